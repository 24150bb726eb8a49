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

This step plans what needs no target facts: a whole object of a complete block is
`already_present` when the target (mooncake-0.3.14, the writer's deployment) looks up its
very key, `rekey` when only its scoping differs (a raw key under >= 0.3.12), and a misfiled
KVEntry is `link`ed to `fpk(key)`. Migrate does not execute Mooncake actions yet
(docs/mooncake.md).
"""

from __future__ import annotations

import os
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmigrate import families
from kvmigrate.formats import mooncake as M
from kvmigrate.identity.facts import Facts
from kvmigrate.identity.vllm_target import Target

PROFILE = "mooncake-0.3.14"  # §0: tenant-scoped keys, the client lock
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
    files: list[StoreFile] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    facts: Facts = field(default_factory=Facts)

    @property
    def fields(self) -> dict[str, Any]:
        return {"family": "mooncake", "store": self.store, "engine": self.engine, "stem": self.stem,
                "scheme": self.scheme, "tenant": self.tenant, "model": self.model, "kv_kind": self.kv_kind,
                "key_ranks": self.key_ranks, "deployment": self.label, "target_label": self.target_label}

    @property
    def target_label(self) -> str:
        """The target's deployment: the writer's, its keys scoped as 0.3.14 looks them up."""
        return deployment_label(self.store, self.engine, self.stem, "mc-scoped", self.tenant or M.DEFAULT_TENANT)


def deployment_label(store: str, engine: str, stem: str, scheme: str, tenant: str | None) -> str:
    label = f"mooncake:{store}:{engine}:{stem}:{scheme}"
    return label + (f":tenant={tenant}" if tenant is not None and tenant != M.DEFAULT_TENANT else "")


def store_label(store: str) -> str:
    """The namespace of a store's own files (containers, the lock, foreign files)."""
    return f"mooncake:{store}"


@dataclass(frozen=True)
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


def parse_engine_key(key: str) -> EngineKey | None:
    v = M.parse_vllm_key(key)
    if v is not None:
        return EngineKey("vllm", v.stem, v.model, v.group, v.hash, (v.pcp, v.dcp, v.pp_rank), v.tp_rank, "", None)
    s = M.parse_sglang_key(key)
    if s is not None:
        if not s.ranks:  # `__k`: MLA, pp 1
            return EngineKey("sglang", s.stem, s.prefix, 0, s.page_hash, (0,), 0, s.half, True)
        pp = s.ranks[1] if len(s.ranks) > 1 else 0
        return EngineKey("sglang", s.stem, s.prefix, 0, s.page_hash, (pp,), s.ranks[0], s.half, None)
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

    def holds_store(self, path: str) -> bool:
        return holds_store(path)

    def root_store_entries(self, root: str, files: list[str], folders: list[str],
                           fsdir: str = M.DEFAULT_FSDIR) -> set[str]:
        """The top-level names of ROOT that belong to a store at ROOT itself (none: ROOT is
        no store): its pair files, the client lock, the fsdir, kvmigrate's stage and lock,
        and its rank client roots."""
        ranks = set(rank_client_roots(root, fsdir))
        if not is_client_root(root, fsdir):
            return ranks
        keep = {n for n in files if n.endswith((M.META_SUFFIX, M.BUCKET_SUFFIX)) or n in (M.LOCK_NAME, OWN_LOCK)}
        keep |= {n for n in folders if n in (fsdir, STAGE_DIR)}
        return keep | ranks

    def target(self, fields: dict, facts: Facts, profile: str) -> Target:
        """The target deployment's label; the objects' actions are the rows' (§3.3)."""
        label = str(fields.get("target_label") or fields.get("deployment") or "")
        return Target(profile=PROFILE, family=self.name, fields=None, d12=None, base_name=label or None,
                      rank_dir=None, parallel_agnostic=False, replicated_layout=False, reasons=[])

    def target_profile(self, profile: str) -> str:
        return PROFILE

    def flat_target(self, source_base: str, fields: Mapping[str, Any]) -> str:
        return str(fields.get("target_label") or source_base)

    # --- verdicts (§1.4, §2.4, §3, §4) ------------------------------------------------

    def classify_store(self, store: str, files: list[StoreFile], objects: list[StoreFile],
                       facts_for: Callable[[str | None], Facts], fsdir: str = M.DEFAULT_FSDIR
                       ) -> tuple[list[Deployment], list[StoreFile]]:
        """(the deployments of a store, with their objects and KVEntries; the store's own
        files: containers, the lock, foreign files). `files` already carry the container
        statuses the scan gave them (§1.4); `objects` are the entries of live indexes."""
        deps: dict[str, Deployment] = {}
        loose = [f for f in files if f.kind != "kventry" or f.status != "ok"]
        keyed = objects + [f for f in files if f.kind == "kventry" and f.status == "ok"]
        store_facts = facts_for(None)
        for o in keyed:
            sk = M.parse_storage_key(o.object_key or b"")
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
                                               facts=facts_for(ek.model))
            dep.files.append(o)
            o.deployment = label
            o.rank, o.group = ek.rank, ek.group
            o.block_hash = _hash_bytes(ek.hash)
            o.block = (label, ek.group, ek.hash, ek.sub)
            o.key_rank = (ek.rank, ek.half)
        _duplicates(keyed)
        # KVEntries of the store at fpk of their own key (whole): a rekey or link whose target one holds is done
        in_place = {o.relpath for o in keyed if o.kind == "kventry" and o.status == "ok" and
                    _client_rel(o.client, M.fpk(o.object_key or b"", fsdir)) == o.relpath}
        for dep in deps.values():
            self._classify_deployment(dep, fsdir, store_facts, in_place)
        return sorted(deps.values(), key=lambda d: d.label), loose

    def _classify_deployment(self, dep: Deployment, fsdir: str, store_facts: Facts, in_place: set[str]) -> None:
        objs = dep.files
        kind = dep.facts.kv_kind
        if dep.engine == "sglang":
            mla = any(o.key_rank == (0, "k") and o.block is not None and _is_mla_key(o) for o in objs)
            kind = kind or ("mla" if mla else "full" if any(o.key_rank[1] == "v" for o in objs) else None)
        else:
            top = max((o.key_rank[0] for o in objs), default=0)
            kind = kind or ("full" if top > 0 else None)
        dep.kv_kind = kind
        writer_tp = dep.facts.writer_tp if isinstance(getattr(dep.facts, "writer_tp", None), int) else None
        n_s = 1 + max((o.key_rank[0] for o in objs), default=0)
        dep.key_ranks = n_s
        halves = sorted({o.key_rank[1] for o in objs})
        subs = sorted({o.block[3] for o in objs if o.block is not None})
        universe = {(r, h) for r in range(n_s) for h in halves}
        sizes = Counter(o.size for o in objs if o.status == "ok")
        modal = sizes.most_common(1)[0][0] if sizes else None
        if writer_tp is not None:
            dep.notes.append(f"writer TP {writer_tp} stated")
        # per object: what its bytes alone prove (§2.4), in §4's order
        for o in objs:
            if o.status == "ok" and o.kind == "kventry" and not o.error:
                sk = M.parse_storage_key(o.object_key or b"")
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
        blocks: dict[tuple, list[StoreFile]] = defaultdict(list)
        for o in objs:
            if o.block is not None:
                blocks[o.block].append(o)
        del subs
        usable = ("ok", "misfiled")  # a misfiled KVEntry counts: it is relinked (§2.4)
        # (in_place: the store's KVEntries at their own fpk path; a misfiled copy of one is a harmless duplicate, §1.3)

        for objs_of in blocks.values():
            have = {o.key_rank for o in objs_of if o.status in usable}
            missing = universe - {o.key_rank for o in objs_of}
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
                self._action(o, dep, fsdir, in_place)

    def _action(self, o: StoreFile, dep: Deployment, fsdir: str, in_place: set[str]) -> None:
        """§3.3 for the target that is the writer's deployment read by Mooncake 0.3.14."""
        sk = M.parse_storage_key(o.object_key or b"")
        target_key = M.scoped(sk.engine, sk.tenant or M.DEFAULT_TENANT)
        o.target_key = target_key
        if o.kind == "kventry":
            want = _client_rel(o.client, M.fpk(target_key, fsdir))
            if sk.tenant is None and want in in_place:  # (prune --migrated takes this name)
                o.action, o.target = "already_present", want
                o.reason = "raw key: the entry at its scoped key's fpk serves it (a rekey's source)"
            elif sk.tenant is None:
                o.action, o.target = "rekey", want
                o.reason = ("raw key (Mooncake <= 0.3.11): 0.3.14 registers it as tenant default and never reads it; "
                            "rekey writes the entry at its scoped key")
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
        o.target = _client_rel(o.client, "")
        if sk.tenant is None:
            o.action = "rekey"
            o.reason = ("raw key (Mooncake <= 0.3.11): 0.3.14 registers it as tenant default and never reads it; "
                        "rekey rewrites its index entry to the scoped key")
        else:
            o.action = "already_present"
            o.reason = "read in place: the target looks up this key in this live index"


