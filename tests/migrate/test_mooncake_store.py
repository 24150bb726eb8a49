"""The Mooncake write primitives (kvmigrate/migrate/mooncake_store.py, mooncake.md §3.5-§5.3),
on real client roots, each judged by the reference reader (tests/helpers/mooncake_reader.py):
after every primitive, and after a crash at each of its steps, a client starting on the root
adopts what it should, deletes nothing but what the protocol allows, and reads the values it
should. A crash is an exception raised at a step (`step=`) or by a patched `os` call, which
the primitive does not catch: what is on disk then is what a kill -9 leaves."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import xxhash

from kvmigrate.errors import EXIT_OPERATIONAL, OperationalError
from kvmigrate.formats import mooncake as M
from kvmigrate.migrate import mooncake_store as S

from helpers.mooncake_reader import read, start

K0 = b"m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@aa"
K1 = b"m@tp_rank:1@pcp0@dcp0@pp_rank:0@group:0@aa"
V0, V1 = b"value zero " * 9, b"value one " * 5
RAW = {K0: V0, K1: V1}


class Crash(Exception):
    """A kill at this point: nothing after it runs, nothing is cleaned up."""


def crash_at(point: str):
    def step(p: str) -> None:
        if p == point:
            raise Crash(p)
    return step


def scoped(k: bytes) -> bytes:
    return b"default\0" + k


def make_pair(root: Path, ident: int, records: list[tuple[bytes, bytes]]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    bucket, meta = M.build_bucket(records)
    (root / f"{ident}.bucket").write_bytes(bucket)
    (root / f"{ident}.meta").write_bytes(M.encode_meta(meta))


def pair_names(root: Path) -> list[str]:
    """Every `.bucket`/`.meta` name below the root, relative to it."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name.endswith((".bucket", ".meta")))


def sees(root: Path, reads: dict[bytes, bytes], misses: tuple[bytes, ...] = (), deleted: tuple[str, ...] = (),
         scoped_reader: bool = True) -> None:
    """A client starting on `root` deletes exactly `deleted`, reads each key of `reads` as its
    value and no value for `misses`; no `.bucket`/`.meta` name is anywhere but at the top."""
    res = start(root)
    assert res.refused is None
    assert sorted(str(p.relative_to(root)) for p in res.deleted) == sorted(deleted)
    for k, v in reads.items():
        assert read(root, res, k, scoped=scoped_reader) == v, k
    for k in misses:
        assert isinstance(read(root, res, k, scoped=scoped_reader), str), k
    assert all("/" not in n for n in pair_names(root))


