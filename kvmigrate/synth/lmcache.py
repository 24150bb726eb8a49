"""Synthetic LMCache tier directories (spec lmcache.md), every name and header written
through kvmigrate/formats/lmcache.py so the grammar exists once.

One build writes one deployment into one tier (`ROOT/<tier>`, or ROOT itself for tier
`.`, §1.1): `blocks` chunks of one backend (local_disk, fs, gds, mp) and key era
(lmc-k1/k2/k3/mp1), one file per writing worker (§1.2, §3.1: MLA with
save_only_first_rank collapses to one rank-0 file, `ws` 1 from k2 on; without it
local_disk and GDS write a copy per rank and fs aliases every rank to worker 0; MP MLA is
kv_rank 0x01000100). Payload: `[2, L, T, h·D]` (GQA, rank r's heads of 8) or
`[1, L, T, W]` (MLA), every rank a slice of one full chunk drawn by SHAKE-256 from the
model and the hash, so a reshard can be checked byte for byte (`full_chunk`, `rank_payload`).
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import Any

from kvmigrate.formats import lmcache as L
from kvmigrate.synth.pages import block_hash_hex, deterministic_int

ERAS = L.SCHEMES
BACKENDS = L.BACKENDS
GDS_NAMES = ("auto", "quoted", "legacy")
TOTAL_KV_HEADS = 8
HEAD_DIM = 4
LATENT_DIM = 8  # W = kv_lora_rank + rope dim (576 for DeepSeek)
TMP_DIR = "lmcache_tmp"  # the `tmp_dir` defect's folder
# defect -> backends it applies to
DEFECTS: dict[str, tuple[str, ...]] = {
    "tmp": ("fs", "gds", "mp"),
    "tmp_dir": ("fs", "mp"),
    "zero_filled": BACKENDS,
    "short": BACKENDS,
    "size_mismatch": BACKENDS,
    "header_invalid": ("fs", "gds"),
    "corrupt_sidecar": ("gds",),
    "orphan_data": ("gds",),
    "misfiled": ("gds",),
    "foreign": BACKENDS,
    "symlink": BACKENDS,
    "unreadable": BACKENDS,
    "layerwise": ("local_disk", "fs", "gds"),
}
# the defects that damage one chunk's file (each takes its own chunk)
BLOCK_DEFECTS = ("zero_filled", "short", "size_mismatch", "header_invalid", "corrupt_sidecar", "orphan_data",
                 "misfiled", "unreadable")


def dtype(spec: Any) -> str:
    """The key's dtype string; synth's "auto" is what vLLM resolves for a bf16 model."""
    return "bfloat16" if spec.dtype == "auto" else spec.dtype


def mla(spec: Any) -> bool:
    return bool(spec.kv_kind == "mla")


def hidden(spec: Any, rank: int = 0) -> int:
    """h·D of one rank (GQA; TP > H replicates heads: one each) or W (MLA)."""
    if mla(spec):
        return LATENT_DIM
    return len(head_set(spec, rank)) * HEAD_DIM


def head_set(spec: Any, rank: int) -> list[int]:
    """The KV heads rank `rank` holds (spec §3.4): a slice of H, or one replicated head."""
    tp = spec.tp
    if tp <= TOTAL_KV_HEADS:
        per = TOTAL_KV_HEADS // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // TOTAL_KV_HEADS)]


def geometry(spec: Any) -> dict[str, Any]:
    return {"layers": spec.layers, "tokens": spec.block_tokens, "total_kv_heads": TOTAL_KV_HEADS,
            "head_dim": HEAD_DIM, "latent_dim": LATENT_DIM, "dtype": dtype(spec),
            "dtype_bytes": L.DTYPE_BYTES[dtype(spec)], "mla": mla(spec)}


def chunk_hash(spec: Any, index: int) -> str:
    """The hash field as the era writes it: a signed, unpadded hex int (half of them
    negative) in-process; 64 hex (blake3) for MP."""
    if spec.lmc_era == "lmc-mp1":
        return block_hash_hex(spec.seed, index, 64)
    v = deterministic_int(spec.seed, f"lmc-chunk-{index}", 63) or 1
    return L.hash_hex(-v if index % 2 == 0 else v)


def full_chunk(spec: Any, hash_field: str) -> bytes:
    """Every head of every (K/V, layer, token) row, C order `[k, L, T, H, D]` (MLA
    `[1, L, T, W]`), drawn from the model and the hash: identical for every rank and era."""
    width = LATENT_DIM if mla(spec) else TOTAL_KV_HEADS * HEAD_DIM
    n = (1 if mla(spec) else 2) * spec.layers * spec.block_tokens * width * L.DTYPE_BYTES[dtype(spec)]
    return hashlib.shake_256(f"lmcache-synth:{spec.model_name}:{spec.seed}:{hash_field}".encode()).digest(n)


def rank_payload(spec: Any, hash_field: str, rank: int) -> bytes:
    """Rank `rank`'s payload: its heads of every row (GQA), the whole chunk (MLA)."""
    full = full_chunk(spec, hash_field)
    if mla(spec):
        return full
    cell = HEAD_DIM * L.DTYPE_BYTES[dtype(spec)]
    row = TOTAL_KV_HEADS * cell
    heads = head_set(spec, rank)
    out = bytearray()
    for off in range(0, len(full), row):
        for h in heads:
            out += full[off + h * cell: off + (h + 1) * cell]
    return bytes(out)


