"""Parallel scan: worker processes (and threads inside them) write exactly the manifest one
process writes — same rows, same order, same metadata — on trees with every kind of
finding, in every --verify mode, per --shard part, with walk errors; a failing worker
stops the scan without leaving a manifest behind."""

from __future__ import annotations

import errno
import json
import os

import pyarrow.parquet as pq
import pytest

from kvmigrate import fsio, manifest, pipeline
from kvmigrate import scan as scan_mod
from kvmigrate.options import ScanOptions
from kvmigrate.scan import blocks as scan_blocks
from kvmigrate.scan import parallel
from kvmigrate.scan import run as scan_run

from helpers.cli_helpers import arrow_pool_after, loads_pyarrow

FACTS = {"model_dtype": "bfloat16", "kv_kind": "mla"}
TREE = (dict(family="llmd", tp=2, kv_kind="mla", blocks=24,
             defects=("missing_rank", "tmp_vllm", "size_mismatch", "misfiled", "zero_filled", "short",
                      "replica_differs", "symlink", "fifo")),
        dict(family="vllm", scheme="S3", tp=2, kv_kind="mla", replicated_layout=True, model_name="deepseek/V2",
             blocks=24, defects=("deep_layout", "tmp_probe")),
        dict(family="vllmcpp", tp=2, kv_kind="mla", blocks=12, defects=("header_key", "foreign"),
             model_name="Qwen/Qwen3-4B"),
        dict(family="vllm", scheme="S1", tp=1, model_name="org/orphan", blocks=8, defects=("orphan_rank",)))


@pytest.fixture
def tree(synth_root):
    root, _ = synth_root(*TREE)
    (root / "notes.txt").write_text("ops notes\n")
    return root


@pytest.fixture
def many_tasks(monkeypatch):
    """One bucket per task and tiny row groups, so both workers get many tasks and the
    parent joins many batches."""
    monkeypatch.setattr(parallel, "TASK_BUCKETS", 1)
    monkeypatch.setattr(scan_run, "BATCH_ROWS", 16)


def run(root, out, **kwargs):
    from kvmigrate.identity.facts import FactsResolver

    result = pipeline.scan(root, out, ScanOptions(facts_resolver=FactsResolver(FACTS, None),
                                                  command="kvmigrate scan ROOT", **kwargs))
    return result, manifest.read_table(out).to_pylist(), manifest.read_metadata(out)


def assert_same(one, other):
    (res_a, rows_a, meta_a), (res_b, rows_b, meta_b) = one, other
    assert len(rows_a) == len(rows_b)
    for a, b in zip(rows_a, rows_b):
        assert a == b, (a["relpath"], b["relpath"])
    assert meta_a == meta_b
    assert res_a.exit_code == res_b.exit_code
    assert json.dumps(res_a.summary).replace(res_a.output, "M") == json.dumps(res_b.summary).replace(res_b.output, "M")


@pytest.mark.parametrize("verify", ["size", "hash", "none"])
def test_workers_write_the_manifest_one_process_writes(tree, tmp_path, many_tasks, verify):
    one = run(tree, tmp_path / "one.parquet", verify=verify, workers=1, threads=1)
    two = run(tree, tmp_path / "two.parquet", verify=verify, workers=2, threads=1)
    statuses = {r["status"] for r in one[1]}
    assert len(one[1]) > 100 and {"ok", "foreign", "tmp_leftover", "unsupported_layout"} <= statuses
    if verify != "none":
        assert {"size_mismatch", "misfiled", "incomplete", "header_invalid"} <= statuses
    if verify == "hash":
        assert {"zero_filled", "replica_mismatch"} <= statuses
    assert pq.ParquetFile(tmp_path / "two.parquet").num_row_groups > 1
    assert_same(one, two)


def test_threads_inside_workers_change_nothing(tree, tmp_path, many_tasks):
    monkeypatched_single = run(tree, tmp_path / "one.parquet", verify="hash", workers=1, threads=1)
    threaded = run(tree, tmp_path / "threads.parquet", verify="hash", workers=1, threads=4)
    both = run(tree, tmp_path / "both.parquet", verify="hash", workers=2, threads=6)  # 3 threads per worker
    assert_same(monkeypatched_single, threaded)
    assert_same(monkeypatched_single, both)


