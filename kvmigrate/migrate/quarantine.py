"""The quarantine of `kvmigrate prune --apply` (migration.md §6): move a prune plan's
files into `ROOT/.kvmigrate/quarantine/<run>/<relpath>` by rename, journaled before the
first move, block by block; finish a run a kill interrupted; read the prune journal.

The plan comes from `prune.build_plan`; `restore.py` undoes or purges what this moved.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
import sys
import time
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvmigrate import layout
from kvmigrate.errors import EXIT_OPERATIONAL, OperationalError, UsageError
from kvmigrate.migrate import journal as jn
from kvmigrate.migrate import prune_stores as stores_
from kvmigrate.migrate.crash import CrashSeam as _CrashSeam  # the kill -9 tests' seam
from kvmigrate.migrate.fsops import DestTree, SymlinkInPath, check_relpath
from kvmigrate.migrate.lock import NamespaceLock
from kvmigrate.migrate.prune import (
    KIND,
    QUARANTINE_DIR,
    Item,
    Items,
    PrunePlan,
    frees,
    prune_journal_dir,
    target_base,
    without_namespaces,
)
from kvmigrate.pacing import Interrupted

if TYPE_CHECKING:  # the JSON models are types only (kvmigrate.outputs)
    from kvmigrate.outputs import PruneRun as PruneRunOutput

_BATCH = 4096  # files per intent record, and moves per fsync of their done records
_KNOWN_FOLDERS = 8192  # folders `makedirs` remembers as made or seen


@dataclass
class PruneResult:
    journal: str | None  # None: nothing to move, so no run (and no journal)
    run_id: str | None
    quarantine: str | None  # relpath of the run's quarantine folder (None with --no-quarantine)
    moved: Counter = field(default_factory=Counter)  # class -> files
    moved_bytes: Counter = field(default_factory=Counter)
    freed_bytes: int = 0  # bytes no other name holds (freed when the quarantine is purged)
    unlinked: int = 0  # files whose bytes another name keeps (a file-count slot only)
    dirs_removed: int = 0
    left: Counter = field(default_factory=Counter)  # class -> files of the plan not moved (kept, failed)
    targets: Counter = field(default_factory=Counter)  # target base -> legacy names of its blocks removed
    left_targets: Counter = field(default_factory=Counter)  # target base -> legacy names of its blocks kept
    # (dev, inode) -> its names in the run, of the inodes the run holds several names of (`frees`;
    # any other inode has one); the inodes of those this run moved a name of
    names: Counter = field(default_factory=Counter, repr=False)
    moved_inodes: set = field(default_factory=set, repr=False)
    kept: list[str] = field(default_factory=list)  # with why (changed since the scan, ...)
    failed: list[str] = field(default_factory=list)  # operational problems
    objects: Counter = field(default_factory=Counter)  # class -> store objects no longer served
    rewritten: int = 0  # store indexes whose keys were retired (--tails)
    # class -> files a killed run had moved whose done record the kill lost (finish_interrupted
    # finds them at their quarantine path): not among `moved`, which this command moved
    already_moved: Counter = field(default_factory=Counter)

    @property
    def exit_code(self) -> int:
        return EXIT_OPERATIONAL if self.failed else 0

    def to_dict(self) -> PruneRunOutput:
        return {"journal": self.journal, "run_id": self.run_id, "quarantine": self.quarantine,
                "moved": dict(self.moved), "moved_bytes": dict(self.moved_bytes), "freed_bytes": self.freed_bytes,
                "unlinked_files": self.unlinked, "dirs_removed": self.dirs_removed, "left": dict(self.left),
                "legacy_names_removed": dict(self.targets), "legacy_names_left": dict(self.left_targets),
                "kept": self.kept, "objects": dict(self.objects), "rewritten": self.rewritten,
                "already_moved": dict(self.already_moved), "failed": self.failed, "exit_code": self.exit_code}


class _Changed(Exception):
    """A file (or its target) is not what the scan saw: kept."""


def apply_prune(plan: PrunePlan, *, journal: str | None = None, quarantine: bool = True, command: str = "",
                crash: Any = None) -> PruneResult:
    """Move the plan's files into the quarantine (or unlink them: --no-quarantine, for
    migrated blocks only), each re-checked first. The whole run is journaled before the
    first file moves, so a killed run is finished by `finish_interrupted` (every file of
    a block goes, never one rank of it). `crash`: the test seam whose `hit(point)` the
    kill -9 tests stop the process at (default: KVMIGRATE_CRASH_AT, as for migrate)."""
    if not quarantine and set(plan.classes) - {"migrated"}:
        raise UsageError("--no-quarantine is allowed for --migrated only (their bytes stay reachable through the "
                         "target); other classes go to the quarantine", hint="drop --no-quarantine")
    if not plan.items and not plan.retires:  # nothing to do: no run, so no journal names an empty one to undo
        return PruneResult(None, None, None)
    # a store is written only with the proof that no client runs, taken before anything (even the journal)
    client_locks = stores_.take_proofs(plan.root, plan.store_proofs) if plan.store_proofs else []
    try:
        return _apply_prune(plan, journal, quarantine, command, crash)
    finally:
        for lock in client_locks:
            lock.release()


def _apply_prune(plan: PrunePlan, journal: str | None, quarantine: bool, command: str, crash: Any) -> PruneResult:
    run_id = jn.new_run_id()
    root = plan.root
    path = journal or os.path.join(prune_journal_dir(root), f"{run_id}{jn.SUFFIX}")
    if os.path.isdir(path):
        path = os.path.join(path, f"{run_id}{jn.SUFFIX}")
    qdir = f"{QUARANTINE_DIR}/{run_id}" if quarantine else None
    w = jn.JournalWriter.create(path, read_only=lambda: (
        f"{root} is on a read-only filesystem: remount it read-write, then rerun the same command (prune moves "
        "files within ROOT, into ROOT/.kvmigrate/quarantine: nothing else can take its place)"),
        header={"kind": KIND, "run_id": run_id, "command": command, "root": root,
                                       "dest": root, "manifest": os.path.abspath(plan.manifest),
                                       "classes": list(plan.classes), "quarantine": qdir, "pid": os.getpid(),
                                       "time": time.time(), "scan_started_ns": plan.scan_started_ns})
    result = PruneResult(path, run_id, qdir)
    hit = (crash or _CrashSeam()).hit  # points: prune_intent, prune_move, prune_dirs
    try:
        with DestTree(root) as tree:
            try:
                _make_quarantine(tree, qdir)
            except OperationalError as exc:  # nothing journaled to move: a complete run that moved nothing
                w.write({"t": "complete", "moved": {}, "kept": 0, "failed": 1, "error": str(exc).splitlines()[0],
                         "time": time.time()}, sync=True)
                raise
            locks = []
            held = set()
            try:
                for base in sorted(plan.locks):
                    try:
                        if tree.lstat(base) is not None:
                            locks.append(NamespaceLock.acquire(tree, base, purpose="prune"))
                    except OperationalError as exc:
                        held.update(plan.locks[base])
                        result.kept.append(f"{', '.join(sorted(plan.locks[base]))}: not pruned: "
                                           f"{str(exc).splitlines()[0]}")
                items = without_namespaces(plan.items, held)
                result.names = shared_inodes((i.dev, i.inode) for i in items)
                retires = _retire_intents(plan, run_id, w, result)
                it = iter(items)
                while chunk := list(itertools.islice(it, _BATCH)):
                    w.intent([_intent(i, qdir) for i in chunk])
                own = stores_.own_locks(root, plan.store_proofs)
                try:
                    hit("prune_intent")
                    _retires(root, retires, w, result, hit)
                    _moves(tree, items, qdir, plan.scan_started_ns, w, result, hit)
                finally:
                    for path in own:
                        if os.path.lexists(path):
                            os.unlink(path)
            finally:
                for lock in locks:
                    lock.release()
        w.write({"t": "complete", "moved": dict(result.moved), "kept": len(result.kept),
                 "failed": len(result.failed), "time": time.time()}, sync=True)
    except KeyboardInterrupt as exc:
        raise _interrupted(w, path) from exc
    finally:
        w.close()
    return result


def _retire_intents(plan: PrunePlan, run_id: str, w: jn.JournalWriter, result: PruneResult) -> list[dict[str, Any]]:
    """Journal the stores' proofs and every retire of the plan (its original and new
    XXH3) before anything is written; an index changed since the scan is kept."""
    for store, p in sorted(plan.store_proofs.items()):
        w.write({"t": "mc_proof", "store": store, "proof": p.proof, "clients": sorted(p.bucket_clients),
                 "written": sorted(p.bucket_clients | p.kventry_clients)})
    out = []
    for rw in plan.retires:
        rec = stores_.retire_intent(plan.root, rw, run_id)
        if isinstance(rec, str):
            result.kept.append(rec)
            continue
        w.write(rec)
        out.append(rec)
    w.sync()
    return out


def _retires(root: str, recs: list[dict[str, Any]], w: jn.JournalWriter, result: PruneResult, hit: Any) -> None:
    """Retire the short entries' keys (§5.2's index rewrite), each journaled when done;
    the stages used are cleared after."""
    from kvmigrate.errors import KvMigrateError

    for rec in recs:
        path = os.path.join(root, rec["meta"])
        try:
            got = stores_.do_retire(root, rec, hit)
        except (KvMigrateError, OSError) as exc:
            result.kept.append(f"{path}: its keys are not retired: {str(exc).splitlines()[0]}")
            continue
        if got != "done":
            result.kept.append(f"{path}: changed since the prune journaled it; its keys are not retired")
            continue
        w.write({"t": "done", "kind": "mc_retire", "meta": rec["meta"]}, sync=True)
        result.rewritten += 1
        result.objects["tails"] += int(rec.get("objects") or 0)
    if recs:
        stores_.clear_stages(root, {r["client"] for r in recs})


def _interrupted(w: jn.JournalWriter, path: str) -> Interrupted:
    """Ctrl-C or SIGTERM while files move: the journal (its intents written ahead) stays
    without `complete`, so the next `prune --apply` finishes the run; say where it is."""
    try:
        w.write({"t": "interrupted", "time": time.time()}, sync=True)
    except OperationalError:
        pass  # (the intents are on disk; the record only says why the run stopped)
    return Interrupted("interrupted (Ctrl-C or SIGTERM)", journal=path)


def _intent(i: Item, qdir: str | None) -> dict[str, Any]:
    rec = {"kind": "move", "path": i.relpath, "to": f"{qdir}/{i.relpath}{i.suffix}" if qdir else None, "dev": i.dev,
           "ino": i.inode, "size": i.size, "mtime_ns": i.mtime_ns, "nlink": i.nlink, "class": i.cls,
           "ns": i.namespace, "key": i.key, "target": None}
    if i.keep:
        rec["keep"] = i.keep
    if i.suffix:
        rec["suffix"] = i.suffix
    if i.objects:
        rec["objects"] = i.objects
    if i.target is not None:
        rec.update(target=i.target[0], tdev=i.target[1], tino=i.target[2], tsize=i.target[3], tmtime_ns=i.target[4])
    return rec


def _moves(tree: DestTree, items: Items, qdir: str | None, scan_started_ns: int | None, w: jn.JournalWriter,
           result: PruneResult, hit: Any) -> None:
    """Move the items block by block: when one rank file of a block stays (changed, or
    the move failed), the others of that block are put back, and a namespace's
    config.json goes only if all else of it went (nothing is left half-moved)."""
    _make_quarantine(tree, qdir)
    known: set[str] = set()  # quarantine folders made or seen by this run
    parents = FolderTree()  # the folders of the files moved
    held_back: set[str] = set()
    n = 0
    for key, same_key in itertools.groupby(items, key=lambda i: i.key):
        group = list(same_key)
        ns = group[0].namespace
        if key == f"{ns}/{layout.CONFIG_NAME}" and ns in held_back:
            result.kept.append(f"{tree.abspath(key)}: kept, since other files of {ns} stay (listed above)")
            _left(result, group)
            continue
        done = []
        for item in group:
            if not _move(tree, item, qdir, scan_started_ns, w, result, known):
                break
            done.append(item)
            hit("prune_move")
            n += 1
            if n % _BATCH == 0:
                w.sync()
        if len(done) < len(group):
            held_back.update(i.namespace for i in group)
            for item in done:
                _undo(tree, item, qdir, w, result)
            _left(result, group)
        else:
            for i in done:
                parents.add(i.relpath.rpartition("/")[0])
    w.sync()
    _remove_folders(tree, parents, w, result, {i.keep for i in items if i.keep})
    hit("prune_dirs")


def _left(result: PruneResult, group: list[Item]) -> None:
    """Count the files of the plan that stay (kept, failed, put back)."""
    result.left.update(i.cls for i in group)
    result.left_targets.update(b for i in group if (b := target_base(i)))


def shared_inodes(inodes: Iterable[tuple[int, int]]) -> Counter:
    """(dev, inode) -> its names, of the inodes named more than once: the rest have one
    name each (tallied in Arrow from two integer columns, not a Python pair per file)."""
    devs, inos = array("Q"), array("Q")
    for dev, ino in inodes:
        devs.append(dev)
        inos.append(ino)
    if not devs:
        return Counter()
    import pyarrow as pa
    import pyarrow.compute as pc

    g = pa.table({"dev": pa.array(devs, pa.uint64()), "ino": pa.array(inos, pa.uint64())}) \
        .group_by(["dev", "ino"]).aggregate([([], "count_all")])
    g = g.filter(pc.greater(g["count_all"], 1))
    return Counter({(d, i): n for d, i, n in zip(*(g[k].to_pylist() for k in ("dev", "ino", "count_all")))})


def _make_quarantine(tree: DestTree, qdir: str | None) -> None:
    """Make the run's quarantine folder before anything moves: on a read-only root (EROFS)
    or one kvmigrate may not write, the run stops here, with nothing moved."""
    if not qdir:
        return
    try:
        makedirs(tree, qdir)
    except OSError as exc:
        what = {errno.EROFS: "read-only filesystem", errno.EACCES: "permission denied",
                errno.EPERM: "operation not permitted", errno.ENOSPC: "no space left on device"}.get(
            exc.errno or 0, exc.strerror or str(exc))
        raise OperationalError(
            f"cannot make the quarantine folder: {what}; nothing was moved", path=tree.abspath(qdir),
            hint=("remount the cache root read-write (prune renames files within it, so the quarantine is on the "
                  "same filesystem), then rerun the same command" if exc.errno == errno.EROFS else
                  "let this user write the cache root's .kvmigrate folder (or free space), then rerun the same "
                  "command")) from None


def _undo(tree: DestTree, item: Item, qdir: str | None, w: jn.JournalWriter, result: PruneResult) -> None:
    """Put back a rank file whose block cannot go whole (journaled: `returned`)."""
    if qdir is None:
        return  # unlinked (--no-quarantine): its bytes are at the target, nothing to put back
    try:
        _put_back(tree, f"{qdir}/{item.relpath}{item.suffix}", item.relpath)
    except OSError as exc:
        result.failed.append(f"{tree.abspath(item.relpath)}: cannot put back into its block ({exc.strerror or exc});"
                             f" it is at {tree.abspath(qdir + '/' + item.relpath + item.suffix)}")
        return
    w.done({"kind": "returned", "path": item.relpath})
    result.objects[item.cls] -= item.objects
    if not result.objects[item.cls]:
        del result.objects[item.cls]
    result.moved[item.cls] -= 1
    result.moved_bytes[item.cls] -= item.size
    if target_base(item):
        result.targets[target_base(item)] -= 1
        if not result.targets[target_base(item)]:
            del result.targets[target_base(item)]
    result.kept.append(f"{tree.abspath(item.relpath)}: put back, since another rank file of its block stays")
    if not result.moved[item.cls]:
        del result.moved[item.cls], result.moved_bytes[item.cls]


def finish_interrupted(root: str) -> list[PruneResult]:
    """Finish every prune run of ROOT that was stopped (kill -9, a crash) before its
    `complete` record: the files it journaled and did not move yet are re-checked against
    the journaled stat and moved, as the run would have. A run still going holds its
    journal's flock: that refusal names its pid."""
    out: list[PruneResult] = []
    jdir = prune_journal_dir(root)
    if not _has_journals(jdir) or all(run.complete or run.restored or run.purge_started
                                      for run in load_prune_runs(jdir, moves=False)):
        return out  # (the runs' states first: a finished run's files are never read)
    for run in load_prune_runs(jdir):
        if run.complete or run.restored or run.purge_started:
            continue
        w = jn.JournalWriter.append(run.path)
        try:
            w.write({"t": "resume", "pid": os.getpid(), "time": time.time()}, sync=True)
            result = PruneResult(run.path, str(run.header.get("run_id")), run.quarantine)
            result.names = shared_inodes((rec["dev"], rec["ino"]) for rec in run.moves.values())
            result.moved_inodes.update((rec["dev"], rec["ino"]) for path, rec in run.moves.items()
                                       if path in run.moved and (rec["dev"], rec["ino"]) in result.names)
            items = [_item(rec) for path, rec in run.moves.items() if path not in run.moved]
            pending_retires = [r for r in run.mc_retires if r["meta"] not in run.mc_done]
            client_locks = stores_.lock_clients(run.root, run.mc_clients) if items or pending_retires else []
            try:
                _retires(run.root, pending_retires, w, result, _CrashSeam().hit)
            finally:
                for lock in client_locks:
                    lock.release()
            with DestTree(run.root) as tree:
                settled = [i for i in items if _settled(tree, i, run.quarantine, w, result)]
                pending = [i for i in items if i not in settled]
                _moves(tree, pending, run.quarantine, run.header.get("scan_started_ns"), w, result,
                       _CrashSeam().hit)
                _remove_folders(tree, FolderTree(i.relpath.rpartition("/")[0] for i in settled), w, result,
                                {i.keep for i in settled if i.keep})
            stores_.drop_own_locks(run.root, run.mc_written)
            w.write({"t": "complete", "moved": dict(result.moved + result.already_moved), "kept": len(result.kept),
                     "failed": len(result.failed), "time": time.time(), "resumed": True}, sync=True)
        except KeyboardInterrupt as exc:
            raise _interrupted(w, run.path) from exc
        finally:
            w.close()
        out.append(result)
    return out


