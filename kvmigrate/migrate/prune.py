"""`kvmigrate prune`: reclaim what no engine will read, reversibly (migration.md §7).

A prune plan is read from a manifest's typed columns (never its `reason` prose) and the
migration journals (through `journal.iter_runs`). Classes, each opt-in by name:

    migrated               legacy block files whose bytes the scan found at a target path
                           (`already_present`: the same inode, or the exact bytes the action
                           writes), their rank files (replicas proven equal by hash, parts
                           of a transform), and the namespace's config.json once nothing
                           else of it is left
    unreadable_namespaces  namespaces no target reads and no migration used, whole
    residue                engine temp files older than --older-than, zero_filled, short,
                           misfiled files

Never: an `ok` block not migrated, a target namespace (every `target_base` of the
manifest and of the journals), kvmigrate's own files, a file changed since the scan
(size, mtime, inode, dev, or a ctime after the scan), a namespace whose target is under
a held migration lock or that was written within the quiet period, anything outside
ROOT, a symlink (its target is never followed: every step goes through O_NOFOLLOW
folder fds of `fsops.DestTree`).

`apply_prune` moves each file into `ROOT/.kvmigrate/quarantine/<run>/<relpath>` by
rename (same inode, nothing copied), journaled write-ahead in its own journal
(`ROOT/.kvmigrate/journals/prune/<run>.jsonl`, beside, not among, the migration
journals); `restore.py` puts it back or purges it.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

from kvmigrate import findings, layout
from kvmigrate import manifest as mf
from kvmigrate.errors import EXIT_OPERATIONAL, OperationalError, UsageError
from kvmigrate.migrate import journal as jn
from kvmigrate.migrate.apply import _CrashSeam  # the kill -9 tests' seam (KVMIGRATE_CRASH_AT), shared
from kvmigrate.migrate.fsops import DestTree, SymlinkInPath, check_relpath
from kvmigrate.migrate.lock import NamespaceLock

CLASSES = ("migrated", "unreadable_namespaces", "residue")
QUARANTINE_DIR = os.path.join(layout.OWN_DIR, "quarantine")
PRUNE_JOURNALS_DIR = os.path.join(jn.JOURNALS_DIR, "prune")
KIND = "prune"  # the header's `kind`: a prune journal, not a migration's

# a namespace of one of these states is read by no target (formats.md §3, interface.md §2)
UNREADABLE_STATUSES = ("orphan_namespace", "digest_mismatch", "config_invalid", "unsupported_layout")
RESIDUE_STATUSES = ("zero_filled", "short", "misfiled")  # tmp_leftover too, when older than --older-than
MIGRATED_STATUSES = ("ok", "padded_legacy")  # a block the scan found placed at its target
DEFAULT_QUIET_PERIOD = 600.0  # seconds: a namespace written in the last 10 minutes is live
DEFAULT_RESIDUE_AGE = 3600.0  # engine temp files younger than 1 h may still be written
_BATCH = 4096  # files per intent record, and moves per fsync of their done records

_COLUMNS = ("relpath", "source_base", "deployment", "target_base", "status", "action", "finding", "primary_rank",
            "rank", "group", "block_hash", "size", "mtime_ns", "inode", "dev", "nlink", "content_xxh3_128",
            "payload_xxh3_128", "target_relpath")


def prune_journal_dir(root: str) -> str:
    return os.path.join(root, PRUNE_JOURNALS_DIR)


class Item(NamedTuple):
    """One file to move, with the stat the scan saw (re-checked before it moves) and, for
    a migrated block, the target path that keeps its bytes and that path's stat."""

    relpath: str
    cls: str
    namespace: str
    dev: int
    inode: int
    size: int
    mtime_ns: int
    nlink: int
    target: tuple[str, int, int, int, int] | None = None  # (relpath, dev, inode, size, mtime_ns)
    key: str = ""  # the block's rank files share it: they move together or not at all


