"""Prune rules of store families (Mooncake stores, spec mooncake.md §6, §5.1), on top of
`prune.py`'s machinery (migration.md §6 unchanged).

A store is not a namespace of block files: a bucket object is an entry of a live pair
(`<id>.meta` + `<id>.bucket`), so a pair is moved whole or not at all (the *container
rule*: `.meta` first, and only when every entry it lists is selected; restore walks the
moves backwards, `.bucket` first), and a client root folder is never removed. The classes:

    migrated               KVEntries a rescan finds `already_present` at another path (a raw
                           entry whose scoped one is in place, a misfiled copy whose fpk(key)
                           holds it); pairs all of whose entries are superseded
    residue                orphan_data, corrupt_sidecar (with its .bucket), orphan_index, a
                           misfiled .meta, tmp_leftover older than --older-than, KVEntry files
                           that are short, header_invalid or zero_filled; never an entry of a
                           live pair, never a misfiled KVEntry (migrate relinks it)
    tails                  `short` entries of live pairs: their keys retired by an index
                           rewrite (nothing freed: is_exist stops claiming them); a pair with
                           no readable entry left is moved whole
    unreadable_namespaces  deployments all of whose objects are stale_hash_recipe (whole
                           pairs only)

A quarantined store file is `<quarantine>/<relpath>.kvmq`: a starting client deletes any
`.bucket` below its root without a top-level `.meta`, and ROOT may itself be a client root.
The quiet period is the store's (its client roots' top-level files and fsdir leaf folders).
Nothing of a store is written without a proof that no client runs (§5.1, `take_proofs`): a
held client flock of every bucket client root written (writer_release >= 0.3.14 stated),
or `engine_stopped` stated; taken before the journal. The crash seam's point of a retire
is `prune_retire`.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvmigrate import families
from kvmigrate.errors import KvMigrateError, UsageError
from kvmigrate.formats import mooncake as M

LAYOUT = "stores"  # Family.root_layout of a store family
QUARANTINE_SUFFIX = ".kvmq"  # a quarantined store file's name ends so: no client adopts or deletes it
PAIR_RESIDUE = ("orphan_data", "corrupt_sidecar", "orphan_index")
KVENTRY_RESIDUE = ("short", "header_invalid", "zero_filled")  # each stops the client from starting
STALE = ("stale_hash_recipe",)
STATUSES = (*PAIR_RESIDUE, *KVENTRY_RESIDUE, "misfiled", "tmp_leftover", *STALE)  # what a class may take
NEVER = ("foreign", "own_artifact", "unsupported_layout")
ORDER = ("migrated", "unreadable_namespaces", "residue", "tails")  # a pair's class: its entries' first


@dataclass
class Stores:
    """The store namespaces of a manifest (its metadata): namespace -> store, each store's
    own namespace, client roots, fsdir and what its deployments' facts state."""

    store_of: dict[str, str] = field(default_factory=dict)
    label_of: dict[str, str] = field(default_factory=dict)  # store -> its own namespace (`mooncake:<store>`)
    clients: dict[str, list[str]] = field(default_factory=dict)  # store -> client roots ('' for ROOT)
    fsdir: dict[str, str] = field(default_factory=dict)
    stopped: dict[str, bool] = field(default_factory=dict)  # store -> engine_stopped stated (a deployment's fact)
    flock: dict[str, bool] = field(default_factory=dict)  # store -> writer_release >= 0.3.14 stated

    @classmethod
    def of(cls, meta: dict[str, Any]) -> Stores:
        out = cls()
        releases: dict[str, list[Any]] = {}
        for ns, m in (meta.get("namespaces") or {}).items():
            if families.get(m.get("family")).root_layout != LAYOUT:
                continue
            cfg = m.get("config_json") or {}
            store = str(cfg.get("store") or ".")
            out.store_of[ns] = store
            facts = m.get("facts") or {}
            if cfg.get("client_roots") is not None:  # the store's own namespace
                out.label_of[store] = ns
                out.clients[store] = ["" if c == "." else str(c) for c in cfg["client_roots"]]
                continue
            out.stopped[store] = out.stopped.get(store, False) or facts.get("engine_stopped") is True
            out.fsdir.setdefault(store, str(facts.get("fsdir") or M.DEFAULT_FSDIR))
            releases.setdefault(store, []).append(facts.get("writer_release"))
        for store, rel in releases.items():
            out.flock[store] = M.lock_proves(rel)
        return out

    def __bool__(self) -> bool:
        return bool(self.store_of)

    def client_of(self, store: str, relpath: str) -> str:
        """The client root a file of the store is under (the deepest one holding it)."""
        best = ""
        for c in self.clients.get(store, []):
            if (not c or relpath.startswith(c + "/")) and len(c) >= len(best):
                best = c
        return best

    def members(self, store: str) -> list[str]:
        return sorted(ns for ns, s in self.store_of.items() if s == store)

    def where(self, ns: str, relpath: str) -> tuple[str, str, bool]:
        """(the store of a file of namespace `ns`, its client root, whether it is a
        KVEntry: a file of the fsdir's `<fsdir>/<a>/<b>/<file>` leaf folders)."""
        store = self.store_of.get(ns, ".")
        client = self.client_of(store, relpath)
        inner = relpath[len(client) + 1:] if client else relpath
        return store, client, inner.startswith(self.fsdir.get(store, M.DEFAULT_FSDIR) + "/") and inner.count("/") == 3

    def kept(self, ns: str, relpath: str) -> str:
        """The deepest folder never removed when a file of the store goes: its client root
        (a KVEntry's: the client root's fsdir)."""
        store, client, kventry = self.where(ns, relpath)
        return _join(client, self.fsdir.get(store, M.DEFAULT_FSDIR)) if kventry else client

    def move_key(self, ns: str, relpath: str) -> str:
        """The files that move together: a pair's `.meta` and `.bucket` at the top of their
        client root; any other file alone."""
        _, client, _ = self.where(ns, relpath)
        name = relpath.rsplit("/", 1)[-1]
        if relpath == _join(client, name) and name.endswith((M.META_SUFFIX, M.BUCKET_SUFFIX)):
            return "pair:" + relpath.rsplit(".", 1)[0]
        return relpath


