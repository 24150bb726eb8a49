"""Synthetic SGLang HiCache `file` directories (docs/sglang.md), written as the released
HiCacheFile writes them, independently of kvmigrate/families/sglang.py (the synth is the
oracle its tests compare against).

Names (sglang.md §1, reference/sglang-format.md §1.3): era `e1` `{hash}.bin` (one file,
every TP rank writes the same name; torch.save zip); `e2` `{hash}.bin` at TP=1 else
`{hash}_{r}_{N}.bin` (MLA: identical copies per rank); `e3` non-MLA as e2, MLA
`{hash}.bin` (rank 0 only); `e4` `{hash}[.pool]_{model}[_{r}_{N}][_{pp}_{pr}][_cp{r}_{s}]
[_tp{N}_dcp{d}_{D}_page{P}].bin` (TP pair for non-MLA and for `.mamba`). Bytes: one page
of `[2, L, P, H, D]` (MHA, H = KV heads of the rank) or `[L, P, 1, dim]` (MLA) in the
writer layout (`layer_first`, `page_first`: `[2, P, L, H, D]` / `[P, L, 1, dim]`), dtype
2 bytes; the full page (all heads, all layers) is one SHAKE-256 stream per page hash, so
every shard and stage is a slice of it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from kvmigrate.synth.pages import block_hash_hex, deterministic_int

ERAS = ("e1", "e2", "e3", "e4")
TOTAL_KV_HEADS = 8
HEAD_DIM = 4
LATENT_DIM = 8
DTYPE_BYTES = 2
DEFECTS = ("missing_rank", "replica_differs", "size_mismatch", "short", "zero_filled", "unreadable",
           "foreign", "symlink", "tmp_sglang", "tmp_sglang_old", "zip_payload")
ZIP = b"PK\x03\x04"


def geometry(spec: Any) -> dict[str, int]:
    """L (this stage's layers), P, H (heads per rank), D, dim, b of the spec's pages."""
    return {"L": spec.layers // spec.pp, "P": spec.block_tokens, "H": max(1, TOTAL_KV_HEADS // spec.tp),
            "D": HEAD_DIM, "dim": LATENT_DIM, "b": DTYPE_BYTES}


def page_size(spec: Any) -> int:
    g = geometry(spec)
    if spec.kv_kind == "mla":
        return g["L"] * g["P"] * g["dim"] * g["b"]
    return 2 * g["L"] * g["P"] * g["H"] * g["D"] * g["b"]


def _elements(spec: Any, hex_hash: str, pool: str | None) -> bytes:
    """The full page of a hash (every layer, every head) in layer_first order, as bytes."""
    g = geometry(spec)
    heads = 1 if spec.kv_kind == "mla" else TOTAL_KV_HEADS
    width = g["dim"] if spec.kv_kind == "mla" else g["D"]
    halves = 1 if spec.kv_kind == "mla" else 2
    n = halves * spec.layers * g["P"] * heads * width * g["b"]
    return hashlib.shake_256(f"sglang-synth:{spec.model_name}:{spec.seed}:{hex_hash}:{pool}".encode()).digest(n)


def page_bytes(spec: Any, hex_hash: str, *, pool: str | None = None, tp_rank: int = 0, pp_rank: int = 0,
               layout: str = "layer_first", shard: int = 0) -> bytes:
    """The bytes rank (tp_rank, pp_rank) writes for a page: its head shard and its stage's
    layers of the full page, in the writer layout. `shard` (CP/DCP rank) salts the bytes:
    each such rank holds a disjoint slice."""
    g = geometry(spec)
    full = _elements(spec, hex_hash + (f":{shard}" if shard else ""), pool)
    b, P, L_all = g["b"], g["P"], spec.layers
    mla = spec.kv_kind == "mla"
    heads, width = (1, g["dim"]) if mla else (TOTAL_KV_HEADS, g["D"])
    halves = 1 if mla else 2
    cell = width * b  # one head of one token of one layer
    layers = range(pp_rank * g["L"], (pp_rank + 1) * g["L"])
    if mla:
        head_set = [0]
    elif spec.tp <= TOTAL_KV_HEADS:
        head_set = list(range(tp_rank * g["H"], (tp_rank + 1) * g["H"]))
    else:
        head_set = [tp_rank // (spec.tp // TOTAL_KV_HEADS)]

    def at(half: int, layer: int, token: int, head: int) -> bytes:
        off = (((half * L_all + layer) * P + token) * heads + head) * cell
        return full[off:off + cell]

    out = bytearray()
    for half in range(halves):
        if layout == "page_first":
            order = ((layer, token) for token in range(P) for layer in layers)
        else:
            order = ((layer, token) for layer in layers for token in range(P))
        for layer, token in order:
            for head in head_set:
                out += at(half, layer, token, head)
    return bytes(out)


def name(spec: Any, hex_hash: str, *, era: str, pool: str | None = None, tp_rank: int = 0, pp_rank: int = 0,
         cp_rank: int = 0, dcp_rank: int = 0) -> str:
    """The file name the writer of `era` gives a page (HiCacheFile, 0.5.23 L748-771)."""
    mla = spec.kv_kind == "mla"
    if era == "e1":
        return f"{hex_hash}.bin"
    if era in ("e2", "e3"):
        if era == "e3" and mla:
            return f"{hex_hash}.bin"
        return f"{hex_hash}_{tp_rank}_{spec.tp}.bin" if spec.tp > 1 else f"{hex_hash}.bin"
    model = "-".join(spec.model_name.split("/"))
    shard = f"_{spec.pp}_{pp_rank}" if spec.pp > 1 else ""
    if spec.cp > 1:
        shard += f"_cp{cp_rank}_{spec.cp}"
    tp_suffix = f"_{model}_{tp_rank}_{spec.tp}{shard}"
    suffix = f"_{model}{shard}" if mla else tp_suffix
    if spec.dcp > 1:
        dcp = f"_tp{spec.tp}_dcp{dcp_rank}_{spec.dcp}_page{spec.block_tokens}"
        suffix += dcp
        tp_suffix += dcp
    key = hex_hash if pool is None else f"{hex_hash}.{pool}"
    return f"{key}{tp_suffix if pool == 'mamba' else suffix}.bin"


def writers(spec: Any, era: str, pool: str | None) -> list[dict[str, int]]:
    """Every (tp, pp, cp, dcp) rank that writes a file of a page (MLA: the storage writer only)."""
    mla = spec.kv_kind == "mla"
    if era == "e1":
        return [{"tp_rank": 0}]
    tps = range(spec.tp)
    if mla and pool != "mamba" and era != "e2":
        tps = range(1)
    out = []
    for pp_rank in range(spec.pp):
        for cp_rank in range(spec.cp):
            for dcp_rank in range(spec.dcp):
                for tp_rank in tps:
                    out.append({"tp_rank": tp_rank, "pp_rank": pp_rank, "cp_rank": cp_rank, "dcp_rank": dcp_rank})
    return out


def check(spec: Any) -> None:
    def bad(msg: str) -> None:
        raise ValueError(f"synth: {msg}")

    if spec.sgl_era not in ERAS:
        bad(f"sgl_era must be one of {', '.join(ERAS)}, got {spec.sgl_era!r}")
    if spec.sgl_era != "e4" and (spec.pp > 1 or spec.cp > 1 or spec.dcp > 1 or spec.pools):
        bad("pp, cp, dcp and pools need sgl_era e4 (SGLang 0.5.10+)")
    if spec.dcp > 1 and spec.kv_kind != "mla":
        bad("dcp > 1 needs kv_kind mla (HiCacheStorageConfig rejects DCP without MLA)")
    if spec.layers % spec.pp:
        bad(f"layers ({spec.layers}) must be divisible by pp ({spec.pp})")
    if spec.hash_len != 64:
        bad("SGLang page keys are 64 hex chars: hash_len must be 64")
    for d in spec.defects:
        if d not in DEFECTS:
            bad(f"defect {d!r} is not one SGLang directories carry; known: {', '.join(DEFECTS)}")
    if "replica_differs" in spec.defects and not (spec.sgl_era == "e2" and spec.kv_kind == "mla" and spec.tp > 1):
        bad("replica_differs needs the per-rank MLA copies of sgl_era e2 with tp > 1")
    if "missing_rank" in spec.defects and len(writers(spec, spec.sgl_era, None)) < 2:
        bad("missing_rank needs a page written by several ranks")
    if "zip_payload" in spec.defects and spec.sgl_era not in ("e1", "e2"):
        bad("zip_payload needs sgl_era e1 or e2 (torch.save up to 0.4.10.post1)")


def build(root: Path, spec: Any, result: Any) -> None:
    """Write the directory of `spec` into `root`, filling `result` (blocks: one per (page,
    pool), `files` by writer index; defects as for the tree families)."""
    check(spec)
    era = spec.sgl_era
    layout = spec.sgl_layout
    pools = (None,) + tuple(spec.pools)
    zipped = era == "e1" or "zip_payload" in spec.defects
    for index in range(spec.blocks):
        hex_hash = block_hash_hex(spec.seed, index, 64)
        for pool in pools:
            files: dict[int, str] = {}
            for i, w in enumerate(writers(spec, era, pool)):
                rel = name(spec, hex_hash, era=era, pool=pool, **w)
                data = page_bytes(spec, hex_hash, pool=pool, tp_rank=w.get("tp_rank", 0) if (
                    spec.kv_kind != "mla" or pool == "mamba") else 0, pp_rank=w.get("pp_rank", 0), layout=layout,
                    shard=w.get("cp_rank", 0) * spec.dcp + w.get("dcp_rank", 0))
                if zipped:
                    data = ZIP + data[len(ZIP):]
                (root / rel).write_bytes(data)
                files[i] = rel
            result.blocks.append({"hex": hex_hash, "group": 0, "index": index, "pool": pool, "files": files,
                                  "defect": None})
    result.namespaces.append({
        "family": "sglang", "scheme": f"sgl-{era}", "model_name": spec.model_name, "tp": spec.tp, "pp": spec.pp,
        "cp": spec.cp, "dcp": spec.dcp, "kv_kind": spec.kv_kind, "layout": layout, "pools": list(spec.pools),
        "file_size": page_size(spec), "ranks": list(range(len(writers(spec, era, None)))),
        "base_name": None, "geometry": geometry(spec)})
    _inject(root, spec, result)


def _victim(result: Any, k: int, need: int = 1) -> dict:
    kv = [b for b in result.blocks if b["pool"] is None and len(b["files"]) >= need]
    b = kv[k % len(kv)]
    return b


def _inject(root: Path, spec: Any, result: Any) -> None:
    for k, d in enumerate(spec.defects):
        rec: dict[str, Any] = {"name": d, "block": None, "rank": None, "group": 0, "base_name": None}
        if d in ("missing_rank", "replica_differs", "size_mismatch", "short", "zero_filled", "unreadable"):
            b = _victim(result, k, 2 if d in ("missing_rank", "replica_differs") else 1)
            b["defect"] = d
            rank = max(b["files"])
            rel = b["files"][rank]
            path = root / rel
            rec.update(block=b["hex"], rank=rank, relpath=rel, rows=[rel])
            if d == "missing_rank":
                path.unlink()
                b["files"][rank] = None
                others = [r for r in b["files"].values() if r]
                rec.update(status="incomplete", reason="page missing", rows=others)
            elif d == "replica_differs":
                data = bytearray(path.read_bytes())
                data[-1] ^= 0xFF
                path.write_bytes(bytes(data))
                rec.update(status="replica_mismatch", reason="copy differs")
            elif d == "size_mismatch":
                path.write_bytes(path.read_bytes()[:-16])
                rec.update(status="size_mismatch", reason="bytes, the deployment's other pages")
            elif d == "short":
                path.write_bytes(b"")
                rec.update(status="short", reason="empty file")
            elif d == "zero_filled":
                path.write_bytes(bytes(len(path.read_bytes())))
                rec.update(status="zero_filled", reason="zero")
            else:
                os.chmod(path, 0)
                rec.update(status="unreadable", reason="permission denied")
        elif d == "foreign":
            rel = "README.txt"
            (root / rel).write_text("not a page\n")
            rec.update(relpath=rel, rows=[rel], status="foreign", reason="unexpected file")
        elif d == "symlink":
            target = result.blocks[0]["files"][0]
            rel = "f" * 64 + "_linked-model.bin"  # a page name that is a symlink: never followed
            os.symlink(target, root / rel)
            rec.update(relpath=rel, rows=[rel], status="foreign", reason="symlink")
        elif d == "tmp_sglang":
            rel = f".{deterministic_int(spec.seed, 'sgl-tmp', 64):016x}{deterministic_int(spec.seed, 'sgl-tmp2', 64):016x}.tmp"
            (root / rel).write_bytes(b"\x01" * 8)
            rec.update(relpath=rel, rows=[rel], status="tmp_leftover", reason="temp leftover")
        elif d == "tmp_sglang_old":
            final = result.blocks[0]["files"][0]
            rel = f"{final}.tmp.{deterministic_int(spec.seed, 'pid', 16)}.{deterministic_int(spec.seed, 'tid', 16)}.1a2b"
            (root / rel).write_bytes(b"\x01" * 8)
            rec.update(relpath=rel, rows=[rel], status="tmp_leftover", reason="temp leftover")
        elif d == "zip_payload":
            rec.update(relpath=result.blocks[0]["files"][0], rows=[r for b in result.blocks for r in b["files"].values()
                                                                  if r], status="unsupported_layout",
                       reason="torch.save zip")
        result.defects.append(rec)
