"""`kvmigrate prune ROOT | --manifest M`: plan (dry run, the default) or `--apply` moving
what no engine will read into the quarantine; `--purge` empties old quarantines."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import click

from kvmigrate.cli.common import (
    AgeType,
    exit_stopped,
    facts_options,
    handle_errors,
    interrupt_on_sigterm,
    io_depth_option,
    output_options,
    pop_fact_flags,
    pop_selection,
    print_json,
    rerun_command,
    returning_jemalloc,
    selection_options,
)
from kvmigrate.units import plural

if TYPE_CHECKING:  # the models are types only: importing them costs every command's start-up
    from kvmigrate.outputs import PruneApplyOutput, PruneDryRunOutput, ReclaimFigures, ReclaimNamespace

_NOT_IN_APPLY_COMMAND = {"apply", "as_json", "quiet", "verbose", "log_format", "manifest_out"}


log = logging.getLogger(__name__)


@click.command("prune")
@click.argument("root", required=False, type=click.Path(file_okay=False, path_type=str))
@click.option("--manifest", "manifest_path", type=click.Path(exists=True, path_type=str),
              help="Plan from this manifest instead of scanning ROOT (a file changed since is kept).")
@click.option("--migrated", is_flag=True, help="Legacy block files whose bytes a verified target path holds "
              "(the default class), with the namespace's config.json and folders once nothing else is left.")
@click.option("--unreadable-namespaces", "unreadable", is_flag=True,
              help="Namespaces no target reads and no migration used (orphan_namespace, digest_mismatch, "
                   "config_invalid, unsupported_layout, and superseded eras: unreachable for the target, every "
                   "block's bytes in a target namespace of the same model), whole.")
@click.option("--residue", is_flag=True, help="Engine temp files older than --older-than, zero_filled, short "
              "and misfiled files (LMCache tiers: orphan_data and corrupt_sidecar too, a GDS data file and its "
              "sidecar together).")
@click.option("--index-lost", "index_lost", is_flag=True,
              help="LMCache local_disk chunks (index_lost: no restarted engine finds them) of quiet tiers stated "
                   "stopped (--engine-stopped, or the engine_stopped fact per tier in --facts).")
@click.option("--tails", is_flag=True,
              help="Mooncake stores: short entries of live pairs (a cut record is_exist claims but no read serves): "
                   "their keys retired by an index rewrite, nothing freed; a pair with no readable entry left moves "
                   "whole.")
@click.option("--engine-stopped", "all_stopped", is_flag=True,
              help="--index-lost: no engine uses any LMCache local_disk tier of ROOT (a tier's engine_stopped "
                   "fact in --facts wins); Mooncake stores: no client uses them (the proof --apply needs unless "
                   "writer_release >= 0.3.14 is stated for a bucket store, whose client lock then proves it).")
@click.option("--apply", "apply", is_flag=True, help="Move them into ROOT/.kvmigrate/quarantine/<run>/ "
              "(default: dry run).")
@click.option("--journal", type=click.Path(path_type=str),
              help="Prune journal file or directory (default: ROOT/.kvmigrate/journals/prune/<run-id>.journal).")
@click.option("--migration-journal", type=click.Path(exists=True, path_type=str),
              help="The migrations' journal file or directory (default: ROOT/.kvmigrate/journals/): their "
                   "targets are never pruned, their sources never count as unreadable.")
@click.option("--no-quarantine", is_flag=True,
              help="Unlink instead of moving (--migrated only: the bytes stay reachable through the target).")
@click.option("--quiet-period", type=AgeType(), default=None, metavar="AGE",
              help="Skip a namespace written within AGE (newest file or folder mtime; a ctime alone, e.g. of "
                   "migrate's own links, is no write; an LMCache tier as a whole) [default: 10m].")
@click.option("--force-live", is_flag=True, help="Prune namespaces within the quiet period too (it never states "
              "an LMCache tier stopped).")
@click.option("--older-than", type=AgeType(), default=None, metavar="AGE",
              help="--residue: temp files older than AGE [default: 1h]; --purge: quarantines older than AGE "
                   "[default: 7d].")
@click.option("--purge", is_flag=True, help="Delete the quarantines of prune runs older than --older-than for "
              "real (with --apply; a dry run says what it would free).")
@click.option("--manifest-out", type=click.Path(path_type=str), help="Keep the manifest of the scan prune runs first.")
@click.option("--verify", "verify", type=click.Choice(["none", "size", "hash"]), default=None,
              help="Scan depth when scanning ROOT first [default: hash: replicas are pruned only where proven "
                   "equal].")
@selection_options
@io_depth_option
@facts_options
@output_options
@handle_errors
def command(root: str | None, manifest_path: str | None, migrated: bool, unreadable: bool, residue: bool,
            index_lost: bool, tails: bool, all_stopped: bool, apply: bool, journal: str | None, migration_journal: str | None,
            no_quarantine: bool,
            quiet_period: float | None, force_live: bool, older_than: float | None, purge: bool,
            manifest_out: str | None, verify: str | None, threads: int | None, as_json: bool, quiet: bool,
            verbose: int, target: str, **kwargs) -> None:
    """Reclaim what no engine will read, reversibly.

    Without --apply this is a dry run: per class and namespace, the files and bytes it
    would move and the bytes that frees (a legacy name of a hard-linked target frees no
    bytes, only a file-count slot). --apply renames each file, re-checked against the
    scan first, into ROOT/.kvmigrate/quarantine/<run>/ (same filesystem, same inode,
    nothing copied), journaled before it moves; `kvmigrate restore JOURNAL` puts them
    back. `prune ROOT --purge --older-than 7d --apply` deletes old quarantines.

    Never pruned: an `ok` block that is not migrated, a target namespace, kvmigrate's
    journals, a file changed since the scan, a namespace under a held migration lock or
    written within --quiet-period, anything outside ROOT, a symlink's target. An LMCache
    tier is quiet or live as a whole (its folder, GDS folders and files), its folder is
    never removed, and its index_lost chunks go only once the tier is stated stopped.
    --only/--exclude take only the namespaces they select (by model, source or target
    base folder name); the scan still reads the whole root, so every target is known.

    \b
    Exit code: dry run 1 if something would be pruned (0 if nothing); --apply 0, or 8
    if a file could not be moved (listed; the journal stays consistent); 2 usage error.
    --purge: dry run 1 if a quarantine holding files would be purged (0 if nothing);
    --purge --apply 0, or 8 if something could not be deleted. 32: --apply stopped by
    Ctrl-C or SIGTERM (it prints the journal, the command that resumes, and restore).
    """
    from kvmigrate.errors import UsageError

    returning_jemalloc()  # (the plan and the purge's tally fold Arrow columns)
    if purge:
        if root is None:
            raise UsageError("--purge needs ROOT (the root whose quarantines to empty)")
        if kwargs.get("only") or kwargs.get("exclude"):
            raise UsageError("--only/--exclude select namespaces to prune; --purge empties whole quarantines",
                             hint="drop --only/--exclude")
        _purge(root, 7 * 86400.0 if older_than is None else older_than, apply, as_json, quiet)
        return
    from kvmigrate import pipeline
    from kvmigrate.identity.facts import FactsResolver
    from kvmigrate.migrate.prune import render_plan
    from kvmigrate.migrate.quarantine import apply_prune, render_result
    from kvmigrate.options import ScanOptions

    ctx = click.get_current_context()
    classes = tuple(c for c, on in (("migrated", migrated), ("unreadable_namespaces", unreadable),
                                    ("residue", residue), ("index_lost", index_lost), ("tails", tails))
                    if on) or ("migrated",)
    if no_quarantine and set(classes) != {"migrated"}:
        raise UsageError("--no-quarantine is allowed for --migrated only (their bytes stay reachable through the "
                         "target); other classes go to the quarantine", hint="drop --no-quarantine")
    selection = pop_selection(kwargs)
    facts_file = kwargs.pop("facts_file", None)
    resolver = FactsResolver(pop_fact_flags(kwargs), facts_file)
    command_line = "kvmigrate " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else None
    explicit_target = ctx.get_parameter_source("target") == click.core.ParameterSource.COMMANDLINE
    options = ScanOptions.planning(verify, target=target, facts_resolver=resolver, threads=threads,
                                   progress=not quiet and sys.stderr.isatty(), command=command_line)
    with _resumable(ctx, apply), \
            pipeline.pruning(root, manifest_path, options, classes=classes, migration_journal=migration_journal,
                             quiet_period=quiet_period, force_live=force_live, older_than=older_than,
                             explicit_target=explicit_target, manifest_out=manifest_out, apply=apply,
                             selection=selection, engine_stopped=all_stopped) as plan:
        if not apply:
            code = plan.exit_code
            apply_command = _apply_command(ctx, ("--engine-stopped",) if plan.unproven_stores() else ())
            if as_json:
                planned: PruneDryRunOutput = {
                    "root": plan.root, "classes": list(plan.classes),
                    "totals": cast("dict[str, ReclaimFigures]", plan.totals()),
                    "namespaces": _namespace_entries(plan),
                    "skipped": plan.skipped, "orphaned": plan.orphaned, "files": len(plan.items),
                    "objects": _objects(plan), "rewritten": len(plan.retires),
                    "apply_command": apply_command if plan.items or plan.retires else None, "exit_code": code}
                print_json(planned)
            elif not quiet:
                click.echo(render_plan(plan, apply_command))
            sys.exit(code)
        log.info("prune: moving %d files %s (journal %s)", len(plan.items),
                 "out of the way" if no_quarantine else "into the quarantine", journal or "default",
                 extra={"files": len(plan.items)})
        result = apply_prune(plan, journal=journal, quarantine=not no_quarantine, command=_apply_command(ctx))
        log.info("prune: done: journal %s", result.journal, extra={"journal": result.journal})
    finished = [r.to_dict() for r in plan.finished]
    if as_json:
        out: PruneApplyOutput = {"root": plan.root, "classes": list(plan.classes), "skipped": plan.skipped,
                                 "finished_interrupted": finished, **result.to_dict()}
        print_json(out)
    elif not quiet:
        for r in plan.finished:  # the run this command resumed: its journal is the one to undo
            already = sum(r.already_moved.values())  # moved before the kill: not counted again
            click.echo(f"finished the interrupted prune run {r.run_id}: {plural(sum(r.moved.values()), 'more file')} "
                       "moved" + (f" ({plural(already, 'file')} it had moved before it stopped, found in the "
                                  "quarantine)" if already else ""))
            click.echo(f"journal: {r.journal}  (undo: kvmigrate restore {r.journal})")
        if result.journal is not None or not plan.finished:
            click.echo(render_result(result))
    failed = result.failed + [f for r in plan.finished for f in r.failed]
    if failed:
        undo = result.journal if result.failed else next(r.journal for r in plan.finished if r.failed)
        click.echo(f"kvmigrate: error: {plural(len(failed), 'file')} could not be moved; {failed[0]}", err=True)
        click.echo(f"  hint: fix the cause (permissions, a read-only or another filesystem), then rerun the same "
                   f"command; `kvmigrate restore {undo}` puts back what moved", err=True)
    sys.exit(result.exit_code | max([r.exit_code for r in plan.finished], default=0))


@contextlib.contextmanager
def _resumable(ctx: click.Context, apply: bool) -> Iterator[None]:
    """--apply stopped by Ctrl-C or SIGTERM (as Ctrl-C): exit 32 with the journal, the
    command that resumes (it finishes the run first) and the one that restores, as
    `migrate` does; stopped in its scan, before any journal, the command only."""
    if not apply:
        yield
        return
    from kvmigrate.pacing import Interrupted

    previous = signal.signal(signal.SIGTERM, interrupt_on_sigterm)
    try:
        yield
    except Interrupted as stopped:
        exit_stopped(stopped, _apply_command(ctx), "restore")
    except KeyboardInterrupt:
        exit_stopped(Interrupted("interrupted (Ctrl-C or SIGTERM)"), _apply_command(ctx), "restore")
    finally:
        signal.signal(signal.SIGTERM, previous)


def _namespace_entries(plan: Any) -> list[ReclaimNamespace]:
    """The dry run's per (class, namespace) figures; a Mooncake store's own namespace adds
    `objects` (no longer served) and `rewritten` (indexes a --tails apply rewrites)."""
    from kvmigrate.migrate.prune import namespace_order

    figures = {key: dict(v) for key, v in plan.by_namespace().items()}
    extra: dict[tuple[str, str], dict[str, int]] = {}
    for item in plan.store_items():
        if item.objects:
            extra.setdefault((item.cls, item.namespace), {"objects": 0, "rewritten": 0})["objects"] += item.objects
    for store, label in _store_labels(plan).items():
        for rw in plan.retires:
            if rw.store == store:
                e = extra.setdefault(("tails", label), {"objects": 0, "rewritten": 0})
                e["objects"] += len(rw.keys)
                e["rewritten"] += 1
    zero = {"files": 0, "bytes": 0, "freed_files": 0, "freed_bytes": 0, "unlinked_files": 0, "unlinked_bytes": 0}
    for key, e in extra.items():
        figures[key] = {**figures.get(key, zero), **e}
    return [cast("ReclaimNamespace", {"class": c, "namespace": ns, **v})
            for (c, ns), v in sorted(figures.items(), key=namespace_order)]


def _store_labels(plan: Any) -> dict[str, str]:
    """store -> its own namespace, of the stores the plan retires entries of."""
    from kvmigrate import manifest as mf
    from kvmigrate.migrate.prune_stores import Stores

    if not plan.retires:
        return {}
    return Stores.of(mf.read_metadata(plan.manifest)).label_of


def _objects(plan: Any) -> dict[str, int]:
    """Per class, the Mooncake store objects the plan stops serving: a moved pair's
    entries, a moved KVEntry, a retired entry."""
    out: dict[str, int] = {}
    for item in plan.store_items():
        if item.objects:
            out[item.cls] = out.get(item.cls, 0) + item.objects
    n = sum(len(rw.keys) for rw in plan.retires)
    if n:
        out["tails"] = out.get("tails", 0) + n
    return out


def _purge(root: str, older_than: float, apply: bool, as_json: bool, quiet: bool) -> None:
    from kvmigrate.migrate.restore import purge, render_purge

    if not os.path.isdir(root):
        from kvmigrate.errors import UsageError

        raise UsageError(f"{root}: no such folder", path=root, hint="pass the cache root that was pruned")
    log.info("prune --purge %s: quarantines older than %gs%s", root, older_than, "" if apply else " (dry run)")
    result = purge(root, older_than, dry_run=not apply)
    if as_json:
        print_json(result.to_dict(os.path.abspath(root)))
    elif not quiet:
        click.echo(render_purge(result, os.path.abspath(root), not apply))
    sys.exit(result.exit_code)


def _apply_command(ctx: click.Context, extra: tuple[str, ...] = ()) -> str:
    """The exact command that applies this plan: the same inputs and options, `extra`, and
    --apply."""
    return rerun_command(ctx, ("root", "manifest_path", "journal", "migration_journal", "facts_file", "model_config"),
                         skip=_NOT_IN_APPLY_COMMAND, extra=(*extra, "--apply"),
                         formats={"quiet_period": _seconds, "older_than": _seconds})


def _seconds(value: float) -> str:
    return f"{value:g}s"
