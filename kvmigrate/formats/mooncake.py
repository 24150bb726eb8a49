"""The Mooncake Store SSD offload formats (spec mooncake.md §1.2, §1.3, §2): the one place
its file names, index encodings, file-per-key paths and key grammars are spelled.

Pure functions, no I/O and no decisions: the family module (to come) reads files and gives
verdicts through these. Research notes: `mooncake-format.md` (R), Mooncake 0.3.8-0.3.14,
whose encodings are unchanged over that range (R §6).

* **Bucket backend** (§1.2): `<id>.bucket` records `[storage key][value]` back to back, and
  `<id>.meta`, a yalantinglibs `struct_pb` `BucketMetadata`: field 1 varint `data_size`,
  field 2 repeated bytes `keys`, field 3 repeated `{1 offset, 2 key_size, 3 data_size}`,
  **zero values omitted**. A value is read at `offset + key_size`.
* **File-per-key backend** (§1.3): `<fsdir>/<a-p>/<a-p>/<SanitizeKey(k)>`, the folders from
  libstdc++'s `std::_Hash_bytes(k, len, 0xc70f6907)`; content `KVEntry{1 key, 2 value}`.
* **Keys** (§2): storage key `<tenant>\\0<engine key>` since 0.3.12 (`mc-scoped`), the engine
  key raw before (`mc-raw`); the vLLM 0.34 and SGLang 0.5.23 engine-key grammars.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from kvmigrate.releases import release_tuple

SCHEMES = ("mc-raw", "mc-scoped")
DEFAULT_TENANT = "default"
DEFAULT_FSDIR = "file_per_key_dir"
BUCKET_SUFFIX = ".bucket"
META_SUFFIX = ".meta"
LOCK_NAME = ".mooncake_local_disk.lock"  # 0.3.14's client lock (flock), bucket backend only
HASH_SEED = 0xC70F6907  # std::hash<std::string>'s seed in libstdc++
_M = 0xC6A4A7935BD1E995
_MASK = (1 << 64) - 1
LOCK_RELEASE = (0, 3, 14)  # the first release that holds the client lock (§5.1)
SCOPED_RELEASE = (0, 3, 12)  # the first release with tenant-scoped keys (§2.1)
MAX_BUCKET_KEYS = 500
MAX_BUCKET_BYTES = 256 << 20


class DecodeError(ValueError):
    """Bytes that are not the struct_pb message asked for (Mooncake's own parse fails)."""


# --- struct_pb (protobuf wire format, the subset Mooncake writes) ------------------------------

def encode_varint(n: int) -> bytes:
    if n < 0:
        raise ValueError("a varint field here is unsigned")
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def decode_varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, next position); raises DecodeError on a varint cut short or over 10 bytes."""
    value = shift = 0
    for i in range(10):
        if pos + i >= len(data):
            raise DecodeError("varint cut short")
        b = data[pos + i]
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value & _MASK, pos + i + 1
        shift += 7
    raise DecodeError("varint longer than 10 bytes")


def _field(number: int, wire: int) -> bytes:
    return encode_varint(number << 3 | wire)


def _bytes_field(number: int, value: bytes) -> bytes:
    return _field(number, 2) + encode_varint(len(value)) + value


def _varint_field(number: int, value: int) -> bytes:
    return b"" if value == 0 else _field(number, 0) + encode_varint(value)  # zero values omitted


def _fields(data: bytes) -> list[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of every field, in order; varint (0) and
    length-delimited (2) fields only, as struct_pb writes these messages."""
    out: list[tuple[int, int, int | bytes]] = []
    pos = 0
    while pos < len(data):
        tag, pos = decode_varint(data, pos)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise DecodeError("field number 0")
        if wire == 0:
            value, pos = decode_varint(data, pos)
            out.append((number, 0, value))
        elif wire == 2:
            n, pos = decode_varint(data, pos)
            if pos + n > len(data):
                raise DecodeError(f"field {number}: {n} bytes announced, {len(data) - pos} left")
            out.append((number, 2, bytes(data[pos:pos + n])))
            pos += n
        else:
            raise DecodeError(f"field {number}: wire type {wire} is not written by Mooncake")
    return out


@dataclass(frozen=True)
class BucketObject:
    """One entry of a `.meta`: where its record starts in the `.bucket`, the inline key's
    length and the value's length (the value is at `offset + key_size`)."""

    offset: int
    key_size: int
    data_size: int

    @property
    def value_start(self) -> int:
        return self.offset + self.key_size

    @property
    def end(self) -> int:
        return self.offset + self.key_size + self.data_size


