"""Writing a Mooncake client root without ever exposing a bad one (mooncake.md §5.1-§5.3):
the file operations a Mooncake migration, rollback and prune are made of.

A starting client deletes a `.bucket` anywhere below its root without a top-level `.meta`
of its id, deletes a pair whose `.meta` does not parse or lists nothing, and refuses to
start on anything at depth 3 of its `<fsdir>` that is no KVEntry (§1.4). So every write
here goes through a temp `<client>/.kvmigrate-stage/<final name>.<pid>.tmp` (a name no
client adopts or deletes), is fsynced, then published: a new name by `link` (no clobber),
a rewritten `.meta` or a displaced KVEntry by `rename` over it after a hard-link backup of
the original. After any step, killed or not, a client starting on the root sees either
the old state or the new one (a new pair's `.bucket` alone, before its `.meta`, is deleted
by that start: a clean miss). The `.meta` is a new pair's commit point.

Each primitive takes `step`, called with the name of every point it passes
(`backup`, `tmp_written`, `renamed`, `bucket_linked`, `meta_linked`, ...): the apply's
crash seam (`CrashSeam.hit`) and the tests' way to stop between two steps.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import xxhash

from kvmigrate.errors import IntegrityError, OperationalError, write_error
from kvmigrate.families.mooncake import probe_client_lock
from kvmigrate.formats.mooncake import (
    BUCKET_SUFFIX,
    LOCK_NAME,
    MAX_BUCKET_BYTES,
    MAX_BUCKET_KEYS,
    META_SUFFIX,
    BucketMeta,
    DecodeError,
    KVEntry,
    build_bucket,
    decode_kv_entry,
    decode_meta,
    encode_kv_entry,
    encode_meta,
    fpk,
    is_pair_name,
    next_bucket_id,
    retired_key,
    stoll_id,
)
from kvmigrate.fsio import CHUNK, hash_file, open_noatime

__all__ = ["STAGE_NAME", "ClientLock", "clear_stage", "EntryOccupied", "IndexDoesNotRoundTrip", "IndexRefused", "PairConflict",
           "PairWritten", "StaleFile", "choose_bucket_ids", "hold_client_lock", "pack_pairs", "place_kv_entry",
           "probe_client_lock", "remove_kv_entry", "remove_pair", "replace_kv_entry", "restore_index",
           "retired_key", "rewrite_index", "stage_path", "write_pair"]

STAGE_NAME = ".kvmigrate-stage"
NAME_MAX = 255

Step = Callable[[str], None]


def _no_step(point: str) -> None:
    pass


class IndexRefused(IntegrityError):
    """A `.meta` this module will not rewrite: what it would write is not an index a
    starting client keeps with every entry (the objects get `none`)."""


class IndexDoesNotRoundTrip(IndexRefused):
    """A `.meta` whose bytes kvmigrate's encoder does not give back from their decoding:
    rewriting it could change more than the keys (§5.2, "index does not round-trip")."""


class PairConflict(IntegrityError):
    """A name of a new pair (`<id>.bucket`, `<id>.meta`) is taken: another writer in the
    client root, or an id chosen from a stale listing. Nothing of the pair is left."""


class EntryOccupied(IntegrityError):
    """`fpk(key)` already holds a file: a KVEntry is never written over but by
    `replace_kv_entry` (a displaced one). `identical`: it holds exactly these bytes."""

    def __init__(self, message: str, *, path: str, identical: bool):
        self.identical = identical
        super().__init__(message, path=path)


class StaleFile(IntegrityError):
    """The file is not the one the plan read (its XXH3 differs): nothing is written."""


def xxh3_hex(data: bytes) -> str:
    return xxhash.xxh3_128(data).hexdigest()


def stage_path(client_root: str) -> str:
    """The client root's stage folder (temps; removed at the end of the run)."""
    return os.path.join(client_root, STAGE_NAME)


