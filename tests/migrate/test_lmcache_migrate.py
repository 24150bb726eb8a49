"""Migrating LMCache tiers (spec lmcache.md §3.1, §3.4-§3.6, §5) end to end on synth trees:
`kvmigrate scan` with the target's facts, `migrate --apply`, then the reference reader
(tests/helpers/lmcache_reader.py, written from the spec, not from kvmigrate) looks every
chunk up as the target deployment would and compares what it reads with what that
deployment itself writes (synth of the same seed at the target's TP: its chunk hashes and
per-head bytes are the same at every TP). Then rescan, verify and rollback."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import pytest

from kvmigrate import manifest
from kvmigrate.synth import SynthSpec, build
from kvmigrate.synth import lmcache as S

from helpers.cli_helpers import run
from helpers.lmcache_reader import Deployment, LMCacheReader

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LMC = dict(family="lmcache", layers=2, block_tokens=4, blocks=3, seed=7)
RECIPE = ["--writer-release", "0.5.6", "--pythonhashseed", "0"]
GEOMETRY = ["--total-kv-heads", str(S.TOTAL_KV_HEADS), "--head-dim", str(S.HEAD_DIM), "--layers", "2",
            "--latent-dim", str(S.LATENT_DIM)]


def synth(root: Path, **kw):
    return build(root, SynthSpec(**{**LMC, **kw}))


def chash(blk: dict) -> int | bytes:
    """A block's chunk hash as the reader takes it: an int, or an MP blake3 digest."""
    return bytes.fromhex(blk["hex"]) if len(blk["hex"]) == 64 else int(blk["hex"], 16)


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file outside kvmigrate's own folder."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and ".kvmigrate" not in p.parts}


def scan(root: Path, out: Path, *flags: str) -> dict[str, dict]:
    rc, text = run("scan", root, "-o", out, *RECIPE, *flags)
    assert rc in (0, 1, 4, 5), text
    return {r["relpath"]: r for r in manifest.read_table(out).to_pylist()}


def apply(manifest_path: Path, *extra: str) -> str:
    rc, text = run("migrate", "--manifest", manifest_path, "--apply", *extra)
    assert rc == 0, text
    return text


