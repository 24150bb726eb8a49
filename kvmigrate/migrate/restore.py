"""Undo or finish a prune (migration.md §6): `restore` puts quarantined files back,
`purge` empties old quarantines for real.

Both read the prune journal (`quarantine.apply_prune` writes it through `journal.JournalWriter`;
its records are read back with `journal.iter_records`). Restore trusts the tree, not the
done records: a file is back when its path holds the journaled inode, so a rerun after a
kill -9 converges. A path re-created meanwhile (the engine wrote the block again) is a
conflict: the pruned file stays in the quarantine and is reported, never overwritten.
Files go back by link + unlink (no rename: a rename would replace a re-created name).
"""

from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from kvmigrate.errors import EXIT_OPERATIONAL, OperationalError
from kvmigrate.migrate import journal as jn
from kvmigrate.migrate.apply import _CrashSeam  # the kill -9 tests' seam (points: restore, purge)
from kvmigrate.migrate.fsops import DestTree, SymlinkInPath, check_relpath
from kvmigrate.migrate.prune import QUARANTINE_DIR, frees, prune_journal_dir
from kvmigrate.migrate.quarantine import load_prune_runs, makedirs
from kvmigrate.units import plural


@dataclass
class RestoreResult:
    restored: int = 0
    already_in_place: int = 0
    dirs_made: int = 0
    kept: list[str] = field(default_factory=list)  # conflicts and files that cannot go back, with why
    journals: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return EXIT_OPERATIONAL if self.kept else 0

    def to_dict(self) -> dict[str, Any]:
        return {"restored": self.restored, "already_in_place": self.already_in_place, "dirs_made": self.dirs_made,
                "kept": self.kept, "journals": self.journals, "exit_code": self.exit_code}


def restore(journal: str, *, namespaces: Iterable[str] | None = None) -> RestoreResult:
    """Put back every file the prune runs of `journal` moved (newest run first); with
    `namespaces`, only the files of those source namespaces (a migration's rollback)."""
    only = set(namespaces) if namespaces is not None else None
    result = RestoreResult()
    crash = _CrashSeam()
    for run in sorted(load_prune_runs(journal), key=lambda r: float(r.header.get("time") or 0), reverse=True):
        items = [i for i in run.moves.values() if only is None or i.get("ns") in only]
        if not items:
            continue
        if run.path not in result.journals:
            result.journals.append(run.path)
        if run.purge_started:
            result.kept += [f"{os.path.join(run.root, i['path'])}: purged with the quarantine of run "
                            f"{run.header.get('run_id')}; cannot be restored" for i in items]
            continue
        w = jn.JournalWriter.append(run.path)  # the flock: not while that prune (or a purge) still runs
        try:
            with DestTree(run.root) as tree:
                known: set[str] = set()  # folders made or seen by this restore
                for d in sorted(run.rmdirs, key=lambda d: d.count("/")):
                    if only is None or any(i["path"].startswith(d + "/") for i in items):
                        result.dirs_made += makedirs(tree, d, known)
                for item in items:
                    _restore_item(tree, item, item["path"] in run.moved, result, known)
                    crash.hit("restore")
                if only is None and run.quarantine:
                    _remove_empty(tree, run.quarantine)
            w.write({"t": "restored", "time": time.time(), "restored": result.restored, "kept": len(result.kept),
                     "namespaces": sorted(only) if only is not None else None}, sync=True)
        finally:
            w.close()
    return result


