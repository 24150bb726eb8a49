"""`kvmigrate restore JOURNAL`: put back exactly what a prune moved into the quarantine."""

from __future__ import annotations

import logging
import sys

import click

from kvmigrate.cli.common import handle_errors, output_options, print_json
from kvmigrate.units import plural

log = logging.getLogger(__name__)


@click.command("restore")
@click.argument("journal", type=click.Path(exists=True, path_type=str))
@output_options
@handle_errors
def command(journal: str, as_json: bool, quiet: bool, verbose: int) -> None:
    """Undo `prune --apply` from its JOURNAL (a file, or the directory
    ROOT/.kvmigrate/journals/prune/): every file goes back to its path, same inode,
    and the folders the prune removed are made again. A path re-created meanwhile is a
    conflict: the pruned file stays in the quarantine, reported, never overwritten.

    \b
    Exit code: 0, or 8 if something could not be put back (listed with the reason).
    """
    from kvmigrate.migrate.restore import render_restore, restore

    log.info("restore %s: putting back what the prune moved", journal)
    result = restore(journal)
    log.info("restore: done: %d files not restored", len(result.kept), extra={"not_restored": len(result.kept)})
    if as_json:
        print_json(result.to_dict())
    elif not quiet:
        click.echo(render_restore(result))
    if result.kept:
        click.echo(f"kvmigrate: error: {plural(len(result.kept), 'file')} not restored; {result.kept[0]}", err=True)
        gone = len(result.kept) - result.conflicts
        hints = ([f"{plural(result.conflicts, 're-created path')} kept as they are: move them aside and rerun "
                  f"`kvmigrate restore {journal}` to put the pruned files back"] if result.conflicts else []) + (
            [f"{plural(gone, 'file')} gone (purged, or removed with --no-quarantine): a migrated block's bytes live on "
             "in its target namespace"] if gone else [])
        click.echo(f"  hint: {'; '.join(hints)}", err=True)
    sys.exit(result.exit_code)
