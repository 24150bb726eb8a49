"""The rows of one task (`Rows`): Python column lists plus the C walk's row store, and
their Arrow table with the manifest schema."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from kvmigrate import findings, layout, manifest
from kvmigrate.classify import FileRecord

NS_COLUMNS = ("family", "scheme", "model_name", "source_d12", "source_base", "deployment",
              "target_profile", "target_d12", "target_base")


class Rows:
    """Manifest rows of one task in walk order, plus `order`: the order they are written
    in. A bucket's block rows wait for their block's verdict and are written after its
    other rows, sorted by (group, block hash); one Arrow `take` per batch puts them
    there, so no row is copied or boxed in Python.

    Rows the Python code makes are column lists (row index i >= 0); the plain block rows
    the C walk takes stay in its BlockRows, `store` (row j has index -(j + 1)) until
    `table()` hands their column buffers to Arrow. `record(i)` and `set_verdict(i, ...)`
    read and write either kind."""

    COLUMNS = ("relpath", "ns", "rank", "group", "block_hash", "size", "mtime_ns", "inode", "dev", "nlink",
               "content", "payload", "status", "action", "reason", "target")
    # (not in COLUMNS, which the C walk's finish_blocks takes: it never reads these two)
    EXTRA = ("ctime_ns", "carried")
    __slots__ = COLUMNS + EXTRA + ("order", "sizes", "errors", "store")
    # the column lists (made in __init__ from COLUMNS and EXTRA), one value a row
    relpath: list[str]
    ns: list[int]
    rank: list[int | None]
    group: list[int | None]
    block_hash: list[bytes | None]
    size: list[int]
    mtime_ns: list[int]
    inode: list[int]
    dev: list[int]
    nlink: list[int]
    content: list[bytes | None]
    payload: list[bytes | None]
    status: list[str]
    action: list[str]
    reason: list[str | None]
    target: list[str | None]
    ctime_ns: list[int | None]
    carried: list[bool]

    def __init__(self) -> None:
        for name in self.COLUMNS + self.EXTRA:
            setattr(self, name, [])
        self.order: list[int] = []
        self.sizes: dict[tuple[str, int | None, int], Counter] = defaultdict(Counter)
        self.errors: list[str] = []
        self.store: Any = None  # kvmigrate._leafwalk.BlockRows, made by the first bucket the C walk takes

    def __len__(self) -> int:
        return len(self.order)

    def add(self, rec: FileRecord, code: int, *, emit: bool = True) -> int:
        """Append one file's row; `emit=False` leaves its place in the order to the caller."""
        i = len(self.relpath)
        self.relpath.append(rec.relpath)
        self.ns.append(code)
        self.rank.append(rec.rank)
        self.group.append(rec.group)
        self.block_hash.append(bytes.fromhex(rec.hex) if rec.hex else None)
        self.size.append(rec.size)
        self.mtime_ns.append(rec.mtime_ns)
        self.inode.append(rec.inode)
        self.dev.append(rec.dev)
        self.nlink.append(rec.nlink)
        self.content.append(rec.content)
        self.payload.append(rec.payload)
        self.status.append(rec.status)
        self.action.append(rec.action)
        self.reason.append(rec.reason)
        self.target.append(rec.target_relpath)
        self.ctime_ns.append(rec.ctime_ns)
        self.carried.append(rec.carried)
        if emit:
            self.order.append(i)
        return i

    def columns(self) -> tuple[list, ...]:
        """The column lists in COLUMNS order (leaf.finish_blocks reads and sets them)."""
        return tuple([getattr(self, name) for name in self.COLUMNS])

    def block_rows(self, leaf: Any) -> Any:
        """The C walk's row store (made on first use)."""
        if self.store is None:
            self.store = leaf.BlockRows()
        return self.store

    def record(self, i: int, hex_hash: str | None = None) -> FileRecord:
        """Row i as a FileRecord (for the rare blocks classified one by one)."""
        if i < 0:
            (relpath, _, rank, group, _, size, mtime_ns, inode, dev, nlink, content, payload, status, action, reason,
             target) = self.store.row(-i - 1)
        else:
            relpath, rank, group, size, mtime_ns, inode, dev, nlink, content, payload, status, action, reason, target = (
                self.relpath[i], self.rank[i], self.group[i], self.size[i], self.mtime_ns[i], self.inode[i],
                self.dev[i], self.nlink[i], self.content[i], self.payload[i], self.status[i], self.action[i],
                self.reason[i], self.target[i])
        return FileRecord(relpath, rank, group, hex_hash, size, mtime_ns, inode, dev, nlink, content=content,
                          payload=payload, status=status, reason=reason, action=action, target_relpath=target)

    def set_verdict(self, i: int, status: str, action: str, reason: str | None, target: str | None) -> None:
        """Row i's status, action, reason and target path."""
        if i < 0:
            self.store.set(-i - 1, status, action, reason, target)
        else:
            self.status[i], self.action[i], self.reason[i], self.target[i] = status, action, reason, target

    def extend(self, other: Rows) -> None:
        base, c_base = len(self.relpath), len(self.store) if self.store is not None else 0
        for name in self.COLUMNS + self.EXTRA:
            getattr(self, name).extend(getattr(other, name))
        if other.store is not None and len(other.store):
            if self.store is None:
                self.store = type(other.store)()
            self.store.extend(other.store)
        # other's list rows follow ours (i + base), its C rows too: -(j + 1) -> -(c_base + j + 1)
        self.order.extend([i + base if i >= 0 else i - c_base for i in other.order] if base or c_base else other.order)
        for key, cnt in other.sizes.items():
            self.sizes[key].update(cnt)
        self.errors.extend(other.errors)

    def table(self, ns_arrays: list[tuple[pa.Array, pa.Array]]) -> pa.Table:
        """The rows as one Arrow table with the manifest schema, in written order."""
        c_rows = len(self.store) if self.store is not None else 0
        if not c_rows:
            t = self._list_table(ns_arrays)
            if self.order != list(range(len(self.order))):
                t = t.take(pa.array(self.order, pa.int32()))
            return t
        if not self.relpath:  # C rows only: the store gathers them in write order
            return _block_rows_table(self.store, ns_arrays, self.order)
        t = pa.concat_tables([self._list_table(ns_arrays), _block_rows_table(self.store, ns_arrays)])
        first_c = len(self.relpath)  # C row j is at first_c + j: index -(j + 1) -> first_c - 1 - i
        order = pa.array(self.order, pa.int64())
        return t.unify_dictionaries().take(
            pc.if_else(pc.less(order, 0), pc.subtract(pa.scalar(first_c - 1, pa.int64()), order), order))

    def _list_table(self, ns_arrays: list[tuple[pa.Array, pa.Array]]) -> pa.Table:
        codes = pa.array(self.ns, pa.int32())
        arrays = [utf8_safe(self.relpath)]
        arrays += [pa.DictionaryArray.from_arrays(mapping.take(codes), dictionary) for mapping, dictionary in ns_arrays]
        arrays += [pa.array(self.rank, pa.int32()), pa.array(self.group, pa.int32()),
                   pa.array(self.block_hash, pa.binary()), pa.array(self.size, pa.int64()),
                   pa.array(self.mtime_ns, pa.int64()), pa.array(self.inode, pa.uint64()),
                   pa.array(self.dev, pa.uint64()), pa.array(self.nlink, pa.uint32()),
                   pa.array(self.content, pa.binary(16)), pa.array(self.payload, pa.binary(16)),
                   utf8_safe(self.status).dictionary_encode(), utf8_safe(self.action).dictionary_encode(),
                   utf8_safe(self.reason).dictionary_encode(), utf8_safe(self.target)]
        arrays += findings.arrays([findings.finding_of(r) for r in self.reason])
        arrays += [pa.array(self.ctime_ns, pa.int64()), pa.array(self.carried, pa.bool_())]
        arrays += object_nulls(len(self.relpath))
        return pa.Table.from_arrays(arrays, schema=manifest.SCHEMA)


