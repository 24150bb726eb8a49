"""What to synthesise (SynthSpec) and what was written (SynthResult)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmigrate.identity.values import FAMILIES, SYNTH_FAMILIES
from kvmigrate.units import agreeing

if TYPE_CHECKING:  # the JSON models are types only (kvmigrate.outputs)
    from kvmigrate.outputs import SynthOutput

SCHEMES = ("S1", "S2", "S3")
# the families whose blocks these defect tables damage (LMCache tiers have their own: synth/lmcache.py)
PAGED = tuple(f for f in FAMILIES if f not in ("lmcache", "mooncake"))
TREES = tuple(f for f in PAGED if f != "sglang")  # the families that write base and rank folders
KV_KINDS = ("full", "mla")

# Defects that damage one block (each takes its own victim block) and the families
# they make sense for. The others add or break files and folders around the blocks.
BLOCK_DEFECTS = {
    "missing_rank": ("llmd", "vllmcpp", "sglang"),
    "replica_differs": ("llmd", "vllmcpp", "sglang"),
    "size_mismatch": PAGED,
    "short": PAGED,
    "zero_filled": PAGED,
    "misfiled": TREES,
    "unreadable": PAGED,
    "padded_legacy": ("llmd",),
    "header_magic": ("vllmcpp",),
    "header_key_size": ("vllmcpp",),
    "header_version": ("vllmcpp",),
    "header_digest": ("vllmcpp",),
    "header_payload_size": ("vllmcpp",),
    "header_key": ("vllmcpp",),
}
TREE_DEFECTS = {
    "tmp_vllm": TREES,
    "tmp_cpp_block": TREES,
    "tmp_cpp_config": TREES,
    "tmp_probe": TREES,
    "foreign": PAGED,
    "symlink": PAGED,
    "fifo": TREES,
    "config_missing": TREES,
    "config_unparsable": TREES,
    "digest_mismatch": TREES,
    "deep_layout": TREES,
    "pp_stage": ("llmd",),
    "orphan_rank": TREES,
}
# SGLang HiCache directories only (synth/sglang.py): temp files of 0.5.20+ and 0.5.14-0.5.19,
# a torch.save payload (0.4.9.post3 - 0.4.10.post1)
FLAT_DEFECTS = {"tmp_sglang": ("sglang",), "tmp_sglang_old": ("sglang",), "zip_payload": ("sglang",)}
DEFECTS = tuple(BLOCK_DEFECTS) + tuple(TREE_DEFECTS) + tuple(FLAT_DEFECTS)


@dataclass
class SynthSpec:
    """One synthetic deployment: a writer family, its era and geometry, and the defects
    to inject. `build()` turns it into one or more namespaces under a root."""

    family: str = "vllm"            # vllm | llmd | vllmcpp
    scheme: str = "S1"              # S1 | S2 | S3 (vllm); llmd always S1; vllmcpp ignores it
    model_name: str = "meta-llama/Llama-3.1-8B-Instruct"
    tp: int = 1
    pp: int = 1                     # llmd pp>1: one base folder per pipeline stage (its layers only)
    dcp: int = 1
    kv_kind: str = "full"           # full | mla
    layers: int = 4                 # per KV cache group
    tensors_per_layer: int = 2      # full attention K, V (mla: always 1)
    page_bytes: int = 256           # one tensor's page for one GPU block on one rank
    blocks: int = 8                 # block keys per rank folder per group
    blocks_per_file: int = 1        # llm-d gpu_blocks_per_file / vLLM blocks_per_file (B)
    block_tokens: int = 16
    groups: int = 1
    hash_len: int = 64              # hex chars of a block name: 64 or 32
    dtype: str = "auto"             # S3 writes it resolved ("bfloat16") unless given explicitly
    replicated_layout: bool = False  # vllm S3 MLA tp>1: the collapsed replicated namespace (1 cell)
    agnostic: bool = False          # vllm: the collapsed parallel-agnostic namespace (tp folded to 1)
    canonical_format: str | None = None  # vllm S3: canonical rows (full pages, one copy)
    seed: int = 0
    defects: tuple[str, ...] = ()
    # sglang (synth/sglang.py): the writer era e1..e4, --hicache-mem-layout (None: the
    # era's default, layer_first up to e3, page_first for e4), attention-CP size, side pools
    sgl_era: str = "e4"
    sgl_layout: str | None = None
    cp: int = 1
    pools: tuple[str, ...] = ()
    extra_fields: dict = field(default_factory=dict)  # unknown identity keys
    # lmcache (synth/lmcache.py): backend, key era, tier folder ("." = ROOT itself), tags
    # ("name%value"), fs RemoteMetadata header, MLA save_only_first_rank, GDS names
    # (auto: quoted for lmc-k3, the <= 0.4.2 `_` names before), MP cache_salt
    lmc_backend: str = "fs"
    lmc_era: str = "lmc-k3"
    lmc_tier: str = "cache"
    lmc_tags: tuple[str, ...] = ()
    lmc_fs_header: bool = True
    lmc_save_only_first_rank: bool = True
    lmc_gds_names: str = "auto"
    lmc_salt: str = ""
    # mooncake (synth/mooncake.py): backend, engine, key scheme and tenant, store folder under
    # ROOT ("." = ROOT itself), vLLM cache prefix ("" none, "auto" an auto-<hex>), file-per-key
    # folder, keys per bucket pair
    mc_backend: str = "bucket"
    mc_engine: str = "vllm"
    mc_scheme: str = "mc-scoped"
    mc_tenant: str = "default"
    mc_store: str = "store"
    mc_cache_prefix: str = ""
    mc_fsdir: str = "file_per_key_dir"
    mc_bucket_keys: int = 500

    def __post_init__(self) -> None:
        if isinstance(self.defects, str):
            self.defects = tuple(d.strip() for d in self.defects.split(",") if d.strip())
        else:
            self.defects = tuple(self.defects)
        self.extra_fields = dict(self.extra_fields or {})
        if isinstance(self.pools, str):
            self.pools = tuple(p.strip() for p in self.pools.split(",") if p.strip())
        self.pools = tuple(self.pools)
        if isinstance(self.lmc_tags, str):
            self.lmc_tags = tuple(t.strip() for t in self.lmc_tags.split(",") if t.strip())
        self.lmc_tags = tuple(self.lmc_tags)
        if self.sgl_layout is None:
            self.sgl_layout = "page_first" if self.sgl_era == "e4" else "layer_first"

    @property
    def tensors_per_group(self) -> int:
        """T: tensors of one KV cache group (MLA: one latent tensor per layer)."""
        return self.layers * (1 if self.kv_kind == "mla" else self.tensors_per_layer)

    def replace(self, **changes: Any) -> SynthSpec:
        return dataclasses.replace(self, **changes)


def check_spec(spec: SynthSpec) -> None:
    """Refuse combinations no writer produces, with a message that says what to change."""
    def bad(msg: str) -> None:
        raise ValueError(f"synth: {msg}")

    if spec.family not in SYNTH_FAMILIES:
        bad(f"family must be one of {', '.join(SYNTH_FAMILIES)}, got {spec.family!r}")
    if spec.family == "lmcache":  # its own defects and rules (synth/lmcache.py)
        from kvmigrate.synth import lmcache

        lmcache.check(spec)
        return
    if spec.family == "mooncake":  # stores of bucket pairs or KVEntries (synth/mooncake.py)
        from kvmigrate.synth import mooncake

        mooncake.check(spec)
        return
    if spec.kv_kind not in KV_KINDS:
        bad(f"kv_kind must be one of {', '.join(KV_KINDS)}, got {spec.kv_kind!r}")
    if spec.family == "vllm" and spec.scheme not in SCHEMES:
        bad(f"scheme must be one of {', '.join(SCHEMES)}, got {spec.scheme!r}")
    for name in ("tp", "pp", "dcp", "layers", "tensors_per_layer", "page_bytes", "blocks", "blocks_per_file",
                 "block_tokens", "groups"):
        value = getattr(spec, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            bad(f"{name} must be a positive integer, got {value!r}")
    if spec.hash_len % 2 or not 6 <= spec.hash_len <= 64:
        bad(f"hash_len must be an even number of hex chars in 6..64, got {spec.hash_len}")
    if not spec.model_name:
        bad("model_name must not be empty")
    unknown = [d for d in spec.defects if d not in DEFECTS]
    if unknown:
        bad(f"unknown {agreeing(len(unknown), 'defect')} {', '.join(unknown)}; known: {', '.join(DEFECTS)}")
    for d in spec.defects:
        families = BLOCK_DEFECTS.get(d) or TREE_DEFECTS.get(d) or FLAT_DEFECTS[d]
        if spec.family not in families:
            bad(f"defect {d!r} applies to family {'/'.join(families)}, not {spec.family!r}")
    if len(set(spec.defects)) != len(spec.defects):
        bad("each defect may be listed once")

    if spec.family == "sglang":
        from kvmigrate.synth import sglang

        sglang.check(spec)
        return
    if spec.family == "vllm":
        if spec.pp != 1:
            bad("vllm rows with pp > 1 are not synthesised (use family llmd for pipeline stages)")
        if spec.replicated_layout and not (spec.scheme == "S3" and spec.kv_kind == "mla" and spec.tp > 1
                                           and spec.dcp == 1):
            bad("replicated_layout needs scheme S3, kv_kind mla, tp > 1 and dcp 1 (vLLM 0.27+ gate R)")
        if spec.canonical_format and spec.scheme != "S3":
            bad("canonical_format needs scheme S3 (vLLM 0.28+)")
    else:
        if spec.replicated_layout or spec.agnostic or spec.canonical_format:
            bad(f"replicated_layout/agnostic/canonical_format are vllm options, not {spec.family}")
    if spec.family == "llmd":
        if spec.scheme != "S1":
            bad("llm-d writes scheme S1 only")
        if spec.layers % spec.pp:
            bad(f"layers ({spec.layers}) must be divisible by pp ({spec.pp}) to split pipeline stages")
    if spec.family == "vllmcpp":
        if spec.hash_len != 64:
            bad("vllm.cpp keys are 32-byte hashes: hash_len must be 64")
        if spec.pp != 1 or spec.blocks_per_file != 1:
            bad("vllm.cpp writes one GPU block per file with pp 1")


def _json_safe(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


@dataclass
class SynthResult:
    """What build() wrote.

    namespaces: one dict per base folder (see `kvmigrate.synth.tree.namespace_dict`).
    blocks: one dict per (block key, group): hex, group, index, and `files` {rank: relpath
        or None when a defect removed or moved it}, `defect` (name or None).
    defects: one dict per injected defect: name, relpath (the file or folder affected),
        status (interface.md §2), reason (a fragment the manifest reason should contain,
        case-insensitive), rows (relpaths whose manifest row must carry `status`),
        base_name, block, group, rank, namespace_status (for namespace-level defects).
    Mooncake stores (synth/mooncake.py) differ: a block has `objects` (key, storage_key,
    rank, pp, half, client_root, relpath, object_index, size, bucket) instead of `files`;
    a defect has `statuses` per file, `objects` per object row, and `deleted`,
    `refuses_start`, `read_fails` (what the next client start does).
    """

    root: Path
    namespaces: list[dict] = field(default_factory=list)
    blocks: list[dict] = field(default_factory=list)
    defects: list[dict] = field(default_factory=list)

    def to_dict(self) -> SynthOutput:
        return _json_safe({"root": str(self.root), "namespaces": self.namespaces, "blocks": self.blocks,
                           "defects": self.defects})

    def block_files(self) -> list[str]:
        """Relpaths of every block file still at its proper place."""
        return [rel for b in self.blocks for rel in b.get("files", {}).values() if rel is not None]

    def defect(self, name: str) -> dict:
        """The record of defect `name` (the first one, for per-stage records)."""
        for d in self.defects:
            if d["name"] == name:
                return d
        raise KeyError(name)
