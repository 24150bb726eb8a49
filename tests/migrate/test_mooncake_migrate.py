"""Migrating Mooncake stores in place (spec mooncake.md §3.3, §5): rekey (an index rewrite,
a KVEntry at its scoped key) and link (a misfiled KVEntry) on synth stores, judged by the
reference reader (tests/helpers/mooncake_reader.py, written from the spec): after --apply a
starting client reads every target key to the bytes the writer stored; the proofs that no
client runs; kill -9 at every step, then a rerun or a rollback; rollback to the exact
original bytes; verify; staleness."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmigrate import manifest
from kvmigrate.families import mooncake as families_mooncake
from kvmigrate.formats import mooncake as M
from kvmigrate.synth import SynthSpec, build
from kvmigrate.synth import mooncake as S

from helpers import mooncake_reader as R
from helpers.cli_helpers import printed_apply, run, run_json

MC = dict(family="mooncake", layers=2, block_tokens=4, blocks=3)


def synth(root: Path, **kw):
    return build(root, SynthSpec(**{**MC, **kw}))


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ROOT but kvmigrate's own folder (its journals, backups)
    and Mooncake's client lock, which kvmigrate creates where absent and leaves (§5.1:
    removing a lock file others open races with them)."""
    out = {}
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x != ".kvmigrate"]
        for n in names:
            if n == M.LOCK_NAME and (Path(d) / n).stat().st_size == 0:
                continue
            p = Path(d) / n
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def reads_every_target_key(res, spec: SynthSpec) -> None:
    """A client of mooncake-0.3.14 starting on each client root reads every object the
    writer stored under its scoped key, to the writer's bytes (rank_value)."""
    starts = {}
    for blk in res.blocks:
        for o in blk["objects"]:
            client = res.root / o["client_root"]
            if o["client_root"] not in starts:
                started = R.start(client)
                assert not started.refused and not started.deleted, (started.refused, started.deleted)
                starts[o["client_root"]] = started
            key = M.scoped(o["key"])
            got = R.read(client, starts[o["client_root"]], key)
            want = S.rank_value(spec, blk["hex"], o["rank"], o["pp"], o["half"] or "k")
            assert got == want, (o["key"], got if isinstance(got, str) else len(got))


CASES = [(b, e, k, tp) for b in ("bucket", "file_per_key") for e in ("vllm", "sglang") for k in ("full", "mla")
         for tp in (1, 2, 4)]


@pytest.mark.parametrize("backend,engine,kind,tp", CASES)
def test_a_raw_store_is_rekeyed_and_every_key_reads_its_bytes(tmp_path, backend, engine, kind, tp):
    """A store written by Mooncake <= 0.3.11 (raw keys): after `migrate --apply` a 0.3.14
    client reads every key to the writer's bytes; no `.bucket` changed; a rescan finds
    nothing pending and audit exits 0 (the raw KVEntries stay, already_present elsewhere,
    for prune --migrated)."""
    root = tmp_path / "root"
    spec = SynthSpec(**{**MC, "mc_backend": backend, "mc_engine": engine, "kv_kind": kind, "tp": tp,
                        "mc_scheme": "mc-raw"})
    res = build(root, spec)
    buckets = {p: p.read_bytes() for p in root.rglob("*.bucket")}
    code, out = run("migrate", root, "--apply", "--engine-stopped")
    assert code == 0, out
    reads_every_target_key(res, spec)
    assert {p: p.read_bytes() for p in root.rglob("*.bucket")} == buckets
    assert not list(root.rglob(".kvmigrate-stage")) and not list(root.rglob(".kvmigrate.lock"))
    code, out = run("migrate", root)
    assert "Mooncake store" not in out or "0 rekey" in out, out


def test_a_misfiled_kventry_is_linked_to_fpk_of_its_key(tmp_path):
    root = tmp_path / "root"
    spec = SynthSpec(**{**MC, "mc_backend": "file_per_key", "tp": 2})
    res = build(root, spec)
    entry = next(p for p in sorted((root / "store" / M.DEFAULT_FSDIR).rglob("*")) if p.is_file())
    a = entry.parent.parent
    stray = a.parent / ("b" if a.name != "b" else "c") / entry.parent.name / entry.name
    stray.parent.mkdir(parents=True, exist_ok=True)
    entry.rename(stray)
    started = R.start(root / "store")
    key = M.decode_kv_entry(stray.read_bytes()).key
    assert isinstance(R.read(root / "store", started, key), str)  # registered, never read
    code, out = run("migrate", root, "--apply", "--engine-stopped")
    assert code == 4, out  # (the misfiled source stays a finding until prune, as for every family)
    assert entry.read_bytes() == stray.read_bytes()
    reads_every_target_key(res, spec)


