"""An SGLang HiCache file directory's scan keeps its peak RSS flat as the directory grows
(a memory bound, not a timed assert).

One directory (MLA TP 2 of the e2 era, `kvmigrate synth --family sglang`: two files a page,
the page's copy of each rank, linked
to the name 0.5.23 reads) of each size is scanned in a child interpreter
(tests/helpers/memory.py `peak_rss`), with --verify size and with --verify hash. The bound
is the one of tests/memory/test_store_scan_rss.py: PER_FILE_BOUND bytes a page file plus
the allocator's NOISE_KIB.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.memory import peak_rss

pytestmark = pytest.mark.slow

# page hashes, two files each (TP 2): the small one already writes four batches of rows, so
# the allocator's first batches (~35 MiB over the first 100k files) count in neither
SMALL_PAGES, LARGE_PAGES = 64_000, 192_000
GROWN_FILES = 2 * (LARGE_PAGES - SMALL_PAGES)
PER_FILE_BOUND = 90  # bytes: (1 GiB - a command's ~130 MiB start) / 10M files
NOISE_KIB = 2048


def _directory(root: Path, pages: int) -> None:
    subprocess.run([sys.executable, "-m", "kvmigrate", "synth", str(root), "--family", "sglang", "--sgl-era", "e2",
                    "--tp", "2",
                    "--kv-kind", "mla", "--layers", "1", "--block-tokens", "1", "--blocks", str(pages),
                    "--seed", "1", "-q"], check=True, capture_output=True)


@pytest.fixture(scope="module")
def directories(tmp_path_factory) -> dict[int, Path]:
    work = tmp_path_factory.mktemp("flat")
    for pages in (SMALL_PAGES, LARGE_PAGES):
        _directory(work / str(pages), pages)
    return {pages: work / str(pages) for pages in (SMALL_PAGES, LARGE_PAGES)}


@pytest.mark.parametrize("verify", ["size", "hash"])
def test_flat_scan_peak_rss_independent_of_size(directories, tmp_path, verify):
    """The page names are sorted in runs on disk and the pages' stat, hash and head go to a
    temporary file that each deployment's verdicts read a page hash at a time
    (scan/flat_spill.py): ~1.4-1.7 KB a page file when every page was a Python record."""
    peaks = {}
    for pages in (SMALL_PAGES, LARGE_PAGES):
        work = tmp_path / str(pages)
        work.mkdir()
        peaks[pages] = peak_rss(["scan", directories[pages], "-o", work / "m.parquet", "--verify", verify,
                                 "--kv-kind", "mla", "--model-name", "m", "--writer-layout", "page_first"], work)
    small, large = peaks[SMALL_PAGES], peaks[LARGE_PAGES]
    assert small.rc in (0, 1) and large.rc in (0, 1), large.out[-2000:]
    growth = (large.kib - small.kib) * 1024
    assert growth <= PER_FILE_BOUND * GROWN_FILES + NOISE_KIB * 1024, (
        f"flat scan --verify {verify}: peak RSS {small.kib} KiB at {2 * SMALL_PAGES:,} files, {large.kib} KiB at "
        f"{2 * LARGE_PAGES:,} files: {growth / GROWN_FILES:.0f} bytes a file (bound {PER_FILE_BOUND})")
