"""A Mooncake store's intent in journal format 3 (migrate/stores.py `intent_parts`): a
head and `mc_part` records of about PART_BYTES each, in the intent's own frame, so that
verify and rollback read a part at a time (journal `store_records`) and rollback sorts
what it must settle on disk (migrate/store_undo.py). A format-2 journal (one intent
record) reads the same: resumed, verified and rolled back."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
from test_mooncake_migrate import MC, reads_at_target_tp, reshard_facts, tree_digest

from kvmigrate.migrate import journal as jn
from kvmigrate.migrate import reshard_spill, stores
from kvmigrate.synth import SynthSpec, build

from helpers.cli_helpers import run, run_json


def _lines(journal: Path) -> list[bytes]:
    with open(journal, "rb") as f:
        return [line for _, data in jn._frames(f) for line in data.splitlines()]


def _migrated(root: Path, facts: Path, backend: str) -> tuple[Path, dict[str, str]]:
    build(root, SynthSpec(**{**MC, "mc_backend": backend, "tp": 2, "blocks": 12}))
    before = tree_digest(root)
    code, out = run("migrate", root, "--facts", facts, "--apply")
    assert code == 0, out
    return next((root / ".kvmigrate" / "journals").glob("*.journal")), before


def _items(records) -> list[dict]:
    """The records with each part's items as records of their own (parts may be cut anywhere)."""
    return [out for r in records
            for out in ([{"of": r["of"], "item": i} for i in r["items"]] if r["t"] == "mc_part" else [r])]


def _normal(records: list[dict], journal: Path) -> str:
    """The records as text less what differs between two runs of one tree: the run's id
    (a retired key names it, so a rewritten index's hash differs), its root, the files'
    inodes and times."""
    header = json.loads(_lines(journal)[0])

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("inode", "mtime_ns", "new")}
        return [strip(v) for v in value] if isinstance(value, list) else value

    text = json.dumps(strip(records), sort_keys=True)
    for run_id in (header["run_id"], header["run_id"].encode().hex()):
        text = text.replace(run_id, "RUN")
    return text.replace(header["root"], "ROOT")


@pytest.mark.parametrize("backend", ["bucket", "file_per_key"])
def test_a_store_intent_is_written_in_parts_and_read_as_format_2_wrote_it(tmp_path, monkeypatch, backend):
    """Format 3 writes a head with no array and parts of about PART_BYTES; every reader
    (`load_runs` whole, `store_records` of a loaded or a streamed run) gives what it gives
    of the same migration journaled in format 2; both roll back to the original bytes."""
    monkeypatch.setattr(stores, "PART_BYTES", 300)  # (several parts of each array of a small store)
    facts = reshard_facts(tmp_path, 4)
    got = {}
    for version in (2, 3):
        monkeypatch.setattr(jn, "VERSION", version)
        journal, before = _migrated(tmp_path / f"v{version}", facts, backend)
        lines = _lines(journal)
        intents = [json.loads(line) for line in lines if line.startswith(b'{"t":"mc_intent"')]
        parts = [json.loads(line) for line in lines if line.startswith(b'{"t":"mc_part"')]
        assert len(intents) == 1
        if version == 2:
            assert not parts and intents[0]["pairs" if backend == "bucket" else "outputs"]
        else:
            assert intents[0]["parts"] is True and not set(jn.INTENT_ARRAYS) & set(intents[0])
            counts = {of: sum(p["of"] == of for p in parts) for of in jn.INTENT_ARRAYS}
            assert counts["reshards"] > 1 and counts["pairs" if backend == "bucket" else "outputs"] >= 1, counts
            for p in parts:  # (a line ends once it passes PART_BYTES: by at most one item)
                assert len(jn._ENCODE({**p, "items": p["items"][:-1]})) < 300 + 60, p["of"]
        loaded = jn.load_runs(str(journal))[0]
        streamed = jn.stream_runs(str(journal))[0]
        assert streamed.stored_in_file and not streamed.store_records
        assert _items(jn.store_records(streamed)) == _items(jn.store_records(loaded))
        got[version] = (_normal(loaded.store_records, journal), _normal(_items(jn.store_records(streamed)), journal))
        monkeypatch.setattr(jn, "VERSION", 3)  # (this release reads both)
        code, out = run("verify", tmp_path / f"v{version}", "--journal", journal)
        assert code == 0, out
        code, out = run("rollback", journal)
        assert code == 0, out
        assert tree_digest(tmp_path / f"v{version}") == before
    assert got[2] == got[3]


