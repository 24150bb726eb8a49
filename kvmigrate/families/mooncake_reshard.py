"""A GQA/MHA block of a Mooncake store read at another TP (spec mooncake.md §3.1, §3.4 -
§3.6): the target's key ranks and storage keys, where its objects go, the geometry a
reshard needs, and what each target key holds today (present, a displaced source of the
block, or another object: a conflict). One source for the scan (the rows' actions) and the
migration plan (the objects an apply writes), so both name the same keys.

Keys carry no TP size, so a target key is often held already: `tp_rank:0` of TP=2 is
TP=1's name. An object of the target's size there is the target's; a source object of the
block there is *displaced* (its entry retired, its KVEntry replaced: never left, every read
of it would fail); anything else is `target_occupied`, and nothing of the block is placed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmigrate.formats import mooncake as M
from kvmigrate.identity import hfconfig
from kvmigrate.transforms_mooncake import heads_at, reshard_problem

__all__ = ["heads_at"]


@dataclass(frozen=True)
class Geometry:
    heads: int  # total KV heads H
    head_dim: int  # D
    elem_bytes: int  # b


@dataclass(frozen=True)
class Output:
    """One object the target reads of a resharded block."""

    rank: int  # target key rank
    half: str  # SGLang k/v; vLLM ""
    engine_key: str
    key: bytes  # storage key
    client: str  # client root relpath ('' for ROOT)
    size: int


def geometry(facts: Any) -> tuple[Geometry | None, list[str]]:
    """(the geometry the facts state, the flags still asked)."""
    heads, dim = getattr(facts, "total_kv_heads", None), getattr(facts, "head_dim", None)
    elem = getattr(facts, "dtype_bytes", None) or hfconfig.dtype_bytes(getattr(facts, "model_dtype", None))
    asks = [flag for v, flag in ((heads, "--total-kv-heads"), (dim, "--head-dim"), (elem, "--dtype-bytes"))
            if not v]
    if not heads or not dim or not elem:
        return None, asks
    return Geometry(int(heads), int(dim), int(elem)), []


def key_ranks(engine: str, tp: int, heads: int) -> int:
    """The GQA/MHA key ranks a deployment at TP `tp` writes (§2.2, §2.3): vLLM min(tp, H),
    SGLang tp (ranks beyond H hold replicated heads)."""
    return min(tp, heads) if engine == "vllm" else tp


def with_rank(engine: str, engine_key: str, rank: int) -> str:
    """The engine key of another key rank of the same block."""
    if engine == "vllm":
        v = M.parse_vllm_key(engine_key)
        assert v is not None
        return M.format_vllm_key(M.VllmKey(v.prefix, v.model, v.namespace, rank, v.pcp, v.dcp, v.pp_rank, v.group,
                                           v.hash))
    s = M.parse_sglang_key(engine_key)
    assert s is not None and s.ranks
    return M.format_sglang_key(M.SglangKey(s.prefix, s.page_hash, (rank, *s.ranks[1:]), s.half))


def with_half(engine_key: str, half: str) -> str:
    s = M.parse_sglang_key(engine_key)
    assert s is not None
    return M.format_sglang_key(M.SglangKey(s.prefix, s.page_hash, s.ranks, half))


def target_client(engine: str, source_client: str, rank: int) -> str:
    """Where a target key rank's objects go (§3.6): vLLM the client root of the block's
    rank-0 source; SGLang `rank_<dp>_<r>_<pp>_<cp>` of target rank r (same dp, pp, cp)."""
    if engine == "vllm":
        return source_client
    parent, _, name = source_client.rpartition("/")
    parts = name.split("_")
    if len(parts) != 5 or parts[0] != "rank":
        return source_client
    folder = f"rank_{parts[1]}_{rank}_{parts[3]}_{parts[4]}"
    return f"{parent}/{folder}" if parent else folder


def storage_key(engine_key: str, tenant: str | None) -> bytes:
    """The storage key a target client looks up: scoped (>= 0.3.12) unless `tenant` is None."""
    return M.StorageKey(tenant, engine_key).encode()


def outputs(engine: str, rank0_key: str, rank0_client: str, n_t: int, halves: tuple[str, ...], tenant: str | None,
            value_size: int, n_s: int, geo: Geometry) -> list[Output]:
    """Every object the target reads of the block, in key-rank (then k, v) order, from the
    target's engine key of key rank 0 (`rank0_key`) and its tenant."""
    size = value_size // heads_at(geo.heads, n_s) * heads_at(geo.heads, n_t)
    out = []
    for r in range(n_t):
        for half in halves:
            key = with_rank(engine, rank0_key, r)
            if half:
                key = with_half(key, half)
            out.append(Output(r, half, key, storage_key(key, tenant), target_client(engine, rank0_client, r), size))
    return out


