"""The Mooncake report (spec mooncake.md §7): the per-store section (backends, client roots,
locks, largest bucket id, the writer's release and its evidence; per deployment its objects
by status and action apart from disk bytes, and what each prune class could take), §7's
notes as typed findings with their hints, the section in text, Markdown and HTML, and
`explain` of a store or deployment label; on stores built by `kvmigrate synth --family
mooncake`, the figures checked against the files on disk and what the reference reader
says a starting client does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmigrate.formats import mooncake as M
from kvmigrate.report import stores as sr
from kvmigrate.synth import SynthSpec, build
from kvmigrate.units import human_bytes

from helpers import mooncake_reader as reader
from helpers.cli_helpers import run, run_json
from helpers.schema_check import errors

MC = dict(family="mooncake", layers=2, block_tokens=4, blocks=3)
SCHEMA = Path(__file__).resolve().parents[2] / "docs" / "schema"
STORE = "mooncake:store"


def synth(root: Path, **kw):
    return build(root, SynthSpec(**{**MC, **kw}))


def scan(root: Path, tmp_path: Path, *flags: str, name: str = "m.parquet") -> tuple[Path, dict]:
    out = tmp_path / name
    code, summary = run_json("scan", str(root), "-o", str(out), *flags)
    assert code in (0, 1, 5), summary
    return out, summary


def report(m: Path) -> dict:
    _, summary = run_json("report", str(m))
    return summary


def the_store(summary: dict, name: str = "store") -> dict:
    return next(s for s in summary["stores"] if s["store"] == name)


def notes(summary: dict, code: str) -> list[dict]:
    return [f for f in summary["findings"] if f["code"] == code]


def hint_commands(summary: dict, code: str) -> list[str]:
    return [h["command"] for h in summary["hints"] if code in h["codes"]]


def disk_files(root: Path) -> list[Path]:
    return [Path(d) / n for d, _, names in os.walk(root) for n in names if ".kvmigrate" not in Path(d).parts]


def live_entries(client: Path) -> list[tuple[Path, reader.Entry]]:
    """Every entry a client starting on `client` adopts, with its `.bucket`."""
    res = reader.start(client)
    return [(e.path, e) for es in res.entries.values() for e in es]


def cut(e: reader.Entry) -> bool:
    return e.offset + e.key_size + e.data_size > e.path.stat().st_size


def hold_lock(lock: Path) -> subprocess.Popen:
    """A child process holding 0.3.14's flock on the client lock, as a live client does."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, time\n"
        f"f = open({str(lock)!r}, 'rb'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


# --- the section -------------------------------------------------------------------------------


def test_store_section_numbers_match_the_files_and_what_a_start_does(tmp_path):
    root = tmp_path / "root"
    synth(root, tp=2, defects=("orphan_data", "corrupt_sidecar", "orphan_index", "short", "client_lock"))
    client = root / "store"
    m, _ = scan(root, tmp_path)
    s = the_store(report(m))
    on_disk = disk_files(root)
    assert (s["namespace"], s["backends"], s["client_roots"]) == (STORE, ["bucket"], ["store"])
    assert (s["locks"], s["client_live"]) == ({"store": "free"}, [])
    assert s["largest_bucket_id"] == max(M.stoll_id(p.name) for p in client.iterdir() if M.is_pair_name(p.name))
    assert (s["files"], s["bytes"]) == (len(on_disk), sum(p.stat().st_size for p in on_disk))
    # the next start deletes exactly what the reference reader's start deletes
    deleted = reader.start(client).deleted
    assert sum(c["files"] for c in s["start_deletes"].values()) == len(deleted)
    assert sum(c["bytes"] for c in s["start_deletes"].values()) == sum(p.stat().st_size for p in deleted)
    assert set(s["start_deletes"]) == {"orphan_data", "corrupt_sidecar", "orphan_index"}
    assert s["start_refuses"] == {"files": 0, "bytes": 0}
    # objects: the entries of live indexes, their bytes the values', apart from the disk's
    entries = live_entries(client)
    (d,) = s["deployments"]
    assert (d["objects"], d["object_bytes"]) == (len(entries), sum(e.data_size for _, e in entries))
    assert (d["files"], d["bytes"]) == (0, 0)  # (a bucket deployment's files are its store's pairs)
    assert sum(v["objects"] for v in d["by_status"].values()) == len(entries)
    assert d["by_status"]["short"]["objects"] == sum(cut(e) for _, e in entries) == d["cut_records"] == 1
    assert (d["engine"], d["scheme"], d["key_ranks"], d["target"]) == (
        "vllm", "mc-scoped", 2, d["deployment"])
    # per class: residue the deleted files, tails the cut records (nothing freed: held in their pair)
    r = s["reclaimable"]
    assert (r["residue"]["files"], r["residue"]["bytes"]) == (len(deleted), sum(p.stat().st_size for p in deleted))
    assert r["tails"] == {"files": 0, "bytes": 0, "objects": 1,
                          "held_bytes": sum(e.data_size for _, e in entries if cut(e))}
    assert r["migrated"]["objects"] == r["unreadable_namespaces"]["objects"] == 0


