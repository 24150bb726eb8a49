"""Synthetic trees have the documented on-disk shape of each writer family and era."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvmigrate import layout
from kvmigrate.cli import cli
from kvmigrate.formats import vllmcpp
from kvmigrate.identity.canonical import canonical_bytes, config_json_bytes, d12, fields_from_config_bytes
from kvmigrate.identity.schemes import scheme_of
from kvmigrate.synth import (
    SynthSpec,
    block_hash_hex,
    build,
    build_demo_root,
    full_page,
    page_bytes_for,
)

SMALL = dict(layers=2, page_bytes=64, blocks=3)


def tree_files(root: Path) -> dict[str, bytes]:
    """relpath -> bytes of every regular file (symlinks and FIFOs as markers)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = b"symlink->" + os.readlink(path).encode()
            elif path.is_fifo():
                out[rel] = b"fifo"
            elif path.is_file():
                out[rel] = path.read_bytes()
    return out


def config_proves_digest(root: Path, ns: dict, family: str) -> None:
    data = (root / ns["config_relpath"]).read_bytes()
    fields = fields_from_config_bytes(data)
    assert fields == ns["fields"]
    parsed = layout.parse_folder(ns["base_name"])
    assert parsed is not None and parsed.rank is None
    assert d12(fields, family) == parsed.d12 == ns["d12"]
    assert data == config_json_bytes(fields, family)
    for rank_dir in ns["rank_dirs"]:
        folder = layout.parse_folder(rank_dir)
        assert folder is not None and folder.base == ns["base_name"]


def block_paths_parse(result) -> None:
    for block in result.blocks:
        for rank, rel in block["files"].items():
            rank_dir, bucket, fanout, name = rel.split("/")
            parsed = layout.parse_block(bucket, fanout, name)
            assert parsed is not None and not parsed.misfiled
            assert parsed.hex_hash == block["hex"] and parsed.group == block["group"]
            assert layout.parse_folder(rank_dir).rank == rank


# --- vLLM: rows under _r0 only -------------------------------------------------------

