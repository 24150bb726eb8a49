"""synth --family mooncake: every backend × engine × scheme × {GQA, MLA} store at TP 1-8 read
back by the reference reader (tests/helpers/mooncake_reader.py), each defect doing what a
starting client does with it (spec mooncake.md §1, §2, §4)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvmigrate.cli import cli
from kvmigrate.formats import mooncake as M
from kvmigrate.synth import SynthSpec, build
from kvmigrate.synth import mooncake as S

from helpers import mooncake_reader as R

SMALL = dict(family="mooncake", layers=2, block_tokens=4, blocks=3)
TPS = (1, 2, 4, 8)


def spec(**kw) -> SynthSpec:
    return SynthSpec(**{**SMALL, **kw})


def skey(obj: dict) -> bytes:
    return obj["storage_key"].encode("utf-8", "surrogateescape")


def files_under(root: Path) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = os.readlink(p) if p.is_symlink() else p.read_bytes()
    return out


def started(root: Path, sp: SynthSpec, result) -> dict[str, R.StartResult]:
    """The reader's start on every client root of the store."""
    ns = result.namespaces[0]
    return {cr: R.start(root / cr, fsdir=sp.mc_fsdir) for cr in ns["client_roots"]}


def read(root: Path, sp: SynthSpec, starts: dict, cr: str, key: bytes) -> bytes | str:
    return R.read(root / cr, starts[cr], key, scoped=sp.mc_scheme == "mc-scoped", fsdir=sp.mc_fsdir)


def main_objects(result) -> list[dict]:
    return [o for b in result.blocks if b["defect"] is None for o in b["objects"]]


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("kv_kind", ["full", "mla"])
@pytest.mark.parametrize("scheme", M.SCHEMES)
@pytest.mark.parametrize("engine", S.ENGINES)
@pytest.mark.parametrize("backend", S.BACKENDS)
def test_a_starting_client_adopts_every_object_and_reads_its_rank_value(tmp_path, backend, engine, scheme,
                                                                        kv_kind, tp):
    sp = spec(mc_backend=backend, mc_engine=engine, mc_scheme=scheme, kv_kind=kv_kind, tp=tp)
    result = build(tmp_path, sp)
    ns = result.namespaces[0]
    starts = started(tmp_path, sp, result)
    registered = set()
    for cr, st in starts.items():
        assert st.deleted == [] and st.refused is None, (cr, st)
        registered |= {(cr, k) for k in (st.entries if backend == "bucket" else st.kv_files)}
    objs = main_objects(result)
    assert registered == {(o["client_root"], skey(o)) for o in objs}
    halves = 2 if engine == "sglang" and kv_kind == "full" else 1
    assert len(objs) == ns["objects"] == sp.blocks * S.key_ranks(sp) * halves
    for b in result.blocks:
        for o in b["objects"]:
            value = S.rank_value(sp, b["hex"], o["rank"], o["pp"], o["half"] or "k")
            assert read(tmp_path, sp, starts, o["client_root"], skey(o)) == value
            assert len(value) == o["size"] == ns["object_size"]
            stored = M.parse_storage_key(skey(o))
            assert stored.scheme == scheme and stored.engine == o["key"]
            assert stored.tenant == (None if scheme == "mc-raw" else "default")
            if engine == "vllm":
                k = M.parse_vllm_key(o["key"])
                assert k is not None and (k.tp_rank, k.pp_rank, k.hash, k.model) == (
                    o["rank"], 0, b["hex"], "Llama-3.1-8B-Instruct")
                assert o["client_root"] == "store"
            else:
                g = M.parse_sglang_key(o["key"])
                assert g is not None and g.page_hash == b["hex"] and g.prefix == "meta-llama-Llama-3.1-8B-Instruct"
                assert g.ranks == (() if kv_kind == "mla" else (o["rank"],)) and g.half == o["half"]
                assert o["client_root"] == f"store/rank_0_{o['rank']}_0_0"
    if kv_kind == "mla":  # one object per block at every TP: vLLM tp_rank:0, SGLang `__k` from rank 0
        assert {o["rank"] for o in objs} == {0} and ns["client_roots"] == [S.client_root(sp)]


