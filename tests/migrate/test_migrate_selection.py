"""migrate, verify and rollback --only/--exclude PATTERN (issue 18 item 1): a pilot on one model."""

from __future__ import annotations

import os

from kvmigrate import manifest

from helpers.cli_helpers import run, run_json

FULL = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1", "--writer-pp", "1"]
LLAMA, QWEN = "meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B"


def two_models(tmp_path, synth_root):
    """A root with a Llama namespace and a Qwen one (both link their blocks), its full manifest."""
    root, _ = synth_root({"model_name": LLAMA}, {"model_name": QWEN, "scheme": "S2"})
    out = tmp_path / "m.parquet"
    code, text = run("scan", root, "-o", out, "--verify", "hash", *FULL)
    assert code == 1, text
    targets = {n["model_name"]: (n["source_base"], n["target_base"])
               for n in run_json("report", out)[1]["namespaces"]}
    return root, out, targets


def test_migrate_only_plans_and_creates_the_selected_namespaces(tmp_path, synth_root):
    root, out, targets = two_models(tmp_path, synth_root)
    code, plan = run_json("migrate", "--manifest", out, "--only", "Qwen/*")
    assert code == 1
    assert [t["target_base"] for t in plan["targets"]] == [targets[QWEN][1]]
    assert "--only 'Qwen/*'" in plan["apply_command"]
    code, text = run("migrate", "--manifest", out, "--only", "Qwen/*", "--apply", "--journal", tmp_path / "j.jsonl")
    assert code == 0, text
    assert (root / targets[QWEN][1]).is_dir() and not (root / targets[LLAMA][1]).exists()
    code, text = run("migrate", root, *FULL, "--exclude", "Qwen/*", "--apply", "--journal", tmp_path / "k.jsonl")
    assert code == 0, text
    assert (root / targets[LLAMA][1]).is_dir()


def test_migrate_root_scans_only_the_selected_namespaces(tmp_path, synth_root):
    root, _, targets = two_models(tmp_path, synth_root)
    keep = tmp_path / "own.parquet"
    code, plan = run_json("migrate", root, *FULL, "--only", targets[LLAMA][0], "--manifest-out", keep)
    assert code == 1
    assert [t["target_base"] for t in plan["targets"]] == [targets[LLAMA][1]]
    assert list(manifest.read_metadata(keep)["namespaces"]) == [targets[LLAMA][0]]
    assert f"--only {targets[LLAMA][0]}" in plan["apply_command"]


def test_verify_checks_the_selected_targets_only(tmp_path, synth_root):
    root, out, targets = two_models(tmp_path, synth_root)
    journal = tmp_path / "j.jsonl"
    code, text = run("migrate", "--manifest", out, "--apply", "--journal", journal, "--mode", "copy")
    assert code == 0, text
    rank_dir = root / f"{targets[QWEN][1]}_r0"
    block = next(os.path.join(d, f) for d, _, fs in sorted(os.walk(rank_dir)) for f in sorted(fs))
    with open(block, "r+b") as fh:  # tamper with one Qwen block the migration wrote
        fh.write(b"\xff")
    assert run("verify", root, "--journal", journal)[0] == 4
    code, text = run("verify", root, "--journal", journal, "--exclude", "Qwen/*")  # Llama's source and target
    assert code == 0 and "2 namespace config.json files, 6 journaled blocks" in text, text
    code, text = run("verify", root, "--journal", journal, "--only", "Qwen/*")
    assert code == 4 and "block_changed" in text


def test_rollback_only_removes_the_selected_targets_and_keeps_the_journal_usable(tmp_path, synth_root):
    root, out, targets = two_models(tmp_path, synth_root)
    journal = tmp_path / "j.jsonl"
    assert run("migrate", "--manifest", out, "--apply", "--journal", journal)[0] == 0
    code, result = run_json("rollback", journal, "--only", "Qwen/*")
    assert code == 0 and result["removed"]["block"] == 6
    assert not (root / targets[QWEN][1]).exists() and not (root / f"{targets[QWEN][1]}_r0").exists()
    assert (root / targets[LLAMA][1] / "config.json").is_file()
    code, result = run_json("rollback", journal)
    assert code == 0 and result["removed"]["block"] == 6
    assert not (root / targets[LLAMA][1]).exists()
    assert sorted(os.listdir(root)) == sorted([*(b for b, _ in targets.values()),
                                               *(f"{b}_r0" for b, _ in targets.values())])
