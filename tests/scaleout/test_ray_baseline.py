"""`--baseline` with `--run-on ray`: the driver checks and reads the baseline once and
sends each part the rows of its own buckets; the dataset directory then holds exactly the
rows of one `--baseline` scan in this process (carried, silent_change and the baseline
metadata included), and the parts open no block file of an unchanged tree."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from test_ray_scaleout import MLA, SCAN_TREE, rows, run

from kvmigrate import manifest

pytestmark = pytest.mark.slow

SMALL_TREE = (dict(family="llmd", tp=2, kv_kind="mla", blocks=12),)


def hash_scan(root, out, *extra) -> int:
    code, _, err = run("scan", root, *MLA, "--verify", "hash", "-q", "-o", out, *extra)
    assert code != 2, err
    return code


def block_rows(path) -> dict[str, dict]:
    return {r["relpath"]: r for r in rows(path) if r["relpath"].endswith(".bin")}


@pytest.mark.parametrize("recheck", ["0", "1/3"])
def test_ray_with_a_baseline_writes_the_rows_of_one_baseline_scan(ray_cluster, synth_root, tmp_path, recheck):
    root, _ = synth_root(*SCAN_TREE)
    full = tmp_path / "full.parquet"
    hash_scan(root, full)
    one, parts = tmp_path / "one.parquet", tmp_path / "parts"
    code_one = hash_scan(root, one, "--baseline", full, "--recheck", recheck)
    code = hash_scan(root, parts, "--baseline", full, "--recheck", recheck, "--run-on", "ray", "--shards", 3)
    assert code == code_one
    assert rows(parts) == rows(one)
    read = [k for k, r in block_rows(parts).items() if not r["carried"] and r["status"] != "header_invalid"]
    assert len(block_rows(parts)) - len(read) > 50  # carried over
    assert bool(read) == (recheck == "1/3")  # the rechecked buckets only
    assert manifest.read_metadata(parts)["baseline"] == manifest.read_metadata(one)["baseline"]
    assert manifest.read_metadata(parts)["baseline"]["rows"] == manifest.read_metadata(one)["baseline"]["rows"]


def test_ray_with_a_baseline_finds_a_silent_change_as_one_process_does(ray_cluster, synth_root, tmp_path):
    from tests.scan.test_baseline import _with_hash_edited

    root, _ = synth_root(*SCAN_TREE)
    full, edited = tmp_path / "full.parquet", tmp_path / "edited.parquet"
    hash_scan(root, full)
    victim = sorted(k for k, r in block_rows(full).items() if r["status"] == "ok")[7]
    _with_hash_edited(full, edited, victim)
    one, parts = tmp_path / "one.parquet", tmp_path / "parts"
    code_one = hash_scan(root, one, "--baseline", edited, "--recheck", "1")
    code = hash_scan(root, parts, "--baseline", edited, "--recheck", "1", "--run-on", "ray", "--shards", 2)
    assert code == code_one and code & 4
    assert rows(parts) == rows(one)
    assert [k for k, r in block_rows(parts).items() if r["status"] == "silent_change"] == [victim]


def test_ray_refuses_a_baseline_of_another_root_before_any_part_starts(ray_cluster, synth_root, tmp_path):
    root, _ = synth_root(*SMALL_TREE)
    other, _ = synth_root(*SMALL_TREE, root_name="other")
    theirs = tmp_path / "other.parquet"
    hash_scan(other, theirs)
    code, _, err = run("audit", root, *MLA, "--verify", "hash", "--baseline", theirs, "--run-on", "ray",
                       "--shards", 2, "--manifest-out", tmp_path / "parts")
    assert code == 2 and "baseline refused" in err and str(other) in err
    assert not (tmp_path / "parts").exists()


def opened_blocks(root, out, *extra) -> int:
    """Block files opened by the command and every process it starts (the local Ray
    cluster and its workers), counted by strace -f."""
    log = tmp = f"{out}.strace"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(["strace", "-f", "-qq", "-e", "trace=open,openat,openat2", "-o", tmp, sys.executable,
                           "-m", "kvmigrate", "scan", str(root), *MLA, "--verify", "hash", "-q", "-o", str(out),
                           "--run-on", "ray", "--shards", "2", *extra], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode in (0, 1, 5), proc.stderr
    with open(log) as f:
        return sum(1 for line in f if re.search(r'\.bin", ', line) and "= -1" not in line)


def test_ray_parts_open_no_block_file_of_an_unchanged_tree_and_read_a_changed_one(synth_root, tmp_path):
    root, _ = synth_root(*SMALL_TREE)
    full = tmp_path / "full.parquet"
    hash_scan(root, full)
    unchanged = tmp_path / "unchanged"
    assert opened_blocks(root, unchanged, "--baseline", str(full), "--recheck", "0") == 0
    assert all(r["carried"] for r in block_rows(unchanged).values()) and block_rows(unchanged)
    victim = sorted(block_rows(full))[3]
    path = root / victim
    st = path.stat()
    path.write_bytes(b"\x5a" * st.st_size)  # other bytes, same size and mtime: only the ctime moved
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    changed = tmp_path / "changed"
    assert opened_blocks(root, changed, "--baseline", str(full), "--recheck", "0") == 1  # strace sees the parts
    after = block_rows(changed)
    assert not after[victim]["carried"] and after[victim]["status"] == "replica_mismatch"
    assert all(r["carried"] for k, r in after.items() if k != victim)


def test_ray_with_a_baseline_carries_the_files_of_a_foreign_folder_as_one_process_does(ray_cluster, synth_root,
                                                                                        tmp_path):
    """A folder that is not a cache namespace is walked by part 0 whatever the bucket-like
    names inside it: its rows reach part 0 (every part), so they are carried there too."""
    root, _ = synth_root(*SMALL_TREE)
    for bucket in ("abd", "abe"):  # parts 1 and 2 of 3 by their names
        (root / "backup" / bucket / "x").mkdir(parents=True)
        (root / "backup" / bucket / "x" / "old.bin").write_bytes(b"kept by hand")
    full = tmp_path / "full.parquet"
    hash_scan(root, full)
    one, parts = tmp_path / "one.parquet", tmp_path / "parts"
    hash_scan(root, one, "--baseline", full, "--recheck", "0")
    hash_scan(root, parts, "--baseline", full, "--recheck", "0", "--run-on", "ray", "--shards", 3)
    assert rows(parts) == rows(one)
    foreign = [r for r in rows(parts) if r["relpath"].startswith("backup/")]
    assert len(foreign) == 2 and all(r["carried"] and r["status"] == "foreign" for r in foreign)


@pytest.mark.parametrize("recheck", ["0", "1/3"])
def test_ray_with_a_baseline_carries_the_pages_of_a_flat_directory_as_one_process_does(ray_cluster, synth_root,
                                                                                        tmp_path, recheck):
    """An SGLang directory's pages are written by part 0, whose share of the baseline holds
    every flat row (scan.baseline.load_parts): carried, or re-read by bucket, as in one process."""
    root, _ = synth_root(dict(family="sglang", sgl_era="e2", tp=2, blocks=40, layers=2))
    sgl = ["--kv-kind", "full", "--model-name", "org/m", "--target-layout", "layer_first", "--verify", "hash", "-q"]
    full, one, parts = tmp_path / "full.parquet", tmp_path / "one.parquet", tmp_path / "parts"
    run("scan", root, *sgl, "-o", full)
    code_one, _, _ = run("scan", root, *sgl, "-o", one, "--baseline", full, "--recheck", recheck)
    code, _, err = run("scan", root, *sgl, "-o", parts, "--baseline", full, "--recheck", recheck,
                       "--run-on", "ray", "--shards", 3)
    assert code == code_one != 2, err
    assert rows(parts) == rows(one)
    read = [r["relpath"] for r in block_rows(parts).values() if not r["carried"]]
    assert len(block_rows(parts)) - len(read) > 40  # carried over
    assert bool(read) == (recheck == "1/3") and {int(k[:3], 16) % 3 for k in read} <= {0}
