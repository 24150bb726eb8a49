"""Each writer family and scheme era: the namespaces found, digests proved, the family
detected (ambiguous where it must be), and the action planned for every block."""

from __future__ import annotations

import os

import pytest

from kvmigrate.classify import UNVERIFIED
from kvmigrate.identity.canonical import full_digest

DTYPE = {"model_dtype": "bfloat16"}
# a vLLM tp = pp = 1 folder may have been collapsed by a 0.24-0.33 gate: the synth writer's topology
TP1 = {**DTYPE, "writer_tp": 1, "writer_pp": 1}
FULL_FACTS = {**TP1, "kv_kind": "full", "total_kv_heads": 8}


def blocks(rows: dict, rank: int | None = None) -> list[dict]:
    return [r for r in rows.values() if r["block_hash"] is not None and (rank is None or r["rank"] == rank)]


def namespace(scan, base: str) -> dict:
    return next(ns for ns in scan.summary["namespaces"] if ns["source_base"] == base)


def check_namespaces(scan, results) -> None:
    """Every synth namespace is found, with its digest proved and the expected family."""
    for result in results:
        for ns in result.namespaces:
            got = namespace(scan, ns["base_name"])
            assert got["digest_ok"] is True
            assert got["family"] == ns["expected_family"], got["family_evidence"]
            assert got["scheme"] == ns["scheme"]
            assert got["ranks"] == ns["ranks"]


def only_action(rows: dict, action: str, fragment: str = "", rank: int = 0) -> list[dict]:
    """Every block's rank-`rank` row carries `action` (reason containing `fragment`) and
    the target path; every other rank's row carries none."""
    first = blocks(rows, rank)
    assert first, "no blocks"
    for r in first:
        assert r["action"] == action, (r["relpath"], r["action"], r["reason"])
        assert fragment in r["reason"], r["reason"]
        assert r["status"] == "ok"
        if action != "none":
            assert r["target_relpath"] and r["target_relpath"].endswith(r["relpath"].split("/", 1)[1])
    for r in blocks(rows):
        if r["rank"] != rank:
            assert r["action"] == "none" and r["target_relpath"] is None
    return first


# -- vLLM ----------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme,family", [("S1", "ambiguous"), ("S2", "vllm")])
def test_vllm_tp1_legacy_rows_are_linked(synth_root, scan_root, scheme, family):
    root, results = synth_root(dict(family="vllm", scheme=scheme))
    scan, rows = scan_root(root, flags=TP1)
    check_namespaces(scan, results)
    first = only_action(rows, "link", "re-key")
    assert all(r["target_base"] != r["source_base"] for r in first)
    if family == "ambiguous":
        ns = namespace(scan, results[0].namespaces[0]["base_name"])
        assert any("both readings give the same bytes" in e for e in ns["family_evidence"])
        assert "family ambiguous" in first[0]["reason"]


def test_vllm_s3_specific_namespace_is_already_present(synth_root, scan_root):
    root, results = synth_root(dict(family="vllm", scheme="S3"))
    scan, rows = scan_root(root, flags=DTYPE)
    check_namespaces(scan, results)
    first = only_action(rows, "already_present")
    assert all(r["target_relpath"] == r["relpath"] for r in first)


def test_vllm_s3_specific_to_agnostic_is_a_link(synth_root, scan_root):
    """vLLM 0.28-0.33 collapse a direct full-attention TP1 deployment; 0.34 reads its own name."""
    root, results = synth_root(dict(family="vllm", scheme="S3"))
    _, rows = scan_root(root, flags=FULL_FACTS)
    only_action(rows, "already_present")
    scan, rows = scan_root(root, flags=FULL_FACTS, target="vllm-0.28")
    only_action(rows, "link")
    ns = namespace(scan, results[0].namespaces[0]["base_name"])
    assert ns["gate"]["parallel_agnostic"] is True and ns["target_base"] != ns["source_base"]


@pytest.mark.parametrize("scheme", ["S2", "S3"])
def test_vllm_tp4_full_attention_rows_are_linked(synth_root, scan_root, scheme):
    root, results = synth_root(dict(family="vllm", scheme=scheme, tp=4))
    scan, rows = scan_root(root, flags=FULL_FACTS, target="vllm-0.28")
    check_namespaces(scan, results)
    only_action(rows, "link", "re-key")  # vLLM 0.28-0.33's agnostic target holds the same 4-cell rows