@pytest.mark.parametrize("command", ["scan", "audit", "migrate"])
def test_io_depth_is_the_walker_count_and_threads_its_other_name(tree, tmp_path, monkeypatch, command):
    """--io-depth N (issue 22: reads in flight, to tune for a cold NVMe queue or a network
    filesystem) reaches the walk as its threads in all; --threads is the same option."""
    from click.testing import CliRunner

    from kvmigrate.cli import cli

    seen = []
    real = parallel.parallelism

    def spy(workers, threads, verify, buckets):
        seen.append(threads)
        return real(workers, threads, verify, buckets)

    monkeypatch.setattr(scan_run, "parallelism", spy)
    for flag, n in (("--io-depth", 3), ("--threads", 5)):
        args = [command, str(tree), flag, str(n), "-q", "--kv-kind", "mla", "--model-dtype", "bfloat16"]
        if command != "migrate":
            args += ["-o", str(tmp_path / f"{command}{n}.parquet")]
        result = CliRunner().invoke(cli, args)
        assert result.exception is None or isinstance(result.exception, SystemExit), result.output
        assert "no such option" not in result.output.lower(), result.output
    assert seen == [3, 5]


@pytest.mark.parametrize("part", [0, 1, 2])
def test_each_shard_part_is_the_same_with_workers(tree, tmp_path, many_tasks, part):
    one = run(tree, tmp_path / "one.parquet", shard=(part, 3), workers=1, threads=1)
    two = run(tree, tmp_path / "two.parquet", shard=(part, 3), workers=2, threads=1)
    assert one[1]
    assert_same(one, two)


def test_walk_errors_reach_the_metadata_from_workers(tree, tmp_path, many_tasks, monkeypatch):
    """A bucket folder that can neither be listed nor stat'ed: the error is a walk error
    (metadata, exit bit 8) whether a worker or the parent met it."""
    rank_dir = next(p for p in sorted(tree.iterdir()) if p.name.endswith("_r1") and "deepseek" not in p.name)
    bucket = sorted(p for p in rank_dir.iterdir() if p.is_dir())[0]
    real_scandir, real_lstat = os.scandir, os.lstat

    def scandir(path="."):
        if str(path) == str(bucket):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_scandir(path)

    def lstat(path, *a, **kw):
        if str(path) == str(bucket):
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real_lstat(path, *a, **kw)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(os, "lstat", lstat)
    one = run(tree, tmp_path / "one.parquet", workers=1, threads=1)
    two = run(tree, tmp_path / "two.parquet", workers=2, threads=1)
    assert one[2]["walk_failed"] is True
    assert [e for e in one[2]["walk_errors"] if bucket.name in e and "EIO" in e]
    assert one[0].exit_code & 8
    assert_same(one, two)


def test_a_failing_worker_stops_the_scan_and_leaves_no_manifest(tree, tmp_path, many_tasks, monkeypatch):
    real_bucket = scan_mod.Walker.bucket

    def bucket(self, unit, hhh, out):
        if hhh == max(unit.bucket_names()):
            raise RuntimeError(f"worker broke on bucket {hhh}")
        return real_bucket(self, unit, hhh, out)

    monkeypatch.setattr(scan_mod.Walker, "bucket", bucket)
    out = tmp_path / "out" / "m.parquet"
    with pytest.raises(RuntimeError, match="worker broke on bucket"):
        run(tree, out, workers=2, threads=1)
    assert sorted(p.name for p in out.parent.iterdir()) == []


