"""`ScanOptions`: how a scan runs, carried whole from the command line through the
pipeline and the Ray runner to the scan stage's `scan()`. Each default lives here once:
the CLI's option defaults, the pipeline's and scale-out's read them from this module.
(Below the stages, and light: the CLI imports it before pyarrow may load.)"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvmigrate.identity.values import DEFAULT_PROFILE

if TYPE_CHECKING:  # (fractions imports decimal: a few ms of every command's start-up)
    from fractions import Fraction

    from kvmigrate.identity.facts import FactsResolver
    from kvmigrate.selection import Selection

VERIFY_LEVELS = ("none", "size", "hash")
DEFAULT_VERIFY = "size"  # `scan`, `audit`: stat only unless --verify hash
# `migrate ROOT`, `prune ROOT`: their own scan hashes unless --verify is given (a plan is
# proven, a replica pruned only where its equality is)
PLANNING_VERIFY = "hash"
DEFAULT_SHARD = (0, 1)


class LoadedBaseline(Protocol):
    """A --baseline already read: a --run-on ray part's rows (kvmigrate.scan.baseline.Baseline)."""

    def metadata(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ScanOptions:
    """Everything `scan()` takes besides the root, the output and the other stages'
    callbacks (see kvmigrate.scan.run.scan for what each does).

    `baseline` is a path, `auto`, or (in a --run-on ray part) the part's rows already
    loaded; `recheck` the fraction of carried-over buckets re-read (None: the default,
    only allowed with a baseline)."""

    target: str = DEFAULT_PROFILE
    facts_resolver: FactsResolver | None = None
    verify: str = DEFAULT_VERIFY
    threads: int | None = None
    shard: tuple[int, int] = DEFAULT_SHARD
    progress: bool = False
    command: str | None = None
    workers: int | None = None
    selection: Selection | None = None
    baseline: str | LoadedBaseline | None = None
    recheck: Fraction | None = None
    history: str | None = None

    def but(self, **changes: Any) -> ScanOptions:
        """A copy with `changes` (dataclasses.replace)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def planning(cls, verify: str | None = None, **fields: Any) -> ScanOptions:
        """The options of the scan `migrate ROOT` and `prune ROOT` run first: at
        PLANNING_VERIFY unless `verify` is given."""
        return cls(verify=verify or PLANNING_VERIFY, **fields)
