"""Undo or finish a prune (migration.md §6): `restore` puts quarantined files back,
`purge` empties old quarantines for real.

Both read the prune journal (`quarantine.apply_prune` writes it through `journal.JournalWriter`;
its records are read back with `journal.iter_records`). Restore trusts the tree, not the
done records (`way_back`): a file is back when its path holds the journaled inode, so a
rerun after a kill -9 converges. A path re-created meanwhile (the engine wrote the block
again) is a conflict: the pruned file stays where it is and is reported, never
overwritten. Files go back by link + unlink (no rename: a rename would replace a
re-created name), from the quarantine or, once that is purged, from their target while it
is a hard link of them. A rollback reads the same way first (`rollback.decide`).
"""

from __future__ import annotations

import contextlib
import heapq
import os
import shutil
import struct
import time
from array import array
from bisect import bisect_left
from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from kvmigrate.errors import EXIT_OPERATIONAL, OperationalError
from kvmigrate.migrate import journal as jn
from kvmigrate.migrate import prune_stores as stores_
from kvmigrate.migrate.crash import CrashSeam as _CrashSeam  # the kill -9 tests' seam
from kvmigrate.migrate.fsops import DestTree, SymlinkInPath, check_relpath
from kvmigrate.migrate.prune import QUARANTINE_DIR, frees, prune_journal_dir
from kvmigrate.migrate.quarantine import PruneRun, load_prune_runs, makedirs
from kvmigrate.units import plural

if TYPE_CHECKING:  # the JSON models are types only (kvmigrate.outputs)
    from kvmigrate.outputs import PurgeOutput, RestoreOutput


@dataclass
class RestoreResult:
    restored: int = 0
    already_in_place: int = 0
    dirs_made: int = 0
    kept: list[str] = field(default_factory=list)  # conflicts and files that cannot go back, with why
    journals: list[str] = field(default_factory=list)
    conflicts: int = 0  # of `kept`: paths re-created meanwhile, the pruned file still in a quarantine or target

    @property
    def exit_code(self) -> int:
        return EXIT_OPERATIONAL if self.kept else 0

    def to_dict(self) -> RestoreOutput:
        return {"restored": self.restored, "already_in_place": self.already_in_place, "dirs_made": self.dirs_made,
                "kept": self.kept, "conflicts": self.conflicts, "journals": self.journals, "exit_code": self.exit_code}


class WayBack(NamedTuple):
    """How one file a prune moved comes back: the one reading of the tree that `restore`
    acts on and a rollback's decision (rollback.decide) counts and lists."""

    path: str  # its path under the root
    state: str  # in_place | quarantine | target | conflict | lost | not_moved
    source: str | None  # the name holding its inode now: its quarantine name, or its target (a hard link)
    why: str | None  # conflict, lost: what to tell (the absolute path first)


def way_back(tree: DestTree, run: PruneRun, item: dict[str, Any], moved: Container[str] | None = None) -> WayBack:
    """Where the file of a prune intent is and how it can come back. Its path holding its
    inode: back. Else its quarantine name holding it: link it back from there; else (the
    quarantine purged, or --no-quarantine) its target, a hard link of it: link it back from
    the target. A path another file holds is a conflict (never overwritten); no name
    holding the inode: lost. A file whose move has no done record and whose quarantine name
    lacks it was never moved (kept by the run, or the kill came first). `moved`: the
    paths of the run's done records, when `run.moved` was not loaded."""
    path = item["path"]
    where = tree.abspath(path)
    inode = (item.get("dev"), item.get("ino"))
    quarantined, target = item.get("to"), item.get("target")
    try:
        now = tree.lstat(path)
        q = tree.lstat(check_relpath(quarantined, "journal path")) if quarantined else None
        t = tree.lstat(check_relpath(target, "journal path")) if target else None
    except (SymlinkInPath, NotADirectoryError):
        return WayBack(path, "conflict", None, f"{where}: a folder on its path is now a symlink or file (never "
                                               "followed); not restored")
    holds = lambda st: st is not None and (st.st_dev, st.st_ino) == inode  # noqa: E731
    if holds(now):
        return WayBack(path, "in_place", quarantined if holds(q) else None, None)  # (both names: a kill between)
    if not holds(q) and path not in (run.moved if moved is None else moved):
        return WayBack(path, "not_moved", None, None)
    source = quarantined if holds(q) else target if holds(t) else None
    if source is None:
        what = (f"purged with the quarantine of run {run.header.get('run_id')}" if run.purge_started and quarantined
                else "missing from the quarantine" if quarantined
                else "removed with --no-quarantine and its target no longer holds its inode")
        return WayBack(path, "lost", None, f"{where}: {what}; cannot be restored")
    if now is not None:
        return WayBack(path, "conflict", source, f"{where}: re-created since the prune (another file is there now); "
                                                 f"the pruned file stays at {tree.abspath(source)}: conflict, not "
                                                 "overwritten")
    return WayBack(path, "quarantine" if source == quarantined else "target", source, None)


