"""One scan per synth defect: the manifest shows the defect's status and reason on exactly
the rows synth says, every other row is healthy, and the exit code carries the state's bits."""

from __future__ import annotations

import os

import pytest

from kvmigrate.classify import STATUS_BITS
from kvmigrate.synth.spec import BLOCK_DEFECTS, TREE_DEFECTS

# One base deployment per family (vLLM in two eras: S1 is the ambiguous one).
BASES = {
    "vllm-S1": dict(family="vllm", scheme="S1"),
    "vllm-S3": dict(family="vllm", scheme="S3"),
    "llmd": dict(family="llmd", tp=2, kv_kind="mla"),
    "vllmcpp": dict(family="vllmcpp", tp=2, kv_kind="mla"),
}
# Defects a scan must see with --verify hash (content, not size).
NEEDS_HASH = {"replica_differs", "zero_filled"}
# Facts that prove llm-d page geometry (padded_legacy needs B x T x P).
GEOMETRY = {"kv_kind": "mla", "page_bytes": 256}
# `unreadable` is proven in test_scan_safety.py (root reads everything).
CASES = [
    (base, defect)
    for defect, families in {**BLOCK_DEFECTS, **TREE_DEFECTS}.items() if defect != "unreadable"
    for base, spec in BASES.items() if spec["family"] in families
    and not (defect in ("missing_rank", "replica_differs") and spec["family"] == "vllm")
]


def _flags(base: str, defect: str) -> dict:
    flags = {"model_dtype": "bfloat16"}
    if base == "llmd":
        flags["kv_kind"] = "mla"  # replicas are only compared when the kv kind says MLA
    if defect == "padded_legacy":
        flags.update(GEOMETRY)
    return flags


@pytest.mark.parametrize("base,defect", CASES, ids=[f"{d}-{b}" for b, d in CASES])
def test_defect_is_reported_on_its_rows_only(synth_root, scan_root, base, defect):
    root, (result,) = synth_root(dict(BASES[base], defects=(defect,)))
    verify = "hash" if defect in NEEDS_HASH else "size"
    scan, rows = scan_root(root, verify=verify, flags=_flags(base, defect))

    expected: dict[str, tuple[str, str]] = {}
    for rec in result.defects:
        for rel in rec["rows"]:
            expected[rel] = (rec["status"], rec["reason"])
    assert expected, "synth recorded no rows for this defect"
    for rel, (status, fragment) in expected.items():
        assert rel in rows, f"{rel} missing from the manifest"
        row = rows[rel]
        assert row["status"] == status, (rel, row["status"], row["reason"])
        assert fragment.lower() in row["reason"].lower(), (rel, row["reason"])
        assert row["action"] == "none"
    mislabelled = {rel: (r["status"], r["reason"]) for rel, r in rows.items()
                   if rel not in expected and r["status"] not in ("ok", "own_artifact")}
    assert not mislabelled
    status = next(iter(expected.values()))[0]
    assert scan.exit_code == STATUS_BITS[status]
    assert scan.summary["totals"]["by_status"][status]["files"] == len(expected)


def test_every_synth_file_has_a_row(synth_root, scan_root):
    """Defects that add files (temp, foreign, symlink, FIFO) still leave one row per file."""
    root, (result,) = synth_root(dict(BASES["llmd"], defects=("tmp_vllm", "tmp_cpp_block", "tmp_cpp_config",
                                                               "tmp_probe", "foreign", "symlink", "fifo")))
    _, rows = scan_root(root)
    on_disk = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_symlink() or not p.is_dir()}
    assert on_disk == set(rows)


def test_replica_difference_needs_hashes(synth_root, scan_root):
    """Equal-size replicas that differ are invisible to --verify size; the plan says the
    replicas are not verified yet instead of calling them equal."""
    root, (result,) = synth_root(dict(BASES["llmd"], defects=("replica_differs",)))
    scan, rows = scan_root(root, verify="size", flags={"model_dtype": "bfloat16", "kv_kind": "mla"})
    victim = result.defect("replica_differs")["rows"][0]
    assert rows[victim]["status"] == "ok"
    assert "not yet verified" in rows[victim]["reason"]
    assert rows[victim]["action"] in ("link", "copy_pad")


