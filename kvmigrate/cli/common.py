"""Shared option sets (decorator factories) and the library-error -> exit-code edge."""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import click

from kvmigrate.errors import EXIT_INTERRUPTED, KvMigrateError
from kvmigrate.identity.values import (
    CACHE_DTYPES,
    DEFAULT_PROFILE,
    EXECUTORS,
    FACT_FLAGS,
    FAMILIES,
    HASH_ALGORITHMS,
    KV_KINDS,
    MODEL_DTYPES,
    MOONCAKE_KV_LAYOUTS,
    MOONCAKE_TARGET_ENGINES,
    PROFILES,
    RUNNERS,
    SGLANG_LAYOUTS,
    TARGET_BACKENDS,
)
from kvmigrate.options import DEFAULT_SHARD, DEFAULT_VERIFY, VERIFY_LEVELS, ScanOptions

if TYPE_CHECKING:  # (fractions imports decimal: a few ms of every command's start-up)
    from fractions import Fraction


def _checked(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Refuse, while parsing, a fact value the engine would not accept (exit 2, naming the values)."""
    if value is None:
        return None
    from kvmigrate.errors import UsageError
    from kvmigrate.identity.facts import allowed_values, check_fact

    name = param.name or ""
    try:
        return check_fact(name, value, FACT_FLAGS.get(name, name))
    except UsageError:
        raise click.BadParameter(f"{value!r}: the engine accepts {allowed_values(name)}") from None


# flag name (snake_case, as in --facts FACTS.json) -> click option
_FACT_OPTIONS = [
    click.option("--model-config", "model_config", type=click.Path(dir_okay=False),
                 help="Hugging Face model config.json to read facts from (kv kind, kv heads, dtype, page bytes); "
                      "refused for a namespace of another model (per model: --facts)."),
    click.option("--kv-kind", type=click.Choice(KV_KINDS), help="Attention kind of the model that wrote the cache."),
    click.option("--total-kv-heads", type=click.IntRange(min=1), help="Total KV heads of the model (G2: tp must divide it)."),
    click.option("--model-dtype", metavar="DTYPE", callback=_checked,
                 help="Model dtype that resolves \"auto\" for targets >= vllm-0.27: "
                      + ", ".join(MODEL_DTYPES) + "."),
    click.option("--cache-dtype", metavar="DTYPE", callback=_checked,
                 help="Raw --kv-cache-dtype of the writer, for targets <= vllm-0.26 from a resolved source: "
                      + ", ".join(CACHE_DTYPES[:8]) + ", ... (vLLM's choices)."),
    click.option("--runner", type=click.Choice(RUNNERS), help="vLLM model runner of the writer (assumed v1)."),
    click.option("--executor", metavar="BACKEND", callback=_checked,
                 help="The inference engine's distributed executor: " + ", ".join(EXECUTORS)
                      + " or an Executor class package.module.Class (assumed mp)."),
    click.option("--nnodes", type=click.IntRange(min=1), help="Nodes per data-parallel replica (assumed 1)."),
    click.option("--per-token-head-quant/--no-per-token-head-quant", default=None,
                 help="Per-token-head KV quantization (assumed off)."),
    click.option("--page-bytes", type=click.IntRange(min=1), help="Bytes of one tensor's page for one GPU block on one rank."),
    click.option("--tensors-per-layer", type=click.IntRange(min=1), help="Full attention: 2 when K and V are separate tensors."),
    click.option("--family", type=click.Choice(FAMILIES), help="Force the writer family (S1 trees can be ambiguous)."),
    click.option("--writer-tp", type=click.IntRange(min=1),
                 help="vLLM folder collapsed by 0.24-0.33's parallel-agnostic gate: the one TP size that wrote "
                      "every row (vLLM 0.34 reads it only under that topology's name; with --writer-pp)."),
    click.option("--writer-pp", type=click.IntRange(min=1),
                 help="The one PP size that wrote every row of such a folder (with --writer-tp)."),
    click.option("--model-name", metavar="NAME",
                 help="SGLang: the served model name (e1-e3 names carry none; decides a name read two ways)."),
    click.option("--writer-layout", type=click.Choice(SGLANG_LAYOUTS),
                 help="SGLang: --hicache-mem-layout of the writer (e4 names record none)."),
    click.option("--target-layout", type=click.Choice(SGLANG_LAYOUTS),
                 help="SGLang: --hicache-mem-layout of the target (assumed page_first, 0.5.14+ default)."),
    click.option("--writer-release", metavar="VERSION", callback=_checked,
                 help="SGLang: release of the writer (its layout default: layer_first up to 0.5.13); LMCache: "
                      "the releases that wrote the tier, comma-separated; Mooncake: the clients' release (0.3.13.post1)."),
    click.option("--layers", type=click.IntRange(min=1),
                 help="SGLang relayout: host layers of the stage (with MTP/draft layers)."),
    click.option("--page-tokens", type=click.IntRange(min=1), help="SGLang relayout: tokens of one page."),
    click.option("--kv-heads", type=click.IntRange(min=1),
                 help="SGLang relayout: KV heads on one rank (or --total-kv-heads: divided by the TP size)."),
    click.option("--head-dim", type=click.IntRange(min=1), help="SGLang relayout: head dim (MHA/GQA)."),
    click.option("--latent-dim", type=click.IntRange(min=1),
                 help="SGLang relayout: MLA latent width (kv_lora_rank + qk_rope_head_dim)."),
    click.option("--dtype-bytes", type=click.IntRange(min=1),
                 help="SGLang relayout: bytes of one KV element (or --model-dtype)."),
    # LMCache tiers (lmcache.md §3.3): read for LMCache tiers only
    click.option("--hash-algorithm", type=click.Choice(HASH_ALGORITHMS),
                 help="LMCache: pre_caching_hash_algorithm of the writer (assumed builtin)."),
    click.option("--target-hash-algorithm", type=click.Choice(HASH_ALGORITHMS),
                 help="LMCache: pre_caching_hash_algorithm of the target (assumed the writer's)."),
    click.option("--pythonhashseed", metavar="SEED", callback=_checked,
                 help="LMCache: PYTHONHASHSEED of the writer, 0-4294967295 or unset."),
    click.option("--target-pythonhashseed", metavar="SEED", callback=_checked,
                 help="LMCache: PYTHONHASHSEED of the target (assumed the writer's)."),
    click.option("--vllm-release", metavar="VERSION", callback=_checked,
                 help="LMCache: vLLM release of the writer (decides NONE_HASH when the seed is unset)."),
    click.option("--target-vllm-release", metavar="VERSION", callback=_checked,
                 help="LMCache: vLLM release of the target (assumed the writer's)."),
    click.option("--python-version", metavar="X.Y", callback=_checked,
                 help="LMCache: Python of the writer (builtin hash; assumed the target's)."),
    click.option("--target-python-version", metavar="X.Y", callback=_checked,
                 help="LMCache: Python of the target (assumed the writer's)."),
    click.option("--chunk-size", type=click.IntRange(min=1),
                 help="LMCache: tokens per chunk of the writer (assumed the target's)."),
    click.option("--target-chunk-size", type=click.IntRange(min=1),
                 help="LMCache: tokens per chunk of the target (assumed the writer's)."),
    click.option("--save-chunk-meta/--no-save-chunk-meta", default=None,
                 help="LMCache fs tier: files carry the RemoteMetadata header (detected when not given)."),
    click.option("--target-save-chunk-meta/--no-target-save-chunk-meta", default=None,
                 help="LMCache: the target fs tier's RemoteMetadata header (assumed the tier's)."),
    click.option("--save-unfull-chunk/--no-save-unfull-chunk", default=None,
                 help="LMCache: the writer stored partial last chunks (assumed off)."),
    click.option("--target-model-name", metavar="NAME",
                 help="LMCache, Mooncake: the target's served model (assumed the writer's)."),
    click.option("--target-tp", type=click.IntRange(min=1),
                 help="LMCache, Mooncake: TP of the target deployment (assumed the writer's)."),
    click.option("--target-save-only-first-rank/--no-target-save-only-first-rank", default=None,
                 help="LMCache MLA: the target's save_only_first_rank (assumed as the names show)."),
    click.option("--target-backend", type=click.Choice(TARGET_BACKENDS),
                 help="LMCache: convert a local_disk tier to an fs tier."),
    click.option("--tmp-dir", metavar="NAME", callback=_checked,
                 help="LMCache: the tier's temp folder (fs_connector_relative_tmp_dir / MP relative_tmp_dir)."),
    # Mooncake stores (mooncake.md §3.2): read for Mooncake stores only
    click.option("--fsdir", metavar="NAME", callback=_checked,
                 help="Mooncake: MOONCAKE_OFFLOAD_FSDIR, the file-per-key folder of each client root "
                      "(assumed file_per_key_dir)."),
    click.option("--kv-layout", type=click.Choice(MOONCAKE_KV_LAYOUTS),
                 help="Mooncake: the writer's KV layout, vLLM nhd|hnd, SGLang layer_first|page_first|"
                      "page_first_direct|page_head (assumed nhd / page_first)."),
    click.option("--tp-lcm-size", type=click.IntRange(min=1),
                 help="Mooncake SGLang: tp_lcm_size, the virtual TP of the key ranks (assumed none)."),
    click.option("--target-tenant", metavar="TENANT", callback=_checked,
                 help="Mooncake: the target clients' tenant (assumed the writer's; a raw key's: default)."),
    click.option("--target-cache-prefix", metavar="PREFIX", callback=_checked,
                 help="Mooncake vLLM: the target's cache prefix, '' for none (assumed the writer's)."),
    click.option("--target-engine", type=click.Choice(MOONCAKE_TARGET_ENGINES),
                 help="Mooncake: the engine reading the store (assumed the writer's)."),
    click.option("--hash-recipe-changed/--no-hash-recipe-changed", default=None,
                 help="Mooncake: the target hashes tokens otherwise (vLLM hash algorithm or seed, SGLang salt): "
                      "no key is reused (assumed not)."),
    click.option("--facts", "facts_file", type=click.Path(dir_okay=False),
                 help="FACTS.json: per-namespace facts keyed by model_name, base folder name or \"*\" "
                      "(LMCache tiers: \"<tier>:<model>\", \"<tier>\", \"<model>\", \"*\"; Mooncake stores likewise, "
                      "keyed by the store's relpath)."),
]
FACT_NAMES = tuple(FACT_FLAGS)


def facts_options(fn: Callable) -> Callable:
    """Deployment-fact flags plus --target; the command receives them as kwargs."""
    for opt in reversed(_FACT_OPTIONS):
        fn = opt(fn)
    fn = click.option("--target", "target", type=click.Choice(PROFILES), default=DEFAULT_PROFILE, show_default=True,
                      help="Engine profile whose namespaces to compute: vllm-0.34 is vLLM 0.34+ (direct layouts "
                           "topology-specific again), vllm-0.28 is 0.28-0.33 (vllmcpp sources always target vllmcpp); "
                           "an lmcache-* profile sets what every LMCache tier targets (default lmcache-0.5.6), a "
                           "mooncake-* profile what every Mooncake store targets (default mooncake-0.3.14, "
                           f"scoped keys; 0.3.11 raw keys); either leaves the other families on {DEFAULT_PROFILE}.")(fn)
    return fn


def pop_fact_flags(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Remove the fact flags from a command's kwargs; return those that were given."""
    flags = {name: kwargs.pop(name, None) for name in FACT_NAMES}
    return {k: v for k, v in flags.items() if v is not None}


LOG_FORMATS = ("text", "json")
LOGGER = "kvmigrate"
# LogRecord attributes of its own: what a JSON log line does not repeat as an extra field
_RECORD_FIELDS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object a record: time (UTC, ISO 8601), level, logger, message, then the
    record's extra fields (`log.info(..., extra={"files": n})`)."""

    def format(self, record: logging.LogRecord) -> str:
        import datetime

        when = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        obj: dict[str, Any] = {"time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                               "level": record.levelname.lower(), "logger": record.name,
                               "message": record.getMessage()}
        obj.update((k, v) for k, v in vars(record).items() if k not in _RECORD_FIELDS and not k.startswith("_"))
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str)


