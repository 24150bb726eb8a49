"""`report` and `audit` show what `prune` would reclaim, per class and namespace, with the
bytes a prune frees apart from the files it only unlinks (issue 19 scope 4): figures from
prune's own selection, equal to what `prune --apply` + `prune --purge` free on disk.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvmigrate import layout

from helpers.cli_helpers import run, run_json

MLA = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]
VLLM = {"family": "vllm", "scheme": "S2", "kv_kind": "mla", "model_name": "org/v"}
ALL = ["--migrated", "--unreadable-namespaces", "--residue"]


def _files(root: Path) -> dict[str, os.stat_result]:
    """Every file of the tree but kvmigrate's own (journals, quarantine), by relpath."""
    out = {}
    for d, _ds, fs in os.walk(root):
        if os.path.relpath(d, root).split(os.sep)[0] == layout.OWN_DIR:
            continue
        for f in fs:
            out[os.path.relpath(os.path.join(d, f), root)] = os.lstat(os.path.join(d, f))
    return out


def _disk_bytes(root: Path) -> int:
    """Bytes held on disk under ROOT, each inode once (kvmigrate's own folder included: the
    quarantine holds what a prune moved until it is purged)."""
    seen = {}
    for d, _ds, fs in os.walk(root):
        for f in fs:
            st = os.lstat(os.path.join(d, f))
            if not os.path.relpath(d, root).startswith(os.path.join(layout.OWN_DIR, "journals")):
                seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def _migrated_tree(synth_root) -> Path:
    root, _ = synth_root(VLLM)
    code, out = run("migrate", root, *MLA, "--apply")
    assert code == 0, out
    return root


def test_linked_legacy_blocks_are_only_unlinked(synth_root):
    root = _migrated_tree(synth_root)
    legacy = {rel: st for rel, st in _files(root).items() if rel.startswith("org_v_") and st.st_nlink == 2}
    assert len(legacy) == 12  # the six blocks, under their legacy and their target name
    code, s = run_json("audit", root, *MLA)
    r = s["reclaimable"]["classes"]["migrated"]
    blocks = [st for rel, st in legacy.items() if layout.parse_folder(rel.split("/")[0]).base == _source(s)]
    assert len(blocks) == 6
    # the blocks free nothing (the target link keeps them); the legacy config.json, linked to nothing, is freed
    assert (r["unlinked_files"], r["unlinked_bytes"]) == (6, sum(st.st_size for st in blocks))
    config = os.lstat(root / _source(s) / layout.CONFIG_NAME)
    assert (r["freed_files"], r["freed_bytes"]) == (1, config.st_size)
    assert [(n["class"], n["namespace"], n["unlinked_files"]) for n in s["reclaimable"]["namespaces"]] == \
        [("migrated", _source(s), 6)]


def test_an_orphan_namespace_is_freed(synth_root):
    root, _ = synth_root({**VLLM, "defects": ("orphan_rank",)})
    orphan = {rel: st for rel, st in _files(root).items()
              if not (root / layout.parse_folder(rel.split("/")[0]).base).is_dir()}
    assert len(orphan) == 2
    code, s = run_json("audit", root, *MLA)
    r = s["reclaimable"]["classes"]["unreadable_namespaces"]
    assert (r["freed_files"], r["freed_bytes"]) == (2, sum(st.st_size for st in orphan.values()))
    assert r["unlinked_files"] == 0 and s["reclaimable"]["classes"]["migrated"]["files"] == 0


def test_residue_is_freed(synth_root, tmp_path):
    root, _ = synth_root({**VLLM, "defects": ("tmp_vllm", "zero_filled")})
    code, s = run_json("audit", root, *MLA, "--verify", "hash")  # (zeros are found by reading)
    assert s["reclaimable"]["classes"]["residue"]["files"] == 1  # the zero-filled block; the temp file is young
    tmp = next(root / rel for rel in _files(root) if rel.endswith(".tmp"))
    os.utime(tmp, (1_000_000_000, 1_000_000_000))
    manifest = tmp_path / "m.parquet"
    run("scan", root, *MLA, "--verify", "hash", "-o", manifest, "-q")
    code, s = run_json("report", manifest)
    r = s["reclaimable"]["classes"]["residue"]
    zero = next(st for rel, st in _files(root).items() if (root / rel).read_bytes().count(0) == st.st_size
                and st.st_size and rel.endswith(".bin"))
    assert (r["freed_files"], r["freed_bytes"]) == (2, zero.st_size + tmp.stat().st_size)


def test_every_format_shows_the_reclaimable_table(synth_root, tmp_path):
    root = _migrated_tree(synth_root)
    manifest = tmp_path / "m.parquet"
    run("scan", root, *MLA, "-o", manifest, "-q")
    code, s = run_json("report", manifest)
    source = _source(s)
    for fmt, title in (("text", "RECLAIMABLE WITH PRUNE"), ("md", "## Reclaimable with prune"),
                       ("html", 'id="t-reclaimable"')):
        code, out = run("report", manifest, "--format", fmt)
        assert title in out and source in out.split(title, 1)[1], fmt
    code, out = run("report", manifest, "--exclude", source, "--json")  # a partial report: its namespaces only
    assert '"unlinked_files": 0' in out and source not in out.split('"reclaimable"', 1)[1].split('"root"', 1)[0]


