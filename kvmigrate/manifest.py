"""The Parquet manifest: one row per source file seen (interface.md §2).

Column names and types are the contract that `report`, `migrate --manifest` and outside
checks rely on. Run-level facts (tool version, command line, facts and their source, each
namespace's config.json and gate decision) live in the Parquet key-value metadata, like
the header of an fclones report, so later steps can re-derive the settings.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from kvmigrate import findings
from kvmigrate.errors import UsageError, write_error
from kvmigrate.units import agreeing

_DICT = pa.dictionary(pa.int32(), pa.string())

SCHEMA = pa.schema([
    ("relpath", pa.string()),
    ("family", _DICT),
    ("scheme", _DICT),
    ("model_name", _DICT),
    ("source_d12", _DICT),
    ("source_base", _DICT),
    ("deployment", _DICT),
    ("target_profile", _DICT),
    ("target_d12", _DICT),
    ("target_base", _DICT),
    ("rank", pa.int32()),
    ("group", pa.int32()),
    ("block_hash", pa.binary()),
    ("size", pa.int64()),
    ("mtime_ns", pa.int64()),
    ("inode", pa.uint64()),
    ("dev", pa.uint64()),
    ("nlink", pa.uint32()),
    ("content_xxh3_128", pa.binary(16)),
    ("payload_xxh3_128", pa.binary(16)),
    ("status", _DICT),
    ("action", _DICT),
    ("reason", _DICT),
    ("target_relpath", pa.string()),
    *findings.FIELDS,  # the typed finding of the reason (kvmigrate.findings)
    # 3: the inode change time (user space cannot set it: a rewrite that restores size and
    # mtime still moves it), so a later `--baseline` run can trust an unchanged row
    ("ctime_ns", pa.int64()),
    ("carried", pa.bool_()),  # the hashes were taken from the --baseline row: the file was not opened
    # 4: object rows of a file that holds several objects (a Mooncake `.meta` index lists its
    # bucket's entries; mooncake.md §4): null on every other row, and on every row of a version 3 manifest
    ("object_index", pa.int32()),  # the entry's index in its index file; null on a file row
    ("object_key", pa.binary()),  # the storage key as stored
    ("target_key", pa.binary()),  # the storage key the target looks up for the row's action
])
OBJECT_COLUMNS = ("object_index", "object_key", "target_key")
COLUMNS = tuple(SCHEMA.names)
# zstd level 1: on a 1M-row manifest the writer takes 0.79 s of CPU against 1.12 s at the
# default level (3), for the same 64 MiB (paths and hashes do not compress much further).
ZSTD_LEVEL = 1
# Parquet dictionary pages only where values repeat (namespace columns, verdicts, ranks,
# sizes): on a path, an inode or a hash they never pay, and trying costs the writer
# about 15% of its time on a million-row manifest (and the file grows).
DICTIONARY_COLUMNS = [f.name for f in SCHEMA if pa.types.is_dictionary(f.type)] + ["rank", "group", "size", "dev",
                                                                                   "nlink"]

META_KEY = b"kvmigrate"  # JSON: {"manifest_version", "tool_version", "command", "root", "facts", "namespaces": {...}}
# 2: the finding columns (kvmigrate.findings). A manifest without them is refused: its
# reasons are prose, and no stage reads prose back.
# 3: ctime_ns and carried (--baseline needs the ctime of every row it trusts).
# 4: object_index, object_key, target_key (OBJECT_COLUMNS); a version 3 manifest reads with them null.
MANIFEST_VERSION = 4
READABLE_VERSIONS = (3, 4)


def columns_to_table(cols: dict[str, list[Any]]) -> pa.Table:
    """Build one Arrow batch from column lists (missing columns become nulls)."""
    n = len(next(iter(cols.values()))) if cols else 0
    arrays = []
    for field in SCHEMA:
        values = cols.get(field.name)
        if values is None:
            arrays.append(pa.nulls(n, field.type))
        elif pa.types.is_dictionary(field.type):
            arrays.append(pa.array(values, pa.string()).dictionary_encode())
        else:
            arrays.append(pa.array(values, field.type))
    return pa.Table.from_arrays(arrays, schema=SCHEMA)


class ManifestWriter:
    """Batched Parquet writer; metadata is set up front (the footer holds it).

    Writes to `<path>.kvmigrate-<pid>.tmp` and renames on close, so an interrupted scan
    never leaves a truncated manifest at the requested path.
    """

    def __init__(self, path: str | os.PathLike[str], metadata: dict[str, Any]):
        self.path = Path(path)
        self.tmp = self.path.with_name(f"{self.path.name}.kvmigrate-{os.getpid()}.tmp")
        metadata = {**metadata, "manifest_version": MANIFEST_VERSION}
        schema = SCHEMA.with_metadata({META_KEY: json.dumps(metadata, sort_keys=True).encode()})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # made here, so a folder it cannot be written in fails with our words (pyarrow then truncates it)
            os.close(os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644))
            self._writer = pq.ParquetWriter(self.tmp, schema, compression="zstd", compression_level=ZSTD_LEVEL,
                                            use_dictionary=DICTIONARY_COLUMNS)
        except OSError as exc:
            with contextlib.suppress(OSError):
                self.tmp.unlink()
            raise write_error(exc, "cannot write the manifest", str(self.path),
                              elsewhere="write it to a writable filesystem") from None
        self._schema = schema
        self.rows = 0

    def write(self, table: pa.Table) -> None:
        if table.num_rows:
            self._writer.write_table(table.cast(self._schema) if table.schema != self._schema else table)
            self.rows += table.num_rows

    def write_columns(self, cols: dict[str, list[Any]]) -> None:
        self.write(columns_to_table(cols))

    def close(self) -> None:
        self._writer.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        try:
            self._writer.close()
        finally:
            self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> ManifestWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _parquet_files(path: str | os.PathLike[str]) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        files = sorted(x for x in p.iterdir() if x.suffix == ".parquet" and x.is_file())
        if not files:
            raise FileNotFoundError(f"{p}: no .parquet files in this manifest directory")
        return files
    return [p]


# Rows that are no evidence of a cache: kvmigrate's own files (.kvmigrate/) and foreign ones
NOT_CACHE_STATUSES = frozenset({"own_artifact", "foreign"})


def holds_no_cache(meta: dict[str, Any], statuses: Iterable[str]) -> bool:
    """A scanned root with no cache namespace (not even one a filtered scan left out) and no
    row but kvmigrate's own and foreign files: an empty or unmounted volume (interface.md
    §4: exit bit 8). What an engine left outside namespaces (temp files, an orphaned rank
    folder, an old deep tree) is a cache. Only a whole scan or its part 0 can tell: a flat
    directory's pages and the files outside buckets are part 0's (`--shard K/N`)."""
    if not str(meta.get("shard") or "0/1").startswith("0/"):
        return False
    skipped = (meta.get("selection") or {}).get("skipped_namespaces")
    return not meta.get("namespaces") and not skipped and set(statuses) <= NOT_CACHE_STATUSES


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Run metadata of a manifest file, or the merge of a dataset directory's parts
    (namespaces united, walk errors of every part; the first part's other keys). The
    parts of a directory must be one complete `--shard` partition of one scan."""
    merged: dict[str, Any] = {}
    parts = []
    for f in _parquet_files(path):
        md = pq.read_schema(f).metadata or {}
        raw = md.get(META_KEY)
        if raw is None:
            continue
        meta = json.loads(raw)
        check_version(meta, f)
        parts.append((f, meta))
        if not merged:
            merged = meta
            merged.setdefault("namespaces", {})
        else:
            merged["namespaces"].update(meta.get("namespaces", {}))
            merged["walk_errors"] = (merged.get("walk_errors") or []) + (meta.get("walk_errors") or [])
            merged["walk_failed"] = bool(merged.get("walk_failed") or meta.get("walk_failed"))
    if Path(path).is_dir() and parts:
        n = _check_partition(Path(path), parts)
        if n > 1:
            merged["shard"] = "0/1"  # the complete set of parts is the whole tree
            merged["parts"] = n
    return merged


