"""Scanning LMCache tier directories (spec lmcache.md §1.1, §2.4, §3.2 rule 1, §4): tier
recognition, the manifest columns, every status synth's defect records expect (every
backend, era, MLA and GQA), the exit bits, mixed roots and what migrate plans (nothing yet),
on real trees built by `kvmigrate synth --family lmcache`."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest

from kvmigrate.classify import STATUS_BITS
from kvmigrate.formats import lmcache as L
from kvmigrate.synth import SynthSpec, build
from kvmigrate.synth import lmcache as S

from helpers import SMALL
from helpers.cli_helpers import run, run_json

LMC = dict(family="lmcache", layers=2, block_tokens=4, blocks=4)
COMBOS = [(b, e) for b in L.BACKENDS for e in L.SCHEMES if (b == "mp") == (e == "lmc-mp1")]
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def synth(root: Path, **kw):
    return build(root, SynthSpec(**{**LMC, **kw}))


def lmc(rows: dict) -> dict:
    return {k: r for k, r in rows.items() if r["family"] == "lmcache"}


def clean_status(backend: str, era: str) -> str:
    """What a whole chunk file (or sidecar) of a deployment is, from its name alone (§3.2 rule 1, §3.5)."""
    if era in ("lmc-k1", "lmc-k2"):
        return "stale_hash_recipe"
    return "index_lost" if backend == "local_disk" else "ok"


def expected_rows(root: Path, results) -> dict[str, str]:
    """relpath -> the status synth's records expect: every defect's statuses (a folder's
    for every file under it), every other chunk file clean."""
    want: dict[str, str] = {}
    for res in results:
        ns = res.namespaces[0]
        for blk in res.blocks:
            for rel in [*blk["files"].values(), *blk["sidecars"].values()]:
                if rel is not None:
                    want[rel] = clean_status(ns["backend"], ns["scheme"])
        for d in res.defects:
            for rel, status in d["statuses"].items():
                if (root / rel).is_dir() and not (root / rel).is_symlink():
                    for dirpath, _, names in os.walk(root / rel):
                        for n in names:
                            want[str((Path(dirpath) / n).relative_to(root))] = status
                else:
                    want[rel] = status
    return want


def check_statuses(root: Path, results, rows: dict) -> int:
    want = expected_rows(root, results)
    got = lmc(rows)
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    for rel, status in want.items():
        if status == "unreadable" and os.geteuid() == 0:
            continue  # root reads a mode-0 file
        assert got[rel]["status"] == status, (rel, got[rel]["status"], got[rel]["reason"])
        # a whole chunk the target reads in place is already_present at its own name; nothing else is placed
        # without target facts (a writer's own deployment is the default target)
        placed = got[rel]["action"] == "already_present" and got[rel]["target_relpath"] == rel
        assert (got[rel]["action"] == "none" or placed and status == "ok") and got[rel]["reason"]
    return len(want)


def restore_modes(results, root: Path) -> None:
    for res in results:
        for d in res.defects:
            if d["name"] == "unreadable":
                os.chmod(root / d["relpath"], 0o644)


# --- §1.1 recognition -------------------------------------------------------------------


@pytest.mark.parametrize("backend", L.BACKENDS)
def test_a_sub_folder_holding_chunk_names_is_a_tier(tmp_path, scan_root, backend):
    era = "lmc-mp1" if backend == "mp" else "lmc-k3"
    res = synth(tmp_path, lmc_backend=backend, lmc_era=era, tp=2, lmc_tier="hot")
    _, rows = scan_root(tmp_path)
    got = lmc(rows)
    assert got and set(got) == set(expected_rows(tmp_path, [res]))
    assert all(r["source_base"].startswith(f"lmcache:hot:{backend}:") for r in got.values())
    assert all(r["relpath"].startswith("hot/") for r in got.values())


@pytest.mark.parametrize("backend", L.BACKENDS)
def test_the_root_itself_is_a_tier(tmp_path, scan_root, backend):
    era = "lmc-mp1" if backend == "mp" else "lmc-k3"
    res = synth(tmp_path, lmc_backend=backend, lmc_era=era, tp=2, lmc_tier=".")
    _, rows = scan_root(tmp_path)
    got = lmc(rows)
    assert set(got) == set(rows) == set(expected_rows(tmp_path, [res]))
    assert {r["source_base"].split(":")[1] for r in got.values()} == {"."}


def test_gds_two_character_folders_belong_to_their_tier(tmp_path, scan_root):
    synth(tmp_path, lmc_backend="gds", lmc_era="lmc-k3", tp=2, lmc_tier=".")
    _, rows = scan_root(tmp_path)
    labels = {r["source_base"] for r in rows.values()}
    assert labels == {f"lmcache:.:gds:{MODEL}:lmc-k3:ws2:bfloat16"}  # no tier named after a <2> folder
    assert all(r["relpath"].count("/") == 2 for r in rows.values())


def test_a_folder_without_chunk_names_stays_foreign(tmp_path, scan_root):
    synth(tmp_path, lmc_backend="fs", lmc_era="lmc-k3")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "model@1@0@1a@half.txt").write_bytes(b"x")
    (tmp_path / ".kvmigrate").mkdir()
    shutil.copy(next((tmp_path / "cache").iterdir()), tmp_path / ".kvmigrate" / "copy.data")
    _, rows = scan_root(tmp_path)
    assert rows["notes/model@1@0@1a@half.txt"]["family"] is None
    assert rows["notes/model@1@0@1a@half.txt"]["status"] == "foreign"
    assert rows[".kvmigrate/copy.data"]["status"] == "own_artifact"
    assert rows[".kvmigrate/copy.data"]["family"] is None


def test_one_folder_may_hold_several_backends_and_deployments(tmp_path, scan_root):
    synth(tmp_path, lmc_backend="local_disk", lmc_era="lmc-k3", tp=2)
    synth(tmp_path, lmc_backend="fs", lmc_era="lmc-k3", kv_kind="mla", model_name="deepseek-ai/DeepSeek-V3", tp=4)
    synth(tmp_path, lmc_backend="fs", lmc_era="lmc-k2", tp=1, lmc_tier="other")
    _, rows = scan_root(tmp_path)
    labels = {r["source_base"] for r in lmc(rows).values()}
    assert labels == {f"lmcache:cache:local_disk:{MODEL.replace('/', '-')}:lmc-k3:ws2:bfloat16",
                      "lmcache:cache:fs:deepseek-ai/DeepSeek-V3:lmc-k3:ws1:bfloat16",
                      f"lmcache:other:fs:{MODEL}:lmc-k2:ws1:bfloat16"}


# --- §4 columns -------------------------------------------------------------------------


def test_rows_carry_the_deployment_label_model_rank_and_hash(tmp_path, scan_root):
    res = synth(tmp_path, lmc_backend="fs", lmc_era="lmc-k3", tp=2, lmc_tags=("user%alice",))
    _, rows = scan_root(tmp_path)
    label = f"lmcache:cache:fs:{MODEL}:lmc-k3:ws2:bfloat16:user%alice"
    for blk in res.blocks:
        for wid, rel in blk["files"].items():
            r = rows[rel]
            assert (r["family"], r["scheme"], r["source_base"], r["deployment"], r["target_base"]) == (
                "lmcache", "lmc-k3", label, label, label)
            assert (r["model_name"], r["rank"], r["group"], r["target_profile"]) == (MODEL, wid, 0, "lmcache-0.5.6")
            assert r["block_hash"] == int(blk["hex"], 16).to_bytes(8, "big", signed=True)
            assert (r["status"], r["action"]) == ("ok", "none")  # (its recipe waits for facts: needs_fact)


def test_mp_rows_take_the_global_rank_and_group(tmp_path, scan_root):
    res = synth(tmp_path, lmc_backend="mp", lmc_era="lmc-mp1", tp=4)
    _, rows = scan_root(tmp_path)
    for blk in res.blocks:
        for wid, rel in blk["files"].items():
            r = rows[rel]
            assert r["source_base"] == f"lmcache:cache:mp:{MODEL}:lmc-mp1:ws4:g0"
            assert (r["rank"], r["group"], r["status"]) == (wid, 0, "ok")
            assert r["block_hash"] == bytes.fromhex(blk["hex"])


def test_verify_hash_fills_content_and_the_payload_after_a_header(tmp_path, scan_root):
    res = synth(tmp_path, lmc_backend="gds", lmc_era="lmc-k3", tp=1)
    _, rows = scan_root(tmp_path, verify="hash")
    import xxhash

    for blk in res.blocks:
        rel = blk["files"][0]
        data = (tmp_path / rel).read_bytes()
        assert rows[rel]["content_xxh3_128"] == xxhash.xxh3_128_digest(data)
        assert rows[rel]["payload_xxh3_128"] == xxhash.xxh3_128_digest(data[4096:])


# --- statuses ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", L.BACKENDS)
def test_every_defect_gets_synths_status(tmp_path, scan_root, backend):
    era = "lmc-mp1" if backend == "mp" else "lmc-k3"
    defects = tuple(d for d, bs in S.DEFECTS.items() if backend in bs)
    res = synth(tmp_path, lmc_backend=backend, lmc_era=era, tp=2, blocks=10, defects=defects)
    try:
        _, rows = scan_root(tmp_path)
        assert check_statuses(tmp_path, [res], rows) > 20
    finally:
        restore_modes([res], tmp_path)


def synth_defects(**kw) -> tuple[str, ...]:
    """The defects synth injects into such a tier (it refuses those the era or backend cannot carry)."""
    out = []
    for d in S.DEFECTS:
        try:
            S.check(SynthSpec(**{**LMC, **kw, "defects": (d,)}))
        except ValueError:
            continue
        out.append(d)
    return tuple(out)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "mla"])
@pytest.mark.parametrize(("backend", "era"), COMBOS)
def test_every_defect_every_era_and_kind(tmp_path, scan_root, backend, era, kind):
    kw = dict(lmc_backend=backend, lmc_era=era, tp=2, blocks=10, kv_kind=kind)
    roots: dict[str, dict] = {"all": {}}
    if backend == "fs":
        roots["raw"] = {"lmc_fs_header": False}
    if kind == "mla" and backend in ("local_disk", "gds"):
        roots["copies"] = {"lmc_save_only_first_rank": False}
    for name, extra in roots.items():
        root = tmp_path / name
        defects = synth_defects(**kw, **extra)
        assert len(defects) >= 6
        res = synth(root, **kw, **extra, defects=defects)
        try:
            _, rows = scan_root(root)
            check_statuses(root, [res], rows)
        finally:
            restore_modes([res], root)


def test_fs_tier_without_headers_judges_sizes_by_the_mode(tmp_path, scan_root):
    res = synth(tmp_path, lmc_backend="fs", lmc_era="lmc-k3", tp=2, blocks=8, lmc_fs_header=False,
                defects=("short", "size_mismatch", "zero_filled"))
    _, rows = scan_root(tmp_path)
    check_statuses(tmp_path, [res], rows)
    _, rows = scan_root(tmp_path, verify="none")  # sizes alone: the mode still decides short and longer
    got = {d["name"]: rows[d["relpath"]]["status"] for d in res.defects}
    assert got == {"short": "short", "size_mismatch": "size_mismatch", "zero_filled": "ok"}


def test_index_lost_is_every_local_disk_chunk(tmp_path, scan_root):
    synth(tmp_path, lmc_backend="local_disk", lmc_era="lmc-k3", kv_kind="mla", tp=4, lmc_save_only_first_rank=False)
    _, rows = scan_root(tmp_path)
    got = lmc(rows)
    assert len(got) == 4 * 4 and {r["status"] for r in got.values()} == {"index_lost"}
    assert "(§3.5)" in next(iter(got.values()))["reason"]


@pytest.mark.parametrize("era", ["lmc-k1", "lmc-k2"])
@pytest.mark.parametrize("backend", ["local_disk", "fs", "gds"])
def test_k1_and_k2_names_are_stale_by_name(tmp_path, scan_root, backend, era):
    synth(tmp_path, lmc_backend=backend, lmc_era=era, tp=2)
    _, rows = scan_root(tmp_path)
    got = lmc(rows)
    assert got and {r["status"] for r in got.values()} == {"stale_hash_recipe"}


def test_a_64_hex_k3_hash_is_stale_by_name(tmp_path, scan_root):
    res = synth(tmp_path, lmc_backend="fs", lmc_era="lmc-k3", tp=1, blocks=3)
    rel = res.blocks[0]["files"][0]
    key = L.parse_name(rel.split("/")[-1]).key
    digest = dataclasses.replace(key, hash="ab" * 32)
    new = "cache/" + L.file_name(digest, "fs")
    os.rename(tmp_path / rel, tmp_path / new)
    _, rows = scan_root(tmp_path)
    assert rows[new]["status"] == "stale_hash_recipe" and "64-hex" in rows[new]["reason"]
    assert rows[res.blocks[1]["files"][0]]["status"] == "ok"


def test_a_sidecar_without_its_data_file_is_orphan_data(tmp_path, scan_root):
    res = synth(tmp_path, lmc_backend="gds", lmc_era="lmc-k3", tp=1, blocks=3)
    blk = res.blocks[0]
    os.unlink(tmp_path / blk["files"][0])
    _, rows = scan_root(tmp_path)
    assert rows[blk["sidecars"][0]]["status"] == "orphan_data"


def test_a_v0_safetensors_pt_is_unsupported(tmp_path, scan_root):
    res = synth(tmp_path, lmc_backend="local_disk", lmc_era="lmc-k1", tp=1, blocks=3)
    rel = res.blocks[0]["files"][0]
    header = b'{"kv": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}'
    (tmp_path / rel).write_bytes(len(header).to_bytes(8, "little") + header + b"\x01" * 4)
    _, rows = scan_root(tmp_path)
    assert rows[rel]["status"] == "unsupported_layout" and "v0" in rows[rel]["reason"]


def test_a_temp_of_the_root_tier_is_a_leftover(tmp_path, scan_root):
    res = synth(tmp_path, lmc_backend="fs", lmc_era="lmc-k3", lmc_tier=".", blocks=3, defects=("tmp",))
    _, rows = scan_root(tmp_path)
    (d,) = res.defects
    assert rows[d["relpath"]]["status"] == "tmp_leftover"
    assert rows[d["relpath"]]["source_base"] == "lmcache:."


# --- exit bits, audit, report, migrate ------------------------------------------------------


@pytest.mark.parametrize(("backend", "era", "defects", "code"), [
    ("fs", "lmc-k3", (), 0),
    ("mp", "lmc-mp1", (), 0),
    ("gds", "lmc-k3", (), 0),
    ("local_disk", "lmc-k3", (), 1),  # index_lost
    ("fs", "lmc-k2", (), 1),  # stale_hash_recipe
    ("gds", "lmc-k3", ("orphan_data",), 1),
    ("gds", "lmc-k3", ("corrupt_sidecar",), 1 | 4),
    ("fs", "lmc-k3", ("header_invalid",), 1 | 4),
])
def test_audit_exit_codes(tmp_path, backend, era, defects, code):
    synth(tmp_path, lmc_backend=backend, lmc_era=era, tp=2, blocks=4, defects=defects)
    rc, out = run("audit", tmp_path)
    assert rc == code, out


def test_new_statuses_carry_the_spec_bits():
    assert {s: STATUS_BITS[s] for s in ("index_lost", "stale_hash_recipe", "unreproducible_hash", "orphan_data",
                                        "corrupt_sidecar")} == {
        "index_lost": 1, "stale_hash_recipe": 1, "unreproducible_hash": 1, "orphan_data": 1, "corrupt_sidecar": 5}


def test_the_report_counts_the_local_disk_leak(tmp_path):
    res = synth(tmp_path / "root", lmc_backend="local_disk", lmc_era="lmc-k3", tp=2, blocks=4)
    size = sum((tmp_path / "root" / rel).stat().st_size for blk in res.blocks for rel in blk["files"].values())
    rc, _ = run("scan", tmp_path / "root", "-o", tmp_path / "m.parquet")
    assert rc == 1
    rc, summary = run_json("report", tmp_path / "m.parquet")
    assert summary["totals"]["by_status"]["index_lost"] == {"files": 8, "bytes": size}
    rc, text = run("report", tmp_path / "m.parquet")
    assert "index_lost" in text and "local_disk" in text


def test_migrate_plans_nothing_for_a_tier_whose_recipe_waits_for_facts(tmp_path):
    root = tmp_path / "root"
    synth(root, lmc_backend="fs", lmc_era="lmc-k3", tp=2, blocks=4)
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    rc, out = run("migrate", root)
    assert rc == 0, out
    assert "nothing to do" in out
    rc, out = run("migrate", root, "--apply")
    assert rc == 0 and "created 0" in out, out
    after = sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".kvmigrate" not in p.parts)
    assert after == before


# --- mixed roots --------------------------------------------------------------------------


def _others(root: Path) -> None:
    for fam in ("vllm", "llmd", "vllmcpp", "sglang"):
        build(root, SynthSpec(**{**SMALL, "family": fam, "tp": 2}))


KEEP = ("family", "scheme", "model_name", "source_base", "deployment", "target_base", "rank", "group", "block_hash",
        "size", "status", "action", "reason", "target_relpath")


def test_tiers_beside_other_families_leave_their_rows_unchanged(tmp_path, scan_root):
    plain, mixed = tmp_path / "plain", tmp_path / "mixed"
    for root in (plain, mixed):
        root.mkdir()
        _others(root)
    res = [synth(mixed, lmc_backend="fs", lmc_era="lmc-k3", tp=2, lmc_tier="lmc-fs"),
           synth(mixed, lmc_backend="local_disk", lmc_era="lmc-k3", tp=2, lmc_tier="."),
           synth(mixed, lmc_backend="gds", lmc_era="lmc-k3", tp=2, lmc_tier=".")]
    _, a = scan_root(plain)
    _, b = scan_root(mixed)
    assert {r["family"] for r in a.values()} >= {"llmd", "vllmcpp", "sglang"}
    assert set(b) - set(lmc(b)) == set(a)
    for rel, r in a.items():
        assert {k: b[rel][k] for k in KEEP} == {k: r[k] for k in KEEP}, rel
    assert set(lmc(b)) == set(expected_rows(mixed, res))


def test_report_findings_speak_of_tiers(tmp_path):
    root = tmp_path / "root"
    synth(root, lmc_backend="gds", lmc_era="lmc-k3", tp=2, blocks=6, defects=("zero_filled", "corrupt_sidecar", "tmp"))
    rc, _ = run("scan", root, "-o", tmp_path / "m.parquet")
    assert rc == 5
    rc, summary = run_json("report", tmp_path / "m.parquet")
    words = {f["status"]: f["message"] for f in summary["findings"] if "status" in f}
    assert "LMCache GDS sidecars" in words["corrupt_sidecar"]
    assert "all-zero LMCache chunk files" in words["zero_filled"]
    assert "interrupted LMCache writes" in words["tmp_leftover"] and "prune moves" not in words["tmp_leftover"]