def writers(spec: Any) -> list[tuple[int, int, int]]:
    """(rank, ws, wid) of every worker that writes a chunk's file (§1.2, §3.1)."""
    tp = spec.tp
    if not mla(spec):
        return [(r, tp, r) for r in range(tp)]
    if spec.lmc_era == "lmc-mp1":
        return [(0, 1, 0)]  # kv_world_size = pp·dcp: 0x01000100 at every TP
    if spec.lmc_save_only_first_rank:  # rank 0 stores; ws collapses to 1 from 0.3.10 (k1 kept it)
        return [(0, tp if spec.lmc_era == "lmc-k1" else 1, 0)]
    if spec.lmc_backend == "fs":  # RemoteBackend aliases MLA ranks to worker 0: only rank 0 puts
        return [(0, tp, 0)]
    return [(r, tp, r) for r in range(tp)]


def tags(spec: Any) -> tuple[tuple[str, str], ...]:
    out = []
    for t in spec.lmc_tags:
        name, _, value = t.partition("%")
        out.append((name, value))
    return tuple(out)


def make_key(spec: Any, hash_field: str, ws: int, wid: int, layer: int | None = None) -> L.Key:
    era = spec.lmc_era
    if era == "lmc-mp1":
        return L.Key(era, spec.model_name, ws, wid, hash_field, kv_rank=L.kv_rank(ws, wid), group=0,
                     salt=spec.lmc_salt or None)
    return L.Key(era, spec.model_name, ws, wid, hash_field, None if era == "lmc-k1" else dtype(spec), tags(spec),
                 fmt="vllm" if era in ("lmc-k1", "lmc-k2") else None, layer=layer)


def gds_quoted(spec: Any) -> bool:
    """Quoted names are 0.4.3+ (k3 only); ≤ 0.4.2 wrote `/`→`_`."""
    if spec.lmc_gds_names == "auto":
        return bool(spec.lmc_era == "lmc-k3")
    return bool(spec.lmc_gds_names == "quoted")


def name_options(spec: Any, hash_field: str | None = None) -> dict[str, Any]:
    if spec.lmc_backend == "gds":
        opts: dict[str, Any] = {"gds_quoted": gds_quoted(spec)}
        if spec.lmc_era == "lmc-k1" and hash_field is not None:  # synth's k1 hashes are 0.3.6+ signed hex ints
            opts["chunk_hash"] = int(hash_field, 16)
        return opts
    if spec.lmc_backend == "fs":
        return {"fs_sep": "-" if spec.lmc_era == "lmc-k1" else L.FS_SEP}  # -SEP- from 0.3.10
    return {}


def tier_prefix(spec: Any) -> str:
    return "" if spec.lmc_tier == "." else spec.lmc_tier + "/"


def file_bytes(spec: Any, payload: bytes, rank: int) -> bytes:
    """Header (fs with save_chunk_meta, GDS) then the payload; raw otherwise (§2.1-§2.3)."""
    shape = L.payload_shape(mla(spec), spec.layers, spec.block_tokens, hidden(spec, rank))
    fmt = L.memory_format(mla(spec))
    if spec.lmc_backend == "fs" and spec.lmc_fs_header:
        return L.encode_fs_header(len(payload), fmt, dtype(spec), shape) + payload
    if spec.lmc_backend == "gds":
        return L.encode_gds_header(dtype(spec), shape, len(payload), fmt) + payload
    return payload


