"""A Mooncake store's objects kept on disk while the scan judges them, not as a Python
record each: a store of 10M objects took ~860 B an object as `StoreFile`s. The objects
go through three kinds of Arrow IPC files in a temporary folder (TMPDIR):

    walk        every object (and KVEntry) in walk order, as the scan reads the indexes
    partitions  the walk's objects split by the hash of their block (`part`), so that the
                objects a verdict compares (a block's key ranks, the entries of one key, a
                target key and its holders) are in one partition, which is judged at once
    runs        each partition's judged objects, sorted by (relpath, index): the rows of a
                namespace are the runs merged, a batch of each at a time

A store's folder is removed when its rows are dropped, or at exit; one of a scan killed
by a signal it cannot handle is removed by the next command that makes such a folder
(kvmigrate/scratch.py).
"""

from __future__ import annotations

import contextlib
import heapq
import operator
import os
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from kvmigrate import findings as fd
from kvmigrate import scratch
from kvmigrate.families import mooncake as MC
from kvmigrate.formats import mooncake as M

StoreFile = MC.StoreFile
Part = MC.Part
PART_OBJECTS = 1 << 13  # objects a partition holds (as records while it is judged), about
MAX_PARTS = 256  # open files while partitioning (a partition grows past PART_OBJECTS to stay under it)
ENTRY_ORDINALS = 1 << 40  # a KVEntry's walk ordinal: after every object of its store (fewer than this)
WALK_BATCH = 4096  # objects per record batch of the walk and partition files
RUN_BATCH = 128  # rows per record batch of a run: the merge holds one batch of each run as records

# StoreFile's fields as columns, in its field order (`block` and `key_rank` are the verdicts'
# own, never kept); a text is UTF-8 bytes with its surrogate escapes, as a file name may be
_TEXT = ("relpath", "client", "kind", "entry", "error", "status", "action", "reason", "deployment", "target")
_TYPES = {"size": pa.int64(), "mtime_ns": pa.int64(), "inode": pa.uint64(), "dev": pa.uint64(),
          "nlink": pa.int64(), "ctime_ns": pa.int64(), "value_size": pa.int64(), "rank": pa.int64(),
          "group": pa.int64(), "object_index": pa.int64(), "value_offset": pa.int64(),
          "regular": pa.bool_(), "all_zero": pa.bool_(), "top": pa.bool_(), "depth3": pa.bool_(),
          "duplicate": pa.bool_(), "mla": pa.bool_(), "data": pa.binary(), "content": pa.binary(),
          "payload": pa.binary(), "block_hash": pa.binary(), "object_key": pa.binary(), "target_key": pa.binary()}
FIELDS = tuple(f for f in StoreFile.__dataclass_fields__ if f not in ("block", "key_rank"))
_FIELDS_OF = operator.attrgetter(*FIELDS)
_FINDING_INTS = {"primary_rank", "cell_bytes", "row_cells", "output_bytes"}
_FINDING = tuple(f"finding_{name}" for name in fd.Finding._fields)
SCHEMA = pa.schema([(name, pa.binary() if name in _TEXT else _TYPES[name]) for name in FIELDS] +
                   [(c, pa.int64() if c[len("finding_"):] in _FINDING_INTS else pa.binary()) for c in _FINDING] +
                   [("ordinal", pa.int64()), ("part", pa.uint64())])


def _utf8(value: Any) -> bytes | None:
    return None if value is None else str(value).encode("utf-8", "surrogatepass")


def _texts(col: pa.Array) -> list[Any]:
    """A text column as str, one object per distinct value of the batch (a meta's relpath,
    a deployment's reason: shared as the records the walk made share them)."""
    d = col.dictionary_encode()
    values = [None if v is None else v.decode("utf-8", "surrogatepass") for v in d.dictionary.to_pylist()]
    return [None if i is None else values[i] for i in d.indices.to_pylist()]


def part_of(o: StoreFile) -> int:
    """The hash an object is partitioned by: its block's (an engine key's hash, which its
    target keys keep), else the key it registers."""
    sk = M.parse_storage_key(o.object_key or b"")
    ek = MC.parse_engine_key(sk.engine)
    basis = ek.hash.encode("utf-8", "surrogatepass") if ek is not None else MC.registered_key(o)
    return xxhash.xxh3_64_intdigest(basis)


