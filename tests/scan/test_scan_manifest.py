"""The manifest scan writes (interface.md §2), --shard coverage, --json and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from kvmigrate import manifest
from kvmigrate.cli import cli
from kvmigrate.errors import UsageError

CONTRACT = {
    "relpath": pa.string(), "family": pa.string(), "scheme": pa.string(), "model_name": pa.string(),
    "source_d12": pa.string(), "source_base": pa.string(), "deployment": pa.string(),
    "target_profile": pa.string(), "target_d12": pa.string(), "target_base": pa.string(),
    "rank": pa.int32(), "group": pa.int32(), "block_hash": pa.binary(), "size": pa.int64(),
    "mtime_ns": pa.int64(), "inode": pa.uint64(), "dev": pa.uint64(), "nlink": pa.uint32(),
    "content_xxh3_128": pa.binary(16), "payload_xxh3_128": pa.binary(16), "status": pa.string(),
    "action": pa.string(), "reason": pa.string(), "target_relpath": pa.string(),
    # the typed finding of the reason (manifest version 2, kvmigrate.findings)
    "finding": pa.string(), "primary_rank": pa.int32(), "of_action": pa.string(), "cell_bytes": pa.int64(),
    "row_cells": pa.int32(), "output_bytes": pa.int64(), "asks": pa.string(), "aliases_relpath": pa.string(),
    # manifest version 3: the inode change time and whether a --baseline carried the row's hashes
    "ctime_ns": pa.int64(), "carried": pa.bool_(),
    # manifest version 4: the object columns (a Mooncake index's entries; null on every other row)
    "object_index": pa.int32(), "object_key": pa.binary(), "target_key": pa.binary(),
}
MIXED = (dict(family="llmd", tp=2, kv_kind="mla", defects=("missing_rank", "tmp_vllm", "size_mismatch")),
         dict(family="vllm", scheme="S3", tp=2, kv_kind="mla", replicated_layout=True, model_name="deepseek/V2",
              defects=("deep_layout",)),
         dict(family="vllmcpp", tp=2, kv_kind="mla", defects=("header_key", "foreign"), model_name="Qwen/Qwen3-4B"))


@pytest.fixture
def mixed_root(synth_root):
    root, results = synth_root(*MIXED)
    (root / ".kvmigrate" / "journals").mkdir(parents=True)
    (root / ".kvmigrate" / "journals" / "run-1.jsonl").write_text("{}\n")
    (root / "notes.txt").write_text("ops notes\n")
    return root, results


def test_schema_every_column_name_and_type(mixed_root, scan_root, tmp_path):
    root, _ = mixed_root
    scan, _ = scan_root(root, verify="hash", flags={"model_dtype": "bfloat16", "kv_kind": "mla"})
    schema = pq.read_schema(scan.output)
    assert schema.names == list(CONTRACT)
    for name, typ in CONTRACT.items():
        got = schema.field(name).type
        if pa.types.is_dictionary(got):
            got = got.value_type
        assert got == typ, (name, got)
    table = pq.read_table(scan.output)
    assert table.num_rows == scan.rows
    assert pc_count_valid(table, "content_xxh3_128") == table.num_rows  # --verify hash: every file hashed
    cpp = [r for r in table.to_pylist() if r["family"] == "vllmcpp" and r["block_hash"] is not None]
    assert cpp and all(r["payload_xxh3_128"] is not None for r in cpp)
    others = [r for r in table.to_pylist() if r["family"] in ("vllm", "llmd")]
    assert others and all(r["payload_xxh3_128"] is None for r in others)


def test_column_chunks_are_zstd_with_dictionaries_only_where_values_repeat(mixed_root, scan_root):
    """The writer's choices: zstd on every column chunk; dictionary pages on the columns of
    repeated values, plain pages on paths, inodes and hashes."""
    root, _ = mixed_root
    scan, _ = scan_root(root, verify="hash", flags={"model_dtype": "bfloat16", "kv_kind": "mla"})
    meta = pq.ParquetFile(scan.output).metadata
    assert meta.num_row_groups >= 1
    for g in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            chunk = meta.row_group(g).column(c)
            assert chunk.compression == "ZSTD", chunk.path_in_schema
            assert chunk.has_dictionary_page == (chunk.path_in_schema in manifest.DICTIONARY_COLUMNS), \
                chunk.path_in_schema


def pc_count_valid(table: pa.Table, column: str) -> int:
    return table.num_rows - table[column].null_count


def test_metadata_reads_back(mixed_root, scan_root):
    root, results = mixed_root
    scan, rows = scan_root(root, flags={"model_dtype": "bfloat16", "kv_kind": "mla"}, verify="size",
                           command="kvmigrate scan ROOT --kv-kind mla")
    meta = manifest.read_metadata(scan.output)
    assert meta["tool_version"] and meta["command"] == "kvmigrate scan ROOT --kv-kind mla"
    assert meta["root"] == str(root) and meta["target_profile"] == "vllm-0.34"
    assert meta["verify"] == "size" and meta["shard"] == "0/1"
    assert meta["facts"]["flags"] == {"model_dtype": "bfloat16", "kv_kind": "mla"}
    bases = {ns["base_name"] for r in results for ns in r.namespaces}
    assert set(meta["namespaces"]) == bases
    for r in results:
        for ns in r.namespaces:
            m = meta["namespaces"][ns["base_name"]]
            assert m["config_json"] == ns["fields"] and m["digest_ok"] is True
            assert m["family"] == ns["expected_family"] and m["status"] == "ok"
            assert m["target"]["base_name"] and "reasons" in m["target"]
            assert m["facts_source"].get("kv_kind") == "flag" or ns["family"] == "vllmcpp"
            assert m["deployment"] == ns["deployment"]


def test_files_outside_buckets_are_rows(mixed_root, scan_root):
    root, results = mixed_root
    _, rows = scan_root(root)
    assert rows["notes.txt"]["status"] == "foreign" and rows["notes.txt"]["rank"] is None
    assert rows[".kvmigrate/journals/run-1.jsonl"]["status"] == "own_artifact"
    for r in results:
        for ns in r.namespaces:
            row = rows[ns["config_relpath"]]
            assert row["status"] == "ok" and row["block_hash"] is None and row["group"] is None


@pytest.mark.parametrize("n", [2, 3, 7])
def test_shards_cover_the_tree_exactly_once(mixed_root, scan_root, n):
    root, _ = mixed_root
    flags = {"model_dtype": "bfloat16", "kv_kind": "mla"}
    _, whole = scan_root(root, flags=flags)
    union: dict[str, dict] = {}
    for k in range(n):
        part, rows = scan_root(root, flags=flags, shard=(k, n))
        assert manifest.read_metadata(part.output)["shard"] == f"{k}/{n}"
        assert not set(rows) & set(union), "a file in two shards"
        union.update(rows)
    assert set(union) == set(whole)
    for rel, row in whole.items():
        assert {c: union[rel][c] for c in ("status", "action", "reason", "target_relpath")} == \
               {c: row[c] for c in ("status", "action", "reason", "target_relpath")}, rel


def test_shard_parts_follow_the_bucket(mixed_root, scan_root):
    """Part k holds the files whose innermost <hhh> folder has int(hhh, 16) % N == k; an
    old deep layout is shared out by its buckets too."""
    root, _ = mixed_root
    _, rows = scan_root(root, shard=(1, 2))
    assert rows and any(r["status"] == "unsupported_layout" for r in rows.values())
    for rel in rows:
        buckets = [p for p in rel.split("/")[:-1] if len(p) == 3 and all(c in "0123456789abcdef" for c in p)]
        assert buckets and int(buckets[-1], 16) % 2 == 1, rel


def test_small_batches_give_the_same_manifest(mixed_root, scan_root, monkeypatch):
    from kvmigrate.scan import run as scan_run

    root, _ = mixed_root
    _, big = scan_root(root, threads=1)
    monkeypatch.setattr(scan_run, "BATCH_ROWS", 3)
    scan, small = scan_root(root, threads=4)
    assert big.keys() == small.keys()
    assert all(big[k]["action"] == small[k]["action"] and big[k]["status"] == small[k]["status"] for k in big)
    assert pq.ParquetFile(scan.output).num_row_groups > 1


# -- CLI -----------------------------------------------------------------------------------

JSON_KEYS = {"root", "target_profile", "totals", "namespaces", "exit_code"}
NS_KEYS = {"source_base", "family", "scheme", "model_name", "ranks", "target_base", "gate", "assumed_facts",
           "by_status", "by_action"}


def test_cli_json_summary_and_exit_code(mixed_root, tmp_path):
    root, results = mixed_root
    out = tmp_path / "m.parquet"
    res = CliRunner().invoke(cli, ["scan", str(root), "-o", str(out), "--json", "--model-dtype", "bfloat16",
                                   "--kv-kind", "mla"])
    summary = json.loads(res.stdout)
    assert set(summary) >= JSON_KEYS
    assert {"files", "bytes", "by_status", "by_action"} <= set(summary["totals"])
    for ns in summary["namespaces"]:
        assert set(ns) >= NS_KEYS
        assert set(ns["gate"]) >= {"parallel_agnostic", "replicated_layout", "reasons"}
    by_status = summary["totals"]["by_status"]
    assert set(by_status) == {"ok", "incomplete", "tmp_leftover", "header_invalid", "foreign", "own_artifact",
                              "size_mismatch", "unsupported_layout"}
    assert all(set(v) == {"files", "bytes"} for v in by_status.values())
    assert all(set(v) == {"blocks", "bytes"} for v in summary["totals"]["by_action"].values())
    # incomplete 1, tmp 1, header_invalid 1+4, foreign 1
    assert res.exit_code == summary["exit_code"] == 5
    assert out.exists()


def test_cli_clean_tree_exits_zero(synth_root, tmp_path):
    root, _ = synth_root(dict(family="vllmcpp"))
    res = CliRunner().invoke(cli, ["scan", str(root), "-o", str(tmp_path / "m.parquet"), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["exit_code"] == 0


def test_cli_missing_fact_names_the_flag(synth_root, tmp_path):
    root, _ = synth_root(dict(family="llmd", tp=2))
    res = CliRunner().invoke(cli, ["scan", str(root), "-o", str(tmp_path / "m.parquet"), "--json"])
    summary = json.loads(res.stdout)
    assert res.exit_code == 1
    assert summary["missing_facts"][0]["flag"] == "--model-dtype"


def test_cli_default_output_in_the_working_directory(synth_root, tmp_path, monkeypatch):
    root, _ = synth_root(dict(family="vllmcpp"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    res = CliRunner().invoke(cli, ["scan", str(root), "-q"])
    assert res.exit_code == 0, res.output
    assert (work / "kvmigrate-manifest.parquet").exists()
    assert not list(work.glob("*.tmp"))


@pytest.mark.parametrize("what", ["missing", "file"])
def test_cli_bad_root_is_a_message_not_a_traceback(tmp_path, what):
    root = tmp_path / "nope"
    if what == "file":
        root.write_text("x")
    res = CliRunner().invoke(cli, ["scan", str(root), "-o", str(tmp_path / "m.parquet")])
    assert res.exit_code == 2
    assert str(root) in res.output and "Traceback" not in res.output
    assert not (tmp_path / "m.parquet").exists()


def test_cli_bad_shard_is_a_usage_error(synth_root, tmp_path):
    root, _ = synth_root(dict(family="vllmcpp"))
    res = CliRunner().invoke(cli, ["scan", str(root), "-o", str(tmp_path / "m.parquet"), "--shard", "3/2"])
    assert res.exit_code == 2


def test_cli_subprocess_no_progress_when_not_a_tty(synth_root, tmp_path):
    """stdout holds only the JSON, stderr no progress bar when it is not a terminal."""
    root, _ = synth_root(dict(family="vllm", scheme="S2"))
    proc = subprocess.run([sys.executable, "-m", "kvmigrate", "scan", str(root), "-o", str(tmp_path / "m.parquet"),
                           "--json", "--model-dtype", "bfloat16", "--kv-kind", "full", "--total-kv-heads", "8",
                           "--writer-tp", "1", "--writer-pp", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr  # 6 blocks pending
    assert json.loads(proc.stdout)["totals"]["by_action"]["link"]["blocks"] == 6
    assert "files/s" not in proc.stderr and "scan:" not in proc.stderr


def _as_version_3(src, dst):
    """A manifest as kvmigrate wrote it before the object columns (format version 3)."""
    t = pq.read_table(src)
    meta = json.loads(t.schema.metadata[manifest.META_KEY])
    meta["manifest_version"] = 3
    pq.write_table(t.drop_columns(list(manifest.OBJECT_COLUMNS)).replace_schema_metadata(
        {manifest.META_KEY: json.dumps(meta).encode()}), dst)


def test_a_version_3_manifest_reads_with_null_object_columns(synth_root, scan_root, tmp_path):
    """Version 4 adds the object columns; a manifest of version 3 stays readable (mooncake.md
    §4): report and migrate read it as they read today's, its object columns null."""
    root, _ = synth_root(*MIXED)
    scan, _ = scan_root(root, flags={"model_dtype": "bfloat16", "kv_kind": "mla"})
    old = tmp_path / "v3.parquet"
    _as_version_3(scan.output, old)
    t = manifest.read_table(old)
    assert t.schema.names == list(manifest.COLUMNS) and t.num_rows == scan.rows
    assert all(t.column(c).null_count == t.num_rows for c in manifest.OBJECT_COLUMNS)
    some = manifest.read_table(old, columns=["relpath", "object_key"])
    assert some.schema.names == ["relpath", "object_key"]
    batches = list(manifest.iter_batches(old, columns=["object_index", "status"]))
    assert sum(b.num_rows for b in batches) == scan.rows and batches[0].schema.names == ["object_index", "status"]
    runner = CliRunner()
    new_report = runner.invoke(cli, ["report", str(scan.output), "--format", "json"])
    old_report = runner.invoke(cli, ["report", str(old), "--format", "json"])
    assert old_report.exit_code == new_report.exit_code, old_report.output
    assert json.loads(old_report.stdout)["totals"] == json.loads(new_report.stdout)["totals"]
    plan = runner.invoke(cli, ["migrate", "--manifest", str(old), "--json"])
    assert plan.exit_code in (0, 1, 5), plan.output
    meta = dict(manifest.read_metadata(old))
    meta["manifest_version"] = 2
    with pytest.raises(UsageError, match="format version 2"):
        manifest.check_version(meta, old)
