"""vLLM 0.34's namespaces (identity.md §4.1), from the engine's own rules.

The oracle below is written from the gates of the 0.33 and 0.34 wheels as
`shared/reference/vllm-034-delta.md` quotes them (offloading/config.py: the direct gate
0.33 had and 0.34 deleted, the canonical certification both share, the replicated gate R
and its canonical form) and from FileMapper's fields function, hashed here with json and
hashlib: none of it comes from kvmigrate's code. For every deployment of the grid (kind,
runner, canonical on/off, tp and pp in {1, 2, 4, 8}) the namespace a 0.33 engine wrote is
the source, and kvmigrate's `vllm-0.34` target must be exactly the namespace the 0.34
engine computes for the same deployment; a folder the 0.33 direct gate collapsed has no
target until --writer-tp/--writer-pp state the topology that wrote it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from itertools import product

import pytest

from kvmigrate import families
from kvmigrate.identity.facts import Facts
from kvmigrate.identity.values import DEFAULT_PROFILE

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# kind -> (kv heads of the model, the attention kind an operator states, layer specs)
KINDS = {
    "full": (8, "full"),             # head-sharded GQA: 8 KV heads
    "replicated_gqa": (2, "full"),   # 2 KV heads: tp 4 and 8 replicate them
    "mla": (1, "mla"),
    "sliding": (8, "sliding"),
    "hybrid": (8, "hybrid"),         # full attention + mamba: two groups
}
SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Dep:
    kind: str
    runner: str
    canonical: bool
    tp: int
    pp: int

    @property
    def heads(self) -> int:
        return KINDS[self.kind][0]

    @property
    def groups(self) -> int:
        return 2 if self.kind == "hybrid" else 1

    @property
    def world(self) -> int:
        return self.tp * self.pp


def certified(d: Dep) -> bool:
    """The canonical certification 0.33 and 0.34 share: every layer certifiable (full or
    sliding attention whose heads tp splits or replicates, plain MLA; mamba never),
    dcp = pcp = 1 (always here) and world size = tp."""
    layer_ok = {"full": d.heads % d.tp == 0 or d.tp % d.heads == 0, "replicated_gqa": True, "mla": True,
                "sliding": True, "hybrid": False}[d.kind]
    return layer_ok and d.world == d.tp


def direct_033(d: Dep) -> bool:
    """0.33's deleted direct gate: V1 runner, one full-attention group that is not MLA,
    num_kv_heads x tp == total heads (per-rank heads max(1, total // tp))."""
    per_rank = max(1, d.heads // d.tp)
    return (d.runner == "v1" and d.groups == 1 and d.kind in ("full", "replicated_gqa")
            and per_rank * d.tp == d.heads)


def gate(d: Dep, version: str) -> tuple[bool, bool]:
    """(parallel_agnostic passed to FileMapper, replicated_layout) of that engine (mp, one node)."""
    agnostic = direct_033(d) if version == "0.33" else False
    if d.canonical and (version == "0.34" or not agnostic):
        agnostic = certified(d)
    if d.canonical:
        replicated = agnostic and d.kind == "mla"  # one node, mp
    else:
        replicated = d.kind == "mla" and d.tp > 1 and d.pp == 1
    return agnostic or replicated, replicated


def fields_of(d: Dep, version: str) -> dict:
    """FileMapper.__init__ of that release (S3)."""
    agnostic, replicated = gate(d, version)
    one = agnostic
    fields = {"model_name": MODEL, "tokens_per_hash": 16, "blocks_per_file": 1,
              "tp_size": 1 if one else d.tp, "pp_size": 1 if one else d.pp, "pcp_size": 1, "dcp_size": 1,
              "dtype": "bfloat16",
              "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": LAYERS}] * d.groups,
              "inference_engine": "vllm"}
    if not agnostic:
        fields["parallel_agnostic"] = False
    if replicated:
        fields["replicated_layout"] = True
    if d.canonical:
        fields["canonical_format"] = "v1-nhd"
    return fields


def base_of(fields: dict) -> str:
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]
    return f"{fields['model_name'].replace('/', '_')}_{digest}"


