"""The namespaces a SynthSpec's writer creates: identity fields, folder names, geometry.

vLLM and llm-d identities come from `kvmigrate.identity.schemes.filemapper` with the
release that wrote the era (S1: 0.22, or 0.24 when agnostic; S2: 0.26; S3: 0.28), so the
folder names are the ones the real engines produce. vllm.cpp uses its 28-key identity
with `rank` inside the digest: one base folder and config.json per rank.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from kvmigrate import layout
from kvmigrate.identity.canonical import config_json_bytes, full_digest
from kvmigrate.identity.schemes import filemapper, scheme_of
from kvmigrate.synth.pages import ROW_ALIGN, geometry
from kvmigrate.synth.spec import SynthSpec

# The default NONE_HASH chain seed of vllm.cpp (vllmcpp-format.md §2.4 C).
VLLMCPP_NONE_HASH = "950bc4c76b023aa9f8388d6705b601adfc50516140dd1f2b8fc90bed037b2070"
VLLMCPP_HEADER = 128
VERSION_OF_ERA = {"S1": "0.22", "S2": "0.26", "S3": "0.28"}
RESOLVED_DTYPE = "bfloat16"  # what an "auto" cache dtype resolves to in S3 (synthetic models are bf16)


@dataclass
class Namespace:
    """One base folder and the rank folders that belong to it."""

    family: str
    era: str
    fields: dict[str, Any]
    ranks: list[int]
    tensors: list[int]            # tensor indices of each group this namespace stores (global in the group)
    cells: int = 1                # vLLM: worker cells per row
    canonical: bool = False       # vLLM: canonical rows (full pages)
    stage: int | None = None      # llm-d pipeline stage
    canonical_family: str = "vllm"  # digest recipe
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        return full_digest(self.fields, self.canonical_family)

    @property
    def d12(self) -> str:
        return self.digest[:12]

    @property
    def base_name(self) -> str:
        return layout.base_name(self.fields["model_name"], self.d12)

    def rank_dir(self, rank: int) -> str:
        return layout.rank_dir_name(self.base_name, rank)

    @property
    def config_bytes(self) -> bytes:
        return config_json_bytes(self.fields, self.canonical_family)

    @property
    def scheme(self) -> str:
        """The scheme label a scanner reports (an agnostic S3 identity reads as S2)."""
        return "vllmcpp-v1" if self.family == "vllmcpp" else scheme_of(self.fields)


def layer_names(spec: SynthSpec, group: int) -> list[str]:
    """Layer names of a KV cache group: group g holds layers g*L .. g*L+L-1 of the model."""
    return [f"model.layers.{group * spec.layers + i}.self_attn.attn" for i in range(spec.layers)]


def tensors_per_layer(spec: SynthSpec) -> int:
    return 1 if spec.kv_kind == "mla" else spec.tensors_per_layer


def stage_layers(spec: SynthSpec, stage: int) -> range:
    """Positions (within a group's layer list) of the layers pipeline stage `stage` holds."""
    per_stage = spec.layers // spec.pp
    return range(stage * per_stage, (stage + 1) * per_stage)


def tensors_of(spec: SynthSpec, positions: range | None = None) -> list[int]:
    """Tensor indices (layer-major, K before V) of the given layer positions."""
    k = tensors_per_layer(spec)
    positions = range(spec.layers) if positions is None else positions
    return [i * k + j for i in positions for j in range(k)]


def cache_dtype(spec: SynthSpec, resolved: bool) -> str:
    if spec.dtype == "auto" and resolved:
        return RESOLVED_DTYPE
    return spec.dtype


def _vllm_groups(spec: SynthSpec, scheme: str, positions: range | None = None) -> list[dict[str, Any]]:
    groups = []
    for g in range(spec.groups):
        names = layer_names(spec, g)
        if positions is not None:
            names = [names[i] for i in positions]
        if scheme == "S1":
            groups.append({"block_size": spec.block_tokens, "layer_names": names})
        else:
            groups.append({"tokens_per_block": spec.block_tokens * spec.dcp, "layer_names": names})
    return groups


def vllm_namespace(spec: SynthSpec) -> Namespace:
    """The scheduler-side vLLM writer: one namespace, rows under `_r0` only."""
    scheme = spec.scheme
    collapse = spec.agnostic or spec.replicated_layout
    version = VERSION_OF_ERA[scheme]
    if scheme == "S1" and collapse:
        version = "0.24"  # the first release with the agnostic gate
    mapper = filemapper(
        version, model_name=spec.model_name, tp_size=spec.tp, pp_size=spec.pp, pcp_size=1, dcp_size=spec.dcp,
        dtype=cache_dtype(spec, resolved=scheme == "S3"), kv_cache_groups=_vllm_groups(spec, scheme),
        rank=0, parallel_agnostic=collapse,
        hash_block_size=spec.block_tokens, gpu_blocks_per_file=spec.blocks_per_file,
        tokens_per_hash=spec.block_tokens * spec.dcp, blocks_per_file=spec.blocks_per_file,
        replicated_layout=spec.replicated_layout, canonical_format=spec.canonical_format)
    fields = dict(mapper.fields)
    fields.update(spec.extra_fields)
    one_cell = spec.replicated_layout or bool(spec.canonical_format)
    return Namespace("vllm", scheme, fields, ranks=[0], tensors=tensors_of(spec),
                     cells=1 if one_cell else spec.tp * spec.pp, canonical=bool(spec.canonical_format))


def llmd_namespaces(spec: SynthSpec) -> list[Namespace]:
    """The llm-d worker-side writer: every rank its own `_r<rank>`; one base per PP stage."""
    out = []
    for stage in range(spec.pp):
        positions = stage_layers(spec, stage) if spec.pp > 1 else None
        mapper = filemapper(
            "0.22", model_name=spec.model_name, tp_size=spec.tp, pp_size=spec.pp, pcp_size=1, dcp_size=spec.dcp,
            dtype=cache_dtype(spec, resolved=False), kv_cache_groups=_vllm_groups(spec, "S1", positions),
            hash_block_size=spec.block_tokens, gpu_blocks_per_file=spec.blocks_per_file, family="llmd")
        fields = dict(mapper.fields)
        fields.update(spec.extra_fields)
        ranks = [stage * spec.tp + r for r in range(spec.tp)]  # global rank = pp_rank * tp + tp_rank
        out.append(Namespace("llmd", "S1", fields, ranks=ranks, tensors=tensors_of(spec, positions),
                             stage=stage if spec.pp > 1 else None, canonical_family="llmd"))
    return out


def _model_facts(model_name: str) -> dict[str, Any]:
    """Plausible architecture strings for the vllm.cpp identity (opaque to every reader)."""
    low = model_name.lower()
    if "qwen3" in low:
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "max_position_embeddings": 40960,
                "rope_config": "theta=1000000,dim=128,scaling=none"}
    if "deepseek" in low:
        return {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                "max_position_embeddings": 163840, "rope_config": "theta=10000,dim=64,scaling=yarn"}
    if "llama" in low:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 131072,
                "rope_config": "theta=500000,dim=128,scaling=llama3"}
    return {"architectures": ["SynthForCausalLM"], "model_type": "synth", "max_position_embeddings": 32768,
            "rope_config": "theta=10000,dim=128,scaling=none"}


