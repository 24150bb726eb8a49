"""Prune's selection of LMCache tiers over the manifest in record batches, for a manifest
whose namespaces are all tiers (files of no namespace beside them), or for the tiers'
rows alone of one with other namespaces (`alone=False`: `prune._picked_mixed`): a plan's
rows without the manifest's columns whole, nor a Python object per row.

The rules are `prune._select`'s with prune_tiers.py's (the reference). A tier's rules
read across its rows by path (a migrated chunk's target, a file some row names as its
target, a GDS pair's partner), so what they need of the rest of the manifest is gathered
compactly first, then each row's class is kept as one byte:

    pass 0   the target bases; the deployments a tier's rule protects; per deployment
             whether all its chunks are stale
    pass A   a 128-bit digest of each tier row's path (null for the others), the paths
             rows name as their target, the migrated candidates (row, their target's
             digest): after it one lookup each gives the protected rows and the migrated
             rows' targets
    pass B   only with rank files to pair: prune_stream's (their primary's target)
    pass C   each row's class (one byte a row), before the GDS pairs; the pairs' rows
             with their partner's digest and whether each row is held
    pairs    only with GDS pairs: the partner's row (one lookup over every row's path
             digest), then `prune_tiers.with_pairs` over the class bytes
    pass D   the namespaces the selection empties (their config.json's class) and the
             index_lost chunks a statement holds back, per deployment
    pass E   the selected rows, as `prune_stream.PlanRows` yields them (`rows`)

`units` gives the tiers' quiet-period units as `prune_tiers.units`, in one pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvmigrate import findings, layout
from kvmigrate.formats import lmcache as L
from kvmigrate.migrate import prune_rules as P
from kvmigrate.migrate import prune_stream as S
from kvmigrate.migrate import prune_tiers as T

_PASS_A = ("source_base", "status", "action", "relpath", "target_relpath", "finding")
_PASS_C = ("source_base", "status", "relpath", "mtime_ns")
_PASS_D = ("source_base", "status", "relpath", "family", "size")
_PASS_E = (*P.PLAN_ROW_COLUMNS, "status", "family")


def _int8(buf: bytearray, offset: int, k: int) -> Any:
    """k class bytes from `offset` as an int8 array (a copy of the slice)."""
    import pyarrow as pa

    return pa.Array.from_buffers(pa.int8(), k, [None, pa.py_buffer(bytes(buf[offset:offset + k]))])


def _put(buf: bytearray, offset: int, arr: Any) -> None:
    """Store an int8 or bool array's values as bytes from `offset`."""
    import pyarrow as pa

    arr = arr.cast(pa.int8())
    k = len(arr)
    buf[offset:offset + k] = memoryview(arr.buffers()[1])[arr.offset:arr.offset + k]


def _bytes(arr: Any) -> bytes:
    """An integer array's values (0-127) as bytes."""
    import pyarrow as pa

    arr = arr.cast(pa.int8())
    return bytes(memoryview(arr.buffers()[1])[arr.offset:arr.offset + len(arr)])


def _assign(code: Any, mask: Any, cls: str) -> Any:
    """`chosen.setdefault(row, cls)` for the rows of mask."""
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.if_else(pc.and_(mask, pc.equal(code, 0)), pa.scalar(P.CODES[cls], pa.int8()), code)


def _set_bytes(buf: bytearray, rows: Any, values: Any | None, chunk: int = 65_536) -> None:
    """buf[row] = value (0 when `values` is None) for each of `rows`, a slice of them
    as Python ints at a time."""
    for at in range(0, len(rows), chunk):
        part = rows.slice(at, chunk).to_pylist()
        vals = [0] * len(part) if values is None else values.slice(at, chunk).to_pylist()
        for r, v in zip(part, vals):
            buf[r] = v


def fold_bases(c: dict[str, Any], members: Any, bases: set[str], others: set[str], alone: bool = True) -> Any | None:
    """A first pass's common part, over a batch (source_base, target_base): the mask of the
    members' rows, or None when `alone` (every namespace must be a member) and a row is of
    another namespace. Adds the batch's target bases to `bases` and the bases a member's
    row is planned into (not its own) to `others`."""
    import pyarrow.compute as pc

    src, tb = c["source_base"], c["target_base"]
    named = pc.filter(src, P._b(pc.not_equal(src, "")))
    if alone and len(named) and not pc.all(P._in(named, members)).as_py():
        return None
    bases.update(pc.unique(tb).drop_null().to_pylist())
    mine = P._in(src, members)
    other = P._b(pc.and_(mine, pc.and_(pc.not_equal(tb, src), pc.not_equal(tb, ""))))
    others.update(pc.unique(pc.filter(tb, other)).drop_null().to_pylist())
    return mine


