#!/usr/bin/env python3
"""Side-by-side benchmarks of kvmigrate against the standard tools, on the same trees.

Builds synthetic cache trees with `kvmigrate synth` (several processes in parallel),
warms them, then runs each comparison group on the same warm tree, changing the order
of the commands every repetition (A,B,C; C,B,A; B,C,A; A,C,B ...), and writes `reports/BENCHMARKS.md`
and `reports/benchmarks.json` with medians, ratios, peak RSS and the issue's targets.

    python3 scripts/bench.py --scale small --reps 2        # ~1-2 minutes
    python3 scripts/bench.py --scale large --keep          # the issue's sizes (1M files, 4 GiB)
    python3 scripts/bench.py --scale small --profile       # + "Where the time goes"
    python3 scripts/bench.py --scale large --profile-only  # profile a kept tree, add to the report
    python3 scripts/bench.py --before b0bf138              # before/after in one run (bench_compare.py)
    python3 scripts/bench.py --before b0bf138 --scale small   # the same, a quick try (~2-3 min)
    python3 scripts/bench.py --only prune --prune-files 20000  # prune vs rm -rf, restore (issue 19)

`--before REV` (alias `--compare`) installs REV and `--after` (default HEAD) into their own
venvs and times each kvmigrate figure below with both, alternating old/new every repetition
on the same warm trees; it writes reports/redesign/BEFORE_AFTER.md and before_after.json
(old median, new median, new/old, PASS when <= 1.05) and exits 1 when a figure fails.
Its groups add `report` (report of a manifest, audit ROOT); the peers are not run.

Groups (see GROUPS below):
  meta      kvmigrate scan --verify size  vs  find -printf, fdfind           (4 KiB tree)
  hash4k    kvmigrate scan --verify hash  vs  find|xargs xxhsum -H2, jdupes -r, rdfind
  hash1m    the same on the 1 MiB-file tree (bandwidth rather than per-file overhead)
  migrate   kvmigrate migrate ROOT --apply (default flags, its own scan) and --manifest M(size)
            --apply (apply reads what it places)  vs  the same safety by hand: xxhsum -H2 of the
            legacy folders, then cp -al; plain cp -al and a `scan --verify hash` manifest's apply
            beside                                                          (4 KiB tree)
  flat      an SGLang HiCache directory (one flat folder of page files, MLA, 1 KiB pages; 50,000 at
            small, 1,000,000 at large, or --flat-files N): scan --verify size vs find -printf,
            scan --verify hash vs find|xargs xxhsum -H2 (serial) and xargs -P8 -n512 (parallel)
  startup   kvmigrate --help (20 runs) and python3 -c pass for reference
  cold4k    (issue 22) the page cache dropped before every command, 4 KiB tree: scan --verify size vs
            find -printf; scan --verify hash vs find|xargs -P(4 x cores) -n512 xxhsum -H2 and rmlint
            -T df (one run, stopped at --rmlint-timeout: a lower bound)
  cold1m    the same on the 1 MiB tree, plus fio's O_DIRECT sequential read of the same files with
            kvmigrate's reads in flight (the device's limit)
  scale     scan --verify size, report and migrate --manifest M --apply at a tenth, three tenths and
            all of the 4 KiB tree (100k, 300k, 1M files at large): per-file and marginal cost, peak RSS
  journal   (alone: `--only journal [--before REV]`) journal bytes per linked block and
            `rollback` time at 100,000 blocks, this checkout against REV (a git worktree of
            it with its own venv); merged into an existing benchmarks.json
  prune     (alone: `--only prune [--prune-files N]`) `kvmigrate prune --apply` of N migrated
            legacy block files (default 500,000) vs `rm -rf` of the same legacy folders (one run,
            the ratio) and `kvmigrate restore` of that prune; merged into an existing
            benchmarks.json, or a prune-only report in a fresh --out-dir
  baseline  (alone: `--only baseline [--baseline-files N] [--baseline-cold]`) `audit --verify
            hash --baseline auto` of an unchanged tree of N files of 4 KiB (default 1,000,000)
            vs `find -printf` and the full hash audit, with the default --recheck and 0;
            bytes read (rchar, read_bytes) as a share of the tree's; warm unless
            --baseline-cold; merged into the --out-dir's benchmarks.json if it has a full
            report, else a report of its own there
baseline, journal and prune also run after the other groups of a full run (`--only
meta,...,baseline,journal,prune`): one run, one report (baseline then on the run's 4 KiB tree).
The scan groups also time the Python floor (scripts/floor_walk.py) as a reference.

Needs only the Python standard library plus the Debian packages xxhash, jdupes, rdfind,
fd-find, findutils, coreutils, util-linux (fincore), and rmlint and fio for the cold groups; a run checks only the tools of
its groups (`--only migrate` needs xxhash, findutils, coreutils, util-linux). `--profile` uses py-spy when it is
installed next to kvmigrate's interpreter or on PATH (`pip install py-spy`: it samples the
worker processes too), else cProfile. `.ci/run` does not run it.
Peak RSS and CPU times come from os.wait4() on each command (the rusage of the process
and its reaped children, the same figure `/usr/bin/time -v` prints as "Maximum resident
set size"); the bench resets its own peak RSS before each command, because a child starts
with its parent's high-water mark.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import profile_spy  # noqa: E402  (scripts/profile_spy.py: py-spy's side of --profile)

REPORTS = REPO / "reports"
DEFAULT_WORKDIR = Path("/work/bench-tmp")

# tool -> Debian package that ships it
TOOLS = {
    "find": "findutils", "xargs": "findutils", "cp": "coreutils", "xxhsum": "xxhash", "jdupes": "jdupes",
    "rdfind": "rdfind", "fdfind": "fd-find", "fincore": "util-linux", "rmlint": "rmlint", "fio": "fio",
}
# tools every run uses (warm-up, counts, residency), then each group's own
BASE_TOOLS = ("find", "xargs", "fincore")
GROUP_TOOLS = {"flat": ("xxhsum",), "meta": ("fdfind",), "hash4k": ("xxhsum", "jdupes", "rdfind"), "hash1m": ("xxhsum", "jdupes", "rdfind"),
               "migrate": ("xxhsum", "cp"), "startup": (), "baseline": (), "cold4k": ("xxhsum", "rmlint"),
               "cold1m": ("xxhsum", "rmlint", "fio"), "scale": ("cp",)}

# Facts the trees need for a target (llm-d S1 MLA -> vllm-0.28 replicated namespace).
FACTS = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]


# --------------------------------------------------------------------------- trees

@dataclass(frozen=True)
class TreeSpec:
    """One synthetic tree: llm-d, TP=2, MLA (identical replicas on both ranks, so the
    duplicate finders have real replica groups to find), real fan-out <hhh>/<hh>_g0.
    Four MLA layers of `page_bytes` each make one file of 4 x page_bytes."""

    name: str
    title: str
    blocks: int          # block keys in total (files = 2 x blocks, one per rank)
    page_bytes: int
    tp: int = 2
    layers: int = 4
    family: str = "llmd"  # "sglang": a flat HiCache directory, MLA (one file per page, no config.json)

    @property
    def file_bytes(self) -> int:
        return self.layers * self.page_bytes

    @property
    def files(self) -> int:
        return self.blocks if self.family == "sglang" else self.tp * self.blocks

    @property
    def other_files(self) -> int:
        """Files besides the blocks: the namespace's config.json (none in a flat directory)."""
        return 0 if self.family == "sglang" else 1

    def synth_args(self, blocks: int, seed: int) -> list[str]:
        if self.family == "sglang":  # latent pages of 4 layers x 16 tokens x 8 x 2 B = 1 KiB
            return ["--family", "sglang", "--sgl-era", "e4", "--kv-kind", "mla", "--tp", str(self.tp),
                    "--layers", str(self.layers), "--blocks", str(blocks), "--seed", str(seed),
                    "--model", "deepseek-ai/DeepSeek-V3"]
        return ["--family", "llmd", "--tp", str(self.tp), "--kv-kind", "mla", "--layers", str(self.layers),
                "--block-bytes", str(self.page_bytes), "--blocks", str(blocks), "--seed", str(seed)]


SCALES = {
    # quick run: ~50k small files + 256 MiB of 1 MiB files
    "small": {"files4k": 25_000, "files1m": 128, "flat": 50_000},
    # the issue's sizes: >= 1M small files, >= 4 GiB of 1 MiB files, a 1M-file HiCache directory
    "large": {"files4k": 500_000, "files1m": 2_048, "flat": 1_000_000},
}


def tree_specs(scale: str, flat_files: int | None = None) -> dict[str, TreeSpec]:
    """The trees of a scale; `flat_files` (--flat-files) sizes the flat HiCache directory."""
    s = dict(SCALES[scale])
    if flat_files:
        s["flat"] = flat_files
    return {
        "files4k": TreeSpec("files4k", "4 KiB files (per-file overhead)", s["files4k"], 1024),
        "files1m": TreeSpec("files1m", "1 MiB files (bandwidth)", s["files1m"], 256 * 1024),
        "flat": TreeSpec("flat", "SGLang HiCache directory (1 KiB page files in one folder)", s["flat"], 256,
                         tp=8, family="sglang"),
        # the scale group's smaller trees: a tenth and three tenths of files4k (100k and 300k files at large)
        "files4k-0.1": TreeSpec("files4k-0.1", "4 KiB files, a tenth", s["files4k"] // 10, 1024),
        "files4k-0.3": TreeSpec("files4k-0.3", "4 KiB files, three tenths", 3 * s["files4k"] // 10, 1024),
    }


SCALE_TREES = ("files4k-0.1", "files4k-0.3", "files4k")  # the scale group's trees, smallest first


FANOUT_LEAVES = 4096 * 256  # <hhh>/<hh> leaf folders one rank folder can have


def expected_dirs(blocks: int) -> int:
    """Folders one rank folder of `blocks` uniformly hashed keys occupies (<hhh> + leaves)."""
    hhh = 4096 * (1 - math.exp(-blocks / 4096))
    leaves = FANOUT_LEAVES * (1 - math.exp(-blocks / FANOUT_LEAVES))
    return int(hhh + leaves) + 1


def trees_of(groups: list[str]) -> set[str]:
    """The trees these groups run on (all of them when no group names one)."""
    wanted = {GROUP_TREES[g] for g in groups if g in GROUP_TREES}
    return wanted or set(GROUP_TREES.values())


def space_needed(specs: dict[str, TreeSpec], groups: list[str]) -> dict[str, int]:
    """Bytes and inodes the run needs at its peak: both trees, one extra copy of a rank
    folder's folders (cp -al or the migrated namespace, removed between repetitions),
    the manifests and the tool outputs."""
    block = 4096
    inodes = 0
    nbytes = 0
    wanted = trees_of(groups)
    for name, spec in specs.items():
        if name not in wanted:
            continue
        dirs = 1 if spec.family == "sglang" else spec.tp * expected_dirs(spec.blocks) + spec.tp + 2
        inodes += spec.files + 1 + dirs
        nbytes += spec.files * max(block, -(-spec.file_bytes // block) * block) + dirs * block
        manifests = 4 if "migrate" in groups else 2
        nbytes += manifests * spec.files * 200
        nbytes += 3 * spec.files * 300  # jdupes / rdfind / xxhsum outputs
    if "migrate" in groups:
        d = expected_dirs(specs["files4k"].blocks) + 4
        inodes += 2 * d
        nbytes += 2 * d * block
    return {"bytes": int(nbytes * 1.1) + (1 << 30), "inodes": int(inodes * 1.1) + 10_000}


def fs_free(path: Path) -> dict[str, int]:
    st = os.statvfs(path)
    return {"bytes": st.f_bavail * st.f_frsize, "inodes": st.f_favail, "total_bytes": st.f_blocks * st.f_frsize,
            "total_inodes": st.f_files}


# --------------------------------------------------------------------------- running commands

@dataclass
class Run:
    wall_s: float
    user_s: float
    sys_s: float
    maxrss_kib: int
    rc: int
    rchar: int | None = None       # bytes read by read()/pread() calls (page cache hits too), /proc/self/io
    read_bytes: int | None = None  # bytes the block layer fetched for it (page cache misses)
    timed_out: bool = False        # killed at the command's timeout: wall_s is a lower bound

    def as_dict(self) -> dict:
        d = {"wall_s": round(self.wall_s, 4), "user_s": round(self.user_s, 4), "sys_s": round(self.sys_s, 4),
             "maxrss_kib": self.maxrss_kib, "rc": self.rc}
        if self.timed_out:
            d["timed_out"] = True
        if self.rchar is not None:
            d.update(rchar=self.rchar, read_bytes=self.read_bytes)
        return d


def proc_io() -> dict[str, int]:
    """This process's I/O counters (/proc/self/io). Linux adds a reaped child's counters
    (and its reaped children's) to its parent's, so the difference around a wait4 is the
    command's and its children's; {} where the file is unreadable."""
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f)}
    except (OSError, ValueError):
        return {}


def damon_pageout() -> str:
    """Whether a DAMON pageout scheme runs (some VMs ship one): it evicts idle page cache, so a
    tree warmed for a warm group may be partly cold again by the time the group times it."""
    root = Path("/sys/kernel/mm/damon/admin/kdamonds")
    found = []
    for state in sorted(root.glob("*/state")):
        try:
            actions = {a.read_text().strip() for a in state.parent.glob("contexts/*/schemes/*/action")}
            if "pageout" in actions:
                found.append(f"kdamond {state.parent.name} (pageout) {state.read_text().strip()}")
        except OSError:
            continue
    return "; ".join(found)


def reset_peak_rss() -> None:
    """Set this process's peak RSS back to its current RSS (/proc/self/clear_refs, 5). A child
    started by vfork + exec begins with its parent's high-water mark as its own, so without
    this a small command shows the bench's largest moment as its peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def status_kib(field: str) -> int | None:
    """One kB field of /proc/self/status (VmHWM: peak RSS since the last reset, VmRSS: now),
    None where unreadable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def run_measured(argv: list[str], *, stdout: str | None = None, stderr: str | None = None,
                 cwd: str | None = None, env: dict | None = None, timeout_s: float | None = None) -> Run:
    """Run one command, wait for it with wait4 and return wall time and its rusage; with
    `timeout_s`, its process group is killed then (Run.timed_out: the time is a lower bound)."""
    import threading

    out = open(stdout, "wb") if stdout else subprocess.DEVNULL
    err = open(stderr, "wb") if stderr else subprocess.DEVNULL
    timer = None
    killed = threading.Event()
    try:
        reset_peak_rss()
        io0 = proc_io()
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=cwd, env=env,
                                start_new_session=timeout_s is not None)
        if timeout_s is not None:
            def kill() -> None:
                killed.set()
                try:
                    os.killpg(proc.pid, 9)
                except OSError:
                    pass
            timer = threading.Timer(timeout_s, kill)
            timer.start()
        _pid, status, ru = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        if timer:
            timer.cancel()
        io1 = proc_io()
        proc.returncode = os.waitstatus_to_exitcode(status)
    finally:
        for f in (out, err):
            if not isinstance(f, int):
                f.close()
    io = {k: io1[k] - io0[k] for k in ("rchar", "read_bytes") if k in io0 and k in io1}
    return Run(wall, ru.ru_utime, ru.ru_stime, ru.ru_maxrss, proc.returncode, io.get("rchar"), io.get("read_bytes"),
               timed_out=killed.is_set())


def sh(cmd: str) -> list[str]:
    return ["/bin/sh", "-c", cmd]


def q(path: Any) -> str:
    return shlex.quote(str(path))


def tail(path: str | Path, n: int = 6) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def capture(argv: list[str], **kw: Any) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60, **kw)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable ({exc})"
    return (p.stdout or p.stderr).strip()


FLOOR_NOTE = ("The Python floor (scripts/floor_walk.py) is a reference, not a competitor: the bare walk and "
              "per-file syscalls in Python (by path), in the same number of processes, with no "
              "classification and no manifest: no pure-Python scanner can beat it. kvmigrate's compiled "
              "leaf walk (kvmigrate/_leafwalk.c, when built) makes those syscalls from C by file "
              "descriptor, so the two compare the cost of everything else: classification, rows, the "
              "manifest.")


@dataclass
class Command:
    """One timed command of a group."""

    key: str
    label: str
    argv: list[str]
    kind: str                      # "kvmigrate" | "baseline"
    ok_rcs: tuple[int, ...] = (0,)
    stdout: str | None = None      # file that receives stdout (None: /dev/null)
    reset: Any = None              # callable run (untimed) after each run
    check: Any = None              # callable(Run) -> dict of facts from the run's output
    available: bool = True
    why_unavailable: str = ""
    runs: list[Run] = field(default_factory=list)
    settled_s: list[float] = field(default_factory=list)  # untimed waits after each reset (--settle)
    facts: dict = field(default_factory=dict)
    error: str = ""
    max_runs: int | None = None    # fewer repetitions than the group's (a peer that takes many minutes)
    timeout_s: float | None = None  # killed then; its time is reported as a lower bound

    @property
    def shell(self) -> str:
        return self.argv[2] if self.argv[:2] == ["/bin/sh", "-c"] else " ".join(q(a) for a in self.argv)

    def summary(self) -> dict:
        walls = [r.wall_s for r in self.runs]
        d: dict[str, Any] = {"key": self.key, "label": self.label, "kind": self.kind, "command": self.shell,
                             "available": self.available}
        if not self.available:
            d["why_unavailable"] = self.why_unavailable
        if self.error:
            d["error"] = self.error
        if walls:
            d.update({
                "median_s": round(statistics.median(walls), 4), "min_s": round(min(walls), 4),
                "max_s": round(max(walls), 4),
                "median_user_s": round(statistics.median(r.user_s for r in self.runs), 4),
                "median_sys_s": round(statistics.median(r.sys_s for r in self.runs), 4),
                "peak_rss_mib": round(max(r.maxrss_kib for r in self.runs) / 1024, 1),
                "runs": [r.as_dict() for r in self.runs],
            })
            if all(r.rchar is not None for r in self.runs):
                d["median_rchar"] = round(statistics.median(r.rchar for r in self.runs))
                d["median_read_bytes"] = round(statistics.median(r.read_bytes for r in self.runs))
        if any(r.timed_out for r in self.runs):
            d["timed_out_after_s"] = self.timeout_s
        if self.facts:
            d["facts"] = self.facts
        if self.settled_s:
            d["settled_s"] = self.settled_s
        return d

    @property
    def median(self) -> float | None:
        return statistics.median(r.wall_s for r in self.runs) if self.runs else None


