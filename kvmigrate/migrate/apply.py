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

This module runs the plan (journal, locks, resume, batches); its collaborators live beside
it and share only the run's state (`state.py`): folders `dirs.py`, the checks of a block's
sources `sources.py`, placing a block or a config.json `place.py` (called by each action's
kind, `actions.py`); proof of an interrupted run's outputs is `reconcile.py`, the result
`result.py`.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvmigrate import layout, pacing
from kvmigrate.errors import EXIT_INTEGRITY, OperationalError, UsageError
from kvmigrate.migrate import journal as jn
from kvmigrate.migrate.actions import ACTIONS
from kvmigrate.migrate.crash import CRASH_ENV  # noqa: F401 (CRASH_ENV: the tests' name)
from kvmigrate.migrate.crash import CrashSeam as _CrashSeam
from kvmigrate.migrate.dirs import Batch, FolderMaker
from kvmigrate.migrate.fsops import DestTree, SymlinkInPath, check_relpath
from kvmigrate.migrate.lock import NamespaceLock
from kvmigrate.migrate.model import BlockAction, Plan, TargetPlan
from kvmigrate.migrate.place import Placer
from kvmigrate.migrate.plan import ActionStream
from kvmigrate.migrate.reconcile import reconcile_item, tmp_name, tmp_paths, unlink_quiet
from kvmigrate.migrate.result import ApplyResult, Stop, finish_counts
from kvmigrate.migrate.runs import claimed_by_others
from kvmigrate.migrate.sources import SourceChecks, read_batch, reads_block
from kvmigrate.migrate.state import ApplyState, Helpers
from kvmigrate.migrate.store_apply import DestStoreApplier, StoreApplier
from kvmigrate.migrate.stores import check_proofs

MODES = ("link", "copy", "auto")
BATCH = 1024
_HELPERS = 3  # threads: two folder makers and a block reader (all mostly in the kernel)


