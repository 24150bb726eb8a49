"""Safe by default (issue 16, defect 2): the dry run counts exactly the outcomes the apply
will have, and competing sources for one target path are resolved by a stated rule.

Two legacy vLLM namespaces of one model (TP=2 and TP=4, same seed: the same block names,
rows of different sizes) collapse into one parallel-agnostic target under vllm-0.28. The
candidate whose size is the target's (the most common size of the target's group over all
its sources) is placed, the other is a conflict with its cause; equal bytes merge; with no
single such size neither is placed. Never by folder-name order.
"""

from __future__ import annotations

import json

import pytest

from kvmigrate import manifest
from kvmigrate.options import ScanOptions

from helpers.cli_helpers import run, run_json

# vLLM 0.28-0.33 collapse every TP of a full-attention model into one namespace, where the
# rows of several TP sizes compete (0.34 keeps each TP's rows in its own namespace)
FULL = ["--family", "vllm", "--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16",
        "--target", "vllm-0.28"]
# rows of 2 layers x 2 tensors x 1024 bytes per rank: TP=2 8192 bytes, TP=4 16384
ROWS = {"family": "vllm", "scheme": "S1", "layers": 2, "page_bytes": 1024, "seed": 1}


def _namespaces(root) -> dict[int, str]:
    """tp -> source base folder of the synthesized namespaces."""
    return {json.loads((d / "config.json").read_text())["tp_size"]: d.name
            for d in root.iterdir() if (d / "config.json").is_file()}


def _dry_and_apply(root) -> tuple[dict, dict]:
    code, dry = run_json("migrate", root, *FULL)
    assert code in (1, 4, 5), dry
    code, done = run_json("migrate", root, *FULL, "--apply")
    assert code in (0, 4), done
    return dry, done


def test_competing_sources_place_the_target_size_not_the_first_folder_name(tmp_path, synth_root):
    # the TP=2 namespace has 3 blocks and its folder name sorts first; the TP=4 one has 12
    root, _ = synth_root({**ROWS, "tp": 2, "blocks": 3}, {**ROWS, "tp": 4, "blocks": 12})
    ns = _namespaces(root)
    assert ns[2] < ns[4]  # name order would pick the minority's 8192-byte rows
    code, text = run("migrate", root, *FULL)
    assert code == 5, text  # pending + conflicts
    cause = f"competing source {ns[2]}: 8192 bytes, the target's size is 16384"
    assert f"conflict: 3 blocks - {cause}" in text
    assert "merge (" not in text  # different sizes are never counted as a merge
    dry, done = _dry_and_apply(root)
    assert dry["outcomes"] == done["outcomes"]
    assert done["outcomes"]["created"] == 12 and done["outcomes"]["conflict"] == 3
    assert f"conflict: {cause} (3 blocks)" in done["apply"]["findings"]
    # the new target holds only rows of its size: the audit finds no size_mismatch
    m = tmp_path / "after.parquet"
    run("scan", root, *FULL, "-o", m)
    rows = manifest.read_table(m).to_pylist()
    target = [r for r in rows if r["source_base"] not in ns.values() and r["block_hash"] is not None]
    assert len(target) == 12 and {r["size"] for r in target} == {16384}
    assert not [r for r in rows if r["status"] == "size_mismatch"]
    # rerun: the losers' paths are now taken (the scan's conflict), listed by cause, not one line per path
    code, text = run("migrate", root, *FULL)
    assert "conflict: 3 blocks - aliases_source: the target path already exists with other bytes" in text


def test_competing_sources_without_a_most_common_size_place_neither(synth_root):
    root, _ = synth_root({**ROWS, "tp": 2, "blocks": 4}, {**ROWS, "tp": 4, "blocks": 4})
    ns = _namespaces(root)
    dry, done = _dry_and_apply(root)
    assert dry["outcomes"] == done["outcomes"]
    assert done["outcomes"]["created"] == 0 and done["outcomes"]["conflict"] == 8
    (target,) = dry["targets"]
    reasons = {c["reason"] for c in target["conflicts"]}
    assert reasons == {f"competing source {ns[tp]}: {size} bytes, the target's size is unknown (no single most "
                       "common size in group 0); none placed" for tp, size in ((2, 8192), (4, 16384))}
    assert not list((root / target["rank_dir"]).rglob("*.bin"))


