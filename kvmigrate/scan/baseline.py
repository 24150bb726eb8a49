"""`--baseline PREV`: the previous manifest of this root, so a scheduled `--verify hash`
reads only what changed (fclones' `--cache`, jdupes' hash database).

A file whose dev, inode, size, mtime_ns and ctime_ns equal its baseline row keeps the
baseline's hashes without being opened (ctime cannot be set from user space: a rewrite
that restores size and mtime still moves it). `--recheck F` re-reads a rotating part of
those files anyway, by bucket (int(hhh, 16) % P == slot, P = 1/F, the slot one further
each run), so P runs cover the tree; a hash that changed under unchanged metadata is a
`silent_change` (disk or filesystem corruption).
"""

from __future__ import annotations

import os
import re
import tempfile
from array import array
from bisect import bisect_left, bisect_right
from fractions import Fraction
from functools import lru_cache
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from kvmigrate import manifest, scratch
from kvmigrate.allocator import give_back_freed
from kvmigrate.errors import UsageError
from kvmigrate.history import history_dir, kept_audits

DEFAULT_RECHECK = Fraction(1, 30)
# Rows whose hashes a run never takes over: what the read itself found (a later read may
# find otherwise), and rows the walk could not read or hash.
READ_FINDINGS = frozenset({"short", "zero_filled", "unreadable", "header_invalid", "silent_change"})
_COLUMNS = ("dev", "inode", "size", "mtime_ns", "ctime_ns", "content_xxh3_128", "payload_xxh3_128",
            "status")


def parse_fraction(text: str) -> Fraction:
    """`--recheck F`: 1/30, 0.05, 0 (never) or 1 (every carried file)."""
    try:
        f = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        raise UsageError(f"--recheck must be a fraction between 0 and 1 (e.g. 1/30 or 0.05), got {text!r}") from None
    if not 0 <= f <= 1:
        raise UsageError(f"--recheck must be between 0 and 1, got {text!r}")
    return f


class BaselineRows:
    """Baseline rows sorted by inode, as flat buffers (`stat`: dev, inode, size, mtime_ns,
    ctime_ns, 8 bytes a row each; `content`: 16 bytes a row) that the C walk's
    BlockRows.carry searches without a Python object per row.

    Rows are found by inode, not by path: a file whose dev, inode, size, mtime and ctime
    all equal a row's is that row's file, under whatever name (a hard link of it has the
    same bytes), and a sorted inode column costs 8 bytes a row where a dict of 1M paths
    cost a scan ~700 MB."""

    def __init__(self, columns: Columns):
        self.stat, self.content, self.payload, self.unsupported = columns
        self._stat = [memoryview(b).cast("Q" if k < 2 else "q") for k, b in enumerate(self.stat)]
        self.rows = len(self._stat[1])

    def unchanged(self, dev: int, ino: int, size: int, mtime_ns: int, ctime_ns: int | None) -> int:
        """The baseline row of a file whose stat fields did not change, or -1."""
        d, n, z, m, c = self._stat
        i = bisect_left(n, ino)
        rows = len(n)
        while i < rows and n[i] == ino:
            if d[i] == dev and z[i] == size and m[i] == mtime_ns and c[i] == ctime_ns:
                return i
            i += 1
        return -1

    def hashes(self, i: int) -> tuple[bytes, bytes | None]:
        """(content hash, payload hash or None) of baseline row i."""
        return bytes(self.content[16 * i:16 * i + 16]), self.payload.get(i)

    def was_unsupported(self, i: int) -> bool:
        """Baseline row i's status was unsupported_layout (a flat page's head decided it:
        scan/flat.py shows a carried page the head its unchanged bytes start with)."""
        return self.unsupported[i] == 1


