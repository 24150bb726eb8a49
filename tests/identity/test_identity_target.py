"""compute_target: mapping a source identity onto a target profile (identity.md §4)."""

from __future__ import annotations

import hashlib
import json

import pytest

from kvmigrate.errors import MissingFactError, UsageError
from kvmigrate.families import compute_target
from kvmigrate.identity.facts import Facts

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(32)]
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
FULL = Facts(kv_kind="full", total_kv_heads=8, model_dtype="bfloat16")


def s1(**over) -> dict:
    fields = {"model_name": LLAMA, "tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "dtype": "auto",
              "hash_block_size": 16, "gpu_blocks_per_file": 1, "inference_engine": "vllm",
              "kv_cache_groups": [{"block_size": 16, "layer_names": LAYERS}]}
    fields.update(over)
    return fields


def s2(**over) -> dict:
    fields = {"model_name": LLAMA, "tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "dtype": "auto",
              "tokens_per_hash": 16, "blocks_per_file": 1, "inference_engine": "vllm",
              "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": LAYERS}]}
    fields.update(over)
    return fields


def s3(**over) -> dict:
    return s2(**{"dtype": "bfloat16", "parallel_agnostic": False, **over})


def ref_d12(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]


# --- one deployment through the releases (upstream-format.md §7 worked folders) ----------------

@pytest.mark.parametrize("profile,d12", [
    ("vllm-0.22", "8d99faf398b6"), ("vllm-0.24", "8d99faf398b6"), ("vllm-0.26", "0c063575d130"),
    ("vllm-0.27", "c13170011f67"), ("vllm-0.28", "c13170011f67"),
])
def test_one_tp1_deployment_moves_through_four_folders(profile, d12):
    target = compute_target(s1(), "vllm", FULL, profile)
    assert target.base_name == f"meta-llama_Llama-3.1-8B-Instruct_{d12}"
    assert target.d12 == ref_d12(target.fields)
    assert target.rank_dir == target.base_name + "_r0"


def test_tp2_non_agnostic_target_keeps_sizes_and_discriminator():
    facts = Facts(kv_kind="full", total_kv_heads=8, model_dtype="bfloat16", runner="v2")
    target = compute_target(s2(tp_size=2), "vllm", facts, "vllm-0.28")
    assert target.base_name == "meta-llama_Llama-3.1-8B-Instruct_4acb1bd394b2"
    assert target.fields["tp_size"] == 2 and target.fields["parallel_agnostic"] is False
    assert target.rank_dir.endswith("_4acb1bd394b2_r0")  # vLLM targets always write _r0


def test_s1_llmd_tree_maps_onto_s3_keys():
    src = s1(tp_size=2, gpu_blocks_per_file=16)
    target = compute_target(src, "llmd", FULL, "vllm-0.28")
    assert target.family == "vllm"
    assert target.fields == {"model_name": LLAMA, "tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1,
                             "dtype": "bfloat16", "tokens_per_hash": 16, "blocks_per_file": 16,
                             "inference_engine": "vllm",
                             "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": LAYERS}]}
    assert target.unreachable is None


# --- dtype ------------------------------------------------------------------------------------

def test_auto_dtype_needs_model_dtype_for_027_and_later():
    for profile in ("vllm-0.27", "vllm-0.28"):
        with pytest.raises(MissingFactError) as err:
            compute_target(s2(), "vllm", Facts(kv_kind="full", total_kv_heads=8), profile)
        assert err.value.flag == "--model-dtype" and err.value.exit_code == 2
        assert "--model-dtype" in str(err.value)


def test_auto_dtype_is_kept_for_026_and_earlier():
    for profile in ("vllm-0.22", "vllm-0.24", "vllm-0.26"):
        assert compute_target(s2(), "vllm", Facts(kv_kind="full"), profile).fields["dtype"] == "auto"


def test_model_dtype_spellings_are_normalized():
    target = compute_target(s2(), "vllm", Facts(kv_kind="full", total_kv_heads=8, model_dtype="torch.bfloat16",
                                                writer_tp=1, writer_pp=1))
    assert target.fields["dtype"] == "bfloat16"


def test_resolved_dtype_needs_cache_dtype_for_026_and_earlier():
    with pytest.raises(MissingFactError) as err:
        compute_target(s3(tp_size=2), "vllm", Facts(kv_kind="full"), "vllm-0.26")
    assert err.value.flag == "--cache-dtype"
    target = compute_target(s3(tp_size=2), "vllm", Facts(kv_kind="full", cache_dtype="auto"), "vllm-0.26")
    assert target.fields["dtype"] == "auto"
    assert "parallel_agnostic" not in target.fields  # S2 has no discriminator


