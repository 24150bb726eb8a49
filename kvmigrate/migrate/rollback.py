"""Undo a migration from its journal (migration.md §3.5): remove exactly what it created.

Order: block files whose identity still matches the journal (a hard link: inode, size and
mtime, the source's own file, so no read; a written file: inode, size and hash); then
config.json files it created that are unchanged; then its own temp files and the
namespace lock; then the folders it created, deepest first, if empty. The lock goes
before the folders only because it sits inside the target base folder (spec order
otherwise). Anything that no longer matches is kept and reported (exit 8): a file
someone changed or replaced after the migration is not ours to delete. Paths come from
the journal and are checked like manifest paths; removal happens through O_NOFOLLOW
directory fds under the journal's destination root, by worker threads (a chunk of files
or folders per task: the disk, not the CPU, is what a removal waits for; an rmdir waits
for its block's discard, so folders have more in flight). The journal is read once.

`dry_run=True` makes the same checks and removes nothing: it counts what would go per
namespace and lists it as shell commands (`rm -f --`, `rmdir --`) a person can review
and run (folders only where they would be empty).

Before any of that, `decide` (one decision for the rollback, its dry run and its list)
reads what a prune moved out of the migrations' sources: it is put back first, or, if any
cannot come back, the rollback refuses and removes nothing (migration.md §6).
"""

from __future__ import annotations

import errno
import glob
import heapq
import json
import os
import shlex
import stat
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvmigrate import families, layout, scratch
from kvmigrate.errors import EXIT_OPERATIONAL, OperationalError
from kvmigrate.migrate import journal as jn
from kvmigrate.migrate.fsops import DestTree, SymlinkInPath, check_relpath
from kvmigrate.migrate.lock import NamespaceLock, lock_relpath
from kvmigrate.migrate.prune import KIND as PRUNE_KIND
from kvmigrate.migrate.prune import prune_journal_dir
from kvmigrate.migrate.quarantine import PruneRun, load_prune_runs, note_prune_record
from kvmigrate.migrate.reconcile import reconcile_item
from kvmigrate.migrate.restore import MovedPaths, PathDigests, WayBack, restore, restore_runs, way_back
from kvmigrate.migrate.runs import claimed_by_others, targets_of_others
from kvmigrate.selection import Selection, journal_bases
from kvmigrate.units import plural

if TYPE_CHECKING:  # the JSON models are types only (kvmigrate.outputs)
    from kvmigrate.outputs import RollbackOutput

_THREADS = 8  # file removals in flight (each waits on the filesystem's journal, not the CPU)
# folder removals in flight: an rmdir frees the folder's block, and on a filesystem mounted
# with `discard` it waits for that block's discard (ext4_free_blocks -> blkdev_issue_discard,
# 0.1-1 ms each here); more in flight, not a faster loop, is what helps. The 99,483 folders
# of a 100,000-block migration on the shared 2-core VM (load 9-15): 8 threads 13.0 and 14.1 s,
# 32 threads 9.3-9.5 s, 64 threads 8.5 s (no better than 32 within the noise, twice the fds)
_DIR_THREADS = 32
_CHUNK = 256  # records per worker task at most (fewer when a level has few: every worker gets some)
_WORKER_FDS = 16  # folder fds a worker keeps: its paths are consecutive (40 workers x 16 < 1024, ulimit -n)
_BATCH = 4_096  # records checked (and removed) at once: what a removal holds, whatever the journal's size
_SORT_RUN = 8_192  # journal records sorted in memory at once; longer journals merge sorted temporary files
# sorted temporary files open at once: at this many they are merged into one (a 10M-record
# journal is ~1,200 runs, more than the usual 1,024 open files)
_MERGE_FAN_IN = 256
KINDS = ("block", "config", "temp", "lock", "dir")


@dataclass
class RollbackResult:
    removed: Counter = field(default_factory=Counter)  # kind -> count (dry run: would be removed)
    restored: int = 0  # pruned source files put back first (dry run: would be)
    already_gone: int = 0
    kept: list[str] = field(default_factory=list)  # could not / must not be removed, with why
    notes: list[str] = field(default_factory=list)
    journals: list[str] = field(default_factory=list)
    dry_run: bool = False
    per_namespace: dict[str, Counter] = field(default_factory=dict)  # target base folder -> kind -> count
    commands: Lines | None = None  # dry run with listing: the removals as shell commands

    @property
    def exit_code(self) -> int:
        return EXIT_OPERATIONAL if self.kept else 0

    def to_dict(self) -> RollbackOutput:
        return {"dry_run": self.dry_run, "removed": dict(self.removed), "restored": self.restored,
                "already_gone": self.already_gone,
                "kept": self.kept, "notes": self.notes, "journals": self.journals,
                "per_namespace": {ns: dict(c) for ns, c in sorted(self.per_namespace.items())},
                "exit_code": self.exit_code}


