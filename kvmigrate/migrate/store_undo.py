"""Undoing and checking a migration's store work (spec mooncake.md §5.3) from its journal
records (migrate/stores.py lists them): rollback puts every rewritten index's and replaced
KVEntry's original back while it holds the journaled new bytes, removes new pairs (`.meta`
first), KVEntries and files in DIR with their journaled bytes (including what a killed run
did before its record, proven by bytes), then its folders, stage and locks; verify checks
every file the run made against its journaled XXH3."""

from __future__ import annotations

import itertools
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvmigrate.errors import OperationalError
from kvmigrate.formats import mooncake as M
from kvmigrate.migrate import journal as jn
from kvmigrate.migrate import mooncake_store as MS
from kvmigrate.migrate.fsops import check_relpath
from kvmigrate.migrate.reshard_spill import Spill
from kvmigrate.migrate.reshard_spill import sort as spill_sort
from kvmigrate.migrate.stores import BACKUP_DIR, OWN_LOCK


@dataclass
class _Read:
    """What rollback takes from one reading of a run's store records: the few things it
    holds (client roots, folders) and, on disk, what grows with the store's blocks."""

    clients: set[str] = field(default_factory=set)  # every client root the run's intents name
    proofs: set[str] = field(default_factory=set)  # the client roots whose 0.3.14 flock it held
    dirs: list[str] = field(default_factory=list)  # folders it made in ROOT (mc_dir), then in DEST
    dest_dirs: list[str] = field(default_factory=list)
    folders: set[str] = field(default_factory=set)  # every folder it may have made (a dry run's `gone`)
    files: Spill = field(default_factory=Spill)  # (order, mc_file), files it made in DEST
    pairs: Spill = field(default_factory=Spill)  # (client, id, 0 intended / 1 journaled, order, base, hashes)
    paths: Spill = field(default_factory=Spill)  # (relpath, rank, order, what, record): see `_settled`
    rewrites: Spill = field(default_factory=Spill)  # intended index rewrites (their `paths` record: an offset)


def _read(run: Any) -> _Read:
    """One pass over the run's store records (§5.3): the pairs, and every path an index or
    KVEntry record or an intent names, spilled to be sorted; an intent into DIR names
    paths under DIR, never reconciled against ROOT (an entry read in place has the very
    same relpath)."""
    got = _Read()
    dest = False  # (the intent the parts that follow belong to is one into DIR)
    for order, r in enumerate(jn.store_records(run)):
        t = r["t"]
        if t == "mc_store":
            got.proofs.add(r["client"])
        elif t == "mc_intent":
            dest = bool(r.get("dest"))
        elif t == "mc_part" and not dest:
            what = r["of"]
            for item in r["items"]:
                got.clients.add(item.get("client", ""))
                if what == "pairs":
                    got.pairs.append((item["client"], item["id"], 0, order, item.get("base"), _hashes(item)))
                elif what == "rewrites":  # (a rewrite names every new key of its bucket: sorted as an offset)
                    got.paths.append((item["meta"], 3, order, what, got.rewrites.append(item)))
                elif what in _INTENDED:
                    got.paths.append((item[_INTENDED[what][0]], _INTENDED[what][1], order, what, item))
        elif t == "mc_pair":
            got.pairs.append((r["client"], r["id"], 1, order, r.get("base"), _hashes(r)))
        elif t == "mc_file":
            got.files.append((-order, r))
        elif t == "mc_index":
            got.paths.append((r["meta"], 0, order, "index", r))
        elif t == "mc_replace":
            got.paths.append((r["path"], 1, order, "index", {**r, "meta": r["path"]}))
        elif t == "mc_entry":
            got.paths.append((r["path"], 0, order, "entry", r))
            got.folders.update(os.path.normpath(os.path.join(run.root, d)) for d in r.get("dirs") or ())
        elif t == "mc_dir":
            (got.dest_dirs if r.get("base") == "dest" else got.dirs).append(r["path"])
            if r.get("base") != "dest":
                got.clients.add(r["path"])
    got.folders.update(os.path.normpath(os.path.join(run.root, d)) for d in got.dirs)
    got.folders.update(os.path.normpath(os.path.join(run.dest, d)) for d in got.dest_dirs)
    return got


