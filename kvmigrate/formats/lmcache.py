"""LMCache disk tiers: the one grammar of names, headers and sizes (spec lmcache.md §1-§2).

Every name LMCache writes is `CacheEngineKey.to_string()` (or an MP object key) put
through a backend's own path rule; nothing is escaped, so a name is decoded only by the
rule of its backend and never by guess (lmcache.md §8). The parsers here return None for
anything they do not recognise, never raise, so a scan may call them on any file name.
The synth (kvmigrate/synth/lmcache.py) writes every name and header through this module,
so the grammar exists once.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

# --- §1.2 keys -------------------------------------------------------------------------

SCHEMES = ("lmc-k1", "lmc-k2", "lmc-k3", "lmc-mp1")
BACKENDS = ("local_disk", "fs", "gds", "mp")
FMT_NAMES = ("vllm", "sgl")  # the k1/k2 leading field: which engine wrote the key

# TORCH_DTYPE_TO_STR_DTYPE (R1 §1.2) plus the 0.3.9.post2-0.3.13 fp8 names -> element bytes
DTYPE_BYTES = {
    "half": 2, "bfloat16": 2, "float": 4, "double": 8, "uint8": 1, "int8": 1, "int16": 2, "int32": 4,
    "int64": 8, "bool": 1, "fp8_e4m3fn": 1, "fp8_e4m3fnuz": 1, "fp8_e5m2": 1, "fp8_e5m2fnuz": 1, "fp8_e4m3": 1,
}
DTYPES = tuple(DTYPE_BYTES)
# a torch dtype name (a `model_dtype` fact) -> the key's spelling (TORCH_DTYPE_TO_STR_DTYPE)
KEY_DTYPE_OF_TORCH = {"bfloat16": "bfloat16", "float16": "half", "half": "half", "float32": "float", "float": "float"}

# MemoryFormat (0.3.1+, §2.1)
KV_2LTD, KV_T2D, KV_2TD, BINARY, BINARY_BUFFER, KV_MLA_FMT = 1, 2, 3, 4, 5, 6
KV_FORMATS = (KV_2LTD, KV_MLA_FMT)  # the payloads kvmigrate reads; others are unsupported_layout

MP_DCP_MARK = "##lmcache-dcp-layout-v1-"  # MP model suffix with DCP > 1 (R2 §3.6)

_SIGNED_HEX = re.compile(r"-?[0-9a-f]{1,16}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_DECIMAL = re.compile(r"-?[0-9]{1,20}")
_UINT = re.compile(r"0|[1-9][0-9]*")
_KV_RANK = re.compile(r"0x[0-9a-f]{8,}")
_GROUP = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True, slots=True)
class Key:
    """One parsed key string (§1.2). `hash` is the field exactly as written (signed,
    unpadded hex; 64 hex for a digest; k1 may hold a decimal). MP keys fill kv_rank, group
    and salt, and `ws`/`wid` are the kv world size and global rank taken from kv_rank."""

    scheme: str
    model: str
    ws: int
    wid: int
    hash: str
    dtype: str | None = None  # None for k1 and MP (not in the name)
    tags: tuple[tuple[str, str], ...] = ()
    fmt: str | None = None  # "vllm"/"sgl" for k1/k2
    layer: int | None = None  # a layerwise k3 key (unsupported_layout, §0)
    kv_rank: int | None = None
    group: int | None = None
    salt: str | None = None

    @property
    def hash_kind(self) -> str:
        """"hex64" (a digest: 0.3.0-0.3.2 or a 0.3.13-0.4.5 bytes hash, stale by name, §3.2),
        "hex" (a signed int), or "decimal" (a k1 name that only a decimal reading fits)."""
        if _HEX64.fullmatch(self.hash):
            return "hex64"
        if _SIGNED_HEX.fullmatch(self.hash):
            return "hex"
        return "decimal"

    @property
    def chunk_hash(self) -> int | None:
        """The int the writer hashed to, where the name proves it: a signed hex field of a
        k2/k3 key (k1's field may be decimal; a digest is bytes, not an int)."""
        if self.scheme in ("lmc-k2", "lmc-k3") and self.hash_kind == "hex":
            return int(self.hash, 16)
        return None

    @property
    def local_ws(self) -> int | None:
        return None if self.kv_rank is None else (self.kv_rank >> 8) & 0xFF

    @property
    def local_rank(self) -> int | None:
        return None if self.kv_rank is None else self.kv_rank & 0xFF


def kv_rank(ws: int, rank: int, local_ws: int | None = None, local_rank: int | None = None) -> int:
    """MP kv_rank = ws<<24 | global_rank<<16 | local_ws<<8 | local_rank (§1.2); a single
    node has local_ws = ws and local_rank = rank."""
    lws = ws if local_ws is None else local_ws
    lr = rank if local_rank is None else local_rank
    return ws << 24 | rank << 16 | lws << 8 | lr


def hash_hex(h: int) -> str:
    """`f"{h:x}"` of a Python int: lowercase, signed, never zero-padded (§1.2, §9.3)."""
    return f"{h:x}"


def format_key(key: Key) -> str:
    """`CacheEngineKey.to_string()` of the key's era (§1.2), or the MP object key."""
    if key.scheme == "lmc-mp1":
        rank = key.kv_rank if key.kv_rank is not None else kv_rank(key.ws, key.wid)
        s = f"{key.model}@0x{rank:08x}@{key.group or 0:x}@{key.hash}"
        return s + (f"@{key.salt}" if key.salt else "")
    fields = [key.model, str(key.ws), str(key.wid), key.hash]
    if key.scheme in ("lmc-k1", "lmc-k2"):
        fields.insert(0, key.fmt or "vllm")
    if key.scheme != "lmc-k1":
        fields.append(key.dtype or "")
    if key.layer is not None:
        fields.append(str(key.layer))
    fields += [f"{k}%{v}" for k, v in key.tags]
    return "@".join(fields)


def _tags(parts: list[str]) -> tuple[tuple[str, str], ...] | None:
    out = []
    for p in parts:
        name, sep, value = p.partition("%")
        if not sep or not name:
            return None
        out.append((name, value))
    return tuple(out)


def _ints(*fields: str) -> list[int] | None:
    if all(_UINT.fullmatch(f) for f in fields):
        return [int(f) for f in fields]
    return None


def _parse_k3(parts: list[str]) -> Key | None:
    if len(parts) < 5 or not parts[0]:
        return None
    nums = _ints(parts[1], parts[2])
    h = parts[3]
    if nums is None or parts[4] not in DTYPE_BYTES or not (_SIGNED_HEX.fullmatch(h) or _HEX64.fullmatch(h)):
        return None
    rest = parts[5:]
    layer = None
    if rest and rest[0].isdigit():  # parse_cache_key: parts[5].isdigit() is a layerwise key
        layer, rest = int(rest[0]), rest[1:]
    tags = _tags(rest)
    if tags is None:
        return None
    return Key("lmc-k3", parts[0], nums[0], nums[1], h, parts[4], tags, layer=layer)


def _parse_legacy(parts: list[str]) -> Key | None:
    if len(parts) < 5 or parts[0] not in FMT_NAMES or not parts[1]:
        return None
    nums = _ints(parts[2], parts[3])
    h = parts[4]
    if nums is None:
        return None
    if len(parts) > 5 and parts[5] in DTYPE_BYTES:  # k1 from k2 by the dtype field
        tags = _tags(parts[6:])
        if tags is None or not _SIGNED_HEX.fullmatch(h):
            return None
        return Key("lmc-k2", parts[1], nums[0], nums[1], h, parts[5], tags, fmt=parts[0])
    tags = _tags(parts[5:])
    if tags is None or not (_SIGNED_HEX.fullmatch(h) or _HEX64.fullmatch(h) or _DECIMAL.fullmatch(h)):
        return None
    return Key("lmc-k1", parts[1], nums[0], nums[1], h, None, tags, fmt=parts[0])


def _parse_mp(parts: list[str]) -> Key | None:
    if len(parts) not in (4, 5) or not parts[0]:
        return None
    if not (_KV_RANK.fullmatch(parts[1]) and _GROUP.fullmatch(parts[2]) and _HEX64.fullmatch(parts[3])):
        return None
    if len(parts) == 5 and not parts[4]:
        return None
    rank = int(parts[1], 16)
    return Key("lmc-mp1", parts[0], rank >> 24, (rank >> 16) & 0xFF, parts[3], kv_rank=rank,
               group=int(parts[2], 16), salt=parts[4] if len(parts) == 5 else None)


def parse_key(s: str) -> Key | None:
    """A key string of any era (§1.2), or None. k1/k2 are told from k3 by which fields are
    integers (a model named `vllm` is possible), k1 from k2 by the dtype field; MP keys
    by their `0x` kv_rank. An `@` inside a model or tag makes a name unparseable (§0)."""
    parts = s.split("@")
    if len(parts) >= 2 and parts[1].startswith("0x"):
        return _parse_mp(parts)
    return _parse_k3(parts) or _parse_legacy(parts)


def mp_dcp(model: str) -> tuple[int, int] | None:
    """(dcp, interleave) of an MP model ending `##lmcache-dcp-layout-v1-d<d>-interleave<n>`."""
    m = re.search(r"##lmcache-dcp-layout-v1-d(\d+)-interleave(\d+)$", model)
    return (int(m.group(1)), int(m.group(2))) if m else None


# --- §1.3 file names ---------------------------------------------------------------------

SUFFIXES = {"local_disk": ".pt", "fs": ".data", "mp": ".data"}
GDS_SUFFIXES = (".kvcache.safetensors", ".weka1")  # .weka1 on wekafs
SIDECAR = ".metadata"
FS_SEP = "-SEP-"  # fs 0.3.10+ and MP: `/` in the key


@dataclass(frozen=True, slots=True)
class ChunkName:
    """A parsed chunk file name. `key.model` is the model as the name allows it to be
    read: exact for fs (`-SEP-`), GDS and MP; as written for local_disk (and old fs `-`
    names), where `model_exact` is False and the model is only matched (§1.3)."""

    backend: str
    key: Key
    suffix: str
    sidecar: bool = False  # a GDS `<data>.metadata`
    quoted: bool | None = None  # GDS: True 0.4.3+ (`%40`), False the ≤ 0.4.2 `_` name
    model_exact: bool = True

    @property
    def data_name(self) -> str:
        """The data file's name (a sidecar's without `.metadata`)."""
        return file_name(self.key, self.backend, gds_quoted=bool(self.quoted), suffix=self.suffix,
                         fs_sep=FS_SEP if self.model_exact else "-")


def file_name(key: Key, backend: str, *, gds_quoted: bool = True, suffix: str | None = None,
              fs_sep: str = FS_SEP, sidecar: bool = False) -> str:
    """The file name `backend` gives `key` (§1.3): local_disk `/`→`-` + `.pt`; fs `/`→`-SEP-`
    (0.3.10+; `-` before) + `.data`; GDS quoted (0.4.3+) or `/`→`_` (≤ 0.4.2) +
    `.kvcache.safetensors`/`.weka1` (+ `.metadata` for the sidecar); MP `/`→`-SEP-` + `.data`."""
    s = format_key(key)
    if backend == "local_disk":
        return s.replace("/", "-") + ".pt"
    if backend == "fs":
        return s.replace("/", fs_sep) + ".data"
    if backend == "mp":
        return s.replace("/", FS_SEP) + ".data"
    if backend == "gds":
        name = quote(s, safe="") if gds_quoted else s.replace("/", "_")
        return name + (suffix or GDS_SUFFIXES[0]) + (SIDECAR if sidecar else "")
    raise ValueError(f"unknown LMCache backend {backend!r}")


def fs_base_index(key: Key, n: int) -> int | None:
    """Which of `n` fs base paths holds the chunk: `base_paths[abs(hash) % n]`, the same
    for every rank (§1.3); None where the name proves no int."""
    h = key.chunk_hash
    return None if h is None or n < 1 else abs(h) % n


def gds_folders(key: Key) -> tuple[str, str] | None:
    """GDS `<s[:2]>/<s[2:4]>` from the **decimal** string of the signed hash int (§1.3,
    §9.4: `-3/80/…` for a negative hash), not from the hex. None where the name proves
    no int (a digest's folders come from `str(bytes)` and are not checked; k1's field
    may be decimal)."""
    h = key.chunk_hash
    return None if h is None else gds_int_folders(h)


def gds_int_folders(chunk_hash: int) -> tuple[str, str]:
    """The folders GdsBackend derives from a chunk hash int: `s = str(h)`, `s[:2]`, `s[2:4]`."""
    s = str(chunk_hash)
    return s[:2], s[2:4]


def gds_relpath(key: Key, *, gds_quoted: bool = True, suffix: str | None = None, sidecar: bool = False,
                chunk_hash: int | None = None) -> str:
    """`<2>/<2>/<name>` inside a GDS tier. `chunk_hash` is the int the writer held when the
    name alone does not prove it (a k1 signed-hex key of 0.3.6+); with neither, the file
    sits at the tier's top (a digest's `str(bytes)` folders are never written here)."""
    name = file_name(key, "gds", gds_quoted=gds_quoted, suffix=suffix, sidecar=sidecar)
    h = key.chunk_hash if chunk_hash is None else chunk_hash
    if h is None:
        return name
    return "/".join(p for p in (*gds_int_folders(h), name) if p)


def relpath_in_tier(key: Key, backend: str, **kw: Any) -> str:
    """Path of a chunk inside its tier directory (§1.3, §3.6)."""
    if backend == "gds":
        return gds_relpath(key, **kw)
    return file_name(key, backend, **{k: v for k, v in kw.items() if k == "fs_sep"})


def parse_name(name: str) -> ChunkName | None:
    """The chunk a file name holds, for any backend (§1.3), or None. The backend comes
    from the name itself (one folder may mix backends, §1.1): `.pt` local_disk; `.data`
    fs or, for an MP key, mp; a GDS suffix (± `.metadata`) gds."""
    if "/" in name:
        return None
    if name.endswith(".pt"):
        key = parse_key(name[:-3])
        if key is None or key.scheme == "lmc-mp1":
            return None
        return ChunkName("local_disk", key, ".pt", model_exact="-" not in key.model)
    if name.endswith(".data"):
        stem = name[:-5]
        exact = FS_SEP in stem
        key = parse_key(stem.replace(FS_SEP, "/"))
        if key is None:
            return None
        if key.scheme == "lmc-mp1":
            return ChunkName("mp", key, ".data")
        # without -SEP- the model had no `/`, or an old (≤ 0.3.9.post2) writer made it `-`
        return ChunkName("fs", key, ".data", model_exact=exact or key.scheme == "lmc-k3" or "-" not in key.model)
    sidecar = name.endswith(SIDECAR)
    base = name[: -len(SIDECAR)] if sidecar else name
    for suffix in GDS_SUFFIXES:
        if base.endswith(suffix):
            return _parse_gds(base[: -len(suffix)], suffix, sidecar)
    return None


def _parse_gds(stem: str, suffix: str, sidecar: bool) -> ChunkName | None:
    """A `%40` name is quoted (0.4.3+); a raw `@` one is the ≤ 0.4.2 `_` name whose `_`
    all stand for `/` (that writer asserted the key has no `_`, R2 §3.3)."""
    if "%40" in stem and "@" not in stem:
        key = parse_key(unquote(stem))
        if key is None or key.scheme == "lmc-mp1" or quote(format_key(key), safe="") != stem:
            return None
        return ChunkName("gds", key, suffix, sidecar, quoted=True)
    if "@" in stem:
        key = parse_key(stem.replace("_", "/"))
        if key is None or key.scheme == "lmc-mp1":
            return None
        return ChunkName("gds", key, suffix, sidecar, quoted=False)
    return None


def local_disk_model_matches(model: str, written: str) -> bool:
    """A local_disk name's model field `written` belongs to `model` (§1.3): matched, never decoded."""
    return model.replace("/", "-") == written


# --- §1.4 temp files ---------------------------------------------------------------------

_GDS_TMP = re.compile(r"(.+)\.tmp([0-9a-f]{8}|[A-Z0-9]{8})")


@dataclass(frozen=True)
class TempName:
    """A writer's temp file: its backend, the final name it was to become and, for GDS,
    which writer drew the suffix ("uuid" 0.4.3+, "legacy" ≤ 0.4.2, "either" when all digits)."""

    backend: str
    final: str
    draw: str | None = None


def fs_temp_name(final: str) -> str:
    """fs and MP: `Path.with_suffix(".tmp")` of the final name (`.data` replaced, §1.4)."""
    return final[: -len(".data")] + ".tmp" if final.endswith(".data") else final + ".tmp"


def gds_temp_name(final: str, token: str) -> str:
    """GDS: `<data>.tmp` + 8 chars (uuid4 hex 0.4.3+, `[A-Z0-9]` ≤ 0.4.2); sidecars alike."""
    return f"{final}.tmp{token}"


def parse_temp_name(name: str) -> TempName | None:
    """The temp file a writer leaves (§1.4), or None. local_disk has none. A file in the
    fs/MP `tmp_dir` keeps its final name: that is a fact about the folder, not the name."""
    if name.endswith(".tmp"):
        final = name[:-4] + ".data"
        parsed = parse_name(final)
        if parsed is not None and parsed.backend in ("fs", "mp"):
            return TempName(parsed.backend, final)
        return None
    m = _GDS_TMP.fullmatch(name)
    if m:
        parsed = parse_name(m.group(1))
        if parsed is not None and parsed.backend == "gds":
            token = m.group(2)
            draw = "either" if token.isdigit() else "uuid" if token == token.lower() else "legacy"
            return TempName("gds", m.group(1), draw)
    return None


# --- §2.1 payload geometry -----------------------------------------------------------------


def payload_shape(mla: bool, layers: int, tokens: int, hidden: int) -> tuple[int, int, int, int]:
    """KV_2LTD `[2, L, T, h·D]` (K half then V half) or KV_MLA_FMT `[1, L, T, W]` (§2.1)."""
    return (1 if mla else 2, layers, tokens, hidden)


def full_chunk_bytes(mla: bool, layers: int, tokens: int, hidden: int, dtype: str) -> int:
    """S = k·L·T·hidden·b (§2.4): the payload of a whole chunk (L includes draft layers)."""
    return (1 if mla else 2) * layers * tokens * hidden * DTYPE_BYTES[dtype]


def memory_format(mla: bool) -> int:
    return KV_MLA_FMT if mla else KV_2LTD


# --- §2.2 fs RemoteMetadata ---------------------------------------------------------------

# key dtype -> RemoteMetadata code (float16 2; 1 also reads as float16)
FS_DTYPE_CODES = {"half": 2, "bfloat16": 3, "float": 4, "double": 5, "uint8": 6, "fp8_e4m3fn": 7, "fp8_e5m2": 8}
_FS_CODE_DTYPES = {v: k for k, v in FS_DTYPE_CODES.items()} | {1: "half"}
FS_HEADER_ONE_GROUP = 28


def fs_header_size(groups: int = 1) -> int:
    """`2 + 5·G` int32: 28 bytes for one group (§2.2)."""
    return 4 * (2 + 5 * groups)


@dataclass(frozen=True)
class FsHeader:
    length: int  # payload bytes
    fmt: int
    groups: tuple[tuple[int, tuple[int, ...]], ...]  # (dtype_code, shape without zero padding)

    @property
    def dtype(self) -> str | None:
        """The key dtype of group 0's code (None: a code LMCache never writes)."""
        return _FS_CODE_DTYPES.get(self.groups[0][0]) if self.groups else None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.groups[0][1] if self.groups else ()


def encode_fs_header(length: int, fmt: int, dtype: str, shape: tuple[int, ...] | list[int]) -> bytes:
    """One group's RemoteMetadata: little-endian int32 length, fmt, dtype code, shape
    zero-padded to 4-D; no magic, no version (§2.2)."""
    padded = list(shape) + [0] * (4 - len(shape))
    return struct.pack("<7i", length, fmt, FS_DTYPE_CODES[dtype], *padded)


def decode_fs_header(data: bytes, groups: int = 1) -> FsHeader | None:
    """Read `groups` groups from the first bytes, or None when too short or a field is
    negative (an int32 header holds no negative length or dimension)."""
    size = fs_header_size(groups)
    if len(data) < size:
        return None
    ints = struct.unpack_from(f"<{2 + 5 * groups}i", data)
    if any(v < 0 for v in ints):
        return None
    out = []
    for g in range(groups):
        code, *shape = ints[2 + 5 * g: 7 + 5 * g]
        while shape and shape[-1] == 0:  # the reader strips the zero padding
            shape.pop()
        out.append((code, tuple(shape)))
    return FsHeader(ints[0], ints[1], tuple(out))


def _prod(shape: tuple[int, ...] | list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _fmt_problem(fmt: int, mla: bool | None) -> str | None:
    """A header's MemoryFormat against the KV formats and the model's kind (§2.4), or None."""
    if fmt not in KV_FORMATS:
        return f"fmt {fmt} is not a KV format"
    if mla is not None and fmt != memory_format(mla):
        return f"fmt {fmt} does not match the model's kind ({'MLA' if mla else 'non-MLA'})"
    return None


def fs_header_problem(h: FsHeader, dtype: str | None, mla: bool | None = None) -> str | None:
    """Why a decoded header contradicts itself or the key (§2.4 header_invalid), or None:
    unknown fmt or dtype code, a dtype other than the key's, fmt against the model's kind,
    shape × b ≠ length."""
    fmt = _fmt_problem(h.fmt, mla)
    if fmt is not None:
        return fmt
    hd = h.dtype
    if hd is None:
        return f"unknown dtype code {h.groups[0][0] if h.groups else None}"
    if dtype is not None and hd != dtype and not (dtype in FS_DTYPE_CODES and FS_DTYPE_CODES[dtype] ==
                                                  FS_DTYPE_CODES.get(hd)):
        return f"dtype code {h.groups[0][0]} ({hd}) but the key says {dtype}"
    if _prod(h.shape) * DTYPE_BYTES[hd] != h.length:
        return f"shape {list(h.shape)} × {DTYPE_BYTES[hd]} B ≠ length {h.length}"
    return None


def fs_header_fits(head: bytes, size: int, dtype: str | None) -> bool:
    """Does a file look like it carries a header (§2.2 detection): known fmt, the key's
    dtype code, shape × b == length == size − 28."""
    h = decode_fs_header(head)
    return h is not None and fs_header_problem(h, dtype) is None and h.length == size - FS_HEADER_ONE_GROUP


# --- §2.3 GDS ----------------------------------------------------------------------------------

GDS_HEADER = 4096
GDS_JSON = GDS_HEADER - 8  # 4088: struct.pack("<Q", 4088) then the padded JSON
# key dtype -> the name gds_backend.torch_dtypes writes (lmcache 0.5.6 wheel, read there): not
# quite safetensors' own spelling for fp8 ("F8E4M3FN", "F8E5M2"), and no bool
GDS_DTYPES = {"half": "F16", "bfloat16": "BF16", "float": "F32", "double": "F64", "uint8": "U8", "int8": "I8",
              "int16": "I16", "int32": "I32", "int64": "I64", "fp8_e4m3fn": "F8E4M3FN", "fp8_e5m2": "F8E5M2"}
_GDS_DTYPE_KEYS = {v: k for k, v in GDS_DTYPES.items()}
GDS_META_VERSION = "1"  # the metadata format version, not the release (§2.3)


@dataclass(frozen=True)
class GdsHeader:
    dtype: str  # safetensors name as written ("BF16")
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]
    fmt: int
    version: str
    canonical: bool  # the 4096 bytes equal what encode_gds_header writes for these fields

    @property
    def length(self) -> int:
        return self.data_offsets[1]

    @property
    def key_dtype(self) -> str | None:
        return _GDS_DTYPE_KEYS.get(self.dtype)


def gds_meta(dtype: str, shape: tuple[int, ...] | list[int], nbytes: int, fmt: int) -> dict[str, Any]:
    """The header's JSON object, keys in the writer's order (§2.3)."""
    return {"kvcache": {"dtype": GDS_DTYPES.get(dtype, dtype), "shape": list(shape), "data_offsets": [0, nbytes],
                        "fmt": fmt, "__metadata__": {"lmcache_version": GDS_META_VERSION}}}


def encode_gds_header(dtype: str, shape: tuple[int, ...] | list[int], nbytes: int, fmt: int) -> bytes:
    """`struct.pack("<Q", 4088)` + `json.dumps(meta)` (default separators) UTF-8, space-
    padded to 4088 bytes (§2.3). The sidecar is a byte copy of these 4096 bytes."""
    body = json.dumps(gds_meta(dtype, shape, nbytes, fmt)).encode("utf-8")
    if len(body) > GDS_JSON:
        raise ValueError("GDS metadata longer than 4088 bytes")
    return struct.pack("<Q", GDS_JSON) + body.ljust(GDS_JSON, b" ")


def decode_gds_header(data: bytes) -> GdsHeader | None:
    """The 4096-byte header (of a data file or a sidecar), or None when it does not parse:
    shorter than 4096, length word ≠ 4088, JSON not UTF-8/valid, or fields of the wrong type."""
    if len(data) < GDS_HEADER or struct.unpack_from("<Q", data)[0] != GDS_JSON:
        return None
    try:
        meta = json.loads(data[8:GDS_HEADER].decode("utf-8"))
        kv = meta["kvcache"]
        dtype, shape, offs, fmt = kv["dtype"], kv["shape"], kv["data_offsets"], kv["fmt"]
        version = kv["__metadata__"]["lmcache_version"]
    except (ValueError, KeyError, TypeError):
        return None
    ints = [*shape, *offs, fmt] if isinstance(shape, list) and isinstance(offs, list) else None
    if (not isinstance(dtype, str) or not isinstance(version, str) or ints is None or len(offs) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints)):
        return None
    canonical = data[:GDS_HEADER] == _encode_raw(meta)
    return GdsHeader(dtype, tuple(shape), (offs[0], offs[1]), fmt, version, canonical)


