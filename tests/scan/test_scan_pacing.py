"""The scan stays out of the engine's way and says how far it is (issue 18 items 4, 5):
--bwlimit throttles its reads, every hashed file's pages are let go (fadvise DONTNEED),
--max-duration stops it at a batch boundary with exit 32, and its bar has a total."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from kvmigrate import manifest, pacing
from kvmigrate.identity.facts import FactsResolver
from kvmigrate.options import ScanOptions
from kvmigrate.pipeline import scan

from helpers import FakeClock  # tests/helpers/__init__.py: a clock the pacing tests move by hand
from helpers.cli_helpers import run

KVMIGRATE = str(Path(sys.executable).with_name("kvmigrate"))
FACTS = ["--model-dtype", "bfloat16", "--kv-kind", "full", "--total-kv-heads", "8", "--writer-tp", "1", "--writer-pp", "1"]
TREE = {"family": "vllm", "scheme": "S1", "tp": 1, "blocks": 300}  # ~300 bucket visits


def _block_bytes(rows: dict) -> int:
    return sum(r["size"] for r in rows.values() if r["block_hash"] is not None and r["content_xxh3_128"] is not None)


def test_bwlimit_throttles_the_hash_scan_reads(synth_root, tmp_path, no_limits):
    root, _ = synth_root(TREE)
    free = scan(root, tmp_path / "free.parquet", ScanOptions(verify="hash", workers=1,
                                                             facts_resolver=FactsResolver({}, None)))
    rate = 4096
    clock = FakeClock()
    pacing.configure(bwlimit=rate)
    pacing._LIMITS.bucket = pacing.TokenBucket(rate, clock=clock, sleep=clock.sleep)
    limited = scan(root, tmp_path / "limited.parquet", ScanOptions(verify="hash", workers=1,
                                                                   facts_resolver=FactsResolver({}, None)))
    rows = {r["relpath"]: r for r in manifest.read_table(limited.output).to_pylist()}
    read = _block_bytes(rows)
    assert read > 20 * rate
    # every byte past the one-second burst was paid for by sleeping at `rate`
    assert clock.slept * rate >= read - rate
    assert clock.slept * rate <= read + rate
    same = {r["relpath"]: r["content_xxh3_128"] for r in manifest.read_table(free.output).to_pylist()}
    assert {k: r["content_xxh3_128"] for k, r in rows.items()} == same  # the same manifest, only slower


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _resident(paths: list[Path]) -> int:
    """Bytes of these files in the page cache (fincore)."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *map(str, paths)],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(x) for x in out.split())


def _assert_left_alone(hot: list[Path], advice: list[str]) -> None:
    """No advice of the scan names one of the engine's hot files, and they are still
    cached. The call log is the proof; the page cache only confirms it, and the kernel may
    drop a few pages of its own accord on a loaded machine (CI saw 8 KiB of 2.6 MiB go),
    so the residency check allows a tenth: a DONTNEED would have dropped them all."""
    calls = [line for line in advice if "fadvise64(" in line]
    named = [m.group(1) for line in calls if (m := re.search(r"fadvise64\(\d+<([^>]+)>", line))]
    assert calls and len(named) == len(calls)  # every call's file is known
    assert set(named).isdisjoint(os.path.realpath(p) for p in hot)
    assert _resident(hot) >= 0.9 * sum(p.stat().st_size for p in hot)


def _hash_scan_with_some_hot(synth_root, tmp_path, spec: dict, hot: int) -> tuple[list[Path], list[Path], list[str]]:
    """A tree whose block files are all evicted but the first `hot` (read, as an engine
    would), then `scan --verify hash` under strace: (blocks, the hot ones, its
    posix_fadvise calls, each with its file's path: strace -y)."""
    root, results = synth_root(spec)
    blocks = [root / r for r in results[0].block_files()]
    os.sync()
    for path in blocks:
        _evict(path)
    for path in blocks[:hot]:
        path.read_bytes()
    assert _resident(blocks[hot:]) == 0 and _resident(blocks[:hot]) == sum(p.stat().st_size for p in blocks[:hot])
    log = tmp_path / "strace.log"
    subprocess.run(["strace", "-f", "-y", "-e", "trace=fadvise64", "-o", str(log), KVMIGRATE, "scan", str(root),
                    "--verify", "hash", "-o", str(tmp_path / "m.parquet"), "-q"], check=False, timeout=120)
    return blocks, blocks[:hot], log.read_text().splitlines()


