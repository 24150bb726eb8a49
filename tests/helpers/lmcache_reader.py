"""A reference reader of LMCache 0.5.6 disk tiers, for the end-to-end tests: the file a
target deployment looks up for a chunk, and what it reads out of it, written from the
normative page (/work/shared/spec/lmcache.md) and the research notes it cites
(/work/shared/reference/lmcache-format.md "R1", lmcache-format-2.md "R2"), not from
kvmigrate (nothing here imports it). 0.5.7rc2 names, reads and looks up the same (R2 §1).

Covered:
* §1.2 the key string of the era 0.5.6 writes (`lmc-k3`): `model@ws@wid@hex@dtype[@tag%v…]`,
  the hash as `f"{h:x}"` (signed, lowercase, unpadded), the dtype by
  `TORCH_DTYPE_TO_STR_DTYPE`, tags from the `lmcache.tag.*` request configs in request order
  (`tags_from_request_configs`); MP object names `model@0x<kv_rank:08x>@<group:x>@<hash>[@salt]`
  with `kv_rank = ws<<24 | r<<16 | lws<<8 | lr`.
* §1.3 file names: local_disk `<key with / -> ->.pt`; fs `<key with / -> -SEP->.data` under
  `base_paths[abs(hash) % n]`; GDS `<s[:2]>/<s[2:4]>/<quote(key, safe='')>.kvcache.safetensors`
  (`.weka1` on wekafs) with `s = str(hash)` (decimal, signed) and its `.metadata` sidecar;
  mp `<model with -SEP->@….data`.
* §3.1 the names a target deployment looks up: MLA with save_only_first_rank (default on
  for MLA) is `@1@0@` at every TP (ranks other than 0 never look up: they receive rank 0's
  chunk by broadcast, so every rank is answered from rank 0's name); MLA without it: fs
  aliases every rank to worker 0 (`remote_enable_mla_worker_id_as0`, default on for MLA)
  when ws > 1, GDS and local_disk look up `@N@r@`; non-MLA `@N@r@`; MP MLA `0x01000100`.
* §2.1 raw payloads (local_disk, fs without header, mp): the shape `[k, L, T, hidden]` from
  the deployment's geometry and the size; a full chunk, or with `save_unfull_chunk` a whole
  number of tokens; anything else is refused (`short` / `size_mismatch`, §2.4).
* §2.2 fs RemoteMetadata header (`save_chunk_meta`, default on): 7 little-endian int32
  (`length`, `fmt`, dtype code, shape[4]); checked against the deployment (fmt vs MLA or
  not, dtype code, shape × element size == length, geometry when given) and the file size
  (`size == 28 + length`: less is `short`, more `size_mismatch`); the payload follows.
* §2.3 GDS: a data file is found only through its sidecar (none: `orphan_data`, or `absent`
  when the data file is missing too); the sidecar's `<Q` length + JSON parsed (a failure, or
  a sidecar that is not the data file's first 4096 bytes: `corrupt_sidecar`); dtype, fmt,
  shape and `data_offsets` checked (`header_invalid`); the payload at offset 4096.
* §3.5 local_disk: a restarted 0.5.6 engine never finds a `.pt` (`index_lost`, even at the
  exact name it would write); `restarted=False` models the process that wrote the file and
  still holds it in its in-memory index (the payload is then read raw).

Deliberately left out: older eras' names (a wrong-era file is simply not at the looked-up
path: `absent`); hash computation (the caller gives the chunk hash, §3.2); layerwise keys;
multi-group (hybrid) headers; PP > 1, DCP > 1 (no MP `##lmcache-dcp-layout…` suffix) and
multi-node MP layouts beyond explicit `local_world_size`/`local_rank`; local_disk's comma
list and PathSharder; the GDS startup scan (lookups here are the per-key sidecar probe, which
finds every key the scan would); MP `fs_native` accounting; content verdicts
(`zero_filled`: a zero file of the right size is served as LMCache would serve it — compare
payloads). Where the engine's own tolerance is unknown (an fs header whose `length` is
smaller than the file holds) this reader follows the spec's verdicts and refuses.

Reasons (`Chunk.why`) reuse the spec's status names: `absent`, `index_lost`, `orphan_data`,
`corrupt_sidecar`, `short`, `size_mismatch`, `header_invalid`.
"""

