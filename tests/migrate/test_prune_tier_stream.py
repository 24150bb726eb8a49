"""Prune's selection of LMCache tiers streamed (migrate/prune_tier_stream.py) equals its
selection over the manifest's columns whole (`prune._picked_whole`, the reference): the
plan's items in order (with their targets and kept folders), the skipped and emptied
namespaces, for every class of a tier: migrated chunks (a reshard's sources with their
sidecars, an MLA chunk's old name), residue of every defect with its GDS partner, stale
deployments, index_lost chunks with and without the statement, --only/--exclude, the
quiet period, a file some row names as its target, and state carried across batch
borders (batches of 5 rows, lookups in parts).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_lmcache_prune import backdate

from kvmigrate import manifest as mf
from kvmigrate.migrate import prune, prune_spill, prune_stream
from kvmigrate.synth import SynthSpec, build

from helpers.cli_helpers import run

LMC = dict(family="lmcache", layers=2, block_tokens=4, blocks=6)
RECIPE = ["--writer-release", "0.5.6", "--pythonhashseed", "0"]
GEOMETRY = ["--total-kv-heads", "8", "--head-dim", "4", "--layers", "2", "--latent-dim", "8"]
CLASSES = [("migrated",), ("unreadable_namespaces",), ("residue",), ("index_lost",),
           ("migrated", "unreadable_namespaces", "residue", "index_lost")]


def synth(root: Path, **kw):
    era = "lmc-mp1" if kw.get("lmc_backend") == "mp" else "lmc-k3"
    return build(root, SynthSpec(**{**LMC, "lmc_era": era, **kw}))


def scan(root: Path, out: Path, *flags: str) -> str:
    code, text = run("scan", root, "--verify", "hash", "-o", out, "-q", *RECIPE, *flags)
    assert code in (0, 1, 5), text
    return str(out)


def small_batches(monkeypatch) -> None:
    """Batches of 5 rows, lookups in 4 parts, the plan's spill in ranges of 7 rows, runs of
    3, its file in batches of 4: state carried across every border."""
    monkeypatch.setattr(prune_stream, "BATCH", 5)
    monkeypatch.setattr(prune_stream, "LOOKUP_PARTS", 4)
    monkeypatch.setattr(prune_spill, "MIN_RANGE", 7)
    monkeypatch.setattr(prune_spill, "RUN_BATCH", 3)
    monkeypatch.setattr(prune_spill, "OUT_BATCH", 4)


def picked(manifest: str, classes: tuple, chosen: set | None, streamed: bool, monkeypatch, *, now: float,
           quiet_period: float | None = None, engine_stopped: bool = False) -> tuple:
    meta = mf.read_metadata(manifest)
    args = (manifest, meta, classes, meta["root"], None, None, now, chosen, quiet_period, engine_stopped)
    p = picked_by(prune._picked_tiers, args, streamed, monkeypatch)
    return list(p.items), p.skipped, p.skip, p.target_bases, p.emptied


def picked_by(stream, args: tuple, streamed: bool, monkeypatch):
    """`prune._picked_whole(*args)`, or the stream's (`prune._picked_tiers`, `_picked_stores`)
    in small batches, its plan on disk and its tally its items'."""
    if not streamed:
        return prune._picked_whole(*args)
    small_batches(monkeypatch)
    p = stream(*args)
    assert p is not None and isinstance(p.items, prune_spill.PlanFile)
    classes = args[2]
    assert p.items.tally(classes) == prune.reclaim_totals(prune._rows_of_items(p.items), classes)
    return p


def assert_same(manifest: str, monkeypatch, **kw) -> int:
    """Every class's plan equal, for every namespace and for half of them; the items of
    all classes together."""
    return len(same_plans(picked, CLASSES, manifest, monkeypatch, **kw)[0])


def same_plans(picked, classes_to_try: list, manifest: str, monkeypatch, **kw) -> tuple:
    """`picked` streamed equals `picked` whole for each of `classes_to_try`, for every
    namespace and for half of them; the last whole plan."""
    names = sorted(mf.read_metadata(manifest)["namespaces"])
    kw["now"] = time.time()  # (one clock for both: the quiet period's words name an age)
    same_figures(manifest, names, kw["now"], monkeypatch)
    whole: tuple = ()
    for classes in classes_to_try:
        whole = picked(manifest, classes, None, False, monkeypatch, **kw)
        assert picked(manifest, classes, None, True, monkeypatch, **kw) == whole, classes
        some = set(names[::2])
        assert picked(manifest, classes, some, True, monkeypatch, **kw) == \
            picked(manifest, classes, some, False, monkeypatch, **kw), classes
    return whole


