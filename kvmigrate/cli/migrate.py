"""`kvmigrate migrate ROOT | --manifest M`: plan (dry run, the default) or `--apply`."""

from __future__ import annotations

import logging
import shlex
import signal
import sys
from typing import TYPE_CHECKING, cast

import click

from kvmigrate.cli.common import (
    Rate,
    Seconds,
    check_scaleout,
    exit_stopped,
    facts_options,
    handle_errors,
    interrupt_on_sigterm,
    io_depth_option,
    output_options,
    pacing_options,
    part_done,
    pop_fact_flags,
    pop_selection,
    print_json,
    rerun_command,
    returning_jemalloc,
    scaleout_options,
    selection_options,
    start_pacing,
)
from kvmigrate.units import plural

if TYPE_CHECKING:  # the models are types only: importing them costs every command's start-up
    from kvmigrate.outputs import ApplyResult, MigrateApplyOutput, MigrateDryRunOutput, SummaryCore, Target

# Options that describe what to do, not how to show it: they go into the printed apply command.
_NOT_IN_APPLY_COMMAND = {"apply", "print_commands", "as_json", "quiet", "verbose", "log_format", "manifest_out"}


log = logging.getLogger(__name__)


@click.command("migrate")
@click.argument("root", required=False, type=click.Path(file_okay=False, path_type=str))
@click.option("--manifest", "manifest_path", type=click.Path(exists=True, path_type=str),
              help="Use this manifest (file or dataset directory) instead of scanning ROOT.")
@click.option("--apply", "apply", is_flag=True, help="Create the target namespaces (default: dry run).")
@click.option("--mode", type=click.Choice(["link", "copy", "auto"]), default="link", show_default=True,
              help="How `link` actions materialize: hard link only, byte copy, or link and copy only "
                   "across filesystems (EXDEV/EMLINK).")
@click.option("--dest", type=click.Path(exists=True, file_okay=False, path_type=str),
              help="Put target namespaces under this root instead of the scanned one.")
@click.option("--journal", type=click.Path(path_type=str),
              help="Journal file or directory, any filesystem (default: ROOT/.kvmigrate/journals/<run-id>.journal; "
                   "about 90 bytes per linked block).")
@click.option("--print-commands", is_flag=True, help="Print the plan as a POSIX shell script and exit.")
@click.option("--manifest-out", type=click.Path(path_type=str),
              help="Keep the manifest of the scan that `migrate ROOT` runs first (with --run-on ray: a dataset "
                   "directory).")
@click.option("--verify", "verify", type=click.Choice(["none", "size", "hash"]), default=None,
              help="Scan depth when scanning ROOT first [default: hash: every block is read once, so the plan "
                   "is proven (crash residue, replica equality, vllm.cpp headers, slice cell sizes) and the dry "
                   "run shows what --apply does]. With size or none, --apply reads each block before placing "
                   "it instead.")
@click.option("--engine-stopped", "engine_stopped", is_flag=True,
              help="Mooncake stores: no Mooncake client uses any store of ROOT (the proof an apply needs where "
                   "kvmigrate cannot take 0.3.14's client lock; mooncake.md 5.1).")
