"""Each finding ends in the exact command that deals with it (restic-style hints)."""

from __future__ import annotations

import pytest
from test_report_summary import (
    AUTO,
    LLMD,
    LLMD_T,
    MLA,
    ROOT,
    VLLM,
    VLLM_T,
    MiB,
    Rows,
    _hex,
    sample_metadata,
    write_sample_manifest,
)

from kvmigrate import findings
from kvmigrate.manifest import ManifestWriter
from kvmigrate.report.summary import summarize


def _one_namespace(tmp_path, base, rows: Rows, **meta_changes):
    meta = sample_metadata()
    meta["namespaces"] = {base: dict(meta["namespaces"][base], **meta_changes)}
    for k in ("root", "target_profile", "verify", "facts"):
        if k in meta_changes:
            meta[k] = meta_changes[k]
    path = tmp_path / "m.parquet"
    with ManifestWriter(path, meta) as w:
        w.write_columns(rows.cols)
    return summarize(path), path


def _commands(summary):
    return [h["command"] for h in summary["hints"]]


def test_integrity_findings_list_their_files_first(tmp_path):
    s = summarize(write_sample_manifest(tmp_path / "m.parquet"))
    cmds = _commands(s)
    m = tmp_path / "m.parquet"
    for status in ("replica_mismatch", "short", "header_invalid"):
        assert f"kvmigrate report {m} --list {status}" in cmds
    # integrity (bit 4) before findings (bit 1) before the migration
    integrity = max(cmds.index(f"kvmigrate report {m} --list {s}") for s in ("replica_mismatch", "short"))
    assert integrity < cmds.index(f"kvmigrate report {m} --list incomplete")
    assert cmds[-1] == f"kvmigrate migrate --manifest {m} --apply"


def test_missing_fact_reruns_the_scan_with_the_flag_and_keeps_the_others(tmp_path):
    s = summarize(write_sample_manifest(tmp_path / "m.parquet"))
    hint = next(h for h in s["hints"] if "target_refused" in h["codes"])
    # a placeholder stays unquoted: pasted as is, the shell refuses it instead of running a guess
    assert hint["command"] == (
        f"kvmigrate scan {ROOT} --kv-kind full --model-dtype <bfloat16|float16> -o {tmp_path / 'm.parquet'}")
    assert hint["namespaces"] == [AUTO]


def test_needs_relayout_asks_for_the_flags_its_reason_names(tmp_path):
    r = Rows()
    r.add(LLMD, f"{LLMD}/config.json", size=500, family="llmd", target=LLMD_T)
    for i in range(4):
        r.block(LLMD, 0, _hex(i, 1), size=MiB, family="llmd", target=LLMD_T, action="needs_relayout",
                reason="needs_relayout: 1048576 bytes, B=4, T unknown, P unknown (pass --tensors-per-layer and "
                       "--page-bytes)",
                finding=findings.Finding(findings.NEEDS_FACT, asks="--tensors-per-layer --page-bytes"))
        r.block(LLMD, 1, _hex(i, 1), size=MiB, family="llmd", target=LLMD_T,
                reason="part of needs_relayout from rank 0",
                finding=findings.Finding(findings.PART_OF_ACTION, primary_rank=0, of_action="needs_relayout"))
    s, m = _one_namespace(tmp_path, LLMD, r)
    n = s["namespaces"][0]
    assert n["by_action"]["needs_relayout"] == {"blocks": 4, "bytes": 8 * MiB}
    assert n["flags_asked"] == {"needs_relayout": {"--page-bytes": 4, "--tensors-per-layer": 4}}
    assert (f"kvmigrate scan {ROOT} --kv-kind full --page-bytes <bytes> --tensors-per-layer <2> -o {m}"
            in _commands(s))
    assert s["exit_code"] == 0  # a plan that waits for a fact is not a state with exit bits


