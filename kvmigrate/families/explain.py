"""`kvmigrate identity` as a Python API: one config.json in, source and target identity
with the gate explanation out (interface.md §1). It sits above the family registry
(detection and the target are asked of kvmigrate.families).

When the config.json sits in a namespace folder, the folder is evidence: its `d12` proves
(or disproves) the digest, and its sibling rank folders and block sizes tell vLLM from
llm-d for scheme S1.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from kvmigrate import families, layout
from kvmigrate.errors import UsageError
from kvmigrate.identity import canonical
from kvmigrate.identity.facts import FLAGS, FactsResolver
from kvmigrate.identity.gates import DEFAULT_PROFILE

if TYPE_CHECKING:  # the JSON models are types only (kvmigrate.outputs)
    from kvmigrate.outputs import IdentityOutput

BLOCK_SAMPLE = 64  # block files stat'ed per namespace for the family evidence
CONFIG_MAX = 16 << 20  # an engine's config.json is a few KiB; never read a huge file whole


def read_config(path: str) -> dict[str, Any]:
    """Parse a namespace config.json; unreadable or invalid input is a usage error naming it."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(CONFIG_MAX + 1)
    except OSError as exc:
        raise UsageError(f"cannot read config.json: {exc.strerror or exc}", path=path,
                         hint="pass the config.json of a namespace folder") from None
    if len(data) > CONFIG_MAX:
        raise UsageError(f"config.json is larger than {CONFIG_MAX} bytes; an engine's is a few KiB", path=path,
                         hint="pass the config.json of a namespace folder")
    try:
        return canonical.fields_from_config_bytes(data)
    except ValueError as exc:
        raise UsageError(f"cannot use config.json: {exc}", path=path,
                         hint="the file is damaged; kvmigrate never migrates a namespace it cannot prove") from None


def folder_evidence(config_path: str) -> tuple[layout.FolderName | None, list[int], list[int]]:
    """(parsed namespace folder or None, rank numbers of sibling rank folders, sampled block sizes)."""
    folder = os.path.dirname(os.path.abspath(config_path))
    parsed = layout.parse_folder(os.path.basename(folder))
    if parsed is None or parsed.rank is not None:
        return None, [], []
    root = os.path.dirname(folder)
    ranks: list[int] = []
    sizes: list[int] = []
    try:
        names = os.listdir(root)
    except OSError:
        return parsed, [], []
    for name in sorted(names):
        sibling = layout.parse_folder(name)
        if sibling is None or sibling.rank is None or sibling.base != parsed.base:
            continue
        ranks.append(sibling.rank)
        if len(sizes) < BLOCK_SAMPLE:
            sizes += _block_sizes(os.path.join(root, name), BLOCK_SAMPLE - len(sizes))
    return parsed, sorted(ranks), sizes


def _block_sizes(rank_dir: str, limit: int) -> list[int]:
    sizes: list[int] = []
    for dirpath, dirnames, filenames in os.walk(rank_dir):
        dirnames.sort()
        for name in sorted(filenames):
            if layout.block_hex(name) is not None:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                sizes.append(st.st_size)
                if len(sizes) >= limit:
                    return sizes
    return sizes


def explain_identity(config_path: str, *, flags: dict[str, Any] | None = None, facts_file: str | None = None,
                     profile: str = DEFAULT_PROFILE) -> IdentityOutput:
    """The object `kvmigrate identity CONFIG_JSON --json` prints."""
    resolver = FactsResolver(flags, facts_file)
    fields = read_config(config_path)
    parsed, ranks, sizes = folder_evidence(config_path)
    name = fields.get("model_name")
    model_name: str = name if isinstance(name, str) else ""
    # the recipe is fixed by the keys (S1 vLLM and llm-d hash alike), so the base name is known first
    try:
        source_d12 = canonical.d12(fields, families.of_identity(fields).name)
    except ValueError as exc:  # vllm.cpp hashes UTF-8: a lone surrogate escape cannot be encoded
        raise UsageError(f"cannot hash the identity: {exc}", path=config_path,
                         hint="the file is damaged; kvmigrate never migrates a namespace it cannot prove") from None
    source_base = layout.base_name(model_name, source_d12)
    facts = resolver.for_namespace(model_name, parsed.base if parsed else source_base, fields)
    family, evidence = families.detect(fields, rank_numbers=ranks, block_sizes=sizes, forced=facts.family)
    if family == families.UNKNOWN:
        raise UsageError("config.json is not a vLLM, llm-d or vllm.cpp identity (" + evidence[0] + ")",
                         path=config_path, hint="pass the config.json of a KV cache namespace folder")
    problems = families.source_problems(fields)
    if problems:
        raise UsageError("source identity is not valid: " + "; ".join(problems), path=config_path,
                         hint="the namespace's config.json is damaged or from an unknown writer")
    target = families.compute_target(fields, family, facts, profile)
    scheme = families.get(family).scheme_of(fields)
    return {
        "family": family,
        "family_evidence": evidence,
        "scheme": scheme,
        "source": {"fields": fields, "d12": source_d12, "base_name": source_base,
                   "digest_ok": (parsed.d12 == source_d12) if parsed else None},
        "target": {"profile": target.profile, "family": target.family, "fields": target.fields,
                   "d12": target.d12, "base_name": target.base_name, "rank_dir": target.rank_dir,
                   "parallel_agnostic": target.parallel_agnostic, "replicated_layout": target.replicated_layout,
                   "reasons": target.reasons, "unreachable": target.unreachable,
                   "missing_facts": target.missing_facts, "decisive_assumptions": target.decisive_assumptions,
                   "writer_topology": target.writer_topology, "claims": target.claims},
        "assumed_facts": target.assumed_facts,
    }


