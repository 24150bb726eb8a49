"""The gates that decide whether a vLLM engine uses the parallel-agnostic namespace
(identity.md §3), evaluated for the deployment that wrote a cache.

Every gate returns `(passed, reasons)` with one human-readable reason per failed
condition, and notes each default it had to assume (runner v1, executor mp, one node,
no per-token-head quantization) so reports can say which claims a decision rests on.
All conditions are evaluated (no short-circuit): an operator sees every reason at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import product
from typing import Any

from kvmigrate.identity.facts import Facts
from kvmigrate.identity.values import DEFAULT_PROFILE, PROFILES, VLLM_PROFILES, VLLMCPP_PROFILE  # noqa: F401

# profile -> (agnostic gate, replicated gate R?, canonical widening?). G0 (vLLM 0.34,
# vllm#55191): a direct layout is never agnostic, only a certified canonical one.
PROFILE_GATES: dict[str, tuple[str | None, bool, bool]] = {
    "vllm-0.22": (None, False, False),
    "vllm-0.24": ("G1", False, False),
    "vllm-0.26": ("G1", False, False),
    "vllm-0.27": ("G1", True, False),
    "vllm-0.28": ("G2", True, True),
    "vllm-0.34": ("G0", True, False),
}


def orphans_direct_collapse(profile: str) -> bool:
    """The profile's engine has parallel-agnostic namespaces but never for a direct layout
    (G0, vLLM 0.34): a folder a 0.24-0.33 direct gate collapsed is orphaned under it."""
    return PROFILE_GATES[profile][0] == "G0"

# defaults the gates may assume (identity.md §4), with the value reports show
DEFAULTS: dict[str, Any] = {"runner": "v1", "executor": "mp", "nnodes": 1, "per_token_head_quant": False}
# the other value of each default, to test whether a decision rests on it
NOT_DEFAULT: dict[str, Any] = {"runner": "v2", "executor": "ray", "nnodes": 2, "per_token_head_quant": True}
# facts without a default: unknown, their gate conditions fail (identity.md §4)
UNDEFAULTED = ("kv_kind", "total_kv_heads")
_KIND_HINT = "pass --kv-kind or --model-config to allow collapse"


@dataclass(frozen=True)
class Deployment:
    """The parallel layout a cache was written with (from its source identity)."""

    tp: int
    pp: int = 1
    pcp: int = 1
    dcp: int = 1
    num_groups: int = 1
    canonical: bool = False  # the source carries canonical_format

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.pcp


@dataclass
class GateDecision:
    parallel_agnostic: bool
    replicated_layout: bool
    reasons: list[str]
    assumed_facts: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Condition:
    """One gate condition as evaluated (kvmigrate explain lists them all, passed or not)."""

    gate: str  # G1, G2, canonical, R
    needs: str  # what the engine requires, e.g. "the V1 model runner"
    passed: bool
    reason: str  # why it failed, as the target's reasons say it ("" when it passed)
    facts: tuple[str, ...] = ()  # the deployment facts it reads (none: the source identity alone)


def _fact(facts: Facts, name: str, assumed: dict[str, Any]) -> Any:
    value = getattr(facts, name)
    if value is None:
        value = DEFAULTS[name]
        assumed[name] = value
    return value


def _check(conds: list[Condition] | None, gate: str, needs: str, passed: bool, reason: str,
           *facts: str) -> list[str]:
    """The reason of a failed condition (as a list to add), noting the condition in `conds`."""
    if conds is not None:
        conds.append(Condition(gate, needs, passed, "" if passed else reason, facts))
    return [] if passed else [reason]


def _kind_reason(prefix: str, kind: str | None, wrong: str) -> str:
    if kind is None:
        return f"{prefix}: kv kind unknown ({_KIND_HINT})"
    return f"{prefix}: kv kind is {kind} ({wrong})"


def _unquantized_no_cp(conds: list[Condition] | None, gate: str, dep: Deployment, facts: Facts,
                       assumed: dict[str, Any], prefix: str) -> list[str]:
    """The conditions G2 and G0 share: no per-token-head KV quantization, dcp = pcp = 1."""
    reasons = _check(conds, gate, "no per-token-head KV quantization", not _fact(facts, "per_token_head_quant", assumed),
                     f"{prefix}: per-token-head KV quantization", "per_token_head_quant")
    reasons += _check(conds, gate, "dcp 1", dep.dcp == 1, f"{prefix}: dcp is {dep.dcp} (needs 1)")
    reasons += _check(conds, gate, "pcp 1", dep.pcp == 1, f"{prefix}: pcp is {dep.pcp} (needs 1)")
    return reasons


def g1(dep: Deployment, facts: Facts, assumed: dict[str, Any], prefix: str = "not agnostic",
       conds: list[Condition] | None = None, gate: str = "G1") -> tuple[bool, list[str]]:
    """is_parallelism_agnostic of vLLM 0.24-0.27: V1 runner, one group, full attention, not MLA."""
    runner = _fact(facts, "runner", assumed)
    kind = facts.kv_kind
    reasons = _check(conds, gate, "the V1 model runner", runner == "v1",
                     f"{prefix}: runner is {runner} (needs the V1 model runner)", "runner")
    reasons += _check(conds, gate, "exactly one KV cache group", dep.num_groups == 1,
                      f"{prefix}: {dep.num_groups} KV cache groups (needs exactly one)")
    reasons += _check(conds, gate, "full attention, not MLA", kind == "full",
                      _kind_reason(prefix, kind, "MLA exclusion" if kind == "mla" else "needs full attention"),
                      "kv_kind")
    return not reasons, reasons


def g2(dep: Deployment, facts: Facts, assumed: dict[str, Any], prefix: str = "not agnostic",
       conds: list[Condition] | None = None) -> tuple[bool, list[str]]:
    """vLLM 0.28+: G1, tp divides the total KV heads, no per-token-head quant, dcp = pcp = 1."""
    _, reasons = g1(dep, facts, assumed, prefix, conds, gate="G2")
    heads = facts.total_kv_heads
    reasons += _check(conds, "G2", "tp divides the total KV heads", heads is not None and heads % dep.tp == 0,
                      f"{prefix}: total kv heads unknown (tp must divide them; pass --total-kv-heads or --model-config)"
                      if heads is None else
                      f"{prefix}: tp {dep.tp} does not divide {heads} total kv heads (replicated GQA heads)",
                      "total_kv_heads")
    reasons += _unquantized_no_cp(conds, "G2", dep, facts, assumed, prefix)
    return not reasons, reasons


def canonical_gate(dep: Deployment, facts: Facts, assumed: dict[str, Any],
                   prefix: str = "not agnostic (canonical layout)",
                   conds: list[Condition] | None = None) -> tuple[bool, list[str]]:
    """0.28+ widening for canonical rows: certifiable attention (incl. plain MLA),
    world_size == tp, no context parallelism."""
    runner = _fact(facts, "runner", assumed)
    kind = facts.kv_kind
    reasons = _check(conds, "canonical", "the V1 model runner", runner == "v1",
                     f"{prefix}: runner is {runner} (needs the V1 model runner)", "runner")
    reasons += _check(conds, "canonical", "full attention or plain MLA", kind in ("full", "mla"),
                      _kind_reason(prefix, kind, "needs full attention or plain MLA"), "kv_kind")
    reasons += _check(conds, "canonical", "world size = tp", dep.world_size == dep.tp,
                      f"{prefix}: world size {dep.world_size} is not tp {dep.tp} (pp {dep.pp}, pcp {dep.pcp})")
    reasons += _check(conds, "canonical", "no context parallelism (dcp 1)", dep.dcp == 1,
                      f"{prefix}: dcp is {dep.dcp} (needs no context parallelism)")
    return not reasons, reasons


def g0(dep: Deployment, facts: Facts, assumed: dict[str, Any], prefix: str = "not agnostic",
       conds: list[Condition] | None = None) -> tuple[bool, list[str]]:
    """vLLM 0.34 (offloading/config.py:208-249 of the 0.34.0 wheel): only a canonical layout
    can be agnostic, when every layer is certifiable (attention; full or sliding with
    heads that tp splits or replicates; plain MLA; no per-token-head quantization),
    dcp = pcp = 1 and world size = tp. No runner condition (unlike 0.28's widening)."""
    reasons = _check(conds, "G0", "a canonical layout (the source carries canonical_format)", dep.canonical,
                     f"{prefix}: direct (non-canonical) layout, which vLLM 0.34 keeps topology-specific "
                     "(vllm#55191)")
    if not dep.canonical:
        return False, reasons
    kind = facts.kv_kind
    reasons += _check(conds, "G0", "certifiable layers (full, sliding or plain MLA attention)",
                      kind in ("full", "sliding", "mla"),
                      _kind_reason(prefix, kind, "no certifiable layout: needs full, sliding or plain MLA attention"),
                      "kv_kind")
    if kind != "mla":
        heads = facts.total_kv_heads
        reasons += _check(conds, "G0", "tp splits or replicates the KV heads",
                          heads is not None and (heads % dep.tp == 0 or dep.tp % heads == 0),
                          f"{prefix}: total kv heads unknown (pass --total-kv-heads or --model-config)"
                          if heads is None else
                          f"{prefix}: tp {dep.tp} neither divides nor is a multiple of {heads} total kv heads",
                          "total_kv_heads")
    reasons += _unquantized_no_cp(conds, "G0", dep, facts, assumed, prefix)
    reasons += _check(conds, "G0", "world size = tp", dep.world_size == dep.tp,
                      f"{prefix}: world size {dep.world_size} is not tp {dep.tp} (pp {dep.pp}, pcp {dep.pcp})")
    return not reasons, reasons


def canonical_replicated(dep: Deployment, facts: Facts, assumed: dict[str, Any], agnostic: bool,
                         prefix: str = "not replicated", conds: list[Condition] | None = None
                         ) -> tuple[bool, list[str]]:
    """vLLM 0.34 with a canonical layout (offloading/config.py:251-264): replicated when the
    certified canonical layout is pure MLA on one node, single-process or the mp executor."""
    kind = facts.kv_kind
    reasons = _check(conds, "R", "a certified canonical layout", agnostic,
                     f"{prefix}: the canonical layout is not certified")
    reasons += _check(conds, "R", "pure MLA", kind == "mla", _kind_reason(prefix, kind, "needs pure MLA"), "kv_kind")
    nnodes = _fact(facts, "nnodes", assumed)
    reasons += _check(conds, "R", "one node per data-parallel replica", nnodes == 1,
                      f"{prefix}: {nnodes} nodes per data-parallel replica (needs 1)", "nnodes")
    executor = _fact(facts, "executor", assumed) if dep.world_size > 1 else "mp"
    reasons += _check(conds, "R", "one process or the mp executor", executor == "mp",
                      f"{prefix}: executor is {executor} (needs mp, or world size 1)", "executor")
    return not reasons, reasons


def replicated_gate(dep: Deployment, facts: Facts, assumed: dict[str, Any],
                    prefix: str = "not replicated", conds: list[Condition] | None = None) -> tuple[bool, list[str]]:
    """R (0.27+): a single pure-MLA group, tp > 1, pp = pcp = dcp = 1, world_size == tp,
    executor mp, one node per data-parallel replica."""
    kind = facts.kv_kind
    reasons = _check(conds, "R", "pure MLA", kind == "mla", _kind_reason(prefix, kind, "needs pure MLA"), "kv_kind")
    reasons += _check(conds, "R", "a single MLA group", dep.num_groups == 1,
                      f"{prefix}: {dep.num_groups} KV cache groups (needs a single MLA group)")
    reasons += _check(conds, "R", "tp > 1", dep.tp > 1, f"{prefix}: tp is {dep.tp} (needs tp > 1)")
    reasons += _check(conds, "R", "pp 1", dep.pp == 1, f"{prefix}: pp is {dep.pp} (needs 1)")
    reasons += _check(conds, "R", "pcp 1", dep.pcp == 1, f"{prefix}: pcp is {dep.pcp} (needs 1)")
    reasons += _check(conds, "R", "dcp 1", dep.dcp == 1, f"{prefix}: dcp is {dep.dcp} (needs 1)")
    executor = _fact(facts, "executor", assumed)
    reasons += _check(conds, "R", "the mp executor", executor == "mp",
                      f"{prefix}: executor is {executor} (needs mp)", "executor")
    nnodes = _fact(facts, "nnodes", assumed)
    reasons += _check(conds, "R", "one node per data-parallel replica", nnodes == 1,
                      f"{prefix}: {nnodes} nodes per data-parallel replica (needs 1)", "nnodes")
    return not reasons, reasons


def evaluate(profile: str, dep: Deployment, facts: Facts, conds: list[Condition] | None = None) -> GateDecision:
    """The target engine's decision for the writer's deployment (its fs tier always opts in).

    Reasons are listed only when the namespace is not collapsed (they explain why not);
    `conds` collects every condition evaluated, passed or not.
    """
    if profile not in PROFILE_GATES:
        raise ValueError(f"unknown vLLM profile {profile!r}")
    agnostic_gate, has_r, widens = PROFILE_GATES[profile]
    assumed: dict[str, Any] = {}
    if agnostic_gate is None:
        return GateDecision(False, False, [f"not agnostic: {profile} has no parallel-agnostic namespaces"], assumed)
    gate = {"G0": g0, "G1": g1, "G2": g2}[agnostic_gate]
    agnostic, reasons = gate(dep, facts, assumed, conds=conds)
    if widens and dep.canonical:
        wide_ok, wide_reasons = canonical_gate(dep, facts, assumed, conds=conds)
        agnostic = agnostic or wide_ok
        reasons = reasons + wide_reasons
    replicated = False
    if has_r and agnostic_gate == "G0" and dep.canonical:
        replicated, r_reasons = canonical_replicated(dep, facts, assumed, agnostic, conds=conds)
        reasons = reasons + r_reasons
    elif has_r:
        replicated, r_reasons = replicated_gate(dep, facts, assumed, conds=conds)
        reasons = reasons + r_reasons
    collapsed = agnostic or replicated
    return GateDecision(collapsed, replicated, [] if collapsed else reasons, assumed)


def open_facts(profile: str, dep: Deployment, facts: Facts) -> tuple[list[str], dict[str, Any]]:
    """What the gate decision for `dep` rests on that nobody stated: (the facts not given
    whose value would change it, the assumed defaults that would change it if wrong).

    A target computed while such a fact is missing is a guess (identity.md §4: an unknown
    kv kind fails every gate, yet a full-attention model's engine reads the collapsed
    namespace), so reports ask for the fact instead of offering to migrate there.
    """
    def outcome(**values: Any) -> tuple[bool, bool]:
        d = evaluate(profile, dep, replace(facts, **values))
        return d.parallel_agnostic, d.replicated_layout

    unknown = [name for name in UNDEFAULTED if getattr(facts, name) is None]
    # the values that can pass a gate: full attention, MLA or (canonical, 0.34) sliding;
    # kv heads that tp divides
    choices = {"kv_kind": ("full", "mla", "sliding"), "total_kv_heads": (dep.tp,)}
    fills = [dict(zip(unknown, combo)) for combo in product(*[(None, *choices[n]) for n in unknown])]
    missing = [name for name in unknown
               if any(f[name] is not None and outcome(**f) != outcome(**{**f, name: None}) for f in fills)]
    now = outcome()
    assumed = evaluate(profile, dep, facts).assumed_facts
    decisive = {name: value for name, value in assumed.items() if outcome(**{name: NOT_DEFAULT[name]}) != now}
    return missing, decisive


def engine_flags(version: str, *, opt_in: bool, is_parallelism_agnostic: bool,
                 replicated_config: bool) -> tuple[bool, bool]:
    """What FileMapper does with its caller's opt-in and the config's verdicts:
    (parallel_agnostic, replicated_layout) as passed on to the fields function."""
    from kvmigrate.identity.schemes import parse_version

    v = parse_version(version)
    if v < (0, 24):
        return False, False
    if v < (0, 27):
        return opt_in and is_parallelism_agnostic, False
    replicated = opt_in and replicated_config
    return opt_in and (is_parallelism_agnostic or replicated), replicated
