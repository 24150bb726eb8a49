"""Materialize a plan: target folders, config.json, then every block, journaled.

Copies and transforms (slice, concat, relayout) write new files the same way: a temp
file next to the final name, fsynced, published by link(); transforms stream through a
hashing writer, so the journaled output hash is known when the last byte is written.

Safety rules (migration.md §3) and where they live:
  * sources are only read (O_NOFOLLOW, O_NOATIME where permitted) or hard-linked;
  * no clobber: a block appears at its final name only through `link()` (the source
    itself, or a fsynced `<final>.kvmigrate-<pid>.tmp` in the same folder, unlinked
    after); EEXIST means compare, then `already_present` or `conflict`;
  * staleness: the source's (dev, inode, size, mtime_ns) must equal the manifest's, on
    the open fd for copies and on the new link's inode for links; with a manifest hash,
    copies re-hash what they read;
  * nothing unread is published: a block the manifest has no content hash for (a scan
    at --verify size or none) has every file read once and checked as a hashing scan
    would (not all zero, the manifest's size, equal replicas, a vllm.cpp header the
    engine accepts) before it is linked or copied; a transform checks its sources so;
  * write-ahead journal: an fsynced intent before each batch, done records after (a
    hard link by its inode identity, plus its hash: the manifest's or the one apply
    read);
  * one run per target namespace (`lock.NamespaceLock`);
  * writes only below the destination root, through O_NOFOLLOW directory fds.

Speed: actions stream from the manifest in batches (bounded memory). While the main
thread links one batch, helper threads make the next batch's folders (after its intent
is fsynced) and stat its sources, or read them (blocks without hashes); every outcome is
still judged by the main thread in block order, so results and journal are those of one
thread.

This module runs the plan (journal, locks, batches, source checks); its parts live beside
it: folders `dirs.py`, placing a block `place.py` (called by each action's kind,
`actions.py`), proof of an interrupted run's outputs `reconcile.py`, the result `result.py`.
"""

from __future__ import annotations

import os
import stat
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, NamedTuple

import xxhash

from kvmigrate import families, layout, pacing
from kvmigrate.errors import EXIT_INTEGRITY, EXIT_OPERATIONAL, OperationalError, UsageError
from kvmigrate.fsio import all_holes, open_noatime
from kvmigrate.migrate import journal as jn
from kvmigrate.migrate.actions import ACTIONS
from kvmigrate.migrate.crash import CRASH_ENV  # noqa: F401 (CRASH_ENV: the tests' name)
from kvmigrate.migrate.crash import CrashSeam as _CrashSeam
from kvmigrate.migrate.dirs import Batch, FolderMaker
from kvmigrate.migrate.fsops import DestTree, SymlinkInPath, check_relpath
from kvmigrate.migrate.lock import NamespaceLock
from kvmigrate.migrate.model import BlockAction, Plan, TargetPlan
from kvmigrate.migrate.outputs import TransformSpec, slice_row_problem
from kvmigrate.migrate.place import CTIME_MOVED, Placer
from kvmigrate.migrate.place import stat_differs as _stat_differs
from kvmigrate.migrate.plan import ActionStream
from kvmigrate.migrate.reconcile import reconcile_item, tmp_name, tmp_paths, unlink_quiet
from kvmigrate.migrate.result import ApplyResult, Stop, finish_counts, oserror_stop
from kvmigrate.migrate.runs import claimed_by_others

