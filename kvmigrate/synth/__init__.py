"""Synthetic KV-cache trees for every writer family and era (tests, demo, benchmarks).

    from kvmigrate.synth import SynthSpec, build, page_bytes_for
    result = build(tmp_path, SynthSpec(family="llmd", tp=2, kv_kind="mla", defects=("missing_rank",)))

Trees are deterministic for a given spec (same relpaths, same bytes). Page content is
described in `kvmigrate.synth.pages`; the namespaces each family writes in
`kvmigrate.synth.identities`; the defects and the status each must produce in
`kvmigrate.synth.defects`.
"""

from __future__ import annotations

from kvmigrate.synth.demo import build_demo_root
from kvmigrate.synth.pages import (
    block_hash,
    block_hash_hex,
    canonical_cell_bytes,
    cell_bytes,
    full_page,
    llmd_file_bytes,
    pad_row,
    page_bytes_for,
    vllm_row_bytes,
    vllmcpp_payload,
)
from kvmigrate.synth.spec import DEFECTS, SynthResult, SynthSpec
from kvmigrate.synth.tree import build

__all__ = [
    "DEFECTS",
    "SynthResult",
    "SynthSpec",
    "block_hash",
    "block_hash_hex",
    "build",
    "build_demo_root",
    "canonical_cell_bytes",
    "cell_bytes",
    "full_page",
    "llmd_file_bytes",
    "pad_row",
    "page_bytes_for",
    "vllm_row_bytes",
    "vllmcpp_payload",
]
