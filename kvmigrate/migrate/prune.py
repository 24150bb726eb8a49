"""`kvmigrate prune`: reclaim what no engine will read, reversibly (migration.md §6).

A prune plan is read from a manifest's typed columns (never its `reason` prose) and the
migration journals (through `journal.iter_runs`). Classes, each opt-in by name:

    migrated               legacy block files whose bytes the scan found at a target path
                           (`already_present`: the same inode, or the exact bytes the action
                           writes), their rank files (replicas proven equal by hash, parts
                           of a transform), and the namespace's config.json once nothing
                           else of it is left
    unreadable_namespaces  namespaces no target reads and no migration used, whole (also
                           superseded eras whose every block a target namespace holds)
    residue                engine temp files older than --older-than, zero_filled, short,
                           misfiled files

Never: an `ok` block not migrated, a target namespace (every `target_base` of the
manifest and of the journals), kvmigrate's own files, a file changed since the scan
(size, mtime, inode, dev, or a ctime after the scan), a namespace whose target is under
a held migration lock or that was written within the quiet period, anything outside
ROOT, a symlink (its target is never followed: every step goes through O_NOFOLLOW
folder fds of `fsops.DestTree`).

This module selects; `quarantine.py` moves each file into
`ROOT/.kvmigrate/quarantine/<run>/<relpath>` by rename (same inode, nothing copied),
journaled write-ahead in its own journal (`ROOT/.kvmigrate/journals/prune/<run>.jsonl`,
beside, not among, the migration journals); `restore.py` puts it back or purges it.
"""

from __future__ import annotations

import fcntl
import functools
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, NamedTuple

from kvmigrate import findings, layout
from kvmigrate import manifest as mf
from kvmigrate.errors import UsageError
from kvmigrate.migrate import journal as jn
from kvmigrate.migrate.fsops import check_relpath

CLASSES = ("migrated", "unreadable_namespaces", "residue")
QUARANTINE_DIR = os.path.join(layout.OWN_DIR, "quarantine")
PRUNE_JOURNALS_DIR = os.path.join(jn.JOURNALS_DIR, "prune")
KIND = "prune"  # the header's `kind`: a prune journal, not a migration's

# a namespace of one of these states is read by no target (formats.md §3, interface.md §2)
UNREADABLE_STATUSES = ("orphan_namespace", "digest_mismatch", "config_invalid", "unsupported_layout")
RESIDUE_STATUSES = ("zero_filled", "short", "misfiled")  # tmp_leftover too, when older than --older-than
MIGRATED_STATUSES = ("ok", "padded_legacy")  # a block the scan found placed at its target
DEFAULT_QUIET_PERIOD = 600.0  # seconds: a namespace written in the last 10 minutes is live
DEFAULT_RESIDUE_AGE = 3600.0  # engine temp files younger than 1 h may still be written

_COLUMNS = ("relpath", "source_base", "deployment", "target_base", "status", "action", "finding", "primary_rank",
            "rank", "group", "block_hash", "size", "mtime_ns", "inode", "dev", "nlink", "content_xxh3_128",
            "payload_xxh3_128", "target_relpath")


def prune_journal_dir(root: str) -> str:
    return os.path.join(root, PRUNE_JOURNALS_DIR)


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


@dataclass
class PrunePlan:
    root: str
    manifest: str
    classes: tuple[str, ...]
    items: list[Item]
    skipped: dict[str, str]  # namespace -> why nothing of it is pruned
    target_bases: set[str]
    emptied: set[str] = field(default_factory=set)  # namespaces pruned whole (their folders go too)
    locks: dict[str, set[str]] = field(default_factory=dict)  # target base -> source namespaces pruned into it
    scan_started_ns: int | None = None
    finished: list = field(default_factory=list)  # quarantine.PruneResult of interrupted runs finished first

    def totals(self) -> dict[str, dict[str, int]]:
        """Per class: files and bytes, those freed once purged and those only unlinked
        (`reclaim_totals`)."""
        return reclaim_totals(_rows_of_items(self.items), self.classes)[0]

    def by_namespace(self) -> dict[tuple[str, str], dict[str, int]]:
        return reclaim_totals(_rows_of_items(self.items), self.classes)[1]

    @property
    def exit_code(self) -> int:
        """Dry run: 1 when something would be pruned (interface.md §4)."""
        return 1 if self.items else 0


