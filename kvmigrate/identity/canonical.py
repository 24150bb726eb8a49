"""Canonical identity JSON, digests and config.json bytes, byte-exact per writer family.

vLLM and llm-d hash `json.dumps(sort_keys, (",", ":"))` with Python's default
`ensure_ascii=True`; vllm.cpp (nlohmann::json::dump) writes raw UTF-8, which Python
reproduces with `ensure_ascii=False` (control characters become lowercase `\\u00xx`
in both). The two recipes differ only for non-ASCII strings, and that is enough to
change a folder name.

Pure primitives: the recipe is a value (identity/values.py ENSURE_ASCII), so this module
imports no family; the family registry and its modules use it (`Family.d12`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvmigrate.identity.values import ENSURE_ASCII

D12_LEN = 12


def recipe(family: str) -> bool:
    """The digest recipe of a writer family (values.ENSURE_ASCII); ValueError for a name
    without one (ambiguous readings and unknown writers hash nothing)."""
    ensure_ascii = ENSURE_ASCII.get(family)
    if ensure_ascii is None:
        raise ValueError(f"unknown family {family!r}")
    return ensure_ascii


def canonical_json(fields: dict[str, Any], ensure_ascii: bool) -> bytes:
    """The canonical identity bytes of one recipe: sorted keys, no spaces, UTF-8."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=ensure_ascii).encode("utf-8")


def config_json(fields: dict[str, Any], ensure_ascii: bool) -> bytes:
    """The config.json of one recipe (no trailing newline): Python's `json.dump(fields,
    indent=2, sort_keys=True)`, or for raw UTF-8 (nlohmann) the canonical bytes."""
    if not ensure_ascii:
        return canonical_json(fields, False)
    return json.dumps(fields, indent=2, sort_keys=True).encode("utf-8")


def canonical_bytes(fields: dict[str, Any], family: str) -> bytes:
    """The exact bytes the writer hashes to name the namespace folder."""
    return canonical_json(fields, recipe(family))


def full_digest(fields: dict[str, Any], family: str) -> str:
    """Lowercase hex SHA-256 of the canonical identity (vllm.cpp stores it raw in headers)."""
    return hashlib.sha256(canonical_bytes(fields, family)).hexdigest()


def d12(fields: dict[str, Any], family: str) -> str:
    """The 12-hex suffix of the namespace folder name."""
    return full_digest(fields, family)[:D12_LEN]


def config_json_bytes(fields: dict[str, Any], family: str) -> bytes:
    """The config.json the writer puts in the base folder (no trailing newline).

    vllm/llmd: `json.dump(fields, indent=2, sort_keys=True)`; vllmcpp: the canonical bytes.
    """
    return config_json(fields, recipe(family))


def fields_from_config_bytes(data: bytes) -> dict[str, Any]:
    """Parse a config.json. Raises ValueError for anything that is not a JSON object."""
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    return obj
