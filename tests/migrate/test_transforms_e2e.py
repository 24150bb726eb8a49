"""End-to-end transforms (migration.md §1): synth tree -> `kvmigrate migrate --apply` ->
the target engine's reader finds every page where it looks.

slice (vLLM MLA rows of N replica cells -> the replicated_layout row), relayout (llm-d
block-major [B][T][P] -> tensor-major [T][B][P]) and concat (llm-d rank files -> one row
of N cells) are checked page by page with the reference reader (worker cells at
`w × cell`, tensors at `t × B × P`, GPU block b at `+ b × P`) against the pages the
source writer stored (`synth.page_bytes_for`). Then the guarantees they share with
copies: nothing written when a number is unproven, staleness, replica checks, kill -9
and resume, rollback, verify, and the cost shown before anything is written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvmigrate import layout, manifest
from kvmigrate.cli import cli
from kvmigrate.migrate.apply import CRASH_ENV
from kvmigrate.migrate.journal import read_records

from helpers.reference_reader import ReferenceReader, content_listing, file_facts, listing, row_page_errors

KVMIGRATE = str(Path(sys.executable).with_name("kvmigrate"))
FULL = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1", "--writer-pp", "1"]
MLA = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]
KiB = 1024

# the trees of the "done means", small: 6 blocks, 2 layers per group
SLICE = {"family": "vllm", "scheme": "S2", "tp": 4, "kv_kind": "mla", "page_bytes": 1024}  # rows: 4 x 2048
MLA_B4 = {"family": "llmd", "tp": 2, "kv_kind": "mla", "blocks_per_file": 4}  # rank files: 4 x 2 x 256
FULL_B1 = {"family": "llmd", "tp": 2}  # rank files: 4 tensors x 256
FULL_B2 = {"family": "llmd", "tp": 2, "blocks_per_file": 2}  # rank files: 2 x 4 x 256


def run(*args) -> tuple[int, dict | str]:
    res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    if "--json" in args:
        return res.exit_code, json.loads(res.stdout)
    return res.exit_code, res.stdout + res.stderr


def sources_of(root) -> list[str]:
    return [os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs]


def apply(tmp_path, root, flags, *, action, created=6):
    """Scan (manifest kept), apply, check the outcome counts and that no source changed."""
    m = tmp_path / "m.parquet"
    before = file_facts(root, sources_of(root))
    code, summary = run("migrate", root, *flags, "--manifest-out", m, "--apply", "--json")
    assert code == 0, summary
    o = summary["outcomes"]
    assert (o["created"], o["conflict"], o["failed"], o["skipped_needs_transform"]) == (created, 0, 0, 0), o
    assert summary["targets"][0]["actions"][action]["blocks"] == created
    assert summary["apply"]["transformed"] == created
    assert file_facts(root, before) == before  # rule 1: sources untouched
    return summary, manifest.read_metadata(m)


def target_of(meta, ns) -> dict:
    return meta["namespaces"][ns["base_name"]]["target"]


def assert_every_page_found(root, target, ns, blocks, *, cells) -> None:
    reader = ReferenceReader(root, target)
    for blk in blocks:
        assert row_page_errors(reader, ns, blk["hex"], blk["group"], cells=cells) == []
        out = os.stat(root / reader.relpath(blk["hex"], blk["group"]))
        assert out.st_nlink == 1  # a new file, never a link of a source
    assert reader.keys_on_disk() == {(b["hex"], b["group"]) for b in blocks}
    assert not list(Path(root).rglob("*.kvmigrate-*.tmp"))


# --- the four transforms of the issue -------------------------------------------------------

@pytest.mark.parametrize("proof", ["facts", "data"])
def test_vllm_s2_tp4_mla_rows_are_sliced_into_the_replicated_namespace(tmp_path, synth_root, proof):
    root, (res,) = synth_root(SLICE)
    # facts: a size-only scan, the facts alone prove the cell; data: `migrate ROOT` hashes by default
    flags = [*MLA, "--page-bytes", "1024", "--verify", "size"] if proof == "facts" else MLA
    summary, meta = apply(tmp_path, root, [*flags, "--target", "vllm-0.28"], action="slice")
    ns = res.namespaces[0]
    target = target_of(meta, ns)
    assert target["replicated_layout"] is True and target["fields"]["replicated_layout"] is True
    assert "tp_size" not in target["fields"] or target["fields"]["tp_size"] == 1
    assert_every_page_found(root, target, ns, res.blocks, cells=1)
    rows = manifest.read_table(tmp_path / "m.parquet").to_pylist()
    reasons = {r["reason"] for r in rows if r["action"] == "slice"}
    if proof == "facts":
        assert reasons == {"slice: cell 0 of 4 (cell 2048 bytes; from facts: 2 layers x 1024 page bytes x 1 blocks "
                           "per file; 4 equal cells and a zero tail are checked before it is cut) + pad to 4096 bytes"}
    else:
        assert reasons == {"slice: cell 0 of 4 (cell 2048 bytes; cell 2048 bytes: the only size with 4 equal cells "
                           "and a zero tail in a sample row of this size; each row is checked again before it is "
                           "cut) + pad to 4096 bytes"}
    cost = summary["targets"][0]["transform_cost"]["slice"]
    assert (cost["blocks"], cost["source_bytes"], cost["output_bytes"], cost["saves_bytes"]) == \
        (6, 6 * 8 * KiB, 6 * 4 * KiB, 6 * 4 * KiB)


@pytest.mark.parametrize("verify", ["size", "hash"])
def test_llmd_tp2_mla_b4_is_relayouted_into_the_replicated_row(tmp_path, synth_root, verify):
    root, (res,) = synth_root(MLA_B4)
    summary, meta = apply(tmp_path, root, [*MLA, "--page-bytes", "256", "--verify", verify], action="relayout")
    ns = res.namespaces[0]
    target = target_of(meta, ns)
    assert target["replicated_layout"] is True
    assert_every_page_found(root, target, ns, res.blocks, cells=1)
    rows = manifest.read_table(tmp_path / "m.parquet").to_pylist()
    lead = {r["reason"] for r in rows if r["action"] == "relayout"}
    assert lead == {"relayout: B=4 T=2 P=256 ([B][T][P] -> [T][B][P], 2048 bytes per rank), then rank 0's cell "
                    "(the replicated row; " + ("replica hashes verified equal" if verify == "hash" else
                                               "replicas not yet verified (run scan --verify hash or migrate "
                                               "--apply hashes them)") + ") + pad to 4096 bytes"}
    assert {r["reason"] for r in rows if r["rank"] == 1 and r["block_hash"]} == {"part of relayout from rank 0"}


def test_llmd_tp2_mla_b4_without_the_replicated_gate_is_relayouted_and_concatenated(tmp_path, synth_root):
    """Executor ray fails the replicated gate: the target row holds both replica cells."""
    root, (res,) = synth_root(MLA_B4)
    summary, meta = apply(tmp_path, root, [*MLA, "--page-bytes", "256", "--executor", "ray"], action="relayout")
    ns = res.namespaces[0]
    target = target_of(meta, ns)
    assert target["replicated_layout"] is False and target["fields"]["tp_size"] == 2
    assert_every_page_found(root, target, ns, res.blocks, cells=2)


def test_llmd_tp2_full_attention_b1_is_concatenated(tmp_path, synth_root):
    root, (res,) = synth_root(FULL_B1)
    summary, meta = apply(tmp_path, root, FULL, action="concat")
    ns = res.namespaces[0]
    target = target_of(meta, ns)
    assert target["parallel_agnostic"] is False and target["fields"]["tp_size"] == 2  # vLLM 0.34: the TP2 row
    assert_every_page_found(root, target, ns, res.blocks, cells=2)
    cost = summary["targets"][0]["transform_cost"]["concat"]
    assert (cost["blocks"], cost["source_bytes"], cost["output_bytes"], cost["new_bytes"]) == \
        (6, 6 * 2 * KiB, 6 * 4 * KiB, 6 * 4 * KiB)


def test_llmd_tp2_full_attention_b2_is_relayouted_and_concatenated(tmp_path, synth_root):
    root, (res,) = synth_root(FULL_B2)
    flags = [*FULL, "--tensors-per-layer", "2", "--page-bytes", "256"]
    summary, meta = apply(tmp_path, root, flags, action="relayout")
    ns = res.namespaces[0]
    assert_every_page_found(root, target_of(meta, ns), ns, res.blocks, cells=2)


def test_two_groups_of_a_relayout_each_find_their_pages(tmp_path, synth_root):
    root, (res,) = synth_root({**FULL_B2, "groups": 2, "blocks": 3})
    summary, meta = apply(tmp_path, root, [*FULL, "--tensors-per-layer", "2", "--page-bytes", "256"],
                          action="relayout")
    ns = res.namespaces[0]
    assert_every_page_found(root, target_of(meta, ns), ns, res.blocks, cells=2)


# --- unproven numbers: needs_*, and nothing is written ----------------------------------------

@pytest.mark.parametrize("spec,flags,action,fragment", [
    (SLICE, [*MLA, "--verify", "size"], "needs_slice",
     "cell size unknown: 4*c <= 8192 < 4*c + 4096 allows c in 1025..2048 (pass --page-bytes; or scan with --verify "
     "hash, as `kvmigrate migrate ROOT` does, to prove it from the replicas)"),
    (SLICE, [*MLA, "--page-bytes", "768", "--verify", "hash"], "needs_slice", "facts and data disagree"),
    (MLA_B4, MLA, "needs_relayout", "needs_relayout: 2048 bytes, B=4, T=2, P unknown (pass --page-bytes)"),
    (FULL_B2, [*FULL, "--page-bytes", "256"], "needs_relayout",
     "needs_relayout: 2048 bytes, B=2, T unknown, P=256 (pass --tensors-per-layer)"),
    (FULL_B1, ["--model-dtype", "bfloat16"], "needs_concat",
     "needs_concat: rank 0 ‖ rank 1 (1024 + 1024 = 2048 bytes): kv kind unknown, so the row's cells are unknown "
     "(pass --kv-kind)"),
], ids=["slice-no-page-bytes", "slice-facts-disagree", "relayout-no-page-bytes", "relayout-no-tensors-per-layer",
        "concat-no-kv-kind"])
def test_an_unproven_transform_stays_needs_and_writes_nothing(tmp_path, synth_root, spec, flags, action, fragment):
    root, (res,) = synth_root(spec)
    m = tmp_path / "m.parquet"
    code, summary = run("migrate", root, *flags, "--manifest-out", m, "--apply", "--json")
    o = summary["outcomes"]
    if "--kv-kind" not in flags:  # its target is a guess as well: --apply leaves the namespace out (bit 1)
        assert code == 1 and summary["apply"]["left_out_guessed"][0]["facts"] == ["kv_kind"], summary
        assert o["created"] == 0
    else:
        assert code == 0, summary
        assert (o["created"], o["skipped_needs_transform"]) == (0, 6)
    (skipped,) = summary["targets"][0]["skipped"]
    assert skipped["action"] == action and fragment in skipped["reason"], skipped
    reader = ReferenceReader(root, target_of(manifest.read_metadata(m), res.namespaces[0]))
    assert reader.keys_on_disk() == set()
    assert not (root / reader.base).exists()  # not even the target folder
    assert not list(Path(root).rglob("*.kvmigrate-*.tmp"))


# --- apply-time checks: staleness, replicas, the row itself ------------------------------------

def _scan(tmp_path, root, flags) -> Path:
    m = tmp_path / "scanned.parquet"
    code, out = run("scan", root, *flags, "-o", m)
    assert code in (0, 1), out
    return m


def _rewrite_keeping_stat(path: Path, data: bytes) -> None:
    """Change a file's content but keep its size and mtime: only a content check sees it."""
    st = os.stat(path)
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_rank_file_changed_since_the_scan_skips_its_concat(tmp_path, synth_root):
    root, (res,) = synth_root(FULL_B1)
    m = _scan(tmp_path, root, FULL)
    victim = res.blocks[2]
    with open(root / victim["files"][1], "ab") as f:  # rank 1 grows
        f.write(b"x" * 64)
    code, summary = run("migrate", "--manifest", m, "--apply", "--json")
    assert code == 0  # changed_since_scan is reported, not failed on
    assert summary["outcomes"]["created"] == 5 and summary["outcomes"]["changed_since_scan"] == 1
    assert any(victim["files"][1] in f for f in summary["apply"]["findings"])
    reader = ReferenceReader(root, target_of(manifest.read_metadata(m), res.namespaces[0]))
    assert (victim["hex"], victim["group"]) not in reader.keys_on_disk()


