"""The rows of Mooncake stores (spec mooncake.md §1, §4): every file under a store the roots
phase recognised is stat-ed, each `.meta` at the top of a client root read and decoded, each
KVEntry's first bytes read for its key, and (--verify size/hash) each object's value read as
far as its verdict needs. What a starting client would do with each file (§1.4) is decided
here, where the files of one client root are seen together; the family module
(families/mooncake.py) groups the objects into deployments and blocks and gives them their
status and action.

Each deployment is a `Namespace` without base or rank folders; the store's own files
(indexes, buckets, the client lock, foreign files) belong to its namespace `mooncake:<store>`.
An object of a live index is a row of its own (`object_index`, `object_key`, `target_key`:
manifest version 4), written beside the file rows in part 0. The objects and KVEntries are
not held as records for the whole store: they go to temporary files as the indexes and
the file-per-key folders are read, and are judged and written a partition at a time
(scan/store_spill.py).
"""

from __future__ import annotations

import os
import stat as stat_mod
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import xxhash

from kvmigrate.families import mooncake as MC
from kvmigrate.formats import mooncake as M
from kvmigrate.fsio import CHUNK, errno_reason, kind_of, open_noatime
from kvmigrate.identity.facts import Facts, FactsResolver
from kvmigrate.scan import store_spill as S
from kvmigrate.scan.roots import Namespace, RootListing
from kvmigrate.scan.rows import rows_of

HEAD_BYTES = 8192
BATCH_ROWS = 8192  # rows of a store namespace made into one table at a time
META_MAX = 64 << 20  # a `.meta` lists at most 500 keys: one larger is never read into memory
StoreFile = MC.StoreFile


def resolve(root: str, listing: RootListing, resolver: FactsResolver, profile: str, verify: str) -> list[Namespace]:
    """The namespaces (deployments, and each store's own) of every store of the root."""
    out: list[Namespace] = []
    for store, fam in sorted(listing.stores.items()):
        fsdir = resolver.for_tier(store, None).fsdir or M.DEFAULT_FSDIR
        only = listing.store_entries if store == "." else None
        folder = S.SPILL.folder()
        with S.SPILL.writing(folder):
            spill = S.ObjectSpill(folder)
            entries = _Entries(spill, fsdir)
            loose, notes = walk_store(root, store, fsdir, verify, spill.add, entries.add, only)
            spill.partition()
            runs = S.Runs(folder)

            def facts_for(model: str | None, store: str = store) -> Facts:
                return resolver.for_tier(store, model, MC.facts_key_matches)

            deps = fam.classify_store(store, spill.partitions, runs.write, facts_for, fsdir, profile,
                                      entries.stray)
            spill.remove()
        for dep in deps:
            ns = _namespace(fam, dep.label, dep.model)
            ns.scheme, ns.model_name = dep.scheme, dep.model
            ns.family_evidence = [f"{dep.engine} keys ({dep.scheme}) in Mooncake store {store}"]
            ns.notes = list(dep.notes)
            ns.fields = dep.fields
            ns.facts = dep.facts
            ns.target = fam.target(ns.fields, Facts(), profile)
            ns.flat_rows = _StoreRows(runs, dep.label, [])
            out.append(ns)
        label = MC.store_label(store)
        ns = _namespace(fam, label, None)
        ns.family_evidence = [f"Mooncake store {store}: client roots, indexes and files of no deployment"]
        ns.fields = {"family": fam.name, "store": store, "deployment": label, **notes}
        ns.notes = list(notes.get("notes", ()))
        ns.flat_rows = _StoreRows(runs, label, loose)
        out.append(ns)
    return out


