"""Where the stages meet: scan → manifest, audit, migrate with its own scan, verify.

The stages are `kvmigrate.scan` (walk a root, write the manifest), `kvmigrate.migrate`
(plan, apply, verify, rollback) and `kvmigrate.report` (summary, hints, renderers). They
never import each other (tests/test_layering.py): what one needs from another is passed
in here, and the CLI and scale-out call these functions. `parts` (--run-on ray --shards
N) runs the scan or the apply as parts through `kvmigrate.scaleout`, imported only then.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from kvmigrate import manifest as mf
from kvmigrate import scan as scan_stage
from kvmigrate import scratch
from kvmigrate.allocator import return_freed_memory
from kvmigrate.errors import UsageError
from kvmigrate.identity.values import DEFAULT_PROFILE, FACT_FLAGS
from kvmigrate.migrate.outputs import expected_transform_output
from kvmigrate.options import ScanOptions
from kvmigrate.report.summary import summarize, totals_for

if TYPE_CHECKING:  # the migration stage is imported by the commands that migrate or verify only
    from kvmigrate.migrate.model import Plan
    from kvmigrate.migrate.result import ApplyResult
    from kvmigrate.migrate.verify import VerifyResult
    from kvmigrate.outputs import Reclaimable, ReportOutput, Run


log = logging.getLogger(__name__)


@dataclass
class ScanResult:
    """A scan: the manifest written, its summary and exit code (interface.md §1)."""

    root: str
    output: str
    summary: ReportOutput
    exit_code: int
    rows: int
    files: int
    bytes: int
    seconds: float
    walk_errors: list[str] = field(default_factory=list)


def scan(root: str | os.PathLike[str], output: str | os.PathLike[str] = "kvmigrate-manifest.parquet",
         options: ScanOptions | None = None, *, manifest: str | None | bool = True, verb: str = "scan") -> ScanResult:
    """Scan ROOT into the manifest at `output` and summarize it in the same pass (the
    summary aggregates the batches as they are written). `manifest`, `verb`: what the
    summary's hints name (see report.summary.summarize)."""
    walked = scan_stage.scan(root, output, options, transform_output=expected_transform_output,
                             batch_sink=totals_for)
    summary = summarize(walked.output, manifest=manifest, verb=verb, totals=walked.totals)
    log.info("%s: summarized the manifest: exit code %d", verb, summary["exit_code"],
             extra={"exit_code": summary["exit_code"]})
    return ScanResult(walked.root, walked.output, summary, summary["exit_code"], summary["totals"]["files"],
                      walked.files, walked.bytes, walked.seconds, walked.walk_errors)


@dataclass(frozen=True)
class Parts:
    """--run-on ray --shards N [--ray-address ADDR]: the scan or apply runs as `count`
    Ray tasks; `on_part` hears of each finished part."""

    count: int
    address: str | None = None
    on_part: Callable[[Any], None] | None = None


def scan_any(root: str | os.PathLike[str], output: str | os.PathLike[str], options: ScanOptions, *,
             parts: Parts | None = None, manifest: str | None | bool = True, verb: str = "scan") -> Any:
    """`scan` in this process, or as `parts` Ray tasks into a dataset directory
    (kvmigrate.scaleout.ray_runner.scan_on_ray, where `options.shard` and
    `options.progress` do not apply); both results have root, output, summary,
    exit_code and seconds."""
    if parts is None:
        return scan(root, output, options, manifest=manifest, verb=verb)
    from kvmigrate.scaleout.ray_runner import scan_on_ray

    log.info("%s: %d parts as Ray tasks into %s", verb, parts.count, output, extra={"parts": parts.count})
    return scan_on_ray(scan, str(root), str(output), options, shards=parts.count, address=parts.address,
                       on_part=parts.on_part, manifest=manifest, verb=verb)


