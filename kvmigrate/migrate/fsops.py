"""File-system primitives for writing under one destination root without ever leaving it.

Every write goes through directory file descriptors opened component by component with
`O_NOFOLLOW | O_DIRECTORY`, so a symlink planted anywhere below the destination root
(`<target>_r0 -> /etc`) makes the operation fail instead of writing through it. Paths
come only from manifest or journal relpaths that `check_relpath` accepted.
"""

from __future__ import annotations

import errno
import os
import stat
from array import array
from collections import OrderedDict
from collections.abc import Iterator

from kvmigrate.errors import UsageError
from kvmigrate.fsio import CHUNK, hash_file, open_noatime

PAGE = 4096
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def check_relpath(relpath: object, what: str) -> str:
    """A normalized relative path (no '', '.', '..' components, not absolute); else raise.

    Manifests and journals are inputs like any other: a path that could climb out of the
    root it is relative to is refused before anything is written.
    """
    if not isinstance(relpath, str) or not relpath:
        raise UsageError(f"{what}: empty or missing path", hint="regenerate the manifest with `kvmigrate scan`")
    parts = relpath.split("/")
    if relpath.startswith("/") or "\0" in relpath or any(p in ("", ".", "..") for p in parts):
        raise UsageError(f"{what}: {relpath!r} is not a normalized relative path; refusing to use it",
                         hint="this manifest or journal was edited or corrupted; regenerate it with `kvmigrate scan`")
    return relpath


