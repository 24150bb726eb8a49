"""The bytes each creating action produces from its source file (migration.md §1).

One generator serves three callers: apply (writes the chunks to a temp file), the
comparison with an existing file at the target path (hashes them only), and journal
reconciliation after a crash (proves a file at a final path is this run's output).
"""

from __future__ import annotations

import os
from typing import Iterator

import xxhash

from kvmigrate.formats import vllmcpp
from kvmigrate.migrate.fsops import CHUNK, PAGE


class SourceInvalid(ValueError):
    """The source cannot produce the action's output (e.g. a vllm.cpp header that the
    scan saw as valid no longer decodes)."""


def _read_exact(fd: int, n: int) -> bytes:
    parts = []
    while n > 0:
        buf = os.read(fd, min(CHUNK, n))
        if not buf:
            break
        parts.append(buf)
        n -= len(buf)
    return b"".join(parts)


def output_chunks(src_fd: int, action: str, digest: bytes | None, src_hasher=None) -> Iterator[bytes]:
    """Yield the output of `action` ("link" = plain copy, "copy_pad", "rewrite_header")
    read from `src_fd`; every source byte read is fed to `src_hasher` (staleness check
    against the manifest's whole-file hash)."""
    upd = src_hasher.update if src_hasher is not None else (lambda b: None)
    if action == "rewrite_header":
        header = _read_exact(src_fd, vllmcpp.HEADER_SIZE)
        upd(header)
        if len(header) < vllmcpp.HEADER_SIZE:
            raise SourceInvalid("source is shorter than a vllm.cpp header")
        h = vllmcpp.decode_header(header)
        if h.magic != vllmcpp.MAGIC or h.key_size > vllmcpp.MAX_KEY_SIZE:
            raise SourceInvalid("source header is not a valid vllm.cpp header")
        if digest is None or len(digest) != 32:
            raise SourceInvalid("no target identity digest for a header rewrite")
        yield vllmcpp.rewrite_header(header, digest)
        remaining = h.payload_size
        while remaining > 0:
            buf = os.read(src_fd, min(CHUNK, remaining))
            if not buf:
                raise SourceInvalid(f"source payload is short by {remaining} bytes")
            upd(buf)
            remaining -= len(buf)
            yield buf
        while True:  # trailing bytes the engine ignores: hashed for staleness, not copied
            buf = os.read(src_fd, CHUNK)
            if not buf:
                break
            upd(buf)
        return
    n = 0
    while True:
        buf = os.read(src_fd, CHUNK)
        if not buf:
            break
        upd(buf)
        n += len(buf)
        yield buf
    if action == "copy_pad" and n % PAGE:
        yield b"\0" * (PAGE - n % PAGE)


def output_hash(src_fd: int, action: str, digest: bytes | None) -> tuple[bytes, int, bytes]:
    """(output xxh3_128, output size, source xxh3_128) without writing anything."""
    out = xxhash.xxh3_128()
    src = xxhash.xxh3_128()
    size = 0
    for chunk in output_chunks(src_fd, action, digest, src):
        out.update(chunk)
        size += len(chunk)
    return out.digest(), size, src.digest()
