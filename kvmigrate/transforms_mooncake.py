"""The Mooncake ``reshard`` of values (mooncake.md §3.4): one block's per-key-rank values at
``n_s`` key ranks become the values the engine would itself have written at ``n_t``.

A GQA/MHA value is ``rows`` rows of ``h·D·b`` bytes, heads innermost but one (vLLM ``nhd``:
``rows = 2·L·T``; SGLang ``layer_first``/``page_first``/``page_first_direct``: ``rows = L·P``
for each ``_k`` or ``_v`` value, resharded apart). Source key rank ``t`` holds heads
``[t·H/n_s, (t+1)·H/n_s)``, or the single head ``t // (n_s/H)`` when ``n_s > H`` (SGLang
replicates heads; the copies must be equal). Each target row is the source rows side by
side in key-rank order, cut at the target's heads: per row, **never** a concatenation of
values. The head arithmetic is LMCache's (`transforms_lmcache`: the same sharding rule);
values are bytes here because a Mooncake value lives inside a `.bucket` or a KVEntry and
is written whole into a new pair.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmigrate.transforms import TransformError
from kvmigrate.transforms_lmcache import ReshardGeometry, _first_difference, head_runs, replica_ranks


class ReplicaMismatch(TransformError):
    """Two key ranks hold copies of one head (``n_s > H``) whose bytes differ: the block is
    ``replica_mismatch``, never resharded."""

    def __init__(self, head: int, ranks: tuple[int, int], at: int):
        self.head = head
        self.ranks = ranks
        self.at = at
        super().__init__(f"reshard: key ranks {ranks[0]} and {ranks[1]} both hold KV head {head} but differ at "
                         f"byte {at}: replicas must be equal (mooncake.md §3.4, replica_mismatch)")


def heads_at(heads: int, n: int) -> int:
    """Heads one key rank's value holds at ``n`` key ranks: H/n, or 1 when n > H."""
    return max(1, heads // n)


def reshard_problem(sizes: Sequence[int], n_s: int, n_t: int, heads: int, head_dim: int,
                    elem_bytes: int) -> str | None:
    """Why the values of sizes ``sizes`` (one per source key rank, in order) cannot be
    resharded from ``n_s`` to ``n_t`` key ranks, in a reason's words; None when they can.
    The plan asks this (``needs_reshard``) before the apply reads a byte."""
    for name, v in (("source key ranks", n_s), ("target key ranks", n_t), ("total_kv_heads", heads),
                    ("head_dim", head_dim), ("dtype_bytes", elem_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return f"{name} must be a whole number >= 1, got {v!r}"
    for side, n in (("source", n_s), ("target", n_t)):
        if heads % n and n % heads:
            return (f"{side} key ranks {n} and total_kv_heads H={heads}: neither H % n nor n % H is 0, "
                    "so the heads are neither split evenly nor replicated")
    if len(sizes) != n_s:
        return f"{n_s} source key ranks need {n_s} values, got {len(sizes)}"
    row = heads_at(heads, n_s) * head_dim * elem_bytes
    for rank, size in enumerate(sizes):
        if size <= 0 or size % row:
            return (f"key rank {rank}'s value is {size} bytes, not a whole number of rows of "
                    f"h_s·D·b = {heads_at(heads, n_s)}·{head_dim}·{elem_bytes} = {row} bytes")
    if len(set(sizes)) > 1:
        return "the key ranks' values hold different numbers of rows: " + ", ".join(
            f"rank {r}: {s // row}" for r, s in enumerate(sizes))
    return None


def check_replicas(sources: Sequence[bytes], n_s: int, heads: int) -> None:
    """Raise ReplicaMismatch when two key ranks holding one head (``n_s > H``) differ."""
    if n_s <= heads:
        return
    for head in range(heads):
        ranks = replica_ranks(heads, n_s, head)
        first = memoryview(sources[ranks[0]])
        for other in ranks[1:]:
            copy = memoryview(sources[other])
            if copy != first:
                raise ReplicaMismatch(head, (ranks[0], other), _first_difference(first, copy))


def reshard_values(sources: Sequence[bytes], n_s: int, n_t: int, heads: int, head_dim: int,
                   elem_bytes: int) -> list[bytes]:
    """The ``n_t`` target values (key rank order) of one block's ``n_s`` source values (key
    rank order). Raises TransformError when ``reshard_problem`` has a reason, ReplicaMismatch
    when replicated heads differ."""
    why = reshard_problem([len(s) for s in sources], n_s, n_t, heads, head_dim, elem_bytes)
    if why:
        raise TransformError(f"reshard: {why}")
    check_replicas(sources, n_s, heads)
    head_bytes = head_dim * elem_bytes
    w_s = heads_at(heads, n_s) * head_bytes
    rows = len(sources[0]) // w_s
    # (layers, tokens) are LMCache's row count; only H and both TPs matter for the head runs
    geometry = ReshardGeometry(layers=1, tokens=1, total_kv_heads=heads, head_dim=head_dim,
                               elem_bytes=elem_bytes, tp_src=n_s, tp_dst=n_t)
    views = [memoryview(s) for s in sources]
    out: list[bytes] = []
    for t in range(n_t):
        spans = [(views[r.src_rank], r.src_head * head_bytes, r.heads * head_bytes) for r in head_runs(geometry, t)]
        if len(spans) == 1 and spans[0][2] == w_s:  # the target row is one source row: the value itself
            out.append(bytes(spans[0][0]))
            continue
        out.append(b"".join(view[i * w_s + off: i * w_s + off + length]
                            for i in range(rows) for view, off, length in spans))
    return out
