"""Runs as first-class state: every `migrate --apply` and `prune --apply` of a root, with
its id, kind, state and the target namespaces it holds, read from the root's journals.

A run's state follows from its journal: `running` while its process holds the journal's
flock, `interrupted` when it ended without `complete` (a kill, a stop), `done`, then
`rolled back` (migration) or `restored` / `purged` (prune) when a later command undid or
finished it; rollback, restore and purge are recorded in the journal of the run they act
on. `kvmigrate runs ROOT` lists them; `audit` and `report` name each unfinished run with
the command that resumes it; a new migration refuses target namespaces an interrupted run
holds (one owner per file: `check_no_interrupted_run`).
"""

from __future__ import annotations

import fcntl
import os
import shlex
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvmigrate.errors import OperationalError, UsageError
from kvmigrate.migrate import journal as jn

if TYPE_CHECKING:
    from kvmigrate.migrate.quarantine import PruneRun

UNFINISHED = ("running", "interrupted")


@dataclass
class RunInfo:
    """One run of a root, as its journal says."""

    run_id: str
    kind: str  # migrate | prune
    state: str  # running | interrupted | done | rolled back | restored | purged
    journal: str
    command: str | None
    root: str
    targets: list[str] = field(default_factory=list)  # target base folders it writes (migrate)
    counts: dict[str, int] = field(default_factory=dict)
    holder: int | None = None  # pid holding the journal (running)
    identity: dict[str, Any] = field(default_factory=dict)  # a migration's header identity (which run resumes it)
    started: float = 0.0  # a prune header's time (run ids of one second order by pid, and pids wrap)

    @property
    def resume_command(self) -> str | None:
        """The command that finishes an unfinished run (its own command line again)."""
        if self.kind == "prune":
            return f"kvmigrate prune {shlex.quote(self.root)} --apply"  # finishes interrupted prunes first
        return self.command

    @property
    def undo_command(self) -> str:
        verb = "restore" if self.kind == "prune" else "rollback"
        return f"kvmigrate {verb} {shlex.quote(self.journal)}"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["identity"], out["started"]
        return {**out, "resume_command": self.resume_command if self.state in UNFINISHED else None,
                "undo_command": self.undo_command}


def _journals(jdir: str) -> list[str]:
    if not os.path.isdir(jdir):
        return []
    return sorted(os.path.join(jdir, f) for f in os.listdir(jdir)
                  if jn.is_journal_name(f) and os.path.isfile(os.path.join(jdir, f)))