def _join(client: str, name: str) -> str:
    return f"{client}/{name}" if client else name


@dataclass
class Retire:
    """Entries of one live `.meta` whose keys a `--tails` prune retires (§5.2's rewrite)."""

    store: str
    meta: str  # relpath of the `.meta`
    client: str
    keys: dict[int, bytes]  # entry -> its key as scanned
    namespaces: dict[int, str]  # entry -> its deployment
    dev: int = 0
    inode: int = 0
    size: int = 0
    mtime_ns: int = 0


@dataclass
class StoreSelection:
    """What the store classes take: file rows per class (manifest row numbers), the
    retires, and per row what it carries (objects no longer served, its move key, the
    folder kept when it goes)."""

    rows: dict[str, list[int]] = field(default_factory=dict)
    retires: list[Retire] = field(default_factory=list)
    objects: dict[int, int] = field(default_factory=dict)  # row -> objects no longer served once it goes
    key: dict[int, str] = field(default_factory=dict)  # row -> the files that move together (a pair)
    keep: dict[int, str] = field(default_factory=dict)  # row -> the deepest folder never removed
    target: dict[int, int] = field(default_factory=dict)  # a migrated KVEntry's row -> its target's row


_SEL_COLUMNS = ("relpath", "source_base", "status", "action", "finding", "target_relpath", "target_base",
                "object_index", "object_key", "target_key", "mtime_ns", "dev", "inode", "size")