@dataclass(frozen=True)
class BucketMeta:
    """A `.meta` (§1.2): Σ key + value bytes, the storage keys and their entries, in order."""

    data_size: int
    keys: tuple[bytes, ...]
    objects: tuple[BucketObject, ...]


def encode_meta(meta: BucketMeta) -> bytes:
    """The bytes Mooncake writes for `meta`: fields in number order, zero values omitted."""
    out = bytearray(_varint_field(1, meta.data_size))
    for k in meta.keys:
        out += _bytes_field(2, k)
    for o in meta.objects:
        body = _varint_field(1, o.offset) + _varint_field(2, o.key_size) + _varint_field(3, o.data_size)
        out += _bytes_field(3, body)
    return bytes(out)


def decode_meta(data: bytes) -> BucketMeta:
    """Parse a `.meta`; raises DecodeError where Mooncake's parse fails. (Whether a start
    keeps it, e.g. `data_size` 0 or lists of different lengths, is the verdict's.)"""
    data_size = 0
    keys: list[bytes] = []
    objects: list[BucketObject] = []
    for number, wire, value in _fields(data):
        if number == 1 and wire == 0:
            data_size = int(value)  # (int: a varint field)
        elif number == 2 and wire == 2:
            keys.append(bytes(value))  # (bytes: a length-delimited field)
        elif number == 3 and wire == 2:
            sub = {n: v for n, w, v in _fields(bytes(value)) if w == 0}
            objects.append(BucketObject(int(sub.get(1, 0)), int(sub.get(2, 0)), int(sub.get(3, 0))))
        else:
            raise DecodeError(f"field {number} (wire {wire}) is not a BucketMetadata field")
    return BucketMeta(data_size, tuple(keys), tuple(objects))


@dataclass(frozen=True)
class KVEntry:
    """A file-per-key file's content (§1.3): the storage key and the value."""

    key: bytes
    value: bytes


def encode_kv_entry(entry: KVEntry) -> bytes:
    return (_bytes_field(1, entry.key) if entry.key else b"") + (_bytes_field(2, entry.value) if entry.value else b"")


def decode_kv_entry(data: bytes) -> KVEntry:
    """Parse a KVEntry; raises DecodeError where Mooncake's `setup()` would (the client then
    does not start, §1.3)."""
    key = value = b""
    for number, wire, v in _fields(data):
        if wire != 2 or number not in (1, 2):
            raise DecodeError(f"field {number} (wire {wire}) is not a KVEntry field")
        if number == 1:
            key = bytes(v)  # (bytes: a length-delimited field)
        else:
            value = bytes(v)
    return KVEntry(key, value)


def build_bucket(entries: list[tuple[bytes, bytes]]) -> tuple[bytes, BucketMeta]:
    """The `.bucket` bytes and `.meta` of (storage key, value) records written in order."""
    out = bytearray()
    objects = []
    for key, value in entries:
        objects.append(BucketObject(len(out), len(key), len(value)))
        out += key + value
    return bytes(out), BucketMeta(len(out), tuple(k for k, _ in entries), tuple(objects))


# --- bucket ids (§1.2) -------------------------------------------------------------------------

_ID = re.compile(r"[+-]?[0-9]+")


def stoll_id(name: str) -> int | None:
    """The id a starting client reads from a `.bucket`/`.meta` name: `std::stoll` of the
    stem's numeric prefix (so `1710000000000-0.bucket` reads as 1710000000000); None when
    the stem does not start with a number."""
    for suffix in (BUCKET_SUFFIX, META_SUFFIX):
        if name.endswith(suffix):
            m = _ID.match(name[: -len(suffix)])
            return int(m.group()) if m else None
    return None


def is_pair_name(name: str) -> bool:
    """A `.bucket`/`.meta` name whose stem is all digits (the only ones a client pairs)."""
    return any(name.endswith(sfx) and name[: -len(sfx)].isdigit() for sfx in (BUCKET_SUFFIX, META_SUFFIX))


def next_bucket_id(existing: list[int], now_seconds: int) -> int:
    """An id above every existing one (a migration's new pair, spec §3.6), or a fresh
    `(unix_seconds << 12)` when there is none."""
    return max(existing) + 1 if existing else now_seconds << 12


# --- file-per-key paths (§1.3) ------------------------------------------------------------------

def hash_bytes(data: bytes, seed: int = HASH_SEED) -> int:
    """libstdc++'s `std::_Hash_bytes` (64-bit): a MurmurHash64A variant over 8-byte
    little-endian words, the 1-7 tail bytes as one little-endian integer."""
    n = len(data)
    h = (seed ^ (n * _M)) & _MASK
    whole = n & ~7
    for i in range(0, whole, 8):
        d = int.from_bytes(data[i:i + 8], "little")
        k = (d * _M) & _MASK
        k ^= k >> 47
        k = (k * _M) & _MASK
        h = ((h ^ k) * _M) & _MASK
    if n & 7:
        h = ((h ^ int.from_bytes(data[whole:], "little")) * _M) & _MASK
    h ^= h >> 47
    h = (h * _M) & _MASK
    h ^= h >> 47
    return h


