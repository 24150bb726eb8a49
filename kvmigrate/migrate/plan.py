"""The migration plan: manifest rows -> per target namespace, the ordered block actions.

Like fclones, finding and acting are separate steps and the plan is plain data: it can be
printed (dry run), rendered as shell commands (`--print-commands`) or executed
(`apply.apply_plan`); each action's kind does all three (`actions.py`). The manifest is
read a chunk of buckets at a time (`rows.py`). Building a plan does no I/O beyond reading
the manifest.

Every path a plan will ever write is checked here, once: relpaths and target_relpaths
must be normalized relative paths, and a target path must sit in the rank folder of the
namespace's target identity with a block file name of the path grammar. A manifest that
fails is refused whole (someone edited it; nothing in it can be trusted).
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from kvmigrate import families, findings, layout, manifest
from kvmigrate.classify import UnitPlan
from kvmigrate.context import block_ranks, unit_contexts
from kvmigrate.errors import UsageError
from kvmigrate.migrate import competing
from kvmigrate.migrate.competing import Candidate, Role, decide
from kvmigrate.migrate.fsops import PAGE, check_relpath, padded_size
from kvmigrate.migrate.model import (
    CREATING,
    MERGE,
    NEEDS,
    NEEDS_DEST,
    NEEDS_DEST_TIER,
    BlockAction,
    Plan,
    SourceFile,
    Tally,
    TargetPlan,
)
from kvmigrate.migrate.outputs import TRANSFORMS, SourceInvalid, TransformSpec, flat_relayout_spec, transform_spec
from kvmigrate.migrate.rows import INTEGRITY_STATES, ManifestRows, PendingRowCheck
from kvmigrate.migrate.stores import STORE_ACTIONS, plan_stores
from kvmigrate.selection import selected_bases

# Rows that only point at the rank-0 row of their block (rank-row rule, migration.md §1)
# have a finding in findings.SECONDARY. The scanner reports a target path that is already
# taken by other bytes as `none` with finding `target_occupied` (identity.md: the occupant
# is itself a scanned path); for migrate it is a conflict: reported, counted, never
# overwritten (exit bit 4).
ALREADY_AT_ROOT = ("already present under the scanned root, not under --dest "
                   "(migrate into ROOT, or scan a root without it)")


def _as_int(v: Any) -> int:
    return int(v) if v is not None else 0


def _world(ns: dict[str, Any]) -> int:
    """Ranks that must hold a copy of each block (`context.block_ranks`)."""
    return len(block_ranks(ns.get("family"), ns.get("config_json") or {}, ns.get("ranks") or (0,)))


def _check_target_path(relpath: str, rank_dir: str, where: str) -> layout.BlockName:
    """The block a target path names, in the target rank folder; raises for any other path."""
    check_relpath(relpath, where)
    parsed = layout.parse_block_relpath(relpath)
    if parsed is None or relpath.split("/", 1)[0] != rank_dir or parsed[1].misfiled:
        raise UsageError(f"{where}: target_relpath {relpath!r} is not a block path in the target rank folder "
                         f"{rank_dir!r}; refusing this manifest",
                         hint="regenerate the manifest with `kvmigrate scan`")
    return parsed[1]


def _check_source_path(relpath: str, where: str) -> None:
    check_relpath(relpath, where)
    top = layout.parse_folder(relpath.split("/", 1)[0])
    if top is None or top.rank is None:
        raise UsageError(f"{where}: source {relpath!r} is not inside a rank folder; refusing this manifest",
                         hint="regenerate the manifest with `kvmigrate scan`")


# Block rows planned at a time: a chunk holds the rows of consecutive <hhh> buckets, about
# this many (all rows of a block share its bucket, so replicas and merge sources of a
# block are always in the same chunk). Bounds the plan's memory; tests lower it.
CHUNK_ROWS = 8192
# Creating rows turned into Python objects at a time while actions are streamed.
SLICE_ROWS = 4096


# --- checking and counting the rows of a chunk --------------------------------------------

@dataclass
class _Context:
    """Per-plan facts every chunk is checked and planned with."""

    where: str
    namespaces: dict[str, dict[str, Any]]
    target_of: dict[str, TargetPlan]
    world_of: dict[str, int]
    multi: list[str]  # deployments with more than one rank file per block
    hashed: bool = False  # the scan took content hashes (--verify hash)
    units: dict[str, UnitPlan] = field(default_factory=dict)  # source base -> its unit's context
    competing: bool = False  # some target path has several candidates (`_competing_roles`)
    # (target base, group) -> the size competing sources are judged by (`competing.target_sizes`);
    # None until the first pass has seen every row
    target_size: dict[tuple[str, int], int | None] | None = None
    # source bases of a flat family (its family object): rows named by file name, not path grammar
    flat: dict[str, Any] = field(default_factory=dict)
    dest_elsewhere: bool = False  # --dest is not the scanned root
    whole: set[str] = field(default_factory=set)  # deployments whose rank files are whole copies

    def __post_init__(self) -> None:
        self.rank_dir = {sb: tp.rank_dir for sb, tp in self.target_of.items()}
        # source namespaces whose name is a base folder name: `<name>_r<rank>` is then a
        # rank folder, and a relpath built from it passes `_check_source_path`
        self.base_folders = {sb for sb in self.target_of if isinstance(sb, str) and "/" not in sb
                             and "\0" not in sb and (f := layout.parse_folder(sb)) is not None and f.rank is None}

    def transformed(self, sb: str, action: str) -> bool:
        """The row's output is written from a proven geometry (a transform, or an LMCache
        chunk's header rewrite: `TierSpec`)."""
        return action in TRANSFORMS or action == "rewrite_header" and sb in self.flat and \
            self.flat[sb].root_layout == "tiers"

    def spec(self, sb: str, action: str, group: Any, size: int, cell: Sequence[Any], rowname: str,
             relpath: str = "", target: str = "") -> TransformSpec:
        """The transform of a row; `cell`: its (row_cells, cell_bytes) columns (a slice
        proven from the data); a flat family's page (`relpath`: its name) is re-proven by
        its family from the namespace's fields and facts."""
        if sb in self.flat and self.flat[sb].root_layout == "tiers":
            ns = self.namespaces[sb]
            try:  # an LMCache tier output, re-proven from the deployment's fields, facts and names
                return self.flat[sb].tier_spec(ns.get("config_json") or {}, ns.get("facts") or {}, action, size, target)
            except (TypeError, ValueError, KeyError) as exc:
                raise UsageError(f"{rowname}: {action} to {target!r} is not proven by the deployment's facts ({exc}); "
                                 "refusing this manifest", hint="regenerate it with `kvmigrate scan`") from None
        if sb in self.flat:
            ns = self.namespaces[sb]
            fields = ns.get("config_json") or {}
            try:
                if action != "relayout":
                    raise ValueError(f"{action} is not defined for a {self.flat[sb].title} page")
                geometry = self.flat[sb].flat_relayout(fields, ns.get("facts") or {}, relpath, size)
                kv_kind = fields.get("kv_kind")
                if not isinstance(kv_kind, str):  # (unreached: flat_relayout proves mla or full)
                    raise ValueError("the identity gives no kv kind")
                return flat_relayout_spec(kv_kind, size, geometry)
            except (SourceInvalid, TypeError, ValueError, KeyError) as exc:
                raise UsageError(f"{rowname}: {action} is not proven by the namespace's facts ({exc}); refusing "
                                 "this manifest", hint="regenerate it with `kvmigrate scan`") from None
        try:
            if not self.units:  # the scan's contexts, rebuilt from the metadata (one builder)
                self.units = unit_contexts(self.namespaces, self.hashed)
            unit = self.units[sb]
            found = findings.Finding(findings.TRANSFORM, row_cells=cell[0], cell_bytes=cell[1]) \
                if cell[1] is not None else None
            return transform_spec(unit, action, _as_int(group), size, found)
        except (SourceInvalid, TypeError, ValueError, KeyError) as exc:
            raise UsageError(f"{rowname}: {action} is not proven by the namespace's identity and "
                             f"facts ({exc}); refusing this manifest",
                             hint="regenerate it with `kvmigrate scan`") from None


