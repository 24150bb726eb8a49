"""`kvmigrate demo [DIR]`: the whole flow on a generated sample root, step by step.

Each step runs the real command in a subprocess and prints it, so the output doubles as a
tutorial: the operator sees exactly what to type on their own cache.
"""

from __future__ import annotations

import click

from kvmigrate.cli.common import handle_errors

# Facts the sample's writers had (a real operator knows these from their deployment).
DEMO_FACTS = {
    "*": {"model_dtype": "bfloat16"},
    "deepseek-ai/DeepSeek-V2-Lite-Chat": {"kv_kind": "mla"},
    "meta-llama/Llama-3.1-8B-Instruct": {"kv_kind": "full", "total_kv_heads": 8, "family": "vllm"},
    "Qwen/Qwen2.5-7B-Instruct": {"kv_kind": "full", "total_kv_heads": 4},
}

# step title, arguments after `kvmigrate`, the exit codes that step is expected to give
# (scan/audit/report find the sample's injected defects: bit 1 findings, bit 4 integrity).
def _steps(root: str, work: str) -> list[tuple[str, list[str], set[int]]]:
    manifest = f"{work}/manifest.parquet"
    facts = f"{work}/FACTS.json"
    journal = f"{work}/journal"
    return [
        ("Scan the cache root (hash every file, compare replicas)",
         ["scan", root, "-o", manifest, "--verify", "hash", "--facts", facts, "-q"], {0, 1, 5}),
        ("Report what is reusable and what is broken",
         ["report", manifest, "--format", "text"], {0, 1, 5}),
        ("Write the same report as a self-contained HTML page",
         ["report", manifest, "--format", "html", "-o", f"{work}/report.html"], {0, 1, 5}),
        ("Dry run: what a migration would do (writes nothing)",
         ["migrate", "--manifest", manifest], {0, 1, 5}),
        ("Apply: hard-link and rewrite reusable blocks into the target namespaces",
         ["migrate", "--manifest", manifest, "--apply", "--journal", journal], {0, 4}),
        ("Apply again: nothing left to do (every block already present)",
         ["migrate", "--manifest", manifest, "--apply", "--journal", journal], {0, 4}),
        ("Verify the target namespaces against the journal",
         ["verify", root, "--journal", journal], {0}),
        ("Roll the migration back (removes exactly what it created)",
         ["rollback", journal], {0}),
    ]


@click.command("demo")
@click.argument("directory", required=False, type=click.Path(file_okay=False, path_type=str))
@handle_errors
def command(directory: str | None) -> None:
    """Build a sample cache root (llm-d, vLLM S1/S2/S3 and vllm.cpp namespaces, with a few
    defects) under DIRECTORY (default: a new temp dir) and run scan, report, dry run,
    apply, verify and rollback on it, printing each step. Exits 0 when every step
    behaved as expected."""
    import json
    import os
    import shlex
    import subprocess
    import sys
    import tempfile

    from kvmigrate.errors import OperationalError
    from kvmigrate.synth.demo import build_demo_root

    work = os.path.abspath(directory) if directory else tempfile.mkdtemp(prefix="kvmigrate-demo-")
    root = os.path.join(work, "cache")
    if os.path.exists(root) and os.listdir(root):
        raise OperationalError("the demo's cache folder already exists and is not empty", path=root,
                               hint="give the demo a new or empty DIRECTORY")
    os.makedirs(root, exist_ok=True)
    results = build_demo_root(root)
    with open(os.path.join(work, "FACTS.json"), "w") as f:
        json.dump(DEMO_FACTS, f, indent=2)
    before = _snapshot(root)
    click.echo(f"kvmigrate demo in {work}")
    click.echo(f"  built {len(results)} sample namespaces under {root} (with injected defects)")
    click.echo(f"  deployment facts in {work}/FACTS.json")
    for n, (title, args, expected) in enumerate(_steps(root, work), 1):
        shown = "kvmigrate " + " ".join(shlex.quote(a) for a in args)
        click.echo(f"\n== step {n}: {title}\n$ {shown}")
        proc = subprocess.run([sys.executable, "-m", "kvmigrate", *args], capture_output=True, text=True)
        out = proc.stdout.rstrip()
        if out:
            click.echo(out)
        if proc.stderr.strip():
            click.echo(proc.stderr.rstrip(), err=True)
        click.echo(f"(exit code {proc.returncode})")
        if proc.returncode not in expected:
            raise OperationalError(f"demo step {n} exited {proc.returncode}, expected one of {sorted(expected)}",
                                   hint=f"rerun it by hand: {shown}")
    after = _snapshot(root)
    changed = [p for p in before if before[p] != after.get(p)]
    if changed:
        raise OperationalError(f"source files changed during the demo: {changed[:5]}")
    click.echo(f"\nDone. Every source file is unchanged (inode, size, mtime, mode) after all steps.\n"
               f"Open {work}/report.html in a browser for the charts.")


def _snapshot(root: str) -> dict[str, tuple[int, int, int, int]]:
    """(inode, size, mtime_ns, mode) of every entry under root, symlinks not followed."""
    import os

    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".kvmigrate"]
        for name in filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            snap[os.path.relpath(p, root)] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)
    return snap
