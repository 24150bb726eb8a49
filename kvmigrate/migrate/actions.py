"""Plan actions, typed (fclones' `FsCommand`): each kind of block action says, in one
place, how it executes (through the run's placing primitives, `place.Placer`:
`link`, `copy`, `transform`; no file logic here), its line in the `--print-commands` shell script and
its line in the dry-run text. The Applier and the renderers look the kind up by the
action string once per action (`ACTIONS`); a `BlockAction` stays a plain NamedTuple.

Also here: the dry-run report (`render_text`) and the shell form (`render_commands`).
"""

from __future__ import annotations

import os
import shlex
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from kvmigrate import findings, layout
from kvmigrate.cost import cost_line
from kvmigrate.formats import vllmcpp
from kvmigrate.migrate.competing import COMPETING
from kvmigrate.migrate.fsops import padded_size
from kvmigrate.migrate.model import MERGE
from kvmigrate.transforms_lmcache import HEADER_BYTES, head_runs
from kvmigrate.units import human_bytes, human_count, plural

if TYPE_CHECKING:
    from kvmigrate.migrate.model import BlockAction, Plan, TargetPlan
    from kvmigrate.migrate.outputs import TransformSpec


class Placing(Protocol):
    """What a kind executes through: the run's placing primitives (`place.Placer`),
    passed in, so that this module does not import the placer."""

    mode: str

    def link(self, tp: TargetPlan, act: BlockAction, src_hash: bytes | None) -> None: ...

    def copy(self, tp: TargetPlan, act: BlockAction, action: str, src_hash: bytes | None) -> None: ...

    def transform(self, tp: TargetPlan, act: BlockAction, spec: TransformSpec) -> None: ...


class ActionKind:
    """One kind of block action. `shell` returns the script line that makes the block
    (noclobber: it never replaces a file at `dst`); `text` the dry-run line of its totals."""

    name = ""
    label = ""  # what the dry run calls it

    def execute(self, placer: Placing, tp: TargetPlan, act: BlockAction, src_hash: bytes | None) -> None:
        """Make the block (its sources already checked by `Applier._block`)."""
        raise NotImplementedError

    def shell(self, act: BlockAction, tp: TargetPlan, root: str, dst: str, mode: str) -> str:
        raise NotImplementedError

    def text(self, blocks: int, nbytes: int) -> str:
        noun = "block " if blocks == 1 else "blocks"
        return f"  {self.label:<40} {human_count(blocks):>9} {noun}  {human_bytes(nbytes):>10}"

    def output_size(self, act: BlockAction) -> int:
        """The bytes the block's file will hold."""
        return act.source.size

    def writes_temp(self, mode: str) -> bool:
        """The block is written to a temp file first (journaled with its intent)."""
        return True


class Link(ActionKind):
    """The source file itself, hard-linked (`--mode copy`: its bytes copied)."""

    name, label = "link", "link (hard link)"

    def execute(self, placer: Placing, tp: TargetPlan, act: BlockAction, src_hash: bytes | None) -> None:
        if placer.mode != "copy":
            placer.link(tp, act, src_hash)
        else:
            placer.copy(tp, act, "link", src_hash)

    def shell(self, act: BlockAction, tp: TargetPlan, root: str, dst: str, mode: str) -> str:
        q = shlex.quote
        src = os.path.join(root, act.source.relpath)
        if mode != "copy":
            return f"[ -e {q(dst)} ] || ln -- {q(src)} {q(dst)}"
        return f"[ -e {q(dst)} ] || cat -- {q(src)} > {q(dst)}"

    def writes_temp(self, mode: str) -> bool:
        return mode != "link"


class CopyPad(ActionKind):
    """The source's bytes, zero-padded to the page size the target engine reads."""

    name, label = "copy_pad", "copy with padding"

    def execute(self, placer: Placing, tp: TargetPlan, act: BlockAction, src_hash: bytes | None) -> None:
        placer.copy(tp, act, self.name, src_hash)

    def shell(self, act: BlockAction, tp: TargetPlan, root: str, dst: str, mode: str) -> str:
        q = shlex.quote
        src = os.path.join(root, act.source.relpath)
        pad = self.output_size(act) - act.source.size
        return f"[ -e {q(dst)} ] || {{ cat -- {q(src)}; head -c {pad} /dev/zero; }} > {q(dst)}"

    def output_size(self, act: BlockAction) -> int:
        return padded_size(act.source.size)