@contextlib.contextmanager
def scanned(root: str | os.PathLike[str], keep: str | os.PathLike[str] | None, options: ScanOptions, *,
            verb: str = "scan", kind: str = "scan", parts: Parts | None = None) -> Iterator[Any]:
    """Scan ROOT into `keep` (kept, and named by the hints), else into a private
    temporary directory outside the cache root (kvmigrate/scratch.py: `kind`), removed when
    the `with` ends: a command that scans before it reports, plans or verifies never writes
    into the tree it reads."""
    if keep is not None:
        yield scan_any(root, keep, options, parts=parts, verb=verb)
        return
    if parts is not None and parts.address:
        raise UsageError("with --ray-address the parts run on other machines: pass --manifest-out DIR on storage "
                         "every node mounts at the same path")
    tmp = scratch.make(kind)
    try:
        output = os.path.join(tmp, "manifest.parquet" if parts is None else "manifest")
        yield scan_any(root, output, options, parts=parts, verb=verb, manifest=None)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- audit -------------------------------------------------------------------------------


@dataclass
class AuditResult:
    summary: ReportOutput
    exit_code: int
    manifest: str | None  # None when the manifest was temporary
    seconds: float = 0.0  # the scan's wall time
    carried: int = 0  # rows whose hashes a --baseline carried over (files not opened)


def audit(root: str | os.PathLike[str], options: ScanOptions, *, manifest_out: str | os.PathLike[str] | None = None,
          parts: Parts | None = None) -> AuditResult:
    """`audit`: scan ROOT and return the report summary and the exit code (OR of the
    states' bits, +8 when the walk failed), in one call (for cron). The manifest is kept
    at `manifest_out` when given (the hints then point at it)."""
    with scanned(root, manifest_out, options, verb="audit", kind="audit", parts=parts) as result:
        return_freed_memory()  # the walk is done: the report's batches follow
        with_reclaimable(result.summary, result.output)
        code = result.exit_code | (with_runs(result.summary)["exit_code"] & 1)
        return AuditResult(result.summary, code, str(result.output) if manifest_out is not None else None,
                           result.seconds, mf.count_true(result.output, "carried"))


def with_runs(summary: ReportOutput) -> ReportOutput:
    """The summary plus the unfinished runs journaled under its root (running, or
    interrupted: a finding with the command that resumes it)."""
    from kvmigrate.migrate.runs import unfinished
    from kvmigrate.report.hints import with_unfinished_runs

    root = summary.get("root")
    runs = [cast("Run", r.to_dict()) for r in unfinished(root)] if isinstance(root, str) and os.path.isdir(root) else []
    return with_unfinished_runs(summary, runs)


# --- facts -------------------------------------------------------------------------------