def restore_runs(journal: str, namespaces: Iterable[str] | None = None) -> list[tuple[PruneRun, list[dict]]]:
    """The prune runs of `journal`, newest first, each with its intents (of the source
    `namespaces` only, when given)."""
    only = set(namespaces) if namespaces is not None else None
    out = []
    for run in sorted(load_prune_runs(journal), key=lambda r: float(r.header.get("time") or 0), reverse=True):
        items = [i for i in run.moves.values() if only is None or i.get("ns") in only]
        if items or run.mc_retires and only is None:
            out.append((run, items))
    return out


def claimed(run: PruneRun, ways: list[tuple[dict, WayBack]]) -> set[tuple[str, str]]:
    """The (root, path) a run moved: the newest run that moved a path owns it, so an older
    run's intent of it (a file restored, then pruned again) is left out."""
    return {(run.root, item["path"]) for item, way in ways if way.state != "not_moved"}


def restore(journal: str, *, namespaces: Iterable[str] | None = None) -> RestoreResult:
    """Put back every file the prune runs of `journal` moved (newest run first); with
    `namespaces`, only the files of those source namespaces (a migration's rollback). Each
    file as `way_back` finds it, under the run journal's flock (not while that prune or a
    purge still runs); the run's quarantine folders left empty go. The intents are read
    frame by frame, newest last one first (`_RunIndex`): what is held per file is a digest
    of its path (the run's done records, the paths a newer run claimed)."""
    only = set(namespaces) if namespaces is not None else None
    result = RestoreResult()
    crash = _CrashSeam()
    owned = PathDigests()  # (root, path) a newer run moved
    for run, index in _indexed_runs(journal):
        def wanted(item: dict[str, Any], run: PruneRun = run) -> bool:
            return (only is None or item.get("ns") in only) and _root_path(run.root, item["path"]) not in owned

        if not any(wanted(i) for i in index.items()) and not (only is None and run.mc_retires):
            continue
        if run.path not in result.journals:
            result.journals.append(run.path)
        w = jn.JournalWriter.append(run.path)  # the flock: not while that prune (or a purge) still runs
        client_locks: list = []
        try:
            if run.mc_clients:  # a store is written back only with its client locks held (exit 8 if one is)
                client_locks = stores_.lock_clients(run.root, run.mc_clients)
            claims = PathDigests()
            with DestTree(run.root) as tree:
                known: set[str] = set()  # folders made or seen by this restore
                for item in index.items(backwards=True):  # the moves backwards: a GDS data file before its sidecar
                    if not wanted(item):
                        continue
                    way = way_back(tree, run, item, index.moved)
                    if way.state != "not_moved":  # (`claimed`)
                        claims.add(_root_path(run.root, item["path"]))
                    _put_back(tree, item, way, result, known)
                    crash.hit("restore")
                if run.quarantine:
                    _remove_empty(tree, run.quarantine)
            owned.update(claims)
            if only is None:
                for rec in run.mc_retires:  # each retired index's original back
                    got, why = stores_.undo_retire(run.root, rec)
                    if got == "restored":
                        result.restored += 1
                    elif got == "in_place":
                        result.already_in_place += 1
                    elif why is not None:
                        result.kept.append(why)
            w.write({"t": "restored", "time": time.time(), "restored": result.restored, "kept": len(result.kept),
                     "namespaces": sorted(only) if only is not None else None}, sync=True)
        finally:
            for lock in client_locks:
                lock.release()
            w.close()
    return result


def _root_path(root: str, path: str) -> str:
    return f"{root}\0{path}"


