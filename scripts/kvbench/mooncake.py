"""The mooncake group: `scan` of a Mooncake Store bucket client root of N objects in N/500
pairs against `find -printf`, and the rekey (`migrate --manifest M --apply`: every `.meta`
rewritten in place) against `cp` of the `.meta` files, warm and cold; MOONCAKE.md."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from .core import Bench
from .harness import DEFAULT_WORKDIR, SCRIPTS, Command, Group, Run, can_drop_caches, q, rmtree, sh, timed
from .rendering import command_rows, group_cmd, ratio_lines
from .trees import fs_free, walk_counts, warm

DRIVER = SCRIPTS / "bench_mooncake.py"  # run with kvmigrate's interpreter: it imports kvmigrate
STORE = "store"  # the client root's folder under the scanned ROOT (the store's name)
PROBE_OBJECTS = 1000
VALUE_BYTES = 64


def build_store(bench: Bench, root: Path, objects: int, seed: int) -> dict:
    """The driver's store under ROOT/store, then its check (untimed)."""
    rmtree(root)
    p = subprocess.run([bench.kvm_python, str(DRIVER), "build", str(root / STORE), "--objects", str(objects),
                        "--value-bytes", str(VALUE_BYTES), "--seed", str(seed)], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"bench: mooncake: building the store failed: {p.stderr.strip()}")
    tree = json.loads(p.stdout)
    c = subprocess.run([bench.kvm_python, str(DRIVER), "check", str(root / STORE), "--objects", str(objects)],
                       capture_output=True, text=True)
    if c.returncode != 0:
        sys.exit(f"bench: mooncake: the store is not what the driver says: {c.stderr.strip()}")
    counts = walk_counts(root, sample=0)
    return {**tree, "checked": json.loads(c.stdout), "dirs": counts["dirs"],
            "build_command": f"{DRIVER.name} build ROOT/{STORE} --objects {objects} --value-bytes {VALUE_BYTES}"}


def scan_to(bench: Bench, root: Path, manifest: Path) -> dict:
    """An untimed `scan` (the rekey's manifest, the probe's): its summary."""
    p = subprocess.run([bench.kvm, "scan", str(root), "-q", "--json", "-o", str(manifest)], capture_output=True,
                       text=True)
    if p.returncode not in (0, 1):
        sys.exit(f"bench: mooncake: `kvmigrate scan {root}` exited {p.returncode}: {p.stderr.strip()[-400:]}")
    return dict(json.loads(p.stdout))


def rekey_argv(bench: Bench, manifest: Path, journal: Path) -> list[str]:
    return [bench.kvm, "migrate", "--manifest", str(manifest), "--apply", "--engine-stopped", "--journal",
            str(journal), "-q", "--json"]


def rekey_probe(bench: Bench, work: Path) -> dict:
    """Whether this kvmigrate's `migrate --apply` rekeys a raw-key store (a small store of the
    driver's, scanned, applied, then rolled back): if it does, the group times the rekey."""
    root, out = work / "probe", work / "out"
    build_store(bench, root, PROBE_OBJECTS, seed=99)
    argv = rekey_argv(bench, out / "probe.parquet", out / "probe-journal")
    res: dict[str, Any] = {"objects": PROBE_OBJECTS, "command": " ".join(q(a) for a in argv)}
    try:
        res["scan_by_action"] = {k: v["objects"] for k, v in
                                 scan_to(bench, root, out / "probe.parquet")["totals"]["objects"]["by_action"].items()}
        p = subprocess.run(argv, capture_output=True, text=True)
        applied = json.loads(p.stdout) if p.stdout.strip() else {}
        res.update(exit_code=p.returncode, outcomes=applied.get("outcomes"))
        res["applies_rekey"] = p.returncode == 0 and (applied.get("outcomes") or {}).get("created") == PROBE_OBJECTS
        if not res["applies_rekey"]:
            res["why"] = (p.stderr.strip().splitlines() or ["no output"])[-1][:300]
    except (OSError, ValueError, KeyError) as exc:
        res.update(applies_rekey=False, why=f"the probe failed: {exc}")
    finally:
        rmtree(root)
        rmtree(out / "probe-journal")
    return res