@pytest.mark.parametrize("scheme", ["S1", "S2", "S3"])
def test_vllm_full_attention_rows_per_era(tmp_path, scheme):
    spec = SynthSpec(family="vllm", scheme=scheme, tp=2, **SMALL)
    result = build(tmp_path, spec)
    (ns,) = result.namespaces
    config_proves_digest(tmp_path, ns, "vllm")
    assert ns["scheme"] == scheme_of(ns["fields"]) == scheme
    assert ns["rank_dirs"] == [ns["base_name"] + "_r0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ns["base_name"], ns["base_name"] + "_r0"])
    block_paths_parse(result)
    cell = 2 * 2 * 64  # T (2 layers x K,V) x B x P
    for block in result.blocks:
        data = (tmp_path / block["files"][0]).read_bytes()
        assert len(data) == 4096 and len(data) % 4096 == 0
        # [W0 cell][W1 cell] + zero pad: each cell holds that rank's head shard, tensor-major.
        for w in range(2):
            for t in range(4):
                page = page_bytes_for(spec, hex_hash=block["hex"], group=0, rank=w, tensor=t, gpu_block=0)
                assert data[w * cell + t * 64:w * cell + (t + 1) * 64] == page
        assert data[2 * cell:] == bytes(4096 - 2 * cell)
    expected_dtype = "bfloat16" if scheme == "S3" else "auto"
    assert ns["fields"]["dtype"] == expected_dtype
    assert ("parallel_agnostic" in ns["fields"]) == (scheme == "S3")


def test_vllm_s1_is_ambiguous_and_s2_s3_are_vllm(tmp_path):
    s1 = build(tmp_path, SynthSpec(family="vllm", scheme="S1", **SMALL)).namespaces[0]
    s2 = build(tmp_path, SynthSpec(family="vllm", scheme="S2", **SMALL)).namespaces[0]
    assert s1["expected_family"] == "ambiguous"
    assert s2["expected_family"] == "vllm"
    assert "hash_block_size" in s1["fields"] and "tokens_per_hash" in s2["fields"]


def test_vllm_mla_direct_rows_hold_n_identical_cells(tmp_path):
    spec = SynthSpec(family="vllm", scheme="S2", tp=4, kv_kind="mla", **SMALL)
    result = build(tmp_path, spec)
    (ns,) = result.namespaces
    assert ns["cells"] == 4 and ns["fields"]["tp_size"] == 4
    cell = 2 * 64  # T = 2 MLA layers, one tensor each
    for block in result.blocks:
        data = (tmp_path / block["files"][0]).read_bytes()
        assert len(data) % 4096 == 0
        cells = [data[i * cell:(i + 1) * cell] for i in range(4)]
        assert len(set(cells)) == 1
        assert cells[0][:64] == full_page(spec, hex_hash=block["hex"], group=0, tensor=0, gpu_block=0)
        assert not any(data[4 * cell:])


def test_vllm_replicated_layout_rows_hold_one_cell(tmp_path):
    spec = SynthSpec(family="vllm", scheme="S3", tp=2, kv_kind="mla", replicated_layout=True, **SMALL)
    result = build(tmp_path, spec)
    (ns,) = result.namespaces
    fields = ns["fields"]
    assert fields["replicated_layout"] is True and fields["tp_size"] == 1 and "parallel_agnostic" not in fields
    assert ns["cells"] == 1
    for block in result.blocks:
        data = (tmp_path / block["files"][0]).read_bytes()
        assert len(data) == 4096
        assert data[:128] == b"".join(page_bytes_for(spec, hex_hash=block["hex"], group=0, rank=0, tensor=t,
                                                     gpu_block=0) for t in range(2))
        assert not any(data[128:])


def test_vllm_agnostic_folds_tp_but_keeps_world_size_cells(tmp_path):
    spec = SynthSpec(family="vllm", scheme="S3", tp=2, agnostic=True, **SMALL)
    (ns,) = build(tmp_path, spec).namespaces
    assert ns["fields"]["tp_size"] == 1 and "parallel_agnostic" not in ns["fields"]
    assert ns["scheme"] == "S2"  # an agnostic S3 identity is the S2 identity
    assert ns["cells"] == 2


def test_vllm_canonical_rows_hold_full_pages_once(tmp_path):
    spec = SynthSpec(family="vllm", scheme="S3", tp=2, canonical_format="v1-nhd", agnostic=True, **SMALL)
    result = build(tmp_path, spec)
    (ns,) = result.namespaces
    assert ns["fields"]["canonical_format"] == "v1-nhd" and ns["cells"] == 1
    block = result.blocks[0]
    data = (tmp_path / block["files"][0]).read_bytes()
    for t in range(4):
        assert data[t * 128:(t + 1) * 128] == full_page(spec, hex_hash=block["hex"], group=0, tensor=t, gpu_block=0)
    assert not any(data[4 * 128:])


def test_vllm_blocks_per_file_rows_are_tensor_major(tmp_path):
    spec = SynthSpec(family="vllm", scheme="S1", blocks_per_file=3, **SMALL)
    result = build(tmp_path, spec)
    block = result.blocks[0]
    data = (tmp_path / block["files"][0]).read_bytes()
    offset = 0
    for t in range(4):
        for b in range(3):
            assert data[offset:offset + 64] == page_bytes_for(spec, hex_hash=block["hex"], group=0, rank=0,
                                                              tensor=t, gpu_block=b)
            offset += 64
    assert result.namespaces[0]["fields"]["gpu_blocks_per_file"] == 3


def test_vllm_rows_multiple_of_4096_for_large_cells(tmp_path):
    spec = SynthSpec(family="vllm", scheme="S2", tp=2, layers=3, page_bytes=500, blocks=2)
    result = build(tmp_path, spec)
    size = 2 * 6 * 500
    for block in result.blocks:
        data = (tmp_path / block["files"][0]).read_bytes()
        assert len(data) == 8192 == result.namespaces[0]["file_size"]
        assert len(data) >= size and not any(data[size:])


# --- llm-d: per-rank block-major shards ------------------------------------------------

def test_llmd_full_attention_shards_differ_per_rank(tmp_path):
    spec = SynthSpec(family="llmd", tp=2, **SMALL)
    result = build(tmp_path, spec)
    (ns,) = result.namespaces
    config_proves_digest(tmp_path, ns, "llmd")
    assert ns["expected_family"] == "llmd" and ns["fields"]["tp_size"] == 2
    assert ns["rank_dirs"] == [ns["base_name"] + "_r0", ns["base_name"] + "_r1"]
    block_paths_parse(result)
    for block in result.blocks:
        r0 = (tmp_path / block["files"][0]).read_bytes()
        r1 = (tmp_path / block["files"][1]).read_bytes()
        assert len(r0) == len(r1) == 4 * 64 == ns["file_size"]
        assert r0 != r1
        # the two shards of each page concatenate to the TP-independent full page
        for t in range(4):
            full = full_page(spec, hex_hash=block["hex"], group=0, tensor=t, gpu_block=0)
            assert r0[t * 64:(t + 1) * 64] + r1[t * 64:(t + 1) * 64] == full


def test_llmd_mla_replicas_are_identical(tmp_path):
    result = build(tmp_path, SynthSpec(family="llmd", tp=4, kv_kind="mla", **SMALL))
    for block in result.blocks:
        datas = {(tmp_path / rel).read_bytes() for rel in block["files"].values()}
        assert len(datas) == 1 and len(next(iter(datas))) == 2 * 64


def test_llmd_files_are_block_major(tmp_path):
    spec = SynthSpec(family="llmd", tp=1, blocks_per_file=2, **SMALL)
    result = build(tmp_path, spec)
    block = result.blocks[0]
    data = (tmp_path / block["files"][0]).read_bytes()
    assert len(data) == 2 * 4 * 64
    offset = 0
    for b in range(2):
        for t in range(4):
            assert data[offset:offset + 64] == page_bytes_for(spec, hex_hash=block["hex"], group=0, rank=0,
                                                              tensor=t, gpu_block=b)
            offset += 64


def test_llmd_tp1_with_4096_sizes_is_ambiguous(tmp_path):
    (ns,) = build(tmp_path, SynthSpec(family="llmd", tp=1, layers=4, page_bytes=512, blocks=2)).namespaces
    assert ns["file_size"] == 4096 and ns["expected_family"] == "ambiguous"
    (ns,) = build(tmp_path / "b", SynthSpec(family="llmd", tp=1, **SMALL)).namespaces
    assert ns["expected_family"] == "llmd"


def test_llmd_known_digest_of_the_worked_example(tmp_path):
    """identity.md §2: llm-d TP=2, gpu_blocks_per_file 16, 32 layers -> 3f1b68c1da90."""
    spec = SynthSpec(family="llmd", tp=2, layers=32, blocks_per_file=16, page_bytes=8, blocks=1)
    (ns,) = build(tmp_path, spec).namespaces
    assert ns["base_name"] == "meta-llama_Llama-3.1-8B-Instruct_3f1b68c1da90"


def test_llmd_pipeline_stages_get_one_base_folder_each(tmp_path):
    spec = SynthSpec(family="llmd", tp=2, pp=2, layers=4, page_bytes=64, blocks=2)
    result = build(tmp_path, spec)
    assert len(result.namespaces) == 2
    stage0, stage1 = result.namespaces
    assert stage0["ranks"] == [0, 1] and stage1["ranks"] == [2, 3]
    assert stage0["d12"] != stage1["d12"]
    names0 = stage0["fields"]["kv_cache_groups"][0]["layer_names"]
    names1 = stage1["fields"]["kv_cache_groups"][0]["layer_names"]
    assert len(names0) == len(names1) == 2 and not set(names0) & set(names1)
    assert stage0["tensors"] == [0, 1, 2, 3] and stage1["tensors"] == [4, 5, 6, 7]
    for ns in result.namespaces:
        config_proves_digest(tmp_path, ns, "llmd")
    # pp > 1 is out of scope whether or not the pp_stage defect was asked for
    assert [d["relpath"] for d in result.defects if d["name"] == "pp_stage"] == [stage0["base_name"],
                                                                                 stage1["base_name"]]


# --- vllm.cpp: header files, one base folder per rank ---------------------------------

def test_vllmcpp_headers_verify_and_payloads_shard(tmp_path):
    spec = SynthSpec(family="vllmcpp", tp=2, **SMALL)
    result = build(tmp_path, spec)
    assert len(result.namespaces) == 2
    for rank, ns in enumerate(result.namespaces):
        config = (tmp_path / ns["config_relpath"]).read_bytes()
        assert hashlib.sha256(config).hexdigest() == ns["digest"]
        assert config == canonical_bytes(ns["fields"], "vllmcpp")
        assert vllmcpp.validate_identity(ns["fields"]) == []
        assert ns["fields"]["rank"] == rank and ns["ranks"] == [rank]
        assert ns["rank_dirs"] == [f"{ns['base_name']}_r{rank}"]
        assert ns["deployment"] == result.namespaces[0]["digest"]
    assert len({json.dumps(ns["fields"]) for ns in result.namespaces}) == 2
    block_paths_parse(result)
    for block in result.blocks:
        payloads = []
        for rank, rel in block["files"].items():
            ns = result.namespaces[rank]
            data = (tmp_path / rel).read_bytes()
            assert len(data) == 128 + ns["fields"]["page_size_bytes"] == 128 + 4 * 64
            key = vllmcpp.make_key(bytes.fromhex(block["hex"]), block["group"])
            assert vllmcpp.verify_header(data, digest=bytes.fromhex(ns["digest"]),
                                         payload_size=ns["fields"]["page_size_bytes"], key=key) is None
            payloads.append(data[128:])
        assert payloads[0] != payloads[1]


def test_vllmcpp_mla_payloads_equal_across_ranks(tmp_path):
    result = build(tmp_path, SynthSpec(family="vllmcpp", tp=2, kv_kind="mla", **SMALL))
    ident = result.namespaces[0]["fields"]
    assert (ident["kv_cache_spec_kind"], ident["num_kv_heads"], ident["head_size"], ident["head_size_v"]) == \
        ("mla", 1, 576, 0)
    for block in result.blocks:
        datas = [(tmp_path / rel).read_bytes() for rel in block["files"].values()]
        assert datas[0][128:] == datas[1][128:]
        assert datas[0][:128] != datas[1][:128]  # the digest includes the rank


def test_vllmcpp_key_carries_group_big_endian(tmp_path):
    result = build(tmp_path, SynthSpec(family="vllmcpp", groups=2, **SMALL))
    block = [b for b in result.blocks if b["group"] == 1][0]
    header = vllmcpp.decode_header((tmp_path / block["files"][0]).read_bytes())
    assert header.key_size == 36 and header.key == bytes.fromhex(block["hex"]) + b"\0\0\0\1"


# --- pages, keys, options ---------------------------------------------------------------

def test_mla_pages_do_not_depend_on_tp_scheme_or_family():
    kwargs = dict(hex_hash=block_hash_hex(0, 0), group=0, tensor=1, gpu_block=0)
    a = SynthSpec(family="llmd", tp=2, kv_kind="mla")
    b = SynthSpec(family="vllm", scheme="S3", tp=4, kv_kind="mla", replicated_layout=True)
    assert page_bytes_for(a, rank=1, **kwargs) == page_bytes_for(b, rank=3, **kwargs) == page_bytes_for(a, rank=0,
                                                                                                       **kwargs)


def test_full_attention_page_concatenation_is_tp_independent():
    kwargs = dict(hex_hash=block_hash_hex(0, 0), group=0, tensor=0, gpu_block=0)
    tp1 = SynthSpec(tp=1, page_bytes=512)
    tp4 = SynthSpec(tp=4, page_bytes=128)
    shards = b"".join(page_bytes_for(tp4, rank=r, **kwargs) for r in range(4))
    assert shards == page_bytes_for(tp1, rank=0, **kwargs)
    assert len({page_bytes_for(tp4, rank=r, **kwargs) for r in range(4)}) == 4


def test_every_page_is_distinct():
    spec = SynthSpec(page_bytes=32)
    pages = {page_bytes_for(spec, hex_hash=block_hash_hex(0, i), group=g, rank=0, tensor=t, gpu_block=b)
             for i in range(3) for g in range(2) for t in range(3) for b in range(2)}
    assert len(pages) == 3 * 2 * 3 * 2


def test_page_bytes_for_accepts_a_result_namespace(tmp_path):
    spec = SynthSpec(family="llmd", tp=2, **SMALL)
    result = build(tmp_path, spec)
    ns, block = result.namespaces[0], result.blocks[0]
    kwargs = dict(hex_hash=block["hex"], group=0, rank=1, tensor=2, gpu_block=0)
    assert page_bytes_for(ns, **kwargs) == page_bytes_for(spec, **kwargs)


def test_same_seed_same_keys_in_every_namespace(tmp_path):
    a = build(tmp_path, SynthSpec(family="vllm", seed=7, **SMALL))
    b = build(tmp_path, SynthSpec(family="vllmcpp", seed=7, **SMALL))
    c = build(tmp_path, SynthSpec(family="vllm", scheme="S2", seed=8, **SMALL))
    assert [x["hex"] for x in a.blocks] == [x["hex"] for x in b.blocks]
    assert not {x["hex"] for x in a.blocks} & {x["hex"] for x in c.blocks}


def test_hash_len_32_names(tmp_path):
    result = build(tmp_path, SynthSpec(hash_len=32, **SMALL))
    assert all(len(b["hex"]) == 32 for b in result.blocks)
    block_paths_parse(result)


def test_groups_have_their_own_files_and_layers(tmp_path):
    result = build(tmp_path, SynthSpec(family="vllm", scheme="S3", groups=2, **SMALL))
    assert len(result.blocks) == 2 * 3
    groups = result.namespaces[0]["fields"]["kv_cache_groups"]
    assert [g["layer_names"] for g in groups] == [
        ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
        ["model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn"]]
    g0 = [(tmp_path / b["files"][0]).read_bytes() for b in result.blocks if b["group"] == 0]
    g1 = [(tmp_path / b["files"][0]).read_bytes() for b in result.blocks if b["group"] == 1]
    assert not set(g0) & set(g1)


def test_extra_fields_land_in_the_identity(tmp_path):
    (ns,) = build(tmp_path, SynthSpec(extra_fields={"future_key": "x"}, **SMALL)).namespaces
    assert ns["fields"]["future_key"] == "x"
    config_proves_digest(tmp_path, ns, "vllm")


def test_explicit_dtype_is_kept_in_s3(tmp_path):
    (ns,) = build(tmp_path, SynthSpec(scheme="S3", dtype="fp8", **SMALL)).namespaces
    assert ns["fields"]["dtype"] == "fp8"


@pytest.mark.parametrize("bad", [
    dict(family="llmd", replicated_layout=True),
    dict(family="vllm", scheme="S2", kv_kind="mla", tp=2, replicated_layout=True),
    dict(family="vllm", scheme="S3", kv_kind="full", tp=2, replicated_layout=True),
    dict(family="vllmcpp", hash_len=32),
    dict(family="vllm", pp=2),
    dict(family="llmd", pp=3, layers=4),
    dict(family="vllm", defects=("padded_legacy",)),
    dict(family="vllm", defects=("nonsense",)),
    dict(family="vllm", blocks=0),
])
def test_impossible_specs_are_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="synth:"):
        build(tmp_path, SynthSpec(**bad))