def check(spec: Any) -> None:
    def bad(msg: str) -> None:
        raise ValueError(f"synth: {msg}")

    b, era = spec.lmc_backend, spec.lmc_era
    if b not in BACKENDS:
        bad(f"lmc_backend must be one of {', '.join(BACKENDS)}, got {b!r}")
    if era not in ERAS:
        bad(f"lmc_era must be one of {', '.join(ERAS)}, got {era!r}")
    if (b == "mp") != (era == "lmc-mp1"):
        bad("the MP backend writes lmc-mp1 keys, and only it does")
    if spec.kv_kind not in ("full", "mla"):
        bad(f"kv_kind must be full or mla, got {spec.kv_kind!r}")
    if not 1 <= spec.tp <= 8 or spec.pp != 1 or spec.dcp != 1 or spec.groups != 1:
        bad("LMCache synth writes TP 1-8 with pp, dcp and groups 1")
    if not mla(spec) and TOTAL_KV_HEADS % spec.tp and spec.tp % TOTAL_KV_HEADS:
        bad(f"a GQA chunk of {TOTAL_KV_HEADS} KV heads shards over a TP dividing {TOTAL_KV_HEADS}, not {spec.tp}")
    if dtype(spec) not in L.FS_DTYPE_CODES:
        bad(f"dtype must be one of {', '.join(L.FS_DTYPE_CODES)} (or auto), got {spec.dtype!r}")
    if mla(spec) and era == "lmc-mp1" and not spec.lmc_save_only_first_rank:
        bad("MP has no save_only_first_rank setting: its MLA key is 0x01000100 at every TP")
    if spec.lmc_gds_names not in GDS_NAMES:
        bad(f"lmc_gds_names must be one of {', '.join(GDS_NAMES)}")
    if b == "gds" and gds_quoted(spec) and era != "lmc-k3":
        bad("quoted GDS names are 0.4.3+ (lmc-k3 keys)")
    for t in spec.lmc_tags:
        name, sep, value = t.partition("%")
        if not sep or not name or "@" in t:
            bad(f"a tag is name%value without '@', got {t!r}")
    if era == "lmc-mp1" and spec.lmc_tags:
        bad("MP keys carry no tags (a cache_salt at most)")
    if "@" in spec.model_name or not spec.model_name:
        bad("the model name must be non-empty and hold no '@' (LMCache escapes nothing)")
    if b == "gds" and not gds_quoted(spec) and "_" in L.format_key(make_key(spec, "1", 1, 0)):
        bad("a ≤ 0.4.2 GDS key holds no '_' (the writer asserted it)")
    if not spec.lmc_tier or "/" in spec.lmc_tier or spec.lmc_tier in ("..", ".kvmigrate"):
        bad(f"lmc_tier must be one folder name or '.', got {spec.lmc_tier!r}")
    for d in spec.defects:
        if d not in DEFECTS:
            bad(f"defect {d!r} is not one LMCache tiers carry; known: {', '.join(DEFECTS)}")
        if b not in DEFECTS[d]:
            bad(f"defect {d!r} applies to backend {'/'.join(DEFECTS[d])}, not {b!r}")
    if "header_invalid" in spec.defects and b == "fs" and not spec.lmc_fs_header:
        bad("header_invalid needs an fs tier with headers")
    if "misfiled" in spec.defects and era == "lmc-k1":
        bad("misfiled needs checked GDS folders: lmc-k2/lmc-k3 (k1's hash may be decimal)")
    if "layerwise" in spec.defects and era != "lmc-k3":
        bad("layerwise keys are lmc-k3 names here")
    n = sum(d in BLOCK_DEFECTS for d in spec.defects)
    n += any(d not in BLOCK_DEFECTS for d in spec.defects)  # the others use the last, undamaged chunk
    if n > spec.blocks:
        bad(f"these defects need at least {n} blocks (one chunk each, one left whole)")
    if len(set(spec.defects)) != len(spec.defects):
        bad("each defect may be listed once")