class _Selected(NamedTuple):
    """The rows a prune of `classes` takes (row -> class), before the run-time checks."""

    root: str
    c: dict[str, list]  # the manifest's columns
    rows_of: dict[str, list[int]]  # namespace -> its rows
    chosen: dict[int, str]  # row -> class
    target_of: dict[int, int]  # migrated row -> its target's row
    target_bases: set[str]
    emptied: set[str]


def _select(manifest_path: str, classes: tuple[str, ...], root: str, migration_journal: str | None,
            older_than: float | None, now: float, meta: dict[str, Any]) -> _Selected:
    """The selection rules (migration.md §6), from the manifest's typed columns and the
    migration journals: the one selection `prune` and the reports' reclaimable figures use."""
    cols = _plain_columns(mf.read_table(manifest_path, columns=_COLUMNS))
    n = len(cols["relpath"])
    c = cols
    targets, used = _journal_namespaces(migration_journal or jn.default_journal_dir(root)) \
        if migration_journal or root else (set(), set())
    target_bases = {b for b in c["target_base"] if b} | targets
    rows_of: dict[str, list[int]] = {}
    for i in range(n):
        ns = c["source_base"][i]
        if ns:
            rows_of.setdefault(ns, []).append(i)

    chosen: dict[int, str] = {}  # row -> class
    target_of: dict[int, int] = {}  # migrated row -> its target's row
    if "migrated" in classes:
        by_relpath = {c["relpath"][i]: i for ns in target_bases for i in rows_of.get(ns, ())}
        primary: dict[tuple, int] = {}
        for i in range(n):
            ns = c["source_base"][i]
            if not ns or ns in target_bases or c["action"][i] != "already_present" \
                    or c["status"][i] not in MIGRATED_STATUSES:
                continue
            j = by_relpath.get(c["target_relpath"][i] or "")
            if j is None or c["status"][j] != "ok":
                continue  # the target path is not a target namespace's healthy file
            chosen[i], target_of[i] = "migrated", j
            primary[(_deployment(c, i), c["group"][i], c["block_hash"][i], c["rank"][i])] = i
        for i in range(n):
            code = c["finding"][i]
            if code not in findings.SECONDARY or c["status"][i] != "ok":
                continue
            # (a vllm.cpp rank folder is a namespace of its own: its block's primary is
            # found through the deployment, which groups the ranks' namespaces)
            p = primary.get((_deployment(c, i), c["group"][i], c["block_hash"][i], c["primary_rank"][i]))
            if p is None:
                continue
            if code == findings.REPLICA_OF_PRIMARY and not _same_bytes(c, i, p):
                continue  # a replica's equality is proven by its hash only (a scan at --verify hash)
            chosen[i], target_of[i] = "migrated", target_of[p]
    if "unreadable_namespaces" in classes:
        for ns, rows in rows_of.items():
            if ns in target_bases or ns in used:
                continue
            if all(c["status"][i] in UNREADABLE_STATUSES or c["status"][i] in ("tmp_leftover", *RESIDUE_STATUSES)
                   for i in rows) and any(c["status"][i] in UNREADABLE_STATUSES for i in rows) \
                    and not any(c["target_relpath"][i] for i in rows):
                for i in rows:
                    chosen.setdefault(i, "unreadable_namespaces")
        for ns in superseded(c, rows_of, meta.get("namespaces") or {}, target_bases, used):
            for i in rows_of[ns]:
                chosen.setdefault(i, "unreadable_namespaces")
    if "residue" in classes:
        age_ns = int((DEFAULT_RESIDUE_AGE if older_than is None else older_than) * 1e9)
        for i in range(n):
            st = c["status"][i]
            if c["source_base"][i] in target_bases or i in chosen:
                continue
            if st in RESIDUE_STATUSES or st == "tmp_leftover" and now * 1e9 - (c["mtime_ns"][i] or 0) >= age_ns:
                chosen[i] = "residue"
    # a namespace pruned whole (for its migrated blocks: once nothing else of it is left)
    # takes its config.json and folders with it
    emptied = set()
    for ns, rows in rows_of.items():
        if ns in target_bases or not any(i in chosen for i in rows):
            continue
        config = [i for i in rows if c["relpath"][i] == f"{ns}/{layout.CONFIG_NAME}"]
        rest = [i for i in rows if i not in config]
        if all(i in chosen for i in rest):
            emptied.add(ns)
            cls = chosen[rest[0]] if rest else "migrated"
            for i in config:
                if c["status"][i] not in ("own_artifact", "foreign"):
                    chosen.setdefault(i, cls)
    return _Selected(root, c, rows_of, chosen, target_of, target_bases, emptied)


