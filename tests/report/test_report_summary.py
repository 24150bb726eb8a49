"""The summary model: counts per namespace, status and action from a hand-built manifest.

`write_sample_manifest` builds a realistic manifest (the rows a scan of a mixed root
would write) with `ManifestWriter`; the other report tests import it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvmigrate import findings
from kvmigrate.manifest import ManifestWriter
from kvmigrate.report.summary import summarize

ROOT = "/srv/kvcache"

VLLM = "meta-llama_Llama-3.1-8B-Instruct_3f1b68c1da90"
VLLM_T = "meta-llama_Llama-3.1-8B-Instruct_42b94bdc9933"
LLMD = "Qwen_Qwen3-8B_0123456789ab"
LLMD_T = "Qwen_Qwen3-8B_ba9876543210"
MLA = "deepseek-ai_DeepSeek-V2-Lite_aaaaaaaaaaaa"
MLA_T = "deepseek-ai_DeepSeek-V2-Lite_8d7a92f846c0"
CPP = "tiny-cpp_cccccccccccc"
CPP_T = "tiny-cpp_dddddddddddd"
AUTO = "mistral_auto-model_eeeeeeeeeeee"
ORPHAN = "lost_ffffffffffff"

MiB = 1 << 20


def _hex(i: int, salt: int) -> str:
    return f"{(i * 2654435761 + salt * 97) % (1 << 64):016x}{salt:04x}{i:012x}"


REPLICA = findings.Finding(findings.REPLICA_OF_PRIMARY, primary_rank=0)
PART_OF_CONCAT = findings.Finding(findings.PART_OF_ACTION, primary_rank=0, of_action="concat")


class Rows:
    """Column lists for ManifestWriter.write_columns, one append per file."""

    def __init__(self):
        self.cols: dict[str, list] = {k: [] for k in (
            "relpath", "family", "scheme", "model_name", "source_d12", "source_base", "deployment",
            "target_profile", "target_d12", "target_base", "rank", "group", "block_hash", "size", "mtime_ns",
            "inode", "dev", "nlink", "status", "action", "reason", "target_relpath", *findings.COLUMNS)}
        self.inode = 1000

    def add(self, base, relpath, *, family="vllm", scheme="S1", model="m", target=None, rank=None, hex_=None,
            size=4096, nlink=1, status="ok", action="none", reason="", group=0, inode=None, finding=None):
        """`finding`: the row's findings.Finding (what later stages read; `reason` is prose)."""
        self.inode += 1
        c = self.cols
        c["relpath"].append(relpath)
        c["family"].append(family)
        c["scheme"].append(scheme)
        c["model_name"].append(model)
        c["source_d12"].append(base[-12:] if base else None)
        c["source_base"].append(base)
        c["deployment"].append(base)
        c["target_profile"].append("vllm-0.28" if target else None)
        c["target_d12"].append(target[-12:] if target else None)
        c["target_base"].append(target)
        c["rank"].append(rank)
        c["group"].append(group if hex_ else None)
        c["block_hash"].append(bytes.fromhex(hex_) if hex_ else None)
        c["size"].append(size)
        c["mtime_ns"].append(1_700_000_000_000_000_000)
        c["inode"].append(inode or self.inode)
        c["dev"].append(64769)
        c["nlink"].append(nlink)
        c["status"].append(status)
        c["action"].append(action)
        c["reason"].append(reason)
        tr = None
        if target and hex_ and action not in ("none",) and not action.startswith("needs_"):
            tr = f"{target}_r0/{hex_[:3]}/{hex_[3:5]}_g{group}/{hex_}.bin"
        c["target_relpath"].append(tr)
        for k, v in zip(findings.COLUMNS, finding or (None,) * len(findings.COLUMNS)):
            c[k].append(v)

    def block(self, base, rank, hex_, **kw):
        self.add(base, f"{base}_r{rank}/{hex_[:3]}/{hex_[3:5]}_g{kw.get('group', 0)}/{hex_}.bin",
                 rank=rank, hex_=hex_, **kw)


def _target(base, d12, *, agnostic=True, replicated=False, reasons=()):
    return {"profile": "vllm-0.28", "family": "vllm", "fields": {"dtype": "bfloat16"}, "d12": d12,
            "base_name": base, "rank_dir": f"{base}_r0", "parallel_agnostic": agnostic,
            "replicated_layout": replicated, "reasons": list(reasons)}


