"""`kvmigrate prune` on Mooncake stores (spec mooncake.md §6, §5.1): each class on stores
built by `kvmigrate synth --family mooncake` (both backends), judged by the reference reader
(tests/helpers/mooncake_reader.py): after `prune --apply` a client starting on each client
root deletes nothing and refuses nothing the residue caused; the container rule (a live
pair whole or not at all, `.meta` first, its `.bucket` restored first); `--tails` retires
short entries by an index rewrite; restore gives back the exact bytes; the proofs that no
client runs; `--migrated` after a migration; kill -9 then a rerun or a restore.

The stores are backdated (two hours ago) to pass the quiet period, as a store looks once
its clients stopped writing."""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvmigrate import manifest as mf
from kvmigrate.formats import mooncake as M
from kvmigrate.synth import SynthSpec, build
from kvmigrate.synth import mooncake as S

from helpers import mooncake_reader as R
from helpers.cli_helpers import printed_apply, run, run_json

MC = dict(family="mooncake", layers=2, block_tokens=4, blocks=3)
STOPPED = "--engine-stopped"


def synth(root: Path, **kw):
    return build(root, SynthSpec(**{**MC, **kw}))


def backdate(root: Path, seconds: float = 7200) -> None:
    """Every file and folder of the root last written `seconds` ago."""
    old = time.time() - seconds
    for d, _, names in os.walk(root):
        for n in names:
            os.utime(os.path.join(d, n), (old, old), follow_symlinks=False)
    for d, _, _ in sorted(os.walk(root), key=lambda w: -w[0].count(os.sep)):
        os.utime(d, (old, old))


def files(root: Path) -> dict[str, str]:
    """relpath -> sha256 of every file outside .kvmigrate, but Mooncake's empty client lock
    (kvmigrate creates it where absent and leaves it, §5.1)."""
    out = {}
    for d, ds, names in os.walk(root):
        ds[:] = [x for x in ds if x != ".kvmigrate"]
        for n in names:
            p = Path(d) / n
            if n == M.LOCK_NAME and p.stat().st_size == 0:
                continue
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def clients(res) -> list[Path]:
    return sorted({res.root / o["client_root"] for b in res.blocks for o in b["objects"]})


def starts_clean(res) -> None:
    """A client starting on each client root deletes nothing and does not refuse to start."""
    for client in clients(res):
        got = R.start(client)
        assert got.deleted == [] and got.refused is None, (client, got.deleted, got.refused)


def rows(tmp_path: Path, root: Path) -> list[dict]:
    out = tmp_path / f"m-{time.monotonic_ns()}.parquet"
    rc, text = run("scan", root, "--verify", "hash", "-o", out, "-q")
    assert rc in (0, 1, 5), text
    return [r for r in mf.read_table(out).to_pylist() if r["family"] == "mooncake"]


def reads_main_blocks(res, spec: SynthSpec, raw: bool = False) -> None:
    """Every object of the main blocks reads its writer's bytes at its scoped key."""
    starts: dict[str, R.StartResult] = {}
    for blk in res.blocks:
        if blk["defect"] is not None:
            continue
        for o in blk["objects"]:
            client = res.root / o["client_root"]
            started = starts.setdefault(o["client_root"], R.start(client))
            got = R.read(client, started, M.scoped(o["key"]))
            assert got == S.rank_value(spec, blk["hex"], o["rank"], o["pp"], o["half"] or "k"), o["key"]


# --- residue -------------------------------------------------------------------------------

RESIDUE = [("bucket", "vllm", "orphan_data"), ("bucket", "vllm", "orphan_index"),
           ("bucket", "vllm", "corrupt_sidecar"), ("bucket", "vllm", "misfiled"), ("bucket", "vllm", "nested_bucket"),
           ("bucket", "sglang", "orphan_data"), ("file_per_key", "vllm", "short"),
           ("file_per_key", "vllm", "header_invalid"), ("file_per_key", "vllm", "tmp_leftover"),
           ("file_per_key", "vllm", "zero_filled"), ("file_per_key", "sglang", "header_invalid")]


