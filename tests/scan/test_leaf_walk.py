"""The compiled leaf walk (kvmigrate._leafwalk) against the Python walk: on every defect
tree, every odd name and every race, both write the same manifest, row for row.

The C walk takes only plain block files and hands everything else to the Python code;
these tests prove that split loses nothing, words nothing differently and drops exactly
what the Python walk drops.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import kvmigrate.scan.walker as scan_walker
from kvmigrate import fsio, manifest, pipeline
from kvmigrate.identity.facts import FactsResolver
from kvmigrate.options import ScanOptions
from kvmigrate.synth.spec import BLOCK_DEFECTS, TREE_DEFECTS, SynthSpec
from kvmigrate.synth.tree import build

from helpers import WALKS

SMALL = dict(blocks=4, page_bytes=64, layers=2)
FLAGS = {"model_dtype": "bfloat16"}
# defect -> spec changes that make the tree show it (as in test_audit)
CASES = {
    "missing_rank": dict(family="llmd", tp=2),
    "replica_differs": dict(family="llmd", tp=2, kv_kind="mla"),
    "padded_legacy": dict(family="llmd", tp=2),
    "pp_stage": dict(family="llmd", tp=1, pp=2),
    **{d: dict(family="vllmcpp") for d in BLOCK_DEFECTS if d.startswith("header_")},
}


class Spy:
    """Counts the rows the C walk appended and the entries it handed back."""

    def __init__(self, leaf):
        self.leaf, self.rows, self.calls, self.unusual = leaf, 0, 0, []

    def walk_bucket(self, *args):
        store = args[7]
        before = len(store)
        result = self.leaf.walk_bucket(*args)
        self.calls += 1
        self.rows += len(store) - before
        self.unusual.extend(result or [])
        return result

    def __getattr__(self, name):
        return getattr(self.leaf, name)


def scan_rows(root: Path, out: Path, walk: str, monkeypatch, verify: str, flags: dict | None = None
              ) -> tuple[int, list[dict], Spy | None]:
    """Scan in this process with one walk; (exit code, manifest rows in order, spy)."""
    from kvmigrate import _leafwalk  # noqa: F401  (the tests need the C walk built)

    spy = None
    if walk == "python":
        monkeypatch.setenv("KVMIGRATE_PURE_PYTHON", "1")
    else:
        monkeypatch.delenv("KVMIGRATE_PURE_PYTHON", raising=False)
        spy = Spy(scan_walker.leaf_walk())
        monkeypatch.setattr(scan_walker, "leaf_walk", lambda: spy)
    result = pipeline.scan(root, out, ScanOptions(facts_resolver=FactsResolver(flags or FLAGS, None), verify=verify,
                                                  threads=2))
    monkeypatch.undo()
    return result.exit_code, manifest.read_table(out).to_pylist(), spy


def both_walks(root: Path, tmp_path: Path, monkeypatch, verify: str, flags: dict | None = None):
    code_py, rows_py, _ = scan_rows(root, tmp_path / f"py-{verify}.parquet", "python", monkeypatch, verify, flags)
    code_c, rows_c, spy = scan_rows(root, tmp_path / f"c-{verify}.parquet", "c", monkeypatch, verify, flags)
    return (code_py, rows_py), (code_c, rows_c), spy


def assert_same(py: tuple[int, list[dict]], c: tuple[int, list[dict]]) -> None:
    (code_py, rows_py), (code_c, rows_c) = py, c
    assert code_c == code_py
    assert len(rows_c) == len(rows_py)
    for a, b in zip(rows_c, rows_py):
        assert a == b, (a, b)


# --- the hash -----------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=4096))
def test_vendored_xxh3_128_is_the_xxhash_packages(data):
    from kvmigrate import _leafwalk

    assert _leafwalk.xxh3_128_digest(data) == xxhash.xxh3_128_digest(data)


@pytest.mark.parametrize("size", [1, 16, 17, 128, 129, 240, 241, 1024, 4096, (1 << 20) + 4095, (1 << 20) + 4097])
def test_vendored_xxh3_128_at_its_size_boundaries(size):
    from kvmigrate import _leafwalk

    data = os.urandom(size)
    assert _leafwalk.xxh3_128_digest(data) == xxhash.xxh3_128_digest(data)


# --- same manifest on every defect tree ------------------------------------------------


@pytest.mark.parametrize("verify", ["none", "size", "hash"])
@pytest.mark.parametrize("defect", [None, *BLOCK_DEFECTS, *TREE_DEFECTS])
def test_both_walks_write_the_same_manifest(tmp_path, monkeypatch, defect, verify):
    changes = {**SMALL, **CASES.get(defect, dict(family="llmd", tp=2, kv_kind="mla"))}
    root = tmp_path / "root"
    build(root, SynthSpec(defects=(defect,) if defect else (), **changes))
    py, c, spy = both_walks(root, tmp_path, monkeypatch, verify, {**FLAGS, "kv_kind": changes.get("kv_kind", "full")})
    assert_same(py, c)
    if changes["family"] != "vllmcpp" and defect != "pp_stage":
        assert spy.rows > 0  # the C walk took the plain blocks itself


@pytest.mark.parametrize("model_name", ["meta-llama/Llama-3.1-8B-Instruct", "Modèle/Ünïcode-8B-日本"])
def test_relpaths_under_ascii_and_non_ascii_rank_folders(tmp_path, monkeypatch, model_name):
    """The C walk copies ASCII rank-folder names straight into the row's path and formats
    the others: both give the Python walk's paths."""
    root = tmp_path / "root"
    build(root, SynthSpec(family="llmd", tp=2, kv_kind="mla", model_name=model_name, **SMALL))
    py, c, spy = both_walks(root, tmp_path, monkeypatch, "hash")
    assert_same(py, c)
    assert spy.rows > 0
    rank_folders = {r["relpath"].split("/")[0] for r in c[1] if r["block_hash"] is not None}
    assert len(rank_folders) == 2 and all((root / d).is_dir() for d in rank_folders)
    assert all(model_name.split("/")[-1] in d for d in rank_folders)


