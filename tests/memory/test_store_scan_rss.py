"""A Mooncake store's scan keeps its peak RSS flat as the store grows (a memory bound, not a
timed assert).

One store (vLLM TP 2, `kvmigrate synth --family mooncake`) of each size and backend is
scanned in a child interpreter (tests/helpers/memory.py `peak_rss`); between the two sizes
the store grows by GROWN_OBJECTS objects (live index entries, one row each, or KVEntry
files). The bound is the one of
tests/memory/test_peak_rss.py: PER_OBJECT_BOUND bytes an object plus the allocator's
NOISE_KIB.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.memory import peak_rss

pytestmark = pytest.mark.slow

SMALL_BLOCKS, LARGE_BLOCKS = 16_000, 64_000  # 32k and 128k objects: the small one fills a scan batch
GROWN_OBJECTS = 2 * (LARGE_BLOCKS - SMALL_BLOCKS)  # one object per block and key rank (TP 2)
PER_OBJECT_BOUND = 90  # bytes: (1 GiB - a command's ~130 MiB start) / 10M objects
NOISE_KIB = 2048


def _store(root: Path, blocks: int, backend: str) -> None:
    subprocess.run([sys.executable, "-m", "kvmigrate", "synth", str(root), "--family", "mooncake", "--tp", "2",
                    "--mc-backend", backend,
                    "--layers", "1", "--block-tokens", "1", "--blocks", str(blocks), "--seed", "1", "-q"],
                   check=True, capture_output=True)


@pytest.mark.parametrize("backend", ["bucket", "file_per_key"])
def test_store_scan_peak_rss_independent_of_size(tmp_path, backend):
    """The store's objects are judged a partition at a time from temporary files
    (scan/store_spill.py): ~50 B an object measured, ~870 B when they were all held (as a
    file-per-key store's KVEntries were, in one partition)."""
    peaks = {}
    for blocks in (SMALL_BLOCKS, LARGE_BLOCKS):
        work = tmp_path / str(blocks)
        work.mkdir()
        _store(work / "root", blocks, backend)
        peaks[blocks] = peak_rss(["scan", work / "root", "-o", work / "m.parquet", "--verify", "size"], work)
    small, large = peaks[SMALL_BLOCKS], peaks[LARGE_BLOCKS]
    assert small.rc == large.rc == 0, large.out[-2000:]
    growth = (large.kib - small.kib) * 1024
    assert growth <= PER_OBJECT_BOUND * GROWN_OBJECTS + NOISE_KIB * 1024, (
        f"{backend} store scan: peak RSS {small.kib} KiB at {2 * SMALL_BLOCKS:,} objects, {large.kib} KiB at "
        f"{2 * LARGE_BLOCKS:,} objects: {growth / GROWN_OBJECTS:.0f} bytes an object (bound {PER_OBJECT_BOUND})")
