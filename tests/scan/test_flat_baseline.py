"""`scan --baseline PREV` of a flat family's directory (SGLang HiCache, scan/flat.py) as of
a tree (tests/scan/test_baseline.py): unchanged pages keep the baseline's hashes unopened,
a rewrite that restores size and mtime is read again (ctime), `--recheck` re-reads the
pages of a rotating part of the buckets (the first 3 hex digits of a page's name) and
finds silent changes, and the manifest is a full hash scan's."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmigrate import manifest
from tests.scan.test_baseline import _with_hash_edited, opened_blocks, rewrite_keeping_size_and_mtime, rows, scan

from helpers.cli_helpers import run

FACTS = ["--kv-kind", "full", "--model-name", "org/m", "--target-layout", "layer_first"]
E2 = dict(family="sglang", sgl_era="e2", tp=2, blocks=40, layers=2)


def pages(path: Path) -> dict[str, dict]:
    return {k: r for k, r in rows(path).items() if k.endswith(".bin")}


def _same_rows(a: Path, b: Path) -> bool:
    """Two manifests hold the same rows, `carried` aside."""
    drop = ["carried"]
    return manifest.read_table(a).drop_columns(drop).equals(manifest.read_table(b).drop_columns(drop))


@pytest.mark.parametrize("era", ["e1", "e2", "e4"])
def test_unchanged_sglang_directory_opens_no_page_file(synth_root, tmp_path, walk, era):
    """e1 pages are torch.save archives (unsupported_layout by their head), e2 names are
    ones whose head decides, e4 ones whose head does not: all carried unopened."""
    root, _ = synth_root({**E2, "sgl_era": era, "tp": 1 if era == "e1" else 2})
    full = tmp_path / "full.parquet"
    assert opened_blocks(root, full, facts=FACTS) == len(pages(full)) > 0  # (strace sees a full read's opens)
    again = tmp_path / "again.parquet"
    assert opened_blocks(root, again, "--baseline", str(full), "--recheck", "0", facts=FACTS) == 0
    before, after = pages(full), pages(again)
    assert all(r["carried"] for r in after.values()) and not any(r["carried"] for r in before.values())
    assert all(r["ctime_ns"] for r in before.values())  # (what a baseline row is trusted by)
    assert _same_rows(full, again)
    assert manifest.read_metadata(again)["baseline"]["path"] == str(full)


def test_rewritten_page_with_restored_size_and_mtime_is_read_again(synth_root, tmp_path, walk):
    root, _ = synth_root(E2)
    full = tmp_path / "full.parquet"
    scan(root, full, facts=FACTS)
    victim = sorted(pages(full))[3]
    path = root / victim
    rewrite_keeping_size_and_mtime(path)
    again = tmp_path / "again.parquet"
    scan(root, again, "--baseline", full, "--recheck", "0", facts=FACTS)
    after = pages(again)
    assert not after[victim]["carried"]
    assert after[victim]["content_xxh3_128"] != pages(full)[victim]["content_xxh3_128"]
    assert after[victim]["ctime_ns"] == path.stat().st_ctime_ns
    assert all(r["carried"] for k, r in after.items() if k != victim)


def test_sampled_bucket_finds_a_silent_change_of_a_page(synth_root, tmp_path, walk):
    root, _ = synth_root(E2)
    full = tmp_path / "full.parquet"
    scan(root, full, facts=FACTS)
    victim = sorted(pages(full))[5]
    edited = tmp_path / "edited.parquet"
    _with_hash_edited(full, edited, victim)
    skipped = tmp_path / "skipped.parquet"
    scan(root, skipped, "--baseline", edited, "--recheck", "0", facts=FACTS)
    assert pages(skipped)[victim]["carried"]  # not re-read: the baseline's word is taken
    assert pages(skipped)[victim]["status"] != "silent_change"
    sampled = tmp_path / "sampled.parquet"
    code, _ = scan(root, sampled, "--baseline", edited, "--recheck", "1", facts=FACTS)
    got = pages(sampled)[victim]
    assert got["status"] == "silent_change" and got["finding"] == "silent_change" and got["action"] == "none"
    assert not got["carried"] and code & 4
    assert not [k for k, r in pages(sampled).items() if r["status"] == "silent_change" and k != victim]
    code, out = run("audit", root, "--verify", "hash", *FACTS, "--baseline", edited, "--recheck", "1")
    assert code & 4 and "disk or filesystem corruption" in out


def test_recheck_rotates_over_the_buckets_of_a_flat_directory(synth_root, tmp_path, walk):
    root, _ = synth_root({**E2, "blocks": 60})
    full, first, second = tmp_path / "full.parquet", tmp_path / "first.parquet", tmp_path / "second.parquet"
    scan(root, full, facts=FACTS)
    scan(root, first, "--baseline", full, "--recheck", "1/2", facts=FACTS)
    scan(root, second, "--baseline", first, "--recheck", "1/2", facts=FACTS)
    a, b = pages(first), pages(second)
    read_a = {k for k, r in a.items() if not r["carried"]}
    read_b = {k for k, r in b.items() if not r["carried"]}
    assert read_a and read_b and not read_a & read_b and read_a | read_b == set(a)  # two runs: every page once
    assert {int(k[:3], 16) % 2 for k in read_a} == {0} and {int(k[:3], 16) % 2 for k in read_b} == {1}
    assert _same_rows(full, first) and _same_rows(full, second)


def test_baseline_scan_of_a_directory_with_defects_is_the_full_scans(synth_root, tmp_path, walk):
    """Replica comparison of carried hashes (e2 MLA), size verdicts and the read findings
    (short, zero-filled: never carried) come out as a full hash scan says."""
    root, _ = synth_root({**E2, "kv_kind": "mla", "defects": ("replica_differs", "short", "zero_filled",
                                                                  "size_mismatch", "foreign")})
    facts = ["--kv-kind", "mla", "--model-name", "org/m", "--target-layout", "layer_first"]
    full, again = tmp_path / "full.parquet", tmp_path / "again.parquet"
    scan(root, full, facts=facts)
    scan(root, again, "--baseline", full, "--recheck", "0", facts=facts)
    statuses = {r["status"] for r in pages(full).values()}
    assert {"ok", "replica_mismatch", "size_mismatch", "short", "zero_filled"} <= statuses
    assert _same_rows(full, again)
    carried = {r["status"] for r in pages(again).values() if r["carried"]}
    assert {"ok", "replica_mismatch"} <= carried and not carried & {"short", "zero_filled"}


def test_a_shard_other_than_0_never_reads_a_flat_directory(synth_root, tmp_path):
    """Part 0 writes a flat directory's rows; part 1 of 2 must not open its pages (it did:
    every page hashed by every part, the rows then dropped); the two parts' dataset holds
    every page once."""
    root, _ = synth_root(E2)
    ds = tmp_path / "ds"
    ds.mkdir()
    assert opened_blocks(root, ds / "part-1.parquet", "--shard", "1/2", facts=FACTS) == 0
    assert opened_blocks(root, ds / "part-0.parquet", "--shard", "0/2", facts=FACTS) == 80
    full = tmp_path / "full.parquet"
    scan(root, full, facts=FACTS)
    assert sorted(pages(full)) == sorted(k for p in ("part-0", "part-1") for k in pages(ds / f"{p}.parquet"))
    assert set(manifest.read_metadata(ds / "part-0.parquet")["namespaces"]) == set(
        manifest.read_metadata(full)["namespaces"])
