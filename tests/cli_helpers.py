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


def arrow_pool_after(args: list[str], pool: str | None = None) -> tuple[str, int]:
    """Run `kvmigrate ARGS` in a fresh interpreter (ARROW_DEFAULT_MEMORY_POOL=`pool`, or
    unset) and return Arrow's default pool there afterwards and the bytes mimalloc ever
    held: what a command chose before pyarrow loaded, and whether anything slipped past it."""
    import os
    import subprocess
    import sys

    code = ("from kvmigrate.cli import cli\n"
            f"try:\n    cli({[str(a) for a in args]!r})\nexcept SystemExit:\n    pass\n"
            "import pyarrow as pa\n"
            "print(pa.default_memory_pool().backend_name, pa.mimalloc_memory_pool().max_memory())\n")
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    if pool:
        env["ARROW_DEFAULT_MEMORY_POOL"] = pool
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    name, mimalloc_peak = out.stdout.split()[-2:]
    return name, int(mimalloc_peak)


def loads_pyarrow(args: list[str]) -> bool:
    """Whether `kvmigrate ARGS` (in a fresh interpreter) leaves pyarrow loaded: a command
    that chooses Arrow's pool must do it before anything it imports loads pyarrow."""
    import subprocess
    import sys

    code = ("import sys\nfrom kvmigrate.cli import cli\n"
            f"try:\n    cli({[str(a) for a in args]!r})\nexcept SystemExit:\n    pass\n"
            "print('pyarrow' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()[-1] == "True"
