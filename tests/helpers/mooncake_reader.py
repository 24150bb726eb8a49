"""A reference reader of Mooncake Store's SSD offload (client-side `FileStorage`, 0.3.8 -
0.3.14), for the end-to-end tests: what a client starting on a client root keeps, deletes
or refuses, and what a read of a storage key returns. Written from the normative page
(/work/shared/spec/mooncake.md §1.2-§1.4, §2.1) and the research notes it cites
(/work/shared/reference/mooncake-format.md §2, §3, §5), not from kvmigrate: nothing here
imports it (its own protobuf decoding and its own port of libstdc++'s hash).

Covered:
* the bucket backend at start: a top-level `<id>.meta` whose stem is all digits, with its
  `<id>.bucket`, that parses with `data_size` != 0 and non-empty lists is adopted; a `.meta`
  that does not parse (or is empty) is deleted with its `.bucket`; a `.meta` without its
  `.bucket` is deleted; every `*.bucket` anywhere below the root without a top-level
  `<stoll(stem)>.meta` is deleted; other names are ignored (`StartResult`);
* a read of an adopted key: the value at `offset + key_size`, `data_size` bytes; a record
  the `.bucket` does not hold whole is registered but unreadable; a key two live entries
  hold fails (the sizes disagree: INVALID_PARAMS);
* the file-per-key backend at start: every regular file at depth 3 of `<fsdir>` must parse
  as a `KVEntry`, else the client does not start (`setup()` raises); a read opens
  `fpk(key)` and returns its value only when that file holds that key;
* ≥ 0.3.12 (`scoped=True`): a key without NUL is registered as tenant `default` but never
  read.

Not covered: eviction, the master's metadata, the uring path's 4 KiB padding (a longer
`.bucket` reads the same), the client lock (kvmigrate's concern, not a read's).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

_M = 0xC6A4A7935BD1E995
_MASK = (1 << 64) - 1


def std_hash(data: bytes) -> int:
    """libstdc++ `std::_Hash_bytes(data, len, 0xc70f6907)` (what `std::hash<std::string>` is)."""
    n = len(data)
    h = (0xC70F6907 ^ (n * _M)) & _MASK
    end = n - n % 8
    for i in range(0, end, 8):
        k = (int.from_bytes(data[i:i + 8], "little") * _M) & _MASK
        k = ((k ^ (k >> 47)) * _M) & _MASK
        h = ((h ^ k) * _M) & _MASK
    if n % 8:
        h = ((h ^ int.from_bytes(data[end:], "little")) * _M) & _MASK
    h = ((h ^ (h >> 47)) * _M) & _MASK
    return h ^ (h >> 47)


def sanitize(key: bytes) -> str:
    out = key.decode("utf-8", "surrogateescape")
    for ch in '/\\:*?"<>|\0':
        out = out.replace(ch, "_")
    return out


def fpk(key: bytes, fsdir: str = "file_per_key_dir") -> str:
    h = std_hash(key)
    return os.path.join(fsdir, chr(ord("a") + h % 16), chr(ord("a") + (h >> 4) % 16), sanitize(key))


class Unparsable(Exception):
    pass


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise Unparsable("varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return value, i


def _message(buf: bytes) -> list[tuple[int, int | bytes]]:
    out: list[tuple[int, int | bytes]] = []
    i = 0
    while i < len(buf):
        tag, i = _varint(buf, i)
        if tag & 7 == 0:
            v, i = _varint(buf, i)
            out.append((tag >> 3, v))
        elif tag & 7 == 2:
            n, i = _varint(buf, i)
            if i + n > len(buf):
                raise Unparsable("length")
            out.append((tag >> 3, buf[i:i + n]))
            i += n
        else:
            raise Unparsable("wire type")
    return out


@dataclass
class Entry:
    path: Path  # the .bucket
    key: bytes
    offset: int
    key_size: int
    data_size: int


@dataclass
class StartResult:
    """What a client starting on a client root does (§1.4)."""

    deleted: list[Path] = field(default_factory=list)
    refused: str | None = None  # file-per-key: why setup() raises (the client does not start)
    entries: dict[bytes, list[Entry]] = field(default_factory=dict)  # bucket keys as registered
    kv_files: dict[bytes, list[Path]] = field(default_factory=dict)  # file-per-key keys as registered


def _stoll(stem: str) -> int | None:
    digits = ""
    for i, ch in enumerate(stem):
        if ch.isdigit() or (i == 0 and ch in "+-"):
            digits += ch
        else:
            break
    try:
        return int(digits)
    except ValueError:
        return None


def start(root: Path, *, fsdir: str = "file_per_key_dir") -> StartResult:
    """The start of a client on `root` (nothing deleted on disk: what it would delete is listed)."""
    res = StartResult()
    metas = {p.name[:-5]: p for p in root.iterdir() if p.is_file() and p.name.endswith(".meta")
             and p.name[:-5].isdigit()}
    for stem, meta in sorted(metas.items()):
        bucket = root / f"{stem}.bucket"
        if not bucket.is_file():
            res.deleted.append(meta)
            continue
        try:
            fields = _message(meta.read_bytes())
        except Unparsable:
            res.deleted += [meta, bucket]
            continue
        data_size = next((int(v) for n, v in fields if n == 1 and isinstance(v, int)), 0)
        keys = [bytes(v) for n, v in fields if n == 2 and isinstance(v, bytes)]
        objs = []
        try:
            for n, v in fields:
                if n == 3 and isinstance(v, bytes):
                    sub = dict((k, x) for k, x in _message(v) if isinstance(x, int))
                    objs.append((sub.get(1, 0), sub.get(2, 0), sub.get(3, 0)))
        except Unparsable:
            res.deleted += [meta, bucket]
            continue
        if data_size == 0 or not keys or not objs:
            res.deleted += [meta, bucket]
            continue
        for key, (off, ks, ds) in zip(keys, objs):
            res.entries.setdefault(key, []).append(Entry(bucket, key, off, ks, ds))
    live = {int(s) for s in metas if (root / f"{s}.bucket").is_file()} - {
        int(p.name[:-5]) for p in res.deleted if p.name.endswith(".meta")}
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.endswith(".bucket"):
                ident = _stoll(name[:-7])  # (at any depth: kept only with a live top-level <id>.meta)
                if ident is None or ident not in live or not (root / f"{ident}.meta").is_file():
                    p = Path(dirpath) / name
                    if p not in res.deleted:
                        res.deleted.append(p)
    base = root / fsdir
    if base.is_dir():
        for a in sorted(base.iterdir()):
            if not a.is_dir():
                continue
            for b in sorted(a.iterdir()):
                if not b.is_dir():
                    continue
                for f in sorted(b.iterdir()):
                    if not f.is_file():
                        continue
                    try:
                        fields = _message(f.read_bytes())
                        if any(n not in (1, 2) or not isinstance(v, bytes) for n, v in fields):
                            raise Unparsable("not a KVEntry")
                    except Unparsable as exc:
                        res.refused = f"{f}: {exc}"
                        return res
                    key = next((bytes(v) for n, v in fields if n == 1 and isinstance(v, bytes)), b"")
                    res.kv_files.setdefault(key, []).append(f)
    return res


def read(root: Path, result: StartResult, storage_key: bytes, *, scoped: bool = True,
         fsdir: str = "file_per_key_dir") -> bytes | str:
    """The value a read of `storage_key` returns after `start`, or why it fails."""
    if result.refused:
        return f"client not started: {result.refused}"
    hits = result.entries.get(storage_key, [])
    if not hits and scoped and b"\0" in storage_key and storage_key.split(b"\0", 1)[1] in result.entries:
        return "INVALID_KEY: registered raw (as tenant default), never read"
    if len(hits) > 1:
        return "INVALID_PARAMS: the key is in two live entries"
    if hits:
        e = hits[0]
        data = e.path.read_bytes()
        start_at = e.offset + e.key_size
        if start_at + e.data_size > len(data):
            return "FILE_READ_FAIL: the record is cut"
        return data[start_at:start_at + e.data_size]
    path = root / fpk(storage_key, fsdir)
    if path.is_file():
        fields = _message(path.read_bytes())
        key = next((bytes(v) for n, v in fields if n == 1 and isinstance(v, bytes)), b"")
        if key == storage_key:
            return next((bytes(v) for n, v in fields if n == 2 and isinstance(v, bytes)), b"")
    return "not found"