def deployments() -> list[Dep]:
    """The grid, without the deployments no engine can write: a canonical layout whose
    workers are not exactly the TP group (pp > 1) fails create_worker in both releases."""
    return [Dep(k, r, c, tp, pp) for k, r, c, tp, pp in product(KINDS, ("v1", "v2"), (False, True), SIZES, SIZES)
            if not (c and pp > 1)]


def facts_for(d: Dep, writer: bool) -> Facts:
    heads, kind = KINDS[d.kind]
    return Facts(kv_kind=kind, total_kv_heads=heads, runner=d.runner, model_dtype="bfloat16",
                 writer_tp=d.tp if writer else None, writer_pp=d.pp if writer else None)


def target(fields: dict, facts: Facts, profile: str = "vllm-0.34"):
    return families.compute_target(fields, "vllm", facts, profile)


MOVED = [d for d in deployments() if base_of(fields_of(d, "0.33")) != base_of(fields_of(d, "0.34"))]


def test_the_default_profile_is_vllm_034():
    assert DEFAULT_PROFILE == "vllm-0.34"


def test_the_moved_deployments_are_the_direct_gate_ones():
    """What moves is what 0.33's direct gate collapsed (full attention, V1, heads split by
    tp), TP1 and the issue's TP2/4/8 and TP4xPP2 among them; nothing canonical can move."""
    assert all(direct_033(d) and not d.canonical for d in MOVED)
    named = {("full", 1, 1), ("full", 2, 1), ("full", 4, 1), ("full", 8, 1), ("full", 4, 2),
             ("replicated_gqa", 1, 1), ("replicated_gqa", 2, 1)}
    assert named <= {(d.kind, d.tp, d.pp) for d in MOVED if d.runner == "v1"}


@pytest.mark.parametrize("d", deployments(), ids=str)
def test_the_034_target_of_a_033_namespace_is_what_034_computes(d):
    source = fields_of(d, "0.33")
    want = base_of(fields_of(d, "0.34"))
    stated = target(source, facts_for(d, writer=True))
    assert stated.unreachable is None, stated.unreachable
    assert (stated.base_name, stated.fields) == (want, fields_of(d, "0.34"))
    assert stated.rank_dir == want + "_r0"
    unstated = target(source, facts_for(d, writer=False))
    if d in MOVED:
        assert unstated.base_name is None and unstated.fields is None  # never a guess
        assert unstated.unreachable.startswith("orphaned by vLLM 0.34")
        assert "--writer-tp N" in unstated.unreachable and "--writer-pp N" in unstated.unreachable
        assert "does not record the topology" in unstated.unreachable
        assert stated.writer_topology == [d.tp, d.pp] and stated.claims
    else:
        assert unstated.base_name == want == base_of(source)  # already in place: the same digest
        assert unstated.unreachable is None and not unstated.claims


@pytest.mark.parametrize("d", deployments(), ids=str)
def test_a_namespace_034_wrote_is_in_place_under_034(d):
    """Given a namespace 0.34 wrote, the 0.34 target is that namespace itself, never the
    collapsed name 0.34 does not read."""
    source = fields_of(d, "0.34")
    got = target(source, facts_for(d, writer=False))
    assert got.unreachable is None and got.base_name == base_of(source)


@pytest.mark.parametrize("d", MOVED[:4], ids=str)
def test_vllm_028_keeps_meaning_028_to_033(d):
    """--target vllm-0.28 still reads the collapsed 0.33 name, and plans a 0.34 namespace into it."""
    collapsed = fields_of(d, "0.33")
    assert target(collapsed, facts_for(d, writer=False), "vllm-0.28").base_name == base_of(collapsed)
    assert target(fields_of(d, "0.34"), facts_for(d, writer=False), "vllm-0.28").base_name == base_of(collapsed)


