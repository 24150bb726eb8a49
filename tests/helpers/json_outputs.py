"""Real `--json` outputs of every command over small synth trees of every family: what
the schema test (tests/report/test_json_schema.py) validates against docs/schema/.

`lifecycle(root, workdir, facts)` runs scan -> report -> audit -> migrate (dry run, then
--apply) -> verify -> runs -> prune (dry run, --apply) -> restore -> rollback (dry run,
then for real) -> purge (dry run) -> identity -> explain on one root and returns
{schema name: [parsed outputs]}.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from kvmigrate.cli import cli
from kvmigrate.migrate import journal as jn

SGLANG_FACTS = ["--model-name", "org/m", "--target-layout", "layer_first"]


def _json(*args: Any, usage_error_ok: bool = False) -> Any:
    """The parsed `--json` output of `kvmigrate ARGS`; None for a usage error (exit 2, which
    prints no JSON) where `usage_error_ok`."""
    res = CliRunner().invoke(cli, [str(a) for a in args] + ["--json"], catch_exceptions=False)
    if usage_error_ok and res.exit_code == 2 and not res.stdout.strip():
        return None
    assert res.stdout.strip(), (args, res.exit_code, res.stderr)
    return json.loads(res.stdout)


def lifecycle(root: Path, work: Path, facts: list[str]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = defaultdict(list)
    m = work / "m.parquet"
    out["facts"].append(_json("facts", root, *facts))
    out["report"].append(_json("scan", root, "-o", m, "--verify", "hash", *facts))
    out["report"].append(_json("report", m))
    out["report"].append(_json("audit", root, *facts))
    out["migrate"].append(_json("migrate", "--manifest", m))
    out["migrate"].append(_json("migrate", "--manifest", m, "--apply"))
    journals = Path(jn.default_journal_dir(str(root)))
    out["verify"].append(_json("verify", root, "--journal", journals))
    out["runs"].append(_json("runs", root))
    out["prune"].append(_json("prune", root, "--quiet-period", "0s", *facts))
    out["prune"].append(_json("prune", root, "--quiet-period", "0s", "--apply", *facts))
    prune_journals = sorted((journals / "prune").glob("*.journal")) if (journals / "prune").is_dir() else []
    for j in prune_journals:
        out["restore"].append(_json("restore", j))
    migrations = sorted(journals.glob("*.journal"))
    for j in migrations:
        out["rollback"].append(_json("rollback", j, "--dry-run"))
        out["rollback"].append(_json("rollback", j))
    out["prune"].append(_json("prune", root, "--purge", "--older-than", "0s"))
    out["runs"].append(_json("runs", root))
    for config in sorted(root.glob("*/config.json"))[:2]:  # (a damaged one is a usage error)
        identity = _json("identity", config, *facts, usage_error_ok=True)
        if identity is not None:
            out["identity"].append(identity)
    summary = out["report"][0]
    for n in summary["namespaces"][:2]:
        out["explain"].append(_json("explain", m, n["source_base"]))
    return dict(out)
