"""Before/after benchmark in one run: `scripts/bench.py --before REV [--after REV2]`.

Installs each revision into its own venv (`git archive` of the commit, `python -m venv`,
`pip install .`, which builds the C leaf walk; the install is refused when it did not),
builds the trees once, then times every kvmigrate figure of the selected groups with both
installs on the same warm trees. Each figure's two commands alternate every repetition
(old, new, then new, old ...), so machine noise and page-cache drift hit both alike.
Writes BEFORE_AFTER.md and before_after.json (default reports/redesign/): per figure the
old median, the new median, new/old and PASS when new/old <= 1.05 (issue 17: "no figure
more than 5% slower"). The peers of bench.py (find, xxhsum, cp ...) are not run: they do
not change between revisions.

Both sides are installed the same way (non-editable, from the commit, not the working
tree), and cached under --install-dir by commit (~210 MB each, mostly pyarrow; remove a
commit's folder to reclaim it), so a second run of the same commits starts timing at once.
`--self-check` checks the ratio and verdict arithmetic on given timings and exits.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from . import trees
from .core import Bench
from .harness import DEFAULT_WORKDIR, FACTS, REPORTS, Command, Group, q, rmtree, run_group, run_measured, tail
from .installs import git, install, resolve
from .rendering import write_json
from .trees import GROUP_TREES, warm

LIMIT = 1.05  # new/old at most this: "no figure more than 5% slower"
# blocks per tree (files = 2 x blocks): small is a quick try, normal is bench.py's small
# trees (its migrate group takes most of the time: 25,000 links a repetition), large its large
SCALES = {"small": {"files4k": 6_000, "files1m": 64}, "normal": trees.SCALES["small"], "large": trees.SCALES["large"]}
GROUPS = ("startup", "meta", "hash4k", "hash1m", "report", "migrate")
DEFAULT_INSTALLS = DEFAULT_WORKDIR / "installs"


# --------------------------------------------------------------------------- the verdict

def verdict(old_walls: list[float], new_walls: list[float], limit: float = LIMIT) -> dict:
    """Medians, new/old and PASS (new/old <= limit) or FAIL; "no data" when a side has no run."""
    if not old_walls or not new_walls:
        return {"old_median_s": None, "new_median_s": None, "ratio": None, "result": "no data"}
    old, new = statistics.median(old_walls), statistics.median(new_walls)
    ratio = new / old if old > 0 else float("inf")
    return {"old_median_s": round(old, 4), "new_median_s": round(new, 4), "ratio": round(ratio, 4),
            "result": "PASS" if ratio <= limit else "FAIL"}


def overall(figures: list[dict]) -> str:
    """PASS only when every figure was measured on both sides and passed (an "error" or
    "no data" figure makes the run incomplete, a FAIL makes it FAIL)."""
    results = [f["result"] for f in figures]
    if not results:
        return "no figures"
    if all(r == "PASS" for r in results):
        return "PASS"
    return "FAIL" if "FAIL" in results else "incomplete"


def self_check() -> int:
    """The report's arithmetic on given timings (no trees, no installs)."""
    cases = [
        (([1.0, 1.0, 1.0], [1.05, 1.05, 1.05]), (1.05, "PASS")),    # exactly 5% slower still passes
        (([2.0, 2.0], [2.2, 2.1]), (1.075, "FAIL")),                  # median of an even count: 2.15
        (([1.0, 3.0, 2.0], [1.9]), (0.95, "PASS")),                   # faster
        (([4.0, 4.0, 100.0], [4.1, 4.2, 4.0]), (1.025, "PASS")),      # one outlier moves no median
        (([0.0], [0.1]), (float("inf"), "FAIL")),
        (([], [1.0]), (None, "no data")),
    ]
    bad = []
    for (old, new), (ratio, result) in cases:
        v = verdict(old, new)
        if v["result"] != result or v["ratio"] != (round(ratio, 4) if ratio is not None else None):
            bad.append(f"verdict({old}, {new}) = {v}, expected ratio {ratio} {result}")
    for results, want in ((["PASS", "PASS"], "PASS"), (["PASS", "FAIL"], "FAIL"),
                          (["PASS", "no data"], "incomplete"), (["error", "PASS"], "incomplete"),
                          ([], "no figures")):
        got = overall([{"result": r} for r in results])
        if got != want:
            bad.append(f"overall({results}) = {got}, expected {want}")
    row = render_row({"label": "x", "tree": "t", "old": {"runs": [1, 1]}, "new": {"runs": [1, 1]},
                      **verdict([1.0, 1.0], [1.2, 1.2]), "same_answer": True})
    if "1.200x" not in row or "FAIL" not in row:
        bad.append(f"render_row shows {row!r}, expected 1.200x and FAIL")
    for line in bad:
        print(f"self-check: {line}", file=sys.stderr)
    total = len(cases) + 6
    print(f"self-check: {total - len(bad)} of {total} checks pass")
    return 1 if bad else 0



