"""The LMCache report (spec lmcache.md §7): `--target lmcache-*` beside the other families,
the per-tier section (per tier, then per deployment: backend, scheme, model, ws, dtype,
the hash-recipe comparison with each fact's source, counts by status and action, what
each prune class could reclaim), §7's notes as typed findings and hints, `explain` of a
deployment, and their JSON against docs/schema; on trees built by `kvmigrate synth
--family lmcache` (and `--family vllm` beside them)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvmigrate import manifest
from kvmigrate.formats import lmcache as L
from kvmigrate.synth import SynthSpec, build

from helpers import SMALL
from helpers.cli_helpers import run, run_json
from helpers.schema_check import errors

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LMC = dict(family="lmcache", layers=2, block_tokens=4, blocks=4)
PROVEN = ["--writer-release", "0.5.6", "--pythonhashseed", "0"]
VLLM = ["--kv-kind", "full", "--model-dtype", "bfloat16"]
SCHEMA = Path(__file__).resolve().parents[2] / "docs" / "schema"


def synth(root: Path, **kw):
    return build(root, SynthSpec(**{**LMC, **kw}))


def scan(root: Path, tmp_path: Path, *args: str, name: str = "m.parquet") -> Path:
    out = tmp_path / name
    rc, text = run("scan", root, "-o", out, "-q", *args)
    assert rc in (0, 1, 5), text  # (5: residue is an integrity finding)
    return out


def report(m: Path) -> dict:
    rc, summary = run_json("report", m)
    return summary


def tier(summary: dict, name: str) -> dict:
    return next(t for t in summary["tiers"] if t["tier"] == name)


def deployment(summary: dict, tier_name: str, backend: str | None = None) -> dict:
    return next(d for d in tier(summary, tier_name)["deployments"] if backend in (None, d["backend"]))


def notes(summary: dict, code: str) -> list[dict]:
    return [f for f in summary["findings"] if f["code"] == code]


def schema(command: str) -> dict:
    return json.loads((SCHEMA / f"{command}.json").read_text())


# --- --target lmcache-* ------------------------------------------------------------------


@pytest.fixture
def mixed(tmp_path):
    """A vLLM S2 TP=2 namespace, a vllm.cpp one and an SGLang deployment beside an fs tier `lmc`."""
    root = tmp_path / "root"
    build(root, SynthSpec(**{**SMALL, "family": "vllm", "scheme": "S2", "tp": 2}))
    build(root, SynthSpec(**{**SMALL, "family": "vllmcpp", "model_name": "org/cpp"}))
    build(root, SynthSpec(**{**SMALL, "family": "sglang", "model_name": "org/sgl"}))
    synth(root, lmc_backend="fs", lmc_era="lmc-k3", tp=2, lmc_tier="lmc")
    return root


def _targets(m: Path) -> dict[str, tuple]:
    meta = manifest.read_metadata(m)
    return {b: ((n["target"] or {}).get("profile"), (n["target"] or {}).get("base_name"))
            for b, n in meta["namespaces"].items()}


def test_an_lmcache_target_leaves_the_tree_families_on_the_default_vllm_profile(mixed, tmp_path):
    default = _targets(scan(mixed, tmp_path, *VLLM, name="d.parquet"))
    rc2 = _targets(scan(mixed, tmp_path, *VLLM, "--target", "lmcache-0.5.7rc2", name="r.parquet"))
    assert default.keys() == rc2.keys()
    profiles = set()
    for base, (profile, name) in rc2.items():
        if base.startswith("lmcache:"):
            assert profile == "lmcache-0.5.7rc2" and default[base][0] == "lmcache-0.5.6"
        else:  # every other namespace: the same target as without --target
            assert (profile, name) == default[base], base
            profiles.add(profile)
    assert profiles == {"vllm-0.34", "vllmcpp", "sglang-0.5.23"}


@pytest.mark.parametrize("command", ["audit", "migrate", "prune", "facts", "verify"])
def test_every_command_offering_target_takes_an_lmcache_profile(mixed, tmp_path, command):
    extra = ["-o", tmp_path / "F.json"] if command == "facts" else []
    rc, out = run(command, mixed, *VLLM, "--target", "lmcache-0.5.7rc2", *extra) if command != "verify" else \
        run(command, mixed, "--target", "lmcache-0.5.7rc2")
    assert rc != 2, out


def test_identity_of_a_vllm_config_under_an_lmcache_target_is_the_default_profile(mixed):
    config = next(mixed.glob("*/config.json"))
    rc, out = run_json("identity", config, *VLLM, "--target", "lmcache-0.5.7rc2")
    assert rc == 0 and out["target"]["profile"] == "vllm-0.34"


def test_the_report_header_shows_the_tree_profile_and_the_tiers(mixed, tmp_path):
    m = scan(mixed, tmp_path, *VLLM, "--target", "lmcache-0.5.7rc2")
    rc, text = run("report", m)
    head = text.split("TOTALS")[0]
    assert "target profile        vllm-0.34" in head, head
    assert "LMCache tiers target  lmcache-0.5.7rc2 (1 tier)" in head, head


# --- the tier section --------------------------------------------------------------------


@pytest.fixture
def two_tiers(tmp_path):
    """An fs tier `hot` with residue (a temp, a zero-filled and a torn chunk) and a
    local_disk tier `disk`."""
    root = tmp_path / "root"
    hot = synth(root, lmc_backend="fs", lmc_era="lmc-k3", tp=2, lmc_tier="hot", blocks=4,
                defects=("tmp", "zero_filled", "short"))
    disk = synth(root, lmc_backend="local_disk", lmc_era="lmc-k3", tp=2, lmc_tier="disk", blocks=3)
    return root, hot, disk


def _size(root: Path, rels) -> int:
    return sum((root / r).stat().st_size for r in rels)


def test_each_tier_lists_its_deployments_with_their_counts(two_tiers, tmp_path):
    root, hot, disk = two_tiers
    s = report(scan(root, tmp_path, *PROVEN))
    assert [t["tier"] for t in s["tiers"]] == ["disk", "hot"]
    d = deployment(s, "hot")
    assert (d["backend"], d["scheme"], d["model"], d["ws"], d["dtype"]) == ("fs", "lmc-k3", MODEL, 2, "bfloat16")
    assert d["target_profile"] == "lmcache-0.5.6" and d["target_base"] == d["deployment"]
    ns = next(n for n in s["namespaces"] if n["source_base"] == d["deployment"])
    assert d["by_status"] == ns["by_status"] and d["by_action"] == ns["by_action"]
    assert set(d["by_status"]) == {"ok", "zero_filled", "short"}
    ld = deployment(s, "disk")
    assert (ld["backend"], ld["model"], ld["ws"]) == ("local_disk", MODEL.replace("/", "-"), 2)
    assert ld["by_status"] == {"index_lost": {"files": 6, "bytes": _size(root, [r for b in disk.blocks
                                                                               for r in b["files"].values()])}}


def test_reclaimable_per_class_makes_the_local_disk_leak_visible(two_tiers, tmp_path):
    root, hot, disk = two_tiers
    s = report(scan(root, tmp_path, *PROVEN))
    residue = [r for d in hot.defects for r in d["rows"]]
    assert tier(s, "hot")["reclaimable"] == {
        "residue": {"files": len(residue), "bytes": _size(root, residue)},
        "index_lost": {"files": 0, "bytes": 0}, "unreadable_namespaces": {"files": 0, "bytes": 0}}
    lost = [r for b in disk.blocks for r in b["files"].values()]
    assert tier(s, "disk")["reclaimable"]["index_lost"] == {"files": 6, "bytes": _size(root, lost)}
    # the temp is the tier's, not its deployment's
    assert deployment(s, "hot")["reclaimable"]["residue"]["files"] == len(residue) - 1
    assert tier(s, "hot")["other_files"] == {"tmp_leftover": {"files": 1, "bytes": _size(root, hot.defects[0]["rows"])}}


def test_a_deployment_of_unreproducible_chunks_is_an_unreadable_namespace(tmp_path):
    root = tmp_path / "root"
    synth(root, lmc_backend="fs", lmc_era="lmc-k3", tp=2, lmc_tier="old", blocks=3)
    s = report(scan(root, tmp_path, "--writer-release", "0.5.6", "--pythonhashseed", "unset"))
    d = deployment(s, "old")
    assert d["by_status"].keys() == {"unreproducible_hash"}
    assert d["reclaimable"]["unreadable_namespaces"] == d["by_status"]["unreproducible_hash"]
    assert tier(s, "old")["reclaimable"]["unreadable_namespaces"] == d["by_status"]["unreproducible_hash"]


def _recipe(d: dict) -> dict[str, dict]:
    return {c["component"]: c for c in d["recipe"]}


def test_the_recipe_comparison_names_each_facts_source(tmp_path):
    root = tmp_path / "root"
    synth(root, lmc_backend="fs", lmc_era="lmc-k3", tp=2, lmc_tier="hot", blocks=3)
    facts = tmp_path / "FACTS.json"
    facts.write_text(json.dumps({f"hot:{MODEL}": {"hash_algorithm": "sha256_cbor", "chunk_size": 256},
                                 "*": {"writer_release": "0.5.6"}}))
    s = report(scan(root, tmp_path, "--facts", facts, "--pythonhashseed", "7", "--target-chunk-size", "256",
                    "--vllm-release", "0.30.0"))
    r = _recipe(deployment(s, "hot"))
    assert r["hash_algorithm"] | {} == {"component": "hash_algorithm", "writer": "sha256_cbor",
                                        "writer_source": f"facts:hot:{MODEL}", "target": "sha256_cbor",
                                        "target_source": "assumed: the writer's", "equal": True}
    assert (r["chunk_size"]["writer_source"], r["chunk_size"]["target_source"], r["chunk_size"]["equal"]) == (
        f"facts:hot:{MODEL}", "flag", True)
    assert r["chain era (writer_release)"]["writer_source"] == "facts:*"
    assert r["chain era (writer_release)"]["equal"] is True
    seed = r["NONE_HASH (PYTHONHASHSEED)"]
    assert (seed["writer"], seed["writer_source"], seed["equal"]) == ("PYTHONHASHSEED=7: NONE_HASH seed 7", "flag",
                                                                      True)
    assert r["vLLM release"]["writer"] == "0.30.0"


def test_a_differing_component_is_marked_in_the_comparison(tmp_path):
    root = tmp_path / "root"
    synth(root, lmc_backend="fs", lmc_era="lmc-k3", tp=2, lmc_tier="hot", blocks=3)
    s = report(scan(root, tmp_path, *PROVEN, "--target-hash-algorithm", "xxhash"))
    r = _recipe(deployment(s, "hot"))
    assert r["hash_algorithm"]["equal"] is False and r["hash_algorithm"]["target_source"] == "flag"
    rc, text = run("explain", tmp_path / "m.parquet", deployment(s, "hot")["deployment"])
    assert "[DIFFERS] writer builtin" in text


def test_an_mp_tier_compares_chunk_size_only(tmp_path):
    root = tmp_path / "root"
    synth(root, lmc_backend="mp", lmc_era="lmc-mp1", tp=2, lmc_tier="mp", blocks=3)
    s = report(scan(root, tmp_path, "--chunk-size", "256", "--target-chunk-size", "512"))
    r = _recipe(deployment(s, "mp"))
    assert r["hash_algorithm"]["writer"] == "blake3" and r["chunk_size"]["equal"] is False


def test_every_format_prints_the_tier_section(two_tiers, tmp_path):
    root, _, _ = two_tiers
    m = scan(root, tmp_path, *PROVEN)
    label = f"lmcache:disk:local_disk:{MODEL.replace('/', '-')}:lmc-k3:ws2:bfloat16"
    rc, text = run("report", m)
    assert "LMCACHE TIERS" in text and "tier disk" in text and "NONE_HASH (PYTHONHASHSEED)" in text
    assert "--index-lost" in text.split("LMCACHE TIERS")[1]
    rc, md = run("report", m, "--format", "md")
    assert "## LMCache tiers" in md and "### tier disk" in md and f"#### `{label}`" in md
    rc, html = run("report", m, "--format", "html")
    assert 'id="t-tiers"' in html and 'id="t-recipe-' in html


# --- §7's notes ---------------------------------------------------------------------------


def test_assumed_facts_are_a_typed_note_with_their_flags(tmp_path):
    root = tmp_path / "root"
    synth(root, lmc_backend="fs", lmc_era="lmc-k3", tp=2, lmc_tier="hot", blocks=3)
    s = report(scan(root, tmp_path, *PROVEN))
    (f,) = notes(s, "assumed_facts")
    assert f["assumed"] == {"hash_algorithm": "builtin", "python_version": "equal for writer and target",
                            "chunk_size": "equal for writer and target"}
    assert "--hash-algorithm" in f["message"] and "--target-chunk-size" in f["message"]
    assert not [n for n in s["findings"] if n["code"] == "note" and "assumed" in n["message"]]


def test_a_local_disk_tier_note_names_the_conversion_and_prune_index_lost(two_tiers, tmp_path):
    root, _, disk = two_tiers
    s = report(scan(root, tmp_path, *PROVEN))
    (f,) = notes(s, "lmcache_local_disk")
    assert f["files"] == 6 and "--target-backend fs --dest DIR" in f["message"]
    cmds = [h["command"] for h in s["hints"] if "lmcache_local_disk" in h["codes"]]
    assert any(c.startswith(f"kvmigrate migrate {root} ") and c.endswith("--target-backend fs --dest <DIR>")
               for c in cmds), cmds
    assert any(c.startswith(f"kvmigrate prune {root} ") and "--index-lost --engine-stopped" in c for c in cmds), cmds


def test_a_seedless_writer_is_noted(tmp_path):
    root = tmp_path / "root"
    synth(root, lmc_backend="fs", lmc_era="lmc-k3", tp=2, lmc_tier="hot", blocks=3)
    s = report(scan(root, tmp_path, "--writer-release", "0.5.6", "--pythonhashseed", "unset"))
    (f,) = notes(s, "lmcache_seedless")
    assert "seeded at random" in f["message"]
    # a seedless sha256 chain under vLLM 0.29+ is reproducible: the note says so
    s = report(scan(root, tmp_path, "--writer-release", "0.5.6", "--pythonhashseed", "unset", "--hash-algorithm",
                    "sha256", "--vllm-release", "0.30.0", name="b.parquet"))
    (f,) = notes(s, "lmcache_seedless")
    assert "vllm-none-hash" in f["message"] and not notes(s, "unreproducible_hash")


def test_a_seed_a_target_setting_fixes_is_noted_with_the_rerun(tmp_path):
    root = tmp_path / "root"
    synth(root, lmc_backend="fs", lmc_era="lmc-k3", tp=2, lmc_tier="hot", blocks=3)
    s = report(scan(root, tmp_path, "--writer-release", "0.5.6", "--pythonhashseed", "5", "--target-pythonhashseed",
                    "6"))
    (f,) = notes(s, "lmcache_seed_fix")
    assert f["files"] == 6 and "PYTHONHASHSEED=5" in f["message"]
    (h,) = [h for h in s["hints"] if "lmcache_seed_fix" in h["codes"]]
    assert "--target-pythonhashseed 5" in h["command"] and "--target-pythonhashseed 6" not in h["command"]
    assert deployment(s, "hot")["seed_fix_files"] == 6


def test_a_corrupt_sidecar_is_noted(tmp_path):
    root = tmp_path / "root"
    synth(root, lmc_backend="gds", lmc_era="lmc-k3", tp=2, lmc_tier="gds", blocks=3, defects=("corrupt_sidecar",))
    s = report(scan(root, tmp_path, *PROVEN))
    (f,) = notes(s, "lmcache_corrupt_sidecar")
    assert f["files"] == 1 and "the server still starts" in f["message"]
    assert tier(s, "gds")["reclaimable"]["residue"]["files"] == 2  # the sidecar and its orphaned data file


def test_a_64_hex_fs_name_starting_with_0_is_noted(tmp_path):
    root = tmp_path / "root"
    res = synth(root, lmc_backend="fs", lmc_era="lmc-k3", tp=1, lmc_tier="hot", blocks=3)
    src = root / res.blocks[0]["files"][0]
    key = L.parse_name(src.name).key
    digest = "0" + "ab" * 31 + "c"  # a 0.4.1-0.4.5 sha256 digest kept whole
    shutil.copyfile(src, src.with_name(src.name.replace(f"@{key.hash}@", f"@{digest}@")))
    s = report(scan(root, tmp_path, *PROVEN))
    (f,) = notes(s, "lmcache_fs_zero_hex64")
    assert f["files"] == 1 and "/cache/load-fs-chunks" in f["message"]


def test_target_rc2_under_the_in_tree_connector_is_noted_for_in_process_tiers_only(tmp_path):
    root = tmp_path / "root"
    synth(root, lmc_backend="fs", lmc_era="lmc-k3", tp=2, lmc_tier="hot", blocks=3)
    synth(root, lmc_backend="mp", lmc_era="lmc-mp1", tp=2, lmc_tier="mp", blocks=3)
    s = report(scan(root, tmp_path, *PROVEN, "--target", "lmcache-0.5.7rc2"))
    assert [f["namespace"] for f in notes(s, "lmcache_rc2_in_tree_connector")] == [deployment(s, "hot")["deployment"]]
    assert "ImportError" in notes(s, "lmcache_rc2_in_tree_connector")[0]["message"]
    assert not notes(report(scan(root, tmp_path, *PROVEN, name="d.parquet")), "lmcache_rc2_in_tree_connector")


def test_an_mp_tier_notes_that_fs_native_usage_restarts_at_0(tmp_path):
    root = tmp_path / "root"
    synth(root, lmc_backend="mp", lmc_era="lmc-mp1", tp=2, lmc_tier="mp", blocks=3)
    s = report(scan(root, tmp_path))
    (f,) = notes(s, "lmcache_fs_native_usage")
    d = deployment(s, "mp")
    assert (f["files"], f["bytes"]) == (d["files"], d["bytes"]) and "#4564" in f["message"]


# --- explain, JSON schema -------------------------------------------------------------------


def test_explain_a_deployment_shows_its_recipe_target_and_counts(two_tiers, tmp_path):
    root, _, _ = two_tiers
    m = scan(root, tmp_path, *PROVEN)
    s = report(m)
    d = deployment(s, "disk")
    rc, out = run_json("explain", m, d["deployment"])
    assert rc == 0 and out["tier"] == {"tier": "disk", "deployment": d}
    assert errors(out, schema("explain")) == []
    rc, text = run("explain", m, d["deployment"])
    assert "hash recipe (writer vs target):" in text
    assert f"target names {d['target_base']} (lmcache-0.5.6)" in text and "files        index_lost 6" in text
    assert "NONE_HASH (PYTHONHASHSEED)  [=] writer PYTHONHASHSEED=0: NONE_HASH seed 0 (flag)" in text


def test_the_json_of_report_and_audit_matches_the_schema(two_tiers, tmp_path):
    root, _, _ = two_tiers
    m = scan(root, tmp_path, *PROVEN)
    assert errors(report(m), schema("report")) == []
    rc, audit = run_json("audit", root, *PROVEN)
    assert audit["tiers"] and errors(audit, schema("report")) == []  # (audit --json: the report's model)
