"""Entry points shared by `report`, `audit` and `scan --json`: summary -> text in a format.

Also the manifest checks that turn "not a manifest" into a clear usage error, and
`list_files`, which streams the paths of one status (what the hints' `--list` prints).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import IO, TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from kvmigrate import manifest as mf
from kvmigrate.classify import STATUS_BITS
from kvmigrate.errors import OperationalError, UsageError, write_error

if TYPE_CHECKING:  # the JSON models are types only (kvmigrate.outputs)
    from kvmigrate.outputs import ReportOutput

FORMATS = ("text", "json", "md", "html")


def _renderer(fmt: str) -> ModuleType:
    """The module kvmigrate.report.render_<fmt> (imported when first asked for)."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown report format {fmt!r}: use one of {', '.join(FORMATS)}")
    return importlib.import_module(f"kvmigrate.report.render_{fmt}")


def check_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest's run metadata, or a UsageError that says what is wrong with `path`."""
    p = Path(path)
    if not p.exists():
        raise UsageError("manifest not found", path=str(p),
                         hint="write one with `kvmigrate scan ROOT -o M.parquet` or `kvmigrate audit ROOT "
                              "--manifest-out M.parquet`")
    try:
        meta = mf.read_metadata(p)
    except FileNotFoundError as exc:
        raise UsageError(str(exc), path=str(p)) from None
    except (pa.ArrowInvalid, pa.ArrowException) as exc:
        raise UsageError(f"not a Parquet manifest ({str(exc).splitlines()[0]})", path=str(p),
                         hint="pass a manifest written by `kvmigrate scan`") from None
    except PermissionError as exc:
        raise OperationalError(f"cannot read the manifest: {exc.strerror}", path=str(p)) from None
    except OSError as exc:
        raise OperationalError(f"cannot read the manifest: {exc}", path=str(p)) from None
    if not meta:
        raise UsageError("this Parquet file has no kvmigrate metadata: not a kvmigrate manifest", path=str(p),
                         hint="pass a manifest written by `kvmigrate scan`")
    return meta


def summary_of(path: str | os.PathLike[str], **kwargs: Any) -> ReportOutput:
    from kvmigrate.report.summary import summarize

    check_manifest(path)
    try:
        return summarize(path, **kwargs)
    except KeyError as exc:
        raise UsageError(f"the manifest lacks column {exc}", path=str(path),
                         hint="it was written by another version: scan again") from None
    except pa.ArrowException as exc:
        raise UsageError(f"the manifest cannot be read: {str(exc).splitlines()[0]}", path=str(path),
                         hint="it may be truncated: scan again") from None


def render_summary(summary: ReportOutput, fmt: str) -> str:
    return _renderer(fmt).render(summary)


def report(path: str | os.PathLike[str], fmt: str = "text", selection: Any = None) -> tuple[str, int]:
    """(rendered report, exit code = the bits of the manifest, or of its `selection`)."""
    renderer = _renderer(fmt)
    summary = summary_of(path, selection=selection)
    return renderer.render(summary), summary["exit_code"]


def diff_report(old: str | os.PathLike[str], new: str | os.PathLike[str], fmt: str = "text") -> tuple[str, int]:
    from kvmigrate.report.diff import diff

    renderer = _renderer(fmt)
    d = diff(summary_of(old), summary_of(new))
    return renderer.render_diff(d), d["exit_code"]


def emit(text: str, output: str | os.PathLike[str] | None, what: str = "the report") -> None:
    """Write to stdout, or atomically to `output` (a reader never sees half a report);
    `what` names it in an error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a hostile config.json string: show it escaped
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if output is None:
        import sys

        sys.stdout.write(text)
        sys.stdout.flush()
        return
    out = Path(output)
    tmp = out.with_name(f"{out.name}.kvmigrate-{os.getpid()}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644), "w",
                       encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, out)
    except OSError as exc:
        with contextlib.suppress(OSError):  # (on a read-only filesystem there is none to remove)
            tmp.unlink()
        raise write_error(exc, f"cannot write {what}", str(out),
                          elsewhere=f"write {what} to a writable filesystem") from None


def list_files(path: str | os.PathLike[str], status: str | None, out: IO[str], *, end: str = "\n",
               action: str | None = None, namespace: str | None = None, selection: Any = None) -> int:
    """Print ROOT/relpath of every row with `status` (None or "any": every status), and
    with `action`, of namespaces matching the `namespace` glob and the `selection` (each
    path followed by `end`); returns how many."""
    from kvmigrate.classify import ACTIONS
    from kvmigrate.selection import Selection

    if status == "any":
        status = None
    if status is not None and status not in STATUS_BITS:
        raise UsageError(f"unknown status {status!r}", hint=f"use one of: any, {', '.join(STATUS_BITS)}")
    if action is not None and action not in ACTIONS:
        raise UsageError(f"unknown action {action!r}", hint=f"use one of: {', '.join(ACTIONS)}")
    meta = check_manifest(path)
    root = meta.get("root") or ""
    bases = None
    if namespace is not None or selection:
        wanted = Selection.of(selection.only if selection else (), selection.exclude if selection else ())
        ns_meta = meta.get("namespaces") or {}
        bases = pa.array(sorted(b for b, m in ns_meta.items() if wanted.admits_namespace(b, m)
                                and (namespace is None or Selection.of([namespace]).admits_namespace(b, m))),
                         pa.string())
    n = 0
    for batch in mf.iter_batches(path, columns=["relpath", "status", "action", "source_base"]):
        mask = pc.is_valid(batch.column(0))  # every row
        for name, value in (("status", status), ("action", action)):
            if value is not None:
                mask = pc.and_(mask, pc.fill_null(pc.equal(_plain(batch.column(name)), value), False))
        if bases is not None:
            mask = pc.and_(mask, pc.is_in(_plain(batch.column("source_base")), value_set=bases))
        rel = batch.column(0).filter(mask)
        for r in rel.to_pylist():
            out.write(os.path.join(root, r) + end)
        n += len(rel)
    out.flush()
    return n


def _plain(col: pa.Array) -> pa.Array:
    return pc.cast(col, pa.string()) if pa.types.is_dictionary(col.type) else col
