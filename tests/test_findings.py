"""Typed findings (interface.md §2, manifest version 2): later stages read the finding
columns, never the prose of `reason`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvmigrate import manifest
from kvmigrate.migrate.plan import build_plan
from kvmigrate.report.summary import summarize

from helpers.cli_helpers import run

FLAGS = {"kv_kind": "mla", "model_dtype": "bfloat16"}
# one root whose rows carry every finding a stage reads: replicas (llm-d MLA TP=2), a slice
# proven from the data (vLLM MLA TP=2 direct rows, --verify hash), part of a transform and
# facts asked (llm-d B=4 relayout without --page-bytes), a taken target path (below)
TREES = ({"family": "llmd", "tp": 2, "kv_kind": "mla"},
         {"family": "vllm", "scheme": "S3", "tp": 2, "kv_kind": "mla", "model_name": "deepseek/V2"},
         {"family": "llmd", "tp": 2, "kv_kind": "mla", "blocks_per_file": 4, "model_name": "org/b4"})


def _mixed_manifest(synth_root, scan_root) -> Path:
    root, _ = synth_root(*TREES)
    scan, rows = scan_root(root, flags=FLAGS, verify="hash")
    # another file already at one block's target path: the block is a conflict for migrate
    taken = next(r["target_relpath"] for r in rows.values() if r["action"] == "copy_pad")
    (root / taken).parent.mkdir(parents=True, exist_ok=True)
    (root / taken).write_bytes(b"other bytes")
    scan, _ = scan_root(root, flags=FLAGS, verify="hash")
    return Path(scan.output)


def _with_reasons(src: Path, dst: Path, text: str) -> Path:
    """The manifest `src` with every reason replaced by `text` (metadata kept)."""
    t = pq.read_table(src)
    i = t.schema.get_field_index("reason")
    t = t.set_column(i, t.schema.field(i), pa.array([text] * t.num_rows, pa.string()).dictionary_encode())
    pq.write_table(t, dst)
    return dst


def _decisions(path: Path) -> dict:
    """What the summary, hints and plan decide (their sentences, which quote reasons, left out)."""
    s = summarize(path)
    per_ns = {n["source_base"]: {k: n[k] for k in ("blocks", "by_status", "by_action", "reusable", "pending",
                                                   "not_reusable", "replicas", "aliases_source_blocks",
                                                   "flags_asked", "transform_cost")}
              for n in s["namespaces"]}
    plan = build_plan(path)
    targets = {tp.base_name: {"counts": tp.counts(), "conflicts": sum(tp.conflicts.values()),
                              "skipped": sum(tp.skipped.values()), "not_reusable": sum(tp.not_reusable.values())}
               for tp in plan.targets}
    return {"totals": s["totals"], "namespaces": per_ns, "exit_code": s["exit_code"],
            "findings": sorted((f["code"], f["namespace"] or "", f.get("blocks") or 0) for f in s["findings"]),
            "hints": sorted(h["command"].replace(str(path), "MANIFEST") for h in s["hints"]), "plan": targets,
            "plan_exit": plan.exit_code() if callable(getattr(plan, "exit_code", None)) else None}


def test_rewording_every_reason_changes_no_decision(synth_root, scan_root, tmp_path):
    m = _mixed_manifest(synth_root, scan_root)
    actions = {r["action"] for r in manifest.read_table(m).to_pylist()}
    assert {"copy_pad", "slice", "needs_relayout"} <= actions, actions  # the findings above are all there
    before = _decisions(m)
    assert any(n["replicas"]["files"] for n in before["namespaces"].values())
    assert any(n["flags_asked"] for n in before["namespaces"].values())
    assert any(n["aliases_source_blocks"] for n in before["namespaces"].values())
    assert any(t["conflicts"] for t in before["plan"].values())
    assert before["totals"]["transform_cost"]["slice"]["output_bytes"] > 0
    assert _decisions(_with_reasons(m, tmp_path / "x.parquet", "x")) == before


# A reason read back: a regex or a prefix/substring test whose subject is a reason value.
_PROSE_READS = [
    re.compile(r"reason\w*(?:\[[^\]]*\])?(?:\s*or\s*\"\")?\)?\.(?:startswith|endswith|partition|rpartition|split|"
               r"find|index|count)\("),
    re.compile(r"[\"']\s+(?:not\s+)?in\s+\(?[\w.]*reason"),  # "aliases_source" in reason
    re.compile(r"(?:_RE\b|_PATTERN\b|\bre\.\w+\().*\breason"),
    re.compile(r"(?:match_substring\w*|starts_with|ends_with|count_substring\w*|extract_regex)\([^)]*reason"),
]


def test_no_stage_reads_the_reason_prose():
    pkg = Path(__file__).resolve().parent.parent / "kvmigrate"
    hits = []
    for path in sorted(pkg.rglob("*.py")):
        if "_vendor" in path.parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if any(p.search(code) for p in _PROSE_READS):
                hits.append(f"{path.relative_to(pkg.parent)}:{n}: {line.strip()}")
    assert not hits, "reason prose read back (use the finding columns, kvmigrate/findings.py):\n" + "\n".join(hits)


def _version_1(src: Path, dst: Path) -> Path:
    """`src` as kvmigrate wrote manifests before the finding columns (format version 1)."""
    t = pq.read_table(src)
    meta = json.loads(t.schema.metadata[manifest.META_KEY])
    meta.pop("manifest_version", None)
    t = t.drop_columns([c for c in ("finding", "primary_rank", "of_action", "cell_bytes", "row_cells", "output_bytes",
                                    "asks", "aliases_relpath") if c in t.column_names])
    pq.write_table(t.replace_schema_metadata({manifest.META_KEY: json.dumps(meta).encode()}), dst)
    return dst


def test_a_manifest_without_the_finding_columns_is_refused_with_rescan(synth_root, scan_root, tmp_path):
    root, _ = synth_root(TREES[0])
    scan, _ = scan_root(root, flags=FLAGS)
    old = _version_1(Path(scan.output), tmp_path / "old.parquet")
    for args in (("report", old), ("migrate", root, "--manifest", old)):
        code, out = run(*args)
        assert code == 2, (args, out)
        assert "manifest format version 1" in out and "rescan with `kvmigrate scan" in out, out
        assert str(old) in out
