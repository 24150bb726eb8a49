"""kvmigrate/formats/lmcache.py: one test per grammar rule and per §2.4 verdict of
spec lmcache.md, on the byte strings LMCache itself writes (R1 §1.6, §2.2)."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest

from kvmigrate.formats import lmcache as L

VERIFIED = "deepseek-ai/DeepSeek-V3@1@0@-1a2b3c@bfloat16@user%alice@tenant%t1"  # R1 §1.6, 0.5.6 to_string


# --- §1.2 keys ---------------------------------------------------------------------------


def test_k3_key_parses_the_verified_string_and_formats_it_back():
    k = L.parse_key(VERIFIED)
    assert k == L.Key("lmc-k3", "deepseek-ai/DeepSeek-V3", 1, 0, "-1a2b3c", "bfloat16",
                      (("user", "alice"), ("tenant", "t1")))
    assert L.format_key(k) == VERIFIED
    assert k.chunk_hash == -0x1A2B3C and k.hash_kind == "hex"


def test_hash_is_signed_lowercase_unpadded_hex():
    assert L.hash_hex(-0x1A2B3C) == "-1a2b3c"
    assert L.hash_hex(0x00AB111111111111) == "ab111111111111"
    k = L.parse_key("m@4@3@ab111111111111@uint8")
    assert k is not None and (k.ws, k.wid, k.hash, k.dtype) == (4, 3, "ab111111111111", "uint8")


def test_k3_bytes_digest_is_64_hex_and_no_int():
    h = "0b84" + "0" * 60
    k = L.parse_key(f"m@1@0@{h}@half")
    assert k is not None and k.hash_kind == "hex64" and k.chunk_hash is None and k.hash == h


def test_k1_key_has_fmt_and_no_dtype():
    k = L.parse_key("vllm@meta-llama/Llama-3.1-8B@2@1@-1a2b@user%a")
    assert k == L.Key("lmc-k1", "meta-llama/Llama-3.1-8B", 2, 1, "-1a2b", None, (("user", "a"),), fmt="vllm")
    assert L.format_key(k) == "vllm@meta-llama/Llama-3.1-8B@2@1@-1a2b@user%a"
    assert k.chunk_hash is None  # a k1 field may be decimal (0.3.3-0.3.5): no int is proven


def test_k1_decimal_and_sha256_hashes():
    dec = L.parse_key("sgl@m@1@0@-9223372036854775807")
    assert dec is not None and dec.scheme == "lmc-k1" and dec.fmt == "sgl" and dec.hash_kind == "decimal"
    hexed = L.parse_key("vllm@m@1@0@" + "be2349cd" * 8)
    assert hexed is not None and hexed.scheme == "lmc-k1" and hexed.hash_kind == "hex64"


def test_k2_key_is_told_from_k1_by_the_dtype_field():
    k = L.parse_key("vllm@m@4@0@7f@fp8_e4m3@t%1")
    assert k is not None and (k.scheme, k.fmt, k.dtype, k.tags) == ("lmc-k2", "vllm", "fp8_e4m3", (("t", "1"),))
    assert L.format_key(k) == "vllm@m@4@0@7f@fp8_e4m3@t%1"


def test_a_model_named_vllm_is_a_k3_key():
    k = L.parse_key("vllm@1@0@ab@half")
    assert k is not None and k.scheme == "lmc-k3" and k.model == "vllm" and k.fmt is None


def test_layerwise_key_keeps_its_layer():
    k = L.parse_key("m@1@0@ab@bfloat16@1@user%a")
    assert k is not None and k.layer == 1 and k.tags == (("user", "a"),)
    assert L.format_key(k) == "m@1@0@ab@bfloat16@1@user%a"


def test_tag_value_may_hold_percent_and_keeps_order():
    k = L.parse_key("m@1@0@ab@half@b%x%y@a%")
    assert k is not None and k.tags == (("b", "x%y"), ("a", ""))


def test_mp_key_fields_and_kv_rank():
    h = "ab" * 32
    k = L.parse_key(f"Qwen/Qwen3-8B@0x02010201@1f@{h}@salt1")
    assert k is not None and k.scheme == "lmc-mp1"
    assert (k.ws, k.wid, k.local_ws, k.local_rank, k.group, k.salt) == (2, 1, 2, 1, 0x1F, "salt1")
    assert k.kv_rank == L.kv_rank(2, 1) == 0x02010201
    assert L.format_key(k) == f"Qwen/Qwen3-8B@0x02010201@1f@{h}@salt1"


def test_mp_mla_kv_rank_is_0x01000100_and_dcp_suffix():
    assert L.kv_rank(1, 0) == 0x01000100
    model = "deepseek-ai/DeepSeek-V3##lmcache-dcp-layout-v1-d2-interleave4"
    k = L.parse_key(f"{model}@0x01000100@0@{'cd' * 32}")
    assert k is not None and k.model == model and k.salt is None and L.mp_dcp(k.model) == (2, 4)


@pytest.mark.parametrize("s", [
    "", "@@@@", "a@b@1@0@ab@half",  # an '@' in the model
    "m@1@0@ab", "m@1@0@ab@notadtype", "m@x@0@ab@half", "m@1@0@xyz@half", "m@1@0@ab@half@notag",
    "m@01@0@ab@half", "vllm@m@1@0@ab@half@notag", "m@0x0100@0@" + "ab" * 32, "m@0x01000100@0@abc",
    "m@1@0@" + "a" * 17 + "@half",
])
def test_unparseable_keys_are_none(s):
    assert L.parse_key(s) is None


# --- §1.3 names ---------------------------------------------------------------------------------

ERA_KEYS = {
    "lmc-k1": L.Key("lmc-k1", "org/model-a", 4, 2, "-7f3a", None, (("u", "x"),), fmt="vllm"),
    "lmc-k2": L.Key("lmc-k2", "org/model-a", 4, 2, "7f3a", "half", (("u", "x"),), fmt="sgl"),
    "lmc-k3": L.Key("lmc-k3", "org/model-a", 4, 2, "-7f3a", "bfloat16", (("u", "x%y"),)),
    "lmc-mp1": L.Key("lmc-mp1", "org/model-a", 4, 2, "9" * 64, kv_rank=L.kv_rank(4, 2), group=0, salt="s"),
}


@pytest.mark.parametrize(("era", "backend"), [(e, b) for e in ERA_KEYS for b in L.BACKENDS
                                               if (b == "mp") == (e == "lmc-mp1")])  # MP keys are MP's only
def test_file_names_round_trip_every_era_and_backend(era, backend):
    key = ERA_KEYS[era]
    variants = [{}]
    if backend == "gds":
        variants = [{"gds_quoted": False}] + ([{"gds_quoted": True}] if era == "lmc-k3" else [])
        variants += [{**v, "suffix": ".weka1"} for v in variants]
    for kw in variants:
        rel = L.relpath_in_tier(key, backend, **kw)
        parsed = L.parse_name(rel.split("/")[-1])
        assert parsed is not None and parsed.backend == backend, rel
        if backend == "local_disk":  # lossy: the model as written
            assert parsed.key == dataclasses.replace(key, model="org-model-a") and not parsed.model_exact
        else:
            assert parsed.key == key and parsed.model_exact
        assert parsed.data_name == rel.split("/")[-1]


def test_local_disk_name_replaces_slash_with_dash_and_keeps_pt():
    k = L.parse_key(VERIFIED)
    assert L.file_name(k, "local_disk") == "deepseek-ai-DeepSeek-V3@1@0@-1a2b3c@bfloat16@user%alice@tenant%t1.pt"
    parsed = L.parse_name(L.file_name(k, "local_disk"))
    assert parsed is not None and parsed.key.model == "deepseek-ai-DeepSeek-V3"
    assert L.local_disk_model_matches("deepseek-ai/DeepSeek-V3", parsed.key.model)
    assert not L.local_disk_model_matches("deepseek-ai/DeepSeek-V3-0324", parsed.key.model)


def test_fs_name_uses_sep_and_old_dash():
    k = L.parse_key(VERIFIED)
    assert L.file_name(k, "fs") == "deepseek-ai-SEP-DeepSeek-V3@1@0@-1a2b3c@bfloat16@user%alice@tenant%t1.data"
    old = L.parse_name("vllm@org-model@2@0@ab.data")  # a ≤ 0.3.9.post2 name: '-' may have been '/'
    assert old is not None and old.backend == "fs" and not old.model_exact


def test_mp_name_is_told_from_fs_by_its_key():
    parsed = L.parse_name(f"org-SEP-m@0x01000100@0@{'e' * 64}.data")
    assert parsed is not None and parsed.backend == "mp" and parsed.key.model == "org/m"


def test_fs_base_path_is_abs_hash_mod_n():
    k = L.parse_key("m@2@1@-7@half")
    assert k is not None and L.fs_base_index(k, 3) == 1 and L.fs_base_index(k, 1) == 0
    assert L.fs_base_index(ERA_KEYS["lmc-k1"], 3) is None


def test_gds_folders_are_decimal_of_the_signed_int():
    k = L.parse_key("m@1@0@-5a3c@half")
    assert k is not None and str(-0x5A3C) == "-23100"
    assert L.gds_folders(k) == ("-2", "31")
    assert L.gds_relpath(k) == "-2/31/m%401%400%40-5a3c%40half.kvcache.safetensors"
    big = L.parse_key("m@1@0@7f@half")
    assert big is not None and L.gds_folders(big) == ("12", "7")  # str(127): a short string


def test_gds_folders_unchecked_for_digests_and_k1():
    assert L.gds_folders(L.Key("lmc-k3", "m", 1, 0, "a" * 64, "half")) is None
    assert L.gds_folders(ERA_KEYS["lmc-k1"]) is None


def test_gds_relpath_takes_the_writers_int_when_the_name_proves_none():
    k1 = ERA_KEYS["lmc-k1"]
    assert L.gds_relpath(k1, gds_quoted=False) == "vllm@org_model-a@4@2@-7f3a@u%x.kvcache.safetensors"
    assert L.gds_relpath(k1, gds_quoted=False, chunk_hash=-0x7F3A).startswith("-3/25/")  # str(-32570)


def test_gds_quoted_name_quotes_slash_at_and_percent():
    k = L.parse_key("org/m@1@0@ab@half@t%v")
    assert k is not None
    assert L.file_name(k, "gds") == "org%2Fm%401%400%40ab%40half%40t%25v.kvcache.safetensors"
    assert L.file_name(k, "gds", sidecar=True).endswith(".kvcache.safetensors.metadata")
    parsed = L.parse_name("org%2Fm%401%400%40ab%40half%40t%25v.kvcache.safetensors.metadata")
    assert parsed is not None and parsed.sidecar and parsed.quoted and parsed.key == k


def test_gds_legacy_name_underscores_all_stand_for_slash():
    parsed = L.parse_name("org_m@1@0@ab@half.kvcache.safetensors")
    assert parsed is not None and parsed.quoted is False and parsed.key.model == "org/m"
    k = L.parse_key("org/m@1@0@ab@half")
    assert k is not None and L.file_name(k, "gds", gds_quoted=False) == "org_m@1@0@ab@half.kvcache.safetensors"


@pytest.mark.parametrize("name", [
    "", "x.pt", "x.data", "README.txt", "a/b.pt", ".kvmigrate.lock", "m@1@0@ab@half.pt.kvmigrate-12.tmp",
    "m%401%400%40ab.kvcache.safetensors", "m@1@0@ab@half.safetensors", "x.kvcache.safetensors.metadata",
    "m@1@0@ab@half.tmp", "\udcff@1@0@ab@half.pt",
])
def test_unknown_names_are_none_never_raise(name):
    parsed = L.parse_name(name)
    assert parsed is None or parsed.key.model == "\udcff"


# --- §1.4 temp names ------------------------------------------------------------------------------


def test_fs_and_mp_temp_names_replace_data_with_tmp():
    assert L.fs_temp_name("org-SEP-m@1@0@ab@half.data") == "org-SEP-m@1@0@ab@half.tmp"
    t = L.parse_temp_name("org-SEP-m@1@0@ab@half.tmp")
    assert t == L.TempName("fs", "org-SEP-m@1@0@ab@half.data")
    mp = L.parse_temp_name(f"m@0x01000100@0@{'a' * 64}.tmp")
    assert mp is not None and mp.backend == "mp"


def test_gds_temp_names_uuid_and_legacy_draws():
    data = "m%401%400%40ab%40half.kvcache.safetensors"
    assert L.gds_temp_name(data, "0a1b2c3d") == data + ".tmp0a1b2c3d"
    assert L.parse_temp_name(data + ".tmp0a1b2c3d") == L.TempName("gds", data, "uuid")
    assert L.parse_temp_name(data + ".metadata.tmpQ7Z2K9AB") == L.TempName("gds", data + ".metadata", "legacy")
    assert L.parse_temp_name(data + ".tmp12345678") == L.TempName("gds", data, "either")


@pytest.mark.parametrize("name", ["m@1@0@ab@half.pt.tmp", "notes.tmp", "m@1@0@ab@half.data.kvmigrate-12.tmp",
                                  "m%401%400%40ab%40half.kvcache.safetensors.kvmigrate-7.tmp",
                                  "m%401%400%40ab%40half.kvcache.safetensors.tmp1",
                                  "m%401%400%40ab%40half.kvcache.safetensors.tmpabcdefgh"])
def test_non_temp_names_are_none(name):
    # local_disk writes no temp; kvmigrate's own temps are own_artifact; 'abcdefgh' is no writer's draw
    assert L.parse_temp_name(name) is None


# --- §2.1 geometry ---------------------------------------------------------------------------------


def test_full_chunk_bytes_deepseek_and_qwen_partial():
    assert L.full_chunk_bytes(True, 61, 256, 576, "bfloat16") == 17_989_632  # R1 §2.1
    assert L.full_chunk_bytes(False, 36, 36, 2 * 128, "bfloat16") == 1_327_104  # R1 §2.1: a 36-token Qwen2.5-3B file
    assert L.payload_shape(False, 4, 16, 32) == (2, 4, 16, 32) and L.payload_shape(True, 4, 16, 8) == (1, 4, 16, 8)
    assert L.memory_format(True) == 6 and L.memory_format(False) == 1


# --- §2.2 fs header ------------------------------------------------------------------------------


def test_fs_header_known_shape_bytes():
    h = L.encode_fs_header(17_989_632, L.KV_MLA_FMT, "bfloat16", [1, 61, 256, 576])
    assert h.hex() == "00801201" "06000000" "03000000" "01000000" "3d000000" "00010000" "40020000"
    assert len(h) == L.fs_header_size(1) == 28
    assert L.decode_fs_header(h) == L.FsHeader(17_989_632, 6, ((3, (1, 61, 256, 576)),))


def test_fs_header_pads_shape_and_dtype_codes():
    h = L.encode_fs_header(12, 1, "half", [2, 3])
    assert struct.unpack("<7i", h) == (12, 1, 2, 2, 3, 0, 0)
    assert L.decode_fs_header(h).shape == (2, 3)  # padding stripped
    assert L.FS_DTYPE_CODES == {"half": 2, "bfloat16": 3, "float": 4, "double": 5, "uint8": 6, "fp8_e4m3fn": 7,
                                "fp8_e5m2": 8}
    assert L.decode_fs_header(struct.pack("<7i", 2, 1, 1, 1, 1, 1, 1)).dtype == "half"  # 1 reads as float16
    assert L.decode_fs_header(h[:27]) is None and L.fs_header_size(2) == 48


def test_fs_header_detection_needs_length_equal_size_minus_28():
    payload = bytes(2 * 4 * 16 * 32 * 2)
    h = L.encode_fs_header(len(payload), 1, "bfloat16", [2, 4, 16, 32])
    assert L.fs_header_fits(h, len(h) + len(payload), "bfloat16")
    assert not L.fs_header_fits(h, len(h) + len(payload) + 1, "bfloat16")
    assert not L.fs_header_fits(h, len(h) + len(payload), "half")
    assert not L.fs_header_fits(payload[:28], len(payload), "bfloat16")  # raw zero bytes: fmt 0


# --- §2.3 GDS header -------------------------------------------------------------------------------


def test_gds_header_bytes_equal_hand_built():
    meta = {"kvcache": {"dtype": "BF16", "shape": [2, 4, 16, 32], "data_offsets": [0, 8192], "fmt": 1,
                        "__metadata__": {"lmcache_version": "1"}}}
    expected = struct.pack("<Q", 4088) + json.dumps(meta).encode().ljust(4088)
    got = L.encode_gds_header("bfloat16", [2, 4, 16, 32], 8192, 1)
    assert got == expected and len(got) == 4096
    assert b'{"kvcache": {"dtype": "BF16", "shape": [2, 4, 16, 32], "data_offsets": [0, 8192]' in got


@pytest.mark.parametrize("dtype,name", [("fp8_e4m3fn", "F8E4M3FN"), ("fp8_e5m2", "F8E5M2"), ("bfloat16", "BF16")])
def test_gds_header_names_dtypes_as_lmcache_056_writes_them(dtype, name):
    """gds_backend.torch_dtypes of the 0.5.6 wheel: fp8 is "F8E4M3FN"/"F8E5M2" (not
    safetensors' "F8_E4M3"); a header naming another spelling is no chunk LMCache wrote."""
    header = L.encode_gds_header(dtype, [2, 4, 16, 32], 4096, 1)
    assert f'"dtype": "{name}"'.encode() in header


def test_gds_header_decodes_and_flags_non_canonical_bytes():
    h = L.decode_gds_header(L.encode_gds_header("half", [1, 2, 3, 8], 96, 6))
    assert h == L.GdsHeader("F16", (1, 2, 3, 8), (0, 96), 6, "1", True) and h.key_dtype == "half"
    meta = {"kvcache": {"dtype": "F16", "shape": [1, 2, 3, 8], "data_offsets": [0, 96], "fmt": 6,
                        "__metadata__": {"lmcache_version": "1"}}}
    compact = struct.pack("<Q", 4088) + json.dumps(meta, separators=(",", ":")).encode().ljust(4088)
    c = L.decode_gds_header(compact)
    assert c is not None and not c.canonical and c.shape == (1, 2, 3, 8)


@pytest.mark.parametrize("data", [
    b"", bytes(4096), struct.pack("<Q", 4000) + b" " * 4088, struct.pack("<Q", 4088) + b"{\"kvcache\": ".ljust(4088),
    struct.pack("<Q", 4088) + b'{"kvcache": {"dtype": "BF16"}}'.ljust(4088),
    struct.pack("<Q", 4088) + b"\xff".ljust(4088),
])
def test_gds_header_that_does_not_parse_is_none(data):
    assert L.decode_gds_header(data) is None


# --- §2.4 verdicts -------------------------------------------------------------------------------

PAYLOAD = bytes(range(256)) * 32  # 8192 bytes = 2·4·16·32·2 (bfloat16)
SHAPE = [2, 4, 16, 32]
FS = L.encode_fs_header(len(PAYLOAD), 1, "bfloat16", SHAPE) + PAYLOAD
GDS = L.encode_gds_header("bfloat16", SHAPE, len(PAYLOAD), 1) + PAYLOAD


def v(backend, data, **kw):
    kw.setdefault("dtype", "bfloat16")
    return L.chunk_verdict(backend, len(data), data[:4096], all_zero=not any(data), **kw).status


def test_verdict_whole_files():
    assert v("fs", FS) is None and v("gds", GDS) is None
    assert v("local_disk", PAYLOAD, full_chunk=8192) is None and v("mp", PAYLOAD, full_chunk=8192) is None
    assert v("fs", PAYLOAD, fs_header=False, full_chunk=8192) is None


def test_verdict_zero_filled():
    assert v("gds", bytes(len(GDS))) == "zero_filled" and v("local_disk", bytes(8192), full_chunk=8192) == "zero_filled"


def test_verdict_short_empty_and_under_header():
    assert v("local_disk", b"", full_chunk=8192) == "short"
    assert v("fs", FS[:20]) == "short" and v("gds", GDS[:4000]) == "short"


def test_verdict_short_torn_after_header():
    assert v("fs", FS[:-100]) == "short" and v("gds", GDS[:-1]) == "short"


def test_verdict_size_mismatch_more_than_header_says():
    assert v("fs", FS + b"x") == "size_mismatch" and v("gds", GDS + b"x" * 16) == "size_mismatch"


def test_verdict_header_invalid_garbage_and_contradictions():
    assert v("gds", b"\x01" * len(GDS)) == "header_invalid"
    bad_shape = L.encode_fs_header(len(PAYLOAD), 1, "bfloat16", [2, 4, 17, 32]) + PAYLOAD
    assert v("fs", bad_shape) == "header_invalid"
    assert v("fs", FS, dtype="half") == "header_invalid"  # dtype code against the key
    assert v("fs", FS, mla=True) == "header_invalid"  # fmt 1 for an MLA model
    assert v("gds", GDS, dtype="float") == "header_invalid"
    wrong_fmt = L.encode_gds_header("bfloat16", SHAPE, len(PAYLOAD), 3) + PAYLOAD
    assert v("gds", wrong_fmt) == "header_invalid"
    meta = L.gds_meta("bfloat16", SHAPE, len(PAYLOAD), 1)
    meta["kvcache"]["__metadata__"]["lmcache_version"] = "2"
    v2 = struct.pack("<Q", 4088) + json.dumps(meta).encode().ljust(4088) + PAYLOAD
    assert v("gds", v2) == "header_invalid"
    negative = struct.pack("<7i", -1, 1, 3, 2, 4, 16, 32) + PAYLOAD
    assert v("fs", negative) == "header_invalid"


def test_verdict_orphan_data_without_whole_sidecar():
    assert v("gds", GDS, sidecar="missing") == "orphan_data" and v("gds", GDS, sidecar="corrupt") == "orphan_data"
    assert v("gds", GDS[:-1], sidecar="missing") == "short"  # the first status in §4's order


def test_verdict_raw_sizes_against_geometry():
    assert v("local_disk", PAYLOAD[:4096], full_chunk=8192) == "short"
    assert v("local_disk", PAYLOAD + b"x" * 512, full_chunk=8192) == "size_mismatch"  # ≤ 0.4.3 padding
    assert v("mp", PAYLOAD[:4096], full_chunk=8192, token_bytes=512, save_unfull_chunk=True) is None
    assert v("mp", PAYLOAD[:4000], full_chunk=8192, token_bytes=512, save_unfull_chunk=True) == "size_mismatch"


def test_verdict_raw_sizes_against_modal_size():
    assert v("local_disk", PAYLOAD[:100], modal_size=8192) == "short"
    assert v("local_disk", PAYLOAD + b"x", modal_size=8192) == "size_mismatch"
    assert v("local_disk", PAYLOAD, modal_size=8192) is None


def test_sidecar_verdicts():
    head = GDS[:4096]
    assert L.sidecar_verdict(head, GDS).status is None
    assert L.sidecar_verdict(bytes(4096), GDS).status == "zero_filled"
    assert L.sidecar_verdict(head[:100], GDS).status == "short"
    assert L.sidecar_verdict(struct.pack("<Q", 4088) + b"{".ljust(4088), GDS).status == "corrupt_sidecar"
    other = L.encode_gds_header("bfloat16", [2, 4, 8, 32], 4096, 1)
    assert L.sidecar_verdict(other, GDS).status == "corrupt_sidecar"  # differs from its data header
    assert L.sidecar_verdict(head + b"x", GDS).status == "size_mismatch"