_UNSAFE = re.compile(r'[/\\:*?"<>|\x00]')


def sanitize_key(key: bytes | str) -> str:
    """SanitizeKey: `/ \\ : * ? " < > |` and NUL become `_`. Lossy: a key is read from its
    file, never from its name."""
    text = key.decode("utf-8", "surrogateescape") if isinstance(key, bytes) else key
    return _UNSAFE.sub("_", text)


def fpk(key: bytes, fsdir: str = DEFAULT_FSDIR) -> str:
    """Where a file-per-key client writes and reads storage key `key`, from its client root."""
    h = hash_bytes(key)
    return f"{fsdir}/{chr(97 + (h & 15))}/{chr(97 + ((h >> 4) & 15))}/{sanitize_key(key)}"


# --- storage keys and engine keys (§2) ----------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StorageKey:
    """A storage key split: `tenant` None for a raw key (≤ 0.3.11), else what precedes the
    first NUL; `engine` the engine's key."""

    tenant: str | None
    engine: str

    @property
    def scheme(self) -> str:
        return "mc-raw" if self.tenant is None else "mc-scoped"

    def encode(self) -> bytes:
        text = self.engine if self.tenant is None else f"{self.tenant}\0{self.engine}"
        return text.encode("utf-8", "surrogateescape")


def parse_storage_key(key: bytes) -> StorageKey:
    text = key.decode("utf-8", "surrogateescape")
    tenant, nul, engine = text.partition("\0")
    return StorageKey(sys.intern(tenant), engine) if nul else StorageKey(None, text)  # (a store has few tenants)


def scoped(engine_key: str, tenant: str = DEFAULT_TENANT) -> bytes:
    """The storage key a ≥ 0.3.12 client uses for `engine_key` (`<tenant>\\0<key>`)."""
    return StorageKey(tenant, engine_key).encode()


@dataclass(frozen=True)
class VllmKey:
    """vLLM 0.34 MooncakeStoreConnector's key (§2.2):
    `[<cache_prefix>@]<model><store_namespace>@tp_rank:<t>@pcp<p>@dcp<d>@pp_rank:<pp>@group:<g>@<hash hex>`."""

    prefix: str | None
    model: str
    namespace: str  # `@store_pp:…@store_format:…` (kept byte for byte), or ""
    tp_rank: int
    pcp: int
    dcp: int
    pp_rank: int
    group: int
    hash: str

    @property
    def stem(self) -> str:
        """The key without rank fields and hash: what a deployment shares (§2.4)."""
        return (f"{self.prefix}@" if self.prefix is not None else "") + self.model + self.namespace


def format_vllm_key(k: VllmKey) -> str:
    return (f"{k.stem}@tp_rank:{k.tp_rank}@pcp{k.pcp}@dcp{k.dcp}@pp_rank:{k.pp_rank}@group:{k.group}@{k.hash}")


def parse_vllm_key(key: str) -> VllmKey | None:
    """Parsed from the right (hash, group, pp, dcp, pcp, tp); the rest splits at the first
    `@store_` (the namespace), then at the last `@` (prefix, model)."""
    fields = key.rsplit("@", 6)  # (the tail `@tp_rank:<d>@pcp<d>@dcp<d>@pp_rank:<d>@group:<d>@<hex>` holds six `@`)
    if len(fields) != 7:
        return None
    head, t, p, d, pp, g, hash_hex = fields
    if not (t.startswith("tp_rank:") and p.startswith("pcp") and d.startswith("dcp") and pp.startswith("pp_rank:")
            and g.startswith("group:")):
        return None
    t, p, d, pp, g = t[8:], p[3:], d[3:], pp[8:], g[6:]
    if not (t.isdecimal() and p.isdecimal() and d.isdecimal() and pp.isdecimal() and g.isdecimal()
            and hash_hex and not hash_hex.strip(_HEX)):  # (\d is str.isdecimal's digits)
        return None
    cut = head.find("@store_")
    rest, namespace = (head, "") if cut < 0 else (head[:cut], head[cut:])
    prefix, at, model = rest.rpartition("@")
    if not model:
        return None
    return VllmKey(prefix if at else None, model, namespace, int(t), int(p), int(d), int(pp), int(g), hash_hex)


_HEX = "0123456789abcdef"