def test_without_a_proof_nothing_is_written(tmp_path):
    """No engine_stopped and no writer_release >= 0.3.14: exit 2 naming the store and the
    flag, nothing written (not even a journal)."""
    root = tmp_path / "root"
    synth(root, mc_scheme="mc-raw", tp=2)
    before = tree_digest(root)
    code, out = run("migrate", root, "--apply")
    assert code == 2 and "store" in out and "--engine-stopped" in out
    assert tree_digest(root) == before and not (root / ".kvmigrate").exists()


def test_the_dry_run_s_apply_command_states_the_stop_it_needs_and_runs_as_printed(tmp_path):
    """Without a proof, the printed command carries --engine-stopped and says what must be
    true first (run without it, the apply stops with exit 2); with the client lock as the
    proof, it needs no statement."""
    root = tmp_path / "root"
    res = synth(root, mc_scheme="mc-raw", tp=2)
    code, out = run("migrate", root)
    label, args = printed_apply(out)
    assert code == 1 and "once no engine uses Mooncake store store" in label and "--engine-stopped" in args, out
    assert run_json("migrate", root)[1]["apply_command"] == "kvmigrate " + " ".join(args)
    assert run(*args)[0] == 0
    reads_every_target_key(res, SynthSpec(**{**MC, "mc_scheme": "mc-raw", "tp": 2}))
    other = tmp_path / "other"
    synth(other, mc_scheme="mc-raw", tp=2)
    facts = tmp_path / "FACTS.json"
    facts.write_text(json.dumps({"store": {"writer_release": "0.3.14"}}))
    label, args = printed_apply(run("migrate", other, "--facts", facts)[1])
    assert label == "to apply:" and "--engine-stopped" not in args and run(*args)[0] == 0


def test_a_held_client_lock_stops_the_apply_before_any_write(tmp_path):
    root = tmp_path / "root"
    synth(root, mc_scheme="mc-raw", tp=2, defects=("client_lock",))
    lock = root / "store" / M.LOCK_NAME
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, time\n"
        f"f = open({str(lock)!r}, 'rb'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        before = tree_digest(root)
        code, out = run("migrate", root, "--apply", "--engine-stopped")
        assert code == 8 and "Mooncake client holds" in out
        assert tree_digest(root) == before
    finally:
        holder.kill()
        holder.wait()


def test_writer_release_0_3_14_stated_makes_the_client_lock_the_proof(tmp_path):
    """A bucket store whose writer_release >= 0.3.14 is stated: the client lock kvmigrate
    holds is the proof, no --engine-stopped; the lock file is created and left."""
    root = tmp_path / "root"
    res = synth(root, mc_scheme="mc-raw", tp=2)
    facts = tmp_path / "FACTS.json"
    facts.write_text(json.dumps({"store": {"writer_release": "0.3.14"}}))
    code, out = run("migrate", root, "--apply", "--facts", facts)
    assert code == 0, out
    assert (root / "store" / M.LOCK_NAME).is_file()
    reads_every_target_key(res, SynthSpec(**{**MC, "mc_scheme": "mc-raw", "tp": 2}))


@pytest.mark.parametrize("backend", ["bucket", "file_per_key"])
def test_rollback_restores_every_files_exact_bytes(tmp_path, backend):
    root = tmp_path / "root"
    synth(root, mc_scheme="mc-raw", tp=2, mc_backend=backend, mc_engine="sglang")
    before = tree_digest(root)
    code, out = run("migrate", root, "--apply", "--engine-stopped")
    assert code == 0 and tree_digest(root) != before, out
    journal = next((root / ".kvmigrate" / "journals").glob("*.journal"))
    code, out = run("verify", root, "--journal", journal)
    assert code == 0, out
    code, out = run("rollback", journal, "--dry-run")
    assert code == 0 and tree_digest(root) != before
    code, out = run("rollback", journal)
    assert code == 0, out
    assert tree_digest(root) == before


