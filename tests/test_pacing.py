"""kvmigrate.pacing (issue 18 item 4): the token bucket and the limits' parsing, with a
fake clock (sleeps are counted and summed, never timed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvmigrate import pacing
from kvmigrate.errors import UsageError


class FakeClock:
    """A clock that moves only when the bucket sleeps (or the test says so)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_the_bucket_sleeps_until_the_bytes_read_are_paid_for():
    clock = FakeClock()
    bucket = pacing.TokenBucket(1000, clock=clock, sleep=clock.sleep)
    bucket.take(1000)  # one second's worth: the burst
    assert clock.sleeps == []
    for _ in range(10):
        bucket.take(500)
    # 5000 bytes past the burst at 1000 B/s: five seconds slept, in ten sleeps of 0.5 s
    assert sum(clock.sleeps) == pytest.approx(5.0)
    assert len(clock.sleeps) == 10
    clock.now += 3.0  # three idle seconds refill at most one second (the capacity)
    bucket.take(1000)
    assert len(clock.sleeps) == 10


@pytest.mark.parametrize("text,rate", [("200M", 200 << 20), ("1.5G", int(1.5 * (1 << 30))), ("50000", 50000),
                                       ("64KiB", 64 << 10), ("10M/s", 10 << 20)])
def test_bwlimit_values(text, rate):
    assert pacing.parse_rate(text) == rate


@pytest.mark.parametrize("text,seconds", [("2h", 7200), ("1h30m", 5400), ("90m", 5400), ("45s", 45), ("0.5", 0.5)])
def test_max_duration_values(text, seconds):
    assert pacing.parse_duration(text) == seconds


@pytest.mark.parametrize("parse,bad", [(pacing.parse_rate, "fast"), (pacing.parse_rate, "0"),
                                       (pacing.parse_rate, "-3M"), (pacing.parse_duration, "2 hours"),
                                       (pacing.parse_duration, "h"), (pacing.parse_duration, "0s")])
def test_bad_limits_are_usage_errors_that_name_the_value(parse, bad):
    with pytest.raises(UsageError) as err:
        parse(bad)
    assert repr(bad) in str(err.value)


def test_worker_processes_split_the_rate():
    try:
        pacing.configure(bwlimit="400M")
        pacing.share(4)
        assert pacing._LIMITS.bucket.rate == 100 << 20
    finally:
        pacing.configure()
    assert not pacing.limited()


def test_idle_io_priority_puts_the_process_in_the_idle_class():
    """ioprio_set in a child process; `ionice -p` reads the class back."""
    code = ("import os, subprocess; from kvmigrate import pacing; note = pacing.idle_io_priority(); "
            "print(note or subprocess.run(['ionice', '-p', str(os.getpid())], capture_output=True, text=True)"
            ".stdout.strip())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "idle", out