def _item(rec: dict[str, Any]) -> Item:
    target = (check_relpath(rec["target"], "journal path"), rec["tdev"], rec["tino"], rec["tsize"],
              rec["tmtime_ns"]) if rec.get("target") else None
    return Item(rec["path"], rec["class"], rec.get("ns") or "", rec["dev"], rec["ino"], rec["size"], rec["mtime_ns"],
                rec.get("nlink") or 1, target, rec.get("key") or rec["path"], rec.get("keep") or "",
                rec.get("suffix") or "", rec.get("objects") or 0)


def _settled(tree: DestTree, item: Item, qdir: str | None, w: jn.JournalWriter, result: PruneResult) -> bool:
    """Moved before the kill, its done record lost with it: at its quarantine path."""
    if tree.lstat(item.relpath) is not None:
        return False
    if qdir is not None:
        st = tree.lstat(f"{qdir}/{item.relpath}{item.suffix}")
        if st is None or (st.st_dev, st.st_ino) != (item.dev, item.inode):
            return False
    w.done({"kind": "moved" if qdir else "unlinked", "path": item.relpath, "ino": item.inode, "dev": item.dev})
    if (item.dev, item.inode) in result.names:
        result.moved_inodes.add((item.dev, item.inode))
    result.already_moved[item.cls] += 1
    return True