def test_verify_finds_a_changed_index_and_an_evicted_pair(tmp_path):
    root = tmp_path / "root"
    synth(root, mc_scheme="mc-raw", tp=2)
    code, _ = run("migrate", root, "--apply", "--engine-stopped")
    journal = next((root / ".kvmigrate" / "journals").glob("*.journal"))
    meta = next((root / "store").glob("*.meta"))
    data = meta.read_bytes()
    meta.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    code, out = run("verify", root, "--journal", journal)
    assert code & 4 and "not the index the migration wrote" in out
    meta.unlink()
    meta.with_suffix(".bucket").unlink()
    code, out = run("verify", root, "--journal", journal)
    assert code & 1 and not code & 4 and "evicted" in out


def test_an_index_changed_since_the_scan_is_not_rewritten(tmp_path):
    root = tmp_path / "root"
    synth(root, mc_scheme="mc-raw", tp=2)
    m = tmp_path / "m.parquet"
    run("scan", root, "-o", m)
    meta = next((root / "store").glob("*.meta"))
    os.utime(meta, ns=(meta.stat().st_atime_ns, meta.stat().st_mtime_ns + 10**9))  # a client rewrote it
    before = tree_digest(root)
    code, out = run("migrate", "--manifest", m, "--apply", "--engine-stopped")
    assert "changed_since_scan 6" in out
    assert tree_digest(root) == before


# every journaled step each backend passes: an index rewrite (backup link, temp, rename), or a
# KVEntry (hash folders, temp, link), the intent before and the journal record after
POINTS = [("bucket", p, n) for p, n in (("intent", 1), ("backup", 1), ("tmp_written", 1), ("renamed", 1),
                                        ("created", 1))] + \
         [("file_per_key", p, n) for p, n in (("intent", 1), ("tmp_written", 1), ("created", 1), ("dirs_made", 2),
                                              ("linked", 3), ("created", 4))]


