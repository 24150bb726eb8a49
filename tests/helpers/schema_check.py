"""A validator for the subset of JSON Schema (draft 2020-12) that scripts/gen_schema.py
emits: `type` (one name or a list), `properties`, `required`, `additionalProperties`
(false or a schema), `items`, `anyOf`, and `$ref` into the document's `$defs`; `{}`
allows anything. Any other keyword is an error, so the generator cannot start emitting
one this checker would silently ignore. (`jsonschema` is no dependency of kvmigrate.)"""

from __future__ import annotations

from typing import Any

_KNOWN = {"$schema", "$id", "title", "description", "$defs", "$ref", "type", "properties", "required",
          "additionalProperties", "items", "anyOf"}


def _is(value: Any, name: str) -> bool:
    if name == "null":
        return value is None
    if name == "boolean":
        return isinstance(value, bool)
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if name == "string":
        return isinstance(value, str)
    if name == "array":
        return isinstance(value, list)
    if name == "object":
        return isinstance(value, dict)
    raise ValueError(f"unknown type {name!r}")


def errors(value: Any, schema: dict[str, Any], root: dict[str, Any] | None = None, path: str = "$") -> list[str]:
    """Every way `value` breaks `schema` (empty: valid), each with its JSON path."""
    root = root if root is not None else schema
    unknown = set(schema) - _KNOWN
    if unknown:
        raise ValueError(f"{path}: keywords this checker does not know: {sorted(unknown)}")
    out: list[str] = []
    if "$ref" in schema:
        ref = schema["$ref"]
        assert ref.startswith("#/$defs/"), ref
        out += errors(value, root["$defs"][ref.removeprefix("#/$defs/")], root, path)
    if "anyOf" in schema:
        tries = [errors(value, s, root, path) for s in schema["anyOf"]]
        if all(tries):
            best = min(tries, key=len)
            out.append(f"{path}: matches none of anyOf; nearest: " + "; ".join(best[:5]))
    if "type" in schema:
        names = [schema["type"]] if isinstance(schema["type"], str) else schema["type"]
        if not any(_is(value, n) for n in names):
            return out + [f"{path}: {type(value).__name__} {value!r:.60} is not {'|'.join(names)}"]
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out += [f"{path}: missing key {k!r}" for k in schema.get("required", ()) if k not in value]
        extra = schema.get("additionalProperties", True)
        for k, v in value.items():
            if k in props:
                out += errors(v, props[k], root, f"{path}.{k}")
            elif extra is False:
                out.append(f"{path}: unexpected key {k!r}")
            elif isinstance(extra, dict):
                out += errors(v, extra, root, f"{path}[{k!r}]")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            out += errors(v, schema["items"], root, f"{path}[{i}]")
    return out
