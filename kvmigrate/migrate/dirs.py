"""The folders of a migration: which a batch of blocks needs, made by helper threads
while the previous batch is linked, judged in order by the main thread and journaled."""

from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvmigrate import layout
from kvmigrate.migrate.fsops import SymlinkInPath
from kvmigrate.migrate.result import oserror_stop

if TYPE_CHECKING:
    from kvmigrate.migrate.model import BlockAction
    from kvmigrate.migrate.state import ApplyState, Helpers

_DIR_CACHE = 4096  # folders remembered as existing / created by this run (bounded memory)
_PARALLEL_DIRS = 64  # folders in a batch from which two helper threads make them
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


@dataclass
class Batch:
    """A batch of actions whose intent is journaled, with its helpers' work under way."""

    actions: list[BlockAction]
    missing: list[str]  # its folders that did not exist, parents first
    dirs: list[Future]  # -> {folder: True | "exists" | OSError | None (not tried)}
    reads: Future | None  # -> ({id(action): [FileRead per file]}, {id(file): why stale})


class FolderMaker:
    """The folders of a run: which are missing, made by the helper threads, judged in
    order and journaled. It writes only through the run's tree and journal (`state`),
    and remembers the folders it knows exist (a bounded cache: one lstat per folder, not
    per block)."""

    def __init__(self, state: ApplyState, helpers: Helpers) -> None:
        self.tree = state.tree
        self.journal = state.journal
        self.helpers = helpers
        self._known_dirs: set[str] = set()  # folders known to exist (a cache, cleared when large)

    def missing_dirs(self, reldirs: list[str]) -> list[str]:
        """Folders (and their parents, parents first) that do not exist yet. A folder in
        one this run created is missing without an lstat (a fresh target namespace is
        made without one stat per folder); one that appeared meanwhile is found by
        mkdir (EEXIST) and not counted as ours."""
        missing: list[str] = []
        missing_set: set[str] = set()
        if len(self._known_dirs) > _DIR_CACHE:
            self._known_dirs.clear()  # a cache only: actions come in path order
        for reldir in reldirs:
            if reldir in self._known_dirs:
                continue
            parts = reldir.split("/")
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d in self._known_dirs or d in missing_set:
                    continue
                parent = d.rpartition("/")[0]
                if parent in missing_set or self.tree.was_made(parent) or not self.tree.is_dir(d):
                    missing.append(d)
                    missing_set.add(d)
                else:
                    self._known_dirs.add(d)
        return missing

    def start_dirs(self, missing: list[str]) -> list[Future]:
        """Hand the folders of a batch (parents first) to the helper threads: those of one
        <hhh> bucket to one thread, two threads unless a namespace folder is among them.
        Each starts from existing folders, opened here (O_NOFOLLOW, as `DestTree`)."""
        if not missing:
            return []
        shards: list[list[str]] = [missing]
        if len(missing) >= _PARALLEL_DIRS and all(d.count("/") >= 2 for d in missing):
            shards = [[], []]
            for d in missing:
                bucket = d.split("/", 2)[1]
                shards[int(bucket, 16) % 2 if layout.BUCKET_RE.match(bucket) else 0].append(d)
        new = set(missing)
        opened: list[dict[str, int]] = []
        try:
            for shard in shards:
                anchors: dict[str, int] = {}
                opened.append(anchors)
                for d in shard:
                    parent = d.rpartition("/")[0]
                    if parent not in new and parent not in anchors:
                        anchors[parent] = os.dup(self.tree.dir_fd(parent))  # the tree may close its own
        except OSError:
            for anchors in opened:
                for fd in anchors.values():
                    os.close(fd)
            return []  # a parent cannot be opened: `judge_dirs` makes them one by one and says why
        return [self.helpers.submit(_make_folders, anchors, shard) for anchors, shard in zip(opened, shards)]

    def judge_dirs(self, prepared: Batch) -> None:
        """Outcomes of a batch's folders in order (see `_judge`)."""
        self._judge(prepared.dirs, prepared.missing)

    def _judge(self, jobs: list[Future], missing: list[str]) -> None:
        """Outcomes of folders in order, as if made here one by one: made, found (not
        ours), in the way (symlink / not a directory), an error (stop). A folder a helper
        could not try is made here. One done record names those this run made."""
        made: dict[str, Any] = {}
        for job in jobs:
            made.update(job.result())
        created = []
        for d in missing:
            try:
                outcome = made.get(d)
                if isinstance(outcome, OSError):
                    raise outcome
                if outcome is None or outcome == "exists":
                    outcome = self.tree.mkdir(d)  # (for "exists": False, or SymlinkInPath)
            except SymlinkInPath:
                raise
            except OSError as exc:
                raise oserror_stop(exc, self.tree.abspath(d), "creating a folder") from None
            if outcome:
                created.append(d)
                self.tree.made(d)
            self._known_dirs.add(d)
        if created:
            self.journal.done({"kind": "dirs", "paths": created})

    def _make_dirs(self, missing: list[str]) -> None:
        """Create folders an fsynced intent listed; one done record names those this run
        really created (a folder that appeared meanwhile is not ours)."""
        self._judge(self.start_dirs(missing), missing)

    def ensure_dirs(self, reldirs: list[str]) -> None:
        """Make the folders (and their parents) that are missing: intent, made, synced."""
        missing = self.missing_dirs(reldirs)
        if missing:
            self.journal.intent([{"kind": "dir", "path": d} for d in missing])
            self._make_dirs(missing)
            self.journal.sync()


def _make_folders(anchors: dict[str, int], folders: list[str]) -> dict[str, Any]:
    """mkdir each folder (parents first) in its parent: an existing folder's fd from
    `anchors`, or a folder made here, opened with O_NOFOLLOW. -> {folder: True (made),
    "exists", the OSError, or None (not tried: its parent could not be opened)}. Closes
    every fd it was given or opened."""
    parents = {d.rpartition("/")[0] for d in folders}
    fds = dict(anchors)
    opened = set(anchors)
    out: dict[str, Any] = {}
    try:
        for d in folders:
            parent, _, name = d.rpartition("/")
            pfd = fds.get(parent)
            if pfd is None:
                out[d] = None
                continue
            try:
                os.mkdir(name, 0o777, dir_fd=pfd)
                out[d] = True
            except FileExistsError:
                out[d] = "exists"
            except OSError as exc:
                out[d] = exc
                continue
            if d in parents:
                try:
                    fds[d] = os.open(name, _DIR_FLAGS, dir_fd=pfd)
                    opened.add(d)
                except OSError:
                    pass  # its folders are made by `_judge`, which says what is wrong
    finally:
        for d in opened:
            os.close(fds[d])
    return out
