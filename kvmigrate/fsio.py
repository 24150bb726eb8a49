"""Reading files under a cache root without disturbing it, and checking the root itself.

One opener and one whole-file hash for every stage (scan, apply, verify, rollback): files
are opened read-only, never through a symlink, without updating atime where permitted
(evictors judge a block's age by its atime), and non-blocking (a FIFO put in a file's
place is opened, then found not regular by fstat, never waited on).
"""

from __future__ import annotations

import errno
import os
import stat

import xxhash

from kvmigrate.errors import OperationalError, UsageError

CHUNK = 1 << 20  # bytes per read when hashing a file chunk by chunk
READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_O_NOATIME = getattr(os, "O_NOATIME", 0)


def open_noatime(path: str, *, dir_fd: int | None = None) -> int:
    """Open read-only without following a final symlink and, where permitted, without
    updating atime. O_NOATIME needs file ownership (EPERM otherwise): then without it."""
    at = {} if dir_fd is None else {"dir_fd": dir_fd}  # (os.open as the tests' fault shims take it)
    if _O_NOATIME:
        try:
            return os.open(path, READ_FLAGS | _O_NOATIME, **at)
        except PermissionError as exc:
            if exc.errno != errno.EPERM:
                raise
    return os.open(path, READ_FLAGS, **at)


def hash_fd(fd: int, limit: int | None = None) -> tuple[bytes, int]:
    """XXH3-128 digest and byte count of an open file from its current offset (at most
    `limit` bytes)."""
    h = xxhash.xxh3_128()
    n = 0
    while limit is None or n < limit:
        want = CHUNK if limit is None else min(CHUNK, limit - n)
        buf = os.read(fd, want)
        if not buf:
            break
        h.update(buf)
        n += len(buf)
    return h.digest(), n


def hash_file(path: str, *, dir_fd: int | None = None) -> tuple[bytes, int]:
    """XXH3-128 and size of a whole file (opened by `open_noatime`)."""
    fd = open_noatime(path, dir_fd=dir_fd)
    try:
        return hash_fd(fd)
    finally:
        os.close(fd)


def check_root(root: str) -> str:
    """The absolute path of a cache root given on the command line; a missing path or a
    file is a usage error (2), a root that cannot be accessed or listed an operational one (8)."""
    path = os.path.abspath(root)
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):  # a wrong path is a usage error (interface.md §4)
        raise UsageError("cache root does not exist", path=path,
                         hint="pass the engine's cache root_dir (the folder holding <model>_<d12> folders)") from None
    except OSError as exc:
        raise OperationalError(f"cannot access the cache root: {exc.strerror}", path=path,
                               hint="check the path and your permissions") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError("cache root is not a directory", path=path,
                         hint="pass the engine's cache root_dir, not a file inside it")
    try:
        with os.scandir(path):
            pass
    except OSError as exc:
        raise OperationalError(f"cannot list the cache root: {exc.strerror}", path=path,
                               hint="run as a user that can read the cache") from None
    return path


def all_holes(fd: int, st: os.stat_result) -> bool:
    """A non-empty file with no data extent at all (SEEK_DATA finds none): all zero.
    Asked only of files that occupy fewer blocks than their size (sparse ones): a
    hashing read (scan, apply) says `zero_filled` without reading gigabytes of holes."""
    if st.st_size <= 0 or (getattr(st, "st_blocks", 0) or 0) * 512 >= st.st_size:
        return False
    try:
        os.lseek(fd, 0, os.SEEK_DATA)
    except OSError as exc:
        return exc.errno == errno.ENXIO
    return False