def _has_journals(jdir: str) -> bool:
    return os.path.isdir(jdir) and any(jn.is_journal_name(f) for f in os.listdir(jdir))


@dataclass
class PruneRun:
    """One prune run of a journal file, as its records say."""

    path: str
    header: dict[str, Any]
    moves: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> intent item
    moved: set[str] = field(default_factory=set)  # paths with a done record
    # counted however the journal is read (a run's intents name each file once, its done
    # records each move once): `kvmigrate runs` counts a run without a record per file
    files_intended: int = 0
    files_moved: int = 0
    complete: bool = False
    restored: bool = False
    purged: bool = False
    purge_started: bool = False
    mc_retires: list[dict[str, Any]] = field(default_factory=list)  # store index rewrites (prune_stores)
    mc_done: set[str] = field(default_factory=set)  # the `.meta` of each retire done
    mc_clients: list[str] = field(default_factory=list)  # bucket client roots whose locks prove the store stopped
    mc_written: list[str] = field(default_factory=list)  # every client root the run writes (its own locks)

    @property
    def root(self) -> str:
        return self.header["root"]

    @property
    def quarantine(self) -> str | None:
        return self.header.get("quarantine")


def load_prune_runs(journal: str, *, moves: bool = True) -> list[PruneRun]:
    """The prune runs of a journal file or directory (oldest first), read with the
    journal module's reader; a migration journal is refused. `moves=False`: the runs'
    states only (every record is still read and checked, none kept per file): what
    `purge` and the run listing need, in bounded memory."""
    runs = []
    for path in jn.journal_files(journal):
        for rec in jn.iter_records(path, linked=False):  # (a prune writes no `linked` record)
            t = rec.get("t")
            if t == "header":
                if rec.get("kind") != KIND or not isinstance(rec.get("root"), str):
                    raise UsageError(f"{path} is not a prune journal", path=path,
                                     hint="pass the journal `kvmigrate prune --apply` printed (a migration is "
                                          "undone with `kvmigrate rollback`)")
                runs.append(PruneRun(path, jn.rebased(rec, path)))
                continue
            note_prune_record(runs[-1], rec, items=moves, moved=moves)
    return runs


