"""SGLang pages written in one --hicache-mem-layout and read in another (docs/sglang.md
§2-3): `relayout` into --dest DIR when the geometry facts prove the page size, each
output compared with an independent oracle (numpy reshape + transpose of the source
page) and with what the 0.5.23 reference reader reads; without --dest the pages stay
pending; `needs_relayout` names the missing facts."""

from __future__ import annotations

import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from kvmigrate.synth import SynthSpec
from kvmigrate.synth import sglang as synth

from helpers.cli_helpers import run
from helpers.sglang_reader import HiCacheFile

SGL = {"family": "sglang", "blocks": 3, "layers": 2}


def _spec(**kw) -> SynthSpec:
    return SynthSpec(**{**SGL, **kw})


def _geometry_flags(spec: SynthSpec) -> list[str]:
    g = synth.geometry(spec)
    out = ["--layers", g["L"], "--page-tokens", g["P"], "--dtype-bytes", g["b"]]
    return out + (["--latent-dim", g["dim"]] if spec.kv_kind == "mla" else ["--kv-heads", g["H"], "--head-dim", g["D"]])


def _oracle(page: bytes, spec: SynthSpec, writer: str, target: str) -> bytes:
    """The page in the target layout, by numpy: the writer's shape, axes permuted to the target's."""
    g = synth.geometry(spec)
    L, P, b = g["L"], g["P"], g["b"]
    mla = spec.kv_kind == "mla"
    shapes = {  # sglang.md §2, an element = b bytes
        "layer_first": (L, P, 1, g["dim"], b) if mla else (2, L, P, g["H"], g["D"], b),
        "page_first": (P, L, 1, g["dim"], b) if mla else (2, P, L, g["H"], g["D"], b),
        "page_first_direct": (1, L, P, 1, g["dim"], b) if mla else (2, 1, L, P, g["H"], g["D"], b),
    }
    a = np.frombuffer(page, np.uint8).reshape(shapes[writer])
    if writer == "page_first_direct":
        a = a[0] if mla else a[:, 0]
    lp = (1, 0) if mla else (0, 2, 1)  # page_first order from layer_first order, and back
    rest = tuple(range(len(lp), a.ndim))
    if (writer == "page_first") != (target == "page_first"):
        a = a.transpose(lp + rest)
    if target == "page_first_direct":
        a = a[np.newaxis] if mla else a[:, np.newaxis]
    return np.ascontiguousarray(a).tobytes()


def _names(d) -> set[str]:
    return {n for n in os.listdir(d) if n != ".kvmigrate"}


def _scan(root, m, *flags) -> dict[str, dict]:
    code, out = run("scan", root, "-o", m, "-q", *flags)
    assert code & 2 == 0 and code & 8 == 0, out
    return {r["relpath"]: r for r in pq.read_table(m).to_pylist()}


@pytest.mark.parametrize("era,kv_kind,writer,target", [
    ("e4", "full", "layer_first", "page_first"),
    ("e4", "mla", "page_first", "layer_first"),
    ("e2", "full", "layer_first", "page_first"),
    ("e2", "mla", "layer_first", "page_first"),
    ("e4", "full", "page_first", "page_first_direct"),
])
def test_relayout_into_dest_is_the_permuted_page(synth_root, tmp_path, era, kv_kind, writer, target):
    spec = _spec(sgl_era=era, kv_kind=kv_kind, tp=2, sgl_layout=writer, model_name="org/m")
    root, res = synth_root(spec)
    before = {n: (root / n).read_bytes() for n in _names(root)}
    inodes = {n: os.lstat(root / n).st_ino for n in before}
    m = tmp_path / "m.parquet"
    facts = ["--kv-kind", kv_kind, "--writer-layout", writer, "--target-layout", target, "--model-name", "org/m",
             *_geometry_flags(spec)]
    rows = _scan(root, m, *facts)
    assert {r["action"] for r in rows.values() if r["finding"] != "replica_of_primary"} == {"relayout"}
    dest, journal = tmp_path / "dest", tmp_path / "journals"
    dest.mkdir()
    code, out = run("migrate", "--manifest", m, "--dest", dest, "--journal", journal, "--apply")
    assert code == 0, out
    mla = kv_kind == "mla"
    opened = set()
    for rank in range(spec.tp):
        reader = HiCacheFile(str(dest), model_name="org/m", tp_rank=rank, tp_size=2, is_mla_model=mla)
        for b in res[0].blocks:
            path = reader.path(b["hex"])
            opened.add(os.path.basename(path))
            source = before[b["files"][0 if mla else rank]]
            with open(path, "rb") as f:
                written = f.read()
            assert written == _oracle(source, spec, writer, target)
            if target != "page_first_direct":  # (the synth writes two layouts)
                want = synth.page_bytes(spec, b["hex"], tp_rank=0 if mla else rank, layout=target)
                assert reader.get(b["hex"], synth.page_size(spec)) == want
    assert _names(dest) == opened
    assert {n: (root / n).read_bytes() for n in _names(root)} == before  # sources untouched
    code, out = run("migrate", "--manifest", m, "--dest", dest, "--journal", journal, "--apply")
    assert code == 0 and "created 0" in out, out
    code, out = run("verify", dest, "--journal", journal)
    assert code == 0, out
    code, out = run("rollback", journal)
    assert code == 0, out
    assert _names(dest) == set()
    assert {n: os.lstat(root / n).st_ino for n in _names(root)} == inodes