# --- determinism, demo, CLI -------------------------------------------------------------

def test_same_spec_builds_identical_trees(tmp_path):
    spec = SynthSpec(family="llmd", tp=2, kv_kind="mla", **SMALL)
    build(tmp_path / "a", spec)
    build(tmp_path / "b", spec)
    a, b = tree_files(tmp_path / "a"), tree_files(tmp_path / "b")
    assert a and a == b


def test_demo_root_is_small_and_has_every_family(tmp_path):
    results = build_demo_root(tmp_path)
    families = {ns["family"] for r in results for ns in r.namespaces}
    schemes = {ns["scheme"] for r in results for ns in r.namespaces}
    assert families == {"vllm", "llmd", "vllmcpp", "sglang", "lmcache", "mooncake"}
    assert {ns["backend"] for r in results for ns in r.namespaces if ns["family"] == "mooncake"} == \
        {"bucket", "file_per_key"}
    assert {ns["backend"] for r in results for ns in r.namespaces if ns["family"] == "lmcache"} == \
        {"fs", "local_disk", "gds"}
    assert {"S1", "S2", "S3", "vllmcpp-v1"} <= schemes
    assert any(ns["replicated_layout"] for r in results for ns in r.namespaces)
    files = [f for f in tree_files(tmp_path) if (tmp_path / f).is_file()]
    assert 10 <= len(files) <= 80