# an intent's items that name a path: (the field, their rank among the records of one path)
_INTENDED = {"outputs": ("path", 2), "entries": ("path", 3)}


def _hashes(pair: dict[str, Any]) -> dict[str, Any]:
    """What rollback reads of a pair's record (not its keys: a pair holds many objects)."""
    return {"meta": pair["meta"], "bucket": pair["bucket"]}


def _settled(root: str, run: Any, records: Iterator[tuple], rewrites: Spill
             ) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """("entry" | "index", relpath, record) of every path the run's work may have made,
    in relpath order, from its records sorted by (relpath, rank, order): the last journaled
    KVEntry, the last journaled index rewrite (a replaced KVEntry's over it), else what
    an intent's output, rewrite or entry proves a killed run did before its record."""
    for path, group in itertools.groupby(records, key=lambda rec: rec[0]):
        entry: dict[str, Any] | None = None
        index: dict[str, Any] | None = None
        for _, _, _, what, r in group:
            if what == "entry":
                entry = r
            elif what == "index":
                index = r
            elif what == "outputs":  # reshard outputs over a displaced KVEntry a killed run did not journal
                if entry is not None or index is not None:
                    continue
                backup = os.path.join(BACKUP_DIR, run.header.get("run_id", ""), path + ".orig")
                if _still_original(os.path.join(root, path), os.path.join(root, backup)):
                    continue  # killed between the backup link and the rename: nothing to put back
                if os.path.exists(os.path.join(root, backup)):
                    index = {"meta": path, "client": r.get("client", ""), "new": r["xxh3"], "backup": backup}
                elif MS._hash_or_none(os.path.join(root, path)) == r["xxh3"]:
                    entry = {"path": path, "xxh3": r["xxh3"], "dirs": []}
            elif what == "rewrites":  # work an interrupted run did but did not journal: proven by its bytes
                if index is None:
                    index = _unjournaled_rewrite(root, run, rewrites.at(r))
            elif entry is None:
                entry = _unjournaled_entry(root, r)
        if entry is not None:
            yield "entry", path, entry
        if index is not None:
            yield "index", path, index