# --------------------------------------------------------------------------- figures

def report_group(bench: Bench) -> Group:
    """`report` of a hash-level manifest of the 4 KiB tree (written untimed by the same
    install: each revision reads its own manifest format) and `audit ROOT` (scan + report)."""
    root = bench.tree_root("files4k")
    manifest = bench.out / "report_source.parquet"
    err = bench.out / "report_source.stderr"
    r = run_measured([bench.kvm, "scan", str(root), "--verify", "hash", "-q", "-o", str(manifest), *FACTS],
                       stderr=str(err))
    ok, why = (True, "") if r.rc in (0, 1) else (False, f"the scan that makes its manifest failed: {tail(err)}")
    cmds = [
        Command("report_text", "kvmigrate report M(hash)", [bench.kvm, "report", str(manifest), "-q"],
                  "kvmigrate", ok_rcs=(0, 1), stdout=str(bench.out / "report.txt"), available=ok,
                  why_unavailable=why),
        Command("report_json", "kvmigrate report M(hash) --format json",
                  [bench.kvm, "report", str(manifest), "--format", "json", "-q"], "kvmigrate", ok_rcs=(0, 1),
                  stdout=str(bench.out / "report.json"), available=ok, why_unavailable=why),
        Command("audit_size", "kvmigrate audit ROOT --verify size",
                  [bench.kvm, "audit", str(root), "--verify", "size", "-q", *FACTS], "kvmigrate", ok_rcs=(0, 1),
                  stdout=str(bench.out / "audit.txt")),
    ]
    return Group("report", "Reports (4 KiB-file tree)", "files4k", cmds, [])


def startup_group(bench: Bench) -> Group:
    cmds = [Command("help", "kvmigrate --help", [bench.kvm, "--help"], "kvmigrate"),
            # -I: not the working folder's checkout on sys.path, only the install's
            Command("import_scan", "python -I -c 'import kvmigrate.scan'",
                      [bench.kvm_python, "-I", "-c", "import kvmigrate.scan"], "kvmigrate")]
    return Group("startup", "Start-up", "", cmds, [])


def build_group(bench: Bench, key: str) -> Group:
    builders = {"startup": startup_group, "meta": Bench.group_meta, "migrate": Bench.group_migrate,
                "hash4k": lambda b: b.group_hash("hash4k", "files4k"),
                "hash1m": lambda b: b.group_hash("hash1m", "files1m"), "report": report_group}
    return builders[key](bench)


def same_answer(old: dict, new: dict) -> tuple[bool | None, list[str]]:
    """Whether both installs reported the same facts (statuses, actions, outcomes, exit code)."""
    if not old or not new:
        return None, []
    keys = sorted(set(old) | set(new))
    diff = [k for k in keys if old.get(k) != new.get(k)]
    return not diff, diff


# --------------------------------------------------------------------------- the run