def vllmcpp_identity(spec: SynthSpec, rank: int) -> dict[str, Any]:
    """The 28-key CacheIdentity of one vllm.cpp rank (vllmcpp-format.md §2.1)."""
    mla = spec.kv_kind == "mla"
    facts = _model_facts(spec.model_name)
    identity: dict[str, Any] = {
        "architectures": facts["architectures"],
        "block_size": spec.block_tokens,
        "checkpoint_fingerprint": "sha256:" + hashlib.sha256(f"weights:{spec.model_name}".encode()).hexdigest()[:16],
        "dcp_size": spec.dcp,
        "format_version": 1,
        "hash_algo": "sha256_cbor",
        "hash_block_size": spec.block_tokens,
        "head_size": 576 if mla else 128,
        "head_size_v": 0 if mla else 128,
        "hf_config_digest": hashlib.sha256(f"hf-config:{spec.model_name}".encode()).hexdigest(),
        "inference_engine": "vllm.cpp",
        "kv_cache_spec_kind": "mla" if mla else "full_attention",
        "kv_dtype": "bf16" if spec.dtype == "auto" else spec.dtype,
        "kv_quant_mode": "none",
        "max_position_embeddings": facts["max_position_embeddings"],
        "model_name": spec.model_name,
        "model_type": facts["model_type"],
        "none_hash_hex": VLLMCPP_NONE_HASH,
        "num_hidden_layers": spec.layers * spec.groups,
        "num_kv_heads": 1 if mla else 8,
        "page_size_bytes": spec.tensors_per_group * spec.page_bytes,
        "pcp_size": 1,
        "pp_size": spec.pp,
        "rank": rank,
        "rope_config": facts["rope_config"],
        "sliding_window": -1,
        "tp_size": spec.tp,
        "weight_quantization": "none",
    }
    identity.update(spec.extra_fields)
    return identity


