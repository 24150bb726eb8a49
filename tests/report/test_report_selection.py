"""report --only/--exclude and --list by --action / --namespace (issue 18 item 1)."""

from __future__ import annotations

from kvmigrate import manifest

from helpers.cli_helpers import run, run_json

FULL = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1", "--writer-pp", "1"]
LLAMA, QWEN = "meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B"


def scanned(tmp_path, synth_root):
    """A full manifest of a healthy Llama namespace and a Qwen one with a torn block (short)."""
    root, (llama, qwen) = synth_root({"model_name": LLAMA}, {"model_name": QWEN, "scheme": "S2", "defects": "short"})
    out = tmp_path / "m.parquet"
    code, text = run("scan", root, "-o", out, *FULL)
    assert code == 5, text  # pending work (1) + the torn block (4)
    return out, llama.namespaces[0]["base_name"], qwen.namespaces[0]["base_name"]


def test_report_only_counts_and_exits_for_the_selected_namespaces(tmp_path, synth_root):
    out, llama, qwen = scanned(tmp_path, synth_root)
    code, whole = run_json("report", out)
    code, part = run_json("report", out, "--exclude", "Qwen/*")
    assert code == 1  # the torn block is Qwen's: only the pending work is left
    assert [n["source_base"] for n in part["namespaces"]] == [llama]
    llama_entry = next(n for n in whole["namespaces"] if n["source_base"] == llama)
    assert part["totals"]["files"] == llama_entry["files"] < whole["totals"]["files"]
    assert part["totals"]["blocks"] == llama_entry["blocks"]
    assert part["selection"] == [{"by": "report", "only": [], "exclude": ["Qwen/*"], "partial": True,
                                  "skipped_namespaces": [qwen]}]
    assert all(f["namespace"] != qwen for f in part["findings"])
    code, text = run("report", out, "--only", qwen)
    assert code == 5 and "partial         report --only" in text and llama not in text


def test_report_list_by_action_and_namespace(tmp_path, synth_root):
    out, llama, qwen = scanned(tmp_path, synth_root)
    rows = manifest.read_table(out).to_pylist()
    root = manifest.read_metadata(out)["root"]

    def listed(*args):
        code, text = run("report", out, *args, "-q")
        assert code == 0, text
        return sorted(line for line in text.splitlines() if line)

    linked = sorted(f"{root}/{r['relpath']}" for r in rows if r["action"] == "link")
    assert linked and listed("--action", "link") == linked
    assert listed("--action", "link", "--namespace", "Qwen/*") == [p for p in linked if f"/{qwen}_r0/" in p]
    assert listed("--namespace", LLAMA) == sorted(f"{root}/{r['relpath']}" for r in rows if r["source_base"] == llama)
    assert listed("--list", "short", "--exclude", "Qwen/*") == []
    assert len(listed("--list", "short")) == 1
    code, text = run("report", out, "--action", "copy_rename")
    assert code == 2 and "unknown action 'copy_rename'" in text and "needs_slice" in text


def test_report_diff_refuses_a_selection(tmp_path, synth_root):
    out, _, _ = scanned(tmp_path, synth_root)
    code, text = run("report", "--diff", out, out, "--only", "x")
    assert code == 2 and "--diff compares whole manifests" in text
