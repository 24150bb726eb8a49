"""The synthetic cache trees the groups run on: their specs, sizes, space, counts and warmth."""

from __future__ import annotations

import math
import os
import random
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .harness import q, sh

# --------------------------------------------------------------------------- trees

@dataclass(frozen=True)
class TreeSpec:
    """One synthetic tree: llm-d, TP=2, MLA (identical replicas on both ranks, so the
    duplicate finders have real replica groups to find), real fan-out <hhh>/<hh>_g0.
    Four MLA layers of `page_bytes` each make one file of 4 x page_bytes."""

    name: str
    title: str
    blocks: int          # block keys in total (files = 2 x blocks, one per rank)
    page_bytes: int
    tp: int = 2
    layers: int = 4
    family: str = "llmd"  # "sglang": a flat HiCache directory, MLA (one file per page, no config.json)

    @property
    def file_bytes(self) -> int:
        return self.layers * self.page_bytes

    @property
    def files(self) -> int:
        return self.blocks if self.family == "sglang" else self.tp * self.blocks

    @property
    def other_files(self) -> int:
        """Files besides the blocks: the namespace's config.json (none in a flat directory)."""
        return 0 if self.family == "sglang" else 1

    def synth_args(self, blocks: int, seed: int) -> list[str]:
        if self.family == "sglang":  # latent pages of 4 layers x 16 tokens x 8 x 2 B = 1 KiB
            return ["--family", "sglang", "--sgl-era", "e4", "--kv-kind", "mla", "--tp", str(self.tp),
                    "--layers", str(self.layers), "--blocks", str(blocks), "--seed", str(seed),
                    "--model", "deepseek-ai/DeepSeek-V3"]
        return ["--family", "llmd", "--tp", str(self.tp), "--kv-kind", "mla", "--layers", str(self.layers),
                "--block-bytes", str(self.page_bytes), "--blocks", str(blocks), "--seed", str(seed)]


SCALES = {
    # quick run: ~50k small files + 256 MiB of 1 MiB files
    "small": {"files4k": 25_000, "files1m": 128, "flat": 50_000},
    # the sizes: >= 1M small files, >= 4 GiB of 1 MiB files, a 1M-file HiCache directory
    "large": {"files4k": 500_000, "files1m": 2_048, "flat": 1_000_000},
}


