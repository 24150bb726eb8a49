"""The journal group: journal bytes per linked block and rollback time against a revision
and the floors of plain tools."""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import shlex
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from .harness import DEFAULT_WORKDIR, FACTS, REPO, Run, q, rep_order, rmtree, run_measured, sh
from .installs import before_kvmigrate
from .trees import TreeSpec

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