class TextFormatter(logging.Formatter):
    """`kvmigrate: info: message`, like the command line's other stderr lines."""

    def format(self, record: logging.LogRecord) -> str:
        text = f"kvmigrate: {record.levelname.lower()}: {record.getMessage()}"
        return text + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")


class _StderrHandler(logging.Handler):
    """Writes to the stderr of the moment (click's test runner swaps it per command),
    above a progress bar while one is shown."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from kvmigrate.progress import write_line

            write_line(self.format(record))
        except Exception:
            self.handleError(record)


def setup_logging(verbose: int = 0, log_format: str = "text", quiet: bool = False) -> logging.Logger:
    """The command line's one log handler, on the `kvmigrate` logger, to stderr (stdout
    carries --json): WARNING and up by default, INFO with -v, DEBUG with -vv; with -q
    (and no -v) errors only. `log_format` json: one JSON object a line. Replaces the
    handler of an earlier command in this process."""
    logger = logging.getLogger(LOGGER)
    for old in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(old)
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose >= 2 else logging.INFO if verbose == 1 else
                    logging.ERROR if quiet else logging.WARNING)
    logger.propagate = False  # one line a record, whatever the root logger has (Ray, pytest)
    return logger


def log_options(fn: Callable) -> Callable:
    """-v/--verbose (INFO; -vv DEBUG) and --log-format text|json, and the handler they set
    up before the command runs (setup_logging). The command receives `verbose` and
    `log_format` only where its signature names them. Each run is logged as it starts
    (its arguments at DEBUG) and ends (its exit code)."""
    import inspect

    params = inspect.signature(fn).parameters
    keeps = {name for name in ("verbose", "log_format") if name in params}

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        verbose, log_format = kwargs.get("verbose", 0), kwargs.get("log_format", "text")
        for name in ("verbose", "log_format"):
            if name not in keeps:
                kwargs.pop(name, None)
        setup_logging(verbose, log_format, bool(kwargs.get("quiet")))
        log = logging.getLogger(f"{LOGGER}.cli")
        ctx = click.get_current_context(silent=True)
        name = (ctx.info_name if ctx is not None else None) or "?"
        log.info("%s: start", name, extra={"command": name})
        log.debug("%s: arguments %s", name, " ".join(sys.argv[1:]),
                  extra={"params": {k: v for k, v in (ctx.params if ctx else {}).items() if v not in (None, (), False)}})
        try:
            result = fn(*args, **kwargs)
        except SystemExit as exc:
            log.info("%s: exit code %s", name, exc.code or 0, extra={"command": name, "exit_code": exc.code or 0})
            raise
        log.info("%s: exit code 0", name, extra={"command": name, "exit_code": 0})
        return result

    command = click.option("--log-format", "log_format", type=click.Choice(LOG_FORMATS), default="text",
                      show_default=True,
                      help="Log lines on stderr (-v, -vv) as text, or json: one JSON object a line (time, level, "
                           "logger, message and fields). audit also writes its events (start, each namespace, "
                           "finding classes, end) as JSON objects.")(wrapper)
    return click.option("-v", "--verbose", count=True,
                        help="Say what each phase does on stderr (INFO); -vv more (DEBUG).")(command)


def output_options(fn: Callable) -> Callable:
    fn = log_options(fn)
    fn = click.option("-q", "--quiet", is_flag=True,
                      help="Print nothing but errors; the exit code says the rest (files asked for, "
                           "such as -o, are still written, and --json still prints).")(fn)
    fn = click.option("--json", "as_json", is_flag=True, help="One JSON summary object on stdout.")(fn)
    return fn


IO_DEPTH_HELP = ("Reads in flight: walker threads in all, over one process per core (default with the "
                 "compiled leaf walk, which waits for the disk without the GIL: 16 a process with --verify "
                 "hash, 4 otherwise; without it 1, 2 with --verify hash; 1 = a single thread). Raise it for "
                 "a cold network filesystem or a deep NVMe queue. --threads is the same option.")


def io_depth_option(fn: Callable) -> Callable:
    """--io-depth N (alias --threads): the walker threads in all, passed as `threads`."""
    return click.option("--io-depth", "--threads", "threads", type=click.IntRange(min=1), default=None,
                        metavar="N", help=IO_DEPTH_HELP)(fn)


class Rate(int):
    """Bytes per second (--bwlimit), written back as given (`64K`) in printed commands."""

    text: str

    def __new__(cls, value: int, text: str) -> Rate:
        obj = super().__new__(cls, value)
        obj.text = text
        return obj

    def __str__(self) -> str:
        return self.text


class Seconds(float):
    """A duration (--max-duration), written back as given (`2h`) in messages and commands."""

    text: str

    def __new__(cls, value: float, text: str) -> Seconds:
        obj = super().__new__(cls, value)
        obj.text = text
        return obj

    def __str__(self) -> str:
        return self.text


def _usage_message(exc: Exception, option: str) -> str:
    """A library UsageError's message without the option name it starts with (click's
    parse error names the option itself)."""
    text = str(exc)
    return text[len(option):].lstrip() if text.startswith(option) else text


class LibraryParsed(click.ParamType):
    """A value a library function parses (raising its UsageError, whose message starts
    with the option's name): a click parse error at once, exit 2, naming the option.
    `parse` turns the text into the value; a value `done` says is parsed passes through."""

    def __init__(self, name: str, option: str, parse: Callable[[str], Any], done: Callable[[Any], bool]):
        self.name, self.option, self.parse, self.done = name, option, parse, done

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if self.done(value):
            return value
        from kvmigrate.errors import UsageError

        try:
            return self.parse(str(value))
        except UsageError as exc:
            self.fail(_usage_message(exc, self.option), param, ctx)


def _rate(text: str) -> Rate:
    from kvmigrate import pacing

    return Rate(pacing.parse_rate(text), text)


def _max_duration(text: str) -> Seconds:
    from kvmigrate import pacing

    return Seconds(pacing.parse_duration(text), text)


def _fraction(text: str) -> Fraction:
    from kvmigrate.scan.baseline import parse_fraction

    return parse_fraction(text)


def _is_fraction(value: Any) -> bool:
    from fractions import Fraction  # (not at start-up: it loads decimal)

    return isinstance(value, Fraction)


# --bwlimit RATE: `200M`, `1.5G`, `50000`; --max-duration: `2h`, `1h30m`, `45s`, above zero
# (kvmigrate.pacing); --recheck F: a fraction between 0 and 1, `1/30`, `0.05` (scan.baseline)
RATE = LibraryParsed("rate", "--bwlimit", _rate, lambda v: isinstance(v, Rate))
MAX_DURATION = LibraryParsed("duration", "--max-duration", _max_duration, lambda v: isinstance(v, Seconds))
FRACTION = LibraryParsed("fraction", "--recheck", _fraction, _is_fraction)


class AgeType(click.ParamType):
    """An age in seconds (--older-than, --quiet-period): `45s`, `10m`, `1h30m`, `7d`
    (kvmigrate.units.parse_duration)."""

    name = "age"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value
        from kvmigrate.units import parse_duration

        try:
            return parse_duration(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class ShardType(click.ParamType):
    """--shard K/N: the K-th of N parts, 0 <= K < N."""

    name = "shard"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, int]:
        if isinstance(value, tuple):
            return value
        try:
            k, n = (int(x) for x in str(value).split("/"))
        except ValueError:
            self.fail(f"expected K/N, got {value!r}", param, ctx)
        if not (n >= 1 and 0 <= k < n):
            self.fail(f"need 0 <= K < N, got {value!r}", param, ctx)
        return k, n


def walk_options(fn: Callable) -> Callable:
    fn = click.option("--verify", "verify", type=click.Choice(VERIFY_LEVELS), default=DEFAULT_VERIFY,
                      show_default=True, help="size: stat only; hash: whole-file XXH3-128 of every file.")(fn)
    fn = io_depth_option(fn)
    fn = click.option("--shard", type=ShardType(), default=None, metavar="K/N",
                      help="Take the K-th of N deterministic parts of the <hhh> buckets.")(fn)
    return fn


def scaleout_options(fn: Callable) -> Callable:
    """--run-on local|ray, --shards N, --ray-address ADDR (kvmigrate.scaleout)."""
    fn = click.option("--ray-address", default=None, metavar="ADDR",
                      help="With --run-on ray: connect to this Ray cluster (e.g. ray://head:10001) instead of "
                           "starting a local one. ROOT and outputs must be shared paths on every node.")(fn)
    fn = click.option("--shards", type=click.IntRange(min=1), default=None, metavar="N",
                      help="With --run-on ray: split the <hhh> buckets into N parts (the --shard K/N partition).")(fn)
    fn = click.option("--run-on", "run_on", type=click.Choice(["local", "ray"]), default="local", show_default=True,
                      help="Run in this process, or as --shards N Ray tasks (pip install 'kvmigrate[ray]'). "
                           "Not the engine's --executor.")(fn)
    return fn


def check_scaleout(run_on: str, shards: int | None, ray_address: str | None,
                   shard: tuple[int, int] | None = None) -> int | None:
    """The number of Ray parts, or None for a run in this process."""
    if run_on != "ray":
        if shards is not None or ray_address is not None:
            raise click.UsageError("--shards and --ray-address need --run-on ray")
        return None
    if shards is None:
        raise click.UsageError("--run-on ray needs --shards N (the number of parts)")
    if shard is not None:
        raise click.UsageError("--shard K/N runs one part in this process; --run-on ray runs all N: pass one of them")
    return shards


def part_done(report: Any) -> None:
    """One stderr line per finished Ray part (progress of a long scale-out run)."""
    click.echo(f"kvmigrate: {report.name}: {'done' if report.error is None else 'failed'}", err=True)


def say_no_cache(summary: Mapping[str, Any]) -> None:
    """The error line of a root that holds no cache (exit bit 8), printed with -q and --json
    too: an empty or unmounted volume is the error of the run (interface.md §4)."""
    if summary.get("no_cache"):
        from kvmigrate.report.hints import no_cache_message

        foreign = ((summary.get("outside_namespaces") or {}).get("by_status") or {}).get("foreign", {})
        click.echo(f"kvmigrate: error: {no_cache_message(summary.get('root') or '?', foreign.get('files', 0))}",
                   err=True)


def print_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


def handle_errors(fn: Callable) -> Callable:
    """Map typed library errors to interface.md §4 exit codes, with a one-line message."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KvMigrateError as exc:
            said = "stopped" if exc.exit_code == EXIT_INTERRUPTED else "error"  # --max-duration: not a failure
            click.echo(f"kvmigrate: {said}: {exc}", err=True)
            sys.exit(exc.exit_code)
        except (KeyboardInterrupt, click.Abort):
            click.echo("kvmigrate: interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)

    return wrapper


def exit_stopped(stopped: Any, resume_command: str, undo_verb: str) -> None:
    """A run stopped by Ctrl-C, SIGTERM or --max-duration (a `pacing.Interrupted`): its
    journal is consistent; print it, the command that goes on where it stopped and the
    one that undoes it (`kvmigrate rollback` of a migration, `kvmigrate restore` of a
    prune), then exit 32. Printed with -q too: it is the error."""
    import shlex

    click.echo(f"kvmigrate: stopped: {stopped.why}; the journal is consistent", err=True)
    if stopped.journal:
        click.echo(f"  journal: {stopped.journal}", err=True)
    click.echo(f"  resume:  {resume_command}", err=True)
    if stopped.journal:
        click.echo(f"  undo:    kvmigrate {undo_verb} {shlex.quote(stopped.journal)}", err=True)
    sys.exit(stopped.exit_code)


def interrupt_on_sigterm(signum: int, frame: Any) -> None:
    """A SIGTERM handler: stop as Ctrl-C does (the run stays resumable)."""
    raise KeyboardInterrupt


def prefer_arrow_pool(pool: str) -> None:
    """Choose Arrow's allocator for this process, before pyarrow loads.

    ARROW_DEFAULT_MEMORY_POOL is read once, when pyarrow loads, and it is the only choice
    Arrow's C++ internals follow (compute kernels, IPC, the Parquet writer):
    `pa.set_memory_pool` changes pyarrow's own default only. An explicit
    ARROW_DEFAULT_MEMORY_POOL is kept.
    """
    if "pyarrow" not in sys.modules:
        os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", pool)


def returning_jemalloc() -> None:
    """Arrow on jemalloc returning freed pages at once (Linux; an explicit
    ARROW_DEFAULT_MEMORY_POOL is kept): a command that reads a whole manifest's columns
    and folds them through many short-lived arrays then peaks at what it holds, not at
    what mimalloc kept of each array it freed. Call it before pyarrow is imported."""
    if sys.platform.startswith("linux"):
        prefer_arrow_pool("jemalloc")
    import pyarrow as pa

    if pa.default_memory_pool().backend_name == "jemalloc":
        pa.jemalloc_set_decay_ms(0)


def selection_options(fn: Callable) -> Callable:
    """--only PATTERN / --exclude PATTERN (repeatable): the namespaces to work on (kvmigrate.selection)."""
    fn = click.option("--exclude", "exclude", multiple=True, metavar="PATTERN",
                      help="Leave out namespaces whose model name, source or target base folder name matches "
                           "this glob (repeatable).")(fn)
    fn = click.option("--only", "only", multiple=True, metavar="PATTERN",
                      help="Work only on namespaces whose model name, source or target base folder name matches "
                           "this glob (repeatable; e.g. 'meta-llama/*'). A filtered scan's manifest is partial.")(fn)
    return fn


def pop_selection(kwargs: dict[str, Any]) -> Any:
    """Remove --only/--exclude from a command's kwargs: a kvmigrate.selection.Selection, or None."""
    from kvmigrate.selection import Selection

    selection = Selection.of(kwargs.pop("only", ()), kwargs.pop("exclude", ()))
    return selection or None


def pacing_options(fn: Callable) -> Callable:
    """--max-duration, --bwlimit, --idle-io: stay out of the engine's way (kvmigrate.pacing)."""
    fn = click.option("--idle-io", "idle_io", is_flag=True,
                      help="Idle I/O priority (ionice -c 3): the disk serves this run only when the engine "
                           "does not ask.")(fn)
    fn = click.option("--bwlimit", type=RATE, metavar="RATE", default=None,
                      help="Read at most RATE bytes/s for hashing and copies (200M, 1.5G; K, M, G = 1024 "
                           "powers), all threads and worker processes together.")(fn)
    fn = click.option("--max-duration", "max_duration", type=MAX_DURATION, metavar="DURATION", default=None,
                      help="Stop cleanly at a batch boundary after DURATION (2h, 90m, 1h30m, 45s) and exit 32 "
                           "with the command that goes on.")(fn)
    return fn


def start_pacing(max_duration: Seconds | None, bwlimit: Rate | None, idle_io: bool, quiet: bool,
                 parts: int | None = None) -> None:
    """Set the run's limits before anything is read (their values were checked while parsing)."""
    from kvmigrate import pacing

    if parts is not None and (max_duration or bwlimit):
        raise click.UsageError("--max-duration and --bwlimit pace a run in this process, not --run-on ray parts")
    pacing.configure(bwlimit=bwlimit, max_duration=max_duration)
    if idle_io:
        note = pacing.idle_io_priority()
        if note and not quiet:
            click.echo(f"kvmigrate: note: {note}", err=True)


def rerun_command(ctx: click.Context, paths: Iterable[str] = (), *, skip: Iterable[str] = (),
                  extra: tuple[str, ...] = (), formats: dict[str, Callable[[Any], str]] | None = None) -> str:
    """The command of this invocation for a shell (the apply command a dry run prints, the
    resume command of a stop): its arguments and the options given on the command line,
    in declaration order; `paths` made absolute, `skip` left out, `formats` writing a
    parsed value back (a duration), a repeatable option once per value; then `extra`."""
    import shlex

    paths, skip, formats = set(paths), set(skip), formats or {}
    args = ["kvmigrate", ctx.info_name or ""]
    for param in ctx.command.params:
        name = param.name
        value = ctx.params.get(name)
        if name in skip or value is None:
            continue
        if isinstance(param, click.Argument):
            args += [os.path.abspath(v) if name in paths else str(v)
                     for v in (value if isinstance(value, tuple) else (value,)) if v is not None]
            continue
        if ctx.get_parameter_source(name) != click.core.ParameterSource.COMMANDLINE:
            continue
        if isinstance(value, bool):
            flag = param.opts[0] if value else (param.secondary_opts[0] if param.secondary_opts else None)
            args += [flag] if flag else []
            continue
        if isinstance(param, click.Option) and param.count:  # -vv: the flag as often as it was given
            args += [param.opts[0]] * int(value)
            continue
        for v in (value if isinstance(value, tuple) else (value,)):
            text = formats[name](v) if name in formats else os.path.abspath(v) if name in paths else str(v)
            args += [param.opts[0], text]
    return " ".join(shlex.quote(a) for a in [*args, *extra])


def baseline_options(fn: Callable) -> Callable:
    """--baseline PREV|auto, --recheck F, --history DIR (kvmigrate.scan.baseline)."""
    fn = click.option("--history", default=None, metavar="DIR", type=click.Path(file_okay=False, path_type=str),
                      help="Where audits are kept (--keep) and --baseline auto looks "
                           "(default: ROOT/.kvmigrate/audits).")(fn)
    fn = click.option("--recheck", type=FRACTION, default=None, metavar="F",
                      help="With --baseline: re-read this fraction of the carried-over files anyway, by bucket, "
                           "a different part each run (default 1/30: 30 runs cover the tree); a hash that "
                           "changed under unchanged metadata is a silent_change (exit bit 4).")(fn)
    fn = click.option("--baseline", default=None, metavar="PREV|auto",
                      help="With --verify hash: a previous manifest of this root (or auto: the newest kept "
                           "audit); files whose dev, inode, size, mtime and ctime are unchanged keep its hashes "
                           "without being read.")(fn)
    return fn


def scan_options(*, target: str, facts_resolver: Any, verify: str, threads: int | None, command: str | None,
                 selection: Any, baseline: str | None, recheck: Fraction | None, history: str | None,
                 shard: tuple[int, int] | None = None, progress: bool = False) -> ScanOptions:
    """The ScanOptions of a command's options (`history` only with --baseline or
    --recheck, which then fail without the other as the scan decides)."""
    given = baseline is not None or recheck is not None
    return ScanOptions(target=target, facts_resolver=facts_resolver, verify=verify, threads=threads,
                       shard=shard or DEFAULT_SHARD, progress=progress, command=command, selection=selection,
                       baseline=baseline, recheck=recheck, history=history if given else None)