def test_mla_replicas_that_differ_at_apply_time_are_never_relayouted(tmp_path, synth_root):
    """A size-only scan cannot see it; apply hashes every replica before it acts."""
    root, (res,) = synth_root(MLA_B4)
    victim = res.blocks[1]
    rank1 = root / victim["files"][1]
    data = bytearray(rank1.read_bytes())
    data[100] ^= 0xFF
    _rewrite_keeping_stat(rank1, bytes(data))  # before the scan: a size scan never reads it
    m = _scan(tmp_path, root, [*MLA, "--page-bytes", "256"])
    code, summary = run("migrate", "--manifest", m, "--apply", "--json")
    assert code == 4
    assert summary["outcomes"]["created"] == 5 and summary["outcomes"]["failed"] == 1
    assert any("MLA replicas differ" in f for f in summary["apply"]["findings"])
    reader = ReferenceReader(root, target_of(manifest.read_metadata(m), res.namespaces[0]))
    assert (victim["hex"], victim["group"]) not in reader.keys_on_disk()


def test_a_row_whose_cells_differ_is_never_sliced(tmp_path, synth_root):
    """The facts prove the cell size; every row must still hold N equal cells."""
    root, (res,) = synth_root(SLICE)
    victim = res.blocks[4]
    row = root / victim["files"][0]
    data = bytearray(row.read_bytes())
    data[2 * 2048 + 7] ^= 0x01  # cell 2
    _rewrite_keeping_stat(row, bytes(data))  # before the scan: a size scan never reads it
    m = _scan(tmp_path, root, [*MLA, "--page-bytes", "1024"])
    code, summary = run("migrate", "--manifest", m, "--apply", "--json")
    assert code == 4
    assert summary["outcomes"]["failed"] == 1 and summary["outcomes"]["created"] == 5
    assert any("cell 2 differs from cell 0" in f for f in summary["apply"]["findings"])
    reader = ReferenceReader(root, target_of(manifest.read_metadata(m), res.namespaces[0]))
    assert (victim["hex"], victim["group"]) not in reader.keys_on_disk()


