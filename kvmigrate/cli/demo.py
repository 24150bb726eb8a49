"""`kvmigrate demo [DIR]`: the whole flow on a generated sample root, step by step.

Each step runs the real command in a subprocess and prints it, so the output doubles as a
tutorial: the operator sees exactly what to type on their own cache.
"""

from __future__ import annotations

import logging

import click

from kvmigrate.cli.common import handle_errors, log_options
from kvmigrate.errors import OperationalError
from kvmigrate.units import plural

# Facts the sample's writers had (a real operator knows these from their deployment);
# the LMCache tiers' own, keyed by tier, are synth.demo.LMCACHE_FACTS.
DEMO_FACTS = {
    "*": {"model_dtype": "bfloat16"},
    "deepseek-ai/DeepSeek-V2-Lite-Chat": {"kv_kind": "mla"},
    # tp = pp = 1 folders of full-attention models: a vLLM 0.24-0.33 gate may have folded
    # any topology to 1, so the operator states the one that wrote them (identity.md §4.1)
    "meta-llama/Llama-3.1-8B-Instruct": {"kv_kind": "full", "total_kv_heads": 8, "family": "vllm",
                                         "writer_tp": 1, "writer_pp": 1},
    "Qwen/Qwen2.5-7B-Instruct": {"kv_kind": "full", "total_kv_heads": 4, "writer_tp": 1, "writer_pp": 1},
    "Qwen/Qwen3-8B": {"writer_release": "0.5.20"},  # the SGLang directory's writer (its layout default)
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
        ("Apply again: nothing new to do (the first apply's work is done)",
         ["migrate", "--manifest", manifest, "--apply", "--journal", journal], {0, 4}),
        ("Verify the target namespaces against the journal",
         ["verify", root, "--journal", journal], {0}),
        ("Roll the migration back (removes exactly what it created)",
         ["rollback", journal], {0}),
    ]


log = logging.getLogger(__name__)


class StepFailed(OperationalError):
    """A demo step gave an unexpected exit code (or touched a source): the sample is kept."""


@click.command("demo")
@click.argument("directory", required=False, type=click.Path(file_okay=False, path_type=str))
@click.option("--keep", is_flag=True,
              help="Without DIRECTORY: keep the temp dir (sample, manifest, journal, report.html) at the end.")
@log_options
@handle_errors
def command(directory: str | None, keep: bool, verbose: int, log_format: str) -> None:
    """Build a sample cache root (llm-d, vLLM S1/S2/S3, vllm.cpp and SGLang namespaces, LMCache
    fs, local_disk and GDS tiers, Mooncake bucket and file-per-key stores, with a few defects)
    and run scan, report, dry run, apply, verify and rollback on it, printing each step. DIRECTORY must be empty or new, and
    stays; without it the demo works in a new temp dir, which it names and removes at the
    end (unless --keep, or a step fails). Exits 0 when every step behaved as expected."""
    import os
    import shutil
    import tempfile

    from kvmigrate.synth.demo import require_empty_folder

    if directory:
        work = os.path.abspath(directory)
        require_empty_folder(work)
        os.makedirs(work, exist_ok=True)
    else:
        work = tempfile.mkdtemp(prefix="kvmigrate-demo-")
    stays = bool(directory) or keep
    try:
        # each step logs as the demo was asked to (its commands show the flags too)
        logging_flags = (["-" + "v" * verbose] if verbose else []) + (["--log-format", "json"] if log_format == "json"
                                                                      else [])
        _run(work, stays, logging_flags)
    except StepFailed:
        stays = True  # the hint's command names paths in it
        raise
    finally:
        if not stays:
            shutil.rmtree(work, ignore_errors=True)
    if stays:
        click.echo(f"The sample stays in {work}: open {work}/report.html in a browser for the charts.")
    else:
        click.echo(f"Removed the sample {work} (pass --keep, or an empty DIRECTORY, to keep it and its report.html).")


def _run(work: str, stays: bool, logging_flags: list[str]) -> None:
    """Build the sample under work/cache and run every step, checking each exit code."""
    import json
    import os
    import shlex
    import subprocess
    import sys

    from kvmigrate.synth.demo import LMCACHE_FACTS, MOONCAKE_FACTS, build_demo_root, describe, mooncake_findings

    root = os.path.join(work, "cache")
    log.info("demo: building the sample root %s", root)
    results = build_demo_root(root)
    with open(os.path.join(work, "FACTS.json"), "w") as f:
        json.dump({**DEMO_FACTS, **LMCACHE_FACTS, **MOONCAKE_FACTS}, f, indent=2)
    before = _snapshot(root)
    namespaces, tiers, stores = describe(results)
    click.echo(f"kvmigrate demo in {work}" + ("" if stays else " (a temp dir, removed at the end unless --keep)"))
    click.echo(f"  built {namespaces} under {root} (with injected defects)")
    click.echo(f"  and {tiers}")
    click.echo(f"  and {stores}")
    click.echo(f"  deployment facts in {work}/FACTS.json")
    manifest = os.path.join(work, "manifest.parquet")
    for n, (title, step_args, expected) in enumerate(_steps(root, work), 1):
        if step_args[:1] == ["migrate"] and "--apply" in step_args:
            expected = expected | _unapplied(manifest, first=n == 5)
        args = [step_args[0], *logging_flags, *step_args[1:]]
        shown = "kvmigrate " + " ".join(shlex.quote(a) for a in args)
        click.echo(f"\n== step {n}: {title}\n$ {shown}")
        log.info("demo: step %d: %s", n, shown, extra={"step": n})
        proc = subprocess.run([sys.executable, "-m", "kvmigrate", *args], capture_output=True, text=True)
        out = proc.stdout.rstrip()
        if out:
            click.echo(out)
        if proc.stderr.strip():
            click.echo(proc.stderr.rstrip(), err=True)
        click.echo(f"(exit code {proc.returncode})")
        if proc.returncode not in expected:
            raise StepFailed(f"demo step {n} exited {proc.returncode}, expected one of {sorted(expected)}",
                                   hint=f"the sample stays in {work}; rerun the step by hand: {shown}")
        if "-o" in step_args and not os.path.exists(step_args[step_args.index("-o") + 1]):
            raise StepFailed(f"demo step {n} exited {proc.returncode} without writing "
                             f"{step_args[step_args.index('-o') + 1]}",
                             hint=f"the sample stays in {work}; rerun the step by hand: {shown}")
        if n == 1:
            click.echo("\nWhat the scan found in the Mooncake stores (from the manifest):")
            for line in mooncake_findings(manifest):
                click.echo(f"  {line}")
    after = _snapshot(root)
    changed = [p for p in before if before[p] != after.get(p)]
    if changed:
        raise StepFailed(f"source files changed during the demo: {changed[:5]}",
                               hint=f"the sample stays in {work} to look at")
    click.echo("\nDone. Every source file is unchanged (inode, size, mtime, mode) after all steps.")


def _unapplied(manifest: str, first: bool) -> set[int]:
    """Exit codes an apply may add for work the scan planned that this kvmigrate does not
    apply yet (bit 1: pending, never written), said once before the first apply; none when
    the plan leaves nothing aside."""
    from kvmigrate.migrate.plan import build_plan

    aside = build_plan(manifest).not_built
    if not aside:
        return set()
    if first:
        for (title, action), n in sorted(aside.items()):
            click.echo(f"\nNote: {title}: {plural(n, 'object')} pending {action} (found by the scan) are not applied "
                       "by this kvmigrate yet: the apply writes none of them and exits 1 for them.")
    return {1, 1 | 4}


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