@io_depth_option
@facts_options
@selection_options
@scaleout_options
@pacing_options
@output_options
@handle_errors
def command(root: str | None, manifest_path: str | None, apply: bool, mode: str, dest: str | None,
            journal: str | None, print_commands: bool, manifest_out: str | None, verify: str | None,
            engine_stopped: bool,
            threads: int | None, as_json: bool, quiet: bool, verbose: int, target: str, run_on: str,
            shards: int | None, ray_address: str | None, max_duration: Seconds | None, bwlimit: Rate | None,
            idle_io: bool, **kwargs) -> None:
    """Migrate reusable blocks into the namespaces the target engine reads.

    Without --apply this is a dry run: it prints, per target namespace, how many blocks
    would be linked, copied with padding, rewritten, are already present, conflict (by
    cause) or are not reusable, the outcomes --apply will report, and the command that
    applies it. It writes nothing. Two source namespaces with one target path (e.g. TP=2
    and TP=4 caches of one model): equal bytes merge; otherwise the block of the target's
    size (its geometry, or the most common size of the target's blocks) is placed and the
    other is a conflict; without one such block, neither is placed.

    \b
    Exit code: dry run 1 if changes are pending (0 if none), +4 for conflicts it would
    meet or integrity states of blocks it would place; --apply 0 when it did all it
    could (other findings are reported, not failed on), 4 if a conflict or an integrity
    problem of what it placed or would place remains, 8 operational stop (the journal
    stays consistent: rerun the same command to resume); 2 usage error.
    """
    # The plan reads the manifest a chunk at a time: jemalloc returning freed pages at once
    # keeps the peak RSS flat (40-200 MiB less on a 400k-row manifest than mimalloc).
    returning_jemalloc()

    from kvmigrate import pipeline
    from kvmigrate.identity.facts import FactsResolver

    ctx = click.get_current_context()
    facts_file = kwargs.pop("facts_file", None)
    resolver = FactsResolver(pop_fact_flags(kwargs), facts_file)
    selection = pop_selection(kwargs)
    parts = check_scaleout(run_on, shards, ray_address)
    start_pacing(max_duration, bwlimit, idle_io, quiet, parts)
    apply_command = _apply_command(ctx)
    dest_command = _apply_command(ctx, dest="<DIR>")
    stopped_command = _apply_command(ctx, extra=("--engine-stopped",))
    from kvmigrate.options import ScanOptions

    options = ScanOptions.planning(
        verify, target=target, facts_resolver=resolver, threads=threads, progress=not quiet and sys.stderr.isatty(),
        selection=selection, command="kvmigrate " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else None)
    with pipeline.migration(
            root, manifest_path, options, apply=apply, dest=dest, manifest_out=manifest_out,
            explicit_target=ctx.get_parameter_source("target") == click.core.ParameterSource.COMMANDLINE,
            parts=None if parts is None else pipeline.Parts(parts, ray_address)) as run:
        for store in run.plan.stores:  # (the operator's statement for every store of ROOT)
            store.stopped_stated |= engine_stopped
        if run.plan.holds_no_cache:  # an empty or unmounted root: nothing to plan, no journal to write there
            from kvmigrate.errors import OperationalError
            from kvmigrate.report.hints import no_cache_message

            raise OperationalError(no_cache_message(run.plan.root, run.plan.status_counts.get("foreign", 0)),
                                   hint="mount the cache volume (or pass the engine's cache root_dir), then plan "
                                        "again")
        if print_commands:
            from kvmigrate.migrate.actions import render_commands

            for line in render_commands(run.plan, mode):
                click.echo(line)
            sys.exit(0)
        log.info("migrate: %s", "applying the plan" if apply else "dry run: the plan only, nothing written")
        if apply:
            _apply(run, mode, journal, apply_command, as_json, quiet)
        else:
            from kvmigrate.migrate.stores import unproven

            if unproven(run.plan.root, run.plan.dest, run.plan.stores):  # (exit 2 without the statement)
                apply_command = stopped_command
            _dry_run(run, apply_command, dest_command, as_json, quiet)


def _apply(run, mode: str, journal: str | None, apply_command: str, as_json: bool, quiet: bool) -> None:
    """--apply: run the plan (a progress bar on a terminal, SIGTERM as Ctrl-C: a stopped
    run stays resumable), print what happened and exit with its code."""
    from kvmigrate.migrate.result import render_result
    from kvmigrate.pacing import Interrupted
    from kvmigrate.progress import Bar

    plan = run.plan
    bar = Bar(run.parts is None and not quiet and sys.stderr.isatty(), "migrate", "block",
              sum(len(t.actions) for t in plan.targets), unit_scale=False, dynamic_ncols=False)
    progress = bar.advance if bar.enabled else None

    previous = signal.signal(signal.SIGTERM, interrupt_on_sigterm)
    try:
        result = run.apply(mode=mode, journal=journal, command=apply_command, progress=progress,
                           on_part=None if quiet else part_done)
    except Interrupted as stopped:
        bar.close()
        _stopped(stopped, apply_command)
    finally:
        signal.signal(signal.SIGTERM, previous)
        bar.close()
    code = result.exit_code
    if plan.not_built:  # work the scan planned that this kvmigrate does not apply yet: pending, never "done"
        code |= 1
    if as_json:
        summary: SummaryCore = run.summary()
        applied: MigrateApplyOutput = {**summary, "outcomes": dict(result.outcomes),
                                       "apply": cast("ApplyResult", result.to_dict()), "exit_code": code,
                                       "targets": _targets_json(plan)}
        print_json(applied)
    elif not quiet:
        click.echo(render_result(plan, result))
    for (title, action), n in sorted(plan.not_built.items()):
        click.echo(f"kvmigrate: {title}: {plural(n, 'object')} pending {action} not applied: this kvmigrate "
                   "does not migrate them yet (nothing of them was written)", err=True)
    if result.stop is not None:
        click.echo(f"kvmigrate: error: {result.stop}", err=True)
        click.echo(f"  journal: {result.journal_path} (rerun the same command to resume, or "
                   f"`kvmigrate rollback {result.journal_path}` to undo)", err=True)
    elif code & 8:  # blocks failed on I/O (e.g. EMLINK) without stopping the run: say so on stderr too
        failed = [f for f in result.findings if f.startswith("failed:")]
        click.echo(f"kvmigrate: error: {plural(result.outcomes.get('failed', 0), 'block')} failed"
                   + (f"; {failed[0]}" if failed else ""), err=True)
        click.echo(f"  journal: {result.journal_path}", err=True)
    sys.exit(code)


