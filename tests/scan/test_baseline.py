"""`scan --baseline PREV`: unchanged files keep the baseline's hashes unopened, a rewrite
that restores size and mtime is read again (ctime), `--recheck` re-reads a rotating part
and finds silent changes, and a baseline of another root, profile or version is refused."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvmigrate import manifest

from helpers.cli_helpers import run

FACTS = ["--model-dtype", "bfloat16", "--kv-kind", "mla"]
SPECS = (dict(family="llmd", tp=2, kv_kind="mla", blocks=12),)


def scan(root: Path, out: Path, *extra: object, facts: list[str] = FACTS) -> tuple[int, str]:
    return run("scan", root, "-o", out, "--verify", "hash", "-q", *facts, *extra)


def rows(path: Path) -> dict[str, dict]:
    return {r["relpath"]: r for r in manifest.read_table(path).to_pylist()}


def block_rows(path: Path) -> dict[str, dict]:
    return {k: r for k, r in rows(path).items() if k.endswith(".bin")}


def opened_blocks(root: Path, out: Path, *extra: str, facts: list[str] = FACTS) -> int:
    """Block (or page) files the scan opens, counted by strace (both walks: the C walk's openat too)."""
    log = out.with_suffix(".strace")
    subprocess.run(["strace", "-f", "-qq", "-e", "trace=open,openat,openat2", "-o", str(log), sys.executable, "-m",
                    "kvmigrate", "scan", str(root), "-o", str(out), "--verify", "hash", "-q", *facts, *extra],
                   check=False, capture_output=True, env=dict(os.environ))
    opens = [line for line in log.read_text().splitlines() if re.search(r'\.bin", ', line) and "= -1" not in line]
    return len(opens)


def rewrite_keeping_size_and_mtime(path: Path) -> None:
    """Other bytes of the same size under the old mtime: only the ctime moves."""
    st = path.stat()
    path.write_bytes(b"\x5a" * st.st_size)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_ctime_ns != st.st_ctime_ns


def test_unchanged_tree_opens_no_block_file(synth_root, tmp_path, walk):
    root, _ = synth_root(*SPECS)
    full = tmp_path / "full.parquet"
    assert opened_blocks(root, full) == len(block_rows(full)) > 0  # (strace sees the opens of a full read)
    again = tmp_path / "again.parquet"
    assert opened_blocks(root, again, "--baseline", str(full), "--recheck", "0") == 0
    before, after = block_rows(full), block_rows(again)
    assert {k: r["content_xxh3_128"] for k, r in after.items()} == {k: r["content_xxh3_128"] for k, r in before.items()}
    assert all(r["carried"] for r in after.values()) and not any(r["carried"] for r in before.values())
    assert {k: (r["status"], r["action"]) for k, r in after.items()} == {
        k: (r["status"], r["action"]) for k, r in before.items()}
    assert manifest.read_metadata(again)["baseline"]["path"] == str(full)


def test_rewrite_with_restored_size_and_mtime_is_read_again(synth_root, tmp_path, walk):
    root, _ = synth_root(*SPECS)
    full = tmp_path / "full.parquet"
    scan(root, full)
    victim = sorted(block_rows(full))[3]
    path = root / victim
    rewrite_keeping_size_and_mtime(path)
    again = tmp_path / "again.parquet"
    scan(root, again, "--baseline", full, "--recheck", "0")
    after = block_rows(again)
    assert not after[victim]["carried"]
    assert after[victim]["content_xxh3_128"] != block_rows(full)[victim]["content_xxh3_128"]
    assert after[victim]["status"] == "replica_mismatch"  # (the other rank's replica still has the old bytes)
    assert all(r["carried"] for k, r in after.items() if k != victim)


def _with_hash_edited(src: Path, dst: Path, relpath: str) -> None:
    """A copy of manifest `src` whose row `relpath` claims other bytes (as if the disk
    changed them under unchanged metadata)."""
    t = pq.read_table(src)
    i = t.schema.get_field_index("content_xxh3_128")
    hashes = t.column(i).to_pylist()
    k = t.column("relpath").to_pylist().index(relpath)
    hashes[k] = bytes(16)
    pq.write_table(t.set_column(i, t.schema.field(i), pa.array(hashes, pa.binary(16))), dst)


def test_sampled_bucket_finds_a_silent_change(synth_root, tmp_path, walk):
    root, _ = synth_root(*SPECS)
    full = tmp_path / "full.parquet"
    scan(root, full)
    victim = sorted(block_rows(full))[5]
    edited = tmp_path / "edited.parquet"
    _with_hash_edited(full, edited, victim)
    skipped = tmp_path / "skipped.parquet"
    scan(root, skipped, "--baseline", edited, "--recheck", "0")
    assert block_rows(skipped)[victim]["carried"]  # not re-read: the baseline's word is taken
    assert block_rows(skipped)[victim]["status"] != "silent_change"
    sampled = tmp_path / "sampled.parquet"
    code, _ = scan(root, sampled, "--baseline", edited, "--recheck", "1")
    got = block_rows(sampled)[victim]
    assert got["status"] == "silent_change" and got["finding"] == "silent_change" and got["action"] == "none"
    assert code & 4
    assert not [k for k, r in block_rows(sampled).items() if r["status"] == "silent_change" and k != victim]
    code, out = run("audit", root, "--verify", "hash", *FACTS, "--baseline", edited, "--recheck", "1")
    assert code & 4 and "disk or filesystem corruption" in out


def test_recheck_rotates_over_the_buckets(synth_root, tmp_path, walk):
    root, _ = synth_root(*SPECS)
    full, first, second = tmp_path / "full.parquet", tmp_path / "first.parquet", tmp_path / "second.parquet"
    scan(root, full)
    scan(root, first, "--baseline", full, "--recheck", "1/2")
    scan(root, second, "--baseline", first, "--recheck", "1/2")
    assert manifest.read_metadata(first)["baseline"]["recheck_slot"] == 0
    assert manifest.read_metadata(second)["baseline"]["recheck_slot"] == 1
    a, b = block_rows(first), block_rows(second)
    assert set(a) == set(b)
    read_a = {k for k, r in a.items() if not r["carried"]}
    read_b = {k for k, r in b.items() if not r["carried"]}
    assert read_a and read_b and not read_a & read_b and read_a | read_b == set(a)  # two runs: every file once


def test_baseline_of_another_root_is_refused(synth_root, tmp_path):
    root, _ = synth_root(*SPECS)
    other, _ = synth_root(*SPECS, root_name="other")
    theirs = tmp_path / "other.parquet"
    scan(other, theirs)
    code, out = scan(root, tmp_path / "x.parquet", "--baseline", theirs)
    assert code == 2 and "baseline refused" in out and str(other) in out and "cache root" in out
    assert not (tmp_path / "x.parquet").exists()


def test_baseline_of_another_target_profile_or_verify_is_refused(synth_root, tmp_path):
    root, _ = synth_root(*SPECS)
    sized = tmp_path / "sized.parquet"
    run("scan", root, "-o", sized, "-q", *FACTS)
    code, out = scan(root, tmp_path / "x.parquet", "--baseline", sized)
    assert code == 2 and "--verify size scan has no hashes" in out
    full = tmp_path / "full.parquet"
    scan(root, full)
    code, out = run("scan", root, "-o", tmp_path / "y.parquet", "--verify", "size", "-q", *FACTS,
                    "--baseline", full)
    assert code == 2 and "needs --verify hash" in out
    assert manifest.read_metadata(full)["target_profile"] == "vllm-0.34"
    code, out = scan(root, tmp_path / "z.parquet", "--baseline", full, "--target", "vllm-0.26")
    assert code == 2 and "target profile 'vllm-0.34'" in out and "'vllm-0.26'" in out


def test_baseline_of_an_older_manifest_version_is_refused(synth_root, tmp_path):
    import json

    root, _ = synth_root(*SPECS)
    full = tmp_path / "full.parquet"
    scan(root, full)
    t = pq.read_table(full)
    meta = json.loads(t.schema.metadata[manifest.META_KEY])
    meta["manifest_version"] = 2
    old = tmp_path / "old.parquet"
    pq.write_table(t.drop_columns(["ctime_ns", "carried"]).replace_schema_metadata(
        {manifest.META_KEY: json.dumps(meta).encode()}), old)
    code, out = scan(root, tmp_path / "x.parquet", "--baseline", old)
    assert code == 2 and "format version 2" in out and "rescan with" in out


def test_baseline_auto_without_kept_audits_reads_everything(synth_root, tmp_path):
    root, _ = synth_root(*SPECS)
    out = tmp_path / "auto.parquet"
    code, _ = scan(root, out, "--baseline", "auto", "--history", tmp_path / "none-yet")
    assert code in (0, 1) and manifest.read_metadata(out)["baseline"] is None
    assert not any(r["carried"] for r in rows(out).values())


def test_parts_of_a_baseline_hold_the_rows_of_their_buckets(synth_root, tmp_path):
    """--run-on ray: a part is sent the baseline rows of the block files it walks (those of
    its buckets) and the few other rows (config.json, temp files: every part)."""
    from fractions import Fraction

    from kvmigrate.scan.baseline import load, load_parts
    from kvmigrate.scan.walker import _bucket_of, shard_part

    root, _ = synth_root(*SPECS)
    next(root.rglob("*.bin")).with_name("x.tmp").write_bytes(b"t")  # a file in a fan-out folder, not a block
    full = tmp_path / "full.parquet"
    scan(root, full)
    checks = dict(root=str(root), target="vllm-0.34", verify="hash", recheck=Fraction(0))
    whole = load(str(full), **checks)
    parts = load_parts(str(full), 3, **checks)
    assert all(p.metadata() == whole.metadata() for p in parts)
    blocks = {r["inode"]: shard_part(_bucket_of(k), 3) for k, r in block_rows(full).items()}
    others = {r["inode"] for k, r in rows(full).items() if k not in block_rows(full)}
    assert len(blocks) > 20 and len(others) >= 2  # (config.json, x.tmp)
    for k, part in enumerate(parts):
        inodes = set(memoryview(part.stat[1]).cast("Q").tolist())
        assert {i for i in inodes if i in blocks} == {i for i, p in blocks.items() if p == k} != set()
        assert others <= inodes
    assert sum(p.rows for p in parts) == len(blocks) + 3 * len(others) == whole.rows + 2 * len(others)


def test_a_baseline_held_by_bucket_folder_finds_what_the_whole_one_finds(synth_root, tmp_path, monkeypatch):
    """The rows of block files wait on disk by bucket folder (`<rank folder>/<hhh>`), read in
    batches of any size: each file finds the row (its hashes, its unsupported mark) the
    whole baseline held in memory finds, and the bucket folder's rows stay in inode order
    when they come from several batches."""
    from fractions import Fraction

    from kvmigrate.scan import baseline as bl

    root, _ = synth_root(dict(family="llmd", tp=2, kv_kind="mla", blocks=300))  # (buckets of several blocks)
    next(root.rglob("*.bin")).with_name("x.tmp").write_bytes(b"t")  # a file in a fan-out folder, not a block
    full = tmp_path / "full.parquet"
    scan(root, full)
    checks = dict(root=str(root), target="vllm-0.34", verify="hash", recheck=Fraction(0))
    (whole,) = bl.load_parts(str(full), 1, **checks)  # (the rows held in memory, as a Ray part holds them)
    monkeypatch.setattr(bl, "LOAD_BATCH", 7)  # a bucket folder's rows in several batches
    held = bl.load(str(full), **checks)
    assert held.buckets is not None and held.buckets.rows > 0.9 * held.rows and held.rows == whole.rows
    found = 0
    for relpath, r in rows(full).items():
        key = (r["dev"], r["inode"], r["size"], r["mtime_ns"], r["ctime_ns"])
        i, j = whole.unchanged(*key), held.rows_for(relpath).unchanged(*key)
        assert (i >= 0) == (j >= 0), relpath
        if i >= 0:
            found += 1
            assert whole.hashes(i) == held.rows_for(relpath).hashes(j) == (r["content_xxh3_128"],
                                                                           r["payload_xxh3_128"])
            assert whole.was_unsupported(i) == held.rows_for(relpath).was_unsupported(j)
    assert found == whole.rows
    assert len(held.buckets.runs) // 3 > len(set(held.buckets.runs[0::3]))  # a folder's rows in several runs
    sizes = []
    for folder in {k.rsplit("/", 2)[0] for k in block_rows(full)}:
        inodes = memoryview(held.bucket_rows(folder).stat[1]).cast("Q").tolist()
        assert inodes == sorted(inodes)
        sizes.append(len(inodes))
    assert sum(sizes) == held.buckets.rows and max(sizes) >= 2
