"""The safety rules of migration.md §3, one test each (each fails if its rule breaks)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest

from kvmigrate import layout, manifest
from kvmigrate.migrate.journal import read_records

from helpers.cli_helpers import run, run_json
from helpers.reference_reader import content_listing, file_facts, listing

MLA = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]
KVMIGRATE = str(Path(sys.executable).with_name("kvmigrate"))


def all_files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def scan_to(root, out, *flags, verify="size") -> dict:
    code, _ = run("scan", root, "-o", out, "--verify", verify, *flags)
    assert code in (0, 1), code
    return manifest.read_metadata(out)


@pytest.fixture
def mixed_root(tmp_path, synth_root):
    """Three families in one root, each with a different creating action: llm-d MLA
    replicas (copy_pad), vLLM S1 full attention (link), vllm.cpp MLA (rewrite_header),
    plus a symlink to a file outside the tree and an engine temp leftover."""
    root, results = synth_root(
        {"family": "llmd", "tp": 2, "kv_kind": "mla", "model_name": "org/mla-model", "defects": ("symlink", "tmp_vllm")},
        {"family": "vllm", "scheme": "S1", "tp": 1, "model_name": "org/full-model"},
        {"family": "vllmcpp", "tp": 2, "kv_kind": "mla", "model_name": "org/cpp-model"},
    )
    facts = tmp_path / "facts.json"
    facts.write_text(json.dumps({
        "org/mla-model": {"kv_kind": "mla", "model_dtype": "bfloat16"},
        "org/full-model": {"kv_kind": "full", "total_kv_heads": 8, "model_dtype": "bfloat16", "writer_tp": 1,
                           "writer_pp": 1},
    }))
    return root, results, ["--facts", str(facts)]


def test_source_files_unchanged_by_every_command(tmp_path, mixed_root):
    root, _, facts = mixed_root
    sources = all_files(root)
    before = file_facts(root, sources)
    m = tmp_path / "m.parquet"
    steps = [("scan", root, "-o", m, *facts, "--verify", "hash"),
             ("migrate", root, *facts),
             ("migrate", "--manifest", m, "--print-commands"),
             ("migrate", root, *facts, "--apply", "--journal", tmp_path / "j.jsonl"),
             ("verify", root, "--journal", tmp_path / "j.jsonl"),
             ("migrate", root, *facts, "--apply", "--journal", tmp_path / "j2.jsonl"),
             ("rollback", tmp_path / "j.jsonl")]
    for step in steps:
        code, out = run(*step)
        assert code in (0, 1), (step, code, out)
        assert file_facts(root, sources) == before, step
    # the migration really happened in between (the test is not vacuous)
    assert read_records(tmp_path / "j.jsonl")[-1]["t"] == "rolled_back"


def test_dry_run_writes_nothing(tmp_path, mixed_root):
    root, _, facts = mixed_root
    before = listing(tmp_path)
    code, out = run("migrate", root, *facts)
    assert code == 1, out
    assert "Nothing was written (dry run)" in out
    assert f"to apply: kvmigrate migrate {root} --facts" in out and out.rstrip().endswith("--apply")
    code, out = run("migrate", root, *facts, "--print-commands")
    assert code == 0 and "ln -- " in out and "head -c" in out
    assert listing(tmp_path) == before
    assert not (root / layout.OWN_DIR).exists()


def test_dry_run_reports_integrity_states_of_blocks_it_does_not_place(synth_root):
    """A short source block is not placed: the plan names it, its bit 4 is audit's
    (interface.md §4: the dry run adds 4 only for blocks it would place)."""
    root, _ = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla", "defects": ("short",)})
    code, summary = run_json("migrate", root, *MLA)
    assert code == 1
    assert summary["pending"] > 0 and summary["exit_code"] == 1
    assert summary["totals"]["by_status"]["short"]["files"] == 1
    code, out = run("migrate", root, *MLA)
    assert code == 1 and "integrity findings in the manifest: 1 file " in out


def test_existing_different_block_is_a_conflict_and_never_overwritten(tmp_path, synth_root):
    root, (res,) = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"})
    m = tmp_path / "m.parquet"
    scan_to(root, m, *MLA)
    rows = [r for r in manifest.read_table(m).to_pylist() if r["target_relpath"]]
    victim = root / rows[0]["target_relpath"]
    victim.parent.mkdir(parents=True)
    victim.write_bytes(b"\x07" * 4096)  # same size as the padded output, other bytes
    st = os.stat(victim)
    code, summary = run_json("migrate", "--manifest", m, "--apply")
    assert code == 4
    assert summary["outcomes"]["conflict"] == 1 and summary["outcomes"]["created"] == len(rows) - 1
    assert victim.read_bytes() == b"\x07" * 4096
    assert (os.stat(victim).st_ino, os.stat(victim).st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert any(str(victim) in f for f in summary["apply"]["findings"])


def test_source_changed_since_scan_is_skipped(tmp_path, synth_root):
    root, (res,) = synth_root({"family": "vllm", "scheme": "S2", "tp": 1})
    m = tmp_path / "m.parquet"
    scan_to(root, m, "--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1",
            "--writer-pp", "1")
    rows = [r for r in manifest.read_table(m).to_pylist() if r["action"] == "link"]
    changed = root / rows[0]["relpath"]
    changed.write_bytes(changed.read_bytes()[::-1])  # a live engine rewrote it (new mtime)
    code, summary = run_json("migrate", "--manifest", m, "--apply")
    assert summary["outcomes"]["changed_since_scan"] == 1
    assert summary["outcomes"]["created"] == len(rows) - 1
    assert not (root / rows[0]["target_relpath"]).exists()
    assert code == 0  # reported, not failed on: the run did all it could


FULL = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1",
        "--writer-pp", "1"]


def _rewrite_keeping_mtime(path: Path) -> None:
    """Other bytes of the same size in place, the mtime put back (a restore tool, `touch -r`):
    only the ctime, which user space cannot set, says the file changed."""
    st = os.stat(path)
    data = path.read_bytes()
    with open(path, "r+b") as f:
        f.write(bytes(b ^ 0xFF for b in data[:64]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns and os.stat(path).st_ctime_ns != st.st_ctime_ns


@pytest.mark.parametrize("verify", ["size", "hash"])
def test_a_source_rewritten_with_its_mtime_restored_is_not_linked(tmp_path, synth_root, verify):
    # the apply re-checked dev, inode, size and mtime only: this block was linked anyway
    root, _ = synth_root({})
    m = tmp_path / "m.parquet"
    scan_to(root, m, *FULL, verify=verify)
    rows = [r for r in manifest.read_table(m).to_pylist() if r["action"] == "link"]
    assert all(r["ctime_ns"] for r in rows)
    _rewrite_keeping_mtime(root / rows[0]["relpath"])
    code, summary = run_json("migrate", "--manifest", m, "--apply")
    assert code == 0, summary  # reported, not failed on
    assert summary["outcomes"]["changed_since_scan"] == 1 and summary["outcomes"]["created"] == len(rows) - 1
    assert not (root / rows[0]["target_relpath"]).exists()
    (line,) = [f for f in summary["apply"]["findings"] if f.startswith("changed_since_scan")]
    assert rows[0]["relpath"] in line and "ctime" in line, line


def test_a_ctime_moved_by_kvmigrates_own_link_is_no_change(tmp_path, synth_root):
    """link(2) moves the source's ctime: applying a size manifest again finds its blocks in
    place, and a hash manifest proves an unchanged source by its bytes."""
    root, _ = synth_root({})
    size, hashed = tmp_path / "size.parquet", tmp_path / "hash.parquet"
    scan_to(root, size, *FULL)
    scan_to(root, hashed, *FULL, verify="hash")
    code, first = run_json("migrate", "--manifest", size, "--apply")
    assert code == 0 and first["outcomes"]["created"] == 6
    code, again = run_json("migrate", "--manifest", size, "--apply")
    assert code == 0 and again["outcomes"]["already_present"] == 6 and again["outcomes"]["changed_since_scan"] == 0
    dest = tmp_path / "dest"
    dest.mkdir()
    code, other = run_json("migrate", "--manifest", hashed, "--apply", "--dest", dest)
    assert code == 0 and other["outcomes"]["created"] == 6, other["apply"]["findings"]


def test_a_ctime_moved_by_a_rollback_or_a_chmod_is_judged_by_journal_and_bytes(tmp_path, synth_root):
    """A rollback's unlink moves the ctime back with nlink: the root's journals say kvmigrate
    did it. A chmod moves it too: a hash manifest proves the bytes, a size manifest cannot."""
    root, _ = synth_root({})
    size, hashed = tmp_path / "size.parquet", tmp_path / "hash.parquet"
    scan_to(root, size, *FULL)
    scan_to(root, hashed, *FULL, verify="hash")
    assert run_json("migrate", "--manifest", size, "--apply")[1]["outcomes"]["created"] == 6
    assert run("rollback", root / ".kvmigrate" / "journals")[0] == 0
    code, again = run_json("migrate", "--manifest", size, "--apply")
    assert code == 0 and again["outcomes"]["created"] == 6 and again["outcomes"]["changed_since_scan"] == 0
    assert run("rollback", root / ".kvmigrate" / "journals")[0] == 0
    shutil.rmtree(root / ".kvmigrate")  # the journals gone: nothing tells who moved the ctimes
    source = root / next(r["relpath"] for r in manifest.read_table(hashed).to_pylist() if r["action"] == "link")
    os.chmod(source, 0o640)
    code, proven = run_json("migrate", "--manifest", hashed, "--apply")
    assert code == 0 and proven["outcomes"]["created"] == 6, proven["apply"]["findings"]
    assert run("rollback", root / ".kvmigrate" / "journals")[0] == 0
    shutil.rmtree(root / ".kvmigrate")
    code, unproven = run_json("migrate", "--manifest", size, "--apply")
    assert code == 0 and unproven["outcomes"]["changed_since_scan"] == 6  # rescan: nothing proves their bytes


def test_copy_rehashes_the_source_when_the_manifest_has_a_hash(tmp_path, synth_root):
    """Same inode, size and mtime but other bytes: only the re-hash can tell."""
    root, (res,) = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"})
    m = tmp_path / "m.parquet"
    scan_to(root, m, *MLA, verify="hash")
    rows = [r for r in manifest.read_table(m).to_pylist() if r["action"] == "copy_pad"]
    src = root / rows[0]["relpath"]
    st = os.stat(src)
    with open(src, "r+b") as f:  # in place: inode and size stay
        f.write(b"\xff" * 16)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    code, summary = run_json("migrate", "--manifest", m, "--apply")
    assert summary["outcomes"]["changed_since_scan"] == 1
    assert not (root / rows[0]["target_relpath"]).exists()
    assert not list(root.rglob("*.kvmigrate-*.tmp"))


def test_replicas_are_hashed_before_reuse_when_the_scan_did_not(tmp_path, synth_root):
    root, (res,) = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla", "defects": ("replica_differs",)})
    m = tmp_path / "m.parquet"
    scan_to(root, m, *MLA, verify="size")  # size only: the scan cannot see the difference
    victim = res.defect("replica_differs")
    row0 = next(r for r in manifest.read_table(m).to_pylist() if r["relpath"] == victim["rows"][0])
    assert row0["action"] == "copy_pad"
    code, summary = run_json("migrate", "--manifest", m, "--apply")
    assert code == 4
    assert summary["outcomes"]["failed"] == 1
    assert not (root / row0["target_relpath"]).exists()
    assert any("replicas differ" in f for f in summary["apply"]["findings"])


_HOLDER = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{os.getpid()}\\n".encode())
    print("locked", flush=True)
    time.sleep(120)
""")


