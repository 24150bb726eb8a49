"""synth --family lmcache: every backend × era × {GQA, MLA} tier, read back file by file
with kvmigrate/formats/lmcache.py (spec lmcache.md §1-§4)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvmigrate.cli import cli
from kvmigrate.formats import lmcache as L
from kvmigrate.synth import SynthSpec, build
from kvmigrate.synth import lmcache as S

SMALL = dict(family="lmcache", layers=2, block_tokens=4, blocks=3)
COMBOS = [(b, e) for b in L.BACKENDS for e in L.SCHEMES if (b == "mp") == (e == "lmc-mp1")]


def spec(**kw) -> SynthSpec:
    return SynthSpec(**{**SMALL, **kw})


def files_under(root: Path) -> list[str]:
    out = []
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            out.append(str((Path(dirpath) / name).relative_to(root)))
    return sorted(out)


def check_chunk_files(root: Path, sp: SynthSpec, result) -> int:
    """Every chunk file synth recorded parses back to the record's fields and is whole."""
    ns = result.namespaces[0]
    n = 0
    for blk in result.blocks:
        for wid, rel in blk["files"].items():
            if rel is None:
                continue
            parsed = L.parse_name(rel.split("/")[-1])
            assert parsed is not None and parsed.backend == sp.lmc_backend, rel
            key = parsed.key
            worker = blk["workers"][wid]
            assert (key.scheme, key.ws, key.wid, key.hash) == (sp.lmc_era, worker["ws"], wid, blk["hex"])
            # local_disk and ≤ 0.3.9.post2 fs names write '/' as '-': the model is matched, not decoded
            lossy = sp.lmc_backend == "local_disk" or (sp.lmc_backend, sp.lmc_era) == ("fs", "lmc-k1")
            assert parsed.model_exact is not lossy
            assert L.format_key(key) == blk["keys"][wid] or lossy
            if lossy:
                assert L.local_disk_model_matches(sp.model_name, key.model)
            else:
                assert key.model == sp.model_name
            assert key.dtype == (None if sp.lmc_era in ("lmc-k1", "lmc-mp1") else ns["dtype"])
            assert key.tags == S.tags(sp) and key.kv_rank == worker["kv_rank"]
            folder = rel.rsplit("/", 1)[0] if "/" in rel else ""
            tier = "" if sp.lmc_tier == "." else sp.lmc_tier
            folders = None
            if sp.lmc_backend == "gds":  # synth's k1 hashes are 0.3.6+ signed hex: the writer's decimal folders
                folders = L.gds_folders(key) or (L.gds_int_folders(int(key.hash, 16)) if key.scheme == "lmc-k1"
                                                 else None)
            assert folder == "/".join(p for p in (tier, *(folders or ())) if p)
            data = (root / rel).read_bytes()
            payload = S.rank_payload(sp, blk["hex"], worker["rank"])
            assert data.endswith(payload) and len(payload) == blk["payload_size"]
            side = None
            if sp.lmc_backend == "gds":
                side = (root / blk["sidecars"][wid]).read_bytes()
                assert side == data[:4096] and L.sidecar_verdict(side, data).status is None
            mla = sp.kv_kind == "mla"
            hidden = S.hidden(sp, worker["rank"])
            full = L.full_chunk_bytes(mla, sp.layers, sp.block_tokens, hidden, ns["dtype"])
            verdict = L.chunk_verdict(sp.lmc_backend, len(data), data[:4096], all_zero=not any(data),
                                      dtype=key.dtype or ns["dtype"], mla=mla, fs_header=ns["fs_header"],
                                      full_chunk=full)
            assert verdict.status is None, (rel, verdict)
            n += 1
    return n


@pytest.mark.parametrize("kv_kind", ["full", "mla"])
@pytest.mark.parametrize(("backend", "era"), COMBOS)
def test_every_backend_era_and_kind_parses_back(tmp_path, backend, era, kv_kind):
    sp = spec(lmc_backend=backend, lmc_era=era, kv_kind=kv_kind, tp=2,
              lmc_tags=() if era == "lmc-mp1" else ("user%alice", "tenant%t%1"))
    result = build(tmp_path, sp)
    n = check_chunk_files(tmp_path, sp, result)
    assert n == 3 * (2 if kv_kind == "full" else 1)  # MLA: rank 0 only (save_only_first_rank)
    # nothing else was written: every file is a chunk (or a GDS sidecar)
    written = {rel for b in result.blocks for rel in [*b["files"].values(), *b["sidecars"].values()]}
    assert set(files_under(tmp_path)) == written


