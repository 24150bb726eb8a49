"""`kvmigrate prune`: reclaim what no engine will read, reversibly (migration.md §6).

A prune plan is read from a manifest's typed columns (never its `reason` prose) and the
migration journals (through `journal.iter_runs`). Classes, each opt-in by name:

    migrated               legacy block files whose bytes the scan found at a target path
                           (`already_present`: the same inode, or the exact bytes the action
                           writes), their rank files (replicas proven equal by hash, parts
                           of a transform), and the namespace's config.json once nothing
                           else of it is left
    unreadable_namespaces  namespaces no target reads and no migration used, whole (also
                           superseded eras whose every block a target namespace holds)
    residue                engine temp files older than --older-than, zero_filled, short,
                           misfiled files (LMCache tiers: orphan_data, corrupt_sidecar too)
    index_lost             LMCache local_disk chunks of tiers stated stopped

LMCache tiers have rules of their own (quiet period per tier, GDS pairs, their classes):
`prune_tiers.py`.

Never: an `ok` block not migrated, a target namespace (every `target_base` of the
manifest and of the journals), kvmigrate's own files, a file changed since the scan
(size, mtime, inode, dev, or a ctime after the scan), a namespace whose target is under
a held migration lock or that was written within the quiet period, anything outside
ROOT, a symlink (its target is never followed: every step goes through O_NOFOLLOW
folder fds of `fsops.DestTree`).

This module selects; `quarantine.py` moves each file into
`ROOT/.kvmigrate/quarantine/<run>/<relpath>` by rename (same inode, nothing copied),
journaled write-ahead in its own journal (`ROOT/.kvmigrate/journals/prune/<run>.journal`,
beside, not among, the migration journals); `restore.py` puts it back or purges it.
"""

from __future__ import annotations

import fcntl
import functools
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypedDict

from kvmigrate import findings, layout
from kvmigrate import manifest as mf
from kvmigrate.classify import UNREADABLE_STATUSES
from kvmigrate.errors import UsageError
from kvmigrate.migrate import journal as jn
from kvmigrate.migrate import prune_spill
from kvmigrate.migrate import prune_stores as stores_
from kvmigrate.migrate import prune_tiers as tiers_
from kvmigrate.migrate.fsops import check_relpath
from kvmigrate.migrate.prune_rules import (
    CLASSES,
    CODES,
    DEFAULT_QUIET_PERIOD,
    DEFAULT_RESIDUE_AGE,
    MIGRATED_STATUSES,
    PLAN_ROW_COLUMNS,
    RESIDUE_STATUSES,
    TOTAL_KEYS,
    Item,
    _b,
    _in,
    _prunable,
    live_reason,
    tally_stream,
)

QUARANTINE_DIR = os.path.join(layout.OWN_DIR, "quarantine")
PRUNE_JOURNALS_DIR = os.path.join(jn.JOURNALS_DIR, "prune")
KIND = "prune"  # the header's `kind`: a prune journal, not a migration's


_COLUMNS = ("relpath", "source_base", "deployment", "target_base", "status", "action", "finding", "primary_rank",
            "rank", "group", "block_hash", "size", "mtime_ns", "inode", "dev", "nlink", "content_xxh3_128",
            "payload_xxh3_128", "target_relpath", "family", "object_index", "object_key", "target_key")


def prune_journal_dir(root: str) -> str:
    return os.path.join(root, PRUNE_JOURNALS_DIR)


Items = list[Item] | prune_spill.PlanFile  # a plan's items: a list, or read from disk a batch at a time


@dataclass
class PrunePlan:
    root: str
    manifest: str
    classes: tuple[str, ...]
    items: Items
    skipped: dict[str, str]  # namespace -> why nothing of it is pruned
    target_bases: set[str]
    emptied: set[str] = field(default_factory=set)  # namespaces pruned whole (their folders go too)
    locks: dict[str, set[str]] = field(default_factory=dict)  # target base -> source namespaces pruned into it
    scan_started_ns: int | None = None
    finished: list = field(default_factory=list)  # quarantine.PruneResult of interrupted runs finished first
    # namespaces kept because the target profile reads them only under their writer's
    # topology, not stated (`orphaned_namespaces`): reusable once it is, so never pruned
    orphaned: list = field(default_factory=list)
    retires: list = field(default_factory=list)  # prune_stores.Retire: --tails index rewrites
    store_proofs: dict = field(default_factory=dict)  # store -> prune_stores.StoreProof of what the plan writes
    _figures: tuple | None = field(default=None, repr=False)  # a PlanFile's tally, once read

    def totals(self) -> dict[str, dict[str, int]]:
        """Per class: files and bytes, those freed once purged and those only unlinked
        (`reclaim_totals`)."""
        return self._tally()[0]

    def by_namespace(self) -> dict[tuple[str, str | None], dict[str, int]]:
        """Per (class, namespace), in order (`namespace_order`)."""
        return dict(sorted(self._tally()[1].items(), key=namespace_order))

    def _tally(self) -> tuple[dict[str, dict[str, int]], dict]:
        if isinstance(self.items, prune_spill.PlanFile):  # (read from disk: once)
            if self._figures is None:
                self._figures = self.items.tally(self.classes)
            return self._figures
        return reclaim_totals(_rows_of_items(self.items), self.classes)

    def store_items(self) -> Iterable[Item]:
        """The items that can be a Mooncake store's files (`objects`): a plan read from
        disk has them only when it holds a store's (it is then read once more)."""
        if isinstance(self.items, prune_spill.PlanFile):
            return self.items if self.items.stores else ()
        return self.items

    def unproven_stores(self) -> list[str]:
        """The stores the apply writes without a proof that their clients are stopped
        (`prune_stores.take_proofs` refuses it): its command needs --engine-stopped."""
        return sorted(s for s, p in self.store_proofs.items() if p.proof is None)

    @property
    def exit_code(self) -> int:
        """Dry run: 1 when something would be pruned (interface.md §4)."""
        return 1 if self.items or self.retires else 0




@dataclass
class _Selected:
    """The rows a prune of `classes` takes, before the run-time checks: Arrow columns,
    never a Python object per manifest row (a migrated 200,000-row manifest costs the
    report its reading and a few vectorized passes)."""

    root: str
    c: dict[str, Any]  # the manifest's columns (pyarrow arrays, dictionaries decoded)
    code: Any  # int8 per row: CODES[class], 0 when not selected
    target_of: Any  # int64 per row: a migrated row's target row, else null
    target_bases: set[str]
    emptied: set[str]
    tiers: tiers_.Tiers = field(default_factory=tiers_.Tiers)
    stores: stores_.Stores = field(default_factory=stores_.Stores)
    store_sel: stores_.StoreSelection = field(default_factory=stores_.StoreSelection)

    def rows(self, *names: str) -> dict[str, list]:
        """The selected rows' columns as Python lists (plus `row`: the manifest row and
        `class`), in manifest order."""
        import pyarrow.compute as pc

        idx = pc.indices_nonzero(self.code)
        out = {name: _shared_strings(pc.take(self.c[name], idx)) if name in _FEW_VALUES
               else pc.take(self.c[name], idx).to_pylist() for name in names}
        out["row"] = idx.to_pylist()
        out["class"] = [CLASSES[k - 1] for k in pc.take(self.code, idx).to_pylist()]
        return out


_FEW_VALUES = ("source_base", "deployment", "status", "action", "finding", "family")  # a namespace's rows share them


def _shared_strings(col: Any) -> list:
    """A column of few distinct values as a list sharing one str per value (`to_pylist`
    makes one per row)."""
    coded = col.dictionary_encode()
    values = coded.dictionary.to_pylist()
    return [None if k is None else values[k] for k in coded.indices.to_pylist()]


def _read_columns(manifest_path: str, names: Iterable[str]) -> dict[str, Any]:
    """The manifest's columns as single arrays, dictionary-encoded strings decoded (the
    compute kernels then compare plain strings). Each column read is dropped once copied
    (this function holds the only reference to the table): the peak is one column."""
    import pyarrow as pa

    table = mf.read_table(manifest_path, columns=list(names))
    out = {}
    for name in list(table.column_names):
        col = table.column(name)
        table = table.drop_columns([name])
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        out[name] = col.cast(col.type.value_type) if pa.types.is_dictionary(col.type) else col
        del col
    return out


