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
from dataclasses import asdict, dataclass
from typing import BinaryIO

from kvmigrate.formats import lmcache as L
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


# --- one output file of a tier action (reshard, rewrite_header, their GDS sidecars) --------

HEADERS = ("raw", "fs", "gds", "sidecar")
"""What precedes a payload: nothing, the 28-byte fs RemoteMetadata, the 4096-byte GDS
header; `sidecar` is a GDS `.metadata` output (the header alone)."""
HEADER_BYTES = {"raw": 0, "fs": 28, "gds": 4096, "sidecar": 4096}


@dataclass(frozen=True)
class TierSpec:
    """One file a tier action writes (lmcache.md §3.4-§3.5), proven from the names, the
    source sizes and the facts: `reshard` of `ranks` head shards at TP `ranks` into target
    rank `dst_rank` of TP `tp_dst`, or `rewrite_header` of one payload (a header added,
    stripped or changed: an fs header, a conversion of a local_disk chunk to fs). The
    payload is `[k, L, T, hidden]` (k 2 for KV_2LTD, 1 for MLA) of `dtype`.

    `flat` (the name the apply asks every transform spec): the sources are whole copies of
    one chunk (MLA, or one rank's file), compared and the first read; a reshard reads one
    shard per source rank.
    """

    action: str  # reshard | rewrite_header
    kv_kind: str  # mla | full
    ranks: int  # source files read (reshard: source TP)
    dtype: str
    layers: int
    tokens: int
    hidden_src: int  # elements per row of a source payload (h_s·D, or W for MLA)
    src_header: str
    dst_header: str
    tp_dst: int = 1
    dst_rank: int = 0
    total_kv_heads: int = 0
    head_dim: int = 0
    fmt: int = 1
    tier = True  # (a class constant: the migrate side tells a tier spec from the tree families')

    @property
    def flat(self) -> bool:
        return self.action != "reshard"

    @property
    def replicas(self) -> bool:
        return False

    @property
    def elem_bytes(self) -> int:
        return L.DTYPE_BYTES[self.dtype]

    @property
    def k(self) -> int:
        return 1 if self.kv_kind == "mla" else 2

    def geometry(self) -> ReshardGeometry:
        return ReshardGeometry(layers=self.layers, tokens=self.tokens, total_kv_heads=self.total_kv_heads,
                               head_dim=self.head_dim, elem_bytes=self.elem_bytes, tp_src=self.ranks,
                               tp_dst=self.tp_dst)

    @property
    def hidden_dst(self) -> int:
        if self.action == "reshard":
            return self.geometry().heads_per_rank(self.tp_dst) * self.head_dim
        return self.hidden_src

    @property
    def payload_src(self) -> int:
        return self.k * self.layers * self.tokens * self.hidden_src * self.elem_bytes

    @property
    def payload_dst(self) -> int:
        return self.k * self.layers * self.tokens * self.hidden_dst * self.elem_bytes

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.k, self.layers, self.tokens, self.hidden_dst)

    @property
    def output_size(self) -> int:
        if self.dst_header == "sidecar":
            return HEADER_BYTES["sidecar"]
        return HEADER_BYTES[self.dst_header] + self.payload_dst

    def header(self) -> bytes:
        if self.dst_header == "fs":
            return L.encode_fs_header(self.payload_dst, self.fmt, self.dtype, self.shape)
        if self.dst_header in ("gds", "sidecar"):
            return L.encode_gds_header(self.dtype, self.shape, self.payload_dst, self.fmt)
        return b""

    def to_json(self) -> dict:
        return {**asdict(self), "tier": True}

    @classmethod
    def from_json(cls, d: dict) -> TierSpec:
        names = ("action", "kv_kind", "ranks", "dtype", "layers", "tokens", "hidden_src", "src_header",
                 "dst_header", "tp_dst", "dst_rank", "total_kv_heads", "head_dim", "fmt")
        spec = cls(**{k: d[k] for k in names})
        spec.check()
        return spec

    def check(self) -> None:
        """Raises TransformError for numbers no LMCache writer produces."""
        if (self.action not in ("reshard", "rewrite_header") or self.kv_kind not in KV_KINDS
                or self.src_header not in HEADERS[:3] or self.dst_header not in HEADERS
                or self.dtype not in L.DTYPE_BYTES):
            raise TransformError(f"inconsistent tier transform {self.to_json()}")
        for name in ("ranks", "layers", "tokens", "hidden_src", "tp_dst"):
            _require_int(name, getattr(self, name), minimum=1)
        _require_int("dst_rank", self.dst_rank, minimum=0)
        if self.action == "reshard":
            g = self.geometry()  # validates H, D and both TPs
            rank_heads(g.total_kv_heads, g.tp_dst, self.dst_rank)
            if g.heads_per_rank(g.tp_src) * g.head_dim != self.hidden_src:
                raise TransformError(f"reshard: a source row of {self.hidden_src} elements is not "
                                     f"{g.heads_per_rank(g.tp_src)} heads of {g.head_dim}")
        elif self.ranks != 1 and self.kv_kind != "mla":
            raise TransformError("rewrite_header reads one file (or whole MLA copies)")


def write_tier(spec: TierSpec, fds: Sequence[int], dst: _Writer) -> int:
    """Stream the file `spec` describes into `dst`: its header, then (not for a sidecar)
    the payload, re-sharded or copied from the first source. Every source's size is
    checked against the geometry first (a torn or resized source raises)."""
    spec.check()
    off = HEADER_BYTES[spec.src_header]
    for rank, fd in enumerate(fds if spec.action == "reshard" else fds[:1]):
        got = _payload_size(fd, off, rank)
        if got != spec.payload_src:
            raise TransformError(f"{spec.action}: source {rank}'s payload is {got} bytes, the geometry gives "
                                 f"{spec.payload_src}")
    head = spec.header()
    if head:
        dst.write(head)
    if spec.dst_header == "sidecar":
        return len(head)
    if spec.action == "reshard":
        return len(head) + write_reshard([(fd, off) for fd in fds], dst, spec.geometry(), spec.dst_rank)
    left, pos = spec.payload_src, off
    while left:
        buf = os.pread(fds[0], min(RESHARD_BUFFER, left), pos)
        if not buf:
            raise TransformError(f"rewrite_header: short read at offset {pos} (the file changed while reading)")
        dst.write(buf)
        pos += len(buf)
        left -= len(buf)
    return len(head) + spec.payload_src