@dataclass
class PrunePlan:
    root: str
    manifest: str
    classes: tuple[str, ...]
    items: list[Item]
    skipped: dict[str, str]  # namespace -> why nothing of it is pruned
    target_bases: set[str]
    emptied: set[str] = field(default_factory=set)  # namespaces pruned whole (their folders go too)
    locks: dict[str, set[str]] = field(default_factory=dict)  # target base -> source namespaces pruned into it
    scan_started_ns: int | None = None
    finished: list["PruneResult"] = field(default_factory=list)  # interrupted runs finished before the scan

    def totals(self) -> dict[str, dict[str, int]]:
        """Per class: files, bytes, bytes freed once purged (every name of the inode goes)
        and files unlinked only (another name, e.g. the target link, keeps the bytes)."""
        out = {c: {"files": 0, "bytes": 0, "freed_bytes": 0, "unlinked_files": 0} for c in self.classes}
        names = Counter((i.dev, i.inode) for i in self.items)
        for i in self.items:
            t = out[i.cls]
            t["files"] += 1
            t["bytes"] += i.size
            if i.nlink <= names[(i.dev, i.inode)]:
                t["freed_bytes"] += i.size
            else:
                t["unlinked_files"] += 1
        return out

    def by_namespace(self) -> dict[tuple[str, str], dict[str, int]]:
        out: dict[tuple[str, str], dict[str, int]] = {}
        for i in self.items:
            t = out.setdefault((i.cls, i.namespace), {"files": 0, "bytes": 0})
            t["files"] += 1
            t["bytes"] += i.size
        return out

    @property
    def exit_code(self) -> int:
        """Dry run: 1 when something would be pruned (interface.md §4)."""
        return 1 if self.items else 0