def sample_metadata() -> dict:
    ns = {
        VLLM: {"family": "ambiguous", "family_evidence": ["S1 keys", "only _r0", "sizes multiples of 4096"],
               "scheme": "S1", "model_name": "meta-llama/Llama-3.1-8B-Instruct", "source_d12": VLLM[-12:],
               "digest_ok": True, "config_json": {"dtype": "bfloat16", "tp_size": 1}, "config_error": None,
               "unknown_keys": [], "ranks": [0], "deployment": VLLM, "facts": {"kv_kind": "full"},
               "facts_source": {"kv_kind": "--kv-kind"}, "assumed_facts": {"runner": "v1", "executor": "mp"},
               "target": _target(VLLM_T, VLLM_T[-12:]), "target_error": None, "status": "ok"},
        LLMD: {"family": "llmd", "family_evidence": ["rank folders _r0.._r1"], "scheme": "S1",
               "model_name": "Qwen/Qwen3-8B", "source_d12": LLMD[-12:], "digest_ok": True,
               "config_json": {"dtype": "bfloat16", "tp_size": 2}, "config_error": None, "unknown_keys": [],
               "ranks": [0, 1], "deployment": LLMD, "facts": {"kv_kind": "full", "total_kv_heads": 8},
               "facts_source": {}, "assumed_facts": {"runner": "v1"},
               "target": _target(LLMD_T, LLMD_T[-12:]), "target_error": None, "status": "ok"},
        MLA: {"family": "llmd", "family_evidence": ["rank folders _r0.._r1"], "scheme": "S1",
              "model_name": "deepseek-ai/DeepSeek-V2-Lite", "source_d12": MLA[-12:], "digest_ok": True,
              "config_json": {"dtype": "bfloat16", "tp_size": 2}, "config_error": None, "unknown_keys": [],
              "ranks": [0, 1], "deployment": MLA, "facts": {"kv_kind": "mla"}, "facts_source": {},
              "assumed_facts": {},
              "target": _target(MLA_T, MLA_T[-12:], agnostic=True, replicated=True,
                                reasons=["not agnostic: kv kind is mla (MLA exclusion)"]),
              "target_error": None, "status": "ok"},
        CPP: {"family": "vllmcpp", "family_evidence": ["format_version", "hash_algo"], "scheme": "vllmcpp-v1",
              "model_name": "tiny-cpp", "source_d12": CPP[-12:], "digest_ok": True, "config_json": {},
              "config_error": None, "unknown_keys": [], "ranks": [0], "deployment": CPP, "facts": {},
              "facts_source": {}, "assumed_facts": {},
              "target": dict(_target(CPP_T, CPP_T[-12:], agnostic=False), profile="vllmcpp", family="vllmcpp"),
              "target_error": None, "status": "ok"},
        AUTO: {"family": "vllm", "family_evidence": ["tokens_per_hash"], "scheme": "S2",
               "model_name": "mistral/auto-model", "source_d12": AUTO[-12:], "digest_ok": True,
               "config_json": {"dtype": "auto", "tp_size": 1}, "config_error": None, "unknown_keys": [],
               "ranks": [0], "deployment": AUTO, "facts": {}, "facts_source": {}, "assumed_facts": {},
               "target": None,
               "target_error": "missing deployment fact 'model_dtype': dtype \"auto\" must be resolved for "
                               "vllm-0.28\n  hint: pass --model-dtype (or 'model_dtype' for this namespace in "
                               "--facts FACTS.json)",
               "target_error_flag": "--model-dtype",  # as the scan records it (identity's MissingFactError)
               "status": "ok"},
        ORPHAN: {"family": "vllm", "family_evidence": [], "scheme": None, "model_name": None,
                 "source_d12": ORPHAN[-12:], "digest_ok": None, "config_json": None,
                 "config_error": "no config.json", "unknown_keys": [], "ranks": [0], "deployment": ORPHAN,
                 "facts": {}, "facts_source": {}, "assumed_facts": {}, "target": None, "target_error": None,
                 "status": "orphan_namespace"},
    }
    return {"tool_version": "0.1.0", "command": f"kvmigrate scan {ROOT}", "root": ROOT,
            "target_profile": "vllm-0.34", "verify": "size", "shard": "0/1",
            "facts": {"flags": {"kv_kind": "full"}, "facts_file": None}, "namespaces": ns}