def temp_path(stage: str, final_name: str) -> str:
    """`<stage>/<final name>.<pid>.tmp`, never ending in `.bucket`/`.meta`; a final name
    too long for that (a long KVEntry key) is replaced by its hash."""
    name = f"{final_name}.{os.getpid()}.tmp"
    if len(os.fsencode(name)) > NAME_MAX:
        name = f"{xxhash.xxh3_64(os.fsencode(final_name)).hexdigest()}.{os.getpid()}.tmp"
    return os.path.join(stage, name)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mkdir(path: str) -> bool:
    """Make one folder (its parent must exist), fsynced into its parent. True if made
    here; an existing one must be a real folder, never a symlink."""
    try:
        os.mkdir(path, 0o777)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise OperationalError("is a symlink or not a folder; refusing to write through it", path=path,
                                   hint="move it aside, then rerun") from None
        return False
    _fsync_dir(os.path.dirname(path))
    return True


def _ensure_stage(stage: str) -> None:
    _mkdir(stage)


def clear_stage(stage_dir: str) -> list[str]:
    """Remove the stage at the end of a run: its temps (`*.tmp`: this run's, or a killed
    one's, never read by anyone) and the folder; returns what else it found there, kept
    along with the folder."""
    try:
        names = os.listdir(stage_dir)
    except FileNotFoundError:
        return []
    others = []
    for name in names:
        path = os.path.join(stage_dir, name)
        if name.endswith(".tmp") and stat.S_ISREG(os.lstat(path).st_mode):
            os.unlink(path)
        else:
            others.append(path)
    if not others:
        os.rmdir(stage_dir)
        _fsync_dir(os.path.dirname(stage_dir))
    return others


