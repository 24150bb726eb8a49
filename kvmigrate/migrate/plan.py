"""The migration plan: manifest rows -> per target namespace, the ordered block actions.

Like fclones, finding and acting are separate steps and the plan is plain data: it can be
printed (dry run), rendered as shell commands (`--print-commands`) or executed
(`apply.apply_plan`). Building a plan does no I/O beyond reading the manifest.

Every path a plan will ever write is checked here, once: relpaths and target_relpaths
must be normalized relative paths, and a target path must sit in the rank folder of the
namespace's target identity with a block file name of the path grammar. A manifest that
fails is refused whole (someone edited it; nothing in it can be trusted).
"""

from __future__ import annotations

import os
import shlex
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.compute as pc

from kvmigrate import layout, manifest
from kvmigrate.classify import TargetInfo, UnitPlan
from kvmigrate.errors import UsageError
from kvmigrate.formats import vllmcpp
from kvmigrate.identity import canonical
from kvmigrate.migrate.cost import cost_line, transform_cost
from kvmigrate.migrate.fsops import check_relpath, padded_size
from kvmigrate.migrate.outputs import TRANSFORMS, SourceInvalid, TransformSpec, transform_spec

# Actions that create a file (migration.md §1); the rest are counted, never acted on.
COPIES = ("link", "copy_pad", "rewrite_header")
CREATING = (*COPIES, *TRANSFORMS)
NEEDS = ("needs_slice", "needs_concat", "needs_relayout")
# Rows that only point at the rank-0 row of their block (rank-row rule, migration.md §1).
_PART_REASON_PREFIXES = ("replica of rank 0", "part of ")
# The scanner reports a target path that is already taken by other bytes as `none` with
# this reason prefix (identity.md: the occupant is itself a scanned path); for migrate it
# is a conflict: reported, counted, never overwritten (exit bit 4).
OCCUPIED_PREFIX = "aliases_source: target path "
ALREADY_AT_ROOT = ("already present under the scanned root, not under --dest "
                   "(migrate into ROOT, or scan a root without it)")
# Row states with the integrity bit (interface.md §2).
INTEGRITY_STATES = frozenset({"replica_mismatch", "size_mismatch", "short", "zero_filled", "misfiled",
                              "header_invalid", "digest_mismatch", "config_invalid"})

