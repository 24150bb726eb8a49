"""The identity a target engine would use for the deployment that wrote a namespace
(identity.md §4): the `Target` record every family returns, and the vLLM recipe that vLLM
and llm-d sources share (Family.target). Which family's recipe applies to a namespace is
the registry's dispatch (kvmigrate.families.compute_target), above this module.

A block may only go where the target engine itself would have written the same bytes for
that deployment, so the gates run at the *writer's* tp/pp/pcp/dcp, never at some other
reader's. The result says which namespace the target reads, why it is (not) collapsed,
which defaults were assumed, and whether the namespace is reachable at all.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvmigrate import layout
from kvmigrate.errors import MissingFactError, UsageError
from kvmigrate.identity import canonical, gates, schemes
from kvmigrate.identity.facts import Facts
from kvmigrate.identity.hfconfig import normalize_dtype
from kvmigrate.identity.values import ORPHANED

PROFILE_VERSIONS = {"vllm-0.22": "0.22", "vllm-0.24": "0.24", "vllm-0.26": "0.26",
                    "vllm-0.27": "0.27", "vllm-0.28": "0.28", "vllm-0.34": "0.34"}
# dtype values vLLM >= 0.27 writes when it resolved "auto" (a pre-0.27 engine wrote "auto")
RESOLVED_DTYPES = ("float16", "bfloat16", "float32")

HASH_GRANULARITY_CHANGED = "hash granularity changed"
RANK_PRIVATE_SHARD = "rank-private shard"
ALIASES_SOURCE = "aliases_source"
WRITER_FACTS = ("writer_tp", "writer_pp")


def orphaned_reason(profile: str, facts: Facts) -> str:
    """Why a folder that may have been collapsed by a direct gate gets no target under a
    profile that keeps direct layouts topology-specific: which facts settle it, and why."""
    version = PROFILE_VERSIONS[profile]
    missing = [f"--{f.replace('_', '-')} N" for f in WRITER_FACTS if getattr(facts, f) is None]
    kind = " (or --kv-kind, if the model is not full attention: then no gate collapsed it)" \
        if facts.kv_kind is None else ""
    return (f"{ORPHANED} {version}: the folder does not record the topology that wrote it (the parallel-agnostic "
            f"gate of vLLM 0.24-0.33 folded tp and pp to 1; vLLM {version} keeps a direct layout "
            f"topology-specific, vllm#55191); state {' and '.join(missing)} (FACTS.json writer_tp, writer_pp){kind} only if one "
            "topology wrote every row: rows written at several TPs are the same size and cannot be told apart")


def writer_claim(target_fields: dict[str, Any], facts: Facts) -> str:
    """What a plan into the topology-specific namespace of a collapsed folder rests on."""
    how = " and ".join(f"--writer-{f[7:]} {getattr(facts, f)}" + (f" ({facts.sources[f]})" if f in facts.sources
                                                                   else "") for f in WRITER_FACTS)
    return (f"relinking this collapsed folder as tp {target_fields['tp_size']}, pp {target_fields['pp_size']} "
            f"rests on the statement that one topology wrote every row ({how}; pcp and dcp 1): rows written at "
            "several TPs are the same size and cannot be told apart, and mixing them is the silent corruption "
            "vllm#55191 fixes")


def target_lacks(key: str) -> str:
    return f"target_lacks_{key}"


@dataclass
class Target:
    profile: str  # e.g. "vllm-0.28" or "vllmcpp"
    family: str  # family of the TARGET engine (Family.target_engine): "vllm" or "vllmcpp"
    fields: dict | None
    d12: str | None
    base_name: str | None
    rank_dir: str | None  # "<base>_r0" for vLLM targets
    parallel_agnostic: bool
    replicated_layout: bool
    reasons: list[str]  # one per failed gate condition
    assumed_facts: dict[str, Any] = field(default_factory=dict)
    unreachable: str | None = None  # whole-namespace reason its blocks get action none
    # facts not given on which the gate decision depends: until stated, this target is a guess
    missing_facts: list[str] = field(default_factory=list)
    # assumed defaults the gate decision rests on (another value would change the target)
    decisive_assumptions: dict[str, Any] = field(default_factory=dict)
    # [tp, pp] the operator stated for a collapsed folder (--writer-tp/--writer-pp): the
    # target is that topology's namespace, and the plan rests on the statement
    writer_topology: list[int] | None = None
    claims: list[str] = field(default_factory=list)  # statements of the operator the target rests on

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- vLLM / llm-d sources ---------------------------------------------------------------

def _target_dtype(src: dict[str, Any], scheme: str, target_scheme: str, facts: Facts) -> str:
    dtype = src["dtype"]
    if target_scheme == "S3":
        if dtype != "auto":
            return dtype
        if facts.model_dtype is None:
            raise MissingFactError("model_dtype", "--model-dtype",
                                   'the source dtype is "auto" and vLLM >= 0.27 writes the resolved model dtype')
        return normalize_dtype(facts.model_dtype) or facts.model_dtype
    # targets <= 0.26 write the raw cache dtype
    parallel_one = all(src[k] == 1 for k in schemes.PARALLEL_KEYS)
    # an S2-looking folder with sizes 1 may be an agnostic S3 namespace (same keys)
    resolved = scheme == "S3" or (scheme == "S2" and parallel_one)
    if resolved and normalize_dtype(dtype) in RESOLVED_DTYPES:
        if facts.cache_dtype is None:
            raise MissingFactError("cache_dtype", "--cache-dtype",
                                   f'the source dtype {dtype!r} may be a resolved "auto"; vLLM <= 0.26 writes '
                                   'the raw --kv-cache-dtype (usually "auto")')
        return facts.cache_dtype
    return dtype


def vllm_target(src: dict[str, Any], family: Any, facts: Facts, profile: str) -> Target:
    """The vLLM target of a vLLM or llm-d namespace (Family.target of both; `family`: the
    source's Family, for its name and `aliases_vllm_names`)."""
    if profile not in PROFILE_VERSIONS:
        if profile == gates.VLLMCPP_PROFILE:
            raise UsageError("--target vllmcpp applies only to vllm.cpp caches; this namespace was written by "
                             f"{family.name!r}", hint="pick a vLLM profile: " + ", ".join(gates.VLLM_PROFILES))
        raise UsageError(f"unknown target profile {profile!r}", hint="known: " + ", ".join(gates.PROFILES))
    version = PROFILE_VERSIONS[profile]
    scheme = schemes.scheme_of(src)
    target_scheme = schemes.scheme_for_version(version)
    known_optional = schemes.known_optional_keys(version)
    tp, pp, pcp, dcp = (src[k] for k in schemes.PARALLEL_KEYS)
    groups = src["kv_cache_groups"]
    unreachable: list[str] = [target_lacks(k) for k in schemes.unknown_keys(src)]
    unreachable += [target_lacks(k) for k in schemes.OPTIONAL_KEYS if k in src and k not in known_optional]

    # group geometry: per-rank GPU block size and tokens per block (= block size x writer's dcp)
    if scheme == "S1":
        block_sizes = [g["block_size"] for g in groups]
        tokens_per_block = [b * dcp for b in block_sizes]
        granularity = src["hash_block_size"]
        per_file = src["gpu_blocks_per_file"]
    else:
        tokens_per_block = [g["tokens_per_block"] for g in groups]
        if any(t % dcp for t in tokens_per_block):
            unreachable.append("tokens_per_block not a multiple of dcp_size")
        block_sizes = [max(1, t // dcp) for t in tokens_per_block]
        granularity = src["tokens_per_hash"]
        per_file = src["blocks_per_file"]
    layer_names = [g["layer_names"] for g in groups]

    # Block keys are hashes over `granularity` tokens: S1 hashed at the cache block size,
    # S2+ at the gcd of the groups' tokens_per_block. Where the two differ, no key matches.
    group_gcd = math.gcd(*tokens_per_block) if tokens_per_block else granularity
    if (scheme == "S1") != (target_scheme == "S1") and group_gcd != granularity:
        unreachable.append(HASH_GRANULARITY_CHANGED)
    scheme_args: dict[str, Any] = {}
    if target_scheme == "S1":
        target_groups = [{"block_size": b, "layer_names": n} for b, n in zip(block_sizes, layer_names)]
        scheme_args.update(hash_block_size=granularity, gpu_blocks_per_file=per_file)
    else:
        target_groups = [{"tokens_per_block": t, "layer_names": n} for t, n in zip(tokens_per_block, layer_names)]
        scheme_args.update(tokens_per_hash=group_gcd if scheme == "S1" else granularity, blocks_per_file=per_file)

    dtype = _target_dtype(src, scheme, target_scheme, facts)

    dep = gate_deployment(src)
    missing: list[str] = []
    decisive: dict[str, Any] = {}
    writer: list[int] | None = None
    orphaned: str | None = None
    claims: list[str] = []
    stated = [getattr(facts, f) for f in WRITER_FACTS]
    if may_be_collapsed(src, family, facts) and gates.orphans_direct_collapse(profile):
        # a folder collapsed by a direct gate (0.24-0.33): the target is the namespace of the
        # topology that wrote its rows, which only the operator can state
        if facts.writer_tp is None or facts.writer_pp is None:  # (the WRITER_FACTS, not all stated)
            orphaned = orphaned_reason(profile, facts)
            dep = gates.Deployment(tp=1, num_groups=len(groups))
        else:
            writer = [facts.writer_tp, facts.writer_pp]
            tp, pp, pcp, dcp = writer[0], writer[1], 1, 1
            dep = gates.Deployment(tp=tp, pp=pp, num_groups=len(groups))
            facts = replace(facts, kv_kind=facts.kv_kind or "full")  # the direct gate it passed needs full attention
    elif (dep is not None and [dep.tp, dep.pp] != stated
          and any(getattr(facts, f) is not None and facts.sources.get(f) not in ("flag", "facts:*")
                  for f in WRITER_FACTS)):
        # stated for this namespace (a global flag or "*" entry is for the collapsed folders
        # of a root; a folder that records its writer's topology keeps it)
        unreachable.append(f"facts contradict the identity: --writer-tp {stated[0]} --writer-pp {stated[1]} stated, "
                           f"but the folder records tp {dep.tp}, pp {dep.pp} (its writer's topology; writer facts "
                           "are for folders collapsed by vLLM 0.24-0.33): drop them for this namespace (FACTS.json "
                           "keys by model or folder)")
    if dep is None:
        if _has_agnostic_namespaces(profile):
            decision = gates.GateDecision(True, src.get("replicated_layout") is True, [], {})
        else:
            decision = gates.GateDecision(False, False, [f"not agnostic: {profile} has no parallel-agnostic "
                                                         "namespaces (source already collapsed)"], {})
    else:
        decision = gates.evaluate(profile, dep, facts)
        missing, decisive = gates.open_facts(profile, dep, facts)
    if writer is not None:
        decision.reasons.insert(0, f"not agnostic: collapsed by vLLM 0.24-0.33's direct gate; {profile} keeps a "
                                   f"direct layout topology-specific (vllm#55191), so its rows belong to the "
                                   f"tp {writer[0]}, pp {writer[1]} namespace stated by --writer-tp/--writer-pp")

    mapper = schemes.filemapper(
        version, model_name=src["model_name"], tp_size=tp, pp_size=pp, pcp_size=pcp, dcp_size=dcp,
        dtype=dtype, kv_cache_groups=target_groups, rank=0, parallel_agnostic=decision.parallel_agnostic,
        replicated_layout=decision.replicated_layout, canonical_format=src.get("canonical_format"),
        storage_format=src.get("storage_format"), inference_engine=src["inference_engine"], family="vllm",
        **scheme_args)
    source_base = layout.base_name(src["model_name"], canonical.d12(src, mapper.family))  # vLLM and llm-d hash alike
    if family.aliases_vllm_names and mapper.base_name == source_base:
        # same folder name, different bytes (llm-d shards vs vLLM rows): never write there
        unreachable.append(ALIASES_SOURCE)
    if writer is not None:
        claims.append(writer_claim(mapper.fields, facts))
    if orphaned:  # no namespace to show: which one the rows belong to is what the facts would say
        return Target(profile=profile, family="vllm", fields=None, d12=None, base_name=None, rank_dir=None,
                      parallel_agnostic=False, replicated_layout=False, reasons=[orphaned],
                      assumed_facts=decision.assumed_facts, unreachable=unreachable[0] if unreachable else orphaned)
    return Target(profile=profile, family="vllm", fields=mapper.fields, d12=mapper.d12, base_name=mapper.base_name,
                  rank_dir=layout.rank_dir_name(mapper.base_name, 0),
                  parallel_agnostic=decision.parallel_agnostic, replicated_layout=decision.replicated_layout,
                  reasons=decision.reasons, assumed_facts=decision.assumed_facts,
                  unreachable=unreachable[0] if unreachable else None, missing_facts=missing,
                  decisive_assumptions=decisive, writer_topology=writer, claims=claims)


def gate_deployment(src: dict[str, Any]) -> gates.Deployment | None:
    """The deployment the gates judge for a vLLM or llm-d source identity; None for a
    source already collapsed (an S3 agnostic or replicated folder: no gate is evaluated)."""
    if (schemes.scheme_of(src) == "S3" and "parallel_agnostic" not in src) or src.get("replicated_layout") is True:
        return None
    tp, pp, pcp, dcp = (src[k] for k in schemes.PARALLEL_KEYS)
    return gates.Deployment(tp=tp, pp=pp, pcp=pcp, dcp=dcp, num_groups=len(src["kv_cache_groups"]),
                            canonical="canonical_format" in src)


def may_be_collapsed(src: dict[str, Any], family: Any, facts: Facts) -> bool:
    """A vLLM folder whose tp/pp may have been folded to 1 by a direct parallel-agnostic gate
    (vLLM 0.24-0.33): no `parallel_agnostic` key, tp = pp = pcp = dcp = 1, neither canonical
    nor replicated, written by the scheduler's FileMapper, and not ruled out by a stated
    fact the direct gate (G1, the weakest) rejects: then the identity records the writer."""
    if not family.scheduler_rows or "parallel_agnostic" in src or "canonical_format" in src:
        return False
    if src.get("replicated_layout") is True or any(src.get(k) != 1 for k in schemes.PARALLEL_KEYS):
        return False
    g1_fails = (len(src.get("kv_cache_groups") or []) != 1 or facts.kv_kind not in (None, "full")
                or facts.runner == "v2")
    return not g1_fails


def _has_agnostic_namespaces(profile: str) -> bool:
    return gates.PROFILE_GATES[profile][0] is not None