MODES = ("link", "copy", "auto")
BATCH = 1024
_HELPERS = 3  # threads: two folder makers and a block reader (all mostly in the kernel)
_NOT_SEEN = object()
class Applier(FolderMaker, Placer):
    """Runs a plan. Two hooks let scale-out (kvmigrate.scaleout) split a run into parts:
    `take_locks=False`: a part, whose driver holds every namespace lock for the run;
    `place_blocks`: a driver, which gives each target its journal record, config.json
    and rank folder, then calls place_blocks() (the parts) while it holds the locks."""

    def __init__(self, plan: Plan, *, mode: str = "link", journal: str | None = None, command: str = "",
                 identity: dict[str, Any] | None = None, batch_size: int = BATCH,
                 progress: Callable[[int], None] | None = None, take_locks: bool = True,
                 place_blocks: Callable[[], Any] | None = None):
        if mode not in MODES:
            raise UsageError(f"unknown --mode {mode!r}", hint="use link, copy or auto")
        self.plan = plan
        self.mode = mode
        self.journal_arg = journal
        self.command = command
        self.identity = identity or {"root": plan.root, "dest": plan.dest, "target_profile": plan.target_profile,
                                     "manifest": plan.manifest_path}
        self.batch_size = batch_size
        self.progress = progress
        self.take_locks = take_locks
        self.place_blocks = place_blocks
        self.result = ApplyResult()
        self.crash = _CrashSeam()
        self._known_dirs: set[str] = set()  # folders known to exist (a cache, cleared when large)
        self._src_prefix = plan.root if plan.root.endswith("/") else plan.root + "/"
        self._pool: ThreadPoolExecutor | None = None  # the block reader and the folder makers
        self._reads: dict[int, list] = {}  # id(action) -> its files' `_FileRead`s, this batch
        self._stats: dict[int, str | None] = {}  # id(source file) -> why it is stale, this batch
        self._header_ids_of: dict[str, tuple[bytes, int]] | None = None  # see `_header_ids`
        self.tree: DestTree | None = None
        self.journal: jn.JournalWriter | None = None
        self._ours: dict[tuple[int, int], int] | None = None  # see `_linked_by_us`
        self._run_id: str | None = None  # the journal run this apply writes (a new one, or the one it resumes)

    # --- entry point ------------------------------------------------------------------

    def run(self) -> ApplyResult:
        plan = self.plan
        if not os.path.isdir(plan.dest):
            raise UsageError(f"destination {plan.dest} is not a directory", path=plan.dest,
                             hint="create it first, or pass an existing directory to --dest")
        work = [tp for tp in plan.targets if tp.actions]
        if self.mode == "link":
            self._check_same_filesystem(work)
        self.tree = DestTree(plan.dest)
        locks: list[NamespaceLock] = []
        try:
            self._open_journal()
            try:
                for tp in work:
                    if not tp.flat:  # (a flat target's files go into the destination directory itself)
                        self._ensure_dirs([tp.base_name])
                if self.take_locks:
                    self._lock_namespaces(work, locks)
                self._resume_pending()
                self._targets(work)
            except SymlinkInPath as exc:
                raise Stop(OperationalError(f"refusing to write through a symlink or non-directory: {exc.filename}",
                                             path=exc.filename, hint="remove it or pass --dest DIR")) from None
            except OperationalError as exc:
                raise Stop(exc) from None
            # release (and remove) the locks before "complete": a kill in between leaves a run the next
            # one resumes and tidies, never a complete journal with a lock file nobody removes
            self._drain()
            for lock in reversed(locks):
                lock.release()
            self.journal.write({"t": "complete", "outcomes": dict(self.result.outcomes)}, sync=True)
        except Stop as stop:
            self.result.stop = stop.error
            self._drain()  # helper threads finish their batch before the run says it stopped
            if self.journal is not None:
                self.journal.write({"t": "stopped", "error": str(stop.error)}, sync=True)
        except KeyboardInterrupt as exc:
            # Ctrl-C / SIGTERM / --max-duration: leave the run resumable (locks released,
            # journal synced), and say where its journal is
            self._drain()
            if self.journal is not None:
                self.journal.write({"t": "interrupted"}, sync=True)
            why = str(exc) if isinstance(exc, pacing.OutOfTime) else "interrupted (Ctrl-C or SIGTERM)"
            raise pacing.Interrupted(why, journal=self.result.journal_path) from exc
        finally:
            self._drain()  # nothing is made under a namespace lock once it is released
            for lock in reversed(locks):
                lock.release()
            if self.journal is not None:
                self.journal.close()
            self.tree.close()
        if plan.placed_integrity_rows:  # other rows' findings are reported, not failed on (interface.md §4)
            self.result.bits |= EXIT_INTEGRITY
        finish_counts(plan, self.result)
        return self.result

    def _lock_namespaces(self, work: list[TargetPlan], locks: list[NamespaceLock]) -> None:
        """Every namespace this run or the run it resumes touches is locked before
        anything is reconciled or written (a lock left by a killed run is taken over,
        and removed on release). A scale-out part skips this (`take_locks`): its driver holds them."""
        for base in sorted({tp.lock_dir for tp in work} | self._resumed_bases()):
            lock = NamespaceLock.acquire(self.tree, base)
            locks.append(lock)
            if lock.created:
                self.journal.write({"t": "lock", "path": lock.relpath})

    def _targets(self, work: list[TargetPlan]) -> None:
        """Every target namespace in plan order; with `place_blocks`, their folders and
        config.json only, then place_blocks() places the blocks."""
        if self.place_blocks is None:
            for tp in work:
                self._target(tp)
            return
        ready = []
        for tp in work:
            errors = len(self.result.namespace_errors)
            self._target(replace(tp, actions=[]))  # its journal record and config.json only
            if len(self.result.namespace_errors) == errors and not tp.flat:
                ready.append(tp.rank_dir)  # a refused namespace gets no folder, as in one process
        self._ensure_dirs(ready)
        self.place_blocks()

    # --- set-up -----------------------------------------------------------------------

    def _check_same_filesystem(self, work: list[TargetPlan]) -> None:
        """`--mode link` never copies: refuse before writing anything if a link would
        cross filesystems."""
        dest_dev = os.stat(self.plan.dest).st_dev
        for tp in work:
            for dev, relpath in _link_devices(tp):
                if dev != dest_dev:
                    raise OperationalError(
                        f"cannot hard-link across filesystems: {os.path.join(self.plan.root, relpath)} is "
                        f"on device {dev}, the destination {self.plan.dest} on device {dest_dev}",
                        path=self.plan.dest,
                        hint="use --mode copy (copy every block) or --mode auto (link where possible, copy the rest); "
                             "nothing was written")

    def _open_journal(self) -> None:
        # default: ROOT/.kvmigrate/journals (migration.md §3.5), also with --dest: every
        # migration of a root is journaled in one place
        arg = self.journal_arg or jn.default_journal_dir(self.plan.root)
        header = {"run_id": jn.new_run_id(), "command": self.command, "manifest": self.plan.manifest_path,
                  "root": self.plan.root, "dest": self.plan.dest, "target_profile": self.plan.target_profile,
                  "identity": self.identity, "pid": os.getpid(), "mode": self.mode}
        found = jn.find_resumable(arg, self.identity)
        if found is not None:
            self.journal = jn.JournalWriter.resume(found, {"pid": os.getpid(), "command": self.command,
                                                           "mode": self.mode})
            self.result.resumed = True
            self._resume_runs = jn.load_runs(found)
            self._run_id = self._resume_runs[-1].header.get("run_id") if self._resume_runs else None
        else:
            path = arg
            if not jn.is_journal_name(arg) and (os.path.isdir(arg) or not os.path.exists(arg)):
                path = os.path.join(arg, f"{header['run_id']}{jn.SUFFIX}")
            self.journal = jn.JournalWriter.create(path, header, read_only=self._read_only_dest)
            self._resume_runs = []
            self._run_id = header["run_id"]
        self.result.journal_path = self.journal.path

    def _read_only_dest(self) -> str | None:
        """The hint when the journal's filesystem is read-only: if the destination cannot
        be written either (a probe file), --journal elsewhere alone would not help; None
        when it can."""
        probe = os.path.join(self.plan.dest, f".kvmigrate-probe-{os.getpid()}")
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        except FileExistsError:
            return None
        except OSError:
            return (f"{self.plan.dest} (where the target namespaces go) is on a read-only filesystem too: remount "
                    "it read-write, then rerun the same command; or migrate onto a writable filesystem: --dest DIR "
                    "--journal PATH (both there; with --mode copy, since hard links cannot cross filesystems)")
        os.unlink(probe)
        return None

    def _resume_pending(self) -> None:
        """Adopt what an interrupted run provably created and remove its temp files,
        so the resumed run ends exactly as an uninterrupted one."""
        if not self._resume_runs:
            return
        run = self._resume_runs[-1]
        digests = {b: bytes.fromhex(r["digest"]) for b, r in run.targets.items() if r.get("digest")}
        pending = run.pending()
        # a path another run journaled as its own is never adopted (its inode may be the very
        # one this run intended: a hard link of the same source)
        others = claimed_by_others([jn.default_journal_dir(self.plan.root), os.path.dirname(self.journal.path)],
                                   [self.journal.path], {item["path"] for item in pending}, self.plan.dest)
        for item in pending:
            if item["path"] in others:
                continue
            adopted = reconcile_item(self.tree, run.root, item, digests)
            if adopted is not None:
                self.journal.done(adopted)
                self.result.recovered += 1
        for item in run.intents.values():
            for tmp in tmp_paths(item):
                unlink_quiet(self.tree, tmp)
        self.journal.sync()

    def _resumed_bases(self) -> set[str]:
        """Target base folders of the run being resumed that exist (to lock them)."""
        if not self._resume_runs:
            return set()
        run = self._resume_runs[-1]
        bases = {rec.get("lock_dir", base) for base, rec in run.targets.items()}
        out = {""} if "" in bases or layout.LOCK_NAME in run.locks else set()  # a flat target's lock
        for base in bases | {p.rsplit("/", 1)[0] for p in run.locks if "/" in p}:
            if base:
                check_relpath(base, "journal target")
                if "/" not in base and self.tree.is_dir(base):
                    out.add(base)
        return out

    # --- config.json (the folders: `dirs.FolderMaker`) -----------------------------------

    def _target(self, tp: TargetPlan) -> None:
        self.result.per_target.setdefault(tp.base_name, Counter())
        if tp.flat:  # file names in the destination directory: no identity digest, no config.json
            self.journal.write({"t": "target", "base": tp.base_name, "family": tp.family, "rank_dir": "",
                                "lock_dir": tp.lock_dir, "flat": True, "sources": tp.sources,
                                "model_name": tp.fields.get("model")}, sync=True)
        else:
            self.journal.write({"t": "target", "base": tp.base_name, "family": tp.family, "rank_dir": tp.rank_dir,
                                "digest": tp.digest.hex(), "sources": tp.sources,
                                "payload_size": tp.fam.payload_bytes(tp.fields)},
                               sync=True)
        problem = None if tp.flat else self._config(tp)
        if problem:
            self.result.namespace_errors.append(problem)
            self.result.bits |= EXIT_INTEGRITY
            for act in tp.actions:
                self._outcome(tp, act, "conflict", "target config.json describes another identity", quiet=True)
            return
        # Actions are streamed from the manifest (plan.ActionStream), a batch at a time, as
        # a pipeline: while this thread links the blocks of one batch, helper threads make
        # the folders of the next (its intent is already fsynced) and read its replicas.
        # Outcomes are judged here, in order: folders before the blocks they hold.
        # --max-duration stops between batches: the batch begun is placed and synced first.
        pacing.check_deadline()
        prepared = None
        out_of_time = False
        for batch in _batches(tp.actions, self.batch_size):
            if pacing.expired():
                out_of_time = True
                break
            upcoming = self._prepare(tp, batch)
            if prepared is not None:
                self._blocks(tp, prepared)
            self._judge_dirs(upcoming)
            prepared = upcoming
        if prepared is not None:
            self._blocks(tp, prepared)
        if out_of_time:
            pacing.check_deadline()

    def _config(self, tp: TargetPlan) -> str | None:
        """Write the target config.json (byte-exact) unless one exists; an existing one
        must describe the same identity. Returns a problem message or None."""
        rel = f"{tp.base_name}/{layout.CONFIG_NAME}"
        want = tp.config_bytes
        problem = self._existing_config_problem(tp, rel)
        if problem != "absent":
            return problem
        tmp = tmp_name(rel)
        self.journal.intent([{"kind": "config", "path": rel, "tmp": tmp,
                              "xxh3_128": xxhash.xxh3_128(want).hexdigest()}])
        try:
            ino = self._write_new(tmp, [want])
            try:
                self.tree.link_local(tmp, rel)
            except FileExistsError:
                unlink_quiet(self.tree, tmp)
                problem = self._existing_config_problem(tp, rel)
                return None if problem == "absent" else problem
            unlink_quiet(self.tree, tmp)
        except OSError as exc:
            unlink_quiet(self.tree, tmp)
            raise oserror_stop(exc, self.tree.abspath(rel), "writing config.json") from None
        self.tree.fsync_dir(tp.base_name)
        self.journal.done({"kind": "config", "path": rel, "ino": ino, "size": len(want),
                           "xxh3_128": xxhash.xxh3_128(want).hexdigest()})
        self.journal.sync()
        return None

    def _existing_config_problem(self, tp: TargetPlan, rel: str) -> str | None:
        st = self.tree.lstat(rel)
        if st is None:
            return "absent"
        where = self.tree.abspath(rel)
        if not stat.S_ISREG(st.st_mode):
            return f"{where} exists and is not a regular file; not touching namespace {tp.base_name}"
        try:
            data = self.tree.read_bytes(rel, limit=1 << 22)
        except OSError as exc:
            raise oserror_stop(exc, where, "reading the existing config.json") from None
        if tp.fam.config_matches(data, tp.fields):  # as the engine compares it (bytes or fields)
            return None
        return (f"{where} exists and describes a different identity than the target; no block of {tp.base_name} "
                "was written (never overwritten: move it aside if it is stale, then rerun)")

    # --- blocks -----------------------------------------------------------------------

    def _prepare(self, tp: TargetPlan, batch: list[BlockAction]) -> Batch:
        """Journal a batch's intent (fsynced), then hand its folders and block reads to
        the helper threads."""
        missing = self._missing_dirs(sorted({act.target_relpath.rsplit("/", 1)[0] for act in batch
                                             if "/" in act.target_relpath}))
        fresh = set(missing)
        items: list[dict[str, Any]] = [{"kind": "dir", "path": d} for d in missing]
        for act in batch:
            item = {"kind": "block", "path": act.target_relpath, "action": act.action, "src": act.source.relpath,
                    "dev": act.source.dev, "ino": act.source.inode, "size": act.source.size, "base": tp.base_name}
            folder = act.target_relpath.rsplit("/", 1)[0] if "/" in act.target_relpath else ""
            if folder not in fresh and not self.tree.was_made(folder) and self._present(act.target_relpath):
                # there before this run (an earlier run's link, say): never this run's to
                # adopt on resume or to remove on rollback (`reconcile_item`)
                item["pre"] = True
            if ACTIONS[act.action].writes_temp(self.mode):
                item["tmp"] = tmp_name(act.target_relpath)
            if act.transform is not None:
                # every file the output is made of, to prove after a crash that a file at
                # the final path is exactly this transform's output
                item["transform"] = act.transform.to_json()
                item["srcs"] = [[f.relpath, f.inode, f.size] for f in act.sources]
            items.append(item)
        self.journal.intent(items)
        self.crash.hit("intent")
        reads = self._helpers().submit(_read_batch, self._src_prefix, batch, tp.fam.header_len)
        return Batch(batch, missing, self._start_dirs(missing), reads)

    def _present(self, relpath: str) -> bool:
        try:
            return self.tree.lstat(relpath) is not None
        except (SymlinkInPath, NotADirectoryError):
            return True  # something is in the way: placing will say what

    def _blocks(self, tp: TargetPlan, prepared: Batch) -> None:
        """Materialize the blocks of a batch whose folders exist, in order; one fsync."""
        self._reads, self._stats = prepared.reads.result() if prepared.reads is not None else ({}, {})
        for act in prepared.actions:
            self._block(tp, act)
            if self.progress:
                self.progress(1)
        self._reads, self._stats = {}, {}
        self.journal.sync()

    def _helpers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=_HELPERS, thread_name_prefix="kvmigrate-io")
        return self._pool

    def _drain(self) -> None:
        """Wait for the helper threads (at most one batch of folders and reads)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _outcome(self, tp: TargetPlan, act: BlockAction, outcome: str, why: str = "", quiet: bool = False,
                 bits: int = 0) -> None:
        self.result.outcomes[outcome] += 1
        per_target = self.result.per_target.get(tp.base_name)
        if per_target is None:
            per_target = self.result.per_target[tp.base_name] = Counter()
        per_target[outcome] += 1
        if outcome in ("conflict", "changed_since_scan", "failed"):
            if not quiet:
                self.result.findings.append(f"{outcome}: {self.tree.abspath(act.target_relpath)} "
                                            f"(from {act.source.relpath}): {why}")
            self.journal.write({"t": "skip", "path": act.target_relpath, "outcome": outcome, "why": why})
            if outcome == "conflict":
                bits |= EXIT_INTEGRITY
            # changed_since_scan: reported, not failed on; the run did all it could (interface.md §4)
        self.result.bits |= bits

    def _src_abs(self, relpath: str) -> str:
        return self._src_prefix + relpath  # os.path.join(root, relpath) for a checked relpath

    def _stale(self, src, act: BlockAction) -> str | None:
        """Why a source no longer is what the scan saw, or None (lstat-ed by the helper
        while the batch's folders were made, or now; a moved ctime judged by `_ctime_moved`)."""
        why = self._stats.pop(id(src), _NOT_SEEN)
        if why is _NOT_SEEN:
            why = _stale_at(self._src_abs(src.relpath), src)
        return self._ctime_moved(src, act) if why == CTIME_MOVED else why

    def _ctime_moved(self, src, act: BlockAction) -> str | None:
        """A source whose ctime alone moved since the scan, no name added (prune re-checks
        a ctime too; a chmod, an xattr set, a rewrite whose mtime was put back move it): no
        change when kvmigrate moved it (`_linked_by_us`) or its bytes still hash to the
        scan's (read now); else changed, or unproven without a hash (CTIME_MOVED)."""
        if self._linked_by_us(src):
            return None
        if src.content_hash is None:
            return CTIME_MOVED
        try:
            fd = open_noatime(self._src_abs(src.relpath))
        except OSError as exc:
            return f"source cannot be read: {exc.strerror}"
        try:
            why = _stat_differs(os.fstat(fd), src, bytes_checked=True)
            got = None if why else _read_fd(fd, src.size)[0]
        except OSError as exc:
            return f"source cannot be read: {exc.strerror}"
        finally:
            os.close(fd)
        if why or got == src.content_hash:
            return why
        return "source changed since the scan: its ctime moved and its bytes differ from the scan's hash"

    def _linked_by_us(self, src) -> bool:
        """An earlier migration run journaled for this root (its default folder, or
        --journal) meant to hard-link this inode, and its journal was last written at or
        after the inode's ctime: link(2) and a rollback's unlink moved it (the same manifest
        applied after a rollback, or into another --dest), not a rewrite. (The run being
        written is left out: its intents precede its links.) Read once, when a ctime first
        needs it."""
        if self._ours is None:
            self._ours = {}
            mine = self._run_id
            for where in {jn.default_journal_dir(self.plan.root), self.journal_arg} - {None}:
                if not os.path.exists(where):
                    continue
                for path, run in jn.iter_runs(where):
                    if run.header.get("run_id") == mine:
                        continue
                    written = os.stat(path).st_mtime_ns
                    for item in run.intents.values():
                        if item.get("kind") == "block" and item.get("action") == "link":
                            key = (item.get("dev"), item.get("ino"))
                            self._ours[key] = max(self._ours.get(key, 0), written)
        try:
            st = os.lstat(self._src_abs(src.relpath))
        except OSError:
            return False
        return st.st_ctime_ns <= self._ours.get((st.st_dev, st.st_ino), -1)

    def _block(self, tp: TargetPlan, act: BlockAction) -> None:
        if _reads_block(act):
            # the manifest lacks the block's hashes: each file is stat-ed and read through one
            # open (by the batch's reader thread) and checked before anything is published
            ok, computed = self._read_checked(tp, act)
        else:
            why = self._stale(act.source, act)
            if why:
                return self._outcome(tp, act, "changed_since_scan", why)
            # a transform checks its sources itself (`_check_transform_sources`)
            multi = act.world > 1 and act.transform is None
            ok, computed = self._check_replicas(tp, act) if multi else (True, None)
        if not ok:
            return
        try:
            ACTIONS[act.action].execute(self, tp, act, computed or act.source.content_hash)
        except SymlinkInPath as exc:
            self._outcome(tp, act, "conflict", f"{exc.filename} is a symlink or not a directory; not written through")

    def _check_replicas(self, tp: TargetPlan, act: BlockAction) -> tuple[bool, bytes | None]:
        """Every rank's file of a multi-rank block must hold equal bytes (payloads for
        vllm.cpp) before one of them is reused, by the hashes the scan took (a block
        lacking them is read instead: `_read_checked`). Returns (ok, None); when not ok
        the block already has its outcome."""
        ranks = {act.source.rank, *(r.rank for r in act.replicas)}
        if _incomplete(tp, act, ranks):
            self._outcome(tp, act, "failed", f"block incomplete: rank files {sorted(ranks)} of {act.world}",
                          bits=EXIT_INTEGRITY)
            return False, None
        for rep in act.replicas:
            why = self._stale(rep, act)
            if why:
                self._outcome(tp, act, "changed_since_scan", f"replica {rep.relpath}: {why}")
                return False, None
        payload = act.action == "rewrite_header"
        files = (act.source, *act.replicas)
        known = [f.payload_hash if payload else f.content_hash for f in files]
        differing = [f.relpath for f, h in zip(files, known) if h != known[0]]
        if differing:
            self._outcome(tp, act, "failed", f"replicas differ ({'payload' if payload else 'content'}): "
                          + ", ".join(differing) + f" != {act.source.relpath}", bits=EXIT_INTEGRITY)
            return False, None
        return True, None

    def _read_checked(self, tp: TargetPlan, act: BlockAction) -> tuple[bool, bytes | None]:
        """The checks a hashing scan makes, on the bytes this run read (one open and one
        read per file, by the batch's reader thread while the folders are made: `_prepare`):
        no block is published unless every file of it was read here or hashed by the scan
        (README: what `--apply` reads). Verdicts in order: the source is stale, the block
        incomplete, a replica stale, a file unreadable, a file's content damaged (all
        zero, not the manifest's size, a vllm.cpp header the engine refuses), the replicas
        differ. Returns (ok, the source's content hash, journaled with the block)."""
        payload = act.action == "rewrite_header"
        reads = self._reads.pop(id(act), None) or _read_block_files(self._src_prefix, act, tp.fam.header_len)
        # a moved ctime alone: read all the same, and no change if kvmigrate moved it (its bytes are checked below)
        reads = [got._replace(stale=None) if got.stale == CTIME_MOVED and self._linked_by_us(f) else got
                 for f, got in zip(act.sources, reads)]
        first = reads[0]
        if first.stale:
            self._outcome(tp, act, "changed_since_scan", first.stale)
            return False, None
        ranks = {act.source.rank, *(r.rank for r in act.replicas)}
        if _incomplete(tp, act, ranks):
            self._outcome(tp, act, "failed", f"block incomplete: rank files {sorted(ranks)} of {act.world}",
                          bits=EXIT_INTEGRITY)
            return False, None
        for rep, got in zip(act.replicas, reads[1:]):
            if got.stale:
                self._outcome(tp, act, "changed_since_scan", f"replica {rep.relpath}: {got.stale}")
                return False, None
        files = act.sources
        for f, got in zip(files, reads):
            if got.error is not None:
                what = "replica" if act.world > 1 else "the source"
                self._outcome(tp, act, "failed", f"cannot read {what} {f.relpath}: {got.error.strerror}",
                              bits=EXIT_OPERATIONAL)
                return False, None
        for f, got in zip(files, reads):
            where = "" if f is act.source else f" of {f.relpath}"
            problem = _content_problem(got, f.size, where) or (
                self._header_problem(tp, f, got.header, where) if tp.fam.header_len else None)
            if problem:
                self._outcome(tp, act, "failed", f"{problem}; not placed", bits=EXIT_INTEGRITY)
                return False, None
        known = [got.payload if payload else got.content for got in reads]
        differing = [f.relpath for f, h in zip(files, known) if h != known[0]]
        if differing:
            self._outcome(tp, act, "failed", f"replicas differ ({'payload' if payload else 'content'}): "
                          + ", ".join(differing) + f" != {act.source.relpath}", bits=EXIT_INTEGRITY)
            return False, None
        return True, first.content

    def _header_problem(self, tp: TargetPlan, f, header: bytes, where: str) -> str | None:
        """The check the engine's reader fails on this source file's header (its rank
        namespace's digest and payload size, the block's key), worded like the scan's finding."""
        fam = tp.fam
        ids = self._header_ids()
        parsed = layout.parse_block_relpath(f.relpath)
        rank_dir = f.relpath.split("/", 1)[0]
        if rank_dir not in ids or parsed is None:
            return f"header_invalid: no {fam.title} identity in the manifest for {f.relpath}"
        block = parsed[1]
        digest, payload_size = ids[rank_dir]
        check = fam.header_check(header, digest=digest, payload_size=payload_size, hex_hash=block.hex_hash,
                                 group=block.group)
        if check is None:
            return None
        return f"header_invalid: header check '{check}' failed{where}: the {fam.title} reader deletes this file"

    def _header_ids(self) -> dict[str, tuple[bytes, int]]:
        """rank folder -> (identity digest, payload size) of the manifest's namespaces whose
        family writes block headers (what their headers must carry)."""
        if self._header_ids_of is None:
            self._header_ids_of = {}
            for ns in (self.plan.metadata.get("namespaces") or {}).values():
                cfg = ns.get("config_json")
                fam = families.get(ns.get("family"))
                if not fam.header_len or not isinstance(cfg, dict):
                    continue
                try:
                    ident = (fam.target_digest(cfg), int(fam.payload_bytes(cfg)))
                except (KeyError, TypeError, ValueError):
                    continue
                for rank_dir in ns.get("rank_dirs") or ():
                    self._header_ids_of[rank_dir] = ident
        return self._header_ids_of

    # --- transforms -------------------------------------------------------------------

    def _open_sources(self, tp: TargetPlan, act: BlockAction) -> list[int] | None:
        """Open every file a transform reads and check it is still what the scan saw
        (dev, inode, size, mtime on the open fd). None: the block has its outcome."""
        spec = act.transform
        files = act.sources if spec.action != "slice" else (act.source,)
        # (a flat family's page is one file; its whole copies, if any, are compared, not read into it)
        if spec.action != "slice" and not spec.flat and [f.rank for f in files] != list(range(spec.ranks)):
            self._outcome(tp, act, "failed", f"block incomplete: rank files {[f.rank for f in files]} of "
                          f"{spec.ranks}", bits=EXIT_INTEGRITY)
            return None
        fds: list[int] = []
        try:
            for f in files:
                try:
                    fd = open_noatime(self._src_abs(f.relpath))
                except FileNotFoundError:
                    self._outcome(tp, act, "changed_since_scan", f"{f.relpath} vanished since the scan")
                    return None
                except OSError as exc:
                    self._outcome(tp, act, "failed", f"cannot read {f.relpath}: {exc.strerror}",
                                  bits=EXIT_OPERATIONAL)
                    return None
                fds.append(fd)
                why = _stat_differs(os.fstat(fd), f, bytes_checked=f.content_hash is not None)
                if why:
                    self._outcome(tp, act, "changed_since_scan", f"{f.relpath}: {why}")
                    return None
            ready, fds = fds, []
            return ready
        finally:
            for fd in fds:
                os.close(fd)

    def _check_transform_sources(self, tp: TargetPlan, act: BlockAction, fds: list[int]) -> bool:
        """Content checks before a transform acts: a slice's row must hold N equal cells
        and a zero tail; MLA rank files must be equal replicas (content hashes computed
        now when the scan did not take them); with the scan's hashes every file is
        re-hashed (staleness). False: the block has its outcome."""
        spec = act.transform
        files = act.sources if spec.action != "slice" else (act.source,)
        try:
            return self._source_contents_ok(tp, act, spec, files, fds)
        except OSError as exc:
            self._outcome(tp, act, "failed", f"cannot read the sources of {act.action}: {exc.strerror or exc}",
                          bits=EXIT_OPERATIONAL)
            return False

    def _source_contents_ok(self, tp: TargetPlan, act: BlockAction, spec: TransformSpec, files, fds) -> bool:
        if spec.action == "slice":
            h = xxhash.xxh3_128()
            problem = slice_row_problem(fds[0], spec, h)
            pacing.charge(act.source.size)  # the row read whole (--bwlimit)
            if act.source.content_hash is not None and h.digest() != act.source.content_hash:
                self._outcome(tp, act, "changed_since_scan", "source content differs from the scan's hash")
                return False
            if problem:
                self._outcome(tp, act, "failed", f"slice of {act.source.relpath}: {problem}; not placed",
                              bits=EXIT_INTEGRITY)
                return False
            return True
        # every rank file is read once here (the writer reads them again): no transform
        # publishes a row made of a file that is all zero (crash residue) or differs from
        # the scan's hash, nor one of MLA replicas that differ
        hashes = []
        for f, fd in zip(files, fds):
            os.lseek(fd, 0, os.SEEK_SET)
            got = _FileRead(None, *_read_fd(fd, f.size, let_go=False))  # the writer reads it next
            if f.content_hash is not None and got.content != f.content_hash:
                self._outcome(tp, act, "changed_since_scan", f"{f.relpath}: content differs from the scan's hash")
                return False
            problem = _content_problem(got, f.size, "" if f is act.source else f" of {f.relpath}")
            if problem:
                self._outcome(tp, act, "failed", f"{act.action}: {problem}; not placed", bits=EXIT_INTEGRITY)
                return False
            hashes.append(got.content)
        if spec.replicas or spec.flat and len(files) > 1:
            differing = [f.relpath for f, h in zip(files, hashes) if h != hashes[0]]
            if differing:
                self._outcome(tp, act, "failed", "MLA replicas differ (content): " + ", ".join(differing)
                              + f" != {act.source.relpath}", bits=EXIT_INTEGRITY)
                return False
        return True


def _incomplete(tp: TargetPlan, act: BlockAction, ranks: set[int]) -> bool:
    """The block lacks a rank file it needs: every rank's; for a family whose rank files
    are whole copies, none (a page of one file, world 1, is whole whatever its rank)."""
    if tp.fam.copies_whole:
        return act.world > 1 and not ranks <= set(range(act.world))
    return ranks != set(range(act.world))


def _link_devices(tp: TargetPlan) -> list[tuple[int, str]]:
    """(device, a source path on it) of the `link` actions of a target: from the plan's
    counts for a streamed plan, else from its actions."""
    if isinstance(tp.actions, ActionStream):
        return list(tp.actions.tally.link_devs.items())
    out: dict[int, str] = {}
    for act in tp.actions:
        if act.action == "link" and act.source.dev:
            out.setdefault(act.source.dev, act.source.relpath)
    return list(out.items())


def _batches(actions, size: int):
    batch: list[BlockAction] = []
    for act in actions:
        batch.append(act)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _read_batch(prefix: str, acts: list[BlockAction], header_len: int
                ) -> tuple[dict[int, list], dict[int, str | None]]:
    """What the blocks of a batch will check about their sources, taken ahead by a
    helper: the files of blocks the manifest has no hashes for, read (by action id); the
    other sources, lstat-ed (by file id; see `Applier._stale`)."""
    reads: dict[int, list] = {}
    stats: dict[int, str | None] = {}
    for act in acts:
        if _reads_block(act):
            reads[id(act)] = _read_block_files(prefix, act, header_len)
        else:
            for f in (act.sources if act.transform is None else (act.source,)):
                stats[id(f)] = _stale_at(prefix + f.relpath, f)
    return reads, stats


class _FileRead(NamedTuple):
    """What one open and read of a source file found (`Applier._read_checked` judges it)."""

    stale: str | None  # why it no longer is what the scan saw (then nothing was read)
    content: bytes | None  # XXH3-128 of the whole file
    payload: bytes | None  # XXH3-128 after the header (header rewrites compare these)
    header: bytes  # the block header (families that write one: vllm.cpp)
    nread: int
    all_zero: bool
    error: OSError | None = None


def _read_block_files(prefix: str, act: BlockAction, header_len: int) -> list[_FileRead]:
    """Every file of a block read once, source first. Reads only (sources are never
    written): safe in a thread."""
    payload = act.action == "rewrite_header"
    return [_stat_and_read(prefix + f.relpath, f, header_len, payload) for f in act.sources]


def _stat_and_read(path: str, src, header_len: int, payload: bool) -> _FileRead:
    try:
        fd = open_noatime(path)
    except OSError as exc:
        why = _stale_at(path, src)  # the verdict lstat gives: vanished, not a regular file, changed
        return _FileRead(why, None, None, b"", 0, False, None if why else exc)
    try:
        st = os.fstat(fd)
        why = _stat_differs(st, src)
        if why and why != CTIME_MOVED:  # (a moved ctime alone is judged by the main thread: read it all the same)
            return _FileRead(why, None, None, b"", 0, False)
        try:
            if all_holes(fd, st):  # every byte zero: refused as the scan would, without the read
                return _FileRead(why, None, None, os.pread(fd, header_len, 0) if header_len else b"",
                                 st.st_size, True)
            return _FileRead(why, *_read_fd(fd, src.size, header_len, payload))
        except OSError as exc:
            return _FileRead(None, None, None, b"", 0, False, exc)
    finally:
        os.close(fd)


def _read_fd(fd: int, size: int, header_len: int = 0, payload: bool = False, let_go: bool = True
             ) -> tuple[bytes, bytes | None, bytes, int, bool]:
    """The scan's block reader (`kvmigrate.fsio.read_fd`) on an open source file: (its
    XXH3-128, the XXH3-128 after `header_len` bytes if `payload`, those bytes, bytes read,
    every byte zero); reading stops once more than `size` bytes came (it grew)."""
    from kvmigrate.fsio import read_fd

    return read_fd(fd, size, header_len, payload, let_go=let_go)


def _content_problem(got: _FileRead, size: int, where: str = "") -> str | None:
    """What a read shows is wrong with a block file (`where`: " of <relpath>" for a file
    other than the one the outcome line names), worded like the scan's finding."""
    if got.nread == 0:
        return f"short: the file{where} is empty"
    if got.all_zero:
        return f"zero_filled: all {got.nread} bytes{where} are zero (crash residue)"
    if got.nread != size:
        return f"size_mismatch: {got.nread} bytes read{where}, the manifest says {size}"
    return None


def _stale_at(path: str, src) -> str | None:
    """Why a source no longer is what the scan saw, or None (by lstat)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "source vanished since the scan"
    except OSError as exc:
        return f"source cannot be read: {exc.strerror}"
    return _stat_differs(st, src)


def _reads_block(act: BlockAction) -> bool:
    """The block's files are read and checked before it is placed (see `Applier._block`);
    a transform reads its sources itself (`Applier._check_transform_sources`)."""
    return act.transform is None and _unhashed(act)


def _unhashed(act: BlockAction) -> bool:
    """The manifest lacks a content (payload, for header rewrites) hash of a file of
    the block: the scan did not read it, so apply must."""
    if act.action == "rewrite_header":
        return any(f.payload_hash is None for f in act.sources)
    return any(f.content_hash is None for f in act.sources)


def apply_plan(plan: Plan, **kwargs: Any) -> ApplyResult:
    """Python API: execute a plan (see `Applier`)."""
    return Applier(plan, **kwargs).run()