def _select(manifest_path: str, classes: tuple[str, ...], root: str, migration_journal: str | None,
            older_than: float | None, now: float, meta: dict[str, Any], *, columns: dict[str, Any] | None = None,
            journal_namespaces: tuple[set[str], set[str]] | None = None) -> _Selected:
    """The selection rules (migration.md §6), from the manifest's typed columns and the
    migration journals: the one selection `prune` and the reports' reclaimable figures use.
    `columns`, `journal_namespaces`: already read (the reports select once per class)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    c = columns if columns is not None else _read_columns(manifest_path, _COLUMNS)
    n = len(c["relpath"])
    idx = pa.array(range(n), pa.int64())  # the row numbers
    targets, used = journal_namespaces or _used_namespaces(root, migration_journal)
    target_bases = set(pc.unique(c["target_base"]).drop_null().to_pylist()) - {""} | targets
    src, status = c["source_base"], c["status"]
    has_ns = _b(pc.not_equal(src, ""))
    tiers = tiers_.Tiers.of(meta)
    is_tier = _in(src, tiers.tier_of)  # LMCache tiers: their own rules (prune_tiers)
    stores = stores_.Stores.of(meta)
    is_store = _in(src, stores.store_of)  # Mooncake stores: their own rules (prune_stores)
    apart = pc.or_(is_tier, is_store)  # rows the generic rules never take
    # (a tier deployment is its own target_base: whether it is a target is prune_tiers' question)
    in_target = pc.and_(_in(src, target_bases), pc.invert(apart))
    none = pa.nulls(n, pa.int64())
    code = pc.fill_null(pa.nulls(n, pa.int8()), 0)
    target_of = none

    def assign(mask: Any, cls: str) -> Any:
        """`chosen.setdefault(row, cls)` for the rows of mask."""
        return pc.if_else(pc.and_(mask, pc.equal(code, 0)), pa.scalar(CODES[cls], pa.int8()), code)

    if "migrated" in classes:
        cand = pc.and_(pc.and_(has_ns, pc.invert(in_target)),
                       pc.and_(_b(pc.equal(c["action"], "already_present")), _in(status, MIGRATED_STATUSES)))
        tier_cand = pc.and_(cand, is_tier)
        cand = pc.and_(cand, pc.invert(apart))
        t_idx = pc.indices_nonzero(in_target).cast(pa.int64())
        pos = pc.index_in(c["target_relpath"], value_set=pc.take(c["relpath"], t_idx))
        j = pc.take(t_idx, pos)  # the target path's row (null: no target namespace's file)
        mig = pc.and_(cand, _b(pc.equal(pc.take(status, j), "ok")))  # a healthy file of a target namespace
        target_of = pc.if_else(mig, j, none)
        if tiers and pc.any(tier_cand).as_py():
            tmig, tj = tiers_.migrated(c, is_tier, tier_cand)
            mig, target_of = pc.or_(mig, tmig), pc.if_else(tmig, tj, target_of)
        sec = pc.and_(_in(c["finding"], findings.SECONDARY), _b(pc.equal(status, "ok")))
        if pc.any(sec).as_py() and pc.any(mig).as_py():
            mig, target_of = _with_secondaries(c, idx, mig, sec, target_of)
        code = pc.if_else(mig, pa.scalar(CODES["migrated"], pa.int8()), code)
    residueish = _in(status, ("tmp_leftover", *RESIDUE_STATUSES))
    if "unreadable_namespaces" in classes:
        unread = _in(status, UNREADABLE_STATUSES)
        per_ns = pa.table({"ns": src, "all": pc.or_(unread, residueish), "any": unread,
                           "tr": _b(pc.not_equal(c["target_relpath"], ""))}).filter(pc.and_(has_ns, pc.invert(apart))) \
            .group_by("ns").aggregate([("all", "all"), ("any", "any"), ("tr", "any")])
        whole = {ns for ns, a, u, tr in zip(*(per_ns[k].to_pylist() for k in ("ns", "all_all", "any_any", "tr_any")))
                 if a and u and not tr and ns not in target_bases and ns not in used}
        whole.update(superseded(c, per_ns["ns"].to_pylist(), meta.get("namespaces") or {}, target_bases, used))
        code = assign(_in(src, whole), "unreadable_namespaces")
    if "residue" in classes:
        age_ns = (DEFAULT_RESIDUE_AGE if older_than is None else older_than) * 1e9
        old = _b(pc.less_equal(pc.fill_null(c["mtime_ns"], 0), int(now * 1e9 - age_ns)))
        res = pc.or_(_in(status, RESIDUE_STATUSES), pc.and_(_b(pc.equal(status, "tmp_leftover")), old))
        code = assign(pc.and_(pc.and_(res, pc.invert(in_target)), pc.invert(apart)), "residue")
    store_sel = stores_.StoreSelection()
    if stores:
        store_sel = stores_.select(c, is_store, stores, classes,
                                   int(now * 1e9 - (DEFAULT_RESIDUE_AGE if older_than is None else older_than) * 1e9),
                                   targets, used)
        for cls, rows in store_sel.rows.items():
            code = assign(_b(pc.is_in(idx, value_set=pa.array(rows, pa.int64()))), cls)
        if store_sel.target:  # a migrated KVEntry keeps the row of the entry that serves its key
            have = pa.array(list(store_sel.target), pa.int64())
            pos = pc.index_in(idx, value_set=have)
            target_of = pc.if_else(pc.is_valid(pos), pc.take(pa.array(list(store_sel.target.values()), pa.int64()),
                                                             pos), target_of)
        has_ns = pc.and_(has_ns, pc.invert(is_store))  # (a store is never emptied as a namespace)
    if tiers:
        guard = tiers_.protected(c, is_tier, targets, used)
        age_ns = (DEFAULT_RESIDUE_AGE if older_than is None else older_than) * 1e9
        for cls, mask in tiers_.select(c, is_tier, guard, classes, RESIDUE_STATUSES, int(now * 1e9 - age_ns)).items():
            code = assign(mask, cls)
        code = tiers_.with_pairs(c, is_tier, guard, code)
    # a namespace pruned whole (for its migrated blocks: once nothing else of it is left)
    # takes its config.json and folders with it
    config = _b(pc.equal(c["relpath"], pc.binary_join_element_wise(src, layout.CONFIG_NAME, "/")))
    rest = pc.invert(config)
    chosen = pc.not_equal(code, 0)
    per_ns = pa.table({"ns": src, "chosen": chosen, "rest": pc.cast(rest, pa.int64()),
                       "rest_chosen": pc.cast(pc.and_(rest, chosen), pa.int64()),
                       "first": pc.if_else(rest, idx, none)}).filter(pc.and_(has_ns, pc.invert(in_target))) \
        .group_by("ns").aggregate([("chosen", "any"), ("rest", "sum"), ("rest_chosen", "sum"), ("first", "min")])
    per_ns = per_ns.filter(pc.and_(per_ns["chosen_any"], pc.equal(per_ns["rest_sum"], per_ns["rest_chosen_sum"])))
    emptied = set(per_ns["ns"].to_pylist())
    if emptied:
        cls = pc.fill_null(pc.take(code, per_ns["first_min"]), CODES["migrated"])  # the class of its first file
        cls_of_row = pc.take(cls, pc.index_in(src, value_set=per_ns["ns"]))
        cfg = pc.and_(pc.and_(config, pc.is_valid(cls_of_row)), pc.invert(_in(status, ("own_artifact", "foreign"))))
        code = pc.if_else(pc.and_(cfg, pc.equal(code, 0)), cls_of_row, code)
    return _Selected(root, c, code, target_of, target_bases, emptied, tiers, stores, store_sel)


def _with_secondaries(c: dict[str, Any], idx: Any, mig: Any, sec: Any, target_of: Any) -> tuple[Any, Any]:
    """The rank files of migrated blocks (`findings.SECONDARY`: a proven replica, a part of
    a transform) join their primary's selection and target: matched by (deployment,
    group, block hash, rank) -- a vllm.cpp rank folder is a namespace of its own, its
    block's primary found through the deployment, which groups the ranks' namespaces."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def keyed(mask: Any, rank: str, row: str) -> Any:
        """The rows of mask with their block's key (computed for those rows only)."""
        d, src = pc.filter(c["deployment"], mask), pc.filter(c["source_base"], mask)
        return pa.table({"d": pc.if_else(_b(pc.not_equal(d, "")), d, pc.fill_null(src, "")),
                         "g": pc.fill_null(pc.filter(c["group"], mask), -1),
                         "h": pc.fill_null(pc.filter(c["block_hash"], mask), b"\0none"),
                         "r": pc.fill_null(pc.filter(c[rank], mask), -1), row: pc.filter(idx, mask)})

    def paired() -> tuple[Any, Any]:
        """(secondary row, its primary row) of every secondary whose block has a primary."""
        prim = keyed(mig, "rank", "p").group_by(["d", "g", "h", "r"]) \
            .aggregate([("p", "max")])  # the last primary of a key, as a dict would
        pairs = keyed(sec, "primary_rank", "i").join(prim, keys=["d", "g", "h", "r"], join_type="inner")
        return pairs["i"].combine_chunks(), pairs["p_max"].combine_chunks()

    i, p = paired()
    # a replica's equality is proven by its hash only (a scan at --verify hash): the payload
    # for vllm.cpp (each rank's header names its own identity), the whole file otherwise
    pay_i, pay_p = pc.take(c["payload_xxh3_128"], i), pc.take(c["payload_xxh3_128"], p)
    same = pc.if_else(pc.is_valid(pay_i), _b(pc.equal(pay_i, pay_p)),
                      _b(pc.equal(pc.take(c["content_xxh3_128"], i), pc.take(c["content_xxh3_128"], p))))
    keep = pc.or_(pc.invert(_b(pc.equal(pc.take(c["finding"], i), findings.REPLICA_OF_PRIMARY))), same)
    i, p = pc.filter(i, keep), pc.filter(p, keep)
    pos = pc.index_in(idx, value_set=i)
    return pc.or_(mig, pc.is_valid(pos)), pc.if_else(pc.is_valid(pos), pc.take(pc.take(target_of, p), pos), target_of)