@dataclass
class Group:
    key: str
    title: str
    tree: str
    commands: list[Command]
    pairs: list[tuple[str, str]]   # (kvmigrate command key, baseline key): ratio = A / B
    note: str = ""
    items: int | None = None       # what a rate counts (default: the tree's files)
    reps: int = 0
    item_name: str = "files"
    loadavg: dict = field(default_factory=dict)


def settle(path: Path, most_s: float, quiet_s: float = 1.0) -> float:
    """Wait (untimed) until the block device under `path` has written and discarded
    nothing for `quiet_s`, at most `most_s` seconds; return the seconds waited. A reset's
    deletes reach the disk later (ext4 with `discard` trims at journal commit), and would
    otherwise land in the next command's time. 0 when the device's counters are unreadable."""
    dev = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")

    def written() -> tuple[str, ...] | None:
        try:
            f = stat.read_text().split()
        except OSError:
            return None
        return (f[6], f[13]) if len(f) > 13 else (f[6],)  # sectors written, sectors discarded

    start = time.perf_counter()
    last = written()
    if last is None:
        return 0.0
    quiet_since = start
    while time.perf_counter() - start < most_s:
        time.sleep(0.2)
        now = written()
        if now != last:
            last, quiet_since = now, time.perf_counter()
        elif time.perf_counter() - quiet_since >= quiet_s:
            break
    return time.perf_counter() - start


def rep_order(cmds: list, rep: int) -> list:
    """The order of repetition `rep`: rotated by one every second repetition, and every
    odd repetition the one before it reversed (A,B,C; C,B,A; B,C,A; A,C,B; ...). Each
    command goes first in turn, and each one runs as often right after a neighbour as
    right before it: a plain rotation kept B always right after A, so B could read what A
    left in a cache that drop_caches cannot empty (the VM host's, behind the virtual disk)."""
    if not cmds:
        return []
    shift = (rep // 2) % len(cmds)
    order = cmds[shift:] + cmds[:shift]
    return order[::-1] if rep % 2 else order


def run_group(group: Group, reps: int, log: Any, out_dir: Path, settle_s: float = 0.0, cold: bool = False) -> None:
    """Each repetition runs every available command once, in `rep_order`, so no command
    always runs first (or right after a cache-heavy one).
    With `settle_s`, a command's reset is followed by a wait for the disk to go quiet;
    `cold` drops the page cache (and dentries, inodes) before every timed command."""
    cmds = [c for c in group.commands if c.available]
    for rep in range(reps):
        for cmd in rep_order(cmds, rep):
            if cmd.error or (cmd.max_runs is not None and len(cmd.runs) >= cmd.max_runs):
                continue
            os.sync()  # nothing of the previous command's writeback lands in this one's time
            if cold:
                drop_page_cache()
            errfile = str(out_dir / f"{cmd.key}.stderr")
            r = run_measured(cmd.argv, stdout=cmd.stdout, stderr=errfile, timeout_s=cmd.timeout_s)
            if r.timed_out:
                cmd.runs.append(r)
                log(f"    rep {rep + 1} {cmd.label}: stopped at its timeout, {r.wall_s:.1f} s (a lower bound)")
            elif r.rc not in cmd.ok_rcs:
                cmd.error = f"exit code {r.rc}: {tail(errfile)}"
                log(f"    {cmd.label}: FAILED ({cmd.error})")
            else:
                cmd.runs.append(r)
                log(f"    rep {rep + 1} {cmd.label}: {r.wall_s:.3f} s, peak RSS {r.maxrss_kib / 1024:.0f} MiB")
                if cmd.check:
                    try:
                        cmd.facts.update(cmd.check(r))
                    except Exception as exc:  # a check is evidence, not a reason to stop
                        cmd.facts["check_error"] = f"{type(exc).__name__}: {exc}"
            if cmd.reset:
                cmd.reset()
                if settle_s:
                    cmd.settled_s.append(round(settle(out_dir, settle_s), 1))


# --------------------------------------------------------------------------- helpers on trees

def walk_counts(root: Path, sample: int = 256, seed: int = 0) -> dict:
    """Files, bytes and folders of a tree (one `find -printf` pass), plus a random sample
    of file paths to check page-cache residency with."""
    proc = subprocess.Popen(["find", str(root), "-printf", r"%y %s %p\n"], stdout=subprocess.PIPE)
    files = dirs = other = nbytes = 0
    rng = random.Random(seed)
    picked: list[str] = []
    assert proc.stdout is not None
    for raw in proc.stdout:
        kind, size, path = raw.decode("utf-8", "surrogateescape").rstrip("\n").split(" ", 2)
        if kind == "f":
            files += 1
            nbytes += int(size)
            if len(picked) < sample:
                picked.append(path)
            else:
                j = rng.randrange(files)
                if j < sample:
                    picked[j] = path
        elif kind == "d":
            dirs += 1
        else:
            other += 1
    proc.wait()
    return {"files": files, "bytes": nbytes, "dirs": dirs, "other": other, "inodes": files + dirs + other,
            "sample": picked}


def residency(paths: list[str]) -> float | None:
    """Fraction of the sampled files' pages in the page cache (fincore)."""
    if not paths or not shutil.which("fincore"):
        return None
    p = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES,SIZE", *paths],
                       capture_output=True, text=True)
    res = size = 0
    for line in p.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            res += int(parts[0])
            size += int(parts[1])
    return round(res / size, 4) if size else None


GROUP_TREES = {"meta": "files4k", "hash4k": "files4k", "hash1m": "files1m", "migrate": "files4k", "flat": "flat",
               "cold4k": "files4k", "cold1m": "files1m", "scale": "files4k"}
COLD_GROUPS = ("cold4k", "cold1m")
AFTER_GROUPS = ("baseline", "journal", "prune")  # run after the others (Bench.run_after_groups)


def warm(root: Path) -> float:
    """Read every folder entry, inode and byte of the tree once (untimed)."""
    start = time.perf_counter()
    subprocess.run(sh(f"find {q(root)} -type f -printf '%s %i %T@ %p\\n' > /dev/null"), check=False)
    subprocess.run(sh(f"find {q(root)} -type f -print0 | xargs -0 cat > /dev/null"), check=False)
    return time.perf_counter() - start


def rmtree(path: Path) -> None:
    """Remove a file or a folder tree (`rm -rf` is about twice as fast as shutil.rmtree
    on a million-folder tree)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists() and subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)]).returncode != 0:
        shutil.rmtree(path)


def count_jdupes_groups(path: str) -> int:
    """jdupes prints each set of duplicates as lines separated by one blank line."""
    groups = 0
    in_group = False
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                if not in_group:
                    groups += 1
                in_group = True
            else:
                in_group = False
    return groups


def count_rmlint_groups(path: str) -> int | str:
    """Duplicate sets rmlint reported: its JSON's closing summary, read from the file's end.
    The whole JSON of a 1M-file tree is hundreds of MiB; loading it would raise this process's
    peak RSS, which the kernel hands on to every command started after (see reset_peak_rss)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            tail_text = f.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"not counted ({exc})"
    start, end = tail_text.rfind("{"), tail_text.rfind("}")
    try:
        summary = json.loads(tail_text[start:end + 1]) if 0 <= start < end else {}
    except ValueError as exc:
        return f"not counted ({exc})"
    return summary.get("duplicate_sets", "not counted (no summary)")


def fio_facts(path: str) -> dict:
    """fio's read bandwidth and bytes (its JSON output)."""
    job = json.loads(Path(path).read_text())["jobs"][0]["read"]
    return {"bw_mib_s": round(job["bw_bytes"] / 2**20, 1), "io_bytes": job["io_bytes"],
            "runtime_s": round(job["runtime"] / 1000, 3)}


def can_drop_caches() -> str:
    """'' when this process may drop the page cache, else why not."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return ""
    except OSError as exc:
        return f"cannot write /proc/sys/vm/drop_caches ({exc.strerror}): run as root"


def count_rdfind_groups(path: str) -> int:
    """rdfind's results file has one DUPTYPE_FIRST_OCCURRENCE line per duplicate set."""
    n = 0
    with open(path, "rb") as f:
        for line in f:
            if line.startswith(b"DUPTYPE_FIRST_OCCURRENCE"):
                n += 1
    return n


def tree_summary(info: dict) -> dict:
    """A tree's stamp as the report keeps it: its top-level names only counted. The stamp
    (in the workdir) lists them to find what an earlier run left; a flat directory has a
    million of them, which once made a 100 MB benchmarks.json."""
    out = {k: v for k, v in info.items() if k != "top_level"}
    out["top_level_entries"] = len(info.get("top_level", ()))
    return out


MAX_LIST_ITEMS = 1000  # a longer list in a report is a listing, not a figure