class Compare:
    def __init__(self, args: Any):
        self.args = args
        self.started = time.time()
        self.loadavg_start = [round(x, 2) for x in os.getloadavg()]
        self.log_lines: list[str] = []
        self.cache = Path(args.install_dir or DEFAULT_INSTALLS).resolve()
        self.sides = {"old": resolve(args.before), "new": resolve(args.after)}
        self.groups = [g.strip() for g in args.only.split(",")] if args.only else list(GROUPS)
        unknown = sorted(set(self.groups) - set(GROUPS))
        if unknown:
            sys.exit(f"bench: unknown group(s) {', '.join(unknown)} for --before; known: {', '.join(GROUPS)}")
        if args.workdir is None:
            args.workdir = str(DEFAULT_WORKDIR / f"{args.scale}-before-after")
        self.benches: dict[str, Bench] = {}
        self.figures: list[dict] = []

    def log(self, msg: str) -> None:
        line = f"[{time.time() - self.started:7.1f}s] {msg}"
        self.log_lines.append(line)
        print(line, flush=True)

    def run(self) -> dict:
        self.cache.mkdir(parents=True, exist_ok=True)
        for tag, side in self.sides.items():
            exe = install(side, self.cache, self.log)
            bench = Bench(_with(self.args, kvmigrate=exe, only=",".join(self.groups), scale="small"))
            bench.scale = self.args.scale
            sizes = SCALES[self.args.scale]  # the trees of the compared groups (no flat directory)
            bench.specs = {name: dataclasses.replace(spec, blocks=sizes[name])
                           for name, spec in bench.specs.items() if name in sizes and name != "flat"}
            bench.out = bench.workdir / f"out-{tag}"
            bench.log = self.log
            self.benches[tag] = bench
        new = self.benches["new"]
        machine = new.machine()
        space = new.check_space()
        for b in self.benches.values():
            b.out.mkdir(parents=True, exist_ok=True)
        pair_out = new.workdir / "out-pairs"
        pair_out.mkdir(parents=True, exist_ok=True)
        need = {GROUP_TREES.get(g, "files4k") for g in self.groups if g != "startup"}
        trees = {name: new.build_tree(new.specs[name]) for name in sorted(need)}
        for name in sorted(need):
            self.log(f"tree {name}: warm-up pass {warm(new.tree_root(name)):.1f} s")
        for key in self.groups:
            self.run_group(key, pair_out)
        result = {
            "schema": 1, "generated_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": "python3 scripts/bench.py " + " ".join(q(a) for a in sys.argv[1:]),
            "scale": self.args.scale, "reps": self.args.reps, "startup_runs": self.args.startup_runs,
            "settle_s": self.args.settle,
            "limit": LIMIT, "duration_s": round(time.time() - self.started, 1),
            "old": self.sides["old"], "new": self.sides["new"],
            "code_commits_between": git("log", "--oneline", "--no-merges", "--format=%h %s",
                                        f"{self.sides['old']['commit']}..{self.sides['new']['commit']}",
                                        "--", "kvmigrate", "setup.py", "pyproject.toml").splitlines(),
            "machine": {**{k: machine[k] for k in ("cpu_model", "cores", "mem_total_bytes", "kernel", "os",
                                                     "workdir_fs", "workdir_mount_options")},
                        "python": self.sides["new"].get("python"), "affinity_cores": len(os.sched_getaffinity(0)),
                        "loadavg_at_start": self.loadavg_start, "python_packages_new": machine["python_packages"]},
            "space": space,
            "trees": {n: {"files": t["counts"]["files"], "bytes": t["counts"]["bytes"], "dirs": t["counts"]["dirs"],
                          "spec": t["spec"], "reused": t["reused"]} for n, t in trees.items()},
            "figures": self.figures, "overall": overall(self.figures),
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
            "uncommitted_under_kvmigrate": machine["git_uncommitted_under_kvmigrate"],
        }
        return result

    def run_group(self, key: str, pair_out: Path) -> None:
        groups = {tag: build_group(b, key) for tag, b in self.benches.items()}
        tree = groups["new"].tree
        if tree:  # again, untimed: the page cache drifts while other groups run
            self.log(f"group {key}: warming {tree} again ({warm(self.benches['new'].tree_root(tree)):.1f} s)")
        reps = self.args.startup_runs if key == "startup" else \
            (self.args.migrate_reps or self.args.reps) if key == "migrate" else self.args.reps
        olds = {c.key: c for c in groups["old"].commands if c.kind == "kvmigrate"}
        for cmd_new in (c for c in groups["new"].commands if c.kind == "kvmigrate"):
            cmd_old = olds.get(cmd_new.key)
            if cmd_old is None:
                continue
            figure_key, label = cmd_new.key, cmd_new.label
            for tag, c in (("old", cmd_old), ("new", cmd_new)):
                c.key, c.label = f"{tag}_{figure_key}", f"{tag}: {label}"
            pair = Group(figure_key, label, tree, [cmd_old, cmd_new], [])
            load = [round(x, 2) for x in os.getloadavg()]
            self.log(f"figure {figure_key}: {label}, {reps} reps each, alternating old/new")
            if cmd_old.available and cmd_new.available:
                # its rotation of 2 commands alternates them
                run_group(pair, reps, self.log, pair_out, self.args.settle)
            same, diff = same_answer(cmd_old.facts, cmd_new.facts)
            fig = {"key": figure_key, "group": key, "label": label, "tree": tree, "reps": reps,
                   "loadavg_before": load, "old": cmd_old.summary(), "new": cmd_new.summary(),
                   **verdict([r.wall_s for r in cmd_old.runs], [r.wall_s for r in cmd_new.runs]),
                   "same_answer": same, "facts_differ": diff}
            for c in (cmd_old, cmd_new):
                if not c.available:
                    fig.setdefault("errors", []).append(f"{c.key}: not available: {c.why_unavailable}")
                if c.error:
                    fig.setdefault("errors", []).append(f"{c.key}: {c.error}")
            if fig.get("errors"):  # a side that failed or was skipped is not a measurement
                fig["result"] = "error"
            self.figures.append(fig)
            self.log(f"figure {figure_key}: old {fig['old_median_s']} s, new {fig['new_median_s']} s, "
                     f"new/old {fig['ratio']}: {fig['result']}")