@pytest.mark.parametrize(("backend", "engine", "defect"), RESIDUE, ids=["-".join(c) for c in RESIDUE])
def test_residue_takes_each_defect_and_the_next_start_deletes_and_refuses_nothing(tmp_path, backend, engine, defect):
    root = tmp_path / "root"
    spec = SynthSpec(**{**MC, "mc_backend": backend, "mc_engine": engine, "tp": 2, "defects": (defect,)})
    res = build(root, spec)
    backdate(root)
    before = files(root)
    (d,) = res.defects
    want = set(d["statuses"])
    code, plan = run_json("prune", root, "--residue")
    assert code == 1 and plan["skipped"] == {} and plan["files"] == len(want), plan
    code, done = run_json("prune", root, "--residue", "--apply", STOPPED)
    assert code == 0 and done["moved"] == {"residue": len(want)}, done
    after = files(root)
    assert set(before) - set(after) == want
    assert all(after[k] == v for k, v in before.items() if k in after)
    starts_clean(res)
    reads_main_blocks(res, spec)
    for client in clients(res):
        assert client.is_dir()  # a client root folder is never removed
    assert all(p.name.endswith(".kvmq") for p in (root / done["quarantine"]).rglob("*") if p.is_file())
    assert not {r["status"] for r in rows(tmp_path, root)} & {defect, d["status"], "orphan_data", "corrupt_sidecar"}
    code, out = run("restore", done["journal"])
    assert code == 0, out
    assert files(root) == before


def test_residue_never_takes_an_entry_of_a_live_pair_nor_a_misfiled_kventry(tmp_path):
    """A short record of a live pair is the pair's (only --tails retires it); a misfiled
    KVEntry is migrate's to relink."""
    for backend, defect in (("bucket", "short"), ("file_per_key", "misfiled")):
        root = tmp_path / backend
        synth(root, mc_backend=backend, defects=(defect,))
        backdate(root)
        before = files(root)
        code, plan = run_json("prune", root, "--residue")
        assert code == 0 and plan["files"] == 0 and plan["rewritten"] == 0, plan
        code, done = run_json("prune", root, "--residue", "--apply", STOPPED)
        assert code == 0 and done["moved"] == {}, done
        assert files(root) == before


def test_audit_counts_what_prune_of_each_class_takes_from_a_store(tmp_path):
    """The reports' reclaimable figures are prune's own selection: an index without its
    bucket, all that is left of a store, counts; so does a pair whose one entry is cut (--tails)."""
    for defect, cls, n in (("orphan_index", "residue", 1), ("short", "tails", 2)):
        root = tmp_path / defect
        res = synth(root, mc_bucket_keys=1, defects=(defect,))
        if defect == "orphan_index":  # the clients evicted every live pair since
            for rel in set(files(root)) - set(res.defects[0]["statuses"]):
                os.unlink(root / rel)
        backdate(root)
        code, s = run_json("audit", root)
        figures = s["reclaimable"]["classes"]
        code, plan = run_json("prune", root, f"--{cls}")
        assert figures[cls] == plan["totals"][cls] and figures[cls]["files"] == n, (cls, figures, plan["totals"])


def test_young_tmp_leftovers_wait_for_older_than(tmp_path):
    root = tmp_path / "root"
    res = synth(root, mc_backend="file_per_key", defects=("tmp_leftover",))
    backdate(root)
    (rel,) = res.defects[0]["statuses"]
    young = time.time() - 1800  # 30 min: the store is quiet, the temp younger than 1 h
    os.utime(root / rel, (young, young))
    code, plan = run_json("prune", root, "--residue")
    assert code == 0 and plan["files"] == 0 and plan["skipped"] == {}, plan
    code, plan = run_json("prune", root, "--residue", "--older-than", "20m")
    assert code == 1 and plan["files"] == 1, plan


def test_a_store_at_root_keeps_its_quarantine_out_of_the_start_s_reach(tmp_path):
    """ROOT is itself the client root: the quarantine is below it, and a start deletes any
    `.bucket` below its root without a top-level `.meta`; the quarantined names end in
    `.kvmq`, so the start deletes nothing."""
    root = tmp_path / "root"
    spec = SynthSpec(**{**MC, "mc_store": ".", "defects": ("orphan_data", "corrupt_sidecar", "nested_bucket")})
    res = build(root, spec)
    backdate(root)
    before = files(root)
    assert R.start(root).deleted
    code, done = run_json("prune", root, "--residue", "--apply", STOPPED)
    assert code == 0 and done["moved"] == {"residue": 6}, done
    got = R.start(root)
    assert got.deleted == [] and got.refused is None, got.deleted
    assert list((root / done["quarantine"]).rglob("*.bucket.kvmq"))
    reads_main_blocks(res, spec)
    code, out = run("restore", done["journal"])
    assert code == 0 and files(root) == before, out


