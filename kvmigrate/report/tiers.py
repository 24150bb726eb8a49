"""The LMCache tiers of a summary (spec lmcache.md §7): per tier, then per deployment, its
backend, key scheme, model, ws, dtype, the hash-recipe comparison with each fact's source,
its target, counts by status and action, and what each prune class could reclaim (the
local_disk leak made visible); and §7's notes, as rules of the report's tables
(the codes below; report/hints.py `TIER_RULES` runs them over every tier deployment).

Everything is read from the summary's namespaces and the manifest's namespace metadata
(`config_json`: the deployment's label fields and what families/lmcache_meta.py recorded),
never from a row's reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvmigrate import families
from kvmigrate.identity.values import LMCACHE_PROFILES

if TYPE_CHECKING:  # the JSON models are types only (kvmigrate.outputs)
    from kvmigrate.outputs import FileCount, Namespace, Tier, TierDeployment

# §6's prune classes of a tier's files, by status
RESIDUE = ("tmp_leftover", "zero_filled", "short", "misfiled", "orphan_data", "corrupt_sidecar")
UNREADABLE = ("stale_hash_recipe", "unreproducible_hash")
INDEX_LOST = "index_lost"
CLASSES = {"residue": "--residue", "index_lost": "--index-lost", "unreadable_namespaces": "--unreadable-namespaces"}
RC2 = LMCACHE_PROFILES[1]  # lmcache-0.5.7rc2: moved its vLLM adapter (R2 §1)
MP = "mp"  # the MP server's FS L2 adapter (fs_native shares its names, R2 §2)
LOCAL_DISK = "local_disk"
FS = "fs"

# the notes' codes (a finding's `code`), one per §7 note
NOTE_LOCAL_DISK = "lmcache_local_disk"
NOTE_SEEDLESS = "lmcache_seedless"
NOTE_SEED_FIX = "lmcache_seed_fix"
NOTE_CORRUPT_SIDECAR = "lmcache_corrupt_sidecar"
NOTE_ZERO_HEX64 = "lmcache_fs_zero_hex64"
NOTE_RC2_IN_TREE = "lmcache_rc2_in_tree_connector"
NOTE_FS_NATIVE = "lmcache_fs_native_usage"
ASSUMED = "assumed_facts"  # the code every family's assumed facts have


def is_tier(n: Mapping[str, Any]) -> bool:
    """A namespace of a tier family (its family says so: docs/families.md)."""
    return bool(n.get("family")) and families.get(n["family"]).root_layout == "tiers"


def _zero() -> FileCount:
    return {"files": 0, "bytes": 0}


def _add(into: FileCount, c: FileCount) -> None:
    into["files"] += c["files"]
    into["bytes"] += c["bytes"]


def reclaimable(by_status: Mapping[str, FileCount]) -> dict[str, FileCount]:
    """Per §6 class, the files of one deployment (or a tier's files of no deployment) a
    prune of that class could take: the residue, the index_lost chunks (local_disk), and
    the stale or unreproducible chunks of a deployment none of whose files is readable."""
    out = {cls: _zero() for cls in CLASSES}
    for status, c in by_status.items():
        if status in RESIDUE:
            _add(out["residue"], c)
        elif status == INDEX_LOST:
            _add(out["index_lost"], c)
    if any(s in UNREADABLE for s in by_status) and all(s in UNREADABLE or s in RESIDUE for s in by_status):
        for status in UNREADABLE:
            if status in by_status:
                _add(out["unreadable_namespaces"], by_status[status])
    return out


def _deployment(n: Namespace, fields: Mapping[str, Any]) -> TierDeployment:
    return {
        "deployment": n["source_base"], "backend": str(fields.get("backend") or ""),
        "scheme": n["scheme"], "model": n["model_name"], "ws": fields.get("ws"), "dtype": fields.get("dtype"),
        "kv_kind": fields.get("kv_kind"), "target_profile": n["target_profile"], "target_base": n["target_base"],
        "recipe": list(fields.get("recipe") or ()),
        "assumed_facts": list(fields.get("assumed_facts") or ()),
        "writer_none_hash": fields.get("writer_none_hash"),
        "seed_fix_files": int(fields.get("seed_fix_files") or 0),
        "zero_hex64_files": int(fields.get("zero_hex64_files") or 0),
        "facts": {k: v for k, v in n["facts"].items() if v is not None},
        "files": n["files"], "bytes": n["bytes"], "by_status": dict(n["by_status"]),
        "by_action": dict(n["by_action"]), "reclaimable": reclaimable(n["by_status"]),
    }


def tiers_of(namespaces: list[Namespace], ns_meta: Mapping[str, Mapping[str, Any]]) -> list[Tier]:
    """The summary's `tiers`: every tier of the root with its deployments, in tier order."""
    out: dict[str, Tier] = {}
    for n in namespaces:
        if not is_tier(n):
            continue
        fields = (ns_meta.get(n["source_base"]) or {}).get("config_json") or {}
        name = str(fields.get("tier") or ".")
        tier = out.get(name)
        if tier is None:
            tier = out[name] = {"tier": name, "target_profile": None, "backends": [], "deployments": [],
                                "other_files": {}, "files": 0, "bytes": 0,
                                "reclaimable": {cls: _zero() for cls in CLASSES}}
        tier["files"] += n["files"]
        tier["bytes"] += n["bytes"]
        if fields.get("backend"):
            d = _deployment(n, fields)
            tier["deployments"].append(d)
            tier["target_profile"] = tier["target_profile"] or d["target_profile"]
            if d["backend"] not in tier["backends"]:
                tier["backends"].append(d["backend"])
            parts = d["reclaimable"]
        else:  # the tier's files of no deployment (temps, foreign files)
            tier["other_files"] = dict(n["by_status"])
            parts = reclaimable(n["by_status"])
        for cls, c in parts.items():
            _add(tier["reclaimable"][cls], c)
    for t in out.values():
        t["backends"].sort()
        if t["target_profile"] is None:  # (a tier of temps alone)
            t["target_profile"] = LMCACHE_PROFILES[0]
    return [out[k] for k in sorted(out)]