def test_the_figures_equal_what_prune_and_purge_free(synth_root):
    root, _ = synth_root(VLLM, {**VLLM, "model_name": "org/o", "defects": ("orphan_rank", "tmp_vllm")})
    code, out = run("migrate", root, *MLA, "--apply")
    assert code == 0, out
    tmp = next(root / rel for rel in _files(root) if rel.endswith(".tmp"))
    os.utime(tmp, (1_000_000_000, 1_000_000_000))
    # two names of one inode, both in the orphan namespace: pruning both frees it
    block = next(root / rel for rel in _files(root) if rel.endswith(".bin") and "org_o_" in rel
                 and not (root / layout.parse_folder(rel.split("/")[0]).base).is_dir())
    os.link(block, block.with_name(("f" if block.name[0] != "f" else "e") + block.name[1:]))
    code, s = run_json("audit", root, *MLA)
    r = s["reclaimable"]
    assert all(r["classes"][c]["files"] for c in ("migrated", "unreadable_namespaces", "residue"))
    before = _disk_bytes(root)
    code, res = run_json("prune", root, *MLA, *ALL, "--quiet-period", "0", "--apply")
    assert code == 0 and res["kept"] == [] and sum(res["moved"].values()) == r["files"]
    assert res["freed_bytes"] == r["freed_bytes"] and res["unlinked_files"] == r["unlinked_files"]
    assert _disk_bytes(root) == before  # moved into the quarantine: nothing freed yet
    code, purged = run_json("prune", root, "--purge", "--older-than", "0s", "--apply")
    assert code == 0 and purged["freed_bytes"] == r["freed_bytes"]
    assert before - _disk_bytes(root) == r["freed_bytes"] > 0


def _source(s: dict) -> str:
    return next(n["source_base"] for n in s["namespaces"] if n["target_base"] and n["target_base"] != n["source_base"])


def test_the_table_says_what_prune_would_skip_now_and_why(synth_root, tmp_path):
    root = _migrated_tree(synth_root)  # written just now: within prune's quiet period
    m = tmp_path / "m.parquet"
    run("scan", root, *MLA, "-o", m, "-q")
    code, s = run_json("report", m)
    skipped = s["reclaimable"]["skipped"]
    assert [k["namespace"] for k in skipped] == [_source(s)]
    assert skipped[0]["quiet_period_s"] == 600 and "--force-live" in skipped[0]["reason"]
    code, text = run("report", m)
    table = text.split("RECLAIMABLE WITH PRUNE", 1)[1]
    assert f"(skipped now)  {_source(s)}: written " in table and "rerun later or --force-live" in table
    for fmt in ("md", "html"):
        code, out = run("report", m, "--format", fmt)
        assert "(skipped now)" in out and "rerun later or --force-live" in out


def test_an_empty_table_says_nothing_to_prune(synth_root):
    root, _ = synth_root(VLLM)  # not migrated: nothing reclaimable
    code, s = run_json("audit", root, *MLA)
    assert s["reclaimable"]["files"] == 0 and s["reclaimable"]["skipped"] == []
    code, text = run("audit", root, *MLA)
    assert "nothing to prune" in text.split("RECLAIMABLE WITH PRUNE", 1)[1].split("\n\n", 2)[1]


def test_each_class_figure_is_what_prune_of_that_class_takes(synth_root):
    """A migrated namespace holding an old engine temp file: prune --migrated keeps its
    config.json (the temp file stays, so the namespace does), prune --migrated --residue
    takes both. The audit's per-class figures are each class's own prune plan, its
    total the plan of all classes together (it counted the config.json under migrated)."""
    root, _ = synth_root({**VLLM, "defects": ("tmp_vllm",)})
    code, out = run("migrate", root, *MLA, "--apply")
    assert code == 0, out
    os.utime(next(root / rel for rel in _files(root) if rel.endswith(".tmp")), (1_000_000_000, 1_000_000_000))
    code, s = run_json("audit", root, *MLA, "--verify", "hash")
    r = s["reclaimable"]
    plans = {}
    for cls in ("migrated", "residue"):
        code, plans[cls] = run_json("prune", root, *MLA, "--force-live", f"--{cls}")
        assert r["classes"][cls] == plans[cls]["totals"][cls], cls
    assert plans["migrated"]["files"] == 6  # the linked blocks; not config.json
    code, both = run_json("prune", root, *MLA, "--force-live", "--migrated", "--residue")
    assert both["files"] == 8 == r["files"]  # with the config.json of the emptied namespace
    assert {k: r[k] for k in ("bytes", "freed_bytes", "unlinked_files")} == \
        {k: sum(t[k] for t in both["totals"].values()) for k in ("bytes", "freed_bytes", "unlinked_files")}
    hint = next(h for h in s["hints"] if "reclaimable" in h["codes"])
    assert hint["why"].startswith("6 legacy files")
