"""Prune rules of tier families (LMCache disk tiers, spec lmcache.md §6), on top of
`prune.py`'s machinery (migration.md §6 unchanged).

A tier directory is one engine's configured path, shared by every deployment that wrote
into it: the quiet period is the tier's (its folder, its GDS `<2>/<2>` folders, its
files), and a live tier is skipped whole. Its deployments are their own targets (the
target engine reads the same tier), so "never a target" means: never a file some row
names as its target, never a deployment another one migrates into, nor one a migration
journal names. The classes:

    residue                as the other families' (tmp_leftover older than --older-than,
                           zero_filled, short, misfiled) plus orphan_data and corrupt_sidecar
    unreadable_namespaces  whole deployments every chunk of which is stale_hash_recipe or
                           unreproducible_hash
    index_lost             local_disk chunks, once the tier is stated stopped (the
                           `engine_stopped` fact, or --engine-stopped for every tier)

A GDS data file and its sidecar move together (the sidecar first, `move_order`); a tier
folder is never removed (`Item.keep`). `--migrated` in a tier (`migrated`) takes the legacy
names a rescan finds `already_present` at another name, with the chunk's other files.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

from kvmigrate import families
from kvmigrate.formats import lmcache as L

STALE_STATUSES = ("stale_hash_recipe", "unreproducible_hash")  # no target release computes their keys
PAIR_RESIDUE = ("orphan_data", "corrupt_sidecar")  # residue of tiers, besides prune.RESIDUE_STATUSES
INDEX_LOST = "index_lost"
NOT_ENGINE_WRITES = ("foreign", "own_artifact")  # a tier's quiet period counts its engine's files only


@dataclass
class Tiers:
    """The tier namespaces of a manifest (its metadata): namespace -> tier name, the
    label of each tier's own namespace and what each deployment's facts state."""

    tier_of: dict[str, str] = field(default_factory=dict)
    label_of: dict[str, str] = field(default_factory=dict)  # tier -> its own namespace (`lmcache:<tier>`)
    stopped: dict[str, bool | None] = field(default_factory=dict)  # deployment -> its engine_stopped fact
    stopped_source: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, meta: dict[str, Any]) -> Tiers:
        out = cls()
        for ns, m in (meta.get("namespaces") or {}).items():
            fam = families.get(m.get("family"))
            if fam.root_layout != "tiers":
                continue
            tier = str((m.get("config_json") or {}).get("tier") or ".")
            out.tier_of[ns] = tier
            out.label_of[tier] = fam.tier_label(tier)
            out.stopped[ns] = (m.get("facts") or {}).get("engine_stopped")
            out.stopped_source[ns] = str((m.get("facts_source") or {}).get("engine_stopped") or "")
        return out

    def __bool__(self) -> bool:
        return bool(self.tier_of)

    def members(self, tier: str) -> list[str]:
        return sorted(ns for ns, t in self.tier_of.items() if t == tier)


def tier_folder(tier: str) -> str:
    """A tier's folder relative to the root ('' for the root itself)."""
    return "" if tier == "." else tier


def kept_folder(tier: str, relpath: str) -> str:
    """The deepest folder a pruned file of the tier never removes: the tier folder for a
    file at its top or in GDS `<2>/<2>` folders (those go when emptied); the file's own
    folder otherwise (a configured temp folder, `tmp_dir`, stays as the engine made it)."""
    base = tier_folder(tier)
    inner = relpath[len(base) + 1:] if base else relpath
    parts = inner.split("/")[:-1]
    if len(parts) <= 2 and all(1 <= len(p) <= 2 and p not in (".", "..") for p in parts):  # (scan/tiers.gds_folder)
        return base
    return relpath.rpartition("/")[0]


def _in(col: Any, values: Any) -> Any:
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.fill_null(pc.is_in(col, value_set=pa.array(sorted(set(values)), col.type)), False)


@dataclass
class Protected:
    """What no class takes from a tier: `rows` (a mask) and the deployments that are a
    target or a migration's source (`targets`, `used`)."""

    rows: Any
    targets: set[str]
    used: set[str]


def protected(c: dict[str, Any], is_tier: Any, journal_targets: set[str], used: set[str]) -> Protected:
    """The tier rows no class takes: a file some row names as its target (an
    `already_present` file is its own), a deployment another one is planned into, one a
    migration journal names as its target. A deployment whose target is itself (the
    target engine reads its own tier) is not protected by that alone: its quiet period is."""
    import pyarrow.compute as pc

    src, tb = c["source_base"], c["target_base"]
    other = pc.fill_null(pc.and_(is_tier, pc.and_(pc.not_equal(tb, src), pc.not_equal(tb, ""))), False)
    targets = set(pc.unique(pc.filter(tb, other)).drop_null().to_pylist()) | set(journal_targets)
    named = pc.unique(pc.filter(c["target_relpath"], pc.fill_null(pc.not_equal(c["target_relpath"], ""), False)))
    rows = pc.or_(_in(src, targets), pc.fill_null(pc.is_in(c["relpath"], value_set=named.drop_null()), False))
    return Protected(pc.and_(is_tier, rows), targets, used)