def test_a_hashed_manifest_catches_content_changed_behind_the_stat(tmp_path, synth_root):
    root, (res,) = synth_root(FULL_B1)
    m = _scan(tmp_path, root, [*FULL, "--verify", "hash"])
    victim = res.blocks[0]
    rank1 = root / victim["files"][1]
    data = bytearray(rank1.read_bytes())
    data[0] ^= 0xFF
    _rewrite_keeping_stat(rank1, bytes(data))
    code, summary = run("migrate", "--manifest", m, "--apply", "--json")
    assert code == 0
    assert summary["outcomes"]["changed_since_scan"] == 1 and summary["outcomes"]["created"] == 5
    assert any("content differs from the scan's hash" in f for f in summary["apply"]["findings"])


def test_a_source_that_cannot_be_read_fails_its_block_and_writes_nothing(tmp_path, synth_root, monkeypatch):
    import errno

    from kvmigrate.migrate import sources as sources_mod

    def eio(fd, size, header_len=0, payload=False, let_go=True):
        raise OSError(errno.EIO, "Input/output error")

    root, (res,) = synth_root(MLA_B4)
    monkeypatch.setattr(sources_mod, "_read_fd", eio)  # the read of the sources apply checks before acting
    m = tmp_path / "m.parquet"
    code, summary = run("migrate", root, *MLA, "--page-bytes", "256", "--manifest-out", m, "--apply", "--json")
    assert code == 8
    assert summary["outcomes"]["failed"] == 6 and summary["outcomes"]["created"] == 0
    assert all("cannot read the sources of relayout: Input/output error" in f for f in summary["apply"]["findings"])
    reader = ReferenceReader(root, target_of(manifest.read_metadata(m), res.namespaces[0]))
    assert reader.keys_on_disk() == set()
    assert not list(Path(root).rglob("*.kvmigrate-*.tmp"))


