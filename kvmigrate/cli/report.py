"""`kvmigrate report M.parquet`: render a manifest as text, JSON, Markdown or HTML."""

from __future__ import annotations

import sys

import click

from kvmigrate.cli.common import handle_errors, output_options, pop_selection, selection_options

FORMATS = ("text", "json", "md", "html")


@click.command("report")
@click.argument("manifests", nargs=-1, required=True, type=click.Path(path_type=str), metavar="MANIFEST...")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="text (default), json (raw numbers, stable keys), md (GitHub tables), html (one self-contained "
                   "page with charts).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Write the report to FILE instead of stdout (atomically).")
@click.option("--diff", "as_diff", is_flag=True,
              help="Compare two manifests: report --diff OLD.parquet NEW.parquet (new and vanished namespaces, "
                   "growth, new findings).")
@click.option("--list", "list_status", metavar="STATUS", default=None,
              help="Print the absolute path of every file with this status, one per line (e.g. tmp_leftover; "
                   "any: every status).")
@click.option("--action", "list_action", metavar="ACTION", default=None,
              help="List the files whose block has this action (e.g. link, needs_slice); with --list, both.")
@click.option("--namespace", "list_namespace", metavar="PATTERN", default=None,
              help="List only files of namespaces whose model name, source or target base folder name "
                   "matches this glob.")
@click.option("-0", "--null", "null", is_flag=True, help="With --list: end each path with NUL (for xargs -0).")
@selection_options
@output_options
@handle_errors
def command(manifests: tuple[str, ...], fmt: str | None, output: str | None, as_diff: bool,
            list_status: str | None, list_action: str | None, list_namespace: str | None, null: bool,
            as_json: bool, quiet: bool, verbose: int, **kwargs) -> None:
    """Render the manifest MANIFEST (a file, or a dataset directory of parts) written by
    `kvmigrate scan` or `kvmigrate audit --manifest-out`: per namespace, blocks and bytes
    by status and action, reusable vs not, bytes held alone vs shared through hard links,
    the target and its gate, findings and the exact command for each.

    \b
    Exit code: the manifest's bits (OR of its states: 1 findings, 4 integrity,
    8 operational; +1 for pending work), 0 when clean; with --diff, the NEW
    manifest's bits; with --list, 0. A missing or unreadable manifest exits 2.
    --only/--exclude report some namespaces (the totals and exit code are theirs; the
    report says it is partial). --list, --action, --namespace: list files instead.
    """
    from kvmigrate.errors import UsageError
    from kvmigrate.report import render

    if as_json:
        if fmt not in (None, "json"):
            raise UsageError(f"--json and --format {fmt} disagree: pass one of them")
        fmt = "json"
    fmt = fmt or "text"
    selection = pop_selection(kwargs)
    if list_status is not None or list_action is not None or list_namespace is not None:
        if as_diff or len(manifests) != 1:
            raise UsageError("--list, --action and --namespace take exactly one MANIFEST")
        n = render.list_files(manifests[0], list_status, sys.stdout, end="\0" if null else "\n",
                              action=list_action, namespace=list_namespace, selection=selection)
        if not quiet:
            what = [w for w in (f"with status {list_status}" if list_status not in (None, "any") else "",
                                f"with action {list_action}" if list_action else "",
                                f"in namespaces matching {list_namespace}" if list_namespace else "") if w]
            click.echo(" ".join([f"kvmigrate: {n} files", *what]), err=True)
        sys.exit(0)
    if as_diff and selection:
        raise UsageError("--only/--exclude report one manifest; --diff compares whole manifests",
                         hint="drop --only/--exclude, or compare manifests of filtered scans")
    if as_diff:
        if len(manifests) != 2:
            raise UsageError(f"--diff needs two manifests, OLD and NEW (got {len(manifests)})",
                             hint="kvmigrate report --diff OLD.parquet NEW.parquet")
        text, code = render.diff_report(manifests[0], manifests[1], fmt)
    else:
        if len(manifests) != 1:
            raise UsageError(f"report takes one MANIFEST (got {len(manifests)}); to compare two, pass --diff")
        text, code = render.report(manifests[0], fmt, selection=selection)
    if not quiet or output is not None or fmt == "json":  # -q: the exit code says it (a file still written)
        render.emit(text, output)
    if output is not None and code and not quiet:  # stdout is empty: say where the findings are
        click.echo(f"kvmigrate: findings (exit {code}): see {output} for each one and what to do next", err=True)
    sys.exit(code)
