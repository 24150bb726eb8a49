"""What every command's start-up imports: `--help` (and a cron job's many short runs)
pays for each module, so the JSON models (types only), the report's view helpers and
`fractions` (which loads `decimal`) are imported where a command uses them, never by the
CLI at start-up."""

from __future__ import annotations

import pytest

from kvmigrate.cli import COMMANDS

from helpers.cli_helpers import modules_after

NOT_AT_START = ("kvmigrate.outputs", "kvmigrate.report.view", "fractions", "decimal", "pyarrow")


@pytest.mark.parametrize("args", [["--help"], ["report", "--help"], ["migrate", "--help"]])
def test_help_imports_no_json_model_nor_fractions(args):
    loaded = modules_after(args)
    assert "kvmigrate.cli.common" in loaded  # (the probe sees the CLI's modules)
    assert [m for m in NOT_AT_START if m in loaded] == []


def test_every_command_module_loads_without_the_models():
    loaded = modules_after(["--help"])
    assert {f"kvmigrate.cli.{m}" for m in COMMANDS.values()} <= loaded | {"kvmigrate.cli.__init__"}
