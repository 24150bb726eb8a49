"""`--run-on ray --shards N [--ray-address ADDR]`: the `--shard K/N` parts as Ray tasks.

Ray is imported here only, and only when a command asks for it. Without an address a
local cluster is started for the command (and shut down after it); with one, the tasks
run wherever that cluster puts them, so ROOT, the dataset directory and the journal
directory must be the same paths on every node (a shared filesystem).

scan / audit: part K runs `scan(..., shard=(K, N))` into a staging folder inside the
dataset directory; only when every part succeeded are the parts published (renamed)
into the directory, replacing parts of an earlier scan, so the directory always holds
one complete scan. The driver then summarizes the directory.

migrate --apply: the driver runs an `Applier` whose per-target step creates the target
base and rank folders and config.json (journaled in `driver.journal`) and, while it holds
every target namespace lock, runs the parts. Part K plans only its bucket partition of
the manifest (`dataset.part_rows`) and applies it without taking locks, journaling into
`part-KKKKK-of-NNNNN.journal` of the journal directory: parts never touch the same path,
and a rerun of the same command resumes each part from its journal.

A part that fails (an exception in its task, a crashed worker, or an operational stop)
is reported with its number; the command then exits 8.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from kvmigrate.allocator import return_freed_memory
from kvmigrate.errors import EXIT_OPERATIONAL, KvMigrateError, OperationalError, UsageError
from kvmigrate.fsio import check_root
from kvmigrate.migrate.apply import Applier
from kvmigrate.migrate.journal import is_journal_name
from kvmigrate.migrate.result import ApplyResult
from kvmigrate.options import ScanOptions
from kvmigrate.scaleout import dataset

if TYPE_CHECKING:  # the JSON models are types only (kvmigrate.outputs)
    from kvmigrate.outputs import ReportOutput

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'kvmigrate[ray]'"
# Tasks exchange small dicts only: a small object store keeps a local cluster light
# (Ray's minimum is 75 MiB; its default is 30% of RAM, in /dev/shm).
LOCAL_OBJECT_STORE_BYTES = 96 * 1024 * 1024
# Test seam: "scan:K" makes part K of a scan raise before it writes; "migrate:K:B" makes
# part K of a migration raise after B blocks (its journal stays resumable).
FAIL_ENV = "KVMIGRATE_RAY_FAIL"


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UsageError("--run-on ray needs the Ray package, which is not installed",
                         hint=f"{INSTALL_HINT}, or run without --run-on ray") from None
    return ray


@contextlib.contextmanager
def session(address: str | None = None) -> Iterator[Any]:
    """A Ray connection for one command: the caller's if Ray is already initialized,
    else the cluster at `address` (or $RAY_ADDRESS), else a new local cluster (stopped
    afterwards)."""
    ray = import_ray()
    if address:
        _check_reachable(address)
    if ray.is_initialized():
        yield ray
        return
    address = address or os.environ.get("RAY_ADDRESS")  # Ray's own convention for "use that cluster"
    quiet = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    try:
        if address:
            ray.init(address=address, **quiet)
        else:
            ray.init(num_cpus=os.cpu_count() or 1, object_store_memory=LOCAL_OBJECT_STORE_BYTES, **quiet)
    except Exception as exc:  # Ray raises ConnectionError, RuntimeError, ValueError...
        where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
        raise OperationalError(f"cannot start or reach {where}: {_last_line(exc)}",
                               hint="check --ray-address (e.g. ray://head:10001 or head:6379) and that the cluster "
                                    "runs the same Ray and Python versions" if address else
                               "see `ray start --head` for what blocks a local cluster (ports, /tmp/ray, /dev/shm)"
                               ) from None
    try:
        yield ray
    finally:
        ray.shutdown()


def _check_reachable(address: str, timeout: float = 10.0) -> None:
    """Fail fast on an address nobody listens at: ray.init() retries such a cluster
    for ever."""
    import socket

    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise OperationalError(f"cannot reach the Ray cluster at {address}: {exc.strerror or exc}",
                               hint="check --ray-address: the head's GCS (host:6379) or Ray Client (ray://host:10001) "
                                    "address, reachable from this machine") from None


def _last_line(exc: BaseException) -> str:
    """The message of an exception whose text may start with a traceback."""
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__


def _task_error(exc: BaseException) -> str:
    """Why a task failed, without Ray's traceback: a kvmigrate error's message (and
    hint), else the exception type and its last line."""
    cause = getattr(exc, "cause", None)  # RayTaskError wraps what the task raised
    err = cause if isinstance(cause, BaseException) else exc
    if isinstance(err, KvMigrateError):
        return " ".join(line.strip() for line in str(err).splitlines())
    return f"{type(err).__name__}: {_last_line(err)}"


def _injected(kind: str) -> dict[int, int]:
    """Parts the FAIL_ENV test seam makes fail: part -> blocks before failing (scan: 0)."""
    out = {}
    for item in filter(None, os.environ.get(FAIL_ENV, "").split(",")):
        fields = item.split(":")
        if fields[0] == kind and len(fields) >= 2 and fields[1].isdigit():
            out[int(fields[1])] = int(fields[2]) if len(fields) > 2 and fields[2].isdigit() else 0
    return out


@dataclass
class PartReport:
    """What one part's task returned (or why it has nothing to return)."""

    part: int
    shards: int
    detail: dict[str, Any] | None = None  # the task's result
    error: str | None = None  # the task raised, or its worker died

    @property
    def name(self) -> str:
        return f"part {self.part} of {self.shards} (--shard {self.part}/{self.shards})"


