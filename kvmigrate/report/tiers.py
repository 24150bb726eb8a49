"""The LMCache tiers of a summary (spec lmcache.md §7): per tier, then per deployment, its
backend, key scheme, model, ws, dtype, the hash-recipe comparison with each fact's source,
its target, counts by status and action, and what each prune class could reclaim (the
local_disk leak made visible); and §7's notes, as rules of the report's tables
(`TIER_RULES`, run by report/hints.py over every tier deployment).

Everything is read from the summary's namespaces and the manifest's namespace metadata
(`config_json`: the deployment's label fields and what families/lmcache_meta.py recorded),
never from a row's reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from kvmigrate import families
from kvmigrate.identity.values import LMCACHE_PROFILES
from kvmigrate.report.hints import Item, _finding, _Hint, _State
from kvmigrate.units import human_bytes, plural

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


# --- §7's notes --------------------------------------------------------------------------


def _assumed(st: _State, tier: Tier, d: TierDeployment) -> Iterator[Item]:
    """Every recipe fact the verdicts assumed, with the flags that state it (§3.3)."""
    if not d["assumed_facts"]:
        return
    parts = [f"{a['fact']} assumed {a['value']}: state it with {' and '.join(a['flags'])}"
             for a in d["assumed_facts"]]
    f = _finding(ASSUMED, 0, d["deployment"], "; ".join(parts))
    f["assumed"] = {a["fact"]: a["value"] for a in d["assumed_facts"]}
    yield f


def _local_disk(st: _State, tier: Tier, d: TierDeployment) -> Iterator[Item]:
    """A local_disk tier: its chunks are a leak until converted or removed (§3.5, §6)."""
    lost = d["reclaimable"]["index_lost"]
    if d["backend"] != LOCAL_DISK or not lost["files"]:
        return
    yield _finding(NOTE_LOCAL_DISK, 0, d["deployment"],
                   f"local_disk tier {tier['tier']}: no restarted engine re-indexes its "
                   f"{plural(lost['files'], '.pt file')} ({human_bytes(lost['bytes'])}), whatever their names; "
                   "convert them into a new fs tier with `migrate ROOT --target-backend fs --dest DIR`, or remove "
                   "them with `prune --index-lost` once no engine uses the tier", files=lost["files"],
                   bytes=lost["bytes"])
    yield _Hint(st.cmd.convert_tier(), f"convert local_disk tier {tier['tier']} into an fs tier under DIR "
                "(DIR/<tier>, then configure remote_url: fs://…/DIR/<tier>); without --apply it prints the plan only",
                NOTE_LOCAL_DISK, d["deployment"], 4)
    yield _Hint(st.cmd.prune("--index-lost", "--engine-stopped"), f"or, once no engine uses local_disk tier "
                f"{tier['tier']} (--engine-stopped states it), see what prune would move (dry run), then add --apply",
                NOTE_LOCAL_DISK, d["deployment"], 4)


def _seedless(st: _State, tier: Tier, d: TierDeployment) -> Iterator[Item]:
    """A writer without PYTHONHASHSEED (§3.2: random up to vLLM 0.28, fixed from 0.29 but
    for xxhash)."""
    if d["facts"].get("pythonhashseed") != "unset":
        return
    none = d["writer_none_hash"]
    if none == "random":
        text = ("seedless writer: its chain was seeded at random, no process regenerates its keys "
                "(unreproducible_hash); run writers with a fixed PYTHONHASHSEED")
    elif none == "fixed":
        text = ("seedless writer: NONE_HASH is vLLM's fixed \"vllm-none-hash\" (vLLM 0.29+), reproducible, but "
                "unlike any deployment that sets PYTHONHASHSEED: the target must leave it unset too")
    else:
        text = ("seedless writer: whether its chain is reproducible depends on its vLLM release (random up to 0.28): "
                "state it with --vllm-release")
    yield _finding(NOTE_SEEDLESS, 0, d["deployment"], text)


def _seed_fix(st: _State, tier: Tier, d: TierDeployment) -> Iterator[Item]:
    """Chunks stale by their NONE_HASH alone: the target taking the writer's seed reaches them."""
    n = d["seed_fix_files"]
    seed = d["facts"].get("pythonhashseed")
    if not n or seed is None:
        return
    yield _finding(NOTE_SEED_FIX, 0, d["deployment"],
                   f"PYTHONHASHSEED differs: start the target with PYTHONHASHSEED={seed} (the writer's) and these "
                   f"{plural(n, 'chunk file')} are reachable again (--target-pythonhashseed states the target's)",
                   files=n)
    flag = "--target-pythonhashseed"
    yield _Hint(st.cmd.rerun(flag, str(seed), replace_flags=(flag,)), f"with the target started under "
                f"PYTHONHASHSEED={seed}: {st.verb} again to see them reachable", NOTE_SEED_FIX, d["deployment"], 2)


