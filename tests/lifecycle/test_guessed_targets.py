"""`migrate --apply` never places a block into a guessed target (a target that depends on a
fact not given): the dry run prints no apply command for it, and an `--apply` typed anyway
leaves those namespaces out, names the facts to state, and sets exit bit 1."""

from __future__ import annotations

import json

from kvmigrate import manifest

from helpers.cli_helpers import run, run_json


def test_apply_never_places_blocks_into_a_guessed_target(tmp_path, synth_root):
    root, (guessed, known) = synth_root({"family": "vllm", "scheme": "S2", "tp": 2},
                                        {"family": "llmd", "tp": 2, "kv_kind": "mla", "model_name": "org/mla"})
    facts = tmp_path / "FACTS.json"
    facts.write_text(json.dumps({"*": {"model_dtype": "bfloat16"}, "org/mla": {"kv_kind": "mla"}}))
    m = tmp_path / "m.parquet"
    code, dry = run_json("migrate", root, "--facts", facts, "--manifest-out", m)
    base = guessed.namespaces[0]["base_name"]
    assert dry["apply_command"] is None and [g["namespace"] for g in dry["guessed_targets"]] == [base]
    guess_target = manifest.read_metadata(m)["namespaces"][base]["target"]["base_name"]
    code, done = run_json("migrate", root, "--facts", facts, "--apply")
    assert code & 1 and not code & 8, done
    assert done["apply"]["left_out_guessed"] == [{"namespace": base, "facts": ["kv_kind"]}]
    assert done["outcomes"]["created"] == len(known.blocks)
    assert not (root / guess_target).exists()  # nothing, not even a folder or config.json
    code, text = run("migrate", root, "--facts", facts, "--apply")
    assert "not placed: 1 namespace whose target is a guess" in text and f"{base}: state --kv-kind" in text