def _block_rows_table(store: Any, ns_arrays: list[tuple[pa.Array, pa.Array]], order: list[int] | None = None
                      ) -> pa.Table:
    """The C walk's rows as an Arrow table, from its column buffers: the rows of `order`
    (indexes -(j + 1)) in that order, or all in store order."""
    cols = store.arrays([layout.shown(base).encode("utf-8") for base in store.bases], order)
    n = len(store) if order is None else len(order)

    def buf(key: str) -> pa.Buffer | None:
        value = cols[key]
        return None if value is None else pa.py_buffer(value)

    def fixed(key: str, typ: pa.DataType, valid: str | None = None) -> pa.Array:
        return pa.Array.from_buffers(typ, n, [buf(valid) if valid else None, buf(key)])

    def coded(c: int, key: str) -> pa.Array:
        return pa.DictionaryArray.from_arrays(fixed(key, pa.int32(), f"{key}_valid"), utf8_safe(store.values(c)))

    codes = fixed("ns", pa.int32())
    if cols["target_offsets"] is not None:
        target = pa.Array.from_buffers(pa.string(), n, [buf("target_valid"), buf("target_offsets"),
                                                        buf("target_data")])
    else:  # a target path that is not valid UTF-8 (a lone surrogate): shown escaped, as in Python rows
        target = utf8_safe(store.targets(order))
    arrays = [pa.Array.from_buffers(pa.string(), n, [None, buf("relpath_offsets"), buf("relpath_data")])]
    arrays += [pa.DictionaryArray.from_arrays(mapping.take(codes), dictionary) for mapping, dictionary in ns_arrays]
    arrays += [fixed("rank", pa.int32()), fixed("group", pa.int32()),
               pa.Array.from_buffers(pa.binary(), n, [None, buf("hash_offsets"), buf("hash_data")]),
               fixed("size", pa.int64()), fixed("mtime_ns", pa.int64()), fixed("inode", pa.uint64()),
               fixed("dev", pa.uint64()), fixed("nlink", pa.uint32()),
               fixed("content", pa.binary(16), "content_valid"), pa.nulls(n, pa.binary(16)),
               coded(0, "status"), coded(1, "action"), coded(2, "reason"), target]
    # the finding columns: one Finding per distinct reason, taken by the rows' reason index
    arrays += findings.arrays_by_code(store.values(2), fixed("reason", pa.int32(), "reason_valid"))
    arrays += [fixed("ctime_ns", pa.int64()), pa.Array.from_buffers(pa.bool_(), n, [None, buf("carried")])]
    arrays += object_nulls(n)
    return pa.Table.from_arrays(arrays, schema=manifest.SCHEMA)