# The expected numbers of the sample, written out by hand (not recomputed by the code under test).
EXPECTED = {
    VLLM: {"files": 1 + 40 + 2 + 1, "blocks": 42, "link": 40, "short": 2, "tmp": 1,
           "bytes": 300 + 40 * 2 * MiB + 2 * 0 + 4096},
    LLMD: {"blocks": 30 + 3 + 1, "concat": 30, "incomplete_files": 4},
    MLA: {"blocks": 20 + 2 + 5, "link": 20, "replica_mismatch_files": 4, "already_present": 5},
    CPP: {"blocks": 10, "rewrite_header": 9, "header_invalid": 1},
    AUTO: {"blocks": 6},
}


def write_sample_manifest(path: Path, *, metadata: dict | None = None, scale: int = 1, skip: tuple = (),
                          extra=None) -> Path:
    """A manifest like a scan of a mixed root with defects would write (see EXPECTED).

    `skip` drops namespaces (rows and metadata); `extra(rows, metadata)` adds some."""
    r = Rows()
    # vllm (ambiguous S1, single rank): config, 40 linkable blocks, 2 short, 1 engine temp file
    r.add(VLLM, f"{VLLM}/config.json", size=300, family="ambiguous", target=VLLM_T)
    for i in range(40 * scale):
        r.block(VLLM, 0, _hex(i, 1), size=2 * MiB, family="ambiguous", target=VLLM_T, action="link",
                reason="re-key S1 -> S3 of the same deployment")
    for i in range(2):
        r.block(VLLM, 0, _hex(i, 2), size=0, family="ambiguous", target=VLLM_T, status="short",
                reason="empty file")
    r.add(VLLM, f"{VLLM}_r0/abc/de_g0/{_hex(0, 3)}.bin_12345.tmp", family="ambiguous", status="tmp_leftover",
          reason="vLLM temp file of an interrupted write", target=VLLM_T)
    # llm-d full attention TP=2: 30 concat blocks (rank 0 leads), 3 blocks with rank 1 missing
    r.add(LLMD, f"{LLMD}/config.json", size=500, family="llmd", target=LLMD_T)
    for i in range(30):
        h = _hex(i, 4)
        r.block(LLMD, 0, h, size=MiB, family="llmd", target=LLMD_T, action="concat",
                reason="concat 2 rank shards")
        r.block(LLMD, 1, h, size=MiB, family="llmd", target=LLMD_T, action="none",
                reason="part of concat from rank 0", finding=PART_OF_CONCAT)
    for i in range(3):
        r.block(LLMD, 0, _hex(i, 5), size=MiB, family="llmd", target=LLMD_T, status="incomplete",
                reason="rank 1 file missing")
    # llm-d MLA TP=2: 20 linked from rank 0 (rank 1 replica), 2 mismatching replicas,
    # 5 already present (hard links: nlink 2)
    r.block(LLMD, 1, _hex(9, 5), size=MiB, family="llmd", target=LLMD_T, status="incomplete",
            reason="block incomplete: rank 0 file missing")
    r.add(MLA, f"{MLA}/config.json", size=400, family="llmd", target=MLA_T)
    for i in range(20):
        h = _hex(i, 6)
        r.block(MLA, 0, h, size=512 * 1024, family="llmd", target=MLA_T, action="link",
                reason="verified rank-0 replica")
        r.block(MLA, 1, h, size=512 * 1024, family="llmd", target=MLA_T, reason="replica of rank 0", finding=REPLICA)
    for i in range(2):
        h = _hex(i, 7)
        for rank in (0, 1):
            r.block(MLA, rank, h, size=512 * 1024, family="llmd", target=MLA_T, status="replica_mismatch",
                    reason="replicas differ")
    for i in range(5):
        h = _hex(i, 8)
        r.block(MLA, 0, h, size=512 * 1024, nlink=2, family="llmd", target=MLA_T, action="already_present",
                reason="target has the same inode")
        r.block(MLA, 1, h, size=512 * 1024, family="llmd", target=MLA_T, reason="replica of rank 0", finding=REPLICA)
    # vllm.cpp: 9 header rewrites, 1 invalid header
    r.add(CPP, f"{CPP}/config.json", size=900, family="vllmcpp", scheme="vllmcpp-v1", target=CPP_T)
    for i in range(9):
        r.block(CPP, 0, _hex(i, 9) + _hex(i, 9), size=128 + 65536, family="vllmcpp", scheme="vllmcpp-v1",
                target=CPP_T, action="rewrite_header", reason="identity digest changes")
    r.block(CPP, 0, _hex(0, 10) + _hex(0, 10), size=128 + 65536, family="vllmcpp", scheme="vllmcpp-v1",
            target=CPP_T, status="header_invalid", reason="header check failed: magic")
    # vllm S2 with dtype auto and no --model-dtype: target refused, blocks stay none
    r.add(AUTO, f"{AUTO}/config.json", size=350, scheme="S2")
    for i in range(6):
        r.block(AUTO, 0, _hex(i, 11), size=MiB, scheme="S2", reason="no target: missing fact model_dtype")
    # an orphan rank folder and a file outside every namespace
    r.block(ORPHAN, 0, _hex(0, 12), size=8192, status="orphan_namespace", reason="rank folder without config.json")
    r.add(None, "notes.txt", size=17, family=None, scheme=None, model=None, status="foreign",
          reason="not part of the cache")
    metadata = metadata or sample_metadata()
    if extra is not None:
        extra(r, metadata)
    if skip:
        keep = [i for i, b in enumerate(r.cols["source_base"]) if b not in skip]
        r.cols = {k: [v[i] for i in keep] for k, v in r.cols.items()}
        metadata["namespaces"] = {b: m for b, m in metadata["namespaces"].items() if b not in skip}
    with ManifestWriter(path, metadata) as w:
        w.write_columns(r.cols)
    return path