def test_a_format_2_journal_is_resumed_and_appended_to_in_format_2(tmp_path, monkeypatch):
    """A run journaled in format 2 and not finished is resumed by this release, which adds
    to that file in format 2 (the release that started it can read all of it); a new file
    is format 3."""
    path = tmp_path / "old.journal"
    identity = {"root": str(tmp_path), "manifest": "m"}
    monkeypatch.setattr(jn, "VERSION", 2)
    w = jn.JournalWriter.create(str(path), {"run_id": "r", "root": str(tmp_path), "dest": str(tmp_path),
                                            "identity": identity})
    w.close()
    monkeypatch.setattr(jn, "VERSION", 3)
    assert jn.find_resumable(str(path), identity) == str(path)
    resumed = jn.JournalWriter.resume(str(path), {"pid": 1})
    assert resumed.version == 2
    resumed.close()
    w = jn.JournalWriter.create(str(path), {"run_id": "r2", "root": str(tmp_path), "dest": str(tmp_path)})
    assert w.version == 2
    w.close()
    assert [json.loads(line).get("v") for line in _lines(path) if line.startswith(b'{"t":"header"')] == [2, 2]
    w = jn.JournalWriter.create(str(tmp_path / "new.journal"), {"run_id": "r3"})
    assert w.version == 3
    w.close()


def _as_format_2(journal: Path) -> None:
    """Rewrite a format-3 journal as format 2 wrote it: `v` 2 in its headers, each store
    intent one record holding its arrays (in the order format 2 wrote them)."""
    with open(journal, "rb") as f:
        frames = [data for _, data in jn._frames(f)]
    out = b""
    for data in frames:
        recs: list[dict] = []
        for line in data.splitlines():
            rec = json.loads(line)
            if rec["t"] == "header":
                rec["v"] = 2
            elif rec["t"] == "mc_intent" and rec.pop("parts", None):
                tail = {k: rec.pop(k) for k in ("clients", "bucket_clients", "dest") if k in rec}
                rec.update({name: [] for name in jn.INTENT_ARRAYS} | tail)
            elif rec["t"] == "mc_part":
                assert recs[-1]["t"] == "mc_intent"
                recs[-1][rec["of"]] += rec["items"]
                continue
            recs.append(rec)
        payload = zlib.compress(b"".join(jn._ENCODE(r).encode() + b"\n" for r in recs))
        out += jn.FRAME.pack(jn.MAGIC, len(payload), zlib.crc32(payload)) + payload
    journal.write_bytes(out)


@pytest.mark.parametrize("backend,point,n", [("bucket", "bucket_linked", 1), ("file_per_key", "linked", 1)])
def test_a_reshard_killed_under_format_2_is_resumed_or_rolled_back(tmp_path, backend, point, n):
    """An interrupted reshard journaled in format 2 (an earlier release's), rerun by this
    release: it finishes the journaled intent, writing format 2 to that file, and every key
    reads as the target TP wrote it; or rolled back: the original bytes."""
    import os
    import subprocess
    import sys

    spec = SynthSpec(**{**MC, "mc_backend": backend, "tp": 2, "blocks": 12})
    facts = reshard_facts(tmp_path, 4)
    for then in ("rerun", "rollback"):
        root = tmp_path / then
        res = build(root, spec)
        before = tree_digest(root)
        killed = subprocess.run([sys.executable, "-m", "kvmigrate", "migrate", str(root), "--facts", str(facts),
                                 "--apply"], env={**os.environ, "KVMIGRATE_CRASH_AT": f"{point}:{n}"},
                                capture_output=True, text=True)
        assert killed.returncode == -9, killed.stderr
        journal = next((root / ".kvmigrate" / "journals").glob("*.journal"))
        _as_format_2(journal)
        if then == "rerun":
            code, out = run("migrate", root, "--facts", facts, "--apply")
            assert code == 0, out
            reads_at_target_tp(root, res, spec, 4)
            lines = _lines(journal)
            assert not [x for x in lines if x.startswith(b'{"t":"mc_part"')]
            assert {json.loads(x)["v"] for x in lines if x.startswith(b'{"t":"header"')} == {2}
        else:
            code, out = run("rollback", journal)
            assert code == 0, out
            assert tree_digest(root) == before


