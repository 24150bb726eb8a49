"""The Mooncake reference reader (tests/helpers/mooncake_reader.py), one test per start and
read rule it implements (spec mooncake.md §1.2-§1.4, §2.1), on client roots written here
byte by byte as the research notes describe them, never with kvmigrate's codec; and the
codec of kvmigrate/formats/mooncake.py read back by it (two implementations agreeing)."""

from __future__ import annotations

from pathlib import Path

from kvmigrate.formats import mooncake as M

from helpers.mooncake_reader import fpk, read, start, std_hash


def varint(n: int) -> bytes:
    out = b""
    while n > 0x7F:
        out += bytes([n & 0x7F | 0x80])
        n >>= 7
    return out + bytes([n])


def meta(records: list[tuple[bytes, bytes]]) -> tuple[bytes, bytes]:
    """(.bucket, .meta) by hand: records back to back; field 1 data_size, 2 keys, 3 entries."""
    bucket, keys, objs, off = b"", b"", b"", 0
    for k, v in records:
        bucket += k + v
        keys += b"\x12" + varint(len(k)) + k
        body = (b"\x08" + varint(off) if off else b"") + b"\x10" + varint(len(k)) + b"\x18" + varint(len(v))
        objs += b"\x1a" + varint(len(body)) + body
        off += len(k) + len(v)
    return bucket, b"\x08" + varint(len(bucket)) + keys + objs


def pair(root: Path, ident: int, records: list[tuple[bytes, bytes]]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    b, m = meta(records)
    (root / f"{ident}.bucket").write_bytes(b)
    (root / f"{ident}.meta").write_bytes(m)


K0, K1 = b"default\0m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@aa", b"default\0m@tp_rank:1@pcp0@dcp0@pp_rank:0@group:0@aa"


def test_a_live_pair_is_adopted_and_each_value_read_at_offset_plus_key_size(tmp_path):
    pair(tmp_path, 4096, [(K0, b"v0" * 10), (K1, b"v1" * 7)])
    res = start(tmp_path)
    assert res.deleted == [] and read(tmp_path, res, K0) == b"v0" * 10 and read(tmp_path, res, K1) == b"v1" * 7


def test_a_meta_that_does_not_parse_goes_with_its_bucket(tmp_path):
    pair(tmp_path, 7, [(K0, b"x")])
    (tmp_path / "7.meta").write_bytes(b"\x12\x40short")
    assert set(start(tmp_path).deleted) == {tmp_path / "7.meta", tmp_path / "7.bucket"}


def test_a_meta_without_bucket_and_an_orphan_bucket_anywhere_are_deleted(tmp_path):
    pair(tmp_path, 8, [(K0, b"x")])
    (tmp_path / "8.bucket").unlink()
    (tmp_path / "rank_0_0_0_0").mkdir()
    (tmp_path / "rank_0_0_0_0" / "9.bucket").write_bytes(b"junk")
    assert set(start(tmp_path).deleted) == {tmp_path / "8.meta", tmp_path / "rank_0_0_0_0" / "9.bucket"}


def test_a_non_digit_stem_is_never_read(tmp_path):
    pair(tmp_path, 10, [(K0, b"x")])
    (tmp_path / "10.meta").rename(tmp_path / "10-0.meta")
    res = start(tmp_path)
    assert tmp_path / "10.bucket" in res.deleted and read(tmp_path, res, K0) == "not found"


def test_a_cut_record_is_registered_but_unreadable(tmp_path):
    pair(tmp_path, 11, [(K0, b"a" * 50), (K1, b"b" * 50)])
    data = (tmp_path / "11.bucket").read_bytes()
    (tmp_path / "11.bucket").write_bytes(data[:-10])
    res = start(tmp_path)
    assert read(tmp_path, res, K0) == b"a" * 50 and read(tmp_path, res, K1).startswith("FILE_READ_FAIL")


def test_one_key_in_two_live_entries_fails_to_read(tmp_path):
    pair(tmp_path, 12, [(K0, b"a")])
    pair(tmp_path, 13, [(K0, b"bb")])
    assert read(tmp_path, start(tmp_path), K0).startswith("INVALID_PARAMS")


def test_a_raw_key_is_registered_under_0_3_12_but_never_read(tmp_path):
    raw = K0.split(b"\0", 1)[1]
    pair(tmp_path, 14, [(raw, b"a")])
    res = start(tmp_path)
    assert read(tmp_path, res, K0).startswith("INVALID_KEY")
    assert read(tmp_path, res, raw, scoped=False) == b"a"  # (a 0.3.11 client reads it)


def test_file_per_key_reads_only_at_its_hash_path_and_a_bad_file_stops_the_client(tmp_path):
    entry = b"\x0a" + varint(len(K0)) + K0 + b"\x12\x03val"
    good = tmp_path / fpk(K0)
    good.parent.mkdir(parents=True)
    good.write_bytes(entry)
    assert read(tmp_path, start(tmp_path), K0) == b"val"
    elsewhere = tmp_path / "file_per_key_dir" / "p" / "p" / "copy"
    elsewhere.parent.mkdir(parents=True, exist_ok=True)
    elsewhere.write_bytes(entry)
    good.unlink()
    res = start(tmp_path)
    assert K0 in res.kv_files and read(tmp_path, res, K0) == "not found"  # registered, never read there
    elsewhere.write_bytes(b"\x0a\x7f")
    assert start(tmp_path).refused is not None


def test_the_reader_and_kvmigrate_agree_on_codec_and_paths(tmp_path):
    """kvmigrate's `.meta`, `.bucket`, KVEntry and fpk, read back by the independent reader."""
    data, m = M.build_bucket([(K0, b"v" * 33), (K1, b"")])
    (tmp_path / "21.bucket").write_bytes(data)
    (tmp_path / "21.meta").write_bytes(M.encode_meta(m))
    path = tmp_path / M.fpk(b"default\0other")
    path.parent.mkdir(parents=True)
    path.write_bytes(M.encode_kv_entry(M.KVEntry(b"default\0other", b"kv")))
    res = start(tmp_path)
    assert read(tmp_path, res, K0) == b"v" * 33 and read(tmp_path, res, K1) == b""
    assert read(tmp_path, res, b"default\0other") == b"kv"
    assert std_hash(b"default\0A@b:1") == M.hash_bytes(b"default\0A@b:1") == 0xFE2F1B6135F10759
