"""Deployment facts read from a Hugging Face model `config.json`, by value (identity.md §4).

Only what the gates and transforms need: the attention kind, the total KV heads, the
model dtype (resolves `"auto"` for vLLM >= 0.27) and the MLA latent geometry (page bytes).
Keys are read by *value*, never by presence alone: Qwen2.5 ships `sliding_window: 32768`
with `use_sliding_window: false`, which vLLM serves as full attention.
"""

from __future__ import annotations

import re
from typing import Any

from kvmigrate.identity.values import HF_OTHER_TORCH_DTYPES, HF_SERVED_DTYPES

# dtype spellings -> the name vLLM writes (`str(torch.dtype).removeprefix("torch.")`)
_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float": "float32",
    "float32": "float32",
}
# bytes per element of a (cache) dtype, for page-size arithmetic
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# vLLM's sparse-MLA fp8 cache packs 512 fp8 latent + 4 fp32 scales + 64 bf16 rope per token
FP8_DS_MLA_TOKEN_BYTES = 656

_SLIDING_TYPES = ("sliding",)
_STATE_TYPES = ("mamba", "linear", "ssm", "conv", "recurrent", "deltanet")
_PURE_STATE_MODEL_TYPES = ("mamba", "mamba2", "falcon_mamba")


def normalize_dtype(value: Any) -> str | None:
    """`torch.bfloat16`, `bf16`, `bfloat16` -> `bfloat16`; unknown strings pass through."""
    if not isinstance(value, str) or not value:
        return None
    name = value.strip().removeprefix("torch.")
    return _DTYPE_ALIASES.get(name.lower(), name)


def dtype_bytes(dtype: str | None) -> int | None:
    """Bytes per element of a cache dtype value (None when unknown, e.g. `auto`)."""
    if dtype is None:
        return None
    name = normalize_dtype(dtype) or ""
    if name in _DTYPE_BYTES:
        return _DTYPE_BYTES[name]
    if name.startswith("fp8") or name in ("int8", "uint8"):
        return 1
    return None


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs nest the language model under `text_config`; its values win."""
    inner = cfg.get("text_config")
    if isinstance(inner, dict):
        return {**cfg, **inner}
    return cfg


def _set(v: Any) -> bool:
    return v is not None and v is not False


def _layer_type_class(entry: Any) -> str:
    text = str(entry).lower()
    if any(t in text for t in _STATE_TYPES):
        return "state"
    if any(t in text for t in _SLIDING_TYPES):
        return "sliding"
    return "full"


def kv_kind_of(cfg: dict[str, Any]) -> tuple[str, str]:
    """(kv kind, the config value that decided it), following identity.md §4 in order."""
    c = _text_config(cfg)
    if _set(c.get("kv_lora_rank")):
        for key in ("index_topk", "index_n_heads"):
            if _set(c.get(key)):
                return "hybrid", f"kv_lora_rank={c['kv_lora_rank']} with indexer {key}={c[key]} (sparse MLA)"
        return "mla", f"kv_lora_rank={c['kv_lora_rank']}"
    layer_types = c.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        classes = {_layer_type_class(t) for t in layer_types}
        if "state" in classes:
            return ("mamba" if classes == {"state"} else "hybrid"), "layer_types contains mamba/linear layers"
        if classes == {"sliding"}:
            return "sliding", "layer_types all sliding_attention"
        if classes == {"sliding", "full"}:
            return "hybrid", "layer_types mixes full and sliding attention"
        return "full", "layer_types all full attention"
    pattern = c.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern and "M" in pattern:
        return ("hybrid" if "*" in pattern else "mamba"), f"hybrid_override_pattern {pattern!r} has mamba layers"
    blocks = c.get("layers_block_type")
    if isinstance(blocks, list) and blocks:
        classes = {_layer_type_class(t) for t in blocks}
        if "state" in classes:
            return ("mamba" if classes == {"state"} else "hybrid"), "layers_block_type contains mamba layers"
    if _set(c.get("attn_layer_period")):
        return "hybrid", f"attn_layer_period={c['attn_layer_period']} (attention interleaved with mamba)"
    interval = c.get("full_attention_interval")
    if isinstance(interval, int) and not isinstance(interval, bool) and interval > 1:
        return "hybrid", f"full_attention_interval={interval} (linear-attention layers between full attention)"
    if c.get("model_type") in _PURE_STATE_MODEL_TYPES:
        return "mamba", f"model_type {c['model_type']!r} is a state-space model"
    swp = c.get("sliding_window_pattern")
    if isinstance(swp, int) and not isinstance(swp, bool) and swp > 1 and _set(c.get("sliding_window")):
        return "hybrid", f"sliding_window_pattern={swp} interleaves sliding and full attention"
    if c.get("model_type") == "gemma2" and _set(c.get("sliding_window")):
        return "hybrid", "gemma2 alternates sliding and full attention layers"
    if _set(c.get("attention_chunk_size")):
        return "hybrid", f"attention_chunk_size={c['attention_chunk_size']} (chunked local attention layers)"
    use_sw = c.get("use_sliding_window")
    if use_sw is True:
        return "sliding", "use_sliding_window is true"
    if use_sw is False:
        return "full", "use_sliding_window is false (a sliding_window value alone is unused)"
    sw = c.get("sliding_window")
    if isinstance(sw, int) and not isinstance(sw, bool) and sw > 0:
        return "sliding", f"sliding_window={sw} (no use_sliding_window switch: the engine applies it)"
    return "full", "no MLA, sliding-window or state-space settings"


_COUNT_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num", "num_attention_heads",
               "n_head", "qk_rope_head_dim")


def _check_counts(c: dict[str, Any]) -> None:
    """Head counts and MLA dimensions, when given, are positive integers (else the file is damaged)."""
    keys = _COUNT_KEYS + (("kv_lora_rank",) if _set(c.get("kv_lora_rank")) else ())
    for key in keys:
        v = c.get(key)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            raise ValueError(f"{key} must be a positive integer, got {v!r}")


def _torch_dtype(key: str, value: Any) -> str | None:
    """The torch dtype a config's `torch_dtype` / `dtype` names; a value no torch dtype has is an error."""
    if value is None:
        return None
    name = normalize_dtype(value) if isinstance(value, str) else None
    if name not in HF_SERVED_DTYPES + HF_OTHER_TORCH_DTYPES:
        raise ValueError(f"{key} {value!r} is not a torch dtype (a config.json says bfloat16, float16, float32, "
                         "float8_e4m3fn, ...)")
    return name


