"""A progress bar on stderr for a stage whose total is known once it starts (the plan's
rows): tqdm, imported only when shown; silent when stderr is not a terminal or -q."""

from __future__ import annotations

import sys
from typing import Any


class Bar:
    """`update(done, total)`: the bar appears at the first call (when the total is known)."""

    def __init__(self, enabled: bool, desc: str, unit: str):
        self.enabled, self.desc, self.unit = enabled, desc, unit
        self.bar: Any = None

    def update(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit=self.unit, file=sys.stderr, desc=self.desc, dynamic_ncols=True,
                            unit_scale=True, leave=True)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