@pytest.mark.parametrize("tp", range(1, 9))
def test_mla_workers_at_every_tp(tmp_path, tp):
    """§1.2/§3.1: save_only_first_rank writes one rank-0 file, ws 1 from k2 on (k1 kept ws);
    off, local_disk and GDS write a copy per rank, fs aliases every rank to worker 0; MP MLA
    is kv_rank 0x01000100."""
    cases = {("lmc-k3", "fs", True): [(1, 0)], ("lmc-k1", "local_disk", True): [(tp, 0)],
             ("lmc-k2", "gds", True): [(1, 0)], ("lmc-k3", "local_disk", False): [(tp, r) for r in range(tp)],
             ("lmc-k3", "gds", False): [(tp, r) for r in range(tp)], ("lmc-k3", "fs", False): [(tp, 0)],
             ("lmc-mp1", "mp", True): [(1, 0)]}
    for (era, backend, sofr), expected in cases.items():
        root = tmp_path / f"{era}-{backend}-{sofr}"
        sp = spec(lmc_backend=backend, lmc_era=era, kv_kind="mla", tp=tp, lmc_save_only_first_rank=sofr, blocks=1)
        result = build(root, sp)
        check_chunk_files(root, sp, result)
        blk = result.blocks[0]
        assert sorted((w["ws"], w["wid"]) for w in blk["workers"].values()) == expected
        copies = {(root / rel).read_bytes()[-blk["payload_size"]:] for rel in blk["files"].values()}
        assert len(copies) == 1  # every MLA copy is the whole chunk
        if backend == "mp":
            assert blk["workers"][0]["kv_rank"] == 0x01000100 and "@0x01000100@" in blk["files"][0]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_gqa_rank_files_are_head_shards_of_one_chunk(tmp_path, tp):
    """Non-MLA: one file per rank, rank r's heads of every (K/V, layer, token) row; the
    shards put back in head order are the full chunk (what a reshard relies on)."""
    sp = spec(lmc_backend="mp", lmc_era="lmc-mp1", tp=tp, blocks=1)
    result = build(tmp_path, sp)
    check_chunk_files(tmp_path, sp, result)
    blk = result.blocks[0]
    assert sorted(blk["files"]) == list(range(tp))
    assert [blk["workers"][r]["kv_rank"] for r in range(tp)] == [L.kv_rank(tp, r) for r in range(tp)]
    shards = [(tmp_path / blk["files"][r]).read_bytes() for r in range(tp)]
    per = S.TOTAL_KV_HEADS // tp * S.HEAD_DIM * 2
    rows = len(shards[0]) // per
    rebuilt = b"".join(s[i * per:(i + 1) * per] for i in range(rows) for s in shards)
    assert rebuilt == S.full_chunk(sp, blk["hex"])


def test_gqa_tp_above_heads_replicates_and_bad_tp_is_refused(tmp_path):
    assert S.head_set(spec(tp=16), 3) == [1]
    with pytest.raises(ValueError, match="TP dividing"):
        build(tmp_path, spec(tp=3))


def test_tier_root_itself_and_named_tier(tmp_path):
    root = build(tmp_path / "a", spec(lmc_tier=".", lmc_backend="local_disk"))
    assert all("/" not in rel for rel in root.block_files()) and root.namespaces[0]["tier_relpath"] == "."
    named = build(tmp_path / "b", spec(lmc_tier="ssd0", lmc_backend="gds"))
    assert all(rel.startswith("ssd0/") for rel in named.block_files())


@pytest.mark.parametrize(("backend", "era"), COMBOS)
def test_a_local_path_model_in_every_name(tmp_path, backend, era):
    """The model is the `vllm serve` argument, a local path too (§1.2): its every `/` goes
    through the backend's rule and comes back (local_disk: matched)."""
    sp = spec(lmc_backend=backend, lmc_era=era, model_name="/models/Qwen2.5-3B", blocks=2)
    result = build(tmp_path, sp)
    assert check_chunk_files(tmp_path, sp, result) == 2  # TP 1: one file per chunk


def test_fs_without_header_and_gds_legacy_names(tmp_path):
    raw = spec(lmc_backend="fs", lmc_fs_header=False)
    result = build(tmp_path / "raw", raw)
    check_chunk_files(tmp_path / "raw", raw, result)
    assert result.namespaces[0]["file_size"] == result.blocks[0]["payload_size"]
    legacy = spec(lmc_backend="gds", lmc_gds_names="legacy", model_name="org/model")
    result = build(tmp_path / "old", legacy)
    check_chunk_files(tmp_path / "old", legacy, result)
    assert all("org_model@" in rel for rel in result.block_files())


