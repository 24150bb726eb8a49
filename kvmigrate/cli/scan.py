"""`kvmigrate scan ROOT [-o MANIFEST]`: walk a cache root and write the Parquet manifest."""

from __future__ import annotations

import os
import shlex
import sys

import click

from kvmigrate.cli.common import (baseline_kwargs, baseline_options, check_scaleout, facts_options,
                                  handle_errors, output_options, parse_shard,
                                  part_done, pop_fact_flags, prefer_arrow_pool, print_json, scaleout_options,
                                  walk_options)


@click.command("scan")
@click.argument("root", type=click.Path(file_okay=True, dir_okay=True, readable=False, path_type=str))
@click.option("-o", "--output", default="kvmigrate-manifest.parquet", show_default=True,
              type=click.Path(path_type=str),
              help="Where to write the manifest (Parquet). DIR/ or an existing directory: a dataset directory, "
                   "this part's file in it (part-K-of-N.parquet); with --run-on ray always a directory "
                   "(default there: kvmigrate-manifest/).")
@facts_options
@walk_options
@baseline_options
@scaleout_options
@output_options
@handle_errors
def command(root: str, output: str, verify: str, threads: int | None, shard: str | None, as_json: bool,
            quiet: bool, verbose: int, target: str, run_on: str, shards: int | None, ray_address: str | None,
            baseline: str | None, recheck: str | None, history: str | None, **kwargs) -> None:
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
    from kvmigrate.pipeline import scan_any

    facts_file = kwargs.pop("facts_file", None)
    flags = pop_fact_flags(kwargs)
    parts = check_scaleout(run_on, shards, ray_address, shard)
    k, n = parse_shard(shard)
    resolver = FactsResolver(flags, facts_file)
    command_line = "kvmigrate " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else None
    options = dict(target=target, facts_resolver=resolver, verify=verify, threads=threads, command=command_line,
                   **baseline_kwargs(baseline, recheck, history, parts))
    if parts is not None:
        default = click.get_current_context().get_parameter_source("output") == click.core.ParameterSource.DEFAULT
        result = scan_any(root, "kvmigrate-manifest" if default else output, parts=parts, address=ray_address,
                          on_part=None if quiet else part_done, **options)
    else:
        from kvmigrate.scaleout.dataset import part_output

        result = scan_any(root, part_output(output, (k, n)), shard=(k, n),
                          progress=(not quiet and sys.stderr.isatty()), **options)
    summary = result.summary
    if as_json:
        print_json(summary)
    else:
        _print_text(summary, result, quiet)
    sys.exit(result.exit_code)


def _print_text(summary: dict, result, quiet: bool) -> None:
    totals = summary["totals"]
    click.echo(f"scanned {summary['root']}: {totals['files']} files, {totals['bytes']} bytes "
               f"in {result.seconds:.1f}s -> {os.path.relpath(result.output)}")
    for ns in summary["namespaces"]:
        actions = ", ".join(f"{a} {v['blocks']}" for a, v in sorted(ns["by_action"].items())) or "no blocks"
        line = f"  {ns['source_base']}: {ns['family']} {ns['scheme']} ranks {ns['ranks']} [{ns['status']}]"
        if ns.get("target_base"):
            line += f" -> {ns['target_base']}"
        click.echo(line)
        click.echo(f"    blocks: {actions}")
        if ns.get("target_error"):
            click.echo(f"    target: {ns['target_error']}")
        elif ns.get("status") not in (None, "ok") and ns.get("status_reason"):
            click.echo(f"    {ns['status_reason']}")
    findings = {s: v for s, v in totals["by_status"].items() if s not in ("ok", "own_artifact")}
    pending = totals["pending"]["blocks"]
    if findings:
        click.echo("findings: " + ", ".join(f"{s} {v['files']}" for s, v in sorted(findings.items())))
    if pending:  # exit bit 1 too
        click.echo(f"pending: {pending} reusable blocks are not yet in their target namespaces")
    if findings or pending:
        click.echo(f"details and what to do next: kvmigrate report {shlex.quote(os.path.relpath(result.output))}")
    for err in summary.get("walk_errors", [])[:5]:
        click.echo(f"walk error: {err}", err=True)
    click.echo(f"exit code {summary['exit_code']}")
