"""An LMCache tier's chunk files kept on disk while the scan judges them, not as a Python
record each (a `TierFile` with its head took ~2.6 KB a file, ~6.9 KB a GDS file). The
files go through three kinds of Arrow IPC files in a temporary folder (TMPDIR), as a
Mooncake store's objects do (scan/store_spill.py; what both do: scan/record_spill.py):

    walk        every chunk file in walk order, as the walk reads it, with the bytes of its
                head the verdicts read (`head_read`: a GDS file's 4096, an fs file's 28)
    partitions  the walk's files split by their chunk hash (`part_of`): a chunk's ranks, a
                GDS data file and its sidecar, and the names a chunk's target looks up
                share it, so every verdict and plan that compares files is inside one
    runs        each partition's judged files, sorted by relpath: a deployment's rows are
                the runs merged, a batch of each at a time

The files of no chunk name (temps, foreign files, symlinks) are few: they stay records.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Iterator

import pyarrow as pa
import xxhash

from kvmigrate import scratch
from kvmigrate.families.lmcache import TierFile, head_read
from kvmigrate.formats import lmcache as L
from kvmigrate.scan import record_spill as R

PART_FILES = 1 << 13  # files a partition holds (as records while it is judged), about
WALK_BATCH = 2048  # files per record batch of the walk and partition files (heads: up to ~8 MiB of GDS headers)
RUN_BATCH = 256  # rows per record batch of a run: the merge holds one batch of each run as records

_TEXT = ("relpath", "name", "folders", "kind", "error", "status", "action", "reason", "deployment", "target")
_TYPES = {"size": pa.int64(), "mtime_ns": pa.int64(), "inode": pa.uint64(), "dev": pa.uint64(),
          "nlink": pa.int64(), "ctime_ns": pa.int64(), "rank": pa.int64(), "group": pa.int64(),
          "regular": pa.bool_(), "all_zero": pa.bool_(), "seed_fix": pa.bool_(), "head": pa.binary(),
          "content": pa.binary(), "payload": pa.binary(), "block_hash": pa.binary()}
FIELDS = tuple(f for f in TierFile.__dataclass_fields__ if f != "chunk")  # (re-parsed from the name)
CODEC = R.Codec(FIELDS, _TEXT, _TYPES)
SCHEMA = CODEC.schema
_FOLDERS = FIELDS.index("folders")
assert FIELDS[-1] == "target" and FIELDS[-2] == "block_hash"


def part_of(f: TierFile) -> int:
    """The hash a chunk file is partitioned by: its block hash (what the plan groups a
    chunk's ranks by), else its name's hash text; a target name keeps the hash text, so it
    lands with its source."""
    if f.block_hash is not None:
        return xxhash.xxh3_64_intdigest(f.block_hash)
    assert f.chunk is not None
    return xxhash.xxh3_64_intdigest(b"\0" + f.chunk.key.hash.encode("utf-8", "surrogatepass"))


def encode(files: list[TierFile], ordinals: list[int], parts: list[int] | None = None) -> pa.RecordBatch:
    """Records as a batch of SCHEMA (`parts`: their partition hashes, else 0)."""
    columns = CODEC.columns(files)
    columns[_FOLDERS] = ["/".join(v) for v in columns[_FOLDERS]]
    return CODEC.encode(columns, ordinals, parts)


def decode(batch: pa.RecordBatch, parse: bool = True) -> tuple[list[int], list[TierFile]]:
    """(ordinals, records) of a batch; `parse`: each chunk name parsed again (the verdicts
    read it, the rows do not)."""
    ordinals, cols = CODEC.decode(batch)
    cols[_FOLDERS] = [tuple(v.split("/")) if v else () for v in cols[_FOLDERS]]
    out = []
    for row in zip(*cols):
        f = TierFile(*row[:-1])  # (`chunk` stands before `target`: FIELDS end with target)
        f.target = row[-1]
        if parse:
            f.chunk = L.parse_name(f.name)
        out.append(f)
    return ordinals, out


SPILL = scratch.Kind("scan-tier", "the scan's temporary files of an LMCache tier",
                     "a tier's chunk files take their headers, ~150 bytes each, there while it is scanned")


class FileSpill(R.WalkSpill):
    """The chunk files of one tier, in walk order, as the walk hands them over (`append`);
    then split into partitions (`partition`) read back one at a time (`partitions`)."""

    def __init__(self, folder: scratch.Folder) -> None:
        super().__init__(folder, CODEC)
        self.pending: list[TierFile] = []
        self.first = 0

    def append(self, f: TierFile) -> None:
        """A chunk file after `TierJudge.add`, its head cut to what the verdicts read."""
        assert f.chunk is not None
        keep = head_read(f.chunk)
        if f.head is not None and keep is not None and len(f.head) > keep:
            f.head = f.head[:keep]
        self.pending.append(f)
        self.count += 1
        if len(self.pending) >= WALK_BATCH:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        files = self.pending
        self.write(encode(files, list(range(self.first, self.first + len(files))), [part_of(f) for f in files]))
        self.first += len(files)
        self.pending = []

    def partition(self) -> None:
        """Split the files into partitions of about PART_FILES each."""
        self._flush()
        self.split(PART_FILES)

    def partitions(self) -> Iterator[tuple[list[int], list[TierFile]]]:
        """Each partition's (ordinals, files), in walk order."""
        return self.read(decode)


class Runs(R.Runs):
    """The judged files of a tier, a run a partition, each sorted by relpath; per
    deployment how many files it has."""

    def __init__(self, folder: scratch.Folder) -> None:
        super().__init__(folder, encode, CODEC.writer)

    def write(self, files: list[TierFile]) -> None:
        for f in files:
            f.head = None  # (the rows do not keep it)
        self.add(sorted(files, key=_relpath), RUN_BATCH)

    def rows(self, label: str) -> Iterator[TierFile]:
        """The files of one deployment, in relpath order."""
        yield from heapq.merge(*self.streams(label, lambda b: decode(b, parse=False)[1]), key=_relpath)


_relpath = operator.attrgetter("relpath")
