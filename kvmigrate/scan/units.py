"""Phase 3 of the scan: the units the walker visits side by side (a vLLM / llm-d
namespace with its rank folders, or a vllm.cpp deployment: one namespace per rank)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmigrate import context, families
from kvmigrate.classify import UnitPlan
from kvmigrate.scan.roots import Namespace


@dataclass
class Member:
    """One rank folder of a unit."""

    rank: int
    dirname: str
    ns: Namespace
    columns: tuple  # namespace column values for its rows
    foreign_reason: str | None = None  # rank folder outside the deployment: its files are foreign
    buckets: set[str] = field(default_factory=set)
    code: int = 0  # its namespace's index in Walker.ns_table (the namespace columns of its rows)


@dataclass
class Unit:
    index: int
    plan: UnitPlan
    members: list[Member]
    # Verdicts of healthy blocks by shape (group, ranks, sizes, replicas differ): the
    # classification depends on nothing else, so it is computed once and replayed.
    verdicts: dict[tuple, tuple] = field(default_factory=dict)
    size_verdicts: dict[tuple[int, int], tuple[str, str] | None] = field(default_factory=dict)
    targets_exist: bool = False  # the target rank folder is already at the root: check each target path

    def bucket_names(self) -> list[str]:
        names: set[str] = set()
        for m in self.members:
            names |= m.buckets
        return sorted(names)


def build_units(root: str, namespaces: list[Namespace], hashed: bool, profile: str) -> list[Unit]:
    units: list[Unit] = []
    records = {ns.source_base: ns.metadata() for ns in namespaces}  # what the manifest keeps of each
    by_base = {ns.source_base: ns for ns in namespaces}
    for bases in context.unit_groups(records):
        nss = [by_base[b] for b in bases]
        plan = context.unit_context([records[b] for b in bases], hashed)
        members = []
        for ns in nss:
            cols = ns.columns()
            own_rank = ((ns.fields or {}).get("rank") if families.get(ns.family).rank_namespaces and ns.status == "ok"
                        else None)  # a namespace per rank: its identity names the one rank folder it reads
            for rank, dirname in ns.rank_dirs.items():
                m = Member(rank, dirname, ns, cols)
                if own_rank is not None and rank != own_rank:
                    m.foreign_reason = (f"rank folder _r{rank} does not match the identity's rank {own_rank} "
                                        "(the engine never reads it)")
                elif ns.status == "ok" and plan.expected_ranks and rank not in plan.expected_ranks:
                    m.foreign_reason = (f"rank folder _r{rank} is outside the writer's ranks "
                                        f"{list(plan.expected_ranks)}")
                members.append(m)
        members.sort(key=lambda m: (m.rank, m.dirname))
        units.append(Unit(len(units), plan, members))
    return units
