"""kill -9 in the middle of `migrate --apply`, then the same command again: the run resumes
from its journal and ends exactly like an uninterrupted one (migration.md §3.5)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvmigrate import layout
from kvmigrate.migrate.apply import CRASH_ENV
from kvmigrate.migrate.journal import read_records

from helpers.reference_reader import content_listing, listing

KVMIGRATE = str(Path(sys.executable).with_name("kvmigrate"))
SPECS = (
    {"family": "vllmcpp", "tp": 2, "kv_kind": "mla", "model_name": "org/cpp-model"},   # rewrite_header
    {"family": "vllm", "scheme": "S1", "tp": 1, "model_name": "org/full-model"},       # link
    {"family": "llmd", "tp": 2, "kv_kind": "mla", "model_name": "org/mla-model"},      # copy_pad
)
FACTS = {"org/mla-model": {"kv_kind": "mla", "model_dtype": "bfloat16"},
         "org/full-model": {"kv_kind": "full", "total_kv_heads": 8, "model_dtype": "bfloat16", "writer_tp": 1,
                            "writer_pp": 1}}


def kvmigrate(*args, env_extra=None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(CRASH_ENV, None)
    env.update(env_extra or {})
    return subprocess.run([KVMIGRATE, *map(str, args)], capture_output=True, text=True, env=env, timeout=120)


def source_map(root) -> dict[int, str]:
    """inode -> relpath of every source file (to recognise hard links in the result)."""
    out = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            p = os.path.join(d, f)
            out[os.lstat(p).st_ino] = os.path.relpath(p, root)
    return out


@pytest.fixture
def two_roots(tmp_path, synth_root):
    a, _ = synth_root(*SPECS, root_name="a")
    b, _ = synth_root(*SPECS, root_name="b")
    facts = tmp_path / "facts.json"
    facts.write_text(json.dumps(FACTS))
    return a, b, ["--facts", facts]


@pytest.mark.slow  # big property test / kill matrix: CI runs it, `-m 'not slow'` leaves it out
@pytest.mark.parametrize("crash_at", ["intent:1", "tmp_written:3", "linked:2", "created:8", "created:14"])
def test_kill_9_then_rerun_ends_like_an_uninterrupted_run(two_roots, crash_at):
    a, b, facts = two_roots
    map_a, map_b = source_map(a), source_map(b)
    pristine_b = listing(b, with_times=False)

    done = kvmigrate("migrate", a, *facts, "--apply")
    assert done.returncode == 0, done.stderr

    killed = kvmigrate("migrate", b, *facts, "--apply", env_extra={CRASH_ENV: crash_at})
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr)
    (journal,) = (b / layout.OWN_DIR / "journals").iterdir()
    assert not any(r["t"] == "complete" for r in read_records(journal))

    resumed = kvmigrate("migrate", b, *facts, "--apply", "--json")
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout)
    assert summary["apply"]["resumed"] is True
    assert summary["apply"]["journal"] == str(journal)  # the same journal, continued

    assert content_listing(b, sources=map_b) == content_listing(a, sources=map_a)
    assert not list(b.rglob("*.kvmigrate-*.tmp")) and not list(b.rglob(layout.LOCK_NAME))
    records = read_records(journal)
    assert records[-1]["t"] == "complete"

    # every file the two processes created is accounted for: rollback restores the tree
    rb = kvmigrate("rollback", journal)
    assert rb.returncode == 0, rb.stdout + rb.stderr
    assert listing(b, exclude_top=(layout.OWN_DIR,), with_times=False) == pristine_b


def test_a_complete_journal_is_not_resumed(two_roots):
    a, _, facts = two_roots
    first = kvmigrate("migrate", a, *facts, "--apply", "--json")
    second = kvmigrate("migrate", a, *facts, "--apply", "--json")
    s1, s2 = json.loads(first.stdout), json.loads(second.stdout)
    assert s2["apply"]["resumed"] is False and s2["apply"]["journal"] != s1["apply"]["journal"]
    assert s2["outcomes"]["created"] == 0


def test_rollback_of_an_interrupted_run_removes_what_it_left(two_roots):
    _, b, facts = two_roots
    pristine = listing(b, with_times=False)
    killed = kvmigrate("migrate", b, *facts, "--apply", env_extra={CRASH_ENV: "linked:2"})
    assert killed.returncode == -signal.SIGKILL
    assert list(b.rglob("*.kvmigrate-*.tmp"))  # the crash left a temp file and a lock behind
    assert list(b.rglob(layout.LOCK_NAME))
    (journal,) = (b / layout.OWN_DIR / "journals").iterdir()
    rb = kvmigrate("rollback", journal, "--json")
    assert rb.returncode == 0, rb.stdout
    assert listing(b, exclude_top=(layout.OWN_DIR,), with_times=False) == pristine
    # a rolled-back journal is not resumed: the next run starts a new one
    again = kvmigrate("migrate", b, *facts, "--apply", "--json")
    assert json.loads(again.stdout)["apply"]["resumed"] is False


def test_sigterm_stops_cleanly_and_the_rerun_resumes(two_roots):
    a, b, facts = two_roots
    map_a, map_b = source_map(a), source_map(b)
    assert kvmigrate("migrate", a, *facts, "--apply").returncode == 0
    stopped = kvmigrate("migrate", b, *facts, "--apply", env_extra={CRASH_ENV: "created:5:TERM"})
    assert stopped.returncode == 32 and "interrupted" in stopped.stderr
    assert not list(b.rglob(layout.LOCK_NAME))  # released on the way out
    (journal,) = (b / layout.OWN_DIR / "journals").iterdir()
    assert read_records(journal)[-1]["t"] == "interrupted"
    resumed = kvmigrate("migrate", b, *facts, "--apply", "--json")
    assert resumed.returncode == 0 and json.loads(resumed.stdout)["apply"]["resumed"] is True
    assert content_listing(b, sources=map_b) == content_listing(a, sources=map_a)


def _wait_stopped(pid: int) -> None:
    import time

    for _ in range(600):
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.05)
    raise AssertionError("the first run never reached its pause point")


def test_a_second_run_of_the_same_command_never_touches_a_live_run(two_roots):
    """While a run is paused mid-copy (its temp file published but not yet removed), the
    same command must fail fast instead of 'resuming' it and deleting its temp files."""
    a, b, facts = two_roots
    map_a, map_b = source_map(a), source_map(b)
    assert kvmigrate("migrate", a, *facts, "--apply").returncode == 0
    env = dict(os.environ, **{CRASH_ENV: "linked:2:STOP"})
    first = subprocess.Popen([KVMIGRATE, "migrate", str(b), *map(str, facts), "--apply"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_stopped(first.pid)
        temps = list(b.rglob("*.kvmigrate-*.tmp"))
        assert temps
        second = kvmigrate("migrate", b, *facts, "--apply")
        assert second.returncode == 8
        assert "in use by another kvmigrate run" in second.stderr and f"pid {first.pid}" in second.stderr
        assert all(t.exists() for t in temps)
    finally:
        os.kill(first.pid, signal.SIGCONT)
        out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert content_listing(b, sources=map_b) == content_listing(a, sources=map_a)


@pytest.mark.parametrize("digest", [bytes(range(16)), None])
def test_a_link_done_record_reads_back_like_the_generic_one(tmp_path, digest):
    """`done_link` formats the hot record by hand: it must parse to exactly what `done`
    writes (paths with quotes and non-ASCII names included), and both stay buffered until
    the next sync."""
    from kvmigrate.migrate.journal import JournalWriter, read_records

    block = tmp_path / 'f"é.bin'
    block.write_bytes(b"x" * 7)
    st = os.lstat(block)
    path = 'base_r0/abc/de_g1/f"é.bin'
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    wa = JournalWriter.create(str(a), {"pid": 1})
    wb = JournalWriter.create(str(b), {"pid": 1})
    rec = {"kind": "block", "path": path, "ino": st.st_ino, "dev": st.st_dev, "size": st.st_size,
           "mtime_ns": st.st_mtime_ns, "how": "link", "action": "link"}
    if digest is not None:
        rec["xxh3_128"] = digest.hex()
    wa.done(rec)
    wb.done_link(path, st, "link", digest)
    assert len(read_records(str(b))) == 1  # the header only: done records wait for the sync
    wa.sync(), wb.sync()
    assert read_records(str(a))[1:] == read_records(str(b))[1:] == [{"t": "done", **rec}]
    wa.close(), wb.close()


def test_an_interrupted_rerun_never_adopts_blocks_an_earlier_run_made(tmp_path, two_roots):
    """kill -9 right after the intent of a rerun of one manifest: its intent lists blocks
    the first run made; neither the resumed run nor a rollback of its journal may take
    them as its own (rollback would remove the first run's links)."""
    a, _, facts = two_roots
    manifest = tmp_path / "m.parquet"
    assert kvmigrate("scan", a, *facts, "-o", manifest).returncode in (0, 1)
    assert kvmigrate("migrate", "--manifest", manifest, "--apply").returncode == 0
    migrated = listing(a, exclude_top=(layout.OWN_DIR,), with_times=False)
    second = tmp_path / "second.jsonl"
    killed = kvmigrate("migrate", "--manifest", manifest, "--apply", "--journal", second,
                       env_extra={CRASH_ENV: "intent:1"})
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr)
    dry = json.loads(kvmigrate("rollback", "--dry-run", "--json", second).stdout)
    assert dry["removed"].get("block", 0) == 0, dry
    resumed = kvmigrate("migrate", "--manifest", manifest, "--apply", "--journal", second, "--json")
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout)
    assert summary["apply"]["resumed"] is True and summary["outcomes"]["created"] == 0
    assert summary["apply"]["recovered"] == 0, summary["apply"]
    rb = json.loads(kvmigrate("rollback", "--json", second).stdout)
    assert rb["removed"].get("block", 0) == 0, rb
    assert listing(a, exclude_top=(layout.OWN_DIR,), with_times=False) == migrated
