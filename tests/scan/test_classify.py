"""The pure decision rules of kvmigrate.classify, cell by cell (no trees needed)."""

from __future__ import annotations

from collections import Counter

import pytest

from kvmigrate import families
from kvmigrate.classify import (
    LEGACY_FLOOR,
    STATUS_BITS,
    UNVERIFIED,
    FileRecord,
    TargetInfo,
    UnitPlan,
    classify_block,
    exit_bits,
    majority_size,
    size_status,
)

HEX = "abcdef" + "0" * 58
TARGET = TargetInfo(profile="vllm-0.28", base="m_111111111111", d12="111111111111", rank_dir="m_111111111111_r0",
                    replicated_layout=False, parallel_agnostic=True)
REPLICATED = TargetInfo(profile="vllm-0.28", base="m_222222222222", d12="222222222222",
                        rank_dir="m_222222222222_r0", replicated_layout=True, parallel_agnostic=True)


def rec(rank: int, size: int = 4096, *, base: str = "m_000000000000", content: bytes | None = None,
        payload: bytes | None = None, status: str = "ok") -> FileRecord:
    rel = f"{base}_r{rank}/abc/de_g0/{HEX}.bin"
    return FileRecord(rel, rank, 0, HEX, size, 1, 100 + rank, 1, 1, content=content, payload=payload,
                      status=status, reason="" if status == "ok" else status)


def plan(family: str, **kw) -> UnitPlan:
    kw.setdefault("target", TARGET)
    return UnitPlan(fam=families.get(family), **kw)


def test_exit_bits_follow_the_interface_table():
    assert exit_bits(["ok", "own_artifact"]) == 0
    assert exit_bits(["incomplete"]) == 1
    assert exit_bits(["replica_mismatch"]) == 5
    assert exit_bits(["unreadable", "tmp_leftover"]) == 9
    assert set(STATUS_BITS) >= {"ok", "incomplete", "replica_mismatch", "size_mismatch", "padded_legacy", "short",
                                "zero_filled", "misfiled", "header_invalid", "unreadable", "tmp_leftover",
                                "own_artifact", "foreign", "orphan_namespace", "digest_mismatch",
                                "config_invalid", "unsupported_layout"}


# -- size rules --------------------------------------------------------------------------------

def test_vllm_rows_are_multiples_of_4096_and_match_proven_geometry():
    p = plan("vllm", kv_kind="mla", layers={0: 2}, page_bytes=256, blocks_per_file=1, world=2)
    assert size_status(p, 0, 4096) is None  # 2 cells x 512 -> padded to 4096
    assert size_status(p, 0, 3072)[0] == "size_mismatch"
    assert size_status(p, 0, 8192)[0] == "size_mismatch"
    assert size_status(plan("vllm"), 0, 8192) is None  # no geometry: only the 4096 rule
    assert size_status(plan("vllm"), 0, 0) == ("short", "empty file")


def test_llmd_geometry_padded_legacy_and_mismatch():
    p = plan("llmd", kv_kind="full", tensors_per_layer=2, layers={0: 2}, page_bytes=256, blocks_per_file=4)
    assert size_status(p, 0, 4 * 4 * 256) is None
    assert size_status(p, 0, LEGACY_FLOOR)[0] == "padded_legacy"
    assert size_status(p, 0, 4096 + 1)[0] == "size_mismatch"
    # without tensors_per_layer a full-attention page count is unknown: nothing proven
    assert size_status(plan("llmd", kv_kind="full", layers={0: 2}, page_bytes=256, blocks_per_file=4), 0,
                       LEGACY_FLOOR) is None


def test_vllmcpp_size_is_header_plus_page_size():
    p = plan("vllmcpp", payload_bytes=512)
    assert size_status(p, 0, 640) is None
    assert size_status(p, 0, 64)[0] == "short"
    assert size_status(p, 0, 641)[0] == "size_mismatch"


def test_majority_size_names_the_norm_and_flags_ties():
    off, why = majority_size(Counter({4096: 5, 3072: 1}))
    assert off == {3072} and "4096" in why
    off, why = majority_size(Counter({4096: 1, 3072: 1}))
    assert off == {3072, 4096} and "no majority" in why


# -- block rules ------------------------------------------------------------------------------

def test_rank_row_rule_puts_the_action_on_rank_zero():
    p = plan("llmd", expected_ranks=(0, 1), kv_kind="full", blocks_per_file=1)
    recs = [rec(1, 1024), rec(0, 1024)]
    classify_block(p, recs, 0, HEX)
    r1, r0 = recs
    assert r0.action == "concat" and r0.target_relpath == f"{TARGET.rank_dir}/abc/de_g0/{HEX}.bin"
    assert r0.reason == "concat: ranks 0..1 (2 x 1024 bytes) + pad to 4096 bytes"
    assert r1.action == "none" and r1.reason == "part of concat from rank 0" and r1.target_relpath is None


def test_missing_rank_makes_the_present_rows_incomplete():
    p = plan("llmd", expected_ranks=(0, 1, 2), kv_kind="mla", blocks_per_file=1, target=REPLICATED)
    recs = [rec(0), rec(2)]
    classify_block(p, recs, 0, HEX)
    assert [r.status for r in recs] == ["incomplete", "incomplete"]
    assert all("rank 1 file missing" in r.reason and r.action == "none" for r in recs)


def test_replicas_differ_by_hash_flags_every_replica():
    p = plan("llmd", expected_ranks=(0, 1, 2), kv_kind="mla", blocks_per_file=1, target=REPLICATED, hashed=True)
    recs = [rec(0, content=b"a" * 16), rec(1, content=b"a" * 16), rec(2, content=b"b" * 16)]
    classify_block(p, recs, 0, HEX)
    assert {r.status for r in recs} == {"replica_mismatch"}
    assert all(r.action == "none" for r in recs)


