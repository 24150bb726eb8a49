"""Manifest dataset directories and the migration partition.

A dataset directory holds one Parquet part per shard of one scan, named
`part-KKKKK-of-NNNNN.parquet` (zero-padded: name order is part order). Every manifest
reader (`kvmigrate.manifest`) accepts it in place of a single file and refuses one whose
parts do not form one complete `--shard` partition, so a missing or stale part can never
pass for a whole tree.

The migration partition puts a block row in part `int(hhh, 16) % N`, `hhh` being the
first three hex digits of its block hash: the `<hhh>` bucket its files and its target
path live in. All rank files, replicas and merge sources of one block therefore fall in
the same part, so each part plans them in the same fixed order as a single-process run.
Rows that are not blocks (config.json, temp files, foreign files) go to part 0.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvmigrate import manifest
from kvmigrate.errors import UsageError

PART_RE = re.compile(r"^part-(\d+)-of-(\d+)\.parquet$")
DRIVER_JOURNAL = "driver.journal"


def part_name(k: int, n: int) -> str:
    """File name of part K of N in a dataset directory."""
    return f"part-{k:05d}-of-{n:05d}.parquet"


def journal_name(k: int, n: int) -> str:
    """File name of part K's journal in a migration's journal directory."""
    return f"part-{k:05d}-of-{n:05d}.journal"


def names_directory(path: str) -> bool:
    """`-o DIR/` (trailing slash) or an existing directory names a dataset directory."""
    return path.endswith(("/", os.sep)) or os.path.isdir(path)


def part_output(output: str, shard: tuple[int, int]) -> str:
    """Where `scan --shard K/N -o OUTPUT` writes its manifest: OUTPUT itself, or the
    part's file inside OUTPUT when OUTPUT names a dataset directory."""
    if not names_directory(output):
        return output
    if os.path.exists(output) and not os.path.isdir(output):
        raise UsageError("not a directory", path=output, hint="pass -o DIR/ for a dataset directory, or -o FILE.parquet")
    return os.path.join(output, part_name(*shard))


def other_parquet_files(directory: str) -> list[str]:
    """Parquet files in a dataset directory that are not parts written by kvmigrate."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.endswith(".parquet") and not PART_RE.match(n))


def stale_parts(directory: str, n: int) -> list[str]:
    """Part files of a scan with another number of parts (replaced when a new scan of
    N parts is published into the directory)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = PART_RE.match(name)
        if m and int(m.group(2)) != n:
            out.append(name)
    return sorted(out)


def declared_shards(directory: str) -> list[tuple[Path, int, int]]:
    """(file, K, N) of every part, from each part's own metadata (not its name)."""
    out = []
    for f in manifest._parquet_files(directory):
        raw = (pq.read_schema(f).metadata or {}).get(manifest.META_KEY)
        shard = json.loads(raw).get("shard", "0/1") if raw else "0/1"
        k, n = (int(x) for x in str(shard).split("/"))
        out.append((f, k, n))
    return out


# --- the migration partition ---------------------------------------------------------

_PREFIXES: pa.Array | None = None


def _two_byte_prefixes() -> pa.Array:
    """All 65536 two-byte values in order: index_in() of a hash's first two bytes is
    their value, and value >> 4 is the `<hhh>` bucket (three hex digits = 12 bits)."""
    global _PREFIXES
    if _PREFIXES is None:
        _PREFIXES = pa.array([i.to_bytes(2, "big") for i in range(1 << 16)], pa.binary())
    return _PREFIXES


def row_parts(block_hash: pa.Array | pa.ChunkedArray, n: int) -> pa.Array | pa.ChunkedArray:
    """Part of every row: int(hhh, 16) % n of its block hash, 0 for rows without one."""
    prefix = pc.binary_slice(block_hash, 0, 2)
    bucket = pc.shift_right(pc.index_in(prefix, value_set=_two_byte_prefixes()).cast(pa.int64()), 4)
    return pc.fill_null(pc.modulo(bucket, n), 0)


def part_rows(path: str | os.PathLike[str], k: int, n: int, columns: Iterable[str] | None = None) -> pa.Table:
    """The manifest rows that migration part K of N acts on.

    A dataset directory scanned as the same N parts is read one file only (the scan's
    partition is the bucket partition); anything else is streamed and filtered by the
    block hash's bucket. Either way every row lands in exactly one part and a block's
    rows in the same one."""
    cols = list(columns) if columns is not None else None
    if os.path.isdir(path):
        shards = declared_shards(str(path))
        mine = [f for f, kk, nn in shards if nn == n and kk == k]
        if len(shards) == n and all(nn == n for _, _, nn in shards) and len(mine) == 1:
            return pq.read_table(mine[0], columns=cols)
    read_cols = cols if cols is None or "block_hash" in cols else [*cols, "block_hash"]
    batches = []
    for batch in manifest.iter_batches(path, columns=read_cols):
        batch = batch.replace_schema_metadata(None)  # parts differ in metadata only
        keep = pc.equal(row_parts(batch.column("block_hash"), n), k)
        batch = batch.filter(keep)
        if cols is not None and read_cols is not cols:
            batch = batch.select(cols)
        if batch.num_rows:
            batches.append(batch)
    if not batches:
        first = manifest._parquet_files(path)[0]
        full = pq.read_schema(first)
        schema = pa.schema([full.field(c) for c in cols]) if cols is not None else full
        return schema.empty_table()
    return pa.Table.from_batches(batches)