_COLUMNS = ("relpath", "family", "source_base", "deployment", "target_base", "rank", "group", "block_hash",
            "size", "mtime_ns", "inode", "dev", "content_xxh3_128", "payload_xxh3_128", "status", "action",
            "reason", "target_relpath")


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One source file an action reads, with the stat the scan saw (staleness check)."""

    relpath: str
    rank: int
    dev: int
    inode: int
    size: int
    mtime_ns: int
    content_hash: bytes | None
    payload_hash: bytes | None


@dataclass(frozen=True, slots=True)
class BlockAction:
    """One block to materialize at `target_relpath` (relative to the destination root)."""

    action: str  # link | copy_pad | rewrite_header | slice | concat | relayout
    target_relpath: str
    source: SourceFile
    replicas: tuple[SourceFile, ...]  # the other ranks' files (equal to `source`, or the shards of a concat)
    source_base: str
    world: int = 1  # ranks that hold a file of this block (replicas must cover 0..world-1)
    transform: TransformSpec | None = None  # the proven geometry of a slice/concat/relayout

    @property
    def output_size(self) -> int:
        if self.transform is not None:
            return self.transform.output_size
        if self.action == "copy_pad":
            return padded_size(self.source.size)
        return self.source.size

    @property
    def sources(self) -> tuple[SourceFile, ...]:
        """Every file of the block in rank order (what a concat or relayout reads)."""
        return (self.source, *self.replicas)

    @property
    def source_bytes(self) -> int:
        return sum(f.size for f in self.sources)


@dataclass
class TargetPlan:
    """Everything to do for one target namespace, in the fixed merge order."""

    base_name: str
    rank_dir: str
    profile: str
    family: str  # target engine family: vllm | vllmcpp
    fields: dict[str, Any]
    sources: list[str]  # source base folders merged into this target, in merge order
    actions: list[BlockAction] = field(default_factory=list)
    already_present: list[int] = field(default_factory=lambda: [0, 0])  # blocks, bytes
    skipped: Counter = field(default_factory=Counter)  # (needs_action, reason) -> blocks
    skipped_bytes: Counter = field(default_factory=Counter)
    not_reusable: Counter = field(default_factory=Counter)  # reason -> blocks
    not_reusable_bytes: Counter = field(default_factory=Counter)
    conflicts: Counter = field(default_factory=Counter)  # reason -> blocks whose target path is taken

    @property
    def config_bytes(self) -> bytes:
        return canonical.config_json_bytes(self.fields, self.family)

    @property
    def digest(self) -> bytes:
        """Raw SHA-256 of the target identity (what vllm.cpp headers carry)."""
        return bytes.fromhex(canonical.full_digest(self.fields, self.family))

    def counts(self) -> dict[str, dict[str, int]]:
        """blocks/bytes per creating action; a second source's block at a target path an
        earlier source already fills (a merge) is counted under `merge_duplicate`."""
        out: dict[str, dict[str, int]] = {a: {"blocks": 0, "bytes": 0} for a in (*CREATING, "merge_duplicate")}
        seen: set[str] = set()
        for act in self.actions:
            key = "merge_duplicate" if act.target_relpath in seen else act.action
            seen.add(act.target_relpath)
            out[key]["blocks"] += 1
            out[key]["bytes"] += act.output_size
        return out

    @property
    def pending(self) -> int:
        c = self.counts()
        return sum(c[a]["blocks"] for a in CREATING)

    def transform_costs(self) -> dict[str, dict]:
        """Per transform: blocks, legacy bytes read, bytes written, estimated time, and
        the space saved (slice) or spent (concat, relayout); merge duplicates excluded."""
        totals: dict[str, list[int]] = {}
        seen: set[str] = set()
        for act in self.actions:
            if act.target_relpath in seen:
                continue
            seen.add(act.target_relpath)
            if act.transform is not None:
                t = totals.setdefault(act.action, [0, 0, 0])
                t[0] += 1
                t[1] += act.source_bytes
                t[2] += act.output_size
        return {a: transform_cost(a, *totals[a]) for a in TRANSFORMS if a in totals}


@dataclass
class Plan:
    root: str  # where the sources are (the scanned root)
    dest: str  # where targets go
    manifest_path: str | None
    target_profile: str
    metadata: dict[str, Any]
    targets: list[TargetPlan]
    untargeted: Counter  # reason -> blocks of namespaces with no target identity
    integrity_rows: int
    status_counts: Counter

    @property
    def pending(self) -> int:
        return sum(t.pending for t in self.targets)

    @property
    def conflicts(self) -> int:
        """Blocks whose target path the scan found taken by other bytes."""
        return sum(sum(t.conflicts.values()) for t in self.targets)

    def dry_run_exit_code(self) -> int:
        code = 1 if self.pending else 0
        if self.integrity_rows or self.conflicts:
            code |= 4
        return code


def _as_int(v: Any) -> int:
    return int(v) if v is not None else 0


def _world(ns: dict[str, Any]) -> int:
    """Ranks that must hold a copy of each block: tp x pcp for llm-d and vllm.cpp
    deployments (one file per rank), 1 for vLLM (the scheduler writes one row)."""
    cfg = ns.get("config_json") or {}
    if ns.get("family") in ("llmd", "vllmcpp"):
        try:
            return max(1, int(cfg.get("tp_size", 1)) * int(cfg.get("pcp_size", 1)))
        except (TypeError, ValueError):
            return max(1, len(ns.get("ranks") or [0]))
    return 1


def _unit_plan(ns: dict[str, Any]) -> UnitPlan:
    """The classification context of a source namespace, rebuilt from the manifest
    metadata (its config.json, resolved facts and target), so that a transform's numbers
    are re-derived the way the scan proved them (`outputs.transform_spec`)."""
    cfg = ns.get("config_json") or {}
    facts = ns.get("facts") or {}
    tgt = ns.get("target") or {}
    family = ns.get("family") or "unknown"
    tp, pp, pcp = (int(cfg.get(k, 1)) for k in ("tp_size", "pp_size", "pcp_size"))
    groups = cfg.get("kv_cache_groups") or []
    return UnitPlan(
        family=family,
        expected_ranks=tuple(range(tp * pcp)) if family == "llmd" else (0,),
        kv_kind=facts.get("kv_kind"),
        blocks_per_file=cfg.get("gpu_blocks_per_file", cfg.get("blocks_per_file")),
        layers={g: len(grp.get("layer_names") or []) for g, grp in enumerate(groups) if isinstance(grp, dict)},
        page_bytes=facts.get("page_bytes"),
        tensors_per_layer=facts.get("tensors_per_layer"),
        world=tp * pp * pcp,
        target=TargetInfo(profile=tgt.get("profile", ""), base=tgt.get("base_name", ""), d12=tgt.get("d12", ""),
                          rank_dir=tgt.get("rank_dir", ""), replicated_layout=bool(tgt.get("replicated_layout")),
                          parallel_agnostic=bool(tgt.get("parallel_agnostic"))))


def _check_target_path(relpath: str, rank_dir: str, where: str) -> None:
    check_relpath(relpath, where)
    parts = relpath.split("/")
    block = layout.parse_block(*parts[1:]) if len(parts) == 4 else None
    if parts[0] != rank_dir or block is None or block.misfiled:
        raise UsageError(f"{where}: target_relpath {relpath!r} is not a block path in the target rank folder "
                         f"{rank_dir!r}; refusing this manifest",
                         hint="regenerate the manifest with `kvmigrate scan`")


def _check_source_path(relpath: str, where: str) -> None:
    check_relpath(relpath, where)
    top = layout.parse_folder(relpath.split("/", 1)[0])
    if top is None or top.rank is None:
        raise UsageError(f"{where}: source {relpath!r} is not inside a rank folder; refusing this manifest",
                         hint="regenerate the manifest with `kvmigrate scan`")


def _rows(table: pa.Table, mask: pa.ChunkedArray | pa.Array | None) -> dict[str, list[Any]]:
    sub = table.filter(mask) if mask is not None else table
    return {name: sub.column(name).to_pylist() for name in sub.column_names}


def build_plan(manifest_path: str | os.PathLike[str], *, dest: str | None = None,
               table: pa.Table | None = None, metadata: dict[str, Any] | None = None) -> Plan:
    """Read a manifest (file or dataset directory) and build the plan.

    `dest` defaults to the scanned root. Raises UsageError for a manifest that is not
    from `kvmigrate scan` or holds a path that could leave its root.
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
    if table is None:
        table = manifest.read_table(manifest_path, columns=_COLUMNS)
    root = os.path.abspath(metadata["root"])
    namespaces: dict[str, dict[str, Any]] = metadata.get("namespaces") or {}
    where = str(manifest_path)

    # Target namespaces, keyed by target base name; sources merge in base-name order.
    targets: dict[str, TargetPlan] = {}
    target_of: dict[str, TargetPlan] = {}
    for src_base in sorted(namespaces):
        ns = namespaces[src_base]
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
        family = tgt.get("family") or ("vllmcpp" if ns.get("family") == "vllmcpp" else "vllm")
        try:
            proven = layout.base_name(tgt["fields"]["model_name"], canonical.d12(tgt["fields"], family))
        except (KeyError, TypeError, ValueError):
            proven = None
        if proven != base:
            raise UsageError(f"{where}: namespace {src_base!r}: target folder {base!r} is not the digest of its "
                             "target identity; refusing this manifest", hint="regenerate it with `kvmigrate scan`")
        tp = targets.get(base)
        if tp is None:
            tp = targets[base] = TargetPlan(base_name=base, rank_dir=rank_dir, profile=tgt.get("profile", ""),
                                            family=family, fields=tgt["fields"], sources=[])
        elif canonical.canonical_bytes(tp.fields, tp.family) != canonical.canonical_bytes(tgt["fields"], family):
            raise UsageError(f"{where}: namespaces map to target {base!r} with different identities")
        tp.sources.append(src_base)
        target_of[src_base] = tp

    action_col = pc.cast(table.column("action"), pa.string())
    status_col = pc.cast(table.column("status"), pa.string())
    status_counts = Counter(dict(zip(*_value_counts(status_col))))
    integrity_rows = sum(n for s, n in status_counts.items() if s in INTEGRITY_STATES)

    # 1. creating actions (one row per block: the rank-0 row)
    acts = _rows(table, pc.is_in(action_col, pa.array(list(CREATING))))
    # 2. replicas of multi-rank deployments, indexed by (deployment, group, block hash)
    multi = sorted({ns.get("deployment") or b for b, ns in namespaces.items() if _world(ns) > 1})
    world_of = {}
    for b, ns in namespaces.items():
        world_of[ns.get("deployment") or b] = max(world_of.get(ns.get("deployment") or b, 1), _world(ns))
    replicas: dict[tuple, list[SourceFile]] = defaultdict(list)
    if multi and acts["relpath"]:
        dep_col = pc.cast(table.column("deployment"), pa.string())
        mask = pc.and_(pc.is_in(dep_col, pa.array(multi)), pc.is_valid(table.column("block_hash")))
        mask = pc.and_(mask, pc.not_equal(status_col, "misfiled"))
        reps = _rows(table, mask)
        for i in range(len(reps["relpath"])):
            key = (reps["deployment"][i], reps["group"][i], reps["block_hash"][i])
            replicas[key].append(_source(reps, i))

    for i in range(len(acts["relpath"])):
        sb = acts["source_base"][i]
        tp = target_of.get(sb)
        rowname = f"{where}: row {acts['relpath'][i]!r}"
        if tp is None:
            raise UsageError(f"{rowname}: action {acts['action'][i]} but namespace {sb!r} has no target identity; "
                             "refusing this manifest", hint="regenerate it with `kvmigrate scan`")
        _check_source_path(acts["relpath"][i], rowname)
        _check_target_path(acts["target_relpath"][i], tp.rank_dir, rowname)
        if acts["target_relpath"][i] == acts["relpath"][i]:
            raise UsageError(f"{rowname}: target path equals the source path; refusing this manifest")
        src = _source(acts, i)
        dep = acts["deployment"][i] or sb
        reps: tuple[SourceFile, ...] = ()
        world = world_of.get(dep, 1)
        if world > 1:
            key = (dep, acts["group"][i], acts["block_hash"][i])
            reps = tuple(sorted((r for r in replicas.get(key, ()) if r.relpath != src.relpath),
                                key=lambda r: r.rank))
            for r in reps:
                _check_source_path(r.relpath, f"{where}: replica {r.relpath!r}")
        spec = None
        if acts["action"][i] in TRANSFORMS:
            try:
                spec = transform_spec(_unit_plan(namespaces[sb]), acts["action"][i], _as_int(acts["group"][i]),
                                      src.size, acts["reason"][i])
            except (SourceInvalid, TypeError, ValueError, KeyError) as exc:
                raise UsageError(f"{rowname}: {acts['action'][i]} is not proven by the namespace's identity and "
                                 f"facts ({exc}); refusing this manifest",
                                 hint="regenerate it with `kvmigrate scan`") from None
        tp.actions.append(BlockAction(acts["action"][i], acts["target_relpath"][i], src, reps, sb, world, spec))
    for tp in targets.values():
        tp.actions.sort(key=lambda a: (a.source_base, a.source.rank, a.target_relpath))

    # 3. counts of what is not created (Arrow group_by: no Python object per row)
    untargeted: Counter = Counter()
    dest_elsewhere = dest is not None and os.path.abspath(dest) != root
    for sb, action, reason, blocks, nbytes in _grouped_counts(table, action_col):
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
        elif action == "none" and reason.startswith(OCCUPIED_PREFIX):
            tp.conflicts[reason] += blocks
        elif action in NEEDS:
            tp.skipped[(action, reason)] += blocks
            tp.skipped_bytes[(action, reason)] += nbytes
        else:
            tp.not_reusable[reason or action] += blocks
            tp.not_reusable_bytes[reason or action] += nbytes

    return Plan(root=root, dest=os.path.abspath(dest) if dest else root,
                manifest_path=os.path.abspath(manifest_path) if manifest_path else None,
                target_profile=metadata.get("target_profile", ""), metadata=metadata,
                targets=[targets[k] for k in sorted(targets)], untargeted=untargeted,
                integrity_rows=integrity_rows, status_counts=status_counts)


