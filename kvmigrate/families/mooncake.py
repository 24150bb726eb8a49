"""Mooncake Store SSD offload (spec mooncake.md; research notes R `mooncake-format.md`):
the client-side `FileStorage` of Mooncake 0.3.8 - 0.3.14, bucket and file-per-key backends,
holding the objects of vLLM 0.34's `MooncakeStoreConnector` and SGLang 0.5.23's HiCache
`mooncake` backend.

A *store* is one or more *client roots* (one client's `ssd_offload_path`; SGLang gives every
rank its own `rank_<dp>_<tp>_<pp>_<cp>` folder) whose keys share one master (§1.1). Every
name, encoding and key grammar is read through `kvmigrate/formats/mooncake.py`; this module
says what a starting client does with each file (§1.4), groups the objects into deployments
(§2.4: `mooncake:<store>:<engine>:<stem>:<scheme>[:tenant=<t>]`) and blocks, and gives every
file and object its status and action (§4). The scan side (finding stores, reading the
files) is `kvmigrate/scan/store_rows.py`.

Each deployment is planned against the keys its target looks up (§3.1: `TargetSide`, from
the facts of §3.2): a whole object of a complete block is `already_present` when the target
(mooncake-0.3.14) looks up its very key, `rekey` when only the scoping, tenant, model or a
non-`auto-` vLLM prefix differ, and a misfiled KVEntry is `link`ed to `fpk(key)`; another
`auto-` prefix or hash recipe is `stale_hash_recipe`, another engine or an lcm conversion
plans nothing, a GQA/MHA block at another target TP `needs_reshard`. Keys compare as a
>= 0.3.12 client registers them (a raw `K` as `default\0K`), and no rekey or link lands on
a key or path another object holds (§3.5: `_settle_targets`).
"""

from __future__ import annotations

import fcntl
import os
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmigrate import families
from kvmigrate import findings as fd
from kvmigrate.families import mooncake_reshard as R
from kvmigrate.formats import mooncake as M
from kvmigrate.identity.facts import Facts
from kvmigrate.identity.values import FACT_FLAGS, MOONCAKE_PROFILES
from kvmigrate.identity.vllm_target import Target

PROFILE = MOONCAKE_PROFILES[0]  # §0: tenant-scoped keys, the client lock
RAW_PROFILE = "mooncake-0.3.11"  # the last release that stores engine keys raw (§2.1)
RANK_DIR = re.compile(r"rank_(\d+)_(\d+)_(\d+)_(\d+)\Z")
STAGE_DIR = ".kvmigrate-stage"
OWN_LOCK = ".kvmigrate.lock"
SAMPLE_ENTRIES = 4096  # entries of one folder looked at to recognise a client root


def is_rank_dir(name: str) -> bool:
    return RANK_DIR.match(name) is not None


def pair_file(name: str) -> bool:
    """A name the bucket backend reads or deletes at the top of a client root: a stem whose
    numeric prefix `stoll` parses, ending `.meta` or `.bucket`."""
    return name.endswith((M.META_SUFFIX, M.BUCKET_SUFFIX)) and M.stoll_id(name) is not None


def is_client_root(path: str, fsdir: str = M.DEFAULT_FSDIR) -> bool:
    """A bucket client root (a regular `<digits>….meta`/`.bucket` file at its top) or a
    file-per-key one (`<fsdir>/` holding a regular file at depth 3), §1.1."""
    try:
        with os.scandir(path) as it:
            for i, e in enumerate(it):
                if i >= SAMPLE_ENTRIES:
                    break
                if pair_file(e.name) and e.is_file(follow_symlinks=False):
                    return True
                if e.name == fsdir and e.is_dir(follow_symlinks=False) and _depth3_file(e.path):
                    return True
    except OSError:
        return False
    return False


def _depth3_file(path: str) -> bool:
    try:
        with os.scandir(path) as a:
            for da in a:
                if not da.is_dir(follow_symlinks=False):
                    continue
                with os.scandir(da.path) as b:
                    for db in b:
                        if not db.is_dir(follow_symlinks=False):
                            continue
                        with os.scandir(db.path) as c:
                            if any(f.is_file(follow_symlinks=False) for f in c):
                                return True
    except OSError:
        return False
    return False