def _read(path: str) -> bytes:
    fd = open_noatime(path)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OperationalError("is not a regular file", path=path)
        chunks = []
        while buf := os.read(fd, CHUNK):
            chunks.append(buf)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _hash_or_none(path: str) -> str | None:
    """XXH3-128 of a regular file, None when it is absent."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    return hash_file(path)[0].hex()


def _write_temp(path: str, data: bytes) -> tuple[str, int]:
    """A new file of `data` (a leftover temp of this pid is replaced), fsynced: (XXH3-128, inode)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError:
        os.unlink(path)
        fd = os.open(path, flags, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        ino = os.fstat(fd).st_ino
    finally:
        os.close(fd)
    return xxh3_hex(data), ino


def _same_inode(path: str, ino: int) -> bool:
    try:
        return os.lstat(path).st_ino == ino
    except FileNotFoundError:
        return False


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _not_a_pair_name(path: str, what: str) -> None:
    if path.endswith((BUCKET_SUFFIX, META_SUFFIX)):
        raise OperationalError(f"{what} must not end in {BUCKET_SUFFIX} or {META_SUFFIX}: a starting client "
                               "would adopt or delete it", path=path)


def _backup(src: str, backup: str) -> None:
    """The original kept at `backup`: a hard link of its inode, or an fsynced copy when the
    backup folder is on another filesystem (EXDEV). A backup already there must be this
    very inode (a resumed run); anything else is refused."""
    _not_a_pair_name(backup, "a backup name")
    os.makedirs(os.path.dirname(backup), exist_ok=True)
    try:
        os.link(src, backup, follow_symlinks=False)
    except FileExistsError:
        if os.path.samestat(os.lstat(src), os.lstat(backup)) or _hash_or_none(backup) == _hash_or_none(src):
            return  # this run's backup (a resumed run; a copy when it was made across filesystems)
        raise OperationalError("a backup is already there, of another file", path=backup,
                               hint="this run's backup folder holds another run's files; use a new run id") from None
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise write_error(exc, "cannot keep the original", backup) from None
        tmp = f"{backup}.{os.getpid()}.tmp"
        _write_temp(tmp, _read(src))
        os.rename(tmp, backup)
    _fsync_dir(os.path.dirname(backup))


def _current(path: str, expect_xxh3: str | None) -> tuple[bytes, str]:
    """The file's bytes and XXH3-128; StaleFile when it is not the one the plan read."""
    data = _read(path)
    digest = xxh3_hex(data)
    if expect_xxh3 is not None and digest != expect_xxh3:
        raise StaleFile(f"changed since it was read (XXH3 {digest}, the plan read {expect_xxh3})", path=path,
                        hint="rescan, then plan again")
    return data, digest


def _via_temp(stage: str, final: str, data: bytes, step: Step, what: str,
              put: Callable[[str, str], None]) -> tuple[str, int]:
    """`data` in an fsynced temp of the stage, then `put` (a rename over, or a link to) at
    `final`; the temp is gone after. Returns (XXH3-128, inode)."""
    _ensure_stage(stage)
    tmp = temp_path(stage, os.path.basename(final))
    try:
        digest, ino = _write_temp(tmp, data)
        step(f"{what}tmp_written")
        put(tmp, final)
    except OSError:
        _unlink_quiet(tmp)
        raise
    _unlink_quiet(tmp)  # (a link leaves it; a rename took it)
    return digest, ino


def _link(src: str, dst: str) -> None:
    os.link(src, dst, follow_symlinks=False)


def _replace(path: str, data: bytes, backup_path: str, stage: str, step: Step, doing: str) -> str:
    """The original linked to its backup, then an fsynced temp of `data` renamed over it
    and the folder fsynced: a reader sees the old file or the new one. Returns the new XXH3."""
    _backup(path, backup_path)
    step("backup")
    try:
        new, _ = _via_temp(stage, path, data, step, "", os.rename)
    except OSError as exc:
        raise write_error(exc, doing, path) from None
    step("renamed")
    _fsync_dir(os.path.dirname(path))
    return new


# --- an index rewrite (§5.2) ---------------------------------------------------------------------

def rewrite_index(client_root: str, meta_name: str, new_keys: dict[int, bytes], backup_path: str,
                  stage_dir: str, *, expect_xxh3: str | None = None, step: Step = _no_step) -> tuple[str, str]:
    """Give entries `i` of `<client>/<meta_name>` the keys `new_keys[i]` (a rekey, or a
    retire: `retired_key`), nothing else: `data_size`, every offset, `key_size` (the skip
    to the value), the count and the order stay. The `.meta` must round-trip through the
    codec and list at least one entry; the original is linked to `backup_path` first;
    the new index goes in by `rename` of an fsynced temp. Returns (old XXH3, new XXH3)."""
    path = os.path.join(client_root, meta_name)
    if not is_pair_name(meta_name) or not meta_name.endswith(META_SUFFIX):
        raise IndexRefused(f"{meta_name!r} is not a top-level <id>{META_SUFFIX} a client reads", path=path)
    data, old = _current(path, expect_xxh3)
    try:
        meta = decode_meta(data)
    except DecodeError as exc:
        raise IndexDoesNotRoundTrip(f"index does not round-trip: it does not parse ({exc})", path=path) from None
    if encode_meta(meta) != data:
        raise IndexDoesNotRoundTrip("index does not round-trip: its bytes are not what kvmigrate's encoder "
                                    "writes for its fields", path=path)
    if not meta.keys or not meta.objects or meta.data_size == 0 or len(meta.keys) != len(meta.objects):
        raise IndexRefused(f"the index lists {len(meta.keys)} keys and {len(meta.objects)} entries, data_size "
                           f"{meta.data_size}: a start deletes it; it is never rewritten", path=path)
    keys = list(meta.keys)
    for i, key in new_keys.items():
        if not 0 <= i < len(keys):
            raise IndexRefused(f"entry {i} is out of range (the index lists {len(keys)})", path=path)
        if not key:
            raise IndexRefused(f"entry {i}: an empty key", path=path)
        keys[i] = key
    for i, key in new_keys.items():
        if keys.count(key) > 1:
            raise IndexRefused(f"entry {i}'s new key is another entry's too (a key in two entries is never read)",
                               path=path)
    new = encode_meta(BucketMeta(meta.data_size, tuple(keys), meta.objects))
    return old, _replace(path, new, backup_path, stage_dir, step, "cannot rewrite the index")


# --- a new pair (§3.6, §5.2) ---------------------------------------------------------------------

@dataclass(frozen=True)
class PairWritten:
    """What the journal records of a new pair: its id, both files' XXH3-128, its keys and
    each value's XXH3-128 (in the pair's order)."""

    id: int
    bucket_xxh3: str
    meta_xxh3: str
    keys: tuple[bytes, ...]
    value_xxh3s: tuple[str, ...]


def choose_bucket_ids(client_root: str, count: int, store_max: int | None = None,
                      now: float | None = None) -> list[int]:
    """`count` consecutive ids above every `stoll` id of a `.bucket`/`.meta` at the top of
    the client root (FIFO eviction then takes them last, and a restarted client resumes
    above them); an empty client root: above `store_max` (the store's largest), else
    `unix_seconds << 12`."""
    try:
        names = os.listdir(client_root)
    except FileNotFoundError:
        names = []
    ids = [i for i in (stoll_id(n) for n in names) if i is not None]
    if not ids and store_max is not None:
        ids = [store_max]
    first = next_bucket_id(ids, int(time.time() if now is None else now))
    return list(range(first, first + count))


def pack_pairs(objects: Sequence[tuple[bytes, bytes]], max_keys: int = MAX_BUCKET_KEYS,
               max_bytes: int = MAX_BUCKET_BYTES) -> list[list[tuple[bytes, bytes]]]:
    """(storage key, value) objects sorted by key and cut into pairs of at most `max_keys`
    keys and `max_bytes` of records (an object larger than that alone in its pair), as a
    client fills its buckets. A key given twice is refused: it would be in two entries."""
    return list(pack_sorted(sorted(objects, key=lambda kv: kv[0]), max_keys, max_bytes))


def pack_sorted(ordered: Iterable[tuple[bytes, bytes]], max_keys: int = MAX_BUCKET_KEYS,
                max_bytes: int = MAX_BUCKET_BYTES) -> Iterator[list[tuple[bytes, bytes]]]:
    """`pack_pairs` of objects already sorted by key, a pair at a time (objects read from
    disk as they are packed: a reshard's outputs)."""
    pair: list[tuple[bytes, bytes]] = []
    size = 0
    prev: bytes | None = None
    for key, value in ordered:
        if key == prev:
            raise ValueError(f"storage key {key!r} is given twice: a key in two live entries is never read")
        prev = key
        n = len(key) + len(value)
        if len(pair) >= max_keys or (pair and size + n > max_bytes):
            yield pair
            pair = []
            size = 0
        pair.append((key, value))
        size += n
    if pair:
        yield pair


def write_pair(client_root: str, bucket_id: int, objects: Sequence[tuple[bytes, bytes]], stage_dir: str,
               *, step: Step = _no_step) -> PairWritten:
    """A new pair `<id>.bucket` + `<id>.meta` holding `objects` in the given order: each file
    an fsynced temp linked to its name (no clobber: a taken name is PairConflict), the
    `.bucket` first, the `.meta` (the commit point) second, the folder fsynced after each."""
    root = client_root
    if not objects:
        raise ValueError("a pair holds at least one object: a client deletes an empty index")
    if len(objects) > MAX_BUCKET_KEYS:
        raise ValueError(f"{len(objects)} objects in one pair: at most {MAX_BUCKET_KEYS} (pack_pairs)")
    keys = tuple(k for k, _ in objects)
    if len(set(keys)) != len(keys) or not all(keys):
        raise ValueError("a pair's keys must be distinct and non-empty")
    bucket_bytes, meta = build_bucket(list(objects))
    meta_bytes = encode_meta(meta)
    bname, mname = f"{bucket_id}{BUCKET_SUFFIX}", f"{bucket_id}{META_SUFFIX}"
    bpath, mpath = os.path.join(root, bname), os.path.join(root, mname)
    for p in (bpath, mpath):
        if os.path.lexists(p):
            raise PairConflict(f"bucket id {bucket_id} is taken", path=p, hint="choose ids from a fresh listing")
    linked = False

    def publish(data: bytes, final: str, what: str) -> tuple[str, int]:
        try:
            got = _via_temp(stage_dir, final, data, step, f"{what}_", _link)
        except FileExistsError:
            raise PairConflict(f"bucket id {bucket_id}'s {what} name was taken meanwhile", path=final) from None
        _fsync_dir(root)
        return got

    try:
        bucket_hash, ino = publish(bucket_bytes, bpath, "bucket")
        linked = True
        step("bucket_linked")
        meta_hash, _ = publish(meta_bytes, mpath, "meta")
        linked = False
        step("meta_linked")
    except (OSError, PairConflict) as exc:  # (the temps are gone: `_via_temp`)
        if linked and _same_inode(bpath, ino):
            os.unlink(bpath)  # ours, with no index: the pair was not committed
            _fsync_dir(root)
        if isinstance(exc, OSError):
            raise write_error(exc, "cannot write a new pair", mpath if linked else bpath) from None
        raise
    values = tuple(xxh3_hex(v) for _, v in objects)
    return PairWritten(bucket_id, bucket_hash, meta_hash, keys, values)


# --- KVEntries (§1.3, §5.2) ----------------------------------------------------------------------

def place_kv_entry(fsdir_root: str, key: bytes, value: bytes, stage_dir: str, created_dirs: list[str],
                   *, step: Step = _no_step) -> tuple[str, str]:
    """A KVEntry of (`key`, `value`) at `fpk(key)` under `fsdir_root` (`<client>/<fsdir>`):
    the fsdir and hash folders made as needed (each appended to `created_dirs`, for the
    journal), an fsynced temp in the stage (never in the fsdir) linked to the final name
    (no clobber: a taken one is EntryOccupied). Returns (path, XXH3-128)."""
    if not key:
        raise ValueError("a KVEntry needs a key")
    data = encode_kv_entry(KVEntry(key, value))
    parts = fpk(key, os.path.basename(os.path.normpath(fsdir_root))).split("/")[1:]  # a, b, name
    final = os.path.join(fsdir_root, *parts)
    d = fsdir_root
    if _mkdir(d):
        created_dirs.append(d)
    for part in parts[:-1]:
        d = os.path.join(d, part)
        if _mkdir(d):
            created_dirs.append(d)
    step("dirs_made")
    try:
        digest, _ = _via_temp(stage_dir, final, data, step, "", _link)
    except FileExistsError:
        same = _hash_or_none(final) == xxh3_hex(data)
        raise EntryOccupied("fpk(key) already holds a file" + (" with these bytes" if same else ""), path=final,
                            identical=same) from None
    except OSError as exc:
        raise write_error(exc, "cannot place a KVEntry", final) from None
    _fsync_dir(os.path.dirname(final))
    step("linked")
    return final, digest


def replace_kv_entry(path: str, new_entry: bytes, backup_path: str, stage_dir: str, *,
                     expect_xxh3: str | None = None, step: Step = _no_step) -> tuple[str, str]:
    """A displaced KVEntry replaced (§3.5): the original linked to `backup_path`, then an
    fsynced temp `rename`d over it. `new_entry` must be a KVEntry whose key's `fpk` is
    this very path (its last three parts). Returns (old XXH3, new XXH3)."""
    try:
        entry = decode_kv_entry(new_entry)
    except DecodeError as exc:
        raise IntegrityError(f"the new content is no KVEntry ({exc})", path=path) from None
    want = fpk(entry.key, "x").split("/")[1:]
    if os.path.normpath(path).split(os.sep)[-3:] != want:
        raise IntegrityError(f"the entry's key is read at .../{'/'.join(want)}, not here", path=path)
    _, old = _current(path, expect_xxh3)
    return old, _replace(path, new_entry, backup_path, stage_dir, step, "cannot replace a KVEntry")


# --- the client lock (§5.1) ----------------------------------------------------------------------

class ClientLock:
    """kvmigrate's hold of a client root's `.mooncake_local_disk.lock` flock: the proof no
    0.3.14 client runs there, and no client starts while held (`setup()` fails fast).
    `created`: the file was made here (the journal says so); it is never removed, since
    removing a lock file others open races with them."""

    def __init__(self, path: str, fd: int, created: bool):
        self.path = path
        self.created = created
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ClientLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def hold_client_lock(client_root: str) -> ClientLock:
    """Take `flock(LOCK_EX | LOCK_NB)` of `<client>/.mooncake_local_disk.lock`, creating it
    empty when absent (as 0.3.14 does). A held lock is a running client: OperationalError
    (exit 8), nothing written."""
    path = os.path.join(client_root, LOCK_NAME)
    created = True
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        created = False
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise OperationalError(f"cannot open the Mooncake client lock: {exc.strerror or exc}", path=path,
                                   hint="it must be a regular file kvmigrate may read") from None
    except OSError as exc:
        raise write_error(exc, "cannot create the Mooncake client lock", path) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OperationalError(
            f"a Mooncake client holds {path}: it is running on this client root", path=path,
            hint="stop every vLLM or SGLang worker whose Mooncake client uses this store, then rerun "
                 "(nothing was written)") from None
    if created:
        _fsync_dir(client_root)
    return ClientLock(path, fd, created)


# --- undo (§5.3) ---------------------------------------------------------------------------------

def restore_index(path: str, backup_path: str, expected_new_xxh3: str, stage_dir: str | None = None
                  ) -> Literal["restored", "kept"]:
    """Put the original back over a rewritten `.meta` (or a replaced KVEntry): `rename` of
    its backup, only while the file still holds the journaled new XXH3; anything else
    (changed since, evicted, no backup) is `kept`. A backup on another filesystem is
    copied to a temp in `stage_dir` first (by default the `.meta`'s client root's; a KVEntry's
    must be given: a temp is never in `<fsdir>`)."""
    if _hash_or_none(path) != expected_new_xxh3 or not os.path.isfile(backup_path):
        return "kept"
    folder = os.path.dirname(path)
    try:
        os.rename(backup_path, path)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise write_error(exc, "cannot put the original back", path) from None
        if stage_dir is None:
            if not path.endswith(META_SUFFIX):
                raise ValueError("a KVEntry's backup across filesystems needs its client root's stage") from None
            stage_dir = stage_path(folder)
        _ensure_stage(stage_dir)
        tmp = temp_path(stage_dir, os.path.basename(path))
        _write_temp(tmp, _read(backup_path))
        os.rename(tmp, path)
        os.unlink(backup_path)
    _fsync_dir(folder)
    return "restored"


def remove_pair(client_root: str, bucket_id: int, meta_xxh3: str, bucket_xxh3: str) -> dict[str, str]:
    """Remove a pair this run wrote: the `.meta` first (the pair is gone for a client at
    once), then the `.bucket`, each only while it holds the journaled XXH3. An index that
    differs keeps both files (another pair now owns the id). Per file: `removed`,
    `absent` or `kept`."""
    mpath = os.path.join(client_root, f"{bucket_id}{META_SUFFIX}")
    bpath = os.path.join(client_root, f"{bucket_id}{BUCKET_SUFFIX}")
    out: dict[str, str] = {}
    got = _hash_or_none(mpath)
    if got is None:
        out["meta"] = "absent"
    elif got != meta_xxh3:
        return {"meta": "kept", "bucket": "kept"}
    else:
        os.unlink(mpath)
        _fsync_dir(client_root)
        out["meta"] = "removed"
    got = _hash_or_none(bpath)
    if got is None:
        out["bucket"] = "absent"
    elif got != bucket_xxh3:
        out["bucket"] = "kept"
    else:
        os.unlink(bpath)
        _fsync_dir(client_root)
        out["bucket"] = "removed"
    return out


def remove_kv_entry(path: str, expected_xxh3: str) -> Literal["removed", "absent", "kept"]:
    """Remove a KVEntry this run placed, only while it holds the journaled XXH3."""
    got = _hash_or_none(path)
    if got is None:
        return "absent"
    if got != expected_xxh3:
        return "kept"
    os.unlink(path)
    _fsync_dir(os.path.dirname(path))
    return "removed"
