"""A cache root on a read-only filesystem (EROFS): every command that writes there stops
with the operational exit 8 and advice that fits: remount it read-write, or put what it
writes (audits, manifests, textfiles; a migration's targets and journal) on a writable
filesystem. EROFS is injected into the os calls that make or change names under ROOT, as
a read-only mount fails them (tests/reliability/test_reliability_faults.py mounts one)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from helpers.cli_helpers import run

FULL = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1",
        "--writer-pp", "1"]
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


@pytest.fixture
def read_only(monkeypatch):
    """read_only(path): from now on, making, opening for writing, linking, renaming or
    removing anything under `path` fails with EROFS (a dir_fd is resolved through /proc)."""

    def make(top: Path) -> None:
        top = os.path.realpath(top)

        def under(path, dir_fd=None) -> bool:
            path = os.fsdecode(path)
            if dir_fd is not None and not os.path.isabs(path):
                path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
            path = os.path.abspath(path)
            return path == top or path.startswith(top + os.sep)

        def refuse(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))

        real = {name: getattr(os, name) for name in ("open", "mkdir", "link", "rename", "replace", "unlink",
                                                      "rmdir")}

        def fake_open(path, flags, mode=0o777, *, dir_fd=None):
            if flags & _WRITE and under(path, dir_fd):
                refuse(path)
            return real["open"](path, flags, mode, dir_fd=dir_fd)

        def one_path(name):
            def fake(path, *args, dir_fd=None, **kwargs):
                if under(path, dir_fd):
                    refuse(path)
                return real[name](path, *args, **({"dir_fd": dir_fd} if dir_fd is not None else {}), **kwargs)
            return fake

        def two_paths(name):
            def fake(src, dst, *, src_dir_fd=None, dst_dir_fd=None, **kwargs):
                if under(dst, dst_dir_fd) or name != "link" and under(src, src_dir_fd):
                    refuse(dst)
                fds = {k: v for k, v in (("src_dir_fd", src_dir_fd), ("dst_dir_fd", dst_dir_fd)) if v is not None}
                return real[name](src, dst, **fds, **kwargs)
            return fake

        monkeypatch.setattr(os, "open", fake_open)
        for name in ("mkdir", "unlink", "rmdir"):
            monkeypatch.setattr(os, name, one_path(name))
        for name in ("link", "rename", "replace"):
            monkeypatch.setattr(os, name, two_paths(name))

    return make


@pytest.mark.parametrize("history", ["missing", "present"])
def test_audit_keep_on_a_read_only_root_is_an_operational_error(synth_root, read_only, history):
    # it exited 2 (a usage error) when the history folder could not be made, with a
    # traceback when it existed (the manifest's temp file could not be created)
    root, _ = synth_root({})
    if history == "present":
        (root / ".kvmigrate" / "audits").mkdir(parents=True)
    read_only(root)
    code, out = run("audit", root, "--keep", "3", "-q", *FULL)
    assert code == 8, out
    assert "Traceback" not in out and "read-only" in out and str(root / ".kvmigrate" / "audits") in out
    assert "hint: the filesystem is read-only: remount it read-write, or keep the audits on a writable " \
           "filesystem: --history DIR" in out


def test_scan_output_and_audit_textfile_on_a_read_only_folder_are_operational_errors(synth_root, tmp_path,
                                                                                     read_only):
    root, _ = synth_root({})
    ro = tmp_path / "ro"
    ro.mkdir()
    read_only(ro)
    code, out = run("scan", root, "-o", ro / "m.parquet", "-q")
    assert code == 8 and "Traceback" not in out, out
    assert f"kvmigrate: error: {ro / 'm.parquet'}: cannot write the manifest: read-only filesystem" in out
    assert "remount it read-write" in out
    code, out = run("audit", root, "-q", "--prometheus", ro / "kvmigrate.prom", *FULL)
    assert code == 8 and "Traceback" not in out, out
    assert f"{ro / 'kvmigrate.prom'}: cannot write the textfile: read-only filesystem" in out


def test_migrate_apply_on_a_read_only_root_says_remount_or_dest(synth_root, read_only):
    # the hint said "pass --journal PATH on a writable filesystem", which does not help:
    # the target namespaces go to the same read-only filesystem
    root, _ = synth_root({})
    before = sorted(p.name for p in root.iterdir())
    read_only(root)
    code, out = run("migrate", root, *FULL, "--apply")
    assert code == 8, out
    assert "cannot create the journal: read-only filesystem" in out
    hint = out[out.index("hint: "):]
    assert hint.startswith(f"hint: {root} (where the target namespaces go) is on a read-only filesystem too: "
                           "remount it read-write, then rerun the same command; or migrate onto a writable filesystem: "
                           "--dest DIR --journal PATH (both there; with --mode copy, since hard links cannot cross "
                           "filesystems)"), hint
    assert sorted(p.name for p in root.iterdir()) == before


def test_migrate_apply_into_a_writable_dest_asks_only_for_the_journal(synth_root, tmp_path, read_only):
    # with --dest on a writable filesystem only the journal (default: under ROOT) is in the way
    root, _ = synth_root({})
    dest = tmp_path / "dest"
    dest.mkdir()
    read_only(root)
    code, out = run("migrate", root, *FULL, "--apply", "--dest", dest, "--mode", "copy")
    assert code == 8, out
    assert "hint: the filesystem is read-only: remount it read-write, or pass --journal PATH on a writable " \
           "filesystem" in out
