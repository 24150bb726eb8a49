"""Crash reconciliation: what an interrupted run provably made, from its journal.

A resumed `--apply` adopts those outputs (and removes its temp files) so it ends exactly
as an uninterrupted run; `rollback` uses the same proof before it removes anything.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from kvmigrate.errors import UsageError
from kvmigrate.fsio import open_noatime
from kvmigrate.migrate.fsops import DestTree, SymlinkInPath, check_relpath
from kvmigrate.migrate.outputs import SourceInvalid, TransformSpec, output_hash, transform_output_hash


def tmp_name(final_relpath: str, pid: int | None = None) -> str:
    return f"{final_relpath}.kvmigrate-{pid if pid is not None else os.getpid()}.tmp"


def tmp_paths(item: dict[str, Any]) -> list[str]:
    """Temp names an intent item may have left: the recorded one, for any pid."""
    tmp = item.get("tmp")
    return [tmp] if tmp else []


def unlink_quiet(tree: DestTree, relpath: str) -> None:
    try:
        tree.unlink(relpath)
    except (FileNotFoundError, SymlinkInPath, NotADirectoryError):
        pass


def reconcile_item(tree: DestTree, root: str, item: dict[str, Any], digests: dict[str, bytes],
                   moved: dict[str, str] | None = None) -> dict | None:
    """Prove that a path an intent lists (but no done record covers) holds this run's
    output; return the done record to adopt it, or None. Never a path the intent marks
    `pre` (it existed when the batch began). Proof: a folder that did not exist at intent time;
    a link with the source's inode; a copy that shares its inode
    with the run's own temp file or holds exactly the bytes the action produces. `moved`:
    sources a prune moved that are read where they are now (a rollback's dry run)."""
    moved = moved or {}
    path = item["path"]
    if item.get("pre"):
        return None  # the path held a file before the run began: not its output
    try:
        st = tree.lstat(path)
    except (SymlinkInPath, NotADirectoryError):
        return None
    if st is None:
        return None
    kind = item.get("kind")
    if kind == "dir":
        return {"kind": "dir", "path": path, "recovered": True} if stat.S_ISDIR(st.st_mode) else None
    if not stat.S_ISREG(st.st_mode):
        return None
    tmp = item.get("tmp")
    tmp_st = tree.lstat(tmp) if tmp else None
    same_as_tmp = tmp_st is not None and tmp_st.st_ino == st.st_ino and tmp_st.st_dev == st.st_dev
    try:
        have, size = tree.hash(path)
    except OSError:
        return None
    if kind == "config":
        if same_as_tmp or have.hex() == item.get("xxh3_128"):
            return {"kind": "config", "path": path, "ino": st.st_ino, "size": size, "xxh3_128": have.hex(),
                    "recovered": True}
        return None
    if kind != "block":
        return None
    if item.get("transform"):
        owned = same_as_tmp or _transform_item_hash(root, item, moved) == have
        if not owned:
            return None
        return {"kind": "block", "path": path, "ino": st.st_ino, "size": size, "xxh3_128": have.hex(),
                "how": "transform", "action": item.get("action"), "recovered": True}
    linked = st.st_ino == item.get("ino") and st.st_dev == item.get("dev")
    owned = same_as_tmp or linked
    how = "link" if linked else "copy"
    if not owned and tmp:
        try:
            fd = open_noatime(os.path.join(root, moved.get(item["src"], item["src"])))
        except OSError:
            return None
        try:
            fst = os.fstat(fd)
            if (fst.st_ino, fst.st_size) != (item.get("ino"), item.get("size")):
                return None
            want, _, _ = output_hash(fd, item.get("action", ""), digests.get(item.get("base", "")))
        except (OSError, SourceInvalid):
            return None
        finally:
            os.close(fd)
        owned = want == have
    if not owned:
        return None
    return {"kind": "block", "path": path, "ino": st.st_ino, "size": size, "xxh3_128": have.hex(), "how": how,
            "action": item.get("action"), "recovered": True}


def _transform_item_hash(root: str, item: dict[str, Any], moved: dict[str, str]) -> bytes | None:
    """The hash of the row a journaled transform writes, from the very files it named
    (each still with its inode and size); None when that cannot be proven."""
    fds: list[int] = []
    try:
        spec = TransformSpec.from_json(item["transform"])
        for rel, ino, size in item["srcs"]:
            check_relpath(rel, "journal source")
            fd = open_noatime(os.path.join(root, moved.get(rel, rel)))
            fds.append(fd)
            st = os.fstat(fd)
            if (st.st_ino, st.st_size) != (ino, size):
                return None
        return transform_output_hash(spec, fds)[0]
    except (OSError, SourceInvalid, UsageError, KeyError, TypeError, ValueError):
        return None
    finally:
        for fd in fds:
            os.close(fd)
