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


def test_run_states_reads_a_store_intent_a_piece_at_a_time(tmp_path, monkeypatch):
    """The states `report` and `prune` ask of a journal (`run_states`) come from a few short
    lines; a Mooncake store's intent is one line of ~3 KB a resharded block in its own
    frame. It is decompressed a piece at a time and never held (traced peak under 4 MiB for
    a 24 MiB intent; the whole frame was decompressed and split before). The lines read are
    those of the whole-frame reader, for any piece size, and none of a torn frame."""
    import io
    import random
    import tracemalloc
    import zlib

    path = tmp_path / "run.journal"
    w = jn.JournalWriter.create(str(path), {"run_id": "r", "root": str(tmp_path), "dest": str(tmp_path)})
    w.write({"t": "target", "base": "b"})
    intent = '{"t":"mc_intent","store":"s","reshards":[' + ",".join(['{"k":"' + "ab" * 1_500 + '"}'] * 9_000) + "]}"
    w.write_parts(iter([intent[i:i + 65_536] for i in range(0, len(intent), 65_536)]), sync=True)
    w.write({"t": "complete"}, sync=True)
    w.close()
    whole = jn.load_runs(str(path), paths=False)
    tracemalloc.start()
    runs = jn.run_states(str(path))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(intent) > 24 << 20 and peak < 4 << 20, peak
    assert [(r.header, r.targets, r.complete, r.rolled_back) for r in runs] == [
        (r.header, r.targets, r.complete, r.rolled_back) for r in whole]
    assert runs[0].complete is not None and runs[0].targets == {"b": {"t": "target", "base": "b"}}

    rng = random.Random(1)
    for _ in range(200):
        lines = [b'{"t":"%s","b":"%s"}' % (rng.choice([b"header", b"target", b"mc_intent", b"done", b"complete"]),
                                            b"x" * rng.choice([0, 1, 5, 40, 3_000])) for _ in range(rng.randint(0, 9))]
        data = b"\n".join(lines) + (b"\n" if rng.random() < 0.7 else b"")
        payload = zlib.compress(data)
        frame = jn.FRAME.pack(jn.MAGIC, len(payload), zlib.crc32(payload)) + payload
        monkeypatch.setattr(jn, "_PIECE", rng.choice([1, 2, 7, 64, 1 << 20]))
        want = [line for line in data.splitlines() if line.startswith(jn._STATE_RECORDS)]
        assert list(jn._wanted_lines(io.BytesIO(frame * 2), jn._STATE_RECORDS)) == want * 2
        assert list(jn._wanted_lines(io.BytesIO(frame + frame[:-1]), jn._STATE_RECORDS)) == want


def test_stream_runs_reads_a_store_intent_without_its_reshards(monkeypatch):
    """verify and rollback (`stream_runs`, `path_records`) never read an intent's reshards
    array (each block's sources and outputs): it is dropped as the frame is read, never
    held, and a store's records are not parsed for the path records. The lines are those of
    the whole-frame reader with that array emptied, for any piece size."""
    import io
    import random
    import zlib

    rng = random.Random(2)

    def emptied(rec: dict) -> dict:
        return {**rec, "reshards": []} if rec["t"] == "mc_intent" else rec

    for _ in range(500):
        recs = []
        for _ in range(rng.randint(1, 8)):  # (a frame holds a record at least)
            t = rng.choice(["header", "target", "mc_intent", "done", "complete", "mc_pair"])
            rec: dict = {"t": t, "store": "s" * rng.choice([0, 3, 30])}
            if t == "mc_intent":  # (a path may hold the text that ends the array: a JSON string escapes it)
                rec.update({"proof": None, "rewrites": [{"meta": "m"}] * rng.randint(0, 2), "entries": [],
                            "reshards": [{"sources": [{"relpath": 'a],"pairs":[' * rng.randint(0, 2),
                                                       "key": "ab" * rng.randint(0, 50)}]}
                                         for _ in range(rng.randint(0, 5))],
                            "pairs": [{"client": "c", "id": 1}] * rng.randint(0, 2), "outputs": [], "clients": []})
            recs.append(rec)
        data = b"\n".join(jn._ENCODE(r).encode() for r in recs) + (b"\n" if rng.random() < 0.7 else b"")
        payload = zlib.compress(data)
        frame = jn.FRAME.pack(jn.MAGIC, len(payload), zlib.crc32(payload)) + payload
        monkeypatch.setattr(jn, "_PIECE", rng.choice([1, 2, 3, 7, 13, 64, 1 << 20]))
        got = [json.loads(line) for line in jn._wanted_lines(io.BytesIO(frame), jn._STREAM_RECORDS,
                                                             jn._INTENT_RESHARDS)]
        assert got == [emptied(r) for r in recs if jn._ENCODE(r).encode().startswith(jn._STREAM_RECORDS)]
        skipped = [json.loads(line) for _, lines in jn._frame_lines(io.BytesIO(frame), (b"",), skip=(b'{"t":"mc_',))
                   for line in lines]
        assert skipped == [r for r in recs if not r["t"].startswith("mc_")]
