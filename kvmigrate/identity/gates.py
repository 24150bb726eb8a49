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

# profile -> (agnostic gate, replicated gate R?, canonical widening?)
PROFILE_GATES: dict[str, tuple[str | None, bool, bool]] = {
    "vllm-0.22": (None, False, False),
    "vllm-0.24": ("G1", False, False),
    "vllm-0.26": ("G1", False, False),
    "vllm-0.27": ("G1", True, False),
    "vllm-0.28": ("G2", True, True),
}

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


def _fact(facts: Facts, name: str, assumed: dict[str, Any]) -> Any:
    value = getattr(facts, name)
    if value is None:
        value = DEFAULTS[name]
        assumed[name] = value
    return value


def g1(dep: Deployment, facts: Facts, assumed: dict[str, Any], prefix: str = "not agnostic") -> tuple[bool, list[str]]:
    """is_parallelism_agnostic of vLLM 0.24-0.27: V1 runner, one group, full attention, not MLA."""
    reasons: list[str] = []
    runner = _fact(facts, "runner", assumed)
    if runner != "v1":
        reasons.append(f"{prefix}: runner is {runner} (needs the V1 model runner)")
    if dep.num_groups != 1:
        reasons.append(f"{prefix}: {dep.num_groups} KV cache groups (needs exactly one)")
    kind = facts.kv_kind
    if kind is None:
        reasons.append(f"{prefix}: kv kind unknown ({_KIND_HINT})")
    elif kind == "mla":
        reasons.append(f"{prefix}: kv kind is mla (MLA exclusion)")
    elif kind != "full":
        reasons.append(f"{prefix}: kv kind is {kind} (needs full attention)")
    return not reasons, reasons


def g2(dep: Deployment, facts: Facts, assumed: dict[str, Any], prefix: str = "not agnostic") -> tuple[bool, list[str]]:
    """vLLM 0.28+: G1, tp divides the total KV heads, no per-token-head quant, dcp = pcp = 1."""
    _, reasons = g1(dep, facts, assumed, prefix)
    heads = facts.total_kv_heads
    if heads is None:
        reasons.append(f"{prefix}: total kv heads unknown (tp must divide them; "
                       "pass --total-kv-heads or --model-config)")
    elif heads % dep.tp != 0:
        reasons.append(f"{prefix}: tp {dep.tp} does not divide {heads} total kv heads (replicated GQA heads)")
    if _fact(facts, "per_token_head_quant", assumed):
        reasons.append(f"{prefix}: per-token-head KV quantization")
    if dep.dcp != 1:
        reasons.append(f"{prefix}: dcp is {dep.dcp} (needs 1)")
    if dep.pcp != 1:
        reasons.append(f"{prefix}: pcp is {dep.pcp} (needs 1)")
    return not reasons, reasons


def canonical_gate(dep: Deployment, facts: Facts, assumed: dict[str, Any],
                   prefix: str = "not agnostic (canonical layout)") -> tuple[bool, list[str]]:
    """0.28+ widening for canonical rows: certifiable attention (incl. plain MLA),
    world_size == tp, no context parallelism."""
    reasons: list[str] = []
    runner = _fact(facts, "runner", assumed)
    if runner != "v1":
        reasons.append(f"{prefix}: runner is {runner} (needs the V1 model runner)")
    kind = facts.kv_kind
    if kind is None:
        reasons.append(f"{prefix}: kv kind unknown ({_KIND_HINT})")
    elif kind not in ("full", "mla"):
        reasons.append(f"{prefix}: kv kind is {kind} (needs full attention or plain MLA)")
    if dep.world_size != dep.tp:
        reasons.append(f"{prefix}: world size {dep.world_size} is not tp {dep.tp} (pp {dep.pp}, pcp {dep.pcp})")
    if dep.dcp != 1:
        reasons.append(f"{prefix}: dcp is {dep.dcp} (needs no context parallelism)")
    return not reasons, reasons


def replicated_gate(dep: Deployment, facts: Facts, assumed: dict[str, Any],
                    prefix: str = "not replicated") -> tuple[bool, list[str]]:
    """R (0.27+): a single pure-MLA group, tp > 1, pp = pcp = dcp = 1, world_size == tp,
    executor mp, one node per data-parallel replica."""
    reasons: list[str] = []
    kind = facts.kv_kind
    if kind is None:
        reasons.append(f"{prefix}: kv kind unknown ({_KIND_HINT})")
    elif kind != "mla":
        reasons.append(f"{prefix}: kv kind is {kind} (needs pure MLA)")
    if dep.num_groups != 1:
        reasons.append(f"{prefix}: {dep.num_groups} KV cache groups (needs a single MLA group)")
    if dep.tp <= 1:
        reasons.append(f"{prefix}: tp is {dep.tp} (needs tp > 1)")
    if dep.pp != 1:
        reasons.append(f"{prefix}: pp is {dep.pp} (needs 1)")
    if dep.pcp != 1:
        reasons.append(f"{prefix}: pcp is {dep.pcp} (needs 1)")
    if dep.dcp != 1:
        reasons.append(f"{prefix}: dcp is {dep.dcp} (needs 1)")
    executor = _fact(facts, "executor", assumed)
    if executor != "mp":
        reasons.append(f"{prefix}: executor is {executor} (needs mp)")
    nnodes = _fact(facts, "nnodes", assumed)
    if nnodes != 1:
        reasons.append(f"{prefix}: {nnodes} nodes per data-parallel replica (needs 1)")
    return not reasons, reasons


def evaluate(profile: str, dep: Deployment, facts: Facts) -> GateDecision:
    """The target engine's decision for the writer's deployment (its fs tier always opts in).

    Reasons are listed only when the namespace is not collapsed (they explain why not).
    """
    if profile not in PROFILE_GATES:
        raise ValueError(f"unknown vLLM profile {profile!r}")
    agnostic_gate, has_r, widens = PROFILE_GATES[profile]
    assumed: dict[str, Any] = {}
    if agnostic_gate is None:
        return GateDecision(False, False, [f"not agnostic: {profile} has no parallel-agnostic namespaces"], assumed)
    gate = g1 if agnostic_gate == "G1" else g2
    agnostic, reasons = gate(dep, facts, assumed)
    if widens and dep.canonical:
        wide_ok, wide_reasons = canonical_gate(dep, facts, assumed)
        agnostic = agnostic or wide_ok
        reasons = reasons + wide_reasons
    replicated = False
    if has_r:
        replicated, r_reasons = replicated_gate(dep, facts, assumed)
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
    # the values that can pass a gate: full attention or MLA; kv heads that tp divides
    choices = {"kv_kind": ("full", "mla"), "total_kv_heads": (dep.tp,)}
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
