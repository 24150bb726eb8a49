"""vllm.cpp block header codec (formats.md §2.1) and the 28-key identity rules."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmigrate.formats import vllmcpp
from kvmigrate.identity import canonical

VLLMCPP_C = {"architectures": ["Qwen3ForCausalLM"], "block_size": 16, "checkpoint_fingerprint": "sha256:aaaa",
             "dcp_size": 1, "format_version": 1, "hash_algo": "sha256_cbor", "hash_block_size": 16, "head_size": 128,
             "head_size_v": 128, "hf_config_digest": "deadbeefcafe", "inference_engine": "vllm.cpp",
             "kv_cache_spec_kind": "full_attention", "kv_dtype": "bf16", "kv_quant_mode": "none",
             "max_position_embeddings": 40960, "model_name": "Qwen/Qwen3-4B", "model_type": "qwen3",
             "none_hash_hex": "950bc4c76b023aa9f8388d6705b601adfc50516140dd1f2b8fc90bed037b2070",
             "num_hidden_layers": 36, "num_kv_heads": 8, "page_size_bytes": 512, "pcp_size": 1, "pp_size": 1,
             "rank": 0, "rope_config": "theta=1000000,dim=128,scaling=none", "sliding_window": -1, "tp_size": 1,
             "weight_quantization": "none"}

H2 = bytes.fromhex("c19f38571680eaa7876980c845f023605b0510735b38bc0d51b310fab11b7406")
# vllmcpp-format.md §3.1: identity C, key (H2, group 3), 512-byte payload, as the engine wrote it
EXAMPLE_HEADER = bytes.fromhex(
    "564c4350504b5631" "01000000" "24000000"
    "0002000000000000"
    "2441b2d1f822a351e040a4dd8d117a0aa78c0907e340c0f4dbae6505a98e8403"
    "c19f38571680eaa7876980c845f023605b0510735b38bc0d51b310fab11b7406" "00000003" + "00" * 28
    + "00" * 8
)


def test_example_header_bytes_match_the_engine():
    digest = bytes.fromhex(canonical.full_digest(VLLMCPP_C, "vllmcpp"))
    key = vllmcpp.make_key(H2, 3)
    assert len(key) == 36 and key[-4:] == b"\x00\x00\x00\x03"
    header = vllmcpp.encode_header(digest, key, 512)
    assert header == EXAMPLE_HEADER
    assert len(header) == vllmcpp.HEADER_SIZE == 128


def test_example_header_decodes():
    h = vllmcpp.decode_header(EXAMPLE_HEADER + b"\x11" * 512)
    assert h.magic == b"VLCPPKV1" and h.format_version == 1 and h.key_size == 36 and h.payload_size == 512
    assert h.digest.hex().startswith("2441b2d1f822")
    assert h.key == vllmcpp.make_key(H2, 3)
    assert h.reserved == b"\0" * 8


digests = st.binary(min_size=32, max_size=32)
keys = st.binary(min_size=0, max_size=64)
payloads = st.integers(min_value=0, max_value=2**64 - 1)


@given(digests, keys, payloads, st.integers(min_value=0, max_value=2**32 - 1))
def test_header_round_trip(digest, key, payload, version):
    data = vllmcpp.encode_header(digest, key, payload, version)
    h = vllmcpp.decode_header(data)
    assert (h.digest, h.key, h.payload_size, h.format_version, h.key_size) == (digest, key, payload, version, len(key))
    assert h.key_field == key.ljust(64, b"\0")
    assert vllmcpp.verify_header(data, digest=digest, payload_size=payload, key=key, format_version=version) is None


@given(st.binary(min_size=32, max_size=32), st.integers(min_value=0, max_value=2**32 - 1))
def test_make_key_is_hash_then_big_endian_group(block_hash, group):
    key = vllmcpp.make_key(block_hash, group)
    assert key[:32] == block_hash and int.from_bytes(key[32:], "big") == group


def _valid() -> tuple[bytes, dict]:
    digest = hashlib.sha256(b"identity").digest()
    key = vllmcpp.make_key(b"\x07" * 32, 0)
    return vllmcpp.encode_header(digest, key, 512), {"digest": digest, "payload_size": 512, "key": key}


def _patch(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new):]


@pytest.mark.parametrize("offset,new,check", [
    (0, b"VLCPPKV2", "magic"),
    (12, (65).to_bytes(4, "little"), "key_size"),
    (8, (2).to_bytes(4, "little"), "format_version"),
    (24, b"\xff", "digest"),
    (16, (513).to_bytes(8, "little"), "payload_size"),
    (56, b"\x08", "key"),
    (12, (35).to_bytes(4, "little"), "key"),  # a shorter key_size changes the compared key
])
def test_verify_names_the_first_failing_check(offset, new, check):
    data, expected = _valid()
    assert vllmcpp.verify_header(_patch(data, offset, new), **expected) == check


def test_verify_follows_the_engine_order():
    data, expected = _valid()
    # magic is checked before everything else, the key last
    broken = _patch(_patch(_patch(data, 56, b"\x08"), 24, b"\xff"), 0, b"XXXXXXXX")
    assert vllmcpp.verify_header(broken, **expected) == "magic"
    assert vllmcpp.verify_header(_patch(_patch(data, 56, b"\x08"), 24, b"\xff"), **expected) == "digest"
    assert vllmcpp.verify_header(data[:127], **expected) == "short"


def test_reserved_bytes_and_key_padding_are_not_checked():
    data, expected = _valid()
    assert vllmcpp.verify_header(_patch(_patch(data, 120, b"\x01" * 8), 100, b"\x01"), **expected) is None


def test_rewrite_header_changes_only_the_digest():
    data, expected = _valid()
    new_digest = hashlib.sha256(b"other").digest()
    rewritten = vllmcpp.rewrite_header(data, new_digest)
    assert rewritten[24:56] == new_digest
    assert rewritten[:24] == data[:24] and rewritten[56:] == data[56:128]
    assert vllmcpp.verify_header(rewritten, **{**expected, "digest": new_digest}) is None


def test_encode_refuses_bad_digest_or_key():
    with pytest.raises(ValueError):
        vllmcpp.encode_header(b"\0" * 31, b"", 1)
    with pytest.raises(ValueError):
        vllmcpp.encode_header(b"\0" * 32, b"\0" * 65, 1)
    with pytest.raises(ValueError):
        vllmcpp.decode_header(b"\0" * 127)


# --- identity Validate() rules -----------------------------------------------------------------

def test_example_identity_is_valid():
    assert vllmcpp.validate_identity(VLLMCPP_C) == []
    assert vllmcpp.validate_identity({**VLLMCPP_C, "replicated_layout": True}) == []


@pytest.mark.parametrize("change,problem", [
    ({"num_kv_heads": 0}, "'num_kv_heads' must be > 0"),
    ({"block_size": True}, "'block_size' must be an integer"),
    ({"page_size_bytes": 512.0}, "'page_size_bytes' must be an integer"),
    ({"model_name": ""}, "'model_name' must not be empty"),
    ({"architectures": []}, "'architectures' must not be empty"),
    ({"architectures": "Qwen3ForCausalLM"}, "'architectures' must be a list of strings"),
    ({"replicated_layout": False}, "'replicated_layout' may only be written as true"),
    ({"format_version": 2**32}, "'format_version' must fit in u32"),
])
def test_identity_validate_rules(change, problem):
    assert any(p.startswith(problem) for p in vllmcpp.validate_identity({**VLLMCPP_C, **change}))


def test_identity_missing_key():
    ident = dict(VLLMCPP_C)
    del ident["rope_config"]
    assert vllmcpp.validate_identity(ident) == ["missing key 'rope_config'"]