def test_payload_is_deterministic_from_the_key(tmp_path):
    a = build(tmp_path / "a", spec(lmc_backend="gds"))
    b = build(tmp_path / "b", spec(lmc_backend="gds"))
    assert [(tmp_path / "a" / r).read_bytes() for r in a.block_files()] == [
        (tmp_path / "b" / r).read_bytes() for r in b.block_files()]
    assert any(blk["hex"].startswith("-") for blk in a.blocks)  # signed hashes, negative ones too


def test_fs_header_and_gds_header_match_the_shape(tmp_path):
    result = build(tmp_path, spec(lmc_backend="fs", tp=2))
    data = (tmp_path / result.blocks[0]["files"][1]).read_bytes()
    assert L.decode_fs_header(data) == L.FsHeader(len(data) - 28, 1, ((3, (2, 2, 4, 4 * 4)),))
    result = build(tmp_path / "g", spec(lmc_backend="gds", kv_kind="mla"))
    data = (tmp_path / "g" / result.blocks[0]["files"][0]).read_bytes()
    assert L.decode_gds_header(data) == L.GdsHeader("BF16", (1, 2, 4, 8), (0, 128), 6, "1", True)


# --- defects ---------------------------------------------------------------------------------


def status_of(root: Path, rel: str, sp: SynthSpec, ns: dict) -> str | None:
    """The status formats/lmcache.py gives the file at `rel` (what a scan will do)."""
    path = root / rel
    name = rel.split("/")[-1]
    if path.is_symlink():
        return "foreign"
    if path.is_dir():  # no fact names a temp folder here
        return "foreign" if L.parse_name(name) is None else None
    if L.parse_temp_name(name) is not None:
        return "tmp_leftover"
    if not os.access(path, os.R_OK):
        return "unreadable"
    parsed = L.parse_name(name)
    assert parsed is not None, rel
    if parsed.key.layer is not None:
        return "unsupported_layout"
    data = path.read_bytes()
    if parsed.sidecar:
        data_path = path.with_name(name[: -len(L.SIDECAR)])
        status = L.sidecar_verdict(data, data_path.read_bytes() if data_path.exists() else None).status
    else:
        sidecar = "ok"
        if sp.lmc_backend == "gds":
            side = path.with_name(name + L.SIDECAR)
            sidecar = "missing" if not side.exists() else (
                "ok" if L.sidecar_verdict(side.read_bytes(), data).status is None else "corrupt")
        mla = sp.kv_kind == "mla"
        full = L.full_chunk_bytes(mla, sp.layers, sp.block_tokens, S.hidden(sp), ns["dtype"])
        status = L.chunk_verdict(sp.lmc_backend, len(data), data[:4096], all_zero=bool(data) and not any(data),
                                 dtype=parsed.key.dtype or ns["dtype"], mla=mla, fs_header=ns["fs_header"],
                                 full_chunk=full, sidecar=sidecar).status
    if status in (None, "orphan_data") and sp.lmc_backend == "gds":  # misfiled precedes orphan_data (§4)
        folders = L.gds_folders(parsed.key)
        tier = "" if sp.lmc_tier == "." else sp.lmc_tier
        if folders is not None and rel.rsplit("/", 1)[0] != "/".join(p for p in (tier, *folders) if p):
            return "misfiled"
    return status


@pytest.mark.parametrize("backend", L.BACKENDS)
def test_every_defect_gets_its_status_from_the_grammar(tmp_path, backend):
    era = "lmc-mp1" if backend == "mp" else "lmc-k3"
    defects = tuple(d for d, bs in S.DEFECTS.items() if backend in bs)
    sp = spec(lmc_backend=backend, lmc_era=era, tp=2, blocks=10, defects=defects)
    result = build(tmp_path, sp)
    ns = result.namespaces[0]
    assert [d["name"] for d in result.defects] == list(defects)
    for d in result.defects:
        assert d["tier"] == "cache" and d["backend"] == backend and d["era"] == era
        assert d["statuses"][d["relpath"]] == d["status"] and set(d["rows"]) == set(d["statuses"])
        for rel, status in d["statuses"].items():
            if os.geteuid() == 0 and status == "unreadable":
                continue  # root reads a mode-0 file
            assert status_of(tmp_path, rel, sp, ns) == status, (d["name"], rel)
    # the chunks no defect touched are whole and parse back
    clean = [b for b in result.blocks if b["defect"] is None]
    assert clean
    result.blocks = clean
    check_chunk_files(tmp_path, sp, result)
    unread = [d for d in result.defects if d["name"] == "unreadable"]
    for d in unread:
        assert stat.S_IMODE((tmp_path / d["relpath"]).stat().st_mode) == 0
        os.chmod(tmp_path / d["relpath"], 0o644)  # let tmp_path be removed