from __future__ import annotations

import json
import os
import struct
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

BACKENDS = ("local_disk", "fs", "gds", "mp")

# torch dtype name -> (the key's dtype string, element size); aliases normalised first
_ALIASES = {"half": "float16", "float": "float32", "double": "float64"}
DTYPES: dict[str, tuple[str, int]] = {
    "float16": ("half", 2), "bfloat16": ("bfloat16", 2), "float32": ("float", 4), "float64": ("double", 8),
    "int8": ("int8", 1), "uint8": ("uint8", 1), "int16": ("int16", 2), "int32": ("int32", 4),
    "int64": ("int64", 8), "bool": ("bool", 1),
    "float8_e4m3fn": ("fp8_e4m3fn", 1), "float8_e4m3fnuz": ("fp8_e4m3fnuz", 1),
    "float8_e5m2": ("fp8_e5m2", 1), "float8_e5m2fnuz": ("fp8_e5m2fnuz", 1),
}
# RemoteMetadata dtype codes (§2.2): 1 and 2 both read as float16
FS_DTYPE_CODES: dict[int, str] = {1: "float16", 2: "float16", 3: "bfloat16", 4: "float32", 5: "float64",
                                  6: "uint8", 7: "float8_e4m3fn", 8: "float8_e5m2"}
# the GDS header's dtype names: gds_backend.torch_dtypes of the lmcache 0.5.6 wheel (fp8 spelled
# "F8E4M3FN"/"F8E5M2", not safetensors' "F8_E4M3")
GDS_DTYPES: dict[str, str] = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64",
                              "uint8": "U8", "int8": "I8", "float8_e4m3fn": "F8E4M3FN", "float8_e5m2": "F8E5M2"}
KV_2LTD, KV_MLA_FMT = 1, 6  # MemoryFormat (0.3.1+, §2.1)
FS_HEADER = struct.Struct("<7i")  # one group: 28 bytes
GDS_HEADER = 4096
GDS_SUFFIX, WEKA_SUFFIX = ".kvcache.safetensors", ".weka1"
MP_MLA_KV_RANK = 0x01000100
TAG_PREFIX = "lmcache.tag."


def torch_dtype(name: str) -> str:
    name = name.removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}")
    return name


def hash_hex(chunk_hash: int | bytes) -> str:
    """`chunk_hash_hex`: an int as signed, lowercase, unpadded hex; bytes as `.hex()`."""
    if isinstance(chunk_hash, bytes):
        return chunk_hash.hex()
    return f"{chunk_hash:x}"


def tags_from_request_configs(request_configs: dict[str, object]) -> tuple[tuple[str, str], ...]:
    """The key's tags: `lmcache.tag.*` entries, prefix stripped, in request order; other
    `lmcache.*` configs never enter the key."""
    return tuple((k[len(TAG_PREFIX):], str(v)) for k, v in request_configs.items() if k.startswith(TAG_PREFIX))


def key_string(model: str, world_size: int, worker_id: int, chunk_hash: int | bytes, dtype: str,
               tags: Sequence[tuple[str, str]] = ()) -> str:
    """`CacheEngineKey.to_string()` of 0.5.6 (lmc-k3, §1.2)."""
    s = f"{model}@{world_size}@{worker_id}@{hash_hex(chunk_hash)}@{DTYPES[torch_dtype(dtype)][0]}"
    if tags:
        s += "@" + "@".join(f"{k}%{v}" for k, v in tags)
    return s


def local_disk_name(key: str) -> str:
    return key.replace("/", "-") + ".pt"


def fs_name(key: str) -> str:
    return key.replace("/", "-SEP-") + ".data"


def gds_relpath(key: str, chunk_hash: int | bytes, *, wekafs: bool = False) -> str:
    """`<s[:2]>/<s[2:4]>/<quoted key><suffix>`, s the decimal string of the hash (§1.3)."""
    s = str(chunk_hash)
    name = urllib.parse.quote(key, safe="") + (WEKA_SUFFIX if wekafs else GDS_SUFFIX)
    return f"{s[:2]}/{s[2:4]}/{name}"


def mp_kv_rank(world_size: int, global_rank: int, local_world_size: int, local_rank: int) -> int:
    return world_size << 24 | global_rank << 16 | local_world_size << 8 | local_rank