def build_plan(manifest_path: str, classes: Iterable[str] = ("migrated",), *, migration_journal: str | None = None,
               quiet_period: float = DEFAULT_QUIET_PERIOD, force_live: bool = False,
               older_than: float | None = None, now: float | None = None) -> PrunePlan:
    """Select what to prune from the manifest (typed columns) and the migration journals."""
    classes = tuple(c for c in CLASSES if c in set(classes))
    if not classes:
        raise UsageError("nothing to select: give --migrated, --unreadable-namespaces or --residue")
    meta = mf.read_metadata(manifest_path)
    root = meta.get("root")
    if not isinstance(root, str) or not os.path.isdir(root):
        raise UsageError(f"the manifest's root {root!r} is not a folder", path=manifest_path,
                         hint="rescan the cache root with `kvmigrate scan ROOT`")
    now = time.time() if now is None else now
    cols = mf.read_table(manifest_path, columns=_COLUMNS).to_pydict()
    n = len(cols["relpath"])
    c = cols
    targets, used = _journal_namespaces(migration_journal or jn.default_journal_dir(root))
    target_bases = {b for b in c["target_base"] if b} | targets
    rows_of: dict[str, list[int]] = {}
    for i in range(n):
        ns = c["source_base"][i]
        if ns:
            rows_of.setdefault(ns, []).append(i)

    chosen: dict[int, str] = {}  # row -> class
    target_of: dict[int, int] = {}  # migrated row -> its target's row
    if "migrated" in classes:
        by_relpath = {c["relpath"][i]: i for ns in target_bases for i in rows_of.get(ns, ())}
        primary: dict[tuple, int] = {}
        for i in range(n):
            ns = c["source_base"][i]
            if not ns or ns in target_bases or c["action"][i] != "already_present" \
                    or c["status"][i] not in MIGRATED_STATUSES:
                continue
            j = by_relpath.get(c["target_relpath"][i] or "")
            if j is None or c["status"][j] != "ok":
                continue  # the target path is not a target namespace's healthy file
            chosen[i], target_of[i] = "migrated", j
            primary[(_deployment(c, i), c["group"][i], c["block_hash"][i], c["rank"][i])] = i
        for i in range(n):
            code = c["finding"][i]
            if code not in findings.SECONDARY or c["status"][i] != "ok":
                continue
            # (a vllm.cpp rank folder is a namespace of its own: its block's primary is
            # found through the deployment, which groups the ranks' namespaces)
            p = primary.get((_deployment(c, i), c["group"][i], c["block_hash"][i], c["primary_rank"][i]))
            if p is None:
                continue
            if code == findings.REPLICA_OF_PRIMARY and not _same_bytes(c, i, p):
                continue  # a replica's equality is proven by its hash only (a scan at --verify hash)
            chosen[i], target_of[i] = "migrated", target_of[p]
    if "unreadable_namespaces" in classes:
        for ns, rows in rows_of.items():
            if ns in target_bases or ns in used:
                continue
            if all(c["status"][i] in UNREADABLE_STATUSES or c["status"][i] in ("tmp_leftover", *RESIDUE_STATUSES)
                   for i in rows) and any(c["status"][i] in UNREADABLE_STATUSES for i in rows) \
                    and not any(c["target_relpath"][i] for i in rows):
                for i in rows:
                    chosen.setdefault(i, "unreadable_namespaces")
    if "residue" in classes:
        age_ns = int((DEFAULT_RESIDUE_AGE if older_than is None else older_than) * 1e9)
        for i in range(n):
            st = c["status"][i]
            if c["source_base"][i] in target_bases or i in chosen:
                continue
            if st in RESIDUE_STATUSES or st == "tmp_leftover" and now * 1e9 - (c["mtime_ns"][i] or 0) >= age_ns:
                chosen[i] = "residue"
    # a namespace pruned whole (for its migrated blocks: once nothing else of it is left)
    # takes its config.json and folders with it
    emptied = set()
    for ns, rows in rows_of.items():
        if ns in target_bases or not any(i in chosen for i in rows):
            continue
        config = [i for i in rows if c["relpath"][i] == f"{ns}/{layout.CONFIG_NAME}"]
        rest = [i for i in rows if i not in config]
        if all(i in chosen for i in rest):
            emptied.add(ns)
            cls = chosen[rest[0]] if rest else "migrated"
            for i in config:
                if c["status"][i] not in ("own_artifact", "foreign"):
                    chosen.setdefault(i, cls)
    skipped = {}
    names = {c["source_base"][i] for i in chosen}
    for ns in sorted(names):
        why = None if force_live else _live(root, ns, [c["relpath"][i] for i in rows_of[ns]], quiet_period, now,
                                            max(c["mtime_ns"][i] or 0 for i in rows_of[ns]))
        if why:
            skipped[ns] = why
    items = []
    locks: dict[str, set[str]] = {}

    def order(i: int) -> tuple:
        """A deployment's blocks with their rank files side by side, its config.json files last."""
        config = c["relpath"][i] == f"{c['source_base'][i]}/{layout.CONFIG_NAME}"
        return _deployment(c, i), config, _key(c, i), c["relpath"][i]

    for i in sorted(chosen, key=order):
        ns = c["source_base"][i]
        rel = c["relpath"][i]
        if c["status"][i] in ("own_artifact", "foreign") or rel.startswith(layout.OWN_DIR + "/"):
            continue
        check_relpath(rel, "manifest path")
        j = target_of.get(i)
        target = None
        if j is not None:
            target = (c["relpath"][j], c["dev"][j], c["inode"][j], c["size"][j], c["mtime_ns"][j])
        items.append(Item(rel, chosen[i], ns, c["dev"][i], c["inode"][i], c["size"][i], c["mtime_ns"][i],
                          c["nlink"][i] or 1, target, _key(c, i)))
    items = without_namespaces(items, set(skipped))
    for item in items:  # the target namespaces to lock while pruning into them: their base folders
        if item.target is not None:
            folder = layout.parse_folder(item.target[0].split("/", 1)[0])
            if folder is not None:
                locks.setdefault(folder.base, set()).add(item.namespace)
    return PrunePlan(root, manifest_path, classes, items, skipped, target_bases, emptied - set(skipped), locks)


def without_namespaces(items: list[Item], namespaces: set[str]) -> list[Item]:
    """The items minus those of `namespaces`, minus every block one of them holds a rank
    file of (a vllm.cpp block spans one namespace per rank), minus the config.json of any
    namespace that keeps something."""
    if not namespaces:
        return items
    dropped = {i.key for i in items if i.namespace in namespaces}
    keeps = {i.namespace for i in items if i.key in dropped} | namespaces
    return [i for i in items if i.key not in dropped
            and not (i.namespace in keeps and i.relpath == f"{i.namespace}/{layout.CONFIG_NAME}")]


def _same_bytes(c: dict[str, list], i: int, p: int) -> bool:
    """Row i holds the data of row p, by hash: the payload for vllm.cpp (each rank's header
    names its own identity), the whole file otherwise."""
    col = "payload_xxh3_128" if c["payload_xxh3_128"][i] is not None else "content_xxh3_128"
    return c[col][i] is not None and c[col][i] == c[col][p]