def _holder(path: str) -> int | None:
    """The pid of the process writing the journal (it holds the flock), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return jn._last_pid(path) or -1
    finally:
        os.close(fd)  # (closing drops a lock taken here)
    return None


def migration_runs(journal_dir: str) -> list[RunInfo]:
    """The migration runs of a journal directory (or file), states only (no path records
    are held: bounded memory)."""
    out = []
    files = [journal_dir] if os.path.isfile(journal_dir) else _journals(journal_dir)
    for path in files:
        try:
            runs = jn.run_states(path)
        except (UsageError, OSError, ValueError):
            continue
        holder = _holder(path)
        for k, run in enumerate(runs):
            if run.header.get("kind") is not None:  # a prune journal passed as a migration's
                continue
            last = k == len(runs) - 1
            if run.rolled_back:
                state = "rolled back"
            elif run.complete is not None:
                state = "done"
            elif last and holder is not None:
                state = "running"
            else:
                state = "interrupted"
            counts = dict((run.complete or {}).get("outcomes") or {})
            out.append(RunInfo(str(run.header.get("run_id") or os.path.basename(path)), "migrate", state, path,
                               run.header.get("command"), run.header.get("dest") or run.root,
                               sorted(run.targets), counts, holder if state == "running" else None,
                               dict(run.header.get("identity") or {}), _started(run.header)))
    return out


def prune_runs(journal_dir: str, *, counted: Callable[[str], bool] = lambda state: True) -> list[RunInfo]:
    """The prune runs of a journal directory, read as `restore` reads them (what `restore`
    and `purge` add to a prune's journal are its later states), each journal once and
    nothing kept per file. `counted(state)`: the runs whose counts (files intended, moved)
    are shown."""
    from kvmigrate.migrate.quarantine import load_prune_runs

    out = []
    for path in _journals(journal_dir):
        try:
            runs = load_prune_runs(path, moves=False)
        except (UsageError, OSError, ValueError):
            continue
        holder = _holder(path)
        for run in runs:
            state = _prune_state(run, holder)
            counts = {"moved": run.files_moved, "intended": run.files_intended} if counted(state) else {}
            out.append(RunInfo(str(run.header.get("run_id") or os.path.basename(path)), "prune", state, path,
                               run.header.get("command"), run.root, [], counts,
                               holder if state == "running" else None, started=_started(run.header)))
    return out


def _started(header: dict[str, Any]) -> float:
    """When a run started, from its journal's header (0 where it says nothing)."""
    try:
        return float(header.get("time") or 0)
    except (TypeError, ValueError):
        return 0.0


def _prune_state(run: PruneRun, holder: int | None) -> str:
    """A prune run's state from its journal's records and the journal's flock holder."""
    if run.purged:
        return "purged"
    if run.restored:
        return "restored"
    if run.complete and not run.purge_started:
        return "done"
    return "running" if holder is not None else "interrupted"


def list_runs(root: str, *, counted: Callable[[str], bool] = lambda state: True) -> list[RunInfo]:
    """Every run journaled under ROOT/.kvmigrate/journals, oldest first: by run id, which
    starts with the second it started in, and within a second by the time a prune's
    header gives (`counted`: see `prune_runs`)."""
    root = os.path.abspath(root)
    jdir = jn.default_journal_dir(root)
    from kvmigrate.migrate.prune import prune_journal_dir

    runs = migration_runs(jdir) + prune_runs(prune_journal_dir(root), counted=counted)
    # (the run id's second, then the header's time: a prune's says which of two runs of one
    # second came first, where the ids' pids do not; a migration's header has no time)
    return sorted(runs, key=lambda r: (r.run_id.partition("-")[0], r.started, r.run_id, r.kind))


def unfinished(root: str) -> list[RunInfo]:
    """The running or interrupted runs of ROOT: the journals of finished runs are read for
    their states alone (no record per file is kept for them)."""
    return [r for r in list_runs(root, counted=lambda state: state in UNFINISHED) if r.state in UNFINISHED]


def check_no_interrupted_run(journal_dirs: list[str], targets: set[str], identity: dict[str, Any]) -> None:
    """Refuse a new migration into target namespaces an unfinished run holds: the new run
    would create files at paths the other run's intents list, which the other's resume or
    rollback would then take for its own. Resuming it here instead would apply another
    plan (its manifest and options), so the operator chooses: resume it, or undo it."""
    seen: set[str] = set()
    for jdir in journal_dirs:
        for run in migration_runs(jdir):
            if run.journal in seen or run.state not in UNFINISHED:
                continue
            seen.add(run.journal)
            if run.identity and _same_run(run.identity, identity):
                continue  # the run this command resumes
            held = sorted(targets & set(run.targets))
            if not held:
                continue
            what = "is still running" + (f" (pid {run.holder})" if run.holder and run.holder > 0 else "") \
                if run.state == "running" else "was interrupted"
            resume = f"resume it with `{run.command}`" if run.command else "resume it with the command that started it"
            raise OperationalError(
                f"target namespace {held[0]}{f' (and {len(held) - 1} more)' if len(held) > 1 else ''} is held by "
                f"run {run.run_id}, which {what}; a new run there would write files that run's resume or "
                "rollback takes for its own", path=run.journal,
                hint=f"{resume}, or undo it with `{run.undo_command}`; then run this command again")


def _same_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same run: equal identities, a scale-out part's without its part number."""
    strip = ("part",)
    return {k: v for k, v in a.items() if k not in strip} == {k: v for k, v in b.items() if k not in strip}


def claimed_by_others(journal_dirs: list[str], own: Iterable[str], paths: set[str], dest: str) -> set[str]:
    """Of `paths`, those another migration run into `dest` (not rolled back, not in the
    journals `own`) journaled as created: a resumed run or a rollback never adopts them,
    whatever their inode says (a hard link another run made of the same source has the
    very inode this run intended)."""
    out: set[str] = set()
    if not paths:
        return out
    seen = {os.path.abspath(p) for p in own}
    for jdir in journal_dirs:
        files = [jdir] if os.path.isfile(jdir) else _journals(jdir)
        for path in files:
            if os.path.abspath(path) in seen:
                continue
            seen.add(os.path.abspath(path))
            try:
                states = jn.run_states(path)
            except (UsageError, OSError, ValueError):
                continue
            if (not states or states[0].header.get("kind") is not None or all(r.rolled_back for r in states)
                    or not any(_same_dir(r.dest, dest) for r in states)):
                continue
            try:
                for rec in jn.iter_records(path, skip=(b'{"t":"mc_',)):  # (a store's: ~1 KB a block)
                    if rec.get("t") == "done" and rec.get("path") in paths:
                        out.add(rec["path"])
            except (UsageError, OSError, ValueError):
                continue
    return out


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def targets_of_others(journal_dirs: list[str], own: Iterable[str], dest: str,
                      own_ids: Iterable[str | None] = ()) -> set[str]:
    """Target base folders under `dest` that migration runs of other journals than `own`
    fill (runs not rolled back; a run id of `own_ids`, the same run journaled twice, is
    no other run)."""
    mine = {os.path.abspath(p) for p in own}
    ids = set(own_ids)
    out: set[str] = set()
    seen: set[tuple[str, str]] = set()
    for jdir in journal_dirs:
        for run in migration_runs(jdir):
            key = (os.path.abspath(run.journal), run.run_id)
            if (key in seen or key[0] in mine or run.run_id in ids or run.state == "rolled back"
                    or not _same_dir(run.root, dest)):
                continue
            seen.add(key)
            out.update(run.targets)
    return out
