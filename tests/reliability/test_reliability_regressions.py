"""Regression tests for the defects the reliability campaign found (scripts/reliability.py,
reports/RELIABILITY.md). One test per defect; each fails on the code before its fix."""

from __future__ import annotations

import errno
import json
import os

from click.testing import CliRunner

from kvmigrate import layout
from kvmigrate.cli import cli

from helpers.reference_reader import listing

FLAGS = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1", "--writer-pp", "1"]


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def test_a_journal_file_without_its_header_does_not_break_rollback_or_verify(synth_root):
    """kill -9 between creating the journal file and writing its header leaves an empty
    `*.jsonl` next to real journals; `rollback DIR` and `verify --journal DIR` exited 2
    on it and left the real runs alone."""
    root, _ = synth_root({"family": "vllm", "scheme": "S1", "tp": 1})
    pristine = listing(root, with_times=False)
    assert invoke("migrate", root, *FLAGS, "--apply").exit_code == 0
    journals = root / layout.OWN_DIR / "journals"
    (journals / "20000101T000000Z-1-aaaaaa.jsonl").write_bytes(b"")
    (journals / "20000101T000000Z-2-bbbbbb.jsonl").write_bytes(b'{"t":"hea')  # torn header
    assert invoke("verify", root, "--journal", journals).exit_code == 0
    res = invoke("rollback", journals)
    assert res.exit_code == 0, res.stdout + res.stderr
    assert listing(root, exclude_top=(layout.OWN_DIR,), with_times=False) == pristine


def test_an_explicit_non_journal_says_what_to_pass(tmp_path):
    bogus = tmp_path / "notes.jsonl"
    bogus.write_text("hello\n")
    res = invoke("rollback", bogus)
    assert res.exit_code == 2
    assert str(bogus) in res.stderr and "hint: pass the journal" in res.stderr


def test_a_hard_link_the_kernel_refuses_names_the_cause_and_the_remedy(synth_root, monkeypatch):
    """fs.protected_hardlinks: a user who may write --dest still gets EPERM linking files
    it does not own; the message said "run as a user that may write the destination"."""
    from kvmigrate.migrate import fsops

    root, _ = synth_root({"family": "vllm", "scheme": "S1", "tp": 1})

    def refused(self, src, rel):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM), src)

    monkeypatch.setattr(fsops.DestTree, "link_in", refused)
    res = invoke("migrate", root, *FLAGS, "--apply")
    assert res.exit_code == 8
    assert "protected_hardlinks" in res.stderr and "owns the cache files" in res.stderr
    assert "--mode copy" in res.stderr and str(root) in res.stderr


def test_failed_blocks_are_reported_on_stderr_too(synth_root, monkeypatch):
    """EMLINK fails one block without stopping the run: exit 8, but stderr was silent
    (and with -q nothing at all was printed)."""
    from kvmigrate.migrate import fsops

    root, (res,) = synth_root({"family": "vllm", "scheme": "S1", "tp": 1})
    victim = res.blocks[0]["hex"]
    real = fsops.DestTree.link_in

    def emlink(self, src, rel):
        if victim in rel:
            raise OSError(errno.EMLINK, os.strerror(errno.EMLINK), src)
        return real(self, src, rel)

    monkeypatch.setattr(fsops.DestTree, "link_in", emlink)
    out = invoke("migrate", root, *FLAGS, "--apply", "-q")
    assert out.exit_code == 8 and out.stdout == ""
    assert "1 block failed" in out.stderr and victim in out.stderr and "--mode auto" in out.stderr


def test_apply_names_the_integrity_findings_it_did_not_migrate(synth_root):
    """Integrity states of blocks it does not place are reported, not failed on (exit 0);
    the apply output says where they are."""
    root, _ = synth_root({"family": "vllm", "scheme": "S1", "tp": 1, "defects": ("short",)})
    res = invoke("migrate", root, *FLAGS, "--apply", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["outcomes"]["failed"] == 0
    res = invoke("migrate", root, *FLAGS, "--apply")
    assert "integrity findings in the manifest" in res.stdout and f"kvmigrate audit {root}" in res.stdout


def test_a_stopped_run_does_not_print_migration_applied(synth_root, monkeypatch):
    from kvmigrate.migrate import fsops

    root, _ = synth_root({"family": "vllm", "scheme": "S1", "tp": 1})

    def full(self, src, rel):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), src)

    monkeypatch.setattr(fsops.DestTree, "link_in", full)
    res = invoke("migrate", root, *FLAGS, "--apply")
    assert res.exit_code == 8
    assert res.stdout.startswith(f"migration stopped early in {root}") and "applied" not in res.stdout


