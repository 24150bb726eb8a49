"""The block rows of a manifest for the planner, read one chunk of `<hhh>` buckets at a time.

All rows of a block (its rank files, its replicas, the merge sources of its target path)
share the bucket of its hash, so a chunk of consecutive buckets holds whole blocks and
the plan's memory is bounded by the chunk size, not by the manifest's.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvmigrate import findings, manifest
from kvmigrate.errors import UsageError
from kvmigrate.migrate.model import CREATING

BUCKETS = 4096
# Row states with the integrity bit (interface.md §2).
INTEGRITY_STATES = frozenset({"replica_mismatch", "size_mismatch", "short", "zero_filled", "misfiled",
                              "header_invalid", "digest_mismatch", "config_invalid", "silent_change"})

_READ_COLUMNS = ("relpath", "source_base", "deployment", "rank", "group", "block_hash", "size", "mtime_ns", "ctime_ns",
                 "nlink", "inode",
                 "dev", "content_xxh3_128", "payload_xxh3_128", "status", "action", "reason", "target_relpath",
                 *findings.COLUMNS)
_BYTES: pa.Array | None = None


def _byte_values() -> pa.Array:
    global _BYTES
    if _BYTES is None:
        _BYTES = pa.array([bytes([i]) for i in range(256)], pa.binary())
    return _BYTES


def _buckets(block_hash: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    """The `<hhh>` bucket (0..4095: the first 12 bits) of every row's block hash; null for
    rows that are not blocks. A block's files and its target path all live in it."""
    values = _byte_values()
    first = pc.fill_null(pc.index_in(pc.binary_slice(block_hash, 0, 1), value_set=values), 0)
    second = pc.fill_null(pc.index_in(pc.binary_slice(block_hash, 1, 2), value_set=values), 0)
    bucket = pc.add(pc.multiply(first, 16), pc.shift_right(second, 4))
    return pc.if_else(pc.is_valid(block_hash), bucket, pa.scalar(None, bucket.type))


def _plain(table: pa.Table) -> pa.Table:
    """Dictionary columns as plain strings (parts of a dataset directory have their own
    dictionaries; row groups are concatenated)."""
    cols = [pc.cast(c, pa.string()) if pa.types.is_dictionary(c.type) else c for c in table.columns]
    return pa.table(cols, names=table.column_names)


def _unreadable(where: str, exc: BaseException) -> UsageError:
    first = str(exc).splitlines()[0] if str(exc) else repr(exc)
    return UsageError(f"cannot read the manifest: {first}", path=where,
                      hint="pass a manifest written by `kvmigrate scan`")