def rollback_run(run: Any, dry_run: bool) -> tuple[Counter, list[str]]:
    """Undo the store work of one journaled run (§5.3): new KVEntries removed (each only
    with its journaled XXH3), each rewritten index's original renamed back (only while it
    holds the journaled new bytes), created folders, the stage and kvmigrate's locks
    removed. Returns (what was done by kind, what was kept and why). What grows with the
    store's blocks is read from the journal a record at a time and sorted on disk."""
    done: Counter = Counter()
    kept: list[str] = []
    if not (getattr(run, "stored_in_file", False) or getattr(run, "store_records", None)):
        return done, kept
    got = _read(run)
    root = run.root
    locks: list[MS.ClientLock] = []
    try:
        if not dry_run:  # each client root once (a resumed run journals its proofs again: a second
            # flock of one file from this process would read as a live client)
            for client in sorted(got.proofs):
                locks.append(MS.hold_client_lock(os.path.join(root, client) if client else root))
        gone: set[str] = set()  # (a dry run: what the removals would take, so folders are counted alike)

        def going(path: str) -> None:  # (only what sits in a folder the run may have made)
            if os.path.dirname(os.path.normpath(path)) in got.folders:
                gone.add(os.path.normpath(path))

        # what a migration into DIR made there (`base: dest`): its files, newest first (a pair's .meta
        # before its .bucket)
        for _, r in spill_sort(got.files, key=lambda rec: rec[0]):
            path = os.path.join(run.dest, check_relpath(r["path"], "journal path"))
            if dry_run:
                if MS._hash_or_none(path) == r["xxh3"]:
                    done["kventry"] += 1
                    going(path)
                continue
            what = MS.remove_kv_entry(path, r["xxh3"])
            done["kventry"] += what == "removed"
            if what == "kept":
                kept.append(f"{path}: changed since the migration made it; left in place")
        # new pairs first (.meta, then .bucket, each only with the bytes the run wrote): journaled or
        # intended (a pair a killed run linked before its record)
        for (client, bucket_id), group in itertools.groupby(spill_sort(got.pairs, key=lambda rec: rec[:4]),
                                                            key=lambda rec: rec[:2]):
            last: dict[Any, dict[str, Any]] = {}  # base -> its record (journaled over intended)
            for *_, where, r in group:
                last[where] = r
            for where, r in last.items():
                top = run.dest if where == "dest" else root
                base = os.path.join(top, client) if client else top
                if dry_run:
                    done["pair"] += int(MS._hash_or_none(os.path.join(base, f"{bucket_id}{M.META_SUFFIX}")) == r["meta"])
                    continue
                got_back = MS.remove_pair(base, bucket_id, r["meta"], r["bucket"])
                done["pair"] += int(got_back.get("meta") == "removed")
                if "kept" in got_back.values():
                    kept.append(f"{base}/{bucket_id}{M.META_SUFFIX}: changed since the migration wrote the pair; left")
        entries, indexes = Spill(), Spill()
        for kind, path, r in _settled(root, run, spill_sort(got.paths, key=lambda rec: rec[:3]), got.rewrites):
            (entries if kind == "entry" else indexes).append((path, r))
        dirs = list(got.dirs)
        for path, r in spill_sort(entries, key=lambda rec: rec[0], reverse=True):
            check_relpath(path, "journal path")
            dirs += r.get("dirs") or []
            if dry_run:
                if MS._hash_or_none(os.path.join(root, path)) == r["xxh3"]:
                    done["kventry"] += 1
                    going(os.path.join(root, path))
                continue
            what = MS.remove_kv_entry(os.path.join(root, path), r["xxh3"])
            if what == "removed":
                done["kventry"] += 1
            elif what == "kept":
                kept.append(f"{os.path.join(root, path)}: changed since the migration placed it; left in place")
        for meta, r in indexes:
            check_relpath(meta, "journal path")
            path, backup = os.path.join(root, meta), os.path.join(root, r["backup"])
            if dry_run:
                done["index"] += int(MS._hash_or_none(path) == r["new"] and os.path.exists(backup))
                continue
            client = os.path.join(root, r["client"]) if r.get("client") else root
            back = MS.restore_index(path, backup, r["new"], MS.stage_path(client))
            if back == "restored":
                done["index"] += 1
            elif back == "kept":
                kept.append(f"{path}: changed since the migration rewrote it; left in place (its original is "
                            f"{backup})")
        entries.close()
        indexes.close()
        for client in sorted(got.clients):
            base = os.path.join(root, client) if client else root
            own = os.path.join(base, OWN_LOCK)
            if os.path.exists(own):
                done["lock"] += 1
                gone.add(os.path.normpath(own))
                if not dry_run:
                    os.unlink(own)
            stage = MS.stage_path(base)
            if dry_run:
                if os.path.isdir(stage):
                    gone.add(os.path.normpath(stage))
            else:
                MS.clear_stage(stage)
        for d, top in sorted({*((d, root) for d in dirs), *((d, run.dest) for d in got.dest_dirs)},
                             key=lambda x: -x[0].count("/")):  # (a folder it made, once empty)
            path = os.path.join(top, d)
            if dry_run:
                try:
                    left = [os.path.join(path, n) for n in os.listdir(path)]
                except OSError:
                    continue
                if all(os.path.normpath(p) in gone for p in left):
                    done["dir"] += 1
                    gone.add(os.path.normpath(path))
                continue
            try:
                os.rmdir(path)
                done["dir"] += 1
            except OSError:
                pass
    finally:
        for lock in locks:
            lock.release()
        for spill in (got.files, got.pairs, got.paths, got.rewrites):
            spill.close()
    return done, kept


def _still_original(path: str, backup: str) -> bool:
    """The file is the very inode its backup links (the replacement never happened)."""
    try:
        return os.path.samestat(os.lstat(path), os.lstat(backup))
    except OSError:
        return False