def _deployment(c: dict[str, list], i: int) -> str:
    return c["deployment"][i] or c["source_base"][i] or ""


def _key(c: dict[str, list], i: int) -> str:
    """The block a row is a rank file of (its deployment, group and hash); else its path."""
    h = c["block_hash"][i]
    return f"{_deployment(c, i)}/{c['group'][i]}:{h.hex()}" if h is not None else c["relpath"][i]


def _journal_namespaces(journal: str) -> tuple[set[str], set[str]]:
    """(target bases, source namespaces) of every migration run in the journal file or
    directory (none when there is none yet)."""
    if not os.path.exists(journal) or os.path.isdir(journal) and not any(
            f.endswith(".jsonl") for f in os.listdir(journal)):
        return set(), set()
    targets: set[str] = set()
    sources: set[str] = set()
    for _, run in jn.iter_runs(journal):
        if run.rolled_back:
            continue
        for base, rec in run.targets.items():
            targets.add(base)
            sources.update(rec.get("sources") or ())
    return targets, sources


def _live(root: str, ns: str, relpaths: list[str], quiet_period: float, now: float, newest_file_ns: int) -> str | None:
    """Why a namespace counts as live: written (its newest file mtime, or the mtime or
    ctime of a folder of it) within the quiet period; None when it is quiet."""
    newest = newest_file_ns / 1e9
    folders = set()
    for rel in relpaths:
        parts = rel.split("/")[:-1]
        for k in range(1, len(parts) + 1):
            folders.add("/".join(parts[:k]))
    for d in folders:
        try:
            st = os.lstat(os.path.join(root, d))
        except OSError:
            continue
        newest = max(newest, st.st_mtime, st.st_ctime)
    age = now - newest
    if age < quiet_period:
        return (f"written {max(age, 0):.0f} s ago, within the quiet period of {quiet_period:.0f} s (a running "
                "engine may use it); rerun later, or pass --force-live")
    return None


# --- apply ---------------------------------------------------------------------------------


@dataclass
class PruneResult:
    journal: str
    run_id: str
    quarantine: str | None  # relpath of the run's quarantine folder (None with --no-quarantine)
    moved: Counter = field(default_factory=Counter)  # class -> files
    moved_bytes: Counter = field(default_factory=Counter)
    freed_bytes: int = 0  # bytes no other name holds (freed when the quarantine is purged)
    unlinked: int = 0  # files whose bytes another name keeps (a file-count slot only)
    dirs_removed: int = 0
    left: Counter = field(default_factory=Counter)  # class -> files of the plan not moved (kept, failed)
    kept: list[str] = field(default_factory=list)  # with why (changed since the scan, ...)
    failed: list[str] = field(default_factory=list)  # operational problems

    @property
    def exit_code(self) -> int:
        return EXIT_OPERATIONAL if self.failed else 0

    def to_dict(self) -> dict[str, Any]:
        return {"journal": self.journal, "run_id": self.run_id, "quarantine": self.quarantine,
                "moved": dict(self.moved), "moved_bytes": dict(self.moved_bytes), "freed_bytes": self.freed_bytes,
                "unlinked_files": self.unlinked, "dirs_removed": self.dirs_removed, "left": dict(self.left),
                "kept": self.kept,
                "failed": self.failed, "exit_code": self.exit_code}


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
    run_id = jn.new_run_id()
    root = plan.root
    path = journal or os.path.join(prune_journal_dir(root), f"{run_id}.jsonl")
    if os.path.isdir(path):
        path = os.path.join(path, f"{run_id}.jsonl")
    qdir = f"{QUARANTINE_DIR}/{run_id}" if quarantine else None
    w = jn.JournalWriter.create(path, {"kind": KIND, "run_id": run_id, "command": command, "root": root,
                                       "dest": root, "manifest": os.path.abspath(plan.manifest),
                                       "classes": list(plan.classes), "quarantine": qdir, "pid": os.getpid(),
                                       "time": time.time(), "scan_started_ns": plan.scan_started_ns})
    result = PruneResult(path, run_id, qdir)
    hit = (crash or _CrashSeam()).hit  # points: prune_intent, prune_move, prune_dirs
    try:
        with DestTree(root) as tree:
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
                for start in range(0, len(items), _BATCH):
                    w.intent([_intent(i, qdir) for i in items[start:start + _BATCH]])
                hit("prune_intent")
                _moves(tree, items, qdir, plan.scan_started_ns, w, result, hit)
            finally:
                for lock in locks:
                    lock.release()
        w.write({"t": "complete", "moved": dict(result.moved), "kept": len(result.kept),
                 "failed": len(result.failed), "time": time.time()}, sync=True)
    finally:
        w.close()
    return result


