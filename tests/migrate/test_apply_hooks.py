"""The Applier's public hooks for scale-out (issue 17): a part runs without taking
namespace locks (its driver holds them), a driver makes each target's config.json and
folders and hands the blocks to `place_blocks` while it holds every lock."""

from __future__ import annotations

import os

from kvmigrate import layout
from kvmigrate.identity.facts import FactsResolver
from kvmigrate.migrate.apply import Applier
from kvmigrate.migrate.journal import read_records
from kvmigrate.options import ScanOptions
from kvmigrate.pipeline import migration

FACTS = {"kv_kind": "mla", "model_dtype": "bfloat16"}


def _plan(synth_root, tmp_path):
    root, _ = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"})
    with migration(str(root), None, ScanOptions.planning(facts_resolver=FactsResolver(FACTS, None)),
                   manifest_out=str(tmp_path / "m.parquet")) as run:
        return root, run.plan


def _records(journal_dir) -> list[dict]:
    (name,) = os.listdir(journal_dir)
    return read_records(journal_dir / name)


def test_a_part_takes_no_namespace_lock(synth_root, tmp_path):
    root, plan = _plan(synth_root, tmp_path)
    result = Applier(plan, journal=str(tmp_path / "j"), take_locks=False).run()
    assert result.outcomes["created"] > 0
    assert not [r for r in _records(tmp_path / "j") if r["t"] == "lock"]


def test_a_driver_places_no_block_itself_and_calls_place_blocks_under_the_locks(synth_root, tmp_path):
    root, plan = _plan(synth_root, tmp_path)
    (tp,) = plan.targets
    seen = []

    def place_blocks() -> None:
        seen.append({"lock": (root / tp.base_name / layout.LOCK_NAME).exists(),
                     "config": (root / tp.base_name / layout.CONFIG_NAME).is_file(),
                     "rank_dir": (root / tp.rank_dir).is_dir()})

    Applier(plan, journal=str(tmp_path / "j"), place_blocks=place_blocks).run()
    assert seen == [{"lock": True, "config": True, "rank_dir": True}]
    records = _records(tmp_path / "j")
    assert not [r for r in records if r.get("kind") == "block"]
    assert [r["t"] for r in records].count("target") == 1
