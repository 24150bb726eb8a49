"""Injected faults on real filesystems, CI-sized (migration.md §3.9): ENOSPC on a small
tmpfs (an injected write failure where mount is refused), EXDEV, EROFS, EACCES and EPERM
as uid 65534, EMLINK (shim and the filesystem's real limit). Each: the documented message
(what, where, what to do) and exit 8, a tree the journal accounts for, a rerun after
fixing the condition that ends like an uninterrupted run, and a rollback."""

from __future__ import annotations

import pytest

from helpers import reliability_harness as R  # tests/helpers/reliability_harness.py: the campaign's benches and oracles

pytestmark = pytest.mark.slow  # reliability-sized: `pytest -m 'not slow'` leaves it out, CI runs it


def check(record: dict, ledger: R.Ledger) -> dict:
    assert ledger.violations == [], "\n".join(ledger.violations)
    assert record["ok"], record["problems"]
    assert record["mechanism"] and not record["mechanism"].startswith("skipped"), record
    return record


def test_enospc_on_a_full_destination(tmp_path):
    ledger = R.Ledger()
    rec = check(R.fault_enospc(tmp_path, ledger), ledger)
    # the mechanism used is recorded: a mounted tmpfs, or the injected fault where mount is refused
    assert rec["mechanism"].startswith(("tmpfs", "injected"))
    assert "no space left on device" in rec["message"]
    assert rec["created_before_stop"] > 0  # it stopped mid-run, not before the first block


def test_enospc_injected_where_mount_is_not_available(tmp_path):
    ledger = R.Ledger()
    rec = check(R.fault_enospc(tmp_path, ledger, force_injected=True), ledger)
    assert rec["mechanism"].startswith("injected") and rec["created_before_stop"] > 0


def test_enospc_where_the_journal_lives(tmp_path):
    ledger = R.Ledger()
    rec = R.fault_enospc_journal(tmp_path, ledger)
    check(rec, ledger)
    assert "no space left" in rec["message"]


@pytest.mark.parametrize("fault", [R.fault_exdev_shm, R.fault_exdev_bind])
def test_exdev(tmp_path, fault):
    ledger = R.Ledger()
    rec = check(fault(tmp_path, ledger), ledger)
    assert "across filesystems" in rec["message"]


@pytest.mark.parametrize("fault", [R.fault_erofs, R.fault_erofs_root])
def test_erofs(tmp_path, fault):
    ledger = R.Ledger()
    rec = check(fault(tmp_path, ledger), ledger)
    assert "read-only" in rec["message"].lower()


def test_eacces_as_an_unprivileged_user(tmp_path):
    ledger = R.Ledger()
    rec = check(R.fault_eacces(tmp_path, ledger), ledger)
    assert "permission denied" in rec["message"] and rec["created_before_stop"] > 0


def test_eperm_hard_links_to_files_of_another_user(tmp_path):
    ledger = R.Ledger()
    rec = check(R.fault_eperm_hardlink(tmp_path, ledger), ledger)
    assert "protected_hardlinks" in rec["message"]


@pytest.mark.parametrize("real", [False, True], ids=["shim", "real-limit"])
def test_emlink(tmp_path, real):
    ledger = R.Ledger()
    rec = check(R.fault_emlink(tmp_path, ledger, real=real), ledger)
    assert "1 block failed" in rec["message"]
