"""The floor of a Python walk: what reading every file of a tree costs with nothing else.

`python3 scripts/floor_walk.py ROOT [--procs N] [--hash]` walks ROOT in N processes
(top-level folders and their first-level subfolders dealt round-robin; files directly in
a top-level folder are not walked: with `--flat`, those folders' entries are, dealt
round-robin, for a tier of one flat folder), and per file
does only what `kvmigrate scan` cannot avoid: list the folder (`os.scandir`), then
`lstat` (or, with --hash, open + fstat + read + close and XXH3-128 of the bytes). No
classification, no manifest. scripts/bench.py runs it beside `kvmigrate scan` so the
report can say how much of a gap to `xxhsum`/`jdupes` is the kernel's and Python's
per-file floor, and how much is kvmigrate's own work.

Prints one JSON line: files, bytes, seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from multiprocessing import get_context

import xxhash

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOATIME", 0)
_CHUNK = 1 << 20


def _read_hash(path: str) -> int:
    fd = os.open(path, _FLAGS)
    try:
        size = os.fstat(fd).st_size
        if size < _CHUNK:
            data = os.read(fd, size + 1)
            xxhash.xxh3_128_digest(data)
            return len(data)
        h = xxhash.xxh3_128()
        n = 0
        while chunk := os.read(fd, _CHUNK):
            h.update(chunk)
            n += len(chunk)
        h.digest()
        return n
    finally:
        os.close(fd)


def _walk(args: tuple[list[str], bool]) -> tuple[int, int]:
    folders, hashed = args
    files = nbytes = 0
    stack = list(folders)
    while stack:
        path = stack.pop()
        with os.scandir(path) as it:
            entries = list(it)
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                stack.append(e.path)
            elif hashed:
                nbytes += _read_hash(e.path)
                files += 1
            else:
                nbytes += e.stat(follow_symlinks=False).st_size
                files += 1
    return files, nbytes


def _walk_flat(args: tuple[list[str], int, int]) -> tuple[int, int]:
    """Process `part` of `parts`: list each flat folder whole, lstat every `parts`-th entry."""
    folders, part, parts = args
    files = nbytes = 0
    for folder in folders:
        with os.scandir(folder) as it:
            entries = list(it)
        for e in entries[part::parts]:
            if not e.is_dir(follow_symlinks=False):
                nbytes += e.stat(follow_symlinks=False).st_size
                files += 1
    return files, nbytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root")
    p.add_argument("--procs", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--hash", action="store_true")
    p.add_argument("--flat", action="store_true",
                   help="ROOT's top-level folders hold the files themselves (an LMCache or HiCache tier): each "
                        "process lists them and lstats its share of the entries")
    a = p.parse_args(argv)
    t0 = time.monotonic()
    if a.flat:
        tops = sorted(e.path for e in os.scandir(a.root) if e.is_dir(follow_symlinks=False))
        with get_context("fork").Pool(a.procs) as pool:
            results = pool.map(_walk_flat, [(tops, i, a.procs) for i in range(a.procs)])
        print(json.dumps({"files": sum(f for f, _ in results), "bytes": sum(b for _, b in results),
                          "seconds": round(time.monotonic() - t0, 3)}))
        return 0
    work = []  # second-level folders: enough pieces to balance N processes
    for top in sorted(os.scandir(a.root), key=lambda e: e.name):
        if top.is_dir(follow_symlinks=False):
            work += sorted(e.path for e in os.scandir(top.path) if e.is_dir(follow_symlinks=False))
    shares = [(work[i::a.procs], a.hash) for i in range(a.procs)]
    with get_context("fork").Pool(a.procs) as pool:
        results = pool.map(_walk, shares)
    files = sum(f for f, _ in results)
    nbytes = sum(b for _, b in results)
    print(json.dumps({"files": files, "bytes": nbytes, "seconds": round(time.monotonic() - t0, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
