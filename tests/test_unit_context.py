"""One classification context (classify.UnitPlan) for the scan and the plan.

The scan classifies each block with the context of its walk unit (config.json, resolved
facts, target); the migration plan re-derives a transform's numbers from the context it
rebuilds from the manifest metadata (`outputs.transform_spec`). Both must be the same
context, for every writer family, era and parallelism synth builds.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvmigrate import manifest
from kvmigrate.context import unit_contexts
from kvmigrate.errors import UsageError
from kvmigrate.identity.facts import FactsResolver
from kvmigrate.migrate.plan import build_plan
from kvmigrate.options import ScanOptions
from kvmigrate.pipeline import scan
from kvmigrate.scan import build_units, list_root, resolve_namespaces

TARGET = "vllm-0.28"


def _cases() -> list[dict]:
    cases = []
    for scheme in ("S1", "S2", "S3"):
        for tp in (1, 2, 4):
            for kind in ("full", "mla"):
                cases.append(dict(family="vllm", scheme=scheme, tp=tp, kv_kind=kind))
    cases.append(dict(family="vllm", scheme="S3", tp=2, kv_kind="mla", replicated_layout=True))
    cases.append(dict(family="vllm", scheme="S3", tp=2, kv_kind="full", canonical_format="v1-nhd"))
    cases.append(dict(family="vllm", scheme="S3", tp=2, kv_kind="full", agnostic=True))
    for tp in (1, 2, 4):
        for kind in ("full", "mla"):
            for bpf in (1, 4):
                cases.append(dict(family="llmd", tp=tp, kv_kind=kind, blocks_per_file=bpf))
    cases.append(dict(family="llmd", tp=2, kv_kind="full", pp=2, defects=("pp_stage",)))
    for tp in (1, 2):
        for kind in ("full", "mla"):
            cases.append(dict(family="vllmcpp", tp=tp, kv_kind=kind))
    cases.append(dict(family="vllmcpp", tp=2, kv_kind="mla", defects=("digest_mismatch",)))
    cases.append(dict(family="vllm", scheme="S2", tp=2, kv_kind="mla", defects=("config_unparsable",)))
    return cases


def _id(case: dict) -> str:
    return "-".join(str(v) if k in ("family", "scheme", "kv_kind") else k if v is True
                    else f"{k}{'+'.join(v) if isinstance(v, tuple) else v}" for k, v in case.items())


def _flags(case: dict, facts: bool) -> dict:
    """The deployment facts of the synth tree (or none: kv kind and page geometry unknown)."""
    if not facts:
        return {}
    flags = {"kv_kind": case["kv_kind"], "page_bytes": 256, "model_dtype": "bfloat16"}
    if case["kv_kind"] == "full":
        flags.update(tensors_per_layer=2, total_kv_heads=8)
    return flags


@pytest.mark.parametrize("case", _cases(), ids=_id)
@pytest.mark.parametrize("verify", ["size", "hash"])
@pytest.mark.parametrize("facts", [True, False], ids=["facts", "no-facts"])
def test_scan_and_plan_build_the_same_context(case, verify, facts, synth_root, tmp_path):
    root, _ = synth_root(case)
    flags = _flags(case, facts)
    out = tmp_path / "m.parquet"
    scan(root, out, ScanOptions(facts_resolver=FactsResolver(flags, None), target=TARGET, verify=verify, threads=1))

    # the scan's contexts: the units it walks (the same calls as `scan.scan`)
    resolver = FactsResolver(flags, None)
    namespaces = resolve_namespaces(str(root), list_root(str(root)), resolver, TARGET)
    units = build_units(str(root), namespaces, verify == "hash", TARGET)
    scanned = {m.ns.source_base: u.plan for u in units for m in u.members}
    assert scanned, "the tree has namespaces"

    # the plan's contexts, rebuilt from the manifest's metadata (what `migrate.plan` calls)
    meta = manifest.read_metadata(out)
    planned = unit_contexts(meta["namespaces"], meta["verify"] == "hash")

    differ = {sb: [f.name for f in dataclasses.fields(ctx) if getattr(ctx, f.name) != getattr(planned[sb], f.name)]
              for sb, ctx in scanned.items()}
    assert {sb: d for sb, d in differ.items() if d} == {}


def test_a_transform_on_a_family_it_is_not_defined_for_is_refused(synth_root, tmp_path):
    """migration.md §1: slice cuts a vLLM row, concat and relayout read llm-d rank files.
    A manifest that asks a concat of a vllm.cpp MLA deployment (whose context gives kv kind
    mla, B = 1 and two ranks, all a concat checks) is refused, not applied."""
    root, _ = synth_root(dict(family="vllmcpp", tp=2, kv_kind="mla"))
    m = tmp_path / "m.parquet"
    scan(root, m, ScanOptions(facts_resolver=FactsResolver({}, None), threads=1))
    table = manifest.read_table(m).to_pylist()
    row = next(r for r in table if r["action"] == "rewrite_header")
    row["action"] = "concat"
    bad = tmp_path / "bad.parquet"
    with manifest.ManifestWriter(bad, manifest.read_metadata(m)) as w:
        w.write_columns({k: [r[k] for r in table] for k in table[0]})
    with pytest.raises(UsageError, match="concat is not defined for a vllmcpp namespace"):
        build_plan(bad)
