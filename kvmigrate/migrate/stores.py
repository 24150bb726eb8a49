"""Migrating Mooncake stores (spec mooncake.md §3.3 - §3.6, §5): the planned work of the
scan's store rows. A Mooncake store is not a namespace of block files: a rekeyed bucket
object stays in its pair (only its key in the `.meta` index changes), a file-per-key entry
is a KVEntry at `fpk(key)`, a reshard writes new pairs or KVEntries. So a store's work is
planned here per store (`StorePlan`, from the manifest's rows), beside the tree and flat
targets of the plan, and applied by migrate/store_apply.py in the same journal; its undo
and its checks are migrate/store_undo.py.

Journal records (`mc_*`), in the order a run writes them per store:

    mc_store    a proof: the client root whose 0.3.14 flock the run holds, how it is proven
    mc_dir      a folder the run made (an SGLang target rank's client root; in DIR)
    mc_intent   fsynced before anything of the store is written: the whole StorePlan
                (`intent_parts`): rewrites, entries, reshards, pairs with ids and hashes,
                outputs; in journal format 3 a head, then its arrays in `mc_part` records
    mc_index    an index rewritten (rekeys and retires): original and new XXH3, its backup
    mc_replace  a displaced KVEntry replaced by a reshard output: old and new XXH3, backup
    mc_pair     a new pair committed: client root, id, both files' XXH3, its keys
    mc_entry    a KVEntry placed: path, XXH3, the folders made for it
    mc_file     a file made in DIR by a migration into another folder (`base: dest`)
    mc_done     the store's work finished (stage and own locks removed)
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvmigrate import families, layout
from kvmigrate import manifest as mf
from kvmigrate.errors import UsageError
from kvmigrate.formats import mooncake as M
from kvmigrate.migrate import mooncake_store as MS
from kvmigrate.migrate.fsops import check_relpath
from kvmigrate.migrate.journal import INTENT_ARRAYS
from kvmigrate.migrate.reshard_spill import Spill
from kvmigrate.migrate.reshard_spill import sort as _sort

_BATCH_ROWS = 4096  # manifest rows held as Python values at once while planning
OWN_LOCK = ".kvmigrate.lock"  # kvmigrate's lock in each client root it writes (holder pid inside)
BACKUP_DIR = os.path.join(layout.OWN_DIR, "mooncake")  # ROOT/.kvmigrate/mooncake/<run>/<relpath>.orig
STORE_ACTIONS = ("rekey", "link", "reshard")  # what this release applies of a store's rows
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
    reshards: Spill = field(default_factory=Spill)  # ReshardWork of each block, on disk
    bucket_clients: list[str] = field(default_factory=list)  # client roots whose index a rewrite changes
    clients: list[str] = field(default_factory=list)  # every client root written
    flock_stated: bool = False  # writer_release >= 0.3.14 stated: the client lock is the proof
    stopped_stated: bool = False  # engine_stopped stated for the store
    objects: Counter = field(default_factory=Counter)  # action -> objects
    # the index entries reshards displace, on disk: (place of the rewrite in `rewrites`, order
    # displaced, entry, its key as scanned); `rewrites` holds the rekeys, `whole_rewrites` both
    retired: Spill = field(default_factory=Spill)
    kept: set[tuple[str, int]] = field(default_factory=set)  # (`.meta`, entry) of reshards that will not run

    def whole_rewrites(self, run_id: str | None = None) -> Iterator[IndexRewrite]:
        """Each index rewrite with the entries reshards retire in it, in the plan's order,
        one at a time (a store's retired entries are not held: two a block); a rewrite left
        with no entry (its reshards will not run: `kept`) is left out. `run_id`: the retired
        keys name the run (§3.5), else they are b"" until it is known."""
        retired = _sort(self.retired, key=lambda r: (r[0], r[1]))
        nxt = next(retired, None)
        for place, rw in enumerate(self.rewrites):
            whole = IndexRewrite(rw.meta, rw.client, dict(rw.keys), dict(rw.old_keys), dict(rw.values), set(rw.retire),
                                 rw.inode, rw.mtime_ns)
            while nxt is not None and nxt[0] == place:
                _, _, index, old = nxt
                if (rw.meta, index) not in self.kept:
                    whole.keys[index] = M.retired_key(old, run_id.replace("@", "_")) if run_id is not None else b""
                    whole.retire.add(index)
                    whole.old_keys[index] = old
                    whole.values[index] = None
                nxt = next(retired, None)
            if whole.keys:
                yield whole

    @property
    def proof(self) -> str | None:
        """How the apply proves no client runs (§5.1): `flock` (every client root written is
        a bucket one with >= 0.3.14 stated), `engine_stopped`, or None (no proof)."""
        if self.stopped_stated:
            return "engine_stopped"
        if self.flock_stated and set(self.clients) <= set(self.bucket_clients):
            return "flock"
        return None


_ENCODE = json.JSONEncoder(separators=(",", ":")).encode  # (the journal's encoder: the same text)


PART_BYTES = 1 << 18  # a part record's text, about: an item may be large (a bucket's rewrite names its every key)


def intent_parts(p: StorePlan, rewrites: Iterable[IndexRewrite], pairs: Iterable[tuple[str, int, list, str, str]],
                 entries: Iterable[tuple], *, dest: bool = False, split: bool = True) -> Iterator[str]:
    """The store's whole plan as its journal intent: everything a resumed run needs to do
    exactly the same (§5.3), and a rollback to prove what is the run's. Its JSON text in
    parts, an element at a time (journal `write_parts`): a plan's reshards, pairs and
    outputs are read from disk as it is written, never held as one record.

    `split` (journal format 3): the intent is a head line and `mc_part` lines of about
    PART_BYTES of one array each, all in the intent's frame, so that a reader takes the
    intent a part at a time (journal `split_intent` reads both forms). Format 2 wrote one
    line."""
    arrays = (
        ("rewrites", ({"meta": rw.meta, "client": rw.client, "inode": rw.inode, "mtime_ns": rw.mtime_ns,
                       "keys": {str(i): k.hex() for i, k in rw.keys.items()},  # (its stat proves the rest)
                       "retire": sorted(rw.retire)} for rw in rewrites)),
        ("entries", ({"source": e.source, "path": e.path, "key": e.key.hex(), "action": e.action,
                      "client": e.client, "size": e.size, "mtime_ns": e.mtime_ns,
                      "value": e.value.hex() if e.value else None} for e in p.entries)),
        ("reshards", ({"n_s": w.n_s, "n_t": w.n_t, "geometry": [w.geometry.heads, w.geometry.head_dim,
                                                                w.geometry.elem_bytes],
                       "kventries": w.kventries, "fsdir": w.fsdir,
                       "sources": [{"rank": r, "half": h, "relpath": src.relpath, "index": src.index,
                                    "key": src.key.hex(), "client": src.client, "size": src.size,
                                    "value": src.value.hex() if src.value else None}
                                   for (r, h), src in sorted(w.sources.items())],
                       "outputs": [{"rank": o.rank, "half": o.half, "engine_key": o.engine_key,
                                    "key": o.key.hex(), "client": o.client} for o in w.outputs],
                       "displaced": [src.relpath + ("" if src.index is None else f"[{src.index}]")
                                     for src in w.displaced]} for w in p.reshards)),
        ("pairs", ({"client": c, "id": i, "bucket": b, "meta": m} for c, i, _, b, m in pairs)),
        ("outputs", ({"path": path, "xxh3": MS.xxh3_hex(data), "client": c} for c, path, data, _ in entries)),
    )
    assert tuple(name for name, _ in arrays) == INTENT_ARRAYS
    head = '{"t":"mc_intent","store":' + _ENCODE(p.store) + ',"proof":' + _ENCODE(p.proof)
    tail = ',"clients":' + _ENCODE(p.clients) + ',"bucket_clients":' + _ENCODE(p.bucket_clients) + \
        (',"dest":true' if dest else "")
    if not split:
        yield head
        for name, items in arrays:
            yield from _array(name, items)
        yield tail + "}"
        return
    yield head + tail + ',"parts":true}'
    for name, items in arrays:
        yield from _parts(name, items)


def _array(name: str, items: Iterable[Any]) -> Iterator[str]:
    """`,"name":[...]`, an item at a time."""
    yield f',"{name}":['
    for n, item in enumerate(items):
        yield ("," if n else "") + _ENCODE(item)
    yield "]"


def _parts(name: str, items: Iterable[Any]) -> Iterator[str]:
    """The `mc_part` lines of one array, a line once its text passes PART_BYTES, an item
    at a time."""
    held = -1  # bytes of the line so far (-1: no line open)
    for item in items:
        text = _ENCODE(item)
        if held < 0 or held >= PART_BYTES:
            yield ("]}" if held >= 0 else "") + '\n{"t":"mc_part","of":"' + name + '","items":[' + text
            held = len(text)
        else:
            yield "," + text
            held += len(text) + 1
    if held >= 0:
        yield "]}"


def from_intent(head: dict[str, Any], parts: Iterable[dict[str, Any]] = ()) -> StorePlan:
    """A StorePlan rebuilt from its journal intent (a resumed run does exactly that): its
    head and its `mc_part` records (journal `split_intent`), read a part at a time (the
    reshards go to the plan's spill; the pairs and outputs are read where they are used)."""
    from kvmigrate.families import mooncake_reshard as R

    p = StorePlan(head["store"], clients=list(head.get("clients") or ()),
                  bucket_clients=list(head.get("bucket_clients") or ()))
    p.stopped_stated = head.get("proof") == "engine_stopped"
    p.flock_stated = head.get("proof") == "flock"
    outputs = -1  # (the reshards' outputs; -1: no reshard)
    for part in parts:
        if part["of"] == "rewrites":
            for r in part["items"]:
                rw = IndexRewrite(r["meta"], r["client"], inode=r.get("inode", 0), mtime_ns=r.get("mtime_ns", 0))
                rw.keys = {int(i): bytes.fromhex(k) for i, k in r["keys"].items()}
                rw.retire = set(r.get("retire") or ())
                rw.values = {i: None for i in rw.keys}
                p.rewrites.append(rw)
        elif part["of"] == "entries":
            for e in part["items"]:
                p.entries.append(EntryWrite(e["source"], e["path"], bytes.fromhex(e["key"]), e["action"], e["client"],
                                            e.get("size", 0), e.get("mtime_ns", 0),
                                            bytes.fromhex(e["value"]) if e.get("value") else None))
        elif part["of"] == "reshards":
            for w in part["items"]:
                sources = {(s["rank"], s["half"]): SourceRef(s["relpath"], s["index"], bytes.fromhex(s["key"]),
                                                              s["client"], s["size"],
                                                              bytes.fromhex(s["value"]) if s["value"] else None)
                           for s in w["sources"]}
                outs = [R.Output(o["rank"], o["half"], o["engine_key"], bytes.fromhex(o["key"]), o["client"], 0)
                        for o in w["outputs"]]
                named = set(w.get("displaced") or ())
                displaced = [src for src in sources.values()
                             if src.relpath + ("" if src.index is None else f"[{src.index}]") in named]
                p.reshards.append(ReshardWork(w["n_s"], w["n_t"], R.Geometry(*w["geometry"]), sources, outs,
                                              displaced, w["kventries"], w.get("fsdir") or M.DEFAULT_FSDIR))
                outputs = max(outputs, 0) + len(outs)
    for e in p.entries:  # (counted in this order: the plan's lines name them so)
        p.objects[e.action] += 1
    for rw in p.rewrites:
        p.objects["rekey"] += len(rw.keys) - len(rw.retire)
    if outputs >= 0:
        p.objects["reshard"] += outputs
    return p


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
    # a reshard's candidate sources and its primary rows, on disk (reshard_spill), each to be
    # sorted by block: a block's rows are far apart in the manifest (a pair holds a key rank)
    candidates = Spill()  # (block order, row, key rank, half, status, SourceRef, key it is registered at)
    primaries = Spill()  # (block order, row, store, target key of key rank 0)
    first_stat: dict[str, tuple[int, int]] = {}  # an index's stat (inode, mtime_ns), from its first object row
    place: dict[str, int] = {}  # `.meta` -> its rewrite's place in its plan's `rewrites`
    for batch in mf.iter_batches(manifest_path, columns=_COLUMNS, batch_size=_BATCH_ROWS):
        cols = batch.to_pydict()
        for i, action in enumerate(cols["action"]):
            if cols["source_base"][i] not in store_of:
                continue
            base = cols["source_base"][i]
            store = str(store_of[base])
            if resharding and cols["object_key"][i] is not None:
                if cols["object_index"][i] is not None:
                    first_stat.setdefault(cols["relpath"][i], (cols["inode"][i] or 0, cols["mtime_ns"][i] or 0))
                cand = _candidate(cols, i, len(candidates))
                if cand is not None:
                    candidates.append(cand)
            if action == "reshard":
                primaries.append((_block_order(base, cols["group"][i], cols["block_hash"][i]), len(primaries),
                                  store, cols["target_key"][i]))
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
            client = target[:-1] if target.endswith("/") else _client_of_object(target, None)
            if index is not None:  # an entry of a live index: rewritten in place
                rw = rewrites.get(relpath)
                if rw is None:
                    rw = rewrites[relpath] = IndexRewrite(relpath, client, inode=cols["inode"][i] or 0,
                                                          mtime_ns=cols["mtime_ns"][i] or 0)
                    place[relpath] = len(plan.rewrites)
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
    works = _sort(_block_works(candidates, primaries, namespaces), key=lambda w: w[0])
    for _, store, work in works:  # (in the primaries' row order: the plan's order, as the scan met them)
        plan = plans[store]
        plan.reshards.append(work)
        for out in work.outputs:
            if out.client not in plan.clients:
                plan.clients.append(out.client)
        for src in work.displaced:  # a bucket entry holding a target key: retired (its key rewritten)
            if src.index is not None:
                rw = rewrites.get(src.relpath)
                if rw is None:
                    inode, mtime_ns = first_stat[src.relpath]  # (its index's stat)
                    rw = rewrites[src.relpath] = IndexRewrite(src.relpath, src.client, inode=inode,
                                                              mtime_ns=mtime_ns)
                    place[src.relpath] = len(plan.rewrites)
                    plan.rewrites.append(rw)
                    if src.client not in plan.bucket_clients:
                        plan.bucket_clients.append(src.client)
                plan.retired.append((place[src.relpath], len(plan.retired), src.index, src.key))  # (whole_rewrites)
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
        plan.flock_stated = M.lock_proves([f.get("writer_release") for f in facts])
    return plan


def _block_order(base: str, group: int | None, block: bytes | None) -> tuple:
    """A block's place in the sort that brings its rows together (None before any value)."""
    return (base, group is not None, group or 0, block is not None, block or b"")


def _candidate(cols: dict[str, list[Any]], i: int, row: int) -> tuple | None:
    """An object row that may be a source of its block's reshard (a usable status, a key of
    an engine's grammar), with the scoped key a starting client registers it at (None: an
    entry away from fpk of its key registers nothing)."""
    from kvmigrate.families import mooncake as fam
    from kvmigrate.families import mooncake_reshard as R

    relpath, index, key, status = cols["relpath"][i], cols["object_index"][i], cols["object_key"][i], cols["status"][i]
    if status not in R.SOURCE_STATUSES:
        return None
    sk = M.parse_storage_key(key)
    ek = fam.key_rank(sk.engine)
    if ek is None:
        return None
    ref = SourceRef(relpath, index, key, _client_of_object(relpath, index), cols["size"][i] or 0,
                    cols["payload_xxh3_128"][i])
    registered = None
    if index is not None or relpath.endswith(M.fpk(key, relpath.split("/")[-4] if relpath.count("/") >= 3
                                                    else M.DEFAULT_FSDIR)):
        registered = M.scoped(sk.engine, sk.tenant or M.DEFAULT_TENANT)
    return (_block_order(cols["source_base"][i], cols["group"][i], cols["block_hash"][i]), row, *ek, status, ref,
            registered)


def _block_works(candidates: Spill, primaries: Spill, namespaces: dict[str, dict[str, Any]]
                 ) -> Iterator[tuple[int, str, ReshardWork]]:
    """(primary's row, store, work) of every resharded block, in block order: the primaries
    and the candidate sources both sorted by block (and row), then walked side by side, so
    only one block's rows are held at a time (a store of N blocks planned in N steps)."""
    cands = _sort(candidates, key=lambda c: (c[0], c[1]))
    cand = next(cands, None)
    held: list[tuple] = []
    held_block = None
    for block, row, store, first_key in _sort(primaries, key=lambda p: (p[0], p[1])):
        if block != held_block:
            held, held_block = [], block
            while cand is not None and cand[0] < block:
                cand = next(cands, None)
            while cand is not None and cand[0] == block:
                held.append(cand)
                cand = next(cands, None)
        yield row, store, _reshard_work(block[0], first_key, namespaces[block[0]], held)


def _reshard_work(base: str, first_key: bytes, ns: dict[str, Any], candidates: list[tuple]) -> ReshardWork:
    """The block's sources, outputs and displaced objects, re-derived from its rows through
    the function the scan used (families/mooncake_reshard.py): both name the same keys.
    `candidates`: the block's candidate sources (`_candidate`) in row order."""
    from kvmigrate.families import mooncake_reshard as R

    fields = ns.get("config_json") or {}
    engine, n_s, n_t = fields["engine"], int(fields["key_ranks"]), int(fields["target_key_ranks"])
    geo = R.Geometry(*fields["geometry"])
    sources: dict[tuple[int, str], SourceRef] = {}
    registered: dict[bytes, list[SourceRef]] = {}
    for _, _, rank, half, status, ref, key in candidates:
        if status == "ok" or (rank, half) not in sources:
            sources[(rank, half)] = ref  # (the scan's choice: an entry in place over a misfiled one)
        if key is not None:
            registered.setdefault(key, []).append(ref)
    halves = tuple(sorted({h for _, h in sources}))
    rank0 = sources[(0, halves[0])]
    kventries = rank0.index is None
    fsdir = rank0.relpath.split("/")[-4] if kventries else M.DEFAULT_FSDIR
    first = M.parse_storage_key(first_key)  # target key rank 0's key, as the scan named it
    # (an output's size is the scan's verdict, `value_size` 0: the apply writes what the reshard computes)
    outs = R.outputs(engine, first.engine, rank0.client, n_t, halves, first.tenant, 0, n_s, geo)
    mine = set(sources.values())  # (only the block's own sources are displaced: its rows are all it needs)
    displaced = [ref for o in outs for ref in registered.get(o.key, []) if ref in mine]
    return ReshardWork(n_s, n_t, geo, sources, outs, displaced, kventries, fsdir)


def _client_of_object(relpath: str, index: int | None) -> str:
    """The client root of an index entry (its `.meta`'s folder) or of a KVEntry."""
    if index is not None:
        return relpath.rpartition("/")[0]
    return "/".join(relpath.split("/")[:-4])


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


def unproven(root: str, dest: str, plans: list[StorePlan]) -> list[str]:
    """The stores an apply into `dest` writes without a proof that their clients are
    stopped (`check_proofs` refuses it): its command needs --engine-stopped."""
    if os.path.abspath(dest) != os.path.abspath(root):  # (into another folder: a store is only read)
        return []
    return [p.store for p in plans if p.proof is None]


def apply_label(stores: list[str]) -> str:
    """The dry run's label of an apply command that states --engine-stopped for `stores`:
    what must be true before it runs."""
    return f"to apply, once no engine uses Mooncake store {', '.join(stores)} (--engine-stopped states it):"


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
