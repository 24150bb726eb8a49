"""In-process CLI invocation shared by the migration, rollback and verify tests."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvmigrate.cli import cli


def run(*args) -> tuple[int, str]:
    """Exit code and stdout + stderr of `kvmigrate ARGS`."""
    res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return res.exit_code, res.stdout + res.stderr


def run_json(*args) -> tuple[int, dict]:
    """Exit code and the parsed `--json` summary of `kvmigrate ARGS --json`."""
    res = CliRunner().invoke(cli, [str(a) for a in args] + ["--json"], catch_exceptions=False)
    return res.exit_code, json.loads(res.stdout)