def test_the_scan_and_the_report_give_the_same_section(tmp_path):
    """The scan aggregates the batches as it writes them, the report reads the manifest back:
    one section either way."""
    root = tmp_path / "root"
    synth(root, tp=2, mc_scheme="mc-raw", defects=("orphan_data", "short"))
    m, scanned = scan(root, tmp_path)
    assert scanned["stores"] == report(m)["stores"] != []
    assert errors(scanned, json.loads((SCHEMA / "report.json").read_text())) == []


@pytest.mark.parametrize("flags,kw,release,stated", [
    ((), dict(mc_scheme="mc-raw"), "<=0.3.11", False),
    ((), dict(), ">=0.3.12", False),
    ((), dict(defects=("client_lock",)), ">=0.3.14", False),
    (("--writer-release", "0.3.13.post1"), dict(), "0.3.13.post1", True),
])
def test_writer_release_and_its_evidence(tmp_path, flags, kw, release, stated):
    root = tmp_path / "root"
    synth(root, tp=1, **kw)
    m, _ = scan(root, tmp_path, *flags)
    s = the_store(report(m))
    assert (s["writer_release"], s["writer_release_stated"]) == (release, stated)
    assumed = notes(report(m), sr.ASSUMED)
    assert ("writer_release" in assumed[0]["assumed"]) is not stated


def test_file_per_key_store_kventries_and_the_migrated_copy(tmp_path):
    """A file-per-key store: its KVEntry files are its deployment's disk bytes; a valid copy
    beside its entry at fpk(key) is what prune --migrated takes."""
    root = tmp_path / "root"
    synth(root, mc_backend="file_per_key", tp=2)
    entry = next(p for p in sorted((root / "store" / M.DEFAULT_FSDIR).rglob("*")) if p.is_file())
    other = "a" if entry.parent.parent.name != "a" else "b"
    stray = entry.parent.parent.parent / other / entry.parent.name / entry.name
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(entry.read_bytes())
    m, _ = scan(root, tmp_path)
    s = the_store(report(m))
    (d,) = s["deployments"]
    kv = [p for p in disk_files(root / "store" / M.DEFAULT_FSDIR)]
    assert s["backends"] == ["file_per_key"] and s["largest_bucket_id"] is None
    assert (d["files"], d["bytes"]) == (len(kv), sum(p.stat().st_size for p in kv))
    assert d["objects"] == len(kv) and d["misfiled_entries"] == 1
    assert d["reclaimable"]["migrated"] == {"files": 1, "bytes": stray.stat().st_size, "objects": 1,
                                            "held_bytes": 0}


# --- the notes ---------------------------------------------------------------------------------