def test_a_store_written_within_the_quiet_period_is_skipped_whole(tmp_path):
    root = tmp_path / "root"
    res = synth(root, mc_backend="file_per_key", defects=("header_invalid",))
    backdate(root)
    (rel,) = res.defects[0]["statuses"]
    leaf = (root / rel).parent
    os.utime(leaf, None)  # a client just wrote a KVEntry into this hash folder
    code, plan = run_json("prune", root, "--residue")
    assert code == 0 and plan["files"] == 0, plan
    assert list(plan["skipped"]) == ["mooncake:store"] and "quiet period" in plan["skipped"]["mooncake:store"]
    code, plan = run_json("prune", root, "--residue", "--force-live")
    assert code == 1 and plan["files"] == 1, plan
    bucket = tmp_path / "bucket"
    res = synth(bucket, defects=("orphan_index",))
    backdate(bucket)
    code, plan = run_json("prune", bucket, "--residue")
    assert code == 1 and plan["skipped"] == {}, plan
    live = next(p for p in (bucket / "store").iterdir() if p.name.endswith(M.META_SUFFIX)
                and p.name != Path(res.defects[0]["relpath"]).name)
    os.utime(live, None)  # a client just wrote a pair
    code, plan = run_json("prune", bucket, "--residue")
    assert code == 0 and plan["files"] == 0 and list(plan["skipped"]) == ["mooncake:store"], plan


# --- tails ---------------------------------------------------------------------------------


def test_tails_retires_a_short_entry_and_keeps_its_pair(tmp_path):
    root = tmp_path / "root"
    spec = SynthSpec(**{**MC, "defects": ("short",)})
    res = build(root, spec)
    backdate(root)
    before = files(root)
    (d,) = res.defects
    (cut,) = [bytes(k, "utf-8", "surrogateescape") for k in d["read_fails"]]
    client = root / d["client_root"]
    assert cut in R.start(client).entries  # is_exist claims it; no read serves it
    code, plan = run_json("prune", root, "--tails")
    assert code == 1 and plan["files"] == 0 and plan["rewritten"] == 1 and plan["objects"] == {"tails": 1}, plan
    (entry,) = plan["namespaces"]
    assert entry["class"] == "tails" and entry["namespace"] == "mooncake:store", entry
    assert (entry["files"], entry["objects"], entry["rewritten"]) == (0, 1, 1), entry
    code, done = run_json("prune", root, "--tails", "--apply", STOPPED)
    assert code == 0 and done["moved"] == {} and done["rewritten"] == 1 and done["objects"] == {"tails": 1}, done
    after = files(root)
    changed = {k for k in before if after.get(k) != before[k]}
    assert changed == {d["relpath"]} and d["relpath"].endswith(M.META_SUFFIX)  # the index only, no bucket
    got = R.start(client)
    assert got.deleted == [] and cut not in got.entries
    assert any(M.parse_retired_key(M.parse_storage_key(k).engine) for k in got.entries)
    reads_main_blocks(res, spec)
    for blk in res.blocks:  # the pair's other entries still read their bytes
        for o in blk["objects"]:
            if M.scoped(o["key"]) != cut and blk["defect"] == "short":
                assert R.read(client, got, M.scoped(o["key"])) == S.rank_value(spec, blk["hex"], o["rank"], o["pp"],
                                                                                o["half"] or "k")
    backdate(root)
    code, plan = run_json("prune", root, "--tails")  # a retired key is never retired again
    assert code == 0 and plan["rewritten"] == 0 and plan["skipped"] == {}, plan
    code, out = run("restore", done["journal"])
    assert code == 0 and files(root) == before, out
    assert cut in R.start(client).entries
    assert not (client / ".kvmigrate.lock").exists() and not (client / ".kvmigrate-stage").exists()