class _Entries:
    """A store's KVEntries as the walk meets them. The `ok` ones join its objects in the
    spill, partitioned by block like them, with walk ordinals after every object's (as
    if the objects came first); the others are the store's own rows. What every partition
    must see of them is `stray`: the others whole (they hold a path, and may hold a key),
    and the path of each `ok` one whose path another block's target may name
    (`MC.path_holder`)."""

    def __init__(self, spill: S.ObjectSpill, fsdir: str) -> None:
        self.spill, self.fsdir = spill, fsdir
        self.stray: S.Part = ([], [])
        self.met = 0

    def add(self, f: StoreFile) -> None:
        ordinal = S.ENTRY_ORDINALS + self.met
        self.met += 1
        holder: StoreFile | None = f
        if f.status == "ok":
            self.spill.add([f], ordinal)
            holder = MC.path_holder(f, self.fsdir)
        if holder is not None:
            self.stray[0].append(ordinal)
            self.stray[1].append(holder)


def _namespace(fam: Any, label: str, model: str | None) -> Namespace:
    ns = Namespace(label, model or "", "", has_base=False)
    ns.family = fam.name
    ns.deployment = label
    return ns


def client_roots(root: str, store: str, fsdir: str) -> list[str]:
    """The client roots of a store, as relpaths from ROOT ('' for ROOT itself), §1.1."""
    path = root if store == "." else os.path.join(root, store)
    prefix = "" if store == "." else store
    out = [prefix] if MC.is_client_root(path, fsdir) else []
    out += [f"{prefix}/{n}" if prefix else n for n in MC.rank_client_roots(path, fsdir)]
    return out


def walk_store(root: str, store: str, fsdir: str, verify: str, add: Callable[[list[StoreFile]], None],
               add_entry: Callable[[StoreFile], None], only: set[str] | None = None
               ) -> tuple[list[StoreFile], dict[str, Any]]:
    """(every file of the store but its `ok` KVEntries, what the store says: client roots,
    lock states, largest bucket id, notes); the objects of its live indexes go to `add`, an
    index's at a time, and every KVEntry, judged as a file, to `add_entry`, each in walk
    order. `only`: the top-level names of a store at ROOT (its other entries are the root's
    own)."""
    clients = client_roots(root, store, fsdir)
    files: list[StoreFile] = []
    locks: dict[str, str] = {}
    largest: int | None = None
    notes: list[str] = []
    rank_clients = {c for c in clients if c != (store if store != "." else "")}
    for client in clients:
        got, lock, top_id = _walk_client(root, client, fsdir, verify, add, add_entry,
                                         skip=rank_clients if client not in rank_clients else set(),
                                         only=only if client == "" else None)
        files += got
        locks[client or "."] = lock
        if top_id is not None:
            largest = top_id if largest is None else max(largest, top_id)
    if store != "." and (store in clients) and rank_clients:
        notes.append(f"store folder {store} is itself a bucket client root: its client deletes every rank "
                     "folder's .bucket at start (R §5)")
    held = sorted(c for c, s in locks.items() if s == "held")
    if held:
        notes.append("client live: the Mooncake 0.3.14 lock is held in " + ", ".join(held))
    return files, {"client_roots": [c or "." for c in clients], "locks": locks,
                            "largest_bucket_id": largest, "notes": notes}


def _rel(client: str, name: str) -> str:
    return f"{client}/{name}" if client else name


