"""`kvmigrate rollback JOURNAL`: removes exactly what a migration created, nothing else."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from kvmigrate import layout
from kvmigrate.migrate.journal import read_records

from helpers.cli_helpers import run, run_json
from helpers.reference_reader import file_facts, listing

FULL = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1", "--writer-pp", "1"]
MLA = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]


def journal_records(path) -> list[dict]:
    return read_records(path)


def created_blocks(journal) -> list[str]:
    return [r["path"] for r in journal_records(journal) if r["t"] == "done" and r["kind"] == "block"]


@pytest.fixture
def migrated(tmp_path, synth_root):
    """An llm-d MLA tree (copy_pad) and a vllm.cpp MLA tree (rewrite_header), migrated."""
    root, results = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"},
                               {"family": "vllmcpp", "tp": 2, "kv_kind": "mla", "model_name": "org/cpp"})
    before = listing(root, with_times=False)
    sources = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
    facts = file_facts(root, sources)
    journal = tmp_path / "j.jsonl"
    code, out = run("migrate", root, *MLA, "--apply", "--journal", journal)
    assert code == 0, out
    assert len(created_blocks(journal)) == 12
    return root, journal, before, sources, facts


def test_rollback_returns_the_tree_to_its_pre_migration_state(migrated):
    root, journal, before, sources, facts = migrated
    code, result = run_json("rollback", journal)
    assert code == 0
    assert result["removed"] == {"block": 12, "config": 2, "dir": result["removed"]["dir"]}
    assert listing(root, exclude_top=(layout.OWN_DIR,), with_times=False) == before
    assert file_facts(root, sources) == facts
    assert journal_records(journal)[-1]["t"] == "rolled_back"


def test_a_block_changed_after_the_migration_is_kept(migrated):
    root, journal, before, sources, facts = migrated
    changed = root / created_blocks(journal)[0]
    data = bytearray(changed.read_bytes())
    data[-1] ^= 0xFF
    with open(changed, "r+b") as f:  # in place: inode and size unchanged, hash differs
        f.write(data)
    code, out = run("rollback", journal)
    assert code == 8
    assert str(changed) in out and "content changed" in out
    assert changed.read_bytes() == bytes(data)
    # the rest is gone; the folders holding the kept block stay
    remaining = listing(root, exclude_top=(layout.OWN_DIR,), with_times=False)
    extra = set(remaining) - set(before)
    rel = os.path.relpath(changed, root)
    # (the target base folder went with its config.json: it held nothing else)
    assert extra == {rel, os.path.dirname(rel), os.path.dirname(os.path.dirname(rel)), rel.split("/")[0]}


def test_a_block_replaced_by_another_inode_is_kept(migrated):
    root, journal, *_ = migrated
    replaced = root / created_blocks(journal)[1]
    data = replaced.read_bytes()
    newer = replaced.with_name("newer")
    newer.write_bytes(data)
    os.rename(newer, replaced)  # same bytes, another inode: not the file the migration made
    code, out = run("rollback", journal)
    assert code == 8 and "inode differs" in out
    assert replaced.read_bytes() == data


def test_a_changed_config_json_is_kept(migrated):
    root, journal, *_ = migrated
    cfg_rel = next(r["path"] for r in journal_records(journal) if r["t"] == "done" and r["kind"] == "config")
    cfg = root / cfg_rel
    cfg.write_bytes(cfg.read_bytes() + b"\n")
    code, out = run("rollback", journal)
    assert code == 8 and str(cfg) in out
    assert cfg.exists()


def test_files_an_engine_added_later_are_never_removed(migrated):
    root, journal, *_ = migrated
    first = root / created_blocks(journal)[0]
    newcomer = first.parent / ("ee" * 32 + ".bin")
    newcomer.write_bytes(b"engine wrote this")
    code, out = run("rollback", journal)
    assert code == 8 and "not empty" in out
    assert newcomer.read_bytes() == b"engine wrote this"
    assert not first.exists()


def test_rollback_twice_is_harmless(migrated):
    root, journal, before, *_ = migrated
    assert run("rollback", journal)[0] == 0
    code, result = run_json("rollback", journal)
    assert code == 0 and result["removed"] == {} and "already rolled back" in result["notes"][0]
    assert listing(root, exclude_top=(layout.OWN_DIR,), with_times=False) == before


def test_rollback_takes_a_directory_of_journals(tmp_path, synth_root):
    root, _ = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"})
    before = listing(root, with_times=False)
    dest = tmp_path / "dest"
    dest.mkdir()
    assert run("migrate", root, *MLA, "--apply", "--dest", dest)[0] == 0
    assert run("migrate", root, *MLA, "--apply")[0] == 0
    assert run("migrate", root, *MLA, "--apply")[0] == 0  # a no-op run: a third journal
    journals = root / layout.OWN_DIR / "journals"
    assert len(list(journals.iterdir())) == 3 and not (dest / layout.OWN_DIR).exists()
    code, result = run_json("rollback", journals)
    assert code == 0 and len(result["journals"]) == 3 and result["removed"]["block"] == 12
    assert listing(root, exclude_top=(layout.OWN_DIR,), with_times=False) == before
    assert list(dest.iterdir()) == []  # each journal names its own destination root


def test_rollback_refuses_while_a_migration_holds_the_lock(migrated):
    root, journal, *_ = migrated
    base = next(r["base"] for r in journal_records(journal) if r["t"] == "target")
    lock = root / base / layout.LOCK_NAME
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import fcntl, os, sys, time
        fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, f"{os.getpid()}\\n".encode())
        print("locked", flush=True); time.sleep(120)
    """), str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, out = run("rollback", journal)
    finally:
        holder.kill()
        holder.wait()
    assert code == 8 and str(lock) in out and f"pid {holder.pid}" in out
    assert all((root / p).exists() for p in created_blocks(journal))


