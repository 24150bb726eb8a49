"""Migrating SGLang HiCache `file` directories end to end (docs/sglang.md §3): synth
directory -> scan -> `migrate --apply` -> the 0.5.23 reference reader (tests/helpers/sglang_reader.py)
opens every reusable page, with the bytes the writer stored, and nothing else is made;
a rerun writes nothing, `verify` is clean, `rollback` restores the directory exactly
(names, bytes, the sources' inodes); `prune --migrated` takes the legacy names."""

from __future__ import annotations

import hashlib
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvmigrate.synth import SynthSpec
from kvmigrate.synth import sglang as synth

from helpers.cli_helpers import run
from helpers.sglang_reader import HiCacheFile

SGL = {"family": "sglang", "blocks": 3, "layers": 2}
OLD = ["--model-name", "org/m", "--target-layout", "layer_first"]  # e1-e3: no model in the name, layer_first


def _spec(**kw) -> SynthSpec:
    return SynthSpec(**{**SGL, **kw})


def _listing(d) -> dict[str, tuple[int, str]]:
    """name -> (inode, sha256 of the bytes) of the page files of a directory (kvmigrate's own folder left out)."""
    out = {}
    for name in os.listdir(d):
        p = os.path.join(d, name)
        if name != ".kvmigrate" and not os.path.islink(p) and os.path.isfile(p):
            with open(p, "rb") as f:
                out[name] = (os.lstat(p).st_ino, hashlib.sha256(f.read()).hexdigest())
    return out


def _read_all(d, spec: SynthSpec, res, *, model: str, layout: str, mla: bool) -> set[str]:
    """Every name the 0.5.23 reader opens for the deployment, every KV page checked
    byte for byte against the writer's; returns the names."""
    names = set()
    for rank in range(spec.tp):
        reader = HiCacheFile(str(d), model_name=model, tp_rank=rank, tp_size=spec.tp, is_mla_model=mla)
        for b in res.blocks:
            names.add(os.path.basename(reader.path(b["hex"], b["pool"])))
            if b["pool"] is None:
                want = synth.page_bytes(spec, b["hex"], tp_rank=0 if mla else rank, layout=layout)
                assert reader.get(b["hex"], synth.page_size(spec)) == want, (rank, b["hex"])
    return names


def _scan(root, m, *flags) -> None:
    code, out = run("scan", root, "-o", m, "-q", *flags)
    assert code & 2 == 0 and code & 8 == 0, out  # (findings and integrity bits: defects under test)


@pytest.mark.parametrize("era,kv_kind,tp", [("e2", "full", 2), ("e2", "full", 1), ("e3", "full", 2),
                                            ("e3", "mla", 4), ("e2", "mla", 2)])
def test_apply_places_every_page_the_0_5_23_reader_opens(synth_root, tmp_path, era, kv_kind, tp):
    spec = _spec(sgl_era=era, kv_kind=kv_kind, tp=tp)
    root, res = synth_root(spec)
    before = _listing(root)
    m = tmp_path / "m.parquet"
    _scan(root, m, "--kv-kind", kv_kind, *OLD)
    code, out = run("migrate", "--manifest", m, "--apply")
    assert code == 0, out
    mla = kv_kind == "mla"
    after = _listing(root)
    opened = _read_all(root, spec, res[0], model="org/m", layout="layer_first", mla=mla)
    assert set(after) - set(before) == opened  # every page it opens, nothing else
    assert len(opened) == 3 * (1 if mla else tp)
    assert {k: v for k, v in after.items() if k in before} == before  # sources untouched
    # a rerun of the same command writes nothing
    code, out = run("migrate", "--manifest", m, "--apply")
    assert code == 0, out
    assert "created 0, already_present " in out
    assert _listing(root) == after
    code, out = run("verify", root, "--journal", root / ".kvmigrate" / "journals")
    assert code == 0, out
    code, out = run("rollback", root / ".kvmigrate" / "journals")
    assert code == 0, out
    assert _listing(root) == before


@pytest.mark.parametrize("kv_kind,pools", [("full", ()), ("mla", ("mamba",))])
def test_e4_pages_are_linked_into_dest_as_a_complete_storage_dir(synth_root, tmp_path, kv_kind, pools):
    spec = _spec(tp=2, kv_kind=kv_kind, model_name="meta-llama/Llama-3.1-8B", pools=pools)
    root, res = synth_root(spec)
    before = _listing(root)
    m = tmp_path / "m.parquet"
    _scan(root, m, "--writer-release", "0.5.20", "--kv-kind", kv_kind)
    code, out = run("migrate", "--manifest", m, "--apply")  # in place: the engine reads them as they are
    assert code == 0 and "created 0" in out, out
    assert _listing(root) == before
    dest = tmp_path / "dest"
    dest.mkdir()
    journal = tmp_path / "journals"  # (the in-place run's journal is of another destination)
    code, out = run("migrate", "--manifest", m, "--dest", dest, "--journal", journal, "--apply")
    assert code == 0, out
    opened = _read_all(dest, spec, res[0], model=spec.model_name, layout="page_first", mla=kv_kind == "mla")
    got = _listing(dest)
    assert set(got) == opened == set(before)
    assert all(got[k][0] == before[k][0] for k in got)  # hard links of the sources
    code, out = run("verify", dest, "--journal", journal)
    assert code == 0, out
    code, out = run("rollback", journal)
    assert code == 0, out
    assert os.listdir(dest) == [] and _listing(root) == before