@pytest.mark.parametrize("backend", S.BACKENDS)
def test_raw_keys_are_registered_but_unread_by_a_scoped_client(tmp_path, backend):
    """§2.1: a ≥ 0.3.12 client asks for `default\\0K`; the store holds `K` (raw, ≤ 0.3.11)."""
    sp = spec(mc_backend=backend, mc_scheme="mc-raw")
    result = build(tmp_path, sp)
    starts = started(tmp_path, sp, result)
    for o in main_objects(result):
        assert b"\0" not in skey(o)
        got = R.read(tmp_path / o["client_root"], starts[o["client_root"]], M.scoped(o["key"]), scoped=True)
        assert isinstance(got, str) and ("INVALID_KEY" in got or got == "not found"), got


@pytest.mark.parametrize("engine", S.ENGINES)
def test_gqa_values_are_head_shards_of_one_block_at_every_tp(engine):
    """Concatenating key ranks' heads per row gives the full block back, and TP=2's rank 0 is
    TP=4's ranks 0 and 1 side by side: a reshard is checkable byte for byte (§3.4)."""
    row_cell = S.HEAD_DIM * S.DTYPE_BYTES
    h = "cd" * 32
    for tp in TPS:
        sp = spec(mc_engine=engine, tp=tp)
        halves = ("k", "v") if engine == "sglang" else ("k",)
        whole = b""
        for half in halves:
            values = [S.rank_value(sp, h, r, 0, half) for r in range(S.key_ranks(sp))]
            width = len(S.head_set(sp, 0)) * row_cell
            rows = len(values[0]) // width
            whole += b"".join(v[i * width:(i + 1) * width] for i in range(rows) for v in values)
        assert whole == S.full_block(sp, h)
    two, four = spec(mc_engine=engine, tp=2), spec(mc_engine=engine, tp=4)
    w = 2 * row_cell  # TP=4 holds 2 heads a rank
    r0, r1 = S.rank_value(four, h, 0), S.rank_value(four, h, 1)
    merged = b"".join(r0[i:i + w] + r1[i:i + w] for i in range(0, len(r0), w))
    assert merged == S.rank_value(two, h, 0)


def test_sglang_tp_above_heads_replicates_and_vllm_keeps_min_tp_h_ranks(tmp_path):
    """§2.3: SGLang MHA writes every TP rank (ranks beyond H hold a replicated head); §2.2: vLLM
    GQA writes min(tp, H) key ranks."""
    sg = spec(mc_engine="sglang", tp=16)
    result = build(tmp_path / "s", sg)
    assert result.namespaces[0]["key_ranks"] == 16 and len(result.namespaces[0]["client_roots"]) == 16
    h = result.blocks[0]["hex"]
    assert S.rank_value(sg, h, 4) == S.rank_value(sg, h, 5) != S.rank_value(sg, h, 6)
    assert S.head_set(sg, 5) == [2]
    vl = spec(mc_engine="vllm", tp=16)
    assert build(tmp_path / "v", vl).namespaces[0]["key_ranks"] == 8


def test_mla_keys_and_bytes_are_the_same_at_every_tp(tmp_path):
    for engine in S.ENGINES:
        seen = set()
        for tp in range(1, 9):  # any TP: MLA is not sharded by heads
            sp = spec(mc_engine=engine, kv_kind="mla", tp=tp, mc_store=f"{engine}{tp}")
            result = build(tmp_path, sp)
            seen.add(tuple((o["key"], S.rank_value(sp, b["hex"], 0)) for b in result.blocks for o in b["objects"]))
        assert len(seen) == 1
    key = M.parse_sglang_key(S.engine_key(spec(mc_engine="sglang", kv_kind="mla"), "ab" * 32, 0))
    assert key is not None and key.ranks == () and key.half == "k"


@pytest.mark.parametrize("engine", S.ENGINES)
def test_pipeline_stages_store_their_own_layers(tmp_path, engine):
    sp = spec(mc_engine=engine, tp=2, pp=2, layers=4)
    result = build(tmp_path, sp)
    starts = started(tmp_path, sp, result)
    objs = main_objects(result)
    assert {o["pp"] for o in objs} == {0, 1}
    for o in objs:
        if engine == "vllm":
            k = M.parse_vllm_key(o["key"])
            assert k is not None and k.pp_rank == o["pp"]
        else:
            g = M.parse_sglang_key(o["key"])
            assert g is not None and g.ranks == (o["rank"], o["pp"])
            assert o["client_root"] == f"store/rank_0_{o['rank']}_{o['pp']}_0"
        assert o["size"] == S.object_size(sp) == S.object_size(spec(mc_engine=engine, tp=2, layers=2))
        assert read(tmp_path, sp, starts, o["client_root"], skey(o)) == S.rank_value(
            sp, o["key"].rsplit("@", 1)[-1] if engine == "vllm" else M.parse_sglang_key(o["key"]).page_hash,
            o["rank"], o["pp"], o["half"] or "k")
    h = result.blocks[0]["hex"]
    assert S.full_block(sp, h, 0) != S.full_block(sp, h, 1)


