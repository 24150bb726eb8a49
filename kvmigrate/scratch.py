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

import os
import re
import shutil
import tempfile

PREFIX = "kvmigrate-"
# kvmigrate-<kind>-<pid namespace>.<pid>-<mkdtemp's suffix: [a-z0-9_], no "-">
_NAME = re.compile(r"kvmigrate-[a-z]+(?:-[a-z]+)*-(\d+)\.(\d+)-[a-z0-9_]+")


def make(kind: str) -> str:
    """A new folder `kvmigrate-<kind>-<ns>.<pid>-XXXXXXXX` in TMPDIR, after removing the
    stale ones."""
    tmp = tempfile.gettempdir()
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