def _grouped_counts(table: pa.Table, action_col: pa.ChunkedArray) -> list[tuple[str, str, str, int, int]]:
    """(source_base, action, reason, blocks, bytes) for block rows that create nothing.

    Rows that only point at their block's rank-0 row are left out (they are not blocks);
    an already-present target path is counted once, even when a migrated target
    namespace, rescanned, is its own source."""
    sub = pa.table({"source_base": pc.cast(table.column("source_base"), pa.string()),
                    "action": action_col,
                    "reason": pc.fill_null(pc.cast(table.column("reason"), pa.string()), ""),
                    "target_relpath": table.column("target_relpath"),
                    "size": pc.fill_null(table.column("size"), 0)})
    keep = pc.and_(pc.is_valid(table.column("block_hash")),
                   pc.invert(pc.fill_null(pc.is_in(action_col, pa.array(list(CREATING))), False)))
    keep = pc.and_(keep, pc.is_valid(action_col))
    for prefix in _PART_REASON_PREFIXES:
        keep = pc.and_(keep, pc.invert(pc.starts_with(sub.column("reason"), prefix)))
    sub = sub.filter(keep)
    present = sub.filter(pc.and_(pc.equal(sub.column("action"), "already_present"),
                                 pc.is_valid(sub.column("target_relpath"))))
    rest = sub.filter(pc.invert(pc.and_(pc.equal(sub.column("action"), "already_present"),
                                        pc.is_valid(sub.column("target_relpath")))))
    out = []
    if present.num_rows:
        first = present.group_by("target_relpath").aggregate([("source_base", "min"), ("size", "max"),
                                                              ("reason", "min")])
        g = pa.table({"source_base": first["source_base_min"], "reason": first["reason_min"],
                      "size": first["size_max"]}).group_by("source_base").aggregate(
            [("size", "count"), ("size", "sum")])
        out += [(b, "already_present", "", n, t) for b, n, t in
                zip(g["source_base"].to_pylist(), g["size_count"].to_pylist(), g["size_sum"].to_pylist())]
    if rest.num_rows:
        g = rest.group_by(["source_base", "action", "reason"]).aggregate([("size", "count"), ("size", "sum")])
        out += list(zip(g["source_base"].to_pylist(), g["action"].to_pylist(), g["reason"].to_pylist(),
                        g["size_count"].to_pylist(), g["size_sum"].to_pylist()))
    return out