def rollback(journal: str, selection: Selection | None = None, *, dry_run: bool = False,
             listing: bool = False) -> RollbackResult:
    """Python API: roll back every run of a journal file or directory (newest first).
    `selection` (--only/--exclude): only the targets it keeps; the journal is then not
    marked rolled back (a later rollback without it removes the rest). `dry_run`: check
    and count only; `listing` also keeps the shell commands. The pruned sources are put
    back first, or the rollback refuses: `decide` says which, for all three alike."""
    result = RollbackResult(dry_run=dry_run, commands=Lines() if listing else None)
    files = jn.journal_files(journal)
    # the runs' states: what each created is read from its journal when it is removed
    loaded = {path: jn.stream_runs(path) for path in files}
    decision = decide(journal, files, loaded, selection)
    if decision.refusal is not None:
        raise decision.refusal
    decision.put_back(result)
    for path in reversed(files):
        runs = loaded.pop(path)
        if all(r.rolled_back for r in runs):
            result.notes.append(f"{path}: already rolled back")
            continue
        result.journals.append(path)
        undone: set[str] = set()  # the targets a selection rolled back
        for run in reversed(runs):
            if not run.rolled_back:
                if selection:
                    undone |= journal_bases(run.targets, selection)
                _rollback_run(run, result, selection, files, decision.sources_now(dry_run))
                if not selection:  # a Mooncake store's work: its indexes' originals back, its KVEntries gone
                    _rollback_stores(run, result)
        if selection:
            result.notes.append(f"{path}: rolled back the targets matching {selection.flags()} only; the journal "
                                "stays usable for the rest")
            if not dry_run and undone:
                _append_rolled_back(path, result, sorted(undone))
            continue
        if not dry_run:
            _append_rolled_back(path, result)
    return result


# --- before anything goes: the sources a prune moved ------------------------------------------


@dataclass
class Decision:
    """What a rollback does before it removes a target, decided once for `rollback`, its
    `--dry-run` and its `--list` (migration.md §6): the files a prune moved out of the
    migrations' source namespaces come back first (from the quarantine, or linked from
    their target, a hard link of them), or, when any cannot (purged, or its path re-created
    meanwhile), the rollback refuses, removing nothing: the targets may hold the last copy."""

    roots: dict[str, set[str]] = field(default_factory=dict)  # root -> source namespaces a prune touched
    back: list[WayBack] = field(default_factory=list)  # to link back, in restore's order
    script: list[str] = field(default_factory=list)  # the same as shell commands (--list)
    refusal: OperationalError | None = None

    def sources_now(self, dry_run: bool) -> dict[str, str]:
        """Where each pruned source is while a dry run looks (nothing was put back): its
        quarantine name, or the target that links it; the real run has put them back."""
        return {} if not dry_run else {w.path: w.source for w in self.back if w.source}

    def put_back(self, result: RollbackResult) -> None:
        """Restore (in a dry run: count and list) what the decision found."""
        if result.dry_run:
            result.restored = len(self.back)
            if result.commands is not None:
                result.commands += self.script
            return
        for root, namespaces in sorted(self.roots.items()):
            restored = restore(prune_journal_dir(root), namespaces=namespaces)
            if restored.kept:  # changed since the decision: still no target removed
                raise OperationalError(
                    f"{len(restored.kept)} pruned source file(s) could not be put back (first: {restored.kept[0]}); "
                    "no target was removed", path=restored.journals[0] if restored.journals else root,
                    hint="see why above, then rerun the rollback")
            result.restored += restored.restored
            if restored.restored:
                result.notes.append(f"first restored {restored.restored} pruned source file(s) from "
                                    f"{', '.join(restored.journals)}")


def decide(journal: str, files: list[str], loaded: dict[str, list[jn.Run]],
           selection: Selection | None) -> Decision:
    """The one decision of `rollback`, `--dry-run` and `--list` (same refusals, counts and
    exit code): every prune intent of the selected targets' source namespaces, read as
    `restore` reads it (`way_back`), without a write. `loaded`: runs already read; the
    other journals are read for their states only."""
    decision = Decision()
    targets_of: dict[tuple[str, str], set[str]] = defaultdict(set)  # (root, source) -> target bases
    selected: set[str] = set()
    for path in files:
        for run in loaded.get(path) or jn.load_runs(path, paths=False):
            if run.rolled_back:
                continue
            for base in journal_bases(run.targets, selection) if selection else set(run.targets):
                selected.add(base)
                for source in run.targets[base].get("sources") or ():
                    targets_of[(run.root, source)].add(base)
    by_root: dict[str, set[str]] = defaultdict(set)
    for root, source in targets_of:
        by_root[root].add(source)
    for path in files:  # a Mooncake store's work: the namespaces of its store a prune touched are its sources
        for run in loaded.get(path) or jn.load_runs(path, paths=False):
            if run.stores and not run.rolled_back and not selection:
                by_root[run.root] |= _store_namespaces(run.root, run.stores)
    lost: list[tuple[str, WayBack]] = []  # (its source namespace, way)
    conflicts: list[WayBack] = []
    residue = 0
    for root, namespaces in sorted(by_root.items()):
        jdir = prune_journal_dir(root)
        if not os.path.isdir(jdir) or not any(jn.is_journal_name(f) for f in os.listdir(jdir)):
            continue
        owned = PathDigests()  # (root, path) a newer run moved
        for prune_run, items in _prune_runs(jdir, namespaces):
            with DestTree(prune_run.root) as tree:
                # in restore's order: the moves backwards (a GDS data file before its sidecar);
                # a file back in place (no quarantine name left) is held by none of what follows
                ways = []
                claims = PathDigests()
                some = False
                for item in items():
                    if (prune_run.root, item["path"]) in owned:
                        continue
                    some = True
                    decision.roots.setdefault(root, set()).update(namespaces)
                    way = way_back(tree, prune_run, item)
                    if way.state != "not_moved":  # (restore.claimed)
                        claims.add((prune_run.root, item["path"]))
                    if way.state != "in_place" or way.source:
                        ways.append((item, way))
                if not some:
                    continue
                ways.reverse()
                owned.update(claims)
                for item, way in ways:
                    if way.state in ("quarantine", "target"):
                        decision.back.append(way)
                    elif way.state == "conflict":
                        conflicts.append(way)
                    elif way.state == "lost" and item.get("class") == "residue":
                        residue += 1  # a temp leftover or crash residue: nothing of value
                    elif way.state == "lost":
                        lost.append((item.get("ns") or "", way))
                decision.script += _restore_script(tree, prune_run, ways)
    if residue:
        decision.script.insert(0, f"# {residue} pruned residue file(s) (temp leftovers, zero-filled or short "
                                  "files) went with a purged quarantine: nothing of value")
    if lost or conflicts:
        gone = {ns for ns, _ in lost}
        held = sorted({b for (_, source), bases in targets_of.items() if source in gone for b in bases})
        decision.refusal = _refusal(journal, selection, lost, conflicts, held, sorted(selected - set(held)))
    return decision


