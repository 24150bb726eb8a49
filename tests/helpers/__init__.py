"""Helpers the tests share, imported as `helpers` (pyproject puts tests/ on the path):
fixtures stay in tests/conftest.py, plain values and functions live here.

`cli_helpers`          run a `kvmigrate` command in-process (exit code, output, --json)
`reference_reader`     the engines' own read rules: what a target reader opens and gets
`sglang_reader`        SGLang 0.5.23's HiCacheFile reader
`lmcache_reader`       LMCache 0.5.6's disk tiers: the name a deployment looks up, what it reads
`synth_matrix`         every synth era x defect, for the default-migration tests
`engine_sim`           a live engine writing beside a scan (also run as a script)
`reliability_harness`  the reliability campaign's benches and oracles (scripts/reliability.py too)

`SMALL`      geometry that keeps trees tiny (a few KiB) but exercises every rule.
`WALKS`      the scan's two leaf walks (the `walk` fixture runs a test once per walk).
`FakeClock`  a clock the pacing tests move by hand.
"""

from __future__ import annotations

from typing import Any

SMALL: dict[str, Any] = dict(layers=2, page_bytes=256, blocks=6)

# The scan's two leaf walks: Python, and C (kvmigrate._leafwalk, built by `pip install`
# where a C compiler is found, as on every CI machine; tests that need it import it).
WALKS = ["python", "c"]


class FakeClock:
    """A clock the pacing tests move by hand (kvmigrate.pacing's deadline and token bucket):
    by `step` at every look at the deadline, and by what a bucket sleeps."""

    def __init__(self, step: float = 0.0) -> None:
        self.now, self.step, self.slept = 0.0, step, 0.0

    def __call__(self) -> float:
        self.now += self.step
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept += seconds
        self.now += seconds