def _encode_raw(meta: Any) -> bytes:
    body = json.dumps(meta).encode("utf-8")
    return struct.pack("<Q", GDS_JSON) + body.ljust(GDS_JSON, b" ") if len(body) <= GDS_JSON else b""


def gds_header_problem(h: GdsHeader, dtype: str | None, mla: bool | None = None) -> str | None:
    """Why a decoded GDS header contradicts itself or the key (§2.4 header_invalid), or None."""
    fmt = _fmt_problem(h.fmt, mla)
    if fmt is not None:
        return fmt
    kd = h.key_dtype
    if kd is None:
        return f"unknown dtype {h.dtype!r}"
    if dtype is not None and GDS_DTYPES.get(dtype) != h.dtype:
        return f"dtype {h.dtype} but the key says {dtype}"
    if h.data_offsets[0] != 0:
        return f"data_offsets start at {h.data_offsets[0]}, not 0"
    if h.version != GDS_META_VERSION:  # the reader raises UnsupportedMetadataVersion (R2 §3.1)
        return f"lmcache_version {h.version!r}, the readers know {GDS_META_VERSION!r}"
    if _prod(h.shape) * DTYPE_BYTES[kd] != h.length:
        return f"shape {list(h.shape)} × {DTYPE_BYTES[kd]} B ≠ {h.length} bytes"
    return None