def _prune_runs(jdir: str, namespaces: set[str]) -> Iterator[tuple[PruneRun, Callable[[], Iterator[dict]]]]:
    """`restore_runs(jdir, namespaces)` read as a stream: the prune runs, newest first,
    as `load_prune_runs` reads them but without their intents (`moves` stays empty,
    `moved` is digests), each with its intent items of `namespaces` (one a path, as
    `PruneRun.moves` holds them), read again from its journal when called."""
    runs: list[tuple[PruneRun, str, int, int]] = []  # (run, file, header position, next header's)
    for path in jn.journal_files(jdir):
        here: list[tuple[PruneRun, int]] = []
        for pos, rec in enumerate(jn.iter_records(path, linked=False)):
            t = rec.get("t")
            if t == "header":
                if rec.get("kind") != PRUNE_KIND or not isinstance(rec.get("root"), str):
                    load_prune_runs(path)  # says why it is not a prune journal
                here.append((PruneRun(path, jn.rebased(rec, path), moved=MovedPaths()), pos))  # type: ignore[arg-type]
                continue
            note_prune_record(here[-1][0], rec, items=False, moved=True)
        ends = [pos for _, pos in here[1:]] + [-1]
        runs += [(run, path, pos, end) for (run, pos), end in zip(here, ends)]

    def intents(path: str, start: int, end: int) -> Callable[[], Iterator[dict]]:
        def items() -> Iterator[dict]:
            for pos, rec in enumerate(jn.iter_records(path, linked=False)):
                if pos == end:
                    return
                if pos > start and rec.get("t") == "intent":
                    yield from (i for i in rec.get("items", []) if i.get("ns") in namespaces)
        return lambda: jn.last_per_path(items)

    for run, path, start, end in sorted(runs, key=lambda r: float(r[0].header.get("time") or 0), reverse=True):
        yield run, intents(path, start, end)


def _store_namespaces(root: str, stores: set[str]) -> set[str]:
    """The namespaces of these stores that prune runs of `root` moved files of: a store's
    own (`mooncake:<store>`) and its deployments' (`mooncake:<store>:...`)."""
    from kvmigrate.families.mooncake import store_label

    jdir = prune_journal_dir(root)
    if not os.path.isdir(jdir) or not any(jn.is_journal_name(f) for f in os.listdir(jdir)):
        return set()
    labels = {store_label(s) for s in stores}
    return {str(i.get("ns")) for _, items in restore_runs(jdir) for i in items
            if i.get("ns") in labels or any(str(i.get("ns") or "").startswith(label + ":") for label in labels)}


def _restore_script(tree: DestTree, run: Any, ways: list[tuple[dict, WayBack]]) -> list[str]:
    """`restore`'s steps for one prune run as shell commands: make the folder a file
    needs, link it back from its source (`ln` fails on an existing name: never over one),
    drop its quarantine name; then remove the run's quarantine folders left empty."""
    q = shlex.quote
    lines: list[str] = []
    made: set[str] = set()
    gone: set[str] = set()  # quarantine names these steps remove
    for _, way in ways:
        if way.state == "in_place" and way.source:  # both names (a kill between link and unlink)
            gone.add(tree.abspath(way.source))
            lines.append(f"rm -f -- {q(tree.abspath(way.source))}")
        if way.state not in ("quarantine", "target") or way.source is None:  # (those two: always a source)
            continue
        parent = way.path.rpartition("/")[0]
        if parent and parent not in made and not os.path.isdir(tree.abspath(parent)):
            lines.append(f"mkdir -p -- {q(tree.abspath(parent))}")
        made.add(parent)
        lines.append(f"ln -- {q(tree.abspath(way.source))} {q(tree.abspath(way.path))}")
        if way.state == "quarantine":
            gone.add(tree.abspath(way.source))
            lines.append(f"rm -f -- {q(tree.abspath(way.source))}")
    if run.quarantine and os.path.isdir(tree.abspath(run.quarantine)):
        empty: dict[str, bool] = {}
        for d, subdirs, names in os.walk(tree.abspath(run.quarantine), topdown=False):
            empty[d] = all(os.path.join(d, n) in gone for n in names) and \
                all(empty.get(os.path.join(d, sub), False) for sub in subdirs)
            if empty[d]:
                lines.append(f"rmdir -- {q(d)}")
    return lines