def test_needs_transform_without_missing_fact_says_it_waits(tmp_path):
    r = Rows()
    r.add(LLMD, f"{LLMD}/config.json", size=500, family="llmd", target=LLMD_T)
    r.block(LLMD, 0, _hex(1, 1), size=MiB, family="llmd", target=LLMD_T, action="needs_concat",
            reason="needs_concat: rank 0 ‖ rank 1 (1048576 + 1048576 = 2097152 bytes): B unknown (blocks_per_file "
                   "missing from the identity)")
    r.block(LLMD, 1, _hex(1, 1), size=MiB, family="llmd", target=LLMD_T, reason="part of needs_concat from rank 0")
    s, _ = _one_namespace(tmp_path, LLMD, r)
    f = next(f for f in s["findings"] if f["code"] == "needs_concat")
    assert "their numbers are not proven (migrate --apply skips them" in f["message"]
    assert "B unknown" in f["message"]
    assert not any("--page-bytes" in c for c in _commands(s))


def test_aliases_source_hints_dest(tmp_path):
    r = Rows()
    r.add(LLMD, f"{LLMD}/config.json", size=500, family="llmd", target=LLMD)
    r.block(LLMD, 0, _hex(1, 1), size=100, family="llmd", target=LLMD,
            reason="aliases_source: the target path is this source file, which holds other bytes than copy_pad "
                   "would write; use --dest DIR", finding=findings.Finding(findings.ALIASES_SOURCE, of_action="copy_pad"))
    s, m = _one_namespace(tmp_path, LLMD, r, ranks=[0])
    assert f"kvmigrate migrate --manifest {m} --dest <DIR> --apply" in _commands(s)


def test_ambiguous_family_that_matters_hints_family(tmp_path):
    r = Rows()
    r.add(VLLM, f"{VLLM}/config.json", size=300, family="ambiguous", target=VLLM_T)
    r.block(VLLM, 0, _hex(1, 1), family="ambiguous", target=VLLM_T,
            reason="family ambiguous (S1 written by vLLM or llm-d, and the two readings give different bytes "
                   "here): pass --family vllm|llmd", finding=findings.Finding(findings.NEEDS_FACT, asks="--family"))
    s, m = _one_namespace(tmp_path, VLLM, r)
    assert f"kvmigrate scan {ROOT} --kv-kind full --family <vllm|llmd> -o {m}" in _commands(s)
    f = next(f for f in s["findings"] if f["code"] == "family_ambiguous")
    assert f["bits"] == 1


def test_harmless_ambiguity_is_a_note_without_command(tmp_path):
    s = summarize(write_sample_manifest(tmp_path / "m.parquet"))
    f = next(f for f in s["findings"] if f["code"] == "family_ambiguous")
    assert f["severity"] == "note" and "changes no decision" in f["message"]
    assert not any("--family" in c for c in _commands(s))


def test_unverified_replicas_hint_verify_hash_only_for_replica_actions(tmp_path):
    s = summarize(write_sample_manifest(tmp_path / "m.parquet"))
    hint = next(h for h in s["hints"] if "replicas_unverified" in h["codes"])
    assert hint["command"] == f"kvmigrate scan {ROOT} --kv-kind full --verify hash -o {tmp_path / 'm.parquet'}"
    assert hint["namespaces"] == [MLA]  # the concat namespace holds shards, not replicas


def test_tmp_leftovers_are_reclaimed_with_prune_not_rm(tmp_path):
    s = summarize(write_sample_manifest(tmp_path / "m.parquet"))
    hint = next(h for h in s["hints"] if "tmp_leftover" in h["codes"])
    assert hint["command"].startswith(f"kvmigrate prune {ROOT} ") and hint["command"].endswith(" --residue")
    assert "rm " not in hint["command"] and "dry run" in hint["why"] and "restore" in hint["why"]


def test_digest_mismatch_hints_identity_of_that_config(tmp_path):
    r = Rows()
    r.add(VLLM, f"{VLLM}/config.json", size=300, status="digest_mismatch", reason="config.json hashes to 0123")
    s, _ = _one_namespace(tmp_path, VLLM, r, status="digest_mismatch", target=None)
    assert f"kvmigrate identity {ROOT}/{VLLM}/config.json" in _commands(s)
    assert s["exit_code"] == 5