def test_bucket_pairs_hold_sorted_keys_capped_per_pair_with_seeded_ids(tmp_path):
    """§1.2: ≤ bucket-keys a pair, records sorted by storage key, ids `(seconds << 12) + seq`
    from a time fixed by the seed, `.meta` as Mooncake encodes it."""
    sp = spec(tp=2, blocks=4, mc_bucket_keys=3)
    result = build(tmp_path, sp)
    pairs = result.namespaces[0]["pairs"]
    assert [p["keys"] for p in pairs] == [3, 3, 2]
    base = S.base_seconds(sp) << 12
    assert [p["id"] for p in pairs] == [base, base + 1, base + 2]
    keys: list[bytes] = []
    for p in pairs:
        raw = (tmp_path / p["meta"]).read_bytes()
        meta = M.decode_meta(raw)
        assert M.encode_meta(meta) == raw and meta.data_size == (tmp_path / p["bucket"]).stat().st_size
        keys += meta.keys
    assert keys == sorted(keys) and len(keys) == 8
    assert S.base_seconds(spec(seed=1)) != S.base_seconds(sp)


@pytest.mark.parametrize("backend", S.BACKENDS)
def test_same_seed_same_bytes(tmp_path, backend):
    defects = ("short", "foreign", "zero_filled")
    a = build(tmp_path / "a", spec(mc_backend=backend, tp=2, defects=defects))
    b = build(tmp_path / "b", spec(mc_backend=backend, tp=2, defects=defects))
    assert files_under(tmp_path / "a") == files_under(tmp_path / "b")
    assert a.to_dict()["blocks"] == b.to_dict()["blocks"]
    build(tmp_path / "c", spec(mc_backend=backend, tp=2, defects=defects, seed=1))
    assert files_under(tmp_path / "c") != files_under(tmp_path / "a")


def test_store_at_root_and_two_stores_side_by_side(tmp_path):
    build(tmp_path / "one", spec(mc_store="."))
    assert any(n.endswith(".meta") for n in os.listdir(tmp_path / "one"))
    r1 = build(tmp_path / "two", spec(mc_store="vllm-bucket"))
    r2 = build(tmp_path / "two", spec(mc_store="sglang-fpk", mc_engine="sglang", mc_backend="file_per_key", tp=2))
    assert r1.namespaces[0]["client_roots"] == ["vllm-bucket"]
    assert r2.namespaces[0]["client_roots"] == ["sglang-fpk/rank_0_0_0_0", "sglang-fpk/rank_0_1_0_0"]
    for rel in ("sglang-fpk/rank_0_0_0_0", "sglang-fpk/rank_0_1_0_0"):
        assert (tmp_path / "two" / rel / M.DEFAULT_FSDIR).is_dir()


def test_cache_prefix_operator_and_auto(tmp_path):
    op = build(tmp_path / "op", spec(mc_cache_prefix="team-a"))
    k = M.parse_vllm_key(op.blocks[0]["objects"][0]["key"])
    assert k is not None and k.prefix == "team-a" and k.model == "Llama-3.1-8B-Instruct"
    auto = build(tmp_path / "auto", spec(mc_cache_prefix="auto"))
    k = M.parse_vllm_key(auto.blocks[0]["objects"][0]["key"])
    assert k is not None and k.prefix is not None and k.prefix.startswith("auto-") and len(k.prefix) == 21
    assert auto.namespaces[0]["cache_prefix"] == k.prefix


def test_fsdir_and_tenant(tmp_path):
    sp = spec(mc_backend="file_per_key", mc_fsdir="kv", mc_tenant="team-b")
    result = build(tmp_path, sp)
    starts = started(tmp_path, sp, result)
    for o in main_objects(result):
        assert skey(o).startswith(b"team-b\0") and o["relpath"] == "store/" + M.fpk(skey(o), "kv")
        assert isinstance(read(tmp_path, sp, starts, "store", skey(o)), bytes)