def facts_skeleton(root: str, facts_resolver: Any, target: str = DEFAULT_PROFILE) -> dict[str, dict[str, Any]]:
    """`facts`: one FACTS.json entry per namespace of ROOT (keyed by its base folder; a
    flat family's deployment by its model name), with every fact its target needs: the
    value where a flag, an entry or a model config states it, else null (not stated:
    kvmigrate treats null as unknown). Reads config.json files only, no block."""
    from kvmigrate import families
    from kvmigrate.fsio import check_root
    from kvmigrate.identity.values import ORPHANED
    from kvmigrate.scan import flat, store_rows, tier_rows
    from kvmigrate.scan.roots import list_root, resolve_namespaces

    root_path = check_root(str(root))
    listing = list_root(root_path, facts_resolver.fsdir_of)
    namespaces = resolve_namespaces(root_path, listing, facts_resolver, target)
    namespaces += flat.resolve(root_path, listing, facts_resolver, target, "none")
    namespaces += tier_rows.resolve(root_path, listing, facts_resolver, target, "none")  # (names and sizes only)
    namespaces += store_rows.resolve(root_path, listing, facts_resolver, target, "none")
    out: dict[str, dict[str, Any]] = {}
    for ns in sorted(namespaces, key=lambda n: n.source_base):
        if ns.status != "ok" or ns.facts is None:
            continue
        needed: list[str] = []
        t = ns.target
        flat_family = families.get(ns.family).root_layout == "flat"
        if ns.target_error_flag:  # the target is not computed yet: the gate's facts are asked too
            needed += [f for f, flag in FACT_FLAGS.items() if flag == ns.target_error_flag]
            if t is None and ns.facts.kv_kind is None and not flat_family:
                needed.append("kv_kind")
        if t is not None:
            needed += list(t.missing_facts)
            if str(t.unreachable or "").startswith(ORPHANED) or t.writer_topology:
                needed += ["kv_kind", "writer_tp", "writer_pp"]
        if families.get(ns.family).settled_by == "--family" and \
                not families.get(ns.family).harmless_ambiguity(ns.fields or {}, ns.sampled_sizes):
            needed.append("family")  # the two readings give different bytes
        tiers = families.get(ns.family).root_layout == "tiers"
        stores = families.get(ns.family).root_layout == "stores"
        if tiers:  # an LMCache deployment: the facts its verdicts asked, keyed "<tier>:<model>" (§3.3)
            needed += list((ns.fields or {}).get("needs_facts") or [])
        if stores:  # a Mooncake deployment (mooncake.md §3.2): its asked facts and the apply's proofs
            if not (ns.fields or {}).get("engine"):
                continue  # (a store's own files: no deployment)
            needed += [*((ns.fields or {}).get("needs_facts") or []), "engine_stopped", "writer_release"]
        given = {f for f in ns.facts.sources if not ns.facts.sources[f].startswith("model_config:")}
        needed += sorted(given)  # what is stated stays stated, per namespace
        key = (ns.model_name or ns.source_base) if flat_family else ns.source_base
        if tiers:
            key = f"{(ns.fields or {}).get('tier')}:{ns.model_name}"
        if stores:
            key = f"{(ns.fields or {}).get('store')}:{ns.model_name}"
        entry = out.setdefault(key, {})
        for name in dict.fromkeys(needed):
            if name in FACT_FLAGS and name != "model_config":
                value = getattr(ns.facts, name, None)
                entry[name] = list(value) if isinstance(value, tuple) else value
    return out


# --- report ------------------------------------------------------------------------------


def with_reclaimable(summary: ReportOutput, manifest: str | os.PathLike[str], *,
                     partial: bool = False) -> ReportOutput:
    """The summary plus `reclaimable`: what `prune` of every class would take from the
    manifest, freed vs only unlinked (migrate.prune.reclaimable: prune's own selection).
    `partial` (report --only/--exclude): of the summary's namespaces only."""
    from kvmigrate.migrate.prune import reclaimable
    from kvmigrate.report.hints import with_reclaimable_figures

    keep = {n["source_base"] for n in summary["namespaces"]} if partial else None
    summary["reclaimable"] = cast("Reclaimable", reclaimable(str(manifest), namespaces=keep))
    return with_reclaimable_figures(summary)


def report(path: str, fmt: str = "text", selection: Any = None) -> tuple[str, int]:
    """`report`: (the rendered summary of the manifest with its reclaimable figures, exit
    code = the bits of the manifest, or of its `selection`)."""
    from kvmigrate.report import render

    summary = with_runs(with_reclaimable(render.summary_of(path, selection=selection), path, partial=bool(selection)))
    return render.render_summary(summary, fmt), summary["exit_code"]


# --- verify ------------------------------------------------------------------------------


def verify(root: str, journal: str | None = None, *, target_profile: str | None = None, summary: bool = True,
           threads: int | None = None, strict: bool = False, selection: Any = None) -> VerifyResult:
    """`verify`: the migration stage's checks (namespaces, journal), then with `summary`
    the root's totals from a stat-only scan into a temporary manifest, in the keys every
    `--json` command prints (verify's findings and exit code stay its own). `selection`:
    --only/--exclude, for the checks and the scan alike."""
    from kvmigrate.migrate import verify as verify_stage

    log.info("verify %s: checking namespace digests%s", root, f" and the blocks of journal {journal}" if journal else "")
    result = verify_stage.verify_root(root, journal, strict=strict, selection=selection)
    log.info("verify: checks done: exit code %d", result.exit_code, extra={"exit_code": result.exit_code})
    if summary:
        log.info("verify: stat-only scan for the summary")
        from kvmigrate.identity.facts import FactsResolver

        profile = target_profile or (verify_stage.journal_target_profile(journal) if journal else None)
        options = ScanOptions(target=profile or DEFAULT_PROFILE, facts_resolver=FactsResolver({}, None),
                              verify="size", threads=threads, selection=selection)
        with scanned(result.root, None, options, kind="verify") as scan_result:
            result.summary = {k: scan_result.summary[k] for k in verify_stage.SUMMARY_KEYS if k in scan_result.summary}
    return result