class RewriteHeader(ActionKind):
    """A vllm.cpp block with the target identity's header and the source's payload."""

    name, label = "rewrite_header", "rewrite header"

    def execute(self, placer: Placing, tp: TargetPlan, act: BlockAction, src_hash: bytes | None) -> None:
        if act.transform is not None:  # an LMCache chunk's header added, stripped or changed (a TierSpec)
            placer.transform(tp, act, act.transform)
        else:
            placer.copy(tp, act, self.name, src_hash)

    def output_size(self, act: BlockAction) -> int:
        return act.transform.output_size if act.transform is not None else act.source.size

    def shell(self, act: BlockAction, tp: TargetPlan, root: str, dst: str, mode: str) -> str:
        if act.transform is not None:
            return tier_shell(act, root, dst)
        # new header, then exactly payload_size bytes of the payload
        q = shlex.quote
        src = os.path.join(root, act.source.relpath)
        payload = act.source.size - vllmcpp.HEADER_SIZE
        header = _rewritten_header_for_script(act, tp)
        return (f"[ -e {q(dst)} ] || {{ printf {header}; tail -c +{vllmcpp.HEADER_SIZE + 1} -- {q(src)}"
                f" | head -c {payload}; }} > {q(dst)}")


class Transform(ActionKind):
    """A new row built from the block's files by the proven geometry the plan carries
    (`act.transform`); its shell form prints the row's cells (`cells`), then the zero pad."""

    def execute(self, placer: Placing, tp: TargetPlan, act: BlockAction, src_hash: bytes | None) -> None:
        placer.transform(tp, act, act.transform_spec)

    def shell(self, act: BlockAction, tp: TargetPlan, root: str, dst: str, mode: str) -> str:
        q = shlex.quote
        spec = act.transform_spec
        parts = self.cells(spec, [q(os.path.join(root, f.relpath)) for f in act.sources])
        pad = spec.output_size - spec.cells * spec.cell
        if pad:
            parts.append(f"head -c {pad} /dev/zero;")
        return f"[ -e {q(dst)} ] || {{ {' '.join(parts)} }} > {q(dst)}"

    def cells(self, spec: TransformSpec, files: list[str]) -> list[str]:
        """Shell commands that print the row's cells from the (quoted) rank files."""
        raise NotImplementedError

    def output_size(self, act: BlockAction) -> int:
        return act.transform_spec.output_size


class Slice(Transform):
    """The first cell of a row that holds equal replica cells."""

    name, label = "slice", "slice (one replica cell of each row)"

    def cells(self, spec: TransformSpec, files: list[str]) -> list[str]:
        return [f"head -c {spec.cell} -- {files[0]};"]


class Concat(Transform):
    """The rank files in rank order."""

    name, label = "concat", "concat (rank files into one row)"

    def cells(self, spec: TransformSpec, files: list[str]) -> list[str]:
        return [f"cat -- {' '.join(files)};"]


class Relayout(Transform):
    """Each page, with dd, in [T][B][P] (tensor-major) order (an SGLang page: L and P
    swapped, per K/V half)."""

    name, label = "relayout", "relayout (block-major to tensor-major; SGLang: L and P axes)"

    def cells(self, spec: TransformSpec, files: list[str]) -> list[str]:
        if spec.halves > 1:  # an SGLang MHA page: the K half, then the V half, each transposed
            return [f"h=0; while [ $h -lt {spec.halves} ]; do t=0; while [ $t -lt {spec.T} ]; do b=0; "
                    f"while [ $b -lt {spec.B} ]; do dd if={src} bs={spec.P} "
                    f"skip=$((h*{spec.B * spec.T}+b*{spec.T}+t)) count=1 2>/dev/null; b=$((b+1)); done; "
                    f"t=$((t+1)); done; h=$((h+1)); done;" for src in files[:spec.cells]]
        return [f"t=0; while [ $t -lt {spec.T} ]; do b=0; while [ $b -lt {spec.B} ]; do "
                f"dd if={src} bs={spec.P} skip=$((b*{spec.T}+t)) count=1 2>/dev/null; b=$((b+1)); done; "
                f"t=$((t+1)); done;" for src in files[:spec.cells]]


class Reshard(ActionKind):
    """One target rank's file of an LMCache chunk re-split along the head axis (lmcache.md
    §3.4), or its GDS sidecar; the shell form is a stdlib Python line doing the same."""

    name, label = "reshard", "reshard (LMCache head shards to another TP)"

    def execute(self, placer: Placing, tp: TargetPlan, act: BlockAction, src_hash: bytes | None) -> None:
        placer.transform(tp, act, act.transform_spec)

    def shell(self, act: BlockAction, tp: TargetPlan, root: str, dst: str, mode: str) -> str:
        return tier_shell(act, root, dst)

    def output_size(self, act: BlockAction) -> int:
        return act.transform_spec.output_size