def _is_mla_key(o: StoreFile) -> bool:
    sk = M.parse_storage_key(o.object_key or b"")
    ek = parse_engine_key(sk.engine)
    return bool(ek is not None and ek.mla)


def _client_rel(client: str, rel: str) -> str:
    """A path inside a client root, from ROOT (a client root's own: ending in `/`)."""
    if not client:
        return rel or "./"
    return f"{client}/{rel}" if rel else f"{client}/"


def _duplicates(objs: list[StoreFile]) -> None:
    """One key in two live entries of a store: both registered, every read fails (§1.4);
    values that differ are `replica_mismatch`."""
    by_key: dict[bytes, list[StoreFile]] = defaultdict(list)
    for o in objs:
        if o.object_key is not None and o.kind == "object":
            by_key[o.object_key].append(o)
    for copies in by_key.values():
        if len(copies) < 2:
            continue
        values = {(o.size, o.payload) for o in copies}
        differ = len(values) > 1
        where = ", ".join(f"{o.relpath}[{o.object_index}]" for o in copies)
        for o in copies:
            if o.status != "ok":
                continue
            o.duplicate = True
            o.status = "replica_mismatch" if differ else o.status
            o.reason = (f"one key in {len(copies)} live entries ({where})" +
                        (" with different values: every read of it fails" if differ else
                         ": every read of it fails until one is retired"))


FAMILY = Mooncake()