def _plain_columns(table: Any) -> dict[str, list]:
    """The columns as Python lists, dictionary-encoded strings decoded first (their
    per-value conversion is 10x slower: 2.7 of 4 s for a manifest of 200,000 rows)."""
    import pyarrow as pa

    return {name: (col.cast(pa.string()) if pa.types.is_dictionary(col.type) else col).to_pylist()
            for name, col in zip(table.column_names, table.columns)}


def superseded(c: dict[str, list], rows_of: dict[str, list[int]], ns_meta: dict[str, dict], target_bases: set[str],
               used: set[str]) -> list[str]:
    """Namespaces of a superseded era (migration.md §6): the target profile can never read
    them (their target is `unreachable`: e.g. the hash granularity changed, a key the target
    lacks), no migration used them, and every block file of them is `ok` with its bytes
    (content hash, a --verify hash scan) in a healthy file of a target namespace of the same
    model: the newer era holds them. A block whose bytes are nowhere else keeps the whole
    namespace (never the last copy); so does a file of any other status but residue."""
    out = []
    present: dict[str, set[bytes]] = {}  # model name -> content hashes of its target namespaces' ok files
    for ns, rows in rows_of.items():
        m = ns_meta.get(ns) or {}
        if ns in target_bases or ns in used or not (m.get("target") or {}).get("unreachable"):
            continue
        model = m.get("model_name")
        if model not in present:
            present[model] = {c["content_xxh3_128"][i] for base in target_bases
                              if (ns_meta.get(base) or {}).get("model_name") == model
                              for i in rows_of.get(base, ()) if c["status"][i] == "ok"} - {None}
        held = present[model]
        if held and all(c["status"][i] in ("tmp_leftover", *RESIDUE_STATUSES) or c["status"][i] == "ok" and (
                c["block_hash"][i] is None or c["content_xxh3_128"][i] in held) for i in rows) \
                and any(c["block_hash"][i] is not None for i in rows):
            out.append(ns)
    return out


def _prunable(c: dict[str, list], i: int) -> bool:
    """Never kvmigrate's own files nor foreign ones (symlinks, FIFOs)."""
    return c["status"][i] not in ("own_artifact", "foreign") and not c["relpath"][i].startswith(layout.OWN_DIR + "/")


