"""End-to-end: synth tree -> `kvmigrate migrate --apply` -> what the target engine reads.

Each test builds a small tree of one family and era, migrates it through the CLI, and
proves with the reference reader (tests/helpers/reference_reader.py) that every reusable block
is found at the path the target engine opens with exactly the bytes the source writer
stored (rebuilt from `synth.page_bytes_for`), and that nothing else is found.
"""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from kvmigrate import manifest
from kvmigrate.cli import cli
from kvmigrate.options import ScanOptions

from helpers.reference_reader import ReferenceReader, expected_vllm_row, expected_vllmcpp_payload, file_facts

FULL = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1", "--writer-pp", "1"]
MLA = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]


def run(*args: str) -> tuple[int, dict | str]:
    res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    out = res.stdout
    if "--json" in args:
        return res.exit_code, json.loads(out)
    return res.exit_code, out + res.stderr


def migrate_and_read(tmp_path, root, flags, *, expect_created):
    """Scan to a kept manifest, apply, return (summary, manifest metadata)."""
    m = tmp_path / "m.parquet"
    sources = [os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs]
    before = file_facts(root, sources)
    code, summary = run("migrate", root, *flags, "--manifest-out", m, "--apply", "--json")
    assert code == 0, summary
    assert summary["outcomes"]["created"] == expect_created
    assert summary["outcomes"]["conflict"] == 0 and summary["outcomes"]["failed"] == 0
    assert file_facts(root, sources) == before  # rule 1: sources untouched
    return summary, manifest.read_metadata(m)


def assert_reader_finds(dest, target, ns, blocks, *, cells):
    reader = ReferenceReader(dest, target)
    expected_keys = set()
    for blk in blocks:
        want = expected_vllm_row(ns, blk["hex"], blk["group"], cells)
        got = reader.load(blk["hex"], blk["group"], row_size=len(want))
        assert got.data == want, (blk, got.why)
        expected_keys.add((blk["hex"], blk["group"]))
    # nothing else is found: the target rank folder holds exactly the migrated keys
    assert reader.keys_on_disk() == expected_keys
    # and a key that was never written is a miss
    assert reader.load("ab" * 32, 0, row_size=4096).data is None


def _target_of(meta, base):
    return meta["namespaces"][base]["target"]


# vLLM 0.28-0.33 collapse a direct full-attention deployment; 0.34 keeps it topology-specific
PROFILES = [("vllm-0.28", True), ("vllm-0.34", False)]


@pytest.mark.parametrize("profile,agnostic", PROFILES)
def test_s1_vllm_tp1_full_attention_rekeys_into_the_profiles_namespace(tmp_path, synth_root, profile, agnostic):
    root, (res,) = synth_root({"family": "vllm", "scheme": "S1", "tp": 1})
    summary, meta = migrate_and_read(tmp_path, root, [*FULL, "--target", profile], expect_created=6)
    ns = res.namespaces[0]
    target = _target_of(meta, ns["base_name"])
    assert target["parallel_agnostic"] is agnostic and ("parallel_agnostic" not in target["fields"]) is agnostic
    assert_reader_finds(root, target, ns, res.blocks, cells=1)
    # a re-key is a hard link of the very same row
    for blk in res.blocks:
        src = os.stat(root / blk["files"][0])
        dst = os.stat(root / ReferenceReader(root, target).relpath(blk["hex"], blk["group"]))
        assert (src.st_ino, src.st_dev) == (dst.st_ino, dst.st_dev)


@pytest.mark.parametrize("profile,agnostic", PROFILES)
def test_s1_vllm_tp4_full_attention_rekeys_rows_of_four_cells(tmp_path, synth_root, profile, agnostic):
    root, (res,) = synth_root({"family": "vllm", "scheme": "S1", "tp": 4})
    summary, meta = migrate_and_read(tmp_path, root, [*FULL, "--family", "vllm", "--target", profile],
                                     expect_created=6)
    ns = res.namespaces[0]
    target = _target_of(meta, ns["base_name"])
    assert target["parallel_agnostic"] is agnostic and target["fields"]["tp_size"] == (1 if agnostic else 4)
    assert_reader_finds(root, target, ns, res.blocks, cells=4)