def rank_client_roots(path: str, fsdir: str = M.DEFAULT_FSDIR) -> list[str]:
    """The `rank_<dp>_<tp>_<pp>_<cp>` client roots inside a folder, by name."""
    try:
        with os.scandir(path) as it:
            names = [e.name for e in it if is_rank_dir(e.name) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    return sorted(n for n in names if is_client_root(os.path.join(path, n), fsdir))


def probe_client_lock(client_root: str) -> str:
    """The state of a client root's 0.3.14 lock, changing nothing: `absent` (no file),
    `held` (a client runs: its flock is taken), else `free`; the probe's own flock is
    released at once. A lock name that is a symlink or cannot be opened raises OSError."""
    path = os.path.join(client_root, M.LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return "absent"
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "held"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return "free"
    finally:
        os.close(fd)


def holds_store(path: str, fsdir: str = M.DEFAULT_FSDIR) -> bool:
    """Whether a folder is a store: itself a client root, or the parent of rank client roots."""
    return is_client_root(path, fsdir) or bool(rank_client_roots(path, fsdir))


@dataclass(slots=True)
class StoreFile:
    """One file under a store as the scan read it, or one object of a live index (then
    `object_index` is its entry's index and the stat columns are its `.meta`'s). `client`:
    its client root's relpath ('' for ROOT); `kind`: what it is in the layout (`meta`,
    `bucket`, `kventry`, `lock`, `own`, `other`, `object`)."""

    relpath: str
    client: str
    kind: str
    size: int
    mtime_ns: int = 0
    inode: int = 0
    dev: int = 0
    nlink: int = 1
    ctime_ns: int | None = None
    regular: bool = True
    entry: str = "file"  # what a non-regular entry is ("symlink", "fifo", ...)
    error: str | None = None
    data: bytes | None = None  # a `.meta`'s bytes; a KVEntry's first bytes (or whole, hashed)
    all_zero: bool | None = None
    content: bytes | None = None
    payload: bytes | None = None  # XXH3-128 of the value (objects, KVEntries)
    value_size: int | None = None
    top: bool = True  # at the top of its client root (a pair name there is read by the client)
    depth3: bool = False  # a file at depth 3 of the fsdir (parsed by the client at start)
    # verdict
    status: str = "ok"
    action: str = "none"
    reason: str = ""
    deployment: str | None = None
    rank: int | None = None
    group: int | None = None
    block_hash: bytes | None = None
    target: str | None = None
    object_index: int | None = None
    object_key: bytes | None = None
    target_key: bytes | None = None
    value_offset: int | None = None  # an object's value in its `.bucket`
    duplicate: bool = False  # its key is in another live entry of the store too
    mla: bool | None = None  # its engine key says MLA (SGLang `__k`; None: not known from one key)
    block: tuple | None = None  # (deployment, group, hash, sub-key): its block
    key_rank: tuple = ()  # its key rank within the block


@dataclass
class Deployment:
    """The objects of one deployment of a store (§2.4)."""

    label: str
    store: str
    engine: str
    stem: str
    scheme: str
    tenant: str | None
    model: str
    kv_kind: str | None = None
    key_ranks: int = 1
    notes: list[str] = field(default_factory=list)
    facts: Facts = field(default_factory=Facts)
    prefix: str | None = None  # vLLM cache prefix
    namespace: str = ""  # vLLM store-TP namespace
    needs: set[str] = field(default_factory=set)  # facts a decision waits for (`kvmigrate facts` asks them)
    side: TargetSide | None = None  # what its target looks up (§3.1)

    @property
    def fields(self) -> dict[str, Any]:
        side = self.side
        return {"family": "mooncake", "store": self.store, "engine": self.engine, "stem": self.stem,
                "scheme": self.scheme, "tenant": self.tenant, "model": self.model, "kv_kind": self.kv_kind,
                "key_ranks": self.key_ranks, "deployment": self.label, "target_label": self.target_label,
                "target_key_ranks": side.key_ranks if side is not None else self.key_ranks,
                "geometry": None if side is None or side.geometry is None else [
                    side.geometry.heads, side.geometry.head_dim, side.geometry.elem_bytes],
                "needs_facts": sorted(self.needs)}

    @property
    def target_label(self) -> str:
        """The target's deployment: its stem and tenant (§3.1), keys scoped as 0.3.14 looks them up."""
        side = self.side
        if side is None:
            return deployment_label(self.store, self.engine, self.stem, "mc-scoped", self.tenant or M.DEFAULT_TENANT)
        return deployment_label(self.store, self.engine, side.stem, "mc-raw" if side.raw else "mc-scoped",
                                None if side.raw else side.tenant)


def deployment_label(store: str, engine: str, stem: str, scheme: str, tenant: str | None) -> str:
    label = f"mooncake:{store}:{engine}:{stem}:{scheme}"
    return label + (f":tenant={tenant}" if tenant is not None and tenant != M.DEFAULT_TENANT else "")


def store_label(store: str) -> str:
    """The namespace of a store's own files (containers, the lock, foreign files)."""
    return f"mooncake:{store}"


@dataclass(frozen=True, slots=True)
class EngineKey:
    """What an engine key says (§2.2, §2.3)."""

    engine: str
    stem: str
    model: str
    group: int
    hash: str
    sub: tuple  # the block's other coordinates: vLLM (pcp, dcp, pp), SGLang (pp,)
    rank: int  # vLLM tp_rank, SGLang MHA rank (MLA 0)
    half: str  # SGLang k/v; vLLM ""
    mla: bool | None  # SGLang `__k`: True; vLLM: not known from one key
    prefix: str | None = None  # vLLM cache prefix
    namespace: str = ""  # vLLM store-TP namespace


def parse_engine_key(key: str) -> EngineKey | None:
    """A key's fields; what keys share (a deployment's stem, model, prefix and namespace, a
    block's hash) is one string, however many objects spell it."""
    v = M.parse_vllm_key(key)
    if v is not None:
        return EngineKey("vllm", sys.intern(v.stem), sys.intern(v.model), v.group, sys.intern(v.hash),
                         (v.pcp, v.dcp, v.pp_rank), v.tp_rank, "", None,
                         None if v.prefix is None else sys.intern(v.prefix), sys.intern(v.namespace))
    s = M.parse_sglang_key(key)
    if s is not None:
        prefix, page = sys.intern(s.prefix), sys.intern(s.page_hash)
        if not s.ranks:  # `__k`: MLA, pp 1
            return EngineKey("sglang", prefix, prefix, 0, page, (0,), 0, s.half, True)
        pp = s.ranks[1] if len(s.ranks) > 1 else 0
        return EngineKey("sglang", prefix, prefix, 0, page, (pp,), s.ranks[0], s.half, None)
    return None


def key_rank(key: str) -> tuple[int, str] | None:
    """(key rank, half) of an engine key, as `parse_engine_key` gives them, None for a key of
    no grammar; no field interned (a reshard's planning reads every object of a store
    once: interning each block's hash grew the interpreter's table by ~200 B a block)."""
    v = M.parse_vllm_key(key)
    if v is not None:
        return v.tp_rank, ""
    s = M.parse_sglang_key(key)
    if s is not None:
        return (s.ranks[0] if s.ranks else 0), s.half
    return None


def _hash_bytes(h: str) -> bytes | None:
    try:
        return bytes.fromhex(h if len(h) % 2 == 0 else "0" + h)
    except ValueError:
        return None


class Mooncake(families.Family):
    name = "mooncake"
    title = "Mooncake Store"
    reads_s1 = False
    target_engine = "mooncake"
    root_layout = "stores"
    prunes = True  # (migrate/prune_stores.py: its own rules)
    incomplete_advice = ("a lookup needs every key rank's object of a block: the block is a miss until the engine "
                         "writes it again")

    def claims_entry(self, name: str, is_dir: bool) -> bool:
        return False  # stores are recognised by what they hold (holds_store)

    def holds_store(self, path: str, fsdir: str | None = None) -> bool:
        return holds_store(path, fsdir or M.DEFAULT_FSDIR)

    def root_store_entries(self, root: str, files: list[str], folders: list[str],
                           fsdir: str | None = None) -> set[str]:
        """The top-level names of ROOT that belong to a store at ROOT itself (none: ROOT is
        no store): its pair files, the client lock, the fsdir, kvmigrate's stage and lock,
        and its rank client roots."""
        fsdir = fsdir or M.DEFAULT_FSDIR
        ranks = set(rank_client_roots(root, fsdir))
        if not is_client_root(root, fsdir):
            return ranks
        keep = {n for n in files if n.endswith((M.META_SUFFIX, M.BUCKET_SUFFIX)) or n in (M.LOCK_NAME, OWN_LOCK)}
        keep |= {n for n in folders if n in (fsdir, STAGE_DIR)}
        return keep | ranks

    def target(self, fields: dict, facts: Facts, profile: str) -> Target:
        """The target deployment's label; the objects' actions are the rows' (§3.3)."""
        label = str(fields.get("target_label") or fields.get("deployment") or "")
        return Target(profile=self.target_profile(profile), family=self.name, fields=None, d12=None,
                      base_name=label or None,
                      rank_dir=None, parallel_agnostic=False, replicated_layout=False, reasons=[])

    def target_profile(self, profile: str) -> str:
        """Every store targets mooncake-0.3.14 unless --target names a mooncake-* profile (§0)."""
        return profile if profile in MOONCAKE_PROFILES else PROFILE

    def flat_target(self, source_base: str, fields: Mapping[str, Any]) -> str:
        return str(fields.get("target_label") or source_base)

    # --- verdicts (§1.4, §2.4, §3, §4) ------------------------------------------------

    def classify_store(self, store: str, partitions: Callable[[], Iterable[Part]],
                       judged: Callable[[list[StoreFile]], None], facts_for: Callable[[str | None], Facts],
                       fsdir: str = M.DEFAULT_FSDIR, profile: str = PROFILE, stray: Part = ([], [])
                       ) -> list[Deployment]:
        """The deployments of a store; each object of its live indexes and each `ok`
        KVEntry, judged, to `judged` (a partition's at a time; retired keys and keys of
        no grammar get the store's label as deployment). `partitions()`: those objects,
        as (walk ordinals, records) per partition, each in walk order, every object a
        verdict compares with another in the other's partition (read three times at
        most); the scan gave them the container statuses of §1.4. `stray`: with their walk
        ordinals, what every partition must see of the KVEntries besides its own: the
        store's other KVEntries (they hold a path and may hold a key) and the path holders
        of its `ok` ones (`path_holder`). `facts_for(model)`: a deployment's facts (§3.2;
        None: the store's own)."""
        deps: dict[str, Deployment] = {}
        tallies: dict[str, _Tally] = {}
        for part in partitions():  # what the deployment-wide verdicts count
            _count(store, part, deps, tallies, facts_for)
        order = sorted(deps, key=lambda label: tallies[label].first)  # (the store's walk order: as one pass)
        again = [label for label in order if self._kind(deps[label], tallies[label])]
        if again:  # blocks a migration already resharded change the writer's key ranks and sizes
            for part in partitions():
                self._count_unsettled(store, part, deps, tallies, again, facts_for)
        store_facts = facts_for(None)
        raw = self.target_profile(profile) == RAW_PROFILE
        for label in order:
            self._prepare(deps[label], tallies[label], raw)
        for part in partitions():
            judged(self._judge(store, part, deps, tallies, order, facts_for, fsdir, store_facts, stray))
            del part  # (before the next partition is read: one at a time)
        return [deps[label] for label in sorted(deps)]

    def _count_unsettled(self, store: str, part: Part, deps: dict[str, Deployment], tallies: dict[str, _Tally],
                         labels: list[str], facts_for: Callable[[str | None], Facts]) -> None:
        ordinals, objs = part
        by_dep, _ = _assign(store, objs, deps, facts_for)
        _duplicates(objs)
        at = dict(zip(map(id, objs), ordinals))
        for label in labels:
            mine = by_dep.get(label, [])
            settled = self._two_layouts(deps[label], mine, deps[label].kv_kind, M.DEFAULT_FSDIR)  # (counts only)
            rest = [o for o in mine if id(o) not in settled]
            tallies[label].count_unsettled(bool(settled), rest, [at[id(o)] for o in rest])

    def _judge(self, store: str, part: Part, deps: dict[str, Deployment], tallies: dict[str, _Tally],
               order: list[str], facts_for: Callable[[str | None], Facts], fsdir: str, store_facts: Facts,
               stray: Part) -> list[StoreFile]:
        """The verdicts of a partition's objects, returned (the deployments' in `order`,
        the order the store's would be judged in at once)."""
        ordinals, objs = part
        by_dep, _ = _assign(store, objs, deps, facts_for)
        _duplicates(objs)
        mine = set(ordinals)  # (a path holder of the partition's own KVEntry: the entry itself is here)
        others = [(k, f) for k, f in zip(*stray) if k not in mine]
        held = _Held.of([f for _, f in sorted([*zip(ordinals, objs), *others], key=lambda p: p[0])])
        for label in order:
            if label in by_dep:
                self._classify_deployment(deps[label], by_dep[label], tallies[label], fsdir, store_facts, held)
        _settle_targets(objs, held, fsdir)
        for o in objs:  # what the verdicts parsed is theirs only: the rows keep the verdicts
            o.block = None
            o.key_rank = ()
        return objs

    def _kind(self, dep: Deployment, t: _Tally) -> bool:
        """A deployment's kind of KV (§2.3) from its keys, unless stated; whether a migration
        may have left blocks in two layouts (then the objects are counted again)."""
        kind = dep.facts.kv_kind
        if dep.engine == "sglang":
            kind = kind or ("mla" if t.mla_k0 else "full" if "v" in t.halves else None)
        else:
            kind = kind or ("full" if t.top > 0 else None)
        dep.kv_kind = kind
        geo, _ = R.geometry(dep.facts)
        return isinstance(dep.facts.target_tp, int) and kind == "full" and geo is not None

    def _prepare(self, dep: Deployment, t: _Tally, raw: bool) -> None:
        """The deployment-wide part of its verdicts: the writer's key ranks, the key ranks
        a block has, the objects' modal size, and the target's side (§3.1)."""
        kind = dep.kv_kind
        writer_tp = dep.facts.writer_tp if isinstance(getattr(dep.facts, "writer_tp", None), int) else None
        n_s = 1 + (t.top_staged if dep.engine == "sglang" and kind == "mla" else t.top)
        halves = sorted(t.halves)
        if dep.engine == "sglang" and kind not in (None, "mla"):
            halves = ["k", "v"]  # an MHA page writes both on every rank
        sizes = t.sizes
        if t.settled:
            n_s = 1 + t.top_unsettled
            sizes = t.sizes_unsettled
        dep.key_ranks = n_s
        t.universe = {(r, h) for r in range(n_s) for h in halves}
        # (the most common size; of sizes as common, the one met first in walk order)
        t.modal = min(sizes, key=lambda size: (-sizes[size][0], sizes[size][1])) if sizes else None
        if writer_tp is not None:
            dep.notes.append(f"writer TP {writer_tp} stated")
        dep.side = _target_side(dep, n_s, raw)

    def _classify_deployment(self, dep: Deployment, objs: list[StoreFile], t: _Tally, fsdir: str,
                             store_facts: Facts, held: _Held) -> None:
        """The verdicts of a deployment's objects of one partition (every key rank of a
        block is in it), from what `_prepare` found over all of them."""
        kind = dep.kv_kind
        if dep.engine == "sglang" and kind == "mla":  # a one-number suffix of an MLA key is its pp rank (§2.3)
            for o in objs:
                _as_mla_stage(o)
        n_s = dep.key_ranks
        universe, modal = t.universe, t.modal
        settled = self._two_layouts(dep, objs, kind, fsdir)  # blocks a migration already resharded (§2.4)
        if settled:
            objs = [o for o in objs if id(o) not in settled]
        side = dep.side
        assert side is not None
        # per object: what its bytes alone prove (§2.4), in §4's order
        for o in objs:
            if o.status == "ok" and o.kind == "kventry" and not o.error:
                sk = _storage(o)
                if _client_rel(o.client, M.fpk(o.object_key or b"", fsdir)) != o.relpath:
                    o.status = "misfiled"
                    o.reason = ("a valid entry outside fpk(key): registered at start, never read" +
                                ("" if sk.tenant is not None else " (and its key is raw)"))
            if o.status != "ok":
                continue
            if o.error:
                o.status, o.reason = "unreadable", o.error
            elif o.all_zero:
                o.status, o.reason = "zero_filled", "every byte of the value is zero: no engine wrote it so"
            elif modal is not None and o.size < modal:
                o.status, o.reason = "short", (f"value of {o.size} bytes, the deployment's objects are {modal}: "
                                               "cut short, a read returns a wrong block")
            elif modal is not None and o.size > modal:
                o.status, o.reason = "size_mismatch", (f"value of {o.size} bytes, the deployment's objects are "
                                                       f"{modal}: not this geometry's block")
        if side.stale:  # §4's order: before replica_mismatch and incomplete
            for o in objs:
                if o.status in ("ok", "replica_mismatch"):
                    o.status, o.action, o.reason = "stale_hash_recipe", "none", side.stale
        blocks: dict[tuple, list[StoreFile]] = defaultdict(list)
        for o in objs:
            if o.block is not None:
                blocks[o.block].append(o)
        usable = R.SOURCE_STATUSES  # a misfiled KVEntry counts: it is relinked (§2.4)
        # KVEntries at their own fpk path: a misfiled copy of one is a harmless duplicate (§1.3)
        in_place = {o.relpath for o in objs if o.kind == "kventry" and o.status == "ok"}
        for objs_of in blocks.values():
            # a key in two live entries fails every read (§1.4), equal values or not: the
            # block is a miss, as with a damaged object (and a reshard has no one source)
            have = {o.key_rank for o in objs_of if o.status in usable and not o.duplicate}
            missing = universe - {o.key_rank for o in objs_of}
            ready = []
            for o in objs_of:
                if o.status not in usable:
                    if not o.reason:
                        o.reason = o.status
                    continue
                if o.duplicate:
                    continue
                if missing and o.status == "ok":
                    o.status = "incomplete"
                    o.reason = (f"block lacks {len(missing)} of the writer's {len(universe)} key-rank objects: "
                                "a lookup needs every one")
                    continue
                if missing or have != universe:
                    o.action = "none"
                    o.reason = "another key-rank object of the block is damaged: the block is a miss"
                    continue
                ready.append(o)
            if side.reshard and ready and not (side.stale or side.refused or side.asks):
                if side.geometry is not None and side.key_ranks is not None:  # everything a reshard needs
                    R.plan_block(ready, engine=dep.engine, n_s=n_s, n_t=side.key_ranks, geo=side.geometry,
                                 tenant=None if side.raw else side.tenant, target_engine_key=side.engine_key,
                                 registered=held.by_key,
                                 fsdir=fsdir)
                else:
                    _needs_reshard(ready, side, fsdir)
                continue
            for o in ready:
                self._action(o, dep, fsdir, in_place)

    def _two_layouts(self, dep: Deployment, objs: list[StoreFile], kind: str | None, fsdir: str) -> set[int]:
        """Blocks held in two layouts after a migration (§2.4): objects of the target's size
        at the target's key ranks are the target's (read in place), the others the writer's,
        whose key ranks are one more than their largest; those a complete target layout
        supersedes are `superseded`. Returns the ids of the objects settled so."""
        target_tp = dep.facts.target_tp
        geo, _ = R.geometry(dep.facts)
        if not isinstance(target_tp, int) or kind != "full" or geo is None:
            return set()
        n_t = R.key_ranks(dep.engine, target_tp, geo.heads)
        blocks: dict[tuple, list[StoreFile]] = defaultdict(list)
        for o in objs:
            if o.block is not None and o.status == "ok" and not o.duplicate:
                blocks[o.block].append(o)
        settled: set[int] = set()
        for block in blocks.values():
            size = {id(o): R.value_size(o) for o in block}
            if len(set(size.values())) != 2:
                continue
            writer_size = size[id(max(block, key=lambda o: o.key_rank))]
            writer = [o for o in block if size[id(o)] == writer_size]
            target = [o for o in block if size[id(o)] != writer_size]
            n_s = 1 + max(o.key_rank[0] for o in writer)
            t_size = writer_size // R.heads_at(geo.heads, n_s) * R.heads_at(geo.heads, n_t)
            halves = {o.key_rank[1] for o in block}
            if {o.key_rank for o in target} != {(r, h) for r in range(n_t) for h in halves} or \
                    {size[id(o)] for o in target} != {t_size}:
                continue
            for o in target:
                o.action, o.target_key = "already_present", o.object_key
                o.target = _client_rel(o.client, "" if o.object_index is not None else M.fpk(o.object_key or b"",
                                                                                              fsdir))
                o.reason = f"read in place: the target's object of key rank {o.key_rank[0]} (TP {target_tp})"
            for o in writer:
                o.reason = fd.Reason(f"the writer's key rank {o.key_rank[0]}: the target reads this block at its "
                                     "own keys", fd.Finding(fd.SUPERSEDED))
            settled |= {id(o) for o in block}
        return settled

    def _action(self, o: StoreFile, dep: Deployment, fsdir: str, in_place: set[str]) -> None:
        """§3.3 for one whole object of a complete block: the key its target looks up
        (§3.1); whether another object already holds that key is settled store-wide after
        (`_settle_targets`, §3.5)."""
        side = dep.side
        assert side is not None
        if side.stale or side.refused or side.asks:
            o.action = "none"
            o.reason = (fd.reason(side.asks_why, fd.NEEDS_FACT, asks=fd.asks(*side.asks)) if side.asks and
                        not (side.stale or side.refused) else side.stale or side.refused)
            return
        sk = _storage(o)
        target_key = side.storage_key(side.engine_key(sk.engine))
        o.target_key = target_key = o.object_key if target_key == o.object_key else target_key
        why = side.differs(sk, dep)  # (the same for most objects of a deployment: their reasons are one string)
        if o.kind == "kventry":
            want = _client_rel(o.client, M.fpk(target_key, fsdir))
            if target_key != o.object_key:
                o.action, o.target = "rekey", want
                o.reason = sys.intern(f"{why}: rekey writes the entry at its target key (fpk of it), its value unchanged")
            elif want == o.relpath:
                o.action, o.target = "already_present", o.relpath
                o.reason = "read in place: the target looks up this key at this path"
            elif want in in_place:  # (prune --migrated takes this name)
                o.action, o.target = "already_present", want
                o.reason = "a copy of the entry at fpk(key), which serves the key: this name is a harmless duplicate"
            else:
                o.action, o.target = "link", want
                o.reason = "a valid entry outside fpk(key): registered at start, never read; link it there"
            return
        o.target = _client_root(o.client)
        if target_key != o.object_key:
            o.action = "rekey"
            o.reason = sys.intern(f"{why}: rekey rewrites its index entry to the target key, its value unchanged")
        else:
            o.action = "already_present"
            o.reason = "read in place: the target looks up this key in this live index"


ENGINE_RELEASES = {"vllm": "vllm-0.34", "sglang": "sglang-0.5.23"}  # the target_engine fact's values
HEADS_OUTERMOST = ("hnd", "page_head")  # layouts no per-row reshard applies to (§3.4)
LAYOUTS = {"vllm": ("nhd", "hnd"), "sglang": ("layer_first", "page_first", "page_first_direct", "page_head")}


def facts_key_matches(key_model: str, written: str) -> bool:
    """Whether a FACTS.json key's model names the model a key spells (§3.2): as spelled, or
    a Hugging Face id `org/name`, which is vLLM's `name` and SGLang's `org-name` or
    `<tag>_org-name` (whatever the engine: one id names both)."""
    if key_model == written:
        return True
    if "/" not in key_model.strip("/"):
        return False
    flat = key_model.strip("/").replace("/", "-")
    return written in (_basename(key_model), flat) or written.endswith("_" + flat)


def _basename(model: str) -> str:
    return model.rstrip("/").rsplit("/", 1)[-1]


@dataclass
class TargetSide:
    """The keys a deployment's target looks up (§3.1), from its facts (§3.2). `key_ranks`
    n_t (None: not known); a non-empty `stale`, `refused` or `asks` means no object is
    reused, `reshard` that a GQA/MHA block would need one."""

    tenant: str
    model: str  # as the target's keys spell it (vLLM basename, SGLang prefix)
    prefix: str | None  # vLLM cache prefix
    namespace: str  # vLLM store-TP namespace, kept
    engine: str
    key_ranks: int | None = None
    stale: str = ""
    refused: str = ""
    asks: tuple[str, ...] = ()
    asks_why: str = ""
    reshard: str = ""
    reshard_asks: tuple[str, ...] = ()
    raw: bool = False  # the target profile stores engine keys raw (mooncake-0.3.11)
    geometry: Any = None  # mooncake_reshard.Geometry when a reshard has every fact it needs

    @property
    def stem(self) -> str:
        if self.engine == "vllm":
            return (f"{self.prefix}@" if self.prefix is not None else "") + self.model + self.namespace
        return self.model

    def storage_key(self, engine_key: str) -> bytes:
        """The storage key the target looks up: scoped by its tenant (>= 0.3.12), or raw."""
        return M.StorageKey(None if self.raw else self.tenant, engine_key).encode()

    def engine_key(self, key: str) -> str:
        """The target's engine key for a writer's key of the same block and key rank."""
        v = M.parse_vllm_key(key)
        if v is not None:
            return M.format_vllm_key(M.VllmKey(self.prefix, self.model, self.namespace, v.tp_rank, v.pcp, v.dcp,
                                               v.pp_rank, v.group, v.hash))
        s = M.parse_sglang_key(key)
        assert s is not None
        return M.format_sglang_key(M.SglangKey(self.model, s.page_hash, s.ranks, s.half))

    def differs(self, sk: M.StorageKey, dep: Deployment) -> str:
        """What of a storage key the target spells otherwise (a rekey's reason)."""
        out = []
        if self.raw and sk.tenant is not None:
            out.append(f"scoped key (tenant {sk.tenant}): the target, Mooncake 0.3.11, looks up raw keys")
        elif self.raw:
            pass
        elif sk.tenant is None:
            out.append("raw key (Mooncake <= 0.3.11): 0.3.14 registers it as tenant default and never reads it")
        elif sk.tenant != self.tenant:
            out.append(f"tenant {sk.tenant} -> {self.tenant} (target_tenant)")
        if dep.model != self.model:
            out.append(f"model {dep.model} -> {self.model} (target_model_name)")
        if dep.engine == "vllm" and dep.prefix != self.prefix:
            out.append(f"cache prefix {dep.prefix or 'none'} -> {self.prefix or 'none'} (target_cache_prefix)")
        return "; ".join(out) or "the target spells this key otherwise"


def _target_side(dep: Deployment, n_s: int, raw: bool = False) -> TargetSide:
    """§3.1-3.3 for one deployment: the target's tenant, model, prefix and key ranks, or why
    no object is reused; every fact assumed goes into the notes with its flag, every fact a
    decision waits for into `dep.needs`."""
    f = dep.facts
    assumed: list[str] = []
    tenant = f.target_tenant or dep.tenant or M.DEFAULT_TENANT
    if f.target_tenant is None:
        assumed.append(f"tenant {tenant} (--target-tenant)")
    prefix: str | None = None
    if dep.engine == "vllm":
        model = _basename(f.target_model_name) if f.target_model_name else dep.model
        prefix = dep.prefix if f.target_cache_prefix is None else (f.target_cache_prefix or None)
        if f.target_cache_prefix is None:
            assumed.append(f"cache prefix {prefix or 'none'} (--target-cache-prefix)")
    else:
        model = _sglang_prefix(dep, f.target_model_name) if f.target_model_name else dep.model
    if f.target_model_name is None:
        assumed.append(f"model {model} (--target-model-name)")
    side = TargetSide(tenant, model, prefix, dep.namespace, dep.engine, n_s, raw=raw)
    writer_engine = ENGINE_RELEASES[dep.engine]
    if f.target_engine is None:
        assumed.append(f"engine {writer_engine} (--target-engine)")
    elif f.target_engine != writer_engine:
        side.refused = (f"the target engine {f.target_engine} reads other keys and values than {writer_engine}, "
                        "which wrote them: Mooncake objects are not converted across engines")
    if f.hash_recipe_changed:
        side.stale = ("the target hashes tokens otherwise (hash_recipe_changed): it never computes these keys, "
                      "and no rename fixes that")
    elif f.hash_recipe_changed is None:
        assumed.append("the writer's hash recipe (--hash-recipe-changed)")
    if dep.engine == "vllm" and dep.prefix is not None and dep.prefix.startswith("auto-"):
        dep.notes.append(f"vLLM cache prefix {dep.prefix}: an auto- prefix hashes the build, model, HF commit and "
                         "cache config, so it changes with every vLLM build (a target of another build: "
                         "--target-cache-prefix states its prefix)")
        if prefix != dep.prefix and not side.stale:
            side.stale = (f"vLLM auto- cache prefix {dep.prefix} is not the target's ({prefix or 'none'}): the "
                          "target's build hashes its blocks otherwise, so no rename makes these keys its own")
    if f.engine_stopped is None:
        assumed.append("a client may use the store (--engine-stopped)")
    if f.writer_release is None:
        assumed.append(("writer release <= 0.3.11 (raw keys)" if dep.scheme == "mc-raw" else
                        "writer release >= 0.3.12 (scoped keys)") + " (--writer-release)")
    _target_ranks(dep, side, n_s, assumed)
    dep.needs.update(_fact_of(flag) for flag in (*side.asks, *side.reshard_asks))
    if assumed:
        dep.notes.append("facts assumed: " + "; ".join(assumed))
    return side


def _sglang_prefix(dep: Deployment, target_model: str) -> str:
    """SGLang's key prefix for the target's model: its path with `/` -> `-`, after the
    writer's extra_backend_tag when one is known (the writer's model stated by
    `model_name`, or a FACTS.json key naming it by its HF id)."""
    flat = target_model.strip("/").replace("/", "-")
    named = [dep.facts.model_name or ""]
    named += [src.removeprefix("facts:").rsplit(":", 1)[-1] for src in dep.facts.sources.values()
              if src.startswith("facts:")]
    for m in named:
        mine = m.strip("/").replace("/", "-")
        if "/" in m.strip("/") and dep.model.endswith("_" + mine):
            return dep.model[: -len(mine)] + flat
    if "_" in dep.model:
        dep.notes.append(f"SGLang key prefix {dep.model}: no extra_backend_tag assumed (state the writer's model "
                         "with --model-name or key FACTS.json by its HF id to keep one)")
    return flat


def _target_ranks(dep: Deployment, side: TargetSide, n_s: int, assumed: list[str]) -> None:
    """n_t, the target's key ranks (§3.1): the writer's unless `target_tp` changes a GQA/MHA
    deployment's, which then needs a reshard (§3.4) or a fact."""
    f = dep.facts
    t = f.target_tp
    if dep.engine == "sglang" and dep.kv_kind is None:
        side.asks = ("--kv-kind",)
        side.asks_why = ("one-number key suffixes and no _v object: MHA TP ranks or MLA pp ranks (§2.3); "
                         "state --kv-kind")
        return
    if t is None:
        assumed.append("TP the writer's (--target-tp)")
        return
    if dep.kv_kind == "mla":
        return  # MLA keys are the same at every TP (§3.1)
    if dep.namespace:
        dep.notes.append(f"store-TP namespace {dep.namespace}: its keys serve every target TP (§3.1)")
        return
    if dep.engine == "sglang" and f.tp_lcm_size is not None:
        if f.tp_lcm_size % t:
            side.refused = (f"target TP {t} does not divide tp_lcm_size {f.tp_lcm_size}: a conversion of the "
                            "virtual key ranks (not built)")
        return
    if dep.kv_kind is None:  # vLLM, one key rank per block
        if t != n_s:
            side.asks = ("--kv-kind",)
            side.asks_why = (f"one key rank per block: MLA (the same keys at TP {t}) or GQA with one key rank "
                             f"(another count at TP {t}); state --kv-kind")
        return
    heads = f.total_kv_heads
    if dep.engine == "sglang" or t <= n_s:
        n_t = t
    elif heads is not None:
        n_t = min(t, heads)
    elif f.writer_tp is not None and f.writer_tp > n_s:
        n_t = n_s  # the writer's TP exceeds its key ranks: H is n_s
    else:
        side.key_ranks = None
        side.asks = ("--total-kv-heads",)
        side.asks_why = f"the target's key ranks are min({t}, H) and the total KV heads H are not stated"
        return
    side.key_ranks = n_t
    if n_t == n_s:
        return
    missing = [flag for flag, value in (("--total-kv-heads", heads), ("--head-dim", f.head_dim),
                                        ("--layers", f.layers), ("--page-tokens", f.page_tokens),
                                        ("--dtype-bytes", f.dtype_bytes or f.model_dtype)) if value is None]
    layout = f.kv_layout or (f.writer_layout if dep.engine == "sglang" else None)
    if layout is None:
        layout = LAYOUTS[dep.engine][0 if dep.engine == "vllm" else 1]
        assumed.append(f"writer layout {layout} (--kv-layout)")
    what = f"{n_s} -> {n_t} key ranks (target TP {t})"
    if layout not in LAYOUTS[dep.engine]:
        side.reshard = f"{what}: layout {layout} is not a {dep.engine} layout (--kv-layout)"
    elif layout in HEADS_OUTERMOST:
        side.reshard = f"{what}: layout {layout} keeps the heads outermost, a reshard per row does not apply"
    elif heads is not None and not (_even(heads, n_s) and _even(heads, n_t)):
        side.reshard = f"{what}: {heads} KV heads do not split evenly over {n_s} and {n_t} key ranks"
    elif missing:
        side.reshard = f"{what}: the geometry is not stated ({' '.join(missing)})"
        side.reshard_asks = tuple(missing)
    else:
        side.reshard = what
        side.geometry, _ = R.geometry(f)


def _even(heads: int, n: int) -> bool:
    return heads % n == 0 or n % heads == 0


def _fact_of(flag: str) -> str:
    return next(name for name, f in FACT_FLAGS.items() if f == flag)


def _needs_reshard(ready: list[StoreFile], side: TargetSide, fsdir: str) -> None:
    """The rank-row rule (§4): the block's primary row (lowest key rank; SGLang rank 0's
    `_k`) asks the reshard, its target target rank 0's key (in the primary's client root),
    the others point at it."""
    ordered = sorted(ready, key=lambda o: o.key_rank)
    primary = ordered[0]
    primary.action = "needs_reshard"
    primary.target_key = side.storage_key(side.engine_key(_storage(primary).engine))
    primary.target = _client_rel(primary.client, M.fpk(primary.target_key, fsdir) if primary.kind == "kventry"
                                 else "")
    finding = fd.Finding(fd.NEEDS_FACT, asks=fd.asks(*side.reshard_asks)) if side.reshard_asks else None
    primary.reason = fd.Reason(side.reshard, finding)
    for o in ordered[1:]:
        o.action = "none"
        o.reason = fd.reason(f"part of key rank {primary.rank}'s needs_reshard", fd.PART_OF_ACTION,
                             primary_rank=primary.rank, of_action="needs_reshard")


def _as_mla_stage(o: StoreFile) -> None:
    """An SGLang MLA key `_<pp>_k` (pp > 1): key rank 0 of stage pp, not TP rank pp."""
    s = M.parse_sglang_key(_storage(o).engine)
    if s is None or len(s.ranks) != 1 or o.block is None:
        return
    o.rank, o.key_rank = 0, (0, s.half)
    o.block = (*o.block[:3], (s.ranks[0],))


Part = tuple[list[int], list[StoreFile]]  # a partition's objects: (walk ordinals, records)


@dataclass
class _Tally:
    """What a deployment's objects say together, counted partition by partition: its
    first object's walk ordinal, what its keys say of its kind and key ranks, and the
    sizes of its `ok` objects (size -> [count, first ordinal])."""

    first: int
    mla_k0: bool = False
    top: int = 0  # its largest key rank
    top_staged: int = 0  # the same, SGLang's one-number MLA suffixes read as pp stages (§2.3)
    halves: set[str] = field(default_factory=set)
    sizes: dict[int, list[int]] = field(default_factory=dict)
    settled: bool = False  # some block is held in two layouts (§2.4): the rest is counted again
    top_unsettled: int = 0
    sizes_unsettled: dict[int, list[int]] = field(default_factory=dict)
    universe: set[tuple] = field(default_factory=set)  # (key rank, half) of a whole block
    modal: int | None = None

    def count(self, objs: list[StoreFile], ordinals: list[int], staged: bool) -> None:
        for o, k in zip(objs, ordinals):
            rank, half = o.key_rank
            self.mla_k0 = self.mla_k0 or (o.key_rank == (0, "k") and bool(o.mla))
            self.top = max(self.top, rank)
            if staged:
                self.top_staged = max(self.top_staged, _staged_rank(o))
            self.halves.add(half)
            if o.status == "ok":
                _tally_size(self.sizes, o.size, k)

    def count_unsettled(self, settled: bool, objs: list[StoreFile], ordinals: list[int]) -> None:
        self.settled = self.settled or settled
        for o, k in zip(objs, ordinals):
            self.top_unsettled = max(self.top_unsettled, o.key_rank[0])
            if o.status == "ok":
                _tally_size(self.sizes_unsettled, o.size, k)


def _tally_size(sizes: dict[int, list[int]], size: int, ordinal: int) -> None:
    got = sizes.get(size)
    if got is None:
        sizes[size] = [1, ordinal]
    else:
        got[0] += 1
        got[1] = min(got[1], ordinal)


def _count(store: str, part: Part, deps: dict[str, Deployment], tallies: dict[str, _Tally],
           facts_for: Callable[[str | None], Facts]) -> None:
    """Count a partition's objects into their deployments' tallies."""
    ordinals, objs = part
    by_dep, _ = _assign(store, objs, deps, facts_for)
    _duplicates(objs)
    at = dict(zip(map(id, objs), ordinals))
    for label, mine in by_dep.items():
        first = at[id(mine[0])]  # (the deployment's first object of the partition, in walk order)
        t = tallies.get(label)
        if t is None:
            t = tallies[label] = _Tally(first)
        t.first = min(t.first, first)
        t.count(mine, [at[id(o)] for o in mine], staged=deps[label].engine == "sglang")


def _staged_rank(o: StoreFile) -> int:
    """An SGLang object's key rank once a one-number suffix is read as its pp stage (as
    `_as_mla_stage` does)."""
    s = M.parse_sglang_key(_storage(o).engine)
    if s is None or len(s.ranks) != 1 or o.block is None:
        return int(o.key_rank[0])
    return 0


def _assign(store: str, objs: list[StoreFile], deps: dict[str, Deployment],
            facts_for: Callable[[str | None], Facts]) -> tuple[dict[str, list[StoreFile]], list[StoreFile]]:
    """Each object's deployment, block and key rank from its key (§2.4), the deployments
    made as their first object is met: (a deployment's objects, in the order given; the
    objects of the store's own: retired keys, keys of no grammar)."""
    by_dep: dict[str, list[StoreFile]] = {}
    loose: list[StoreFile] = []
    shared: dict[tuple, tuple] = {}  # one tuple per key rank and block coordinates, not one per object
    for o in objs:
        sk = M.parse_storage_key(o.object_key or b"")
        retired = M.parse_retired_key(sk.engine)
        if retired is not None and o.status == "ok":  # an entry a migration displaced (§3.5)
            o.reason = fd.Reason(f"an entry kvmigrate run {retired[0]} retired (its key was "
                                 f"{retired[1]!r}): no engine looks it up", fd.Finding(fd.SUPERSEDED))
            o.deployment = store_label(store)
            loose.append(o)
            continue
        ek = parse_engine_key(sk.engine)
        scheme = "mc-scoped" if sk.tenant is not None else "mc-raw"
        if ek is None:
            if o.status == "ok":
                o.status, o.action = "unsupported_layout", "none"
                o.reason = ("a key of no known grammar (neither vLLM 0.34's nor SGLang 0.5.23's): kept, never "
                            "migrated")
            o.deployment = store_label(store)
            loose.append(o)
            continue
        label = deployment_label(store, ek.engine, ek.stem, scheme, sk.tenant)
        dep = deps.get(label)
        if dep is None:
            dep = deps[label] = Deployment(label, store, ek.engine, ek.stem, scheme, sk.tenant, ek.model,
                                           facts=facts_for(ek.model), prefix=ek.prefix, namespace=ek.namespace)
        label = dep.label  # (one string per deployment, not one per object)
        by_dep.setdefault(label, []).append(o)
        o.deployment = label
        o.rank, o.group = ek.rank, ek.group
        o.block_hash = _hash_bytes(ek.hash)
        o.block = (label, ek.group, ek.hash, shared.setdefault(ek.sub, ek.sub))
        o.key_rank = shared.setdefault((ek.rank, ek.half), (ek.rank, ek.half))
        o.mla = ek.mla
    return by_dep, loose


class _Held:
    """What holds each key of a store as a 0.3.14 client registers it (a raw `K` as
    `default\\0K`, §2.1), and which file sits at each KVEntry path (§3.5)."""

    def __init__(self) -> None:
        self.by_key: dict[bytes, list[StoreFile]] = defaultdict(list)
        self.by_path: dict[str, StoreFile] = {}

    @classmethod
    def of(cls, entries: list[StoreFile]) -> _Held:
        held = cls()
        for e in entries:
            if e.kind == "kventry":
                held.by_path[e.relpath] = e
            if e.object_key is not None:
                held.by_key[registered_key(e)].append(e)
        return held


def _storage(o: StoreFile) -> M.StorageKey:
    """An object's storage key split (parsed when asked: a parse kept per object would
    hold its engine key twice)."""
    return M.parse_storage_key(o.object_key or b"")


def registered_key(o: StoreFile) -> bytes:
    """The key a >= 0.3.12 client registers an entry under: a raw `K` as `default\\0K` (§2.1)."""
    key = o.object_key or b""
    return key if b"\0" in key else _DEFAULT_SCOPE + key  # (M.scoped of the key's text: the same bytes)


_DEFAULT_SCOPE = M.scoped("")  # `default\0`


def path_holder(e: StoreFile, fsdir: str) -> StoreFile | None:
    """What partitions other than its own must see of an `ok` KVEntry: nothing when it sits
    at fpk of its own key and that key parses, since a target path another block names is
    then never its path (sanitizing keeps `@`, hex digits and SGLang's key tail, so two
    parsing keys of one fpk path share their block hash, hence their partition). Else its
    path alone: `_settle_targets` finds an occupied path by it; by key it is no other
    partition's target (a key of another hash, or of no grammar)."""
    key = e.object_key or b""
    if (parse_engine_key(M.parse_storage_key(key).engine) is not None
            and _client_rel(e.client, M.fpk(key, fsdir)) == e.relpath):
        return None
    return StoreFile(e.relpath, e.client, e.kind, e.size)


def _same_value(a: StoreFile, b: StoreFile) -> bool:
    """Same value bytes as far as the scan read them: the size, and the hash when both were
    hashed (--verify hash)."""
    size_a = a.value_size if a.value_size is not None else a.size
    size_b = b.value_size if b.value_size is not None else b.size
    return size_a == size_b and (a.payload is None or b.payload is None or a.payload == b.payload)


def _serves(h: StoreFile, key: bytes, fsdir: str) -> bool:
    """Whether a read of `key` returns `h`'s value: a whole entry stored under that very key
    (a raw one is never read), no other entry registering it, a KVEntry at fpk(key)."""
    return (h.object_key == key and h.status == "ok" and not h.duplicate and
            (h.kind == "object" or h.relpath == _client_rel(h.client, M.fpk(key, fsdir))))


def _location(h: StoreFile) -> str:
    """A row's `target_relpath` for an object found at `h`: a bucket entry's client root, a
    KVEntry's path."""
    return _client_root(h.client) if h.kind == "object" else h.relpath


def _settle_targets(keyed: list[StoreFile], held: _Held, fsdir: str) -> None:
    """§3.5 for the rekeys and links of a store, which never overwrite: a target key (or a
    KVEntry's target path) another object holds with this value makes the source
    `already_present` there (prune --migrated takes it later); held otherwise, `none` with
    the finding `target_occupied`. Sources sharing one target key: the first by (relpath,
    index) is planned, each other one is `already_present` after it (the same value) or
    `target_occupied` (another value)."""
    first: dict[bytes, StoreFile] = {}
    for o in sorted(keyed, key=lambda o: (o.relpath, -1 if o.object_index is None else o.object_index)):
        if o.action not in ("rekey", "link") or o.target_key is None:
            continue
        key, action = o.target_key, o.action
        others: list[StoreFile] = []
        if action == "rekey" and o.kind != "kventry":  # (a link adds no registration: the misfiled entry has
            # the key already; a KVEntry is read at fpk of its key only, so copies elsewhere never collide, §1.3)
            others = [h for h in held.by_key.get(key, ()) if h is not o and
                      not (h.action == "rekey" and h.target_key != key)]  # (one renamed away frees the key)
        at = held.by_path.get(o.target or "") if o.kind == "kventry" else None
        if at is not None and at is not o and all(at is not h for h in others):
            others.append(at)
        if others:
            serving = next((h for h in others if _serves(h, key, fsdir) and _same_value(h, o)), None)
            if serving is not None:
                o.action, o.target = "already_present", _location(serving)
                o.reason = (f"the target key is already served by {serving.relpath}" +
                            (f"[{serving.object_index}]" if serving.object_index is not None else "") +
                            " with this value: this object is a copy (prune --migrated takes it)")
            else:
                h = others[0]
                o.action = "none"
                o.reason = fd.reason(f"the target key (or its path) is held by {h.relpath}" +
                                     (f"[{h.object_index}]" if h.object_index is not None else "") +
                                     " with other bytes: never overwritten", fd.TARGET_OCCUPIED,
                                     aliases_relpath=h.relpath, of_action=action)
            continue
        prior = first.get(key)
        if prior is None:
            first[key] = o
        elif _same_value(prior, o):
            o.action, o.target = "already_present", prior.target
            o.reason = (f"{prior.relpath}" + (f"[{prior.object_index}]" if prior.object_index is not None else "")
                        + f" is {prior.action}ed to the same target key with this value: this object is a copy")
        else:
            o.action = "none"
            o.reason = fd.reason(f"{prior.relpath} is {prior.action}ed to the same target key with other bytes: "
                                 "never planned twice", fd.TARGET_OCCUPIED, aliases_relpath=prior.relpath,
                                 of_action=action)


def _client_root(client: str) -> str:
    """A client root's own target path (`_client_rel(client, "")`), one string per client
    root however many objects name it."""
    return sys.intern(_client_rel(client, ""))


def _client_rel(client: str, rel: str) -> str:
    """A path inside a client root, from ROOT (a client root's own: ending in `/`)."""
    if not client:
        return rel or "./"
    return f"{client}/{rel}" if rel else f"{client}/"


def _duplicates(objs: list[StoreFile]) -> None:
    """One key registered by two live entries of a store: both registered, every read fails
    (§1.4); values that differ are `replica_mismatch`. Keys compare as a >= 0.3.12 client
    registers them: a raw `K` and `default\0K` are one key (§2.1)."""
    by_key: dict[bytes, list[StoreFile]] = defaultdict(list)
    for o in objs:
        if o.object_key is not None and o.kind == "object":
            by_key[registered_key(o)].append(o)
    for copies in by_key.values():
        if len(copies) < 2:
            continue
        values = {(o.size, o.payload) for o in copies}
        differ = len(values) > 1
        where = ", ".join(f"{o.relpath}[{o.object_index}]" for o in copies)
        if len({o.object_key for o in copies}) > 1:
            where += "; a raw key registers as tenant default"
        for o in copies:
            if o.status != "ok":
                continue
            o.duplicate = True
            o.status = "replica_mismatch" if differ else o.status
            o.reason = (f"one key in {len(copies)} live entries ({where})" +
                        (" with different values: every read of it fails" if differ else
                         ": every read of it fails until one is retired"))


FAMILY = Mooncake()
