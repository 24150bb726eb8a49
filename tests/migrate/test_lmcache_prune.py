"""`kvmigrate prune` on LMCache tiers (spec lmcache.md §6, migration.md §6): each class on
trees built by `kvmigrate synth --family lmcache`, GDS pairs moved together and restored
byte for byte, the per-tier quiet period, `--index-lost` with and without the statement
that no engine uses the tier, targets never taken, purge, and prune -> restore -> rescan.

The trees are backdated (`os.utime`, two hours ago) to pass the quiet period, as an
engine's tier would look once it stopped writing."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from kvmigrate import manifest as mf
from kvmigrate.synth import SynthSpec, build

from helpers.cli_helpers import run, run_json

LMC = dict(family="lmcache", layers=2, block_tokens=4, blocks=8)
SIDECAR = ".metadata"
# (backend, defect) of every residue defect synth makes
RESIDUE = [("gds", "zero_filled"), ("gds", "short"), ("gds", "misfiled"), ("gds", "orphan_data"),
           ("gds", "corrupt_sidecar"), ("gds", "tmp"), ("fs", "tmp"), ("fs", "zero_filled"), ("fs", "short"),
           ("local_disk", "zero_filled"), ("local_disk", "short"), ("mp", "tmp"), ("mp", "short")]


def synth(root: Path, **kw):
    era = "lmc-mp1" if kw.get("lmc_backend") == "mp" else "lmc-k3"
    return build(root, SynthSpec(**{**LMC, "lmc_era": era, **kw}))


def backdate(root: Path, seconds: float = 7200) -> None:
    """Every file and folder of the root last written `seconds` ago."""
    old = time.time() - seconds
    for d, _, names in os.walk(root):
        for n in names:
            os.utime(os.path.join(d, n), (old, old), follow_symlinks=False)
    for d, _, _ in sorted(os.walk(root), key=lambda w: -w[0].count(os.sep)):
        os.utime(d, (old, old))


def files(root: Path) -> dict[str, str]:
    """relpath -> sha256 of every file outside .kvmigrate."""
    out = {}
    for d, ds, names in os.walk(root):
        ds[:] = [x for x in ds if x != ".kvmigrate"]
        for n in names:
            p = Path(d) / n
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def folders(root: Path) -> set[str]:
    out = set()
    for d, ds, _ in os.walk(root):
        ds[:] = [x for x in ds if x != ".kvmigrate"]
        out |= {str((Path(d) / x).relative_to(root)) for x in ds}
    return out


def statuses(tmp_path: Path, root: Path, *flags: str) -> dict[str, str]:
    out = tmp_path / f"m-{time.monotonic_ns()}.parquet"
    rc, text = run("scan", root, "--verify", "hash", "-o", out, "-q", *flags)
    assert rc in (0, 1, 5), text
    return {r["relpath"]: r["status"] for r in mf.read_table(out).to_pylist() if r["family"] == "lmcache"}


def partner(rel: str) -> str:
    return rel[:-len(SIDECAR)] if rel.endswith(SIDECAR) else rel + SIDECAR


def expected_taken(root: Path, defect: dict) -> set[str]:
    """A defect's files, with the GDS partner of each (a pair moves together)."""
    out = set(defect["statuses"])
    for rel in list(out):
        if rel.endswith((".kvcache.safetensors", SIDECAR)) and (root / partner(rel)).exists():
            out.add(partner(rel))
    return out


# --- residue -------------------------------------------------------------------------------