@pytest.mark.parametrize("verify", ["size", "hash"])
@pytest.mark.parametrize("page_bytes,action", [(256, "copy_pad"), (2048, "link")])
def test_s1_llmd_tp2_mla_replicas_become_the_replicated_row(tmp_path, synth_root, page_bytes, action, verify):
    root, (res,) = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla", "page_bytes": page_bytes})
    summary, meta = migrate_and_read(tmp_path, root, [*MLA, "--verify", verify], expect_created=6)
    assert summary["targets"][0]["actions"][action]["blocks"] == 6
    ns = res.namespaces[0]
    target = _target_of(meta, ns["base_name"])
    assert target["replicated_layout"] and target["fields"]["replicated_layout"] is True
    assert_reader_finds(root, target, ns, res.blocks, cells=1)


def test_s1_llmd_tp4_mla_replicas_become_the_replicated_row(tmp_path, synth_root):
    root, (res,) = synth_root({"family": "llmd", "tp": 4, "kv_kind": "mla"})
    summary, meta = migrate_and_read(tmp_path, root, MLA, expect_created=6)
    ns = res.namespaces[0]
    assert_reader_finds(root, _target_of(meta, ns["base_name"]), ns, res.blocks, cells=1)


def test_llmd_tp1_file_is_padded_into_the_agnostic_row(tmp_path, synth_root):
    root, (res,) = synth_root({"family": "llmd", "tp": 1})
    summary, meta = migrate_and_read(tmp_path, root, FULL, expect_created=6)
    assert summary["targets"][0]["actions"]["copy_pad"]["blocks"] == 6
    ns = res.namespaces[0]
    assert_reader_finds(root, _target_of(meta, ns["base_name"]), ns, res.blocks, cells=1)


@pytest.mark.parametrize("profile,agnostic", PROFILES)
def test_s2_to_s3_rekey(tmp_path, synth_root, profile, agnostic):
    root, (res,) = synth_root({"family": "vllm", "scheme": "S2", "tp": 1})
    summary, meta = migrate_and_read(tmp_path, root, [*FULL, "--target", profile], expect_created=6)
    ns = res.namespaces[0]
    target = _target_of(meta, ns["base_name"])
    assert target["fields"]["dtype"] == "bfloat16" and ("parallel_agnostic" not in target["fields"]) is agnostic
    assert target["base_name"] != ns["base_name"]
    assert_reader_finds(root, target, ns, res.blocks, cells=1)


def test_s2_to_s3_specific_rekey_when_the_gate_fails(tmp_path, synth_root):
    # 3 KV heads cannot be split over tp=2: G2 fails, the target keeps tp and says so
    root, (res,) = synth_root({"family": "vllm", "scheme": "S2", "tp": 2})
    flags = ["--kv-kind", "full", "--total-kv-heads", "3", "--model-dtype", "bfloat16"]
    summary, meta = migrate_and_read(tmp_path, root, flags, expect_created=6)
    ns = res.namespaces[0]
    target = _target_of(meta, ns["base_name"])
    assert target["fields"]["parallel_agnostic"] is False and target["fields"]["tp_size"] == 2
    assert_reader_finds(root, target, ns, res.blocks, cells=2)


def test_s3_namespace_already_in_place_is_all_already_present(tmp_path, synth_root):
    """Under vLLM 0.28-0.33 (0.34 orphans this collapsed folder: tests/migrate/test_migrate_vllm034.py)."""
    root, (res,) = synth_root({"family": "vllm", "scheme": "S3", "tp": 1, "agnostic": True})
    ns = res.namespaces[0]
    flags = [*FULL, "--target", "vllm-0.28"]
    code, summary = run("migrate", root, *flags, "--json")
    assert code == 0 and summary["pending"] == 0  # dry run: nothing to do
    summary, meta = migrate_and_read(tmp_path, root, flags, expect_created=0)
    assert summary["outcomes"]["already_present"] == 6
    target = _target_of(meta, ns["base_name"])
    assert target["base_name"] == ns["base_name"]
    assert_reader_finds(root, target, ns, res.blocks, cells=1)


