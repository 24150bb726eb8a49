"""vLLM / llm-d identity field schemes S1, S2, S3 and the FileMapper fields function.

S1 (vLLM 0.22–0.25, llm-d flat layout): hash_block_size, gpu_blocks_per_file, groups
    {"block_size", "layer_names"}, raw cache dtype.
S2 (vLLM 0.26): tokens_per_hash, blocks_per_file, groups {"tokens_per_block", ...}.
S3 (vLLM 0.27+): S2 plus `"parallel_agnostic": false` only when not agnostic, dtype
    resolved; optional `replicated_layout` (0.27+), `canonical_format` (0.28+),
    `storage_format` (main after 0.33), each written only when set.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from kvmigrate import layout
from kvmigrate.identity import canonical

COMMON_KEYS = ("model_name", "tp_size", "pp_size", "pcp_size", "dcp_size", "dtype",
               "kv_cache_groups", "inference_engine")
S1_KEYS = ("hash_block_size", "gpu_blocks_per_file")
S2_KEYS = ("tokens_per_hash", "blocks_per_file")
OPTIONAL_KEYS = ("replicated_layout", "canonical_format", "storage_format")
PARALLEL_KEYS = ("tp_size", "pp_size", "pcp_size", "dcp_size")

# Which optional keys each vLLM release's FileMapper knows.
MAIN_VERSION = (99, 0)  # "vLLM main after 0.33"


def parse_version(version: str | tuple[int, ...]) -> tuple[int, ...]:
    if isinstance(version, tuple):
        return version[:2]
    if version == "main":
        return MAIN_VERSION
    parts = version.split(".")
    return int(parts[0]), int(parts[1])


def scheme_for_version(version: str | tuple[int, ...]) -> str:
    v = parse_version(version)
    if v < (0, 26):
        return "S1"
    if v < (0, 27):
        return "S2"
    return "S3"


def known_optional_keys(version: str | tuple[int, ...]) -> tuple[str, ...]:
    v = parse_version(version)
    keys: list[str] = []
    if v >= (0, 27):
        keys.append("replicated_layout")
    if v >= (0, 28):
        keys.append("canonical_format")
    if v >= MAIN_VERSION:
        keys.append("storage_format")
    return tuple(keys)


@dataclass(frozen=True)
class FileMapper:
    """What vLLM's FileMapper computes from its constructor arguments."""

    fields: dict[str, Any]
    rank: int
    family: str = "vllm"

    @property
    def d12(self) -> str:
        return canonical.d12(self.fields, self.family)

    @property
    def base_name(self) -> str:
        return layout.base_name(self.fields["model_name"], self.d12)

    @property
    def rank_dir(self) -> str:
        return layout.rank_dir_name(self.base_name, self.rank)

    def block_relpath(self, hex_hash: str, group: int) -> str:
        return layout.block_relpath(self.base_name, self.rank, hex_hash, group)


def filemapper(version: str | tuple[int, ...], *, model_name: str, tp_size: int, pp_size: int,
               pcp_size: int, dcp_size: int, dtype: str, kv_cache_groups: list[dict[str, Any]],
               rank: int = 0, parallel_agnostic: bool = False,
               hash_block_size: int | None = None, gpu_blocks_per_file: int | None = None,
               tokens_per_hash: int | None = None, blocks_per_file: int | None = None,
               replicated_layout: bool = False, canonical_format: str | None = None,
               storage_format: str | None = None, inference_engine: str = "vllm",
               family: str = "vllm") -> FileMapper:
    """The FileMapper-equivalent fields function of a given vLLM release.

    The arguments are what the engine passes *after* its gates: `parallel_agnostic`
    collapses tp/pp/pcp/dcp to 1 and the rank to 0 before hashing.
    """
    scheme = scheme_for_version(version)
    if parallel_agnostic:
        tp_size = pp_size = pcp_size = dcp_size = 1
        rank = 0
    fields: dict[str, Any] = {
        "model_name": model_name,
        "tp_size": tp_size,
        "pp_size": pp_size,
        "pcp_size": pcp_size,
        "dcp_size": dcp_size,
        "dtype": dtype,
        "kv_cache_groups": kv_cache_groups,
        "inference_engine": inference_engine,
    }
    if scheme == "S1":
        fields["hash_block_size"] = hash_block_size
        fields["gpu_blocks_per_file"] = gpu_blocks_per_file
    else:
        fields["tokens_per_hash"] = tokens_per_hash
        fields["blocks_per_file"] = blocks_per_file
    if scheme == "S3" and not parallel_agnostic:
        fields["parallel_agnostic"] = False
    optional = known_optional_keys(version)
    if replicated_layout and "replicated_layout" in optional:
        fields["replicated_layout"] = True
    if canonical_format and "canonical_format" in optional:
        fields["canonical_format"] = canonical_format
    if storage_format and "storage_format" in optional:
        fields["storage_format"] = storage_format
    return FileMapper(fields, rank, family)


def scheme_of(fields: Mapping[str, Any]) -> str:
    """Scheme label of a vllm/llmd identity (formats.md: S3 when `parallel_agnostic` or a
    0.27+ key is present; an agnostic S3 identity is indistinguishable from S2)."""
    if "hash_block_size" in fields:
        return "S1"
    if "parallel_agnostic" in fields or any(k in fields for k in OPTIONAL_KEYS):
        return "S3"
    return "S2"


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_fields(fields: Mapping[str, Any]) -> list[str]:
    """Type problems of a vllm/llmd identity (empty: usable). Unknown keys are allowed."""
    problems: list[str] = []
    scheme_keys = S1_KEYS if "hash_block_size" in fields else S2_KEYS
    for key in COMMON_KEYS + scheme_keys:
        if key not in fields:
            problems.append(f"missing key '{key}'")
    for key in PARALLEL_KEYS + scheme_keys:
        if key in fields and not (_is_int(fields[key]) and fields[key] > 0):
            problems.append(f"'{key}' must be a positive integer")
    for key in ("model_name", "dtype", "inference_engine"):
        if key in fields and not (isinstance(fields[key], str) and fields[key]):
            problems.append(f"'{key}' must be a non-empty string")
    groups = fields.get("kv_cache_groups")
    if "kv_cache_groups" in fields:
        gkey = "block_size" if "hash_block_size" in fields else "tokens_per_block"
        if not isinstance(groups, list):
            problems.append("'kv_cache_groups' must be a list")
        else:
            for i, g in enumerate(groups):
                if not isinstance(g, dict):
                    problems.append(f"kv_cache_groups[{i}] must be an object")
                    continue
                size = g.get(gkey)
                if not (_is_int(size) and size > 0):
                    problems.append(f"kv_cache_groups[{i}].{gkey} must be a positive integer")
                names = g.get("layer_names")
                if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
                    problems.append(f"kv_cache_groups[{i}].layer_names must be a list of strings")
    if "parallel_agnostic" in fields and fields["parallel_agnostic"] is not False:
        problems.append("'parallel_agnostic' may only be written as false")
    if "replicated_layout" in fields and fields["replicated_layout"] is not True:
        problems.append("'replicated_layout' may only be written as true")
    for key in ("canonical_format", "storage_format"):
        if key in fields and not isinstance(fields[key], str):
            problems.append(f"'{key}' must be a string")
    return problems


def unknown_keys(fields: Mapping[str, Any]) -> list[str]:
    """Keys no released scheme writes (kept in the source digest, never copied to a target)."""
    known = set(COMMON_KEYS) | set(S1_KEYS) | set(S2_KEYS) | set(OPTIONAL_KEYS) | {"parallel_agnostic"}
    return sorted(k for k in fields if k not in known)