def superseded(c: dict[str, Any], namespaces: Iterable[str], ns_meta: dict[str, dict], target_bases: set[str],
               used: set[str]) -> list[str]:
    """Namespaces of a superseded era (migration.md §6): the target profile can never read
    them (their target is `unreachable`: e.g. the hash granularity changed, a key the target
    lacks), no migration used them, and every block file of them is `ok` with its bytes
    (content hash, a --verify hash scan) in a healthy file of a target namespace of the same
    model: the newer era holds them. A block whose bytes are nowhere else keeps the whole
    namespace (never the last copy); so does a file of any other status but residue."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from kvmigrate.identity.values import ORPHANED

    by_model: dict[Any, list[str]] = {}
    for ns in namespaces:
        m = ns_meta.get(ns) or {}
        why = str((m.get("target") or {}).get("unreachable") or "")
        # (a folder orphaned by its writer's unstated topology is reusable once it is stated: kept)
        if ns not in target_bases and ns not in used and why and not why.startswith(ORPHANED):
            by_model.setdefault(m.get("model_name"), []).append(ns)
    out = []
    src, status = c["source_base"], c["status"]
    ok = _b(pc.equal(status, "ok"))
    for model, names in by_model.items():
        bases = [b for b in target_bases if (ns_meta.get(b) or {}).get("model_name") == model]
        held = pc.unique(pc.filter(c["content_xxh3_128"], pc.and_(_in(src, bases), ok))).drop_null()
        if not len(held):
            continue  # no target namespace of the model holds anything
        good = pc.or_(_in(status, ("tmp_leftover", *RESIDUE_STATUSES)), pc.and_(ok, pc.or_(
            pc.is_null(c["block_hash"]), _b(pc.is_in(c["content_xxh3_128"], value_set=held)))))
        per_ns = pa.table({"ns": src, "good": good, "block": pc.is_valid(c["block_hash"])}) \
            .filter(_in(src, names)).group_by("ns").aggregate([("good", "all"), ("block", "any")])
        out += [ns for ns, g, b in zip(*(per_ns[k].to_pylist() for k in ("ns", "good_all", "block_any"))) if g and b]
    return out


@dataclass
class _Picked:
    """What a prune of some classes takes, before the quiet period's skips and the locks':
    its items in the plan's order (a list, or a PlanFile read from disk a batch at a time)."""

    items: Items
    skipped: dict[str, str]
    skip: set[str]
    target_bases: set[str]
    emptied: set[str]
    retires: list = field(default_factory=list)
    stores: stores_.Stores = field(default_factory=stores_.Stores)


_TARGET_COLUMNS = ("relpath", "dev", "inode", "size", "mtime_ns")


def _picked_whole(manifest_path: str, meta: dict[str, Any], classes: tuple[str, ...], root: str,
                  migration_journal: str | None, older_than: float | None, now: float, chosen: set[str] | None,
                  quiet_period: float | None, engine_stopped: bool) -> _Picked:
    """`_select` over the manifest's columns whole (the streamed plans' reference, and the
    path of a manifest a stream refuses: a store file named twice), then --only/--exclude, the tiers'
    unstated index_lost chunks and the quiet period (`quiet_period` None: --force-live);
    the items in the plan's order."""
    import pyarrow as pa
    import pyarrow.compute as pc

    sel = _select(manifest_path, classes, root, migration_journal, older_than, now, meta)
    sel.code = pc.if_else(_prunable(sel.c), sel.code, 0)
    if chosen is not None:
        sel.code = pc.if_else(_in(sel.c["source_base"], chosen), sel.code, 0)
    skipped: dict[str, str] = {}
    skip: set[str] = set()  # the namespaces of what is skipped (a live tier: all of its deployments)
    if "index_lost" in classes:
        lost = pc.equal(sel.code, CODES["index_lost"])
        per = pa.table({"ns": sel.c["source_base"], "size": pc.fill_null(sel.c["size"], 0)}).filter(lost) \
            .group_by("ns").aggregate([("size", "count"), ("size", "sum")])
        waiting = tiers_.unstated(sel.tiers, {ns: (n, b) for ns, n, b in zip(
            *(per[k].to_pylist() for k in ("ns", "size_count", "size_sum")))}, engine_stopped)
        skipped.update(waiting)
        sel.code = pc.if_else(pc.and_(lost, _in(sel.c["source_base"], waiting)), 0, sel.code)
    retires = list(sel.store_sel.retires)
    if chosen is not None:
        retires = [rw for rw in retires if set(rw.namespaces.values()) <= chosen]
    if quiet_period is not None:
        names = set(pc.unique(pc.filter(sel.c["source_base"], pc.not_equal(sel.code, 0))).drop_null().to_pylist())
        names |= {sel.stores.label_of.get(rw.store, "") for rw in retires} - {""}
        _skip_live(root, _quiet_units(sel, names), quiet_period, now, skipped, skip)
    r = sel.rows(*PLAN_ROW_COLUMNS)
    targets = pc.filter(sel.target_of, pc.not_equal(sel.code, 0))
    t = {k: pc.take(sel.c[k], targets).to_pylist() for k in _TARGET_COLUMNS}
    tiers, stores, ssel, target_bases, emptied = sel.tiers, sel.stores, sel.store_sel, sel.target_bases, sel.emptied
    del sel, targets  # the manifest's columns, before the items grow
    pa.default_memory_pool().release_unused()
    tier_of, store_of = dict(tiers.tier_of), dict(stores.store_of)

    def order(k: int) -> tuple:
        """A deployment's blocks with their rank files side by side, its config.json files
        last; a GDS sidecar just before its data file."""
        config = r["relpath"][k] == f"{r['source_base'][k]}/{layout.CONFIG_NAME}"
        rel = r["relpath"][k]
        if r["source_base"][k] in store_of:  # a pair's two files side by side, its `.meta` first
            return "", False, ssel.key.get(r["row"][k], rel), (stores_.move_order(rel), rel)
        return _deployment(r, k), config, _key(r, k), tiers_.move_order(rel) if r["source_base"][k] in tier_of \
            else (rel, 1)

    items = []
    for k in sorted(range(len(r["row"])), key=order):
        check_relpath(r["relpath"][k], "manifest path")
        target = None if t["relpath"][k] is None else \
            (t["relpath"][k], t["dev"][k], t["inode"][k], t["size"][k], t["mtime_ns"][k])
        row, ns = r["row"][k], r["source_base"][k]
        if ns in store_of:
            items.append(Item(r["relpath"][k], r["class"][k], ns, r["dev"][k], r["inode"][k], r["size"][k],
                              r["mtime_ns"][k], r["nlink"][k] or 1, target, ssel.key.get(row, r["relpath"][k]),
                              ssel.keep.get(row, ""), stores_.QUARANTINE_SUFFIX, ssel.objects.get(row, 0)))
            continue
        items.append(Item(r["relpath"][k], r["class"][k], r["source_base"][k], r["dev"][k], r["inode"][k],
                          r["size"][k], r["mtime_ns"][k], r["nlink"][k] or 1, target, _key(r, k),
                          tiers_.kept_folder(tier_of[ns], r["relpath"][k]) if ns in tier_of else ""))
    return _Picked(items, skipped, skip, target_bases, emptied, retires, stores)