def _restore_item(tree: DestTree, item: dict[str, Any], journaled: bool, result: RestoreResult,
                  known: set[str]) -> None:
    """Put one file back. `journaled`: its move has a done record; one without (a kill
    before the record, or a file this run kept) is restored only from where it is."""
    path = item["path"]
    where = tree.abspath(path)
    ino, dev = item.get("ino"), item.get("dev")
    source = item.get("to") or item.get("target")  # the quarantined name, or (--no-quarantine) the target
    try:
        now = tree.lstat(path)
        src = tree.lstat(check_relpath(source, "journal path")) if source else None
    except (SymlinkInPath, NotADirectoryError):
        result.kept.append(f"{where}: a folder on its path is now a symlink or file (never followed); not restored")
        return
    if now is not None:
        if (now.st_dev, now.st_ino) == (dev, ino):
            result.already_in_place += 1
            if item.get("to") and src is not None and (src.st_dev, src.st_ino) == (dev, ino):
                tree.unlink(item["to"])  # a kill between link and unlink left both names
            return
        result.kept.append(f"{where}: re-created since the prune (another file is there now); the pruned file "
                           f"stays at {tree.abspath(source) if source else 'nowhere'}: conflict, not overwritten")
        return
    if not journaled and (src is None or (src.st_dev, src.st_ino) != (dev, ino)):
        return  # this run never moved it (kept, or killed before): nothing of it to put back
    if src is None or (src.st_dev, src.st_ino) != (dev, ino):
        what = "missing from the quarantine" if item.get("to") else \
            "removed with --no-quarantine and its target no longer holds its inode"
        result.kept.append(f"{where}: {what}; cannot be restored")
        return
    try:
        makedirs(tree, path.rpartition("/")[0], known)
        spfd, sname = tree.split(source)
        dpfd, dname = tree.split(path)
        os.link(sname, dname, src_dir_fd=spfd, dst_dir_fd=dpfd, follow_symlinks=False)
        if item.get("to"):
            os.unlink(sname, dir_fd=spfd)
    except FileExistsError:
        result.kept.append(f"{where}: re-created while restoring; conflict, not overwritten")
        return
    except OSError as exc:
        result.kept.append(f"{where}: cannot restore: {exc.strerror or exc}")
        return
    result.restored += 1


def _remove_empty(tree: DestTree, reldir: str) -> None:
    """Remove the empty folders of a run's quarantine, deepest first."""
    base = tree.abspath(reldir)
    for dirpath, _, _ in sorted(os.walk(base), key=lambda e: e[0].count("/"), reverse=True):
        try:
            os.rmdir(dirpath)
        except OSError:
            pass


# --- purge -----------------------------------------------------------------------------------


@dataclass
class PurgeResult:
    runs: list[str] = field(default_factory=list)  # run ids purged
    files: int = 0
    freed_bytes: int = 0  # bytes whose last name was in the quarantine
    young: int = 0  # runs younger than --older-than, kept
    failed: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return EXIT_OPERATIONAL if self.failed else 0

    def to_dict(self) -> dict[str, Any]:
        return {"purged_runs": self.runs, "files": self.files, "freed_bytes": self.freed_bytes,
                "kept_young_runs": self.young, "failed": self.failed, "exit_code": self.exit_code}


def purge(root: str, older_than: float, *, now: float | None = None, dry_run: bool = False) -> PurgeResult:
    """Delete the quarantines of prune runs older than `older_than` seconds for real. The
    purge is journaled first (`purge`), so a killed purge is finished by a rerun and a
    restore of that run says what is gone."""
    root = os.path.abspath(root)
    now = time.time() if now is None else now
    result = PurgeResult()
    crash = _CrashSeam()
    jdir = prune_journal_dir(root)
    if not os.path.isdir(jdir) or not any(f.endswith(".jsonl") for f in os.listdir(jdir)):
        return result
    for run in load_prune_runs(jdir):
        if run.purged or not run.quarantine or not run.complete and not run.purge_started:
            continue  # (an interrupted prune is finished by the next `prune --apply` first)
        if now - float(run.header.get("time") or now) < older_than:
            result.young += 1
            continue
        qpath = os.path.join(root, run.quarantine)
        if not qpath.startswith(os.path.join(root, QUARANTINE_DIR) + "/"):
            result.failed.append(f"{run.path}: quarantine {qpath} is not under {root}/{QUARANTINE_DIR}; skipped")
            continue
        files, freed = _count(qpath)
        result.runs.append(str(run.header.get("run_id")))
        result.files += files
        result.freed_bytes += freed
        if dry_run:
            continue
        try:
            w = jn.JournalWriter.append(run.path)
        except OperationalError as exc:
            result.failed.append(str(exc).split("\n")[0])
            continue
        try:
            w.write({"t": "purge", "time": time.time(), "files": files}, sync=True)
            crash.hit("purge")
            errors: list[str] = []
            shutil.rmtree(qpath, onerror=lambda fn, p, exc: errors.append(f"{p}: {exc[1]}"))
            if errors and os.path.exists(qpath):
                result.failed += errors[:10]
                continue
            w.write({"t": "purged", "time": time.time(), "files": files, "freed_bytes": freed}, sync=True)
        finally:
            w.close()
    return result


