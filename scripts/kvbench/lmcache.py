"""The lmcache group: an LMCache fs tier's reshard (TP 2 -> 4) against cat + cp of the same
bytes, and `scan` of a large fs tier against `find -printf`, warm and cold; LMCACHE.md."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .core import Bench
from .harness import DEFAULT_WORKDIR, SCRIPTS, Command, Group, Run, can_drop_caches, q, rmtree, sh, timed
from .rendering import command_rows, group_cmd, ratio_lines
from .trees import fs_free, walk_counts, warm

DRIVER = SCRIPTS / "bench_lmcache.py"  # run with kvmigrate's interpreter: it imports kvmigrate
SYNTH_SHARE = 100_000  # chunks one synth process writes (its records stay in memory until it ends)
# the facts a migrate of the probe tree needs to plan anything (it asks for them by name)
RECIPE_FACTS = ["--target-tp", "4", "--total-kv-heads", "8", "--writer-release", "0.5.6", "--pythonhashseed", "0"]
PROBE_FACTS = [*RECIPE_FACTS, "--head-dim", "4", "--layers", "4"]  # synth's geometry
TREE_FACTS = [*RECIPE_FACTS, "--head-dim", "128", "--layers", "32"]  # Llama-3.1-8B's
GEOMETRY = ("Llama-3.1-8B: 32 layers, 8 KV heads of 128, bf16, chunks of 256 tokens; fs tier, lmc-k3 names, "
            "the 28-byte RemoteMetadata header")


def cli_reshard_probe(kvm: str, workdir: Path) -> dict:
    """Whether this kvmigrate's `migrate` plans `reshard` for a TP 2 LMCache fs tier with
    --target-tp 4 (a dry run on a small synth tree): if it does, the group times the CLI too."""
    root = workdir / "probe"
    rmtree(root)
    synth = [kvm, "synth", str(root), "--family", "lmcache", "--lmc-backend", "fs", "--tp", "2", "--blocks", "4",
             "-q"]
    argv = [kvm, "migrate", str(root), *PROBE_FACTS, "--json"]
    res: dict[str, Any] = {"command": " ".join(q(a) for a in argv)}
    try:
        subprocess.run(synth, check=True, capture_output=True)
        p = subprocess.run(argv, capture_output=True, text=True)
        summary = json.loads(p.stdout)
    except (OSError, subprocess.CalledProcessError, ValueError) as exc:
        res.update(plans_reshard=False, why=f"the probe failed: {exc}")
        return res
    finally:
        rmtree(root)
    actions: dict[str, int] = {}
    statuses: dict[str, int] = {}
    for ns in summary.get("namespaces", []):
        for a, v in (ns.get("by_action") or {}).items():
            actions[a] = actions.get(a, 0) + v.get("blocks", 0)
        for s, v in (ns.get("by_status") or {}).items():
            statuses[s] = statuses.get(s, 0) + v.get("files", 0)
    res.update(plans_reshard=actions.get("reshard", 0) > 0, by_action=actions, by_status=statuses)
    return res


def reshard_commands(bench: Bench, src: Path, work: Path, probe: dict, chunks: int) -> list[Command]:
    """The driver (or the CLI when it plans reshard), the cat + cp floor and cp alone; every
    command writes into work/dst, deleted after each run (untimed)."""
    py, out = bench.kvm_python, work / "out"
    dst = work / "dst"
    src_tier, dst_tier = src / "cache", dst / "cache"

    def reset() -> None:
        """A fresh empty DST (migrate --dest wants it to exist) and no journal in the source root."""
        rmtree(dst)
        dst.mkdir()
        rmtree(src / ".kvmigrate")

    reset()

    def bytes_checked() -> Any:
        p = subprocess.run([py, str(DRIVER), "check", str(src_tier), str(dst_tier), "--chunks", "2"],
                           capture_output=True, text=True)
        return json.loads(p.stdout) if p.returncode == 0 else f"FAILED: {p.stderr.strip()}"

    def migrate_check(stdout: str) -> Any:
        def check(_run: Run) -> dict:
            summary = json.loads(Path(stdout).read_text())
            return {"outcomes": summary.get("outcomes"), "verify": summary.get("verify"),
                    "exit_code": summary.get("exit_code"), "bytes_checked": bytes_checked()}
        return check

    def driver_check(stdout: str) -> Any:
        def check(_run: Run) -> dict:
            facts = json.loads(Path(stdout).read_text())
            p = subprocess.run([py, str(DRIVER), "check", str(src_tier), str(dst_tier), "--chunks", "2"],
                               capture_output=True, text=True)
            facts["bytes_checked"] = json.loads(p.stdout) if p.returncode == 0 else f"FAILED: {p.stderr.strip()}"
            return facts
        return check

    def copy_check(_run: Run) -> dict:
        c = walk_counts(dst, sample=0)
        return {"files_written": c["files"], "written_bytes": c["bytes"]}

    drv_out = str(out / "lmc_reshard.json")
    cmds = [
        Command("lmc_reshard", "kvmigrate reshard (transforms_lmcache.write_reshard, Python driver)",
                [py, str(DRIVER), "reshard", str(src_tier), str(dst_tier), "--tp-dst", "4"], "kvmigrate",
                stdout=drv_out, reset=reset, check=driver_check(drv_out)),
        Command("lmc_cat_cp", "cat SRC > /dev/null, then cp -R SRC DST",
                sh(f"find {q(src_tier)} -type f -print0 | xargs -0 cat > /dev/null && mkdir -p {q(dst)} && "
                   f"cp -R {q(src_tier)} {q(dst_tier)}"), "baseline", reset=reset, check=copy_check),
        Command("lmc_cp", "cp -R SRC DST", sh(f"mkdir -p {q(dst)} && cp -R {q(src_tier)} {q(dst_tier)}"),
                "baseline", reset=reset, check=copy_check),
    ]
    cmds.append(Command("lmc_imports", "the driver's imports alone (no file read or written)",
                        [py, "-c", "import kvmigrate.formats.lmcache, kvmigrate.transforms_lmcache"], "baseline"))
    if probe.get("plans_reshard"):
        for key, verify, label in (("lmc_migrate", [], "(its default --verify hash)"),
                                   ("lmc_migrate_size", ["--verify", "size"], "--verify size")):
            mig_out = str(out / f"{key}.json")
            cmds.insert(0, Command(key, f"kvmigrate migrate ROOT --apply --dest DST {label}",
                                   [bench.kvm, "migrate", str(src), *TREE_FACTS, *verify, "--dest", str(dst),
                                    "--apply", "-q", "--json"], "kvmigrate", stdout=mig_out, reset=reset,
                                   check=migrate_check(mig_out)))
    return cmds


def scan_commands(bench: Bench, root: Path, out: Path) -> list[Command]:
    manifest, stdout, floor_out = out / "lmc_scan.parquet", str(out / "lmc_scan.json"), str(out / "lmc_floor.json")

    def check(_run: Run) -> dict:
        s = json.loads(Path(stdout).read_text())
        return {"files": s["totals"]["files"], "bytes": s["totals"]["bytes"], "exit_code": s.get("exit_code"),
                "by_status": {k: v["files"] for k, v in s["totals"]["by_status"].items()},
                "manifest_bytes": manifest.stat().st_size}

    return [
        Command("lmc_scan", "kvmigrate scan ROOT -o M.parquet (default --verify size)",
                [bench.kvm, "scan", str(root), "-q", "--json", "-o", str(manifest)], "kvmigrate", ok_rcs=(0, 1),
                stdout=stdout, check=check),
        Command("lmc_find", "find -printf", sh(f"find {q(root)} -printf '%p %s %T@\\n' > /dev/null"), "baseline"),
        Command("lmc_cat", "find | xargs cat (opens and reads every file, as the scan does)",
                sh(f"find {q(root)} -type f -print0 | xargs -0 cat > /dev/null"), "baseline"),
        Command("lmc_floor", f"Python floor (scandir + lstat, {len(os.sched_getaffinity(0))} processes, no manifest)",
                [bench.kvm_python, str(SCRIPTS / "floor_walk.py"), "--flat", str(root)], "baseline",
                stdout=floor_out, check=lambda _r: {"files": json.loads(Path(floor_out).read_text())["files"]}),
    ]


def build_scan_tier(bench: Bench, root: Path, chunks: int, log: Any) -> dict:
    """`kvmigrate synth --family lmcache` into one fs tier, `--jobs` processes at a time of
    at most SYNTH_SHARE chunks each, one seed each (disjoint keys); the smallest chunk synth
    writes (one layer, one token: 128 payload bytes + the 28-byte header)."""
    rmtree(root)
    root.mkdir(parents=True)
    shares = [min(SYNTH_SHARE, chunks - i) for i in range(0, chunks, SYNTH_SHARE)]
    argvs = [[bench.kvm, "synth", str(root), "--family", "lmcache", "--lmc-backend", "fs", "--layers", "1",
              "--block-tokens", "1", "--blocks", str(n), "--seed", str(1 + i), "-q"] for i, n in enumerate(shares)]
    start = _dt.datetime.now()
    running: list[tuple[list[str], subprocess.Popen]] = []
    pending = list(argvs)
    while pending or running:
        while pending and len(running) < max(1, bench.args.jobs):
            argv = pending.pop(0)
            running.append((argv, subprocess.Popen(argv, stderr=subprocess.PIPE)))
        argv, p = running.pop(0)
        if p.wait() != 0:
            sys.exit(f"bench: `{' '.join(argv)}` failed: {p.stderr.read().decode() if p.stderr else ''}")
    seconds = (_dt.datetime.now() - start).total_seconds()
    counts = walk_counts(root, sample=0)
    if counts["files"] != chunks:
        sys.exit(f"bench: {root} has {counts['files']} files, {chunks} chunks expected (a key written twice?)")
    log(f"lmcache: scan tier of {chunks:,} chunk files built in {seconds:.0f} s")
    return {"chunks": chunks, "files": counts["files"], "bytes": counts["bytes"], "dirs": counts["dirs"],
            "build_s": round(seconds, 1), "synth_processes": len(argvs), "synth_command": " ".join(q(a) for a in argvs[0])}


def run_lmcache_group(args: argparse.Namespace, bench: Bench) -> dict:
    """The whole group in one run: probe, reshard tree, reshard warm and cold, scan tier,
    scan warm and cold; the trees are deleted at the end (unless --keep)."""
    log = bench.log
    work = Path(args.workdir or DEFAULT_WORKDIR / "lmcache").resolve()
    rmtree(work)
    (work / "out").mkdir(parents=True)
    out = work / "out"
    cold_why = "" if args.lmcache_warm_only else can_drop_caches()
    cold = not args.lmcache_warm_only and not cold_why
    res: dict[str, Any] = {"when": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                           "command": "python3 scripts/bench.py " + " ".join(q(a) for a in sys.argv[1:]),
                           "workdir": str(work), "free_before": fs_free(work), "reps": args.lmcache_reps,
                           "cold": cold, "cold_skipped_because": cold_why or None}
    probe = cli_reshard_probe(bench.kvm, work)
    res["cli_probe"] = probe
    log(f"lmcache: migrate plans reshard for an LMCache tier: {probe['plans_reshard']} ({probe.get('by_action')})")

    src = work / "reshard-src"
    n = args.lmcache_chunks
    p = subprocess.run([bench.kvm_python, str(DRIVER), "build", str(src / "cache"), "--chunks", str(n), "--seed", "1"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"bench: lmcache: building the reshard tier failed: {p.stderr.strip()}")
    tree = json.loads(p.stdout)
    scan_src = subprocess.run([bench.kvm, "scan", str(src), "-q", "--json", "-o", str(out / "reshard_src.parquet")],
                              capture_output=True, text=True)
    tree["kvmigrate_scan_of_it"] = {k: v for k, v in json.loads(scan_src.stdout)["totals"].items()
                                    if k in ("files", "bytes", "by_status", "by_action")}
    res["reshard_tree"] = {**tree, "geometry": GEOMETRY, "tp_src": 2, "tp_dst": 4}
    log(f"lmcache: reshard tier {n} chunks, {tree['files']} files, {tree['bytes'] / 2**30:.2f} GiB")
    cmds = reshard_commands(bench, src, work, probe, n)
    pairs = [("lmc_reshard", "lmc_cat_cp"), ("lmc_reshard", "lmc_cp")]
    if probe.get("plans_reshard"):
        pairs = [("lmc_migrate", "lmc_cat_cp"), ("lmc_migrate_size", "lmc_cat_cp"), ("lmc_migrate_size", "lmc_cp"),
                 ("lmc_migrate_size", "lmc_reshard"), *pairs]
    runs = []
    log(f"lmcache: warm-up of the reshard tier {warm(src):.1f} s")
    runs.append(timed(Group("lmcache_reshard_warm", "Reshard TP 2 -> 4, warm", "lmcache", cmds, pairs),
                      args.lmcache_reps, bench, out, cold=False))
    if cold:
        cmds = reshard_commands(bench, src, work, probe, n)
        runs.append(timed(Group("lmcache_reshard_cold", "Reshard TP 2 -> 4, cold", "lmcache", cmds, pairs),
                          args.lmcache_reps, bench, out, cold=True))
    res["reshard"] = runs
    if not args.keep:
        rmtree(src)

    root = work / "scan-tier"
    res["scan_tree"] = build_scan_tier(bench, root, args.lmcache_scan_chunks, log)
    pairs = [("lmc_scan", "lmc_find"), ("lmc_scan", "lmc_cat"), ("lmc_scan", "lmc_floor")]
    log(f"lmcache: warm-up of the scan tier {warm(root):.1f} s")
    runs = [timed(Group("lmcache_scan_warm", "Scan of the fs tier, warm", "lmcache", scan_commands(bench, root, out),
                        pairs), args.lmcache_reps, bench, out, cold=False)]
    if cold:
        runs.append(timed(Group("lmcache_scan_cold", "Scan of the fs tier, cold", "lmcache",
                                scan_commands(bench, root, out), pairs), 1, bench, out, cold=True))
    res["scan"] = runs
    res["free_min"] = fs_free(work)
    if not args.keep:
        log(f"lmcache: removing {work}")
        rmtree(work)
    return res


# --------------------------------------------------------------------------- LMCACHE.md

def _mbs(nbytes: int, seconds: float | None) -> str:
    return f"{nbytes / seconds / 1e6:,.0f}" if seconds else "—"


def render_lmcache(result: dict) -> str:
    m, g = result["machine"], result["lmcache"]
    lines: list[str] = []
    add = lines.append
    add("# kvmigrate benchmarks: LMCache (reshard and scan)")
    add("")
    add(f"`{g['command']}` at {g['when']}, kvmigrate at `{m['git_head']}`"
        + (f" (uncommitted: {', '.join(m['git_uncommitted_under_kvmigrate'])})"
           if m["git_uncommitted_under_kvmigrate"] else "") + ".")
    add(f"Machine: {m['cpu_model']}, {m['cores']} cores (shared with other sessions: the load averages are "
        f"below), {m['mem_total_bytes'] / 2**30:.1f} GiB, kernel {m['kernel']}, {m['os']}; work folder on "
        f"{m['workdir_fs']} ({m['workdir_device']}, {m['workdir_mount_options']}); Python {m['python']}. "
        "Raw figures: [`lmcache.json`](lmcache.json).")
    add("")
    if g["cold"]:
        add("**Warm and cold.** Warm: the source tree was read once (untimed) before the group, and `sync` runs "
            "before every command. Cold: `sync; echo 3 > /proc/sys/vm/drop_caches` (page cache, dentries and "
            "inodes; the bench runs as root) before every timed command.")
    else:
        add(f"**Warm only**: the cold runs were skipped ({g['cold_skipped_because'] or '--lmcache-warm-only'}).")
    add(f"Each command ran {g['reps']} times per warm group (cold scan: once), the order changing every "
        "repetition (each first in turn); medians, and the peak RSS of the process and its children (wait4).")
    probe = g["cli_probe"]
    free = g["free_before"]
    add(f"Work folder `{g['workdir']}`: {free['bytes'] / 2**30:.0f} GiB and {free['inodes']:,} inodes free before the "
        f"run (of {free['total_bytes'] / 2**30:.0f} GiB and {free['total_inodes']:,}: the largest filesystem here); "
        "the trees are deleted after the group.")
    add("")
    add("## Reshard: TP 2 → 4")
    add("")
    t = g["reshard_tree"]
    add(f"{t['chunks']} chunks of {t['geometry']}: {t['files']} source files of {t['file_bytes']:,} bytes "
        f"({t['bytes'] / 2**30:.2f} GiB), each chunk becoming 4 target files of "
        f"{(t['file_bytes'] - 28) // 2 + 28:,} bytes (the target name and header, then the target rank's heads "
        "of every row). `kvmigrate scan` of the source tree: "
        f"{t['kvmigrate_scan_of_it']['files']:,} files, statuses {t['kvmigrate_scan_of_it']['by_status']}.")
    add("")
    if probe["plans_reshard"]:
        add(f"`migrate` plans `reshard` for an LMCache tier at this commit (`{probe['command']}` on a small synth "
            f"tree: actions {probe['by_action']}), so the CLI rows are the figure: `kvmigrate migrate ROOT --apply "
            f"--dest DST {' '.join(TREE_FACTS)}` (the recipe facts and the geometry it asks for), with its own scan "
            "at its default `--verify hash` (every source file read and hashed before the plan, then read again "
            "to reshard), and with `--verify size` (the scan stats; apply reads each source as it reshards). "
            "Both journal every file and fsync what they write. Beside them, `scripts/bench_lmcache.py reshard`: "
            "a small Python driver that groups the files into chunks by name and writes, per target rank, the "
            "name, the fs header and `kvmigrate.transforms_lmcache.write_reshard`'s payload: the transform "
            "alone (no scan, journal, fsync or lock).")
    else:
        add(f"`migrate ROOT --apply` does not plan `reshard` for an LMCache tier at this commit (`{probe['command']}` "
            f"on a small synth tree: actions {probe.get('by_action')}, statuses {probe.get('by_status')}), so the "
            "figure is the transform itself: `scripts/bench_lmcache.py reshard`, a small Python driver that groups "
            "the tier's files into chunks by name and, for each target rank, writes the target name, the fs header "
            "and `kvmigrate.transforms_lmcache.write_reshard`'s payload. It is what apply would add to the "
            "transform: no journal, no fsync, no lock, no scan.")
    add("The floor is `cat` of the source files to /dev/null, then `cp -R` of the same files (the bytes read once "
        "and read and written once more); `cp -R` alone beside it. Every command writes into a fresh folder, "
        "deleted after it (untimed); none fsyncs (the `sync` before the next command is untimed). After each "
        "driver run, two chunks' outputs are compared with the heads taken in plain Python (untimed). The last row "
        "is the driver's start-up: Python importing kvmigrate's LMCache format and transform modules (which bring "
        "pyarrow and numpy), part of every driver run.")
    add("")
    add("| run | command | median s | min–max s | MB/s (source bytes) | peak RSS MiB | rchar GiB | "
        "read from disk GiB |")
    add("|---|---|---:|---:|---:|---:|---:|---:|")
    command_rows(add, g["reshard"], lambda c: (
        "—" if c["key"] == "lmc_imports" else _mbs(t["bytes"], c["median_s"]), f"{c['peak_rss_mib']:.0f}",
        f"{c.get('median_rchar', 0) / 2**30:.2f}", f"{c.get('median_read_bytes', 0) / 2**30:.2f}"))
    add("")
    for grp in g["reshard"]:
        ratio_lines(add, grp, " (time; below 1 is faster)")
        for c in grp["commands"]:
            f = c.get("facts") or {}
            if "bytes_checked" in f:
                done = f.get("outcomes") or f"{f.get('chunks')} chunks, {f.get('written_bytes', 0):,} bytes written"
                add(f"  * {c['label']}: {done}; bytes checked: {f['bytes_checked']}")
        add(f"  * load average {grp['loadavg']}")
    add("")
    add("## Scan of a large fs tier")
    add("")
    s = g["scan_tree"]
    add(f"{s['chunks']:,} chunk files in one fs tier folder (`{s['synth_command']}`, in {s['synth_processes']} synth "
        f"run(s) of disjoint seeds, {s['build_s']:.0f} s to build): one layer and one token a chunk, "
        f"{s['bytes'] // max(1, s['files'])} bytes a file with the header. `kvmigrate scan ROOT -o M.parquet` "
        "(its default `--verify size`: the name parsed, each file opened and its first bytes read, up to 8 KiB: "
        "here the whole file, the 28-byte header checked against the name's dtype and the size; then the "
        "manifest) against `find ROOT -printf '%p %s %T@\\n'` (lists and stats), `find | xargs cat` (opens and "
        "reads every file whole: the scan's reads without its Python) and the Python "
        "floor (`scripts/floor_walk.py --flat`: each process lists the folder and lstats its share of the entries, "
        "nothing else).")
    add("")
    add("| run | command | median s | min–max s | files/s | peak RSS MiB | user s | sys s |")
    add("|---|---|---:|---:|---:|---:|---:|---:|")
    command_rows(add, g["scan"], lambda c: (f"{s['files'] / c['median_s']:,.0f}", f"{c['peak_rss_mib']:.0f}",
                                       f"{c['median_user_s']:.1f}", f"{c['median_sys_s']:.1f}"))
    add("")
    for grp in g["scan"]:
        ratio_lines(add, grp, "")
        fl = group_cmd(grp, "lmc_floor")
        if "facts" in fl:
            add(f"  * the floor walked {fl['facts'].get('files'):,} files")
        sc = group_cmd(grp, "lmc_scan")
        if "facts" in sc:
            add(f"  * scan: {sc['facts'].get('files'):,} files, statuses {sc['facts'].get('by_status')}, manifest "
                f"{sc['facts'].get('manifest_bytes', 0):,} bytes, exit code {sc['facts'].get('exit_code')}; load "
                f"average {grp['loadavg']}")
    for note in g.get("notes", []):
        add("")
        add(note)
    return "\n".join(lines).rstrip() + "\n"
