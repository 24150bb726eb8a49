"""Sharded output without Ray: `scan --shard K/N -o DIR/` writes DIR/part-K-of-N.parquet,
and every reader (report, audit, migrate --manifest, verify, rollback) takes the
directory; the result equals that of one unsharded manifest. The directory must be
one complete partition of one scan, else readers refuse it (exit 2).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from kvmigrate import manifest
from kvmigrate.cli import cli
from kvmigrate.scaleout import dataset

MLA = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]
TREE = (dict(family="llmd", tp=2, kv_kind="mla", blocks=16, defects=("missing_rank", "size_mismatch", "tmp_vllm")),
        dict(family="llmd", tp=4, kv_kind="mla", blocks=16),
        dict(family="vllmcpp", tp=2, kv_kind="mla", blocks=16, model_name="Qwen/Qwen3-4B",
             defects=("header_key", "foreign")))


def run(*args) -> tuple[int, str, str]:
    res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def tree_state(root) -> dict:
    """Everything a migration may change under ROOT (its own .kvmigrate/ journals
    aside): every folder, and every file with its bytes and the other paths that
    share its inode (which target is a hard link of which source)."""
    by_inode: dict[int, list[str]] = {}
    files: dict[str, tuple] = {}
    for dirpath, dirs, names in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        dirs[:] = sorted(d for d in dirs if not (rel_dir == "." and d == ".kvmigrate"))
        for d in dirs:
            files[os.path.normpath(os.path.join(rel_dir, d)) + "/"] = ("dir",)
        for name in names:
            rel = os.path.normpath(os.path.join(rel_dir, name))
            st = os.lstat(os.path.join(dirpath, name))
            by_inode.setdefault(st.st_ino, []).append(rel)
            if os.path.islink(os.path.join(dirpath, name)) or not os.path.isfile(os.path.join(dirpath, name)):
                files[rel] = ("other", st.st_mode)
                continue
            with open(os.path.join(dirpath, name), "rb") as f:
                files[rel] = (st.st_size, f.read(), st.st_ino)
    out = {}
    for rel, facts in files.items():
        if len(facts) == 3:
            facts = (facts[0], facts[1], frozenset(by_inode[facts[2]]) - {rel})
        out[rel] = facts
    return out


def rows(path) -> list[dict]:
    return manifest.read_table(path).sort_by("relpath").to_pylist()


def comparable(summary: dict, path) -> dict:
    """A summary without what names the manifest or the command line, and with the
    example file of each finding dropped (the first one met depends on row order)."""
    text = json.dumps(summary).replace(str(path), "MANIFEST")
    out = json.loads(text)
    for key in ("command", "manifest"):
        out.pop(key)
    for finding in out.get("findings", []):
        finding.pop("example", None)
    return out


def scan_parts(root, out_dir, n, *flags) -> None:
    for k in range(n):
        code, _, err = run("scan", root, *MLA, *flags, "--shard", f"{k}/{n}", "-o", f"{out_dir}/")
        assert code in (0, 1, 5), err


@pytest.fixture
def tree(synth_root):
    root, _ = synth_root(*TREE)
    return root


def test_shard_output_into_a_directory_is_named_by_part(tree, tmp_path):
    out = tmp_path / "m"
    scan_parts(tree, out, 3)
    assert sorted(os.listdir(out)) == [dataset.part_name(k, 3) for k in range(3)]
    assert [manifest.read_metadata(out / dataset.part_name(k, 3))["shard"] for k in range(3)] == ["0/3", "1/3", "2/3"]
    # an existing directory without the trailing slash names a dataset directory too
    code, _, _ = run("scan", tree, *MLA, "--shard", "0/3", "-o", out)
    assert code in (0, 1, 5) and sorted(os.listdir(out)) == [dataset.part_name(k, 3) for k in range(3)]


def test_report_of_the_parts_equals_the_report_of_one_manifest(tree, tmp_path):
    one = tmp_path / "one.parquet"
    code_one, _, _ = run("scan", tree, *MLA, "-o", one)
    out = tmp_path / "m"
    scan_parts(tree, out, 3)
    assert rows(out) == rows(one)  # every column of every row
    code_dir, text_dir, _ = run("report", out, "--json")
    code_file, text_file, _ = run("report", one, "--json")
    assert code_dir == code_file == code_one
    assert comparable(json.loads(text_dir), out) == comparable(json.loads(text_file), one)


def test_audit_with_shard_writes_its_part_of_a_dataset_directory(tree, tmp_path):
    out = tmp_path / "m"
    for k in range(2):
        run("audit", tree, *MLA, "--shard", f"{k}/2", "--manifest-out", f"{out}/", "--json")
    code, text, _ = run("audit", tree, *MLA, "--json")
    code_dir, text_dir, _ = run("report", out, "--json")
    assert code_dir == code
    assert json.loads(text_dir)["totals"] == json.loads(text)["totals"]


def test_migrate_from_the_parts_equals_migrate_from_one_manifest(tree, tmp_path):
    other = tmp_path / "copy"
    shutil.copytree(tree, other, symlinks=True)
    one = tmp_path / "one.parquet"
    run("scan", other, *MLA, "-o", one)
    out = tmp_path / "m"
    scan_parts(tree, out, 3)
    journals = tmp_path / "journals"
    code_dir, text_dir, _ = run("migrate", "--manifest", out, "--apply", "--journal", journals, "--json")
    code_one, text_one, _ = run("migrate", "--manifest", one, "--apply", "--json")
    assert code_dir == code_one
    assert json.loads(text_dir)["outcomes"] == json.loads(text_one)["outcomes"]
    assert json.loads(text_dir)["outcomes"]["created"] > 0
    assert tree_state(tree) == tree_state(other)
    assert run("verify", tree, "--journal", journals)[0] == 0


def test_a_missing_part_is_refused_by_every_reader(tree, tmp_path):
    out = tmp_path / "m"
    scan_parts(tree, out, 3)
    os.unlink(out / dataset.part_name(1, 3))
    for args in (["report", out], ["migrate", "--manifest", out]):
        code, _, err = run(*args)
        assert code == 2, args
        assert "incomplete dataset directory: missing part 1/3" in err and str(out) in err


def test_parts_of_two_different_splits_are_refused(tree, tmp_path):
    out = tmp_path / "m"
    scan_parts(tree, out, 2)
    run("scan", tree, *MLA, "--shard", "0/3", "-o", f"{out}/")
    code, _, err = run("report", out)
    assert code == 2 and "different --shard N (2, 3)" in err


def test_parts_of_scans_with_other_facts_are_refused(tree, tmp_path):
    out = tmp_path / "m"
    run("scan", tree, *MLA, "--shard", "0/2", "-o", f"{out}/")
    run("scan", tree, "--kv-kind", "mla", "--model-dtype", "float16", "--shard", "1/2", "-o", f"{out}/")
    code, _, err = run("report", out)
    assert code == 2 and "come from different scans (facts differ)" in err


def test_walk_errors_of_every_part_reach_the_merged_summary(tree, tmp_path):
    out = tmp_path / "m"
    scan_parts(tree, out, 2)
    meta = manifest.read_metadata(out)
    assert meta["shard"] == "0/1" and meta["parts"] == 2
    # rewrite part 1 as if its walk had failed: the directory's summary must say so (+8)
    import pyarrow.parquet as pq

    part = out / dataset.part_name(1, 2)
    table = pq.read_table(part)
    md = json.loads(table.schema.metadata[manifest.META_KEY])
    md.update(walk_errors=["x/y: cannot list: Permission denied"], walk_failed=True)
    pq.write_table(table.replace_schema_metadata({manifest.META_KEY: json.dumps(md).encode()}), part)
    merged = manifest.read_metadata(out)
    assert merged["walk_failed"] is True and merged["walk_errors"] == ["x/y: cannot list: Permission denied"]
    code, text, _ = run("report", out, "--json")
    assert code & 8 and json.loads(text)["walk_failed"] is True


@pytest.mark.parametrize("n", [1, 3, 8])
def test_migration_parts_partition_the_rows_and_keep_each_block_whole(tree, tmp_path, n):
    """Every row in exactly one part; all rows of one block hash (ranks, replicas, merge
    sources) in the same part, the one of its <hhh> bucket; non-block rows in part 0."""
    one = tmp_path / "one.parquet"
    run("scan", tree, *MLA, "-o", one)
    parts = [dataset.part_rows(one, k, n).to_pylist() for k in range(n)]
    assert sorted(r["relpath"] for p in parts for r in p) == sorted(r["relpath"] for r in rows(one))
    for k, part in enumerate(parts):
        for r in part:
            want = int(r["block_hash"].hex()[:3], 16) % n if r["block_hash"] is not None else 0
            assert want == k, r["relpath"]


def test_a_dataset_directory_of_the_same_n_is_read_one_part_per_migration_part(tree, tmp_path):
    out = tmp_path / "m"
    scan_parts(tree, out, 3)
    for k in range(3):
        assert dataset.part_rows(out, k, 3).to_pylist() == \
            manifest.read_table(out / dataset.part_name(k, 3)).to_pylist()
    # another N: split by bucket across the files
    assert sum(dataset.part_rows(out, k, 2).num_rows for k in range(2)) == len(rows(out))
