"""Prune's selection of Mooncake stores streamed (migrate/prune_store_stream.py) equals its
selection over the manifest's columns whole (`prune._picked_whole`, the reference): the
plan's items in order (with their pair keys, kept folders, quarantine suffix and objects),
the retires, the proofs, the skipped namespaces and the target bases, for every class of
a store: residue of every defect of both backends, --tails (a short entry retired, a pair
with no readable entry moved whole), migrated raw KVEntries and a relinked misfiled one,
a stale deployment taken whole beside a live one, --only, the quiet period, and state
carried across batch borders (batches of 5 rows, lookups in parts). A manifest that is
not for the stream (a store file with two rows) is planned by the reference.
"""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_mooncake_prune import MC, STOPPED, backdate
from test_prune_tier_stream import picked_by, same_plans

from kvmigrate import manifest as mf
from kvmigrate.migrate import prune, prune_store_stream, prune_stores
from kvmigrate.synth import SynthSpec, build

from helpers.cli_helpers import run

CLASSES = [("migrated",), ("unreadable_namespaces",), ("residue",), ("tails",),
           ("migrated", "unreadable_namespaces", "residue", "tails")]


def scan(root: Path, out: Path) -> str:
    code, text = run("scan", root, "--verify", "hash", "-o", out, "-q")
    assert code in (0, 1, 4, 5), text
    return str(out)


def picked(manifest: str, classes: tuple, chosen: set | None, streamed: bool, monkeypatch, *, now: float,
           quiet_period: float | None = None) -> tuple:
    meta = mf.read_metadata(manifest)
    args = (manifest, meta, classes, meta["root"], None, None, now, chosen, quiet_period, False)
    p = picked_by(prune._picked_stores, args, streamed, monkeypatch)
    items = list(p.items)
    proofs = prune_stores.proofs(items, p.retires, p.stores, False)
    return items, p.skipped, p.skip, p.target_bases, p.emptied, p.retires, proofs


def assert_same(manifest: str, monkeypatch, **kw) -> int:
    """Every class's plan equal, for every namespace and for half of them; the items and
    retires of all classes together (the quiet period's skips are dropped later)."""
    whole = same_plans(picked, CLASSES, manifest, monkeypatch, **kw)
    return len(whole[0]) + len(whole[5])


RESIDUE = [("bucket", "vllm", ("orphan_data", "orphan_index", "corrupt_sidecar", "misfiled", "nested_bucket",
                               "short", "zero_filled", "foreign", "replica_mismatch")),
           ("bucket", "sglang", ("orphan_data", "short", "misfiled", "unsupported_key")),
           ("file_per_key", "vllm", ("short", "header_invalid", "tmp_leftover", "zero_filled", "misfiled")),
           ("file_per_key", "sglang", ("header_invalid", "short", "symlink"))]


@pytest.mark.parametrize(("backend", "engine", "defects"), RESIDUE, ids=["-".join(c[:2]) for c in RESIDUE])
@pytest.mark.parametrize("keys", [2, 500])
def test_the_defects_of_a_store(tmp_path, backend, engine, defects, keys, monkeypatch):
    root = tmp_path / "root"
    build(root, SynthSpec(**{**MC, "blocks": 4, "tp": 2, "mc_backend": backend, "mc_engine": engine,
                             "mc_bucket_keys": keys, "defects": defects}))
    backdate(root)
    assert assert_same(scan(root, tmp_path / "m.parquet"), monkeypatch, quiet_period=600.0) > 0


@pytest.mark.parametrize("keys", [1, 2, 500])
def test_tails_of_short_entries(tmp_path, keys, monkeypatch):
    root = tmp_path / "root"
    build(root, SynthSpec(**{**MC, "blocks": 5, "tp": 2, "mc_bucket_keys": keys, "defects": ("short",)}))
    backdate(root)
    assert assert_same(scan(root, tmp_path / "m.parquet"), monkeypatch) > 0


