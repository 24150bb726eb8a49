"""Prune's selection over the manifest in record batches, for a manifest of
directory-layout families (no LMCache tier, no Mooncake store): the reports' reclaimable
figures (`reclaimable`) in a working set that does not grow with the manifest's rows,
and a prune plan's rows (`plan_rows`) holding only the selected ones.

The rules are `prune._select`'s (migration.md §6; their shared vocabulary and masks are
in prune_rules.py), which reads every column whole; that one stays the reference (and
the path for tiers and stores, whose rules read across their rows). What a row's class
needs of the rest of the manifest is gathered first, compactly (`gather`):

    pass 0   the target bases, and per namespace whether all its files are unreadable
    pass A   the rows of target namespaces: a 128-bit digest of their path, and their
             row, when healthy (the file a migrated block's bytes stay in); the migrated
             candidates (row, digest of their target path); a superseded era's held hashes.
             After it one lookup of every candidate: a migrated row -> its target's row
    pass B   only with rank files to pair or a superseded era to prove: the primaries of
             migrated blocks (key digest, hashes, target row), the rank files to pair
             (row, their primary's key digest, hashes) and each era's verdict. After it
             one lookup of every rank file's primary: a paired row -> its target's row
    pass C   each row's class under each selection (`_Classes`): the figures keep of the
             selected rows only (dev, inode, size, nlink, row), 40-odd bytes, because
             whether a file frees its bytes depends on its inode's other names; a plan
             keeps the selected rows' columns
    pass D   the newest write of the namespaces counted, for the quiet period (folders
             lstat'ed as their rows are read: `newest_writes`)

Each pass reads BATCH rows at a time; dictionary columns are decoded per batch. What
must be looked up across the whole manifest is looked up once, after its pass (a hash
table over all targets or primaries built per batch would make the passes quadratic);
pass C slices the sorted (row -> target row) results by its batch's rows.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvmigrate import findings, layout
from kvmigrate import manifest as mf
from kvmigrate.classify import UNREADABLE_STATUSES

BATCH = 16_384
LOOKUP_PARTS = 8  # a whole-manifest lookup runs in parts by digest: its hash table is an eighth of the rows
_SELECTIONS = ("migrated", "unreadable_namespaces", "residue", "all")  # index_lost, tails: tiers' and stores' only


def _batches(manifest_path: str, names: Iterable[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(the first row's number, the batch's columns with dictionaries decoded)."""
    import pyarrow as pa

    names = list(dict.fromkeys(names))
    offset = 0
    for b in mf.iter_batches(manifest_path, columns=names, batch_size=BATCH):
        c = {}
        for name in names:
            col = b.column(name)
            c[name] = col.cast(col.type.value_type) if pa.types.is_dictionary(col.type) else col
        yield offset, c
        offset += b.num_rows


def _index_in(needles: Any, haystack: Any) -> Any:
    """`pc.index_in(needles, value_set=haystack)` (a value's first position; `needles`
    has no null), in LOOKUP_PARTS parts by the digests' first byte: each part's hash
    table holds a part of the haystack."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(needles)
    if not n or not len(haystack):
        return pa.nulls(n, pa.int64())
    part_h, part_n = _part(haystack), _part(needles)
    where, found = [], []
    for p in range(LOOKUP_PARTS):
        hm, nm = pc.equal(part_h, p), pc.equal(part_n, p)
        if not pc.any(nm).as_py():
            continue
        at = pc.index_in(pc.filter(needles, nm), value_set=pc.filter(haystack, hm))
        found.append(pc.take(pc.indices_nonzero(hm).cast(pa.int64()), at))
        where.append(pc.indices_nonzero(nm).cast(pa.int64()))
    order = pc.sort_indices(pa.concat_arrays(where))
    return pc.take(pa.concat_arrays(found), order)


def _part(digests: Any) -> Any:
    """Each 16-byte digest's lookup part, from its first byte (0 for a null)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(digests)
    data = digests.buffers()[1]
    first = bytes(memoryview(data)[16 * digests.offset:16 * (digests.offset + n):16]) if n else b""
    return pc.bit_wise_and(pa.Array.from_buffers(pa.uint8(), n, [None, pa.py_buffer(first)]),
                           pa.scalar(LOOKUP_PARTS - 1, pa.uint8()))