def test_start_deletes_note_exactly_when_a_start_deletes(tmp_path):
    clean, dirty = tmp_path / "clean", tmp_path / "dirty"
    synth(clean, tp=2)
    synth(dirty, tp=2, defects=("orphan_data", "corrupt_sidecar", "orphan_index"))
    m, _ = scan(clean, tmp_path, name="clean.parquet")
    assert notes(report(m), sr.NOTE_START_DELETES) == [] and reader.start(clean / "store").deleted == []
    m, _ = scan(dirty, tmp_path, name="dirty.parquet")
    summary = report(m)
    (f,) = notes(summary, sr.NOTE_START_DELETES)
    deleted = reader.start(dirty / "store").deleted
    assert (f["files"], f["bytes"], f["namespace"]) == (len(deleted), sum(p.stat().st_size for p in deleted), STORE)
    assert sorted(hint_commands(summary, sr.NOTE_START_DELETES)) == sorted(
        f"kvmigrate report {m} --list {status}" for status in ("orphan_data", "corrupt_sidecar", "orphan_index"))


def test_orphan_index_has_advice_of_its_own(tmp_path):
    root = tmp_path / "root"
    synth(root, tp=1, defects=("orphan_index",))
    m, _ = scan(root, tmp_path)
    summary = report(m)
    (f,) = [f for f in summary["findings"] if f.get("status") == "orphan_index"]
    assert f["files"] == 1 and "unknown state" not in f["message"]
    assert f"kvmigrate report {m} --list orphan_index" in hint_commands(summary, "orphan_index")


def test_start_refused_note_for_depth3_files_that_do_not_parse(tmp_path):
    """header_invalid and a cut KVEntry stop the client; a KVEntry whose value is zeros
    parses, so it does not (the reference reader starts)."""
    refusing, zeros = tmp_path / "refusing", tmp_path / "zeros"
    synth(refusing, mc_backend="file_per_key", tp=1, defects=("header_invalid", "short"))
    synth(zeros, mc_backend="file_per_key", tp=1, defects=("zero_filled",))
    m, _ = scan(refusing, tmp_path, name="r.parquet")
    summary = report(m)
    (f,) = notes(summary, sr.NOTE_START_REFUSED)
    assert reader.start(refusing / "store").refused is not None
    assert f["files"] == 2 == the_store(summary)["start_refuses"]["files"]
    assert {f"kvmigrate report {m} --list header_invalid", f"kvmigrate report {m} --list short"} <= set(
        hint_commands(summary, sr.NOTE_START_REFUSED))
    m, _ = scan(zeros, tmp_path, name="z.parquet")
    assert reader.start(zeros / "store").refused is None
    assert notes(report(m), sr.NOTE_START_REFUSED) == []


def test_apply_proof_note_and_its_command(tmp_path):
    """Pending rekeys: the apply needs --engine-stopped, or (a bucket store) writer_release
    0.3.14 stated, then it takes the client lock; a store with nothing pending needs none."""
    raw, clean = tmp_path / "raw", tmp_path / "clean"
    synth(raw, tp=2, mc_scheme="mc-raw")
    synth(clean, tp=2)
    m, _ = scan(raw, tmp_path, name="raw.parquet")
    summary = report(m)
    (f,) = notes(summary, sr.NOTE_APPLY_PROOF)
    assert "--engine-stopped" in f["message"]
    cmds = hint_commands(summary, sr.NOTE_APPLY_PROOF)
    assert f"kvmigrate migrate --manifest {m} --apply --engine-stopped" in cmds
    assert f"kvmigrate scan {raw} --writer-release 0.3.14 -o {m}" in cmds
    m2, _ = scan(raw, tmp_path, "--writer-release", "0.3.14", name="stated.parquet")
    summary = report(m2)
    (f,) = notes(summary, sr.NOTE_APPLY_PROOF)
    assert M.LOCK_NAME in f["message"] and hint_commands(summary, sr.NOTE_APPLY_PROOF) == []
    m3, _ = scan(clean, tmp_path, name="clean.parquet")
    assert notes(report(m3), sr.NOTE_APPLY_PROOF) == []


