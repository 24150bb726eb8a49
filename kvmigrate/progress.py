"""The one progress bar: tqdm on stderr, imported only when shown; silent when stderr is
not a terminal or -q (the caller passes `enabled`). The scan counts bucket visits with
files, bytes and rate as a postfix, the plan rows checked, the apply blocks placed.

Log lines (kvmigrate.cli.common.setup_logging) go through `write_line`, above an open
bar instead of through it."""

from __future__ import annotations

import sys
import time
from typing import Any

_OPEN = 0  # bars shown and not closed yet, in this process


class Bar:
    """A bar whose total is known up front (`total`), or at the first `update(done,
    total)` (the plan's rows). `advance(n)` adds n; `update(done, total)` sets the count."""

    def __init__(self, enabled: bool, desc: str, unit: str, total: int | None = None, *,
                 unit_scale: bool = True, dynamic_ncols: bool = True):
        self.enabled, self.desc, self.unit = enabled, desc, unit
        self.options: dict[str, Any] = {"unit_scale": unit_scale, "dynamic_ncols": dynamic_ncols}
        self.bar: Any = None
        if enabled and total is not None:
            self._open(total)

    def _open(self, total: int) -> None:
        global _OPEN
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit=self.unit, file=sys.stderr, desc=self.desc, leave=True, **self.options)
        _OPEN += 1

    def update(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            self._open(total)
        self.bar.update(done - self.bar.n)

    def advance(self, n: int = 1, postfix: str | None = None) -> None:
        if self.bar is None:
            return
        if postfix is not None:
            self.bar.set_postfix_str(postfix, refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        global _OPEN
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            _OPEN -= 1


class ScanBar:
    """The scan's bar: bucket visits done of the total known up front (so a percentage and
    an ETA), files, bytes and rate as its postfix."""

    def __init__(self, enabled: bool, total: int = 0):
        self.bar = Bar(enabled, "scan", " buckets", total, unit_scale=False)
        self.bytes = self.files = 0
        self.t0 = time.monotonic()

    def update(self, buckets: int, files: int, nbytes: int) -> None:
        self.bytes += nbytes
        self.files += files
        if self.bar.bar is not None:
            from kvmigrate.units import human_bytes, plural

            dt = max(time.monotonic() - self.t0, 1e-6)
            self.bar.advance(buckets, f"{plural(self.files, 'file')}, {human_bytes(self.bytes)}, "
                                      f"{human_bytes(int(self.bytes / dt))}/s")

    def close(self) -> None:
        self.bar.close()


def write_line(text: str) -> None:
    """One line on stderr; above the bar while one is shown (tqdm.write), so neither
    breaks the other."""
    if _OPEN:
        from tqdm import tqdm

        tqdm.write(text, file=sys.stderr)
        return
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
