"""An LMCache tier's scan keeps its peak RSS flat as the tier grows (a memory bound, not a
timed assert).

One tier (MLA TP 2 saved by rank 0, `kvmigrate synth --family lmcache`: one file a chunk
for fs, a data file and its sidecar for GDS) of each size is scanned in a child
interpreter (tests/helpers/memory.py `peak_rss`) with the facts that plan it. The bound is
the one of tests/memory/test_store_scan_rss.py: PER_FILE_BOUND bytes a file plus the
allocator's NOISE_KIB.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.memory import peak_rss

pytestmark = pytest.mark.slow

# chunks of each tier: the small one already fills 8 partitions (scan/tier_spill.py
# PART_FILES), so the allocator's first batches count in neither
CHUNKS = {"fs": (64_000, 256_000), "gds": (16_000, 64_000)}
FILES_A_CHUNK = {"fs": 1, "gds": 2}
PER_FILE_BOUND = 90  # bytes: (1 GiB - a command's ~130 MiB start) / 10M files
NOISE_KIB = 2048
FACTS = ("--writer-release", "0.5.6", "--pythonhashseed", "0", "--target-tp", "2",
         "--no-target-save-only-first-rank", "--total-kv-heads", "8", "--head-dim", "4", "--layers", "1",
         "--latent-dim", "8")


def _tier(root: Path, backend: str, chunks: int) -> None:
    subprocess.run([sys.executable, "-m", "kvmigrate", "synth", str(root), "--family", "lmcache", "--lmc-backend",
                    backend, "--tp", "2", "--kv-kind", "mla", "--layers", "1", "--block-tokens", "1",
                    "--blocks", str(chunks), "--seed", "1", "-q"], check=True, capture_output=True)


@pytest.fixture(scope="module")
def tiers(tmp_path_factory) -> dict[tuple[str, int], Path]:
    work = tmp_path_factory.mktemp("tiers")
    out = {}
    for backend, sizes in CHUNKS.items():
        for chunks in sizes:
            out[backend, chunks] = work / f"{backend}-{chunks}"
            _tier(out[backend, chunks], backend, chunks)
    return out


@pytest.mark.parametrize("backend", sorted(CHUNKS))
def test_tier_scan_peak_rss_independent_of_size(tiers, tmp_path, backend):
    """The tier's chunk files are judged a partition of chunk hashes at a time from
    temporary files and its folder's names sorted in runs on disk (scan/tier_spill.py):
    ~9 B a fs file measured (GDS: none), ~2.5 KB a fs file and ~6.9 KB a GDS file when
    they were all held as records with their heads."""
    peaks = {}
    small_chunks, large_chunks = CHUNKS[backend]
    for chunks in (small_chunks, large_chunks):
        work = tmp_path / str(chunks)
        work.mkdir()
        peaks[chunks] = peak_rss(["scan", tiers[backend, chunks], "-o", work / "m.parquet", "--verify", "size",
                                  *FACTS], work)
    small, large = peaks[small_chunks], peaks[large_chunks]
    assert small.rc in (0, 1) and large.rc in (0, 1), large.out[-2000:]
    grown = FILES_A_CHUNK[backend] * (large_chunks - small_chunks)
    growth = (large.kib - small.kib) * 1024
    assert growth <= PER_FILE_BOUND * grown + NOISE_KIB * 1024, (
        f"{backend} tier scan: peak RSS {small.kib} KiB at {FILES_A_CHUNK[backend] * small_chunks:,} files, "
        f"{large.kib} KiB at {FILES_A_CHUNK[backend] * large_chunks:,} files: {growth / grown:.0f} bytes a file "
        f"(bound {PER_FILE_BOUND})")