def test_zip_payloads_are_never_placed(synth_root, tmp_path):
    raw = _spec(sgl_era="e2", tp=2)
    root, res = synth_root(_spec(sgl_era="e2", tp=2, seed=1, defects=("zip_payload",)), raw)
    before = _listing(root)
    m = tmp_path / "m.parquet"
    _scan(root, m, "--kv-kind", "full", *OLD)
    code, out = run("migrate", "--manifest", m, "--apply")
    assert code == 0, out
    new = set(_listing(root)) - set(before)
    assert new == _read_all(root, raw, res[1], model="org/m", layout="layer_first", mla=False)
    zipped = {b["hex"] for b in res[0].blocks}
    assert not {n for n in new if n[:64] in zipped}


def test_mla_copies_the_majority_places_and_a_missing_copy_does_not_block(synth_root, tmp_path):
    spec = _spec(sgl_era="e2", kv_kind="mla", tp=4, defects=("replica_differs", "missing_rank"))
    root, res = synth_root(spec)
    m = tmp_path / "m.parquet"
    _scan(root, m, "--kv-kind", "mla", "--verify", "hash", *OLD)
    code, out = run("migrate", "--manifest", m, "--apply")
    assert code == 0, out
    assert _read_all(root, spec, res[0], model="org/m", layout="layer_first", mla=True) <= set(_listing(root))


def test_mla_copies_that_differ_are_not_placed_when_apply_compares_them(synth_root, tmp_path):
    spec = _spec(sgl_era="e2", kv_kind="mla", tp=2, defects=("replica_differs",))
    root, res = synth_root(spec)
    before = _listing(root)
    m = tmp_path / "m.parquet"
    _scan(root, m, "--kv-kind", "mla", *OLD)  # --verify size: the copies were not compared
    code, out = run("migrate", "--manifest", m, "--apply")
    assert code == 4, out
    bad = next(d["block"] for d in res[0].defects if d["name"] == "replica_differs")
    assert "replicas differ (content)" in out
    new = set(_listing(root)) - set(before)
    assert len(new) == 2 and not any(n.startswith(bad) for n in new)


def test_prune_takes_the_legacy_names_and_rollback_restores_them_first(synth_root, tmp_path):
    spec = _spec(sgl_era="e2", tp=2)
    root, res = synth_root(spec)
    before = _listing(root)
    m, m2 = tmp_path / "m.parquet", tmp_path / "m2.parquet"
    flags = ["--kv-kind", "full", "--writer-layout", "layer_first", *OLD]
    _scan(root, m, *flags)
    assert run("migrate", "--manifest", m, "--apply")[0] == 0
    _scan(root, m2, *flags)
    code, out = run("prune", root, "--manifest", m2, "--migrated", "--force-live", "--apply")
    assert code == 0, out
    opened = _read_all(root, spec, res[0], model="org/m", layout="layer_first", mla=False)
    assert set(_listing(root)) == opened  # only the names 0.5.23 opens are left
    code, out = run("rollback", root / ".kvmigrate" / "journals")
    assert code == 0, out
    assert _listing(root) == before


def test_plan_refuses_a_flat_target_that_is_no_page_name(synth_root, tmp_path):
    root, _ = synth_root(_spec(sgl_era="e2", tp=2))
    m = tmp_path / "m.parquet"
    _scan(root, m, "--kv-kind", "full", *OLD)
    t = pq.read_table(m)
    targets = [("sub/" + x if x else x) for x in t.column("target_relpath").to_pylist()]
    t = t.set_column(t.schema.get_field_index("target_relpath"), "target_relpath", pa.array(targets, pa.string()))
    pq.write_table(t.replace_schema_metadata(t.schema.metadata), m)
    code, out = run("migrate", "--manifest", m)
    assert code == 2, out
    assert "is not a page file name of the SGLang HiCache file backend directory" in out