def _rows_in(hay: Any, values: list) -> Any:
    """The positions of `hay` (digests, null for none) whose value is among `values` (a
    list of digest arrays, repeats allowed: `pc.is_in`), ascending, in LOOKUP_PARTS parts
    by the digests' first byte: no part's table holds more than a part of the values,
    nor are they ever concatenated whole."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values = [v for v in values if len(v)]
    if not len(hay) or not values:
        return pa.array([], pa.int64())
    from kvmigrate.migrate.prune_rules import _b

    part_h, part_v = _part(hay), [_part(v) for v in values]
    out = []
    for p in range(LOOKUP_PARTS):
        hm = _b(pc.and_(pc.equal(part_h, p), pc.is_valid(hay)))
        at = pc.indices_nonzero(hm).cast(pa.int64())
        mine = pa.concat_arrays([pc.filter(v, pc.equal(vp, p)) for v, vp in zip(values, part_v)])
        hit = _b(pc.is_in(pc.filter(hay, hm), value_set=mine))
        out.append(pc.filter(at, hit))
    rows = pa.concat_arrays(out)
    return pc.take(rows, pc.sort_indices(rows))


def _rows(offset: int, n: int) -> Any:
    import pyarrow as pa

    return pa.array(range(offset, offset + n), pa.int64())


def _digests(col: Any) -> Any:
    """A 128-bit digest per string (null for null): paths compared without holding them.
    Hashed straight from the array's buffers into one buffer: no Python object per row
    outlives its step (a list of them pinned the allocator's pages batch after batch)."""
    import pyarrow as pa

    n = len(col)
    if not n:
        return pa.array([], pa.binary(16))
    _, offsets, data = col.buffers()
    offs = memoryview(offsets).cast("q" if pa.types.is_large_string(col.type) else "i")[col.offset:col.offset + n + 1]
    view = memoryview(data) if data is not None else memoryview(b"")
    out = bytearray(16 * n)
    digest = xxhash.xxh3_128_digest
    for i in range(n):
        out[16 * i:16 * i + 16] = digest(view[offs[i]:offs[i + 1]])
    return _fixed(out, n, col)


def _fixed(out: bytearray, n: int, like: Any) -> Any:
    """binary(16) values from one buffer, null where `like` is null."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = pa.Array.from_buffers(pa.binary(16), n, [None, pa.py_buffer(out)])
    return pc.if_else(pc.is_valid(like), arr, pa.scalar(None, pa.binary(16))) if like.null_count else arr


def _key_digests(d: Any, g: Any, h: Any, r: Any) -> Any:
    """A digest per block key (deployment, group, block hash, rank): `_with_secondaries`' key."""
    n = len(d)
    out = bytearray(16 * n)
    for i, (dv, gv, hv, rv) in enumerate(zip(d.to_pylist(), g.to_pylist(), h.to_pylist(), r.to_pylist())):
        out[16 * i:16 * i + 16] = xxhash.xxh3_128_digest(b"%s\0%d\0%d\0%s" % (dv.encode(), gv, rv, hv))
    return _fixed(out, n, d)


class RowDigests:
    """A 128-bit digest per manifest row (a path's), null for the rows not wanted, written
    batch by batch into one buffer of the manifest's rows: half the peak of a list of
    parts concatenated at the end (16 bytes a row, not 32)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.data = bytearray(16 * n)
        self.wanted = bytearray(n)

    def put(self, offset: int, digests: Any, wanted: Any) -> None:
        """The digests of the rows from `offset` (binary(16)), those of `wanted` (a mask) kept."""
        import pyarrow as pa

        k = len(digests)
        self.data[16 * offset:16 * (offset + k)] = \
            memoryview(digests.buffers()[1])[16 * digests.offset:16 * (digests.offset + k)]
        wanted = wanted.cast(pa.int8())
        self.wanted[offset:offset + k] = memoryview(wanted.buffers()[1])[wanted.offset:wanted.offset + k]

    def array(self) -> Any:
        """The digests as one binary(16) array over the buffer (not copied); the buffer is
        the array's from then on."""
        import pyarrow as pa
        import pyarrow.compute as pc

        valid = pc.not_equal(pa.Array.from_buffers(pa.int8(), self.n, [None, pa.py_buffer(self.wanted)]), 0)
        self.wanted = bytearray()
        out = pa.Array.from_buffers(pa.binary(16), self.n, [valid.buffers()[1], pa.py_buffer(self.data)])
        self.data = bytearray()
        return out


def _concat(parts: list, typ: Any) -> Any:
    import pyarrow as pa

    return pa.concat_arrays(parts) if parts else pa.array([], typ)


class Names:
    """Namespace names as small int codes (the compact rows hold a code, not a string)."""

    def __init__(self) -> None:
        self.code: dict[str | None, int] = {}
        self.names: list[str | None] = []

    def _code(self, name: str | None) -> int:
        k = self.code.get(name)
        if k is None:
            k = self.code[name] = len(self.names)
            self.names.append(name)
        return k

    def codes(self, col: Any) -> Any:
        import pyarrow as pa
        import pyarrow.compute as pc

        coded = col.dictionary_encode()
        ids = pc.take(pa.array([self._code(v) for v in coded.dictionary.to_pylist()], pa.int32()), coded.indices)
        return pc.fill_null(ids, self._code(None)) if ids.null_count else ids

    def name(self, k: int) -> str | None:
        return self.names[k]


@dataclass
class _Figures:
    """What the passes gather of the whole manifest, and the rules' per-row masks over a batch."""

    classes_meta: dict[str, dict]
    target_bases: set[str]
    used: set[str]
    # the namespaces of LMCache tiers and Mooncake stores beside the directory families
    # (their own rules take their rows: the generic ones never do, as in `_select`)
    apart: frozenset[str] = frozenset()
    whole: set[str] = field(default_factory=set)  # namespaces unreadable_namespaces takes whole
    # (rows ascending, their targets' rows) as two int64 arrays: the migrated rows (pass A)
    # and the rank files paired with a migrated primary (pass B), each with the row of the
    # file its bytes stay in
    migrated_to: tuple[Any, Any] | None = None
    paired_to: tuple[Any, Any] | None = None

    def in_target(self, c: dict[str, Any]) -> Any:
        import pyarrow.compute as pc

        from kvmigrate.migrate.prune_rules import _in

        return pc.and_(_in(c["source_base"], self.target_bases), self.plain(c))

    def plain(self, c: dict[str, Any]) -> Any:
        """The rows the generic rules may take: of a directory family, or of no namespace."""
        import pyarrow.compute as pc

        from kvmigrate.migrate.prune_rules import _in

        return pc.invert(_in(c["source_base"], self.apart))

    def migrated(self, offset: int, k: int) -> tuple[Any, Any]:
        """(a block whose bytes the scan found at its target, in a healthy file of a target
        namespace (`_select`'s first pass); the row of that file, else null), for the k
        rows from `offset`."""
        return _lookup(self.migrated_to, offset, k)

    def paired(self, offset: int, mig: Any, target: Any) -> tuple[Any, Any]:
        """`mig` plus the rank files (findings.SECONDARY, status ok) whose block's primary
        is migrated (a replica only when its hash proves it equal), with the primary's target."""
        import pyarrow.compute as pc

        if self.paired_to is None:
            return mig, target
        paired, their = _lookup(self.paired_to, offset, len(mig))
        return pc.or_(mig, paired), pc.if_else(paired, their, target)


def _lookup(found: tuple[Any, Any] | None, offset: int, k: int) -> tuple[Any, Any]:
    """(whether each of the k rows from `offset` is among `found`'s rows, its target there,
    else null): the slice of `found` in that range, found by bisection."""
    import pyarrow as pa
    import pyarrow.compute as pc

    lo = hi = 0
    if found is not None:
        rows, targets = found
        lo, hi = _bisect(rows, offset), _bisect(rows, offset + k)
    if lo == hi:
        return pa.array([False] * k, pa.bool_()), pa.nulls(k, pa.int64())
    where = pc.index_in(_rows(offset, k), value_set=rows.slice(lo, hi - lo))
    return pc.is_valid(where), pc.take(targets.slice(lo, hi - lo), where)


def _bisect(rows: Any, row: int) -> int:
    """The first position in `rows` (ascending) whose row is >= row."""
    lo, hi = 0, len(rows)
    while lo < hi:
        mid = (lo + hi) // 2
        if rows[mid].as_py() < row:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _key_columns(c: dict[str, Any], at: Any, rank: str) -> tuple[Any, Any, Any, Any]:
    """The block key columns of the rows `at` (`_with_secondaries`' `keyed`)."""
    import pyarrow.compute as pc

    from kvmigrate.migrate.prune_rules import _b

    d, src = pc.take(c["deployment"], at), pc.take(c["source_base"], at)
    return (pc.if_else(_b(pc.not_equal(d, "")), d, pc.fill_null(src, "")), pc.fill_null(pc.take(c["group"], at), -1),
            pc.fill_null(pc.take(c["block_hash"], at), b"\0none"), pc.fill_null(pc.take(c[rank], at), -1))


_PASS_C = ("relpath", "source_base", "deployment", "status", "action", "finding", "target_relpath", "group",
           "block_hash", "rank", "primary_rank", "payload_xxh3_128", "content_xxh3_128", "mtime_ns", "dev", "inode",
           "size", "nlink", "family")


def gather(manifest_path: str, meta: dict[str, Any], used_namespaces: tuple[set[str], set[str]],
           classes: tuple[str, ...], apart: frozenset[str] = frozenset()) -> _Figures:
    """Passes 0, A and B: what the rules of `classes` need of the whole manifest. `apart`:
    the namespaces of tiers and stores beside the directory families (`_Figures.apart`)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from kvmigrate.migrate import prune_rules as P

    targets, used = used_namespaces
    # pass 0: the target bases; per namespace, whether it is all unreadable
    bases: set[str] = set()
    unread_ns: dict[str, list[bool]] = {}  # ns -> [all unreadable or residue, any unreadable, any target path]
    fig = _Figures(meta.get("namespaces") or {}, set(), used, apart)
    for _, c in _batches(manifest_path, ("target_base", "source_base", "status", "target_relpath")):
        bases.update(pc.unique(c["target_base"]).drop_null().to_pylist())
        if "unreadable_namespaces" not in classes:
            continue
        src, status = c["source_base"], c["status"]
        unread = P._in(status, UNREADABLE_STATUSES)
        g = pa.table({"ns": src, "all": pc.or_(unread, P._in(status, ("tmp_leftover", *P.RESIDUE_STATUSES))),
                      "any": unread, "tr": P._b(pc.not_equal(c["target_relpath"], ""))}) \
            .filter(pc.and_(P._b(pc.not_equal(src, "")), fig.plain(c))) \
            .group_by("ns").aggregate([("all", "all"), ("any", "any"), ("tr", "any")])
        for ns, a, u, tr in zip(*(g[k].to_pylist() for k in ("ns", "all_all", "any_any", "tr_any"))):
            was = unread_ns.setdefault(ns, [True, False, False])
            was[:] = [was[0] and a, was[1] or u, was[2] or tr]
    fig.target_bases = (bases - {""}) | targets
    fig.whole = {ns for ns, (a, u, tr) in unread_ns.items()
                 if a and u and not tr and ns not in fig.target_bases and ns not in used}
    eras = _superseded_candidates(list(unread_ns), fig)
    del unread_ns
    migrated = "migrated" in classes
    if not migrated and not eras:
        return fig

    # pass A: the files of target namespaces; the migrated candidates; what the eras'
    # models hold; rank files to pair
    in_targets: dict[str, list] = {"d": [], "row": [], "ok": []}  # the files of target namespaces
    candidates: dict[str, list] = {"row": [], "d": []}  # the migrated candidates, their target path
    held: dict[Any, list] = {m: [] for m in eras}
    any_secondary = False
    for offset, c in _batches(manifest_path, ("source_base", "status", "action", "relpath", "target_relpath",
                                              "finding", "content_xxh3_128")):
        src, status = c["source_base"], c["status"]
        ok = P._b(pc.equal(status, "ok"))
        in_target = fig.in_target(c)
        if migrated and pc.any(in_target).as_py():
            in_targets["d"].append(_digests(pc.filter(c["relpath"], in_target)))
            in_targets["row"].append(pc.filter(_rows(offset, len(src)), in_target))
            in_targets["ok"].append(pc.filter(ok, in_target))
        if migrated:
            cand = pc.and_(pc.and_(P._b(pc.not_equal(src, "")), pc.invert(in_target)),
                           pc.and_(P._b(pc.equal(c["action"], "already_present")), P._in(status, P.MIGRATED_STATUSES)))
            cand = pc.and_(cand, fig.plain(c))
            if pc.any(cand).as_py():
                candidates["row"].append(pc.filter(_rows(offset, len(src)), cand))
                candidates["d"].append(_digests(pc.filter(c["target_relpath"], cand)))
        for model, (model_bases, _) in eras.items():
            mask = pc.and_(P._in(src, model_bases), ok)
            if pc.any(mask).as_py():
                held[model].append(pc.unique(pc.filter(c["content_xxh3_128"], mask)).drop_null())
        any_secondary = migrated and (any_secondary or bool(
            pc.any(pc.and_(P._in(c["finding"], findings.SECONDARY), ok)).as_py()))
    fig.migrated_to = _at_healthy_targets(candidates, in_targets)
    del candidates, in_targets
    held_sets = {m: s for m, s in ((m, pc.unique(_concat(p, pa.binary(16)))) for m, p in held.items()) if len(s)}
    del held

    # pass B: the primaries of migrated blocks and the rank files to pair; each era's
    # verdict per namespace
    pair = any_secondary and fig.migrated_to is not None
    if pair or held_sets:
        fig.paired_to, good = _pass_b(manifest_path, fig, eras, held_sets, pair)
        fig.whole |= {ns for ns, (g, b) in good.items() if g and b}
    return fig


def _at_healthy_targets(candidates: dict[str, list], in_targets: dict[str, list]) -> tuple[Any, Any] | None:
    """(row, target row) of the candidates whose target path's first row among the target
    namespaces' files is `ok` (`_select`'s first pass: `index_in` finds a path's first
    row), in one lookup; the parts are emptied as they are joined."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from kvmigrate.migrate.prune_rules import _b

    if not candidates["row"] or not in_targets["row"]:
        return None
    pos = _index_in(_take_whole(candidates, "d", pa.binary(16)), _take_whole(in_targets, "d", pa.binary(16)))
    hit = _b(pc.take(_take_whole(in_targets, "ok", pa.bool_()), pos))
    rows, targets = _take_whole(candidates, "row", pa.int64()), _take_whole(in_targets, "row", pa.int64())
    if not pc.any(hit).as_py():
        return None
    return pc.filter(rows, hit), pc.filter(pc.take(targets, pos), hit)