def scan_commands(bench: Bench, root: Path, out: Path) -> list[Command]:
    manifest, stdout = out / "mc_scan.parquet", str(out / "mc_scan.json")

    def check(_run: Run) -> dict:
        s = json.loads(Path(stdout).read_text())
        t = s["totals"]
        return {"files": t["files"], "bytes": t["bytes"], "exit_code": s.get("exit_code"),
                "by_status": {k: v["files"] for k, v in t["by_status"].items()},
                "objects": t["objects"]["objects"],
                "objects_by_action": {k: v["objects"] for k, v in t["objects"]["by_action"].items()},
                "manifest_bytes": manifest.stat().st_size}

    return [
        Command("mc_scan", "kvmigrate scan ROOT -o M.parquet (default --verify size)",
                [bench.kvm, "scan", str(root), "-q", "--json", "-o", str(manifest)], "kvmigrate", ok_rcs=(0, 1),
                stdout=stdout, check=check),
        Command("mc_find", "find -printf", sh(f"find {q(root)} -printf '%p %s %T@\\n' > /dev/null"), "baseline"),
    ]


def rekey_commands(bench: Bench, root: Path, work: Path, manifest: Path, objects: int) -> list[Command]:
    """The rekey (undone after each run by `rollback`, untimed: the original `.meta` inodes go
    back, so the manifest stays true for the next run) and the copy of every `.meta`."""
    out, journal, dst = work / "out", work / "journal", work / "meta-copy"
    stdout = str(out / "mc_rekey.json")
    store = root / STORE

    def undo() -> None:
        p = subprocess.run([bench.kvm, "rollback", str(journal), "-q"], capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"bench: mooncake: rollback of the rekey failed: {p.stderr.strip()[-400:]}")
        rmtree(journal)

    def rekey_check(_run: Run) -> dict:
        s = json.loads(Path(stdout).read_text())
        c = subprocess.run([bench.kvm_python, str(DRIVER), "check", str(store), "--objects", str(objects), "--scheme",
                            "mc-scoped"], capture_output=True, text=True)
        return {"outcomes": s.get("outcomes"), "exit_code": s.get("exit_code"),
                "keys_checked": json.loads(c.stdout) if c.returncode == 0 else f"FAILED: {c.stderr.strip()}"}

    def copy_check(_run: Run) -> dict:
        c = walk_counts(dst, sample=0)
        return {"files_written": c["files"], "written_bytes": c["bytes"]}

    return [
        Command("mc_rekey", "kvmigrate migrate --manifest M --apply --engine-stopped (rekey: every .meta rewritten)",
                rekey_argv(bench, manifest, journal), "kvmigrate", stdout=stdout, reset=undo, check=rekey_check),
        Command("mc_cp_meta", "cp of the .meta files to another folder",
                sh(f"mkdir -p {q(dst)} && find {q(store)} -maxdepth 1 -name '*.meta' -print0 | xargs -0 cp -t {q(dst)}"),
                "baseline", reset=lambda: rmtree(dst), check=copy_check),
    ]