def test_a_held_client_lock_is_a_live_client(tmp_path):
    root = tmp_path / "root"
    synth(root, tp=2, defects=("client_lock",))
    m, _ = scan(root, tmp_path, name="free.parquet")
    assert notes(report(m), sr.NOTE_CLIENT_LIVE) == []
    holder = hold_lock(root / "store" / M.LOCK_NAME)
    try:
        m, _ = scan(root, tmp_path, name="held.parquet")
    finally:
        holder.kill()
        holder.wait()
    summary = report(m)
    s = the_store(summary)
    assert (s["locks"], s["client_live"]) == ({"store": "held"}, ["store"])
    (f,) = notes(summary, sr.NOTE_CLIENT_LIVE)
    assert f["namespace"] == STORE
    assert hint_commands(summary, sr.NOTE_CLIENT_LIVE) == [f"kvmigrate explain {m} {STORE}"]
    code, text = run("report", str(m))
    assert "store held (client live)" in text


def test_keys_is_exist_reports_but_no_read_serves(tmp_path):
    """Cut records, raw keys (pending rekey) and misfiled KVEntries: each counted, and the
    note only when there is one."""
    cases = {"cut": dict(defects=("short",)), "raw": dict(mc_scheme="mc-raw"),
             "misfiled": dict(mc_backend="file_per_key", defects=("misfiled",)), "clean": dict()}
    got = {}
    for name, kw in cases.items():
        root = tmp_path / name
        synth(root, tp=2, **kw)
        m, _ = scan(root, tmp_path, name=f"{name}.parquet")
        summary = report(m)
        (d,) = the_store(summary)["deployments"]
        got[name] = ((d["cut_records"], d["raw_keys"], d["misfiled_entries"]), len(notes(summary, sr.NOTE_UNSERVED)),
                     hint_commands(summary, sr.NOTE_UNSERVED), m, d)
    raw_objects = got["raw"][4]["objects"]
    assert [got[n][:2] for n in cases] == [((1, 0, 0), 1), ((0, raw_objects, 0), 1), ((0, 0, 1), 1), ((0, 0, 0), 0)]
    assert got["cut"][2] == [f"kvmigrate prune {tmp_path / 'cut'} --tails"]  # (prune retires their keys)
    assert got["raw"][2] == [f"kvmigrate migrate --manifest {got['raw'][3]} --apply --engine-stopped"]


def test_auto_prefix_note(tmp_path):
    auto, fixed = tmp_path / "auto", tmp_path / "fixed"
    synth(auto, tp=1, mc_cache_prefix="auto")
    synth(fixed, tp=1)
    m, _ = scan(auto, tmp_path, name="auto.parquet")
    summary = report(m)
    (d,) = the_store(summary)["deployments"]
    (f,) = notes(summary, sr.NOTE_AUTO_PREFIX)
    assert d["auto_prefix"].startswith("auto-") and d["auto_prefix"] in f["message"]
    assert hint_commands(summary, sr.NOTE_AUTO_PREFIX) == [f"kvmigrate explain {m} {d['deployment']}"]
    m, _ = scan(fixed, tmp_path, name="fixed.parquet")
    assert notes(report(m), sr.NOTE_AUTO_PREFIX) == []


