"""docs/cli.md is the command line's own `--help` (scripts/gen_cli_docs.py writes it): a
change to an option's help that was not regenerated into the file fails here, naming the
command that fixes it."""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

import pytest

from kvmigrate.cli import COMMANDS

REPO = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli_docs", REPO / "scripts" / "gen_cli_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_cli_md_is_the_current_help():
    gen = _generator()
    want = gen.render()
    have = gen.DOC.read_text() if gen.DOC.exists() else ""
    if have != want:
        diff = list(difflib.unified_diff(have.splitlines(), want.splitlines(), "docs/cli.md", "--help now", lineterm="", n=1))
        shown = "\n".join(diff[:40]) + (f"\n... {len(diff) - 40} more diff lines" if len(diff) > 40 else "")
        pytest.fail(f"docs/cli.md is stale: the command line's --help changed. Regenerate it with\n\n"
                    f"    {gen.REGENERATE}\n\nand commit docs/cli.md.\n\n{shown}", pytrace=False)


def test_docs_cli_md_has_every_command():
    text = _generator().render()
    for name in COMMANDS:
        assert f"\n## kvmigrate {name}\n" in text
        assert f"Usage: kvmigrate {name} [OPTIONS]" in text