def test_an_enormous_config_json_is_not_read_into_memory(tmp_path, synth_root):
    """A 1 TiB sparse config.json: scan read it whole (MemoryError traceback under a
    memory limit, the OOM killer without one)."""
    import resource
    import subprocess
    import sys
    from pathlib import Path

    from kvmigrate import manifest

    root, (res,) = synth_root({"family": "vllm", "scheme": "S1", "tp": 1})
    config = root / res.namespaces[0]["config_relpath"]
    os.truncate(config, 1 << 40)
    out = tmp_path / "m.parquet"

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    kvmigrate = str(Path(sys.executable).with_name("kvmigrate"))
    p = subprocess.run([kvmigrate, "scan", str(root), "-o", str(out)], capture_output=True, text=True,
                       preexec_fn=limit_memory, timeout=120)
    assert "Traceback" not in p.stderr and p.returncode == 1 | 4, p.stderr
    rows = [r for r in manifest.read_table(out).to_pylist() if r["relpath"] == res.namespaces[0]["config_relpath"]]
    assert rows[0]["status"] == "config_invalid" and "larger than" in rows[0]["reason"]


def test_scan_with_findings_names_the_command_that_explains_them(synth_root, tmp_path):
    root, _ = synth_root({"family": "vllm", "scheme": "S1", "tp": 1, "defects": ("short",)})
    out = tmp_path / "m.parquet"
    res = invoke("scan", root, "-o", out)
    assert res.exit_code == 1 | 4
    assert "details and what to do next: kvmigrate report" in res.stdout and "m.parquet" in res.stdout


def _surrogate_cpp_config(synth_root) -> tuple:
    """A vllm.cpp root whose rank-0 config.json names the model with a lone surrogate
    escape ("\\ud800"): valid JSON for Python, not encodable as the engine's UTF-8."""
    root, (res,) = synth_root({"family": "vllmcpp", "tp": 1, "kv_kind": "mla"})
    config = root / res.namespaces[0]["config_relpath"]
    fields = json.loads(config.read_bytes())
    fields["model_name"] = "evil\ud800name"
    config.write_text(json.dumps(fields))  # ensure_ascii: written as the escape
    return root, config


def test_a_lone_surrogate_in_a_vllmcpp_config_is_config_invalid_not_a_traceback(synth_root, tmp_path):
    from kvmigrate import manifest

    root, config = _surrogate_cpp_config(synth_root)
    out = tmp_path / "m.parquet"
    res = CliRunner().invoke(cli, ["scan", str(root), "-o", str(out)])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert res.exit_code == 1 | 4
    row = next(r for r in manifest.read_table(out).to_pylist() if r["relpath"].endswith("config.json"))
    assert row["status"] == "config_invalid" and "surrogate" in row["reason"]


def test_identity_of_a_config_it_cannot_hash_is_a_usage_error(synth_root):
    root, config = _surrogate_cpp_config(synth_root)
    res = CliRunner().invoke(cli, ["identity", str(config)])
    assert res.exit_code == 2 and not isinstance(res.exception, UnicodeError)
    assert "cannot hash the identity" in res.stderr and str(config) in res.stderr


def test_identity_refuses_an_enormous_config_without_reading_it(synth_root):
    root, (res,) = synth_root({"family": "vllm", "scheme": "S1", "tp": 1})
    config = root / res.namespaces[0]["config_relpath"]
    os.truncate(config, 1 << 40)
    out = CliRunner().invoke(cli, ["identity", str(config)])
    assert out.exit_code == 2 and "larger than" in out.stderr


def test_migrate_with_a_file_that_is_not_parquet_is_a_usage_error(tmp_path):
    bogus = tmp_path / "m.parquet"
    bogus.write_text("not parquet")
    res = CliRunner().invoke(cli, ["migrate", "--manifest", str(bogus)])
    assert res.exit_code == 2, res.exception  # an uncaught exception exits 1
    assert "cannot read the manifest" in res.stderr and str(bogus) in res.stderr and "hint:" in res.stderr


def test_a_journal_with_a_damaged_header_or_record_is_named_not_a_traceback(tmp_path):
    header_only = tmp_path / "a.jsonl"
    header_only.write_text('{"t":"header"}\n')  # valid JSON, no root/dest
    no_path = tmp_path / "b.jsonl"
    no_path.write_text(json.dumps({"t": "header", "root": str(tmp_path), "dest": str(tmp_path)}) + "\n"
                       + json.dumps({"t": "intent", "items": [{"kind": "block"}]}) + "\n")
    for journal in (header_only, no_path):
        for args in (["rollback", str(journal)], ["verify", str(tmp_path), "--journal", str(journal)]):
            res = CliRunner().invoke(cli, args)
            assert res.exit_code == 2, (args, res.exception)
            assert "damaged journal" in res.stderr and str(journal) in res.stderr


