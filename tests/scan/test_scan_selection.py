"""scan/audit --only/--exclude PATTERN (issue 18 item 1): which namespaces a scan reads, and
a filtered manifest that says it is partial."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvmigrate import manifest
from kvmigrate.selection import Selection

from helpers.cli_helpers import run, run_json

KVMIGRATE = str(Path(sys.executable).parent / "kvmigrate")
FULL = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1", "--writer-pp", "1"]
LLAMA, QWEN = "meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B"


def two_models(synth_root) -> tuple[Path, str, str]:
    """A root with a Llama namespace (vLLM S1) and a Qwen one (vLLM S2); their base folders."""
    root, (llama, qwen) = synth_root({"model_name": LLAMA}, {"model_name": QWEN, "scheme": "S2", "defects": "tmp_vllm"})
    return root, llama.namespaces[0]["base_name"], qwen.namespaces[0]["base_name"]


def opened_paths(tmp_path: Path, *args: str) -> list[str]:
    """Every path the command (and its worker processes, and the compiled leaf walk) opens."""
    trace = tmp_path / f"trace-{len(list(tmp_path.glob('trace-*')))}"
    proc = subprocess.run(["strace", "-f", "-qq", "-e", "trace=open,openat,openat2", "-o", str(trace),
                           KVMIGRATE, *args], capture_output=True, text=True)
    assert proc.returncode in (0, 1), proc.stderr
    return [line.split('"')[1] for line in trace.read_text().splitlines() if line.count('"') >= 2]


def test_filtered_scan_opens_no_file_of_an_excluded_namespace(tmp_path, synth_root):
    root, llama, qwen = two_models(synth_root)
    out = str(tmp_path / "m.parquet")
    everything = opened_paths(tmp_path, "scan", str(root), "-o", out, "--verify", "hash", *FULL)
    assert any(f"/{qwen}_r0/" in p for p in everything)  # the trace sees the walk's opens
    for flags in (["--exclude", "Qwen/*"], ["--only", "meta-llama/*"], ["--exclude", qwen]):
        opened = opened_paths(tmp_path, "scan", str(root), "-o", out, "--verify", "hash", *FULL, *flags)
        assert [p for p in opened if qwen in p] == [], flags
        assert any(f"/{llama}_r0/" in p for p in opened), flags
        rows = manifest.read_table(out).to_pylist()
        assert {r["source_base"] for r in rows} == {llama}, flags


def test_filtered_manifest_says_it_is_partial(tmp_path, synth_root):
    root, llama, qwen = two_models(synth_root)
    (root / "stray.txt").write_text("not a namespace")
    out = tmp_path / "m.parquet"
    code, text = run("scan", root, "-o", out, *FULL, "--exclude", "Qwen/*")
    assert code == 1, text
    assert "partial: scan --exclude 'Qwen/*': 1 namespace left out, and every file outside namespaces" in text
    meta = manifest.read_metadata(out)
    assert meta["selection"] == {"only": [], "exclude": ["Qwen/*"], "partial": True, "skipped_namespaces": [qwen]}
    assert list(meta["namespaces"]) == [llama]
    assert all(r["source_base"] == llama for r in manifest.read_table(out).to_pylist())  # no stray.txt row
    code, summary = run_json("report", out)
    assert summary["selection"][0]["by"] == "scan" and summary["outside_namespaces"] is None
    note = "scan --exclude 'Qwen/*': 1 namespace left out"
    for fmt in ("text", "md", "html"):
        code, rendered = run("report", out, "--format", fmt)
        assert (note.replace("'", "&#x27;") if fmt == "html" else note) in rendered, fmt
    code, full = run("scan", root, "-o", tmp_path / "full.parquet", *FULL)
    assert "selection" not in manifest.read_metadata(tmp_path / "full.parquet") and "partial" not in full


def test_a_pattern_may_name_the_target_folder(tmp_path, synth_root, scan_root):
    """The target base name is known only once config.json is read: such a pattern still selects."""
    root, llama, qwen = two_models(synth_root)
    full, _ = scan_root(root, flags={"kv_kind": "full", "total_kv_heads": 8, "model_dtype": "bfloat16", "writer_tp": 1,
                                     "writer_pp": 1})
    target = next(n["target_base"] for n in full.summary["namespaces"] if n["source_base"] == qwen)
    assert target != qwen
    out = tmp_path / "t.parquet"
    code, text = run("scan", root, "-o", out, *FULL, "--only", target)
    assert list(manifest.read_metadata(out)["namespaces"]) == [qwen], text
    code, text = run("audit", root, *FULL, "--exclude", target)
    assert qwen not in text and llama in text and "partial" in text


def test_folder_names_decide_before_anything_is_read():
    only_llama = Selection.of(["meta-llama/*"])
    assert only_llama.by_folder("meta-llama_Llama-3.1-8B-Instruct_0123456789ab") is True
    assert only_llama.by_folder("Qwen_Qwen2.5-7B_0123456789ab") is False  # no target of Qwen can match
    by_target = Selection.of(["*_0123*"])
    assert by_target.by_folder("Qwen_Qwen2.5-7B_aaaaaaaaaaaa") is None  # its target might be ..._0123...
    assert Selection.of(["*_zz*"]).by_folder("Qwen_Qwen2.5-7B_aaaaaaaaaaaa") is False  # no hex digest has z
    assert Selection.of([], ["Qwen*"]).by_folder("Qwen_Qwen2.5-7B_aaaaaaaaaaaa") is False
    assert Selection.of([], ["Qwen/*"]).admits(["Qwen/Qwen2.5-7B"]) is False
    assert Selection.of(["[mM]eta-llama/*"]).admits(["meta-llama_Llama_0123456789ab"]) is True