def test_walk_errors_set_the_operational_bit_and_hint_a_rescan(tmp_path):
    r = Rows()
    r.add(VLLM, f"{VLLM}/config.json", size=300)
    meta = sample_metadata()
    meta["namespaces"] = {VLLM: dict(meta["namespaces"][VLLM], family="vllm", assumed_facts={})}
    meta["walk_errors"] = [f"{VLLM}_r0/abc: cannot list: [Errno 13] Permission denied"]
    meta["walk_failed"] = True
    with ManifestWriter(tmp_path / "m.parquet", meta) as w:
        w.write_columns(r.cols)
    s = summarize(tmp_path / "m.parquet")
    assert s["exit_code"] == 8
    f = next(f for f in s["findings"] if f["code"] == "walk_errors")
    assert f["severity"] == "operational" and "Permission denied" in f["message"]
    assert s["hints"][0]["command"] == f"kvmigrate scan {ROOT} --kv-kind full -o {tmp_path / 'm.parquet'}"


def test_commands_quote_roots_with_spaces_and_keep_the_target(tmp_path):
    meta = sample_metadata()
    meta["root"] = "/srv/kv cache"
    meta["target_profile"] = "vllm-0.27"
    s = summarize(write_sample_manifest(tmp_path / "m.parquet", metadata=meta))
    hint = next(h for h in s["hints"] if "target_refused" in h["codes"])
    assert hint["command"].startswith("kvmigrate scan '/srv/kv cache' --target vllm-0.27 --kv-kind full ")


def test_temporary_manifest_hints_write_one_first(tmp_path):
    s = summarize(write_sample_manifest(tmp_path / "m.parquet"), manifest=None, verb="audit")
    assert (f"rm -f kvmigrate-manifest.parquet; kvmigrate scan {ROOT} --kv-kind full -o kvmigrate-manifest.parquet; "
            "kvmigrate report kvmigrate-manifest.parquet --list short") in _commands(s)
    assert f"kvmigrate migrate {ROOT} --kv-kind full --apply" in _commands(s)
    assert any(c.startswith(f"kvmigrate audit {ROOT} --kv-kind full --model-dtype") for c in _commands(s))


def test_claims_and_assumed_facts_are_reported(tmp_path):
    s = summarize(write_sample_manifest(tmp_path / "m.parquet"))
    notes = [f for f in s["findings"] if f["code"] == "assumed_facts" and f["namespace"] == VLLM]
    assert notes and notes[0]["assumed"] == {"runner": "v1", "executor": "mp"}


def test_guessed_target_hints_the_facts_to_state_never_an_apply(synth_root, tmp_path):
    """Issue 16.6: an S3-era (vLLM 0.27/0.28) collapsed TP=1 namespace scanned with no facts.
    Its target depends on --kv-kind and --total-kv-heads (unknown, every gate fails: the
    specific namespace), so audit, report and the migrate dry run print no --apply but the
    facts: flag, where the value is, the FACTS.json form. The printed command, with the
    values filled in, runs and finds the namespace already where vLLM 0.28 reads it."""
    import json
    import shlex

    from click.testing import CliRunner

    from kvmigrate.cli import cli

    def invoke(argv):
        return CliRunner().invoke(cli, argv, catch_exceptions=False)

    # a TP2 folder of vLLM 0.27+: an MLA model's would be replicated, so the kv kind decides
    root, (res,) = synth_root(dict(family="vllm", scheme="S3", tp=2))
    base = res.namespaces[0]["base_name"]
    manifest = tmp_path / "audit.parquet"
    audit = invoke(["audit", str(root), "--json", "--manifest-out", str(manifest)])
    summary = json.loads(audit.stdout)
    assert audit.exit_code == 1
    assert summary["namespaces"][0]["target_missing_facts"] == ["kv_kind"]
    assert not any("--apply" in h["command"] for h in summary["hints"]), summary["hints"]
    hint = next(h for h in summary["hints"] if "target_guessed" in h["codes"])
    assert hint["command"] == (f"kvmigrate audit {root} --kv-kind <full|mla|sliding|hybrid|mamba> "
                               f"--manifest-out {manifest}")
    assert "kv_lora_rank" in hint["why"] and "--model-config PATH" in hint["why"]
    assert f'--facts FACTS.json: {{"{base}": {{"kv_kind": ' in hint["why"]
    for argv in (["audit", str(root)], ["report", str(manifest)], ["migrate", str(root)],
                 ["migrate", "--manifest", str(manifest)]):
        out = invoke(argv).stdout
        assert "--apply" not in out and "--kv-kind" in out, (argv, out)
    dry = json.loads(invoke(["migrate", str(root), "--json"]).stdout)
    assert dry["apply_command"] is None
    assert dry["guessed_targets"] == [{"namespace": base, "facts": ["kv_kind"]}]

    # the printed commands run once the values are stated, and then nothing is guessed
    for command in (hint["command"], dry["facts_command"]):
        argv = shlex.split(command.replace("<full|mla|sliding|hybrid|mamba>", "full").replace("<N>", "8"))
        assert argv[0] == "kvmigrate"
        rerun = invoke(argv[1:] + ["--json"])
        decided = json.loads(rerun.stdout)
        assert rerun.exit_code == 0, decided.get("hints")
        assert decided["namespaces"][0]["target_base"] == base  # already in place: the guess was wrong
        assert not decided["namespaces"][0]["target_missing_facts"]