def note_prune_record(run: PruneRun, rec: dict[str, Any], *, items: bool, moved: bool) -> None:
    """One record after a prune run's header into the run's state, its paths checked.
    `items`: keep each intent item by path (`run.moves`); `moved`: keep the paths moved
    (`run.moved`). Without either, nothing is kept per file: the states alone."""
    t = rec.get("t")
    if t == "intent":
        for item in rec.get("items", []):
            path = check_relpath(item.get("path"), "journal path")
            run.files_intended += 1
            if items:
                run.moves[path] = item
    elif t == "done" and rec.get("kind") == "rmdirs":  # (restore remakes them from the journal)
        for folder in rec.get("paths", []):
            check_relpath(folder, "journal path")
    elif t == "mc_retire":
        check_relpath(rec.get("meta"), "journal path")
        run.mc_retires.append(rec)
    elif t == "done" and rec.get("kind") == "mc_retire":
        run.mc_done.add(str(rec.get("meta")))
    elif t == "mc_proof":
        run.mc_clients += [c for c in rec.get("clients") or () if c not in run.mc_clients]
        run.mc_written += [c for c in rec.get("written") or () if c not in run.mc_written]
    elif t == "done" and rec.get("kind") == "returned":
        run.moved.discard(rec.get("path"))
        run.files_moved -= 1
    elif t == "done" and isinstance(rec.get("path"), str):  # (every done record of a move names its path)
        run.files_moved += 1
        if moved:
            run.moved.add(rec["path"])
    elif t == "complete":
        run.complete = True
    elif t == "resume":
        run.complete = False
    elif t == "restored":
        run.restored = True
    elif t == "purge":
        run.purge_started = True
    elif t == "purged":
        run.purged = True


