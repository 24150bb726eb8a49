"""The driver of `--run-on ray` keeps its peak RSS flat as the cache grows (a memory
bound, not a timed assert): it plans, locks and summarizes, while the parts walk and
place the files in their own tasks.

One llm-d TP=2 MLA tree of each size is scanned and migrated as 2 Ray tasks on a local
cluster the command starts itself; the driver's own peak (VmHWM, not the cluster's
processes) is compared between the sizes with the bound of tests/memory/test_peak_rss.py.
"""

from __future__ import annotations

import pytest

from helpers.memory import FACTS, assert_flat, peak_rss, synth_llmd

pytestmark = pytest.mark.slow

SMALL_BLOCKS, LARGE_BLOCKS = 16_000, 128_000
PER_FILE_BOUND = 90  # bytes: (1 GiB - a command's start) / 10M files
NOISE_KIB = 2048
STEPS = ("scan", "migrate_apply")


@pytest.fixture(scope="module")
def peaks(ray, tmp_path_factory) -> dict[int, dict]:
    base = tmp_path_factory.mktemp("ray-driver")
    out = {}
    for blocks in (SMALL_BLOCKS, LARGE_BLOCKS):
        work = base / str(blocks)
        work.mkdir()
        root = work / "root"
        synth_llmd(root, blocks)
        on_ray = ["--run-on", "ray", "--shards", "2"]
        out[blocks] = {
            "scan": peak_rss(["scan", root, "-o", work / "dataset", "--verify", "size", *FACTS, *on_ray], work, own=True),
            "migrate_apply": peak_rss(["migrate", "--manifest", work / "dataset", "--apply", *on_ray], work, own=True),
        }
    return out


@pytest.mark.parametrize("step", STEPS)
def test_ray_driver_peak_rss_independent_of_size(peaks, step):
    assert_flat(f"{step} on Ray (the driver)", peaks[SMALL_BLOCKS][step], peaks[LARGE_BLOCKS][step],
                2 * SMALL_BLOCKS, 2 * LARGE_BLOCKS, per_file=PER_FILE_BOUND, noise_kib=NOISE_KIB)