def _unjournaled_rewrite(root: str, run: Any, rw: dict[str, Any]) -> dict[str, Any] | None:
    """An index a killed run rewrote before journaling it: its backup is there and the
    index is exactly the backup with the intent's keys."""
    backup = os.path.join(root, BACKUP_DIR, run.header.get("run_id", ""), rw["meta"] + ".orig")
    path = os.path.join(root, rw["meta"])
    try:
        orig = M.decode_meta(MS._read(backup))
        now = MS._read(path)
    except (OperationalError, M.DecodeError, OSError):
        return None
    keys = list(orig.keys)
    for i, k in rw["keys"].items():
        if int(i) < len(keys):
            keys[int(i)] = bytes.fromhex(k)
    expected = M.encode_meta(M.BucketMeta(orig.data_size, tuple(keys), orig.objects))
    if now != expected:
        return None
    return {"meta": rw["meta"], "client": rw.get("client", ""), "new": MS.xxh3_hex(now),
            "backup": os.path.relpath(backup, root)}


def _unjournaled_entry(root: str, e: dict[str, Any]) -> dict[str, Any] | None:
    """A KVEntry a killed run placed before journaling it: the entry of the intent's key
    with the source's value."""
    try:
        placed = MS._read(os.path.join(root, e["path"]))
        source = M.decode_kv_entry(MS._read(os.path.join(root, e["source"])))
    except (OperationalError, M.DecodeError, OSError):
        return None
    if placed != M.encode_kv_entry(M.KVEntry(bytes.fromhex(e["key"]), source.value)):
        return None
    return {"path": e["path"], "xxh3": MS.xxh3_hex(placed), "dirs": []}


def _compare(path: str, want: str | None, gone: str, changed: str) -> tuple[str, str] | None:
    """("missing", gone) when nothing is at `path`, ("changed", changed) when its XXH3-128
    is not `want`, else None: one check of a file the migration made."""
    got = MS._hash_or_none(path)
    if got is None:
        return "missing", f"{path}: {gone}"
    if got != want:
        return "changed", f"{path}: {changed}"
    return None


def verify_run(run: Any) -> tuple[int, list[tuple[str, str]]]:
    """(files checked, (finding kind, message) for each store file of a run that is not
    what it made, §5.3): a rewritten index or placed KVEntry whose bytes differ from the
    journaled ones, or that no starting client would read (its `.bucket` gone, an entry
    away from fpk of its key)."""
    out: list[tuple[str, str]] = []
    root = run.root
    checked = 0
    for r in jn.store_records(run, ()):
        checked += r["t"] in ("mc_index", "mc_entry", "mc_pair", "mc_replace", "mc_file")
        if r["t"] == "mc_index":
            path = os.path.join(root, r["meta"])
            found = _compare(path, r["new"], "the index the migration rewrote is gone (evicted or removed)",
                             "not the index the migration wrote")
            if found is None and not os.path.isfile(path[: -len(M.META_SUFFIX)] + M.BUCKET_SUFFIX):
                found = ("missing", f"{path}: its .bucket is gone: the next client start deletes the index")
            out += [found] if found else []
        elif r["t"] == "mc_file":
            path = os.path.join(run.dest, r["path"])
            found = _compare(path, r["xxh3"], "the file the migration made is gone (evicted or removed)",
                             "not the file the migration made")
            out += [found] if found else []
        elif r["t"] == "mc_pair":
            top = run.dest if r.get("base") == "dest" else root
            base = os.path.join(top, r["client"]) if r["client"] else top
            for suffix, want in ((M.META_SUFFIX, r["meta"]), (M.BUCKET_SUFFIX, r["bucket"])):
                found = _compare(os.path.join(base, f"{r['id']}{suffix}"), want,
                                 "the pair the migration wrote is gone (evicted or removed)",
                                 "not the pair the migration wrote")
                out += [found] if found else []
                if found and found[0] == "missing":
                    break
        elif r["t"] in ("mc_entry", "mc_replace"):
            path = os.path.join(root, r["path"])
            found = _compare(path, r.get("xxh3") or r.get("new"), "the KVEntry the migration placed is gone",
                             "not the KVEntry the migration placed")
            if found is None:
                entry = M.decode_kv_entry(MS._read(path))
                if not r["path"].endswith(M.fpk(entry.key, r["path"].split("/")[-4])):
                    found = ("misplaced", f"{path}: not at fpk of its key: no read finds it")
            out += [found] if found else []
    return checked, out
