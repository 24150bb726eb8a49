"""Numbers a person can compare (issue 18 item 7): exact counts, plural agreement, an
unknown family that says why, the dry run and the report counting merges alike, and
`report --diff` telling new data from new hard links."""

from __future__ import annotations

import re

from test_report_summary import VLLM, write_sample_manifest

from kvmigrate import manifest
from kvmigrate.report.render import report
from kvmigrate.report.summary import summarize

from helpers.cli_helpers import run, run_json

MLA = ("--kv-kind", "mla", "--model-dtype", "bfloat16")


def test_counts_are_exact_where_totals_are_compared(tmp_path):
    m = write_sample_manifest(tmp_path / "m.parquet", scale=300)  # 12,000 linkable blocks in one namespace
    s = summarize(m)
    text, _ = report(m, "text")
    blocks = s["totals"]["blocks"]
    assert blocks > 12_000
    assert re.search(rf"^  blocks +{blocks:,}$", text, re.M), f"{blocks:,}"
    row = next(line for line in text.splitlines() if line.startswith(VLLM))
    assert f" {s['namespaces'][[n['source_base'] for n in s['namespaces']].index(VLLM)]['blocks']:,} " in row
    assert not re.search(r"\b\d+(\.\d+)?[kMG]\b", text)  # no rounded count anywhere


def test_one_block_is_singular(synth_root, tmp_path):
    root, _ = synth_root({"family": "vllm", "scheme": "S2", "kv_kind": "mla", "blocks": 1})
    m = tmp_path / "m.parquet"
    code, scan_out = run("scan", root, *MLA, "-o", m)
    assert code == 1
    assert "pending: 1 reusable block is not yet" in scan_out
    text, _ = report(m, "text")
    code, dry = run("migrate", "--manifest", m)
    assert code == 1 and "1 block would be created" in dry
    for out in (scan_out, text, dry):
        assert not re.search(r"(?<![\d,.])1 (blocks|files)\b", out), re.findall(r".*\b1 (?:blocks|files)\b.*", out)


def test_unknown_family_says_why_never_none(synth_root, tmp_path):
    root, _ = synth_root({"family": "vllm", "scheme": "S2", "defects": ("config_unparsable",)})
    m = tmp_path / "m.parquet"
    code, scan_out = run("scan", root, "-o", m)
    assert code & 4
    text, _ = report(m, "text")
    for out in (scan_out, text):
        assert "None" not in out
        assert "unknown (config.json invalid)" in out


def test_dry_run_and_report_count_merged_replicas_alike(synth_root, tmp_path):
    """llm-d TP=2 and TP=4 MLA caches of one model (replicas merged into one
    replicated-layout target) and vLLM S1 and S2 folders of one deployment."""
    root, _ = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla", "seed": 1},
                         {"family": "llmd", "tp": 4, "kv_kind": "mla", "seed": 1},
                         {"family": "vllm", "scheme": "S1", "kv_kind": "mla", "seed": 3},
                         {"family": "vllm", "scheme": "S2", "kv_kind": "mla", "seed": 3})
    m = tmp_path / "m.parquet"
    run("scan", root, *MLA, "-o", m, "-q")
    code, plan = run_json("migrate", "--manifest", m)
    assert code == 1
    merges = sum(t["actions"]["merge_duplicate"]["blocks"] for t in plan["targets"])
    assert merges == 12 and plan["pending"] == 12  # SMALL: 6 blocks per namespace, two pairs
    code, rep = run_json("report", m, "--format", "json")
    assert rep["totals"]["pending"]["blocks"] == plan["pending"]
    assert rep["totals"]["merge_duplicates"]["blocks"] == merges
    text, _ = report(m, "text")
    assert re.search(rf"^  pending blocks +{plan['pending']}$", text, re.M)
    assert re.search(rf"^  merge duplicates +{merges} blocks", text, re.M)
    _, dry = run("migrate", "--manifest", m)
    assert f"{plan['pending']} blocks would be created" in dry
    # Blocks by action: each action's blocks less its merge duplicates are the dry run's action lines
    planned = {a: sum(t["actions"][a]["blocks"] for t in plan["targets"]) for a in ("link", "copy_pad")}
    table = text[text.index("BLOCKS BY ACTION"):text.index("NAMESPACE DETAILS")]
    assert "OF WHICH MERGE DUPLICATES" in table
    for action, n in planned.items():
        blocks, merged = re.search(rf"^{action} +(\d+) +\S+ \S+ +(\d+)$", table, re.M).groups()
        assert int(blocks) - int(merged) == n > 0, action


def test_diff_tells_new_data_from_new_hard_links(synth_root, tmp_path):
    root, _ = synth_root({"family": "vllm", "scheme": "S2", "kv_kind": "mla", "blocks": 10, "page_bytes": 4096})
    before, after = tmp_path / "before.parquet", tmp_path / "after.parquet"
    run("scan", root, *MLA, "-o", before, "-q")
    code, out = run("migrate", "--manifest", before, "--apply", "-q")
    assert code == 0, out
    run("scan", root, *MLA, "-o", after, "-q")
    code, d = run_json("report", "--diff", before, after, "--format", "json")
    o, n = d["old"]["totals"], d["new"]["totals"]
    old_rows = set(manifest.read_table(before, ["relpath"])["relpath"].to_pylist())
    t = manifest.read_table(after, ["relpath", "size", "nlink"]).to_pylist()
    linked = sum(r["size"] for r in t if r["relpath"] not in old_rows and r["nlink"] > 1)
    new_alone = sum(r["size"] for r in t if r["relpath"] not in old_rows and r["nlink"] == 1)
    assert linked >= 10 * 4096  # the ten blocks, hard-linked into the target
    assert n["bytes"] - o["bytes"] == linked + new_alone  # every path counted: looks like new data
    assert n["bytes_shared"] - o["bytes_shared"] == 2 * linked  # the source and the target path of each
    assert abs((n["data_bytes"] - o["data_bytes"]) - new_alone) <= 1  # but only the unlinked files are new data
    _, text = run("report", "--diff", before, after)
    assert re.search(r"^  shared \(hard links\) +0 B -> .* \(\+", text, re.M)
    assert re.search(r"^  data on disk .* \(a hard-linked file counted once", text, re.M)