class PathDigests:
    """A set of paths held as 64-bit digests in one sorted array (8 bytes a member, not a
    Python string in a hash set): a set of paths the size of a cache. Members come in
    unsorted and are sorted in runs and merged at the first question after (or `freeze`,
    before threads read it); a path never added is taken for one once in 2**64 / n."""

    _RUN = 16_384  # digests sorted as Python ints at once, then merged

    def __init__(self) -> None:
        self._sorted = array("q")
        self._new = array("q")

    def add(self, path: object) -> None:
        self._new.append(hash(path))

    def update(self, other: PathDigests) -> None:
        self._new.extend(other._sorted)
        self._new.extend(other._new)

    def freeze(self) -> None:
        if self._new:
            runs = [self._sorted] + [array("q", sorted(self._new[i:i + self._RUN]))
                                     for i in range(0, len(self._new), self._RUN)]
            self._new = array("q")
            self._sorted = array("q", heapq.merge(*runs))

    def __contains__(self, path: object) -> bool:
        self.freeze()
        h = hash(path)
        k = bisect_left(self._sorted, h)
        return k < len(self._sorted) and self._sorted[k] == h


class MovedPaths:
    """A prune run's paths with a done record (`PruneRun.moved`), as digests: a path
    `returned` (put back by the run itself: few, kept as they are) is left out until
    moved again."""

    def __init__(self) -> None:
        self.paths = PathDigests()
        self.returned: set[str] = set()

    def add(self, path: str) -> None:
        self.paths.add(path)
        self.returned.discard(path)

    def discard(self, path: str) -> None:
        self.returned.add(path)

    def __contains__(self, path: object) -> bool:
        return path in self.paths and path not in self.returned


@dataclass
class _RunIndex:
    """Where one prune run's intents are in its journal file (their frames' offsets) and
    its done records (`MovedPaths`): the run read again frame by frame, either way round."""

    path: str
    intents: list[int] = field(default_factory=list)
    moved: MovedPaths = field(default_factory=MovedPaths)
    loaded: list[dict[str, Any]] | None = None  # a format-1 journal's intents (no frames to come back to)

    def items(self, backwards: bool = False) -> Iterator[dict[str, Any]]:
        """The run's intent items in journal order, or backwards (a run journals each
        path once: `PruneRun.moves` of it)."""
        if self.loaded is not None:
            yield from reversed(self.loaded) if backwards else self.loaded
            return
        for offset in reversed(self.intents) if backwards else self.intents:
            for rec in jn.frame_records(self.path, offset)[::-1] if backwards else jn.frame_records(self.path, offset):
                if rec.get("t") == "intent":
                    items = rec.get("items", [])
                    yield from reversed(items) if backwards else items


def _indexed_runs(journal: str) -> Iterator[tuple[PruneRun, _RunIndex]]:
    """The prune runs of `journal`, newest first, each with its `_RunIndex` (read when
    its turn comes)."""
    runs = []
    for f in jn.journal_files(journal):
        runs += [(run, f, k) for k, run in enumerate(load_prune_runs(f, moves=False))]
    for run, f, k in sorted(runs, key=lambda e: float(e[0].header.get("time") or 0), reverse=True):
        yield run, _index(run, f, k)


def _index(run: PruneRun, path: str, k: int) -> _RunIndex:
    """The `_RunIndex` of the k-th run of a journal file."""
    index = _RunIndex(path)
    runs = -1
    framed = False
    for offset, rec in jn.iter_framed(path):
        framed = True
        t = rec.get("t") if isinstance(rec, dict) else None
        if t == "header":
            runs += 1
        if runs != k:
            continue
        if t == "intent" and (not index.intents or index.intents[-1] != offset):
            index.intents.append(offset)
        elif t == "done" and rec.get("kind") == "returned":
            index.moved.discard(str(rec.get("path")))
        elif t == "done" and rec.get("kind") != "rmdirs" and rec.get("kind") != "mc_retire" \
                and isinstance(rec.get("path"), str):
            index.moved.add(rec["path"])
    if not framed:  # format 1: the run as `load_prune_runs` keeps it
        full = load_prune_runs(path)[k]
        index.loaded = list(full.moves.values())
        index.moved = MovedPaths()
        for p in full.moved:
            index.moved.add(p)
    return index


