"""`kvmigrate report M.parquet`: render a manifest as text, JSON, Markdown or HTML."""

from __future__ import annotations

import sys

import click

from kvmigrate.allocator import return_freed_memory
from kvmigrate.cli.common import (
    handle_errors,
    output_options,
    pop_selection,
    prefer_arrow_pool,
    selection_options,
)
from kvmigrate.units import plural

FORMATS = ("text", "json", "md", "html")


@click.command("report")
@click.argument("manifests", nargs=-1, type=click.Path(path_type=str), metavar="MANIFEST...")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="text (default), json (raw numbers, stable keys), md (GitHub tables), html (one self-contained "
                   "page with charts).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Write the report to FILE instead of stdout (atomically).")
@click.option("--diff", "as_diff", is_flag=True,
              help="Compare two manifests: report --diff OLD.parquet NEW.parquet (new and vanished namespaces, "
                   "growth, new findings). With one (NEW), OLD is the kept audit before it; with none, the last two "
                   "kept audits of --history DIR.")
@click.option("--trend", "as_trend", is_flag=True,
              help="Files and bytes by status, blocks by action, over the kept audits (audit --keep N) of "
                   "--history DIR, or of the folder of the MANIFEST given (text, json, or html: a chart).")
@click.option("--history", default=None, metavar="DIR", type=click.Path(file_okay=False, path_type=str),
              help="The folder of kept audits (audit --keep N: ROOT/.kvmigrate/audits by default).")
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
            as_json: bool, quiet: bool, verbose: int, as_trend: bool, history: str | None, **kwargs) -> None:
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
    # mimalloc (Arrow's default) keeps the pages every batch of the summary freed: 283 MiB
    # peak for a 1M-row manifest against 205 MiB (and 1.5 s against 1.0 s) on the C
    # library's malloc, as scan and audit (see kvmigrate.scan.run._lean_arrow_allocator)
    prefer_arrow_pool("system")
    return_freed_memory()
    from kvmigrate.errors import UsageError
    from kvmigrate.report import render

    if as_json:
        if fmt not in (None, "json"):
            raise UsageError(f"--json and --format {fmt} disagree: pass one of them")
        fmt = "json"
    fmt = fmt or "text"
    if as_trend:
        _trend(manifests, history, fmt, output)
    if as_diff and len(manifests) < 2:
        manifests = _previous_audit(manifests, history)
    if not manifests:
        raise UsageError("give a MANIFEST (or --diff / --trend with --history DIR)",
                         hint="kvmigrate report M.parquet")
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
            click.echo(" ".join([f"kvmigrate: {plural(n, 'file')}", *what]), err=True)
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
        from kvmigrate.pipeline import report

        text, code = report(manifests[0], fmt, selection=selection)
    if not quiet or output is not None or fmt == "json":  # -q: the exit code says it (a file still written)
        render.emit(text, output)
    if output is not None and code and not quiet:  # stdout is empty: say where the findings are
        click.echo(f"kvmigrate: findings (exit {code}): see {output} for each one and what to do next", err=True)
    sys.exit(code)


def _previous_audit(manifests: tuple[str, ...], history: str | None) -> tuple[str, ...]:
    """--diff with NEW only: the kept audit before it; with nothing: the last two kept audits."""
    from kvmigrate.errors import UsageError
    from kvmigrate.history import kept_audits, previous

    if manifests:
        old = previous(manifests[0], history)
        if old is None:
            raise UsageError("no earlier kept audit to compare with", path=manifests[0],
                             hint="pass OLD and NEW, or keep audits with `kvmigrate audit ROOT --keep N`")
        return str(old), manifests[0]
    if history is None:
        raise UsageError("--diff needs OLD and NEW manifests, NEW alone, or --history DIR (the kept audits)",
                         hint="kvmigrate report --diff OLD.parquet NEW.parquet")
    kept = kept_audits(history)
    if len(kept) < 2:
        raise UsageError(f"--diff needs two kept audits, the history holds {len(kept)}", path=history,
                         hint="run `kvmigrate audit ROOT --keep N` again later")
    return str(kept[-2]), str(kept[-1])


def _trend(manifests: tuple[str, ...], history: str | None, fmt: str, output: str | None) -> None:
    """report --trend: render the kept audits' numbers and exit 0 (a history is no finding)."""
    import os

    from kvmigrate.errors import UsageError
    from kvmigrate.history import kept_audits
    from kvmigrate.report import render, trend

    if fmt not in ("text", "json", "html"):
        raise UsageError(f"--trend renders text, json or html, not {fmt}")
    if history is None and len(manifests) != 1:
        raise UsageError("--trend needs --history DIR (the kept audits) or one kept MANIFEST",
                         hint="kvmigrate report --trend --history ROOT/.kvmigrate/audits")
    folder = history if history is not None else os.path.dirname(os.path.abspath(manifests[0]))
    paths: list[str | os.PathLike[str]] = list(kept_audits(folder))
    if not paths:
        raise UsageError("no kept audits here", path=folder, hint="keep audits with `kvmigrate audit ROOT --keep N`")
    tr = trend.trend(paths, render.summary_of)
    if fmt == "html":
        from kvmigrate.report.render_html import render_trend

        text = render_trend(tr)
    else:
        text = trend.render_json(tr) if fmt == "json" else trend.render_text(tr)
    render.emit(text, output)
    sys.exit(0)
