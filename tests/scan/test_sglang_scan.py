"""Scanning SGLang HiCache directories (docs/sglang.md): detection, deployments, the
manifest columns, each defect's status and each action row of §3, on synth directories."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from helpers.cli_helpers import run

SGL = {"family": "sglang", "blocks": 3, "layers": 2}


def pages(rows):
    return {k: r for k, r in rows.items() if r["family"] == "sglang"}


def test_e4_directory_is_recognised_and_grouped_into_deployments(synth_root, scan_root):
    root, _ = synth_root({**SGL, "tp": 4, "model_name": "meta-llama/Llama-3.1-8B"},
                         {**SGL, "tp": 8, "kv_kind": "mla", "model_name": "deepseek-ai/DeepSeek-V3"})
    _, rows = scan_root(root)
    got = pages(rows)
    assert len(got) == 3 * 4 + 3
    by_dep = Counter(r["deployment"] for r in got.values())
    assert by_dep == {"sglang:meta-llama-Llama-3.1-8B:tp4": 12, "sglang:deepseek-ai-DeepSeek-V3": 3}
    for r in got.values():
        assert r["scheme"] == "sgl-e4" and r["target_profile"] == "sglang-0.5.23"
        assert r["source_base"] == r["deployment"]
        assert len(r["block_hash"]) == 32
    ranks = sorted(r["rank"] for r in got.values() if r["model_name"] == "meta-llama-Llama-3.1-8B")
    assert ranks == sorted(list(range(4)) * 3)
    assert {r["model_name"] for r in got.values()} == {"meta-llama-Llama-3.1-8B", "deepseek-ai-DeepSeek-V3"}


def test_pools_are_deployments_of_their_own(synth_root, scan_root):
    root, _ = synth_root({**SGL, "tp": 2, "kv_kind": "mla", "model_name": "kimi", "pools": ("mamba", "indexer")})
    _, rows = scan_root(root)
    assert Counter(r["source_base"] for r in pages(rows).values()) == {
        "sglang:kimi": 3, "sglang:kimi.indexer": 3, "sglang:kimi:tp2.mamba": 6}


def test_pp_stages_are_one_deployment(synth_root, scan_root):
    root, _ = synth_root({**SGL, "tp": 2, "pp": 2, "model_name": "m"})
    _, rows = scan_root(root, flags={"writer_layout": "page_first"})
    got = pages(rows)
    assert {r["deployment"] for r in got.values()} == {"sglang:m:tp2:pp2"}
    assert sorted(Counter(r["rank"] for r in got.values())) == [0, 1, 2, 3]
    assert {r["action"] for r in got.values()} == {"already_present"}


def test_e4_layout_unrecorded_needs_writer_layout(synth_root, scan_root):
    root, _ = synth_root({**SGL, "tp": 2, "model_name": "m"})
    _, rows = scan_root(root)
    for r in pages(rows).values():
        assert (r["status"], r["action"], r["finding"], r["asks"]) == ("ok", "needs_relayout", "needs_fact",
                                                                       "--writer-layout")


@pytest.mark.parametrize("release", ["0.5.14", "0.5.20"])
def test_e4_equal_layouts_are_already_present(synth_root, scan_root, release):
    root, _ = synth_root({**SGL, "tp": 2, "model_name": "m"})
    _, rows = scan_root(root, flags={"writer_release": release})  # page_first default from 0.5.14, the target's
    for rel, r in pages(rows).items():
        assert (r["action"], r["target_relpath"]) == ("already_present", rel)


def test_e4_written_layer_first_needs_relayout(synth_root, scan_root):
    root, _ = synth_root({**SGL, "tp": 2, "model_name": "m", "sgl_layout": "layer_first"})
    _, rows = scan_root(root, flags={"writer_release": "0.5.13"})
    for r in pages(rows).values():
        assert r["action"] == "needs_relayout" and "written layer_first, read page_first" in r["reason"]


def test_e2_non_mla_shards_link_to_the_0_5_23_name(synth_root, scan_root):
    root, res = synth_root({**SGL, "sgl_era": "e2", "tp": 4})
    _, rows = scan_root(root, flags={"kv_kind": "full", "model_name": "org/m", "target_layout": "layer_first"})
    got = pages(rows)
    assert len(got) == 12
    for rel, r in got.items():
        hexh, rest = rel[:64], rel[64:]
        assert r["scheme"] == "sgl-e2" and r["action"] == "link"
        assert r["target_relpath"] == f"{hexh}_org-m{rest}"  # `_{r}_{N}` kept after the model


def test_e2_at_tp1_links_to_rank_0_of_1(synth_root, scan_root):
    root, _ = synth_root({**SGL, "sgl_era": "e2", "tp": 1})
    _, rows = scan_root(root, flags={"kv_kind": "full", "model_name": "m", "target_layout": "layer_first"})
    for rel, r in pages(rows).items():
        assert r["target_relpath"] == rel[:64] + "_m_0_1.bin"


def test_e3_mla_links_to_the_model_name(synth_root, scan_root):
    root, _ = synth_root({**SGL, "sgl_era": "e3", "tp": 4, "kv_kind": "mla"})
    _, rows = scan_root(root, flags={"kv_kind": "mla", "model_name": "ds", "target_layout": "layer_first"})
    got = pages(rows)
    assert len(got) == 3
    for rel, r in got.items():
        assert (r["scheme"], r["action"], r["target_relpath"]) == ("sgl-e3", "link", rel[:64] + "_ds.bin")


def test_e2_mla_copies_one_link_per_page(synth_root, scan_root):
    root, _ = synth_root({**SGL, "sgl_era": "e2", "tp": 2, "kv_kind": "mla"})
    _, rows = scan_root(root, flags={"kv_kind": "mla", "model_name": "ds", "target_layout": "layer_first"},
                        verify="hash")
    got = pages(rows)
    links = [r for r in got.values() if r["action"] == "link"]
    assert len(links) == 3 and all(r["relpath"].endswith("_0_2.bin") for r in links)
    assert {r["target_relpath"][64:] for r in links} == {"_ds.bin"}
    others = [r for r in got.values() if r["action"] != "link"]
    assert {(r["status"], r["finding"], r["primary_rank"]) for r in others} == {("ok", "replica_of_primary", 0)}


def test_e2_mla_copy_that_differs_is_replica_mismatch(synth_root, scan_root):
    root, res = synth_root({**SGL, "sgl_era": "e2", "tp": 2, "kv_kind": "mla", "defects": ("replica_differs",)})
    _, rows = scan_root(root, flags={"kv_kind": "mla", "model_name": "ds", "target_layout": "layer_first"},
                        verify="hash")
    d = res[0].defect("replica_differs")
    victim = [r for r in pages(rows).values() if r["relpath"][:64] == d["block"]]
    assert {r["status"] for r in victim} == {"replica_mismatch"}  # two copies: no majority, nothing placed
    assert all(r["action"] == "none" for r in victim)


def test_e1_to_e3_names_need_kv_kind(synth_root, scan_root):
    root, _ = synth_root({**SGL, "sgl_era": "e2", "tp": 2})
    _, rows = scan_root(root, flags={"model_name": "m"})
    for r in pages(rows).values():
        assert (r["status"], r["action"], r["asks"]) == ("ok", "none", "--kv-kind")


def test_e1_to_e3_names_need_model_name(synth_root, scan_root):
    root, _ = synth_root({**SGL, "sgl_era": "e3", "tp": 2})
    _, rows = scan_root(root, flags={"kv_kind": "full"})
    for r in pages(rows).values():
        assert (r["model_name"], r["action"], r["asks"]) == (None, "none", "--model-name")
        assert "'_0_2'" in r["reason"] or "'_1_2'" in r["reason"]  # the FACTS.json key to set


def test_e1_zip_payload_is_unsupported_layout(synth_root, scan_root):
    root, _ = synth_root({**SGL, "sgl_era": "e1", "tp": 2})
    _, rows = scan_root(root, flags={"kv_kind": "full", "model_name": "m"})
    got = pages(rows)
    assert len(got) == 3  # every TP rank wrote the same name
    for r in got.values():
        assert (r["scheme"], r["status"], r["action"]) == ("sgl-e1", "unsupported_layout", "none")


def test_e2_zip_payload_is_unsupported_layout(synth_root, scan_root):
    root, _ = synth_root({**SGL, "sgl_era": "e2", "tp": 2, "defects": ("zip_payload",)})
    _, rows = scan_root(root, flags={"kv_kind": "full", "model_name": "m"})
    assert {r["status"] for r in pages(rows).values()} == {"unsupported_layout"}


def test_link_whose_target_exists_is_already_present(synth_root, scan_root):
    root, _ = synth_root({**SGL, "sgl_era": "e2", "tp": 2})
    first = sorted(p for p in os.listdir(root) if p.endswith("_0_2.bin"))[0]
    os.link(root / first, root / (first[:64] + "_m_0_2.bin"))
    _, rows = scan_root(root, flags={"kv_kind": "full", "model_name": "m", "target_layout": "layer_first"})
    assert rows[first]["action"] == "already_present"
    assert Counter(r["action"] for r in pages(rows).values() if r["scheme"] == "sgl-e2") == {
        "link": 5, "already_present": 1}


@pytest.mark.parametrize("defect,status,verify", [
    ("short", "short", "size"),
    ("size_mismatch", "size_mismatch", "size"),
    ("zero_filled", "zero_filled", "hash"),
    ("missing_rank", "incomplete", "size"),
])
def test_page_defects(synth_root, scan_root, defect, status, verify):
    root, res = synth_root({**SGL, "tp": 2, "model_name": "m", "defects": (defect,)})
    _, rows = scan_root(root, flags={"writer_layout": "page_first"}, verify=verify)
    d = res[0].defect(defect)
    for rel in d["rows"]:
        assert rows[rel]["status"] == status, rows[rel]
        assert rows[rel]["action"] == "none"
    healthy = [r for k, r in pages(rows).items() if k not in d["rows"] and k != d.get("relpath")]
    assert healthy and {r["status"] for r in healthy} == {"ok"}


@pytest.mark.parametrize("defect,status", [("tmp_sglang", "tmp_leftover"), ("tmp_sglang_old", "tmp_leftover"),
                                           ("foreign", "foreign"), ("symlink", "foreign")])
def test_files_around_the_pages(synth_root, scan_root, defect, status):
    root, res = synth_root({**SGL, "tp": 2, "model_name": "m", "defects": (defect,)})
    _, rows = scan_root(root)
    d = res[0].defect(defect)
    r = rows[d["relpath"]]
    family = "sglang" if status == "tmp_leftover" else None  # an engine's leftover is the engine's
    assert (r["status"], r["action"], r["family"], r["source_base"]) == (status, "none", family, None)


def test_dcp_and_cp_ranks(synth_root, scan_root):
    root, _ = synth_root({**SGL, "tp": 4, "kv_kind": "mla", "dcp": 2, "cp": 2, "model_name": "ds"})
    _, rows = scan_root(root, flags={"writer_layout": "page_first"})
    got = pages(rows)
    assert {r["deployment"] for r in got.values()} == {"sglang:ds:cp2:tp4dcp2page16"}
    assert Counter(r["rank"] for r in got.values()) == {0: 3, 1: 3, 2: 3, 3: 3}
    assert {r["action"] for r in got.values()} == {"already_present"}


def test_facts_file_keys_exact_suffix_then_model_then_star(synth_root, scan_root, tmp_path):
    root, _ = synth_root({**SGL, "sgl_era": "e2", "tp": 2}, {**SGL, "sgl_era": "e2", "tp": 1},
                         {**SGL, "tp": 1, "model_name": "org/e4"})
    facts = tmp_path / "FACTS.json"
    facts.write_text(json.dumps({"*": {"kv_kind": "full", "model_name": "star", "target_layout": "layer_first",
                                       "writer_layout": "layer_first"},
                                 "": {"model_name": "exact"},
                                 "org/e4": {"writer_layout": "page_first"}}))
    _, rows = scan_root(root, facts_file=str(facts))
    got = pages(rows)
    targets = Counter(r["target_relpath"][64:] for r in got.values() if r["scheme"] != "sgl-e4")
    assert targets == {"_exact_0_1.bin": 3, "_star_0_2.bin": 3, "_star_1_2.bin": 3}
    e4 = [r for r in got.values() if r["scheme"] == "sgl-e4"]  # its own entry: written page_first
    assert len(e4) == 3 and {r["action"] for r in e4} == {"needs_relayout"}
    assert all("written page_first, read layer_first" in r["reason"] for r in e4)


def test_facts_key_by_served_model_name_decides_the_reading(synth_root, scan_root, tmp_path):
    root, _ = synth_root({**SGL, "tp": 8, "pp": 2, "kv_kind": "mla", "model_name": "org/DeepSeek_V3_0_1"})
    facts = tmp_path / "FACTS.json"
    facts.write_text(json.dumps({"org/DeepSeek_V3_0_1": {"model_name": "org/DeepSeek_V3_0_1",
                                                         "writer_layout": "page_first"}}))
    _, rows = scan_root(root, facts_file=str(facts))
    got = pages(rows)
    assert {r["deployment"] for r in got.values()} == {"sglang:org-DeepSeek_V3_0_1:pp2"}
    assert all("read with the model name 'org/DeepSeek_V3_0_1'" in r["reason"] for r in got.values())
    _, rows = scan_root(root, flags={"writer_layout": "page_first"})  # without it: read from the right
    assert {r["deployment"] for r in pages(rows).values()} == {"sglang:org-DeepSeek_V3:tp1:pp2"}


def test_tree_namespaces_and_a_hicache_directory_side_by_side(synth_root, scan_root):
    root, _ = synth_root({"family": "vllm"}, {**SGL, "tp": 2, "model_name": "m"})
    _, rows = scan_root(root, flags={"kv_kind": "full", "total_kv_heads": 8, "model_dtype": "bfloat16"})
    fams = Counter(r["family"] for r in rows.values())
    assert fams.pop("sglang") == 6 and sum(n for f, n in fams.items() if f) > 0
    assert not any(r["status"] == "foreign" for r in rows.values())


def test_cli_synth_scan_report_and_audit(tmp_path):
    d = tmp_path / "hicache"
    code, out = run("synth", d, "--family", "sglang", "--sgl-era", "e2", "--tp", "2", "--blocks", "2")
    assert code == 0, out
    code, out = run("scan", d, "-o", tmp_path / "m.parquet", "--kv-kind", "full", "--model-name", "org/m",
                    "--target-layout", "layer_first")  # not -q: it prints nothing
    assert code == 1 and "sglang:org-m:tp2:sgl-e2" in out  # pending links
    code, out = run("report", tmp_path / "m.parquet")
    assert code == 1 and "sglang:org-m:tp2:sgl-e2" in out
    code, out = run("scan", d, "-o", tmp_path / "m2.parquet", "-q", "--writer-layout", "sideways")
    assert code == 2 and "sideways" in out


def test_report_names_the_engine_hazards(synth_root, scan_root):
    root, _ = synth_root({**SGL, "sgl_era": "e2", "tp": 2})
    result, _ = scan_root(root, flags={"kv_kind": "full", "model_name": "m"})
    code, out = run("report", result.output)
    text = " ".join(out.split())
    assert "rewrites its `_{r}_{N}` pages in place" in text and "only while that engine is stopped" in text
    assert "assumed writer layout layer_first (the default of every e1-e3 release), target layout page_first" in text
    for hazard in ("orders by mtime and evicts by unlink", "clear() deletes every regular file", "for its TTL"):
        assert hazard in text


def test_temp_files_carry_the_sglang_family_and_the_deployment_their_name_says(synth_root, tmp_path):
    # temp leftovers had no family (nor deployment) in the manifest and the report
    import pyarrow.parquet as pq

    root, (res,) = synth_root({"family": "sglang", "tp": 2, "blocks": 3, "layers": 2,
                               "defects": ("tmp_sglang", "tmp_sglang_old")})
    m = tmp_path / "m.parquet"
    code, out = run("scan", root, "-o", m, "-q")
    assert code & 10 == 0, out
    rows = {r["relpath"]: r for r in pq.read_table(m).to_pylist()}
    pages = {r["deployment"] for r in rows.values() if r["status"] == "ok"}
    (deployment,) = pages
    temps = {d["name"]: d["relpath"] for d in res.defects}
    new, old = rows[temps["tmp_sglang"]], rows[temps["tmp_sglang_old"]]
    assert new["status"] == old["status"] == "tmp_leftover"
    assert new["family"] == old["family"] == "sglang"
    assert old["deployment"] == deployment and old["model_name"] == rows[next(
        r for r in rows if rows[r]["status"] == "ok")]["model_name"]
    assert new["deployment"] is None  # `.<32 hex>.tmp` names no page
    assert new["source_base"] is None and old["source_base"] is None  # no page of a namespace: prune's residue
    code, out = run("report", m)
    outside = next(line for line in out.splitlines() if line.startswith("(outside namespaces)"))
    assert outside.split()[2] == "sglang", outside
