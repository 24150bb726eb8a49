"""A prune plan of a directory-layout manifest kept on disk, not as a Python object per
file: a 10M-file cache's plan is millions of items, which as `Item`s (with their key and
target) took ~800 B each. The plan is built in three steps, each holding a bounded part:

    partition   the selected rows (prune_stream.PlanRows), as they stream by, into files
                by the range of manifest rows their target is in (one file for no target)
    join        range by range, the targets' stat (read from the manifest in one forward
                pass) attached to the rows pointing into the range; each range sorted in
                the plan's order (`ORDER`) and written as a run
    merge       the runs merged into the plan's file, in the plan's order

`PlanFile` then reads the plan a batch at a time: its items, its figures (`tally`), the
target bases to lock, and a copy without some namespaces (`without`). Its files live in
a temporary folder (TMPDIR), removed when the plan is dropped: a dry run writes nothing
under the cache root.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import shutil
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from kvmigrate import layout, scratch
from kvmigrate.migrate.fsops import check_relpath
from kvmigrate.migrate.prune_rules import CLASSES, TOTAL_KEYS, Item, tally_stream

if TYPE_CHECKING:
    from kvmigrate.migrate.prune_stores import Stores

MIN_RANGE = 16_384  # manifest rows per target range: the join holds a range's rows at once
MAX_RANGES = 256  # ranges of each kind (of targets, of rows with none): the range grows past MIN_RANGE to stay under it
RUN_BATCH = 512  # rows per record batch of a run: the merge holds one batch of each run as Python keys
OUT_BATCH = 4096  # rows per record batch of the plan's file: what iterating the plan holds
# a deployment's blocks with their rank files side by side, its config.json files last; a
# tier's GDS sidecar just before its data file (`prune_tiers.move_order`: `moved`, `step`)
ORDER = ("deployment", "config", "key", "moved", "step", "relpath")


def _schema() -> Any:
    import pyarrow as pa

    return pa.schema([("relpath", pa.string()), ("code", pa.int8()), ("ns", pa.int32()), ("dev", pa.uint64()),
                      ("inode", pa.uint64()), ("size", pa.int64()), ("mtime_ns", pa.int64()), ("nlink", pa.uint32()),
                      ("key", pa.string()), ("t_relpath", pa.string()), ("t_dev", pa.uint64()),
                      ("t_inode", pa.uint64()), ("t_size", pa.int64()), ("t_mtime_ns", pa.int64()),
                      ("objects", pa.int32())])


_TARGET = ("relpath", "dev", "inode", "size", "mtime_ns")  # a target's columns, as t_<name> in the plan


class _Folder:
    """The plan's temporary folder, removed with the last PlanFile that reads it (one left by
    a killed prune goes with the next working folder made: kvmigrate/scratch.py)."""

    def __init__(self) -> None:
        self.path = scratch.make("prune-plan")
        self._remove = weakref.finalize(self, shutil.rmtree, self.path, True)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)


class PlanFile:
    """A plan's items, in the plan's order, read from its file a batch at a time. Sized
    and iterable like the list of items the whole-column plan holds."""

    def __init__(self, folder: _Folder, path: str, rows: int, names: list[str | None],
                 tier_of: dict[str, str] | None = None, stores: Stores | None = None) -> None:
        self.folder, self.path, self.rows, self.names = folder, path, rows, names
        self.tier_of = tier_of or {}  # an LMCache tier's deployment -> its tier (its items keep the tier folder)
        self.stores = stores  # Mooncake stores: their items keep the client root and are quarantined as `.kvmq`

    def __len__(self) -> int:
        return self.rows

    def __bool__(self) -> bool:
        return self.rows > 0

    def batches(self) -> Iterator[Any]:
        import pyarrow as pa

        if not self.rows:
            return
        with pa.OSFile(self.path, "rb") as f:
            reader = pa.ipc.open_stream(f)
            yield from reader

    def __iter__(self) -> Iterator[Item]:
        from kvmigrate.migrate.prune_stores import QUARANTINE_SUFFIX
        from kvmigrate.migrate.prune_tiers import kept_folder

        names, tier_of = self.names, self.tier_of
        store_of = self.stores.store_of if self.stores else {}
        for b in self.batches():
            c = {k: b.column(k).to_pylist() for k in b.schema.names}
            for k, rel in enumerate(c["relpath"]):
                target = None if c["t_relpath"][k] is None else \
                    (c["t_relpath"][k], c["t_dev"][k], c["t_inode"][k], c["t_size"][k], c["t_mtime_ns"][k])
                ns = names[c["ns"][k]]
                item = Item(rel, CLASSES[c["code"][k] - 1], ns, c["dev"][k], c["inode"][k], c["size"][k],
                            c["mtime_ns"][k], c["nlink"][k] or 1, target, c["key"][k])
                if ns in store_of:
                    assert self.stores is not None
                    item = item._replace(keep=self.stores.kept(ns, rel), suffix=QUARANTINE_SUFFIX,
                                         objects=c["objects"][k] or 0)
                elif ns in tier_of:
                    item = item._replace(keep=kept_folder(tier_of[ns], rel))
                yield item

    def tally(self, classes: tuple[str, ...]) -> tuple[dict[str, dict[str, int]], dict[tuple[str, Any], dict]]:
        """(per class, per (class, namespace)) as `prune.reclaim_totals` tallies the items:
        an inode's bytes counted on its first name in the plan's order."""
        import pyarrow as pa

        per_class = {c: dict.fromkeys(TOTAL_KEYS, 0) for c in classes}

        def batches() -> Iterator[dict[str, Any]]:
            at = 0
            for b in self.batches():
                yield {**{k: b.column(k) for k in ("code", "ns", "dev", "inode", "size", "nlink")},
                       "ord": pa.array(range(at, at + b.num_rows), pa.int64())}
                at += b.num_rows

        tally = tally_stream(batches)
        per_ns: dict[tuple[str, Any], dict] = {}
        for (cls, code), figures in tally.items():
            per_ns[(cls, self.names[code])] = figures
            total = per_class.setdefault(cls, dict.fromkeys(TOTAL_KEYS, 0))
            for key in TOTAL_KEYS:
                total[key] += figures[key]
        return per_class, per_ns

    def target_folders(self) -> set[tuple[str, str | None]]:
        """(the first folder of a target path, the namespace pruned into it), once each."""
        import pyarrow as pa
        import pyarrow.compute as pc

        out: set[tuple[str, str | None]] = set()
        for b in self.batches():
            has = pc.is_valid(b.column("t_relpath"))
            if not pc.any(has).as_py():
                continue
            first = pc.replace_substring_regex(pc.filter(b.column("t_relpath"), has), "/.*$", "")
            g = pa.table({"f": first, "ns": pc.filter(b.column("ns"), has)}).group_by(["f", "ns"]).aggregate([])
            out.update((f, self.names[ns]) for f, ns in zip(g["f"].to_pylist(), g["ns"].to_pylist()))
        return out

    def without(self, namespaces: set[str]) -> PlanFile:
        """`prune.without_namespaces`: a copy without the items of `namespaces`, nor any
        block one of them holds a rank file of, nor the config.json of a namespace that
        keeps something."""
        import pyarrow as pa
        import pyarrow.compute as pc

        codes = [k for k, ns in enumerate(self.names) if ns in namespaces]
        if not codes or not self.rows:
            return self
        dropped: set[str] = set()
        for b in self.batches():
            mine = pc.is_in(b.column("ns"), value_set=pa.array(codes, pa.int32()))
            if pc.any(mine).as_py():
                dropped.update(pc.filter(b.column("key"), mine).to_pylist())
        keeps: set[int] = set(codes)
        for b in self.batches():
            keeps.update(ns for ns, key in zip(b.column("ns").to_pylist(), b.column("key").to_pylist())
                         if key in dropped)
        configs = {k: f"{ns}/{layout.CONFIG_NAME}" for k, ns in enumerate(self.names) if k in keeps}
        path = self.folder.file(f"plan-{len(os.listdir(self.folder.path))}.arrow")
        rows = 0
        with _writing(self.folder), scratch.IpcWriter(path, _schema()) as w:
            for b in self.batches():
                keep = [key not in dropped and configs.get(ns) != rel for ns, key, rel in
                        zip(b.column("ns").to_pylist(), b.column("key").to_pylist(), b.column("relpath").to_pylist())]
                kept = b.filter(pa.array(keep, pa.bool_()))
                rows += kept.num_rows
                w.write(kept)
        return PlanFile(self.folder, path, rows, self.names, self.tier_of, self.stores)


def _read(path: str) -> Any:
    import pyarrow as pa

    with pa.OSFile(path, "rb") as f:
        return pa.ipc.open_stream(f).read_all()


def spill(chosen: Iterable[Any], manifest_rows: int, targets: Callable[[Any], dict[str, Any]],
          code_of: Callable[[Any], Any], names: list[str | None], tier_of: dict[str, str] | None = None,
          stores: Stores | None = None) -> PlanFile:
    """The plan's file of the `chosen` rows (tables of prune_stream.PlanRows' columns; a
    store's rows also `key` and `objects`): partitioned by their target's range, joined
    with the targets' stat (`targets`: the _TARGET columns of ascending manifest rows,
    called range after range), sorted and merged. `code_of`: a namespace column's int
    codes (into `names`); `tier_of`: the LMCache tiers' deployments, `stores`: the Mooncake
    stores (their moves' order, their kept folder)."""
    folder = _Folder()
    with _writing(folder):
        return _spill(folder, chosen, manifest_rows, targets, code_of, names, tier_of or {}, stores)


def _writing(folder: _Folder) -> contextlib.AbstractContextManager[None]:
    """A failed write of the plan's files: exit 8, before anything is moved."""
    return scratch.writing(folder.path, "the prune plan's temporary files",
                           "the plan takes ~200 bytes a file it prunes", then="; nothing was moved")


def _spill(folder: _Folder, chosen: Iterable[Any], manifest_rows: int, targets: Callable[[Any], dict[str, Any]],
           code_of: Callable[[Any], Any], names: list[str | None], tier_of: dict[str, str],
           stores: Stores | None) -> PlanFile:
    import pyarrow as pa
    import pyarrow.compute as pc

    span = max(MIN_RANGE, -(-manifest_rows // MAX_RANGES))
    # range -> its rows' file: a target's range, or (-1 - k) for the rows of no target in the
    # k-th range of their own rows (residue, a stale namespace: a plan may be all of them)
    writers: dict[int, scratch.IpcWriter] = {}
    for t in chosen:
        if not t.num_rows:
            continue
        t = t.append_column("ns", code_of(t["source_base"].combine_chunks()))
        own = pc.subtract(pa.scalar(-1, pa.int64()), pc.divide(t["row"], pa.scalar(span, pa.int64())))
        which = pc.if_else(pc.is_valid(t["target"]), pc.divide(t["target"], pa.scalar(span, pa.int64())), own)
        for r in pc.unique(which).to_pylist():
            w = writers.get(r)
            if w is None:
                w = writers[r] = scratch.IpcWriter(folder.file(f"range-{r}.arrow"), t.schema)
            for b in t.filter(pc.equal(which, r)).to_batches():
                w.write(b)
    for w in writers.values():
        w.close()
    runs = []
    for r in sorted(writers):
        part = _read(folder.file(f"range-{r}.arrow"))
        os.unlink(folder.file(f"range-{r}.arrow"))
        runs.append(_run(folder, r, part, None if r < 0 else targets(part["target"]), tier_of, stores))
        del part
    path = folder.file("plan.arrow")
    rows = _merge(runs, path)
    for run in runs:
        os.unlink(run)
    return PlanFile(folder, path, rows, names, tier_of, stores)


def _run(folder: _Folder, r: int, part: Any, found: dict[str, Any] | None, tier_of: dict[str, str],
         stores: Stores | None) -> str:
    """One range's rows with their targets' stat and their order's columns, sorted."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = part.num_rows
    if found is None:
        stat = {f"t_{k}": pa.nulls(n, typ) for k, typ in zip(_TARGET, (pa.string(), pa.uint64(), pa.uint64(),
                                                                        pa.int64(), pa.int64()))}
    else:
        at = pc.index_in(part["target"], value_set=found["row"])
        stat = {f"t_{k}": pc.take(found[k], at) for k in _TARGET}
    deployment = pc.fill_null(part["deployment"], "")
    src = part["source_base"]
    deployment = pc.if_else(pc.not_equal(deployment, ""), deployment, pc.fill_null(src, ""))
    config = pc.fill_null(pc.equal(part["relpath"], pc.binary_join_element_wise(
        pc.fill_null(src, "None"), layout.CONFIG_NAME, "/")), False)
    given = part["key"].to_pylist() if "key" in part.column_names else [None] * n  # a store's: its pair
    key = [k if k is not None else rel if h is None else f"{d}/{g}:{h.hex()}" for k, d, g, h, rel in zip(
        given, deployment.to_pylist(), part["group"].to_pylist(), part["block_hash"].to_pylist(),
        part["relpath"].to_pylist())]
    moved, step = part["relpath"], pa.array([1] * n, pa.int8())  # (relpath, 1): a file of no tier
    if tier_of or stores:
        from kvmigrate.migrate import prune_stores, prune_tiers

        tier = pc.is_in(src, value_set=pa.array(sorted(tier_of), src.type)).to_pylist()
        store = pc.is_in(src, value_set=pa.array(sorted(stores.store_of if stores else ()), src.type)).to_pylist()
        order = [prune_tiers.move_order(rel) if t else ("", prune_stores.move_order(rel)) if s else (rel, 1)
                 for rel, t, s in zip(part["relpath"].to_pylist(), tier, store)]
        moved, step = pa.array([o[0] for o in order], pa.string()), pa.array([o[1] for o in order], pa.int8())
        if stores:  # a store's files sort by their pair alone (a store is no deployment of blocks)
            deployment = pc.if_else(pa.array(store, pa.bool_()), "", deployment)
    objects = part["objects"] if "objects" in part.column_names else pa.nulls(n, pa.int32())
    t = pa.table({"relpath": part["relpath"], "code": part["code"], "ns": part["ns"],
                  **{k: part[k] for k in ("dev", "inode", "size", "mtime_ns", "nlink")},
                  "key": pa.array(key, pa.string()), **stat, "objects": objects.cast(pa.int32()),
                  "deployment": deployment, "config": config,
                  "moved": moved, "step": step})
    t = t.sort_by([(k, "ascending") for k in ORDER])
    path = folder.file(f"run-{r}.arrow")
    with scratch.IpcWriter(path, t.schema) as w:
        for b in t.to_batches(max_chunksize=RUN_BATCH):
            w.write(b)
    return path


def _merge(runs: list[str], path: str) -> int:
    """The runs merged in the plan's order into the plan's file (the order's columns
    dropped), each path checked as the whole-column plan checks it, in that order. Its
    rows. Each run holds one batch at a time (RUN_BATCH rows as Python keys)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    schema = _schema()

    def rows(i: int, run: str) -> Iterator[tuple]:
        with pa.OSFile(run, "rb") as f:
            for b in pa.ipc.open_stream(f):
                keys = zip(*(b.column(k).to_pylist() for k in ORDER))
                b = b.select(schema.names)
                yield from ((key, i, j, b) for j, key in enumerate(keys))

    n = 0
    pending: list[tuple[int, Any]] = []

    def flush(w: scratch.IpcWriter) -> None:
        by_batch: dict[int, tuple[Any, list[int], list[int]]] = {}
        for pos, (j, b) in enumerate(pending):
            entry = by_batch.setdefault(id(b), (b, [], []))
            entry[1].append(j)
            entry[2].append(pos)
        parts = [(pc.take(pa.Table.from_batches([b]), pa.array(js, pa.int64())), at)
                 for b, js, at in by_batch.values()]
        t = pa.concat_tables([p for p, _ in parts])
        where = [0] * len(pending)
        for k, pos in enumerate(p for _, at in parts for p in at):
            where[pos] = k
        for b in t.take(pa.array(where, pa.int64())).to_batches():
            w.write(b)
        pending.clear()

    with scratch.IpcWriter(path, schema) as w:
        for key, _, j, b in heapq.merge(*(rows(i, run) for i, run in enumerate(runs))):
            check_relpath(key[-1], "manifest path")
            pending.append((j, b))
            n += 1
            if len(pending) == OUT_BATCH:
                flush(w)
        if pending:
            flush(w)
    return n