@pytest.fixture
def sample(tmp_path) -> Path:
    return write_sample_manifest(tmp_path / "m.parquet")


def _ns(summary, base):
    return next(n for n in summary["namespaces"] if n["source_base"] == base)


def test_interface_keys_present(sample):
    s = summarize(sample)
    for key in ("root", "target_profile", "totals", "namespaces", "exit_code", "findings", "hints"):
        assert key in s
    for key in ("files", "bytes", "by_status", "by_action"):
        assert key in s["totals"]
    for n in s["namespaces"]:
        for key in ("source_base", "family", "scheme", "model_name", "ranks", "target_base", "gate",
                    "assumed_facts", "by_status", "by_action"):
            assert key in n, key
        assert set(n["gate"]) == {"parallel_agnostic", "replicated_layout", "reasons", "by_name"}
    json.dumps(s)  # JSON-able


def test_single_rank_namespace_counts(sample):
    n = _ns(summarize(sample), VLLM)
    e = EXPECTED[VLLM]
    assert n["files"] == e["files"]
    assert n["bytes"] == e["bytes"]
    assert n["blocks"] == e["blocks"]  # the temp file is not a block
    assert n["by_action"]["link"] == {"blocks": 40, "bytes": 40 * 2 * MiB}
    assert n["by_action"]["none"] == {"blocks": 2, "bytes": 0}
    assert n["by_status"]["short"] == {"files": 2, "bytes": 0}
    assert n["by_status"]["tmp_leftover"] == {"files": 1, "bytes": 4096}
    assert n["target_base"] == VLLM_T
    assert n["hash_bytes"] == [16]


def test_multi_rank_blocks_are_counted_once(sample):
    n = _ns(summarize(sample), LLMD)
    assert n["blocks"] == EXPECTED[LLMD]["blocks"]
    # concat consumes both rank shards: the bytes of the "part of concat" rows belong to it
    assert n["by_action"]["concat"] == {"blocks": 30, "bytes": 60 * MiB}
    # 3 blocks lack rank 1, one lacks rank 0: each counted once
    assert n["by_action"]["none"] == {"blocks": 4, "bytes": 4 * MiB}
    assert n["by_status"]["incomplete"]["files"] == 4
    assert n["reusable"] == {"blocks": 30, "bytes": 60 * MiB}
    assert n["not_reusable"] == {"blocks": 4, "bytes": 4 * MiB}


