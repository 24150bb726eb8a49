"""How the walk's tasks run: runs of `<hhh>` buckets of one unit, in fork()ed worker
processes (the walk is Python work: the GIL would serialise threads) or in this process
with threads for I/O concurrency; results come back in task order, so every mode writes
the same manifest."""

from __future__ import annotations

import os
import signal
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from kvmigrate import pacing
from kvmigrate.scan.rows import Rows
from kvmigrate.scan.units import Unit
from kvmigrate.scan.walker import Walker, leaf_walk, shard_part

TASK_BUCKETS = 32  # <hhh> buckets per task
PARALLEL_MIN_BUCKETS = 256  # fewer bucket visits than this: one process (forking costs more)
LEAF_THREADS = 4  # walker threads per process with the compiled leaf walk (see parallelism)
LEAF_HASH_THREADS = 16  # the same when hashing: reads in flight for a cold disk (see parallelism)


def plan_tasks(units: list[Unit], k: int, n: int) -> list[tuple[int, list[str]]]:
    """(unit index, a run of its buckets in sorted order) in the order rows are written."""
    tasks = []
    for u in units:
        names = [b for b in u.bucket_names() if shard_part(b, n) == k]
        for i in range(0, len(names), TASK_BUCKETS):
            tasks.append((u.index, names[i:i + TASK_BUCKETS]))
    return tasks