def test_a_journal_path_that_leaves_the_destination_is_refused(migrated, tmp_path):
    root, journal, *_ = migrated
    outside = tmp_path / "precious.bin"
    outside.write_bytes(b"x")
    records = journal_records(journal)
    for r in records:
        if r["t"] == "done" and r["kind"] == "block":
            r["path"] = "../precious.bin"
            r["ino"] = os.stat(outside).st_ino
            break
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, out = run("rollback", journal)
    assert code == 2 and "not a normalized relative path" in out
    assert outside.read_bytes() == b"x"


def test_rollback_of_a_missing_journal_is_a_usage_error(tmp_path):
    code, out = run("rollback", tmp_path / "nope.jsonl")
    assert code == 2


def test_rollback_dry_run_counts_per_namespace_and_writes_nothing(migrated):
    root, journal, *_ = migrated
    tree, journal_bytes = listing(root, with_times=True), journal.read_bytes()
    code, dry = run_json("rollback", journal, "--dry-run")
    assert code == 0 and dry["dry_run"] is True
    assert listing(root, with_times=True) == tree and journal.read_bytes() == journal_bytes  # nothing written
    namespaces = {p.split("/")[0] for p in created_blocks(journal)}
    assert len(dry["per_namespace"]) == 2 and all(ns in namespaces or ns + "_r0" in namespaces
                                                   for ns in dry["per_namespace"])
    assert sum(c["block"] for c in dry["per_namespace"].values()) == 12
    code, done = run_json("rollback", journal)
    assert code == 0 and done["removed"] == dry["removed"] and done["per_namespace"] == dry["per_namespace"]