def select(c: dict[str, Any], is_tier: Any, guard: Protected, classes: tuple[str, ...],
           residue_statuses: tuple[str, ...], tmp_cutoff_ns: int) -> dict[str, Any]:
    """Per class, the tier rows it takes (masks), before the pairs and the run-time
    checks (statement, quiet period)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    status, src = c["status"], c["source_base"]
    free = pc.and_(is_tier, pc.invert(guard.rows))
    out: dict[str, Any] = {}
    residueish = _in(status, ("tmp_leftover", *residue_statuses, *PAIR_RESIDUE))
    if "unreadable_namespaces" in classes:
        stale = _in(status, STALE_STATUSES)
        per_ns = pa.table({"ns": src, "all": pc.or_(stale, residueish), "any": stale}).filter(is_tier) \
            .group_by("ns").aggregate([("all", "all"), ("any", "any")])
        whole = {ns for ns, a, s in zip(*(per_ns[k].to_pylist() for k in ("ns", "all_all", "any_any")))
                 if a and s and ns not in guard.targets and ns not in guard.used}
        out["unreadable_namespaces"] = pc.and_(free, _in(src, whole))
    if "residue" in classes:
        old = pc.fill_null(pc.less_equal(pc.fill_null(c["mtime_ns"], 0), tmp_cutoff_ns), False)
        tmp = pc.and_(pc.fill_null(pc.equal(status, "tmp_leftover"), False), old)
        out["residue"] = pc.and_(free, pc.or_(_in(status, (*residue_statuses, *PAIR_RESIDUE)), tmp))
    if "index_lost" in classes:
        out["index_lost"] = pc.and_(free, pc.fill_null(pc.equal(status, INDEX_LOST), False))
    return out


def partners(c: dict[str, Any], is_tier: Any) -> Any:
    """Per row, the row of its GDS partner (a data file's sidecar, a sidecar's data file
    in the same folder), null when it has none."""
    import pyarrow as pa
    import pyarrow.compute as pc

    rel = c["relpath"]
    side = pc.and_(is_tier, pc.fill_null(pc.ends_with(rel, L.SIDECAR), False))
    data = pc.and_(is_tier, pc.invert(side))
    for_side = pc.index_in(pc.replace_substring_regex(rel, f"{_re(L.SIDECAR)}$", ""), value_set=rel)
    for_data = pc.index_in(pc.binary_join_element_wise(rel, pa.scalar(L.SIDECAR), ""), value_set=rel)
    none = pa.nulls(len(rel), for_side.type)
    gds_data = pc.and_(data, pc.or_(*(pc.fill_null(pc.ends_with(rel, s), False) for s in L.GDS_SUFFIXES)))
    return pc.if_else(side, for_side, pc.if_else(gds_data, for_data, none))


def _re(text: str) -> str:
    import re

    return re.escape(text)


def with_pairs(c: dict[str, Any], is_tier: Any, guard: Protected, code: Any) -> Any:
    """A GDS pair moves together: a row whose partner is taken is taken with it (same
    class); a pair one of whose files no class may take stays whole."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not pc.any(is_tier).as_py():
        return code
    partner = partners(c, is_tier)
    has = pc.is_valid(partner)
    if not pc.any(has).as_py():
        return code
    held = pc.or_(guard.rows, _in(c["status"], NOT_ENGINE_WRITES))
    blocked = pc.and_(has, pc.or_(held, pc.fill_null(pc.take(held, partner), False)))
    zero = pa.scalar(0, code.type)
    code = pc.if_else(blocked, zero, code)
    theirs = pc.fill_null(pc.take(code, partner), 0)
    return pc.if_else(pc.and_(has, pc.and_(pc.equal(code, 0), pc.not_equal(theirs, 0))), theirs.cast(code.type), code)


def move_order(relpath: str) -> tuple[str, int]:
    """A GDS sidecar moves before its data file (a live engine's probe reads the sidecar
    first, then the data: spec §5); restore walks the moves backwards, data first."""
    if relpath.endswith(L.SIDECAR):
        return relpath[:-len(L.SIDECAR)], 0
    return relpath, 1