def test_without_dest_a_relayout_stays_pending_naming_dest(synth_root, tmp_path):
    spec = _spec(tp=2, sgl_layout="layer_first", model_name="m")
    root, _ = synth_root(spec)
    before = _names(root)
    m = tmp_path / "m.parquet"
    _scan(root, m, "--writer-release", "0.5.13", *_geometry_flags(spec))
    code, out = run("migrate", "--manifest", m, "--apply")
    assert code == 0, out
    assert "skipped_needs_transform 6" in out and _names(root) == before
    code, out = run("migrate", "--manifest", m)
    assert "skipped needs_relayout: 6 blocks" in out and "rerun with --dest DIR" in out


def test_needs_relayout_names_the_missing_facts(synth_root, tmp_path):
    spec = _spec(tp=2, sgl_layout="layer_first", model_name="m")
    root, _ = synth_root(spec)
    rows = _scan(root, tmp_path / "m.parquet", "--writer-release", "0.5.13", "--layers", "2", "--dtype-bytes", "2")
    for r in rows.values():
        assert r["action"] == "needs_relayout" and r["finding"] == "needs_fact"
        assert r["asks"].split() == ["--page-tokens", "--head-dim", "--kv-heads"]
        assert "needs the geometry facts page_tokens, head_dim, kv_heads" in r["reason"]


def test_a_geometry_the_file_size_contradicts_is_a_size_mismatch(synth_root, tmp_path):
    spec = _spec(tp=2, sgl_layout="layer_first", model_name="m")
    root, _ = synth_root(spec)
    flags = _geometry_flags(spec)
    flags[flags.index("--head-dim") + 1] = 8  # twice the real head dim
    rows = _scan(root, tmp_path / "m.parquet", "--writer-release", "0.5.13", *flags)
    for r in rows.values():
        assert r["status"] == "size_mismatch" and r["action"] == "none"
        assert "the geometry gives" in r["reason"] and f"the file has {synth.page_size(spec)}" in r["reason"]


def test_page_first_direct_holds_layer_first_bytes_so_nothing_is_rewritten(synth_root, tmp_path):
    """[2, 1, L, P, H, D] is [2, L, P, H, D] with an axis of 1: the same bytes (numpy says
    so), so a layer_first page is read in place by a page_first_direct engine."""
    spec = _spec(tp=2, sgl_layout="layer_first", model_name="m")
    root, res = synth_root(spec)
    page = (root / res[0].blocks[0]["files"][0]).read_bytes()
    assert _oracle(page, spec, "layer_first", "page_first_direct") == page
    rows = _scan(root, tmp_path / "m.parquet", "--writer-layout", "layer_first", "--target-layout",
                 "page_first_direct")
    assert {r["action"] for r in rows.values()} == {"already_present"}


def test_mla_copies_that_differ_are_not_relayouted(synth_root, tmp_path):
    spec = _spec(sgl_era="e2", kv_kind="mla", tp=2, defects=("replica_differs",))
    root, res = synth_root(spec)
    m = tmp_path / "m.parquet"
    _scan(root, m, "--kv-kind", "mla", "--model-name", "org/m", *_geometry_flags(spec))  # copies not compared
    dest = tmp_path / "dest"
    dest.mkdir()
    code, out = run("migrate", "--manifest", m, "--dest", dest, "--journal", tmp_path / "j", "--apply")
    assert code == 4 and "MLA replicas differ (content)" in out, out
    bad = next(d["block"] for d in res[0].defects if d["name"] == "replica_differs")
    assert len(_names(dest)) == 2 and not any(n.startswith(bad) for n in _names(dest))


def test_the_report_says_a_relayout_needs_dest(synth_root, tmp_path):
    spec = _spec(tp=2, sgl_layout="layer_first", model_name="m")
    root, _ = synth_root(spec)
    m = tmp_path / "m.parquet"
    _scan(root, m, "--writer-release", "0.5.13", *_geometry_flags(spec))
    code, out = run("report", m)
    assert f"$ kvmigrate migrate --manifest {m} --dest <DIR> --apply" in out, out
    assert "a relayout keeps the page's file name" in out


@pytest.mark.parametrize("source", ["manifest", "root"])
def test_a_dry_run_says_what_waits_for_dest_and_prints_that_command(synth_root, tmp_path, source):
    # the dry run said "nothing to do: every reusable block is already in place" (exit 0)
    # while every page waited for --dest
    spec = _spec(tp=2, sgl_layout="layer_first", model_name="m")
    root, _ = synth_root(spec)
    flags = ["--writer-release", "0.5.13", *_geometry_flags(spec)]
    m = tmp_path / "m.parquet"
    _scan(root, m, *flags)
    args = ["--manifest", m] if source == "manifest" else [root, *flags]
    code, out = run("migrate", *args)
    assert code == 1, out
    assert "nothing to do" not in out
    size = synth.page_size(spec) * 6
    assert f"6 blocks ({size / 1024:.1f} KiB) wait for --dest DIR" in out, out
    (command,) = [line.removeprefix("to apply: ") for line in out.splitlines() if line.startswith("to apply: ")]
    assert command.startswith(f"kvmigrate migrate {f'--manifest {m}' if source == 'manifest' else root} ")
    assert command.endswith(" --dest <DIR> --apply") and all(str(f) in command.split() for f in args)
    dest = tmp_path / "dest"
    dest.mkdir()
    code, out = run(*command.replace("<DIR>", str(dest)).split()[1:], "--journal", tmp_path / "j")
    assert code == 0 and "created 6" in out, out