def _move(tree: DestTree, item: Item, qdir: str | None, scan_started_ns: int | None, w: jn.JournalWriter,
          result: PruneResult, known: set[str]) -> bool:
    """Move (or unlink) one file after re-checking it; False when it was kept."""
    where = tree.abspath(item.relpath)
    try:
        st = _check_unchanged(tree, item, scan_started_ns, result.moved_inodes)
        if qdir is None:
            tree.unlink(item.relpath)
        else:
            dest = f"{qdir}/{item.relpath}{item.suffix}"
            makedirs(tree, dest.rpartition("/")[0], known)
            spfd, sname = tree.split(item.relpath)
            dpfd, dname = tree.split(dest)
            os.rename(sname, dname, src_dir_fd=spfd, dst_dir_fd=dpfd)
            moved = tree.lstat(dest)
            if moved is None or (moved.st_dev, moved.st_ino) != (st.st_dev, st.st_ino):
                # replaced between the check and the rename: put that file back, untouched
                _put_back(tree, dest, item.relpath)
                raise _Changed("replaced while pruning")
    except _Changed as exc:
        result.kept.append(f"{where}: {exc}; kept")
        return False
    except (SymlinkInPath, NotADirectoryError):
        result.kept.append(f"{where}: a folder on its path is now a symlink or file (never followed); kept")
        return False
    except FileNotFoundError:
        result.kept.append(f"{where}: gone since the scan; nothing to do")
        return False
    except OSError as exc:
        why = "another filesystem (EXDEV): the quarantine must be on the same filesystem as the file" \
            if exc.errno == errno.EXDEV else (exc.strerror or str(exc))
        result.failed.append(f"{where}: cannot move: {why}; kept")
        return False
    w.done({"kind": "moved" if qdir else "unlinked", "path": item.relpath, "ino": st.st_ino, "dev": st.st_dev})
    if item.objects:
        result.objects[item.cls] += item.objects
    first = (st.st_dev, st.st_ino) not in result.moved_inodes  # (another name of it moved: its bytes counted)
    if (st.st_dev, st.st_ino) in result.names:
        result.moved_inodes.add((st.st_dev, st.st_ino))
    result.moved[item.cls] += 1
    result.moved_bytes[item.cls] += item.size
    if target_base(item):
        result.targets[target_base(item)] += 1
    if frees(st.st_nlink, result.names.get((st.st_dev, st.st_ino), 1)):
        result.freed_bytes += item.size if first else 0
    else:
        result.unlinked += 1
    return True


