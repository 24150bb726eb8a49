"""Deterministic KV pages and the block-file bytes each writer family builds from them.

A page is what one tensor of one layer holds for one GPU block on one rank. Its content
depends only on (model_name, seed, block hash, group, tensor, gpu block) and, for full
attention, on the head shard: the *full* page (all KV heads) is one SHAKE-256 stream of
`page_bytes × tp` bytes and rank r holds the r-th of tp equal slices. SHAKE output is
prefix-consistent, so the full page is the same at every TP as long as
`page_bytes × tp` is, and MLA pages (latent KV, replicated on every rank) are the same
at every TP, in every scheme era and for every writer family. That is what lets a test
prove that a migrated or merged block holds exactly the pages the source writer stored.

The layouts (formats.md §2):
* vLLM row: `[W0 cell][W1 cell]…[W(M-1) cell]` + zero pad to a multiple of 4096; a cell
  is tensor-major `[T][B][P]`; a canonical cell holds full pages (all heads, one copy).
* llm-d file: this rank's shard only, block-major `[B][T][P]`, no header, no padding.
* vllm.cpp payload: `[T][P]` for the one GPU block of the file (after a 128-byte header).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

ROW_ALIGN = 4096
_DOMAIN = "kvmigrate-synth-v1"


def block_hash(seed: int, index: int, hash_len: int = 64) -> bytes:
    """Raw block hash of block `index` (`hash_len` hex chars): the same for a given seed
    in every namespace, so caches of one model in several eras share their keys."""
    if hash_len % 2 or not 6 <= hash_len <= 64:
        raise ValueError(f"hash_len must be an even number of hex chars in 6..64, got {hash_len}")
    digest = hashlib.sha256(f"{_DOMAIN}:block:{seed}:{index}".encode()).digest()
    return digest[: hash_len // 2]


def block_hash_hex(seed: int, index: int, hash_len: int = 64) -> str:
    return block_hash(seed, index, hash_len).hex()


def deterministic_int(seed: int, label: str, bits: int) -> int:
    """A reproducible pseudo-random integer (temp-file suffixes, pids...)."""
    digest = hashlib.sha256(f"{_DOMAIN}:int:{seed}:{label}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % (1 << bits)


def stale_bytes(seed: int, label: str, size: int) -> bytes:
    """Non-zero garbage, e.g. the uninitialised staging buffer behind llm-d's 16 MiB floor."""
    return hashlib.shake_256(f"{_DOMAIN}:stale:{seed}:{label}".encode()).digest(size)


@dataclass(frozen=True)
class PageGeometry:
    """What page content depends on: taken from a SynthSpec or a SynthResult namespace."""

    model_name: str
    seed: int
    kv_kind: str
    tp: int
    page_bytes: int

    @property
    def is_mla(self) -> bool:
        return self.kv_kind == "mla"

    @property
    def full_page_bytes(self) -> int:
        """Bytes of one page with all KV heads (MLA: the replicated latent page)."""
        return self.page_bytes if self.is_mla else self.page_bytes * self.tp


def geometry(spec_or_namespace: Any) -> PageGeometry:
    """PageGeometry of a SynthSpec, a SynthResult namespace dict, or a PageGeometry."""
    if isinstance(spec_or_namespace, PageGeometry):
        return spec_or_namespace
    if isinstance(spec_or_namespace, Mapping):
        get = spec_or_namespace.__getitem__
    elif all(hasattr(spec_or_namespace, k) for k in ("model_name", "seed", "kv_kind", "tp", "page_bytes")):
        def get(key: str) -> Any:
            return getattr(spec_or_namespace, key)
    else:
        raise TypeError("expected a SynthSpec, a SynthResult namespace dict or a PageGeometry, "
                        f"got {type(spec_or_namespace).__name__}")
    return PageGeometry(get("model_name"), int(get("seed")), get("kv_kind"), int(get("tp")), int(get("page_bytes")))


@lru_cache(maxsize=64)
def _model_stream(model_name: str, seed: int) -> Any:
    """SHAKE-256 state after absorbing (model, seed); copied per page (saves re-hashing)."""
    prefix = json.dumps([_DOMAIN, "page", model_name, seed]) + "\n"
    return hashlib.shake_256(prefix.encode("utf-8", "surrogatepass"))


