#!/usr/bin/env python3
"""Profile one `kvmigrate` command as it really runs, with py-spy (sampling).

`kvmigrate scan` walks in worker processes; an in-process profiler (cProfile,
pyinstrument) sees only the parent. py-spy samples the parent *and* its workers from
outside, at a fixed rate, with no instrumentation overhead, so the shares are shares of
real wall time per process. A sample taken while a thread sits in a system call is
charged to the Python line that made the call (`os.read(...)`, `list(scandir)`): those
lines are the kernel's share.

    python scripts/profile_spy.py --json top.json -- scan ROOT --verify hash -q -o M.parquet

Needs `py-spy` (pip install py-spy) on PATH or next to the interpreter. Used by
`scripts/bench.py --profile`.
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path


def find_py_spy(python: str) -> str | None:
    """py-spy on PATH, or in the bin folder of the given interpreter."""
    near = Path(python).parent / "py-spy"
    return str(near) if near.exists() else shutil.which("py-spy")


def _frame_parts(frame: str) -> tuple[str, str]:
    """('function (file)', 'function (file:line)') of a py-spy raw frame
    'function (path/file.py:LINE)'."""
    name, _, loc = frame.rpartition(" (")
    loc = loc.rstrip(")")
    path, _, line = loc.rpartition(":")
    short = "/".join(Path(path).parts[-2:]) if path else loc
    return f"{name} ({short})", f"{name} ({short}:{line})"


def _source_file(path: str) -> str:
    """The file py-spy's relative path names in the profiled installation (this script runs
    under the measured interpreter), not in the current folder: a checkout edited since
    would show other lines."""
    if os.path.isabs(path):
        return path
    for entry in sys.path[1:]:  # (sys.path[0] is this script's folder)
        candidate = os.path.join(entry or os.getcwd(), path)
        if os.path.isfile(candidate):
            return candidate
    return path


def aggregate(raw: str, top: int) -> dict:
    """Self samples per function and per line, inclusive samples per kvmigrate function,
    and samples per process (parent / workers)."""
    self_fn: Counter = Counter()
    self_line: Counter = Counter()
    incl: Counter = Counter()
    procs: Counter = Counter()
    source: dict[str, str] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        total += count
        frames = stack.split(";")
        if frames and frames[0].startswith("process "):
            procs[frames[0].split(":", 1)[0]] += count
            frames = frames[1:]
        if not frames:
            continue
        fn, ln = _frame_parts(frames[-1])
        self_fn[fn] += count
        self_line[ln] += count
        if ln not in source:
            path, _, lineno = frames[-1].rpartition(" (")[2].rstrip(")").rpartition(":")
            source[ln] = linecache.getline(_source_file(path), int(lineno)).strip() if lineno.isdigit() else ""
        for f in {_frame_parts(f)[0] for f in frames}:
            if "kvmigrate/" in f:
                incl[f] += count

    def pct(c: Counter) -> list[list]:
        return [[k, round(100.0 * v / total, 1)] for k, v in c.most_common(top)] if total else []

    by_line = pct(self_line)
    for row in by_line:  # the source text of the line, so a reader sees what it does
        row.append(source.get(row[0], ""))
    return {"samples": total, "self_by_function_pct": pct(self_fn), "self_by_line_pct": by_line,
            "inclusive_kvmigrate_pct": pct(incl),
            "processes": [[p, round(100.0 * v / total, 1)] for p, v in procs.most_common()] if total else []}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="where the aggregated profile goes")
    p.add_argument("--rate", type=int, default=250, help="samples per second per process")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--kvmigrate", default=shutil.which("kvmigrate") or "kvmigrate")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the kvmigrate arguments")
    a = p.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    spy = find_py_spy(sys.executable)
    if spy is None:
        print("profile_spy: py-spy not found (pip install py-spy)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "raw.txt")
        t0 = time.monotonic()
        proc = subprocess.run([spy, "record", "-r", str(a.rate), "--subprocesses", "--format", "raw", "-o", raw,
                               "--", a.kvmigrate, *cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
        wall = time.monotonic() - t0
        if proc.returncode not in (0, 1) or not os.path.exists(raw):
            print(f"profile_spy: py-spy failed: {proc.stderr.strip()[-500:]}", file=sys.stderr)
            return 1
        result = aggregate(Path(raw).read_text(), a.top)
    result.update({"tool": "py-spy (sampling, parent and worker processes)", "rate_hz": a.rate,
                   "wall_s": round(wall, 2), "command": " ".join(["kvmigrate", *cmd])})
    Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