def test_unplanned_multi_rank_blocks_count_once(tmp_path):
    """A refused llm-d target: every rank file of every block is `none` with the same reason."""
    r = Rows()
    r.add(LLMD, f"{LLMD}/config.json", size=500, family="llmd")
    for i in range(7):
        for rank in (0, 1, 2, 3):
            r.block(LLMD, rank, _hex(i, 4), size=MiB, family="llmd", reason="no target identity for this namespace")
    for rank in (1, 2):  # a block without its rank-0 and rank-3 files
        r.block(LLMD, rank, _hex(99, 4), size=MiB, family="llmd", status="incomplete",
                reason="block incomplete: rank 0,3 file missing")
    meta = sample_metadata()
    meta["namespaces"] = {LLMD: dict(meta["namespaces"][LLMD], ranks=[0, 1, 2, 3], target=None,
                                     target_error="missing deployment fact 'kv_kind'")}
    with ManifestWriter(tmp_path / "m.parquet", meta) as w:
        w.write_columns(r.cols)
    n = _ns(summarize(tmp_path / "m.parquet"), LLMD)
    assert n["blocks"] == 8
    assert n["by_action"] == {"none": {"blocks": 8, "bytes": 30 * MiB}}


def test_replicas_and_hard_links(sample):
    n = _ns(summarize(sample), MLA)
    assert n["blocks"] == EXPECTED[MLA]["blocks"]
    assert n["by_action"]["link"]["blocks"] == 20
    assert n["by_action"]["already_present"] == {"blocks": 5, "bytes": 5 * 512 * 1024}
    # rank-1 copies of blocks taken from rank 0 are replicas, neither reused nor "not reusable"
    assert n["by_action"]["none"] == {"blocks": 2, "bytes": 4 * 512 * 1024}
    assert n["replicas"] == {"files": 25, "bytes": 25 * 512 * 1024}
    assert n["not_reusable"] == {"blocks": 2, "bytes": 4 * 512 * 1024}
    assert n["by_status"]["replica_mismatch"]["files"] == 4
    assert n["bytes_shared"] == 5 * 512 * 1024
    assert n["bytes_alone"] == n["bytes"] - 5 * 512 * 1024
    assert n["pending"]["blocks"] == 20
    assert n["reusable"]["blocks"] == 25
    assert n["gate"]["replicated_layout"] is True
    assert n["gate"]["reasons"] == ["not agnostic: kv kind is mla (MLA exclusion)"]


def test_totals_are_the_sum_of_namespaces_and_outside(sample):
    s = summarize(sample)
    t = s["totals"]
    assert t["files"] == sum(n["files"] for n in s["namespaces"]) + s["outside_namespaces"]["files"]
    assert t["bytes"] == sum(n["bytes"] for n in s["namespaces"]) + 17
    assert t["by_status"]["foreign"] == {"files": 1, "bytes": 17}
    assert t["by_action"]["link"]["blocks"] == 40 + 20
    assert t["by_action"]["rewrite_header"]["blocks"] == 9
    assert t["blocks"] == sum(n["blocks"] for n in s["namespaces"])
    assert sum(a["blocks"] for a in t["by_action"].values()) == t["blocks"]
    assert sum(a["bytes"] for a in t["by_action"].values()) + t["replicas"]["bytes"] == t["block_bytes"]
    assert t["bytes_alone"] + t["bytes_shared"] == t["bytes"]
    assert t["namespaces"] == 6


def test_exit_code_is_or_of_status_bits(sample):
    # short, replica_mismatch, header_invalid -> 4; all findings -> 1; nothing operational
    assert summarize(sample)["exit_code"] == 5


def test_unreadable_sets_operational_bit(tmp_path):
    r = Rows()
    r.add(VLLM, f"{VLLM}/config.json", size=300)
    r.block(VLLM, 0, _hex(1, 1), status="unreadable", reason="[Errno 13] Permission denied")
    meta = sample_metadata()
    meta["namespaces"] = {VLLM: meta["namespaces"][VLLM]}
    with ManifestWriter(tmp_path / "m.parquet", meta) as w:
        w.write_columns(r.cols)
    s = summarize(tmp_path / "m.parquet")
    assert s["exit_code"] == 9
    f = next(f for f in s["findings"] if f["code"] == "unreadable")
    assert f["severity"] == "operational"
    assert f["example_reason"] == "[Errno 13] Permission denied"