_TIER_SCRIPT = ("import os,sys;a=sys.argv;h=bytes.fromhex(a[2]);o=int(a[3]);n=int(a[4]);ws=int(a[5]);"
                "sp=[tuple(map(int,x.split(':'))) for x in a[6].split(',') if x];"
                "fs=[os.open(p,os.O_RDONLY) for p in a[7:]];"
                "f=os.open(a[1],os.O_WRONLY|os.O_CREAT|os.O_EXCL,0o644);os.write(f,h);"
                "[os.write(f,b''.join(os.pread(fs[r],l,o+i*ws+s) for r,s,l in sp)) for i in range(n)]")


def tier_shell(act: BlockAction, root: str, dst: str) -> str:
    """A stdlib Python line writing an LMCache tier output (header, then its rows)."""
    q = shlex.quote
    spec: Any = act.transform  # (a TierSpec)
    files = [q(os.path.join(root, f.relpath)) for f in act.sources]
    off = HEADER_BYTES[spec.src_header]
    if spec.dst_header == "sidecar":
        rows, width, spans = 0, 0, ""
    elif spec.action == "reshard":
        g = spec.geometry()
        width = g.heads_per_rank(g.tp_src) * g.head_bytes
        rows = g.rows
        spans = ",".join(f"{r.src_rank}:{r.src_head * g.head_bytes}:{r.heads * g.head_bytes}"
                         for r in head_runs(g, spec.dst_rank))
    else:
        rows, width, spans = 1, spec.payload_src, f"0:0:{spec.payload_src}"
        files = files[:1]
    return (f"[ -e {q(dst)} ] || python3 -c {q(_TIER_SCRIPT)} {q(dst)} {q(spec.header().hex())} "
            f"{off} {rows} {width} {q(spans)} {' '.join(files)}")


ACTIONS: dict[str, ActionKind] = {k.name: k for k in (Link(), CopyPad(), RewriteHeader(), Slice(), Concat(),
                                                       Relayout(), Reshard())}


# --- rendering ---------------------------------------------------------------------------

MERGE_LABEL = "merge (already present: the same block from another source)"

def _conflict_causes(conflicts: Counter) -> Counter:
    """Conflicts by cause: the scan names each taken target path in its reason; the
    dry run groups them without the path (the manifest and the apply list each one)."""
    out: Counter = Counter()
    for reason, n in conflicts.items():
        out[findings.without_occupied_path(reason)] += n
    return out