def test_vllm_s1_tp4_is_ambiguous_and_waits_for_family(synth_root, scan_root):
    root, results = synth_root(dict(family="vllm", scheme="S1", tp=4))
    scan, rows = scan_root(root, flags=FULL_FACTS)
    check_namespaces(scan, results)
    only_action(rows, "none", "pass --family")
    ns = namespace(scan, results[0].namespaces[0]["base_name"])
    assert any("changes decisions" in e for e in ns["family_evidence"])
    _, rows = scan_root(root, flags={**FULL_FACTS, "family": "vllm"})
    only_action(rows, "link")


def test_vllm_mla_tp2_s2_slice_with_cell_proven_by_facts(synth_root, scan_root):
    root, results = synth_root(dict(family="vllm", scheme="S2", tp=2, kv_kind="mla"))
    scan, rows = scan_root(root, flags={**DTYPE, "kv_kind": "mla", "page_bytes": 256})
    check_namespaces(scan, results)
    # 2 layers x 256 x 1; a 4096-byte output (cell + pad)
    only_action(rows, "slice", "slice: cell 0 of 2 (cell 512 bytes; from facts: 2 layers x 256 page bytes x 1 "
                               "blocks per file")
    only_action(rows, "slice", "+ pad to 4096 bytes")
    assert namespace(scan, results[0].namespaces[0]["base_name"])["gate"]["replicated_layout"] is True


def test_vllm_mla_tp2_needs_slice_reports_candidates(synth_root, scan_root):
    root, _ = synth_root(dict(family="vllm", scheme="S2", tp=2, kv_kind="mla"))
    _, rows = scan_root(root, flags={**DTYPE, "kv_kind": "mla"})
    only_action(rows, "needs_slice", "c in 1..2048 (pass --page-bytes; or scan with --verify hash")
    _, rows = scan_root(root, flags={**DTYPE, "kv_kind": "mla"}, verify="hash")
    only_action(rows, "slice", "cell 512 bytes: the only size with 2 equal cells and a zero tail")
    _, rows = scan_root(root, flags={**DTYPE, "kv_kind": "mla", "page_bytes": 256}, verify="hash")
    only_action(rows, "slice", "cell 512 bytes from facts")
    _, rows = scan_root(root, flags={**DTYPE, "kv_kind": "mla", "page_bytes": 128}, verify="hash")
    only_action(rows, "needs_slice", "facts and data disagree")


def test_vllm_mla_tp2_without_replicated_target_is_a_link(synth_root, scan_root):
    """vLLM 0.26 has no replicated gate: the S1 -> S2 re-key keeps the same N identical
    cells, so the row is linked; 0.27+ collapses it (needs_slice)."""
    root, _ = synth_root(dict(family="vllm", scheme="S1", tp=2, kv_kind="mla"))
    _, rows = scan_root(root, flags={"kv_kind": "mla", "family": "vllm"}, target="vllm-0.26")
    only_action(rows, "link", "re-key")
    _, rows = scan_root(root, flags={**DTYPE, "kv_kind": "mla", "family": "vllm"}, target="vllm-0.27")
    only_action(rows, "needs_slice")


def test_vllm_s3_replicated_mla_is_already_present(synth_root, scan_root):
    root, results = synth_root(dict(family="vllm", scheme="S3", tp=2, kv_kind="mla", replicated_layout=True))
    scan, rows = scan_root(root, flags={**DTYPE, "kv_kind": "mla"})
    check_namespaces(scan, results)
    only_action(rows, "already_present")


# -- llm-d ---------------------------------------------------------------------------------

def test_llmd_tp1_unaligned_file_is_copy_padded(synth_root, scan_root):
    root, results = synth_root(dict(family="llmd"))
    scan, rows = scan_root(root, flags=DTYPE)
    check_namespaces(scan, results)  # 1024-byte files: llm-d, not ambiguous
    only_action(rows, "copy_pad", "zero padded to 4096")


def test_llmd_tp1_aligned_file_is_linked(synth_root, scan_root):
    root, results = synth_root(dict(family="llmd", page_bytes=1024))  # 2 layers x 2 tensors x 1024 = 4096
    scan, rows = scan_root(root, flags=TP1)  # (read as vLLM, it may be a collapsed folder)
    check_namespaces(scan, results)  # ambiguous, but harmless
    only_action(rows, "link")


