"""The per-block checksum a vLLM fs tier may keep in an extended attribute.

vLLM PR #57912 (open, not in 0.34; identity.md §4.1) stores the CRC-32C (Castagnoli) of
the whole file, 4 bytes big-endian, in `user.vllm.kv_crc32c`, set on the temp file before
its rename; a load that finds a value that does not match deletes the file. An earlier
variant (a fork cited in RFC #54363) keeps zlib's CRC-32 in `user.vllm.kv_crc32`. So:

* a hard link keeps the value (it is the inode's), and the bytes: nothing to do;
* a copy of the same bytes (`--mode copy`, `--dest` on another filesystem) copies it
  (`copy_values`), or the engine loses the check;
* a file whose bytes change (copy_pad, a header rewrite, slice, concat, relayout) must not
  carry it: a new file starts without one, and nothing copies it there;
* `verify` checks it where present (`mismatch`).
"""

from __future__ import annotations

import errno
import os
import zlib

CRC32C_XATTR = "user.vllm.kv_crc32c"  # CRC-32C of the whole file, 4 bytes big-endian (PR #57912)
CRC32_XATTR = "user.vllm.kv_crc32"  # zlib CRC-32, 4 bytes big-endian (the earlier variant)
XATTRS = (CRC32C_XATTR, CRC32_XATTR)
_ABSENT = (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP)
_CHUNK = 1 << 20


def _py_crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C in Python (where the compiled leaf walk is not built): slow, but the same."""
    crc ^= 0xFFFFFFFF
    table = _TABLE
    for b in data:
        crc = (crc >> 8) ^ table[(crc ^ b) & 0xFF]
    return crc ^ 0xFFFFFFFF


def _table() -> list[int]:
    out = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        out.append(c)
    return out


_TABLE = _table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C of `data`, continuing from `crc` (as zlib.crc32 continues)."""
    try:
        from kvmigrate._leafwalk import crc32c as fast
    except ImportError:
        return _py_crc32c(data, crc)
    return int(fast(data, crc))


def values(fd: int) -> dict[str, bytes]:
    """The checksum attributes a file carries (none where the filesystem has no xattrs)."""
    out = {}
    for name in XATTRS:
        try:
            out[name] = os.getxattr(fd, name)
        except OSError as exc:
            if exc.errno not in _ABSENT:
                raise
    return out


def copy_values(src_fd: int, dst_fd: int) -> None:
    """Give a copy of the same bytes the source's checksum attributes (a destination
    filesystem without xattrs keeps none: the engine then loads the block unchecked)."""
    for name, value in values(src_fd).items():
        try:
            os.setxattr(dst_fd, name, value)
        except OSError as exc:
            if exc.errno not in _ABSENT:
                raise


def mismatch(fd: int) -> str | None:
    """Why the file's checksum attribute does not match its bytes (None: it matches, or
    there is none). A value that is not 4 bytes is a mismatch, as the engine reads it."""
    found = values(fd)
    if not found:
        return None
    c32c = c32 = 0
    offset = 0
    while True:
        chunk = os.pread(fd, _CHUNK, offset)
        if not chunk:
            break
        if CRC32C_XATTR in found:
            c32c = crc32c(chunk, c32c)
        if CRC32_XATTR in found:
            c32 = zlib.crc32(chunk, c32)
        offset += len(chunk)
    for name, value in found.items():
        want = c32c if name == CRC32C_XATTR else c32
        if len(value) != 4:
            return f"{name} holds {len(value)} bytes, not a 4-byte checksum"
        if int.from_bytes(value, "big") != want:
            return (f"{name} says {value.hex()}, the file's bytes give {want:08x}: vLLM deletes the block on its "
                    "first load")
    return None
