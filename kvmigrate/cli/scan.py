"""`kvmigrate scan ROOT [-o MANIFEST]`: walk a cache root and write the Parquet manifest."""

from __future__ import annotations

import os
import shlex
import sys
from typing import TYPE_CHECKING, Any

import click

from kvmigrate.cli.common import (
    Rate,
    Seconds,
    baseline_options,
    check_scaleout,
    facts_options,
    handle_errors,
    output_options,
    pacing_options,
    part_done,
    pop_fact_flags,
    pop_selection,
    prefer_arrow_pool,
    print_json,
    say_no_cache,
    scaleout_options,
    scan_options,
    selection_options,
    start_pacing,
    walk_options,
)
from kvmigrate.units import human_bytes, human_count, plural

if TYPE_CHECKING:
    from fractions import Fraction


@click.command("scan")
@click.argument("root", type=click.Path(file_okay=True, dir_okay=True, readable=False, path_type=str))
@click.option("-o", "--output", default="kvmigrate-manifest.parquet", show_default=True,
              type=click.Path(path_type=str),
              help="Where to write the manifest (Parquet). DIR/ or an existing directory: a dataset directory, "
                   "this part's file in it (part-K-of-N.parquet); with --run-on ray always a directory "
                   "(default there: kvmigrate-manifest/).")
@facts_options
@selection_options
@walk_options
@baseline_options
@scaleout_options
@pacing_options
@output_options
@handle_errors
def command(root: str, output: str, verify: str, threads: int | None, shard: tuple[int, int] | None,
            as_json: bool, quiet: bool, verbose: int, target: str, run_on: str, shards: int | None,
            ray_address: str | None, max_duration: Seconds | None, bwlimit: Rate | None, idle_io: bool,
            baseline: str | None, recheck: Fraction | None, history: str | None, **kwargs: Any) -> None:
    """Walk ROOT (the engine's cache root_dir): identify namespaces, prove their digests,
    stat (and with --verify hash, hash) every file, compare replicas and decide a target
    and an action for every block. Writes the manifest; never modifies ROOT.

    \b
    Exit code: OR of the findings' bits (1 findings, 4 integrity, 8 I/O), +1 when reusable
    blocks are not yet in their targets (pending work), 0 when clean; 2 usage error
    (missing ROOT, bad option value), 32 interrupted.
    """
    prefer_arrow_pool("system")  # see kvmigrate.scan._lean_arrow_allocator
    from kvmigrate.identity.facts import FactsResolver
    from kvmigrate.pipeline import Parts, scan_any

    facts_file = kwargs.pop("facts_file", None)
    flags = pop_fact_flags(kwargs)
    selection = pop_selection(kwargs)
    parts = check_scaleout(run_on, shards, ray_address, shard)
    start_pacing(max_duration, bwlimit, idle_io, quiet, parts)
    resolver = FactsResolver(flags, facts_file)
    command_line = "kvmigrate " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else None
    options = scan_options(target=target, facts_resolver=resolver, verify=verify, threads=threads,
                           command=command_line, selection=selection, baseline=baseline, recheck=recheck,
                           history=history, shard=shard, progress=parts is None and not quiet and sys.stderr.isatty())
    if parts is not None:
        default = click.get_current_context().get_parameter_source("output") == click.core.ParameterSource.DEFAULT
        result = scan_any(root, "kvmigrate-manifest" if default else output, options,
                          parts=Parts(parts, ray_address, None if quiet else part_done))
    else:
        from kvmigrate.scaleout.dataset import part_output

        result = scan_any(root, part_output(output, options.shard), options)
    summary = result.summary
    say_no_cache(summary)
    if as_json:
        print_json(summary)
    elif not quiet:  # -q: the exit code says it (interface.md §4)
        _print_text(summary, result)
    sys.exit(result.exit_code)


def _print_text(summary: dict, result) -> None:
    totals = summary["totals"]
    click.echo(f"scanned {summary['root']}: {plural(totals['files'], 'file')}, {human_bytes(totals['bytes'])} "
               f"in {result.seconds:.1f}s -> {os.path.relpath(result.output)}")
    from kvmigrate.report.view import identity_label, selection_note  # (not at start-up: --help loads every command)

    if summary.get("selection"):
        click.echo("partial: " + "; ".join(selection_note(step) for step in summary["selection"]))
    for ns in summary["namespaces"]:
        actions = (", ".join(f"{a} {human_count(v['blocks'])}" for a, v in sorted(ns["by_action"].items()))
                   or "no blocks")
        line = f"  {ns['source_base']}: {identity_label(ns)} ranks {ns['ranks']} [{ns['status']}]"
        if ns.get("target_base"):
            line += f" -> {ns['target_base']}"
        click.echo(line)
        click.echo(f"    blocks: {actions}")
        if ns.get("target_error"):
            click.echo(f"    target: {ns['target_error']}")
        elif ns.get("status") not in (None, "ok") and ns.get("status_reason"):
            click.echo(f"    {ns['status_reason']}")
    from kvmigrate.report.view import store_line

    for store in summary.get("stores") or ():  # Mooncake stores (report/stores.py)
        click.echo(store_line(store))
    findings = {s: v for s, v in totals["by_status"].items() if s not in ("ok", "own_artifact")}
    pending = totals["pending"]["blocks"]
    if findings:
        click.echo("findings: " + ", ".join(f"{s} {human_count(v['files'])}" for s, v in sorted(findings.items())))
    if pending:  # exit bit 1 too
        click.echo(f"pending: {plural(pending, 'reusable block')} {'is' if pending == 1 else 'are'} not yet in their "
                   "target namespaces")
    if findings or pending:
        click.echo(f"details and what to do next: kvmigrate report {shlex.quote(os.path.relpath(result.output))}")
    for err in summary.get("walk_errors", [])[:5]:
        click.echo(f"walk error: {err}", err=True)
    click.echo(f"exit code {summary['exit_code']}")
