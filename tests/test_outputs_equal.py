"""scripts/outputs_equal.py: the same kvmigrate on both sides prints and journals the same
things once what differs by nature is normalised (it is deterministic), and a kvmigrate
that prints one more line is caught, on one or two small synth trees."""

import sys
from pathlib import Path

import outputs_equal  # scripts/outputs_equal.py (pyproject.toml puts scripts/ on pytest's pythonpath)
import pytest

KVMIGRATE = Path(sys.executable).parent / "kvmigrate"  # this environment's console script
needs_console_script = pytest.mark.skipif(not KVMIGRATE.exists(), reason="no kvmigrate console script beside python")


@needs_console_script
def test_the_same_kvmigrate_on_both_sides_is_all_equal(tmp_path, capsys):
    code = outputs_equal.main([str(KVMIGRATE), str(KVMIGRATE), "--trees", "llmd-tp2-mla,vllm-S1-tp1-full/clean",
                               "--work", str(tmp_path / "w")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "all equal" in out
    # 16 commands' stdout, the migration and prune journals and their listing, the tree at the end, per tree
    assert f"{'all':<18}{2:>7}{2 * (16 + 3 + 1):>18}{2 * (16 + 3 + 1):>8}{0:>11}" in out


@needs_console_script
def test_one_more_line_of_report_is_a_difference(tmp_path, capsys):
    chatty = tmp_path / "chatty-kvmigrate"  # not a Python script: one process per command
    chatty.write_text(f'#!/bin/sh\n"{KVMIGRATE}" "$@"; rc=$?\n[ "$1" = report ] && echo "one more line"\nexit $rc\n')
    chatty.chmod(0o755)
    code = outputs_equal.main([str(KVMIGRATE), str(chatty), "--trees", "llmd-tp2-mla", "--work", str(tmp_path / "w")])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "llmd-tp2-mla/clean: report\n" in out and "+one more line" in out
    assert f"{'journals':<18}{1:>7}{3:>18}{3:>8}{0:>11}" in out  # the rest still equal


def test_normalising_keeps_what_a_command_says_and_drops_what_differs_by_nature():
    work = "/tmp/kvm-outputs-equal-x/old/000"
    text = (f"scanned {work}/root: 9 files in 0.3s -> 000/m1.parquet at 2026-12-06T15:22:28Z, 12.5 MiB/s\n"
            '{"run_id":"20261206T152228Z-16378-5338eb","ino":11840189,"size":433,"tool_version":"0.1.0"}\n'
            ".kvmigrate/quarantine/20261206T152255Z-16720-308e9f/a.bin config.json.kvmigrate-16378.tmp\n")
    assert outputs_equal.normalise(text, work) == (
        "scanned <W>/root: 9 files in <duration> -> 000/m1.parquet at <time>, <rate>\n"
        '{"run_id":<run_id>,"ino":<ino>,"size":433,"tool_version":<tool_version>}\n'
        ".kvmigrate/quarantine/<run>/a.bin config.json.kvmigrate-<pid>.tmp\n")
    assert outputs_equal.normalise("9 files", work) != outputs_equal.normalise("10 files", work)