def test_other_bytes_at_a_transform_target_are_a_conflict_never_overwritten(tmp_path, synth_root):
    root, (res,) = synth_root(FULL_B1)
    m = _scan(tmp_path, root, FULL)
    target = target_of(manifest.read_metadata(m), res.namespaces[0])
    reader = ReferenceReader(root, target)
    blk = res.blocks[3]
    squatter = root / reader.relpath(blk["hex"], blk["group"])
    squatter.parent.mkdir(parents=True)
    squatter.write_bytes(b"\x01" * 4096)
    code, summary = run("migrate", "--manifest", m, "--apply", "--json")
    assert code == 4
    assert summary["outcomes"]["conflict"] == 1 and summary["outcomes"]["created"] == 5
    assert squatter.read_bytes() == b"\x01" * 4096
    # a rescan sees the same: the path is taken by other bytes than concat would write
    code, dry = run("migrate", root, *FULL, "--json")
    assert dry["targets"][0]["conflicts"] and dry["pending"] == 0




# --- cost shown before anything is written ----------------------------------------------------

def test_the_dry_run_and_the_report_show_what_transforms_cost(tmp_path, synth_root):
    root, _ = synth_root(SLICE, {**FULL_B1, "model_name": "org/full"})
    facts = tmp_path / "facts.json"
    facts.write_text(json.dumps({"meta-llama/Llama-3.1-8B-Instruct": {"kv_kind": "mla", "page_bytes": 1024},
                                 "org/full": {"kv_kind": "full", "total_kv_heads": 8},
                                 "*": {"model_dtype": "bfloat16"}}))
    before = listing(root)
    code, text = run("migrate", root, "--facts", facts, "--manifest-out", tmp_path / "m.parquet")
    assert code == 1
    assert ("cost of slice: 6 blocks, writes 24.0 KiB (est. under 0.1 s at an assumed 500 MB/s); saves 24.0 KiB "
            "against the legacy rows (once those are removed)") in text
    assert ("cost of concat: 6 blocks, writes 24.0 KiB (est. under 0.1 s at an assumed 500 MB/s); costs 24.0 KiB "
            "of new space (the legacy files stay)") in text
    assert listing(root) == before  # a dry run writes nothing
    code, report = run("report", tmp_path / "m.parquet", "--format", "text")
    assert "transform cost       slice: 6 blocks, writes 24.0 KiB" in report
    assert "transform cost       concat: 6 blocks, writes 24.0 KiB" in report
    code, s = run("report", tmp_path / "m.parquet", "--format", "json")
    s = json.loads(s) if isinstance(s, str) else s
    cost = s["totals"]["transform_cost"]
    assert cost["slice"]["saves_bytes"] == 6 * 4 * KiB and cost["concat"]["new_bytes"] == 6 * 4 * KiB


