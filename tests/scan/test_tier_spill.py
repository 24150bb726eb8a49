"""An LMCache tier's chunk files are judged a partition of chunk hashes at a time from
temporary files (kvmigrate/scan/tier_spill.py), its top folder's names sorted in runs on
disk: the rows are those of one piece, a failed write of the files is an operational error
naming their folder, and the folder is removed after the scan."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from kvmigrate import manifest
from kvmigrate.formats import lmcache as L
from kvmigrate.scan import flat_spill, tier_rows, tier_spill
from kvmigrate.synth import SynthSpec, build

from helpers.cli_helpers import run

FACTS = ("--writer-release", "0.5.6", "--pythonhashseed", "0", "--target-tp", "2",
         "--no-target-save-only-first-rank", "--total-kv-heads", "8", "--head-dim", "4", "--layers", "1",
         "--latent-dim", "8")
# each backend with the defects whose verdicts compare files (a data file and its sidecar,
# a chunk's ranks, the modal size, the header vote) and files of no chunk name
DEFECTS = {"fs": ("tmp", "zero_filled", "short", "size_mismatch", "header_invalid", "foreign", "symlink"),
           "gds": ("tmp", "zero_filled", "short", "header_invalid", "corrupt_sidecar", "orphan_data", "misfiled",
                   "symlink"),
           "local_disk": ("zero_filled", "short", "size_mismatch", "foreign"),
           "mp": ("tmp", "zero_filled", "short", "size_mismatch", "symlink")}


def _tier(root: Path, backend: str, kv_kind: str, defects: tuple[str, ...] = ()) -> None:
    """A tier of two deployments (TP 1 and TP 2) over the same chunk hashes, so that the TP 1
    chunks' target names (TP 2) are the other deployment's files, with `defects` in the last
    one (MP MLA: TP 1 alone, its key is the same at every TP)."""
    era = "lmc-mp1" if backend == "mp" else "lmc-k3"
    tps = (1,) if backend == "mp" and kv_kind == "mla" else (1, 2)
    for tp in tps:
        with_defects = defects if tp == tps[-1] else ()
        build(root, SynthSpec(family="lmcache", lmc_backend=backend, lmc_era=era, tp=tp, kv_kind=kv_kind, layers=1,
                              block_tokens=1, blocks=16, seed=1, defects=with_defects,
                              lmc_save_only_first_rank=not (kv_kind == "mla" and backend != "mp")))


def _rows(root: Path, out: Path, verify: str) -> tuple[list[dict], dict]:
    code, text = run("scan", root, "-o", out, "--verify", verify, *FACTS)
    assert code in (0, 1, 2, 3, 4, 5, 6, 7), text
    rows = sorted(manifest.read_table(out).to_pylist(), key=lambda r: r["relpath"])
    meta = manifest.read_metadata(out)
    meta.pop("command", None)  # (names the manifest)
    return rows, meta


@pytest.mark.parametrize("backend", sorted(DEFECTS))
@pytest.mark.parametrize("kv_kind", ["mla", "full"])
@pytest.mark.parametrize("verify", ["none", "hash"])
def test_partitions_give_the_rows_of_one(tmp_path, tmpdir_of_scan, monkeypatch, backend, kv_kind, verify):
    """A tier split into partitions of 2 chunk files, walked and written in batches of 2 or
    3, its top folder's names sorted 3 at a time, has the rows of one piece."""
    root = tmp_path / "root"
    _tier(root, backend, kv_kind, DEFECTS[backend])
    whole, whole_meta = _rows(root, tmp_path / "whole.parquet", verify)
    parts: list[int] = []
    split = tier_spill.FileSpill.partition

    def partition(self):
        split(self)
        parts.append(len(self.parts))

    monkeypatch.setattr(tier_spill.FileSpill, "partition", partition)
    for module, name, value in ((tier_spill, "PART_FILES", 2), (tier_spill, "WALK_BATCH", 3),
                                (tier_spill, "RUN_BATCH", 2), (tier_rows, "BATCH_ROWS", 3),
                                (flat_spill, "RUN_NAMES", 3), (tier_rows, "NAMES_BATCH", 2)):
        monkeypatch.setattr(module, name, value)
    got, got_meta = _rows(root, tmp_path / "parts.parquet", verify)
    assert parts and max(parts) > 4
    assert got == whole
    assert got_meta == whole_meta
    assert {r["status"] for r in whole} - {"ok"}  # (the defects are judged)


# how many of a chunk file's first bytes its verdicts read (families/lmcache.py `head_read`):
# a GDS data file's header, an fs file's RemoteMetadata, a local_disk `.pt`'s safetensors
# length and `{`; an MP file's none; a GDS sidecar's all (its length is a verdict)
HEAD_READ = {"gds": 4096, "fs": 28, "local_disk": 10, "mp": 0}


@pytest.mark.parametrize("backend", sorted(DEFECTS))
@pytest.mark.parametrize("verify", ["size", "hash"])
def test_the_spill_keeps_only_the_first_bytes_the_verdicts_read(tmp_path, tmpdir_of_scan, monkeypatch, backend,
                                                                verify):
    """A chunk file goes to TMPDIR with the bytes of its head a verdict reads, not the 8 KiB
    the walk reads: a GDS data file took 8 KiB there where its header is 4 KiB."""
    root = tmp_path / "root"
    _tier(root, backend, "full", DEFECTS[backend])
    spilled: dict[str, int] = {}
    encode = tier_spill.encode

    def spy(files, ordinals, parts=None):
        batch = encode(files, ordinals, parts)
        for name, head in zip(batch.column("name").to_pylist(), batch.column("head").to_pylist()):
            if head is not None:  # (a run's rows keep none)
                spilled[name.decode()] = len(head)
        return batch

    monkeypatch.setattr(tier_spill, "encode", spy)
    _rows(root, tmp_path / "m.parquet", verify)
    assert spilled
    sizes = {p.name: p.lstat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink()}
    for name, n in spilled.items():
        chunk = L.parse_name(name)
        assert chunk is not None, name
        if chunk.sidecar:
            assert n == min(sizes[name], 8192), name
        else:
            assert n == min(sizes[name], HEAD_READ[chunk.backend]), (name, n)


def test_a_failed_write_of_the_temporary_files_names_the_folder(tmp_path, scan_with_full_tmpdir):
    root = tmp_path / "root"
    _tier(root, "gds", "full")
    text = scan_with_full_tmpdir(root)
    assert "cannot write the scan's temporary files of an LMCache tier: no space left on device" in text


def test_the_folder_is_removed_after_the_scan(tmp_path, tmpdir_of_scan, monkeypatch):
    root = tmp_path / "root"
    _tier(root, "fs", "full", ("tmp", "foreign"))
    monkeypatch.setattr(flat_spill, "RUN_NAMES", 3)  # (the top folder's names go to runs too)
    code, text = run("scan", root, "-o", tmp_path / "m.parquet")
    assert code in (0, 1, 2, 3, 4, 5, 6, 7), text
    gc.collect()
    assert list(tmpdir_of_scan.iterdir()) == []