@dataclass(frozen=True)
class SglangKey:
    """SGLang 0.5.23 HiCache `mooncake` key (§2.3): `<prefix>_<page hash>_<suffix>_<k|v>`; the
    suffix is MHA `<tp_rank>` or `<tp_rank>_<pp_rank>`, MLA empty (`__k`) or `<pp_rank>`."""

    prefix: str
    page_hash: str
    ranks: tuple[int, ...]  # the suffix's numbers: (), (r,), (r, pp); MLA: () or (pp,)
    half: str  # "k" or "v"

    @property
    def stem(self) -> str:
        return self.prefix


_SGL = re.compile(r"(.+)_([0-9a-f]{64})_((?:\d+(?:_\d+)?)?)_([kv])")


def format_sglang_key(k: SglangKey) -> str:
    return f"{k.prefix}_{k.page_hash}_{'_'.join(str(r) for r in k.ranks)}_{k.half}"


def parse_sglang_key(key: str) -> SglangKey | None:
    m = _SGL.fullmatch(key)
    if m is None:
        return None
    ranks = tuple(int(x) for x in m.group(3).split("_")) if m.group(3) else ()
    if not ranks and m.group(4) != "k":
        return None  # (an MLA page writes only `__k`)
    return SglangKey(m.group(1), m.group(2), ranks, m.group(4))


# --- a KVEntry read from its first bytes (the scan reads no more than it must) ----------------------

class CutError(DecodeError):
    """A message whose fields run past the file's end (`short`, §4)."""


def kv_entry_layout(head: bytes, size: int) -> tuple[bytes, int, int]:
    """(key, value offset, value length) of a KVEntry file of `size` bytes from its first
    bytes (which hold the key): struct_pb writes field 1, then field 2. Raises CutError when
    a field announces more bytes than the file has, DecodeError for anything else a parse
    refuses (trailing bytes, another field, the key not within `head`)."""
    pos, key, value_at, value_len = 0, b"", size, 0
    seen: list[int] = []
    while pos < size:
        try:
            tag, pos = decode_varint(head, pos)
            number, wire = tag >> 3, tag & 7
            if wire != 2 or number not in (1, 2) or number in seen or (number == 1 and seen):
                raise DecodeError(f"field {number} (wire {wire}) where a KVEntry holds key, then value")
            n, pos = decode_varint(head, pos)
        except DecodeError as exc:
            if pos >= len(head) and len(head) < size:
                raise DecodeError("the key is longer than the bytes read") from exc
            if len(head) >= size and "cut short" in str(exc):
                raise CutError(str(exc)) from exc
            raise
        if pos + n > size:
            raise CutError(f"field {number}: {n} bytes announced, {size - pos} left")
        if number == 2 and pos + n < size:
            raise DecodeError(f"{size - pos - n} bytes after the value")
        seen.append(number)
        if number == 1:
            if pos + n > len(head):
                raise DecodeError("the key is longer than the bytes read")
            key = bytes(head[pos:pos + n])
        else:
            value_at, value_len = pos, n
        pos += n
    return key, value_at, value_len

# --- retired keys (§3.5) -------------------------------------------------------------------------

RETIRED_MARK = "kvmigrate-retired"


def retired_key(storage_key: bytes, run_id: str) -> bytes:
    """The key a displaced bucket entry gets (§3.5): `kvmigrate-retired@<run>@<engine key>`
    in the storage key's own scoping (a scoped key keeps its tenant, a raw key stays raw), so
    no engine ever looks it up and the `.meta` keeps its count. `run_id` holds no `@`, the
    separator that gives the original key back."""
    if not run_id or "@" in run_id or "\0" in run_id:
        raise ValueError(f"a run id in a retired key must be non-empty with no '@' or NUL, got {run_id!r}")
    k = parse_storage_key(storage_key)
    return StorageKey(k.tenant, f"{RETIRED_MARK}@{run_id}@{k.engine}").encode()


def parse_retired_key(engine_key: str) -> tuple[str, str] | None:
    """(run id, the original engine key) of a retired entry's engine key; None for any other."""
    mark, at, rest = engine_key.partition("@")
    if mark != RETIRED_MARK or not at:
        return None
    run, at, original = rest.partition("@")
    return (run, original) if at and run else None


# --- releases (§0, §5.1) -------------------------------------------------------------------------

def lock_proves(releases: list[object]) -> bool:
    """§5.1 (a): every release stated (one per deployment of a store) is >= 0.3.14, whose
    client holds the lock, so kvmigrate holding it proves no client runs."""
    found = [release_tuple(r) for r in releases]
    return bool(found) and all(r is not None and r >= LOCK_RELEASE for r in found)