def test_clean_manifest_exits_zero(tmp_path):
    r = Rows()
    r.add(VLLM, f"{VLLM}/config.json", size=300, target=VLLM_T)
    for i in range(3):
        r.block(VLLM, 0, _hex(i, 1), target=VLLM_T, action="already_present", nlink=2)
    meta = sample_metadata()
    meta["namespaces"] = {VLLM: dict(meta["namespaces"][VLLM], family="vllm", assumed_facts={})}
    with ManifestWriter(tmp_path / "m.parquet", meta) as w:
        w.write_columns(r.cols)
    s = summarize(tmp_path / "m.parquet")
    assert s["exit_code"] == 0
    # the one thing left to do: reclaim the legacy names (issue 19), a dry run first
    assert [(h["command"], h["codes"]) for h in s["hints"]] == [(f"kvmigrate prune {ROOT} --kv-kind full",
                                                                  ["reclaimable"])]
    assert [f for f in s["findings"] if f["severity"] != "note"] == []


def test_target_error_sets_findings_bit(tmp_path):
    r = Rows()
    r.add(AUTO, f"{AUTO}/config.json", size=350, scheme="S2")
    r.block(AUTO, 0, _hex(1, 1), scheme="S2", reason="no target")
    meta = sample_metadata()
    meta["namespaces"] = {AUTO: meta["namespaces"][AUTO]}
    with ManifestWriter(tmp_path / "m.parquet", meta) as w:
        w.write_columns(r.cols)
    s = summarize(tmp_path / "m.parquet")
    assert s["exit_code"] == 1
    assert _ns(s, AUTO)["target_base"] is None
    assert _ns(s, AUTO)["gate"] == {"parallel_agnostic": None, "replicated_layout": None, "reasons": [],
                                    "by_name": False}


def test_namespace_status_from_metadata(sample):
    s = summarize(sample)
    n = _ns(s, ORPHAN)
    assert n["status"] == "orphan_namespace"
    assert n["by_status"] == {"orphan_namespace": {"files": 1, "bytes": 8192}}


def test_dtype_auto_rekey_is_reported_as_a_claim(tmp_path):
    meta = sample_metadata()
    auto = meta["namespaces"][AUTO]
    auto.update(target=_target(VLLM_T, VLLM_T[-12:]), target_error=None,
                facts_source={"model_dtype": "--model-dtype"}, facts={"model_dtype": "bfloat16"})
    s = summarize(write_sample_manifest(tmp_path / "m.parquet", metadata=meta))
    claims = _ns(s, AUTO)["claims"]
    assert any('dtype "auto"' in c and "bfloat16" in c and "--model-dtype" in c for c in claims)
    assert any("V1 and V2 runner" in c for c in claims)  # S2, TP=1, re-keyed
    assert _ns(s, VLLM)["claims"] == []  # resolved dtype, S1: nothing claimed


def test_dataset_directory_of_parts(tmp_path):
    one = summarize(write_sample_manifest(tmp_path / "single.parquet"))
    d = tmp_path / "parts"
    d.mkdir()
    # the same rows split over two parts: namespaces split across files merge
    import pyarrow.parquet as pq
    table = pq.read_table(tmp_path / "single.parquet")
    half = table.num_rows // 2
    md = table.schema.metadata
    pq.write_table(table.slice(0, half).replace_schema_metadata(md), d / "part-0.parquet")
    pq.write_table(table.slice(half).replace_schema_metadata(md), d / "part-1.parquet")
    two = summarize(d)
    assert two["totals"] == one["totals"]
    assert [n["blocks"] for n in two["namespaces"]] == [n["blocks"] for n in one["namespaces"]]


def test_small_batches_give_the_same_summary(sample, monkeypatch):
    """Aggregation across batch boundaries (incl. a multi-rank block split over two batches)."""
    import kvmigrate.report.summary as sm

    whole = summarize(sample)
    monkeypatch.setattr(sm, "BATCH_ROWS", 7)
    monkeypatch.setattr(sm, "_KEY_COMPACT_ROWS", 3)
    seen = []
    real_add = sm._Totals.add
    monkeypatch.setattr(sm._Totals, "add", lambda self, b: (seen.append(b.num_rows), real_add(self, b)))
    assert summarize(sample) == whole
    assert max(seen) == 7 and len(seen) > 20