def tree_specs(scale: str, flat_files: int | None = None) -> dict[str, TreeSpec]:
    """The trees of a scale; `flat_files` (--flat-files) sizes the flat HiCache directory."""
    s = dict(SCALES[scale])
    if flat_files:
        s["flat"] = flat_files
    return {
        "files4k": TreeSpec("files4k", "4 KiB files (per-file overhead)", s["files4k"], 1024),
        "files1m": TreeSpec("files1m", "1 MiB files (bandwidth)", s["files1m"], 256 * 1024),
        "flat": TreeSpec("flat", "SGLang HiCache directory (1 KiB page files in one folder)", s["flat"], 256,
                         tp=8, family="sglang"),
        # the scale group's smaller trees: a tenth and three tenths of files4k (100k and 300k files at large)
        "files4k-0.1": TreeSpec("files4k-0.1", "4 KiB files, a tenth", s["files4k"] // 10, 1024),
        "files4k-0.3": TreeSpec("files4k-0.3", "4 KiB files, three tenths", 3 * s["files4k"] // 10, 1024),
    }


SCALE_TREES = ("files4k-0.1", "files4k-0.3", "files4k")  # the scale group's trees, smallest first


FANOUT_LEAVES = 4096 * 256  # <hhh>/<hh> leaf folders one rank folder can have


def expected_dirs(blocks: int) -> int:
    """Folders one rank folder of `blocks` uniformly hashed keys occupies (<hhh> + leaves)."""
    hhh = 4096 * (1 - math.exp(-blocks / 4096))
    leaves = FANOUT_LEAVES * (1 - math.exp(-blocks / FANOUT_LEAVES))
    return int(hhh + leaves) + 1


def trees_of(groups: list[str]) -> set[str]:
    """The trees these groups run on (all of them when no group names one)."""
    wanted = {GROUP_TREES[g] for g in groups if g in GROUP_TREES}
    return wanted or set(GROUP_TREES.values())


def space_needed(specs: dict[str, TreeSpec], groups: list[str]) -> dict[str, int]:
    """Bytes and inodes the run needs at its peak: both trees, one extra copy of a rank
    folder's folders (cp -al or the migrated namespace, removed between repetitions),
    the manifests and the tool outputs."""
    block = 4096
    inodes = 0
    nbytes = 0
    wanted = trees_of(groups)
    for name, spec in specs.items():
        if name not in wanted:
            continue
        dirs = 1 if spec.family == "sglang" else spec.tp * expected_dirs(spec.blocks) + spec.tp + 2
        inodes += spec.files + 1 + dirs
        nbytes += spec.files * max(block, -(-spec.file_bytes // block) * block) + dirs * block
        manifests = 4 if "migrate" in groups else 2
        nbytes += manifests * spec.files * 200
        nbytes += 3 * spec.files * 300  # jdupes / rdfind / xxhsum outputs
    if "migrate" in groups:
        d = expected_dirs(specs["files4k"].blocks) + 4
        inodes += 2 * d
        nbytes += 2 * d * block
    return {"bytes": int(nbytes * 1.1) + (1 << 30), "inodes": int(inodes * 1.1) + 10_000}


def fs_free(path: Path) -> dict[str, int]:
    st = os.statvfs(path)
    return {"bytes": st.f_bavail * st.f_frsize, "inodes": st.f_favail, "total_bytes": st.f_blocks * st.f_frsize,
            "total_inodes": st.f_files}



# --------------------------------------------------------------------------- helpers on trees

def walk_counts(root: Path, sample: int = 256, seed: int = 0) -> dict:
    """Files, bytes and folders of a tree (one `find -printf` pass), plus a random sample
    of file paths to check page-cache residency with."""
    proc = subprocess.Popen(["find", str(root), "-printf", r"%y %s %p\n"], stdout=subprocess.PIPE)
    files = dirs = other = nbytes = 0
    rng = random.Random(seed)
    picked: list[str] = []
    assert proc.stdout is not None
    for raw in proc.stdout:
        kind, size, path = raw.decode("utf-8", "surrogateescape").rstrip("\n").split(" ", 2)
        if kind == "f":
            files += 1
            nbytes += int(size)
            if len(picked) < sample:
                picked.append(path)
            else:
                j = rng.randrange(files)
                if j < sample:
                    picked[j] = path
        elif kind == "d":
            dirs += 1
        else:
            other += 1
    proc.wait()
    return {"files": files, "bytes": nbytes, "dirs": dirs, "other": other, "inodes": files + dirs + other,
            "sample": picked}


def residency(paths: list[str]) -> float | None:
    """Fraction of the sampled files' pages in the page cache (fincore)."""
    if not paths or not shutil.which("fincore"):
        return None
    p = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES,SIZE", *paths],
                       capture_output=True, text=True)
    res = size = 0
    for line in p.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            res += int(parts[0])
            size += int(parts[1])
    return round(res / size, 4) if size else None


GROUP_TREES = {"meta": "files4k", "hash4k": "files4k", "hash1m": "files1m", "migrate": "files4k", "flat": "flat",
               "cold4k": "files4k", "cold1m": "files1m", "scale": "files4k"}
COLD_GROUPS = ("cold4k", "cold1m")
AFTER_GROUPS = ("baseline", "journal", "prune")  # run after the others (runner.run_after_groups)


def warm(root: Path) -> float:
    """Read every folder entry, inode and byte of the tree once (untimed)."""
    start = time.perf_counter()
    subprocess.run(sh(f"find {q(root)} -type f -printf '%s %i %T@ %p\\n' > /dev/null"), check=False)
    subprocess.run(sh(f"find {q(root)} -type f -print0 | xargs -0 cat > /dev/null"), check=False)
    return time.perf_counter() - start



def tree_summary(info: dict) -> dict:
    """A tree's stamp as the report keeps it: its top-level names only counted. The stamp
    (in the workdir) lists them to find what an earlier run left; a flat directory has a
    million of them, which once made a 100 MB benchmarks.json."""
    out = {k: v for k, v in info.items() if k != "top_level"}
    out["top_level_entries"] = len(info.get("top_level", ()))
    return out