def _put_back(tree: DestTree, item: dict[str, Any], way: WayBack, result: RestoreResult, known: set[str]) -> None:
    """Act on one file's WayBack: link it back from its source (then drop the quarantine
    name), making the folders it needs; never over a name that exists (link, not rename)."""
    if way.state == "in_place":
        result.already_in_place += 1
        if way.source:
            tree.unlink(way.source)  # a kill between link and unlink left both names
        return
    if way.state in ("conflict", "lost"):
        if way.why is not None:  # (a conflict or a loss always says why)
            result.kept.append(way.why)
        if way.state == "conflict" and way.source:
            result.conflicts += 1
        return
    if way.state == "not_moved" or way.source is None:  # (quarantine, target: always the name to link from)
        return
    path = item["path"]
    try:
        result.dirs_made += makedirs(tree, path.rpartition("/")[0], known)
        spfd, sname = tree.split(way.source)
        dpfd, dname = tree.split(path)
        os.link(sname, dname, src_dir_fd=spfd, dst_dir_fd=dpfd, follow_symlinks=False)
        if way.state == "quarantine":
            os.unlink(sname, dir_fd=spfd)
    except FileExistsError:
        result.kept.append(f"{tree.abspath(path)}: re-created while restoring; conflict, not overwritten")
        result.conflicts += 1
        return
    except OSError as exc:
        result.kept.append(f"{tree.abspath(path)}: cannot restore: {exc.strerror or exc}")
        return
    result.restored += 1


def _remove_empty(tree: DestTree, reldir: str) -> None:
    """Remove the empty folders of a run's quarantine, deepest first."""
    base = tree.abspath(reldir)
    for dirpath, _, _ in os.walk(base, topdown=False):  # a folder after everything under it
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
    dry_run: bool = False

    @property
    def exit_code(self) -> int:
        """8 when something could not be deleted; a dry run: 1 when a quarantine holding
        files would be purged; else 0 (nothing to do is no finding; interface.md §4)."""
        return EXIT_OPERATIONAL if self.failed else 1 if self.dry_run and self.runs else 0

    def to_dict(self, root: str) -> PurgeOutput:
        return {"root": root, "dry_run": self.dry_run,
                "purged_runs": self.runs, "files": self.files, "freed_bytes": self.freed_bytes,
                "kept_young_runs": self.young, "failed": self.failed, "exit_code": self.exit_code}


def purge(root: str, older_than: float, *, now: float | None = None, dry_run: bool = False) -> PurgeResult:
    """Delete the quarantines of prune runs older than `older_than` seconds for real. The
    purge is journaled first (`purge`), so a killed purge is finished by a rerun and a
    restore of that run says what is gone."""
    root = os.path.abspath(root)
    now = time.time() if now is None else now
    result = PurgeResult(dry_run=dry_run)
    crash = _CrashSeam()
    jdir = prune_journal_dir(root)
    if not os.path.isdir(jdir) or not any(jn.is_journal_name(f) for f in os.listdir(jdir)):
        return result
    for run in load_prune_runs(jdir, moves=False):
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
        if not files:  # a restore emptied it (or it never held a file): nothing to purge
            if not dry_run and os.path.isdir(qpath):
                with DestTree(root) as tree:
                    _remove_empty(tree, run.quarantine)
            continue
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

            def note(fn: Any, p: str, exc: tuple[Any, BaseException, Any], errors: list[str] = errors) -> None:
                errors.append(f"{p}: {exc[1]}")

            shutil.rmtree(qpath, onerror=note)
            if errors and os.path.exists(qpath):
                result.failed += errors[:10]
                continue
            w.write({"t": "purged", "time": time.time(), "files": files, "freed_bytes": freed}, sync=True)
        finally:
            w.close()
    return result


def _count(path: str) -> tuple[int, int]:
    """(files, bytes whose every name is in the quarantine) under a quarantine folder:
    the bytes its removal frees (`prune.frees`: two quarantined names of one inode free it).
    A file of one name frees its bytes as it is walked; only the inodes of several names
    are kept, as four compact integer columns, and tallied in Arrow at the end."""
    files = freed = 0
    linked = _Inodes()
    for st in _file_stats(path):
        files += 1
        if st.st_nlink <= 1:
            freed += st.st_size if frees(st.st_nlink, 1) else 0
        else:
            linked.add(st)
    return files, freed + linked.freed()