def _check_unchanged(tree: DestTree, item: Item, scan_started_ns: int | None,
                     ours: AbstractSet[tuple[int, int]] = frozenset()) -> os.stat_result:
    """A fresh lstat equal to the scan's (a regular file, same dev, inode, size, mtime, no
    ctime after the scan), and for a migrated block its target unchanged too (the same
    inode for a link). `ours`: inodes this run moved another name of (that rename set
    their ctime: not a change since the scan)."""
    st = tree.lstat(item.relpath)
    if st is None:
        raise FileNotFoundError(item.relpath)
    if not stat.S_ISREG(st.st_mode):
        raise _Changed("no longer a regular file (a symlink is never followed)")
    if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != (item.dev, item.inode, item.size, item.mtime_ns):
        raise _Changed("changed since the scan (size, mtime or inode differ)")
    if scan_started_ns is not None and st.st_ctime_ns > scan_started_ns and (st.st_dev, st.st_ino) not in ours:
        raise _Changed("changed since the scan (ctime is newer than the scan)")
    if item.target is not None:
        trel, tdev, tino, tsize, tmtime = item.target
        tst = tree.lstat(trel)
        if tst is None or not stat.S_ISREG(tst.st_mode) or \
                (tst.st_dev, tst.st_ino, tst.st_size, tst.st_mtime_ns) != (tdev, tino, tsize, tmtime):
            raise _Changed(f"its target {tree.abspath(trel)} changed or went since the scan")
    return st