@pytest.fixture
def client(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    make_pair(root, 4096, [(K0, V0), (K1, V1)])
    return root


def backup_of(root: Path, name: str) -> str:
    return str(root / ".kvmigrate" / "mooncake" / "run1" / f"{name}.orig")


# --- the index rewrite ----------------------------------------------------------------------------

def test_a_rekey_changes_only_the_key_and_the_old_key_no_longer_reads(client):
    before = (client / "4096.meta").read_bytes()
    old, new = S.rewrite_index(str(client), "4096.meta", {0: scoped(K0)}, backup_of(client, "4096.meta"),
                               S.stage_path(str(client)))
    sees(client, {scoped(K0): V0}, misses=(K0,), scoped_reader=False)
    a, b = M.decode_meta(before), M.decode_meta((client / "4096.meta").read_bytes())
    assert (b.data_size, b.objects, b.keys[1]) == (a.data_size, a.objects, a.keys[1]) and b.keys[0] == scoped(K0)
    assert old == xxhash.xxh3_128(before).hexdigest() and new == xxhash.xxh3_128_hexdigest(
        (client / "4096.meta").read_bytes())
    kept = Path(backup_of(client, "4096.meta"))
    assert kept.read_bytes() == before and kept.stat().st_nlink == 1  # the original inode, only there now
    assert list((client / S.STAGE_NAME).iterdir()) == []


def test_a_retired_key_keeps_its_scoping_and_no_engine_reads_it(client):
    assert M.retired_key(scoped(K0), "r7") == b"default\0kvmigrate-retired@r7@" + K0
    assert M.retired_key(K0, "r7") == b"kvmigrate-retired@r7@" + K0
    assert M.parse_retired_key("kvmigrate-retired@r7@" + K0.decode()) == ("r7", K0.decode())
    with pytest.raises(ValueError):
        M.retired_key(K0, "run@1")
    S.rewrite_index(str(client), "4096.meta", {1: M.retired_key(K1, "r7")}, backup_of(client, "4096.meta"),
                    S.stage_path(str(client)))
    sees(client, {K0: V0, M.retired_key(K1, "r7"): V1}, misses=(K1,), scoped_reader=False)


def test_an_index_that_does_not_round_trip_is_never_rewritten(client):
    meta = client / "4096.meta"
    odd = b"\x08" + M.encode_varint(len(K0 + V0)) + b"\x12" + bytes([len(K0)]) + K0 + b"\x1a\x06\x08\x00\x10" + \
        bytes([len(K0)]) + b"\x18" + bytes([len(V0)])  # offset 0 written out: Mooncake omits it
    meta.write_bytes(odd)
    with pytest.raises(S.IndexDoesNotRoundTrip):
        S.rewrite_index(str(client), "4096.meta", {0: scoped(K0)}, backup_of(client, "4096.meta"),
                        S.stage_path(str(client)))
    assert meta.read_bytes() == odd and not Path(backup_of(client, "4096.meta")).exists()


def test_an_index_listing_nothing_is_never_rewritten(client):
    (client / "4096.meta").write_bytes(M.encode_meta(M.BucketMeta(10, (), ())))
    with pytest.raises(S.IndexRefused, match="lists 0 keys"):
        S.rewrite_index(str(client), "4096.meta", {}, backup_of(client, "4096.meta"), S.stage_path(str(client)))


def test_a_new_key_that_another_entry_holds_is_refused(client):
    with pytest.raises(S.IndexRefused, match="another entry"):
        S.rewrite_index(str(client), "4096.meta", {0: K1}, backup_of(client, "4096.meta"), S.stage_path(str(client)))
    sees(client, RAW, scoped_reader=False)


def test_an_index_changed_since_the_plan_is_stale(client):
    with pytest.raises(S.StaleFile):
        S.rewrite_index(str(client), "4096.meta", {0: scoped(K0)}, backup_of(client, "4096.meta"),
                        S.stage_path(str(client)), expect_xxh3="0" * 32)
    sees(client, RAW, scoped_reader=False)


def test_the_backup_is_an_fsynced_copy_across_filesystems(client, monkeypatch):
    real = os.link
    backup = backup_of(client, "4096.meta")

    def link(src, dst, **kw):
        if str(dst) == backup:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(src, dst, **kw)
    monkeypatch.setattr(os, "link", link)
    before = (client / "4096.meta").read_bytes()
    S.rewrite_index(str(client), "4096.meta", {0: scoped(K0)}, backup, S.stage_path(str(client)))
    assert Path(backup).read_bytes() == before
    assert sorted(p.name for p in Path(backup).parent.iterdir()) == ["4096.meta.orig"]


@pytest.mark.parametrize("point", ["backup", "tmp_written"])
def test_a_crash_during_an_index_rewrite_leaves_the_original_index(client, point):
    with pytest.raises(Crash):
        S.rewrite_index(str(client), "4096.meta", {0: scoped(K0)}, backup_of(client, "4096.meta"),
                        S.stage_path(str(client)), step=crash_at(point))
    sees(client, RAW, misses=(scoped(K0),), scoped_reader=False)
    assert all(p.name.endswith(".tmp") for p in (client / S.STAGE_NAME).glob("*"))


def test_a_failed_rename_leaves_the_original_index_and_no_temp(client, monkeypatch):
    def rename(src, dst):
        raise OSError(errno.EIO, "I/O error")
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OperationalError):
        S.rewrite_index(str(client), "4096.meta", {0: scoped(K0)}, backup_of(client, "4096.meta"),
                        S.stage_path(str(client)))
    sees(client, RAW, scoped_reader=False)
    assert list((client / S.STAGE_NAME).iterdir()) == []


