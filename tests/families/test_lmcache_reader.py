"""The LMCache 0.5.6 reference reader (tests/helpers/lmcache_reader.py), one test per rule it
implements, on tier directories built here byte by byte with struct/json as the spec
describes (docs: /work/shared/spec/lmcache.md §1-§3), never with kvmigrate's synth. File
names are written out literally, so a reader that computes a wrong name misses them."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from helpers.lmcache_reader import Deployment, LMCacheReader, key_string, tags_from_request_configs

MODEL = "meta-llama/Llama-3.1-8B"
H = -0x1A2B3C  # str(H) == "-1715004": GDS folders "-1/71"
L, HID, T = 2, 8, 4  # layers, per-rank hidden (or MLA width), chunk_size
FULL = 2 * L * T * HID * 2  # a non-MLA bfloat16 chunk: 256 B
MLA_FULL = 1 * L * T * HID * 2
DIGEST = bytes(range(32))  # an MP blake3 chunk hash


def payload(n: int, seed: int = 1) -> bytes:
    return bytes((seed * 31 + i * 7) % 251 for i in range(n))


def put(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def fs_header(length: int, fmt: int = 1, code: int = 3, shape: tuple[int, ...] = (2, L, T, HID)) -> bytes:
    """RemoteMetadata, one group (§2.2): 7 little-endian int32."""
    return struct.pack("<7i", length, fmt, code, *shape)


def gds_header(n: int, *, dtype: str = "BF16", shape: list[int] | None = None, fmt: int = 1) -> bytes:
    """§2.3: <Q 4088, then json.dumps with default separators, key order as written, padded with spaces."""
    meta = {"kvcache": {"dtype": dtype, "shape": shape or [2, L, T, HID], "data_offsets": [0, n], "fmt": fmt,
                        "__metadata__": {"lmcache_version": "1"}}}
    return struct.pack("<Q", 4088) + json.dumps(meta).encode().ljust(4088, b" ")


def dep(**kw) -> Deployment:
    return Deployment(**{"model": MODEL, "layers": L, "hidden": HID, "chunk_size": T, **kw})


# --- names (§1.2, §1.3, §3.1) ---------------------------------------------------------------

def test_key_string_is_the_verified_0_5_6_output():
    """R1 §1.6: tags in request order, other lmcache.* configs dropped, bfloat16 spelled as is."""
    tags = tags_from_request_configs({"lmcache.tag.user": "alice", "lmcache.skip_save": False, "lmcache.tag.tenant": "t1"})
    assert key_string("deepseek-ai/DeepSeek-V3", 1, 0, -0x1A2B3C, "bfloat16", tags) == \
        "deepseek-ai/DeepSeek-V3@1@0@-1a2b3c@bfloat16@user%alice@tenant%t1"


@pytest.mark.parametrize("h, text", [(-0x1A2B3C, "-1a2b3c"), (0x00AB111111111111, "ab111111111111"), (0xABC, "abc")])
def test_hash_is_signed_lowercase_unpadded_hex(h, text):
    assert key_string("m", 4, 3, h, "uint8") == f"m@4@3@{text}@uint8"


@pytest.mark.parametrize("dtype, name", [("float16", "half"), ("half", "half"), ("float32", "float"),
                                         ("bfloat16", "bfloat16"), ("uint8", "uint8"), ("torch.float64", "double")])
def test_key_dtype_by_torch_dtype_to_str_dtype(dtype, name):
    assert key_string("m", 1, 0, 1, dtype).endswith(f"@{name}")


def test_local_disk_and_fs_names_are_the_verified_ones():
    """R1 §1.6: local_disk `/`->`-` + .pt, fs `/`->`-SEP-` + .data."""
    d = Deployment("deepseek-ai/DeepSeek-V3", world_size=8, worker_id=5, mla=True,
                   tags=(("user", "alice"), ("tenant", "t1")))
    assert LMCacheReader("/t", "local_disk", d).relpath(-0x1A2B3C) == \
        "deepseek-ai-DeepSeek-V3@1@0@-1a2b3c@bfloat16@user%alice@tenant%t1.pt"
    assert LMCacheReader("/t", "fs", d).relpath(-0x1A2B3C) == \
        "deepseek-ai-SEP-DeepSeek-V3@1@0@-1a2b3c@bfloat16@user%alice@tenant%t1.data"


@pytest.mark.parametrize("backend", ["local_disk", "fs", "gds"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_mla_with_save_only_first_rank_looks_up_1_0_at_every_tp(backend, tp):
    for rank in range(tp):
        r = LMCacheReader("/t", backend, Deployment(MODEL, world_size=tp, worker_id=rank, mla=True))
        assert r.key(H) == f"{MODEL}@1@0@-1a2b3c@bfloat16"


def test_gds_folders_come_from_the_decimal_hash_and_the_name_is_quoted():
    d = Deployment(MODEL, world_size=2, worker_id=1, tags=(("team", "a%b"),))
    assert LMCacheReader("/t", "gds", d).relpath(H) == \
        "-1/71/meta-llama%2FLlama-3.1-8B%402%401%40-1a2b3c%40bfloat16%40team%25a%25b.kvcache.safetensors"
    assert LMCacheReader("/t", "gds", d).relpath(0xABCDEF).startswith("11/25/")  # 0xabcdef == 11259375


def test_gds_on_wekafs_uses_the_weka1_suffix():
    assert LMCacheReader("/t", "gds", Deployment(MODEL, wekafs=True)).relpath(H).endswith("%40bfloat16.weka1")


def test_mp_names_carry_the_kv_rank():
    """§1.2: non-MLA N<<24|r<<16|N<<8|r on one node; MLA 0x01000100 at every TP."""
    gqa = LMCacheReader("/t", "mp", Deployment(MODEL, world_size=2, worker_id=1))
    assert gqa.relpath(DIGEST) == f"meta-llama-SEP-Llama-3.1-8B@0x02010201@0@{DIGEST.hex()}.data"
    for tp in (1, 2, 8):
        mla = LMCacheReader("/t", "mp", Deployment(MODEL, world_size=tp, worker_id=tp - 1, mla=True))
        assert mla.relpath(DIGEST, group=10) == f"meta-llama-SEP-Llama-3.1-8B@0x01000100@a@{DIGEST.hex()}.data"


def test_mp_cache_salt_is_the_last_field():
    r = LMCacheReader("/t", "mp", Deployment(MODEL))
    assert r.relpath(DIGEST, cache_salt="s1") == f"meta-llama-SEP-Llama-3.1-8B@0x01000100@0@{DIGEST.hex()}@s1.data"


# --- local_disk (§2.1, §3.5) ----------------------------------------------------------------

LD_NAME = "meta-llama-Llama-3.1-8B@2@1@-1a2b3c@bfloat16.pt"
FS_NAME = "meta-llama-SEP-Llama-3.1-8B@2@1@-1a2b3c@bfloat16.data"
GDS_REL = "-1/71/meta-llama%2FLlama-3.1-8B%402%401%40-1a2b3c%40bfloat16.kvcache.safetensors"


def test_local_disk_live_engine_reads_the_raw_payload(tmp_path):
    """The process that wrote the .pt (its in-memory index holds it): raw bytes, no header."""
    data = put(tmp_path / LD_NAME, payload(FULL)).read_bytes()
    got = LMCacheReader(tmp_path, "local_disk", dep(world_size=2, worker_id=1, restarted=False)).lookup(H)
    assert got.found and got.payload == data
    assert (got.shape, got.dtype, got.fmt) == ((2, L, T, HID), "bfloat16", 1)


def test_local_disk_after_a_restart_is_index_lost_even_at_its_exact_name(tmp_path):
    put(tmp_path / LD_NAME, payload(FULL))
    r = LMCacheReader(tmp_path, "local_disk", dep(world_size=2, worker_id=1))
    got = r.lookup(H)
    assert not got.found and got.why == "index_lost" and got.path == tmp_path / LD_NAME
    assert r.lookup(H + 1).why == "absent"


def test_local_disk_name_is_lossy_two_models_share_one_file(tmp_path):
    """§1.3: `/` -> `-` is never reversed; `meta-llama-Llama-3.1-8B` opens the same .pt."""
    data = put(tmp_path / LD_NAME, payload(FULL)).read_bytes()
    other = dep(model="meta-llama-Llama-3.1-8B", world_size=2, worker_id=1, restarted=False)
    got = LMCacheReader(tmp_path, "local_disk", other).lookup(H)
    assert got.found and got.payload == data and got.key == "meta-llama-Llama-3.1-8B@2@1@-1a2b3c@bfloat16"

# --- fs (§2.2) -------------------------------------------------------------------------------

def test_fs_with_header_returns_the_payload_after_28_bytes(tmp_path):
    data = payload(FULL)
    put(tmp_path / FS_NAME, fs_header(FULL) + data)
    got = LMCacheReader(tmp_path, "fs", dep(world_size=2, worker_id=1)).lookup(H)
    assert got.found and got.payload == data
    assert (got.shape, got.dtype, got.fmt) == ((2, L, T, HID), "bfloat16", 1)


def test_fs_header_of_the_notes_deepseek_example(tmp_path):
    """R1 §2.2: 00801201 06000000 03000000 01000000 3d000000 00010000 40020000 = 17989632 B,
    fmt 6, bf16, [1, 61, 256, 576] (the payload here is a sparse file of zeros)."""
    header = bytes.fromhex("00801201060000000300000001000000" "3d0000000001000040020000")
    path = put(tmp_path / "deepseek-ai-SEP-DeepSeek-V3@1@0@-1a2b3c@bfloat16.data", header)
    with open(path, "r+b") as f:
        f.truncate(28 + 17989632)
    d = Deployment("deepseek-ai/DeepSeek-V3", world_size=8, worker_id=3, mla=True, layers=61, hidden=576)
    got = LMCacheReader(tmp_path, "fs", d).lookup(H)
    assert got.found and len(got.payload) == 17989632 and (got.shape, got.fmt) == ((1, 61, 256, 576), 6)


@pytest.mark.parametrize("length, why", [(FULL + 64, "short"), (FULL - 64, "size_mismatch")])
def test_fs_header_length_disagreeing_with_the_file(tmp_path, length, why):
    """§2.4: the file holds less than the header says (a torn write) -> short; more -> size_mismatch."""
    put(tmp_path / FS_NAME, fs_header(length, shape=(2, L, length // (2 * L * HID * 2), HID)) + payload(FULL))
    got = LMCacheReader(tmp_path, "fs", dep(world_size=2, worker_id=1)).lookup(H)
    assert not got.found and got.why == why


def test_fs_file_shorter_than_its_header_is_short(tmp_path):
    put(tmp_path / FS_NAME, fs_header(FULL)[:20])
    assert LMCacheReader(tmp_path, "fs", dep(world_size=2, worker_id=1)).lookup(H).why == "short"


@pytest.mark.parametrize("header", [
    fs_header(FULL, code=2),  # float16 where the key says bfloat16
    fs_header(FULL, fmt=6),  # an MLA chunk for a non-MLA deployment
    fs_header(FULL, fmt=4),  # BINARY: not a KV payload
    fs_header(FULL, shape=(2, L, T, HID * 2)),  # shape x 2 B != length
    fs_header(FULL, shape=(2, L, T * 2, HID // 2)),  # bytes agree, the hidden size does not
], ids=["dtype", "mla-fmt", "binary-fmt", "shape-length", "geometry"])
def test_fs_header_contradicting_the_key_or_itself_is_header_invalid(tmp_path, header):
    put(tmp_path / FS_NAME, header + payload(FULL))
    got = LMCacheReader(tmp_path, "fs", dep(world_size=2, worker_id=1)).lookup(H)
    assert not got.found and got.why == "header_invalid"


def test_fs_dtype_code_1_reads_as_float16(tmp_path):
    name = "meta-llama-SEP-Llama-3.1-8B@1@0@-1a2b3c@half.data"
    put(tmp_path / name, fs_header(FULL, code=1) + payload(FULL))
    got = LMCacheReader(tmp_path, "fs", dep(dtype="float16")).lookup(H)
    assert got.found and got.dtype == "float16"


def test_fs_without_header_reads_the_raw_payload_and_rejects_a_headed_file(tmp_path):
    data = payload(FULL)
    put(tmp_path / FS_NAME, data)
    got = LMCacheReader(tmp_path, "fs", dep(world_size=2, worker_id=1, save_chunk_meta=False)).lookup(H)
    assert got.found and got.payload == data and got.shape == (2, L, T, HID)
    put(tmp_path / FS_NAME, fs_header(FULL) + data)  # 28 bytes more: not a whole number of tokens
    assert LMCacheReader(tmp_path, "fs", dep(world_size=2, worker_id=1, save_chunk_meta=False)).lookup(H).why == \
        "size_mismatch"


def test_fs_header_expected_but_absent_is_refused(tmp_path):
    """No magic: raw bytes are read as a header; here their `length` (875374111) exceeds the file."""
    put(tmp_path / FS_NAME, payload(FULL))
    got = LMCacheReader(tmp_path, "fs", dep(world_size=2, worker_id=1)).lookup(H)
    assert not got.found and got.why == "short"


def test_raw_partial_chunk_is_short_unless_save_unfull_chunk(tmp_path):
    part = payload(FULL // T * 3)  # 3 of 4 tokens
    put(tmp_path / FS_NAME, part)
    d = {"world_size": 2, "worker_id": 1, "save_chunk_meta": False}
    assert LMCacheReader(tmp_path, "fs", dep(**d)).lookup(H).why == "short"
    got = LMCacheReader(tmp_path, "fs", dep(**d, save_unfull_chunk=True)).lookup(H)
    assert got.found and got.shape == (2, L, 3, HID) and got.payload == part


def test_fs_base_path_is_abs_hash_mod_n(tmp_path):
    bases = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    data = payload(FULL)
    put(bases[abs(H) % 3] / FS_NAME, fs_header(FULL) + data)  # 1715004 % 3 == 0
    got = LMCacheReader(bases, "fs", dep(world_size=2, worker_id=1)).lookup(H)
    assert got.found and got.path == bases[0] / FS_NAME and got.payload == data
    assert not LMCacheReader(bases[1:], "fs", dep(world_size=2, worker_id=1)).lookup(H).found


@pytest.mark.parametrize("name", [
    "vllm@meta-llama-SEP-Llama-3.1-8B@2@1@-1a2b3c@bfloat16.data",  # lmc-k2 (0.3.9.post2-0.3.12)
    "vllm@meta-llama-SEP-Llama-3.1-8B@2@1@-1a2b3c.data",  # lmc-k1
    "meta-llama-Llama-3.1-8B@2@1@-1a2b3c@bfloat16.data",  # `-` for `/` (before 0.3.10)
    "meta-llama-SEP-Llama-3.1-8B@2@1@-00000000001a2b3c@bfloat16.data",  # zero-padded hash
    "meta-llama-SEP-Llama-3.1-8B@2@1@1a2b3c@bfloat16.data",  # sign dropped
    "meta-llama-SEP-Llama-3.1-8B@2@1@-1A2B3C@bfloat16.data",  # upper case
    "meta-llama-SEP-Llama-3.1-8B@2@1@-1a2b3c@fp8_e4m3.data",  # another dtype spelling
])
def test_fs_wrong_era_or_wrong_spelling_is_not_found(tmp_path, name):
    put(tmp_path / name, fs_header(FULL) + payload(FULL))
    got = LMCacheReader(tmp_path, "fs", dep(world_size=2, worker_id=1)).lookup(H)
    assert not got.found and got.why == "absent"
    put(tmp_path / FS_NAME, fs_header(FULL) + payload(FULL))
    assert LMCacheReader(tmp_path, "fs", dep(world_size=2, worker_id=1)).lookup(H).found


# --- GDS (§2.3) ------------------------------------------------------------------------------

def gds_pair(tier: Path, rel: str, data: bytes, header: bytes | None = None, *, sidecar: bool = True) -> None:
    header = gds_header(len(data)) if header is None else header
    put(tier / rel, header + data)
    if sidecar:
        put(tier / f"{rel}.metadata", header)


def test_gds_header_bytes_are_the_notes_layout():
    """The builder above against the spec's words: 4096 B, <Q 4088, default separators, key order."""
    h = gds_header(FULL)
    assert len(h) == 4096 and h[:8] == (4088).to_bytes(8, "little") and h.endswith(b" ")
    assert h[8:].rstrip(b" ") == (b'{"kvcache": {"dtype": "BF16", "shape": [2, 2, 4, 8], "data_offsets": [0, 256], '
                                  b'"fmt": 1, "__metadata__": {"lmcache_version": "1"}}}')