# --- migrate -----------------------------------------------------------------------------


@dataclass
class Migration:
    """A plan and the manifest it was built from (kept, or removed when the `with` of
    `migration` ends); `apply` runs it here or as parts."""

    plan: Plan
    manifest: str
    kept: bool
    identity_manifest: str  # "scan" for a plan of its own scan, else the manifest's path
    parts: int | None = None
    address: str | None = None

    def summary(self) -> ReportOutput:
        """The summary of the plan's manifest; its hints name the manifest only if it is kept."""
        return summarize(self.manifest, manifest=self.manifest if self.kept else None, verb="migrate")

    def apply(self, *, mode: str = "link", journal: str | None = None, command: str = "",
              progress: Callable[[int], None] | None = None,
              on_part: Callable[[Any], None] | None = None) -> ApplyResult:
        from kvmigrate.migrate.apply import apply_plan

        plan, guessed = self._without_guesses()
        identity = {"root": plan.root, "dest": plan.dest, "target_profile": plan.target_profile,
                    "manifest": self.identity_manifest}
        from kvmigrate.migrate.journal import default_journal_dir
        from kvmigrate.migrate.runs import check_no_interrupted_run

        check_no_interrupted_run([default_journal_dir(plan.root), *([journal] if journal else [])],
                                 {tp.base_name for tp in plan.targets if tp.actions}, identity)
        blocks = sum(len(tp.actions) for tp in plan.targets)
        log.info("apply: %d blocks into %d target namespaces (mode %s, journal %s)", blocks, len(plan.targets), mode,
                 journal or "default", extra={"blocks": blocks, "targets": len(plan.targets), "mode": mode})
        if guessed:
            log.info("apply: leaving out %d namespaces whose target is a guess", len(guessed))
        if self.parts is None:
            result = apply_plan(plan, mode=mode, journal=journal, command=command, identity=identity,
                                progress=_logged(progress, blocks))
        else:
            from kvmigrate.scaleout.ray_runner import apply_on_ray

            log.info("apply: %d parts as Ray tasks", self.parts)
            result = apply_on_ray(plan, self.manifest, shards=self.parts, address=self.address, mode=mode,
                                  journal=journal, command=command, identity=identity, on_part=on_part)
        log.info("apply: done: %s; journal %s", ", ".join(f"{k} {v}" for k, v in sorted(result.outcomes.items()))
                 or "nothing to do", result.journal_path,
                 extra={"outcomes": dict(result.outcomes), "journal": result.journal_path})
        result.left_out = guessed
        if guessed:
            result.bits |= 1  # a finding: blocks wait for facts (interface.md §4)
        return result

    def guessed_sources(self) -> dict[str, list[str]]:
        """Source namespace -> facts not given, of the sources of the plan's targets: their
        target is a guess (identity.md §4), which no --apply fills."""
        from kvmigrate.report.hints import guessed_targets

        guessed = guessed_targets(self.plan.metadata.get("namespaces") or {})
        return {src: guessed[src] for tp in self.plan.targets for src in tp.sources if src in guessed}

    def _without_guesses(self) -> tuple[Plan, dict[str, list[str]]]:
        """The plan to apply: without the namespaces whose target is a guess (the dry run
        printed no apply command for them; an --apply typed anyway must not place them)."""
        guessed = self.guessed_sources()
        if not guessed:
            return self.plan, {}
        from dataclasses import replace

        from kvmigrate.migrate.plan import build_plan
        from kvmigrate.selection import Selection

        selection = replace(self.plan.selection or Selection(), left_out=tuple(sorted(guessed)))
        plan = _plan(build_plan, self.manifest, self.plan.dest, False, selection)
        plan.stores = self.plan.stores  # (with the proofs stated on the command line)
        return plan, guessed