@pytest.mark.parametrize(("backend", "defect"), RESIDUE, ids=[f"{b}-{d}" for b, d in RESIDUE])
def test_residue_takes_each_defect_of_a_quiet_tier_with_its_gds_partner(tmp_path, backend, defect):
    root = tmp_path / "root"
    res = synth(root, lmc_backend=backend, tp=2, defects=(defect,))
    backdate(root)
    before = files(root)
    (d,) = res.defects
    want = expected_taken(root, d)
    code, plan = run_json("prune", root, "--residue")
    assert code == 1 and plan["skipped"] == {}, plan
    assert plan["files"] == len(want) == plan["totals"]["residue"]["files"], (plan, want)
    code, done = run_json("prune", root, "--residue", "--apply")
    assert code == 0 and done["moved"] == {"residue": len(want)}, done
    after = files(root)
    assert set(before) - set(after) == want
    assert all(after[k] == v for k, v in before.items() if k in after)
    assert (root / "cache").is_dir()  # the tier folder itself is never removed
    assert not set(statuses(tmp_path, root).values()) & {"zero_filled", "short", "misfiled", "orphan_data",
                                                          "corrupt_sidecar", "tmp_leftover"}


def test_young_tmp_files_wait_for_older_than(tmp_path):
    root = tmp_path / "root"
    res = synth(root, lmc_backend="fs", defects=("tmp",))
    backdate(root)
    tmp = [root / rel for rel in res.defects[0]["statuses"]]
    young = time.time() - 1800  # 30 min: the tier is quiet, the temp files younger than 1 h
    for p in tmp:
        os.utime(p, (young, young))
    code, plan = run_json("prune", root, "--residue")
    assert code == 0 and plan["files"] == 0 and plan["skipped"] == {}, plan
    code, plan = run_json("prune", root, "--residue", "--older-than", "20m")
    assert code == 1 and plan["files"] == len(tmp), plan


def test_the_tmp_dir_folder_stays_when_its_temp_files_go(tmp_path):
    from kvmigrate.synth.lmcache import TMP_DIR

    root = tmp_path / "root"
    res = synth(root, lmc_backend="fs", defects=("tmp_dir",))
    backdate(root)
    temps = set(res.defects[0]["statuses"])
    code, done = run_json("prune", root, "--residue", "--tmp-dir", TMP_DIR, "--apply")
    assert code == 0 and done["moved"] == {"residue": len(temps)}, done
    assert not temps & set(files(root)) and (root / "cache" / TMP_DIR).is_dir()


def test_a_gds_pair_moves_sidecar_first_and_restores_data_first_exactly(tmp_path, monkeypatch):
    root = tmp_path / "root"
    synth(root, lmc_backend="gds", tp=2, lmc_tier=".",
          defects=("zero_filled", "short", "misfiled", "orphan_data", "corrupt_sidecar", "tmp"))
    backdate(root)
    before, dirs = files(root), folders(root)
    code, done = run_json("prune", root, "--residue", "--apply")
    assert code == 0 and done["dirs_removed"] > 0, done
    after = files(root)
    gone = set(before) - set(after)
    for rel in before:  # a pair is there or gone whole
        if rel.endswith(".kvcache.safetensors") and partner(rel) in before:
            assert (rel in gone) == (partner(rel) in gone), rel
    for d in dirs - folders(root):  # only emptied GDS <2>/<2> folders went
        assert not any(k.startswith(d + "/") for k in after), d
    from kvmigrate.migrate.quarantine import load_prune_runs

    (prune_run,) = load_prune_runs(done["journal"])
    moves = list(prune_run.moves)
    for rel in moves:
        if rel.endswith(SIDECAR) and partner(rel) in moves:
            assert moves.index(rel) < moves.index(partner(rel)), rel
    linked: list[str] = []
    real_link = os.link

    def link(src, dst, **kw):
        linked.append(dst)
        return real_link(src, dst, **kw)

    monkeypatch.setattr(os, "link", link)
    code, out = run("restore", done["journal"])
    monkeypatch.undo()
    assert code == 0, out
    for name in linked:
        if name.endswith(SIDECAR) and name[:-len(SIDECAR)] in linked:
            assert linked.index(name[:-len(SIDECAR)]) < linked.index(name), name
    assert files(root) == before and folders(root) == dirs


