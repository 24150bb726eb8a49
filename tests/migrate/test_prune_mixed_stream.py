"""Prune's selection of a manifest that mixes directory-layout families with LMCache tiers
and Mooncake stores (one root holding more than one engine's cache), streamed kind by
kind (`prune._picked_mixed`, `prune._reclaimable_streams`), equals its selection over the
manifest's columns whole (`prune._picked_whole`, `_reclaimable_whole`, the reference):
the plan's items in order (targets, kept folders, pair keys, quarantine suffix, objects),
the retires and proofs, the skipped, emptied and target namespaces, for every class, with
and without the engine-stopped statement and the quiet period; the reports' reclaimable
figures; for every namespace and half of them, in small batches. Each kind's rules still
read the whole manifest: a directory family's row naming a tier's file as its target
protects that file, and a superseded era's bytes may be held beside a store. A manifest
a kind's stream refuses is planned by the reference.
"""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_lmcache_prune import backdate
from test_prune_tier_stream import picked_by, same_plans

from kvmigrate import manifest as mf
from kvmigrate.migrate import prune, prune_stores
from kvmigrate.synth import SynthSpec, build

from helpers.cli_helpers import run

FACTS = ["--writer-release", "0.5.6", "--pythonhashseed", "0", "--kv-kind", "mla", "--model-dtype", "bfloat16"]
LLMD = dict(family="llmd", tp=2, kv_kind="mla", blocks=4)
LMC = dict(family="lmcache", layers=2, block_tokens=4, lmc_era="lmc-k3", tp=2)
MC = dict(family="mooncake", layers=2, block_tokens=4, tp=2, mc_bucket_keys=2)
GDS_TIER = {**LMC, "blocks": 8, "lmc_backend": "gds", "lmc_tier": "g",
            "defects": ("orphan_data", "corrupt_sidecar", "short", "misfiled")}
ALL = ("migrated", "unreadable_namespaces", "residue", "index_lost", "tails")
CLASSES = [(c,) for c in ALL] + [ALL]


def scan(root: Path, out: Path) -> str:
    code, text = run("scan", root, "--verify", "hash", "-o", out, "-q", *FACTS)
    assert code in (0, 1, 4, 5), text
    return str(out)


def picked(manifest: str, classes: tuple, chosen: set | None, streamed: bool, monkeypatch, *, now: float,
           quiet_period: float | None = None, engine_stopped: bool = False) -> tuple:
    meta = mf.read_metadata(manifest)
    args = (manifest, meta, classes, meta["root"], None, None, now, chosen, quiet_period, engine_stopped)
    p = picked_by(prune._picked_mixed, args, streamed, monkeypatch)
    items = list(p.items)
    return (items, p.skipped, p.skip, p.target_bases, p.emptied, p.retires,
            prune_stores.proofs(items, p.retires, p.stores, engine_stopped))


def assert_same(manifest: str, monkeypatch, **kw) -> dict[str, int]:
    """Every class's plan equal, for every namespace and for half of them; the plan of all
    classes together: its items per kind of namespace."""
    return kinds_of(same_plans(picked, CLASSES, manifest, monkeypatch, **kw)[0], manifest)


def kinds_of(items, manifest: str) -> dict[str, int]:
    """The items of tiers, of stores and of the others (directory families, no namespace)."""
    meta = mf.read_metadata(manifest)
    tiers, stores = prune.tiers_.Tiers.of(meta).tier_of, prune_stores.Stores.of(meta).store_of
    kinds = {"tiers": 0, "stores": 0, "plain": 0}
    for i in items:
        kinds["tiers" if i.namespace in tiers else "stores" if i.namespace in stores else "plain"] += 1
    return kinds


def three_kinds(root: Path) -> None:
    """An llm-d deployment (migrated), an old era of another model, a GDS tier and a
    local_disk tier, a Mooncake bucket store: each with defects of its own."""
    build(root, SynthSpec(**{**LLMD, "defects": ("zero_filled", "tmp_vllm", "orphan_rank")}))
    build(root, SynthSpec(family="vllm", scheme="S1", kv_kind="mla", extra_fields={"future_key": 1},
                          model_name="org/old"))
    build(root, SynthSpec(family="vllm", scheme="S3", kv_kind="mla", model_name="org/old"))
    build(root, SynthSpec(**GDS_TIER))
    build(root, SynthSpec(**{**LMC, "blocks": 4, "lmc_backend": "local_disk", "lmc_tier": "ld",
                             "model_name": "org/x"}))
    build(root, SynthSpec(**{**MC, "blocks": 5, "defects": ("short", "orphan_data", "zero_filled")}))


def stray_temp_file(root: Path) -> None:
    """An SGLang temp file at the top of the root: of no namespace, the generic rules' residue."""
    (root / f".{'ab' * 16}.tmp").write_bytes(b"\1" * 8)


def test_three_kinds_of_cache_on_one_root_after_a_migration(tmp_path, monkeypatch):
    root = tmp_path / "root"
    three_kinds(root)
    code, out = run("migrate", root, "--apply", "--engine-stopped", *FACTS)
    assert code in (0, 4), out
    stray_temp_file(root)
    backdate(root)
    m = scan(root, tmp_path / "m.parquet")
    kinds = assert_same(m, monkeypatch)
    assert all(kinds.values()), kinds
    assert assert_same(m, monkeypatch, engine_stopped=True)["tiers"] > kinds["tiers"]  # the index_lost chunks
    assert assert_same(m, monkeypatch, quiet_period=600.0) == kinds


