"""Deployment facts: what config.json does not say but the gates need (identity.md §4).

Facts come from three places, most specific first: a `--facts FACTS.json` entry keyed
by the base folder name, then by `model_name`, then `"*"`; then the command-line flags.
Explicit values beat values derived from a Hugging Face model config (`model_config`,
itself taken from the most specific place that names one). Every resolved fact records
where it came from, so reports can say which claim a migration trusted.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dc_fields
from typing import Any

from kvmigrate.errors import UsageError
from kvmigrate.identity import hfconfig
from kvmigrate.identity.values import (
    CACHE_DTYPES,
    EXECUTORS,
    FACT_FLAGS,
    FAMILIES,
    HASH_ALGORITHMS,
    KV_KINDS,
    LMCACHE_FACTS,
    MODEL_DTYPES,
    MOONCAKE_FACTS,
    MOONCAKE_KV_LAYOUTS,
    MOONCAKE_TARGET_ENGINES,
    RUNNERS,
    SGLANG_LAYOUTS,
    TARGET_BACKENDS,
)

# fact -> the values the engine accepts (the string facts)
CHOICES = {"kv_kind": KV_KINDS, "family": FAMILIES, "runner": RUNNERS, "model_dtype": MODEL_DTYPES,
           "cache_dtype": CACHE_DTYPES, "executor": EXECUTORS,
           "writer_layout": SGLANG_LAYOUTS, "target_layout": SGLANG_LAYOUTS,
           "hash_algorithm": HASH_ALGORITHMS, "target_hash_algorithm": HASH_ALGORITHMS,
           "target_backend": TARGET_BACKENDS, "kv_layout": MOONCAKE_KV_LAYOUTS,
           "target_engine": MOONCAKE_TARGET_ENGINES}
_RELEASE = re.compile(r"\d+\.\d+(\.\d+)?((\.post|rc)\d+)?")  # an SGLang release (writer_release)
_PYTHON = re.compile(r"3\.\d+")  # a CPython minor version (python_version)
_SEED_MAX = 4294967295  # PYTHONHASHSEED's range
_QUALNAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")  # an Executor class vLLM imports by name

FLAGS = FACT_FLAGS  # fact -> the flag naming it in messages


@dataclass
class Facts:
    """Resolved facts of one namespace; None = unknown."""

    kv_kind: str | None = None  # full | mla | sliding | hybrid | mamba
    total_kv_heads: int | None = None
    model_dtype: str | None = None
    cache_dtype: str | None = None
    runner: str | None = None  # v1 | v2
    executor: str | None = None  # mp | ray | uni ...
    nnodes: int | None = None
    per_token_head_quant: bool | None = None
    page_bytes: int | None = None
    tensors_per_layer: int | None = None
    family: str | None = None  # vllm | llmd | vllmcpp | sglang (forced)
    # the one topology that wrote every row of a folder collapsed by vLLM 0.24-0.33's
    # direct gate, which the identity does not record (identity.md §4.1)
    writer_tp: int | None = None
    writer_pp: int | None = None
    # SGLang HiCache (sglang.md §3): the served model name (e1-e3 names carry none), the
    # page layout of writer and target, or the writer's release (its layout default)
    model_name: str | None = None
    writer_layout: str | None = None
    target_layout: str | None = None
    writer_release: str | None = None
    # SGLang page geometry, for a relayout (sglang.md §2-3): host layers of the stage, page
    # tokens, KV heads on one rank (or total_kv_heads and the TP size), head dim or MLA
    # latent width, dtype bytes (or model_dtype)
    layers: int | None = None
    page_tokens: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    latent_dim: int | None = None
    dtype_bytes: int | None = None
    # LMCache tiers (lmcache.md §3.3): the hash recipe (a seed is its decimal string or
    # "unset"), the chunk geometry, the target deployment and the tier's temp folder;
    # writer_release may then be a tuple of releases (the flag's comma list)
    hash_algorithm: str | None = None
    target_hash_algorithm: str | None = None
    pythonhashseed: str | None = None
    target_pythonhashseed: str | None = None
    vllm_release: str | None = None
    target_vllm_release: str | None = None
    python_version: str | None = None
    target_python_version: str | None = None
    chunk_size: int | None = None
    target_chunk_size: int | None = None
    save_chunk_meta: bool | None = None
    target_save_chunk_meta: bool | None = None
    save_unfull_chunk: bool | None = None
    target_model_name: str | None = None
    target_tp: int | None = None
    target_save_only_first_rank: bool | None = None
    target_backend: str | None = None
    tmp_dir: str | None = None
    engine_stopped: bool | None = None  # a local_disk tier no engine uses (prune --index-lost, §6)
    # Mooncake stores (mooncake.md §3.2): MOONCAKE_OFFLOAD_FSDIR, the writer's KV layout and
    # SGLang virtual TP; the target's tenant, vLLM cache prefix ("" = none), engine, and
    # whether it hashes tokens otherwise (then no key of the store is ever computed again)
    fsdir: str | None = None
    kv_layout: str | None = None
    tp_lcm_size: int | None = None
    target_tenant: str | None = None
    target_cache_prefix: str | None = None
    target_engine: str | None = None
    hash_recipe_changed: bool | None = None
    sources: dict[str, str] = field(default_factory=dict)  # fact -> "flag" | "facts:<key>" | "model_config:<path>"
    # why the namespace gets no target although its facts resolved (a model config of another model)
    refusal: str | None = None
    refusal_flag: str | None = None  # the flag that stated the refused facts (None: FACTS.json did)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("sources")
        d.pop("refusal")
        d.pop("refusal_flag")
        for name in LMCACHE_FACTS + MOONCAKE_FACTS:  # (not given: other families' manifests stay as they were)
            if d[name] is None:
                d.pop(name)
        if isinstance(d.get("writer_release"), tuple):
            d["writer_release"] = list(d["writer_release"])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Facts:
        """The facts a manifest recorded (`to_dict`'s output; unknown keys ignored)."""
        known = {name: d[name] for name in FACT_NAMES if d.get(name) is not None}
        if isinstance(known.get("writer_release"), list):
            known["writer_release"] = tuple(known["writer_release"])
        return cls(**known)


FACT_NAMES = tuple(f.name for f in dc_fields(Facts) if f.name not in ("sources", "refusal", "refusal_flag"))
_INT_FACTS = ("total_kv_heads", "nnodes", "page_bytes", "tensors_per_layer", "writer_tp", "writer_pp", "layers",
              "page_tokens", "kv_heads", "head_dim", "latent_dim", "dtype_bytes", "chunk_size",
              "target_chunk_size", "target_tp", "tp_lcm_size")


def allowed_values(name: str) -> str:
    """The values of a fact the engine accepts, as a message lists them."""
    if name in CHOICES:
        extra = {"model_dtype": " (what \"auto\" resolved to)",
                 "executor": ", or an Executor class as package.module.Class"}.get(name, "")
        return "one of " + ", ".join(CHOICES[name]) + extra
    if name in _INT_FACTS:
        return "a positive integer"
    if name == "model_name":
        return "a non-empty served model name"
    if name in ("model_name", "target_model_name"):
        return "a non-empty model name"
    if name == "writer_release":
        return "an SGLang release such as 0.5.13, or LMCache releases (a list, the flag comma-separated)"
    if name in ("vllm_release", "target_vllm_release"):
        return "a vLLM release such as 0.11.0"
    if name in ("pythonhashseed", "target_pythonhashseed"):
        return f"a seed 0...{_SEED_MAX} or \"unset\" (\"random\" = unset)"
    if name in ("python_version", "target_python_version"):
        return "a Python version such as 3.12"
    if name == "tmp_dir":
        return "a folder name inside the tier (no '/')"
    if name == "fsdir":
        return "a folder name inside the client root (no '/')"
    if name == "target_tenant":
        return "a non-empty tenant name without NUL"
    if name == "target_cache_prefix":
        return "a vLLM cache prefix without NUL or '@store_' (\"\" = none)"
    return "true or false"  # the boolean facts


def check_fact(name: str, value: Any, where: str) -> Any:
    """Validate one fact value against what the engine accepts; the normalized value or a UsageError.

    `where` says where the value came from (the flag, or "<FACTS.json>: entry '<key>'"), so
    the message names the flag or the FACTS.json key, the value and the allowed values.
    """
    if name not in FLAGS or name == "model_config":
        raise UsageError(f"{where}: unknown fact '{name}'",
                         hint="known facts: " + ", ".join(FACT_NAMES + ("model_config",)))
    if name in CHOICES:
        ok = isinstance(value, str) and (value in CHOICES[name]
                                         or (name == "executor" and _QUALNAME.fullmatch(value) is not None))
    elif name in _INT_FACTS:
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    elif name in ("model_name", "target_model_name"):
        ok = isinstance(value, str) and value != ""
    elif name == "writer_release":
        if isinstance(value, str) and "," in value:  # the flag's comma list
            value = [v.strip() for v in value.split(",")]
        if isinstance(value, (list, tuple)):
            ok = bool(value) and all(isinstance(v, str) and _RELEASE.fullmatch(v) for v in value)
            value = tuple(value) if len(value) != 1 else value[0]
        else:
            ok = isinstance(value, str) and _RELEASE.fullmatch(value) is not None
    elif name in ("vllm_release", "target_vllm_release"):
        ok = isinstance(value, str) and _RELEASE.fullmatch(value) is not None
    elif name in ("pythonhashseed", "target_pythonhashseed"):
        if value == "random":
            value = "unset"
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        ok = value == "unset" or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _SEED_MAX)
        value = str(value)
    elif name in ("python_version", "target_python_version"):
        ok = isinstance(value, str) and _PYTHON.fullmatch(value) is not None
    elif name in ("tmp_dir", "fsdir"):
        ok = isinstance(value, str) and value not in ("", ".", "..") and "/" not in value and "\0" not in value
    elif name == "target_tenant":
        ok = isinstance(value, str) and value != "" and "\0" not in value
    elif name == "target_cache_prefix":
        ok = isinstance(value, str) and "\0" not in value and "@store_" not in value
    else:  # the boolean facts
        ok = isinstance(value, bool)
    if not ok:
        raise UsageError(f"{where}: fact '{name}' must be {allowed_values(name)}, got {value!r}",
                         hint=f"fix the value (flag {FLAGS[name]}, FACTS.json key '{name}')")
    return hfconfig.normalize_dtype(value) if name == "model_dtype" else value