@pytest.mark.parametrize("verify", ["size", "hash"])
def test_c_walk_takes_every_plain_block_and_hands_back_the_findings(tmp_path, monkeypatch, verify):
    root = tmp_path / "root"
    result = build(root, SynthSpec(family="llmd", tp=2, kv_kind="mla", defects=("zero_filled", "short"), **SMALL))
    victims = {result.defect(d)["relpath"] for d in ("zero_filled", "short")}
    code, rows, spy = scan_rows(root, tmp_path / "m.parquet", "c", monkeypatch, verify, {**FLAGS, "kv_kind": "mla"})
    handed_back = [f"{fanout}/{name}" for fanout, name in spy.unusual]
    assert spy.rows + len(handed_back) == len(result.block_files())
    if verify == "hash":  # empty and zero-filled files are findings the Python code words
        assert sorted(handed_back) == sorted("/".join(Path(v).parts[-2:]) for v in victims)
    else:  # --verify size reads nothing: the size verdicts come with the C rows
        assert handed_back == []
    by_path = {r["relpath"]: r for r in rows}
    assert {by_path[v]["status"] for v in victims} == {"zero_filled", "short"} if verify == "hash" else True
    assert all(by_path[r]["status"] == "ok" for r in result.block_files() if r not in victims
               and Path(r).name not in {Path(v).name for v in victims})


# --- odd names and kinds ----------------------------------------------------------------


def _plant_odd_entries(root: Path, rank_dir: Path) -> list[str]:
    """Entries next to real blocks that look almost like blocks or fan-out folders."""
    bucket = next(p for p in sorted(rank_dir.iterdir()) if p.is_dir())
    fanout = next(p for p in sorted(bucket.iterdir()) if p.is_dir())
    real = next(p for p in sorted(fanout.iterdir()))
    hh = fanout.name[:2]
    prefix = bucket.name + hh
    planted = {
        fanout / (prefix + "ABCD.bin"): b"upper-case hex",
        fanout / (prefix + "abc.bin"): b"odd hex length",
        fanout / (prefix + "abcd.bin\n"): b"trailing newline",
        fanout / (prefix + "abcd.BIN"): b"upper-case suffix",
        fanout / "fff000aa.bin": b"misfiled: another bucket",
        fanout / (prefix + "0000.bin"): b"",  # empty
        fanout / (prefix + "1111.bin"): bytes(300),  # zero-filled
        fanout / (prefix + "2222.bin.tmp"): b"x",
        bucket / (prefix + "3333.bin"): b"a block name in the bucket folder",
        bucket / (hh + "_g"): b"a fan-out name without a group, as a file",
        bucket / "not-a-fanout" / (prefix + "4444.bin"): b"in a foreign folder",
        bucket / (hh + "_g1234567890") / (prefix + "5555.bin"): b"group of 10 digits",
        bucket / (hh + "_g\u0663") / (prefix + "6666.bin"): b"arabic-indic digit",
        bucket / (hh + "_g0\n") / (prefix + "7777.bin"): b"fan-out name with a newline",
        bucket / ("zz_g0") / (prefix + "8888.bin"): b"non-hex fan-out",
    }
    for path, data in planted.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (fanout / (prefix + "9999.bin")).mkdir()  # a folder named like a block
    os.symlink(real, fanout / (prefix + "aaaa.bin"))  # a symlink named like a block
    os.mkfifo(fanout / (prefix + "bbbb.bin"))  # a FIFO named like a block (never opened)
    odd = os.fsdecode(b"\xff\xfe" + prefix.encode() + b"cccc.bin")  # undecodable name
    (fanout / odd).write_bytes(b"undecodable")
    return [str(p.relative_to(root)) for p in planted]


@pytest.mark.parametrize("verify", ["none", "size", "hash"])
def test_odd_names_and_kinds_are_worded_alike(tmp_path, monkeypatch, verify):
    root = tmp_path / "root"
    build(root, SynthSpec(family="llmd", tp=2, kv_kind="mla", **SMALL))
    rank_dir = next(p for p in sorted(root.iterdir()) if p.name.endswith("_r0"))
    planted = _plant_odd_entries(root, rank_dir)
    py, c, spy = both_walks(root, tmp_path, monkeypatch, verify, {**FLAGS, "kv_kind": "mla"})
    assert_same(py, c)
    listed = {r["relpath"] for r in c[1]}
    assert set(planted) <= listed
    assert spy.unusual  # handed back, not taken


# --- the path grammar: both walks classify every name as layout.py does ------------------

HEX = "0123456789abcdef"


