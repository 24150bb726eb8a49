"""`-q` is quiet for every command alike (issue 18 item 5): on a clean tree each command
prints nothing at all, on stdout or stderr, and says it through its exit code (0)."""

from __future__ import annotations

from helpers.cli_helpers import run

FACTS = ["--model-dtype", "bfloat16", "--kv-kind", "full", "--total-kv-heads", "8", "--writer-tp", "1", "--writer-pp", "1"]


def test_every_command_is_silent_with_q_on_a_clean_tree(synth_root, tmp_path):
    root, _ = synth_root({"family": "vllm", "scheme": "S1", "tp": 1})
    assert run("migrate", root, *FACTS, "--apply", "-q") == (0, "")
    (journal,) = (root / ".kvmigrate" / "journals").glob("*.journal")
    config = next(root.glob("*/config.json"))
    m = tmp_path / "m.parquet"
    commands = [
        ["scan", root, *FACTS, "-o", m],
        ["audit", root, *FACTS],
        ["audit", root, *FACTS, "-o", tmp_path / "audit.md", "--format", "md"],
        ["report", m],
        ["report", m, "--format", "html", "-o", tmp_path / "r.html"],
        ["migrate", root, *FACTS],
        ["migrate", "--manifest", m],
        ["migrate", "--manifest", m, "--apply"],
        ["verify", root],
        ["verify", root, "--journal", journal],
        ["identity", config, *FACTS],
        ["synth", tmp_path / "another"],
        ["rollback", journal],
    ]
    said = {" ".join(map(str, c[:1] + c[-2:])): run(*c, "-q") for c in commands}
    assert {k: v for k, v in said.items() if v != (0, "")} == {}
    assert (tmp_path / "audit.md").is_file() and (tmp_path / "r.html").is_file()  # -q still writes files


def test_every_command_s_help_says_what_q_does():
    """`--help` says what -q does (docs/interface.md): the result too is left out, not
    only progress and log lines (the help said so once, and `report -q` then looked broken)."""
    import click

    from kvmigrate.cli import cli

    ctx = click.Context(cli)
    said = {}
    for name in cli.list_commands(ctx):
        command = cli.get_command(ctx, name)
        q = next((p for p in command.params if "-q" in p.opts), None)
        if q is not None and name != "synth":  # synth's own -q: "Print nothing (the tree is still built)"
            said[name] = " ".join(q.help.split())
    assert "report" in said and "scan" in said
    wrong = {name: h for name, h in said.items()
             if not ("nothing but errors" in h and "still written" in h and "--json still prints" in h)}
    assert wrong == {}
