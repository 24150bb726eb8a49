"""In-process CLI invocation shared by the migration, rollback and verify tests."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvmigrate.cli import cli


def run(*args) -> tuple[int, str]:
    """Exit code and stdout + stderr of `kvmigrate ARGS`."""
    res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return res.exit_code, res.stdout + res.stderr


def printed_apply(out: str) -> tuple[str, list[str]]:
    """The apply command a dry run printed: (its label, its arguments after `kvmigrate`)."""
    import shlex

    line = next(x for x in reversed(out.splitlines()) if x.startswith("to apply") and " kvmigrate " in x)
    label, _, command = line.partition(" kvmigrate ")
    return label, shlex.split(command)


def run_json(*args) -> tuple[int, dict]:
    """Exit code and the parsed `--json` summary of `kvmigrate ARGS --json`."""
    res = CliRunner().invoke(cli, [str(a) for a in args] + ["--json"], catch_exceptions=False)
    return res.exit_code, json.loads(res.stdout)


def _after_cli(args: list[str], then: str, pool: str | None = None) -> list[str]:
    """Run `kvmigrate ARGS` in a fresh interpreter (ARROW_DEFAULT_MEMORY_POOL=`pool`, or
    unset), then the Python `then`; the words it printed last."""
    import os
    import subprocess
    import sys

    code = ("from kvmigrate.cli import cli\n"
            f"try:\n    cli({[str(a) for a in args]!r})\nexcept SystemExit:\n    pass\n" + then)
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    if pool:
        env["ARROW_DEFAULT_MEMORY_POOL"] = pool
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          check=True).stdout.split()


def arrow_pool_after(args: list[str], pool: str | None = None) -> tuple[str, int]:
    """Arrow's default pool after `kvmigrate ARGS` and the bytes mimalloc ever held: what a
    command chose before pyarrow loaded, and whether anything slipped past it."""
    name, mimalloc_peak = _after_cli(args, "import pyarrow as pa\n"
                                     "print(pa.default_memory_pool().backend_name, "
                                     "pa.mimalloc_memory_pool().max_memory())\n", pool)[-2:]
    return name, int(mimalloc_peak)


def modules_after(args: list[str]) -> set[str]:
    """The modules a fresh interpreter holds after `kvmigrate ARGS`."""
    return set(_after_cli(args, "import sys\nprint(' '.join(sorted(sys.modules)))\n"))


def loads_pyarrow(args: list[str]) -> bool:
    """Whether `kvmigrate ARGS` leaves pyarrow loaded: a command that chooses Arrow's pool
    must do it before anything it imports loads pyarrow."""
    return _after_cli(args, "import sys\nprint('pyarrow' in sys.modules)\n")[-1] == "True"