def test_llmd_tp2_mla_replicas_go_to_the_replicated_row(synth_root, scan_root):
    root, results = synth_root(dict(family="llmd", tp=2, kv_kind="mla"))
    scan, rows = scan_root(root, flags={**DTYPE, "kv_kind": "mla"})
    check_namespaces(scan, results)
    only_action(rows, "copy_pad", UNVERIFIED)
    assert {r["reason"] for r in blocks(rows, 1)} == {"replica of rank 0"}
    _, rows = scan_root(root, flags={**DTYPE, "kv_kind": "mla"}, verify="hash")
    only_action(rows, "copy_pad", "replica hashes verified equal")


def test_llmd_tp2_without_kv_kind_needs_concat(synth_root, scan_root):
    root, _ = synth_root(dict(family="llmd", tp=2, kv_kind="mla"))
    _, rows = scan_root(root, flags=DTYPE)
    only_action(rows, "needs_concat", "rank 0 ‖ rank 1")


def test_llmd_tp2_full_attention_is_concatenated(synth_root, scan_root):
    root, results = synth_root(dict(family="llmd", tp=2))
    scan, rows = scan_root(root, flags=FULL_FACTS)
    check_namespaces(scan, results)
    only_action(rows, "concat", "concat: ranks 0..1 (2 x 1024 bytes) + pad to 4096 bytes")
    assert {r["reason"] for r in blocks(rows, 1)} == {"part of concat from rank 0"}


def test_llmd_blocks_per_file_needs_relayout_until_its_numbers_are_known(synth_root, scan_root):
    root, results = synth_root(dict(family="llmd", tp=2, blocks_per_file=4))
    scan, rows = scan_root(root, flags=DTYPE)
    check_namespaces(scan, results)
    only_action(rows, "needs_relayout", "4096 bytes, B=4, T unknown, P unknown (pass --kv-kind and --page-bytes)")
    _, rows = scan_root(root, flags={**FULL_FACTS, "tensors_per_layer": 2, "page_bytes": 256})
    only_action(rows, "relayout", "relayout: B=4 T=4 P=256 ([B][T][P] -> [T][B][P], 4096 bytes per rank), "
                                  "then concat of ranks 0..1 + pad to 8192 bytes")


def test_llmd_relayout_geometry_must_match_the_size(synth_root, scan_root):
    """P from --page-bytes, never from the file size: a wrong P makes every file a size
    mismatch against the proven geometry instead of a guessed relayout."""
    root, _ = synth_root(dict(family="llmd", tp=2, blocks_per_file=4))
    _, rows = scan_root(root, flags={**FULL_FACTS, "tensors_per_layer": 2, "page_bytes": 128})
    assert {r["status"] for r in blocks(rows)} == {"size_mismatch"}
    assert all("the 2048 bytes the proven geometry" in r["reason"] for r in blocks(rows))


def test_llmd_target_aliasing_its_own_folder_is_never_written(synth_root, scan_root):
    """--target vllm-0.22 names the llm-d folder itself (same S1 identity, other bytes)."""
    root, _ = synth_root(dict(family="llmd", tp=2))
    _, rows = scan_root(root, flags=FULL_FACTS, target="vllm-0.22")
    only_action(rows, "none", "aliases_source")
    assert "--dest" in blocks(rows, 0)[0]["reason"]


# -- vllm.cpp ------------------------------------------------------------------------------

def test_vllmcpp_single_rank_is_already_in_place(synth_root, scan_root):
    root, results = synth_root(dict(family="vllmcpp"))
    scan, rows = scan_root(root)
    check_namespaces(scan, results)
    only_action(rows, "already_present")
    assert all(r["target_relpath"] == r["relpath"] for r in blocks(rows))


def test_vllmcpp_tp2_mla_is_rewritten_into_the_collapsed_identity(synth_root, scan_root):
    root, results = synth_root(dict(family="vllmcpp", tp=2, kv_kind="mla"))
    scan, rows = scan_root(root, verify="hash")
    check_namespaces(scan, results)
    only_action(rows, "rewrite_header", "payload hashes verified equal")
    assert {r["reason"] for r in blocks(rows, 1)} == {"replica of rank 0"}
    deployment = full_digest(dict(results[0].namespaces[1]["fields"], rank=0), "vllmcpp")
    assert {r["deployment"] for r in blocks(rows)} == {deployment}
    assert all(r["payload_xxh3_128"] is not None for r in blocks(rows))
    assert len({r["target_base"] for r in blocks(rows)}) == 1
    # the summary counts each block once, under the rank-0 namespace
    ns0 = namespace(scan, results[0].namespaces[0]["base_name"])
    assert ns0["by_action"]["rewrite_header"]["blocks"] == 6