def _file_stats(path: str) -> Iterator[os.stat_result]:
    """The lstat of every file under `path` (what `os.walk` lists as files: not a folder,
    nor a symlink to one), one open folder listing per depth instead of each folder's
    names in lists (a quarantine's block folders are many at one level)."""
    try:
        listing = os.scandir(path)
    except OSError:
        return
    with listing:
        for entry in listing:
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            if is_dir:
                if not entry.is_symlink():
                    yield from _file_stats(entry.path)
                continue
            try:
                yield os.lstat(entry.path)
            except OSError:
                continue


class _Inodes:
    """(dev, inode, nlink, size) of the multiply-linked files walked, 32 bytes each: up to
    HELD of them in memory, beyond that in PARTS files by inode in a working folder (TMPDIR),
    tallied a part at a time (every name of an inode is in one part), so a quarantine of
    10M files is counted in tens of MiB."""

    HELD = 1 << 18
    PARTS = 64

    def __init__(self) -> None:
        self.cols = tuple(array("Q") for _ in range(4))
        self.folder: str | None = None

    @property
    def n(self) -> int:
        """The inodes held."""
        return len(self.cols[0])

    def add(self, st: os.stat_result) -> None:
        for col, v in zip(self.cols, (st.st_dev, st.st_ino, st.st_nlink, st.st_size)):
            col.append(v)
        if self.n >= self.HELD:
            self._spill()

    def _spill(self) -> None:
        """The held inodes appended to their parts' files, as (dev, ino, nlink, size) words."""
        from kvmigrate import scratch

        with scratch.writing(self.folder, "the purge's list of hard-linked files",
                             "32 bytes a file of the quarantine with another name"):
            try:
                if self.folder is None:
                    self.folder = scratch.make("purge")
                with contextlib.ExitStack() as files:
                    parts = [files.enter_context(open(os.path.join(self.folder, f"part{k}"), "ab"))
                             for k in range(self.PARTS)]
                    for dev, ino, nlink, size in zip(*self.cols):
                        parts[ino % self.PARTS].write(_WORDS.pack(dev, ino, nlink, size))
            except OSError as exc:
                raise scratch.CannotWrite(exc) from exc
        self.cols = tuple(array("Q") for _ in range(4))

    def freed(self) -> int:
        """The bytes of the inodes whose every name was walked, each inode once."""
        if self.folder is None:
            return _freed(self.cols)
        try:
            self._spill()
            total = 0
            for k in range(self.PARTS):
                path = os.path.join(self.folder, f"part{k}")
                words = array("Q")
                with open(path, "rb") as f:
                    words.frombytes(f.read())
                total += _freed(tuple(words[i::4] for i in range(4)))
            return total
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


_WORDS = struct.Struct("=4Q")


def _freed(cols: tuple[array, ...]) -> int:
    """The bytes of the inodes of (dev, ino, nlink, size) columns whose every name is in
    them, each inode once (`frees`)."""
    if not cols[0]:
        return 0
    import pyarrow as pa
    import pyarrow.compute as pc

    t = pa.table({k: pa.array(col, pa.uint64()) for k, col in zip(("dev", "ino", "nlink", "size"), cols)})
    g = t.group_by(["dev", "ino"]).aggregate([("nlink", "max"), ("size", "max"), ([], "count_all")])
    # (`frees`: every name of the inode among the walked ones)
    mask = pc.less_equal(g["nlink_max"], pc.cast(g["count_all"], pa.uint64()))
    return int(pc.sum(pc.filter(g["size_max"], mask)).as_py() or 0)


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
    young = f"; {plural(result.young, 'younger run')} kept" if result.young else ""
    if not result.runs:
        lines = [f"nothing to purge under {os.path.join(root, QUARANTINE_DIR)}{young}"]
    else:
        lines = [f"{verb} {plural(len(result.runs), 'quarantine')} under {os.path.join(root, QUARANTINE_DIR)}: "
                 f"{plural(result.files, 'file')}, {human_bytes(result.freed_bytes)} freed{young}"]
    lines += [f"  failed: {f}" for f in result.failed]
    return "\n".join(lines)