def test_rollback_dry_run_list_run_by_sh_gives_the_tree_rollback_gives(migrated):
    root, journal, before, sources, facts = migrated
    code, script = run("rollback", journal, "--dry-run", "--list")
    assert code == 0 and script.startswith("#!/bin/sh\n")
    assert sum(line.startswith("rm -f -- ") for line in script.splitlines()) == 12 + 2  # blocks, config.json
    proc = subprocess.run(["sh", "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # the tree `rollback` restores (test_rollback_returns_the_tree_to_its_pre_migration_state)
    assert listing(root, exclude_top=(layout.OWN_DIR,), with_times=False) == before
    assert file_facts(root, sources) == facts
    code, result = run_json("rollback", journal)  # nothing left to remove
    assert code == 0 and result["removed"] == {} and result["already_gone"] >= 14


def test_rollback_dry_run_list_leaves_a_changed_block_out_and_says_why(migrated):
    root, journal, *_ = migrated
    changed = root / created_blocks(journal)[0]
    with open(changed, "r+b") as f:
        f.write(b"\xee")
    code, script = run("rollback", journal, "--dry-run", "--list")
    assert code == 8
    lines = script.splitlines()
    assert not [line for line in lines if str(changed) in line and not line.startswith("#")]
    assert any(line.startswith("# keep: ") and str(changed) in line and "content changed" in line for line in lines)
    assert not any(line == f"rmdir -- {changed.parent}" for line in lines)  # its folder stays


def test_rollback_list_without_dry_run_is_a_usage_error(migrated):
    root, journal, *_ = migrated
    code, out = run("rollback", journal, "--list")
    assert code == 2 and "--dry-run" in out
    assert (root / created_blocks(journal)[0]).exists()


def test_rollback_of_a_rerun_from_the_same_manifest_removes_nothing_it_did_not_create(tmp_path, synth_root):
    """A second `--apply` of one manifest finds every block already present and creates
    nothing; rolling back its journal must not remove the blocks the first run made
    (its intents list them, but the paths were there before it began)."""
    root, _ = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"})
    manifest = tmp_path / "m.parquet"
    assert run("scan", root, *MLA, "-o", manifest)[0] in (0, 1)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    assert run("migrate", "--manifest", manifest, "--apply", "--journal", first)[0] == 0
    migrated = listing(root, exclude_top=(layout.OWN_DIR,), with_times=False)
    code, summary = run_json("migrate", "--manifest", manifest, "--apply", "--journal", second)
    assert code == 0 and summary["outcomes"]["created"] == 0 and summary["outcomes"]["already_present"] > 0
    code, dry = run_json("rollback", "--dry-run", second)
    assert code == 0 and dry["removed"].get("block", 0) == 0, dry
    code, result = run_json("rollback", second)
    assert code == 0 and result["removed"].get("block", 0) == 0 and result["already_gone"] == 0, result
    assert listing(root, exclude_top=(layout.OWN_DIR,), with_times=False) == migrated
    code, result = run_json("rollback", first)
    assert code == 0 and result["removed"]["block"] == len(created_blocks(first)) and result["already_gone"] == 0


def test_rollback_reads_its_journal_once(migrated, monkeypatch):
    """The restore-pruned-sources pass and the removals share one reading of the journal
    (at 100,000 blocks each reading costs 0.5 s of decoding)."""
    from kvmigrate.migrate import journal as jn
    from kvmigrate.migrate.rollback import rollback

    root, journal, before, *_ = migrated
    reads = []
    real = jn.iter_records

    def spy(path, **kw):
        reads.append(str(path))
        return real(path, **kw)

    monkeypatch.setattr(jn, "iter_records", spy)
    result = rollback(str(journal))
    assert result.exit_code == 0 and result.removed["block"] == 12
    assert reads.count(str(journal)) == 1, reads
    assert listing(root, exclude_top=(layout.OWN_DIR,), with_times=False) == before


def test_rollback_removes_the_folders_of_a_level_several_at_once(migrated, monkeypatch):
    """An rmdir waits for its freed block's discard (ext4 `discard`): the few folders of
    a level are spread over workers, not one task. Two rmdir calls must be in flight
    together (a barrier), else the first one gives up waiting and the test fails."""
    from kvmigrate.migrate.rollback import rollback

    root, journal, before, *_ = migrated
    real = os.rmdir
    barrier = threading.Barrier(2, timeout=10)
    lock = threading.Lock()
    first: list[int] = []
    alone: list[str] = []

    def spy(path, *args, **kwargs):
        with lock:
            waits = len(first) < 2
            if waits:
                first.append(threading.get_ident())
        if waits:
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                alone.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", spy)
    result = rollback(str(journal))
    assert not alone, f"rmdir of {alone} ran alone: a level's folders went to one worker"
    assert len(set(first)) == 2 and result.exit_code == 0
    assert listing(root, exclude_top=(layout.OWN_DIR,), with_times=False) == before


def test_rollback_counts_agree_in_number(tmp_path, synth_root):
    """'removed 1 block, ..., 1 folder' (was '1 blocks', '1 folders'), per namespace too."""
    root, _ = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla", "blocks": 1})
    journal = tmp_path / "j.jsonl"
    assert run("migrate", root, *MLA, "--apply", "--journal", journal)[0] == 0
    code, out = run("rollback", "--dry-run", journal)
    assert code == 0 and "1 block," in out and "1 blocks" not in out, out
    code, out = run("rollback", journal)
    assert code == 0 and "removed 1 block," in out, out


def test_a_long_journal_is_sorted_with_few_temporary_files_open(migrated, monkeypatch):
    """The journal's records are sorted in runs spilled to temporary files; past
    _MERGE_FAN_IN runs they are merged into one, so a 10M-record journal (~1,200 runs)
    never holds more files open than the usual 1,024 allow. Here runs of 2 records."""
    from kvmigrate.migrate import rollback

    root, journal, before, sources, facts = migrated
    monkeypatch.setattr(rollback, "_SORT_RUN", 2)
    monkeypatch.setattr(rollback, "_MERGE_FAN_IN", 3)
    made, most = [], [0]

    def counted():
        f = temp_file()
        made.append(f)
        most[0] = max(most[0], sum(not g.closed for g in made))
        return f

    temp_file = rollback._temp_file
    monkeypatch.setattr(rollback, "_temp_file", counted)
    code, result = run_json("rollback", journal)
    assert code == 0 and result["removed"]["block"] == 12
    assert listing(root, exclude_top=(layout.OWN_DIR,), with_times=False) == before
    assert file_facts(root, sources) == facts
    assert len(made) > 10 and most[0] <= 3 + 2  # the runs, the merge's output and the spool of blocks
