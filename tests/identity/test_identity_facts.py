"""Deployment facts: Hugging Face configs read by value, flags, FACTS.json precedence,
MLA page bytes, and clear refusals for broken inputs (identity.md §4)."""

from __future__ import annotations

import json

import pytest

from kvmigrate.errors import UsageError
from kvmigrate.identity.facts import Facts, FactsResolver
from kvmigrate.identity.hfconfig import facts_from_hf_config, mla_page_bytes

# Public config.json values of real models, keeping only the keys that matter.
LLAMA_31_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
               "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
               "max_position_embeddings": 131072, "rope_theta": 500000.0,
               "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"},
               "torch_dtype": "bfloat16"}
QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
             "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "max_window_layers": 28,
             "sliding_window": 131072, "use_sliding_window": False, "rope_theta": 1000000.0,
             "torch_dtype": "bfloat16"}
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128, "hidden_size": 4096,
            "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "max_window_layers": 36,
            "sliding_window": None, "use_sliding_window": False, "torch_dtype": "bfloat16"}
MISTRAL_7B_V01 = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
                  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                  "sliding_window": 4096, "rope_theta": 10000.0, "torch_dtype": "bfloat16"}
GEMMA2_9B = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "cache_implementation": "hybrid",
             "head_dim": 256, "hidden_size": 3584, "num_attention_heads": 16, "num_hidden_layers": 42,
             "num_key_value_heads": 8, "query_pre_attn_scalar": 256, "sliding_window": 4096,
             "sliding_window_size": 4096, "torch_dtype": "float32"}
GEMMA2_9B_LAYER_TYPES = {**GEMMA2_9B, "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                                      for i in range(42)]}
GEMMA3_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
             "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "num_attention_heads": 8,
                             "num_key_value_heads": 4, "num_hidden_layers": 34, "sliding_window": 1024,
                             "sliding_window_pattern": 6}}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
               "num_attention_heads": 128, "num_key_value_heads": 128, "num_hidden_layers": 61,
               "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
               "v_head_dim": 128, "torch_dtype": "bfloat16"}
DEEPSEEK_V32_EXP = {**DEEPSEEK_V3, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
                    "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048}
JAMBA_V01 = {"architectures": ["JambaForCausalLM"], "model_type": "jamba", "attn_layer_offset": 4,
             "attn_layer_period": 8, "expert_layer_offset": 1, "expert_layer_period": 2, "hidden_size": 4096,
             "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2, "num_attention_heads": 32,
             "num_hidden_layers": 32, "num_key_value_heads": 8, "sliding_window": None, "torch_dtype": "bfloat16"}
NEMOTRON_H_8B = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
                 "hybrid_override_pattern": "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-M-",
                 "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 52,
                 "torch_dtype": "bfloat16"}
QWEN3_NEXT_80B = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "full_attention_interval": 4,
                  "num_attention_heads": 16, "num_key_value_heads": 2, "num_hidden_layers": 48,
                  "linear_num_key_heads": 16, "linear_num_value_heads": 32, "torch_dtype": "bfloat16"}
QWEN3_NEXT_LAYER_TYPES = {**QWEN3_NEXT_80B, "layer_types": ["full_attention" if (i + 1) % 4 == 0
                                                            else "linear_attention" for i in range(48)]}
MAMBA_28B = {"architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_size": 2560, "state_size": 16,
             "num_hidden_layers": 64, "torch_dtype": "float32"}

HF_TABLE = [
    ("llama-3.1-8b", LLAMA_31_8B, "full", 8, "bfloat16"),
    ("qwen2.5-7b-sliding-window-unused", QWEN25_7B, "full", 4, "bfloat16"),
    ("qwen3-8b", QWEN3_8B, "full", 8, "bfloat16"),
    ("mistral-7b-v0.1-sliding", MISTRAL_7B_V01, "sliding", 8, "bfloat16"),
    ("gemma-2-9b", GEMMA2_9B, "hybrid", 8, None),
    ("gemma-2-9b-layer-types", GEMMA2_9B_LAYER_TYPES, "hybrid", 8, None),
    ("gemma-3-4b-text-config", GEMMA3_4B, "hybrid", 4, "bfloat16"),
    ("deepseek-v3-mla", DEEPSEEK_V3, "mla", 128, "bfloat16"),
    ("deepseek-v3.2-exp-sparse-mla", DEEPSEEK_V32_EXP, "hybrid", 128, "bfloat16"),
    ("jamba-v0.1", JAMBA_V01, "hybrid", 8, "bfloat16"),
    ("nemotron-h-8b", NEMOTRON_H_8B, "hybrid", 8, "bfloat16"),
    ("qwen3-next-80b", QWEN3_NEXT_80B, "hybrid", 2, "bfloat16"),
    ("qwen3-next-80b-layer-types", QWEN3_NEXT_LAYER_TYPES, "hybrid", 2, "bfloat16"),
    ("mamba-2.8b", MAMBA_28B, "mamba", None, None),
]


