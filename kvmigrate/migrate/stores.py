"""Migrating Mooncake stores (spec mooncake.md §3.3, §5): the planned work of the scan's
store rows, applied with the write primitives of migrate/mooncake_store.py.

A Mooncake store is not a namespace of block files: a rekeyed bucket object stays in its
pair, only its key in the `.meta` index changes (an index rewrite), and a file-per-key entry
is a KVEntry at `fpk(key)`. So a store's work is planned and applied here, per store, beside
the tree and flat targets of the plan, in the same journal (records `mc_*`):

    mc_store   the store, its proofs (a held client flock per bucket client root, or the
               engine_stopped statement), the client roots it writes, kvmigrate's own locks
    mc_intent  fsynced before anything of the store is written: every index rewrite
               (the `.meta`, entry -> new key) and every KVEntry (source, path, key)
    mc_index   after an index rewrite: its original XXH3, the backup, the new XXH3
    mc_entry   after a KVEntry was placed: its path, XXH3, the folders made for it
    mc_done    the store's work finished (stage and own locks removed)

Order per store (§5.2): proofs and locks, the intent, index rewrites, new KVEntries. Source
`.bucket` files are never modified: every value stays readable at its manifest location.
Rollback puts every rewritten index's original back (only while it holds the journaled new
bytes) and removes the KVEntries the run placed (only with their journaled bytes).
"""

from __future__ import annotations

import errno
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import xxhash

from kvmigrate import families, layout
from kvmigrate import manifest as mf
from kvmigrate.errors import OperationalError, UsageError, write_error
from kvmigrate.formats import mooncake as M
from kvmigrate.migrate import mooncake_store as MS
from kvmigrate.migrate.fsops import check_relpath

OWN_LOCK = ".kvmigrate.lock"  # kvmigrate's lock in each client root it writes (holder pid inside)
BACKUP_DIR = os.path.join(layout.OWN_DIR, "mooncake")  # ROOT/.kvmigrate/mooncake/<run>/<relpath>.orig
STORE_ACTIONS = ("rekey", "link", "reshard")  # what this release applies of a store's rows
FLOCK_RELEASE = (0, 3, 14)  # the first Mooncake that holds the client lock (§5.1)
_COLUMNS = ["relpath", "source_base", "family", "action", "object_index", "object_key", "target_key",
            "target_relpath", "size", "mtime_ns", "inode", "payload_xxh3_128", "status", "group", "block_hash"]


@dataclass
class IndexRewrite:
    """The new keys of some entries of one live `.meta` (a rekey, §5.2)."""

    meta: str  # relpath of the `.meta`
    client: str  # its client root's relpath ('' for ROOT)
    keys: dict[int, bytes] = field(default_factory=dict)  # entry -> new storage key
    old_keys: dict[int, bytes] = field(default_factory=dict)  # entry -> its key as scanned
    values: dict[int, bytes | None] = field(default_factory=dict)  # entry -> its value's XXH3-128 (hash scans)
    retire: set[int] = field(default_factory=set)  # entries a reshard displaces (§3.5): no object placed
    inode: int = 0  # the `.meta`'s stat as scanned (staleness: its object rows carry it)
    mtime_ns: int = 0


@dataclass
class EntryWrite:
    """A KVEntry the target reads at `path` (fpk of `key`): from the source entry's value."""

    source: str
    path: str
    key: bytes
    action: str  # rekey (a new entry, the key changes) or link (the same bytes at fpk(key))
    client: str
    size: int = 0
    mtime_ns: int = 0
    value: bytes | None = None  # the value's XXH3-128 (hash scans)


class ObjectRow(NamedTuple):
    """An object row of a store with a reshard (its sources, and what holds its target keys)."""

    relpath: str
    entry: int | None  # object_index
    key: bytes
    size: int
    value: bytes | None
    source_base: str
    group: int | None
    block_hash: bytes | None
    status: str
    inode: int
    mtime_ns: int


@dataclass(frozen=True)
class SourceRef:
    """One source object of a resharded block, as the scan read it."""

    relpath: str  # its `.meta` (a bucket entry) or its KVEntry file
    index: int | None
    key: bytes
    client: str
    size: int
    value: bytes | None  # XXH3-128 (hash scans)


@dataclass
class ReshardWork:
    """A GQA/MHA block read at another TP (§3.4): its sources by (key rank, half), the
    objects the target reads, and the sources holding a target key (displaced, §3.5)."""

    n_s: int
    n_t: int
    geometry: Any  # families.mooncake_reshard.Geometry
    sources: dict[tuple[int, str], SourceRef]
    outputs: list[Any]  # families.mooncake_reshard.Output
    displaced: list[SourceRef]
    kventries: bool  # file-per-key: outputs are KVEntries at fpk(key); else new pairs
    fsdir: str = M.DEFAULT_FSDIR


@dataclass
class StorePlan:
    store: str
    rewrites: list[IndexRewrite] = field(default_factory=list)
    entries: list[EntryWrite] = field(default_factory=list)
    reshards: list[ReshardWork] = field(default_factory=list)
    bucket_clients: list[str] = field(default_factory=list)  # client roots whose index a rewrite changes
    clients: list[str] = field(default_factory=list)  # every client root written
    flock_stated: bool = False  # writer_release >= 0.3.14 stated: the client lock is the proof
    stopped_stated: bool = False  # engine_stopped stated for the store
    objects: Counter = field(default_factory=Counter)  # action -> objects

    @property
    def proof(self) -> str | None:
        """How the apply proves no client runs (§5.1): `flock` (every client root written is
        a bucket one with >= 0.3.14 stated), `engine_stopped`, or None (no proof)."""
        if self.stopped_stated:
            return "engine_stopped"
        if self.flock_stated and set(self.clients) <= set(self.bucket_clients):
            return "flock"
        return None


def to_intent(p: StorePlan, pairs: list[tuple[str, int, list, str, str]], entries: list[tuple]) -> dict[str, Any]:
    """The store's whole plan as its journal intent: everything a resumed run needs to do
    exactly the same (§5.3), and a rollback to prove what is the run's."""
    return {"t": "mc_intent", "store": p.store, "proof": p.proof,
            "rewrites": [{"meta": rw.meta, "client": rw.client, "inode": rw.inode, "mtime_ns": rw.mtime_ns,
                          "keys": {str(i): k.hex() for i, k in rw.keys.items()},  # (its stat proves the rest)
                          "retire": sorted(rw.retire)} for rw in p.rewrites],
            "entries": [{"source": e.source, "path": e.path, "key": e.key.hex(), "action": e.action,
                         "client": e.client, "size": e.size, "mtime_ns": e.mtime_ns,
                         "value": e.value.hex() if e.value else None} for e in p.entries],
            "reshards": [{"n_s": w.n_s, "n_t": w.n_t, "geometry": [w.geometry.heads, w.geometry.head_dim,
                                                                  w.geometry.elem_bytes],
                          "kventries": w.kventries, "fsdir": w.fsdir,
                          "sources": [{"rank": r, "half": h, "relpath": src.relpath, "index": src.index,
                                       "key": src.key.hex(), "client": src.client, "size": src.size,
                                       "value": src.value.hex() if src.value else None}
                                      for (r, h), src in sorted(w.sources.items())],
                          "outputs": [{"rank": o.rank, "half": o.half, "engine_key": o.engine_key,
                                       "key": o.key.hex(), "client": o.client, "size": o.size} for o in w.outputs],
                          "displaced": [src.relpath + ("" if src.index is None else f"[{src.index}]")
                                        for src in w.displaced]} for w in p.reshards],
            "pairs": [{"client": c, "id": i, "bucket": b, "meta": m} for c, i, _, b, m in pairs],
            "outputs": [{"path": path, "xxh3": MS.xxh3_hex(data), "client": c} for c, path, data, _ in entries],
            "clients": p.clients, "bucket_clients": p.bucket_clients}


