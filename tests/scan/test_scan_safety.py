"""Scan never changes the tree, never follows symlinks, survives a live writer, and turns
permission errors into findings (migration.md §3 rules 1, 7, 8; interface.md §2)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from kvmigrate import fsio

INTEGRITY = {"replica_mismatch", "size_mismatch", "short", "zero_filled", "misfiled", "header_invalid",
             "digest_mismatch", "config_invalid", "unreadable", "incomplete"}
OLD_ATIME = 1_000_000_000 * 10**9  # 2001: older than any mtime, so relatime would update it


def snapshot(root: Path) -> dict[str, tuple]:
    """(inode, size, mtime_ns, ctime_ns, atime_ns, mode, content) of every entry, lstat only."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            content = _read_noatime(p) if p.is_file() and not p.is_symlink() and st.st_mode & 0o444 else None
            out[str(p.relative_to(root))] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_atime_ns,
                                             st.st_mode, content)
    return out


def _read_noatime(p: Path) -> bytes:
    """Read without touching atime, so the snapshot itself does not change what it checks."""
    fd = os.open(p, os.O_RDONLY | os.O_NOATIME)
    try:
        return os.read(fd, os.fstat(fd).st_size + 1)
    finally:
        os.close(fd)


def age_atimes(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            p = Path(dirpath) / name
            if not p.is_symlink() and p.is_file():
                st = os.lstat(p)
                os.utime(p, ns=(OLD_ATIME, st.st_mtime_ns))


def test_scan_changes_nothing_under_root(synth_root, scan_root):
    root, results = synth_root(
        dict(family="llmd", tp=2, kv_kind="mla", defects=("tmp_vllm", "symlink", "fifo", "foreign")),
        dict(family="vllmcpp", tp=2, kv_kind="mla", model_name="Qwen/Qwen3-4B", defects=("header_magic",)),
        dict(family="vllm", scheme="S2", model_name="m/x", defects=("short", "deep_layout")))
    age_atimes(root)
    before = snapshot(root)
    scan, rows = scan_root(root, verify="hash", flags={"model_dtype": "bfloat16", "kv_kind": "mla"})
    assert rows and scan.summary["totals"]["files"] == len(rows)
    after = snapshot(root)
    atime = 4
    assert {k: v[:atime] + v[atime + 1:] for k, v in after.items()} == \
           {k: v[:atime] + v[atime + 1:] for k, v in before.items()}
    # atime: only meaningful where reads update it (relatime / strictatime mounts)
    probe = root / results[2].namespaces[0]["config_relpath"]
    probe.read_bytes()
    if os.lstat(probe).st_atime_ns != before[str(probe.relative_to(root))][atime]:
        changed = [k for k in before if k != str(probe.relative_to(root)) and after[k][atime] != before[k][atime]]
        assert not changed, changed


def test_reads_ask_for_noatime(tmp_path, monkeypatch):
    """Every open by the scanner asks for O_NOATIME (falling back only on EPERM) and never
    follows a symlink."""
    f = tmp_path / "f.bin"
    f.write_bytes(b"\1" * 10)
    seen = []
    real_open = os.open

    def spy(path, flags, *a):
        seen.append(flags)
        if len(seen) == 1 and flags & os.O_NOATIME:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real_open(path, flags, *a)

    monkeypatch.setattr(fsio.os, "open", spy)
    res = fsio.read_file(str(f), want_hash=True)
    assert res.content is not None
    assert seen[0] & os.O_NOATIME and seen[0] & os.O_NOFOLLOW
    assert not seen[1] & os.O_NOATIME and seen[1] & os.O_NOFOLLOW


def test_symlinks_are_never_followed(synth_root, scan_root, tmp_path):
    root, (result,) = synth_root(dict(family="vllm", scheme="S2"))
    outside = tmp_path / "outside"
    (outside / "abc" / "de_g0").mkdir(parents=True)
    (outside / "abc" / "de_g0" / ("abcde" + "0" * 59 + ".bin")).write_bytes(b"\1" * 4096)
    rank_dir = root / result.namespaces[0]["rank_dirs"][0]
    os.symlink(outside / "abc", rank_dir / "abc")              # a bucket that is a symlink
    os.symlink(outside, root / "elsewhere")                     # top level, outside the root
    os.symlink("loop_b", root / "loop_a")                      # a symlink loop
    os.symlink("loop_a", root / "loop_b")
    os.symlink(root, rank_dir / "fff")                          # a loop back to the root
    base_link = root / (result.namespaces[0]["base_name"][:-12] + "0" * 12)
    os.symlink(root / result.namespaces[0]["base_name"], base_link)  # a "base folder" that is a symlink
    scan, rows = scan_root(root, flags={"model_dtype": "bfloat16"}, verify="hash")
    links = {str(p.relative_to(root)) for p in (rank_dir / "abc", root / "elsewhere", root / "loop_a",
                                                root / "loop_b", rank_dir / "fff", base_link)}
    for rel in links:
        assert rows[rel]["status"] == "foreign" and "symlink" in rows[rel]["reason"], rows[rel]
        assert rows[rel]["content_xxh3_128"] is None
    assert not [r for r in rows if any(r.startswith(link + "/") for link in links)]
    assert len(rows) == len(result.block_files()) + 1 + len(links)


def test_unreadable_file_by_monkeypatched_open(synth_root, scan_root, monkeypatch, python_walk):
    root, (result,) = synth_root(dict(family="llmd", tp=2, kv_kind="mla", defects=("unreadable",)))
    victim = result.defect("unreadable")["relpath"]
    real_open = os.open

    def guarded(path, flags, *a):
        if str(path).endswith(victim):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(fsio.os, "open", guarded)
    scan, rows = scan_root(root, verify="hash", flags={"model_dtype": "bfloat16", "kv_kind": "mla"})
    row = rows[victim]
    assert row["status"] == "unreadable" and "EACCES" in row["reason"] and victim in row["reason"]
    assert scan.exit_code == 1 | 8
    others = [r for rel, r in rows.items() if rel != victim and r["status"] != "ok"]
    assert not others, others


@pytest.fixture
def world_readable_dir():
    """A tree an unprivileged user can traverse (pytest's tmp dirs are private to root)."""
    d = Path(tempfile.mkdtemp(prefix="kvmigrate-nobody-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    for dirpath, dirnames, _ in os.walk(d):
        for name in dirnames:
            os.chmod(Path(dirpath) / name, 0o755)
    shutil.rmtree(d)


def _scan_as_nobody(root: Path, out_dir: Path, *extra: str) -> tuple[int, dict, dict]:
    out = out_dir / "m.parquet"
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                           "kvmigrate", "scan", str(root), "-o", str(out), "--json", "--model-dtype", "bfloat16",
                           *extra], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    from kvmigrate import manifest

    rows = {r["relpath"]: r for r in manifest.read_table(out).to_pylist()}
    return proc.returncode, json.loads(proc.stdout), rows


@pytest.mark.parametrize("verify", ["size", "hash"])
def test_unreadable_file_as_unprivileged_user(world_readable_dir, verify, walk):
    from kvmigrate.synth import SynthSpec, build

    root = world_readable_dir / "root"
    out_dir = world_readable_dir / "out"
    out_dir.mkdir()
    os.chmod(out_dir, 0o777)
    result = build(root, SynthSpec(family="vllm", scheme="S2", layers=2, page_bytes=256, blocks=4,
                                   defects=("unreadable",)))
    victim = result.defect("unreadable")["relpath"]
    code, summary, rows = _scan_as_nobody(root, out_dir, "--verify", verify)
    assert rows[victim]["status"] == "unreadable"
    assert "EACCES" in rows[victim]["reason"] and "permission denied" in rows[victim]["reason"].lower()
    assert code == summary["exit_code"] == 1 | 8
    assert [r["status"] for rel, r in rows.items() if rel != victim] == ["ok"] * (len(rows) - 1)


def test_unlistable_folder_as_unprivileged_user(world_readable_dir, walk):
    from kvmigrate.synth import SynthSpec, build

    root = world_readable_dir / "root"
    out_dir = world_readable_dir / "out"
    out_dir.mkdir()
    os.chmod(out_dir, 0o777)
    result = build(root, SynthSpec(family="vllm", scheme="S2", layers=2, page_bytes=256, blocks=4))
    bucket = Path(result.block_files()[0]).parts[:2]
    os.chmod(root.joinpath(*bucket), 0)
    code, summary, rows = _scan_as_nobody(root, out_dir)
    rel = "/".join(bucket)
    assert rows[rel]["status"] == "unreadable" and "cannot list" in rows[rel]["reason"]
    assert code & 8


def test_unreadable_root_is_an_operational_error(world_readable_dir):
    root = world_readable_dir / "root"
    root.mkdir(mode=0o700)
    out_dir = world_readable_dir / "out"
    out_dir.mkdir()
    os.chmod(out_dir, 0o777)
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                           "kvmigrate", "scan", str(root), "-o", str(out_dir / "m.parquet")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 8
    assert str(root) in proc.stderr and "Traceback" not in proc.stderr


# -- a live engine writing into the root during the scan -----------------------------------

WRITER = textwrap.dedent("""
    import os, random, sys, time
    root, rank_dir, stop = sys.argv[1], sys.argv[2], sys.argv[3]
    rnd = random.Random(7)
    base = os.path.join(root, rank_dir)
    n = 0
    row = bytes(range(256)) * 16  # a valid 4096-byte row
    while not os.path.exists(stop):
        n += 1
        hex_hash = "%064x" % rnd.getrandbits(256)
        folder = os.path.join(base, hex_hash[:3], hex_hash[3:5] + "_g0")
        os.makedirs(folder, exist_ok=True)
        final = os.path.join(folder, hex_hash + ".bin")
        tmp = "%s_%d.tmp" % (final, rnd.getrandbits(32))
        with open(tmp, "wb") as f:
            f.write(row)
        os.replace(tmp, final)                       # publish a new block (temp + rename)
        victims = []
        for dirpath, _, files in os.walk(base):
            victims.extend(os.path.join(dirpath, f) for f in files if f.endswith(".bin"))
            if len(victims) > 50:
                break
        if victims and n % 2:
            v = rnd.choice(victims)
            try:
                os.unlink(v)                          # the evictor deletes one
            except FileNotFoundError:
                pass
        elif victims:
            v = rnd.choice(victims)
            tmp = v + "_%d.tmp" % rnd.getrandbits(32)
            with open(tmp, "wb") as f:
                f.write(row)
            os.replace(tmp, v)                        # rewrite one in place (same size)
    print(n)
""")


def test_scan_during_live_writes_finds_nothing_false(synth_root, scan_root, tmp_path):
    root, (result,) = synth_root(dict(family="vllm", scheme="S2", blocks=1000))
    rank_dir = result.namespaces[0]["rank_dirs"][0]
    stop = tmp_path / "stop"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    proc = subprocess.Popen([sys.executable, str(script), str(root), rank_dir, str(stop)], stdout=subprocess.PIPE,
                            text=True)
    try:
        time.sleep(0.3)
        outcomes = []
        for verify in ("size", "hash", "size"):
            scan, rows = scan_root(root, flags={"model_dtype": "bfloat16"}, verify=verify, threads=4)
            outcomes.append((scan, rows))
    finally:
        stop.write_text("")
        writes = int(proc.communicate(timeout=60)[0])
    assert writes > 10, "the writer did not run during the scans"
    for scan, rows in outcomes:
        bad = {rel: (r["status"], r["reason"]) for rel, r in rows.items()
               if r["status"] in INTEGRITY or (r["status"] not in ("ok", "tmp_leftover"))}
        assert not bad, bad
        assert not scan.exit_code & 4 and not scan.exit_code & 8
        tmp_rows = [rel for rel, r in rows.items() if r["status"] == "tmp_leftover"]
        assert all(rel.endswith(".tmp") for rel in tmp_rows)


def test_files_vanishing_between_listing_and_reading_are_dropped(synth_root, scan_root, monkeypatch, python_walk):
    """An evictor deletes a block, and an engine replaces another with a symlink, after the
    scanner listed them: no row for them, no finding, and only the manifest is written."""
    root, (result,) = synth_root(dict(family="llmd", tp=1, defects=("tmp_vllm",)))
    gone, replaced = result.block_files()[:2]
    tmp_file = result.defect("tmp_vllm")["relpath"]
    real = os.open

    def racing(path, flags, *args, **kw):  # the race happens just before the scanner opens the file
        if isinstance(path, str):
            for rel in (gone, tmp_file):
                if path.endswith(rel) and os.path.lexists(path):
                    os.unlink(path)
            if path.endswith(replaced) and not os.path.islink(path):
                os.unlink(path)
                os.symlink("/etc/passwd", path)
        return real(path, flags, *args, **kw)

    monkeypatch.setattr(fsio.os, "open", racing)
    scan, rows = scan_root(root, verify="hash", flags={"model_dtype": "bfloat16", "kv_kind": "full",
                                                        "total_kv_heads": 8})  # (else the target is a guess)
    assert gone not in rows and replaced not in rows and tmp_file not in rows
    assert {r["status"] for r in rows.values()} == {"ok"}
    assert scan.exit_code == 1  # no finding: the blocks are pending migration only
    assert sorted(p.name for p in Path(scan.output).parent.iterdir() if p.name.startswith("manifest")) == \
           [Path(scan.output).name]
