"""The baseline group: audit --verify hash --baseline auto of an unchanged tree against
find -printf and the full hash audit, with the bytes each reads."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
from pathlib import Path

from .core import Bench
from .harness import DEFAULT_WORKDIR, FACTS, Command, Group, Run, capture, drop_page_cache, q, rmtree, run_group, run_measured, sh
from .trees import TreeSpec, fs_free, warm

MANIFEST_FACTS = ("import json, sys, pyarrow.compute as pc\n"
                  "from kvmigrate.manifest import read_table\n"
                  "t = read_table(sys.argv[1], columns=['carried', 'status'])\n"
                  "s = pc.value_counts(pc.cast(t['status'], 'string')).to_pylist()\n"
                  "print(json.dumps({'rows': t.num_rows, 'carried': pc.sum(pc.cast(t['carried'], 'int64')).as_py() "
                  "or 0, 'by_status': {d['values']: d['counts'] for d in s}}))\n")



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
    for f in one_process.values():
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
