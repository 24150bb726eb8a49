"""`migrate --apply` and `verify` stay out of the engine's way and say where they stopped
(issue 18 items 4, 5): --max-duration stops at a batch boundary with a consistent journal
and exit 32, the printed command resumes it; Ctrl-C/SIGTERM prints the journal and the
resume command; --bwlimit throttles copies; planning has its own bar."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvmigrate import manifest, pacing
from kvmigrate.migrate.apply import BATCH, CRASH_ENV
from kvmigrate.migrate.journal import read_records

from helpers import FakeClock  # tests/helpers/__init__.py: a clock the pacing tests move by hand
from helpers.cli_helpers import run, run_json

KVMIGRATE = str(Path(sys.executable).with_name("kvmigrate"))
FACTS = ["--model-dtype", "bfloat16", "--kv-kind", "full", "--total-kv-heads", "8", "--writer-tp", "1", "--writer-pp", "1"]


@pytest.fixture
def scanned(synth_root, tmp_path):
    """A vLLM S1 tree of 2.4 batches of blocks to link, and its hash-scan manifest."""
    root, results = synth_root({"family": "vllm", "scheme": "S1", "tp": 1, "blocks": 2 * BATCH + 400})
    out = tmp_path / "m.parquet"
    code, text = run("scan", root, *FACTS, "--verify", "hash", "-o", out, "-q")
    assert code == 1 and out.is_file(), text
    return root, out, len(results[0].block_files())


def _journal_records(root: Path) -> list[dict]:
    (journal,) = (root / ".kvmigrate" / "journals").glob("*.journal")
    return read_records(str(journal))


def _resume_command(text: str) -> list[str]:
    m = re.search(r"^  resume:  (kvmigrate .*)$", text, re.M)
    assert m, text
    return shlex.split(m.group(1))[1:]


def test_max_duration_stops_apply_at_a_batch_boundary_and_the_printed_command_resumes(scanned, no_limits):
    root, m, blocks = scanned
    pacing._LIMITS.clock = FakeClock(step=1000.0)  # the deadline's looks: target, batch 1, batch 2 (expired)
    code, text = run("migrate", "--manifest", m, "--apply", "--max-duration", "2500s")
    assert code == 32, text
    records = _journal_records(root)
    assert records[-1]["t"] == "interrupted"
    done = [r for r in records if r.get("t") == "done" and r.get("kind") == "block"]
    assert len(done) == BATCH  # the first batch, whole; nothing of the second was begun
    assert re.search(r"^kvmigrate: stopped: --max-duration 2500s elapsed", text, re.M)
    assert re.search(r"^  journal: \S+\.journal$", text, re.M)
    args = _resume_command(text)
    assert args[:3] == ["migrate", "--manifest", str(m)] and "--apply" in args
    pacing._LIMITS.clock = pacing.time.monotonic
    code, summary = run_json(*args)
    assert code == 0 and summary["apply"]["resumed"] is True
    placed = sum(1 for r in _journal_records(root) if r.get("t") == "done" and r.get("kind") == "block")
    assert placed == blocks
    journal = str(next((root / ".kvmigrate" / "journals").glob("*.journal")))
    assert run("verify", root, "--journal", journal, "-q") == (0, "")


def test_an_interrupted_apply_prints_its_journal_and_the_resume_command(scanned):
    root, m, blocks = scanned
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    stopped = subprocess.run([KVMIGRATE, "migrate", "--manifest", str(m), "--apply"], capture_output=True, text=True,
                             env={**env, CRASH_ENV: "created:5:TERM"}, timeout=120)
    assert stopped.returncode == 32, stopped.stderr
    journal = re.search(r"^  journal: (\S+)$", stopped.stderr, re.M).group(1)
    assert Path(journal).is_file() and read_records(journal)[-1]["t"] == "interrupted"
    assert f"undo:    kvmigrate rollback {journal}" in stopped.stderr
    resumed = subprocess.run([KVMIGRATE, *_resume_command(stopped.stderr), "--json"], capture_output=True,
                             text=True, env=env, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["apply"]["resumed"] is True


def test_bwlimit_throttles_copies(scanned, monkeypatch, no_limits):
    root, m, blocks = scanned
    clock = FakeClock()
    bucket = pacing.TokenBucket
    monkeypatch.setattr(pacing, "TokenBucket", lambda rate: bucket(rate, clock=clock, sleep=clock.sleep))
    code, text = run("migrate", "--manifest", m, "--mode", "copy", "--apply", "--bwlimit", "64K", "-q")
    assert code == 0, text
    copied = sum(os.path.getsize(root / r["path"]) for r in _journal_records(root)
                 if r.get("t") == "done" and r.get("kind") == "block")
    assert copied > 10 * (64 << 10)
    assert clock.slept * (64 << 10) >= copied - (64 << 10)


def test_max_duration_stops_verify_with_exit_32(scanned, no_limits):
    root, m, blocks = scanned
    assert run("migrate", "--manifest", m, "--apply", "-q") == (0, "")
    journal = str(next((root / ".kvmigrate" / "journals").glob("*.journal")))
    pacing._LIMITS.clock = FakeClock(step=1000.0)
    code, text = run("verify", root, "--journal", journal, "--max-duration", "2500s")
    assert code == 32, text
    assert "kvmigrate: stopped: --max-duration elapsed after 2 journaled blocks were checked" in text
    assert f"hint: rerun `kvmigrate verify {root} --journal {journal} --max-duration 2500s` in a longer window" in text
    pacing._LIMITS.clock = pacing.time.monotonic
    assert run("verify", root, "--journal", journal, "--max-duration", "1h", "-q") == (0, "")


def test_the_rerun_hint_of_a_stopped_verify_runs_with_its_verbosity(scanned, no_limits):
    root, m, blocks = scanned
    assert run("migrate", "--manifest", m, "--apply", "-q") == (0, "")
    journal = str(next((root / ".kvmigrate" / "journals").glob("*.journal")))
    pacing._LIMITS.clock = FakeClock(step=1000.0)
    code, text = run("verify", root, "--journal", journal, "--max-duration", "2500s", "-vv")
    assert code == 32, text
    hint = re.search(r"hint: rerun `([^`]+)`", text).group(1)
    assert "-v -v" in hint
    pacing._LIMITS.clock = pacing.time.monotonic
    code, text = run(*shlex.split(hint)[1:])
    assert code == 0, text


def test_planning_has_its_own_bar(scanned, capsys):
    from kvmigrate.options import ScanOptions
    from kvmigrate.pipeline import migration

    root, m, blocks = scanned
    with migration(None, str(m), ScanOptions(progress=True)) as planned:
        assert sum(tp.pending for tp in planned.plan.targets) == blocks
    err = capsys.readouterr().err
    assert re.search(r"plan: 100%\|[^|]*\| [\d.]+k?/[\d.]+k? \[", err), err[-400:]


def test_bwlimit_throttles_transforms(synth_root, tmp_path, monkeypatch, no_limits):
    """llm-d TP=2 full attention: every block is a concat of two rank files (a transform)."""
    root, _ = synth_root({"family": "llmd", "tp": 2, "blocks": 200})
    m = tmp_path / "t.parquet"
    code, text = run("scan", root, *FACTS, "--verify", "hash", "-o", m, "-q")
    assert code == 1, text
    clock = FakeClock()
    bucket = pacing.TokenBucket
    monkeypatch.setattr(pacing, "TokenBucket", lambda rate: bucket(rate, clock=clock, sleep=clock.sleep))
    code, summary = run_json("migrate", "--manifest", m, "--apply", "--bwlimit", "64K")
    assert code == 0 and summary["apply"]["transformed"] == 200, summary["outcomes"]
    read = sum(r["size"] for r in manifest.read_table(m).to_pylist() if r["block_hash"] is not None)  # both ranks
    assert read > 5 * (64 << 10)
    # every source byte read was paid for at the rate; none twice (the writer's read of what the
    # check read comes from the page cache)
    assert read - (64 << 10) <= clock.slept * (64 << 10) <= read + (64 << 10)
