"""Facts that cannot be silently wrong: a stated kind an MLA model cannot have is refused
for that namespace, a root of several models is asked for per-namespace facts
(`kvmigrate facts` writes the skeleton), and a FACTS.json key that matches nothing is a
usage error naming the nearest keys."""

from __future__ import annotations

import json
import shlex

from cli_helpers import run, run_json

DEEPSEEK = "deepseek-ai/DeepSeek-V2-Lite-Chat"
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


def mixed(synth_root):
    return synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla", "model_name": DEEPSEEK},
                      {"family": "vllm", "scheme": "S2", "tp": 2, "model_name": LLAMA})


def test_a_stated_kind_an_mla_model_cannot_have_is_refused_for_its_namespace(tmp_path, synth_root):
    root, (deepseek, llama) = mixed(synth_root)
    before = {p.name for p in root.iterdir()}
    code, done = run_json("migrate", root, "--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16",
                          "--apply")
    assert done["outcomes"]["created"] == len(llama.blocks)  # the Llama rows only
    ds = next(n for n in done["namespaces"] if n["model_name"] == DEEPSEEK)
    assert "is an MLA model" in ds["target_error"] and "--kv-kind full" in ds["target_error"]
    (llama_target,) = {t["target_base"] for t in done["targets"]}
    assert {p.name for p in root.iterdir()} - before == {llama_target, llama_target + "_r0", ".kvmigrate"}
    facts = tmp_path / "FACTS.json"  # the same claim in a FACTS.json entry of that model
    facts.write_text(json.dumps({DEEPSEEK: {"kv_kind": "full"}, "*": {"model_dtype": "bfloat16"}}))
    code, audit = run_json("audit", root, "--facts", facts)
    ds = next(n for n in audit["namespaces"] if n["model_name"] == DEEPSEEK)
    assert f"entry {DEEPSEEK!r}" in ds["target_error"]


def test_a_root_of_several_models_is_asked_for_per_namespace_facts(tmp_path, synth_root):
    root, (deepseek, llama) = mixed(synth_root)
    code, audit = run_json("audit", root, "--model-dtype", "bfloat16")
    commands = [h["command"] for h in audit["hints"]]
    assert not any("--kv-kind" in c for c in commands), commands  # never one global kind for both
    (skeleton_cmd,) = [c for c in commands if c.startswith("kvmigrate facts")]
    code, out = run(*shlex.split(skeleton_cmd.replace("-o FACTS.json", f"-o {tmp_path / 'FACTS.json'}"))[1:])
    assert code == 1  # nulls left to fill
    skeleton = json.loads((tmp_path / "FACTS.json").read_text())
    assert set(skeleton) == {deepseek.namespaces[0]["base_name"], llama.namespaces[0]["base_name"]}
    assert all(entry["kv_kind"] is None and entry["model_dtype"] == "bfloat16" for entry in skeleton.values())
    skeleton[deepseek.namespaces[0]["base_name"]]["kv_kind"] = "mla"
    skeleton[llama.namespaces[0]["base_name"]].update(kv_kind="full", total_kv_heads=8)
    (tmp_path / "FACTS.json").write_text(json.dumps(skeleton))
    code, done = run_json("migrate", root, "--facts", tmp_path / "FACTS.json", "--apply")
    assert code == 0 and done["outcomes"]["created"] == len(deepseek.blocks) + len(llama.blocks), done
    assert not done["apply"]["left_out_guessed"]


def test_a_facts_key_that_matches_nothing_is_a_usage_error_naming_the_nearest(tmp_path, synth_root):
    root, _ = mixed(synth_root)
    facts = tmp_path / "FACTS.json"
    facts.write_text(json.dumps({"deepseek-ai/DeepSeek-V2-Lite": {"kv_kind": "mla"}}))  # not the served name
    code, out = run("audit", root, "--facts", facts, "--model-dtype", "bfloat16")
    assert code == 2 and "'deepseek-ai/DeepSeek-V2-Lite' matches no namespace" in out
    assert f"nearest: {DEEPSEEK!r}" in out
