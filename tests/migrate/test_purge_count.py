"""What a purge frees (kvmigrate/migrate/restore.py `_count`): the bytes of the files whose
every name is in the quarantine, each inode once, counted with the hard-linked files
beyond `_Inodes.HELD` in parts on disk (TMPDIR): the same figures as held whole, the parts'
folder removed after, and never more than HELD of them in memory."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from kvmigrate.migrate import restore


def _quarantine(tmp_path: Path) -> tuple[Path, int, int]:
    """A folder of files of one name (freed), pairs of names both in it (freed once), files
    with a name outside (kept), and a file of three names, one outside (kept): (folder,
    files, bytes freed)."""
    q, outside = tmp_path / "q", tmp_path / "target"
    freed = files = 0
    for k in range(40):
        p = q / f"a{k % 7}" / f"one{k}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * (k + 1))
        files, freed = files + 1, freed + k + 1
    for k in range(30):
        p = q / f"b{k % 5}" / f"pair{k}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"y" * (100 + k))
        again = q / f"b{(k + 1) % 5}" / f"pair{k}.again"
        again.parent.mkdir(parents=True, exist_ok=True)
        os.link(p, again)
        files, freed = files + 2, freed + 100 + k
    outside.mkdir()
    for k in range(50):
        p = q / f"c{k % 3}" / f"linked{k}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"z" * 1000)
        os.link(p, outside / f"linked{k}.bin")
        files += 1
    p = q / "d" / "three.bin"
    p.parent.mkdir(parents=True)
    p.write_bytes(b"w" * 5000)
    os.link(p, q / "d" / "three.again")
    os.link(p, outside / "three.bin")
    return q, files + 2, freed


@pytest.mark.parametrize("held, parts", [(7, 3), (1, 64), (10_000, 64)])
def test_a_purge_counts_in_parts_what_it_counts_whole(tmp_path, monkeypatch, held, parts):
    work = tmp_path / "tmp"
    work.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(work))
    q, files, freed = _quarantine(tmp_path)
    most = []
    spill = restore._Inodes._spill

    def watched(self):
        most.append(self.n)
        spill(self)

    monkeypatch.setattr(restore._Inodes, "HELD", held)
    monkeypatch.setattr(restore._Inodes, "PARTS", parts)
    monkeypatch.setattr(restore._Inodes, "_spill", watched)
    assert restore._count(str(q)) == (files, freed)
    assert all(n <= held for n in most)
    assert bool(most) == (held < 30 * 2 + 50 + 2)  # (spilled only when the linked files outnumber HELD)
    assert list(work.iterdir()) == []
