"""The Mooncake Store formats (kvmigrate/formats/mooncake.py, spec mooncake.md §1.2, §1.3, §2),
one test per rule, against evidence from outside kvmigrate: the research notes' bytes of a
`.meta` Mooncake wrote (mooncake-format.md §2), and `std::hash<std::string>` values printed by
a C++ program built with g++ 12.2 (Debian 12) against libstdc++ on this machine:

    for (auto k : keys) printf("%016zx\\n", std::hash<std::string>{}(std::string(k, len)));
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmigrate.families.mooncake import parse_engine_key
from kvmigrate.formats import mooncake as M

# (key bytes, libstdc++ std::hash<std::string>) -- every tail length 0..7 and a whole word
LIBSTDCXX_HASHES = [
    (b"", 0x553E93901E462A6E),
    (b"a", 0x454DDEE488C1ED6B),
    (b"abcdefg", 0xDEEE6830A3AF82AF),
    (b"abcdefgh", 0x783DB3E38DB898BB),
    (b"abcdefghi", 0xB4EC9257851C8AAF),
    (b"default", 0x94CEE80424A1717E),
    (b"A@b:1", 0xE1449C8258FB44E5),
    (b"default\0A@b:1", 0xFE2F1B6135F10759),
    (b"default\0Llama-3.1-8B@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@00ff10ab", 0x11FC6FA2F270948D),
]


@pytest.mark.parametrize("key, want", LIBSTDCXX_HASHES)
def test_hash_bytes_is_libstdcxx_std_hash(key, want):
    assert M.hash_bytes(key) == want


def test_fpk_folders_come_from_the_hash_and_the_name_is_sanitized():
    """§1.3: `<fsdir>/<chr(97+(h&15))>/<chr(97+((h>>4)&15))>/<SanitizeKey(k)>`; the research's
    example `default\\0A@b:1` -> `…/default_A@b_1`."""
    h = 0xFE2F1B6135F10759
    want = f"file_per_key_dir/{chr(97 + (h & 15))}/{chr(97 + ((h >> 4) & 15))}/default_A@b_1"
    assert M.fpk(b"default\0A@b:1") == want
    assert M.fpk(b"default\0A@b:1", "other").startswith("other/")


def test_sanitize_key_maps_every_unsafe_character_and_nul():
    assert M.sanitize_key('a/b\\c:d*e?f"g<h>i|j\0k') == "a_b_c_d_e_f_g_h_i_j_k"


def test_meta_encoding_is_the_bytes_mooncake_wrote():
    """mooncake-format.md §2: `08 d8 02 | 12 0d "default\\0key-0" | 1a 04 10 0d 18 64` is
    data_size 344, one key, its entry offset 0 (omitted), key_size 13, data_size 100."""
    key = b"default\0key-0"
    meta = M.BucketMeta(344, (key,), (M.BucketObject(0, 13, 100),))
    want = bytes.fromhex("08d802") + bytes([0x12, 0x0D]) + key + bytes.fromhex("1a04100d1864")
    assert M.encode_meta(meta) == want
    assert M.decode_meta(want) == meta


def test_a_meta_that_does_not_parse_raises():
    for bad in (b"\x08", b"\x12\x05ab", b"\x0d\x00\x00\x00\x00", b"\x00"):
        with pytest.raises(M.DecodeError):
            M.decode_meta(bad)


def test_kv_entry_round_trips_and_rejects_other_fields():
    e = M.KVEntry(b"default\0k", b"\x00\x01value")
    assert M.decode_kv_entry(M.encode_kv_entry(e)) == e
    with pytest.raises(M.DecodeError):
        M.decode_kv_entry(b"\x18\x01")  # a varint field 3: not a KVEntry


@given(st.lists(st.tuples(st.binary(min_size=1, max_size=40), st.binary(max_size=200)), max_size=20))
def test_a_built_bucket_reads_back_every_value(entries):
    data, meta = M.build_bucket(entries)
    meta = M.decode_meta(M.encode_meta(meta))
    assert meta.data_size == len(data) and list(meta.keys) == [k for k, _ in entries]
    for (key, value), o in zip(entries, meta.objects):
        assert data[o.offset:o.value_start] == key
        assert data[o.value_start:o.end] == value


def test_bucket_ids_are_read_as_std_stoll_reads_them():
    """§1.2: the numeric prefix (the doc's `1710000000000-0.bucket` reads as 1710000000000);
    only an all-digit stem makes a pair name."""
    assert M.stoll_id("7000123.bucket") == 7000123
    assert M.stoll_id("1710000000000-0.bucket") == 1710000000000
    assert M.stoll_id("notes.meta") is None
    assert M.is_pair_name("42.meta") and not M.is_pair_name("42-0.meta") and not M.is_pair_name("42.tmp")
    assert M.next_bucket_id([5, 9], 1) == 10 and M.next_bucket_id([], 3) == 3 << 12


def test_storage_keys_scoped_and_raw():
    """§2.1: a NUL makes a scoped key (tenant before the first NUL); else raw (≤ 0.3.11)."""
    k = M.parse_storage_key(b"default\0m@tp_rank:0")
    assert (k.tenant, k.engine, k.scheme) == ("default", "m@tp_rank:0", "mc-scoped")
    raw = M.parse_storage_key(b"m@tp_rank:0")
    assert (raw.tenant, raw.scheme) == (None, "mc-raw")
    assert M.scoped("m@tp_rank:0") == b"default\0m@tp_rank:0" == k.encode()


@pytest.mark.parametrize("key, prefix, model, namespace", [
    ("Llama-3.1-8B@tp_rank:1@pcp0@dcp0@pp_rank:0@group:0@00ff", None, "Llama-3.1-8B", ""),
    ("auto-1a2b@Llama-3.1-8B@tp_rank:0@pcp0@dcp0@pp_rank:0@group:2@ab", "auto-1a2b", "Llama-3.1-8B", ""),
    ("p@q@Qwen3@store_pp:1@store_format:rank_local_tp2_layout_nhd@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@ff",
     "p@q", "Qwen3", "@store_pp:1@store_format:rank_local_tp2_layout_nhd"),
])
def test_vllm_keys_parse_from_the_right_and_format_back(key, prefix, model, namespace):
    """§2.2: parsed from the right; the namespace at the first `@store_`; prefix and model
    at the last `@`."""
    k = M.parse_vllm_key(key)
    assert k is not None and (k.prefix, k.model, k.namespace) == (prefix, model, namespace)
    assert M.format_vllm_key(k) == key


_TAIL = re.compile(r"@tp_rank:(\d+)@pcp(\d+)@dcp(\d+)@pp_rank:(\d+)@group:(\d+)@([0-9a-f]+)\Z")


def _by_the_grammar(key: str) -> tuple | None:
    """§2.2's grammar as a regular expression: the tail matched from the right, then the
    namespace at the first `@store_`, prefix and model at the last `@`."""
    m = _TAIL.search(key)
    if m is None:
        return None
    head = key[: m.start()]
    cut = head.find("@store_")
    rest, namespace = (head, "") if cut < 0 else (head[:cut], head[cut:])
    prefix, at, model = rest.rpartition("@")
    if not model:
        return None
    return (prefix if at else None, model, namespace, *map(int, m.groups()[:5]), m.group(6))


_PIECES = st.sampled_from(["@", "tp_rank:", "pcp", "dcp", "pp_rank:", "group:", "@store_", "0", "17", "\u0663",
                           "ab", "ff", "G", "x", "Llama", "-", ":", " ", "\u00e9"])


@given(st.lists(_PIECES, max_size=14).map("".join),
       st.tuples(*[st.sampled_from(["0", "3", "12", "\u0663", "", "x", "1@"])] * 5),
       st.sampled_from(["00ff", "ab", "", "AB", "g1", "0@1", "f"]))
def test_vllm_keys_parse_as_the_grammar_says(head, numbers, hash_hex):
    """The parser (from the right, without a regular expression) takes exactly the keys
    §2.2's grammar takes, to the same fields, near misses and Unicode digits included."""
    t, p, d, pp, g = numbers
    for key in (head, f"{head}@tp_rank:{t}@pcp{p}@dcp{d}@pp_rank:{pp}@group:{g}@{hash_hex}",
                f"{head}@tp_rank:{t}@pcp{p}@dcp{d}@pp_rank:{pp}@group:{g}@{hash_hex}{head}"):
        k = M.parse_vllm_key(key)
        got = None if k is None else (k.prefix, k.model, k.namespace, k.tp_rank, k.pcp, k.dcp, k.pp_rank, k.group,
                                      k.hash)
        assert got == _by_the_grammar(key), key


def test_a_key_of_no_known_grammar_is_none():
    assert M.parse_vllm_key("something-else") is None
    assert M.parse_sglang_key("something_else_k") is None


@pytest.mark.parametrize("ranks, half", [((3,), "k"), ((3,), "v"), ((3, 1), "v"), ((), "k"), ((1,), "k")])
def test_sglang_keys_parse_and_format_back(ranks, half):
    """§2.3: `<prefix>_<page hash>_<suffix>_<k|v>`, MHA `<r>` or `<r>_<pp>`, MLA `__k` (pp 1)."""
    page = "ab" * 32
    key = f"tag_org-model_{page}_{'_'.join(map(str, ranks))}_{half}"
    k = M.parse_sglang_key(key)
    assert k is not None and (k.prefix, k.page_hash, k.ranks, k.half) == ("tag_org-model", page, ranks, half)
    assert M.format_sglang_key(k) == key


def test_an_mla_page_writes_no_v_half():
    assert M.parse_sglang_key(f"m_{'ab' * 32}__v") is None


_SANITIZED = "_/\\:*?\"<>|\0"  # the characters SanitizeKey turns into `_`, and `_`


@given(st.lists(st.sampled_from(["_", ":", "/", "@", "a", "0", "ff", "-", "store_", "\0", "x_1"]), max_size=10)
       .map("".join),
       st.sampled_from(["vllm", "sglang"]), st.sampled_from(["00ff", "ab" * 32, "0" * 64]),
       st.tuples(st.sampled_from(["0", "1", "12"]), st.sampled_from(["", "_1", "_0"])), st.data())
def test_two_parsing_keys_of_one_fpk_name_share_their_block_hash(head, engine, hash_hex, ranks, data):
    """What the scan's partitions rest on (scan/store_spill.py, families/mooncake.py
    `path_holder`): fpk names a file by the sanitized key, and two keys that both parse
    and sanitize alike have one block hash, so a KVEntry at fpk of its own key is in the
    partition of any target that names its path."""
    if engine == "vllm":
        key = f"{head}@tp_rank:{ranks[0]}@pcp0@dcp0@pp_rank:0@group:0@{hash_hex}"
    else:
        key = f"{head or 'm'}_{hash_hex}_{ranks[0]}{ranks[1]}_k"
    twin = "".join(data.draw(st.sampled_from(_SANITIZED)) if c in _SANITIZED else c for c in key)
    assert M.sanitize_key(twin) == M.sanitize_key(key)
    a, b = parse_engine_key(key), parse_engine_key(twin)
    if a is not None and b is not None:
        assert a.hash == b.hash, (key, twin)
