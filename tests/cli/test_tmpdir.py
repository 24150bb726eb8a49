"""TMPDIR: where an operator sends kvmigrate's working files (temporary manifests, prune
plans, a store's spill) because /tmp is too small. One that does not exist, is a file or
cannot be made use of stops the command with exit 8, naming it, instead of Python's silent
fallback to /tmp."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def kvmigrate(*args, tmpdir: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmigrate", *map(str, args)], capture_output=True, text=True,
                          env=dict(os.environ, TMPDIR=tmpdir))


@pytest.mark.parametrize("what", ["missing", "a file", "below a file"])
@pytest.mark.parametrize("command", ["audit", "prune", "mooncake scan"])
def test_an_unusable_tmpdir_stops_the_command_naming_it(synth_root, tmp_path, what, command):
    if what == "missing":
        bad = tmp_path / "no" / "such"
    else:
        (tmp_path / "file").write_text("not a folder")
        bad = tmp_path / "file" if what == "a file" else tmp_path / "file" / "sub"
    if command == "mooncake scan":
        root, _ = synth_root({"family": "mooncake", "blocks": 3, "layers": 2, "block_tokens": 4})
        args = ["scan", root, "-o", tmp_path / "m.parquet"]
    else:
        root, _ = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"})
        args = [command, root, "--kv-kind", "mla", "--model-dtype", "bfloat16"]
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    p = kvmigrate(*args, tmpdir=str(bad))
    assert p.returncode == 8, p.stdout + p.stderr
    assert "TMPDIR" in p.stderr and str(bad) in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
