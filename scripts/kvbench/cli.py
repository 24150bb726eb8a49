"""scripts/bench.py's command line: the options, and which run each asks for."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from pathlib import Path
from typing import Any

from .baseline import run_baseline_group
from .compare import main as compare_main
from .compare import self_check
from .core import Bench
from .harness import DEFAULT_WORKDIR, REPORTS, rmtree
from .journal import run_journal_group
from .lmcache import render_lmcache, run_lmcache_group
from .memory import check_space as memory_check_space
from .memory import memory_sizes, run_memory_group
from .memory import space_needed as memory_space_needed
from .mooncake import render_mooncake, run_mooncake_group
from .prune import run_prune_group
from .rendering import memory_runs, render, render_journal, render_prune_only, write_json
from .runner import run
from .trees import SCALES, expected_dirs, warm


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
                                  "scale and baseline,journal,prune,memory (run after the others; each alone merges "
                                  "into the --out-dir's report); lmcache alone (LMCACHE.md of its own); mooncake alone "
                                  "(MOONCAKE.md of its own)")
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
    p.add_argument("--memory-files", metavar="N,N,N",
                   help="memory group: files of its trees, comma-separated (default 20000,60000,120000 at --scale "
                        "small, 100000,1000000,3000000 at large); each tree is built, measured and removed in turn")
    p.add_argument("--memory-steps", metavar="NAME,NAME",
                   help="memory group: only these lifecycle commands (tests/helpers/memory.py LIFECYCLE), run in "
                        "its order, e.g. the 10M-file run's scan,migrate_apply,scan_after,report_after,verify,"
                        "prune_dry,prune_apply,restore,rollback (a step needs the outputs of the steps it follows)")
    p.add_argument("--memory-baselines-up-to", type=int, metavar="FILES",
                   help="memory group: run `find` and `cp -al` of the tree only at sizes of at most FILES files "
                        "(default: every size); at 10M files `cp -al` alone is a quarter of an hour")
    p.add_argument("--memory-run-name", metavar="NAME",
                   help="memory group: keep this run beside the group's three-size run, as benchmarks.json "
                        "`memory_NAME` and a section of its own (e.g. 10m: the 10M-file run); default: the group's "
                        "run, `memory`")
    p.add_argument("--baseline-files", type=int, default=1_000_000,
                   help="baseline group: files of 4 KiB in its tree (default 1,000,000)")
    p.add_argument("--rmlint-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="cold groups: stop rmlint after this long (its time is then a lower bound; default 600)")
    p.add_argument("--baseline-cold", action="store_true",
                   help="baseline group: drop the page cache before each timed command (root; default: warm)")
    p.add_argument("--lmcache-chunks", type=int, default=128, metavar="N",
                   help="lmcache group: chunks of the reshard tier (Llama-3.1-8B, 256 tokens, TP 2: 32 MiB a chunk; "
                        "default 128)")
    p.add_argument("--lmcache-scan-chunks", type=int, default=1_000_000, metavar="N",
                   help="lmcache group: chunk files of the fs tier it scans (default 1,000,000)")
    p.add_argument("--lmcache-reps", type=int, default=3, metavar="N",
                   help="lmcache group: repetitions of each command (the cold scan runs once; default 3)")
    p.add_argument("--lmcache-warm-only", action="store_true",
                   help="lmcache group: leave out the cold runs (which drop the page cache: root)")
    p.add_argument("--mooncake-objects", type=int, default=1_000_000, metavar="N",
                   help="mooncake group: objects of the store it scans and rekeys, 500 a pair (default 1,000,000)")
    p.add_argument("--mooncake-reps", type=int, default=3, metavar="N",
                   help="mooncake group: repetitions of each command (the cold runs run once; default 3)")
    p.add_argument("--mooncake-warm-only", action="store_true",
                   help="mooncake group: leave out the cold runs (which drop the page cache: root)")
    p.add_argument("--kvmigrate", help="the kvmigrate executable (default: /work/venv/bin/kvmigrate or PATH)")
    p.add_argument("--out-dir", help="where BENCHMARKS.md and benchmarks.json go (default reports/; "
                                      "with --before: reports/redesign/)")
    p.add_argument("--before", "--compare", metavar="REV",
                   help="before/after in one run (scripts/kvbench/compare.py): install REV and --after into their "
                        "own venvs and time every kvmigrate figure with both, alternating; writes "
                        "BEFORE_AFTER.md and before_after.json; exit 1 when a figure is more than 5%% slower")
    p.add_argument("--after", metavar="REV", default="HEAD", help="the new side of --before (default HEAD)")
    p.add_argument("--install-dir", help=f"where --before keeps its installs by commit (default "
                                         f"{DEFAULT_WORKDIR}/installs)")
    p.add_argument("--self-check", action="store_true",
                   help="check the before/after report's ratios and verdicts on given timings, then exit")
    p.add_argument("--force", action="store_true", help="run even if the space check says it will not fit")
    p.add_argument("--render-only", action="store_true",
                   help="rewrite BENCHMARKS.md from the benchmarks.json in --out-dir (with --only lmcache: LMCACHE.md "
                        "from lmcache.json; --only mooncake: MOONCAKE.md from mooncake.json), run nothing")
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



def group_only(args: argparse.Namespace, bench: Bench, name: str, measure: Any, render_page: Any) -> int:
    """`--only <name>` of a group with a report of its own: <NAME>.md and <name>.json in
    --out-dir (the other reports untouched), its trees in <workdir>/<name>."""
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bench.workdir = Path(args.workdir or DEFAULT_WORKDIR / name).resolve()
    bench.workdir.mkdir(parents=True, exist_ok=True)
    machine = bench.machine()
    try:
        group = measure(args, bench)
    except KeyboardInterrupt:
        print(f"bench: interrupted; trees left in {bench.workdir}", file=sys.stderr)
        return 32
    result = {"machine": machine, name: group}
    write_json(out / f"{name}.json", result)
    (out / f"{name.upper()}.md").write_text(render_page(result))
    bench.log(f"wrote {out / (name.upper() + '.md')} and {name}.json")
    return 0


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
    (out / "BENCHMARKS.md").write_text(render(result, out))
    bench.log(f"wrote {out / 'BENCHMARKS.md'} and benchmarks.json")
    for t in baseline["targets"]:
        print(f"  {t['result']:>6}  {t['target']}: {t['figure']}")
    if not args.keep:
        bench.log(f"removing {bench.workdir} (use --keep to reuse the tree)")
        rmtree(bench.workdir)
    return 0


def memory_only(args: argparse.Namespace, bench: Bench) -> int:
    """`--only memory`: merged into the --out-dir's report (a full one, or a prune group's
    page of its own), else a page of its own; --check-space prints the space check only."""
    sizes = memory_sizes(args)
    workdir = Path(args.workdir or DEFAULT_WORKDIR / "memory").resolve()
    if args.check_space:
        for files in sizes:
            need = memory_space_needed(files)
            print(f"memory-{files}: {files:,} files of 4,096 B, ~{need['bytes'] / 2**30:.2f} GiB and "
                  f"~{need['inodes']:,} inodes at its peak")
        memory_check_space(workdir, sizes, args.force, bench.log)
        return 0
    out = Path(args.out_dir)
    path = out / "benchmarks.json"
    result = json.loads(path.read_text()) if path.is_file() else None
    bench.workdir = workdir
    machine = bench.machine()
    if result is None or "machine" not in result:
        result = {"machine": machine}

    key = f"memory_{args.memory_run_name}" if args.memory_run_name else "memory"

    def save(memory: dict) -> None:
        out.mkdir(parents=True, exist_ok=True)
        result[key] = {**memory, "name": args.memory_run_name} if args.memory_run_name else memory
        write_json(path, result)
        (out / "BENCHMARKS.md").write_text(render(result, out) if "targets" in result else render_prune_only(result))

    try:
        save(run_memory_group(args, bench, bench.log, save))
    except KeyboardInterrupt:
        print(f"bench: interrupted; trees left in {workdir}; the figures so far are in {out}", file=sys.stderr)
        return 32
    bench.log(f"wrote {out / 'BENCHMARKS.md'} and benchmarks.json")
    if not args.keep:
        rmtree(workdir)
    return 0


def render_journal_only(result: dict) -> str:
    lines = ["# kvmigrate journal and rollback benchmark", "", "Raw figures: [`benchmarks.json`](benchmarks.json)."]
    render_journal(result["journal"], lines.append)
    return "\n".join(lines) + "\n"


def render_any(result: dict, out: Path) -> str:
    """--render-only: the page the run that wrote `result` rendered (a journal-only or
    prune-only run writes a report of its own, without the scan groups' figures)."""
    if "generated_utc" in result:
        return render(result, out)
    if set(result) == {"journal"}:
        return render_journal_only(result)
    if "prune" in result or memory_runs(result):
        return render_prune_only(result)
    raise SystemExit(f"{out / 'benchmarks.json'}: not a benchmark report this bench renders")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.self_check or args.before:
        return self_check() if args.self_check else compare_main(args)
    args.out_dir = args.out_dir or str(REPORTS)
    if args.render_only and args.only and args.only.strip() == "lmcache":
        out = Path(args.out_dir)
        (out / "LMCACHE.md").write_text(render_lmcache(json.loads((out / "lmcache.json").read_text())))
        print(f"wrote {out / 'LMCACHE.md'}")
        return 0
    if args.render_only and args.only and args.only.strip() == "mooncake":
        out = Path(args.out_dir)
        (out / "MOONCAKE.md").write_text(render_mooncake(json.loads((out / "mooncake.json").read_text())))
        print(f"wrote {out / 'MOONCAKE.md'}")
        return 0
    if args.render_only:
        out = Path(args.out_dir)
        (out / "BENCHMARKS.md").write_text(render_any(json.loads((out / "benchmarks.json").read_text()), out))
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
            (out / "BENCHMARKS.md").write_text(render_journal_only({"journal": journal}))
            bench.log(f"wrote {out / 'BENCHMARKS.md'} and benchmarks.json")
            return 0
        result["journal"] = journal
        write_json(path, result)
        (out / "BENCHMARKS.md").write_text(render(result, out))
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
            text = render(result, out)
        write_json(path, result)
        (out / "BENCHMARKS.md").write_text(text)
        bench.log(f"wrote {out / 'BENCHMARKS.md'} and benchmarks.json")
        if not args.keep:  # (after the figures are written: removing the target's tree takes minutes)
            rmtree(bench.workdir)
        return 0
    if args.only and args.only.strip() == "memory":  # merged into the existing report, or a page of its own
        return memory_only(args, bench)
    if args.only and args.only.strip() == "lmcache":  # LMCACHE.md and lmcache.json of their own
        return group_only(args, bench, "lmcache", run_lmcache_group, render_lmcache)
    if args.only and args.only.strip() == "mooncake":  # MOONCAKE.md and mooncake.json of their own
        if args.mooncake_objects < 1:
            sys.exit("bench: --mooncake-objects must be at least 1")
        return group_only(args, bench, "mooncake", run_mooncake_group, render_mooncake)
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
        (out / "BENCHMARKS.md").write_text(render(result, out))
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
        result = run(bench)
    except KeyboardInterrupt:
        print(f"bench: interrupted; trees and outputs left in {bench.workdir}", file=sys.stderr)
        return 32
    bench.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(bench.out_dir / "benchmarks.json", result)
    (bench.out_dir / "BENCHMARKS.md").write_text(render(result, bench.out_dir))
    bench.log(f"wrote {bench.out_dir / 'BENCHMARKS.md'} and benchmarks.json")
    if not args.keep:
        bench.log(f"removing {bench.workdir} (slow for the large trees, especially with the `discard` mount option)")
        rmtree(bench.workdir)
        bench.log(f"removed {bench.workdir} (use --keep to reuse the trees)")
    for t in result["targets"]:
        print(f"  {t['result']:>12}  {t['target']}: {t['figure']}")
    return 0