def _migrated_part(synth_root):
    """A tree migrated once, then two of its target blocks removed and a namespace added."""
    root, _ = synth_root({**ROWS, "tp": 2, "blocks": 6})
    code, done = run_json("migrate", root, *FULL, "--apply")
    assert code == 0 and done["outcomes"]["created"] == 6
    for p in sorted((root / done["targets"][0]["rank_dir"]).rglob("*.bin"))[:2]:
        p.unlink()
    synth_root({**ROWS, "tp": 4, "blocks": 2, "seed": 7})
    return root


MLA = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]
TREES = {
    "plain": ([{**ROWS, "tp": 2, "blocks": 5}], FULL, ("created", 5)),
    "competing": ([{**ROWS, "tp": 2, "blocks": 3}, {**ROWS, "tp": 4, "blocks": 12}], FULL, ("conflict", 3)),
    # llm-d MLA TP=2 / TP=4 of one seed: equal rank-0 files, proven equal by their hashes
    "equal_bytes": ([{"family": "llmd", "tp": 2, "kv_kind": "mla", "blocks": 5, "seed": 1},
                     {"family": "llmd", "tp": 4, "kv_kind": "mla", "blocks": 5, "seed": 1}],
                    [*MLA, "--verify", "hash"], ("already_present", 5)),
    "migrated_part": (None, FULL, ("already_present", 4)),
    # llm-d B=4 without --page-bytes (needs_relayout) next to a migratable namespace
    "needs": ([{"family": "llmd", "tp": 2, "kv_kind": "mla", "blocks_per_file": 4},
               {"family": "llmd", "tp": 2, "kv_kind": "mla", "blocks": 3, "model_name": "org/other"}],
              MLA, ("skipped_needs_transform", 6)),
}


@pytest.mark.parametrize("tree", sorted(TREES))
def test_the_dry_run_outcomes_are_the_apply_outcomes(tree, synth_root):
    specs, flags, (key, n) = TREES[tree]
    root = _migrated_part(synth_root) if specs is None else synth_root(*specs)[0]
    code, dry = run_json("migrate", root, *flags)
    assert code in (0, 1, 4, 5), dry
    code, done = run_json("migrate", root, *flags, "--apply")
    assert code in (0, 4), done
    assert list(dry["outcomes"]) == list(done["outcomes"])  # the same keys (interface.md §1)
    assert dry["outcomes"] == done["outcomes"]
    assert dry["outcomes"][key] == n, dry["outcomes"]
    per_target = {t["target_base"]: {k: v for k, v in t["outcomes"].items() if v} for t in dry["targets"]}
    assert per_target == {b: {k: v for k, v in c.items() if v} for b, c in done["apply"]["per_target"].items()}


def test_a_scale_out_part_judges_competing_sources_by_the_whole_plans_sizes(tmp_path, synth_root):
    from kvmigrate.identity.facts import FactsResolver
    from kvmigrate.migrate.plan import build_plan
    from kvmigrate.pipeline import scan
    from kvmigrate.scaleout import dataset

    # 3 shared block names, 1 more in TP=4: modal 16384 over the whole target, a tie in a
    # part that holds one shared block only
    root, _ = synth_root({**ROWS, "tp": 2, "blocks": 3}, {**ROWS, "tp": 4, "blocks": 4})
    m = tmp_path / "m.parquet"
    scan(root, m, ScanOptions(facts_resolver=FactsResolver({"family": "vllm", "kv_kind": "full", "total_kv_heads": 8,
                                                            "model_dtype": "bfloat16"}, None), threads=2,
                              target="vllm-0.28"))
    whole = build_plan(m)
    assert whole.outcomes()["created"] == 4 and whole.outcomes()["conflict"] == 3
    meta = manifest.read_metadata(m)
    n = 64

    def summed(**kwargs) -> dict:
        total: dict = {}
        for k in range(n):
            part = build_plan(m, table=dataset.part_rows(m, k, n), metadata=meta, **kwargs)
            for key, v in part.outcomes().items():
                total[key] = total.get(key, 0) + v
        return total

    assert summed(target_sizes=whole.target_sizes) == whole.outcomes()
    assert summed() != whole.outcomes()  # each part alone sees a tie: the sizes must come from the whole
