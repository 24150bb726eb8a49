"""Gate tables per target profile (identity.md §3): each condition of G1, G2, R and the
canonical widening flips the decision, for the deployment that wrote the cache, and the
failed condition is named in the reasons."""

from __future__ import annotations

import pytest

from kvmigrate.families import compute_target
from kvmigrate.identity import gates
from kvmigrate.identity.facts import Facts

BASE_FACTS = dict(kv_kind="full", total_kv_heads=8, model_dtype="bfloat16", runner="v1", executor="mp", nnodes=1,
                  per_token_head_quant=False)


def source(tp: int = 2, pp: int = 1, pcp: int = 1, dcp: int = 1, groups: int = 1, canonical: bool = False) -> dict:
    """A vLLM 0.26 (S2) identity of the deployment (0.28 S3 when canonical)."""
    fields = {"model_name": "org/model", "tp_size": tp, "pp_size": pp, "pcp_size": pcp, "dcp_size": dcp,
              "dtype": "auto", "tokens_per_hash": 16 * dcp, "blocks_per_file": 1, "inference_engine": "vllm",
              "kv_cache_groups": [{"tokens_per_block": 16 * dcp, "layer_names": [f"model.layers.{g}.attn"]}
                                  for g in range(groups)]}
    if canonical:
        fields.update(canonical_format="v1-nhd", parallel_agnostic=False, dtype="bfloat16")
    return fields


def decide(profile: str, deployment: dict, facts: dict):
    return compute_target(source(**deployment), "vllm", Facts(**{**BASE_FACTS, **facts}), profile)


AGNOSTIC_PROFILES = ("vllm-0.24", "vllm-0.26", "vllm-0.27", "vllm-0.28")

# (case, deployment, facts, reason fragment): each breaks exactly one G1 condition
G1_FLIPS = [
    ("runner-v2", {}, {"runner": "v2"}, "not agnostic: runner is v2"),
    ("two-groups", {"groups": 2}, {}, "not agnostic: 2 KV cache groups"),
    ("mla", {}, {"kv_kind": "mla", "executor": "ray"}, "not agnostic: kv kind is mla (MLA exclusion)"),
    ("sliding", {}, {"kv_kind": "sliding"}, "not agnostic: kv kind is sliding"),
    ("hybrid", {}, {"kv_kind": "hybrid"}, "not agnostic: kv kind is hybrid"),
    ("mamba", {}, {"kv_kind": "mamba"}, "not agnostic: kv kind is mamba"),
    ("kind-unknown", {}, {"kv_kind": None}, "not agnostic: kv kind unknown"),
]
# conditions G2 adds in 0.28 (G1 of 0.24-0.27 ignores them)
G2_FLIPS = [
    ("heads-not-divisible", {}, {"total_kv_heads": 3}, "not agnostic: tp 2 does not divide 3 total kv heads"),
    ("heads-unknown", {}, {"total_kv_heads": None}, "not agnostic: total kv heads unknown"),
    ("per-token-head-quant", {}, {"per_token_head_quant": True}, "not agnostic: per-token-head KV quantization"),
    ("dcp", {"dcp": 2}, {}, "not agnostic: dcp is 2"),
    ("pcp", {"pcp": 2}, {}, "not agnostic: pcp is 2"),
]


@pytest.mark.parametrize("profile", AGNOSTIC_PROFILES)
def test_full_attention_baseline_collapses(profile):
    target = decide(profile, {}, {})
    assert target.parallel_agnostic and not target.replicated_layout
    assert target.reasons == []
    assert target.fields["tp_size"] == 1
    assert "parallel_agnostic" not in target.fields


def test_vllm_022_never_collapses():
    target = decide("vllm-0.22", {}, {})
    assert not target.parallel_agnostic
    assert target.fields["tp_size"] == 2
    assert target.reasons == ["not agnostic: vllm-0.22 has no parallel-agnostic namespaces"]
    mla = decide("vllm-0.22", {}, {"kv_kind": "mla"})
    assert not mla.parallel_agnostic and not mla.replicated_layout


@pytest.mark.parametrize("profile", AGNOSTIC_PROFILES)
@pytest.mark.parametrize("case,deployment,facts,reason", G1_FLIPS, ids=[c[0] for c in G1_FLIPS])
def test_each_g1_condition_flips_the_decision(profile, case, deployment, facts, reason):
    target = decide(profile, deployment, facts)
    assert not target.parallel_agnostic
    assert target.fields["tp_size"] == 2
    assert any(r.startswith(reason) for r in target.reasons), target.reasons
    if profile in ("vllm-0.27", "vllm-0.28"):
        assert target.fields["parallel_agnostic"] is False


