"""`kvmigrate rollback JOURNAL`: remove exactly what a migration created."""

from __future__ import annotations

import logging
import sys

import click

from kvmigrate.cli.common import handle_errors, output_options, pop_selection, print_json, selection_options

log = logging.getLogger(__name__)


@click.command("rollback")
@click.argument("journal", type=click.Path(exists=True, path_type=str))
@click.option("--dry-run", is_flag=True, help="Check and count what would be removed, per namespace; remove nothing.")
@click.option("--list", "as_list", is_flag=True,
              help="With --dry-run: print the removals as a shell script (rm -f, rmdir) to review or run by hand.")
@selection_options
@output_options
@handle_errors
def command(journal: str, dry_run: bool, as_list: bool, as_json: bool, quiet: bool, verbose: int, **kwargs) -> None:
    """Undo `migrate --apply` from its JOURNAL (a file, or a directory of journals):
    remove the block files it created whose inode and hash still match, then the
    config.json files it created that are unchanged, then its temp files and lock, then
    the folders it created if empty. Nothing else is touched. --only/--exclude: only the
    target namespaces they select (by target or source base folder name, or model).

    After `prune --apply` took its source files, they are put back first (from the
    quarantine, or linked from their target); when any cannot come back (purged, or its
    path re-created), it refuses and removes nothing.

    With --dry-run, nothing is removed or written (not even the journal's rolled-back
    mark): it prints what would go, per namespace; --list prints it as a shell script.
    Both make the rollback's decision: the same refusals, counts and exit code.

    \b
    Exit code: 0, or 8 if something could not (dry run: would not) be removed (listed
    with the reason) or the rollback refuses; 2 for --list without --dry-run.
    """
    from kvmigrate.errors import UsageError
    from kvmigrate.migrate.rollback import render, render_commands, rollback

    if as_list and not dry_run:
        raise UsageError("--list shows what a dry run would remove", hint="add --dry-run (nothing is removed)")
    log.info("rollback %s: %s", journal, "checking what would be removed (dry run)" if dry_run else
             "putting back what a prune took, then removing what the migration created")
    result = rollback(journal, pop_selection(kwargs), dry_run=dry_run, listing=as_list)
    log.info("rollback: done: exit code %d", result.exit_code, extra={"exit_code": result.exit_code})
    if as_list:
        for line in render_commands(result, journal):
            click.echo(line)
    elif as_json:
        print_json(result.to_dict())
    elif not quiet:
        click.echo(render(result))
    sys.exit(result.exit_code)
