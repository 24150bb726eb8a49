"""`kvmigrate prune` and `restore`: one test per selection and safety rule (issue 19).

The trees: an llm-d MLA TP=2 namespace (copy_pad of rank 0, rank 1 a proven replica)
and a vLLM S2 MLA namespace (a hard link), migrated into the same root.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from kvmigrate import layout
from kvmigrate import manifest as mf
from kvmigrate.options import ScanOptions

from helpers.cli_helpers import run, run_json
from helpers.reference_reader import ReferenceReader, file_facts, listing

MLA = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]
NOW = ["--quiet-period", "0"]  # synthetic trees were written just now: every test but the quiet-period one
LLMD = {"family": "llmd", "tp": 2, "kv_kind": "mla"}
VLLM = {"family": "vllm", "scheme": "S2", "kv_kind": "mla", "model_name": "org/v"}


def _files(root: Path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, ds, fs in os.walk(root)
                  if not os.path.relpath(d, root).startswith(layout.OWN_DIR) for f in fs)


@pytest.fixture
def migrated(synth_root):
    """(root, the legacy files' bytes before the migration, the migration journal dir)."""
    root, _ = synth_root(LLMD, VLLM)
    legacy = {rel: (root / rel).read_bytes() for rel in _files(root)}
    code, out = run("migrate", root, *MLA, "--apply")
    assert code == 0, out
    return root, legacy


def _manifest(tmp_path: Path, root: Path) -> tuple[str, list[dict]]:
    out = tmp_path / "m.parquet"
    code, text = run("scan", root, *MLA, "--verify", "hash", "-o", out, "-q")
    assert code in (0, 1), text
    return str(out), mf.read_table(out).to_pylist()


def _readable_through_targets(root: Path, manifest: str, legacy: dict[str, bytes]) -> None:
    """Every legacy block's bytes load at its target path through the reference reader
    (a copy_pad target holds them padded; a replica is rank 0's bytes)."""
    meta = mf.read_metadata(manifest)
    rows = {r["relpath"]: r for r in mf.read_table(manifest).to_pylist()}
    checked = 0
    for rel, data in legacy.items():
        row = rows.get(rel)
        parsed = layout.parse_block_relpath(rel)
        if row is None or parsed is None:
            continue
        target = meta["namespaces"][row["source_base"]]["target"]
        got = ReferenceReader(root, target).load(parsed[1].hex_hash, parsed[1].group, row_size=len(data))
        assert got.data == data, (rel, got.why)
        checked += 1
    assert checked == 18  # 6 llm-d blocks x 2 ranks + 6 vLLM blocks


def test_dry_run_selects_migrated_blocks_and_writes_nothing(migrated):
    root, legacy = migrated
    before = listing(root)
    code, plan = run_json("prune", root, *MLA, *NOW)
    assert code == 1
    assert listing(root) == before
    ns = {(n["namespace"], n["files"]) for n in plan["namespaces"]}
    # llm-d: 6 blocks x 2 ranks + config.json; vLLM: 6 linked blocks + config.json
    assert {n for _, n in ns} == {13, 7} and plan["files"] == 20
    t = plan["totals"]["migrated"]
    assert t["unlinked_files"] == 6  # the vLLM links: the target name keeps their bytes
    assert t["freed_bytes"] == t["bytes"] - sum(len(legacy[r]) for r in legacy if r.startswith("org_v_")
                                                and r.endswith(".bin"))


def test_apply_quarantines_then_restore_puts_every_path_back(migrated, tmp_path):
    root, legacy = migrated
    manifest, _ = _manifest(tmp_path, root)
    before = listing(root, exclude_top=(layout.OWN_DIR,))
    code, res = run_json("prune", "--manifest", manifest, *MLA, *NOW, "--apply")
    assert code == 0, res
    assert res["moved"] == {"migrated": 20} and res["kept"] == [] and res["failed"] == []
    assert not any((root / rel).exists() for rel in legacy)  # every legacy file and folder went
    quarantine = root / res["quarantine"]
    assert sorted(_files(quarantine)) == sorted(legacy)
    # nothing was copied: the quarantined names are the legacy inodes
    assert {os.lstat(quarantine / r).st_ino for r in legacy} == {before[r][2] for r in legacy}
    _readable_through_targets(root, manifest, legacy)
    code, out = run("restore", res["journal"])
    assert code == 0, out
    after = listing(root, exclude_top=(layout.OWN_DIR,))
    assert after.keys() == before.keys()  # every file and folder, none more
    # files: the same inode, size, mtime and bytes (folders are made again: new inodes)
    assert {k: v for k, v in after.items() if k in legacy} == {k: v for k, v in before.items() if k in legacy}
    assert {r: (root / r).read_bytes() for r in legacy} == legacy
    assert {r: os.lstat(root / r).st_ino for r in legacy} == {r: before[r][2] for r in legacy}


def test_an_ok_block_not_migrated_is_never_selected(migrated, synth_root):
    root, legacy = migrated
    # the engine wrote one more block into the legacy vLLM namespace after the migration
    block = next(r for r in legacy if r.startswith("org_v_") and r.endswith(".bin"))
    rank, name = block.split("/")[0], block.rsplit("/", 1)[1]
    fresh = root / rank / "abc" / "de_g0" / ("abcdef" + name[6:])
    fresh.parent.mkdir(parents=True)
    fresh.write_bytes((root / block).read_bytes())
    code, plan = run_json("prune", root, *MLA, *NOW)
    selected = {n["namespace"]: n["files"] for n in plan["namespaces"]}
    base = block.split("/")[0].rsplit("_r", 1)[0]
    assert selected[base] == 6  # the six migrated blocks; not the new one, and not config.json
    code, res = run_json("prune", root, *MLA, *NOW, "--apply")
    assert code == 0
    assert fresh.exists() and (root / base / "config.json").exists()


def test_a_file_changed_since_the_scan_is_kept(migrated, tmp_path):
    root, legacy = migrated
    manifest, _ = _manifest(tmp_path, root)
    changed = root / next(r for r in legacy if r.startswith("org_v_") and r.endswith(".bin"))
    st = os.lstat(changed)
    os.utime(changed, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # the engine touched it
    code, res = run_json("prune", "--manifest", manifest, *MLA, *NOW, "--apply")
    assert code == 0
    assert changed.exists() and os.lstat(changed).st_ino == st.st_ino
    assert [k for k in res["kept"] if str(changed) in k and "changed since the scan" in k]
    # the other blocks went; the namespace's config.json stays with the kept block
    assert res["moved"]["migrated"] == 18
    assert (root / changed.relative_to(root).parts[0].rsplit("_r", 1)[0] / "config.json").exists()


def test_a_file_whose_ctime_is_newer_than_prunes_own_scan_is_kept(migrated, monkeypatch):
    """prune ROOT stamps its scan's start: a chmod (ctime only) after it keeps the file."""
    root, legacy = migrated
    from kvmigrate import pipeline
    from kvmigrate.migrate import prune, quarantine

    target = root / next(r for r in legacy if r.startswith("org_v_") and r.endswith(".bin"))
    original = prune.build_plan

    def build_then_touch(*args, **kwargs):
        plan = original(*args, **kwargs)
        os.chmod(target, 0o640)  # after the scan: only the ctime says so
        return plan

    monkeypatch.setattr(prune, "build_plan", build_then_touch)
    with pipeline.pruning(str(root), None, ScanOptions.planning(facts_resolver=_resolver()), force_live=True) as plan:
        res = quarantine.apply_prune(plan)
    assert target.exists()
    assert [k for k in res.kept if str(target) in k and "ctime" in k]


def _resolver():
    from kvmigrate.identity.facts import FactsResolver

    return FactsResolver({"kv_kind": "mla", "model_dtype": "bfloat16"}, None)


def test_a_target_namespace_is_never_touched(migrated, tmp_path):
    root, legacy = migrated
    # residue inside the target namespace (an old engine temp file) stays too
    targets = sorted({p.split("/")[0] for p in _files(root)} - {p.split("/")[0] for p in legacy})
    assert len(targets) == 4  # two target base folders and their _r0
    rank = next(t for t in targets if t.endswith("_r0"))
    tmp = root / rank / "abc" / "de_g0" / ("abcdef" * 2 + ".bin_1234.tmp")
    tmp.parent.mkdir(parents=True)
    tmp.write_bytes(b"x" * 100)
    os.utime(tmp, (1_000_000_000, 1_000_000_000))
    target_files = [p for p in _files(root) if p.split("/")[0] in targets]
    facts = file_facts(root, target_files)
    code, res = run_json("prune", root, *MLA, *NOW, "--migrated", "--unreadable-namespaces", "--residue", "--apply")
    assert code == 0, res
    assert file_facts(root, target_files) == facts


def test_a_symlink_is_never_followed(migrated, tmp_path):
    root, legacy = migrated
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"precious")
    block = next(r for r in legacy if r.startswith("org_v_") and r.endswith(".bin"))
    link = root / block.rsplit("/", 1)[0] / ("ab" * 16 + ".bin")
    os.symlink(outside, link)
    old = (1_000_000_000, 1_000_000_000)
    os.utime(link, old, follow_symlinks=False)
    code, res = run_json("prune", root, *MLA, *NOW, "--migrated", "--residue", "--unreadable-namespaces", "--apply")
    assert code == 0
    assert os.path.islink(link) and os.readlink(link) == str(outside)
    assert outside.read_bytes() == b"precious"
    # a rank folder replaced by a symlink after the scan: nothing is moved through it
    code, out = run("restore", res["journal"])
    assert code == 0, out
    manifest, _ = _manifest(tmp_path, root)
    rank = root / block.split("/")[0]
    os.rename(rank, tmp_path / "moved-away")
    os.symlink(tmp_path / "moved-away", rank)
    code, res = run_json("prune", "--manifest", manifest, *MLA, *NOW, "--apply")
    assert code == 0
    assert [k for k in res["kept"] if "symlink" in k]
    assert sorted(_files(tmp_path / "moved-away")) == sorted(
        [r.split("/", 1)[1] for r in legacy if r.startswith(block.split("/")[0] + "/")]
        + [os.path.relpath(link, rank)])


def test_a_namespace_written_within_the_quiet_period_is_skipped(migrated):
    root, legacy = migrated
    before = listing(root)
    code, res = run_json("prune", root, *MLA, "--apply")  # default quiet period: 10 min, the tree is newer
    assert code == 0
    assert res["moved"] == {} and len(res["skipped"]) == 2
    assert all("quiet period" in why and "--force-live" in why for why in res["skipped"].values())
    assert {k: v for k, v in listing(root).items() if not k.startswith(layout.OWN_DIR)} == \
        {k: v for k, v in before.items() if not k.startswith(layout.OWN_DIR)}
    code, res = run_json("prune", root, *MLA, "--force-live", "--apply")
    assert res["moved"] == {"migrated": 20}


def test_a_namespace_under_a_held_migration_lock_is_skipped(migrated):
    root, legacy = migrated
    targets = sorted({p.split("/")[0] for p in _files(root)} - {p.split("/")[0] for p in legacy})
    base = next(t for t in targets if not t.endswith("_r0") and t.startswith("org_v_"))
    fd = os.open(root / base / layout.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a migration into org/v's target is running
        code, plan = run_json("prune", root, *MLA, *NOW)
        code, res = run_json("prune", root, *MLA, *NOW, "--apply")
    finally:
        os.close(fd)
    assert plan["files"] == 13 and [why for why in plan["skipped"].values() if "locked" in why]  # the dry run says so
    assert res["moved"] == {"migrated": 13}  # the llm-d namespace only
    assert [why for why in res["skipped"].values() if "locked" in why]
    assert all((root / r).exists() for r in legacy if r.startswith("org_v_"))


def test_restore_refuses_a_path_recreated_meanwhile(migrated):
    root, legacy = migrated
    code, res = run_json("prune", root, *MLA, *NOW, "--apply")
    block = next(r for r in legacy if r.startswith("org_v_") and r.endswith(".bin"))
    (root / block).parent.mkdir(parents=True)
    (root / block).write_bytes(b"the engine wrote it again")
    code, out = run("restore", res["journal"])
    assert code == 8
    assert str(root / block) in out and "conflict" in out
    assert (root / block).read_bytes() == b"the engine wrote it again"
    assert (root / res["quarantine"] / block).read_bytes() == legacy[block]
    assert sum((root / r).exists() for r in legacy) == len(legacy)


def test_no_quarantine_is_for_migrated_only(migrated):
    root, _ = migrated
    code, out = run("prune", root, *MLA, *NOW, "--residue", "--no-quarantine", "--apply")
    assert code == 2 and "--migrated only" in out


def test_no_quarantine_unlinks_and_restore_relinks_from_the_target(migrated):
    root, legacy = migrated
    code, res = run_json("prune", root, *MLA, *NOW, "--no-quarantine", "--apply")
    assert code == 0 and res["moved"] == {"migrated": 20} and res["quarantine"] is None
    code, out = run("restore", res["journal"])
    assert code == 8  # the copy_pad sources and configs are gone for good (their bytes live on in the targets)
    linked = [r for r in legacy if r.startswith("org_v_") and r.endswith(".bin")]
    assert all((root / r).read_bytes() == legacy[r] for r in linked)


def test_unreadable_namespaces_are_pruned_whole_and_only_when_asked(synth_root):
    root, _ = synth_root({**VLLM, "defects": ("orphan_rank",)})
    orphan = [p for p in _files(root) if not (root / layout.parse_folder(p.split("/")[0]).base).is_dir()]
    assert len(orphan) == 2  # a rank folder of another dtype, two blocks, no base folder
    code, plan = run_json("prune", root, *MLA, *NOW)
    assert plan["files"] == 0  # nothing migrated; an orphan is not selected by default
    code, res = run_json("prune", root, *MLA, *NOW, "--unreadable-namespaces", "--apply")
    assert code == 0
    assert res["moved"] == {"unreadable_namespaces": len(orphan)}
    assert not any((root / p).exists() for p in orphan)
    assert len(_files(root)) == 7  # the healthy namespace: config.json and its 6 blocks


def test_residue_takes_old_temp_files_only(synth_root):
    root, _ = synth_root({**VLLM, "defects": ("tmp_vllm",)})
    tmp = next(root / p for p in _files(root) if p.endswith(".tmp"))
    code, plan = run_json("prune", root, *MLA, *NOW, "--residue")
    assert plan["files"] == 0  # written just now: the engine may still be renaming it
    os.utime(tmp, (1_000_000_000, 1_000_000_000))
    code, res = run_json("prune", root, *MLA, *NOW, "--residue", "--apply")
    assert res["moved"] == {"residue": 1} and not tmp.exists()


def test_purge_empties_old_quarantines_and_restore_then_says_so(migrated):
    root, legacy = migrated
    code, res = run_json("prune", root, *MLA, *NOW, "--apply")
    quarantine = root / res["quarantine"]
    code, kept = run_json("prune", root, "--purge", "--older-than", "7d", "--apply")
    assert code == 0 and kept["purged_runs"] == [] and quarantine.is_dir()
    code, dry = run_json("prune", root, "--purge", "--older-than", "0s")
    assert code == 1 and quarantine.is_dir()
    code, purged = run_json("prune", root, "--purge", "--older-than", "0s", "--apply")
    assert code == 0 and purged["purged_runs"] == [res["run_id"]] and purged["files"] == 20
    assert purged["freed_bytes"] == dry["freed_bytes"] > 0
    assert not quarantine.exists()
    code, out = run("restore", res["journal"])
    assert code == 8 and "purged" in out


def test_rollback_after_prune_restores_the_sources_first(migrated):
    root, legacy = migrated
    journals = root / ".kvmigrate" / "journals"
    code, res = run_json("prune", root, *MLA, *NOW, "--apply")
    assert code == 0
    code, out = run("rollback", journals)
    assert code == 0, out
    assert {r: (root / r).read_bytes() for r in legacy} == legacy
    assert sorted(p for p in _files(root)) == sorted(legacy)  # the targets went, the sources came back


def test_a_rollback_that_restores_pruned_files_removes_their_empty_quarantine(migrated):
    """The quarantine folders the restore emptied go with it (a whole-run restore did that
    already; a rollback's, restoring its sources' files only, left them behind)."""
    root, legacy = migrated
    code, res = run_json("prune", root, *MLA, *NOW, "--apply")
    assert code == 0 and (root / res["quarantine"]).is_dir()
    code, out = run("rollback", root / ".kvmigrate" / "journals")
    assert code == 0, out
    assert all((root / rel).exists() for rel in legacy)
    assert not (root / res["quarantine"]).exists()


def test_rollback_refuses_when_pruned_sources_cannot_come_back(migrated):
    root, legacy = migrated
    journals = root / ".kvmigrate" / "journals"
    run_json("prune", root, *MLA, *NOW, "--apply")
    run_json("prune", root, "--purge", "--older-than", "0s", "--apply")
    targets_before = {p for p in _files(root)}
    code, out = run("rollback", journals)
    assert code == 8
    assert "kvmigrate restore" not in out and "nothing was rolled back" in out  # (a purged quarantine: no restore)
    assert {p for p in _files(root)} == targets_before  # the targets hold the last copy: kept


def test_prune_journals_do_not_disturb_the_migration_readers(migrated):
    """Prune journals sit in journals/prune/: verify and rollback read the migrations' only."""
    root, _ = migrated
    run_json("prune", root, *MLA, *NOW, "--apply")
    code, out = run("verify", root, "--journal", root / ".kvmigrate" / "journals")
    assert code == 0, out
    code, out = run("restore", root / ".kvmigrate" / "journals" / next(
        f for f in os.listdir(root / ".kvmigrate" / "journals") if f.endswith(".journal")))
    assert code == 2 and "not a prune journal" in out


def test_audit_names_prune_for_migrated_legacy_blocks_and_not_after(migrated):
    root, _ = migrated
    code, summary = run_json("audit", root, *MLA, "--verify", "hash")
    hint = next(h for h in summary["hints"] if "reclaimable" in h["codes"])
    assert hint["command"] == f"kvmigrate prune {root} --kv-kind mla --model-dtype bfloat16"
    assert len(hint["namespaces"]) == 2
    run_json("prune", root, *MLA, *NOW, "--apply")
    code, summary = run_json("audit", root, *MLA, "--verify", "hash")
    assert not [h for h in summary["hints"] if "reclaimable" in h["codes"]]


def test_a_blocks_rank_files_go_together_or_not_at_all(migrated, tmp_path):
    """llm-d TP=2: when rank 1's file changed since the scan, rank 0's file of that block
    stays too (a rerun would see the block incomplete and keep its half for ever)."""
    root, legacy = migrated
    manifest, _ = _manifest(tmp_path, root)
    rank1 = next(r for r in legacy if "_r1/" in r and r.endswith(".bin") and not r.startswith("org_v_"))
    rank0 = rank1.replace("_r1/", "_r0/", 1)
    st = os.lstat(root / rank1)
    os.utime(root / rank1, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    code, res = run_json("prune", "--manifest", manifest, *MLA, *NOW, "--apply")
    assert code == 0
    assert (root / rank0).exists() and (root / rank1).exists()
    assert [k for k in res["kept"] if str(root / rank0) in k and "put back" in k]
    assert res["moved"]["migrated"] == 20 - 3  # the block's two files and the namespace's config.json stay


def test_a_vllmcpp_rank_namespace_goes_with_its_deployment(synth_root):
    """vllm.cpp TP=2: each rank folder is a namespace of its own, rank 1's header names its
    own identity; its blocks are replicas of rank 0's (equal payload hashes), found through
    the deployment column, and go with them."""
    root, _ = synth_root({"family": "vllmcpp", "tp": 2, "kv_kind": "mla", "model_name": "org/cpp"})
    legacy = _files(root)
    code, out = run("migrate", root, *MLA, "--apply")
    assert code == 0, out
    code, res = run_json("prune", root, *MLA, *NOW, "--apply")
    assert code == 0 and res["moved"] == {"migrated": len(legacy)} == {"migrated": 14}
    assert not any((root / r).exists() for r in legacy)


def test_a_skipped_vllmcpp_rank_namespace_keeps_its_siblings_blocks(synth_root, tmp_path):
    """When one rank namespace of a vllm.cpp block is skipped (live, or locked), the other
    ranks' files of those blocks stay too, and so do both config.json files."""
    from kvmigrate.migrate import prune

    root, _ = synth_root({"family": "vllmcpp", "tp": 2, "kv_kind": "mla", "model_name": "org/cpp"})
    code, out = run("migrate", root, *MLA, "--apply")
    assert code == 0, out
    manifest, _ = _manifest(tmp_path, root)
    plan = prune.build_plan(manifest, force_live=True)
    rank1 = {i.namespace for i in plan.items if "_r1/" in i.relpath}
    assert len(plan.items) == 14 and len(rank1) == 1
    assert list(prune.without_namespaces(plan.items, rank1)) == []


def test_the_apply_summary_says_each_target_now_holds_only_its_own_files(migrated):
    root, legacy = migrated
    code, out = run("prune", root, *MLA, *NOW, "--apply")
    assert code == 0, out
    # 6 llm-d blocks x 2 rank files (copy_pad) + 6 vLLM links: every legacy name of a placed block
    assert "legacy names removed: 18; each target namespace now holds only its own files" in out
    targets = {layout.parse_folder(p.split("/")[0]).base for p in _files(root)}
    assert len(targets) == 2 and not targets & {layout.parse_folder(p.split("/")[0]).base for p in legacy}
    for base in targets:  # what is left in the cache is the targets' own files, no legacy name
        assert f"  {base}: " in out and ": its file count is its own" in out.split(f"  {base}: ", 1)[1].split("\n")[0]
    code, res = run_json("restore", next((root / ".kvmigrate" / "journals" / "prune").iterdir()))
    assert code == 0
    code, res = run_json("prune", root, *MLA, *NOW, "--apply")
    assert sum(res["legacy_names_removed"].values()) == 18 and res["legacy_names_left"] == {}


# an S1 namespace the target profile cannot read (a key vllm-0.28 lacks: target unreachable),
# beside the S3 namespace of the same deployment, which holds the same blocks (same seed)
OLD_ERA = {"family": "vllm", "scheme": "S1", "kv_kind": "mla", "extra_fields": {"future_key": 1}}
NEW_ERA = {"family": "vllm", "scheme": "S3", "kv_kind": "mla"}


def _era_namespaces(root: Path, manifest: str) -> tuple[str, str]:
    meta = mf.read_metadata(manifest)["namespaces"]
    old = next(b for b, n in meta.items() if n["scheme"] == "S1")
    assert meta[old]["target"]["unreachable"] == "target_lacks_future_key"
    return old, next(b for b, n in meta.items() if n["scheme"] == "S3")


def test_a_superseded_era_namespace_is_pruned_whole_with_unreadable_namespaces(synth_root, tmp_path):
    root, _ = synth_root(OLD_ERA, NEW_ERA)
    manifest, _ = _manifest(tmp_path, root)
    old, new = _era_namespaces(root, manifest)
    code, plan = run_json("prune", "--manifest", manifest, *NOW)
    assert plan["files"] == 0  # not migrated: --migrated never takes it
    code, res = run_json("prune", "--manifest", manifest, *NOW, "--unreadable-namespaces", "--apply")
    assert code == 0 and res["moved"] == {"unreadable_namespaces": 7}  # its 6 blocks and config.json
    assert {layout.parse_folder(p.split("/")[0]).base for p in _files(root)} == {new}
    assert len(_files(root)) == 7  # the newer era, untouched


def test_a_superseded_namespace_holding_the_last_copy_of_a_block_is_kept(synth_root, tmp_path):
    root, _ = synth_root(OLD_ERA, NEW_ERA)
    manifest, _ = _manifest(tmp_path, root)
    old, new = _era_namespaces(root, manifest)
    # one block of the newer era is gone: the old namespace holds its only copy
    os.unlink(root / next(p for p in _files(root) if p.startswith(new + "_r0/") and p.endswith(".bin")))
    manifest, _ = _manifest(tmp_path, root)
    code, plan = run_json("prune", "--manifest", manifest, *NOW, "--unreadable-namespaces")
    assert code == 0 and plan["files"] == 0
    code, s = run_json("report", manifest)
    assert s["reclaimable"]["files"] == 0


def test_the_merged_reclaimable_hint_says_prunes_figures_over_every_namespace_it_names(migrated):
    from kvmigrate.units import human_bytes, plural

    root, _ = migrated
    code, summary = run_json("audit", root, *MLA, "--verify", "hash")
    hint = next(h for h in summary["hints"] if "reclaimable" in h["codes"])
    assert len(hint["namespaces"]) == 2
    code, plan = run_json("prune", root, *MLA, "--force-live")
    t = plan["totals"]["migrated"]
    assert summary["reclaimable"]["classes"]["migrated"] == t
    assert hint["why"].startswith(f"{plural(t['files'], 'legacy file')} ({human_bytes(t['bytes'])}) already in their "
                                  f"target: prune frees {human_bytes(t['freed_bytes'])} once purged and unlinks "
                                  f"{plural(t['unlinked_files'], 'file')} ")


def test_residue_outside_any_namespace_beside_one_inside_is_planned_and_reported(synth_root, tmp_path):
    """An SGLang temp file at the top of the root has no namespace; beside a zero-filled
    block of a namespace, the dry run (text and --json), the apply and audit's
    reclaimable figures list both: the file outside namespaces under its own label."""
    root, _ = synth_root({"family": "sglang", "defects": ("tmp_sglang",)}, {**VLLM, "defects": ("zero_filled",)})
    tmp = next(root / p for p in os.listdir(root) if p.endswith(".tmp"))
    os.utime(tmp, (1_000_000_000, 1_000_000_000))  # older than --older-than's default hour
    code, plan = run_json("prune", root, *MLA, *NOW, "--residue")
    assert code == 1, plan
    assert sorted((n["namespace"] or "", n["files"]) for n in plan["namespaces"]) == \
        [("", 1), (next(n["namespace"] for n in plan["namespaces"] if n["namespace"]), 1)]
    code, text = run("prune", root, *MLA, *NOW, "--residue")
    assert code == 1 and "(outside namespaces): 1 file," in text, text
    code, summary = run_json("audit", root, *MLA, "--verify", "hash")
    assert summary["reclaimable"]["classes"]["residue"]["files"] == 2
    code, text = run("audit", root, *MLA, "--verify", "hash")
    assert "(outside namespaces)" in text.split("RECLAIMABLE WITH PRUNE", 1)[1].split("FINDINGS", 1)[0]
    code, res = run_json("prune", root, *MLA, *NOW, "--residue", "--apply")
    assert code == 0 and res["moved"] == {"residue": 2} and not tmp.exists()


def test_purge_with_nothing_to_free_exits_0(migrated):
    """A quarantine a restore emptied holds nothing to purge: the dry run and --apply both
    exit 0 (nothing to do is no finding) and say so; one that holds files: dry run 1."""
    root, _ = migrated
    code, res = run_json("prune", root, *MLA, *NOW, "--apply")
    assert code == 0
    code, out = run("restore", res["journal"])
    assert code == 0, out
    for apply in ((), ("--apply",)):
        code, out = run("prune", root, "--purge", "--older-than", "0s", *apply)
        assert code == 0 and "nothing to purge" in out, (apply, out)
        code, purged = run_json("prune", root, "--purge", "--older-than", "0s", *apply)
        assert code == 0 and purged["purged_runs"] == [] and purged["files"] == 0 and purged["exit_code"] == 0
    code, res = run_json("prune", root, *MLA, *NOW, "--apply")
    code, dry = run_json("prune", root, "--purge", "--older-than", "0s")
    assert code == 1 and dry["purged_runs"] == [res["run_id"]] and dry["exit_code"] == 1


def test_a_read_only_root_stops_before_anything_moves(migrated, monkeypatch):
    """EROFS when the quarantine folder is made (the root mounted read-only, the journal
    elsewhere): a message naming the path and what to do, exit 8, nothing moved; once
    writable, the same command prunes everything."""
    import errno

    from kvmigrate.migrate import fsops

    root, legacy = migrated
    real = fsops.DestTree.mkdir

    def read_only(self, reldir):
        if reldir.startswith(layout.OWN_DIR + "/quarantine"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), self.abspath(reldir))
        return real(self, reldir)

    monkeypatch.setattr(fsops.DestTree, "mkdir", read_only)
    code, out = run("prune", root, *MLA, *NOW, "--apply")
    assert code == 8, out
    assert "Traceback" not in out and f"{root}/.kvmigrate/quarantine" in out
    assert "read-only" in out and "hint:" in out and "nothing was moved" in out
    assert all((root / rel).exists() for rel in legacy)
    monkeypatch.setattr(fsops.DestTree, "mkdir", real)
    code, res = run_json("prune", root, *MLA, *NOW, "--apply")
    assert code == 0 and res["moved"] == {"migrated": 20} and res["finished_interrupted"] == []


@pytest.mark.parametrize("sig", ["INT", "TERM"])
def test_an_interrupted_prune_prints_journal_resume_and_restore_and_the_rerun_names_its_run(migrated, sig):
    """Ctrl-C (or SIGTERM) while files move: exit 32 with the journal, the command that
    resumes and the one that restores; that command finishes the run and names it (no
    new empty run); the restore command it names puts every file back."""
    import re
    import shlex
    import signal
    import subprocess
    import sys

    from kvmigrate.migrate.apply import CRASH_ENV

    root, legacy = migrated
    exe = str(Path(sys.executable).with_name("kvmigrate"))
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    # the child gets Ctrl-C's default action whatever this process inherited (a job started
    # in the background by a non-interactive shell ignores SIGINT, and so would the child)
    stopped = subprocess.run([exe, "prune", str(root), *MLA, *NOW, "--apply"], capture_output=True, text=True,
                             env={**env, CRASH_ENV: f"prune_move:5:{sig}"}, timeout=120,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert stopped.returncode == 32, stopped.stdout + stopped.stderr
    err = stopped.stderr
    assert "Traceback" not in err and re.search(r"^kvmigrate: stopped: interrupted", err, re.M), err
    journal = re.search(r"^  journal: (\S+)$", err, re.M).group(1)
    assert Path(journal).parent == root / ".kvmigrate" / "journals" / "prune" and Path(journal).is_file()
    assert f"undo:    kvmigrate restore {journal}" in err
    resume = re.search(r"^  resume:  (kvmigrate .*)$", err, re.M).group(1)
    assert shlex.split(resume)[1:3] == ["prune", str(root)] and "--apply" in shlex.split(resume)
    assert 0 < sum(not (root / rel).exists() for rel in legacy) < len(legacy)  # stopped midway
    again = subprocess.run([exe, *shlex.split(resume)[1:]], capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert not any((root / rel).exists() for rel in legacy)  # the run was finished
    assert f"journal: {journal}  (undo: kvmigrate restore {journal})" in again.stdout, again.stdout
    assert os.listdir(root / ".kvmigrate" / "journals" / "prune") == [Path(journal).name]  # no new, empty run
    code, out = run("restore", journal)
    assert code == 0, out
    assert {rel: (root / rel).read_bytes() for rel in legacy} == legacy


def test_a_rerun_after_kill_9_counts_only_the_files_it_moves(migrated):
    """kill -9 mid-prune loses the done records not yet written (they are flushed every
    4,096 moves): the rerun finds those files in the quarantine and says so apart, so its
    "more files moved" is the number still in place before it ran."""
    import re
    import subprocess
    import sys

    from kvmigrate.migrate import runs
    from kvmigrate.migrate.apply import CRASH_ENV

    root, legacy = migrated
    exe = str(Path(sys.executable).with_name("kvmigrate"))
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    killed = subprocess.run([exe, "prune", str(root), *MLA, *NOW, "--apply"], capture_output=True, text=True,
                            env={**env, CRASH_ENV: "prune_move:5"}, timeout=120)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    in_place = sum((root / rel).exists() for rel in legacy)
    (interrupted,) = [r for r in runs.list_runs(str(root)) if r.state == "interrupted"]
    journaled = interrupted.counts["moved"]  # moves whose done record reached the journal
    assert 0 < in_place < len(legacy) and journaled < len(legacy) - in_place  # some records lost
    again = subprocess.run([exe, "prune", str(root), *MLA, *NOW, "--apply"], capture_output=True, text=True,
                           env=env, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    line = re.search(r"^finished the interrupted prune run \S+: (.*)$", again.stdout, re.M).group(1)
    lost = len(legacy) - in_place - journaled
    assert line == (f"{in_place} more files moved ({lost} file{'s' if lost > 1 else ''} it had moved before it "
                    "stopped, found in the quarantine)"), again.stdout
    assert not any((root / rel).exists() for rel in legacy)


def test_runs_count_each_prune_run_without_reading_its_journal_whole(migrated, monkeypatch):
    """`kvmigrate runs`, `report` and `audit` count a prune run's files (intended, moved)
    from its journal's records as they go by, nothing kept per file: a 10M-file prune's
    journal does not become 10M records in memory. The counts are those of the paths
    journaled (a restored run, one killed twice, its resumption, one still interrupted)."""
    import subprocess
    import sys

    from kvmigrate.migrate import quarantine, runs
    from kvmigrate.migrate.apply import CRASH_ENV

    root, _ = migrated
    code, done = run_json("prune", root, *MLA, *NOW, "--apply")
    assert code == 0
    assert run("restore", done["journal"])[0] == 0
    exe = str(Path(sys.executable).with_name("kvmigrate"))
    args = [exe, "prune", str(root), *MLA, *NOW, "--apply"]
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    for point in ("prune_move:5", "prune_move:3"):  # killed, then killed again while it is resumed
        killed = subprocess.run(args, capture_output=True, text=True, env={**env, CRASH_ENV: point}, timeout=120)
        assert killed.returncode < 0, killed.stdout + killed.stderr
    whole: list[str] = []
    real = quarantine.load_prune_runs

    def spied(journal, *, moves=True):
        if moves:
            whole.append(journal)
        return real(journal, moves=moves)

    monkeypatch.setattr(quarantine, "load_prune_runs", spied)
    listed = runs.list_runs(str(root))
    assert whole == []
    monkeypatch.undo()
    # (by state: runs started in one second sort by pid, and pids wrap around)
    by_state = {r.state: r for r in listed if r.kind == "prune"}
    assert sorted(by_state) == ["interrupted", "restored"]
    for r in by_state.values():
        (journaled,) = quarantine.load_prune_runs(r.journal)
        assert r.counts == {"moved": len(journaled.moved), "intended": len(journaled.moves)}
    restored, interrupted = by_state["restored"], by_state["interrupted"]
    assert restored.counts["moved"] == restored.counts["intended"] > interrupted.counts["moved"]
    assert [r.to_dict() for r in runs.unfinished(str(root))] == [interrupted.to_dict()]


def _written_long_ago(root: Path) -> None:
    """Every file and folder of the tree: mtime in 2001 (outside any quiet period)."""
    old = (1_000_000_000, 1_000_000_000)
    for d, ds, fs in os.walk(root, topdown=False):
        for name in fs + ds:
            os.utime(os.path.join(d, name), old, follow_symlinks=False)
    os.utime(root, old)


def _hinted(summary: dict, code: str) -> dict:
    (hint,) = [h for h in summary["hints"] if code in h["codes"]]
    return hint


def test_the_orphan_folder_hint_prunes_exactly_the_folders_it_names(synth_root):
    """audit's hint for a rank folder without its base folder names a prune command; run
    as printed (then with --apply), it takes that folder and nothing else: not the
    namespace whose config.json does not hash to its name, another unreadable one."""
    import shlex

    root, _ = synth_root({**VLLM, "defects": ("orphan_rank",)},
                         {**VLLM, "model_name": "org/w", "seed": 1, "defects": ("digest_mismatch",)})
    _written_long_ago(root)
    orphan = [p for p in _files(root) if not (root / layout.parse_folder(p.split("/")[0]).base).is_dir()]
    base = layout.parse_folder(orphan[0].split("/")[0]).base
    before = {p: (root / p).read_bytes() for p in _files(root) if p not in orphan}
    code, summary = run_json("audit", root, *MLA)
    hint = _hinted(summary, "orphan_namespace")
    assert hint["namespaces"] == [base]
    args = shlex.split(hint["command"])
    assert args[:2] == ["kvmigrate", "prune"]
    code, plan = run_json(*args[1:])
    assert code == 1 and [(n["class"], n["namespace"]) for n in plan["namespaces"]] == \
        [("unreadable_namespaces", base)] and plan["files"] == len(orphan) == 2
    code, res = run_json(*args[1:], "--apply")
    assert code == 0 and res["moved"] == {"unreadable_namespaces": 2}
    assert not any((root / p).exists() for p in orphan)
    assert {p: (root / p).read_bytes() for p in _files(root)} == before  # org/w and org/v untouched


def test_the_hint_for_an_orphaned_target_folder_is_no_prune_command(migrated, tmp_path):
    """The rank folder of a target namespace whose base folder went is orphan_namespace
    too, but no prune takes a target: its hint lists its files instead of naming a prune
    (whose plan skipped it and took another unreadable namespace)."""
    import shlex
    import shutil

    root, legacy = migrated
    targets = sorted({p.split("/")[0] for p in _files(root)} - {p.split("/")[0] for p in legacy})
    target = next(t for t in targets if t.startswith("org_v_") and not t.endswith("_r0"))
    shutil.rmtree(root / target)  # its config.json and lock folder went; its rank folder stays
    # and the llm-d source's base folder: its rank folders are a migration journal's source
    source = next(p.split("/")[0] for p in legacy if p.endswith("/config.json") and not p.startswith("org_v_"))
    shutil.rmtree(root / source)
    synth_root_again = {**VLLM, "model_name": "org/w", "seed": 1, "defects": ("digest_mismatch",)}
    from kvmigrate.synth import SynthSpec, build

    build(root, SynthSpec(**{"layers": 2, "page_bytes": 256, "blocks": 6, **synth_root_again}))
    _written_long_ago(root)
    code, summary = run_json("audit", root, *MLA, "--verify", "hash", "--manifest-out", tmp_path / "m.parquet")
    hint = _hinted(summary, "orphan_namespace")
    assert sorted(hint["namespaces"]) == sorted([target, source]) and "prune" not in hint["command"]
    from click.testing import CliRunner

    from kvmigrate.cli import cli

    listed = CliRunner().invoke(cli, shlex.split(hint["command"])[1:]).stdout.split()
    assert {path.split("/")[-4] for path in listed} == {f"{target}_r0", f"{source}_r0", f"{source}_r1"}, listed
    for h in summary["hints"]:  # no prune hint names a command taking a namespace it does not name
        if "--unreadable-namespaces" in h["command"]:
            code, plan = run_json(*shlex.split(h["command"])[1:])
            assert {n["namespace"] for n in plan["namespaces"]} <= set(h["namespaces"]), h


def _rollback_three_ways(journals: Path) -> dict[str, tuple[int, str]]:
    """`rollback --dry-run`, `--dry-run --list` and the real `rollback` of journals (in that
    order): (exit code, stdout + stderr) each."""
    return {"dry": run("rollback", journals, "--dry-run"), "list": run("rollback", journals, "--dry-run", "--list"),
            "real": run("rollback", journals)}


def test_after_a_purge_dry_run_list_and_rollback_refuse_alike_and_remove_nothing(migrated):
    """migrate -> prune -> purge: the copy_pad targets and the linked targets hold the last
    copy of blocks whose legacy names (and config.json files) were purged. The dry run, its
    --list script and the rollback refuse with one message and exit 8; no command printed
    removes a target or names a restore of the purged quarantine; 14 files cannot come back
    (the 6 linked blocks can: from their targets)."""
    import re

    root, legacy = migrated
    journals = root / ".kvmigrate" / "journals"
    code, res = run_json("prune", root, *MLA, *NOW, "--apply")
    assert code == 0 and res["moved"] == {"migrated": 20}
    code, purged = run_json("prune", root, "--purge", "--older-than", "0s", "--apply")
    assert code == 0 and purged["purged_runs"] == [res["run_id"]]
    before = listing(root, exclude_top=(layout.OWN_DIR,))
    out = _rollback_three_ways(journals)
    assert {way: code for way, (code, _) in out.items()} == {"dry": 8, "list": 8, "real": 8}, out
    errors = {way: text[text.index("kvmigrate: error:"):] for way, (_, text) in out.items()}
    assert errors["dry"] == errors["list"] == errors["real"], errors
    error = errors["real"]
    assert "14 of them cannot be put back" in error and "nothing was rolled back" in error
    assert "kvmigrate restore" not in "".join(text for _, text in out.values())
    assert not [line for line in out["list"][1].splitlines() if re.match(r"(rm|rmdir|ln|mkdir) ", line)]
    assert not re.search(r"`kvmigrate rollback [^`]*`", error)  # every target holds a last copy: keep them all
    assert listing(root, exclude_top=(layout.OWN_DIR,)) == before  # nothing removed, nothing restored
    code, out = run("verify", root, "--journal", journals)
    assert code == 0, out  # the targets still hold every block


def _pruned_twin(synth_root, name: str, *, fresh_block: bool, purge: bool) -> tuple[Path, Path, str]:
    """One of two identical trees: LLMD + VLLM migrated, then (fresh_block) an engine block
    written into the vLLM legacy namespace (so prune keeps its config.json), pruned, then
    (purge) purged. (root, migration journals, the llm-d target base)."""
    root, _ = synth_root(LLMD, VLLM, root_name=name)
    legacy = _files(root)
    assert run("migrate", root, *MLA, "--apply")[0] == 0
    llmd_target = next(layout.parse_folder(p.split("/")[0]).base for p in _files(root)
                       if p not in legacy and not p.startswith("org_v_"))
    if fresh_block:
        block = next(r for r in legacy if r.startswith("org_v_") and r.endswith(".bin"))
        fresh = root / block.split("/")[0] / "abc" / "de_g0" / ("abcdef" + block.rsplit("/", 1)[1][6:])
        fresh.parent.mkdir(parents=True)
        fresh.write_bytes((root / block).read_bytes())
    code, res = run_json("prune", root, *MLA, *NOW, "--apply")
    assert code == 0 and res["moved"] == {"migrated": 19 if fresh_block else 20}, res
    if purge:
        assert run("prune", root, "--purge", "--older-than", "0s", "--apply")[0] == 0
    return root, root / ".kvmigrate" / "journals", llmd_target


def _tree(root: Path) -> dict[str, tuple]:
    """The tree without kvmigrate's journals (they record the run): type, size, bytes and
    link count of each entry, so two twin trees compare equal."""
    return {rel: (kind, size, digest, os.lstat(root / rel).st_nlink if kind != 0o040000 else None)
            for rel, (kind, size, _, digest) in listing(root, with_times=False).items()
            if not rel.startswith(os.path.join(layout.OWN_DIR, "journals"))}


@pytest.mark.parametrize("purge", [False, True])
def test_rollback_after_prune_dry_run_list_and_real_run_agree(synth_root, purge):
    """Dry run, --list and rollback agree on exit code, counts and what is removed; the
    --list script run by sh on a twin tree leaves the tree rollback leaves, and neither
    leaves empty quarantine folders behind. Not purged: every pruned file comes back from
    the quarantine. Purged: rollback refuses, naming the rollback of the other targets;
    that command puts the linked vLLM blocks back from their targets (the llm-d target,
    the last copy of its blocks, is kept)."""
    import re
    import subprocess

    a, ja, llmd = _pruned_twin(synth_root, "a", fresh_block=purge, purge=purge)
    b, jb, _ = _pruned_twin(synth_root, "b", fresh_block=purge, purge=purge)
    args = []
    if purge:
        code, out = run("rollback", ja, "--dry-run")
        assert code == 8, out
        command = re.search(r"`(kvmigrate rollback [^`]*)`", out).group(1)
        assert "--exclude" in command and llmd in command and "kvmigrate restore" not in out
        args = command.split()[3:]
    code, dry = run_json("rollback", ja, *args, "--dry-run")
    code_list, script = run("rollback", ja, *args, "--dry-run", "--list")
    proc = subprocess.run(["sh", "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    code_b, real = run_json("rollback", jb, *args)
    assert code == code_list == code_b == 0, (dry, real)
    for key in ("removed", "per_namespace", "restored", "already_gone"):
        assert dry[key] == real[key], key
    assert dry["restored"] == (6 if purge else 20)
    assert sum(line.startswith(("rm -f -- ", "rmdir -- ")) and ".kvmigrate" not in line
               for line in script.splitlines()) == sum(real["removed"].values())
    assert _tree(a) == _tree(b)  # the script leaves the tree rollback leaves
    assert not [p for p in _tree(b) if p.startswith(os.path.join(layout.OWN_DIR, "quarantine") + "/")]
    if purge:  # the llm-d target is kept whole, the vLLM legacy names are back
        assert any(p.startswith(llmd) for p in _tree(b))
        assert len([p for p in _tree(b) if p.startswith("org_v_") and p.endswith(".bin")]) == 7


def test_a_rollback_whose_pruned_source_path_was_recreated_refuses_alike_until_moved_aside(migrated):
    """The engine wrote a pruned block's path again: its pruned file cannot go back over it.
    Dry run, --list and rollback refuse alike (exit 8, nothing removed); once the new file
    is moved aside, the rollback puts every pruned file back, then removes the targets."""
    root, legacy = migrated
    code, res = run_json("prune", root, *MLA, *NOW, "--apply")
    block = next(r for r in legacy if r.startswith("org_v_") and r.endswith(".bin"))
    (root / block).parent.mkdir(parents=True)
    (root / block).write_bytes(b"the engine wrote it again")
    before = listing(root, exclude_top=(layout.OWN_DIR,))
    out = _rollback_three_ways(root / ".kvmigrate" / "journals")
    assert {way: code for way, (code, _) in out.items()} == {"dry": 8, "list": 8, "real": 8}, out
    errors = {text[text.index("kvmigrate: error:"):] for _, text in out.values()}
    assert len(errors) == 1 and "move the re-created files aside" in errors.pop()
    assert listing(root, exclude_top=(layout.OWN_DIR,)) == before
    os.rename(root / block, root.parent / "aside.bin")
    code, done = run_json("rollback", root / ".kvmigrate" / "journals")
    assert code == 0 and done["restored"] == 20, done
    assert {rel: (root / rel).read_bytes() for rel in legacy} == legacy


def test_a_file_restored_then_pruned_again_counts_once_when_it_cannot_come_back(migrated):
    """prune, restore, prune again, purge: each file is the newer run's (the older run's
    quarantine never held it again), so the refusal counts 14 files, not 14 + 20."""
    root, legacy = migrated
    code, first = run_json("prune", root, *MLA, *NOW, "--apply")
    assert run("restore", first["journal"])[0] == 0
    code, second = run_json("prune", root, *MLA, *NOW, "--apply")
    assert code == 0 and second["moved"] == {"migrated": 20}
    assert run("prune", root, "--purge", "--older-than", "0s", "--apply")[0] == 0
    code, out = run("rollback", root / ".kvmigrate" / "journals", "--dry-run")
    assert code == 8 and "pruned and 14 of them cannot be put back" in out, out
    code, out = run("restore", root / ".kvmigrate" / "journals" / "prune")
    assert code == 8 and "14 files not restored" in out and "re-created" not in out.split("hint:", 1)[1], out


def test_removed_folders_are_journaled_in_bounded_records_and_restore_reads_them(migrated, tmp_path, monkeypatch):
    """A prune that empties many folders names them in several `rmdirs` records of at most
    RMDIRS_PER_RECORD paths (a reader decodes one record at once: one record naming every
    folder grew with the tree); restore and a rollback after it read them all."""
    from kvmigrate.migrate import journal as jn
    from kvmigrate.migrate import quarantine

    monkeypatch.setattr(quarantine, "RMDIRS_PER_RECORD", 3)
    root, legacy = migrated
    manifest, _ = _manifest(tmp_path, root)
    before = listing(root, exclude_top=(layout.OWN_DIR,))
    code, res = run_json("prune", "--manifest", manifest, *MLA, *NOW, "--apply")
    assert code == 0, res
    records = [r for r in jn.read_records(str(root / res["journal"])) if r.get("kind") == "rmdirs"]
    folders = [p for r in records for p in r["paths"]]
    assert len(records) > 1 and all(len(r["paths"]) <= 3 for r in records)
    assert len(folders) == len(set(folders)) and not any((root / d).exists() for d in folders)
    assert folders == sorted(folders, key=lambda d: (d.count("/"), d), reverse=True)  # deepest first, as before
    code, out = run("restore", res["journal"])
    assert code == 0, out
    assert listing(root, exclude_top=(layout.OWN_DIR,)).keys() == before.keys()
    code, res = run_json("prune", root, *MLA, *NOW, "--apply")
    assert code == 0, res
    code, out = run("rollback", root / ".kvmigrate" / "journals")
    assert code == 0, out
    assert {r: (root / r).read_bytes() for r in legacy} == legacy


def test_a_full_temporary_folder_stops_the_plan_with_what_to_do(synth_root, tmp_path, monkeypatch):
    """The plan of a directory-layout manifest is written to TMPDIR before anything moves:
    a write that fails there (no space left) is exit 8, the folder and what to do named,
    and every file is where it was."""
    import errno
    import tempfile

    root, _ = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"})
    assert run("migrate", root, *MLA, "--apply")[0] == 0
    manifest, _ = _manifest(tmp_path, root)
    before = listing(root)

    import pyarrow as pa

    opened = pa.OSFile

    def full(path, mode="rb"):
        if mode != "rb" and tempfile.gettempdir() in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return opened(path, mode)

    monkeypatch.setattr(pa, "OSFile", full)
    code, out = run("prune", root, "--manifest", manifest, "--quiet-period", "0s", "--apply")
    assert code == 8, out
    assert "cannot write the prune plan's temporary files: no space left on device" in out
    assert "kvmigrate-prune-plan-" in out and "TMPDIR" in out
    assert listing(root) == before


def test_a_killed_prunes_working_folders_are_removed_by_the_next_command(synth_root, tmp_path):
    """A prune killed by a signal it cannot handle (kill -9 here; a `timeout` SIGTERMing a
    dry run) leaves its scan's temporary manifest and its plan's folder in TMPDIR; the next
    command that makes one (an audit here) removes both, not the folders of a process still
    running, of another pid namespace (a container sharing TMPDIR) or of older versions."""
    import subprocess
    import sys

    from kvmigrate import scratch

    root, _ = synth_root({"family": "llmd", "tp": 2, "kv_kind": "mla"})
    assert run("migrate", root, *MLA, "--apply")[0] == 0
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    ns = scratch.owner().split(".")[0]
    kept = [f"kvmigrate-prune-plan-{scratch.owner()}-x",  # this test's own pid: a running process
            f"kvmigrate-prune-{int(ns) + 1}.999999999-x",  # no such pid here, but another namespace's
            "kvmigrate-prune-plan-999999999-x", "kvmigrate-prune-abc123"]  # older versions' names
    for name in kept:
        (tmp / name).mkdir()
    env = dict(os.environ, TMPDIR=str(tmp))
    args = [sys.executable, "-m", "kvmigrate", "prune", str(root), *MLA, "--quiet-period", "0s", "--apply"]
    killed = subprocess.run(args, env=dict(env, KVMIGRATE_CRASH_AT="prune_move:1"), capture_output=True)
    assert killed.returncode == -9
    left = sorted(p.name for p in tmp.iterdir() if p.name not in kept)
    assert [name.removeprefix("kvmigrate-").rsplit("-", 2)[0] for name in left] == ["prune", "prune-plan"]
    again = subprocess.run([sys.executable, "-m", "kvmigrate", "audit", str(root), *MLA], env=env,
                           capture_output=True, text=True)
    assert again.returncode in (0, 1), again.stderr
    assert sorted(p.name for p in tmp.iterdir()) == sorted(kept)


def test_runs_of_one_second_are_listed_in_the_order_they_started(migrated, monkeypatch):
    """Run ids are `<second>-<pid>-<random>`: two prunes started in one second sort by pid
    as text, and pids wrap around (a later run of pid 10 sorted before one of pid 9).
    `kvmigrate runs` lists them by the time their journals' headers give."""
    from kvmigrate.migrate import journal as jn

    root, _ = migrated
    ids = iter(["20261207T031528Z-9-aaaaaa", "20261207T031528Z-10-bbbbbb"])
    monkeypatch.setattr(jn, "new_run_id", lambda: next(ids))
    code, first = run_json("prune", root, *MLA, *NOW, "--apply")
    assert code == 0
    assert run("restore", first["journal"])[0] == 0
    code, second = run_json("prune", root, *MLA, *NOW, "--apply")
    assert code == 0
    code, listed = run_json("runs", root)
    prunes = [(r["run_id"], r["state"]) for r in listed["runs"] if r["kind"] == "prune"]
    assert prunes == [("20261207T031528Z-9-aaaaaa", "restored"), ("20261207T031528Z-10-bbbbbb", "done")]
