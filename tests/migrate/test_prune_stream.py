"""Prune's selection streamed (migrate/prune_stream.py) equals its selection over the
manifest's columns whole (`prune._select`, the reference): the reports' reclaimable
figures (`_reclaimable_whole`) and a prune plan's rows and targets (`_picked_whole`), for
every rule: migrated blocks and their rank files, unreadable and superseded namespaces,
residue, a namespace emptied by a selection (its config.json), files of no namespace,
--only/--exclude, the quiet period, and state carried across batch borders (batches of
5 rows).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmigrate import manifest as mf
from kvmigrate.migrate import prune, prune_spill, prune_stream

from helpers.cli_helpers import run
from helpers.synth_matrix import ERAS, cases, spec_of

MLA = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]
LLMD = {"family": "llmd", "tp": 2, "kv_kind": "mla"}
VLLM = {"family": "vllm", "scheme": "S2", "kv_kind": "mla", "model_name": "org/v"}
OLD_ERA = {"family": "vllm", "scheme": "S1", "kv_kind": "mla", "extra_fields": {"future_key": 1}}
NEW_ERA = {"family": "vllm", "scheme": "S3", "kv_kind": "mla"}


def _scan(root: Path, out: Path, facts: list[str]) -> str:
    code, text = run("scan", root, *facts, "--verify", "hash", "-o", out, "-q")
    assert code in (0, 1, 5), text
    return str(out)


def _figures(manifest: str, namespaces: set[str] | None, batch: int | None, monkeypatch) -> tuple:
    meta = mf.read_metadata(manifest)
    root = meta["root"]
    used = prune._used_namespaces(root, None)
    now = 2e9  # every temp file is old, every namespace quiet: the figures do not depend on the clock
    if batch is None:
        per_class, per_ns, totals, skipped = prune._reclaimable_whole(manifest, meta, root, used, now, namespaces)
    else:
        monkeypatch.setattr(prune_stream, "BATCH", batch)
        per_class, per_ns, totals, skipped = prune_stream.reclaimable(manifest, meta, root, used, now, namespaces)
    return per_class, sorted(per_ns.items(), key=prune.namespace_order), totals, skipped


PLAN_CLASSES = [("migrated",), ("unreadable_namespaces",), ("residue",),
                ("migrated", "unreadable_namespaces", "residue")]


def _picked(manifest: str, classes: tuple, chosen: set | None, batch: int | None, monkeypatch,
            quiet_period: float | None = None, now: float = 2e9) -> tuple:
    meta = mf.read_metadata(manifest)
    args = (manifest, meta, classes, meta["root"], None, None, now, chosen, quiet_period, False)
    if batch is None:
        p = prune._picked_whole(*args)
    else:
        monkeypatch.setattr(prune_stream, "BATCH", batch)
        monkeypatch.setattr(prune_spill, "MIN_RANGE", 7)  # many target ranges: the join and merge cross them
        monkeypatch.setattr(prune_spill, "RUN_BATCH", 3)
        monkeypatch.setattr(prune_spill, "OUT_BATCH", 4)
        p = prune._picked_streamed(*args)
        # the plan's items on disk; its figures, read from there, as the items' tally
        assert isinstance(p.items, prune_spill.PlanFile)
        assert p.items.tally(classes) == prune.reclaim_totals(prune._rows_of_items(p.items), classes)
    return list(p.items), p.skipped, p.skip, p.target_bases, p.emptied


def _assert_same_plans(manifest: str, monkeypatch) -> int:
    """Every class's plan rows equal; the number of rows of the plan of all three."""
    names = sorted(mf.read_metadata(manifest)["namespaces"])
    for classes in PLAN_CLASSES:
        whole = _picked(manifest, classes, None, None, monkeypatch)
        assert _picked(manifest, classes, None, 5, monkeypatch) == whole, classes
        some = set(names[::2])
        assert _picked(manifest, classes, some, 5, monkeypatch) == _picked(manifest, classes, some, None, monkeypatch)
    return len(whole[0])


