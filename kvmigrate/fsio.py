"""Reading files under a cache root without disturbing it, and checking the root itself.

One opener, one whole-file hash and one block reader for every stage (scan, apply,
verify, rollback): files are opened read-only, never through a symlink, without updating
atime where permitted (evictors judge a block's age by its atime), and non-blocking (a
FIFO put in a file's place is opened, then found not regular by fstat, never waited on).
The block reader (`read_fd`, and `read_file` around it for the scan) reads a file once
for its size, zero check, XXH3-128 and optional header and payload hash.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from dataclasses import dataclass

import xxhash

from kvmigrate import pacing
from kvmigrate.errors import OperationalError, UsageError

CHUNK = 1 << 20  # bytes per read when hashing a file chunk by chunk
# The block reader's reused per-thread buffer is a page larger than a chunk, so a 1 MiB
# block file is read (and its EOF proven) by a single read of size + 1 bytes.
READ_BUFFER = CHUNK + 4096
SMALL_FILE = 64 * 1024  # smaller files are read into a fresh bytes object (cheaper than the buffer)
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
        pacing.charge(len(buf))
        h.update(buf)
        n += len(buf)
    return h.digest(), n


def hash_file(path: str, *, dir_fd: int | None = None) -> tuple[bytes, int]:
    """XXH3-128 and size of a whole file (opened by `open_noatime`)."""
    fd = open_noatime(path, dir_fd=dir_fd)
    was_cached = pacing.cached(fd)
    try:
        return hash_fd(fd)
    finally:
        if not was_cached:
            pacing.drop_cache(fd)
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
    fsdir = inside_fsdir(path)
    if fsdir is not None:
        raise UsageError(f"cache root is inside Mooncake's file-per-key folder {fsdir}: a Mooncake client parses "
                         "every file 3 levels below it, so kvmigrate's own files there (journals, history) would "
                         "stop the client from starting", path=path,
                         hint=f"pass the client root above it ({os.path.dirname(fsdir) or '/'})")
    return path


def inside_fsdir(path: str) -> str | None:
    """The Mooncake file-per-key folder (default name) a path is, or lies 1 or 2 hash folders
    below (mooncake.md §5.2: a ROOT there is refused), else None."""
    from kvmigrate.formats.mooncake import DEFAULT_FSDIR

    parts = os.path.normpath(path).split(os.sep)
    for depth in range(3):
        if len(parts) > depth and parts[-1 - depth] == DEFAULT_FSDIR and all(
                len(p) == 1 and "a" <= p <= "p" for p in parts[len(parts) - depth:]):
            return os.sep.join(parts[: len(parts) - depth])
    return None


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


def kind_of(mode: int) -> str:
    """What a file that is not a regular one is, in a finding's words."""
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    if stat.S_ISDIR(mode):
        return "directory"
    return "special file"


def errno_reason(exc: OSError, what: str, relpath: str) -> str:
    """An OSError worded as a finding: `<what> <relpath>: [ENAME] message`."""
    name = errno.errorcode.get(exc.errno or 0, "EIO")
    return f"{what} {relpath}: [{name}] {exc.strerror or exc}"


# ---------------------------------------------------------------------------------------
# The block reader


_tls = threading.local()


def read_buffer() -> bytearray:
    buf = getattr(_tls, "buf", None)
    if buf is None:
        buf = _tls.buf = bytearray(READ_BUFFER)
    return buf


_ZEROS = bytes(READ_BUFFER)


def _zero_prefix(buf: bytearray, n: int) -> bool:
    """Are the first n bytes of the buffer zero? (The first byte settles it for almost
    every real file.)"""
    if buf[0]:
        return False
    return buf == _ZEROS if n == len(buf) else buf[:n] == _ZEROS[:n]


def read_fd(fd: int, size: int, header_len: int = 0, payload: bool = False, let_go: bool = True
            ) -> tuple[bytes, bytes | None, bytes, int, bool]:
    """`_read_fd`, then the bytes read charged to --bwlimit and, unless the file was
    cached before, its pages let go (`pacing.drop_cache`: a hash scan leaves the engine's
    page cache as it found it). `let_go=False`: the caller reads the file again next
    (and lets go of it then)."""
    was_cached = not let_go or pacing.cached(fd)
    try:
        result = _read_fd(fd, size, header_len, payload)
    finally:
        if not was_cached:
            pacing.drop_cache(fd)
    pacing.charge(result[3])
    return result