def build_plan(manifest_path: str, classes: Iterable[str] = ("migrated",), *, migration_journal: str | None = None,
               quiet_period: float = DEFAULT_QUIET_PERIOD, force_live: bool = False,
               older_than: float | None = None, now: float | None = None) -> PrunePlan:
    """Select what to prune from the manifest (typed columns) and the migration journals,
    then skip the namespaces that are live or whose target is locked."""
    classes = tuple(c for c in CLASSES if c in set(classes))
    if not classes:
        raise UsageError("nothing to select: give --migrated, --unreadable-namespaces or --residue")
    meta = mf.read_metadata(manifest_path)
    root = meta.get("root")
    if not isinstance(root, str) or not os.path.isdir(root):
        raise UsageError(f"the manifest's root {root!r} is not a folder", path=manifest_path,
                         hint="rescan the cache root with `kvmigrate scan ROOT`")
    now = time.time() if now is None else now
    root, c, rows_of, chosen, target_of, target_bases, emptied = _select(manifest_path, classes, root,
                                                                         migration_journal, older_than, now, meta)
    skipped = {}
    names = {c["source_base"][i] for i in chosen}
    for ns in sorted(names):
        why = None if force_live else _live(root, ns, [c["relpath"][i] for i in rows_of[ns]], quiet_period, now,
                                            max(c["mtime_ns"][i] or 0 for i in rows_of[ns]))
        if why:
            skipped[ns] = why
    items = []
    locks: dict[str, set[str]] = {}

    def order(i: int) -> tuple:
        """A deployment's blocks with their rank files side by side, its config.json files last."""
        config = c["relpath"][i] == f"{c['source_base'][i]}/{layout.CONFIG_NAME}"
        return _deployment(c, i), config, _key(c, i), c["relpath"][i]

    for i in sorted(chosen, key=order):
        ns = c["source_base"][i]
        rel = c["relpath"][i]
        if not _prunable(c, i):
            continue
        check_relpath(rel, "manifest path")
        j = target_of.get(i)
        target = None
        if j is not None:
            target = (c["relpath"][j], c["dev"][j], c["inode"][j], c["size"][j], c["mtime_ns"][j])
        items.append(Item(rel, chosen[i], ns, c["dev"][i], c["inode"][i], c["size"][i], c["mtime_ns"][i],
                          c["nlink"][i] or 1, target, _key(c, i)))
    items = without_namespaces(items, set(skipped))
    for item in items:  # the target namespaces to lock while pruning into them: their base folders
        base = target_base(item)
        if base is not None:
            locks.setdefault(base, set()).add(item.namespace)
    held = {ns for base, names in locks.items() if _lock_held(root, base) for ns in names}
    if held:  # the dry run says what --apply will skip (the apply takes the locks itself)
        skipped.update({ns: "its target is locked by a running kvmigrate migration; rerun when it is done"
                        for ns in held})
        items = without_namespaces(items, held)
        locks = {b: names - held for b, names in locks.items() if names - held}
    return PrunePlan(root, manifest_path, classes, items, skipped, target_bases, emptied - set(skipped), locks)


def without_namespaces(items: list[Item], namespaces: set[str]) -> list[Item]:
    """The items minus those of `namespaces`, minus every block one of them holds a rank
    file of (a vllm.cpp block spans one namespace per rank), minus the config.json of any
    namespace that keeps something."""
    if not namespaces:
        return items
    dropped = {i.key for i in items if i.namespace in namespaces}
    keeps = {i.namespace for i in items if i.key in dropped} | namespaces
    return [i for i in items if i.key not in dropped
            and not (i.namespace in keeps and i.relpath == f"{i.namespace}/{layout.CONFIG_NAME}")]


TOTAL_KEYS = ("files", "bytes", "freed_files", "freed_bytes", "unlinked_files", "unlinked_bytes")


def frees(nlink: int, selected_names: int) -> bool:
    """A pruned file frees its bytes (once purged) when every name of its inode is pruned;
    else another name, e.g. the target's hard link, keeps them: it is only unlinked (a
    file-count slot). The one rule of the plan, the apply's result and the reports."""
    return nlink <= selected_names