def build(root: Path, spec: Any, result: Any) -> None:
    """Write the tier of `spec` under `root`, filling `result` (one namespace, one block
    record per chunk, one defect record per defect)."""
    check(spec)
    prefix = tier_prefix(spec)
    tier_dir = root if spec.lmc_tier == "." else root / spec.lmc_tier
    tier_dir.mkdir(parents=True, exist_ok=True)
    sizes = set()
    for index in range(spec.blocks):
        h = chunk_hash(spec, index)
        opts = name_options(spec, h)
        rec: dict[str, Any] = {"hex": h, "index": index, "group": 0, "files": {}, "sidecars": {}, "keys": {},
                               "workers": {}, "payload_size": None, "defect": None}
        for rank, ws, wid in writers(spec):
            key = make_key(spec, h, ws, wid)
            payload = rank_payload(spec, h, rank)
            data = file_bytes(spec, payload, rank)
            rel = prefix + L.relpath_in_tier(key, spec.lmc_backend, **opts)
            _write(root / rel, data)
            rec["files"][wid] = rel
            rec["keys"][wid] = L.format_key(key)
            rec["workers"][wid] = {"rank": rank, "ws": ws, "wid": wid, "kv_rank": key.kv_rank}
            rec["payload_size"] = len(payload)
            sizes.add(len(data))
            if spec.lmc_backend == "gds":
                side = prefix + L.gds_relpath(key, sidecar=True, **opts)
                _write(root / side, data[:L.GDS_HEADER])
                rec["sidecars"][wid] = side
        result.blocks.append(rec)
    w = writers(spec)
    result.namespaces.append({
        "family": "lmcache", "base_name": None, "tier": spec.lmc_tier, "tier_relpath": prefix.rstrip("/") or ".",
        "backend": spec.lmc_backend, "scheme": spec.lmc_era, "model_name": spec.model_name,
        "ws": w[0][1], "tp": spec.tp, "kv_kind": spec.kv_kind, "dtype": dtype(spec), "tags": list(spec.lmc_tags),
        "salt": spec.lmc_salt or None, "fs_header": spec.lmc_backend == "fs" and spec.lmc_fs_header,
        "gds_quoted": gds_quoted(spec) if spec.lmc_backend == "gds" else None,
        "save_only_first_rank": spec.lmc_save_only_first_rank, "ranks": [wid for _, _, wid in w],
        "file_size": max(sizes) if sizes else 0, "geometry": geometry(spec),
        "full_chunk_bytes": L.full_chunk_bytes(mla(spec), spec.layers, spec.block_tokens, hidden(spec), dtype(spec)),
    })
    _inject(root, spec, result)


