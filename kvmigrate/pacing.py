"""Staying out of the engine's way (issue 18 item 4): a read-bandwidth limit, a run-time
limit, idle I/O priority, and page-cache hygiene after a hashing read.

The limits are process-wide (`configure`, from the CLI): every stage reads through
`kvmigrate.fsio`, which charges `charge(n)` for the bytes it read, and asks `expired()`
at its batch boundaries. A fork()ed scan worker inherits them; `share(workers)` gives
each worker its part of the bandwidth, so the processes together stay under the limit.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvmigrate import units
from kvmigrate.errors import EXIT_INTERRUPTED, KvMigrateError, UsageError

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?(?:/s)?$", re.IGNORECASE)


class OutOfTime(KvMigrateError, KeyboardInterrupt):
    """--max-duration elapsed: the run stopped at a batch boundary (exit 32). A
    KeyboardInterrupt too, so every stage that leaves a Ctrl-C consistent (no temporary
    manifest, a synced journal) does the same here."""

    exit_code = EXIT_INTERRUPTED


class Interrupted(KvMigrateError, KeyboardInterrupt):
    """A run stopped by Ctrl-C, SIGTERM or --max-duration, with what the operator needs to
    go on: `journal` (an --apply's journal path) and `why`."""

    exit_code = EXIT_INTERRUPTED

    def __init__(self, why: str, journal: str | None = None):
        self.why = why
        self.journal = journal
        super().__init__(why)


def parse_rate(text: str) -> int:
    """'200M' -> 209715200 bytes per second (K, M, G, T are powers of 1024; 'MiB', 'M/s' too)."""
    m = _SIZE_RE.match(str(text).strip())
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"--bwlimit {text!r}: expected a positive rate such as 200M, 1.5G or 50000 (bytes/s)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def parse_duration(text: str) -> float:
    """--max-duration: '2h' -> 7200.0 seconds; '1h30m', '90m', '45s', '0.5s' or a bare
    number of seconds (units.parse_duration), above zero."""
    try:
        seconds = units.parse_duration(text)
    except ValueError:
        raise UsageError(f"--max-duration {text!r}: expected a duration such as 2h, 1h30m, 90m or 45s") from None
    if seconds <= 0:
        raise UsageError(f"--max-duration {text!r}: expected a duration above zero")
    return seconds


class TokenBucket:
    """Bytes per second for every thread of a process: `take(n)` returns at once while
    the bucket holds tokens, else sleeps until the debt is paid. Reads are charged after
    they happened (a read is never split), so the burst is one second's worth plus one
    read. `clock` and `sleep` are injectable (the tests count sleeps, never time them)."""

    def __init__(self, rate: float, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.rate = float(rate)
        self.capacity = float(rate)  # one second of reads
        self.clock, self.sleep = clock, sleep
        self.tokens = self.capacity
        self.stamp = clock()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            now = self.clock()
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= n
            wait = -self.tokens / self.rate if self.tokens < 0 else 0.0
        if wait > 0:
            self.sleep(wait)


@dataclass
class _Limits:
    bucket: TokenBucket | None = None
    rate: int | None = None  # the --bwlimit of the whole run (bytes/s)
    deadline: float | None = None  # time.monotonic() at which --max-duration ends
    max_duration: str | None = None  # as given, for messages
    clock: Callable[[], float] = time.monotonic  # (the tests move it)


_LIMITS = _Limits()


def configure(bwlimit: str | int | None = None, max_duration: str | float | None = None) -> None:
    """Set the process-wide limits (None: none). Called by the CLI before a run."""
    rate = parse_rate(bwlimit) if isinstance(bwlimit, str) else bwlimit
    _LIMITS.rate = rate
    _LIMITS.bucket = TokenBucket(rate) if rate else None
    if max_duration is None:
        _LIMITS.deadline = _LIMITS.max_duration = None
    else:
        seconds = parse_duration(max_duration) if isinstance(max_duration, str) else float(max_duration)
        _LIMITS.deadline = _LIMITS.clock() + seconds
        _LIMITS.max_duration = str(max_duration)


def share(workers: int) -> None:
    """In one of `workers` processes walking side by side: take 1/workers of the rate."""
    if _LIMITS.rate and workers > 1:
        _LIMITS.bucket = TokenBucket(_LIMITS.rate / workers)


def limited() -> bool:
    """Is the read bandwidth limited? (The scan then reads in Python, file by file,
    where every read is charged, instead of a whole bucket in C.)"""
    return _LIMITS.bucket is not None


def charge(n: int) -> None:
    """Bytes just read: sleep if the --bwlimit bucket is empty."""
    bucket = _LIMITS.bucket
    if bucket is not None and n > 0:
        bucket.take(n)


def expired() -> bool:
    return _LIMITS.deadline is not None and _LIMITS.clock() >= _LIMITS.deadline


def check_deadline() -> None:
    """At a batch boundary: stop (OutOfTime, exit 32) once --max-duration has elapsed."""
    if expired():
        raise OutOfTime(f"--max-duration {_LIMITS.max_duration} elapsed; stopped at a batch boundary")


class _CacheStatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_SYS_CACHESTAT = 451  # (the same number on every Linux architecture)
_FIRST_PAGE = _CacheStatRange(0, 4096)
_tls = threading.local()
_libc: list = []  # [libc] once loaded, [None] where there is no cachestat(2)


def cached(fd: int) -> bool:
    """Is the file's first page in the page cache (the engine read or wrote it lately)?
    Asked with cachestat(2) (Linux 6.5), which starts no read. Before 6.5: a one-byte read
    with RWF_NOWAIT, which fails with EAGAIN rather than wait for the disk (it may start
    the read, so a small file on a fast disk can look cached: it is then kept). If
    neither can tell: False (the pages read are let go)."""
    if not _libc:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            probe = _CacheStat()
            ok = libc.syscall(_SYS_CACHESTAT, -1, ctypes.byref(_CacheStatRange(0, 0)), ctypes.byref(probe), 0)
            _libc.append(None if ok != 0 and ctypes.get_errno() == errno.ENOSYS else libc)
        except (OSError, AttributeError):
            _libc.append(None)
    libc = _libc[0]
    if libc is not None:
        args = getattr(_tls, "cachestat", None)
        if args is None:  # one result struct per thread, made once
            cs = _CacheStat()
            args = _tls.cachestat = (libc.syscall, cs, ctypes.byref(_FIRST_PAGE), ctypes.byref(cs))
        call, cs, first_page, result = args
        return call(_SYS_CACHESTAT, fd, first_page, result, 0) == 0 and cs.nr_cache > 0
    try:
        return os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT) == 1
    except (AttributeError, OSError):
        return False


def drop_cache(fd: int) -> None:
    """After a hashing read of a file that was not cached before (`cached`): tell the
    kernel its pages will not be needed again, so reading a 20 TB cache does not evict
    the engine's hot pages. A file that was cached stays cached."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass


_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273, "s390x": 282}
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_IDLE = 3
_IOPRIO_CLASS_SHIFT = 13


def idle_io_priority() -> str | None:
    """Put this process (and the threads and workers it starts afterwards) in the idle
    I/O class (`ionice -c 3`): the disk serves it only when nobody else asks. None when
    done, else a note saying why not (another OS or architecture, not permitted)."""
    nr = _SYS_IOPRIO_SET.get(os.uname().machine)
    if nr is None:
        return f"idle I/O priority not set: no ioprio_set on {os.uname().sysname} {os.uname().machine}"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.syscall(nr, _IOPRIO_WHO_PROCESS, 0, _IOPRIO_CLASS_IDLE << _IOPRIO_CLASS_SHIFT)
    except (OSError, AttributeError) as exc:
        return f"idle I/O priority not set: {exc}"
    if rc != 0:
        err = ctypes.get_errno()
        return f"idle I/O priority not set: ioprio_set: [{errno.errorcode.get(err, err)}] {os.strerror(err)}"
    return None