def test_apply_hint_names_the_assumed_defaults_its_target_rests_on(synth_root, tmp_path):
    """Assumed defaults (runner v1, no per-token-head quant, executor mp, one node) are vLLM's
    and are not asked for: the apply hint stays, naming only the ones the target rests on
    (here the G2 conditions; executor and nodes matter only to replicated MLA), and it runs."""
    import json
    import shlex

    from click.testing import CliRunner

    from kvmigrate.cli import cli

    root, _ = synth_root(dict(family="vllm", scheme="S2"))
    facts = ["--model-dtype", "bfloat16", "--kv-kind", "full", "--total-kv-heads", "8", "--target", "vllm-0.28"]
    audit = CliRunner().invoke(cli, ["audit", str(root), "--json", *facts], catch_exceptions=False)
    hint = next(h for h in json.loads(audit.stdout)["hints"] if "migration_pending" in h["codes"])
    assert hint["command"] == (f"kvmigrate migrate {root} --target vllm-0.28 --kv-kind full --model-dtype bfloat16 "
                               "--total-kv-heads 8 --apply")
    assert "per_token_head_quant=False, runner=v1 (vLLM's defaults)" in hint["why"]
    assert "--per-token-head-quant, --runner first" in hint["why"] and "executor" not in hint["why"]
    applied = CliRunner().invoke(cli, shlex.split(hint["command"])[1:], catch_exceptions=False)
    assert applied.exit_code == 0, applied.stdout


def test_pending_blocks_of_a_size_scan_are_not_called_proven(synth_root, tmp_path):
    """A size-level audit has not read the blocks it calls reusable (a zero-filled one looks
    like any other): the pending finding says so and that --apply checks them first; a hash
    audit, which read them, says nothing of the kind."""
    from helpers.cli_helpers import run_json

    root, _ = synth_root(dict(family="vllm", scheme="S2", defects=("zero_filled",)))
    facts = ["--model-dtype", "bfloat16", "--kv-kind", "full", "--total-kv-heads", "8", "--writer-tp", "1",
             "--writer-pp", "1"]
    messages = {}
    for verify in ("size", "hash"):
        code, summary = run_json("audit", root, *facts, "--verify", verify)
        (pending,) = [f for f in summary["findings"] if f["code"] == "migration_pending"]
        messages[verify] = pending["message"]
    assert "did not read them" in messages["size"] and "reads and checks each" in messages["size"]
    assert "did not read" not in messages["hash"]


MLA_FACTS = ["--kv-kind", "mla", "--total-kv-heads", "1", "--model-dtype", "bfloat16"]


def _migrated_mla_tree_with_differing_replicas(synth_root):
    """An llm-d TP=2 MLA tree with one block whose replicas differ, after the default
    migration (which hashes, places the equal replicas and refuses the other)."""
    from helpers.cli_helpers import run_json

    root, _ = synth_root(dict(family="llmd", tp=2, kv_kind="mla", blocks=6, defects=("replica_differs",)))
    code, applied = run_json("migrate", root, *MLA_FACTS, "--apply")
    assert code == 0
    return root, applied


