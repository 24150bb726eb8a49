"""Page cache left behind by a hash scan (issue 18 item 4), before/after in one run.

    .venv/bin/python scripts/bench_pagecache.py [--dir DIR] [--gib 2] [--base COMMIT]

Builds a vLLM tree of --gib GiB (512 KiB block files), syncs it and evicts it from the
page cache, then has "the engine" read 10% of its blocks (they are hot). For each build
(the code at --base, then this checkout) it evicts the cold 90% again, runs
`kvmigrate scan --verify hash`, and reports the tree's bytes resident in the page cache
after the scan (fincore: exact for these files) and /proc/meminfo Cached before/after
(the whole machine: other processes move it too). The --base build is `git archive` of
COMMIT with its C extension built in place. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def meminfo_cached() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Cached:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no Cached line in /proc/meminfo")


def resident(paths: list[str]) -> int:
    total = 0
    for i in range(0, len(paths), 500):
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *paths[i:i + 500]],
                             capture_output=True, text=True, check=True).stdout
        total += sum(int(x) for x in out.split())
    return total


def evict(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def base_build(commit: str, where: Path) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=where, check=True,
                   capture_output=True)
    return where


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed)")
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--base", default="dc7c478", help="commit before the page-cache change")
    args = ap.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="kvmigrate-pagecache-"))
    root = work / "root"
    blocks = int(args.gib * 1024 * MiB // (512 * 1024))
    if not root.exists():
        subprocess.run([sys.executable, "-m", "kvmigrate", "synth", str(root), "--blocks", str(blocks), "--layers",
                        "4", "--block-bytes", str(64 * 1024), "-q"], check=True)
    files = sorted(str(p) for p in root.rglob("*") if p.is_file() and p.name != "config.json")
    size = sum(os.path.getsize(p) for p in files)
    os.sync()
    evict(files)
    hot = files[::10]
    cold = sorted(set(files) - set(hot))
    for p in hot:  # the engine's working set
        Path(p).read_bytes()
    hot_bytes = sum(os.path.getsize(p) for p in hot)
    builds = [(f"before ({args.base})", base_build(args.base, work / "base")), ("after (this checkout)", REPO)]
    print(f"tree: {len(files):,} block files, {size / MiB:,.0f} MiB; engine-hot: {len(hot):,} files, "
          f"{hot_bytes / MiB:,.0f} MiB\n")
    print("| build | tree resident after the scan | of it hot blocks | cold blocks | meminfo Cached delta |")
    print("|---|---:|---:|---:|---:|")
    for name, src in builds:
        evict(cold)
        before = meminfo_cached()
        env = {**os.environ, "PYTHONPATH": str(src)}
        subprocess.run([sys.executable, "-m", "kvmigrate", "scan", str(root), "--verify", "hash", "-o",
                        str(work / "m.parquet"), "-q"], env=env, check=False, cwd=str(work),
                       stdout=subprocess.DEVNULL)
        after = meminfo_cached()
        print(f"| {name} | {resident(files) / MiB:,.0f} MiB | {resident(hot) / MiB:,.0f} MiB | "
              f"{resident(cold) / MiB:,.0f} MiB | {(after - before) / MiB:+,.0f} MiB |")


if __name__ == "__main__":
    main()