def render_text(plan: Plan, apply_command: str | None = None, dest_command: str | None = None) -> str:
    """The dry-run report: per target namespace, what would be created and what not;
    `dest_command`: the apply command with --dest <DIR>, for what only waits for it."""
    lines = [f"migration plan for {plan.root}" + (f" -> {plan.dest}" if plan.dest != plan.root else ""),
             f"target profile: {plan.target_profile}"]
    for tp in plan.targets:
        c = tp.counts()
        lines.append("")
        if tp.lock is not None:
            where = f"files in tier {tp.lock or '.'}, {tp.profile}"
        elif tp.flat:
            where = f"page files in the destination directory, {tp.profile}"
        else:
            where = f"files in {tp.rank_dir}/"
        lines.append(f"target namespace {tp.base_name}  ({tp.family}, {where})")
        lines.append(f"  from: {', '.join(tp.sources)}")
        lines += [f"  rests on: {claim}" for claim in tp.claims]
        for a, kind in ACTIONS.items():
            if c[a]["blocks"]:
                lines.append(kind.text(c[a]["blocks"], c[a]["bytes"]))
        lines.append(f"  {'already present':<40} {human_count(tp.already_present[0]):>9} "
                     f"{'block ' if tp.already_present[0] == 1 else 'blocks'}  "
                     f"{human_bytes(tp.already_present[1]):>10}")
        if c[MERGE]["blocks"]:
            lines.append(f"  {MERGE_LABEL}: {plural(c[MERGE]['blocks'], 'block')} ({human_bytes(c[MERGE]['bytes'])})")
        if tp.unverified_merges:
            lines.append(f"    of which {tp.unverified_merges} only by size (the manifest has no content hashes): "
                         "their bytes are compared at apply, a difference is a conflict")
        for action, cost in tp.transform_costs().items():
            lines.append(f"  cost of {cost_line(action, cost, human_bytes)}")
        for (action, reason), n in sorted(tp.skipped.items()):
            lines.append(f"  skipped {action}: {plural(n, 'block')} ({human_bytes(tp.skipped_bytes[(action, reason)])})"
                         f" - {reason}")
        for reason, n in sorted(tp.not_reusable.items()):
            lines.append(f"  not reusable: {plural(n, 'block')} ({human_bytes(tp.not_reusable_bytes[reason])})"
                         f" - {reason}")
        causes = _conflict_causes(tp.conflicts)
        for reason, n in sorted(causes.items())[:10]:
            lines.append(f"  conflict: {plural(n, 'block')} - {reason}")
        if len(causes) > 10:
            lines.append(f"  ... and {len(causes) - 10} more causes of conflicts")
        if any(r.startswith(COMPETING) for r in tp.conflicts):
            lines.append("  (competing sources for one target path: the one whose size is the target's is placed, "
                         "never one by name order; the others stay in their legacy folder)")
        lines.append("  outcomes: " + ", ".join(f"{k} {n}" for k, n in tp.outcomes().items()
                                                 if k not in ("changed_since_scan", "failed")))
    if plan.stores:
        from kvmigrate.migrate.stores import describe

        lines.append("")
        into = plan.dest if os.path.abspath(plan.dest) != os.path.abspath(plan.root) else None
        lines.append("Mooncake stores (index entries rekeyed in place, KVEntries written at fpk(key)):" if into is None
                     else "Mooncake stores (what the target reads, placed into the destination):")
        lines += describe(plan.stores, into)
    if plan.not_built:
        lines.append("")
        lines.append("planned by the scan, not applied by this kvmigrate yet (nothing of them is written):")
        for (title, action), n in sorted(plan.not_built.items()):
            lines.append(f"  {title}: {plural(n, 'object')} pending {action}")
    if plan.untargeted:
        lines.append("")
        lines.append("namespaces without a target identity:")
        for reason, n in sorted(plan.untargeted.items()):
            lines.append(f"  not reusable: {plural(n, 'block')} - {reason}")
    lines.append("")
    if plan.integrity_rows:
        lines.append(f"integrity findings in the manifest: {plural(plan.integrity_rows, 'file')} "
                     "(see `kvmigrate report` for details)")
    lines.append("outcomes if applied: " + ", ".join(f"{k} {n}" for k, n in plan.outcomes().items())
                 + " (changed_since_scan and failed are only known when applying)")
    waiting, waiting_bytes = plan.waiting_for_dest
    if plan.pending:
        from kvmigrate.migrate.stores import apply_label, unproven

        lines.append(f"{plural(plan.pending, 'block')} would be created. Nothing was written (dry run).")
        stores = unproven(plan.root, plan.dest, plan.stores)
        if apply_command:
            lines.append(f"{apply_label(stores) if stores else 'to apply:'} {apply_command}")
    if waiting:
        lines.append(f"{plural(waiting, 'block')} ({human_bytes(waiting_bytes)}) wait for --dest DIR: a relayout "
                     "keeps the page's file name, so it is written into a new storage directory DIR (with links to "
                     "the pages kept as they are), never over a source." + ("" if plan.pending else
                                                                            " Nothing was written (dry run)."))
        if dest_command:
            lines.append(f"to apply: {dest_command}")
    if not plan.pending and not waiting and not plan.not_built:
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
        made: set[str] = set()
        if tp.flat:
            made.add(plan.dest)  # page files in the destination directory: no folder, no config.json
        else:
            yield f"mkdir -p -- {q(base)}"
            cfg = os.path.join(base, layout.CONFIG_NAME)
            yield f"[ -e {q(cfg)} ] || printf {_printf_bytes(tp.config_bytes)} > {q(cfg)}"
        for act in tp.actions:
            dst = os.path.join(plan.dest, act.target_relpath)
            parent = os.path.dirname(dst)
            if parent not in made:
                made.add(parent)
                yield f"mkdir -p -- {q(parent)}"
            yield ACTIONS[act.action].shell(act, tp, plan.root, dst, mode)
    for store in plan.stores:  # an index rewrite needs the proofs, the round-trip check and the journal
        yield ""
        yield (f"# Mooncake store {store.store}: {sum(store.objects.values())} objects ({len(store.rewrites)} index "
               f"rewrites, {len(store.entries)} KVEntries) are not in this script: their index rewrites need "
               "kvmigrate's proof that no client runs and its journal; run `kvmigrate migrate --apply`")


def _rewritten_header_for_script(act: BlockAction, tp: TargetPlan) -> str:
    """The header a rewrite writes can be derived from the plan alone: the key comes
    from the path, the payload size from the identity, the digest from the target."""
    parsed = layout.parse_block_relpath(act.target_relpath)
    if parsed is None:  # the plan checked it: `_check_target_path`
        raise ValueError(f"not a block path: {act.target_relpath}")
    block = parsed[1]
    name, group = block.hex_hash, block.group
    payload = int(tp.fields.get("page_size_bytes", act.source.size - vllmcpp.HEADER_SIZE))
    header = vllmcpp.encode_header(tp.digest, vllmcpp.make_key(bytes.fromhex(name), group), payload)
    return _printf_bytes(header)
