"""`kvmigrate audit ROOT`: scan + report in one go, with fsck-like exit bits for cron."""

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
    say_no_cache,
    scaleout_options,
    scan_options,
    selection_options,
    start_pacing,
    walk_options,
)

if TYPE_CHECKING:
    from fractions import Fraction


@click.command("audit")
@click.argument("root", type=click.Path(path_type=str))
@click.option("--format", "fmt", type=click.Choice(["text", "json", "md", "html"]), default=None,
              help="Report format (default text; --json is the same as --format json).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Write the report to FILE instead of stdout.")
@click.option("--manifest-out", type=click.Path(path_type=str), default=None,
              help="Keep the manifest at this path (default: a temporary file, removed afterwards). DIR/ or an "
                   "existing directory: a dataset directory (with --run-on ray, always).")
@click.option("--keep", type=click.IntRange(min=1), default=None, metavar="N",
              help="Keep this audit's manifest in the history (ROOT/.kvmigrate/audits, or --history DIR) and the "
                   "last N in all: what --baseline auto, report --diff and report --trend read.")
@click.option("--prometheus", "prometheus", type=click.Path(dir_okay=False, path_type=str), default=None,
              metavar="FILE", help="Write the audit's gauges in the node_exporter textfile format to FILE "
                                   "(atomically: temp + rename in its folder).")
@facts_options
@selection_options
@walk_options
@baseline_options
@scaleout_options
@pacing_options
@output_options
@handle_errors
def command(root: str, fmt: str | None, output: str | None, manifest_out: str | None, verify: str,
            threads: int | None, shard: tuple[int, int] | None, as_json: bool, quiet: bool, verbose: int,
            target: str, run_on: str, shards: int | None, ray_address: str | None, max_duration: Seconds | None,
            bwlimit: Rate | None, idle_io: bool, baseline: str | None, recheck: Fraction | None,
            history: str | None, keep: int | None, prometheus: str | None, log_format: str, **kwargs: Any) -> None:
    """Scan ROOT and report what is reusable, what is broken, and the exact command for
    each finding. Read-only on ROOT. No progress bar unless stderr is a terminal.

    \b
    Exit code (OR-able bits, like fsck):
      0 clean   1 findings or pending work (reusable blocks not yet in their targets)
      4 integrity problems   8 operational error (I/O, permissions)
      2 usage error (missing ROOT, bad option value)   32 interrupted
    """
    prefer_arrow_pool("system")  # see kvmigrate.scan.run._lean_arrow_allocator
    from kvmigrate.errors import UsageError
    from kvmigrate.identity.facts import FactsResolver
    from kvmigrate.pipeline import Parts, audit
    from kvmigrate.report.render import emit, render_summary

    if as_json:
        if fmt not in (None, "json"):
            raise UsageError(f"--json and --format {fmt} disagree: pass one of them")
        fmt = "json"
    facts_file = kwargs.pop("facts_file", None)
    flags = pop_fact_flags(kwargs)
    selection = pop_selection(kwargs)
    resolver = FactsResolver(flags, facts_file)
    command_line = "kvmigrate " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else None
    parts = check_scaleout(run_on, shards, ray_address, shard)
    kept_in = None
    if keep is not None:
        from kvmigrate.history import history_dir, new_audit_path

        if manifest_out is not None or parts is not None:
            raise UsageError("--keep writes the manifest into the audit history: drop "
                             + ("--manifest-out" if manifest_out is not None else "--run-on ray (not supported "
                                                                                  "with --keep yet)"))
        kept_in = history_dir(os.path.abspath(root), history)
        manifest_out = str(new_audit_path(kept_in))
    if log_format == "json":
        from kvmigrate.report.prometheus import log_line

        click.echo(log_line({"event": "start", "root": os.path.abspath(root), "command": command_line,
                             "verify": verify, "baseline": baseline}), err=True)
    start_pacing(max_duration, bwlimit, idle_io, quiet, parts)
    options = scan_options(target=target, facts_resolver=resolver, verify=verify, threads=threads,
                           command=command_line, selection=selection, baseline=baseline, recheck=recheck,
                           history=history, shard=shard, progress=parts is None and not quiet and sys.stderr.isatty())
    if parts is not None:
        result = audit(root, options, manifest_out=manifest_out,
                       parts=Parts(parts, ray_address, None if quiet else part_done))
    else:
        from kvmigrate.scaleout.dataset import part_output

        result = audit(root, options,
                       manifest_out=part_output(manifest_out, options.shard) if manifest_out else None)
    say_no_cache(result.summary)
    if kept_in is not None and keep is not None:
        from kvmigrate.history import prune

        prune(kept_in, keep)
    if prometheus is not None:
        from kvmigrate.report.prometheus import previous_textfile, textfile

        emit(textfile(result.summary, seconds=result.seconds, carried=result.carried,
                      previous=previous_textfile(prometheus)), prometheus, what="the textfile")
    if log_format == "json":
        from kvmigrate.report.prometheus import events, log_line

        for event in events(result.summary, seconds=result.seconds, carried=result.carried):
            click.echo(log_line(event), err=True)
    if not quiet or output is not None or fmt == "json":  # -q: the exit code says it (a file still written)
        emit(render_summary(result.summary, fmt or "text"), output)
    sys.exit(result.exit_code)
