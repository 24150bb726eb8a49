"""Logging (interface.md §1): `-v` says on stderr what each phase does (INFO), `-vv` more
(DEBUG), `--log-format json` makes every log line one JSON object, on every command; stdout
stays what it is without them. Bad --bwlimit, --shard, --max-duration, --recheck and
--older-than values are click parse errors (exit 2) naming the option."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvmigrate.cli import cli

FACTS = ["--model-dtype", "bfloat16", "--kv-kind", "full", "--total-kv-heads", "8", "--writer-tp", "1", "--writer-pp", "1"]


def invoke(*args):
    res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def info_lines(stderr: str, level: str = "info") -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"kvmigrate: {level}: ")]


def test_v_says_each_phase_on_stderr_and_leaves_stdout_as_it_was(synth_root, tmp_path):
    root, _ = synth_root({"family": "vllm", "scheme": "S1", "tp": 1})
    m = tmp_path / "m.parquet"
    code, _, err = invoke("scan", root, *FACTS, "-o", m, "--verify", "hash", "-v")
    said = "\n".join(info_lines(err))
    for phase in ("listing the root", "found 1 namespaces", "walking", "hashing every file", "manifest written"):
        assert phase in said, err
    assert not info_lines(err, "debug")

    for args in (["report", m], ["migrate", "--manifest", m], ["verify", root], ["runs", root]):
        quiet_code, quiet_out, quiet_err = invoke(*args)
        code, out, err = invoke(*args, "-v")
        assert (code, out) == (quiet_code, quiet_out), args  # stdout unchanged by -v
        assert info_lines(err) and not info_lines(quiet_err), args

    code, _, err = invoke("migrate", "--manifest", m, "--apply", "-v")
    said = "\n".join(info_lines(err))
    assert "plan: " in said and "apply: " in said and "journal" in said, err
    (journal,) = (root / ".kvmigrate" / "journals").glob("*.journal")
    code, _, err = invoke("prune", root, *FACTS, "--apply", "--force-live", "-v")
    assert "prune: moving" in err, err
    (pruned,) = (root / ".kvmigrate" / "journals" / "prune").glob("*.journal")
    code, _, err = invoke("restore", pruned, "-v")
    assert "restore " in "\n".join(info_lines(err)), err
    code, _, err = invoke("rollback", journal, "-v")
    assert "rollback " in "\n".join(info_lines(err)), err


def test_vv_adds_debug_lines(synth_root, tmp_path):
    root, _ = synth_root({"family": "vllm", "scheme": "S1", "tp": 1})
    code, out, err = invoke("scan", root, *FACTS, "-o", tmp_path / "m.parquet", "-vv")
    debug = info_lines(err, "debug")
    assert any("scan: namespace " in line for line in debug), err
    assert any("bucket" in line for line in debug), err
    assert "kvmigrate:" not in out  # logs never go to stdout


def test_log_format_json_on_every_command(synth_root, tmp_path):
    root, _ = synth_root({"family": "vllm", "scheme": "S1", "tp": 1})
    m = tmp_path / "m.parquet"
    config = next(root.glob("*/config.json"))
    namespace = config.parent.name
    steps = [
        ["scan", root, *FACTS, "-o", m],
        ["report", m],
        ["explain", m, namespace],
        ["identity", config, *FACTS],
        ["facts", root, *FACTS],
        ["audit", root, *FACTS],
        ["migrate", root, *FACTS],
        ["migrate", "--manifest", m, "--apply"],
        ["verify", root],
        ["runs", root],
        ["prune", root, *FACTS, "--apply", "--force-live"],
        ["restore", root / ".kvmigrate" / "journals" / "prune"],
        ["rollback", root / ".kvmigrate" / "journals"],
        ["synth", tmp_path / "another"],
    ]
    seen = set()
    for args in steps:
        code, out, err = invoke(*args, "-q", "-v", "--log-format", "json")
        assert code != 2, (args, err)
        objects = [json.loads(line) for line in err.splitlines()]  # every stderr line is one JSON object
        logs = [o for o in objects if "level" in o]
        assert logs, (args, err)
        for o in logs:
            assert {"time", "level", "logger", "message"} <= set(o), o
            assert o["logger"].startswith("kvmigrate")
        seen.add(args[0])
    assert seen == {"scan", "report", "explain", "identity", "facts", "audit", "migrate", "verify", "runs", "prune",
                    "restore", "rollback", "synth"}


def test_every_command_takes_v_and_log_format():
    import click

    ctx = click.Context(cli)
    missing = {}
    for name in cli.list_commands(ctx):
        opts = {o for p in cli.get_command(ctx, name).params for o in p.opts}
        lacking = {"-v", "--log-format"} - opts
        if lacking:
            missing[name] = lacking
    assert missing == {}


@pytest.mark.parametrize("command, option, value", [
    ("scan", "--bwlimit", "fast"),
    ("scan", "--bwlimit", "0"),
    ("scan", "--shard", "3/2"),
    ("audit", "--shard", "one"),
    ("verify", "--max-duration", "soon"),
    ("scan", "--max-duration", "0s"),
    ("audit", "--recheck", "2"),
    ("scan", "--recheck", "x"),
    ("prune", "--older-than", "old"),
])
def test_a_bad_value_is_a_parse_error_naming_the_option(tmp_path, command, option, value):
    """Refused while parsing (click's usage error, exit 2), before any path is looked at:
    the root here does not even exist."""
    code, out, err = invoke(command, tmp_path / "missing", option, value)
    assert code == 2
    assert f"Invalid value for '{option}'" in err and repr(value) in err, err
    assert "kvmigrate: error:" not in err  # not a library error after the run began