def _check_row(ctx: _Context, row: dict[str, Any]) -> None:
    """The checks of one creating row, with their messages; raises for a bad row."""
    sb = row.get("source_base")
    tp = ctx.target_of.get(sb) if isinstance(sb, str) else None
    rowname = f"{ctx.where}: row {row.get('relpath')!r}"
    if tp is None:
        raise UsageError(f"{rowname}: action {row.get('action')} but namespace {sb!r} has no target identity; "
                         "refusing this manifest", hint="regenerate it with `kvmigrate scan`")
    _check_source_path(row["relpath"], rowname)
    name = _check_target_path(row["target_relpath"], tp.rank_dir, rowname).hex_hash
    if row["target_relpath"] == row["relpath"]:
        raise UsageError(f"{rowname}: target path equals the source path; refusing this manifest")
    if row.get("block_hash") is None or name != row["block_hash"].hex():
        have = row["block_hash"].hex() if row.get("block_hash") is not None else None
        raise UsageError(f"{rowname}: target_relpath {row['target_relpath']!r} does not name the row's block "
                         f"{have!r}; refusing this manifest", hint="regenerate it with `kvmigrate scan`")


def _check_flat_row(ctx: _Context, sb: str, relpath: Any, target: Any, block_hash: bytes | None) -> None:
    """A flat family's creating row: its source and target are page file names of the
    directory (one component each) that name the row's page; a target equal to its
    source only goes to --dest (a relayout keeps the name)."""
    fam = ctx.flat[sb]
    rowname = f"{ctx.where}: row {relpath!r}"
    for what, name in (("relpath", relpath), ("target_relpath", target)):
        check_relpath(name, rowname)
        page = fam.flat_page_hex(name)
        if block_hash is not None:
            block_hash = fam.unmarked(block_hash)
        if page is None:
            raise UsageError(f"{rowname}: {what} {name!r} is not a page file name of the {fam.title} directory; "
                             "refusing this manifest", hint="regenerate it with `kvmigrate scan`")
        if block_hash is None or page != block_hash.hex():
            raise UsageError(f"{rowname}: {what} {name!r} does not name the row's page "
                             f"{block_hash.hex() if block_hash is not None else None!r}; refusing this manifest",
                             hint="regenerate it with `kvmigrate scan`")
    if target == relpath and not ctx.dest_elsewhere:
        raise UsageError(f"{rowname}: target path equals the source path; refusing this manifest",
                         hint="regenerate it with `kvmigrate scan`")
    if fam.root_layout == "tiers":
        problem = fam.tier_paths_problem(ctx.namespaces[sb].get("config_json") or {}, relpath, target)
        if problem:
            raise UsageError(f"{rowname}: {problem}; refusing this manifest", hint="regenerate it with `kvmigrate scan`")


def _flat_rows(flat: list[str], dest_elsewhere: bool) -> Callable[[pa.Table], pa.Table]:
    """A flat family's rows as the destination makes them, rewritten as each chunk is
    read (sglang.md §3). With --dest DIR, the pages the engine reads in place
    (`already_present`, target = source) are linked into DIR too: DIR becomes a complete
    storage directory. Without it, a transform (its output keeps the name) stays pending:
    `needs_relayout` saying to pass --dest."""
    bases = pa.array(flat, pa.string())

    def adjust(chunk: pa.Table) -> pa.Table:
        mine = pc.fill_null(pc.is_in(chunk.column("source_base"), value_set=bases), False)
        action = chunk.column("action")
        if dest_elsewhere:
            hit = pc.and_(mine, pc.fill_null(pc.and_(pc.equal(action, "already_present"), pc.equal(
                chunk.column("target_relpath"), chunk.column("relpath"))), False))
            new, reason = pa.scalar("link"), None
        else:
            hit = pc.and_(mine, pc.fill_null(pc.is_in(action, pa.array(list(TRANSFORMS))), False))
            new, reason = pa.scalar("needs_relayout"), pa.scalar(NEEDS_DEST)
        if not pc.any(hit).as_py():
            return chunk
        chunk = chunk.set_column(chunk.schema.get_field_index("action"), "action", pc.if_else(hit, new, action))
        if reason is not None:
            i = chunk.schema.get_field_index("reason")
            chunk = chunk.set_column(i, "reason", pc.if_else(hit, reason, chunk.column("reason")))
        return chunk
    return adjust