def unstated(tiers: Tiers, selected: dict[str, tuple[int, int]], all_stopped: bool) -> dict[str, str]:
    """The deployments whose index_lost chunks wait for a statement that no engine uses
    their tier: deployment -> what the dry run says ({deployment: (files, bytes)} of
    `selected`). A deployment's own `engine_stopped` fact wins over --engine-stopped."""
    from kvmigrate.units import human_bytes, plural

    out = {}
    for ns, (files, size) in sorted(selected.items()):
        fact = tiers.stopped.get(ns)
        if fact is True or fact is None and all_stopped:
            continue
        tier = tiers.tier_of.get(ns, ".")
        what = (f"{plural(files, 'index_lost chunk file')} ({human_bytes(size)}) of local_disk tier {tier}, "
                "not taken: a running LocalDiskBackend fails on a chunk removed under it")
        if fact is False:
            out[ns] = (f"{what}; its engine_stopped fact is false ({tiers.stopped_source.get(ns) or 'stated'}): "
                       "set it true once no engine uses the tier")
        else:
            out[ns] = (f"{what}, and nothing states that no engine uses the tier; once none does, pass "
                       f"--engine-stopped (every tier) or state it per tier in FACTS.json: "
                       f'{{"{tier}": {{"engine_stopped": true}}}}')
    return out


def units(c: dict[str, Any], tiers: Tiers, names: set[str]) -> dict[str, tuple[list[str], list[str], int]]:
    """The quiet-period units of the tier namespaces among `names`: tier label -> (every
    namespace of the tier, its folders relative to the root: the tier folder and the GDS
    folders its rows sit in, the newest mtime of its files in the manifest). Files that
    are not the engine's (foreign, kvmigrate's own) do not count."""
    import pyarrow.compute as pc

    wanted = {tiers.tier_of[ns] for ns in names if ns in tiers.tier_of}
    if not wanted:
        return {}
    members = [ns for ns, t in tiers.tier_of.items() if t in wanted]
    out = empty_units(tiers, wanted)
    fold_units(out, tiers, c, pc.and_(_in(c["source_base"], members), pc.invert(_in(c["status"], NOT_ENGINE_WRITES))))
    return {label: (ms, sorted(f), n) for label, (ms, f, n) in out.items()}


Units = dict[str, tuple[list[str], set[str], int]]  # tier label -> (namespaces, folders, newest mtime)


def empty_units(tiers: Tiers, wanted: set[str]) -> Units:
    """Each wanted tier's unit before any file: its namespaces and its own folder."""
    return {tiers.label_of[tier]: (tiers.members(tier), {tier_folder(tier)}, 0) for tier in wanted}


def fold_units(out: Units, tiers: Tiers, c: Any, rows: Any) -> None:
    """Fold the `rows` (a mask) of columns `c` (source_base, relpath, mtime_ns) into their
    tiers' units: the folders the files sit in (each with its parents), the newest mtime."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = pa.table({"ns": c["source_base"], "dir": pc.replace_substring_regex(c["relpath"], "/[^/]*$", ""),
                  "slash": pc.match_substring(c["relpath"], "/"), "mtime": pc.fill_null(c["mtime_ns"], 0)}) \
        .filter(rows).group_by(["ns", "dir", "slash"]).aggregate([("mtime", "max")])
    for ns, d, slash, mtime in zip(*(t[k].to_pylist() for k in ("ns", "dir", "slash", "mtime_max"))):
        label = tiers.label_of[tiers.tier_of[ns]]
        ms, folders, newest = out[label]
        if slash:
            parts = d.split("/")
            folders.update("/".join(parts[:k]) for k in range(1, len(parts) + 1))
        out[label] = (ms, folders, max(newest, mtime))


def live_reason(age: float, newest: float, quiet_period: float) -> str:
    """Why a tier is skipped: its newest write, within the quiet period."""
    when = datetime.datetime.fromtimestamp(newest, datetime.timezone.utc).isoformat(timespec="seconds")
    return (f"tier written {max(age, 0):.0f} s ago (newest mtime {when.replace('+00:00', 'Z')} of its folders and "
            f"files), within the quiet period of {quiet_period:.0f} s: an engine may be using it, so nothing of the "
            "tier is pruned; rerun later, or pass --force-live")


def migrated(c: dict[str, Any], is_tier: Any, cand: Any) -> tuple[Any, Any]:
    """`--migrated` in a tier (spec §6): a chunk file the rescan finds `already_present` at
    a *different* name (an old ws/wid/model name, a GDS `_` name, a placed reshard's
    primary) whose target name is a whole file the target reads in place (its own target);
    never a file that is its own target. (mask, the target's row) per row; the other files
    of the chunk (part_of_action: the reshard's other ranks, the sidecars; proven copies)
    join through prune's secondaries."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def b(mask: Any) -> Any:
        return pc.fill_null(mask, False)

    cand = pc.and_(cand, b(pc.not_equal(c["target_relpath"], c["relpath"])))
    idx = pc.indices_nonzero(is_tier).cast(pa.int64())
    pos = pc.index_in(c["target_relpath"], value_set=pc.take(c["relpath"], idx))
    j = pc.take(idx, pos)
    whole = b(pc.equal(pc.take(c["status"], j), "ok"))
    in_place = b(pc.equal(pc.take(c["target_relpath"], j), pc.take(c["relpath"], j)))
    mask = pc.and_(cand, pc.and_(whole, in_place))
    return mask, pc.if_else(mask, j, pa.nulls(len(c["relpath"]), pa.int64()))