def test_a_pair_whose_partner_is_a_target_stays_whole(tmp_path):
    """A data file named as a target (a row's target_relpath): neither it nor its corrupt
    sidecar moves."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "root"
    res = synth(root, lmc_backend="gds", defects=("corrupt_sidecar",))
    backdate(root)
    side = next(r for r, s in res.defects[0]["statuses"].items() if s == "corrupt_sidecar")
    m = tmp_path / "m.parquet"
    assert run("scan", root, "--verify", "hash", "-o", m, "-q")[0] == 5
    code, plan = run_json("prune", "--manifest", m, "--residue")
    assert code == 1 and plan["files"] == 2, plan  # the pair, while nothing names its data file
    t = pq.read_table(m)
    rel = t.column("relpath").to_pylist()
    other = next(i for i, r in enumerate(rel) if r.endswith(".kvcache.safetensors") and r != partner(side))
    tr = t.column("target_relpath").to_pylist()
    tr[other] = partner(side)  # as a planned action would name its target
    t = t.set_column(t.schema.get_field_index("target_relpath"), t.schema.field("target_relpath"),
                     pa.array(tr, t.schema.field("target_relpath").type))
    pq.write_table(t, m)
    code, plan = run_json("prune", "--manifest", m, "--residue")
    assert code == 0 and plan["files"] == 0, plan


# --- the quiet period, per tier ----------------------------------------------------------


def _two_deployment_tier(root: Path):
    gds = synth(root, lmc_backend="gds", lmc_tier="t", defects=("short",))
    fs = synth(root, lmc_backend="fs", lmc_tier="t", model_name="org/other", defects=("zero_filled",))
    quiet = synth(root, lmc_backend="fs", lmc_tier="q", defects=("zero_filled",))
    backdate(root)
    return gds, fs, quiet


def test_a_file_written_in_place_skips_its_whole_tier_named_with_its_newest_mtime(tmp_path):
    root = tmp_path / "root"
    gds, fs, quiet = _two_deployment_tier(root)
    chunk = root / next(iter(fs.blocks[1]["files"].values()))
    os.utime(chunk)  # the fs engine rewrote one chunk: the gds deployment's residue waits too
    code, plan = run_json("prune", root, "--residue")
    assert code == 1 and list(plan["skipped"]) == ["lmcache:t"], plan
    assert "newest mtime" in plan["skipped"]["lmcache:t"] and "--force-live" in plan["skipped"]["lmcache:t"]
    assert {n["namespace"].split(":")[1] for n in plan["namespaces"]} == {"q"}
    code, text = run("prune", root, "--residue")
    assert "skipped lmcache:t: tier written" in text
    code, plan = run_json("prune", root, "--residue", "--force-live")
    assert code == 1 and plan["skipped"] == {} and {n["namespace"].split(":")[1] for n in plan["namespaces"]} == \
        {"t", "q"}


def test_a_new_chunk_in_a_gds_folder_skips_the_tier(tmp_path):
    root = tmp_path / "root"
    gds, _, _ = _two_deployment_tier(root)
    rel = next(iter(gds.blocks[1]["files"].values()))
    new = (root / rel).with_name("fresh.kvcache.safetensors.tmp0A1B2C3D")
    new.write_bytes(b"x")
    old = time.time() - 7200
    os.utime(new, (old, old))  # only its folder's mtime says the engine wrote
    code, plan = run_json("prune", root, "--residue")
    assert list(plan["skipped"]) == ["lmcache:t"], plan


def test_report_names_the_live_tier_it_would_skip(tmp_path):
    root = tmp_path / "root"
    _two_deployment_tier(root)
    os.utime(root / "t")
    m = tmp_path / "m.parquet"
    assert run("scan", root, "-o", m, "-q")[0] == 5
    code, summary = run_json("report", m)
    r = summary["reclaimable"]
    assert [k["namespace"] for k in r["skipped"]] == ["lmcache:t"], r["skipped"]
    assert r["classes"]["residue"]["files"] > 0


# --- unreadable namespaces ---------------------------------------------------------------


def test_unreadable_namespaces_takes_a_stale_deployment_whole_and_keeps_its_tier(tmp_path):
    root = tmp_path / "root"
    old = synth(root, lmc_backend="fs", lmc_era="lmc-k2", lmc_tier="t")
    synth(root, lmc_backend="fs", lmc_tier="t", model_name="org/new")
    backdate(root)
    before = files(root)
    stale = {rel for b in old.blocks for rel in b["files"].values() if rel}
    code, plan = run_json("prune", root, "--unreadable-namespaces")
    assert code == 1 and [n["class"] for n in plan["namespaces"]] == ["unreadable_namespaces"], plan
    assert plan["files"] == len(stale)
    code, done = run_json("prune", root, "--unreadable-namespaces", "--apply")
    assert code == 0
    assert set(before) - set(files(root)) == stale and (root / "t").is_dir()


def test_unreadable_namespaces_takes_an_unreproducible_deployment_only_when_the_facts_say_so(tmp_path):
    root = tmp_path / "root"
    synth(root, lmc_backend="fs", lmc_tier="t")
    backdate(root)
    code, plan = run_json("prune", root, "--unreadable-namespaces")
    assert code == 0 and plan["files"] == 0, plan  # needs_fact: nothing is proven
    code, plan = run_json("prune", root, "--unreadable-namespaces", "--pythonhashseed", "unset",
                          "--writer-release", "0.5.6")
    assert code == 1 and plan["files"] == 8, plan


def test_unreadable_namespaces_never_takes_a_deployment_another_is_planned_into(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "root"
    synth(root, lmc_backend="fs", lmc_era="lmc-k2", lmc_tier="t")
    synth(root, lmc_backend="fs", lmc_tier="t", model_name="org/new")
    backdate(root)
    m = tmp_path / "m.parquet"
    assert run("scan", root, "--verify", "hash", "-o", m, "-q")[0] in (0, 1)
    code, plan = run_json("prune", "--manifest", m, "--unreadable-namespaces")
    assert code == 1 and plan["files"] == 8, plan  # while it is no target
    t = pq.read_table(m)
    src = t.column("source_base").to_pylist()
    stale = next(s for s in src if ":lmc-k2:" in s)
    tb = [stale if ":org/new:" in s else b for s, b in zip(src, t.column("target_base").to_pylist())]
    t = t.set_column(t.schema.get_field_index("target_base"), t.schema.field("target_base"),
                     pa.array(tb, t.schema.field("target_base").type))
    pq.write_table(t, m)
    code, plan = run_json("prune", "--manifest", m, "--unreadable-namespaces")
    assert code == 0 and plan["files"] == 0, plan


# --- index_lost ----------------------------------------------------------------------------


def _local_disk(root: Path, tier: str = "ld"):
    res = synth(root, lmc_backend="local_disk", lmc_tier=tier, tp=2)
    return {rel for b in res.blocks for rel in b["files"].values() if rel}


def test_index_lost_without_the_statement_takes_nothing_and_names_the_flag(tmp_path):
    root = tmp_path / "root"
    pt = _local_disk(root)
    backdate(root)
    code, plan = run_json("prune", root, "--index-lost")
    assert code == 0 and plan["files"] == 0, plan
    (why,) = plan["skipped"].values()
    assert f"{len(pt)} index_lost chunk files" in why and "--engine-stopped" in why and '"ld"' in why
    code, done = run_json("prune", root, "--index-lost", "--apply")
    assert code == 0 and done["journal"] is None and set(files(root)) == pt


def test_index_lost_with_engine_stopped_takes_every_chunk_and_restores_them(tmp_path):
    root = tmp_path / "root"
    pt = _local_disk(root)
    backdate(root)
    before = files(root)
    code, plan = run_json("prune", root, "--index-lost", "--engine-stopped")
    assert code == 1 and plan["totals"]["index_lost"]["files"] == len(pt) and plan["skipped"] == {}, plan
    code, done = run_json("prune", root, "--index-lost", "--engine-stopped", "--apply")
    assert code == 0 and done["moved"] == {"index_lost": len(pt)}, done
    assert files(root) == {} and (root / "ld").is_dir()
    assert run("restore", done["journal"])[0] == 0
    assert files(root) == before


def test_index_lost_by_the_engine_stopped_fact_per_tier(tmp_path):
    root = tmp_path / "root"
    stopped = _local_disk(root, "ld")
    running = _local_disk(root, "ld2")
    backdate(root)
    facts = tmp_path / "FACTS.json"
    facts.write_text(json.dumps({"ld": {"engine_stopped": True}}))
    code, plan = run_json("prune", root, "--index-lost", "--facts", facts)
    assert code == 1 and plan["files"] == len(stopped), plan
    assert [k.split(":")[1] for k in plan["skipped"]] == ["ld2"], plan
    code, done = run_json("prune", root, "--index-lost", "--facts", facts, "--apply")
    assert code == 0 and set(files(root)) == running


def test_a_tier_stated_running_is_not_taken_by_engine_stopped(tmp_path):
    root = tmp_path / "root"
    _local_disk(root)
    backdate(root)
    facts = tmp_path / "FACTS.json"
    facts.write_text(json.dumps({"ld": {"engine_stopped": False}}))
    code, plan = run_json("prune", root, "--index-lost", "--engine-stopped", "--facts", facts)
    assert code == 0 and plan["files"] == 0, plan
    assert "engine_stopped fact is false" in next(iter(plan["skipped"].values()))


def test_index_lost_needs_quiet_and_force_live_never_states_stopped(tmp_path):
    root = tmp_path / "root"
    pt = _local_disk(root)  # written just now
    code, plan = run_json("prune", root, "--index-lost", "--engine-stopped")
    assert code == 0 and plan["files"] == 0 and "newest mtime" in plan["skipped"]["lmcache:ld"], plan
    code, plan = run_json("prune", root, "--index-lost", "--force-live")
    assert code == 0 and plan["files"] == 0, plan
    code, plan = run_json("prune", root, "--index-lost", "--force-live", "--engine-stopped")
    assert code == 1 and plan["files"] == len(pt), plan


def test_report_makes_the_local_disk_leak_visible_as_reclaimable(tmp_path):
    root = tmp_path / "root"
    pt = _local_disk(root)
    backdate(root)
    m = tmp_path / "m.parquet"
    assert run("scan", root, "-o", m, "-q")[0] == 1
    code, text = run("report", m)
    assert "--index-lost" in text
    code, summary = run_json("report", m)
    assert summary["reclaimable"]["classes"]["index_lost"]["files"] == len(pt)


# --- --migrated, purge --------------------------------------------------------------------


def test_migrated_keeps_a_tier_file_whose_target_is_not_read_in_place(tmp_path):
    """--migrated takes a legacy name only when its target is a whole file the target reads in
    place (its own target): a row marked already_present at a tier file that waits for its facts
    (needs_fact, no target of its own) stays (the tier's residue goes)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "root"
    synth(root, lmc_backend="fs", lmc_tier="a", defects=("zero_filled",))
    synth(root, lmc_backend="fs", lmc_tier="b", model_name="org/new")
    backdate(root)
    m = tmp_path / "m.parquet"
    run("scan", root, "--verify", "hash", "-o", m, "-q")
    t = pq.read_table(m)
    rel, src = t.column("relpath").to_pylist(), t.column("source_base").to_pylist()
    b_file = next(r for r in rel if r.startswith("b/"))
    b_ns = src[rel.index(b_file)]
    cols = {"action": ["already_present" if r.startswith("a/") else a for r, a in
                       zip(rel, t.column("action").to_pylist())],
            "target_relpath": [b_file if r.startswith("a/") else x for r, x in
                               zip(rel, t.column("target_relpath").to_pylist())],
            "target_base": [b_ns if r.startswith("a/") else x for r, x in zip(rel, t.column("target_base").to_pylist())]}
    for name, values in cols.items():
        i = t.schema.get_field_index(name)
        t = t.set_column(i, t.schema.field(i), pa.array(values, t.schema.field(i).type))
    pq.write_table(t, m)
    code, plan = run_json("prune", "--manifest", m, "--migrated", "--residue")
    assert code == 1 and plan["files"] == 1 and list(plan["totals"]) == ["migrated", "residue"], plan
    assert plan["totals"]["migrated"]["files"] == 0 and plan["totals"]["residue"]["files"] == 1, plan


def test_purge_deletes_a_pruned_tier_quarantine(tmp_path):
    root = tmp_path / "root"
    synth(root, lmc_backend="gds", defects=("corrupt_sidecar", "short"))
    backdate(root)
    code, done = run_json("prune", root, "--residue", "--apply")
    assert code == 0 and sum(done["moved"].values()) == 4  # two pairs: the short data file has its sidecar
    quarantine = root / done["quarantine"]
    assert sum(len(f) for _, _, f in os.walk(quarantine)) == 4
    code, dry = run_json("prune", root, "--purge", "--older-than", "0")
    assert code == 1 and dry["files"] == 4
    code, purged = run_json("prune", root, "--purge", "--older-than", "0", "--apply")
    assert code == 0 and purged["files"] == 4 and not quarantine.exists()
    code, out = run("restore", done["journal"])
    assert code == 8 and "purged" in out


# --- prune -> restore -> rescan ---------------------------------------------------------------


def test_prune_restore_rescan_sequence_gives_the_same_statuses(tmp_path):
    """Any sequence of prune runs (classes drawn), then one restore of them all: every file
    back byte for byte and every manifest status as before."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    classes = ("--residue", "--unreadable-namespaces", "--index-lost")
    counter = iter(range(10**6))

    @settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.sets(st.sampled_from(classes), min_size=1), min_size=1, max_size=3))
    def check(runs: list[set[str]]) -> None:
        root = tmp_path / f"root{next(counter)}"
        synth(root, lmc_backend="gds", tp=2, lmc_tier="g", defects=("corrupt_sidecar", "orphan_data", "short",
                                                                     "zero_filled", "misfiled", "tmp"))
        synth(root, lmc_backend="local_disk", lmc_tier="ld", defects=("short",))
        synth(root, lmc_backend="fs", lmc_era="lmc-k2", lmc_tier="old", defects=("zero_filled",))
        backdate(root)
        want, dirs = files(root), folders(root)
        status = statuses(tmp_path, root)
        for chosen in runs:
            backdate(root)  # (a prune's own folder removals move a tier's mtime)
            code, done = run_json("prune", root, *sorted(chosen), "--engine-stopped", "--apply")
            assert code == 0, done
        code, out = run("restore", root / ".kvmigrate" / "journals" / "prune")
        assert code == 0, out
        assert files(root) == want and folders(root) == dirs
        assert statuses(tmp_path, root) == status

    check()


def test_a_killed_tier_prune_is_finished_and_keeps_the_tier_folder(tmp_path):
    """kill -9 midway: the rerun finishes the journaled run (the tier folder, journaled
    as kept, stays though every file of it went), and restore puts every file back."""
    import subprocess
    import sys

    from kvmigrate.migrate.crash import CRASH_ENV

    root = tmp_path / "root"
    pt = _local_disk(root)
    backdate(root)
    before = files(root)
    exe = str(Path(sys.executable).with_name("kvmigrate"))
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    args = [exe, "prune", str(root), "--index-lost", "--engine-stopped", "--apply"]
    killed = subprocess.run(args, capture_output=True, text=True, env={**env, CRASH_ENV: "prune_move:3"}, timeout=120)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert 0 < len(files(root)) < len(pt)
    again = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "finished the interrupted prune run" in again.stdout
    assert files(root) == {} and (root / "ld").is_dir()
    code, out = run("restore", root / ".kvmigrate" / "journals" / "prune")
    assert code == 0, out
    assert files(root) == before