def test_gds_chunk_is_found_through_its_sidecar_payload_at_4096(tmp_path):
    data = payload(FULL)
    gds_pair(tmp_path, GDS_REL, data)
    got = LMCacheReader(tmp_path, "gds", dep(world_size=2, worker_id=1)).lookup(H)
    assert got.found and got.payload == data and got.path == tmp_path / GDS_REL
    assert (got.shape, got.dtype, got.fmt) == ((2, L, T, HID), "bfloat16", 1)


def test_gds_data_file_without_sidecar_is_never_found(tmp_path):
    gds_pair(tmp_path, GDS_REL, payload(FULL), sidecar=False)
    got = LMCacheReader(tmp_path, "gds", dep(world_size=2, worker_id=1)).lookup(H)
    assert not got.found and got.why == "orphan_data"
    assert LMCacheReader(tmp_path, "gds", dep(world_size=2, worker_id=0)).lookup(H).why == "absent"


@pytest.mark.parametrize("sidecar", [
    bytes(4096),  # zero-filled: JSON does not parse
    gds_header(FULL)[:2000],  # torn
    gds_header(FULL + 64),  # parses, but is not the data file's header
    gds_header(FULL).replace(b'"lmcache_version": "1"', b'"lmcache_version": "2"'),  # unsupported version
], ids=["zeros", "torn", "differs", "version"])
def test_gds_corrupt_sidecar_is_not_found(tmp_path, sidecar):
    gds_pair(tmp_path, GDS_REL, payload(FULL))
    put(tmp_path / f"{GDS_REL}.metadata", sidecar)
    got = LMCacheReader(tmp_path, "gds", dep(world_size=2, worker_id=1)).lookup(H)
    assert not got.found and got.why == "corrupt_sidecar"