def test_unlocked_bucket_client_roots_note(tmp_path):
    """Bucket client roots without 0.3.14's lock (nor 0.3.14 stated): two clients on one root
    clash; none with the lock file, nor for a file-per-key store."""
    cases = {"unlocked": (dict(), ()), "locked": (dict(defects=("client_lock",)), ()),
             "stated": (dict(), ("--writer-release", "0.3.14")), "fpk": (dict(mc_backend="file_per_key"), ())}
    got = {}
    for name, (kw, flags) in cases.items():
        root = tmp_path / name
        synth(root, tp=1, **kw)
        m, _ = scan(root, tmp_path, *flags, name=f"{name}.parquet")
        got[name] = len(notes(report(m), sr.NOTE_UNLOCKED))
    assert got == {"unlocked": 1, "locked": 0, "stated": 0, "fpk": 0}


def test_a_store_folder_that_is_a_bucket_client_root(tmp_path):
    """SGLang's rank client roots under a store folder holding a pair itself: a client
    started on the store folder deletes the rank folders' buckets."""
    root = tmp_path / "root"
    synth(root, tp=2, mc_engine="sglang")
    m, _ = scan(root, tmp_path, name="ranks.parquet")
    assert notes(report(m), sr.NOTE_STORE_IS_CLIENT) == []
    rank = next(p for p in sorted((root / "store").iterdir()) if p.is_dir())
    for p in sorted(rank.iterdir()):
        if M.is_pair_name(p.name):
            (root / "store" / p.name).write_bytes(p.read_bytes())
            break
    ranks_buckets = [p for p in (root / "store").rglob("*.bucket") if p.parent != root / "store"]
    assert set(ranks_buckets) <= set(reader.start(root / "store").deleted)
    m, _ = scan(root, tmp_path, name="both.parquet")
    summary = report(m)
    assert the_store(summary)["store_is_client_root"] is True
    (f,) = notes(summary, sr.NOTE_STORE_IS_CLIENT)
    assert f["namespace"] == STORE
    assert hint_commands(summary, sr.NOTE_STORE_IS_CLIENT) == [f"kvmigrate explain {m} {STORE}"]


def test_restart_clients_after_an_apply(tmp_path):
    raw, clean = tmp_path / "raw", tmp_path / "clean"
    synth(raw, tp=1, mc_scheme="mc-raw")
    synth(clean, tp=1)
    m, _ = scan(raw, tmp_path, name="raw.parquet")
    summary = report(m)
    assert len(notes(summary, sr.NOTE_RESTART)) == 1
    assert hint_commands(summary, sr.NOTE_RESTART) == [f"kvmigrate migrate --manifest {m} --apply --engine-stopped"]
    m, _ = scan(clean, tmp_path, name="clean.parquet")
    assert notes(report(m), sr.NOTE_RESTART) == []


# --- renderers and explain ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["text", "md", "html"])
def test_every_format_renders_the_store_section(tmp_path, fmt):
    root = tmp_path / "root"
    synth(root, tp=2, defects=("orphan_data", "client_lock"))
    m, _ = scan(root, tmp_path)
    s = the_store(report(m))
    code, out = run("report", str(m), "--format", fmt)
    assert "mooncake stores" in out.lower()
    assert s["deployments"][0]["deployment"] in out and str(s["largest_bucket_id"]) in out
    assert "store free" in out and "--tails" in out


def test_explain_a_store_and_a_deployment(tmp_path):
    root = tmp_path / "root"
    synth(root, tp=2, defects=("orphan_data",))
    m, _ = scan(root, tmp_path)
    s = the_store(report(m))
    for name in (STORE, "store"):  # (its namespace, or its relpath)
        _, out = run_json("explain", str(m), name)
        assert out["namespace"] == STORE
        assert out["store"] == {"store": s, "deployment": None}
    dep = s["deployments"][0]
    _, out = run_json("explain", str(m), dep["deployment"])
    assert out["store"] == {"store": s, "deployment": dep}
    assert errors(out, json.loads((SCHEMA / "explain.json").read_text())) == []
    code, text = run("explain", str(m), STORE)
    assert code == 0 and "store        store (bucket); client roots store" in text
    assert "deletes 1 orphan_data" in text


