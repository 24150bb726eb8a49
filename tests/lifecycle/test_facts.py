"""Facts that cannot be silently wrong: a stated kind an MLA model cannot have is refused
for that namespace, a root of several models is asked for per-namespace facts
(`kvmigrate facts` writes the skeleton), and a FACTS.json key that matches nothing is a
usage error naming the nearest keys."""

from __future__ import annotations

import json
import shlex

from helpers.cli_helpers import run, run_json

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


def test_a_facts_key_of_a_folder_the_lifecycle_removed_is_no_error(tmp_path, synth_root):
    """Found by running the README's lifecycle: prune and purge remove a migrated
    namespace's folder, and the nightly audit with the same FACTS.json (keyed by that
    folder, as `kvmigrate facts` writes it) failed with exit 2 from then on."""
    root, (res,) = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla", "model_name": DEEPSEEK})
    facts = tmp_path / "FACTS.json"
    facts.write_text(json.dumps({res.namespaces[0]["base_name"]: {"kv_kind": "mla", "model_dtype": "bfloat16"}}))
    assert run("migrate", root, "--facts", facts, "--apply")[0] == 0
    assert run("prune", root, "--facts", facts, "--apply", "--quiet-period", "0")[0] == 0
    assert run("prune", root, "--purge", "--older-than", "0s", "--apply")[0] == 0
    assert not (root / res.namespaces[0]["base_name"]).exists()
    code, out = run("audit", root, "--facts", facts)
    assert code != 2, out


def test_the_skeleton_asks_the_kind_of_a_namespace_whose_target_waits_for_another_fact(tmp_path, synth_root):
    """A namespace refused for a missing fact (its dtype) has no target yet, so the facts its
    gate will need (the kind) are asked in the same skeleton, not one rerun later."""
    root, (res,) = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla", "model_name": DEEPSEEK})
    code, out = run_json("facts", root)
    assert out["facts"][res.namespaces[0]["base_name"]] == {"kv_kind": None, "model_dtype": None}
