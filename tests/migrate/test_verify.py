"""`kvmigrate verify ROOT [--journal J]`: namespace digests and journaled outputs."""

from __future__ import annotations

import os

import pytest

from kvmigrate.migrate.journal import read_records

from helpers.cli_helpers import run, run_json

MLA = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]


def done_records(journal, kind="block") -> list[dict]:
    return [r for r in read_records(journal) if r["t"] == "done" and r["kind"] == kind]


@pytest.fixture
def migrated(tmp_path, synth_root):
    root, results = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"},
                               {"family": "vllmcpp", "tp": 2, "kv_kind": "mla", "model_name": "org/cpp"},
                               {"family": "vllm", "scheme": "S1", "tp": 1, "kv_kind": "mla",
                                "model_name": "org/linked"})
    journal = tmp_path / "j.jsonl"
    code, out = run("migrate", root, *MLA, "--apply", "--journal", journal)
    assert code == 0, out
    return root, journal


def test_a_clean_migration_verifies(migrated):
    root, journal = migrated
    code, result = run_json("verify", root, "--journal", journal)
    assert code == 0 and result["findings"] == []
    # 3 source namespaces + vllm.cpp rank 1 + 3 targets, every block and created config
    assert result["checked"] == {"namespaces": 7, "blocks": 18, "configs": 3}


def test_a_tampered_migrated_block_is_found(migrated):
    root, journal = migrated
    rec = done_records(journal)[0]
    path = root / rec["path"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    with open(path, "r+b") as f:
        f.write(data)
    code, out = run("verify", root, "--journal", journal)
    assert code == 4
    assert f"block_changed: {path}" in out


def test_a_removed_or_replaced_block_is_found(migrated):
    root, journal = migrated
    gone, swapped = (root / r["path"] for r in done_records(journal)[:2])
    gone.unlink()
    tmp = swapped.with_name("swap")
    tmp.write_bytes(swapped.read_bytes())
    os.rename(tmp, swapped)
    code, result = run_json("verify", root, "--journal", journal)
    assert code == 1 | 4  # evicted (1), replaced (4)
    assert {(f["code"], f["path"]) for f in result["findings"]} == {("evicted", str(gone)),
                                                                    ("block_replaced", str(swapped))}


def test_a_linked_block_modified_through_its_source_is_found(migrated):
    """A hard link shares its inode with the source: a rewrite of the source in place
    changes the migrated block too, and verify must notice."""
    root, journal = migrated
    rec = next(r for r in done_records(journal) if r["how"] == "link")
    path = root / rec["path"]
    with open(path, "r+b") as f:
        f.write(b"\xee" * 8)
    code, out = run("verify", root, "--journal", journal)
    assert code == 4 and "block_changed" in out


def test_a_namespace_whose_config_does_not_prove_its_digest_is_found(tmp_path, synth_root):
    root, (res,) = synth_root({"family": "vllm", "scheme": "S2", "tp": 1, "defects": ("digest_mismatch",)})
    code, result = run_json("verify", root)
    assert code == 4
    (finding,) = result["findings"]
    assert finding["code"] == "config_digest_mismatch"
    assert finding["path"].endswith("config.json")


def test_an_unparsable_config_is_found(tmp_path, synth_root):
    root, (res,) = synth_root({"family": "vllm", "scheme": "S2", "tp": 1, "defects": ("config_unparsable",)})
    code, result = run_json("verify", root)
    assert code == 4 and result["findings"][0]["code"] == "config_invalid"


def test_a_changed_created_config_json_is_found(migrated):
    root, journal = migrated
    cfg = root / done_records(journal, "config")[0]["path"]
    cfg.write_bytes(cfg.read_bytes().replace(b'"dtype"', b'"dtype" '))  # same identity, other bytes
    code, out = run("verify", root, "--journal", journal)
    assert code == 4 and "config_changed" in out


def test_a_rolled_back_journal_has_nothing_to_check(migrated):
    root, journal = migrated
    assert run("rollback", journal)[0] == 0
    code, result = run_json("verify", root, "--journal", journal)
    assert code == 0 and result["checked"]["blocks"] == 0


def test_verify_without_a_journal_checks_digests_only_and_writes_nothing(migrated):
    root, journal = migrated
    before = sorted(os.walk(root))
    code, out = run("verify", root)
    assert code == 0 and "no findings" in out
    assert sorted(os.walk(root)) == before


def test_verify_json_has_the_interface_summary_keys(migrated):
    root, journal = migrated
    code, result = run_json("verify", root, "--journal", journal)
    assert code == 0
    for key in ("root", "target_profile", "totals", "namespaces", "exit_code"):
        assert key in result
    assert result["target_profile"] == "vllm-0.34"
    assert result["totals"]["files"] > 0 and len(result["namespaces"]) == 7


def test_verify_json_and_text_tell_the_same_and_name_only_paths_that_exist(migrated):
    """--json named the temporary manifest of its summary walk (deleted by then) and
    carried the scanner's hints, which the text output does not show."""
    root, journal = migrated
    next(root / r["path"] for r in done_records(journal)).unlink()  # one finding to advise on
    code, result = run_json("verify", root, "--journal", journal)
    text_code, text = run("verify", root, "--journal", journal)
    assert code == text_code == 1
    assert "hints" not in result and result["next"] == text.splitlines()[-1]

    def strings(value):
        if isinstance(value, dict):
            for v in value.values():
                yield from strings(v)
        elif isinstance(value, list):
            for v in value:
                yield from strings(v)
        elif isinstance(value, str):
            yield value

    named = [s for s in strings(result) if s.startswith("/") or " /" in s]
    assert named  # root, journal
    missing = {f["path"] for f in result["findings"] if f["code"] == "evicted"}
    for s in named:
        for word in s.split():
            if word.startswith("/") and word not in missing:
                assert os.path.exists(word.rstrip(",.:;)")), (word, s)


@pytest.mark.parametrize("what, message", [("missing", "cache root does not exist"),
                                           ("file", "cache root is not a directory")])
def test_verify_checks_its_root_as_scan_does(tmp_path, what, message):
    """A missing ROOT or a file: the scan's usage error (exit 2), with its message and hint."""
    root = tmp_path / "root"
    if what == "file":
        root.write_text("not a cache\n")
    for command in ("scan", "verify"):
        code, out = run(command, root)
        assert code == 2, out
        assert f"{root}: {message}" in out and "hint: pass the engine's cache root_dir" in out, (command, out)


FULL = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1",
        "--writer-pp", "1"]


