"""Identity engine: canonical JSON and digests, vLLM field schemes, gates, deployment
facts, family detection and target computation (identity.md, formats.md §3)."""

from kvmigrate.identity.canonical import canonical_bytes, config_json_bytes, d12, fields_from_config_bytes, full_digest
from kvmigrate.identity.facts import Facts, FactsResolver
from kvmigrate.identity.family import ambiguity_is_harmless, detect_family, harmless_ambiguity_note
from kvmigrate.identity.gates import DEFAULT_PROFILE, PROFILES, VLLM_PROFILES, Deployment, GateDecision
from kvmigrate.identity.hfconfig import facts_from_hf_config
from kvmigrate.identity.schemes import filemapper, scheme_of, unknown_keys, validate_fields
from kvmigrate.identity.target import Target, compute_target

__all__ = [
    "DEFAULT_PROFILE", "PROFILES", "VLLM_PROFILES", "Deployment", "Facts", "FactsResolver", "GateDecision", "Target",
    "ambiguity_is_harmless", "canonical_bytes", "compute_target", "config_json_bytes", "d12", "detect_family",
    "facts_from_hf_config", "fields_from_config_bytes", "filemapper", "full_digest", "harmless_ambiguity_note",
    "scheme_of", "unknown_keys", "validate_fields",
]
