"""vllm.cpp: the 28-key CacheIdentity and the 128-byte block header (formats.md §2.1).

The engine checks a header in a fixed order (magic, key_size, version, digest,
payload_size, key) and deletes the file on the first mismatch; `verify_header` reports
the first failing check by that name so a finding says exactly why the engine would
refuse the file.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

MAGIC = b"VLCPPKV1"
HEADER_SIZE = 128
FORMAT_VERSION = 1
KEY_SIZE = 36
MAX_KEY_SIZE = 64
_HEADER = struct.Struct("<8sIIQ32s64s8s")
assert _HEADER.size == HEADER_SIZE

# key -> JSON type ("int", "str", "list") and Validate() rule ("nonempty", "positive", None)
IDENTITY_KEYS: dict[str, tuple[str, str | None]] = {
    "architectures": ("list", "nonempty"),
    "block_size": ("int", "positive"),
    "checkpoint_fingerprint": ("str", None),
    "dcp_size": ("int", None),
    "format_version": ("int", None),
    "hash_algo": ("str", "nonempty"),
    "hash_block_size": ("int", "positive"),
    "head_size": ("int", "positive"),
    "head_size_v": ("int", None),
    "hf_config_digest": ("str", "nonempty"),
    "inference_engine": ("str", "nonempty"),
    "kv_cache_spec_kind": ("str", "nonempty"),
    "kv_dtype": ("str", "nonempty"),
    "kv_quant_mode": ("str", "nonempty"),
    "max_position_embeddings": ("int", None),
    "model_name": ("str", "nonempty"),
    "model_type": ("str", "nonempty"),
    "none_hash_hex": ("str", "nonempty"),
    "num_hidden_layers": ("int", "positive"),
    "num_kv_heads": ("int", "positive"),
    "page_size_bytes": ("int", "positive"),
    "pcp_size": ("int", None),
    "pp_size": ("int", None),
    "rank": ("int", None),
    "rope_config": ("str", None),
    "sliding_window": ("int", None),
    "tp_size": ("int", None),
    "weight_quantization": ("str", "nonempty"),
}
assert len(IDENTITY_KEYS) == 28
SPEC_KINDS = ("full_attention", "mla", "sliding_window", "chunked_local_attention", "mamba")
# Optional key a replicated (collapsed) target identity adds; the only bool allowed.
OPTIONAL_KEYS = {"replicated_layout": "bool"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_identity(identity: dict[str, Any]) -> list[str]:
    """Problems that make the engine refuse the identity (empty list: valid).

    Mirrors CacheIdentity::Validate plus the type rules of the canonical form (integers
    stay ints, never bool/float).
    """
    problems: list[str] = []
    for key, (kind, rule) in IDENTITY_KEYS.items():
        if key not in identity:
            problems.append(f"missing key '{key}'")
            continue
        v = identity[key]
        if kind == "int" and not _is_int(v):
            problems.append(f"'{key}' must be an integer, got {type(v).__name__}")
            continue
        if kind == "str" and not isinstance(v, str):
            problems.append(f"'{key}' must be a string, got {type(v).__name__}")
            continue
        if kind == "list" and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            problems.append(f"'{key}' must be a list of strings")
            continue
        if rule == "nonempty" and len(v) == 0:
            problems.append(f"'{key}' must not be empty")
        if rule == "positive" and v <= 0:
            problems.append(f"'{key}' must be > 0, got {v}")
    if "replicated_layout" in identity and identity["replicated_layout"] is not True:
        problems.append("'replicated_layout' may only be written as true")
    if _is_int(identity.get("format_version")) and not 0 <= identity["format_version"] < 2**32:
        problems.append("'format_version' must fit in u32")
    try:  # the canonical form is UTF-8: a lone surrogate escape ("\ud800") cannot be hashed
        json.dumps(identity, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        problems.append("a string holds a lone UTF-16 surrogate escape (not UTF-8): the engine never writes one")
    return problems


def make_key(block_hash: bytes, group: int) -> bytes:
    """OffloadKey: the block hash followed by the group id as 4 big-endian bytes."""
    return block_hash + group.to_bytes(4, "big")


@dataclass(frozen=True)
class Header:
    magic: bytes
    format_version: int
    key_size: int
    payload_size: int
    digest: bytes  # 32 raw bytes
    key_field: bytes  # all 64 bytes of the key area
    reserved: bytes

    @property
    def key(self) -> bytes:
        return self.key_field[: min(self.key_size, MAX_KEY_SIZE)]


def encode_header(digest: bytes, key: bytes, payload_size: int, format_version: int = FORMAT_VERSION) -> bytes:
    """Header bytes as the engine writes them (key zero-padded to 64, reserved zero)."""
    if len(digest) != 32:
        raise ValueError("identity digest must be 32 raw bytes")
    if len(key) > MAX_KEY_SIZE:
        raise ValueError("key longer than 64 bytes")
    return _HEADER.pack(MAGIC, format_version, len(key), payload_size, digest, key.ljust(64, b"\0"), b"\0" * 8)


def decode_header(data: bytes) -> Header:
    """Unpack the first 128 bytes (raises ValueError when shorter)."""
    if len(data) < HEADER_SIZE:
        raise ValueError(f"short header: {len(data)} bytes")
    magic, ver, key_size, payload, digest, key_field, reserved = _HEADER.unpack_from(data)
    return Header(magic, ver, key_size, payload, digest, key_field, reserved)


def verify_header(data: bytes, *, digest: bytes, payload_size: int, key: bytes,
                  format_version: int = FORMAT_VERSION) -> str | None:
    """Name of the first check the engine's reader would fail, in its order, or None.

    Check names: short, magic, key_size, format_version, digest, payload_size, key.
    """
    if len(data) < HEADER_SIZE:
        return "short"
    h = decode_header(data)
    if h.magic != MAGIC:
        return "magic"
    if h.key_size > MAX_KEY_SIZE:
        return "key_size"
    if h.format_version != format_version:
        return "format_version"
    if h.digest != digest:
        return "digest"
    if h.payload_size != payload_size:
        return "payload_size"
    if h.key != key:
        return "key"
    return None


def rewrite_header(data: bytes, new_digest: bytes) -> bytes:
    """A new header with only the identity digest changed (for rewrite_header actions)."""
    h = decode_header(data)
    return _HEADER.pack(h.magic, h.format_version, h.key_size, h.payload_size, new_digest, h.key_field, h.reserved)