def test_one_process_for_small_trees_one_per_core_for_large(monkeypatch, walk):
    monkeypatch.setattr(parallel, "_cpus", lambda: 4)
    small = parallel.PARALLEL_MIN_BUCKETS - 1
    # default threads per process: the C walk waits for the disk without the GIL (4, and 16
    # when hashing: a read per file, and a cold disk serves more the more are queued); the
    # Python walk holds it (1, 2 when hashing)
    size, hashing = (1, 2) if walk == "python" else (parallel.LEAF_THREADS, parallel.LEAF_HASH_THREADS)
    assert (parallel.LEAF_THREADS, parallel.LEAF_HASH_THREADS) == (4, 16)
    assert parallel.parallelism(None, None, "size", small) == (1, size)
    assert parallel.parallelism(None, None, "size", parallel.PARALLEL_MIN_BUCKETS) == (4, size)
    assert parallel.parallelism(None, None, "hash", parallel.PARALLEL_MIN_BUCKETS) == (4, hashing)
    assert parallel.parallelism(None, 8, "size", 10**6) == (4, 2)  # --threads counts threads in all
    assert parallel.parallelism(None, 1, "hash", 10**6) == (1, 1)
    assert parallel.parallelism(None, 2, "hash", 10**6) == (2, 1)
    assert parallel.parallelism(3, 1, "hash", 1) == (3, 1)
    monkeypatch.setattr(parallel, "_cpus", lambda: 1)
    assert parallel.parallelism(None, None, "size", 10**6) == (1, size)


@pytest.mark.parametrize("env, backend", [(None, "system"), ("jemalloc", "jemalloc"), ("mimalloc", "mimalloc")])
def test_scan_uses_the_c_library_malloc_unless_a_pool_is_chosen(tree, tmp_path, env, backend):
    """mimalloc (Arrow's default here) keeps freed pages per thread, jemalloc with no
    decay faults fresh pages in for every batch; scan switches the process to the C
    library's malloc, unless ARROW_DEFAULT_MEMORY_POOL says otherwise."""
    import subprocess
    import sys

    code = ("import pyarrow as pa; from kvmigrate.pipeline import scan; "
            f"scan({str(tree)!r}, {str(tmp_path / 'm.parquet')!r}); print(pa.default_memory_pool().backend_name)")
    env_vars = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    if env:
        env_vars["ARROW_DEFAULT_MEMORY_POOL"] = env
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_vars, check=True)
    assert out.stdout.split()[-1] == backend


@pytest.mark.parametrize("command", ["scan", "audit"])
@pytest.mark.parametrize("env, backend", [(None, "system"), ("jemalloc", "jemalloc")])
def test_scan_commands_choose_the_pool_before_pyarrow_loads(tree, tmp_path, command, env, backend):
    """The scan and audit commands set ARROW_DEFAULT_MEMORY_POOL before pyarrow loads, so
    Arrow's C++ internals (IPC, compute, the Parquet writer) use the C library's malloc
    too: nothing at all is allocated through mimalloc. An explicit choice is kept."""
    args = [command, str(tree), "--verify", "hash", "-q", "-o", str(tmp_path / "m.parquet")]
    assert arrow_pool_after(args, env) == (backend, 0)


@pytest.mark.parametrize("command", ["scan", "audit"])
def test_loading_a_scan_command_leaves_pyarrow_unloaded(command):
    """The scan and audit commands can choose Arrow's pool only while pyarrow is unloaded,
    so loading the command (and everything it imports at top level) must not load it. A
    top-level import of a module that needs pyarrow, anywhere below the command, broke this
    once (the report's view importing the hints)."""
    assert not loads_pyarrow([command, "--help"])


# -- the single-file fast paths the parallel walk relies on ---------------------------------


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, fsio.SMALL_FILE - 1, fsio.SMALL_FILE,
                                  fsio.READ_BUFFER - 1, fsio.READ_BUFFER, 3 * fsio.READ_BUFFER + 7])
