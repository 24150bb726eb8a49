"""docs/schema/<command>.json: generated from kvmigrate/outputs.py by scripts/gen_schema.py,
kept current, and true of what the commands print: every `--json` output of a whole
lifecycle (scan, report, audit, migrate, verify, runs, prune, restore, rollback, purge,
identity) over a tree of every family and era validates against its command's schema
(tests/schema_check.py: the subset of JSON Schema the generator emits)."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvmigrate.cli import cli
from kvmigrate.outputs import OUTPUTS

from helpers.json_outputs import SGLANG_FACTS, lifecycle
from helpers.schema_check import errors
from helpers.synth_matrix import ERAS, GEOMETRY, cases, spec_of

REPO = Path(__file__).resolve().parents[2]
SCHEMA_DIR = REPO / "docs" / "schema"
_spec = importlib.util.spec_from_file_location("gen_schema", REPO / "scripts" / "gen_schema.py")
assert _spec and _spec.loader
gen_schema = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_schema)

SGLANG = {"family": "sglang", "blocks": 3, "layers": 2}
TREES = {era: ({**GEOMETRY, **spec}, facts) for era, (spec, facts) in ERAS.items()}
TREES["sglang-e2-tp2"] = ({**SGLANG, "sgl_era": "e2", "tp": 2}, ["--kv-kind", "full", *SGLANG_FACTS])
TREES["sglang-e3-tp4-mla"] = ({**SGLANG, "sgl_era": "e3", "tp": 4, "kv_kind": "mla"}, ["--kv-kind", "mla", *SGLANG_FACTS])
TREES["sglang-e4-tp1"] = ({**SGLANG, "tp": 1}, ["--kv-kind", "full"])


def schema(command: str) -> dict:
    return json.loads((SCHEMA_DIR / f"{command}.json").read_text())


def assert_valid(outputs: dict[str, list]) -> None:
    bad = []
    for command, values in outputs.items():
        s = schema(command)
        for i, value in enumerate(values):
            bad += [f"{command} #{i}: {e}" for e in errors(value, s)]
    assert bad == [], "\n".join(bad[:40])


def test_every_command_has_a_schema_file_and_they_are_current():
    assert sorted(p.stem for p in SCHEMA_DIR.glob("*.json")) == sorted(OUTPUTS)
    assert gen_schema.stale(SCHEMA_DIR) == [], "docs/schema is stale: run scripts/gen_schema.py"


def test_a_stale_schema_file_is_named(tmp_path):
    assert gen_schema.main(["--dir", str(tmp_path)]) == 0
    assert gen_schema.stale(tmp_path) == []
    doc = json.loads((tmp_path / "runs.json").read_text())
    doc["$defs"]["Run"]["properties"]["pid"] = {"type": "integer"}  # a key the types do not have
    (tmp_path / "runs.json").write_text(json.dumps(doc, indent=2) + "\n")
    (tmp_path / "gone.json").write_text("{}\n")
    assert gen_schema.stale(tmp_path) == ["runs.json", "gone.json"]
    assert gen_schema.main(["--check", "--dir", str(tmp_path)]) == 1


@pytest.mark.parametrize("tree", sorted(TREES))
def test_every_output_of_a_lifecycle_matches_its_schema(synth_root, tmp_path, tree):
    spec, facts = TREES[tree]
    root, _ = synth_root(spec)
    outputs = lifecycle(root, tmp_path, facts)
    assert {"report", "migrate", "verify", "runs", "prune", "rollback"} <= set(outputs)
    assert_valid(outputs)


@pytest.mark.parametrize("family", ["vllm", "llmd", "vllmcpp", "sglang"])
def test_synth_json_matches_its_schema(tmp_path, family):
    res = CliRunner().invoke(cli, ["synth", str(tmp_path / "t"), "--family", family, "--tp", "2", "--blocks", "3",
                                   "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["blocks"] and errors(out, schema("synth")) == []


@pytest.mark.slow
@pytest.mark.parametrize("era,defect", cases())
def test_reports_of_every_defect_match_the_schema(synth_root, tmp_path, era, defect):
    root, _ = synth_root(spec_of(era, defect))
    facts = ERAS[era][1]
    outputs = lifecycle(root, tmp_path, facts)
    assert_valid(outputs)


def test_the_check_fails_on_a_wrong_key_a_wrong_type_and_a_missing_key(synth_root, tmp_path):
    spec, facts = TREES["vllm-S2-tp2-full"]
    root, _ = synth_root(spec)
    outputs = lifecycle(root, tmp_path, facts)
    summary = outputs["report"][0]
    assert errors(summary, schema("report")) == []
    renamed = copy.deepcopy(summary)
    renamed["namespaces"][0]["target_basename"] = renamed["namespaces"][0].pop("target_base")
    assert errors(renamed, schema("report")) == ["$.namespaces[0]: missing key 'target_base'",
                                                 "$.namespaces[0]: unexpected key 'target_basename'"]
    wrong = copy.deepcopy(summary)
    wrong["totals"]["pending"]["blocks"] = "3"
    assert errors(wrong, schema("report")) == ["$.totals.pending.blocks: str '3' is not integer"]
    applied = next(o for o in outputs["migrate"] if "apply" in o)
    applied["apply"]["linkd"] = 1
    assert errors(applied, schema("migrate")) != []