def _take_whole(parts: dict[str, list], name: str, typ: Any) -> Any:
    """The column `name` of `parts` as one array, its parts let go (not held twice)."""
    whole = _concat(parts[name], typ)
    parts[name] = []
    return whole


def _superseded_candidates(namespaces: list[str], fig: _Figures) -> dict[Any, tuple[list[str], list[str]]]:
    """model -> (its target bases, the namespaces of a superseded era of it): `superseded`'s
    candidates, from the manifest's metadata."""
    from kvmigrate.identity.values import ORPHANED

    by_model: dict[Any, list[str]] = {}
    for ns in namespaces:
        m = fig.classes_meta.get(ns) or {}
        why = str((m.get("target") or {}).get("unreachable") or "")
        if ns not in fig.target_bases and ns not in fig.used and why and not why.startswith(ORPHANED):
            by_model.setdefault(m.get("model_name"), []).append(ns)
    return {model: ([b for b in fig.target_bases if (fig.classes_meta.get(b) or {}).get("model_name") == model], names)
            for model, names in by_model.items()}


def _pass_b(manifest_path: str, fig: _Figures, eras: dict, held: dict,
            pair: bool) -> tuple[tuple[Any, Any] | None, dict]:
    """(the rank files paired with a migrated primary: rows, their primary's target row;
    per namespace of an era: (every file good, any block file))."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from kvmigrate.migrate import prune_rules as P

    # the primaries are fig.migrated_to's rows, in its order: their key (each batch's
    # backwards), payload (None: a batch of none) and content hashes
    prims: dict[str, list] = {"key": [], "payload": [], "content": []}
    # the rank files to pair: row, their primary's key, the hash proving a replica (the
    # payload's if it has one, else the whole file's), whether it is the payload's, replica
    secs: dict[str, list] = {"row": [], "key": [], "proof": [], "by_payload": [], "replica": []}
    good: dict[str, tuple[bool, bool]] = {}
    for offset, c in _batches(manifest_path, _PASS_C):
        src, status = c["source_base"], c["status"]
        ok = P._b(pc.equal(status, "ok"))
        if pair:
            mig, _ = fig.migrated(offset, len(src))
            if pc.any(mig).as_py():
                at = pc.indices_nonzero(mig)
                prims["key"].append(_key_digests(*_key_columns(c, pc.take(at, _backwards(len(at))), "rank")))
                payload = pc.take(c["payload_xxh3_128"], at)
                prims["payload"].append(payload if payload.null_count < len(payload) else None)
                prims["content"].append(pc.take(c["content_xxh3_128"], at))
            sec = pc.and_(P._in(c["finding"], findings.SECONDARY), ok)
            if pc.any(sec).as_py():
                at = pc.indices_nonzero(sec)
                payload = pc.take(c["payload_xxh3_128"], at)
                secs["row"].append(pc.take(_rows(offset, len(src)), at))
                secs["key"].append(_key_digests(*_key_columns(c, at, "primary_rank")))
                secs["proof"].append(pc.coalesce(payload, pc.take(c["content_xxh3_128"], at)))
                secs["by_payload"].append(pc.is_valid(payload))
                secs["replica"].append(P._b(pc.equal(pc.take(c["finding"], at), findings.REPLICA_OF_PRIMARY)))
        for model, (_, names) in eras.items():
            if model not in held:
                continue
            g = pc.or_(P._in(status, ("tmp_leftover", *P.RESIDUE_STATUSES)), pc.and_(ok, pc.or_(
                pc.is_null(c["block_hash"]), P._b(pc.is_in(c["content_xxh3_128"], value_set=held[model])))))
            per = pa.table({"ns": src, "good": g, "block": pc.is_valid(c["block_hash"])}) \
                .filter(P._in(src, names)).group_by("ns").aggregate([("good", "all"), ("block", "any")])
            for ns, gg, bb in zip(*(per[k].to_pylist() for k in ("ns", "good_all", "block_any"))):
                was = good.get(ns, (True, False))
                good[ns] = (was[0] and gg, was[1] or bb)
    return (_with_primaries(secs, prims, fig.migrated_to) if fig.migrated_to is not None else None), good


def _backwards(n: int) -> Any:
    import pyarrow as pa

    return pa.array(range(n - 1, -1, -1), pa.int64())


def _with_primaries(secs: dict[str, list], prims: dict[str, list],
                    migrated_to: tuple[Any, Any]) -> tuple[Any, Any] | None:
    """(row, target row) of the rank files whose block key has a migrated primary -- the
    last one of the key, as a dict would keep -- a replica only when its hash proves it
    equal to that primary's (`_with_secondaries`), in one lookup; the parts are emptied
    as they are joined."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from kvmigrate.migrate.prune_rules import _b

    if not secs["row"] or not prims["key"]:
        return None
    binary = pa.binary(16)
    # index_in finds a key's first occurrence: in the primaries' keys backwards, its last primary
    backwards = _concat(prims["key"][::-1], binary)
    prims["key"] = []
    last = _index_in(_take_whole(secs, "key", binary), backwards)
    del backwards
    p = pc.subtract(len(migrated_to[0]) - 1, last.cast(pa.int64()))  # (null: no primary)
    proof, by_payload = _take_whole(secs, "proof", binary), _take_whole(secs, "by_payload", pa.bool_())
    by_its_payload = pa.scalar(False)  # (no primary has a payload: no replica is proven by one)
    if any(part is not None for part in prims["payload"]):
        payloads = _concat([part if part is not None else pa.nulls(len(like), binary)
                            for part, like in zip(prims["payload"], prims["content"])], binary)
        by_its_payload = _b(pc.equal(proof, pc.take(payloads, p)))
        del payloads
    prims["payload"] = []
    same = pc.if_else(by_payload, by_its_payload,
                      _b(pc.equal(proof, pc.take(_take_whole(prims, "content", binary), p))))
    del proof, by_payload, by_its_payload
    keep = pc.and_(pc.is_valid(p), pc.or_(pc.invert(_take_whole(secs, "replica", pa.bool_())), same))
    if not pc.any(keep).as_py():
        return None
    return pc.filter(_take_whole(secs, "row", pa.int64()), keep), pc.take(migrated_to[1], pc.filter(p, keep))