def record_tail(reasons: list[Any], ordinals: list[int], parts: list[int] | None) -> list[pa.Array]:
    """The columns a spilled record ends with: its reason's finding (the _FINDING columns),
    its walk ordinal and its partition hash (else 0). Also the tier spill's."""
    found = [fd.finding_of(r) for r in reasons]
    arrays = []
    for k, c in enumerate(_FINDING):
        got = [None if x is None else x[k] for x in found]
        arrays.append(pa.array(got, pa.int64()) if c[len("finding_"):] in _FINDING_INTS else
                      pa.array([_utf8(v) for v in got], pa.binary()))
    arrays.append(pa.array(ordinals, pa.int64()))
    arrays.append(pa.array(parts if parts is not None else [0] * len(reasons), pa.uint64()))
    return arrays


def with_findings(batch: pa.RecordBatch, reasons: list[Any]) -> None:
    """A batch's reasons given back their findings (`record_tail`'s columns), in place."""
    if batch.column("finding_code").null_count < batch.num_rows:  # (a reason with a finding: its text carries it)
        parts = [(_texts(batch.column(c)) if c[len("finding_"):] not in _FINDING_INTS else
                  batch.column(c).to_pylist()) for c in _FINDING]
        for k, values in enumerate(zip(*parts)):
            if values[0] is not None:
                reasons[k] = fd.Reason(reasons[k], fd.Finding(*values))


def encode(files: list[StoreFile], ordinals: list[int], parts: list[int] | None = None) -> pa.RecordBatch:
    """Records as a batch of SCHEMA (`parts`: their partition hashes, else 0)."""
    arrays = []
    columns = list(zip(*map(_FIELDS_OF, files))) or [() for _ in FIELDS]
    for name, values in zip(FIELDS, columns):
        if name in _TEXT:
            arrays.append(pa.array([_utf8(v) for v in values], pa.binary()))
        else:
            arrays.append(pa.array(values, _TYPES[name]))
    arrays += record_tail([f.reason for f in files], ordinals, parts)
    return pa.RecordBatch.from_arrays(arrays, schema=SCHEMA)


def decode(batch: pa.RecordBatch) -> tuple[list[int], list[StoreFile]]:
    """(ordinals, records) of a batch."""
    cols = [(_texts(batch.column(name)) if name in _TEXT else batch.column(name).to_pylist()) for name in FIELDS]
    n = batch.num_rows
    with_findings(batch, cols[FIELDS.index("reason")])
    blocks, ranks = [None] * n, [()] * n
    return batch.column("ordinal").to_pylist(), [StoreFile(*row) for row in zip(*cols, blocks, ranks)]


SPILL = scratch.Kind("scan-store", "the scan's temporary files of a Mooncake store",
                     "a store's objects take ~500 bytes each there while it is scanned")


_OPTIONS = pa.ipc.IpcWriteOptions(compression="lz4")  # (keys, paths and reasons repeat: a third of the bytes)


def _writer(path: str) -> scratch.IpcWriter:
    return scratch.IpcWriter(path, SCHEMA, _OPTIONS)


def split(folder: Any, path: str, n: int, writer: Any) -> list[str]:
    """The records of the walk file `path` split into `n` partition files by their `part`
    column (hash mod n), each in walk order; the walk file is removed. `writer(path)`: a
    partition file's IpcWriter (the spill's schema). Also the tier spill's (scan/tier_spill.py)."""
    paths = [folder.file(f"part{p}") for p in range(n)]
    writers = [writer(p) for p in paths]
    try:
        for b in scratch.batches(path):
            which = [h % n for h in b.column("part").to_pylist()]
            b = b.take(pc.sort_indices(pa.array(which, pa.int32())))  # (stable: walk order kept)
            counts = [0] * n
            for p in which:
                counts[p] += 1
            start = 0
            for p, count in enumerate(counts):
                if count:
                    writers[p].write(b.slice(start, count))
                start += count
    finally:
        for w in writers:
            w.close()
    os.unlink(path)
    return paths