def problem(sizes: list[int], n_s: int, n_t: int, geo: Geometry) -> str | None:
    """Why the block's values cannot be resharded (§3.4), None when they can."""
    return reshard_problem(sizes, n_s, n_t, geo.heads, geo.head_dim, geo.elem_bytes)


SOURCE_STATUSES = ("ok", "misfiled")  # a block's sources: a misfiled KVEntry holds its key's value too (§2.4)


def holders(out: list[Output], registered: Mapping[bytes, list[Any]], block: set[int]) -> tuple[int, list[Any], Any]:
    """(outputs present at the target's size, the block's source objects that hold an
    output's key (displaced), an object of another block holding one: the conflict or
    None). `registered`: storage key a start registers -> its objects; `block`: ids of the
    block's own source objects."""
    present, displaced, other = 0, [], None
    for o in out:
        # (a KVEntry away from fpk of its key, a temp copy or a misfiled one, is read at no key, §1.3)
        held = [h for h in registered.get(o.key) or () if not (getattr(h, "kind", "") == "kventry"
                                                                and h.status in ("misfiled", "tmp_leftover"))]
        if not held:
            continue
        if all(id(h) in block for h in held):
            displaced += held
        elif any(value_size(h) == o.size and id(h) not in block for h in held) and len(held) == 1:
            present += 1
        else:
            other = other or next(h for h in held if id(h) not in block)
    return present, displaced, other


def plan_block(objs: list[Any], *, engine: str, n_s: int, n_t: int, geo: Geometry, tenant: str | None,
               target_engine_key: Any, registered: Mapping[bytes, list[Any]], fsdir: str) -> None:
    """The actions of one complete block at another TP (the scan's `StoreFile`s): a
    `reshard` on its primary object (key rank 0, SGLang's `_k`) with the bytes of every
    target object, the others `part_of_action`; `needs_reshard` naming why it cannot run;
    `already_present` once every target key holds an object of the target size;
    `target_occupied` when another block's object holds one."""
    from kvmigrate import findings as fd

    by: dict[tuple, Any] = {}
    for o in objs:  # (of an entry in place and a misfiled copy of it, the one a client reads)
        if o.status == "ok" or o.key_rank not in by:
            by[o.key_rank] = o
    halves = tuple(sorted({h for _, h in by}))
    primary = by[(0, halves[0])]

    def mark(o: Any, action: str, text: str, finding: Any, target: str | None = None, key: bytes | None = None) -> None:
        o.action, o.target, o.target_key = action, target, key
        o.reason = fd.Reason(text, finding)

    def followers(action: str) -> None:
        for o in objs:
            if o is not primary:
                mark(o, "none", f"read by key rank 0's {action}",
                     fd.Finding(fd.PART_OF_ACTION, primary_rank=0, of_action=action))

    for half in halves:
        sizes = [value_size(by[(r, half)]) if (r, half) in by else 0 for r in range(n_s)]
        why = problem(sizes, n_s, n_t, geo)
        if why is not None:
            mark(primary, "needs_reshard", f"reshard from {n_s} to {n_t} key ranks: {why}", fd.Finding(fd.TRANSFORM))
            followers("needs_reshard")
            return
    rank0 = target_engine_key(M.parse_storage_key(primary.object_key or b"").engine)  # (its target model and prefix)
    outs = outputs(engine, rank0, primary.client, n_t, halves, tenant, value_size(primary), n_s, geo)
    present, _displaced, other = holders(outs, registered, {id(o) for o in objs})
    first = outs[0]
    kventry = primary.object_index is None
    target = (_join(first.client, M.fpk(first.key, fsdir)) if kventry else (first.client + "/" if first.client
                                                                              else "./"))
    total = sum(o.size for o in outs)
    if present == len(outs):
        mark(primary, "already_present", f"every object of its reshard to {n_t} key ranks is present",
             None, target, first.key)
    elif other is not None:
        mark(primary, "none", f"a target key of its reshard is held by another object ({other.relpath}): never "
             "overwritten", fd.Finding(fd.TARGET_OCCUPIED, aliases_relpath=other.relpath, of_action="reshard"),
             target, first.key)
    else:
        mark(primary, "reshard", f"reshard of the head shards from {n_s} to {n_t} key ranks ({len(outs)} objects, "
             f"{total} bytes)", fd.Finding(fd.TRANSFORM, output_bytes=total), target, first.key)
    followers(str(primary.action))


def value_size(o: Any) -> int:
    """An object's value bytes: an index entry's row size, a KVEntry's value (its row is the file)."""
    return int(o.size if o.object_index is not None else (o.value_size or 0))


def _join(client: str, rel: str) -> str:
    return f"{client}/{rel}" if client else rel
