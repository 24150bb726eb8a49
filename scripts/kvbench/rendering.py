"""BENCHMARKS.md and benchmarks.json of a run (and of a group run alone)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from .harness import FACTS, REPORTS

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



def group_cmd(group: dict, key: str) -> dict:
    """The command of a measured group by its key."""
    return next(c for c in group["commands"] if c["key"] == key)


def ratio_lines(add: Any, grp: dict, suffix: str = "") -> None:
    """One line per ratio of a warm or cold group: its two commands and the ratio."""
    for r in grp["ratios"]:
        add(f"* {'cold' if grp['cold'] else 'warm'}: **{group_cmd(grp, r['a'])['label']}** / "
            f"{group_cmd(grp, r['b'])['label']} = **{r['ratio']:.2f}x**{suffix}")


def command_rows(add: Any, groups: list[dict], cells: Any) -> None:
    """The rows of one table: per command of each group, warm or cold, the command, median
    and range, then `cells(command)`; or why it was not run."""
    for grp in groups:
        run = "cold" if grp["cold"] else "warm"
        for c in grp["commands"]:
            if "median_s" not in c:
                add(f"| {run} | {c['label']} | {c.get('error') or 'not run'} | | | | | |")
            else:
                add(f"| {run} | {c['label']} | {c['median_s']:.2f} | {c['min_s']:.2f}–{c['max_s']:.2f} | "
                    + " | ".join(cells(c)) + " |")


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


def reports_link(out_dir: str | Path | None) -> str:
    """The prefix that takes a link from a report in `out_dir` to a file of reports/: none
    in reports/ itself or outside it (a report written elsewhere is read there, or copied
    into reports/ later), `../` from a named run's folder under reports/."""
    if out_dir is None:
        return ""
    out = Path(out_dir).resolve()
    if out == REPORTS or REPORTS not in out.parents:
        return ""
    return "../" * len(out.relative_to(REPORTS).parts)


def render(result: dict, out_dir: str | Path | None = None) -> str:
    """BENCHMARKS.md of `result`, to be written into `out_dir` (links to reports/ files follow it)."""
    up = reports_link(out_dir)
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
        "every folder, inode and byte first, and again just before each group: the VM reclaims idle page cache; "
        "page-cache residency is "
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
    for mem in memory_runs(result):  # `--only memory`, merged
        render_memory(mem, add)
    transforms = REPORTS / "TRANSFORMS.md"
    if transforms.is_file():
        add("")
        add("## Transform throughput (slice, concat, relayout) against `cp`")
        add("")
        add("Measured separately by `scripts/bench_transforms.py` (method and full table in "
            f"[TRANSFORMS.md]({up}TRANSFORMS.md)); its results table, copied here:")
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
    baseline = REPORTS / "BASELINE.md"
    if result.get("baseline"):  # `--only baseline`, merged
        render_baseline(result["baseline"], m, add)
    elif baseline.is_file():  # the earlier, separate measure of a --baseline scan
        text = baseline.read_text()
        add("")
        add("## Scheduled audits: `--baseline` on an unchanged tree")
        add("")
        add("Measured separately by the former `scripts/bench_baseline.py` (now `--only baseline`; method in "
            f"[BASELINE.md]({up}BASELINE.md)):")
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



def render_journal(j: dict, add: Any) -> None:
    add("")
    add("## Journal: bytes per block and rollback time (issue 18)")
    add("")
    add(f"{j['tree']}; `migrate --manifest M --apply --journal DIR`, then `sync`, then the timed "
        f"`rollback DIR`; median of {j['reps']} repetitions changing the order of the versions (each goes first "
        "in turn, neighbours "
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
            f"{max(r['rollback_s'] for r in j['versions']['before']['runs'])} s within one run. Almost all of a "
            "rollback is the filesystem's: `rmdir` of the ~100,000 "
            "folders the migration created (ext4 mounted with `discard`: each rmdir waits for the discard of the "
            "folder's freed block, inside the call and under its parent folder's lock: `ext4_evict_inode` -> "
            "`ext4_free_blocks` -> `blkdev_issue_discard`); the new rollback keeps 8 file and 32 folder removals "
            "in flight, reads the journal once and reads no linked block. The apply times "
            "depend on the order: an apply right after a rollback waits for that rollback's writeback.")



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
    """BENCHMARKS.md of a run of the prune or memory group alone (a fresh --out-dir), or of
    both, each run alone into the same folder."""
    m = result["machine"]
    L: list[str] = []
    add = L.append
    alone = [g for g in ("prune", "memory") if result.get(g) or g == "memory" and memory_runs(result)]
    add(f"# kvmigrate benchmarks: the {' and '.join(alone)} group{'s' if len(alone) > 1 else ''}")
    add("")
    add(f"Machine: {m['cpu_model']}, {m['cores']} cores, {m['mem_total_bytes'] / 2**30:.1f} GiB, kernel "
        f"{m['kernel']}, {m['os']}; work folder on {m['workdir_fs']} ({m['workdir_device']}, "
        f"{m['workdir_mount_options']}); Python {m['python']}; kvmigrate at `{m['git_head'].split()[0]}`"
        + (f" (uncommitted: {', '.join(m['git_uncommitted_under_kvmigrate'])})"
           if m["git_uncommitted_under_kvmigrate"] else "") + ". Raw figures: [`benchmarks.json`](benchmarks.json).")
    if result.get("prune"):
        render_prune(result["prune"], add)
    for mem in memory_runs(result):
        render_memory(mem, add)
    return "\n".join(L).rstrip() + "\n"


def memory_runs(result: dict) -> list[dict]:
    """The memory group's runs: its own (`memory`), then the named ones (`memory_NAME`,
    --memory-run-name) by name."""
    return [result[k] for k in sorted(result, key=lambda k: (k != "memory", k))
            if (k == "memory" or k.startswith("memory_")) and isinstance(result[k], dict)]