def _with(args: Any, **changes: Any) -> Any:
    copy = type(args)(**vars(args))
    for k, v in changes.items():
        setattr(copy, k, v)
    return copy


# --------------------------------------------------------------------------- the report

def _s(v: float | None) -> str:
    return "—" if v is None else f"{v:.3f}"


def render_row(f: dict) -> str:
    digits = 4 if f["ratio"] is not None and round(f["ratio"], 3) == LIMIT else 3  # 1.0502x FAIL, not 1.050x
    ratio = "—" if f["ratio"] is None else f"{f['ratio']:.{digits}f}x"
    same = {True: "yes", False: "NO: " + ", ".join(f.get("facts_differ", [])), None: "—"}[f["same_answer"]]
    spread = " / ".join(
        f"{min(r['wall_s'] for r in f[t]['runs']):.3f}–{max(r['wall_s'] for r in f[t]['runs']):.3f}"
        if f[t].get("runs") and isinstance(f[t]["runs"][0], dict) else "—" for t in ("old", "new"))
    return (f"| {f['label']} | {f.get('tree') or '—'} | {_s(f['old_median_s'])} | {_s(f['new_median_s'])} | "
            f"{ratio} | **{f['result']}** | {cpu_ratio(f)} | {spread} | {same} |")


def cpu_ratio(f: dict) -> str:
    """new/old of the median user + system time: a second view, less moved than wall time
    by other processes competing for the cores (the verdict stays on wall time)."""
    try:
        old, new = (f[t]["median_user_s"] + f[t]["median_sys_s"] for t in ("old", "new"))
    except KeyError:
        return "—"
    return f"{new / old:.3f}x" if old > 0 else "—"