def _picked_streamed(manifest_path: str, meta: dict[str, Any], classes: tuple[str, ...], root: str,
                     migration_journal: str | None, older_than: float | None, now: float, chosen: set[str] | None,
                     quiet_period: float | None, engine_stopped: bool) -> _Picked:
    """`_picked_whole` for a manifest of directory-layout families, in batches
    (prune_stream.PlanRows): the selected rows go to disk as they are read, and the
    plan's items are read back from there (prune_spill)."""
    import pyarrow.compute as pc

    from kvmigrate.migrate import prune_stream

    used = _used_namespaces(root, migration_journal)
    age = DEFAULT_RESIDUE_AGE if older_than is None else older_than
    rows = prune_stream.PlanRows(manifest_path, meta, used, classes, int(now * 1e9 - age * 1e9))
    names = prune_stream.Names()

    def kept() -> Iterator[Any]:
        for t in rows:
            keep = t["prunable"]
            if chosen is not None:
                keep = pc.and_(keep, _in(t["source_base"], chosen))
            yield t.filter(keep)

    items = prune_spill.spill(kept(), mf.row_count(manifest_path),
                              prune_stream.TargetReader(manifest_path, _TARGET_COLUMNS), names.codes, names.names)
    skipped: dict[str, str] = {}
    skip: set[str] = set()
    if quiet_period is not None:
        for ns, newest in sorted(prune_stream.newest_writes(manifest_path, root, set(names.names) - {None}).items()):
            if now - newest < quiet_period:
                skipped[ns] = live_reason(now - newest, quiet_period)
                skip.add(ns)
    return _Picked(items, skipped, skip, rows.fig.target_bases, rows.emptied())


def _spilled(rows: Iterable[Any], manifest_rows: int, manifest_path: str,
             **kinds: Any) -> tuple[prune_spill.PlanFile, set[str]]:
    """The plan's items on disk (prune_spill) of the selected rows (tables of a batch's), and
    the namespaces they are of: the quiet period judges their units. `kinds`: the tiers'
    or stores' (their moves' order, their kept folder)."""
    import pyarrow.compute as pc

    from kvmigrate.migrate import prune_stream

    names = prune_stream.Names()
    taken: set[str] = set()

    def kept() -> Iterator[Any]:
        for t in rows:
            taken.update(pc.unique(t["source_base"]).drop_null().to_pylist())
            yield t

    items = prune_spill.spill(kept(), manifest_rows, prune_stream.TargetReader(manifest_path, _TARGET_COLUMNS),
                              names.codes, names.names, **kinds)
    return items, taken


def _picked_tiers(manifest_path: str, meta: dict[str, Any], classes: tuple[str, ...], root: str,
                  migration_journal: str | None, older_than: float | None, now: float, chosen: set[str] | None,
                  quiet_period: float | None, engine_stopped: bool) -> _Picked | None:
    """`_picked_whole` for a manifest whose namespaces are all LMCache tiers, in batches
    (prune_tier_stream.TierRows), the plan's items on disk (prune_spill); None for any
    other manifest."""
    from kvmigrate.migrate import prune_tier_stream

    tiers = tiers_.Tiers.of(meta)
    if set(meta.get("namespaces") or {}) - set(tiers.tier_of):
        return None
    used = _used_namespaces(root, migration_journal)
    age = DEFAULT_RESIDUE_AGE if older_than is None else older_than
    rows = prune_tier_stream.TierRows(manifest_path, meta, used, classes, int(now * 1e9 - age * 1e9), tiers)
    if not rows.gather(chosen, engine_stopped):
        return None
    items, taken = _spilled(rows.rows(chosen), rows.n, manifest_path, tier_of=dict(tiers.tier_of))
    skipped: dict[str, str] = dict(rows.waiting)
    skip: set[str] = set()
    if quiet_period is not None:
        units = prune_tier_stream.units(manifest_path, tiers, taken)
        _skip_live(root, {u: (*unit, True) for u, unit in units.items()}, quiet_period, now, skipped, skip)
    return _Picked(items, skipped, skip, rows.target_bases, rows.emptied)


def _picked_stores(manifest_path: str, meta: dict[str, Any], classes: tuple[str, ...], root: str,
                   migration_journal: str | None, older_than: float | None, now: float, chosen: set[str] | None,
                   quiet_period: float | None, engine_stopped: bool) -> _Picked | None:
    """`_picked_whole` for a manifest whose namespaces are all of Mooncake stores, in
    batches (prune_store_stream.StoreRows), the plan's items on disk (prune_spill); None
    for any other manifest."""

    from kvmigrate.migrate import prune_store_stream

    stores = stores_.Stores.of(meta)
    if set(meta.get("namespaces") or {}) - set(stores.store_of):
        return None
    age = DEFAULT_RESIDUE_AGE if older_than is None else older_than
    rows = prune_store_stream.StoreRows(manifest_path, _used_namespaces(root, migration_journal), classes,
                                        int(now * 1e9 - age * 1e9), stores)
    if not rows.gather():
        return None
    items, taken = _spilled(rows.rows(chosen), rows.n, manifest_path, stores=stores)
    retires = rows.retires
    if chosen is not None:
        retires = [rw for rw in retires if set(rw.namespaces.values()) <= chosen]
    skipped: dict[str, str] = {}
    skip: set[str] = set()
    if quiet_period is not None:
        taken |= {stores.label_of.get(rw.store, "") for rw in retires} - {""}
        units = prune_store_stream.units(manifest_path, stores, taken)
        _skip_live(root, {u: (*unit, False) for u, unit in units.items()}, quiet_period, now, skipped, skip)
    return _Picked(items, skipped, skip, rows.target_bases, set(), retires, stores)


