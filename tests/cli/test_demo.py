"""`kvmigrate demo`: the README's main-job command runs the whole flow and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvmigrate import manifest


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """One `kvmigrate demo DIR` run (DIR = tmp_path/d) the tests of its output share."""
    tmp_path = tmp_path_factory.mktemp("demo")
    proc = subprocess.run([sys.executable, "-m", "kvmigrate", "demo", str(tmp_path / "d")],
                          capture_output=True, text=True, timeout=300)
    return proc, tmp_path


def test_demo_runs_every_step_and_leaves_sources_untouched(demo):
    proc, tmp_path = demo
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for step in ("scan", "report", "migrate --manifest", "--apply", "verify", "rollback"):
        assert f"$ kvmigrate {step}" in out or step in out
    assert out.count("== step") == 8
    assert "Every source file is unchanged" in out
    html = (tmp_path / "d" / "report.html").read_text()
    assert "<svg" in html
    # rollback removed the target namespaces the apply created: only the sample's folders remain
    from kvmigrate.synth.demo import build_demo_root

    build_demo_root(tmp_path / "fresh")
    left = {n for n in os.listdir(tmp_path / "d" / "cache") if n != ".kvmigrate"}
    assert left == set(os.listdir(tmp_path / "fresh"))


def _lmcache_expected(root):
    """relpath -> status of every file of the sample's LMCache tiers, as synth records them:
    a whole chunk file (GDS sidecars too) `ok`, `index_lost` on a local_disk tier (no
    restarted engine re-indexes it), each injected defect's files their own status."""
    from kvmigrate.synth.demo import build_demo_root

    expected = {}
    for result in build_demo_root(root):
        for ns in result.namespaces:
            if ns["family"] != "lmcache":
                continue
            whole = "index_lost" if ns["backend"] == "local_disk" else "ok"
            for block in result.blocks:
                for rel in [*block["files"].values(), *block["sidecars"].values()]:
                    if rel is not None:
                        expected[rel] = whole
            for defect in result.defects:
                expected.update(defect["statuses"])
    return expected


def test_demo_manifest_holds_its_lmcache_tiers_with_their_statuses(demo):
    # the sample's LMCache tiers (an fs tier of an MLA model at TP 2, a local_disk tier, a GDS
    # tier) are scanned like its namespaces, each file with the status its writer's bytes prove
    proc, tmp_path = demo
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = _lmcache_expected(tmp_path / "fresh-lmcache")
    rows = manifest.read_table(str(tmp_path / "d" / "manifest.parquet"),
                               columns=["relpath", "family", "status", "finding", "asks"]).to_pylist()
    tier_rows = {r["relpath"]: r for r in rows if r["family"] == "lmcache"}
    assert {rel: r["status"] for rel, r in tier_rows.items()} == expected
    assert {"ok", "index_lost", "short", "orphan_data"} <= set(expected.values())
    # the demo's FACTS.json states the writers' hash recipe: no row waits on a fact
    assert not [rel for rel, r in tier_rows.items() if r["finding"] == "needs_fact" or r["asks"]]


def test_demo_names_its_lmcache_tiers_in_its_summary(demo):
    proc, _ = demo
    assert proc.returncode == 0, proc.stdout + proc.stderr
    head = proc.stdout.split("== step 1")[0]
    assert "3 LMCache tiers: lmcache-fs (fs), lmcache-disk (local_disk), lmcache-gds (gds)" in head, head


