"""The plan streamed from the manifest one chunk of buckets at a time (plan.ActionStream).

Whatever the chunk size, the actions (in the fixed merge order, with their replicas),
the counts and what `--apply` creates are the same; a dataset directory plans like the
single file. And the checks streaming relies on: a target path must name its row's
block (a block's rows share its bucket), a block row without a block hash is refused,
and a manifest that changes between two reads is refused.
"""

from __future__ import annotations

import os

import pytest

from kvmigrate import manifest
from kvmigrate.errors import UsageError
from kvmigrate.identity.facts import FactsResolver
from kvmigrate.migrate import plan as plan_mod
from kvmigrate.migrate.apply import apply_plan
from kvmigrate.migrate.plan import build_plan
from kvmigrate.options import ScanOptions
from kvmigrate.pipeline import scan

FACTS = {"kv_kind": "mla", "model_dtype": "bfloat16"}


@pytest.fixture
def merged(tmp_path, synth_root):
    """Multi-rank (llm-d TP=2 and TP=4) and single-rank (vLLM S1 and S2) namespaces,
    each pair merging into one target; llm-d with two groups (concat), and a vllm.cpp
    TP=2 deployment (one namespace per rank)."""
    root, _ = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla", "blocks": 10, "seed": 1},
                         {"family": "llmd", "tp": 4, "kv_kind": "mla", "blocks": 10, "seed": 1},
                         {"family": "llmd", "tp": 2, "kv_kind": "mla", "blocks": 10, "groups": 2, "seed": 2,
                          "model_name": "org/groups"},
                         {"family": "vllm", "scheme": "S1", "kv_kind": "mla", "blocks": 10, "seed": 3},
                         {"family": "vllm", "scheme": "S2", "kv_kind": "mla", "blocks": 10, "seed": 3},
                         {"family": "vllmcpp", "tp": 2, "kv_kind": "mla", "blocks": 10, "seed": 5,
                          "model_name": "org/cpp"})
    m = tmp_path / "m.parquet"
    scan(root, m, ScanOptions(facts_resolver=FactsResolver(FACTS, None), threads=2))
    return root, m


def _small_chunks(monkeypatch, rows: int = 7, slice_rows: int = 3) -> None:
    monkeypatch.setattr(plan_mod, "CHUNK_ROWS", rows)
    monkeypatch.setattr(plan_mod, "SLICE_ROWS", slice_rows)


def _snapshot(plan) -> list:
    """Everything a plan says, actions in order with their replicas."""
    out = [(plan.pending, plan.integrity_rows, dict(plan.status_counts), dict(plan.untargeted))]
    for tp in plan.targets:
        out.append((tp.base_name, tp.sources, tp.counts(), tp.transform_costs(), tp.already_present,
                    dict(tp.not_reusable), dict(tp.skipped), dict(tp.conflicts), len(tp.actions)))
        out.append([tuple(a) for a in tp.actions])
    return out


def test_small_chunks_plan_the_same_actions_in_the_same_order(merged, monkeypatch):
    root, m = merged
    whole = build_plan(m)
    counts = [tp.counts() for tp in whole.targets]
    assert len(whole.targets) == 4 and whole.pending == 10 + 10 + 20 + 10
    assert sum(c["merge_duplicate"]["blocks"] for c in counts) == 20
    assert {a for c in counts for a, n in c.items() if n["blocks"]} == {"link", "copy_pad", "concat", "rewrite_header",
                                                                         "merge_duplicate"}
    _small_chunks(monkeypatch)
    chunked = build_plan(m)
    assert len(chunked.targets[0].actions._rows._ranges) > 3  # really several chunks
    assert _snapshot(chunked) == _snapshot(whole)


def test_actions_follow_the_merge_order_and_carry_every_replica(merged, monkeypatch):
    _small_chunks(monkeypatch)
    plan = build_plan(merged[1])
    for tp in plan.targets:
        keys = [(a.source_base, a.source.rank, a.target_relpath) for a in tp.actions]
        assert keys == sorted(keys)
        for a in tp.actions:
            assert [f.rank for f in a.sources] == list(range(a.world))
            assert len({f.relpath for f in a.sources}) == a.world


def test_small_chunks_apply_the_same_tree(merged, tmp_path, monkeypatch):
    root, m = merged
    (one := tmp_path / "one").mkdir()
    (many := tmp_path / "many").mkdir()
    whole = apply_plan(build_plan(m, dest=str(one)), journal=str(tmp_path / "j1"), command="test")
    _small_chunks(monkeypatch)
    chunked = apply_plan(build_plan(m, dest=str(many)), journal=str(tmp_path / "j2"), command="test",
                         batch_size=4)
    assert whole.exit_code == chunked.exit_code == 0
    assert whole.outcomes == chunked.outcomes and whole.outcomes["created"] > 0

    def tree(d):
        return {os.path.relpath(os.path.join(p, f), d): open(os.path.join(p, f), "rb").read()
                for p, _, fs in os.walk(d) for f in fs if ".kvmigrate" not in p and f != ".kvmigrate.lock"}

    assert tree(one) == tree(many)


def test_a_dataset_directory_plans_like_the_single_file(merged, tmp_path, monkeypatch):
    root, m = merged
    parts = tmp_path / "parts"
    for k in range(3):
        scan(root, parts / f"part-{k:05d}-of-00003.parquet",
             ScanOptions(facts_resolver=FactsResolver(FACTS, None), shard=(k, 3), threads=2))
    _small_chunks(monkeypatch)
    assert _snapshot(build_plan(parts)) == _snapshot(build_plan(m))


def _rewrite(m, out, **changes):
    """Copy manifest `m` to `out`, changing the first creating row's columns."""
    table = manifest.read_table(m).to_pylist()
    row = next(r for r in table if r["action"] == "link")
    row.update(changes)
    cols = {k: [r[k] for r in table] for k in table[0]}
    with manifest.ManifestWriter(out, manifest.read_metadata(m)) as w:
        w.write_columns(cols)
    return row


def test_a_target_path_that_does_not_name_its_block_is_refused(merged, tmp_path):
    root, m = merged
    table = manifest.read_table(m).to_pylist()
    a, b = [r for r in table if r["action"] == "link"][:2]
    # a's target path names another block (b's, in its bucket): a valid path, the wrong block
    row = _rewrite(m, tmp_path / "bad.parquet", target_relpath=b["target_relpath"])
    with pytest.raises(UsageError, match="does not name the row's block"):
        build_plan(tmp_path / "bad.parquet")
    assert row["relpath"] == a["relpath"]


def test_a_block_action_without_a_block_hash_is_refused(merged, tmp_path):
    root, m = merged
    _rewrite(m, tmp_path / "bad.parquet", block_hash=None)
    with pytest.raises(UsageError, match="does not name the row's block None"):
        build_plan(tmp_path / "bad.parquet")


def test_a_manifest_rewritten_after_planning_is_refused(merged, tmp_path, monkeypatch):
    """Actions are read again when they are streamed (several chunks: nothing cached);
    rows the plan never checked must not be acted on."""
    root, m = merged
    _small_chunks(monkeypatch)
    copy = tmp_path / "copy.parquet"
    copy.write_bytes(m.read_bytes())
    plan = build_plan(copy)
    _rewrite(m, copy, relpath="../../etc/passwd")  # would have been refused by the plan
    with pytest.raises(UsageError, match="the manifest changed while it was being used"):
        for tp in plan.targets:
            list(tp.actions)