def check_version(meta: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Refuse a manifest of another format version (an older one lacks the finding columns)."""
    version = meta.get("manifest_version", 1)
    if version not in READABLE_VERSIONS:
        raise UsageError(f"manifest format version {version}, this kvmigrate reads version {MANIFEST_VERSION}"
                         + (" (an older manifest has no finding columns)" if isinstance(version, int) and version < 2
                            else " (an older manifest has no ctime_ns column)"
                            if isinstance(version, int) and version < min(READABLE_VERSIONS) else ""),
                         path=str(path), hint="rescan with `kvmigrate scan ROOT -o MANIFEST`")


_SAME_SCAN_KEYS = ("root", "target_profile", "verify", "facts")


def _check_partition(directory: Path, parts: list[tuple[Path, dict[str, Any]]]) -> int:
    """A dataset directory whose parts declare `shard` K/N (N > 1) must hold every part
    0..N-1 exactly once, all of one scan (same root, target, depth and facts): a
    missing, duplicated or stale part would silently change every number. Returns N."""
    shards = []
    for f, meta in parts:
        try:
            k, n = (int(x) for x in str(meta.get("shard", "0/1")).split("/"))
        except ValueError:
            raise UsageError(f"{f.name}: unreadable shard {meta.get('shard')!r} in its metadata", path=str(f)) from None
        shards.append((f, k, n))
    first = parts[0][1]
    for f, meta in parts[1:]:
        differ = [key for key in _SAME_SCAN_KEYS if meta.get(key) != first.get(key)]
        if differ:
            raise UsageError(f"{f.name} and {parts[0][0].name} come from different scans ({', '.join(differ)} "
                             "differ)", path=str(directory),
                             hint="a dataset directory holds the parts of one scan: rescan into an empty directory")
    sizes = sorted({n for _, _, n in shards})
    if sizes == [1]:
        return 1
    if len(sizes) > 1:
        raise UsageError(f"parts of scans with different --shard N ({', '.join(map(str, sizes))}) in one directory",
                         path=str(directory), hint="keep the parts of one scan only, or rescan into an empty directory")
    n = sizes[0]
    seen: dict[int, list[str]] = {}
    for f, k, _ in shards:
        seen.setdefault(k, []).append(f.name)
    missing = [k for k in range(n) if k not in seen]
    doubled = {k: names for k, names in seen.items() if len(names) > 1}
    if missing or doubled:
        what = []
        if missing:
            what.append(f"missing {agreeing(len(missing), 'part')} {', '.join(f'{k}/{n}' for k in missing[:10])}"
                        + (f" and {len(missing) - 10} more" if len(missing) > 10 else ""))
        if doubled:
            what.append(f"{agreeing(len(doubled), 'part')} present twice: " + "; ".join(" ".join(v) for v in doubled.values()))
        raise UsageError(f"incomplete dataset directory: {', '.join(what)}", path=str(directory),
                         hint=f"run the missing `kvmigrate scan ROOT --shard K/{n} -o {directory}/` part(s), "
                              "or rerun the whole scan")
    return n


def _present(f: Path, cols: list[str] | None) -> tuple[list[str] | None, list[str]]:
    """(the columns to read from one file, the asked columns it lacks: a version 3 file has
    no OBJECT_COLUMNS)."""
    names = pq.read_schema(f).names
    wanted = cols if cols is not None else list(COLUMNS)
    missing = [c for c in wanted if c not in names and c in OBJECT_COLUMNS]
    if not missing:
        return cols, []
    return [c for c in wanted if c not in missing], missing


def _with_nulls(t: Any, missing: list[str], order: list[str] | None) -> Any:
    """A table or batch with null OBJECT_COLUMNS added, in the asked (or schema) order."""
    n = t.num_rows
    arrays = dict(zip(t.schema.names, t.columns))
    for c in missing:
        arrays[c] = pa.nulls(n, SCHEMA.field(c).type)
    names = order if order is not None else [c for c in COLUMNS if c in arrays]
    make = pa.RecordBatch.from_arrays if isinstance(t, pa.RecordBatch) else pa.Table.from_arrays
    return make([arrays[c] for c in names], names=names)


def _read_one(f: Path, cols: list[str] | None) -> pa.Table:
    read, missing = _present(f, cols)
    t = pq.read_table(f, columns=read)
    return _with_nulls(t, missing, cols) if missing else t


def read_table(path: str | os.PathLike[str], columns: Iterable[str] | None = None) -> pa.Table:
    """The rows of a manifest file or dataset directory, with the contract schema."""
    cols = list(columns) if columns is not None else None
    tables = [_read_one(f, cols) for f in _parquet_files(path)]
    if len(tables) == 1:
        return tables[0]
    return pa.concat_tables(tables, promote_options="permissive").unify_dictionaries()


def iter_batches(path: str | os.PathLike[str], columns: Iterable[str] | None = None,
                 batch_size: int = 65536):
    """Stream record batches (bounded memory for million-row manifests), a reader per row
    group: one reader over the whole file kept state from every row group it had read
    (its peak RSS grew batch after batch: +33 MiB over a 192k-row manifest, against +21)."""
    cols = list(columns) if columns is not None else None
    for f in _parquet_files(path):
        read, missing = _present(f, cols)
        pf = pq.ParquetFile(f)
        for group in range(pf.metadata.num_row_groups):
            for batch in pf.iter_batches(batch_size=batch_size, row_groups=[group], columns=read):
                yield _with_nulls(batch, missing, cols) if missing else batch


def row_count(path: str | os.PathLike[str]) -> int:
    """Rows of a manifest file or dataset directory, from the Parquet footers."""
    return sum(pq.ParquetFile(f).metadata.num_rows for f in _parquet_files(path))


def count_true(path: str | os.PathLike[str], column: str) -> int:
    """Rows of a manifest file or dataset directory where a bool column is true."""
    import pyarrow.compute as pc

    return sum(pc.sum(pc.cast(b.column(0), pa.int64())).as_py() or 0 for b in iter_batches(path, columns=[column]))