def mp_name(model: str, kv_rank: int, group: int, chunk_hash: bytes, cache_salt: str | None = None) -> str:
    name = f"{model.replace('/', '-SEP-')}@0x{kv_rank:08x}@{group:x}@{chunk_hash.hex()}"
    if cache_salt:
        name += f"@{cache_salt}"
    return name + ".data"


@dataclass(frozen=True)
class Deployment:
    """The target deployment as LMCache 0.5.6 sees it.

    `model` is the `vllm serve` argument; `world_size` TP×PP (DP excluded), `worker_id` the
    global rank; `dtype` the KV cache's torch dtype (vLLM's fp8 caches: `uint8`); `tags`
    (name, value) in request order. `layers`/`hidden` (per-rank h·D, or the MLA width W) and
    `chunk_size` give the full-chunk shape raw payloads are read with."""

    model: str
    world_size: int = 1
    worker_id: int = 0
    dtype: str = "bfloat16"
    tags: tuple[tuple[str, str], ...] = ()
    mla: bool = False
    save_only_first_rank: bool | None = None  # None: LMCache's default (on for MLA)
    remote_enable_mla_worker_id_as0: bool | None = None  # None: default (on for MLA)
    save_chunk_meta: bool = True  # fs: the RemoteMetadata header
    save_unfull_chunk: bool = False
    layers: int | None = None
    hidden: int | None = None
    chunk_size: int = 256
    restarted: bool = True  # local_disk: the engine has restarted since the file was written
    wekafs: bool = False  # GDS suffix .weka1
    local_world_size: int | None = None  # MP: single node unless given
    local_rank: int | None = None

    @property
    def only_first_rank(self) -> bool:
        sofr = True if self.save_only_first_rank is None else self.save_only_first_rank
        return self.mla and sofr

    @property
    def kv_size(self) -> int:
        return 1 if self.mla else 2

    @property
    def fmt(self) -> int:
        return KV_MLA_FMT if self.mla else KV_2LTD


@dataclass(frozen=True)
class Chunk:
    """One lookup: `payload` is None on a miss, `why` then names the rule (spec status names)."""

    backend: str
    key: str
    relpath: str  # inside the tier (fs: inside the base path chosen)
    path: Path
    payload: bytes | None = None
    why: str | None = None
    detail: str = ""
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    fmt: int | None = None

    @property
    def found(self) -> bool:
        return self.payload is not None


