"""A full run: trees built and warmed, every wanted group timed, then baseline, journal
and prune; the result the report renders."""

from __future__ import annotations

import copy
import datetime as _dt
import os
import sys
import time
from pathlib import Path
from typing import Any

from .baseline import run_baseline_group
from .core import Bench
from .harness import can_drop_caches, q, rmtree, run_group
from .journal import run_journal_group
from .prune import run_prune_group
from .trees import AFTER_GROUPS, COLD_GROUPS, GROUP_TREES, SCALE_TREES, fs_free, residency, walk_counts, warm


def run(bench: Bench) -> dict:
    """The run `bench` was made for: its trees, groups and figures, as benchmarks.json holds them."""
    bench.check_tools()
    argv_line = "python3 scripts/bench.py " + " ".join(q(a) for a in sys.argv[1:])
    machine = bench.machine()
    space = bench.check_space()
    bench.out.mkdir(parents=True, exist_ok=True)
    cold_why = can_drop_caches() if set(COLD_GROUPS) & set(bench.groups_wanted) else ""
    if cold_why:  # never warm figures reported as cold
        skipped = [g for g in bench.groups_wanted if g in COLD_GROUPS]
        bench.notes.append(f"The cold groups ({', '.join(skipped)}) were skipped: {cold_why}.")
        bench.groups_wanted = [g for g in bench.groups_wanted if g not in COLD_GROUPS]
    need_trees = {GROUP_TREES[g] for g in bench.groups_wanted if g in GROUP_TREES}
    if "scale" in bench.groups_wanted:
        need_trees.update(SCALE_TREES)
    if bench.args.profile:
        need_trees.add("files4k")
    for name in sorted(need_trees):
        bench.trees[name] = bench.build_tree(bench.specs[name])
    space["free_bytes_after_build"] = fs_free(bench.workdir)["bytes"]
    space["free_inodes_after_build"] = fs_free(bench.workdir)["inodes"]
    warmth: dict[str, Any] = {}
    for name in sorted(need_trees):
        root = bench.tree_root(name)
        sample = walk_counts(root, seed=7)["sample"]
        before = residency(sample)
        secs = warm(root)
        after = residency(sample)
        warmth[name] = {"resident_fraction_before_warmup": before, "warmup_s": round(secs, 2),
                        "resident_fraction_after_warmup": after, "sample_files": len(sample), "_sample": sample}
        bench.log(f"tree {name}: warm-up pass {secs:.1f} s; sampled pages resident before {before}, after {after}")

    builders = {"meta": bench.group_meta, "hash4k": lambda: bench.group_hash("hash4k", "files4k"),
                "hash1m": lambda: bench.group_hash("hash1m", "files1m"), "migrate": bench.group_migrate,
                "flat": bench.group_flat, "cold4k": lambda: bench.group_cold("cold4k", "files4k"),
                "cold1m": lambda: bench.group_cold("cold1m", "files1m"), "scale": bench.group_scale}
    after_groups = [g for g in bench.groups_wanted if g in AFTER_GROUPS]
    for key in bench.groups_wanted:
        if key == "startup":
            bench.startup = bench.run_startup()
            continue
        if key in AFTER_GROUPS:
            continue
        if key not in builders:
            sys.exit(f"bench: unknown group {key!r}; known: {', '.join([*builders, 'startup', *AFTER_GROUPS])}")
        group = builders[key]()
        bench.log(f"group {key}: {group.title}")
        tree = GROUP_TREES.get(key)
        if key in COLD_GROUPS:
            pass  # run_group drops the page cache before every command
        elif key == "scale":
            for name in SCALE_TREES:
                bench.log(f"tree {name}: warmed before group scale ({warm(bench.tree_root(name)):.1f} s)")
        elif tree in warmth:  # again, untimed: the VM reclaims idle page cache while other groups run
            root = bench.tree_root(tree)
            secs = warm(root)
            warmth[tree].setdefault("rewarm_before_group", {})[key] = {
                "warmup_s": round(secs, 2), "resident_fraction_after": residency(warmth[tree]["_sample"])}
            bench.log(f"tree {tree}: warmed again before group {key} ({secs:.1f} s)")
        group.loadavg["before"] = [round(x, 2) for x in os.getloadavg()]
        for c in group.commands:
            if not c.available:
                bench.log(f"    {c.label}: not available: {c.why_unavailable}")
        reps = bench.args.migrate_reps if key == "migrate" and bench.args.migrate_reps else bench.reps
        group.reps = reps
        if key == "scale":
            reps = min(reps, 2)
            group.reps = reps
        run_group(group, reps, bench.log, bench.out, bench.args.settle, cold=key in COLD_GROUPS)
        group.loadavg["after"] = [round(x, 2) for x in os.getloadavg()]
        bench.groups.append(group)
        free_now = fs_free(bench.workdir)["bytes"]
        space["free_bytes_min_after_a_group"] = min(space.get("free_bytes_min_after_a_group", free_now), free_now)
    if bench.args.profile:
        bench.profile = bench.run_profile()
    for w in warmth.values():
        w["resident_fraction_at_end"] = residency(w.pop("_sample"))
    after = run_after_groups(bench, after_groups)
    space["free_bytes_at_end"] = fs_free(bench.workdir)["bytes"]
    space["free_inodes_at_end"] = fs_free(bench.workdir)["inodes"]

    result = {
        "schema": 1,
        "generated_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "scale": bench.scale, "reps": bench.reps, "command": argv_line,
        "duration_s": round(time.time() - bench.started, 1),
        "machine": machine, "space": space, "trees": bench.trees, "warm": warmth,
        "kvmigrate_threads": bench.args.threads or "default (kvmigrate.scan.parallel.parallelism)",
        "kvmigrate_leaf_walk": bench.leaf_walk(),
        "groups": [bench.group_dict(g) for g in bench.groups],
        "startup": bench.startup,
        "replica_groups": bench.replica_check(),
        "targets": bench.targets(),
        "scale_figures": bench.scale_figures(),
        "profile": bench.profile,
        "notes": bench.notes,
    }
    result.update(after)
    for key in ("baseline",):
        for t in after.get(key, {}).get("targets", []):
            result["targets"].append({**t, "target": f"nightly re-audit: {t['target']}"})
    return result


def run_after_groups(bench: Bench, keys: list[str]) -> dict:
    """baseline, journal and prune in the same run as the other groups (issue 22: one
    run), each as it runs alone; baseline on this run's files4k tree, journal and prune
    on trees of their own in sub-folders of the workdir."""
    out: dict[str, Any] = {}
    workdir, results_out = bench.workdir, bench.out
    for key in keys:
        args = copy.copy(bench.args)
        bench.log(f"group {key}")
        if key == "baseline":
            spec = bench.specs["files4k"]
            args.baseline_files = spec.files
            out["baseline"] = run_baseline_group(args, bench, spec=spec)
            out["baseline"].pop("machine", None)
        elif key == "journal":
            args.workdir = str(workdir / "journal")
            out["journal"] = run_journal_group(args, bench.kvm, bench.log)
        elif key == "prune":
            args.workdir = str(workdir / "prune")
            bench.workdir = Path(args.workdir)
            out["prune"] = run_prune_group(args, bench, bench.log)
            rmtree(Path(args.workdir))
        bench.workdir, bench.out = workdir, results_out
    return out
