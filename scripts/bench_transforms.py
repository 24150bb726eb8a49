"""Transform throughput (MB/s of output written) against plain `cp` of the same bytes.

    /work/venv/bin/python scripts/bench_transforms.py [--dir DIR] [--reps 3] [--json OUT]

Three levels, each with real-model geometry (see CASES):
  memory   the pure functions of kvmigrate.transforms on bytes already in memory;
  file     what `migrate --apply` runs per block: open the rank files, stream the transform
           through the hashing writer into a new file (outputs.write_transform), with and
           without fsync; against `cp` of files holding the same number of bytes (one cp
           process for the whole set; with fsync: cp then fsync of every copy);
  apply    `kvmigrate migrate ROOT --apply` on a synthetic llm-d tree (scan, plan, journal,
           hashing, fsync, publish) against `cp -r` of its rank folders + sync.
Sources are read once before timing (warm page cache). The best of --reps runs counts.
MB = 10^6 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvmigrate.migrate.outputs import HashingWriter, TransformSpec, write_transform
from kvmigrate.transforms import concat_cells, pad_len, relayout_block_major_to_tensor_major, slice_cell

MB = 10**6
# name, spec, files per set, blocks: sizes from real models (16-token GPU blocks, bf16)
#   DeepSeek-V3 MLA page: 16 x (512 + 64) x 2 = 18432 bytes, 61 layers
#   Llama-3.1-8B at TP=2: 4 KV heads per rank x 128 x 16 x 2 = 16384 bytes per K or V page, 32 layers
CASES = [
    ("relayout MLA B=16 (DeepSeek, llm-d default 256-token files)",
     TransformSpec("relayout", "mla", ranks=1, cells=1, cell=16 * 61 * 18432, B=16, T=61, P=18432), 12),
    ("relayout+concat full B=16 TP=2 (Llama-8B)",
     TransformSpec("relayout", "full", ranks=2, cells=2, cell=16 * 64 * 16384, B=16, T=64, P=16384), 8),
    ("concat full B=1 TP=2 (Llama-8B)",
     TransformSpec("concat", "full", ranks=2, cells=2, cell=64 * 16384, B=1, T=1, P=64 * 16384), 96),
    ("slice MLA TP=8 B=1 (DeepSeek rows of 8 cells)",
     TransformSpec("slice", "mla", ranks=1, cells=1, cell=61 * 18432, row_cells=8), 48),
]


def _write_random(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 1 << 24)
            f.write(os.urandom(n))
            left -= n


def _warm(paths: list[Path]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


def make_sources(work: Path, spec: TransformSpec, blocks: int) -> list[list[Path]]:
    """Per block, the files the transform reads (slice: one row of N equal cells)."""
    out = []
    for b in range(blocks):
        files = []
        if spec.action == "slice":
            cell = os.urandom(spec.cell)
            p = work / f"b{b}.row"
            p.write_bytes(cell * spec.row_cells + bytes(pad_len(spec.cell * spec.row_cells)
                                                        - spec.cell * spec.row_cells))
            files.append(p)
        else:
            for r in range(spec.ranks):
                p = work / f"b{b}.r{r}"
                _write_random(p, spec.cell)
                files.append(p)
        out.append(files)
    return out


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_memory(spec: TransformSpec, sources: list[list[Path]], reps: int) -> float:
    data = [[p.read_bytes() for p in files] for files in sources[:4]]

    def run() -> None:
        for files in data:
            if spec.action == "slice":
                slice_cell(files[0], cell=spec.cell)
            elif spec.action == "concat":
                concat_cells(files)
            else:
                concat_cells([relayout_block_major_to_tensor_major(f, B=spec.B, T=spec.T, P=spec.P)
                              for f in files[:spec.cells]])

    return len(data) * spec.output_size / best(run, reps) / MB


def bench_file(spec: TransformSpec, sources: list[list[Path]], out: Path, reps: int, fsync: bool) -> float:
    def run() -> None:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        for b, files in enumerate(sources):
            fds = [os.open(p, os.O_RDONLY) for p in files]
            fd = os.open(out / f"b{b}.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                w = HashingWriter(fd)
                write_transform(spec, fds, w)
                w.flush()
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
                for s in fds:
                    os.close(s)

    return len(sources) * spec.output_size / best(run, reps) / MB


def bench_cp(spec: TransformSpec, work: Path, blocks: int, out: Path, reps: int, fsync: bool) -> float:
    """cp of files holding exactly the output bytes (one cp process for the set)."""
    same = work / "same"
    same.mkdir(exist_ok=True)
    files = []
    for b in range(blocks):
        p = same / f"b{b}.bin"
        if not p.exists():
            _write_random(p, spec.output_size)
        files.append(p)
    _warm(files)

    def run() -> None:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        subprocess.run(["cp", *map(str, files), str(out)], check=True)
        if fsync:
            for p in out.iterdir():
                fd = os.open(p, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)

    return blocks * spec.output_size / best(run, reps) / MB


def bench_apply(work: Path, reps: int) -> dict[str, float]:
    """`kvmigrate migrate --apply` (relayout + concat of a TP=2 llm-d tree) vs cp -r + sync."""
    from kvmigrate.synth import SynthSpec, build

    kvm = str(Path(sys.executable).with_name("kvmigrate"))
    spec = SynthSpec(family="llmd", tp=2, layers=32, tensors_per_layer=2, page_bytes=16384, blocks_per_file=16,
                     blocks=8)
    flags = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--tensors-per-layer",
             "2", "--page-bytes", "16384", "-q"]
    out_bytes = spec.blocks * pad_len(2 * 16 * 64 * 16384)
    apply_t, cp_t = [], []
    for _ in range(reps):
        root = work / "apply-root"
        shutil.rmtree(root, ignore_errors=True)
        res = build(root, spec)
        _warm([root / f for f in res.block_files()])
        t = time.perf_counter()
        subprocess.run([kvm, "migrate", str(root), *flags, "--apply"], check=True)
        apply_t.append(time.perf_counter() - t)
        dst = work / "cp-dst"
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir()
        t = time.perf_counter()  # both rank folders: exactly the bytes of the output rows
        subprocess.run(["cp", "-r", *[str(root / d) for d in res.namespaces[0]["rank_dirs"]], str(dst)],
                       check=True)
        subprocess.run(["sync", "-f", str(dst)], check=True)
        cp_t.append(time.perf_counter() - t)
        shutil.rmtree(dst, ignore_errors=True)
    return {"apply_MBps": out_bytes / min(apply_t) / MB, "cp_r_sync_MBps": out_bytes / min(cp_t) / MB,
            "apply_seconds": min(apply_t), "output_MB": out_bytes / MB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir on the root filesystem)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvmigrate-bench-transforms-", dir=args.dir))
    results = []
    try:
        for name, spec, blocks in CASES:
            case = work / "case"
            shutil.rmtree(case, ignore_errors=True)
            case.mkdir()
            sources = make_sources(case, spec, blocks)
            _warm([p for files in sources for p in files])
            row = {"case": name, "blocks": blocks, "output_MB": round(blocks * spec.output_size / MB, 1),
                   "memory_MBps": bench_memory(spec, sources, args.reps),
                   "file_MBps": bench_file(spec, sources, case / "out", args.reps, fsync=False),
                   "cp_MBps": bench_cp(spec, case, blocks, case / "cp", args.reps, fsync=False),
                   "file_fsync_MBps": bench_file(spec, sources, case / "out", args.reps, fsync=True),
                   "cp_fsync_MBps": bench_cp(spec, case, blocks, case / "cp", args.reps, fsync=True)}
            results.append(row)
            print(f"{name}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items() if k.endswith("MBps")), flush=True)
        apply = bench_apply(work, args.reps)
        print(f"migrate --apply relayout+concat: {apply['apply_MBps']:.0f} MB/s of output "
              f"({apply['output_MB']:.0f} MB in {apply['apply_seconds']:.2f} s, scan included); "
              f"cp -r + sync {apply['cp_r_sync_MBps']:.0f} MB/s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"cases": results, "apply": apply}, indent=2))


if __name__ == "__main__":
    main()
