"""`--apply` never publishes bytes it has not read and checked (issue 16, "Safe by default").

A block reaches a target namespace only if this run's scan hashed it (`migrate ROOT`,
whose own scan runs at --verify hash unless told otherwise) or apply read every file of it
before placing it (a manifest from a size-only or unverified scan): crash residue, a
vllm.cpp header the engine refuses and replicas that differ are refused either way, and a
vLLM MLA row of replica cells is sliced by the default command without --page-bytes.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvmigrate import manifest
from kvmigrate.cli import cli

from helpers.reference_reader import ReferenceReader, row_page_errors

FULL = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1", "--writer-pp", "1"]
MLA = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]


def run(*args) -> tuple[int, dict]:
    res = CliRunner().invoke(cli, [str(a) for a in args] + ["--json"], catch_exceptions=False)
    return res.exit_code, json.loads(res.stdout)


def migrate(route: str, root, facts: list[str], tmp_path) -> tuple[int, dict, dict]:
    """Apply by one of the ways a user can: (exit code, summary, manifest metadata)."""
    m = tmp_path / "m.parquet"
    if route == "default":
        code, summary = run("migrate", root, *facts, "--manifest-out", m, "--apply")
    elif route.startswith("migrate-"):  # migrate ROOT --verify size|none --apply
        code, summary = run("migrate", root, *facts, "--verify", route.split("-")[1], "--manifest-out", m, "--apply")
    else:  # a manifest kept from `scan --verify size|none`
        code, _ = run("scan", root, *facts, "--verify", route.split("-")[1], "-o", m)
        assert not code & 8
        code, summary = run("migrate", "--manifest", m, "--apply")
    return code, summary, manifest.read_metadata(m)


# vLLM S2 (a link), llm-d TP=1 (a copy_pad), vLLM S2 MLA TP=4 with the cell size given (a slice)
RESIDUE = {
    "vllm-link": ({"family": "vllm", "scheme": "S2", "tp": 1, "layers": 1, "page_bytes": 4096, "blocks": 8,
                   "seed": 5}, FULL),
    "llmd-copy-pad": ({"family": "llmd", "tp": 1}, FULL),
    "vllm-slice": ({"family": "vllm", "scheme": "S2", "tp": 4, "kv_kind": "mla", "page_bytes": 1024},
                   [*MLA, "--page-bytes", "1024"]),
}


@pytest.mark.parametrize("route", ["default", "migrate-size", "manifest-size"])
@pytest.mark.parametrize("tree", list(RESIDUE))
def test_crash_residue_is_never_placed(tmp_path, synth_root, tree, route):
    spec, facts = RESIDUE[tree]
    root, (res,) = synth_root({**spec, "defects": ("zero_filled",)})
    (victim,) = res.defects
    ns = res.namespaces[0]
    code, summary, meta = migrate(route, root, facts, tmp_path)
    target = meta["namespaces"][ns["base_name"]]["target"]
    reader = ReferenceReader(root, target)
    assert not (root / reader.relpath(victim["block"], victim["group"])).exists()
    o = summary["outcomes"]
    assert o["created"] == len(res.blocks) - 1
    if route == "default":  # its scan read the block: the plan never held it, an unrelated finding
        assert o["failed"] == 0 and code == 0
    else:  # apply read it before placing it: an integrity problem of what it would place
        assert code & 4 and not code & 8
        assert o["failed"] == 1
        (finding,) = summary["apply"]["findings"]
        assert "zero_filled: all" in finding and "are zero (crash residue); not placed" in finding
        assert victim["relpath"] in finding
    # what the engine reads from the target is what the source writer stored
    cells = 1 if target.get("replicated_layout") else ns["tp"]
    for blk in res.blocks:
        if blk["hex"] != victim["block"]:
            assert row_page_errors(reader, ns, blk["hex"], blk["group"], cells=cells) == []
    # and a hashing scan afterwards finds the residue once: in the source, never in the target
    code, scanned = run("scan", root, *facts, "--verify", "hash", "-o", tmp_path / "after.parquet")
    assert scanned["totals"]["by_status"]["zero_filled"]["files"] == 1


@pytest.mark.parametrize("route", ["migrate-none", "manifest-none"])
@pytest.mark.parametrize("defect", ["header_digest", "header_key", "header_version"])
def test_a_vllmcpp_header_the_engine_refuses_is_never_placed(tmp_path, synth_root, defect, route):
    # an unverified scan never looked at the headers: apply reads them before rewriting one
    root, (res,) = synth_root({"family": "vllmcpp", "tp": 2, "kv_kind": "mla", "defects": (defect,)})
    (victim,) = res.defects
    code, summary, meta = migrate(route, root, [], tmp_path)
    assert code == 4
    o = summary["outcomes"]
    assert (o["created"], o["failed"]) == (len(res.blocks) - 1, 1)
    (finding,) = summary["apply"]["findings"]
    assert f"header_invalid: header check '{victim['check']}' failed: the vllm.cpp reader deletes this file; " \
           "not placed" in finding and victim["relpath"] in finding
    rank0 = next(ns for ns in res.namespaces if ns["ranks"] == [0])
    reader = ReferenceReader(root, meta["namespaces"][rank0["base_name"]]["target"])
    assert not (root / reader.relpath(victim["block"], victim["group"])).exists()
    assert len(reader.keys_on_disk()) == len(res.blocks) - 1


def test_rows_of_replica_cells_are_sliced_by_the_default_command(tmp_path, synth_root):
    # vLLM 0.26 MLA TP=4: rows of 4 identical cells; no --page-bytes, no --verify
    spec = {"family": "vllm", "scheme": "S2", "tp": 4, "kv_kind": "mla"}
    root, (res,) = synth_root(spec)
    ns = res.namespaces[0]
    code, summary, meta = migrate("default", root, MLA, tmp_path)
    assert code == 0, summary
    assert summary["outcomes"]["created"] == len(res.blocks) and summary["apply"]["transformed"] == len(res.blocks)
    reader = ReferenceReader(root, meta["namespaces"][ns["base_name"]]["target"])
    for blk in res.blocks:
        assert row_page_errors(reader, ns, blk["hex"], blk["group"], cells=1) == []
    # from a size-only manifest the cell size stays unproven: skipped, and both ways are named
    other, _ = synth_root(spec, root_name="other")
    code, summary, _ = migrate("manifest-size", other, MLA, tmp_path / "other-m")
    assert code == 0 and summary["outcomes"]["skipped_needs_transform"] == len(res.blocks)
    (skipped,) = summary["targets"][0]["skipped"]
    assert "(pass --page-bytes; or scan with --verify hash, as `kvmigrate migrate ROOT` does" in skipped["reason"]
    code, report = run("report", tmp_path / "other-m" / "m.parquet")
    commands = [h["command"] for h in report["hints"]]
    assert any("--page-bytes" in c for c in commands) and any("--verify hash" in c for c in commands), commands


def test_apply_reads_its_sources_with_the_scans_block_reader(tmp_path, synth_root, monkeypatch):
    """One block reader (issue 17): the files apply reads before placing them (a size-only
    manifest) go through kvmigrate.fsio.read_fd, the reader the scan hashes with, so both
    judge a block file (size, zero check, XXH3-128) by the same code."""
    from kvmigrate import fsio

    spec, facts = RESIDUE["vllm-link"]
    root, (res,) = synth_root(spec)
    m = tmp_path / "m.parquet"
    code, _ = run("scan", root, *facts, "--verify", "size", "-o", m)
    assert not code & 8
    read = []
    real = fsio.read_fd

    def spy(fd, size, header_len=0, payload=False, let_go=True):
        got = real(fd, size, header_len, payload, let_go=let_go)
        read.append((size, got[3]))
        return got

    monkeypatch.setattr(fsio, "read_fd", spy)
    code, summary = run("migrate", "--manifest", m, "--apply")
    assert code == 0 and summary["outcomes"]["created"] == len(res.blocks)
    assert len(read) == len(res.blocks) and all(size == nread for size, nread in read)