def _value_counts(col: pa.ChunkedArray) -> tuple[list[Any], list[int]]:
    vc = pc.value_counts(col)
    return vc.field("values").to_pylist(), vc.field("counts").to_pylist()


def _source(cols: dict[str, list[Any]], i: int) -> SourceFile:
    return SourceFile(relpath=cols["relpath"][i], rank=_as_int(cols["rank"][i]), dev=_as_int(cols["dev"][i]),
                      inode=_as_int(cols["inode"][i]), size=_as_int(cols["size"][i]),
                      mtime_ns=_as_int(cols["mtime_ns"][i]), content_hash=cols["content_xxh3_128"][i],
                      payload_hash=cols["payload_xxh3_128"][i])


# --- rendering ---------------------------------------------------------------------------

def human_bytes(n: int) -> str:
    step = 1024.0
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < step or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= step
    return f"{n} B"


_LABELS = {"link": "link (hard link)", "copy_pad": "copy with padding", "rewrite_header": "rewrite header",
           "slice": "slice (one replica cell of each row)", "concat": "concat (rank files into one row)",
           "relayout": "relayout (block-major to tensor-major)",
           "merge_duplicate": "merge (same path as an earlier source)"}


def render_text(plan: Plan, apply_command: str | None = None) -> str:
    """The dry-run report: per target namespace, what would be created and what not."""
    lines = [f"migration plan for {plan.root}" + (f" -> {plan.dest}" if plan.dest != plan.root else ""),
             f"target profile: {plan.target_profile}"]
    for tp in plan.targets:
        c = tp.counts()
        lines.append("")
        lines.append(f"target namespace {tp.base_name}  ({tp.family}, files in {tp.rank_dir}/)")
        lines.append(f"  from: {', '.join(tp.sources)}")
        for a in (*CREATING, "merge_duplicate"):
            if c[a]["blocks"]:
                lines.append(f"  {_LABELS[a]:<40} {c[a]['blocks']:>9} blocks  {human_bytes(c[a]['bytes']):>10}")
        lines.append(f"  {'already present':<40} {tp.already_present[0]:>9} blocks  "
                     f"{human_bytes(tp.already_present[1]):>10}")
        for action, cost in tp.transform_costs().items():
            lines.append(f"  cost of {cost_line(action, cost, human_bytes)}")
        for (action, reason), n in sorted(tp.skipped.items()):
            lines.append(f"  skipped {action}: {n} blocks ({human_bytes(tp.skipped_bytes[(action, reason)])})"
                         f" - {reason}")
        for reason, n in sorted(tp.not_reusable.items()):
            lines.append(f"  not reusable: {n} blocks ({human_bytes(tp.not_reusable_bytes[reason])}) - {reason}")
        for reason, n in sorted(tp.conflicts.items())[:10]:
            lines.append(f"  conflict: {n} blocks - {reason}")
        if len(tp.conflicts) > 10:
            lines.append(f"  ... and {len(tp.conflicts) - 10} more conflicts")
    if plan.untargeted:
        lines.append("")
        lines.append("namespaces without a target identity:")
        for reason, n in sorted(plan.untargeted.items()):
            lines.append(f"  not reusable: {n} blocks - {reason}")
    lines.append("")
    if plan.integrity_rows:
        lines.append(f"integrity findings in the manifest: {plan.integrity_rows} files "
                     "(see `kvmigrate report` for details)")
    if plan.pending:
        lines.append(f"{plan.pending} blocks would be created. Nothing was written (dry run).")
        if apply_command:
            lines.append(f"to apply: {apply_command}")
    else:
        lines.append("nothing to do: every reusable block is already in place.")
    return "\n".join(lines)


