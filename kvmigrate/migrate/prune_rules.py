"""The vocabulary and per-row rules prune's selection shares between its two readers:
`prune._select` over the manifest's columns whole and `prune_stream` over its batches
(migration.md §6): the classes and their codes, the statuses they take, the masks that
never prune a row, the tally of freed vs only unlinked, the quiet period's words."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

from kvmigrate import layout

CLASSES = ("migrated", "unreadable_namespaces", "residue", "index_lost", "tails")  # tails: Mooncake stores
RESIDUE_STATUSES = ("zero_filled", "short", "misfiled")  # tmp_leftover too, when older than --older-than
MIGRATED_STATUSES = ("ok", "padded_legacy")  # a block the scan found placed at its target
DEFAULT_QUIET_PERIOD = 600.0  # seconds: a namespace written in the last 10 minutes is live
DEFAULT_RESIDUE_AGE = 3600.0  # engine temp files younger than 1 h may still be written
CODES = {cls: k for k, cls in enumerate(CLASSES, 1)}  # a row's class in the selection's int8 column (0: none)
COUNT_PARTS = 8  # the inode count of a tally runs in parts (a power of two): its hash table an eighth of the rows
TOTAL_KEYS = ("files", "bytes", "freed_files", "freed_bytes", "unlinked_files", "unlinked_bytes")
# the manifest columns a plan item is made of (its target: relpath, dev, inode, size, mtime_ns of another row)
PLAN_ROW_COLUMNS = ("relpath", "source_base", "deployment", "group", "block_hash", "dev", "inode", "size",
                    "mtime_ns", "nlink")


class Item(NamedTuple):
    """One file to move, with the stat the scan saw (re-checked before it moves) and, for
    a migrated block, the target path that keeps its bytes and that path's stat."""

    relpath: str
    cls: str
    namespace: str
    dev: int
    inode: int
    size: int
    mtime_ns: int
    nlink: int
    target: tuple[str, int, int, int, int] | None = None  # (relpath, dev, inode, size, mtime_ns)
    key: str = ""  # the block's rank files share it: they move together or not at all
    keep: str = ""  # a folder never removed, even when emptied (an LMCache tier's: the engine's configured path)
    suffix: str = ""  # appended to its quarantine name (a store file's `.kvmq`: no client adopts or deletes it)
    objects: int = 0  # store objects no longer served once it goes (a pair's entries, a KVEntry)


def _b(mask: Any) -> Any:
    """A boolean mask whose nulls (a null column value) are False, as Python's `in` /
    `==` on None would be."""
    import pyarrow.compute as pc

    return pc.fill_null(mask, False)


def _in(col: Any, values: Iterable) -> Any:
    import pyarrow as pa
    import pyarrow.compute as pc

    return _b(pc.is_in(col, value_set=pa.array(sorted(set(values)), col.type)))


def _prunable(c: dict[str, Any]) -> Any:
    """Never kvmigrate's own files nor foreign ones (symlinks, FIFOs), nor a file of a
    family whose prune rules are not built yet (Family.prunes): a mask per row."""
    import pyarrow.compute as pc

    from kvmigrate import families

    mask = pc.or_(_in(c["status"], ("own_artifact", "foreign")), _b(pc.starts_with(c["relpath"], layout.OWN_DIR + "/")))
    held = [f.name for f in families.writers() if not f.prunes]
    if held and c.get("family") is not None:
        mask = pc.or_(mask, _in(c["family"], held))
    return pc.invert(mask)


