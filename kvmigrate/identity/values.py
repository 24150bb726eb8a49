"""The values a deployment fact may take: those the engines themselves accept (identity.md §4).

One table for the command-line flags, FACTS.json and the model-config reader, so a value
no engine would take ("banana", "potato") is a usage error before anything is planned.
No imports at all: `kvmigrate <command> --help` reads the choices from here, and every
layer (the family registry, kvmigrate.families, included) reads its names from here.
"""

from __future__ import annotations

# The writer families, in the order of the --family choices (the first is synth's default).
# A new family: its module `kvmigrate/families/<name>.py` defining FAMILY, its name here and
# its digest recipe below.
NAMES = ("vllm", "llmd", "vllmcpp", "sglang", "lmcache", "mooncake")
AMBIGUOUS = "ambiguous"  # the reading of an S1 identity vLLM and llm-d write alike
UNKNOWN = "unknown"  # no scheme keys, or a name no module has: nothing is migrated
# How each writer serialises an identity to name its namespace (identity.md §1): Python's
# json.dumps with ensure_ascii (True; config.json is indent=2) or raw UTF-8 as
# nlohmann::json::dump writes it (False; config.json is the canonical bytes themselves).
# identity/canonical.py hashes by it; Family.ensure_ascii reads it.
ENSURE_ASCII = {"vllm": True, "llmd": True, "vllmcpp": False,
                AMBIGUOUS: True}  # an S1 identity: vLLM and llm-d hash it alike

# vllm-0.28 is vLLM 0.28-0.33; vllm-0.34 the newest release, whose direct layouts are
# topology-specific again (identity.md §4.1)
VLLM_PROFILES = ("vllm-0.22", "vllm-0.24", "vllm-0.26", "vllm-0.27", "vllm-0.28", "vllm-0.34")
VLLMCPP_PROFILE = "vllmcpp"
SGLANG_PROFILE = "sglang-0.5.23"  # what SGLang 0.5.23's HiCacheFile looks up (sglang.md §3)
# what an LMCache tier's target reads (lmcache.md §0: the same names, bytes and lookups); the
# first is every tier's default, and naming one leaves the other families on DEFAULT_PROFILE
LMCACHE_PROFILES = ("lmcache-0.5.6", "lmcache-0.5.7rc2")
# Mooncake stores (mooncake.md §0): the first is every store's default (tenant-scoped keys, the
# client lock); 0.3.11 reads raw keys; naming one leaves the other families on DEFAULT_PROFILE
MOONCAKE_PROFILES = ("mooncake-0.3.14", "mooncake-0.3.13", "mooncake-0.3.12", "mooncake-0.3.11")
PROFILES = VLLM_PROFILES + (VLLMCPP_PROFILE, SGLANG_PROFILE) + LMCACHE_PROFILES + MOONCAKE_PROFILES
DEFAULT_PROFILE = "vllm-0.34"
# how a target's `unreachable` starts when the namespace is a folder a vLLM 0.24-0.33 gate
# collapsed, which the profile reads only under its writer's topology, not given
ORPHANED = "orphaned by vLLM"