class LMCacheReader:
    """What one rank of `deployment` looks up in a tier of `backend`, and reads.

    `tier` is the configured directory (fs: one base path, or the list of them)."""

    def __init__(self, tier: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], backend: str,
                 deployment: Deployment):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}")
        tiers = [Path(t) for t in tier] if isinstance(tier, (list, tuple)) else [Path(tier)]
        if len(tiers) > 1 and backend != "fs":
            raise ValueError("only fs takes several base paths")
        self.tiers, self.backend, self.dep = tiers, backend, deployment
        self.dtype = torch_dtype(deployment.dtype)
        self.elem = DTYPES[self.dtype][1]

    # --- names -----------------------------------------------------------------------------

    def key_fields(self) -> tuple[int, int]:
        """(ws, wid) of the key this rank looks up (§3.1)."""
        d = self.dep
        if d.only_first_rank:
            return 1, 0
        alias = d.mla if d.remote_enable_mla_worker_id_as0 is None else (d.remote_enable_mla_worker_id_as0 and d.mla)
        if self.backend == "fs" and alias and d.world_size > 1:
            return d.world_size, 0
        return d.world_size, d.worker_id

    def kv_rank(self) -> int:
        d = self.dep
        if d.mla:
            return MP_MLA_KV_RANK
        lws = d.world_size if d.local_world_size is None else d.local_world_size
        lr = d.worker_id if d.local_rank is None else d.local_rank
        return mp_kv_rank(d.world_size, d.worker_id, lws, lr)

    def key(self, chunk_hash: int | bytes, *, group: int = 0, cache_salt: str | None = None) -> str:
        if self.backend == "mp":
            return mp_name(self.dep.model, self.kv_rank(), group, _as_bytes(chunk_hash), cache_salt)[:-len(".data")]
        ws, wid = self.key_fields()
        return key_string(self.dep.model, ws, wid, _as_int(chunk_hash), self.dtype, self.dep.tags)

    def relpath(self, chunk_hash: int | bytes, *, group: int = 0, cache_salt: str | None = None) -> str:
        if self.backend == "mp":
            return mp_name(self.dep.model, self.kv_rank(), group, _as_bytes(chunk_hash), cache_salt)
        key = self.key(chunk_hash)
        if self.backend == "local_disk":
            return local_disk_name(key)
        if self.backend == "fs":
            return fs_name(key)
        return gds_relpath(key, _as_int(chunk_hash), wekafs=self.dep.wekafs)

    def base(self, chunk_hash: int | bytes) -> Path:
        if self.backend == "fs" and len(self.tiers) > 1:
            return self.tiers[abs(_as_int(chunk_hash)) % len(self.tiers)]
        return self.tiers[0]

    def path(self, chunk_hash: int | bytes, *, group: int = 0, cache_salt: str | None = None) -> Path:
        return self.base(chunk_hash) / self.relpath(chunk_hash, group=group, cache_salt=cache_salt)

    # --- reads -----------------------------------------------------------------------------

    def lookup(self, chunk_hash: int | bytes, *, group: int = 0, cache_salt: str | None = None) -> Chunk:
        key = self.key(chunk_hash, group=group, cache_salt=cache_salt)
        rel = self.relpath(chunk_hash, group=group, cache_salt=cache_salt)
        at = _At(self.backend, key, rel, self.base(chunk_hash) / rel)
        if self.backend == "gds":
            return self._gds(at)
        data = _read(at.path)
        if data is None:
            return at.miss("absent")
        if self.backend == "local_disk" and self.dep.restarted:
            return at.miss("index_lost", "0.5.6 never re-indexes a .pt after a restart (§3.5)")
        if self.backend == "fs" and self.dep.save_chunk_meta:
            return self._fs_header(at, data)
        return self._raw(at, data)

    def _raw(self, at: _At, data: bytes) -> Chunk:
        d = self.dep
        if not data:
            return at.miss("short", "empty file")
        if d.layers is None or d.hidden is None:
            return at.hit(data, None, self.dtype, d.fmt)
        per_token = d.kv_size * d.layers * d.hidden * self.elem
        full = per_token * d.chunk_size
        if len(data) > full or len(data) % per_token:
            return at.miss("size_mismatch", f"{len(data)} B is not a whole number of tokens up to {full} B")
        tokens = len(data) // per_token
        if tokens < d.chunk_size and not d.save_unfull_chunk:
            return at.miss("short", f"{tokens} of {d.chunk_size} tokens without save_unfull_chunk")
        return at.hit(data, (d.kv_size, d.layers, tokens, d.hidden), self.dtype, d.fmt)

    def _check_shape(self, shape: list[int], nbytes: int) -> str | None:
        d = self.dep
        if len(shape) != 4 or any(not isinstance(n, int) or n <= 0 for n in shape):
            return f"shape {shape} is not 4-D"
        if shape[0] != d.kv_size:
            return f"shape {shape} is not a {'MLA' if d.mla else 'K/V'} chunk"
        if shape[0] * shape[1] * shape[2] * shape[3] * self.elem != nbytes:
            return f"shape {shape} x {self.elem} B != {nbytes} B"
        if d.layers is not None and shape[1] != d.layers:
            return f"{shape[1]} layers, the deployment has {d.layers}"
        if d.hidden is not None and shape[3] != d.hidden:
            return f"hidden {shape[3]}, the deployment has {d.hidden}"
        if shape[2] > d.chunk_size:
            return f"{shape[2]} tokens > chunk_size {d.chunk_size}"
        return None

    def _fs_header(self, at: _At, data: bytes) -> Chunk:
        if len(data) < FS_HEADER.size:
            return at.miss("short", f"{len(data)} B, shorter than the 28-byte header")
        length, fmt, code, *dims = FS_HEADER.unpack_from(data)
        body = len(data) - FS_HEADER.size
        if 0 <= body < length:
            return at.miss("short", f"header says {length} B, the file holds {body}")
        if fmt != self.dep.fmt:
            return at.miss("header_invalid", f"fmt {fmt}, the deployment reads {self.dep.fmt}")
        if FS_DTYPE_CODES.get(code) != self.dtype:
            return at.miss("header_invalid", f"dtype code {code}, the key says {self.dtype}")
        while dims and dims[-1] == 0:  # zero padding to 4-D is stripped on read
            dims.pop()
        bad = self._check_shape(dims, length)
        if bad:
            return at.miss("header_invalid", bad)
        if body > length:
            return at.miss("size_mismatch", f"header says {length} B, the file holds {body}")
        return at.hit(data[FS_HEADER.size:], tuple(dims), self.dtype, fmt)

    def _gds(self, at: _At) -> Chunk:
        sidecar = _read(Path(f"{at.path}.metadata"))
        data = _read(at.path)
        if sidecar is None:
            return at.miss("orphan_data" if data is not None else "absent", "no sidecar: never indexed nor probed")
        meta = _parse_gds_header(sidecar)
        if isinstance(meta, str):
            return at.miss("corrupt_sidecar", meta)
        if data is None:
            return at.miss("absent", "a sidecar without its data file")
        if len(data) < GDS_HEADER:
            return at.miss("short", f"{len(data)} B, shorter than the 4096-byte header")
        if data[:GDS_HEADER] != sidecar:
            return at.miss("corrupt_sidecar", "the sidecar is not the data file's header")
        kv = meta["kvcache"]
        if kv.get("dtype") != GDS_DTYPES.get(self.dtype):
            return at.miss("header_invalid", f"dtype {kv.get('dtype')!r}, the key says {self.dtype}")
        if kv.get("fmt") != self.dep.fmt:
            return at.miss("header_invalid", f"fmt {kv.get('fmt')}, the deployment reads {self.dep.fmt}")
        offsets = kv.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2 and offsets[0] == 0 and isinstance(offsets[1], int)):
            return at.miss("header_invalid", f"data_offsets {offsets!r}")
        n = offsets[1]
        shape = kv.get("shape")
        bad = self._check_shape(list(shape) if isinstance(shape, list) else [], n)
        if bad:
            return at.miss("header_invalid", bad)
        body = len(data) - GDS_HEADER
        if body < n:
            return at.miss("short", f"header says {n} B, the file holds {body}")
        if body > n:
            return at.miss("size_mismatch", f"header says {n} B, the file holds {body}")
        return at.hit(data[GDS_HEADER:], tuple(shape), self.dtype, kv["fmt"])