def test_tails_moves_a_pair_with_no_readable_entry_whole_meta_first(tmp_path, monkeypatch):
    root = tmp_path / "root"
    res = synth(root, mc_bucket_keys=1, defects=("short",))
    backdate(root)
    before = files(root)
    meta = res.defects[0]["relpath"]
    bucket = meta[: -len(M.META_SUFFIX)] + M.BUCKET_SUFFIX
    code, plan = run_json("prune", root, "--tails")
    assert [(e["class"], e["files"], e.get("objects"), e.get("rewritten")) for e in plan["namespaces"]] == \
        [("tails", 2, 1, 0)], plan
    code, done = run_json("prune", root, "--tails", "--apply", STOPPED)
    assert code == 0 and done["moved"] == {"tails": 2} and done["rewritten"] == 0, done
    assert done["objects"] == {"tails": 1}, done
    assert set(before) - set(files(root)) == {bucket, meta}
    starts_clean(res)
    from kvmigrate.migrate.quarantine import load_prune_runs

    (prune_run,) = load_prune_runs(done["journal"])
    assert list(prune_run.moves) == [meta, bucket]
    linked: list[str] = []
    real_link = os.link

    def link(src, dst, **kw):
        linked.append(dst)
        return real_link(src, dst, **kw)

    monkeypatch.setattr(os, "link", link)
    code, out = run("restore", done["journal"])
    monkeypatch.undo()
    assert code == 0, out
    assert [n for n in linked if n.endswith((M.META_SUFFIX, M.BUCKET_SUFFIX))] == [Path(bucket).name,
                                                                                    Path(meta).name]
    assert files(root) == before


# --- migrated ------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_migrated_takes_the_raw_kventries_after_a_migration(tmp_path, engine):
    root = tmp_path / "root"
    spec = SynthSpec(**{**MC, "mc_backend": "file_per_key", "mc_scheme": "mc-raw", "mc_engine": engine, "tp": 2})
    res = build(root, spec)
    raw = set(files(root))
    code, out = run("migrate", root, "--apply", STOPPED)
    assert code == 0, out
    backdate(root)
    before = files(root)
    code, done = run_json("prune", root, "--apply", STOPPED)
    assert code == 0 and done["moved"] == {"migrated": len(raw)}, done
    assert set(before) - set(files(root)) == raw
    assert done["objects"] == {"migrated": len(raw)}
    starts_clean(res)
    reads_main_blocks(res, spec)
    assert {r["status"] for r in rows(tmp_path, root)} == {"ok"}
    code, out = run("restore", done["journal"])
    assert code == 0 and files(root) == before, out


def test_migrated_keeps_a_raw_kventry_whose_scoped_entry_changed_since_the_scan(tmp_path):
    """A raw KVEntry goes only while the entry that serves its key is the one the scan saw:
    never the last copy."""
    root = tmp_path / "root"
    synth(root, mc_backend="file_per_key", mc_scheme="mc-raw")
    raw = sorted(files(root))
    code, out = run("migrate", root, "--apply", STOPPED)
    assert code == 0, out
    backdate(root)
    m = tmp_path / "m.parquet"
    rc, text = run("scan", root, "--verify", "hash", "-o", m, "-q")
    assert rc == 0, text
    by_rel = {r["relpath"]: r for r in mf.read_table(m).to_pylist()}
    victim = by_rel[raw[0]]["target_relpath"]
    assert victim not in raw and (root / victim).is_file()
    os.unlink(root / victim)  # evicted since the scan (its folder now new: --force-live)
    code, done = run_json("prune", "--manifest", m, "--apply", "--force-live", STOPPED)
    assert code == 0 and done["moved"] == {"migrated": len(raw) - 1}, done
    assert (root / raw[0]).is_file() and any(raw[0] in k and "target" in k for k in done["kept"]), done["kept"]


def test_migrated_takes_a_relinked_misfiled_kventry_and_nothing_of_a_rekeyed_pair(tmp_path):
    root = tmp_path / "fpk"
    res = synth(root, mc_backend="file_per_key", defects=("misfiled",))
    (rel,) = res.defects[0]["statuses"]
    code, out = run("migrate", root, "--apply", STOPPED)
    assert code in (0, 4), out  # (4: the misfiled KVEntry is an integrity finding of the scan)
    backdate(root)
    code, done = run_json("prune", root, "--apply", STOPPED)
    assert code == 0 and done["moved"] == {"migrated": 1} and not (root / rel).exists(), done
    starts_clean(res)
    bucket = tmp_path / "bucket"
    synth(bucket, mc_scheme="mc-raw")
    code, out = run("migrate", bucket, "--apply", STOPPED)
    assert code == 0, out
    backdate(bucket)
    before = files(bucket)
    code, done = run_json("prune", bucket, "--migrated", "--residue", "--tails", "--apply", STOPPED)
    assert code == 0 and done["moved"] == {} and files(bucket) == before, done


