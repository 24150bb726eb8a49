"""A folder a vLLM 0.24-0.33 gate collapsed, migrated for vLLM 0.34 (identity.md §4.1).

0.34 never reads the collapsed name: it reads the rows under the name of the topology
that wrote them, which the folder does not record. Without --writer-tp/--writer-pp
nothing is placed and no apply command is offered; with them the rows are relinked into
the 0.34 namespace, whose config.json is byte for byte what 0.34 writes, and every
report says the plan rests on that statement. The namespace and config.json expected
here come from tests/helpers/reference_reader.py (the engine's rules), not from kvmigrate.
"""

from __future__ import annotations

import json
import os

import pytest

from kvmigrate import layout, manifest

from helpers.cli_helpers import run, run_json
from helpers.reference_reader import ReferenceReader, file_facts, row_page_errors, vllm034_base, vllm034_config_bytes

FULL = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16"]


def collapsed(synth_root, tp: int):
    root, (res,) = synth_root({"family": "vllm", "scheme": "S3", "tp": tp, "agnostic": True})
    ns = res.namespaces[0]
    assert "parallel_agnostic" not in ns["fields"] and ns["fields"]["tp_size"] == 1  # what 0.33 wrote
    return root, res, ns


def top_level(root) -> set[str]:
    return {e for e in os.listdir(root) if e != layout.OWN_DIR}


@pytest.mark.parametrize("tp", [1, 2])
def test_without_the_writer_facts_nothing_is_placed_and_no_apply_is_offered(tmp_path, synth_root, tp):
    root, res, ns = collapsed(synth_root, tp)
    before = top_level(root)
    code, text = run("migrate", root, *FULL)
    assert "to apply:" not in text and "orphaned by vLLM 0.34" in text, text
    code, done = run_json("migrate", root, *FULL, "--apply")
    assert done["outcomes"]["created"] == 0
    assert top_level(root) == before and vllm034_base(ns) not in top_level(root)
    code, audit = run_json("audit", root, *FULL)
    assert code & 1 and "already in place" not in json.dumps(audit)
    (finding,) = [f for f in audit["findings"] if f["code"] == "orphaned"]
    assert finding["blocks"] == len(res.blocks) and "does not record the topology" in finding["message"]
    assert not any("--apply" in h["command"] for h in audit["hints"]), audit["hints"]
    (hint,) = [h for h in audit["hints"] if "orphaned" in h["codes"]]
    assert "--writer-tp <N> --writer-pp <N>" in hint["command"]


@pytest.mark.parametrize("tp", [1, 2])
def test_with_the_writer_facts_the_rows_go_where_034_reads_them(tmp_path, synth_root, tp):
    root, res, ns = collapsed(synth_root, tp)
    writer = ["--writer-tp", str(tp), "--writer-pp", "1"]
    code, text = run("migrate", root, *FULL, *writer)
    assert f"target namespace {vllm034_base(ns)}" in text
    assert "rests on: relinking this collapsed folder as tp" in text and "to apply:" in text
    sources = [os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs]
    before = file_facts(root, sources)
    m = tmp_path / "m.parquet"
    code, done = run_json("migrate", root, *FULL, *writer, "--apply", "--manifest-out", m)
    assert code == 0 and done["outcomes"]["created"] == len(res.blocks), done
    assert file_facts(root, sources) == before  # the collapsed folder is untouched
    base = vllm034_base(ns)
    assert (root / base / layout.CONFIG_NAME).read_bytes() == vllm034_config_bytes(ns)
    target = manifest.read_metadata(m)["namespaces"][ns["base_name"]]["target"]
    assert target["base_name"] == base
    reader = ReferenceReader(root, target)
    assert reader.keys_on_disk() == {(b["hex"], b["group"]) for b in res.blocks}
    for b in res.blocks:
        assert row_page_errors(reader, ns, b["hex"], b["group"], cells=tp) == []
    # the report says what the plan rested on
    code, report = run("report", m)
    assert "rests on the statement that one topology wrote every row" in report


def test_a_false_writer_statement_is_what_the_plan_rests_on(tmp_path, synth_root):
    """Rows written at TP2 stated as TP1: kvmigrate cannot tell (equal sizes) and places
    them where 0.34 at TP1 reads; the engine's rules say another name is theirs."""
    root, res, ns = collapsed(synth_root, 2)
    code, done = run_json("migrate", root, *FULL, "--writer-tp", "1", "--writer-pp", "1", "--apply")
    assert code == 0 and done["outcomes"]["created"] == len(res.blocks)
    (placed,) = {t["target_base"] for t in done["targets"]}
    assert placed != vllm034_base(ns)
    assert any("rests on the statement" in c for t in done["targets"] for c in t["claims"])


def test_rows_of_a_multi_node_engine_are_an_integrity_finding_never_reused(tmp_path, synth_root):
    """nnodes > 1: the engine core's rows lack the remote workers' slots (vllm#54415)."""
    root, (res,) = synth_root({"family": "vllm", "scheme": "S3", "tp": 2})
    before = top_level(root)
    code, audit = run_json("audit", root, *FULL, "--nnodes", "2")
    assert code & 4 and audit["totals"]["by_status"]["missing_slots"]["files"] == len(res.blocks) + 1  # + config.json
    assert any("prune" in h["command"] and "--unreadable-namespaces" in h["command"] for h in audit["hints"])
    code, done = run_json("migrate", root, *FULL, "--nnodes", "2", "--apply")
    assert done["outcomes"]["created"] == 0 and top_level(root) == before
    code, plan = run_json("prune", root, *FULL, "--nnodes", "2", "--unreadable-namespaces", "--force-live")
    assert plan["totals"]["unreadable_namespaces"]["files"] == len(res.blocks) + 1
    # one node: the same folder is in place
    code, audit = run_json("audit", root, *FULL)
    assert code == 0 and "missing_slots" not in audit["totals"]["by_status"]


def test_the_reclaimable_figures_name_an_orphaned_folder_and_prune_keeps_it_until_migrated(tmp_path, synth_root):
    root, res, ns = collapsed(synth_root, 2)
    files = len(res.blocks) + 1  # + config.json
    code, audit = run_json("audit", root, *FULL)
    assert audit["reclaimable"]["orphaned"] == [{"namespace": ns["base_name"], "files": files,
                                                 "bytes": audit["namespaces"][0]["bytes"],
                                                 "reason": audit["namespaces"][0]["target_unreachable"]}]
    code, text = run("audit", root, *FULL)
    assert "(orphaned by vLLM 0.34)" in text
    every = ("--migrated", "--unreadable-namespaces", "--residue", "--force-live")
    code, plan = run_json("prune", root, *FULL, *every)
    assert plan["files"] == 0 and [o["namespace"] for o in plan["orphaned"]] == [ns["base_name"]]
    # once the topology is stated and the rows are relinked, --migrated takes the collapsed folder
    writer = ["--writer-tp", "2", "--writer-pp", "1"]
    assert run_json("migrate", root, *FULL, *writer, "--apply")[0] == 0
    code, plan = run_json("prune", root, *FULL, *writer, "--migrated", "--force-live")
    assert plan["totals"]["migrated"]["files"] == files and plan["orphaned"] == []