def select(c: dict[str, Any], is_store: Any, stores: Stores, classes: tuple[str, ...], tmp_cutoff_ns: int,
           journal_targets: set[str], used: set[str]) -> StoreSelection:
    """The store rows each class takes (before the run-time checks: quiet period, a fresh
    stat, the proofs), under the container rule."""
    import pyarrow.compute as pc

    idx = pc.indices_nonzero(is_store).to_pylist()
    out = StoreSelection()
    if not idx:
        return out
    r: dict[str, list[Any]] = {k: (pc.take(c[k], idx).to_pylist() if c.get(k) is not None else [None] * len(idx))
                               for k in _SEL_COLUMNS}
    rel, src, status = r["relpath"], r["source_base"], r["status"]
    files: dict[str, int] = {}
    entries: dict[str, list[int]] = {}
    for j in range(len(idx)):
        if r["object_index"][j] is None:
            files[rel[j]] = j
        else:
            entries.setdefault(rel[j], []).append(j)
    named = {t for j, t in enumerate(r["target_relpath"]) if t and t != rel[j]}  # files some row targets
    other_targets = {tb for j, tb in enumerate(r["target_base"]) if tb and tb != src[j]} | set(journal_targets)
    chosen: dict[int, str] = {}  # file row -> class
    picked: dict[int, str] = {}  # object row -> class

    def free(j: int) -> bool:
        return status[j] not in NEVER and rel[j] not in named

    def is_kventry(j: int) -> bool:
        return stores.where(src[j], rel[j])[2]

    if "migrated" in classes:
        for p, j in files.items():
            t = r["target_relpath"][j]
            if r["object_key"][j] is None or r["action"][j] != "already_present" or not t or t == p:
                continue
            k = files.get(t)
            if status[j] in ("ok", "misfiled") and k is not None and status[k] == "ok" and \
                    r["target_relpath"][k] == t and free(j):
                chosen[j] = "migrated"
                out.target[idx[j]] = idx[k]  # re-checked before the move: never the last copy
        for js in entries.values():
            for j in js:
                key, tkey = r["object_key"][j], r["target_key"][j]
                if r["finding"][j] == "superseded" or (r["action"][j] == "already_present" and tkey is not None
                                                       and key is not None and tkey != key):
                    picked[j] = "migrated"
    if "unreadable_namespaces" in classes:
        deps: dict[str, list[int]] = {}
        for j in range(len(idx)):
            if src[j] not in stores.label_of.values():
                deps.setdefault(src[j], []).append(j)
        for ns, js in deps.items():
            if ns in other_targets or ns in used or not all(status[j] in STALE for j in js):
                continue
            for j in js:
                if r["object_index"][j] is None:
                    if free(j):
                        chosen.setdefault(j, "unreadable_namespaces")
                else:
                    picked.setdefault(j, "unreadable_namespaces")
    if "residue" in classes:
        for p, j in files.items():
            name = p.rsplit("/", 1)[-1]
            if not free(j):
                continue
            take = status[j] in PAIR_RESIDUE or (
                status[j] == "misfiled" and r["object_key"][j] is None and name.endswith(M.META_SUFFIX)) or (
                status[j] == "tmp_leftover" and (r["mtime_ns"][j] or 0) <= tmp_cutoff_ns) or (
                status[j] in KVENTRY_RESIDUE and is_kventry(j))
            if take:
                chosen.setdefault(j, "residue")
    if "tails" in classes:
        for js in entries.values():
            for j in js:
                key = r["object_key"][j]
                if status[j] == "short" and key is not None and \
                        M.parse_retired_key(M.parse_storage_key(key).engine) is None:
                    picked.setdefault(j, "tails")
    # the container rule: a live pair goes whole, only when every entry of it is taken
    for meta, js in entries.items():
        got = [picked.get(j) for j in js]
        bucket = meta[: -len(M.META_SUFFIX)] + M.BUCKET_SUFFIX
        m, b = files.get(meta), files.get(bucket)
        if all(got) and m is not None and b is not None and free(m) and free(b):
            cls = min(got, key=lambda x: ORDER.index(x or "tails")) or "tails"
            chosen[m] = chosen[b] = cls
            out.objects[idx[m]] = len(js)
            continue
        tails = {r["object_index"][j]: j for j, g in zip(js, got) if g == "tails"}
        if tails and m is not None:
            store = stores.store_of.get(src[m], ".")
            out.retires.append(Retire(store, meta, stores.client_of(store, meta),
                                      {i: r["object_key"][j] for i, j in sorted(tails.items())},
                                      {i: src[j] for i, j in tails.items()}, r["dev"][m] or 0, r["inode"][m] or 0,
                                      r["size"][m] or 0, r["mtime_ns"][m] or 0))
    for j, cls in chosen.items():
        row = idx[j]
        out.rows.setdefault(cls, []).append(row)
        out.key[row] = stores.move_key(src[j], rel[j])
        out.keep[row] = stores.kept(src[j], rel[j])
        if is_kventry(j):
            out.objects.setdefault(row, int(r["object_key"][j] is not None))
    return out


