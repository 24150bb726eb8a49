"""The LMCache ``reshard`` transform (lmcache.md §3.4): one chunk's head shards at TP S
become the payload the worker of rank ``t`` at TP N would have written.

A non-MLA payload is ``KV_2LTD`` ``[2, L, T, h·D]`` in C order (lmcache.md §2.1), so each
rank's file is ``rows = 2·L·T`` rows of ``h_s·D·b`` bytes: one row per (K/V, layer,
token), holding that rank's heads side by side. Rank ``r`` of TP ``S`` holds heads
``[r·H/S, (r+1)·H/S)`` when ``H % S == 0``, or the single head ``r // (S/H)`` when
``S > H`` (vLLM replicates KV heads; the copies are equal). The target row is the source
rows concatenated along the head axis in head order, then cut at the target's heads:
per row, **never** a concatenation of files (lmcache.md §8).

The transform is pure on bytes: headers (fs RemoteMetadata, GDS 4096 bytes) are the
caller's; each source is given as an open file and the offset where its payload starts.
Memory stays at one batch of rows per source whatever the chunk size; output is
sequential, so ``dst`` may be a hashing writer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

from kvmigrate.transforms import TransformError, _fd, _require_int, _Writer

RESHARD_BUFFER = 4 << 20
"""Default bytes of source rows read per batch (all sources together): a few MiB keeps
reads large and memory bounded for chunks of hundreds of MiB."""

KV_KINDS = ("full", "mla")

Source = tuple[int | BinaryIO, int]
"""An open source file (or descriptor) and the byte offset where its payload starts."""


@dataclass(frozen=True)
class HeadRun:
    """Consecutive heads of one target row taken from one source rank's row."""

    src_rank: int
    src_head: int  # first head's index inside the source rank's shard
    dst_head: int  # first head's index inside the target rank's shard
    heads: int