def parallelism(workers: int | None, threads: int | None, verify: str, buckets: int) -> tuple[int, int]:
    """(processes, threads per process). CPU parallelism comes from processes (the rows are
    Python work); threads overlap waits for the disk. The compiled leaf walk waits without
    the GIL: on a cold 1M-file tree (a real cache is not in page cache) four threads per
    process scanned 1.7x (--verify size) and 1.5x (hash) faster than one and two, and within
    5% on a warm one. Hashing waits on a data read per file, and a disk serves more reads
    the more are queued (here: 12k 4 KiB reads/s at 8 in flight, 19k at 32, 27k at 128):
    sixteen threads per process hashed a cold 1M-file tree of 4 KiB files in 40 s against
    104 s with four, and as fast warm (more threads gained nothing on --verify size,
    which is bound by the folder and inode reads). The Python walk holds the GIL between
    system calls: there threads cost more in hand-overs on a warm tree than they win
    (hashing large files releases it: two). `threads` (--io-depth, alias --threads) is
    the number of walkers in all."""
    cpus = _cpus()
    if workers is None:
        workers = cpus if cpus > 1 and buckets >= PARALLEL_MIN_BUCKETS else 1
        if threads is not None:  # --threads N: N walkers in all (--threads 1: one process, one thread)
            workers = min(workers, threads)
    if threads is None:
        if leaf_walk() is not None:
            per_process = LEAF_HASH_THREADS if verify == "hash" else LEAF_THREADS
        else:
            per_process = 2 if verify == "hash" else 1
    else:
        per_process = max(1, threads // workers)
    return workers, per_process


def _cpus() -> int:
    """CPUs this process may run on (a taskset or cpuset narrows them; os.cpu_count does not)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def walk_task(walker: Walker, unit_index: int, buckets: list[str], threads: int = 1,
              pool: ThreadPoolExecutor | None = None) -> Rows:
    """Walk a run of buckets of one unit; with a thread pool, buckets run side by side
    and their rows are joined in bucket order."""
    unit = walker.units[unit_index]
    out = Rows()
    if pool is None or threads <= 1 or len(buckets) == 1:
        for b in buckets:
            walker.bucket(unit, b, out)
        return out

    def one(b: str) -> Rows:
        rows = Rows()
        walker.bucket(unit, b, rows)
        return rows

    for rows in pool.map(one, buckets):
        out.extend(rows)
    return out


class Walk:
    """Context manager yielding (table, sizes, errors) per task, in task order, with a
    bounded number of tasks in flight (memory: a few tasks, never the tree).

    workers > 1: a fork()ed process pool (started before the manifest writer exists);
    each result travels as an Arrow IPC stream. workers == 1: this process, tasks side
    by side in `threads` threads.
    """

    def __init__(self, walker: Walker, tasks: list[tuple[int, list[str]]], workers: int, threads: int):
        self.walker, self.tasks, self.workers, self.threads = walker, tasks, workers, threads
        self.pool: Any = None
        self.inflight: deque = deque()
        self.todo = iter(tasks)

    def __enter__(self) -> Iterator[tuple[pa.Table, dict, list[str]]]:
        if self.workers > 1 and self.tasks:
            _WORKER.walker, _WORKER.threads, _WORKER.parent = self.walker, self.threads, os.getpid()
            _WORKER.workers = self.workers
            import multiprocessing

            self.pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("fork"),
                                            initializer=_worker_init)
            self._fill(2 * self.workers)  # the first submit forks every worker
            return self._results(self._from_worker)
        if self.threads > 1 and len(self.tasks) > 1:
            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvmigrate-scan")
            self._fill(2 * self.threads)
            return self._results(self._local)
        return self._inline()

    def _submit(self, unit_index: int, buckets: list[str]):
        if isinstance(self.pool, ProcessPoolExecutor):
            return self.pool.submit(_worker_task, unit_index, buckets)
        return self.pool.submit(walk_task, self.walker, unit_index, buckets)

    def _fill(self, window: int) -> None:
        while len(self.inflight) < window:
            task = next(self.todo, None)
            if task is None:
                return
            self.inflight.append(self._submit(*task))

    def _results(self, convert) -> Iterator[tuple[pa.Table, dict, list[str]]]:
        window = len(self.inflight)
        while self.inflight:
            result = self.inflight.popleft().result()
            self._fill(window)
            yield convert(result)

    def _local(self, rows: Rows) -> tuple[pa.Table, dict, list[str]]:
        return rows.table(self.walker.ns_arrays), rows.sizes, rows.errors

    @staticmethod
    def _from_worker(result: tuple[bytes, dict, list[str]]) -> tuple[pa.Table, dict, list[str]]:
        data, task_sizes, task_errors = result
        return pa.ipc.open_stream(data).read_all(), task_sizes, task_errors

    def _inline(self) -> Iterator[tuple[pa.Table, dict, list[str]]]:
        for unit_index, buckets in self.todo:
            yield self._local(walk_task(self.walker, unit_index, buckets))

    def __exit__(self, *exc: Any) -> None:
        if self.pool is not None:
            for f in self.inflight:
                f.cancel()
            self.pool.shutdown(wait=True, cancel_futures=True)
        _WORKER.walker = None


@dataclass
class _WorkerState:
    """What a forked walk worker inherits from its parent (set just before the fork: a
    fork()ed process pool passes no arguments to its initializer's process state)."""

    walker: Walker | None = None
    threads: int = 1  # walker threads per worker process
    workers: int = 1  # walk worker processes side by side (they share --bwlimit)
    parent: int = 0  # the parent's pid (a worker whose parent died exits)
    pool: ThreadPoolExecutor | None = None  # the worker's thread pool, made by its first task


_WORKER = _WorkerState()


def _worker_init() -> None:
    """A walk worker leaves Ctrl-C to the parent (which stops the pool and exits 32), dies
    of SIGTERM, and dies with the parent: a worker that outlived it would block for ever
    writing a result nobody reads."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    leaf = leaf_walk()
    try:
        if leaf is not None:
            leaf.die_with_parent(signal.SIGKILL)
        else:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the pool notices a dead parent less promptly
        pass
    if os.getppid() != _WORKER.parent:  # the parent died before prctl
        os._exit(1)
    pacing.share(_WORKER.workers)  # the workers' reads together stay under --bwlimit


_PR_SET_PDEATHSIG = 1


def _worker_task(unit_index: int, buckets: list[str]) -> tuple[bytes, dict, list[str]]:
    """Run in a worker process: walk the buckets, return the rows as an Arrow IPC stream."""
    walker = _WORKER.walker
    assert walker is not None
    if _WORKER.threads > 1 and _WORKER.pool is None:
        _WORKER.pool = ThreadPoolExecutor(_WORKER.threads, thread_name_prefix="kvmigrate-scan")
    rows = walk_task(walker, unit_index, buckets, _WORKER.threads, _WORKER.pool)
    table = rows.table(walker.ns_arrays)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes(), dict(rows.sizes), rows.errors
