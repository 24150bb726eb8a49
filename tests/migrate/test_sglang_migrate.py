"""Migrate on a manifest with SGLang HiCache rows (docs/sglang.md §3): the scan plans the
links, migrate does not place them yet; it says so and still migrates the tree
namespaces of the same root."""

from __future__ import annotations

import os

from tests.cli_helpers import run

FACTS = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--model-name", "org/m",
         "--target-layout", "layer_first"]


def _listing(root):
    return sorted((dp, f, os.lstat(os.path.join(dp, f)).st_ino) for dp, _, fs in os.walk(root) for f in fs
                  if ".kvmigrate" not in dp)


def test_migrate_counts_sglang_links_as_not_placed_and_migrates_the_rest(tmp_path):
    root = tmp_path / "root"
    assert run("synth", root, "--family", "vllm", "--scheme", "S2", "--tp", "2", "--blocks", "2")[0] == 0
    assert run("synth", root, "--family", "sglang", "--sgl-era", "e2", "--tp", "2", "--blocks", "2")[0] == 0
    m = tmp_path / "m.parquet"
    code, out = run("scan", root, "-o", m, "-q", *FACTS)
    assert code == 1, out
    code, out = run("migrate", "--manifest", m)
    assert code == 1, out  # the vLLM namespace's blocks are pending
    assert "not reusable: 4 blocks - link: migrate does not place SGLang HiCache file backend files yet" in out
    sgl_before = [x for x in _listing(root) if x[1].endswith(".bin") and x[0] == str(root)]
    code, out = run("migrate", "--manifest", m, "--apply")
    assert code == 0, out
    assert [x for x in _listing(root) if x[1].endswith(".bin") and x[0] == str(root)] == sgl_before
    code, out = run("scan", root, "-o", tmp_path / "m2.parquet", *FACTS)  # not -q: it prints nothing
    assert "already_present" in out  # the vLLM target was created