def test_a_clean_migration_verifies_beside_damaged_namespaces_it_never_touched(tmp_path, synth_root):
    # verify --journal of a clean migration exited 4 for another namespace's digest_mismatch,
    # advising to remove "blocks that no longer match the journal"
    root, _ = synth_root({"defects": ("zero_filled",)},  # a damaged block the migration leaves alone
                         {"scheme": "S3", "dtype": "bfloat16", "model_name": "Qwen/Qwen2.5-7B",
                          "defects": ("digest_mismatch",)})
    journal = tmp_path / "j.jsonl"
    code, out = run("migrate", root, *FULL, "--apply", "--journal", journal)
    assert code == 0 and "created 5" in out, out
    code, result = run_json("verify", root, "--journal", journal)
    assert code == 0, result["next"]
    (other,) = result["findings"]
    assert other["code"] == "config_digest_mismatch" and "Qwen" in other["path"] and other["related"] is False
    assert result["checked"]["blocks"] == 5
    code, text = run("verify", root, "--journal", journal)
    assert code == 0
    assert "no longer match the journal" not in text and "finding(s)" not in text
    assert text.splitlines()[-1] == (
        "what the migration created matches its journal; 1 finding outside it (a namespace the migration neither "
        f"created nor wrote into): not this migration's, so not in the exit code; `kvmigrate audit {root}` reports "
        "it with what to do.")


def test_a_target_namespace_whose_config_json_no_longer_proves_its_name_fails_verify(tmp_path, synth_root):
    root, _ = synth_root({})
    journal = tmp_path / "j.jsonl"
    assert run("migrate", root, *FULL, "--apply", "--journal", journal)[0] == 0
    (cfg,) = [root / r["path"] for r in done_records(journal, "config")]
    cfg.write_text(cfg.read_text().replace('"bfloat16"', '"float16"'))  # parses, hashes to another name
    code, result = run_json("verify", root, "--journal", journal)
    assert code == 4
    assert {(f["code"], f["related"]) for f in result["findings"]} == {("config_digest_mismatch", True),
                                                                      ("config_changed", True)}


def test_verify_without_a_journal_advises_identity_for_a_digest_mismatch(tmp_path, synth_root):
    root, (res,) = synth_root({"family": "vllm", "scheme": "S2", "tp": 1, "defects": ("digest_mismatch",)})
    code, out = run("verify", root)
    assert code == 4
    cfg = root / res.namespaces[0]["config_relpath"]
    assert out.splitlines()[-1] == (f"1 namespace whose config.json does not hash to its folder name: no engine "
                                    f"reads it under that name; see why with `kvmigrate identity {cfg}`.")
