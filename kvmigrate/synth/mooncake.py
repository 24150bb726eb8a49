"""Synthetic Mooncake Store SSD-offload stores (spec mooncake.md §1, §2), every name, index,
KVEntry, path and key written through kvmigrate/formats/mooncake.py so the grammar exists once.

One build writes one store (`ROOT/<mc_store>`, or ROOT itself for `.`): `blocks` blocks of one
engine (vLLM 0.34 `MooncakeStoreConnector` or SGLang 0.5.23 HiCache `mooncake`), one key scheme
(`mc-scoped`: `<tenant>\\0<key>`, 0.3.12+; `mc-raw`: the engine key, ≤ 0.3.11) and one backend
(`bucket` pairs or `file_per_key` KVEntries). Client roots: vLLM one, the store folder itself;
SGLang `rank_0_<tp>_<pp>_0` per rank under the store folder (§2.3).

Values come from one full block per (block hash, pipeline stage), SHAKE-256 of the model,
the seed and the hash (`full_block`); each object is its key rank's heads of every row
(`rank_value`), heads innermost-but-one, so a reshard can be checked byte for byte:

* vLLM GQA `[L, 2, T, h, D]` (layout `nhd`), key ranks `t < min(tp, H)`; MLA `[L, T, W]`,
  one object `tp_rank:0` at every TP;
* SGLang MHA `_k` `[T, L, h, D]` and `_v` likewise (layout `page_first`), TP rank r's heads
  (one replicated head at tp > H); MLA only `__k` `[T, L, W]`, from rank 0.

Bucket ids are `(seconds << 12) + seq` from a fixed time drawn from the seed, above every id
already at the client root's top, so rebuilding or adding a store to a root is deterministic.
Defects (`DEFECTS`) each write their own extra blocks (hash indexes from `blocks` on), so the
`blocks` main blocks stay whole and readable whatever is injected.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from kvmigrate.formats import mooncake as M
from kvmigrate.synth.pages import block_hash_hex, deterministic_int

BACKENDS = ("bucket", "file_per_key")
ENGINES = ("vllm", "sglang")
TOTAL_KV_HEADS = 8
HEAD_DIM = 4
LATENT_DIM = 8  # W = kv_lora_rank + rope dim (576 for DeepSeek)
DTYPE_BYTES = 2  # bf16 / fp16: the only element size synth writes
DTYPES = ("auto", "bfloat16", "float16", "half")
MAX_TP = 16  # tp > H = 8 exercises SGLang's replicated heads (vLLM: min(tp, H) key ranks)
EPOCH = 1_760_000_000  # the base of the fixed bucket-id time (seconds; the seed adds up to ~97 days)
UNSUPPORTED_KEY = "other-app/object-0"  # a key of no engine grammar (another Mooncake user)
NESTED_DIR = "backup"  # the `nested_bucket` defect's sub-folder
# defect -> (backends it applies to, the status the file or object it is about must get)
DEFECTS: dict[str, tuple[tuple[str, ...], str]] = {
    "orphan_data": (("bucket",), "orphan_data"),
    "orphan_index": (("bucket",), "orphan_index"),
    "corrupt_sidecar": (("bucket",), "corrupt_sidecar"),
    "short": (BACKENDS, "short"),
    "misfiled": (BACKENDS, "misfiled"),
    "header_invalid": (("file_per_key",), "header_invalid"),
    "tmp_leftover": (("file_per_key",), "tmp_leftover"),
    "foreign": (BACKENDS, "foreign"),
    "nested_bucket": (("bucket",), "orphan_data"),
    "replica_mismatch": (("bucket",), "replica_mismatch"),
    "zero_filled": (BACKENDS, "zero_filled"),
    "size_mismatch": (BACKENDS, "size_mismatch"),
    "symlink": (BACKENDS, "foreign"),
    "unreadable": (BACKENDS, "unreadable"),
    "client_lock": (("bucket",), "ok"),
    "unsupported_key": (BACKENDS, "unsupported_layout"),
}
# how many extra blocks each defect writes (the others only add or copy files)
DEFECT_BLOCKS = {"orphan_data": 1, "orphan_index": 1, "corrupt_sidecar": 2, "short": 2, "misfiled": 1,
                 "header_invalid": 1, "replica_mismatch": 1, "zero_filled": 1, "size_mismatch": 1,
                 "unreadable": 1}


# --- geometry and values ------------------------------------------------------------------------

def mla(spec: Any) -> bool:
    return bool(spec.kv_kind == "mla")


def stage_layers(spec: Any) -> int:
    """Layers of one pipeline stage (each stage stores its own layers under its pp_rank)."""
    return int(spec.layers // spec.pp)


def key_ranks(spec: Any) -> int:
    """Key ranks of a block at `spec.tp` (§2.2, §2.3): vLLM 1 (MLA) or min(tp, H); SGLang 1
    (MLA, rank 0 writes) or tp (MHA: ranks beyond H hold replicated heads)."""
    if mla(spec):
        return 1
    return min(spec.tp, TOTAL_KV_HEADS) if spec.mc_engine == "vllm" else int(spec.tp)


def head_set(spec: Any, rank: int) -> list[int]:
    """The KV heads key rank `rank` holds (§3.4): a slice of H, or one replicated head."""
    n = key_ranks(spec)
    if n <= TOTAL_KV_HEADS:
        per = TOTAL_KV_HEADS // n
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (n // TOTAL_KV_HEADS)]


def full_block(spec: Any, block_hash: str, pp_rank: int = 0) -> bytes:
    """Every head of every row of block `block_hash` in pipeline stage `pp_rank`, C order:
    vLLM `[L, 2, T, H, D]` (MLA `[L, T, W]`), SGLang `[2, T, L, H, D]` (k then v; MLA
    `[T, L, W]`), L the stage's layers. Drawn from the model, seed, hash and stage only: the
    same at every TP and scheme, so a resharded object can be compared with `rank_value`."""
    width = LATENT_DIM if mla(spec) else TOTAL_KV_HEADS * HEAD_DIM
    n = (1 if mla(spec) else 2) * stage_layers(spec) * spec.block_tokens * width * DTYPE_BYTES
    label = f"mooncake-synth:{spec.mc_engine}:{spec.model_name}:{spec.seed}:{block_hash}:{pp_rank}"
    return hashlib.shake_256(label.encode()).digest(n)


def rank_value(spec: Any, block_hash: str, rank: int, pp_rank: int = 0, half: str = "k") -> bytes:
    """The value of key rank `rank`'s object (`half` "k"/"v": SGLang MHA's `_k`/`_v`; vLLM
    and MLA ignore it): its heads of every row of `full_block` (MLA: the whole block)."""
    full = full_block(spec, block_hash, pp_rank)
    if mla(spec):
        return full
    if spec.mc_engine == "sglang":
        mid = len(full) // 2
        full = full[:mid] if half == "k" else full[mid:]
    cell = HEAD_DIM * DTYPE_BYTES
    row = TOTAL_KV_HEADS * cell
    heads = head_set(spec, rank)
    lo, hi = heads[0] * cell, (heads[-1] + 1) * cell  # the heads are contiguous
    return b"".join(full[off + lo: off + hi] for off in range(0, len(full), row))


def object_size(spec: Any) -> int:
    """Bytes of one object at `spec`'s geometry (§2.2, §2.3)."""
    rows = stage_layers(spec) * spec.block_tokens * (1 if spec.mc_engine == "sglang" or mla(spec) else 2)
    return rows * (LATENT_DIM if mla(spec) else len(head_set(spec, 0)) * HEAD_DIM) * DTYPE_BYTES


