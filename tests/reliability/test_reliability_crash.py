"""Crash consistency, CI-sized (scripts/reliability.py runs the full campaign): kill -9 in
`migrate --apply` at the crash-point hook or after a random delay, check the tree the kill
left, rerun, compare with an uninterrupted run, verify, roll back (migration.md §3.1, §3.3,
§3.5)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from kvmigrate.migrate.apply import CRASH_ENV

from helpers import reliability_harness as R  # tests/helpers/reliability_harness.py: the campaign's benches and oracles

pytestmark = pytest.mark.slow  # reliability-sized: `pytest -m 'not slow'` leaves it out, CI runs it

SCENARIOS = {s.name: s for s in R.SCENARIOS}


def _assert_clean(ledger: R.Ledger) -> None:
    assert ledger.violations == [], "\n".join(ledger.violations)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_kill_9_at_a_hook_point_and_after_a_random_delay_ends_like_an_uninterrupted_run(tmp_path, name):
    ledger = R.Ledger()
    bench = R.CrashBench(SCENARIOS[name], tmp_path, ledger)
    assert bench.hits["created"] > 0  # the reference run created blocks: there is something to interrupt
    hook = bench.trial(101, via="manifest", how="hook", kills=1)
    delay = bench.trial(202, via="scan", how="delay", kills=1)
    _assert_clean(ledger)
    assert hook["ok"] and delay["ok"]
    assert hook["kills"][0]["killed"]  # the hook always fires: n is drawn within the reference run's hits
    assert ledger.counts["kill_points"] >= 1


def test_a_second_kill_during_the_resumed_run(tmp_path):
    ledger = R.Ledger()
    bench = R.CrashBench(SCENARIOS["mixed-3-families"], tmp_path, ledger)
    record = bench.trial(7, via="manifest", how="hook", kills=2)
    _assert_clean(ledger)
    assert len(record["kills"]) == 2 and record["ok"]


def test_the_checks_after_a_kill_catch_partial_unjournaled_and_altered_files(tmp_path):
    """The harness must be able to fail: plant each defect it looks for in a killed tree."""
    ledger = R.Ledger()
    bench = R.CrashBench(SCENARIOS["vllm-S1-mode-copy"], tmp_path, ledger)
    run, _, _ = bench._popen(bench.argv("manifest"), {CRASH_ENV: "created:3"}, None)
    assert run.rc == -signal.SIGKILL
    clean = R.check_after_kill(bench.root, bench.root, bench.pristine, bench.ref_new, bench.root)
    assert clean == []

    view = R.read_journals(bench.root)
    # done records are written per batch: the blocks made before the kill are those of the
    # intent that exist (the resumed run adopts them)
    planned = sorted(p for p, i in view.intents.items() if i.get("kind") == "block")
    created = [p for p in planned if (bench.root / p).exists()]
    os.truncate(bench.root / created[0], 100)  # a partial file at a final path
    planned_not_done = [p for p in planned if not (bench.root / p).exists()]
    (bench.root / planned_not_done[0]).parent.mkdir(parents=True, exist_ok=True)
    (bench.root / planned_not_done[0]).write_bytes(b"\1" * 4096)  # other bytes at a planned path
    stray = bench.root / created[1].rsplit("/", 1)[0] / ("f" * 64 + ".bin")
    stray.write_bytes(b"stray")  # a path neither the journal nor the reference knows
    source = next(r for r, e in bench.pristine.items() if r.endswith(".bin"))
    with open(bench.root / source, "r+b") as f:
        f.write(b"\xff")  # an altered source

    found = R.check_after_kill(bench.root, bench.root, bench.pristine, bench.ref_new, bench.root)
    kinds = {k for k, _ in found}
    details = "\n".join(d for _, d in found)
    assert {"lost_source", "clobbered", "journal"} <= kinds, found
    assert created[0] in details and planned_not_done[0] in details and stray.name in details and source in details


def test_a_torn_journal_line_is_allowed_but_a_damaged_middle_line_is_not(tmp_path):
    good = tmp_path / "a.jsonl"
    good.write_text(json.dumps({"t": "header"}) + "\n" + '{"t":"int')
    assert R.parse_journal(good)[1] == []
    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps({"t": "header"}) + "\nnot json\n" + json.dumps({"t": "complete"}) + "\n")
    assert R.parse_journal(bad)[1]


def test_a_non_zero_exit_must_name_a_path_and_a_remedy():
    def run(rc, out="", err=""):
        return R.Run("t", [], rc, out, err, 0.0)

    assert R.message_problem(run(8, err="kvmigrate: error: no space left on device")) is not None
    assert R.message_problem(run(8, err="kvmigrate: error: /d/x: no space\n  hint: free space, then rerun")) is None
    assert R.message_problem(run(8, out="/d/x: failed; rerun with --mode auto")) is not None  # stops go to stderr
    assert R.message_problem(run(1, out="scanned /r\nfindings: foreign 1\nexit code 1")) is not None
    assert R.message_problem(run(-9)) is None  # killed: nothing to say
