"""Our own port of the cases of upstream vLLM's tests/v1/kv_offload/test_file_mapper.py
(the executable specification of identity.md §3), run against kvmigrate's engine:
`gates.engine_flags` (what FileMapper does with the caller's opt-in and the config's
verdicts) feeding `schemes.filemapper` (the fields function), and, where the verdict is a
gate, `compute_target` for the writer's deployment."""

from __future__ import annotations

import pytest

from kvmigrate.families import compute_target
from kvmigrate.identity import gates, schemes
from kvmigrate.identity.facts import Facts

ROOT = "/tmp/cache"


def make_mapper(version: str = "main", *, model_name: str = "test-model", dtype: str = "float16",
                groups: tuple = (), tokens_per_hash: int = 16, blocks_per_chunk: int = 1, rank: int = 0,
                tp_size: int = 1, pp_size: int = 1, pcp_size: int = 1, dcp_size: int = 1,
                is_parallelism_agnostic: bool = False, replicated_layout: bool = False,
                canonical_layout: bool = False, storage_format: str | None = None,
                opt_in: bool = False) -> schemes.FileMapper:
    """The engine side: opt-in and config verdicts -> flags -> fields function."""
    agnostic, replicated = gates.engine_flags(version, opt_in=opt_in, is_parallelism_agnostic=is_parallelism_agnostic,
                                              replicated_config=replicated_layout)
    return schemes.filemapper(
        version, model_name=model_name, tp_size=tp_size, pp_size=pp_size, pcp_size=pcp_size, dcp_size=dcp_size,
        dtype=dtype, rank=rank, parallel_agnostic=agnostic, replicated_layout=replicated,
        kv_cache_groups=[{"tokens_per_block": t, "layer_names": [name]} for t, name in groups],
        tokens_per_hash=tokens_per_hash, blocks_per_file=blocks_per_chunk,
        canonical_format="v1-nhd" if canonical_layout else None, storage_format=storage_format)


def file_name(mapper: schemes.FileMapper, block_hash: bytes, group: int) -> str:
    return f"{ROOT}/{mapper.block_relpath(block_hash.hex(), group)}"


def base_path(mapper: schemes.FileMapper) -> str:
    return f"{ROOT}/{mapper.base_name}"


def test_file_name_full_structure():
    fm = make_mapper(rank=3)
    assert file_name(fm, bytes(range(8)), 2) == "/tmp/cache/test-model_de3bba26cf36_r3/000/10_g2/0001020304050607.bin"


def test_run_config_fields():
    fm = make_mapper(model_name="my-model", dtype="bfloat16", tp_size=4, pp_size=3, pcp_size=2, dcp_size=2,
                     groups=((64, "layer0"),), tokens_per_hash=64, blocks_per_chunk=3)
    assert fm.fields == {
        "model_name": "my-model", "tokens_per_hash": 64, "blocks_per_file": 3, "tp_size": 4, "pp_size": 3,
        "pcp_size": 2, "dcp_size": 2, "dtype": "bfloat16",
        "kv_cache_groups": [{"tokens_per_block": 64, "layer_names": ["layer0"]}],
        "inference_engine": "vllm", "parallel_agnostic": False,
    }


def test_config_file_lives_in_base_folder():
    fm = make_mapper()
    assert f"{base_path(fm)}/config.json" == "/tmp/cache/test-model_de3bba26cf36/config.json"


def test_hybrid_identity_records_resolved_tokens_per_hash():
    fm = make_mapper(groups=((12, "full_layer"), (16, "mla_layer")), tokens_per_hash=4)
    assert fm.fields["tokens_per_hash"] == 4
    assert fm.fields["kv_cache_groups"] == [{"tokens_per_block": 12, "layer_names": ["full_layer"]},
                                            {"tokens_per_block": 16, "layer_names": ["mla_layer"]}]


def test_hybrid_target_tokens_per_hash_is_gcd_of_groups():
    # our engine's side of the same rule: an S1 hybrid hashed at 4 maps onto tokens_per_hash gcd(12, 16) = 4
    src = {"model_name": "hybrid", "tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "dtype": "bfloat16",
           "hash_block_size": 4, "gpu_blocks_per_file": 1, "inference_engine": "vllm",
           "kv_cache_groups": [{"block_size": 12, "layer_names": ["full_layer"]},
                               {"block_size": 16, "layer_names": ["mla_layer"]}]}
    target = compute_target(src, "vllm", Facts(kv_kind="hybrid"), "vllm-0.28")
    assert target.fields["tokens_per_hash"] == 4
    assert target.unreachable is None


