#!/usr/bin/env python3
"""`scan --verify hash --baseline` of an unchanged tree, against `find -printf` of it and
a full hash scan: wall time, CPU, and bytes read (rchar of the command and its children:
Linux adds a reaped child's I/O counters to its parent's /proc/self/io).

    python3 scripts/bench_baseline.py TREE [--kvmigrate PATH] [--facts ...] [--out reports/BASELINE.md]

One run of each, warm tree (it is read once first). Writes a Markdown page (method and
table; scripts/bench.py copies the table into reports/BENCHMARKS.md).
A tree: `kvmigrate synth TREE --family llmd --tp 2 --kv-kind mla --blocks 50000
--block-bytes 1024` (100k files of 4 KiB).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time


def rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def measured(argv: list[str]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of the children, bytes read) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r0 = rchar()
    t0 = time.monotonic()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.monotonic() - t0
    r1 = rchar()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in (0, 1):
        sys.exit(f"{argv[0]} exited {proc.returncode}: {proc.stderr.decode()[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), r1 - r0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("tree")
    p.add_argument("--kvmigrate", default=shutil.which("kvmigrate") or "kvmigrate")
    p.add_argument("--facts", nargs="*", default=["--model-dtype", "bfloat16", "--kv-kind", "mla"])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "reports", "BASELINE.md"))
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="kvmigrate-bench-baseline-")
    full, again = os.path.join(work, "full.parquet"), os.path.join(work, "again.parquet")
    sizes = subprocess.run(["find", a.tree, "-type", "f", "-printf", "%s\n"], capture_output=True, text=True,
                           check=True).stdout.split()
    files, tree_bytes = len(sizes), sum(map(int, sizes))
    subprocess.run(f"find {a.tree} -type f -print0 | xargs -0 cat > /dev/null", shell=True, check=True)  # warm
    scan = [a.kvmigrate, "scan", a.tree, "--verify", "hash", "-q", *a.facts]
    runs = {
        "find -printf (stat only)": ["find", a.tree, "-printf", "%s %T@ %i %p\n"],
        "scan --verify size (stat only)": [a.kvmigrate, "scan", a.tree, "-q", *a.facts, "-o",
                                           os.path.join(work, "size.parquet")],
        "scan --verify hash (full)": scan + ["-o", full],
        "scan --verify hash --baseline (unchanged, --recheck 0)": scan + ["-o", again, "--baseline", full,
                                                                          "--recheck", "0"],
        "scan --verify hash --baseline (unchanged, default --recheck 1/30)": scan + [
            "-o", again, "--baseline", full],
    }
    results = {name: measured(argv) for name, argv in runs.items()}
    manifest_bytes = os.path.getsize(full)
    find_wall = results["find -printf (stat only)"][0]
    floor = results["scan --verify size (stat only)"][2]  # what a scan reads besides files: Python, manifest
    load = os.getloadavg()[0]
    out = ["# `--baseline`: a scheduled hash audit of an unchanged tree", "",
           "Measured by `scripts/bench_baseline.py` (one run of each command, warm tree, "
           f"{os.cpu_count()} CPUs, load average {load:.1f} when it ran: other jobs shared the machine, so wall "
           "times are noisy; CPU seconds and bytes read are not). Bytes read: `rchar` of the command and "
           "its children from /proc/self/io (Linux adds a reaped child's counters to its parent's).", "",
           f"Tree: {files} files, {tree_bytes} bytes in files; the baseline manifest: {manifest_bytes} bytes.", "",
           "| command | wall s | CPU s | wall vs find | bytes read (rchar) | beyond --verify size | of the tree |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for name, (wall, cpu, nread) in results.items():
        extra = nread - floor if name.startswith("scan") else None
        out.append(f"| {name} | {wall:.2f} | {cpu:.2f} | {wall / find_wall:.2f}x | {nread} | "
                   f"{'' if extra is None else extra} | {'' if extra is None else f'{100 * extra / tree_bytes:.2f}%'} |")
    out += ["", "\"beyond --verify size\": bytes a scan reads besides what a stat-only scan of the same tree "
            "reads (Python's own files, the manifest it summarizes): for the --baseline rows, the baseline "
            "manifest's columns; with --recheck 1/30, also the re-read thirtieth of the files.", ""]
    text = "\n".join(out)
    print(text)
    with open(a.out, "w") as f:
        f.write(text)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