class PartsFailed(OperationalError):
    """Some parts did not finish; the message lists each with its shard number."""

    def __init__(self, what: str, failed: list[tuple[PartReport, str]], hint: str):
        lines = [f"{len(failed)} of {failed[0][0].shards} {what} parts failed:"]
        lines += [f"  {report.name}: {why}" for report, why in failed]
        super().__init__("\n".join(lines), hint=hint)
        self.parts = [report.part for report, _ in failed]


def run_parts(ray: Any, fn: Callable[..., dict], args_of: Callable[[int], tuple], n: int,
              on_part: Callable[[PartReport], None] | None = None) -> list[PartReport]:
    """Run fn(*args_of(k)) for k in 0..n-1 as Ray tasks (one CPU each); collect every
    part's result or error. Ctrl-C cancels the parts still running."""
    task = ray.remote(num_cpus=1)(fn)
    refs = {task.remote(*args_of(k)): k for k in range(n)}
    reports: dict[int, PartReport] = {}
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                k = refs[ref]
                try:
                    reports[k] = PartReport(k, n, detail=ray.get(ref))
                except Exception as exc:  # RayTaskError (the task raised), WorkerCrashedError, ...
                    reports[k] = PartReport(k, n, error=_task_error(exc))
                if on_part is not None:
                    on_part(reports[k])
    except BaseException:
        for ref in pending:
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
        raise
    return [reports[k] for k in range(n)]


# --- scan and audit ----------------------------------------------------------------------


def _scan_part(scan: Callable[..., Any], root: str, staging: str, k: int, n: int, options: ScanOptions,
               fail: bool) -> dict[str, Any]:
    """Ray task: scan part K of N into the staging folder with `scan` (the pipeline's scan,
    passed in: scale-out runs the pipeline's stages and never imports the pipeline).
    `options.baseline`: this part's rows of the --baseline (scan.baseline.load_parts), or None."""
    if fail:
        raise RuntimeError(f"injected failure of scan part {k} ({FAIL_ENV})")
    # a part holds one Ray CPU: no walk processes of its own
    res = scan(root, os.path.join(staging, dataset.part_name(k, n)), options.but(shard=(k, n), progress=False,
                                                                                 workers=1))
    return {"exit_code": res.exit_code, "rows": res.rows, "files": res.files, "bytes": res.bytes,
            "seconds": res.seconds, "walk_errors": len(res.walk_errors)}


@dataclass
class DatasetScan:
    """A scan run as parts: the dataset directory, its merged summary, per-part facts."""

    root: str
    output: str
    summary: ReportOutput
    exit_code: int
    parts: list[PartReport]
    seconds: float


def _check_dataset_dir(output: str) -> str:
    """The dataset directory a scan may publish into: new, or holding kvmigrate parts."""
    out = os.path.abspath(output)
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError("with --run-on ray the manifest is a dataset directory, and this is a file", path=out,
                         hint="pass -o DIR (a new or empty directory, or one holding a previous scan's parts)")
    others = dataset.other_parquet_files(out)
    if others:
        raise UsageError(f"the dataset directory holds other Parquet files ({', '.join(others[:3])}): a dataset "
                         "directory holds the parts of one scan only", path=out,
                         hint="choose a new directory, or move those files away")
    return out