def _printf_bytes(data: bytes) -> str:
    """A POSIX `printf` format that prints exactly `data` (octal escapes, no % or \\)."""
    out = []
    for b in data:
        ch = chr(b)
        if 0x20 <= b < 0x7F and ch not in "\\%'":
            out.append(ch)
        else:
            out.append(f"\\{b:03o}")
    return "'" + "".join(out) + "'"


def render_commands(plan: Plan, mode: str = "link") -> Iterable[str]:
    """The plan as a POSIX shell script (fclones-style). noclobber makes every `>` refuse
    an existing file and `ln` never replaces one; kvmigrate's replica, staleness and
    journal checks are not part of this form: prefer `--apply`."""
    q = shlex.quote
    yield "#!/bin/sh"
    yield "# kvmigrate migration plan; without --apply nothing has been written."
    yield "# This script skips kvmigrate's replica, staleness and journal checks: prefer `kvmigrate migrate --apply`."
    yield "set -eu"
    yield "set -o noclobber"
    for tp in plan.targets:
        base = os.path.join(plan.dest, tp.base_name)
        yield ""
        yield f"# target namespace {tp.base_name} (from {', '.join(tp.sources)})"
        yield f"mkdir -p -- {q(base)}"
        cfg = os.path.join(base, layout.CONFIG_NAME)
        yield f"[ -e {q(cfg)} ] || printf {_printf_bytes(tp.config_bytes)} > {q(cfg)}"
        made: set[str] = set()
        for act in tp.actions:
            dst = os.path.join(plan.dest, act.target_relpath)
            src = os.path.join(plan.root, act.source.relpath)
            parent = os.path.dirname(dst)
            if parent not in made:
                made.add(parent)
                yield f"mkdir -p -- {q(parent)}"
            if act.action == "link" and mode != "copy":
                yield f"[ -e {q(dst)} ] || ln -- {q(src)} {q(dst)}"
            elif act.action == "link":
                yield f"[ -e {q(dst)} ] || cat -- {q(src)} > {q(dst)}"
            elif act.action == "copy_pad":
                pad = act.output_size - act.source.size
                yield f"[ -e {q(dst)} ] || {{ cat -- {q(src)}; head -c {pad} /dev/zero; }} > {q(dst)}"
            elif act.transform is not None:
                yield f"[ -e {q(dst)} ] || {{ {_transform_script(plan.root, act)} }} > {q(dst)}"
            else:  # rewrite_header: new header, then exactly payload_size bytes of the payload
                payload = act.source.size - vllmcpp.HEADER_SIZE
                header = _rewritten_header_for_script(act, tp)
                yield (f"[ -e {q(dst)} ] || {{ printf {header}; tail -c +{vllmcpp.HEADER_SIZE + 1} -- {q(src)}"
                       f" | head -c {payload}; }} > {q(dst)}")


