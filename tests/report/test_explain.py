"""`kvmigrate explain MANIFEST NAMESPACE` (issue 18 item 6): from a manifest alone, why a
namespace has its target, and what would change each class of blocks it cannot reuse."""

from __future__ import annotations

import json
import shutil

from helpers.cli_helpers import run, run_json


def scanned(tmp_path, synth_root, spec, *flags):
    root, (result,) = synth_root(spec)
    out = tmp_path / "m.parquet"
    code, text = run("scan", root, "-o", out, *flags)
    assert code in (1, 5), text
    return root, out, result.namespaces[0]["base_name"]


def test_every_gate_condition_with_the_source_of_each_fact(tmp_path, synth_root):
    facts = tmp_path / "FACTS.json"
    facts.write_text(json.dumps({"*": {"total_kv_heads": 8}}))
    hf = tmp_path / "hf-config.json"
    hf.write_text(json.dumps({"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8,
                              "torch_dtype": "bfloat16"}))
    root, out, base = scanned(tmp_path, synth_root, {"scheme": "S2", "tp": 2}, "--kv-kind", "full",
                              "--facts", facts, "--model-config", hf, "--target", "vllm-0.28")
    code, r = run_json("explain", out, base)
    assert code == 0
    assert r["target"]["parallel_agnostic"] is True and "parallel-agnostic namespace" in r["why"]
    gates = {(c["gate"], c["needs"]): c for c in r["gates"]}
    assert [g for g, _ in gates] == ["G2"] * 7 + ["R"] * 8  # vllm-0.28: G2 and the replicated gate R
    assert all(c["passed"] for (g, _), c in gates.items() if g == "G2")
    assert gates[("R", "pure MLA")]["reason"] == "not replicated: kv kind is full (needs pure MLA)"
    sources = {f["name"]: f["source"] for c in r["gates"] for f in c["facts"]}
    assert sources["kv_kind"] == "flag --kv-kind"
    assert sources["total_kv_heads"] == f"FACTS.json key '*' ({facts})"
    assert sources["runner"] == sources["executor"] == "assumed: vLLM's default"
    by_name = {f["name"]: f for f in r["facts"]}
    assert by_name["model_dtype"] == {"name": "model_dtype", "value": "bfloat16", "source": f"model config {hf}",
                                      "flag": "--model-dtype"}
    assert by_name["cache_dtype"]["source"] == "not given"
    code, text = run("explain", out, base)
    assert "[pass] tp divides the total KV heads: total_kv_heads=8 (FACTS.json key '*'" in text
    assert "[FAIL] tp > 1" not in text and "[pass] tp > 1: config.json" in text


def test_failed_conditions_are_the_targets_reasons_and_a_guess_names_its_command(tmp_path, synth_root):
    root, out, base = scanned(tmp_path, synth_root, {"scheme": "S2"}, "--model-dtype", "bfloat16",
                              "--target", "vllm-0.28")
    code, r = run_json("explain", out, base)
    code, summary = run_json("report", out)
    entry = next(n for n in summary["namespaces"] if n["source_base"] == base)
    assert [c["reason"] for c in r["gates"] if not c["passed"]] == entry["gate"]["reasons"]
    assert "a guess: --kv-kind, --total-kv-heads not given would change it" in r["why"]
    assert "--kv-kind <full|mla|sliding|hybrid|mamba> --total-kv-heads <N>" in r["command"]


def test_each_non_reusable_class_has_its_reason_and_command(tmp_path, synth_root):
    root, out, base = scanned(tmp_path, synth_root, {"family": "llmd", "tp": 2, "defects": "short"},
                              "--model-dtype", "bfloat16")
    shutil.rmtree(root)  # from the manifest alone
    code, r = run_json("explain", out, base)
    assert code == 0
    classes = {(c["status"], c["action"]): c for c in r["not_reusable"]}
    concat = classes[("ok", "needs_concat")]
    assert (concat["finding"], concat["asks"]) == ("needs_fact", "--kv-kind")
    assert "kv kind unknown" in concat["reason"] and "--kv-kind <full|mla" in concat["command"]
    short = classes[("short", "none")]
    assert short["blocks"] == 1 and short["command"] == f"kvmigrate report {out} --list short"
    code, summary = run_json("report", out)
    entry = next(n for n in summary["namespaces"] if n["source_base"] == base)
    assert sum(c["blocks"] for c in r["not_reusable"]) == entry["not_reusable"]["blocks"] == r["blocks"]
    assert concat["bytes"] == entry["by_action"]["needs_concat"]["bytes"]
    code, text = run("explain", out, "meta-llama/Llama-3.1-8B-Instruct")  # a model name naming one namespace
    assert code == 0 and "status short, action none\n    reason: empty file" in text


def test_blocks_split_between_batches_give_the_same_classes(tmp_path, synth_root, monkeypatch):
    """The classes are streamed: a block whose rank files fall in two batches, or one
    missing a rank file (it waits until the end), is classed as when read at once."""
    from kvmigrate.report import explain as explain_module

    root, out, base = scanned(tmp_path, synth_root, {"family": "llmd", "tp": 2, "blocks": 12,
                                                     "defects": ("short", "missing_rank")}, "--model-dtype", "bfloat16")
    whole = explain_module.explain(out, base)
    assert len(whole["not_reusable"]) >= 2
    monkeypatch.setattr(explain_module, "BATCH_ROWS", 5)
    assert explain_module.explain(out, base) == whole


def test_a_namespace_without_a_target_says_which_fact_and_command(tmp_path, synth_root):
    root, out, base = scanned(tmp_path, synth_root, {"scheme": "S2"})
    code, r = run_json("explain", out, base)
    assert r["target"] is None and r["gates"] == []
    assert r["why"].startswith("no target namespace: missing deployment fact 'model_dtype'")
    assert "--model-dtype <bfloat16|float16>" in r["command"]
    (only,) = r["not_reusable"]
    assert (only["finding"], only["asks"], only["blocks"]) == ("needs_fact", "--model-dtype", 6)


def test_unknown_namespace_or_not_a_manifest_is_a_usage_error(tmp_path, synth_root):
    root, out, base = scanned(tmp_path, synth_root, {"scheme": "S2"})
    code, text = run("explain", out, "nope")
    assert code == 2 and f"no namespace 'nope' in the manifest (namespaces: {base})" in text
    bogus = tmp_path / "x.parquet"
    bogus.write_text("not parquet")
    code, text = run("explain", bogus, base)
    assert code == 2 and "not a Parquet manifest" in text


def test_a_flat_deployment_names_its_target_without_a_folder(tmp_path, synth_root):
    """An SGLang deployment has no target folder: explain says where its pages are read
    (by name, in the same directory), never 'None' (seen: 'target sglang-0.5.23: None
    blocks under None/' and 'None is the writer's own deployment namespace')."""
    root, _ = synth_root({"family": "sglang", "blocks": 3, "layers": 2, "tp": 2, "model_name": "m"})
    out = tmp_path / "m.parquet"
    code, text = run("scan", root, "-o", out, "--writer-layout", "page_first")
    assert code in (0, 1), text
    code, text = run("explain", out, "sglang:m:tp2")
    assert code == 0, text
    assert "None" not in text, text
    assert "target       sglang-0.5.23: the pages of deployment sglang:m:tp2" in text, text
    assert "ranks [0, 1])" in text, text
    code, r = run_json("explain", out, "sglang:m:tp2")
    assert "None" not in r["why"] and "by name" in r["why"], r["why"]
