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

import heapq
from collections.abc import Iterable, Iterator

import pyarrow as pa
import xxhash

from kvmigrate import scratch
from kvmigrate.families import mooncake as MC
from kvmigrate.formats import mooncake as M
from kvmigrate.scan import record_spill as R

StoreFile = MC.StoreFile
Part = MC.Part
PART_OBJECTS = 1 << 13  # objects a partition holds (as records while it is judged), about
ENTRY_ORDINALS = 1 << 40  # a KVEntry's walk ordinal: after every object of its store (fewer than this)
WALK_BATCH = 4096  # objects per record batch of the walk and partition files
RUN_BATCH = 128  # rows per record batch of a run: the merge holds one batch of each run as records

# StoreFile's fields as columns, in its field order (`block` and `key_rank` are the verdicts'
# own, never kept)
_TEXT = ("relpath", "client", "kind", "entry", "error", "status", "action", "reason", "deployment", "target")
_TYPES = {"size": pa.int64(), "mtime_ns": pa.int64(), "inode": pa.uint64(), "dev": pa.uint64(),
          "nlink": pa.int64(), "ctime_ns": pa.int64(), "value_size": pa.int64(), "rank": pa.int64(),
          "group": pa.int64(), "object_index": pa.int64(), "value_offset": pa.int64(),
          "regular": pa.bool_(), "all_zero": pa.bool_(), "top": pa.bool_(), "depth3": pa.bool_(),
          "duplicate": pa.bool_(), "mla": pa.bool_(), "data": pa.binary(), "content": pa.binary(),
          "payload": pa.binary(), "block_hash": pa.binary(), "object_key": pa.binary(), "target_key": pa.binary()}
FIELDS = tuple(f for f in StoreFile.__dataclass_fields__ if f not in ("block", "key_rank"))
CODEC = R.Codec(FIELDS, _TEXT, _TYPES)
SCHEMA = CODEC.schema


def part_of(o: StoreFile) -> int:
    """The hash an object is partitioned by: its block's (an engine key's hash, which its
    target keys keep), else the key it registers."""
    sk = M.parse_storage_key(o.object_key or b"")
    ek = MC.parse_engine_key(sk.engine)
    basis = ek.hash.encode("utf-8", "surrogatepass") if ek is not None else MC.registered_key(o)
    return xxhash.xxh3_64_intdigest(basis)


def encode(files: list[StoreFile], ordinals: list[int], parts: list[int] | None = None) -> pa.RecordBatch:
    """Records as a batch of SCHEMA (`parts`: their partition hashes, else 0)."""
    return CODEC.encode(CODEC.columns(files), ordinals, parts)


def decode(batch: pa.RecordBatch) -> tuple[list[int], list[StoreFile]]:
    """(ordinals, records) of a batch."""
    ordinals, cols = CODEC.decode(batch)
    n = batch.num_rows
    blocks, ranks = [None] * n, [()] * n
    return ordinals, [StoreFile(*row) for row in zip(*cols, blocks, ranks)]


SPILL = scratch.Kind("scan-store", "the scan's temporary files of a Mooncake store",
                     "a store's objects take ~500 bytes each there while it is scanned")


class ObjectSpill(R.WalkSpill):
    """The objects of one store, in walk order, as the walk hands them over (`add`); then
    split into partitions (`partitions`) that are read back one at a time (`load`)."""

    def __init__(self, folder: scratch.Folder) -> None:
        super().__init__(folder, CODEC)
        self.pending: list[tuple[int, StoreFile]] = []

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
        files = [o for _, o in self.pending]
        self.write(encode(files, [k for k, _ in self.pending], [part_of(o) for o in files]))
        self.pending = []

    def partition(self) -> None:
        """Split the objects into partitions of about PART_OBJECTS each."""
        self._flush()
        self.split(PART_OBJECTS)

    def partitions(self) -> Iterator[Part]:
        """Each partition's (ordinals, objects), in walk order (a client root's KVEntries
        were added before its objects: their ordinals put them after)."""
        for ordinals, objs in self.read(decode):
            if any(a > b for a, b in zip(ordinals, ordinals[1:])):
                order = sorted(range(len(ordinals)), key=ordinals.__getitem__)
                ordinals, objs = [ordinals[i] for i in order], [objs[i] for i in order]
            yield ordinals, objs


class Runs(R.Runs):
    """The judged objects of a store, a run a partition, each sorted by (relpath, index);
    per namespace (its `deployment`) how many objects it has."""

    def __init__(self, folder: scratch.Folder) -> None:
        super().__init__(folder, encode, CODEC.writer)

    def write(self, objs: list[StoreFile]) -> None:
        self.add(sorted(objs, key=row_order), RUN_BATCH)

    def rows(self, label: str, files: list[StoreFile]) -> Iterator[StoreFile]:
        """The objects of one namespace and its `files`, in (relpath, index) order."""
        streams = self.streams(label, lambda b: decode(b)[1])
        yield from heapq.merge(sorted(files, key=row_order), *streams, key=row_order)


def row_order(f: StoreFile) -> tuple[str, int]:
    """A row's place among its namespace's: by relpath, a file before its objects."""
    return f.relpath, -1 if f.object_index is None else f.object_index