def test_concurrent_run_fails_fast_naming_the_lock_and_holder(tmp_path, synth_root):
    root, (res,) = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"})
    m = tmp_path / "m.parquet"
    meta = scan_to(root, m, *MLA)
    target_base = next(iter(meta["namespaces"].values()))["target"]["base_name"]
    (root / target_base).mkdir()
    lock = root / target_base / layout.LOCK_NAME
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        proc = subprocess.run([KVMIGRATE, "migrate", "--manifest", str(m), "--apply"], capture_output=True,
                              text=True, timeout=60)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 8, proc.stderr
    assert str(lock) in proc.stderr and f"pid {holder.pid}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (root / f"{target_base}_r0").exists() and not (root / target_base / "config.json").exists()


def test_symlinks_are_never_followed(tmp_path, mixed_root):
    root, results, facts = mixed_root
    link = root / results[0].defect("symlink")["relpath"]
    assert link.is_symlink()
    outside = tmp_path / "outside"
    outside.mkdir()
    # a symlink planted where a target rank folder will go must not be written through
    m = tmp_path / "m.parquet"
    meta = scan_to(root, m, *facts)
    full_ns = next(ns for ns in meta["namespaces"].values() if ns["model_name"] == "org/full-model")
    os.symlink(outside, root / full_ns["target"]["rank_dir"])
    code, out = run("migrate", "--manifest", m, "--apply")
    assert code == 8 and "symlink" in out
    assert list(outside.iterdir()) == []
    # without the trap, the symlinked source file is not migrated anywhere; the stopped run
    # holds its targets until it is resumed (or undone): another command there refuses
    os.unlink(root / full_ns["target"]["rank_dir"])
    code, out = run("migrate", root, *facts, "--apply")
    assert code == 8 and "was interrupted" in out, out
    code, out = run("migrate", "--manifest", m, "--apply")
    assert code == 0, out
    passwd = os.stat(os.readlink(link))
    for rel in all_files(root):
        st = os.lstat(root / rel)
        assert (st.st_ino, st.st_dev) != (passwd.st_ino, passwd.st_dev), rel