def _intent(i: Item, qdir: str | None) -> dict[str, Any]:
    rec = {"kind": "move", "path": i.relpath, "to": f"{qdir}/{i.relpath}" if qdir else None, "dev": i.dev,
           "ino": i.inode, "size": i.size, "mtime_ns": i.mtime_ns, "nlink": i.nlink, "class": i.cls,
           "ns": i.namespace, "key": i.key, "target": None}
    if i.target is not None:
        rec.update(target=i.target[0], tdev=i.target[1], tino=i.target[2], tsize=i.target[3], tmtime_ns=i.target[4])
    return rec


def _moves(tree: DestTree, items: list[Item], qdir: str | None, scan_started_ns: int | None, w: jn.JournalWriter,
           result: PruneResult, hit: Any) -> None:
    """Move the items block by block: when one rank file of a block stays (changed, or
    the move failed), the others of that block are put back, and a namespace's
    config.json goes only if all else of it went (nothing is left half-moved)."""
    if qdir:
        makedirs(tree, qdir)
    known: set[str] = set()  # quarantine folders made or seen by this run
    moved: list[str] = []
    held_back: set[str] = set()
    n = 0
    for key, group in itertools.groupby(items, key=lambda i: i.key):
        group = list(group)
        ns = group[0].namespace
        if key == f"{ns}/{layout.CONFIG_NAME}" and ns in held_back:
            result.kept.append(f"{tree.abspath(key)}: kept, since other files of {ns} stay (listed above)")
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
        else:
            moved += [i.relpath for i in done]
    w.sync()
    gone = set(moved)
    result.left.update(i.cls for i in items if i.relpath not in gone)
    _remove_folders(tree, moved, w, result)
    hit("prune_dirs")


def _undo(tree: DestTree, item: Item, qdir: str | None, w: jn.JournalWriter, result: PruneResult) -> None:
    """Put back a rank file whose block cannot go whole (journaled: `returned`)."""
    if qdir is None:
        return  # unlinked (--no-quarantine): its bytes are at the target, nothing to put back
    try:
        _put_back(tree, f"{qdir}/{item.relpath}", item.relpath)
    except OSError as exc:
        result.failed.append(f"{tree.abspath(item.relpath)}: cannot put back into its block ({exc.strerror or exc});"
                             f" it is at {tree.abspath(qdir + '/' + item.relpath)}")
        return
    w.done({"kind": "returned", "path": item.relpath})
    result.moved[item.cls] -= 1
    result.moved_bytes[item.cls] -= item.size
    result.kept.append(f"{tree.abspath(item.relpath)}: put back, since another rank file of its block stays")
    if not result.moved[item.cls]:
        del result.moved[item.cls], result.moved_bytes[item.cls]


def finish_interrupted(root: str) -> list[PruneResult]:
    """Finish every prune run of ROOT that was stopped (kill -9, a crash) before its
    `complete` record: the files it journaled and did not move yet are re-checked against
    the journaled stat and moved, as the run would have. A run still going holds its
    journal's flock: that refusal names its pid."""
    out = []
    for run in load_prune_runs(prune_journal_dir(root)) if _has_journals(prune_journal_dir(root)) else []:
        if run.complete or run.restored or run.purge_started:
            continue
        w = jn.JournalWriter.append(run.path)
        try:
            w.write({"t": "resume", "pid": os.getpid(), "time": time.time()}, sync=True)
            result = PruneResult(run.path, str(run.header.get("run_id")), run.quarantine)
            items = [_item(rec) for path, rec in run.moves.items() if path not in run.moved]
            with DestTree(run.root) as tree:
                settled = [i for i in items if _settled(tree, i, run.quarantine, w, result)]
                pending = [i for i in items if i not in settled]
                _moves(tree, pending, run.quarantine, run.header.get("scan_started_ns"), w, result,
                       _CrashSeam().hit)
                _remove_folders(tree, [i.relpath for i in settled], w, result)
            w.write({"t": "complete", "moved": dict(result.moved), "kept": len(result.kept),
                     "failed": len(result.failed), "time": time.time(), "resumed": True}, sync=True)
        finally:
            w.close()
        out.append(result)
    return out