def test_gds_sidecar_without_data_file_is_absent(tmp_path):
    put(tmp_path / f"{GDS_REL}.metadata", gds_header(FULL))
    got = LMCacheReader(tmp_path, "gds", dep(world_size=2, worker_id=1)).lookup(H)
    assert not got.found and got.why == "absent"


@pytest.mark.parametrize("header", [
    gds_header(FULL, dtype="F16"),
    gds_header(FULL, fmt=6),
    gds_header(FULL, shape=[2, L, T, HID * 2]),
], ids=["dtype", "fmt", "shape"])
def test_gds_header_contradicting_the_key_is_header_invalid(tmp_path, header):
    gds_pair(tmp_path, GDS_REL, payload(FULL), header)
    assert LMCacheReader(tmp_path, "gds", dep(world_size=2, worker_id=1)).lookup(H).why == "header_invalid"


@pytest.mark.parametrize("cut, why", [(64, "short"), (-64, "size_mismatch")])
def test_gds_data_size_against_data_offsets(tmp_path, cut, why):
    """§2.4: size == 4096 + data_offsets[1]; a torn data file is short, a longer one size_mismatch."""
    data = payload(FULL)
    gds_pair(tmp_path, GDS_REL, data[:FULL - cut] if cut > 0 else data + payload(-cut), gds_header(FULL))
    assert LMCacheReader(tmp_path, "gds", dep(world_size=2, worker_id=1)).lookup(H).why == why