def test_new_pairs_note_when_objects_wait_for_a_reshard(tmp_path):
    """New pairs get ids above every existing one: FIFO evicts them last. The scan plans no
    Mooncake reshard yet, so the plan is the manifest of a real store with its rank-0 entries'
    action set to `reshard` (the columns the note reads)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    root = tmp_path / "root"
    synth(root, tp=2)
    m, _ = scan(root, tmp_path)
    assert notes(report(m), sr.NOTE_NEW_PAIRS) == []
    t = pq.read_table(m)
    primary = pc.and_(pc.is_valid(t["object_index"]), pc.equal(pc.fill_null(t["rank"], -1), 0))
    i = t.schema.get_field_index("action")
    action = pc.if_else(primary, "reshard", pc.cast(t["action"], pa.string()))
    planned = tmp_path / "planned.parquet"
    pq.write_table(t.set_column(i, t.schema.field(i), action.dictionary_encode()), planned)
    summary = report(planned)
    (d,) = the_store(summary)["deployments"]
    (f,) = notes(summary, sr.NOTE_NEW_PAIRS)
    assert d["reshard_objects"] == pc.sum(primary.cast(pa.int64())).as_py() > 0
    assert str(the_store(summary)["largest_bucket_id"]) in f["message"]
    assert hint_commands(summary, sr.NOTE_NEW_PAIRS) == [f"kvmigrate migrate --manifest {planned}"]


def test_statuses_of_index_entries_are_findings(tmp_path):
    """A pair file is `ok` while an entry of it is zero or too long: each such status of
    index entries is a finding of its deployment (the exit code's bits have a reason)."""
    root = tmp_path / "root"
    synth(root, tp=2, defects=("zero_filled", "size_mismatch"))
    m, scanned = scan(root, tmp_path)
    summary = report(m)
    (d,) = the_store(summary)["deployments"]
    got = {f["status"]: f for f in summary["findings"] if f.get("status") and f["namespace"] == d["deployment"]}
    assert set(got) == {"zero_filled", "size_mismatch"} == set(d["entries_by_status"]) - {"ok"}
    for status, f in got.items():
        assert f["bytes"] == d["entries_by_status"][status]["bytes"] and f["bits"] == 5
        assert f"kvmigrate report {m} --list {status}" in hint_commands(summary, status)
    assert scanned["exit_code"] == 5


def test_two_stores_beside_another_family(tmp_path):
    """Stores side by side with an llm-d tree: one entry per store, its figures its own; the
    llm-d namespaces are in no store and the report without stores has an empty section."""
    root = tmp_path / "root"
    build(root, SynthSpec(family="llmd", tp=2, blocks=2))
    synth(root, mc_store="a", tp=2, defects=("orphan_data",))
    synth(root, mc_store="b", tp=1, mc_backend="file_per_key")
    m, _ = scan(root, tmp_path, "--kv-kind", "mla")
    summary = report(m)
    assert [s["store"] for s in summary["stores"]] == ["a", "b"]
    a, b = summary["stores"]
    assert (a["backends"], b["backends"]) == (["bucket"], ["file_per_key"])
    for s in (a, b):
        files = disk_files(root / s["store"])
        assert (s["files"], s["bytes"]) == (len(files), sum(p.stat().st_size for p in files))
    assert set(a["start_deletes"]) == {"orphan_data"} and b["start_deletes"] == {}
    alone = tmp_path / "alone"
    build(alone, SynthSpec(family="llmd", tp=2, blocks=2))
    m2, _ = scan(alone, tmp_path, "--kv-kind", "mla", name="alone.parquet")
    assert report(m2)["stores"] == []


def test_the_scan_prints_a_line_per_store(tmp_path):
    root = tmp_path / "root"
    synth(root, tp=2, defects=("orphan_data", "client_lock"))
    code, out = run("scan", str(root), "-o", str(tmp_path / "m.parquet"))
    bucket = next(p for p in (root / "store").iterdir() if p.name.endswith(M.BUCKET_SUFFIX)
                  and p in reader.start(root / "store").deleted)
    line = next(x for x in out.splitlines() if x.startswith("  store store:"))
    assert "bucket; client roots store; locks store free" in line
    assert f"the next client start deletes 1 file ({human_bytes(bucket.stat().st_size)})" in line


@pytest.mark.parametrize("flags,unused", [
    ((), []), (("--target-tp", "4"), []), (("--target-tp", "2"), ["store/rank_0_2_0_0", "store/rank_0_3_0_0"]),
])
def test_rank_folders_a_tp_shrink_leaves_unused(tmp_path, flags, unused):
    root = tmp_path / "root"
    synth(root, tp=4, mc_engine="sglang")
    m, _ = scan(root, tmp_path, *flags)
    summary = report(m)
    s = the_store(summary)
    assert sorted(s["client_roots"]) == [f"store/rank_0_{r}_0_0" for r in range(4)]
    assert s["unused_rank_roots"] == unused
    got = notes(summary, sr.NOTE_UNUSED_RANKS)
    assert len(got) == (1 if unused else 0)
    if unused:
        assert all(r in got[0]["message"] for r in unused)
        assert hint_commands(summary, sr.NOTE_UNUSED_RANKS) == [f"kvmigrate migrate --manifest {m}"]


def test_every_action_has_a_colour_in_the_html_report(tmp_path):
    """An action without a colour crashed `report --format html` (a raw store's `rekey`):
    every action the planner knows has one, and a raw store's report renders."""
    from kvmigrate.classify import ACTIONS
    from kvmigrate.report.render_html import ACTION_COLORS

    assert set(ACTIONS) <= set(ACTION_COLORS)
    from kvmigrate.synth import SynthSpec, build

    root = tmp_path / "root"
    build(root, SynthSpec(family="mooncake", mc_scheme="mc-raw", tp=2, layers=2, block_tokens=4, blocks=2))
    from helpers.cli_helpers import run

    run("scan", root, "-o", tmp_path / "m.parquet")
    code, out = run("report", tmp_path / "m.parquet", "--format", "html", "-o", tmp_path / "r.html")
    assert code in (0, 1) and (tmp_path / "r.html").read_text().count("<svg") >= 1, out


def test_every_migrate_hint_of_a_store_without_a_proof_runs_as_printed(tmp_path):
    """A raw store with pending rekeys and no proof: the plain `migrate ROOT --apply` would
    exit 2 (no proof), so it is not printed; the store's own hint (with --engine-stopped) is,
    and it runs as printed (exit 0, the store rekeyed)."""
    import shlex

    from helpers.cli_helpers import run, run_json

    root = tmp_path / "root"
    synth(root, tp=2, mc_scheme="mc-raw")
    _, summary = run_json("audit", root)
    migrates = [h["command"] for h in summary["hints"] if h["command"].startswith("kvmigrate migrate")]
    assert migrates == [f"kvmigrate migrate {root} --apply --engine-stopped"], migrates
    code, out = run(*shlex.split(migrates[0])[1:])
    assert code == 0, out


def test_a_scan_then_list_hint_lists_the_files_when_the_scan_finds_something(tmp_path):
    """The hints that scan first and then list or explain run in a shell as printed: a scan
    with findings exits 1 or 5, which an `&&` chain stopped at, so the listing never ran."""
    root = tmp_path / "root"
    synth(root, tp=2, defects=("orphan_data",))
    from helpers.cli_helpers import run_json

    _, summary = run_json("audit", root)
    listing = next(h["command"] for h in summary["hints"] if h["command"].endswith("--list orphan_data"))
    done = subprocess.run(["sh", "-c", listing.replace("kvmigrate ", f"{sys.executable} -m kvmigrate ")],
                          cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip().endswith(".bucket"), (listing, done.stdout, done.stderr)
