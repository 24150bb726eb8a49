"""One summary model computed from a manifest: what every report format and `--json` print.

The manifest can hold millions of rows, so it is never turned into Python objects per
row: batches are streamed with only the needed columns, each batch is grouped with Arrow
(`Table.group_by`) into a few hundred aggregate rows (namespace x status x action x
reason x shared x hash length), and those small aggregates are merged in Python.

Blocks are counted with the rank-row rule (migration.md §1): a block that has an action
carries it on one row, its other rank files have the finding `replica_of_primary` or
`part_of_action` (kvmigrate.findings; the reason says "replica of rank 0" or "part of
<action> from rank 0"). So blocks = rows with an action + the distinct `(group, block_hash)` keys
of the remaining (`none`) rows of multi-rank namespaces, whose rank files are not told
apart; only those keys are kept (compact Arrow tables, de-duplicated as they grow).
Bytes of `part_of_action` rows count for the action their primary row has now (a concat
reads every shard; once placed, the primary is `already_present` while the part rows
still name `of_action`, so pending bytes are those of blocks still pending): each such
row is joined to its primary by (namespace, group, block hash), batch by batch, keeping
only the rows whose partner has not come yet (a block's rank files are written side by
side, so few). Bytes of `replica_of_primary` rows are reported as `replica_bytes`: copies
of a block that is taken from rank 0.

Merges are counted as the dry run counts them (migrate/plan.py): when several source
namespaces share a target, a target path that more than one of their pending rows would
fill is one block, placed from the first source in merge order (base-name order); each
other row is a *merge duplicate* (`merge_duplicates`), not pending. Only the target paths
of namespaces that share a target are kept for this (compact Arrow tables). Unlike the
dry run, the summary does not compare the candidates' bytes: differing candidates (a
conflict there) count as merge duplicates here.

`data_bytes` counts each file's bytes divided by its link count, so a file hard-linked
into its target counts once across both paths (exact when every link is under ROOT): a
migration by hard links leaves it unchanged, where `bytes` grows by every linked block.

`summarize(path)` returns a JSON-able dict with stable keys (kvmigrate.outputs.ReportOutput, documented in the README of
`interface.md` §1 plus the per-namespace fields of §3); renderers only format it.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc

from kvmigrate import families
from kvmigrate import findings as fd
from kvmigrate import manifest as mf

# The status enum with its exit-code bits (interface.md §2) and the actions in preference
# order (migration.md §1) are defined once, by the classifier that assigns them.
from kvmigrate.classify import ACTIONS as ACTION_ORDER
from kvmigrate.classify import STATUS_BITS
from kvmigrate.cost import TRANSFORMS, transform_cost, transform_cost_of
from kvmigrate.report import stores as st

if TYPE_CHECKING:  # the JSON models are types only (kvmigrate.outputs)
    from kvmigrate.outputs import (
        BlockCount,
        FileCount,
        Gate,
        MergeDuplicates,
        Namespace,
        ObjectCount,
        ObjectTally,
        OutsideNamespaces,
        ReportOutput,
        ScanFacts,
        SelectionStep,
        Totals,
        TransformCost,
    )

SUMMARY_VERSION = 1

STATUS_ORDER = tuple(STATUS_BITS)
REUSABLE_ACTIONS = ACTION_ORDER[:ACTION_ORDER.index("needs_slice")]
PENDING_ACTIONS = REUSABLE_ACTIONS[1:]  # reusable and not yet at the target
NEEDS_ACTIONS = ("needs_slice", "needs_concat", "needs_relayout", "needs_reshard")

# Rows that are files in the tree but never blocks, even when their name carries a hash.
NOT_BLOCK_STATUSES = frozenset({"tmp_leftover", "own_artifact", "foreign"})

_COLUMNS = ["relpath", "source_base", "status", "action", "reason", "size", "nlink", "block_hash", "group", "rank",
            "finding", "of_action", "output_bytes", "asks", "family", "object_index", "object_key"]
_MERGE_COLUMNS = ["target_base", "target_relpath", "target_key"]  # read only when source namespaces share a target
# the finding columns a group of rows is told apart by (besides its reason)
_FINDING_KEYS = ("finding", "of_action", "output_bytes", "asks")
_REASONS_KEPT = 32  # distinct reasons kept per (namespace, status, action); the rest are "other"
_KEY_COMPACT_ROWS = 1 << 20
# Rows a manifest is read by: a batch's buffers (and the compute over them, ~1 KiB a row)
# are the summary's working set, so they stay the same however many batches follow.
BATCH_ROWS = 16384

_C = TypeVar("_C", "BlockCount", "FileCount", "ObjectTally")  # the counts _ordered keeps in order

OUTSIDE = None  # source_base of rows outside any namespace (top-level foreign files...)


def _as_str(col: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """Dictionary-encoded strings -> plain strings (some kernels take only the latter)."""
    if pa.types.is_dictionary(col.type):
        return pc.cast(col, pa.string())
    return col


class _Totals:
    """Aggregates merged across batches: small dicts keyed by group, never by row."""

    def __init__(self, lowest_rank: dict[str, int], shared_target: frozenset[str] = frozenset(),
                 rank_folders: dict[str, int] | None = None):
        # (ns, status, action, reason, finding, shared, hash_len, at_lowest, kind) -> [rows, bytes]; kind
        # (OBJECT_*): a file, an object row of an index (counted apart from the disk's bytes,
        # mooncake.md §4), or a file that is one object (a KVEntry: both)
        self.groups: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
        self.reasons_seen: dict[tuple, set] = defaultdict(set)
        # (ns, status) -> (relpath, reason) of the first row seen
        self.examples: dict[tuple, tuple[str, str | None]] = {}
        self.lowest_rank = lowest_rank  # namespace -> its lowest rank folder (from the metadata)
        self._names = pa.array(sorted(lowest_rank), pa.string())
        self._lowest = pa.array([lowest_rank[b] for b in sorted(lowest_rank)], pa.int32())
        self._keys: list[pa.Table] = []
        self._key_rows = 0
        self.shared_target = pa.array(sorted(shared_target), pa.string())  # sources sharing their target
        self._paths: list[pa.Table] = []  # (target_base, target_relpath, ns, size) of their pending rows
        self.data_bytes: dict[str | None, float] = defaultdict(float)
        # namespaces with several rank folders: their blocks' other rank files follow a primary row
        multi = sorted(b for b, n in (rank_folders or {}).items() if n > 1)
        self.multi_rank = pa.array(multi, pa.string())
        self._followers = pa.array([(rank_folders or {})[b] - 1 for b in multi], pa.int64())  # per block, at most
        self._leads: pa.Table | None = None  # primary rows whose followers have not all come yet
        self._waiting: pa.Table | None = None  # follower rows whose primary has not come yet
        self.part_bytes: dict[tuple[str, str], int] = defaultdict(int)  # (ns, the primary's action) -> bytes
        self.outside_families: dict[str, int] = defaultdict(int)  # family -> files outside namespaces (temps)
        self.stores = st.StoreRows()  # the rows of Mooncake stores, for their section (report/stores.py)

    def add(self, batch: pa.RecordBatch) -> None:
        t = pa.Table.from_batches([batch])
        nlink = t["nlink"]
        ns = _as_str(t["source_base"])
        shared = pc.fill_null(pc.greater(nlink, pa.scalar(1, nlink.type)), False)
        # 1: the row sits in its namespace's lowest rank folder; 0: another rank; 2: unknown namespace
        lowest = pc.take(self._lowest, pc.index_in(ns, value_set=self._names))
        at_lowest = pc.fill_null(pc.cast(pc.equal(pc.fill_null(t["rank"], -1), lowest), pa.int8()), 2)
        work = pa.table({
            "ns": ns,
            "status": _as_str(t["status"]),
            "action": _as_str(t["action"]),
            "reason": _as_str(t["reason"]),
            **{k: _as_str(t[k]) for k in _FINDING_KEYS},
            "shared": shared,
            "hash_len": pc.binary_length(t["block_hash"]),
            "at_lowest": at_lowest,
            "size": pc.fill_null(t["size"], 0),
            "kind": _object_kind(t),
            # the file's share of its inode's bytes (data_bytes: a hard-linked file counted once)
            "share": pc.divide(pc.cast(pc.fill_null(t["size"], 0), pa.float64()),
                               pc.cast(pc.max_element_wise(pc.fill_null(nlink, 1), pa.scalar(1, nlink.type)),
                                       pa.float64())),
        })
        keys = ["ns", "status", "action", "reason", *_FINDING_KEYS, "shared", "hash_len", "at_lowest", "kind"]
        agg = work.group_by(keys).aggregate([("size", "sum"), ([], "count_all"), ("share", "sum")])
        for (ns_, status, action, reason, finding, of_action, out, asks, sh, hl, low, kind, nbytes,
             nfiles, share) in zip(*(agg[c].to_pylist() for c in (*keys, "size_sum", "count_all", "share_sum"))):
            if kind != OBJECT_ROW:
                self.data_bytes[ns_] += share or 0.0
            seen = self.reasons_seen[(ns_, status, action)]
            if reason not in seen:
                if len(seen) >= _REASONS_KEPT and finding not in fd.SECONDARY:
                    reason = "(other reasons)"
                seen.add(reason)
            g = self.groups[(ns_, status, action, reason, fd.Finding(finding, of_action=of_action, output_bytes=out,
                                                                    asks=asks), bool(sh), hl, low, kind)]
            g[0] += nfiles
            g[1] += nbytes or 0
        self._add_examples(work, t["relpath"])
        self.stores.add(t, work["ns"], work["kind"])
        self._add_outside_families(work, t)
        self._add_block_keys(work, t)
        self._add_target_paths(work, t)
        if len(self.multi_rank):
            self._add_followers(work, t)

    def _add_outside_families(self, work: pa.Table, t: pa.Table) -> None:
        """Files outside any namespace that a family's name still claims (an engine's temp
        leftovers in a flat directory), counted per family."""
        if "family" not in t.column_names:
            return
        rows = pa.table({"family": _as_str(t["family"])}).filter(
            pc.and_(pc.is_null(work["ns"]), pc.is_valid(t["family"])))
        if rows.num_rows:
            counts = rows.group_by(["family"]).aggregate([([], "count_all")])
            for family, n in zip(counts["family"].to_pylist(), counts["count_all"].to_pylist()):
                self.outside_families[family] += n

    _KEYS = ["ns", "group", "block_hash"]

    def _add_followers(self, work: pa.Table, t: pa.Table) -> None:
        """Join the rank files of multi-rank blocks (findings.SECONDARY) to their primary
        row, for the bytes of `part_of_action` rows under the action the primary has now.
        A primary is let go once all its namespace's other ranks have come, a follower once
        its primary has: what waits is a block split between batches."""
        in_multi = pc.fill_null(pc.is_in(work["ns"], value_set=self.multi_rank), False)
        keyed = pc.and_(in_multi, pc.is_valid(t["block_hash"]))
        secondary = pc.fill_null(pc.is_in(work["finding"], value_set=pa.array(fd.SECONDARY)), False)
        acting = pc.or_(pc.fill_null(pc.not_equal(work["action"], "none"), False),
                        pc.fill_null(pc.equal(work["finding"], fd.TARGET_OCCUPIED), False))  # its followers stay
        lead = pc.and_(pc.and_(keyed, pc.invert(secondary)),
                       pc.and_(pc.equal(work["at_lowest"], 1),
                               pc.and_(pc.fill_null(pc.equal(work["status"], "ok"), False), acting)))
        keys = {"ns": work["ns"], "group": pc.fill_null(t["group"], -1), "block_hash": t["block_hash"]}
        leads = pa.table({**keys, "action": work["action"],
                          "left": pc.take(self._followers, pc.index_in(work["ns"], value_set=self.multi_rank))}
                         ).filter(lead)
        follows = pa.table({**keys, "size": work["size"], "of_action": work["of_action"],
                            "part": pc.fill_null(pc.equal(work["finding"], fd.PART_OF_ACTION), False)}
                           ).filter(pc.and_(keyed, secondary))
        leads = pa.concat_tables([x for x in (self._leads, leads) if x is not None])
        follows = pa.concat_tables([x for x in (self._waiting, follows) if x is not None])
        if leads.num_rows and follows.num_rows:
            pairs = follows.join(leads.select([*self._KEYS, "action"]), keys=self._KEYS, join_type="inner")
            if pairs.num_rows:
                parts = pairs.filter(pairs["part"]).group_by(["ns", "action"]).aggregate([("size", "sum")])
                for ns, action, nbytes in zip(*(parts[c].to_pylist() for c in ("ns", "action", "size_sum"))):
                    self.part_bytes[(ns, action)] += nbytes
                came = pairs.group_by(self._KEYS).aggregate([([], "count_all")])
                leads = leads.join(came, keys=self._KEYS, join_type="left outer")
                left = pc.subtract(leads["left"], pc.fill_null(leads["count_all"], 0))
                leads = leads.drop_columns(["count_all", "left"]).append_column("left", left)
                follows = follows.join(came.select(self._KEYS), keys=self._KEYS, join_type="left anti")
                leads = leads.filter(pc.greater(leads["left"], 0))
        self._leads, self._waiting = leads, follows

    def followers_unmatched(self) -> None:
        """After the last batch: part rows whose primary never came count for their
        `of_action`, as the rows say."""
        w = self._waiting
        if w is None or not w.num_rows:
            return
        parts = w.filter(w["part"]).group_by(["ns", "of_action"]).aggregate([("size", "sum")])
        for ns, action, nbytes in zip(*(parts[c].to_pylist() for c in ("ns", "of_action", "size_sum"))):
            self.part_bytes[(ns, action)] += nbytes
        self._waiting = None

    def _add_target_paths(self, work: pa.Table, t: pa.Table) -> None:
        """Target paths of the pending rows of namespaces that share their target (merges)."""
        if not len(self.shared_target):
            return
        mask = pc.and_(pc.fill_null(pc.is_in(work["action"], value_set=pa.array(PENDING_ACTIONS)), False),
                       pc.fill_null(pc.is_in(work["ns"], value_set=self.shared_target), False))
        # a target is a path, and within a client root's index a storage key (mooncake.md §4)
        key = pc.fill_null(t["target_key"], b"") if "target_key" in t.column_names else pa.nulls(t.num_rows, pa.binary())
        rows = pa.table({"target_base": _as_str(t["target_base"]), "target_relpath": t["target_relpath"],
                         "target_key": pc.fill_null(key, b""), "ns": work["ns"], "action": work["action"],
                         "size": work["size"]}).filter(mask)
        if rows.num_rows:
            self._paths.append(rows)

    def merge_duplicates(self) -> dict[str, dict[str, list[int]]]:
        """Per source namespace and action: [blocks, bytes] of its pending rows at a target
        path that a namespace before it in merge order (base-name order) fills."""
        if not self._paths:
            return {}
        rows = pa.concat_tables(self._paths).combine_chunks()
        if rows.num_rows < 2:
            return {}
        # sorted by path then source: a row whose path is its predecessor's is a duplicate
        rows = rows.take(pc.sort_indices(rows, [("target_base", "ascending"), ("target_relpath", "ascending"),
                                                ("target_key", "ascending"), ("ns", "ascending")]))
        same = pc.and_(pc.and_(pc.equal(rows["target_relpath"][1:], rows["target_relpath"][:-1]),
                               pc.equal(rows["target_base"][1:], rows["target_base"][:-1])),
                       pc.equal(rows["target_key"][1:], rows["target_key"][:-1]))
        dup = rows.slice(1).filter(pc.fill_null(same, False))
        if not dup.num_rows:
            return {}
        counts = dup.group_by(["ns", "action"]).aggregate([([], "count_all"), ("size", "sum")])
        out: dict[str, dict[str, list[int]]] = defaultdict(dict)
        for ns, action, n, b in zip(*(counts[c].to_pylist() for c in ("ns", "action", "count_all", "size_sum"))):
            out[ns][action] = [n, b]
        return out

    def _add_examples(self, work: pa.Table, relpath: pa.ChunkedArray) -> None:
        mask = pc.invert(pc.is_in(work["status"], value_set=pa.array(["ok", "own_artifact"])))
        mask = pc.fill_null(mask, True)
        rows = pa.table({"ns": work["ns"], "status": work["status"], "relpath": relpath,
                         "reason": work["reason"]}).filter(mask)
        if not rows.num_rows:
            return
        first = rows.group_by(["ns", "status"], use_threads=False).aggregate(
            [("relpath", "first"), ("reason", "first")])
        for ns, status, rel, reason in zip(*(first[c].to_pylist() for c in (
                "ns", "status", "relpath_first", "reason_first"))):
            self.examples.setdefault((ns, status), (rel, reason))

    def _add_block_keys(self, work: pa.Table, t: pa.Table) -> None:
        """Keys of the rare `none` rows that may belong to a block without a row in the
        lowest rank folder: `incomplete` rows, and rows of namespaces the metadata does not
        list. Every other `none` block is counted by its lowest-rank row (see summarize)."""
        not_block = pc.fill_null(pc.is_in(work["status"], value_set=pa.array(sorted(NOT_BLOCK_STATUSES))), False)
        action_none = pc.fill_null(pc.equal(work["action"], "none"), True)
        secondary = pc.fill_null(pc.is_in(work["finding"], value_set=pa.array(fd.SECONDARY)), False)
        rare = pc.or_(pc.fill_null(pc.equal(work["status"], "incomplete"), False), pc.equal(work["at_lowest"], 2))
        mask = pc.and_(pc.and_(pc.is_valid(t["block_hash"]), pc.invert(not_block)),
                       pc.and_(pc.and_(action_none, pc.invert(secondary)), pc.and_(rare, pc.is_valid(work["ns"]))))
        keys = pa.table({"ns": work["ns"], "group": t["group"], "block_hash": t["block_hash"],
                         "at_lowest": work["at_lowest"]}).filter(mask)
        if not keys.num_rows:
            return
        self._keys.append(keys.group_by(["ns", "group", "block_hash"]).aggregate([("at_lowest", "max")])
                          .rename_columns(["ns", "group", "block_hash", "at_lowest"]))
        self._key_rows += self._keys[-1].num_rows
        if self._key_rows > _KEY_COMPACT_ROWS:
            self._compact()

    def _compact(self) -> None:
        merged = pa.concat_tables(self._keys).combine_chunks()
        merged = merged.group_by(["ns", "group", "block_hash"]).aggregate([("at_lowest", "max")])
        self._keys = [merged.rename_columns(["ns", "group", "block_hash", "at_lowest"])]
        self._key_rows = self._keys[0].num_rows

    def blocks_without_lowest_row(self) -> dict[str | None, int]:
        """Per namespace: blocks none of whose rows is in the lowest rank folder (or whose
        namespace has no rank list), i.e. blocks the lowest-rank count missed."""
        if not self._keys:
            return {}
        self._compact()
        extra = self._keys[0].filter(pc.not_equal(self._keys[0]["at_lowest"], 1))
        if not extra.num_rows:
            return {}
        counts = extra.group_by(["ns"]).aggregate([([], "count_all")])
        return dict(zip(counts["ns"].to_pylist(), counts["count_all"].to_pylist()))


def _ordered(d: Mapping[str, _C], order: tuple[str, ...]) -> dict[str, _C]:
    """Known keys in spec order, unknown ones after (sorted); zero entries (a count and
    bytes both 0) dropped."""
    out = {k: d[k] for k in order if k in d and any(d[k].values())}
    out.update({k: d[k] for k in sorted(d) if k not in out and any(d[k].values())})
    return out


@dataclass
class _Aggregate:
    """One namespace's counters, folded from the merged groups (`_namespace_aggregates`)."""

    files: int = 0
    bytes: int = 0
    block_rows: int = 0
    block_bytes: int = 0
    bytes_alone: int = 0
    bytes_shared: int = 0
    by_status: defaultdict[str, FileCount] = field(default_factory=lambda: defaultdict(_no_files))
    lead_blocks: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    action_bytes: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    none_rows: int = 0
    replica_files: int = 0
    replica_bytes: int = 0
    reasons: defaultdict[str, defaultdict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    hash_bytes: set[int] = field(default_factory=set)
    aliases_source: int = 0
    flags_asked: defaultdict[str, defaultdict[str, int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    transform_out: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    objects: int = 0  # objects a store holds (index entries and KVEntries), apart from its files
    object_bytes: int = 0
    object_by_status: defaultdict[str, FileCount] = field(default_factory=lambda: defaultdict(_no_files))
    object_by_action: defaultdict[str, FileCount] = field(default_factory=lambda: defaultdict(_no_files))


FILE_ROW, OBJECT_ROW, FILE_OBJECT = st.FILE_ROW, st.OBJECT_ROW, st.FILE_OBJECT  # what a row counts as (mooncake.md §4)


def _object_kind(t: pa.Table) -> pa.Array:
    """Per row: FILE_ROW, OBJECT_ROW (an index entry: `object_index` set) or FILE_OBJECT (a
    file that is one object: `object_key` set on a file row)."""
    if "object_index" not in t.column_names:
        return pa.array([FILE_ROW] * t.num_rows, pa.int8())
    entry = pc.is_valid(t["object_index"])
    keyed = pc.is_valid(t["object_key"])
    return pc.cast(pc.if_else(entry, OBJECT_ROW, pc.if_else(keyed, FILE_OBJECT, FILE_ROW)), pa.int8())


def _no_files() -> FileCount:
    return {"files": 0, "bytes": 0}


def _namespace_aggregates(groups: dict[tuple, list[int]], joined: frozenset[str] = frozenset(),
                          part_bytes: dict[tuple[str, str], int] | None = None) -> dict[str | None, _Aggregate]:
    """Fold the merged groups into per-namespace counters; the part rows of the `joined`
    namespaces count for their primary's action (`part_bytes`, _Totals._add_followers)."""
    per_ns: dict[str | None, _Aggregate] = {}
    for (ns, status, action, reason, found, shared, hash_len, at_lowest, kind), (files, nbytes) in groups.items():
        a = per_ns.get(ns)
        if a is None:
            a = per_ns[ns] = _Aggregate()
        if kind != FILE_ROW:
            a.objects += files
            a.object_bytes += nbytes
            for ost in (a.object_by_status[status or "unknown"], a.object_by_action[action or "none"]):
                ost["files"] += files
                ost["bytes"] += nbytes
        if kind == OBJECT_ROW:  # its bytes are its bucket's, counted by the bucket's file row
            _count_block_rows(a, ns, status, action, reason, found, hash_len, at_lowest, files, nbytes, joined)
            continue
        a.files += files
        a.bytes += nbytes
        if shared:
            a.bytes_shared += nbytes
        else:
            a.bytes_alone += nbytes
        st = a.by_status[status or "unknown"]
        st["files"] += files
        st["bytes"] += nbytes
        _count_block_rows(a, ns, status, action, reason, found, hash_len, at_lowest, files, nbytes, joined)
    for (ns, action), nbytes in (part_bytes or {}).items():
        if ns in per_ns:
            per_ns[ns].action_bytes[action or "none"] += nbytes
    return per_ns


def _count_block_rows(a: _Aggregate, ns: str | None, status: str | None, action: str | None, reason: str | None,
                      found: fd.Finding, hash_len: int | None, at_lowest: int, files: int, nbytes: int,
                      joined: frozenset[str]) -> None:
    """The block counters of a group of rows (a block file's, or an object's: each is a block)."""
    if hash_len is None or status in NOT_BLOCK_STATUSES:
        return
    a.block_rows += files
    a.block_bytes += nbytes
    a.hash_bytes.add(hash_len)
    action = action or "none"
    secondary = action == "none" and found.code in fd.SECONDARY
    part_of = found.of_action if action == "none" and found.code == fd.PART_OF_ACTION else None
    if action == "none" and found.code == fd.REPLICA_OF_PRIMARY:
        a.replica_files += files
        a.replica_bytes += nbytes
    elif not (part_of and ns in joined):
        a.action_bytes[part_of or action] += nbytes
    if action != "none":
        a.lead_blocks[action] += files
    elif at_lowest == 1 and not secondary:
        a.none_rows += files  # one row per `none` block in the lowest rank folder
    if action in TRANSFORMS:
        # bytes written per block (the finding's output_bytes); without it, the bytes
        # of the rows that carry the action (an estimate)
        out = found.output_bytes
        a.transform_out[action] += files * out if out is not None else nbytes
    if (action == "none" or action in NEEDS_ACTIONS) and found.code not in fd.SECONDARY:
        a.reasons[action][reason or "(no reason)"] += files
        if found.code in fd.ALIASING:
            a.aliases_source += files
        for flag in fd.asked_flags(found.asks):
            a.flags_asked[action][flag] += files


def _gate(target: dict[str, Any] | None) -> Gate:
    if not target:
        return {"parallel_agnostic": None, "replicated_layout": None, "reasons": [], "by_name": False}
    return {"parallel_agnostic": target.get("parallel_agnostic"),
            "replicated_layout": target.get("replicated_layout"),
            "reasons": list(target.get("reasons") or []),
            # a flat family's target is page names, not a folder a gate picks (docs/families.md §3)
            "by_name": bool(target.get("profile")) and not target.get("base_name")}


def _target_base(base: str, meta: dict[str, Any], target: dict[str, Any] | None) -> str | None:
    """The target namespace's name: a flat deployment's is the one its pages are named
    into (as a rescan labels them), since it has no folder."""
    if not target or target.get("base_name") or not target.get("profile"):
        return (target or {}).get("base_name")
    fam = families.get(meta.get("family"))
    return fam.flat_target(base, meta.get("config_json") or {}) if fam.root_layout == "flat" else None


def _claims(meta: dict[str, Any]) -> list[str]:
    """identity.md §4: re-keying "auto" dtype or an S2 TP=1 folder trusts the operator."""
    target = meta.get("target") or {}
    if not target:
        return []
    source = meta.get("config_json") or {}
    tfields = target.get("fields") or {}
    sources = meta.get("facts_source") or {}
    assumed = meta.get("assumed_facts") or {}
    claims = []
    if source.get("dtype") == "auto" and tfields.get("dtype") not in (None, "auto"):
        how = sources.get("model_dtype", "--model-dtype")
        claims.append(
            f're-keying dtype "auto" as {tfields["dtype"]} trusts the model dtype claim ({how}): '
            'a folder with dtype "auto" may mix fp16 and bf16 pages written by different engines (vLLM #49438)')
    if (meta.get("scheme") == "S2" and source.get("tp_size") == 1 and target.get("d12") is not None
            and target.get("d12") != meta.get("source_d12")):
        runner = (meta.get("facts") or {}).get("runner") or assumed.get("runner") or "v1"
        how = "assumed" if "runner" in assumed else sources.get("runner", "--runner")
        claims.append(
            f"re-keying a TP=1 S2 folder trusts that every page was written by the {runner} model runner "
            f"({how}): such folders may mix V1 and V2 runner pages (vLLM #49440)")
    claims += list(target.get("claims") or ())  # the operator's statements the target itself rests on
    return claims


def _objects_entry(agg: _Aggregate) -> ObjectCount:
    """The objects of a namespace (a Mooncake deployment's index entries and KVEntries), by
    status and action: counted apart from its files (mooncake.md §4)."""
    def tally(counts: Mapping[str, FileCount], order: Any) -> dict[str, ObjectTally]:
        tallies: dict[str, ObjectTally] = {k: {"objects": v["files"], "bytes": v["bytes"]} for k, v in counts.items()}
        return _ordered(tallies, order)

    return {"objects": agg.objects, "bytes": agg.object_bytes,
            "by_status": tally(agg.object_by_status, STATUS_ORDER), "by_action": tally(agg.object_by_action, ACTION_ORDER)}


def _sum_objects(entries: list[ObjectCount]) -> ObjectCount:
    out: ObjectCount = {"objects": 0, "bytes": 0, "by_status": {}, "by_action": {}}
    for e in entries:
        out["objects"] += e["objects"]
        out["bytes"] += e["bytes"]
        for key, order in (("by_status", STATUS_ORDER), ("by_action", ACTION_ORDER)):
            merged: dict[str, ObjectTally] = dict(out[key])  # type: ignore[literal-required]
            for k, v in e[key].items():  # type: ignore[literal-required]
                m = merged.setdefault(k, {"objects": 0, "bytes": 0})
                merged[k] = {"objects": m["objects"] + v["objects"], "bytes": m["bytes"] + v["bytes"]}
            out[key] = _ordered(merged, order)  # type: ignore[literal-required]
    return out


def _cost(action: str, blocks: int, source_bytes: int, output_bytes: int) -> TransformCost:
    return transform_cost_of(transform_cost(action, blocks, source_bytes, output_bytes))


def _namespace_entry(base: str, meta: dict[str, Any], agg: _Aggregate | None,
                     extra_blocks: dict[Any, int], merges: dict[str, list[int]] | None = None,
                     data_bytes: float = 0.0) -> Namespace:
    agg = agg or _Aggregate()
    target = meta.get("target") or None
    none_blocks = agg.none_rows + extra_blocks.get(base, 0)
    counted: dict[str, BlockCount] = {
        a: {"blocks": agg.lead_blocks.get(a, 0), "bytes": agg.action_bytes.get(a, 0)}
        for a in set(agg.lead_blocks) | set(agg.action_bytes) if a != "none"}
    counted["none"] = {"blocks": none_blocks, "bytes": agg.action_bytes.get("none", 0)}
    blocks = sum(v["blocks"] for v in counted.values())
    by_action = _ordered(counted, ACTION_ORDER)
    reusable = _sum_actions(by_action, REUSABLE_ACTIONS)
    pending = _sum_actions(by_action, PENDING_ACTIONS)
    merged: MergeDuplicates = {
        "blocks": sum(n for n, _ in (merges or {}).values()),
        "bytes": sum(b for _, b in (merges or {}).values()),
        "by_action": {a: {"blocks": n, "bytes": b} for a, (n, b) in sorted((merges or {}).items())}}
    # a merge duplicate is placed by another source
    pending = {"blocks": pending["blocks"] - merged["blocks"], "bytes": pending["bytes"] - merged["bytes"]}
    reasons: dict[str, list[list[str | int]]] = {
        a: [[r, n] for r, n in sorted(rs.items(), key=lambda x: (-x[1], x[0]))[:5]] for a, rs in agg.reasons.items()}
    entry: Namespace = {
        "source_base": base,
        "family": meta.get("family"),
        "family_evidence": list(meta.get("family_evidence") or []),
        "scheme": meta.get("scheme"),
        "model_name": meta.get("model_name"),
        "ranks": list(meta.get("ranks") or []),
        "deployment": meta.get("deployment"),
        "status": meta.get("status"),
        "status_reason": meta.get("status_reason") or None,
        "notes": list(meta.get("notes") or []),
        "digest_ok": meta.get("digest_ok"),
        "config_error": meta.get("config_error"),
        "unknown_keys": list(meta.get("unknown_keys") or []),
        "hash_bytes": sorted(agg.hash_bytes),
        "target_profile": (target or {}).get("profile"),
        "target_family": (target or {}).get("family"),
        "target_base": _target_base(base, meta, target),
        "target_rank_dir": (target or {}).get("rank_dir"),
        "target_d12": (target or {}).get("d12"),
        "target_error": meta.get("target_error"),
        "target_error_flag": meta.get("target_error_flag"),
        "target_refused_flag": meta.get("target_refused_flag"),
        "target_unreachable": (target or {}).get("unreachable"),
        # facts not given that would change the target (a guess until stated), and the defaults it rests on
        "target_missing_facts": list((target or {}).get("missing_facts") or []),
        "target_decisive_assumptions": dict((target or {}).get("decisive_assumptions") or {}),
        "gate": _gate(target),
        "facts": dict(meta.get("facts") or {}),
        "facts_source": dict(meta.get("facts_source") or {}),
        "assumed_facts": dict(meta.get("assumed_facts") or {}),
        "claims": _claims(meta),
        "files": agg.files,
        "bytes": agg.bytes,
        "blocks": blocks,
        "block_bytes": agg.block_bytes,
        "bytes_alone": agg.bytes_alone,
        "bytes_shared": agg.bytes_shared,
        "data_bytes": round(data_bytes),
        "by_status": _ordered({k: _file_count(v) for k, v in agg.by_status.items()}, STATUS_ORDER),
        "by_action": by_action,
        "reusable": reusable,
        "pending": pending,
        "merge_duplicates": merged,
        "not_reusable": {"blocks": blocks - reusable["blocks"],
                         "bytes": agg.block_bytes - reusable["bytes"] - agg.replica_bytes},
        "replicas": {"files": agg.replica_files, "bytes": agg.replica_bytes},
        "top_reasons": reasons,
        "aliases_source_blocks": agg.aliases_source,
        "flags_asked": {a: dict(sorted(f.items())) for a, f in sorted(agg.flags_asked.items())},
        # what the pending transforms cost (bytes to write, estimated time) and save or spend
        "transform_cost": {a: _cost(a, by_action[a]["blocks"], by_action[a]["bytes"], agg.transform_out.get(a, 0))
                           for a in TRANSFORMS if a in by_action},
    }
    if agg.objects:
        entry["objects"] = _objects_entry(agg)
    return entry


def _file_count(v: FileCount) -> FileCount:
    return {"files": v["files"], "bytes": v["bytes"]}


def _sum_actions(by_action: Mapping[str, BlockCount], actions: tuple[str, ...]) -> BlockCount:
    return {"blocks": sum(by_action[a]["blocks"] for a in actions if a in by_action),
            "bytes": sum(by_action[a]["bytes"] for a in actions if a in by_action)}


def _merge_files(items: list[dict[str, FileCount]]) -> dict[str, FileCount]:
    out: dict[str, FileCount] = {}
    for d in items:
        for k, v in d.items():
            o = out.setdefault(k, {"files": 0, "bytes": 0})
            o["files"] += v["files"]
            o["bytes"] += v["bytes"]
    return _ordered(out, STATUS_ORDER)


def _merge_blocks(items: list[dict[str, BlockCount]]) -> dict[str, BlockCount]:
    out: dict[str, BlockCount] = {}
    for d in items:
        for k, v in d.items():
            o = out.setdefault(k, {"blocks": 0, "bytes": 0})
            o["blocks"] += v["blocks"]
            o["bytes"] += v["bytes"]
    return _ordered(out, ACTION_ORDER)


def _batches(path: str | os.PathLike[str], columns: list[str]):
    """Stream a manifest file or dataset directory. Unlike the default reader it does not
    pre-buffer whole row groups: the summary's memory stays flat as manifests grow."""
    import pyarrow.parquet as pq

    for f in mf._parquet_files(path):
        read, missing = mf._present(f, columns)  # (a version 3 manifest has no object columns)
        for batch in pq.ParquetFile(f, pre_buffer=False).iter_batches(batch_size=BATCH_ROWS, columns=read):
            yield mf._with_nulls(batch, missing, columns) if missing else batch


def exit_code_of(statuses: list[str] | set[str] | dict, *, target_errors: bool = False) -> int:
    """OR of the interface.md §2 bits of the states present (+1 when a target is refused or a guess)."""
    code = 0
    for s in statuses:
        code |= STATUS_BITS.get(s, 1)
    if target_errors:
        code |= 1
    return code


def totals_for(meta: dict[str, Any]) -> _Totals:
    """An empty accumulator for the rows of a manifest with this metadata. A writer that
    `add`s every batch it writes can pass it to `summarize(..., totals=)`, which then does
    not read the rows back (scan: no second pass over a million rows)."""
    ns_meta: dict[str, dict[str, Any]] = meta.get("namespaces") or {}
    sources: dict[str, list[str]] = defaultdict(list)  # target base -> its source namespaces
    for b, m in ns_meta.items():
        if (m.get("target") or {}).get("base_name"):
            sources[m["target"]["base_name"]].append(b)
    shared = frozenset(b for bs in sources.values() if len(bs) > 1 for b in bs)
    return _Totals({b: min(m["ranks"]) for b, m in ns_meta.items() if m.get("ranks")}, shared,
                   {b: len(m["ranks"]) for b, m in ns_meta.items() if m.get("ranks")})


def summarize(path: str | os.PathLike[str], *, manifest: str | None | bool = True,
              verb: str = "scan", totals: _Totals | None = None, selection: Any = None) -> ReportOutput:
    """The summary of a manifest file or dataset directory.

    `manifest` is the manifest path that hints may tell the user to reuse (True: `path`
    itself; None: it will not survive, e.g. audit's temporary manifest). `verb` is the
    command a hint re-runs with a missing fact (`scan` or `audit`). `totals`: the rows
    already aggregated (see `totals_for`). `selection` (kvmigrate.selection, report
    --only/--exclude): the namespaces to report; the totals are theirs, rows outside any
    namespace are left out, and `selection` in the summary says the report is partial.
    """
    from kvmigrate.report.hints import findings_and_hints, target_is_guess, target_orphaned
    from kvmigrate.report.tiers import tiers_of

    meta = mf.read_metadata(path)
    ns_meta: dict[str, dict[str, Any]] = meta.get("namespaces") or {}
    if totals is None:
        totals = totals_for(meta)
        stores = any(st.is_store(m) for m in ns_meta.values())  # (their migrated class reads the target columns)
        for batch in _batches(path, _COLUMNS + (_MERGE_COLUMNS if len(totals.shared_target) or stores else [])):
            totals.add(batch)
    totals.followers_unmatched()
    per_ns = _namespace_aggregates(totals.groups, frozenset(totals.multi_rank.to_pylist()), totals.part_bytes)
    extra_blocks = totals.blocks_without_lowest_row()
    merges = totals.merge_duplicates()
    namespaces = [
        _namespace_entry(base, ns_meta.get(base, {}), per_ns.get(base), extra_blocks, merges.get(base),
                         totals.data_bytes.get(base, 0.0))
        for base in sorted(b for b in (set(ns_meta) | set(per_ns)) if b is not OUTSIDE)
    ]
    steps: list[SelectionStep] = [_scan_step(meta["selection"])] if meta.get("selection") else []
    no_cache = mf.holds_no_cache(meta, {s for a in per_ns.values() for s in a.by_status})
    outside = per_ns.get(OUTSIDE)
    if selection:
        kept = [n for n in namespaces
                if selection.admits_namespace(n["source_base"], ns_meta.get(n["source_base"], {}))]
        chosen = selection.metadata()
        steps.append({"only": chosen["only"], "exclude": chosen["exclude"], "partial": True, "by": "report",
                      "skipped_namespaces": [n["source_base"] for n in namespaces if n not in kept]})
        namespaces, outside = kept, None
    outside_entry: OutsideNamespaces | None = None
    if outside:
        outside_entry = {
            "files": outside.files, "bytes": outside.bytes,
            "families": dict(sorted(totals.outside_families.items())),  # files a family's name claims
            "by_status": _ordered({k: _file_count(v) for k, v in outside.by_status.items()}, STATUS_ORDER),
        }
    every: list[Namespace | OutsideNamespaces] = [*namespaces, *([outside_entry] if outside_entry else [])]
    by_action = _merge_blocks([n["by_action"] for n in namespaces])
    merged: MergeDuplicates = {"blocks": sum(n["merge_duplicates"]["blocks"] for n in namespaces),
                               "bytes": sum(n["merge_duplicates"]["bytes"] for n in namespaces),
                               "by_action": _merge_blocks([n["merge_duplicates"]["by_action"] for n in namespaces])}
    reusable = _sum_actions(by_action, REUSABLE_ACTIONS)
    pending = _sum_actions(by_action, PENDING_ACTIONS)
    blocks = sum(n["blocks"] for n in namespaces)
    block_bytes = sum(n["block_bytes"] for n in namespaces)
    replicas: FileCount = {"files": sum(n["replicas"]["files"] for n in namespaces),
                           "bytes": sum(n["replicas"]["bytes"] for n in namespaces)}
    totals_entry: Totals = {
        "files": sum(n["files"] for n in every),
        "bytes": sum(n["bytes"] for n in every),
        "blocks": blocks,
        "block_bytes": block_bytes,
        "replicas": replicas,
        "bytes_alone": sum(n["bytes_alone"] for n in namespaces) + (outside.bytes_alone if outside else 0),
        "bytes_shared": sum(n["bytes_shared"] for n in namespaces) + (outside.bytes_shared if outside else 0),
        "data_bytes": sum(n["data_bytes"] for n in namespaces) + round(totals.data_bytes.get(OUTSIDE, 0.0)),
        "merge_duplicates": merged,
        "by_status": _merge_files([n["by_status"] for n in every]),
        "by_action": by_action,
        "namespaces": len(namespaces),
        "transform_cost": {
            a: _cost(a, *(sum(n["transform_cost"][a][k] for n in namespaces if a in n["transform_cost"])
                          for k in ("blocks", "source_bytes", "output_bytes")))
            for a in TRANSFORMS if any(a in n["transform_cost"] for n in namespaces)},
        "reusable": reusable,
        "pending": {"blocks": pending["blocks"] - merged["blocks"], "bytes": pending["bytes"] - merged["bytes"]},
        "not_reusable": {"blocks": blocks - reusable["blocks"],
                         "bytes": block_bytes - reusable["bytes"] - replicas["bytes"]},
    }
    if any("objects" in n for n in namespaces):
        totals_entry["objects"] = _sum_objects([n["objects"] for n in namespaces if "objects" in n])
    statuses = set(totals_entry["by_status"]) | {n["status"] for n in namespaces if n["status"] not in (None, "ok")}
    statuses |= set(totals_entry["objects"]["by_status"]) if "objects" in totals_entry else set()  # (an index's entries)
    walk_errors = list(meta.get("walk_errors") or [])
    summary: ReportOutput = {
        "summary_version": SUMMARY_VERSION,
        "tool_version": meta.get("tool_version"),
        "command": meta.get("command"),
        "root": meta.get("root"),
        "target_profile": meta.get("target_profile"),
        "verify": meta.get("verify"),
        "shard": meta.get("shard"),
        "facts": _scan_facts(meta.get("facts")),
        "selection": steps or None,  # --only/--exclude of the scan, then of the report: a partial view
        "manifest": str(Path(path).resolve()) if manifest is True else (manifest or None),
        "totals": totals_entry,
        "namespaces": namespaces,
        "outside_namespaces": outside_entry,
        "walk_errors": walk_errors,
        "walk_failed": bool(meta.get("walk_failed")),
        "no_cache": no_cache,  # nothing here: an empty or unmounted root (exit bit 8)
        "missing_facts": [{"namespace": n["source_base"], "flag": n["target_error_flag"], "error": error}
                          for n in namespaces if (error := n["target_error"])],

        "exit_code": (exit_code_of(statuses, target_errors=any(n["target_error"] or target_is_guess(n)
                                                               or target_orphaned(n) for n in namespaces))
                      | (1 if totals_entry["pending"]["blocks"] else 0)  # pending work (interface.md §4)
                      | (8 if meta.get("walk_failed") or no_cache else 0)),
        "findings": [],
        "hints": [],
        "tiers": tiers_of(namespaces, ns_meta),  # LMCache tiers, per tier then per deployment
        # Mooncake stores, per store then per deployment
        "stores": st.stores_of(namespaces, ns_meta, totals.stores, (meta.get("facts") or {}).get("flags")),
    }
    summary["findings"], summary["hints"] = findings_and_hints(summary, verb=verb, examples=totals.examples)
    return summary


def _scan_facts(facts: dict[str, Any] | None) -> ScanFacts:
    """The facts the scan was given (its manifest metadata, scan/run.py: flags and facts file)."""
    out: ScanFacts = {}
    for key, value in (facts or {}).items():
        if key == "flags":
            out["flags"] = value
        elif key == "facts_file":
            out["facts_file"] = value
    return out


def _scan_step(chosen: dict[str, Any]) -> SelectionStep:
    """The scan's --only/--exclude (its manifest metadata, scan/run.py) as the summary's
    first selection step, in the metadata's key order."""
    only, exclude = list(chosen["only"]), list(chosen["exclude"])
    if "partial" in chosen and "skipped_namespaces" in chosen:  # (as scan/run.py writes it)
        return {"only": only, "exclude": exclude, "partial": bool(chosen["partial"]),
                "skipped_namespaces": list(chosen["skipped_namespaces"]), "by": "scan"}
    return {"only": only, "exclude": exclude, "by": "scan"}
