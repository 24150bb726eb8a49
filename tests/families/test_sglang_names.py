"""The SGLang HiCache file-name grammar (docs/sglang.md §1), one test per rule and era.

The names come from the synth (kvmigrate/synth/sglang.py, written from the released
HiCacheFile code independently of the family module) and, where the reference note lists
names the real 0.5.23 class produced, from that list (reference/sglang-format.md §1.1)."""

from __future__ import annotations

import pytest

from kvmigrate.families import sglang as fam
from kvmigrate.synth import SynthSpec
from kvmigrate.synth import sglang as synth

H = "ab" * 32


def reading_of(name: str, **facts) -> fam.Reading:
    page = fam.parse_page_name(name)
    assert page is not None, name
    return fam.read_suffix(page.suffix, page.pool, **facts)


@pytest.mark.parametrize("tp", range(1, 9))
def test_e4_non_mla_tp_suffix_at_every_tp_size(tp):
    spec = SynthSpec(family="sglang", tp=tp, model_name="meta-llama/Llama-3.1-8B")
    for r in range(tp):
        got = reading_of(synth.name(spec, H, era="e4", tp_rank=r))
        assert (got.era, got.model, got.tp, got.pp) == ("e4", "meta-llama-Llama-3.1-8B", (r, tp), None)


def test_names_the_real_0_5_23_class_produced():
    """reference/sglang-format.md §1.1: the names of the real class, read back."""
    assert reading_of(f"{H}_meta-llama-Llama-3.1-8B_3_8.bin").tp == (3, 8)
    got = reading_of(f"{H}_meta-llama-Llama-3.1-8B_1_4_2_1.bin")
    assert (got.model, got.tp, got.pp) == ("meta-llama-Llama-3.1-8B", (1, 4), (2, 1))
    got = reading_of(f"{H}_deepseek-ai-DeepSeek-V3.bin")
    assert (got.model, got.tp, got.mla) == ("deepseek-ai-DeepSeek-V3", None, True)
    assert reading_of(f"{H}_x-y_cp1_2.bin").cp == (1, 2)
    got = reading_of(f"{H}_ds_tp4_dcp0_2_page64.bin")
    assert (got.model, got.dcp) == ("ds", (4, 0, 2, 64))
    page = fam.parse_page_name(f"{H}.mamba_ds_2_4_tp4_dcp0_2_page64.bin")
    assert page.pool == "mamba"
    got = fam.read_suffix(page.suffix, page.pool)
    assert (got.model, got.tp, got.dcp) == ("ds", (2, 4), (4, 0, 2, 64))
    assert fam.parse_page_name(f"{H}.indexer_deepseek-ai-DeepSeek-V3.bin").pool == "indexer"
    assert reading_of(f"{H}_.bin").model == ""  # MLA, model_name None
    assert reading_of(f"{H}_-models-My Model:v1_0_1.bin").model == "-models-My Model:v1"


def test_underscores_and_digits_survive_in_the_model_name():
    spec = SynthSpec(family="sglang", tp=2, model_name="org/Qwen2_5-7B_v2")
    got = reading_of(synth.name(spec, H, era="e4", tp_rank=1))
    assert (got.model, got.tp) == ("org-Qwen2_5-7B_v2", (1, 2))


def test_pp_pair_is_size_before_rank():
    spec = SynthSpec(family="sglang", tp=4, pp=2, layers=4, model_name="m")
    got = reading_of(synth.name(spec, H, era="e4", tp_rank=3, pp_rank=1))
    assert (got.tp, got.pp) == ((3, 4), (2, 1))
    assert got.worker() == (1 * 4 + 3, 8)  # stage 1, rank 3 of a TP4 x PP2 deployment


def test_mla_pp_stage_without_tp_pair():
    spec = SynthSpec(family="sglang", tp=8, pp=2, kv_kind="mla", model_name="ds")
    got = reading_of(synth.name(spec, H, era="e4", pp_rank=0))
    assert (got.tp, got.pp, got.mla) == (None, (2, 0), True)