def scan_on_ray(scan: Callable[..., Any], root: str, output: str, options: ScanOptions, *, shards: int,
                address: str | None = None, on_part: Callable[[PartReport], None] | None = None,
                manifest: str | None | bool = True, verb: str = "scan") -> DatasetScan:
    """Scan ROOT as `shards` Ray tasks (each runs `scan`, the pipeline's) into the dataset directory `output`, then
    summarize it (`manifest`, `verb`: what its hints name, see report.summary.summarize).
    `options`: every part's (its `shard`, `progress` and `workers` are the part's own);
    `options.selection` (--only/--exclude): every part scans those namespaces only.
    `options.baseline`, `recheck`, `history` (--baseline PREV|auto): the driver checks
    and reads the baseline once and sends each part the rows of its own buckets only.

    Parts are staged inside `output` and published only when all succeeded; otherwise
    PartsFailed (exit 8) names them and `output` is left as it was."""
    from kvmigrate.identity.facts import FactsResolver
    from kvmigrate.report.summary import summarize

    if shards < 1:
        raise UsageError(f"--shards must be at least 1, got {shards}")
    t0 = time.monotonic()
    baseline, recheck, history = options.baseline, options.recheck, options.history
    if baseline is not None and not isinstance(baseline, str):
        raise UsageError("a --run-on ray scan reads its --baseline itself: pass a path or auto")
    root_path = check_root(root)  # the scanner's own check, before any part starts
    out = _check_dataset_dir(output)
    options = options.but(facts_resolver=options.facts_resolver or FactsResolver({}, None), baseline=None,
                          recheck=None, history=None)
    baselines = _baseline_parts(baseline, recheck, history, shards, root=root_path, target=options.target,
                                verify=options.verify)
    fail = _injected("scan")
    with session(address) as ray:
        try:
            os.makedirs(out, exist_ok=True)
            staging = tempfile.mkdtemp(prefix=".kvmigrate-parts-", dir=out)
        except OSError as exc:
            raise OperationalError(f"cannot create the dataset directory: {exc.strerror}", path=out) from None
        try:
            reports = run_parts(ray, _scan_part,
                                lambda k: (scan, root_path, staging, k, shards,
                                           options.but(baseline=baselines[k]) if baselines else options, k in fail),
                                shards, on_part)
            failed = [(r, r.error) for r in reports if r.error is not None]
            if failed:
                raise PartsFailed("scan", failed, hint=f"fix the cause and rerun the same command (it scans every "
                                                       f"part again); {out} was left as it was")
            for name in dataset.stale_parts(out, shards):
                os.unlink(os.path.join(out, name))
            for k in range(shards):
                name = dataset.part_name(k, shards)
                os.replace(os.path.join(staging, name), os.path.join(out, name))
            log.info("scan: %d parts published into %s", shards, out, extra={"parts": shards, "dataset": out})
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return_freed_memory()  # the parts are done: the summary's batches follow
    summary = summarize(out, manifest=manifest, verb=verb)
    code = summary["exit_code"]
    for r in reports:
        if r.detail is not None:  # (every part's: a part without one failed above)
            code |= r.detail["exit_code"]
    return DatasetScan(root_path, out, summary, code, reports, time.monotonic() - t0)


def _baseline_parts(baseline: str | None, recheck: Fraction | None, history: str | None, shards: int,
                    **run: str) -> list | None:
    """Each part's rows of the --baseline, checked and read by the driver before any part
    starts (a refused baseline is a usage error, exit 2); None: no baseline, or `auto`
    with no kept audit yet (every part reads everything)."""
    from kvmigrate.scan.baseline import DEFAULT_RECHECK, LONE_RECHECK, load_parts

    if baseline is None:
        if recheck is not None:
            raise UsageError(LONE_RECHECK)
        return None
    return load_parts(baseline, shards, history=history, recheck=DEFAULT_RECHECK if recheck is None else recheck,
                      **run)


# --- migrate --apply ---------------------------------------------------------------------


def default_journal_dir(root: str, identity: dict[str, Any]) -> str:
    """ROOT/.kvmigrate/journals/parts-<digest of the run identity>: the same command
    finds the same directory again, and resumes from it."""
    from kvmigrate.migrate import journal as jn

    key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return os.path.join(jn.default_journal_dir(root), f"parts-{key}")


