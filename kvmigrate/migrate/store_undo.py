"""Undoing and checking a migration's store work (spec mooncake.md §5.3) from its journal
records (migrate/stores.py lists them): rollback puts every rewritten index's and replaced
KVEntry's original back while it holds the journaled new bytes, removes new pairs (`.meta`
first), KVEntries and files in DIR with their journaled bytes (including what a killed run
did before its record, proven by bytes), then its folders, stage and locks; verify checks
every file the run made against its journaled XXH3."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from kvmigrate.errors import OperationalError
from kvmigrate.formats import mooncake as M
from kvmigrate.migrate import mooncake_store as MS
from kvmigrate.migrate.fsops import check_relpath
from kvmigrate.migrate.stores import BACKUP_DIR, OWN_LOCK


def run_records(run: Any) -> list[dict[str, Any]]:
    return list(getattr(run, "store_records", ()) or ())


def rollback_run(run: Any, dry_run: bool) -> tuple[Counter, list[str]]:
    """Undo the store work of one journaled run (§5.3): new KVEntries removed (each only
    with its journaled XXH3), each rewritten index's original renamed back (only while it
    holds the journaled new bytes), created folders, the stage and kvmigrate's locks
    removed. Returns (what was done by kind, what was kept and why)."""
    recs = run_records(run)
    done: Counter = Counter()
    kept: list[str] = []
    if not recs:
        return done, kept
    root = run.root
    proofs = [r for r in recs if r["t"] == "mc_store"]
    locks: list[MS.ClientLock] = []
    try:
        if not dry_run:  # each client root once (a resumed run journals its proofs again: a second
            # flock of one file from this process would read as a live client)
            for client in sorted({r["client"] for r in proofs}):
                locks.append(MS.hold_client_lock(os.path.join(root, client) if client else root))
        gone: set[str] = set()  # (a dry run: what the removals would take, so folders are counted alike)
        indexes = {r["meta"]: r for r in recs if r["t"] == "mc_index"}
        indexes.update({r["path"]: {**r, "meta": r["path"]} for r in recs if r["t"] == "mc_replace"})
        entries = {r["path"]: r for r in recs if r["t"] == "mc_entry"}
        # (an intent of a migration into DIR names paths under DIR: never reconciled against ROOT,
        # where an entry read in place has the very same relpath)
        intents = [r for r in recs if r["t"] == "mc_intent" and not r.get("dest")]
        # new pairs first (.meta, then .bucket, each only with the bytes the run wrote): journaled or
        # intended (a pair a killed run linked before its record)
        # what a migration into DIR made there (`base: dest`): its files, newest first (a pair's .meta
        # before its .bucket)
        for r in reversed([r for r in recs if r["t"] == "mc_file"]):
            path = os.path.join(run.dest, check_relpath(r["path"], "journal path"))
            if dry_run:
                if MS._hash_or_none(path) == r["xxh3"]:
                    done["kventry"] += 1
                    gone.add(path)
                continue
            what = MS.remove_kv_entry(path, r["xxh3"])
            done["kventry"] += what == "removed"
            if what == "kept":
                kept.append(f"{path}: changed since the migration made it; left in place")
        pairs = {(r["client"], r["id"], r.get("base")): r for it in intents for r in it.get("pairs", ())}
        pairs.update({(r["client"], r["id"], r.get("base")): r for r in recs if r["t"] == "mc_pair"})
        for (client, bucket_id, where), r in sorted(pairs.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            top = run.dest if where == "dest" else root
            base = os.path.join(top, client) if client else top
            if dry_run:
                done["pair"] += int(MS._hash_or_none(os.path.join(base, f"{bucket_id}{M.META_SUFFIX}")) == r["meta"])
                continue
            got = MS.remove_pair(base, bucket_id, r["meta"], r["bucket"])
            done["pair"] += int(got.get("meta") == "removed")
            if "kept" in got.values():
                kept.append(f"{base}/{bucket_id}{M.META_SUFFIX}: changed since the migration wrote the pair; left")
        for it in intents:  # reshard outputs over a displaced KVEntry a killed run did not journal
            for o in it.get("outputs", ()):
                if o["path"] not in entries and o["path"] not in indexes:
                    backup = os.path.join(BACKUP_DIR, run.header.get("run_id", ""), o["path"] + ".orig")
                    if _still_original(os.path.join(root, o["path"]), os.path.join(root, backup)):
                        continue  # killed between the backup link and the rename: nothing to put back
                    if os.path.exists(os.path.join(root, backup)):
                        indexes[o["path"]] = {"meta": o["path"], "client": o.get("client", ""), "new": o["xxh3"],
                                              "backup": backup}
                    elif MS._hash_or_none(os.path.join(root, o["path"])) == o["xxh3"]:
                        entries[o["path"]] = {"path": o["path"], "xxh3": o["xxh3"], "dirs": []}
        # work an interrupted run did but did not journal: proven by its bytes
        for it in intents:
            for rw in it.get("rewrites", ()):
                if rw["meta"] in indexes:
                    continue
                found = _unjournaled_rewrite(root, run, rw)
                if found is not None:
                    indexes[rw["meta"]] = found
            for e in it.get("entries", ()):
                if e["path"] in entries:
                    continue
                found = _unjournaled_entry(root, e)
                if found is not None:
                    entries[e["path"]] = found
        dirs: list[str] = []
        for path, r in sorted(entries.items(), reverse=True):
            check_relpath(path, "journal path")
            dirs += r.get("dirs") or []
            if dry_run:
                if MS._hash_or_none(os.path.join(root, path)) == r["xxh3"]:
                    done["kventry"] += 1
                    gone.add(os.path.join(root, path))
                continue
            what = MS.remove_kv_entry(os.path.join(root, path), r["xxh3"])
            if what == "removed":
                done["kventry"] += 1
            elif what == "kept":
                kept.append(f"{os.path.join(root, path)}: changed since the migration placed it; left in place")
        for meta, r in sorted(indexes.items()):
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
        dirs += [r["path"] for r in recs if r["t"] == "mc_dir" and r.get("base") != "dest"]
        dest_dirs = [r["path"] for r in recs if r["t"] == "mc_dir" and r.get("base") == "dest"]
        clients = {r.get("client", "") for it in intents for r in
                   [*it.get("rewrites", ()), *it.get("entries", ()), *it.get("pairs", ()), *it.get("outputs", ())]}
        for client in sorted(clients | {r["path"] for r in recs if r["t"] == "mc_dir" and r.get("base") != "dest"}):
            base = os.path.join(root, client) if client else root
            own = os.path.join(base, OWN_LOCK)
            if os.path.exists(own):
                done["lock"] += 1
                gone.add(own)
                if not dry_run:
                    os.unlink(own)
            stage = MS.stage_path(base)
            if dry_run:
                if os.path.isdir(stage):
                    gone.add(stage)
            else:
                MS.clear_stage(stage)
        for d, top in sorted({*((d, root) for d in dirs), *((d, run.dest) for d in dest_dirs)},
                             key=lambda x: -x[0].count("/")):  # (a folder it made, once empty)
            path = os.path.join(top, d)
            if dry_run:
                try:
                    left = [os.path.join(path, n) for n in os.listdir(path)]
                except OSError:
                    continue
                if all(p in gone for p in left):
                    done["dir"] += 1
                    gone.add(path)
                continue
            try:
                os.rmdir(path)
                done["dir"] += 1
            except OSError:
                pass
    finally:
        for lock in locks:
            lock.release()
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
    for r in run_records(run):
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