def test_the_quiet_period_skips_each_kind_s_unit(tmp_path, monkeypatch):
    """The store written just now is skipped whole; the backdated tiers and folders are not."""
    root = tmp_path / "root"
    three_kinds(root)
    backdate(root)
    for d, _, names in __import__("os").walk(root / "store"):
        for n in names:
            Path(d, n).touch()
    m = scan(root, tmp_path / "m.parquet")
    assert assert_same(m, monkeypatch, quiet_period=600.0)["stores"] > 0
    _, skipped, *_ = picked(m, ALL, None, True, monkeypatch, now=time.time(), quiet_period=600.0)
    assert [unit for unit, why in skipped.items() if "quiet period" in why] == ["mooncake:store"], skipped


def test_a_directory_row_naming_a_tier_s_file_as_its_target_protects_it(tmp_path, monkeypatch):
    root = tmp_path / "root"
    build(root, SynthSpec(**LLMD))
    build(root, SynthSpec(**{**LMC, "blocks": 4, "lmc_backend": "gds", "defects": ("zero_filled",)}))
    m = scan(root, tmp_path / "m.parquet")
    t = pq.read_table(m)
    status = t.column("status").cast(pa.string()).to_pylist()
    rel, src = t.column("relpath").to_pylist(), t.column("source_base").cast(pa.string()).to_pylist()
    victim = next(r for r, s in zip(rel, status) if s == "zero_filled")
    namer = next(k for k, (s, ns) in enumerate(zip(status, src)) if s == "ok" and ns and "lmcache" not in ns)
    tr = t.column("target_relpath").to_pylist()
    tr[namer] = victim
    pq.write_table(t.set_column(t.schema.get_field_index("target_relpath"), "target_relpath",
                                pa.array(tr, pa.string())), m)
    assert assert_same(m, monkeypatch) == {"tiers": 0, "stores": 0, "plain": 0}


def test_a_superseded_era_beside_a_store_and_tiers_without_directory_families(tmp_path, monkeypatch):
    old = tmp_path / "old"
    build(old, SynthSpec(family="vllm", scheme="S1", kv_kind="mla", extra_fields={"future_key": 1}))
    build(old, SynthSpec(family="vllm", scheme="S3", kv_kind="mla"))
    build(old, SynthSpec(**{**MC, "blocks": 3, "defects": ("orphan_data", "zero_filled")}))
    assert assert_same(scan(old, tmp_path / "old.parquet"), monkeypatch)["plain"] == 9  # its 8 blocks, config.json
    apart = tmp_path / "apart"
    build(apart, SynthSpec(**GDS_TIER))
    build(apart, SynthSpec(**{**MC, "blocks": 3, "mc_backend": "file_per_key", "defects": ("tmp_leftover",)}))
    stray_temp_file(apart)
    backdate(apart)
    kinds = assert_same(scan(apart, tmp_path / "apart.parquet"), monkeypatch)
    assert kinds["tiers"] and kinds["stores"] and kinds["plain"] == 1, kinds


def test_a_mixed_manifest_a_kind_s_stream_refuses_is_planned_by_the_reference(tmp_path):
    root = tmp_path / "root"
    build(root, SynthSpec(**LLMD))
    build(root, SynthSpec(**{**MC, "blocks": 3, "defects": ("orphan_data",)}))
    m = tmp_path / "m.parquet"
    scan(root, m)
    t = pq.read_table(m)
    store_files = [i for i, (ns, o) in enumerate(zip(t.column("source_base").cast(pa.string()).to_pylist(),
                                                     t.column("object_index").is_valid().to_pylist()))
                   if ns and ns.startswith("mooncake") and not o]
    pq.write_table(pa.concat_tables([t, t.take([store_files[-1]])]), m)  # a store file with two rows
    meta = mf.read_metadata(str(m))
    args = (str(m), meta, ("residue",), meta["root"], None, None, time.time(), None, None, False)
    assert prune._picked_mixed(*args) is None
    plan = prune.build_plan(str(m), ("residue",), force_live=True)
    assert list(plan.items) == list(prune._picked_whole(*args).items) and plan.items


@pytest.mark.parametrize("kind", ["tiers", "stores"])
def test_a_mixed_manifest_is_planned_on_disk(tmp_path, kind):
    root = tmp_path / "root"
    build(root, SynthSpec(**{**LLMD, "defects": ("zero_filled",)}))
    other = GDS_TIER if kind == "tiers" else {**MC, "blocks": 3, "defects": ("orphan_data", "zero_filled")}
    build(root, SynthSpec(**other))
    m = scan(root, tmp_path / "m.parquet")
    plan = prune.build_plan(m, ("residue",), force_live=True)
    assert isinstance(plan.items, prune.prune_spill.PlanFile)
    kinds = kinds_of(plan.items, m)
    assert kinds[kind] and kinds["plain"], kinds  # the other kind's residue and the directory family's
