"""`kvmigrate verify ROOT [--journal J]`: re-check namespace digests and migrated blocks."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, cast

import click

from kvmigrate.cli.common import (
    Rate,
    Seconds,
    handle_errors,
    output_options,
    pacing_options,
    pop_selection,
    print_json,
    rerun_command,
    selection_options,
    start_pacing,
)
from kvmigrate.identity.values import DEFAULT_PROFILE, PROFILES

if TYPE_CHECKING:  # the models are types only: importing them costs every command's start-up
    from kvmigrate.outputs import VerifyOutput


@click.command("verify")
@click.argument("root", type=click.Path(path_type=str))  # checked by fsio.check_root, as scan checks it
@click.option("--journal", type=click.Path(exists=True, path_type=str),
              help="Journal file or directory of a migration: check every block it created.")
@click.option("--target", "target", type=click.Choice(PROFILES), default=None,
              help=f"Profile for the summary's target names (default: the journal's, else {DEFAULT_PROFILE}).")
@click.option("--io-depth", "--threads", "threads", type=click.IntRange(min=1), default=None, metavar="N",
              help="Reads in flight (walker threads) for the summary; --threads is the same option.")
@click.option("--strict", is_flag=True,
              help="A journaled block evicted since the migration is an integrity finding (exit 4), not 1.")
@selection_options
@pacing_options
@output_options
@handle_errors
def command(root: str, journal: str | None, target: str | None, threads: int | None, strict: bool, as_json: bool,
            quiet: bool, verbose: int, max_duration: Seconds | None, bwlimit: Rate | None, idle_io: bool,
            **kwargs) -> None:
    """Check that every namespace's config.json under ROOT hashes to its folder name and,
    with --journal, that every block the migration created still has the journaled
    inode, size and XXH3-128 (and, for vllm.cpp, a header the engine accepts). A block
    that is gone was evicted by the engine. The journal must be of a migration into ROOT.
    Writes nothing.

    \b
    Exit code: 0 clean, 1 blocks evicted since the migration (4 with --strict),
    4 integrity findings, +8 when something could not be read, 2 a journal of another root.
    """
    from kvmigrate.fsio import check_root
    from kvmigrate.migrate.verify import render
    from kvmigrate.pipeline import verify

    check_root(root)
    start_pacing(max_duration, bwlimit, idle_io, quiet)
    from kvmigrate.pacing import OutOfTime

    try:
        result = verify(root, journal, target_profile=target, summary=as_json, threads=threads, strict=strict,
                        selection=pop_selection(kwargs))
    except OutOfTime as exc:
        raise OutOfTime(str(exc), hint=f"rerun `{rerun_command(click.get_current_context(), ('root', 'journal'))}` "
                                           "in a longer window") from None
    if as_json:
        print_json(cast("VerifyOutput", result.to_dict()))
    elif not quiet:
        click.echo(render(result))
    sys.exit(result.exit_code)