def _walk_client(root: str, client: str, fsdir: str, verify: str, add: Callable[[list[StoreFile]], None],
                 add_entry: Callable[[StoreFile], None], skip: set[str], only: set[str] | None = None
                 ) -> tuple[list[StoreFile], str, int | None]:
    """One client root: its files with the container verdicts of §1.4 (its live objects
    to `add`), the state of its 0.3.14 lock, and its largest bucket id."""
    base = os.path.join(root, client) if client else root
    files: list[StoreFile] = []
    below: list[StoreFile] = []  # files in sub-folders (a `.bucket` there is deleted at start)
    try:
        with os.scandir(base) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as exc:
        f = StoreFile(client or ".", client, "other", 0)
        f.status, f.reason, f.error = "unreadable", errno_reason(exc, "cannot list", client or "."), "list"
        return [f], "absent", None
    lock = "absent"
    for e in entries:
        if only is not None and e.name not in only:
            continue
        rel = _rel(client, e.name)
        if e.is_dir(follow_symlinks=False):
            if rel in skip:
                continue  # a rank client root: walked as its own
            if e.name == fsdir:
                _walk_fsdir(e.path, rel, client, verify, files, add_entry)
            elif e.name == MC.STAGE_DIR:
                _tree(e.path, rel, client, below, own=True)
            else:
                _tree(e.path, rel, client, below, own=False)
            continue
        got = _stat(e.path, rel, client, "other")
        if got is None:
            continue
        f = got
        if not f.regular:
            pass
        elif e.name == M.LOCK_NAME:
            f.kind = "lock"
            try:
                lock = MC.probe_client_lock(base)
            except OSError:
                lock = "free"  # (not openable: no client of ours holds it either way)
        elif e.name == MC.OWN_LOCK:
            f.kind = "own"
        elif e.name.endswith(M.META_SUFFIX):
            f.kind = "meta"  # (read when its pair is judged: one index's bytes held at a time)
        elif e.name.endswith(M.BUCKET_SUFFIX):
            f.kind = "bucket"
        files.append(f)
    _containers(root, client, files, below, verify, add)
    ids = [M.stoll_id(f.relpath.rsplit("/", 1)[-1]) for f in files if f.kind in ("meta", "bucket")]
    top_id = max((i for i in ids if i is not None), default=None)
    return files + below, lock, top_id


def _stat(path: str, rel: str, client: str, kind: str) -> StoreFile | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        f = StoreFile(rel, client, kind, 0)
        f.error = errno_reason(exc, "cannot stat", rel)
        return f
    f = StoreFile(rel, client, kind, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_nlink, st.st_ctime_ns)
    if not stat_mod.S_ISREG(st.st_mode):
        f.regular, f.entry = False, kind_of(st.st_mode)
    return f


def _read_meta(path: str, f: StoreFile) -> None:
    if f.size > META_MAX:
        f.error = f"{f.relpath} is larger than {META_MAX} bytes (an index of 500 keys is far smaller): not read"
        return
    try:
        fd = open_noatime(path)
        try:
            chunks, n = [], 0
            while n <= META_MAX:
                b = os.read(fd, CHUNK)
                if not b:
                    break
                chunks.append(b)
                n += len(b)
        finally:
            os.close(fd)
        f.data = b"".join(chunks)
    except OSError as exc:
        f.error = errno_reason(exc, "cannot read", f.relpath)


def _listing(path: str, rel: str, client: str, out: list[StoreFile]) -> list[os.DirEntry]:
    """A folder's entries by name; none (and an `unreadable` row for it) when it cannot be listed."""
    try:
        with os.scandir(path) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError as exc:
        f = StoreFile(rel, client, "other", 0)
        f.status, f.reason, f.error = "unreadable", errno_reason(exc, "cannot list", rel), "list"
        out.append(f)
        return []


def _tree(path: str, rel: str, client: str, out: list[StoreFile], own: bool) -> None:
    """Every file under a folder of a client root outside its layout (never followed)."""
    for e in _listing(path, rel, client, out):
        child = f"{rel}/{e.name}"
        if e.is_dir(follow_symlinks=False):
            _tree(e.path, child, client, out, own)
            continue
        got = _stat(e.path, child, client, "own" if own else "other")
        if got is None:
            continue
        f = got
        f.top = False
        if not own and f.regular and e.name.endswith(M.BUCKET_SUFFIX):
            f.kind = "bucket"
        elif not own and f.regular and e.name.endswith(M.META_SUFFIX):
            f.kind = "meta"
            _read_meta(e.path, f)
        out.append(f)