def _item(rec: dict[str, Any]) -> Item:
    target = (check_relpath(rec["target"], "journal path"), rec["tdev"], rec["tino"], rec["tsize"],
              rec["tmtime_ns"]) if rec.get("target") else None
    return Item(rec["path"], rec["class"], rec.get("ns") or "", rec["dev"], rec["ino"], rec["size"], rec["mtime_ns"],
                rec.get("nlink") or 1, target, rec.get("key") or rec["path"])


def _settled(tree: DestTree, item: Item, qdir: str | None, w: jn.JournalWriter, result: PruneResult) -> bool:
    """Moved before the kill, its done record lost with it: at its quarantine path."""
    if tree.lstat(item.relpath) is not None:
        return False
    if qdir is not None:
        st = tree.lstat(f"{qdir}/{item.relpath}")
        if st is None or (st.st_dev, st.st_ino) != (item.dev, item.inode):
            return False
    w.done({"kind": "moved" if qdir else "unlinked", "path": item.relpath, "ino": item.inode, "dev": item.dev})
    result.moved[item.cls] += 1
    result.moved_bytes[item.cls] += item.size
    return True


def _has_journals(jdir: str) -> bool:
    return os.path.isdir(jdir) and any(f.endswith(".jsonl") for f in os.listdir(jdir))


@dataclass
class PruneRun:
    """One prune run of a journal file, as its records say."""

    path: str
    header: dict[str, Any]
    moves: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> intent item
    moved: set[str] = field(default_factory=set)  # paths with a done record
    rmdirs: list[str] = field(default_factory=list)
    complete: bool = False
    restored: bool = False
    purged: bool = False
    purge_started: bool = False

    @property
    def root(self) -> str:
        return self.header["root"]

    @property
    def quarantine(self) -> str | None:
        return self.header.get("quarantine")


def load_prune_runs(journal: str) -> list[PruneRun]:
    """The prune runs of a journal file or directory (oldest first), read with the
    journal module's reader; a migration journal is refused."""
    runs = []
    for path in jn.journal_files(journal):
        for rec in jn.iter_records(path):
            t = rec.get("t")
            if t == "header":
                if rec.get("kind") != KIND or not isinstance(rec.get("root"), str):
                    raise UsageError(f"{path} is not a prune journal", path=path,
                                     hint="pass the journal `kvmigrate prune --apply` printed (a migration is "
                                          "undone with `kvmigrate rollback`)")
                runs.append(PruneRun(path, rec))
                continue
            run = runs[-1]
            if t == "intent":
                for item in rec.get("items", []):
                    run.moves[check_relpath(item.get("path"), "journal path")] = item
            elif t == "done" and rec.get("kind") == "rmdirs":
                run.rmdirs += [check_relpath(p, "journal path") for p in rec.get("paths", [])]
            elif t == "done" and rec.get("kind") == "returned":
                run.moved.discard(rec.get("path"))
            elif t == "done":
                run.moved.add(rec.get("path"))
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
    return runs


def _move(tree: DestTree, item: Item, qdir: str | None, scan_started_ns: int | None, w: jn.JournalWriter,
          result: PruneResult, known: set[str]) -> bool:
    """Move (or unlink) one file after re-checking it; False when it was kept."""
    where = tree.abspath(item.relpath)
    try:
        st = _check_unchanged(tree, item, scan_started_ns)
        if qdir is None:
            tree.unlink(item.relpath)
        else:
            dest = f"{qdir}/{item.relpath}"
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
    result.moved[item.cls] += 1
    result.moved_bytes[item.cls] += item.size
    if st.st_nlink <= 1:
        result.freed_bytes += item.size
    else:
        result.unlinked += 1
    return True


