"""An LMCache tier's chunk files kept on disk while the scan judges them, not as a Python
record each (a `TierFile` with its head took ~2.6 KB a file, ~6.9 KB a GDS file). The
files go through three kinds of Arrow IPC files in a temporary folder (TMPDIR), as a
Mooncake store's objects do (scan/store_spill.py):

    walk        every chunk file in walk order, with its head, as the walk reads it
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
import pyarrow.compute as pc
import xxhash

from kvmigrate import scratch
from kvmigrate.families.lmcache import TierFile
from kvmigrate.formats import lmcache as L
from kvmigrate.scan.store_spill import _FINDING, _FINDING_INTS, _texts, _utf8, record_tail, remove_files, split, with_findings

PART_FILES = 1 << 13  # files a partition holds (as records while it is judged), about
MAX_PARTS = 256  # open files while partitioning (a partition grows past PART_FILES to stay under it)
WALK_BATCH = 2048  # files per record batch of the walk and partition files (heads: up to 16 MiB)
RUN_BATCH = 256  # rows per record batch of a run: the merge holds one batch of each run as records

_TEXT = ("relpath", "name", "folders", "kind", "error", "status", "action", "reason", "deployment", "target")
_TYPES = {"size": pa.int64(), "mtime_ns": pa.int64(), "inode": pa.uint64(), "dev": pa.uint64(),
          "nlink": pa.int64(), "ctime_ns": pa.int64(), "rank": pa.int64(), "group": pa.int64(),
          "regular": pa.bool_(), "all_zero": pa.bool_(), "seed_fix": pa.bool_(), "head": pa.binary(),
          "content": pa.binary(), "payload": pa.binary(), "block_hash": pa.binary()}
FIELDS = tuple(f for f in TierFile.__dataclass_fields__ if f != "chunk")  # (re-parsed from the name)
_FIELDS_OF = operator.attrgetter(*FIELDS)
SCHEMA = pa.schema([(name, pa.binary() if name in _TEXT else _TYPES[name]) for name in FIELDS] +
                   [(c, pa.int64() if c[len("finding_"):] in _FINDING_INTS else pa.binary()) for c in _FINDING] +
                   [("ordinal", pa.int64()), ("part", pa.uint64())])
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
    arrays = []
    columns = list(zip(*map(_FIELDS_OF, files))) or [() for _ in FIELDS]
    for name, values in zip(FIELDS, columns):
        if name == "folders":
            arrays.append(pa.array([_utf8("/".join(v)) for v in values], pa.binary()))
        elif name in _TEXT:
            arrays.append(pa.array([_utf8(v) for v in values], pa.binary()))
        else:
            arrays.append(pa.array(values, _TYPES[name]))
    arrays += record_tail([f.reason for f in files], ordinals, parts)
    return pa.RecordBatch.from_arrays(arrays, schema=SCHEMA)


def decode(batch: pa.RecordBatch, parse: bool = True) -> tuple[list[int], list[TierFile]]:
    """(ordinals, records) of a batch; `parse`: each chunk name parsed again (the verdicts
    read it, the rows do not)."""
    cols = [(_texts(batch.column(name)) if name in _TEXT else batch.column(name).to_pylist()) for name in FIELDS]
    cols[_FOLDERS] = [tuple(v.split("/")) if v else () for v in cols[_FOLDERS]]
    with_findings(batch, cols[FIELDS.index("reason")])
    out = []
    for row in zip(*cols):
        f = TierFile(*row[:-1])  # (`chunk` stands before `target`: FIELDS end with target)
        f.target = row[-1]
        if parse:
            f.chunk = L.parse_name(f.name)
        out.append(f)
    return batch.column("ordinal").to_pylist(), out


SPILL = scratch.Kind("scan-tier", "the scan's temporary files of an LMCache tier",
                     "a tier's files take their first bytes (up to 8 KiB) each there while it is scanned")


_OPTIONS = pa.ipc.IpcWriteOptions(compression="lz4")


def _writer(path: str) -> scratch.IpcWriter:
    return scratch.IpcWriter(path, SCHEMA, _OPTIONS)


class FileSpill:
    """The chunk files of one tier, in walk order, as the walk hands them over (`append`);
    then split into partitions (`partition`) read back one at a time (`partitions`)."""

    def __init__(self, folder: scratch.Folder) -> None:
        self.folder = folder
        self.path = folder.file("walk")
        self.count = 0
        self.pending: list[TierFile] = []
        self.first = 0
        self.writer: scratch.IpcWriter | None = None
        self.parts: list[str] = []

    def append(self, f: TierFile) -> None:
        self.pending.append(f)
        self.count += 1
        if len(self.pending) >= WALK_BATCH:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        if self.writer is None:
            self.writer = _writer(self.path)
        files = self.pending
        self.writer.write(encode(files, list(range(self.first, self.first + len(files))), [part_of(f) for f in files]))
        self.first += len(files)
        self.pending = []

    def partition(self) -> None:
        """Split the files into partitions of about PART_FILES each."""
        self._flush()
        if self.writer is None:
            return
        self.writer.close()
        n = min(-(-self.count // PART_FILES), MAX_PARTS)
        if n <= 1:
            self.parts = [self.path]
            return
        self.parts = split(self.folder, self.path, n, _writer)

    def remove(self) -> None:
        """Remove the files' records once judged (the runs hold what is written)."""
        remove_files(self.path, self.parts)
        self.parts = []

    def partitions(self) -> Iterator[tuple[list[int], list[TierFile]]]:
        """Each partition's (ordinals, files), in walk order."""
        for path in self.parts:
            ordinals: list[int] = []
            files: list[TierFile] = []
            for b in scratch.batches(path):
                k, got = decode(b)
                ordinals += k
                files += got
            yield ordinals, files


class Runs:
    """The judged files of a tier, a run a partition, each sorted by relpath; per
    deployment how many files it has."""

    def __init__(self, folder: scratch.Folder) -> None:
        self.folder = folder
        self.paths: list[str] = []
        self.counts: dict[str, int] = {}

    def write(self, files: list[TierFile]) -> None:
        ordered = sorted(files, key=_relpath)
        path = self.folder.file("run")
        w = _writer(path)
        try:
            for i in range(0, len(ordered), RUN_BATCH):
                chunk = ordered[i:i + RUN_BATCH]
                for f in chunk:
                    f.head = None  # (the rows do not keep it)
                w.write(encode(chunk, [0] * len(chunk)))
        finally:
            w.close()
        self.paths.append(path)
        for f in ordered:
            label = f.deployment or ""
            self.counts[label] = self.counts.get(label, 0) + 1

    def rows(self, label: str) -> Iterator[TierFile]:
        """The files of one deployment, in relpath order."""
        if not self.counts.get(label):
            return
        want = pa.scalar(_utf8(label), pa.binary())

        def run(path: str) -> Iterator[TierFile]:
            for b in scratch.batches(path):
                b = b.filter(pc.equal(b.column("deployment"), want))
                if b.num_rows:
                    yield from decode(b, parse=False)[1]

        yield from heapq.merge(*(run(p) for p in self.paths), key=_relpath)


_relpath = operator.attrgetter("relpath")