def test_a_size_audit_after_migrating_does_not_call_refused_replicas_migratable(synth_root):
    """After a migration refused a block whose replicas differ, a size audit (the default)
    cannot tell it from a migratable one: it says the block is pending only if its replicas
    are equal, puts the hash audit (which names it) before the migrate step, and does not
    offer migrate --apply as what places it."""
    from helpers.cli_helpers import run_json

    root, _ = _migrated_mla_tree_with_differing_replicas(synth_root)
    _, summary = run_json("audit", root, *MLA_FACTS)
    assert summary["verify"] == "size"
    (pending,) = [f for f in summary["findings"] if f["code"] == "migration_pending"]
    assert pending["blocks"] == 1 and pending["unproven_replicas"] == 1
    assert "pending only if its replicas are equal" in pending["message"]
    commands = [h["command"] for h in summary["hints"]]
    hashing = commands.index(f"kvmigrate audit {root} --kv-kind mla --model-dtype bfloat16 --total-kv-heads 1 "
                             "--verify hash")
    (migrate,) = [h for h in summary["hints"] if "migration_pending" in h["codes"]]
    assert hashing < commands.index(migrate["command"])
    assert not migrate["why"].startswith("migrate the reusable blocks")
    assert "does not place the blocks a migration already refused" in migrate["why"]
    # what the hint promises: the hash audit names the block and nothing is left pending
    _, hashed = run_json("audit", root, *MLA_FACTS, "--verify", "hash")
    assert hashed["totals"]["pending"]["blocks"] == 0
    assert not [f for f in hashed["findings"] if f["code"] == "migration_pending"]
    assert [f["files"] for f in hashed["findings"] if f["code"] == "replica_mismatch"] == [2]


def test_a_size_audit_says_its_prune_figure_is_a_floor_where_replicas_are_unhashed(synth_root):
    """A size audit proves rank 0's placed files only, but `kvmigrate prune ROOT` hashes and
    takes the other ranks' equal replicas too: the audit's figure says "at least", and a hash
    audit's figure is what prune's dry run selects."""
    from helpers.cli_helpers import run_json

    root, _ = _migrated_mla_tree_with_differing_replicas(synth_root)
    figures = {}
    for verify in ("size", "hash"):
        _, summary = run_json("audit", root, *MLA_FACTS, "--verify", verify)
        (h,) = [h for h in summary["hints"] if "reclaimable" in h["codes"]]
        figures[verify] = (h["why"], summary["reclaimable"]["classes"]["migrated"]["files"])
    assert figures["size"][0].startswith("at least 5 legacy files") and "prune frees at least" in figures["size"][0]
    assert figures["hash"][0].startswith("10 legacy files") and "at least" not in figures["hash"][0]
    _, plan = run_json("prune", root, *MLA_FACTS, "--force-live")
    assert plan["totals"]["migrated"]["files"] == figures["hash"][1] == 10


def test_identity_findings_say_why_in_a_whole_sentence(synth_root, tmp_path):
    # the finding read "...; never migrated; see why with (e.g. <path>)": a sentence cut off
    from helpers.cli_helpers import run, run_json

    root, _ = synth_root({"scheme": "S3", "dtype": "bfloat16", "defects": ["digest_mismatch"]})
    code, summary = run_json("audit", root)
    assert code & 4
    f = next(f for f in summary["findings"] if f["code"] == "digest_mismatch")
    assert f["message"].endswith("never migrated; `kvmigrate identity` on its config.json shows why"), f["message"]
    code, out = run("audit", root)
    assert "see why with" not in out
    finding = next(line for line in out.splitlines() if line.startswith("integrity") and "digest_mismatch" in line)
    assert "`kvmigrate identity` on its config.json shows why (e.g. " in finding


@pytest.mark.parametrize("family, says, never", [
    ("llmd", "llm-d silently serves stale KV for the missing rank", "SGLang"),
    ("sglang", "SGLang needs every TP rank's file of a page", "llm-d")])
def test_the_incomplete_finding_speaks_of_the_family_that_wrote_it(synth_root, family, says, never):
    # an SGLang deployment's incomplete pages were said to make "llm-d silently serve stale KV"
    from helpers.cli_helpers import run_json

    spec = {"family": family, "tp": 2, "defects": ("missing_rank",)}
    root, _ = synth_root(spec if family == "llmd" else {**spec, "blocks": 3, "layers": 2})
    code, summary = run_json("audit", root, "--model-dtype", "bfloat16")
    assert code & 1
    (f,) = [f for f in summary["findings"] if f["code"] == "incomplete"]
    assert says in f["message"] and never not in f["message"], f["message"]
    hint = next(h for h in summary["hints"] if "incomplete" in h["codes"])
    assert says in hint["why"] and never not in hint["why"]
