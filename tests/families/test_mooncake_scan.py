"""Scanning Mooncake stores (spec mooncake.md §1, §2.4, §4): stores and client roots, the
file and object rows (manifest version 4), every status synth's defect records expect on
both backends and engines, objects counted apart from disk bytes, the exit bits, the client
lock, a store at ROOT beside another family, and what migrate says of the planned work (not
applied yet). On real stores built by `kvmigrate synth --family mooncake`."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmigrate import manifest
from kvmigrate.formats import mooncake as M
from kvmigrate.synth import SynthSpec, build
from kvmigrate.synth import mooncake as S

from helpers.cli_helpers import run, run_json

MC = dict(family="mooncake", layers=2, block_tokens=4, blocks=3)
BACKENDS = ("bucket", "file_per_key")
ENGINES = ("vllm", "sglang")


def synth(root: Path, **kw):
    return build(root, SynthSpec(**{**MC, **kw}))


def scan(root: Path, out: Path, *flags: str) -> tuple[int, dict, list[dict]]:
    code, summary = run_json("scan", str(root), "-o", str(out), "--json", *flags)
    return code, summary, manifest.read_table(out).to_pylist()


def mooncake_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["family"] == "mooncake"]


def objects(rows: list[dict]) -> dict[tuple[str, int | None], dict]:
    """Rows that are objects: index entries (relpath, i) and KVEntries (relpath, None)."""
    return {(r["relpath"], r["object_index"]): r for r in mooncake_rows(rows) if r["object_key"] is not None}


def files(rows: list[dict]) -> dict[str, dict]:
    return {r["relpath"]: r for r in mooncake_rows(rows) if r["object_index"] is None}


def disk_bytes(root: Path) -> int:
    return sum((Path(d) / n).lstat().st_size for d, _, names in os.walk(root) for n in names
               if ".kvmigrate" not in Path(d).parts)


CLEAN = [(b, e, s, k, tp) for b in BACKENDS for e in ENGINES for s in M.SCHEMES for k in ("full", "mla")
         for tp in (1, 2, 4)]


@pytest.mark.parametrize("backend,engine,scheme,kind,tp", CLEAN)
def test_every_object_of_a_clean_store_is_a_row_with_its_key_and_action(tmp_path, backend, engine, scheme, kind, tp):
    """One object row per entry of a live index (relpath the `.meta`, its index), one row per
    KVEntry; the key as stored, the key the target looks up, the action: a scoped key is
    read in place (already_present), a raw one needs a rekey under 0.3.14 (§2.1, §3.3)."""
    root = tmp_path / "root"
    res = synth(root, mc_backend=backend, mc_engine=engine, mc_scheme=scheme, kv_kind=kind, tp=tp)
    code, summary, rows = scan(root, tmp_path / "m.parquet", "--verify", "hash")
    got = objects(rows)
    want = {(o["relpath"], o["object_index"]): o for blk in res.blocks for o in blk["objects"]}
    assert set(got) == set(want)
    for key, o in want.items():
        r = got[key]
        assert r["object_key"] == o["storage_key"].encode("utf-8", "surrogateescape")
        assert r["status"] == "ok" and r["size"] == (o["size"] if backend == "bucket" else r["size"])
        engine_key = M.parse_storage_key(r["object_key"]).engine
        assert r["target_key"] == M.scoped(engine_key)
        assert r["action"] == ("already_present" if scheme == "mc-scoped" else "rekey"), r["reason"]
        assert r["deployment"] == res.namespaces[0]["deployment"]
        assert r["payload_xxh3_128"] is not None
        if backend == "bucket":
            assert r["target_relpath"] == o["client_root"] + "/"
        else:
            assert r["target_relpath"] == f"{o['client_root']}/{M.fpk(r['target_key'])}"
    assert all(r["status"] == "ok" for r in files(rows).values())
    # disk bytes are the files'; the objects are counted apart (§4)
    assert summary["totals"]["bytes"] == disk_bytes(root)
    assert summary["totals"]["objects"]["objects"] == len(want)
    assert code == (0 if scheme == "mc-scoped" else 1)  # +1 for pending rekey (§7)


def test_rows_outside_mooncake_have_null_object_columns(tmp_path):
    root = tmp_path / "root"
    build(root, SynthSpec(family="llmd", tp=2, blocks=2))
    synth(root, mc_store="mc")
    _, _, rows = scan(root, tmp_path / "m.parquet")
    others = [r for r in rows if r["family"] != "mooncake"]
    assert others and all(r["object_index"] is None and r["object_key"] is None and r["target_key"] is None
                          for r in others)
    assert objects(rows)


def expected(res) -> tuple[dict[str, str], dict[tuple[str, int | None], str], set[str]]:
    """(file statuses, object statuses, the hashes of the defects' blocks) synth's records expect."""
    file_status: dict[str, str] = {}
    obj_status: dict[tuple[str, int | None], str] = {}
    touched: set[str] = set()
    for d in res.defects:
        file_status.update(d["statuses"])
        for o in d["objects"]:
            obj_status[(o["relpath"], o["object_index"])] = o["status"]
        touched.update(d.get("blocks") or ())
    return file_status, obj_status, touched


DEFECT_CASES = [(b, e, d) for b in BACKENDS for e in ENGINES for d, (backends, _) in S.DEFECTS.items()
                if b in backends and d != "unreadable"]


@pytest.mark.parametrize("backend,engine,defect", DEFECT_CASES)
def test_each_defect_has_the_status_a_starting_client_implies(tmp_path, backend, engine, defect):
    """§1.4 and §4 on every defect synth writes: each file and object its record names has
    that status; the other objects of the defect's blocks are at most `incomplete` and never
    placed; every other object is whole and planned."""
    root = tmp_path / "root"
    res = synth(root, mc_backend=backend, mc_engine=engine, tp=2, defects=(defect,))
    code, summary, rows = scan(root, tmp_path / "m.parquet", "--verify", "hash")
    file_status, obj_status, touched = expected(res)
    got_files, got_objects = files(rows), objects(rows)
    for rel, status in file_status.items():
        assert rel in got_files, (rel, sorted(got_files))
        assert got_files[rel]["status"] == status, (rel, got_files[rel]["status"], got_files[rel]["reason"])
    for key, status in obj_status.items():
        r = got_objects.get(key) or got_files.get(key[0])
        assert r is not None, key
        assert r["status"] == status, (key, r["status"], r["reason"])
        assert r["action"] in ("none", "link", "already_present") and r["reason"]
    for key, r in got_objects.items():
        if key in obj_status or key[0] in file_status:
            continue
        if r["block_hash"] is not None and r["block_hash"].hex() in touched:
            assert r["status"] in ("ok", "incomplete", "unsupported_layout"), (key, r["status"], r["reason"])
            assert r["action"] in ("none", "already_present")
        else:
            assert (r["status"], r["action"]) == ("ok", "already_present"), (key, r["status"], r["reason"])
    for rel, r in got_files.items():
        if rel not in file_status and r["object_key"] is None:
            assert r["status"] in ("ok", "own_artifact"), (rel, r["status"], r["reason"])
    bits = 0
    for s in [*file_status.values(), *obj_status.values()]:
        bits |= {"ok": 0, "short": 5, "header_invalid": 5, "corrupt_sidecar": 5, "misfiled": 5,
                 "replica_mismatch": 5, "zero_filled": 5, "size_mismatch": 5}.get(s, 1)
    assert code & 5 == bits & 5, (code, bits)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_file_that_cannot_be_read_is_unreadable(tmp_path, monkeypatch, backend):
    """A `.bucket` or KVEntry the scan cannot open (EACCES; as root, where mode 000 still
    reads, the open is made to fail): its objects are `unreadable` (exit bit 8), never placed."""
    from kvmigrate.scan import store_rows

    root = tmp_path / "root"
    res = synth(root, tp=2, mc_backend=backend, defects=("unreadable",))
    victim = next(r for d in res.defects for r in d["statuses"])
    real = store_rows.open_noatime

    def refuse(path, *a, **kw):
        if str(path).endswith(victim):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(store_rows, "open_noatime", refuse)
    code, _, rows = scan(root, tmp_path / "m.parquet", "--verify", "hash")
    stem = victim.rsplit(".", 1)[0] if backend == "bucket" else victim
    hit = [r for r in mooncake_rows(rows) if r["relpath"].startswith(stem)  # (an unread KVEntry has no key)
           and (r["object_key"] is not None or backend == "file_per_key")]
    assert hit and all(r["status"] == "unreadable" and r["action"] == "none" for r in hit), hit
    assert code & 8


def test_a_key_of_no_grammar_is_kept_unsupported(tmp_path):
    root = tmp_path / "root"
    synth(root, tp=2, defects=("unsupported_key",))
    _, _, rows = scan(root, tmp_path / "m.parquet")
    odd = [r for r in objects(rows).values() if r["status"] == "unsupported_layout"]
    assert odd and all(r["action"] == "none" and r["deployment"] == "mooncake:store" for r in odd)


def test_a_misfiled_copy_beside_its_entry_is_present_elsewhere(tmp_path):
    """A valid KVEntry outside fpk(key) whose key fpk(key) holds: `misfiled`, already_present
    at fpk(key) (the name prune --migrated takes); without the copy at fpk(key) it is linked."""
    root = tmp_path / "root"
    synth(root, mc_backend="file_per_key", tp=2)
    entry = next(p for p in sorted((root / "store" / M.DEFAULT_FSDIR).rglob("*")) if p.is_file())
    key = M.decode_kv_entry(entry.read_bytes()).key
    a, b = entry.parent.parent.name, entry.parent.name
    other = "a" if a != "a" else "b"
    stray = entry.parent.parent.parent / other / b / entry.name
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(entry.read_bytes())
    _, _, rows = scan(root, tmp_path / "m.parquet")
    rel = str(stray.relative_to(root))
    r = files(rows)[rel]
    assert (r["status"], r["action"], r["target_relpath"]) == ("misfiled", "already_present",
                                                               str(entry.relative_to(root)))
    assert r["object_key"] == key
    entry.unlink()
    _, _, rows = scan(root, tmp_path / "m2.parquet")
    r = files(rows)[rel]
    assert (r["status"], r["action"], r["target_relpath"]) == ("misfiled", "link", str(entry.relative_to(root)))


def test_a_store_at_root_beside_nothing_else(tmp_path):
    root = tmp_path / "root"
    res = synth(root, mc_store=".", mc_engine="sglang", tp=2)
    (root / "notes.txt").write_text("ops\n")
    code, summary, rows = scan(root, tmp_path / "m.parquet")
    got = objects(rows)
    assert len(got) == sum(len(b["objects"]) for b in res.blocks)
    assert all(r["deployment"].startswith("mooncake:.:sglang:") for r in got.values())
    assert [r["status"] for r in rows if r["relpath"] == "notes.txt"] == ["foreign"]


def test_a_held_client_lock_is_reported_and_the_scan_takes_nothing(tmp_path):
    """0.3.14's flock on `.mooncake_local_disk.lock` (§1.4): the scan probes it without
    blocking and says the client is live; the lock file's row is `ok`."""
    root = tmp_path / "root"
    synth(root, tp=2, defects=("client_lock",))
    lock = root / "store" / M.LOCK_NAME
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({str(lock)!r}, 'rb'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        _, summary, rows = scan(root, tmp_path / "m.parquet")
        meta = manifest.read_metadata(tmp_path / "m.parquet")["namespaces"]["mooncake:store"]
        assert meta["config_json"]["locks"] == {"store": "held"}
        assert any("client live" in n for n in meta["notes"])
    finally:
        holder.kill()
        holder.wait()
    assert files(rows)["store/" + M.LOCK_NAME]["status"] == "ok"
    with open(lock, "rb") as f:  # released: the scan kept no lock
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_migrate_plans_the_store_work_and_says_which_proof_it_needs(tmp_path):
    """A raw store (rekey pending): the dry run lists the store's rekeys and the proof the
    apply needs, exits 1; --apply without a proof exits 2 and writes nothing."""
    root = tmp_path / "root"
    synth(root, mc_scheme="mc-raw", tp=2)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    scan(root, tmp_path / "m.parquet")
    code, out = run("migrate", "--manifest", str(tmp_path / "m.parquet"))
    assert code == 1 and "Mooncake store store: 6 rekey (1 index rewrites, 0 KVEntries)" in out
    assert "--engine-stopped" in out and "nothing to do" not in out
    code, out = run("migrate", "--manifest", str(tmp_path / "m.parquet"), "--apply")
    assert code == 2 and "no proof that its clients are stopped" in out
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before


def test_report_counts_objects_apart(tmp_path):
    root = tmp_path / "root"
    synth(root, tp=2, defects=("orphan_data",))
    scan(root, tmp_path / "m.parquet")
    code, out = run("report", str(tmp_path / "m.parquet"), "--format", "json")
    report = json.loads(out)
    assert report["totals"]["bytes"] == disk_bytes(root)
    assert report["totals"]["objects"]["objects"] == 6
    assert report["totals"]["by_status"]["orphan_data"]["files"] == 1


@pytest.mark.parametrize("below", ["", "a", "a/b"])
def test_a_root_inside_a_file_per_key_folder_is_refused(tmp_path, below):
    """§5.2: kvmigrate's own files under a ROOT inside `<fsdir>` (its journals at depth 3)
    would stop the client from starting: the scan refuses it with exit 2, naming the
    client root above."""
    root = tmp_path / "root"
    synth(root, mc_backend="file_per_key", tp=2)
    fsdir = root / "store" / M.DEFAULT_FSDIR
    (fsdir / below).mkdir(parents=True, exist_ok=True)
    code, out = run("scan", str(fsdir / below), "-o", str(tmp_path / "m.parquet"))
    assert code == 2 and "inside Mooncake's file-per-key folder" in out and str(root / "store") in out
    code, out = run("migrate", str(fsdir / below), "--apply")
    assert code == 2 and not (fsdir / below / ".kvmigrate").exists()