@pytest.mark.parametrize("rel", [
    "-1/71/meta-llama_Llama-3.1-8B@2@1@-1a2b3c@bfloat16.kvcache.safetensors",  # <= 0.4.2 `_` name
    "-1/a2/meta-llama%2FLlama-3.1-8B%402%401%40-1a2b3c%40bfloat16.kvcache.safetensors",  # folders from the hex
    "17/15/meta-llama%2FLlama-3.1-8B%402%401%40-1a2b3c%40bfloat16.kvcache.safetensors",  # sign dropped
    "meta-llama%2FLlama-3.1-8B%402%401%40-1a2b3c%40bfloat16.kvcache.safetensors",  # no folders
    "-1/71/meta-llama%2FLlama-3.1-8B%402%401%40-1a2b3c%40bfloat16.weka1",  # wekafs suffix elsewhere
])
def test_gds_other_eras_and_folders_are_not_found(tmp_path, rel):
    gds_pair(tmp_path, rel, payload(FULL))
    got = LMCacheReader(tmp_path, "gds", dep(world_size=2, worker_id=1)).lookup(H)
    assert not got.found and got.why == "absent"


# --- MLA aliasing (§3.1) ---------------------------------------------------------------------

MLA_FS_W0 = "meta-llama-SEP-Llama-3.1-8B@2@0@-1a2b3c@bfloat16.data"
MLA_GDS_W0 = "-1/71/meta-llama%2FLlama-3.1-8B%402%400%40-1a2b3c%40bfloat16.kvcache.safetensors"
MLA_GDS_W1 = "-1/71/meta-llama%2FLlama-3.1-8B%402%401%40-1a2b3c%40bfloat16.kvcache.safetensors"


