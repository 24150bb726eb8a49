"""What the Mooncake store's spill (scan/store_spill.py) and the LMCache tier's
(scan/tier_spill.py) share: records as the columns of Arrow IPC files in a working folder
(`Codec`), the walk's file split into partitions read back one at a time (`WalkSpill`),
and each partition's judged records written as a sorted run, the runs read back merged
(`Runs`). Each spill says only what differs: its record class, its partition hash, the
order of its rows and its batch sizes.
"""

from __future__ import annotations

import contextlib
import operator
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from kvmigrate import findings as fd
from kvmigrate import scratch

MAX_PARTS = 256  # open files while partitioning (a partition grows past its size to stay under it)

_FINDING_INTS = {"primary_rank", "cell_bytes", "row_cells", "output_bytes"}
_FINDING = tuple(f"finding_{name}" for name in fd.Finding._fields)
# the columns a spilled record ends with: its reason's finding, its walk ordinal, its partition hash
TAIL = ([(c, pa.int64() if c[len("finding_"):] in _FINDING_INTS else pa.binary()) for c in _FINDING] +
        [("ordinal", pa.int64()), ("part", pa.uint64())])
_OPTIONS = pa.ipc.IpcWriteOptions(compression="lz4")  # (keys, paths and reasons repeat: a third of the bytes)


def utf8(value: Any) -> bytes | None:
    """A text as UTF-8 bytes with its surrogate escapes, as a file name may hold them."""
    return None if value is None else str(value).encode("utf-8", "surrogatepass")


def texts(col: pa.Array) -> list[Any]:
    """A text column as str, one object per distinct value of the batch (a meta's relpath,
    a deployment's reason: shared as the records the walk made share them)."""
    d = col.dictionary_encode()
    values = [None if v is None else v.decode("utf-8", "surrogatepass") for v in d.dictionary.to_pylist()]
    return [None if i is None else values[i] for i in d.indices.to_pylist()]


def record_tail(reasons: list[Any], ordinals: list[int], parts: list[int] | None) -> list[pa.Array]:
    """The columns of TAIL: the reasons' findings, the walk ordinals and the partition
    hashes (else 0)."""
    found = [fd.finding_of(r) for r in reasons]
    arrays = []
    for k, c in enumerate(_FINDING):
        got = [None if x is None else x[k] for x in found]
        arrays.append(pa.array(got, pa.int64()) if c[len("finding_"):] in _FINDING_INTS else
                      pa.array([utf8(v) for v in got], pa.binary()))
    arrays.append(pa.array(ordinals, pa.int64()))
    arrays.append(pa.array(parts if parts is not None else [0] * len(reasons), pa.uint64()))
    return arrays


def with_findings(batch: pa.RecordBatch, reasons: list[Any]) -> None:
    """A batch's reasons given back their findings (`record_tail`'s columns), in place."""
    if batch.column("finding_code").null_count < batch.num_rows:  # (a reason with a finding: its text carries it)
        parts = [(texts(batch.column(c)) if c[len("finding_"):] not in _FINDING_INTS else
                  batch.column(c).to_pylist()) for c in _FINDING]
        for k, values in enumerate(zip(*parts)):
            if values[0] is not None:
                reasons[k] = fd.Reason(reasons[k], fd.Finding(*values))


class Codec:
    """A record class's fields as the columns of a spill's files (`SCHEMA`), then TAIL's: a
    field of `text` as `utf8` bytes, the others of their type in `types`."""

    def __init__(self, fields: tuple[str, ...], text: tuple[str, ...], types: dict[str, pa.DataType]) -> None:
        self.fields, self.text, self.types = fields, text, types
        self.values_of = operator.attrgetter(*fields)
        self.reason = fields.index("reason")
        self.schema = pa.schema([(name, pa.binary() if name in text else types[name]) for name in fields] + TAIL)

    def writer(self, path: str) -> scratch.IpcWriter:
        """A new file of the schema."""
        return scratch.IpcWriter(path, self.schema, _OPTIONS)

    def columns(self, records: Sequence[Any]) -> list[Sequence[Any]]:
        """The records' fields, a sequence a field."""
        return list(zip(*map(self.values_of, records))) or [() for _ in self.fields]

    def encode(self, columns: list[Sequence[Any]], ordinals: list[int], parts: list[int] | None = None
               ) -> pa.RecordBatch:
        """Fields (`columns`' order) as a batch of the schema (`parts`: the partition hashes, else 0)."""
        arrays = [pa.array([utf8(v) for v in values], pa.binary()) if name in self.text else
                  pa.array(values, self.types[name]) for name, values in zip(self.fields, columns)]
        arrays += record_tail(list(columns[self.reason]), ordinals, parts)
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)

    def decode(self, batch: pa.RecordBatch) -> tuple[list[int], list[list[Any]]]:
        """(ordinals, the fields a list each) of a batch, the reasons with their findings."""
        cols = [(texts(batch.column(name)) if name in self.text else batch.column(name).to_pylist())
                for name in self.fields]
        with_findings(batch, cols[self.reason])
        return batch.column("ordinal").to_pylist(), cols