def _assert_same(manifest: str, monkeypatch) -> dict:
    _assert_same_plans(manifest, monkeypatch)
    whole = _figures(manifest, None, None, monkeypatch)
    assert _figures(manifest, None, 5, monkeypatch) == whole
    assert _figures(manifest, None, 65_536, monkeypatch) == whole
    names = sorted(mf.read_metadata(manifest)["namespaces"])
    if names:
        some = set(names[::2])
        assert _figures(manifest, some, 5, monkeypatch) == _figures(manifest, some, None, monkeypatch)
    return whole[2]


def test_migrated_blocks_and_their_proven_replicas(synth_root, tmp_path, monkeypatch):
    root, _ = synth_root(LLMD, VLLM)
    assert run("migrate", root, *MLA, "--apply")[0] == 0
    manifest = _scan(root, tmp_path / "m.parquet", MLA)
    totals = _assert_same(manifest, monkeypatch)
    assert totals["files"] > 0 and totals["unlinked_files"] > 0  # the figures are not all zero
    items, *_ = _picked(manifest, ("migrated",), None, 5, monkeypatch)
    blocks = [item.target for item in items if item.relpath.endswith(".bin")]
    assert blocks and all(blocks)  # every migrated block with its target's path and stat


def _with_copies(manifest: str, rows: list[tuple[int, bool]]) -> None:
    """Add to the manifest a copy of each row (row, before every row: else after), at
    another path and inode, with other bytes: a second primary of its block key."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pq.read_table(manifest)
    before, after = [], []
    for row, first in rows:
        copy = t.slice(row, 1)
        for name, value in (("relpath", copy["relpath"][0].as_py().replace(".bin", ".copy.bin")),
                            ("inode", copy["inode"][0].as_py() + 10**9), ("content_xxh3_128", b"\x01" * 16)):
            i = copy.schema.get_field_index(name)
            copy = copy.set_column(i, copy.schema.field(i), pa.array([value], copy.schema.field(i).type))
        (before if first else after).append(copy)
    pq.write_table(pa.concat_tables([*before, t, *after]).replace_schema_metadata(t.schema.metadata), manifest)


def test_a_rank_file_pairs_with_the_last_primary_of_its_block(synth_root, tmp_path, monkeypatch):
    """Two migrated primaries of one block key (deployment, group, block hash, rank): its
    rank files pair with the last (as `_select`'s dict keeps it), a replica only when its
    bytes equal that one's."""
    import pyarrow.parquet as pq

    root, _ = synth_root(LLMD)
    assert run("migrate", root, *MLA, "--apply")[0] == 0
    manifest = _scan(root, tmp_path / "m.parquet", MLA)
    t = pq.read_table(manifest, columns=["relpath", "source_base", "action", "rank", "target_relpath"])
    primaries = [(i, rel) for i, (rel, src, action, rank, target) in enumerate(zip(*(t[k].to_pylist()
                                                                                      for k in t.column_names)))
                 if action == "already_present" and rank == 0 and target and not target.startswith(src + "_")]
    assert len(primaries) >= 2
    (last, replaced), (first, kept) = primaries[:2]
    _with_copies(manifest, [(last, False), (first, True)])  # a copy after every row; one before them
    _assert_same(manifest, monkeypatch)
    rows = {item.relpath for item in _picked(manifest, ("migrated",), None, 5, monkeypatch)[0]}
    # the copy after the rows is its key's last primary: the replica of the first is no longer
    # proven equal; the copy before them is not: the other block's replica still is
    assert replaced.replace("_r0/", "_r1/") not in rows and kept.replace("_r0/", "_r1/") in rows
    assert {replaced, kept, replaced.replace(".bin", ".copy.bin"), kept.replace(".bin", ".copy.bin")} <= rows


def test_unreadable_namespaces_and_residue(synth_root, tmp_path, monkeypatch):
    root, _ = synth_root({**VLLM, "defects": ("orphan_rank",)}, {**LLMD, "defects": ("tmp_vllm",)})
    totals = _assert_same(_scan(root, tmp_path / "m.parquet", MLA), monkeypatch)
    assert totals["files"] > 0


def test_a_superseded_era(synth_root, tmp_path, monkeypatch):
    root, _ = synth_root(OLD_ERA, NEW_ERA)
    totals = _assert_same(_scan(root, tmp_path / "m.parquet", MLA), monkeypatch)
    assert totals["files"] == 7  # the old era's 6 blocks and its config.json


def test_rank_namespaces_of_a_vllmcpp_deployment(synth_root, tmp_path, monkeypatch):
    root, _ = synth_root({"family": "vllmcpp", "tp": 2, "kv_kind": "mla", "model_name": "org/cpp"})
    assert run("migrate", root, "--apply")[0] == 0
    _assert_same(_scan(root, tmp_path / "m.parquet", []), monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("era,defect", [(era, None) for era in ERAS] + cases())
def test_every_synth_tree_before_and_after_its_migration(era, defect, tmp_path, monkeypatch):
    from kvmigrate.synth import SynthSpec, build

    root = tmp_path / "root"
    root.mkdir()
    build(root, SynthSpec(**spec_of(era, defect)))
    facts = ERAS[era][1]
    _assert_same(_scan(root, tmp_path / "m1.parquet", facts), monkeypatch)
    run("migrate", root, *facts, "--apply")
    _assert_same(_scan(root, tmp_path / "m2.parquet", facts), monkeypatch)


def test_a_namespace_written_within_the_quiet_period_is_named_as_prune_would_skip_it(synth_root, tmp_path,
                                                                                      monkeypatch):
    import os

    root, _ = synth_root({**LLMD, "defects": ("tmp_vllm",)})
    now = time.time()
    for d, _, files in os.walk(root):  # every file old (the temp file is residue); the folders written just now
        for f in files:
            os.utime(os.path.join(d, f), (now - 7200, now - 7200))
    manifest = _scan(root, tmp_path / "m.parquet", MLA)
    meta = mf.read_metadata(manifest)
    used = prune._used_namespaces(str(root), None)
    whole = prune._reclaimable_whole(manifest, meta, str(root), used, now, None)
    monkeypatch.setattr(prune_stream, "BATCH", 3)
    streamed = prune_stream.reclaimable(manifest, meta, str(root), used, now, None)
    assert whole[3] and streamed[3] == whole[3]
    plan = _picked(manifest, ("residue",), None, None, monkeypatch, quiet_period=600, now=now)
    assert plan[1] and _picked(manifest, ("residue",), None, 3, monkeypatch, quiet_period=600, now=now) == plan


@given(st.lists(st.tuples(st.sampled_from([1, 2, 3]), st.sampled_from(["a", "b", None]),
                          st.sampled_from([0, 1, None]), st.integers(0, 6), st.integers(0, 9),
                          st.sampled_from([0, 1, 2, 3, None])), max_size=40),
       st.integers(1, 7))
def test_the_streamed_tally_is_the_items_tally(rows, batch):
    """Freed vs only unlinked, an inode's bytes once on its first name, read in batches:
    as `reclaim_totals` tallies a plan's items (inodes named twice, on one device or two,
    null and zero link counts; some namespaces only, their inodes' names counted over all)."""
    import pyarrow as pa

    from kvmigrate.migrate import prune_rules as P

    cols = {k: pa.array([r[i] for r in rows], t) for i, (k, t) in enumerate(
        [("code", pa.int8()), ("ns", pa.string()), ("dev", pa.uint64()), ("inode", pa.uint64()),
         ("size", pa.int64()), ("nlink", pa.uint32())])}
    order = pa.array(range(len(rows)), pa.int64())

    def batches():
        for at in range(0, len(rows), batch):
            yield {**{k: v.slice(at, batch) for k, v in cols.items()}, "ord": order.slice(at, batch)}

    items = [(P.CLASSES[code - 1], ns, dev or 0, ino or 0, size, nlink or 1) for code, ns, dev, ino, size, nlink in rows]
    for keep in (None, {"a"}, {"a", "b"}):
        per_ns = prune.reclaim_totals(items, P.CLASSES, keep)[1]
        assert P.tally_stream(batches, keep) == per_ns