def _then(first: Callable[[pa.Table], pa.Table] | None,
          second: Callable[[pa.Table], pa.Table]) -> Callable[[pa.Table], pa.Table]:
    return second if first is None else (lambda chunk: second(first(chunk)))


def _tier_rows(tiers: dict[str, Any], namespaces: dict[str, dict[str, Any]],
               dest_elsewhere: bool) -> Callable[[pa.Table], pa.Table]:
    """A tier family's rows as the plan acts on them (lmcache.md §3.6, §4), rewritten as
    each chunk is read: one creating row per file an action writes (the scan's row names
    the first; `expanded_targets` the others, each GDS data file followed by its
    sidecar); a sidecar row's chunk hash marked (never a rank file of its chunk); with
    --dest DIR the chunks the target reads in place linked into DIR; without it, a
    deployment whose outputs must go elsewhere (a conversion) waits for --dest."""
    bases = pa.array(sorted(tiers), pa.string())

    def adjust(chunk: pa.Table) -> pa.Table:
        mine = pc.fill_null(pc.is_in(chunk.column("source_base"), value_set=bases), False)
        if not pc.any(mine).as_py():
            return chunk
        rows = chunk.filter(mine).to_pylist()
        by_path = {r["relpath"]: r for r in rows}
        out: list[dict[str, Any]] = []
        for r in rows:
            fam = tiers[r["source_base"]]
            fields = namespaces.get(r["source_base"], {}).get("config_json") or {}
            if r["block_hash"] is not None and fam.is_sidecar(r["relpath"]):
                r["block_hash"] = fam.marked(r["block_hash"])
            action, target = r["action"], r["target_relpath"]
            if dest_elsewhere and action == "already_present" and target == r["relpath"]:
                action = "link"  # DIR/<tier> becomes a complete tier (§3.6)
            if action not in CREATING or target is None:
                out.append(r)
                continue
            if fields.get("needs_dest") and not dest_elsewhere:
                out.append({**r, "action": "needs_dest", "reason": NEEDS_DEST_TIER})
                continue
            for t in fam.expanded_targets(fields, action, target):
                if t == r["relpath"] and not dest_elsewhere:
                    continue
                if not fam.is_sidecar(t) or action == "reshard":
                    out.append({**r, "action": action, "target_relpath": t})
                    continue
                side = by_path.get(r["relpath"] + fam.sidecar_suffix)
                if side is not None:  # (a data file without its sidecar is orphan_data: never placed)
                    out.append({**side, "action": action, "target_relpath": t, "finding": None,
                                "block_hash": fam.marked(r["block_hash"])})
        rest = chunk.filter(pc.invert(mine))
        return pa.concat_tables([rest, pa.Table.from_pylist(out, schema=chunk.schema)]) if out else rest
    return adjust