def _killed(root: Path, point: str, n: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVMIGRATE_CRASH_AT": f"{point}:{n}"}
    return subprocess.run([sys.executable, "-m", "kvmigrate", "migrate", str(root), "--apply", "--engine-stopped"],
                          env=env, capture_output=True, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("backend,point,n", POINTS)
def test_kill_9_at_every_step_then_rerun_or_rollback(tmp_path, backend, point, n):
    """kill -9 at each journaled step: no source value unreadable meanwhile (the reader
    reads every raw key or its scoped key); a rerun ends as an uninterrupted run; a
    rollback instead gives back the exact original bytes."""
    spec = SynthSpec(**{**MC, "mc_backend": backend, "mc_scheme": "mc-raw", "tp": 2})
    for then in ("rerun", "rollback"):
        root = tmp_path / then
        res = build(root, spec)
        before = tree_digest(root)
        killed = _killed(root, point, n)
        assert killed.returncode == -9, (killed.returncode, killed.stderr)
        for blk in res.blocks:  # every value readable under one of its keys
            for o in blk["objects"]:
                client = root / o["client_root"]
                started = R.start(client)
                assert not started.refused
                raw = R.read(client, started, o["key"].encode(), scoped=False)
                scoped = R.read(client, started, M.scoped(o["key"]))
                want = S.rank_value(spec, blk["hex"], o["rank"], o["pp"], o["half"] or "k")
                assert want in (raw, scoped), (point, o["key"])
        if then == "rerun":
            code, out = run("migrate", root, "--apply", "--engine-stopped")
            assert code == 0, out
            reads_every_target_key(res, spec)
            assert not list(root.rglob(".kvmigrate-stage")) or not any(
                p.is_file() for s in root.rglob(".kvmigrate-stage") for p in s.iterdir())
        else:
            journal = root / ".kvmigrate" / "journals"
            code, out = run("rollback", journal)
            assert code == 0, out
            assert tree_digest(root) == before, point


def test_print_commands_says_the_store_work_is_not_in_the_script(tmp_path):
    """--print-commands cannot express an index rewrite: the script says so, per store,
    rather than leaving the store's work out silently."""
    root = tmp_path / "root"
    synth(root, mc_scheme="mc-raw", tp=2)
    code, out = run("migrate", root, "--print-commands")
    assert code == 0 and "# Mooncake store store: 6 objects (1 index rewrites, 0 KVEntries) are not in this script" in out


@pytest.mark.parametrize("backend", ["bucket", "file_per_key"])
def test_rollback_list_says_the_store_work_is_not_in_the_script(tmp_path, backend):
    """rollback --dry-run --list cannot express a KVEntry's checked removal nor an index's
    restore: the script names that work per store, as many as the dry run counts, rather
    than print an empty script."""
    root = tmp_path / "root"
    synth(root, mc_scheme="mc-raw", mc_backend=backend, tp=2)
    assert run("migrate", root, "--apply", "--engine-stopped")[0] == 0
    journal = next((root / ".kvmigrate" / "journals").glob("*.journal"))
    code, dry = run_json("rollback", journal, "--dry-run")
    code, out = run("rollback", journal, "--dry-run", "--list")
    work = {"bucket": f"{dry['removed'].get('index', 0)} indexes to restore",
            "file_per_key": f"{dry['removed'].get('block', 0)} KVEntries to remove"}[backend]
    said = [line for line in out.splitlines() if line.startswith("# Mooncake store store: ")]
    assert code == 0 and len(said) == 1 and work in said[0] and "are not in this script" in said[0], out
    assert not work.startswith("0 ")


GEOMETRY = {"total_kv_heads": 8, "head_dim": 4, "dtype_bytes": 2, "layers": 2, "page_tokens": 4, "kv_kind": "full"}
RESHARDS = [(b, e, s, t) for b in ("bucket", "file_per_key") for e in ("vllm", "sglang")
            for s, t in ((2, 4), (4, 2), (2, 1), (1, 8), (8, 2))]


def reshard_facts(tmp_path: Path, target_tp: int) -> Path:
    facts = tmp_path / "FACTS.json"
    facts.write_text(json.dumps({"store": {**GEOMETRY, "target_tp": target_tp, "engine_stopped": True}}))
    return facts


def reads_at_target_tp(root: Path, res, spec: SynthSpec, target_tp: int, skip: set[str] = frozenset()) -> None:
    """A client of the target deployment (TP `target_tp`) starting on each client root reads
    every key of every block (but those in `skip`) to the bytes that deployment would itself
    have written."""
    target = spec.replace(tp=target_tp)
    halves = ("k", "v") if spec.mc_engine == "sglang" else ("k",)  # (vLLM ignores the half)
    for blk in res.blocks:
        if blk["hex"] in skip:
            continue
        o = blk["objects"][0]
        for r in range(S.key_ranks(target)):
            for half in halves:
                key = S.engine_key(target, blk["hex"], r, o["pp"], half)
                client = root / S.client_root(target, r, o["pp"])
                started = R.start(client)
                assert not started.refused and not started.deleted, (started.refused, started.deleted)
                got = R.read(client, started, M.scoped(key))
                want = S.rank_value(target, blk["hex"], r, o["pp"], half)
                assert got == want, (key, got if isinstance(got, str) else len(got))


@pytest.mark.parametrize("backend", ["bucket", "file_per_key"])
def test_a_reshard_is_planned_in_steps_linear_in_the_store_s_objects(tmp_path, monkeypatch, backend):
    """Each resharded block's sources are looked up, not found by reading every object of
    its store again: four times the blocks, four times the keys parsed (it was sixteen)."""
    from kvmigrate.migrate import stores

    parsed = []
    for blocks in (8, 32):
        root = tmp_path / f"root{blocks}"
        build(root, SynthSpec(**{**MC, "mc_backend": backend, "tp": 2, "blocks": blocks}))
        m = tmp_path / f"m{blocks}.parquet"
        code, out = run("scan", root, "--facts", reshard_facts(tmp_path, 4), "-o", m, "-q")
        assert code in (0, 1), out
        calls = [0]
        real = M.parse_storage_key

        def counting(key, _real=real, _calls=calls):
            _calls[0] += 1
            return _real(key)

        monkeypatch.setattr(M, "parse_storage_key", counting)
        (plan,) = stores.plan_stores(str(m), manifest.read_metadata(str(m))["namespaces"], engine_stopped=True)
        monkeypatch.setattr(M, "parse_storage_key", real)
        assert len(plan.reshards) == blocks
        parsed.append(calls[0])
    assert parsed[1] <= 5 * parsed[0], parsed


@pytest.mark.parametrize("backend,engine,source_tp,target_tp", RESHARDS)
def test_a_gqa_store_resharded_reads_as_the_target_tp_wrote_it(tmp_path, backend, engine, source_tp, target_tp):
    """§3.4-3.6: after `migrate --apply` a store written at one TP reads, key by key, as the
    target TP would have written it (synth's own store at that TP is the reference); no
    source `.bucket` changes; a rescan plans nothing; verify passes; rollback gives back
    every file's exact bytes."""
    root = tmp_path / "root"
    spec = SynthSpec(**{**MC, "mc_backend": backend, "mc_engine": engine, "tp": source_tp})
    res = build(root, spec)
    before = tree_digest(root)
    buckets = {p: p.read_bytes() for p in root.rglob("*.bucket")}
    facts = reshard_facts(tmp_path, target_tp)
    code, out = run("migrate", root, "--facts", facts, "--apply")
    assert code == 0, out
    reads_at_target_tp(root, res, spec, target_tp)
    assert all(p.read_bytes() == data for p, data in buckets.items())
    code, out = run("migrate", root, "--facts", facts)
    assert code == 0 and "Mooncake store" not in out, out
    journal = next((root / ".kvmigrate" / "journals").glob("*.journal"))
    code, out = run("verify", root, "--journal", journal)
    assert code == 0, out
    code, out = run("rollback", journal)
    assert code == 0, out
    assert tree_digest(root) == before


def test_a_block_whose_key_is_in_two_live_entries_is_not_resharded(tmp_path):
    """§1.4: a key registered by two live entries (equal values) fails every read, so its
    block is a miss. A reshard leaves that block alone, as a block with a damaged key-rank
    object, instead of stopping on a traceback; the other blocks read at the target TP;
    rollback gives back every file."""
    root = tmp_path / "root"
    spec = SynthSpec(**{**MC, "mc_backend": "bucket", "tp": 2, "mc_bucket_keys": 1})
    res = build(root, spec)
    metas = sorted((root / "store").glob("*.meta"))
    first = metas[0]
    twice = next(b["hex"] for b in res.blocks if b["hex"].encode() in first.read_bytes())
    copy = first.with_name(f"{int(metas[-1].stem) + 100}.meta")
    copy.write_bytes(first.read_bytes())
    copy.with_suffix(".bucket").write_bytes(first.with_suffix(".bucket").read_bytes())
    before = tree_digest(root)
    facts = reshard_facts(tmp_path, 4)
    code, out = run("migrate", root, "--facts", facts, "--apply")
    assert code == 0 and "Traceback" not in out, out
    reads_at_target_tp(root, res, spec, 4, skip={twice})
    code, out = run("migrate", root, "--facts", facts)
    assert code == 0 and "Traceback" not in out and "Mooncake store" not in out, out
    journal = next((root / ".kvmigrate" / "journals").glob("*.journal"))
    code, out = run("rollback", journal)
    assert code == 0, out
    assert tree_digest(root) == before


def test_a_resharded_store_of_another_fsdir_is_read_in_place_at_its_own_paths(tmp_path):
    """A file-per-key store under a MOONCAKE_OFFLOAD_FSDIR of its own (the `fsdir` fact),
    resharded: the rescan finds each block in two layouts and names the target's objects
    `already_present` at their own paths, in that folder (not the default one's)."""
    root = tmp_path / "root"
    build(root, SynthSpec(**{**MC, "mc_backend": "file_per_key", "mc_fsdir": "kvdir", "tp": 4}))
    facts = tmp_path / "FACTS.json"  # (TP 4 -> 2: the writer's key ranks 2 and 3 stay, a second layout)
    facts.write_text(json.dumps({"store": {**GEOMETRY, "target_tp": 2, "engine_stopped": True, "fsdir": "kvdir"}}))
    code, out = run("migrate", root, "--facts", facts, "--apply")
    assert code == 0, out
    code, out = run("scan", root, "--facts", facts, "-o", tmp_path / "after.parquet")
    assert code == 0, out
    rows = [r for r in manifest.read_table(tmp_path / "after.parquet").to_pylist() if r["action"] == "already_present"]
    assert len(rows) == 2 * 3  # (key ranks 0 and 1 of each block)
    assert all(r["target_relpath"] == r["relpath"] and "/kvdir/" in r["relpath"] for r in rows), rows[0]


def _misplace(entry: Path, value: bytes | None = None) -> Path:
    """A KVEntry's copy in the last first-level folder of the fpk dir, `p` (misfiled: met
    after the entry), its value replaced by `value` when given; the path of the copy."""
    a = entry.parent.parent
    assert a.name != "p"
    copy = a.parent / "p" / entry.parent.name / entry.name
    copy.parent.mkdir(parents=True, exist_ok=True)
    e = M.decode_kv_entry(entry.read_bytes())
    copy.write_bytes(M.encode_kv_entry(M.KVEntry(e.key, e.value if value is None else value)))
    return copy


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_block_with_a_misfiled_key_rank_is_resharded_from_the_entry_a_client_reads(tmp_path, engine):
    """A misfiled KVEntry holds its key's value (§2.4): a block whose key rank 0 is only
    misfiled is resharded from it, not stopped on a traceback; a block whose key rank 0
    has a misfiled copy with other bytes is resharded from the entry in place, the one a
    client reads. Every block then reads at the target TP as that TP would have written it."""
    root = tmp_path / "root"
    spec = SynthSpec(**{**MC, "mc_backend": "file_per_key", "mc_engine": engine, "tp": 2, "blocks": 4})
    res = build(root, spec)
    def key_rank(p: Path) -> tuple[int, str]:
        ek = families_mooncake.parse_engine_key(M.parse_storage_key(M.decode_kv_entry(p.read_bytes()).key).engine)
        assert ek is not None
        return ek.rank, ek.half

    rank0 = sorted(p for p in (root / "store").rglob("*") if p.is_file() and key_rank(p) in ((0, ""), (0, "k"))
                   and p.parent.parent.name != "p")
    moved, copied = rank0[0], rank0[1]
    _misplace(moved)
    moved.unlink()
    stale = _misplace(copied, bytes(len(M.decode_kv_entry(copied.read_bytes()).value)))
    stale.write_bytes(stale.read_bytes()[:-1] + b"\x01")  # (not all zero: a stale value, not zero_filled)
    code, out = run("migrate", root, "--facts", reshard_facts(tmp_path, 4), "--apply")
    assert "Traceback" not in out and code in (0, 4), out  # (4: the misfiled entries stay findings until prune)
    reads_at_target_tp(root, res, spec, 4)


RESHARD_POINTS = [("bucket", p, n) for p, n in (("backup", 1), ("renamed", 1), ("bucket_linked", 1),
                                                ("meta_linked", 1), ("created", 2))] + \
                 [("file_per_key", p, n) for p, n in (("backup", 1), ("renamed", 1), ("linked", 1), ("created", 3))]


@pytest.mark.slow
@pytest.mark.parametrize("backend,point,n", RESHARD_POINTS)
def test_kill_9_during_a_reshard_then_rerun_or_rollback(tmp_path, backend, point, n):
    """kill -9 at each step of a reshard (a retire's index rewrite, a pair's two links, a
    displaced KVEntry's replacement, the journal record): a rerun reads as the target TP
    wrote it; a rollback gives back the exact original bytes."""
    spec = SynthSpec(**{**MC, "mc_backend": backend, "tp": 2})
    facts = reshard_facts(tmp_path, 4)
    for then in ("rerun", "rollback"):
        root = tmp_path / then
        res = build(root, spec)
        before = tree_digest(root)
        env = {**os.environ, "KVMIGRATE_CRASH_AT": f"{point}:{n}"}
        killed = subprocess.run([sys.executable, "-m", "kvmigrate", "migrate", str(root), "--facts", str(facts),
                                 "--apply"], env=env, capture_output=True, text=True)
        assert killed.returncode == -9, (killed.returncode, killed.stderr)
        if then == "rerun":
            code, out = run("migrate", root, "--facts", facts, "--apply")
            assert code == 0, out
            reads_at_target_tp(root, res, spec, 4)
        else:
            code, out = run("rollback", root / ".kvmigrate" / "journals")
            assert code == 0, out
            assert tree_digest(root) == before, point


DEFECT_SWEEP = [(b, e, d) for b in ("bucket", "file_per_key") for e in ("vllm", "sglang")
                for d, (backends, _) in S.DEFECTS.items() if b in backends and d not in ("unreadable", "client_lock")]


@pytest.mark.parametrize("backend,engine,defect", DEFECT_SWEEP)
def test_every_defect_store_migrated_reads_every_whole_block(tmp_path, backend, engine, defect):
    """A raw store with each defect synth writes, migrated: every block the writer stored whole
    (no defect touched it) reads under its scoped key to the writer's bytes; the next client
    start deletes and refuses no more than the defect itself made it; no source value that
    read before reads wrong after."""
    root = tmp_path / "root"
    spec = SynthSpec(**{**MC, "mc_backend": backend, "mc_engine": engine, "tp": 2, "mc_scheme": "mc-raw",
                        "defects": (defect,)})
    res = build(root, spec)
    touched = {h for d in res.defects for h in d.get("blocks") or ()}
    clients = sorted({o["client_root"] for b in res.blocks for o in b["objects"]})
    before = {c: R.start(root / c) for c in clients}
    code, out = run("migrate", root, "--apply", "--engine-stopped")
    assert code in (0, 1, 4, 5), out
    for c in clients:
        after = R.start(root / c)
        assert len(after.deleted) <= len(before[c].deleted) and bool(after.refused) <= bool(before[c].refused), c
    for blk in res.blocks:
        if blk["hex"] in touched:
            continue
        for o in blk["objects"]:
            client = root / o["client_root"]
            started = R.start(client)
            if started.refused:  # (a KVEntry the defect wrote stops this client: nothing reads, as before)
                continue
            want = S.rank_value(spec, blk["hex"], o["rank"], o["pp"], o["half"] or "k")
            assert R.read(client, started, M.scoped(o["key"])) == want, (defect, o["key"])


def test_target_mooncake_0_3_11_reads_raw_keys_and_leaves_the_other_families_alone(tmp_path):
    """§0: `--target mooncake-0.3.11` makes every store's target a client that looks up raw
    keys (a downgrade rekeys scoped entries raw); the tree families keep vllm-0.34; the
    default profile makes the same store scoped again."""
    root = tmp_path / "root"
    spec = SynthSpec(**{**MC, "tp": 2})
    res = build(root, spec)
    build(root, SynthSpec(family="llmd", tp=2, blocks=2))
    m = tmp_path / "m.parquet"
    run("scan", root, "-o", m, "--target", "mooncake-0.3.11", "--model-dtype", "bfloat16")
    from kvmigrate import manifest

    rows = manifest.read_table(m).to_pylist()
    profiles = {r["family"]: r["target_profile"] for r in rows if r["source_base"] and r["target_profile"]}
    assert profiles["mooncake"] == "mooncake-0.3.11" and profiles["llmd"] == "vllm-0.34"
    assert {r["action"] for r in rows if r["object_index"] is not None} == {"rekey"}
    code, out = run("migrate", root, "--target", "mooncake-0.3.11", "--engine-stopped", "--apply")
    assert code == 0, out
    started = R.start(root / "store")
    for blk in res.blocks:
        for o in blk["objects"]:
            assert R.read(root / "store", started, o["key"].encode(), scoped=False) == S.rank_value(
                spec, blk["hex"], o["rank"], o["pp"]), o["key"]
    code, out = run("migrate", root, "--engine-stopped", "--apply")  # back to 0.3.14: scoped again
    assert code == 0, out
    reads_every_target_key(res, spec)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_rollback_after_prune_puts_the_pruned_raw_entries_back_first(tmp_path, engine):
    """Between commands: a raw file-per-key store rekeyed, then `prune --migrated` takes the
    raw KVEntries (their scoped copies serve), then the migration is rolled back: the raw
    entries come back before the scoped ones go, so every value still reads (raw keys), and
    the store is byte for byte what it was."""
    root = tmp_path / "root"
    spec = SynthSpec(**{**MC, "mc_backend": "file_per_key", "mc_engine": engine, "tp": 2, "mc_scheme": "mc-raw"})
    res = build(root, spec)
    before = tree_digest(root)
    code, out = run("migrate", root, "--apply", "--engine-stopped")
    assert code == 0, out
    code, out = run("prune", root, "--apply", "--engine-stopped", "--quiet-period", "0")
    assert code == 0, out
    moved = [p for p in before if not (root / p).exists()]
    assert moved, "prune --migrated took no raw KVEntry"
    journal = next((root / ".kvmigrate" / "journals").glob("*.journal"))
    code, out = run("rollback", journal)
    assert code == 0, out
    assert tree_digest(root) == before
    for blk in res.blocks:
        for o in blk["objects"]:
            client = root / o["client_root"]
            got = R.read(client, R.start(client), o["key"].encode(), scoped=False)
            assert got == S.rank_value(spec, blk["hex"], o["rank"], o["pp"], o["half"] or "k")


@pytest.mark.parametrize("backend", ["bucket", "file_per_key"])
def test_reshard_prune_then_rollback_gives_back_the_original_store(tmp_path, backend):
    """Between commands: a reshard retires (or replaces) the writer's objects, `prune` takes
    what the target no longer reads (pairs of retired entries, superseded objects), then the
    migration is rolled back: every pruned file comes back first, then every original, so the
    store is byte for byte what the writer left and reads at its own TP."""
    root = tmp_path / "root"
    spec = SynthSpec(**{**MC, "mc_backend": backend, "tp": 2})
    res = build(root, spec)
    before = tree_digest(root)
    facts = reshard_facts(tmp_path, 4)
    code, out = run("migrate", root, "--facts", facts, "--apply")
    assert code == 0, out
    code, out = run("prune", root, "--facts", facts, "--apply", "--quiet-period", "0")
    assert code in (0, 1), out
    reads_at_target_tp(root, res, spec, 4)
    journal = next((root / ".kvmigrate" / "journals").glob("*.journal"))
    code, out = run("rollback", journal)
    assert code == 0, out
    assert tree_digest(root) == before
    reads_at_target_tp(root, res, spec, 2)


DEST_CASES = [(b, e, s, t) for b in ("bucket", "file_per_key") for e in ("vllm", "sglang")
              for s, t in (("mc-raw", None), ("mc-scoped", None), ("mc-scoped", 4))]


@pytest.mark.parametrize("backend,engine,scheme,target_tp", DEST_CASES)
def test_migrate_into_dest_holds_exactly_what_the_target_reads(tmp_path, backend, engine, scheme, target_tp):
    """§3.6 `--dest DIR`: DIR/<store> then holds what the target reads (a rekeyed or read-in-
    place pair whole, its .bucket linked; KVEntries linked or written; reshard outputs),
    and nothing under ROOT changes, so no proof that the clients are stopped is needed; a
    rescan of DIR finds everything in place; verify; rollback empties DIR again."""
    root, dest = tmp_path / "root", tmp_path / "dest"
    dest.mkdir()
    spec = SynthSpec(**{**MC, "mc_backend": backend, "mc_engine": engine, "tp": 2, "mc_scheme": scheme,
                        "defects": ("orphan_data",) if backend == "bucket" else ("tmp_leftover",)})
    res = build(root, spec)
    before = tree_digest(root)
    facts = reshard_facts(tmp_path, target_tp) if target_tp else None
    extra = ["--facts", facts] if facts else []
    code, out = run("migrate", root, "--dest", dest, *extra, "--apply")
    assert code == 0, out
    assert tree_digest(root) == before
    touched = {h for d in res.defects for h in d.get("blocks") or ()}
    if target_tp:
        reads_at_target_tp(dest, res, spec, target_tp, touched)
    else:
        for blk in res.blocks:
            if blk["hex"] in touched:
                continue
            for o in blk["objects"]:
                client = dest / o["client_root"]
                got = R.read(client, R.start(client), M.scoped(o["key"]))
                assert got == S.rank_value(spec, blk["hex"], o["rank"], o["pp"], o["half"] or "k"), o["key"]
    for c in {o["client_root"] for b in res.blocks for o in b["objects"]}:
        started = R.start(dest / c)
        assert not started.deleted and not started.refused, (started.deleted, started.refused)
    code, out = run("migrate", dest, *extra)
    assert "Mooncake store" not in out, out  # (nothing left to place in DIR)
    journal = next((root / ".kvmigrate" / "journals").glob("*.journal"))
    code, out = run("verify", dest, "--journal", journal)
    assert code == 0, out
    code, out = run("rollback", journal)
    assert code == 0, out
    assert tree_digest(root) == before
    assert not [p for p in dest.rglob("*") if p.is_file() and ".kvmigrate" not in p.parts]


def test_rollback_after_a_purge_refuses_and_names_the_store_deployment_to_keep(tmp_path):
    """migrate, prune --migrated, purge, rollback: the raw entries are gone for good, so the
    rollback refuses (exit 8, nothing removed) and its hint names what to keep (the hint
    read "keep :" for a store's work, which has no target folder)."""
    root = tmp_path / "root"
    synth(root, mc_backend="file_per_key", mc_engine="sglang", tp=2, mc_scheme="mc-raw")
    assert run("migrate", root, "--apply", "--engine-stopped")[0] == 0
    assert run("prune", root, "--apply", "--engine-stopped", "--quiet-period", "0")[0] == 0
    assert run("prune", root, "--purge", "--older-than", "0s", "--apply")[0] == 0
    before = tree_digest(root)
    journal = next((root / ".kvmigrate" / "journals").glob("*.journal"))
    code, out = run("rollback", journal)
    assert code == 8 and "hint: keep mooncake:store:sglang:" in out, out
    assert tree_digest(root) == before