def remove_files(path: str, parts: list[str]) -> None:
    """The walk file and its partitions, once judged (the runs hold what is written)."""
    for p in {path, *parts}:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


class ObjectSpill:
    """The objects of one store, in walk order, as the walk hands them over (`add`); then
    split into partitions (`partitions`) that are read back one at a time (`load`)."""

    def __init__(self, folder: scratch.Folder) -> None:
        self.folder = folder
        self.path = folder.file("walk")
        self.count = 0
        self.pending: list[tuple[int, StoreFile]] = []
        self.writer: scratch.IpcWriter | None = None
        self.parts: list[str] = []

    def add(self, objs: Iterable[StoreFile], ordinal: int | None = None) -> None:
        """Objects that follow the ones added (`ordinal`: the first one's place in walk order)."""
        for o in objs:
            self.pending.append((self.count if ordinal is None else ordinal, o))
            self.count += 1
            if ordinal is not None:
                ordinal += 1
        if len(self.pending) >= WALK_BATCH:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        if self.writer is None:
            self.writer = _writer(self.path)
        files = [o for _, o in self.pending]
        self.writer.write(encode(files, [k for k, _ in self.pending], [part_of(o) for o in files]))
        self.pending = []

    def partition(self) -> None:
        """Split the objects into partitions of about PART_OBJECTS each."""
        self._flush()
        if self.writer is None:
            return
        self.writer.close()
        n = -(-self.count // PART_OBJECTS)
        n = min(n, MAX_PARTS)
        if n <= 1:
            self.parts = [self.path]
            return
        self.parts = split(self.folder, self.path, n, _writer)

    def remove(self) -> None:
        """Remove the objects' files once judged (the runs hold what is written)."""
        remove_files(self.path, self.parts)
        self.parts = []

    def partitions(self) -> Iterator[Part]:
        """Each partition's (ordinals, objects), in walk order (a client root's KVEntries
        were added before its objects: their ordinals put them after)."""
        for path in self.parts:
            ordinals: list[int] = []
            objs: list[StoreFile] = []
            for b in scratch.batches(path):
                k, got = decode(b)
                ordinals += k
                objs += got
            if any(a > b for a, b in zip(ordinals, ordinals[1:])):
                order = sorted(range(len(ordinals)), key=ordinals.__getitem__)
                ordinals, objs = [ordinals[i] for i in order], [objs[i] for i in order]
            yield ordinals, objs


class Runs:
    """The judged objects of a store, a run a partition, each sorted by (relpath, index);
    per namespace (its `deployment`) how many objects it has."""

    def __init__(self, folder: scratch.Folder) -> None:
        self.folder = folder
        self.paths: list[str] = []
        self.counts: dict[str, int] = {}

    def write(self, objs: list[StoreFile]) -> None:
        ordered = sorted(objs, key=row_order)
        path = self.folder.file("run")
        w = _writer(path)
        try:
            for i in range(0, len(ordered), RUN_BATCH):
                chunk = ordered[i:i + RUN_BATCH]
                w.write(encode(chunk, [0] * len(chunk)))
        finally:
            w.close()
        self.paths.append(path)
        for o in ordered:
            label = o.deployment or ""
            self.counts[label] = self.counts.get(label, 0) + 1

    def rows(self, label: str, files: list[StoreFile]) -> Iterator[StoreFile]:
        """The objects of one namespace and its `files`, in (relpath, index) order."""
        want = pa.scalar(_utf8(label), pa.binary())

        def run(path: str) -> Iterator[StoreFile]:
            for b in scratch.batches(path):
                b = b.filter(pc.equal(b.column("deployment"), want))
                if b.num_rows:
                    yield from decode(b)[1]

        streams = [run(p) for p in self.paths] if self.counts.get(label) else []
        yield from heapq.merge(sorted(files, key=row_order), *streams, key=row_order)


def row_order(f: StoreFile) -> tuple[str, int]:
    """A row's place among its namespace's: by relpath, a file before its objects."""
    return f.relpath, -1 if f.object_index is None else f.object_index
