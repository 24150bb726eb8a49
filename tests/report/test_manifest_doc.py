"""docs/manifest.md is the manifest's reader contract: every column of the schema has its
line, and its ready queries (DuckDB SQL and Polars) give the right rows on a real
manifest (a synth tree with merged sources, scanned before and after `migrate --apply`).
"""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import pyarrow.compute as pc
import pytest

from kvmigrate import manifest
from kvmigrate.classify import ACTIONS, STATUS_BITS
from kvmigrate.migrate.model import CREATING
from kvmigrate.migrate.plan import build_plan
from kvmigrate.report.summary import summarize

from helpers.cli_helpers import run

DOC = Path(__file__).resolve().parents[2] / "docs" / "manifest.md"
DEFAULT = "kvmigrate-manifest.parquet"
FACTS = ("--kv-kind", "mla", "--model-dtype", "bfloat16")


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def queries(lang: str) -> dict[str, str]:
    """name -> code of the ```lang blocks that start with a `query: NAME` comment."""
    out = {}
    for code in re.findall(rf"```{lang}\n(.*?)```", doc_text(), re.S):
        m = re.match(r"(?:--|#) query: (\w+)\n", code)
        if m:
            out[m.group(1)] = code
    return out


def sql(name: str, path: Path) -> list[tuple]:
    return duckdb.sql(queries("sql")[name].replace(DEFAULT, str(path))).fetchall()


def polars(name: str, path: Path) -> list[tuple]:
    scope: dict = {}
    exec(queries("python")[name].replace(DEFAULT, str(path)), scope)
    return [tuple(r) for r in scope[name].rows()]


@pytest.fixture(scope="module")
def manifests(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(root, manifest before, manifest after migrate --apply) of llm-d TP=2 and TP=4
    and vLLM S1 and S2 namespaces, each pair merging into one target."""
    from kvmigrate.synth import SynthSpec, build

    from helpers import SMALL

    d = tmp_path_factory.mktemp("mdoc")
    root = d / "root"
    root.mkdir()
    for spec in ({"family": "llmd", "tp": 2, "kv_kind": "mla", "seed": 1},
                 {"family": "llmd", "tp": 4, "kv_kind": "mla", "seed": 1},
                 {"family": "vllm", "scheme": "S1", "kv_kind": "mla", "seed": 3},
                 {"family": "vllm", "scheme": "S2", "kv_kind": "mla", "seed": 3}):
        build(root, SynthSpec(**{**SMALL, **spec}))
    before, after = d / "before.parquet", d / "after.parquet"
    code, out = run("scan", root, *FACTS, "-o", before, "-q")
    assert code == 1, out
    code, out = run("migrate", "--manifest", before, "--apply", "-q")
    assert code == 0, out
    code, out = run("scan", root, *FACTS, "-o", after, "-q")
    assert code == 0, out
    return root, before, after


def test_every_schema_column_has_a_doc_line():
    documented = set(re.findall(r"^\| `(\w+)` \|", doc_text(), re.M))
    missing = [c for c in manifest.COLUMNS if c not in documented]
    assert not missing, f"docs/manifest.md has no line for column(s) {missing}"


def test_every_status_and_action_is_documented():
    text = doc_text()
    status_rows = set(re.findall(r"^\| `(\w+)` \| .* \| [\d+]+ \|$", text, re.M))
    assert set(STATUS_BITS) <= status_rows
    for action in ACTIONS:
        assert re.search(rf"^\| (`\w+`, )*`{action}`", text, re.M), action


def test_metadata_keys_are_documented(manifests):
    _, before, _ = manifests
    meta = manifest.read_metadata(before)
    text = doc_text()
    for key in meta:
        assert f"| `{key}` |" in text, key
    for key in next(iter(meta["namespaces"].values())):
        assert f"`{key}`" in text, key


def test_each_query_has_a_duckdb_and_a_polars_form():
    assert set(queries("sql")) == set(queries("python")) == {"bytes_per_status", "legacy_migrated",
                                                             "pending_by_action"}


def test_bytes_per_status_matches_the_report(manifests):
    _, before, _ = manifests
    rows = sql("bytes_per_status", before)
    assert rows == polars("bytes_per_status", before)
    s = summarize(before)
    expected = sorted((n["source_base"], st, c["files"], c["bytes"]) for n in s["namespaces"]
                      for st, c in n["by_status"].items())
    assert sorted(r for r in rows if r[0] is not None) == expected
    assert sum(r[3] for r in rows) == s["totals"]["bytes"]


def test_legacy_migrated_lists_the_migrated_sources_and_what_they_free(manifests):
    root, before, after = manifests
    assert sql("legacy_migrated", before) == [] == polars("legacy_migrated", before)  # nothing migrated yet
    rows = sql("legacy_migrated", after)
    assert rows == polars("legacy_migrated", after)
    legacy = sorted(manifest.read_metadata(before)["namespaces"])
    assert [r[0] for r in rows] == legacy
    t = manifest.read_table(after)
    for name, target, files, nbytes, freed in rows:
        folder = [p for p in root.rglob("*") if p.is_file() and p.relative_to(root).parts[0].startswith(name)]
        assert files == len(folder) and nbytes == sum(p.stat().st_size for p in folder)
        assert freed == sum(p.stat().st_size for p in folder if p.stat().st_nlink == 1)
        mine = t.filter(pc.equal(t["source_base"].cast("string"), name))
        assert set(mine["target_base"].cast("string").to_pylist()) == {target}
    by_name = {r[0]: r for r in rows}
    placed = duckdb.sql(f"SELECT source_base, list(DISTINCT action) FROM '{before}' WHERE action <> 'none' "
                        "GROUP BY ALL").fetchall()
    assert {a for _, actions in placed for a in actions} >= {"link", "copy_pad"}
    for name, actions in placed:
        first = name == min(n for n, _ in placed if by_name[n][1] == by_name[name][1])
        if actions == ["link"] and first:  # hard-linked into the target: the folder frees its config.json only
            assert by_name[name][4] < 4096 < by_name[name][3]
        else:  # copies, or the merge duplicate of another source: the only link to their bytes
            assert by_name[name][4] > by_name[name][3] - 4096


def test_pending_by_action_counts_blocks_like_the_dry_run(manifests):
    _, before, after = manifests
    rows = sql("pending_by_action", before)
    assert rows == polars("pending_by_action", before)
    plan = build_plan(before)
    planned = {a: sum(tp.counts()[a]["blocks"] for tp in plan.targets) for a in CREATING}
    assert {a: n for a, n, _ in rows} == {a: n for a, n in planned.items() if n}
    assert sum(n for _, n, _ in rows) == plan.pending == summarize(before)["totals"]["pending"]["blocks"]
    assert sql("pending_by_action", after) == [] == polars("pending_by_action", after)