def test_a_crash_after_the_rename_leaves_the_new_index(client):
    with pytest.raises(Crash):
        S.rewrite_index(str(client), "4096.meta", {0: scoped(K0)}, backup_of(client, "4096.meta"),
                        S.stage_path(str(client)), step=crash_at("renamed"))
    sees(client, {scoped(K0): V0, K1: V1}, misses=(K0,), scoped_reader=False)


# --- new pairs ------------------------------------------------------------------------------------

NEW = [(scoped(K0) + b"x", b"a" * 40), (scoped(K1) + b"x", b"b" * 30)]


def test_a_new_pair_is_adopted_and_every_key_reads(client):
    (ident,) = S.choose_bucket_ids(str(client), 1)
    assert ident == 4097
    w = S.write_pair(str(client), ident, NEW, S.stage_path(str(client)))
    sees(client, {K0: V0, K1: V1, **dict(NEW)}, scoped_reader=False)
    assert w.bucket_xxh3 == xxhash.xxh3_128_hexdigest((client / "4097.bucket").read_bytes())
    assert w.meta_xxh3 == xxhash.xxh3_128_hexdigest((client / "4097.meta").read_bytes())
    assert w.keys == tuple(k for k, _ in NEW) and w.value_xxh3s == tuple(xxhash.xxh3_128_hexdigest(v) for _, v in NEW)
    assert list((client / S.STAGE_NAME).iterdir()) == []


def test_a_taken_pair_name_is_a_conflict_and_nothing_is_written(client):
    (client / "4097.meta").write_bytes(b"someone else's")
    with pytest.raises(S.PairConflict):
        S.write_pair(str(client), 4097, NEW, S.stage_path(str(client)))
    assert not (client / "4097.bucket").exists()


def test_an_index_name_taken_meanwhile_takes_our_bucket_away(client, monkeypatch):
    real = os.link

    def link(src, dst, **kw):
        if str(dst).endswith("4097.meta"):
            Path(dst).write_bytes(b"raced")  # another writer's index appears first
        return real(src, dst, **kw)
    monkeypatch.setattr(os, "link", link)
    with pytest.raises(S.PairConflict):
        S.write_pair(str(client), 4097, NEW, S.stage_path(str(client)))
    assert not (client / "4097.bucket").exists() and list((client / S.STAGE_NAME).iterdir()) == []


@pytest.mark.parametrize(("point", "deleted"), [("bucket_tmp_written", ()), ("bucket_linked", ("4097.bucket",)),
                                                ("meta_tmp_written", ("4097.bucket",))])
def test_a_crash_before_the_index_is_linked_leaves_the_old_root(client, point, deleted):
    """A lone new `.bucket` is the only trace, and a start deletes it: a clean miss."""
    with pytest.raises(Crash):
        S.write_pair(str(client), 4097, NEW, S.stage_path(str(client)), step=crash_at(point))
    sees(client, RAW, misses=tuple(k for k, _ in NEW), deleted=deleted, scoped_reader=False)
    assert all(p.name.endswith(".tmp") for p in (client / S.STAGE_NAME).iterdir())


def test_a_crash_once_the_index_is_linked_leaves_the_pair_committed(client):
    with pytest.raises(Crash):
        S.write_pair(str(client), 4097, NEW, S.stage_path(str(client)), step=crash_at("meta_linked"))
    sees(client, {**RAW, **dict(NEW)}, scoped_reader=False)


def test_a_failed_link_of_the_index_leaves_no_lone_bucket(client, monkeypatch):
    real = os.link

    def link(src, dst, **kw):
        if str(dst).endswith(".meta"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst, **kw)
    monkeypatch.setattr(os, "link", link)
    with pytest.raises(OperationalError, match="no space"):
        S.write_pair(str(client), 4097, NEW, S.stage_path(str(client)))
    sees(client, RAW, scoped_reader=False)
    assert list((client / S.STAGE_NAME).iterdir()) == []