# --- keys and client roots ----------------------------------------------------------------------

def key_model(spec: Any) -> str:
    """The model as the key spells it: vLLM the served path's basename, SGLang `/` → `-`."""
    if spec.mc_engine == "vllm":
        return str(spec.model_name.rstrip("/").rsplit("/", 1)[-1])
    return str(spec.model_name.replace("/", "-"))


def cache_prefix(spec: Any) -> str | None:
    """vLLM's cache prefix: none, the operator's, or for `auto` an `auto-<hex>` drawn from
    the seed and model (a real one hashes the build: F §3.1)."""
    p = spec.mc_cache_prefix
    if not p:
        return None
    if p == "auto":
        return f"auto-{deterministic_int(spec.seed, 'mc-auto-' + spec.model_name, 64):016x}"
    return str(p)


def engine_key(spec: Any, block_hash: str, rank: int, pp_rank: int = 0, half: str = "k") -> str:
    """The engine's key of key rank `rank`'s object of a block (§2.2, §2.3)."""
    if spec.mc_engine == "vllm":
        return M.format_vllm_key(M.VllmKey(cache_prefix(spec), key_model(spec), "", rank, 0, 0, pp_rank, 0,
                                           block_hash))
    if mla(spec):
        ranks: tuple[int, ...] = () if spec.pp == 1 else (pp_rank,)
        return M.format_sglang_key(M.SglangKey(key_model(spec), block_hash, ranks, "k"))
    ranks = (rank,) if spec.pp == 1 else (rank, pp_rank)
    return M.format_sglang_key(M.SglangKey(key_model(spec), block_hash, ranks, half))