@pytest.mark.parametrize("verify", ["size", "hash"])
def test_vllmcpp_tp2_mla_replicas_get_a_rewritten_header(tmp_path, synth_root, verify):
    root, (res,) = synth_root({"family": "vllmcpp", "tp": 2, "kv_kind": "mla"})
    summary, meta = migrate_and_read(tmp_path, root, ["--verify", verify], expect_created=6)
    rank0 = next(ns for ns in res.namespaces if ns["ranks"] == [0])
    target = _target_of(meta, rank0["base_name"])
    assert target["fields"]["replicated_layout"] is True and target["fields"]["rank"] == 0
    assert target["fields"]["tp_size"] == 1
    reader = ReferenceReader(root, target)
    for blk in res.blocks:
        got = reader.load(blk["hex"], blk["group"])
        assert got.data == expected_vllmcpp_payload(rank0, blk["hex"], blk["group"], 0), got.why
        # a new file, never a link: the source keeps its own header (the source digest)
        assert os.stat(root / got.path).st_ino != os.stat(root / blk["files"][0]).st_ino
    assert reader.keys_on_disk() == {(b["hex"], b["group"]) for b in res.blocks}
    # the legacy rank-0 reader still reads its own files (source untouched)
    legacy = ReferenceReader(root, {"family": "vllmcpp", "fields": rank0["fields"]})
    blk = res.blocks[0]
    assert legacy.load(blk["hex"], blk["group"]).data == expected_vllmcpp_payload(rank0, blk["hex"], 0, 0)


def test_vllmcpp_tp2_full_attention_is_rank_private_and_untouched(tmp_path, synth_root):
    root, (res,) = synth_root({"family": "vllmcpp", "tp": 2, "kv_kind": "full"})
    folders = sorted(os.listdir(root))
    code, summary = run("migrate", root, "--json")
    assert code == 0 and summary["pending"] == 0
    for t in summary["targets"]:
        assert {r["reason"] for r in t["not_reusable"]} == {"rank-private shard"}
    summary, meta = migrate_and_read(tmp_path, root, [], expect_created=0)
    assert sorted(n for n in os.listdir(root) if n != ".kvmigrate") == folders
    for ns in res.namespaces:  # each rank's reader finds its own shard, nothing new
        rank = ns["ranks"][0]
        reader = ReferenceReader(root, _target_of(meta, ns["base_name"]))
        for blk in res.blocks:
            got = reader.load(blk["hex"], blk["group"])
            assert got.data == expected_vllmcpp_payload(ns, blk["hex"], blk["group"], rank)
        assert reader.keys_on_disk() == {(b["hex"], b["group"]) for b in res.blocks}


def test_a_sharded_manifest_directory_and_a_journal_directory(tmp_path, synth_root):
    """Scale-out shape: one manifest part per shard in a directory, journals in a directory."""
    from kvmigrate.identity.facts import FactsResolver
    from kvmigrate.pipeline import scan

    root, (res,) = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla", "blocks": 12})
    parts = tmp_path / "manifest"
    parts.mkdir()
    resolver = FactsResolver({"kv_kind": "mla", "model_dtype": "bfloat16"})
    for k in range(2):
        scan(root, parts / f"part-{k}.parquet", ScanOptions(facts_resolver=resolver, shard=(k, 2), threads=1))
    journals = tmp_path / "journals"
    code, summary = run("migrate", "--manifest", parts, "--apply", "--journal", journals, "--json")
    assert code == 0 and summary["outcomes"]["created"] == 12
    (journal,) = journals.iterdir()
    assert journal.suffix == ".journal"
    meta = manifest.read_metadata(parts)
    ns = res.namespaces[0]
    assert_reader_finds(root, _target_of(meta, ns["base_name"]), ns, res.blocks, cells=1)
    assert run("verify", root, "--journal", journals)[0] == 0