def render_text(result: IdentityOutput, config_path: str) -> str:
    """Human rendering of `explain_identity`'s result."""
    src, tgt = result["source"], result["target"]
    lines = [f"config.json  {config_path}",
             f"family       {result['family']}   scheme {result['scheme']}"]
    lines += [f"             - {e}" for e in result.get("family_evidence", [])]
    digest = {True: "matches its folder", False: "DOES NOT match its folder (digest_mismatch: never migrated)",
              None: "not in a namespace folder"}[src["digest_ok"]]
    lines.append(f"source       {src['base_name']}   (d12 {src['d12']}, {digest})")
    profile = tgt["profile"] + (" (the default: vLLM 0.34 and newer)" if tgt["profile"] == DEFAULT_PROFILE else "")
    if tgt["fields"] is None:
        lines.append(f"target       {profile}: none")
        lines.append(f"             {tgt['unreachable']}")
        return _printable(lines)
    lines.append(f"target       {profile}: {tgt['base_name']}   blocks under {tgt['rank_dir']}/")
    same = tgt["base_name"] == src["base_name"]
    lines.append("             parallel-agnostic: " + ("yes" if tgt["parallel_agnostic"] else "no")
                 + "   replicated layout: " + ("yes" if tgt["replicated_layout"] else "no")
                 + ("   (same folder as the source: already in place)" if same else ""))
    lines += [f"rests on     {claim}" for claim in tgt.get("claims") or ()]
    if tgt.get("unreachable"):
        lines.append(f"             unreachable: {tgt['unreachable']} (its blocks get action none)")
    if tgt["reasons"]:
        lines.append("why not collapsed:")
        lines += [f"  - {r}" for r in tgt["reasons"]]
    if tgt.get("missing_facts"):
        lines.append("guess        this target depends on " + ", ".join(FLAGS[f] for f in tgt["missing_facts"])
                     + " (not given; or --model-config): state them before migrating")
    if result["assumed_facts"]:
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in sorted(result["assumed_facts"].items()))
        lines.append(f"assumed      {shown}  (defaults; pass the flags to state them)")
    lines.append("target fields (* = differs from the source):")
    for key in sorted(tgt["fields"]):
        value = tgt["fields"][key]
        mark = "*" if src["fields"].get(key, _MISSING) != value else " "
        lines.append(f"  {mark} {key}: {_summary(key, value)}")
    dropped = sorted(k for k in src["fields"] if k not in tgt["fields"])
    if dropped:
        lines.append("  - dropped: " + ", ".join(dropped))
    return _printable(lines)


def _printable(lines: list[str]) -> str:
    # a lone surrogate escape in a config.json string cannot be printed as UTF-8: escape it
    return "\n".join(lines).encode("utf-8", "backslashreplace").decode("utf-8")


_MISSING = object()


def _summary(key: str, value: Any) -> str:
    """One line per field; layer lists are long, so groups show counts and end points."""
    if key == "kv_cache_groups" and isinstance(value, list):
        parts = []
        for g in value:
            size = ", ".join(f"{k} {v}" for k, v in sorted(g.items()) if k != "layer_names")
            names = g.get("layer_names") or []
            span = f"{names[0]} .. {names[-1]}" if len(names) > 1 else ", ".join(names)
            parts.append(f"[{size}; {len(names)} layers {span}]")
        return f"{len(value)} group(s) " + " ".join(parts)
    import json

    return json.dumps(value, ensure_ascii=False)


def _fmt(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)