@pytest.mark.parametrize("name,cfg,kind,heads,dtype", HF_TABLE, ids=[row[0] for row in HF_TABLE])
def test_facts_from_real_hf_configs(name, cfg, kind, heads, dtype):
    facts = facts_from_hf_config(cfg)
    assert facts["kv_kind"] == kind
    assert facts.get("total_kv_heads") == heads
    assert facts.get("model_dtype") == dtype


def test_float32_checkpoint_leaves_model_dtype_to_the_operator():
    # vLLM downcasts float32 under --dtype auto to bfloat16 or float16 depending on the GPU
    facts = facts_from_hf_config(GEMMA2_9B)
    assert "model_dtype" not in facts and "--model-dtype" in facts["model_dtype_note"]


def test_layer_types_all_sliding_is_sliding():
    cfg = {**QWEN3_8B, "layer_types": ["sliding_attention"] * 36}
    assert facts_from_hf_config(cfg)["kv_kind"] == "sliding"


def test_use_sliding_window_true_is_sliding():
    assert facts_from_hf_config({**QWEN25_7B, "use_sliding_window": True})["kv_kind"] == "sliding"


def test_kv_lora_rank_null_is_not_mla():
    assert facts_from_hf_config({**LLAMA_31_8B, "kv_lora_rank": None})["kv_kind"] == "full"


def test_total_kv_heads_falls_back_to_attention_heads():
    cfg = {k: v for k, v in LLAMA_31_8B.items() if k != "num_key_value_heads"}
    assert facts_from_hf_config(cfg)["total_kv_heads"] == 32


def test_transformers_v5_dtype_key_is_read():
    cfg = {k: v for k, v in QWEN3_8B.items() if k != "torch_dtype"}
    assert facts_from_hf_config({**cfg, "dtype": "bfloat16"})["model_dtype"] == "bfloat16"


def test_mla_geometry_is_reported():
    facts = facts_from_hf_config(DEEPSEEK_V3)
    assert (facts["kv_lora_rank"], facts["qk_rope_head_dim"]) == (512, 64)
    assert "kv_lora_rank" not in facts_from_hf_config(LLAMA_31_8B)


def test_mla_page_bytes_arithmetic():
    assert mla_page_bytes(64, 512, 64, "bfloat16") == 64 * 576 * 2
    assert mla_page_bytes(64, 512, 64, "fp8_e4m3") == 64 * 576
    assert mla_page_bytes(64, 512, 64, "fp8_ds_mla") == 64 * 656
    assert mla_page_bytes(64, 512, 64, "auto") is None


# --- FactsResolver ------------------------------------------------------------------------------

def write_json(path, obj) -> str:
    path.write_text(json.dumps(obj))
    return str(path)


MLA_SOURCE = {"model_name": "deepseek-ai/DeepSeek-V3", "tp_size": 8, "pp_size": 1, "pcp_size": 1, "dcp_size": 1,
              "dtype": "auto", "tokens_per_hash": 64, "blocks_per_file": 1, "inference_engine": "vllm",
              "kv_cache_groups": [{"tokens_per_block": 64, "layer_names": ["model.layers.0.self_attn.attn"]}]}


def test_flags_alone(tmp_path):
    facts = FactsResolver({"kv_kind": "full", "total_kv_heads": 8, "runner": "v1"}).for_namespace("m", "m_0123456789ab")
    assert (facts.kv_kind, facts.total_kv_heads, facts.runner) == ("full", 8, "v1")
    assert facts.sources == {"kv_kind": "flag", "total_kv_heads": "flag", "runner": "flag"}
    assert facts.executor is None  # unknown stays unknown; the gates assume and report defaults


