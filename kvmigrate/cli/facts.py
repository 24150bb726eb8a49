"""`kvmigrate facts ROOT -o FACTS.json`: a per-namespace skeleton of the deployment facts."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING

import click

from kvmigrate.cli.common import facts_options, handle_errors, output_options, pop_fact_flags, print_json

if TYPE_CHECKING:  # the models are types only: importing them costs every command's start-up
    from kvmigrate.outputs import FactsOutput


@click.command("facts")
@click.argument("root", type=click.Path(path_type=str))
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Write the skeleton here (refused if the file exists); default: print it.")
@facts_options
@output_options
@handle_errors
def command(root: str, output: str | None, target: str, as_json: bool, quiet: bool, verbose: int,
            **kwargs) -> None:
    """Write a FACTS.json skeleton for ROOT: one entry per namespace (its base folder name;
    an SGLang deployment by its model name) with every fact its target needs (--target),
    filled from the flags, --facts and --model-config where they state it, null where
    nobody did. Fill in the nulls per namespace, then `kvmigrate audit ROOT --facts
    FACTS.json`: a root of several models gets each model's facts, never one global set.
    Reads config.json files only.

    \b
    Exit code: 0, or 1 when a needed fact is still null; 2 usage error.
    """
    from kvmigrate.identity.facts import FactsResolver
    from kvmigrate.pipeline import facts_skeleton

    facts_file = kwargs.pop("facts_file", None)
    resolver = FactsResolver(pop_fact_flags(kwargs), facts_file)
    skeleton = facts_skeleton(root, resolver, target)
    unknown = sorted(f"{key}: {name}" for key, entry in skeleton.items() for name, v in entry.items() if v is None)
    text = json.dumps(skeleton, indent=2, sort_keys=True) + "\n"
    if output is not None:
        try:
            with open(output, "x") as f:
                f.write(text)
        except FileExistsError:
            from kvmigrate.errors import UsageError

            raise UsageError("the facts file exists; not overwriting it", path=output,
                             hint="pass another -o path, or --facts it to fill what it leaves null") from None
    if as_json:
        out: FactsOutput = {"root": os.path.abspath(root), "facts": skeleton, "unknown": unknown, "output": output,
                            "exit_code": 1 if unknown else 0}
        print_json(out)
    elif not quiet:
        if output is None:
            click.echo(text, nl=False)
        else:
            click.echo(f"wrote {output}: {len(skeleton)} entries")
        if unknown:
            click.echo(f"{len(unknown)} fact(s) not stated (null): " + "; ".join(unknown[:10])
                       + (" ..." if len(unknown) > 10 else ""), err=True)
            click.echo(f"fill them in, then: kvmigrate audit {root} --facts {output or 'FACTS.json'}", err=True)
    sys.exit(1 if unknown else 0)