def move_order(relpath: str) -> int:
    """A pair's `.meta` moves before its `.bucket` (a start then sees no index, or the
    whole pair); restore walks the moves backwards, `.bucket` first."""
    return 0 if relpath.endswith(M.META_SUFFIX) else 1


def units(c: dict[str, Any], stores: Stores, names: set[str]) -> dict[str, tuple[list[str], list[str], int]]:
    """The quiet-period units of the store namespaces among `names`: the store's own label
    -> (every namespace of the store, its fsdir leaf folders, the newest mtime of its client
    roots' top-level files in the manifest; kvmigrate's own and foreign files do not count).
    A client root folder's own mtime does not: a prune's moves change it, an engine's new
    pair is a new top-level file."""
    wanted = {stores.store_of[ns] for ns in names if ns in stores.store_of}
    if not wanted:
        return {}
    out = empty_units(stores, wanted)
    fold_units(out, stores, wanted, c)
    return {label: (ms, sorted(f), n) for label, (ms, f, n) in out.items()}


def empty_units(stores: Stores, wanted: set[str]) -> dict[str, tuple[list[str], set[str], int]]:
    """Each wanted store's unit before any row: its label -> (its namespaces, no folder, 0)."""
    return {stores.label_of.get(store, store): (stores.members(store), set(), 0) for store in wanted}


def fold_units(out: dict[str, tuple[list[str], set[str], int]], stores: Stores, wanted: set[str],
               c: dict[str, Any]) -> None:
    """Fold the rows of `c` (columns source_base, relpath, mtime_ns, status) into the units
    of the `wanted` stores."""
    import pyarrow as pa
    import pyarrow.compute as pc

    members = [ns for ns, s in stores.store_of.items() if s in wanted]
    mask = pc.and_(pc.fill_null(pc.is_in(c["source_base"], value_set=pa.array(sorted(members), c["source_base"].type)),
                                False),
                   pc.invert(pc.fill_null(pc.is_in(c["status"], value_set=pa.array(["own_artifact", "foreign"],
                                                                                   c["status"].type)), False)))
    t = pa.table({"ns": c["source_base"], "rel": c["relpath"], "mtime": pc.fill_null(c["mtime_ns"], 0)}).filter(mask)
    for ns, rel, mtime in zip(*(t[k].to_pylist() for k in ("ns", "rel", "mtime"))):
        store = stores.store_of[ns]
        label = stores.label_of.get(store, store)
        ms, folders, newest = out[label]
        client = stores.client_of(store, rel)
        inner = rel[len(client) + 1:] if client else rel
        if "/" not in inner:
            newest = max(newest, mtime)
        elif inner.startswith(stores.fsdir.get(store, M.DEFAULT_FSDIR) + "/") and inner.count("/") == 3:
            folders.add(rel.rsplit("/", 1)[0])
        out[label] = (ms, folders, newest)


# --- the proofs (§5.1) ---------------------------------------------------------------------------


@dataclass
class StoreProof:
    """What writing one store needs: its client roots written through bucket files (a
    client lock proves them stopped when 0.3.14 is stated) and through KVEntries (only the
    engine_stopped statement does)."""

    store: str
    bucket_clients: set[str] = field(default_factory=set)
    kventry_clients: set[str] = field(default_factory=set)
    stopped: bool = False
    flock: bool = False

    @property
    def proof(self) -> str | None:
        if self.stopped:
            return "engine_stopped"
        if self.flock and not self.kventry_clients:
            return "flock"
        return None