def from_intent(rec: dict[str, Any]) -> StorePlan:
    """A StorePlan rebuilt from its journal intent (a resumed run does exactly that)."""
    from kvmigrate.families import mooncake_reshard as R

    p = StorePlan(rec["store"], clients=list(rec.get("clients") or ()),
                  bucket_clients=list(rec.get("bucket_clients") or ()))
    p.stopped_stated = rec.get("proof") == "engine_stopped"
    p.flock_stated = rec.get("proof") == "flock"
    for r in rec.get("rewrites", ()):
        rw = IndexRewrite(r["meta"], r["client"], inode=r.get("inode", 0), mtime_ns=r.get("mtime_ns", 0))
        rw.keys = {int(i): bytes.fromhex(k) for i, k in r["keys"].items()}
        rw.retire = set(r.get("retire") or ())
        rw.values = {i: None for i in rw.keys}
        p.rewrites.append(rw)
    for e in rec.get("entries", ()):
        p.entries.append(EntryWrite(e["source"], e["path"], bytes.fromhex(e["key"]), e["action"], e["client"],
                                    e.get("size", 0), e.get("mtime_ns", 0),
                                    bytes.fromhex(e["value"]) if e.get("value") else None))
    for w in rec.get("reshards", ()):
        sources = {(s["rank"], s["half"]): SourceRef(s["relpath"], s["index"], bytes.fromhex(s["key"]), s["client"],
                                                      s["size"], bytes.fromhex(s["value"]) if s["value"] else None)
                   for s in w["sources"]}
        outs = [R.Output(o["rank"], o["half"], o["engine_key"], bytes.fromhex(o["key"]), o["client"], o["size"])
                for o in w["outputs"]]
        named = set(w.get("displaced") or ())
        displaced = [src for src in sources.values()
                     if src.relpath + ("" if src.index is None else f"[{src.index}]") in named]
        p.reshards.append(ReshardWork(w["n_s"], w["n_t"], R.Geometry(*w["geometry"]), sources, outs, displaced,
                                      w["kventries"], w.get("fsdir") or M.DEFAULT_FSDIR))
    for e in p.entries:
        p.objects[e.action] += 1
    for rw in p.rewrites:
        p.objects["rekey"] += len(rw.keys) - len(rw.retire)
    for w in p.reshards:
        p.objects["reshard"] += len(w.outputs)
    return p


def _release(value: Any) -> tuple[int, ...] | None:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", str(value or ""))
    return tuple(int(x) for x in m.groups()) if m else None


def plan_stores(manifest_path: str, namespaces: dict[str, dict[str, Any]], *, engine_stopped: bool = False,
                chosen: Iterable[str] | None = None, dest: bool = False) -> list[StorePlan]:
    """The store work of a manifest: its `rekey`, `link` and `reshard` rows, grouped per
    store. `dest`: a migration into another folder (§3.6), which then holds exactly what
    the target reads: the objects read in place (`already_present` at their own key and
    path) are placed there too."""
    store_of = {b: (ns.get("config_json") or {}).get("store") for b, ns in namespaces.items()
                if families.get(ns.get("family")).root_layout == "stores"}
    if chosen is not None:
        keep = set(chosen)
        store_of = {b: s for b, s in store_of.items() if b in keep}
    if not store_of:
        return []
    plans: dict[str, StorePlan] = {}
    rewrites: dict[str, IndexRewrite] = {}
    resharding = {b for b, ns in namespaces.items() if b in store_of and
                  (ns.get("config_json") or {}).get("target_key_ranks")}
    objects: dict[str, list[ObjectRow]] = {}  # store -> its objects (a reshard's sources and what holds its keys)
    primaries: list[tuple[str, str, int, bytes, bytes]] = []  # (store, namespace, group, block hash, target key)
    for batch in mf.iter_batches(manifest_path, columns=_COLUMNS):
        cols = batch.to_pydict()
        for i, action in enumerate(cols["action"]):
            if cols["source_base"][i] not in store_of:
                continue
            base = cols["source_base"][i]
            store = str(store_of[base])
            if resharding and cols["object_key"][i] is not None:
                objects.setdefault(store, []).append(ObjectRow(
                    cols["relpath"][i], cols["object_index"][i], cols["object_key"][i], cols["size"][i] or 0,
                    cols["payload_xxh3_128"][i], base, cols["group"][i], cols["block_hash"][i], cols["status"][i],
                    cols["inode"][i] or 0, cols["mtime_ns"][i] or 0))
            if action == "reshard":
                primaries.append((store, base, cols["group"][i], cols["block_hash"][i], cols["target_key"][i]))
                _plan_of(plans, store, namespaces, store_of, engine_stopped)
                continue
            in_place = (action == "already_present" and cols["object_key"][i] is not None
                        and cols["target_key"][i] == cols["object_key"][i]
                        and (cols["object_index"][i] is not None or cols["target_relpath"][i] == cols["relpath"][i]))
            if action not in STORE_ACTIONS and not (dest and in_place):
                continue
            if in_place:
                action = "link"  # (into DIR: the same bytes, at the same key and path)
            plan = _plan_of(plans, store, namespaces, store_of, engine_stopped)
            relpath, target = cols["relpath"][i], cols["target_relpath"][i]
            key = cols["target_key"][i]
            check_relpath(relpath, f"{manifest_path}: row")
            if not key or not target:
                raise UsageError(f"{manifest_path}: row {relpath!r}: a {action} without its target key or path; "
                                 "refusing this manifest", hint="regenerate it with `kvmigrate scan`")
            index = cols["object_index"][i]
            client = target[:-1] if target.endswith("/") else _client_of(relpath, target)
            if index is not None:  # an entry of a live index: rewritten in place
                rw = rewrites.get(relpath)
                if rw is None:
                    rw = rewrites[relpath] = IndexRewrite(relpath, client, inode=cols["inode"][i] or 0,
                                                          mtime_ns=cols["mtime_ns"][i] or 0)
                    plan.rewrites.append(rw)
                    if client not in plan.bucket_clients:
                        plan.bucket_clients.append(client)
                rw.keys[index] = key
                rw.old_keys[index] = cols["object_key"][i]
                rw.values[index] = cols["payload_xxh3_128"][i]
            else:
                check_relpath(target, f"{manifest_path}: row {relpath!r} target")
                plan.entries.append(EntryWrite(relpath, target, key, action, client, cols["size"][i] or 0,
                                               cols["mtime_ns"][i] or 0, cols["payload_xxh3_128"][i]))
            if client not in plan.clients:
                plan.clients.append(client)
            plan.objects[action] += 1
    for store, base, group, block, first_key in primaries:
        work = _reshard_work(base, group, block, first_key, namespaces[base], objects.get(store, []))
        plan = plans[store]
        plan.reshards.append(work)
        for out in work.outputs:
            if out.client not in plan.clients:
                plan.clients.append(out.client)
        for src in work.displaced:  # a bucket entry holding a target key: retired (its key rewritten)
            if src.index is not None:
                rw = rewrites.get(src.relpath)
                if rw is None:
                    row = next(o for o in objects[store] if o.relpath == src.relpath)  # (its index's stat)
                    rw = rewrites[src.relpath] = IndexRewrite(src.relpath, src.client, inode=row.inode,
                                                              mtime_ns=row.mtime_ns)
                    plan.rewrites.append(rw)
                    if src.client not in plan.bucket_clients:
                        plan.bucket_clients.append(src.client)
                rw.keys[src.index] = b""  # (the run's retired key, made when the run id is known)
                rw.retire.add(src.index)
                rw.old_keys[src.index] = src.key
                rw.values[src.index] = None
        plan.objects["reshard"] += len(work.outputs)
        for c in {s.client for s in work.sources.values()}:
            if c not in plan.bucket_clients and not work.kventries:
                plan.bucket_clients.append(c)
    return [plans[s] for s in sorted(plans)]