def full_page(spec_or_namespace: Any, *, hex_hash: str, group: int, tensor: int, gpu_block: int) -> bytes:
    """The page with all heads (the concatenation of every rank's shard, in rank order)."""
    g = geometry(spec_or_namespace)
    stream = _model_stream(g.model_name, g.seed).copy()
    stream.update(f"{hex_hash}|{group}|{tensor}|{gpu_block}".encode())
    return stream.digest(g.full_page_bytes)


def page_bytes_for(spec_or_namespace: Any, *, hex_hash: str, group: int, rank: int, tensor: int,
                   gpu_block: int) -> bytes:
    """The page the source writer stored for (block, group, tensor, gpu block) on `rank`.

    `rank` is the worker rank; its head shard is `rank % tp` (llm-d pipeline stages use
    global ranks). MLA pages ignore the rank: every rank holds the same replica.
    """
    g = geometry(spec_or_namespace)
    page = full_page(g, hex_hash=hex_hash, group=group, tensor=tensor, gpu_block=gpu_block)
    if g.is_mla:
        return page
    shard = rank % g.tp
    return page[shard * g.page_bytes:(shard + 1) * g.page_bytes]


def pad_row(data: bytes, align: int = ROW_ALIGN) -> bytes:
    """Zero pad to a multiple of `align` (the vLLM row stride)."""
    return data + b"\0" * (-len(data) % align)


def cell_bytes(spec_or_namespace: Any, *, hex_hash: str, group: int, rank: int, tensors: Sequence[int],
               blocks_per_file: int) -> bytes:
    """One worker's cell of a vLLM row: tensor-major `[T][B][P]` of that rank's shard."""
    g = geometry(spec_or_namespace)
    return b"".join(page_bytes_for(g, hex_hash=hex_hash, group=group, rank=rank, tensor=t, gpu_block=b)
                    for t in tensors for b in range(blocks_per_file))


def canonical_cell_bytes(spec_or_namespace: Any, *, hex_hash: str, group: int, tensors: Sequence[int],
                         blocks_per_file: int) -> bytes:
    """A canonical-layout cell: full pages (all heads, one copy), tensor-major `[T][B][P_full]`."""
    g = geometry(spec_or_namespace)
    return b"".join(full_page(g, hex_hash=hex_hash, group=group, tensor=t, gpu_block=b)
                    for t in tensors for b in range(blocks_per_file))


def vllm_row_bytes(spec_or_namespace: Any, *, hex_hash: str, group: int, tensors: Sequence[int],
                   blocks_per_file: int, cells: int, canonical: bool = False) -> bytes:
    """A vLLM fs-tier row: `cells` worker cells (rank order) + zero pad to 4096.

    cells = world size for direct rows (MLA: N identical cells), 1 for replicated and
    canonical rows.
    """
    if canonical:
        body = canonical_cell_bytes(spec_or_namespace, hex_hash=hex_hash, group=group, tensors=tensors,
                                    blocks_per_file=blocks_per_file)
        return pad_row(body * cells)
    body = b"".join(cell_bytes(spec_or_namespace, hex_hash=hex_hash, group=group, rank=w, tensors=tensors,
                               blocks_per_file=blocks_per_file) for w in range(cells))
    return pad_row(body)


def llmd_file_bytes(spec_or_namespace: Any, *, hex_hash: str, group: int, rank: int, tensors: Sequence[int],
                    blocks_per_file: int) -> bytes:
    """An llm-d block file: this rank's shard, block-major `[B][T][P]`, no header or pad."""
    g = geometry(spec_or_namespace)
    return b"".join(page_bytes_for(g, hex_hash=hex_hash, group=group, rank=rank, tensor=t, gpu_block=b)
                    for b in range(blocks_per_file) for t in tensors)


def vllmcpp_payload(spec_or_namespace: Any, *, hex_hash: str, group: int, rank: int,
                    tensors: Sequence[int]) -> bytes:
    """A vllm.cpp payload: `[T][P]` of the file's single GPU block, this rank's shard."""
    return llmd_file_bytes(spec_or_namespace, hex_hash=hex_hash, group=group, rank=rank, tensors=tensors,
                           blocks_per_file=1)