def _refusal(journal: str, selection: Selection | None, lost: list[tuple[str, WayBack]], conflicts: list[WayBack],
             held: list[str], others: list[str]) -> OperationalError:
    """Why nothing is rolled back, and what to do instead: never a command that removes
    the last copy of a block, never a restore of a purged quarantine."""
    said, hints = [], []
    if lost:
        said.append(f"{len(lost)} of them cannot be put back (first: {lost[0][1].why})")
        kept = held or sorted({ns for ns, _ in lost})  # (a Mooncake store's work has no target folder: its namespaces)
        keep = f"keep {', '.join(kept)}: the migration into {'it' if len(kept) == 1 else 'them'} cannot be undone " \
               "any more (the pruned sources are gone)"
        if others:
            command = " ".join(["kvmigrate rollback", shlex.quote(os.path.abspath(journal)),
                                *([selection.flags()] if selection else []),
                                *(f"--exclude {shlex.quote(glob.escape(b))}" for b in held)])
            keep += f"; roll back the other targets with `{command}`"
        hints.append(keep)
    if conflicts:
        said.append(f"{len(conflicts)} cannot go back since their path was re-created (first: {conflicts[0].why})")
        hints.append("move the re-created files aside, then rerun the rollback: it puts the pruned files back first")
    why = "the targets hold the last copy of those blocks" if lost else "their targets may hold the last copy"
    return OperationalError(f"files of this migration's sources were pruned and {'; '.join(said)}; nothing was "
                            f"rolled back (nothing removed, nothing restored): {why}", hint="; ".join(hints))


