"""The memory group: every command of a migration's lifecycle at three tree sizes, its peak
RSS and time, their growth per file, with `cp -al` and `find` beside as the filesystem's own."""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .core import Bench
from .harness import DEFAULT_WORKDIR, REPO, q, rmtree, run_measured, sh
from .trees import TreeSpec, expected_dirs, fs_free

sys.path.insert(0, str(REPO / "tests"))
from helpers.memory import LIFECYCLE, lifecycle_steps  # tests/helpers/memory.py: one list of commands

# files of the three trees (2 files a block: one per rank of an llm-d TP=2 MLA tree)
MEMORY_SIZES = {"small": (20_000, 60_000, 120_000), "large": (100_000, 1_000_000, 3_000_000)}
PROJECT_AT = 10_000_000         # files: the size the peak RSS is projected to
GOAL_PEAK_MIB = 1024            # goal: every command's peak projected at PROJECT_AT files
GOAL_MARGINAL_RATIO = 1.1       # goal: cost per file between the two largest / between the two smallest
FILE_BYTES = 4096               # 4 layers x 1 KiB pages
# the filesystem's own growth, run on each tree before the lifecycle
BASELINES = {
    "cp_al": "`cp -al` of the tree (one hard link a file, its folders made again)",
    "find": "`find -printf` of size, inode and mtime of every file",
}


def memory_sizes(args: argparse.Namespace) -> list[int]:
    """--memory-files, or the scale's three sizes; at least two, ascending."""
    if getattr(args, "memory_files", None):
        try:
            sizes = sorted({int(s.replace("_", "")) for s in args.memory_files.split(",") if s.strip()})
        except ValueError:
            sys.exit(f"bench: --memory-files takes file counts separated by commas, got {args.memory_files!r}")
    else:
        sizes = list(MEMORY_SIZES[args.scale])
    if len(sizes) < 2 or sizes[0] < 4:
        sys.exit("bench: the memory group needs at least two sizes of at least 4 files (--memory-files)")
    return sizes


def memory_steps(args: argparse.Namespace) -> list[str]:
    """--memory-steps (in LIFECYCLE's order), or every command of LIFECYCLE."""
    if not getattr(args, "memory_steps", None):
        return list(LIFECYCLE)
    chosen = {s.strip() for s in args.memory_steps.split(",") if s.strip()}
    unknown = sorted(chosen - set(LIFECYCLE))
    if unknown or not chosen:
        sys.exit(f"bench: --memory-steps takes names of {', '.join(LIFECYCLE)}; got {args.memory_steps!r}")
    return [name for name in LIFECYCLE if name in chosen]


def baselines_up_to(args: argparse.Namespace) -> int | None:
    """--memory-baselines-up-to: `find` and `cp -al` run beside the commands at sizes of at
    most this many files (their figures then come from the sizes they ran at); None: at every
    size."""
    return getattr(args, "memory_baselines_up_to", None)