def test_every_cold_hashed_block_file_is_fadvised_dontneed_and_the_engines_stay_cached(synth_root, tmp_path,
                                                                                        walk):
    """strace counts posix_fadvise(DONTNEED) calls of the scan (C walk and Python walk):
    one per block file that was not in the page cache; the 10 the "engine" just read
    are left alone, and stay cached."""
    blocks, hot, advice = _hash_scan_with_some_hot(synth_root, tmp_path, {**TREE, "blocks": 40}, hot=10)
    calls = [line for line in advice if "POSIX_FADV_DONTNEED" in line]
    assert len(calls) == len(blocks) - len(hot) == 30
    assert _resident(blocks[10:]) == 0  # read, hashed and let go
    _assert_left_alone(hot, advice)


def test_max_duration_stops_the_scan_with_exit_32_and_a_rerun_completes(synth_root, tmp_path, no_limits):
    root, _ = synth_root(TREE)
    out = tmp_path / "m.parquet"
    pacing._LIMITS.clock = FakeClock(step=1.0)  # every look at the deadline is one second later
    code, text = run("scan", root, *FACTS, "-o", out, "--max-duration", "3s")
    assert code == 32, text
    assert not out.exists()  # no manifest that would read as a tree missing files
    assert re.search(r"kvmigrate: stopped: --max-duration elapsed after [\d,]+ of [\d,]+ bucket visits", text)
    assert re.search(r"--shard K/\d+ -o DIR/", text)
    pacing._LIMITS.clock = pacing.time.monotonic
    code, text = run("scan", root, *FACTS, "-o", out, "--max-duration", "1h", "-q")
    assert code in (0, 1) and text == ""
    assert manifest.read_table(out).num_rows > 300


def test_the_scan_bar_has_a_total_a_percentage_and_an_eta(synth_root, tmp_path, capsys):
    root, _ = synth_root(TREE)
    scan(root, tmp_path / "m.parquet", ScanOptions(verify="size", progress=True, facts_resolver=FactsResolver({}, None)))
    err = capsys.readouterr().err
    m = re.search(r"scan: 100%\|[^|]*\| (\d+)/(\d+) \[[\d:]+<[\d:]+", err)  # done/total [elapsed<ETA
    assert m and m.group(1) == m.group(2) and int(m.group(2)) >= 256, err[-500:]


def test_the_c_walk_asks_ahead_for_cold_big_blocks_only(synth_root, tmp_path, monkeypatch):
    """A block read in pieces (> STREAM_CHUNK) gets posix_fadvise(WILLNEED) when it is
    cold, so the disk sees one large request; one already in the page cache (the
    engine's, or a warm tree) is not asked for again: the advice would walk its pages for
    nothing (a warm 4 GiB scan paid for that)."""
    from kvmigrate import _leafwalk

    monkeypatch.delenv("KVMIGRATE_PURE_PYTHON", raising=False)
    blocks, hot, advice = _hash_scan_with_some_hot(
        synth_root, tmp_path, {**TREE, "blocks": 12, "page_bytes": 65536, "layers": 4}, hot=5)
    assert min(p.stat().st_size for p in blocks) > _leafwalk.STREAM_CHUNK
    asked = [line for line in advice if "POSIX_FADV_WILLNEED" in line]
    assert len(asked) == len(blocks) - len(hot) == 7
    _assert_left_alone(hot, advice)