# --- crash, resume, rollback, verify ----------------------------------------------------------

FACTS = {"meta-llama/Llama-3.1-8B-Instruct": {"kv_kind": "mla", "page_bytes": 1024},
         "org/mla": {"kv_kind": "mla", "page_bytes": 256},
         "org/full": {"kv_kind": "full", "total_kv_heads": 8},
         "org/b2": {"kv_kind": "full", "total_kv_heads": 8, "tensors_per_layer": 2, "page_bytes": 256},
         "*": {"model_dtype": "bfloat16"}}
MIXED = (SLICE, {**MLA_B4, "model_name": "org/mla"}, {**FULL_B1, "model_name": "org/full"},
         {**FULL_B2, "model_name": "org/b2"})


def kvmigrate(*args, env_extra=None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(CRASH_ENV, None)
    env.update(env_extra or {})
    return subprocess.run([KVMIGRATE, *map(str, args)], capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture
def two_mixed_roots(tmp_path, synth_root):
    a, _ = synth_root(*MIXED, root_name="a")
    b, _ = synth_root(*MIXED, root_name="b")
    facts = tmp_path / "facts.json"
    facts.write_text(json.dumps(FACTS))
    return a, b, ["--facts", facts]


@pytest.mark.slow  # big property test / kill matrix: CI runs it, `-m 'not slow'` leaves it out
@pytest.mark.parametrize("crash_at", ["transform_write:3", "tmp_written:2", "linked:7", "created:13"])
def test_kill_9_mid_transform_then_rerun_ends_like_an_uninterrupted_run(two_mixed_roots, crash_at):
    a, b, facts = two_mixed_roots
    done = kvmigrate("migrate", a, *facts, "--apply", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["apply"]["transformed"] == 24

    killed = kvmigrate("migrate", b, *facts, "--apply", env_extra={CRASH_ENV: crash_at})
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr)
    if crash_at.startswith("transform_write"):
        (tmp,) = b.rglob("*.kvmigrate-*.tmp")
        assert 0 < tmp.stat().st_size < 4096  # a half-written temp (4 KiB rows, written in 1 KiB steps)
    resumed = kvmigrate("migrate", b, *facts, "--apply", "--json")
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout)
    assert summary["apply"]["resumed"] is True
    assert content_listing(b) == content_listing(a)
    assert not list(b.rglob("*.kvmigrate-*.tmp")) and not list(b.rglob(layout.LOCK_NAME))
    assert kvmigrate("verify", b, "--journal", b / layout.OWN_DIR / "journals").returncode == 0


def test_a_published_output_is_adopted_by_its_hash(two_mixed_roots):
    """Power loss after the temp was published and removed but before its done record:
    the output at the final path is adopted only because it holds exactly the bytes the
    journaled transform of the journaled sources produces."""
    a, b, facts = two_mixed_roots
    assert kvmigrate("migrate", a, *facts, "--apply").returncode == 0
    killed = kvmigrate("migrate", b, *facts, "--apply", env_extra={CRASH_ENV: "linked:5"})
    assert killed.returncode == -signal.SIGKILL
    (tmp,) = b.rglob("*.kvmigrate-*.tmp")
    final = tmp.with_name(tmp.name.split(".kvmigrate-")[0])
    assert final.exists()
    tmp.unlink()  # as if the unlink reached the disk and the done record did not
    resumed = kvmigrate("migrate", b, *facts, "--apply", "--json")
    assert resumed.returncode == 0, resumed.stderr
    # the batch's earlier blocks lost their (buffered) done records too: all adopted
    assert json.loads(resumed.stdout)["apply"]["recovered"] >= 1
    assert content_listing(b) == content_listing(a)


def test_a_migrated_tree_rescans_as_already_present(two_mixed_roots):
    a, _, facts = two_mixed_roots
    assert kvmigrate("migrate", a, *facts, "--apply").returncode == 0
    dry = kvmigrate("migrate", a, *facts, "--json")
    assert dry.returncode == 0, dry.stdout
    summary = json.loads(dry.stdout)
    assert summary["pending"] == 0
    assert sum(t["already_present"]["blocks"] for t in summary["targets"]) == 24


def test_rollback_removes_every_transformed_output_and_nothing_else(two_mixed_roots):
    _, b, facts = two_mixed_roots
    pristine = listing(b, with_times=False)
    done = kvmigrate("migrate", b, *facts, "--apply", "--json")
    assert done.returncode == 0
    journal = json.loads(done.stdout)["apply"]["journal"]
    rb = kvmigrate("rollback", journal, "--json")
    assert rb.returncode == 0, rb.stdout
    assert json.loads(rb.stdout)["removed"]["block"] == 24
    assert listing(b, exclude_top=(layout.OWN_DIR,), with_times=False) == pristine


def test_rollback_of_a_run_killed_mid_transform(two_mixed_roots):
    _, b, facts = two_mixed_roots
    pristine = listing(b, with_times=False)
    killed = kvmigrate("migrate", b, *facts, "--apply", env_extra={CRASH_ENV: "transform_write:5"})
    assert killed.returncode == -signal.SIGKILL
    assert list(b.rglob("*.kvmigrate-*.tmp"))
    (journal,) = (b / layout.OWN_DIR / "journals").iterdir()
    rb = kvmigrate("rollback", journal)
    assert rb.returncode == 0, rb.stdout + rb.stderr
    assert listing(b, exclude_top=(layout.OWN_DIR,), with_times=False) == pristine


def test_verify_finds_a_tampered_transformed_output(two_mixed_roots):
    _, b, facts = two_mixed_roots
    done = kvmigrate("migrate", b, *facts, "--apply", "--json")
    journal = json.loads(done.stdout)["apply"]["journal"]
    assert kvmigrate("verify", b, "--journal", journal).returncode == 0
    records = read_records(journal)
    rec = next(r for r in records if r["t"] == "done" and r.get("action") == "relayout")
    assert rec["how"] == "transform"
    path = b / rec["path"]
    data = bytearray(path.read_bytes())
    data[300] ^= 0x01
    with open(path, "r+b") as f:
        f.write(data)
    res = kvmigrate("verify", b, "--journal", journal)
    assert res.returncode == 4
    assert f"block_changed: {path}" in res.stdout


# --- the shell form of the plan builds the same rows --------------------------------------------

def test_print_commands_script_writes_the_rows_apply_writes(two_mixed_roots, tmp_path):
    a, b, facts = two_mixed_roots
    assert kvmigrate("migrate", a, *facts, "--apply").returncode == 0
    script = kvmigrate("migrate", b, *facts, "--print-commands")
    assert script.returncode == 0, script.stderr
    (tmp_path / "plan.sh").write_text(script.stdout)
    ran = subprocess.run(["sh", str(tmp_path / "plan.sh")], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert content_listing(b) == content_listing(a)