# what each defect is about (per backend) and what a starting client does with it (§1.4)
def _check_defect(root: Path, sp: SynthSpec, rec: dict, starts: dict) -> None:
    d = rec["name"]
    cr = rec["client_root"]
    path = root / rec["relpath"]
    fpk = sp.mc_backend == "file_per_key"
    if d == "orphan_data":
        assert path.name.endswith(".bucket") and not path.with_suffix(".meta").exists()
    elif d == "orphan_index":
        assert path.name.endswith(".meta") and not path.with_suffix(".bucket").exists()
    elif d == "corrupt_sidecar":
        metas = [r for r in rec["statuses"] if r.endswith(".meta")]
        with pytest.raises(M.DecodeError):
            M.decode_meta((root / metas[0]).read_bytes())
        assert M.decode_meta((root / metas[1]).read_bytes()).keys == ()
    elif d == "short" and not fpk:
        row = rec["objects"][0]
        meta = M.decode_meta(path.read_bytes())
        bucket = root / rec["relpath"].replace(".meta", ".bucket")
        assert meta.objects[row["object_index"]].end > bucket.stat().st_size
        assert sum(o.end > bucket.stat().st_size for o in meta.objects) == 1  # the others are whole
    elif d in ("short", "header_invalid"):
        with pytest.raises(M.DecodeError):
            M.decode_kv_entry(path.read_bytes())
    elif d == "misfiled" and not fpk:
        assert not M.is_pair_name(path.name) and M.stoll_id(path.name) is not None
        M.decode_meta(path.read_bytes())
    elif d == "misfiled":
        entry = M.decode_kv_entry(path.read_bytes())
        assert rec["relpath"] != M.fpk(entry.key, sp.mc_fsdir) and rec["relpath"].startswith(cr + "/")
        assert rec["relpath"].split("/")[-1] == M.sanitize_key(entry.key)
    elif d == "tmp_leftover":
        assert path.name.endswith(".tmp") and path.relative_to(root / cr).parts[:1] == (sp.mc_fsdir,)
        assert len(path.relative_to(root / cr / sp.mc_fsdir).parts) == 3  # depth 3: scanned at start
        entry = M.decode_kv_entry(path.read_bytes())
        assert len(starts[cr].kv_files[entry.key]) == 2  # registered again: a harmless duplicate
    elif d == "foreign":
        assert all(M.stoll_id(r.rsplit("/", 1)[-1]) is None for r in rec["statuses"])
    elif d == "nested_bucket":
        assert path.parent.name == S.NESTED_DIR and path.name.endswith(".bucket")
    elif d == "replica_mismatch":
        a, b = rec["objects"]
        assert a["key"] == b["key"] and a["relpath"] != b["relpath"]
    elif d in ("zero_filled", "size_mismatch"):
        row = rec["objects"][0]
        got = read(root, sp, starts, cr, row["key"].encode())
        assert isinstance(got, bytes)
        if d == "zero_filled":
            assert not any(got) and len(got) == S.object_size(sp)
        else:
            assert len(got) > S.object_size(sp)
    elif d == "symlink":
        assert path.is_symlink() and path.resolve().is_file()
    elif d == "unreadable":
        assert path.stat().st_mode & 0o777 == 0
        if os.geteuid() != 0:
            with pytest.raises(PermissionError):
                if fpk:
                    R.start(root / cr, fsdir=sp.mc_fsdir)
                else:
                    read(root, sp, starts, cr, rec["objects"][0]["key"].encode())
    elif d == "client_lock":
        assert set(rec["statuses"]) == {f"{r}/{M.LOCK_NAME}" for r in starts}
        assert all((root / r).stat().st_size == 0 for r in rec["statuses"])
    elif d == "unsupported_key":
        row = rec["objects"][0]
        engine_key = M.parse_storage_key(row["key"].encode()).engine
        assert M.parse_vllm_key(engine_key) is None and M.parse_sglang_key(engine_key) is None
        assert isinstance(read(root, sp, starts, cr, row["key"].encode()), bytes)
    else:
        raise AssertionError(d)


CASES = [(d, b, e) for d, (backends, _) in S.DEFECTS.items() for b in backends for e in S.ENGINES]


