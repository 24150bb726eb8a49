"""Runs are first-class: an interrupted migration holds its target namespaces until it is
resumed or undone, a resumed run adopts only files it provably made (never another run's),
its rollback removes only those, and audit, report and `kvmigrate runs` name it."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from kvmigrate.migrate import journal as jn
from kvmigrate.migrate.apply import CRASH_ENV

from helpers.cli_helpers import run, run_json

KVMIGRATE = str(Path(sys.executable).with_name("kvmigrate"))
FACTS = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1",
         "--writer-pp", "1"]


def kvmigrate(*args, crash: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    if crash:
        env[CRASH_ENV] = crash
    return subprocess.run([KVMIGRATE, *map(str, args)], capture_output=True, text=True, env=env, timeout=120)


def interrupted(tmp_path, synth_root):
    """A tree of links, its manifest, and run A (`migrate --manifest M --apply`) killed mid-way."""
    root, (res,) = synth_root({"family": "vllm", "scheme": "S2", "blocks": 24})
    m = tmp_path / "m.parquet"
    assert run("scan", root, "-o", m, "--verify", "hash", *FACTS)[0] == 1
    sources = target_files(root)
    killed = kvmigrate("migrate", "--manifest", m, "--apply", crash="created:5")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    (journal_a,) = Path(jn.default_journal_dir(str(root))).glob("*.journal")
    MADE_BY[journal_a] = target_files(root) - sources  # (its done records may not have reached the journal)
    assert len(MADE_BY[journal_a]) == 5
    return root, res, m, journal_a


MADE_BY: dict = {}


def target_files(root) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*.bin")}


def test_a_new_run_refuses_the_targets_an_interrupted_run_holds(tmp_path, synth_root):
    root, res, m, journal_a = interrupted(tmp_path, synth_root)
    before = target_files(root)
    code, out = run("migrate", root, *FACTS, "--apply")  # the audit's hint: another identity, a new journal
    assert code == 8, out
    assert "was interrupted" in out and f"kvmigrate rollback {journal_a}" in out and "--manifest" in out
    assert target_files(root) == before  # nothing written
    assert len(list(journal_a.parent.glob("*.journal"))) == 1  # and no new journal
    # resumed as printed, the run ends; then the other command has nothing left to do
    assert kvmigrate("migrate", "--manifest", m, "--apply").returncode == 0
    code, done = run_json("migrate", root, *FACTS, "--apply")
    assert code == 0 and done["outcomes"]["created"] == 0


def created_blocks(journal) -> set[str]:
    return {rec["path"] for rec in jn.read_records(str(journal)) if rec.get("t") == "done"
            and rec.get("kind") == "block"}


def b_after_a(root, journal_a, monkeypatch):
    """Run B (`migrate ROOT --apply`, a new journal) as a release without the refusal ran
    it over interrupted run A: it ends, creating the rest, at paths A's intents list."""
    from kvmigrate.migrate import runs

    made_by_a = MADE_BY[journal_a]
    with monkeypatch.context() as mp:
        mp.setattr(runs, "check_no_interrupted_run", lambda *a, **k: None)
        code, b = run_json("migrate", root, *FACTS, "--apply")
    assert code == 0 and b["outcomes"]["created"] > 0
    journal_b = Path(b["apply"]["journal"])
    made_by_b = created_blocks(journal_b)
    assert made_by_b and not made_by_b & made_by_a
    intended_by_a = {item["path"] for rec in jn.read_records(str(journal_a)) if rec.get("t") == "intent"
                     for item in rec["items"] if item.get("kind") == "block"}
    assert made_by_b & intended_by_a  # the paths A's resume or rollback would have taken
    return made_by_a, journal_b, made_by_b


def test_the_printed_undo_of_an_interrupted_run_leaves_another_runs_files(tmp_path, synth_root, monkeypatch):
    root, res, m, journal_a = interrupted(tmp_path, synth_root)
    made_by_a, journal_b, made_by_b = b_after_a(root, journal_a, monkeypatch)
    code, dry = run_json("rollback", journal_a, "--dry-run")
    assert dry["removed"]["block"] == len(made_by_a)
    code, out = run("rollback", journal_a)
    assert "another migration run" in out
    assert made_by_b <= target_files(root) and not made_by_a & target_files(root)
    code, verified = run_json("verify", root, "--journal", journal_b)
    assert code == 0, verified["findings"]


def test_a_resumed_run_never_adopts_another_runs_files(tmp_path, synth_root, monkeypatch):
    root, res, m, journal_a = interrupted(tmp_path, synth_root)
    made_by_a, journal_b, made_by_b = b_after_a(root, journal_a, monkeypatch)
    # A resumes: it must not adopt B's files, and its rollback must leave them
    code, a = run_json("migrate", "--manifest", m, "--apply")
    assert code == 0 and a["apply"]["resumed"]
    adopted = {rec["path"] for rec in jn.read_records(str(journal_a)) if rec.get("recovered")}
    assert not adopted & made_by_b, adopted & made_by_b
    code, out = run("rollback", journal_a)
    assert code == 8 and "another migration run" in out  # the folders and config.json B's blocks need stay
    assert made_by_b <= target_files(root)
    code, verified = run_json("verify", root, "--journal", journal_b)
    assert code == 0, verified["findings"]