@dataclass(frozen=True)
class _At:
    backend: str
    key: str
    relpath: str
    path: Path

    def miss(self, why: str, detail: str = "") -> Chunk:
        return Chunk(self.backend, self.key, self.relpath, self.path, None, why, detail)

    def hit(self, payload: bytes, shape: tuple[int, ...] | None, dtype: str, fmt: int) -> Chunk:
        return Chunk(self.backend, self.key, self.relpath, self.path, payload, None, "", shape, dtype, fmt)


def _parse_gds_header(raw: bytes) -> dict | str:
    """The sidecar as the per-key probe parses it: `<Q` length, then that much UTF-8 JSON
    (space-padded) with a `kvcache` entry of metadata version "1"; a string says why not."""
    if len(raw) != GDS_HEADER:
        return f"{len(raw)} B, not {GDS_HEADER}"
    (n,) = struct.unpack_from("<Q", raw)
    if n != GDS_HEADER - 8:
        return f"header length {n}, not {GDS_HEADER - 8}"
    try:
        meta = json.loads(raw[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return f"JSON: {exc}"
    kv = meta.get("kvcache") if isinstance(meta, dict) else None
    if not isinstance(kv, dict):
        return "no kvcache entry"
    version = kv.get("__metadata__", {}).get("lmcache_version") if isinstance(kv.get("__metadata__"), dict) else None
    if version != "1":
        return f"metadata version {version!r}"
    return meta


def _read(path: Path) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _as_int(chunk_hash: int | bytes) -> int:
    if not isinstance(chunk_hash, int):
        raise TypeError("an in-process 0.5.6 chunk hash is an int (digests are folded, §1.2)")
    return chunk_hash


def _as_bytes(chunk_hash: int | bytes) -> bytes:
    if not isinstance(chunk_hash, bytes):
        raise TypeError("an MP chunk hash is the 32-byte blake3 digest")
    return chunk_hash