class TierRows:
    """The rows a prune of `classes` selects in a manifest of tiers, as tables of a
    batch's rows (`prune_stream.PlanRows`' columns), once `gather` found the manifest
    fit (every namespace a tier). Not `alone`: the tiers' rows only, of a manifest that
    has other namespaces (whose rows, and those of no namespace, are another's to take)."""

    def __init__(self, manifest_path: str, meta: dict[str, Any], used_namespaces: tuple[set[str], set[str]],
                 classes: tuple[str, ...], cutoff_ns: int, tiers: T.Tiers, alone: bool = True) -> None:
        self.path, self.classes, self.cutoff, self.tiers = manifest_path, classes, cutoff_ns, tiers
        self.alone = alone
        self.meta = meta
        self.journal_targets, self.used = used_namespaces
        self.n = 0
        self.code = bytearray()  # a class code a row (0: none), final once `gather` is done
        self.target_bases: set[str] = set()
        self.emptied: set[str] = set()
        self.waiting: dict[str, str] = {}  # deployment -> why its index_lost chunks wait (`prune_tiers.unstated`)
        self.fig: S._Figures | None = None
        self.protect: set[str] = set()  # deployments another is planned into: no tier class takes them
        self.whole: set[str] = set()  # deployments unreadable_namespaces takes whole
        self.protected: Any = None  # rows some row names as its target (ascending)
        self.fit = bytearray()  # pass A: per row 1 ok, 2 its own target (a migrated chunk's target is both)
        self._secondary = False  # some rank file (findings.SECONDARY) to pair with its primary

    def gather(self, chosen: set[str] | None, engine_stopped: bool) -> bool:
        """Passes 0 to D; False when a row is of a namespace that is not a tier (the
        manifest is not for this path)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        tier_of = self.tiers.tier_of
        # pass 0
        bases: set[str] = set()
        protect: set[str] = set(self.journal_targets)  # deployments another is planned into
        stale: dict[str, list[bool]] = {}  # deployment -> [all stale or residue, any stale]
        residueish = ("tmp_leftover", *P.RESIDUE_STATUSES, *T.PAIR_RESIDUE)
        for _, c in S._batches(self.path, ("source_base", "target_base", "status")):
            self.n += len(c["source_base"])
            src = c["source_base"]
            is_tier = fold_bases(c, tier_of, bases, protect, self.alone)
            if is_tier is None:
                return False
            st = P._in(c["status"], T.STALE_STATUSES)
            g = pa.table({"ns": src, "all": pc.or_(st, P._in(c["status"], residueish)), "any": st}) \
                .filter(is_tier).group_by("ns").aggregate([("all", "all"), ("any", "any")])
            for ns, a, s in zip(*(g[k].to_pylist() for k in ("ns", "all_all", "any_any"))):
                was = stale.setdefault(ns, [True, False])
                was[:] = [was[0] and a, was[1] or s]
        self.target_bases = (bases - {""}) | set(self.journal_targets)
        self.protect = protect
        self.whole = {ns for ns, (a, s) in stale.items() if a and s and ns not in protect and ns not in self.used}
        self.fig = S._Figures(self.meta.get("namespaces") or {}, self.target_bases, self.used)
        self._pass_a()
        if self.fig.migrated_to is not None and self._secondary:
            self.fig.paired_to, _ = S._pass_b(self.path, self.fig, {}, {}, True)
        pairs = self._pass_c()
        if pairs is not None:
            self._pairs(*pairs)
        self._pass_d(chosen, engine_stopped)
        return True

    def _pass_a(self) -> None:
        """The protected rows (a file some row names as its target) and the migrated rows'
        targets (`prune_tiers.migrated`)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        digests = S.RowDigests(self.n)  # each row's path digest, null for a row of no tier
        named: list = []  # the digests of the paths rows name as their target
        cand: dict[str, list] = {"row": [], "d": []}
        migrated = "migrated" in self.classes
        for offset, c in S._batches(self.path, _PASS_A):
            src, status, rel, tr = c["source_base"], c["status"], c["relpath"], c["target_relpath"]
            is_tier = P._in(src, self.tiers.tier_of)
            digests.put(offset, S._digests(rel), is_tier)
            has = P._b(pc.not_equal(tr, ""))
            if pc.any(has).as_py():
                named.append(pc.unique(S._digests(pc.filter(tr, has))))
            ok = P._b(pc.equal(status, "ok"))
            own = P._b(pc.equal(tr, rel))
            self.fit += _bytes(pc.add(ok.cast(pa.int8()), pc.multiply(own.cast(pa.int8()), 2)))
            if not migrated:
                continue
            cand_mask = pc.and_(pc.and_(is_tier, P._b(pc.equal(c["action"], "already_present"))),
                                pc.and_(P._in(status, P.MIGRATED_STATUSES), P._b(pc.not_equal(tr, rel))))
            if pc.any(cand_mask).as_py():
                cand["row"].append(pc.filter(S._rows(offset, len(src)), cand_mask))
                cand["d"].append(S._digests(pc.filter(tr, cand_mask)))
            self._secondary = self._secondary or bool(pc.any(pc.and_(P._in(c["finding"], findings.SECONDARY),
                                                                     ok)).as_py())
        binary = pa.binary(16)
        hay = digests.array()
        del digests
        self.protected = pa.array([], pa.int64())
        if named:
            self.protected = S._rows_in(hay, named)
            del named
        if cand["row"]:
            rows, d = S._concat(cand["row"], pa.int64()), S._concat(cand["d"], binary)
            cand.clear()
            j = S._index_in(d, hay)
            del d
            fit = pa.Array.from_buffers(pa.int8(), len(self.fit), [None, pa.py_buffer(bytes(self.fit))])
            hit = P._b(pc.equal(pc.take(fit, j), 3))
            if pc.any(hit).as_py():
                self.fig.migrated_to = (pc.filter(rows, hit), pc.filter(j, hit))  # type: ignore[union-attr]
        del hay
        self.fit = bytearray()

    @staticmethod
    def _lookup_mask(rows: Any, offset: int, k: int) -> Any:
        """Whether each of the k rows from `offset` is among `rows` (ascending)."""
        return S._lookup((rows, rows), offset, k)[0] if len(rows) else S._lookup(None, offset, k)[0]

    def _pass_c(self) -> tuple[Any, Any, bytearray] | None:
        """Each row's class before the pairs; (the pair rows, their partner's digest, each
        row's `held` byte) when the manifest has GDS pairs."""
        import pyarrow as pa
        import pyarrow.compute as pc

        fig = self.fig
        assert fig is not None
        self.code = bytearray(self.n)
        held = bytearray(self.n)
        pair_rows: list = []
        partner: list = []
        for offset, c in S._batches(self.path, _PASS_C):
            src, status, rel = c["source_base"], c["status"], c["relpath"]
            k = len(src)
            is_tier = P._in(src, self.tiers.tier_of)
            code = pa.array([0] * k, pa.int8())
            if "migrated" in self.classes:
                mig, _ = fig.paired(offset, *fig.migrated(offset, k))
                code = pc.if_else(mig, pa.scalar(P.CODES["migrated"], pa.int8()), code)
            old = P._b(pc.less_equal(pc.fill_null(c["mtime_ns"], 0), self.cutoff))
            tmp = pc.and_(P._b(pc.equal(status, "tmp_leftover")), old)
            if "residue" in self.classes and self.alone:  # rows of no namespace: the generic rule
                plain = pc.invert(is_tier)
                code = _assign(code, pc.and_(plain, pc.or_(P._in(status, P.RESIDUE_STATUSES), tmp)), "residue")
            guarded = pc.and_(is_tier, pc.or_(P._in(src, self.protect), self._lookup_mask(self.protected, offset, k)))
            free = pc.and_(is_tier, pc.invert(guarded))
            if "unreadable_namespaces" in self.classes:
                code = _assign(code, pc.and_(free, P._in(src, self.whole)), "unreadable_namespaces")
            if "residue" in self.classes:
                taken = pc.or_(P._in(status, (*P.RESIDUE_STATUSES, *T.PAIR_RESIDUE)), tmp)
                code = _assign(code, pc.and_(free, taken), "residue")
            if "index_lost" in self.classes:
                code = _assign(code, pc.and_(free, P._b(pc.equal(status, T.INDEX_LOST))), "index_lost")
            if not self.alone:  # (a rank file of another namespace paired with a tier's primary: none)
                code = pc.if_else(is_tier, code, pa.scalar(0, pa.int8()))
            _put(self.code, offset, code)
            _put(held, offset, pc.or_(guarded, P._in(status, T.NOT_ENGINE_WRITES)))
            side = pc.and_(is_tier, P._b(pc.ends_with(rel, L.SIDECAR)))
            gds = pc.and_(pc.and_(is_tier, pc.invert(side)),
                          pc.or_(*(P._b(pc.ends_with(rel, s)) for s in L.GDS_SUFFIXES)))
            either = pc.or_(side, gds)
            if pc.any(either).as_py():
                at = pc.indices_nonzero(either)
                r = pc.take(rel, at)
                their = pc.if_else(pc.take(side, at), pc.replace_substring_regex(r, f"{T._re(L.SIDECAR)}$", ""),
                                   pc.binary_join_element_wise(r, pa.scalar(L.SIDECAR), ""))
                pair_rows.append(pc.add(at.cast(pa.int64()), offset))
                partner.append(S._digests(their))
        if not pair_rows:
            return None
        return S._concat(pair_rows, pa.int64()), S._concat(partner, pa.binary(16)), held

    def _pairs(self, rows: Any, partner_digest: Any, held: bytearray) -> None:
        """`prune_tiers.with_pairs` over the class bytes: a pair one of whose files is held
        stays whole; a file whose partner is taken goes with it, in its class."""
        import pyarrow as pa
        import pyarrow.compute as pc

        every = S._concat([S._digests(c["relpath"]) for _, c in S._batches(self.path, ("relpath",))], pa.binary(16))
        their = S._index_in(partner_digest, every)
        del every, partner_digest
        has = pc.is_valid(their)
        rows, their = pc.filter(rows, has), pc.filter(their, has)
        held_a = pa.Array.from_buffers(pa.int8(), self.n, [None, pa.py_buffer(bytes(held))])
        blocked = pc.or_(pc.not_equal(pc.take(held_a, rows), 0), pc.not_equal(pc.take(held_a, their), 0))
        del held_a
        _set_bytes(self.code, pc.filter(rows, blocked), None)
        code = _int8(self.code, 0, self.n)
        mine, theirs = pc.take(code, rows), pc.take(code, their)
        del code
        takes = pc.and_(pc.equal(mine, 0), pc.not_equal(theirs, 0))
        _set_bytes(self.code, pc.filter(rows, takes), pc.filter(theirs, takes))

    def _pass_d(self, chosen: set[str] | None, engine_stopped: bool) -> None:
        """The namespaces the selection empties (a config.json of one takes the class of
        its first file), then the index_lost chunks waiting for a statement."""
        import pyarrow as pa
        import pyarrow.compute as pc

        acc: dict[str, list] = {}
        configs: list = []
        lost: dict[str, list[int]] = {}
        for offset, c in S._batches(self.path, _PASS_D):
            src = c["source_base"]
            k = len(src)
            code = _int8(self.code, offset, k)
            config = P._b(pc.equal(c["relpath"], pc.binary_join_element_wise(src, layout.CONFIG_NAME, "/")))
            has_ns = P._b(pc.not_equal(src, ""))
            rows = S._rows(offset, k)
            S._fold_emptied(acc, src, code, config, has_ns, rows)
            cfg = pc.and_(config, has_ns)
            if pc.any(cfg).as_py():
                configs.append(pa.table({"row": pc.filter(rows, cfg), "code": pc.filter(code, cfg),
                                         **{name: pc.filter(col, cfg) for name, col in c.items()}}))
            if "index_lost" in self.classes:
                self._count_lost(lost, c, code, chosen, pc.invert(cfg))
        emptied = {ns: (v[3] if v[3] is not None else P.CODES["migrated"])
                   for ns, v in acc.items() if v[0] and v[1] == v[2]}
        self.emptied = set(emptied)
        for t in configs:  # (few: a namespace's config.json each)
            own = P._in(t["status"], ("own_artifact", "foreign")).to_pylist()
            final = [emptied.get(ns, 0) if not cur and not o else cur for ns, cur, o in
                     zip(t["source_base"].to_pylist(), t["code"].to_pylist(), own)]
            for row, k in zip(t["row"].to_pylist(), final):
                self.code[row] = k
            if "index_lost" in self.classes:
                cols = {name: t[name].combine_chunks() for name in _PASS_D}
                self._count_lost(lost, cols, pa.array(final, pa.int8()), chosen,
                                 pa.array([True] * t.num_rows, pa.bool_()))
        self.waiting = T.unstated(self.tiers, {ns: (n, b) for ns, (n, b) in lost.items()}, engine_stopped) \
            if lost else {}

    @staticmethod
    def _count_lost(lost: dict[str, list[int]], c: dict[str, Any], code: Any, chosen: set[str] | None,
                    mask: Any) -> None:
        """Per deployment, the files and bytes of its selected index_lost rows (of `mask`)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        take = pc.and_(pc.and_(mask, P._prunable(c)), pc.equal(code, P.CODES["index_lost"]))
        if chosen is not None:
            take = pc.and_(take, P._in(c["source_base"], chosen))
        if not pc.any(take).as_py():
            return
        g = pa.table({"ns": c["source_base"], "size": pc.fill_null(c["size"], 0)}).filter(take) \
            .group_by("ns").aggregate([("size", "count"), ("size", "sum")])
        for ns, n, b in zip(*(g[k].to_pylist() for k in ("ns", "size_count", "size_sum"))):
            was = lost.setdefault(ns, [0, 0])
            was[0] += n
            was[1] += b or 0

    def rows(self, chosen: set[str] | None) -> Iterator[Any]:
        """Pass E: the selected rows (prunable, of `chosen`, not waiting), a batch's at a
        time: row, code, target and PLAN_ROW_COLUMNS."""
        import pyarrow as pa
        import pyarrow.compute as pc

        fig = self.fig
        assert fig is not None
        waiting = set(self.waiting)
        for offset, c in S._batches(self.path, _PASS_E):
            k = len(c["relpath"])
            code = _int8(self.code, offset, k)
            keep = pc.and_(pc.not_equal(code, 0), P._prunable(c))
            if chosen is not None:
                keep = pc.and_(keep, P._in(c["source_base"], chosen))
            if waiting:
                keep = pc.and_(keep, pc.invert(pc.and_(pc.equal(code, P.CODES["index_lost"]),
                                                       P._in(c["source_base"], waiting))))
            if not pc.any(keep).as_py():
                continue
            target = pa.nulls(k, pa.int64())
            if "migrated" in self.classes:
                mig, target = fig.paired(offset, *fig.migrated(offset, k))
                target = pc.if_else(mig, target, pa.scalar(None, pa.int64()))
            cols = {"row": S._rows(offset, k), "code": code, "target": target,
                    **{name: c[name] for name in P.PLAN_ROW_COLUMNS}}
            yield pa.table({name: pc.filter(v, keep) for name, v in cols.items()})
        fig.migrated_to = fig.paired_to = None


def units(manifest_path: str, tiers: T.Tiers, names: set[str]) -> dict[str, tuple[list[str], list[str], int]]:
    """`prune_tiers.units` in one pass over the manifest: per tier label, its
    deployments, its folders (the tier folder and those its files sit in) and its
    newest file mtime; files not the engine's do not count."""
    import pyarrow.compute as pc

    wanted = {tiers.tier_of[ns] for ns in names if ns in tiers.tier_of}
    if not wanted:
        return {}
    members = [ns for ns, t in tiers.tier_of.items() if t in wanted]
    out = T.empty_units(tiers, wanted)
    for _, c in S._batches(manifest_path, ("source_base", "relpath", "mtime_ns", "status")):
        rows = pc.and_(P._in(c["source_base"], members), pc.invert(P._in(c["status"], T.NOT_ENGINE_WRITES)))
        if pc.any(rows).as_py():
            T.fold_units(out, tiers, c, rows)
    return {label: (ms, sorted(f), n) for label, (ms, f, n) in out.items()}