def test_s2_looking_tp1_folder_may_be_resolved_s3_agnostic():
    # an agnostic S3 namespace has exactly the S2 keys: its "bfloat16" may be a resolved "auto"
    with pytest.raises(MissingFactError):
        compute_target(s2(dtype="bfloat16"), "vllm", Facts(kv_kind="full"), "vllm-0.26")
    # with tp 2 it cannot be agnostic, so the dtype is the raw --kv-cache-dtype
    assert compute_target(s2(dtype="bfloat16", tp_size=2), "vllm", Facts(), "vllm-0.26").fields["dtype"] == "bfloat16"


def test_explicit_cache_dtype_is_unchanged_in_every_direction():
    for profile in ("vllm-0.22", "vllm-0.26", "vllm-0.28"):
        assert compute_target(s3(dtype="fp8_e4m3"), "vllm", Facts(), profile).fields["dtype"] == "fp8_e4m3"
        assert compute_target(s1(dtype="fp8"), "vllm", Facts(), profile).fields["dtype"] == "fp8"


# --- groups, dcp and hash granularity -----------------------------------------------------------

def test_s1_block_size_times_writers_dcp_is_tokens_per_block():
    src = s1(dcp_size=2, hash_block_size=32)
    target = compute_target(src, "vllm", Facts(kv_kind="full", model_dtype="bfloat16", runner="v2"), "vllm-0.28")
    assert target.fields["kv_cache_groups"][0]["tokens_per_block"] == 32
    assert target.fields["tokens_per_hash"] == 32 and target.fields["dcp_size"] == 2
    assert target.unreachable is None


def test_s2_tokens_per_block_divided_by_dcp_is_s1_block_size():
    src = s2(dcp_size=2, tokens_per_hash=32, kv_cache_groups=[{"tokens_per_block": 32, "layer_names": LAYERS}])
    target = compute_target(src, "vllm", Facts(runner="v2"), "vllm-0.24")
    assert target.fields["kv_cache_groups"] == [{"block_size": 16, "layer_names": LAYERS}]
    assert target.fields["hash_block_size"] == 32 and target.fields["dcp_size"] == 2
    assert target.unreachable is None


def test_collapsed_source_maps_with_dcp_1():
    src = s2(dtype="bfloat16", canonical_format="v1-nhd")  # S3 agnostic: sizes already 1
    target = compute_target(src, "vllm", Facts(), "vllm-0.28")
    assert target.fields["kv_cache_groups"][0]["tokens_per_block"] == 16


def test_several_groups_with_equal_gcd_stay_reachable():
    groups = [{"block_size": 16, "layer_names": ["a"]}, {"block_size": 32, "layer_names": ["b"]}]
    target = compute_target(s1(kv_cache_groups=groups), "vllm", FULL, "vllm-0.28")
    assert target.fields["tokens_per_hash"] == 16
    assert target.unreachable is None


def test_several_groups_whose_gcd_differs_change_hash_granularity():
    groups = [{"block_size": 12, "layer_names": ["a"]}, {"block_size": 16, "layer_names": ["b"]}]
    target = compute_target(s1(kv_cache_groups=groups), "vllm", FULL, "vllm-0.28")
    assert target.fields["tokens_per_hash"] == 4
    assert target.unreachable == "hash granularity changed"
    # same scheme family on both sides: the granularity is copied, nothing changes
    assert compute_target(s1(kv_cache_groups=groups), "vllm", FULL, "vllm-0.24").unreachable is None


# --- optional and unknown keys ----------------------------------------------------------------

def test_profiles_never_add_canonical_or_storage_format():
    for profile in ("vllm-0.27", "vllm-0.28"):
        fields = compute_target(s1(), "vllm", FULL, profile).fields
        assert "canonical_format" not in fields and "storage_format" not in fields


def test_source_canonical_format_is_kept_where_known():
    src = s3(canonical_format="v1-hnd")
    assert compute_target(src, "vllm", FULL, "vllm-0.28").fields["canonical_format"] == "v1-hnd"
    older = compute_target(src, "vllm", Facts(kv_kind="full"), "vllm-0.27")
    assert older.unreachable == "target_lacks_canonical_format"
    assert "canonical_format" not in older.fields


def test_storage_format_is_unknown_to_every_profile():
    src = s3(canonical_format="v1-nhd", storage_format="grouped-v1-4096")
    assert compute_target(src, "vllm", FULL, "vllm-0.28").unreachable == "target_lacks_storage_format"


