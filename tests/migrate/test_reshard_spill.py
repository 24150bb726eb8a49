"""The on-disk pieces of a Mooncake reshard (migrate/reshard_spill.py, the journal's
`write_parts`): each gives what its in-memory counterpart gave, so a plan, its intent and
its journal are the same bytes."""

from __future__ import annotations

import json
import random

from kvmigrate.migrate import journal as jn
from kvmigrate.migrate import reshard_spill as S


def test_sort_is_sorted_and_stable_across_runs_and_merges(monkeypatch):
    monkeypatch.setattr(S, "MERGE_RUNS", 3)  # (runs merged before the last merge, too)
    rng = random.Random(5)
    records = [(rng.randint(0, 20), i) for i in range(2_000)]
    for run in (1, 7, 64, 5_000):
        assert list(S.sort(records, key=lambda r: r[0], run=run)) == sorted(records, key=lambda r: r[0])
    assert list(S.sort([], key=lambda r: r)) == []


def test_a_spill_reads_back_its_records_in_order_and_by_offset():
    spill = S.Spill([(1, b"a"), {"k": [2, 3]}, b"x" * 100_000])
    spill.append("last")
    assert len(spill) == 4
    assert list(spill) == [(1, b"a"), {"k": [2, 3]}, b"x" * 100_000, "last"]
    items = list(spill.items())
    assert [spill.at(at) for at, _ in items] == [rec for _, rec in items]
    assert list(spill) == list(spill)  # (read as often as needed)
    assert len(S.Spill()) == 0 and list(S.Spill()) == []


def test_write_parts_makes_the_frame_write_makes(tmp_path):
    """A record in parts, after held done records, is the same file as the record written
    whole: the same frame, compressed alike."""
    rec = {"t": "mc_intent", "store": "s", "rewrites": [{"meta": f"m{i}", "keys": {str(i): "ab" * i}}
                                                         for i in range(3_000)], "dest": True}
    text = jn._ENCODE(rec)
    parts = [text[i:i + 97] for i in range(0, len(text), 97)]
    files = []
    for name, write in (("whole", lambda w: w.write(rec, sync=True)),
                        ("parts", lambda w: w.write_parts(iter(parts), sync=True))):
        path = tmp_path / f"{name}.journal"
        w = jn.JournalWriter.create(str(path), {"run_id": "r"})
        w.done({"path": "a", "size": 1})
        write(w)
        w.write({"t": "complete"}, sync=True)
        w.close()
        files.append(path.read_bytes())
    assert json.loads(text) == rec
    assert files[0] == files[1]