def _corrupt_sidecar(st: _State, tier: Tier, d: TierDeployment) -> Iterator[Item]:
    """A corrupt GDS sidecar stops the startup scan of its folder, not the server (R2 §3.1)."""
    c = d["by_status"].get("corrupt_sidecar")
    if not c:
        return
    yield _finding(NOTE_CORRUPT_SIDECAR, 0, d["deployment"],
                   f"{plural(c['files'], 'corrupt GDS sidecar')} in tier {tier['tier']}: the startup scan of each "
                   "one's <2> folder stops there (logged; the server still starts and lookups still probe each key's "
                   "sidecar); its data file is orphan_data", files=c["files"], bytes=c["bytes"])


def _zero_hex64(st: _State, tier: Tier, d: TierDeployment) -> Iterator[Item]:
    """64-hex fs names starting with 0: the internal API's from_string drops the zero (R2 §3.5)."""
    n = d["zero_hex64_files"]
    if not n:
        return
    yield _finding(NOTE_ZERO_HEX64, 0, d["deployment"],
                   f"{plural(n, 'fs chunk name')} with a 64-hex hash starting with 0: /cache/load-fs-chunks cannot "
                   "load them (CacheEngineKey.from_string drops the leading zero, so it opens a name that does not "
                   "exist)", files=n)


def _rc2_in_tree(st: _State, tier: Tier, d: TierDeployment) -> Iterator[Item]:
    """Target lmcache-0.5.7rc2 for an in-process deployment: vLLM's in-tree connector
    imports the adapter 0.5.7rc2 moved (R2 §1)."""
    if d["target_profile"] != RC2 or d["backend"] == MP:
        return
    yield _finding(NOTE_RC2_IN_TREE, 0, d["deployment"],
                   f"target {RC2} under vLLM's in-tree LMCacheConnectorV1 (vLLM 0.34 included): it imports "
                   "lmcache.integration.vllm.vllm_v1_adapter, which 0.5.7rc2 moved, so the engine fails at start "
                   "(ImportError) and reads nothing; the names and bytes are 0.5.6's: stay on lmcache-0.5.6 until "
                   "vLLM's connector follows")


def _fs_native(st: _State, tier: Tier, d: TierDeployment) -> Iterator[Item]:
    """MP tiers: the fs_native adapter's usage restarts at 0 after a restart (R2 §2)."""
    if d["backend"] != MP or not d["files"]:
        return
    yield _finding(NOTE_FS_NATIVE, 0, d["deployment"],
                   f"MP tier {tier['tier']}: after a server restart the fs_native L2 adapter counts its usage from 0, "
                   f"not the {plural(d['files'], 'file')} ({human_bytes(d['bytes'])}) already here (LMCache #4564): "
                   "eviction starts late and the disk can fill; leave that much room below max_capacity",
                   files=d["files"], bytes=d["bytes"])


TIER_RULES: tuple[Callable[[_State, Tier, TierDeployment], Iterator[Item]], ...] = (
    _assumed, _local_disk, _seedless, _seed_fix, _corrupt_sidecar, _zero_hex64, _rc2_in_tree, _fs_native,
)


def tier_items(st: _State) -> Iterator[Item]:
    """Every TIER_RULES item of every deployment of every tier of the summary."""
    for tier in st.summary.get("tiers") or ():
        for d in tier["deployments"]:
            for rule in TIER_RULES:
                yield from rule(st, tier, d)