def _stopped(stopped, apply_command: str) -> None:
    """A run stopped by Ctrl-C, SIGTERM or --max-duration: the same command goes on where
    it stopped, rollback undoes it (exit 32)."""
    exit_stopped(stopped, apply_command, "rollback")


def _dry_run(run, apply_command: str | None, dest_command: str | None, as_json: bool, quiet: bool) -> None:
    """The plan, and the command that applies it (with --dest <DIR> for what waits for it),
    unless a target it fills is a guess: then the command that states the missing facts
    (identity.md §4)."""
    from kvmigrate.migrate.actions import render_text

    plan = run.plan
    code = plan.dry_run_exit_code()
    guesses = run.guessed_sources()
    facts_command = _facts_command(plan, guesses) if guesses else None
    if facts_command:
        apply_command = dest_command = None
    waiting, waiting_bytes = plan.waiting_for_dest
    if as_json:
        summary: SummaryCore = run.summary()
        # `outcomes`: what --apply will report, with the same keys and (barring changes
        # meanwhile) the same numbers; merges of equal sizes only are compared at apply
        planned: MigrateDryRunOutput = {
            **summary, "exit_code": code, "outcomes": plan.outcomes(), "targets": _targets_json(plan),
            "pending": plan.pending, "apply_command": apply_command if plan.pending else None,
            "waiting_for_dest": {"blocks": waiting, "bytes": waiting_bytes},
            "dest_command": dest_command if waiting else None,
            "merges_checked_at_apply": sum(tp.unverified_merges for tp in plan.targets),
            "guessed_targets": [{"namespace": b, "facts": f} for b, f in sorted(guesses.items())],
            "facts_command": facts_command}
        print_json(planned)
    elif not quiet:
        click.echo(render_text(plan, apply_command, dest_command))
        if facts_command:
            from kvmigrate.report.hints import ask_facts

            click.echo("the targets of these namespaces are a guess (they depend on facts not given), so no "
                       "migrate command is printed:")
            for base, facts in sorted(guesses.items()):
                click.echo(f"  {base}: {ask_facts(facts, base)}")
            click.echo(f"state them, then plan again: {facts_command}")
    sys.exit(code)


def _facts_command(plan, guesses: dict[str, list[str]]) -> str:
    """The dry run of ROOT again with the facts the scan had, plus placeholders for the missing ones."""
    from kvmigrate.report.hints import Commands, fact_hint

    cmd = Commands({"root": plan.root, "facts": plan.metadata.get("facts"), "target_profile": plan.target_profile,
                    "verify": plan.metadata.get("verify"),
                    "selection": [dict(plan.selection.metadata(), by="scan")] if plan.selection else None}, "migrate")
    facts = sorted({f for fs in guesses.values() for f in fs})
    command, _ = fact_hint(cmd, facts, None)
    if plan.dest != plan.root:
        command += " --dest " + shlex.quote(plan.dest)
    return command


def _targets_json(plan) -> list[Target]:
    from kvmigrate.cost import transform_cost_of

    out: list[Target] = []
    for tp in plan.targets:
        out.append({"target_base": tp.base_name, "family": tp.family, "rank_dir": tp.rank_dir,
                    "sources": tp.sources, "claims": list(tp.claims),
                    "actions": {a: {"blocks": c["blocks"], "bytes": c["bytes"]} for a, c in tp.counts().items()},
                    "outcomes": tp.outcomes(),
                    "merges_checked_at_apply": tp.unverified_merges,
                    "transform_cost": {a: transform_cost_of(c) for a, c in tp.transform_costs().items()},
                    "already_present": {"blocks": tp.already_present[0], "bytes": tp.already_present[1]},
                    "skipped": [{"action": a, "reason": r, "blocks": n, "bytes": tp.skipped_bytes[(a, r)]}
                                for (a, r), n in sorted(tp.skipped.items())],
                    "not_reusable": [{"reason": r, "blocks": n, "bytes": tp.not_reusable_bytes[r]}
                                     for r, n in sorted(tp.not_reusable.items())],
                    "conflicts": [{"reason": r, "blocks": n} for r, n in sorted(tp.conflicts.items())]})
    return out


def _apply_command(ctx: click.Context, dest: str | None = None, extra: tuple[str, ...] = ()) -> str:
    """The exact command that applies this plan: the same inputs and options, `extra`, and
    --apply; with `dest`, --dest that placeholder (left unquoted: a shell refuses it, never
    guesses)."""
    paths = ("root", "manifest_path", "dest", "journal", "facts_file", "model_config")
    if dest is None:
        return rerun_command(ctx, paths, skip=_NOT_IN_APPLY_COMMAND, extra=(*extra, "--apply"))
    return rerun_command(ctx, paths, skip=_NOT_IN_APPLY_COMMAND | {"dest"}) + f" --dest {dest} --apply"
