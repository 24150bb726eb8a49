"""Family detection from config.json keys and folder evidence (formats.md §3)."""

from __future__ import annotations

import pytest

from kvmigrate.families import detect as detect_family
from kvmigrate.families.ambiguous import ambiguity_is_harmless, harmless_ambiguity_note

S1 = {"model_name": "m", "tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "dtype": "auto",
      "hash_block_size": 16, "gpu_blocks_per_file": 1, "inference_engine": "vllm",
      "kv_cache_groups": [{"block_size": 16, "layer_names": ["l0"]}]}
S2 = {"model_name": "m", "tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "dtype": "auto",
      "tokens_per_hash": 16, "blocks_per_file": 1, "inference_engine": "vllm", "kv_cache_groups": []}
CPP = {"format_version": 1, "hash_algo": "sha256_cbor", "kv_cache_spec_kind": "full_attention",
       "hash_block_size": 16, "model_name": "m"}


def test_vllmcpp_keys_win_even_with_hash_block_size():
    family, evidence = detect_family(CPP, rank_numbers=[0, 1])
    assert family == "vllmcpp"
    assert "vllm.cpp identity" in evidence[0]


def test_tokens_per_hash_is_vllm():
    assert detect_family(S2, rank_numbers=[0, 1, 2])[0] == "vllm"
    assert detect_family({**S2, "parallel_agnostic": False})[0] == "vllm"


def test_s1_with_rank_folders_beyond_r0_is_llmd():
    family, evidence = detect_family(S1, rank_numbers=[0, 1])
    assert family == "llmd"
    assert any("_r1" in e and "llm-d" in e for e in evidence)


def test_s1_with_block_sizes_not_page_multiples_is_llmd():
    family, evidence = detect_family(S1, rank_numbers=[0], block_sizes=[8192, 12288, 65536 + 512])
    assert family == "llmd"
    assert any("66048" in e for e in evidence)


def test_s1_without_evidence_is_ambiguous_with_the_reason():
    family, evidence = detect_family(S1, rank_numbers=[0], block_sizes=[4096, 8192])
    assert family == "ambiguous"
    assert any("--family" in e for e in evidence)
    assert detect_family(S1)[0] == "ambiguous"


@pytest.mark.parametrize("forced", ["vllm", "llmd"])
def test_forced_family_settles_s1(forced):
    family, evidence = detect_family(S1, forced=forced)
    assert family == forced
    assert any("given by the operator" in e for e in evidence)


def test_forced_family_never_overrides_proving_keys():
    family, evidence = detect_family(S2, forced="llmd")
    assert family == "vllm"
    assert any("ignored" in e for e in evidence)
    assert detect_family(CPP, forced="vllm")[0] == "vllmcpp"
    assert detect_family(S1, forced="vllmcpp", rank_numbers=[0, 1])[0] == "llmd"


def test_config_without_scheme_keys_is_unknown():
    assert detect_family({"model_name": "m"})[0] == "unknown"


def test_ambiguity_is_harmless_only_when_both_readings_give_the_same_bytes():
    assert ambiguity_is_harmless(S1, [4096, 8192])
    assert harmless_ambiguity_note(S1, [4096]) is not None
    assert not ambiguity_is_harmless({**S1, "tp_size": 2}, [4096])
    assert not ambiguity_is_harmless({**S1, "pp_size": 2}, [4096])
    assert not ambiguity_is_harmless({**S1, "pcp_size": 2}, [4096])
    assert not ambiguity_is_harmless({**S1, "gpu_blocks_per_file": 4}, [4096])
    assert not ambiguity_is_harmless(S1, [4096, 6000])
    assert harmless_ambiguity_note({**S1, "tp_size": 2}) is None