def padded_size(size: int) -> int:
    return -(-size // PAGE) * PAGE


_MADE_KEPT = 1 << 16  # folders made by this run remembered (by-path links, no lstat of their children)


class FolderSet:
    """A set of folder paths kept as their 64-bit string hashes in one array (open
    addressing): 16 bytes a folder at most, where a set of path strings took ~150.
    Two paths with one hash (odds of 2**-64 a pair) would read as one."""

    def __init__(self, capacity: int) -> None:
        self._mask = (1 << max(4, (2 * capacity - 1).bit_length())) - 1  # at most half full
        self._slots: array | None = None  # made by the first add
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def _find(self, reldir: str) -> tuple[int, int]:
        """(the folder's digest, its slot: where it is or where it would go)."""
        h = hash(reldir) or 1  # (0 marks an empty slot)
        slots, mask = self._slots, self._mask
        assert slots is not None
        i = h & mask
        while slots[i] and slots[i] != h:
            i = (i + 1) & mask
        return h, i

    def add(self, reldir: str) -> None:
        if self._slots is None:
            self._slots = array("q", bytes(8 * (self._mask + 1)))
        h, i = self._find(reldir)
        if not self._slots[i]:
            self._slots[i] = h
            self._len += 1

    def __contains__(self, reldir: str) -> bool:
        return self._slots is not None and bool(self._slots[self._find(reldir)[1]])

    def clear(self) -> None:
        self._slots, self._len = None, 0


class SymlinkInPath(OSError):
    """A component of a destination path is a symlink or not a directory."""


def _ancestors(reldir: str) -> Iterator[str]:
    """'a/b/c' -> 'a/b', 'a' (the root '' not included)."""
    while "/" in reldir:
        reldir = reldir.rpartition("/")[0]
        yield reldir


class DestTree:
    """Directory fds under a destination root, opened without following symlinks.

    Keeps a small LRU of open fds (fan-out folders are revisited within a batch) so a
    20k-block run does not open every folder three times per block.
    """

    def __init__(self, root: str, max_fds: int = 128):
        self.root = os.path.abspath(root)
        self.root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        self._fds: OrderedDict[str, int] = OrderedDict()
        # folder -> its cached descendants, so forgetting a folder does not scan the cache
        # (a prune removes tens of thousands of folders, each forgotten first)
        self._below: dict[str, set[str]] = {}
        self._max = max_fds
        self._made = FolderSet(_MADE_KEPT)
        self._prefix = os.path.join(self.root, "")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._below.clear()
        os.close(self.root_fd)

    def __enter__(self) -> DestTree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def abspath(self, relpath: str) -> str:
        return self._prefix + relpath  # os.path.join for a checked (never absolute) relpath

    def dir_fd(self, reldir: str) -> int:
        """fd of an existing directory `reldir` ('' = root); raises FileNotFoundError or
        SymlinkInPath."""
        if reldir == "":
            return self.root_fd
        fd = self._fds.get(reldir)
        if fd is not None:
            self._fds.move_to_end(reldir)
            return fd
        parent, _, name = reldir.rpartition("/")
        pfd = self.dir_fd(parent)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise SymlinkInPath(exc.errno, "is a symlink or not a directory", self.abspath(reldir)) from None
            raise
        self._fds[reldir] = fd
        for above in _ancestors(reldir):
            self._below.setdefault(above, set()).add(reldir)
        if len(self._fds) > self._max:
            self._drop(next(iter(self._fds)))
        return fd

    def _drop(self, reldir: str) -> None:
        """Close one cached fd and take it out of its ancestors' index."""
        os.close(self._fds.pop(reldir))
        for above in _ancestors(reldir):
            below = self._below[above]
            below.discard(reldir)
            if not below:
                del self._below[above]

    def split(self, relpath: str) -> tuple[int, str]:
        """(fd of the parent directory, final name)."""
        parent, _, name = relpath.rpartition("/")
        return self.dir_fd(parent), name

    def made(self, reldir: str) -> None:
        """Note a folder this run just made (mkdir in an O_NOFOLLOW-opened parent): files
        in it are linked and checked by path, with no folder fd opened per file (as
        `cp -al` does); anywhere else every step goes through a folder fd. Bounded: a
        forgotten folder only costs the slower way."""
        if len(self._made) >= _MADE_KEPT:
            self._made.clear()
        self._made.add(reldir)

    def was_made(self, reldir: str) -> bool:
        """This run made `reldir` (as far as the bounded memory of `made` goes): its
        children cannot exist yet without a stat."""
        return reldir in self._made

    def lstat(self, relpath: str) -> os.stat_result | None:
        """lstat of a path below the root, None if it (or a parent) does not exist."""
        try:
            if relpath.rpartition("/")[0] in self._made:
                return os.lstat(self.abspath(relpath))
            pfd, name = self.split(relpath)
            return os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def is_dir(self, reldir: str) -> bool:
        """True for a real directory; False if absent; raises SymlinkInPath for a symlink."""
        st = self.lstat(reldir)
        if st is None:
            return False
        if not stat.S_ISDIR(st.st_mode):
            raise SymlinkInPath(errno.ENOTDIR, "is a symlink or not a directory", self.abspath(reldir))
        return True

    def mkdir(self, reldir: str) -> bool:
        """Create one directory (its parent must exist). True if this call created it."""
        pfd, name = self.split(reldir)
        try:
            os.mkdir(name, 0o777, dir_fd=pfd)
            return True
        except FileExistsError:
            if not self.is_dir(reldir):
                raise SymlinkInPath(errno.ENOTDIR, "is not a directory", self.abspath(reldir)) from None
            return False

    def rmdir(self, reldir: str) -> None:
        self.forget(reldir)
        pfd, name = self.split(reldir)
        os.rmdir(name, dir_fd=pfd)

    def forget(self, reldir: str) -> None:
        """Close cached fds of `reldir` and everything below it (before removing it);
        '' closes them all."""
        if reldir == "":
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._below.clear()
            self._made.clear()
            return
        for key in [*self._below.get(reldir, ()), *([reldir] if reldir in self._fds else [])]:
            self._drop(key)
        self._made.clear()  # (digests: the folders made below it cannot be told apart)

    def unlink(self, relpath: str) -> None:
        pfd, name = self.split(relpath)
        os.unlink(name, dir_fd=pfd)

    def create_excl(self, relpath: str) -> int:
        """Open a new file for writing; fails if the name exists (never follows a symlink)."""
        pfd, name = self.split(relpath)
        return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                       0o644, dir_fd=pfd)

    def link_in(self, src_abs: str, relpath: str) -> None:
        """Hard-link an absolute source path to `relpath` (no-clobber: EEXIST if taken).

        linkat without AT_SYMLINK_FOLLOW: a symlink source is linked as a symlink, which
        the caller's inode check then rejects.
        """
        if relpath.rpartition("/")[0] in self._made:
            os.link(src_abs, self.abspath(relpath), follow_symlinks=False)
            return
        pfd, name = self.split(relpath)
        os.link(src_abs, name, dst_dir_fd=pfd, follow_symlinks=False)

    def link_local(self, tmp_rel: str, relpath: str) -> None:
        """Publish a temp file under its final name (same directory), no-clobber."""
        tfd, tname = self.split(tmp_rel)
        pfd, name = self.split(relpath)
        os.link(tname, name, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)

    def read_bytes(self, relpath: str, limit: int | None = None) -> bytes:
        pfd, name = self.split(relpath)
        fd = open_noatime(name, dir_fd=pfd)
        try:
            chunks = []
            n = 0
            while limit is None or n < limit:
                buf = os.read(fd, CHUNK if limit is None else min(CHUNK, limit - n))
                if not buf:
                    break
                chunks.append(buf)
                n += len(buf)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def hash(self, relpath: str) -> tuple[bytes, int]:
        pfd, name = self.split(relpath)
        return hash_file(name, dir_fd=pfd)

    def fsync_dir(self, reldir: str) -> None:
        try:
            os.fsync(self.dir_fd(reldir))
        except OSError:
            pass
