"""Private working folders in $TMPDIR (a scan's temporary manifest, prune's plan files),
named after the process that made them.

Such a folder goes when its command ends, or at exit; it stays when the process dies of a
signal it cannot handle (kill -9, the OOM killer, a `timeout` that SIGTERMs a cron job),
each time up to a manifest's size. So every new folder first removes this user's folders
whose process is gone. The name holds the pid and the pid namespace: a process in another
container that shares TMPDIR is not seen by os.kill, so only folders of this namespace are
judged. Names without them (older versions) are left alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any

PREFIX = "kvmigrate-"
# kvmigrate-<kind>-<pid namespace>.<pid>-<mkdtemp's suffix: [a-z0-9_], no "-">
_NAME = re.compile(r"kvmigrate-[a-z]+(?:-[a-z]+)*-(\d+)\.(\d+)-[a-z0-9_]+")


def tmpdir() -> str:
    """The folder for working files: TMPDIR's. Python's tempfile takes the next usable one
    (/tmp, /var/tmp, the current folder) without a word when TMPDIR does not exist or is
    not writable; an operator sets TMPDIR because /tmp is too small for a manifest, so
    such a TMPDIR stops the command (exit 8), named, instead."""
    tmp = tempfile.gettempdir()
    asked = os.environ.get("TMPDIR")
    if asked and os.path.abspath(asked) != tmp:
        from kvmigrate.errors import OperationalError

        why = ("does not exist" if not os.path.exists(asked) else "is not a folder" if not os.path.isdir(asked)
               else "cannot be written to")
        raise OperationalError(f"TMPDIR {why}: kvmigrate's working files (temporary manifests, plans) go there",
                               path=asked, hint=f"create it (or set TMPDIR to a writable folder with room; {tmp} "
                                                "would be used without TMPDIR), then rerun the same command")
    return tmp


def make(kind: str) -> str:
    """A new folder `kvmigrate-<kind>-<ns>.<pid>-XXXXXXXX` in TMPDIR, after removing the
    stale ones."""
    tmp = tmpdir()
    remove_stale(tmp)
    return tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-{owner()}-", dir=tmp)


def owner() -> str:
    """`<pid namespace>.<pid>` of this process (namespace 0 where /proc does not say)."""
    return f"{_pid_namespace()}.{os.getpid()}"


def remove_stale(tmp: str) -> None:
    """Remove this user's working folders in `tmp` whose process (in this pid namespace)
    no longer runs."""
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    here = _pid_namespace()
    for name in names:
        m = _NAME.fullmatch(name)
        if m is None or int(m.group(1)) != here or int(m.group(2)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(2)), 0)
            continue  # (running: its folder is in use)
        except ProcessLookupError:
            pass
        except OSError:
            continue  # (another user's process: not ours to judge)
        path = os.path.join(tmp, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid == os.getuid() and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)


def _pid_namespace() -> int:
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return 0
    digits = re.search(r"\d+", link)
    return int(digits.group()) if digits else 0


class Folder:
    """A working folder (`make`) removed with the last object that refers to it, or at
    exit; one left by a process killed with a signal it cannot handle goes with the next
    working folder made."""

    def __init__(self, kind: str) -> None:
        try:
            self.path = make(kind)
        except OSError as exc:
            self.path = tempfile.gettempdir()
            raise CannotWrite(exc) from exc
        self._remove = weakref.finalize(self, _remove_own, self.path, os.getpid())
        self.files = 0

    def file(self, name: str) -> str:
        """The path of a new Arrow file in the folder."""
        self.files += 1
        return os.path.join(self.path, f"{name}-{self.files}.arrow")

    def remove(self) -> None:
        self._remove()


class Kind:
    """A kind of working folder and what a failed write into it says (`writing`): one
    object a spill, so that the folder it makes and its exit 8 name the same files."""

    def __init__(self, name: str, files: str, room: str) -> None:
        self.name, self.files, self.room = name, files, room

    def folder(self) -> Folder:
        """A new working folder of this kind; a TMPDIR that cannot hold it is exit 8."""
        with self.writing(None):
            return Folder(self.name)

    def writing(self, folder: Folder | None) -> contextlib.AbstractContextManager[None]:
        """A failed write into `folder` (None: not made yet): exit 8, naming it."""
        return writing(folder.path if folder is not None else None, self.files, self.room)


def _remove_own(path: str, pid: int) -> None:
    """Remove the folder, in the process that made it only (a forked walk worker leaves it)."""
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


class CannotWrite(Exception):
    """The OSError of a write into a working folder (not of a read or write of the cache)."""


def batches(path: str) -> Iterator[Any]:
    """The record batches of an Arrow IPC stream file of a working folder, one at a time
    (a spill reads back what it wrote a batch at a time, never the whole file)."""
    import pyarrow as pa

    with pa.OSFile(path, "rb") as f:
        yield from pa.ipc.open_stream(f)


class IpcWriter:
    """An Arrow IPC stream file of a working folder, written batch by batch; a failed
    write is CannotWrite."""

    def __init__(self, path: str, schema: Any, options: Any = None) -> None:
        import pyarrow as pa

        try:
            self.sink = pa.OSFile(path, "wb")
            self.writer = pa.ipc.new_stream(self.sink, schema, options=options)
        except OSError as exc:
            raise CannotWrite(exc) from exc

    def write(self, batch: Any) -> None:
        """A record batch or a table; nothing for no rows."""
        if batch.num_rows:
            try:
                self.writer.write(batch)
            except OSError as exc:
                raise CannotWrite(exc) from exc

    def __enter__(self) -> IpcWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.writer.close()
            self.sink.close()
        except OSError as exc:
            with contextlib.suppress(OSError):
                self.sink.close()  # (the file descriptor goes with it: a full TMPDIR stays unmountable else)
            raise CannotWrite(exc) from exc


@contextlib.contextmanager
def spilling(files: str, room: str) -> Iterator[None]:
    """Writes into TMPDIR's unlinked temporary files (`tempfile.TemporaryFile`): any OSError
    of them is `writing`'s exit 8, naming TMPDIR."""
    with writing(None, files, room):
        try:
            yield
        except OSError as exc:
            raise CannotWrite(exc) from exc


@contextlib.contextmanager
def writing(folder: str | None, files: str, room: str, *, then: str = "") -> Iterator[None]:
    """A write into the working folder (None: not made yet) that fails (a full or read-only
    TMPDIR) is an operational error (exit 8) naming the folder, with what to do: `files`,
    what was being written; `room`, what it takes; `then`, what it left as it was."""
    try:
        yield
    except CannotWrite as cannot:
        from kvmigrate.errors import OS_WHAT, OperationalError

        exc = cannot.args[0]
        what = OS_WHAT.get(exc.errno or 0, exc.strerror or str(exc))
        raise OperationalError(f"cannot write {files}: {what}{then}", path=folder or tempfile.gettempdir(),
                               hint=f"set TMPDIR to a folder with room ({room}), then rerun the same "
                                    "command") from None