def space_needed(files: int) -> dict[str, int]:
    """Bytes and inodes of one size's tree at its peak: the tree, its migrated namespace (hard
    links: folders only), the `cp -al` copy's folders, the manifests and audits; the trees
    are built one after the other, each removed before the next."""
    dirs = 2 * expected_dirs(files // 2) + 4
    inodes = files + 3 * dirs + 1000
    nbytes = files * FILE_BYTES + 3 * dirs * 4096 + 6 * files * 200
    return {"bytes": int(nbytes * 1.2) + (1 << 30), "inodes": int(inodes * 1.2) + 10_000}


def check_space(workdir: Path, sizes: list[int], force: bool, log: Any) -> dict:
    """df and df -i of the workdir, and the space the largest tree needs: refuse (unless
    --force) before building a tree that will not fit."""
    workdir.mkdir(parents=True, exist_ok=True)
    for argv in (["df", "-h", str(workdir)], ["df", "-i", str(workdir)]):
        p = subprocess.run(argv, capture_output=True, text=True)
        for line in (p.stdout or p.stderr).splitlines():
            log(f"memory: {line}")
    need = space_needed(max(sizes))
    free = fs_free(workdir)
    info = {"workdir": str(workdir), "needed_bytes_estimate": need["bytes"], "needed_inodes_estimate": need["inodes"],
            "free_bytes_before": free["bytes"], "free_inodes_before": free["inodes"]}
    log(f"memory: the largest tree ({max(sizes):,} files) needs about {need['bytes'] / 2**30:.1f} GiB and "
        f"{need['inodes']:,} inodes; free {free['bytes'] / 2**30:.1f} GiB and {free['inodes']:,} inodes")
    if need["bytes"] > free["bytes"] or need["inodes"] > free["inodes"]:
        msg = (f"bench: not enough room in {workdir} for the memory group: need ~{need['bytes'] / 2**30:.1f} GiB "
               f"and {need['inodes']:,} inodes, have {free['bytes'] / 2**30:.1f} GiB and {free['inodes']:,}. "
               "Use --workdir on a bigger filesystem or smaller --memory-files.")
        if not force:
            sys.exit(msg + " (--force to try anyway)")
        info["note"] = msg + " Ran anyway (--force)."
    return info


def run_memory_group(args: argparse.Namespace, bench: Bench, log: Any,
                     save: Callable[[dict], None] | None = None) -> dict:
    """At each size: build an llm-d TP=2 MLA tree, time `find` and `cp -al` of it, then run
    every command of LIFECYCLE (or of --memory-steps) on it in order (one run each: the
    lifecycle changes the tree), each measured by run_measured (wall time, peak RSS from wait4); the tree is
    removed before the next size. `save` gets the figures so far after each command (marked
    `stopped` until the last): a run stopped part way (a session's end) keeps its report."""
    sizes, steps, up_to = memory_sizes(args), memory_steps(args), baselines_up_to(args)
    workdir = Path(args.workdir or DEFAULT_WORKDIR / "memory").resolve()
    bench.workdir = workdir
    space = check_space(workdir, sizes, args.force, log)
    out: dict[str, Any] = {"sizes": [], "commands": steps, "subset": steps != list(LIFECYCLE),
                           "baselines": BASELINES, "baselines_up_to": up_to,
                           "space": space,
                           "tree": "llm-d TP=2 MLA, 4 KiB files (4 layers of 1 KiB), blocks on two ranks"}
    load_before = os.getloadavg()[0]
    for files in sizes:
        spec = TreeSpec(f"memory-{files}", f"memory group, {files:,} files", max(1, files // 2), 1024)
        rmtree(bench.tree_root(spec.name))  # the lifecycle changed an earlier run's tree: never reused
        bench._stamp_path(spec.name).unlink(missing_ok=True)
        tree = bench.build_tree(spec)
        root = bench.tree_root(spec.name)
        work = workdir / f"work-{files}"
        rmtree(work)
        work.mkdir(parents=True)
        size: dict[str, Any] = {"files": tree["counts"]["files"], "build_s": tree["build_s"], "steps": {}}
        out["sizes"].append(size)

        def saved() -> None:
            if save is not None:
                save({**out, "figures": memory_figures(out["sizes"], [*BASELINES, *steps]), "stopped": True,
                      "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
                      "when": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                      "command": "python3 scripts/bench.py " + " ".join(q(a) for a in sys.argv[1:])})

        if up_to is None or files <= up_to:
            measure_step(size, work, "find", sh(f"find {q(root)} -type f -printf '%s %i %T@ %p\\n' > /dev/null"),
                         log)
            measure_step(size, work, "cp_al", ["cp", "-al", str(root), str(workdir / "cp-al")], log)
            rmtree(workdir / "cp-al")
        saved()
        for name, argv in lifecycle_steps(work, root):
            if name in steps:
                measure_step(size, work, name, [bench.kvm, *map(str, argv)], log)
                saved()
        rmtree(root)
        bench._stamp_path(spec.name).unlink(missing_ok=True)
        if not args.keep:
            rmtree(work)
    out["figures"] = memory_figures(out["sizes"], [*BASELINES, *steps])
    out["load_before"], out["load_after"] = round(load_before, 2), round(os.getloadavg()[0], 2)
    out["when"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    out["command"] = "python3 scripts/bench.py " + " ".join(q(a) for a in sys.argv[1:])
    return out


def measure_step(size: dict, work: Path, name: str, argv: list[str], log: Any) -> None:
    """Run one command after `sync`, its outputs in WORK; its figures into SIZE's steps."""
    os.sync()
    r = run_measured(argv, stdout=str(work / f"{name}.out"), stderr=str(work / f"{name}.err"))
    size["steps"][name] = {**r.as_dict(), "wall_s": round(r.wall_s, 3)}
    failed = " FAILED" if r.rc & (2 | 8 | 32) or r.rc < 0 else ""
    log(f"memory: {size['files']:,} files: {name} {r.wall_s:.2f} s, peak RSS {r.maxrss_kib / 1024:.0f} MiB, "
        f"exit {r.rc}{failed}")


def memory_figures(sizes: list[dict], names: list[str]) -> dict[str, dict]:
    """Per command: peak RSS (MiB) and time at each size (None where it did not run: a run
    stopped part way through its largest tree); the peak's growth per file between the two
    largest sizes it ran at and its projection at PROJECT_AT files; the time per file between
    its two smallest and between its two largest sizes, and their ratio (1.0: linear)."""
    sizes = sorted(sizes, key=lambda s: s["files"])
    figures: dict[str, dict] = {}
    for name in names:
        steps = [s["steps"].get(name) for s in sizes]
        ran = [(s["files"], st) for s, st in zip(sizes, steps) if st is not None]
        if not ran:
            continue
        files = [f for f, _ in ran]
        kib = [st["maxrss_kib"] for _, st in ran]
        wall = [st["wall_s"] for _, st in ran]
        f: dict[str, Any] = {"files": [s["files"] for s in sizes],
                             "peak_rss_mib": [None if st is None else round(st["maxrss_kib"] / 1024, 1) for st in steps],
                             "wall_s": [None if st is None else st["wall_s"] for st in steps],
                             "rc": [None if st is None else st["rc"] for st in steps]}
        figures[name] = f
        if len(ran) < 2:  # (a baseline left out of the larger sizes: its figures, no slope)
            f["slope_bytes_per_file"], f["marginal_us_per_file"] = None, [None, None]
            continue
        (f1, k1, t1), (f2, k2, t2) = zip(files[-2:], kib[-2:], wall[-2:])
        slope = (k2 - k1) * 1024 / (f2 - f1) if f2 > f1 else None
        f["slope_bytes_per_file"] = round(slope, 1) if slope is not None else None
        if slope is not None:
            f["projected_mib_at_10m"] = round((k2 * 1024 + max(slope, 0) * (PROJECT_AT - f2)) / 2**20, 1)
            f["peak_goal_met"] = f["projected_mib_at_10m"] <= GOAL_PEAK_MIB
        small = (wall[1] - wall[0]) / (files[1] - files[0]) if files[1] > files[0] else None
        large = (t2 - t1) / (f2 - f1) if f2 > f1 else None
        f["marginal_us_per_file"] = [round(x * 1e6, 3) if x is not None else None for x in (small, large)]
        if len(ran) > 2 and small and large is not None and small > 0:  # (two sizes: one interval, no ratio)
            f["marginal_ratio"] = round(large / small, 2)
            f["marginal_goal_met"] = f["marginal_ratio"] <= GOAL_MARGINAL_RATIO
    return figures
