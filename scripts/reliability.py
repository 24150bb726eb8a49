#!/usr/bin/env python3
"""The reliability campaign: crash consistency, injected faults, a live engine, hostile input.

    python scripts/reliability.py            # full campaign -> reports/RELIABILITY.md (+ .json)
    python scripts/reliability.py --quick    # a few of each, report under --out (default: a temp dir)

What it does (issue 8; migration.md §3 is the rule book):

1. crash     `kvmigrate migrate --apply` in a subprocess on synth trees (vLLM S1 re-key
             links, llm-d MLA copy_pad, vllm.cpp rewrite_header, a mixed root, --mode copy),
             killed with SIGKILL at randomized points (the KVMIGRATE_CRASH_AT hook with a
             random count, or a random delay after the journal appears), sometimes twice,
             then rerun. After every kill: sources unchanged (inode, size, mtime_ns, mode,
             SHA-256), every file at a final path holds the bytes an uninterrupted run
             writes there, the journal accounts for every new path and its done records
             match the files. After the rerun: the tree equals an uninterrupted run's
             (bytes, and linked files share the source's inode), `verify` passes, and
             `rollback` restores the pre-migration listing and bytes.
2. faults    ENOSPC on a 256 KiB tmpfs (injected write failure if mount is refused),
             EXDEV (/dev/shm, and a bind mount of the same filesystem), EROFS (a read-only
             bind mount), EACCES (as uid 65534 via setpriv), EMLINK (an os.link shim; a real
             ext4 65000-link limit in the full run): the documented message, exit code, a
             consistent journal, and a rerun after fixing the condition that ends like an
             uninterrupted run.
3. engine    tests/helpers/engine_sim.py writes, loads and evicts blocks like each engine while
             `scan --verify hash` and `migrate --apply` run on the same root.
5. prune     (issue 19) `prune --apply`, `restore` and `prune --purge` on a migrated root of the
             three families, killed with SIGKILL at a random step (KVMIGRATE_CRASH_AT:
             prune_intent, prune_move:<n>, prune_dirs, restore:<n>, purge), then rerun: every
             legacy file's inode and bytes at exactly one name (its path or its quarantine
             path), the rerun converges (all pruned / all restored / the quarantine gone and
             `verify` clean through the targets).
4. hostile   hypothesis-built roots (garbage config.json, wrong types, deep nesting, names
             with `..`, non-UTF-8 names, symlink loops and links out of the root, FIFOs,
             device files, empty and 1 TiB sparse block files): scan, audit, migrate (dry
             run and --apply) never print a traceback, exit with documented bits, never
             follow a link out of the root and never write outside it.

Every command is recorded; every non-zero exit must come with a message naming a path
and a remedy. Any violation is listed in the report and makes the script exit 1.

The benches and oracles live in tests/helpers/reliability_harness.py (the CI-sized tests
tests/reliability/test_reliability_*.py use the same ones); this script runs them at campaign size
and writes the report.

To measure exactly one commit while others edit the checkout, run it from an export (and
build the C leaf walk there, or scan runs its Python walk; the report says which ran):
    git archive HEAD | tar -x -C /tmp/head && cd /tmp/head && python setup.py -q build_ext --inplace &&
    KVM_RELIABILITY_COMMIT=$(git -C /work/main rev-parse --short HEAD) PYTHONPATH=/tmp/head
    python scripts/reliability.py --out REPORT
Needs root (mount, mknod, setpriv); without it the mount-based faults fall back to
injected ones and say so.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers.reliability_harness import (  # noqa: E402  (tests/helpers/reliability_harness.py)
    SCENARIOS,
    CrashBench,
    Ledger,
    Scenario,
    engine_round,
    fault_eacces,
    fault_emlink,
    fault_enospc,
    fault_enospc_journal,
    fault_eperm_hardlink,
    fault_erofs,
    fault_erofs_root,
    fault_exdev_bind,
    fault_exdev_shm,
    hostile_recipes,
    hostile_trial,
    prune_trial,
    sh,
)

# ---------------------------------------------------------------------------------------
# The four parts at campaign size


def crash_campaign(work: Path, ledger: Ledger, *, kills: int, seed: int, max_trials: int | None = None,
                   scenarios: list[Scenario] | None = None) -> list[dict]:
    """Trials round-robin over the scenarios until `kills` kill points were hit."""
    benches = [CrashBench(s, work, ledger) for s in (scenarios or SCENARIOS)]
    rng = random.Random(seed)
    trials = []
    i = 0
    while ledger.counts["kill_points"] < kills and (max_trials is None or i < max_trials):
        bench = benches[i % len(benches)]
        trials.append(bench.trial(rng.randrange(2 ** 32)))
        i += 1
    return trials


def fault_campaign(work: Path, ledger: Ledger, *, real_emlink: bool = True) -> list[dict]:
    cases: list[Callable[[], dict]] = [
        lambda: fault_enospc(work, ledger),
        lambda: fault_enospc(work, ledger, force_injected=True),
        lambda: fault_enospc_journal(work, ledger),
        lambda: fault_exdev_shm(work, ledger),
        lambda: fault_exdev_bind(work, ledger),
        lambda: fault_erofs(work, ledger),
        lambda: fault_erofs_root(work, ledger),
        lambda: fault_eacces(work, ledger),
        lambda: fault_eperm_hardlink(work, ledger),
        lambda: fault_emlink(work, ledger, real=False),
    ]
    if real_emlink:
        cases.append(lambda: fault_emlink(work, ledger, real=True))
    return [case() for case in cases]


def engine_campaign(work: Path, ledger: Ledger, *, rounds: int, seed: int) -> list[dict]:
    return [engine_round(work, ledger, seed + i, verify=("hash", "size")[i % 2]) for i in range(rounds)]


def prune_campaign(work: Path, ledger: Ledger, *, trials: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [prune_trial(work, ledger, rng.randrange(2 ** 32)) for _ in range(trials)]


def hostile_campaign(work: Path, ledger: Ledger, *, examples: int, seed: int) -> list[dict]:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    records: list[dict] = []

    @hseed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(recipe=hostile_recipes())
    def run(recipe: dict) -> None:
        try:
            records.append(hostile_trial(work, ledger, recipe, len(records)))
        except Exception as exc:  # a defect of this harness, not of kvmigrate: keep going, report it
            ledger.violate("harness", f"hostile case {len(records)}: {type(exc).__name__}: {exc} "
                                      f"recipe {json.dumps(recipe)[:800]}")
            records.append({"case": len(records), "ok": False, "harness_error": str(exc)})

    run()
    return records

# ---------------------------------------------------------------------------------------
# The report

# Defects this campaign found in kvmigrate, each fixed with a regression test in
# tests/reliability/test_reliability_regressions.py (the campaign re-proves them on every run).
FOUND = [
    ("kill -9 between creating a journal file and writing its header left an empty `*.jsonl`; "
     "`rollback DIR` and `verify --journal DIR` then exited 2 and left the real runs alone",
     "journal directories skip a file whose header line never reached the disk",
     "test_a_journal_file_without_its_header_does_not_break_rollback_or_verify"),
    ("as a user who may write --dest but does not own the cache files, every hard link fails with EPERM "
     "(fs.protected_hardlinks); the message said \"run as a user that may write the destination\"",
     "the stop names protected_hardlinks and the remedies (run as the files' owner, or --mode copy)",
     "test_a_hard_link_the_kernel_refuses_names_the_cause_and_the_remedy"),
    ("EMLINK fails a block without stopping the run: exit 8 with nothing on stderr (nothing at all with -q)",
     "`migrate --apply` prints the failed count and the first failure on stderr",
     "test_failed_blocks_are_reported_on_stderr_too"),
    ("`migrate --apply` exited 4 for integrity states in the manifest without a word about them, and printed "
     "\"migration applied\" above an operational stop",
     "a line names the integrity findings and `kvmigrate audit ROOT`; a stop prints \"migration stopped early\"",
     "test_apply_says_why_it_exits_4_when_every_block_went_well, test_a_stopped_run_does_not_print_migration_applied"),
    ("a 1 TiB sparse config.json was read whole by scan (MemoryError traceback under a memory limit, "
     "the OOM killer without one) and by `identity`",
     "config.json larger than 16 MiB is config_invalid unread; `identity` refuses it",
     "test_an_enormous_config_json_is_not_read_into_memory, test_identity_refuses_an_enormous_config_without_"
     "reading_it"),
    ("`scan` exiting with findings did not say where to look", "it names `kvmigrate report MANIFEST`",
     "test_scan_with_findings_names_the_command_that_explains_them"),
    ("a vllm.cpp config.json holding a lone surrogate escape (\"\\ud800\") crashed scan and identity with "
     "UnicodeEncodeError", "such an identity is config_invalid (scan) / a usage error (identity)",
     "test_a_lone_surrogate_in_a_vllmcpp_config_is_config_invalid_not_a_traceback, "
     "test_identity_of_a_config_it_cannot_hash_is_a_usage_error"),
    ("`migrate --manifest` of a file that is not Parquet, and `rollback`/`verify` of a journal whose records "
     "lack keys, crashed with tracebacks", "usage errors (exit 2) naming the file, with a hint",
     "test_migrate_with_a_file_that_is_not_parquet_is_a_usage_error, "
     "test_a_journal_with_a_damaged_header_or_record_is_named_not_a_traceback"),
    ("a vLLM config.json whose model_name holds a lone surrogate escape (valid for vLLM, which hashes with "
     "ensure_ascii) crashed scan (writing the manifest), the reports and `identity` with UnicodeEncodeError",
     "such strings are shown with backslash escapes", "test_a_lone_surrogate_in_a_vllm_model_name_is_shown_"
     "escaped_not_a_traceback"),
    ("a kill after `migrate --apply` journaled \"complete\" but before it removed its namespace lock file left "
     "that file for good (no run resumes a complete journal); found by a double kill (vllm-S1-mode-copy, seed "
     "1054687125: created:12, then 2.6 ms into the resumed run)",
     "locks are released before \"complete\" is written, so such a kill leaves a run the next one resumes",
     "test_a_kill_between_the_last_block_and_complete_leaves_no_stale_lock"),
    ("`scan --verify size` (stat and headers only) read a vllm.cpp block file with an all-zero header whole, "
     "to tell zero_filled from header_invalid: a 1 TiB sparse file kept scan, audit and migrate busy for "
     "minutes (a hang in CI)", "only files up to 64 MiB are read for that; larger ones are header_invalid",
     "test_scan_verify_size_does_not_read_a_huge_zero_header_vllmcpp_file"),
    ("`report M -o FILE` exited 5 with nothing on stdout or stderr", "a stderr line says where the findings are "
     "(tests/report/test_report_cli.py now checks stdout, not stdout+stderr, for emptiness)",
     "test_report_to_a_file_with_findings_says_where_they_are"),
]
KNOWN_LIMITS = [
    "`scan --verify hash` (and `migrate ROOT`, which hashes by default) calls a block file of nothing but holes "
    "zero_filled without reading it (SEEK_DATA); a huge file with some data in it is still read whole.",
    "A symlink planted at a target folder (`<target>` or `<target>_r0`) stops the whole run (exit 8, "
    "\"refusing to write through a symlink\"), not just that namespace; the message names the path and "
    "the fix.",
    "The live-engine rounds restrict the simulated evictor to the source namespaces; a real evictor may also "
    "delete migrated files, which `verify` then reports as missing.",
    "Exits with findings only (bits 1 and 4: `scan`, `audit`, a dry run) explain themselves on stdout, their "
    "result channel (interface.md §5); the message check looks there for them and on stderr for every exit "
    "with bit 2, 8 or 32.",
]


def _machine() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    commit = sh("git", "-C", REPO, "rev-parse", "--short", "HEAD").stdout.strip()
    dirty = bool(sh("git", "-C", REPO, "status", "--porcelain", "--untracked-files=no").stdout.strip())
    if not commit and os.environ.get("KVM_RELIABILITY_COMMIT"):  # run from `git archive` of that commit
        commit, dirty = os.environ["KVM_RELIABILITY_COMMIT"] + " (clean export)", False
    # cwd "/": `python -c` puts the working folder first on sys.path, and a checkout there
    # would be reported instead of what the campaign's commands import (PYTHONPATH, venv)
    walk = subprocess.run([sys.executable, "-c", "import kvmigrate.scan as s; w = s.leaf_walk(); "
                           "print(w.__file__ if w else '')"],
                          capture_output=True, text=True, cwd="/").stdout.strip()
    return {"leaf_walk": f"C ({walk})" if walk else "Python",
            "cpu": cpu, "cores": os.cpu_count(), "memory": mem, "kernel": platform.release(),
            "python": platform.python_version(), "commit": commit + (" (+ uncommitted changes in the checkout)"
                                                                     if dirty else ""),
            "user": "root" if os.geteuid() == 0 else f"uid {os.geteuid()}"}


def _figures(ledger: Ledger) -> dict[str, int]:
    c = ledger.counts
    return {"kill points": c["kill_points"], "prune kill points": c["prune_kill_points"], "tracebacks": c["violation:traceback"],
            "files lost": c["violation:lost_source"] + c["violation:lost_block"],
            "files clobbered or partial": c["violation:clobbered"],
            "non-zero exits without a path and a remedy": c["violation:message"],
            "violations (all kinds)": len(ledger.violations)}


def render_report(ledger: Ledger, results: dict[str, Any], meta: dict[str, Any]) -> str:
    c = ledger.counts
    fig = _figures(ledger)
    out = [f"# Reliability campaign ({'quick' if meta['quick'] else 'full'})", "",
           "Regenerate: `python scripts/reliability.py` (full, writes this file and `reports/reliability.json`); "
           "`python scripts/reliability.py --quick` is the short version. The CI-sized checks are "
           "`tests/reliability/test_reliability_*.py`. What each part does is in the script's docstring; the rules are "
           "migration.md §3 and interface.md §4.", "",
           f"Run {meta['started']} on {meta['machine']['cpu']} ({meta['machine']['cores']} cores, "
           f"{meta['machine']['memory']}), Linux {meta['machine']['kernel']}, Python {meta['machine']['python']}, "
           f"as {meta['machine']['user']}; kvmigrate at {meta['machine']['commit']}, scan leaf walk "
           f"{meta['machine'].get('leaf_walk', '?')}. Work folder on "
           f"{meta['workfs']}. Seed {meta['seed']}. Duration {meta['seconds'] / 60:.1f} min "
           f"({', '.join(f'{k} {v:.0f} s' for k, v in meta['sections'].items())}); 1-minute load average "
           f"{meta['load'][0]:.1f} at the start, {meta['load'][1]:.1f} at the end (other work shares the "
           "machine).", "",
           "## Outcome", "",
           "| figure | value |", "|---|---|",
           f"| SIGKILL points (crash-point hook / random delay) | {c['kill_points']} "
           f"({c['kill_points:hook']} / {c['kill_points:delay']}) in {c['crash_trials']} trials |",
           f"| kills that landed after the run had finished (not counted) | {c['kill_missed']} |",
           f"| injected faults | {c['faults']} ({', '.join(sorted({r['fault'] for r in results.get('faults', [])}))}) |",
           f"| live-engine rounds | {c['engine_rounds']} ({c['engine_writes']} block files written, "
           f"{c['engine_deletes']} deleted by the engines meanwhile) |",
           f"| fuzzed hostile trees | {c['fuzzed_trees']} |",
           f"| prune / restore / purge trials (SIGKILLs landed) | {c['prune_trials']} ({c['prune_kill_points']}) |",
           f"| kvmigrate commands run | {c['commands']} ({c['nonzero_exits']} non-zero exits) |"]
    out += [f"| **{k}** | **{v}** |" for k, v in fig.items() if k not in ("kill points", "prune kill points")]
    out += [""]
    if ledger.violations:
        out += ["## Violations", ""] + [f"- {textwrap.shorten(v, 600)}" for v in ledger.violations[:50]] + [""]
    # crash
    trials = results.get("crash", [])
    if trials:
        out += ["## 1. Crash consistency (kill -9, then the same command again)", "",
                "Every trial: a random scenario root (restored by `rollback` between trials, so every trial also "
                "proves rollback), a random way in (`migrate --manifest M --apply` or `migrate ROOT --apply`, "
                "which rescans the half-migrated root), one or two SIGKILLs (the second during the resumed run), "
                "checks after each kill, then the rerun, `verify` and `rollback` checks.", "",
                "| scenario | trials | kill points | hook points hit | double kills | failed |", "|---|---|---|---|---|---|"]
        by: dict[str, list[dict]] = {}
        for t in trials:
            by.setdefault(t["scenario"], []).append(t)
        for name, ts in by.items():
            kills = [k for t in ts for k in t["kills"] if k["killed"]]
            points = Counter(k["at"].split(":")[0] for k in kills if k["how"] == "hook")
            out.append(f"| {name} | {len(ts)} | {len(kills)} | "
                       f"{', '.join(f'{p} {n}' for p, n in sorted(points.items()))} | "
                       f"{sum(1 for t in ts if len(t['kills']) > 1)} | {sum(1 for t in ts if not t['ok'])} |")
        killed = [k for t in trials for k in t["kills"] if k["killed"]]
        none = sum(1 for k in killed if k["blocks_done"] == 0)
        done = sum(1 for k in killed if k["blocks_done"] >= k["blocks_total"])
        out += ["", f"Where the kills landed: {none} before the first block was created, "
                f"{len(killed) - none - done} between blocks (some created, some not), {done} after the last "
                "block (config, lock or journal completion still pending)."]
        seeds = [t["seed"] for t in trials]
        out += ["", f"Trial seeds (each reproduces its trial: `CrashBench(...).trial(seed)`): first {seeds[:8]}, "
                f"all in reliability.json.", ""]
    faults = results.get("faults", [])
    if faults:
        out += ["## 2. Injected faults", "",
                "Each: the command under the fault (exit 8 and the message below), then the tree checked like "
                "after a kill, then the condition fixed and the same command rerun (ends like an uninterrupted "
                "run), then `rollback`.", "",
                "| fault | where | mechanism | message (first line) | ok |", "|---|---|---|---|---|"]
        for r in faults:
            msg = textwrap.shorten(r.get("message", "").replace(str(meta["work"]), "$WORK"), 230).replace("|", "\\|")
            out.append(f"| {r['fault']} | {r['where']} | {r.get('mechanism', '')} | {msg} | "
                       f"{'yes' if r['ok'] else 'NO'} |")
        out += [""]
    rounds = results.get("engine", [])
    if rounds:
        out += ["## 3. Live engines (tests/helpers/engine_sim.py)", "",
                "Three engine processes (vLLM: `<hex>.bin_<n>.tmp` + `os.replace`; llm-d: the same, both rank "
                "files; vllm.cpp: `<hex>.bin.<pid>.<n>.tmp` + `rename`) store new blocks, leave short residue "
                "and abandoned temp files, load blocks (deleting short reads and bad headers) and evict the least "
                "recently used, while `scan --verify hash` and then `migrate ROOT --apply` run.", "",
                "| round | engine ops | scan rows by status | migrate outcomes | ok |", "|---|---|---|---|---|"]
        for r in rounds:
            out.append(f"| seed {r['seed']}, migrate --verify {r['verify']} | "
                       f"{', '.join(f'{k} {v}' for k, v in sorted(r['engine_ops'].items()))} | "
                       f"{', '.join(f'{k} {v}' for k, v in sorted(r.get('scan_status', {}).items()))} | "
                       f"{', '.join(f'{k} {v}' for k, v in sorted(r['migrate_outcomes'].items()) if v)} | "
                       f"{'yes' if r['ok'] else 'NO'} |")
        out += ["", "Integrity states appear only on the residue the engines wrote short on purpose; every created "
                "file holds its source's bytes (link), bytes + zero pad (copy_pad) or the payload under a header "
                "the target identity verifies (rewrite_header); every planned block not created has a skip "
                "record in the journal (changed_since_scan when an engine deleted its source meanwhile).", ""]
    if c["fuzzed_trees"]:
        made = {k.split(":", 1)[1]: v for k, v in c.items() if k.startswith("fuzz:")}
        out += ["## 4. Hostile trees (hypothesis)", "",
                f"{c['fuzzed_trees']} roots (hypothesis seed {meta['seed']}); on each: `scan`, `scan --verify hash` "
                "(unless a 1 TiB file is present), `audit`, `report --format html` (a `<script>` model name must "
                "come out escaped), `migrate` dry run, `migrate --apply` (after planting "
                "symlinks where it will write), `verify` and `rollback`. Checked: no traceback, exit codes made of "
                "the interface's bits, every regular file's atime, bytes and inode unchanged (atimes were moved "
                "3 days back first, so any read without O_NOATIME shows), the marker file and the namespace "
                "outside the root untouched (links point there), nothing created next to the root, in TMPDIR or "
                "outside the target namespaces, rollback restores the root.", "",
                "Elements generated (occurrences over all trees):", "",
                ", ".join(f"{k} {v}" for k, v in sorted(made.items())), ""]
    pruned = results.get("prune", [])
    if pruned:
        out += ["## 5. Prune, restore, purge (kill -9, then the same command again)", "",
                "Every trial: a migrated root of the three families (vLLM link, llm-d copy_pad, vllm.cpp "
                "rewrite_header), one step killed at a random point, the tree checked (every legacy file's inode "
                "and bytes at exactly one name), the step rerun, then `restore` (or, after a purge, `verify`).", "",
                "| step | trials | SIGKILLs landed | kill points | failed |", "|---|---|---|---|---|"]
        for step in ("prune", "restore", "purge"):
            ts = [t for t in pruned if t["step"] == step]
            if ts:
                points = Counter(t["at"].split(":")[0] for t in ts if t["killed"])
                out.append(f"| {step} | {len(ts)} | {sum(t['killed'] for t in ts)} | "
                           f"{', '.join(f'{p} {n}' for p, n in sorted(points.items()))} | "
                           f"{sum(1 for t in ts if not t['ok'])} |")
        out += [""]
    out += ["## Defects found and fixed", "",
            "| defect | fix | regression test |", "|---|---|---|"]
    out += [f"| {a} | {b} | `{t}` |" for a, b, t in FOUND]
    out += ["", "## Known limits", ""] + [f"- {x}" for x in KNOWN_LIMITS] + [""]
    slowest = sorted((r for r in ledger.runs if r.rc != -999), key=lambda r: r.seconds, reverse=True)[:5]
    if slowest:
        out += ["## Slowest commands", "",
                "A tiny tree that keeps a command busy for long is a finding too (a 1 TiB sparse file read "
                "whole was one); wall-clock seconds on the shared machine:", ""]
        out += [f"- {r.seconds:.1f} s: {textwrap.shorten(r.brief().replace(str(meta['work']), '$WORK'), 220)}"
                for r in slowest] + [""]
    notes = sorted(set(ledger.notes))
    if notes:
        out += ["## Notes from this run", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few of each (CI-sized)")
    ap.add_argument("--seed", type=int, default=20260611)
    ap.add_argument("--kills", type=int, default=None, help="SIGKILL points to reach (full: 220, quick: 12)")
    ap.add_argument("--fuzz", type=int, default=None, help="hostile trees (full: 120, quick: 10)")
    ap.add_argument("--engine-rounds", type=int, default=None, help="live-engine rounds (full: 6, quick: 1)")
    ap.add_argument("--prune-trials", type=int, default=None, help="prune/restore/purge kill trials (full: 30, "
                    "quick: 3)")
    ap.add_argument("--only", choices=["crash", "faults", "engine", "hostile", "prune"], action="append",
                    help="run only these parts (repeatable)")
    ap.add_argument("--out", help="report path (full: reports/RELIABILITY.md; quick: <workdir>/RELIABILITY.md)")
    ap.add_argument("--workdir", help="where trees are built (default: a new temp folder, removed unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args(argv)
    quick = args.quick
    kills = args.kills if args.kills is not None else (12 if quick else 220)
    fuzz = args.fuzz if args.fuzz is not None else (10 if quick else 120)
    rounds = args.engine_rounds if args.engine_rounds is not None else (1 if quick else 6)
    prune_trials = args.prune_trials if args.prune_trials is not None else (3 if quick else 30)
    parts = args.only or ["crash", "faults", "engine", "hostile", "prune"]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvm-reliability-"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else (work / "RELIABILITY.md" if quick else REPO / "reports" / "RELIABILITY.md")
    ledger = Ledger()
    results: dict[str, Any] = {}
    sections: dict[str, float] = {}
    workfs = sh("findmnt", "-no", "FSTYPE", "-T", work).stdout.strip() + f" ({work})"
    started = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    steps = [("crash", lambda: crash_campaign(work, ledger, kills=kills, seed=args.seed)),
             ("faults", lambda: fault_campaign(work, ledger)),
             ("engine", lambda: engine_campaign(work, ledger, rounds=rounds, seed=args.seed)),
             ("hostile", lambda: hostile_campaign(work, ledger, examples=fuzz, seed=args.seed)),
             ("prune", lambda: prune_campaign(work, ledger, trials=prune_trials, seed=args.seed))]
    try:
        for name, step in steps:
            if name not in parts:
                continue
            t = time.monotonic()
            print(f"reliability: {name} ...", file=sys.stderr, flush=True)
            results[name] = step()
            sections[name] = time.monotonic() - t
            print(f"reliability: {name} done in {sections[name]:.0f} s, {len(ledger.violations)} violations so far",
                  file=sys.stderr, flush=True)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    meta = {"quick": quick, "seed": args.seed, "started": started, "seconds": time.monotonic() - t0,
            "sections": sections, "machine": _machine(),
            "workfs": workfs, "work": str(work), "load": (load_before, os.getloadavg()[0])}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_report(ledger, results, meta) + "\n")
    raw = out.with_name("reliability.json") if not quick else out.with_suffix(".json")
    raw.write_text(json.dumps({"meta": meta, "figures": _figures(ledger), "counts": dict(ledger.counts),
                               "violations": ledger.violations, "results": results}, indent=1, default=str) + "\n")
    fig = _figures(ledger)
    print(f"reliability: {fig} in {meta['seconds'] / 60:.1f} min -> {out}", file=sys.stderr)
    return 1 if ledger.violations else 0


if __name__ == "__main__":
    sys.exit(main())