def test_tree_namespaces_of_the_same_root_migrate_beside_it(tmp_path):
    root = tmp_path / "root"
    assert run("synth", root, "--family", "vllm", "--scheme", "S2", "--tp", "2", "--blocks", "2")[0] == 0
    assert run("synth", root, "--family", "sglang", "--sgl-era", "e2", "--tp", "2", "--blocks", "2")[0] == 0
    m = tmp_path / "m.parquet"
    _scan(root, m, "--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", *OLD)
    code, out = run("migrate", "--manifest", m, "--apply")
    assert code == 0, out
    assert "target namespace sglang:org-m:tp2: created 4" in out
    code, out = run("scan", root, "-o", tmp_path / "m2.parquet", "--kv-kind", "full", "--total-kv-heads", "8",
                    "--model-dtype", "bfloat16", *OLD)
    assert "already_present" in out  # the vLLM target was created too


@pytest.mark.parametrize("crash_at", ["intent:1", "created:3", "tmp_written:2"])
def test_kill_9_mid_apply_then_rerun_ends_like_an_uninterrupted_run(synth_root, tmp_path, crash_at):
    import subprocess
    import sys

    from kvmigrate.migrate.apply import CRASH_ENV

    spec = _spec(sgl_era="e2", tp=2)
    root, res = synth_root(spec)
    before = _listing(root)
    m = tmp_path / "m.parquet"
    _scan(root, m, "--kv-kind", "full", *OLD)
    mode = ["--mode", "copy"] if crash_at.startswith("tmp_written") else []  # (a copy writes a temp first)
    kvm = os.path.join(os.path.dirname(sys.executable), "kvmigrate")
    killed = subprocess.run([kvm, "migrate", "--manifest", str(m), "--apply", *mode], capture_output=True, text=True,
                            env={**os.environ, CRASH_ENV: crash_at}, timeout=120)
    assert killed.returncode == -9, killed.stderr
    code, out = run("migrate", "--manifest", m, "--apply", *mode)
    assert code == 0, out
    after = _listing(root)
    assert set(after) - set(before) == _read_all(root, spec, res[0], model="org/m", layout="layer_first", mla=False)
    assert not [n for n in os.listdir(root) if n.endswith(".tmp") or n == ".kvmigrate.lock"]
    code, out = run("rollback", root / ".kvmigrate" / "journals")
    assert code == 0, out
    assert _listing(root) == before


def test_only_selects_a_deployment_by_its_model_name_in_migrate_verify_and_rollback(synth_root, tmp_path):
    root, _ = synth_root(_spec(sgl_era="e3", tp=2))
    before = _listing(root)
    m = tmp_path / "m.parquet"
    _scan(root, m, "--kv-kind", "full", *OLD)
    assert run("migrate", "--manifest", m, "--only", "org-m", "--apply")[0] == 0
    assert len(_listing(root)) == 2 * len(before)
    journal = root / ".kvmigrate" / "journals"
    code, out = run("verify", root, "--journal", journal, "--only", "org-m")
    assert code == 0 and f"{len(before)} journaled blocks" in out, out
    code, out = run("rollback", journal, "--only", "org-m")
    assert code == 0 and f"removed {len(before)} blocks" in out, out
    assert _listing(root) == before


def test_the_copy_placed_is_one_the_majority_agrees_with_even_when_rank_0_differs(synth_root, tmp_path):
    spec = _spec(sgl_era="e2", kv_kind="mla", tp=4)
    root, res = synth_root(spec)
    first = root / res[0].blocks[0]["files"][0]  # rank 0's copy of one page: the odd one out
    data = bytearray(first.read_bytes())
    data[0] ^= 0xFF
    first.write_bytes(bytes(data))
    m = tmp_path / "m.parquet"
    _scan(root, m, "--kv-kind", "mla", "--verify", "hash", *OLD)
    code, out = run("migrate", "--manifest", m, "--apply")
    assert code == 0, out
    assert len(_read_all(root, spec, res[0], model="org/m", layout="layer_first", mla=True)) == 3


def test_rollback_of_a_rerun_of_one_manifest_keeps_the_first_runs_pages(synth_root, tmp_path):
    """The second --apply of one manifest finds every page present and creates none: its
    rollback removes nothing (its intent lists the pages the first run linked)."""
    spec = _spec(sgl_era="e2", kv_kind="full", tp=2)
    root, _ = synth_root(spec)
    m = tmp_path / "m.parquet"
    _scan(root, m, "--kv-kind", "full", *OLD)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    assert run("migrate", "--manifest", m, "--apply", "--journal", first)[0] == 0
    migrated = _listing(root)
    code, out = run("migrate", "--manifest", m, "--apply", "--journal", second)
    assert code == 0 and "created 0, already_present " in out, out
    code, out = run("rollback", second)
    assert code == 0 and "removed 0 blocks" in out, out
    assert _listing(root) == migrated