@st.composite
def planted_names(draw) -> tuple[str, ...]:
    """(bucket, fan-out, file) or (bucket, file) names below a rank folder, each valid half
    of the time, else a near miss (hex length, case, `_g` missing, fan-out mismatch,
    non-ASCII digits and letters, a trailing newline, temp suffixes)."""
    h = draw(st.integers(3, 8).flatmap(lambda n: st.text(alphabet=HEX, min_size=2 * n, max_size=2 * n)))
    hhh, hh = h[:3], h[3:5] or "00"
    group = draw(st.sampled_from(["0", "1", "00", "1234567890"]))

    def one(valid: str, *near: str) -> str:  # the valid name half of the time
        return draw(st.sampled_from(near)) if draw(st.booleans()) else valid

    bucket = one(hhh, "fff", hhh.upper(), h[:2], hhh + "0", hhh + "\n", h[:2] + "\u00e9")
    fanout = one(f"{hh}_g{group}", f"{h[5:7] or 'ff'}_g0", f"{hh}_g", f"{hh}_gx", f"{hh}_g\u0663",
                 f"{hh}_g{group}\n", f"{hh.upper()}_g0", f"{hh[:1]}_g0", f"{hh}-g0", f"{hh}g{group}")
    name = one(f"{h}.bin", f"{h[:-1]}.bin", f"{h[:4]}.bin", f"{h.upper()}.bin", f"{h}.bin.tmp", f"{h}.bin\n", f"{h}.BIN",
               f"{h}\u00e9.bin",
               f"\u0663{h}.bin", f"{h}.bin_12.tmp", f"{h}bin")
    return (bucket, fanout, name) if draw(st.integers(0, 3)) else (bucket, name)


@pytest.fixture(scope="module")
def grammar_tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("grammar") / "root"
    build(root, SynthSpec(family="llmd", tp=1, kv_kind="mla", **SMALL))
    return root


@pytest.mark.parametrize("verify", ["size", "hash"])
def test_both_walks_classify_every_name_as_the_layout_grammar(grammar_tree, tmp_path_factory, monkeypatch, verify):
    """Real files with generated names in a rank folder: the C walk writes the Python
    walk's rows, and a file is a block row (its hash, group, misfiled or not) exactly
    when layout.parse_block_relpath says its path is a block path; the plan's vectorised
    block-path match agrees too."""
    import pyarrow as pa
    from hypothesis import HealthCheck

    from kvmigrate import layout
    from kvmigrate.migrate.plan import _source_paths_ok

    rank_dir = next(p.name for p in grammar_tree.iterdir() if p.name.endswith("_r0"))

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(planted_names(), min_size=1, max_size=8))
    def check(entries):
        tmp = tmp_path_factory.mktemp("case")
        root = tmp / "root"
        shutil.copytree(grammar_tree, root, symlinks=True)
        planted = {"/".join((rank_dir, *e)) for e in entries}
        for rel in planted:
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"\x01" * 64)
        py, c, _ = both_walks(root, tmp, monkeypatch, verify, {**FLAGS, "kv_kind": "mla"})
        assert_same(py, c)
        by_path = {r["relpath"]: r for r in c[1]}
        for rel in planted:
            row, parsed = by_path[rel], layout.parse_block_relpath(rel)
            if parsed is None:
                assert row["block_hash"] is None, row
            else:
                block = parsed[1]
                assert (row["block_hash"].hex(), row["group"]) == (block.hex_hash, block.group), row
                assert (row["status"] == "misfiled") == block.misfiled, row
        rels = sorted(planted)
        assert _source_paths_ok(pa.array(rels)).to_pylist() == [layout.parse_block_relpath(r) is not None
                                                                 for r in rels]
        shutil.rmtree(tmp)

    check()


def test_blocks_larger_than_the_read_buffer_are_streamed(tmp_path, monkeypatch):
    root = tmp_path / "root"
    result = build(root, SynthSpec(family="llmd", tp=2, kv_kind="mla", layers=3, page_bytes=1 << 19, blocks=2))
    sizes = {os.path.getsize(root / r) for r in result.block_files()}
    assert min(sizes) > fsio.READ_BUFFER  # 1.5 MiB files: more than one read
    py, c, spy = both_walks(root, tmp_path, monkeypatch, "hash", {**FLAGS, "kv_kind": "mla"})
    assert_same(py, c)
    for row in c[1]:
        if row["relpath"] in result.block_files():
            assert row["content_xxh3_128"] == xxhash.xxh3_128_digest((root / row["relpath"]).read_bytes())
    assert spy.rows == len(result.block_files())


def _chunk_sizes() -> list[int]:
    from kvmigrate import _leafwalk

    c = _leafwalk.STREAM_CHUNK
    return [c - 1, c, c + 1, 2 * c, 2 * c + 1, 4 * c - 1, 4 * c, 4 * c + 1,
            fsio.READ_BUFFER - 1, fsio.READ_BUFFER, fsio.READ_BUFFER + 1]


@pytest.mark.parametrize("fill", ["random", "zeros_then_one", "zeros"])
def test_blocks_around_the_stream_chunk_are_hashed_whole(tmp_path, monkeypatch, fill):
    """Block files of sizes about the C walk's read chunk (one read below it, chunks from
    it on, the last read one byte longer): both walks give each file's whole-file digest,
    and only an all-zero file is zero-filled (a non-zero byte in the last chunk counts)."""
    root = tmp_path / "root"
    result = build(root, SynthSpec(family="llmd", tp=2, kv_kind="mla", **{**SMALL, "blocks": 8}))
    files = sorted(result.block_files())
    sizes = _chunk_sizes()
    assert len(files) >= len(sizes)
    written = {}
    for rel, size in zip(files, sizes):
        if fill == "random":
            data = os.urandom(size)
        else:
            data = bytes(size - 1) + (b"\1" if fill == "zeros_then_one" else b"\0")
        (root / rel).write_bytes(data)
        written[rel] = data
    py, c, spy = both_walks(root, tmp_path, monkeypatch, "hash", {**FLAGS, "kv_kind": "mla"})
    assert_same(py, c)
    rows = {r["relpath"]: r for r in c[1]}
    for rel, data in written.items():
        row = rows[rel]
        assert row["size"] == len(data)
        if fill == "zeros":
            assert row["status"] == "zero_filled", row
        else:
            assert row["content_xxh3_128"] == xxhash.xxh3_128_digest(data)
            assert row["status"] != "zero_filled"


