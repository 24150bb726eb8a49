"""What an LMCache tier's chunks become for the target deployment (lmcache.md §3.1, §3.4-§3.6):
the names the target looks up, and each chunk's action by the rank-row rule (§4).

The scan asks `plan_tier` once a tier's files have their statuses; the migration plan
asks `tier_spec` (the bytes a `reshard` or `rewrite_header` output holds, re-proven from
the namespace's fields and facts, the names and the source size) and `expanded_targets`
(every file an action writes, from the one target its row names). One source for both:
the scan's `output_bytes` and the plan's are the same function's.

A chunk hash is never recomputed: a target name keeps the source's hash, and only rows
whose recipe §3.2 proved equal (status `ok`, or `index_lost` for a conversion) are placed.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import xxhash

from kvmigrate import findings as fd
from kvmigrate.formats import lmcache as L
from kvmigrate.fsio import hash_file, open_noatime
from kvmigrate.identity.facts import Facts
from kvmigrate.transforms import TransformError
from kvmigrate.transforms_lmcache import HEADER_BYTES, TierSpec, write_tier

MP_MLA_RANK = 0x01000100  # an MP MLA key's kv_rank at every TP (§1.2)
PLACEABLE = ("ok",)


@dataclass(frozen=True)
class TargetSide:
    """The deployment that reads the tier next, for one source deployment (§3.1, §3.3)."""

    backend: str
    model: str
    ws: int
    wids: tuple[int, ...]  # the worker ids that look a chunk up
    kind: str | None  # mla | full
    header: str  # raw | fs | gds: what precedes a target payload
    convert: bool = False  # a local_disk chunk written as an fs chunk (§3.5)
    reshard: bool = False  # a non-MLA TP change (§3.4)
    rewrites: bool = False  # an fs chunk's header added or stripped (its name is kept)

    @property
    def needs_dest(self) -> bool:
        """Outputs that keep a source's name or change the backend go only into --dest DIR (§3.6)."""
        return self.convert or self.rewrites


class NotPlanned(Exception):
    """The facts do not decide the target: `why`, and the flags that would (`asks`)."""

    def __init__(self, why: str, asks: str | None = None) -> None:
        super().__init__(why)
        self.why = why
        self.asks = asks


def _src_header(backend: str, fs_header: bool | None) -> str:
    return "gds" if backend == "gds" else "fs" if backend == "fs" and fs_header else "raw"


def target_side(dep: Any) -> TargetSide | None:
    """The target of a deployment (None: nothing to plan: another scheme's names, a
    local_disk tier not converted). Raises NotPlanned where the facts do not decide it."""
    f: Facts = dep.facts
    if dep.scheme not in ("lmc-k3", "lmc-mp1"):
        return None
    convert = dep.backend == "local_disk" and f.target_backend == "fs"
    if dep.backend == "local_disk" and not convert:
        return None
    backend = "fs" if convert else dep.backend
    model = f.target_model_name or dep.model
    whys: list[str] = []
    asks: list[str] = []
    if dep.backend == "local_disk" and "-" in dep.model and (convert or f.target_model_name):
        # the name spells `/` as `-`: the model is matched, never decoded (§1.3)
        if f.target_model_name:
            model = f.target_model_name
        elif f.model_name and L.local_disk_model_matches(f.model_name, dep.model):
            model = f.model_name
        else:
            whys.append(f"the local_disk name spells the model {dep.model!r} with '-' for '/': a conversion must "
                        "spell it as `vllm serve` names it")
            asks.append("--model-name")
    kind = dep.kv_kind or f.kv_kind
    if backend == "fs":
        want = f.target_save_chunk_meta
        header = ("fs" if want else "raw") if want is not None else (
            "fs" if convert or dep.fs_header else "raw")
    else:
        header = "gds" if backend == "gds" else "raw"
    if kind is None and header == "fs" and (convert or dep.backend == "fs" and not dep.fs_header):
        whys.append("a RemoteMetadata header states the chunk's format: the kv kind decides it")
        asks.append("--kv-kind")
    if whys:  # (every fact the target waits for, asked at once)
        raise NotPlanned("; ".join(whys), fd.asks(*asks))
    side = _side(dep, f, backend, model, kind, header, convert)
    if side is not None and backend == "fs" and not convert and header != _src_header(dep.backend, dep.fs_header):
        side = replace(side, rewrites=True)
    return side


