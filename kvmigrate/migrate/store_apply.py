"""Applying a store's plan (migrate/stores.py) with the write primitives of
migrate/mooncake_store.py: in place (`StoreApplier`: proofs, the intent, index rewrites,
replaced KVEntries, new pairs, new KVEntries; a resumed run finishes its journaled intent
exactly) or into another folder (`DestStoreApplier`, §3.6). Source `.bucket` files are
never modified: every value stays readable at its manifest location."""

from __future__ import annotations

import errno
import itertools
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import xxhash

from kvmigrate.errors import OperationalError, write_error
from kvmigrate.formats import mooncake as M
from kvmigrate.migrate import journal as jn
from kvmigrate.migrate import mooncake_store as MS
from kvmigrate.migrate.journal import INTENT_ARRAYS
from kvmigrate.migrate.reshard_spill import Spill
from kvmigrate.migrate.reshard_spill import sort as spill_sort
from kvmigrate.migrate.stores import (
    BACKUP_DIR,
    OWN_LOCK,
    EntryWrite,
    IndexRewrite,
    ReshardWork,
    SourceRef,
    StorePlan,
    check_proofs,
    from_intent,
    intent_parts,
)

_METAS_HELD = 8  # decoded source indexes kept (a block's key ranks are in a few pairs)


def _keep_displaced(p: StorePlan, work: ReshardWork) -> None:
    """A reshard that will not run retires nothing: its displaced entries leave the index
    rewrites (a rewrite left with no entry is dropped: `whole_rewrites`)."""
    p.kept.update((src.relpath, src.index) for src in work.displaced if src.index is not None)