def run_mooncake_group(args: argparse.Namespace, bench: Bench) -> dict:
    """The whole group in one run: probe, store, scan warm and cold, rekey warm and cold
    (when this kvmigrate applies it); the trees are deleted at the end (unless --keep)."""
    log = bench.log
    work = Path(args.workdir or DEFAULT_WORKDIR / "mooncake").resolve()
    rmtree(work)
    out = work / "out"
    out.mkdir(parents=True)
    cold_why = "" if args.mooncake_warm_only else can_drop_caches()
    cold = not args.mooncake_warm_only and not cold_why
    res: dict[str, Any] = {"when": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                           "command": "python3 scripts/bench.py " + " ".join(q(a) for a in sys.argv[1:]),
                           "workdir": str(work), "free_before": fs_free(work), "reps": args.mooncake_reps,
                           "cold": cold, "cold_skipped_because": cold_why or None}
    probe = rekey_probe(bench, work)
    res["rekey_probe"] = probe
    log(f"mooncake: migrate --apply rekeys a raw-key store: {probe['applies_rekey']} ({probe.get('outcomes')})")

    root = work / "root"
    n = args.mooncake_objects
    res["store"] = build_store(bench, root, n, seed=1)
    log(f"mooncake: store of {n:,} objects in {res['store']['pairs']:,} pairs built in {res['store']['seconds']:.1f} s")
    pairs = [("mc_scan", "mc_find")]
    log(f"mooncake: warm-up of the store {warm(root):.1f} s")
    runs = [timed(Group("mooncake_scan_warm", "Scan of the store, warm", "mooncake", scan_commands(bench, root, out),
                        pairs), args.mooncake_reps, bench, out, cold=False)]
    if cold:
        runs.append(timed(Group("mooncake_scan_cold", "Scan of the store, cold", "mooncake",
                                scan_commands(bench, root, out), pairs), 1, bench, out, cold=True))
    res["scan"] = runs

    res["rekey"] = []
    if probe["applies_rekey"]:
        manifest = out / "rekey-source.parquet"
        scan_to(bench, root, manifest)
        pairs = [("mc_rekey", "mc_cp_meta")]
        log(f"mooncake: warm-up of the store {warm(root):.1f} s")
        res["rekey"].append(timed(Group("mooncake_rekey_warm", "Rekey, warm", "mooncake",
                                        rekey_commands(bench, root, work, manifest, n), pairs),
                                  args.mooncake_reps, bench, out, cold=False))
        if cold:
            res["rekey"].append(timed(Group("mooncake_rekey_cold", "Rekey, cold", "mooncake",
                                            rekey_commands(bench, root, work, manifest, n), pairs),
                                      1, bench, out, cold=True))
    res["free_min"] = fs_free(work)
    if not args.keep:
        log(f"mooncake: removing {work}")
        rmtree(work)
    return res


# --------------------------------------------------------------------------- MOONCAKE.md

def _table(add: Any, groups: list[dict], items: int, what: str) -> None:
    add(f"| run | command | median s | min–max s | {what}/s | peak RSS MiB | user s | sys s |")
    add("|---|---|---:|---:|---:|---:|---:|---:|")
    command_rows(add, groups, lambda c: (f"{items / c['median_s']:,.0f}", f"{c['peak_rss_mib']:.0f}",
                                         f"{c['median_user_s']:.1f}", f"{c['median_sys_s']:.1f}"))
    add("")


