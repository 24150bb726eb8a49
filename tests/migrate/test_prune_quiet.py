"""The quiet period counts an engine's writes, not kvmigrate's own links (issue 19, 2c).

An engine writing a block changes the file's mtime and its folder's mtime; evicting one,
the folder's mtime; an in-place rewrite, the file's mtime. `migrate`'s hard link changes
only the source inode's ctime and the target folder: the legacy namespace must look as
old as the engine left it. The trees are backdated (mtime, an hour ago) before migrating:
`os.utime` itself sets every ctime to now, as a restore from backup or a chmod would.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from helpers.cli_helpers import run, run_json

MLA = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]
VLLM = {"family": "vllm", "scheme": "S2", "kv_kind": "mla", "model_name": "org/v"}


def _backdated_and_migrated(synth_root) -> Path:
    """The root of a tree last written an hour ago, then migrated."""
    root, _ = synth_root(VLLM)
    old = time.time() - 3600
    for d, _, fs in os.walk(root):
        for f in fs:
            os.utime(os.path.join(d, f), (old, old))
    for d, _, _ in sorted(os.walk(root), key=lambda w: -w[0].count(os.sep)):
        os.utime(d, (old, old))
    code, out = run("migrate", root, *MLA, "--apply")
    assert code == 0, out
    return root


def _legacy_rank(root: Path) -> Path:
    code, plan = run_json("prune", root, *MLA, "--force-live")
    assert code == 1 and len(plan["namespaces"]) == 1, plan
    ns = plan["namespaces"][0]["namespace"]
    return next(p for p in root.iterdir() if p.name.startswith(ns + "_r"))


def test_prune_right_after_migrate_selects_the_migrated_legacy_files(synth_root):
    root = _backdated_and_migrated(synth_root)
    code, plan = run_json("prune", root, *MLA)  # the default quiet period, no --force-live
    assert code == 1 and plan["skipped"] == {}, plan
    assert plan["totals"]["migrated"]["files"] > 0


def test_a_new_file_in_a_legacy_folder_within_the_quiet_period_skips_it(synth_root):
    root = _backdated_and_migrated(synth_root)
    rank = _legacy_rank(root)
    folder = next(d for d in rank.rglob("*") if d.is_dir() and any(f.suffix == ".bin" for f in d.iterdir()))
    (folder / ("f" * 64 + ".bin")).write_bytes(b"\0" * 16)  # an engine's new block
    code, plan = run_json("prune", root, *MLA)
    assert plan["totals"]["migrated"]["files"] == 0 and len(plan["skipped"]) == 1, plan
    assert "quiet period" in next(iter(plan["skipped"].values()))


def test_an_in_place_rewrite_within_the_quiet_period_skips_it(synth_root):
    root = _backdated_and_migrated(synth_root)
    rank = _legacy_rank(root)
    block = next(f for f in rank.rglob("*.bin"))
    data = block.read_bytes()
    with open(block, "r+b") as f:  # the same inode, a fresh mtime; its folder unchanged
        f.write(data[:1])
    code, plan = run_json("prune", root, *MLA)
    assert plan["totals"]["migrated"]["files"] == 0 and len(plan["skipped"]) == 1, plan