class _Streams:
    """Each kind's streamed selection of one manifest, for a manifest with LMCache tiers or
    Mooncake stores: the tiers' and stores' rows by their own rules (`alone=False`: other
    namespaces are accepted, the files of no namespace left to the generic rules), the
    directory families' and the files of no namespace by the generic rules (`apart`: the
    tiers' and stores' namespaces, whose rows those never take, as in `_select`). Each
    reads the whole manifest for what its rules ask of it (target bases, a path some row
    names as its target, a superseded era's held bytes)."""

    def __init__(self, manifest_path: str, meta: dict[str, Any], classes: tuple[str, ...],
                 used: tuple[set[str], set[str]], cutoff_ns: int) -> None:
        from kvmigrate.migrate import prune_store_stream, prune_stream, prune_tier_stream

        self.tier_of, self.stores = tiers_.Tiers.of(meta), stores_.Stores.of(meta)
        self.tiers = prune_tier_stream.TierRows(manifest_path, meta, used, classes, cutoff_ns, self.tier_of,
                                                alone=False) if self.tier_of else None
        self.store_rows = prune_store_stream.StoreRows(manifest_path, used, classes, cutoff_ns, self.stores,
                                                       alone=False) if self.stores else None
        self.plain = prune_stream.PlanRows(manifest_path, meta, used, classes, cutoff_ns,
                                           frozenset(self.tier_of.tier_of) | frozenset(self.stores.store_of))
        self.taken: dict[str, set[str]] = {"plain": set(), "tiers": set(), "stores": set()}

    @classmethod
    def gathered(cls, manifest_path: str, meta: dict[str, Any], classes: tuple[str, ...],
                 used: tuple[set[str], set[str]], cutoff_ns: int, chosen: set[str] | None,
                 engine_stopped: bool) -> _Streams | None:
        """The streams, their passes over the manifest done; None when the tiers' or stores'
        stream finds the manifest not for it (the reference selects then)."""
        s = cls(manifest_path, meta, classes, used, cutoff_ns)
        if s.tiers is not None and not s.tiers.gather(chosen, engine_stopped):
            return None
        if s.store_rows is not None and not s.store_rows.gather():
            return None
        return s

    def rows(self, chosen: set[str] | None) -> Iterator[Any]:
        """Each kind's selected rows (prunable, of `chosen`), in one table shape: row, code,
        target, PLAN_ROW_COLUMNS, key and objects (a store pair's); the namespaces of each
        kind taken go to `taken`."""
        import pyarrow as pa
        import pyarrow.compute as pc

        def kind(name: str, tables: Iterable[Any]) -> Iterator[Any]:
            for t in tables:
                self.taken[name].update(pc.unique(t["source_base"]).drop_null().to_pylist())
                for col, typ in (("key", pa.string()), ("objects", pa.int32())):
                    if col not in t.column_names:
                        t = t.append_column(col, pa.nulls(t.num_rows, typ))
                yield t.select(["row", "code", "target", *PLAN_ROW_COLUMNS, "key", "objects"])

        def generic() -> Iterator[Any]:
            for t in self.plain:
                keep = t["prunable"]
                if chosen is not None:
                    keep = pc.and_(keep, _in(t["source_base"], chosen))
                yield t.filter(keep)

        yield from kind("plain", generic())
        if self.tiers is not None:
            yield from kind("tiers", self.tiers.rows(chosen))
        if self.store_rows is not None:
            yield from kind("stores", self.store_rows.rows(chosen))

    def live(self, manifest_path: str, root: str, quiet_period: float, now: float,
             names: set[str] | None = None) -> dict[str, tuple[str, list[str], float]]:
        """The units written within the quiet period (`_live_units`) among those of the
        namespaces taken (or of `names`): a directory family's namespace, a tier, a store."""
        from kvmigrate.migrate import prune_store_stream, prune_stream, prune_tier_stream

        def of(kind: str) -> set[str]:
            return self.taken[kind] if names is None else names

        live: dict[str, tuple[str, list[str], float]] = {}
        plain = {ns for ns in of("plain") if ns not in self.tier_of.tier_of and ns not in self.stores.store_of}
        for ns, newest in prune_stream.newest_writes(manifest_path, root, plain).items():
            if now - newest < quiet_period:
                live[ns] = (live_reason(now - newest, quiet_period), [ns], now - newest)
        if self.tiers is not None:
            units = prune_tier_stream.units(manifest_path, self.tier_of, of("tiers"))
            live.update(_live_units(root, {u: (*unit, True) for u, unit in units.items()}, quiet_period, now))
        if self.store_rows is not None:
            units = prune_store_stream.units(manifest_path, self.stores, of("stores"))
            live.update(_live_units(root, {u: (*unit, False) for u, unit in units.items()}, quiet_period, now))
        return live


def _picked_mixed(manifest_path: str, meta: dict[str, Any], classes: tuple[str, ...], root: str,
                  migration_journal: str | None, older_than: float | None, now: float, chosen: set[str] | None,
                  quiet_period: float | None, engine_stopped: bool) -> _Picked | None:
    """`_picked_whole` for a manifest that mixes directory-layout families, LMCache tiers
    and Mooncake stores (a shared volume holding more than one engine's cache): each
    kind's streamed selection (`_Streams`), their rows in one plan on disk, in the whole
    plan's order. None when the tiers' or stores' stream refuses the manifest."""
    from kvmigrate.migrate import prune_stream

    age = DEFAULT_RESIDUE_AGE if older_than is None else older_than
    s = _Streams.gathered(manifest_path, meta, classes, _used_namespaces(root, migration_journal),
                          int(now * 1e9 - age * 1e9), chosen, engine_stopped)
    if s is None:
        return None
    names = prune_stream.Names()
    items = prune_spill.spill(s.rows(chosen), mf.row_count(manifest_path),
                              prune_stream.TargetReader(manifest_path, _TARGET_COLUMNS), names.codes, names.names,
                              tier_of=dict(s.tier_of.tier_of), stores=s.stores)
    skipped: dict[str, str] = dict(s.tiers.waiting) if s.tiers is not None else {}
    retires = s.store_rows.retires if s.store_rows is not None else []
    if chosen is not None:
        retires = [rw for rw in retires if set(rw.namespaces.values()) <= chosen]
    skip: set[str] = set()
    if quiet_period is not None:
        s.taken["stores"] |= {s.stores.label_of.get(rw.store, "") for rw in retires} - {""}
        for unit, (why, members, _) in sorted(s.live(manifest_path, root, quiet_period, now).items()):
            skipped[unit] = why
            skip.update(members)
    target_bases = s.plain.fig.target_bases | (s.tiers.target_bases if s.tiers is not None else set()) \
        | (s.store_rows.target_bases if s.store_rows is not None else set())
    emptied = s.plain.emptied() | (s.tiers.emptied if s.tiers is not None else set())
    return _Picked(items, skipped, skip, target_bases, emptied, retires, s.stores)


def build_plan(manifest_path: str, classes: Iterable[str] = ("migrated",), *, migration_journal: str | None = None,
               quiet_period: float = DEFAULT_QUIET_PERIOD, force_live: bool = False,
               older_than: float | None = None, now: float | None = None, selection: Any = None,
               engine_stopped: bool = False) -> PrunePlan:
    """Select what to prune from the manifest (typed columns) and the migration journals,
    then skip the namespaces that are live or whose target is locked. `selection`
    (--only/--exclude): take only the namespaces it selects (a vllm.cpp deployment as
    one; no file outside namespaces), the rules still read over the whole manifest, so a
    target or a migration's source is known as such whatever is selected. An LMCache tier
    is live or quiet as a whole (prune_tiers.units); its index_lost chunks wait for the
    statement that no engine uses it (its `engine_stopped` fact, or `engine_stopped`:
    --engine-stopped for every tier whose fact says nothing), which --force-live never gives."""
    classes = tuple(c for c in CLASSES if c in set(classes))
    if not classes:
        raise UsageError("nothing to select: give --migrated, --unreadable-namespaces, --residue or --index-lost")
    meta = mf.read_metadata(manifest_path)
    root = meta.get("root")
    if not isinstance(root, str) or not os.path.isdir(root):
        raise UsageError(f"the manifest's root {root!r} is not a folder", path=manifest_path,
                         hint="rescan the cache root with `kvmigrate scan ROOT`")
    now = time.time() if now is None else now
    chosen = None
    if selection:
        from kvmigrate.selection import selected_bases

        chosen = set(selected_bases(meta.get("namespaces") or {}, selection))
    args = (manifest_path, meta, classes, root, migration_journal, older_than, now, chosen,
            None if force_live else quiet_period, engine_stopped)
    stores, tiers, names = stores_.Stores.of(meta), tiers_.Tiers.of(meta), set(meta.get("namespaces") or {})
    if stores and not names - set(stores.store_of):
        picked = _picked_stores(*args) or _picked_whole(*args)
    elif tiers and not names - set(tiers.tier_of):
        picked = _picked_tiers(*args) or _picked_whole(*args)
    elif stores or tiers:
        picked = _picked_mixed(*args) or _picked_whole(*args)
    else:
        picked = _picked_streamed(*args)
    skipped, stores = picked.skipped, picked.stores
    items = without_namespaces(picked.items, picked.skip)
    retires = [rw for rw in picked.retires if stores.label_of.get(rw.store) not in skipped]
    locks = _locks(items)  # the target namespaces to lock while pruning into them: their base folders
    held = {ns for base, names in locks.items() if _lock_held(root, base) for ns in names}
    if held:  # the dry run says what --apply will skip (the apply takes the locks itself)
        skipped.update({ns: "its target is locked by a running kvmigrate migration; rerun when it is done"
                        for ns in held})
        items = without_namespaces(items, held)
        locks = {b: names - held for b, names in locks.items() if names - held}
    proofs = stores_.proofs(items, retires, stores, engine_stopped) if stores else {}
    return PrunePlan(root, manifest_path, classes, items, skipped, picked.target_bases, picked.emptied - picked.skip,
                     locks, orphaned=orphaned_namespaces(manifest_path, meta), retires=retires, store_proofs=proofs)


