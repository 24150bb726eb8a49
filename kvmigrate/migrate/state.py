"""What the parts of one `migrate --apply` run share: the destination tree, the journal,
the result, the crash seam and the mode (`ApplyState`), and the helper threads
(`Helpers`). The Applier (`apply.py`) makes them once its journal is open and hands them
to its collaborators: the folder maker (`dirs.py`), the source checks (`sources.py`) and
the placer (`place.py`). Each takes them in its constructor, so what a part may touch is
written down in one place rather than found on a shared `self`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kvmigrate.errors import EXIT_INTEGRITY

if TYPE_CHECKING:
    from kvmigrate.migrate.crash import CrashSeam
    from kvmigrate.migrate.fsops import DestTree
    from kvmigrate.migrate.journal import JournalWriter
    from kvmigrate.migrate.model import BlockAction, TargetPlan
    from kvmigrate.migrate.result import ApplyResult

_T = TypeVar("_T")


@dataclass(frozen=True)
class ApplyState:
    """The fixed references of one run (frozen: none of them is replaced while it runs,
    so a part may keep its own reference to the tree or the journal). Every block outcome
    goes through `outcome`, whichever part decides it, so the result, the findings and the
    journal's skip records always agree."""

    tree: DestTree  # the destination, opened without following symlinks
    journal: JournalWriter  # this run's journal (a new one, or the one it resumes)
    result: ApplyResult  # what the run reports, counted as it goes
    crash: CrashSeam  # the kill -9 tests' points
    mode: str  # link | copy | auto
    src_prefix: str  # the source root, with a trailing "/"

    def src_abs(self, relpath: str) -> str:
        """The absolute path of a source file (os.path.join(root, relpath) for a checked relpath)."""
        return self.src_prefix + relpath

    def outcome(self, tp: TargetPlan, act: BlockAction, outcome: str, why: str = "", quiet: bool = False,
                bits: int = 0) -> None:
        """Count a block's outcome; a conflict, a change since the scan and a failure are
        also a finding (unless `quiet`) and a journal skip record."""
        result = self.result
        result.outcomes[outcome] += 1
        per_target = result.per_target.get(tp.base_name)
        if per_target is None:
            per_target = result.per_target[tp.base_name] = Counter()
        per_target[outcome] += 1
        if outcome in ("conflict", "changed_since_scan", "failed"):
            if not quiet:
                result.findings.append(f"{outcome}: {self.tree.abspath(act.target_relpath)} "
                                       f"(from {act.source.relpath}): {why}")
            self.journal.write({"t": "skip", "path": act.target_relpath, "outcome": outcome, "why": why})
            if outcome == "conflict":
                bits |= EXIT_INTEGRITY
            # changed_since_scan: reported, not failed on; the run did all it could (interface.md §4)
        result.bits |= bits


class Helpers:
    """The run's helper threads (folder makers and the block reader: mostly in the
    kernel), started when first needed. `drain` waits for them: the Applier drains before
    it releases a namespace lock, so nothing is made under a lock once it is gone; a
    later `submit` starts them again."""

    def __init__(self, workers: int) -> None:
        self._workers = workers
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="kvmigrate-io")
        return self._pool.submit(fn, *args)

    def drain(self) -> None:
        """Wait for the helper threads (at most one batch of folders and reads)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