@pytest.mark.parametrize("evil", ["../x.bin", "/tmp/x.bin", "{rank_dir}/../../x.bin", "{rank_dir}/abc/de_g0/../x.bin",
                                  "{source_rank_dir}/{rest}"])
def test_manifest_paths_that_leave_the_target_are_rejected(tmp_path, synth_root, evil):
    root, (res,) = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"})
    m = tmp_path / "m.parquet"
    meta = scan_to(root, m, *MLA)
    table = manifest.read_table(m)
    rows = table.column("target_relpath").to_pylist()
    i = next(i for i, r in enumerate(rows) if r)
    ns = next(iter(meta["namespaces"].values()))
    rest = rows[i].split("/", 1)[1]
    rows[i] = evil.format(rank_dir=ns["target"]["rank_dir"], source_rank_dir=ns["rank_dirs"][0], rest=rest)
    table = table.set_column(table.schema.get_field_index("target_relpath"), "target_relpath",
                             pa.array(rows, pa.string()))
    evil_m = tmp_path / "evil.parquet"
    with manifest.ManifestWriter(evil_m, meta) as w:
        w.write(table)
    before = listing(tmp_path)
    code, out = run("migrate", "--manifest", evil_m, "--apply")
    assert code == 2 and "refusing" in out
    assert listing(tmp_path) == before
    assert not os.path.exists("/tmp/x.bin") or evil != "/tmp/x.bin"


