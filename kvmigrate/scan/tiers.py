"""Which folders of a cache root are tier directories (spec lmcache.md §1.1): a family
with `root_layout = "tiers"` (LMCache) keeps its chunks in folders one backend was
configured with, shared by every rank, recognised by what they hold.

* at the top of ROOT: a sub-folder that is not `.kvmigrate` and not another family's
  namespace folder, holding at least one regular file whose name parses as a chunk, at its
  top level or in a GDS `<2>/<2>/` folder pair;
* ROOT itself, when its own top-level files (or its `<2>/<2>/` folders) hold such names.

Only the listing is read here (names and file types); scan/tier_rows.py reads the files.
"""

from __future__ import annotations

import os
from typing import Any

SAMPLE_ENTRIES = 4096  # entries of one folder looked at to recognise a tier (a chunk is usually first)


def gds_folder(name: str) -> bool:
    """A GDS hash folder: the first or next two characters of the decimal hash string
    (`-3`, `80`; one character where the string is that short)."""
    return 1 <= len(name) <= 2 and name not in (".", "..")


def _holds_chunk(path: str, fam: Any, depth: int) -> bool:
    """Whether a folder holds a regular file with a chunk name at its top level or, with
    `depth`, in GDS folders below it."""
    try:
        with os.scandir(path) as it:
            for i, e in enumerate(it):
                if i >= SAMPLE_ENTRIES:
                    break
                if e.is_file(follow_symlinks=False):
                    if fam.is_chunk_name(e.name):
                        return True
                elif (depth and gds_folder(e.name) and e.is_dir(follow_symlinks=False)
                      and _holds_chunk(e.path, fam, depth - 1)):
                    return True
    except OSError:
        return False
    return False


def tier_family(path: str, families: list[Any]) -> Any:
    """The family whose tier a sub-folder of the root is, or None."""
    return next((f for f in families if _holds_chunk(path, f, 2)), None)


def gds_pair(path: str, fam: Any) -> bool:
    """A `<2>` folder at the top of a root tier: `<2>/<2>/` folders holding a chunk."""
    try:
        with os.scandir(path) as it:
            subs = [e.path for e in it if gds_folder(e.name) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return False
    return any(_holds_chunk(sub, fam, 0) for sub in subs[:SAMPLE_ENTRIES])
