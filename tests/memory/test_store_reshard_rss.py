"""A Mooncake store's reshard apply keeps its peak RSS from growing with every block's work
held (a memory bound, not a timed assert).

One bucket store (vLLM TP 2, `kvmigrate synth --family mooncake`) of each size is scanned
with target TP 4 stated, then `migrate --manifest M --apply` runs in a child interpreter
(tests/helpers/memory.py `peak_rss`). Both sizes are above the rows the generic planning
reads at once (plan.py CHUNK_ROWS, 8,192: two object rows a block). Arrow allocates from
the system allocator here: with mimalloc, two runs of one store peaked up to 9 MiB apart.

Measured: 121 -> 130 MiB, ~1.9 KB a block, of which the reshard's own Python objects are
~0.1 KB (the rest: the generic planning reading the manifest's row groups of up to 32,768
rows, and the heap around it); 184 -> 274 MiB, ~18.8 KB a block, when every block's rows,
work, outputs and intent were held.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.memory import peak_rss

SMALL_BLOCKS, LARGE_BLOCKS = 5_000, 10_000
PER_BLOCK_BOUND = 2_500  # bytes
# verify, rollback --dry-run and rollback of the run: they read its store records a part of the
# intent at a time and rollback sorts what it settles on disk (~5-13 B a block measured at 16k ->
# 48k blocks; ~2.3 KB when they held the intent's rewrites, pairs and outputs, ~24 KB when they
# held its reshards too, and rollback ~7.3 KB while the journal's frames were inflated whole)
AFTER_BOUND = 500
# a rerun of the apply killed mid-way: it reads the journal's intent a part at a time (~14 KB a
# block when it held the whole intent, each pair's values and every record). (The apply into
# another folder, ~0.4 against ~1.9 KB a block at 16k -> 48k, is not told apart at these sizes.)
RESUME_BOUND = 2_500
NOISE_KIB = 4096
FACTS = {"store": {"total_kv_heads": 8, "head_dim": 4, "dtype_bytes": 2, "layers": 1, "page_tokens": 1,
                   "kv_kind": "full", "target_tp": 4, "engine_stopped": True}}


def _scanned_store(work: Path, blocks: int) -> Path:
    """A bucket store of `blocks` blocks at TP 2 and its manifest, target TP 4."""
    subprocess.run([sys.executable, "-m", "kvmigrate", "synth", str(work / "root"), "--family", "mooncake", "--tp", "2",
                    "--mc-backend", "bucket", "--layers", "1", "--block-tokens", "1", "--blocks", str(blocks),
                    "--seed", "1", "-q"], check=True, capture_output=True)
    facts = work / "FACTS.json"
    facts.write_text(json.dumps(FACTS))
    manifest = work / "m.parquet"
    scan = subprocess.run([sys.executable, "-m", "kvmigrate", "scan", str(work / "root"), "--facts", str(facts), "-o",
                           str(manifest), "-q"], capture_output=True, text=True)
    assert scan.returncode in (0, 1), scan.stdout + scan.stderr
    return manifest


def test_store_reshard_apply_peak_rss_grows_little_per_block(tmp_path, monkeypatch):
    """Planning sorts the blocks' rows on disk, the outputs and pairs are records in
    temporary files and the intent is written in parts (migrate/reshard_spill.py); verify
    and rollback (and its dry run) of the run read the journal's store records a part at
    a time, never the intent's reshards; so does a rerun of the apply killed mid-way (the
    intent's reshards too)."""
    monkeypatch.setenv("ARROW_DEFAULT_MEMORY_POOL", "system")
    peaks = {}
    for blocks in (SMALL_BLOCKS, LARGE_BLOCKS):
        work = tmp_path / str(blocks)
        work.mkdir()
        manifest = _scanned_store(work, blocks)
        peaks[blocks] = peak_rss(["migrate", "--manifest", manifest, "--apply", "-q"], work)
        journal = next((work / "root" / ".kvmigrate" / "journals").glob("*.journal"))
        for name, command in (("verify", ["verify", work / "root", "--journal", journal]),
                              ("rollback --dry-run", ["rollback", journal, "--dry-run"]),
                              ("rollback", ["rollback", journal])):  # (last: it changes the store)
            peaks[(blocks, name)] = peak_rss(command, work)
        killed = subprocess.run([sys.executable, "-m", "kvmigrate", "migrate", "--manifest", str(manifest), "--apply",
                                 "-q"], env={**os.environ, "KVMIGRATE_CRASH_AT": "created:40"}, capture_output=True)
        assert killed.returncode == -9, killed.stderr
        peaks[(blocks, "resume")] = peak_rss(["migrate", "--manifest", manifest, "--apply", "-q"], work)
    for command, bound in (("migrate", PER_BLOCK_BOUND), ("verify", AFTER_BOUND),
                           ("rollback --dry-run", AFTER_BOUND), ("rollback", AFTER_BOUND),
                           ("resume", RESUME_BOUND)):
        small, large = (peaks[blocks if command == "migrate" else (blocks, command)]
                        for blocks in (SMALL_BLOCKS, LARGE_BLOCKS))
        assert small.rc == large.rc == 0, large.out[-2000:]
        grown = LARGE_BLOCKS - SMALL_BLOCKS
        growth = (large.kib - small.kib) * 1024
        assert growth <= bound * grown + NOISE_KIB * 1024, (
            f"store reshard {command}: peak RSS {small.kib} KiB at {SMALL_BLOCKS:,} blocks, {large.kib} KiB at "
            f"{LARGE_BLOCKS:,} blocks: {growth / grown:.0f} bytes a block (bound {bound})")