def render(res: dict) -> str:
    L: list[str] = []
    add = L.append
    old, new, m = res["old"], res["new"], res["machine"]
    worst = max((f for f in res["figures"] if f["ratio"] is not None), key=lambda f: f["ratio"], default=None)
    add(f"# Before/after in one run: {old['commit'][:7]} (old) against {new['commit'][:7]} (new)")
    add("")
    add(f"Generated {res['generated_utc']} by `{res['command']}` in {res['duration_s'] / 60:.1f} min.")
    add("")
    add(f"- **old** (before): `{old['commit']}` {old['subject']} ({old['date']})")
    add(f"- **new** (after): `{new['commit']}` {new['subject']} ({new['date']})")
    add(f"- **Result: {res['overall']}** — a figure passes when new/old <= {res['limit']:.2f} (no figure more "
        f"than {round((res['limit'] - 1) * 100)}% slower)"
        + (f"; the slowest is {worst['label']} at {worst['ratio']:.3f}x." if worst else "."))
    if res.get("uncommitted_under_kvmigrate"):
        add(f"- The checkout had uncommitted changes under kvmigrate/ "
            f"({', '.join(res['uncommitted_under_kvmigrate'])}): not measured, both sides are commits.")
    add("")
    add("| figure | tree | old median s | new median s | new/old | verdict | new/old CPU | old / new min–max s "
        "| same answer |")
    add("|---|---|---:|---:|---:|---|---:|---|---|")
    for f in res["figures"]:
        add(render_row(f))
    errors = [(f["label"], e) for f in res["figures"] for e in f.get("errors", [])]
    if errors:
        add("")
        for label, e in errors:
            add(f"- **{label}**: `{e}`")
    add("")
    add("## Method")
    add("")
    add("Each revision is installed into its own venv from its commit (`git archive`, `python -m venv`, "
        "`pip install .`, which builds the C leaf walk; both run it: "
        f"old `{old.get('leaf_walk')}`, new `{new.get('leaf_walk')}`). The trees are built once (by the new "
        "install's `kvmigrate synth`) and warmed; each figure then runs the old and the new command "
        f"{res['reps']} times each (start-up: {res['startup_runs']}), alternating which goes first every "
        "repetition, on the same warm tree. Each install writes and reads its own manifests (report, "
        "migrate --manifest). Migrate repetitions start from the legacy tree alone (the created targets are "
        f"deleted, untimed, then up to {res.get('settle_s', 0):g} s of waiting for the disk to go quiet: the "
        "deletes' discards land in no later command's time). *Same answer*: both installs reported the same "
        "statuses, actions, outcomes and "
        "exit code. Times are wall-clock medians (the verdict); *new/old CPU* is the ratio of the median user + "
        "system times, a second view less moved by other processes on the cores; per-run user/sys time and "
        "peak RSS are in the JSON.")
    add("")
    add("## Machine and trees")
    add("")
    add(f"- {m['cpu_model']}, {m['cores']} cores ({m['affinity_cores']} usable), "
        f"{(m['mem_total_bytes'] or 0) / 2**30:.1f} GiB; kernel {m['kernel']}; {m['os']}; Python {m['python']}")
    add(f"- load average at start: {', '.join(str(x) for x in m['loadavg_at_start'])}, at end: "
        f"{', '.join(str(x) for x in res.get('loadavg_at_end', []))} (1, 5, 15 min); "
        f"workdir on {m['workdir_fs']} ({m['workdir_mount_options']})")
    for name, t in res["trees"].items():
        add(f"- tree `{name}`: {t['files']:,} files, {t['bytes'] / 2**20:,.0f} MiB, {t['dirs']:,} folders "
            f"(llm-d TP={t['spec']['tp']} MLA, {t['spec']['layers']} layers of {t['spec']['page_bytes']:,} B)")
    add(f"- scale `{res['scale']}`, {res['reps']} repetitions per side per figure")
    add("")
    add(f"## Code commits between old and new ({len(res['code_commits_between'])}, touching kvmigrate/, "
        "setup.py or pyproject.toml)")
    add("")
    for line in res["code_commits_between"]:
        add(f"- {line[:200]}")
    add("")
    return "\n".join(L)


def main(args: Any) -> int:
    out_dir = Path(args.out_dir or REPORTS / "redesign").resolve()
    args.out_dir = str(out_dir)  # the benches' stderr files go beside the report (Bench needs one)
    cmp = Compare(args)
    try:
        result = cmp.run()
    except KeyboardInterrupt:
        print(f"bench: interrupted; trees and outputs left in {args.workdir}", file=sys.stderr)
        return 32
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "before_after.json", result)
    (out_dir / "BEFORE_AFTER.md").write_text(render(result))
    cmp.log(f"wrote {out_dir / 'BEFORE_AFTER.md'} and before_after.json ({result['overall']})")
    if not args.keep:
        rmtree(Path(args.workdir))
        cmp.log(f"removed {args.workdir} (--keep reuses the trees; the installs stay in {cmp.cache})")
    for f in result["figures"]:
        print(f"  {f['result']:>8}  {f['ratio'] if f['ratio'] is not None else '—':>6}  {f['label']}")
    return 0 if result["overall"] == "PASS" else 1