@pytest.mark.parametrize("zero", [False, True])
def test_read_file_hashes_every_size_exactly(tmp_path, size, zero):
    """One read of size + 1 bytes for small files, the reused buffer (one read or a
    stream) for large ones: the digest and the all-zero verdict are those of the bytes."""
    import xxhash

    data = bytes(size) if zero else (os.urandom(size // 2 + 1) * 2)[:size]
    if not zero and size:
        data = b"\1" + data[1:]
    f = tmp_path / "f.bin"
    f.write_bytes(data)
    res = fsio.read_file(str(f), want_hash=True)
    assert res.content == xxhash.xxh3_128_digest(data)
    assert res.all_zero is (zero and size > 0)
    assert res.st.st_size == size


@pytest.mark.parametrize("claimed", [100, 9000, fsio.READ_BUFFER + 5])
def test_read_file_of_a_file_whose_size_keeps_changing_says_so(tmp_path, monkeypatch, claimed):
    """fstat's size and the bytes read disagree at both reads (it grew or shrank while
    read, twice): ChangedWhileRead, an OSError naming the path and both sizes, so the row
    says unreadable with a remedy instead of hashing bytes that match no size."""
    f = tmp_path / "f.bin"
    f.write_bytes(b"\2" * 5000)
    real_fstat = os.fstat
    monkeypatch.setattr(os, "fstat", lambda fd: os.stat_result(
        tuple(real_fstat(fd))[:6] + (claimed,) + tuple(real_fstat(fd))[7:]))
    with pytest.raises(fsio.ChangedWhileRead) as info:
        fsio.read_file(str(f), want_hash=True)
    assert isinstance(info.value, OSError) and info.value.errno == errno.EAGAIN
    assert info.value.filename == str(f)
    assert f"{claimed:,} bytes at open" in info.value.strerror and "5,000 read" in info.value.strerror


@pytest.mark.parametrize("claimed", [100, 9000, fsio.READ_BUFFER + 5])
def test_read_file_of_a_file_that_changed_size_once_reads_it_again(tmp_path, monkeypatch, claimed):
    """Only the first read disagrees with fstat: the file is read once more from a fresh
    open, and the result is the whole file's hash with its true size."""
    import xxhash

    f = tmp_path / "f.bin"
    f.write_bytes(b"\2" * 5000)
    real_fstat = os.fstat
    calls = []

    def fstat(fd):
        calls.append(fd)
        st = real_fstat(fd)
        return os.stat_result(tuple(st)[:6] + (claimed,) + tuple(st)[7:]) if len(calls) == 1 else st

    monkeypatch.setattr(os, "fstat", fstat)
    res = fsio.read_file(str(f), want_hash=True)
    assert len(calls) == 2
    assert res.content == xxhash.xxh3_128_digest(b"\2" * 5000) and res.st.st_size == 5000
    assert res.all_zero is False


def test_fast_block_name_match_is_the_layout_grammar():
    """The walk's block-name match (layout.block_hex) accepts exactly what layout.BLOCK_RE accepts."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvmigrate import layout

    names = st.one_of(
        st.text(alphabet="0123456789abcdefABx._\n", max_size=16).map(lambda t: t + ".bin"),
        st.text(alphabet="0123456789abcdef", min_size=0, max_size=70).flatmap(
            lambda h: st.sampled_from([h + ".bin", h + ".bin\n", h + ".bin.tmp", h + "bin", h + ".BIN"])),
        st.text(max_size=20))

    @settings(max_examples=1000, deadline=None)
    @given(names)
    def check(name):
        want = layout.BLOCK_RE.match(name)
        assert layout.block_hex(name) == (want.group(1) if want else None), name

    check()


@pytest.mark.parametrize("defects", [("missing_rank", "tmp_vllm", "replica_differs", "foreign"),
                                     ("size_mismatch", "misfiled")])  # the second rewrites the manifest
def test_scan_summary_is_the_summary_of_its_manifest_read_back(synth_root, tmp_path, many_tasks, defects):
    """scan aggregates the summary from the batches it writes (no second read); it is the
    summary `report` computes from the file."""
    from kvmigrate.report.summary import summarize

    root, _ = synth_root(dict(family="llmd", tp=2, kv_kind="mla", blocks=24, defects=defects))
    for workers in (1, 2):
        res, rows, _ = run(root, tmp_path / f"m{workers}.parquet", verify="hash", workers=workers)
        assert len(rows) > 40 and {r["status"] for r in rows} - {"ok"}
        assert res.summary == summarize(res.output)


SLOW_SCAN = """
import os, sys, time
import kvmigrate.scan as S
import kvmigrate.scan.parallel as P
P.TASK_BUCKETS = 1
P.PARALLEL_MIN_BUCKETS = 1
P._cpus = lambda: 2
real = S.Walker.bucket
def slow(self, unit, hhh, out):
    time.sleep(0.2)
    return real(self, unit, hhh, out)
S.Walker.bucket = slow
from kvmigrate.cli import main
sys.argv = ["kvmigrate", "scan", sys.argv[1], "-o", sys.argv[2], "-q"]
main()
"""


def _children(pid: int) -> set[int]:
    kids: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids |= {int(x) for x in f.read().split()}
    return kids


def _start_slow_scan(tree, tmp_path, env=None):
    import subprocess
    import sys
    import time

    out = tmp_path / "out" / "m.parquet"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SCAN, str(tree), str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 60
    while len(_children(proc.pid)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.3)  # the workers are walking
    return proc, _children(proc.pid), out


def _gone(pids: set[int], timeout: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [p for p in pids if os.path.exists(f"/proc/{p}") and "Z" not in _state(p)]:
            return True
        time.sleep(0.05)
    return False


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_sigterm_stops_the_workers_and_leaves_no_manifest(tree, tmp_path):
    """A stopped pod or `timeout` sends SIGTERM: the scan ends like Ctrl-C (exit 32), its
    workers are gone and no temporary manifest is left."""
    import signal

    proc, workers, out = _start_slow_scan(tree, tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 32, err
    assert "Traceback" not in err
    assert _gone(workers)
    assert not list(out.parent.iterdir())


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
@pytest.mark.parametrize("walk", ["c", "python"])
def test_workers_die_with_a_killed_scan(tree, tmp_path, walk):
    """kill -9 (or the OOM killer) of the scan takes its workers with it: none is left
    blocked on a pipe nobody reads. (The parent-death signal is set by the C extension,
    or through ctypes where it is not built.)"""
    import signal

    env = {"KVMIGRATE_PURE_PYTHON": "1" if walk == "python" else "0"}
    proc, workers, _ = _start_slow_scan(tree, tmp_path, env)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert _gone(workers)


def test_a_ray_scan_part_walks_in_its_own_process(tree, tmp_path, monkeypatch):
    """A Ray part holds one CPU: it must not fork a walk process per core of the node."""
    from kvmigrate import pipeline
    from kvmigrate.identity.facts import FactsResolver
    from kvmigrate.scaleout import ray_runner

    seen = {}
    real = scan_mod.scan

    def spy(root, output, options, **kwargs):
        seen.update(vars(options))
        return real(root, output, options, **kwargs)

    monkeypatch.setattr(scan_mod, "scan", spy)
    monkeypatch.setattr(parallel, "_cpus", lambda: 8)
    monkeypatch.setattr(parallel, "PARALLEL_MIN_BUCKETS", 1)
    (tmp_path / "staging").mkdir()
    ray_runner._scan_part(pipeline.scan, str(tree), str(tmp_path / "staging"), 0, 2,
                          ScanOptions(target="vllm-0.28", facts_resolver=FactsResolver(FACTS, None), verify="size"),
                          False)
    assert seen["workers"] == 1


def test_remembered_verdicts_are_bounded(synth_root, tmp_path, monkeypatch):
    """A namespace of many odd sizes must not grow the per-shape verdict memory without
    bound; blocks past the bound are classified one by one, with the same result."""
    root, _ = synth_root(dict(family="llmd", tp=2, kv_kind="mla", blocks=24))
    for i, f in enumerate(sorted(root.rglob("*.bin"))):
        if i % 2:
            f.write_bytes(f.read_bytes() + b"\1" * (1 + i))  # every second file its own size
    unbounded = run(root, tmp_path / "a.parquet", workers=1, threads=1)
    monkeypatch.setattr(scan_blocks, "VERDICTS_KEPT", 2)
    seen = []
    real = scan_mod.Walker._finish_blocks

    def spy(self, unit, blocks, out):
        real(self, unit, blocks, out)
        seen.append((len(unit.verdicts), len(unit.size_verdicts)))

    monkeypatch.setattr(scan_mod.Walker, "_finish_blocks", spy)
    bounded = run(root, tmp_path / "b.parquet", workers=1, threads=1)
    assert seen and max(max(v) for v in seen) <= 2
    assert_same(unbounded, bounded)