class Baseline(BaselineRows):
    """A previous manifest of this root, checked: the rows whose hashes may be carried
    over. Those of block files (`<rank folder>/<hhh>/<fan-out>/<file>`, nearly all) wait
    in a temporary file by bucket folder (`BucketFiles`), and each bucket's walk reads its
    own (`rows_for`): a file found there under the same bucket folder is the same file,
    since a rename or a new hard link moves its ctime. The other rows (config.json, temp
    files, flat families' pages: few but for the flat families) are held here."""

    def __init__(self, path: str, meta: dict[str, Any], columns: Columns, recheck: Fraction,
                 total: int | None = None, buckets: BucketFiles | None = None):
        super().__init__(columns)
        self.path = path
        self.meta = meta
        self.buckets = buckets
        held = self.rows + (buckets.rows if buckets is not None else 0)
        self.total = held if total is None else total  # (a part's: the whole baseline's rows)
        self.rows = held
        self.recheck = recheck
        self.period = 0 if recheck == 0 else max(1, round(1 / recheck))
        previous = (meta.get("baseline") or {}).get("recheck_slot")
        self.slot = 0 if not self.period or previous is None else (int(previous) + 1) % self.period

    def rows_for(self, relpath: str) -> BaselineRows:
        """The rows a file at `relpath` is looked up in: its bucket folder's, for a block
        file's path (the whole baseline when it is held here)."""
        if self.buckets is not None:
            m = _BUCKET_FOLDER.fullmatch(relpath)
            if m is not None:
                return self.buckets.folder_rows(m.group(1))
        return self

    def bucket_rows(self, folder: str) -> BaselineRows:
        """The rows the files under a bucket folder (`<rank folder>/<hhh>`) are looked up in."""
        if self.buckets is not None and _BUCKET_FOLDER_NAME.fullmatch(folder):
            return self.buckets.folder_rows(folder)
        return self

    def rechecks(self, bucket: str | None) -> bool:
        """Files of this bucket are re-read this run (their hashes compared to the baseline's)."""
        if not self.period or bucket is None:
            return False
        return int(bucket, 16) % self.period == self.slot

    def __reduce__(self) -> tuple:
        """Pickled as bytes (a part's rows go to its Ray task; memoryviews do not pickle)."""
        assert self.buckets is None, "a baseline with its rows in a temporary file stays in its process"
        columns = (tuple(bytes(b) for b in self.stat), bytes(self.content), self.payload, bytes(self.unsupported))
        return Baseline, (self.path, self.meta, columns, self.recheck, self.total)

    def metadata(self) -> dict[str, Any]:
        return {"path": self.path, "tool_version": self.meta.get("tool_version"), "rows": self.total,
                "recheck": str(self.recheck), "recheck_period": self.period,
                "recheck_slot": self.slot if self.period else None}


Columns = tuple  # ((dev, inode, size, mtime_ns, ctime_ns) buffers, content buffer, {row: payload},
# one byte a row: 1 where its status was unsupported_layout)

# a block file's path, `<rank folder>/<hhh>/<fan-out>/<file>`, and its bucket folder
_BUCKET_PATH = r"^(?P<rank_folder>[^/]+)/(?P<hhh>[0-9a-f]{3})/[^/]+/[^/]+$"  # (Arrow's regex: `$` is the end)
_BUCKET_FOLDER = re.compile(r"([^/]+/[0-9a-f]{3})/[^/]+/[^/]+")  # (fullmatch: the same paths)
_BUCKET_FOLDER_NAME = re.compile(r"[^/]+/[0-9a-f]{3}")
_HEX3 = pa.array([f"{i:03x}" for i in range(1 << 12)])  # a `<hhh>` name by its value
_WIDTHS = (8, 8, 8, 8, 8, 16, 16, 1, 1)  # dev, inode, size, mtime_ns, ctime_ns, content, payload, has payload,
# unsupported: the bytes of a row in each of BucketFiles' files
LOAD_BATCH = 16_384  # baseline rows read at a time
_ROWS_CACHED = 64  # bucket folders' rows kept read (a walk's threads each walk one at a time)


