"""scripts/bench.py --only mooncake at a tiny scale: a store of the driver's scanned beside
find -printf, its rekey beside cp of the .meta files, MOONCAKE.md rendered; and the driver's
check, which must catch a store that is not what it says."""

import json
import subprocess
import sys
from pathlib import Path

import kvbench as bench  # scripts/kvbench (pyproject.toml puts scripts/ on pytest's pythonpath)

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
KVM = str(Path(sys.executable).with_name("kvmigrate"))


def driver(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / "bench_mooncake.py"), *args], capture_output=True, text=True)


def test_the_mooncake_group_times_scan_and_rekey_beside_the_standard_tools(tmp_path):
    work, out = tmp_path / "work", tmp_path / "reports"
    rc = bench.main(["--only", "mooncake", "--mooncake-objects", "1200", "--mooncake-reps", "1",
                     "--mooncake-warm-only", "--workdir", str(work), "--out-dir", str(out), "--kvmigrate", KVM])
    assert rc == 0
    res = json.loads((out / "mooncake.json").read_text())["mooncake"]
    store = res["store"]
    assert (store["objects"], store["pairs"], store["files"]) == (1200, 3, 6)  # 500 objects a pair
    assert store["checked"] == {"pairs": 3, "objects": 1200}
    (scan,) = res["scan"]
    s = {c["key"]: c for c in scan["commands"]}
    facts = s["mc_scan"]["facts"]
    assert (facts["files"], facts["by_status"], facts["objects"]) == (6, {"ok": 6}, 1200)
    assert facts["objects_by_action"] == {"rekey": 1200}  # raw keys, read by 0.3.14
    assert "median_s" in s["mc_find"] and "peak_rss_mib" in s["mc_scan"]
    assert ("mc_scan", "mc_find") in {(r["a"], r["b"]) for r in scan["ratios"]}
    # this kvmigrate's migrate applies rekey: the rekey is timed, its store read back scoped
    assert res["rekey_probe"]["applies_rekey"]
    (rekey,) = res["rekey"]
    r = {c["key"]: c for c in rekey["commands"]}
    assert r["mc_rekey"]["facts"]["outcomes"]["created"] == 1200
    assert r["mc_rekey"]["facts"]["keys_checked"] == {"pairs": 3, "objects": 1200, "scheme": "mc-scoped"}
    assert r["mc_cp_meta"]["facts"]["files_written"] == 3
    text = (out / "MOONCAKE.md").read_text()
    assert "## Scan" in text and "## Rekey" in text and "Warm only" in text
    assert "/ find -printf = **" in text and "/ cp of the .meta files to another folder = **" in text
    assert not work.exists()  # the trees are deleted after the group
    (out / "MOONCAKE.md").unlink()  # --render-only writes the same page from mooncake.json
    assert bench.main(["--only", "mooncake", "--render-only", "--out-dir", str(out)]) == 0
    assert (out / "MOONCAKE.md").read_text() == text


def test_the_driver_s_check_catches_a_record_that_is_not_where_its_index_says(tmp_path):
    store = tmp_path / "root" / "store"
    assert driver("build", str(store), "--objects", "600").returncode == 0
    assert driver("check", str(store), "--objects", "600").returncode == 0
    # raw keys: a rekey's read-back (every key scoped) must refuse them
    assert "is not mc-scoped" in driver("check", str(store), "--objects", "600", "--scheme", "mc-scoped").stderr
    bucket = sorted(store.glob("*.bucket"))[0]
    data = bytearray(bucket.read_bytes())
    data[0] ^= 0xFF  # the first record's inline key
    bucket.write_bytes(bytes(data))
    bad = driver("check", str(store), "--objects", "600")
    assert bad.returncode != 0 and "is not where its index puts it" in bad.stderr