def render_mooncake(result: dict) -> str:
    m, g = result["machine"], result["mooncake"]
    lines: list[str] = []
    add = lines.append
    add("# kvmigrate benchmarks: Mooncake Store (scan and rekey)")
    add("")
    add(f"`{g['command']}` at {g['when']}, kvmigrate at `{m['git_head']}`"
        + (f" (uncommitted: {', '.join(m['git_uncommitted_under_kvmigrate'])})"
           if m["git_uncommitted_under_kvmigrate"] else "") + ".")
    add(f"Machine: {m['cpu_model']}, {m['cores']} cores (shared with other sessions: the load averages are "
        f"below), {m['mem_total_bytes'] / 2**30:.1f} GiB, kernel {m['kernel']}, {m['os']}; work folder on "
        f"{m['workdir_fs']} ({m['workdir_device']}, {m['workdir_mount_options']}); Python {m['python']}. "
        "Raw figures: [`mooncake.json`](mooncake.json).")
    add("")
    if g["cold"]:
        add("**Warm and cold.** Warm: the store was read once (untimed) before each group, and `sync` runs "
            "before every command. Cold: `sync; echo 3 > /proc/sys/vm/drop_caches` (page cache, dentries and "
            "inodes; the bench runs as root) before every timed command.")
    else:
        add(f"**Warm only**: the cold runs were skipped ({g['cold_skipped_because'] or '--mooncake-warm-only'}).")
    add(f"Each command ran {g['reps']} times per warm group (cold: once), the order changing every repetition "
        "(each first in turn); medians, and the peak RSS of the process and its children (wait4).")
    free = g["free_before"]
    add(f"Work folder `{g['workdir']}`: {free['bytes'] / 2**30:.0f} GiB and {free['inodes']:,} inodes free before the "
        f"run (of {free['total_bytes'] / 2**30:.0f} GiB and {free['total_inodes']:,}); the trees are deleted after "
        "the group.")
    add("")
    s = g["store"]
    add("## The store")
    add("")
    add(f"One vLLM bucket client root (`ROOT/{STORE}`) of {s['objects']:,} objects in {s['pairs']:,} pairs "
        f"({s['files']:,} files, {s['bytes'] / 2**20:,.1f} MiB), 500 objects a pair as Mooncake fills them, "
        f"written in {s['seconds']:.1f} s by `scripts/{s['build_command']}`: every `.bucket` record, `.meta` "
        "index, id and key through `kvmigrate/formats/mooncake.py` (`build_bucket`, `encode_meta`). Keys are "
        f"vLLM 0.34's at TP 1 ({s['key_bytes']} bytes), raw as Mooncake ≤ 0.3.11 stored them, so the scan finds "
        f"every object pending `rekey` under 0.3.14; values are {s['value_bytes']} random bytes (the scan reads "
        "the indexes and stats the buckets: value bytes only weigh on `--verify hash`). Checked after the build "
        f"(untimed): {s['checked']}.")
    add("")
    add("## Scan")
    add("")
    add("`kvmigrate scan ROOT -o M.parquet` (its default `--verify size`: every `.meta` read and decoded, each "
        "entry checked against its `.bucket`'s size, keys parsed and grouped into blocks and deployments; then a "
        "manifest with a row per file and per object) against `find ROOT -printf '%p %s %T@\\n'` (lists and "
        "stats the same files, reads none).")
    add("")
    _table(add, g["scan"], s["objects"], "objects")
    for grp in g["scan"]:
        ratio_lines(add, grp, " (time; below 1 is faster)")
        sc = group_cmd(grp, "mc_scan")
        if "facts" in sc:
            f = sc["facts"]
            add(f"  * scan: {f.get('files'):,} files {f.get('by_status')}, {f.get('objects'):,} objects "
                f"{f.get('objects_by_action')}, manifest {f.get('manifest_bytes', 0):,} bytes, exit code "
                f"{f.get('exit_code')}; load average {grp['loadavg']}")
    add("")
    add("## Rekey")
    add("")
    probe = g["rekey_probe"]
    if not g["rekey"]:
        add("**Slot for the rekey figure** (not measured: this kvmigrate's `migrate --apply` did not rekey the "
            f"probe store of {probe['objects']:,} raw-key objects: `{probe['command']}` gave exit code "
            f"{probe.get('exit_code')}, outcomes {probe.get('outcomes')}; {probe.get('why', '')}). It is timed "
            "here, beside `cp` of the `.meta` files, as soon as `migrate --apply` applies `rekey`.")
        return "\n".join(lines).rstrip() + "\n"
    add(f"`migrate --apply` rekeys at this commit (probe: {probe['objects']:,} raw-key objects, outcomes "
        f"{probe['outcomes']}), so the figure is the CLI: `kvmigrate migrate --manifest M --apply --engine-stopped` "
        "on the manifest of an untimed scan of the store (`--engine-stopped`: the proof that no Mooncake client "
        "runs). Per `.meta`: decode, re-encode and compare, every rekeyed value read back against the scan, the "
        "original hard-linked to its backup, the new index written to a temp, fsynced and renamed over it, the "
        "folder fsynced; the journal records each. After every run `kvmigrate rollback` puts the original indexes "
        "back (untimed), so the next run starts from the same store and manifest. The floor is `cp` of the "
        "`.meta` files into another folder (every index read and written once, no fsync), deleted after each "
        "run (untimed).")
    add("")
    _table(add, g["rekey"], s["objects"], "objects")
    for grp in g["rekey"]:
        ratio_lines(add, grp, " (time; below 1 is faster)")
        rk = group_cmd(grp, "mc_rekey")
        if "facts" in rk:
            add(f"  * rekey: outcomes {rk['facts'].get('outcomes')}, exit code {rk['facts'].get('exit_code')}; "
                f"the store's indexes read back after the run (untimed): {rk['facts'].get('keys_checked')}; "
                f"load average {grp['loadavg']}")
    return "\n".join(lines).rstrip() + "\n"
