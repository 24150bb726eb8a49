"""`kvmigrate rollback JOURNAL`: remove exactly what a migration created."""

from __future__ import annotations

import sys

import click

from kvmigrate.cli.common import handle_errors, output_options, pop_selection, print_json, selection_options


@click.command("rollback")
@click.argument("journal", type=click.Path(exists=True, path_type=str))
@selection_options
@output_options
@handle_errors
def command(journal: str, as_json: bool, quiet: bool, verbose: int, **kwargs) -> None:
    """Undo `migrate --apply` from its JOURNAL (a file, or a directory of journals):
    remove the block files it created whose inode and hash still match, then the
    config.json files it created that are unchanged, then its temp files and lock, then
    the folders it created if empty. Nothing else is touched. --only/--exclude: only the
    target namespaces they select (by target or source base folder name, or model).

    \b
    Exit code: 0, or 8 if something could not be removed (listed with the reason).
    """
    from kvmigrate.migrate.rollback import render, rollback

    result = rollback(journal, pop_selection(kwargs))
    if as_json:
        print_json(result.to_dict())
    elif not quiet:
        click.echo(render(result))
    sys.exit(result.exit_code)