def test_new_ids_are_above_every_stoll_id_at_the_top(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    (root / "5000-0.bucket").write_bytes(b"x")  # stoll reads 5000
    (root / "4999.meta").write_bytes(b"x")
    (root / "sub").mkdir()
    (root / "sub" / "9999.bucket").write_bytes(b"x")  # not at the top
    assert S.choose_bucket_ids(str(root), 3) == [5001, 5002, 5003]


def test_an_empty_client_root_gets_ids_above_the_store_else_from_the_clock(tmp_path):
    assert S.choose_bucket_ids(str(tmp_path), 2, store_max=7000) == [7001, 7002]
    assert S.choose_bucket_ids(str(tmp_path), 1, now=1_700_000_000) == [1_700_000_000 << 12]


def test_pairs_are_sorted_by_key_and_cut_at_the_key_and_byte_limits():
    objs = [(b"k%03d" % i, b"v" * 10) for i in reversed(range(7))]
    assert [len(p) for p in S.pack_pairs(objs, max_keys=3)] == [3, 3, 1]
    assert [k for p in S.pack_pairs(objs, max_keys=3) for k, _ in p] == sorted(k for k, _ in objs)
    assert [len(p) for p in S.pack_pairs(objs, max_bytes=28)] == [2, 2, 2, 1]  # 14 bytes a record
    assert [len(p) for p in S.pack_pairs([(b"big", b"v" * 100), (b"a", b"v")], max_bytes=50)] == [1, 1]
    assert len(S.pack_pairs([(b"k%04d" % i, b"") for i in range(1001)])[0]) == M.MAX_BUCKET_KEYS
    with pytest.raises(ValueError, match="twice"):
        S.pack_pairs([(b"a", b"1"), (b"a", b"2")])


# --- KVEntries ------------------------------------------------------------------------------------

def test_a_placed_kv_entry_reads_and_its_hash_folders_are_reported(tmp_path):
    made: list[str] = []
    path, digest = S.place_kv_entry(str(tmp_path / M.DEFAULT_FSDIR), scoped(K0), V0, S.stage_path(str(tmp_path)), made)
    sees(tmp_path, {scoped(K0): V0})
    assert path == str(tmp_path / M.fpk(scoped(K0))) and digest == xxhash.xxh3_128_hexdigest(Path(path).read_bytes())
    rel = M.fpk(scoped(K0)).split("/")
    assert made == [str(tmp_path / rel[0]), str(tmp_path / rel[0] / rel[1]), str(tmp_path / "/".join(rel[:3]))]
    again: list[str] = []
    with pytest.raises(S.EntryOccupied) as err:
        S.place_kv_entry(str(tmp_path / M.DEFAULT_FSDIR), scoped(K0), V0, S.stage_path(str(tmp_path)), again)
    assert err.value.identical and again == []


@pytest.mark.parametrize("point", ["dirs_made", "tmp_written"])
def test_a_crash_before_a_kv_entry_is_linked_leaves_nothing_at_depth_3(tmp_path, point):
    with pytest.raises(Crash):
        S.place_kv_entry(str(tmp_path / M.DEFAULT_FSDIR), scoped(K0), V0, S.stage_path(str(tmp_path)), [], step=crash_at(point))
    sees(tmp_path, {}, misses=(scoped(K0),))
    assert [p for p in (tmp_path / M.DEFAULT_FSDIR).rglob("*") if p.is_file()] == []


def test_a_displaced_kv_entry_is_replaced_and_its_original_kept(tmp_path):
    path, _ = S.place_kv_entry(str(tmp_path / M.DEFAULT_FSDIR), scoped(K0), V0, S.stage_path(str(tmp_path)), [])
    before = Path(path).read_bytes()
    backup = backup_of(tmp_path, M.fpk(scoped(K0)))
    new = M.encode_kv_entry(M.KVEntry(scoped(K0), V1))
    old_h, new_h = S.replace_kv_entry(path, new, backup, S.stage_path(str(tmp_path)))
    sees(tmp_path, {scoped(K0): V1})
    assert Path(backup).read_bytes() == before and new_h == xxhash.xxh3_128_hexdigest(new)
    assert old_h == xxhash.xxh3_128_hexdigest(before)


def test_a_kv_entry_whose_key_is_read_elsewhere_never_replaces(tmp_path):
    path, _ = S.place_kv_entry(str(tmp_path / M.DEFAULT_FSDIR), scoped(K0), V0, S.stage_path(str(tmp_path)), [])
    with pytest.raises(S.IntegrityError, match="is read at"):
        S.replace_kv_entry(path, M.encode_kv_entry(M.KVEntry(scoped(K1), V1)), backup_of(tmp_path, "x"),
                           S.stage_path(str(tmp_path)))
    sees(tmp_path, {scoped(K0): V0})


@pytest.mark.parametrize("point", ["backup", "tmp_written"])
def test_a_crash_during_a_kv_entry_replace_leaves_the_original(tmp_path, point):
    path, _ = S.place_kv_entry(str(tmp_path / M.DEFAULT_FSDIR), scoped(K0), V0, S.stage_path(str(tmp_path)), [])
    with pytest.raises(Crash):
        S.replace_kv_entry(path, M.encode_kv_entry(M.KVEntry(scoped(K0), V1)), backup_of(tmp_path, "e"),
                           S.stage_path(str(tmp_path)), step=crash_at(point))
    sees(tmp_path, {scoped(K0): V0})


# --- the client lock ------------------------------------------------------------------------------

@contextmanager
def lock_held_by_another_process(path: Path) -> Iterator[None]:
    code = ("import fcntl, os, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "sys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "locked"
        yield
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()


def test_the_lock_is_created_empty_held_and_never_removed(tmp_path):
    lock = tmp_path / M.LOCK_NAME
    assert S.probe_client_lock(str(tmp_path)) == "absent" and not lock.exists()
    with S.hold_client_lock(str(tmp_path)) as held:
        assert held.created and lock.read_bytes() == b""
        assert S.probe_client_lock(str(tmp_path)) == "held"
    assert lock.exists() and S.probe_client_lock(str(tmp_path)) == "free"
    with S.hold_client_lock(str(tmp_path)) as again:
        assert not again.created


def test_a_lock_another_process_holds_is_exit_8_naming_the_path(tmp_path):
    lock = tmp_path / M.LOCK_NAME
    with lock_held_by_another_process(lock):
        assert S.probe_client_lock(str(tmp_path)) == "held"
        with pytest.raises(OperationalError) as err:
            S.hold_client_lock(str(tmp_path))
        assert err.value.exit_code == EXIT_OPERATIONAL and str(lock) in str(err.value)
        assert "stop every vLLM or SGLang worker" in str(err.value)
    assert S.probe_client_lock(str(tmp_path)) == "free"


# --- undo -----------------------------------------------------------------------------------------

def test_a_rewritten_index_is_restored_only_while_it_holds_the_new_hash(client):
    backup = backup_of(client, "4096.meta")
    _, new = S.rewrite_index(str(client), "4096.meta", {0: scoped(K0)}, backup, S.stage_path(str(client)))
    assert S.restore_index(str(client / "4096.meta"), backup, "f" * 32) == "kept"
    sees(client, {scoped(K0): V0}, scoped_reader=False)
    assert S.restore_index(str(client / "4096.meta"), backup, new) == "restored"
    sees(client, RAW, misses=(scoped(K0),), scoped_reader=False)
    assert not Path(backup).exists()


def test_an_index_backup_on_another_filesystem_is_copied_back(client, monkeypatch):
    backup = backup_of(client, "4096.meta")
    _, new = S.rewrite_index(str(client), "4096.meta", {0: scoped(K0)}, backup, S.stage_path(str(client)))
    real = os.rename

    def rename(src, dst):
        if str(src) == backup:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(src, dst)
    monkeypatch.setattr(os, "rename", rename)
    assert S.restore_index(str(client / "4096.meta"), backup, new) == "restored"
    sees(client, RAW, scoped_reader=False)


def test_a_replaced_kv_entry_is_restored(tmp_path):
    path, _ = S.place_kv_entry(str(tmp_path / M.DEFAULT_FSDIR), scoped(K0), V0, S.stage_path(str(tmp_path)), [])
    backup = backup_of(tmp_path, "e")
    _, new = S.replace_kv_entry(path, M.encode_kv_entry(M.KVEntry(scoped(K0), V1)), backup,
                                S.stage_path(str(tmp_path)))
    assert S.restore_index(path, backup, new) == "restored"
    sees(tmp_path, {scoped(K0): V0})


def test_a_new_pair_is_removed_index_first_and_only_with_its_hashes(client, monkeypatch):
    w = S.write_pair(str(client), 4097, NEW, S.stage_path(str(client)))
    assert S.remove_pair(str(client), 4097, "0" * 32, w.bucket_xxh3) == {"meta": "kept", "bucket": "kept"}
    sees(client, {**RAW, **dict(NEW)}, scoped_reader=False)
    real, order = os.unlink, []

    def unlink(p, *a, **kw):
        order.append(os.path.basename(p))
        return real(p, *a, **kw)
    monkeypatch.setattr(os, "unlink", unlink)
    assert S.remove_pair(str(client), 4097, w.meta_xxh3, w.bucket_xxh3) == {"meta": "removed", "bucket": "removed"}
    assert order == ["4097.meta", "4097.bucket"]
    sees(client, RAW, misses=tuple(k for k, _ in NEW), scoped_reader=False)


def test_a_lone_bucket_of_the_run_is_removed_and_another_bucket_kept(client):
    with pytest.raises(Crash):
        S.write_pair(str(client), 4097, NEW, S.stage_path(str(client)), step=crash_at("bucket_linked"))
    digest = xxhash.xxh3_128_hexdigest((client / "4097.bucket").read_bytes())
    assert S.remove_pair(str(client), 4097, "0" * 32, "1" * 32) == {"meta": "absent", "bucket": "kept"}
    assert S.remove_pair(str(client), 4097, "0" * 32, digest) == {"meta": "absent", "bucket": "removed"}
    sees(client, RAW, scoped_reader=False)


def test_a_placed_kv_entry_is_removed_only_with_its_hash(tmp_path):
    path, digest = S.place_kv_entry(str(tmp_path / M.DEFAULT_FSDIR), scoped(K0), V0, S.stage_path(str(tmp_path)), [])
    assert S.remove_kv_entry(path, "0" * 32) == "kept"
    assert S.remove_kv_entry(path, digest) == "removed" and S.remove_kv_entry(path, digest) == "absent"
    sees(tmp_path, {}, misses=(scoped(K0),))


def test_a_crash_between_removing_the_index_and_the_bucket_leaves_a_clean_miss(client, monkeypatch):
    w = S.write_pair(str(client), 4097, NEW, S.stage_path(str(client)))
    real = os.unlink

    def unlink(p, *a, **kw):
        if str(p).endswith(".bucket"):
            raise Crash(p)
        return real(p, *a, **kw)
    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(Crash):
        S.remove_pair(str(client), 4097, w.meta_xxh3, w.bucket_xxh3)
    sees(client, RAW, misses=tuple(k for k, _ in NEW), deleted=("4097.bucket",), scoped_reader=False)


def test_a_kv_entry_with_a_name_near_the_limit_is_staged_under_its_hash(tmp_path):
    key = b"default\0" + b"k" * 240  # a 248-byte file name: with `.<pid>.tmp` over NAME_MAX
    path, _ = S.place_kv_entry(str(tmp_path / M.DEFAULT_FSDIR), key, V0, S.stage_path(str(tmp_path)), [])
    assert len(os.path.basename(path)) == 248
    sees(tmp_path, {key: V0})


def test_the_stage_is_cleared_of_temps_and_kept_with_anything_else(client):
    stage = S.stage_path(str(client))
    with pytest.raises(Crash):
        S.write_pair(str(client), 4097, NEW, stage, step=crash_at("bucket_tmp_written"))
    assert S.clear_stage(stage) == [] and not os.path.exists(stage)
    with pytest.raises(Crash):
        S.write_pair(str(client), 4098, NEW, stage, step=crash_at("bucket_tmp_written"))
    Path(stage, "notes.txt").write_text("x")
    assert S.clear_stage(stage) == [os.path.join(stage, "notes.txt")]
    assert os.listdir(stage) == ["notes.txt"]