class BucketFiles:
    """The baseline's block-file rows in temporary files (one a column, fixed width), in
    runs of one bucket folder sorted by inode, and where each bucket folder's runs are
    (bucket folder code, first row, rows; 24 bytes a run): a walk reads a bucket's rows
    when it walks that bucket, and none is held per row. Forked walk workers share the
    open files (reads are pread: no shared offset)."""

    def __init__(self) -> None:
        tmp = scratch.tmpdir()
        self.files = [tempfile.TemporaryFile(prefix="kvmigrate-baseline-", dir=tmp)  # noqa: SIM115 (open while it lives)
                      for _ in _WIDTHS]
        self.rows = 0
        self.folders: dict[str, int] = {}  # rank folder -> its code (a bucket folder's: code * 4096 + hhh)
        self.runs = array("q")  # (bucket folder code, first row, rows), in the order written
        self._keys = array("q")  # the runs' bucket folder codes, sorted (bisected)
        self.folder_rows = lru_cache(maxsize=_ROWS_CACHED)(self._read)  # one bucket folder's rows

    def add(self, t: pa.Table, rank_folders: pa.Array, buckets: pa.Array) -> None:
        """Rows of block files (each row's rank folder and `<hhh>`), in any order."""
        names = pc.unique(rank_folders)
        codes = pa.array([self.folders.setdefault(n, len(self.folders)) for n in names.to_pylist()], pa.int64())
        code = pc.take(codes, pc.index_in(rank_folders, value_set=names))
        hhh = pc.index_in(buckets, value_set=_HEX3).cast(pa.int64())
        t = t.append_column("key", pc.add(pc.multiply(code, 4096), hhh))
        t = t.take(pc.sort_indices(t, [("key", "ascending"), ("inode", "ascending")])).combine_chunks()
        for k, col in enumerate(_stored_columns(t)):
            self.files[k].write(col)
        runs = pc.run_end_encode(t["key"].chunk(0)) if t.num_rows else None
        if runs is not None:
            start = self.rows
            for key, end in zip(runs.values.to_pylist(), runs.run_ends.to_pylist()):
                self.runs.extend((key, start, self.rows + end - start))
                start = self.rows + end
        self.rows += t.num_rows

    def close_writing(self) -> None:
        """Index the runs by bucket folder (a stable sort: a folder's runs in row order)."""
        for f in self.files:
            f.flush()
        n = len(self.runs) // 3
        order = sorted(range(n), key=lambda r: self.runs[3 * r])
        self.runs = array("q", (v for r in order for v in self.runs[3 * r:3 * r + 3]))
        self._keys = array("q", self.runs[0::3])

    def _read(self, folder: str) -> BaselineRows:
        """The rows of one bucket folder (`<rank folder>/<hhh>`), sorted by inode."""
        rank_folder, _, hhh = folder.rpartition("/")
        code = self.folders.get(rank_folder)
        lo = hi = 0
        if code is not None:
            key = code * 4096 + int(hhh, 16)
            lo, hi = bisect_left(self._keys, key), bisect_right(self._keys, key)
        parts = [b"".join(os.pread(f.fileno(), w * self.runs[3 * r + 2], w * self.runs[3 * r + 1])
                          for r in range(lo, hi)) for f, w in zip(self.files, _WIDTHS)]
        if hi - lo > 1:  # runs of several batches: one inode order
            parts = _by_inode(parts)
        stat, content, payload, has_payload, unsupported = parts[:5], parts[5], parts[6], parts[7], parts[8]
        payloads = {i: payload[16 * i:16 * i + 16] for i, v in enumerate(has_payload) if v}
        return BaselineRows((tuple(stat), content, payloads, unsupported))


def _stored_columns(t: pa.Table) -> list[bytes]:
    """A table's columns as BucketFiles stores them, `_WIDTHS` bytes a row."""
    stat, content, _, unsupported = _columns(t, presorted=True)
    payload = t["payload_xxh3_128"]
    has_payload = pc.cast(pc.is_valid(payload), pa.uint8())
    return [bytes(b) for b in stat] + [bytes(content), bytes(_flat(payload, 16)), bytes(_flat(has_payload, 1)),
                                       bytes(unsupported)]


def _by_inode(parts: list[bytes]) -> list[bytes]:
    """Stored columns of several runs in one inode order."""
    n = len(parts[1]) // 8
    inode = pa.Array.from_buffers(pa.uint64(), n, [None, pa.py_buffer(parts[1])])
    order = pc.sort_indices(inode)
    out = []
    for b, w in zip(parts, _WIDTHS):
        arr = pa.Array.from_buffers(pa.binary(w), n, [None, pa.py_buffer(b)]).take(order)
        out.append(bytes(_flat(pa.chunked_array([arr]), w)))
    return out


