"""Prune's selection of Mooncake stores over the manifest in record batches, for a manifest
whose namespaces are all of stores (and files of no namespace), or for the stores' rows
alone of one with other namespaces (`alone=False`: `prune._picked_mixed`): a plan's rows
without the manifest's columns whole, nor a Python object per row.

The rules are prune_stores.select's (the reference). They read across rows: a migrated
KVEntry's target file, a file some row names as its target, a deployment all of whose
objects are stale, and the container rule, which takes a live pair (`<id>.meta` +
`<id>.bucket`) whole only when every entry its `.meta` lists is taken. So what they need
of the rest of the manifest is gathered compactly first, then each row's class is kept
as one byte:

    pass 0   every namespace a store's (else the reference plans it); the deployments
             another is planned into; per deployment whether all its objects are stale
    pass A   a 128-bit digest of each store file's path (one row a path, else the
             reference plans it), the paths rows name as their target, the migrated
             KVEntry candidates (row, their target's digest): after it one lookup each
             gives the protected rows and the migrated rows' targets
    pass C   each row's class (an entry row's: what its class takes of it); per `.meta`
             path (its digest), folded batch by batch: its entries, how many no class
             takes, their first class, and whether its `.meta` and `.bucket` are free
    pairs    the pairs taken whole (digest -> class, entries), in LOOKUP_PARTS parts
    retires  only with --tails entries of pairs not taken whole: the `.meta` rows' stat
    rows     the selected files, a batch at a time, with their pair's key and objects
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvmigrate.formats import mooncake as M
from kvmigrate.migrate import prune_rules as P
from kvmigrate.migrate import prune_stores as ST
from kvmigrate.migrate import prune_stream as S
from kvmigrate.migrate import prune_tier_stream as TS

_PASS_0 = ("source_base", "target_base", "status")
_PASS_A = ("source_base", "status", "action", "relpath", "target_relpath", "object_index", "object_key")
_PASS_C = ("source_base", "status", "action", "finding", "relpath", "object_index", "object_key", "target_key",
           "mtime_ns")
_PASS_E = (*P.PLAN_ROW_COLUMNS, "status", "family", "object_index", "object_key")


class StoreRows:
    """The rows a prune of `classes` selects in a manifest of Mooncake stores, as tables of
    a batch's rows (prune_stream.PlanRows' columns, `key` and `objects`), once `gather`
    found the manifest fit. Not `alone`: the stores' rows only, of a manifest that has
    other namespaces (whose rows, and those of no namespace, are another's to take)."""

    def __init__(self, manifest_path: str, used_namespaces: tuple[set[str], set[str]], classes: tuple[str, ...],
                 cutoff_ns: int, stores: ST.Stores, alone: bool = True) -> None:
        self.path, self.classes, self.cutoff, self.stores = manifest_path, classes, cutoff_ns, stores
        self.alone = alone
        self.journal_targets, self.used = used_namespaces
        self.n = 0
        self.target_bases: set[str] = set()
        self.retires: list[ST.Retire] = []
        self.code = bytearray()  # a class code a row (0: none); a pair's files take theirs from `whole`
        self.whole: dict[str, Any] | None = None  # the pairs taken whole: d (their .meta's digest), cls, objects
        self._stale: set[str] = set()  # deployments unreadable_namespaces takes whole
        self._protected: Any = None  # rows some row names as its target (ascending)
        self._migrated_to: tuple[Any, Any] | None = None  # migrated KVEntry rows (ascending), their target's row

    def gather(self) -> bool:
        """Passes 0 to C and the pairs; False when the manifest is not for this path (a
        namespace not a store's, two rows of one store file)."""
        if not self._pass_0() or not self._pass_a():
            return False
        tails = self._pass_c()
        if tails:
            self._retires(tails)
        return True

    def _pass_0(self) -> bool:
        import pyarrow as pa
        import pyarrow.compute as pc

        store_of, labels = self.stores.store_of, set(self.stores.label_of.values())
        bases: set[str] = set()
        others: set[str] = set(self.journal_targets)  # deployments another is planned into
        stale: dict[str, bool] = {}
        for _, c in S._batches(self.path, _PASS_0):
            self.n += len(c["source_base"])
            src = c["source_base"]
            is_store = TS.fold_bases(c, store_of, bases, others, self.alone)
            if is_store is None:
                return False
            dep = pc.and_(is_store, pc.invert(P._in(src, labels)))
            g = pa.table({"ns": src, "all": P._in(c["status"], ST.STALE)}).filter(dep) \
                .group_by("ns").aggregate([("all", "all")])
            for ns, a in zip(g["ns"].to_pylist(), g["all_all"].to_pylist()):
                stale[ns] = stale.get(ns, True) and a
        self.target_bases = (bases - {""}) | set(self.journal_targets)
        self._stale = {ns for ns, a in stale.items() if a and ns not in others and ns not in self.used}
        return True

    def _pass_a(self) -> bool:
        """The protected rows and the migrated KVEntries' targets (prune_stores.select's
        `named`, `files.get(t)`); False when a store file has two rows."""
        import pyarrow as pa
        import pyarrow.compute as pc

        digests = S.RowDigests(self.n)  # each row's path digest: a store file's (the others are null in the lookups)
        named: list = []  # the digests of the paths store rows name as their target
        fit = bytearray()  # per row: 1 ok, 2 its own target (a migrated KVEntry's target is both)
        cand: dict[str, list] = {"row": [], "d": []}
        for offset, c in S._batches(self.path, _PASS_A):
            src, status, rel, tr = c["source_base"], c["status"], c["relpath"], c["target_relpath"]
            is_store = P._in(src, self.stores.store_of)
            file = pc.and_(is_store, pc.is_null(c["object_index"]))
            k = len(src)
            digests.put(offset, S._digests(rel), file)
            other = P._b(pc.and_(pc.not_equal(tr, ""), pc.not_equal(tr, rel)))
            has = pc.and_(is_store, other)
            if pc.any(has).as_py():
                named.append(pc.unique(S._digests(pc.filter(tr, has))))
            own = P._b(pc.equal(tr, rel))
            fit += TS._bytes(pc.add(P._b(pc.equal(status, "ok")).cast(pa.int8()), pc.multiply(own.cast(pa.int8()), 2)))
            if "migrated" not in self.classes:
                continue
            m = pc.and_(pc.and_(file, pc.is_valid(c["object_key"])),
                        pc.and_(P._b(pc.equal(c["action"], "already_present")),
                                pc.and_(other, P._in(status, ("ok", "misfiled")))))
            if pc.any(m).as_py():
                cand["row"].append(pc.filter(S._rows(offset, k), m))
                cand["d"].append(S._digests(pc.filter(tr, m)))
        binary = pa.binary(16)
        hay = digests.array()
        del digests
        if _repeats(hay):
            return False
        self._protected = pa.array([], pa.int64())
        if named:
            self._protected = S._rows_in(hay, named)
            del named
        if cand["row"]:
            rows, d = S._concat(cand["row"], pa.int64()), S._concat(cand["d"], binary)
            j = S._index_in(d, hay)
            fits = pa.Array.from_buffers(pa.int8(), len(fit), [None, pa.py_buffer(bytes(fit))])
            hit = P._b(pc.equal(pc.take(fits, j), 3))
            if pc.any(hit).as_py():
                self._migrated_to = (pc.filter(rows, hit), pc.filter(j, hit))
        return True

    def _pass_c(self) -> list[tuple[int, str, int, bytes, str]]:
        """Each row's class; the pairs taken whole (`whole`); the entries --tails takes
        (row, their .meta, entry, key, deployment) in manifest order."""
        import pyarrow as pa
        import pyarrow.compute as pc

        self.code = bytearray(self.n)
        folds: list = []  # per batch: per .meta digest, what the container rule needs
        tails: list[tuple[int, str, int, bytes, str]] = []
        mig, unr, res, tls = (pa.scalar(P.CODES[k], pa.int8()) for k in
                              ("migrated", "unreadable_namespaces", "residue", "tails"))
        for offset, c in S._batches(self.path, _PASS_C):
            src, status, rel = c["source_base"], c["status"], c["relpath"]
            k = len(src)
            is_store = P._in(src, self.stores.store_of)
            entry = pc.and_(is_store, pc.is_valid(c["object_index"]))
            file = pc.and_(is_store, pc.is_null(c["object_index"]))
            guarded = TS.TierRows._lookup_mask(self._protected, offset, k)
            free = pc.and_(pc.and_(file, pc.invert(P._in(status, ST.NEVER))), pc.invert(guarded))
            code = pa.array([0] * k, pa.int8())
            if "migrated" in self.classes:
                moved, _ = S._lookup(self._migrated_to, offset, k)
                code = pc.if_else(pc.and_(moved, free), mig, code)
                key, tkey = c["object_key"], c["target_key"]
                gone = pc.or_(P._b(pc.equal(c["finding"], "superseded")),
                              P._b(pc.and_(pc.equal(c["action"], "already_present"), pc.not_equal(tkey, key))))
                code = pc.if_else(pc.and_(entry, gone), mig, code)
            if "unreadable_namespaces" in self.classes:
                code = TS._assign(code, pc.and_(P._in(src, self._stale), pc.or_(free, entry)), "unreadable_namespaces")
            if "residue" in self.classes:
                old_tmp = pc.and_(P._b(pc.equal(status, "tmp_leftover")),
                                  P._b(pc.less_equal(pc.fill_null(c["mtime_ns"], 0), self.cutoff)))
                misfiled_meta = pc.and_(pc.and_(P._b(pc.equal(status, "misfiled")), pc.is_null(c["object_key"])),
                                        P._b(pc.ends_with(rel, M.META_SUFFIX)))
                take = pc.or_(pc.or_(P._in(status, ST.PAIR_RESIDUE), misfiled_meta),
                              pc.or_(old_tmp, self._kventries(c, P._in(status, ST.KVENTRY_RESIDUE))))
                code = TS._assign(code, pc.and_(free, take), "residue")
                if self.alone:  # files of no namespace: the generic rule
                    plain = P._b(pc.equal(src, ""))
                    code = TS._assign(code, pc.and_(plain, pc.or_(P._in(status, P.RESIDUE_STATUSES), old_tmp)),
                                      "residue")
            if "tails" in self.classes:
                short = pc.and_(entry, pc.and_(P._b(pc.equal(status, "short")), pc.is_valid(c["object_key"])))
                code = TS._assign(code, self._unretired(c["object_key"], short), "tails")
            TS._put(self.code, offset, code)
            folds.append(self._fold(c, entry, file, free, code))
            if "tails" in self.classes:
                at = pc.indices_nonzero(pc.and_(entry, pc.equal(code, tls)))
                if len(at):
                    tails.extend(zip(pc.add(at, offset).to_pylist(), pc.take(rel, at).to_pylist(),
                                     pc.take(c["object_index"], at).to_pylist(), pc.take(c["object_key"], at).to_pylist(),
                                     pc.take(src, at).to_pylist()))
        self.whole = _whole(folds)
        return tails

    def _kventries(self, c: dict[str, Any], mask: Any) -> Any:
        """`mask` and a KVEntry file of its store (Stores.where, for the rows of mask: few)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        at = pc.indices_nonzero(mask)
        if not len(at):
            return mask
        hit = [self.stores.where(ns, rel)[2] for ns, rel in zip(pc.take(c["source_base"], at).to_pylist(),
                                                                 pc.take(c["relpath"], at).to_pylist())]
        out = [False] * len(mask)
        for i, h in zip(at.to_pylist(), hit):
            out[i] = h
        return pa.array(out, pa.bool_())

    @staticmethod
    def _unretired(keys: Any, mask: Any) -> Any:
        """`mask` and a key no earlier --tails run retired (for the short entries: few)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        at = pc.indices_nonzero(mask)
        if not len(at):
            return mask
        out = [False] * len(mask)
        for i, key in zip(at.to_pylist(), pc.take(keys, at).to_pylist()):
            out[i] = M.parse_retired_key(M.parse_storage_key(key).engine) is None
        return pa.array(out, pa.bool_())

    @staticmethod
    def _fold(c: dict[str, Any], entry: Any, file: Any, free: Any, code: Any) -> Any:
        """A batch's rows folded per `.meta` path (its digest): its entries' classes (min,
        count, how many none takes), whether its `.meta` and its `.bucket` are free files."""
        import pyarrow as pa
        import pyarrow.compute as pc

        rel = c["relpath"]
        meta = pc.and_(file, P._b(pc.ends_with(rel, M.META_SUFFIX)))
        bucket = pc.and_(file, P._b(pc.ends_with(rel, M.BUCKET_SUFFIX)))
        keep = pc.or_(entry, pc.or_(meta, bucket))
        if not pc.any(keep).as_py():
            return None
        rel = pc.filter(rel, keep)
        entry, meta, bucket, free, code = (pc.filter(a, keep) for a in (entry, meta, bucket, free, code))
        of_meta = pc.if_else(bucket, pc.binary_join_element_wise(
            pc.utf8_slice_codeunits(rel, 0, -len(M.BUCKET_SUFFIX)), pa.scalar(M.META_SUFFIX), ""), rel)
        none = pa.scalar(None, pa.int8())
        t = pa.table({"d": S._digests(of_meta), "pick": pc.if_else(entry, code, none),
                      "zero": pc.and_(entry, pc.equal(code, 0)).cast(pa.int64()),
                      "m_free": pc.and_(meta, free).cast(pa.int8()), "b_free": pc.and_(bucket, free).cast(pa.int8())})
        g = t.group_by("d").aggregate([("pick", "min"), ("pick", "count"), ("zero", "sum"), ("m_free", "max"),
                                       ("b_free", "max")])
        return g.rename_columns([{"pick_min": "pick", "pick_count": "n", "zero_sum": "zero", "m_free_max": "m_free",
                                  "b_free_max": "b_free"}.get(n, n) for n in g.column_names])

    def _retires(self, tails: list[tuple[int, str, int, bytes, str]]) -> None:
        """A Retire per `.meta` (in the order its entries first appear) whose --tails entries
        stay in a pair not taken whole, with the `.meta` file's stat as scanned."""
        import pyarrow as pa
        import pyarrow.compute as pc

        by_meta: dict[str, list[tuple[int, bytes, str]]] = {}
        for _, meta, index, key, ns in tails:
            by_meta.setdefault(meta, []).append((index, key, ns))
        metas = list(by_meta)
        if self.whole is not None and len(self.whole["d"]):
            taken = P._b(pc.is_in(S._digests(pa.array(metas, pa.string())), value_set=self.whole["d"])).to_pylist()
            metas = [m for m, t in zip(metas, taken) if not t]
        if not metas:
            return
        stat: dict[str, tuple[str, int, int, int, int]] = {}
        wanted = pa.array(metas, pa.string())
        for _, c in S._batches(self.path, ("source_base", "relpath", "object_index", "dev", "inode", "size",
                                           "mtime_ns")):
            m = pc.and_(pc.and_(P._in(c["source_base"], self.stores.store_of), pc.is_null(c["object_index"])),
                        P._b(pc.is_in(c["relpath"], value_set=wanted)))
            if pc.any(m).as_py():
                for ns, rel, *st in zip(*(pc.filter(c[k], m).to_pylist() for k in
                                          ("source_base", "relpath", "dev", "inode", "size", "mtime_ns"))):
                    stat[rel] = (ns, *(v or 0 for v in st))
        for meta in metas:
            if meta not in stat:
                continue
            ns, dev, inode, size, mtime = stat[meta]
            store, client, _ = self.stores.where(ns, meta)
            got = sorted(by_meta[meta])
            self.retires.append(ST.Retire(store, meta, client, {i: k for i, k, _ in got}, {i: n for i, _, n in got},
                                          dev, inode, size, mtime))

    def rows(self, chosen: set[str] | None) -> Iterator[Any]:
        """The selected files (prunable, of `chosen`), a batch's at a time: row, code,
        target, PLAN_ROW_COLUMNS, key (a pair's) and objects (no longer served once it goes)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        whole = self.whole if self.whole is not None and len(self.whole["d"]) else None
        for offset, c in S._batches(self.path, _PASS_E):
            k = len(c["relpath"])
            rel, src = c["relpath"], c["source_base"]
            code = TS._int8(self.code, offset, k)
            file = pc.is_null(c["object_index"])
            objects = pa.nulls(k, pa.int32())
            if whole is not None:
                pair = pc.and_(pc.and_(file, P._in(src, self.stores.store_of)),
                               pc.or_(P._b(pc.ends_with(rel, M.META_SUFFIX)), P._b(pc.ends_with(rel, M.BUCKET_SUFFIX))))
                at = pa.nulls(k, pa.int64())
                if pc.any(pair).as_py():
                    of_meta = pc.binary_join_element_wise(pc.replace_substring_regex(rel, r"\.bucket$", ""),
                                                          pa.scalar(M.META_SUFFIX), "")
                    of_meta = pc.if_else(P._b(pc.ends_with(rel, M.BUCKET_SUFFIX)), of_meta, rel)
                    at = pc.if_else(pair, S._index_in(S._digests(of_meta), whole["d"]), at)
                hit = pc.is_valid(at)
                code = pc.if_else(hit, pc.take(whole["cls"], at), code)
                meta = pc.and_(hit, P._b(pc.ends_with(rel, M.META_SUFFIX)))
                objects = pc.if_else(meta, pc.take(whole["objects"], at), objects)
            keep = pc.and_(pc.and_(file, pc.not_equal(code, 0)), P._prunable(c))
            if chosen is not None:
                keep = pc.and_(keep, P._in(src, chosen))
            if not pc.any(keep).as_py():
                continue
            target = pa.nulls(k, pa.int64())
            if self._migrated_to is not None:
                moved, their = S._lookup(self._migrated_to, offset, k)
                target = pc.if_else(pc.and_(moved, pc.equal(code, P.CODES["migrated"])), their, target)
            cols = {"row": S._rows(offset, k), "code": code, "target": target,
                    **{name: c[name] for name in P.PLAN_ROW_COLUMNS}, "objects": objects.cast(pa.int32()),
                    "object_key": c["object_key"]}
            t = pa.table({name: pc.filter(v, keep) for name, v in cols.items()})
            yield self._keyed(t)

    def _keyed(self, t: Any) -> Any:
        """A batch of selected files with their move key (a pair's) and a KVEntry's object."""
        import pyarrow as pa

        keys: list[str | None] = []
        objects: list[int | None] = []
        for ns, rel, obj, okey in zip(*(t[k].to_pylist() for k in ("source_base", "relpath", "objects",
                                                                    "object_key"))):
            if ns in self.stores.store_of:
                keys.append(self.stores.move_key(ns, rel))
                objects.append(obj if obj is not None else int(okey is not None) if self.stores.where(ns, rel)[2]
                               else None)
            else:
                keys.append(None)
                objects.append(None)
        t = t.drop_columns(["object_key", "objects"])
        return t.append_column("key", pa.array(keys, pa.string())).append_column("objects", pa.array(objects, pa.int32()))


def _whole(folds: list) -> dict[str, Any] | None:
    """The pairs the container rule takes whole, from the batches' folds: every entry of
    the `.meta` taken (the first class of them), its `.meta` and `.bucket` free files. A
    column each of d, cls and objects (its entries), folded in LOOKUP_PARTS parts by digest."""
    import pyarrow as pa
    import pyarrow.compute as pc

    folds = [f for f in folds if f is not None]
    if not folds:
        return None
    t = pa.concat_tables(folds)
    del folds
    part = S._part(t["d"].combine_chunks())
    out = []
    for p in range(S.LOOKUP_PARTS):
        g = t.filter(pc.equal(part, p)).group_by("d").aggregate(
            [("pick", "min"), ("n", "sum"), ("zero", "sum"), ("m_free", "max"), ("b_free", "max")])
        g = g.filter(pc.and_(pc.and_(pc.greater(g["n_sum"], 0), pc.equal(g["zero_sum"], 0)),
                             pc.and_(pc.equal(g["m_free_max"], 1), pc.equal(g["b_free_max"], 1))))
        out.append(pa.table({"d": g["d"], "cls": g["pick_min"].cast(pa.int8()), "objects": g["n_sum"].cast(pa.int32())}))
    t = pa.concat_tables(out)
    return {k: t[k].combine_chunks() for k in t.column_names}


def _repeats(hay: Any) -> bool:
    """Whether a digest (a store file's path) is there twice, in LOOKUP_PARTS parts."""
    import pyarrow.compute as pc

    part = S._part(hay)
    for p in range(S.LOOKUP_PARTS):
        some = pc.filter(hay, pc.and_(pc.equal(part, p), pc.is_valid(hay)))
        if len(some) and pc.count_distinct(some).as_py() != len(some):
            return True
    return False


def units(manifest_path: str, stores: ST.Stores, names: set[str]) -> dict[str, tuple[list[str], list[str], int]]:
    """prune_stores.units in one pass over the manifest, a batch at a time."""
    wanted = {stores.store_of[ns] for ns in names if ns in stores.store_of}
    if not wanted:
        return {}
    out = ST.empty_units(stores, wanted)
    for _, c in S._batches(manifest_path, ("source_base", "relpath", "mtime_ns", "status")):
        ST.fold_units(out, stores, wanted, c)
    return {label: (ms, sorted(f), n) for label, (ms, f, n) in out.items()}