def _plan_of(plans: dict[str, StorePlan], store: str, namespaces: dict[str, dict[str, Any]],
             store_of: dict[str, Any], engine_stopped: bool) -> StorePlan:
    plan = plans.get(store)
    if plan is None:
        plan = plans[store] = StorePlan(store)
        facts = [namespaces[b].get("facts") or {} for b, s in store_of.items()  # (its deployments')
                 if s == store and (namespaces[b].get("config_json") or {}).get("engine")]
        plan.stopped_stated = engine_stopped or any(f.get("engine_stopped") is True for f in facts)
        rel = [_release(f.get("writer_release")) for f in facts]
        plan.flock_stated = bool(rel) and all(r is not None and r >= FLOCK_RELEASE for r in rel)
    return plan


def _reshard_work(base: str, group: int, block: bytes, first_key: bytes, ns: dict[str, Any],
                  objects: list[ObjectRow]) -> ReshardWork:
    """The block's sources, outputs and displaced objects, re-derived from the rows through
    the function the scan used (families/mooncake_reshard.py): both name the same keys."""
    from kvmigrate.families import mooncake as fam
    from kvmigrate.families import mooncake_reshard as R

    fields = ns.get("config_json") or {}
    engine, n_s, n_t = fields["engine"], int(fields["key_ranks"]), int(fields["target_key_ranks"])
    geo = R.Geometry(*fields["geometry"])
    sources: dict[tuple[int, str], SourceRef] = {}
    registered: dict[bytes, list[SourceRef]] = {}
    for relpath, index, key, size, value, sb, g, h, status, _ino, _mtime in objects:
        sk = M.parse_storage_key(key)
        ref = SourceRef(relpath, index, key, _client_of_object(relpath, index), size or 0, value)
        if index is not None or relpath.endswith(M.fpk(key, relpath.split("/")[-4] if relpath.count("/") >= 3
                                                             else M.DEFAULT_FSDIR)):
            registered.setdefault(M.scoped(sk.engine, sk.tenant or M.DEFAULT_TENANT), []).append(ref)
        if sb == base and g == group and h == block and status == "ok":
            ek = fam.parse_engine_key(sk.engine)
            if ek is not None:
                sources[(ek.rank, ek.half)] = ref
    halves = tuple(sorted({h for _, h in sources}))
    rank0 = sources[(0, halves[0])]
    kventries = rank0.index is None
    fsdir = rank0.relpath.split("/")[-4] if kventries else M.DEFAULT_FSDIR
    first = M.parse_storage_key(first_key)  # target key rank 0's key, as the scan named it
    value_size = _kventry_value_size(rank0) if kventries else rank0.size
    outs = R.outputs(engine, first.engine, rank0.client, n_t, halves, first.tenant, value_size, n_s, geo)
    mine = set(sources.values())
    displaced = [ref for o in outs for ref in registered.get(o.key, []) if ref in mine]
    return ReshardWork(n_s, n_t, geo, sources, outs, displaced, kventries, fsdir)


def _kventry_value_size(ref: SourceRef) -> int:
    """A KVEntry source's value bytes (its row's size is the file's): its file minus the
    key field and the value's tag and length (struct_pb's layout, §1.3)."""
    key_field = 1 + len(M.encode_varint(len(ref.key))) + len(ref.key)
    rest = ref.size - key_field  # 1 tag byte + varint(n) + n
    for length_bytes in range(1, 11):
        n = rest - 1 - length_bytes
        if n >= 0 and len(M.encode_varint(n)) == length_bytes:
            return n
    return 0


def _client_of_object(relpath: str, index: int | None) -> str:
    """The client root of an index entry (its `.meta`'s folder) or of a KVEntry."""
    if index is not None:
        return relpath.rpartition("/")[0]
    return "/".join(relpath.split("/")[:-4])


def _client_of(relpath: str, target: str) -> str:
    """The client root of a KVEntry: what precedes its `<fsdir>/<a>/<b>/<name>` (4 parts)."""
    parts = target.split("/")
    return "/".join(parts[:-4])


def describe(plans: list[StorePlan], dest: str | None = None) -> list[str]:
    """The dry run's lines: per store, its work and the proof the apply needs (none into
    another folder `dest`)."""
    lines: list[str] = []
    for p in plans:
        what = ", ".join(f"{n} {a}" for a, n in sorted(p.objects.items()))
        if dest is not None:
            lines.append(f"  Mooncake store {p.store} into {os.path.join(dest, p.store)}: {what} (the store under "
                         "ROOT is only read: no proof that its clients are stopped is needed)")
            continue
        lines.append(f"  Mooncake store {p.store}: {what} ({len(p.rewrites)} index rewrites, "
                     f"{len(p.entries)} KVEntries)")
        proof = p.proof
        if proof == "flock":
            lines.append("    the apply takes the Mooncake 0.3.14 client lock of each client root it writes "
                         "(a held lock: exit 8, nothing written)")
        elif proof == "engine_stopped":
            lines.append("    no Mooncake client uses it (engine_stopped stated); the apply also takes the client "
                         "lock of each bucket client root it writes")
        else:
            lines.append("    the apply needs a proof that no Mooncake client uses it: stop the engines and pass "
                         "--engine-stopped (or state writer_release >= 0.3.14 for a bucket store)")
    return lines


def check_proofs(root: str, plans: list[StorePlan]) -> None:
    """A store without a proof that its clients are stopped: exit 2, before anything (even
    the journal) is written."""
    missing = [p.store for p in plans if p.proof is None]
    if missing:
        raise UsageError(f"Mooncake store {missing[0]}: no proof that its clients are stopped"
                         + (f" (and {len(missing) - 1} more stores)" if len(missing) > 1 else ""),
                         path=os.path.join(root, missing[0]) if missing[0] != "." else root,
                         hint="stop every engine using the store and rerun with --engine-stopped (or state "
                              "writer_release >= 0.3.14 for a bucket store: its client lock then proves it)")


def _keep_displaced(p: StorePlan, work: ReshardWork) -> None:
    """A reshard that will not run retires nothing: its displaced entries leave the index
    rewrites (a rewrite left with no entry is dropped)."""
    for src in work.displaced:
        for rw in p.rewrites:
            if rw.meta == src.relpath and src.index is not None:
                rw.keys.pop(src.index, None)
                rw.old_keys.pop(src.index, None)
                rw.retire.discard(src.index)
    p.rewrites = [rw for rw in p.rewrites if rw.keys]


