"""The scan: phases 1-3 (roots, units), the walk of every task (parallel), the
manifest written batch by batch, then phase 5 (sizes)."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from kvmigrate import __version__, manifest, pacing
from kvmigrate.classify import FileRecord, UnitPlan
from kvmigrate.errors import OperationalError, UsageError
from kvmigrate.fsio import check_root
from kvmigrate.identity.facts import FactsResolver
from kvmigrate.options import VERIFY_LEVELS, ScanOptions
from kvmigrate.progress import ScanBar
from kvmigrate.scan import flat, store_rows, tier_rows
from kvmigrate.scan.baseline import DEFAULT_RECHECK, LONE_RECHECK, Baseline
from kvmigrate.scan.baseline import load as load_baseline
from kvmigrate.scan.parallel import Walk, parallelism, plan_tasks
from kvmigrate.scan.roots import list_root, resolve_namespaces, select_folders, select_namespaces
from kvmigrate.scan.rows import Rows
from kvmigrate.scan.sizes import finalize
from kvmigrate.scan.toplevel import non_bucket_rows
from kvmigrate.scan.units import Unit, build_units
from kvmigrate.scan.walker import Walker
from kvmigrate.units import human_bytes

log = logging.getLogger(__name__)

BATCH_ROWS = 32_768  # rows per Parquet row group (at least; larger ones cost the summary memory)


@dataclass
class WalkResult:
    """What `scan()` returns: the manifest written and what the walk saw. The summary
    and exit code are the report's (kvmigrate.pipeline.scan adds them). `totals`: the
    `batch_sink` fed every batch written, None without one or when the manifest was
    rewritten after the walk (its batches then differ from the file)."""

    root: str
    output: str
    files: int
    bytes: int
    seconds: float
    walk_errors: list[str] = field(default_factory=list)
    totals: Any = None


def scan(root: str | os.PathLike[str], output: str | os.PathLike[str] = "kvmigrate-manifest.parquet",
         options: ScanOptions | None = None, *,
         transform_output: Callable[[str, UnitPlan, FileRecord], tuple[int, Callable[[], bytes | None]]],
         batch_sink: Callable[[dict[str, Any]], Any] | None = None) -> WalkResult:
    """Scan ROOT and write the manifest at `output` (kvmigrate.pipeline.scan adds the
    summary and exit code: call that one).

    What this stage needs from others is passed in, so stages never import each other:
    `transform_output(root, plan, row)` is the size and a hash function of what a
    transform would write (for a file already at its target path: the migration's
    kvmigrate.migrate.outputs.expected_transform_output); `batch_sink(metadata)` makes an
    object whose `add(batch)` gets every batch written (the summary's accumulator).

    `shard=(k, n)` takes buckets with int(hhh, 16) % n == k (files outside buckets: k=0).
    `workers` processes walk the buckets (default: one per core when the tree is large
    enough to pay for the fork); `threads` is the I/O concurrency (threads in all).
    Every choice of workers and threads writes the same manifest.
    `selection` (--only/--exclude) narrows the scan to some namespaces, decided before
    they are read; the manifest's metadata then says it is partial (`selection`).

    `baseline` (a manifest, a dataset directory or "auto": the newest audit kept in
    `history`, default ROOT/.kvmigrate/audits) with --verify hash: files unchanged since
    it keep its hashes unopened; `recheck` (a fraction, default 1/30) of its buckets are
    re-read all the same (kvmigrate.scan.baseline). A `Baseline` already loaded is a
    part's share of it (scan.baseline.load_parts).

    These are the fields of `options` (kvmigrate.options.ScanOptions), with
    `target`, `facts_resolver`, `verify`, `threads`, `progress` and `command`.
    """
    options = options or ScanOptions()
    target, verify, shard, workers, recheck = (options.target, options.verify, options.shard, options.workers,
                                               options.recheck)
    selection, baseline, history = options.selection, options.baseline, options.history
    if verify not in VERIFY_LEVELS:
        raise UsageError(f"--verify must be none, size or hash, got {verify!r}")
    k, n = shard
    if not (n >= 1 and 0 <= k < n):
        raise UsageError(f"--shard needs 0 <= K < N, got {k}/{n}")
    if workers is not None and workers < 1:
        raise UsageError(f"--workers must be at least 1, got {workers}")
    t0 = time.monotonic()
    root_path = check_root(str(root))
    resolver = options.facts_resolver or FactsResolver({}, None)
    prev = None
    if isinstance(baseline, Baseline):  # a part of a --run-on ray scan: its rows, loaded and checked by the driver
        prev = baseline
    elif isinstance(baseline, str):
        prev = load_baseline(baseline, root=root_path, target=target, verify=verify, history=history,
                             recheck=DEFAULT_RECHECK if recheck is None else recheck)
    elif recheck is not None:
        raise UsageError(LONE_RECHECK)
    output = os.path.abspath(output)
    if os.path.isdir(output):
        raise UsageError("the manifest path is a directory", path=output,
                         hint="pass -o FILE.parquet (a dataset directory is written by --run-on ray)")

    log.info("scan %s: listing the root (verify %s, shard %d/%d)", root_path, verify, k, n,
             extra={"root": root_path, "verify": verify, "shard": f"{k}/{n}"})
    if prev is not None:
        log.info("scan: baseline %s: unchanged files keep its hashes", prev.path)
    try:
        listing = list_root(root_path, resolver.fsdir_of)
    except OSError as exc:
        raise OperationalError(f"cannot list the cache root: {exc.strerror}", path=root_path) from None
    skipped: list[str] = []
    if selection:
        listing, skipped = select_folders(listing, selection)
    namespaces = resolve_namespaces(root_path, listing, resolver, target)
    if k == 0:  # flat families' deployments: part 0 writes their rows (outside buckets), so only it reads them
        namespaces += flat.resolve(root_path, listing, resolver, target, verify, prev)
        namespaces += tier_rows.resolve(root_path, listing, resolver, target, verify)
        namespaces += store_rows.resolve(root_path, listing, resolver, target, verify)
        if not selection:  # (a selection leaves namespaces unread that a key may be for)
            resolver.check_keys_matched([n for ns in namespaces for n in (ns.model_name, ns.source_base) if n])
    if selection:
        namespaces, skipped_late = select_namespaces(namespaces, selection)
        skipped = sorted(skipped + skipped_late)
    log.info("scan: found %d namespaces%s", len(namespaces), f" ({len(skipped)} left out by the selection)"
             if skipped else "", extra={"namespaces": len(namespaces), "skipped": len(skipped)})
    for ns in namespaces:
        log.debug("scan: namespace %s: %s, %s", ns.source_base, ns.family, ns.status,
                  extra={"namespace": ns.source_base, "family": ns.family, "status": ns.status})
    units = build_units(root_path, namespaces, verify == "hash", target)
    walker = Walker(root_path, verify=verify, listing=listing, transform_output=transform_output, baseline=prev)
    walker.prepare(namespaces, units)

    meta = {
        "tool_version": __version__,
        "command": options.command or "kvmigrate scan " + shlex.quote(str(root)),
        "root": root_path,
        "target_profile": target,
        "verify": verify,
        "shard": f"{k}/{n}",
        "facts": {"flags": _jsonable(resolver.flags), "facts_file": resolver.facts_file},
        "namespaces": {ns.source_base: ns.metadata() for ns in namespaces},
        "walk_errors": [],  # a walk with errors rewrites the metadata (see _finalize)
        "walk_failed": False,
        # the baseline used (None: every file was read); rows it carried over have `carried`
        "baseline": prev.metadata() if prev is not None else None,
    }
    if selection:
        meta["selection"] = dict(selection.metadata(), partial=True, skipped_namespaces=skipped)
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    _lean_arrow_allocator()
    head = non_bucket_rows(walker, listing, namespaces, units, shard)  # also lists every unit's buckets
    tasks = plan_tasks(units, k, n)
    workers, threads = parallelism(workers, options.threads, verify, sum(len(b) for _, b in tasks))
    log.info("scan: walking %d bucket visits in %d tasks (%d processes, %d threads)%s",
             sum(len(b) for _, b in tasks), len(tasks), workers, threads,
             ", hashing every file" if verify == "hash" else ", stat only" if verify == "size" else "",
             extra={"tasks": len(tasks), "workers": workers, "threads": threads})
    with _terminate_as_interrupt():
        return _write(walker, units, head, tasks, workers, threads, meta, output, options.progress, root_path, t0,
                      batch_sink)


def _write(walker: Walker, units: list[Unit], head: list[Rows | Any], tasks: list[tuple[int, list[str]]],
           workers: int, threads: int, meta: dict[str, Any], output: str, progress: bool, root_path: str,
           t0: float, batch_sink: Callable[[dict[str, Any]], Any] | None) -> WalkResult:
    """Walk the tasks and write the manifest."""
    sizes: dict[tuple[str, int, int], Counter] = defaultdict(Counter)
    errors: list[str] = []
    files = nbytes = 0
    rewritten = False
    with Walk(walker, tasks, workers, threads) as batches:  # forks the workers first
        totals = batch_sink(meta) if batch_sink else None  # e.g. the summary, aggregated as batches are written
        visits = sum(len(b) for _, b in tasks)
        bar = ScanBar(progress, visits)
        writer = manifest.ManifestWriter(output, meta)
        try:
            pending: list[pa.Table] = []
            pending_rows = 0

            def take(table: pa.Table, task_sizes: dict, task_errors: list[str], buckets: int = 0) -> None:
                nonlocal files, nbytes, pending_rows
                for key, cnt in task_sizes.items():
                    sizes[key].update(cnt)
                errors.extend(task_errors)
                rows = table.num_rows
                size = pc.sum(table["size"]).as_py() or 0 if rows else 0
                files += rows
                nbytes += size
                bar.update(buckets, rows, size)
                if rows:
                    pending.append(table)
                    pending_rows += rows
                if pending_rows >= BATCH_ROWS:
                    flush()
                    # the batch's buffers go back to the system: else each batch's peak sits
                    # on the last one's freed (fragmented) pages, and grows with the tree
                    pa.default_memory_pool().release_unused()

            def flush() -> None:
                nonlocal pending, pending_rows
                if pending_rows:
                    table = pa.concat_tables(pending).unify_dictionaries()
                    writer.write(table)
                    if totals is not None:
                        for batch in table.combine_chunks().to_batches():
                            totals.add(batch)
                pending, pending_rows = [], 0

            for part in head:  # Rows, or batches of a folder's rows (Rows, or tables: scan/flat.py)
                for piece in [part] if isinstance(part, Rows) else part:
                    if isinstance(piece, Rows):
                        take(piece.table(walker.ns_arrays), piece.sizes, piece.errors)
                    else:
                        take(piece, {}, [])
            done = 0
            for (table, task_sizes, task_errors), (_, buckets) in zip(batches, tasks):
                take(table, task_sizes, task_errors, len(buckets))
                done += len(buckets)
                log.debug("scan: task of %d buckets done: %d rows (%d of %d visits)", len(buckets), table.num_rows,
                          done, visits)
                if done < visits and pacing.expired():
                    raise _out_of_time(meta["command"], done, visits)
            flush()
            bar.close()
            rewritten = finalize(writer, meta, walker, units, sizes, errors)
            if rewritten:
                log.info("scan: manifest rewritten once (odd sizes re-classified, or walk errors recorded)")
        except BaseException:
            writer.abort()
            bar.close()
            raise
    pa.default_memory_pool().release_unused()
    log.info("scan: manifest written: %s (%d files, %s, %d walk errors, %.1fs)", output, files, human_bytes(nbytes),
             len(errors), time.monotonic() - t0,
             extra={"manifest": output, "files": files, "bytes": nbytes, "walk_errors": len(errors)})
    return WalkResult(root_path, output, files, nbytes, time.monotonic() - t0, errors,
                      None if rewritten else totals)


def _out_of_time(command: str, done: int, visits: int) -> pacing.OutOfTime:
    """--max-duration ended a scan: no manifest (a partial one would read as a clean tree
    missing files). A scan starts over, so the hint splits it into parts that fit the
    window: --shard K/N, with N from the share this one walked."""
    parts = max(2, -(-visits // max(done, 1)) + 1)
    base = re.sub(r"\s--max-duration(?:=|\s+)\S+", "", command)
    verb = base.split()[1] if len(base.split()) > 1 else "scan"
    if verb in ("scan", "audit"):
        out = "-o DIR/" if verb == "scan" else "--manifest-out DIR/"
        parted = re.sub(r"\s(?:-o|--output|--manifest-out)(?:=|\s+)\S+", "", base)
        hint = (f"a scan starts over: rerun `{base}` in a longer window, or in {parts} parts that each fit this "
                f"one: `{parted} --shard K/{parts} {out}` for K = 0 .. {parts - 1} (one manifest dataset in DIR)")
    else:
        hint = (f"a scan starts over: scan first (`kvmigrate scan ROOT --verify hash -o M.parquet`, in parts with "
                f"--shard K/{parts} -o DIR/ if it does not fit), then `kvmigrate migrate --manifest M.parquet "
                "--apply --max-duration ...` places blocks window after window")
    return pacing.OutOfTime(f"--max-duration elapsed after {done:,} of {visits:,} bucket visits "
                            f"({100 * done // visits}%); no manifest was written", hint=hint)


class _terminate_as_interrupt:
    """SIGTERM (a pod stopped, `timeout`) ends a scan like Ctrl-C: workers stopped, no
    temporary manifest left, exit 32 from the command line. Main thread only (where
    Python runs signal handlers); the previous handler comes back afterwards."""

    def __enter__(self) -> None:
        self.installed = threading.current_thread() is threading.main_thread()
        if self.installed:
            self.previous = signal.signal(signal.SIGTERM, _interrupt)

    def __exit__(self, *exc: Any) -> None:
        if self.installed:
            signal.signal(signal.SIGTERM, self.previous if self.previous is not None else signal.SIG_DFL)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def _lean_arrow_allocator() -> None:
    """Arrow's default allocator here, mimalloc, keeps freed pages: on a 1M-file tree the
    scan peaked at 273 MiB with it (the summary re-reads the manifest at the end); jemalloc
    told to give freed pages back at once, ~175 MiB, but it faulted fresh pages in for
    every batch's buffers again. The C library's malloc reuses what a batch freed for the
    next one: ~138 MiB, and the 1M-file hash scan ~4% faster.

    The scan and audit commands choose it before pyarrow loads (cli.common.
    prefer_arrow_pool), which is what Arrow's C++ internals follow; here, for a caller
    that loaded pyarrow first, pyarrow's own default is switched (that alone peaked at
    ~170 MiB: IPC, compute and Parquet buffers stayed on mimalloc). An explicit
    ARROW_DEFAULT_MEMORY_POOL is kept."""
    if os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        return
    pa.set_memory_pool(pa.system_memory_pool())

