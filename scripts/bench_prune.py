"""`kvmigrate prune --apply` of N migrated legacy block files against `rm -rf` of the same
legacy folders, and `kvmigrate restore` (issue 19; one run each, as the issue asks).

    /work/venv/bin/python scripts/bench_prune.py --files 500000 [--dir DIR] [--json OUT]

Builds a vLLM S2 tree of N blocks (`kvmigrate synth`), migrates it (hard links), scans it
into a manifest (`--verify size`: the timing is prune's own work, not a hash scan), then
times on the warm tree:
  prune    kvmigrate prune --manifest M --apply --force-live  (re-check each file and its
           target, journal, rename into the quarantine, remove the emptied folders)
  restore  kvmigrate restore JOURNAL                          (every file and folder back)
  rm -rf   of the legacy rank folder and base folder          (what the hint used to say)
The tree is removed at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FACTS = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16"]


def kvmigrate() -> str:
    here = Path(sys.executable).with_name("kvmigrate")
    return str(here) if here.exists() else (shutil.which("kvmigrate") or "kvmigrate")


def timed(argv: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True)
    took = time.perf_counter() - start
    if p.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return took, p.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=50_000)
    ap.add_argument("--dir", default=None, help="work folder (default: a temp folder, removed)")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    kvm = kvmigrate()
    work = Path(args.dir or tempfile.mkdtemp(prefix="kvmigrate-bench-prune-"))
    root = work / "root"
    out: dict = {"files": args.files}
    try:
        if not root.exists():
            t, _ = timed([kvm, "synth", str(root), "--family", "vllm", "--scheme", "S2", "--blocks", str(args.files),
                          "--layers", "1", "--block-bytes", "1024"])
            out["synth_s"] = round(t, 2)
            t, _ = timed([kvm, "migrate", str(root), *FACTS, "--verify", "size", "--apply", "-q"])
            out["migrate_s"] = round(t, 2)
        legacy = sorted(p.name for p in root.iterdir() if p.name != ".kvmigrate" and not _is_target(root, p.name))
        manifest = work / "m.parquet"
        t, _ = timed([kvm, "scan", str(root), *FACTS, "--verify", "size", "-o", str(manifest), "-q"])
        out["scan_s"] = round(t, 2)
        t, text = timed([kvm, "prune", "--manifest", str(manifest), *FACTS, "--force-live", "--apply", "--json",
                         "-q"])
        res = json.loads(text)
        out["prune_apply_s"] = round(t, 2)
        out["pruned_files"] = sum(res["moved"].values())
        t, _ = timed([kvm, "restore", res["journal"], "-q"])
        out["restore_s"] = round(t, 2)
        subprocess.run(["sync"])
        t, _ = timed(["rm", "-rf", *[str(root / name) for name in legacy]])
        out["rm_rf_s"] = round(t, 2)
        out["prune_vs_rm"] = round(out["prune_apply_s"] / out["rm_rf_s"], 2) if out["rm_rf_s"] else None
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


def _is_target(root: Path, name: str) -> bool:
    """A folder the migration made (its journal names its target bases)."""
    journals = root / ".kvmigrate" / "journals"
    for f in journals.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line) if line.endswith("}") else {}
            if rec.get("t") == "target" and name.startswith(rec["base"]):
                return True
    return False


if __name__ == "__main__":
    os.environ.pop("KVMIGRATE_CRASH_AT", None)
    sys.exit(main())