class _Classes:
    """Pass C: each row's class under each selection (name -> its classes, in CLASSES'
    order of precedence), batch by batch; per namespace what its emptying needs, so that
    the config.json rows (set aside by the caller) get their class at the end."""

    def __init__(self, fig: _Figures, selections: dict[str, tuple[str, ...]], cutoff_ns: int) -> None:
        self.fig, self.selections, self.cutoff = fig, selections, cutoff_ns
        # ns -> [a file chosen, files but config.json, those chosen, the first one's code, its row]
        self.emptied: dict[str, dict[str, list]] = {s: {} for s in selections}

    def batch(self, offset: int, c: dict[str, Any]) -> tuple[dict[str, Any], Any, Any]:
        """(a class code per row under each selection, the row of a migrated row's target,
        the config.json rows of namespaces a selection can empty)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        from kvmigrate.migrate import prune_rules as P

        fig, k = self.fig, len(c["relpath"])
        src, status = c["source_base"], c["status"]
        has_ns = P._b(pc.not_equal(src, ""))
        in_target, plain = fig.in_target(c), fig.plain(c)
        wanted = {cls for classes in self.selections.values() for cls in classes}
        one: dict[str, Any] = {}
        target = pa.nulls(k, pa.int64())
        if "migrated" in wanted:
            mig, target = fig.paired(offset, *fig.migrated(offset, k))
            one["migrated"] = pc.and_(mig, plain)
        if "unreadable_namespaces" in wanted:
            one["unreadable_namespaces"] = P._in(src, fig.whole) if fig.whole else pc.and_(has_ns, False)
        if "residue" in wanted:
            old = P._b(pc.less_equal(pc.fill_null(c["mtime_ns"], 0), self.cutoff))
            one["residue"] = pc.and_(pc.or_(P._in(status, P.RESIDUE_STATUSES),
                                            pc.and_(P._b(pc.equal(status, "tmp_leftover")), old)),
                                     pc.and_(pc.invert(in_target), plain))
        codes = {}
        for name, classes in self.selections.items():
            code = pa.array([0] * k, pa.int8())
            for cls in classes:
                if cls in one:
                    code = pc.if_else(pc.and_(one[cls], pc.equal(code, 0)), pa.scalar(P.CODES[cls], pa.int8()), code)
            codes[name] = code
        target = pc.if_else(one["migrated"], target, pa.scalar(None, pa.int64())) if "migrated" in one else target
        config = P._b(pc.equal(c["relpath"], pc.binary_join_element_wise(src, layout.CONFIG_NAME, "/")))
        emptiable = pc.and_(pc.and_(has_ns, pc.invert(in_target)), plain)
        rows = _rows(offset, k)
        for name in self.selections:
            _fold_emptied(self.emptied[name], src, codes[name], config, emptiable, rows)
        return codes, target, pc.and_(config, emptiable)

    def emptied_namespaces(self, name: str) -> dict[str, int]:
        """Namespace -> the class its config.json takes: those the selection empties (a
        file chosen, every file but config.json chosen), the class of its first file."""
        from kvmigrate.migrate import prune_rules as P

        return {ns: (v[3] if v[3] is not None else P.CODES["migrated"])
                for ns, v in self.emptied[name].items() if v[0] and v[1] == v[2]}

    def config_codes(self, name: str, configs: Any) -> Any:
        """The final codes of the set-aside config.json rows (columns source_base, status
        and `name`): an emptied namespace's takes its class, unless already chosen or
        never prunable (kvmigrate's own, foreign)."""
        import pyarrow as pa

        from kvmigrate.migrate import prune_rules as P

        cls_of = self.emptied_namespaces(name)
        mine = [cls_of.get(ns) for ns in configs["source_base"].to_pylist()]
        foreign = P._in(configs["status"], ("own_artifact", "foreign")).to_pylist()
        return pa.array([cur or (0 if m is None or f else m) for cur, m, f in
                         zip(configs[name].to_pylist(), mine, foreign)], pa.int8())


def reclaimable(manifest_path: str, meta: dict[str, Any], root: str, used_namespaces: tuple[set[str], set[str]],
                now: float, namespaces: set[str] | None) -> tuple[dict, dict, dict, list]:
    """(per class, per (class, namespace), totals, skipped) as `prune.reclaimable` reports
    them, for a manifest with no LMCache tier and no Mooncake store."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from kvmigrate.migrate import prune_rules as P

    fig = gather(manifest_path, meta, used_namespaces, P.CLASSES)
    selections: dict[str, tuple[str, ...]] = {cls: (cls,) for cls in _SELECTIONS[:-1]}
    selections["all"] = P.CLASSES
    classes = _Classes(fig, selections, int(now * 1e9 - P.DEFAULT_RESIDUE_AGE * 1e9))
    names = Names()
    kept: list = []  # the selected rows: row, ns code, dev, inode, size, nlink, a code per selection
    configs: list = []  # the config.json rows of namespaces that can be emptied (few): classed last
    n = 0
    for offset, c in _batches(manifest_path, _PASS_C):
        n = offset + len(c["relpath"])
        codes, _, cfg = classes.batch(offset, c)
        rows = _rows(offset, len(c["relpath"]))
        prunable = P._prunable(c)
        ns = names.codes(c["source_base"])
        cols = {"row": rows, "ns": ns, **{k: c[k] for k in ("dev", "inode", "size", "nlink")}, **codes}
        if pc.any(cfg).as_py():
            configs.append(pa.table({**{k: pc.filter(v, cfg) for k, v in cols.items()},
                                     "source_base": pc.filter(c["source_base"], cfg),
                                     "status": pc.filter(c["status"], cfg), "prunable": pc.filter(prunable, cfg)}))
        chosen = pc.and_(pc.and_(_any_code(codes), prunable), pc.invert(cfg))
        if pc.any(chosen).as_py():
            kept.append(pa.table({k: pc.filter(v, chosen) for k, v in cols.items()}))
    fig.migrated_to = fig.paired_to = None  # (what the rows needed of the rest of the manifest: before the tallies)
    if configs:  # a namespace emptied by a selection takes its config.json in the class of its first file
        cfgs = pa.concat_tables(configs)
        for s in _SELECTIONS:
            cfgs = cfgs.set_column(cfgs.column_names.index(s), s, classes.config_codes(s, cfgs))
        cfgs = cfgs.filter(pc.and_(cfgs["prunable"], _any_code({s: cfgs[s] for s in _SELECTIONS})))
        kept.append(cfgs.select(list(kept[0].column_names) if kept else
                                ["row", "ns", "dev", "inode", "size", "nlink", *_SELECTIONS]))
    del configs
    table = pa.concat_tables(kept) if kept else None
    del kept
    keep = None if namespaces is None else {names.code[ns] for ns in namespaces if ns in names.code}
    per_class = {cls: dict.fromkeys(P.TOTAL_KEYS, 0) for cls in P.CLASSES}
    per_ns: dict[tuple[str, str | None], dict[str, int]] = {}
    together_ns: dict[tuple[str, str | None], dict[str, int]] = {}
    for s in _SELECTIONS:
        if table is None:
            break
        tally = P.tally_stream(functools.partial(_selected, table, s, n), keep)
        named = {(cls, names.name(code)): v for (cls, code), v in tally.items()}
        if s == "all":
            together_ns = named
            continue
        for key, v in named.items():
            per_ns[key] = v
            for k2 in P.TOTAL_KEYS:
                per_class[s][k2] += v[k2]
    del table
    totals = {k2: sum(v[k2] for v in together_ns.values()) for k2 in P.TOTAL_KEYS}
    skipped = []
    for ns, newest in sorted(newest_writes(manifest_path, root, {ns for _, ns in together_ns}).items()):
        age = now - newest
        if age < P.DEFAULT_QUIET_PERIOD:
            skipped.append({"namespace": ns, "written_s_ago": round(max(age, 0)),
                            "quiet_period_s": P.DEFAULT_QUIET_PERIOD, "reason": P.live_reason(age, P.DEFAULT_QUIET_PERIOD)})
    return per_class, per_ns, totals, skipped




class PlanRows:
    """The rows a prune of `classes` selects, as tables of a batch's rows (manifest order:
    row, class code, `prunable`, the target's row and PLAN_ROW_COLUMNS), the config.json rows
    last, once it is known which namespaces the selection empties (`emptied`); for a
    manifest with no LMCache tier and no Mooncake store, or for its directory families
    and files of no namespace beside them (`apart`: the tiers' and stores' namespaces)."""

    def __init__(self, manifest_path: str, meta: dict[str, Any], used_namespaces: tuple[set[str], set[str]],
                 classes: tuple[str, ...], cutoff_ns: int, apart: frozenset[str] = frozenset()) -> None:
        self.manifest_path = manifest_path
        self.fig = gather(manifest_path, meta, used_namespaces, classes, apart)
        self.sel = _Classes(self.fig, {"code": classes}, cutoff_ns)

    def __iter__(self) -> Iterator[Any]:
        import pyarrow as pa
        import pyarrow.compute as pc

        from kvmigrate.migrate import prune_rules as P

        configs: list = []
        for offset, c in _batches(self.manifest_path, _PASS_C):
            codes, target, cfg = self.sel.batch(offset, c)
            cols = {"row": _rows(offset, len(c["relpath"])), "code": codes["code"], "prunable": P._prunable(c),
                    "target": target, **{k: c[k] for k in P.PLAN_ROW_COLUMNS}}
            if pc.any(cfg).as_py():
                configs.append(pa.table({**{k: pc.filter(v, cfg) for k, v in cols.items()},
                                         "status": pc.filter(c["status"], cfg)}))
            chosen = pc.and_(pc.not_equal(codes["code"], 0), pc.invert(cfg))
            if pc.any(chosen).as_py():
                yield pa.table({k: pc.filter(v, chosen) for k, v in cols.items()})
        if configs:
            cfgs = pa.concat_tables(configs, promote_options="permissive")
            cfgs = cfgs.set_column(cfgs.column_names.index("code"), "code", self.sel.config_codes("code", cfgs))
            yield cfgs.drop_columns(["status"]).filter(pc.not_equal(cfgs["code"], 0))
        self.fig.migrated_to = self.fig.paired_to = None  # (what the rows needed of the rest of the manifest)

    def emptied(self) -> set[str]:
        """The namespaces the selection empties (known once every row was read)."""
        return set(self.sel.emptied_namespaces("code"))


class TargetReader:
    """The columns `names` of ascending manifest rows, asked range after range: one
    forward pass over the manifest, one batch held at a time."""

    def __init__(self, manifest_path: str, names: Iterable[str]) -> None:
        self.names = list(names)
        self._batches = _batches(manifest_path, self.names)
        self._at: tuple[int, dict[str, Any]] | None = None

    def __call__(self, rows: Any) -> dict[str, Any]:
        """{"row": the distinct rows of `rows`, ascending, and each name: their values}."""
        import pyarrow as pa
        import pyarrow.compute as pc

        wanted = pc.unique(rows.drop_null()).cast(pa.int64())
        wanted = pc.take(wanted, pc.sort_indices(wanted))
        parts: dict[str, list] = {k: [] for k in self.names}
        at = 0
        while at < len(wanted):
            if self._at is None or self._at[0] + len(self._at[1][self.names[0]]) <= wanted[at].as_py():
                self._at = next(self._batches)
                continue
            offset, c = self._at
            end = at + (pc.sum(pc.less(wanted.slice(at), offset + len(c[self.names[0]]))).as_py() or 0)
            local = pc.subtract(wanted[at:end], offset)
            for name in self.names:
                parts[name].append(pc.take(c[name], local))
            at = end
        return {"row": wanted, **{k: pa.concat_arrays(v) if v else pa.array([], pa.null()) for k, v in parts.items()}}


def _selected(table: Any, selection: str, n: int) -> Iterator[dict[str, Any]]:
    """The rows of `table` a selection takes, a batch at a time, as `tally_stream` reads
    them: its class code, and the plan's order of names (class by class, rows in manifest
    order, of a manifest of n rows)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for b in table.to_batches(max_chunksize=BATCH):
        b = b.filter(pc.not_equal(b.column(selection), 0))
        code = b.column(selection)
        yield {"code": code, **{k: b.column(k) for k in ("ns", "dev", "inode", "size", "nlink")},
               "ord": pc.add(pc.multiply(code.cast(pa.int64()), n), b.column("row").cast(pa.int64()))}


