"""The `kvmigrate` command line: a click group whose commands live one per module.

Commands are imported lazily (only the one being run), and command modules import the
library inside their function bodies, so `kvmigrate --help` stays fast and never loads
pyarrow.
"""

from __future__ import annotations

import importlib

import click

from kvmigrate import __version__

# command name -> module under kvmigrate.cli (each module defines `command`)
COMMANDS = {
    "scan": "scan",
    "audit": "audit",
    "report": "report",
    "migrate": "migrate",
    "verify": "verify",
    "rollback": "rollback",
    "identity": "identity",
    "demo": "demo",
    "synth": "synth",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        module = COMMANDS.get(name)
        if module is None:
            return None
        try:
            mod = importlib.import_module(f"kvmigrate.cli.{module}")
        except ModuleNotFoundError as exc:
            if exc.name == f"kvmigrate.cli.{module}":
                return None  # command not built yet
            raise
        return mod.command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvmigrate")
def cli() -> None:
    """Scan, audit and migrate persistent LLM KV caches (vLLM fs tier, llm-d fs
    connector, vllm.cpp) into the namespaces a newer engine reads.

    \b
    Exit codes (OR-able bits, like fsck):
      0 clean   1 findings / changes pending   2 usage error
      4 integrity problems   8 operational error   32 interrupted
    """


def main() -> None:
    cli(prog_name="kvmigrate")