def test_the_issue_example_moves_to_the_digests_the_real_034_file_mapper_gave():
    """32 layers, block 16, bf16 (vllm-034-delta.md §1, digests from the real 0.34 FileMapper)."""
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(32)]
    collapsed = {"model_name": MODEL, "tokens_per_hash": 16, "blocks_per_file": 1, "tp_size": 1, "pp_size": 1,
                 "pcp_size": 1, "dcp_size": 1, "dtype": "bfloat16",
                 "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": layers}], "inference_engine": "vllm"}
    assert base_of(collapsed).endswith("_c13170011f67")
    for tp, d12 in ((1, "330cb72a4d52"), (2, "4acb1bd394b2"), (4, "bb167a2b57ee")):
        t = target(collapsed, Facts(kv_kind="full", total_kv_heads=8, writer_tp=tp, writer_pp=1))
        assert t.base_name == f"meta-llama_Llama-3.1-8B-Instruct_{d12}"


def test_writer_facts_that_contradict_a_recorded_topology_are_refused():
    d = Dep("sliding", "v1", False, 2, 1)  # not collapsed: the identity records tp 2
    facts = Facts(kv_kind="sliding", total_kv_heads=8, writer_tp=4, writer_pp=1,
                  sources={"writer_tp": f"facts:{MODEL}", "writer_pp": f"facts:{MODEL}"})
    t = target(fields_of(d, "0.33"), facts)
    assert t.unreachable.startswith("facts contradict the identity: --writer-tp 4 --writer-pp 1")
    # a global flag (or a "*" entry) speaks of the root's collapsed folders: this one keeps its own
    for where in ("flag", "facts:*"):
        facts.sources = {"writer_tp": where, "writer_pp": where}
        t = target(fields_of(d, "0.33"), facts)
        assert t.unreachable is None and t.fields["tp_size"] == 2


def test_one_writer_fact_alone_names_the_other():
    d = Dep("full", "v1", False, 2, 1)
    t = target(fields_of(d, "0.33"), Facts(kv_kind="full", total_kv_heads=8, writer_tp=2))
    assert t.base_name is None
    assert "--writer-pp N" in t.unreachable and "--writer-tp N" not in t.unreachable


def test_a_tp1_s2_folder_of_a_sliding_model_records_its_writer():
    """An S2 folder with tp 1 of a model the direct gate rejects was written at tp 1: no
    writer facts needed (the gate could not have folded anything)."""
    s2 = {"model_name": MODEL, "tokens_per_hash": 16, "blocks_per_file": 1, "tp_size": 1, "pp_size": 1,
          "pcp_size": 1, "dcp_size": 1, "dtype": "auto",
          "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": LAYERS}], "inference_engine": "vllm"}
    sliding = target(s2, Facts(kv_kind="sliding", total_kv_heads=8, model_dtype="bfloat16"))
    assert sliding.unreachable is None and sliding.fields["tp_size"] == 1
    full = target(s2, Facts(kv_kind="full", total_kv_heads=8, model_dtype="bfloat16"))
    assert full.base_name is None and full.unreachable.startswith("orphaned by vLLM 0.34")
    unknown = target(s2, Facts(model_dtype="bfloat16"))
    assert unknown.base_name is None and "--kv-kind" in unknown.unreachable


def test_an_llmd_tp1_folder_records_its_writer():
    """llm-d never collapses (its identity always records the topology)."""
    s1 = {"model_name": MODEL, "hash_block_size": 16, "gpu_blocks_per_file": 1, "tp_size": 1, "pp_size": 1,
          "pcp_size": 1, "dcp_size": 1, "dtype": "auto",
          "kv_cache_groups": [{"block_size": 16, "layer_names": LAYERS}], "inference_engine": "vllm"}
    t = families.compute_target(s1, "llmd", Facts(kv_kind="full", total_kv_heads=8, model_dtype="bfloat16"),
                                "vllm-0.34")
    assert t.unreachable is None and t.fields["tp_size"] == 1 and t.fields["parallel_agnostic"] is False
