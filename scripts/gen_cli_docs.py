#!/usr/bin/env python3
"""Write docs/cli.md, the option reference, from the command line's own `--help`.

    python scripts/gen_cli_docs.py          # rewrite docs/cli.md
    python scripts/gen_cli_docs.py --check  # exit 1 (and say so) when docs/cli.md is stale

Every command and subcommand of `kvmigrate`, in click's own help formatting at a fixed
width (WIDTH columns), so the file is the same on every machine and terminal. The
reference is never edited by hand: tests/cli/test_cli_docs.py fails when the help
changed and the file was not regenerated.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "cli.md"
WIDTH = 80  # columns of the help text; fixed so the output does not depend on the terminal
REGENERATE = "python scripts/gen_cli_docs.py"

HEADER = f"""\
# Command-line reference

Every command's `--help`, as `kvmigrate` prints it ({WIDTH} columns). Generated from the
command line itself by `{REGENERATE}`; do not edit by hand (the tests fail
when this file and the help differ). What the options mean in depth, the `--json` keys
and the exit codes: [interface.md](interface.md).
"""


def _commands(ctx: click.Context) -> list[click.Context]:
    """The context of `ctx`'s command and of every command under it, depth first, in
    the order `--help` lists them."""
    found = [ctx]
    command = ctx.command
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            found += _commands(click.Context(sub, info_name=name, parent=ctx, **sub.context_settings))
    return found


def render() -> str:
    """docs/cli.md as it should read for the command line installed now."""
    from kvmigrate.cli import cli

    settings = {**cli.context_settings, "terminal_width": WIDTH, "max_content_width": WIDTH}
    root = click.Context(cli, info_name="kvmigrate", **settings)
    contexts = _commands(root)
    out = [HEADER]
    out += ["Commands:", ""]
    out += [f"* [`{c.command_path}`](#{c.command_path.replace(' ', '-')})" for c in contexts[1:]]
    out += [""]
    for ctx in contexts:
        out += [f"## {ctx.command_path}", "", "```text", ctx.command.get_help(ctx).rstrip(), "```", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when docs/cli.md is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"docs/cli.md is stale (the command line's --help changed); regenerate it: {REGENERATE}",
                  file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
