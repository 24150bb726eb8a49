"""A live engine during scan and migrate (migration.md §3.8), CI-sized: tests/helpers/engine_sim.py
behaves like each engine; scan and migrate on the same root find nothing false and lose or
clobber nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from kvmigrate import layout
from kvmigrate.formats import vllmcpp

from helpers import engine_sim
from helpers import reliability_harness as R  # tests/helpers/reliability_harness.py: the campaign's benches and oracles

pytestmark = pytest.mark.slow  # reliability-sized: `pytest -m 'not slow'` leaves it out, CI runs it

SPECS = [{**R.GEOMETRY, **s, "blocks": 6} for s in (R.VLLM_LINK, R.LLMD_COPY_PAD, R.CPP_REWRITE)]


def test_the_simulator_behaves_like_each_engine(tmp_path):
    root = tmp_path / "root"
    R.build_root(root, [R.VLLM_LINK, R.LLMD_COPY_PAD, R.CPP_REWRITE], 6)
    initial = sum(1 for p in root.rglob("*.bin"))
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, engine_sim.__file__, str(root), "--log", str(log), "--seed", "3", "--max-ops", "400",
           "--duration", "60", "--evict-above", str(initial + 10)]
    for spec in SPECS:
        cmd += ["--spec", json.dumps(spec)]
    subprocess.run(cmd, check=True, timeout=120)
    records = engine_sim.read_log(str(log))
    ops = Counter(r["op"] for r in records)
    assert ops["write"] > 50 and ops["delete"] > 0 and ops["abandon_tmp"] > 0
    deleted = {r["path"] for r in records if r["op"] == "delete"}
    specs = {r["base"]: SPECS[i] for i, s in enumerate(SPECS)
             for r in records if r["op"] == "write" and r.get("deployment") == i}
    for r in records:
        if r["op"] == "write" and r["path"] not in deleted:  # the bytes it logged are on disk
            data = (root / r["path"]).read_bytes()
            assert data == engine_sim.block_bytes(specs[r["base"]], r["base"], r["hex"], r["group"], r["rank"],
                                                  short=not r["ok"])
        if r["op"] == "delete" and r["why"] == "short read":  # only residue reads short
            assert not next(w for w in records if w["op"] == "write" and w["path"] == r["path"])["ok"]
        if r["op"] == "abandon_tmp":  # each engine's own temp name
            name = r["path"].rsplit("/", 1)[1]
            cpp = "org_cpp-model" in r["path"]
            assert (layout.TMP_CPP_BLOCK_RE if cpp else layout.TMP_VLLM_BLOCK_RE).match(name), name


def test_scan_and_migrate_while_three_engines_write_read_and_evict(tmp_path):
    ledger = R.Ledger()
    record = R.engine_round(tmp_path, ledger, seed=11, verify="hash")
    assert ledger.violations == [], "\n".join(ledger.violations)
    assert record["ok"]
    assert record["engine_ops"]["write"] > 0 and record["created"] > 0
    # the engines were live during the commands: the scan saw their temp files or residue
    assert set(record["scan_status"]) - {"ok"}


def test_the_output_check_catches_altered_bytes():
    src = bytes(range(256)) * 3
    assert R._output_mismatch("link", src, src, {}, "ab" * 32, 0) is None
    assert R._output_mismatch("link", src, src[:-1] + b"\0", {}, "ab" * 32, 0)
    padded = src + bytes(4096 - len(src))
    assert R._output_mismatch("copy_pad", src, padded, {}, "ab" * 32, 0) is None
    assert R._output_mismatch("copy_pad", src, padded[:-1] + b"\1", {}, "ab" * 32, 0)
    digest = bytes(range(32))
    key = vllmcpp.make_key(bytes.fromhex("ab" * 32), 0)
    payload = b"\7" * 512
    old = vllmcpp.encode_header(b"\0" * 32, key, len(payload)) + payload
    new = vllmcpp.encode_header(digest, key, len(payload)) + payload
    target = {"digest": digest.hex(), "payload_size": len(payload)}
    assert R._output_mismatch("rewrite_header", old, new, target, "ab" * 32, 0) is None
    assert R._output_mismatch("rewrite_header", old, old, target, "ab" * 32, 0)  # header not rewritten
    assert R._output_mismatch("rewrite_header", old, new[:-1] + b"\0", target, "ab" * 32, 0)


def test_the_campaign_script_writes_its_report(tmp_path):
    """`scripts/reliability.py` end to end on its shortest part: the report names the
    figures the issue asks for, and the script exits 0 when nothing was violated."""
    out = tmp_path / "RELIABILITY.md"
    script = Path(__file__).resolve().parents[2] / "scripts" / "reliability.py"
    p = subprocess.run([sys.executable, str(script), "--quick", "--only", "engine", "--out", str(out),
                        "--workdir", str(tmp_path / "work")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    text = out.read_text()
    for figure in ("tracebacks** | **0", "files lost** | **0", "files clobbered or partial** | **0",
                   "Live engines", "Defects found and fixed", "Seed"):
        assert figure in text, figure
    raw = json.loads(out.with_suffix(".json").read_text())
    assert raw["figures"]["violations (all kinds)"] == 0 and raw["results"]["engine"][0]["ok"]
