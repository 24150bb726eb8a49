"""scripts/bench.py --only lmcache at a tiny scale: one Llama-sized chunk resharded TP 2 -> 4
beside cat + cp of the same files, a synth fs tier scanned beside find; and the driver's
check, which must catch target files that are not the heads they name."""

import json
import subprocess
import sys
from pathlib import Path

import kvbench as bench  # scripts/kvbench (pyproject.toml puts scripts/ on pytest's pythonpath)

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
KVM = str(Path(sys.executable).with_name("kvmigrate"))
CHUNK_FILE = 28 + 2 * 32 * 256 * 4 * 128 * 2  # a TP 2 rank's file: header + 16 MiB
TARGET_FILE = 28 + 2 * 32 * 256 * 2 * 128 * 2  # a TP 4 rank's file: header + 8 MiB


def driver(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / "bench_lmcache.py"), *args], capture_output=True, text=True)


def test_the_lmcache_group_times_reshard_and_scan_beside_the_standard_tools(tmp_path):
    work, out = tmp_path / "work", tmp_path / "reports"
    rc = bench.main(["--only", "lmcache", "--lmcache-chunks", "1", "--lmcache-scan-chunks", "300", "--lmcache-reps",
                     "1", "--lmcache-warm-only", "--workdir", str(work), "--out-dir", str(out), "--kvmigrate", KVM])
    assert rc == 0
    res = json.loads((out / "lmcache.json").read_text())["lmcache"]
    tree = res["reshard_tree"]
    assert (tree["files"], tree["file_bytes"]) == (2, CHUNK_FILE)
    assert tree["kvmigrate_scan_of_it"]["by_status"] == {"ok": {"files": 2, "bytes": 2 * CHUNK_FILE}}
    (warm,) = res["reshard"]
    cmds = {c["key"]: c for c in warm["commands"]}
    assert {"lmc_reshard", "lmc_cat_cp", "lmc_cp"} <= set(cmds)
    drv = cmds["lmc_reshard"]["facts"]
    assert drv["written_bytes"] == 4 * TARGET_FILE and drv["source_bytes"] == 2 * CHUNK_FILE
    assert drv["bytes_checked"]["checked_target_files"] == 4
    assert cmds["lmc_cat_cp"]["facts"] == {"files_written": 2, "written_bytes": 2 * CHUNK_FILE}
    assert {(r["a"], r["b"]) for r in warm["ratios"]} >= {("lmc_reshard", "lmc_cat_cp"), ("lmc_reshard", "lmc_cp")}
    # this kvmigrate's migrate plans an LMCache reshard: the CLI is timed too, its output checked the same way
    assert res["cli_probe"]["plans_reshard"]
    for key in ("lmc_migrate", "lmc_migrate_size"):
        assert cmds[key]["facts"]["outcomes"]["created"] == 4, cmds[key]
        assert cmds[key]["facts"]["bytes_checked"]["checked_target_files"] == 4
    assert ("lmc_migrate", "lmc_cat_cp") in {(r["a"], r["b"]) for r in warm["ratios"]}
    (scan,) = res["scan"]
    s = {c["key"]: c for c in scan["commands"]}
    assert s["lmc_scan"]["facts"]["files"] == res["scan_tree"]["files"] == 300
    assert s["lmc_scan"]["facts"]["by_status"] == {"ok": 300}
    assert "median_s" in s["lmc_find"] and "median_s" in s["lmc_cat"]
    assert s["lmc_floor"]["facts"]["files"] == 300  # the floor walks the tier's one flat folder too
    text = (out / "LMCACHE.md").read_text()
    assert "## Reshard: TP 2 → 4" in text and "## Scan of a large fs tier" in text
    assert "/ cat SRC > /dev/null, then cp -R SRC DST = **" in text and "/ find -printf = **" in text
    assert "Warm only" in text
    assert not work.exists()  # the trees are deleted after the group
    (out / "LMCACHE.md").unlink()  # --render-only writes the same page from lmcache.json
    assert bench.main(["--only", "lmcache", "--render-only", "--out-dir", str(out)]) == 0
    assert (out / "LMCACHE.md").read_text() == text


def test_the_driver_s_check_catches_a_target_that_is_not_its_heads(tmp_path):
    src, dst = tmp_path / "src" / "cache", tmp_path / "dst" / "cache"
    assert driver("build", str(src), "--chunks", "1").returncode == 0
    assert driver("reshard", str(src), str(dst), "--tp-dst", "4").returncode == 0
    assert driver("check", str(src), str(dst), "--chunks", "1").returncode == 0
    # rank 1's file made of the first 8 MiB of source rank 0's payload: a concatenation, not heads 2-3
    target = next(p for p in dst.iterdir() if "@4@1@" in p.name)
    source = next(p for p in src.iterdir() if "@2@0@" in p.name)
    with open(target, "r+b") as f, open(source, "rb") as s:
        f.seek(28)
        s.seek(28)
        f.write(s.read(TARGET_FILE - 28))
    bad = driver("check", str(src), str(dst), "--chunks", "1")
    assert bad.returncode != 0 and "not the heads [2, 3]" in bad.stderr