def test_vllmcpp_tp2_full_attention_is_a_rank_private_shard(synth_root, scan_root):
    root, results = synth_root(dict(family="vllmcpp", tp=2))
    scan, rows = scan_root(root)
    check_namespaces(scan, results)
    only_action(rows, "none", "rank-private shard")


# -- targets that exist, missing facts, unknown keys ---------------------------------------

def test_target_already_holding_the_bytes_is_already_present(synth_root, scan_root):
    root, results = synth_root(dict(family="vllm", scheme="S2"))
    _, rows = scan_root(root, flags=TP1)
    first = blocks(rows, 0)
    hard, copied, other = first[0], first[1], first[2]
    for r in (hard, copied, other):
        (root / r["target_relpath"]).parent.mkdir(parents=True, exist_ok=True)
    os.link(root / hard["relpath"], root / hard["target_relpath"])
    (root / copied["target_relpath"]).write_bytes((root / copied["relpath"]).read_bytes())
    (root / other["target_relpath"]).write_bytes(b"\1" * 4096)
    _, rows = scan_root(root, flags=TP1)
    assert rows[hard["relpath"]]["action"] == "already_present"
    assert "hard link" in rows[hard["relpath"]]["reason"]
    assert rows[copied["relpath"]]["action"] == "already_present"
    assert rows[other["relpath"]]["action"] == "none"
    assert "aliases_source" in rows[other["relpath"]]["reason"]
    assert rows[first[3]["relpath"]]["action"] == "link"


def test_copy_pad_output_already_present(synth_root, scan_root):
    root, _ = synth_root(dict(family="llmd"))
    _, rows = scan_root(root, flags=DTYPE)
    r = blocks(rows, 0)[0]
    data = (root / r["relpath"]).read_bytes()
    (root / r["target_relpath"]).parent.mkdir(parents=True, exist_ok=True)
    (root / r["target_relpath"]).write_bytes(data + bytes(-len(data) % 4096))
    _, rows = scan_root(root, flags=DTYPE)
    assert rows[r["relpath"]]["action"] == "already_present"


def test_missing_fact_fails_only_its_namespace(synth_root, scan_root):
    root, results = synth_root(dict(family="vllm", scheme="S1"), dict(family="vllmcpp"))
    scan, rows = scan_root(root)
    s1 = results[0].namespaces[0]["base_name"]
    ns = namespace(scan, s1)
    assert "--model-dtype" in ns["target_error"]
    assert all(r["action"] == "none" and "--model-dtype" in r["reason"]
               for r in blocks(rows) if r["source_base"] == s1)
    assert all(r["action"] == "already_present" for r in blocks(rows) if r["source_base"] != s1)
    assert scan.exit_code == 1
    assert scan.summary["missing_facts"][0]["flag"] == "--model-dtype"


def test_unknown_source_key_is_not_carried_into_a_target(synth_root, scan_root):
    root, _ = synth_root(dict(family="vllm", scheme="S2", extra_fields={"kv_sharing": "x"}))
    scan, rows = scan_root(root, flags=DTYPE)
    only_action(rows, "none", "target_lacks_kv_sharing")
    meta_ns = next(iter(scan.summary["namespaces"]))
    assert meta_ns["status"] == "ok"


def test_several_models_in_one_root_take_facts_per_namespace(synth_root, scan_root, tmp_path):
    import json

    root, results = synth_root(dict(family="llmd", tp=2, kv_kind="mla", model_name="deepseek-ai/DeepSeek-V2"),
                               dict(family="llmd", tp=2, model_name="Qwen/Qwen3-4B"))
    facts = tmp_path / "facts.json"
    facts.write_text(json.dumps({"deepseek-ai/DeepSeek-V2": {"kv_kind": "mla"},
                                 "Qwen/Qwen3-4B": {"kv_kind": "full", "total_kv_heads": 8},
                                 "*": {"model_dtype": "bfloat16"}}))
    scan, rows = scan_root(root, facts_file=str(facts))
    by_model = {}
    for r in blocks(rows, 0):
        by_model.setdefault(r["model_name"], set()).add(r["action"])
    assert by_model == {"deepseek-ai/DeepSeek-V2": {"copy_pad"}, "Qwen/Qwen3-4B": {"concat"}}
