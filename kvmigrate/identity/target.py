"""Moved: the `Target` record and the vLLM target recipe to kvmigrate.identity.vllm_target
(below the family registry), the dispatch "target for a namespace" (compute_target,
source_problems) to the registry, kvmigrate.families. This module only re-exports them
for the old import paths; it sits above the registry, and nothing imports it back."""

from __future__ import annotations

# moved to kvmigrate.families; callers in scan/plan/apply switch in pass 2b
from kvmigrate.families import compute_target, source_problems  # noqa: F401
from kvmigrate.identity.vllm_target import (ALIASES_SOURCE, HASH_GRANULARITY_CHANGED, PROFILE_VERSIONS,  # noqa: F401
                                            RANK_PRIVATE_SHARD, RESOLVED_DTYPES, Target, target_lacks, vllm_target)