def mla(**kw) -> Deployment:
    return dep(mla=True, save_only_first_rank=False, world_size=2, **kw)


def test_mla_rank_1_on_fs_is_aliased_to_worker_0(tmp_path):
    """remote_enable_mla_worker_id_as0 (default on for MLA): rank 1 looks up @2@0@ and finds rank 0's copy."""
    data = payload(MLA_FULL, seed=5)
    put(tmp_path / MLA_FS_W0, fs_header(MLA_FULL, fmt=6, shape=(1, L, T, HID)) + data)
    got = LMCacheReader(tmp_path, "fs", mla(worker_id=1)).lookup(H)
    assert got.found and got.path == tmp_path / MLA_FS_W0 and got.payload == data and got.shape == (1, L, T, HID)
    off = LMCacheReader(tmp_path, "fs", mla(worker_id=1, remote_enable_mla_worker_id_as0=False)).lookup(H)
    assert not off.found and off.relpath == "meta-llama-SEP-Llama-3.1-8B@2@1@-1a2b3c@bfloat16.data"


def test_mla_rank_1_on_gds_is_not_aliased(tmp_path):
    """GDS has no aliasing: every rank writes and looks up its own copy."""
    data = payload(MLA_FULL, seed=5)
    mla_header = gds_header(MLA_FULL, shape=[1, L, T, HID], fmt=6)
    gds_pair(tmp_path, MLA_GDS_W0, data, mla_header)
    assert LMCacheReader(tmp_path, "gds", mla(worker_id=0)).lookup(H).found
    got = LMCacheReader(tmp_path, "gds", mla(worker_id=1)).lookup(H)
    assert not got.found and got.why == "absent" and got.relpath == MLA_GDS_W1
    gds_pair(tmp_path, MLA_GDS_W1, data, mla_header)
    assert LMCacheReader(tmp_path, "gds", mla(worker_id=1)).lookup(H).payload == data


