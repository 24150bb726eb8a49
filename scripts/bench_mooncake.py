"""The Mooncake side of scripts/bench.py (group `mooncake`), run with kvmigrate's interpreter.

    python scripts/bench_mooncake.py build STORE --objects N [--value-bytes 64] [--seed S]
    python scripts/bench_mooncake.py check STORE --objects N [--scheme mc-scoped]

`build` writes one vLLM bucket client root (`STORE`, Mooncake's `ssd_offload_path`) of N
objects in ceil(N / 500) pairs, 500 objects a pair as Mooncake fills them: every `.meta`,
`.bucket` record, id and key through kvmigrate/formats/mooncake.py (`build_bucket`,
`encode_meta`). The keys are vLLM 0.34's at TP 1 (one object a block), raw as Mooncake
≤ 0.3.11 stored them, so a scan finds every object pending `rekey` under 0.3.14; the values
are small and random (the scan reads indexes and stats buckets: their bytes do not matter).
`synth --family mooncake` writes the same grammar with model-shaped values, far slower at
a million objects. It prints one JSON line.

`check` reads the store back with the format module (untimed: the bench's evidence that the
tree is what it says, every pair live and every key where its index puts it). With
`--scheme`, after a rekey: every index key of that scheme (a rekey changes only the `.meta`'s
keys; the inline key in the `.bucket` stays, as Mooncake never reads it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

from kvmigrate.formats import mooncake as M

MODEL = "Llama-3.1-8B-Instruct"  # vLLM's key spells the served model's basename
FIRST_ID = (1_760_000_000 << 12)  # (unix_seconds << 12) + seq, as a client names its buckets


def key(block_hash: str) -> bytes:
    """The raw storage key (≤ 0.3.11) of a block's one object at TP 1."""
    return M.StorageKey(None, M.format_vllm_key(M.VllmKey(None, MODEL, "", 0, 0, 0, 0, 0, block_hash))).encode()


def build(store: Path, objects: int, value_bytes: int, seed: int) -> dict:
    start = time.perf_counter()
    store.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    pairs = nbytes = 0
    for first in range(0, objects, M.MAX_BUCKET_KEYS):
        n = min(M.MAX_BUCKET_KEYS, objects - first)
        entries = sorted((key(f"{rng.getrandbits(256):064x}"), rng.randbytes(value_bytes)) for _ in range(n))
        data, meta = M.build_bucket(entries)
        index = M.encode_meta(meta)
        bucket_id = FIRST_ID + pairs
        with open(store / f"{bucket_id}{M.BUCKET_SUFFIX}", "wb") as f:  # the .bucket, then its .meta
            f.write(data)
        with open(store / f"{bucket_id}{M.META_SUFFIX}", "wb") as f:
            f.write(index)
        pairs += 1
        nbytes += len(data) + len(index)
    return {"objects": objects, "pairs": pairs, "files": 2 * pairs, "bytes": nbytes, "value_bytes": value_bytes,
            "key_bytes": len(key("0" * 64)), "seconds": round(time.perf_counter() - start, 3)}


def check(store: Path, objects: int, scheme: str | None = None) -> dict:
    """Every `.meta` parses, lists ≤ 500 keys whose records lie inside its `.bucket` with the
    key inline (with `scheme`: every key of that scheme instead); the store holds `objects`
    distinct keys in all."""
    keys: set[bytes] = set()
    pairs = 0
    for meta_path in sorted(store.glob(f"*{M.META_SUFFIX}")):
        meta = M.decode_meta(meta_path.read_bytes())
        data = meta_path.with_suffix(M.BUCKET_SUFFIX).read_bytes()
        if not 0 < len(meta.keys) <= M.MAX_BUCKET_KEYS or len(meta.keys) != len(meta.objects):
            raise SystemExit(f"{meta_path}: {len(meta.keys)} keys, {len(meta.objects)} entries")
        for k, o in zip(meta.keys, meta.objects, strict=True):
            if o.end > len(data) or (scheme is None and data[o.offset:o.value_start] != k):
                raise SystemExit(f"{meta_path}: the record of {k!r} is not where its index puts it")
            if scheme is not None and M.parse_storage_key(k).scheme != scheme:
                raise SystemExit(f"{meta_path}: key {k!r} is not {scheme}")
        if meta.data_size != len(data):
            raise SystemExit(f"{meta_path}: data_size {meta.data_size}, .bucket of {len(data)} bytes")
        keys.update(meta.keys)
        pairs += 1
    if len(keys) != objects:
        raise SystemExit(f"{store}: {len(keys)} distinct keys, {objects} expected")
    return {"pairs": pairs, "objects": len(keys), **({"scheme": scheme} if scheme else {})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("store", type=Path)
    b.add_argument("--objects", type=int, required=True)
    b.add_argument("--value-bytes", type=int, default=64)
    b.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("check")
    c.add_argument("store", type=Path)
    c.add_argument("--objects", type=int, required=True)
    c.add_argument("--scheme", choices=M.SCHEMES)
    a = p.parse_args(argv)
    if a.cmd == "build":
        if a.objects < 1 or a.value_bytes < 1:
            raise SystemExit("--objects and --value-bytes must be positive")
        res = build(a.store, a.objects, a.value_bytes, a.seed)
    else:
        res = check(a.store, a.objects, a.scheme)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