def proofs(items: Iterable[Any], retires: list[Retire], stores: Stores, engine_stopped: bool) -> dict[str, StoreProof]:
    """Per store the plan writes, what its proof is: the client roots of its files among
    the items (written through bucket files or KVEntries) and of the retires."""
    out: dict[str, StoreProof] = {}

    def of(store: str) -> StoreProof:
        if store not in out:
            out[store] = StoreProof(store, stopped=engine_stopped or stores.stopped.get(store, False),
                                    flock=stores.flock.get(store, False))
        return out[store]

    for item in items:
        if item.namespace not in stores.store_of:
            continue
        store, client, kventry = stores.where(item.namespace, item.relpath)
        (of(store).kventry_clients if kventry else of(store).bucket_clients).add(client)
    for rw in retires:
        of(rw.store).bucket_clients.add(rw.client)
    return out


def describe(proof_of: dict[str, StoreProof]) -> list[str]:
    """The dry run's lines: the proof the apply needs per store."""
    lines = []
    for store, p in sorted(proof_of.items()):
        if p.proof == "flock":
            lines.append(f"  Mooncake store {store}: the apply takes the Mooncake 0.3.14 client lock of each client "
                         "root it writes (a held lock: exit 8, nothing moved)")
        elif p.proof == "engine_stopped":
            lines.append(f"  Mooncake store {store}: no client uses it (engine_stopped stated); the apply also takes "
                         "the client lock of each bucket client root it writes")
        else:
            lines.append(f"  Mooncake store {store}: the apply needs a proof that no Mooncake client uses it: stop "
                         "the engines and pass --engine-stopped (or state writer_release >= 0.3.14 for a bucket "
                         "store)")
    return lines


def take_proofs(root: str, proof_of: dict[str, StoreProof]) -> list[Any]:
    """Every proof of every store before anything is written (§5.1): no proof → exit 2
    naming the store and --engine-stopped; a held client lock → exit 8 (the locks taken so
    far released). Returns the client locks held (release them when done)."""
    from kvmigrate.migrate import mooncake_store as MS

    missing = sorted(s for s, p in proof_of.items() if p.proof is None)
    if missing:
        raise UsageError(f"Mooncake store {missing[0]}: no proof that its clients are stopped; nothing was moved"
                         + (f" (and {len(missing) - 1} more stores)" if len(missing) > 1 else ""),
                         path=os.path.join(root, missing[0]) if missing[0] != "." else root,
                         hint="stop every engine using the store and rerun with --engine-stopped (or state "
                              "writer_release >= 0.3.14 for a bucket store: its client lock then proves it)")
    locks: list[Any] = []
    try:
        for _, p in sorted(proof_of.items()):
            for client in sorted(p.bucket_clients):
                locks.append(MS.hold_client_lock(os.path.join(root, client) if client else root))
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


def own_locks(root: str, proof_of: dict[str, StoreProof]) -> list[str]:
    """kvmigrate's `.kvmigrate.lock` (holder pid inside) in each client root the run
    writes; the paths it made (removed at the end of the run, `drop_own_locks`)."""
    from kvmigrate.migrate.stores import OWN_LOCK

    made = []
    for p in proof_of.values():
        for client in sorted(p.bucket_clients | p.kventry_clients):
            path = os.path.join(root, client, OWN_LOCK) if client else os.path.join(root, OWN_LOCK)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                continue  # (a killed run's: removed at the end of this one)
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()}\n")
            made.append(path)
    return made


def drop_own_locks(root: str, clients: list[str]) -> None:
    """Remove kvmigrate's `.kvmigrate.lock` of these client roots (the end of a run a kill
    interrupted: its locks were left)."""
    from kvmigrate.migrate.stores import OWN_LOCK

    for client in clients:
        path = os.path.join(root, client, OWN_LOCK) if client else os.path.join(root, OWN_LOCK)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def lock_clients(root: str, clients: list[str]) -> list[Any]:
    """The client locks of journaled bucket client roots (a restore or a resumed run
    writes them again): a held one → exit 8, the others released."""
    return take_proofs(root, {"": StoreProof("", bucket_clients=set(clients), stopped=True)}) if clients else []