def test_replicated_source_into_profile_without_replicated_layout():
    src = s2(dtype="bfloat16", replicated_layout=True)
    target = compute_target(src, "vllm", Facts(cache_dtype="auto"), "vllm-0.26")
    assert target.unreachable == "target_lacks_replicated_layout"
    assert "replicated_layout" not in target.fields


def test_unknown_source_key_is_never_copied():
    src = s3(kv_cache_layout="LBNHC")
    target = compute_target(src, "vllm", FULL, "vllm-0.28")
    assert target.unreachable == "target_lacks_kv_cache_layout"
    assert "kv_cache_layout" not in target.fields


# --- collapse already done / not re-gated ---------------------------------------------------------

def test_already_collapsed_s3_keeps_its_collapse_without_facts():
    src = s2(dtype="bfloat16", canonical_format="v1-nhd")  # S3 without parallel_agnostic
    target = compute_target(src, "vllm", Facts(), "vllm-0.28")
    assert target.parallel_agnostic and target.reasons == [] and target.assumed_facts == {}
    assert target.fields == src  # the target is the namespace itself


def test_replicated_source_keeps_replication():
    src = s2(dtype="bfloat16", replicated_layout=True)
    for profile in ("vllm-0.27", "vllm-0.28"):
        target = compute_target(src, "vllm", Facts(kv_kind=None), profile)
        assert target.replicated_layout and target.parallel_agnostic
        assert target.fields == src


def test_s2_tp1_identity_is_gated_at_tp1():
    target = compute_target(s2(), "vllm", Facts(kv_kind="mla", model_dtype="bfloat16"), "vllm-0.28")
    assert not target.parallel_agnostic
    assert target.fields["parallel_agnostic"] is False
    assert "not replicated: tp is 1 (needs tp > 1)" in target.reasons


def test_unknown_kv_kind_gives_the_rekeyed_specific_namespace():
    target = compute_target(s2(tp_size=2), "vllm", Facts(model_dtype="bfloat16", total_kv_heads=8), "vllm-0.28")
    assert not target.parallel_agnostic
    assert target.fields["tp_size"] == 2 and target.fields["parallel_agnostic"] is False
    assert target.fields["dtype"] == "bfloat16"
    assert any("kv kind unknown" in r and "--kv-kind" in r for r in target.reasons)


def test_assumed_defaults_are_listed():
    target = compute_target(s2(tp_size=2), "vllm", FULL, "vllm-0.28")
    assert target.assumed_facts == {"runner": "v1", "per_token_head_quant": False, "executor": "mp", "nnodes": 1}
    stated = Facts(kv_kind="full", total_kv_heads=8, model_dtype="bfloat16", runner="v1", executor="mp", nnodes=1,
                   per_token_head_quant=False)
    assert compute_target(s2(tp_size=2), "vllm", stated, "vllm-0.28").assumed_facts == {}
    assert compute_target(s2(tp_size=2), "vllm", FULL, "vllm-0.22").assumed_facts == {}


# --- aliasing -----------------------------------------------------------------------------------

def test_llmd_tree_targeting_its_own_s1_name_is_aliases_source():
    src = s1(tp_size=2, gpu_blocks_per_file=16)
    target = compute_target(src, "llmd", FULL, "vllm-0.22")
    assert target.fields == src
    assert target.unreachable == "aliases_source"
    # a vLLM source in the same place is simply already in place
    assert compute_target(src, "vllm", FULL, "vllm-0.22").unreachable is None


# --- vllm.cpp -------------------------------------------------------------------------------------

CPP = {"architectures": ["Qwen3ForCausalLM"], "block_size": 16, "checkpoint_fingerprint": "sha256:aaaa",
       "dcp_size": 1, "format_version": 1, "hash_algo": "sha256_cbor", "hash_block_size": 16, "head_size": 128,
       "head_size_v": 128, "hf_config_digest": "deadbeefcafe", "inference_engine": "vllm.cpp",
       "kv_cache_spec_kind": "full_attention", "kv_dtype": "bf16", "kv_quant_mode": "none",
       "max_position_embeddings": 40960, "model_name": "Qwen/Qwen3-4B", "model_type": "qwen3",
       "none_hash_hex": "950bc4c76b023aa9f8388d6705b601adfc50516140dd1f2b8fc90bed037b2070",
       "num_hidden_layers": 36, "num_kv_heads": 8, "page_size_bytes": 512, "pcp_size": 1, "pp_size": 1, "rank": 0,
       "rope_config": "theta=1000000,dim=128,scaling=none", "sliding_window": -1, "tp_size": 1,
       "weight_quantization": "none"}