def _any_code(codes: dict[str, Any]) -> Any:
    import pyarrow.compute as pc

    out = None
    for s in _SELECTIONS:
        m = pc.not_equal(codes[s], 0)
        out = m if out is None else pc.or_(out, m)
    return out


def _fold_emptied(acc: dict[str, list], src: Any, code: Any, config: Any, emptiable: Any, rows: Any) -> None:
    """Per namespace, across batches: any file chosen, its files but config.json, those
    chosen, and the class of the first of them (`_select`'s emptied namespaces)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    rest = pc.invert(config)
    chosen = pc.not_equal(code, 0)
    t = pa.table({"ns": src, "chosen": chosen, "rest": rest.cast(pa.int64()),
                  "rest_chosen": pc.and_(rest, chosen).cast(pa.int64()),
                  "first": pc.if_else(rest, rows, pa.nulls(len(rows), pa.int64()))}).filter(emptiable)
    if not t.num_rows:
        return
    g = t.group_by("ns").aggregate([("chosen", "any"), ("rest", "sum"), ("rest_chosen", "sum"), ("first", "min")])
    firsts = g["first_min"]
    first_codes = pc.take(code, pc.subtract(firsts, rows[0])) if len(rows) else firsts
    for ns, ch, r, rc, f, fc in zip(*(g[k].to_pylist() for k in ("ns", "chosen_any", "rest_sum", "rest_chosen_sum")),
                                    firsts.to_pylist(), first_codes.to_pylist()):
        was = acc.get(ns)
        if was is None:
            acc[ns] = [ch, r, rc, fc if f is not None else None, f]
        else:
            was[0], was[1], was[2] = was[0] or ch, was[1] + r, was[2] + rc
            if was[4] is None and f is not None:
                was[3], was[4] = fc, f


def newest_writes(manifest_path: str, root: str, names: set) -> dict[str, float]:
    """Per namespace of `names`: its newest write, in seconds: the newest file mtime (the
    scan's) or folder mtime (an lstat as its rows are read, each folder once a batch) --
    `prune._newest_write` over `_namespace_folders`, without holding a folder list."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from kvmigrate.migrate import prune_rules as P

    names = {ns for ns in names if ns}
    if not names or not root or not os.path.isdir(root):
        return {}
    newest: dict[str, float] = {}
    for _, c in _batches(manifest_path, ("source_base", "relpath", "mtime_ns")):
        mine = P._in(c["source_base"], names)
        if not pc.any(mine).as_py():
            continue
        rel = pc.filter(c["relpath"], mine)
        t = pa.table({"ns": pc.filter(c["source_base"], mine), "dir": pc.replace_substring_regex(rel, "/[^/]*$", ""),
                      "slash": pc.match_substring(rel, "/"), "mtime": pc.fill_null(pc.filter(c["mtime_ns"], mine), 0)})
        g = t.group_by(["ns", "dir", "slash"]).aggregate([("mtime", "max")])
        seen: set[tuple[str, str]] = set()
        for ns, d, slash, mtime in zip(*(g[k].to_pylist() for k in ("ns", "dir", "slash", "mtime_max"))):
            best = max(newest.get(ns, 0.0), mtime / 1e9)
            if slash:
                parts = d.split("/")
                for folder in ("/".join(parts[:j]) for j in range(1, len(parts) + 1)):
                    if (ns, folder) in seen:
                        continue
                    seen.add((ns, folder))
                    try:
                        best = max(best, os.lstat(os.path.join(root, folder)).st_mtime)
                    except OSError:
                        continue
            newest[ns] = best
    return newest