def test_equal_replicas_go_to_the_replicated_row():
    p = plan("llmd", expected_ranks=(0, 1), kv_kind="mla", blocks_per_file=1, target=REPLICATED, hashed=True)
    recs = [rec(0, 4096, content=b"a" * 16), rec(1, 4096, content=b"a" * 16)]
    classify_block(p, recs, 0, HEX)
    assert recs[0].action == "link" and "verified equal" in recs[0].reason
    assert recs[1].reason == "replica of rank 0"
    p.hashed = False
    recs = [rec(0, 1000), rec(1, 1000)]
    classify_block(p, recs, 0, HEX)
    assert recs[0].action == "copy_pad" and UNVERIFIED in recs[0].reason


def test_a_damaged_rank_file_blocks_the_healthy_ones():
    p = plan("llmd", expected_ranks=(0, 1), kv_kind="full", blocks_per_file=1)
    recs = [rec(0), rec(1, 0, status="short")]
    classify_block(p, recs, 0, HEX)
    assert recs[0].status == "ok" and recs[0].action == "none" and "rank 1 file is short" in recs[0].reason
    assert recs[1].status == "short"


def test_source_at_its_target_path():
    same = TargetInfo("vllm-0.28", "m_000000000000", "000000000000", "m_000000000000_r0", False, False)
    recs = [rec(0)]
    classify_block(plan("vllm", target=same), recs, 0, HEX)
    assert recs[0].action == "already_present" and recs[0].target_relpath == recs[0].relpath
    recs = [rec(0, 1000)]  # llm-d tp=1: copy_pad would have to write over its own source
    classify_block(plan("llmd", target=same, blocks_per_file=1), recs, 0, HEX)
    assert recs[0].action == "none" and recs[0].reason.startswith("aliases_source") and "--dest" in recs[0].reason


@pytest.mark.parametrize("reason", ["hash granularity changed", "target_lacks_storage_format"])
def test_unreachable_target_reason_is_the_block_reason(reason):
    t = TargetInfo("vllm-0.26", "m_1", "1", "m_1_r0", False, False, unreachable=reason)
    recs = [rec(0)]
    classify_block(plan("vllm", target=t), recs, 0, HEX)
    assert recs[0].action == "none" and recs[0].reason == reason


def test_missing_fact_reason_wins():
    recs = [rec(0)]
    classify_block(plan("vllm", none_reason="missing deployment fact 'model_dtype': pass --model-dtype"), recs, 0,
                   HEX)
    assert recs[0].action == "none" and "--model-dtype" in recs[0].reason


def test_ambiguous_family_that_matters_waits_for_family():
    recs = [rec(0)]
    classify_block(plan("ambiguous", ambiguity_harmless=False), recs, 0, HEX)
    assert recs[0].action == "none" and "--family" in recs[0].reason
    recs = [rec(0)]
    classify_block(plan("ambiguous", ambiguity_harmless=True), recs, 0, HEX)
    assert recs[0].action == "link"


def test_vllm_mla_slice_numbers():
    p = plan("vllm", kv_kind="mla", world=4, layers={0: 2}, blocks_per_file=1, target=REPLICATED)
    recs = [rec(0, 8192)]
    classify_block(p, recs, 0, HEX)
    assert recs[0].action == "needs_slice" and "c in 1025..2048 (pass --page-bytes; or scan with --verify hash" in recs[0].reason
    p.page_bytes = 4096  # 4 x (2 x 4096) does not fit an 8192-byte row
    classify_block(p, recs, 0, HEX)
    assert recs[0].action == "needs_slice" and "facts and data disagree" in recs[0].reason
    p.source_replicated = True  # a replicated source is already one cell: a plain re-key
    classify_block(p, recs, 0, HEX)
    assert recs[0].action == "link"


def test_relayout_names_the_missing_flags():
    p = plan("llmd", expected_ranks=(0,), kv_kind="full", blocks_per_file=4, layers={0: 2})
    recs = [rec(0, 4096)]
    classify_block(p, recs, 0, HEX)
    assert recs[0].action == "needs_relayout"
    assert "T unknown, P unknown (pass --tensors-per-layer and --page-bytes)" in recs[0].reason


def test_vllmcpp_rules():
    cpp_target = TargetInfo("vllmcpp", "m_333333333333", "333333333333", "m_333333333333_r0", True, True)
    p = plan("vllmcpp", expected_ranks=(0, 1), kv_kind="mla", target=cpp_target, hashed=True)
    recs = [rec(0, payload=b"p" * 16, content=b"x" * 16), rec(1, payload=b"p" * 16, content=b"y" * 16)]
    classify_block(p, recs, 0, HEX)
    assert recs[0].action == "rewrite_header" and recs[1].reason == "replica of rank 0"
    recs = [rec(0, payload=b"p" * 16), rec(1, payload=b"q" * 16)]
    classify_block(p, recs, 0, HEX)
    assert {r.status for r in recs} == {"replica_mismatch"}
    full = plan("vllmcpp", expected_ranks=(0, 1), kv_kind="full", target=cpp_target)
    recs = [rec(0), rec(1)]
    classify_block(full, recs, 0, HEX)
    assert recs[0].action == "none" and "rank-private shard" in recs[0].reason


def test_namespace_wide_status_covers_every_block_row():
    p = plan("unknown", block_status="orphan_namespace", block_reason="rank folder without its base folder")
    recs = [rec(0), rec(1, status="short")]
    classify_block(p, recs, 0, HEX)
    assert [r.status for r in recs] == ["orphan_namespace", "short"]
    assert all(r.action == "none" for r in recs)