def split(folder: scratch.Folder, path: str, n: int, writer: Callable[[str], scratch.IpcWriter]) -> list[str]:
    """The records of the walk file `path` split into `n` partition files by their `part`
    column (hash mod n), each in walk order; the walk file is removed. `writer(path)`: a
    partition file's IpcWriter (the spill's schema)."""
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


class WalkSpill:
    """A spill's records in walk order, written a batch at a time as the walk hands them
    over (`write`); then split into partitions (`split`) read back one at a time (`read`)."""

    def __init__(self, folder: scratch.Folder, codec: Codec) -> None:
        self.folder, self.codec = folder, codec
        self.path = folder.file("walk")
        self.count = 0  # (the records added: the spill's own count, which partitions go by)
        self.writer: scratch.IpcWriter | None = None
        self.parts: list[str] = []

    def write(self, batch: pa.RecordBatch) -> None:
        if self.writer is None:
            self.writer = self.codec.writer(self.path)
        self.writer.write(batch)

    def split(self, size: int) -> None:
        """Split the records written into partitions of about `size` each (the walk file
        itself where one will do)."""
        if self.writer is None:
            return
        self.writer.close()
        n = min(-(-self.count // size), MAX_PARTS)
        if n <= 1:
            self.parts = [self.path]
            return
        self.parts = split(self.folder, self.path, n, self.codec.writer)

    def remove(self) -> None:
        """Remove the walk file and its partitions once judged (the runs hold what is written)."""
        for p in {self.path, *self.parts}:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        self.parts = []

    def read(self, decode: Callable[[pa.RecordBatch], tuple[list[int], list[Any]]]) -> Iterator[tuple[list[int], list[Any]]]:
        """Each partition's (ordinals, records), as `decode` makes them of its batches."""
        for path in self.parts:
            ordinals: list[int] = []
            records: list[Any] = []
            for b in scratch.batches(path):
                k, got = decode(b)
                ordinals += k
                records += got
            yield ordinals, records


class Runs:
    """A spill's judged records, a run a partition, each sorted by the spill's row order
    (`add`); per deployment how many records they hold, and each run's records of one
    deployment read back a batch at a time (`streams`), for the spill to merge."""

    def __init__(self, folder: scratch.Folder, encode: Callable[[list[Any], list[int]], pa.RecordBatch],
                 writer: Callable[[str], scratch.IpcWriter]) -> None:
        self.folder, self.encode, self.writer = folder, encode, writer
        self.paths: list[str] = []
        self.counts: dict[str, int] = {}

    def add(self, ordered: list[Any], batch: int) -> None:
        """One run of records in row order, `batch` rows a record batch (the merge holds
        one batch of each run as records)."""
        path = self.folder.file("run")
        w = self.writer(path)
        try:
            for i in range(0, len(ordered), batch):
                chunk = ordered[i:i + batch]
                w.write(self.encode(chunk, [0] * len(chunk)))
        finally:
            w.close()
        self.paths.append(path)
        for r in ordered:
            label = r.deployment or ""
            self.counts[label] = self.counts.get(label, 0) + 1

    def streams(self, label: str, decode: Callable[[pa.RecordBatch], Iterable[Any]]) -> list[Iterator[Any]]:
        """Each run's records of deployment `label`, as `decode` makes them (none where the
        runs hold none of it)."""
        if not self.counts.get(label):
            return []
        want = pa.scalar(utf8(label), pa.binary())

        def run(path: str) -> Iterator[Any]:
            for b in scratch.batches(path):
                b = b.filter(pc.equal(b.column("deployment"), want))
                if b.num_rows:
                    yield from decode(b)

        return [run(p) for p in self.paths]