@pytest.mark.parametrize(("backend", "scheme", "defects"), [("file_per_key", "mc-raw", ()),
                                                             ("file_per_key", "mc-scoped", ("misfiled",)),
                                                             ("bucket", "mc-raw", ())])
def test_migrated_kventries_and_rekeyed_pairs(tmp_path, backend, scheme, defects, monkeypatch):
    root = tmp_path / "root"
    build(root, SynthSpec(**{**MC, "blocks": 4, "tp": 2, "mc_backend": backend, "mc_scheme": scheme,
                             "mc_bucket_keys": 2, "defects": defects}))
    code, out = run("migrate", root, "--apply", STOPPED)
    assert code in (0, 4), out
    backdate(root)
    n = assert_same(scan(root, tmp_path / "m.parquet"), monkeypatch, quiet_period=600.0)
    assert n > 0 or backend == "bucket"


def stale_first_deployment(m: Path) -> str:
    """Mark the objects of the manifest's first deployment `stale_hash_recipe`; its name."""
    t = pq.read_table(m)
    ns, objects = t.column("source_base").to_pylist(), t.column("object_index").is_valid().to_pylist()
    first = sorted({s for s, o in zip(ns, objects) if o})[0]
    status = pa.array(["stale_hash_recipe" if s == first and o else st for s, o, st in zip(
        ns, objects, t.column("status").to_pylist())], pa.string())
    pq.write_table(t.set_column(t.schema.get_field_index("status"), "status", status.dictionary_encode()), m)
    return first


def test_a_stale_deployment_beside_a_live_one_and_the_quiet_period(tmp_path, monkeypatch):
    """One deployment's objects `stale_hash_recipe`: its pairs go whole, the other's stay;
    a store written within the quiet period is skipped whole, in both plans."""
    root = tmp_path / "root"
    build(root, SynthSpec(**{**MC, "blocks": 6, "tp": 2, "mc_bucket_keys": 2, "defects": ("orphan_data",)}))
    live = tmp_path / "live.parquet"
    scan(root, live)
    stale_first_deployment(live)
    assert assert_same(str(live), monkeypatch, quiet_period=600.0) > 0
    _, skipped, skip, *_ = picked(str(live), ("unreadable_namespaces",), None, True, monkeypatch, now=time.time(),
                                  quiet_period=600.0)
    assert list(skipped) == ["mooncake:store"] and skip == set(mf.read_metadata(str(live))["namespaces"])
    backdate(root)
    quiet = tmp_path / "quiet.parquet"
    scan(root, quiet)
    stale_first_deployment(quiet)
    items, skipped, *_ = picked(str(quiet), ("unreadable_namespaces",), None, True, monkeypatch, now=time.time(),
                                quiet_period=600.0)
    pairs = [r for r in mf.read_table(str(quiet)).to_pylist() if r["relpath"].endswith((".meta", ".bucket"))
             and r["object_index"] is None]
    assert skipped == {} and 0 < len(items) < len(pairs), (len(items), len(pairs))  # the stale deployment's pairs
    assert assert_same(str(quiet), monkeypatch, quiet_period=600.0) > 0


def test_a_store_file_with_two_rows_is_planned_by_the_reference(tmp_path):
    root = tmp_path / "root"
    build(root, SynthSpec(**{**MC, "defects": ("orphan_data",)}))
    m = tmp_path / "m.parquet"
    scan(root, m)
    t = pq.read_table(m)
    files = [i for i, o in enumerate(t.column("object_index").is_valid().to_pylist()) if not o]
    t = pa.concat_tables([t, t.take([files[-1]])])
    pq.write_table(t, m)
    meta = mf.read_metadata(str(m))
    args = (str(m), meta, ("residue",), meta["root"], None, None, time.time(), None, None, False)
    assert prune._picked_stores(*args) is None
    assert prune_store_stream.StoreRows(str(m), (set(), set()), ("residue",), 0,
                                        prune_stores.Stores.of(meta)).gather() is False