@pytest.mark.parametrize("case,deployment,facts,reason", G2_FLIPS, ids=[c[0] for c in G2_FLIPS])
def test_each_g2_condition_flips_the_decision_in_028(case, deployment, facts, reason):
    target = decide("vllm-0.28", deployment, facts)
    assert not target.parallel_agnostic
    assert any(r.startswith(reason) for r in target.reasons), target.reasons


@pytest.mark.parametrize("profile", ("vllm-0.24", "vllm-0.26", "vllm-0.27"))
@pytest.mark.parametrize("case,deployment,facts,reason", G2_FLIPS, ids=[c[0] for c in G2_FLIPS])
def test_g2_conditions_do_not_apply_before_028(profile, case, deployment, facts, reason):
    assert decide(profile, deployment, facts).parallel_agnostic


def test_gate_runs_at_the_writers_tp_not_a_smaller_reader_tp():
    # a TP=8 cache of a 4-KV-head model fails G2 at tp=8, although tp=4 would pass
    assert not decide("vllm-0.28", {"tp": 8}, {"total_kv_heads": 4}).parallel_agnostic
    assert decide("vllm-0.28", {"tp": 4}, {"total_kv_heads": 4}).parallel_agnostic


# --- R, the replicated-layout gate (0.27+) ------------------------------------------------------

MLA = {"kv_kind": "mla", "total_kv_heads": 128}
R_FLIPS = [
    ("kind-hybrid", {}, {"kv_kind": "hybrid"}, "not replicated: kv kind is hybrid"),
    ("kind-unknown", {}, {"kv_kind": None}, "not replicated: kv kind unknown"),
    ("two-groups", {"groups": 2}, {}, "not replicated: 2 KV cache groups"),
    ("tp1", {"tp": 1}, {}, "not replicated: tp is 1"),
    ("pp", {"pp": 2}, {}, "not replicated: pp is 2"),
    ("pcp", {"pcp": 2}, {}, "not replicated: pcp is 2"),
    ("dcp", {"dcp": 2}, {}, "not replicated: dcp is 2"),
    ("executor-ray", {}, {"executor": "ray"}, "not replicated: executor is ray"),
    ("two-nodes", {}, {"nnodes": 2}, "not replicated: 2 nodes per data-parallel replica"),
]


@pytest.mark.parametrize("profile", ("vllm-0.27", "vllm-0.28"))
def test_mla_baseline_passes_r(profile):
    target = decide(profile, {}, MLA)
    assert target.parallel_agnostic and target.replicated_layout
    assert target.fields["replicated_layout"] is True
    assert target.fields["tp_size"] == 1 and "parallel_agnostic" not in target.fields
    assert target.rank_dir.endswith("_r0")


@pytest.mark.parametrize("profile", ("vllm-0.24", "vllm-0.26"))
def test_profiles_before_027_have_no_r(profile):
    target = decide(profile, {}, MLA)
    assert not target.parallel_agnostic and not target.replicated_layout
    assert "replicated_layout" not in target.fields
    assert not any(r.startswith("not replicated") for r in target.reasons)


@pytest.mark.parametrize("profile", ("vllm-0.27", "vllm-0.28"))
@pytest.mark.parametrize("case,deployment,facts,reason", R_FLIPS, ids=[c[0] for c in R_FLIPS])
def test_each_r_condition_flips_the_decision(profile, case, deployment, facts, reason):
    target = decide(profile, deployment, {**MLA, **facts})
    assert not target.replicated_layout
    assert not target.parallel_agnostic
    assert "replicated_layout" not in target.fields
    assert any(r.startswith(reason) for r in target.reasons), target.reasons


def test_r_defaults_are_assumed_and_reported():
    target = compute_target(source(), "vllm", Facts(kv_kind="mla", model_dtype="bfloat16"), "vllm-0.28")
    assert target.replicated_layout
    assert target.assumed_facts == {"runner": "v1", "per_token_head_quant": False, "executor": "mp", "nnodes": 1}


# --- canonical-layout widening (0.28, sources carrying canonical_format) -----------------------

