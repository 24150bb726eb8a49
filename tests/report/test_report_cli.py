"""`kvmigrate report`: formats, -o, exit codes, --list, --diff, bad manifests."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from test_report_summary import AUTO, CPP, MLA, ROOT, VLLM, Rows, _hex, sample_metadata, write_sample_manifest

from kvmigrate.cli import cli
from kvmigrate.report.diff import diff
from kvmigrate.report.summary import summarize

from helpers.cli_helpers import arrow_pool_after, loads_pyarrow
from helpers.cli_helpers import run as run_cli


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_default_format_is_text_and_exit_code_is_the_manifests_bits(tmp_path):
    m = write_sample_manifest(tmp_path / "m.parquet")
    res = run("report", str(m))
    assert res.exit_code == summarize(m)["exit_code"] == 5
    assert res.output.startswith("kvmigrate report: /srv/kvcache")
    assert "WHAT TO DO NEXT" in res.output


def test_json_format_and_flag_are_the_summary(tmp_path):
    m = write_sample_manifest(tmp_path / "m.parquet")
    a = json.loads(run("report", str(m), "--format", "json").output)
    b = json.loads(run("report", str(m), "--json").output)
    assert a == b
    assert a["totals"] == json.loads(json.dumps(summarize(m)["totals"]))


def test_output_file_is_written_and_stdout_stays_empty(tmp_path):
    m = write_sample_manifest(tmp_path / "m.parquet")
    for fmt in ("text", "json", "md", "html"):
        out = tmp_path / f"r.{fmt}"
        res = run("report", str(m), "--format", fmt, "-o", str(out))
        assert res.exit_code == 5
        assert res.stdout == ""
        assert VLLM in out.read_text()
    assert not list(tmp_path.glob("*.tmp"))


def test_clean_manifest_exits_zero(tmp_path):
    r = Rows()
    r.add(VLLM, f"{VLLM}/config.json", size=300)
    r.block(VLLM, 0, _hex(1, 1), action="already_present")
    meta = sample_metadata()
    meta["namespaces"] = {VLLM: dict(meta["namespaces"][VLLM], family="vllm", assumed_facts={})}
    from kvmigrate.manifest import ManifestWriter

    with ManifestWriter(tmp_path / "m.parquet", meta) as w:
        w.write_columns(r.cols)
    res = run("report", str(tmp_path / "m.parquet"))
    assert res.exit_code == 0
    # migrated: what is left is reclaiming the legacy names, with prune (issue 19)
    assert "kvmigrate prune" in res.output and "rm " not in res.output


def test_list_prints_absolute_paths_of_one_status(tmp_path):
    m = write_sample_manifest(tmp_path / "m.parquet")
    res = CliRunner().invoke(cli, ["report", str(m), "--list", "short"])
    assert res.exit_code == 0
    lines = res.stdout.splitlines()
    assert len(lines) == 2
    assert all(line.startswith(f"{ROOT}/{VLLM}_r0/") for line in lines)
    nul = CliRunner().invoke(cli, ["report", str(m), "--list", "tmp_leftover", "-0", "-q"])
    assert nul.stdout.count("\0") == 1 and nul.stdout.endswith(".tmp\0")


def test_list_unknown_status_is_a_usage_error(tmp_path):
    m = write_sample_manifest(tmp_path / "m.parquet")
    res = run("report", str(m), "--list", "broken")
    assert res.exit_code == 2
    assert "unknown status 'broken'" in res.output


def test_missing_and_invalid_manifests_exit_2_naming_the_path(tmp_path):
    res = run("report", str(tmp_path / "nope.parquet"))
    assert res.exit_code == 2 and "nope.parquet: manifest not found" in res.output
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    res = run("report", str(bad))
    assert res.exit_code == 2 and "bad.parquet" in res.output and "not a Parquet manifest" in res.output
    import pyarrow as pa
    import pyarrow.parquet as pq

    foreign = tmp_path / "other.parquet"
    pq.write_table(pa.table({"x": [1]}), foreign)
    res = run("report", str(foreign))
    assert res.exit_code == 2 and "not a kvmigrate manifest" in res.output
    assert "Traceback" not in res.output


def test_two_manifests_without_diff_is_a_usage_error(tmp_path):
    m = write_sample_manifest(tmp_path / "m.parquet")
    res = run("report", str(m), str(m))
    assert res.exit_code == 2 and "--diff" in res.output


# --- diff -------------------------------------------------------------------------------

def _later(tmp_path):
    """OLD: the sample without the vllm.cpp namespace. NEW: vllm.cpp appeared, the orphan
    vanished, the vllm namespace grew by 10 blocks and 3 more short files."""
    old = write_sample_manifest(tmp_path / "old.parquet", skip=(CPP,))

    def grow(r: Rows, meta: dict) -> None:
        for i in range(10):
            r.block(VLLM, 0, _hex(100 + i, 1), size=2 << 20, family="ambiguous", target=meta["namespaces"][VLLM]
                    ["target"]["base_name"], action="link", reason="re-key")
        for i in range(3):
            r.block(VLLM, 0, _hex(100 + i, 2), size=0, family="ambiguous", status="short", reason="empty file")

    new = write_sample_manifest(tmp_path / "new.parquet", skip=("lost_ffffffffffff",), extra=grow)
    return old, new


def test_diff_new_vanished_growth_and_new_findings(tmp_path):
    old, new = _later(tmp_path)
    d = diff(summarize(old), summarize(new))
    assert d["new_namespaces"] == [CPP]
    assert d["vanished_namespaces"] == ["lost_ffffffffffff"]
    grown = next(n for n in d["namespaces"] if n["source_base"] == VLLM)
    assert grown["change"] == "changed"
    assert grown["delta"]["files"] == 13 and grown["delta"]["blocks"] == 13
    assert grown["delta"]["bytes"] == 10 * (2 << 20)
    assert grown["delta"]["reusable_blocks"] == 10
    assert {n["source_base"] for n in d["namespaces"]} == {VLLM, CPP, "lost_ffffffffffff"}  # unchanged ones omitted
    new_findings = {(f["namespace"], f["status"]): f for f in d["new_findings"]}
    assert new_findings[(VLLM, "short")]["old_files"] == 2 and new_findings[(VLLM, "short")]["new_files"] == 5
    assert new_findings[(CPP, "header_invalid")]["old_files"] == 0
    assert {(f["namespace"], f["status"]) for f in d["resolved_findings"]} == {("lost_ffffffffffff",
                                                                                 "orphan_namespace")}
    assert (MLA, "replica_mismatch") not in new_findings  # unchanged


def test_diff_cli_every_format_exit_is_new_manifest_bits(tmp_path):
    old, new = _later(tmp_path)
    for fmt in ("text", "md", "html", "json"):
        res = run("report", "--diff", str(old), str(new), "--format", fmt)
        assert res.exit_code == summarize(new)["exit_code"], fmt
        assert CPP in res.output and "lost_ffffffffffff" in res.output
    text = run("report", "--diff", str(old), str(new)).output
    assert "NEW OR GROWN FINDINGS" in text
    row = next(line for line in text.splitlines() if line.startswith(VLLM) and "short" in line)
    assert row.split()[2:5] == ["2", "5", "+3"]
    d = json.loads(run("report", "--diff", str(old), str(new), "--json").output)
    assert d["new_namespaces"] == [CPP]


def test_diff_needs_two_manifests(tmp_path):
    m = write_sample_manifest(tmp_path / "m.parquet")
    res = run("report", "--diff", str(m))
    assert res.exit_code == 2 and "OLD and NEW" in res.output


def test_diff_of_a_manifest_with_itself_shows_no_change(tmp_path):
    m = write_sample_manifest(tmp_path / "m.parquet")
    d = diff(summarize(m), summarize(m))
    assert d["namespaces"] == [] and d["new_findings"] == [] and d["resolved_findings"] == []
    assert d["new_namespaces"] == d["vanished_namespaces"] == []


def test_auto_namespace_is_listed_in_every_format(tmp_path):
    m = write_sample_manifest(tmp_path / "m.parquet")
    for fmt in ("text", "md", "html", "json"):
        assert AUTO in run("report", str(m), "--format", fmt).output


@pytest.mark.parametrize("env, backend", [(None, "system"), ("jemalloc", "jemalloc")])
def test_report_reads_the_manifest_on_the_c_library_malloc(synth_root, tmp_path, env, backend):
    """mimalloc, Arrow's default, keeps the pages each batch of the summary freed: on a
    1M-row manifest the report peaked at 283 MiB with it, 205 MiB on the C library's malloc.
    report chooses that pool before pyarrow loads, as scan and audit do (nothing goes
    through mimalloc); an explicit ARROW_DEFAULT_MEMORY_POOL is kept."""
    root, _ = synth_root(dict(family="llmd", tp=2, kv_kind="mla", blocks=24, defects=("zero_filled",)))
    m = tmp_path / "m.parquet"
    code, out = run_cli("scan", root, "--kv-kind", "mla", "--model-dtype", "bfloat16", "-q", "-o", m)
    assert code in (1, 5), out
    assert arrow_pool_after(["report", str(m), "--format", "json", "-q"], env) == (backend, 0)


def test_loading_the_report_command_leaves_pyarrow_unloaded():
    """report can choose Arrow's pool only while pyarrow is unloaded."""
    assert not loads_pyarrow(["report", "--help"])


def test_list_counts_one_file_in_the_singular(synth_root, tmp_path):
    # it said "kvmigrate: 1 files with status tmp_leftover": every count goes through units.plural
    root, _ = synth_root({"defects": ["tmp_vllm"]})
    m = tmp_path / "m.parquet"
    assert run("scan", str(root), "-o", str(m), "-q").exit_code & 10 == 0
    res = run("report", str(m), "--list", "tmp_leftover")
    assert res.exit_code == 0 and res.stdout.count("\n") == 1
    assert res.stderr == "kvmigrate: 1 file with status tmp_leftover\n"