def test_mla_save_only_first_rank_every_rank_reads_the_1_0_file(tmp_path):
    data = payload(MLA_FULL, seed=7)
    put(tmp_path / "meta-llama-SEP-Llama-3.1-8B@1@0@-1a2b3c@bfloat16.data",
        fs_header(MLA_FULL, fmt=6, shape=(1, L, T, HID)) + data)
    for rank in range(4):
        got = LMCacheReader(tmp_path, "fs", dep(mla=True, world_size=4, worker_id=rank)).lookup(H)
        assert got.found and got.payload == data


# --- MP (§1.2, §2.1) -------------------------------------------------------------------------

def test_mp_non_mla_rank_reads_its_own_raw_object(tmp_path):
    r0, r1 = payload(FULL, seed=2), payload(FULL, seed=3)
    put(tmp_path / f"meta-llama-SEP-Llama-3.1-8B@0x02000200@0@{DIGEST.hex()}.data", r0)
    put(tmp_path / f"meta-llama-SEP-Llama-3.1-8B@0x02010201@0@{DIGEST.hex()}.data", r1)
    for rank, want in ((0, r0), (1, r1)):
        got = LMCacheReader(tmp_path, "mp", dep(world_size=2, worker_id=rank)).lookup(DIGEST)
        assert got.found and got.payload == want and got.shape == (2, L, T, HID)


def test_mp_mla_object_serves_every_tp(tmp_path):
    data = payload(MLA_FULL, seed=9)
    put(tmp_path / f"meta-llama-SEP-Llama-3.1-8B@0x01000100@0@{DIGEST.hex()}.data", data)
    for tp in (1, 2, 4):
        for rank in range(tp):
            got = LMCacheReader(tmp_path, "mp", dep(mla=True, world_size=tp, worker_id=rank)).lookup(DIGEST)
            assert got.found and got.payload == data and (got.shape, got.fmt) == ((1, L, T, HID), 6)


def test_mp_object_of_another_size_is_refused(tmp_path):
    put(tmp_path / f"meta-llama-SEP-Llama-3.1-8B@0x01000100@0@{DIGEST.hex()}.data", payload(FULL + 10))
    assert LMCacheReader(tmp_path, "mp", dep()).lookup(DIGEST).why == "size_mismatch"