def capped(obj: Any, limit: int = MAX_LIST_ITEMS) -> Any:
    """`obj` with every list longer than `limit` cut to its first `limit` items and a last
    string saying how many were left out: no listing of a tree reaches a report."""
    if isinstance(obj, dict):
        return {k: capped(v, limit) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [capped(v, limit) for v in obj[:limit]]
        if len(obj) > limit:
            items.append(f"... {len(obj) - limit:,} more left out (the bench keeps at most {limit:,} items a list)")
        return items
    return obj


def write_json(path: Path, result: dict) -> None:
    """A report's JSON, capped (`capped`)."""
    path.write_text(json.dumps(capped(result), indent=1, sort_keys=False) + "\n")


# --------------------------------------------------------------------------- the bench

class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.scale = args.scale
        self.reps = args.reps
        self.workdir = Path(args.workdir or DEFAULT_WORKDIR / args.scale).resolve()
        self.out = self.workdir / "out"  # manifests and outputs (one per install in --before runs)
        self.out_dir = Path(args.out_dir).resolve()
        self.kvm = self._find_kvmigrate(args.kvmigrate)
        self.kvm_python = self._interpreter_of(self.kvm)
        self.specs = tree_specs(self.scale, getattr(args, "flat_files", None))
        self.groups_wanted = [g.strip() for g in args.only.split(",")] if args.only else \
            ["meta", "hash4k", "hash1m", "migrate", "startup"]
        self.trees: dict[str, dict] = {}
        self.groups: list[Group] = []
        self.startup: dict = {}
        self.profile: dict = {}
        self.notes: list[str] = []
        self.started = time.time()
        self.log_lines: list[str] = []

    # ---- plumbing

    def log(self, msg: str) -> None:
        line = f"[{time.time() - self.started:7.1f}s] {msg}"
        self.log_lines.append(line)
        print(line, flush=True)

    @staticmethod
    def _find_kvmigrate(given: str | None) -> str:
        if given:
            return str(Path(given).resolve())
        beside = Path(sys.executable).with_name("kvmigrate")
        for cand in (Path("/work/venv/bin/kvmigrate"), beside):
            if cand.exists():
                return str(cand)
        found = shutil.which("kvmigrate")
        if not found:
            sys.exit("bench: no `kvmigrate` executable found; pass --kvmigrate PATH "
                     "(e.g. /work/venv/bin/kvmigrate after `pip install -e .`)")
        return found

    @staticmethod
    def _interpreter_of(script: str) -> str:
        try:
            with open(script, "rb") as f:
                first = f.readline().decode()
        except OSError:
            return sys.executable
        if first.startswith("#!") and "python" in first:
            return first[2:].strip().split()[0]
        return sys.executable

    def kvm_has(self, command: str) -> tuple[bool, str]:
        p = subprocess.run([self.kvm, command, "--help"], capture_output=True, text=True)
        if p.returncode == 0:
            return True, ""
        msg = (p.stderr or p.stdout).strip().splitlines()
        return False, f"`kvmigrate {command}` is not available ({msg[-1] if msg else 'exit ' + str(p.returncode)})"

    def check_tools(self) -> None:
        """Exit naming the Debian packages to install when a wanted group's tool is missing."""
        needed = dict.fromkeys(BASE_TOOLS)
        for g in self.groups_wanted:
            needed.update(dict.fromkeys(GROUP_TOOLS.get(g, ())))
        missing = [t for t in needed if not shutil.which(t)]
        if not Path("/usr/bin/time").exists():
            self.notes.append("/usr/bin/time is not installed (not needed: RSS comes from os.wait4).")
        if missing:
            pkgs = sorted({TOOLS[t] for t in missing})
            sys.exit(f"bench: missing tools: {', '.join(missing)} (Debian packages {', '.join(pkgs)}).\n"
                     f"Install them with: apt-get update && apt-get install -y {' '.join(pkgs)}")

    # ---- space and trees

    def check_space(self) -> dict:
        self.workdir.mkdir(parents=True, exist_ok=True)
        need = space_needed(self.specs, self.groups_wanted)
        free = fs_free(self.workdir)
        reuse = {name: self._stamp_ok(spec) for name, spec in self.specs.items()}
        info = {"workdir": str(self.workdir), "needed_bytes_estimate": need["bytes"],
                "needed_inodes_estimate": need["inodes"], "free_bytes_before": free["bytes"],
                "free_inodes_before": free["inodes"], "fs_total_bytes": free["total_bytes"],
                "fs_total_inodes": free["total_inodes"], "trees_reused": reuse}
        self.log(f"workdir {self.workdir}: needs about {need['bytes'] / 2**30:.1f} GiB and "
                 f"{need['inodes']:,} inodes; free {free['bytes'] / 2**30:.1f} GiB and {free['inodes']:,} inodes")
        rebuilt = [name for name in trees_of(self.groups_wanted) if not reuse.get(name)]
        if rebuilt and (need["bytes"] > free["bytes"] or need["inodes"] > free["inodes"]):
            msg = (f"bench: not enough room in {self.workdir}: need ~{need['bytes'] / 2**30:.1f} GiB and "
                   f"{need['inodes']:,} inodes, have {free['bytes'] / 2**30:.1f} GiB and {free['inodes']:,}. "
                   "Use --workdir on a bigger filesystem or --scale small.")
            if not self.args.force:
                sys.exit(msg + " (--force to try anyway)")
            self.notes.append(msg + " Ran anyway (--force).")
        return info

    def tree_root(self, name: str) -> Path:
        return self.workdir / "trees" / name

    def _stamp_path(self, name: str) -> Path:
        return self.workdir / "trees" / f"{name}.stamp.json"

    def _stamp_ok(self, spec: TreeSpec) -> bool:
        try:
            stamp = json.loads(self._stamp_path(spec.name).read_text())
        except (OSError, ValueError):
            return False
        return stamp.get("spec") == spec.__dict__ and self.tree_root(spec.name).is_dir()

    def build_tree(self, spec: TreeSpec) -> dict:
        """Build with `kvmigrate synth` in --jobs processes, one seed each, into one root:
        the same namespace (same config.json), disjoint block keys."""
        root = self.tree_root(spec.name)
        stamp = self._stamp_path(spec.name)
        if self._stamp_ok(spec):
            info = json.loads(stamp.read_text())
            info["reused"] = True
            for name in sorted(set(os.listdir(root)) - set(info["top_level"])):
                self.log(f"tree {spec.name}: removing {name} left by an earlier run")
                rmtree(root / name)
            self.log(f"tree {spec.name}: reusing {root} ({info['counts']['files']:,} files)")
            return tree_summary(info)
        rmtree(root)
        stamp.unlink(missing_ok=True)
        root.mkdir(parents=True)
        jobs = max(1, min(self.args.jobs, spec.blocks))
        shares = [spec.blocks // jobs + (1 if i < spec.blocks % jobs else 0) for i in range(jobs)]
        self.log(f"tree {spec.name}: building {spec.files:,} files of {spec.file_bytes:,} B with "
                 f"{jobs} synth processes")
        start = time.perf_counter()
        procs = []
        logs = []
        for i, n in enumerate(shares):
            argv = [self.kvm, "synth", str(root), *spec.synth_args(n, seed=1 + i)]
            logf = self.workdir / f"synth-{spec.name}-{i}.log"
            logs.append(logf)
            with open(logf, "wb") as f:
                procs.append((argv, subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)))
        for argv, p in procs:
            if p.wait() != 0:
                sys.exit(f"bench: `{' '.join(argv)}` failed (exit {p.returncode}); see {logs[procs.index((argv, p))]}")
        seconds = time.perf_counter() - start
        counts = walk_counts(root)
        if counts["files"] != spec.files + spec.other_files:
            sys.exit(f"bench: {root} has {counts['files']} files, expected {spec.files + spec.other_files} "
                     "(block files + config.json, none in a flat directory)")
        info = {
            "spec": spec.__dict__, "root": str(root), "build_s": round(seconds, 2),
            "build_files_per_s": round(spec.files / seconds), "build_method": f"kvmigrate synth x{jobs} processes",
            "synth_commands": [" ".join(q(a) for a in argv) for argv, _ in procs],
            "counts": {k: v for k, v in counts.items() if k != "sample"}, "reused": False,
            "top_level": sorted(os.listdir(root)),
        }
        stamp.write_text(json.dumps(info, indent=1))
        self.log(f"tree {spec.name}: {counts['files']:,} files, {counts['dirs']:,} folders, "
                 f"{counts['bytes'] / 2**20:,.0f} MiB in {seconds:.1f} s")
        return tree_summary(info)

    # ---- groups

    def _scan_cmd(self, key: str, label: str, tree: str, verify: str, facts: tuple[str, ...] = ()) -> Command:
        root = self.tree_root(tree)
        out = self.out / f"{key}.parquet"
        stdout = str(self.out / f"{key}.json")
        argv = [self.kvm, "scan", str(root), "--verify", verify, "-q", "--json", "-o", str(out), *FACTS, *facts]
        if self.args.threads:
            argv += ["--threads", str(self.args.threads)]
        ok, why = self.kvm_has("scan")

        def check(_run: Run) -> dict:
            summary = json.loads(Path(stdout).read_text())
            facts = {"files": summary["totals"]["files"], "bytes": summary["totals"]["bytes"],
                     "by_status": {s: v["files"] for s, v in summary["totals"]["by_status"].items()},
                     "by_action": {a: v["blocks"] for a, v in summary["totals"]["by_action"].items()},
                     "exit_code": summary.get("exit_code")}
            if verify == "hash":
                facts["replica_groups"] = self.manifest_replica_groups(out)
            return facts

        return Command(key, label, argv, "kvmigrate", ok_rcs=(0, 1), stdout=stdout, check=check, available=ok,
                       why_unavailable=why)

    def manifest_replica_groups(self, manifest: Path) -> int | str:
        """Sets of >= 2 files with equal whole-file XXH3-128 in the manifest (what jdupes
        and rdfind report as duplicate sets), counted with kvmigrate's own interpreter."""
        code = ("import sys, pyarrow.compute as pc; from kvmigrate.manifest import read_table\n"
                "t = read_table(sys.argv[1], columns=['content_xxh3_128'])\n"
                "c = t.column('content_xxh3_128')\n"
                "nulls = c.null_count\n"
                "t = t.filter(pc.is_valid(c)).group_by('content_xxh3_128').aggregate([([], 'count_all')])\n"
                "print(pc.sum(pc.greater_equal(t.column('count_all'), 2)).as_py() or 0, nulls)\n")
        p = subprocess.run([self.kvm_python, "-c", code, str(manifest)], capture_output=True, text=True, cwd="/")
        if p.returncode != 0:
            return f"not counted ({(p.stderr.strip().splitlines() or ['?'])[-1]})"
        groups, nulls = p.stdout.split()
        if int(nulls):
            return f"{groups} ({nulls} rows without a content hash)"
        return int(groups)

    def group_meta(self) -> Group:
        root = self.tree_root("files4k")
        cmds = [
            self._scan_cmd("meta_kvm", "kvmigrate scan --verify size", "files4k", "size"),
            Command("meta_find", "find -printf", sh(f"find {q(root)} -type f -printf '%s %i %T@ %p\\n' > /dev/null"),
                    "baseline"),
            Command("meta_fd", "fdfind --type f", sh(f"fdfind -uu --type f . {q(root)} > /dev/null"), "baseline"),
            Command("meta_fd_l", "fdfind --type f -l", sh(f"fdfind -uu --type f -l . {q(root)} > /dev/null"),
                    "baseline"),
            self._floor_cmd("meta_floor", root, hashed=False),
        ]
        return Group("meta", "Metadata scan (4 KiB-file tree)", "files4k", cmds,
                     [("meta_kvm", "meta_find"), ("meta_kvm", "meta_fd"), ("meta_kvm", "meta_fd_l"),
                      ("meta_kvm", "meta_floor")],
                     note="find and fdfind only list (find also stats); kvmigrate also identifies namespaces, "
                          "classifies every block and writes the Parquet manifest. `fdfind` does not stat; "
                          "`fdfind -l` runs `ls -l` on batches of files. " + FLOOR_NOTE)

    def _floor_cmd(self, key: str, root: Path, hashed: bool) -> Command:
        """The Python floor (scripts/floor_walk.py): the same walk and reads in as many
        processes as kvmigrate uses, with nothing else (a reference, not a target)."""
        script = str(Path(__file__).resolve().parent / "floor_walk.py")
        return Command(key, f"Python floor ({'scandir + read + XXH3' if hashed else 'scandir + lstat'}, "
                            f"{len(os.sched_getaffinity(0))} processes, no manifest)",
                       [self.kvm_python, script, str(root), *(["--hash"] if hashed else [])], "baseline")

    def group_hash(self, key: str, tree: str) -> Group:
        root = self.tree_root(tree)
        out = self.out
        jd_out = str(out / f"{key}_jdupes.txt")
        rd_out = str(out / f"{key}_rdfind.txt")
        xx_out = str(out / f"{key}_xxhsum.count")
        cmds = [
            self._scan_cmd(f"{key}_kvm", "kvmigrate scan --verify hash", tree, "hash"),
            Command(f"{key}_xxhsum", "find | xargs xxhsum -H2",
                    sh(f"find {q(root)} -type f -print0 | xargs -0 xxhsum -H2 > /dev/null"), "baseline",
                    stdout=xx_out),
            Command(f"{key}_jdupes", "jdupes -r", ["jdupes", "-r", "-q", str(root)], "baseline", stdout=jd_out,
                    check=lambda _r: {"replica_groups": count_jdupes_groups(jd_out)}),
            Command(f"{key}_rdfind", "rdfind -dryrun true",
                    ["rdfind", "-dryrun", "true", "-outputname", rd_out, str(root)], "baseline",
                    stdout=str(out / f"{key}_rdfind.log"),
                    check=lambda _r: {"replica_groups": count_rdfind_groups(rd_out)}),
            self._floor_cmd(f"{key}_floor", root, hashed=True),
        ]
        spec = self.specs[tree]
        return Group(key, f"Content verification: {spec.title}", tree, cmds,
                     [(f"{key}_kvm", f"{key}_xxhsum"), (f"{key}_kvm", f"{key}_jdupes"),
                      (f"{key}_kvm", f"{key}_rdfind"), (f"{key}_kvm", f"{key}_floor"),
                      (f"{key}_floor", f"{key}_jdupes")],
                     note="Same files, same bytes: every file of the tree is read whole and hashed. "
                          "kvmigrate compares each block's rank replicas and writes the manifest; jdupes and "
                          "rdfind group equal files (their group counts are checked against the manifest's). "
                          + FLOOR_NOTE)

    def group_flat(self) -> Group:
        """A flat HiCache directory: the scan's flat path (scan/flat.py) against listing
        and hashing the same folder (xxhsum serial, and 8 processes of 512 files as a
        parallel hasher would)."""
        root = self.tree_root("flat")
        facts = ("--writer-layout", "page_first")  # the pages are then already_present for sglang-0.5.23
        cmds = [
            self._scan_cmd("flat_kvm_size", "kvmigrate scan --verify size", "flat", "size", facts),
            Command("flat_find", "find -printf",
                    sh(f"find {q(root)} -maxdepth 1 -type f -printf '%s %i %T@ %p\\n' > /dev/null"), "baseline"),
            self._scan_cmd("flat_kvm_hash", "kvmigrate scan --verify hash", "flat", "hash", facts),
            Command("flat_xxhsum", "find | xargs xxhsum -H2",
                    sh(f"find {q(root)} -maxdepth 1 -type f -print0 | xargs -0 xxhsum -H2 > /dev/null"), "baseline"),
            Command("flat_xxhsum_p8", "find | xargs -P8 -n512 xxhsum -H2",
                    sh(f"find {q(root)} -maxdepth 1 -type f -print0 | xargs -0 -P8 -n512 xxhsum -H2 > /dev/null"),
                    "baseline"),
        ]
        return Group("flat", f"Flat directory: {self.specs['flat'].title}", "flat", cmds,
                     [("flat_kvm_size", "flat_find"), ("flat_kvm_hash", "flat_xxhsum"),
                      ("flat_kvm_hash", "flat_xxhsum_p8")],
                     note="One folder, no rank or bucket folders: kvmigrate parses every name, groups the files "
                          "into deployments and writes the manifest (in one process, part 0: the C extension "
                          "stats or reads and hashes the pages by file descriptor in a few threads, the family's "
                          "Python code holds one record a file for its verdicts); find and xxhsum only list or "
                          "hash (xargs -P8 -n512: eight xxhsum processes at a time, 512 files each).")

    def hash_io_depth(self) -> int:
        """Reads in flight of the measured kvmigrate's default `scan --verify hash`
        (processes x threads a process), asked from its own parallelism()."""
        code = ("from kvmigrate.scan.parallel import parallelism, PARALLEL_MIN_BUCKETS as B\n"
                "w, t = parallelism(None, None, 'hash', B); print(w * t)")
        p = subprocess.run([self.kvm_python, "-c", code], capture_output=True, text=True, cwd="/")
        return int(p.stdout.strip()) if p.returncode == 0 and p.stdout.strip().isdigit() else 8

    def group_cold(self, key: str, tree: str) -> Group:
        """Cold reads (issue 22): the page cache, dentries and inodes dropped before every
        timed command (run_group(cold=True)). The peers: find -printf, xxhsum in 4 x cores
        processes of 512 files (the fastest way a user gets the same hashes), rmlint (a C
        duplicate finder; capped, the cap is a lower bound) and, on the 1 MiB tree, fio's
        sequential read of the same files with kvmigrate's reads in flight (the device's
        limit: O_DIRECT, so no page cache either way)."""
        root = self.tree_root(tree)
        out = self.out
        hashers = 4 * len(os.sched_getaffinity(0))
        depth = self.hash_io_depth()
        rm_json = str(out / f"{key}_rmlint.json")
        fio_json = str(out / f"{key}_fio.json")
        cmds = [
            self._scan_cmd(f"{key}_kvm_size", "kvmigrate scan --verify size", tree, "size"),
            Command(f"{key}_find", "find -printf", sh(f"find {q(root)} -type f -printf '%s %i %T@ %p\\n' > /dev/null"),
                    "baseline"),
            self._scan_cmd(f"{key}_kvm", "kvmigrate scan --verify hash", tree, "hash"),
            Command(f"{key}_xxhsum", f"find | xargs -P{hashers} -n512 xxhsum -H2",
                    sh(f"find {q(root)} -type f -print0 | xargs -0 -P{hashers} -n 512 xxhsum -H2 > /dev/null"),
                    "baseline"),
            Command(f"{key}_rmlint", "rmlint -T df (duplicate files)",
                    ["rmlint", "-T", "df", "-o", f"json:{rm_json}", str(root)], "baseline",
                    ok_rcs=(0, 1), max_runs=1, timeout_s=self.args.rmlint_timeout,
                    check=lambda _r: {"replica_groups": count_rmlint_groups(rm_json)}),
        ]
        pairs = [(f"{key}_kvm_size", f"{key}_find"), (f"{key}_kvm", f"{key}_xxhsum"), (f"{key}_kvm", f"{key}_rmlint")]
        if tree == "files1m":
            cmds.append(Command(f"{key}_fio", f"fio sequential read, O_DIRECT, iodepth {depth}",
                                ["fio", "--name=seqread", f"--opendir={root}", "--rw=read", "--bs=1M", "--direct=1",
                                 "--ioengine=libaio", f"--iodepth={depth}", "--group_reporting",
                                 "--output-format=json", f"--output={fio_json}"], "baseline",
                                check=lambda _r: fio_facts(fio_json)))
            pairs.append((f"{key}_kvm", f"{key}_fio"))
        spec = self.specs[tree]
        return Group(key, f"Cold: {spec.title} (page cache dropped before every command)", tree, cmds, pairs,
                     note="`sync; echo 3 > /proc/sys/vm/drop_caches` before every timed command: what a nightly "
                          "job meets on a cache larger than RAM. rmlint runs once (at most "
                          f"{self.args.rmlint_timeout:.0f} s: a longer run is stopped and its time is a lower "
                          "bound). fio reads the same files whole (O_DIRECT, 1 MiB requests, as many in flight "
                          f"as kvmigrate's hash scan has reads: {depth}); its bandwidth is its own (the time it "
                          "spends opening the files is not in it).")

    def group_scale(self) -> Group:
        """Scale with size (issue 22 item 4): scan --verify size, migrate --apply and
        report at 100k, 300k and 1M files (warm), time per file and peak RSS."""
        cmds = []
        for name in SCALE_TREES:
            root = self.tree_root(name)
            before = set(os.listdir(root))
            manifest = self.out / f"scale_{name}.parquet"

            def reset(root: Path = root, before: set = before) -> None:
                for extra in sorted(set(os.listdir(root)) - before):
                    rmtree(root / extra)

            rank0 = next((root / n for n in sorted(before) if n.endswith("_r0")), root)
            cp_dest = self.workdir / f"scale-cpal-{name}"

            def reset_cp(dest: Path = cp_dest) -> None:
                rmtree(dest)

            cmds += [
                Command(f"scale_{name}_scan", f"scan --verify size ({name})",
                        [self.kvm, "scan", str(root), "--verify", "size", "-q", "-o", str(manifest), *FACTS],
                        "kvmigrate", ok_rcs=(0, 1)),
                Command(f"scale_{name}_report", f"report M ({name})",
                        [self.kvm, "report", str(manifest), "-q", "--format", "json"], "kvmigrate", ok_rcs=(0, 1)),
                Command(f"scale_{name}_migrate", f"migrate --manifest M --apply ({name})",
                        [self.kvm, "migrate", "--manifest", str(manifest), "--apply", "-q"], "kvmigrate",
                        reset=reset),
                # the filesystem's own growth: as many hard links into a fresh tree of the same shape
                Command(f"scale_{name}_cpal", f"cp -al of the rank-0 folder ({name})",
                        ["cp", "-al", str(rank0), str(cp_dest)], "baseline", reset=reset_cp),
            ]
        sizes = ", ".join(f"{self.specs[n].files:,}" for n in SCALE_TREES)
        pairs = [(f"scale_{n}_migrate", f"scale_{n}_cpal") for n in SCALE_TREES]
        return Group("scale", f"Scale with size: {sizes} files of 4 KiB (warm)", SCALE_TREES[-1], cmds, pairs,
                     note="Each size is its own tree (llm-d TP=2 MLA, the same shape). `M` is the size scan's "
                          "manifest; migrate reads and checks both replicas of every block it links (what a "
                          "size manifest asks), and each run's links are removed after it (untimed). The "
                          "commands run in order (scan, report, migrate) the first time, so each has its manifest. `cp -al` "
                          "of the rank-0 folder makes as many hard links (one per block) into a fresh tree of the "
                          "same folder shape: the filesystem's own cost of linking at each size, for the migrate "
                          "row to be read against.")

    def group_migrate(self) -> Group:
        tree = "files4k"
        root = self.tree_root(tree)
        out = self.out
        manifest = out / "migrate_source.parquet"  # scan --verify hash: replicas proven equal by the scan
        manifest_size = out / "migrate_source_size.parquet"  # scan --verify size: apply reads the replicas
        rank0 = [p for p in sorted(root.iterdir()) if p.name.endswith("_r0")]
        cp_dest = self.workdir / "cpal"
        byhand_dest = self.workdir / "byhand"
        before = set(os.listdir(root))
        legacy = sorted(name for name in before if not name.startswith("."))  # base folder + rank folders

        def reset_root() -> None:
            """Delete what migrate created under ROOT: the new top-level target folders and
            kvmigrate's own .kvmigrate/ (journal, lock) — never a source folder."""
            for name in sorted(set(os.listdir(root)) - before):
                rmtree(root / name)

        def reset_cp() -> None:
            rmtree(cp_dest)

        def reset_byhand() -> None:
            rmtree(byhand_dest)

        ok_m, why_m = self.kvm_has("migrate")
        migrate_json = str(out / "migrate_manifest.json")
        migrate_size_json = str(out / "migrate_manifest_size.json")
        migrate_root_json = str(out / "migrate_root.json")

        def migrate_check(path: str) -> Any:
            def check(_run: Run) -> dict:
                summary = json.loads(Path(path).read_text())
                outcomes = summary.get("outcomes") or summary.get("apply", {}).get("outcomes") or {}
                return {"outcomes": outcomes, "expected_links": self.specs[tree].blocks,
                        "created_top_level": sorted(set(os.listdir(root)) - before),
                        "exit_code": summary.get("exit_code"), "verify": summary.get("verify")}
            return check

        def cp_check(dest: Path) -> Any:
            def check(_run: Run) -> dict:
                n = sum(len(files) for _d, _s, files in os.walk(dest))
                return {"files_linked": n, "expected_links": self.specs[tree].blocks}
            return check

        if ok_m:
            for verify, path in (("hash", manifest), ("size", manifest_size)):
                self.log(f"migrate: writing the source manifest (untimed scan --verify {verify})")
                err = out / f"migrate_source_{verify}.stderr"
                r = run_measured([self.kvm, "scan", str(root), "--verify", verify, "-q", "-o", str(path), *FACTS],
                                 stderr=str(err))
                if r.rc not in (0, 1):
                    ok_m, why_m = False, f"the scan that makes its manifest failed: {tail(err)}"
        src = rank0[0] if rank0 else root / "missing_r0"
        # the by-hand equivalent of a migration that proves the bytes it places: hash every
        # legacy file (both replicas of each block, as kvmigrate reads them) on every core,
        # then link the rank-0 files (the links kvmigrate makes) under a new name
        hashers = 4 * len(os.sched_getaffinity(0))
        byhand = (f"find {' '.join(q(root / n) for n in legacy)} -type f -print0 | "
                  f"xargs -0 -P{hashers} -n 512 xxhsum -H2 > /dev/null && "
                  f"mkdir -p {q(byhand_dest)} && cp -al {q(src)} {q(byhand_dest / 'target_r0')}")
        cmds = [
            Command("mig_kvm_root", "kvmigrate migrate ROOT --apply (scan + apply)",
                    [self.kvm, "migrate", str(root), "--apply", "-q", "--json", *FACTS], "kvmigrate",
                    stdout=migrate_root_json, reset=reset_root, check=migrate_check(migrate_root_json),
                    available=ok_m, why_unavailable=why_m),
            Command("mig_kvm_size", "kvmigrate migrate --manifest M(size) --apply",
                    [self.kvm, "migrate", "--manifest", str(manifest_size), "--apply", "-q", "--json"], "kvmigrate",
                    stdout=migrate_size_json, reset=reset_root, check=migrate_check(migrate_size_json),
                    available=ok_m, why_unavailable=why_m),
            Command("mig_byhand", "by hand: xxhsum -H2 of the legacy folders, then cp -al", sh(byhand), "baseline",
                    reset=reset_byhand, check=cp_check(byhand_dest)),
            Command("mig_cpal", "cp -al (rank 0 folder)", sh(f"mkdir -p {q(cp_dest)} && cp -al {q(src)} {q(cp_dest)}/"),
                    "baseline", reset=reset_cp, check=cp_check(cp_dest)),
            Command("mig_kvm", "kvmigrate migrate --manifest M --apply",
                    [self.kvm, "migrate", "--manifest", str(manifest), "--apply", "-q", "--json"], "kvmigrate",
                    stdout=migrate_json, reset=reset_root, check=migrate_check(migrate_json), available=ok_m,
                    why_unavailable=why_m),
        ]
        return Group("migrate", "Materialization: hard links (4 KiB-file tree)", tree, cmds,
                     [("mig_kvm_root", "mig_byhand"), ("mig_kvm_size", "mig_byhand"),
                      ("mig_kvm_root", "mig_cpal"), ("mig_kvm_size", "mig_cpal"), ("mig_kvm", "mig_cpal"),
                      ("mig_byhand", "mig_cpal")],
                     note="Every block's action is `link` (llm-d TP=2 MLA -> the vllm-0.28 replicated namespace): "
                          "kvmigrate links one replica per block (rank 0) into the target namespace. Every "
                          "repetition starts from the legacy tree alone: the created target folders (and "
                          ".kvmigrate/) or the cp destination are deleted after each command (untimed). "
                          "`ROOT` runs `migrate ROOT --apply` with its default flags, its own scan included "
                          "(the scan level it used is its `verify` below). `M(size)` is the manifest of "
                          "`scan --verify size`: before linking, apply reads and hashes both replicas of every "
                          "block. *By hand* is what an operator would type for the same safety: `xxhsum -H2` "
                          f"of every file of the legacy folders ({hashers} parallel xxhsum processes of 512 "
                          "files, 4 per core), which proves the bytes, then `cp -al` of the rank-0 folder (the "
                          "same links) to a new name; the ROOT and M(size) runs are judged against it (goal "
                          "<= 1.0x). Plain `cp -al` of the same rank-0 files, which checks nothing, stays as the "
                          "reference. `M` is the manifest of `scan --verify hash`: the scan proved every "
                          "block's two replicas equal, so apply only checks each source is unchanged (lstat) "
                          "and links: the materialization proper, against plain `cp -al`.",
                     items=self.specs[tree].blocks, item_name="links")

    def run_startup(self) -> dict:
        n = self.args.startup_runs
        res: dict[str, Any] = {"runs": n}
        for key, argv in (("kvmigrate_help", [self.kvm, "--help"]),
                          ("python_floor", [self.kvm_python, "-c", "pass"]),
                          ("python_import_kvmigrate_cli", [self.kvm_python, "-c", "import kvmigrate.cli"]),
                          ("python_import_kvmigrate_scan", [self.kvm_python, "-c", "import kvmigrate.scan"])):
            walls = []
            rss = 0
            for _ in range(n):
                r = run_measured(argv)
                walls.append(r.wall_s)
                rss = max(rss, r.maxrss_kib)
            res[key] = {"command": " ".join(q(a) for a in argv), "median_s": round(statistics.median(walls), 4),
                        "min_s": round(min(walls), 4), "max_s": round(max(walls), 4),
                        "peak_rss_mib": round(rss / 1024, 1)}
        p = subprocess.run([self.kvm_python, "-X", "importtime", "-c", "import kvmigrate.cli"],
                           capture_output=True, text=True)
        rows = []
        for ln in p.stderr.splitlines():
            parts = ln.replace("import time:", "").split("|")
            if len(parts) == 3 and parts[1].strip().isdigit():
                rows.append((int(parts[1]), parts[2].rstrip()))
        res["importtime_top_cumulative_us"] = [f"{us} {name}" for us, name in sorted(rows, reverse=True)[:8]]
        loaded = subprocess.run([self.kvm_python, "-c", "import sys, kvmigrate.cli; "
                                 "print(' '.join(m for m in ('pyarrow','tqdm','xxhash') if m in sys.modules))"],
                                capture_output=True, text=True)
        res["heavy_modules_loaded_by_cli"] = loaded.stdout.split()
        self.log(f"startup: kvmigrate --help median {res['kvmigrate_help']['median_s'] * 1000:.0f} ms "
                 f"(python floor {res['python_floor']['median_s'] * 1000:.0f} ms)")
        return res

    def run_profile(self) -> dict:
        """Where `kvmigrate scan` spends its time on the 4 KiB tree: py-spy sampling the
        real run (parent and worker processes, scripts/profile_spy.py) when py-spy is
        installed, else cProfile of every thread of one process (scripts/profile_scan.py)."""
        root = self.tree_root("files4k")
        out = self.out
        top = ["--top", str(self.args.profile_top)]
        if profile_spy.find_py_spy(self.kvm_python):
            res: dict[str, Any] = {"tool": "py-spy (sampling, parent and worker processes; scripts/profile_spy.py)",
                                   "kind": "py-spy"}
            name = "py-spy"

            def profiler(verify: str, js: Path) -> list[str]:
                return [str(REPO / "scripts" / "profile_spy.py"), "--json", str(js), *top, "--kvmigrate", self.kvm]
        else:
            res = {"tool": "cProfile, all threads merged (scripts/profile_scan.py)"}
            name = "cProfile"

            def profiler(verify: str, js: Path) -> list[str]:
                return [str(REPO / "scripts" / "profile_scan.py"), "--out", str(out / f"profile_{verify}.pstats"),
                        "--json", str(js), *top]
        for verify in ("size", "hash"):
            js = out / f"profile_{'spy_' if name == 'py-spy' else ''}{verify}.json"
            argv = [self.kvm_python, *profiler(verify, js), "--", "scan", str(root), "--verify", verify, "-q",
                    "-o", str(out / f"profile_{verify}.parquet"), *FACTS]
            self.log(f"profile ({name}): scan --verify {verify}")
            p = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if p.returncode != 0 or not js.exists():
                res[verify] = {"error": (p.stderr.strip().splitlines() or ["?"])[-1]}
                continue
            res[verify] = json.loads(js.read_text())
        return res

    # ---- main

    def machine(self) -> dict:
        cpu = "unknown"
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        mem = {}
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                k, v = line.split(":", 1)
                if k in ("MemTotal", "MemAvailable"):
                    mem[k] = int(v.split()[0]) * 1024
        except OSError:
            pass
        fstype, mnt, dev, opts = "unknown", "", "", ""
        real = str(self.workdir)
        try:
            for line in Path("/proc/mounts").read_text().splitlines():
                d, m, t, o = line.split()[:4]
                if (real == m or real.startswith(m.rstrip("/") + "/")) and len(m) >= len(mnt):
                    fstype, mnt, dev, opts = t, m, d, o
        except OSError:
            pass
        pyver = capture([self.kvm_python, "-c", "import sys; print(sys.version.split()[0])"])
        libs = capture([self.kvm_python, "-c",
                        "import importlib.metadata as m\n"
                        "for p in ('kvmigrate','pyarrow','xxhash','click','tqdm'):\n"
                        "    print(p, m.version(p))"])
        debs = capture(["dpkg-query", "-W", "-f", "${Package} ${Version}\\n", *sorted(set(TOOLS.values()))])
        git_head = capture(["git", "-C", str(REPO), "log", "-1", "--format=%h %s"])
        dirty = capture(["git", "-C", str(REPO), "status", "--porcelain", "--", "kvmigrate"])
        return {
            "cpu_model": cpu, "cores": os.cpu_count(), "mem_total_bytes": mem.get("MemTotal"),
            "page_reclaim": damon_pageout(),
            "mem_available_bytes_at_start": mem.get("MemAvailable"), "kernel": platform.release(),
            "os": capture(["sh", "-c", ". /etc/os-release && echo $PRETTY_NAME"]),
            "workdir_fs": fstype, "workdir_mount": mnt, "workdir_device": dev, "workdir_mount_options": opts,
            "python": pyver, "python_executable": self.kvm_python, "kvmigrate": self.kvm,
            "python_packages": dict(line.split(" ", 1) for line in libs.splitlines() if " " in line),
            "debian_packages": dict(line.split(" ", 1) for line in debs.splitlines() if " " in line),
            "git_head": git_head,
            "git_uncommitted_under_kvmigrate": [ln for ln in dirty.splitlines() if ln.strip()],
        }

    def run(self) -> dict:
        self.check_tools()
        argv_line = "python3 scripts/bench.py " + " ".join(q(a) for a in sys.argv[1:])
        machine = self.machine()
        space = self.check_space()
        self.out.mkdir(parents=True, exist_ok=True)
        cold_why = can_drop_caches() if set(COLD_GROUPS) & set(self.groups_wanted) else ""
        if cold_why:  # never warm figures reported as cold
            skipped = [g for g in self.groups_wanted if g in COLD_GROUPS]
            self.notes.append(f"The cold groups ({', '.join(skipped)}) were skipped: {cold_why}.")
            self.groups_wanted = [g for g in self.groups_wanted if g not in COLD_GROUPS]
        need_trees = {GROUP_TREES[g] for g in self.groups_wanted if g in GROUP_TREES}
        if "scale" in self.groups_wanted:
            need_trees.update(SCALE_TREES)
        if self.args.profile:
            need_trees.add("files4k")
        for name in sorted(need_trees):
            self.trees[name] = self.build_tree(self.specs[name])
        space["free_bytes_after_build"] = fs_free(self.workdir)["bytes"]
        space["free_inodes_after_build"] = fs_free(self.workdir)["inodes"]
        warmth: dict[str, Any] = {}
        for name in sorted(need_trees):
            root = self.tree_root(name)
            sample = walk_counts(root, seed=7)["sample"]
            before = residency(sample)
            secs = warm(root)
            after = residency(sample)
            warmth[name] = {"resident_fraction_before_warmup": before, "warmup_s": round(secs, 2),
                            "resident_fraction_after_warmup": after, "sample_files": len(sample), "_sample": sample}
            self.log(f"tree {name}: warm-up pass {secs:.1f} s; sampled pages resident before {before}, after {after}")

        builders = {"meta": self.group_meta, "hash4k": lambda: self.group_hash("hash4k", "files4k"),
                    "hash1m": lambda: self.group_hash("hash1m", "files1m"), "migrate": self.group_migrate,
                    "flat": self.group_flat, "cold4k": lambda: self.group_cold("cold4k", "files4k"),
                    "cold1m": lambda: self.group_cold("cold1m", "files1m"), "scale": self.group_scale}
        after_groups = [g for g in self.groups_wanted if g in AFTER_GROUPS]
        for key in self.groups_wanted:
            if key == "startup":
                self.startup = self.run_startup()
                continue
            if key in AFTER_GROUPS:
                continue
            if key not in builders:
                sys.exit(f"bench: unknown group {key!r}; known: {', '.join([*builders, 'startup', *AFTER_GROUPS])}")
            group = builders[key]()
            self.log(f"group {key}: {group.title}")
            tree = GROUP_TREES.get(key)
            if key in COLD_GROUPS:
                pass  # run_group drops the page cache before every command
            elif key == "scale":
                for name in SCALE_TREES:
                    self.log(f"tree {name}: warmed before group scale ({warm(self.tree_root(name)):.1f} s)")
            elif tree in warmth:  # again, untimed: the VM reclaims idle page cache while other groups run
                root = self.tree_root(tree)
                secs = warm(root)
                warmth[tree].setdefault("rewarm_before_group", {})[key] = {
                    "warmup_s": round(secs, 2), "resident_fraction_after": residency(warmth[tree]["_sample"])}
                self.log(f"tree {tree}: warmed again before group {key} ({secs:.1f} s)")
            group.loadavg["before"] = [round(x, 2) for x in os.getloadavg()]
            for c in group.commands:
                if not c.available:
                    self.log(f"    {c.label}: not available: {c.why_unavailable}")
            reps = self.args.migrate_reps if key == "migrate" and self.args.migrate_reps else self.reps
            group.reps = reps
            if key == "scale":
                reps = min(reps, 2)
                group.reps = reps
            run_group(group, reps, self.log, self.out, self.args.settle, cold=key in COLD_GROUPS)
            group.loadavg["after"] = [round(x, 2) for x in os.getloadavg()]
            self.groups.append(group)
            free_now = fs_free(self.workdir)["bytes"]
            space["free_bytes_min_after_a_group"] = min(space.get("free_bytes_min_after_a_group", free_now), free_now)
        if self.args.profile:
            self.profile = self.run_profile()
        for name, w in warmth.items():
            w["resident_fraction_at_end"] = residency(w.pop("_sample"))
        after = self.run_after_groups(after_groups)
        space["free_bytes_at_end"] = fs_free(self.workdir)["bytes"]
        space["free_inodes_at_end"] = fs_free(self.workdir)["inodes"]

        result = {
            "schema": 1,
            "generated_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "scale": self.scale, "reps": self.reps, "command": argv_line,
            "duration_s": round(time.time() - self.started, 1),
            "machine": machine, "space": space, "trees": self.trees, "warm": warmth,
            "kvmigrate_threads": self.args.threads or "default (kvmigrate.scan.parallel.parallelism)",
            "kvmigrate_leaf_walk": self.leaf_walk(),
            "groups": [self.group_dict(g) for g in self.groups],
            "startup": self.startup,
            "replica_groups": self.replica_check(),
            "targets": self.targets(),
            "scale_figures": self.scale_figures(),
            "profile": self.profile,
            "notes": self.notes,
        }
        result.update(after)
        for key in ("baseline",):
            for t in after.get(key, {}).get("targets", []):
                result["targets"].append({**t, "target": f"nightly re-audit: {t['target']}"})
        return result

    def run_after_groups(self, keys: list[str]) -> dict:
        """baseline, journal and prune in the same run as the other groups (issue 22: one
        run), each as it runs alone; baseline on this run's files4k tree, journal and prune
        on trees of their own in sub-folders of the workdir."""
        import copy

        out: dict[str, Any] = {}
        workdir, results_out = self.workdir, self.out
        for key in keys:
            args = copy.copy(self.args)
            self.log(f"group {key}")
            if key == "baseline":
                spec = self.specs["files4k"]
                args.baseline_files = spec.files
                out["baseline"] = run_baseline_group(args, self, spec=spec)
                out["baseline"].pop("machine", None)
            elif key == "journal":
                args.workdir = str(workdir / "journal")
                out["journal"] = run_journal_group(args, self.kvm, self.log)
            elif key == "prune":
                args.workdir = str(workdir / "prune")
                self.workdir = Path(args.workdir)
                out["prune"] = run_prune_group(args, self, self.log)
                rmtree(Path(args.workdir))
            self.workdir, self.out = workdir, results_out
        return out

    def group_dict(self, g: Group) -> dict:
        by_key = {c.key: c for c in g.commands}
        ratios = []
        for a, b in g.pairs:
            ca, cb = by_key[a], by_key[b]
            r = round(ca.median / cb.median, 3) if ca.median and cb.median else None
            ratios.append({"a": a, "b": b, "a_label": ca.label, "b_label": cb.label, "ratio_a_over_b": r})
        tree = self.trees.get(g.tree, {}).get("counts", {})
        items = g.items if g.items is not None else tree.get("files")
        cmds = []
        for c in g.commands:
            d = c.summary()
            if c.median and items:
                d["items_per_s"] = round(items / c.median)
                if g.items is None:
                    d["mib_per_s"] = round(tree["bytes"] / c.median / 2**20, 1)
            cmds.append(d)
        return {"key": g.key, "title": g.title, "tree": g.tree, "note": g.note, "item_name": g.item_name,
                "reps": g.reps,
                "items": items, "loadavg": g.loadavg, "commands": cmds, "ratios": ratios}

    def _cmd(self, key: str) -> Command | None:
        for g in self.groups:
            for c in g.commands:
                if c.key == key:
                    return c
        return None

    def leaf_walk(self) -> str:
        """Which leaf walk the measured kvmigrate's scan runs (README: Install)."""
        code = "import kvmigrate.scan as s; w = s.leaf_walk(); print(w.__file__ if w else '')"
        # cwd "/": `python -c` puts the working folder first on sys.path, and a checkout
        # there would be reported instead of what the measured install imports
        p = subprocess.run([self.kvm_python, "-c", code], capture_output=True, text=True, cwd="/")
        if p.returncode != 0:
            return "unknown"
        where = p.stdout.strip()
        return f"C (`{Path(where).name}`)" if where else "Python (the C extension is not built or ruled out)"

    def replica_check(self) -> dict:
        out = {}
        for g in self.groups:
            if not g.key.startswith(("hash", "cold")):
                continue
            spec = self.specs[g.tree]
            row: dict[str, Any] = {"expected": spec.blocks}
            for suffix in ("kvm", "jdupes", "rdfind", "rmlint"):
                c = self._cmd(f"{g.key}_{suffix}")
                row[suffix] = c.facts.get("replica_groups") if c and c.facts else None
            counted = [v for k, v in row.items() if k != "expected" and v is not None]
            if counted and all(isinstance(v, int) for v in counted):
                row["agree"] = all(v == spec.blocks for v in counted)
            else:
                row["agree"] = None  # a count is missing: not checked
            kvm = self._cmd(f"{g.key}_kvm")
            if kvm and kvm.facts:
                row["kvmigrate_files"] = kvm.facts.get("files")
                row["tree_files"] = self.trees[g.tree]["counts"]["files"]
            out[g.key] = row
        return out

    def scale_figures(self) -> dict:
        """Per command of the scale group: per-file cost at each size, the ratio of the
        largest tree's to the smallest's, and the largest tree's peak RSS."""
        out: dict[str, dict] = {}
        for cmd in ("scan", "migrate", "report", "cpal"):
            rows = []
            for name in SCALE_TREES:
                c = self._cmd(f"scale_{name}_{cmd}")
                files = self.trees.get(name, {}).get("counts", {}).get("files")
                if not c or not c.median or not files:
                    break
                rows.append({"tree": name, "files": files, "median_s": round(c.median, 3),
                             "us_per_file": round(1e6 * c.median / files, 2),
                             "peak_rss_mib": c.summary()["peak_rss_mib"]})
            if len(rows) == len(SCALE_TREES):
                # per-file cost carries the fixed start-up, which flatters the largest tree; the marginal
                # cost (seconds per added file between sizes) does not
                a, b, c = rows[0], rows[1], rows[-1]
                low = (b["median_s"] - a["median_s"]) / (b["files"] - a["files"])
                high = (c["median_s"] - b["median_s"]) / (c["files"] - b["files"])
                out[cmd] = {"sizes": rows, "per_file_ratio": round(rows[-1]["us_per_file"] / rows[0]["us_per_file"], 3),
                            "marginal_us_per_file": [round(1e6 * low, 2), round(1e6 * high, 2)],
                            "marginal_ratio": round(high / low, 3) if low > 0 else None,
                            "largest_files": rows[-1]["files"], "largest_rss_mib": rows[-1]["peak_rss_mib"]}
        return out

    def targets(self) -> list[dict]:
        """The issue's "Done means", each as measured here."""
        large = self.scale == "large"
        res: list[dict] = []

        def ratio(a: str, b: str) -> float | None:
            ca, cb = self._cmd(a), self._cmd(b)
            return ca.median / cb.median if ca and cb and ca.median and cb.median else None

        def add(name: str, figure: float | None, limit: float, kind: str, unit: str, basis: str,
                strict: bool = False) -> None:
            if figure is None:
                res.append({"target": name, "figure": None, "limit": limit, "result": "not measured",
                            "basis": basis})
                return
            if kind == "max":
                passed = figure < limit if strict else figure <= limit
            else:
                passed = figure >= limit
            miss = ""
            if not passed:
                miss = (f"{figure / limit:.2f}x over the limit" if kind == "max"
                        else f"{limit / figure:.2f}x short of the target")
            res.append({"target": name, "figure": round(figure, 3), "unit": unit, "limit": limit, "kind": kind,
                        "strict": strict,
                        "result": "pass" if passed else "miss", "by": miss, "basis": basis,
                        "scale_note": "" if large else "small scale: indicative; the target is defined on the "
                                                        "large trees (1M files, 4 GiB)"})

        add("metadata scan <= 1.5x find -printf", ratio("meta_kvm", "meta_find"), 1.5, "max", "x",
            "kvmigrate scan --verify size / find -printf, medians, 4 KiB tree")
        for key, what in (("hash4k", "4 KiB files"), ("hash1m", "1 MiB files")):
            r = ratio(f"{key}_xxhsum", f"{key}_kvm")
            add(f"hash throughput >= 1.0x xxhsum -H2 ({what})", r, 1.0, "min", "x",
                "xxhsum time / kvmigrate scan --verify hash time (throughput ratio)")
            for tool in ("jdupes", "rdfind"):
                if (key, tool) == ("hash1m", "jdupes"):
                    continue  # retired (issue 22): under the start-up floor of any tool started in Python
                add(f"replica groups >= 3x faster than {tool} ({what})", ratio(f"{key}_{tool}", f"{key}_kvm"), 3.0,
                    "min", "x", f"{tool} time / kvmigrate scan --verify hash time")
        add("migrate --apply (links) <= 1.5x cp -al", ratio("mig_kvm", "mig_cpal"), 1.5, "max", "x",
            "kvmigrate migrate --manifest M --apply / cp -al, medians")
        for key, what in (("mig_kvm_root", "migrate ROOT --apply (default flags)"),
                          ("mig_kvm_size", "migrate --manifest M(size) --apply")):
            add(f"{what} <= 1.0x xxhsum -H2 + cp -al by hand (issue 16)", ratio(key, "mig_byhand"), 1.0, "max",
                "x", f"kvmigrate {what} / (xxhsum -H2 of the legacy folders, then cp -al), medians")
        if self._cmd("flat_kvm_size"):
            add("flat directory: scan --verify size <= 1.0x find -printf (issue 21)",
                ratio("flat_kvm_size", "flat_find"), 1.0, "max", "x",
                "kvmigrate scan --verify size / find -printf, medians, flat HiCache directory")
            add("flat directory: hash throughput >= 1.0x xxhsum -H2 (serial)", ratio("flat_xxhsum", "flat_kvm_hash"),
                1.0, "min", "x", "xxhsum time / kvmigrate scan --verify hash time, flat HiCache directory")
            flat_rss = [c.summary().get("peak_rss_mib") for c in (self._cmd("flat_kvm_size"),
                                                                   self._cmd("flat_kvm_hash")) if c]
            flat_rss = [x for x in flat_rss if x is not None]
            add("flat directory: scan peak RSS < 256 MiB", max(flat_rss) if flat_rss else None, 256, "max", "MiB",
                "max over the flat group's scan --verify size and --verify hash runs (os.wait4 ru_maxrss)",
                strict=True)
        rss = [c.summary().get("peak_rss_mib") for c in (self._cmd("meta_kvm"), self._cmd("hash4k_kvm")) if c]
        rss = [x for x in rss if x is not None]
        add("scan peak RSS < 256 MiB (4 KiB-file tree)", max(rss) if rss else None, 256, "max", "MiB",
            "max over scan --verify size and --verify hash runs (os.wait4 ru_maxrss)", strict=True)
        for key, what in (("cold4k", "1M files of 4 KiB" if large else "4 KiB files"), ("cold1m", "1 MiB files")):
            if not self._cmd(f"{key}_kvm"):
                continue
            add(f"cold: scan --verify size <= 0.5x find -printf ({what})", ratio(f"{key}_kvm_size", f"{key}_find"),
                0.5, "max", "x", "kvmigrate scan --verify size / find -printf, medians, page cache dropped before each")
            add(f"cold: hash throughput >= 1.5x xargs -P xxhsum -H2 ({what})", ratio(f"{key}_xxhsum", f"{key}_kvm"),
                1.5, "min", "x", "find | xargs -P(4 x cores) -n512 xxhsum -H2 time / kvmigrate scan --verify hash time")
            rm = self._cmd(f"{key}_rmlint")
            lower = bool(rm and any(r.timed_out for r in rm.runs))
            add(f"cold: replica groups >= 5x faster than rmlint ({what})", ratio(f"{key}_rmlint", f"{key}_kvm"), 5.0,
                "min", "x", "rmlint -T df time / kvmigrate scan --verify hash time"
                + (" (rmlint stopped at its timeout: the figure is a lower bound)" if lower else ""))
            if lower and res[-1].get("figure") is not None:
                res[-1]["lower_bound"] = True
            fio, kvm = self._cmd(f"{key}_fio"), self._cmd(f"{key}_kvm")
            if fio and kvm and kvm.median and fio.facts.get("bw_mib_s"):
                kvm_bw = self.trees[GROUP_TREES[key]]["counts"]["bytes"] / kvm.median / 2**20
                add(f"cold: hash scan bandwidth >= 0.8x fio sequential read ({what})", kvm_bw / fio.facts["bw_mib_s"],
                    0.8, "min", "x", f"kvmigrate {kvm_bw:.0f} MiB/s (tree bytes / median) / fio "
                    f"{fio.facts['bw_mib_s']:.0f} MiB/s (its own bandwidth, O_DIRECT, same reads in flight)")
        scale = self.scale_figures()
        scale.pop("cpal", None)  # a reference for migrate's row, not a target of ours
        for cmd, f in scale.items():
            add(f"scale: {cmd} time per file at {SCALE_TREES[-1]} / at {SCALE_TREES[0]} <= 1.1", f.get("per_file_ratio"),
                1.1, "max", "x", "median seconds per file, largest tree over smallest (linear: 1.0)")
            add(f"scale: {cmd} marginal time per file, {SCALE_TREES[1]} to {SCALE_TREES[-1]} / {SCALE_TREES[0]} to "
                f"{SCALE_TREES[1]} <= 1.1", f.get("marginal_ratio"), 1.1, "max", "x",
                "seconds per added file between sizes (the fixed start-up left out)")
            add(f"scale: {cmd} peak RSS < 256 MiB at {f['largest_files']:,} files", f.get("largest_rss_mib"), 256,
                "max", "MiB", "os.wait4 ru_maxrss, largest tree", strict=True)
        help_s = self.startup.get("kvmigrate_help", {}).get("median_s") if self.startup else None
        add("kvmigrate --help < 0.3 s", help_s, 0.3, "max", "s", f"median of {self.args.startup_runs} runs",
            strict=True)
        return res


# --------------------------------------------------------------------------- report

def fmt_s(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def cell(text: Any) -> str:
    """Markdown table cells must not contain a bare `|`."""
    return str(text).replace("|", "\\|")


def fmt_int(x: Any) -> str:
    return f"{x:,}" if isinstance(x, int) else ("—" if x is None else str(x))


def render_machine(result: dict, add: Any) -> None:
    """The "Machine" table of a report."""
    m = result["machine"]
    add("## Machine")
    add("")
    add("| | |")
    add("|---|---|")
    add(f"| CPU | {m['cpu_model']}, {m['cores']} cores |")
    add(f"| RAM | {m['mem_total_bytes'] / 2**30:.1f} GiB (available at start "
        f"{(m['mem_available_bytes_at_start'] or 0) / 2**30:.1f} GiB) |")
    add(f"| workdir filesystem | {m['workdir_fs']} on {m['workdir_device']} (mounted at {m['workdir_mount']}, "
        f"options `{m.get('workdir_mount_options', '')}`) |")
    add(f"| kernel / OS | {m['kernel']} / {m['os']} |")
    if m.get("page_reclaim"):
        add(f"| proactive page reclaim | {m['page_reclaim']} |")
    add(f"| Python | {m['python']} (`{m['python_executable']}`) |")
    add(f"| Python packages | {', '.join(f'{k} {v}' for k, v in m['python_packages'].items())} |")
    add(f"| Debian packages | {', '.join(f'{k} {v}' for k, v in m['debian_packages'].items())} |")
    add(f"| kvmigrate source | `{m['git_head']}`"
        + (f"; working tree had {len(m['git_uncommitted_under_kvmigrate'])} uncommitted change(s) under "
           f"kvmigrate/" if m["git_uncommitted_under_kvmigrate"] else "; clean") + " |")
    add(f"| kvmigrate threads | {result['kvmigrate_threads']} |")
    if result.get("kvmigrate_leaf_walk"):
        add(f"| scan leaf walk | {result['kvmigrate_leaf_walk']} |")
    add("")


def render_scale(figures: dict, add: Any) -> None:
    """The scale group's table: time per file and peak RSS at each size."""
    if not figures:
        return
    add("")
    add("| command | " + " | ".join(f"{r['files']:,} files: s, µs/file, peak RSS MiB"
                                  for r in next(iter(figures.values()))["sizes"])
        + " | per-file cost, largest / smallest | marginal µs/file (low, high) | marginal high / low |")
    add("|---|" + "---:|" * (len(next(iter(figures.values()))["sizes"]) + 3))
    for cmd, f in figures.items():
        lo, hi = f["marginal_us_per_file"]
        mr = "—" if f["marginal_ratio"] is None else f"{f['marginal_ratio']:.3f}"
        label = {"cpal": "cp -al of rank 0 (the filesystem's own linking cost)"}.get(cmd, cmd)
        add(f"| {label} | " + " | ".join(f"{fmt_s(r['median_s'])}, {r['us_per_file']:.2f}, {r['peak_rss_mib']}"
                                       for r in f["sizes"]) + f" | {f['per_file_ratio']:.3f} | {lo}, {hi} | {mr} |")


def render_group(g: dict, m: dict, add: Any, scale_figures: dict | None = None) -> None:
    """One group's section: its table of commands, ratios, facts and exact commands."""
    add("")
    add(f"### {g['title']}")
    add("")
    add(g["note"])
    if g["key"] == "scale":
        render_scale(scale_figures or {}, add)
    la = g.get("loadavg", {})
    add("")
    add(f"{g.get('reps')} repetitions; {fmt_int(g['items'])} {g['item_name']} per run. Load average "
        f"(1/5/15 min) before the group {la.get('before')}, after {la.get('after')}.")
    busy = max((la.get("before") or [0])[0], (la.get("after") or [0])[0])
    if busy > (m.get("cores") or 1):
        add("")
        add(f"> The 1-min load reached {busy} on {m.get('cores')} cores in this group (it counts the group's own "
            "commands, and every process waiting on the disk): expect noisy figures; compare min with min "
            "as well as the medians.")
    add("")
    add(f"| command | median s | min s | max s | {g['item_name']}/s | MiB/s | user s | sys s | peak RSS MiB |")
    add("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in g["commands"]:
        label = cell(c["label"])
        if not c["available"]:
            add(f"| {label} | not available: {cell(c['why_unavailable'])} | | | | | | | |")
            continue
        if "median_s" not in c:
            add(f"| {label} | failed (see below) | | | | | | | |")
            continue
        add(f"| {label} | {fmt_s(c['median_s'])} | {fmt_s(c['min_s'])} | {fmt_s(c['max_s'])} | "
            f"{fmt_int(c.get('items_per_s'))} | {c.get('mib_per_s', '—')} | {fmt_s(c['median_user_s'])} | "
            f"{fmt_s(c['median_sys_s'])} | {c['peak_rss_mib']} |")
    add("")
    add("| pair | ratio (A/B time) |")
    add("|---|---:|")
    for r in g["ratios"]:
        ratio = "—" if r["ratio_a_over_b"] is None else f"{r['ratio_a_over_b']:.2f}x"
        add(f"| {cell(r['a_label'])} / {cell(r['b_label'])} | {ratio} |")
    facts = [(c["label"], c["facts"]) for c in g["commands"] if c.get("facts")]
    if facts:
        add("")
        for label, f in facts:
            add(f"- {label}: `{json.dumps(f, sort_keys=True)}`")
    errors = [(c["label"], c["error"]) for c in g["commands"] if c.get("error")]
    for label, e in errors:
        runs = len(next(c for c in g["commands"] if c["label"] == label).get("runs", []))
        add(f"- **{label} failed** after {runs} good run(s); its later repetitions were skipped:")
        add("")
        add("```")
        add(e)
        add("```")
    add("")
    add("<details><summary>exact commands</summary>")
    add("")
    for c in g["commands"]:
        add(f"- {c['label']}: `{c['command']}`")
    add("")
    add("</details>")


def render(result: dict) -> str:
    if "groups" not in result:  # a `--only baseline` run on its own
        return render_baseline_page(result)
    m = result["machine"]
    L: list[str] = []
    add = L.append
    add("# kvmigrate benchmarks: side by side with the standard tools")
    add("")
    add(f"Generated {result['generated_utc']} by `{result['command']}` "
        f"(scale **{result['scale']}**, {result['reps']} repetitions per command, run took "
        f"{result['duration_s'] / 60:.1f} min). Raw figures: [`benchmarks.json`](benchmarks.json).")
    if result["scale"] != "large":
        add("")
        add("> This is a **small-scale** run (quick check). The issue's targets are defined on the large "
            "trees (1M files, 4 GiB); rerun with `--scale large` for the figures that count.")
    add("")
    add("Method: the *Cold* groups drop the page cache, dentries and inodes (`sync; echo 3 > "
        "/proc/sys/vm/drop_caches`, as root) before every timed command; the nightly re-audit group does the "
        "same when its title says cold. Every other group runs on one warm tree (an untimed warm-up pass reads "
        "every folder, inode and byte first, and again just before each group: the VM reclaims idle page cache; page-cache residency is "
        "sampled with `fincore`). Every repetition runs each command once and the "
        "order changes between repetitions (A,B,C; C,B,A; B,C,A; A,C,B: each command goes first in turn, and runs as "
        "often right after each neighbour as right before it), `sync` before each timed command. Figures are "
        "medians of wall time; ratios are kvmigrate median / tool median (below 1 = kvmigrate faster). Peak RSS "
        "and CPU times come from `os.wait4` on each command (process + reaped children; the same figure as "
        "`/usr/bin/time -v` \"Maximum resident set size\"); the bench resets its own peak RSS "
        "(`/proc/self/clear_refs`) before each command, since a child starts with its parent's high-water mark.")
    add("")

    add("## Targets (issue 6, \"Done means\"; issue 16 for migrate against the same safety by hand; issue 22 for "
        "the cold, scale and nightly re-audit figures)")
    add("")
    add("| target | measured | limit | result | |")
    add("|---|---:|---:|---|---|")
    for t in result["targets"]:
        if t["figure"] is None:
            fig = "—"
        elif t.get("unit") == "x":  # ratios to three decimals: 3.001 must not read as a round 3
            fig = f"{'≥ ' if t.get('lower_bound') else ''}{t['figure']:.3f} x"
        else:
            fig = f"{t['figure']:.3g} {t.get('unit', '')}".strip()
        sign = {"max": "<" if t.get("strict") else "≤", "min": "≥"}.get(t.get("kind", ""), "")
        lim = f"{sign} {t['limit']:g}".strip()
        res = {"pass": "**pass**", "miss": "**miss**"}.get(t["result"], t["result"])
        add(f"| {t['target']} | {fig} | {lim} | {res} | {t.get('by', '')} |")
    add("")
    add("Ratios for throughput targets are tool time / kvmigrate time (above 1 = kvmigrate faster).")
    add("")

    render_machine(result, add)

    add("## Trees")
    add("")
    add("Built with `kvmigrate synth` (llm-d, TP=2, MLA, 4 layers: both rank folders hold identical replicas, "
        "real fan-out `<hhh>/<hh>_g0`), several processes with distinct seeds into one root (one namespace). "
        "Every kvmigrate command gets the facts `" + " ".join(FACTS) + "`, so every block has a target "
        "(the vllm-0.28 replicated namespace) and the action `link`.")
    add("")
    add("| tree | file size | files | bytes | folders | inodes | build | warm (sampled pages resident) |")
    add("|---|---:|---:|---:|---:|---:|---|---|")
    for name, t in result["trees"].items():
        c = t["counts"]
        w = result["warm"].get(name, {})
        build = ("reused (--keep)" if t.get("reused")
                 else f"{t['build_s']:.1f} s ({t['build_files_per_s']:,} files/s, {t['build_method']})")
        rewarm = "; ".join(f"before group {g}: warmed again in {r['warmup_s']} s, then {r['resident_fraction_after']}"
                           for g, r in w.get("rewarm_before_group", {}).items())
        warm_s = (f"before {w.get('resident_fraction_before_warmup')}, after warm-up "
                  f"{w.get('resident_fraction_after_warmup')}, at end {w.get('resident_fraction_at_end')}"
                  + (f" ({rewarm})" if rewarm else ""))
        add(f"| {name} | {t['spec']['page_bytes'] * t['spec']['layers']:,} B | {c['files']:,} | "
            f"{c['bytes'] / 2**20:,.1f} MiB | {c['dirs']:,} | {c['inodes']:,} | {build} | {warm_s} |")
    s = result["space"]
    add("")
    add(f"Space: workdir `{s['workdir']}`; estimated need {s['needed_bytes_estimate'] / 2**30:.1f} GiB and "
        f"{s['needed_inodes_estimate']:,} inodes; free before {s['free_bytes_before'] / 2**30:.1f} GiB / "
        f"{s['free_inodes_before']:,} inodes, after building {s['free_bytes_after_build'] / 2**30:.1f} GiB / "
        f"{s['free_inodes_after_build']:,} inodes, at the end {s['free_bytes_at_end'] / 2**30:.1f} GiB / "
        f"{s['free_inodes_at_end']:,} inodes.")
    add("")

    add("## Results")
    for g in result["groups"]:
        render_group(g, m, add, result.get("scale_figures"))

    rg = result["replica_groups"]
    if rg:
        add("")
        add("### Replica groups found (same answer check)")
        add("")
        add("| tree | expected (blocks with 2 identical replicas) | kvmigrate (manifest: files sharing an XXH3-128) "
            "| jdupes | rdfind | rmlint | agree | files in manifest / in tree |")
        add("|---|---:|---:|---:|---:|---:|---|---|")
        for key, r in rg.items():
            agree = {True: "yes", False: "NO"}.get(r["agree"], "not checked")
            add(f"| {key} | {fmt_int(r['expected'])} | {fmt_int(r.get('kvm'))} | {fmt_int(r.get('jdupes'))} | "
                f"{fmt_int(r.get('rdfind'))} | {fmt_int(r.get('rmlint'))} | {agree} | "
                f"{fmt_int(r.get('kvmigrate_files'))} / {fmt_int(r.get('tree_files'))} |")

    st = result["startup"]
    if st:
        add("")
        add(f"### Start-up (median of {st['runs']} runs)")
        add("")
        add("| command | median ms | min ms | max ms | peak RSS MiB |")
        add("|---|---:|---:|---:|---:|")
        for key in ("kvmigrate_help", "python_import_kvmigrate_cli", "python_import_kvmigrate_scan", "python_floor"):
            v = st[key]
            add(f"| `{v['command']}` | {v['median_s'] * 1000:.0f} | {v['min_s'] * 1000:.0f} | "
                f"{v['max_s'] * 1000:.0f} | {v['peak_rss_mib']} |")
        add("")
        heavy = ", ".join(st["heavy_modules_loaded_by_cli"]) or "none"
        add(f"Heavy modules loaded by `import kvmigrate.cli`: {heavy}. "
            "`import kvmigrate.scan` (pyarrow and the library) is the fixed cost every scan and migrate pays "
            "before its first file; on the small trees it is a visible part of each kvmigrate time.")

    add("")
    add("## Where the time goes")
    add("")
    prof = result["profile"]
    if not prof:
        add("Not profiled in this run: add `--profile` (py-spy of `kvmigrate scan` on the 4 KiB tree, parent and "
            "workers, via `scripts/profile_spy.py`; cProfile via `scripts/profile_scan.py` without py-spy).")
    elif prof.get("kind") == "py-spy":
        render_spy_profile(prof, add)
    else:
        add(f"{prof['tool']}. Self time (`tottime`) is summed over the main thread and the worker threads, so "
            "it adds up to more than the wall time; rows marked *wait* are idle threads blocked on the work "
            "queue or a lock, not cost. A built-in's time is charged to the Python function named in "
            "\"called from\". Iterating an `os.scandir` iterator is not a profiled call: the directory reads "
            "(getdents) show up as self time of the function that loops over it (e.g. `bucket`).")
        for verify, p in _profiled_modes(prof, add):
            add(f"**`scan --verify {verify}`** on the 4 KiB tree: wall {p['wall_s']:.2f} s under the profiler, "
                f"{p['threads_profiled']} threads, {p['profiled_time_s']:.2f} s profiled in total.")
            add("")
            waits = [r for r in p["top_tottime"] if r.get("waiting")]
            if waits:
                add("Idle waiting (not cost): " + "; ".join(
                    f"`{r['function']}` {r['tottime_s']:.2f} s" for r in waits) + ".")
                add("")
            add("Top self time:")
            add("")
            add("| function | called from | calls | self s | cumulative s |")
            add("|---|---|---:|---:|---:|")
            for r in p["top_tottime"]:
                if r.get("waiting"):
                    continue
                add(f"| `{r['function']}` | `{r.get('called_from') or ''}` | {r['ncalls']:,} | "
                    f"{r['tottime_s']:.3f} | {r['cumtime_s']:.3f} |")
            phases = p.get("top_kvmigrate_cumtime") or []
            if phases:
                add("")
                add("kvmigrate functions by cumulative time (the phases):")
                add("")
                add("| function | calls | self s | cumulative s |")
                add("|---|---:|---:|---:|")
                for r in phases:
                    add(f"| `{r['function']}` | {r['ncalls']:,} | {r['tottime_s']:.3f} | {r['cumtime_s']:.3f} |")
    if result["notes"]:
        add("")
        add("## Notes")
        add("")
        for n in result["notes"]:
            add(f"- {n}")
    if result.get("journal"):
        render_journal(result["journal"], add)
    if result.get("prune"):
        render_prune(result["prune"], add)
    transforms = Path(__file__).resolve().parent.parent / "reports" / "TRANSFORMS.md"
    if transforms.is_file():
        add("")
        add("## Transform throughput (slice, concat, relayout) against `cp`")
        add("")
        add("Measured separately by `scripts/bench_transforms.py` (method and full table in "
            "[TRANSFORMS.md](TRANSFORMS.md)); its results table, copied here:")
        add("")
        text = transforms.read_text()
        start = text.find("| case |")
        end = text.find("\n\n", start)
        if start >= 0:
            add(text[start:end if end > 0 else None].rstrip())
            tail_start = text.find("End to end:", end)
            if tail_start >= 0:
                add("")
                add(text[tail_start:text.find("\n\n", tail_start)].strip())
    baseline = Path(__file__).resolve().parent.parent / "reports" / "BASELINE.md"
    if result.get("baseline"):  # `--only baseline`, merged
        render_baseline(result["baseline"], m, add)
    elif baseline.is_file():  # the earlier, separate measure of a --baseline scan
        text = baseline.read_text()
        add("")
        add("## Scheduled audits: `--baseline` on an unchanged tree")
        add("")
        add("Measured separately by the former `scripts/bench_baseline.py` (now `--only baseline`; method in "
            "[BASELINE.md](BASELINE.md)):")
        add("")
        start = text.find("Tree:")
        add(text[start:].rstrip() if start >= 0 else text.rstrip())
    add("")
    add("## How to rerun")
    add("")
    add("```")
    add("apt-get update && apt-get install -y xxhash jdupes rdfind fd-find time   # the tools compared against")
    add("python3 scripts/bench.py --scale small --reps 2             # quick check, ~2 min")
    add("python3 scripts/bench.py --scale large --reps 5 --migrate-reps 3 --keep   # the issue's sizes")
    add("python3 scripts/bench.py --scale small --profile            # + py-spy (else cProfile) of scan (Where the time goes)")
    add("python3 scripts/bench.py --only meta,startup                # some groups only")
    add("python3 scripts/bench.py --scale small --only migrate --reps 2   # the migrate group alone")
    add("python3 scripts/bench.py --only baseline --baseline-files 50000   # --baseline auto of an unchanged tree")
    add("```")
    add("")
    add("Options: `--workdir DIR` (default /work/bench-tmp/SCALE, outside the repo), `--keep` (keep the trees and "
        "reuse them next time), `--reps N` (default 5), `--jobs N` (synth processes), `--threads N` (passed to "
        "kvmigrate scan), `--migrate-reps N`, `--kvmigrate PATH`, `--out-dir DIR` (default reports/), "
        "`--check-space` (print the sizes and the space check, then exit). The large scale needs about 2.9M "
        "inodes and ~18 GiB on the workdir's filesystem; the script checks `statvfs` first and refuses when "
        "there is not enough room. On this 2-core VM a large run takes roughly 1.5-2 h, most of it in the "
        "migrate group: every repetition deletes ~400k created folders, and deletes are slow (~3k folders/s) "
        "on an ext4 mounted with `discard`; `--migrate-reps 3` saves about half an hour.")
    add("")
    return "\n".join(L)


# --------------------------------------------------------------------------- journal group

def before_kvmigrate(rev: str, workdir: Path, log: Any) -> tuple[str, str]:
    """(kvmigrate executable, commit) of REV: a detached git worktree of it under the
    workdir with its own venv (`pip install -e .`, reused by the next run)."""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", rev], capture_output=True, text=True,
                            check=True).stdout.strip()
    wt = workdir / f"before-{commit[:12]}"
    exe = wt / ".venv" / "bin" / "kvmigrate"
    if not exe.exists():
        log(f"journal: building {rev} ({commit[:12]}) in {wt}")
        if not wt.exists():
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(wt), commit], check=True,
                           capture_output=True)
        subprocess.run([sys.executable, "-m", "venv", str(wt / ".venv")], check=True)
        subprocess.run([str(wt / ".venv" / "bin" / "pip"), "install", "-q", "-e", str(wt)], check=True,
                       capture_output=True)
    return str(exe), commit