MEMORY_GOAL_MIB = 1024       # scripts/kvbench/memory.py: GOAL_PEAK_MIB (rendering imports only harness)
MEMORY_GOAL_RATIO = 1.1      # ... GOAL_MARGINAL_RATIO


def render_memory(mem: dict, add: Any) -> None:
    """The memory group's section: per command of the lifecycle, peak RSS and time at each
    size, the peak's growth per file, its projection at 10M files, the marginal time per file."""
    figures = mem["figures"]
    files = [s["files"] for s in mem["sizes"]]
    sizes = " / ".join(f"{n:,}" for n in files)
    add("")
    add("## Memory: peak RSS of every command over a lifecycle, by tree size" +
        (f" (the {mem['name']} run)" if mem.get("name") else ""))
    add("")
    add(f"{mem['tree']}, at {sizes} files; one run of `{mem['command']}` at {mem['when']} (load average "
        f"{mem['load_before']} before the group, {mem['load_after']} after). At each size, on a fresh tree: "
        "`find` and `cp -al` of it (the filesystem's own cost"
        + (f"; at sizes up to {mem['baselines_up_to']:,} files only" if mem.get("baselines_up_to") else "")
        + "), then "
        + ("the commands chosen with --memory-steps" if mem.get("subset") else "every command")
        + " of a migration's lifecycle "
        "in order (tests/helpers/memory.py, LIFECYCLE), each once (the lifecycle changes the tree), after "
        "`sync`. Peak RSS is the command's own ru_maxrss (wait4). Slope: the peak's growth per file between "
        f"the two largest sizes; at 10M: the largest peak plus that slope (goal <= {MEMORY_GOAL_MIB:,} MiB). "
        "Marginal: the time per file between the two smallest sizes and between the two largest, and their "
        f"ratio (1.0 linear; goal <= {MEMORY_GOAL_RATIO}).")
    if mem.get("stopped"):
        add("")
        add("**The run stopped before its end** (figures saved after each command): — marks a command not run "
            "at that size; a command's slope and projection are from the two largest sizes it ran at.")
    add("")
    add(f"| command | peak RSS (MiB) at {sizes} | slope (B/file) | at 10M (MiB) | time (s) at {sizes} | "
        "marginal (µs/file) small → large | ratio | exit codes |")
    add("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, f in figures.items():
        label = f"{name} (filesystem)" if name in mem["baselines"] else name
        rss = " / ".join("—" if x is None else f"{x:,.0f}" for x in f["peak_rss_mib"])
        wall = " / ".join("—" if x is None else f"{x:.2f}" for x in f["wall_s"])
        slope = "—" if f.get("slope_bytes_per_file") is None else f"{f['slope_bytes_per_file']:,.0f}"
        at10 = "—" if f.get("projected_mib_at_10m") is None else f"{f['projected_mib_at_10m']:,.0f}"
        if name not in mem["baselines"] and f.get("peak_goal_met") is False:
            at10 = f"**{at10}**"
        marginal = " → ".join("—" if x is None else f"{x:.2f}" for x in f["marginal_us_per_file"])
        ratio = "—" if f.get("marginal_ratio") is None else f"{f['marginal_ratio']:.2f}"
        if name not in mem["baselines"] and f.get("marginal_goal_met") is False:
            ratio = f"**{ratio}**"
        rcs = " / ".join("—" if rc is None else str(rc) for rc in f["rc"])
        add(f"| {label} | {rss} | {slope} | {at10} | {wall} | {marginal} | {ratio} | {rcs} |")
    ours = {k: f for k, f in figures.items() if k not in mem["baselines"]}
    over = [k for k, f in ours.items() if f.get("peak_goal_met") is False]
    steep = [k for k, f in ours.items() if f.get("marginal_goal_met") is False]
    timed = [k for k, f in ours.items() if f.get("marginal_goal_met") is not None]
    add("")
    projected = [k for k, f in ours.items() if f.get("projected_mib_at_10m") is not None]
    unprojected = [k for k in ours if k not in projected]  # (a stopped run: not yet run at two sizes)
    add(f"Peak RSS projected at 10M files: {len(projected) - len(over)} of {len(projected)} commands within "
        f"{MEMORY_GOAL_MIB:,} MiB" + (f" (over: {', '.join(over)})" if over else "")
        + (f"; not projected, run at one size only: {', '.join(unprojected)}" if unprojected else "")
        + "; marginal time per "
        f"file: {len(timed) - len(steep)} of {len(timed)} within {MEMORY_GOAL_RATIO}x"
        + (f" (over: {', '.join(steep)})" if steep else "")
        + (f"; {len(ours) - len(timed)} not judged (—: run at two sizes only, one interval to compare with "
           "itself; or their time did not grow between the two smallest sizes, start-up and noise outweigh the "
           "files there)" if len(timed) < len(ours) else "")
        + ". Bold: a goal not met. Exit codes: 1 is findings "
        "or changes pending (a dry run, a report of pending blocks), not a failure.")


def render_baseline(b: dict, m: dict, add: Any) -> None:
    """The baseline group's section: targets, bytes read, then the group's table."""
    add("")
    add("## Scheduled audits: `audit --verify hash --baseline auto` of an unchanged tree (issue 20)")
    add("")
    add(f"`{b['command']}` at {b['when']}: {b['files']:,} files, {b['tree_bytes']:,} bytes in files, "
        f"**{b['warmth']}**; {b['reps']} repetitions of each command, the "
        "order changing (each first in turn, neighbours both ways round), medians. The baseline manifest (the kept "
        f"full audit): {b['manifest_bytes']:,} bytes "
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
