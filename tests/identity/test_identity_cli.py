"""`kvmigrate identity CONFIG_JSON` (interface.md §1) on synthetic trees of each family."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvmigrate import families
from kvmigrate.cli import cli
from kvmigrate.synth import SynthSpec, build

HF_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_attention_heads": 32,
            "num_key_value_heads": 8, "num_hidden_layers": 32, "torch_dtype": "bfloat16"}
HF_DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_attention_heads": 128,
                  "num_key_value_heads": 128, "num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                  "torch_dtype": "bfloat16"}
HF_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_attention_heads": 32,
            "num_key_value_heads": 8, "num_hidden_layers": 36, "torch_dtype": "bfloat16"}
TOP_KEYS = {"family", "family_evidence", "scheme", "source", "target", "assumed_facts"}
SOURCE_KEYS = {"fields", "d12", "base_name", "digest_ok"}
TARGET_KEYS = {"profile", "family", "fields", "d12", "base_name", "rank_dir", "parallel_agnostic",
               "replicated_layout", "reasons", "unreachable", "missing_facts", "decisive_assumptions",
               "writer_topology", "claims"}


def run(*args: str) -> tuple[int, dict | str, str]:
    result = CliRunner().invoke(cli, ["identity", *args])
    out = result.stdout
    try:
        out = json.loads(out)
    except json.JSONDecodeError:
        pass
    return result.exit_code, out, result.stderr


def synth(root: Path, **spec) -> dict:
    return build(root, SynthSpec(blocks=2, **spec)).namespaces[0]


def config_path(root: Path, ns: dict) -> str:
    return str(root / ns["config_relpath"])


def ref_d12(fields: dict, ensure_ascii: bool = True) -> str:
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=ensure_ascii)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@pytest.fixture
def hf_llama(tmp_path) -> str:
    path = tmp_path / "hf-llama.json"
    path.write_text(json.dumps(HF_LLAMA))
    return str(path)


def test_llmd_tree_prints_the_documented_json(tmp_path, hf_llama):
    root = tmp_path / "cache"
    ns = synth(root, family="llmd", tp=2)
    code, out, err = run(config_path(root, ns), "--json", "--model-config", hf_llama)
    assert code == 0, err
    assert set(out) == TOP_KEYS
    assert set(out["source"]) == SOURCE_KEYS and set(out["target"]) == TARGET_KEYS
    assert out["family"] == "llmd" and out["scheme"] == "S1"
    assert out["source"] == {"fields": ns["fields"], "d12": ns["d12"], "base_name": ns["base_name"],
                             "digest_ok": True}
    src = ns["fields"]
    # vLLM 0.34 (the default) keeps a direct layout topology-specific: the TP2 namespace
    expected = {"model_name": src["model_name"], "tp_size": 2, "pp_size": 1, "pcp_size": 1, "dcp_size": 1,
                "dtype": "bfloat16", "tokens_per_hash": src["hash_block_size"],
                "blocks_per_file": src["gpu_blocks_per_file"], "inference_engine": "vllm",
                "kv_cache_groups": [{"tokens_per_block": g["block_size"], "layer_names": g["layer_names"]}
                                    for g in src["kv_cache_groups"]], "parallel_agnostic": False}
    d12 = ref_d12(expected)
    assert out["target"]["fields"] == expected
    assert out["target"]["d12"] == d12
    assert out["target"]["base_name"] == src["model_name"].replace("/", "_") + "_" + d12
    assert out["target"]["rank_dir"] == out["target"]["base_name"] + "_r0"
    assert out["target"]["profile"] == "vllm-0.34"
    assert out["target"]["parallel_agnostic"] is False and out["target"]["replicated_layout"] is False
    assert out["target"]["reasons"] == [
        "not agnostic: direct (non-canonical) layout, which vLLM 0.34 keeps topology-specific (vllm#55191)",
        "not replicated: kv kind is full (needs pure MLA)"]
    assert out["assumed_facts"] == {"executor": "mp", "nnodes": 1}


def test_vllm_s3_tree_with_gate_reasons(tmp_path):
    root = tmp_path / "cache"
    ns = synth(root, family="vllm", scheme="S3", tp=2, kv_kind="mla")
    code, out, err = run(config_path(root, ns), "--json", "--kv-kind", "mla", "--executor", "ray")
    assert code == 0, err
    assert out["family"] == "vllm" and out["scheme"] == "S3"
    assert out["source"]["digest_ok"] is True
    target = out["target"]
    assert target["parallel_agnostic"] is False and target["replicated_layout"] is False
    assert "not agnostic: direct (non-canonical) layout, which vLLM 0.34 keeps topology-specific (vllm#55191)" \
        in target["reasons"]
    assert "not replicated: executor is ray (needs mp)" in target["reasons"]
    assert target["fields"] == ns["fields"]  # a 0.28-0.33 identity of that deployment, the same in 0.34: in place
    assert "executor" not in out["assumed_facts"] and out["assumed_facts"]["nnodes"] == 1


def test_vllmcpp_tree_always_targets_vllmcpp(tmp_path):
    root = tmp_path / "cache"
    ns = synth(root, family="vllmcpp")
    code, out, err = run(config_path(root, ns), "--json", "--target", "vllm-0.22")
    assert code == 0, err
    assert out["family"] == "vllmcpp" and out["scheme"] == "vllmcpp-v1"
    assert out["source"]["digest_ok"] is True
    assert out["source"]["d12"] == ref_d12(ns["fields"], ensure_ascii=False)
    assert out["target"]["profile"] == "vllmcpp" and out["target"]["family"] == "vllmcpp"
    assert out["target"]["fields"] == ns["fields"]
    assert out["target"]["rank_dir"] == ns["base_name"] + "_r0"
    assert out["assumed_facts"] == {}


def test_s1_vllm_tree_is_ambiguous_until_family_is_given(tmp_path, hf_llama):
    root = tmp_path / "cache"
    ns = synth(root, family="vllm", scheme="S1")
    code, out, _ = run(config_path(root, ns), "--json", "--model-config", hf_llama, "--writer-tp", "1",
                       "--writer-pp", "1")
    assert code == 0
    assert out["family"] == "ambiguous"
    assert any("--family" in e for e in out["family_evidence"])
    assert out["target"]["base_name"]  # the target is still computed
    facts = tmp_path / "FACTS.json"
    facts.write_text(json.dumps({ns["base_name"]: {"family": "vllm"}}))
    code, out, _ = run(config_path(root, ns), "--json", "--model-config", hf_llama, "--facts", str(facts))
    assert code == 0 and out["family"] == "vllm"


def test_digest_mismatch_is_shown(tmp_path):
    root = tmp_path / "cache"
    ns = synth(root, family="vllm", scheme="S2", model_name="org/model")
    cfg = Path(config_path(root, ns))
    fields = json.loads(cfg.read_text())
    fields["tp_size"] = 4  # edited by hand: the folder name no longer proves it
    cfg.write_text(json.dumps(fields, indent=2, sort_keys=True))
    code, out, _ = run(str(cfg), "--json", "--kv-kind", "full", "--model-dtype", "bfloat16")
    assert code == 0
    assert out["source"]["digest_ok"] is False
    code, text, _ = run(str(cfg), "--kv-kind", "full", "--model-dtype", "bfloat16")
    assert "DOES NOT match its folder" in text


def test_config_outside_a_namespace_folder_has_null_digest_ok(tmp_path, hf_llama):
    path = tmp_path / "config.json"
    path.write_bytes((Path(__file__).parents[2] / "kvmigrate/samples/vllm-0.26-llama-3.1-8b-tp2.config.json")
                     .read_bytes())
    code, out, _ = run(str(path), "--json", "--model-config", hf_llama)
    assert code == 0
    assert out["source"]["digest_ok"] is None


def test_missing_required_fact_exits_2_naming_the_flag(tmp_path):
    root = tmp_path / "cache"
    ns = synth(root, family="vllm", scheme="S2", tp=2)
    code, out, err = run(config_path(root, ns), "--json", "--kv-kind", "full")
    assert code == 2
    assert out == ""
    assert "--model-dtype" in err and "Traceback" not in err


def test_missing_cache_dtype_for_old_target_exits_2(tmp_path):
    root = tmp_path / "cache"
    ns = synth(root, family="vllm", scheme="S3", tp=2)
    code, _, err = run(config_path(root, ns), "--target", "vllm-0.26", "--kv-kind", "full")
    assert code == 2 and "--cache-dtype" in err


@pytest.mark.parametrize("content,message", [
    (b"{broken", "cannot use config.json: not valid JSON"),
    (b"[]", "cannot use config.json: expected a JSON object, got list"),
    (b'{"model_name": "m"}', "not a vLLM, llm-d or vllm.cpp identity"),
    (b'{"model_name": "m", "tokens_per_hash": 0}', "source identity is not valid"),
])
def test_broken_config_is_a_usage_error_naming_the_path(tmp_path, content, message):
    path = tmp_path / "m_0123456789ab" / "config.json"
    path.parent.mkdir()
    path.write_bytes(content)
    code, _, err = run(str(path), "--json")
    assert code == 2
    assert str(path) in err and message in err and "Traceback" not in err


def test_missing_config_file_is_a_usage_error(tmp_path):
    code, _, err = run(str(tmp_path / "nope" / "config.json"))
    assert code == 2 and "cannot read config.json" in err


def test_text_output_lists_target_reasons_and_assumed_defaults(tmp_path):
    root = tmp_path / "cache"
    ns = synth(root, family="vllm", scheme="S2", tp=2)
    code, text, _ = run(config_path(root, ns), "--model-dtype", "bfloat16", "--target", "vllm-0.28")
    assert code == 0
    assert "family       vllm   scheme S2" in text
    assert "not agnostic: kv kind unknown" in text
    assert "assumed      executor=mp, nnodes=1, per_token_head_quant=false, runner=v1" in text


def test_real_subprocess_prints_the_documented_json(tmp_path, hf_llama):
    root = tmp_path / "cache"
    ns = synth(root, family="llmd", tp=2)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([sys.executable, "-m", "kvmigrate", "identity", config_path(root, ns), "--json",
                           "--model-config", hf_llama], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == TOP_KEYS and out["family"] == "llmd"
    assert out["target"]["profile"] == "vllm-0.34" and out["target"]["parallel_agnostic"] is False
    missing = subprocess.run([sys.executable, "-m", "kvmigrate", "identity", config_path(root, ns)],
                             capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode == 2 and "--model-dtype" in missing.stderr


@pytest.mark.parametrize("sample", sorted(p.name for p in (Path(__file__).parents[2] / "kvmigrate/samples")
                                          .glob("*.config.json")))
def test_every_shipped_sample_works(sample, tmp_path):
    path = Path(__file__).parents[2] / "kvmigrate/samples" / sample
    # each sample with a config of its own model (another model's config is refused)
    own = {"vllm-0.27-deepseek-v3-tp8.config.json": HF_DEEPSEEK_V3, "vllmcpp-qwen3-4b.config.json": HF_QWEN3}
    model_config = tmp_path / "hf-config.json"
    model_config.write_text(json.dumps(own.get(sample, HF_LLAMA)))
    code, out, err = run(str(path), "--json", "--model-config", str(model_config))
    assert code == 0, err
    assert out["family"] in ("vllm", "vllmcpp", "ambiguous")


# --- nonsense facts and another model's config (issue 16, defect 3) ----------------------------

SAMPLES = Path(__file__).parents[2] / "kvmigrate/samples"
HF_DEEPSEEK_V2_LITE = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                       "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 27,
                       "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}
BAD_FLAGS = [  # (flag, value, text of the allowed values)
    ("--model-dtype", "banana", "half, float16, bfloat16, float, float32"),
    ("--cache-dtype", "banana", "auto, float16, bfloat16, fp8, fp8_e4m3"),
    ("--executor", "potato", "mp, ray, uni, external_launcher"),
    ("--runner", "v3", "'v1', 'v2'"),
    ("--kv-kind", "linear", "'full', 'mla', 'sliding', 'hybrid', 'mamba'"),
    ("--family", "trtllm", "'vllm', 'llmd', 'vllmcpp', 'sglang'"),
    ("--writer-layout", "sideways", "'layer_first', 'page_first', 'page_first_direct'"),
    ("--writer-release", "latest", "an SGLang release such as 0.5.13"),
    ("--nnodes", "0", "x>=1"),
    ("--total-kv-heads", "0", "x>=1"),
    ("--page-bytes", "-1", "x>=1"),
    ("--tensors-per-layer", "0", "x>=1"),
]
BAD_FACTS = [  # (FACTS.json key, value, text of the allowed values)
    ("model_dtype", "banana", "half, float16, bfloat16, float, float32"),
    ("cache_dtype", "fp9", "auto, float16, bfloat16, fp8, fp8_e4m3"),
    ("executor", "potato", "mp, ray, uni, external_launcher"),
    ("runner", "v3", "v1, v2"),
    ("kv_kind", "linear", "full, mla, sliding, hybrid, mamba"),
    ("family", "trtllm", "vllm, llmd, vllmcpp, sglang"),
    ("writer_layout", "sideways", "layer_first, page_first, page_first_direct"),
    ("model_name", "", "a non-empty served model name"),
    ("nnodes", 0, "a positive integer"),
    ("total_kv_heads", "8", "a positive integer"),
    ("page_bytes", 1.5, "a positive integer"),
    ("tensors_per_layer", -2, "a positive integer"),
    ("per_token_head_quant", "yes", "true or false"),
]


def tree_listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_bad_fact_values_exit_2_naming_the_allowed_values_and_write_nothing(tmp_path):
    root = tmp_path / "cache"
    synth(root, family="vllm", scheme="S2", tp=2)
    before = tree_listing(root)
    manifest = tmp_path / "m.parquet"
    good = ["migrate", str(root), "--apply", "--manifest-out", str(manifest), "--model-dtype", "bfloat16",
            "--kv-kind", "full", "--total-kv-heads", "8"]
    for flag, value, allowed in BAD_FLAGS:
        result = CliRunner().invoke(cli, [*good, flag, value])
        assert result.exit_code == 2, (flag, result.output)
        assert flag in result.stderr and value in result.stderr, (flag, result.stderr)
        assert allowed in result.stderr, (flag, result.stderr)
        assert tree_listing(root) == before and not manifest.exists(), flag
    facts_path = tmp_path / "FACTS.json"
    for key, value, allowed in BAD_FACTS:
        facts_path.write_text(json.dumps({"meta-llama/Llama-3.1-8B-Instruct": {key: value}}))
        result = CliRunner().invoke(cli, [*good, "--facts", str(facts_path)])
        assert result.exit_code == 2, (key, result.output)
        for part in (str(facts_path), "'meta-llama/Llama-3.1-8B-Instruct'", f"'{key}'", repr(value), allowed):
            assert part in result.stderr, (key, part, result.stderr)
        assert tree_listing(root) == before and not manifest.exists(), key
    result = CliRunner().invoke(cli, good)  # the same command with sound facts writes
    assert result.exit_code == 0, result.output
    assert tree_listing(root) != before and manifest.exists()


def test_llama_config_on_a_deepseek_namespace_is_refused_for_that_namespace(tmp_path):
    root = tmp_path / "cache"
    ds = synth(root, family="vllm", scheme="S3", tp=2, kv_kind="mla", model_name="deepseek-ai/DeepSeek-V2-Lite")
    llama = synth(root, family="vllm", scheme="S3", tp=2)
    llama_cfg = str(SAMPLES / "hf-llama-3.1-8b.json")
    code, out, err = run(config_path(root, ds), "--json", "--model-config", llama_cfg)
    assert code == 2 and out == ""
    for part in (ds["base_name"], llama_cfg, "LlamaForCausalLM", "'deepseek-ai/DeepSeek-V2-Lite'",
                 "--facts keys by model name", '{"deepseek-ai/DeepSeek-V2-Lite": {"model_config": '):
        assert part in err, part
    # in a scan the config still serves the Llama namespace; the DeepSeek one gets no target
    result = CliRunner().invoke(cli, ["scan", str(root), "-o", str(tmp_path / "m.parquet"), "--json",
                                      "--model-config", llama_cfg])
    by_base = {n["source_base"]: n for n in json.loads(result.stdout)["namespaces"]}
    refused, served = by_base[ds["base_name"]], by_base[llama["base_name"]]
    assert refused["target_base"] is None and "refused for namespace" in refused["target_error"]
    assert set(refused["by_action"]) == {"none"}
    assert served["target_error"] is None and served["target_base"] is not None
    # each model with its own config (--facts keys by model name): both are planned
    ds_cfg = tmp_path / "deepseek-v2-lite.json"
    ds_cfg.write_text(json.dumps(HF_DEEPSEEK_V2_LITE))
    facts = tmp_path / "FACTS.json"
    facts.write_text(json.dumps({"deepseek-ai/DeepSeek-V2-Lite": {"model_config": str(ds_cfg)},
                                 "meta-llama/Llama-3.1-8B-Instruct": {"model_config": llama_cfg}}))
    result = CliRunner().invoke(cli, ["scan", str(root), "-o", str(tmp_path / "m2.parquet"), "--json",
                                      "--facts", str(facts)])
    assert all(n["target_error"] is None for n in json.loads(result.stdout)["namespaces"])
    code, out, err = run(config_path(root, ds), "--json", "--model-config", str(ds_cfg))
    assert code == 0, err
    assert out["target"]["replicated_layout"] is True  # MLA at tp 2: the config's kv kind was used


@pytest.mark.parametrize("stated_by", ["flag", "facts"])
def test_a_refusal_records_the_flag_that_stated_the_refused_facts(tmp_path, stated_by):
    """The report's rerun hint for a refused namespace names the flag that stated the facts,
    carried as data from identity (`target_refused_flag`), never read back from the message;
    facts a FACTS.json stated have no flag of their own: the family's is offered."""
    root = tmp_path / "cache"
    ds = synth(root, family="vllm", scheme="S3", tp=2, kv_kind="mla", model_name="deepseek-ai/DeepSeek-V2-Lite")
    llama_cfg = str(SAMPLES / "hf-llama-3.1-8b.json")
    if stated_by == "flag":
        stated = ["--model-config", llama_cfg]
    else:
        facts = tmp_path / "FACTS.json"
        facts.write_text(json.dumps({"*": {"model_config": llama_cfg}}))
        stated = ["--facts", str(facts)]
    result = CliRunner().invoke(cli, ["scan", str(root), "-o", str(tmp_path / "m.parquet"), "--json", *stated])
    out = json.loads(result.stdout)
    (ns,) = [n for n in out["namespaces"] if n["source_base"] == ds["base_name"]]
    assert "refused for namespace" in ns["target_error"] and ns["target_error_flag"] is None
    want = "--model-config" if stated_by == "flag" else None
    assert ns["target_refused_flag"] == want
    (finding,) = [f for f in out["findings"] if f["code"] == "target_refused"]
    assert finding["flag"] == (want or families.get("vllm").settled_by)  # else the family's own


def test_a_kind_stated_for_another_model_is_refused_with_its_flag(tmp_path):
    root = tmp_path / "cache"
    ds = synth(root, family="vllm", scheme="S3", tp=2, kv_kind="mla", model_name="deepseek-ai/DeepSeek-V2-Lite")
    result = CliRunner().invoke(cli, ["scan", str(root), "-o", str(tmp_path / "m.parquet"), "--json",
                                      "--kv-kind", "full"])
    (ns,) = [n for n in json.loads(result.stdout)["namespaces"] if n["source_base"] == ds["base_name"]]
    assert "refused for namespace" in ns["target_error"]
    assert ns["target_refused_flag"] == "--kv-kind"
