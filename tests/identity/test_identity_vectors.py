"""Every identity vector produced by real vLLM FileMappers, and every worked digest of
identity.md §2 and §5, reproduced by our fields function and canonical JSON."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kvmigrate import layout
from kvmigrate.identity import canonical, schemes

VECTORS_PATH = Path("/work/shared/vectors/vllm-filemapper-public.json")
VECTORS = json.loads(VECTORS_PATH.read_text())


def _vector_id(v: dict) -> str:
    args = v["file_mapper_args"]
    return f"{v['vllm_version']}-{args['model_name']}-tp{args['tp_size']}-r{args['rank']}-{v['base_name'][-12:]}"


def test_vector_file_holds_all_35_vectors():
    assert len(VECTORS) == 35
    assert {v["vllm_version"] for v in VECTORS} == {"0.22.0", "0.24.0", "0.26.0", "0.27.0", "0.28.0", "0.29.0",
                                                     "0.33.0"}


@pytest.mark.parametrize("vector", VECTORS, ids=[_vector_id(v) for v in VECTORS])
def test_filemapper_reproduces_vllm_vector(vector):
    mapper = schemes.filemapper(vector["vllm_version"], **vector["file_mapper_args"])
    assert mapper.fields == vector["fields"]
    assert mapper.base_name == vector["base_name"]
    assert mapper.rank_dir == vector["rank_dir"]
    key = vector["example_key"]
    assert mapper.block_relpath(key["block_hash_hex"], key["group"]) == vector["example_relpath"]
    # the base folder name is the digest of the fields, recomputed independently here
    digest = hashlib.sha256(json.dumps(vector["fields"], sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert vector["base_name"].endswith("_" + digest[:12])


@pytest.mark.parametrize("vector", VECTORS, ids=[_vector_id(v) for v in VECTORS])
def test_vector_scheme_label_matches_release(vector):
    version = schemes.parse_version(vector["vllm_version"])
    label = schemes.scheme_of(vector["fields"])
    if version < (0, 26):
        assert label == "S1"
    elif version < (0, 27) or ("parallel_agnostic" not in vector["fields"]
                                and not any(k in vector["fields"] for k in schemes.OPTIONAL_KEYS)):
        assert label == "S2"  # S3 agnostic == S2 identity
    else:
        assert label == "S3"
    assert schemes.validate_fields(vector["fields"]) == []


# --- identity.md §2 worked digests ---------------------------------------------------------

S3_DEFAULT = {"model_name": "test-model", "tokens_per_hash": 16, "blocks_per_file": 1, "tp_size": 1, "pp_size": 1,
              "pcp_size": 1, "dcp_size": 1, "dtype": "float16", "kv_cache_groups": [], "inference_engine": "vllm",
              "parallel_agnostic": False}
S2_DEFAULT = {k: v for k, v in S3_DEFAULT.items() if k != "parallel_agnostic"}
S1_DEFAULT = {**{k: v for k, v in S2_DEFAULT.items() if k not in ("tokens_per_hash", "blocks_per_file")},
              "hash_block_size": 16, "gpu_blocks_per_file": 1}
LLMD_LLAMA = {"model_name": "meta-llama/Llama-3.1-8B-Instruct", "tp_size": 2, "pp_size": 1, "pcp_size": 1,
              "dcp_size": 1, "dtype": "auto", "hash_block_size": 16, "gpu_blocks_per_file": 16,
              "kv_cache_groups": [{"block_size": 16,
                                   "layer_names": [f"model.layers.{i}.self_attn.attn" for i in range(32)]}],
              "inference_engine": "vllm"}
MLA_REPLICATED = {**S2_DEFAULT, "model_name": "mla-model",
                  "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["mla_layer"]}],
                  "replicated_layout": True}

WORKED_VLLM = [
    ("s3-default", S3_DEFAULT, "de3bba26cf36"),
    ("s2-or-s3-agnostic", S2_DEFAULT, "42b94bdc9933"),
    ("s1", S1_DEFAULT, "588656ebcc66"),
    ("s3-canonical", {**S3_DEFAULT, "canonical_format": "v1-nhd"}, "8b51acfc04f1"),
    ("s3-canonical-storage", {**S3_DEFAULT, "canonical_format": "v1-nhd", "storage_format": "grouped-v1-4096"},
     "97323f68ee5f"),
    ("mla-replicated", MLA_REPLICATED, "8d7a92f846c0"),
    ("llmd-llama-tp2", LLMD_LLAMA, "3f1b68c1da90"),
]


@pytest.mark.parametrize("name,fields,expected", WORKED_VLLM, ids=[w[0] for w in WORKED_VLLM])
def test_identity_md_worked_digest(name, fields, expected):
    for family in ("vllm", "llmd", "ambiguous"):
        assert canonical.d12(fields, family) == expected


def test_s3_default_is_upstream_block_path():
    # upstream test_get_file_name_full_structure: rank 3, group 2, hash bytes(range(8))
    base = layout.base_name("test-model", canonical.d12(S3_DEFAULT, "vllm"))
    assert layout.block_relpath(base, 3, bytes(range(8)).hex(), 2) == "test-model_de3bba26cf36_r3/000/10_g2/0001020304050607.bin"


def test_worked_s3_default_from_fields_function():
    mapper = schemes.filemapper("0.27", model_name="test-model", tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                dtype="float16", kv_cache_groups=[], tokens_per_hash=16, blocks_per_file=1)
    assert mapper.fields == S3_DEFAULT
    assert mapper.d12 == "de3bba26cf36"


# --- identity.md §5 / vllmcpp-format.md §2.4: vllm.cpp identities --------------------------

VLLMCPP_A_TEXT = (
    '{"architectures":["Qwen3ForCausalLM"],"block_size":16,"checkpoint_fingerprint":"sha256:aaaa","dcp_size":1,'
    '"format_version":1,"hash_algo":"sha256_cbor","hash_block_size":16,"head_size":128,"head_size_v":128,'
    '"hf_config_digest":"deadbeefcafe","inference_engine":"vllm.cpp","kv_cache_spec_kind":"full_attention",'
    '"kv_dtype":"bf16","kv_quant_mode":"none","max_position_embeddings":40960,"model_name":"Qwen/Qwen3-4B",'
    '"model_type":"qwen3","none_hash_hex":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",'
    '"num_hidden_layers":36,"num_kv_heads":8,"page_size_bytes":512,"pcp_size":1,"pp_size":1,"rank":0,'
    '"rope_config":"theta=1000000,dim=128,scaling=none","sliding_window":-1,"tp_size":1,"weight_quantization":"none"}'
)
VLLMCPP_A = json.loads(VLLMCPP_A_TEXT)
DEFAULT_NONE_HASH = "950bc4c76b023aa9f8388d6705b601adfc50516140dd1f2b8fc90bed037b2070"
VLLMCPP_C = {**VLLMCPP_A, "none_hash_hex": DEFAULT_NONE_HASH}


def test_vllmcpp_example_a_bytes_and_digest():
    data = canonical.canonical_bytes(VLLMCPP_A, "vllmcpp")
    assert data == VLLMCPP_A_TEXT.encode()
    assert len(data) == 722
    assert canonical.full_digest(VLLMCPP_A, "vllmcpp") == \
        "89e024398d8ac0155870aab8877af52af56e933431403825cbf30dac0f73ad8e"
    assert layout.base_name(VLLMCPP_A["model_name"], canonical.d12(VLLMCPP_A, "vllmcpp")) == \
        "Qwen_Qwen3-4B_89e024398d8a"


def test_vllmcpp_example_b_tiering_identity():
    b = {**VLLMCPP_A, "none_hash_hex": "00"}
    assert len(canonical.canonical_bytes(b, "vllmcpp")) == 660
    assert canonical.full_digest(b, "vllmcpp") == "16f0fbbe6d5b27bf1fa442535b461c95654b632eec196dbceaafe43052fc3916"


@pytest.mark.parametrize("overrides,expected", [
    ({}, "2441b2d1f822a351e040a4dd8d117a0aa78c0907e340c0f4dbae6505a98e8403"),
    ({"tp_size": 2, "rank": 0}, "5478ffca1af4d050f0427f585ae3ee4f55092957aaaac670553c21453f951630"),
    ({"tp_size": 2, "rank": 1}, "071818851a2ae55412f218cb0b18eb1ce19d44f6afc9de0a221f51dbb3406ef0"),
], ids=["c", "c-tp2-rank0", "c-tp2-rank1"])
def test_vllmcpp_example_c_default_seed_and_tp2_ranks(overrides, expected):
    assert canonical.full_digest({**VLLMCPP_C, **overrides}, "vllmcpp") == expected


def test_vllmcpp_example_d_escaping():
    name = "org/M\u00e9del\"x\\y\x01\t/\x7f"
    ident = {**VLLMCPP_A, "model_name": name}
    data = canonical.canonical_bytes(ident, "vllmcpp")
    assert '"model_name":"org/M\u00e9del\\"x\\\\y\\u0001\\t/\x7f"'.encode() in data
    assert canonical.full_digest(ident, "vllmcpp") == "77558fe2071db1f364c003365e94bd623e4b787dcb43f7d2f317b92e78f5df11"
    folder = layout.base_name(name, "77558fe2071d")
    assert folder == "org_M\u00e9del\"x\\y\x01\t_\x7f_77558fe2071d"
    assert layout.parse_folder(folder).safe_model == "org_M\u00e9del\"x\\y\x01\t_\x7f"


def test_vllmcpp_and_vllm_recipes_differ_only_for_non_ascii():
    assert canonical.canonical_bytes(VLLMCPP_A, "vllmcpp") == canonical.canonical_bytes(VLLMCPP_A, "vllm")
    accented = {**VLLMCPP_A, "model_name": "M\u00e9del"}
    assert canonical.d12(accented, "vllmcpp") != canonical.d12(accented, "vllm")
