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


@pytest.fixture
def full_tmpdir(tmp_path):
    """A TMPDIR with 64 KiB of room (a tmpfs: the tests run as root, as CI does)."""
    from helpers.reliability_harness import mounted

    target = tmp_path / "tiny"
    target.mkdir()
    with mounted("-t", "tmpfs", "-o", "size=64k", "tmpfs", target=target) as ok:
        assert ok, "mount -t tmpfs needs root"
        yield target


def _files(root):
    return sorted((str(p.relative_to(root)), p.read_bytes() if p.is_file() else None) for p in root.rglob("*"))


def test_a_full_tmpdir_stops_a_mooncake_reshard_before_it_writes(synth_root, tmp_path, full_tmpdir):
    """The reshard's work is spilled to TMPDIR while it is planned (migrate/reshard_spill.py):
    a full one is exit 8 naming it, for the dry run and the apply, and the store is as it was."""
    import json

    root, _ = synth_root({"family": "mooncake", "tp": 2, "mc_backend": "bucket", "layers": 1, "block_tokens": 1,
                          "blocks": 600})
    facts = tmp_path / "facts.json"
    facts.write_text(json.dumps({"store": {"total_kv_heads": 8, "head_dim": 4, "dtype_bytes": 2, "layers": 1,
                                           "page_tokens": 1, "kv_kind": "full", "target_tp": 4,
                                           "engine_stopped": True}}))
    manifest = tmp_path / "m.parquet"
    assert kvmigrate("scan", root, "--facts", facts, "-o", manifest, "-q", tmpdir=str(tmp_path)).returncode in (0, 1)
    before = _files(root)
    for apply in ([], ["--apply"]):
        p = kvmigrate("migrate", "--manifest", manifest, *apply, tmpdir=str(full_tmpdir))
        assert p.returncode == 8, p.stdout + p.stderr
        assert str(full_tmpdir) in p.stderr and "no space left" in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert _files(root) == before


def test_a_full_tmpdir_stops_a_flat_scan_naming_it(synth_root, tmp_path, full_tmpdir, monkeypatch):
    """A HiCache directory's page names and pages go to TMPDIR while it is scanned
    (scan/flat_spill.py): a full one is an operational error (exit 8) naming it."""
    import tempfile

    from kvmigrate.errors import OperationalError
    from kvmigrate.identity.facts import FactsResolver
    from kvmigrate.options import ScanOptions
    from kvmigrate.pipeline import scan
    from kvmigrate.scan import flat_spill

    root, _ = synth_root({"family": "sglang", "tp": 2, "layers": 1, "block_tokens": 1, "blocks": 400})
    monkeypatch.setattr(flat_spill, "RUN_NAMES", 64)  # (runs on disk from 64 names on: the directory has 800)
    monkeypatch.setenv("TMPDIR", str(full_tmpdir))
    monkeypatch.setattr(tempfile, "tempdir", None)
    with pytest.raises(OperationalError) as err:
        scan(root, tmp_path / "m.parquet", ScanOptions(verify="size", facts_resolver=FactsResolver({}, None)))
    assert err.value.exit_code == 8 and str(full_tmpdir) in str(err.value.path or "") + str(err.value)
    assert "no space left" in str(err.value)
    assert not (tmp_path / "m.parquet").exists()
