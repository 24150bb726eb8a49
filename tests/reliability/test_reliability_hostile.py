"""Hostile and broken input, CI-sized (hypothesis; the campaign script runs more): scan,
audit, migrate (dry run and --apply), verify and rollback on roots full of garbage
config.json files, links out of the root, FIFOs, devices, odd names and enormous sparse
files never print a traceback, exit with the interface's bits, never follow a link out of
the root, never read a source without O_NOATIME and never write outside the target
namespaces (migration.md §3.1, §3.7; interface.md §4)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings

from helpers import reliability_harness as R  # tests/helpers/reliability_harness.py: the campaign's benches and oracles

pytestmark = pytest.mark.slow  # reliability-sized: `pytest -m 'not slow'` leaves it out, CI runs it


def _config(kind: str, ns: int, **kw) -> dict:
    return {"ns": ns, "kind": kind, "garbage": "ff00fe", "value": [1, {"a": None}], "depth": 200_000, "mib": 1,
            "key": 3, "model": "../../outside", "rename": True, **kw}


def _item(kind: str, place: str, ns: int = 0) -> dict:
    return {"kind": kind, "place": place, "ns": ns, "name": "ff2e2ec3", "hex": f"{ns:02x}{len(kind):02x}" + "ab" * 30,
            "depth": 40}


# every config mutation and every tree element at least once, whatever hypothesis draws
KITCHEN_SINKS = [
    {"namespaces": ["vllm", "llmd", "vllmcpp", "vllm-S2"], "blocks": 3, "hash_scan": False,
     "configs": [_config(k, i) for i, k in enumerate(R.CONFIG_KINDS[j:j + 4])],
     "items": [_item(kind, R.PLACES[(i + j) % len(R.PLACES)], i) for i, kind in enumerate(R.ITEM_KINDS)],
     "traps": [{"at": R.TRAPS[j % 4], "ns": j, "to": ("marker", "dir", "loop")[j % 3]}]}
    for j in range(0, len(R.CONFIG_KINDS), 4)
]
KITCHEN_SINKS.append({"namespaces": ["vllm", "vllmcpp"], "blocks": 4, "hash_scan": True, "traps": [],
                      "configs": [_config("evil_model_name", 0, model=m) for m in ("..", "evil\ud800name")]
                      + [_config("evil_model_name", 1, model=R.HTML_INJECTION)]
                      + [_config("wrong_type", 1, value=2**80)],
                      "items": [_item("dotdot_name", "rank"), _item("binary_name", "fanout", 1)]})


# enormous sparse block files in every family's fan-out folders (a 1 TiB file must never be read whole)
KITCHEN_SINKS.append({"namespaces": ["vllmcpp", "llmd", "vllm"], "blocks": 3, "hash_scan": False, "traps": [],
                      "configs": [], "items": [_item("sparse_block", "fanout", ns) for ns in range(4)]
                      + [_item("empty_block", "fanout", 1)]})


# derandomized: CI runs the same examples every time (the campaign script explores with a recorded seed)
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
          database=None)
@given(recipe=R.hostile_recipes())
@example(recipe=KITCHEN_SINKS[0])
@example(recipe=KITCHEN_SINKS[1])
@example(recipe=KITCHEN_SINKS[2])
@example(recipe=KITCHEN_SINKS[3])
@example(recipe=KITCHEN_SINKS[4])
@example(recipe=KITCHEN_SINKS[5])
def test_hostile_roots_get_clear_answers_and_nothing_outside_is_touched(tmp_path_factory, recipe):
    ledger = R.Ledger()
    record = R.hostile_trial(tmp_path_factory.mktemp("hostile"), ledger, recipe, 0)
    assert ledger.violations == [], "\n".join(ledger.violations)
    assert record["ok"]
    assert ledger.counts["commands"] >= 4


def test_the_kitchen_sinks_cover_every_element():
    kinds = {c["kind"] for r in KITCHEN_SINKS for c in r["configs"]}
    items = {i["kind"] for r in KITCHEN_SINKS for i in r["items"]}
    assert kinds == set(R.CONFIG_KINDS) and items == set(R.ITEM_KINDS)


def test_the_hostile_checks_catch_a_followed_link(tmp_path):
    """The checks must be able to fail: a read through a link out of the root moves the
    marker's atime, which the trial compares."""
    outside = tmp_path / "outside"
    R._outside_tree(outside)
    R.backdate_atimes(outside)
    before = R.observed(R.snapshot(outside))
    (outside / "marker").read_bytes()  # what following a symlink to it would do
    assert R.observed(R.snapshot(outside)) != before