# --- §2.4 verdicts ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """A file's status by §2.4 (None: whole) and a reason for the manifest."""

    status: str | None
    reason: str = ""


OK = Verdict(None)


def sidecar_verdict(sidecar: bytes, data_head: bytes | None) -> Verdict:
    """A GDS `.metadata` (§2.4): zero_filled (every byte zero comes first, §4), short
    (under 4096), corrupt_sidecar (does not parse, or differs from its data file's first
    4096 bytes); whole otherwise. A sidecar without a data file is the scan's concern."""
    if sidecar and not any(sidecar):
        return Verdict("zero_filled", "every byte is zero")
    if len(sidecar) < GDS_HEADER:
        return Verdict("short", f"{len(sidecar)} bytes, a sidecar holds {GDS_HEADER}")
    if decode_gds_header(sidecar) is None:
        return Verdict("corrupt_sidecar", "sidecar does not parse (the startup scan of its folder stops)")
    if data_head is not None and len(data_head) >= GDS_HEADER and sidecar[:GDS_HEADER] != data_head[:GDS_HEADER]:
        return Verdict("corrupt_sidecar", "sidecar differs from its data file's header")
    if len(sidecar) != GDS_HEADER:
        return Verdict("size_mismatch", f"{len(sidecar)} bytes, a sidecar holds {GDS_HEADER}")
    return OK