class RecordRows:
    """A namespace's rows from file records a family reads itself (its `flat_rows`), as one
    table when written, in relpath order."""

    def __init__(self, files: list[Any]) -> None:
        self.files = files

    def __bool__(self) -> bool:
        return bool(self.files)

    def ordered(self) -> list[Any]:
        return sorted(self.files, key=lambda f: f.relpath)

    def tables(self, code: int, ns_arrays: list) -> Any:
        out = rows_of(self.ordered(), code)
        if len(out):
            yield out.table(ns_arrays)


def rows_of(records: Any, code: int) -> Rows:
    """The rows of file records a family reads itself (LMCache's `TierFile`, Mooncake's
    `StoreFile`: relpath, stat, hashes, verdict, block hash), in the order given."""
    out = Rows()
    for f in records:
        rec = FileRecord(f.relpath, f.rank, f.group, None, f.size, f.mtime_ns, f.inode, f.dev, f.nlink,
                         content=f.content, payload=f.payload, status=f.status, reason=f.reason, action=f.action,
                         target_relpath=f.target, ctime_ns=f.ctime_ns)
        i = out.add(rec, code)
        out.block_hash[i] = f.block_hash
    return out


def object_nulls(n: int) -> list[pa.Array]:
    """The object columns of rows that are files only (every family but Mooncake's)."""
    return [pa.nulls(n, manifest.SCHEMA.field(c).type) for c in manifest.OBJECT_COLUMNS]


def utf8_safe(values: list[Any]) -> pa.Array:
    """A string column; undecodable file names (surrogate escapes) are shown with
    backslash escapes: Arrow strings are UTF-8, and a foreign file's odd name must not
    crash the scan."""
    try:
        return pa.array(values, pa.string())
    except (UnicodeEncodeError, pa.ArrowException):
        return pa.array([layout.shown(v) if isinstance(v, str) else v for v in values], pa.string())


def ns_arrays(ns_table: list[tuple | None]) -> list[tuple[pa.Array, pa.Array]]:
    """Per namespace column: (namespace code -> dictionary index, dictionary), so a batch's
    namespace columns are built from its rows' codes with one `take` each."""
    out = []
    for j in range(len(NS_COLUMNS)):
        index: dict[str, int] = {}
        mapping = []
        for cols in ns_table:
            value = cols[j] if cols is not None else None
            mapping.append(None if value is None else index.setdefault(value, len(index)))
        out.append((pa.array(mapping, pa.int32()), utf8_safe(list(index))))
    return out
