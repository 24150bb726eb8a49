"""A Mooncake store's objects are judged a partition at a time from temporary files
(kvmigrate/scan/store_spill.py): the rows are those of one partition holding every object,
a failed write of the files is an operational error naming their folder, and the folder is
removed after the scan (and after a scan killed before it could remove its own)."""

from __future__ import annotations

import errno
import gc
import os
import tempfile
from pathlib import Path

import pyarrow as pa
import pytest

from kvmigrate import manifest, scratch
from kvmigrate.scan import store_spill
from kvmigrate.synth import SynthSpec, build

from helpers.cli_helpers import run

# the defects whose verdicts compare objects across buckets and client roots
DEFECTS = ("replica_mismatch", "short", "misfiled", "size_mismatch", "zero_filled", "unsupported_key", "orphan_data")


@pytest.fixture
def tmpdir_of_scan(tmp_path, monkeypatch) -> Path:
    """The folder the scan's temporary files go to (TMPDIR)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


GEOMETRY = ("--total-kv-heads", "8", "--head-dim", "4", "--layers", "2", "--page-tokens", "4", "--dtype-bytes", "2")


def _store(root: Path, engine: str) -> None:
    build(root, SynthSpec(family="mooncake", mc_engine=engine, tp=2, layers=2, block_tokens=4, blocks=24,
                          defects=DEFECTS))


def _rows(root: Path, out: Path, *flags: str) -> tuple[list[dict], dict]:
    code, text = run("scan", root, "-o", out, "--verify", "hash", *flags)
    assert code in (0, 1, 2, 3, 4, 5, 6, 7), text
    t = manifest.read_table(out)
    meta = manifest.read_metadata(out)
    meta.pop("command", None)  # (names the manifest)
    return t.to_pylist(), meta


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("flags", [(), ("--target-tenant", "prod"), ("--target-tp", "4", *GEOMETRY)])
@pytest.mark.parametrize("migrated", [False, True])
def test_partitions_give_the_rows_of_one(tmp_path, tmpdir_of_scan, monkeypatch, engine, flags, migrated):
    """A store split into partitions of 5 objects has the rows of one partition: clean,
    with defects, at another tenant or TP, and after a migration (retired entries, keys
    the target holds, blocks in two layouts)."""
    root = tmp_path / "root"
    _store(root, engine)
    before = None
    if migrated:
        before, _ = _rows(root, tmp_path / "before.parquet", *flags)
        code, text = run("migrate", "--manifest", tmp_path / "before.parquet", "--apply", "--engine-stopped")
        assert code in (0, 1, 2, 3, 4, 5, 6, 7), text
    whole, whole_meta = _rows(root, tmp_path / "whole.parquet", *flags)
    parts: list[int] = []
    split = store_spill.ObjectSpill.partition

    def partition(self, one):
        split(self, one)
        parts.append(len(self.parts))

    monkeypatch.setattr(store_spill, "PART_OBJECTS", 5)
    monkeypatch.setattr(store_spill.ObjectSpill, "partition", partition)
    got, got_meta = _rows(root, tmp_path / "parts.parquet", *flags)
    assert parts and max(parts) > 10
    assert got == whole
    assert got_meta == whole_meta
    assert any(r["object_index"] is not None for r in got)
    if migrated and flags:  # (the migration changed the store: its rows say so)
        assert got != before


def test_a_failed_write_of_the_temporary_files_names_the_folder(tmp_path, tmpdir_of_scan, monkeypatch):
    root = tmp_path / "root"
    _store(root, "vllm")

    opened = pa.OSFile

    def full(path, mode="rb"):  # TMPDIR full: every file the scan writes there fails
        if mode != "rb" and str(path).startswith(str(tmpdir_of_scan)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return opened(path, mode)

    monkeypatch.setattr(pa, "OSFile", full)
    code, text = run("scan", root, "-o", tmp_path / "m.parquet")
    assert code == 8, text
    assert "cannot write the scan's temporary files of a Mooncake store: no space left on device" in text
    assert str(tmpdir_of_scan) in text and "TMPDIR" in text
    assert not (tmp_path / "m.parquet").exists()
    gc.collect()
    assert list(tmpdir_of_scan.iterdir()) == []


def test_the_folder_is_removed_after_the_scan_and_after_a_killed_one(tmp_path, tmpdir_of_scan):
    root = tmp_path / "root"
    _store(root, "sglang")
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    namespace = scratch.owner().split(".")[0]
    left = tmpdir_of_scan / f"kvmigrate-scan-store-{namespace}.{dead}-x"  # a scan killed by SIGKILL left it
    left.mkdir()
    (left / "walk-1.arrow").write_bytes(b"")
    code, text = run("scan", root, "-o", tmp_path / "m.parquet")
    assert code in (0, 1, 2, 3, 4, 5, 6, 7), text
    gc.collect()
    assert list(tmpdir_of_scan.iterdir()) == []
