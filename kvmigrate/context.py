"""The classification context of a walk unit (`classify.UnitPlan`), built in one place.

Its input is the record the scan keeps of each namespace (`scan.Namespace.metadata`,
written to the manifest's metadata under "namespaces"): config.json, family, status,
resolved facts, target. The scan builds each unit's context from it before the walk; the
migration plan rebuilds the same context from the manifest, so a transform's numbers are
re-derived exactly as the scan proved them (`migrate.outputs.transform_spec`), and the
ranks a block must have (`block_ranks`) mean the same to both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvmigrate import families, findings
from kvmigrate.classify import TargetInfo, UnitPlan


def block_ranks(family: str | None, fields: Mapping[str, Any], present: Iterable[int] = (0,)) -> tuple[int, ...]:
    """The ranks that hold a file of each block (formats.md §2; the family says,
    Family.block_ranks): rank 0 only for vLLM (the scheduler writes one row), one per
    worker for llm-d and vllm.cpp. Fields that give no number (an invalid config.json)
    fall back to the rank folders `present`."""
    return families.get(family).block_ranks(fields, present)


def unit_groups(namespaces: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    """The walk units of a root as lists of source base names: a vllm.cpp deployment's
    valid namespaces together (a family whose ranks write namespaces of their own: in
    rank order, grouped by the `deployment` digest), every
    other namespace alone; in deployment order."""
    by_deployment: dict[str, list[str]] = {}
    singles: list[list[str]] = []
    for sb in sorted(namespaces):
        ns = namespaces[sb]
        if families.get(ns.get("family")).rank_namespaces and ns.get("status") == "ok":
            by_deployment.setdefault(ns.get("deployment") or sb, []).append(sb)
        else:
            singles.append([sb])
    groups = singles + [sorted(v, key=lambda sb: (namespaces[sb].get("config_json") or {}).get("rank", 0))
                        for v in by_deployment.values()]
    groups.sort(key=lambda g: namespaces[g[0]].get("deployment") or g[0])
    return groups


def _target_info(t: Mapping[str, Any] | None) -> TargetInfo | None:
    if not t:
        return None
    digest = families.get(t.get("family")).target_digest(t.get("fields"))
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
    family = ns.get("family") or families.UNKNOWN
    fam = families.get(family)
    plan = UnitPlan(fam=fam, hashed=hashed)
    status = ns.get("status") or "ok"
    if status != "ok":  # an unproven namespace: every row of its blocks carries its status (action none)
        plan.block_status, plan.block_reason = status, ns.get("status_reason") or ""
        return plan
    tp, pp, pcp = (fields.get(k, 1) for k in ("tp_size", "pp_size", "pcp_size"))
    writer = (ns.get("target") or {}).get("writer_topology")
    if writer:  # a collapsed folder's rows hold the cells of the topology the operator stated
        tp, pp = writer
    plan.world = tp * pp * pcp
    plan.expected_ranks = fam.block_ranks(fields, ns.get("ranks") or (0,))
    if fam.rank_namespaces:  # a rank whose namespace is absent or invalid leaves the deployment incomplete
        present = {(n.get("config_json") or {}).get("rank") for n in members}
        plan.absent_ranks = tuple(r for r in plan.expected_ranks if r not in present)
    plan.payload_bytes = fam.payload_bytes(fields)
    plan.kv_kind = fam.kv_kind(fields, ns.get("facts") or {})
    plan.blocks_per_file = fam.blocks_per_file(fields)
    groups = fields.get("kv_cache_groups") or []
    plan.layers = {g: len(grp.get("layer_names", [])) for g, grp in enumerate(groups) if isinstance(grp, dict)}
    facts = ns.get("facts") or {}
    plan.page_bytes = facts.get("page_bytes")
    plan.tensors_per_layer = facts.get("tensors_per_layer")
    plan.source_replicated = fields.get("replicated_layout") is True
    plan.source_canonical = "canonical_format" in fields
    plan.target = _target_info(ns.get("target"))
    plan.ambiguity_harmless = fam.harmless_ambiguity(fields, ns.get("block_sizes"))
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