# --- parallel_agnostic: the opt-in is honoured only when the config allows it ------------------

def test_parallel_agnostic_collapses_namespace_when_config_allows():
    fm = make_mapper(tp_size=4, pp_size=3, pcp_size=2, dcp_size=2, rank=1, is_parallelism_agnostic=True, opt_in=True)
    assert [fm.fields[k] for k in ("tp_size", "pp_size", "pcp_size", "dcp_size")] == [1, 1, 1, 1]
    assert fm.rank == 0
    assert "parallel_agnostic" not in fm.fields


def test_parallel_agnostic_ignored_when_config_disallows():
    fm = make_mapper(tp_size=2, rank=1, is_parallelism_agnostic=False, opt_in=True)
    assert fm.fields["tp_size"] == 2
    assert fm.rank == 1
    assert fm.fields["parallel_agnostic"] is False


def test_namespace_kept_without_opt_in():
    fm = make_mapper(tp_size=2, rank=1, is_parallelism_agnostic=True, opt_in=False)
    assert fm.fields["tp_size"] == 2
    assert fm.rank == 1
    assert fm.fields["parallel_agnostic"] is False


def test_agnostic_and_specific_are_different_base_paths():
    agnostic = make_mapper(is_parallelism_agnostic=True, opt_in=True)
    specific = make_mapper(is_parallelism_agnostic=False, opt_in=True)
    assert base_path(agnostic) != base_path(specific)
    assert "parallel_agnostic" not in agnostic.fields
    assert specific.fields["parallel_agnostic"] is False


