"""The C library's allocator, tuned for a command that streams a manifest in batches."""

from __future__ import annotations

import ctypes


def return_freed_memory() -> None:
    """Have glibc's malloc give back the large buffers a batch frees.

    glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), so
    the buffers of later batches come from the heap, whose freed pages stay resident:
    a command that streams a manifest in batches peaked higher the more batches it read
    (a report of 128k rows ~17 MiB above one of 32k rows). A fixed threshold (glibc's
    default, 128 KiB) keeps each larger buffer in its own mapping, returned when freed,
    for ~15% more system time (a mapping's pages are faulted in afresh). Not for a walk:
    the hash audit's read buffers made it several times slower (audit calls it once its
    walk is done). No-op where the C library has no mallopt."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, _MALLOC_THRESHOLD)  # (a set threshold is no longer raised)
    mallopt(_M_TRIM_THRESHOLD, _MALLOC_THRESHOLD)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_MALLOC_THRESHOLD = 128 * 1024


def give_back_freed() -> None:
    """Return the freed holes of the heap to the system, once: the C library's malloc
    keeps them when a live buffer sits above them. A baseline's load (reading, filtering
    and sorting its columns takes about four times what it keeps) grew the audit's peak
    by that much again (~200 B a baseline row) without it. glibc's malloc_trim; elsewhere
    a no-op."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)