def test_cli_synth_writes_tree_and_json(tmp_path):
    runner = CliRunner()
    out = runner.invoke(cli, ["synth", str(tmp_path), "--family", "llmd", "--tp", "2", "--kv-kind", "mla",
                              "--blocks", "2", "--block-bytes", "64", "--layers", "2", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["namespaces"][0]["family"] == "llmd"
    assert len(data["blocks"]) == 2
    for block in data["blocks"]:
        for rel in block["files"].values():
            assert (tmp_path / rel).stat().st_size == 2 * 64


def test_cli_synth_refuses_bad_combination_with_exit_2(tmp_path):
    out = CliRunner().invoke(cli, ["synth", str(tmp_path), "--family", "llmd", "--replicated"])
    assert out.exit_code == 2
    assert "vllm options" in out.output and "Traceback" not in out.output


# --- defects: each one does what its record says -----------------------------------------

MLA2 = dict(tp=2, kv_kind="mla", **SMALL)


def only(result, name):
    (rec,) = [d for d in result.defects if d["name"] == name]
    return rec


def healthy_sizes(tmp_path, result, rec):
    """Sizes of the block files of the victim's namespace that no defect touched."""
    return {(tmp_path / rel).stat().st_size for b in result.blocks if b["defect"] is None
            for rel in b["files"].values() if rel and rel.startswith(rec["base_name"])}


@pytest.mark.parametrize("family", ["llmd", "vllmcpp"])
def test_defect_missing_rank(tmp_path, family):
    result = build(tmp_path, SynthSpec(family=family, defects=("missing_rank",), **MLA2))
    rec = only(result, "missing_rank")
    assert rec["status"] == "incomplete" and rec["rank"] == 1
    assert not (tmp_path / rec["relpath"]).exists()
    assert rec["rows"] and all((tmp_path / rel).is_file() for rel in rec["rows"])
    victim = [b for b in result.blocks if b["defect"] == "missing_rank"]
    assert len(victim) == 1 and victim[0]["files"][1] is None and victim[0]["hex"] == rec["block"]
    for block in result.blocks:
        if block["defect"] is None:
            assert all((tmp_path / rel).is_file() for rel in block["files"].values())


@pytest.mark.parametrize("family", ["llmd", "vllmcpp"])
def test_defect_replica_differs(tmp_path, family):
    result = build(tmp_path, SynthSpec(family=family, defects=("replica_differs",), **MLA2))
    rec = only(result, "replica_differs")
    assert rec["status"] == "replica_mismatch" and len(rec["rows"]) == 2
    skip = 128 if family == "vllmcpp" else 0
    a, b = [(tmp_path / rel).read_bytes() for rel in rec["rows"]]
    assert len(a) == len(b) and a[skip:] != b[skip:]
    for block in result.blocks:
        if block["defect"] is None:
            payloads = {(tmp_path / rel).read_bytes()[skip:] for rel in block["files"].values()}
            assert len(payloads) == 1


def test_defect_replica_differs_needs_mla(tmp_path):
    with pytest.raises(ValueError, match="MLA replicas"):
        build(tmp_path, SynthSpec(family="llmd", tp=2, defects=("replica_differs",), **SMALL))


@pytest.mark.parametrize("family", ["vllm", "llmd", "vllmcpp"])
def test_defect_size_mismatch(tmp_path, family):
    result = build(tmp_path, SynthSpec(family=family, defects=("size_mismatch",), **SMALL))
    rec = only(result, "size_mismatch")
    size = (tmp_path / rec["relpath"]).stat().st_size
    assert rec["status"] == "size_mismatch" and size == rec["size"] != rec["expected_size"]
    assert healthy_sizes(tmp_path, result, rec) == {result.namespaces[0]["file_size"]}
    assert size > (128 if family == "vllmcpp" else 0)
    if family == "vllm":
        assert size % 4096
    if family == "vllmcpp":
        data = (tmp_path / rec["relpath"]).read_bytes()
        ns = result.namespaces[0]
        assert vllmcpp.verify_header(data, digest=bytes.fromhex(ns["digest"]),
                                     payload_size=ns["fields"]["page_size_bytes"],
                                     key=vllmcpp.make_key(bytes.fromhex(rec["block"]), 0)) is None


@pytest.mark.parametrize("family", ["vllm", "llmd", "vllmcpp"])
def test_defect_short(tmp_path, family):
    result = build(tmp_path, SynthSpec(family=family, defects=("short",), **SMALL))
    rec = only(result, "short")
    data = (tmp_path / rec["relpath"]).read_bytes()
    assert rec["status"] == "short"
    if family == "vllmcpp":
        assert 0 < len(data) < 128 and rec["reason"] == "header"
        assert vllmcpp.verify_header(data, digest=b"\0" * 32, payload_size=1, key=b"") == "short"
    else:
        assert data == b"" and rec["reason"] == "empty"


@pytest.mark.parametrize("family", ["vllm", "llmd", "vllmcpp"])
def test_defect_zero_filled(tmp_path, family):
    result = build(tmp_path, SynthSpec(family=family, defects=("zero_filled",), **SMALL))
    rec = only(result, "zero_filled")
    data = (tmp_path / rec["relpath"]).read_bytes()
    assert rec["status"] == "zero_filled"
    assert len(data) == result.namespaces[0]["file_size"] and not any(data)


@pytest.mark.parametrize("family", ["vllm", "llmd", "vllmcpp"])
def test_defect_misfiled(tmp_path, family):
    result = build(tmp_path, SynthSpec(family=family, defects=("misfiled",), **MLA2))
    rec = only(result, "misfiled")
    assert rec["status"] == "misfiled"
    assert len(rec["rows"]) == (1 if family == "vllm" else 2)  # every rank's file of the block moves
    for rel in rec["rows"]:
        _, bucket, fanout, name = rel.split("/")
        parsed = layout.parse_block(bucket, fanout, name)
        assert parsed.misfiled and parsed.hex_hash == rec["block"]
        proper = layout.block_relpath_in_rank(rec["block"], 0)
        assert not (tmp_path / rel.split("/")[0] / proper).exists()


def test_defect_unreadable(tmp_path):
    result = build(tmp_path, SynthSpec(family="llmd", defects=("unreadable",), **SMALL))
    rec = only(result, "unreadable")
    assert rec["status"] == "unreadable"
    assert (tmp_path / rec["relpath"]).stat().st_mode & 0o777 == 0
    assert rec["effective"] == (os.geteuid() != 0)


def test_defect_padded_legacy(tmp_path):
    spec = SynthSpec(family="llmd", defects=("padded_legacy",), **MLA2)
    result = build(tmp_path, spec)
    rec = only(result, "padded_legacy")
    assert rec["status"] == "padded_legacy" and len(rec["rows"]) == 2
    datas = [(tmp_path / rel).read_bytes() for rel in rec["rows"]]
    healthy = result.namespaces[0]["file_size"]
    assert rec["data_size"] == healthy
    for data in datas:
        assert len(data) == 16 * 1024 * 1024
        assert data[:healthy] == pages_of_llmd(spec, rec["block"])
        assert any(data[healthy:healthy + 4096])  # stale, not zero
    assert datas[0] == datas[1]  # MLA replicas stay equal: only the padding is the finding


def pages_of_llmd(spec, hex_hash):
    from kvmigrate.synth import llmd_file_bytes

    return llmd_file_bytes(spec, hex_hash=hex_hash, group=0, rank=0, tensors=range(spec.layers), blocks_per_file=1)


@pytest.mark.parametrize("name,check", [
    ("header_magic", "magic"), ("header_key_size", "key_size"), ("header_version", "format_version"),
    ("header_digest", "digest"), ("header_payload_size", "payload_size"), ("header_key", "key")])
def test_defect_vllmcpp_header(tmp_path, name, check):
    result = build(tmp_path, SynthSpec(family="vllmcpp", defects=(name,), **SMALL))
    rec = only(result, name)
    ns = result.namespaces[0]
    data = (tmp_path / rec["relpath"]).read_bytes()
    assert rec["status"] == "header_invalid" and rec["reason"] == check
    assert len(data) == ns["file_size"]
    got = vllmcpp.verify_header(data, digest=bytes.fromhex(ns["digest"]), payload_size=ns["fields"]["page_size_bytes"],
                                key=vllmcpp.make_key(bytes.fromhex(rec["block"]), 0))
    assert got == check


@pytest.mark.parametrize("name,kind,where", [
    ("tmp_vllm", "vllm-block", "fanout"), ("tmp_cpp_block", "vllmcpp-block", "fanout"),
    ("tmp_cpp_config", "vllmcpp-config", "base"), ("tmp_probe", "vllm-probe", "base")])
def test_defect_temp_leftovers(tmp_path, name, kind, where):
    result = build(tmp_path, SynthSpec(family="vllmcpp" if "cpp" in name else "vllm", defects=(name,), **SMALL))
    rec = only(result, name)
    ns = result.namespaces[0]
    parts = rec["relpath"].split("/")
    assert rec["status"] == "tmp_leftover" and (tmp_path / rec["relpath"]).is_file()
    assert layout.temp_kind(parts[-1]) == kind
    if where == "base":
        assert parts[0] == ns["base_name"] and len(parts) == 2
    else:
        assert parts[0] == ns["rank_dirs"][0] and len(parts) == 4
        assert layout.parse_block(parts[1], parts[2], parts[3]) is None
        assert parts[3].split(".bin")[0] not in {b["hex"] for b in result.blocks}


def test_defect_tmp_vllm_digits_follow_the_writer(tmp_path):
    llmd = only(build(tmp_path / "a", SynthSpec(family="llmd", defects=("tmp_vllm",), **SMALL)), "tmp_vllm")
    digits = int(llmd["relpath"].rsplit("_", 1)[1].split(".")[0])
    assert digits < 2**32  # llm-d: std::random_device u32


def test_defect_foreign(tmp_path):
    result = build(tmp_path, SynthSpec(family="llmd", tp=2, defects=("foreign",), **SMALL))
    rec = only(result, "foreign")
    name = rec["relpath"].split("/")[-1]
    assert rec["status"] == "foreign" and (tmp_path / rec["relpath"]).is_file()
    assert layout.temp_kind(name) is None and not layout.BLOCK_RE.match(name)


def test_defect_symlink_points_outside_the_root(tmp_path):
    result = build(tmp_path, SynthSpec(family="vllm", defects=("symlink",), **SMALL))
    rec = only(result, "symlink")
    path = tmp_path / rec["relpath"]
    assert rec["status"] == "foreign" and path.is_symlink()
    target = Path(os.readlink(path))
    assert target.is_absolute() and tmp_path not in target.parents
    _, bucket, fanout, name = rec["relpath"].split("/")
    assert layout.parse_block(bucket, fanout, name) is not None  # named like a block: must still be foreign


def test_defect_fifo(tmp_path):
    import stat

    result = build(tmp_path, SynthSpec(family="llmd", defects=("fifo",), **SMALL))
    rec = only(result, "fifo")
    assert rec["status"] == "foreign"
    assert stat.S_ISFIFO(os.lstat(tmp_path / rec["relpath"]).st_mode)


def test_defect_config_missing(tmp_path):
    result = build(tmp_path, SynthSpec(family="llmd", tp=2, defects=("config_missing",), **SMALL))
    rec = only(result, "config_missing")
    ns = result.namespaces[0]
    assert rec["status"] == rec["namespace_status"] == "orphan_namespace"
    assert (tmp_path / ns["base_name"]).is_dir() and not (tmp_path / ns["config_relpath"]).exists()
    assert sorted(rec["rows"]) == sorted(result.block_files())


def test_defect_config_unparsable(tmp_path):
    result = build(tmp_path, SynthSpec(family="vllm", defects=("config_unparsable",), **SMALL))
    rec = only(result, "config_unparsable")
    assert rec["status"] == "config_invalid"
    assert rec["rows"] == [result.namespaces[0]["config_relpath"], *result.block_files()]
    with pytest.raises(ValueError):
        fields_from_config_bytes((tmp_path / rec["relpath"]).read_bytes())


@pytest.mark.parametrize("family", ["vllm", "llmd", "vllmcpp"])
def test_defect_digest_mismatch(tmp_path, family):
    result = build(tmp_path, SynthSpec(family=family, defects=("digest_mismatch",), **SMALL))
    rec = only(result, "digest_mismatch")
    ns = result.namespaces[0]
    fields = fields_from_config_bytes((tmp_path / rec["relpath"]).read_bytes())
    canon = "vllmcpp" if family == "vllmcpp" else "vllm"
    assert rec["status"] == "digest_mismatch"
    assert rec["rows"][0] == ns["config_relpath"] and rec["rows"][1:]  # its blocks carry it too
    assert fields != ns["fields"] and d12(fields, canon) != ns["d12"]
    assert set(fields) == set(ns["fields"])  # still a well-formed identity


def test_defect_deep_layout(tmp_path):
    spec = SynthSpec(family="llmd", defects=("deep_layout",), **SMALL)
    result = build(tmp_path, spec)
    rec = only(result, "deep_layout")
    assert rec["status"] == "unsupported_layout" and rec["relpath"] == "meta-llama"
    assert layout.parse_folder(rec["relpath"]) is None
    assert len(rec["rows"]) == 2
    for rel in rec["rows"]:
        parts = rel.split("/")
        assert parts[:7] == ["meta-llama", "Llama-3.1-8B-Instruct", "block_size_16_blocks_per_file_1",
                             "tp_1_pp_size_1_pcp_size_1", "rank_0", "auto", parts[6]]
        assert parts[7].endswith("_g0") and (tmp_path / rel).stat().st_size == 4 * 64


def test_defect_pp_stage(tmp_path):
    result = build(tmp_path, SynthSpec(family="llmd", tp=2, defects=("pp_stage",), **SMALL))
    recs = [d for d in result.defects if d["name"] == "pp_stage"]
    assert len(recs) == 2 == len(result.namespaces)
    assert {r["relpath"] for r in recs} == {ns["base_name"] for ns in result.namespaces}
    for rec in recs:
        assert rec["status"] == "unsupported_layout" and rec["reason"] == "pipeline stage"
        assert len(rec["rows"]) == 2 * 3  # 2 ranks x 3 blocks of that stage
    assert sorted(r for rec in recs for r in rec["rows"]) == sorted(result.block_files())


def test_defect_orphan_rank(tmp_path):
    result = build(tmp_path, SynthSpec(family="vllmcpp", defects=("orphan_rank",), **SMALL))
    rec = only(result, "orphan_rank")
    folder = layout.parse_folder(rec["relpath"])
    assert rec["status"] == "orphan_namespace" and folder.rank == 0
    assert not (tmp_path / folder.base).exists()
    assert folder.base not in {ns["base_name"] for ns in result.namespaces}
    assert len(rec["rows"]) == 2 and all((tmp_path / r).is_file() for r in rec["rows"])


FAMILY_DEFECTS = {
    "vllm": ["size_mismatch", "short", "zero_filled", "misfiled", "unreadable", "tmp_vllm", "tmp_probe",
             "foreign", "symlink", "fifo", "digest_mismatch", "deep_layout", "orphan_rank"],
    "llmd": ["missing_rank", "replica_differs", "size_mismatch", "short", "zero_filled", "misfiled", "unreadable",
             "padded_legacy", "tmp_vllm", "foreign", "symlink", "fifo", "config_missing", "deep_layout",
             "orphan_rank"],
    "vllmcpp": ["missing_rank", "replica_differs", "size_mismatch", "short", "zero_filled", "misfiled",
                "header_magic", "header_key_size", "header_version", "header_digest", "header_payload_size",
                "header_key", "tmp_cpp_block", "tmp_cpp_config", "foreign", "symlink", "fifo",
                "config_unparsable", "orphan_rank"],
}


@pytest.mark.parametrize("family", sorted(FAMILY_DEFECTS))
def test_defects_together_leave_every_other_file_untouched(tmp_path, family):
    """All of a family's defects at once hit distinct victims, and every file outside the
    defect records is byte-identical to the healthy tree."""
    base = dict(family=family, tp=2, kv_kind="mla", layers=2, page_bytes=64, blocks=24)
    if family == "vllm":
        base.update(tp=1)
    healthy = tree_files(build(tmp_path / "healthy", SynthSpec(**base)).root)
    result = build(tmp_path / "sick", SynthSpec(defects=tuple(FAMILY_DEFECTS[family]), **base))
    sick = tree_files(result.root)
    assert {d["name"] for d in result.defects} == set(FAMILY_DEFECTS[family])
    victims = [d["block"] for d in result.defects if d["block"]]
    assert len(victims) == len(set(victims))
    touched = {d["relpath"] for d in result.defects}
    touched |= {r for d in result.defects if d["namespace_status"] is None for r in d["rows"]}
    victim_blocks = {b["hex"] for b in result.blocks if b["defect"]}
    checked = 0
    for rel, data in healthy.items():
        if rel in touched or any(h in rel for h in victim_blocks):
            continue
        assert sick.get(rel) == data, rel
        checked += 1
    assert checked >= 10


def test_block_defects_need_enough_blocks(tmp_path):
    with pytest.raises(ValueError, match="blocks >= 3"):
        build(tmp_path, SynthSpec(blocks=2, defects=("short", "zero_filled")))


def test_config_defects_are_exclusive(tmp_path):
    with pytest.raises(ValueError, match="pick one"):
        build(tmp_path, SynthSpec(defects=("config_missing", "digest_mismatch"), **SMALL))


def test_defective_trees_are_deterministic(tmp_path):
    spec = SynthSpec(family="llmd", defects=("missing_rank", "tmp_vllm", "symlink", "fifo", "orphan_rank"), **MLA2)
    a = build(tmp_path / "a", spec)
    b = build(tmp_path / "b", spec)
    assert tree_files(tmp_path / "a") == tree_files(tmp_path / "b")
    assert json.dumps(a.to_dict()["defects"]).replace(str(a.root), "") == \
        json.dumps(b.to_dict()["defects"]).replace(str(b.root), "")


def test_rebuilding_over_a_defective_tree_works(tmp_path):
    spec = SynthSpec(family="vllm", defects=("unreadable", "symlink", "fifo", "misfiled"), blocks=5, layers=2,
                     page_bytes=64)
    build(tmp_path, spec)
    first = tree_files(tmp_path)
    build(tmp_path, spec)
    assert tree_files(tmp_path) == first


def test_cli_synth_defects_flag(tmp_path):
    out = CliRunner().invoke(cli, ["synth", str(tmp_path), "--family", "vllmcpp", "--blocks", "3",
                                   "--defects", "header_digest,tmp_cpp_config"])
    assert out.exit_code == 0, out.output
    assert "header_digest" in out.output and "header_invalid" in out.output
    assert "tmp_cpp_config" in out.output


def test_demo_llmd_mla_tree_lands_in_the_demo_replicated_namespace(tmp_path):
    """The demo's llm-d TP=2 MLA tree and its vLLM S3 replicated tree are one model's cache:
    the identity engine maps the first onto the second, and a padded rank-0 replica equals
    the replicated row byte for byte (so a migration finds those blocks already present)."""
    from kvmigrate.families import compute_target
    from kvmigrate.identity.facts import Facts
    from kvmigrate.synth import pad_row

    results = build_demo_root(tmp_path, with_defects=False)
    llmd, replicated = results[0], results[3]
    target = compute_target(llmd.namespaces[0]["fields"], "llmd", Facts(kv_kind="mla", model_dtype="bfloat16"),
                            "vllm-0.28")
    assert target.replicated_layout and target.base_name == replicated.namespaces[0]["base_name"]
    rows = {b["hex"]: (tmp_path / b["files"][0]).read_bytes() for b in replicated.blocks}
    shared = [b for b in llmd.blocks if b["hex"] in rows]
    assert len(shared) == len(rows) == 3
    for block in shared:
        assert pad_row((tmp_path / block["files"][0]).read_bytes()) == rows[block["hex"]]