def _walk_fsdir(path: str, rel: str, client: str, verify: str, out: list[StoreFile],
                add_entry: Callable[[StoreFile], None]) -> None:
    """The file-per-key folder: every regular file at depth 3 is a KVEntry to the client
    (§1.3), judged as a file here and given to `add_entry` (the `ok` ones are not kept in
    `out`: a store may hold millions); files at other depths are ignored by it (foreign)."""

    def level(p: str, r: str, depth: int) -> None:
        for e in _listing(p, r, client, out):
            child = f"{r}/{e.name}"
            if e.is_dir(follow_symlinks=False):
                level(e.path, child, depth + 1)
                continue
            got = _stat(e.path, child, client, "other")
            if got is None:
                continue
            f = got
            f.top = False
            if depth == 3 and f.regular:
                f.depth3, f.kind = True, "kventry"
                _read_kventry(e.path, f, verify)
                _plain_verdict(f)
                add_entry(f)
                if f.status == "ok":
                    continue
            out.append(f)

    level(path, rel, 1)


def _read_kventry(path: str, f: StoreFile, verify: str) -> None:
    """The key and the value's place from the first bytes; with --verify size whether the
    value is all zero, with --verify hash its XXH3-128 (and the file's)."""
    try:
        fd = open_noatime(path)
    except OSError as exc:
        f.error = errno_reason(exc, "cannot read", f.relpath)
        return
    try:
        head = os.pread(fd, HEAD_BYTES, 0)
        try:
            key, at, n = M.kv_entry_layout(head, f.size)
        except M.DecodeError:
            f.data = head  # (its verdict tells a cut entry from another file by these bytes)
            f.all_zero = not any(head) if len(head) == f.size else None
            return
        f.object_key, f.value_offset, f.value_size = key, at, n
        if verify in ("size", "hash"):
            whole = xxhash.xxh3_128() if verify == "hash" else None
            f.all_zero, f.payload = _read_value(fd, at, n, verify == "hash")
            if whole is not None:
                _hash_range(fd, 0, f.size, whole)
                f.content = whole.digest()
    except OSError as exc:
        f.error = errno_reason(exc, "cannot read", f.relpath)
    finally:
        os.close(fd)


def _hash_range(fd: int, start: int, n: int, h: Any) -> bool:
    """Hash n bytes of fd from start; True when every one is zero."""
    zero, pos, end = True, start, start + n
    while pos < end:
        b = os.pread(fd, min(CHUNK, end - pos), pos)
        if not b:
            break
        if zero and any(b):
            zero = False
        if h is not None:
            h.update(b)
        pos += len(b)
    return zero


def _read_value(fd: int, at: int, n: int, hashed: bool) -> tuple[bool | None, bytes | None]:
    """(all zero, XXH3-128) of a value: its first bytes decide unless they are all zero or
    it is hashed."""
    if not hashed:
        head = os.pread(fd, min(n, HEAD_BYTES), at)
        if any(head):
            return False, None
        return _hash_range(fd, at, n, None), None
    h = xxhash.xxh3_128()
    zero = _hash_range(fd, at, n, h)
    return zero, h.digest()