def test_aliases_source_is_never_written(tmp_path, synth_root):
    # --target vllm-0.22 on an llm-d tree: S1 target names equal the source names
    root, (res,) = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"})
    before = listing(root)
    code, summary = run_json("migrate", root, *MLA, "--target", "vllm-0.22", "--apply")
    assert summary["outcomes"]["created"] == 0
    reasons = {r["reason"] for t in summary["targets"] for r in t["not_reusable"]}
    assert any("aliases_source" in r for r in reasons), reasons
    after = listing(root, exclude_top=(layout.OWN_DIR,))
    assert after == {k: v for k, v in before.items()}


def test_second_migration_is_a_no_op(tmp_path, mixed_root):
    root, _, facts = mixed_root
    code, first = run_json("migrate", root, *facts, "--apply")
    assert code == 0 and first["outcomes"]["created"] == 6 * 3
    state = listing(root, exclude_top=(layout.OWN_DIR,))
    code, dry = run_json("migrate", root, *facts)
    assert code == 0 and dry["pending"] == 0
    code, second = run_json("migrate", root, *facts, "--apply")
    assert code == 0
    assert second["outcomes"]["created"] == 0 and second["outcomes"]["already_present"] == 6 * 3
    assert listing(root, exclude_top=(layout.OWN_DIR,)) == state