class StoreApplier:
    """Applies the store plans of one migration run, writing its journal."""

    def __init__(self, root: str, plans: list[StorePlan], journal: Any, run_id: str,
                 crash: Callable[[str], None], resumed: list[jn.Run] | None = None):
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
        self.done_index: dict[str, str] = {}
        self.done_entry: dict[str, str] = {}
        # a store whose intent an interrupted run wrote and did not finish: that intent is done
        # exactly (its pairs' ids and hashes), not a plan from a scan of the half-done store;
        # store -> its last intent: (its run, its place among the run's records, its head)
        finished: set[str] = set()
        intents: dict[str, tuple[jn.Run, int, dict[str, Any]]] = {}
        for run in resumed or ():  # (the journal's every run, a record at a time: its intents' parts stay there)
            for at, r in enumerate(jn.store_records(run, ())):
                t = r["t"]
                if t == "mc_index":
                    self.done_index[r["meta"]] = r["new"]
                elif t in ("mc_entry", "mc_replace"):
                    self.done_entry[r["path"]] = r.get("xxh3") or r["new"]
                elif t == "mc_done":
                    finished.add(r["store"])
                elif t == "mc_intent":
                    intents[r["store"]] = (run, at, r)
        self.unfinished = {store: intent for store, intent in intents.items() if store not in finished}
        self.resuming = False
        self._metas: OrderedDict[str, tuple[tuple[int, ...], M.BucketMeta]] = OrderedDict()  # see _index

    def _abs(self, relpath: str) -> str:
        return os.path.join(self.root, relpath) if relpath else self.root

    def take_proofs(self) -> None:
        """Every proof of every store before the first write (§5.1): no proof → exit 2
        (`check_proofs`), a held client lock → exit 8; nothing written either way."""
        check_proofs(self.root, self.plans)
        resumed = [from_intent(head) for _, _, head in self.unfinished.values()]  # (its proofs: the head's)
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
            self._store(from_intent(intent[2], _parts(*intent[:2], INTENT_ARRAYS)), intent)
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

    def _store(self, p: StorePlan, resumed: tuple[jn.Run, int, dict[str, Any]] | None = None) -> None:
        for client in p.clients:
            if not os.path.isdir(self._abs(client)):  # an SGLang target rank's client root (§3.6)
                os.makedirs(self._abs(client))
                self.journal.write({"t": "mc_dir", "store": p.store, "path": client}, sync=True)
            self._own_lock(client)
        outputs = self._reshard_outputs(p)  # every source read and checked before anything is written
        if resumed is None:
            pairs: Any = self._pairs(p, outputs)  # (a displaced entry's retired key names this run, §3.5)
            intent = intent_parts(p, p.whole_rewrites(self.run_id), pairs, outputs["entries"],
                                  split=self.journal.version >= 3)
            self.journal.write_parts(intent, sync=True)
        else:  # the interrupted run's pairs: the same ids, proven the same bytes
            pairs = self._resumed_pairs(_parts(*resumed[:2], ("pairs",)), outputs)
        self.crash("intent")
        for rw in p.whole_rewrites(self.run_id):
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

    def _reshard_outputs(self, p: StorePlan) -> dict[str, Spill]:
        """The values every reshard writes (§3.4), from sources re-read and checked against
        the scan: {"objects": [(client, key, value)] for new pairs, "entries": [(client,
        path, KVEntry bytes, displaced)] for KVEntries}, on disk (reshard_spill), not held."""
        from kvmigrate.transforms_mooncake import reshard_values

        out = {"objects": Spill(), "entries": Spill()}
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
            meta = self._index(self._abs(src.relpath))
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

    def _index(self, path: str) -> M.BucketMeta:
        """A source `.meta` decoded as it is now: the last few decoded are kept while their
        stat stays the same (a pair of 500 entries was decoded again for each of them)."""
        st = os.stat(path)
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        held = self._metas.get(path)
        if held is not None and held[0] == stamp:
            self._metas.move_to_end(path)
            return held[1]
        meta = M.decode_meta(MS._read(path))
        self._metas[path] = (stamp, meta)
        while len(self._metas) > _METAS_HELD:
            self._metas.popitem(last=False)
        return meta

    def _resumed_pairs(self, intended: Iterator[dict[str, Any]], outputs: dict[str, Spill]) -> Spill:
        """The intended pairs with their objects recomputed: a client root's k-th intended
        pair is its k-th pair packed again; a pair whose bytes would differ from the
        intent's is left out (changed_since_scan), and a `.bucket` of the interrupted run
        left alone without its `.meta` is taken away before it is rewritten. On disk (a
        pair holds its objects' values), client root by client root: the order `_pairs`
        intends them in."""
        ordered = spill_sort(((rec["client"], at, rec) for at, rec in
                              enumerate(rec for part in intended for rec in part["items"])),
                             key=lambda c: (c[0], c[1]))
        packed = _packed(outputs["objects"])
        ahead = next(packed, None)
        out = Spill()
        for client, group in itertools.groupby(ordered, key=lambda c: c[0]):
            while ahead is not None and ahead[0] < client:
                ahead = next(packed, None)
            for _, _, rec in group:
                objects: list[tuple[bytes, bytes]] = []
                if ahead is not None and ahead[0] == client:
                    objects = ahead[1]
                    ahead = next(packed, None)
                same = False
                if objects:
                    data, meta = M.build_bucket(objects)
                    same = MS.xxh3_hex(data) == rec["bucket"] and MS.xxh3_hex(M.encode_meta(meta)) == rec["meta"]
                if not same:
                    self._skip("changed_since_scan", len(objects), f"{client}: pair {rec['id']} would not be the "
                               "bytes the interrupted run intended")
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

    def _pairs(self, p: StorePlan, outputs: dict[str, Spill]) -> Spill:
        """The new pairs of the store's reshard outputs, per target client root: objects sorted
        by key, <= 500 a pair and 256 MiB, ids above every id at the top of the client root
        (§3.6): (client, id, objects, .bucket XXH3, .meta XXH3), on disk."""
        out = Spill()
        last: tuple[str, int] | None = None  # (client root, id of its last pair)
        for client, pair in _packed(outputs["objects"]):
            if last is None or last[0] != client:
                last = (client, MS.choose_bucket_ids(self._abs(client), 1)[0])  # (then consecutive ids)
            else:
                last = (client, last[1] + 1)
            data, meta = M.build_bucket(pair)
            out.append((client, last[1], pair, MS.xxh3_hex(data), MS.xxh3_hex(M.encode_meta(meta))))
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
            self._place_entry(root, path, "", entry.key, entry.value)
            return
        self.crash("created")
        self.outcomes["created"] += 1

    def _place_entry(self, client_root: str, path: str, source: str, key: bytes, value: bytes) -> None:
        """A new KVEntry at fpk of `key` in the fsdir `path` names, journaled (`source`: the
        entry it is linked from, '' for a reshard output). One already there with the same
        bytes is `already_present`; another is a conflict, left as it is."""
        dirs: list[str] = []
        fsdir = path.split("/")[-4]
        try:
            _, digest = MS.place_kv_entry(os.path.join(client_root, fsdir), key, value, MS.stage_path(client_root),
                                          dirs, step=self.crash)
        except MS.EntryOccupied as exc:
            if exc.identical:
                self.outcomes["already_present"] += 1
            else:
                self._skip("conflict", 1, f"{path}: {exc}")
            return
        self.journal.write({"t": "mc_entry", "path": path, "source": source, "xxh3": digest,
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
        self._place_entry(self._abs(e.client), e.path, e.source, e.key, entry.value)

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

    def _put(self, store: str, client: str, relpath: str, data: bytes | None = None, source: str | None = None
             ) -> bool:
        """A file at DIR/relpath: `data` written, or `source` linked (copied with --mode copy
        or across filesystems), through the temp-then-link of the write primitives (its temp
        in DIR/<client>'s stage, never in an fsdir); never over another file (the same bytes
        there: done). Returns whether it is there with the bytes it must hold."""
        final = self._d(relpath)
        self._dirs(store, os.path.dirname(final))
        src = self._abs(source or "")
        want = MS.xxh3_hex(data) if data is not None else MS._hash_or_none(src)
        if os.path.lexists(final):
            return MS._hash_or_none(final) == want
        linked = False
        if data is None and self.mode != "copy":
            try:
                os.link(src, final, follow_symlinks=False)
                linked = True
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise write_error(exc, "cannot link into the destination", final) from None
        if not linked:
            MS._via_temp(MS.stage_path(self._d(client)), final, data if data is not None else MS._read(src),
                         self.crash, "", MS._link)
        MS._fsync_dir(os.path.dirname(final))
        self.journal.write({"t": "mc_file", "store": store, "path": relpath, "xxh3": want, "base": "dest"}, sync=True)
        self.crash("created")
        return True

    def _dest_store(self, p: StorePlan) -> None:
        outputs = self._reshard_outputs(p)
        self.journal.write_parts(intent_parts(p, p.whole_rewrites(), [], outputs["entries"], dest=True,
                                              split=self.journal.version >= 3), sync=True)
        self.crash("intent")
        new_objects = Spill()  # (client, key, value) of the new pairs in DIR: on disk, not held
        for rw in p.whole_rewrites():
            self._dest_index(p.store, rw, new_objects)
        for e in p.entries:
            self._dest_entry(p.store, e)
        for client, path, data, _ in outputs["entries"]:
            if self._put(p.store, client, path, data=data):
                self.outcomes["created"] += 1
            else:
                self._skip("conflict", 1, f"{self._d(path)}: another file is there")
        for rec in outputs["objects"]:
            new_objects.append(rec)
        clients = set(p.clients)
        last: tuple[str, int] | None = None  # (client root, id of its last pair)
        for client, objects in _packed(new_objects):
            base = self._d(client)
            if last is None or last[0] != client:
                self._dirs(p.store, base)
                clients.add(client)
                last = (client, MS.choose_bucket_ids(base, 1)[0])  # (then consecutive ids)
            else:
                last = (client, last[1] + 1)
            made = MS.write_pair(base, last[1], objects, MS.stage_path(base), step=self.crash)
            self.journal.write({"t": "mc_pair", "store": p.store, "client": client, "id": made.id,
                                "bucket": made.bucket_xxh3, "meta": made.meta_xxh3, "base": "dest",
                                "keys": [k.hex() for k in made.keys]}, sync=True)
            self.outcomes["created"] += len(objects)
        new_objects.close()
        for client in clients:
            MS.clear_stage(MS.stage_path(self._d(client)))
        self.journal.write({"t": "mc_done", "store": p.store}, sync=True)

    def _dest_index(self, store: str, rw: IndexRewrite, new_objects: Spill) -> None:
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
            if self._put(store, rw.client, bucket, source=bucket) and self._put(store, rw.client, rw.meta,
                                                                                 data=new_meta):
                self.outcomes["created"] += n
            else:
                self._skip("conflict", n, f"{self._d(rw.meta)}: another pair has its id there")
            return
        with open(self._abs(bucket), "rb") as f:
            for i, key in sorted(keys.items()):
                obj = meta.objects[i]
                f.seek(obj.value_start)
                new_objects.append((rw.client, key, f.read(obj.data_size)))

    def _dest_entry(self, store: str, e: EntryWrite) -> None:
        entry = self._source_entry(e)
        if entry is None:
            return
        ok = (self._put(store, e.client, e.path, source=e.source) if entry.key == e.key else
              self._put(store, e.client, e.path, data=M.encode_kv_entry(M.KVEntry(e.key, entry.value))))
        if ok:
            self.outcomes["created"] += 1
        else:
            self._skip("conflict", 1, f"{self._d(e.path)}: another file is there")


def _packed(objects: Spill) -> Iterator[tuple[str, list[tuple[bytes, bytes]]]]:
    """(client root, objects) of every new pair of reshard outputs (client, key, value):
    client roots in order, each one's objects sorted by key and packed as a client fills
    its buckets. The keys are sorted apart from their values; a value is read back as its
    pair is packed."""
    ordered = spill_sort(((client, key, at) for at, (client, key, _) in objects.items()), key=lambda c: (c[0], c[1]))
    for client, group in itertools.groupby(ordered, key=lambda c: c[0]):
        for pair in MS.pack_sorted((key, objects.at(at)[2]) for _, key, at in group):
            yield client, pair


def _parts(run: jn.Run, at: int, arrays: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    """The parts of `arrays` of the intent that is record `at` of the run's store records
    (not counting parts: `jn.store_records(run, ())`), read from the journal a part at a time."""
    n = -1
    for rec in jn.store_records(run, arrays):
        if rec["t"] != "mc_part":
            n += 1
            if n > at:
                return
        elif n == at:
            yield rec