class ManifestRows:
    """The block rows of a manifest (file, dataset directory, or a table in memory),
    handed out one chunk of consecutive buckets at a time.

    A first pass reads three narrow columns: status counts of every row, and each row
    group's bucket range and per-bucket row counts, from which the chunks are cut. A chunk
    then reads the row groups whose bucket range overlaps it (the scanner writes rows in
    bucket order per namespace: a small part of the file) and keeps its rows. The plan
    checks every row once; a file that changes between two reads is refused."""

    _read_errors = (pa.ArrowException, OSError, ValueError, KeyError)

    def __init__(self, path: str | os.PathLike[str] | None, table: pa.Table | None, where: str,
                 chunk_rows: int, sources: Iterable[str] | None = None):
        """`sources`: keep only the rows of these source namespaces (--only/--exclude)."""
        self.where = where
        self._sources = None if sources is None else pa.array(sorted(sources), pa.string())
        self.chunk_rows = chunk_rows
        self.status_counts: Counter = Counter()
        self.placed_integrity_rows = 0  # rows with a creating action and an integrity state
        self._table: pa.Table | None = None
        self._files: list[tuple[Any, str, tuple[int, ...]]] = []  # (ParquetFile, path, stat identity)
        self._parts: list[tuple[int, int, int, int]] = []  # (file, row group, first bucket, last bucket)
        self._cache: tuple[int, pa.Table | None] | None = None
        self.adjust: Any = None  # chunk -> chunk, applied as each is handed out (plan._into_dest)
        hist = [0] * BUCKETS
        try:
            if table is not None:
                cols = [c for c in _READ_COLUMNS if c in table.column_names]
                self._table = self._mine(_plain(table.select(cols)))
                self._table = self._table.append_column("_bucket", _buckets(self._table.column("block_hash")))
                self._survey([self._table], -1, 0, hist)
            elif path is None:
                raise TypeError("rows come from a manifest path or a table")
            else:
                for f in manifest._parquet_files(path):
                    self._files.append((pq.ParquetFile(f), str(f), _identity(f)))
                    pf = self._files[-1][0]
                    for i in range(pf.num_row_groups):
                        self._survey(pf.iter_batches(batch_size=_SURVEY_BATCH, row_groups=[i], use_threads=False,
                                                     columns=["status", "action", "block_hash"]
                                                     + (["source_base"] if self._sources is not None else [])),
                                     len(self._files) - 1, i, hist)
        except (UsageError, PendingRowCheck):
            raise
        except self._read_errors as exc:
            raise _unreadable(where, exc) from None
        self._ranges = _cut(hist, chunk_rows)

    def _survey(self, batches: Iterable[Any], file: int, index: int, hist: list[int]) -> None:
        """Status counts, a bucket histogram and the bucket range of one row group."""
        seen: list[int] = []
        for t in map(self._mine, batches):
            values, counts = _value_counts(pc.cast(t.column("status"), pa.string()))
            self.status_counts.update(dict(zip(values, counts)))
            bh = t.column("block_hash")
            creating = pc.fill_null(pc.is_in(pc.cast(t.column("action"), pa.string()), pa.array(list(CREATING))),
                                    False)
            if pc.any(pc.and_(creating, pc.is_null(bh))).as_py():
                self._orphan_block_row(self._row_group(file, index))
            damaged = pc.is_in(pc.cast(t.column("status"), pa.string()), pa.array(sorted(INTEGRITY_STATES)))
            self.placed_integrity_rows += pc.sum(pc.and_(creating, damaged)).as_py() or 0
            vc = pc.value_counts(_buckets(bh))
            for b, n in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()):
                if b is not None:
                    hist[b] += n
                    seen.append(b)
        if seen and file >= 0:
            self._parts.append((file, index, min(seen), max(seen)))

    def _row_group(self, file: int, index: int) -> pa.Table:
        """All rows of one row group (plain strings)."""
        if file < 0:
            return self._table
        return self._mine(_plain(_read_row_group(self._checked(file), index, list(_READ_COLUMNS))))

    def _checked(self, file: int) -> Any:
        pf, path, ident = self._files[file]
        if _identity(path) != ident:
            raise UsageError("the manifest changed while it was being used (planned from one version, read "
                             "another)", path=path, hint="rerun the command once nothing writes the manifest")
        return pf

    def _split_row_group(self, file: int, index: int, lo: int, hi: int,
                         room: int) -> tuple[list[pa.Table], list[pa.Table] | None]:
        """The rows of one row group in buckets lo..hi, and those of later buckets while
        they fit in `room` rows (None when they do not: read again later). Decoded in
        record batches, so a big row group is never held whole."""
        mine: list[pa.Table] = []
        later: list[pa.Table] | None = []
        for batch in self._checked(file).iter_batches(batch_size=_READ_BATCH, row_groups=[index],
                                                      columns=list(_READ_COLUMNS), use_threads=False):
            t = _in_buckets(self._mine(_plain(pa.Table.from_batches([batch]))), lo, BUCKETS - 1)
            after = pc.greater(t.column("_bucket"), hi)
            mine.append(t.filter(pc.invert(after)))
            if later is not None:
                rest = t.filter(after)
                room -= rest.num_rows
                later = (later + [rest]) if room >= 0 else None
        return mine, later

    def _mine(self, t: Any) -> Any:
        """A table or batch narrowed to the kept source namespaces (all of it without)."""
        if self._sources is None:
            return t
        return t.filter(pc.fill_null(pc.is_in(pc.cast(t.column("source_base"), pa.string()),
                                              value_set=self._sources), False))

    @staticmethod
    def _orphan_block_row(t: pa.Table) -> None:
        """A creating row without a block hash has no bucket: it is refused (like a row
        whose target path does not name its block), never dropped."""
        mask = pc.and_(pc.fill_null(pc.is_in(pc.cast(t.column("action"), pa.string()), pa.array(list(CREATING))),
                                    False), pc.is_null(t.column("block_hash")))
        raise PendingRowCheck(t.filter(mask).slice(0, 1).to_pylist()[0])

    def chunks(self) -> Iterator[pa.Table]:
        """Tables of block rows (plain string columns), one per bucket range, in bucket
        order; the last one read is kept (a one-chunk manifest is read once per plan)."""
        carry: dict[tuple[int, int], pa.Table] = {}
        for k, (lo, hi) in enumerate(self._ranges):
            if self._cache is not None and self._cache[0] == k:
                t = self._cache[1]
            else:
                self._cache = None
                t = self._read(lo, hi, carry)
                self._cache = (k, t)
            if t is not None and t.num_rows:
                yield self.adjust(t) if self.adjust is not None else t

    def _read(self, lo: int, hi: int, carry: dict[tuple[int, int], pa.Table]) -> pa.Table | None:
        """Rows of buckets lo..hi. A row group read for one chunk keeps its rows of later
        buckets for the next chunks (`carry`, at most 2 x chunk_rows rows), so a manifest in
        bucket order is decoded about once per pass; beyond that it is read again."""
        parts = []
        try:
            if self._table is not None:
                parts.append(_in_buckets(self._table, lo, hi))
            for f, i, first, last in self._parts:
                if last < lo or first > hi:
                    continue
                room = 2 * self.chunk_rows - sum(c.num_rows for c in carry.values())
                t = carry.pop((f, i), None)
                if t is None:
                    mine, later = self._split_row_group(f, i, lo, hi, room)
                else:
                    after = pc.greater(t.column("_bucket"), hi)
                    mine, later = [t.filter(pc.invert(after))], [t.filter(after)]
                parts += mine
                later = [x for x in later or () if x.num_rows]
                if later:
                    carry[(f, i)] = later[0] if len(later) == 1 else pa.concat_tables(later)
            parts = [p for p in parts if p.num_rows]
            if not parts:
                return None
            return parts[0] if len(parts) == 1 else pa.concat_tables(parts, promote_options="permissive")
        except UsageError:
            raise
        except self._read_errors as exc:
            raise _unreadable(self.where, exc) from None