def load(spec: str, *, root: str, target: str, verify: str, recheck: Fraction,
         history: str | None = None) -> Baseline | None:
    """The baseline named by `--baseline` (a manifest, a dataset directory, or `auto`: the
    newest kept audit of ROOT), checked against this run; None for `auto` with no kept
    audit yet (the first run reads everything)."""
    found = _checked(spec, root=root, target=target, verify=verify, history=history)
    if found is None:
        return None
    path, meta = found
    buckets = BucketFiles()
    other: list[pa.Table] = []
    for batch in manifest.iter_batches(path, columns=_COLUMNS + ("relpath",), batch_size=LOAD_BATCH):
        t = _carriable(pa.Table.from_batches([batch]))
        t = t.set_column(t.schema.get_field_index("status"), "status", pc.cast(t["status"], pa.string()))
        parts = pc.extract_regex(t["relpath"], _BUCKET_PATH)
        in_bucket = pc.is_valid(parts)
        t = t.drop_columns(["relpath"])
        if pc.any(in_bucket).as_py():
            parts = pc.filter(parts, in_bucket)
            buckets.add(t.filter(in_bucket), pc.struct_field(parts, [0]), pc.struct_field(parts, [1]))
        other.append(t.filter(pc.invert(in_bucket)))
    buckets.close_writing()
    table = (pa.concat_tables(other) if other else
             _carriable(manifest.read_table(path, columns=_COLUMNS)))  # (no row: its empty columns)
    baseline = Baseline(path, meta, _columns(table), recheck, buckets=buckets)
    give_back_freed()  # (the load freed ~4x what it keeps)
    return baseline


def load_parts(spec: str, parts: int, *, root: str, target: str, verify: str, recheck: Fraction,
               history: str | None = None) -> list[Baseline] | None:
    """`load`, split for the N parts of a `--run-on ray` scan, so each task is sent about
    1/N of the baseline, and the driver checks and reads it once (one recheck slot for
    all). The parts' metadata names the whole baseline.

    A block file of a rank folder (`<rank folder>/<hhh>/<fan-out>/<file>`) is walked by
    part int(hhh, 16) % N: its row goes to that part alone. Every other row (config.json,
    temp and foreign files, deep layouts, flat families: few) goes to every part, so
    whichever part walks that file finds it (a part's extra rows are never matched by a
    file it does not walk: rows are matched by dev, inode, size, mtime and ctime)."""
    found = _checked(spec, root=root, target=target, verify=verify, history=history)
    if found is None:
        return None
    path, meta = found
    table = manifest.read_table(path, columns=_COLUMNS + ("relpath", "rank"))
    hhh = pc.struct_field(pc.extract_regex(table["relpath"], _BLOCK_PATH), [0])  # null: not a block path
    value = pc.index_in(hhh, value_set=pa.array([f"{i:03x}" for i in range(1 << 12)]))  # (its value)
    part = pc.if_else(pc.is_valid(table["rank"]), pc.modulo(value.cast(pa.int64()), parts), None)
    table = _carriable(table.drop_columns(["relpath", "rank"]).append_column("part", part))  # (paths: not copied)
    table = table.take(pc.sort_indices(table["inode"]))  # (once: a filter keeps the order)
    return [Baseline(path, meta, _columns(table.filter(pc.fill_null(pc.equal(table["part"], k), True)),
                                          presorted=True), recheck, total=table.num_rows) for k in range(parts)]


LONE_RECHECK = "--recheck re-reads files a --baseline carries over: it needs --baseline PREV|auto"
_BLOCK_PATH = r"^[^/]+/(?P<hhh>[0-9a-f]{3})/[^/]+/[^/]+$"  # <rank folder>/<hhh>/<fan-out>/<file>


