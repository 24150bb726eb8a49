"""The bench's harness: timing commands (wall, rusage, bytes read), their order, the
page cache, the tools it needs."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
REPORTS = REPO / "reports"
DEFAULT_WORKDIR = Path("/work/bench-tmp")

# tool -> Debian package that ships it
TOOLS = {
    "find": "findutils", "xargs": "findutils", "cp": "coreutils", "xxhsum": "xxhash", "jdupes": "jdupes",
    "rdfind": "rdfind", "fdfind": "fd-find", "fincore": "util-linux", "rmlint": "rmlint", "fio": "fio",
}
# tools every run uses (warm-up, counts, residency), then each group's own
BASE_TOOLS = ("find", "xargs", "fincore")
GROUP_TOOLS = {"flat": ("xxhsum",), "meta": ("fdfind",), "hash4k": ("xxhsum", "jdupes", "rdfind"),
               "hash1m": ("xxhsum", "jdupes", "rdfind"), "migrate": ("xxhsum", "cp"), "startup": (), "baseline": (),
               "cold4k": ("xxhsum", "rmlint"), "cold1m": ("xxhsum", "rmlint", "fio"), "scale": ("cp",)}

# Facts the trees need for a target (llm-d S1 MLA -> vllm-0.28 replicated namespace).
FACTS = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]


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

    timer = None
    killed = threading.Event()
    with contextlib.ExitStack() as files:  # the output files close however the wait ends
        out = files.enter_context(open(stdout, "wb")) if stdout else subprocess.DEVNULL
        err = files.enter_context(open(stderr, "wb")) if stderr else subprocess.DEVNULL
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



def timed(group: Group, reps: int, bench: Any, out: Path, cold: bool) -> dict:
    """Run a group's commands `reps` times (warm or cold), with the load average around it:
    its commands' summaries and the ratio of each pair of medians (a group of its own's
    report, LMCACHE.md and MOONCAKE.md)."""
    group.loadavg["before"] = [round(x, 2) for x in os.getloadavg()]
    group.reps = reps
    run_group(group, reps, bench.log, out, cold=cold)
    group.loadavg["after"] = [round(x, 2) for x in os.getloadavg()]
    cmds = {c.key: c for c in group.commands}
    ratios = []
    for a, b in group.pairs:
        ma, mb = cmds[a].median, cmds[b].median
        if ma and mb:
            ratios.append({"a": a, "b": b, "ratio": round(ma / mb, 3)})
    return {"key": group.key, "title": group.title, "cold": cold, "reps": reps, "loadavg": group.loadavg,
            "commands": [c.summary() for c in group.commands], "ratios": ratios}


def rmtree(path: Path) -> None:
    """Remove a file or a folder tree (`rm -rf` is about twice as fast as shutil.rmtree
    on a million-folder tree)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists() and subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)]).returncode != 0:
        shutil.rmtree(path)



def can_drop_caches() -> str:
    """'' when this process may drop the page cache, else why not."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return ""
    except OSError as exc:
        return f"cannot write /proc/sys/vm/drop_caches ({exc.strerror}): run as root"



def drop_page_cache() -> None:
    """sync, then drop the page cache, dentries and inodes (root only)."""
    os.sync()
    why = can_drop_caches()
    if why:
        sys.exit(f"bench: a cold group drops the page cache and {why}, or leave the cold groups and "
                 "--baseline-cold out (a warm run)")