def storage_key(spec: Any, key: str) -> bytes:
    """`<tenant>\\0<key>` (mc-scoped) or the key itself (mc-raw), §2.1."""
    if spec.mc_scheme == "mc-raw":
        return M.StorageKey(None, key).encode()
    return M.scoped(key, spec.mc_tenant)


def store_relpath(spec: Any) -> str:
    return "." if spec.mc_store == "." else str(spec.mc_store)


def client_root(spec: Any, rank: int = 0, pp_rank: int = 0) -> str:
    """Relpath (under ROOT) of the client root that writes key rank `rank` of stage `pp_rank`:
    vLLM the store folder; SGLang `rank_0_<rank>_<pp>_0` in it (MLA: rank 0's)."""
    if spec.mc_engine == "vllm":
        return store_relpath(spec)
    return _join(store_relpath(spec), f"rank_0_{0 if mla(spec) else rank}_{pp_rank}_0")


def block_objects(spec: Any, block_hash: str) -> list[dict[str, Any]]:
    """Every object a block stores: client root, key rank, stage, half, keys and value."""
    out = []
    halves = ("k",) if mla(spec) or spec.mc_engine == "vllm" else ("k", "v")
    for pp_rank in range(spec.pp):
        for rank in range(key_ranks(spec)):
            for half in halves:
                key = engine_key(spec, block_hash, rank, pp_rank, half)
                out.append({"key": key, "storage_key": storage_key(spec, key).decode("utf-8", "surrogateescape"),
                            "rank": rank, "pp": pp_rank, "half": half if spec.mc_engine == "sglang" else None,
                            "client_root": client_root(spec, rank, pp_rank),
                            "value": rank_value(spec, block_hash, rank, pp_rank, half)})
    return out


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p and p != ".") or "."


def base_seconds(spec: Any) -> int:
    """The fixed `unix_seconds` of the ids (deterministic from the seed)."""
    return EPOCH + deterministic_int(spec.seed, "mc-bucket-time", 23)


def deployment(spec: Any) -> str:
    """§2.4's label of the store's one deployment."""
    stem = (f"{cache_prefix(spec)}@" if cache_prefix(spec) else "") + key_model(spec)
    label = f"mooncake:{store_relpath(spec)}:{spec.mc_engine}:{stem}:{spec.mc_scheme}"
    # the tenant is named when it is not Mooncake's default (families/mooncake.py deployment_label)
    return label + (f":tenant={spec.mc_tenant}" if spec.mc_scheme == "mc-scoped" and spec.mc_tenant != M.DEFAULT_TENANT
                     else "")