def test_a_lone_surrogate_in_a_vllm_model_name_is_shown_escaped_not_a_traceback(synth_root, tmp_path):
    """vLLM hashes with ensure_ascii, so "\\ud800" in model_name is a readable (if
    mismatching) identity; writing the manifest, the report and `identity` crashed on it."""
    root, (res,) = synth_root({"family": "vllm", "scheme": "S1", "tp": 1})
    config = root / res.namespaces[0]["config_relpath"]
    fields = json.loads(config.read_bytes())
    fields["model_name"] = "evil\ud800name"
    config.write_text(json.dumps(fields))
    out = tmp_path / "m.parquet"
    scan = CliRunner().invoke(cli, ["scan", str(root), "-o", str(out)])
    assert scan.exit_code == 1 | 4, scan.exception  # digest_mismatch
    for args in (["report", str(out), "--format", "text"], ["audit", str(root)],
                 ["identity", str(config), *FLAGS]):
        res = CliRunner().invoke(cli, args)
        assert not isinstance(res.exception, UnicodeError), (args, res.exception)
        assert "evil\\ud800name" in res.stdout, args


def test_report_to_a_file_with_findings_says_where_they_are(synth_root, tmp_path):
    """`report M -o FILE` exited 5 with nothing on stdout or stderr."""
    root, _ = synth_root({"family": "vllm", "scheme": "S1", "tp": 1, "defects": ("short",)})
    m, out = tmp_path / "m.parquet", tmp_path / "r.html"
    assert invoke("scan", root, "-o", m).exit_code == 5
    res = invoke("report", m, "--format", "html", "-o", out)
    assert res.exit_code == 5 and res.stdout == ""
    assert f"findings (exit 5): see {out}" in res.stderr


_KILL_AT_LOCK_RELEASE = '''\
import os, signal
from kvmigrate.migrate import lock as _lock
def _release(self):
    os.kill(os.getpid(), signal.SIGKILL)
_lock.NamespaceLock.release = _release
'''


def test_a_kill_between_the_last_block_and_complete_leaves_no_stale_lock(tmp_path, synth_root):
    """The run wrote "complete", then was killed before removing its lock file: no later
    run resumed a complete journal, so the lock file stayed in the target namespace for
    good (found by a double kill in the campaign)."""
    import subprocess
    import sys
    from pathlib import Path

    root, _ = synth_root({"family": "vllm", "scheme": "S1", "tp": 1})
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(_KILL_AT_LOCK_RELEASE)
    kvmigrate = str(Path(sys.executable).with_name("kvmigrate"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")])))
    killed = subprocess.run([kvmigrate, "migrate", str(root), *FLAGS, "--apply"], env=env, capture_output=True)
    assert killed.returncode == -9
    assert list(root.rglob(layout.LOCK_NAME))  # the kill came while the lock was held
    again = subprocess.run([kvmigrate, "migrate", str(root), *FLAGS, "--apply"], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert not list(root.rglob(layout.LOCK_NAME))


def test_scan_verify_size_does_not_read_a_huge_zero_header_vllmcpp_file(tmp_path, synth_root):
    """`scan --verify size` read a vllm.cpp block file with an all-zero header whole (to
    tell zero_filled from header_invalid): a 1 TiB sparse file took many minutes. Bounded
    by CPU time, not wall time: reading 1 TiB costs far more than the limit."""
    import resource
    import subprocess
    import sys
    from pathlib import Path

    from kvmigrate import manifest

    root, (res,) = synth_root({"family": "vllmcpp", "tp": 2, "kv_kind": "mla"})
    rank1 = next(p for p in root.iterdir() if p.name.endswith("_r1"))
    huge = rank1 / "d05" / "48_g0" / ("d0548e" + "ab" * 29 + ".bin")
    huge.parent.mkdir(parents=True)
    huge.write_bytes(b"")
    os.truncate(huge, 1 << 40)

    def limit_cpu():
        resource.setrlimit(resource.RLIMIT_CPU, (30, 30))

    out = tmp_path / "m.parquet"
    kvmigrate = str(Path(sys.executable).with_name("kvmigrate"))
    p = subprocess.run([kvmigrate, "scan", str(root), "-o", str(out), "--verify", "size", "--kv-kind", "mla",
                        "--model-dtype", "bfloat16"], capture_output=True, text=True, preexec_fn=limit_cpu)
    assert p.returncode >= 0, f"killed by signal {-p.returncode} (CPU limit): it read the huge file"
    row = next(r for r in manifest.read_table(out).to_pylist() if r["relpath"].endswith(huge.name))
    assert row["status"] == "header_invalid"
