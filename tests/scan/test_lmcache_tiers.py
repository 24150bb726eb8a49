"""The roots phase and tier directories (spec lmcache.md §1.1, scan/tiers.py): which
top-level folders are tiers, when the root itself is one, what stays foreign, and that
tier rows are part 0's in a sharded scan; on trees built by `kvmigrate synth`."""

from __future__ import annotations

from pathlib import Path

from kvmigrate.scan.roots import list_root
from kvmigrate.synth import SynthSpec, build

LMC = dict(family="lmcache", layers=2, block_tokens=4, blocks=3)


def synth(root: Path, **kw):
    return build(root, SynthSpec(**{**LMC, **kw}))


def test_sub_folders_with_chunk_names_are_tiers_others_stay_foreign(tmp_path):
    synth(tmp_path, lmc_backend="fs", lmc_era="lmc-k3", lmc_tier="remote")
    synth(tmp_path, lmc_backend="gds", lmc_era="lmc-k3", lmc_tier="gds")  # chunks only under <2>/<2>/
    (tmp_path / "empty").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.data").write_bytes(b"not a key")
    listing = list_root(str(tmp_path))
    assert sorted(listing.tiers) == ["gds", "remote"]
    assert sorted(listing.foreign_dirs) == ["docs", "empty"]
    assert listing.root_tier is None


def test_the_root_is_a_tier_and_keeps_its_gds_folders(tmp_path):
    synth(tmp_path, lmc_backend="gds", lmc_era="lmc-k3", lmc_tier=".")
    (tmp_path / "README").write_text("hello")
    listing = list_root(str(tmp_path))
    assert listing.root_tier is not None
    fam, entries = listing.root_tier
    assert fam.name == "lmcache"
    assert all(len(e.name) <= 2 for e in entries) and entries
    assert listing.tiers == {} and listing.foreign_dirs == []
    assert [e.name for e in listing.files] == ["README"]  # not a chunk: the root's own foreign file


def test_a_root_tier_of_top_level_files(tmp_path):
    res = synth(tmp_path, lmc_backend="local_disk", lmc_era="lmc-k3", lmc_tier=".", tp=2)
    listing = list_root(str(tmp_path))
    assert listing.root_tier is not None
    assert sorted(e.name for e in listing.root_tier[1]) == sorted(
        rel for blk in res.blocks for rel in blk["files"].values())
    assert listing.files == []


def test_tier_rows_are_written_by_part_zero(tmp_path, scan_root):
    synth(tmp_path, lmc_backend="fs", lmc_era="lmc-k3", tp=2)
    _, whole = scan_root(tmp_path)
    _, part0 = scan_root(tmp_path, shard=(0, 2))
    _, part1 = scan_root(tmp_path, shard=(1, 2))
    tier = {k for k, r in whole.items() if r["family"] == "lmcache"}
    assert tier and tier <= set(part0) and not tier & set(part1)


def test_verify_none_reads_no_bytes_and_judges_sizes(tmp_path, scan_root):
    res = synth(tmp_path, lmc_backend="mp", lmc_era="lmc-mp1", tp=2, blocks=6, defects=("short", "zero_filled"))
    _, rows = scan_root(tmp_path, verify="none")
    got = {d["name"]: rows[d["relpath"]]["status"] for d in res.defects}
    assert got == {"short": "short", "zero_filled": "ok"}  # all zero needs the bytes
    _, rows = scan_root(tmp_path, verify="size")
    assert {d["name"]: rows[d["relpath"]]["status"] for d in res.defects} == {"short": "short",
                                                                              "zero_filled": "zero_filled"}
