"""The classification context of a walk unit (`classify.UnitPlan`), built in one place.

Its input is the record the scan keeps of each namespace (`scan.Namespace.metadata`,
written to the manifest's metadata under "namespaces"): config.json, family, status,
resolved facts, target. The scan builds each unit's context from it before the walk; the
migration plan rebuilds the same context from the manifest, so a transform's numbers are
re-derived exactly as the scan proved them (`migrate.outputs.transform_spec`), and the
ranks a block must have (`block_ranks`) mean the same to both.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from kvmigrate import findings
from kvmigrate.classify import TargetInfo, UnitPlan
from kvmigrate.identity import canonical
from kvmigrate.identity.family import ambiguity_is_harmless

VLLMCPP_KV_KINDS = {"mla": "mla", "full_attention": "full", "sliding_window": "sliding"}


def _size(fields: Mapping[str, Any], key: str) -> int:
    v = fields.get(key, 1)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key} {v!r} is not an integer")
    return v


def block_ranks(family: str | None, fields: Mapping[str, Any], present: Iterable[int] = (0,)) -> tuple[int, ...]:
    """The ranks that hold a file of each block (formats.md §2): one per worker for llm-d
    (tp x pcp: a pipeline stage is its own base folder) and vllm.cpp (tp x pp x pcp: every
    worker of the deployment has its own namespace, the rank inside its digest); rank 0
    only for vLLM (the scheduler writes one row). Fields that give no number (an invalid
    config.json) fall back to the rank folders `present`."""
    if family not in ("llmd", "vllmcpp"):
        return (0,)
    try:
        n = _size(fields, "tp_size") * _size(fields, "pcp_size")
        if family == "vllmcpp":
            n *= _size(fields, "pp_size")
    except ValueError:
        n = len(tuple(present))
    return tuple(range(max(1, n)))


def unit_groups(namespaces: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    """The walk units of a root as lists of source base names: a vllm.cpp deployment's
    valid namespaces together (in rank order, grouped by the `deployment` digest), every
    other namespace alone; in deployment order."""
    by_deployment: dict[str, list[str]] = {}
    singles: list[list[str]] = []
    for sb in sorted(namespaces):
        ns = namespaces[sb]
        if ns.get("family") == "vllmcpp" and ns.get("status") == "ok":
            by_deployment.setdefault(ns.get("deployment") or sb, []).append(sb)
        else:
            singles.append([sb])
    groups = singles + [sorted(v, key=lambda sb: (namespaces[sb].get("config_json") or {}).get("rank", 0))
                        for v in by_deployment.values()]
    groups.sort(key=lambda g: namespaces[g[0]].get("deployment") or g[0])
    return groups


def _kv_kind(ns: Mapping[str, Any], fields: Mapping[str, Any]) -> str | None:
    """vllm.cpp identities name their kind; other families take the kv_kind fact."""
    if ns.get("family") == "vllmcpp" and fields:
        return VLLMCPP_KV_KINDS.get(fields.get("kv_cache_spec_kind"), "hybrid")
    return (ns.get("facts") or {}).get("kv_kind")


def _target_info(t: Mapping[str, Any] | None) -> TargetInfo | None:
    if not t:
        return None
    digest = None
    if t.get("family") == "vllmcpp" and t.get("fields") is not None:
        digest = bytes.fromhex(canonical.full_digest(t["fields"], "vllmcpp"))
    unreachable = t.get("unreachable")
    if unreachable == "aliases_source":
        unreachable = findings.reason(f"aliases_source: target {t.get('base_name')} is this source folder name, "
                                      "which holds other bytes than the target engine writes; use --dest DIR",
                                      findings.ALIASES_SOURCE)
    return TargetInfo(profile=t.get("profile", ""), base=t.get("base_name", ""), d12=t.get("d12", ""),
                      rank_dir=t.get("rank_dir", ""), replicated_layout=bool(t.get("replicated_layout")),
                      parallel_agnostic=bool(t.get("parallel_agnostic")), digest=digest, unreachable=unreachable)


def unit_context(members: list[Mapping[str, Any]], hashed: bool) -> UnitPlan:
    """The classification context of one walk unit from its namespaces' records (a unit
    of `unit_groups`; its first namespace speaks for all: a vllm.cpp deployment's
    namespaces are equal except the rank)."""
    ns = members[0]
    fields = ns.get("config_json") or {}
    family = ns.get("family") or "unknown"
    plan = UnitPlan(family=family, hashed=hashed)
    status = ns.get("status") or "ok"
    if status != "ok":  # an unproven namespace: every row of its blocks carries its status (action none)
        plan.block_status, plan.block_reason = status, ns.get("status_reason") or ""
        return plan
    tp, pp, pcp = (fields.get(k, 1) for k in ("tp_size", "pp_size", "pcp_size"))
    plan.world = tp * pp * pcp
    plan.expected_ranks = block_ranks(family, fields, ns.get("ranks") or (0,))
    if family == "vllmcpp":
        present = {(n.get("config_json") or {}).get("rank") for n in members}
        plan.absent_ranks = tuple(r for r in plan.expected_ranks if r not in present)
        plan.vllmcpp_payload = fields.get("page_size_bytes")
        plan.blocks_per_file = 1
    plan.kv_kind = _kv_kind(ns, fields)
    plan.blocks_per_file = fields.get("gpu_blocks_per_file", fields.get("blocks_per_file", plan.blocks_per_file))
    groups = fields.get("kv_cache_groups") or []
    plan.layers = {g: len(grp.get("layer_names", [])) for g, grp in enumerate(groups) if isinstance(grp, dict)}
    facts = ns.get("facts") or {}
    plan.page_bytes = facts.get("page_bytes")
    plan.tensors_per_layer = facts.get("tensors_per_layer")
    plan.source_replicated = fields.get("replicated_layout") is True
    plan.source_canonical = "canonical_format" in fields
    plan.target = _target_info(ns.get("target"))
    if family == "ambiguous":
        # the sample of rank 0's block sizes; a manifest without it (before it was
        # recorded) reads as an ambiguity that matters: blocks stay `none`
        sizes = ns.get("block_sizes")
        plan.ambiguity_harmless = sizes is not None and ambiguity_is_harmless(fields, sizes)
    if ns.get("target_error"):
        plan.none_reason = ns["target_error"]
    if plan.absent_ranks and not plan.none_reason:
        plan.none_reason = (f"deployment incomplete: the namespace of rank {', '.join(map(str, plan.absent_ranks))} "
                            "is missing or invalid")
    for n in members:
        for rank, d in zip(n.get("ranks") or [], n.get("rank_dirs") or []):
            plan.rank_dirs[rank] = d
    return plan


def unit_contexts(namespaces: Mapping[str, Mapping[str, Any]], hashed: bool) -> dict[str, UnitPlan]:
    """The context of every namespace of a manifest's metadata (namespaces of one unit
    share it), keyed by source base name."""
    out: dict[str, UnitPlan] = {}
    for group in unit_groups(namespaces):
        ctx = unit_context([namespaces[sb] for sb in group], hashed)
        for sb in group:
            out[sb] = ctx
    return out
