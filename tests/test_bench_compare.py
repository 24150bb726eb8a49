"""scripts/bench.py --before: the report's arithmetic (new/old, PASS when <= 1.05) on
given timings, through the script's own --self-check (no trees, no installs)."""

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"


def test_before_after_verdicts_from_given_timings():
    p = subprocess.run([sys.executable, str(BENCH), "--self-check"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "12 of 12 checks pass" in p.stdout