def test_mamba_side_file_keeps_the_tp_suffix_under_mla():
    spec = SynthSpec(family="sglang", tp=4, kv_kind="mla", model_name="kimi", pools=("mamba",))
    kv = reading_of(synth.name(spec, H, era="e4"))
    mamba_name = synth.name(spec, H, era="e4", pool="mamba", tp_rank=2)
    assert mamba_name == f"{H}.mamba_kimi_2_4.bin"
    page = fam.parse_page_name(mamba_name)
    mamba = fam.read_suffix(page.suffix, page.pool, kv_kind="mla")
    assert (kv.tp, mamba.tp) == (None, (2, 4))


def test_dcp_suffix_embeds_the_tp_size():
    spec = SynthSpec(family="sglang", tp=4, dcp=2, kv_kind="mla", model_name="ds", block_tokens=64)
    got = reading_of(synth.name(spec, H, era="e4", dcp_rank=1))
    assert (got.model, got.tp, got.dcp) == ("ds", None, (4, 1, 2, 64))
    assert got.worker() == (1, 2)


def test_cp_suffix():
    spec = SynthSpec(family="sglang", tp=2, cp=2, model_name="m")
    got = reading_of(synth.name(spec, H, era="e4", tp_rank=1, cp_rank=1))
    assert (got.tp, got.cp) == ((1, 2), (1, 2))


def test_model_name_fact_decides_a_name_read_two_ways():
    """An MLA model whose name ends in `_0_1`: from the right the groups read as TP 0 of 1;
    the model_name fact reads them as part of the model."""
    spec = SynthSpec(family="sglang", tp=8, pp=2, kv_kind="mla", model_name="org/DeepSeek_V3_0_1")
    name = synth.name(spec, H, era="e4", pp_rank=1)
    greedy = reading_of(name)
    assert (greedy.model, greedy.tp) == ("org-DeepSeek_V3", (0, 1))
    decided = reading_of(name, model="org/DeepSeek_V3_0_1")
    assert (decided.model, decided.tp, decided.pp) == ("org-DeepSeek_V3_0_1", None, (2, 1))


def test_kv_kind_mla_fact_keeps_trailing_digits_in_the_model():
    got = reading_of(f"{H}_model_3_8.bin", kv_kind="mla")
    assert (got.model, got.tp) == ("model_3_8", None)


@pytest.mark.parametrize("era,kv_kind,tp,suffix", [
    ("e1", "full", 4, ""),  # every rank wrote the same name
    ("e2", "full", 1, ""),
    ("e2", "full", 4, "_2_4"),
    ("e2", "mla", 4, "_2_4"),  # per-rank MLA copies
    ("e3", "full", 4, "_2_4"),
    ("e3", "mla", 4, ""),  # only rank 0 writes
])
def test_e1_to_e3_names_carry_no_model(era, kv_kind, tp, suffix):
    spec = SynthSpec(family="sglang", sgl_era=era, tp=tp, kv_kind=kv_kind)
    name = synth.name(spec, H, era=era, tp_rank=2 if tp > 1 else 0)
    assert name == f"{H}{suffix}.bin"
    got = reading_of(name)
    assert (got.era, got.model) == ("e23", None)
    assert got.tp == ((2, 4) if suffix else None)


@pytest.mark.parametrize("name", [f".{'0f' * 16}.tmp", f"{H}_m_0_1.bin.tmp.4242.17.9a0c"])
def test_temp_files_of_both_eras(name):
    assert fam.is_temp(name)
    assert fam.FAMILY.claims_entry(name, False)


@pytest.mark.parametrize("name", ["config.json", f"{H}", f"{H}.txt", "ab" * 31 + ".bin", f"{H}.unknownpool_m.bin",
                                  f"{H}xyz.bin", f"{H[:-1]}G.bin"])
def test_names_that_are_no_page(name):
    assert fam.parse_page_name(name) is None


def test_a_folder_is_never_claimed():
    assert not fam.FAMILY.claims_entry(f"{H}_m_0_1.bin", True)
