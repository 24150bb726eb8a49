"""Kept audits (`audit --keep N`): manifests named by their UTC time in ROOT/.kvmigrate/audits
(or --history DIR), which `--baseline auto`, `report --diff` and `report --trend` read."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from kvmigrate import layout
from kvmigrate.errors import UsageError, write_error

HISTORY = f"{layout.OWN_DIR}/audits"  # under ROOT
PREFIX = "audit-"


def history_dir(root: str, history: str | None) -> Path:
    """Where kept audits live: --history DIR, else ROOT/.kvmigrate/audits."""
    return Path(history) if history else Path(root) / HISTORY


def kept_audits(directory: str | os.PathLike[str]) -> list[Path]:
    """The kept audit manifests, oldest first (their names start with the UTC time)."""
    d = Path(directory)
    try:
        return sorted(p for p in d.iterdir() if p.name.startswith(PREFIX) and p.suffix == ".parquet" and p.is_file())
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise UsageError(f"cannot list the audit history: {exc.strerror}", path=str(d)) from None


def new_audit_path(directory: str | os.PathLike[str], now: dt.datetime | None = None) -> Path:
    """The path of the next kept audit (the manifest writer makes it atomically: temp + rename)."""
    now = now or dt.datetime.now(dt.timezone.utc)
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
        os.close(os.open(d / f".{PREFIX}probe-{os.getpid()}", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        os.unlink(d / f".{PREFIX}probe-{os.getpid()}")  # (before the scan: a folder it cannot keep it in fails now)
    except OSError as exc:
        raise write_error(exc, "cannot keep the audit in the history folder", str(d),
                          elsewhere="keep the audits on a writable filesystem: --history DIR") from None
    path = d / f"{PREFIX}{now.strftime('%Y%m%dT%H%M%S.%fZ')}.parquet"
    n = 1
    while path.exists():  # (two audits in one microsecond)
        path = d / f"{PREFIX}{now.strftime('%Y%m%dT%H%M%S.%fZ')}-{n}.parquet"
        n += 1
    return path


def prune(directory: str | os.PathLike[str], keep: int) -> list[Path]:
    """Remove all but the newest `keep` kept audits; the removed paths."""
    audits = kept_audits(directory)
    gone = audits[:-keep] if keep > 0 else audits
    for p in gone:
        p.unlink(missing_ok=True)
    return gone


def previous(manifest_path: str | os.PathLike[str], directory: str | os.PathLike[str] | None = None) -> Path | None:
    """The kept audit just before `manifest_path` (in `directory`, default its own folder);
    for a manifest outside the history, the newest kept audit."""
    me = Path(manifest_path).resolve()
    audits = [p.resolve() for p in kept_audits(directory if directory is not None else me.parent)]
    older = [p for p in audits if p != me and (me not in audits or p.name < me.name)]
    return older[-1] if older else None
