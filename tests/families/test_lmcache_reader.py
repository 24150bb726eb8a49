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