_READ_BATCH = 4096  # rows decoded at a time from a row group
_SURVEY_BATCH = 65536  # (three narrow columns)


def _read_row_group(pf: Any, index: int, columns: list[str]) -> pa.Table:
    batches = list(pf.iter_batches(batch_size=_READ_BATCH, row_groups=[index], columns=columns, use_threads=False))
    return pa.Table.from_batches(batches, schema=pf.schema_arrow.select(columns) if not batches else None)


def _in_buckets(t: pa.Table, lo: int, hi: int) -> pa.Table:
    """The rows of buckets lo..hi, with their bucket as column `_bucket`."""
    b = t.column("_bucket") if "_bucket" in t.column_names else _buckets(t.column("block_hash"))
    if "_bucket" not in t.column_names:
        t = t.append_column("_bucket", b)
    return t.filter(pc.fill_null(pc.and_(pc.greater_equal(b, lo), pc.less_equal(b, hi)), False))


def _identity(path: str | os.PathLike[str]) -> tuple[int, ...]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class PendingRowCheck(Exception):
    """Raised by the survey with a row that build_plan must refuse through the row checks."""

    def __init__(self, row: dict[str, Any]):
        self.row = row


def _cut(hist: list[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive bucket ranges holding about `limit` rows each (a bigger bucket alone)."""
    ranges, lo, acc = [], 0, 0
    for b, n in enumerate(hist):
        if acc and acc + n > limit:
            ranges.append((lo, b - 1))
            lo, acc = b, 0
        acc += n
    ranges.append((lo, BUCKETS - 1))
    return ranges


def _value_counts(col: pa.ChunkedArray) -> tuple[list[Any], list[int]]:
    vc = pc.value_counts(col)
    return vc.field("values").to_pylist(), vc.field("counts").to_pylist()