def _containers(root: str, client: str, files: list[StoreFile], below: list[StoreFile], verify: str,
                add: Callable[[list[StoreFile]], None]) -> None:
    """§1.4's table for the top of one client root: live pairs, corrupt and orphaned
    indexes, buckets the next start deletes; the objects of the live pairs to `add`."""
    top = {f.relpath.rsplit("/", 1)[-1]: f for f in files if f.top}  # (not a KVEntry of the same name)
    live: dict[int, StoreFile] = {}
    for name, f in top.items():
        if f.kind != "meta" or not f.regular:
            continue
        _read_meta(os.path.join(root, f.relpath), f)
        data, f.data = f.data, None  # (decoded here; the rows keep what it says, not its bytes)
        if not M.is_pair_name(name):
            _unread_meta(f, "its stem is not all digits: Mooncake never reads it", data)
            continue
        ident = M.stoll_id(name)
        bucket = top.get(name[: -len(M.META_SUFFIX)] + M.BUCKET_SUFFIX)
        if f.error:
            f.status, f.reason = "unreadable", f.error
            continue
        try:
            meta = M.decode_meta(data or b"")
            problem = ("its data_size is 0" if meta.data_size == 0 else "it lists no key" if not meta.keys else
                       f"it lists {len(meta.keys)} keys and {len(meta.objects)} entries"
                       if len(meta.keys) != len(meta.objects) else None)
        except M.DecodeError as exc:
            meta, problem = None, f"it does not parse ({exc})"
        if problem is not None:
            f.status = "corrupt_sidecar"
            f.reason = f"index {f.relpath}: {problem}; the next client start deletes it and its .bucket"
            if bucket is not None and bucket.regular:
                bucket.status = "orphan_data"
                bucket.reason = f"its index {f.relpath} is corrupt: the next client start deletes both"
            continue
        if bucket is None or not bucket.regular:
            f.status = "orphan_index"
            f.reason = (f"index without its bucket {name[:-len(M.META_SUFFIX)]}{M.BUCKET_SUFFIX}: its "
                        f"{len(meta.keys) if meta else 0} objects are gone; the next client start deletes it")
            continue
        assert meta is not None and ident is not None
        live[ident] = f
        f.reason = f"live index of {len(meta.keys)} objects"
        add(_objects(root, f, bucket, meta, verify))
    for f in [*files, *below]:
        name = f.relpath.rsplit("/", 1)[-1]
        if f.kind == "bucket" and f.regular and f.status == "ok":
            ident = M.stoll_id(name)
            if f.top and M.is_pair_name(name) and ident in live:
                f.reason = f"bucket of the live index {ident}{M.META_SUFFIX}"
            elif ident is not None and ident in live:
                f.status = "foreign"
                f.reason = (f"kept by the client (a live {ident}{M.META_SUFFIX} exists) but never read: not part "
                            "of the cache")
            else:
                f.status = "orphan_data"
                f.reason = ("a .bucket without a live top-level index " +
                            (f"{ident}{M.META_SUFFIX}" if ident is not None else "(no numeric id)") +
                            ": the next client start deletes it")
        elif f.kind == "meta" and not f.top and f.regular:
            _unread_meta(f, "below the top of its client root: Mooncake never reads it")
    for f in [*files, *below]:
        _plain_verdict(f)


def _unread_meta(f: StoreFile, why: str, data: bytes | None = None) -> None:
    try:
        M.decode_meta((f.data if data is None else data) or b"")
        f.status, f.reason = "misfiled", f"an index Mooncake never reads ({why}); its objects are not served"
    except M.DecodeError:
        f.status, f.reason = "foreign", f"{why}; it does not parse as an index: not part of the cache"


def _plain_verdict(f: StoreFile) -> None:
    """Files the layout gives no other verdict: the lock, kvmigrate's own, foreign ones,
    KVEntries (their key is the family's to judge)."""
    if f.status != "ok" or f.reason:
        return
    if not f.regular:
        f.status, f.reason = "foreign", f"{f.entry} (never followed): not part of the cache"
    elif f.error:
        f.status, f.reason = "unreadable", f.error
    elif f.kind == "lock":
        f.reason = "the Mooncake 0.3.14 client lock"
    elif f.kind == "own":
        f.status, f.reason = "own_artifact", "kvmigrate's own file (a migration's lock or stage)"
    elif f.kind == "kventry":
        _kventry_verdict(f)
    else:
        f.status, f.reason = "foreign", "not a file Mooncake reads: not part of the cache"