# --- races and permission faults at the system-call boundary --------------------------

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Before the scanner opens a file whose name is in an environment variable: delete it
   (KVM_RACE_GONE), swap it for a symlink (KVM_RACE_SYMLINK), or refuse (KVM_RACE_DENY). */
/* KVM_REL_LOG: one line per block file opened or lstat'ed relative to a folder descriptor
   (the C walk; the Python walk uses whole paths). */
static void log_relative(int dirfd, const char *path, const char *what) {
    const char *log = getenv("KVM_REL_LOG");
    if (!log || dirfd == AT_FDCWD || path[0] == '/' || !strstr(path, ".bin")) return;
    int fd = syscall(SYS_openat, AT_FDCWD, log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
    if (fd >= 0) {
        if (write(fd, what, strlen(what)) < 0) {}
        close(fd);
    }
}

int fstatat(int dirfd, const char *path, struct stat *st, int flags) {
    log_relative(dirfd, path, "stat\n");
    int (*real)(int, const char *, struct stat *, int) = dlsym(RTLD_NEXT, "fstatat");
    return real(dirfd, path, st, flags);
}
int fstatat64(int dirfd, const char *path, struct stat64 *st, int flags) {
    log_relative(dirfd, path, "stat\n");
    int (*real)(int, const char *, struct stat64 *, int) = dlsym(RTLD_NEXT, "fstatat64");
    return real(dirfd, path, st, flags);
}

static int race(int dirfd, const char *path, int flags) {
    log_relative(dirfd, path, "open\n");
    const char *log = getenv("KVM_OPEN_LOG");
    if (log && strstr(path, ".bin")) { /* which flags each block file is opened with */
        int fd = syscall(SYS_openat, AT_FDCWD, log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
        if (fd >= 0) {
            char line[64];
            int n = snprintf(line, sizeof line, "%d %d\n", (flags & O_NOATIME) != 0, (flags & O_NOFOLLOW) != 0);
            if (write(fd, line, n) < 0) {}
            close(fd);
        }
    }
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    const char *gone = getenv("KVM_RACE_GONE"), *link = getenv("KVM_RACE_SYMLINK"), *deny = getenv("KVM_RACE_DENY");
    struct stat st;
    if (gone && !strcmp(base, gone)) unlinkat(dirfd, path, 0);
    if (link && !strcmp(base, link) && !fstatat(dirfd, path, &st, AT_SYMLINK_NOFOLLOW) && S_ISREG(st.st_mode)) {
        unlinkat(dirfd, path, 0);
        symlinkat("/etc/passwd", dirfd, path);
    }
    if (deny && !strcmp(base, deny)) { errno = EACCES; return -1; }
    return 0;
}

/* KVM_DT_UNKNOWN: every getdents64 entry says DT_UNKNOWN, as on filesystems without file
   types in directories: the C walk must lstat each entry (glibc's readdir, which the
   Python walk uses, does not go through syscall()). */
long syscall(long number, ...) {
    va_list ap;
    va_start(ap, number);
    long a[6];
    for (int i = 0; i < 6; i++) a[i] = va_arg(ap, long);
    va_end(ap);
    long (*real)(long, ...) = dlsym(RTLD_NEXT, "syscall");
    long r = real(number, a[0], a[1], a[2], a[3], a[4], a[5]);
    if (number == SYS_getdents64 && r > 0 && getenv("KVM_DT_UNKNOWN")) {
        for (long pos = 0; pos < r;) {
            char *entry = (char *)a[1] + pos;
            unsigned short reclen;
            memcpy(&reclen, entry + 16, sizeof reclen);
            entry[18] = 0; /* d_type = DT_UNKNOWN */
            pos += reclen;
        }
    }
    return r;
}

/* KVM_RACE_GROW / KVM_RACE_GROW_ONCE: just before a read of the file so named, append
   4096 bytes to it (a writer at work in place): at every read, or at the first read in
   this process only. */
#include <sys/uio.h>
static int grown_once;
static void grow(int fd) {
    const char *always = getenv("KVM_RACE_GROW"), *once = getenv("KVM_RACE_GROW_ONCE");
    if (!always && !(once && !grown_once)) return;
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) return;
    path[n] = 0;
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    if (!((always && !strcmp(base, always)) || (once && !strcmp(base, once)))) return;
    if (!always) grown_once = 1;
    int w = syscall(SYS_openat, AT_FDCWD, path, O_WRONLY | O_APPEND | O_CLOEXEC);
    if (w < 0) return;
    char more[4096];
    memset(more, 0x5a, sizeof more);
    if (write(w, more, sizeof more) < 0) {}
    close(w);
}
ssize_t read(int fd, void *buf, size_t count) {
    grow(fd);
    ssize_t (*real)(int, void *, size_t) = dlsym(RTLD_NEXT, "read");
    return real(fd, buf, count);
}
ssize_t readv(int fd, const struct iovec *iov, int iovcnt) {
    grow(fd);
    ssize_t (*real)(int, const struct iovec *, int) = dlsym(RTLD_NEXT, "readv");
    return real(fd, iov, iovcnt);
}

#define MODE(flags) mode_t mode = 0; if (flags & O_CREAT) { va_list ap; va_start(ap, flags); mode = va_arg(ap, int); va_end(ap); }

int openat(int dirfd, const char *path, int flags, ...) {
    MODE(flags)
    if (race(dirfd, path, flags)) return -1;
    int (*real)(int, const char *, int, ...) = dlsym(RTLD_NEXT, "openat");
    return real(dirfd, path, flags, mode);
}
int openat64(int dirfd, const char *path, int flags, ...) {
    MODE(flags)
    if (race(dirfd, path, flags)) return -1;
    int (*real)(int, const char *, int, ...) = dlsym(RTLD_NEXT, "openat64");
    return real(dirfd, path, flags, mode);
}
int open(const char *path, int flags, ...) {
    MODE(flags)
    if (race(AT_FDCWD, path, flags)) return -1;
    int (*real)(const char *, int, ...) = dlsym(RTLD_NEXT, "open");
    return real(path, flags, mode);
}
int open64(const char *path, int flags, ...) {
    MODE(flags)
    if (race(AT_FDCWD, path, flags)) return -1;
    int (*real)(const char *, int, ...) = dlsym(RTLD_NEXT, "open64");
    return real(path, flags, mode);
}
"""


@pytest.fixture(scope="module")
def race_shim(tmp_path_factory) -> Path:
    """An LD_PRELOAD library that races the scanner inside open()/openat() (built with cc:
    CI machines have it, as the C walk itself needs it)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed to build the race shim"
    d = tmp_path_factory.mktemp("shim")
    (d / "shim.c").write_text(textwrap.dedent(SHIM))
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(d / "shim.so"), str(d / "shim.c"), "-ldl"], check=True)
    return d / "shim.so"