def chunk_verdict(backend: str, size: int, head: bytes, *, all_zero: bool, dtype: str | None = None,
                  mla: bool | None = None, fs_header: bool = True, full_chunk: int | None = None,
                  token_bytes: int | None = None, save_unfull_chunk: bool = False,
                  modal_size: int | None = None, sidecar: str = "ok") -> Verdict:
    """The §2.4 verdict of one data file, first applicable in §4's order: zero_filled,
    short, header_invalid, size_mismatch, orphan_data (misfiled is the path's, §1.3).

    head: the file's first bytes (≥ 4096 for GDS, ≥ 28 for fs with header); dtype/mla:
    the key's dtype and the model's kind when known; fs_header: whether this fs tier has
    headers (§2.2); full_chunk/token_bytes: S and one token's bytes from the geometry facts;
    modal_size: the deployment's modal size when there is no geometry; sidecar (GDS):
    "ok", "missing" or "corrupt" (a data file whose sidecar is not whole is never found).
    """
    if size == 0:
        return Verdict("short", "empty file")
    if all_zero:
        return Verdict("zero_filled", "every byte is zero")
    if backend == "gds" or (backend == "fs" and fs_header):
        hsize = GDS_HEADER if backend == "gds" else FS_HEADER_ONE_GROUP
        if size < hsize:
            return Verdict("short", f"{size} bytes, shorter than its {hsize}-byte header")
        if backend == "gds":
            g = decode_gds_header(head)
            if g is None:
                return Verdict("header_invalid", "GDS header does not parse")
            length, problem = g.length, gds_header_problem(g, dtype, mla)
        else:
            f = decode_fs_header(head)
            if f is None:
                return Verdict("header_invalid", "RemoteMetadata header does not parse")
            length, problem = f.length, fs_header_problem(f, dtype, mla)
        if size < hsize + length:
            return Verdict("short", f"{size} bytes, its header says {hsize + length} (a torn write)")
        if problem:
            return Verdict("header_invalid", problem)
        if size > hsize + length:
            return Verdict("size_mismatch", f"{size} bytes, its header says {hsize + length}")
        if backend == "gds" and sidecar != "ok":
            return Verdict("orphan_data", f"sidecar {sidecar}: the engine never finds this data file")
        return OK
    if full_chunk is not None:
        if size == full_chunk:
            return OK
        if size > full_chunk:
            return Verdict("size_mismatch", f"{size} bytes, a full chunk is {full_chunk}")
        if not save_unfull_chunk:
            return Verdict("short", f"{size} bytes, a full chunk is {full_chunk}")
        if token_bytes and size % token_bytes == 0:
            return OK
        return Verdict("size_mismatch", f"{size} bytes is not a whole number of {token_bytes}-byte tokens")
    if modal_size is not None and size != modal_size:
        if size < modal_size:
            return Verdict("short", f"{size} bytes, the deployment's other chunks hold {modal_size}")
        return Verdict("size_mismatch", f"{size} bytes, the deployment's other chunks hold {modal_size}")
    return OK
