"""The Mooncake stores of a summary (spec mooncake.md §7): per store its backends, client
roots, lock states, largest bucket id and the writer's release with its evidence; per
deployment its engine, scheme, model, key ranks, target, objects by status and action
(counted apart from the files that hold them, §4) and what each prune class could reclaim
(§6); and §7's notes, as rules of the report's tables (the codes below; report/hints.py
`STORE_RULES` runs them over every store).

The figures come from the rows, streamed: `StoreRows.add` groups each manifest batch with
Arrow into a few aggregate rows per namespace (kind of row, status, action, finding,
whether the target holds the row at another key or path, whether it is a pair file), so a
store of millions of objects costs no Python object per row. The rest is read from the
summary's namespaces and the manifest's namespace metadata (`config_json`: the store's
client roots, locks and largest bucket id; a deployment's label fields), never from a
row's reason.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from kvmigrate import families
from kvmigrate.families.mooncake import RANK_DIR
from kvmigrate.formats import mooncake as M

if TYPE_CHECKING:  # the JSON models are types only (kvmigrate.outputs)
    from kvmigrate.outputs import FileCount, Namespace, ObjectTally, Store, StoreDeployment, StoreReclaim

# what a manifest row counts as (mooncake.md §4): a file, an object row of an index (its
# bytes are its bucket's, counted apart from the disk's), or a file that is one object (a KVEntry)
FILE_ROW, OBJECT_ROW, FILE_OBJECT = 0, 1, 2

# §6's prune classes of a store, in the report's order, with the flag that opts in
CLASSES = {"residue": "--residue", "migrated": "--migrated", "tails": "--tails",
           "unreadable_namespaces": "--unreadable-namespaces"}
# files the residue class takes (misfiled: only a `.meta` Mooncake never reads, never a
# misfiled KVEntry, which a link serves)
RESIDUE = ("orphan_data", "corrupt_sidecar", "orphan_index", "tmp_leftover", "short", "header_invalid",
           "zero_filled")
START_DELETES = ("orphan_data", "corrupt_sidecar", "orphan_index")  # §1.4: the next client start deletes them
# a depth-3 file of the fsdir that does not parse as a KVEntry (no object key): no client starts
START_REFUSES = ("short", "header_invalid", "zero_filled")
KVENTRY_DEFECTS = ("short", "header_invalid", "zero_filled", "tmp_leftover")  # files only file-per-key has
UNREADABLE = ("stale_hash_recipe",)
PENDING = ("link", "rekey", "reshard")  # actions that write the store
SUPERSEDED = "superseded"  # the finding of an object whose block the target holds at its own keys (§4)
BUCKET, FILE_PER_KEY = "bucket", "file_per_key"
HELD = "held"
LOCK_NAME = M.LOCK_NAME
LOCK_TARGET = M.LOCK_RELEASE  # the first release with the client lock (§1.4, §5.1)
SCOPED_FROM = M.SCOPED_RELEASE  # the first release with tenant-scoped keys (§2.1)
RAW, SCOPED = M.SCHEMES  # mc-raw, mc-scoped
AUTO_PREFIX = "auto-"  # vLLM's cache prefix made from the build (§2.2): changes with every build

# the notes' codes (a finding's `code`), one per §7 note
ASSUMED = "assumed_facts"  # the code every family's assumed facts have
NOTE_APPLY_PROOF = "mooncake_apply_proof"
NOTE_CLIENT_LIVE = "mooncake_client_live"
NOTE_START_DELETES = "mooncake_start_deletes"
NOTE_START_REFUSED = "mooncake_start_refused"
NOTE_UNSERVED = "mooncake_unserved_keys"
NOTE_AUTO_PREFIX = "mooncake_auto_prefix"
NOTE_NEW_PAIRS = "mooncake_new_pairs_evicted_last"
NOTE_UNLOCKED = "mooncake_unlocked_client_roots"
NOTE_STORE_IS_CLIENT = "mooncake_store_is_client_root"
NOTE_RESTART = "mooncake_restart_clients"
NOTE_UNUSED_RANKS = "mooncake_unused_rank_roots"

# a status's (what it is, what follows, how to act) for a store's rows where the shared
# words (report/hints.py STATUS_ADVICE) speak of another family's files
STATUS_ADVICE: dict[str, tuple[str, str, str]] = {
    "orphan_data": ("Mooncake .bucket files without a live top-level <id>.meta",
                    "the next client start deletes them (with every .bucket below the client root)", "list"),
    "corrupt_sidecar": ("Mooncake top-level <id>.meta indexes that do not parse or list nothing",
                        "the next client start deletes each with its .bucket", "list"),
    "orphan_index": ("Mooncake <id>.meta indexes without their <id>.bucket: their objects are gone",
                     "the next client start deletes them", "list"),
    "short": ("Mooncake records cut by their .bucket's end (is_exist says 1, every read fails), or KVEntry "
              "files cut short (a client refuses to start on their store)", "never migrated", "list"),
    "header_invalid": ("files at depth 3 of a Mooncake fsdir that do not parse as a KVEntry",
                       "a client refuses to start on their store (setup() raises)", "list"),
    "misfiled": ("Mooncake KVEntries outside fpk(key) (registered, never read), or .meta files Mooncake never "
                 "reads", "a KVEntry is linked to fpk(key) by migrate; a .meta is residue", "list"),
    "tmp_leftover": ("*.tmp KVEntries at depth 3 of a Mooncake fsdir (Mooncake writes no temps)",
                     "a starting client registers them again", "list"),
    "zero_filled": ("Mooncake objects whose value is all zeros", "never migrated; a read serves zeros", "list"),
    "size_mismatch": ("Mooncake objects larger than their deployment's objects (or the stated geometry's)",
                      "never migrated: not this geometry's block", "list"),
    "replica_mismatch": ("Mooncake keys held by two live entries with different values",
                         "every read of them fails; never migrated", "list"),
    "unsupported_layout": ("Mooncake objects keyed by no known grammar (another Mooncake user)",
                           "kept, never migrated or pruned", "list"),
}


def is_store(n: Mapping[str, Any]) -> bool:
    """A namespace of a store family (its family says so: docs/families.md)."""
    return bool(n.get("family")) and families.get(n["family"]).root_layout == "stores"


def store_families() -> list[str]:
    return [f.name for f in families.writers() if f.root_layout == "stores"]


def _as_str(col: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    return pc.cast(col, pa.string()) if pa.types.is_dictionary(col.type) else col


class StoreRows:
    """The rows of store families, grouped per batch: (namespace, kind, status, action,
    finding, elsewhere, pair file) -> [rows, bytes]. `elsewhere`: an `already_present` row
    the target holds at another key (an index entry) or path (a file): a rescan's
    migrated source."""

    def __init__(self, names: Iterable[str] | None = None):
        self.families = pa.array(sorted(store_families() if names is None else names), pa.string())
        self.groups: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])

    def add(self, t: pa.Table, ns: pa.ChunkedArray | pa.Array, kind: pa.Array) -> None:
        if not len(self.families) or "family" not in t.column_names or not self._named(t["family"]):
            return
        mine = pc.fill_null(pc.is_in(_as_str(t["family"]), value_set=self.families), False)
        if not pc.any(mine).as_py():
            return
        relpath = _as_str(t["relpath"])
        pair = pc.or_(pc.ends_with(relpath, M.META_SUFFIX), pc.ends_with(relpath, M.BUCKET_SUFFIX))
        present = pc.fill_null(pc.equal(_as_str(t["action"]), "already_present"), False)
        if "target_relpath" in t.column_names and "target_key" in t.column_names:
            moved_key = pc.fill_null(pc.not_equal(t["target_key"], t["object_key"]), False)
            moved_path = pc.fill_null(pc.not_equal(_as_str(t["target_relpath"]), relpath), False)
            elsewhere = pc.and_(present, pc.if_else(pc.equal(kind, OBJECT_ROW), moved_key, moved_path))
        else:  # (a summary that did not read the target columns: no store of the root)
            elsewhere = pc.and_(present, pa.scalar(False))
        work = pa.table({
            "ns": ns, "kind": kind, "status": _as_str(t["status"]), "action": _as_str(t["action"]),
            "finding": _as_str(t["finding"]), "elsewhere": elsewhere, "pair": pair,
            "size": pc.fill_null(t["size"], 0),
        }).filter(mine)
        keys = ["ns", "kind", "status", "action", "finding", "elsewhere", "pair"]
        agg = work.group_by(keys).aggregate([("size", "sum"), ([], "count_all")])
        for row in zip(*(agg[c].to_pylist() for c in (*keys, "size_sum", "count_all"))):
            g = self.groups[tuple(row[:7])]
            g[0] += row[8]
            g[1] += row[7] or 0

    def _named(self, col: pa.ChunkedArray | pa.Array) -> bool:
        """Whether a store family can be in the column: a dictionary's values say it without
        decoding the rows (a batch of another family's rows costs nothing more)."""
        chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
        for c in chunks:
            values = c.dictionary if pa.types.is_dictionary(c.type) else c
            if pc.any(pc.fill_null(pc.is_in(values, value_set=self.families), False)).as_py():
                return True
        return False

    def of(self) -> dict[str, list[tuple[tuple, list[int]]]]:
        """namespace -> its groups ((kind, status, action, finding, elsewhere, pair), [rows, bytes])."""
        out: dict[str, list[tuple[tuple, list[int]]]] = defaultdict(list)
        for (ns, *key), v in self.groups.items():
            if ns is not None:
                out[ns].append((tuple(key), v))
        return out


def _reclaim() -> StoreReclaim:
    return {"files": 0, "bytes": 0, "objects": 0, "held_bytes": 0}


def _fc() -> FileCount:
    return {"files": 0, "bytes": 0}


def _add_fc(into: FileCount, n: int, b: int) -> None:
    into["files"] += n
    into["bytes"] += b


def _tally(objects: Mapping[str, ObjectTally] | None) -> dict[str, ObjectTally]:
    return {k: {"objects": v["objects"], "bytes": v["bytes"]} for k, v in (objects or {}).items()}


class _Figures:
    """What one namespace's groups say (§6's classes, §7's counts)."""

    def __init__(self, groups: list[tuple[tuple, list[int]]]):
        self.reclaimable = {cls: _reclaim() for cls in CLASSES}
        self.start_deletes: dict[str, FileCount] = {}
        self.start_refuses: FileCount = _fc()
        self.cut_records = self.raw_keys = self.misfiled = self.pending = self.reshard = 0
        self.bucket = self.file_per_key = False
        self.object_statuses: set[str] = set()
        self.entries: dict[str, ObjectTally] = {}  # index entries (object rows) by status
        stale: list[tuple[int, int, int]] = []
        for (kind, status, action, finding, elsewhere, pair), (n, b) in groups:
            r = self.reclaimable
            if kind == OBJECT_ROW or (kind == FILE_ROW and pair):
                self.bucket = True
            if kind == FILE_OBJECT or (kind == FILE_ROW and not pair and status in KVENTRY_DEFECTS):
                self.file_per_key = True
            if kind == OBJECT_ROW:
                e = self.entries.setdefault(status, {"objects": 0, "bytes": 0})
                e["objects"] += n
                e["bytes"] += b
            if kind != FILE_ROW:
                self.object_statuses.add(status)
                if action in PENDING:
                    self.pending += n
                if action == "reshard":
                    self.reshard += n
                if action == "rekey":
                    self.raw_keys += n
            if kind != OBJECT_ROW and (status in RESIDUE or (status == "misfiled" and kind == FILE_ROW)):
                r["residue"]["files"] += n
                r["residue"]["bytes"] += b
                r["residue"]["objects"] += n if kind == FILE_OBJECT else 0
            if kind == FILE_ROW and status in START_DELETES:
                _add_fc(self.start_deletes.setdefault(status, _fc()), n, b)
            if kind == FILE_ROW and not pair and status in START_REFUSES:
                _add_fc(self.start_refuses, n, b)
            if kind == OBJECT_ROW and status == "short":  # a cut record of a live pair
                self.cut_records += n
                r["tails"]["objects"] += n
                r["tails"]["held_bytes"] += b
            if kind == FILE_OBJECT and status == "misfiled":
                self.misfiled += n
            if elsewhere or finding == SUPERSEDED:
                m = r["migrated"]
                m["objects"] += n if kind != FILE_ROW else 0
                if kind == OBJECT_ROW:  # its pair stays while it lists live objects
                    m["held_bytes"] += b
                else:
                    m["files"] += n
                    m["bytes"] += b
            if kind != FILE_ROW and status in UNREADABLE:
                stale.append((kind, n, b))
        if stale and self.object_statuses <= set(UNREADABLE):  # a deployment no engine reads
            u = self.reclaimable["unreadable_namespaces"]
            for kind, n, b in stale:
                u["objects"] += n
                if kind == OBJECT_ROW:
                    u["held_bytes"] += b
                else:
                    u["files"] += n
                    u["bytes"] += b


def _stated(name: str, spaces: Sequence[Mapping[str, Any]], flags: Mapping[str, Any]) -> tuple[Any, str | None]:
    """(value, where) of a store fact: a namespace of the store states it, else the scan's flag."""
    for n in spaces:
        value = (n.get("facts") or {}).get(name)
        if value is not None:
            source = (n.get("facts_source") or {}).get(name) or "stated"
            return value, ("flag" if source == "flag" else source)
    if flags.get(name) is not None:
        return flags[name], "flag"
    return None, None


def _deployment(n: Namespace, fields: Mapping[str, Any], fig: _Figures) -> StoreDeployment:
    objects = n.get("objects") or {"objects": 0, "bytes": 0, "by_status": {}, "by_action": {}}
    stem = str(fields.get("stem") or "")
    prefix, at, _ = stem.partition("@")  # (only a vLLM stem holds a cache prefix before an `@`)
    writer_tp = (n["facts"] or {}).get("writer_tp")
    return {
        "deployment": n["source_base"], "engine": str(fields.get("engine") or ""), "stem": stem,
        "scheme": n["scheme"], "tenant": fields.get("tenant"), "model": n["model_name"],
        "kv_kind": fields.get("kv_kind"), "key_ranks": int(fields.get("key_ranks") or 0),
        "writer_tp": writer_tp if isinstance(writer_tp, int) else None,
        "target": fields.get("target_label") or n["target_base"], "target_profile": n["target_profile"],
        "assumed_facts": dict(n["assumed_facts"]),
        "files": n["files"], "bytes": n["bytes"],
        "objects": objects["objects"], "object_bytes": objects["bytes"],
        "by_status": _tally(objects["by_status"]), "by_action": _tally(objects["by_action"]),
        "entries_by_status": {k: fig.entries[k] for k in sorted(fig.entries)},
        "pending_objects": fig.pending, "reshard_objects": fig.reshard,
        "cut_records": fig.cut_records, "raw_keys": fig.raw_keys, "misfiled_entries": fig.misfiled,
        "auto_prefix": prefix if at and prefix.startswith(AUTO_PREFIX) else None,
        "reclaimable": fig.reclaimable,
    }


def _sum_reclaim(into: dict[str, StoreReclaim], part: Mapping[str, StoreReclaim]) -> None:
    for cls, v in part.items():
        o = into[cls]
        for k in ("files", "bytes", "objects", "held_bytes"):
            o[k] += v[k]


def _release(spaces: Sequence[Mapping[str, Any]], deps: list[StoreDeployment], locks: Mapping[str, str],
             flags: Mapping[str, Any]) -> tuple[str | None, str, bool]:
    """(the writer's release, its evidence, whether it is stated): the `writer_release`
    fact, else the lock file 0.3.14 creates, else the keys (mc-raw <= 0.3.11, mc-scoped >= 0.3.12)."""
    value, where = _stated("writer_release", spaces, flags)
    if value is not None:
        shown = ",".join(value) if isinstance(value, (list, tuple)) else str(value)
        return shown, f"stated ({where})", True
    schemes = {d["scheme"] for d in deps}
    if any(s != "absent" for s in locks.values()):
        return f">={'.'.join(map(str, LOCK_TARGET))}", f"its client lock file {M.LOCK_NAME}, which 0.3.14 creates", False
    if SCOPED in schemes:
        mixed = " (raw keys too: an older writer)" if RAW in schemes else ""
        return f">={'.'.join(map(str, SCOPED_FROM))}", f"tenant-scoped keys ({SCOPED}){mixed}", False
    if RAW in schemes:
        return f"<={'.'.join(map(str, SCOPED_FROM[:2]))}.{SCOPED_FROM[2] - 1}", f"raw keys only ({RAW})", False
    return None, "no keys", False


def stores_of(namespaces: list[Namespace], ns_meta: Mapping[str, Mapping[str, Any]], rows: StoreRows | None,
              flags: Mapping[str, Any] | None = None) -> list[Store]:
    """The summary's `stores`: every Mooncake store of the root with its deployments, in
    store order. `flags`: the scan's fact flags (a store fact stated for the whole root)."""
    groups = rows.of() if rows is not None else {}
    flags = flags or {}
    by_store: dict[str, list[tuple[Namespace, Mapping[str, Any]]]] = defaultdict(list)
    for n in namespaces:
        if is_store(n):
            fields = (ns_meta.get(n["source_base"]) or {}).get("config_json") or {}
            by_store[str(fields.get("store") or ".")].append((n, fields))
    out: list[Store] = []
    for name in sorted(by_store):
        members = by_store[name]
        own = next(((n, f) for n, f in members if "client_roots" in f), None)
        fields = own[1] if own else {}
        deps: list[StoreDeployment] = []
        reclaim = {cls: _reclaim() for cls in CLASSES}
        deletes: dict[str, FileCount] = {}
        refuses = _fc()
        backends: set[str] = set()
        for n, f in members:
            fig = _Figures(groups.get(n["source_base"], []))
            backends |= {b for b, has in ((BUCKET, fig.bucket), (FILE_PER_KEY, fig.file_per_key)) if has}
            for status in START_DELETES:
                if status in fig.start_deletes:
                    c = fig.start_deletes[status]
                    _add_fc(deletes.setdefault(status, _fc()), c["files"], c["bytes"])
            _add_fc(refuses, fig.start_refuses["files"], fig.start_refuses["bytes"])
            _sum_reclaim(reclaim, fig.reclaimable)
            if n is not (own[0] if own else None):
                deps.append(_deployment(n, f, fig))
        locks = {str(k): str(v) for k, v in (fields.get("locks") or {}).items()}
        if fields.get("largest_bucket_id") is not None:
            backends.add(BUCKET)
        spaces = [n for n, _ in members]
        release, evidence, stated = _release(spaces, deps, locks, flags)
        stopped, _ = _stated("engine_stopped", spaces, flags)
        roots = [str(c) for c in fields.get("client_roots") or ()]
        target_tp, _ = _stated("target_tp", spaces, flags)
        files = sum(n["files"] for n in spaces)
        nbytes = sum(n["bytes"] for n in spaces)
        out.append({
            "store": name, "namespace": own[0]["source_base"] if own else None,
            "backends": sorted(backends), "client_roots": roots, "locks": locks,
            "client_live": sorted(c for c, s in locks.items() if s == HELD),
            "largest_bucket_id": fields.get("largest_bucket_id"),
            "writer_release": release, "writer_release_evidence": evidence, "writer_release_stated": stated,
            "engine_stopped": bool(stopped),
            # its own folder is a bucket client root above others: that client's start deletes their buckets
            "store_is_client_root": name in roots and len(roots) > 1 and BUCKET in backends,
            "target_tp": target_tp if isinstance(target_tp, int) else None,
            "unused_rank_roots": unused_rank_roots(roots, target_tp),
            "files": files, "bytes": nbytes,
            "objects": sum(d["objects"] for d in deps), "object_bytes": sum(d["object_bytes"] for d in deps),
            "pending_objects": sum(d["pending_objects"] for d in deps),
            "start_deletes": deletes, "start_refuses": refuses,
            "deployments": deps, "reclaimable": reclaim,
            "notes": list((own[0]["notes"] if own else None) or ()),
        })
    return out


def unused_rank_roots(roots: Iterable[str], target_tp: Any) -> list[str]:
    """SGLang's rank client roots `rank_<dp>_<tp>_<pp>_<cp>` of TP ranks the target does not
    run (a TP shrink): no rank starts a client there (§2.3)."""
    if not isinstance(target_tp, int):
        return []
    out = []
    for root in roots:
        m = RANK_DIR.match(root.rsplit("/", 1)[-1])
        if m is not None and int(m.group(2)) >= target_tp:
            out.append(root)
    return out


def lock_label(store: Mapping[str, Any]) -> str:
    """The client roots' lock states, e.g. "rank_0_0_0_0 held (client live), rank_0_1_0_0 free"."""
    return ", ".join(f"{c} {s}" + (" (client live)" if s == HELD else "") for c, s in store["locks"].items()) or "-"


def release_ok_for_lock(store: Mapping[str, Any]) -> bool:
    """§5.1 (a): a writer release >= 0.3.14 stated, so the client flock is a proof."""
    if not store["writer_release_stated"]:
        return False
    return M.lock_proves(store["writer_release"].split(",") if store["writer_release"] else [])
