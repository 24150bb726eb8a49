"""One migration at a time per target namespace (migration.md §3.6).

An advisory `flock` on `.kvmigrate.lock` in the target base folder (a flat family's
target: the destination directory itself, `lock_relpath("")`), with the holder's pid
inside so the refusal can name it. The kernel drops the lock when its holder dies (kill -9
included), so a stale lock file never blocks a rerun. After locking, the file's inode is
compared with the name's: a lock taken on a file another process just unlinked is
retried, the classic flock-and-unlink race.
"""

from __future__ import annotations

import fcntl
import os

from kvmigrate import layout
from kvmigrate.errors import OperationalError, write_error
from kvmigrate.migrate.fsops import DestTree


def lock_relpath(base: str) -> str:
    """The lock file of a target folder ("" = the destination directory)."""
    return f"{base}/{layout.LOCK_NAME}" if base else layout.LOCK_NAME


class NamespaceLock:
    def __init__(self, tree: DestTree, base: str, fd: int, created: bool):
        self.tree = tree
        self.base = base
        self.relpath = lock_relpath(base)
        self._fd = fd
        self.created = created

    @classmethod
    def acquire(cls, tree: DestTree, base: str, purpose: str = "migration") -> NamespaceLock:
        relpath = lock_relpath(base)
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        for _ in range(10):
            pfd, name = tree.split(relpath)
            created = True
            try:
                fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=pfd)
            except FileExistsError:
                created = False
                try:
                    fd = os.open(name, flags, dir_fd=pfd)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise _lock_error(tree, relpath, exc) from None
            except OSError as exc:
                raise _lock_error(tree, relpath, exc) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                who = f"pid {holder}" if holder else "another process"
                raise OperationalError(
                    f"target namespace {base or tree.root} is locked by another kvmigrate run ({who}): "
                    f"{tree.abspath(relpath)}", path=tree.abspath(relpath),
                    hint=f"wait for {who} to finish, then rerun; the lock is released automatically when "
                         f"its holder exits (this {purpose} did not change anything in {base or tree.root})") from None
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False) if _exists(pfd, name) else None
            if st is None or st.st_ino != os.fstat(fd).st_ino:
                os.close(fd)  # the file was unlinked by its previous holder: take the new one
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return cls(tree, base, fd, created)
        raise OperationalError(f"could not take the lock {tree.abspath(relpath)} (it keeps changing)",
                               path=tree.abspath(relpath))

    def release(self) -> None:
        """Remove the lock file while still holding it, then drop the lock."""
        if self._fd < 0:
            return
        try:
            self.tree.unlink(self.relpath)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = -1


def _exists(pfd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=pfd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def _read_holder(fd: int) -> str:
    try:
        data = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return data if data.isdigit() else ""


def _lock_error(tree: DestTree, relpath: str, exc: OSError) -> OperationalError:
    return write_error(exc, "cannot create the lock file", tree.abspath(relpath),
                       elsewhere="migrate onto another filesystem: --dest DIR")
