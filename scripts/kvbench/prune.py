"""The prune group: prune --apply against rm -rf of the same legacy folders, and restore."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from pathlib import Path
from typing import Any

from .core import Bench
from .harness import DEFAULT_WORKDIR, FACTS, Run, q, rmtree, run_measured, tail
from .trees import warm


def run_prune_group(args: argparse.Namespace, bench: Bench, log: Any) -> dict:
    """`prune --apply` of `--prune-files` migrated legacy block files against `rm -rf` of
    the same legacy folders, and `restore` of that prune (issue 19; one run, as it asks).

    A vLLM S2 MLA tree of N blocks (1 KiB each, one layer) is migrated by hard links and
    scanned (`--verify size`: the timed figure is prune's own work, not a hash scan); on the
    warm tree, each after `sync`: prune (a fresh lstat of every legacy file and of its
    target, the journal fsynced before the first move, one rename per file into the
    quarantine, the emptied folders removed), restore (every file and folder back, checked
    by count), then rm -rf of the legacy folders (what the hints used to print)."""
    n = args.prune_files
    kvm = bench.kvm
    workdir = Path(args.workdir or DEFAULT_WORKDIR / "prune").resolve()
    rmtree(workdir)
    workdir.mkdir(parents=True)
    root = workdir / "root"
    out: dict[str, Any] = {"files": n, "tree": f"vLLM S2 MLA, {n:,} blocks of 1 KiB (one layer), migrated by hard "
                                               "links", "steps": {}, "loadavg": {}}

    def step(name: str, argv: list[str], ok: tuple[int, ...] = (0,), stdout: str | None = None) -> Run:
        os.sync()
        out["loadavg"][name] = [round(x, 2) for x in os.getloadavg()]
        r = run_measured(argv, stdout=stdout, stderr=str(workdir / f"{name}.err"))
        if r.rc not in ok:
            sys.exit(f"bench: prune: {name} exited {r.rc}: {tail(workdir / f'{name}.err')}")
        out["steps"][name] = {**r.as_dict(), "wall_s": round(r.wall_s, 2)}
        log(f"prune: {name} {r.wall_s:.2f} s (load {out['loadavg'][name][0]})")
        return r

    step("synth", [kvm, "synth", str(root), "--family", "vllm", "--scheme", "S2", "--kv-kind", "mla", "--blocks",
                   str(n), "--layers", "1", "--block-bytes", "1024"])
    legacy = sorted(os.listdir(root))  # the folders synth wrote: the migration's sources
    step("migrate", [kvm, "migrate", str(root), *FACTS, "--verify", "size", "--apply", "-q"])
    manifest = workdir / "m.parquet"
    step("scan", [kvm, "scan", str(root), *FACTS, "--verify", "size", "-o", str(manifest), "-q"], ok=(0, 1))
    files_before = sum(len(fs) for name in legacy for _, _, fs in os.walk(root / name))
    warm(root)
    res_path = workdir / "prune.json"
    prune = step("prune_apply", [kvm, "prune", "--manifest", str(manifest), *FACTS, "--force-live", "--apply",
                                 "--json", "-q"], stdout=str(res_path))
    res = json.loads(res_path.read_text())
    out["pruned_files"] = sum(res["moved"].values())
    out["legacy_names_removed"] = sum(res.get("legacy_names_removed", {}).values())
    restore = step("restore", [kvm, "restore", res["journal"], "-q"])
    out["restored_files"] = sum(len(fs) for name in legacy for _, _, fs in os.walk(root / name))
    if out["restored_files"] != files_before or out["pruned_files"] != files_before:
        sys.exit(f"bench: prune: {files_before} legacy files, {out['pruned_files']} pruned, "
                 f"{out['restored_files']} back after restore")
    warm(root)
    rm = step("rm_rf", ["rm", "-rf", *[str(root / name) for name in legacy]])
    out["legacy_files"] = files_before
    out["prune_vs_rm"] = round(prune.wall_s / rm.wall_s, 2) if rm.wall_s else None
    out["restore_vs_prune"] = round(restore.wall_s / prune.wall_s, 2) if prune.wall_s else None
    out["loadavg"]["end"] = [round(x, 2) for x in os.getloadavg()]
    out["when"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    out["command"] = "python3 scripts/bench.py " + " ".join(q(a) for a in sys.argv[1:])
    return out
