"""What a migration run reports: its result (outcomes, counts, findings), the
operational stops it ends on with their message and hint, and the text of both."""

from __future__ import annotations

import errno
import shlex
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvmigrate.errors import EXIT_INTEGRITY, EXIT_OPERATIONAL, OS_WHAT, OperationalError
from kvmigrate.migrate.model import OUTCOMES
from kvmigrate.units import plural

if TYPE_CHECKING:
    from kvmigrate.migrate.model import Plan

_OS_HINT = {errno.ENOSPC: "free space on the destination, then rerun the same command: it resumes from the journal",
            errno.EDQUOT: "raise the quota or free space, then rerun the same command to resume",
            errno.EACCES: "run as a user that may write the destination, then rerun the same command to resume",
            errno.EPERM: "run as a user that may write the destination, then rerun the same command to resume",
            errno.EROFS: "the destination is on a read-only filesystem: remount it read-write, then rerun the same "
                         "command to resume; or migrate onto a writable filesystem: --dest DIR (with --mode copy: "
                         "hard links cannot cross filesystems)",
            errno.EIO: "check the device (dmesg), then rerun the same command to resume"}


class Stop(Exception):
    """An operational stop: the journal is synced, locks released, then it is raised."""

    def __init__(self, error: OperationalError):
        self.error = error


def oserror_stop(exc: OSError, where: str, doing: str) -> Stop:
    what = OS_WHAT.get(exc.errno or 0, exc.strerror or str(exc))
    return Stop(OperationalError(f"{doing} failed: {what}", path=where,
                                  hint=_OS_HINT.get(exc.errno or 0, "fix the cause, then rerun the same command: "
                                                                    "it resumes from the journal")))


@dataclass
class ApplyResult:
    outcomes: Counter = field(default_factory=lambda: Counter({o: 0 for o in OUTCOMES}))
    per_target: dict[str, Counter] = field(default_factory=dict)
    linked: int = 0  # created as hard links
    copied: int = 0  # created as new files (copy, copy_pad, rewrite_header)
    link_copies: int = 0  # `link` actions materialized as copies (--mode copy/auto)
    transformed: int = 0  # new files written by slice / concat / relayout (counted in `copied` too)
    bytes_written: int = 0
    findings: list[str] = field(default_factory=list)  # conflict / failed / changed lines
    namespace_errors: list[str] = field(default_factory=list)
    bits: int = 0
    stop: OperationalError | None = None
    journal_path: str | None = None
    resumed: bool = False
    recovered: int = 0  # outputs of an interrupted run proven and adopted on resume
    # source namespace -> facts not given: left out, their target is a guess (exit bit 1)
    left_out: dict[str, list[str]] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        code = self.bits
        if self.stop is not None:
            code |= EXIT_OPERATIONAL
        return code

    def to_dict(self) -> dict[str, Any]:
        return {"outcomes": dict(self.outcomes), "linked": self.linked, "copied": self.copied,
                "link_copies": self.link_copies, "transformed": self.transformed, "bytes_written": self.bytes_written,
                "per_target": {k: dict(v) for k, v in self.per_target.items()},
                "findings": self.findings, "namespace_errors": self.namespace_errors,
                "journal": self.journal_path, "resumed": self.resumed, "recovered": self.recovered,
                "left_out_guessed": [{"namespace": b, "facts": f} for b, f in sorted(self.left_out.items())],
                "stopped": str(self.stop) if self.stop else None}


def render_result(plan: Plan, result: ApplyResult) -> str:
    lines = [("migration stopped early in " if result.stop else "migration applied to ") + plan.dest
             + (" (resumed an interrupted run)" if result.resumed else "")]
    if result.recovered:
        lines.append(f"  adopted {result.recovered} outputs of the interrupted run")
    for base, c in sorted(result.per_target.items()):
        parts = ", ".join(f"{k} {c[k]}" for k in OUTCOMES if c.get(k))
        lines.append(f"target namespace {base}: {parts or 'nothing to do'}")
    for tp in plan.targets:
        for (action, reason), n in sorted(tp.skipped.items()):
            lines.append(f"  skipped {plural(n, 'block')} ({action}): {reason}")
    o = result.outcomes
    lines.append("outcomes: " + ", ".join(f"{k} {o.get(k, 0)}" for k in OUTCOMES))
    lines.append(f"  created as hard links {result.linked}, as new files {result.copied}"
                 f" ({result.link_copies} links copied by --mode, {result.transformed} by transforms)")
    for err in result.namespace_errors:
        lines.append(f"error: {err}")
    if result.left_out:
        from kvmigrate.identity.facts import FLAGS

        lines.append(f"not placed: {plural(len(result.left_out), 'namespace')} whose target is a guess (it depends on "
                     "facts not given; the dry run prints the command that states them):")
        lines += [f"  {base}: state {', '.join(FLAGS.get(f, f) for f in facts)}"
                  for base, facts in sorted(result.left_out.items())]
    if plan.integrity_rows:  # not migrated, not failed on (audit's exit code): say where they are
        one = plan.integrity_rows == 1
        lines.append(f"integrity findings in the manifest: {plural(plan.integrity_rows, 'file')} "
                     f"{'is' if one else 'are'} damaged or suspect and {'was' if one else 'were'} not migrated; "
                     f"details: kvmigrate audit {shlex.quote(plan.root)}")
    shown = result.findings[:20]
    for f in shown:
        lines.append(f"  {f}")
    if len(result.findings) > len(shown):
        lines.append(f"  ... and {len(result.findings) - len(shown)} more (see the journal)")
    if result.journal_path:
        lines.append(f"journal: {result.journal_path}")
        lines.append(f"undo: kvmigrate rollback {result.journal_path}")
        lines.append(f"check: kvmigrate verify {plan.dest} --journal {result.journal_path}")
    return "\n".join(lines)


def _count_skipped(plan: Plan) -> int:
    return sum(sum(tp.skipped.values()) for tp in plan.targets)


def finish_counts(plan: Plan, result: ApplyResult) -> None:
    """Blocks the manifest already found in place count as already_present; needs_*
    blocks are skipped with a count (migration.md §1)."""
    result.outcomes["skipped_needs_transform"] += _count_skipped(plan)
    if plan.conflicts:  # target paths the scan already found taken by other bytes
        result.outcomes["conflict"] += plan.conflicts
        result.bits |= EXIT_INTEGRITY
    for tp in plan.targets:
        per = result.per_target.setdefault(tp.base_name, Counter())
        if tp.conflicts:
            per["conflict"] += sum(tp.conflicts.values())
            result.findings += [f"conflict: {reason} ({plural(n, 'block')})" for reason, n in sorted(tp.conflicts.items())]
        n = sum(tp.skipped.values())
        if n:
            per["skipped_needs_transform"] += n
        if tp.already_present[0]:
            per["already_present"] += tp.already_present[0]
            result.outcomes["already_present"] += tp.already_present[0]