def _count(path: str) -> tuple[int, int]:
    """(files, bytes whose every name is in the quarantine) under a quarantine folder:
    the bytes its removal frees (`prune.frees`: two quarantined names of one inode free it)."""
    stats = []
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                stats.append(os.lstat(os.path.join(dirpath, name)))
            except OSError:
                continue
    names_of = Counter((st.st_dev, st.st_ino) for st in stats)
    freed = sum({(st.st_dev, st.st_ino): st.st_size for st in stats
                 if frees(st.st_nlink, names_of[(st.st_dev, st.st_ino)])}.values())  # each inode once
    return len(stats), freed


# --- rollback after prune ------------------------------------------------------------------


def restore_before_rollback(root: str, namespaces: Iterable[str]) -> RestoreResult | None:
    """Before a migration's rollback removes its targets: put back what a prune moved
    out of its source namespaces. Raises (naming `restore`) when any of it cannot come
    back, so the rollback removes nothing: no sequence of commands loses a block."""
    jdir = prune_journal_dir(root)
    if not os.path.isdir(jdir) or not any(f.endswith(".jsonl") for f in os.listdir(jdir)):
        return None
    namespaces = set(namespaces)
    pending = [r for r in load_prune_runs(jdir) if not r.restored
               and any(i.get("ns") in namespaces for i in r.moves.values())]
    if not pending:
        return None
    result = restore(jdir, namespaces=namespaces)
    if result.kept:
        raise OperationalError(
            f"the sources of this migration were pruned and {plural(len(result.kept), 'file')} cannot be put back "
            f"(first: {result.kept[0]}); nothing was rolled back, since the targets hold their last copy",
            path=result.journals[0] if result.journals else jdir,
            hint=f"resolve them with `kvmigrate restore {result.journals[0] if result.journals else jdir}`, "
                 "then rerun the rollback")
    return result


def render_restore(result: RestoreResult) -> str:
    lines = [f"restored {plural(result.restored, 'file')} from {plural(len(result.journals), 'prune journal')}"
             + (f"; {result.already_in_place} already in place" if result.already_in_place else "")
             + (f"; {plural(result.dirs_made, 'folder')} made again" if result.dirs_made else "")]
    if result.kept:
        lines.append(f"not restored {len(result.kept)}:")
        lines += [f"  {k}" for k in result.kept[:50]] + (
            [f"  ... and {len(result.kept) - 50} more"] if len(result.kept) > 50 else [])
    return "\n".join(lines)


def render_purge(result: PurgeResult, root: str, dry_run: bool) -> str:
    from kvmigrate.units import human_bytes

    verb = "would purge" if dry_run else "purged"
    lines = [f"{verb} {plural(len(result.runs), 'quarantine')} under {os.path.join(root, QUARANTINE_DIR)}: "
             f"{plural(result.files, 'file')}, {human_bytes(result.freed_bytes)} freed"
             + (f"; {plural(result.young, 'younger run')} kept" if result.young else "")]
    lines += [f"  failed: {f}" for f in result.failed]
    return "\n".join(lines)