def _checked(spec: str, *, root: str, target: str, verify: str,
             history: str | None) -> tuple[str, dict[str, Any]] | None:
    """(path, metadata) of the baseline `--baseline` names, once its version, root,
    target profile and verify mode are checked against this run; None: `auto` finds no
    kept audit."""
    if verify != "hash":
        raise UsageError(f"--baseline carries hashes over: it needs --verify hash (got --verify {verify})",
                         hint="add --verify hash, or drop --baseline")
    if spec == "auto":
        kept = kept_audits(history_dir(root, history))
        if not kept:
            return None
        path = str(kept[-1])
    else:
        path = os.path.abspath(spec)
        if not os.path.exists(path):
            raise UsageError("no such baseline manifest", path=path,
                             hint="pass a manifest written by `kvmigrate scan --verify hash`, or --baseline auto")
    rescan = f"rescan with `kvmigrate scan {root} --verify hash -o MANIFEST` and pass that manifest"
    version = _version(path)
    if version not in manifest.READABLE_VERSIONS:
        raise UsageError(f"baseline refused: manifest format version {version}, a baseline needs version "
                         f"{' or '.join(map(str, manifest.READABLE_VERSIONS))} (its ctime_ns column)", path=path,
                         hint=rescan)
    meta = manifest.read_metadata(path)
    for key, ours, what in (("root", root, "cache root"), ("target_profile", target, "target profile")):
        if meta.get(key) != ours:
            raise UsageError(f"baseline refused: it is a scan of {what} {meta.get(key)!r}, this run's is {ours!r}",
                             path=path, hint="pass a manifest of this root and --target, or --baseline auto")
    if meta.get("verify") != "hash":
        raise UsageError(f"baseline refused: a --verify {meta.get('verify')} scan has no hashes to carry over",
                         path=path, hint=rescan)
    return path, meta


def _version(path: str) -> Any:
    """The manifest_version of a manifest (the first part of a dataset directory)."""
    import json

    import pyarrow.parquet as pq

    try:
        files = manifest._parquet_files(path)
        raw = (pq.read_schema(files[0]).metadata or {}).get(manifest.META_KEY)
    except (OSError, ValueError) as exc:
        raise UsageError(f"baseline refused: cannot read it as a Parquet manifest ({exc})", path=path) from None
    if raw is None:
        raise UsageError("baseline refused: not a kvmigrate manifest (no kvmigrate metadata)", path=path)
    return json.loads(raw).get("manifest_version", 1)


def _carriable(t: pa.Table) -> pa.Table:
    """The baseline rows whose hashes may be carried over."""
    status = pc.cast(t["status"], pa.string())
    keep = pc.and_(pc.and_(pc.is_valid(t["content_xxh3_128"]), pc.is_valid(t["ctime_ns"])),
                   pc.invert(pc.fill_null(pc.is_in(status, pa.array(sorted(READ_FINDINGS))), False)))
    return t.filter(keep)


def _columns(t: pa.Table, presorted: bool = False) -> Columns:
    """Rows sorted by inode, as `Baseline` keeps them: with Arrow kernels and buffers,
    never a Python object per row."""
    t = (t if presorted else t.take(pc.sort_indices(t["inode"]))).combine_chunks()
    stat = tuple(_flat(t[name], 8) for name in ("dev", "inode", "size", "mtime_ns", "ctime_ns"))
    payload_col = t["payload_xxh3_128"]
    payload = ({} if payload_col.null_count == t.num_rows else
               {i: v for i, v in enumerate(payload_col.to_pylist()) if v is not None})
    unsupported = pc.fill_null(pc.equal(pc.cast(t["status"], pa.string()), "unsupported_layout"), False)
    return stat, _flat(t["content_xxh3_128"], 16), payload, _flat(pc.cast(unsupported, pa.uint8()), 1)


def _flat(column: Any, width: int) -> memoryview:
    """The values of a null-free fixed-width column as one flat buffer."""
    arr = column.chunk(0) if column.num_chunks else pa.array([], column.type)
    if arr.null_count:
        arr = pc.fill_null(arr, 0 if width == 8 else b"\0" * width)
    data = memoryview(arr.buffers()[1])
    return data[arr.offset * width:(arr.offset + len(arr)) * width]