def geometry(spec: Any) -> dict[str, Any]:
    return {"layers": spec.layers, "stage_layers": stage_layers(spec), "tokens": spec.block_tokens,
            "total_kv_heads": TOTAL_KV_HEADS, "head_dim": HEAD_DIM, "latent_dim": LATENT_DIM,
            "dtype_bytes": DTYPE_BYTES, "mla": mla(spec),
            "kv_layout": "page_first" if spec.mc_engine == "sglang" else "nhd"}


# --- checks -------------------------------------------------------------------------------------

def check(spec: Any) -> None:
    """Refuse what no Mooncake writer produces, saying what to change."""
    def bad(msg: str) -> None:
        raise ValueError(f"synth: {msg}")

    if spec.mc_backend not in BACKENDS:
        bad(f"mc_backend must be one of {', '.join(BACKENDS)}, got {spec.mc_backend!r}")
    if spec.mc_engine not in ENGINES:
        bad(f"mc_engine must be one of {', '.join(ENGINES)}, got {spec.mc_engine!r}")
    if spec.mc_scheme not in M.SCHEMES:
        bad(f"mc_scheme must be one of {', '.join(M.SCHEMES)}, got {spec.mc_scheme!r}")
    if not spec.mc_tenant or "\0" in spec.mc_tenant:
        bad("mc_tenant must be non-empty and hold no NUL")
    if spec.mc_scheme == "mc-raw" and spec.mc_tenant != M.DEFAULT_TENANT:
        bad("a raw key (mc-raw, ≤ 0.3.11) has no tenant: leave mc_tenant at 'default'")
    if spec.kv_kind not in ("full", "mla"):
        bad(f"kv_kind must be full or mla, got {spec.kv_kind!r}")
    for name in ("tp", "pp", "layers", "blocks", "block_tokens", "mc_bucket_keys"):
        value = getattr(spec, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            bad(f"{name} must be a positive integer, got {value!r}")
    if spec.tp > MAX_TP:
        bad(f"Mooncake synth writes TP 1-{MAX_TP}, not {spec.tp}")
    if not mla(spec) and TOTAL_KV_HEADS % spec.tp and spec.tp % TOTAL_KV_HEADS:
        bad(f"a GQA block of {TOTAL_KV_HEADS} KV heads shards over a TP dividing {TOTAL_KV_HEADS} "
            f"(or a multiple of it), not {spec.tp}")
    if spec.layers % spec.pp:
        bad(f"layers ({spec.layers}) must be divisible by pp ({spec.pp}): each stage stores its own layers")
    if spec.dcp != 1 or spec.groups != 1 or spec.cp != 1:
        bad("Mooncake synth writes dcp, cp and groups 1")
    if spec.dtype not in DTYPES:
        bad(f"Mooncake synth writes 2-byte elements: dtype must be one of {', '.join(DTYPES)}")
    if spec.mc_bucket_keys > M.MAX_BUCKET_KEYS:
        bad(f"mc_bucket_keys is at most {M.MAX_BUCKET_KEYS} (Mooncake's limit)")
    if spec.mc_cache_prefix and spec.mc_engine != "vllm":
        bad("a cache prefix is vLLM's (SGLang keys have none)")
    if not spec.mc_store or "/" in spec.mc_store or spec.mc_store in ("..", ".kvmigrate") \
            or M.stoll_id(spec.mc_store) is not None:
        bad(f"mc_store must be one folder name (not .bucket/.meta) or '.', got {spec.mc_store!r}")
    if not spec.mc_fsdir or "/" in spec.mc_fsdir or spec.mc_fsdir in (".", ".."):
        bad(f"mc_fsdir must be one folder name, got {spec.mc_fsdir!r}")
    if not spec.model_name:
        bad("the model name must not be empty")
    probe = engine_key(spec, "ab" * 32, 0)
    if spec.mc_engine == "vllm":
        v = M.parse_vllm_key(probe)
        survives = v is not None and (v.prefix, v.model, v.namespace) == (cache_prefix(spec), key_model(spec), "")
    else:
        g = M.parse_sglang_key(probe)
        survives = g is not None and g.prefix == key_model(spec)
    if not survives:
        bad(f"model {spec.model_name!r} (and cache prefix) do not survive the {spec.mc_engine} key grammar")
    for d in spec.defects:
        if d not in DEFECTS:
            bad(f"defect {d!r} is not one Mooncake stores carry; known: {', '.join(DEFECTS)}")
        if spec.mc_backend not in DEFECTS[d][0]:
            bad(f"defect {d!r} applies to backend {'/'.join(DEFECTS[d][0])}, not {spec.mc_backend!r}")
    if len(set(spec.defects)) != len(spec.defects):
        bad("each defect may be listed once")


# --- writing ------------------------------------------------------------------------------------

def build(root: Path, spec: Any, result: Any) -> None:
    """Write the store of `spec` under `root`, filling `result`: one namespace (the store),
    one block record per block (main blocks `defect` None) with its objects, one defect
    record per defect (name, relpath, status, statuses per file, objects per object row,
    and what the next client start does: `deleted`, `refuses_start`, `read_fails`)."""
    check(spec)
    root = Path(root)
    for cr in {client_root(spec, r, p) for r in range(key_ranks(spec)) for p in range(spec.pp)}:
        if _top_ids(root / cr) or (root / cr / spec.mc_fsdir).exists():
            raise ValueError(f"synth: {cr} already holds a Mooncake client root: one build per store "
                             "(give another --mc-store)")
    (root / store_relpath(spec)).mkdir(parents=True, exist_ok=True)
    blocks: list[dict[str, Any]] = []
    for index in range(spec.blocks):
        h = block_hash_hex(spec.seed, index, 64)
        blocks.append({"hex": h, "index": index, "group": 0, "defect": None, "objects": block_objects(spec, h)})
    pairs = _write(root, spec, [o for b in blocks for o in b["objects"]])
    result.blocks.extend(_public(b) for b in blocks)
    roots = sorted({o["client_root"] for b in blocks for o in b["objects"]})
    result.namespaces.append({
        "family": "mooncake", "base_name": None, "store_relpath": store_relpath(spec), "engine": spec.mc_engine,
        "backend": spec.mc_backend, "scheme": spec.mc_scheme,
        "tenant": spec.mc_tenant if spec.mc_scheme == "mc-scoped" else None, "model_name": spec.model_name,
        "key_model": key_model(spec), "cache_prefix": cache_prefix(spec), "deployment": deployment(spec),
        "fsdir": spec.mc_fsdir if spec.mc_backend == "file_per_key" else None, "tp": spec.tp, "pp": spec.pp,
        "kv_kind": spec.kv_kind, "key_ranks": key_ranks(spec), "client_roots": roots,
        "objects": sum(len(b["objects"]) for b in blocks), "object_size": object_size(spec),
        "pairs": pairs, "geometry": geometry(spec),
    })
    _inject(root, spec, result, pairs)


def _public(block: dict[str, Any]) -> dict[str, Any]:
    """A block record without the values (JSON output; `rank_value` recomputes them)."""
    objs = [{k: v for k, v in o.items() if k != "value"} for o in block["objects"]]
    return {**block, "objects": objs}


def _write_file(path: Path, data: bytes) -> None:
    """Create or replace a file (a rebuild over a symlink or an `unreadable` defect too)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        os.chmod(path, 0o644)
    path.write_bytes(data)


def _top_ids(folder: Path) -> list[int]:
    if not folder.is_dir():
        return []
    ids = (M.stoll_id(n) for n in os.listdir(folder))
    return [i for i in ids if i is not None]


def _write(root: Path, spec: Any, objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Store `objects` (each gets `relpath`, `object_index`, `size`, `bucket`): bucket
    backend new pairs per client root (sorted by storage key, ≤ mc_bucket_keys and 256 MiB a
    pair, ids above every id there, `.bucket` then `.meta`); file-per-key a KVEntry at
    `fpk(key)`. Returns the pairs written."""
    pairs: list[dict[str, Any]] = []
    for cr in sorted({o["client_root"] for o in objects}):
        folder = root / cr
        mine = sorted((o for o in objects if o["client_root"] == cr), key=lambda o: _skey(o))
        if spec.mc_backend == "file_per_key":
            for o in mine:
                rel = _join(cr, M.fpk(_skey(o), spec.mc_fsdir))
                _write_file(root / rel, M.encode_kv_entry(M.KVEntry(_skey(o), o["value"])))
                o.update(relpath=rel, object_index=None, size=len(o["value"]), bucket=None)
            continue
        chunks: list[list[dict[str, Any]]] = []
        size = 0
        for o in mine:
            n = len(_skey(o)) + len(o["value"])
            if not chunks or len(chunks[-1]) >= spec.mc_bucket_keys or size + n > M.MAX_BUCKET_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append(o)
            size += n
        next_id = M.next_bucket_id(_top_ids(folder), base_seconds(spec))
        for chunk in chunks:
            data, meta = M.build_bucket([(_skey(o), o["value"]) for o in chunk])
            bucket, meta_rel = _join(cr, f"{next_id}{M.BUCKET_SUFFIX}"), _join(cr, f"{next_id}{M.META_SUFFIX}")
            _write_file(root / bucket, data)
            _write_file(root / meta_rel, M.encode_meta(meta))
            for i, o in enumerate(chunk):
                o.update(relpath=meta_rel, object_index=i, size=len(o["value"]), bucket=bucket)
            pairs.append({"client_root": cr, "id": next_id, "meta": meta_rel, "bucket": bucket, "keys": len(chunk)})
            next_id += 1
    return pairs


def _skey(o: dict[str, Any]) -> bytes:
    return bytes(o["storage_key"].encode("utf-8", "surrogateescape"))


def _row(o: dict[str, Any], status: str) -> dict[str, Any]:
    """An object row a defect must produce: (relpath, object_index) and its storage key."""
    return {"relpath": o["relpath"], "object_index": o["object_index"], "key": o["storage_key"], "status": status}


def _inject(root: Path, spec: Any, result: Any, pairs: list[dict[str, Any]]) -> None:
    extra = spec.blocks
    for d in spec.defects:
        blocks: list[dict[str, Any]] = []
        n = 0 if (d, spec.mc_backend) == ("misfiled", "bucket") else DEFECT_BLOCKS.get(d, 0)
        for _ in range(n):  # the victims: key rank 0's object of the first block
            h = block_hash_hex(spec.seed, extra, 64)
            blocks.append({"hex": h, "index": extra, "group": 0, "defect": d, "objects": block_objects(spec, h)})
            extra += 1
        rec: dict[str, Any] = {"name": d, "store": store_relpath(spec), "backend": spec.mc_backend,
                               "engine": spec.mc_engine, "status": DEFECTS[d][1], "statuses": {}, "objects": [],
                               "deleted": [], "refuses_start": False, "read_fails": [],
                               "blocks": [b["hex"] for b in blocks]}
        rec.update(_defect(root, spec, d, blocks, pairs))
        rec["relpath"] = rec.get("relpath") or next(iter(rec["statuses"]))
        rec["object_index"] = None
        row = next((o for o in rec["objects"] if o["status"] == rec["status"]), None)
        if row is not None and rec["statuses"].get(rec["relpath"]) != rec["status"]:  # an object row's status
            rec.update(relpath=row["relpath"], object_index=row["object_index"])
        rec["client_root"] = rec.get("client_root") or client_root(spec)
        result.blocks.extend(_public(b) for b in blocks)
        result.defects.append(rec)


def _defect(root: Path, spec: Any, d: str, blocks: list[dict[str, Any]],
            pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """Inject defect `d` (its blocks not yet written; `pairs` the main blocks' pairs); the
    record's fields (§1.4, §4). The victim is the first block's first object (key rank 0,
    stage 0, `_k`), in rank 0's client root."""
    fpk = spec.mc_backend == "file_per_key"
    cr = client_root(spec)
    objs = [o for b in blocks for o in b["objects"]]
    if d in ("zero_filled", "size_mismatch"):  # the victim's value is wrong before it is written
        v = blocks[0]["objects"][0]
        v["value"] = bytes(len(v["value"])) if d == "zero_filled" else v["value"] + b"\x01" * 16
    if d == "corrupt_sidecar":  # two pairs: one .meta cut mid-field, one listing nothing
        new = _write(root, spec, blocks[0]["objects"]) + _write(root, spec, blocks[1]["objects"])
        a, b = (p for p in new if p["client_root"] == cr)
        data = (root / a["meta"]).read_bytes()
        (root / a["meta"]).write_bytes(data[:-1])  # the last entry's length now runs past the end
        bucket_b = (root / b["bucket"]).read_bytes()
        (root / b["meta"]).write_bytes(M.encode_meta(M.BucketMeta(len(bucket_b), (), ())))
        files = [a["meta"], a["bucket"], b["meta"], b["bucket"]]
        return {"relpath": a["meta"], "statuses": dict(zip(files, ["corrupt_sidecar", "orphan_data"] * 2)),
                "deleted": files}
    if d == "short" and not fpk:  # two blocks in one pair, the last record cut in its value
        _write(root, spec, objs)
        mine = [o for o in objs if o["client_root"] == cr]
        last = max(mine, key=lambda o: o["object_index"])
        bucket = root / last["bucket"]
        data = bucket.read_bytes()
        bucket.write_bytes(data[: len(data) - last["size"] // 2])
        return {"relpath": last["bucket"], "statuses": {last["relpath"]: "ok", last["bucket"]: "ok"},
                "objects": [_row(last, "short")], "read_fails": [last["storage_key"]]}
    if d in DEFECT_BLOCKS:
        _write(root, spec, objs)
    v = blocks[0]["objects"][0] if blocks else None
    first = pairs[0] if pairs else None
    if d == "orphan_data":
        assert v is not None
        os.unlink(root / v["relpath"])
        return {"statuses": {v["bucket"]: "orphan_data"}, "deleted": [v["bucket"]]}
    if d == "orphan_index":
        assert v is not None
        os.unlink(root / v["bucket"])
        return {"statuses": {v["relpath"]: "orphan_index"}, "deleted": [v["relpath"]]}
    if d == "short":  # a KVEntry cut in its value: the client does not start
        assert v is not None
        data = (root / v["relpath"]).read_bytes()
        (root / v["relpath"]).write_bytes(data[: len(data) - v["size"] // 2])
        return {"statuses": {v["relpath"]: "short"}, "refuses_start": True}
    if d == "misfiled" and not fpk:  # the deployment doc's `<id>-0.meta` name: never read
        assert first is not None
        rel = _join(first["client_root"], f"{first['id']}-0{M.META_SUFFIX}")
        _write_file(root / rel, (root / first["meta"]).read_bytes())
        return {"statuses": {rel: "misfiled"}, "client_root": first["client_root"]}
    if d == "misfiled":  # a valid KVEntry in another hash folder: registered, never read
        assert v is not None
        parts = v["relpath"].split("/")
        parts[-2] = "a" if parts[-2] != "a" else "b"
        rel = "/".join(parts)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        os.rename(root / v["relpath"], root / rel)
        blocks[0]["objects"][0]["relpath"] = rel
        return {"statuses": {rel: "misfiled"}, "read_fails": [v["storage_key"]]}
    if d == "header_invalid":  # junk at fpk(key): no KVEntry (field 13, wire type 6)
        assert v is not None
        (root / v["relpath"]).write_bytes(b"not a KVEntry\n")
        return {"statuses": {v["relpath"]: "header_invalid"}, "refuses_start": True}
    if d in ("zero_filled", "size_mismatch", "unreadable"):
        assert v is not None
        if d == "unreadable":
            target = v["relpath"] if fpk else v["bucket"]
            os.chmod(root / target, 0)
            if fpk:
                return {"statuses": {target: "unreadable"}}
            rows = [_row(o, "unreadable") for o in objs if o["bucket"] == target]
            return {"relpath": target, "statuses": {target: "unreadable"}, "objects": rows}
        if fpk:
            return {"statuses": {v["relpath"]: d}, "objects": [_row(v, d)]}
        return {"statuses": {v["relpath"]: "ok", v["bucket"]: "ok"}, "objects": [_row(v, d)]}
    if d == "replica_mismatch":  # the victim's key again in a second live pair, another value
        assert v is not None
        twin = {**v, "value": bytes(b ^ 0x5A for b in v["value"])}
        _write(root, spec, [twin])
        return {"relpath": twin["relpath"], "statuses": {twin["relpath"]: "ok", twin["bucket"]: "ok"},
                "objects": [_row(v, d), _row(twin, d)], "read_fails": [v["storage_key"]]}
    if d == "unsupported_key":  # another Mooncake user's key, same tenant
        skey = storage_key(spec, UNSUPPORTED_KEY).decode("utf-8", "surrogateescape")
        o: dict[str, Any] = {"key": UNSUPPORTED_KEY, "storage_key": skey, "client_root": cr, "value": b"\x07" * 64}
        _write(root, spec, [o])
        statuses = {o["relpath"]: "unsupported_layout"} if fpk else {o["relpath"]: "ok", o["bucket"]: "ok"}
        return {"relpath": o["relpath"], "statuses": statuses, "objects": [_row(o, "unsupported_layout")]}
    if d == "tmp_leftover":  # a valid KVEntry copy named *.tmp at depth 3: registered again
        entry = _first_kventry(root, spec)
        rel = entry + ".tmp"
        _write_file(root / rel, (root / entry).read_bytes())
        return {"statuses": {rel: "tmp_leftover"}}
    if d == "foreign":
        rels = [_join(cr, "notes.txt")]
        if fpk:
            rels.append(_join(cr, spec.mc_fsdir, "notes.txt"))  # depth 1 of the fsdir: never scanned
        else:
            assert first is not None
            rel = _join(first["client_root"], f"{first['id']}{M.BUCKET_SUFFIX}.kvmtmp")
            _write_file(root / rel, (root / first["bucket"]).read_bytes())
            rels.append(rel)
        _write_file(root / rels[0], b"not a Mooncake file\n")
        if fpk:
            _write_file(root / rels[1], b"not a Mooncake file\n")
        return {"statuses": dict.fromkeys(rels, "foreign")}
    if d == "nested_bucket":  # a .bucket moved aside into a sub-folder under an id no top-level .meta has
        assert first is not None  # (the start deletes it; under a live id it would be kept, never read)
        rel = _join(first["client_root"], NESTED_DIR, f"{first['id'] * 10}{M.BUCKET_SUFFIX}")
        _write_file(root / rel, (root / first["bucket"]).read_bytes())
        return {"statuses": {rel: "orphan_data"}, "deleted": [rel], "client_root": first["client_root"]}
    if d == "symlink":  # never followed by kvmigrate; Mooncake's is_regular_file would follow it
        if fpk:
            target = _first_kventry(root, spec)
            rel = target + ".link"
        else:
            assert first is not None
            target, rel = first["bucket"], _join(first["client_root"], "current.link")
        if os.path.lexists(root / rel):
            os.unlink(root / rel)
        os.symlink(os.path.relpath(root / target, (root / rel).parent), root / rel)
        return {"statuses": {rel: "foreign"}}
    # client_lock: 0.3.14's empty lock file in every bucket client root of the store (Mooncake's: ok)
    roots = sorted({p["client_root"] for p in pairs}) or [cr]
    rels = [_join(r, M.LOCK_NAME) for r in roots]
    for rel in rels:
        _write_file(root / rel, b"")
    return {"statuses": dict.fromkeys(rels, "ok")}


def _first_kventry(root: Path, spec: Any) -> str:
    """Relpath of the first main block's first KVEntry (file-per-key)."""
    o = block_objects(spec, block_hash_hex(spec.seed, 0, 64))[0]
    return _join(o["client_root"], M.fpk(_skey(o), spec.mc_fsdir))