def _locks(items: Items) -> dict[str, set[str]]:
    """Target base -> the namespaces pruned into it (`target_base` of each item)."""
    locks: dict[str, set[str]] = {}
    if isinstance(items, prune_spill.PlanFile):
        for folder, ns in items.target_folders():
            base = _base_of(folder)
            if base is not None:
                locks.setdefault(base, set()).add(ns)  # type: ignore[arg-type]
        return locks
    for item in items:
        base = target_base(item)
        if base is not None:
            locks.setdefault(base, set()).add(item.namespace)
    return locks


def orphaned_namespaces(manifest_path: str, meta: dict[str, Any],
                        namespaces: set[str] | None = None) -> list[dict[str, Any]]:
    """Namespaces orphaned by the target profile (a folder a vLLM 0.24-0.33 gate collapsed,
    read by 0.34 only under the topology that wrote it, which nobody stated), with their
    files and bytes: no class prunes them (their blocks are `ok`, reusable once
    --writer-tp/--writer-pp are stated; after that migration `--migrated` takes them), but
    the figures name them, as what the target engine will not read until then."""
    from kvmigrate.identity.values import ORPHANED

    names = {base: (m.get("target") or {}).get("unreachable") for base, m in (meta.get("namespaces") or {}).items()
             if str((m.get("target") or {}).get("unreachable") or "").startswith(ORPHANED)
             and (namespaces is None or base in namespaces)}
    if not names:
        return []
    import pyarrow as pa

    figures: dict[str, tuple[int, int]] = {}
    for b in mf.iter_batches(manifest_path, columns=["source_base", "size"]):
        src = b["source_base"]
        src = src.cast(src.type.value_type) if pa.types.is_dictionary(src.type) else src
        per = pa.table({"ns": src, "size": b["size"]}).filter(_in(src, names)) \
            .group_by("ns").aggregate([("size", "sum"), ([], "count_all")])
        for base, z, n in zip(*(per[k].to_pylist() for k in ("ns", "size_sum", "count_all"))):
            was = figures.get(base, (0, 0))
            figures[base] = (was[0] + n, was[1] + (z or 0))
    return [{"namespace": base, "files": figures.get(base, (0, 0))[0], "bytes": figures.get(base, (0, 0))[1],
             "reason": why} for base, why in sorted(names.items())]


def without_namespaces(items: Items, namespaces: set[str]) -> Items:
    """The items minus those of `namespaces`, minus every block one of them holds a rank
    file of (a vllm.cpp block spans one namespace per rank), minus the config.json of any
    namespace that keeps something."""
    if not namespaces:
        return items
    if isinstance(items, prune_spill.PlanFile):
        return items.without(namespaces)
    dropped = {i.key for i in items if i.namespace in namespaces}
    keeps = {i.namespace for i in items if i.key in dropped} | namespaces
    return [i for i in items if i.key not in dropped
            and not (i.namespace in keeps and i.relpath == f"{i.namespace}/{layout.CONFIG_NAME}")]


# what prune says of a namespace it keeps because the target reads it only under its
# writer's topology (orphaned_namespaces)
ORPHANED_KEPT = ("orphaned by vLLM 0.34 (the folder does not record the topology that wrote it): state "
                 "--writer-tp/--writer-pp and migrate it, then --migrated takes it; no class prunes it before")

OUTSIDE = "(outside namespaces)"  # how the files of no namespace (namespace None) are named


def namespace_order(entry: tuple[tuple[str, str | None], Any]) -> tuple[str, str]:
    """Sort key of a ((class, namespace), figures) entry: files outside any namespace
    (SGLang temp files at the top of the root: namespace None) sort first."""
    (cls, ns), _ = entry
    return cls, ns or ""


def namespace_label(ns: str | None) -> str:
    return ns or OUTSIDE


def frees(nlink: int, selected_names: int) -> bool:
    """A pruned file frees its bytes (once purged) when every name of its inode is pruned;
    else another name, e.g. the target's hard link, keeps them: it is only unlinked (a
    file-count slot). The one rule of the plan, the apply's result and the reports."""
    return nlink <= selected_names


def reclaim_totals(rows: Iterable[tuple[str, str, int, int, int, int]], classes: Iterable[str] = CLASSES,
                   keep: set[str] | None = None) -> tuple[dict[str, dict[str, int]], dict[tuple[str, str], dict]]:
    """(per class, per (class, namespace)) files and bytes, freed and only unlinked, of
    rows (class, namespace, dev, inode, size, nlink); `keep`: tally those namespaces only
    (the names of an inode are counted over every row). Freed bytes count each inode once:
    two pruned names of one inode free its bytes once."""
    rows = list(rows)
    names = Counter((dev, ino) for _, _, dev, ino, _, _ in rows)
    counted: set[tuple[int, int]] = set()
    per_class = {c: dict.fromkeys(TOTAL_KEYS, 0) for c in classes}
    per_ns: dict[tuple[str, str], dict[str, int]] = {}
    for cls, ns, dev, ino, size, nlink in rows:
        if keep is not None and ns not in keep:
            continue
        how = "freed" if frees(nlink, names[(dev, ino)]) else "unlinked"
        once = how == "unlinked" or (dev, ino) not in counted
        counted.add((dev, ino))
        for t in (per_class.setdefault(cls, dict.fromkeys(TOTAL_KEYS, 0)),
                  per_ns.setdefault((cls, ns), dict.fromkeys(TOTAL_KEYS, 0))):
            t["files"] += 1
            t["bytes"] += size
            t[f"{how}_files"] += 1
            t[f"{how}_bytes"] += size if once else 0
    return per_class, per_ns


def _rows_of_items(items: Iterable[Item]) -> Iterator[tuple[str, str, int, int, int, int]]:
    return ((i.cls, i.namespace, i.dev, i.inode, i.size, i.nlink) for i in items)


def reclaimable(manifest_path: str, *, migration_journal: str | None = None, now: float | None = None,
                namespaces: set[str] | None = None) -> dict[str, Any]:
    """What `prune` selects in this manifest (the same `_select`), for `report` and
    `audit`: per class and namespace, what `prune --<class>` alone takes; the totals, what
    `prune --migrated --unreadable-namespaces --residue` takes (more than the classes' sum
    when only the classes together empty a namespace: its config.json goes then). Freed vs
    only unlinked. Read-only: the run-time checks (quiet period, held locks, a fresh stat)
    are prune's own. `namespaces`: only those (--only/--exclude). Tallied in Arrow, as
    `reclaim_totals` tallies a plan's items."""
    meta = mf.read_metadata(manifest_path)
    meta_root = meta.get("root")
    root = meta_root if isinstance(meta_root, str) else ""
    now = time.time() if now is None else now
    per_class: dict[str, dict[str, int]] = {c: dict.fromkeys(TOTAL_KEYS, 0) for c in CLASSES}
    per_ns: dict = {}
    totals = dict.fromkeys(TOTAL_KEYS, 0)
    skipped: list = []
    if _any_candidate(manifest_path):
        used = _used_namespaces(root, migration_journal)
        if tiers_.Tiers.of(meta) or stores_.Stores.of(meta):
            per_class, per_ns, totals, skipped = _reclaimable_streams(manifest_path, meta, root, used, now,
                                                                      namespaces) \
                or _reclaimable_whole(manifest_path, meta, root, used, now, namespaces)
        else:
            from kvmigrate.migrate import prune_stream

            per_class, per_ns, totals, skipped = prune_stream.reclaimable(manifest_path, meta, root, used, now,
                                                                          namespaces)
    out: dict[str, Any] = dict(totals)
    out["classes"] = per_class
    out["namespaces"] = [{"class": cls, "namespace": ns, **v}
                         for (cls, ns), v in sorted(per_ns.items(), key=namespace_order)]
    out["skipped"] = skipped
    out["orphaned"] = orphaned_namespaces(manifest_path, meta, namespaces)
    return out


