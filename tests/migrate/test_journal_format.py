"""Journal format 2 (migration.md §3.5): compressed frames, links as columns, a torn tail
cut off, format-1 journals still read."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from kvmigrate import layout
from kvmigrate.migrate import journal as jn
from kvmigrate.migrate.apply import CRASH_ENV
from kvmigrate.migrate.journal import read_records

from helpers.cli_helpers import run, run_json
from helpers.reference_reader import listing

MLA = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]
KVMIGRATE = str(Path(sys.executable).with_name("kvmigrate"))
LINKS = {"family": "llmd", "tp": 2, "kv_kind": "mla", "layers": 4, "page_bytes": 1024}  # every action `link`


def kvmigrate(*args, env_extra=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    return subprocess.run([KVMIGRATE, *map(str, args)], capture_output=True, text=True, env={**env, **(env_extra or {})},
                          timeout=300)


def test_a_linked_block_costs_at_most_100_journal_bytes(tmp_path, synth_root):
    root, _ = synth_root({**LINKS, "blocks": 4000})
    journal = tmp_path / "j.jsonl"
    code, summary = run_json("migrate", root, *MLA, "--apply", "--journal", journal)
    assert code == 0 and summary["apply"]["outcomes"]["created"] == 4000
    # (every block in its own <hhh>/<hh> folder pair, mostly: the folders are journaled too)
    assert journal.stat().st_size / 4000 <= 100, journal.stat().st_size
    done = [r for r in read_records(journal) if r["t"] == "done" and r["kind"] == "block"]
    assert len(done) == 4000 and all(r["how"] == "link" and r["mtime_ns"] and r["xxh3_128"] for r in done)


def test_a_kill_mid_batch_then_a_torn_tail_resumes_and_is_cut_off(tmp_path, synth_root):
    """kill -9 after 300 links (mid-batch, nothing of the batch's done records written),
    then the last frame is torn: the rerun resumes, drops the torn bytes before appending,
    and ends like an uninterrupted run; rollback then restores the tree."""
    root, _ = synth_root({**LINKS, "blocks": 1500})
    pristine = listing(root, with_times=False)
    killed = kvmigrate("migrate", root, *MLA, "--apply", env_extra={CRASH_ENV: "created:300"})
    assert killed.returncode == -signal.SIGKILL
    (journal,) = (root / layout.OWN_DIR / "journals").iterdir()
    size, records = journal.stat().st_size, read_records(journal)
    with open(journal, "ab") as f:  # a frame cut short: header and part of its payload
        f.write(jn.FRAME.pack(jn.MAGIC, 1000, 0) + b"\x78\x9c" + b"\0" * 100)
    assert read_records(journal) == records  # the torn frame is ignored
    assert jn.valid_end(str(journal)) == size
    resumed = kvmigrate("migrate", root, *MLA, "--apply", "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["apply"]["resumed"] is True
    assert jn.valid_end(str(journal)) == journal.stat().st_size  # no torn bytes left in the middle
    records = read_records(journal)
    assert records[-1]["t"] == "complete"
    made = {r["path"] for r in records if r["t"] == "done" and r.get("kind") == "block"}
    assert len(made) == 1500
    assert run("rollback", journal)[0] == 0
    assert listing(root, exclude_top=(layout.OWN_DIR,), with_times=False) == pristine


def _as_format_1(journal, out) -> None:
    """The same runs as a format-1 journal (JSON lines, one done record per link)."""
    records = read_records(journal)
    records[0] = {**records[0], "v": 1}
    out.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_format_1_journal_is_still_verified_and_rolled_back(tmp_path, synth_root):
    root, _ = synth_root({**LINKS, "blocks": 200})
    pristine = listing(root, with_times=False)
    journal, old = tmp_path / "j.jsonl", tmp_path / "old.jsonl"
    assert run("migrate", root, *MLA, "--apply", "--journal", journal)[0] == 0
    _as_format_1(journal, old)
    code, result = run_json("verify", root, "--journal", old)
    assert code == 0 and result["checked"]["blocks"] == 200
    code, result = run_json("rollback", old)
    assert code == 0 and result["removed"]["block"] == 200
    assert listing(root, exclude_top=(layout.OWN_DIR,), with_times=False) == pristine
    assert json.loads(old.read_text().splitlines()[-1])["t"] == "rolled_back"  # appended in its own format


def test_an_unfinished_format_1_run_is_not_resumed_and_names_its_release(tmp_path, synth_root):
    root, _ = synth_root({**LINKS, "blocks": 200})
    journal = tmp_path / "j.jsonl"
    assert run("migrate", root, *MLA, "--apply", "--journal", journal)[0] == 0
    jdir = tmp_path / "journals"
    jdir.mkdir()
    old = jdir / "old.jsonl"
    _as_format_1(journal, old)
    old.write_text("".join(line + "\n" for line in old.read_text().splitlines() if '"t": "complete"' not in line))
    code, out = run("migrate", root, *MLA, "--apply", "--journal", jdir)
    assert code == 2, out
    assert str(old) in out and jn.V1_RELEASE in out and f"kvmigrate rollback {old}" in out


def test_a_damaged_middle_frame_is_never_truncated_away(tmp_path, synth_root):
    """Bad bytes followed by whole frames are damage, not a torn tail: the rerun refuses
    to append (exit 8) instead of cutting the journaled records after it."""
    root, _ = synth_root({**LINKS, "blocks": 300})
    killed = kvmigrate("migrate", root, *MLA, "--apply", env_extra={CRASH_ENV: "created:200"})
    assert killed.returncode == -signal.SIGKILL
    (journal,) = (root / layout.OWN_DIR / "journals").iterdir()
    data = bytearray(journal.read_bytes())
    second = data.find(jn.MAGIC, 1)
    data[second + jn.FRAME.size + 2] ^= 0xFF  # a byte of the second frame's payload: its CRC fails
    journal.write_bytes(bytes(data))
    rerun = kvmigrate("migrate", root, *MLA, "--apply")
    assert rerun.returncode == 8, rerun.stderr
    assert "damaged at byte" in rerun.stderr and str(journal) in rerun.stderr
    assert journal.read_bytes() == bytes(data)  # nothing cut, nothing appended


def test_a_journal_on_another_filesystem_migrates_verifies_and_rolls_back(tmp_path, synth_root):
    """`--journal DIR` on another filesystem (issue 18 item 2): /dev/shm is a tmpfs, the tree
    is on tmp_path's filesystem. The journal lives there, the lock stays beside the target,
    and verify and rollback read it from there."""
    import shutil
    import tempfile

    root, _ = synth_root({**LINKS, "blocks": 60})
    shm = Path(tempfile.mkdtemp(prefix="kvmigrate-journal-", dir="/dev/shm"))
    try:
        assert os.stat(shm).st_dev != os.stat(root).st_dev, "the test needs /dev/shm on another filesystem"
        journal = shm / "journals"
        before = listing(root, with_times=False)
        code, summary = run_json("migrate", root, *MLA, "--apply", "--journal", journal)
        assert code == 0 and summary["apply"]["outcomes"]["created"] == 60
        (jfile,) = journal.glob("*.journal")
        assert not (root / ".kvmigrate" / "journals").exists()  # nothing journaled on the cache's filesystem
        locks = [r["path"] for r in read_records(jfile) if r["t"] == "lock"]
        targets = {r["base"] for r in read_records(jfile) if r["t"] == "target"}
        # the lock was taken beside the target, on the cache's filesystem (and released)
        assert locks and {p.split("/")[0] for p in locks} <= targets, (locks, targets)
        assert all(p.endswith("/" + layout.LOCK_NAME) and not (root / p).exists() for p in locks)
        code, out = run("verify", root, "--journal", jfile)
        assert code == 0, out
        code, out = run("rollback", jfile)
        assert code == 0, out
        after = {k: v for k, v in listing(root, with_times=False).items() if ".kvmigrate" not in k}
        assert after == {k: v for k, v in before.items() if ".kvmigrate" not in k}
    finally:
        shutil.rmtree(shm, ignore_errors=True)