def _kventry_verdict(f: StoreFile) -> None:
    name = f.relpath.rsplit("/", 1)[-1]
    if f.object_key is None:  # it did not parse: the client does not start
        if f.size == 0 or f.all_zero:
            f.status = "zero_filled"
            f.reason = "an all-zero file at depth 3 of the file-per-key folder: the client does not start"
        else:
            try:
                M.kv_entry_layout(f.data or b"", f.size)
                cut = False
            except M.CutError:
                cut = True
            except M.DecodeError:
                cut = False
            f.status = "short" if cut else "header_invalid"
            f.reason = ("a KVEntry whose fields run past its end" if cut else "a file that is not a KVEntry") + \
                " at depth 3 of the file-per-key folder: the client does not start"
        return
    if name.endswith(".tmp"):
        f.status = "tmp_leftover"
        f.reason = "a temp name at depth 3 (Mooncake writes no temps): registered again, never read"
        return
    if f.all_zero and f.value_size:
        f.status = "zero_filled"
        f.reason = "every byte of the value is zero: no engine wrote it so"
        return


def _objects(root: str, meta_file: StoreFile, bucket: StoreFile, meta: M.BucketMeta, verify: str
             ) -> list[StoreFile]:
    """The object rows of a live index: each entry, its value's place in the bucket, and
    (verify size/hash) what its bytes are."""
    out = []
    path = os.path.join(root, bucket.relpath)
    fd = None
    if verify in ("size", "hash"):
        try:
            fd = open_noatime(path)
        except OSError as exc:
            bucket.error = errno_reason(exc, "cannot read", bucket.relpath)
    try:
        for i, (key, obj) in enumerate(zip(meta.keys, meta.objects)):
            o = StoreFile(meta_file.relpath, meta_file.client, "object", obj.data_size, meta_file.mtime_ns,
                          meta_file.inode, meta_file.dev, meta_file.nlink, meta_file.ctime_ns)
            o.object_index, o.object_key, o.value_offset, o.value_size = i, key, obj.value_start, obj.data_size
            if obj.end > bucket.size:
                o.status = "short"
                o.reason = (f"record cut by the end of {bucket.relpath} ({bucket.size} bytes, the value ends at "
                            f"{obj.end}): is_exist says 1, every read fails")
            elif bucket.error:
                o.error = bucket.error
            elif fd is not None:
                try:
                    o.all_zero, o.payload = _read_value(fd, obj.value_start, obj.data_size, verify == "hash")
                    o.content = o.payload
                except OSError as exc:
                    o.error = errno_reason(exc, "cannot read", bucket.relpath)
            out.append(o)
    finally:
        if fd is not None:
            os.close(fd)
    return out


class _StoreRows:
    """A store namespace's rows: its files (the store's own namespace) and its judged
    objects read back from the store's runs, in (relpath, index) order, in batches of
    BATCH_ROWS. Written once: the files are let go as they are."""

    def __init__(self, runs: S.Runs, label: str, files: list[StoreFile]) -> None:
        self.runs, self.label, self.files = runs, label, files

    def __bool__(self) -> bool:
        return bool(self.files) or bool(self.runs.counts.get(self.label))

    def tables(self, code: int, ns_arrays: list) -> Iterator[pa.Table]:
        rows = self.runs.rows(self.label, self.files)
        self.files = []
        batch: list[StoreFile] = []
        for f in rows:
            batch.append(f)
            if len(batch) == BATCH_ROWS:
                yield _table(batch, code, ns_arrays)
                batch = []
        if batch:
            yield _table(batch, code, ns_arrays)


def _table(batch: list[StoreFile], code: int, ns_arrays: list) -> pa.Table:
    t = rows_of(batch, code).table(ns_arrays)
    for name, values, typ in (("object_index", [f.object_index for f in batch], pa.int32()),
                              ("object_key", [f.object_key for f in batch], pa.binary()),
                              ("target_key", [f.target_key for f in batch], pa.binary())):
        t = t.set_column(t.schema.get_field_index(name), name, pa.array(values, typ))
    return t