def tally_stream(batches: Callable[[], Iterator[dict[str, Any]]],
                 keep: set | None = None) -> dict[tuple[str, Any], dict[str, int]]:
    """Per (class, namespace) the files and bytes of the selected rows, freed vs only
    unlinked (`prune.frees`: every name of the inode selected; its bytes counted once, on
    its first name in `ord`, the plan's order, among the rows tallied), of the namespaces
    `keep` only (an inode's names counted over every row): `prune.reclaim_totals` in
    Arrow. The rows are read batch by batch, three times (`batches()`: columns code, ns,
    dev, inode, size, nlink, ord): the inode numbers named more than once, then those
    inodes' names, then the figures. What it holds is 8 bytes a row (the inode numbers,
    once) and the inodes named twice, not a table of every row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    inodes = [pa.concat_arrays([pc.fill_null(c["inode"], 0).cast(pa.uint64())]) for c in batches()]
    if not inodes:
        return {}
    twice = _named_twice(pa.chunked_array(inodes, pa.uint64()))
    del inodes
    shared: dict[tuple[int, int], list] = {}  # (dev, inode) -> [names, first order among those tallied]
    if len(twice):
        for c in batches():
            mine = pc.is_in(pc.fill_null(c["inode"], 0).cast(pa.uint64()), value_set=twice)
            tallied = pc.filter(_in(c["ns"], keep), mine).to_pylist() if keep is not None else None
            for k, (dev, ino, order) in enumerate(zip(*(pc.filter(pc.fill_null(c[name], 0), mine).to_pylist()
                                                        for name in ("dev", "inode", "ord")))):
                was = shared.setdefault((dev, ino), [0, None])
                was[0] += 1
                if tallied is None or tallied[k]:
                    was[1] = order if was[1] is None else min(was[1], order)
    shared = {k: v for k, v in shared.items() if v[0] > 1}
    out: dict[tuple[str, Any], dict[str, int]] = {}
    zero = pa.scalar(0, pa.int64())
    for c in batches():
        n = len(c["code"])
        nlink = pc.fill_null(c["nlink"], 1).cast(pa.int64())
        nlink = pc.if_else(pc.equal(nlink, 0), 1, nlink)
        size = pc.fill_null(c["size"], 0).cast(pa.int64())
        count, first = [1] * n, [True] * n
        if shared:
            mine = pc.is_in(pc.fill_null(c["inode"], 0).cast(pa.uint64()), value_set=twice)
            for k in pc.indices_nonzero(mine).to_pylist():
                dev, ino = c["dev"][k].as_py() or 0, c["inode"][k].as_py() or 0
                names = shared.get((dev, ino))
                if names is not None:
                    count[k], first[k] = names[0], c["ord"][k].as_py() == names[1]
        freed = pc.less_equal(nlink, pa.array(count, pa.int64()))
        once = pc.or_(pc.invert(freed), pa.array(first, pa.bool_()))
        t = pa.table({"cls": c["code"], "ns": c["ns"], "size": size, "freed": freed.cast(pa.int64()),
                      "freed_bytes": pc.if_else(pc.and_(freed, once), size, zero),
                      "unlinked": pc.invert(freed).cast(pa.int64()),
                      "unlinked_bytes": pc.if_else(freed, zero, size)})
        if keep is not None:
            t = t.filter(_in(t["ns"], keep))
        g = t.group_by(["cls", "ns"]).aggregate([("size", "count"), ("size", "sum"), ("freed", "sum"),
                                                 ("freed_bytes", "sum"), ("unlinked", "sum"),
                                                 ("unlinked_bytes", "sum")])
        cols = [g[k].to_pylist() for k in ("cls", "ns", "size_count", "size_sum", "freed_sum", "freed_bytes_sum",
                                           "unlinked_sum", "unlinked_bytes_sum")]
        for cls, ns, *figures in zip(*cols):
            total = out.setdefault((CLASSES[cls - 1], ns), dict.fromkeys(TOTAL_KEYS, 0))
            for key, v in zip(TOTAL_KEYS, figures):
                total[key] += v or 0
    return out


def _named_twice(inodes: Any) -> Any:
    """The inode numbers `inodes` holds more than once, counted in COUNT_PARTS parts by
    their low bits: each part's hash table (a value count) holds an eighth of them."""
    import pyarrow as pa
    import pyarrow.compute as pc

    part = pc.bit_wise_and(inodes, pa.scalar(COUNT_PARTS - 1, pa.uint64())).cast(pa.uint8())
    out = []
    for p in range(COUNT_PARTS):
        counts = pc.filter(inodes, pc.equal(part, p)).value_counts()
        out.append(pc.filter(counts.field("values"), pc.greater(counts.field("counts"), 1)))
        del counts
    return pa.concat_arrays(out) if out else pa.array([], pa.uint64())


def live_reason(age: float, quiet_period: float) -> str:
    """What prune says of a namespace written `age` seconds ago, within the quiet period."""
    return (f"written {max(age, 0):.0f} s ago, within the quiet period of {quiet_period:.0f} s (a running "
            "engine may use it); rerun later, or pass --force-live")
