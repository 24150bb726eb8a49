"""Path grammar (formats.md §1): folder names parsed from the right, fan-out folders,
misfiled blocks and every known temp-file pattern."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmigrate import layout

HEX = "0123456789abcdef"
d12s = st.text(alphabet=HEX, min_size=12, max_size=12)
# model names as engines see them: org/name, local paths, underscores, quotes, non-ASCII
# (never a NUL: no folder name holds one)
names = st.text(min_size=1, max_size=40).filter(lambda s: "\x00" not in s)
model_names = st.one_of(
    names,
    st.builds(lambda a, b: f"{a}/{b}", names, names),
    st.sampled_from(["meta-llama/Llama-3.1-8B-Instruct", "/models/x", "a_b_c", "org/M\u00e9del", "x_0123456789ab",
                     "x_0123456789ab_r3", "\u6a21\u578b/\u540d\u524d", "q'uote \"d\" sp ace"]),
)
hashes = st.integers(min_value=3, max_value=40).flatmap(
    lambda n: st.text(alphabet=HEX, min_size=2 * n, max_size=2 * n))
groups = st.integers(min_value=0, max_value=2**32 - 1)
ranks = st.integers(min_value=0, max_value=10_000)


@given(model_names, d12s)
def test_base_folder_round_trip(model, d12):
    name = layout.base_name(model, d12)
    parsed = layout.parse_folder(name)
    assert parsed == layout.FolderName(model.replace("/", "_"), d12, None)
    assert parsed.base == name


@given(model_names, d12s, ranks)
def test_rank_folder_round_trip(model, d12, rank):
    base = layout.base_name(model, d12)
    parsed = layout.parse_folder(layout.rank_dir_name(base, rank))
    assert parsed == layout.FolderName(model.replace("/", "_"), d12, rank)
    assert parsed.base == base


@given(model_names, d12s, ranks, hashes, groups)
def test_block_path_round_trip(model, d12, rank, hex_hash, group):
    rel = layout.block_relpath(layout.base_name(model, d12), rank, hex_hash, group)
    # a model name may contain "/", which becomes "_": the path has exactly four parts
    rank_dir, bucket, fanout, filename = rel.split("/")
    assert layout.parse_folder(rank_dir).rank == rank
    block = layout.parse_block(bucket, fanout, filename)
    assert block == layout.BlockName(hex_hash, group, False)


@given(hashes, groups, st.text(alphabet=HEX, min_size=3, max_size=3), st.text(alphabet=HEX, min_size=2, max_size=2))
def test_misfiled_detection(hex_hash, group, bucket, hh):
    block = layout.parse_block(bucket, f"{hh}_g{group}", f"{hex_hash}.bin")
    assert block is not None
    assert block.misfiled == (bucket != hex_hash[:3] or hh != hex_hash[3:5])


def test_safe_model_replaces_only_slashes():
    assert layout.safe_model_name("/models/x") == "_models_x"
    assert layout.safe_model_name("org/M\u00e9 del\"'") == "org_M\u00e9 del\"'"


def test_base_and_rank_folders_never_collide():
    assert layout.parse_folder("m_0123456789ab").rank is None
    assert layout.parse_folder("m_0123456789ab_r0").rank == 0
    # a model whose name itself ends like a namespace is still parsed from the right
    assert layout.parse_folder("x_0123456789ab_r3_ba9876543210") == layout.FolderName(
        "x_0123456789ab_r3", "ba9876543210", None)


@pytest.mark.parametrize("name", ["m_0123456789a", "m_0123456789AB", "_0123456789abc", "0123456789ab", "m-0123456789ab",
                                  "m_0123456789ab_r", "m_0123456789ab_rx", "m_0123456789ab_r-1", ".kvmigrate",
                                  "lost+found"])
def test_non_namespace_folders_are_rejected(name):
    assert layout.parse_folder(name) is None


@pytest.mark.parametrize("bucket,fanout,filename", [
    ("abc", "de_g0", "abcde.bin"),  # odd hex length
    ("abc", "de_g0", "abcd.bin"),  # too short
    ("abc", "de_g0", "ABCDEF.bin"),  # uppercase
    ("abc", "de_g0", "abcdef.bin.tmp"),
    ("abcd", "de_g0", "abcdef.bin"),
    ("abc", "de_gx", "abcdef.bin"),
    ("abc", "de", "abcdef.bin"),
])
def test_malformed_block_names(bucket, fanout, filename):
    assert layout.parse_block(bucket, fanout, filename) is None


TEMP_CASES = [
    ("abcdef0123.bin_81234.tmp", "vllm-block"),
    ("030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122.bin_9223372036854775807.tmp", "vllm-block"),
    ("6d3e5b6755d8bfccc976a0e595f00e60a98c194f1f4fb0bee85ec0d8a6084035.bin.4242.7.tmp", "vllmcpp-block"),
    ("config.json.4242.0.tmp", "vllmcpp-config"),
    (".o_direct_probe_123456.tmp", "vllm-probe"),
    ("abcdef.bin.kvmigrate-777.tmp", "own"),
    ("config.json.kvmigrate-1.tmp", "own"),
    ("abcdef.bin", None),
    ("config.json", None),
    ("abcdef.bin_.tmp", None),
    ("abcdef.bin.12.tmp", None),
    ("config.json.tmp", None),
    (".o_direct_probe_.tmp", None),
    ("notes.txt", None),
]


@pytest.mark.parametrize("filename,kind", TEMP_CASES)
def test_every_temp_file_pattern(filename, kind):
    assert layout.temp_kind(filename) == kind


@given(hashes, st.integers(min_value=0, max_value=2**63 - 1), st.integers(min_value=0, max_value=2**22),
       st.integers(min_value=0, max_value=2**20))
def test_temp_patterns_property(hex_hash, rnd, pid, n):
    assert layout.temp_kind(f"{hex_hash}.bin_{rnd}.tmp") == "vllm-block"
    assert layout.temp_kind(f"{hex_hash}.bin.{pid}.{n}.tmp") == "vllmcpp-block"
    assert layout.temp_kind(f"config.json.{pid}.{n}.tmp") == "vllmcpp-config"
    assert layout.temp_kind(f".o_direct_probe_{rnd}.tmp") == "vllm-probe"
    assert layout.temp_kind(f"{hex_hash}.bin.kvmigrate-{pid}.tmp") == "own"
    assert layout.temp_kind(f"{hex_hash}.bin") is None


@st.composite
def near_block_relpaths(draw) -> str:
    """A block path relative to the root, each part valid or a near miss of it."""
    h = draw(hashes)
    parts = [draw(st.sampled_from([f"m_{'0' * 12}_r0", f"m\u00e9 _{'a' * 12}_r12", f"m_{'0' * 12}_r\u0663",
                                   f"m_{'0' * 12}_r0\n", f"m_{'0' * 12}", f"m_{'0' * 11}_r0", f"_{'0' * 12}_r0"])),
             draw(st.sampled_from([h[:3], "ABC", h[:2], h[:3] + "\n", "fff"])),
             draw(st.sampled_from([f"{h[3:5]}_g0", f"{h[3:5]}_g", f"{h[3:5]}_g0\n", f"{h[3:5]}_g\u0663", "zz_g1"])),
             draw(st.sampled_from([f"{h}.bin", f"{h}.bin\n", f"{h[:-1]}.bin", f"{h.upper()}.bin", f"{h}.bin.tmp"]))]
    return "/".join(parts[:draw(st.integers(2, 4))] if draw(st.booleans()) else parts)


@settings(max_examples=300, deadline=None)
@given(st.lists(near_block_relpaths(), min_size=1, max_size=20))
def test_plan_block_path_match_is_the_layout_grammar(relpaths):
    """The plan's vectorised (RE2) block-path match accepts exactly the paths
    parse_block_relpath parses."""
    import pyarrow as pa

    from kvmigrate.migrate.plan import _source_paths_ok

    assert _source_paths_ok(pa.array(relpaths)).to_pylist() == [layout.parse_block_relpath(r) is not None
                                                                for r in relpaths]