def reclaim_totals(rows: Iterable[tuple[str, str, int, int, int, int]], classes: Iterable[str] = CLASSES,
                   keep: set[str] | None = None) -> tuple[dict[str, dict[str, int]], dict[tuple[str, str], dict]]:
    """(per class, per (class, namespace)) files and bytes, freed and only unlinked, of
    rows (class, namespace, dev, inode, size, nlink); `keep`: tally those namespaces only
    (the names of an inode are counted over every row). Freed bytes count each inode once:
    two pruned names of one inode free its bytes once."""
    rows = list(rows)
    names = Counter((dev, ino) for _, _, dev, ino, _, _ in rows)
    counted: set[tuple[int, int]] = set()
    per_class = {c: dict.fromkeys(TOTAL_KEYS, 0) for c in classes}
    per_ns: dict[tuple[str, str], dict[str, int]] = {}
    for cls, ns, dev, ino, size, nlink in rows:
        if keep is not None and ns not in keep:
            continue
        how = "freed" if frees(nlink, names[(dev, ino)]) else "unlinked"
        once = how == "unlinked" or (dev, ino) not in counted
        counted.add((dev, ino))
        for t in (per_class.setdefault(cls, dict.fromkeys(TOTAL_KEYS, 0)),
                  per_ns.setdefault((cls, ns), dict.fromkeys(TOTAL_KEYS, 0))):
            t["files"] += 1
            t["bytes"] += size
            t[f"{how}_files"] += 1
            t[f"{how}_bytes"] += size if once else 0
    return per_class, per_ns


def _rows_of_items(items: Iterable[Item]) -> Iterator[tuple[str, str, int, int, int, int]]:
    return ((i.cls, i.namespace, i.dev, i.inode, i.size, i.nlink) for i in items)


def reclaimable(manifest_path: str, *, migration_journal: str | None = None, now: float | None = None,
                namespaces: set[str] | None = None) -> dict[str, Any]:
    """What `prune --migrated --unreadable-namespaces --residue` selects in this manifest
    (the same `_select`), per class and namespace, freed vs only unlinked, for `report`
    and `audit`. Read-only: the run-time checks (quiet period, held locks, a fresh stat)
    are prune's own. `namespaces`: only those (--only/--exclude)."""
    meta = mf.read_metadata(manifest_path)
    root = meta.get("root") if isinstance(meta.get("root"), str) else ""
    rows: list[tuple[str, str, int, int, int, int]] = []
    if _any_candidate(manifest_path):
        sel = _select(manifest_path, CLASSES, root, migration_journal, None, time.time() if now is None else now,
                      meta)
        c = sel.c
        rows = [(cls, c["source_base"][i], c["dev"][i], c["inode"][i], c["size"][i] or 0, c["nlink"][i] or 1)
                for i, cls in sel.chosen.items() if _prunable(c, i)]
    per_class, per_ns = reclaim_totals(rows, CLASSES, keep=namespaces)
    out: dict[str, Any] = {k: sum(t[k] for t in per_class.values()) for k in TOTAL_KEYS}
    out["classes"] = per_class
    out["namespaces"] = [{"class": cls, "namespace": ns, **v} for (cls, ns), v in sorted(per_ns.items())]
    return out


def _any_candidate(manifest_path: str) -> bool:
    """Some row could be selected (a block already at its target, or a status of a class):
    the two columns are read first, so a manifest with nothing to prune costs no more."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = mf.read_table(manifest_path, columns=["status", "action"])
    if not t.num_rows:
        return False
    plain = [pc.cast(t[k], pa.string()) if pa.types.is_dictionary(t[k].type) else t[k] for k in ("status", "action")]
    statuses = pa.array([*UNREADABLE_STATUSES, *RESIDUE_STATUSES, "tmp_leftover"])
    hit = pc.or_(pc.fill_null(pc.is_in(plain[0], value_set=statuses), False),
                 pc.fill_null(pc.equal(plain[1], "already_present"), False))
    return bool(pc.any(hit).as_py())


def target_base(item: Item) -> str | None:
    """The base folder of the target namespace a migrated item's block is placed in."""
    return None if item.target is None else _base_of(item.target[0].split("/", 1)[0])


@functools.lru_cache(maxsize=1024)
def _base_of(folder_name: str) -> str | None:
    folder = layout.parse_folder(folder_name)
    return folder.base if folder is not None else None