def test_demo_passes_its_logging_flags_to_every_step(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvmigrate", "demo", str(tmp_path / "d"), "-v"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "$ kvmigrate scan -v " in proc.stdout and "$ kvmigrate rollback -v " in proc.stdout
    for step in ("scan", "report", "migrate", "verify", "rollback"):  # each step's own start line
        assert f"{step}: start" in proc.stderr, step


def _tree(root):
    """Relative path -> (inode, size, mtime_ns) of every file and folder under root."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            snap[os.path.relpath(p, root)] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return snap


def test_demo_refuses_a_nonempty_folder(tmp_path):
    # an operator's existing cache root given as DIR (defect 9: the demo wrote its cache/,
    # journal/, FACTS.json, manifest and report.html into it)
    from kvmigrate.synth.demo import build_demo_root

    live = tmp_path / "live-cache"
    build_demo_root(live, with_defects=False)
    before = _tree(live)
    proc = subprocess.run([sys.executable, "-m", "kvmigrate", "demo", str(live)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert str(live) in proc.stderr
    assert "not empty" in proc.stderr and "pass an empty or new folder" in proc.stderr
    assert _tree(live) == before


def _run_demo_in(tmp_path, *args):
    """`kvmigrate demo ARGS` with its temp dirs made under tmp_path/tmp; returns (proc, leftovers)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    proc = subprocess.run([sys.executable, "-m", "kvmigrate", "demo", *args],
                          capture_output=True, text=True, timeout=300, env=env)
    return proc, sorted(tmp.iterdir())


def test_demo_without_dir_names_its_sample_and_removes_it(tmp_path):
    proc, left = _run_demo_in(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert left == []
    sample = proc.stdout.splitlines()[0].split(" in ", 1)[1].split(" ")[0]
    assert sample.startswith(str(tmp_path / "tmp" / "kvmigrate-demo-"))
    assert f"Removed the sample {sample}" in proc.stdout


def test_demo_keep_leaves_the_sample_where_it_says(tmp_path):
    proc, left = _run_demo_in(tmp_path, "--keep")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(left) == 1 and left[0].name.startswith("kvmigrate-demo-")
    assert f"The sample stays in {left[0]}" in proc.stdout
    assert {p.name for p in left[0].iterdir()} >= {"cache", "journal", "FACTS.json", "manifest.parquet",
                                                    "report.html"}


def test_demo_refusal_counts_one_entry_in_the_singular(tmp_path):
    # it said "the folder is not empty (1 entries: notes.txt)"
    from helpers.cli_helpers import run

    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "notes.txt").write_text("x")
    code, out = run("demo", folder)
    assert code == 2
    assert "the folder is not empty (1 entry: notes.txt)" in out, out


def _mooncake_expected(root):
    """(relpath, object_index) -> (status, action) of the rows synth records for the sample's
    Mooncake stores: every object of a main block `ok`, pending `rekey` where its key is raw
    (written by Mooncake ≤ 0.3.11, read by 0.3.14), `already_present` where scoped; each
    injected defect's files and objects their own status (action None: not checked)."""
    from kvmigrate.synth.demo import build_demo_root

    expected = {}
    for result in build_demo_root(root):
        for ns in result.namespaces:
            if ns["family"] != "mooncake":
                continue
            action = "rekey" if ns["scheme"] == "mc-raw" else "already_present"
            for block in (b for b in result.blocks if b["defect"] is None):
                for obj in block["objects"]:
                    expected[(obj["relpath"], obj["object_index"])] = ("ok", action)
            for defect in result.defects:
                for rel, status in defect["statuses"].items():
                    expected[(rel, None)] = (status, None)
                for obj in defect["objects"]:
                    expected[(obj["relpath"], obj["object_index"])] = (obj["status"], None)
    return expected


def _mooncake_rows(tmp_path):
    rows = manifest.read_table(str(tmp_path / "d" / "manifest.parquet"),
                               columns=["relpath", "object_index", "family", "status", "action", "reason",
                                        "object_key"]).to_pylist()
    return [r for r in rows if r["family"] == "mooncake"]


def test_demo_manifest_holds_its_mooncake_stores_with_their_statuses(demo):
    # a vLLM bucket store of raw keys (pending rekey under 0.3.14) with a .bucket the next
    # client start deletes and a cut record; an SGLang file-per-key store with a file at a
    # KVEntry's path that stops the client from starting
    proc, tmp_path = demo
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = _mooncake_expected(tmp_path / "fresh-mooncake")
    got = {(r["relpath"], r["object_index"]): (r["status"], r["action"]) for r in _mooncake_rows(tmp_path)}
    assert {k: (got.get(k, ("missing", None))[0], a and got.get(k, (None, None))[1]) for k, (_, a) in expected.items()} \
        == expected
    statuses = {s for s, _ in expected.values()}
    assert {"ok", "orphan_data", "short", "header_invalid"} <= statuses
    assert "rekey" in {a for _, a in expected.values()}


def test_demo_says_what_the_scan_found_in_its_mooncake_stores(demo):
    # the narration is counted from the manifest: each store's objects, its pending rekeys,
    # what the next client start deletes, the cut record, the KVEntry that stops the start
    proc, tmp_path = demo
    assert proc.returncode == 0, proc.stdout + proc.stderr
    head = proc.stdout.split("== step 1")[0]
    assert ("2 Mooncake stores: mooncake-vllm (bucket, vLLM TP 2, raw keys), "
            "mooncake-sglang (file_per_key, SGLang TP 2, scoped keys)") in head, head
    said = proc.stdout.split("What the scan found in the Mooncake stores")[1].split("== step 2")[0]
    rows = _mooncake_rows(tmp_path)
    for store in ("mooncake-vllm", "mooncake-sglang"):
        objects = [r for r in rows if r["relpath"].startswith(store + "/") and r["object_key"] is not None]
        assert f"  {store}: {len(objects)} objects (" in said, said
    rekeys = [r for r in rows if r["action"] == "rekey"]
    assert rekeys and f"rekey: {len(rekeys)} objects - {rekeys[0]['reason']}" in said, said
    for status, what, says in (("orphan_data", "file", "the next client start deletes it"),
                               ("short", "object", "every read fails"),
                               ("header_invalid", "file", "the client does not start")):
        hits = [r for r in rows if r["status"] == status]
        assert len(hits) == 1 and f"{status}: 1 {what} - {hits[0]['reason']}" in said, (status, said)
        assert says in hits[0]["reason"]


def test_demo_note_names_exactly_the_work_its_apply_leaves_aside(demo):
    # the demo expects an apply to exit 1 only for work the scan planned that this kvmigrate
    # does not apply yet, and says so before the apply: its note and the apply's own
    # "not applied" lines name the same objects (none of either once migrate applies them)
    proc, _ = demo
    assert proc.returncode == 0, proc.stdout + proc.stderr
    before, step5 = proc.stdout.split("== step 5")[0].split("== step 4")[1], proc.stdout.split("== step 5")[1]
    step5 = step5.split("== step 6")[0]
    noted = {line.split("Note: ", 1)[1].split(" (found by the scan)")[0] for line in before.splitlines()
             if line.startswith("Note: ")}
    left = {line.split("kvmigrate: ", 1)[1].split(" not applied")[0] for line in proc.stderr.splitlines()
            if " not applied: this kvmigrate does not migrate them yet" in line}
    assert noted == left
    code = int(step5.rsplit("(exit code ", 1)[1].split(")")[0])
    assert bool(code & 1) == bool(noted), (code, noted)