def test_incomplete_block_names_the_missing_rank(synth_root, scan_root):
    root, (result,) = synth_root(dict(BASES["llmd"], defects=("missing_rank",)))
    _, rows = scan_root(root, flags={"model_dtype": "bfloat16"})
    d = result.defect("missing_rank")
    for rel in d["rows"]:
        assert f"rank {d['rank']} file missing" in rows[rel]["reason"]
        assert rows[rel]["target_relpath"] is None


def test_zero_filled_vllmcpp_seen_without_hashing(synth_root, scan_root):
    """A vllm.cpp header of zeros makes scan read the whole file even with --verify size,
    so crash residue is called zero_filled, not just a bad magic."""
    root, (result,) = synth_root(dict(BASES["vllmcpp"], defects=("zero_filled",)))
    scan, rows = scan_root(root, verify="size")
    rel = result.defect("zero_filled")["rows"][0]
    assert rows[rel]["status"] == "zero_filled"


def test_header_checks_run_without_hashing(synth_root, scan_root):
    root, (result,) = synth_root(dict(BASES["vllmcpp"], defects=("header_digest",)))
    scan, rows = scan_root(root, verify="size")
    rel = result.defect("header_digest")["rows"][0]
    assert rows[rel]["status"] == "header_invalid" and "'digest'" in rows[rel]["reason"]
    assert rows[rel]["content_xxh3_128"] is None


def test_padded_legacy_without_geometry_is_a_size_outlier(synth_root, scan_root):
    """Without page facts the 16 MiB file is not proven padded: it is the odd size of its
    (namespace, rank, group), and the reason names the norm."""
    root, (result,) = synth_root(dict(BASES["llmd"], defects=("padded_legacy",)))
    _, rows = scan_root(root, flags={"model_dtype": "bfloat16"})
    for rel in result.defect("padded_legacy")["rows"]:
        assert rows[rel]["status"] == "size_mismatch"
        assert "most of its files are 512 bytes" in rows[rel]["reason"]


def test_digest_mismatch_blocks_are_never_migrated(synth_root, scan_root):
    root, (result,) = synth_root(dict(BASES["vllm-S3"], defects=("digest_mismatch",)))
    scan, rows = scan_root(root)
    blocks = [r for r in rows.values() if r["block_hash"] is not None]
    assert blocks and all(r["action"] == "none" and "digest mismatch" in r["reason"] for r in blocks)
    ns = next(iter(scan.summary["namespaces"]))
    assert ns["status"] == "digest_mismatch" and ns["digest_ok"] is False


@pytest.mark.parametrize("defect,status", [("digest_mismatch", "digest_mismatch"),
                                           ("config_unparsable", "config_invalid")])
def test_blocks_of_an_unproven_namespace_carry_its_status(synth_root, scan_root, walk, defect, status):
    """interface.md §2: the blocks of a namespace whose config.json does not prove its folder
    carry the namespace's status (never `ok`), in both walks, so bytes by status add up."""
    root, (result,) = synth_root(dict(BASES["vllm-S3"], defects=(defect,)))
    scan, rows = scan_root(root)
    blocks = [r for r in rows.values() if r["block_hash"] is not None]
    assert len(blocks) == len(result.block_files())
    assert all(r["status"] == status and r["action"] == "none" for r in blocks), {r["status"] for r in blocks}
    by_status = scan.summary["totals"]["by_status"]
    assert set(by_status) == {status}
    assert by_status[status]["bytes"] == sum(r["size"] for r in rows.values())


def _rchar() -> int:
    """Bytes this process has read through read()-like calls (page cache included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.parametrize("base", ["vllm-S1", "llmd", "vllmcpp"])
def test_a_sparse_block_is_zero_filled_without_reading_its_holes(synth_root, scan_root, walk, base):
    """A block file that is nothing but holes (an ftruncate-d crash residue; the hostile
    trees' 1 TiB sparse file) reads as zeros: a hash scan, which `migrate ROOT` runs by
    default, calls it zero_filled from SEEK_DATA instead of reading gigabytes of zeros."""
    root, (result,) = synth_root(BASES[base])
    victim = sorted(root.glob("*_r*/*/*/*.bin"))[0]
    victim.write_bytes(b"")
    os.truncate(victim, 4 << 30)  # 4 GiB of holes
    before = _rchar()
    scan, rows = scan_root(root, verify="hash")
    assert _rchar() - before < 256 << 20  # far less than the hole: never read
    row = rows[str(victim.relative_to(root))]
    assert row["status"] == "zero_filled" and row["action"] == "none"
