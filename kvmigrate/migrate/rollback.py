"""Undo a migration from its journal (migration.md §3.5): remove exactly what it created.

Order: block files whose inode, size and hash (a hard link journaled without a hash:
its mtime) still match the journal; then config.json
files it created that are unchanged; then its own temp files and the namespace lock;
then the folders it created, deepest first, if empty. The lock goes before the folders
only because it sits inside the target base folder (spec order otherwise). Anything
that no longer matches is kept and reported (exit 8): a file someone changed or
replaced after the migration is not ours to delete. Paths come from the journal and
are checked like manifest paths; removal happens through O_NOFOLLOW directory fds
under the journal's destination root.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvmigrate import layout
from kvmigrate.errors import EXIT_OPERATIONAL, OperationalError
from kvmigrate.migrate import journal as jn
from kvmigrate.migrate.reconcile import reconcile_item
from kvmigrate.migrate.fsops import DestTree, SymlinkInPath, check_relpath
from kvmigrate.migrate.lock import NamespaceLock
from kvmigrate.migrate.restore import restore_before_rollback
from kvmigrate.selection import Selection, base_of_path, journal_bases


@dataclass
class RollbackResult:
    removed: Counter = field(default_factory=Counter)  # kind -> count
    already_gone: int = 0
    kept: list[str] = field(default_factory=list)  # could not / must not be removed, with why
    notes: list[str] = field(default_factory=list)
    journals: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return EXIT_OPERATIONAL if self.kept else 0

    def to_dict(self) -> dict[str, Any]:
        return {"removed": dict(self.removed), "already_gone": self.already_gone, "kept": self.kept,
                "notes": self.notes, "journals": self.journals, "exit_code": self.exit_code}


def rollback(journal: str, selection: Selection | None = None) -> RollbackResult:
    """Python API: roll back every run of a journal file or directory (newest first).
    `selection` (--only/--exclude): only the targets it keeps; the journal is then not
    marked rolled back (a later rollback without it removes the rest)."""
    result = RollbackResult()
    files = jn.journal_files(journal)
    _restore_pruned_sources(files, result)
    for path in reversed(files):
        runs = jn.load_runs(path)
        if all(r.rolled_back for r in runs):
            result.notes.append(f"{path}: already rolled back")
            continue
        result.journals.append(path)
        for run in reversed(runs):
            if not run.rolled_back:
                _rollback_run(run, result, selection)
        if selection:
            result.notes.append(f"{path}: rolled back the targets matching {selection.flags()} only; the journal "
                                "stays usable for the rest")
            continue
        _append_rolled_back(path, result)
    return result


def _restore_pruned_sources(files: list[str], result: RollbackResult) -> None:
    """A prune may have moved these migrations' sources into its quarantine: put them
    back before any target goes (or raise, removing nothing: the targets may hold the
    last copy)."""
    sources: dict[str, set[str]] = {}
    for path in files:
        for run in jn.load_runs(path):
            if not run.rolled_back:
                for rec in run.targets.values():
                    sources.setdefault(run.root, set()).update(rec.get("sources") or ())
    for root, namespaces in sources.items():
        restored = restore_before_rollback(root, namespaces)
        if restored is not None and restored.restored:
            result.notes.append(f"first restored {restored.restored} pruned source file(s) from "
                                f"{', '.join(restored.journals)}")


def _rollback_run(run: jn.Run, result: RollbackResult, selection: Selection | None = None) -> None:
    if selection:  # the records of the kept targets only
        kept = journal_bases(run.targets, selection)
        run.targets = {b: r for b, r in run.targets.items() if b in kept}
        run.locks = [p for p in run.locks if _base_of(p) in kept]
        run.done = {p: r for p, r in run.done.items() if base_of_path(p) in kept}
        run.intents = {p: r for p, r in run.intents.items() if base_of_path(p) in kept}
    dest = run.dest
    if not os.path.isdir(dest):
        result.kept.append(f"{dest}: destination root of run {run.header.get('run_id')} is missing; nothing removed")
        return
    digests = {b: bytes.fromhex(r["digest"]) for b, r in run.targets.items() if r.get("digest")}
    with DestTree(dest) as tree:
        locks = []
        try:
            for base in sorted({*run.targets, *(_base_of(p) for p in run.locks)}):
                check_relpath(base, "journal target")
                if tree.lstat(base) is not None:
                    locks.append(NamespaceLock.acquire(tree, base, purpose="rollback"))
            created = dict(run.done)
            for item in run.pending():
                adopted = reconcile_item(tree, run.root, item, digests)
                if adopted is not None:
                    created[item["path"]] = adopted
            by_kind: dict[str, list[dict]] = {"block": [], "config": [], "dir": []}
            for rec in created.values():
                if rec.get("kind") in by_kind:
                    check_relpath(rec["path"], "journal path")
                    by_kind[rec["kind"]].append(rec)
            for rec in by_kind["block"]:
                _remove_file(tree, rec, "block", result)
            for rec in by_kind["config"]:
                _remove_file(tree, rec, "config", result)
            for item in run.intents.values():
                tmp = item.get("tmp")
                if tmp and layout.OWN_TMP_RE.search(tmp):
                    check_relpath(tmp, "journal temp path")
                    _remove_quiet(tree, tmp, "temp", result)
        finally:
            for lock in locks:  # a lock file left by an interrupted run goes too
                lock.release()
        for rec in sorted(by_kind["dir"], key=lambda r: r["path"].count("/"), reverse=True):
            try:
                tree.rmdir(rec["path"])
                result.removed["dir"] += 1
            except FileNotFoundError:
                result.already_gone += 1
            except OSError as exc:
                if exc.errno == errno.ENOTEMPTY:
                    result.kept.append(f"{tree.abspath(rec['path'])}: folder not empty (holds files this migration "
                                       "did not create, or kept ones listed above); left in place")
                else:
                    result.kept.append(f"{tree.abspath(rec['path'])}: cannot remove folder: {exc.strerror}")


def _base_of(lock_relpath: str) -> str:
    return lock_relpath.rsplit("/", 1)[0]


def _remove_file(tree: DestTree, rec: dict[str, Any], kind: str, result: RollbackResult) -> None:
    path = rec["path"]
    where = tree.abspath(path)
    try:
        st = tree.lstat(path)
    except (SymlinkInPath, NotADirectoryError):
        result.kept.append(f"{where}: a parent folder is now a symlink or file; not touched")
        return
    if st is None:
        result.already_gone += 1
        return
    if not stat.S_ISREG(st.st_mode) or st.st_ino != rec.get("ino") or st.st_dev != rec.get("dev", st.st_dev):
        result.kept.append(f"{where}: replaced since the migration (inode differs); kept")
        return
    if st.st_size != rec.get("size"):
        result.kept.append(f"{where}: size changed since the migration ({st.st_size} != {rec.get('size')}); kept")
        return
    if rec.get("xxh3_128") is None and rec.get("how") == "link":
        # a hard link journaled by identity (no hash was taken): its inode is the source's,
        # unchanged while the mtime is
        if st.st_mtime_ns != rec.get("mtime_ns"):
            result.kept.append(f"{where}: modified since the migration (mtime differs); kept")
            return
        return _unlink_counted(tree, path, where, kind, result)
    try:
        have, _ = tree.hash(path)
    except OSError as exc:
        result.kept.append(f"{where}: cannot read to check it: {exc.strerror}; kept")
        return
    if have.hex() != rec.get("xxh3_128"):
        result.kept.append(f"{where}: content changed since the migration (hash differs); kept")
        return
    _unlink_counted(tree, path, where, kind, result)


def _unlink_counted(tree: DestTree, path: str, where: str, kind: str, result: RollbackResult) -> None:
    try:
        tree.unlink(path)
        result.removed[kind] += 1
    except FileNotFoundError:
        result.already_gone += 1
    except OSError as exc:
        result.kept.append(f"{where}: cannot remove: {exc.strerror}")


def _remove_quiet(tree: DestTree, path: str, kind: str, result: RollbackResult) -> None:
    try:
        tree.unlink(path)
        result.removed[kind] += 1
    except (FileNotFoundError, SymlinkInPath, NotADirectoryError):
        pass
    except OSError as exc:
        result.kept.append(f"{tree.abspath(path)}: cannot remove temp file: {exc.strerror}")


def _append_rolled_back(path: str, result: RollbackResult) -> None:
    """Mark the journal so a rerun of its command starts afresh instead of resuming."""
    try:
        w = jn.JournalWriter.append(path)
        w.write({"t": "rolled_back", "time": time.time(), "removed": dict(result.removed),
                 "kept": len(result.kept)}, sync=True)
        w.close()
    except OperationalError as exc:
        result.kept.append(f"{path}: cannot mark the journal as rolled back: {exc}")


def render(result: RollbackResult) -> str:
    r = result.removed
    lines = [f"rolled back {len(result.journals)} journal(s): removed {r.get('block', 0)} blocks, "
             f"{r.get('config', 0)} config.json, {r.get('dir', 0)} folders, {r.get('temp', 0)} temp files"
             + (f"; {result.already_gone} already gone" if result.already_gone else "")]
    lines += [f"  note: {n}" for n in result.notes]
    if result.kept:
        lines.append(f"kept {len(result.kept)} path(s):")
        lines += [f"  {k}" for k in result.kept]
    return "\n".join(lines)