def _reclaimable_whole(manifest_path: str, meta: dict[str, Any], root: str, used: tuple[set[str], set[str]],
                       now: float, namespaces: set[str] | None) -> tuple[dict, dict, dict, list]:
    """`reclaimable`'s (per class, per (class, namespace), totals, skipped) from `_select`
    over the manifest's columns whole: the reference `prune_stream` streams, and the path
    of manifests with LMCache tiers or Mooncake stores."""
    per_class = {c: dict.fromkeys(TOTAL_KEYS, 0) for c in CLASSES}
    per_ns: dict[tuple[str, str], dict[str, int]] = {}
    c = _read_columns(manifest_path, _COLUMNS)
    for cls in CLASSES:  # each class as `prune --<class>` selects it
        sel = _select(manifest_path, (cls,), root, None, None, now, meta, columns=c, journal_namespaces=used)
        for key, v in _tally(sel, namespaces).items():
            per_ns[key] = v
            for k in TOTAL_KEYS:
                per_class[cls][k] += v[k]
    sel = _select(manifest_path, CLASSES, root, None, None, now, meta, columns=c, journal_namespaces=used)
    together = _tally(sel, namespaces)
    totals = {k: sum(v[k] for v in together.values()) for k in TOTAL_KEYS}
    return per_class, per_ns, totals, _skipped_now(sel, {ns for _, ns in together}, now)


def _reclaimable_streams(manifest_path: str, meta: dict[str, Any], root: str, used: tuple[set[str], set[str]],
                         now: float, namespaces: set[str] | None) -> tuple[dict, dict, dict, list] | None:
    """`_reclaimable_whole` for a manifest with LMCache tiers or Mooncake stores, from each
    kind's streamed selection (`_Streams`), class by class and then all together: what it
    holds is the selected rows' stat (40-odd bytes each), not the manifest's columns.
    None when a stream refuses the manifest (the reference counts it)."""
    import pyarrow as pa

    from kvmigrate.migrate import prune_stream

    n = mf.row_count(manifest_path)
    cutoff = int(now * 1e9 - DEFAULT_RESIDUE_AGE * 1e9)
    names = prune_stream.Names()
    per_class = {c: dict.fromkeys(TOTAL_KEYS, 0) for c in CLASSES}
    per_ns: dict[tuple[str, str | None], dict[str, int]] = {}
    together: dict[tuple[str, str | None], dict[str, int]] = {}
    streams = None
    for classes in [*((c,) for c in CLASSES), CLASSES]:
        streams = None  # (the last class's passes let go before the next's are gathered)
        streams = _Streams.gathered(manifest_path, meta, classes, used, cutoff, None, False)
        if streams is None:
            return None
        if streams.tiers is not None:
            streams.tiers.waiting = {}  # (the figures count index_lost chunks whether or not a statement holds them)
        parts = [pa.table({"row": t["row"], "ns": names.codes(t["source_base"].combine_chunks()),
                           **{k: t[k] for k in ("dev", "inode", "size", "nlink", "code")}})
                 for t in streams.rows(None) if t.num_rows]
        if not parts:
            continue
        table = pa.concat_tables(parts)
        del parts
        keep = None if namespaces is None else {names.code[ns] for ns in namespaces if ns in names.code}
        tally = tally_stream(functools.partial(prune_stream._selected, table, "code", n), keep)
        del table
        named = {(cls, names.name(code)): v for (cls, code), v in tally.items()}
        if classes == CLASSES:
            together = named
            continue
        for key, v in named.items():
            per_ns[key] = v
            for k in TOTAL_KEYS:
                per_class[classes[0]][k] += v[k]
    totals = {k: sum(v[k] for v in together.values()) for k in TOTAL_KEYS}
    skipped: list[SkippedNamespace] = []
    if streams is not None and root and os.path.isdir(root):
        counted = {ns for _, ns in together if ns}
        live = streams.live(manifest_path, root, DEFAULT_QUIET_PERIOD, now, counted)
        for unit, (why, _, age) in sorted(live.items()):
            skipped.append({"namespace": unit, "written_s_ago": round(max(age, 0)),
                            "quiet_period_s": DEFAULT_QUIET_PERIOD, "reason": why})
    return per_class, per_ns, totals, skipped


class SkippedNamespace(TypedDict):
    """A namespace `prune` run now would skip, as the reports list it."""

    namespace: str
    written_s_ago: int
    quiet_period_s: float
    reason: str | None  # `_live`'s reason


def _skipped_now(sel: _Selected, names: set[str], now: float) -> list[SkippedNamespace]:
    """The namespaces counted above that `prune` run now would skip (written within the
    default quiet period), with the reason it would give: the reports say so rather than
    promise what a prune run now leaves."""
    if not sel.root or not os.path.isdir(sel.root):
        return []
    out: list[SkippedNamespace] = []
    for ns, (_, folders, newest_ns, tier) in sorted(_quiet_units(sel, names).items()):
        age = now - _newest_write(sel.root, folders, newest_ns)
        if age < DEFAULT_QUIET_PERIOD:
            out.append({"namespace": ns, "written_s_ago": round(max(age, 0)), "quiet_period_s": DEFAULT_QUIET_PERIOD,
                        "reason": _live(sel.root, ns, folders, DEFAULT_QUIET_PERIOD, now, newest_ns, tier=tier)})
    return out


def _tally(sel: _Selected, keep: set[str] | None) -> dict[tuple[str, str], dict[str, int]]:
    """Per (class, namespace) the files and bytes of the selection (`tally_stream`, its
    order of names class by class, rows in manifest order), of the namespaces `keep` only."""
    import pyarrow as pa
    import pyarrow.compute as pc

    c = sel.c
    mask = pc.and_(pc.not_equal(sel.code, 0), _prunable(c))
    code = pc.filter(sel.code, mask)
    rows = pc.filter(pa.array(range(len(mask)), pa.int64()), mask)
    cols = {"code": code, "ns": pc.filter(c["source_base"], mask),
            **{k: pc.filter(c[k], mask) for k in ("dev", "inode", "size", "nlink")},
            "ord": pc.add(pc.multiply(code.cast(pa.int64()), len(mask)), rows)}
    one = {k: v.combine_chunks() if isinstance(v, pa.ChunkedArray) else v for k, v in cols.items()}  # one batch
    return tally_stream(lambda: iter([one]), keep)


def _any_candidate(manifest_path: str) -> bool:
    """Some row could be selected (a block already at its target, or a status of a class):
    the two columns are read first, so a manifest with nothing to prune costs no more."""
    import pyarrow as pa
    import pyarrow.compute as pc

    statuses = pa.array([*UNREADABLE_STATUSES, *RESIDUE_STATUSES, "tmp_leftover", *tiers_.STALE_STATUSES,
                         *tiers_.PAIR_RESIDUE, tiers_.INDEX_LOST, *stores_.STATUSES])
    for b in mf.iter_batches(manifest_path, columns=["status", "action"]):
        plain = [pc.cast(b[k], pa.string()) if pa.types.is_dictionary(b[k].type) else b[k] for k in ("status", "action")]
        hit = pc.or_(pc.fill_null(pc.is_in(plain[0], value_set=statuses), False),
                     pc.fill_null(pc.equal(plain[1], "already_present"), False))
        if pc.any(hit).as_py():
            return True
    return False


def target_base(item: Item) -> str | None:
    """The base folder of the target namespace a migrated item's block is placed in."""
    return None if item.target is None else _base_of(item.target[0].split("/", 1)[0])


@functools.lru_cache(maxsize=1024)
def _base_of(folder_name: str) -> str | None:
    folder = layout.parse_folder(folder_name)
    return folder.base if folder is not None else None