def test_purge_deletes_a_store_quarantine_and_restore_then_says_so(tmp_path):
    root = tmp_path / "root"
    res = synth(root, defects=("orphan_data", "nested_bucket"))
    backdate(root)
    code, done = run_json("prune", root, "--residue", "--apply", STOPPED)
    assert code == 0 and done["moved"] == {"residue": 2}, done
    code, purged = run_json("prune", root, "--purge", "--older-than", "0s", "--apply")
    assert code == 0 and purged["files"] == 2, purged
    assert not (root / done["quarantine"]).exists()
    starts_clean(res)
    code, out = run("restore", done["journal"])
    assert code == 8 and "purged with the quarantine" in out, out


def test_unreadable_namespaces_takes_a_stale_deployment_s_pairs_whole(tmp_path):
    """Two deployments in one store, each in pairs of its own; one is `stale_hash_recipe`
    (the status a scan gives a key no target computes: set in the manifest here, as the
    scan gives no Mooncake object it yet): its pairs go whole, the other's stay and read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "root"
    stale = SynthSpec(**{**MC, "model_name": "org/Old-Model", "seed": 1})
    kept = SynthSpec(**MC)
    res_kept, res_stale = build(root, kept), build(tmp_path / "other", stale)  # (one build per store)
    for rel in files_of(res_stale):
        assert not (root / rel).exists()
        (root / rel).write_bytes((tmp_path / "other" / rel).read_bytes())
    backdate(root)
    before = files(root)
    m = tmp_path / "m.parquet"
    rc, text = run("scan", root, "--verify", "hash", "-o", m, "-q")
    assert rc in (0, 1), text
    t = pq.read_table(m)
    src = t.column("source_base").cast(pa.string()).to_pylist()
    label = next(ns for ns in src if ns and ":Old-Model:" in ns)
    status = [("stale_hash_recipe" if ns == label else s) for ns, s in zip(src, t.column("status").to_pylist())]
    t = t.set_column(t.schema.get_field_index("status"), "status",
                     pa.array(status, pa.string()).dictionary_encode())
    pq.write_table(t, m)
    stale_files = files_of(res_stale)
    assert stale_files and not stale_files & files_of(res_kept) and stale_files | files_of(res_kept) == set(before)
    code, plan = run_json("prune", "--manifest", m, "--unreadable-namespaces")
    assert code == 1 and plan["files"] == len(stale_files), (plan, stale_files)
    code, done = run_json("prune", "--manifest", m, "--unreadable-namespaces", "--apply", STOPPED)
    assert code == 0 and done["moved"] == {"unreadable_namespaces": len(stale_files)}, done
    assert set(before) - set(files(root)) == stale_files
    starts_clean(res_kept)
    reads_main_blocks(res_kept, kept)
    code, out = run("restore", done["journal"])
    assert code == 0 and files(root) == before, out


def files_of(res) -> set[str]:
    """The pair files (or KVEntries) a synth build wrote for its objects."""
    out = set()
    for b in res.blocks:
        for o in b["objects"]:
            out.add(o["relpath"])
            if o.get("bucket"):
                out.add(o["bucket"])
    return out


# --- the proofs (§5.1) ---------------------------------------------------------------------


@pytest.mark.parametrize(("backend", "defect", "facts"), [("bucket", "orphan_data", ()),
                                                          ("file_per_key", "header_invalid", ()),
                                                          ("file_per_key", "header_invalid",
                                                           ("--writer-release", "0.3.14"))])
def test_without_a_proof_prune_exits_2_naming_the_store_and_moves_nothing(tmp_path, backend, defect, facts):
    """No engine_stopped and no client lock to hold (a file-per-key client root has none,
    whatever the release): exit 2, nothing written, not even the journal."""
    root = tmp_path / "root"
    synth(root, mc_backend=backend, defects=(defect,))
    backdate(root)
    before = files(root)
    code, out = run("prune", root, "--residue", *facts)  # the dry run says which proof the apply needs
    assert code == 1 and "the apply needs a proof that no Mooncake client uses it" in out, out
    code, out = run("prune", root, "--residue", "--apply", *facts)
    assert code == 2, out
    assert "Mooncake store store" in out and "--engine-stopped" in out
    assert files(root) == before and not (root / ".kvmigrate").exists()


@pytest.mark.parametrize(("backend", "defect"), [("bucket", "orphan_data"), ("file_per_key", "header_invalid")])
def test_the_dry_run_s_apply_command_states_the_stop_it_needs_and_runs_as_printed(tmp_path, backend, defect):
    """Without a proof, the printed command carries --engine-stopped and says what must be
    true first; run as printed, it moves what the dry run said. With the proof stated, it
    is the command as given."""
    root = tmp_path / "root"
    synth(root, mc_backend=backend, defects=(defect,))
    backdate(root)
    code, out = run("prune", root, "--residue")
    label, args = printed_apply(out)
    assert code == 1 and "once no engine uses Mooncake store store" in label and STOPPED in args, out
    code, plan = run_json("prune", root, "--residue")
    assert plan["apply_command"] == "kvmigrate " + " ".join(args)
    code, done = run_json(*args)
    assert code == 0 and done["moved"] == {"residue": plan["files"]} and plan["files"] > 0, done
    other = tmp_path / "other"
    synth(other, mc_backend=backend, defects=(defect,))
    backdate(other)
    label, args = printed_apply(run("prune", other, "--residue", STOPPED)[1])
    assert label == "to apply:" and args.count(STOPPED) == 1


def test_a_held_client_lock_exits_8_and_a_free_one_is_the_proof(tmp_path):
    root = tmp_path / "root"
    res = synth(root, defects=("orphan_data", "client_lock"))
    backdate(root)
    before = files(root)
    lock = root / res.defects[1]["relpath"]
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a running 0.3.14 client
        code, out = run("prune", root, "--residue", "--apply", "--writer-release", "0.3.14")
        assert code == 8, out
        assert files(root) == before and not (root / ".kvmigrate").exists()
    finally:
        os.close(fd)
    code, done = run_json("prune", root, "--residue", "--apply", "--writer-release", "0.3.14")
    assert code == 0 and done["moved"] == {"residue": 1}, done
    starts_clean(res)


def test_restore_waits_for_a_held_client_lock(tmp_path):
    root = tmp_path / "root"
    res = synth(root, defects=("orphan_index", "client_lock"))
    backdate(root)
    before = files(root)
    code, done = run_json("prune", root, "--residue", "--apply", STOPPED)
    assert code == 0, done
    fd = os.open(root / res.defects[1]["relpath"], os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code, out = run("restore", done["journal"])
        assert code == 8 and files(root) != before, out
    finally:
        os.close(fd)
    code, out = run("restore", done["journal"])
    assert code == 0 and files(root) == before, out


# --- kill -9 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("point", ["prune_move:3", "prune_retire:1", "prune_intent:1"])
def test_a_killed_store_prune_is_finished_by_a_rerun_and_restored_exactly(tmp_path, point):
    from kvmigrate.migrate.crash import CRASH_ENV

    root = tmp_path / "root"
    spec = SynthSpec(**{**MC, "defects": ("orphan_data", "orphan_index", "corrupt_sidecar", "nested_bucket", "short")})
    res = build(root, spec)
    backdate(root)
    before = files(root)
    exe = str(Path(sys.executable).with_name("kvmigrate"))
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    args = [exe, "prune", str(root), "--residue", "--tails", "--apply", STOPPED]
    killed = subprocess.run(args, capture_output=True, text=True, env={**env, CRASH_ENV: point}, timeout=300)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert list(root.rglob(".kvmigrate.lock"))  # kvmigrate's own lock of the client root it writes
    again = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "finished the interrupted prune run" in again.stdout
    assert not list(root.rglob(".kvmigrate.lock")) and not list(root.rglob(".kvmigrate-stage"))
    starts_clean(res)
    cut = {k.encode("utf-8", "surrogateescape") for k in res.defects[-1]["read_fails"]}
    for client in clients(res):
        assert not cut & set(R.start(client).entries)  # the short entry's key is retired
    assert set(before) - set(files(root)) == {rel for d in res.defects[:4] for rel in d["statuses"]}
    code, out = run("restore", root / ".kvmigrate" / "journals" / "prune")
    assert code == 0, out
    assert files(root) == before
