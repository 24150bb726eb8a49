"""Moved: which writer family made a namespace (formats.md §3) is the registry's question,
asked over every family module: `kvmigrate.families.detect`; the S1 ambiguity rule is the
ambiguous reading's (kvmigrate.families.ambiguous). This module only re-exports them for
the old import paths; it sits above the registry, and nothing imports it back."""

from __future__ import annotations

# moved to kvmigrate.families (detect) and kvmigrate.families.ambiguous; callers in
# scan/plan/apply switch in pass 2b
from kvmigrate.families import detect as detect_family  # noqa: F401
from kvmigrate.families.ambiguous import ambiguity_is_harmless, harmless_ambiguity_note  # noqa: F401
