"""A Mooncake store's objects are judged a partition at a time from temporary files
(kvmigrate/scan/store_spill.py): the rows are those of one partition holding every object,
a failed write of the files is an operational error naming their folder, and the folder is
removed after the scan (and after a scan killed before it could remove its own)."""

from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path

import pytest

from kvmigrate import manifest, scratch
from kvmigrate.formats import mooncake as M
from kvmigrate.scan import store_spill
from kvmigrate.synth import SynthSpec, build

from helpers.cli_helpers import run

# the defects whose verdicts compare objects across buckets, client roots and KVEntry paths
DEFECTS = {"bucket": ("replica_mismatch", "short", "misfiled", "size_mismatch", "zero_filled", "unsupported_key",
                      "orphan_data"),
           "file_per_key": ("short", "misfiled", "size_mismatch", "zero_filled", "unsupported_key", "header_invalid",
                            "tmp_leftover")}


GEOMETRY = ("--total-kv-heads", "8", "--head-dim", "4", "--layers", "2", "--page-tokens", "4", "--dtype-bytes", "2")


def _store(root: Path, engine: str, backend: str = "bucket") -> None:
    build(root, SynthSpec(family="mooncake", mc_engine=engine, mc_backend=backend, tp=2, layers=2, block_tokens=4,
                          blocks=24, defects=DEFECTS[backend]))
    if backend == "file_per_key":
        _path_holders(root / "store")


def _path_holders(store: Path) -> None:  # (of its first client root)
    """KVEntries whose path another block's target names (§3.5), judged in other partitions:
    a misfiled copy of an entry, another block's entry at the paths an entry is rekeyed to
    (tenant prod, or scoped from raw), and a key of no grammar at its own fpk path whose
    name is an entry's but for a `:`."""
    def key_of(p: Path) -> bytes | None:
        try:
            return M.decode_kv_entry(p.read_bytes()).key
        except M.DecodeError:
            return None

    client = next(p for p in sorted(store.rglob(M.DEFAULT_FSDIR)) if p.is_dir()).parent  # (SGLang: rank_0)
    entries = [p for p in sorted((client / M.DEFAULT_FSDIR).rglob("*")) if p.is_file() and not p.is_symlink()
               and not p.name.endswith(".tmp") and key_of(p)]
    first, second, third = entries[0], entries[-1], entries[len(entries) // 2]
    a = first.parent.parent
    copy = a.parent / ("b" if a.name != "b" else "c") / first.parent.name / first.name
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(first, copy)
    engine_key = M.parse_storage_key(key_of(second) or b"").engine
    for target in (M.scoped(engine_key, "prod"), M.scoped(engine_key)):
        path = client / M.fpk(target)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(third, path)
    key = key_of(second) or b""
    twin = key.replace(b"rank:", b"rank_", 1) if b"rank:" in key else key[:-1] + b"x"
    path = client / M.fpk(twin)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(M.encode_kv_entry(M.KVEntry(twin, M.decode_kv_entry(second.read_bytes()).value)))


def _rows(root: Path, out: Path, *flags: str) -> tuple[list[dict], dict]:
    code, text = run("scan", root, "-o", out, "--verify", "hash", *flags)
    assert code in (0, 1, 2, 3, 4, 5, 6, 7), text
    t = manifest.read_table(out)
    meta = manifest.read_metadata(out)
    meta.pop("command", None)  # (names the manifest)
    return t.to_pylist(), meta


@pytest.mark.parametrize("backend", ["bucket", "file_per_key"])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("flags", [(), ("--target-tenant", "prod"), ("--target-tp", "4", *GEOMETRY)])
@pytest.mark.parametrize("migrated", [False, True])
def test_partitions_give_the_rows_of_one(tmp_path, tmpdir_of_scan, monkeypatch, backend, engine, flags, migrated):
    """A store split into partitions of 5 objects has the rows of one partition: with
    defects, at another tenant or TP, and after a migration (retired entries, keys the
    target holds, blocks in two layouts); a file-per-key store's KVEntries too, with
    entries at paths other blocks' targets name."""
    root = tmp_path / "root"
    _store(root, engine, backend)
    before = None
    if migrated:
        before, _ = _rows(root, tmp_path / "before.parquet", *flags)
        code, text = run("migrate", "--manifest", tmp_path / "before.parquet", "--apply", "--engine-stopped")
        assert code in (0, 1, 2, 3, 4, 5, 6, 7), text
    whole, whole_meta = _rows(root, tmp_path / "whole.parquet", *flags)
    parts: list[int] = []
    split = store_spill.ObjectSpill.partition

    def partition(self):
        split(self)
        parts.append(len(self.parts))

    monkeypatch.setattr(store_spill, "PART_OBJECTS", 5)
    monkeypatch.setattr(store_spill.ObjectSpill, "partition", partition)
    got, got_meta = _rows(root, tmp_path / "parts.parquet", *flags)
    assert parts and max(parts) > 10
    assert got == whole
    assert got_meta == whole_meta
    assert any(r["object_index"] is not None for r in got) or backend == "file_per_key"
    if migrated and flags:  # (the migration changed the store: its rows say so)
        assert got != before


def test_a_failed_write_of_the_temporary_files_names_the_folder(tmp_path, scan_with_full_tmpdir):
    root = tmp_path / "root"
    _store(root, "vllm")
    text = scan_with_full_tmpdir(root)
    assert "cannot write the scan's temporary files of a Mooncake store: no space left on device" in text


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