def load_json_object(path: str, what: str) -> dict[str, Any]:
    """Read a JSON object from `path`; any problem is a UsageError naming the path."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise UsageError(f"cannot read {what}: {exc.strerror or exc}", path=path,
                         hint=f"check the path of the {what}") from None
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise UsageError(f"{what} is not valid JSON: {exc}", path=path,
                         hint=f"fix or replace the {what}") from None
    if not isinstance(obj, dict):
        raise UsageError(f"{what} must hold a JSON object, got {type(obj).__name__}", path=path,
                         hint=f"fix or replace the {what}")
    return obj


@dataclass
class _Layer:
    """One place facts come from: a FACTS.json entry or the flags."""

    source: str  # "facts:<key>" or "flag"
    values: dict[str, Any]
    model_config: str | None  # resolved path


class FactsResolver:
    """Resolve the facts of each namespace from flags and an optional FACTS.json."""

    def __init__(self, flags: dict[str, Any] | None = None, facts_file: str | None = None):
        self.flags = {k: v for k, v in (flags or {}).items() if v is not None}
        self.facts_file = facts_file
        self._hf_cache: dict[str, dict[str, Any]] = {}
        self._hf_configs: dict[str, dict[str, Any]] = {}
        flag_values = {}
        for name, value in self.flags.items():
            if name == "model_config":
                continue
            flag_values[name] = check_fact(name, value, FLAGS.get(name, "command line"))
        flag_cfg = self.flags.get("model_config")
        self._flags = _Layer("flag", flag_values, os.path.abspath(flag_cfg) if flag_cfg else None)
        self._entries: dict[str, _Layer] = {}
        self.matched: set[str] = set()  # the FACTS.json keys some namespace used (check_keys_matched)
        if facts_file is not None:
            self._entries = self._load_facts_file(facts_file)
        for layer in [self._flags, *self._entries.values()]:
            if layer.model_config:
                self._hf_facts(layer.model_config)  # fail early on a broken model config

    def _load_facts_file(self, path: str) -> dict[str, _Layer]:
        obj = load_json_object(path, "facts file")
        folder = os.path.dirname(os.path.abspath(path))
        entries: dict[str, _Layer] = {}
        for key, values in obj.items():
            where = f"{path}: entry {key!r}"
            if not isinstance(values, dict):
                raise UsageError(f"{where} must be an object of facts, got {type(values).__name__}", path=path,
                                 hint='write {"<model_name>|<base folder>|*": {"kv_kind": "full", ...}}')
            checked = {}
            model_config = None
            for name, value in values.items():
                if name == "model_config":
                    if not (isinstance(value, str) and value):
                        raise UsageError(f"{where}: 'model_config' must be a path string", path=path)
                    model_config = os.path.normpath(os.path.join(folder, os.path.expanduser(value)))
                    continue
                if value is None:
                    continue
                checked[name] = check_fact(name, value, where)
            entries[key] = _Layer(f"facts:{key}", checked, model_config)
        return entries

    def _hf_facts(self, path: str) -> dict[str, Any]:
        if path not in self._hf_cache:
            cfg = load_json_object(path, "model config")
            try:
                facts = hfconfig.facts_from_hf_config(cfg)
            except ValueError as exc:
                raise UsageError(f"model config: {exc}", path=path,
                                 hint="fix the file or pass the model's own Hugging Face config.json") from None
            self._hf_cache[path] = facts
            self._hf_configs[path] = cfg
        return self._hf_cache[path]

    def _refusal(self, layer: _Layer, model_name: str, base_name: str, conflict: str) -> str:
        """One line (reports keep the first): the namespace, the config and the way out."""
        given_by = "--model-config" if layer.source == "flag" else \
            f"'model_config' of {self.facts_file} entry {layer.source.removeprefix('facts:')!r}"
        example = json.dumps({model_name: {"model_config": "<its config.json>"}})
        return (f"model config {layer.model_config} ({given_by}) refused for namespace {base_name}: {conflict}; "
                f"its blocks are not planned. --facts keys by model name: give each model its "
                f"own config, e.g. --facts FACTS.json with {example}")

    def _kind_refusal(self, facts: Facts, model_name: str, base_name: str, conflict: str) -> str:
        """One line: the stated kind, where it came from, the namespace and the way out."""
        source = facts.sources.get("kv_kind", "flag")
        given_by = "--kv-kind" if source == "flag" else \
            f"'kv_kind' of {self.facts_file} entry {source.removeprefix('facts:')!r}"
        example = json.dumps({model_name: {"kv_kind": "<its kind>"}})
        return (f"--kv-kind {facts.kv_kind} ({given_by}) refused for namespace {base_name}: {conflict}; its blocks "
                f"are not planned. State each model's kind on its own, e.g. --facts FACTS.json with {example}")

    def check_keys_matched(self, names: list[str]) -> None:
        """A FACTS.json key no namespace of the root used is a typo: its facts would
        silently apply to nothing. A key naming a base folder that is gone is not: the
        lifecycle removes folders (prune and purge, rollback, an engine's eviction), and the
        nightly audit with the same FACTS.json must not fail for it. `names`: the root's
        model and folder names, for the nearest ones the message offers."""
        import difflib

        from kvmigrate import layout

        def a_folder(key: str) -> bool:
            folder = layout.parse_folder(key)
            return folder is not None and folder.rank is None

        stale = sorted(k for k in self._entries if k not in self.matched and k != "*" and not a_folder(k))
        if not stale:
            return
        near = difflib.get_close_matches(stale[0], sorted(set(names)), n=3, cutoff=0.5)
        raise UsageError(f"{self.facts_file}: key {stale[0]!r} matches no namespace of this root"
                         + (f" (and {len(stale) - 1} more keys)" if len(stale) > 1 else ""), path=self.facts_file,
                         hint=("nearest: " + ", ".join(repr(n) for n in near) + "; " if near else "")
                         + "keys are a model name, a base folder name or \"*\" (`kvmigrate facts ROOT` writes them)")

    def keys(self) -> list[str]:
        """The FACTS.json keys (a flat family matches model names after its own rewrite)."""
        return list(self._entries)

    def layers_for(self, model_name: str, base_name: str) -> list[_Layer]:
        """Places facts come from for one namespace, most specific first."""
        keys = [k for k in (base_name, model_name, "*") if k in self._entries]
        self.matched.update(keys)
        layers = [self._entries[k] for k in keys]
        # a FACTS.json key may name both the base folder and the model (same string): once
        unique: list[_Layer] = []
        for layer in layers:
            if not any(layer is u for u in unique):
                unique.append(layer)
        return [*unique, self._flags]

    def for_tier(self, tier: str, model: str | None, matches: Any = None) -> Facts:
        """The facts of one LMCache deployment (lmcache.md §3.3): each fact from the most
        specific FACTS.json key that sets it, `"<tier>:<model>"` > `"<tier>"` > `"<model>"` >
        `"*"`, then the flags. `model`: as the names spell it (None: the tier's own facts);
        `matches(key_model, model)`: whether a key's model is the names' (local_disk's lossy
        `-`, §1.3; default equality)."""
        same = matches or (lambda a, b: a == b)
        keys: list[str] = []
        if model is not None:
            keys += [k for k in self._entries if k.startswith(tier + ":") and same(k[len(tier) + 1:], model)]
        if tier in self._entries:
            keys.append(tier)
        if model is not None:
            keys += [k for k in self._entries if k not in keys and ":" not in k and k != "*" and same(k, model)]
        if "*" in self._entries:
            keys.append("*")
        self.matched.update(keys)
        facts = Facts()
        for name in FACT_NAMES:
            for layer in [*(self._entries[k] for k in keys), self._flags]:
                if name in layer.values:
                    setattr(facts, name, layer.values[name])
                    facts.sources[name] = layer.source
                    break
        return facts

    def fsdir_of(self, store: str) -> str | None:
        """A Mooncake store's file-per-key folder (`fsdir`, mooncake.md §3.2) as its key or a
        flag states it, without marking a FACTS.json key used (the roots phase asks it of
        every folder)."""
        for layer in [*(self._entries[k] for k in (store, "*") if k in self._entries), self._flags]:
            if "fsdir" in layer.values:
                return str(layer.values["fsdir"])
        return None

    def for_namespace(self, model_name: str, base_name: str, source_fields: dict | None = None) -> Facts:
        layers = self.layers_for(model_name, base_name)
        facts = Facts()
        for name in FACT_NAMES:
            for layer in layers:
                if name in layer.values:
                    setattr(facts, name, layer.values[name])
                    facts.sources[name] = layer.source
                    break
        conflict = hfconfig.kind_conflict(model_name, facts.kv_kind)
        if conflict is not None:  # a flag or FACTS.json entry meant for other models of the root
            facts.refusal = self._kind_refusal(facts, model_name, base_name, conflict)
            facts.refusal_flag = "--kv-kind"  # its message names it, from a flag or FACTS.json
            return facts
        cfg_layer = next((layer for layer in layers if layer.model_config), None)
        if cfg_layer is None or cfg_layer.model_config is None:
            return facts
        cfg_path = cfg_layer.model_config
        hf = self._hf_facts(cfg_path)
        conflict = hfconfig.family_conflict(self._hf_configs[cfg_path], model_name)
        if conflict is not None:
            facts.refusal = self._refusal(cfg_layer, model_name, base_name, conflict)
            facts.refusal_flag = "--model-config" if cfg_layer.source == "flag" else None
            return facts
        origin = f"model_config:{cfg_path}"
        for name in ("kv_kind", "total_kv_heads", "model_dtype"):
            if getattr(facts, name) is None and name in hf:
                setattr(facts, name, hf[name])
                facts.sources[name] = origin
        if facts.page_bytes is None and facts.kv_kind == "mla" and source_fields:
            page = _mla_page_bytes(hf, source_fields, facts)
            if page is not None:
                facts.page_bytes = page
                facts.sources["page_bytes"] = origin
        return facts


def _mla_page_bytes(hf: dict[str, Any], fields: dict[str, Any], facts: Facts) -> int | None:
    """block tokens x (kv_lora_rank + qk_rope_head_dim) x dtype bytes, for a vLLM/llm-d source."""
    rank, rope = hf.get("kv_lora_rank"), hf.get("qk_rope_head_dim")
    groups = fields.get("kv_cache_groups")
    if not (rank and rope and isinstance(groups, list) and groups and isinstance(groups[0], dict)):
        return None
    group = groups[0]
    if "block_size" in group:  # S1: the per-rank GPU block size
        tokens = group["block_size"]
    else:  # S2+: tokens_per_block = block size x dcp
        dcp = fields.get("dcp_size") or 1
        tpb = group.get("tokens_per_block")
        if not isinstance(tpb, int) or not isinstance(dcp, int) or dcp <= 0 or tpb % dcp:
            return None
        tokens = tpb // dcp
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
        return None
    dtype = fields.get("dtype")
    if dtype == "auto":
        dtype = facts.model_dtype
    if not isinstance(dtype, str):
        return None
    return hfconfig.mla_page_bytes(tokens, rank, rope, dtype)