class _Removal:
    """One run's removals under its destination root: the checks and (unless a dry
    run) the unlink/rmdir, folder by folder in worker threads; counts per namespace."""

    def __init__(self, run: jn.Run, tree: DestTree, result: RollbackResult):
        self.tree = tree
        self.result = result
        self.dry = result.dry_run
        self.ns_of = {}  # first path component -> target base folder
        for base, rec in run.targets.items():
            self.ns_of[base] = base
            if isinstance(rec.get("rank_dir"), str):
                self.ns_of[rec["rank_dir"]] = base
        self.gone = PathDigests()  # dry run: paths that would be removed (for folder emptiness)

    def namespace(self, relpath: str, intended: str | None = None) -> str:
        """The target a path counts under: its folder's, or the one its intent names
        (`intended`: a flat target's files have no folder)."""
        top = relpath.split("/", 1)[0]
        return self.ns_of.get(top) or intended or top

    def count(self, kind: str, relpath: str, intended: str | None = None) -> None:
        self.result.removed[kind] += 1
        self.result.per_namespace.setdefault(self.namespace(relpath, intended), Counter())[kind] += 1
        if self.dry:
            self.gone.add(relpath)
            if self.result.commands is not None:
                cmd = "rmdir" if kind == "dir" else "rm -f"
                self.result.commands.append(f"{cmd} -- {shlex.quote(self.tree.abspath(relpath))}")

    def files(self, recs: Iterable[dict[str, Any]], kind: str, *, ordered: bool = False) -> None:
        """Check and remove files in path order (so each worker's folder fds are reused);
        `ordered`: `recs` come in path order already (read from the journal, a batch at a time)."""
        check = lambda tree, rec: _check_file(tree, rec, self.dry)  # noqa: E731
        for batch in _batches(recs if ordered else sorted(recs, key=lambda r: r["path"])):
            self._in_threads(batch, check, kind, _THREADS)

    def dirs(self, levels: Callable[[int], Iterable[dict[str, Any]]], deepest: int) -> None:
        """Remove folders deepest first, if empty (dry run: if all they hold would go).
        `levels(depth)`: the folders of a depth, in path order, each once. Each level's
        workers are done (and their fds closed) before the next level starts, so no fd
        of a folder about to go is open: an rmdir needs no `forget`."""
        self.tree.forget("")
        for depth in range(deepest, -1, -1):
            for batch in _batches(levels(depth)):
                self.gone.freeze()  # (read by the workers: settled before they start)
                self._in_threads(batch, self._rmdir, "dir", _DIR_THREADS)

    def _rmdir(self, tree: DestTree, rec: dict[str, Any]) -> tuple[str, str | None]:
        path = rec["path"]
        try:
            if self.dry:
                st = tree.lstat(path)
                if st is None:
                    return "gone", None
                if not stat.S_ISDIR(st.st_mode):
                    return "kept", f"{tree.abspath(path)}: no longer a folder; left in place"
                pfd, name = tree.split(path)
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=pfd)
                try:
                    left = [e for e in os.listdir(fd) if f"{path}/{e}" not in self.gone]
                finally:
                    os.close(fd)
                if left:
                    raise OSError(errno.ENOTEMPTY, "not empty")
            else:
                pfd, name = tree.split(path)
                os.rmdir(name, dir_fd=pfd)
            return "removed", None
        except FileNotFoundError:
            return "gone", None
        except (SymlinkInPath, NotADirectoryError):
            return "kept", f"{tree.abspath(path)}: a parent folder is now a symlink or file; not touched"
        except OSError as exc:
            if exc.errno == errno.ENOTEMPTY:
                return "kept", (f"{tree.abspath(path)}: folder not empty (holds files this migration did not "
                                "create, or kept ones listed above); left in place")
            return "kept", f"{tree.abspath(path)}: cannot remove folder: {exc.strerror}"

    def _in_threads(self, recs: list[dict[str, Any]], check, kind: str, threads: int) -> None:
        """`check(tree, record)` for every record, by `threads` workers each with its own
        DestTree (O_NOFOLLOW folder fds, not shared), a chunk of consecutive records per
        task (at most `_CHUNK`, about four per worker when there are few); then the
        outcomes are tallied in record order."""
        if not recs:
            return
        size = max(1, min(_CHUNK, len(recs) // (4 * threads)))
        trees: list[DestTree] = []
        local = threading.local()

        def task(chunk: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
            tree = getattr(local, "tree", None)
            if tree is None:
                tree = local.tree = DestTree(self.tree.root, max_fds=_WORKER_FDS)
                trees.append(tree)
            return [check(tree, rec) for rec in chunk]

        try:
            with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvmigrate-rollback") as pool:
                chunks = [recs[i:i + size] for i in range(0, len(recs), size)]
                outcomes = [out for chunk_out in pool.map(task, chunks) for out in chunk_out]
        finally:
            for tree in trees:
                tree.close()
        for rec, (what, why) in zip(recs, outcomes):
            if what == "removed":
                self.count(kind, rec["path"], rec.get("_intended"))
            elif what == "gone":
                self.result.already_gone += 1
            elif why is not None:  # kept: always says why
                self.result.kept.append(why)


def _rollback_run(run: jn.Run, result: RollbackResult, selection: Selection | None = None,
                  rolling: Iterable[str] = (), moved: dict[str, str] | None = None) -> None:
    """Remove what `run` (of `jn.stream_runs`) created; `rolling`: the journals this
    rollback undoes (their runs are not "other runs" whose files or targets must be
    left); `moved`: a dry run's pruned sources, not yet put back (source path -> the
    name holding it now). Its records are read from the journal in path order
    (`_Created`), a batch at a time."""
    rolling = {*rolling, run.journal}
    jn.resolve_flat(run)
    kept: set[str] | None = None
    if selection:  # the records of the kept targets only
        kept = journal_bases(run.targets, selection)
        run.targets = {b: r for b, r in run.targets.items() if b in kept}
        run.locks = [p for p in run.locks if _base_of(p) in kept]
    dest = run.dest
    if not os.path.isdir(dest):
        result.kept.append(f"{dest}: destination root of run {run.header.get('run_id')} is missing; nothing removed")
        return
    digests = {b: bytes.fromhex(r["digest"]) for b, r in run.targets.items() if r.get("digest")}
    with DestTree(dest) as tree, _Created(run, kept) as created:
        rm = _Removal(run, tree, result)
        locks = []
        bases = []
        left_locks: list[str] = []  # counted as the dry run counts them: removed on release
        try:
            for base in sorted({*(r.get("lock_dir", b) for b, r in run.targets.items()),
                                *(_base_of(p) for p in run.locks)}):
                if base:  # ("": a flat target's lock, in the destination directory itself)
                    check_relpath(base, "journal target")
                if base == "" or tree.lstat(base) is not None:
                    bases.append(base)
                    if not result.dry_run:
                        left = _exists(tree, lock_relpath(base))  # a lock file an interrupted run left
                        locks.append(NamespaceLock.acquire(tree, base, purpose="rollback"))
                        if left:
                            left_locks.append(base)
            created.read(tree)
            # never what another run journaled as its own (a link of the same source has
            # the inode this run's intent names), nor the config.json of a target another
            # run still fills (its blocks would be left without their identity)
            others = claimed_by_others(_journal_dirs(run), rolling, {item["path"] for item in created.pending}, dest)
            shared = targets_of_others(_journal_dirs(run), rolling, dest, [run.header.get("run_id")]) \
                & set(run.targets)
            for item in created.pending:
                if item["path"] in others:
                    continue
                adopted = reconcile_item(tree, run.root, item, digests, moved)
                if adopted is not None:
                    created.adopt({**adopted, "_intended": item.get("base")})
            configs = []
            for rec in created.configs:
                path = rec["path"]
                if run.target_of(path) in shared:
                    result.kept.append(f"{tree.abspath(path)}: another migration run (not rolled back) also fills "
                                       f"target {run.target_of(path)}: its blocks need this config.json; left in place")
                else:
                    configs.append(rec)
            # a file its engine reads only through another (a GDS sidecar) goes first, then the rest
            paired = any(families.get(t.get("family")).paired_files for t in run.targets.values())

            def first(rec: dict[str, Any]) -> bool:
                family = (run.targets.get(run.target_of(rec["path"]) or "") or {}).get("family")
                return paired and families.get(family).removed_first(rec["path"])

            if paired:
                rm.files((r for r in created.of_kind("block") if first(r)), "block", ordered=True)
            rm.files((r for r in created.of_kind("block") if not first(r)), "block", ordered=True)
            rm.files(configs, "config")
            rm.files([{"path": tmp, "temp": True} for tmp in created.temps], "temp")
            if result.dry_run:  # a lock file left by an interrupted run would go too
                rm.files([{"path": lock_relpath(b), "temp": True} for b in bases
                          if _exists(tree, lock_relpath(b))], "lock")
        finally:
            for lock in locks:  # a lock file left by an interrupted run goes too
                lock.release()
            for base in left_locks:
                if not _exists(tree, lock_relpath(base)):
                    rm.count("lock", lock_relpath(base))
        rm.dirs(lambda depth: (r for r in created.of_kind("dir") if r["path"].count("/") == depth), created.deepest)


class _Created:
    """What a run created, read from its journal in path order: its `done` records (the
    last of each path) and, of a path with an intent but no done record (an interrupted
    batch), the intent item (`pending`, adopted once `reconcile` proves it). The
    journal's records are sorted in runs of `_SORT_RUN` into temporary files and merged
    (an external sort); the blocks and folders are kept in one temporary file of JSON
    lines, read again for each kind and folder depth: what is held is a batch, the
    config.json files, the pending items and the existing temp files, not a record per
    block. A record carries the target its intent names (`_intended`)."""

    def __init__(self, run: jn.Run, kept: set[str] | None):
        self.run = run
        self.kept = kept  # the targets a selection keeps (None: all)
        self.pending: list[dict[str, Any]] = []  # in intent order
        self.configs: list[dict[str, Any]] = []  # in the order of their first done record, then adopted
        self.temps: list[str] = []  # temp files the intents name that are there, in intent order
        self.deepest = 0  # the deepest folder's depth
        self._spool = _temp_file()
        self._adopted: list[dict[str, Any]] = []

    def __enter__(self) -> _Created:
        return self

    def __exit__(self, *exc: object) -> None:
        self._spool.close()

    def read(self, tree: DestTree) -> None:
        """Sort the run's records by path and keep what each path is."""
        pending: list[tuple[int, dict[str, Any]]] = []
        configs: list[tuple[int, dict[str, Any]]] = []
        temps: list[tuple[int, str]] = []
        for path, group in _grouped(self._sorted_records()):
            intent = next((rec for _, what, rec in reversed(group) if what == "intent"), None)
            done = next((rec for _, what, rec in reversed(group) if what == "done"), None)
            if intent is not None:
                first = min(seq for seq, what, _ in group if what == "intent")
                tmp = intent.get("tmp")
                if tmp and layout.OWN_TMP_RE.search(tmp):
                    check_relpath(tmp, "journal temp path")
                    if _exists(tree, tmp):  # (an interrupted batch's: few)
                        temps.append((first, tmp))
                if done is None:
                    pending.append((first, intent))
            if done is None:
                continue
            kind = done.get("kind")
            if kind not in ("block", "config", "dir"):
                continue
            check_relpath(path, "journal path")
            rec = {**done, "_intended": intent.get("base") if intent is not None else None}
            if kind == "config":
                configs.append((min(seq for seq, what, _ in group if what == "done"), rec))
                continue
            if kind == "dir":
                self.deepest = max(self.deepest, path.count("/"))
            self._spool.write(json.dumps(rec) + "\n")
        self._spool.flush()
        self.pending = [item for _, item in sorted(pending, key=lambda e: e[0])]
        self.configs = [rec for _, rec in sorted(configs, key=lambda e: e[0])]
        self.temps = [tmp for _, tmp in sorted(temps, key=lambda e: e[0])]

    def _sorted_records(self) -> Iterator[tuple[str, int, str, dict[str, Any]]]:
        """(path, sequence, "intent" | "done", record) of the run's kept records, in path order."""
        run, kept = self.run, self.kept
        buf: list[tuple[str, int, str, dict[str, Any]]] = []
        runs: list[Any] = []
        try:
            for seq, (pos, what, rec) in enumerate(jn.path_records(run)):
                path = rec["path"]
                if run.drops or kept is not None:
                    target = run.target_of(path)
                    if run.drops and jn.dropped(run, pos, target) or kept is not None and target not in kept:
                        continue
                buf.append((path, seq, what, rec))
                if len(buf) >= _SORT_RUN:
                    runs.append(_spill(buf))
                    if len(runs) >= _MERGE_FAN_IN:  # (an open file per run: the runs so far become one)
                        runs = [_merged(runs)]
            buf.sort(key=lambda e: (e[0], e[1]))
            if not runs:
                yield from buf
                return
            runs.append(_spill(buf))
            yield from heapq.merge(*((tuple(json.loads(line)) for line in f) for f in runs),
                                   key=lambda e: (e[0], e[1]))
        finally:
            for f in runs:
                f.close()

    def adopt(self, rec: dict[str, Any]) -> None:
        """A pending item `reconcile` proved this run's output."""
        if rec.get("kind") == "config":
            self.configs.append(rec)
        elif rec.get("kind") in ("block", "dir"):
            check_relpath(rec["path"], "journal path")
            if rec["kind"] == "dir":
                self.deepest = max(self.deepest, rec["path"].count("/"))
            self._adopted.append(rec)
            self._adopted.sort(key=lambda r: r["path"])

    def of_kind(self, kind: str) -> Iterator[dict[str, Any]]:
        """The blocks or folders, in path order (each once)."""
        self._spool.seek(0)
        journaled = (json.loads(line) for line in self._spool)
        for rec in heapq.merge(journaled, self._adopted, key=lambda r: r["path"]):
            if rec.get("kind") == kind:
                yield rec


def _spill(buf: list[tuple[str, int, str, dict[str, Any]]]) -> Any:
    """A sorted run of records in a temporary file (emptied from `buf`), for the merge."""
    buf.sort(key=lambda e: (e[0], e[1]))
    f = _temp_file()
    for entry in buf:
        f.write(json.dumps(entry) + "\n")
    buf.clear()
    f.seek(0)
    return f


def _merged(runs: list[Any]) -> Any:
    """One sorted run of the sorted runs' records, in a temporary file; the runs closed."""
    f = _temp_file()
    try:
        for entry in heapq.merge(*runs, key=_run_key):
            f.write(entry)
    finally:
        for r in runs:
            r.close()
    f.seek(0)
    return f


def _run_key(line: str) -> tuple[str, int]:
    """A spilled entry's sort key: (path, sequence)."""
    path, seq, *_ = json.loads(line)
    return path, seq


def _grouped(entries: Iterable[tuple[str, int, str, dict[str, Any]]]) \
        -> Iterator[tuple[str, list[tuple[int, str, dict[str, Any]]]]]:
    """(path, its (sequence, what, record) entries) of path-ordered entries."""
    path: str | None = None
    group: list[Any] = []
    for p, seq, what, rec in entries:
        if p != path:
            if path is not None:
                yield path, group
            path, group = p, []
        group.append((seq, what, rec))
    if path is not None:
        yield path, group


def _temp_file() -> Any:
    """A temporary text file that keeps any path's characters and line ends as written
    (closed by its owner: it outlives the function that fills it)."""
    return tempfile.TemporaryFile("w+", encoding="utf-8", errors="surrogateescape", newline="\n",
                                  dir=scratch.tmpdir())


def _batches(recs: Iterable[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for rec in recs:
        batch.append(rec)
        if len(batch) >= _BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


class Lines:
    """Lines kept in a temporary file as they come and read back in order: a dry run's
    shell script (a line per file) on disk, not in memory."""

    def __init__(self) -> None:
        self._file = _temp_file()
        self._count = 0

    def append(self, line: str) -> None:
        self._file.write(line + "\n")
        self._count += 1

    def __iadd__(self, lines: Iterable[str]) -> Lines:
        for line in lines:
            self.append(line)
        return self

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[str]:
        self._file.flush()
        self._file.seek(0)
        for line in self._file:
            yield line[:-1]


def _rollback_stores(run: jn.Run, result: RollbackResult) -> None:
    """The store work of a run (migrate/store_undo.py): indexes restored, KVEntries removed."""
    from kvmigrate.migrate.store_undo import rollback_run

    done, kept = rollback_run(run, result.dry_run)
    for kind, n in done.items():
        if n:
            result.removed["block" if kind == "kventry" else kind] += n
    result.kept += kept
    work = {words: done[kind] for kind, words in STORE_WORK.items() if done.get(kind)}
    if result.commands is not None and work:  # (--list: said, never left out without a word)
        result.commands.append("")
        result.commands.append(
            f"# Mooncake store {', '.join(sorted(run.stores))}: {', '.join(f'{n} {k}' for k, n in work.items())} "
            "are not in this script: each removal needs the client lock rollback holds and its check of the "
            "journaled hash, and an index's original comes back from kvmigrate's backup by rename; run "
            f"`kvmigrate rollback {shlex.quote(run.journal)}`")


# what a Mooncake store's undo counts, in the words of --list's comment
STORE_WORK = {"kventry": "KVEntries to remove", "pair": "new pairs to remove", "index": "indexes to restore",
              "dir": "folders to remove", "lock": "lock files to remove"}


def _journal_dirs(run: jn.Run) -> list[str]:
    """Where the other runs of this root are journaled: the root's journal folder and the
    folder of this run's journal (a --journal elsewhere)."""
    return [jn.default_journal_dir(run.root), os.path.dirname(run.journal)]


def _exists(tree: DestTree, relpath: str) -> bool:
    try:
        return tree.lstat(relpath) is not None
    except (SymlinkInPath, NotADirectoryError):
        return False


def _base_of(lock_path: str) -> str:
    return lock_path.rsplit("/", 1)[0] if "/" in lock_path else ""



def _check_file(tree: DestTree, rec: dict[str, Any], dry: bool) -> tuple[str, str | None]:
    """("removed" | "gone" | "kept", why kept) for one journaled file."""
    path = rec["path"]
    where = tree.abspath(path)
    try:
        st = tree.lstat(path)
    except (SymlinkInPath, NotADirectoryError):
        return "kept", f"{where}: a parent folder is now a symlink or file; not touched"
    except OSError as exc:
        return "kept", f"{where}: cannot check it: {exc.strerror}; kept"
    if st is None:
        return "gone", None
    if not rec.get("temp"):
        why = _changed(tree, path, st, rec)
        if why:
            return "kept", f"{where}: {why}"
    if dry:
        return "removed", None
    try:
        tree.unlink(path)
        return "removed", None
    except FileNotFoundError:
        return "gone", None
    except OSError as exc:
        return "kept", f"{where}: cannot remove: {exc.strerror}"


def _changed(tree: DestTree, path: str, st: os.stat_result, rec: dict[str, Any]) -> str | None:
    """Why a journaled output is no longer what the migration made, or None."""
    if not stat.S_ISREG(st.st_mode) or st.st_ino != rec.get("ino") or st.st_dev != rec.get("dev", st.st_dev):
        return "replaced since the migration (inode differs); kept"
    if st.st_size != rec.get("size"):
        return f"size changed since the migration ({st.st_size} != {rec.get('size')}); kept"
    if rec.get("how") == "link" and "mtime_ns" in rec:
        # a hard link is the source's own inode: unchanged while its mtime is (the bytes
        # stay under the source name, so removing this name loses nothing): no read
        if st.st_mtime_ns != rec.get("mtime_ns"):
            return "modified since the migration (mtime differs); kept"
        return None
    try:
        have, _ = tree.hash(path)
    except OSError as exc:
        return f"cannot read to check it: {exc.strerror}; kept"
    if have.hex() != rec.get("xxh3_128"):
        return "content changed since the migration (hash differs); kept"
    return None


def _append_rolled_back(path: str, result: RollbackResult, targets: list[str] | None = None) -> None:
    """Mark the journal so a rerun of its command starts afresh instead of resuming; with
    `targets` (a rollback of those only), so that what its runs made there is forgotten."""
    try:
        w = jn.JournalWriter.append(path)
        w.write({"t": "rolled_back", "time": time.time(), "removed": dict(result.removed),
                 "kept": len(result.kept), **({"targets": targets} if targets is not None else {})}, sync=True)
        w.close()
    except OperationalError as exc:
        result.kept.append(f"{path}: cannot mark the journal as rolled back: {exc}")


def _counts(c: Counter) -> str:
    return (f"{plural(c.get('block', 0), 'block')}, {plural(c.get('config', 0), 'config.json', 'config.json files')}, "
            f"{plural(c.get('dir', 0), 'folder')}, {plural(c.get('temp', 0), 'temp file')}"
            + (f", {plural(c['lock'], 'lock file')}" if c.get("lock") else "")
            + (f"; put back the original of {plural(c['index'], 'Mooncake index', 'Mooncake indexes')}"
               if c.get("index") else ""))


def render(result: RollbackResult) -> str:
    if result.dry_run:
        lines = [f"rollback dry run of {plural(len(result.journals), 'journal')}: nothing was removed; it would remove "
                 f"{_counts(result.removed)}" + (f"; {result.already_gone} already gone" if result.already_gone else "")
                 + (f", after putting back {plural(result.restored, 'pruned source file')} (from the quarantine, or "
                    "linked from their target)" if result.restored else "")]
        for ns, c in sorted(result.per_namespace.items()):
            lines.append(f"  {ns}: {_counts(c)}")
    else:
        lines = [f"rolled back {plural(len(result.journals), 'journal')}: removed {_counts(result.removed)}"
                 + (f"; {result.already_gone} already gone" if result.already_gone else "")]
    lines += [f"  note: {n}" for n in result.notes]
    if result.kept:
        lines.append(f"{'would keep' if result.dry_run else 'kept'} {plural(len(result.kept), 'path')}:")
        lines += [f"  {k}" for k in result.kept]
    return "\n".join(lines)


def render_commands(result: RollbackResult, journal: str) -> Iterable[str]:
    """A dry run's removals as a POSIX shell script, in the order rollback removes
    them (files, then folders deepest first); what it would keep, as comments."""
    yield "#!/bin/sh"
    yield "set -e  # a step that fails stops the script: no target goes while its source is not back"
    yield f"# kvmigrate rollback --dry-run --list {shlex.quote(journal)}: nothing has been removed."
    if result.restored:
        yield (f"# First the {result.restored} pruned source file(s) go back (`kvmigrate restore`'s steps: ln never "
               "replaces a name), then the removals")
    yield "# The same removals by hand (without rollback's lock and its re-check just before each removal):"
    for ns, c in sorted(result.per_namespace.items()):
        yield f"#   {ns}: {_counts(c)}"
    for k in result.kept:
        yield f"# keep: {k}"
    yield from result.commands or []
