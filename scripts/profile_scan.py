#!/usr/bin/env python3
"""Profile one `kvmigrate` command in-process with cProfile on *every* thread.

cProfile (and pyinstrument) only see the thread that enabled them, but `kvmigrate scan`
does its walking and hashing in a thread pool. This helper wraps `threading.Thread.run`
so each worker thread gets its own profiler, then merges all of them with the main
thread's into one pstats file. Times are therefore summed over threads (CPU-ish time,
not wall time); the wall time of the whole command is reported separately.

    python scripts/profile_scan.py --out scan.pstats --json top.json -- scan ROOT -q -o M.parquet

Run it with the interpreter kvmigrate is installed in. Used by `scripts/bench.py --profile`.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import threading
import time


def _profile_all_threads() -> list[cProfile.Profile]:
    """Give every thread started from now on its own enabled profiler."""
    profiles: list[cProfile.Profile] = []
    lock = threading.Lock()
    original_run = threading.Thread.run

    def run(self: threading.Thread) -> None:
        prof = cProfile.Profile()
        with lock:
            profiles.append(prof)
        prof.enable()
        try:
            original_run(self)
        finally:
            prof.disable()

    threading.Thread.run = run  # type: ignore[method-assign]
    return profiles


# Blocking calls where an idle thread waits for work: summed over threads they look
# expensive, but they are idle time, not cost.
WAITS = {"<method 'acquire' of '_thread.lock' objects>", "<method 'get' of '_queue.SimpleQueue' objects>",
         "<method 'acquire' of '_thread.RLock' objects>", "<built-in method time.sleep>"}


def _where(func: tuple[str, int, str]) -> str:
    filename, line, name = func
    if filename == "~":
        return name  # a built-in: "<built-in method posix.lstat>"
    parts = filename.replace(os.sep, "/").split("/")
    for anchor in ("kvmigrate", "site-packages", "lib"):
        if anchor in parts:
            i = len(parts) - 1 - parts[::-1].index(anchor)
            filename = "/".join(parts[i + (anchor != "kvmigrate"):])
            break
    return f"{filename}:{line}({name})"


def top_entries(stats: pstats.Stats, key: str, n: int) -> list[dict]:
    """The n most expensive functions by `key` ('tottime' = self time, 'cumtime')."""
    rows = []
    for func, (cc, nc, tt, ct, callers) in stats.stats.items():  # type: ignore[attr-defined]
        # built-ins say little on their own: name the Python function that spends the time
        top_caller = max(callers.items(), key=lambda kv: kv[1][3], default=None)
        rows.append({"function": _where(func), "ncalls": nc, "primitive_calls": cc,
                     "tottime_s": round(tt, 4), "cumtime_s": round(ct, 4),
                     "called_from": _where(top_caller[0]) if top_caller else None,
                     "waiting": func[2] in WAITS})
    field = "tottime_s" if key == "tottime" else "cumtime_s"
    rows.sort(key=lambda r: r[field], reverse=True)
    return rows[:n]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="merged pstats file to write")
    parser.add_argument("--json", dest="json_out", help="write the top entries as JSON here")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the kvmigrate arguments")
    ns = parser.parse_args()
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    if not args:
        parser.error("give the kvmigrate arguments after --, e.g. -- scan ROOT -q")

    threads = _profile_all_threads()
    from kvmigrate.cli import cli  # imported after the patch: the pool is created later anyway

    main_prof = cProfile.Profile()
    exit_code = 0
    start = time.perf_counter()
    main_prof.enable()
    try:
        cli.main(args=args, prog_name="kvmigrate", standalone_mode=True)
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        main_prof.disable()
    wall = time.perf_counter() - start

    stats = pstats.Stats(main_prof)
    for prof in threads:
        stats.add(prof)
    stats.dump_stats(ns.out)
    summary = {
        "argv": ["kvmigrate", *args],
        "exit_code": exit_code,
        "wall_s": round(wall, 3),
        "threads_profiled": 1 + len(threads),
        "profiled_time_s": round(stats.total_tt, 3),  # type: ignore[attr-defined]
        "top_tottime": top_entries(stats, "tottime", ns.top),
        "top_cumtime": top_entries(stats, "cumtime", ns.top),
        "top_kvmigrate_cumtime": [r for r in top_entries(stats, "cumtime", 10 * ns.top)
                                  if r["function"].startswith("kvmigrate/")
                                  and not r["function"].startswith("kvmigrate/cli/")][:ns.top],
        "pstats": os.path.abspath(ns.out),
    }
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump(summary, f, indent=1)
    else:
        json.dump(summary, sys.stdout, indent=1)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