# the floor of a rollback: the same removals by plain tools, after a migration by this checkout
FLOORS = {
    "floor rm -rf": "`rm -rf` of the folders the migration created whole (the target base folder and its "
                    "rank folder): one process, one removal at a time",
    "floor xargs -P": "the paths of `rollback --dry-run --list` (listed untimed): `xargs -0 -P 8 -n 256 rm -f` of "
                      "the files, then `xargs -0 -P 64 -n 256 rmdir` of the folders level by level, deepest first",
}


def run_floor(name: str, exe: str, jdir: Path, root: Path, before: set[str], workdir: Path) -> Run:
    """Time the floor `name` (FLOORS) on a freshly migrated tree: exactly the paths the
    migration created, removed by plain tools."""
    if name == "floor rm -rf":
        created = sorted(set(os.listdir(root)) - before - {".kvmigrate"})
        return run_measured(["rm", "-rf", "--", *(str(root / n) for n in created)])
    listing = subprocess.run([exe, "rollback", str(jdir), "--dry-run", "--list"], capture_output=True, text=True)
    if listing.returncode != 0:
        sys.exit(f"bench: journal: rollback --dry-run --list failed (exit {listing.returncode})")
    files, dirs = [], defaultdict(list)
    for line in listing.stdout.splitlines():
        if line.startswith("rm -f -- "):
            files.append(shlex.split(line)[-1])
        elif line.startswith("rmdir -- "):
            path = shlex.split(line)[-1]
            dirs[path.count("/")].append(path)
    lists = workdir / "floor-lists"
    rmtree(lists)
    lists.mkdir()
    (lists / "files").write_text("\0".join(files) + "\0")
    script = [f"xargs -0 -P 8 -n 256 rm -f -- < {q(lists / 'files')}"]
    for depth in sorted(dirs, reverse=True):
        (lists / f"dirs-{depth}").write_text("\0".join(dirs[depth]) + "\0")
        script.append(f"xargs -0 -P 64 -n 256 rmdir -- < {q(lists / f'dirs-{depth}')}")
    return run_measured(sh(" && ".join(script)))


