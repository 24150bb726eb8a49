"""Identity engine: canonical JSON and digests, vLLM field schemes, gates, deployment
facts and the vLLM target recipe (identity.md). Family detection and the target of a
namespace are the family registry's (kvmigrate.families.detect, .compute_target), which
sits above this package.

The names below load their module on first use, so the CLI's option tables can read
`kvmigrate.identity.values` without importing the whole engine (`--help` stays fast).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "canonical_bytes": "canonical", "config_json_bytes": "canonical", "d12": "canonical",
    "fields_from_config_bytes": "canonical", "full_digest": "canonical",
    "Facts": "facts", "FactsResolver": "facts",
    "DEFAULT_PROFILE": "gates", "PROFILES": "gates", "VLLM_PROFILES": "gates", "Deployment": "gates",
    "GateDecision": "gates",
    "facts_from_hf_config": "hfconfig",
    "filemapper": "schemes", "scheme_of": "schemes", "unknown_keys": "schemes", "validate_fields": "schemes",
    "Target": "vllm_target",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
