"""The scan's flat-directory path (kvmigrate/scan/flat.py) at scale: the compiled
`stat_flat` that stats (or reads and hashes) a folder's page files by file descriptor,
the Python walk that words what it leaves, and rows that reach the manifest writer in
batches, on real files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import xxhash

from kvmigrate import manifest, pipeline
from kvmigrate.identity.facts import FactsResolver
from kvmigrate.options import ScanOptions
from kvmigrate.scan import flat as scan_flat
from kvmigrate.scan import run as scan_run
from kvmigrate.scan import walker as scan_walker

REPO = Path(__file__).resolve().parents[2]
SGL = {"family": "sglang", "blocks": 5, "layers": 2}
PAGE = "a" * 64 + "_m.bin"


def _files(tmp_path: Path) -> Path:
    d = tmp_path / "dir"
    d.mkdir()
    (d / PAGE).write_bytes(b"\x01\x02\x03\x04\x05\x06")
    (d / ("b" * 64 + "_m.bin")).write_bytes(b"\x07\x08")  # shorter than the head
    (d / ("c" * 64 + "_m.bin")).write_bytes(b"")  # empty: a finding
    (d / ("d" * 64 + "_m.bin")).write_bytes(bytes(64))  # zero-filled: a finding
    os.symlink(PAGE, d / ("e" * 64 + "_m.bin"))  # never followed
    (d / ("f" * 64 + "_é.bin")).write_bytes(b"xyz")  # not ASCII: left to Python
    return d


NAMES = ("a" * 64 + "_m.bin", "b" * 64 + "_m.bin", "c" * 64 + "_m.bin", "d" * 64 + "_m.bin", "e" * 64 + "_m.bin",
         "f" * 64 + "_é.bin", "g" * 64 + "_m.bin")  # (the last one does not exist)


def _column(stats: bytes, n: int, k: int) -> list[int]:
    col = memoryview(stats).cast("q")
    return list(col[k * n:(k + 1) * n])


def test_stat_flat_stats_regular_files_as_lstat_and_leaves_the_rest_to_python(tmp_path):
    from kvmigrate import _leafwalk

    d = _files(tmp_path)
    codes, stats, digests, heads = _leafwalk.stat_flat(str(d), NAMES, False)
    assert list(codes) == [0, 0, 0, 0, 1, 1, 1]  # symlink, non-ASCII name, vanished: Python words them
    assert digests is None and heads is None
    n = len(NAMES)
    for i, name in enumerate(NAMES[:4]):
        st = os.lstat(d / name)
        assert [_column(stats, n, k)[i] for k in range(5)] == [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev,
                                                                st.st_nlink]


def test_stat_flat_hashed_gives_hash_and_head_of_plain_files_only(tmp_path):
    from kvmigrate import _leafwalk

    d = _files(tmp_path)
    codes, stats, digests, heads = _leafwalk.stat_flat(str(d), NAMES, True)
    assert list(codes) == [0, 0, 1, 1, 1, 1, 1]  # empty and zero-filled files are findings Python words
    assert digests[:16] == xxhash.xxh3_128_digest(b"\x01\x02\x03\x04\x05\x06")
    assert digests[16:32] == xxhash.xxh3_128_digest(b"\x07\x08")
    assert heads[:4] == b"\x01\x02\x03\x04" and heads[4:6] == b"\x07\x08"
    assert _column(stats, len(NAMES), 0)[:2] == [6, 2]


def test_c_walk_stats_the_pages_in_c_and_writes_the_python_walks_manifest(synth_root, tmp_path, monkeypatch):
    root, _ = synth_root({**SGL, "sgl_era": "e2", "tp": 2, "kv_kind": "mla", "model_name": "m",
                          "defects": ("replica_differs",)},
                         {**SGL, "tp": 2, "model_name": "x", "defects": ("short", "zero_filled", "symlink",
                                                                         "tmp_sglang", "size_mismatch")},
                         {**SGL, "sgl_era": "e1", "model_name": "z", "seed": 3})
    flags = {"kv_kind": "mla", "model_name": "m", "writer_layout": "page_first"}
    calls = []
    leaf = scan_walker.leaf_walk()
    real = leaf.stat_flat

    class Spy:
        def __getattr__(self, name):
            return getattr(leaf, name)

        def stat_flat(self, *args):
            calls.append(args[2])
            return real(*args)

    for verify in ("size", "hash"):
        manifests = {}
        for walk in ("python", "c"):
            if walk == "python":
                monkeypatch.setenv("KVMIGRATE_PURE_PYTHON", "1")
            else:
                monkeypatch.delenv("KVMIGRATE_PURE_PYTHON", raising=False)
                monkeypatch.setattr(scan_walker, "leaf_walk", lambda: Spy())
            out = tmp_path / f"{walk}-{verify}.parquet"
            result = pipeline.scan(root, out, ScanOptions(facts_resolver=FactsResolver(flags, None), verify=verify))
            manifests[walk] = (result.exit_code, manifest.read_table(out).to_pylist())
            monkeypatch.undo()
        assert manifests["c"] == manifests["python"]
        found = {"short", "size_mismatch", "foreign", "tmp_leftover", "unsupported_layout"}
        if verify == "hash":
            found |= {"zero_filled", "replica_mismatch"}
        assert {r["status"] for r in manifests["c"][1]} >= found
    assert calls and set(calls) == {False, True}  # stat_flat took the pages, in both modes


def test_flat_rows_reach_the_manifest_writer_in_bounded_batches(synth_root, tmp_path, monkeypatch):
    root, _ = synth_root({**SGL, "blocks": 40, "tp": 2, "model_name": "x"},
                         {**SGL, "blocks": 30, "tp": 8, "kv_kind": "mla", "model_name": "y"})
    flags = {"writer_layout": "page_first"}
    whole = tmp_path / "whole.parquet"
    pipeline.scan(root, whole, ScanOptions(facts_resolver=FactsResolver(flags, None), verify="size"))
    sizes = []
    real = manifest.ManifestWriter.write

    def write(self, table):
        sizes.append(table.num_rows)
        return real(self, table)

    monkeypatch.setattr(manifest.ManifestWriter, "write", write)
    monkeypatch.setattr(scan_flat, "BATCH_ROWS", 16, raising=False)
    monkeypatch.setattr(scan_run, "BATCH_ROWS", 16)
    batched = tmp_path / "batched.parquet"
    pipeline.scan(root, batched, ScanOptions(facts_resolver=FactsResolver(flags, None), verify="size"))
    assert sum(sizes) == 110 and len(sizes) >= 110 // 32
    assert max(sizes) <= 2 * 16  # never every page's row in one table
    assert manifest.read_table(batched).to_pylist() == manifest.read_table(whole).to_pylist()


def test_bench_flat_files_sizes_the_flat_directory(tmp_path):
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), "--check-space", "--flat-files", "1234",
                        "--kvmigrate", str(Path(sys.executable).parent / "kvmigrate"),
                        "--workdir", str(tmp_path / "bench")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "flat: 1,234 files of 1,024 B" in p.stdout


def test_the_flat_scan_in_small_runs_chunks_and_windows_writes_the_same_rows(synth_root, tmp_path, monkeypatch):
    """The names sorted in runs on disk, stat-ed a few at a time, and judged in windows
    that cut between two files of one page hash: the same manifest as in one piece, for
    every --verify mode, a --baseline scan and both walks. The tree holds pages whose
    ranks, MLA copies and target names sit in different chunks: an e2 MLA deployment
    beside the e4 names it is read as (already present), an e2 TP 2 one with defects, an
    e1 one and a side pool."""
    from kvmigrate.scan import flat_spill

    root, _ = synth_root({**SGL, "blocks": 9, "sgl_era": "e2", "tp": 2, "kv_kind": "mla", "model_name": "m",
                          "seed": 1, "defects": ("replica_differs",)},
                         {**SGL, "blocks": 5, "kv_kind": "mla", "model_name": "m", "seed": 1},
                         {**SGL, "sgl_era": "e2", "tp": 2, "model_name": "x", "defects": ("short", "zero_filled",
                                                                                          "size_mismatch")},
                         {**SGL, "sgl_era": "e1", "model_name": "z", "seed": 3},
                         {**SGL, "blocks": 7, "tp": 2, "pools": ("mamba",), "seed": 4})
    flags = {"kv_kind": "mla", "model_name": "m", "writer_layout": "page_first"}

    def scan(name: str, verify: str, baseline: Path | None = None) -> tuple[int, list]:
        out = tmp_path / f"{name}.parquet"
        result = pipeline.scan(root, out, ScanOptions(facts_resolver=FactsResolver(flags, None), verify=verify,
                                                      baseline=str(baseline) if baseline else None))
        rows = manifest.read_table(out).to_pylist()
        assert len({r["relpath"] for r in rows}) == len(rows) == len(os.listdir(root))
        return result.exit_code, rows

    whole = {verify: scan(f"whole-{verify}", verify) for verify in ("none", "size", "hash")}
    whole["baseline"] = scan("whole-baseline", "hash", tmp_path / "whole-hash.parquet")
    assert any(r["action"] == "already_present" and r["target_relpath"] != r["relpath"] for r in whole["size"][1])
    monkeypatch.setattr(flat_spill, "RUN_NAMES", 5)
    monkeypatch.setattr(scan_flat, "CHUNK_NAMES", 3)
    monkeypatch.setattr(scan_flat, "PART_ROWS", 4)
    for walk in ("c", "python"):
        if walk == "python":
            monkeypatch.setenv("KVMIGRATE_PURE_PYTHON", "1")
        for verify in ("none", "size", "hash"):
            assert scan(f"{walk}-{verify}", verify) == whole[verify], (walk, verify)
        assert scan(f"{walk}-baseline", "hash", tmp_path / "whole-hash.parquet") == whole["baseline"], walk
