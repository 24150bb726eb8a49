"""Crash consistency of prune, restore and purge (issue 19): kill -9 at every step of the
protocol (the KVMIGRATE_CRASH_AT seam), then rerun: it converges, nothing is lost and
nothing is half-moved. The oracle is the tree itself: every legacy file's inode, with its
bytes, is at its own path or at its quarantine path, never neither."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
from pathlib import Path

import pytest

from kvmigrate import layout
from kvmigrate.migrate.apply import CRASH_ENV
from kvmigrate.synth import SynthSpec, build

from helpers import reliability_harness as R  # tests/helpers/reliability_harness.py: the kvmigrate executable it drives
from helpers.cli_helpers import run

pytestmark = pytest.mark.slow

MLA = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]
SPECS = [dict(family="llmd", tp=2, kv_kind="mla"), dict(family="vllm", scheme="S2", kv_kind="mla", model_name="org/v")]
PRUNE = ["prune", *MLA, "--quiet-period", "0", "--apply", "-q"]
QUARANTINE = Path(layout.OWN_DIR) / "quarantine"
JOURNALS = Path(layout.OWN_DIR) / "journals" / "prune"


def _migrated_root(work: Path) -> tuple[Path, dict[str, tuple[int, str]]]:
    root = work / "root"
    root.mkdir()
    for spec in SPECS:
        build(root, SynthSpec(**{"layers": 2, "page_bytes": 256, "blocks": 6, **spec}))
    legacy = {rel: _facts(root / rel) for rel in _files(root)}
    code, out = run("migrate", root, *MLA, "--apply", "-q")
    assert code == 0, out
    return root, legacy


def _files(root: Path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root)
                  if not os.path.relpath(d, root).startswith(layout.OWN_DIR) for f in fs)


def _facts(path: Path) -> tuple[int, str]:
    return os.lstat(path).st_ino, hashlib.sha256(path.read_bytes()).hexdigest()


def _kvmigrate(*args, crash: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(CRASH_ENV, None)
    if crash:
        env[CRASH_ENV] = crash
    return subprocess.run([R.KVMIGRATE, *map(str, args)], env=env, capture_output=True, text=True, timeout=120)


def _where(root: Path, legacy: dict[str, tuple[int, str]]) -> dict[str, str]:
    """Each legacy file: 'home', 'quarantine' or a violation (lost, duplicated, changed)."""
    quarantined: dict[str, list[Path]] = {}
    if (root / QUARANTINE).is_dir():
        for run_dir in (root / QUARANTINE).iterdir():
            for rel in _files(run_dir):
                quarantined.setdefault(rel, []).append(run_dir / rel)
    out = {}
    for rel, facts in legacy.items():
        places = [p for p in [root / rel, *quarantined.get(rel, [])] if p.exists()]
        good = [p for p in places if _facts(p) == facts]
        if len(places) != 1 or len(good) != 1:
            out[rel] = f"violation: {len(places)} names, {len(good)} with its inode and bytes"
        else:
            out[rel] = "home" if good[0] == root / rel else "quarantine"
    return out


@pytest.mark.parametrize("point", ["prune_intent:1", "prune_move:1", "prune_move:9", "prune_dirs:1"])
def test_kill_9_during_prune_then_rerun_converges_and_restore_returns_everything(tmp_path, point):
    root, legacy = _migrated_root(tmp_path)
    killed = _kvmigrate(*PRUNE[:1], root, *PRUNE[1:], crash=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    where = _where(root, legacy)
    assert not [v for v in where.values() if v.startswith("violation")], where
    again = _kvmigrate(*PRUNE[:1], root, *PRUNE[1:])
    assert again.returncode == 0, again.stdout + again.stderr
    assert set(_where(root, legacy).values()) == {"quarantine"}  # converged: all of it pruned
    restored = _kvmigrate("restore", root / JOURNALS)
    assert restored.returncode == 0, restored.stdout + restored.stderr
    assert set(_where(root, legacy).values()) == {"home"}


@pytest.mark.parametrize("point", ["prune_intent:1", "prune_move:5"])
def test_restore_of_a_killed_prune_returns_what_it_moved(tmp_path, point):
    root, legacy = _migrated_root(tmp_path)
    assert _kvmigrate(*PRUNE[:1], root, *PRUNE[1:], crash=point).returncode == -signal.SIGKILL
    restored = _kvmigrate("restore", root / JOURNALS)
    assert restored.returncode == 0, restored.stdout + restored.stderr
    assert set(_where(root, legacy).values()) == {"home"}


@pytest.mark.parametrize("point", ["restore:1", "restore:10"])
def test_kill_9_during_restore_then_rerun_converges(tmp_path, point):
    root, legacy = _migrated_root(tmp_path)
    assert _kvmigrate(*PRUNE[:1], root, *PRUNE[1:]).returncode == 0
    assert _kvmigrate("restore", root / JOURNALS, crash=point).returncode == -signal.SIGKILL
    assert not [v for v in _where(root, legacy).values() if v.startswith("violation")]
    again = _kvmigrate("restore", root / JOURNALS)
    assert again.returncode == 0, again.stdout + again.stderr
    assert set(_where(root, legacy).values()) == {"home"}


def test_kill_9_during_purge_then_rerun_finishes_it(tmp_path):
    root, legacy = _migrated_root(tmp_path)
    assert _kvmigrate(*PRUNE[:1], root, *PRUNE[1:]).returncode == 0
    purge = ["prune", root, "--purge", "--older-than", "0s", "--apply"]
    assert _kvmigrate(*purge, crash="purge:1").returncode == -signal.SIGKILL
    again = _kvmigrate(*purge)
    assert again.returncode == 0, again.stdout + again.stderr
    assert not any((root / QUARANTINE).iterdir())
    said = _kvmigrate("restore", root / JOURNALS)
    assert said.returncode == 8 and "purged" in said.stdout
    # the migrated targets still hold every block: nothing was lost by prune + purge
    assert _kvmigrate("verify", root).returncode == 0


@pytest.mark.parametrize("err", ["EXDEV", "EACCES", "EROFS"])
def test_a_move_that_fails_is_kept_named_and_the_rerun_converges(tmp_path, monkeypatch, err):
    import errno

    root, legacy = _migrated_root(tmp_path)
    real, calls = os.rename, []

    def failing(src, dst, *args, **kwargs):
        calls.append(src)
        if len(calls) == 3:
            raise OSError(getattr(errno, err), os.strerror(getattr(errno, err)), src)
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", failing)
    code, out = run(*PRUNE[:1], root, *PRUNE[1:-1])
    monkeypatch.setattr(os, "rename", real)
    assert code == 8, out
    assert "could not be moved" in out and "hint:" in out and str(root) in out
    if err == "EXDEV":
        assert "same filesystem" in out
    where = _where(root, legacy)
    assert list(where.values()).count("home") >= 1 and not [v for v in where.values() if v.startswith("violation")]
    code, out = run(*PRUNE[:1], root, *PRUNE[1:-1])
    assert code == 0, out
    assert set(_where(root, legacy).values()) == {"quarantine"}
    code, out = run("restore", root / JOURNALS)
    assert code == 0, out
    assert set(_where(root, legacy).values()) == {"home"}


def test_no_space_for_the_journal_moves_nothing(tmp_path, monkeypatch):
    """Write-ahead: the intent must be on disk before the first file moves."""
    import errno

    from kvmigrate.migrate import journal

    root, legacy = _migrated_root(tmp_path)
    real = journal.os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(journal.os, "fsync", full)
    code, out = run(*PRUNE[:1], root, *PRUNE[1:-1])
    monkeypatch.setattr(journal.os, "fsync", real)
    assert code == 8 and "no space" in out and "hint:" in out
    assert set(_where(root, legacy).values()) == {"home"}
