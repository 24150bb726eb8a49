"""`kvmigrate explain MANIFEST NAMESPACE`: why a namespace has its target, from a manifest alone."""

from __future__ import annotations

import click

from kvmigrate.allocator import return_freed_memory
from kvmigrate.cli.common import handle_errors, output_options, prefer_arrow_pool, print_json


@click.command("explain")
@click.argument("manifest", type=click.Path(path_type=str))
@click.argument("namespace")
@output_options
@handle_errors
def command(manifest: str, namespace: str, as_json: bool, quiet: bool, verbose: int) -> None:
    """From MANIFEST alone (nothing under the cache root is read): why NAMESPACE (a source
    base folder name, or a model or target base name naming one namespace) has the target
    it has: each gate condition, passed or failed, with the facts it read and where each
    came from (flag, FACTS.json key, model config, assumed); then every class of blocks
    that is not reusable, with its reason and the command that would change it.
    For a single config.json, see `kvmigrate identity`.

    \b
    Exit code: 0; 2 when MANIFEST is not a manifest or NAMESPACE is not in it.
    """
    prefer_arrow_pool("system")  # (as report: see kvmigrate.scan.run._lean_arrow_allocator)
    return_freed_memory()
    from kvmigrate.report.explain import explain, render_text

    result = explain(manifest, namespace)
    if as_json:
        print_json(result)
    elif not quiet:
        click.echo(render_text(result), nl=False)
