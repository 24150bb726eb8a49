"""The per-block fast path of `migrate --apply` keeps every guarantee.

A hard link is journaled by the identity of the inode it shares with its source (dev,
inode, size, mtime) and the hash the scan or apply's own check read (a size-only
manifest: apply reads every block before placing it), and verify and rollback then
judge it by them; replica hashes are taken through one open per file (fstat for
staleness, then one read), which must never wait on a FIFO put in a file's place and
must name a vanished replica like the stat-based check did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
from click.testing import CliRunner

from kvmigrate import manifest
from kvmigrate.cli import cli
from kvmigrate.identity.facts import FactsResolver
from kvmigrate.migrate.journal import read_records
from kvmigrate.options import ScanOptions
from kvmigrate.pipeline import scan

KVMIGRATE = str(Path(sys.executable).with_name("kvmigrate"))
FACTS = {"kv_kind": "mla", "model_dtype": "bfloat16"}


def run_json(*args) -> tuple[int, dict]:
    res = CliRunner().invoke(cli, [str(a) for a in args] + ["--json"], catch_exceptions=False)
    return res.exit_code, json.loads(res.stdout)


def done_blocks(journal) -> list[dict]:
    return [r for r in read_records(journal) if r["t"] == "done" and r["kind"] == "block"]


def scan_size(root, m) -> list[dict]:
    scan(root, m, ScanOptions(facts_resolver=FactsResolver(FACTS, None), verify="size", threads=2))
    return manifest.read_table(m).to_pylist()


def test_a_link_apply_read_is_journaled_with_its_hash_and_identity(tmp_path, synth_root):
    root, _ = synth_root({"family": "vllm", "scheme": "S1", "kv_kind": "mla"})  # one rank, a size-only scan
    m, journal = tmp_path / "m.parquet", tmp_path / "j.jsonl"
    rows = {r["relpath"]: r for r in scan_size(root, m) if r["action"] == "link"}
    code, summary = run_json("migrate", "--manifest", m, "--apply", "--journal", journal)
    assert code == 0 and summary["outcomes"]["created"] == len(rows) > 2
    recs = done_blocks(journal)
    by_path = {r["target_relpath"]: r for r in rows.values()}
    for rec in recs:
        src_path = root / by_path[rec["path"]]["relpath"]
        src = os.stat(src_path)
        # apply read the block before linking it (the scan did not): the hash it read is journaled
        assert rec["xxh3_128"] == xxhash.xxh3_128_hexdigest(src_path.read_bytes()) and rec["how"] == "link"
        assert (rec["dev"], rec["ino"], rec["size"], rec["mtime_ns"]) == (src.st_dev, src.st_ino, src.st_size,
                                                                            src.st_mtime_ns)
    assert run_json("verify", root, "--journal", journal)[0] == 0
    # written through its source: same inode and size, new bytes -> verify finds it, rollback keeps it
    changed = root / recs[0]["path"]
    with open(root / by_path[recs[0]["path"]]["relpath"], "r+b") as f:
        f.write(b"\xee" * 8)
    code, result = run_json("verify", root, "--journal", journal)
    assert code == 4 and [(f["code"], f["path"]) for f in result["findings"]] == [("block_changed", str(changed))]
    code, result = run_json("rollback", journal)
    assert code == 8 and result["removed"]["block"] == len(recs) - 1
    # (a link is checked by identity: the write moved the shared inode's mtime)
    assert changed.exists() and any(str(changed) in k and "mtime differs" in k for k in result["kept"])


def test_replica_hashes_taken_at_apply_are_journaled(tmp_path, synth_root):
    root, _ = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla", "layers": 4, "page_bytes": 1024})  # link
    m, journal = tmp_path / "m.parquet", tmp_path / "j.jsonl"
    rows = {r["target_relpath"]: r for r in scan_size(root, m) if r["target_relpath"]}
    code, summary = run_json("migrate", "--manifest", m, "--apply", "--journal", journal)
    assert code == 0 and summary["apply"]["linked"] == len(rows)
    for rec in done_blocks(journal):
        want = xxhash.xxh3_128_hexdigest((root / rows[rec["path"]]["relpath"]).read_bytes())
        assert rec["xxh3_128"] == want


def _replica_row(rows: list[dict]) -> dict:
    return next(r for r in rows if r["rank"] == 1 and r["block_hash"] is not None)


def test_a_fifo_in_a_replicas_place_is_not_waited_on(tmp_path, synth_root):
    root, _ = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"})
    m = tmp_path / "m.parquet"
    rows = scan_size(root, m)
    victim = root / _replica_row(rows)["relpath"]
    victim.unlink()
    os.mkfifo(victim)  # opened for reading without O_NONBLOCK, this would block for ever
    proc = subprocess.run([KVMIGRATE, "migrate", "--manifest", str(m), "--apply", "--json"], capture_output=True,
                          text=True, timeout=60)
    summary = json.loads(proc.stdout)
    assert proc.returncode == 0 and summary["outcomes"]["changed_since_scan"] == 1
    assert any(f"replica {victim.relative_to(root)}: source is no longer a regular file" in f
               for f in summary["apply"]["findings"])


def test_a_vanished_replica_is_changed_since_the_scan(tmp_path, synth_root):
    root, _ = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"})
    m = tmp_path / "m.parquet"
    rows = scan_size(root, m)
    victim = _replica_row(rows)
    (root / victim["relpath"]).unlink()
    code, summary = run_json("migrate", "--manifest", m, "--apply")
    assert code == 0 and summary["outcomes"]["changed_since_scan"] == 1
    assert any(f"replica {victim['relpath']}: source vanished since the scan" in f
               for f in summary["apply"]["findings"])


def test_folders_made_by_two_threads_are_the_same_and_journaled(tmp_path, synth_root, monkeypatch):
    from kvmigrate.migrate import dirs as dirs_mod
    from kvmigrate.migrate.apply import apply_plan
    from kvmigrate.migrate.plan import build_plan

    root, _ = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla", "blocks": 40},
                         {"family": "vllm", "scheme": "S1", "kv_kind": "mla", "blocks": 40, "model_name": "org/b"})
    m = tmp_path / "m.parquet"
    scan_size(root, m)

    def folders(d):
        return sorted(os.path.relpath(p, d) for p, _, _ in os.walk(d) if ".kvmigrate" not in p)

    (one := tmp_path / "one").mkdir()
    (two := tmp_path / "two").mkdir()
    assert apply_plan(build_plan(m, dest=str(one)), journal=str(tmp_path / "j1.jsonl")).exit_code == 0
    monkeypatch.setattr(dirs_mod, "_PARALLEL_DIRS", 1)  # every depth of every batch by two threads
    result = apply_plan(build_plan(m, dest=str(two)), journal=str(tmp_path / "j2.jsonl"), batch_size=16)
    assert result.exit_code == 0 and result.outcomes["created"] == 80
    assert folders(one) == folders(two) and len(folders(two)) > 80
    records = read_records(tmp_path / "j2.jsonl")
    journaled = {p for r in records if r["t"] == "done" and r["kind"] == "dirs" for p in r["paths"]}
    assert journaled == set(folders(two)) - {"."}
    code, summary = run_json("rollback", tmp_path / "j2.jsonl")
    assert code == 0 and folders(two) == ["."]


_APPLY_IN_BATCHES = """
import sys
from kvmigrate.migrate import dirs as dirs_mod
from kvmigrate.migrate.apply import apply_plan
from kvmigrate.migrate.plan import build_plan
dirs_mod._PARALLEL_DIRS = 1
result = apply_plan(build_plan(sys.argv[1]), journal=sys.argv[2], batch_size=8)
sys.exit(result.exit_code)
"""


@pytest.mark.parametrize("crash", ["intent:3", "created:12"])
def test_a_kill_while_the_next_batch_is_prepared_resumes_and_rolls_back(tmp_path, synth_root, crash):
    """Batches of 8: kill -9 after the third intent (the second batch's folders made, its
    blocks not linked yet), or while the second batch is linked (the helpers make the
    third batch's folders); the rerun ends like a clean run, rollback leaves the pristine
    tree."""
    from kvmigrate.migrate.apply import CRASH_ENV

    from helpers.reference_reader import content_listing, listing

    clean_root, _ = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla", "blocks": 30}, root_name="clean")
    root, _ = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla", "blocks": 30})
    pristine = listing(root, with_times=False)
    maps = [{os.lstat(os.path.join(d, f)).st_ino: os.path.relpath(os.path.join(d, f), r)
             for d, _, fs in os.walk(r) for f in fs} for r in (clean_root, root)]  # inode -> source file
    runs = []
    for r in (clean_root, root):
        m = tmp_path / f"{r.name}.parquet"
        scan_size(r, m)
        runs.append((m, tmp_path / f"{r.name}.jsonl"))
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}

    def apply(m, journal, crash=None):
        return subprocess.run([sys.executable, "-c", _APPLY_IN_BATCHES, str(m), str(journal)], timeout=120,
                              env={**env, **({CRASH_ENV: crash} if crash else {})}, capture_output=True, text=True)

    assert apply(*runs[0]).returncode == 0
    killed = apply(*runs[1], crash=crash)
    assert killed.returncode == -9, killed.stderr
    resumed = apply(*runs[1])
    assert resumed.returncode == 0, resumed.stderr
    assert content_listing(root, sources=maps[1]) == content_listing(clean_root, sources=maps[0])
    code, result = run_json("rollback", runs[1][1])
    assert code == 0, result
    assert listing(root, exclude_top=(".kvmigrate",), with_times=False) == pristine
