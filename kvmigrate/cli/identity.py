"""`kvmigrate identity CONFIG_JSON`: source and target identity with the gate explanation."""

from __future__ import annotations

import click

from kvmigrate.cli.common import facts_options, handle_errors, output_options, pop_fact_flags, print_json


@click.command("identity")
@click.argument("config_json", type=click.Path(dir_okay=False))
@facts_options
@output_options
@handle_errors
def command(config_json: str, target: str, as_json: bool, quiet: bool, verbose: int, **kwargs) -> None:
    """Show the identity of a namespace's CONFIG_JSON and the namespace the --target engine
    would use for the same deployment, with one reason per failed gate condition.

    Exit 0, or 2 when a needed deployment fact is missing (the message names the flag),
    a fact value is one the engine would not accept, the model config is another model's,
    or CONFIG_JSON is not a readable identity.
    """
    from kvmigrate.families.explain import explain_identity, render_text

    facts_file = kwargs.pop("facts_file", None)
    flags = pop_fact_flags(kwargs)
    result = explain_identity(config_json, flags=flags, facts_file=facts_file, profile=target)
    if as_json:
        print_json(result)
    elif not quiet:
        click.echo(render_text(result, config_json))