def _read_fd(fd: int, size: int, header_len: int, payload: bool) -> tuple[bytes, bytes | None, bytes, int, bool]:
    """One sequential read of an open block file from its start, the check every stage
    makes of a block: (XXH3-128 of its bytes, XXH3-128 after the first `header_len` bytes
    if `payload`, those first bytes, bytes read, every byte zero).

    A file that fits takes one read of size + 1 bytes (the short read proves EOF) and a
    one-shot hash: a small one into a fresh bytes object, a larger one into the reused
    per-thread buffer; larger files are streamed chunk by chunk to EOF. Reading stops
    once more than `size` bytes came (it grew: the caller decides, never chasing a writer)."""
    total = 0
    zero = True
    if size < SMALL_FILE:
        data = os.read(fd, size + 1)
        n = len(data)
        zero = not n or (not data[0] and not data.lstrip(b"\0"))
        if n == size and not payload:
            return xxhash.xxh3_128_digest(data), None, data[:header_len], n, zero and n > 0
        first: bytes | memoryview = data
        buf = mv = None
    else:
        buf = read_buffer()
        mv = memoryview(buf)
        want = size + 1 if size < READ_BUFFER else READ_BUFFER
        n = os.readv(fd, [mv[:want]])
        zero = not n or _zero_prefix(buf, n)
        if n == size and n < want and not payload:
            return xxhash.xxh3_128_digest(mv[:n]), None, bytes(mv[:min(n, header_len)]), n, zero and n > 0
        first = mv[:n]
    whole = xxhash.xxh3_128()
    after = xxhash.xxh3_128() if payload else None
    head = b""
    chunk = first
    while n:
        whole.update(chunk)
        if total < header_len:
            head += bytes(chunk[:header_len - total])
        if after is not None and total + n > header_len:
            after.update(chunk[max(0, header_len - total):])
        total += n
        if buf is None or mv is None:  # past a small file's first read (both None): the rest into the buffer
            buf = read_buffer()
            mv = memoryview(buf)
        elif total > size:  # it grew while read
            break
        n = os.readv(fd, [mv])
        chunk = mv[:n]
        if zero and n:
            zero = _zero_prefix(buf, n)
    return whole.digest(), after.digest() if after is not None else None, head, total, zero and total > 0


class Vanished(Exception):
    """The file disappeared (or was replaced by a non-file) between listing and reading."""


class ChangedWhileRead(OSError):
    """The file's size changed while it was read, and again when read once more: something
    is writing it in place. Its row says so (unreadable, operational) instead of carrying
    a hash of bytes that match no size the scan saw."""

    def __init__(self, path: str, size: int, nread: int):
        super().__init__(errno.EAGAIN, f"changed size while read ({size:,} bytes at open, {nread:,} read): "
                                       "something is writing it; rerun the scan when the engine is idle", path)


@dataclass(slots=True)
class ReadResult:
    content: bytes | None  # XXH3-128 digest of the whole file
    payload: bytes | None  # XXH3-128 after the first `header_len` bytes
    header: bytes | None  # first `header_len` bytes
    all_zero: bool
    st: os.stat_result  # fstat of the opened file (the truth if it was replaced meanwhile)


def read_file(path: str, *, want_hash: bool, header_len: int = 0) -> ReadResult:
    """Read a regular file once (`read_fd`): its header, whole-file and payload XXH3-128,
    and whether every byte is zero. Raises Vanished, or OSError for real I/O problems.

    A file whose size changes while it is read (more or fewer bytes than fstat said) is
    read once more from a fresh open; if it changes again, ChangedWhileRead."""
    for _attempt in range(2):
        try:
            return _read_file(path, want_hash, header_len)
        except _SizeChanged as exc:
            changed = exc
    raise ChangedWhileRead(path, changed.size, changed.nread)


class _SizeChanged(Exception):
    def __init__(self, size: int, nread: int):
        super().__init__(size, nread)
        self.size, self.nread = size, nread


def _read_file(path: str, want_hash: bool, header_len: int) -> ReadResult:
    try:
        fd = open_noatime(path)
    except FileNotFoundError:
        raise Vanished(path) from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.ENOTDIR):
            raise Vanished(path) from None  # replaced by a symlink / FIFO meanwhile
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Vanished(path)
        if want_hash and all_holes(fd, st):
            # nothing but holes: every byte is zero (an ftruncate-d crash residue, or a 1 TiB
            # sparse file that would take minutes to read); no hash is needed to say so
            return ReadResult(None, None, os.pread(fd, header_len, 0) if header_len else None, True, st)
        if not want_hash:
            return ReadResult(None, None, os.pread(fd, header_len, 0) if header_len else None, False, st)
        content, payload, header, nread, all_zero = read_fd(fd, st.st_size, header_len, payload=bool(header_len))
        if nread != st.st_size:
            raise _SizeChanged(st.st_size, nread)
        return ReadResult(content, payload, header if header_len else None, all_zero, st)
    finally:
        os.close(fd)


def read_all(path: str, limit: int) -> bytes | None:
    """Whole file content (for slice-candidate search), or None if too large / gone."""
    try:
        fd = open_noatime(path)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        chunks = []
        while True:
            b = os.read(fd, CHUNK)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)
