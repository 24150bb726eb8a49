"""Every command x outcome -> the exit code of interface.md §4 and the README, run through
the command line on real synthetic trees (issue 16, defect 4 and 5).

Each situation below builds its tree and returns the arguments of the command under test;
the table says what that command must exit with. Unprivileged runs (a folder the walk
cannot list) go through `setpriv` as nobody, since root reads everything.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvmigrate import layout, manifest
from kvmigrate.migrate.journal import default_journal_dir, read_records

from helpers.cli_helpers import run

# a vLLM S1 full-attention tree, no guessed target
FACTS = ["--model-dtype", "bfloat16", "--kv-kind", "full", "--total-kv-heads", "8", "--writer-tp", "1", "--writer-pp", "1"]
TREE = {"family": "vllm", "scheme": "S1", "tp": 1}


def _journal(root: Path) -> Path:
    return Path(default_journal_dir(str(root)))


def _migrated(synth_root, *defects: str, root_name: str = "root") -> Path:
    root, _ = synth_root({**TREE, "defects": defects}, root_name=root_name)
    code, out = run("migrate", root, *FACTS, "--apply", "-q")
    assert code == 0, out
    return root


def _manifest_of(root: Path, tmp_path: Path) -> Path:
    out = tmp_path / "m.parquet"
    run("scan", root, *FACTS, "-o", out, "-q")
    assert out.is_file()
    return out


def _target_blocks(root: Path) -> list[Path]:
    """The block files migrate created (under the target rank folder, not the source's)."""
    journal = next(_journal(root).glob("*.journal"))
    done = read_records(journal)
    return [root / r["path"] for r in done if r.get("t") == "done" and r.get("kind") == "block"]


# --- situations: (tmp_path, synth_root) -> the command's arguments ------------------------

def scan_clean(tmp_path, synth_root):
    return ["scan", _migrated(synth_root), *FACTS, "-o", tmp_path / "m.parquet"]


def scan_pending(tmp_path, synth_root):
    root, _ = synth_root(TREE)
    return ["scan", root, *FACTS, "-o", tmp_path / "m.parquet"]


def scan_integrity(tmp_path, synth_root):
    return ["scan", _migrated(synth_root, "short"), *FACTS, "-o", tmp_path / "m.parquet"]


def audit_clean(tmp_path, synth_root):
    return ["audit", _migrated(synth_root), *FACTS]


def audit_pending(tmp_path, synth_root):
    root, _ = synth_root(TREE)
    return ["audit", root, *FACTS]


def audit_integrity(tmp_path, synth_root):
    return ["audit", _migrated(synth_root, "short"), *FACTS]


def report_clean(tmp_path, synth_root):
    return ["report", _manifest_of(_migrated(synth_root), tmp_path)]


def report_pending(tmp_path, synth_root):
    root, _ = synth_root(TREE)
    return ["report", _manifest_of(root, tmp_path)]


def report_integrity(tmp_path, synth_root):
    return ["report", _manifest_of(_migrated(synth_root, "short"), tmp_path)]


def dry_run_nothing_to_do(tmp_path, synth_root):
    return ["migrate", _migrated(synth_root), *FACTS]


def dry_run_work(tmp_path, synth_root):
    root, _ = synth_root(TREE)
    return ["migrate", root, *FACTS]


def dry_run_work_and_unrelated_defects(tmp_path, synth_root):
    """A short source block is not placed: reported in the plan, not failed on."""
    root, _ = synth_root({**TREE, "defects": ("short",)})
    return ["migrate", root, *FACTS]


def _occupied(tmp_path, synth_root) -> Path:
    """A tree whose first block's target path already holds other bytes (a conflict)."""
    root, (res,) = synth_root(TREE)
    target = next(iter(manifest.read_metadata(_manifest_of(root, tmp_path))["namespaces"].values()))["target"]
    blk = res.blocks[0]
    occupant = root / layout.block_relpath(target["base_name"], 0, blk["hex"], blk["group"])
    occupant.parent.mkdir(parents=True)
    occupant.write_bytes(b"\x09" * 4096)
    return root


def _damaged_block_to_place(tmp_path, synth_root) -> Path:
    """The scan's manifest, with one block it would link marked zero_filled (as a scan
    of a hand-damaged manifest or a helper's check would have it)."""
    root, _ = synth_root(TREE)
    m = _manifest_of(root, tmp_path)
    rows = manifest.read_table(m).to_pylist()
    next(r for r in rows if r["action"] == "link")["status"] = "zero_filled"
    out = tmp_path / "damaged.parquet"
    with manifest.ManifestWriter(out, manifest.read_metadata(m)) as w:
        w.write_columns({k: [r[k] for r in rows] for k in rows[0]})
    return out


def dry_run_damaged_block_to_place(tmp_path, synth_root):
    return ["migrate", "--manifest", _damaged_block_to_place(tmp_path, synth_root)]


def apply_damaged_block_to_place(tmp_path, synth_root):
    return ["migrate", "--manifest", _damaged_block_to_place(tmp_path, synth_root), "--apply"]


def dry_run_conflict(tmp_path, synth_root):
    return ["migrate", _occupied(tmp_path, synth_root), *FACTS]


def apply_with_unrelated_defects(tmp_path, synth_root):
    """Everything it could place is placed; the short source block is reported only."""
    root, _ = synth_root({**TREE, "defects": ("short",)})
    return ["migrate", root, *FACTS, "--apply"]


def apply_source_evicted_since_scan(tmp_path, synth_root):
    """changed_since_scan: the evictor removed a source between the scan and the apply."""
    root, _ = synth_root(TREE)
    m = _manifest_of(root, tmp_path)
    victim = next(r["relpath"] for r in manifest.read_table(m).to_pylist() if r["action"] == "link")
    (root / victim).unlink()
    return ["migrate", "--manifest", m, "--apply"]


def apply_conflict(tmp_path, synth_root):
    return ["migrate", _occupied(tmp_path, synth_root), *FACTS, "--apply"]


_held: list[int] = []


def apply_lock_held(tmp_path, synth_root):
    """Another run holds the target namespace's lock (flock: one open file each)."""
    root, _ = synth_root(TREE)
    m = _manifest_of(root, tmp_path)
    target = next(iter(manifest.read_metadata(m)["namespaces"].values()))["target"]["base_name"]
    (root / target).mkdir()
    fd = os.open(root / target / layout.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _held.append(fd)
    return ["migrate", "--manifest", m, "--apply"]


def verify_clean(tmp_path, synth_root):
    root = _migrated(synth_root)
    return ["verify", root, "--journal", _journal(root)]


def verify_evicted(tmp_path, synth_root, *extra):
    root = _migrated(synth_root)
    _target_blocks(root)[0].unlink()  # what the engine's evictor does
    return ["verify", root, "--journal", _journal(root), *extra]


def verify_evicted_strict(tmp_path, synth_root):
    return verify_evicted(tmp_path, synth_root, "--strict")


def verify_corrupted(tmp_path, synth_root):
    root = _migrated(synth_root)
    block = _target_blocks(root)[0]
    with open(block, "r+b") as f:
        f.write(b"\xee" * 8)
    return ["verify", root, "--journal", _journal(root)]


def verify_other_roots_journal(tmp_path, synth_root):
    a = _migrated(synth_root, root_name="a")
    b = _migrated(synth_root, root_name="b")
    return ["verify", a, "--journal", _journal(b)]


def rollback_ok(tmp_path, synth_root):
    return ["rollback", _journal(_migrated(synth_root))]


def identity_missing_fact(tmp_path, synth_root):
    root, _ = synth_root(TREE)
    return ["identity", next(root.glob(f"*/{layout.CONFIG_NAME}"))]


def missing(*argv):
    def situation(tmp_path, synth_root):
        return [a if a != "MISSING" else tmp_path / "no-such-path" for a in argv]
    situation.__name__ = "missing path"
    return situation


def tree_then(*argv):
    def situation(tmp_path, synth_root):
        root, _ = synth_root(TREE)
        return [a if a != "ROOT" else root for a in argv]
    situation.__name__ = "bad option value"
    return situation


TABLE = [
    # command, situation, expected exit code
    ("scan", scan_clean, 0),
    ("scan", scan_pending, 1),
    ("scan", scan_integrity, 5),
    ("audit", audit_clean, 0),
    ("audit", audit_pending, 1),
    ("audit", audit_integrity, 5),
    ("report", report_clean, 0),
    ("report", report_pending, 1),
    ("report", report_integrity, 5),
    ("migrate", dry_run_nothing_to_do, 0),
    ("migrate", dry_run_work, 1),
    ("migrate", dry_run_work_and_unrelated_defects, 1),
    ("migrate", dry_run_conflict, 1 | 4),
    ("migrate", dry_run_damaged_block_to_place, 1 | 4),
    ("migrate --apply", apply_damaged_block_to_place, 4),
    ("migrate --apply", apply_with_unrelated_defects, 0),
    ("migrate --apply", apply_source_evicted_since_scan, 0),
    ("migrate --apply", apply_conflict, 4),
    ("migrate --apply", apply_lock_held, 8),
    ("verify", verify_clean, 0),
    ("verify", verify_evicted, 1),
    ("verify", verify_evicted_strict, 4),
    ("verify", verify_corrupted, 4),
    ("verify", verify_other_roots_journal, 2),
    ("rollback", rollback_ok, 0),
    ("identity", identity_missing_fact, 2),
    ("scan", missing("scan", "MISSING"), 2),
    ("audit", missing("audit", "MISSING"), 2),
    ("report", missing("report", "MISSING"), 2),
    ("migrate", missing("migrate", "MISSING", *FACTS), 2),
    ("migrate --apply", missing("migrate", "MISSING", *FACTS, "--apply"), 2),
    ("migrate --manifest", missing("migrate", "--manifest", "MISSING"), 2),
    ("verify", missing("verify", "MISSING"), 2),
    ("rollback", missing("rollback", "MISSING"), 2),
    ("identity", missing("identity", "MISSING"), 2),
    ("scan", tree_then("scan", "ROOT", "--shard", "3/2"), 2),
    ("audit", tree_then("audit", "ROOT", "--threads", "0"), 2),
    ("migrate", tree_then("migrate", "ROOT", "--mode", "bogus"), 2),
    ("verify", tree_then("verify", "ROOT", "--target", "vllm-9"), 2),
    ("report", tree_then("report", "ROOT", "--format", "pdf"), 2),
]


@pytest.mark.parametrize("command, situation, expected", TABLE,
                         ids=[f"{c}-{s.__name__.replace('_', ' ')}-{e}" for c, s, e in TABLE])
def test_exit_code(tmp_path, synth_root, command, situation, expected):
    argv = situation(tmp_path, synth_root)
    try:
        code, out = run(*argv)
    finally:
        while _held:
            os.close(_held.pop())
    assert code == expected, out
    assert "Traceback" not in out


# --- the walk cannot list a folder: bit 8 (as an unprivileged user) ------------------------

@pytest.fixture
def unlistable_tree(tmp_path):
    """A pending tree whose first bucket folder nobody may list, in a folder nobody can
    traverse (pytest's tmp dirs are private to root)."""
    from kvmigrate.synth import SynthSpec, build

    d = Path(tempfile.mkdtemp(prefix="kvmigrate-nobody-", dir="/tmp"))
    os.chmod(d, 0o755)
    root, out = d / "root", d / "out"
    result = build(root, SynthSpec(**TREE, layers=2, page_bytes=256, blocks=4))
    out.mkdir()
    os.chmod(out, 0o777)
    bucket = root.joinpath(*Path(result.block_files()[0]).parts[:2])
    os.chmod(bucket, 0)
    yield root, out
    os.chmod(bucket, 0o755)
    shutil.rmtree(d)


def _as_nobody(*argv) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                           "kvmigrate", *map(str, argv)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", ["scan", "audit", "report"])
def test_a_folder_the_walk_cannot_list_sets_bit_8(unlistable_tree, command):
    """unreadable (1|8) besides the pending work (1): 9, for the report of that scan too."""
    root, out = unlistable_tree
    m = out / "m.parquet"
    argv = {"scan": ["scan", root, *FACTS, "-o", m, "-q"], "audit": ["audit", root, *FACTS, "-q"],
            "report": ["report", m]}[command]
    if command == "report":
        assert _as_nobody("scan", root, *FACTS, "-o", m, "-q").returncode == 9
    done = _as_nobody(*argv)
    assert done.returncode == 1 | 8, done.stderr
    assert "Traceback" not in done.stderr