@contextlib.contextmanager
def migration(root: str | None, manifest: str | None = None, options: ScanOptions | None = None, *,
              apply: bool = False, dest: str | None = None, manifest_out: str | None = None,
              explicit_target: bool = False, parts: Parts | None = None) -> Iterator[Migration]:
    """`migrate`: plan from `manifest`, or from a scan of ROOT of its own with `options`
    (kept at `manifest_out`, else temporary). Its own scan hashes by default
    (ScanOptions.planning), in the dry run and with --apply alike: the plan is proven and
    the apply links what the scan read (never bytes nobody checked). With `parts`, one Ray
    session serves the scan and the apply. `options.selection` (--only/--exclude): its own
    scan reads, and the plan takes, only those namespaces; `options.target`,
    `facts_resolver` are checked against a `manifest`'s, `options.progress` shows the
    plan's bar."""
    options = options or ScanOptions.planning()
    target, progress, selection = options.target, options.progress, options.selection
    count, address = (parts.count, parts.address) if parts is not None else (None, None)
    if manifest is None and root is None:
        raise UsageError("give ROOT (scan it first) or --manifest M.parquet",
                         hint="kvmigrate migrate /cache/root   or   kvmigrate migrate --manifest m.parquet")
    from kvmigrate.migrate.plan import build_plan

    with contextlib.ExitStack() as stack:
        if parts is not None and (manifest is None or apply):
            from kvmigrate.scaleout.ray_runner import session

            stack.enter_context(session(address))
        if manifest is None:
            assert root is not None  # (refused above without ROOT or --manifest)
            scan_result = stack.enter_context(scanned(root, manifest_out, options, kind="migrate",
                                                      parts=parts))
            yield Migration(_plan(build_plan, scan_result.output, dest, progress, selection), str(scan_result.output),
                            kept=manifest_out is not None, identity_manifest="scan", parts=count, address=address)
            return
        check_manifest_facts(manifest, options.facts_resolver)
        plan = _plan(build_plan, manifest, dest, progress, selection)
        if explicit_target and plan.target_profile != target:
            raise UsageError(f"the manifest was scanned for --target {plan.target_profile}, not {target}",
                             path=manifest, hint=f"rescan with --target {target}, or drop --target")
        if root is not None and os.path.abspath(root) != plan.root:
            raise UsageError(f"ROOT {os.path.abspath(root)} differs from the manifest's root {plan.root}",
                             path=manifest, hint="drop ROOT or use the manifest of that root")
        yield Migration(plan, manifest, kept=True, identity_manifest=os.path.abspath(manifest), parts=count,
                        address=address)


def _plan(build_plan: Callable[..., Plan], manifest: Any, dest: str | None, progress: bool,
          selection: Any = None) -> Plan:
    """The plan, with its own bar (rows checked of the manifest's) on a terminal."""
    from kvmigrate.progress import Bar

    log.info("plan: reading the manifest %s", manifest)
    bar = Bar(progress, "plan", " rows")
    try:
        plan = build_plan(manifest, dest=dest, selection=selection, progress=bar.update if progress else None)
    finally:
        bar.close()
    log.info("plan: %d target namespaces, %d blocks to place", len(plan.targets),
             sum(len(tp.actions) for tp in plan.targets),
             extra={"targets": len(plan.targets), "blocks": sum(len(tp.actions) for tp in plan.targets)})
    return plan


