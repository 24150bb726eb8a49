#!/usr/bin/env python3
"""Benchmark `kvmigrate report` on a generated manifest of N rows (default 1M).

    python scripts/bench_report.py [--rows 1000000] [--dir /tmp/kvm-bench]

Writes a realistic manifest (a single-rank vLLM namespace of linkable blocks, an llm-d
TP=2 full-attention namespace whose blocks concat or miss a rank, an llm-d TP=2 MLA
namespace of rank-0 links and replicas with some mismatches, a few defects), then runs
`kvmigrate report` in each format as a child process and prints wall time and peak RSS
(getrusage of the child). Columns are built with Arrow buffers, not per-row objects.
"""

from __future__ import annotations

import argparse
import array
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa

from kvmigrate.manifest import SCHEMA, ManifestWriter

ROOT = "/srv/kvcache"
BATCH = 200_000


def _hashes(start: int, n: int, salt: int) -> pa.Array:
    """n distinct 32-byte block hashes (binary), from two counters."""
    data = bytearray(32 * n)
    for i in range(n):
        v = start + i
        data[32 * i:32 * i + 16] = (v * 0x9E3779B97F4A7C15 % (1 << 128)).to_bytes(16, "little")
        data[32 * i + 16:32 * i + 32] = (salt << 64 | v).to_bytes(16, "little")
    offsets = array.array("i", range(0, 32 * (n + 1), 32))
    return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(bytes(data))])


STRING = pa.string()  # _const's default type


def _const(value, n: int, typ: pa.DataType = STRING) -> pa.Array:
    return pa.array([value], typ).take(pa.array([0] * n, pa.int32())) if value is not None else pa.nulls(n, typ)


def _dict(values: list, n: int) -> pa.Array:
    """Cycle through `values` (string) for n rows, dictionary encoded."""
    idx = pa.array([i % len(values) for i in range(n)], pa.int32())
    return pa.DictionaryArray.from_arrays(idx, pa.array(values, pa.string()))


def _batch(base: str, target: str | None, family: str, n: int, start: int, salt: int, *, rank: int, size: int,
           action: list[str], status: list[str], reason: list[str], nlink: int = 1) -> pa.Table:
    hashes = _hashes(start, n, salt)
    relpath = pa.array([f"{base}_r{rank}/{start + i:06x}.bin" for i in range(n)], pa.string())
    cols = {
        "relpath": relpath, "family": _const(family, n), "scheme": _const("S1", n), "model_name": _const("m", n),
        "source_d12": _const(base[-12:], n), "source_base": _const(base, n), "deployment": _const(base, n),
        "target_profile": _const("vllm-0.28" if target else None, n), "target_d12": _const(None, n),
        "target_base": _const(target, n), "rank": _const(rank, n, pa.int32()), "group": _const(0, n, pa.int32()),
        "block_hash": hashes, "size": _const(size, n, pa.int64()), "mtime_ns": _const(1, n, pa.int64()),
        "inode": pa.array(range(salt * 10**8 + start, salt * 10**8 + start + n), pa.uint64()),
        "dev": _const(1, n, pa.uint64()), "nlink": _const(nlink, n, pa.uint32()),
        "content_xxh3_128": pa.nulls(n, pa.binary(16)), "payload_xxh3_128": pa.nulls(n, pa.binary(16)),
        "status": _dict(status, n), "action": _dict(action, n), "reason": _dict(reason, n),
        "target_relpath": _const(None, n),
    }
    arrays = [cols[f.name] if not pa.types.is_dictionary(f.type) or pa.types.is_dictionary(cols[f.name].type)
              else cols[f.name].dictionary_encode() for f in SCHEMA]
    return pa.Table.from_arrays(arrays, schema=SCHEMA)