@pytest.mark.parametrize(("defect", "backend", "engine"), CASES)
def test_each_defect_does_what_a_starting_client_does(tmp_path, defect, backend, engine):
    sp = spec(mc_backend=backend, mc_engine=engine, tp=2, defects=(defect,))
    result = build(tmp_path, sp)
    (rec,) = result.defects
    assert rec["status"] == S.DEFECTS[defect][1]
    assert rec["statuses"].get(rec["relpath"]) == rec["status"] or (
        rec["object_index"] is not None and rec["objects"][0]["status"] == rec["status"])
    for rel in rec["statuses"]:
        assert os.path.lexists(tmp_path / rel), rel
    starts = started(tmp_path, sp, result)
    deleted = sorted(str(p.relative_to(tmp_path)) for st in starts.values() for p in st.deleted)
    assert deleted == sorted(rec["deleted"])
    refused = [cr for cr, st in starts.items() if st.refused]
    assert refused == ([rec["client_root"]] if rec["refuses_start"] else [])
    for row in rec["objects"]:  # the object rows: the entry at object_index holds the key
        if row["object_index"] is not None:
            meta = M.decode_meta((tmp_path / row["relpath"]).read_bytes())
            assert meta.keys[row["object_index"]] == row["key"].encode()
    for key in rec["read_fails"]:
        got = read(tmp_path, sp, starts, rec["client_root"], key.encode())
        assert isinstance(got, str), got
    if not rec["refuses_start"]:  # the main blocks stay whole and readable
        for b in result.blocks:
            if b["defect"] is None:
                for o in b["objects"]:
                    want = S.rank_value(sp, b["hex"], o["rank"], o["pp"], o["half"] or "k")
                    assert read(tmp_path, sp, starts, o["client_root"], skey(o)) == want
    _check_defect(tmp_path, sp, rec, starts)


def test_every_defect_at_once_on_each_backend(tmp_path):
    for backend in S.BACKENDS:
        names = tuple(d for d, (backends, _) in S.DEFECTS.items() if backend in backends)
        result = build(tmp_path / backend, spec(mc_backend=backend, defects=names))
        assert [d["name"] for d in result.defects] == list(names)
        assert len({b["hex"] for b in result.blocks}) == len(result.blocks)  # each defect its own blocks


@pytest.mark.parametrize(("kw", "msg"), [
    (dict(mc_backend="file_per_key", defects=("orphan_data",)), "applies to backend bucket"),
    (dict(defects=("header_invalid",)), "applies to backend file_per_key"),
    (dict(defects=("tmp_leftover",)), "applies to backend file_per_key"),
    (dict(mc_backend="file_per_key", defects=("client_lock",)), "applies to backend bucket"),
    (dict(defects=("missing_rank",)), "not one Mooncake stores carry"),
    (dict(tp=3), "shards over a TP dividing 8"),
    (dict(tp=17, kv_kind="mla"), "TP 1-16"),
    (dict(mc_engine="sglang", mc_cache_prefix="x"), "cache prefix is vLLM's"),
    (dict(mc_scheme="mc-raw", mc_tenant="t"), "has no tenant"),
    (dict(mc_bucket_keys=501), "at most 500"),
    (dict(layers=3, pp=2), "divisible by pp"),
    (dict(dtype="float32"), "2-byte elements"),
    (dict(model_name="a@b"), "key grammar"),
    (dict(mc_store="a/b"), "one folder name"),
])
def test_combinations_no_writer_produces_are_refused(tmp_path, kw, msg):
    with pytest.raises(ValueError, match=msg):
        build(tmp_path, spec(**kw))


def test_a_second_build_into_one_store_is_refused(tmp_path):
    build(tmp_path, spec())
    with pytest.raises(ValueError, match="one build per store"):
        build(tmp_path, spec())


def test_cli_synth_mooncake_json_and_text(tmp_path):
    runner = CliRunner()
    out = runner.invoke(cli, ["synth", str(tmp_path / "j"), "--family", "mooncake", "--mc-engine", "sglang",
                              "--mc-backend", "file_per_key", "--mc-scheme", "mc-raw", "--tp", "2", "--blocks", "2",
                              "--layers", "2", "--block-tokens", "4", "--defects", "short,foreign", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    ns = data["namespaces"][0]
    assert (ns["family"], ns["engine"], ns["backend"], ns["scheme"], ns["tp"]) == (
        "mooncake", "sglang", "file_per_key", "mc-raw", 2)
    assert ns["objects"] == 8 and [d["name"] for d in data["defects"]] == ["short", "foreign"]
    assert data["defects"][0]["refuses_start"] is True
    text = runner.invoke(cli, ["synth", str(tmp_path / "t"), "--family", "mooncake", "--mc-store", "mc",
                               "--mc-bucket-keys", "2", "--defects", "client_lock"])
    assert text.exit_code == 0, text.output
    assert "mc  mooncake bucket vllm mc-scoped tp=1 pp=1 full roots=1 objects=8" in text.output
    assert "8 objects under" in text.output and "defect client_lock: mc/.mooncake_local_disk.lock -> ok" in text.output
    bad = runner.invoke(cli, ["synth", str(tmp_path / "b"), "--family", "mooncake", "--tp", "3"])
    assert bad.exit_code == 2 and "shards over a TP" in bad.output
