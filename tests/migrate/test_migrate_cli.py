"""`kvmigrate migrate` command-line contract: usage errors, the printed apply command."""

from __future__ import annotations

import shlex

from helpers.cli_helpers import run

MLA = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]


def test_neither_root_nor_manifest_is_a_usage_error():
    code, out = run("migrate")
    assert code == 2 and "give ROOT" in out and "Traceback" not in out


def test_manifest_inputs_must_agree_with_the_manifest(tmp_path, synth_root):
    root, _ = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"})
    m = tmp_path / "m.parquet"
    assert run("scan", root, "-o", m, *MLA)[0] == 1  # pending work
    other = tmp_path / "other"
    other.mkdir()
    code, out = run("migrate", other, "--manifest", m)
    assert code == 2 and "differs from the manifest's root" in out
    code, out = run("migrate", "--manifest", m, "--target", "vllm-0.27")
    assert code == 2 and "scanned for --target vllm-0.34" in out
    code, out = run("migrate", "--manifest", m, "--kv-kind", "full")
    assert code == 2 and "differ from the ones the manifest was scanned with" in out
    code, out = run("migrate", "--manifest", m, *MLA)  # the same facts are fine
    assert code == 1


def test_the_printed_apply_command_applies_the_plan(tmp_path, synth_root):
    root, _ = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"})
    dest = tmp_path / "dest"
    dest.mkdir()
    code, out = run("migrate", root, *MLA, "--dest", dest, "--mode", "auto")
    assert code == 1
    line = next(x for x in out.splitlines() if x.startswith("to apply: "))
    argv = shlex.split(line[len("to apply: "):])
    assert argv[:3] == ["kvmigrate", "migrate", str(root)] and argv[-1] == "--apply"
    assert "--dest" in argv and "--mode" in argv and "--kv-kind" in argv
    code, out = run(*argv[1:])
    assert code == 0, out
    assert len(list(dest.rglob("*.bin"))) == 6
    # the scan of ROOT cannot see DEST: a rerun compares at the target paths instead
    code, out = run(*argv[1:], "--json")
    assert code == 0 and '"already_present": 6' in out and '"created": 0' in out


def test_print_commands_in_copy_mode_copies_instead_of_linking(synth_root):
    root, _ = synth_root({"family": "vllm", "scheme": "S2", "tp": 1})
    flags = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1",
             "--writer-pp", "1"]
    code, link_script = run("migrate", root, *flags, "--print-commands")
    code2, copy_script = run("migrate", root, *flags, "--print-commands", "--mode", "copy")
    assert code == code2 == 0
    assert link_script.count("ln -- ") == 6 and "ln -- " not in copy_script
    assert copy_script.count("cat -- ") == 6