CPP_MLA = {**CPP, "kv_cache_spec_kind": "mla", "num_kv_heads": 1, "head_size": 576, "head_size_v": 0,
           "page_size_bytes": 16 * 576 * 2}


def test_single_rank_vllmcpp_is_already_in_place():
    target = compute_target(CPP, "vllmcpp", Facts(), "vllm-0.28")
    assert target.profile == "vllmcpp" and target.family == "vllmcpp"
    assert target.fields == CPP and target.base_name == "Qwen_Qwen3-4B_2441b2d1f822"
    assert target.rank_dir == "Qwen_Qwen3-4B_2441b2d1f822_r0"
    assert not target.replicated_layout and target.unreachable is None
    assert any("already in place" in r for r in target.reasons)


def test_vllmcpp_mla_ranks_collapse_to_one_replicated_identity():
    rank0 = compute_target({**CPP_MLA, "tp_size": 2, "rank": 0}, "vllmcpp", Facts())
    rank1 = compute_target({**CPP_MLA, "tp_size": 2, "rank": 1}, "vllmcpp", Facts())
    assert rank0.base_name == rank1.base_name
    assert rank0.fields == {**CPP_MLA, "replicated_layout": True}
    assert rank0.replicated_layout and rank0.parallel_agnostic and rank0.reasons == []
    assert rank0.rank_dir.endswith("_r0")
    expected = hashlib.sha256(json.dumps(rank0.fields, sort_keys=True, separators=(",", ":"),
                                         ensure_ascii=False).encode()).hexdigest()[:12]
    assert rank0.d12 == expected


def test_vllmcpp_multi_rank_full_attention_is_rank_private():
    target = compute_target({**CPP, "tp_size": 2, "rank": 1}, "vllmcpp", Facts())
    assert target.unreachable == "rank-private shard"
    assert target.fields["rank"] == 1 and "replicated_layout" not in target.fields
    assert target.rank_dir.endswith("_r1")


@pytest.mark.parametrize("over,reason", [
    ({"pp_size": 2}, "not replicated: pp is 2"),
    ({"pcp_size": 2}, "not replicated: pcp is 2"),
    ({"dcp_size": 2}, "not replicated: dcp is 2"),
])
def test_vllmcpp_replicated_gate_conditions(over, reason):
    target = compute_target({**CPP_MLA, "tp_size": 2, "rank": 1, **over}, "vllmcpp", Facts())
    assert not target.replicated_layout
    assert f"{reason} (needs 1)" in target.reasons


def test_vllmcpp_already_replicated_identity_is_unchanged():
    src = {**CPP_MLA, "replicated_layout": True}
    target = compute_target(src, "vllmcpp", Facts())
    assert target.fields == src and target.replicated_layout


def test_vllmcpp_unknown_key_is_not_copied_into_a_collapsed_identity():
    target = compute_target({**CPP_MLA, "tp_size": 2, "rank": 1, "future_key": 7}, "vllmcpp", Facts())
    assert target.unreachable == "target_lacks_future_key"
    assert "future_key" not in target.fields


def test_vllmcpp_non_ascii_target_uses_raw_utf8_recipe():
    src = {**CPP_MLA, "model_name": "org/Mödel", "tp_size": 2}
    target = compute_target(src, "vllmcpp", Facts())
    raw = json.dumps(target.fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert target.d12 == hashlib.sha256(raw).hexdigest()[:12]
    assert target.base_name == f"org_Mödel_{target.d12}"


# --- refusals ---------------------------------------------------------------------------------

def test_invalid_source_identity_is_refused():
    with pytest.raises(UsageError, match="tp_size"):
        compute_target(s2(tp_size=0), "vllm", FULL)
    with pytest.raises(UsageError, match="num_kv_heads"):
        compute_target({**CPP, "num_kv_heads": 0}, "vllmcpp", Facts())


def test_vllmcpp_profile_for_a_vllm_source_is_a_usage_error():
    with pytest.raises(UsageError, match="vllm.cpp caches"):
        compute_target(s2(), "vllm", FULL, "vllmcpp")
    with pytest.raises(UsageError, match="unknown target profile"):
        compute_target(s2(), "vllm", FULL, "vllm-9.9")


def test_target_to_dict_is_json_serializable():
    d = compute_target(s2(tp_size=2), "vllm", FULL).to_dict()
    assert json.loads(json.dumps(d)) == d
    assert set(d) == {"profile", "family", "fields", "d12", "base_name", "rank_dir", "parallel_agnostic",
                      "replicated_layout", "reasons", "assumed_facts", "unreachable", "missing_facts",
                      "decisive_assumptions", "writer_topology", "claims"}