def _scan_with_shim(shim: Path, root: Path, out: Path, walk: str, verify: str = "hash",
                    **race: str) -> tuple[int, dict[str, dict], str]:
    env = {**os.environ, "LD_PRELOAD": str(shim), **race}
    env.pop("KVMIGRATE_PURE_PYTHON", None)
    if walk == "python":
        env["KVMIGRATE_PURE_PYTHON"] = "1"
    proc = subprocess.run([sys.executable, "-m", "kvmigrate", "scan", str(root), "-o", str(out), "--verify", verify,
                           "--model-dtype", "bfloat16", "--kv-kind", "mla"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, {r["relpath"]: r for r in manifest.read_table(out).to_pylist()}, proc.stderr


@pytest.mark.parametrize("walk", WALKS)
def test_blocks_deleted_or_replaced_by_a_symlink_just_before_open_are_dropped(tmp_path, race_shim, walk):
    root = tmp_path / "root"
    result = build(root, SynthSpec(family="llmd", tp=2, kv_kind="mla", **SMALL))
    gone, replaced = result.block_files()[0], result.block_files()[-1]
    hit = {Path(gone).name, Path(replaced).name}  # (a block's replicas share their name: both ranks race)
    code, rows, _ = _scan_with_shim(race_shim, root, tmp_path / "m.parquet", walk,
                                    KVM_RACE_GONE=Path(gone).name, KVM_RACE_SYMLINK=Path(replaced).name)
    assert not (root / gone).exists() and (root / replaced).is_symlink()  # the race did happen
    assert not [rel for rel in rows if Path(rel).name in hit]
    blocks = [r for r in rows.values() if r["block_hash"] is not None]
    assert len(blocks) == len([r for r in result.block_files() if Path(r).name not in hit]) > 0
    assert {r["status"] for r in rows.values()} == {"ok"}
    assert code == 1  # no finding: the blocks are pending migration only


@pytest.mark.parametrize("verify", ["size", "hash"])
def test_c_walk_on_a_filesystem_without_file_types_in_directories(tmp_path, race_shim, verify):
    """d_type DT_UNKNOWN everywhere: the C walk lstats each entry and still takes the plain
    blocks and hands back the rest, writing the Python walk's manifest."""
    root = tmp_path / "root"
    build(root, SynthSpec(family="llmd", tp=2, kv_kind="mla", **SMALL))
    rank_dir = next(p for p in sorted(root.iterdir()) if p.name.endswith("_r0"))
    planted = _plant_odd_entries(root, rank_dir)
    code_py, rows_py, _ = _scan_with_shim(race_shim, root, tmp_path / "py.parquet", "python", verify)
    log = tmp_path / "relative.log"
    code_c, rows_c, _ = _scan_with_shim(race_shim, root, tmp_path / "c.parquet", "c", verify, KVM_DT_UNKNOWN="1",
                                        KVM_REL_LOG=str(log))
    assert_same((code_py, list(rows_py.values())), (code_c, list(rows_c.values())))  # same rows, same order
    assert set(planted) <= set(rows_c)
    # the C walk did take the plain blocks: each was lstat'ed by descriptor (d_type unknown),
    # and, hashing, opened by descriptor
    calls = log.read_text().split()
    plain = [r for r in rows_c.values() if r["status"] == "ok" and r["block_hash"] is not None]
    assert calls.count("open") >= (len(plain) if verify == "hash" else 0)
    assert calls.count("stat") >= len(plain)


@pytest.mark.parametrize("walk", WALKS)
def test_block_files_are_opened_without_atime_update_or_symlink_follow(tmp_path, race_shim, walk):
    """Evictors judge a block's age by its atime: reading it for a hash must not refresh it."""
    root = tmp_path / "root"
    result = build(root, SynthSpec(family="llmd", tp=2, kv_kind="mla", **SMALL))
    log = tmp_path / "opens.log"
    code, rows, _ = _scan_with_shim(race_shim, root, tmp_path / "m.parquet", walk, KVM_OPEN_LOG=str(log))
    opens = log.read_text().split("\n")[:-1]
    assert len(opens) >= len(result.block_files())
    assert set(opens) == {"1 1"}  # O_NOATIME and O_NOFOLLOW on every one (we own the files: no EPERM)


@pytest.mark.parametrize("walk", WALKS)
def test_block_refused_at_open_is_unreadable_with_errno_and_path(tmp_path, race_shim, walk):
    root = tmp_path / "root"
    result = build(root, SynthSpec(family="llmd", tp=2, kv_kind="mla", **SMALL))
    victim = result.block_files()[1]
    code, rows, _ = _scan_with_shim(race_shim, root, tmp_path / "m.parquet", walk, KVM_RACE_DENY=Path(victim).name)
    row = rows[victim]
    assert row["status"] == "unreadable" and "EACCES" in row["reason"] and victim in row["reason"]
    assert code == 1 | 8
    assert all(r["status"] == "ok" for rel, r in rows.items() if rel != victim and r["block_hash"] is not None
               and Path(rel).name != Path(victim).name)


# --- which walk runs --------------------------------------------------------------------


@pytest.mark.parametrize("walk", WALKS)
def test_block_growing_while_read_is_unreadable_not_misreported(tmp_path, race_shim, walk):
    """Block files that grow at every read (something writing them in place): read twice,
    changed twice, so their rows say so (unreadable, operational bit, a remedy) and carry
    no hash of bytes that match no size. The other blocks are unaffected."""
    root = tmp_path / "root"
    result = build(root, SynthSpec(family="llmd", tp=2, kv_kind="mla", **SMALL))
    name = Path(sorted(result.block_files())[0]).name  # (a block's replicas share their name: both grow)
    code, rows, _ = _scan_with_shim(race_shim, root, tmp_path / "m.parquet", walk, KVM_RACE_GROW=name)
    hit = [r for rel, r in rows.items() if Path(rel).name == name]
    assert len(hit) == 2
    for row in hit:
        assert row["status"] == "unreadable", row
        assert "changed size while read" in row["reason"] and "rerun the scan" in row["reason"]
        assert row["content_xxh3_128"] is None
    assert code & 8
    others = [r for rel, r in rows.items() if rel in result.block_files() and Path(rel).name != name]
    assert others and all(r["content_xxh3_128"] is not None and r["status"] == "ok" for r in others)


@pytest.mark.parametrize("walk", WALKS)
def test_block_that_grew_once_while_read_is_read_again(tmp_path, race_shim, walk):
    """A block file that grows once, during its first read: read again from a fresh open,
    its row holds the size and the hash of the same bytes (what the file now is)."""
    root = tmp_path / "root"
    result = build(root, SynthSpec(family="llmd", tp=2, kv_kind="mla", **SMALL))
    name = Path(sorted(result.block_files())[0]).name
    replicas = [rel for rel in result.block_files() if Path(rel).name == name]
    before = {rel: (root / rel).stat().st_size for rel in replicas}
    code, rows, _ = _scan_with_shim(race_shim, root, tmp_path / "m.parquet", walk, KVM_RACE_GROW_ONCE=name)
    grown = [rel for rel in replicas if (root / rel).stat().st_size == before[rel] + 4096]
    assert len(grown) >= 1  # the race did happen (once per walking process)
    for rel in replicas:
        data = (root / rel).read_bytes()
        row = rows[rel]
        assert row["size"] == len(data)
        assert row["content_xxh3_128"] == xxhash.xxh3_128_digest(data)
        assert row["status"] != "unreadable"


def test_pure_python_switch(monkeypatch):
    """KVMIGRATE_PURE_PYTHON=1 rules the C walk out; otherwise it runs (the tests need it
    built: `pip install` compiles it where a C compiler is found, as on every CI machine)."""
    monkeypatch.setenv("KVMIGRATE_PURE_PYTHON", "1")
    assert scan_walker.leaf_walk() is None
    monkeypatch.setenv("KVMIGRATE_PURE_PYTHON", "0")
    assert scan_walker.leaf_walk() is not None
    monkeypatch.delenv("KVMIGRATE_PURE_PYTHON")
    from kvmigrate import _leafwalk

    assert scan_walker.leaf_walk() is _leafwalk


@pytest.mark.parametrize("verify", ["size", "hash"])
def test_existing_target_folders_are_judged_alike(tmp_path, monkeypatch, verify):
    """After a migration the target folder exists: linked blocks are already_present, a
    target path holding other bytes is aliases_source, a vanished link is a link again."""
    root = tmp_path / "root"
    build(root, SynthSpec(family="llmd", tp=2, kv_kind="mla", **{**SMALL, "blocks": 8}))
    flags = ["--model-dtype", "bfloat16", "--kv-kind", "mla"]
    proc = subprocess.run([sys.executable, "-m", "kvmigrate", "migrate", str(root), "--apply", *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    _, rows, _ = scan_rows(root, tmp_path / "after.parquet", "python", monkeypatch, verify, {**FLAGS, "kv_kind": "mla"})
    targets = sorted({r["target_relpath"] for r in rows if r["action"] == "already_present" and r["target_relpath"]})
    assert len(targets) >= 3
    (root / targets[0]).unlink()
    (root / targets[0]).write_bytes(b"other bytes")  # a foreign file at a target path
    (root / targets[1]).unlink()  # a link gone: to be made again
    py, c, spy = both_walks(root, tmp_path, monkeypatch, verify, {**FLAGS, "kv_kind": "mla"})
    assert_same(py, c)
    actions = {r["action"] for r in c[1]}
    reasons = " ".join(r["reason"] or "" for r in c[1])
    assert "already_present" in actions and "aliases_source" in reasons
    assert actions - {"already_present", "none"}  # the block whose link vanished is to be made again
    assert spy.rows > 0


# --- finish_blocks against its Python statement -------------------------------------------


def _finish_reference(blocks, columns, order, verdicts, classify, replicas, prefix, targets_exist, shapes):
    """What leaf.finish_blocks does, written plainly (Walker._finish_blocks_py's loop)."""
    P, K, Z, C, S, A, R, T = (columns[j] for j in (0, 2, 5, 10, 12, 13, 14, 15))
    slow, check = [], []
    for key in sorted(blocks):
        idx = blocks[key]
        group, hex_hash = key
        order.extend(idx)
        if any(S[i] != "ok" for i in idx):
            slow.append(key)
            continue
        differ = bool(replicas) and len(idx) > 1 and len({Z[i] if C[i] is None else C[i] for i in idx}) > 1
        shape = (group, tuple(K[i] for i in idx), tuple(Z[i] for i in idx), differ)
        verdict = verdicts.get(shape)
        if verdict is None:
            verdict = classify(idx, group, hex_hash, shape)
        tpath = f"{prefix}{hex_hash[:3]}/{hex_hash[3:5]}_g{group}/{hex_hash}.bin"
        for i, (status, action, reason, has_target) in zip(idx, verdict):
            S[i], A[i], R[i] = status, action, reason
            if has_target:
                T[i] = tpath
                if targets_exist and tpath != P[i]:
                    check.append((i, hex_hash))
        if shapes is not None:
            shapes[shape] = shapes.get(shape, 0) + 1
    return slow, check


_block = st.tuples(
    st.sampled_from([0, 1, 2, 9, 10, 11, 100]),  # numeric, not string, order of groups
    st.sampled_from(["abcdef", "abcdef00", "abcdee", "0a1b2c", "ffffff", "abcdef0a"]),  # prefixes of each other
    st.lists(st.tuples(st.sampled_from([0, 1, 3]), st.sampled_from([4096, 4096, 8192]), st.booleans(),
                       st.sampled_from(["ok"] * 5 + ["corrupt"]), st.sampled_from(["c", "c", "py"])),
             min_size=1, max_size=3))


@pytest.mark.slow  # big property test / kill matrix: CI runs it, `-m 'not slow'` leaves it out
@settings(max_examples=150, deadline=None)
@given(st.lists(_block, max_size=12), st.sampled_from(["always", "never", "alternate"]), st.booleans(),
       st.booleans(), st.sampled_from(["org_m_0123456789ab/", "Modèle_日本_0123456789ab/", ""]), st.booleans(),
       st.booleans(), st.sampled_from(["python rows first", "C rows first", "C rows only"]))
def test_finish_blocks_is_its_python_statement(blocks_in, keep, replicas, targets_exist, prefix, count, hashed,
                                               joining):
    """Block rows the C walk took (real files, kept and grouped by block in its BlockRows)
    and rows Python made (column lists), in one block or not, Python rows joining before
    or after the C walk's (export_blocks): finish_blocks sorts the blocks in Python's
    tuple order (group numerically, then the hex string), reuses a shape's verdict only
    once it is kept, builds target paths from ASCII and non-ASCII prefixes and counts
    shapes, row for row as the plain Python loop does on the same rows as lists."""
    import tempfile

    from kvmigrate import _leafwalk

    def classify_with(verdicts, calls):
        def classify(idx, group, hex_hash, shape):
            calls.append((tuple(idx), group, hex_hash, shape))
            verdict = tuple((f"s{group}", "none" if shape[3] else "link", f"r{len(idx)}-{j}", j % 2 == 0)
                            for j in range(len(idx)))
            if keep == "always" or (keep == "alternate" and len(calls) % 2):
                verdicts[shape] = verdict
            return verdict
        return classify

    def size_verdict(group, size):  # what walk_bucket asks of a C row's size
        return ("corrupt", f"size {size} is odd") if size == 8192 and group == 1 else None

    with tempfile.TemporaryDirectory() as tmp:
        columns = tuple([] for _ in range(16))
        store = _leafwalk.BlockRows()
        blocks: dict = {}
        py_rows: dict = {}  # block -> list rows Python made for it
        on_disk: set = set()
        for group, hex_hash, files in blocks_in:
            if (group, hex_hash) in py_rows:
                continue
            py_rows[(group, hex_hash)] = []
            for rank, size, same, status, kind in files:
                if (kind == "c" or joining == "C rows only") and (rank, group, hex_hash) not in on_disk:
                    on_disk.add((rank, group, hex_hash))
                    folder = Path(tmp, f"{prefix}r{rank}", hex_hash[:3], f"{hex_hash[3:5]}_g{group}")
                    folder.mkdir(parents=True, exist_ok=True)
                    (folder / f"{hex_hash}.bin").write_bytes((b"\x01" if same else bytes([rank + 2])) * size)
                    continue
                if joining == "C rows only":
                    continue
                row = [None] * 16
                row[0] = f"{prefix}r{rank}/{hex_hash[:3]}/{hex_hash[3:5]}_g{group}/{hex_hash}.bin"
                row[2], row[3], row[5], row[12], row[13], row[14] = rank, group, size, status, "none", ""
                row[10] = (xxhash.xxh3_128_digest((b"\x01" if same else bytes([rank + 2])) * size) if hashed
                           else None)
                py_rows[(group, hex_hash)].append(len(columns[0]))
                for j, col in enumerate(columns):
                    col.append(row[j])

        def join_python_rows():
            for key, idx in py_rows.items():
                if idx:
                    blocks.setdefault(key, []).extend(idx)

        if joining == "python rows first":
            join_python_rows()
        buf = bytearray(1 << 16)
        for rank, hhh in sorted({(r, h[:3]) for r, _, h in on_disk}):
            rel = f"{prefix}r{rank}/{hhh}/"
            assert _leafwalk.walk_bucket(str(Path(tmp, rel)), rel, hhh, hashed, None, 0, rank, store, size_verdict,
                                         buf) == []
        if joining == "C rows first":
            store.export_blocks(blocks)
            join_python_rows()

        # the reference runs on the same rows, all in lists: C row j is list row `first_c + j`,
        # filed under its block in walk order, before or after the Python rows
        first_c = len(columns[0])
        ref_columns = tuple(list(col) for col in columns)
        c_blocks: dict = {}
        for j in range(len(store)):
            row = store.row(j)
            for col, value in zip(ref_columns, row):
                col.append(value)
            c_blocks.setdefault((row[3], row[0].rsplit("/", 1)[1][:-4]), []).append(first_c + j)
        ref_blocks: dict = {}
        for key in (*py_rows, *c_blocks):
            idx = (py_rows.get(key, []) + c_blocks.get(key, []) if joining == "python rows first"
                   else c_blocks.get(key, []) + py_rows.get(key, []))
            if idx:
                ref_blocks[key] = idx

        def as_list_index(i):
            return i if i >= 0 else first_c - 1 - i

        results = []
        for fn, cols, blks in ((_leafwalk.finish_blocks, columns, blocks), (_finish_reference, ref_columns, ref_blocks)):
            order: list = []
            verdicts: dict = {}
            calls: list = []
            shapes = {} if count else None
            args = (blks, cols, store) if fn is _leafwalk.finish_blocks else (blks, cols)
            slow, check = fn(*args, order, verdicts, classify_with(verdicts, calls), replicas, prefix,
                             targets_exist, shapes)
            slow_rows = [[as_list_index(i) for i in blks[key]] for key in slow]  # the slow blocks are in the dict
            if fn is _leafwalk.finish_blocks:  # C rows as the reference sees them
                order = [as_list_index(i) for i in order]
                check = [(as_list_index(i), h) for i, h in check]
                calls = [(tuple(as_list_index(i) for i in idx), *rest) for idx, *rest in calls]
                cols = tuple(list(col) for col in columns)
                for j in range(len(store)):
                    for col, value in zip(cols, store.row(j)):
                        col.append(value)
            results.append((list(slow), slow_rows, list(check), order, cols, calls, shapes))
        assert results[0] == results[1]
        assert len(store) == len(on_disk)


def test_blocks_of_one_name_in_two_groups_stay_apart(tmp_path):
    """The C walk groups a bucket's rows by (group, block hash) in a hash table: 3,000
    names present in groups 0 and 1 of one bucket (the table grows and its probes cross
    each other many times) give 6,000 blocks of one row each, every row in its own group's
    block."""
    from kvmigrate import _leafwalk

    rel = "m_0123456789ab_r0/abc/"
    names = [f"abcde{i:06x}{'0' * 53}" for i in range(3000)]
    for group in (0, 1):
        folder = tmp_path / rel / f"de_g{group}"
        folder.mkdir(parents=True)
        for name in names:
            (folder / f"{name}.bin").write_bytes(bytes([group + 1]) * 64)
    store = _leafwalk.BlockRows()
    assert _leafwalk.walk_bucket(str(tmp_path / rel), rel, "abc", True, None, 0, 0, store, None,
                                 bytearray(1 << 16)) == []
    blocks: dict = {}
    store.export_blocks(blocks)
    assert len(blocks) == 6000
    for (group, hex_hash), idx in blocks.items():
        assert len(idx) == 1
        row = store.row(-idx[0] - 1)
        assert row[3] == group and row[0] == f"{rel}de_g{group}/{hex_hash}.bin"
        assert row[10] == xxhash.xxh3_128_digest(bytes([group + 1]) * 64)


def test_the_c_walk_takes_the_row_columns_in_the_row_stores_order():
    """finish_blocks reads the Python rows' column lists, and BlockRows.row returns a row,
    by position: the C side's column order (ROW_COLUMNS) is the row store's (Rows.COLUMNS)."""
    from kvmigrate import _leafwalk
    from kvmigrate.scan.rows import Rows

    assert _leafwalk.ROW_COLUMNS == Rows.COLUMNS