def _put_back(tree: DestTree, src: str, dest: str) -> None:
    """link + unlink: never over a name that exists again."""
    spfd, sname = tree.split(src)
    makedirs(tree, dest.rpartition("/")[0])
    dpfd, dname = tree.split(dest)
    os.link(sname, dname, src_dir_fd=spfd, dst_dir_fd=dpfd, follow_symlinks=False)
    os.unlink(sname, dir_fd=spfd)


def makedirs(tree: DestTree, reldir: str, known: set[str] | None = None) -> int:
    """Make `reldir` and its missing parents under the tree (no symlink followed); the
    folders in `known` are not asked again (one mkdir per folder, not per file); past
    _KNOWN_FOLDERS it starts over (the files come folder by folder: a bounded memory of
    them saves as many mkdirs). Returns how many it made."""
    made = 0
    if known is not None and len(known) > _KNOWN_FOLDERS:
        known.clear()
    parts = reldir.split("/") if reldir else []
    for k in range(len(parts), 0, -1):  # the deepest known folder: only below it is asked
        if "/".join(parts[:k]) in (known or ()):
            break
    else:
        k = 0
    for n in range(k + 1, len(parts) + 1):
        d = "/".join(parts[:n])
        made += tree.mkdir(d)
        if known is not None:
            known.add(d)
    return made


class FolderTree:
    """A set of folders (relative paths) as a tree of their names: a name shared by many
    folders (an llm-d `<hh>_g<group>`, a rank folder's hash fan-out) is held once, and each
    folder is one dict slot, not a path string (a prune of millions of files in as many
    folders held each path three times)."""

    def __init__(self, folders: Iterable[str] = ()) -> None:
        self.root: dict[str, dict | None] = {}
        for folder in folders:
            self.add(folder)

    def add(self, folder: str) -> None:
        """The folder and its parents."""
        if not folder:
            return
        node = self.root
        parts = folder.split("/")
        for k, part in enumerate(parts):
            child = node.get(part)
            if child is None:
                if k == len(parts) - 1:
                    if part not in node:
                        node[sys.intern(part)] = None
                    return
                child = node[sys.intern(part)] = {}
            node = child

    def deepest_first(self) -> Iterator[str]:
        """Every folder, deepest first, then by path descending: `sorted(paths, key=(depth,
        path), reverse=True)`, without the list. Siblings above the last level compare
        as `name/` (the path's next character), so the order is the paths' own."""
        depth = self._depth(self.root)
        for d in range(depth, 0, -1):
            yield from self._at(self.root, d, "")

    def _depth(self, node: dict | None) -> int:
        return 0 if not node else 1 + max(self._depth(child) for child in node.values())

    def _at(self, node: dict | None, d: int, prefix: str) -> Iterator[str]:
        if not node:
            return
        if d == 1:
            for name in sorted(node, reverse=True):
                yield prefix + name
            return
        for name in sorted(node, key=lambda n: n + "/", reverse=True):
            yield from self._at(node[name], d - 1, f"{prefix}{name}/")