def _side(dep: Any, f: Facts, backend: str, model: str, kind: str | None, header: str,
          convert: bool) -> TargetSide | None:
    """The target names (§3.1) of a deployment whose backend, model and header are decided."""
    writer_sofr = dep.ws == 1
    n = f.target_tp
    if dep.scheme == "lmc-mp1":
        if kind is None and n is not None and n != dep.ws:
            raise NotPlanned("the kv kind decides an MP key's kv_rank at another TP", fd.asks("--kv-kind"))
        if kind == "mla" or dep.ws == 1 and n in (None, 1):
            return TargetSide(backend, model, dep.ws, (0,), kind, header)
        n = n or dep.ws
        if n != dep.ws and L.mp_dcp(dep.model) is not None:
            raise NotPlanned("a DCP layout (the model's ##lmcache-dcp-layout suffix) splits heads another way: "
                             "never re-sharded (§3.4)")
        return TargetSide(backend, model, n, tuple(range(n)), kind, header, reshard=n != dep.ws)
    sofr = f.target_save_only_first_rank
    changes = (n is not None and n != dep.ws) or (sofr is not None and sofr != writer_sofr)
    if kind is None:
        if changes:
            raise NotPlanned("the kv kind decides the target names at another TP or save_only_first_rank "
                             "(MLA collapses ws to 1, a GQA chunk is re-sharded)", fd.asks("--kv-kind"))
        return TargetSide(backend, model, dep.ws, tuple(range(dep.ws)), kind, header, convert=convert)
    if kind == "mla":
        sofr = writer_sofr if sofr is None else sofr
        if sofr:
            return TargetSide(backend, model, 1, (0,), kind, header, convert=convert)
        if n is None:
            if writer_sofr:
                raise NotPlanned("MLA without save_only_first_rank at the target: its TP names every key",
                                 fd.asks("--target-tp"))
            n = dep.ws
        # fs aliases MLA ranks to worker 0 (remote_enable_mla_worker_id_as0); GDS and local_disk do not (§3.1)
        wids = (0,) if backend == "fs" else tuple(range(n))
        return TargetSide(backend, model, n, wids, kind, header, convert=convert)
    n = n or dep.ws
    return TargetSide(backend, model, n, tuple(range(n)), kind, header, convert=convert, reshard=n != dep.ws)


def target_key(key: L.Key, side: TargetSide, wid: int) -> L.Key:
    """The key the target deployment's worker `wid` looks a source chunk up by (§3.1):
    the source's hash, dtype and tags, the target's model, ws and worker id."""
    if key.scheme != "lmc-mp1" and (key.model, key.ws, key.wid) == (side.model, side.ws, wid):
        return key  # (most chunks: the target reads them under their own key)
    if key.scheme == "lmc-mp1":
        rank = MP_MLA_RANK if side.kind == "mla" else L.kv_rank(side.ws, wid)
        return replace(key, model=side.model, ws=rank >> 24, wid=(rank >> 16) & 0xFF, kv_rank=rank)
    return replace(key, model=side.model, ws=side.ws, wid=wid)


def target_relpath(tier: str, key: L.Key, side: TargetSide, *, sidecar: bool = False) -> str:
    """Where the target deployment finds a chunk, from the root (or from --dest, §3.6)."""
    if side.backend == "gds":
        rel = L.gds_relpath(key, gds_quoted=True, sidecar=sidecar)
    else:
        rel = L.file_name(key, side.backend)
    return rel if tier == "." else f"{tier}/{rel}"


def _own_name(f: Any, key: L.Key, side: TargetSide) -> bool:
    """The target's name of a chunk file is its own: the same key, backend and spelling (a
    quoted GDS name, an fs `-SEP-` name) in the folders its writer derives."""
    c = f.chunk
    return (key is c.key and side.backend == c.backend and c.model_exact and c.quoted is not False
            and not c.sidecar)


def target_label(tier: str, dep: Any, side: TargetSide) -> str:
    """§4's `target_base`: the label a rescan gives the target deployment's chunks."""
    probe = L.Key(dep.scheme, side.model, side.ws, 0, "0", dep.dtype, dep.tags, group=dep.group)
    if dep.scheme == "lmc-mp1":
        rank = MP_MLA_RANK if side.kind == "mla" else L.kv_rank(side.ws, 0)
        probe = replace(probe, ws=rank >> 24, kv_rank=rank)
    return deployment_label(tier, L.ChunkName(side.backend, probe, ""))