def _logged(progress: Callable[[int], None] | None, total: int) -> Callable[[int], None] | None:
    """The apply's progress callback, plus a DEBUG line every tenth of the blocks (with -vv)."""
    if not log.isEnabledFor(logging.DEBUG) or total <= 0:
        return progress
    step = max(1, total // 10)
    done = [0]

    def tick(n: int) -> None:
        if progress is not None:
            progress(n)
        before = done[0]
        done[0] += n
        if done[0] // step != before // step or done[0] == total:
            log.debug("apply: %d of %d blocks done", done[0], total, extra={"done": done[0], "total": total})

    return tick


def check_manifest_facts(manifest_path: str, facts_resolver: Any) -> None:
    """Facts decide targets at scan time: with --manifest they may only repeat the scan's."""
    flags = getattr(facts_resolver, "flags", None) or {}
    facts_file = getattr(facts_resolver, "facts_file", None)
    if not flags and not facts_file:
        return
    scanned_facts = (mf.read_metadata(manifest_path).get("facts") or {})
    given = json.loads(json.dumps(flags, default=str))
    same_file = (facts_file is None or scanned_facts.get("facts_file") is not None
                 and os.path.abspath(facts_file) == os.path.abspath(scanned_facts["facts_file"]))
    if given != (scanned_facts.get("flags") or {}) or not same_file:
        raise UsageError("these facts differ from the ones the manifest was scanned with; targets are decided "
                         "at scan time", path=manifest_path,
                         hint="rescan: `kvmigrate migrate ROOT --<facts>` (or `kvmigrate scan`), or drop the facts")


# --- prune -------------------------------------------------------------------------------


@contextlib.contextmanager
def pruning(root: str | None, manifest: str | None = None, options: ScanOptions | None = None, *,
            classes: tuple[str, ...] = ("migrated",), migration_journal: str | None = None,
            quiet_period: float | None = None, force_live: bool = False, older_than: float | None = None,
            explicit_target: bool = False, manifest_out: str | None = None, apply: bool = False,
            selection: Any = None, engine_stopped: bool = False) -> Iterator[Any]:
    """`prune`: the prune plan of `manifest`, or of a scan of ROOT of its own with
    `options` (at `hash` by default, ScanOptions.planning, like migrate's: a replica is
    pruned only where its equality is proven). The scan's start time goes into the plan,
    so a file whose ctime is newer is kept. With `apply`, prune runs that were
    interrupted are finished first (before the scan). `selection` narrows the plan, never
    the scan (`options.selection` is not used): every target must be known."""
    options = (options or ScanOptions.planning()).but(selection=None)
    target = options.target
    if manifest is None and root is None:
        raise UsageError("give ROOT (scan it first) or --manifest M.parquet",
                         hint="kvmigrate prune /cache/root   or   kvmigrate prune --manifest m.parquet")
    import time

    from kvmigrate.migrate.prune import DEFAULT_QUIET_PERIOD, build_plan
    from kvmigrate.migrate.quarantine import finish_interrupted

    finished = []
    if apply:
        where = root if root is not None else mf.read_metadata(manifest).get("root") if manifest is not None else None
        finished = finish_interrupted(os.path.abspath(where)) if isinstance(where, str) else []
    plan_options = dict(classes=classes, migration_journal=migration_journal, force_live=force_live,
                        quiet_period=DEFAULT_QUIET_PERIOD if quiet_period is None else quiet_period,
                        older_than=older_than, selection=selection, engine_stopped=engine_stopped)
    log.info("prune: classes %s%s", ", ".join(classes), ", after finishing interrupted runs" if finished else "")
    if manifest is None:
        assert root is not None  # (refused above without ROOT or --manifest)
        started = time.time_ns()
        with scanned(root, manifest_out, options, kind="prune") as scan_result:
            plan = build_plan(str(scan_result.output), **plan_options)
            plan.scan_started_ns, plan.finished = started, finished
            yield plan
        return
    check_manifest_facts(manifest, options.facts_resolver)
    plan = build_plan(manifest, **plan_options)
    plan.finished = finished
    if explicit_target and (mf.read_metadata(manifest).get("target_profile") or target) != target:
        raise UsageError(f"the manifest was scanned for another --target than {target}", path=manifest,
                         hint=f"rescan with --target {target}, or drop --target")
    if root is not None and os.path.abspath(root) != plan.root:
        raise UsageError(f"ROOT {os.path.abspath(root)} differs from the manifest's root {plan.root}",
                         path=manifest, hint="drop ROOT or use the manifest of that root")
    yield plan