class Applier:
    """Runs a plan. Two hooks let scale-out (kvmigrate.scaleout) split a run into parts:
    `take_locks=False`: a part, whose driver holds every namespace lock for the run;
    `place_blocks`: a driver, which gives each target its journal record, config.json
    and rank folder, then calls place_blocks() (the parts) while it holds the locks.

    The Applier owns the run's order (journal, locks, resume, targets, batches); the
    work is its collaborators', made by `run()` once the journal is open and sharing
    only the run's `ApplyState`: `folders` (dirs.FolderMaker), `sources`
    (sources.SourceChecks) and `placer` (place.Placer, which each action kind executes
    through)."""

    # made by run() once the journal is open (the journal is the one thing they all write)
    state: ApplyState
    folders: FolderMaker
    sources: SourceChecks
    placer: Placer

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
        self.helpers = Helpers(_HELPERS)  # the block reader and the folder makers
        self.journal: jn.JournalWriter | None = None  # None until opened (a stop may come first)
        self._resume_runs: list[jn.Run] = []  # the journal's runs, when it resumes one
        self._run_id: str | None = None  # the journal run this apply writes (a new one, or the one it resumes)
        self._unpaired: set[str] = set()  # GDS data files this run could not place: their sidecars wait

    # --- entry point ------------------------------------------------------------------

    def run(self) -> ApplyResult:
        plan = self.plan
        if not os.path.isdir(plan.dest):
            raise UsageError(f"destination {plan.dest} is not a directory", path=plan.dest,
                             hint="create it first, or pass an existing directory to --dest")
        work = [tp for tp in plan.targets if tp.actions]
        if self.mode == "link":
            self._check_same_filesystem(work)
        into_dest = os.path.abspath(plan.dest) != os.path.abspath(plan.root)
        if not into_dest:  # (into another folder, a store under ROOT is only read: no proof needed)
            check_proofs(plan.root, plan.stores)
        tree = DestTree(plan.dest)
        locks: list[NamespaceLock] = []
        stores: StoreApplier | None = None
        try:
            journal = self._open_journal()
            self._start(tree, journal)
            try:
                # the resumed runs with store records, read from the journal a part at a time
                # (`load_runs` above held none of them)
                resumed = [r for r in jn.stream_runs(journal.path) if r.stored_in_file] if self._resume_runs else []
                if into_dest and plan.stores:  # (mooncake.md §3.6: DIR then holds what the target reads)
                    stores = DestStoreApplier(plan.root, plan.dest, plan.stores, journal, self._run_id or "",
                                              self.crash.hit, self.mode)
                elif plan.stores or resumed:  # every store's proof before the first write of the run (§5.1)
                    stores = StoreApplier(plan.root, plan.stores, journal, self._run_id or "", self.crash.hit,
                                          resumed)
                    stores.take_proofs()
                for tp in work:
                    if not tp.flat:  # (a flat target's files go into the destination directory itself)
                        self.folders.ensure_dirs([tp.base_name])
                    elif tp.lock_dir:  # a tier's folder holds its lock (a tier made in --dest DIR)
                        self.folders.ensure_dirs([tp.lock_dir])
                if self.take_locks:
                    self._lock_namespaces(work, locks)
                self._resume_pending()
                self._targets(work)
                if stores is not None:
                    stores.apply()
                    self.result.outcomes.update(stores.outcomes)
                    self.result.findings += stores.skipped
            except SymlinkInPath as exc:
                raise Stop(OperationalError(f"refusing to write through a symlink or non-directory: {exc.filename}",
                                             path=exc.filename, hint="remove it or pass --dest DIR")) from None
            except OperationalError as exc:
                raise Stop(exc) from None
            # release (and remove) the locks before "complete": a kill in between leaves a run the next
            # one resumes and tidies, never a complete journal with a lock file nobody removes
            self.helpers.drain()
            for lock in reversed(locks):
                lock.release()
            journal.write({"t": "complete", "outcomes": dict(self.result.outcomes)}, sync=True)
        except Stop as stop:
            self.result.stop = stop.error
            self.helpers.drain()  # helper threads finish their batch before the run says it stopped
            if self.journal is not None:
                self.journal.write({"t": "stopped", "error": str(stop.error)}, sync=True)
        except KeyboardInterrupt as exc:
            # Ctrl-C / SIGTERM / --max-duration: leave the run resumable (locks released,
            # journal synced), and say where its journal is
            self.helpers.drain()
            if self.journal is not None:
                self.journal.write({"t": "interrupted"}, sync=True)
            why = str(exc) if isinstance(exc, pacing.OutOfTime) else "interrupted (Ctrl-C or SIGTERM)"
            raise pacing.Interrupted(why, journal=self.result.journal_path) from exc
        finally:
            self.helpers.drain()  # nothing is made under a namespace lock once it is released
            for lock in reversed(locks):
                lock.release()
            if stores is not None:
                stores.release()
            if self.journal is not None:
                self.journal.close()
            tree.close()
        if plan.placed_integrity_rows:  # other rows' findings are reported, not failed on (interface.md §4)
            self.result.bits |= EXIT_INTEGRITY
        finish_counts(plan, self.result)
        return self.result

    def _lock_namespaces(self, work: list[TargetPlan], locks: list[NamespaceLock]) -> None:
        """Every namespace this run or the run it resumes touches is locked before
        anything is reconciled or written (a lock left by a killed run is taken over,
        and removed on release). A scale-out part skips this (`take_locks`): its driver holds them."""
        for base in sorted({tp.lock_dir for tp in work} | self._resumed_bases()):
            lock = NamespaceLock.acquire(self.state.tree, base)
            locks.append(lock)
            if lock.created:
                self.state.journal.write({"t": "lock", "path": lock.relpath})

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
        self.folders.ensure_dirs(ready)
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

    def _open_journal(self) -> jn.JournalWriter:
        """The run's journal: the one of an interrupted run of the same identity (resumed),
        or a new one. Default: ROOT/.kvmigrate/journals (migration.md §3.5), also with
        --dest: every migration of a root is journaled in one place."""
        arg = self.journal_arg or jn.default_journal_dir(self.plan.root)
        run_id = jn.new_run_id()
        header = {"run_id": run_id, "command": self.command, "manifest": self.plan.manifest_path,
                  "root": self.plan.root, "dest": self.plan.dest, "target_profile": self.plan.target_profile,
                  "identity": self.identity, "pid": os.getpid(), "mode": self.mode}
        found = jn.find_resumable(arg, self.identity)
        if found is not None:
            journal = jn.JournalWriter.resume(found, {"pid": os.getpid(), "command": self.command, "mode": self.mode})
            self.result.resumed = True
            self._resume_runs = jn.load_runs(found, stores=False)
            self._run_id = self._resume_runs[-1].header.get("run_id") if self._resume_runs else None
        else:
            path = arg
            if not jn.is_journal_name(arg) and (os.path.isdir(arg) or not os.path.exists(arg)):
                path = os.path.join(arg, f"{run_id}{jn.SUFFIX}")
            journal = jn.JournalWriter.create(path, header, read_only=self._read_only_dest)
            self._resume_runs = []
            self._run_id = run_id
        self.journal = journal
        self.result.journal_path = journal.path
        return journal

    def _start(self, tree: DestTree, journal: jn.JournalWriter) -> None:
        """Make the run's collaborators: they share its tree, journal, result, crash seam
        and mode (`ApplyState`), nothing else of the Applier."""
        src_prefix = self.plan.root if self.plan.root.endswith("/") else self.plan.root + "/"
        self.state = ApplyState(tree, journal, self.result, self.crash, self.mode, src_prefix)
        self.folders = FolderMaker(self.state, self.helpers)
        self.sources = SourceChecks(self.state, self.plan, self.journal_arg, self._run_id)
        self.placer = Placer(self.state, self.sources)

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
        tree, journal = self.state.tree, self.state.journal
        digests = {b: bytes.fromhex(r["digest"]) for b, r in run.targets.items() if r.get("digest")}
        pending = run.pending()
        # a path another run journaled as its own is never adopted (its inode may be the very
        # one this run intended: a hard link of the same source)
        others = claimed_by_others([jn.default_journal_dir(self.plan.root), os.path.dirname(journal.path)],
                                   [journal.path], {item["path"] for item in pending}, self.plan.dest)
        for item in pending:
            if item["path"] in others:
                continue
            adopted = reconcile_item(tree, run.root, item, digests)
            if adopted is not None:
                journal.done(adopted)
                self.result.recovered += 1
        for item in run.intents.values():
            for tmp in tmp_paths(item):
                unlink_quiet(tree, tmp)
        journal.sync()

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
                if "/" not in base and self.state.tree.is_dir(base):
                    out.add(base)
        return out

    # --- targets (config.json: `place.Placer`, the folders: `dirs.FolderMaker`) -------------

    def _target(self, tp: TargetPlan) -> None:
        self.result.per_target.setdefault(tp.base_name, Counter())
        journal = self.state.journal
        if tp.flat:  # file names in the destination directory: no identity digest, no config.json
            journal.write({"t": "target", "base": tp.base_name, "family": tp.family, "rank_dir": "",
                                "lock_dir": tp.lock_dir, "flat": True, "sources": tp.sources,
                                "model_name": tp.fields.get("model")}, sync=True)
        else:
            journal.write({"t": "target", "base": tp.base_name, "family": tp.family, "rank_dir": tp.rank_dir,
                                "digest": tp.digest.hex(), "sources": tp.sources,
                                "payload_size": tp.fam.payload_bytes(tp.fields)},
                               sync=True)
        problem = None if tp.flat else self.placer.place_config(tp)
        if problem:
            self.result.namespace_errors.append(problem)
            self.result.bits |= EXIT_INTEGRITY
            for act in tp.actions:
                self.state.outcome(tp, act, "conflict", "target config.json describes another identity", quiet=True)
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
            self.folders.judge_dirs(upcoming)
            prepared = upcoming
        if prepared is not None:
            self._blocks(tp, prepared)
        if out_of_time:
            pacing.check_deadline()

    # --- blocks -----------------------------------------------------------------------

    def _prepare(self, tp: TargetPlan, batch: list[BlockAction]) -> Batch:
        """Journal a batch's intent (fsynced), then hand its folders and block reads to
        the helper threads."""
        missing = self.folders.missing_dirs(sorted({act.target_relpath.rsplit("/", 1)[0] for act in batch
                                             if "/" in act.target_relpath}))
        fresh = set(missing)
        items: list[dict[str, Any]] = [{"kind": "dir", "path": d} for d in missing]
        for act in batch:
            item = {"kind": "block", "path": act.target_relpath, "action": act.action, "src": act.source.relpath,
                    "dev": act.source.dev, "ino": act.source.inode, "size": act.source.size, "base": tp.base_name}
            folder = act.target_relpath.rsplit("/", 1)[0] if "/" in act.target_relpath else ""
            if folder not in fresh and not self.state.tree.was_made(folder) and self._present(act.target_relpath):
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
        self.state.journal.intent(items)
        self.crash.hit("intent")
        reads = self.helpers.submit(read_batch, self.state.src_prefix, batch, tp.fam.header_len)
        return Batch(batch, missing, self.folders.start_dirs(missing), reads)

    def _present(self, relpath: str) -> bool:
        try:
            return self.state.tree.lstat(relpath) is not None
        except (SymlinkInPath, NotADirectoryError):
            return True  # something is in the way: placing will say what

    def _blocks(self, tp: TargetPlan, prepared: Batch) -> None:
        """Materialize the blocks of a batch whose folders exist, in order; one fsync."""
        self.sources.begin_batch(*(prepared.reads.result() if prepared.reads is not None else ({}, {})))
        for act in prepared.actions:
            self._block(tp, act)
            if self.progress:
                self.progress(1)
        self.sources.end_batch()
        self.state.journal.sync()

    def _block(self, tp: TargetPlan, act: BlockAction) -> None:
        """One block: its sources checked (`sources.SourceChecks`), then placed by its
        action kind through the placer."""
        if reads_block(act):
            # the manifest lacks the block's hashes: each file is stat-ed and read through one
            # open (by the batch's reader thread) and checked before anything is published
            ok, computed = self.sources.read_checked(tp, act)
        else:
            why = self.sources.stale(act.source, act)
            if why:
                return self.state.outcome(tp, act, "changed_since_scan", why)
            # a transform checks its sources itself (`SourceChecks.check_transform_sources`)
            multi = act.world > 1 and act.transform is None
            ok, computed = self.sources.check_replicas(tp, act) if multi else (True, None)
        if not ok:
            return
        paired = tp.fam.paired_files and tp.fam.pair_of(act.target_relpath)
        if paired and tp.fam.removed_first(act.target_relpath) and (
                paired in self._unpaired or not self._present(paired)):
            # a GDS sidecar is published only after its data file (lmcache.md §5): an engine's
            # probe reads the sidecar, then the data
            return self.state.outcome(tp, act, "failed", f"its data file {paired} was not placed; the sidecar "
                                      "never goes first", bits=EXIT_INTEGRITY)
        placed = self.result.outcomes["created"] + self.result.outcomes["already_present"] if paired else 0
        try:
            ACTIONS[act.action].execute(self.placer, tp, act, computed or act.source.content_hash)
        except SymlinkInPath as exc:
            self.state.outcome(tp, act, "conflict", f"{exc.filename} is a symlink or not a directory; not written through")
        if paired and not tp.fam.removed_first(act.target_relpath) and \
                self.result.outcomes["created"] + self.result.outcomes["already_present"] == placed:
            self._unpaired.add(act.target_relpath)  # (its sidecar, next, is not placed)


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


def apply_plan(plan: Plan, **kwargs: Any) -> ApplyResult:
    """Python API: execute a plan (see `Applier`)."""
    return Applier(plan, **kwargs).run()
