"""The crash seam of the kill -9 tests: `KVMIGRATE_CRASH_AT=<point>:<n>[:TERM]` makes the
process SIGKILL (or SIGTERM) itself at the n-th <point> of a protocol. One module for
every command that has points, so none of them imports another's machinery for it.

Points: intent, tmp_written, linked, created, transform_write (migrate --apply);
prune_intent, prune_move, prune_dirs (prune --apply); restore; purge.
"""

from __future__ import annotations

import os
import signal

CRASH_ENV = "KVMIGRATE_CRASH_AT"


class CrashSeam:
    """Lets the kill -9 tests stop the process at an exact point of the protocol."""

    def __init__(self) -> None:
        point, _, rest = os.environ.get(CRASH_ENV, "").partition(":")
        n, _, sig = rest.partition(":")
        self.point = point or None
        self.left = int(n) if n.isdigit() else 1
        self.signal = getattr(signal, f"SIG{sig}", signal.SIGKILL) if sig else signal.SIGKILL

    def hit(self, point: str) -> None:
        if point == self.point:
            self.left -= 1
            if self.left == 0:
                os.kill(os.getpid(), self.signal)
