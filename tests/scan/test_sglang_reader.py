"""End to end against the 0.5.23 reader (tests/helpers/sglang_reader.py): what the scan calls
`already_present` is what SGLang 0.5.23 reads, with the bytes the writer stored; a
planned `link` target is the name it opens (placed here by hand: a check of the scan alone;
tests/migrate/test_sglang_migrate.py lets migrate place them), after which a rescan finds
it already present."""

from __future__ import annotations

import os

import pytest

from kvmigrate.synth import SynthSpec
from kvmigrate.synth import sglang as synth

from helpers.sglang_reader import HiCacheFile

SGL = {"family": "sglang", "blocks": 3, "layers": 2}


def _spec(**kw) -> SynthSpec:
    return SynthSpec(**{**SGL, **kw})


def test_already_present_pages_are_read_by_0_5_23_with_the_written_bytes(synth_root, scan_root):
    spec = _spec(tp=4, model_name="meta-llama/Llama-3.1-8B")
    root, res = synth_root(spec)
    _, rows = scan_root(root, flags={"writer_release": "0.5.20"})
    present = {k for k, r in rows.items() if r["action"] == "already_present"}
    read = set()
    for r in range(4):
        reader = HiCacheFile(str(root), model_name=spec.model_name, tp_rank=r, tp_size=4)
        for b in res[0].blocks:
            got = reader.get(b["hex"], synth.page_size(spec))
            assert got == synth.page_bytes(spec, b["hex"], tp_rank=r, layout="page_first")
            read.add(os.path.basename(reader.path(b["hex"])))
    assert read == present and len(present) == 12


def test_mla_pp_stages_and_mamba_side_files(synth_root, scan_root):
    spec = _spec(tp=4, pp=2, kv_kind="mla", model_name="kimi", pools=("mamba",))
    root, res = synth_root(spec)
    _, rows = scan_root(root, flags={"writer_layout": "page_first", "kv_kind": "mla"})
    present = {k for k, r in rows.items() if r["action"] == "already_present"}
    read = set()
    for pp_rank in range(2):
        for tp_rank in range(4):  # every rank reads the one MLA file; the mamba file is its own
            reader = HiCacheFile(str(root), model_name="kimi", tp_rank=tp_rank, tp_size=4, pp_rank=pp_rank,
                                 pp_size=2, is_mla_model=True)
            for b in res[0].blocks:
                if b["pool"] is None:
                    assert reader.get(b["hex"], synth.page_size(spec)) == synth.page_bytes(
                        spec, b["hex"], pp_rank=pp_rank, layout="page_first")
                read.add(os.path.basename(reader.path(b["hex"], b["pool"])))
    assert read == present


@pytest.mark.parametrize("era,kv_kind,tp", [("e2", "full", 2), ("e2", "full", 1), ("e3", "mla", 4),
                                            ("e2", "mla", 2)])
def test_link_targets_are_the_names_0_5_23_opens(synth_root, scan_root, era, kv_kind, tp):
    spec = _spec(sgl_era=era, kv_kind=kv_kind, tp=tp)
    root, res = synth_root(spec)
    flags = {"kv_kind": kv_kind, "model_name": "org/m", "target_layout": "layer_first"}
    _, rows = scan_root(root, flags=flags, verify="hash")
    links = [r for r in rows.values() if r["action"] == "link"]
    assert len(links) == 3 * (1 if kv_kind == "mla" else tp)
    for r in links:  # what migrate --apply will do (link actions)
        os.link(root / r["relpath"], root / r["target_relpath"])
    mla = kv_kind == "mla"
    for rank in range(tp):
        reader = HiCacheFile(str(root), model_name="org/m", tp_rank=rank, tp_size=tp, is_mla_model=mla)
        for b in res[0].blocks:
            want = synth.page_bytes(spec, b["hex"], tp_rank=0 if mla else rank, layout="layer_first")
            assert reader.get(b["hex"], synth.page_size(spec)) == want
    _, again = scan_root(root, flags=flags, verify="hash")
    assert not [r for r in again.values() if r["action"] == "link"]  # a rerun plans nothing more
    assert sum(r["action"] == "already_present" for r in again.values()) >= len(links)


def test_a_size_mismatch_is_what_the_reader_refuses(synth_root, scan_root):
    spec = _spec(tp=2, model_name="m", defects=("size_mismatch",))
    root, res = synth_root(spec)
    _, rows = scan_root(root, flags={"writer_layout": "page_first"})
    d = res[0].defect("size_mismatch")
    assert rows[d["relpath"]]["status"] == "size_mismatch"
    reader = HiCacheFile(str(root), model_name="m", tp_rank=d["rank"], tp_size=2)
    with pytest.raises(IOError, match="Short read"):
        reader.get(d["block"], synth.page_size(spec))