def test_model_config_flag_fills_facts_and_page_bytes(tmp_path):
    cfg = write_json(tmp_path / "config.json", DEEPSEEK_V3)
    facts = FactsResolver({"model_config": cfg}).for_namespace(MLA_SOURCE["model_name"], "x", MLA_SOURCE)
    assert (facts.kv_kind, facts.total_kv_heads, facts.model_dtype) == ("mla", 128, "bfloat16")
    assert facts.page_bytes == 64 * (512 + 64) * 2
    assert facts.sources["kv_kind"] == f"model_config:{cfg}"
    assert facts.sources["page_bytes"] == f"model_config:{cfg}"


def test_mla_page_bytes_uses_per_rank_block_and_fp8_cache(tmp_path):
    cfg = write_json(tmp_path / "config.json", DEEPSEEK_V3)
    src = {**MLA_SOURCE, "dtype": "fp8_e4m3", "dcp_size": 2,
           "kv_cache_groups": [{"tokens_per_block": 128, "layer_names": ["l"]}]}
    facts = FactsResolver({"model_config": cfg}).for_namespace(src["model_name"], "x", src)
    assert facts.page_bytes == 64 * 576 * 1


def test_explicit_facts_beat_the_model_config(tmp_path):
    cfg = write_json(tmp_path / "config.json", DEEPSEEK_V3)
    facts = FactsResolver({"model_config": cfg, "kv_kind": "full", "page_bytes": 4096}).for_namespace("m", "b", MLA_SOURCE)
    assert facts.kv_kind == "full" and facts.sources["kv_kind"] == "flag"
    assert facts.page_bytes == 4096
    assert facts.total_kv_heads == 128


def test_facts_file_most_specific_key_wins_and_flags_fill_gaps(tmp_path):
    path = write_json(tmp_path / "FACTS.json", {
        "*": {"kv_kind": "full", "executor": "ray", "nnodes": 2},
        "org/model": {"kv_kind": "mla", "executor": "mp"},
        "org_model_0123456789ab": {"kv_kind": "sliding"},
    })
    resolver = FactsResolver({"runner": "v2", "kv_kind": "hybrid"}, path)
    facts = resolver.for_namespace("org/model", "org_model_0123456789ab")
    assert facts.kv_kind == "sliding" and facts.sources["kv_kind"] == "facts:org_model_0123456789ab"
    assert facts.executor == "mp" and facts.sources["executor"] == "facts:org/model"
    assert facts.nnodes == 2 and facts.sources["nnodes"] == "facts:*"
    assert facts.runner == "v2" and facts.sources["runner"] == "flag"
    other = resolver.for_namespace("other/model", "other_model_ba9876543210")
    assert other.kv_kind == "full" and other.executor == "ray"


def test_facts_file_model_config_is_relative_to_the_facts_file(tmp_path):
    (tmp_path / "models").mkdir()
    write_json(tmp_path / "models" / "ds.json", DEEPSEEK_V3)
    path = write_json(tmp_path / "FACTS.json", {"deepseek-ai/DeepSeek-V3": {"model_config": "models/ds.json"}})
    facts = FactsResolver(None, path).for_namespace(MLA_SOURCE["model_name"], "b", MLA_SOURCE)
    assert facts.kv_kind == "mla"
    assert facts.sources["kv_kind"] == f"model_config:{tmp_path / 'models' / 'ds.json'}"


def test_facts_file_family(tmp_path):
    path = write_json(tmp_path / "FACTS.json", {"*": {"family": "llmd"}})
    assert FactsResolver(None, path).for_namespace("m", "b").family == "llmd"


@pytest.mark.parametrize("content,message", [
    ("{not json", "facts file is not valid JSON"),
    ("[1, 2]", "facts file must hold a JSON object"),
    ('{"*": 3}', "must be an object of facts"),
    ('{"*": {"kv_kind": "linear"}}', "fact 'kv_kind' must be one of"),
    ('{"*": {"total_kv_heads": "8"}}', "fact 'total_kv_heads' must be a positive integer"),
    ('{"*": {"per_token_head_quant": "yes"}}', "must be true or false"),
    ('{"*": {"kv_knd": "full"}}', "unknown fact 'kv_knd'"),
])
def test_broken_facts_file_is_a_usage_error_naming_the_path(tmp_path, content, message):
    path = tmp_path / "FACTS.json"
    path.write_text(content)
    with pytest.raises(UsageError) as err:
        FactsResolver(None, str(path))
    assert str(path) in str(err.value)
    assert message in str(err.value)
    assert err.value.exit_code == 2


def test_missing_facts_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="cannot read facts file"):
        FactsResolver(None, str(tmp_path / "nope.json"))