def _check_unchanged(tree: DestTree, item: Item, scan_started_ns: int | None) -> os.stat_result:
    """A fresh lstat equal to the scan's (a regular file, same dev, inode, size, mtime, no
    ctime after the scan), and for a migrated block its target unchanged too (the same
    inode for a link)."""
    st = tree.lstat(item.relpath)
    if st is None:
        raise FileNotFoundError(item.relpath)
    if not stat.S_ISREG(st.st_mode):
        raise _Changed("no longer a regular file (a symlink is never followed)")
    if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != (item.dev, item.inode, item.size, item.mtime_ns):
        raise _Changed("changed since the scan (size, mtime or inode differ)")
    if scan_started_ns is not None and st.st_ctime_ns > scan_started_ns:
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
    folders in `known` are not asked again (one mkdir per folder, not per file). Returns
    how many it made."""
    made = 0
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


def _remove_folders(tree: DestTree, moved: list[str], w: jn.JournalWriter, result: PruneResult) -> None:
    """The folders the moves left empty, deepest first (a folder still holding anything
    stays); each one journaled so `restore` makes it again."""
    folders = set()
    for rel in moved:
        parts = rel.split("/")[:-1]
        for k in range(1, len(parts) + 1):
            folders.add("/".join(parts[:k]))
    removed = []
    for d in sorted(folders, key=lambda d: (d.count("/"), d), reverse=True):
        try:
            tree.rmdir(d)
            removed.append(d)
        except OSError:
            continue
    if removed:
        w.write({"t": "done", "kind": "rmdirs", "paths": removed}, sync=True)
    result.dirs_removed += len(removed)


# --- rendering -------------------------------------------------------------------------------


def render_plan(plan: PrunePlan, apply_command: str | None) -> str:
    from kvmigrate.units import human_bytes

    lines = [f"prune plan for {plan.root}"]
    totals = plan.totals()
    for cls in plan.classes:
        t = totals[cls]
        lines.append(f"  {cls.replace('_', '-'):<24} {t['files']:>8} files {human_bytes(t['bytes']):>10}; frees "
                     f"{human_bytes(t['freed_bytes'])} once purged, {t['unlinked_files']} files only unlinked "
                     "(their bytes stay under another name: a file-count slot each)")
        for (c, ns), v in sorted(plan.by_namespace().items()):
            if c == cls:
                lines.append(f"    {ns}: {v['files']} files, {human_bytes(v['bytes'])}")
    for ns, why in sorted(plan.skipped.items()):
        lines.append(f"  skipped {ns}: {why}")
    if plan.items:
        lines.append(f"{len(plan.items)} files would move to {os.path.join(plan.root, QUARANTINE_DIR)}/<run>/ "
                     "(reversible: `kvmigrate restore JOURNAL`). Nothing was moved (dry run).")
        if apply_command:
            lines.append(f"to apply: {apply_command}")
    else:
        lines.append("nothing to prune.")
    return "\n".join(lines)


def render_result(result: PruneResult) -> str:
    from kvmigrate.units import human_bytes

    moved = sum(result.moved.values())
    where = os.path.join("ROOT", result.quarantine) if result.quarantine else "nowhere (--no-quarantine: unlinked)"
    lines = [f"pruned {moved} files ({human_bytes(sum(result.moved_bytes.values()))}) into {where}: "
             f"{human_bytes(result.freed_bytes)} freed once purged, {result.unlinked} files only unlinked; "
             f"{result.dirs_removed} empty folders removed"]
    for cls, k in sorted(result.moved.items()):
        lines.append(f"  {cls.replace('_', '-')}: {k} files, {human_bytes(result.moved_bytes[cls])}")
    if result.moved.get("migrated"):
        lines.append("  the target namespaces' blocks now have one name each in the cache: file-count evictors count "
                     "them once" if not result.left.get("migrated") else
                     f"  {result.left['migrated']} legacy names of migrated blocks stay (below): evictors still count "
                     "those blocks twice")
    lines.append(f"journal: {result.journal}  (undo: kvmigrate restore {result.journal})")
    for what, rows in (("kept", result.kept), ("failed", result.failed)):
        if rows:
            lines.append(f"{what} {len(rows)}:")
            lines += [f"  {r}" for r in rows[:50]] + ([f"  ... and {len(rows) - 50} more"] if len(rows) > 50 else [])
    return "\n".join(lines)