def test_tmp_dir_is_foreign_unless_a_fact_names_it(tmp_path):
    result = build(tmp_path, spec(lmc_backend="fs", defects=("tmp_dir",)))
    d = result.defect("tmp_dir")
    assert d["relpath"] == "cache/lmcache_tmp" and d["status"] == "foreign"
    (rel, status), = d["with_fact"]["statuses"].items()
    assert status == "tmp_leftover" and rel.startswith("cache/lmcache_tmp/")
    assert L.parse_name(rel.split("/")[-1]) is not None  # the final name, in the temp folder


def test_several_deployments_share_a_tier_and_tiers_share_a_root(tmp_path):
    """One folder holds several deployments told apart by their keys; several tiers sit
    side by side under ROOT (§1.1)."""
    a = build(tmp_path, spec(lmc_backend="fs", model_name="org/a"))
    b = build(tmp_path, spec(lmc_backend="fs", model_name="org/b", tp=2))
    c = build(tmp_path, spec(lmc_backend="local_disk", model_name="org/a"))  # another backend, same folder
    d = build(tmp_path, spec(lmc_backend="gds", lmc_tier="gds0"))
    every = [*a.block_files(), *b.block_files(), *c.block_files(), *d.block_files()]
    assert len(set(every)) == len(every) == 3 + 6 + 3 + 3
    assert {L.parse_name(r.split("/")[-1]).backend for r in every} == {"fs", "local_disk", "gds"}
    assert all((tmp_path / r).is_file() for r in every)


def test_gds_defects_name_the_pair(tmp_path):
    sp = spec(lmc_backend="gds", blocks=4, defects=("corrupt_sidecar", "orphan_data", "misfiled", "tmp"))
    result = build(tmp_path, sp)
    corrupt = result.defect("corrupt_sidecar")
    assert corrupt["relpath"].endswith(".metadata") and sorted(corrupt["statuses"].values()) == [
        "corrupt_sidecar", "orphan_data"]
    orphan = result.defect("orphan_data")
    assert not (tmp_path / (orphan["relpath"] + ".metadata")).exists()
    misfiled = result.defect("misfiled")
    assert len(misfiled["rows"]) == 2 and all(s == "misfiled" for s in misfiled["statuses"].values())
    tmp = result.defect("tmp")
    assert [L.parse_temp_name(r.split("/")[-1]).final.endswith(".metadata") for r in tmp["rows"]] == [False, True]


@pytest.mark.parametrize(("kw", "msg"), [
    (dict(lmc_backend="mp", lmc_era="lmc-k3"), "MP backend"),
    (dict(lmc_backend="fs", lmc_era="lmc-mp1"), "MP backend"),
    (dict(lmc_backend="gds", lmc_era="lmc-k2", lmc_gds_names="quoted"), "0.4.3"),
    (dict(lmc_backend="gds", lmc_gds_names="legacy", model_name="org/my_model"), "'_'"),
    (dict(lmc_backend="local_disk", defects=("tmp",)), "backend"),
    (dict(lmc_backend="fs", lmc_fs_header=False, defects=("header_invalid",)), "headers"),
    (dict(lmc_tags=("nopercent",)), "name%value"),
    (dict(model_name="a@b"), "'@'"),
    (dict(lmc_backend="mp", lmc_era="lmc-mp1", kv_kind="mla", lmc_save_only_first_rank=False), "MP has no"),
    (dict(defects=("missing_rank",)), "not one LMCache"),
    (dict(lmc_backend="gds", blocks=2, defects=("misfiled", "short", "tmp")), "at least 3 blocks"),
])
def test_combinations_no_writer_produces_are_refused(tmp_path, kw, msg):
    with pytest.raises(ValueError, match=msg):
        build(tmp_path, spec(**kw))


def test_cli_synth_lmcache_json(tmp_path):
    out = CliRunner().invoke(cli, ["synth", str(tmp_path), "--family", "lmcache", "--lmc-backend", "gds",
                                   "--kv-kind", "mla", "--tp", "4", "--lmc-all-ranks", "--blocks", "2",
                                   "--lmc-tags", "user%a", "--defects", "orphan_data", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    ns = doc["namespaces"][0]
    assert (ns["family"], ns["backend"], ns["scheme"], ns["ws"], ns["ranks"]) == ("lmcache", "gds", "lmc-k3", 4,
                                                                                  [0, 1, 2, 3])
    assert doc["defects"][0]["status"] == "orphan_data"
    text = CliRunner().invoke(cli, ["synth", str(tmp_path / "t"), "--family", "lmcache", "--lmc-backend", "mp",
                                    "--lmc-era", "lmc-mp1"])
    assert text.exit_code == 0 and "lmcache mp lmc-mp1" in text.output