class StoreApplier:
    """Applies the store plans of one migration run, writing its journal."""

    def __init__(self, root: str, plans: list[StorePlan], journal: Any, run_id: str,
                 crash: Callable[[str], None], resumed: list[dict[str, Any]] | None = None):
        self.root = root
        self.plans = plans
        self.journal = journal
        self.run_id = run_id
        self.crash = crash
        self.flocks: list[MS.ClientLock] = []
        self.own_locks: list[str] = []
        self.outcomes: Counter = Counter()
        self.skipped: list[str] = []
        # what an interrupted run of this journal already did: index -> new XXH3, entry -> XXH3
        self.done_index = {r["meta"]: r["new"] for r in resumed or () if r.get("t") == "mc_index"}
        self.done_entry = {r["path"]: r["xxh3"] for r in resumed or () if r.get("t") in ("mc_entry", "mc_replace")
                           for r in [{**r, "xxh3": r.get("xxh3") or r.get("new")}]}
        # a store whose intent an interrupted run wrote and did not finish: that intent is done
        # exactly (its pairs' ids and hashes), not a plan from a scan of the half-done store
        finished = {r["store"] for r in resumed or () if r.get("t") == "mc_done"}
        self.unfinished = {r["store"]: r for r in resumed or () if r.get("t") == "mc_intent"
                           and r["store"] not in finished}
        self.resuming = False

    def _abs(self, relpath: str) -> str:
        return os.path.join(self.root, relpath) if relpath else self.root

    def take_proofs(self) -> None:
        """Every proof of every store before the first write (§5.1): no proof → exit 2
        (`check_proofs`), a held client lock → exit 8; nothing written either way."""
        check_proofs(self.root, self.plans)
        resumed = [from_intent(i) for i in self.unfinished.values()]
        try:
            taken: set[str] = set()
            for p in [*[q for q in self.plans if q.store not in self.unfinished], *resumed]:
                for client in p.bucket_clients:
                    if client in taken:
                        continue
                    taken.add(client)
                    lock = MS.hold_client_lock(self._abs(client))
                    self.flocks.append(lock)
                    self.journal.write({"t": "mc_store", "store": p.store, "client": client, "proof": p.proof,
                                        "lock_created": lock.created}, sync=True)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for lock in reversed(self.flocks):
            lock.release()
        self.flocks = []

    def apply(self) -> None:
        planned = {p.store for p in self.plans}
        for store, intent in sorted(self.unfinished.items()):
            self.resuming = True
            self._store(from_intent(intent), intent)
            self.resuming = False
            if store in planned:
                self.skipped.append(f"Mooncake store {store}: an interrupted run's work was finished; rerun the "
                                    "migration to plan anything else of it")
        for p in self.plans:
            if p.store not in self.unfinished:
                self._store(p)

    def _own_lock(self, client: str) -> None:
        path = os.path.join(self._abs(client), OWN_LOCK)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            return  # (an interrupted run's: removed at the end of this one)
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        self.own_locks.append(path)

    def _store(self, p: StorePlan, resumed: dict[str, Any] | None = None) -> None:
        for client in p.clients:
            if not os.path.isdir(self._abs(client)):  # an SGLang target rank's client root (§3.6)
                os.makedirs(self._abs(client))
                self.journal.write({"t": "mc_dir", "store": p.store, "path": client}, sync=True)
            self._own_lock(client)
        for rw in p.rewrites:  # a displaced entry's retired key names this run (§3.5)
            for i, k in rw.keys.items():
                if not k:
                    rw.keys[i] = M.retired_key(rw.old_keys[i], self.run_id.replace("@", "_"))
        outputs = self._reshard_outputs(p)  # every source read and checked before anything is written
        if resumed is None:
            pairs = self._pairs(p, outputs)
            self.journal.write(to_intent(p, pairs, outputs["entries"]), sync=True)
        else:  # the interrupted run's pairs: the same ids, proven the same bytes
            pairs = self._resumed_pairs(resumed, outputs)
        self.crash("intent")
        for rw in p.rewrites:
            self._rewrite(rw)
        for client, path, data, displaced in outputs["entries"]:
            self._output_entry(client, path, data, displaced)
        for client, bucket_id, objects, _, _ in pairs:
            self._pair(client, bucket_id, objects)
        for e in p.entries:
            self._entry(e)
        for client in p.clients:
            MS.clear_stage(MS.stage_path(self._abs(client)))
        for path in self.own_locks:
            if os.path.exists(path):
                os.unlink(path)
        self.own_locks = []
        self.journal.write({"t": "mc_done", "store": p.store}, sync=True)

    def _reshard_outputs(self, p: StorePlan) -> dict[str, list[Any]]:
        """The values every reshard writes (§3.4), from sources re-read and checked against
        the scan: {"objects": [(client, key, value)] for new pairs, "entries": [(client,
        path, KVEntry bytes, displaced)] for KVEntries}."""
        from kvmigrate.transforms_mooncake import reshard_values

        out: dict[str, list[Any]] = {"objects": [], "entries": []}
        for work in p.reshards:
            values: dict[tuple[int, str], bytes] = {}
            for rank_half, src in work.sources.items():
                value = self._source_value(src)
                if value is None:
                    break
                values[rank_half] = value
            if len(values) != len(work.sources):
                first = min(work.sources.values(), key=lambda src: src.relpath)
                self._skip("changed_since_scan", len(work.outputs),
                           f"{first.relpath}: a source of its reshard changed since the scan")
                _keep_displaced(p, work)  # (no output: its sources keep their keys)
                continue
            geo = work.geometry
            by_half: dict[str, list[bytes]] = {}
            for half in sorted({h for _, h in work.sources}):
                by_half[half] = reshard_values([values[(r, half)] for r in range(work.n_s)], work.n_s, work.n_t,
                                               geo.heads, geo.head_dim, geo.elem_bytes)
            displaced = {src.relpath for src in work.displaced if src.index is None}
            for o in work.outputs:
                value = by_half[o.half][o.rank]
                if work.kventries:
                    path = f"{o.client}/{M.fpk(o.key, work.fsdir)}" if o.client else M.fpk(o.key, work.fsdir)
                    out["entries"].append((o.client, path, M.encode_kv_entry(M.KVEntry(o.key, value)),
                                           path in displaced))
                else:
                    out["objects"].append((o.client, o.key, value))
        return out

    def _source_value(self, src: SourceRef) -> bytes | None:
        """A reshard source's value as it is now, or None when it is not the scanned one."""
        try:
            if src.index is None:
                backup = os.path.join(self.root, BACKUP_DIR, self.run_id, src.relpath + ".orig")
                # (a displaced source an interrupted run replaced: its original is the backup)
                data = MS._read(backup if self.resuming and os.path.isfile(backup) else self._abs(src.relpath))
                if len(data) != src.size:  # (a KVEntry's row size is its file's)
                    return None
                value = M.decode_kv_entry(data).value
                if src.value is not None and xxhash.xxh3_128(value).digest() != src.value:
                    return None
                return value
            meta = M.decode_meta(MS._read(self._abs(src.relpath)))
            obj = meta.objects[src.index]
            bucket = self._abs(src.relpath)[: -len(M.META_SUFFIX)] + M.BUCKET_SUFFIX
            with open(bucket, "rb") as f:
                f.seek(obj.value_start)
                value = f.read(obj.data_size)
        except (OSError, OperationalError, M.DecodeError, IndexError):
            return None
        if len(value) != src.size or src.value is not None and xxhash.xxh3_128(value).digest() != src.value:
            return None
        return value

    def _resumed_pairs(self, intent: dict[str, Any], outputs: dict[str, list[Any]]
                       ) -> list[tuple[str, int, list, str, str]]:
        """The intended pairs with their objects recomputed; a pair whose bytes would differ
        from the intent's is left out (changed_since_scan), and a `.bucket` of the
        interrupted run left alone without its `.meta` is taken away before it is rewritten."""
        by_client: dict[str, list[tuple[bytes, bytes]]] = {}
        for client, key, value in outputs["objects"]:
            by_client.setdefault(client, []).append((key, value))
        out = []
        packed = {c: MS.pack_pairs(objs) for c, objs in by_client.items()}
        seen: dict[str, int] = {}
        for rec in intent.get("pairs", ()):
            client = rec["client"]
            k = seen.get(client, 0)
            seen[client] = k + 1
            objects = packed.get(client, [])[k] if k < len(packed.get(client, [])) else []
            same = False
            if objects:
                data, meta = M.build_bucket(objects)
                same = MS.xxh3_hex(data) == rec["bucket"] and MS.xxh3_hex(M.encode_meta(meta)) == rec["meta"]
            if not same:
                self._skip("changed_since_scan", len(objects), f"{client}: pair {rec['id']} would not be the bytes "
                           "the interrupted run intended")
                continue
            base = self._abs(client)
            bucket = os.path.join(base, f"{rec['id']}{M.BUCKET_SUFFIX}")
            meta_path = os.path.join(base, f"{rec['id']}{M.META_SUFFIX}")
            if MS._hash_or_none(meta_path) == rec["meta"]:
                self.outcomes["created"] += len(objects)  # committed before the interruption
                continue
            if not os.path.exists(meta_path) and MS._hash_or_none(bucket) == rec["bucket"]:
                os.unlink(bucket)  # ours, never committed: written again below
            out.append((client, rec["id"], objects, rec["bucket"], rec["meta"]))
        return out

    def _pairs(self, p: StorePlan, outputs: dict[str, list[Any]]) -> list[tuple[str, int, list, str, str]]:
        """The new pairs of the store's reshard outputs, per target client root: objects sorted
        by key, <= 500 a pair and 256 MiB, ids above every id at the top of the client root
        (§3.6): (client, id, objects, .bucket XXH3, .meta XXH3)."""
        by_client: dict[str, list[tuple[bytes, bytes]]] = {}
        for client, key, value in outputs["objects"]:
            by_client.setdefault(client, []).append((key, value))
        out = []
        for client, objs in sorted(by_client.items()):
            packed = MS.pack_pairs(objs)
            ids = MS.choose_bucket_ids(self._abs(client), len(packed))
            for bucket_id, objects in zip(ids, packed):
                data, meta = M.build_bucket(objects)
                out.append((client, bucket_id, objects, MS.xxh3_hex(data), MS.xxh3_hex(M.encode_meta(meta))))
        return out

    def _pair(self, client: str, bucket_id: int, objects: list[tuple[bytes, bytes]]) -> None:
        root = self._abs(client)
        try:
            made = MS.write_pair(root, bucket_id, objects, MS.stage_path(root), step=self.crash)
        except MS.PairConflict as exc:
            self._skip("conflict", len(objects), f"{client}: {exc}")
            return
        self.journal.write({"t": "mc_pair", "client": client, "id": made.id, "bucket": made.bucket_xxh3,
                            "meta": made.meta_xxh3, "keys": [k.hex() for k in made.keys]}, sync=True)
        self.crash("created")
        self.outcomes["created"] += len(objects)

    def _output_entry(self, client: str, path: str, data: bytes, displaced: bool) -> None:
        """A reshard output at fpk(key): a new KVEntry, or over the displaced source's file
        (its original kept as a backup)."""
        root = self._abs(client)
        target = self._abs(path)
        if self.resuming and MS._hash_or_none(target) == MS.xxh3_hex(data):
            self.outcomes["created"] += 1  # placed before the interruption
            return
        if displaced:
            backup = os.path.join(self.root, BACKUP_DIR, self.run_id, path + ".orig")
            os.makedirs(os.path.dirname(backup), exist_ok=True)
            old, new = MS.replace_kv_entry(target, data, backup, MS.stage_path(root), step=self.crash)
            self.journal.write({"t": "mc_replace", "path": path, "client": client, "old": old, "new": new,
                                "backup": os.path.relpath(backup, self.root)}, sync=True)
        else:
            entry = M.decode_kv_entry(data)
            dirs: list[str] = []
            fsdir = path.split("/")[-4]
            try:
                _, new = MS.place_kv_entry(os.path.join(root, fsdir), entry.key, entry.value, MS.stage_path(root),
                                           dirs, step=self.crash)
            except MS.EntryOccupied as exc:
                if exc.identical:
                    self.outcomes["already_present"] += 1
                else:
                    self._skip("conflict", 1, f"{path}: {exc}")
                return
            self.journal.write({"t": "mc_entry", "path": path, "source": "", "xxh3": new,
                                "dirs": [os.path.relpath(d, self.root) for d in dirs]}, sync=True)
        self.crash("created")
        self.outcomes["created"] += 1

    def _rewrite(self, rw: IndexRewrite) -> None:
        path = self._abs(rw.meta)
        n = len(rw.keys) - len(rw.retire)  # objects placed (a retired entry places none)
        try:
            data = MS._read(path)
        except OperationalError as exc:
            self._skip("failed", n, f"{rw.meta}: {exc}")
            return
        digest = MS.xxh3_hex(data)
        if self.done_index.get(rw.meta) == digest or self.resuming and self._rewritten(data, rw):
            self.outcomes["created"] += n  # an interrupted run of this journal rewrote it
            return
        try:
            st = os.lstat(path)
            meta = M.decode_meta(data)
        except (OSError, M.DecodeError) as exc:
            self._skip("changed_since_scan", n, f"{rw.meta}: {exc}")
            return
        if self._rewritten(data, rw):  # (a second apply of one manifest: the index holds its keys already)
            self.outcomes["already_present"] += n
            return
        if (st.st_ino, st.st_mtime_ns) != (rw.inode, rw.mtime_ns) or any(
                i >= len(meta.keys) or meta.keys[i] != old for i, old in rw.old_keys.items()):
            self._skip("changed_since_scan", n, f"{rw.meta}: the index changed since the scan")
            return
        bucket = path[: -len(M.META_SUFFIX)] + M.BUCKET_SUFFIX
        if not self._values_whole(bucket, meta, rw):
            self._skip("changed_since_scan", n, f"{rw.meta}: a value in its bucket changed since the scan")
            return
        backup = os.path.join(self.root, BACKUP_DIR, self.run_id, rw.meta + ".orig")
        os.makedirs(os.path.dirname(backup), exist_ok=True)
        try:
            old, new = MS.rewrite_index(self._abs(rw.client), os.path.basename(rw.meta), rw.keys, backup,
                                        MS.stage_path(self._abs(rw.client)), expect_xxh3=digest, step=self.crash)
        except MS.IndexRefused as exc:
            self._skip("skipped_needs_transform" if isinstance(exc, MS.IndexDoesNotRoundTrip) else "conflict", n,
                       f"{rw.meta}: {exc}")
            return
        except MS.StaleFile as exc:
            self._skip("changed_since_scan", n, f"{rw.meta}: {exc}")
            return
        self.journal.write({"t": "mc_index", "meta": rw.meta, "client": rw.client, "old": old, "new": new,
                            "backup": os.path.relpath(backup, self.root), "inode": st.st_ino, "size": st.st_size,
                            "mtime_ns": st.st_mtime_ns}, sync=True)
        self.crash("created")
        self.outcomes["created"] += n

    def _rewritten(self, data: bytes, rw: IndexRewrite) -> bool:
        """Whether an index already holds the rewrite's keys (an interrupted run renamed it
        in and was stopped before its record)."""
        try:
            keys = M.decode_meta(data).keys
        except M.DecodeError:
            return False
        return all(i < len(keys) and keys[i] == k for i, k in rw.keys.items())

    def _values_whole(self, bucket: str, meta: M.BucketMeta, rw: IndexRewrite) -> bool:
        """Every rekeyed value still in its bucket with the scanned bytes (a hash scan's
        XXH3-128), or at least within the file (a size scan)."""
        try:
            fd = os.open(bucket, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            size = os.fstat(fd).st_size
            for i in rw.keys:
                obj = meta.objects[i]
                if obj.end > size:
                    return False
                want = rw.values.get(i)
                if want is not None:
                    h = xxhash.xxh3_128()
                    pos = obj.value_start
                    while pos < obj.end:
                        b = os.pread(fd, min(1 << 20, obj.end - pos), pos)
                        if not b:
                            return False
                        h.update(b)
                        pos += len(b)
                    if h.digest() != want:
                        return False
        finally:
            os.close(fd)
        return True

    def _entry(self, e: EntryWrite) -> None:
        target = self._abs(e.path)
        if e.path in self.done_entry and MS._hash_or_none(target) == self.done_entry[e.path]:
            self.outcomes["created"] += 1
            return
        entry = self._source_entry(e)
        if entry is None:
            return
        if e.action == "link" and entry.key != e.key:
            self._skip("changed_since_scan", 1, f"{e.source}: its key is not the one the scan read")
            return
        client = self._abs(e.client)
        fsdir = e.path.split("/")[-4]
        dirs: list[str] = []
        try:
            path, digest = MS.place_kv_entry(os.path.join(client, fsdir), e.key, entry.value,
                                             MS.stage_path(client), dirs, step=self.crash)
        except MS.EntryOccupied as exc:
            if exc.identical:
                self.outcomes["already_present"] += 1
            else:
                self._skip("conflict", 1, f"{e.path}: {exc}")
            return
        self.journal.write({"t": "mc_entry", "path": e.path, "source": e.source, "xxh3": digest,
                            "dirs": [os.path.relpath(d, self.root) for d in dirs]}, sync=True)
        self.crash("created")
        self.outcomes["created"] += 1

    def _source_entry(self, e: EntryWrite) -> M.KVEntry | None:
        """The source KVEntry of a rekey or link as the scan read it (its stat, its value's
        hash), or None with the outcome changed_since_scan."""
        try:
            st = os.lstat(self._abs(e.source))
            entry = M.decode_kv_entry(MS._read(self._abs(e.source)))
        except (OSError, OperationalError, M.DecodeError) as exc:
            self._skip("changed_since_scan", 1, f"{e.source}: {exc}")
            return None
        if (st.st_size, st.st_mtime_ns) != (e.size, e.mtime_ns) or (
                e.value is not None and xxhash.xxh3_128(entry.value).digest() != e.value):
            self._skip("changed_since_scan", 1, f"{e.source}: the entry changed since the scan")
            return None
        return entry

    def _skip(self, outcome: str, n: int, why: str) -> None:
        self.outcomes[outcome] += n
        self.skipped.append(f"{outcome}: {why}")


class DestStoreApplier(StoreApplier):
    """A migration of stores into another folder DIR (§3.6): DIR/<client root> then holds
    exactly what the target reads. A pair all of whose entries are reusable is placed whole
    (its `.bucket` linked, or copied with --mode copy or across filesystems; its `.meta` with
    the target keys written), other reusable objects and reshard outputs go into new pairs,
    KVEntries are linked (their key unchanged) or written. Nothing under ROOT is written but
    the journal, so no proof that the clients are stopped is needed. Every file made in DIR
    is journaled (`mc_file`, `mc_pair`, `mc_dir` with `base: dest`) for rollback and verify."""

    def __init__(self, root: str, dest: str, plans: list[StorePlan], journal: Any, run_id: str,
                 crash: Callable[[str], None], mode: str = "link"):
        super().__init__(root, plans, journal, run_id, crash)
        self.dest = dest
        self.mode = mode

    def take_proofs(self) -> None:
        """None needed: the store under ROOT is only read."""

    def apply(self) -> None:
        for p in self.plans:
            self._dest_store(p)

    def _d(self, relpath: str) -> str:
        return os.path.join(self.dest, relpath) if relpath else self.dest

    def _dirs(self, store: str, path: str) -> None:
        """The folders of `path` under DIR, each made journaled."""
        rel = os.path.relpath(path, self.dest)
        parts = [] if rel == "." else rel.split(os.sep)
        cur = self.dest
        for part in parts:
            cur = os.path.join(cur, part)
            if not os.path.isdir(cur):
                os.mkdir(cur)
                self.journal.write({"t": "mc_dir", "store": store, "path": os.path.relpath(cur, self.dest),
                                    "base": "dest"}, sync=True)

    def _put(self, store: str, relpath: str, data: bytes | None = None, source: str | None = None) -> bool:
        """A file at DIR/relpath: `data` written, or `source` linked (copied with --mode copy
        or across filesystems); never over another file (the same bytes there: done).
        Returns whether it is there with the bytes it must hold."""
        final = self._d(relpath)
        self._dirs(store, os.path.dirname(final))
        want = MS.xxh3_hex(data) if data is not None else MS._hash_or_none(self._abs(source or ""))
        if os.path.lexists(final):
            return MS._hash_or_none(final) == want
        stage = MS.stage_path(os.path.dirname(final))
        if data is None and self.mode != "copy":
            try:
                os.link(self._abs(source or ""), final, follow_symlinks=False)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise write_error(exc, "cannot link into the destination", final) from None
                data = MS._read(self._abs(source or ""))
        if data is None and not os.path.exists(final):
            data = MS._read(self._abs(source or ""))
        if data is not None and not os.path.exists(final):
            MS._ensure_stage(stage)
            tmp = MS.temp_path(stage, os.path.basename(final))
            MS._write_temp(tmp, data)
            try:
                os.link(tmp, final, follow_symlinks=False)
            finally:
                MS._unlink_quiet(tmp)
            MS.clear_stage(stage)
        MS._fsync_dir(os.path.dirname(final))
        self.journal.write({"t": "mc_file", "store": store, "path": relpath, "xxh3": want, "base": "dest"}, sync=True)
        self.crash("created")
        return True

    def _dest_store(self, p: StorePlan) -> None:
        outputs = self._reshard_outputs(p)
        self.journal.write({**to_intent(p, [], outputs["entries"]), "dest": True}, sync=True)
        self.crash("intent")
        new_objects: dict[str, list[tuple[bytes, bytes]]] = {}
        for rw in p.rewrites:
            self._dest_index(p.store, rw, new_objects)
        for e in p.entries:
            self._dest_entry(p.store, e)
        for _client, path, data, _ in outputs["entries"]:
            if self._put(p.store, path, data=data):
                self.outcomes["created"] += 1
            else:
                self._skip("conflict", 1, f"{self._d(path)}: another file is there")
        for client, key, value in outputs["objects"]:
            new_objects.setdefault(client, []).append((key, value))
        for client, objs in sorted(new_objects.items()):
            base = self._d(client)
            self._dirs(p.store, base)
            packed = MS.pack_pairs(objs)
            for bucket_id, objects in zip(MS.choose_bucket_ids(base, len(packed)), packed):
                made = MS.write_pair(base, bucket_id, objects, MS.stage_path(base), step=self.crash)
                self.journal.write({"t": "mc_pair", "store": p.store, "client": client, "id": made.id,
                                    "bucket": made.bucket_xxh3, "meta": made.meta_xxh3, "base": "dest",
                                    "keys": [k.hex() for k in made.keys]}, sync=True)
                self.outcomes["created"] += len(objects)
            MS.clear_stage(MS.stage_path(base))
        self.journal.write({"t": "mc_done", "store": p.store}, sync=True)

    def _dest_index(self, store: str, rw: IndexRewrite, new_objects: dict[str, list[tuple[bytes, bytes]]]) -> None:
        """A live pair's reusable entries into DIR: the pair whole when every entry is, else
        each value into a new pair there."""
        n = len(rw.keys) - len(rw.retire)
        try:
            data = MS._read(self._abs(rw.meta))
            st = os.lstat(self._abs(rw.meta))
            meta = M.decode_meta(data)
        except (OSError, OperationalError, M.DecodeError) as exc:
            self._skip("changed_since_scan", n, f"{rw.meta}: {exc}")
            return
        bucket = rw.meta[: -len(M.META_SUFFIX)] + M.BUCKET_SUFFIX
        if (st.st_ino, st.st_mtime_ns) != (rw.inode, rw.mtime_ns) or not self._values_whole(
                self._abs(bucket), meta, rw):
            self._skip("changed_since_scan", n, f"{rw.meta}: the pair changed since the scan")
            return
        keys = {i: k for i, k in rw.keys.items() if i not in rw.retire}
        if len(keys) == len(meta.keys) and M.encode_meta(meta) == data:  # every entry reusable: the pair whole
            new_meta = M.encode_meta(M.BucketMeta(meta.data_size, tuple(keys[i] for i in range(len(meta.keys))),
                                                  meta.objects))
            if self._put(store, bucket, source=bucket) and self._put(store, rw.meta, data=new_meta):
                self.outcomes["created"] += n
            else:
                self._skip("conflict", n, f"{self._d(rw.meta)}: another pair has its id there")
            return
        with open(self._abs(bucket), "rb") as f:
            for i, key in sorted(keys.items()):
                obj = meta.objects[i]
                f.seek(obj.value_start)
                new_objects.setdefault(rw.client, []).append((key, f.read(obj.data_size)))

    def _dest_entry(self, store: str, e: EntryWrite) -> None:
        entry = self._source_entry(e)
        if entry is None:
            return
        ok = (self._put(store, e.path, source=e.source) if entry.key == e.key else
              self._put(store, e.path, data=M.encode_kv_entry(M.KVEntry(e.key, entry.value))))
        if ok:
            self.outcomes["created"] += 1
        else:
            self._skip("conflict", 1, f"{self._d(e.path)}: another file is there")


# --- rollback and verify ---------------------------------------------------------------------------

def run_records(run: Any) -> list[dict[str, Any]]:
    return list(getattr(run, "store_records", ()) or ())


def rollback_run(run: Any, dry_run: bool, engine_stopped: bool = False) -> tuple[Counter, list[str]]:
    """Undo the store work of one journaled run (§5.3): new KVEntries removed (each only
    with its journaled XXH3), each rewritten index's original renamed back (only while it
    holds the journaled new bytes), created folders, the stage and kvmigrate's locks
    removed. Returns (what was done by kind, what was kept and why)."""
    recs = run_records(run)
    done: Counter = Counter()
    kept: list[str] = []
    if not recs:
        return done, kept
    root = run.root
    proofs = [r for r in recs if r["t"] == "mc_store"]
    locks: list[MS.ClientLock] = []
    try:
        if not dry_run:  # each client root once (a resumed run journals its proofs again: a second
            # flock of one file from this process would read as a live client)
            for client in sorted({r["client"] for r in proofs}):
                locks.append(MS.hold_client_lock(os.path.join(root, client) if client else root))
        gone: set[str] = set()  # (a dry run: what the removals would take, so folders are counted alike)
        indexes = {r["meta"]: r for r in recs if r["t"] == "mc_index"}
        indexes.update({r["path"]: {**r, "meta": r["path"]} for r in recs if r["t"] == "mc_replace"})
        entries = {r["path"]: r for r in recs if r["t"] == "mc_entry"}
        # (an intent of a migration into DIR names paths under DIR: never reconciled against ROOT,
        # where an entry read in place has the very same relpath)
        intents = [r for r in recs if r["t"] == "mc_intent" and not r.get("dest")]
        # new pairs first (.meta, then .bucket, each only with the bytes the run wrote): journaled or
        # intended (a pair a killed run linked before its record)
        # what a migration into DIR made there (`base: dest`): its files, newest first (a pair's .meta
        # before its .bucket)
        for r in reversed([r for r in recs if r["t"] == "mc_file"]):
            path = os.path.join(run.dest, check_relpath(r["path"], "journal path"))
            if dry_run:
                if MS._hash_or_none(path) == r["xxh3"]:
                    done["kventry"] += 1
                    gone.add(path)
                continue
            what = MS.remove_kv_entry(path, r["xxh3"])
            done["kventry"] += what == "removed"
            if what == "kept":
                kept.append(f"{path}: changed since the migration made it; left in place")
        pairs = {(r["client"], r["id"], r.get("base")): r for it in intents for r in it.get("pairs", ())}
        pairs.update({(r["client"], r["id"], r.get("base")): r for r in recs if r["t"] == "mc_pair"})
        for (client, bucket_id, where), r in sorted(pairs.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            top = run.dest if where == "dest" else root
            base = os.path.join(top, client) if client else top
            if dry_run:
                done["pair"] += int(MS._hash_or_none(os.path.join(base, f"{bucket_id}{M.META_SUFFIX}")) == r["meta"])
                continue
            got = MS.remove_pair(base, bucket_id, r["meta"], r["bucket"])
            done["pair"] += int(got.get("meta") == "removed")
            if "kept" in got.values():
                kept.append(f"{base}/{bucket_id}{M.META_SUFFIX}: changed since the migration wrote the pair; left")
        for it in intents:  # reshard outputs over a displaced KVEntry a killed run did not journal
            for o in it.get("outputs", ()):
                if o["path"] not in entries and o["path"] not in indexes:
                    backup = os.path.join(BACKUP_DIR, run.header.get("run_id", ""), o["path"] + ".orig")
                    if _still_original(os.path.join(root, o["path"]), os.path.join(root, backup)):
                        continue  # killed between the backup link and the rename: nothing to put back
                    if os.path.exists(os.path.join(root, backup)):
                        indexes[o["path"]] = {"meta": o["path"], "client": o.get("client", ""), "new": o["xxh3"],
                                              "backup": backup}
                    elif MS._hash_or_none(os.path.join(root, o["path"])) == o["xxh3"]:
                        entries[o["path"]] = {"path": o["path"], "xxh3": o["xxh3"], "dirs": []}
        # work an interrupted run did but did not journal: proven by its bytes
        for it in intents:
            for rw in it.get("rewrites", ()):
                if rw["meta"] in indexes:
                    continue
                found = _unjournaled_rewrite(root, run, rw)
                if found is not None:
                    indexes[rw["meta"]] = found
            for e in it.get("entries", ()):
                if e["path"] in entries:
                    continue
                found = _unjournaled_entry(root, e)
                if found is not None:
                    entries[e["path"]] = found
        dirs: list[str] = []
        for path, r in sorted(entries.items(), reverse=True):
            check_relpath(path, "journal path")
            dirs += r.get("dirs") or []
            if dry_run:
                if MS._hash_or_none(os.path.join(root, path)) == r["xxh3"]:
                    done["kventry"] += 1
                    gone.add(os.path.join(root, path))
                continue
            what = MS.remove_kv_entry(os.path.join(root, path), r["xxh3"])
            if what == "removed":
                done["kventry"] += 1
            elif what == "kept":
                kept.append(f"{os.path.join(root, path)}: changed since the migration placed it; left in place")
        for meta, r in sorted(indexes.items()):
            check_relpath(meta, "journal path")
            path, backup = os.path.join(root, meta), os.path.join(root, r["backup"])
            if dry_run:
                done["index"] += int(MS._hash_or_none(path) == r["new"] and os.path.exists(backup))
                continue
            client = os.path.join(root, r["client"]) if r.get("client") else root
            back = MS.restore_index(path, backup, r["new"], MS.stage_path(client))
            if back == "restored":
                done["index"] += 1
            elif back == "kept":
                kept.append(f"{path}: changed since the migration rewrote it; left in place (its original is "
                            f"{backup})")
        dirs += [r["path"] for r in recs if r["t"] == "mc_dir" and r.get("base") != "dest"]
        dest_dirs = [r["path"] for r in recs if r["t"] == "mc_dir" and r.get("base") == "dest"]
        clients = {r.get("client", "") for it in intents for r in
                   [*it.get("rewrites", ()), *it.get("entries", ()), *it.get("pairs", ()), *it.get("outputs", ())]}
        for client in sorted(clients | {r["path"] for r in recs if r["t"] == "mc_dir" and r.get("base") != "dest"}):
            base = os.path.join(root, client) if client else root
            own = os.path.join(base, OWN_LOCK)
            if os.path.exists(own):
                done["lock"] += 1
                gone.add(own)
                if not dry_run:
                    os.unlink(own)
            stage = MS.stage_path(base)
            if dry_run:
                if os.path.isdir(stage):
                    gone.add(stage)
            else:
                MS.clear_stage(stage)
        for d, top in sorted({*((d, root) for d in dirs), *((d, run.dest) for d in dest_dirs)},
                             key=lambda x: -x[0].count("/")):  # (a folder it made, once empty)
            path = os.path.join(top, d)
            if dry_run:
                try:
                    left = [os.path.join(path, n) for n in os.listdir(path)]
                except OSError:
                    continue
                if all(p in gone for p in left):
                    done["dir"] += 1
                    gone.add(path)
                continue
            try:
                os.rmdir(path)
                done["dir"] += 1
            except OSError:
                pass
    finally:
        for lock in locks:
            lock.release()
    return done, kept


def _still_original(path: str, backup: str) -> bool:
    """The file is the very inode its backup links (the replacement never happened)."""
    try:
        return os.path.samestat(os.lstat(path), os.lstat(backup))
    except OSError:
        return False


def _unjournaled_rewrite(root: str, run: Any, rw: dict[str, Any]) -> dict[str, Any] | None:
    """An index a killed run rewrote before journaling it: its backup is there and the
    index is exactly the backup with the intent's keys."""
    backup = os.path.join(root, BACKUP_DIR, run.header.get("run_id", ""), rw["meta"] + ".orig")
    path = os.path.join(root, rw["meta"])
    try:
        orig = M.decode_meta(MS._read(backup))
        now = MS._read(path)
    except (OperationalError, M.DecodeError, OSError):
        return None
    keys = list(orig.keys)
    for i, k in rw["keys"].items():
        if int(i) < len(keys):
            keys[int(i)] = bytes.fromhex(k)
    expected = M.encode_meta(M.BucketMeta(orig.data_size, tuple(keys), orig.objects))
    if now != expected:
        return None
    return {"meta": rw["meta"], "client": rw.get("client", ""), "new": MS.xxh3_hex(now),
            "backup": os.path.relpath(backup, root)}


def _unjournaled_entry(root: str, e: dict[str, Any]) -> dict[str, Any] | None:
    """A KVEntry a killed run placed before journaling it: the entry of the intent's key
    with the source's value."""
    try:
        placed = MS._read(os.path.join(root, e["path"]))
        source = M.decode_kv_entry(MS._read(os.path.join(root, e["source"])))
    except (OperationalError, M.DecodeError, OSError):
        return None
    if placed != M.encode_kv_entry(M.KVEntry(bytes.fromhex(e["key"]), source.value)):
        return None
    return {"path": e["path"], "xxh3": MS.xxh3_hex(placed), "dirs": []}


def verify_run(run: Any) -> tuple[int, list[tuple[str, str]]]:
    """(files checked, (finding kind, message) for each store file of a run that is not
    what it made, §5.3): a rewritten index or placed KVEntry whose bytes differ from the
    journaled ones, or that no starting client would read (its `.bucket` gone, an entry
    away from fpk of its key)."""
    out: list[tuple[str, str]] = []
    root = run.root
    checked = 0
    for r in run_records(run):
        checked += r["t"] in ("mc_index", "mc_entry", "mc_pair", "mc_replace", "mc_file")
        if r["t"] == "mc_index":
            path = os.path.join(root, r["meta"])
            got = MS._hash_or_none(path)
            if got is None:
                out.append(("missing", f"{path}: the index the migration rewrote is gone (evicted or removed)"))
            elif got != r["new"]:
                out.append(("changed", f"{path}: not the index the migration wrote"))
            elif not os.path.isfile(path[: -len(M.META_SUFFIX)] + M.BUCKET_SUFFIX):
                out.append(("missing", f"{path}: its .bucket is gone: the next client start deletes the index"))
        elif r["t"] == "mc_file":
            path = os.path.join(run.dest, r["path"])
            got = MS._hash_or_none(path)
            if got is None:
                out.append(("missing", f"{path}: the file the migration made is gone (evicted or removed)"))
            elif got != r["xxh3"]:
                out.append(("changed", f"{path}: not the file the migration made"))
        elif r["t"] == "mc_pair":
            top = run.dest if r.get("base") == "dest" else root
            base = os.path.join(top, r["client"]) if r["client"] else top
            for suffix, want in ((M.META_SUFFIX, r["meta"]), (M.BUCKET_SUFFIX, r["bucket"])):
                path = os.path.join(base, f"{r['id']}{suffix}")
                got = MS._hash_or_none(path)
                if got is None:
                    out.append(("missing", f"{path}: the pair the migration wrote is gone (evicted or removed)"))
                    break
                if got != want:
                    out.append(("changed", f"{path}: not the pair the migration wrote"))
        elif r["t"] in ("mc_entry", "mc_replace"):
            r = {**r, "xxh3": r.get("xxh3") or r.get("new")}
            path = os.path.join(root, r["path"])
            got = MS._hash_or_none(path)
            if got is None:
                out.append(("missing", f"{path}: the KVEntry the migration placed is gone"))
            elif got != r["xxh3"]:
                out.append(("changed", f"{path}: not the KVEntry the migration placed"))
            else:
                entry = M.decode_kv_entry(MS._read(path))
                fsdir = r["path"].split("/")[-4]
                if not r["path"].endswith(M.fpk(entry.key, fsdir)):
                    out.append(("misplaced", f"{path}: not at fpk of its key: no read finds it"))
    return checked, out