def write_manifest(path: Path, rows: int, worst: bool = False) -> int:
    """`worst`: every llm-d block is `none` (e.g. its target was refused), so each of them
    needs a distinct key to be counted once: the largest key set the summary keeps."""
    vllm, llmd, mla = "llama_3f1b68c1da90", "qwen_0123456789ab", "deepseek_aaaaaaaaaaaa"
    meta = {"tool_version": "bench", "command": "bench", "root": ROOT, "target_profile": "vllm-0.28",
            "verify": "size", "shard": "0/1", "facts": {"flags": {}, "facts_file": None},
            "namespaces": {
                vllm: {"family": "vllm", "scheme": "S1", "ranks": [0], "target": {"base_name": vllm + "_t"},
                       "status": "ok"},
                llmd: {"family": "llmd", "scheme": "S1", "ranks": [0, 1], "target": {"base_name": llmd + "_t"},
                       "status": "ok"},
                mla: {"family": "llmd", "scheme": "S1", "ranks": [0, 1], "target": {"base_name": mla + "_t",
                                                                                      "replicated_layout": True},
                      "status": "ok"}}}
    n_vllm = rows * 4 // 10          # 40 % single-rank rows
    n_llmd = rows * 4 // 10 // 2     # 40 % as rank pairs
    n_mla = (rows - n_vllm - 2 * n_llmd) // 2
    written = 0
    with ManifestWriter(path, meta) as w:
        for start in range(0, n_vllm, BATCH):
            n = min(BATCH, n_vllm - start)
            w.write(_batch(vllm, vllm + "_t", "vllm", n, start, 1, rank=0, size=2 << 20,
                           action=["link"] * 99 + ["none"], status=["ok"] * 99 + ["short"],
                           reason=["re-key"] * 99 + ["empty file"]))
            written += n
        for start in range(0, n_llmd, BATCH):  # rank 0 leads concat; every 50th block misses rank 1
            n = min(BATCH, n_llmd - start)
            lead, follow = ("none", "no target identity for this namespace") if worst else \
                ("concat", "part of concat from rank 0")
            w.write(_batch(llmd, llmd + "_t", "llmd", n, start, 2, rank=0, size=1 << 20,
                           action=[lead] * 49 + ["none"], status=["ok"] * 49 + ["incomplete"],
                           reason=["concat 2 shards" if not worst else follow] * 49
                           + ["block incomplete: rank 1 file missing"]))
            w.write(_batch(llmd, llmd + "_t", "llmd", n, start, 2, rank=1, size=1 << 20,
                           action=["none"], status=["ok"] * 49 + ["incomplete"],
                           reason=[follow] * 49 + ["block incomplete: rank 0 file missing"]))
            written += 2 * n
        for start in range(0, n_mla, BATCH):  # rank 0 links, rank 1 replicas; every 100th differs
            n = min(BATCH, n_mla - start)
            w.write(_batch(mla, mla + "_t", "llmd", n, start, 3, rank=0, size=512 << 10, nlink=2,
                           action=["link"] * 99 + ["none"], status=["ok"] * 99 + ["replica_mismatch"],
                           reason=["rank-0 MLA replica"] * 99 + ["replicas differ"]))
            w.write(_batch(mla, mla + "_t", "llmd", n, start, 3, rank=1, size=512 << 10,
                           action=["none"], status=["ok"] * 99 + ["replica_mismatch"],
                           reason=["replica of rank 0"] * 99 + ["replicas differ"]))
            written += 2 * n
    return written


_WRAPPER = """
import resource, subprocess, sys, time
t0 = time.perf_counter()
rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
print(time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, rc)
"""


def measure(cmd: list[str]) -> tuple[float, int, int]:
    """(seconds, peak RSS in KiB, exit code) of `cmd`, run under a fresh wrapper process so
    that getrusage(RUSAGE_CHILDREN) sees this one child only."""
    out = subprocess.run([sys.executable, "-c", _WRAPPER, *cmd], capture_output=True, text=True, check=True)
    seconds, rss, rc = out.stdout.split()
    return float(seconds), int(rss), int(rc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dir", default="/tmp/kvm-bench-report")
    ap.add_argument("--worst", action="store_true", help="every llm-d block `none` (largest distinct-key set)")
    args = ap.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    m = d / f"manifest-{args.rows}{'-worst' if args.worst else ''}.parquet"
    t0 = time.perf_counter()
    rows = write_manifest(m, args.rows, args.worst)
    print(f"manifest: {rows} rows, {m.stat().st_size / 2**20:.1f} MiB, written in {time.perf_counter() - t0:.1f} s")
    kvm = [sys.executable, "-m", "kvmigrate"]
    base_s, base_rss, _ = measure([sys.executable, "-c", "import pyarrow, pyarrow.parquet, pyarrow.compute"])
    print(f"baseline (python + import pyarrow): {base_s:.2f} s, peak RSS {base_rss / 1024:.0f} MiB")
    for fmt in ("json", "text", "md", "html"):
        s, rss, code = measure(kvm + ["report", str(m), "--format", fmt, "-o", str(d / f"report.{fmt}")])
        print(f"report --format {fmt:4s}: {s:.2f} s, peak RSS {rss / 1024:.0f} MiB, exit {code}")


if __name__ == "__main__":
    main()