def same_figures(manifest: str, names: list[str], now: float, monkeypatch) -> None:
    """The reports' reclaimable figures streamed kind by kind (`prune._reclaimable_streams`,
    small batches) equal those over the columns whole, for every namespace and half of them."""
    meta = mf.read_metadata(manifest)
    used = prune._used_namespaces(meta["root"], None)

    def figures(how, namespaces: set | None) -> tuple:
        per_class, per_ns, totals, skipped = how(manifest, meta, meta["root"], used, now, namespaces)
        return per_class, sorted(per_ns.items(), key=prune.namespace_order), totals, skipped

    for namespaces in (None, set(names[::2])):
        whole = figures(prune._reclaimable_whole, namespaces)
        with monkeypatch.context() as m:
            small_batches(m)
            assert figures(prune._reclaimable_streams, namespaces) == whole, namespaces


@pytest.mark.parametrize("backend", ["fs", "gds"])
def test_a_placed_reshard_s_sources_with_their_sidecars(tmp_path, backend, monkeypatch):
    root = tmp_path / "root"
    synth(root, lmc_backend=backend, tp=2)
    flags = [*RECIPE, "--target-tp", "4", *GEOMETRY]
    assert run("migrate", root, *flags, "--apply")[0] == 0
    m = scan(root, tmp_path / "m.parquet", "--target-tp", "4", *GEOMETRY)
    assert assert_same(m, monkeypatch) > 0


def test_an_mla_chunk_s_old_name_never_its_target(tmp_path, monkeypatch):
    root = tmp_path / "root"
    synth(root, lmc_backend="fs", tp=2, kv_kind="mla")
    flags = ["--target-tp", "2", "--no-target-save-only-first-rank", *GEOMETRY]
    assert run("migrate", root, *RECIPE, *flags, "--apply")[0] == 0
    assert assert_same(scan(root, tmp_path / "m.parquet", *flags), monkeypatch) > 0


@pytest.mark.parametrize("backend", ["gds", "fs", "local_disk", "mp"])
def test_residue_of_every_defect_with_its_gds_partner(tmp_path, backend, monkeypatch):
    from kvmigrate.synth.lmcache import DEFECTS

    root = tmp_path / "root"
    defects = tuple(d for d, backends in DEFECTS.items() if backend in backends and d != "layerwise")
    synth(root, lmc_backend=backend, tp=2, blocks=12, defects=defects, lmc_tier="." if backend == "gds" else "cache")
    m = scan(root, tmp_path / "m.parquet")
    assert assert_same(m, monkeypatch) > 0


def test_stale_and_live_deployments_of_two_tiers(tmp_path, monkeypatch):
    root = tmp_path / "root"
    synth(root, lmc_backend="fs", lmc_era="lmc-k2", lmc_tier="t")
    synth(root, lmc_backend="fs", lmc_tier="t", model_name="org/new", defects=("zero_filled",))
    synth(root, lmc_backend="gds", lmc_tier="q", defects=("short", "orphan_data"))
    backdate(root / "t")
    m = scan(root, tmp_path / "m.parquet")
    assert assert_same(m, monkeypatch) > 0
    assert assert_same(m, monkeypatch, quiet_period=600) > 0  # (tier q is live: skipped whole)


def test_index_lost_with_and_without_the_statement(tmp_path, monkeypatch):
    root = tmp_path / "root"
    synth(root, lmc_backend="local_disk", lmc_tier="ld", tp=2)
    synth(root, lmc_backend="local_disk", lmc_tier="other", model_name="org/x", defects=("short",))
    m = scan(root, tmp_path / "m.parquet")
    assert assert_same(m, monkeypatch) > 0
    assert assert_same(m, monkeypatch, engine_stopped=True) > 0


def test_a_file_named_as_a_target_is_protected(tmp_path, monkeypatch):
    """A residue file some row names as its target stays (`prune_tiers.protected`), and
    so does its GDS partner."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "root"
    synth(root, lmc_backend="gds", defects=("corrupt_sidecar", "zero_filled"))
    m = scan(root, tmp_path / "m.parquet")
    t = pq.read_table(m)
    status = t.column("status").cast(pa.string()).to_pylist()
    rel = t.column("relpath").to_pylist()
    victims = [r for r, s in zip(rel, status) if s in ("corrupt_sidecar", "zero_filled")]
    assert victims
    namer = next(k for k, s in enumerate(status) if s == "ok")
    tr = t.column("target_relpath").to_pylist()
    tr[namer] = victims[0]
    t = t.set_column(t.schema.get_field_index("target_relpath"), "target_relpath", pa.array(tr, pa.string()))
    pq.write_table(t, m)
    assert assert_same(m, monkeypatch) > 0


def test_a_manifest_with_another_family_is_not_for_this_path(tmp_path):
    root = tmp_path / "root"
    synth(root, lmc_backend="fs")
    build(root, SynthSpec(family="llmd", tp=2, kv_kind="mla", blocks=2))
    m = scan(root, tmp_path / "m.parquet", "--kv-kind", "mla", "--model-dtype", "bfloat16")
    meta = mf.read_metadata(m)
    args = (m, meta, ("residue",), meta["root"], None, None, time.time(), None, None, False)
    assert prune._picked_tiers(*args) is None