# --- the retires (§5.2's index rewrite) ----------------------------------------------------------


def backup_path(run_id: str, meta: str) -> str:
    """A retired index's original, relative to ROOT (migrate's backup folder, this run's)."""
    from kvmigrate.migrate.stores import BACKUP_DIR

    return os.path.join(BACKUP_DIR, run_id, meta + ".orig")


def retire_intent(root: str, rw: Retire, run_id: str) -> dict[str, Any] | str:
    """The journal record of a retire, planned against the index as it is now: its
    original and new XXH3 (the new bytes are the original's with the retired keys), or why
    it is kept (changed since the scan, does not round-trip)."""
    from kvmigrate.migrate import mooncake_store as MS

    path = os.path.join(root, rw.meta)
    try:
        st = os.lstat(path)
        data = MS._read(path)
        meta = M.decode_meta(data)
    except (OSError, M.DecodeError, KvMigrateError) as exc:  # (OperationalError: not a regular file)
        return f"{path}: {exc}; kept"
    if (st.st_ino, st.st_size, st.st_mtime_ns) != (rw.inode, rw.size, rw.mtime_ns) or any(
            i >= len(meta.keys) or meta.keys[i] != k for i, k in rw.keys.items()):
        return f"{path}: changed since the scan; kept"
    if M.encode_meta(meta) != data:
        return f"{path}: index does not round-trip; its keys are not retired"
    new_keys = {i: M.retired_key(k, run_id) for i, k in rw.keys.items()}
    keys = list(meta.keys)
    for i, k in new_keys.items():
        keys[i] = k
    new = M.encode_meta(M.BucketMeta(meta.data_size, tuple(keys), meta.objects))
    return {"t": "mc_retire", "store": rw.store, "meta": rw.meta, "client": rw.client,
            "keys": {str(i): k.hex() for i, k in new_keys.items()}, "old": MS.xxh3_hex(data), "new": MS.xxh3_hex(new),
            "backup": backup_path(run_id, rw.meta), "objects": len(new_keys),
            "namespaces": {str(i): rw.namespaces.get(i, "") for i in new_keys}}


def do_retire(root: str, rec: dict[str, Any], step: Any) -> str:
    """Apply a journaled retire: `done` (this call, or before a kill: the index holds the
    new bytes), else `kept` with why (the index is neither the original nor the new)."""
    from kvmigrate.migrate import mooncake_store as MS

    path = os.path.join(root, rec["meta"])
    now = MS._hash_or_none(path)
    if now == rec["new"]:
        return "done"
    if now != rec["old"]:
        return "kept"
    client = os.path.join(root, rec["client"]) if rec["client"] else root
    MS.rewrite_index(client, os.path.basename(rec["meta"]), {int(i): bytes.fromhex(k) for i, k in rec["keys"].items()},
                     os.path.join(root, rec["backup"]), MS.stage_path(client), expect_xxh3=rec["old"], step=step)
    step("prune_retire")
    return "done"


def clear_stages(root: str, clients: set[str]) -> None:
    from kvmigrate.migrate import mooncake_store as MS

    for client in sorted(clients):
        MS.clear_stage(MS.stage_path(os.path.join(root, client) if client else root))


def undo_retire(root: str, rec: dict[str, Any]) -> tuple[str, str | None]:
    """Put a retired index's original back: (`restored`, `in_place` or `kept`, why)."""
    from kvmigrate.migrate import mooncake_store as MS

    path = os.path.join(root, rec["meta"])
    if MS._hash_or_none(path) == rec["old"]:
        return "in_place", None
    client = os.path.join(root, rec["client"]) if rec["client"] else root
    got = MS.restore_index(path, os.path.join(root, rec["backup"]), rec["new"], MS.stage_path(client))
    if got == "restored":
        MS.clear_stage(MS.stage_path(client))
        return "restored", None
    return "kept", (f"{path}: changed since the prune retired its keys (or its backup is gone); left in place "
                    f"(its original is {os.path.join(root, rec['backup'])})")


def objects_of(counter: Counter, cls: str, n: int) -> None:
    if n:
        counter[cls] += n
