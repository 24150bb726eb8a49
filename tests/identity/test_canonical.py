"""Canonical JSON, digests and config.json bytes (identity.md §1), checked against an
independent reference serializer written from the two writers' escaping rules."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmigrate.identity import canonical

_SHORT = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def ref_string(s: str, ascii_only: bool) -> str:
    """vLLM (Python json, ensure_ascii): every char outside ' '..'~' as \\uXXXX (UTF-16
    surrogate pairs above the BMP). vllm.cpp (nlohmann::json::dump): raw UTF-8, only
    control characters below 0x20 escaped; both use lowercase hex and the short escapes."""
    out = ['"']
    for ch in s:
        code = ord(ch)
        if ch in _SHORT:
            out.append(_SHORT[ch])
        elif code < 0x20:
            out.append(f"\\u{code:04x}")
        elif ascii_only and code > 0x7E:
            if code > 0xFFFF:
                v = code - 0x10000
                out.append(f"\\u{0xD800 + (v >> 10):04x}\\u{0xDC00 + (v & 0x3FF):04x}")
            else:
                out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def ref_dumps(value, ascii_only: bool) -> str:
    if isinstance(value, dict):
        items = sorted(value.items())  # code-point order == UTF-8 byte order (nlohmann's std::map)
        return "{" + ",".join(f"{ref_string(k, ascii_only)}:{ref_dumps(v, ascii_only)}" for k, v in items) + "}"
    if isinstance(value, list):
        return "[" + ",".join(ref_dumps(v, ascii_only) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if value is None:
        return "null"
    return ref_string(value, ascii_only)


names = st.text(min_size=1, max_size=30)
small = st.integers(min_value=1, max_value=64)
vllm_identities = st.fixed_dictionaries(
    {"model_name": names, "tp_size": small, "pp_size": small, "pcp_size": small, "dcp_size": small,
     "dtype": st.sampled_from(["auto", "bfloat16", "fp8_e4m3", "float16"]),
     "kv_cache_groups": st.lists(st.fixed_dictionaries({"tokens_per_block": small,
                                                        "layer_names": st.lists(names, max_size=4)}), max_size=3),
     "inference_engine": st.sampled_from(["vllm", "aphrodite"]),
     "tokens_per_hash": small, "blocks_per_file": small},
    optional={"parallel_agnostic": st.just(False), "replicated_layout": st.just(True),
              "canonical_format": st.sampled_from(["v1-nhd", "v1-hnd", "v2-nhd"]),
              "storage_format": st.sampled_from(["grouped-v1-4096", "grouped-v1-8192"]),
              "x_unknown_key": st.one_of(names, small)})
int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
vllmcpp_identities = st.fixed_dictionaries(
    {"architectures": st.lists(names, min_size=1, max_size=2), "block_size": small, "checkpoint_fingerprint": names,
     "dcp_size": small, "format_version": st.just(1), "hash_algo": st.just("sha256_cbor"), "hash_block_size": small,
     "head_size": small, "head_size_v": st.integers(min_value=0, max_value=512), "hf_config_digest": names,
     "inference_engine": st.just("vllm.cpp"),
     "kv_cache_spec_kind": st.sampled_from(["full_attention", "mla", "sliding_window", "chunked_local_attention",
                                            "mamba"]),
     "kv_dtype": st.sampled_from(["bf16", "f16", "fp8"]), "kv_quant_mode": st.just("none"),
     "max_position_embeddings": int64, "model_name": names, "model_type": names,
     "none_hash_hex": st.text(alphabet="0123456789abcdef", min_size=2, max_size=64),
     "num_hidden_layers": small, "num_kv_heads": small, "page_size_bytes": st.integers(min_value=1, max_value=2**40),
     "pcp_size": small, "pp_size": small, "rank": st.integers(min_value=0, max_value=64), "rope_config": names,
     "sliding_window": st.integers(min_value=-1, max_value=2**20), "tp_size": small, "weight_quantization": names},
    optional={"replicated_layout": st.just(True)})


@pytest.mark.slow  # big property test / kill matrix: CI runs it, `-m 'not slow'` leaves it out
@settings(max_examples=300)
@given(vllm_identities)
def test_vllm_canonical_bytes_equal_the_reference_recipe(fields):
    expected = ref_dumps(fields, ascii_only=True).encode()
    assert canonical.canonical_bytes(fields, "vllm") == expected
    assert canonical.canonical_bytes(fields, "llmd") == expected
    assert expected == json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()  # the writer's own call
    assert canonical.d12(fields, "vllm") == hashlib.sha256(expected).hexdigest()[:12]


@pytest.mark.slow  # big property test / kill matrix: CI runs it, `-m 'not slow'` leaves it out
@settings(max_examples=300)
@given(vllmcpp_identities)
def test_vllmcpp_canonical_bytes_equal_the_reference_recipe(identity):
    expected = ref_dumps(identity, ascii_only=False).encode("utf-8")
    assert canonical.canonical_bytes(identity, "vllmcpp") == expected
    assert canonical.full_digest(identity, "vllmcpp") == hashlib.sha256(expected).hexdigest()
    # config.json is exactly the canonical bytes: sha256(file) == full digest
    assert canonical.config_json_bytes(identity, "vllmcpp") == expected


@given(vllm_identities)
def test_vllm_config_json_round_trips_to_the_same_digest(fields):
    data = canonical.config_json_bytes(fields, "vllm")
    assert not data.endswith(b"\n")
    assert canonical.fields_from_config_bytes(data) == fields
    assert canonical.d12(canonical.fields_from_config_bytes(data), "vllm") == canonical.d12(fields, "vllm")


S3_ONE_GROUP = {"model_name": "org/M\u00e9del", "tokens_per_hash": 16, "blocks_per_file": 1, "tp_size": 1,
                "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "dtype": "bfloat16",
                "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["l0", "l1"]}],
                "inference_engine": "vllm", "parallel_agnostic": False}


def test_vllm_config_json_rendering_is_byte_exact():
    expected = (
        b'{\n'
        b'  "blocks_per_file": 1,\n'
        b'  "dcp_size": 1,\n'
        b'  "dtype": "bfloat16",\n'
        b'  "inference_engine": "vllm",\n'
        b'  "kv_cache_groups": [\n'
        b'    {\n'
        b'      "layer_names": [\n'
        b'        "l0",\n'
        b'        "l1"\n'
        b'      ],\n'
        b'      "tokens_per_block": 16\n'
        b'    }\n'
        b'  ],\n'
        b'  "model_name": "org/M\\u00e9del",\n'
        b'  "parallel_agnostic": false,\n'
        b'  "pcp_size": 1,\n'
        b'  "pp_size": 1,\n'
        b'  "tokens_per_hash": 16,\n'
        b'  "tp_size": 1\n'
        b'}'
    )
    for family in ("vllm", "llmd", "ambiguous"):
        assert canonical.config_json_bytes(S3_ONE_GROUP, family) == expected


def test_vllmcpp_config_json_is_raw_utf8_canonical_bytes():
    ident = {"model_name": "org/M\u00e9del\x01", "rank": 0, "architectures": ["A"]}
    assert canonical.config_json_bytes(ident, "vllmcpp") == \
        '{"architectures":["A"],"model_name":"org/M\u00e9del\\u0001","rank":0}'.encode()


def test_key_order_is_recursive_but_list_order_is_kept():
    fields = {"b": [{"z": 1, "a": 2}, {"y": 0}], "a": ["l1", "l0"]}
    assert canonical.canonical_bytes(fields, "vllm") == b'{"a":["l1","l0"],"b":[{"a":2,"z":1},{"y":0}]}'


def test_unknown_family_is_refused():
    with pytest.raises(ValueError):
        canonical.canonical_bytes({}, "sglang")


@pytest.mark.parametrize("data,message", [
    (b"{", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[1]", "expected a JSON object"),
    (b"", "not valid JSON"),
])
def test_fields_from_config_bytes_rejects_non_objects(data, message):
    with pytest.raises(ValueError, match=message):
        canonical.fields_from_config_bytes(data)
