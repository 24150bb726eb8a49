"""The LMCache facts (spec lmcache.md §3.3) and the reachability verdicts they decide (§3.2
rules 2-4, in §4's order): each verdict with the facts that trigger it and its exit bit,
the FACTS.json key precedence `"<tier>:<model>"` > `"<tier>"` > `"<model>"` > `"*"`, bad
values, `"unset"`, lists of writer releases, the rerun hint, the `tmp_dir` fact, the
`kvmigrate facts` skeleton, and other families unaffected; on trees built by
`kvmigrate synth --family lmcache`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmigrate.errors import UsageError
from kvmigrate.identity.facts import FactsResolver
from kvmigrate.synth import SynthSpec, build

from helpers import SMALL
from helpers.cli_helpers import run

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROVEN = {"writer_release": "0.5.6", "pythonhashseed": "0"}  # a k3 name's recipe, proven equal


def synth_cli(root: Path, *args: str) -> None:
    rc, out = run("synth", root, "--family", "lmcache", "--layers", "2", "--block-tokens", "4", "--blocks", "3",
                  *args)
    assert rc == 0, out


def lmc(rows: dict) -> dict:
    return {k: r for k, r in rows.items() if r["family"] == "lmcache" and r["deployment"].count(":") > 2}


def statuses(rows: dict) -> set[str]:
    return {r["status"] for r in lmc(rows).values()}


def facts_file(tmp_path: Path, obj: dict) -> str:
    p = tmp_path / "FACTS.json"
    p.write_text(json.dumps(obj))
    return str(p)


@pytest.fixture
def fs_tier(tmp_path):
    root = tmp_path / "root"
    synth_cli(root, "--lmc-backend", "fs", "--lmc-era", "lmc-k3", "--tp", "2")
    return root


# --- rule 4: a <= 16-hex k3 name needs writer_release -------------------------------------


def test_without_facts_a_k3_name_asks_writer_release_and_the_seed(fs_tier, scan_root):
    _, rows = scan_root(fs_tier)
    got = lmc(rows)
    assert got and statuses(rows) == {"ok"}
    for r in got.values():
        assert r["action"] == "none" and r["finding"] == "needs_fact"
        assert r["asks"].split() == ["--writer-release", "--pythonhashseed"]


def test_with_the_seed_only_writer_release_is_asked(fs_tier, scan_root):
    _, rows = scan_root(fs_tier, flags={"pythonhashseed": "0"})
    assert {r["asks"] for r in lmc(rows).values()} == {"--writer-release"}


def test_proven_facts_leave_the_chunk_ok_without_a_finding(fs_tier, scan_root):
    _, rows = scan_root(fs_tier, flags=PROVEN)
    assert statuses(rows) == {"ok"}
    assert {r["finding"] for r in lmc(rows).values()} == {None}


def test_a_quoted_gds_name_proves_its_era_by_itself(tmp_path, scan_root):
    synth_cli(tmp_path / "r", "--lmc-backend", "gds", "--lmc-era", "lmc-k3", "--lmc-gds-names", "quoted")
    _, rows = scan_root(tmp_path / "r", flags={"pythonhashseed": "0"})
    # no needs_fact: every data file is read in place, its sidecar goes with it (part_of_action)
    assert {r["finding"] for r in lmc(rows).values()} <= {None, "part_of_action"}
    assert {r["action"] for r in lmc(rows).values() if not r["relpath"].endswith(".metadata")} == {"already_present"}


def test_a_sha256_seedless_chain_asks_the_vllm_release(fs_tier, scan_root):
    _, rows = scan_root(fs_tier, flags={"writer_release": "0.5.6", "pythonhashseed": "unset",
                                        "hash_algorithm": "sha256"})
    assert statuses(rows) == {"ok"}
    assert {r["asks"] for r in lmc(rows).values()} == {"--vllm-release"}


# --- rule 2: unreproducible_hash ------------------------------------------------------------


@pytest.mark.parametrize("flags", [
    {"pythonhashseed": "unset"},  # builtin: Python's str hash is random
    {"pythonhashseed": "random"},  # "random" = unset
    {"pythonhashseed": "unset", "hash_algorithm": "xxhash"},
    {"pythonhashseed": "unset", "hash_algorithm": "sha256", "vllm_release": "0.28.1"},
])
def test_a_random_none_hash_is_unreproducible(fs_tier, scan_root, flags):
    _, rows = scan_root(fs_tier, flags={"writer_release": "0.5.6", **flags})
    assert statuses(rows) == {"unreproducible_hash"}
    assert "seeded at random" in next(iter(lmc(rows).values()))["reason"]


def test_a_seedless_sha256_chain_under_vllm_029_is_reproducible(fs_tier, scan_root):
    _, rows = scan_root(fs_tier, flags={"writer_release": "0.5.6", "pythonhashseed": "unset",
                                        "hash_algorithm": "sha256", "vllm_release": "0.29.0"})
    assert statuses(rows) == {"ok"} and {r["finding"] for r in lmc(rows).values()} == {None}


def test_unreproducible_comes_before_index_lost(tmp_path, scan_root):
    synth_cli(tmp_path / "r", "--lmc-backend", "local_disk", "--lmc-era", "lmc-k3")
    _, rows = scan_root(tmp_path / "r", flags={"writer_release": "0.5.6", "pythonhashseed": "unset"})
    assert statuses(rows) == {"unreproducible_hash"}


# --- rule 3: stale_hash_recipe from the facts ------------------------------------------------


@pytest.mark.parametrize(("flags", "says"), [
    ({"target_pythonhashseed": "7"}, "setting the target's PYTHONHASHSEED to the writer's (0)"),
    ({"target_hash_algorithm": "sha256"}, "hash_algorithm builtin (writer) vs sha256 (target)"),
    ({"chunk_size": 256, "target_chunk_size": 512}, "chunk_size 256 (writer) vs 512 (target)"),
    ({"python_version": "3.10", "target_python_version": "3.12"}, "Python 3.10 (writer) vs 3.12 (target)"),
    ({"writer_release": "0.4.0"}, "chain era of 0.4.0"),
])
def test_a_recipe_component_that_differs_is_stale(fs_tier, scan_root, flags, says):
    _, rows = scan_root(fs_tier, flags={**PROVEN, **flags})
    assert statuses(rows) == {"stale_hash_recipe"}
    assert says in next(iter(lmc(rows).values()))["reason"]


def test_python_versions_on_one_side_of_311_agree(fs_tier, scan_root):
    _, rows = scan_root(fs_tier, flags={**PROVEN, "python_version": "3.11", "target_python_version": "3.12"})
    assert statuses(rows) == {"ok"}


def test_an_mp_chain_depends_only_on_chunk_size(tmp_path, scan_root):
    synth_cli(tmp_path / "r", "--lmc-backend", "mp", "--lmc-era", "lmc-mp1")
    _, rows = scan_root(tmp_path / "r", flags={"pythonhashseed": "unset"})
    assert statuses(rows) == {"ok"} and {r["finding"] for r in lmc(rows).values()} == {None}
    _, rows = scan_root(tmp_path / "r", flags={"chunk_size": 256, "target_chunk_size": 128})
    assert statuses(rows) == {"stale_hash_recipe"}


@pytest.mark.parametrize(("flags", "code"), [
    (PROVEN, 0),
    ({**PROVEN, "pythonhashseed": "unset"}, 1),
    ({**PROVEN, "target_pythonhashseed": "3"}, 1),
])
def test_exit_bits_of_the_verdicts(fs_tier, flags, code):
    args = [a for k, v in flags.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    rc, out = run("audit", fs_tier, *args)
    assert rc == code, out


def test_the_rerun_hint_names_the_flags(fs_tier):
    rc, out = run("audit", fs_tier)
    assert "--pythonhashseed <value> --writer-release <value>" in out


def test_assumed_facts_are_noted_with_their_flags(fs_tier):
    rc, out = run("audit", fs_tier, "--writer-release", "0.5.6", "--pythonhashseed", "0")
    assert "hash_algorithm assumed builtin" in out and "--hash-algorithm" in out
    assert "python_version assumed equal" in out and "--chunk-size" in out


def test_the_report_notes_a_seedless_writer_and_a_seed_a_target_setting_fixes(fs_tier):
    rc, out = run("audit", fs_tier, "--writer-release", "0.5.6", "--pythonhashseed", "5", "--target-pythonhashseed",
                  "6")
    assert rc == 1 and "start the target with PYTHONHASHSEED=5" in out, out
    rc, out = run("audit", fs_tier, "--writer-release", "0.5.6", "--pythonhashseed", "unset")
    assert rc == 1 and "seedless writer" in out, out


def test_a_seed_is_not_offered_as_the_fix_when_another_component_differs_too(fs_tier):
    """Setting the target's PYTHONHASHSEED reaches nothing when the algorithm differs as well:
    neither the row's reason nor the report's note may say it does."""
    rc, out = run("audit", fs_tier, "--writer-release", "0.5.6", "--pythonhashseed", "5", "--target-pythonhashseed",
                  "6", "--target-hash-algorithm", "sha256", "--json")
    assert rc == 1
    text = json.dumps(json.loads(out))
    assert "hash_algorithm builtin (writer) vs sha256 (target)" in text
    assert "makes the chunks reachable again" not in text and "start the target with PYTHONHASHSEED" not in text


# --- writer releases ------------------------------------------------------------------------


def test_a_list_of_releases_ignores_those_that_write_no_k3_names(fs_tier, scan_root):
    _, rows = scan_root(fs_tier, flags={"pythonhashseed": "0", "writer_release": "0.4.7,0.3.12"})
    assert statuses(rows) == {"ok"} and {r["finding"] for r in lmc(rows).values()} == {None}


def test_releases_of_two_chain_eras_prove_nothing(fs_tier, scan_root):
    ff = facts_file(fs_tier.parent, {"*": {"writer_release": ["0.4.7", "0.4.0"], "pythonhashseed": 0}})
    _, rows = scan_root(fs_tier, facts_file=ff)
    assert statuses(rows) == {"ok"}
    r = next(iter(lmc(rows).values()))
    assert r["finding"] == "needs_fact" and "different recipes" in r["reason"]


def test_releases_all_before_041_are_stale(fs_tier, scan_root):
    _, rows = scan_root(fs_tier, flags={"pythonhashseed": "0", "writer_release": "0.3.13,0.4.0"})
    assert statuses(rows) == {"stale_hash_recipe"}


# --- FACTS.json keys --------------------------------------------------------------------------


@pytest.mark.parametrize(("entries", "want"), [
    ({"cache:" + MODEL: {"pythonhashseed": "unset"}, "cache": {"pythonhashseed": 0}}, "unreproducible_hash"),
    ({"cache": {"pythonhashseed": "unset"}, MODEL: {"pythonhashseed": 0}}, "unreproducible_hash"),
    ({MODEL: {"pythonhashseed": "unset"}, "*": {"pythonhashseed": 0}}, "unreproducible_hash"),
    ({"*": {"pythonhashseed": "unset"}}, "unreproducible_hash"),
    ({"cache:" + MODEL: {"pythonhashseed": None}, "cache": {"pythonhashseed": "unset"}}, "unreproducible_hash"),
    ({"other:" + MODEL: {"pythonhashseed": "unset"}, "*": {"pythonhashseed": 0}}, "ok"),
])
def test_the_most_specific_key_wins(fs_tier, scan_root, entries, want):
    obj = {"*": {"writer_release": "0.5.6"}}
    for k, v in entries.items():
        obj[k] = {**obj.get(k, {}), **v}
    if "other:" + MODEL in obj:  # a key of a tier that does not exist is a typo
        obj.pop("other:" + MODEL)
    _, rows = scan_root(fs_tier, facts_file=facts_file(fs_tier.parent, obj))
    assert statuses(rows) == {want}


def test_flags_fill_the_gaps_of_facts_json(fs_tier, scan_root):
    ff = facts_file(fs_tier.parent, {"cache": {"writer_release": "0.5.6"}})
    _, rows = scan_root(fs_tier, facts_file=ff, flags={"pythonhashseed": "unset", "writer_release": "0.4.0"})
    assert statuses(rows) == {"unreproducible_hash"}  # the key's release, the flag's seed


def test_a_local_disk_model_key_matches_the_lossy_name(tmp_path, scan_root):
    synth_cli(tmp_path / "r", "--lmc-backend", "local_disk", "--lmc-era", "lmc-k3")
    ff = facts_file(tmp_path, {"cache:" + MODEL: {"writer_release": "0.5.6", "pythonhashseed": "unset"}})
    _, rows = scan_root(tmp_path / "r", facts_file=ff)
    assert statuses(rows) == {"unreproducible_hash"}


# --- bad values ---------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "value"), [
    ("pythonhashseed", "banana"), ("pythonhashseed", -1), ("pythonhashseed", 4294967296),
    ("target_pythonhashseed", "x"), ("hash_algorithm", "md5"), ("target_hash_algorithm", "sha1"),
    ("vllm_release", "latest"), ("python_version", "2"), ("chunk_size", 0), ("target_tp", -2),
    ("save_chunk_meta", "yes"),
    ("target_backend", "gds"), ("tmp_dir", "a/b"), ("target_model_name", ""),
])
def test_a_bad_value_is_a_usage_error_naming_the_key(tmp_path, name, value):
    ff = facts_file(tmp_path, {"cache": {name: value}})
    with pytest.raises(UsageError, match=f"entry 'cache': fact '{name}'"):
        FactsResolver({}, ff)


@pytest.mark.parametrize("bad", [["0.4.7", "new"], [], "0.4.7,", 4.7])
def test_a_list_of_releases_is_a_fact_a_bad_one_a_usage_error(tmp_path, bad):
    resolver = FactsResolver({"writer_release": "0.4.7,0.3.12"}, facts_file(tmp_path, {"cache": {
        "writer_release": ["0.5.6", "0.3.9.post2", "0.5.7rc2"]}}))
    assert resolver.for_tier("cache", None).writer_release == ("0.5.6", "0.3.9.post2", "0.5.7rc2")
    assert resolver.for_tier("other", None).writer_release == ("0.4.7", "0.3.12")
    with pytest.raises(UsageError, match="entry 'cache': fact 'writer_release' must be .*LMCache releases"):
        FactsResolver({}, facts_file(tmp_path, {"cache": {"writer_release": bad}}))


@pytest.mark.parametrize("args", [
    ("--pythonhashseed", "banana"), ("--hash-algorithm", "md5"), ("--python-version", "three"),
    ("--target-chunk-size", "0"), ("--tmp-dir", "a/b"), ("--target-backend", "gds"),
])
def test_a_bad_flag_exits_2(fs_tier, args):
    rc, out = run("audit", fs_tier, *args)
    assert rc == 2 and f"Invalid value for '{args[0]}'" in out, out


def test_a_bad_facts_json_value_exits_2_naming_the_key(fs_tier):
    ff = facts_file(fs_tier.parent, {"cache": {"pythonhashseed": "banana"}})
    rc, out = run("audit", fs_tier, "--facts", ff)
    assert rc == 2 and "entry 'cache': fact 'pythonhashseed' must be a seed" in out, out


def test_unset_and_null_differ(fs_tier, scan_root):
    _, rows = scan_root(fs_tier, facts_file=facts_file(fs_tier.parent, {"*": {**PROVEN, "pythonhashseed": None}}))
    assert statuses(rows) == {"ok"} and {r["asks"] for r in lmc(rows).values()} == {"--pythonhashseed"}
    _, rows = scan_root(fs_tier, facts_file=facts_file(fs_tier.parent, {"*": {**PROVEN, "pythonhashseed": "unset"}}))
    assert statuses(rows) == {"unreproducible_hash"}


# --- tmp_dir, chunk_size ----------------------------------------------------------------------


def test_the_tmp_dir_fact_makes_a_temp_folder_tmp_leftover(tmp_path, scan_root):
    res = build(tmp_path, SynthSpec(family="lmcache", lmc_backend="fs", lmc_era="lmc-k3", layers=2, block_tokens=4,
                                    blocks=3, defects=("tmp_dir",)))
    (d,) = res.defects
    _, rows = scan_root(tmp_path)
    assert {rows[rel]["status"] for rel in d["statuses"] if rel in rows} | {
        r["status"] for rel, r in rows.items() if "/lmcache_tmp/" in rel} == {"foreign"}
    _, rows = scan_root(tmp_path, flags={"tmp_dir": d["with_fact"]["tmp_dir"]})
    for rel, status in d["with_fact"]["statuses"].items():
        assert rows[rel]["status"] == status


def test_chunk_size_and_geometry_judge_raw_sizes(tmp_path, scan_root):
    """S = k·L·T·hidden·b (§2.4): with every chunk one size, the mode calls them whole;
    the facts say they are short of a 8-token chunk."""
    synth_cli(tmp_path / "r", "--lmc-backend", "local_disk", "--lmc-era", "lmc-k3", "--tp", "2")
    geometry = {"layers": 2, "total_kv_heads": 8, "head_dim": 4, "kv_kind": "full", **PROVEN}
    _, rows = scan_root(tmp_path / "r", flags={**geometry, "chunk_size": 4})
    assert statuses(rows) == {"index_lost"}
    _, rows = scan_root(tmp_path / "r", flags={**geometry, "chunk_size": 8})
    assert statuses(rows) == {"short"}
    _, rows = scan_root(tmp_path / "r", flags={**geometry, "chunk_size": 8, "save_unfull_chunk": True})
    assert statuses(rows) == {"index_lost"}


# --- kvmigrate facts --------------------------------------------------------------------------


def test_the_facts_skeleton_keys_a_tier_deployment_by_tier_and_model(fs_tier, tmp_path):
    rc, out = run("facts", fs_tier, "-o", tmp_path / "F.json")
    assert rc == 1, out
    skel = json.loads((tmp_path / "F.json").read_text())
    assert skel == {"cache:" + MODEL: {"pythonhashseed": None, "writer_release": None}}
    skel["cache:" + MODEL] = PROVEN
    (tmp_path / "F.json").write_text(json.dumps(skel))
    rc, out = run("facts", fs_tier, "--facts", tmp_path / "F.json")
    assert rc == 0 and '"writer_release": "0.5.6"' in out, out
    rc, out = run("audit", fs_tier, "--facts", tmp_path / "F.json")
    assert rc == 0 and "needs_fact" not in out and "--writer-release <value>" not in out


# --- other families ---------------------------------------------------------------------------


def test_lmcache_flags_leave_other_families_rows_and_facts_unchanged(tmp_path, scan_root):
    root = tmp_path / "root"
    for fam in ("vllm", "llmd", "vllmcpp", "sglang"):
        build(root, SynthSpec(**{**SMALL, "family": fam, "tp": 2}))
    res_a, a = scan_root(root)
    res_b, b = scan_root(root, flags={"pythonhashseed": "unset", "hash_algorithm": "sha256", "chunk_size": 3,
                                      "target_tp": 4, "tmp_dir": "x", "writer_release": "0.4.7,0.3.12"})
    keep = ("status", "action", "reason", "target_relpath", "finding", "asks")
    assert {k: {c: r[c] for c in keep} for k, r in a.items()} == {k: {c: r[c] for c in keep} for k, r in b.items()}


def test_the_rerun_hint_for_unproven_recipes_says_what_waits_for_the_facts(fs_tier):
    """The facts a `none` row asks for decide its verdict; the hint never says 'none can be planned'."""
    rc, out = run("audit", fs_tier)
    hint = next(line for line in out.splitlines() if "--writer-release" in line and "state" in line)
    assert "wait for them" in hint and "none can be planned" not in hint