def test_broken_model_config_is_a_usage_error_naming_the_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": ')
    with pytest.raises(UsageError) as err:
        FactsResolver({"model_config": str(path)})
    assert str(path) in str(err.value) and "model config is not valid JSON" in str(err.value)
    missing = tmp_path / "FACTS.json"
    missing.write_text(json.dumps({"*": {"model_config": "absent.json"}}))
    with pytest.raises(UsageError, match="absent.json"):
        FactsResolver(None, str(missing))


def test_bad_flag_value_is_a_usage_error():
    with pytest.raises(UsageError, match="fact 'runner' must be one of v1, v2"):
        FactsResolver({"runner": "v3"})


def test_facts_to_dict_has_every_fact_and_no_sources():
    d = Facts(kv_kind="full", sources={"kv_kind": "flag"}).to_dict()
    assert d["kv_kind"] == "full" and "sources" not in d
    assert set(d) == {"kv_kind", "total_kv_heads", "model_dtype", "cache_dtype", "runner", "executor", "nnodes",
                      "per_token_head_quant", "page_bytes", "tensors_per_layer", "family", "writer_tp", "writer_pp",
                      "model_name", "writer_layout", "target_layout", "writer_release",
                      "layers", "page_tokens", "kv_heads", "head_dim", "latent_dim", "dtype_bytes"}
    assert json.loads(json.dumps(d)) == d


# --- values the engines accept (issue 16, defect 3) --------------------------------------------

BAD_VALUES = [  # (fact, a value no engine takes, text of the allowed values)
    ("model_dtype", "banana", "half, float16, bfloat16, float, float32"),
    ("model_dtype", "auto", "half, float16, bfloat16, float, float32"),  # the fact is what "auto" resolved to
    ("cache_dtype", "banana", "auto, float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2, fp8_inc, fp8_ds_mla"),
    ("executor", "potato", "mp, ray, uni, external_launcher, or an Executor class"),
    ("runner", "v3", "one of v1, v2"),
    ("kv_kind", "linear", "one of full, mla, sliding, hybrid, mamba"),
    ("family", "trtllm", "one of vllm, llmd, vllmcpp, sglang"),
    ("target_layout", "page_head", "one of layer_first, page_first, page_first_direct"),
    ("writer_release", "latest", "an SGLang release such as 0.5.13"),
    ("model_name", 7, "a non-empty served model name"),
    ("nnodes", 0, "a positive integer"),
    ("total_kv_heads", -8, "a positive integer"),
    ("page_bytes", "4096", "a positive integer"),
    ("tensors_per_layer", True, "a positive integer"),
    ("per_token_head_quant", "yes", "true or false"),
]


@pytest.mark.parametrize("fact,value,allowed", BAD_VALUES, ids=[f"{f}={v!r}" for f, v, _ in BAD_VALUES])
def test_every_fact_is_checked_against_the_values_the_engine_accepts(tmp_path, fact, value, allowed):
    """--model-dtype banana, --executor potato, ...: a usage error naming the flag or the
    FACTS.json path and key, the value and the allowed values."""
    with pytest.raises(UsageError) as err:
        FactsResolver({fact: value})
    text = str(err.value)
    assert err.value.exit_code == 2
    assert f"--{fact.replace('_', '-')}" in text and repr(value) in text and allowed in text
    path = write_json(tmp_path / "FACTS.json", {"org/model": {fact: value}})
    with pytest.raises(UsageError) as err:
        FactsResolver(None, path)
    text = str(err.value)
    assert path in text and "'org/model'" in text and f"'{fact}'" in text and repr(value) in text
    assert allowed in text


def test_values_the_engine_accepts_are_kept():
    facts = FactsResolver({"model_dtype": "half", "cache_dtype": "fp8_ds_mla", "executor": "external_launcher",
                           "runner": "v2"}).for_namespace("m", "b")
    assert (facts.model_dtype, facts.cache_dtype, facts.executor, facts.runner) == \
        ("float16", "fp8_ds_mla", "external_launcher", "v2")
    # vLLM also imports an Executor class by its qualified name
    assert FactsResolver({"executor": "my_pkg.executors.MyExecutor"}).for_namespace("m", "b").executor == \
        "my_pkg.executors.MyExecutor"