@dataclass(frozen=True)
class ReshardGeometry:
    """One chunk's numbers (lmcache.md §2.1, §3.3 facts); validated on construction.

    ``layers`` counts draft layers; ``tokens`` is the chunk's own T (fewer for a last
    partial chunk); ``total_kv_heads`` is the model's H, before TP sharding.
    """

    layers: int
    tokens: int
    total_kv_heads: int
    head_dim: int
    elem_bytes: int
    tp_src: int
    tp_dst: int
    kv_kind: str = "full"

    def __post_init__(self) -> None:
        if self.kv_kind not in KV_KINDS:
            raise TransformError(f"reshard: kv kind must be one of {', '.join(KV_KINDS)}, got {self.kv_kind!r}")
        if self.kv_kind == "mla":
            raise TransformError(
                "reshard: an MLA chunk is never resharded: every rank's copy is the whole "
                "latent chunk [1, L, T, W], so it is linked to the target names (lmcache.md §3.4)"
            )
        _require_int("layers (L, draft layers included)", self.layers, minimum=1)
        _require_int("tokens (T of this chunk)", self.tokens, minimum=1)
        _require_int("total_kv_heads (H, before TP sharding)", self.total_kv_heads, minimum=1)
        _require_int("head_dim (D)", self.head_dim, minimum=1)
        _require_int("elem_bytes (b)", self.elem_bytes, minimum=1)
        _require_int("source TP", self.tp_src, minimum=1)
        _require_int("target TP", self.tp_dst, minimum=1)
        for side, tp in (("source", self.tp_src), ("target", self.tp_dst)):
            H = self.total_kv_heads
            if H % tp and tp % H:
                raise TransformError(
                    f"reshard: {side} TP {tp} and total_kv_heads H={H}: neither H % TP nor TP % H "
                    "is 0, so the heads are not split evenly nor replicated (lmcache.md §3.4: needs_reshard)"
                )

    @property
    def rows(self) -> int:
        """2·L·T: one row per (K/V, layer, token)."""
        return 2 * self.layers * self.tokens

    @property
    def head_bytes(self) -> int:
        return self.head_dim * self.elem_bytes

    def heads_per_rank(self, tp: int) -> int:
        """h at TP ``tp``: H/TP, or 1 when TP > H (a replicated head)."""
        return max(1, self.total_kv_heads // tp)

    def payload_bytes(self, tp: int) -> int:
        """The size of one rank's payload at TP ``tp``: 2·L·T·h·D·b."""
        return self.rows * self.heads_per_rank(tp) * self.head_bytes

    @property
    def source_bytes(self) -> int:
        return self.payload_bytes(self.tp_src)

    @property
    def target_bytes(self) -> int:
        return self.payload_bytes(self.tp_dst)


def rank_heads(total_kv_heads: int, tp: int, rank: int) -> range:
    """The model heads rank ``rank`` of TP ``tp`` holds, in order (lmcache.md §3.4)."""
    _require_int("total_kv_heads", total_kv_heads, minimum=1)
    _require_int("TP", tp, minimum=1)
    _require_int("rank", rank, minimum=0)
    if rank >= tp:
        raise TransformError(f"rank {rank} is out of range for TP {tp} (ranks 0..{tp - 1})")
    if total_kv_heads % tp == 0:
        h = total_kv_heads // tp
        return range(rank * h, (rank + 1) * h)
    if tp % total_kv_heads == 0:
        head = rank // (tp // total_kv_heads)
        return range(head, head + 1)
    raise TransformError(f"TP {tp} and total_kv_heads {total_kv_heads}: neither divides the other")


def replica_ranks(total_kv_heads: int, tp: int, head: int) -> range:
    """The ranks of TP ``tp`` holding model head ``head`` (one rank unless TP > H)."""
    rank_heads(total_kv_heads, tp, 0)  # validates H and TP
    _require_int("head", head, minimum=0)
    if head >= total_kv_heads:
        raise TransformError(f"head {head} is out of range for total_kv_heads {total_kv_heads} (heads 0..{total_kv_heads - 1})")
    if tp <= total_kv_heads:
        return range(head * tp // total_kv_heads, head * tp // total_kv_heads + 1)
    k = tp // total_kv_heads
    return range(head * k, (head + 1) * k)


def reshard_output_size(geometry: ReshardGeometry, dst_rank: int) -> int:
    """Bytes of target rank ``dst_rank``'s payload: 2·L·T·h_t·D·b (the geometry is
    validated when built; this checks the rank)."""
    rank_heads(geometry.total_kv_heads, geometry.tp_dst, dst_rank)
    return geometry.target_bytes


def head_runs(geometry: ReshardGeometry, dst_rank: int) -> list[HeadRun]:
    """Where each of target rank ``dst_rank``'s heads comes from, merged into runs of
    consecutive heads of one source rank. A replicated head is read from the lowest
    source rank holding it."""
    H, S = geometry.total_kv_heads, geometry.tp_src
    runs: list[HeadRun] = []
    for j, head in enumerate(rank_heads(H, geometry.tp_dst, dst_rank)):
        src = replica_ranks(H, S, head)[0]
        src_head = head - rank_heads(H, S, src)[0]
        last = runs[-1] if runs else None
        if last and last.src_rank == src and last.src_head + last.heads == src_head:
            runs[-1] = HeadRun(src, last.src_head, last.dst_head, last.heads + 1)
        else:
            runs.append(HeadRun(src, src_head, j, 1))
    return runs


def _payload_size(fd: int, offset: int, rank: int) -> int:
    _require_int(f"source rank {rank}'s payload offset", offset, minimum=0)
    size = os.fstat(fd).st_size
    if size < offset:
        raise TransformError(f"reshard: source rank {rank}'s file is {size} bytes, shorter than its payload offset {offset}")
    return size - offset


def check_reshard_sources(sources: Sequence[Source], geometry: ReshardGeometry) -> list[int]:
    """The sources' descriptors, once every source rank is present with a payload of exactly
    2·L·T·h_s·D·b bytes after its offset (lmcache.md §3.4: every rank present and whole)."""
    g = geometry
    if len(sources) != g.tp_src:
        raise TransformError(
            f"reshard: source TP {g.tp_src} needs one file per rank, got {len(sources)}"
        )
    fds = []
    h_s = g.heads_per_rank(g.tp_src)
    for rank, (src, offset) in enumerate(sources):
        fd = _fd(src)
        got = _payload_size(fd, offset, rank)
        if got != g.source_bytes:
            raise TransformError(
                f"reshard: source rank {rank}'s payload is {got} bytes, but 2·L·T·h_s·D·b = "
                f"2·{g.layers}·{g.tokens}·{h_s}·{g.head_dim}·{g.elem_bytes} = {g.source_bytes}: "
                "the file does not have the geometry the facts describe"
            )
        fds.append(fd)
    return fds


def _read_exact(fd: int, view: memoryview, offset: int, rank: int) -> None:
    got = os.preadv(fd, [view], offset)
    if got != len(view):
        raise TransformError(
            f"reshard: short read of source rank {rank}: {got} of {len(view)} bytes at offset {offset} "
            "(the file changed while reading)"
        )


def _first_difference(a: memoryview, b: memoryview) -> int:
    lo, hi = 0, len(a)
    while hi - lo > 64:  # binary search on equal prefixes: memoryview compares in C
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo + next(i for i in range(hi - lo) if a[lo + i] != b[lo + i])


def write_reshard(
    sources: Sequence[Source],
    dst: _Writer,
    geometry: ReshardGeometry,
    dst_rank: int,
    *,
    check_replicas: bool = True,
    buffer_bytes: int = RESHARD_BUFFER,
) -> int:
    """Stream target rank ``dst_rank``'s payload into ``dst``; returns the bytes written.

    ``sources`` holds one ``(file, payload_offset)`` per source rank, in rank order; files
    are read with ``pread`` (their positions are not moved). Rows are processed in batches
    of about ``buffer_bytes`` of source reads, so memory is bounded whatever the chunk
    size. With ``check_replicas`` (source TP > H), every replica of a head read is
    compared with the copy used: replicas that differ raise (lmcache.md §3.4).
    """
    g = geometry
    _require_int("buffer_bytes", buffer_bytes, minimum=1)
    size = reshard_output_size(g, dst_rank)
    fds = check_reshard_sources(sources, g)
    offsets = [offset for _, offset in sources]
    runs = head_runs(g, dst_rank)
    w_s = g.heads_per_rank(g.tp_src) * g.head_bytes
    w_t = g.heads_per_rank(g.tp_dst) * g.head_bytes
    used = sorted({run.src_rank for run in runs})
    replicas: dict[int, list[int]] = {}
    if check_replicas and g.tp_src > g.total_kv_heads:
        for rank in used:
            head = rank_heads(g.total_kv_heads, g.tp_src, rank)[0]
            replicas[rank] = [r for r in replica_ranks(g.total_kv_heads, g.tp_src, head) if r != rank]
    # Each run as byte offsets: (source rank, offset in source row, offset in target row, length).
    spans = [(run.src_rank, run.src_head * g.head_bytes, run.dst_head * g.head_bytes, run.heads * g.head_bytes)
             for run in runs]
    whole_row = len(spans) == 1 and spans[0][3] == w_s  # target row == one source row
    per_row = len(used) * w_s + (0 if whole_row else w_t) + (w_s if replicas else 0)
    batch = max(1, min(g.rows, buffer_bytes // per_row))
    bufs = {rank: bytearray(batch * w_s) for rank in used}
    scratch = memoryview(bytearray(batch * w_s)) if replicas else None
    out = bytearray(0 if whole_row else batch * w_t)
    row0 = 0
    while row0 < g.rows:
        n = min(batch, g.rows - row0)
        views = {rank: memoryview(bufs[rank])[: n * w_s] for rank in used}
        for rank, view in views.items():
            _read_exact(fds[rank], view, offsets[rank] + row0 * w_s, rank)
            for other in replicas.get(rank, ()):
                assert scratch is not None
                copy = scratch[: n * w_s]
                _read_exact(fds[other], copy, offsets[other] + row0 * w_s, other)
                if copy != view:
                    at = row0 * w_s + _first_difference(view, copy)
                    head = rank_heads(g.total_kv_heads, g.tp_src, rank)[0]
                    raise TransformError(
                        f"reshard: source ranks {rank} and {other} both hold KV head {head} (source TP "
                        f"{g.tp_src} > H={g.total_kv_heads} replicates heads) but differ at payload byte {at}: "
                        "replicas must be equal (lmcache.md §3.4, replica_mismatch)"
                    )
        if whole_row:
            dst.write(views[spans[0][0]])
        else:
            target = memoryview(out)[: n * w_t]
            for rank, s_off, t_off, length in spans:
                view = views[rank]
                for i in range(n):
                    s = i * w_s + s_off
                    t = i * w_t + t_off
                    target[t : t + length] = view[s : s + length]
            dst.write(target)
        row0 += n
    return size