def test_tp2_and_tp4_caches_merge_into_one_target_and_a_conflict_is_not_overwritten(tmp_path, synth_root):
    root, (tp2, tp4) = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"},
                                  {"family": "llmd", "tp": 4, "kv_kind": "mla"})
    # one block of the TP=4 cache holds other (but replica-consistent) bytes
    odd = tp4.blocks[0]
    other = bytes(range(256)) * (os.path.getsize(root / odd["files"][0]) // 256)
    for rel in odd["files"].values():
        (root / rel).write_bytes(other)
    first, second = sorted([tp2, tp4], key=lambda r: r.namespaces[0]["base_name"])
    code, summary = run_json("migrate", root, *MLA, "--apply")
    assert code == 4
    (target,) = summary["targets"]
    assert sorted(target["sources"]) == sorted([tp2.namespaces[0]["base_name"], tp4.namespaces[0]["base_name"]])
    o = summary["outcomes"]
    # the odd key holds different bytes of one size in the two caches: neither is placed, both
    # are reported (docs/migration.md §2: competing sources, never name order)
    assert (o["created"], o["already_present"], o["conflict"]) == (5, 5, 2)
    blk = first.blocks[0]
    assert not (root / layout.block_relpath(target["target_base"], 0, blk["hex"], blk["group"])).exists()
    assert sorted(c["blocks"] for c in target["conflicts"]) == [1, 1]
    assert all("competing source" in c["reason"] and "none placed" in c["reason"] for c in target["conflicts"])
    assert (root / second.blocks[0]["files"][0]).exists()


@pytest.fixture
def shm_dest():
    d = tempfile.mkdtemp(prefix="kvmigrate-test-", dir="/dev/shm")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def test_cross_filesystem_destination(tmp_path, synth_root, shm_dest):
    root, (res,) = synth_root({"family": "vllm", "scheme": "S1", "tp": 1})
    assert os.stat(root).st_dev != os.stat(shm_dest).st_dev  # the premise of this test
    flags = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1", "--writer-pp", "1"]
    code, out = run("migrate", root, *flags, "--apply", "--dest", shm_dest)
    assert code == 8
    assert "--mode copy" in out and "--mode auto" in out and "nothing was written" in out
    assert list(shm_dest.iterdir()) == []
    code, summary = run_json("migrate", root, *flags, "--apply", "--dest", shm_dest, "--mode", "auto")
    assert code == 0
    assert summary["apply"]["link_copies"] == 6 and summary["apply"]["linked"] == 0
    assert all(os.stat(root / rel).st_nlink == 1 for rel in res.block_files())
    created = [p for p in shm_dest.rglob("*.bin")]
    assert len(created) == 6
    for p in created:
        assert os.stat(p).st_dev == os.stat(shm_dest).st_dev
    assert len(list((root / layout.OWN_DIR / "journals").iterdir())) == 1  # journaled under ROOT
    assert not (shm_dest / layout.OWN_DIR).exists()


def test_mode_auto_links_on_the_same_filesystem_and_mode_copy_copies(tmp_path, synth_root):
    root, (res,) = synth_root({"family": "vllm", "scheme": "S1", "tp": 1})
    flags = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1", "--writer-pp", "1"]
    dest_auto, dest_copy = tmp_path / "auto", tmp_path / "copy"
    dest_auto.mkdir(), dest_copy.mkdir()
    code, auto = run_json("migrate", root, *flags, "--apply", "--dest", dest_auto, "--mode", "auto")
    assert code == 0 and auto["apply"]["linked"] == 6 and auto["apply"]["copied"] == 0
    code, copy = run_json("migrate", root, *flags, "--apply", "--dest", dest_copy, "--mode", "copy")
    assert code == 0 and copy["apply"]["copied"] == 6 and copy["apply"]["linked"] == 0
    src_inodes = {os.stat(root / rel).st_ino for rel in res.block_files()}
    assert {os.stat(p).st_ino for p in dest_auto.rglob("*.bin")} == src_inodes
    copies = list(dest_copy.rglob("*.bin"))
    assert not ({os.stat(p).st_ino for p in copies} & src_inodes)
    assert content_listing(dest_auto) == content_listing(dest_copy)


def test_print_commands_script_produces_the_same_tree_as_apply(tmp_path, synth_root):
    specs = ({"family": "llmd", "tp": 2, "kv_kind": "mla"}, {"family": "vllmcpp", "tp": 2, "kv_kind": "mla"})
    root_a, _ = synth_root(*specs, root_name="a")
    root_b, _ = synth_root(*specs, root_name="b")
    code, _ = run("migrate", root_a, *MLA, "--apply")
    assert code == 0
    code, script = run("migrate", root_b, *MLA, "--print-commands")
    assert code == 0
    proc = subprocess.run(["sh", "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert content_listing(root_a) == content_listing(root_b)


@pytest.mark.parametrize("err,expect", [(errno.EACCES, "permission denied"), (errno.EROFS, "read-only filesystem"),
                                        (errno.ENOSPC, "no space left"), (errno.EXDEV, "--mode copy")])
def test_operational_errors_stop_with_a_message_and_a_consistent_journal(tmp_path, synth_root, monkeypatch, err,
                                                                         expect):
    from kvmigrate.migrate import fsops

    root, (res,) = synth_root({"family": "vllm", "scheme": "S1", "tp": 1})
    flags = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1", "--writer-pp", "1"]
    calls = {"n": 0}
    real = fsops.DestTree.link_in

    def failing_link(self, src, rel):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(err, os.strerror(err), src)
        return real(self, src, rel)

    monkeypatch.setattr(fsops.DestTree, "link_in", failing_link)
    journal = tmp_path / "j.jsonl"
    code, out = run("migrate", root, *flags, "--apply", "--journal", journal)
    assert code == 8 and expect in out, out
    records = read_records(journal)
    done = [r for r in records if r["t"] == "done" and r["kind"] == "block"]
    assert len(done) == 2 and not any(r["t"] == "complete" for r in records)
    for r in done:
        assert (root / r["path"]).exists()
    monkeypatch.setattr(fsops.DestTree, "link_in", real)
    code, summary = run_json("migrate", root, *flags, "--apply", "--journal", journal)
    assert code == 0 and summary["apply"]["resumed"] and summary["outcomes"]["created"] == 4
    assert read_records(journal)[-1]["t"] == "complete"


def test_emlink_in_link_mode_fails_the_block_and_auto_copies_it(tmp_path, synth_root, monkeypatch):
    from kvmigrate.migrate import fsops

    root, (res,) = synth_root({"family": "vllm", "scheme": "S1", "tp": 1})
    flags = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1", "--writer-pp", "1"]
    victim = res.blocks[0]["hex"]
    real = fsops.DestTree.link_in

    def emlink(self, src, rel):
        if victim in rel:
            raise OSError(errno.EMLINK, "Too many links", src)
        return real(self, src, rel)

    monkeypatch.setattr(fsops.DestTree, "link_in", emlink)
    code, summary = run_json("migrate", root, *flags, "--apply")
    assert code == 8 and summary["outcomes"]["failed"] == 1 and summary["outcomes"]["created"] == 5
    assert any("--mode auto" in f for f in summary["apply"]["findings"])
    code, summary = run_json("migrate", root, *flags, "--apply", "--mode", "auto")
    assert code == 0 and summary["outcomes"]["created"] == 1 and summary["apply"]["link_copies"] == 1


def test_json_summary_has_the_interface_keys(mixed_root):
    root, _, facts = mixed_root
    code, dry = run_json("migrate", root, *facts)
    for key in ("root", "target_profile", "totals", "namespaces", "exit_code"):
        assert key in dry
    assert dry["exit_code"] == code == 1
    code, applied = run_json("migrate", root, *facts, "--apply")
    assert set(applied["outcomes"]) == {"created", "already_present", "conflict", "changed_since_scan",
                                        "skipped_needs_transform", "failed"}
    assert applied["exit_code"] == code == 0


def _target_base(meta) -> str:
    (ns,) = meta["namespaces"].values()
    return ns["target"]["base_name"]


def test_an_existing_config_json_of_another_identity_stops_that_namespace(tmp_path, synth_root):
    root, (res,) = synth_root({"family": "vllm", "scheme": "S2", "tp": 1})
    flags = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1", "--writer-pp", "1"]
    m = tmp_path / "m.parquet"
    base = _target_base(scan_to(root, m, *flags))
    (root / base).mkdir()
    foreign = b'{"model_name": "someone-else"}'
    (root / base / "config.json").write_bytes(foreign)
    code, summary = run_json("migrate", "--manifest", m, "--apply")
    assert code == 4
    assert summary["outcomes"]["created"] == 0 and summary["outcomes"]["conflict"] == 6
    assert "describes a different identity" in summary["apply"]["namespace_errors"][0]
    assert (root / base / "config.json").read_bytes() == foreign
    assert not (root / f"{base}_r0").exists()


def test_an_existing_equivalent_vllm_config_json_is_kept_as_it_is(tmp_path, synth_root):
    root, (res,) = synth_root({"family": "vllm", "scheme": "S2", "tp": 1})
    flags = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1", "--writer-pp", "1"]
    m = tmp_path / "m.parquet"
    meta = scan_to(root, m, *flags)
    base = _target_base(meta)
    (root / base).mkdir()
    compact = json.dumps(next(iter(meta["namespaces"].values()))["target"]["fields"]).encode()
    (root / base / "config.json").write_bytes(compact)  # same identity, other bytes
    journal = tmp_path / "j.jsonl"
    code, summary = run_json("migrate", "--manifest", m, "--apply", "--journal", journal)
    assert code == 0 and summary["outcomes"]["created"] == 6
    assert (root / base / "config.json").read_bytes() == compact
    assert not [r for r in read_records(journal) if r["t"] == "done" and r.get("kind") == "config"]
    assert run("rollback", journal)[0] == 0  # removes the blocks, not a config.json it did not create
    assert (root / base / "config.json").read_bytes() == compact
    assert not (root / f"{base}_r0").exists()


def test_vllmcpp_config_json_must_match_byte_for_byte(tmp_path, synth_root):
    root, (r,) = synth_root({"family": "vllmcpp", "tp": 2, "kv_kind": "mla"})
    m = tmp_path / "m.parquet"
    meta = scan_to(root, m)
    tgt = next(ns["target"] for ns in meta["namespaces"].values() if ns["target"]["replicated_layout"])
    (root / tgt["base_name"]).mkdir()
    pretty = json.dumps(tgt["fields"], indent=1, sort_keys=True).encode()  # equal values, other bytes
    (root / tgt["base_name"] / "config.json").write_bytes(pretty)
    code, summary = run_json("migrate", "--manifest", m, "--apply")
    assert code == 4 and summary["outcomes"]["created"] == 0
    assert (root / tgt["base_name"] / "config.json").read_bytes() == pretty


def test_a_different_block_found_by_the_scan_at_a_target_path_is_a_conflict(tmp_path, synth_root):
    """`migrate ROOT` scans first: the scan sees the occupant, the plan reports a conflict
    (dry run and apply exit with bit 4) and the occupant is never overwritten."""
    root, (res,) = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"})
    meta = scan_to(root, tmp_path / "m.parquet", *MLA)
    target = next(iter(meta["namespaces"].values()))["target"]
    blk = res.blocks[0]
    occupant = root / layout.block_relpath(target["base_name"], 0, blk["hex"], blk["group"])
    occupant.parent.mkdir(parents=True)
    occupant.write_bytes(b"\x09" * 4096)
    code, dry = run_json("migrate", root, *MLA)
    assert code == 1 | 4 and dry["targets"][0]["conflicts"][0]["blocks"] == 1
    code, summary = run_json("migrate", root, *MLA, "--apply")
    assert code == 4
    assert summary["outcomes"]["conflict"] == 1 and summary["outcomes"]["created"] == 5
    assert occupant.read_bytes() == b"\x09" * 4096


def test_no_space_while_writing_a_copy_leaves_no_temp_and_resumes(tmp_path, synth_root, monkeypatch):
    from kvmigrate.migrate import place as place_mod

    root, (res,) = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"})
    real = place_mod.Placer._write_new
    calls = {"n": 0}

    def full_disk(self, tmp, chunks, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # config.json, then two blocks, then the disk is full
            fd = self.tree.create_excl(tmp)  # a partial temp file exists when ENOSPC hits
            os.close(fd)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, tmp, chunks, **kwargs)

    monkeypatch.setattr(place_mod.Placer, "_write_new", full_disk)
    journal = tmp_path / "j.jsonl"
    code, out = run("migrate", root, *MLA, "--apply", "--journal", journal)
    assert code == 8 and "no space left on device" in out and "resume" in out
    assert not list(root.rglob("*.kvmigrate-*.tmp"))
    assert len(list(root.rglob("*.bin"))) == 12 + 2
    monkeypatch.setattr(place_mod.Placer, "_write_new", real)
    code, summary = run_json("migrate", root, *MLA, "--apply", "--journal", journal)
    assert code == 0 and summary["apply"]["resumed"] and summary["outcomes"]["created"] == 4


def test_apply_summary_counts_integrity_files_and_skips_in_agreement(synth_root):
    """The applied summary says '1 file is damaged', not '1 files are' (the dry run's
    wording and the one plural formatter)."""
    root, _ = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla", "defects": ("short",)})
    code, out = run("migrate", root, *MLA, "--apply")
    assert "integrity findings in the manifest: 1 file is damaged or suspect and was not migrated" in out, out
    assert "1 files" not in out and "1 blocks" not in out, out