@pytest.mark.parametrize("patch,message", [
    ({"torch_dtype": "float8"}, "torch_dtype 'float8' is not a torch dtype"),
    ({"torch_dtype": 16}, "torch_dtype 16 is not a torch dtype"),
    ({"text_config": {"dtype": "banana"}}, "text_config.dtype 'banana' is not a torch dtype"),
    ({"num_key_value_heads": "8"}, "num_key_value_heads must be a positive integer, got '8'"),
    ({"kv_lora_rank": -512}, "kv_lora_rank must be a positive integer, got -512"),
])
def test_nonsense_in_a_model_config_is_refused_naming_the_file(tmp_path, patch, message):
    path = write_json(tmp_path / "config.json", {**DEEPSEEK_V3, **patch})
    with pytest.raises(UsageError) as err:
        FactsResolver({"model_config": path})
    assert err.value.exit_code == 2 and path in str(err.value) and message in str(err.value)


def test_fp8_checkpoint_leaves_model_dtype_to_the_operator():
    """A real fp8 checkpoint says float8_e4m3fn: vLLM serves it as the GPU's half type."""
    facts = facts_from_hf_config({**LLAMA_31_8B, "torch_dtype": "float8_e4m3fn"})
    assert "model_dtype" not in facts and "--model-dtype" in facts["model_dtype_note"]


# --- a model config applied to a namespace of another model ------------------------------------

DEEPSEEK_V2_LITE = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
                    "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 27,
                    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                    "v_head_dim": 128, "torch_dtype": "bfloat16"}


def test_model_config_of_another_model_is_refused_for_that_namespace(tmp_path):
    from kvmigrate.families import compute_target

    llama = write_json(tmp_path / "llama.json", LLAMA_31_8B)
    resolver = FactsResolver({"model_config": llama})
    src = {**MLA_SOURCE, "model_name": "deepseek-ai/DeepSeek-V2-Lite"}
    facts = resolver.for_namespace(src["model_name"], "deepseek-ai_DeepSeek-V2-Lite_0123456789ab", src)
    assert facts.kv_kind is None and facts.total_kv_heads is None  # nothing taken from the wrong config
    for part in ("deepseek-ai_DeepSeek-V2-Lite_0123456789ab", "LlamaForCausalLM", "'deepseek-ai/DeepSeek-V2-Lite'",
                 llama, "--model-config", "--facts keys by model name",
                 '{"deepseek-ai/DeepSeek-V2-Lite": {"model_config": '):
        assert part in facts.refusal
    with pytest.raises(UsageError, match="refused for namespace deepseek-ai_DeepSeek-V2-Lite_0123456789ab"):
        compute_target(src, "vllm", facts, "vllm-0.28")
    # the same resolver still serves the Llama namespace; a FACTS.json config is named by its key
    assert resolver.for_namespace("meta-llama/Llama-3.1-8B-Instruct", "b").refusal is None
    path = write_json(tmp_path / "FACTS.json", {"*": {"model_config": "llama.json"}})
    refusal = FactsResolver(None, path).for_namespace(src["model_name"], "b", src).refusal
    assert f"'model_config' of {path} entry '*'" in refusal


@pytest.mark.parametrize("model_name,cfg,refused", [
    ("deepseek-ai/DeepSeek-V2-Lite", LLAMA_31_8B, True),
    ("deepseek-ai/DeepSeek-V2-Lite", DEEPSEEK_V2_LITE, False),
    ("deepseek-ai/DeepSeek-V3", DEEPSEEK_V2_LITE, False),  # one family: V2 and V3 are both MLA
    ("Qwen/Qwen3-8B", QWEN25_7B, True),  # qwen2 config on a Qwen3 model
    ("Qwen/Qwen2.5-7B-Instruct", QWEN25_7B, False),
    ("Qwen/QwQ-32B", QWEN25_7B, False),  # generic Qwen name: any Qwen config
    ("mistralai/Mistral-7B-v0.1", GEMMA2_9B, True),
    ("google/gemma-2-9b", GEMMA2_9B, False),
    ("deepseek-ai/DeepSeek-R1-Distill-Llama-8B", LLAMA_31_8B, False),  # names both families
    ("deepseek-ai/deepseek-coder-6.7b-instruct", LLAMA_31_8B, False),  # DeepSeek Coder v1 is a Llama model
    ("org/model", DEEPSEEK_V3, False),  # unknown names are never refused
    ("meta-llama/Llama-3.1-8B", JAMBA_V01, False),  # nor unknown architectures
])
def test_model_config_conflicts_are_decided_conservatively(tmp_path, model_name, cfg, refused):
    path = write_json(tmp_path / "config.json", cfg)
    facts = FactsResolver({"model_config": path}).for_namespace(model_name, "b")
    assert (facts.refusal is not None) == refused