def run_journal_group(args: argparse.Namespace, kvm: str, log: Any) -> dict:
    """Journal size per linked block and rollback time, before (REV) and after (this
    checkout), on one tree of `--journal-blocks` llm-d TP=2 MLA blocks (every action a
    link, as in the migrate group), alternating before/after each repetition."""
    blocks = args.journal_blocks
    workdir = Path(args.workdir or DEFAULT_WORKDIR / "journal").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    spec = TreeSpec("journal", "journal tree", blocks, 1024)
    root = workdir / "tree"
    stamp = workdir / f"tree-{blocks}.ok"
    if not stamp.exists():
        rmtree(root)
        log(f"journal: synth {blocks:,} blocks (x{spec.tp} rank files)")
        subprocess.run([kvm, "synth", str(root), *spec.synth_args(blocks, 0)], check=True, capture_output=True)
        stamp.write_text("ok\n")
    before = set(os.listdir(root))
    versions = {"after": (kvm, subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                               text=True).stdout.strip())}
    if args.journal_before:
        versions = {"before": before_kvmigrate(args.journal_before, workdir, log), **versions}
    names = [*versions, *FLOORS]
    load_before = os.getloadavg()[0]
    manifests = {}  # each version migrates from a manifest of its own scan (the format versions differ)
    for name, (exe, _) in versions.items():
        manifests[name] = workdir / f"m-{name}.parquet"
        r = run_measured([exe, "scan", str(root), "--verify", "hash", "-q", "-o", str(manifests[name]), *FACTS])
        if r.rc not in (0, 1):
            sys.exit(f"bench: journal: the {name} scan failed (exit {r.rc})")
    out: dict[str, Any] = {"blocks": blocks, "tree": f"llm-d TP=2 MLA, {blocks:,} blocks of 4 KiB, every action "
                                                     "`link`", "reps": args.reps, "versions": {}}
    runs: dict[str, list[dict]] = {k: [] for k in names}
    for rep in range(args.reps):
        order = rep_order(names, rep)  # each goes first in turn, neighbours both ways round
        for name in order:
            version = "after" if name in FLOORS else name  # a floor removes what this checkout created
            exe = versions[version][0]
            jdir = workdir / f"journal-{name.replace(' ', '-')}"
            rmtree(jdir)
            for extra in sorted(set(os.listdir(root)) - before):
                rmtree(root / extra)
            ap = run_measured([exe, "migrate", "--manifest", str(manifests[version]), "--apply", "-q", "--journal",
                               str(jdir)])
            if ap.rc != 0:
                sys.exit(f"bench: journal: the {name} apply failed (exit {ap.rc})")
            jbytes = sum(f.stat().st_size for f in jdir.iterdir())
            os.sync()
            if name in FLOORS:
                rb = run_floor(name, exe, jdir, root, before, workdir)
            else:
                rb = run_measured([exe, "rollback", str(jdir), "-q"])
            left = sorted(set(os.listdir(root)) - before)
            rec = {"apply_s": round(ap.wall_s, 2), "apply_rc": ap.rc, "journal_bytes": jbytes,
                   "bytes_per_block": round(jbytes / blocks, 1), "rollback_s": round(rb.wall_s, 2),
                   "rollback_rc": rb.rc, "rollback_peak_rss_mib": round(rb.maxrss_kib / 1024, 1),
                   "left_after_rollback": [n for n in left if n != ".kvmigrate"]}
            runs[name].append(rec)
            log(f"journal: {name} rep {rep + 1}: {rec}")
    for name in names:
        exe, commit = versions["after" if name in FLOORS else name]
        rs = runs[name]
        out["versions"][name] = {"kvmigrate": exe, "commit": commit, "runs": rs, "how": FLOORS.get(name),
                                 "bytes_per_block": statistics.median(r["bytes_per_block"] for r in rs),
                                 "rollback_s": statistics.median(r["rollback_s"] for r in rs),
                                 "apply_s": statistics.median(r["apply_s"] for r in rs)}
    if "before" in out["versions"]:
        b, a = out["versions"]["before"], out["versions"]["after"]
        out["rollback_speedup"] = round(b["rollback_s"] / a["rollback_s"], 2) if a["rollback_s"] else None
        out["size_ratio"] = round(b["bytes_per_block"] / a["bytes_per_block"], 1) if a["bytes_per_block"] else None
    floor = min(FLOORS, key=lambda n: out["versions"][n]["rollback_s"])
    f_s, a_s = out["versions"][floor]["rollback_s"], out["versions"]["after"]["rollback_s"]
    out["floor"] = {"name": floor, "rollback_s": f_s, "after_over_floor": round(a_s / f_s, 2) if f_s else None}
    out["load_before"], out["load_after"] = round(load_before, 2), round(os.getloadavg()[0], 2)
    out["when"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    out["command"] = "python3 scripts/bench.py " + " ".join(q(a) for a in sys.argv[1:])
    return out


def render_journal(j: dict, add: Any) -> None:
    add("")
    add("## Journal: bytes per block and rollback time (issue 18)")
    add("")
    add(f"{j['tree']}; `migrate --manifest M --apply --journal DIR`, then `sync`, then the timed "
        f"`rollback DIR`; median of {j['reps']} repetitions changing the order of the versions (each goes first in turn, neighbours "
        f"both ways round), "
        f"from one run of `{j['command']}` at {j['when']} (removals wait on the disk: the wall times are noisy)"
        + (f"; load average {j['load_before']} before the group, {j['load_after']} after." if "load_before" in j
           else "."))
    add("")
    add("| version | commit | journal bytes / block | rollback (s) | apply (s) | rollback peak RSS (MiB) |")
    add("|---|---|---:|---:|---:|---:|")
    for name, v in j["versions"].items():
        rss = statistics.median(r["rollback_peak_rss_mib"] for r in v["runs"])
        jb = "—" if v.get("how") else f"{v['bytes_per_block']:,.1f}"  # a floor: the after's journal
        add(f"| {name} | `{v['commit'][:10]}` | {jb} | {v['rollback_s']:.2f} | "
            f"{v['apply_s']:.2f} | {rss:,.1f} |")
    floors = [(name, v) for name, v in j["versions"].items() if v.get("how")]
    if floors:
        add("")
        add("The floor rows remove exactly what the migration (by `after`) created, with plain tools, timed the "
            "same way: " + "; ".join(f"**{name}**: {v['how']}" for name, v in floors) + ".")
        if j.get("floor"):
            f = j["floor"]
            add(f"Rollback (after) takes **{f['after_over_floor']}x** the fastest floor ({f['name']}, "
                f"{f['rollback_s']:.2f} s).")
    if j.get("rollback_speedup"):
        add("")
        add(f"Rollback **{j['rollback_speedup']}x** faster (goal >= 5x); the journal **{j['size_ratio']}x** "
            f"smaller (goal <= 100 bytes per linked block). Each repetition: "
            + "; ".join(f"{name} " + ", ".join(f"{r['rollback_s']} s" for r in v["runs"])
                        for name, v in j["versions"].items()) + ".")
        pairs = [round(b["rollback_s"] / a["rollback_s"], 1)
                 for b, a in zip(j["versions"]["before"]["runs"], j["versions"]["after"]["runs"]) if a["rollback_s"]]
        add("")
        add(f"Per repetition (before / after of the same repetition, run back to back): "
            f"{', '.join(f'{x}x' for x in pairs)}. The load of the other sessions moved the before times from "
            f"{min(r['rollback_s'] for r in j['versions']['before']['runs'])} to "
            f"{max(r['rollback_s'] for r in j['versions']['before']['runs'])} s within one run. Almost all of a rollback is the filesystem's: `rmdir` of the ~100,000 "
            "folders the migration created (ext4 mounted with `discard`: each rmdir waits for the discard of the "
            "folder's freed block, inside the call and under its parent folder's lock: `ext4_evict_inode` -> "
            "`ext4_free_blocks` -> `blkdev_issue_discard`); the new rollback keeps 8 file and 32 folder removals "
            "in flight, reads the journal once and reads no linked block. The apply times "
            "depend on the order: an apply right after a rollback waits for that rollback's writeback.")


# --------------------------------------------------------------------------- prune group

def run_prune_group(args: argparse.Namespace, bench: Bench, log: Any) -> dict:
    """`prune --apply` of `--prune-files` migrated legacy block files against `rm -rf` of
    the same legacy folders, and `restore` of that prune (issue 19; one run, as it asks).

    A vLLM S2 MLA tree of N blocks (1 KiB each, one layer) is migrated by hard links and
    scanned (`--verify size`: the timed figure is prune's own work, not a hash scan); on the
    warm tree, each after `sync`: prune (a fresh lstat of every legacy file and of its
    target, the journal fsynced before the first move, one rename per file into the
    quarantine, the emptied folders removed), restore (every file and folder back, checked
    by count), then rm -rf of the legacy folders (what the hints used to print)."""
    n = args.prune_files
    kvm = bench.kvm
    workdir = Path(args.workdir or DEFAULT_WORKDIR / "prune").resolve()
    rmtree(workdir)
    workdir.mkdir(parents=True)
    root = workdir / "root"
    out: dict[str, Any] = {"files": n, "tree": f"vLLM S2 MLA, {n:,} blocks of 1 KiB (one layer), migrated by hard "
                                               "links", "steps": {}, "loadavg": {}}

    def step(name: str, argv: list[str], ok: tuple[int, ...] = (0,), stdout: str | None = None) -> Run:
        os.sync()
        out["loadavg"][name] = [round(x, 2) for x in os.getloadavg()]
        r = run_measured(argv, stdout=stdout, stderr=str(workdir / f"{name}.err"))
        if r.rc not in ok:
            sys.exit(f"bench: prune: {name} exited {r.rc}: {tail(workdir / f'{name}.err')}")
        out["steps"][name] = {**r.as_dict(), "wall_s": round(r.wall_s, 2)}
        log(f"prune: {name} {r.wall_s:.2f} s (load {out['loadavg'][name][0]})")
        return r

    step("synth", [kvm, "synth", str(root), "--family", "vllm", "--scheme", "S2", "--kv-kind", "mla", "--blocks",
                   str(n), "--layers", "1", "--block-bytes", "1024"])
    legacy = sorted(os.listdir(root))  # the folders synth wrote: the migration's sources
    step("migrate", [kvm, "migrate", str(root), *FACTS, "--verify", "size", "--apply", "-q"])
    manifest = workdir / "m.parquet"
    step("scan", [kvm, "scan", str(root), *FACTS, "--verify", "size", "-o", str(manifest), "-q"], ok=(0, 1))
    files_before = sum(len(fs) for name in legacy for _, _, fs in os.walk(root / name))
    warm(root)
    res_path = workdir / "prune.json"
    prune = step("prune_apply", [kvm, "prune", "--manifest", str(manifest), *FACTS, "--force-live", "--apply",
                                 "--json", "-q"], stdout=str(res_path))
    res = json.loads(res_path.read_text())
    out["pruned_files"] = sum(res["moved"].values())
    out["legacy_names_removed"] = sum(res.get("legacy_names_removed", {}).values())
    restore = step("restore", [kvm, "restore", res["journal"], "-q"])
    out["restored_files"] = sum(len(fs) for name in legacy for _, _, fs in os.walk(root / name))
    if out["restored_files"] != files_before or out["pruned_files"] != files_before:
        sys.exit(f"bench: prune: {files_before} legacy files, {out['pruned_files']} pruned, "
                 f"{out['restored_files']} back after restore")
    warm(root)
    rm = step("rm_rf", ["rm", "-rf", *[str(root / name) for name in legacy]])
    out["legacy_files"] = files_before
    out["prune_vs_rm"] = round(prune.wall_s / rm.wall_s, 2) if rm.wall_s else None
    out["restore_vs_prune"] = round(restore.wall_s / prune.wall_s, 2) if prune.wall_s else None
    out["loadavg"]["end"] = [round(x, 2) for x in os.getloadavg()]
    out["when"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    out["command"] = "python3 scripts/bench.py " + " ".join(q(a) for a in sys.argv[1:])
    return out


def render_prune(p: dict, add: Any) -> None:
    st = p["steps"]
    add("")
    add("## prune --apply against rm -rf of the same legacy folders, and restore (issue 19)")
    add("")
    add(f"{p['tree']}; one run of `{p['command']}` at {p['when']}. On the warm tree, each after `sync`: "
        "`kvmigrate prune --manifest M --force-live --apply` (a fresh lstat of every legacy file and its target, "
        "the journal fsynced before the first move, one rename per file into the quarantine, the emptied folders "
        "removed), `kvmigrate restore JOURNAL` (every file and folder back: counted), then `rm -rf` of the same "
        "legacy folders (no check, no undo).")
    add("")
    add("| step | wall (s) | user (s) | sys (s) | peak RSS (MiB) | 1-min load before |")
    add("|---|---:|---:|---:|---:|---:|")
    for name in ("synth", "migrate", "scan", "prune_apply", "restore", "rm_rf"):
        r = st[name]
        add(f"| {name.replace('_', ' ')} | {r['wall_s']:.2f} | {r['user_s']:.2f} | {r['sys_s']:.2f} | "
            f"{r['maxrss_kib'] / 1024:,.1f} | {p['loadavg'][name][0]} |")
    add("")
    add(f"{p['legacy_files']:,} legacy files (the blocks and the namespace's config.json, which goes with its last "
        f"block): {p['pruned_files']:,} pruned ({p['legacy_names_removed']:,} legacy names of blocks the target "
        f"holds), {p['restored_files']:,} back after restore. **prune / rm -rf = {p['prune_vs_rm']}**, "
        f"restore / prune = {p['restore_vs_prune']}; load average at the end {p['loadavg']['end']}.")


def render_prune_only(result: dict) -> str:
    """BENCHMARKS.md of a run of the prune group alone (a fresh --out-dir)."""
    m = result["machine"]
    L: list[str] = []
    add = L.append
    add("# kvmigrate benchmarks: the prune group")
    add("")
    add(f"Machine: {m['cpu_model']}, {m['cores']} cores, {m['mem_total_bytes'] / 2**30:.1f} GiB, kernel "
        f"{m['kernel']}, {m['os']}; work folder on {m['workdir_fs']} ({m['workdir_device']}, "
        f"{m['workdir_mount_options']}); Python {m['python']}; kvmigrate at `{m['git_head'].split()[0]}`"
        + (f" (uncommitted: {', '.join(m['git_uncommitted_under_kvmigrate'])})"
           if m["git_uncommitted_under_kvmigrate"] else "") + ". Raw figures: [`benchmarks.json`](benchmarks.json).")
    render_prune(result["prune"], add)
    return "\n".join(L).rstrip() + "\n"


# --------------------------------------------------------------------------- baseline group

MANIFEST_FACTS = ("import json, sys, pyarrow.compute as pc\n"
                  "from kvmigrate.manifest import read_table\n"
                  "t = read_table(sys.argv[1], columns=['carried', 'status'])\n"
                  "s = pc.value_counts(pc.cast(t['status'], 'string')).to_pylist()\n"
                  "print(json.dumps({'rows': t.num_rows, 'carried': pc.sum(pc.cast(t['carried'], 'int64')).as_py() "
                  "or 0, 'by_status': {d['values']: d['counts'] for d in s}}))\n")


def drop_page_cache() -> None:
    """sync, then drop the page cache, dentries and inodes (root only)."""
    os.sync()
    why = can_drop_caches()
    if why:
        sys.exit(f"bench: a cold group drops the page cache and {why}, or leave the cold groups and "
                 "--baseline-cold out (a warm run)")


def run_baseline_group(args: argparse.Namespace, bench: Bench, spec: TreeSpec | None = None) -> dict:
    """`audit --verify hash --baseline auto` of an unchanged tree (issue 20) against `find
    -printf` of it and the full hash audit, on `--baseline-files` llm-d TP=2 MLA files of
    4 KiB: wall, CPU and bytes read (rchar and read_bytes of /proc/self/io around each
    command: the command's and its children's), with the default --recheck (1/30) and
    with --recheck 0. The baseline is one untimed full hash audit kept with `--keep 1
    --history DIR` outside the tree: every timed run uses that one (same recheck slot),
    and none hashes it as a file of the tree. Warm unless `--baseline-cold`, which drops
    the page cache before each timed command."""
    n = args.baseline_files
    if spec is None:  # alone: a tree of its own; in a full run, the run's files4k tree (`spec`)
        bench.workdir = Path(args.workdir or DEFAULT_WORKDIR / "baseline").resolve()
        bench.out = bench.workdir / "out"
        spec = TreeSpec(f"baseline-{n}", f"{n:,} files of 4 KiB", blocks=max(1, n // 2), page_bytes=1024)
    bench.out.mkdir(parents=True, exist_ok=True)
    bench.check_tools()
    free = fs_free(bench.workdir)
    need = spec.files * (spec.file_bytes + 1024) * 2  # files, their folders, five manifests, headroom
    if not bench._stamp_ok(spec) and (need > free["bytes"] or 2 * spec.files > free["inodes"]) and not args.force:
        sys.exit(f"bench: baseline: not enough room in {bench.workdir} for {spec.files:,} files (~{need / 2**30:.1f} "
                 f"GiB, {2 * spec.files:,} inodes; free {free['bytes'] / 2**30:.1f} GiB, {free['inodes']:,} inodes): "
                 "use --workdir elsewhere, a smaller --baseline-files, or --force")
    machine = bench.machine()
    tree = bench.build_tree(spec)
    bench.trees[spec.name] = tree
    root = bench.tree_root(spec.name)
    history = bench.out / "audits"
    rmtree(history)
    kvm = bench.kvm

    def audit(key: str, label: str, *extra: str, verify: str = "hash") -> Command:
        manifest = bench.out / f"{key}.parquet"
        stdout = str(bench.out / f"{key}.json")

        def check(_run: Run) -> dict:
            facts = json.loads(subprocess.run([bench.kvm_python, "-c", MANIFEST_FACTS, str(manifest)],
                                              capture_output=True, text=True, check=True, cwd="/").stdout)
            facts["exit_code"] = json.loads(Path(stdout).read_text()).get("exit_code")
            return facts

        argv = [kvm, "audit", str(root), "--verify", verify, "-q", "--format", "json", *FACTS, "--history",
                str(history), "--manifest-out", str(manifest), *extra]
        return Command(key, label, argv, "kvmigrate", ok_rcs=(0, 1), stdout=stdout, check=check)

    bench.log(f"baseline: the baseline, an untimed full hash audit kept in {history}")
    first = run_measured([kvm, "audit", str(root), "--verify", "hash", "-q", *FACTS, "--history", str(history),
                          "--keep", "1"])
    kept = sorted(history.glob("*.parquet")) if history.is_dir() else []
    if first.rc not in (0, 1) or len(kept) != 1:
        sys.exit(f"bench: baseline: the first audit failed (exit {first.rc}, {len(kept)} kept manifests in {history})")
    cmds = [
        Command("bl_find", "find -printf (stat only)", sh(f"find {q(root)} -type f -printf '%s %i %T@ %p\\n' > /dev/null"),
                "baseline"),
        audit("bl_size", "audit --verify size (stat only, reference)", verify="size"),
        audit("bl_full", "audit --verify hash (full)"),
        audit("bl_auto", "audit --verify hash --baseline auto (default --recheck 1/30)", "--baseline", "auto"),
        audit("bl_auto_r0", "audit --verify hash --baseline auto --recheck 0", "--baseline", "auto", "--recheck", "0"),
    ]
    cold = bool(args.baseline_cold)
    for c in cmds:
        c.reset = drop_page_cache if cold else None
    pairs = [("bl_auto", "bl_find"), ("bl_auto_r0", "bl_find"), ("bl_auto", "bl_full"), ("bl_auto_r0", "bl_full"),
             ("bl_full", "bl_find"), ("bl_size", "bl_find")]
    group = Group("baseline", f"Scheduled audit of an unchanged tree ({spec.files:,} files of 4 KiB, "
                              f"{'cold: page cache dropped before each command' if cold else 'warm'})",
                  spec.name, cmds, pairs,
                  note="The baseline: one full `audit --verify hash --keep 1 --history DIR` before the timed runs "
                       "(DIR outside the tree, so no run hashes a kept manifest as a file of the tree). Every "
                       "timed audit writes its manifest with --manifest-out (what a temporary one costs too).")
    if cold:
        drop_page_cache()
        warmth = "cold"
    else:
        warmth = f"warm (warm-up pass {warm(root):.1f} s, untimed)"
    bench.log(f"baseline: {group.title}; {warmth}")
    group.loadavg["before"] = [round(x, 2) for x in os.getloadavg()]
    uptime_before = capture(["uptime"])
    run_group(group, args.reps, bench.log, bench.out, args.settle)
    group.loadavg["after"] = [round(x, 2) for x in os.getloadavg()]
    group.reps = args.reps
    # bytes alone, once each, in one process (--threads 1): the timed runs' rchar also counts the rows the
    # walk processes send the parent through pipes (~400 bytes a file), which are no reads of the disk.
    # Warm even in a cold run: rchar counts read calls whatever the page cache holds, and a one-thread
    # cold hash audit of 1M files would take longer than the rest of the group
    one_process = {}
    for c in cmds[1:]:
        r = run_measured(c.argv + ["--threads", "1"], stdout="/dev/null")
        one_process[c.key] = {"rchar": r.rchar, "read_bytes": r.read_bytes, "wall_s": round(r.wall_s, 2), "rc": r.rc}
        bench.log(f"    one process: {c.label}: rchar {r.rchar:,}, read_bytes {r.read_bytes:,}")
    gd = bench.group_dict(group)
    tree_bytes = tree["counts"]["bytes"]
    manifest_bytes = kept[0].stat().st_size
    by_key = {c["key"]: c for c in gd["commands"]}
    size_rchar = by_key["bl_size"].get("median_rchar")
    figures = {}
    for key, c in by_key.items():
        if c.get("median_rchar") is None:
            continue
        f = {"rchar": c["median_rchar"], "read_bytes": c["median_read_bytes"],
             "rchar_pct_of_tree": round(100 * c["median_rchar"] / tree_bytes, 3),
             "read_bytes_pct_of_tree": round(100 * c["median_read_bytes"] / tree_bytes, 3)}
        if key.startswith("bl_auto"):
            f["rchar_without_manifest_pct_of_tree"] = round(100 * (c["median_rchar"] - manifest_bytes) / tree_bytes, 3)
            f["read_bytes_without_manifest_pct_of_tree"] = round(
                100 * max(0, c["median_read_bytes"] - manifest_bytes) / tree_bytes, 3)
        if key != "bl_find" and size_rchar is not None:
            f["rchar_beyond_size_audit"] = c["median_rchar"] - size_rchar
        figures[key] = f
    floor = one_process["bl_size"]["rchar"]
    for key, f in one_process.items():
        f["rchar_pct_of_tree"] = round(100 * f["rchar"] / tree_bytes, 3)
        f["rchar_beyond_size_audit"] = f["rchar"] - floor
        f["rchar_beyond_size_audit_pct_of_tree"] = round(100 * (f["rchar"] - floor) / tree_bytes, 3)
    ratio = {(r["a"], r["b"]): r["ratio_a_over_b"] for r in gd["ratios"]}
    targets = []
    for key, what in (("bl_auto", "default --recheck 1/30"), ("bl_auto_r0", "--recheck 0")):
        r = ratio.get((key, "bl_find"))
        targets.append({"target": f"audit --baseline auto ({what}) vs find -printf", "figure": r, "unit": "x",
                        "limit": 1.0, "kind": "max", "result": "—" if r is None else "pass" if r <= 1.0 else "miss"})
        pct = one_process[key]["rchar_beyond_size_audit_pct_of_tree"]
        targets.append({"target": f"bytes read (rchar, one process) beyond the stat-only audit, the baseline "
                                  f"manifest's columns included, {what}", "figure": pct,
                        "unit": "% of the tree", "limit": 1.0, "kind": "max", "strict": True,
                        "result": "pass" if pct < 1.0 else "miss"})
    return {"files": spec.files, "tree_bytes": tree_bytes, "tree": tree, "cold": cold, "warmth": warmth,
            "manifest_bytes": manifest_bytes, "baseline_audit_s": round(first.wall_s, 2), "group": gd,
            "bytes": figures, "one_process": one_process, "targets": targets, "machine": machine, "uptime_before": uptime_before,
            "uptime_after": capture(["uptime"]), "reps": args.reps,
            "when": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": "python3 scripts/bench.py " + " ".join(q(a) for a in sys.argv[1:])}


def render_baseline(b: dict, m: dict, add: Any) -> None:
    """The baseline group's section: targets, bytes read, then the group's table."""
    add("")
    add("## Scheduled audits: `audit --verify hash --baseline auto` of an unchanged tree (issue 20)")
    add("")
    add(f"`{b['command']}` at {b['when']}: {b['files']:,} files, {b['tree_bytes']:,} bytes in files, "
        f"**{b['warmth']}**; {b['reps']} repetitions of each command, the "
        f"order changing (each first in turn, neighbours both ways round), medians. The baseline manifest (the kept full audit): {b['manifest_bytes']:,} bytes "
        f"({100 * b['manifest_bytes'] / b['tree_bytes']:.2f}% of the tree). `uptime` before: "
        f"`{b['uptime_before']}`; after: `{b['uptime_after']}`.")
    add("")
    add("| target | measured | limit | result |")
    add("|---|---:|---:|---|")
    for t in b["targets"]:
        fig = "—" if t["figure"] is None else f"{t['figure']:.3f} {t['unit']}"
        add(f"| {t['target']} | {fig} | {'<' if t.get('strict') else '≤'} {t['limit']:g} | **{t['result']}** |")
    add("")
    add("Bytes read, from /proc/self/io around each command (Linux adds a reaped child's counters to its "
        "parent's): `rchar` counts every byte read() or pread() returned, from the page cache too; `read_bytes` "
        "the bytes the block layer fetched (page cache misses: on a warm tree, what was evicted since the warm-up). "
        "\"Without the manifest\": "
        "minus the baseline manifest's size, which a baseline run reads (its columns) besides the tree.")
    add("")
    add("| command | rchar | of the tree | without the manifest | read_bytes | of the tree | rchar beyond "
        "`audit --verify size` |")
    add("|---|---:|---:|---:|---:|---:|---:|")
    labels = {c["key"]: c["label"] for c in b["group"]["commands"]}
    for key, f in b["bytes"].items():
        without = f.get("rchar_without_manifest_pct_of_tree")
        beyond = f.get("rchar_beyond_size_audit")
        add(f"| {cell(labels[key])} | {f['rchar']:,} | {f['rchar_pct_of_tree']:.3f}% | "
            f"{'' if without is None else f'{without:.3f}%'} | {f['read_bytes']:,} | "
            f"{f['read_bytes_pct_of_tree']:.3f}% | {'' if beyond is None else f'{beyond:,}'} |")
    one = b.get("one_process")
    if one:
        add("")
        add("The same audits once more each, in one process (`--threads 1`), for their bytes alone: in the timed "
            "runs `rchar` also counts the rows the walk processes send the parent through pipes (about 400 "
            "bytes a file), which read nothing from the disk. Beyond the stat-only audit, what a baseline run "
            "reads is the baseline manifest's columns and the files it opens. These runs are warm even in a "
            "cold group (`rchar` counts read calls, cached or not; `read_bytes` here is then near 0).")
        add("")
        add("| command (one process) | rchar | of the tree | beyond `audit --verify size` | of the tree | "
            "read_bytes |")
        add("|---|---:|---:|---:|---:|---:|")
        for key, f in one.items():
            add(f"| {cell(labels[key])} | {f['rchar']:,} | {f['rchar_pct_of_tree']:.3f}% | "
                f"{f['rchar_beyond_size_audit']:,} | {f['rchar_beyond_size_audit_pct_of_tree']:.3f}% | "
                f"{f['read_bytes']:,} |")
    render_group(b["group"], m, add)


def render_baseline_page(result: dict) -> str:
    """BENCHMARKS.md of a `--only baseline` run into an out-dir without a full report."""
    L: list[str] = []
    add = L.append
    add("# kvmigrate benchmarks: the baseline group")
    add("")
    add(f"Generated {result['generated_utc']} by `{result['command']}`. Raw figures: "
        "[`benchmarks.json`](benchmarks.json).")
    add("")
    render_machine(result, add)
    render_baseline(result["baseline"], result["machine"], add)
    add("")
    return "\n".join(L)


# --------------------------------------------------------------------------- CLI

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Benchmark kvmigrate side by side with find, fdfind, xxhsum, jdupes, "
                                            "rdfind and cp -al on synthetic cache trees.")
    p.add_argument("--scale", choices=sorted(set(SCALES) | {"normal"}), default=None,
                   help="tree sizes: small (default) or large; with --before: small (a quick try), normal "
                        "(the default: this script's small trees) or large")
    p.add_argument("--reps", type=int, default=None,
                   help="repetitions per command (default 5; with --before: 6, at --scale small 3)")
    p.add_argument("--workdir", help=f"where trees and outputs go (default {DEFAULT_WORKDIR}/SCALE; with --before: "
                                     f"{DEFAULT_WORKDIR}/SCALE-before-after)")
    p.add_argument("--keep", action="store_true", help="keep the workdir (trees are reused by the next run)")
    p.add_argument("--profile", action="store_true", help="profile kvmigrate scan (cProfile, all threads)")
    p.add_argument("--profile-top", type=int, default=20)
    p.add_argument("--only", help="comma-separated groups: meta,hash4k,hash1m,migrate,flat,startup,cold4k,cold1m,"
                                  "scale and baseline,journal,prune (run after the others; each alone merges "
                                  "into the --out-dir's report)")
    p.add_argument("--flat-files", type=int, metavar="N",
                   help="page files of the flat group's HiCache directory (default: 50,000 at --scale small, "
                        "1,000,000 at large)")
    p.add_argument("--jobs", type=int, default=max(2, os.cpu_count() or 2), help="parallel synth processes")
    p.add_argument("--threads", type=int, help="--threads for kvmigrate scan (default: its own default)")
    p.add_argument("--migrate-reps", type=int,
                   help="repetitions of the migrate group (default: --reps); each one deletes the created "
                        "folders, which is slow on a filesystem mounted with `discard`")
    p.add_argument("--startup-runs", type=int, default=20)
    p.add_argument("--settle", type=float, default=None, metavar="SECONDS",
                   help="after a command's reset (the migrate group's deletes), wait up to SECONDS for the disk "
                        "to write and discard nothing for 1 s, untimed (default 0; with --before: 15)")
    p.add_argument("--journal-before", metavar="REV", help="journal group: the git revision to compare with (built in a "
                                                   "worktree under the workdir with its own venv)")
    p.add_argument("--journal-blocks", type=int, default=100_000, help="journal group: blocks (default 100,000)")
    p.add_argument("--prune-files", type=int, default=500_000,
                   help="prune group: migrated legacy block files to prune (default 500,000)")
    p.add_argument("--baseline-files", type=int, default=1_000_000,
                   help="baseline group: files of 4 KiB in its tree (default 1,000,000)")
    p.add_argument("--rmlint-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="cold groups: stop rmlint after this long (its time is then a lower bound; default 600)")
    p.add_argument("--baseline-cold", action="store_true",
                   help="baseline group: drop the page cache before each timed command (root; default: warm)")
    p.add_argument("--kvmigrate", help="the kvmigrate executable (default: /work/venv/bin/kvmigrate or PATH)")
    p.add_argument("--out-dir", help="where BENCHMARKS.md and benchmarks.json go (default reports/; "
                                      "with --before: reports/redesign/)")
    p.add_argument("--before", "--compare", metavar="REV",
                   help="before/after in one run (scripts/bench_compare.py): install REV and --after into their "
                        "own venvs and time every kvmigrate figure with both, alternating; writes "
                        "BEFORE_AFTER.md and before_after.json; exit 1 when a figure is more than 5%% slower")
    p.add_argument("--after", metavar="REV", default="HEAD", help="the new side of --before (default HEAD)")
    p.add_argument("--install-dir", help=f"where --before keeps its installs by commit (default "
                                         f"{DEFAULT_WORKDIR}/installs)")
    p.add_argument("--self-check", action="store_true",
                   help="check the before/after report's ratios and verdicts on given timings, then exit")
    p.add_argument("--force", action="store_true", help="run even if the space check says it will not fit")
    p.add_argument("--render-only", action="store_true",
                   help="rewrite BENCHMARKS.md from the benchmarks.json in --out-dir, run nothing")
    p.add_argument("--profile-only", action="store_true",
                   help="run only the --profile step on the kept 4 KiB tree and add it to the benchmarks.json in "
                        "--out-dir (then rewrite BENCHMARKS.md)")
    p.add_argument("--check-space", action="store_true",
                   help="print the trees' sizes and the space they need, then exit")
    a = p.parse_args(argv)
    if a.before:
        a.scale = a.scale or "normal"
        a.reps = a.reps or (3 if a.scale == "small" else 6)  # even: each side goes first as often
        a.settle = 15.0 if a.settle is None else a.settle
    elif a.scale == "normal":
        p.error("--scale normal is a scale of --before runs; here: small or large")
    a.scale = a.scale or "small"
    a.reps = a.reps or 5
    a.settle = a.settle or 0.0
    if a.reps < 1:
        p.error("--reps must be >= 1")
    return a


def _profiled_modes(prof: dict, add):
    """(verify, profile) of each profiled scan mode; a failed one is reported and skipped."""
    for verify in ("size", "hash"):
        p = prof.get(verify)
        if not p:
            continue
        add("")
        if "error" in p:
            add(f"`scan --verify {verify}`: profile failed: {p['error']}")
            continue
        yield verify, p


def render_spy_profile(prof: dict, add) -> None:
    """The py-spy section of "Where the time goes": shares of samples, per line and per
    function, for each scan mode."""
    add(f"{prof['tool']}. Each process is sampled at a fixed rate; a share is the part of all samples (parent "
        "and workers together) taken on that line or function. A sample taken during a system call is charged to "
        "the Python line making it: `os.read`, `os.open`/`open_noatime`, `os.fstat` and `list(scandir)` lines "
        "are the kernel's share; idle pool threads waiting for work show as `wait`/`select`/`_recv` lines. "
        "With the compiled leaf walk, the `leaf.walk_bucket(...)` line is all of it for plain block files: "
        "the system calls, the XXH3 hashing and the row appends in C (py-spy does not see inside it; "
        "`perf record` does).")
    for verify, p in _profiled_modes(prof, add):
        add(f"**`scan --verify {verify}`** on the 4 KiB tree: wall {p['wall_s']:.2f} s under py-spy, "
            f"{p['samples']:,} samples at {p.get('rate_hz', '?')} Hz per thread, parent and workers together.")
        add("")
        add("| line (self) | code | share |")
        add("|---|---|---:|")
        for row in p.get("self_by_line_pct", []):
            code = (row[2] if len(row) > 2 else "").replace("|", "\\|")
            add(f"| `{row[0]}` | `{code}` | {row[1]}% |")
        add("")
        add("| function (self) | share |")
        add("|---|---:|")
        for name, share in p.get("self_by_function_pct", []):
            add(f"| `{name}` | {share}% |")


def baseline_only(args: argparse.Namespace, bench: Bench) -> int:
    """`--only baseline`: its section is merged into the full report of --out-dir when
    there is one (other groups kept), else it is a report of its own there."""
    if args.baseline_files < 2:
        sys.exit("bench: --baseline-files must be at least 2 (one block on each of two ranks)")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "benchmarks.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    try:
        baseline = run_baseline_group(args, bench)
    except KeyboardInterrupt:
        print(f"bench: interrupted; the tree is left in {bench.workdir}", file=sys.stderr)
        return 32
    if "groups" in result:
        baseline.pop("machine")
    else:
        result = {"schema": 1, "generated_utc": baseline["when"], "command": baseline["command"],
                  "machine": baseline.pop("machine"),
                  "kvmigrate_threads": args.threads or "default (kvmigrate.scan.parallel.parallelism)",
                  "kvmigrate_leaf_walk": bench.leaf_walk()}
    result["baseline"] = baseline
    write_json(path, result)
    (out / "BENCHMARKS.md").write_text(render(result))
    bench.log(f"wrote {out / 'BENCHMARKS.md'} and benchmarks.json")
    for t in baseline["targets"]:
        print(f"  {t['result']:>6}  {t['target']}: {t['figure']}")
    if not args.keep:
        bench.log(f"removing {bench.workdir} (use --keep to reuse the tree)")
        rmtree(bench.workdir)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.self_check or args.before:
        import bench_compare  # scripts/bench_compare.py (it imports this module)
        return bench_compare.self_check() if args.self_check else bench_compare.main(args)
    args.out_dir = args.out_dir or str(REPORTS)
    if args.render_only:
        out = Path(args.out_dir)
        (out / "BENCHMARKS.md").write_text(render(json.loads((out / "benchmarks.json").read_text())))
        print(f"wrote {out / 'BENCHMARKS.md'}")
        return 0
    bench = Bench(args)
    if args.only and args.only.strip() == "journal":  # merged into the existing report, other groups kept
        out = Path(args.out_dir)
        path = out / "benchmarks.json"
        result = json.loads(path.read_text()) if path.is_file() else None
        journal = run_journal_group(args, bench.kvm, bench.log)
        if result is None or "machine" not in result:  # a folder of its own: the journal section alone
            out.mkdir(parents=True, exist_ok=True)
            write_json(path, {"journal": journal})
            lines = ["# kvmigrate journal and rollback benchmark", "", "Raw figures: "
                     "[`benchmarks.json`](benchmarks.json)."]
            render_journal(journal, lines.append)
            (out / "BENCHMARKS.md").write_text("\n".join(lines) + "\n")
            bench.log(f"wrote {out / 'BENCHMARKS.md'} and benchmarks.json")
            return 0
        result["journal"] = journal
        write_json(path, result)
        (out / "BENCHMARKS.md").write_text(render(result))
        bench.log(f"wrote {out / 'BENCHMARKS.md'} and benchmarks.json")
        return 0
    if args.only and args.only.strip() == "prune":  # merged into the existing report, or a report of its own
        out = Path(args.out_dir)
        path = out / "benchmarks.json"
        result = json.loads(path.read_text()) if path.is_file() else None
        bench.workdir = Path(args.workdir or DEFAULT_WORKDIR / "prune").resolve()
        machine = bench.machine()
        prune = run_prune_group(args, bench, bench.log)
        out.mkdir(parents=True, exist_ok=True)
        if result is None or "targets" not in result:
            result = {"machine": machine, "prune": prune}
            text = render_prune_only(result)
        else:
            result["prune"] = prune
            text = render(result)
        write_json(path, result)
        (out / "BENCHMARKS.md").write_text(text)
        bench.log(f"wrote {out / 'BENCHMARKS.md'} and benchmarks.json")
        if not args.keep:  # (after the figures are written: removing the target's tree takes minutes)
            rmtree(bench.workdir)
        return 0
    if args.only and args.only.strip() == "baseline":  # merged into a full report there, else a page of its own
        return baseline_only(args, bench)
    if args.profile_only:
        out = Path(args.out_dir)
        result = json.loads((out / "benchmarks.json").read_text())
        root = bench.tree_root("files4k")
        if not root.is_dir():
            sys.exit(f"bench: {root} is missing: --profile-only profiles the tree a --keep run left")
        bench.log(f"profile-only: warm-up pass {warm(root):.1f} s")
        result["profile"] = bench.run_profile()
        when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        result.setdefault("notes", []).append(
            f"\"Where the time goes\" was taken after the timed run ({when}) by `python3 scripts/bench.py "
            f"--profile-only --kvmigrate {bench.kvm}` on the same kept tree.")
        write_json(out / "benchmarks.json", result)
        (out / "BENCHMARKS.md").write_text(render(result))
        bench.log(f"wrote {out / 'BENCHMARKS.md'} and benchmarks.json")
        return 0
    if args.check_space:
        for spec in bench.specs.values():
            print(f"{spec.name}: {spec.files:,} files of {spec.file_bytes:,} B "
                  f"({spec.files * spec.file_bytes / 2**30:.2f} GiB), "
                  f"~{spec.tp * expected_dirs(spec.blocks):,} folders")
        bench.check_space()
        return 0
    try:
        result = bench.run()
    except KeyboardInterrupt:
        print(f"bench: interrupted; trees and outputs left in {bench.workdir}", file=sys.stderr)
        return 32
    bench.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(bench.out_dir / "benchmarks.json", result)
    (bench.out_dir / "BENCHMARKS.md").write_text(render(result))
    bench.log(f"wrote {bench.out_dir / 'BENCHMARKS.md'} and benchmarks.json")
    if not args.keep:
        bench.log(f"removing {bench.workdir} (slow for the large trees, especially with the `discard` mount option)")
        rmtree(bench.workdir)
        bench.log(f"removed {bench.workdir} (use --keep to reuse the trees)")
    for t in result["targets"]:
        print(f"  {t['result']:>12}  {t['target']}: {t['figure']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
