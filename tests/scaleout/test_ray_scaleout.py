"""`--run-on ray --shards N` on a local Ray cluster (2 CPUs, started once for this module).

scan and migrate --apply of synth trees as N in {1, 3, 8} Ray tasks end exactly like a
single-process run: the same manifest rows (every column), the same migrated tree (the
same target files, hard-linked to the same sources), and a journal directory that
verify and rollback take. A part that fails is reported with its number (exit 8) and a
rerun of the same command completes it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner
from test_ray_dataset_dir import comparable, tree_state

from kvmigrate import manifest
from kvmigrate.cli import cli
from kvmigrate.migrate.journal import read_records
from kvmigrate.scaleout import dataset
from kvmigrate.scaleout.ray_runner import FAIL_ENV

pytestmark = pytest.mark.slow  # reliability-sized: `pytest -m 'not slow'` leaves it out, CI runs it

MLA = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]
# every family and most defects (size votes, missing ranks, temp files, deep layouts)
SCAN_TREE = (dict(family="llmd", tp=2, kv_kind="mla", blocks=24, defects=("missing_rank", "tmp_vllm", "size_mismatch")),
             dict(family="vllm", scheme="S3", tp=2, kv_kind="mla", replicated_layout=True, model_name="deepseek/V2",
                  blocks=24, defects=("deep_layout", "misfiled")),
             dict(family="vllmcpp", tp=2, kv_kind="mla", blocks=24, defects=("header_key", "foreign"),
                  model_name="Qwen/Qwen3-4B"))
# links (S2 re-key), padded copies (llm-d), rewritten headers (vllm.cpp), and two caches
# of one model (TP=2, TP=4) merging into one target, one key holding other bytes
MIGRATE_TREE = (dict(family="llmd", tp=2, kv_kind="mla", blocks=24),
                dict(family="llmd", tp=4, kv_kind="mla", blocks=24),
                dict(family="vllm", scheme="S2", tp=1, kv_kind="mla", model_name="deepseek/V2", blocks=24),
                dict(family="vllmcpp", tp=2, kv_kind="mla", blocks=24, model_name="Qwen/Qwen3-4B"))


def run(*args) -> tuple[int, str, str]:
    res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def rows(path) -> list[dict]:
    return manifest.read_table(path).sort_by("relpath").to_pylist()


@pytest.fixture
def migrate_tree(synth_root):
    root, (tp2, tp4, _, _) = synth_root(*MIGRATE_TREE)
    odd = tp4.blocks[0]  # a key both caches hold: the TP=4 copy holds other bytes -> conflict
    size = os.path.getsize(root / odd["files"][0])
    for rel in odd["files"].values():
        (root / rel).write_bytes(bytes(range(256)) * (size // 256))
    return root


@pytest.mark.parametrize("n", [1, 3, 8])
def test_scan_on_ray_has_exactly_the_rows_of_one_scan(ray_cluster, synth_root, tmp_path, n):
    root, _ = synth_root(*SCAN_TREE)
    one = tmp_path / "one.parquet"
    code_one, text_one, _ = run("scan", root, *MLA, "-o", one, "--json")
    out = tmp_path / "parts"
    code, text, err = run("scan", root, *MLA, "--run-on", "ray", "--shards", n, "-o", out, "--json")
    assert code == code_one, err
    assert sorted(os.listdir(out)) == [dataset.part_name(k, n) for k in range(n)]  # nothing staged is left
    assert rows(out) == rows(one)
    assert comparable(json.loads(text), out) == comparable(json.loads(text_one), one)


def test_audit_on_ray_keeps_the_dataset_directory_and_exits_like_one_audit(ray_cluster, synth_root, tmp_path):
    root, _ = synth_root(*SCAN_TREE)
    code_one, text_one, _ = run("audit", root, *MLA, "--json")
    out = tmp_path / "parts"
    code, text, err = run("audit", root, *MLA, "--run-on", "ray", "--shards", 3, "--manifest-out", out, "--json")
    assert code == code_one and code & 4, err
    assert json.loads(text)["totals"] == json.loads(text_one)["totals"]
    assert rows(out) == rows(manifest_of_scan(root, tmp_path))


def manifest_of_scan(root, tmp_path):
    one = tmp_path / "scan-one.parquet"
    run("scan", root, *MLA, "-o", one)
    return one


@pytest.mark.parametrize("n", [1, 3, 8])
def test_migrate_on_ray_ends_like_one_migration(ray_cluster, migrate_tree, tmp_path, n):
    root = migrate_tree
    other = tmp_path / "single"
    shutil.copytree(root, other, symlinks=True)
    before = tree_state(root)
    code_one, text_one, _ = run("migrate", other, *MLA, "--apply", "--json")
    journals = tmp_path / "journals"
    code, text, err = run("migrate", root, *MLA, "--apply", "--run-on", "ray", "--shards", n,
                          "--journal", journals, "--json")
    single, parts = json.loads(text_one), json.loads(text)
    assert code == code_one == 4, err  # 4: the TP=4 key with other bytes competes with TP=2: a conflict, never overwritten
    assert parts["outcomes"] == single["outcomes"]
    assert parts["outcomes"]["created"] > 50 and parts["outcomes"]["conflict"] == 2  # neither content placed
    assert sorted(f.replace(str(root), "ROOT") for f in parts["apply"].pop("findings")) == \
        sorted(f.replace(str(other), "ROOT") for f in single["apply"].pop("findings"))
    for result in (parts["apply"], single["apply"]):
        result.pop("journal")
    assert parts["apply"] == single["apply"]  # per target outcomes, links, copies, bytes written
    assert tree_state(root) == tree_state(other)  # same files, bytes and hard links
    assert sorted(os.listdir(journals)) == [dataset.DRIVER_JOURNAL] + [dataset.journal_name(k, n) for k in range(n)]
    assert run("verify", root, "--journal", journals)[0] == 0
    code, _, err = run("rollback", journals)
    assert code == 0, err
    assert tree_state(root) == before


def test_a_single_manifest_file_is_split_by_bucket_into_parts(ray_cluster, migrate_tree, tmp_path):
    root = migrate_tree
    other = tmp_path / "single"
    shutil.copytree(root, other, symlinks=True)
    one = tmp_path / "one.parquet"
    run("scan", root, *MLA, "--verify", "hash", "-o", one)  # as `migrate ROOT` scans (competing sources compared)
    code, text, err = run("migrate", "--manifest", one, "--apply", "--run-on", "ray", "--shards", 3, "--json")
    code_one, text_one, _ = run("migrate", other, *MLA, "--apply", "--json")
    assert code == code_one, err
    assert json.loads(text)["outcomes"] == json.loads(text_one)["outcomes"]
    assert tree_state(root) == tree_state(other)


def test_folders_config_and_locks_are_the_drivers_alone(ray_cluster, migrate_tree, tmp_path):
    """Parts never race on shared paths: the driver journals every base and rank folder,
    config.json and lock; a part journals only what lies in its own <hhh> buckets."""
    journals = tmp_path / "journals"
    code, _, err = run("migrate", migrate_tree, *MLA, "--apply", "--run-on", "ray", "--shards", 3,
                       "--journal", journals)
    assert code == 4, err

    def created(name):
        kinds: dict[str, list[str]] = {"dir": [], "config": [], "lock": [], "block": []}
        for rec in read_records(journals / name):
            if rec["t"] == "lock":
                kinds["lock"].append(rec["path"])
            elif rec["t"] == "done" and rec.get("kind") == "dirs":
                kinds["dir"] += rec["paths"]
            elif rec["t"] == "done":
                kinds[rec["kind"]].append(rec["path"])
        return kinds

    driver = created(dataset.DRIVER_JOURNAL)
    assert driver["block"] == [] and len(driver["config"]) == len(driver["lock"]) == 3  # three targets
    assert all(p.count("/") == 0 for p in driver["dir"]) and len(driver["dir"]) == 6  # base + rank folders
    for k in range(3):
        part = created(dataset.journal_name(k, 3))
        assert part["config"] == part["lock"] == [] and part["block"]
        buckets = {p.split("/")[1] for p in part["block"]}
        assert {int(b, 16) % 3 for b in buckets} == {k}
        assert all(p.count("/") >= 1 and p.split("/")[1] in buckets for p in part["dir"])


def test_a_failed_scan_part_is_named_and_a_rerun_completes_it(ray_cluster, synth_root, tmp_path, monkeypatch):
    root, _ = synth_root(*SCAN_TREE)
    out = tmp_path / "parts"
    monkeypatch.setenv(FAIL_ENV, "scan:1")
    code, text, err = run("scan", root, *MLA, "--run-on", "ray", "--shards", 3, "-o", out, "--json")
    assert code == 8 and text == ""
    assert "1 of 3 scan parts failed" in err and "part 1 of 3 (--shard 1/3): RuntimeError" in err
    assert os.listdir(out) == []  # no part published: the directory never holds an incomplete scan
    monkeypatch.delenv(FAIL_ENV)
    code, _, err = run("scan", root, *MLA, "--run-on", "ray", "--shards", 3, "-o", out)
    assert code == 5, err
    assert rows(out) == rows(manifest_of_scan(root, tmp_path))


def test_a_failed_migration_part_is_named_and_a_rerun_resumes_it(ray_cluster, migrate_tree, tmp_path, monkeypatch):
    root = migrate_tree
    other = tmp_path / "single"
    shutil.copytree(root, other, symlinks=True)
    run("migrate", other, *MLA, "--apply")
    m = tmp_path / "m"
    run("scan", root, *MLA, "--verify", "hash", "--run-on", "ray", "--shards", 3, "-o", m)  # as `migrate ROOT`
    journals = tmp_path / "journals"
    monkeypatch.setenv(FAIL_ENV, "migrate:1:2")  # part 1 raises after its second block
    args = ("migrate", "--manifest", m, "--apply", "--run-on", "ray", "--shards", 3, "--journal", journals)
    code, out, err = run(*args)
    assert code == 8 | 4  # the failed part; the finished parts found the conflict
    assert "part 1 of 3 (--shard 1/3): RuntimeError: injected failure of migrate part 1" in err
    assert "rerun the same command" in err
    assert tree_state(root) != tree_state(other)
    monkeypatch.delenv(FAIL_ENV)
    code, text, err = run(*args, "--json")
    assert code == 4, err
    assert json.loads(text)["apply"]["resumed"] is True
    assert tree_state(root) == tree_state(other)
    records = read_records(journals / dataset.journal_name(1, 3))
    assert [r["t"] for r in records].count("resume") == 1


def test_a_cluster_address_from_another_process(ray_cluster, synth_root, tmp_path):
    """The real command line, connecting with --ray-address: stdout holds only the JSON."""
    root, _ = synth_root(*SCAN_TREE)
    out = tmp_path / "parts"
    address = ray_cluster.get_runtime_context().gcs_address
    proc = subprocess.run([sys.executable, "-m", "kvmigrate", "scan", str(root), *MLA, "--run-on", "ray",
                           "--shards", "3", "--ray-address", address, "-o", str(out), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 5, proc.stderr
    assert json.loads(proc.stdout)["totals"]["files"] == len(rows(out))
    assert rows(out) == rows(manifest_of_scan(root, tmp_path))


def test_without_ray_installed_the_message_names_the_extra(synth_root, tmp_path, monkeypatch):
    root, _ = synth_root(SCAN_TREE[0])
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    code, _, err = run("scan", root, "--run-on", "ray", "--shards", 2, "-o", tmp_path / "parts")
    assert code == 2 and "pip install 'kvmigrate[ray]'" in err


def test_ray_options_need_each_other(synth_root, tmp_path):
    root, _ = synth_root(SCAN_TREE[0])
    assert run("scan", root, "--shards", 2)[0] == 2
    assert run("scan", root, "--run-on", "ray")[0] == 2
    assert run("scan", root, "--run-on", "ray", "--shards", 2, "--shard", "0/2")[0] == 2


def test_an_address_nobody_listens_at_fails_fast(synth_root, tmp_path):
    root, _ = synth_root(SCAN_TREE[0])
    code, _, err = run("scan", root, "--run-on", "ray", "--shards", 2, "--ray-address", "127.0.0.1:1",
                       "-o", tmp_path / "parts")
    assert code == 8 and "cannot reach the Ray cluster at 127.0.0.1:1" in err
    assert not (tmp_path / "parts").exists()


def test_a_selection_runs_on_ray_as_in_one_process(ray_cluster, migrate_tree, tmp_path):
    """--only/--exclude reach every part: the scan's rows, and the apply's targets."""
    one, out = tmp_path / "one.parquet", tmp_path / "parts"
    code_one, _, _ = run("scan", migrate_tree, *MLA, "--exclude", "Qwen/*", "-o", one)
    code, _, err = run("scan", migrate_tree, *MLA, "--exclude", "Qwen/*", "--run-on", "ray", "--shards", 3,
                       "-o", out)
    assert code == code_one, err
    assert rows(out) == rows(one) and not any(r["model_name"] == "Qwen/Qwen3-4B" for r in rows(out))
    assert manifest.read_metadata(out)["selection"]["exclude"] == ["Qwen/*"]
    before = set(os.listdir(migrate_tree))
    code, text, err = run("migrate", migrate_tree, *MLA, "--only", "Qwen/*", "--apply", "--run-on", "ray",
                          "--shards", 2, "--json")
    assert code == 0, err
    created = set(os.listdir(migrate_tree)) - before - {".kvmigrate"}
    assert created and all(name.startswith("Qwen_Qwen3-4B_") for name in created)
    assert json.loads(text)["outcomes"]["created"] > 0