def deployment_label(tier: str, chunk: L.ChunkName) -> str:
    """§4's `source_base`/`deployment` of a chunk's file."""
    k = chunk.key
    if k.scheme == "lmc-mp1":
        return f"lmcache:{tier}:mp:{k.model}:lmc-mp1:ws{k.ws}:g{k.group or 0:x}"
    out = f"lmcache:{tier}:{chunk.backend}:{k.model}:{k.scheme}:ws{k.ws}"
    if k.dtype:
        out += f":{k.dtype}"
    if k.tags:
        out += ":" + "@".join(f"{t}%{v}" for t, v in k.tags)
    return out


# --- the bytes of one output --------------------------------------------------------------

def tier_spec(fields: Mapping[str, Any], facts: Facts, action: str, size: int, target: str) -> TierSpec:
    """The file `action` writes at `target` from a source file of `size` bytes (a reshard:
    rank 0's; every rank's is the same), re-proven from the deployment's fields and facts.
    Raises NotPlanned naming what is missing or inconsistent."""
    name = target.rsplit("/", 1)[-1]
    chunk = L.parse_name(name)
    if chunk is None:
        raise NotPlanned(f"{target!r} is no LMCache chunk name")
    src_header = _src_header(str(fields.get("backend")), fields.get("fs_header"))
    if chunk.sidecar:
        dst_header = "sidecar"
    elif chunk.backend == "gds":
        dst_header = "gds"
    elif chunk.backend == "fs":
        dst_header = str(fields.get("target_header") or "raw")
    else:
        dst_header = "raw"
    kind = fields.get("kv_kind") or facts.kv_kind
    dtype = fields.get("dtype") or L.KEY_DTYPE_OF_TORCH.get(str(facts.model_dtype))  # (an MP name carries none)
    if kind not in ("mla", "full"):
        raise NotPlanned("the kv kind is not known", fd.asks("--kv-kind"))
    if dtype is None:
        raise NotPlanned("the KV cache dtype is not in an MP name", fd.asks("--model-dtype"))
    if dtype not in L.DTYPE_BYTES:
        raise NotPlanned(f"dtype {dtype!r} is not one LMCache writes a payload of")
    b = L.DTYPE_BYTES[str(dtype)]
    k = 1 if kind == "mla" else 2
    payload = size - HEADER_BYTES[src_header]
    ws = int(fields.get("ws") or 1)
    if payload <= 0:
        raise NotPlanned(f"a {size}-byte file holds no payload after its {HEADER_BYTES[src_header]}-byte header")
    fmt = L.memory_format(kind == "mla")
    if action == "reshard":
        asks = [flag for fact, flag in (("total_kv_heads", "--total-kv-heads"), ("head_dim", "--head-dim"),
                                        ("layers", "--layers")) if getattr(facts, fact) is None]
        if asks:
            raise NotPlanned("a reshard needs the model's total KV heads, head size and layers", fd.asks(*asks))
        H, D, layers = int(facts.total_kv_heads or 0), int(facts.head_dim or 0), int(facts.layers or 0)
        n = int(fields.get("target_ws") or ws)
        if H % ws and ws % H or H % n and n % H:
            raise NotPlanned(f"total_kv_heads {H} with source TP {ws} and target TP {n}: neither divides the other")
        hidden = max(1, H // ws) * D
        row = k * layers * hidden * b
        if payload % row:
            raise NotPlanned(f"a {payload}-byte payload is not a whole number of tokens of {row} bytes "
                             f"(2·L·h·D·b with L={layers}, h={max(1, H // ws)}, D={D})")
        spec = TierSpec("reshard", "full", ws, str(dtype), layers, payload // row, hidden, src_header, dst_header,
                        tp_dst=n, dst_rank=chunk.key.wid, total_kv_heads=H, head_dim=D, fmt=fmt)
    else:
        given_layers = facts.layers
        given_hidden = facts.latent_dim if kind == "mla" else (
            max(1, facts.total_kv_heads // ws) * facts.head_dim if facts.total_kv_heads and facts.head_dim else None)
        if dst_header == "raw" and not (given_layers and given_hidden):  # (a stripped header needs no shape)
            given_layers, given_hidden = 1, payload // (k * b)
        if not (given_layers and given_hidden):
            asks = ["--layers"] if not given_layers else []
            asks += (["--latent-dim"] if kind == "mla" else ["--total-kv-heads", "--head-dim"]) if not given_hidden \
                else []
            raise NotPlanned("a header states the payload's shape: the layers and the row width are needed",
                             fd.asks(*asks))
        layers, hidden = int(given_layers), int(given_hidden)
        row = k * layers * hidden * b
        if payload % row:
            raise NotPlanned(f"a {payload}-byte payload is not a whole number of tokens of {row} bytes")
        spec = TierSpec("rewrite_header", str(kind), 1, str(dtype), layers, payload // row, hidden, src_header,
                        dst_header, fmt=fmt)
    try:
        spec.check()
    except TransformError as exc:
        raise NotPlanned(str(exc)) from None
    return spec


def expanded_targets(fields: Mapping[str, Any], action: str, target: str) -> list[str]:
    """Every file an action writes, from the first target its row names (§4: "the plan
    derives the others from §3.1"): every target worker's name of an MLA link or of a
    reshard, each GDS data file followed by its sidecar."""
    head, _, name = target.rpartition("/")
    chunk = L.parse_name(name)
    if chunk is None:
        return [target]
    wids = [int(w) for w in fields.get("target_wids") or [chunk.key.wid]]
    many = action == "reshard" or fields.get("kv_kind") == "mla"
    out = []
    for wid in (wids if many else [chunk.key.wid]):
        key = replace(chunk.key, wid=wid)
        if key.scheme == "lmc-mp1":
            rank = MP_MLA_RANK if fields.get("kv_kind") == "mla" else L.kv_rank(key.ws, wid)
            key = replace(key, kv_rank=rank)
        tier = str(fields.get("tier") or ".")
        prefix = "" if tier == "." else tier + "/"
        if chunk.backend == "gds":
            rel = prefix + L.gds_relpath(key, gds_quoted=True, suffix=chunk.suffix)
            out += [rel, rel + L.SIDECAR]
        else:
            out.append(head + "/" + L.file_name(key, chunk.backend) if head else L.file_name(key, chunk.backend))
    return out


# --- the scan: every chunk's action --------------------------------------------------------

def plan_tier(tier: str, deps: Iterable[Any], files: Iterable[Any]) -> None:
    """Give every chunk of the tier's deployments its action and target (§3.4, §4's
    rank-row rule); rows that are not placed keep action `none` and say why."""
    deps = list(deps)
    present = {f.relpath: f for f in files}
    plan_sides(deps)
    plan_files(tier, deps, [f for dep in deps for f in dep.files], present)


def plan_sides(deps: Iterable[Any]) -> None:
    """Each deployment's target (`side`), or why the facts do not decide it (`needs_target`)."""
    for dep in deps:
        try:
            dep.side = target_side(dep)
        except NotPlanned as np:
            dep.needs_target = np


def plan_files(tier: str, deps: Iterable[Any], files: Iterable[Any], present: Mapping[str, Any]) -> None:
    """`plan_tier` for some of the deployments' files: every file of a chunk hash among
    them, and `present` every file at a name their targets look up (a scan plans a tier a
    partition of chunk hashes at a time)."""
    of_dep: dict[str, list[Any]] = defaultdict(list)
    for f in files:
        of_dep[f.deployment].append(f)
    for dep in deps:
        dfiles = of_dep.get(dep.label)
        if not dfiles:
            continue
        np = dep.needs_target
        if np is not None:
            convert = dep.facts.target_backend == "fs"
            for f in dfiles:
                if (f.status in PLACEABLE or convert and f.status == "index_lost") and fd.finding_of(f.reason) is None:
                    f.reason = fd.Reason(f"{f.reason}; not planned: {np.why}",
                                         fd.Finding(fd.NEEDS_FACT, asks=np.asks) if np.asks else None)
            continue
        side = dep.side
        if side is None:
            continue
        chunks: dict[Any, list[Any]] = defaultdict(list)
        for f in dfiles:
            if f.chunk is not None and f.block_hash is not None:
                chunks[f.block_hash].append(f)
        for cfiles in chunks.values():
            _plan_chunk(tier, dep, side, cfiles, present)


def _placeable(f: Any, side: TargetSide) -> bool:
    """A whole chunk file whose recipe §3.2 proved (a `needs_fact` row waits for its facts)."""
    found = fd.finding_of(f.reason)
    if found is not None and found.code == fd.NEEDS_FACT:
        return False
    return f.status == "ok" or side.convert and f.status == "index_lost"


def _plan_chunk(tier: str, dep: Any, side: TargetSide, cfiles: list[Any], present: Mapping[str, Any]) -> None:
    datas = sorted((f for f in cfiles if not f.chunk.sidecar), key=lambda f: (f.rank or 0, not f.chunk.quoted))
    good = [f for f in datas if _placeable(f, side)]
    if not good:
        return
    if side.kind != "mla" and not side.reshard:
        _plan_per_rank(dep, side, datas, good, present, tier)
        _plan_sidecars(cfiles)
        return
    key0 = good[0].chunk.key
    targets = [target_relpath(tier, target_key(key0, side, w), side) for w in side.wids]
    if side.kind == "mla":
        _plan_copies(dep, side, good, targets, present)
    else:
        _plan_reshard(dep, side, datas, good, targets, present)
    _plan_sidecars(cfiles)


def _action(side: TargetSide, dep: Any) -> str:
    changes_header = side.header != _src_header(dep.backend, dep.fs_header) and side.backend != "gds"
    return "rewrite_header" if changes_header else "link"


def _majority(copies: list[Any]) -> list[Any]:
    """The copies a strict majority of the hashed copies agrees with (all of them when some
    copy was not hashed: the apply compares them); the others are marked replica_mismatch."""
    if len(copies) < 2 or any(f.content is None for f in copies):
        return copies
    groups: dict[bytes, list[Any]] = defaultdict(list)
    for f in copies:
        groups[f.content].append(f)
    best = max(groups.values(), key=len)
    keep = best if 2 * len(best) > len(copies) else []
    for f in copies:
        if not any(f is k for k in keep):
            f.status = "replica_mismatch"
            f.reason = fd.Reason(f"{f.reason}; MLA copy differs from " + (
                f"the {len(keep)} of {len(copies)} copies that agree" if keep else "the others, and no majority "
                "agrees: none is placed"))
    return keep


def _unproven_rewrite(dep: Any, side: TargetSide, action: str, f: Any, target: str) -> bool:
    """A header rewrite the facts do not prove (its shape): the row says what it waits for."""
    if action != "rewrite_header":
        return False
    try:
        tier_spec(tier_fields(dep, side), dep.facts, action, f.size, target)
    except NotPlanned as np:
        _mark(f, "none", None, f"{action} not planned: {np.why}",
              fd.Finding(fd.NEEDS_FACT, asks=np.asks) if np.asks else None)
        return True
    return False


def _same_bytes(a: Any, b: Any, root: str | None, read: dict[str, bytes] | None = None) -> bool:
    """Two tier files hold the same bytes: one inode, equal content hashes, or (the scan
    did not hash them: a copy `--mode copy` made) equal sizes and equal hashes read now;
    `read` keeps what was read (a file compared with several is read once)."""
    if (a.dev, a.inode) == (b.dev, b.inode):
        return True
    if a.size != b.size:
        return False
    read = {} if read is None else read
    try:
        digests = []
        for f in (a, b):
            if f.content is None and f.relpath not in read:
                if root is None:
                    return False
                read[f.relpath] = hash_file(os.path.join(root, f.relpath))[0]
            digests.append(f.content if f.content is not None else read[f.relpath])
    except OSError:
        return False
    return bool(digests[0] == digests[1])


def _mark(f: Any, action: str, target: str | None, text: str, finding: fd.Finding | None = None) -> None:
    f.action, f.target = action, target
    f.reason = fd.Reason(f"{f.reason}; {text}" if f.reason else text, finding)


def _plan_copies(dep: Any, side: TargetSide, good: list[Any], targets: list[str], present: Mapping[str, Any]) -> None:
    """MLA: every copy is the whole chunk; one verified copy (the lowest rank) serves every
    target name (§3.1); the others are its replicas. Copies the scan hashed that differ: the
    copy a majority agrees with serves, the others are `replica_mismatch`; without a
    majority none is placed (§3.4)."""
    good = _majority(good)
    if not good:
        return
    primary = good[0]
    action = _action(side, dep)
    occupied = None
    have = 0
    read: dict[str, bytes] = {}  # (the copy is read at most once, however many names hold it)
    if not side.needs_dest:
        for t in targets:
            there = present.get(t)
            if there is None:
                continue
            if any(there is g for g in good) or action == "link" and _same_bytes(there, primary, dep.root, read):
                have += 1
            else:
                occupied = occupied or t
    if _unproven_rewrite(dep, side, action, primary, targets[0]):
        return
    if have == len(targets):
        _mark(primary, "already_present", targets[0], "the target looks this chunk up by "
              + ("this very name" if targets == [primary.relpath] else f"{len(targets)} name(s), all present"))
    elif occupied is not None:
        _mark(primary, "none", targets[0], "a target name (aliases_relpath) holds other bytes: never overwritten",
              fd.Finding(fd.TARGET_OCCUPIED, aliases_relpath=occupied, of_action=action))
    else:
        _mark(primary, action, targets[0], f"MLA copy: {action} to {len(targets)} target name(s) of "
              f"ws {side.ws}" + (" (a local_disk chunk converted to fs, §3.5)" if side.convert else ""))
    for f in good[1:]:
        _mark(f, "none", None, f"copy of rank {primary.rank}'s chunk file",
              fd.Finding(fd.REPLICA_OF_PRIMARY, primary_rank=primary.rank))


def _plan_per_rank(dep: Any, side: TargetSide, datas: list[Any], good: list[Any], present: Mapping[str, Any],
                   tier: str) -> None:
    """Non-MLA at the same TP: each rank's file to its own target name (a model rename, a
    GDS `_` name, a header change, a conversion). Each rank looks its own shard up, so a
    missing rank's file does not stop the others."""
    action = _action(side, dep)
    for f in good:
        key = target_key(f.chunk.key, side, int(f.rank or 0))
        t = f.relpath if _own_name(f, key, side) else target_relpath(tier, key, side)
        there = None if side.needs_dest else present.get(t)
        if _unproven_rewrite(dep, side, action, f, t):
            continue
        if t == f.relpath and not side.needs_dest:
            _mark(f, "already_present", t, "the target looks this chunk up by this very name")
        elif there is not None and action == "link" and _same_bytes(there, f, dep.root):
            _mark(f, "already_present", t, "present at its target name")
        elif there is not None:
            _mark(f, "none", t, "its target name holds other bytes: never overwritten",
                  fd.Finding(fd.TARGET_OCCUPIED, aliases_relpath=t, of_action=action))
        else:
            _mark(f, action, t, f"{action} of rank {f.rank}'s head shard to its target name")


def _plan_reshard(dep: Any, side: TargetSide, datas: list[Any], good: list[Any], targets: list[str],
                  present: Mapping[str, Any]) -> None:
    """A non-MLA chunk at another TP: every source rank's shard re-split along the head
    axis into one file per target rank (§3.4), never a rename."""
    by_rank = {int(f.rank or 0): f for f in reversed(good)}
    missing = [r for r in range(dep.ws) if r not in by_rank]
    if missing:
        for f in good:
            f.status = "incomplete"
            _mark(f, "none", None, f"rank file(s) {missing} of ws {dep.ws} missing or damaged: never resharded")
        return
    primary = by_rank[0]
    fields = tier_fields(dep, side)
    try:
        tier_spec(fields, dep.facts, "reshard", primary.size, targets[0])
    except NotPlanned as np:
        _mark(primary, "needs_reshard", targets[0], f"reshard TP {dep.ws} -> {side.ws}: {np.why}",
              fd.Finding(fd.NEEDS_FACT if np.asks else fd.TRANSFORM, asks=np.asks))
        for f in good:
            if f is not primary:
                _mark(f, "none", None, f"part of rank {primary.rank}'s needs_reshard",
                      fd.Finding(fd.PART_OF_ACTION, primary_rank=0, of_action="needs_reshard"))
        return
    sizes = {f.size for f in by_rank.values()}
    if len(sizes) > 1:
        _mark(primary, "needs_reshard", targets[0], f"the rank files differ in size ({sorted(sizes)}): a reshard "
              "reads equal shards", fd.Finding(fd.TRANSFORM))
        return
    outputs = expanded_targets(fields, "reshard", targets[0])
    have = 0
    occupied = None
    for t in outputs:
        there = present.get(t)
        if there is None:
            continue
        if _expected_matches(dep, fields, [by_rank[r] for r in range(dep.ws)], t, there):
            have += 1
        else:
            occupied = occupied or t
    total = sum(tier_spec(fields, dep.facts, "reshard", primary.size, t).output_size for t in outputs)
    if have == len(outputs):
        _mark(primary, "already_present", targets[0], f"every file of its reshard to ws {side.ws} is present")
    elif occupied is not None:
        _mark(primary, "none", targets[0], "a target name (aliases_relpath) holds other bytes: never overwritten",
              fd.Finding(fd.TARGET_OCCUPIED, aliases_relpath=occupied, of_action="reshard"))
    else:
        _mark(primary, "reshard", targets[0], f"reshard of the head shards from ws {dep.ws} to {side.ws} "
              f"({len(outputs)} files, {total} bytes)", fd.Finding(fd.TRANSFORM, output_bytes=total))
    for r in range(1, dep.ws):
        _mark(by_rank[r], "none", None, f"read by rank 0's {primary.action}",
              fd.Finding(fd.PART_OF_ACTION, primary_rank=0, of_action=primary.action))


def _expected_matches(dep: Any, fields: Mapping[str, Any], sources: list[Any], target: str, there: Any) -> bool:
    """Whether an existing file at a reshard's output name holds exactly what it would write."""
    try:
        spec = tier_spec(fields, dep.facts, "reshard", sources[0].size, target)
    except NotPlanned:
        return False
    if there.size != spec.output_size or dep.root is None:
        return False
    w = _Hasher()
    fds: list[int] = []
    try:
        for f in sources:
            fds.append(open_noatime(os.path.join(dep.root, f.relpath)))
        write_tier(spec, fds, w)
        return w.h.digest() == hash_file(os.path.join(dep.root, there.relpath))[0]
    except (OSError, TransformError):
        return False
    finally:
        for x in fds:
            os.close(x)


class _Hasher:
    def __init__(self) -> None:
        self.h = xxhash.xxh3_128()

    def write(self, data: Any) -> int:
        self.h.update(data)
        return len(data)


def _plan_sidecars(cfiles: list[Any]) -> None:
    """A GDS sidecar goes with its data file (§4): placed, verified, rolled back and pruned
    with it, after it; the sidecar of an acting data file names its own target, the sidecar
    of a replica or of a reshard's other source points at the same primary as its data file."""
    by_path = {f.relpath: f for f in cfiles}
    for s in cfiles:
        if not s.chunk.sidecar or s.status != "ok":
            continue
        data = by_path.get(s.relpath[: -len(L.SIDECAR)])
        if data is None:
            continue
        found = fd.finding_of(data.reason)
        if data.target is not None and data.action not in ("none", "needs_reshard"):
            _mark(s, "none", data.target + L.SIDECAR, "the sidecar of its data file: placed after it",
                  fd.Finding(fd.PART_OF_ACTION, primary_rank=data.rank, of_action=data.action))
        elif data.action == "none" and found is not None and found.code in fd.SECONDARY:
            _mark(s, "none", None, f"the sidecar of its data file ({found.code})",
                  fd.Finding(found.code, primary_rank=found.primary_rank, of_action=found.of_action))


def tier_fields(dep: Any, side: TargetSide | None) -> dict[str, Any]:
    """The namespace fields the plan re-proves an action from (the manifest keeps them)."""
    out: dict[str, Any] = {"backend": dep.backend, "fs_header": dep.fs_header, "kv_kind": dep.kv_kind or dep.facts.kv_kind,
                           "dtype": dep.dtype, "ws": dep.ws, "tier": dep.tier}
    if side is not None:
        out.update({"target_ws": side.ws, "target_wids": list(side.wids), "target_header": side.header,
                    "target_backend": side.backend, "needs_dest": side.needs_dest,
                    "joint_ranks": side.kind == "mla" or side.reshard})
    return out