def _lock_held(root: str, base: str) -> bool:
    """A migration holds the flock of the target's lock file (migrate/lock.py) right now."""
    try:
        fd = os.open(os.path.join(root, base, layout.LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _deployment(c: dict[str, list], i: int) -> str:
    return c["deployment"][i] or c["source_base"][i] or ""


def _key(c: dict[str, list], i: int) -> str:
    """The block a row is a rank file of (its deployment, group and hash); else its path."""
    h = c["block_hash"][i]
    return f"{_deployment(c, i)}/{c['group'][i]}:{h.hex()}" if h is not None else c["relpath"][i]


def _used_namespaces(root: str, migration_journal: str | None) -> tuple[set[str], set[str]]:
    """(target bases, source namespaces) of the migrations of `migration_journal`, or of
    ROOT's default journal folder."""
    return _journal_namespaces(migration_journal or jn.default_journal_dir(root)) \
        if migration_journal or root else (set(), set())


def _journal_namespaces(journal: str) -> tuple[set[str], set[str]]:
    """(target bases, source namespaces) of every migration run in the journal file or
    directory (none when there is none yet)."""
    if not os.path.exists(journal) or os.path.isdir(journal) and not any(
            jn.is_journal_name(f) for f in os.listdir(journal)):
        return set(), set()
    targets: set[str] = set()
    sources: set[str] = set()
    runs = (run for f in jn.journal_files(journal) for run in jn.run_states(f))
    for run in runs:
        if run.rolled_back:
            continue
        for base, rec in run.targets.items():
            targets.add(base)
            sources.update(rec.get("sources") or ())
    return targets, sources


def _namespace_folders(c: dict[str, Any], names: set[str]) -> dict[str, tuple[list[str], int]]:
    """Per namespace of `names`: its folders (relative to the root) and its newest file
    mtime in the manifest, from the unique parent folders of its rows (few: one pass in
    Arrow, not a Python string per row)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    names = {ns for ns in names if ns}
    if not names:
        return {}
    t = pa.table({"ns": c["source_base"], "dir": pc.replace_substring_regex(c["relpath"], "/[^/]*$", ""),
                  "slash": pc.match_substring(c["relpath"], "/"), "mtime": pc.fill_null(c["mtime_ns"], 0)}) \
        .filter(_in(c["source_base"], names))
    g = t.group_by(["ns", "dir", "slash"]).aggregate([("mtime", "max")])
    out: dict[str, tuple[set[str], int]] = {ns: (set(), 0) for ns in names}
    for ns, d, slash, mtime in zip(*(g[k].to_pylist() for k in ("ns", "dir", "slash", "mtime_max"))):
        folders, newest = out[ns]
        if slash:
            parts = d.split("/")
            folders.update("/".join(parts[:k]) for k in range(1, len(parts) + 1))
        out[ns] = (folders, max(newest, mtime))
    return {ns: (sorted(f), m) for ns, (f, m) in out.items()}


def _quiet_units(sel: _Selected, names: set[str]) -> dict[str, tuple[list[str], list[str], int, bool]]:
    """What the quiet period judges as one, for the namespaces `names`: unit -> (its
    namespaces, its folders, its newest file mtime in the manifest, whether it is a tier).
    A namespace is its own unit; an LMCache tier is one unit of all its deployments."""
    plain = names - set(sel.tiers.tier_of) - set(sel.stores.store_of)
    out = {ns: ([ns], folders, newest, False) for ns, (folders, newest) in _namespace_folders(sel.c, plain).items()}
    out.update({label: (members, folders, newest, True)
                for label, (members, folders, newest) in tiers_.units(sel.c, sel.tiers, names).items()})
    out.update({label: (members, folders, newest, False)  # a store is one unit (prune_stores.units)
                for label, (members, folders, newest) in stores_.units(sel.c, sel.stores, names).items()})
    return out


def _newest_write(root: str, folders: list[str], newest_file_ns: int) -> float:
    """The newest file mtime (the scan's) or folder mtime (a fresh lstat), in seconds."""
    newest = newest_file_ns / 1e9
    for d in folders:
        try:
            newest = max(newest, os.lstat(os.path.join(root, d)).st_mtime)
        except OSError:
            continue
    return newest


def _skip_live(root: str, units: dict[str, tuple[list[str], list[str], int, bool]], quiet_period: float,
               now: float, skipped: dict[str, str], skip: set[str]) -> None:
    """The quiet period over units (label -> (members, folders, newest file ns, a tier)): a
    unit written to within it is skipped (why, in `skipped`) with all its members."""
    for unit, (why, members, _) in sorted(_live_units(root, units, quiet_period, now).items()):
        skipped[unit] = why
        skip.update(members)


def _live_units(root: str, units: dict[str, tuple[list[str], list[str], int, bool]], quiet_period: float,
                now: float) -> dict[str, tuple[str, list[str], float]]:
    """The units written to within the quiet period: unit -> (why, its members, its age in s)."""
    out = {}
    for unit, (members, folders, newest_ns, tier) in units.items():
        newest = _newest_write(root, folders, newest_ns)
        why = _live_since(newest, quiet_period, now, tier)
        if why:
            out[unit] = (why, members, now - newest)
    return out


def _live(root: str, ns: str, folders: list[str], quiet_period: float, now: float, newest_file_ns: int, *,
          tier: bool = False) -> str | None:
    """Why a namespace counts as live: written (its newest file mtime, or the mtime of a
    folder of it) within the quiet period; None when it is quiet. An engine's write
    changes a file's mtime (in place) or its folder's mtime (a new file, a rename into
    place, an eviction); never a ctime alone, which kvmigrate's own hard link (the source
    inode), a chmod or an mtime restored from backup change (migration.md §6)."""
    return _live_since(_newest_write(root, folders, newest_file_ns), quiet_period, now, tier)


def _live_since(newest: float, quiet_period: float, now: float, tier: bool) -> str | None:
    """`_live` of a unit last written at `newest` (seconds)."""
    age = now - newest
    if age < quiet_period and tier:
        return tiers_.live_reason(age, newest, quiet_period)
    return live_reason(age, quiet_period) if age < quiet_period else None


# --- rendering -------------------------------------------------------------------------------


def render_plan(plan: PrunePlan, apply_command: str | None) -> str:
    from kvmigrate.units import human_bytes, plural

    lines = [f"prune plan for {plan.root}"]
    totals = plan.totals()
    for cls in plan.classes:
        t = totals[cls]
        lines.append(f"  {cls.replace('_', '-'):<24} {plural(t['files'], 'file'):>14} {human_bytes(t['bytes']):>10}; frees "
                     f"{human_bytes(t['freed_bytes'])} once purged, {plural(t['unlinked_files'], 'file')} only unlinked "
                     "(their bytes stay under another name: a file-count slot each)")
        for (c, ns), v in plan.by_namespace().items():
            if c == cls:
                lines.append(f"    {namespace_label(ns)}: {plural(v['files'], 'file')}, {human_bytes(v['bytes'])}; frees "
                             f"{human_bytes(v['freed_bytes'])}, {v['unlinked_files']} only unlinked")
    if plan.retires:
        n = sum(len(rw.keys) for rw in plan.retires)
        lines.append(f"  tails: {plural(n, 'short entry', 'short entries')} of "
                     f"{plural(len(plan.retires), 'live index', 'live indexes')} retired by an index rewrite "
                     "(is_exist stops claiming them; nothing freed)")
        for rw in plan.retires:
            lines.append(f"    {rw.meta}: entries {', '.join(str(i) for i in sorted(rw.keys))}")
    lines += stores_.describe(plan.store_proofs)
    for ns, why in sorted(plan.skipped.items()):
        lines.append(f"  skipped {ns}: {why}")
    lines += [f"  kept {o['namespace']}: {plural(o['files'], 'file')}, {human_bytes(o['bytes'])}, {ORPHANED_KEPT}"
              for o in plan.orphaned]
    if plan.items or plan.retires:
        lines.append(f"{plural(len(plan.items), 'file')} would move to {os.path.join(plan.root, QUARANTINE_DIR)}/<run>/ "
                     "(reversible: `kvmigrate restore JOURNAL`). Nothing was moved (dry run).")
        unproven = plan.unproven_stores()
        if apply_command:
            from kvmigrate.migrate.stores import apply_label

            lines.append(f"{apply_label(unproven) if unproven else 'to apply:'} {apply_command}")
    else:
        lines.append("nothing to prune.")
    return "\n".join(lines)
