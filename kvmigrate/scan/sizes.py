"""Phase 5 of the scan: sizes that must be equal within a (namespace, rank, group) are
only known at the end; odd ones re-classify their blocks in one rewrite of the manifest
(`finalize`), which also records walk errors in the metadata."""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvmigrate import classify, findings, manifest
from kvmigrate.classify import FileRecord
from kvmigrate.scan.rows import utf8_safe
from kvmigrate.scan.units import Unit
from kvmigrate.scan.walker import Walker

# File-level states (what a file alone shows). Every other state of a block row is a
# block-level verdict on a file that was fine by itself: the re-classification of odd-size
# blocks recovers the file-level state from the manifest row this way.
FILE_LEVEL_STATUSES = frozenset({"short", "zero_filled", "header_invalid", "size_mismatch", "padded_legacy",
                                 "unreadable", "misfiled", "silent_change"})


def _outliers(walker: Walker, units: list[Unit], sizes: dict[tuple[str, int, int], Counter]
              ) -> dict[tuple[str, int, int], tuple[set[int], str]]:
    """Sizes that are off in their (namespace, rank, group), with the reason."""
    outliers: dict[tuple[str, int, int], tuple[set[int], str]] = {}
    if walker.verify == "none":
        return outliers
    samples = {m.ns.source_base: m.ns.size_sample for u in units for m in u.members}
    for key, cnt in sizes.items():
        # the shard-independent sample joins the vote, so every --shard part judges alike
        combined = cnt + samples.get(key[0], {}).get((key[1], key[2]), Counter())
        if len(combined) > 1:
            off, why = classify.majority_size(combined)
            if off & set(cnt):
                outliers[key] = (off, why)
    return outliers


def finalize(writer: manifest.ManifestWriter, meta: dict[str, Any], walker: Walker, units: list[Unit],
              sizes: dict[tuple[str, int, int], Counter], errors: list[str]) -> bool:
    """Close the manifest. Rarely it needs a second pass: blocks with an odd size for
    their (namespace, rank, group) get `size_mismatch` and are classified again, and walk
    errors go into the metadata (the Parquet footer holds it): the written rows are
    then copied into a new manifest with those fixes. True when rows changed."""
    outliers = _outliers(walker, units, sizes)
    if not outliers and not errors:
        writer.close()
        return False
    meta["walk_errors"] = errors[:1000]
    meta["walk_failed"] = bool(errors)
    writer._writer.close()
    stage = f"{writer.path}.stage.kvmigrate-{os.getpid()}.tmp"
    os.replace(writer.tmp, stage)
    try:
        unit_of: dict[str, tuple[Unit, int]] = {}
        for u in units:
            for i, m in enumerate(u.members):
                unit_of.setdefault(m.ns.source_base, (u, i))
        member_of = {(u.index, m.rank, m.ns.source_base): i for u in units for i, m in enumerate(u.members)}
        pf = pq.ParquetFile(stage)
        with manifest.ManifestWriter(writer.path, meta) as out:
            for i in range(pf.num_row_groups):
                t = pf.read_row_group(i)
                if outliers:
                    t = _fix_sizes(t, outliers, walker, unit_of, member_of, units)
                out.write(t)
    finally:
        try:
            os.unlink(stage)
        except FileNotFoundError:
            pass
    return bool(outliers)


def _file_level(status: str | None, reason: str | None) -> tuple[str, str]:
    """The state a row's file showed by itself, before block rules (see FILE_LEVEL_STATUSES)."""
    if status in FILE_LEVEL_STATUSES:
        return status, reason or status
    return "ok", ""


def _fix_sizes(t: pa.Table, outliers: dict, walker: Walker, unit_of: dict, member_of: dict,
               units: list[Unit]) -> pa.Table:
    bases = pa.array(sorted({k[0] for k in outliers}), pa.string())
    hit = pc.fill_null(pc.is_in(t["source_base"].cast(pa.string()), value_set=bases), False)
    if not pc.any(hit).as_py():
        return t
    sb = t["source_base"].to_pylist()
    rk = t["rank"].to_pylist()
    gr = t["group"].to_pylist()
    sz = t["size"].to_pylist()
    bh = t["block_hash"].to_pylist()
    st = t["status"].to_pylist()
    rs = t["reason"].to_pylist()
    ist = [_file_level(a, b)[0] for a, b in zip(st, rs)]
    affected: set[tuple[str, int, bytes]] = set()
    for i in range(t.num_rows):
        if bh[i] is None or ist[i] != "ok":
            continue
        o = outliers.get((sb[i], rk[i], gr[i]))
        if o is not None and sz[i] in o[0]:
            affected.add((unit_of[sb[i]][0].index, gr[i], bh[i]))
    if not affected:
        return t
    idx_by_block: dict[tuple, list[int]] = defaultdict(list)
    for i in range(t.num_rows):
        if bh[i] is not None and sb[i] in unit_of:
            key = (unit_of[sb[i]][0].index, gr[i], bh[i])
            if key in affected:
                idx_by_block[key].append(i)
    cols = {n: t[n].to_pylist() for n in ("status", "action", "reason", "target_relpath", "relpath",
                                          "mtime_ns", "inode", "dev", "nlink", "content_xxh3_128",
                                          "payload_xxh3_128")}
    units_by_index = {u.index: u for u in units}
    refound: dict[int, findings.Finding | None] = {}
    for (uidx, group, bhash), rows in idx_by_block.items():
        unit = units_by_index[uidx]
        recs = []
        for i in rows:
            istatus, ireason = _file_level(st[i], rs[i])
            r = FileRecord(cols["relpath"][i], rk[i], group, bhash.hex(), sz[i], cols["mtime_ns"][i],
                           cols["inode"][i], cols["dev"][i], cols["nlink"][i],
                           member=member_of.get((uidx, rk[i], sb[i]), 0),
                           content=cols["content_xxh3_128"][i], payload=cols["payload_xxh3_128"][i],
                           status=istatus, reason=ireason)
            o = outliers.get((sb[i], rk[i], group))
            if r.status == "ok" and o is not None and r.size in o[0]:
                r.status = "size_mismatch"
                r.reason = f"size {r.size} differs from the rest of its (namespace, rank, group): {o[1]}"
            recs.append(r)
        walker.finish_block(unit, recs, group, bhash.hex())
        for i, r in zip(rows, recs):
            cols["status"][i], cols["action"][i] = r.status, r.action
            cols["reason"][i], cols["target_relpath"][i] = r.reason, r.target_relpath
            refound[i] = findings.finding_of(r.reason)
    # the finding columns: the new reasons' findings on the rows classified again
    found: list[tuple[Any, ...] | None] = [tuple(v) for v in zip(*(t[n].to_pylist() for n in findings.COLUMNS))]
    for i, f in refound.items():
        found[i] = f
    for name, array in zip(findings.COLUMNS, findings.arrays(
            [None if f is None or f[0] is None else findings.Finding(*f) for f in found])):
        t = t.set_column(t.schema.get_field_index(name), name, array)
    for name in ("status", "action", "reason"):
        t = t.set_column(t.schema.get_field_index(name), name, utf8_safe(cols[name]).dictionary_encode())
    t = t.set_column(t.schema.get_field_index("target_relpath"), "target_relpath", utf8_safe(cols["target_relpath"]))
    return t