def _remove_folders(tree: DestTree, parents: FolderTree, w: jn.JournalWriter, result: PruneResult,
                    keep: AbstractSet[str] = frozenset()) -> None:
    """The folders the moves left empty (`parents`: the folders of the files moved, with
    their parents), deepest first (a folder still holding anything stays); each one
    journaled so `restore` makes it again. `keep`: folders never removed, nor their
    parents (an LMCache tier folder is the engine's configured path, and so is its temp
    folder; its GDS `<2>/<2>` folders go when emptied)."""
    kept = {"/".join(k.split("/")[:j]) for k in keep for j in range(1, len(k.split("/")) + 1)}
    removed: list[str] = []
    for d in parents.deepest_first():
        if d in kept:
            continue
        try:
            tree.rmdir(d)
            removed.append(d)
        except OSError:
            continue
        if len(removed) == RMDIRS_PER_RECORD:
            _journal_rmdirs(w, removed, result)
    _journal_rmdirs(w, removed, result)


RMDIRS_PER_RECORD = 8_192  # folders a `rmdirs` record names: a reader decodes one record at once


def _journal_rmdirs(w: jn.JournalWriter, removed: list[str], result: PruneResult) -> None:
    """The folders removed so far, as one `rmdirs` record (a run writes as many as it needs),
    then forgotten: no record grows with the tree."""
    if removed:
        w.write({"t": "done", "kind": "rmdirs", "paths": removed}, sync=True)
        result.dirs_removed += len(removed)
        removed.clear()


# --- rendering -------------------------------------------------------------------------------


def render_result(result: PruneResult) -> str:
    from kvmigrate.units import human_bytes, plural

    if result.journal is None:
        return "nothing to prune: no file moved, no prune run journaled"
    moved = sum(result.moved.values())
    where = os.path.join("ROOT", result.quarantine) if result.quarantine else "nowhere (--no-quarantine: unlinked)"
    lines = [f"pruned {plural(moved, 'file')} ({human_bytes(sum(result.moved_bytes.values()))}) into {where}: "
             f"{human_bytes(result.freed_bytes)} freed once purged, {plural(result.unlinked, 'file')} only unlinked; "
             f"{plural(result.dirs_removed, 'empty folder')} removed"]
    for cls, k in sorted(result.moved.items()):
        lines.append(f"  {cls.replace('_', '-')}: {plural(k, 'file')}, {human_bytes(result.moved_bytes[cls])}")
    if result.objects or result.rewritten:
        lines.append(f"Mooncake objects no longer served: {sum(result.objects.values())}; "
                     f"{plural(result.rewritten, 'index', 'indexes')} rewritten (short entries' keys retired: nothing "
                     "freed); restart the clients and the master")
    if result.targets or result.left_targets:
        lines.append(f"legacy names removed: {sum(result.targets.values())}; " + (
            "each target namespace now holds only its own files (a file-count evictor counts each block once)"
            if not result.left_targets else f"{sum(result.left_targets.values())} stay (below): file-count evictors "
                                           "still count those blocks twice"))
        for base in sorted(set(result.targets) | set(result.left_targets)):
            lines.append(f"  {base}: {plural(result.targets[base], 'legacy name')} removed" + (
                f", {result.left_targets[base]} left" if result.left_targets[base] else
                ": its file count is its own"))
    lines.append(f"journal: {result.journal}  (undo: kvmigrate restore {result.journal})")
    for what, rows in (("kept", result.kept), ("failed", result.failed)):
        if rows:
            lines.append(f"{what} {len(rows)}:")
            lines += [f"  {r}" for r in rows[:50]] + ([f"  ... and {len(rows) - 50} more"] if len(rows) > 50 else [])
    return "\n".join(lines)