@pytest.mark.parametrize("backend,point,n", [("bucket", "bucket_linked", 1), ("file_per_key", "linked", 1)])
def test_rollback_of_a_killed_reshard_sorts_its_records_on_disk(tmp_path, monkeypatch, backend, point, n):
    """A reshard killed mid-way, rolled back with runs of 2 records (merged 3 at a time):
    the dry run counts what the rollback in one piece counts, and the rollback gives back
    the original bytes. The unjournaled work a killed run did is proven from the intent's
    parts, read as the sort's runs."""
    import os
    import subprocess
    import sys

    facts = reshard_facts(tmp_path, 4)
    counts = []
    for small in (False, True):
        root = tmp_path / f"small{small}"
        build(root, SynthSpec(**{**MC, "mc_backend": backend, "tp": 2, "blocks": 12}))
        before = tree_digest(root)
        killed = subprocess.run([sys.executable, "-m", "kvmigrate", "migrate", str(root), "--facts", str(facts),
                                 "--apply"], env={**os.environ, "KVMIGRATE_CRASH_AT": f"{point}:{n}"},
                                capture_output=True, text=True)
        assert killed.returncode == -9, killed.stderr
        if small:
            monkeypatch.setattr(reshard_spill, "RUN_RECORDS", 2)
            monkeypatch.setattr(reshard_spill, "MERGE_RUNS", 3)
        journals = root / ".kvmigrate" / "journals"
        code, dry = run_json("rollback", journals, "--dry-run")
        assert code == 0, dry
        counts.append(dry["removed"])
        code, out = run("rollback", journals)
        assert code == 0, out
        assert tree_digest(root) == before
    assert counts[0] == counts[1] and counts[0], counts


def test_streamed_lines_are_the_frame_reader_s_lines(monkeypatch):
    """`_streamed_lines` gives each wanted line as it is decompressed, after a first pass
    proved the frame's CRC: the lines `_frame_lines` gives for any piece size, and none of
    a torn or corrupt frame (nor of any frame after it)."""
    import io
    import random

    rng = random.Random(3)
    for _ in range(300):
        lines = [b'{"t":"%s","b":"%s"}' % (rng.choice([b"header", b"mc_part", b"mc_pair", b"done"]),
                                            b"x" * rng.choice([0, 1, 5, 40, 3_000])) for _ in range(rng.randint(1, 9))]
        data = b"\n".join(lines) + (b"\n" if rng.random() < 0.7 else b"")
        payload = zlib.compress(data)
        frame = jn.FRAME.pack(jn.MAGIC, len(payload), zlib.crc32(payload)) + payload
        bad = jn.FRAME.pack(jn.MAGIC, len(payload), zlib.crc32(payload) ^ 1) + payload
        monkeypatch.setattr(jn, "_PIECE", rng.choice([1, 2, 7, 64, 1 << 20]))
        wanted, skip = (b'{"t":"mc_', b'{"t":"header"'), (b'{"t":"mc_part"',)
        want = [line for _, got in jn._frame_lines(io.BytesIO(frame), wanted, skip=skip) for line in got]
        assert want == [x for x in data.splitlines() if x.startswith(wanted) and not x.startswith(skip)]
        assert list(jn._streamed_lines(io.BytesIO(frame * 2), wanted, skip=skip)) == want * 2
        assert list(jn._streamed_lines(io.BytesIO(frame + frame[:-1]), wanted, skip=skip)) == want
        assert list(jn._streamed_lines(io.BytesIO(frame + bad + frame), wanted, skip=skip)) == want