def _write(path: Path, data: bytes) -> None:
    """Create or replace a file (a rebuild over a symlink or an `unreadable` defect too)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        os.chmod(path, 0o644)
    path.write_bytes(data)


def _inject(root: Path, spec: Any, result: Any) -> None:
    prefix = tier_prefix(spec)
    b = spec.lmc_backend
    k = 0
    for d in spec.defects:
        rec: dict[str, Any] = {"name": d, "block": None, "rank": None, "group": 0, "base_name": None,
                               "tier": spec.lmc_tier, "backend": b, "era": spec.lmc_era}
        if d in BLOCK_DEFECTS:
            blk = result.blocks[k]
            k += 1
            blk["defect"] = d
            wid = min(blk["files"])
            rel = blk["files"][wid]
            side = blk["sidecars"].get(wid)
            path = root / rel
            rec.update(block=blk["hex"], rank=wid, relpath=rel)
            statuses = _damage(root, spec, d, blk, wid, rel, side, path)
            primary = next(iter(statuses))  # the file the defect is about (a corrupt sidecar: the sidecar)
            rec.update(relpath=primary, status=statuses[primary], statuses=statuses, rows=list(statuses))
        else:
            rec.update(_tree_defect(root, spec, d, result, prefix))
        rec["reason"] = {"tmp_leftover": "temp", "zero_filled": "zero", "short": "bytes", "size_mismatch": "bytes",
                         "header_invalid": "header", "corrupt_sidecar": "sidecar", "orphan_data": "sidecar",
                         "misfiled": "folder", "foreign": "", "unreadable": "permission",
                         "unsupported_layout": "layerwise"}[rec["status"]]
        result.defects.append(rec)


def _damage(root: Path, spec: Any, d: str, blk: dict, wid: int, rel: str, side: str | None,
            path: Path) -> dict[str, str]:
    """Damage one chunk file; the status each touched file must get (§2.4, §4)."""
    data = path.read_bytes()
    b = spec.lmc_backend
    if d == "zero_filled":
        path.write_bytes(bytes(len(data)))
        if side is not None:  # its sidecar now differs from the data header (§2.4)
            return {rel: "zero_filled", side: "corrupt_sidecar"}
        return {rel: "zero_filled"}
    if d == "short":  # a torn write: part of the payload missing
        path.write_bytes(data[: len(data) - blk["payload_size"] // 2])
        return {rel: "short"}
    if d == "size_mismatch":
        path.write_bytes(data + b"\x01" * 16)
        return {rel: "size_mismatch"}
    if d == "header_invalid":  # one token more in the shape than the length holds: shape × b ≠ length
        shape = list(L.payload_shape(mla(spec), spec.layers, spec.block_tokens + 1, hidden(spec, wid)))
        fmt = L.memory_format(mla(spec))
        if b == "fs":
            path.write_bytes(L.encode_fs_header(blk["payload_size"], fmt, dtype(spec), shape)
                             + data[L.FS_HEADER_ONE_GROUP:])
            return {rel: "header_invalid"}
        wrong = L.encode_gds_header(dtype(spec), shape, blk["payload_size"], fmt)
        path.write_bytes(wrong + data[L.GDS_HEADER:])
        assert side is not None
        (root / side).write_bytes(wrong)  # the writer wrote both alike: the sidecar is whole
        return {rel: "header_invalid"}
    if d == "corrupt_sidecar":
        assert side is not None
        (root / side).write_bytes(struct.pack("<Q", L.GDS_JSON) + b"{\"kvcache\": ".ljust(L.GDS_JSON, b" "))
        return {side: "corrupt_sidecar", rel: "orphan_data"}
    if d == "orphan_data":
        assert side is not None
        (root / side).unlink()
        blk["sidecars"][wid] = None
        return {rel: "orphan_data"}
    if d == "misfiled":  # the right name in another `<2>/<2>` folder (from the hex, not the decimal)
        assert side is not None
        parts = rel.split("/")
        prefix = "/".join(parts[:-3])
        hexed = blk["hex"].lstrip("-")
        folders = [hexed[:2], hexed[2:4]]
        if folders == parts[-3:-1]:
            folders[1] = "zz"
        folder = "/".join(p for p in (prefix, *folders) if p)
        new_rel, new_side = f"{folder}/{parts[-1]}", f"{folder}/{side.split('/')[-1]}"
        (root / folder).mkdir(parents=True, exist_ok=True)
        os.rename(path, root / new_rel)
        os.rename(root / side, root / new_side)
        blk["files"][wid] = None
        blk["sidecars"][wid] = None
        return {new_rel: "misfiled", new_side: "misfiled"}
    os.chmod(path, 0)  # unreadable
    return {rel: "unreadable"}


def _tree_defect(root: Path, spec: Any, d: str, result: Any, prefix: str) -> dict[str, Any]:
    b = spec.lmc_backend
    first = result.blocks[-1]
    wid = max(first["files"])
    final = first["files"][wid]
    if d == "tmp":
        if b in ("fs", "mp"):
            rels = [L.fs_temp_name(final)]
        else:
            token = f"{deterministic_int(spec.seed, 'lmc-tmp', 32):08x}"
            side = first["sidecars"][wid]
            rels = [L.gds_temp_name(final, token), L.gds_temp_name(side, token)]
        for r in rels:
            _write(root / r, b"\x01" * 64)
        return {"relpath": rels[0], "rows": rels, "status": "tmp_leftover",
                "statuses": dict.fromkeys(rels, "tmp_leftover")}
    if d == "tmp_dir":  # fs_connector_relative_tmp_dir / MP relative_tmp_dir: the final name inside
        folder = prefix + TMP_DIR
        rel = f"{folder}/{final.rsplit('/', 1)[-1]}"
        _write(root / rel, b"\x01" * 64)
        # a fact names the folder (tmp_dir, §1.4, §3.3): then its files are temps, else it is foreign
        return {"relpath": folder, "rows": [folder], "status": "foreign", "statuses": {folder: "foreign"},
                "with_fact": {"tmp_dir": TMP_DIR, "statuses": {rel: "tmp_leftover"}}}
    if d == "foreign":
        folder = prefix + "lost+found"
        _write(root / folder / "README.txt", b"not a chunk\n")
        return {"relpath": folder, "rows": [folder], "status": "foreign", "statuses": {folder: "foreign"}}
    if d == "symlink":
        key = make_key(spec, L.hash_hex(0x5EED), *writers(spec)[0][1:])
        rel = prefix + L.relpath_in_tier(key, b, **name_options(spec, key.hash))
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(root / final, (root / rel).parent), root / rel)
        return {"relpath": rel, "rows": [rel], "status": "foreign", "statuses": {rel: "foreign"}}
    # layerwise: a k3 LayerCacheEngineKey name (`…@dtype@<layer>`): out of scope (§0)
    _, ws, wid0 = writers(spec)[0]
    key = make_key(spec, first["hex"], ws, wid0, layer=1)
    rel = prefix + L.relpath_in_tier(key, b, **name_options(spec, key.hash))
    _write(root / rel, b"\x02" * 64)
    return {"relpath": rel, "rows": [rel], "status": "unsupported_layout", "statuses": {rel: "unsupported_layout"},
            "key": L.format_key(key)}