# fact (as in FACTS.json) -> the command-line flag stating it
FACT_FLAGS = {
    "model_config": "--model-config",
    "kv_kind": "--kv-kind",
    "total_kv_heads": "--total-kv-heads",
    "model_dtype": "--model-dtype",
    "cache_dtype": "--cache-dtype",
    "runner": "--runner",
    "executor": "--executor",
    "nnodes": "--nnodes",
    "per_token_head_quant": "--per-token-head-quant",
    "page_bytes": "--page-bytes",
    "tensors_per_layer": "--tensors-per-layer",
    "family": "--family",
    # the one topology that wrote every row of a collapsed vLLM folder (identity.md §4.1)
    "writer_tp": "--writer-tp",
    "writer_pp": "--writer-pp",
    # SGLang HiCache (docs/sglang.md §3)
    "model_name": "--model-name",
    "writer_layout": "--writer-layout",
    "target_layout": "--target-layout",
    "writer_release": "--writer-release",
    # SGLang page geometry (a relayout, docs/sglang.md §3)
    "layers": "--layers",
    "page_tokens": "--page-tokens",
    "kv_heads": "--kv-heads",
    "head_dim": "--head-dim",
    "latent_dim": "--latent-dim",
    "dtype_bytes": "--dtype-bytes",
    # LMCache tiers (spec lmcache.md §3.3): the hash recipe of writer and target, the chunk
    # geometry and the target deployment; writer_release, model_name and the geometry
    # flags above are shared with the other families
    "hash_algorithm": "--hash-algorithm",
    "target_hash_algorithm": "--target-hash-algorithm",
    "pythonhashseed": "--pythonhashseed",
    "target_pythonhashseed": "--target-pythonhashseed",
    "vllm_release": "--vllm-release",
    "target_vllm_release": "--target-vllm-release",
    "python_version": "--python-version",
    "target_python_version": "--target-python-version",
    "chunk_size": "--chunk-size",
    "target_chunk_size": "--target-chunk-size",
    "save_chunk_meta": "--save-chunk-meta",
    "target_save_chunk_meta": "--target-save-chunk-meta",
    "save_unfull_chunk": "--save-unfull-chunk",
    "target_model_name": "--target-model-name",
    "target_tp": "--target-tp",
    "target_save_only_first_rank": "--target-save-only-first-rank",
    "target_backend": "--target-backend",
    "tmp_dir": "--tmp-dir",
    # no engine uses this local_disk tier: prune --index-lost may take its chunks (§6)
    "engine_stopped": "--engine-stopped",
    # Mooncake stores (spec mooncake.md §3.2): the file-per-key folder, the writer's KV layout
    # and SGLang virtual TP, and the target's keys (tenant, vLLM cache prefix, engine, recipe);
    # writer_release, engine_stopped, target_tp, target_model_name and the geometry are shared
    "fsdir": "--fsdir",
    "kv_layout": "--kv-layout",
    "tp_lcm_size": "--tp-lcm-size",
    "target_tenant": "--target-tenant",
    "target_cache_prefix": "--target-cache-prefix",
    "target_engine": "--target-engine",
    "hash_recipe_changed": "--hash-recipe-changed",
}
# the facts only LMCache tiers read: other families never see them (not in their manifests)
LMCACHE_FACTS = ("hash_algorithm", "target_hash_algorithm", "pythonhashseed", "target_pythonhashseed",
                 "vllm_release", "target_vllm_release", "python_version", "target_python_version", "chunk_size",
                 "target_chunk_size", "save_chunk_meta", "target_save_chunk_meta", "save_unfull_chunk",
                 "target_model_name", "target_tp", "target_save_only_first_rank", "target_backend", "tmp_dir",
                 "engine_stopped")
# LMCache `pre_caching_hash_algorithm` values (sha256_cbor_64bit: sha256_cbor's old name) and
# the MP server's blake3 (lmcache.md §3.2)
# the facts only Mooncake stores read (not in other families' manifests when not given)
MOONCAKE_FACTS = ("fsdir", "kv_layout", "tp_lcm_size", "target_tenant", "target_cache_prefix", "target_engine",
                  "hash_recipe_changed")
# a Mooncake writer's KV layout (mooncake.md §3.2): vLLM's block layout, SGLang's
# --hicache-mem-layout (page_head: heads outermost)
MOONCAKE_KV_LAYOUTS = ("nhd", "hnd", "layer_first", "page_first", "page_first_direct", "page_head")
# the engines whose keys a Mooncake target reads (mooncake.md §0)
MOONCAKE_TARGET_ENGINES = ("vllm-0.34", "sglang-0.5.23")
HASH_ALGORITHMS = ("builtin", "sha256", "sha256_cbor", "sha256_cbor_64bit", "xxhash", "xxhash_cbor", "blake3")
TARGET_BACKENDS = ("fs",)  # a local_disk tier converted to an fs tier (lmcache.md §3.5)

# SGLang --hicache-mem-layout values whose page shape kvmigrate knows (sglang.md §2)
SGLANG_LAYOUTS = ("layer_first", "page_first", "page_first_direct")

KV_KINDS = ("full", "mla", "sliding", "hybrid", "mamba")
FAMILIES = NAMES  # the writer families: one module each in kvmigrate/families/
SYNTH_FAMILIES = NAMES  # synth's --family choices: every family
RUNNERS = ("v1", "v2")  # vLLM's V1 and V2 model runners

# vLLM `ModelConfig.dtype` (ModelDType) without "auto": the fact is what "auto" resolved to
MODEL_DTYPES = ("half", "float16", "bfloat16", "float", "float32")

# vLLM `CacheConfig.cache_dtype` (CacheDType, the raw --kv-cache-dtype) of the newest
# vllm/config/cache.py (the literal has only grown: older releases accept fewer)
CACHE_DTYPES = (
    "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla",
    "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
    "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6",
)

# vLLM `ParallelConfig.distributed_executor_backend` (DistributedExecutorBackend); vLLM also
# takes the qualified name of an Executor class (`package.module.Class`)
EXECUTORS = ("mp", "ray", "uni", "external_launcher")

# `torch_dtype` of a Hugging Face config.json: the half types vLLM serves as they are;
# other torch dtypes (float32, fp8 checkpoints, ...) fall back to the GPU's preferred half type
HF_SERVED_DTYPES = ("float16", "bfloat16")
HF_OTHER_TORCH_DTYPES = (
    "float32", "float64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "int8", "uint8", "int16", "int32", "int64",
)
