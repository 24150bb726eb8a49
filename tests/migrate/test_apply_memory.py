"""What an apply keeps for the whole run is compact: the folders it made (digests) and
the inodes earlier runs linked (arrays per device, read from their journals)."""

from __future__ import annotations

import json

from kvmigrate.migrate.fsops import FolderSet
from kvmigrate.migrate.sources import LinkedInodes

BASE_X = "meta-llama_Llama-3.1-8B-Instruct_1446626a3783"
BASE_Y = "meta-llama_Llama-3.1-8B-Instruct_cb9d954483ca"


def test_folder_set_is_a_set_of_paths():
    made = FolderSet(64)
    folders = [f"{BASE_X}_r0/{b:03x}/{s:02x}_g0" for b in range(40) for s in range(3)]
    for f in folders + folders[:5]:
        made.add(f)
    assert len(made) == len(folders)
    assert all(f in made for f in folders)
    assert f"{BASE_Y}_r0/000/00_g0" not in made
    made.clear()
    assert len(made) == 0 and folders[0] not in made


def _link(base: str, ino: int) -> dict:
    return {"kind": "block", "action": "link", "path": f"{base}_r0/abc/de_g0/{ino:064x}.bin", "dev": 7, "ino": ino,
            "size": 4096, "src": "x", "base": base}


def test_linked_inodes_of_earlier_runs(tmp_path):
    """Every run's link intents but the run being written, and without the targets a
    rollback of some targets took back (as journal.load_runs drops them)."""
    journals = tmp_path / "journals"
    journals.mkdir()
    head = {"t": "header", "v": 1, "root": str(tmp_path), "dest": str(tmp_path)}
    records = [
        {**head, "run_id": "A"},
        {"t": "target", "base": BASE_X}, {"t": "target", "base": BASE_Y},
        {"t": "intent", "items": [_link(BASE_X, 10), _link(BASE_Y, 11), {"kind": "dir", "path": f"{BASE_X}_r0"}]},
        {"t": "complete", "outcomes": {}},
        {"t": "rolled_back", "targets": [BASE_Y]},
        {**head, "run_id": "B"},
        {"t": "target", "base": BASE_X},
        {"t": "intent", "items": [_link(BASE_X, 12)]},
    ]
    path = journals / "20260101T000000Z-1-aaaaaa.journal"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    written = path.stat().st_mtime_ns
    ours = LinkedInodes.of_journals([str(journals)], "B")
    assert ours.written(7, 10) == written
    assert ours.written(7, 11) == -1  # its target was rolled back
    assert ours.written(7, 12) == -1  # the run being written
    assert ours.written(8, 10) == -1
    assert LinkedInodes.of_journals([str(journals)], None).written(7, 12) == written