def reader(tier: Path, backend: str, ws: int, wid: int, *, mla: bool, **kw) -> LMCacheReader:
    hidden = S.LATENT_DIM if mla else max(1, S.TOTAL_KV_HEADS // ws) * S.HEAD_DIM
    return LMCacheReader(tier, backend, Deployment(model=kw.pop("model", MODEL), world_size=ws, worker_id=wid,
                                                   mla=mla, layers=2, hidden=hidden, chunk_size=4, **kw))


def expected_payloads(tmp: Path, backend: str, tp: int, *, mla: bool = False, **kw) -> dict[tuple[int, int], bytes]:
    """(chunk hash, rank) -> the payload the target deployment itself writes (synth at its TP)."""
    res = synth(tmp, lmc_backend=backend, tp=tp, kv_kind="mla" if mla else "full", **kw)
    out = {}
    for blk in res.blocks:
        for wid in blk["files"]:
            r = reader(tmp / "cache", backend, tp if not mla or not kw.get("lmc_save_only_first_rank", True) else 1,
                       wid, mla=mla, save_only_first_rank=kw.get("lmc_save_only_first_rank"),
                       save_chunk_meta=kw.get("lmc_fs_header", True))
            got = r.lookup(chash(blk))
            assert got.found, (got.why, got.detail)
            out[(chash(blk), int(wid))] = got.payload
    return out


@pytest.mark.parametrize("backend, header", [("fs", True), ("fs", False), ("gds", True), ("mp", False)])
@pytest.mark.parametrize("src_tp, dst_tp", [(2, 4), (4, 2), (1, 8), (8, 2)])
def test_reshard_serves_the_bytes_the_target_tp_writes(tmp_path, backend, header, src_tp, dst_tp):
    """§3.4: a GQA chunk's shards re-split along the head axis, one file per target rank with
    its header (fs RemoteMetadata, GDS header and sidecar) rewritten for the new shape; read
    back by the reference reader at the target TP equal to what that TP writes itself."""
    era = "lmc-mp1" if backend == "mp" else "lmc-k3"
    root = tmp_path / "root"
    res = synth(root, lmc_backend=backend, lmc_era=era, tp=src_tp, lmc_fs_header=header)
    before = snapshot(root)
    kind = [] if header and backend != "mp" else ["--kv-kind", "full"]  # (a raw payload states no kind)
    if backend == "mp":
        kind += ["--model-dtype", "bfloat16"]  # (an MP name carries no dtype)
    rows = scan(root, tmp_path / "m.parquet", "--target-tp", str(dst_tp), *kind, *GEOMETRY)
    primaries = [r for r in rows.values() if r["action"] == "reshard"]
    assert len(primaries) == len(res.blocks), {r["action"] for r in rows.values()}
    apply(tmp_path / "m.parquet")
    # sources untouched, every target rank's file present and what the target TP reads
    assert {k: v for k, v in snapshot(root).items() if k in before} == before
    want = expected_payloads(tmp_path / "want", backend, dst_tp, lmc_era=era, lmc_fs_header=header)
    for (h, wid), payload in want.items():
        got = reader(root / "cache", backend, dst_tp, wid, mla=False, save_chunk_meta=header).lookup(h)
        assert got.found and got.payload == payload, (h, wid, got.why, got.detail)
    # a rescan finds the reshard in place; verify passes; rollback leaves exactly the sources
    again = scan(root, tmp_path / "m2.parquet", "--target-tp", str(dst_tp), *kind, *GEOMETRY)
    assert {r["action"] for r in again.values() if r["relpath"] in before and r["rank"] == 0
            and not r["relpath"].endswith(".metadata")} == {"already_present"}
    assert run("verify", root, "--journal", root / ".kvmigrate" / "journals")[0] == 0
    rc, text = run("rollback", root / ".kvmigrate" / "journals")
    assert rc == 0, text
    assert snapshot(root) == before


def test_reshard_round_trip_2_4_2_gives_back_the_source_bytes(tmp_path):
    """The reshard is exact: TP 2 -> 4, then only the TP 4 files, back to 2, equals the source."""
    root = tmp_path / "root"
    synth(root, lmc_backend="fs", tp=2)
    source = snapshot(root)
    scan(root, tmp_path / "a.parquet", "--target-tp", "4", *GEOMETRY)
    apply(tmp_path / "a.parquet")
    four = tmp_path / "four"
    (four / "cache").mkdir(parents=True)
    for p in (root / "cache").iterdir():
        if "@4@" in p.name:
            shutil.copy2(p, four / "cache" / p.name)
    scan(four, tmp_path / "b.parquet", "--target-tp", "2", *GEOMETRY)
    apply(tmp_path / "b.parquet")
    back = {k: v for k, v in snapshot(four).items() if re.search(r"@2@[01]@", k)}
    assert back == source


@pytest.mark.parametrize("backend", ["fs", "gds"])
def test_mla_copies_are_linked_to_every_target_name(tmp_path, backend):
    """§3.1: an MLA chunk written with save_only_first_rank (`@1@0@`) read at TP 4 without it:
    fs aliases every rank to worker 0 (`@4@0@`), GDS looks up `@4@r@` for every rank (data,
    then sidecar); every name a hard link of the one copy."""
    root = tmp_path / "root"
    synth(root, lmc_backend=backend, tp=2, kv_kind="mla")
    before = snapshot(root)
    scan(root, tmp_path / "m.parquet", "--target-tp", "4", "--no-target-save-only-first-rank", *GEOMETRY)
    text = apply(tmp_path / "m.parquet")
    assert "created as hard links" in text
    want = expected_payloads(tmp_path / "want", backend, 4, mla=True, lmc_save_only_first_rank=False)
    for (h, wid), payload in want.items():
        got = reader(root / "cache", backend, 4, wid, mla=True, save_only_first_rank=False).lookup(h)
        assert got.found and got.payload == payload, (wid, got.why)
    new = [p for p in (root / "cache").rglob("*") if p.is_file() and "@4@" in p.name or "%404%40" in p.name]
    assert new and all(p.stat().st_nlink >= 2 for p in new)
    assert {k: v for k, v in snapshot(root).items() if k in before} == before


def test_gqa_model_rename_links_each_rank_file_to_its_own_name(tmp_path):
    """§3.4: same TP, another `vllm serve` argument: each rank's shard linked to its own name."""
    root = tmp_path / "root"
    res = synth(root, lmc_backend="fs", tp=2)
    scan(root, tmp_path / "m.parquet", "--target-model-name", "/models/llama-8b")
    apply(tmp_path / "m.parquet")
    for blk in res.blocks:
        for wid in (0, 1):
            got = reader(root / "cache", "fs", 2, wid, mla=False, model="/models/llama-8b").lookup(chash(blk))
            old = reader(root / "cache", "fs", 2, wid, mla=False).lookup(chash(blk))
            assert got.found and got.payload == old.payload


def test_legacy_gds_names_are_linked_to_the_quoted_name_data_then_sidecar(tmp_path):
    """§3.4: a <= 0.4.2 `_` name is found by no 0.5.6 lookup; its data file and its sidecar are
    linked to the quoted name."""
    root = tmp_path / "root"
    res = synth(root, lmc_backend="gds", tp=2, lmc_gds_names="legacy")
    for blk in res.blocks:
        assert not reader(root / "cache", "gds", 2, 0, mla=False).lookup(chash(blk)).found
    rows = scan(root, tmp_path / "m.parquet")
    assert {r["action"] for r in rows.values() if not r["relpath"].endswith(".metadata")} == {"link"}
    apply(tmp_path / "m.parquet")
    for blk in res.blocks:
        for wid in (0, 1):
            assert reader(root / "cache", "gds", 2, wid, mla=False).lookup(chash(blk)).found


def test_header_change_goes_only_into_dest(tmp_path):
    """§3.4, §3.6: stripping an fs tier's headers keeps each name, so it is written only into
    --dest DIR; without it the plan waits for DIR and writes nothing."""
    root = tmp_path / "root"
    res = synth(root, lmc_backend="fs", tp=2)
    before = snapshot(root)
    scan(root, tmp_path / "m.parquet", "--no-target-save-chunk-meta", *GEOMETRY)
    rc, text = run("migrate", "--manifest", tmp_path / "m.parquet")
    assert rc == 1 and "--dest" in text, text
    rc, text = run("migrate", "--manifest", tmp_path / "m.parquet", "--apply")
    assert snapshot(root) == before
    dest = tmp_path / "dest"
    dest.mkdir()
    apply(tmp_path / "m.parquet", "--dest", dest)
    for blk in res.blocks:
        for wid in (0, 1):
            h = chash(blk)
            got = reader(dest / "cache", "fs", 2, wid, mla=False, save_chunk_meta=False).lookup(h)
            old = reader(root / "cache", "fs", 2, wid, mla=False).lookup(h)
            assert got.found and got.payload == old.payload
            assert (dest / "cache" / Path(got.relpath).name).stat().st_size == len(old.payload)


@pytest.mark.parametrize("kind", ["full", "mla"])
def test_local_disk_chunks_are_converted_to_an_fs_tier_in_dest(tmp_path, kind):
    """§3.5: a .pt is reused only as an fs chunk of a new tier in --dest (header added, shape
    from the facts); the local_disk tier itself is never written."""
    root = tmp_path / "root"
    res = synth(root, lmc_backend="local_disk", tp=2, kv_kind=kind)
    before = snapshot(root)
    flags = ["--target-backend", "fs", "--model-name", MODEL, "--kv-kind", kind, *GEOMETRY]
    rows = scan(root, tmp_path / "m.parquet", *flags)
    assert {r["status"] for r in rows.values() if r["family"] == "lmcache"} == {"index_lost"}
    rc, text = run("migrate", "--manifest", tmp_path / "m.parquet", "--apply")
    assert snapshot(root) == before and "--dest" in text
    dest = tmp_path / "dest"
    dest.mkdir()
    apply(tmp_path / "m.parquet", "--dest", dest)
    assert snapshot(root) == before
    mla = kind == "mla"
    for blk in res.blocks:
        h = chash(blk)
        for wid in ((0,) if mla else (0, 1)):
            pt = reader(root / "cache", "local_disk", 1 if mla else 2, wid, mla=mla, restarted=False).lookup(h)
            got = reader(dest / "cache", "fs", 1 if mla else 2, wid, mla=mla).lookup(h)
            assert pt.found and got.found and got.payload == pt.payload, (got.why, got.detail)


def test_reshard_without_geometry_asks_for_it_and_writes_nothing(tmp_path):
    root = tmp_path / "root"
    synth(root, lmc_backend="fs", tp=2)
    before = snapshot(root)
    rows = scan(root, tmp_path / "m.parquet", "--target-tp", "4")
    asked = {r["asks"] for r in rows.values() if r["action"] == "needs_reshard"}
    assert asked == {"--total-kv-heads --head-dim --layers"}
    run("migrate", "--manifest", tmp_path / "m.parquet", "--apply")
    assert snapshot(root) == before


def test_a_chunk_missing_a_rank_file_is_incomplete_and_never_resharded(tmp_path):
    root = tmp_path / "root"
    res = synth(root, lmc_backend="fs", tp=2)
    gone = root / res.blocks[0]["files"][1]
    gone.unlink()
    rows = scan(root, tmp_path / "m.parquet", "--target-tp", "4", *GEOMETRY)
    assert rows[res.blocks[0]["files"][0]]["status"] == "incomplete"
    assert rows[res.blocks[0]["files"][0]]["action"] == "none"
    apply(tmp_path / "m.parquet")
    assert not [p for p in (root / "cache").iterdir() if res.blocks[0]["hex"] in p.name and "@4@" in p.name]


def test_a_target_name_holding_other_bytes_is_never_overwritten(tmp_path):
    root = tmp_path / "root"
    res = synth(root, lmc_backend="fs", tp=2)
    blk = res.blocks[0]
    first = root / blk["files"][0]
    squatter = first.with_name(first.name.replace("@2@0@", "@4@1@"))
    squatter.write_bytes(b"x" * 100)
    rows = scan(root, tmp_path / "m.parquet", "--target-tp", "4", *GEOMETRY)
    assert rows[blk["files"][0]]["finding"] == "target_occupied"
    rc, text = run("migrate", "--manifest", tmp_path / "m.parquet", "--apply")
    assert squatter.read_bytes() == b"x" * 100


def test_verify_finds_a_tampered_reshard_output(tmp_path):
    root = tmp_path / "root"
    synth(root, lmc_backend="fs", tp=2)
    scan(root, tmp_path / "m.parquet", "--target-tp", "4", *GEOMETRY)
    apply(tmp_path / "m.parquet")
    out = next(p for p in (root / "cache").iterdir() if "@4@2@" in p.name)
    data = bytearray(out.read_bytes())
    data[-1] ^= 0xFF
    fd = os.open(out, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(data[-1:]), len(data) - 1)
    finally:
        os.close(fd)
    rc, text = run("verify", root, "--journal", root / ".kvmigrate" / "journals")
    assert rc != 0 and out.name in text, text


def test_a_gds_sidecar_is_never_published_without_its_data_file(tmp_path):
    """§5: data first, then its sidecar. A data target taken after the scan is a conflict at
    apply; its sidecar is then not placed either (a probe reads the sidecar, then the data)."""
    root = tmp_path / "root"
    synth(root, lmc_backend="gds", tp=2, kv_kind="mla")
    scan(root, tmp_path / "m.parquet", "--target-tp", "2", "--no-target-save-only-first-rank", *GEOMETRY)
    from kvmigrate.migrate.plan import build_plan

    plan = build_plan(tmp_path / "m.parquet")
    targets = [a.target_relpath for tp in plan.targets for a in tp.actions]
    data = next(t for t in targets if not t.endswith(".metadata"))
    assert data + ".metadata" in targets
    (root / data).parent.mkdir(parents=True, exist_ok=True)
    (root / data).write_bytes(b"someone else's")
    rc, text = run("migrate", "--manifest", tmp_path / "m.parquet", "--apply")
    assert rc & 4 and "conflict" in text
    assert not (root / (data + ".metadata")).exists()
    assert (root / data).read_bytes() == b"someone else's"
    others = [t for t in targets if t.endswith(".metadata") and t != data + ".metadata"]
    assert others and all((root / t).exists() and (root / t[: -len(".metadata")]).exists() for t in others)


@pytest.mark.parametrize("backend", ["fs", "gds"])
def test_print_commands_writes_what_apply_writes(tmp_path, backend):
    """The shell form of a reshard (and its GDS sidecar) makes byte-identical files."""
    import subprocess

    a, b = tmp_path / "a", tmp_path / "b"
    synth(a, lmc_backend=backend, tp=2)
    synth(b, lmc_backend=backend, tp=2)
    scan(a, tmp_path / "a.parquet", "--target-tp", "4", *GEOMETRY)
    scan(b, tmp_path / "b.parquet", "--target-tp", "4", *GEOMETRY)
    rc, script = run("migrate", "--manifest", tmp_path / "a.parquet", "--print-commands")
    assert rc in (0, 1)
    (tmp_path / "plan.sh").write_text(script)
    subprocess.run(["sh", tmp_path / "plan.sh"], check=True)
    apply(tmp_path / "b.parquet")
    assert snapshot(a) == snapshot(b)


# --- every synth case: the reference reader finds no wrong byte after migrate --apply ---------

SWEEP_TARGETS = {
    "same": [],
    "tp": ["--target-tp", "4"],
    "model": ["--target-model-name", "/models/renamed"],
}


def _sweep_cases() -> list[tuple[str, bool, str, str]]:
    out = []
    for backend, header in (("fs", True), ("fs", False), ("gds", True), ("mp", False), ("local_disk", False)):
        for kind in ("full", "mla"):
            for target in SWEEP_TARGETS:
                out.append((backend, header, kind, target))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("backend, header, kind, target", _sweep_cases())
def test_reference_reader_finds_no_wrong_byte_after_apply(tmp_path, backend, header, kind, target):
    """Every backend, MLA and GQA, each target change, with every defect synth makes for the
    backend: after `migrate --apply` the target deployment (reference reader) reads, for
    every chunk it finds, exactly the bytes that deployment itself writes; every whole chunk
    is found; no source file changed."""
    era = "lmc-mp1" if backend == "mp" else "lmc-k3"
    defects = tuple(d for d, backends in S.DEFECTS.items() if backend in backends
                    and not (d == "header_invalid" and backend == "fs" and not header)
                    and not (d == "layerwise" and era != "lmc-k3") and d != "unreadable")
    root = tmp_path / "root"
    spec = dict(lmc_backend=backend, lmc_era=era, tp=2, kv_kind=kind, lmc_fs_header=header, blocks=12)
    res = synth(root, defects=defects, **spec)
    before = snapshot(root)
    flags = ["--kv-kind", kind, "--model-dtype", "bfloat16", *GEOMETRY, *SWEEP_TARGETS[target]]
    tier = root / "cache"
    if backend == "local_disk":
        flags += ["--target-backend", "fs", "--model-name", MODEL]
        scan(root, tmp_path / "m.parquet", *flags)
        tier = tmp_path / "dest" / "cache"
        tier.parent.mkdir()
        rc, text = run("migrate", "--manifest", tmp_path / "m.parquet", "--apply", "--dest", tier.parent)
    else:
        scan(root, tmp_path / "m.parquet", *flags)
        rc, text = run("migrate", "--manifest", tmp_path / "m.parquet", "--apply")
    assert rc in (0, 4), text
    assert {k: v for k, v in snapshot(root).items() if k in before} == before
    ws = 4 if target == "tp" else 2
    model = "/models/renamed" if target == "model" else MODEL
    mla = kind == "mla"
    want = synth(tmp_path / "want", **{**spec, "tp": ws})
    read_backend = "fs" if backend == "local_disk" else backend
    damaged = {b["hex"] for b in res.blocks if b["defect"]}
    found = 0
    for blk in want.blocks:
        h = chash(blk)
        for wid in range(1 if mla else ws):
            expect = reader(tmp_path / "want" / "cache", backend, ws, wid, mla=mla, save_chunk_meta=header,
                            restarted=False).lookup(h)
            assert expect.found, expect.why
            got = reader(tier, read_backend, ws, wid, mla=mla, model=model,
                         save_chunk_meta=header or backend == "local_disk").lookup(h)
            placed = str(got.path.relative_to(root) if got.path.is_relative_to(root) else "") not in before
            if got.found and (placed or blk["hex"] not in damaged):
                # what kvmigrate placed, or a whole chunk read in place (a damaged source read in place
                # is the scan's finding, never a migration's doing)
                assert got.payload == expect.payload, (blk["hex"], wid, got.relpath)
                found += 1
            elif got.found:
                continue
            else:
                assert blk["hex"] in damaged, (blk["hex"], wid, got.why, got.detail)
    assert found


@pytest.mark.parametrize("backend", ["fs", "gds"])
@pytest.mark.parametrize("crash_at", ["intent:1", "tmp_written:3", "linked:2", "created:5"])
def test_kill_9_mid_reshard_then_rerun_ends_like_an_uninterrupted_run(tmp_path, backend, crash_at):
    """A run killed at any journaled step, rerun, ends with exactly the uninterrupted run's
    files (no temp, no lock left); rollback then gives back the source tree."""
    import subprocess
    import sys

    from kvmigrate.migrate.crash import CRASH_ENV

    root, clean = tmp_path / "root", tmp_path / "clean"
    synth(root, lmc_backend=backend, tp=2)
    synth(clean, lmc_backend=backend, tp=2)
    before = snapshot(root)
    scan(root, tmp_path / "m.parquet", "--target-tp", "4", *GEOMETRY)
    scan(clean, tmp_path / "c.parquet", "--target-tp", "4", *GEOMETRY)
    apply(tmp_path / "c.parquet")
    kvm = os.path.join(os.path.dirname(sys.executable), "kvmigrate")
    killed = subprocess.run([kvm, "migrate", "--manifest", str(tmp_path / "m.parquet"), "--apply"],
                            capture_output=True, text=True, env={**os.environ, CRASH_ENV: crash_at}, timeout=120)
    assert killed.returncode == -9, killed.stderr
    apply(tmp_path / "m.parquet")
    assert snapshot(root) == snapshot(clean)
    assert not [p for p in root.rglob("*") if p.name.endswith(".tmp") or p.name == ".kvmigrate.lock"]
    assert run("verify", root, "--journal", root / ".kvmigrate" / "journals")[0] == 0
    rc, text = run("rollback", root / ".kvmigrate" / "journals")
    assert rc == 0, text
    assert snapshot(root) == before


def test_audit_exits_1_for_pending_tier_work_and_its_hint_does_it(tmp_path):
    """§7: scan/audit add 1 for a pending link/rewrite_header/reshard; the command the report
    prints does the work, and the audit after it exits 0."""
    import shlex

    root = tmp_path / "root"
    synth(root, lmc_backend="fs", tp=2)
    flags = [*RECIPE, "--target-tp", "4", *GEOMETRY]
    rc, text = run("audit", root, *flags)
    assert rc == 1, text
    hint = next(line.strip()[2:] for line in text.splitlines() if line.strip().startswith("$ kvmigrate migrate"))
    args = shlex.split(hint)[1:]
    assert "--apply" in args
    rc, out = run(*args)
    assert rc == 0, out
    rc, text = run("audit", root, *flags)
    assert rc == 0, text


def test_mla_copies_that_differ_under_verify_hash_place_the_majority(tmp_path):
    """§3.4: MLA copies (GDS without save_only_first_rank) that differ: the copy a majority
    agrees with is placed; the odd copy is replica_mismatch. Without a majority nothing is."""
    root = tmp_path / "root"
    res = synth(root, lmc_backend="gds", tp=3, kv_kind="mla", lmc_save_only_first_rank=False)
    blk = res.blocks[0]
    odd = root / blk["files"][0]  # rank 0's copy differs from ranks 1 and 2
    data = bytearray(odd.read_bytes())
    data[-1] ^= 0xFF
    odd.write_bytes(bytes(data))
    rows = scan(root, tmp_path / "m.parquet", "--verify", "hash", "--target-model-name", "/models/x", *GEOMETRY)
    assert rows[blk["files"][0]]["status"] == "replica_mismatch"
    assert rows[blk["files"][1]]["action"] == "link"
    apply(tmp_path / "m.parquet")
    got = reader(root / "cache", "gds", 3, 0, mla=True, model="/models/x", save_only_first_rank=False).lookup(chash(blk))
    assert got.found and got.payload == (root / blk["files"][1]).read_bytes()[4096:]


# --- prune --migrated: the legacy names a migration replaced (§6) ----------------------------

@pytest.mark.parametrize("backend", ["fs", "gds"])
def test_prune_migrated_takes_every_source_of_a_placed_reshard_with_its_sidecars(tmp_path, backend):
    root = tmp_path / "root"
    res = synth(root, lmc_backend=backend, tp=2)
    sources = snapshot(root)
    flags = [*RECIPE, "--target-tp", "4", *GEOMETRY]
    rc, text = run("migrate", root, *flags, "--apply")
    assert rc == 0, text
    migrated = snapshot(root)
    rc, text = run("prune", root, *flags, "--force-live", "--apply")
    assert rc == 0, text
    left = snapshot(root)
    assert set(left) == set(migrated) - set(sources)  # every legacy file (data, sidecars) moved, no output
    for blk in res.blocks:
        for wid in range(4):
            assert reader(root / "cache", backend, 4, wid, mla=False).lookup(chash(blk)).found
    journal = next((root / ".kvmigrate" / "journals" / "prune").iterdir())
    rc, text = run("restore", journal)
    assert rc == 0, text
    assert snapshot(root) == migrated


def test_prune_migrated_takes_an_mla_chunks_old_name_never_its_target(tmp_path):
    """An MLA chunk written with save_only_first_rank (`@1@0@`) linked to `@2@0@` (fs, target
    without it): the old name goes (its bytes stay under the new name), the new never."""
    root = tmp_path / "root"
    synth(root, lmc_backend="fs", tp=2, kv_kind="mla")
    old = set(snapshot(root))
    flags = [*RECIPE, "--target-tp", "2", "--no-target-save-only-first-rank", *GEOMETRY]
    assert run("migrate", root, *flags, "--apply")[0] == 0
    new = set(snapshot(root)) - old
    rc, text = run("prune", root, *flags, "--force-live", "--apply")
    assert rc == 0, text
    assert set(snapshot(root)) == new, text


def test_prune_migrated_takes_nothing_from_a_tier_nothing_was_migrated_from(tmp_path):
    root = tmp_path / "root"
    synth(root, lmc_backend="gds", tp=2)
    before = snapshot(root)
    rc, text = run("prune", root, *RECIPE, "--force-live", "--apply")
    assert rc == 0, text
    assert snapshot(root) == before


def test_every_gds_file_of_a_reshard_chunk_counts_once_and_the_cost_is_every_output(tmp_path):
    """A reshard's other ranks and every sidecar point at rank 0's row (no `none` block of its
    own); `output_bytes` is everything the action writes (every target rank's data file and
    sidecar), so the report's cost is the plan's."""
    import json

    root = tmp_path / "root"
    res = synth(root, lmc_backend="gds", tp=2)
    flags = [*RECIPE, "--target-tp", "4", *GEOMETRY]
    rows = scan(root, tmp_path / "m.parquet", *flags)
    assert {r["action"] for r in rows.values() if r["finding"] not in ("part_of_action",)} == {"reshard"}
    rc, text = run("report", tmp_path / "m.parquet", "--json")
    totals = json.loads(text)["totals"]
    data = 4 * (4096 + 2 * 2 * 4 * (S.TOTAL_KV_HEADS // 4) * S.HEAD_DIM * 2)
    want = len(res.blocks) * (data + 4 * 4096)
    assert totals["blocks"] == len(res.blocks)
    rc, plan = run("migrate", "--manifest", tmp_path / "m.parquet", "--json")
    created = json.loads(plan)
    assert want == sum(t["actions"]["reshard"]["bytes"] for t in created["targets"]), created
    assert want == totals["transform_cost"]["reshard"]["output_bytes"], totals["transform_cost"]


def test_the_local_disk_hints_lead_to_a_converted_tier(tmp_path):
    """A sequence an operator follows: audit names the facts a conversion waits for (all at
    once); with them, the conversion hint (DIR filled in) writes an fs tier the reader finds."""
    import shlex

    root, dest = tmp_path / "root", tmp_path / "dest"
    res = synth(root, lmc_backend="local_disk", tp=2)
    dest.mkdir()
    rc, text = run("audit", root, *RECIPE, "--target-backend", "fs")
    asked = next(line for line in text.splitlines() if line.strip().startswith("2. state"))
    assert "--kv-kind" in asked and "--model-name" in asked, text
    facts = ["--kv-kind", "full", "--model-name", MODEL, *GEOMETRY]
    rc, text = run("audit", root, *RECIPE, "--target-backend", "fs", *facts)
    hint = next(line.strip()[2:] for line in text.splitlines()
                if line.strip().startswith("$ kvmigrate migrate") and "--dest <DIR>" in line)
    assert hint.count("--target-backend") == 1, hint
    args = [a if a != "<DIR>" else str(dest) for a in shlex.split(hint)[1:]] + ["--apply"]
    rc, out = run(*args)
    assert rc == 0, out
    for blk in res.blocks:
        for wid in (0, 1):
            assert reader(dest / "cache", "fs", 2, wid, mla=False).lookup(chash(blk)).found


def test_a_reshard_checks_each_source_once_for_all_its_outputs(tmp_path, monkeypatch):
    """A chunk's several outputs (one per target rank, a GDS sidecar each) read and check
    their sources once per batch while the files' stat is unchanged; the writer reads what
    it needs."""
    from click.testing import CliRunner

    from kvmigrate.cli import cli
    from kvmigrate.migrate import sources

    root = tmp_path / "root"
    res = synth(root, lmc_backend="gds", tp=2)
    scan(root, tmp_path / "m.parquet", "--target-tp", "4", *GEOMETRY)
    reads: list[int] = []
    real = sources._read_fd

    def counted(fd, *a, **kw):
        reads.append(fd)
        return real(fd, *a, **kw)

    monkeypatch.setattr(sources, "_read_fd", counted)
    out = CliRunner().invoke(cli, ["migrate", "--manifest", str(tmp_path / "m.parquet"), "--apply"])
    assert out.exit_code == 0, out.output
    assert len(reads) == 2 * len(res.blocks)  # two source ranks a chunk, for its 8 files


@pytest.mark.parametrize("backend", ["fs", "gds"])
def test_a_rescan_finds_copies_made_by_mode_copy_and_prune_takes_the_old_names(tmp_path, backend):
    """After `migrate --apply --mode copy` (new inodes, a scan that hashes nothing) a rescan
    says already_present, not target_occupied: a rerun creates nothing and prune --migrated
    takes the old names (their bytes stay under the new ones)."""
    root = tmp_path / "root"
    res = synth(root, lmc_backend=backend, tp=2, kv_kind="mla")
    flags = [*RECIPE, "--target-tp", "2", "--no-target-save-only-first-rank", *GEOMETRY]
    old = set(snapshot(root))
    rc, text = run("migrate", root, *flags, "--apply", "--mode", "copy")
    assert rc == 0, text
    rows = scan(root, tmp_path / "m.parquet", *flags)
    assert {r["finding"] for r in rows.values()} & {"target_occupied"} == set()
    rc, text = run("migrate", "--manifest", tmp_path / "m.parquet", "--apply")
    assert rc == 0 and "created 0" in text, text
    rc, text = run("prune", root, *flags, "--force-live", "--apply")
    assert rc == 0, text
    assert not set(snapshot(root)) & old
    for blk in res.blocks:
        for wid in (0, 1):
            assert reader(root / "cache", backend, 2, wid, mla=True, save_only_first_rank=False).lookup(
                chash(blk)).found