def _transform_script(root: str, act: BlockAction) -> str:
    """Shell commands that print a transform's row: slice = the first cell, concat = the
    rank files in rank order, relayout = each page with dd in [T][B][P] order; then the
    zero pad."""
    spec = act.transform
    assert spec is not None
    q = shlex.quote
    files = [q(os.path.join(root, f.relpath)) for f in act.sources]
    if spec.action == "slice":
        parts = [f"head -c {spec.cell} -- {files[0]};"]
    elif spec.action == "concat":
        parts = [f"cat -- {' '.join(files)};"]
    else:
        parts = [f"t=0; while [ $t -lt {spec.T} ]; do b=0; while [ $b -lt {spec.B} ]; do "
                 f"dd if={src} bs={spec.P} skip=$((b*{spec.T}+t)) count=1 2>/dev/null; b=$((b+1)); done; "
                 f"t=$((t+1)); done;" for src in files[:spec.cells]]
    pad = spec.output_size - spec.cells * spec.cell
    if pad:
        parts.append(f"head -c {pad} /dev/zero;")
    return " ".join(parts)


def _rewritten_header_for_script(act: BlockAction, tp: TargetPlan) -> str:
    """The header a rewrite writes can be derived from the plan alone: the key comes
    from the path, the payload size from the identity, the digest from the target."""
    name = act.target_relpath.rsplit("/", 1)[1][:-len(".bin")]
    group = int(act.target_relpath.split("/")[2].split("_g")[1])
    payload = int(tp.fields.get("page_size_bytes", act.source.size - vllmcpp.HEADER_SIZE))
    header = vllmcpp.encode_header(tp.digest, vllmcpp.make_key(bytes.fromhex(name), group), payload)
    return _printf_bytes(header)
