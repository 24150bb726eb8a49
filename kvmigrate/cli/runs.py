"""`kvmigrate runs ROOT`: every migration and prune run of a root, its state and what it holds."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, cast

import click

from kvmigrate.cli.common import handle_errors, output_options, print_json

if TYPE_CHECKING:  # the models are types only: importing them costs every command's start-up
    from kvmigrate.outputs import Run, RunsOutput


@click.command("runs")
@click.argument("root", type=click.Path(exists=True, file_okay=False, path_type=str))
@output_options
@handle_errors
def command(root: str, as_json: bool, quiet: bool, verbose: int) -> None:
    """List the runs journaled under ROOT/.kvmigrate/journals: `migrate --apply` and `prune
    --apply` runs with their id, kind, state (running, interrupted, done, rolled back,
    restored, purged), outcome counts, the target namespaces a migration holds, the pid
    of a running one, and for an unfinished run the command that resumes it and the one
    that undoes it.

    \b
    Exit code: 0, or 1 when a run is interrupted (resume or undo it: a new migration
    refuses the target namespaces it holds).
    """
    from kvmigrate.migrate.runs import UNFINISHED, list_runs

    runs = list_runs(root)
    code = 1 if any(r.state == "interrupted" for r in runs) else 0
    if as_json:
        listed: RunsOutput = {"root": os.path.abspath(root), "runs": [cast("Run", r.to_dict()) for r in runs],
                              "exit_code": code}
        print_json(listed)
    elif not quiet:
        if not runs:
            click.echo(f"no runs journaled under {os.path.abspath(root)}")
        for r in runs:
            counts = ", ".join(f"{k} {v}" for k, v in sorted(r.counts.items()) if v)
            click.echo(f"{r.run_id}  {r.kind:<7}  {r.state:<11}" + (f"  {counts}" if counts else "")
                       + (f"  (pid {r.holder})" if r.holder and r.holder > 0 else ""))
            if r.targets:
                click.echo(f"  targets: {', '.join(r.targets)}")
            click.echo(f"  journal: {r.journal}")
            if r.state in UNFINISHED and r.resume_command:
                click.echo(f"  resume:  {r.resume_command}")
            if r.state not in ("rolled back", "restored", "purged"):
                click.echo(f"  undo:    {r.undo_command}")
    sys.exit(code)