def vllmcpp_namespaces(spec: SynthSpec) -> list[Namespace]:
    """vllm.cpp: the rank is inside the digest, so each rank has its own base folder."""
    out = []
    deployment = full_digest(vllmcpp_identity(spec, 0), "vllmcpp")
    for rank in range(spec.tp):
        ns = Namespace("vllmcpp", "vllmcpp-v1", vllmcpp_identity(spec, rank), ranks=[rank], tensors=tensors_of(spec),
                       canonical_family="vllmcpp")
        ns.extra["deployment"] = deployment
        out.append(ns)
    return out


def plan_namespaces(spec: SynthSpec) -> list[Namespace]:
    if spec.family == "vllm":
        return [vllm_namespace(spec)]
    if spec.family == "llmd":
        return llmd_namespaces(spec)
    return vllmcpp_namespaces(spec)


def file_size(spec: SynthSpec, ns: Namespace) -> int:
    """Size of every healthy block file of the namespace (the same for every group)."""
    if ns.family == "vllm":
        page = geometry(spec).full_page_bytes if ns.canonical else spec.page_bytes
        data = ns.cells * len(ns.tensors) * spec.blocks_per_file * page
        return data + (-data % ROW_ALIGN)
    if ns.family == "llmd":
        return spec.blocks_per_file * len(ns.tensors) * spec.page_bytes
    return VLLMCPP_HEADER + len(ns.tensors) * spec.page_bytes


def expected_family(spec: SynthSpec, ns: Namespace) -> str:
    """The family a scanner must report (formats.md §3): S1 trees may be ambiguous."""
    if ns.family == "vllmcpp" or ns.scheme != "S1":
        return ns.family
    if ns.family == "llmd" and (any(r != 0 for r in ns.ranks) or file_size(spec, ns) % ROW_ALIGN):
        return "llmd"
    return "ambiguous"


def namespace_dict(spec: SynthSpec, ns: Namespace) -> dict[str, Any]:
    """The SynthResult record of a namespace; also a PageGeometry source for page_bytes_for."""
    return {
        "base_name": ns.base_name,
        "d12": ns.d12,
        "digest": ns.digest,
        "config_relpath": f"{ns.base_name}/{layout.CONFIG_NAME}",
        "rank_dirs": [ns.rank_dir(r) for r in ns.ranks],
        "ranks": list(ns.ranks),
        "family": ns.family,
        "expected_family": expected_family(spec, ns),
        "scheme": ns.scheme,
        "era": ns.era,
        "fields": ns.fields,
        "deployment": ns.extra.get("deployment", ns.base_name),
        "model_name": spec.model_name,
        "seed": spec.seed,
        "tp": spec.tp,
        "pp": spec.pp,
        "dcp": spec.dcp,
        "stage": ns.stage,
        "kv_kind": spec.kv_kind,
        "layers": spec.layers,
        "tensors_per_layer": tensors_per_layer(spec),
        "tensors": list(ns.tensors),
        "page_bytes": spec.page_bytes,
        "blocks_per_file": spec.blocks_per_file,
        "groups": spec.groups,
        "hash_len": spec.hash_len,
        "cells": ns.cells,
        "canonical": ns.canonical,
        "agnostic": spec.family == "vllm" and (spec.agnostic or spec.replicated_layout),
        "replicated_layout": spec.replicated_layout,
        "file_size": file_size(spec, ns),
    }
