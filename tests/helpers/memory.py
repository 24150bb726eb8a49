"""Peak RSS of kvmigrate commands over a migration's lifecycle, for the memory bounds.

Every command runs in a child interpreter (`python -m kvmigrate`); its peak resident set
comes from the kernel's rusage of that child (`os.wait4`, `ru_maxrss` in KiB), so nothing
of the test process counts. `lifecycle_peaks` builds one llm-d TP=2 MLA tree with
`kvmigrate synth` and runs every command an operator runs on it, in order: the figures of
two sizes give each command's growth per file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

FACTS = ("--kv-kind", "mla", "--model-dtype", "bfloat16")


@dataclass(frozen=True)
class Peak:
    """One command's exit code and peak resident set."""

    rc: int
    kib: int
    out: str


# Runs `kvmigrate ARGS` and, at exit, writes the peak of this process's own memory since its
# exec (VmHWM) or of its worker processes, whichever is larger. Not the rusage of the child as
# seen by its parent: that starts from the parent's peak (Linux keeps it across fork and exec),
# so under a test process grown large every command would seem to peak at the same size.
_DRIVER = """
import atexit, resource, runpy, sys
def _peak(path=sys.argv[1], own=sys.argv[2] == "own"):
    hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    workers = 0 if own else resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    open(path, "w").write(str(max(hwm, workers)))
atexit.register(_peak)
sys.argv = ["kvmigrate", *sys.argv[3:]]
runpy.run_module("kvmigrate", run_name="__main__")
"""


def peak_rss(args: list[str], cwd: Path, *, own: bool = False) -> Peak:
    """`kvmigrate ARGS` in a child interpreter: its exit code and peak resident set (KiB).
    `own`: the command's process alone, not its workers (a Ray driver's children are the
    cluster's own processes)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    peak = cwd / "peak.txt"
    with open(cwd / "out.txt", "w+") as out:
        p = subprocess.run([sys.executable, "-c", _DRIVER, str(peak), "own" if own else "all", *map(str, args)],
                           cwd=cwd,
                           stdout=out, stderr=subprocess.STDOUT, env=env)
        out.seek(0)
        text = out.read()
    return Peak(p.returncode, int(peak.read_text()), text)


def assert_flat(what: str, small: Peak, large: Peak, small_files: int, large_files: int, *,
                per_file: int, noise_kib: int) -> None:
    """Both runs ended alike (0 or 1), and the peak grew by at most `per_file` bytes a file
    between the two sizes, plus the allocator's noise."""
    assert small.rc == large.rc and large.rc in (0, 1), large.out[-2000:]
    grown = large_files - small_files
    growth = (large.kib - small.kib) * 1024
    assert growth <= per_file * grown + noise_kib * 1024, (
        f"{what}: peak RSS {small.kib} KiB at {small_files:,} files, {large.kib} KiB at {large_files:,} files: "
        f"{growth / grown:.0f} bytes a file (bound {per_file})")


def synth_llmd(root: Path, blocks: int) -> None:
    """An llm-d TP=2 MLA tree of `blocks` block keys (2 x blocks files of 4 KiB)."""
    subprocess.run([sys.executable, "-m", "kvmigrate", "synth", str(root), "--family", "llmd", "--tp", "2",
                    "--kv-kind", "mla", "--layers", "4", "--block-bytes", "1024", "--blocks", str(blocks),
                    "--seed", "1"], check=True, capture_output=True)


LIFECYCLE = ("scan", "report", "migrate_dry", "migrate_apply", "scan_after", "report_after", "report_json",
             "report_diff", "explain", "audit", "audit_baseline", "verify", "prune_dry", "prune_apply", "restore",
             "rollback_list", "rollback_dry", "rollback", "migrate_again", "prune_scan_apply", "scan_again",
             "report_runs", "purge")


def lifecycle_steps(work: Path, root: Path) -> list[tuple[str, list]]:
    """(name, kvmigrate arguments) of every command an operator runs on the tree ROOT, in
    LIFECYCLE's order: scan, report, migrate, audit, verify, prune, restore, rollback, migrate
    again, prune from its own scan, report again (several runs' journals), purge (manifests
    in WORK). scripts/bench.py's memory group runs the same list."""
    source = next(p.name for p in sorted(root.iterdir()) if p.name.endswith("_r0"))[:-len("_r0")]
    journals = root / ".kvmigrate" / "journals"
    steps: list[tuple[str, list]] = [
        ("scan", ["scan", root, "-o", work / "m1.parquet", "--verify", "size", *FACTS]),
        ("report", ["report", work / "m1.parquet"]),
        ("migrate_dry", ["migrate", "--manifest", work / "m1.parquet"]),
        ("migrate_apply", ["migrate", "--manifest", work / "m1.parquet", "--apply"]),
        ("scan_after", ["scan", root, "-o", work / "m2.parquet", "--verify", "size", *FACTS]),
        ("report_after", ["report", work / "m2.parquet"]),
        ("report_json", ["report", work / "m2.parquet", "--format", "json"]),
        ("report_diff", ["report", work / "m2.parquet", "--diff", work / "m1.parquet"]),
        ("explain", ["explain", work / "m2.parquet", source]),
        ("audit", ["audit", root, "--verify", "hash", "--keep", "3", *FACTS]),
        ("audit_baseline", ["audit", root, "--verify", "hash", "--baseline", "auto", "--keep", "3", *FACTS]),
        ("verify", ["verify", root, "--journal", journals]),
        ("prune_dry", ["prune", root, "--manifest", work / "m2.parquet", "--quiet-period", "0s"]),
        ("prune_apply", ["prune", root, "--manifest", work / "m2.parquet", "--quiet-period", "0s", "--apply"]),
        ("restore", ["restore", journals / "prune"]),
        ("rollback_list", ["rollback", journals, "--dry-run", "--list"]),
        ("rollback_dry", ["rollback", journals, "--dry-run"]),
        ("rollback", ["rollback", journals]),
        ("migrate_again", ["migrate", "--manifest", work / "m1.parquet", "--apply"]),
        ("prune_scan_apply", ["prune", root, "--quiet-period", "0s", "--apply", *FACTS]),
        ("scan_again", ["scan", root, "-o", work / "m3.parquet", "--verify", "size", *FACTS]),
        ("report_runs", ["report", work / "m3.parquet"]),  # names the unfinished runs: reads every journal
        ("purge", ["prune", root, "--purge", "--older-than", "0s", "--apply"]),
    ]
    assert tuple(name for name, _ in steps) == LIFECYCLE
    return steps


def lifecycle_peaks(work: Path, blocks: int) -> dict[str, Peak]:
    """Each command's peak over a lifecycle of one tree (lifecycle_steps)."""
    work.mkdir(parents=True, exist_ok=True)
    root = work / "root"
    synth_llmd(root, blocks)
    return {name: peak_rss(args, work) for name, args in lifecycle_steps(work, root)}