def _apply_part(manifest_path: str, dest: str, k: int, n: int, mode: str, journal: str, command: str,
                identity: dict[str, Any], fail_after: int | None,
                target_sizes: dict | None = None, selection: Any = None) -> dict[str, Any]:
    """Ray task: plan part K of N of the manifest and apply it (no namespace locks: the
    driver holds them for the whole run). Competing sources are judged by the whole
    plan's target sizes (`target_sizes`), as in one process."""
    from kvmigrate import manifest
    from kvmigrate.migrate.plan import build_plan

    plan = build_plan(manifest_path, dest=dest, table=dataset.part_rows(manifest_path, k, n),
                      metadata=manifest.read_metadata(manifest_path), target_sizes=target_sizes, selection=selection)
    progress = None
    if fail_after is not None:
        left = [fail_after]

        def progress(_: int) -> None:
            left[0] -= 1
            if left[0] <= 0:
                raise RuntimeError(f"injected failure of migrate part {k} ({FAIL_ENV})")

    # the driver holds every namespace lock and made the target folders and config.json
    # (found present and equal here)
    result = Applier(plan, mode=mode, journal=journal, command=command, identity=identity, progress=progress,
                     take_locks=False).run()
    return {"result": result.to_dict(), "bits": result.bits, "exit_code": result.exit_code}


def apply_on_ray(plan: Any, manifest_path: str, *, shards: int, address: str | None = None, mode: str = "link",
                 journal: str | None = None, command: str = "", identity: dict[str, Any] | None = None,
                 on_part: Callable[[PartReport], None] | None = None) -> Any:
    """`migrate --apply --run-on ray`: returns one ApplyResult merged from the parts
    (outcomes summed, findings concatenated), with `stop` set when a part failed."""
    if shards < 1:
        raise UsageError(f"--shards must be at least 1, got {shards}")
    manifest_path = os.path.abspath(manifest_path)
    identity = dict(identity or {"root": plan.root, "dest": plan.dest, "target_profile": plan.target_profile,
                                 "manifest": manifest_path})
    jdir = os.path.abspath(journal) if journal else default_journal_dir(plan.root, identity)
    if is_journal_name(jdir) or os.path.isfile(jdir):
        raise UsageError("with --run-on ray, --journal names a directory (one journal per part)", path=jdir,
                         hint="pass --journal DIR")
    fail = _injected("migrate")

    reports: list[PartReport] = []
    with session(address) as ray:
        def launch() -> None:
            """Every part, once each target's base folder, config.json and rank folder exist,
            while the driver holds every namespace lock."""
            def args_of(k: int) -> tuple:
                return (manifest_path, plan.dest, k, shards, mode,
                        os.path.join(jdir, dataset.journal_name(k, shards)), command,
                        {**identity, "part": f"{k}/{shards}"}, fail.get(k), plan.target_sizes, plan.selection)
            reports.extend(run_parts(ray, _apply_part, args_of, shards, on_part))

        log.info("apply: %d parts as Ray tasks, journals in %s", shards, jdir, extra={"parts": shards, "journals": jdir})
        done = Applier(plan, mode=mode, journal=os.path.join(jdir, dataset.DRIVER_JOURNAL), command=command,
                       identity={**identity, "part": "driver"}, place_blocks=launch).run()
    merged = ApplyResult()
    problems: list[tuple[PartReport, str]] = []
    for report in reports:
        if report.detail is None:
            problems.append((report, report.error or "no result"))
            continue
        _add(merged, report.detail)
        if report.detail["result"].get("stopped"):
            problems.append((report, f"stopped: {report.detail['result']['stopped']}"))
    for err in done.namespace_errors:
        if err not in merged.namespace_errors:
            merged.namespace_errors.append(err)
    merged.bits |= done.bits
    merged.journal_path = jdir
    merged.resumed = merged.resumed or done.resumed
    if done.stop is not None:
        merged.stop = done.stop
    elif problems:
        merged.stop = PartsFailed("migration", problems,
                                  hint="rerun the same command: every part resumes from its journal in " + jdir)
    if merged.stop is not None:
        merged.bits |= EXIT_OPERATIONAL
    return merged


def _add(merged: Any, detail: dict[str, Any]) -> None:
    d = detail["result"]
    merged.outcomes.update(Counter(d.get("outcomes") or {}))
    for base, counts in (d.get("per_target") or {}).items():
        merged.per_target.setdefault(base, Counter()).update(Counter(counts))
    for key, value in d.items():  # linked, copied, bytes_written, recovered, ...
        if isinstance(value, int) and not isinstance(value, bool) and isinstance(getattr(merged, key, None), int):
            setattr(merged, key, getattr(merged, key) + value)
    merged.findings += d.get("findings") or []
    for err in d.get("namespace_errors") or []:
        if err not in merged.namespace_errors:
            merged.namespace_errors.append(err)
    merged.resumed = merged.resumed or bool(d.get("resumed"))
    merged.bits |= detail["bits"]