def _first_int(c: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        v = c.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def facts_from_hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Facts a Hugging Face `config.json` proves, as a dict with the snake_case fact names.

    Keys (only those the config determines): `kv_kind`, `total_kv_heads`, `model_dtype`
    (not for float32 or fp8 checkpoints, which vLLM serves as a half type chosen per GPU),
    and for MLA models `kv_lora_rank`, `qk_rope_head_dim` (to derive `page_bytes`).
    `kv_kind_evidence` says which value decided the kind. Raises ValueError for a value no
    real config has (a dtype torch does not know, a head count that is not a positive integer).
    """
    if not isinstance(cfg, dict):
        raise ValueError("a Hugging Face config must be a JSON object")
    c = _text_config(cfg)
    _check_counts(c)
    facts: dict[str, Any] = {}
    facts["kv_kind"], facts["kv_kind_evidence"] = kv_kind_of(cfg)
    heads = _first_int(c, ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"))
    if heads is None:
        heads = _first_int(c, ("num_attention_heads", "n_head"))
    if heads is not None:
        facts["total_kv_heads"] = heads
    inner = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else {}
    dtypes = [_torch_dtype(prefix + key, obj.get(key))
              for prefix, obj in (("text_config.", inner), ("", cfg)) for key in ("torch_dtype", "dtype")]
    dtype = next((d for d in dtypes if d is not None), None)
    if dtype in HF_SERVED_DTYPES:
        facts["model_dtype"] = dtype
    elif dtype is not None:
        # vLLM serves float32 (and fp8, ...) checkpoints under --dtype auto as the platform's
        # preferred half type (bfloat16 on most GPUs, float16 on older ones): the config cannot tell
        facts["model_dtype_note"] = (f"torch_dtype {dtype}: vLLM serves it as bfloat16 or float16 depending on "
                                     "the GPU; pass --model-dtype")
    if _set(c.get("kv_lora_rank")):
        for key in ("kv_lora_rank", "qk_rope_head_dim"):
            v = _first_int(c, (key,))
            if v is not None:
                facts[key] = v
    return facts


def mla_page_bytes(block_tokens: int, kv_lora_rank: int, qk_rope_head_dim: int, cache_dtype: str) -> int | None:
    """Bytes of one MLA layer's page for one GPU block on one rank (None: dtype unknown)."""
    if normalize_dtype(cache_dtype) == "fp8_ds_mla":
        return block_tokens * FP8_DS_MLA_TOKEN_BYTES
    size = dtype_bytes(cache_dtype)
    if size is None:
        return None
    return block_tokens * (kv_lora_rank + qk_rope_head_dim) * size


# --- which model a config is ----------------------------------------------------------------
# Well-known families: (family, pattern of the lower-case model name, model_type, architecture).
# A family that prefixes another (qwen: qwen2, qwen3) is the generic one and agrees with both.
_MODEL_FAMILIES = [(fam, re.compile(name), re.compile(mtype), re.compile(arch)) for fam, name, mtype, arch in (
    ("llama", r"(?<![a-z])llama", r"m?llama\d*(_text)?", r"(Llama\d*|Mllama)For"),
    ("mistral", r"(?<![a-z])(mistral|ministral|codestral|devstral|magistral|mathstral)",
     r"(mistral|ministral)\d*", r"(Mistral|Ministral)\d*For"),
    ("mixtral", r"(?<![a-z])mixtral", r"mixtral", r"MixtralFor"),
    ("qwen", r"(?<![a-z])(qwen|qwq)(?![23])", r"qwen", r"QWen"),
    ("qwen2", r"(?<![a-z])qwen2", r"qwen2\w*", r"Qwen2"),
    ("qwen3", r"(?<![a-z])qwen3", r"qwen3\w*", r"Qwen3"),
    # DeepSeek V2/V3/R1 are MLA models; DeepSeek LLM/Coder v1 and Prover-V2-7B are Llama models
    ("deepseek", r"deepseek[-_ ]?(coder[-_ ]?)?(v[2-9]|r1)(?![a-z0-9])", r"deepseek_v\d+", r"DeepseekV\d+For"),
    ("gemma", r"(?<![a-z])gemma", r"gemma\d*n?(_text)?", r"Gemma\d*n?For"),
    ("phi", r"(?<![a-z])phi[-_]?\d", r"phi\w*", r"Phi\w*For"),
    ("gpt_oss", r"gpt[-_]?oss", r"gpt_oss", r"GptOssFor"),
)]


def _related(a: str, b: str) -> bool:
    return a.startswith(b) or b.startswith(a)


def name_families(model_name: str) -> set[str]:
    """Families a model name clearly names (most specific only: qwen3, not qwen and qwen3)."""
    name = model_name.lower()
    found = {fam for fam, pattern, _, _ in _MODEL_FAMILIES if pattern.search(name)}
    return {f for f in found if not any(g != f and g.startswith(f) for g in found)}


def config_family(cfg: dict[str, Any]) -> tuple[str, str] | None:
    """(family, what the config says: architecture and model_type) or None when not well known."""
    model_type = cfg.get("model_type")
    archs = [a for a in cfg.get("architectures") or () if isinstance(a, str)] \
        if isinstance(cfg.get("architectures"), list) else []
    said = ", ".join([*archs[:1], *([f"model_type {model_type!r}"] if isinstance(model_type, str) else [])])
    for fam, _, mtype, _ in _MODEL_FAMILIES:
        if isinstance(model_type, str) and mtype.fullmatch(model_type):
            return fam, said
    for fam, _, _, arch in _MODEL_FAMILIES:
        if any(arch.match(a) for a in archs):
            return fam, said
    return None


def family_conflict(cfg: dict[str, Any], model_name: str) -> str | None:
    """Why `cfg` cannot be the config of `model_name` (None: it may be).

    Conservative: only when the name clearly names well-known families and the config
    names another one; unknown names and unknown architectures never conflict.
    """
    named = name_families(model_name)
    found = config_family(cfg)
    if not named or found is None or any(_related(found[0], f) for f in named):
        return None
    return (f"the config is {found[1]} (a {found[0]} model) but model {model_name!r} is a "
            f"{' or '.join(sorted(named))} model")


# Families whose attention kind is known from the name alone: DeepSeek V2/V3/R1 and Kimi K2
# (DeepseekV3 architecture) keep MLA latents (a V3.2-style sparse indexer makes the cache
# hybrid, identity.md §4); the other well-known families above never use MLA.
_MLA_NAME = re.compile(r"kimi[-_ ]?k2")
MLA_FAMILIES = ("deepseek",)


def kind_conflict(model_name: str, kv_kind: str | None) -> str | None:
    """Why a stated attention kind cannot be `model_name`'s (None: it may be). Conservative,
    as `family_conflict`: only well-known MLA names stated as another kind. That is the
    claim no data can refute: it makes equal replicas of a latent look like head shards
    (concatenated, or collapsed as full attention). The opposite claim (a GQA model stated
    as MLA) is refuted by the rows themselves: shards differ, and replicas must hash
    equal before one is taken for all (replica_mismatch, a slice's equal cells)."""
    if kv_kind is None or kv_kind in ("mla", "hybrid") or not model_name:
        return None
    if not (name_families(model_name) & set(MLA_FAMILIES) or _MLA_NAME.search(model_name.lower())):
        return None
    return (f"model {model_name!r} is an MLA model (its KV cache holds one latent per token, the same on every "
            f"rank), not {kv_kind}")
