"""A root copied with its journals (cp -a, a restored backup) is the copy's: its rollback,
restore and runs act on the copy and consult the copy's journals, never the original's
(journal headers name the root they were written under; paths in records are relative)."""

from __future__ import annotations

import shutil

from kvmigrate import layout

from helpers.cli_helpers import run, run_json
from helpers.reference_reader import listing

MLA = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]


def test_a_copied_roots_rollback_acts_on_the_copy_only(tmp_path, synth_root):
    root, _ = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"})
    assert run("migrate", root, *MLA, "--apply")[0] == 0
    code, pruned = run_json("prune", root, *MLA, "--apply", "--quiet-period", "0")
    assert code == 0 and pruned["moved"]["migrated"] > 0
    copy = tmp_path / "copy"
    shutil.copytree(root, copy, symlinks=True)
    original = listing(root, with_times=False)
    code, runs = run_json("runs", copy)
    assert {r["root"] for r in runs["runs"]} == {str(copy)}
    copied = listing(copy, with_times=False)
    code, out = run("rollback", copy / layout.OWN_DIR / "journals")
    # the copy's quarantine holds other inodes than its journal proves: nothing can be put
    # back there, so nothing of the copy's targets (their last copy) is removed
    assert code == 8 and "cannot be put back" in out, out
    assert str(root) + "/" not in out  # every path named is the copy's
    assert listing(root, with_times=False) == original  # the original root is untouched
    after = listing(copy, with_times=False)
    kept = {rel: entry[-1] for rel, entry in copied.items() if not rel.startswith(layout.OWN_DIR)}
    assert {rel: after[rel][-1] for rel in kept if rel in after} == kept  # no file of the copy was removed