def test_audit_report_and_runs_name_the_interrupted_run_with_its_resume_command(tmp_path, synth_root):
    root, res, m, journal_a = interrupted(tmp_path, synth_root)
    code, audit = run_json("audit", root, *FACTS)
    assert code & 1
    (finding,) = [f for f in audit["findings"] if f["code"] == "unfinished_run"]
    assert str(journal_a) in finding["message"] and "was interrupted" in finding["message"]
    (hint,) = [h for h in audit["hints"] if "unfinished_run" in h["codes"]]
    assert hint["command"].startswith("kvmigrate migrate --manifest") and hint["command"].endswith("--apply")
    assert f"kvmigrate rollback {journal_a}" in hint["why"]
    code, listed = run_json("runs", root)
    assert code == 1 and [(r["kind"], r["state"]) for r in listed["runs"]] == [("migrate", "interrupted")]
    assert listed["runs"][0]["resume_command"] == hint["command"]
    # the printed command resumes it; then the run is done and the finding gone
    assert kvmigrate(*shlex.split(hint["command"])[1:]).returncode == 0
    code, listed = run_json("runs", root)
    assert code == 0 and listed["runs"][0]["state"] == "done"
    code, audit = run_json("audit", root, *FACTS)
    assert not [f for f in audit["findings"] if f["code"] == "unfinished_run"]


def test_journals_are_named_for_what_they_are_and_old_names_still_read(tmp_path, synth_root):
    """A journal is compressed binary frames, not JSON lines: `<run>.journal`; a journal
    named `.jsonl` (as earlier releases named them) is still found and rolled back."""
    root, (res,) = synth_root({"family": "vllm", "scheme": "S2", "blocks": 6})
    code, done = run_json("migrate", root, *FACTS, "--apply")
    journal = Path(done["apply"]["journal"])
    assert code == 0 and journal.suffix == ".journal" and journal.read_bytes()[:4] == b"KVJF"
    old = journal.with_suffix(".jsonl")
    journal.rename(old)
    code, result = run_json("rollback", journal.parent)
    assert code == 0 and result["removed"]["block"] == len(res.blocks) and result["journals"] == [str(old)]


def test_a_dry_run_reads_a_pruned_source_where_it_is_to_prove_a_killed_runs_copy(tmp_path, synth_root):
    """Found by the lifecycle model: a killed run's padded copies are proven its own by
    re-reading their sources; after a prune moved those sources into its quarantine, the
    dry run (which puts nothing back) read them at their old paths, missed them, and
    predicted a refusal the real rollback (which puts them back first) did not meet."""
    mla = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]
    root, (res,) = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla", "blocks": 8})
    killed = kvmigrate("migrate", root, *mla, "--apply", crash="created:7")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    code, pruned = run_json("prune", root, *mla, "--apply", "--quiet-period", "0")
    assert code == 0 and pruned["moved"]["migrated"] > 0
    (journal,) = Path(jn.default_journal_dir(str(root))).glob("*.journal")
    dcode, dry = run_json("rollback", journal, "--dry-run")
    code, real = run_json("rollback", journal)
    assert (dcode, dry["removed"], dry["kept"]) == (code, real["removed"], real["kept"]) and code == 0


def test_a_target_rolled_back_alone_is_no_longer_the_runs(tmp_path, synth_root):
    """Found by running the sequence the rollback hint prints (`rollback J --exclude T`):
    the journal did not record which targets went, so after a new run re-made them, a full
    `rollback J` took the new run's links (the same inodes) and verify called its config.json
    replaced."""
    mla = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]
    root, (llmd, vllm) = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla", "model_name": "org/mla"},
                                    {"family": "vllm", "scheme": "S2", "tp": 2, "kv_kind": "mla",
                                     "model_name": "org/mla2"})
    code, first = run_json("migrate", root, *mla, "--apply")
    assert code == 0
    journal = first["apply"]["journal"]
    vllm_target = next(t["target_base"] for t in first["targets"] if vllm.namespaces[0]["base_name"] in t["sources"])
    llmd_target = next(t["target_base"] for t in first["targets"] if t["target_base"] != vllm_target)
    assert run("rollback", journal, "--only", vllm_target)[0] == 0
    code, second = run_json("migrate", root, *mla, "--apply")
    assert code == 0 and second["outcomes"]["created"] == len(vllm.blocks)
    made_again = created_blocks(second["apply"]["journal"])
    code, out = run("rollback", journal)
    assert code == 0, out
    assert made_again <= target_files(root) and not (root / llmd_target).exists()
    code, verified = run_json("verify", root, "--journal", jn.default_journal_dir(str(root)))
    assert code == 0, verified["findings"]