def _source_paths_ok(relpath: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    """The block paths the scanner writes: a path of this shape passes `_check_source_path`
    (a rank folder, then components that are neither empty, "." nor ".." and hold no NUL);
    any other is checked by it."""
    return pc.fill_null(pc.match_substring_regex(relpath, layout.BLOCK_RELPATH_RE2), False)


def _creating(chunk: pa.Table) -> pa.Table:
    return chunk.filter(pc.fill_null(pc.is_in(chunk.column("action"), pa.array(list(CREATING))), False))


def _validate(ctx: _Context, c: pa.Table) -> None:
    """Every path a creating row makes the plan read or write must be one the scan
    writes. A row whose source and target paths are exactly the scanner's for its
    namespace, rank, group and block hash passes at once; any other gets the row checks."""
    cols = (c.column(k).to_pylist() for k in ("source_base", "rank", "group", "block_hash", "relpath",
                                              "target_relpath"))
    rank_dir, bases = ctx.rank_dir, ctx.base_folders
    for i, (sb, rank, g, h, rel, tr) in enumerate(zip(*cols)):
        if sb in ctx.flat:
            _check_flat_row(ctx, sb, rel, tr, h)
            continue
        if (sb in bases and h is not None and len(h) >= 3 and g is not None and g >= 0 and rank is not None
                and rank >= 0):
            x = h.hex()
            tail = layout.block_relpath_in_rank(x, g)
            if rel == f"{layout.rank_dir_name(sb, rank)}/{tail}" and tr == f"{rank_dir[sb]}/{tail}" and rel != tr:
                continue
        _check_row(ctx, c.slice(i, 1).to_pylist()[0])


def _candidates(ctx: _Context, chunk: pa.Table, c: pa.Table) -> pa.Table | None:
    """Rows of multi-rank deployments that may be a replica of a creating row of `c`."""
    if not ctx.multi or not c.num_rows:
        return None
    mask = pc.and_(pc.is_in(chunk.column("deployment"), pa.array(ctx.multi)), pc.is_valid(chunk.column("block_hash")))
    mask = pc.and_(mask, pc.not_equal(chunk.column("status"), "misfiled"))
    mask = pc.and_(mask, pc.is_in(chunk.column("block_hash"), value_set=pc.unique(c.column("block_hash"))))
    return chunk.filter(mask)


def _block_keys(ctx: _Context, c: pa.Table) -> dict[tuple, set[str]]:
    """(deployment, group, block hash) -> relpaths of the creating rows of multi-rank blocks."""
    keys: dict[tuple, set[str]] = {}
    cols = [c.column(k).to_pylist() for k in ("source_base", "deployment", "group", "block_hash", "relpath")]
    for sb, dep, group, bh, rel in zip(*cols):
        dep = dep or sb
        if ctx.world_of.get(dep, 1) > 1:
            keys.setdefault((dep, group, bh), set()).add(rel)
    return keys


def _validate_replicas(ctx: _Context, cands: pa.Table | None, c: pa.Table) -> None:
    """A replica a block reads must be a source path too (rows checked in Python only
    when the Arrow check does not accept them)."""
    if cands is None or not cands.num_rows:
        return
    bad = cands.filter(pc.invert(_source_paths_ok(cands.column("relpath"))))
    if not bad.num_rows:
        return
    keys = _block_keys(ctx, c)
    for r in bad.to_pylist():
        sources = keys.get((r["deployment"], r["group"], r["block_hash"]))
        if sources and any(s != r["relpath"] for s in sources):
            where = f"{ctx.where}: replica {r['relpath']!r}"
            fam = ctx.flat.get(r["source_base"])
            if fam is None:
                _check_source_path(r["relpath"], where)
            elif (fam.root_layout == "flat" and "/" in check_relpath(r["relpath"], where)
                  or fam.flat_page_hex(check_relpath(r["relpath"], where)) is None):
                raise UsageError(f"{where} is not a page file name of the {fam.title} directory; refusing this "
                                 "manifest", hint="regenerate it with `kvmigrate scan`")


def _by_merge_order(c: pa.Table, *, with_source: bool) -> pa.Table:
    """Rows in the fixed merge order: (source base, rank,) target path; stable."""
    c = c.append_column("_rank", pc.fill_null(c.column("rank"), 0))
    keys = [("source_base", "ascending"), ("_rank", "ascending")] if with_source else []
    return c.take(pc.sort_indices(c, sort_keys=[*keys, ("target_relpath", "ascending")]))


def _tally_chunk(ctx: _Context, c: pa.Table, cands: pa.Table | None, tallies: dict[str, Tally]) -> None:
    """First pass over the creating rows of one chunk, per target, in Arrow: counts, and
    every row's output size in its (target, group) histogram; transforms (proven here)
    are counted one by one, rows of a target path with several candidates only join the
    histogram (the competing-source rule needs all of it: `_tally_competing`)."""
    if not c.num_rows:
        return
    c = c.select(["source_base", "rank", "target_relpath", "action", "size", "dev", "relpath", "group", "row_cells",
                  "cell_bytes", "deployment", "block_hash"])
    c = c.set_column(1, "rank", pc.fill_null(c.column("rank"), 0))
    c = c.set_column(4, "size", pc.fill_null(c.column("size"), 0))
    c = c.set_column(5, "dev", pc.fill_null(c.column("dev"), 0))
    for (sb, rank), n in _grouped(c, ["source_base", "rank"], [("rank", "count")]):
        tal = tallies[ctx.target_of[sb].base_name]
        tal.groups.add((sb, rank))
        tal.blocks += n
    links = c.filter(pc.and_(pc.equal(c.column("action"), "link"), pc.not_equal(c.column("dev"), 0)))
    for (sb, dev), relpath in _grouped(links, ["source_base", "dev"], [("relpath", "min")]):
        tal = tallies[ctx.target_of[sb].base_name]
        if dev not in tal.link_devs:
            tal.link_devs[dev] = relpath
    merged = _competing_paths(c)
    one_by_one = pc.or_(pc.is_in(c.column("action"), pa.array(list(TRANSFORMS))),
                        pc.less(c.column("size"), 0))  # (padding of a negative size: Python's rounding)
    tiers = [b for b, f in ctx.flat.items() if f.root_layout == "tiers"]
    if tiers:  # an LMCache header rewrite writes what its TierSpec says
        one_by_one = pc.or_(one_by_one, pc.fill_null(pc.and_(pc.equal(c.column("action"), "rewrite_header"), pc.is_in(
            c.column("source_base"), pa.array(tiers, pa.string()))), False))
    if len(merged):
        one_by_one = pc.or_(one_by_one, pc.is_in(c.column("target_relpath"), value_set=merged))
    plain = c.filter(pc.invert(one_by_one))
    padded = pc.multiply(pc.divide(pc.add(plain.column("size"), PAGE - 1), PAGE), PAGE)
    plain = plain.append_column("out", pc.if_else(pc.equal(plain.column("action"), "copy_pad"), padded,
                                                  plain.column("size")))
    for (sb, action), (n, nbytes) in _grouped(plain, ["source_base", "action"], [("out", "count"), ("out", "sum")]):
        cnt = tallies[ctx.target_of[sb].base_name].counts[action]
        cnt["blocks"] += n
        cnt["bytes"] += nbytes
    for (sb, group, out), n in _grouped(plain, ["source_base", "group", "out"], [("out", "count")]):
        tallies[ctx.target_of[sb].base_name].sizes.setdefault(_as_int(group), Counter())[out] += n
    rest = _by_merge_order(c.filter(one_by_one), with_source=True)
    if rest.num_rows:
        _tally_rows(ctx, rest, cands, tallies, competing=set(merged.to_pylist()))


def _competing_paths(c: pa.Table) -> pa.Array:
    """Target paths that more than one creating row of the chunk would write."""
    paths = c.group_by("target_relpath").aggregate([("target_relpath", "count")])
    return paths.filter(pc.greater(paths.column("target_relpath_count"), 1)).column("target_relpath").combine_chunks()


def _grouped(t: pa.Table, keys: list[str], aggs: list[tuple[str, str]]) -> Iterator[tuple[tuple, Any]]:
    """(key values, aggregate value or values) of an Arrow group_by."""
    if not t.num_rows:
        return
    g = t.group_by(keys).aggregate(aggs)
    cols = [g.column(f"{col}_{fn}").to_pylist() for col, fn in aggs]
    for key, *vals in zip(zip(*(g.column(k).to_pylist() for k in keys)), *cols):
        yield key, (vals[0] if len(vals) == 1 else tuple(vals))


def _tally_rows(ctx: _Context, c: pa.Table, cands: pa.Table | None, tallies: dict[str, Tally],
                competing: set[str] | None = None) -> None:
    """Counts of creating rows one by one; transforms are proven. In the first pass
    (`competing`: the chunk's target paths with several candidates) each row also joins
    its target's size histogram, and rows at a competing path are only that; the second
    pass counts the rows the competing-source rule places (`competing` None)."""
    names = ("source_base", "target_relpath", "action", "size", "group", "row_cells", "cell_bytes", "relpath",
             "deployment", "block_hash")
    cols = dict(zip(names, (c.column(k).to_pylist() for k in names)))
    rep_sizes: dict[tuple, list[tuple[str, int]]] | None = None
    for i in range(c.num_rows):
        sb, action, tr, size = cols["source_base"][i], cols["action"][i], cols["target_relpath"][i], cols["size"][i]
        tal = tallies[ctx.target_of[sb].base_name]
        spec = None
        if ctx.transformed(sb, action):
            spec = ctx.spec(sb, action, cols["group"][i], size, (cols["row_cells"][i], cols["cell_bytes"][i]),
                            f"{ctx.where}: row {cols['relpath'][i]!r}", cols["relpath"][i], tr)
            out = spec.output_size
        else:
            out = padded_size(size) if action == "copy_pad" else size
        if competing is not None:
            tal.sizes.setdefault(_as_int(cols["group"][i]), Counter())[out] += 1
            if tr in competing:
                tal.competing = True
                continue
        tal.counts[action]["blocks"] += 1
        tal.counts[action]["bytes"] += out
        if spec is None:
            continue
        source_bytes = size
        dep = cols["deployment"][i] or sb
        if ctx.world_of.get(dep, 1) > 1 and cands is not None:
            if rep_sizes is None:
                rep_sizes = defaultdict(list)
                rc = [cands.column(k).to_pylist() for k in ("deployment", "group", "block_hash", "relpath", "size")]
                for d, g, h, rel, n in zip(*rc):
                    rep_sizes[(d, g, h)].append((rel, _as_int(n)))
            source_bytes += sum(n for rel, n in rep_sizes.get((dep, cols["group"][i], cols["block_hash"][i]), ())
                                if rel != cols["relpath"][i])
        t = tal.transforms.setdefault(action, [0, 0, 0])
        t[0] += 1
        t[1] += source_bytes
        t[2] += out


# --- competing sources (the rule: `competing.py`) ---------------------------------------

_ROLE_COLUMNS = ("source_base", "rank", "relpath", "action", "size", "group", "row_cells", "cell_bytes", "dev",
                 "inode", "content_xxh3_128", "payload_xxh3_128", "target_relpath")


def _competing_roles(ctx: _Context, c: pa.Table) -> dict[str, Role]:
    """Source relpath -> role of each creating row of a chunk (all sources) whose target
    path has more than one (a block's rows and target path share its bucket: the chunk
    holds every candidate)."""
    if not c.num_rows:
        return {}
    merged = _competing_paths(c)
    if not len(merged):
        return {}
    rows = _by_merge_order(c.filter(pc.is_in(c.column("target_relpath"), value_set=merged)), with_source=True)
    cols = dict(zip(_ROLE_COLUMNS, (rows.column(k).to_pylist() for k in _ROLE_COLUMNS)))
    by_path: dict[str, list[Candidate]] = {}
    for i in range(rows.num_rows):
        sb, action, size, group = cols["source_base"][i], cols["action"][i], _as_int(cols["size"][i]), cols["group"][i]
        if ctx.transformed(sb, action):
            out = ctx.spec(sb, action, group, size, (cols["row_cells"][i], cols["cell_bytes"][i]),
                           f"{ctx.where}: row {cols['relpath'][i]!r}", cols["relpath"][i],
                           cols["target_relpath"][i]).output_size
        else:
            out = padded_size(size) if action == "copy_pad" else size
        digest = None if ctx.transformed(sb, action) else cols["payload_xxh3_128" if action == "rewrite_header"
                                                        else "content_xxh3_128"][i]
        by_path.setdefault(cols["target_relpath"][i], []).append(Candidate(
            sb, _as_int(cols["rank"][i]), cols["relpath"][i], action, out, _as_int(group),
            (_as_int(cols["dev"][i]), _as_int(cols["inode"][i])), digest))
    out_roles: dict[str, Role] = {}
    sizes = ctx.target_size or {}
    for cands in by_path.values():
        base = ctx.target_of[cands[0].source_base].base_name
        for x, (role, cause) in zip(cands, decide(cands, sizes.get((base, cands[0].group)))):
            out_roles[x.relpath] = Role(role, cause, x.source_base, x.rank, x.out)
    return out_roles


def _tally_competing(ctx: _Context, c: pa.Table, cands: pa.Table | None, tallies: dict[str, Tally]) -> None:
    """Second pass over a chunk: the rows of competing target paths by the rule above;
    a placed row counts as its action, a merge as `merge_duplicate`, a conflict by cause."""
    roles = _competing_roles(ctx, c)
    if not roles:
        return
    placed = [rel for rel, r in roles.items() if r.role == "place"]
    if placed:
        rows = c.filter(pc.is_in(c.column("relpath"), value_set=pa.array(placed, pa.string())))
        rows = rows.set_column(rows.schema.get_field_index("size"), "size", pc.fill_null(rows.column("size"), 0))
        _tally_rows(ctx, _by_merge_order(rows, with_source=True), cands, tallies)
    for r in roles.values():
        tp = ctx.target_of[r.source_base]
        tal = tallies[tp.base_name]
        if r.role == "conflict":
            tp.conflicts[r.cause] += 1
            tal.blocks -= 1
        elif r.role != "place":
            tal.counts[MERGE]["blocks"] += 1
            tal.counts[MERGE]["bytes"] += r.out
            tal.merges.add((r.source_base, r.rank))
            tal.unverified += r.role == "check"


# Columns of a source file, nulls read as 0 (as `_as_int` did per row).
_FILE_COLUMNS = ("relpath", "rank", "dev", "inode", "size", "mtime_ns", "content_xxh3_128", "payload_xxh3_128",
                 "ctime_ns", "nlink")
_INT_COLUMNS = ("rank", "dev", "inode", "size", "mtime_ns")


# SourceFile / BlockAction from a tuple of all fields, without the keyword handling of
# the NamedTuple constructor (one of each per block file, on the hot path)
_source_file = partial(tuple.__new__, SourceFile)
_block_action = partial(tuple.__new__, BlockAction)


def _file_lists(t: pa.Table) -> list[list[Any]]:
    return [(pc.fill_null(t.column(k), 0) if k in _INT_COLUMNS else t.column(k)).to_pylist() for k in _FILE_COLUMNS]


def _chunk_actions(ctx: _Context, chunk: pa.Table, sb: str, rank: int, merges: bool = False) -> Iterator[BlockAction]:
    """The actions of source `sb`, rank `rank` in one chunk, in target path order, with
    their replicas (looked up within the chunk: a block's rank files share its bucket):
    the blocks it places, or (`merges`) those another source places with the same bytes.
    A competing source's conflict is no action. The rows were checked when the plan was
    built (the same bytes: `ManifestRows`)."""
    c = _creating(chunk)
    roles = _competing_roles(ctx, c) if ctx.competing else {}
    if merges and not roles:
        return
    c = c.filter(pc.and_(pc.equal(c.column("source_base"), sb), pc.equal(pc.fill_null(c.column("rank"), 0), rank)))
    if roles:  # merges: the rows to keep; else: the rows to leave out
        chosen = [rel for rel, r in roles.items() if r.source_base == sb and r.rank == rank
                  and (r.role in ("merge", "check") if merges else r.role != "place")]
        hit = pc.is_in(c.column("relpath"), value_set=pa.array(chosen, pa.string()))
        c = c.filter(hit if merges else pc.invert(hit))
    if not c.num_rows:
        return
    c = _by_merge_order(c, with_source=False)
    # replicas in rank order (a stable sort: ties keep manifest order), looked up among
    # the rows of this source's deployments; a creating row of this group is a source,
    # never a replica (a block's rank-0 row)
    replicas: dict[tuple, list[SourceFile]] = defaultdict(list)
    deps = [d for d in {d or sb for d in c.column("deployment").to_pylist()} if ctx.world_of.get(d, 1) > 1]
    cands = None
    if deps:
        mine = pc.fill_null(pc.and_(pc.equal(chunk.column("source_base"), sb),
                                    pc.equal(pc.fill_null(chunk.column("rank"), 0), rank)), False)
        mask = pc.and_(pc.is_in(chunk.column("deployment"), pa.array(deps)), pc.is_valid(chunk.column("block_hash")))
        mask = pc.and_(mask, pc.not_equal(chunk.column("status"), "misfiled"))
        mask = pc.and_(mask, pc.invert(pc.and_(mine, pc.fill_null(
            pc.is_in(chunk.column("action"), pa.array(list(CREATING))), False))))
        if ctx.whole:  # whole copies: one the scan flagged (a differing or damaged copy) is no replica
            flagged = pc.and_(pc.is_in(chunk.column("deployment"), pa.array(sorted(ctx.whole))),
                              pc.invert(pc.is_in(chunk.column("status"), pa.array(["ok", "index_lost"]))))
            mask = pc.and_(mask, pc.invert(pc.fill_null(flagged, False)))
        cands = chunk.filter(mask)
    if cands is not None and cands.num_rows:
        cands = cands.take(pc.sort_indices(pc.fill_null(cands.column("rank"), 0)))
        keys = zip(*(cands.column(k).to_pylist() for k in ("deployment", "group", "block_hash")))
        for key, f in zip(keys, zip(*_file_lists(cands))):
            replicas[key].append(_source_file(f))
    world_of, no_replicas = ctx.world_of, ()
    for start in range(0, c.num_rows, SLICE_ROWS):
        part = c.slice(start, SLICE_ROWS)
        files = zip(*_file_lists(part))
        rest = zip(*(part.column(k).to_pylist() for k in ("action", "target_relpath", "deployment", "group",
                                                           "block_hash", "row_cells", "cell_bytes")))
        for f, (action, target, dep, group, bh, *cell) in zip(files, rest):
            src = _source_file(f)
            dep = dep or sb
            world = world_of.get(dep, 1)
            reps = tuple(replicas.get((dep, group, bh), no_replicas)) if world > 1 else no_replicas
            spec = None
            if ctx.transformed(sb, action):
                spec = ctx.spec(sb, action, group, src.size, cell, f"{ctx.where}: row {src.relpath!r}", src.relpath,
                                target)
            yield _block_action((action, target, src, reps, sb, world, spec))


class ActionStream:
    """The block actions of one target namespace in the fixed merge order (source base,
    then rank, then target path): the blocks to place, then the merges (blocks another
    source places with the same bytes: the apply compares them). Read from the manifest
    a chunk at a time each time it is iterated: a plan of millions of blocks never holds
    them. Sized and indexable like the list it stands for; its counts were taken when
    the plan was built."""

    def __init__(self, rows: ManifestRows, ctx: _Context, tally: Tally):
        self._rows = rows
        self._ctx = ctx
        self.tally = tally

    def __iter__(self) -> Iterator[BlockAction]:
        for sb, rank in sorted(self.tally.groups):
            for chunk in self._rows.chunks():
                yield from _chunk_actions(self._ctx, chunk, sb, rank)
        # merges last: the apply compares each with the block placed at its path
        for sb, rank in sorted(self.tally.merges):
            for chunk in self._rows.chunks():
                yield from _chunk_actions(self._ctx, chunk, sb, rank, merges=True)

    def __len__(self) -> int:
        return self.tally.blocks

    def __bool__(self) -> bool:
        return self.tally.blocks > 0

    def __getitem__(self, index: int | slice) -> Any:
        return list(self)[index]


def build_plan(manifest_path: str | os.PathLike[str], *, dest: str | None = None,
               table: pa.Table | None = None, metadata: dict[str, Any] | None = None,
               target_sizes: dict[tuple[str, int], int | None] | None = None, selection: Any = None,
               progress: Callable[[int, int], None] | None = None) -> Plan:
    """Read a manifest (file or dataset directory) and build the plan.

    `dest` defaults to the scanned root. Raises UsageError for a manifest that is not
    from `kvmigrate scan` or holds a path that could leave its root. Every row is checked
    and counted here, a chunk of buckets at a time; the actions themselves are streamed
    from the manifest again when a target's `actions` are iterated (`ActionStream`).
    `target_sizes` (a whole plan's `Plan.target_sizes`) lets a plan of some rows of a
    manifest (a scale-out part) judge competing sources as the whole plan does.
    `progress(rows_done, rows)` after each chunk (the planning bar).
    """
    if metadata is None:
        try:
            metadata = manifest.read_metadata(manifest_path)
        except (pa.ArrowException, OSError, ValueError) as exc:  # not Parquet, unreadable, damaged metadata
            raise UsageError(f"cannot read the manifest: {str(exc).splitlines()[0] if str(exc) else exc!r}",
                             path=str(manifest_path), hint="pass a manifest written by `kvmigrate scan`") from None
    if not metadata or "root" not in metadata:
        raise UsageError("not a kvmigrate manifest (no run metadata)", path=str(manifest_path),
                         hint="create one with `kvmigrate scan ROOT -o M.parquet`")
    root = os.path.abspath(metadata["root"])
    namespaces: dict[str, dict[str, Any]] = metadata.get("namespaces") or {}
    where = str(manifest_path)
    chosen = selected_bases(namespaces, selection) if selection else None

    # Target namespaces, keyed by target base name; sources merge in base-name order.
    targets: dict[str, TargetPlan] = {}
    target_of: dict[str, TargetPlan] = {}
    flat: dict[str, Any] = {}
    not_built: dict[str, str] = {}  # namespace -> the family title whose migration kvmigrate lacks
    for src_base in sorted(chosen if chosen is not None else namespaces):
        ns = namespaces[src_base]
        fam = families.get(ns.get("family"))
        if fam.root_layout == "stores":  # a store's work is planned apart (migrate/stores.py)
            not_built[src_base] = fam.title
            continue
        if fam.root_layout in ("flat", "tiers"):
            flat[src_base] = fam
            _flat_target(targets, target_of, src_base, ns, fam, where)
            continue
        tgt = ns.get("target")
        if not tgt or not tgt.get("base_name") or tgt.get("fields") is None:
            continue
        base, rank_dir = tgt["base_name"], tgt.get("rank_dir") or layout.rank_dir_name(tgt["base_name"], 0)
        check_relpath(base, f"{where}: namespace {src_base!r} target base_name")
        check_relpath(rank_dir, f"{where}: namespace {src_base!r} target rank_dir")
        base_folder, rank_folder = layout.parse_folder(base), layout.parse_folder(rank_dir)
        if ("/" in base or "/" in rank_dir or base_folder is None or base_folder.rank is not None
                or rank_folder is None or rank_folder.rank is None or rank_folder.base != base):
            raise UsageError(f"{where}: namespace {src_base!r} has an invalid target folder {base!r}/{rank_dir!r}; "
                             "refusing this manifest", hint="regenerate it with `kvmigrate scan`")
        family = tgt.get("family") or families.get(ns.get("family")).target_engine  # older manifests name none
        try:
            proven = layout.base_name(tgt["fields"]["model_name"], families.get(family).d12(tgt["fields"]))
        except (KeyError, TypeError, ValueError):
            proven = None
        if proven != base:
            raise UsageError(f"{where}: namespace {src_base!r}: target folder {base!r} is not the digest of its "
                             "target identity; refusing this manifest", hint="regenerate it with `kvmigrate scan`")
        tp = targets.get(base)
        if tp is None:
            tp = targets[base] = TargetPlan(base_name=base, rank_dir=rank_dir, profile=tgt.get("profile", ""),
                                            family=family, fields=tgt["fields"], sources=[])
        elif tp.fam.canonical_bytes(tp.fields) != families.get(family).canonical_bytes(tgt["fields"]):
            raise UsageError(f"{where}: namespaces map to target {base!r} with different identities")
        tp.sources.append(src_base)
        tp.claims += [c for c in tgt.get("claims") or () if c not in tp.claims]
        target_of[src_base] = tp

    # Replicas of multi-rank deployments are looked up by (deployment, group, block hash).
    world_of: dict[str, int] = {}
    for b, ns in namespaces.items():
        world_of[ns.get("deployment") or b] = max(world_of.get(ns.get("deployment") or b, 1), _world(ns))
    multi = sorted({ns.get("deployment") or b for b, ns in namespaces.items() if _world(ns) > 1})
    dest_elsewhere = dest is not None and os.path.abspath(dest) != root
    whole = {ns.get("deployment") or b for b, ns in namespaces.items() if families.get(ns.get("family")).copies_whole}
    ctx = _Context(where, namespaces, target_of, world_of, multi, hashed=metadata.get("verify") == "hash",
                   flat=flat, dest_elsewhere=dest_elsewhere, whole=whole)
    try:
        rows = ManifestRows(manifest_path, table, where, CHUNK_ROWS, sources=chosen)
        if flat:
            rows.adjust = _flat_rows(sorted(b for b, f in flat.items() if f.root_layout == "flat"), dest_elsewhere)
        tiers = {b: f for b, f in flat.items() if f.root_layout == "tiers"}
        if tiers:
            rows.adjust = _then(rows.adjust, _tier_rows(tiers, namespaces, dest_elsewhere))
    except PendingRowCheck as pending:
        _check_row(ctx, pending.row)
        raise UsageError(f"{where}: row {pending.row.get('relpath')!r}: a block action without a block hash; "
                         "refusing this manifest", hint="regenerate it with `kvmigrate scan`") from None
    status_counts = rows.status_counts
    integrity_rows = sum(n for s, n in status_counts.items() if s in INTEGRITY_STATES)

    # One pass over the chunks: check every creating row, count actions (the actions are
    # streamed later), and count what is not created (Arrow group_by).
    tallies = {base: Tally() for base in targets}
    untargeted: Counter = Counter()
    waiting: Counter = Counter()  # (family title, action) -> blocks of not_built namespaces
    total_rows, done_rows = sum(status_counts.values()), 0
    for chunk in rows.chunks():
        if progress is not None:
            done_rows += chunk.num_rows
            progress(min(done_rows, total_rows), total_rows)
        if not_built:  # a store's rows: its work is planned apart (plan_stores); what waits is counted here
            chunk = _without_stores(chunk, not_built, waiting, dest_elsewhere)
        c = _creating(chunk)
        _validate(ctx, c)
        cands = _candidates(ctx, chunk, c)
        _validate_replicas(ctx, cands, c)
        _tally_chunk(ctx, c, cands, tallies)
        for sb, action, reason, occupied, blocks, nbytes in _grouped_counts(chunk, chunk.column("action")):
            tp = target_of.get(sb)
            if action == "already_present" and tp is not None and dest_elsewhere:
                # the scan compared the target path under ROOT, not under --dest
                tp.not_reusable[ALREADY_AT_ROOT] += blocks
                tp.not_reusable_bytes[ALREADY_AT_ROOT] += nbytes
            elif action == "already_present":
                if tp is not None:
                    tp.already_present[0] += blocks
                    tp.already_present[1] += nbytes
            elif tp is None:
                untargeted[reason or action] += blocks
            elif action == "none" and occupied is not None:
                tp.conflicts[findings.reason(reason, findings.TARGET_OCCUPIED, aliases_relpath=occupied)] += blocks
            elif action in NEEDS:
                tp.skipped[(action, reason)] += blocks
                tp.skipped_bytes[(action, reason)] += nbytes
            else:
                tp.not_reusable[reason or action] += blocks
                tp.not_reusable_bytes[reason or action] += nbytes
    # Competing sources of a target path are judged by the target's size (a histogram
    # over all of its rows: the first pass), so they are counted in a second pass.
    ctx.target_size = target_sizes if target_sizes is not None else competing.target_sizes(targets, tallies)
    if any(t.competing for t in tallies.values()):
        ctx.competing = True
        for chunk in rows.chunks():
            if not_built:
                chunk = _without_stores(chunk, not_built, Counter(), dest_elsewhere)
            c = _creating(chunk)
            _tally_competing(ctx, c, _candidates(ctx, chunk, c), tallies)
    for base, tp in targets.items():
        tp.actions = ActionStream(rows, ctx, tallies[base])

    stores = [] if not not_built else plan_stores(str(manifest_path), namespaces, chosen=list(not_built),
                                                 dest=dest_elsewhere)
    return Plan(root=root, dest=os.path.abspath(dest) if dest else root,
                manifest_path=os.path.abspath(manifest_path) if manifest_path else None,
                target_profile=metadata.get("target_profile", ""), metadata=metadata,
                targets=[targets[k] for k in sorted(targets)], untargeted=untargeted,
                integrity_rows=integrity_rows, status_counts=status_counts, target_sizes=ctx.target_size,
                placed_integrity_rows=rows.placed_integrity_rows, selection=selection, not_built=waiting,
                stores=stores)


def _without_stores(chunk: pa.Table, stores: dict[str, str], waiting: Counter, dest_elsewhere: bool) -> pa.Table:
    """The chunk without the rows of store namespaces (`stores`: namespace -> its family's
    title), counting in `waiting` those whose action this release does not apply (a
    needs_* action)."""
    mine = pc.fill_null(pc.is_in(chunk.column("source_base"), value_set=pa.array(sorted(stores))), False)
    if not pc.any(mine).as_py():
        return chunk
    theirs = chunk.filter(mine)
    for sb, action, _, _, blocks, _ in _grouped_counts(theirs, theirs.column("action")):
        if action not in ("none", "already_present") and action not in STORE_ACTIONS:
            waiting[(stores[sb], action)] += blocks
    return chunk.filter(pc.invert(mine))


def _flat_target(targets: dict[str, TargetPlan], target_of: dict[str, TargetPlan], src_base: str,
                 ns: dict[str, Any], fam: Any, where: str) -> None:
    """The target of a flat family's deployment: file names in the destination directory
    (no folder, no config.json), labelled as a rescan labels the names it creates; the
    deployments whose names become one deployment's share it."""
    fields = ns.get("config_json") or {}
    base = fam.flat_target(src_base, fields)
    tp = targets.get(base)
    if tp is None:
        tier = fields.get("tier") if fam.root_layout == "tiers" else None  # a tier's lock is at its top (lmcache.md §5)
        tp = targets[base] = TargetPlan(base_name=base, rank_dir="", profile=(ns.get("target") or {}).get("profile", ""),
                                        family=fam.name, fields=dict(fields), sources=[], flat=True,
                                        lock=None if tier is None else "" if tier == "." else str(tier))
    elif not tp.flat:
        raise UsageError(f"{where}: namespace {src_base!r} maps to target {base!r}, a base folder of another family; "
                         "refusing this manifest", hint="regenerate it with `kvmigrate scan`")
    tp.sources.append(src_base)
    target_of[src_base] = tp


GroupedCount = tuple[str, str, str, str | None, int, int]  # see `_grouped_counts`


def _grouped_counts(table: pa.Table, action_col: pa.ChunkedArray) -> list[GroupedCount]:
    """(source_base, action, reason, occupied target path, blocks, bytes) for block rows
    that create nothing (the path: the row's finding is `target_occupied`).

    Rows that only point at their block's rank-0 row are left out (they are not blocks);
    an already-present target path is counted once, even when a migrated target
    namespace, rescanned, is its own source."""
    sub = pa.table({"source_base": pc.cast(table.column("source_base"), pa.string()),
                    "action": action_col,
                    "reason": pc.fill_null(pc.cast(table.column("reason"), pa.string()), ""),
                    "target_relpath": table.column("target_relpath"),
                    "size": pc.fill_null(table.column("size"), 0),
                    "occupied": pc.if_else(pc.fill_null(pc.equal(table.column("finding"), findings.TARGET_OCCUPIED),
                                                        False),
                                           table.column("aliases_relpath"), pa.scalar(None, pa.string()))})
    keep = pc.and_(pc.is_valid(table.column("block_hash")),
                   pc.invert(pc.fill_null(pc.is_in(action_col, pa.array(list(CREATING))), False)))
    keep = pc.and_(keep, pc.is_valid(action_col))
    keep = pc.and_(keep, pc.invert(pc.fill_null(pc.is_in(table.column("finding"),
                                                         pa.array(findings.SECONDARY)), False)))
    sub = sub.filter(keep)
    present = sub.filter(pc.and_(pc.equal(sub.column("action"), "already_present"),
                                 pc.is_valid(sub.column("target_relpath"))))
    rest = sub.filter(pc.invert(pc.and_(pc.equal(sub.column("action"), "already_present"),
                                        pc.is_valid(sub.column("target_relpath")))))
    out: list[GroupedCount] = []
    if present.num_rows:
        first = present.group_by("target_relpath").aggregate([("source_base", "min"), ("size", "max"),
                                                              ("reason", "min")])
        g = pa.table({"source_base": first["source_base_min"], "reason": first["reason_min"],
                      "size": first["size_max"]}).group_by("source_base").aggregate(
            [("size", "count"), ("size", "sum")])
        out += [(b, "already_present", "", None, n, t) for b, n, t in
                zip(g["source_base"].to_pylist(), g["size_count"].to_pylist(), g["size_sum"].to_pylist())]
    if rest.num_rows:
        g = rest.group_by(["source_base", "action", "reason", "occupied"]).aggregate([("size", "count"),
                                                                                     ("size", "sum")])
        out += list(zip(g["source_base"].to_pylist(), g["action"].to_pylist(), g["reason"].to_pylist(),
                        g["occupied"].to_pylist(), g["size_count"].to_pylist(), g["size_sum"].to_pylist()))
    return out