CANON_BASE = {**MLA, "executor": "ray"}  # R fails, so only the widening can collapse
CANON_FLIPS = [
    ("runner-v2", {}, {"runner": "v2"}, "not agnostic (canonical layout): runner is v2"),
    ("sliding", {}, {"kv_kind": "sliding"}, "not agnostic (canonical layout): kv kind is sliding"),
    ("pp", {"pp": 2}, {}, "not agnostic (canonical layout): world size 4 is not tp 2"),
    ("dcp", {"dcp": 2}, {}, "not agnostic (canonical layout): dcp is 2"),
]


def test_canonical_widening_admits_plain_mla():
    target = decide("vllm-0.28", {"canonical": True}, CANON_BASE)
    assert target.parallel_agnostic and not target.replicated_layout
    assert target.fields["canonical_format"] == "v1-nhd"
    assert not decide("vllm-0.28", {}, CANON_BASE).parallel_agnostic


@pytest.mark.parametrize("case,deployment,facts,reason", CANON_FLIPS, ids=[c[0] for c in CANON_FLIPS])
def test_each_canonical_widening_condition_flips_the_decision(case, deployment, facts, reason):
    target = decide("vllm-0.28", {"canonical": True, **deployment}, {**CANON_BASE, **facts})
    assert not target.parallel_agnostic
    assert any(r.startswith(reason) for r in target.reasons), target.reasons


def test_gate_functions_return_one_reason_per_failed_condition():
    dep = gates.Deployment(tp=3, pp=2, pcp=2, dcp=2, num_groups=2)
    passed, reasons = gates.replicated_gate(dep, Facts(kv_kind="full", executor="ray", nnodes=2), {})
    assert not passed
    assert len(reasons) == 7  # kind, groups, pp, pcp, dcp, executor, nnodes (tp 3 > 1 passes)
    assert sum(r.startswith("not replicated: ") for r in reasons) == len(reasons)
    passed, reasons = gates.g2(dep, Facts(kv_kind="sliding", total_kv_heads=8, runner="v2",
                                          per_token_head_quant=True), {})
    assert not passed
    assert len(reasons) == 7  # runner, groups, kind, heads, quant, dcp, pcp


@pytest.mark.parametrize("deployment,unknown,missing,decisive", [
    # tp=1 full attention: both unknown facts could collapse it (G2), the defaults it rests on are named
    ({"tp": 1}, ("kv_kind", "total_kv_heads"), ["kv_kind", "total_kv_heads"], {}),
    ({"tp": 1}, ("kv_kind",), ["kv_kind"], {}),
    ({"tp": 1}, (), [], {"runner": "v1", "per_token_head_quant": False}),
    # two groups fail every gate whatever the kv kind: nothing to ask
    ({"tp": 2, "groups": 2}, ("kv_kind", "total_kv_heads"), [], {}),
    # dcp 2 fails G2 and R: the kv kind changes nothing in 0.28
    ({"tp": 2, "dcp": 2}, ("kv_kind",), [], {}),
])
def test_a_target_is_a_guess_only_where_an_unstated_fact_changes_it(deployment, unknown, missing, decisive):
    """Issue 16.6: a target is a guess when a fact not given could change the gate decision,
    and rests on the assumed defaults that another value would change; never otherwise."""
    facts = {**BASE_FACTS, "runner": None, "executor": None, "nnodes": None, "per_token_head_quant": None,
             **{name: None for name in unknown}}
    target = decide("vllm-0.28", deployment, facts)
    assert target.missing_facts == missing
    assert target.decisive_assumptions == decisive


def test_conditions_are_every_check_and_their_failures_are_the_reasons():
    """kvmigrate explain lists each condition: the failed ones are exactly the decision's
    reasons (in order), for every profile and a grid of deployments and facts."""
    from itertools import product

    for profile, tp, groups, kind, heads, runner, canonical in product(
            gates.PROFILE_GATES, (1, 2, 3), (1, 2), (None, "full", "mla", "sliding"), (None, 8), ("v1", "v2"),
            (False, True)):
        dep = gates.Deployment(tp=tp, num_groups=groups, canonical=canonical)
        facts = Facts(kv_kind=kind, total_kv_heads=heads, runner=runner)
        conds: list = []
        decision = gates.evaluate(profile, dep, facts, conds)
        assert decision == gates.evaluate(profile, dep, facts)  # collecting changes nothing
        if gates.PROFILE_GATES[profile][0] is None:
            assert conds == []
            continue
        failed = [c.reason for c in conds if not c.passed]
        assert all(c.reason == "" for c in conds if c.passed)
        if not decision.parallel_agnostic:
            assert failed == decision.reasons, (profile, dep, facts)
        assert {c.gate for c in conds} >= {gates.PROFILE_GATES[profile][0]}
