"""The LMCache side of scripts/bench.py (group `lmcache`), run with kvmigrate's interpreter.

    python scripts/bench_lmcache.py build TIER --chunks N [--tp 2] [--seed S]
    python scripts/bench_lmcache.py reshard SRC_TIER DST_TIER [--tp-dst 4]
    python scripts/bench_lmcache.py check SRC_TIER DST_TIER [--chunks 2]

`build` writes an fs tier of real chunk files at a real model's size (Llama-3.1-8B: 32
layers, 8 KV heads of 128, bf16, chunks of 256 tokens): every name and RemoteMetadata
header comes from kvmigrate/formats/lmcache.py, the payload is random. `synth` cannot
write these: its chunks have 4-element heads, made for tests.

`reshard` is the driver the bench times while `migrate` does not plan an LMCache
`reshard`: it groups the tier's files into chunks by their names, and writes each target
rank's file (its name at the target TP, the fs header, then the payload from
kvmigrate.transforms_lmcache.write_reshard) into DST_TIER. It prints one JSON line.

`check` compares the first chunks' outputs with the head slices taken in plain Python
(untimed: the bench's evidence that the timed run wrote the right bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

from kvmigrate.formats import lmcache as L
from kvmigrate.transforms_lmcache import ReshardGeometry, rank_heads, write_reshard

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LAYERS, TOKENS, TOTAL_KV_HEADS, HEAD_DIM, DTYPE = 32, 256, 8, 128, "bfloat16"


def geometry(tp_src: int, tp_dst: int) -> ReshardGeometry:
    return ReshardGeometry(LAYERS, TOKENS, TOTAL_KV_HEADS, HEAD_DIM, L.DTYPE_BYTES[DTYPE], tp_src, tp_dst)


def chunk_file(key: L.Key, payload_bytes: int, heads: int) -> tuple[str, bytes]:
    """The file name and RemoteMetadata header LMCache's fs backend writes for `key`."""
    shape = L.payload_shape(False, LAYERS, TOKENS, heads * HEAD_DIM)
    header = L.encode_fs_header(payload_bytes, L.memory_format(False), DTYPE, shape)
    return L.file_name(key, "fs"), header


def build(tier: Path, chunks: int, tp: int, seed: int) -> dict:
    g = geometry(tp, tp)
    tier.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    nbytes = 0
    for _ in range(chunks):
        h = rng.getrandbits(63) or 1
        field = L.hash_hex(-h if rng.random() < 0.5 else h)  # signed, unpadded, as LMCache writes it
        for rank in range(tp):
            key = L.Key("lmc-k3", MODEL, tp, rank, field, DTYPE)
            name, header = chunk_file(key, g.source_bytes, g.heads_per_rank(tp))
            with open(tier / name, "wb") as f:
                f.write(header)
                f.write(os.urandom(g.source_bytes))
            nbytes += len(header) + g.source_bytes
    return {"chunks": chunks, "files": chunks * tp, "bytes": nbytes, "file_bytes": L.FS_HEADER_ONE_GROUP + g.source_bytes}


def chunks_of(tier: Path) -> tuple[int, dict[str, dict[int, Path]]]:
    """The tier's chunks by hash field: {hash: {rank: path}}, and their TP (every key's ws)."""
    found: dict[str, dict[int, Path]] = defaultdict(dict)
    tps = set()
    for entry in os.scandir(tier):
        parsed = L.parse_name(entry.name)
        if parsed is None or parsed.backend != "fs":
            raise SystemExit(f"{entry.path}: not an LMCache chunk name")
        found[parsed.key.hash][parsed.key.wid] = Path(entry.path)
        tps.add(parsed.key.ws)
    if len(tps) != 1:
        raise SystemExit(f"{tier}: chunks of {len(tps)} world sizes ({sorted(tps)}); one expected")
    return tps.pop(), found


def reshard(src: Path, dst: Path, tp_dst: int) -> dict:
    start = time.perf_counter()
    tp_src, chunks = chunks_of(src)
    g = geometry(tp_src, tp_dst)
    dst.mkdir(parents=True, exist_ok=True)
    read = written = 0
    for field, ranks in chunks.items():
        with ExitStack() as stack:
            sources = [(stack.enter_context(open(ranks[r], "rb")), L.FS_HEADER_ONE_GROUP) for r in range(tp_src)]
            for t in range(tp_dst):
                key = L.Key("lmc-k3", MODEL, tp_dst, t, field, DTYPE)
                name, header = chunk_file(key, g.target_bytes, g.heads_per_rank(tp_dst))
                with open(dst / name, "wb") as out:
                    out.write(header)
                    written += len(header) + write_reshard(sources, out, g, t)
        read += tp_src * (L.FS_HEADER_ONE_GROUP + g.source_bytes)
    return {"chunks": len(chunks), "tp_src": tp_src, "tp_dst": tp_dst, "source_bytes": read,
            "written_bytes": written, "seconds": round(time.perf_counter() - start, 3)}


def check(src: Path, dst: Path, n: int) -> dict:
    """Every target row of the first `n` chunks equals the source rows' heads it names."""
    tp_src, chunks = chunks_of(src)
    tp_dst, out = chunks_of(dst)
    g = geometry(tp_src, tp_dst)
    hb = g.head_bytes
    checked = 0
    for field in sorted(chunks)[:n]:
        src_rows = [L.FS_HEADER_ONE_GROUP, g.heads_per_rank(tp_src) * hb]
        data = [ranks.read_bytes() for _, ranks in sorted(chunks[field].items())]
        for t in range(tp_dst):
            got = out[field][t].read_bytes()
            want = bytearray(got[:L.FS_HEADER_ONE_GROUP])
            for row in range(g.rows):
                for head in rank_heads(TOTAL_KV_HEADS, tp_dst, t):
                    s = head // g.heads_per_rank(tp_src)
                    at = src_rows[0] + row * src_rows[1] + (head - rank_heads(TOTAL_KV_HEADS, tp_src, s)[0]) * hb
                    want += data[s][at:at + hb]
            if bytes(want) != got:
                raise SystemExit(f"{out[field][t]}: not the heads {list(rank_heads(TOTAL_KV_HEADS, tp_dst, t))}")
            checked += 1
    return {"checked_target_files": checked, "target_files": sum(len(r) for r in out.values()),
            "target_chunks": len(out)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("tier", type=Path)
    b.add_argument("--chunks", type=int, required=True)
    b.add_argument("--tp", type=int, default=2)
    b.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("reshard")
    r.add_argument("src", type=Path)
    r.add_argument("dst", type=Path)
    r.add_argument("--tp-dst", type=int, default=4)
    c = sub.add_parser("check")
    c.add_argument("src", type=Path)
    c.add_argument("dst", type=Path)
    c.add_argument("--chunks", type=int, default=2)
    a = p.parse_args(argv)
    if a.cmd == "build":
        res = build(a.tier, a.chunks, a.tp, a.seed)
    elif a.cmd == "reshard":
        res = reshard(a.src, a.dst, a.tp_dst)
    else:
        res = check(a.src, a.dst, a.chunks)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