def _lock_held(root: str, base: str) -> bool:
    """A migration holds the flock of the target's lock file (migrate/lock.py) right now."""
    try:
        fd = os.open(os.path.join(root, base, layout.LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _same_bytes(c: dict[str, list], i: int, p: int) -> bool:
    """Row i holds the data of row p, by hash: the payload for vllm.cpp (each rank's header
    names its own identity), the whole file otherwise."""
    col = "payload_xxh3_128" if c["payload_xxh3_128"][i] is not None else "content_xxh3_128"
    return c[col][i] is not None and c[col][i] == c[col][p]


def _deployment(c: dict[str, list], i: int) -> str:
    return c["deployment"][i] or c["source_base"][i] or ""


def _key(c: dict[str, list], i: int) -> str:
    """The block a row is a rank file of (its deployment, group and hash); else its path."""
    h = c["block_hash"][i]
    return f"{_deployment(c, i)}/{c['group'][i]}:{h.hex()}" if h is not None else c["relpath"][i]


def _journal_namespaces(journal: str) -> tuple[set[str], set[str]]:
    """(target bases, source namespaces) of every migration run in the journal file or
    directory (none when there is none yet)."""
    if not os.path.exists(journal) or os.path.isdir(journal) and not any(
            f.endswith(".jsonl") for f in os.listdir(journal)):
        return set(), set()
    targets: set[str] = set()
    sources: set[str] = set()
    runs = (run for f in jn.journal_files(journal) for run in jn.load_runs(f, paths=False))  # run states only
    for run in runs:
        if run.rolled_back:
            continue
        for base, rec in run.targets.items():
            targets.add(base)
            sources.update(rec.get("sources") or ())
    return targets, sources


def _live(root: str, ns: str, relpaths: list[str], quiet_period: float, now: float, newest_file_ns: int) -> str | None:
    """Why a namespace counts as live: written (its newest file mtime, or the mtime or
    ctime of a folder of it) within the quiet period; None when it is quiet."""
    newest = newest_file_ns / 1e9
    folders = set()
    for rel in relpaths:
        parts = rel.split("/")[:-1]
        for k in range(1, len(parts) + 1):
            folders.add("/".join(parts[:k]))
    for d in folders:
        try:
            st = os.lstat(os.path.join(root, d))
        except OSError:
            continue
        newest = max(newest, st.st_mtime, st.st_ctime)
    age = now - newest
    if age < quiet_period:
        return (f"written {max(age, 0):.0f} s ago, within the quiet period of {quiet_period:.0f} s (a running "
                "engine may use it); rerun later, or pass --force-live")
    return None




# --- rendering -------------------------------------------------------------------------------


def render_plan(plan: PrunePlan, apply_command: str | None) -> str:
    from kvmigrate.units import human_bytes

    lines = [f"prune plan for {plan.root}"]
    totals = plan.totals()
    for cls in plan.classes:
        t = totals[cls]
        lines.append(f"  {cls.replace('_', '-'):<24} {t['files']:>8} files {human_bytes(t['bytes']):>10}; frees "
                     f"{human_bytes(t['freed_bytes'])} once purged, {t['unlinked_files']} files only unlinked "
                     "(their bytes stay under another name: a file-count slot each)")
        for (c, ns), v in sorted(plan.by_namespace().items()):
            if c == cls:
                lines.append(f"    {ns}: {v['files']} files, {human_bytes(v['bytes'])}; frees "
                             f"{human_bytes(v['freed_bytes'])}, {v['unlinked_files']} only unlinked")
    for ns, why in sorted(plan.skipped.items()):
        lines.append(f"  skipped {ns}: {why}")
    if plan.items:
        lines.append(f"{len(plan.items)} files would move to {os.path.join(plan.root, QUARANTINE_DIR)}/<run>/ "
                     "(reversible: `kvmigrate restore JOURNAL`). Nothing was moved (dry run).")
        if apply_command:
            lines.append(f"to apply: {apply_command}")
    else:
        lines.append("nothing to prune.")
    return "\n".join(lines)