def test_a_flat_deployment_reports_its_target_names_not_no_target(tmp_path, synth_root):
    """An SGLang e2 deployment migrates into the e4 names of its model: the report's target
    column names that deployment and the gate column says 'by name' (was 'no target' and
    '-' beside 6 reusable pages)."""
    from helpers.cli_helpers import run, run_json
    root, _ = synth_root({"family": "sglang", "blocks": 3, "layers": 2, "tp": 2, "sgl_era": "e2"})
    m = tmp_path / "m.parquet"
    code, out = run("scan", root, "-o", m, "--kv-kind", "full", "--model-name", "org/m",
                    "--target-layout", "layer_first")
    assert code in (0, 1), out
    code, s = run_json("report", m)
    (n,) = [n for n in s["namespaces"] if n["family"] == "sglang"]
    assert n["target_base"] == "sglang:org-m:tp2" and n["gate"]["by_name"] is True, (n["target_base"], n["gate"])
    code, text = run("report", m)
    row = next(line for line in text.splitlines() if line.startswith(n["source_base"]) and "by name" in line)
    assert row.rstrip().endswith("sglang:org-m:tp2"), row


LLMD_FULL = ["--kv-kind", "full", "--model-dtype", "bfloat16", "--total-kv-heads", "8"]


@pytest.mark.parametrize("batch_rows", [None, 7])
def test_pending_bytes_are_those_of_the_blocks_still_pending(synth_root, tmp_path, monkeypatch, batch_rows):
    # after a concat migration, pending bytes counted every other-rank file of the placed
    # blocks (their rows still say "part of concat"): 19.5 MiB pending where 2 KiB were left
    from prometheus_client.parser import text_string_to_metric_families

    from kvmigrate.report import summary as summary_module

    from helpers.cli_helpers import run, run_json

    if batch_rows:  # a block's rank files read in different batches
        monkeypatch.setattr(summary_module, "BATCH_ROWS", batch_rows)
    root, (res,) = synth_root({"family": "llmd", "tp": 2, "defects": ("missing_rank",)})
    code, out = run("migrate", root, *LLMD_FULL, "--apply")
    assert code == 0 and "created 5" in out, out
    m = tmp_path / "m.parquet"
    assert run("scan", root, "-o", m, "-q", *LLMD_FULL)[0] & 10 == 0
    s = summarize(m) if batch_rows else run_json("report", m)[1]
    source = next(n for n in s["namespaces"] if n["source_base"] == res.namespaces[0]["base_name"])
    assert source["pending"] == {"blocks": 0, "bytes": 0} and s["totals"]["pending"] == {"blocks": 0, "bytes": 0}
    incomplete = source["by_status"]["incomplete"]["bytes"]
    assert source["not_reusable"] == {"blocks": 1, "bytes": incomplete}
    assert source["by_action"]["already_present"]["bytes"] == source["block_bytes"] - incomplete
    prom = tmp_path / "kvmigrate.prom"
    run("audit", root, "-q", *LLMD_FULL, "--prometheus", prom)
    gauges = [s for f in text_string_to_metric_families(prom.read_text()) for s in f.samples
              if s.name == "kvmigrate_pending_bytes"]
    assert gauges and all(g.value == 0 for g in gauges)
    # one target block evicted: it alone is pending, with the bytes of both its rank files
    target = next(n for n in s["namespaces"] if n["source_base"] == source["target_base"])
    victim = next(p for p in sorted((root / target["target_rank_dir"]).rglob("*.bin")))
    os.unlink(victim)
    rank_files = sorted(p for p in root.rglob(victim.name) if p.parent.parent.parent.name.startswith(
        res.namespaces[0]["base_name"]))
    assert len(rank_files) == 2
    m2 = tmp_path / "m2.parquet"
    assert run("scan", root, "-o", m2, "-q", *LLMD_FULL)[0] & 10 == 0
    s2 = summarize(m2)
    source = next(n for n in s2["namespaces"] if n["source_base"] == res.namespaces[0]["base_name"])
    assert source["pending"] == {"blocks": 1, "bytes": sum(p.stat().st_size for p in rank_files)}