def test_mla_exclusion_keeps_mla_out_of_the_agnostic_gate():
    # the predicate side (upstream test_factory): one full-attention-looking group, but MLA
    dep = gates.Deployment(tp=2)
    passed, reasons = gates.g1(dep, Facts(kv_kind="mla"), {})
    assert not passed
    assert reasons == ["not agnostic: kv kind is mla (MLA exclusion)"]
    assert gates.g1(dep, Facts(kv_kind="full"), {})[0]
    # and end to end: a TP=2 MLA cache written by vLLM 0.26 keeps its parallel identity under 0.26
    src = {"model_name": "mla-model", "tp_size": 2, "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "dtype": "auto",
           "tokens_per_hash": 16, "blocks_per_file": 1, "inference_engine": "vllm",
           "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["mla_layer"]}]}
    target = compute_target(src, "vllm", Facts(kv_kind="mla"), "vllm-0.26")
    assert not target.parallel_agnostic
    assert target.fields["tp_size"] == 2
    assert "not agnostic: kv kind is mla (MLA exclusion)" in target.reasons


def test_canonical_layout_forks_the_namespace():
    direct = make_mapper()
    canonical = make_mapper(canonical_layout=True)
    assert "canonical_format" not in direct.fields
    assert canonical.fields["canonical_format"] == "v1-nhd"
    assert base_path(direct) != base_path(canonical)


# --- replicated_layout: OR'd into the agnostic identity for compact MLA rows -------------------

MLA_SHARED = dict(model_name="mla-model", groups=((16, "mla_layer"),), replicated_layout=True, opt_in=True)


def test_replicated_layout_tp2_and_tp4_collapse_to_one_path():
    tp2 = make_mapper(tp_size=2, rank=1, **MLA_SHARED)
    tp4 = make_mapper(tp_size=4, rank=3, **MLA_SHARED)
    assert base_path(tp2) == base_path(tp4) == "/tmp/cache/mla-model_8d7a92f846c0"
    for fm in (tp2, tp4):
        assert [fm.fields[k] for k in ("tp_size", "pp_size", "pcp_size", "dcp_size")] == [1, 1, 1, 1]
        assert fm.rank == 0
        assert "parallel_agnostic" not in fm.fields
        assert fm.fields["replicated_layout"] is True
        assert file_name(fm, b"\x01" * 8, 0).startswith(f"{base_path(fm)}_r0/")


def test_replicated_gate_collapses_tp2_and_tp4_mla_caches_to_one_target():
    # our target computation for the same deployments (written before R existed: parallel_agnostic false)
    def src(tp: int) -> dict:
        return {"model_name": "mla-model", "tp_size": tp, "pp_size": 1, "pcp_size": 1, "dcp_size": 1,
                "dtype": "float16", "tokens_per_hash": 16, "blocks_per_file": 1, "inference_engine": "vllm",
                "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["mla_layer"]}],
                "parallel_agnostic": False}
    t2 = compute_target(src(2), "vllm", Facts(kv_kind="mla"), "vllm-0.28")
    t4 = compute_target(src(4), "vllm", Facts(kv_kind="mla"), "vllm-0.28")
    assert t2.base_name == t4.base_name == "mla-model_8d7a92f846c0"
    assert t2.rank_dir == "mla-model_8d7a92f846c0_r0"
    assert t2.replicated_layout and t2.parallel_agnostic


def test_replicated_layout_requires_opt_in():
    fm = make_mapper(tp_size=2, rank=1, replicated_layout=True, opt_in=False)
    assert fm.fields["tp_size"] == 2
    assert fm.rank == 1
    assert fm.fields["parallel_agnostic"] is False
    assert "replicated_layout" not in fm.fields
    baseline = make_mapper(tp_size=2, rank=1, replicated_layout=False, opt_in=False)
    assert base_path(fm) == base_path(baseline)


def test_non_replicated_keeps_parallel_identity():
    fm = make_mapper(tp_size=4, rank=2, replicated_layout=False, is_parallelism_agnostic=False, opt_in=True)
    assert fm.fields["tp_size"] == 4
    assert fm.rank == 2
    assert fm.fields["parallel_agnostic"] is False
    assert file_name(fm, b"\x02" * 8, 0).startswith(f"{base_path(fm)}_r2/")


def test_agnostic_via_full_attention_differs_from_agnostic_via_replicated():
    shared = dict(model_name="shared-model", groups=((16, "layer0"),), tp_size=2, rank=1, opt_in=True)
    via_agnostic = make_mapper(is_parallelism_agnostic=True, replicated_layout=False, **shared)
    via_replicated = make_mapper(is_parallelism_agnostic=False, replicated_layout=True, **shared)
    assert base_path(via_agnostic) != base_path(via_replicated)
    assert "replicated_layout" not in via_agnostic.fields
    assert via_replicated.fields["replicated_layout"] is True


def test_agnostic_via_full_attention_differs_from_via_replicated_in_targets():
    src = {"model_name": "shared-model", "tp_size": 2, "pp_size": 1, "pcp_size": 1, "dcp_size": 1,
           "dtype": "float16", "tokens_per_hash": 16, "blocks_per_file": 1, "inference_engine": "vllm",
           "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["layer0"]}], "parallel_agnostic": False}
    full = compute_target(src, "vllm", Facts(kv_kind="full", total_kv_heads=8), "vllm-0.28")
    mla = compute_target(src, "vllm", Facts(kv_kind="mla"), "vllm-0.28")
    assert full.parallel_agnostic and not full.replicated_layout
    assert mla.parallel_agnostic and mla.replicated_layout
    assert full.base_name != mla.base_name


def test_replicated_run_config_is_tp_invariant():
    tp2 = make_mapper(tp_size=2, rank=0, **MLA_SHARED)
    tp4 = make_mapper(tp_size=4, rank=2, **MLA_SHARED)
    assert tp2.fields == tp4.fields


def test_three_storage_formats_give_three_paths():
    common = dict(groups=((16, "layer0"), (16, "layer1")), canonical_layout=True, is_parallelism_agnostic=True,
                  opt_in=True)
    paths = {file_name(make_mapper(storage_format=fmt, **common), bytes(range(8)), 1)
             for fmt in (None, "grouped-v1-4096", "grouped-v1-8192")}
    assert len(paths) == 3


@pytest.mark.parametrize("version,expected", [
    ("0.22", (False, False)), ("0.24", (True, False)), ("0.26", (True, False)),
    ("0.27", (True, True)), ("0.28", (True, True)),
])
def test_engine_flags_per_release(version, expected):
    assert gates.engine_flags(version, opt_in=True, is_parallelism_agnostic=True, replicated_config=True) == expected
    assert gates.engine_flags(version, opt_in=False, is_parallelism_agnostic=True, replicated_config=True) == \
        (False, False)
