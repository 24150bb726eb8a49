"""Walk details: what is where in a root, --verify none, progress, odd names."""

from __future__ import annotations

import os

from kvmigrate import layout
from kvmigrate.options import ScanOptions


def test_empty_root_has_no_rows_and_says_nothing_is_there(tmp_path, scan_root):
    root = tmp_path / "empty"
    root.mkdir()
    scan, rows = scan_root(root)
    assert rows == {} and scan.exit_code == 8  # an empty or unmounted root (interface.md §4)
    assert scan.summary["no_cache"] is True


def test_base_folder_without_rank_folder_is_noted_not_failed(synth_root, scan_root):
    root, (result,) = synth_root(dict(family="vllm", scheme="S2"))
    ns = result.namespaces[0]
    for dirpath, _dirnames, filenames in os.walk(root / ns["rank_dirs"][0], topdown=False):
        for f in filenames:
            os.unlink(os.path.join(dirpath, f))
        os.rmdir(dirpath)
    scan, rows = scan_root(root, flags={"model_dtype": "bfloat16", "writer_tp": 1, "writer_pp": 1})
    assert list(rows) == [ns["config_relpath"]]
    assert rows[ns["config_relpath"]]["status"] == "ok" and "no rank folder" in rows[ns["config_relpath"]]["reason"]
    assert scan.exit_code == 0


def test_vllm_rank_folder_beyond_r0_is_foreign(synth_root, scan_root):
    """vLLM writes only _r0 (the scheduler's row); an S2 namespace with _r1 files has
    something else in it."""
    root, (result,) = synth_root(dict(family="vllm", scheme="S2"))
    ns = result.namespaces[0]
    src = root / result.block_files()[0]
    extra = root / layout.rank_dir_name(ns["base_name"], 1) / src.relative_to(root / ns["rank_dirs"][0])
    extra.parent.mkdir(parents=True)
    extra.write_bytes(src.read_bytes())
    scan, rows = scan_root(root, flags={"model_dtype": "bfloat16", "writer_tp": 1, "writer_pp": 1})
    row = rows[str(extra.relative_to(root))]
    assert row["status"] == "foreign" and "outside the writer's ranks" in row["reason"]
    assert rows[result.block_files()[0]]["action"] == "link"


def test_verify_none_stats_but_judges_no_sizes(synth_root, scan_root):
    root, (result,) = synth_root(dict(family="vllm", scheme="S2", defects=("size_mismatch",)))
    victim = result.defect("size_mismatch")["relpath"]
    _, rows = scan_root(root, flags={"model_dtype": "bfloat16"}, verify="none")
    assert rows[victim]["status"] == "ok" and rows[victim]["size"] == result.defect("size_mismatch")["size"]
    assert all(r["content_xxh3_128"] is None and r["inode"] for r in rows.values())
    _, rows = scan_root(root, flags={"model_dtype": "bfloat16"}, verify="size")
    assert rows[victim]["status"] == "size_mismatch"


def test_undecodable_file_name_is_a_foreign_row(synth_root, scan_root):
    root, (result,) = synth_root(dict(family="vllmcpp"))
    odd = os.path.join(os.fsencode(root / result.namespaces[0]["rank_dirs"][0]), b"caf\xe9.txt")
    with open(odd, "wb") as f:
        f.write(b"x")
    scan, rows = scan_root(root)
    odd_rows = [r for rel, r in rows.items() if rel.endswith(".txt")]
    assert len(odd_rows) == 1 and odd_rows[0]["status"] == "foreign"
    assert "\\xe9" in odd_rows[0]["relpath"]


def test_own_artifacts_anywhere_are_not_findings(synth_root, scan_root):
    root, (result,) = synth_root(dict(family="vllm", scheme="S2"))
    ns = result.namespaces[0]
    block = root / result.block_files()[0]
    (root / ns["base_name"] / layout.LOCK_NAME).write_text("pid 1\n")
    (block.parent / (block.name + ".kvmigrate-4242.tmp")).write_bytes(b"partial")
    (root / "m.parquet.kvmigrate-77.tmp").write_bytes(b"partial manifest")
    scan, rows = scan_root(root, flags={"model_dtype": "bfloat16", "kv_kind": "full", "total_kv_heads": 8,
                                        "writer_tp": 1, "writer_pp": 1})
    own = {rel for rel, r in rows.items() if r["status"] == "own_artifact"}
    assert len(own) == 3 and scan.exit_code == 1  # no finding: the blocks are pending migration only


def test_progress_bar_goes_to_stderr(synth_root, tmp_path, capsys):
    from kvmigrate.pipeline import scan

    root, _ = synth_root(dict(family="vllmcpp", blocks=20))
    scan(root, tmp_path / "m.parquet", ScanOptions(progress=True, threads=1))
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "files" in captured.err and "21" in captured.err  # 20 blocks + config.json


def test_the_roots_own_and_foreign_folders_are_written_in_batches_in_walk_order(synth_root, tmp_path, monkeypatch):
    """kvmigrate's own folder (a prune's quarantine holds every file it moved) and a foreign
    folder are handed on FOLDER_BATCH rows at a time: the manifest is the one of a single
    batch, row for row."""
    from kvmigrate import manifest as mf
    from kvmigrate.scan import walker

    from helpers.cli_helpers import run

    root, _ = synth_root(dict(family="llmd", tp=2, kv_kind="mla"))
    for top in (layout.OWN_DIR + "/quarantine/run1", "notes"):
        for k in range(7):
            d = root / top / f"d{k % 3}" / f"e{k}"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"f{k}.bin").write_bytes(b"x" * k)
    tables = []
    for batch in (10_000, 2):
        monkeypatch.setattr(walker, "FOLDER_BATCH", batch)
        out = tmp_path / f"m{batch}.parquet"
        code, text = run("scan", root, "--kv-kind", "mla", "--model-dtype", "bfloat16", "-o", out, "-q")
        assert code in (0, 1, 5), text
        tables.append(mf.read_table(out).drop_columns(["ctime_ns"]))
    rel = tables[1]["relpath"].to_pylist()
    assert tables[0].equals(tables[1])
    assert sum(r.startswith(layout.OWN_DIR + "/quarantine/") for r in rel) == 7
    assert sum(r.startswith("notes/") for r in rel) == 7
