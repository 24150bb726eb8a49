"""Walk a cache root and write the manifest: one row per file, an action per block.

Phases (each a function below):

1. `list_root`: the top level of ROOT: base folders, rank folders (siblings), kvmigrate's
   own files, old llm-d deep layouts, anything else (foreign).
2. `resolve_namespaces`: per base folder read config.json, prove its digest against the
   folder name, detect the family (with evidence), resolve facts, compute the target.
   A missing fact fails that namespace only (`target_error`), never the scan.
3. `build_units`: what the walker visits side by side: a vLLM / llm-d namespace with its
   rank folders, or a vllm.cpp deployment (one namespace per rank).
4. The walk, a run of `<hhh>` buckets of one unit per task (memory bounded by a task):
   scandir the bucket in every rank folder, `lstat` each file (DirEntry, no symlink
   follow) or, with --verify hash, open + fstat + read it (no lstat), read vllm.cpp
   headers, and classify (`kvmigrate.classify`; a healthy block's verdict is computed once
   per shape and replayed). The plain block files of vLLM / llm-d buckets go through the
   compiled leaf walk where it is built (`kvmigrate._leafwalk`: by file descriptor, GIL
   released); anything unusual it hands back to the Python code here, which words it.
   Rows the Python code makes go to column lists, the leaf walk's stay in C structs
   (`Rows`), one Arrow batch per task. Tasks run in worker processes (the
   rest of the walk is Python work: the GIL would serialise threads) or in this process,
   with threads for I/O concurrency; their batches are written in task order, so every
   mode writes the same manifest.
5. Sizes that must be equal within a (namespace, rank, group) are only known at the end:
   when some are odd (or the walk met errors, which the metadata records), the manifest
   is rewritten once with those blocks re-classified (`_finalize`); a healthy tree is
   written once.

Files that vanish between listing and reading (a live engine's evictor, temp + rename)
are dropped: they are not there. Permission and I/O errors are findings (`unreadable`,
with errno and path). Nothing under ROOT is ever opened for writing.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shlex
import stat as stat_mod
import sys
import signal
import threading
import time
from collections import Counter, defaultdict, deque
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from kvmigrate import __version__, classify, context, findings, layout, manifest
from kvmigrate.classify import FileRecord, UnitPlan
from kvmigrate.errors import MissingFactError, OperationalError, UsageError
from kvmigrate.formats import vllmcpp
from kvmigrate.fsio import all_holes, check_root, open_noatime  # noqa: F401  (open_noatime: tests fault it here)
from kvmigrate.identity import canonical, schemes
from kvmigrate.identity.facts import Facts, FactsResolver
from kvmigrate.identity.family import detect_family, harmless_ambiguity_note
from kvmigrate.identity.target import compute_target
from kvmigrate.identity.values import DEFAULT_PROFILE
from kvmigrate.units import human_bytes

READ_CHUNK = 1 << 20  # 1 MiB reads into a reused per-thread buffer
# The buffer is a page larger than a chunk, so a 1 MiB block file is read (and its EOF
# proven) by a single read of size + 1 bytes.
READ_BUFFER = READ_CHUNK + 4096
SMALL_FILE = 64 * 1024  # smaller files are read into a fresh bytes object (cheaper than the buffer)
SAMPLE_FILES = 64  # block sizes sampled per rank folder for family detection
CONFIG_MAX = 16 << 20  # engines write a config.json of a few KiB: a larger one is never read into memory
ZERO_SCAN_MAX = 64 << 20  # --verify size reads a zero-header vllm.cpp file whole only up to this size
DEEP_RE_PREFIXES = ("block_size_",)
BATCH_ROWS = 32_768  # rows per Parquet row group (at least; larger ones cost the summary memory)
TASK_BUCKETS = 32  # <hhh> buckets per task
PARALLEL_MIN_BUCKETS = 256  # fewer bucket visits than this: one process (forking costs more)
LEAF_THREADS = 4  # walker threads per process with the compiled leaf walk (see _parallelism)
VERDICTS_KEPT = 4096  # block shapes (and sizes) whose verdict a walk remembers: a namespace has a few

# File-level states (what a file alone shows). Every other state of a block row is a
# block-level verdict on a file that was fine by itself: the re-classification of odd-size
# blocks recovers the file-level state from the manifest row this way.
FILE_LEVEL_STATUSES = frozenset({"short", "zero_filled", "header_invalid", "size_mismatch", "padded_legacy",
                                 "unreadable", "misfiled"})
NS_COLUMNS = ("family", "scheme", "model_name", "source_d12", "source_base", "deployment",
              "target_profile", "target_d12", "target_base")


# ---------------------------------------------------------------------------------------
# Results


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


# ---------------------------------------------------------------------------------------
# Reading files


_tls = threading.local()


def _buffer() -> bytearray:
    buf = getattr(_tls, "buf", None)
    if buf is None:
        buf = _tls.buf = bytearray(READ_BUFFER)
    return buf


_ZEROS = bytes(READ_BUFFER)


def leaf_walk() -> Any:
    """The compiled leaf walk (kvmigrate._leafwalk), or None: not built on this machine
    (no C compiler at install time), or KVMIGRATE_PURE_PYTHON=1 (the tests run both walks
    on the same trees; an operator can rule the extension out)."""
    if os.environ.get("KVMIGRATE_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        from kvmigrate import _leafwalk
    except ImportError:
        return None
    return _leafwalk


class Vanished(Exception):
    """The file disappeared (or was replaced by a non-file) between listing and reading."""


class ChangedWhileRead(OSError):
    """The file's size changed while it was read, and again when read once more: something
    is writing it in place. Its row says so (unreadable, operational) instead of carrying
    a hash of bytes that match no size the scan saw."""

    def __init__(self, path: str, size: int, nread: int):
        super().__init__(errno.EAGAIN, f"changed size while read ({size:,} bytes at open, {nread:,} read): "
                                       "something is writing it; rerun the scan when the engine is idle", path)


@dataclass(slots=True)
class ReadResult:
    content: bytes | None  # XXH3-128 digest of the whole file
    payload: bytes | None  # XXH3-128 after the first `header_len` bytes
    header: bytes | None  # first `header_len` bytes
    all_zero: bool
    st: os.stat_result  # fstat of the opened file (the truth if it was replaced meanwhile)


def read_file(path: str, *, want_hash: bool, header_len: int = 0) -> ReadResult:
    """Read a regular file once: its header, whole-file and payload XXH3-128, and whether
    every byte is zero. Raises Vanished, or OSError for real I/O problems.

    A file whose size changes while it is read (more or fewer bytes than fstat said) is
    read once more from a fresh open; if it changes again, ChangedWhileRead."""
    for _attempt in range(2):
        try:
            return _read_file(path, want_hash, header_len)
        except _SizeChanged as exc:
            changed = exc
    raise ChangedWhileRead(path, changed.size, changed.nread)


class _SizeChanged(Exception):
    def __init__(self, size: int, nread: int):
        super().__init__(size, nread)
        self.size, self.nread = size, nread


def _read_file(path: str, want_hash: bool, header_len: int) -> ReadResult:
    try:
        fd = open_noatime(path)
    except FileNotFoundError:
        raise Vanished(path) from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.ENOTDIR):
            raise Vanished(path) from None  # replaced by a symlink / FIFO meanwhile
        raise
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode):
            raise Vanished(path)
        if want_hash and all_holes(fd, st):
            # nothing but holes: every byte is zero (an ftruncate-d crash residue, or a 1 TiB
            # sparse file that would take minutes to read); no hash is needed to say so
            return ReadResult(None, None, os.pread(fd, header_len, 0) if header_len else None, True, st)
        if not header_len:
            if not want_hash:
                return ReadResult(None, None, None, False, st)
            size = st.st_size
            if size < SMALL_FILE:  # one read of size + 1 bytes: the short read proves EOF
                data = os.read(fd, size + 1)
                if len(data) == size:
                    return ReadResult(xxhash.xxh3_128_digest(data), None, None,
                                      size > 0 and not data[0] and not data.lstrip(b"\0"), st)
                content, nread, all_zero = _hash_fd(fd, size, data)
            else:
                content, nread, all_zero = _hash_fd(fd, size)
            if nread != size:
                raise _SizeChanged(size, nread)
            return ReadResult(content, None, None, all_zero and nread > 0, st)
        header = os.pread(fd, header_len, 0)
        if not want_hash:
            return ReadResult(None, None, header, False, st)
        buf = _buffer()
        mv = memoryview(buf)
        whole = xxhash.xxh3_128()
        payload = xxhash.xxh3_128()
        all_zero = True
        offset = 0
        while True:
            n = os.readv(fd, [mv])
            if not n:
                break
            chunk = mv[:n]
            whole.update(chunk)
            if offset >= header_len:
                payload.update(chunk)
            elif offset + n > header_len:
                payload.update(chunk[header_len - offset:])
            if all_zero:
                all_zero = _zero_prefix(buf, n)
            offset += n
            if offset > st.st_size:  # it grew while read
                break
        if offset != st.st_size:
            raise _SizeChanged(st.st_size, offset)
        return ReadResult(whole.digest(), payload.digest(), header, all_zero and offset > 0, st)
    finally:
        os.close(fd)


def _zero_prefix(buf: bytearray, n: int) -> bool:
    """Are the first n bytes of the buffer zero? (The first byte settles it for almost
    every real file.)"""
    if buf[0]:
        return False
    return buf == _ZEROS if n == len(buf) else buf[:n] == _ZEROS[:n]


def _hash_fd(fd: int, size: int, head: bytes = b"") -> tuple[bytes, int, bool]:
    """XXH3-128 of an open file (after `head`, its bytes already read), bytes read, and
    whether they are all zero. A file that fits the reused buffer takes one read of
    size + 1 bytes (the short read proves EOF) and a one-shot hash; larger ones are
    streamed chunk by chunk. Reading stops once more than `size` bytes came (it grew:
    read_file reads it again rather than chase a writer)."""
    buf = _buffer()
    mv = memoryview(buf)
    whole = xxhash.xxh3_128()
    total = len(head)
    zero = True
    if head:
        whole.update(head)
        zero = not head.lstrip(b"\0")
        n = os.readv(fd, [mv])
    else:
        want = size + 1 if size < READ_BUFFER else READ_BUFFER
        n = os.readv(fd, [mv[:want]])
        if n == size and n < want:
            return xxhash.xxh3_128_digest(mv[:n]), n, n > 0 and _zero_prefix(buf, n)
    zero = zero and (not n or _zero_prefix(buf, n))
    while n:
        whole.update(mv[:n])
        total += n
        if total > size:  # it grew while read: the caller reads it again (no chasing a writer)
            break
        n = os.readv(fd, [mv])
        if zero and n:
            zero = _zero_prefix(buf, n)
    return whole.digest(), total, zero


def read_all(path: str, limit: int) -> bytes | None:
    """Whole file content (for slice-candidate search), or None if too large / gone."""
    try:
        fd = open_noatime(path)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        chunks = []
        while True:
            b = os.read(fd, READ_CHUNK)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def expected_output_digest(action: str, src: str, *, new_digest: bytes | None = None) -> bytes | None:
    """XXH3-128 of the file an action would write from `src` (to recognise a target that
    already holds it): link = the source bytes, copy_pad = + zero pad to 4096,
    rewrite_header = the new header + the payload."""
    try:
        if action == "link":
            return read_file(src, want_hash=True).content
        data = read_all(src, 1 << 32)
    except (Vanished, OSError):
        return None
    if data is None:
        return None
    if action == "copy_pad":
        return xxhash.xxh3_128_digest(data + bytes(-len(data) % classify.PAGE))
    if action == "rewrite_header" and new_digest is not None and len(data) >= vllmcpp.HEADER_SIZE:
        return xxhash.xxh3_128_digest(vllmcpp.rewrite_header(data, new_digest) + data[vllmcpp.HEADER_SIZE:])
    return None


def errno_reason(exc: OSError, what: str, relpath: str) -> str:
    name = errno.errorcode.get(exc.errno or 0, "EIO")
    return f"{what} {relpath}: [{name}] {exc.strerror or exc}"


# ---------------------------------------------------------------------------------------
# Root listing and namespaces


@dataclass
class Namespace:
    """One namespace (base folder and/or rank folders) with what scan proved about it."""

    source_base: str
    safe_model: str
    d12: str
    has_base: bool
    rank_dirs: dict[int, str] = field(default_factory=dict)  # rank -> top-level folder name
    config_relpath: str | None = None
    fields: dict[str, Any] | None = None
    config_raw: bytes | None = None
    family: str | None = None
    family_evidence: list[str] = field(default_factory=list)
    scheme: str | None = None
    model_name: str | None = None
    digest_ok: bool | None = None
    digest: bytes | None = None  # full identity digest (raw), vllm.cpp header check
    config_error: str | None = None
    unknown_keys: list[str] = field(default_factory=list)
    deployment: str | None = None
    facts: Facts | None = None
    target: Any = None  # kvmigrate.identity.target.Target
    target_error: str | None = None
    target_error_flag: str | None = None
    status: str = "ok"
    status_reason: str = ""
    notes: list[str] = field(default_factory=list)
    sampled_sizes: list[int] = field(default_factory=list)  # rank 0's, for family evidence
    size_sample: dict[tuple[int, int], Counter] = field(default_factory=dict)  # (rank, group) -> sizes

    def columns(self) -> tuple:
        t = self.target
        return (self.family, self.scheme, self.model_name, self.d12, self.source_base,
                self.deployment or self.source_base,
                t.profile if t is not None else None,
                t.d12 if t is not None else None,
                t.base_name if t is not None else None)

    def metadata(self) -> dict[str, Any]:
        t = self.target
        facts = self.facts
        return {
            "family": self.family, "family_evidence": self.family_evidence, "scheme": self.scheme,
            "model_name": self.model_name, "source_d12": self.d12, "digest_ok": self.digest_ok,
            "config_json": self.fields, "config_error": self.config_error, "unknown_keys": self.unknown_keys,
            "ranks": sorted(self.rank_dirs), "rank_dirs": [self.rank_dirs[r] for r in sorted(self.rank_dirs)],
            "deployment": self.deployment or self.source_base,
            "facts": facts.to_dict() if facts is not None else {},
            "facts_source": dict(facts.sources) if facts is not None else {},
            "assumed_facts": dict(t.assumed_facts) if t is not None else {},
            "target": None if t is None else {
                "profile": t.profile, "family": t.family, "fields": t.fields, "d12": t.d12,
                "base_name": t.base_name, "rank_dir": t.rank_dir, "parallel_agnostic": t.parallel_agnostic,
                "replicated_layout": t.replicated_layout, "reasons": list(t.reasons),
                "unreachable": t.unreachable, "missing_facts": list(t.missing_facts),
                "decisive_assumptions": dict(t.decisive_assumptions)},
            "target_error": self.target_error, "target_error_flag": self.target_error_flag,
            "status": self.status, "status_reason": self.status_reason, "notes": self.notes,
            "block_sizes": _modal_sizes(self.sampled_sizes),  # rank 0's sample (family evidence)
        }


@dataclass
class RootListing:
    """The top level of ROOT, sorted into what each entry is."""

    bases: dict[str, os.DirEntry] = field(default_factory=dict)
    rank_folders: dict[str, dict[int, str]] = field(default_factory=dict)  # base -> rank -> dirname
    own_dirs: list[str] = field(default_factory=list)
    deep_dirs: list[str] = field(default_factory=list)
    foreign_dirs: list[str] = field(default_factory=list)
    files: list[os.DirEntry] = field(default_factory=list)  # top-level non-directories
    names: set[str] = field(default_factory=set)


def _looks_deep(path: str, depth: int = 3) -> bool:
    """Old llm-d deep layout: `<model>/block_size_*/tp_*_pp_size_*_pcp_size_*/rank_*/...`
    (the model name is verbatim, so `org/model` nests one more level)."""
    try:
        with os.scandir(path) as it:
            subdirs = [e for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return False
    for e in subdirs:
        if e.name.startswith(DEEP_RE_PREFIXES):
            return True
    if depth > 1:
        return any(_looks_deep(e.path, depth - 1) for e in subdirs[:64])
    return False


def list_root(root: str) -> RootListing:
    listing = RootListing()
    with os.scandir(root) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        listing.names.add(e.name)
        if not e.is_dir(follow_symlinks=False):
            listing.files.append(e)
            continue
        if e.name == layout.OWN_DIR:
            listing.own_dirs.append(e.name)
            continue
        parsed = layout.parse_folder(e.name)
        if parsed is not None and parsed.rank is not None:
            listing.rank_folders.setdefault(parsed.base, {})[parsed.rank] = e.name
        elif parsed is not None:
            listing.bases[e.name] = e
        elif _looks_deep(e.path):
            listing.deep_dirs.append(e.name)
        else:
            listing.foreign_dirs.append(e.name)
    return listing


def _read_config(root: str, ns: Namespace) -> None:
    """Read, parse and validate config.json; prove the digest against the folder name."""
    rel = f"{ns.source_base}/{layout.CONFIG_NAME}"
    path = os.path.join(root, rel)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        ns.status, ns.status_reason = "orphan_namespace", f"{rel} is missing"
        ns.config_error = "config.json missing"
        return
    except OSError as exc:
        ns.status, ns.status_reason = "config_invalid", errno_reason(exc, "cannot stat", rel)
        ns.config_error = ns.status_reason
        return
    ns.config_relpath = rel
    if not stat_mod.S_ISREG(st.st_mode):
        ns.status, ns.status_reason = "orphan_namespace", f"{rel} is not a regular file (never followed)"
        ns.config_error = "config.json is not a regular file"
        ns.config_relpath = None
        return
    too_big = (f"{rel} is larger than {CONFIG_MAX} bytes (an engine's config.json is a few KiB); not read, "
               "never migrated")
    if st.st_size > CONFIG_MAX:
        ns.status, ns.status_reason, ns.config_error = "config_invalid", too_big, too_big
        return
    try:
        fd = open_noatime(path)
        try:
            chunks = []
            n = 0
            while n <= CONFIG_MAX:  # it may grow while read
                b = os.read(fd, READ_CHUNK)
                if not b:
                    break
                chunks.append(b)
                n += len(b)
            raw = b"".join(chunks)
        finally:
            os.close(fd)
        if n > CONFIG_MAX:
            ns.status, ns.status_reason, ns.config_error = "config_invalid", too_big, too_big
            return
    except OSError as exc:
        ns.status, ns.status_reason = "config_invalid", errno_reason(exc, "cannot read", rel)
        ns.config_error = ns.status_reason
        return
    ns.config_raw = raw
    try:
        fields = canonical.fields_from_config_bytes(raw)
    except ValueError as exc:
        ns.status, ns.status_reason = "config_invalid", f"{rel}: {exc}"
        ns.config_error = str(exc)
        return
    is_cpp = all(k in fields for k in ("format_version", "hash_algo", "kv_cache_spec_kind"))
    problems = vllmcpp.validate_identity(fields) if is_cpp else schemes.validate_fields(fields)
    if problems:
        ns.status = "config_invalid"
        ns.status_reason = f"{rel}: " + "; ".join(problems[:5])
        ns.config_error = "; ".join(problems)
        ns.fields = fields
        return
    ns.fields = fields
    ns.model_name = fields["model_name"]
    if is_cpp:
        ns.scheme = "vllmcpp-v1"
        digest_hex = canonical.full_digest(fields, "vllmcpp")
        ns.digest = bytes.fromhex(digest_hex)
        ns.unknown_keys = sorted(k for k in fields if k not in vllmcpp.IDENTITY_KEYS
                                 and k not in vllmcpp.OPTIONAL_KEYS)
        if hashlib.sha256(raw).hexdigest() != digest_hex:
            ns.notes.append("config.json is not byte-canonical (vllm.cpp compares it field by field)")
        rank0 = dict(fields, rank=0)
        ns.deployment = canonical.full_digest(rank0, "vllmcpp")
    else:
        ns.scheme = schemes.scheme_of(fields)
        digest_hex = canonical.full_digest(fields, "vllm")
        ns.unknown_keys = schemes.unknown_keys(fields)
        ns.deployment = ns.source_base
    expected_base = layout.base_name(ns.model_name, digest_hex[:12])
    ns.digest_ok = expected_base == ns.source_base
    if not ns.digest_ok:
        ns.status = "digest_mismatch"
        if digest_hex[:12] != ns.d12:
            ns.status_reason = (f"digest mismatch: {rel} hashes to {digest_hex[:12]}, the folder name says "
                                f"{ns.d12}; never migrated")
        else:
            ns.status_reason = (f"digest mismatch: {rel} names model {ns.model_name!r}, the folder name says "
                                f"{ns.safe_model!r}; never migrated")


def _sample_sizes(root: str, rank_dir: str, limit: int = SAMPLE_FILES) -> list[tuple[int, int]]:
    """(group, size) of the first block files of a rank folder, in sorted bucket order.

    Deterministic and independent of --shard: it is the family evidence of S1 folders and
    the shared size reference that lets every shard judge odd sizes the same way.
    """
    sizes: list[tuple[int, int]] = []
    base = os.path.join(root, rank_dir)
    try:
        with os.scandir(base) as it:
            buckets = sorted(e.name for e in it if e.is_dir(follow_symlinks=False) and layout.BUCKET_RE.match(e.name))
    except OSError:
        return sizes
    for b in buckets:
        try:
            with os.scandir(os.path.join(base, b)) as it:
                fanouts = sorted(e.name for e in it
                                 if e.is_dir(follow_symlinks=False) and layout.FANOUT_RE.match(e.name))
        except OSError:
            continue
        for f in fanouts:
            group = int(layout.FANOUT_RE.match(f).group(2))
            try:
                with os.scandir(os.path.join(base, b, f)) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except OSError:
                continue
            for e in entries:
                if e.is_file(follow_symlinks=False) and layout.BLOCK_RE.match(e.name):
                    try:
                        sizes.append((group, e.stat(follow_symlinks=False).st_size))
                    except OSError:
                        continue
                    if len(sizes) >= limit:
                        return sizes
    return sizes


def _modal_sizes(sizes: list[int]) -> list[int]:
    """The most common block size(s) of a sample: one damaged file is not evidence."""
    if not sizes:
        return []
    counts = Counter(sizes).most_common()
    top = counts[0][1]
    return [s for s, n in counts if n == top and s > 0]


def resolve_namespaces(root: str, listing: RootListing, resolver: FactsResolver, profile: str) -> list[Namespace]:
    """Every namespace of the root with config, digest, family, facts and target resolved."""
    namespaces: list[Namespace] = []
    names = sorted(set(listing.bases) | set(listing.rank_folders))
    for base in names:
        parsed = layout.parse_folder(base)
        ns = Namespace(base, parsed.safe_model, parsed.d12, has_base=base in listing.bases,
                       rank_dirs=dict(sorted(listing.rank_folders.get(base, {}).items())))
        if ns.has_base:
            _read_config(root, ns)
        else:
            ns.status = "orphan_namespace"
            ns.status_reason = f"rank folder without its base folder {base}/"
        if ns.has_base and not ns.rank_dirs and ns.status == "ok":
            ns.notes.append("no rank folder: the namespace holds no blocks")
        if ns.fields is not None and ns.status in ("ok", "digest_mismatch"):
            _resolve_identity(root, ns, resolver, profile)
        namespaces.append(ns)
    return namespaces


def _resolve_identity(root: str, ns: Namespace, resolver: FactsResolver, profile: str) -> None:
    fields = ns.fields
    assert fields is not None
    facts = resolver.for_namespace(ns.model_name or "", ns.source_base, fields)
    ns.facts = facts
    if not (ns.scheme or "").startswith("vllmcpp"):
        for rank, dirname in ns.rank_dirs.items():
            for group, size in _sample_sizes(root, dirname):
                ns.size_sample.setdefault((rank, group), Counter())[size] += 1
                if rank == 0:
                    ns.sampled_sizes.append(size)
    family, evidence = detect_family(fields, rank_numbers=list(ns.rank_dirs),
                                     block_sizes=_modal_sizes(ns.sampled_sizes), forced=facts.family)
    ns.family, ns.family_evidence = family, list(evidence)
    if family == "ambiguous":
        note = harmless_ambiguity_note(fields, _modal_sizes(ns.sampled_sizes))
        if note:
            ns.family_evidence.append(note)
        else:
            ns.family_evidence.append("the ambiguity changes decisions here (tp, pp, pcp or blocks per file > 1): "
                                      "blocks stay `none` until --family is given")
    if family == "unknown":
        ns.status, ns.status_reason = "config_invalid", "config.json matches no known writer scheme"
        return
    if family == "llmd" and fields.get("pp_size", 1) > 1:
        ns.status = "unsupported_layout"
        ns.status_reason = (f"pipeline stage: llm-d with pp={fields['pp_size']} writes one base folder per stage "
                            "(out of scope)")
    if ns.status != "ok":
        return
    target_profile = "vllmcpp" if family == "vllmcpp" else profile
    try:
        ns.target = compute_target(fields, family, facts, target_profile)
    except MissingFactError as exc:
        ns.target_error_flag = exc.flag
        ns.target_error = findings.reason(f"missing deployment fact '{exc.fact}': pass {exc.flag} "
                                          f"(or '{exc.fact}' for this namespace in --facts)", findings.NEEDS_FACT,
                                          asks=findings.asks(exc.flag))
    except UsageError as exc:
        ns.target_error = str(exc).split("\n")[0]


# ---------------------------------------------------------------------------------------
# Walk units


@dataclass
class Member:
    """One rank folder of a unit."""

    rank: int
    dirname: str
    ns: Namespace
    columns: tuple  # namespace column values for its rows
    foreign_reason: str | None = None  # rank folder outside the deployment: its files are foreign
    buckets: set[str] = field(default_factory=set)
    code: int = 0  # its namespace's index in Walker.ns_table (the namespace columns of its rows)


@dataclass
class Unit:
    index: int
    plan: UnitPlan
    members: list[Member]
    # Verdicts of healthy blocks by shape (group, ranks, sizes, replicas differ): the
    # classification depends on nothing else, so it is computed once and replayed.
    verdicts: dict[tuple, tuple] = field(default_factory=dict)
    size_verdicts: dict[tuple[int, int], tuple[str, str] | None] = field(default_factory=dict)
    targets_exist: bool = False  # the target rank folder is already at the root: check each target path

    def bucket_names(self) -> list[str]:
        names: set[str] = set()
        for m in self.members:
            names |= m.buckets
        return sorted(names)


def build_units(root: str, namespaces: list[Namespace], hashed: bool, profile: str) -> list[Unit]:
    units: list[Unit] = []
    records = {ns.source_base: ns.metadata() for ns in namespaces}  # what the manifest keeps of each
    by_base = {ns.source_base: ns for ns in namespaces}
    for bases in context.unit_groups(records):
        nss = [by_base[b] for b in bases]
        plan = context.unit_context([records[b] for b in bases], hashed)
        members = []
        for ns in nss:
            cols = ns.columns()
            own_rank = (ns.fields or {}).get("rank") if ns.family == "vllmcpp" and ns.status == "ok" else None
            for rank, dirname in ns.rank_dirs.items():
                m = Member(rank, dirname, ns, cols)
                if own_rank is not None and rank != own_rank:
                    m.foreign_reason = (f"rank folder _r{rank} does not match the identity's rank {own_rank} "
                                        "(the engine never reads it)")
                elif ns.status == "ok" and plan.expected_ranks and rank not in plan.expected_ranks:
                    m.foreign_reason = (f"rank folder _r{rank} is outside the writer's ranks "
                                        f"{list(plan.expected_ranks)}")
                members.append(m)
        members.sort(key=lambda m: (m.rank, m.dirname))
        units.append(Unit(len(units), plan, members))
    return units


# ---------------------------------------------------------------------------------------
# Per-bucket work


class Rows:
    """Manifest rows of one task in walk order, plus `order`: the order they are written
    in. A bucket's block rows wait for their block's verdict and are written after its
    other rows, sorted by (group, block hash); one Arrow `take` per batch puts them
    there, so no row is copied or boxed in Python.

    Rows the Python code makes are column lists (row index i >= 0); the plain block rows
    the C walk takes stay in its BlockRows, `store` (row j has index -(j + 1)) until
    `table()` hands their column buffers to Arrow. `record(i)` and `set_verdict(i, ...)`
    read and write either kind."""

    COLUMNS = ("relpath", "ns", "rank", "group", "block_hash", "size", "mtime_ns", "inode", "dev", "nlink",
               "content", "payload", "status", "action", "reason", "target")
    __slots__ = COLUMNS + ("order", "sizes", "errors", "store")

    def __init__(self) -> None:
        for name in self.COLUMNS:
            setattr(self, name, [])
        self.order: list[int] = []
        self.sizes: dict[tuple[str, int, int], Counter] = defaultdict(Counter)
        self.errors: list[str] = []
        self.store: Any = None  # kvmigrate._leafwalk.BlockRows, made by the first bucket the C walk takes

    def __len__(self) -> int:
        return len(self.order)

    def add(self, rec: FileRecord, code: int, *, emit: bool = True) -> int:
        """Append one file's row; `emit=False` leaves its place in the order to the caller."""
        i = len(self.relpath)
        self.relpath.append(rec.relpath)
        self.ns.append(code)
        self.rank.append(rec.rank)
        self.group.append(rec.group)
        self.block_hash.append(bytes.fromhex(rec.hex) if rec.hex else None)
        self.size.append(rec.size)
        self.mtime_ns.append(rec.mtime_ns)
        self.inode.append(rec.inode)
        self.dev.append(rec.dev)
        self.nlink.append(rec.nlink)
        self.content.append(rec.content)
        self.payload.append(rec.payload)
        self.status.append(rec.status)
        self.action.append(rec.action)
        self.reason.append(rec.reason)
        self.target.append(rec.target_relpath)
        if emit:
            self.order.append(i)
        return i

    def columns(self) -> tuple[list, ...]:
        """The column lists in COLUMNS order (leaf.finish_blocks reads and sets them)."""
        return tuple([getattr(self, name) for name in self.COLUMNS])

    def block_rows(self, leaf: Any) -> Any:
        """The C walk's row store (made on first use)."""
        if self.store is None:
            self.store = leaf.BlockRows()
        return self.store

    def record(self, i: int, hex_hash: str | None = None) -> FileRecord:
        """Row i as a FileRecord (for the rare blocks classified one by one)."""
        if i < 0:
            (relpath, _, rank, group, _, size, mtime_ns, inode, dev, nlink, content, payload, status, action, reason,
             target) = self.store.row(-i - 1)
        else:
            relpath, rank, group, size, mtime_ns, inode, dev, nlink, content, payload, status, action, reason, target = (
                self.relpath[i], self.rank[i], self.group[i], self.size[i], self.mtime_ns[i], self.inode[i],
                self.dev[i], self.nlink[i], self.content[i], self.payload[i], self.status[i], self.action[i],
                self.reason[i], self.target[i])
        return FileRecord(relpath, rank, group, hex_hash, size, mtime_ns, inode, dev, nlink, content=content,
                          payload=payload, status=status, reason=reason, action=action, target_relpath=target)

    def set_verdict(self, i: int, status: str, action: str, reason: str | None, target: str | None) -> None:
        """Row i's status, action, reason and target path."""
        if i < 0:
            self.store.set(-i - 1, status, action, reason, target)
        else:
            self.status[i], self.action[i], self.reason[i], self.target[i] = status, action, reason, target

    def extend(self, other: "Rows") -> None:
        base, c_base = len(self.relpath), len(self.store) if self.store is not None else 0
        for name in self.COLUMNS:
            getattr(self, name).extend(getattr(other, name))
        if other.store is not None and len(other.store):
            if self.store is None:
                self.store = type(other.store)()
            self.store.extend(other.store)
        # other's list rows follow ours (i + base), its C rows too: -(j + 1) -> -(c_base + j + 1)
        self.order.extend([i + base if i >= 0 else i - c_base for i in other.order] if base or c_base else other.order)
        for key, cnt in other.sizes.items():
            self.sizes[key].update(cnt)
        self.errors.extend(other.errors)

    def table(self, ns_arrays: list[tuple[pa.Array, pa.Array]]) -> pa.Table:
        """The rows as one Arrow table with the manifest schema, in written order."""
        c_rows = len(self.store) if self.store is not None else 0
        if not c_rows:
            t = self._list_table(ns_arrays)
            if self.order != list(range(len(self.order))):
                t = t.take(pa.array(self.order, pa.int32()))
            return t
        if not self.relpath:  # C rows only: the store gathers them in write order
            return _block_rows_table(self.store, ns_arrays, self.order)
        t = pa.concat_tables([self._list_table(ns_arrays), _block_rows_table(self.store, ns_arrays)])
        first_c = len(self.relpath)  # C row j is at first_c + j: index -(j + 1) -> first_c - 1 - i
        order = pa.array(self.order, pa.int64())
        return t.unify_dictionaries().take(
            pc.if_else(pc.less(order, 0), pc.subtract(pa.scalar(first_c - 1, pa.int64()), order), order))

    def _list_table(self, ns_arrays: list[tuple[pa.Array, pa.Array]]) -> pa.Table:
        codes = pa.array(self.ns, pa.int32())
        arrays = [_utf8_safe(self.relpath)]
        arrays += [pa.DictionaryArray.from_arrays(mapping.take(codes), dictionary) for mapping, dictionary in ns_arrays]
        arrays += [pa.array(self.rank, pa.int32()), pa.array(self.group, pa.int32()),
                   pa.array(self.block_hash, pa.binary()), pa.array(self.size, pa.int64()),
                   pa.array(self.mtime_ns, pa.int64()), pa.array(self.inode, pa.uint64()),
                   pa.array(self.dev, pa.uint64()), pa.array(self.nlink, pa.uint32()),
                   pa.array(self.content, pa.binary(16)), pa.array(self.payload, pa.binary(16)),
                   _utf8_safe(self.status).dictionary_encode(), _utf8_safe(self.action).dictionary_encode(),
                   _utf8_safe(self.reason).dictionary_encode(), _utf8_safe(self.target)]
        arrays += findings.arrays([findings.finding_of(r) for r in self.reason])
        return pa.Table.from_arrays(arrays, schema=manifest.SCHEMA)


def _block_rows_table(store: Any, ns_arrays: list[tuple[pa.Array, pa.Array]], order: list[int] | None = None
                      ) -> pa.Table:
    """The C walk's rows as an Arrow table, from its column buffers: the rows of `order`
    (indexes -(j + 1)) in that order, or all in store order."""
    cols = store.arrays([layout.shown(base).encode("utf-8") for base in store.bases], order)
    n = len(store) if order is None else len(order)

    def buf(key: str) -> pa.Buffer | None:
        value = cols[key]
        return None if value is None else pa.py_buffer(value)

    def fixed(key: str, typ: pa.DataType, valid: str | None = None) -> pa.Array:
        return pa.Array.from_buffers(typ, n, [buf(valid) if valid else None, buf(key)])

    def coded(c: int, key: str) -> pa.Array:
        return pa.DictionaryArray.from_arrays(fixed(key, pa.int32(), f"{key}_valid"), _utf8_safe(store.values(c)))

    codes = fixed("ns", pa.int32())
    if cols["target_offsets"] is not None:
        target = pa.Array.from_buffers(pa.string(), n, [buf("target_valid"), buf("target_offsets"),
                                                        buf("target_data")])
    else:  # a target path that is not valid UTF-8 (a lone surrogate): shown escaped, as in Python rows
        target = _utf8_safe(store.targets(order))
    arrays = [pa.Array.from_buffers(pa.string(), n, [None, buf("relpath_offsets"), buf("relpath_data")])]
    arrays += [pa.DictionaryArray.from_arrays(mapping.take(codes), dictionary) for mapping, dictionary in ns_arrays]
    arrays += [fixed("rank", pa.int32()), fixed("group", pa.int32()),
               pa.Array.from_buffers(pa.binary(), n, [None, buf("hash_offsets"), buf("hash_data")]),
               fixed("size", pa.int64()), fixed("mtime_ns", pa.int64()), fixed("inode", pa.uint64()),
               fixed("dev", pa.uint64()), fixed("nlink", pa.uint32()),
               fixed("content", pa.binary(16), "content_valid"), pa.nulls(n, pa.binary(16)),
               coded(0, "status"), coded(1, "action"), coded(2, "reason"), target]
    # the finding columns: one Finding per distinct reason, taken by the rows' reason index
    arrays += findings.arrays_by_code(store.values(2), fixed("reason", pa.int32(), "reason_valid"))
    return pa.Table.from_arrays(arrays, schema=manifest.SCHEMA)


def _utf8_safe(values: list[Any]) -> pa.Array:
    """A string column; undecodable file names (surrogate escapes) are shown with
    backslash escapes: Arrow strings are UTF-8, and a foreign file's odd name must not
    crash the scan."""
    try:
        return pa.array(values, pa.string())
    except (UnicodeEncodeError, pa.ArrowException):
        return pa.array([layout.shown(v) if isinstance(v, str) else v for v in values], pa.string())


def _ns_arrays(ns_table: list[tuple | None]) -> list[tuple[pa.Array, pa.Array]]:
    """Per namespace column: (namespace code -> dictionary index, dictionary), so a batch's
    namespace columns are built from its rows' codes with one `take` each."""
    out = []
    for j in range(len(NS_COLUMNS)):
        index: dict[str, int] = {}
        mapping = []
        for cols in ns_table:
            value = cols[j] if cols is not None else None
            mapping.append(None if value is None else index.setdefault(value, len(index)))
        out.append((pa.array(mapping, pa.int32()), _utf8_safe(list(index))))
    return out


def _kind_of(mode: int) -> str:
    if stat_mod.S_ISLNK(mode):
        return "symlink"
    if stat_mod.S_ISFIFO(mode):
        return "FIFO"
    if stat_mod.S_ISSOCK(mode):
        return "socket"
    if stat_mod.S_ISCHR(mode) or stat_mod.S_ISBLK(mode):
        return "device"
    if stat_mod.S_ISDIR(mode):
        return "directory"
    return "special file"


def _record(relpath: str, st: os.stat_result, rank: int | None = None, group: int | None = None,
            hex_hash: str | None = None) -> FileRecord:
    return FileRecord(relpath, rank, group, hex_hash, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev,
                      st.st_nlink)


class Walker:
    """The walk of one scan: options, shared caches and the per-bucket worker."""

    def __init__(self, root: str, *, verify: str, listing: RootListing,
                 transform_output: Callable[[str, UnitPlan, FileRecord], tuple[int, Callable[[], bytes | None]]]):
        self.root = root
        self.transform_output = transform_output  # see `scan`
        self.verify = verify
        self.hashed = verify == "hash"
        self.listing = listing
        self._slice_cache: dict[tuple[int, int, int], str | None] = {}
        self._euid = os.geteuid()
        self._groups = set(os.getgroups()) | {os.getegid()}
        # --verify size never opens block files, yet an unreadable one is a finding: judge the bits
        self.check_perm = verify == "size" and self._euid != 0
        self.leaf_perm = (self._euid, tuple(self._groups)) if self.check_perm else None  # (for the leaf walk)
        # namespace columns of rows: code 0 = outside any namespace
        self.ns_table: list[tuple | None] = [None]
        self.ns_codes: dict[tuple | None, int] = {None: 0}
        self.ns_arrays: list[tuple[pa.Array, pa.Array]] = []
        self.units: list[Unit] = []
        self._fanouts: dict[str, tuple[int, str] | None] = {}  # fan-out folder name -> (group, hh)
        self.leaf = leaf_walk()

    def prepare(self, namespaces: list[Namespace], units: list[Unit]) -> None:
        """Number the namespaces (rows carry a code, batches a dictionary) and note per
        unit what the block fast path needs."""
        for ns in namespaces:
            cols = ns.columns()
            if cols not in self.ns_codes:
                self.ns_codes[cols] = len(self.ns_table)
                self.ns_table.append(cols)
        for u in units:
            for m in u.members:
                m.code = self.ns_codes[m.columns]
            t = u.plan.target
            u.targets_exist = t is not None and t.rank_dir in self.listing.names
        self.ns_arrays = _ns_arrays(self.ns_table)
        self.units = units

    # -- generic file rows -------------------------------------------------------------

    def _lstat(self, path: str, rel: str, out: Rows) -> os.stat_result | None:
        try:
            return os.lstat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            out.errors.append(errno_reason(exc, "cannot stat", rel))
            return None

    def entry_record(self, entry: os.DirEntry, rel: str, out: Rows) -> FileRecord | None:
        """lstat through the DirEntry (one syscall, no symlink follow); None if it vanished."""
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            rec = FileRecord(rel, None, None, None, 0, 0, 0, 0, 0)
            rec.status, rec.reason = "unreadable", errno_reason(exc, "cannot stat", rel)
            return rec
        return _record(rel, st)

    def hash_plain(self, rec: FileRecord, path: str) -> bool:
        """Hash a non-block regular file in --verify hash mode; False if it vanished."""
        if not self.hashed:
            return True
        try:
            r = read_file(path, want_hash=True)
        except Vanished:
            return False
        except OSError as exc:
            rec.status, rec.reason = "unreadable", errno_reason(exc, "cannot read", rec.relpath)
            return True
        rec.content = r.content
        return True

    def other_file(self, entry: os.DirEntry, rel: str, out: Rows, *, where: str,
                   status: str | None = None, reason: str | None = None,
                   ns_cols: tuple | None = None) -> None:
        """A file that is not a block: temp leftovers, own artifacts, foreign files."""
        rec = self.entry_record(entry, rel, out)
        if rec is None:
            return
        if rec.status == "ok":
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError:
                return
            if not stat_mod.S_ISREG(mode):
                kind = _kind_of(mode)
                rec.status = "foreign"
                if kind == "symlink":
                    try:
                        dest = os.readlink(entry.path)
                    except OSError:
                        dest = "?"
                    rec.reason = f"symlink to {dest!r} (never followed)"
                else:
                    rec.reason = f"{kind} (never opened)"
                rec.reason = f"{rec.reason}: not part of the cache"
            elif status is not None:
                rec.status, rec.reason = status, reason or status
                if not self.hash_plain(rec, entry.path):
                    return
            else:
                kind = layout.temp_kind(entry.name)
                if kind == "own":
                    rec.status, rec.reason = "own_artifact", "kvmigrate temp file"
                elif entry.name == layout.LOCK_NAME:
                    rec.status, rec.reason = "own_artifact", "kvmigrate lock file"
                elif kind is not None:
                    rec.status, rec.reason = "tmp_leftover", f"temp leftover of an interrupted write ({kind})"
                else:
                    rec.status, rec.reason = "foreign", f"unexpected file in {where}: not part of the cache"
                if not self.hash_plain(rec, entry.path):
                    return
        rec.action = "none"
        self._emit(out, rec, ns_cols)

    def _emit(self, out: Rows, rec: FileRecord, ns_cols: tuple | None) -> None:
        out.add(rec, self.ns_codes[ns_cols])

    def dir_rows(self, path: str, rel: str, out: Rows, *, status: str | None, reason: str | None,
                 ns_cols: tuple | None, where: str, shard: tuple[int, int] | None = None,
                 bucket: str | None = None) -> None:
        """Every file under a directory (no symlink follow) as non-block rows. With `shard`,
        only files whose innermost `<hhh>` ancestor belongs to this part (none: part 0)."""
        try:
            with os.scandir(path) as it:
                entries = sorted(it, key=lambda e: e.name)
        except FileNotFoundError:
            return
        except OSError as exc:
            if shard is None or _part(bucket, shard[1]) == shard[0]:
                st = self._lstat(path, rel, out)
                if st is not None:
                    rec = _record(rel, st)
                    rec.status, rec.reason = "unreadable", errno_reason(exc, "cannot list", rel)
                    self._emit(out, rec, ns_cols)
            return
        for e in entries:
            child = f"{rel}/{e.name}"
            if e.is_dir(follow_symlinks=False):
                inner = e.name if layout.BUCKET_RE.match(e.name) else bucket
                self.dir_rows(e.path, child, out, status=status, reason=reason, ns_cols=ns_cols, where=where,
                              shard=shard, bucket=inner)
            elif shard is None or _part(bucket, shard[1]) == shard[0]:
                self.other_file(e, child, out, where=where, status=status, reason=reason, ns_cols=ns_cols)

    # -- blocks --------------------------------------------------------------------------

    def bucket(self, unit: Unit, hhh: str, out: Rows) -> None:
        """Walk bucket `hhh` of every rank folder of a unit, classify, append rows to `out`.

        The plain case (a block file of a vLLM / llm-d unit in its right fan-out folder)
        goes through the compiled leaf walk when it is built (kvmigrate._leafwalk: the
        whole bucket by file descriptor, GIL released, rows appended in C), else through
        the inlined loop of `_fanout_folder`. Everything unusual goes through the general
        per-file code with a FileRecord, whichever walk found it.
        """
        blocks: dict[tuple[int, str], list[int]] = {}
        misc: list[int] = []
        leaf = self.leaf if unit.plan.family != "vllmcpp" else None
        if leaf is not None:
            verdict = partial(self._size_verdict, unit) if self._checks_size(unit) else None
            buf = _buffer()
        for mi, m in enumerate(unit.members):
            if hhh not in m.buckets:
                continue
            brel = f"{m.dirname}/{hhh}"
            bpath = f"{self.root}/{brel}"
            if m.foreign_reason:
                self.dir_rows(bpath, brel, out, status="foreign", reason=m.foreign_reason, ns_cols=m.columns,
                              where="rank folder")
                continue
            if leaf is not None:
                store = out.block_rows(leaf)
                unusual = leaf.walk_bucket(bpath, brel + "/", hhh, self.hashed, self.leaf_perm, m.code, m.rank,
                                           store, verdict, buf)
                if unusual == []:
                    continue
                store.export_blocks(blocks)  # Python rows join the blocks: after the C walk's rows so far
                if unusual is not None:
                    self._unusual(unit, mi, m, hhh, brel, bpath, unusual, out, blocks, misc)
                    continue
            fanouts = self._listing(bpath, brel, out, m.columns)  # (block rows are sorted per bucket below)
            for fe in fanouts or ():
                self._bucket_entry(unit, mi, m, hhh, brel, fe, out, blocks, misc)
        out.order.extend(misc)
        if blocks or leaf is not None:  # (the C walk files its rows' blocks in out.store)
            self._finish_blocks(unit, blocks, out)

    def _checks_size(self, unit: Unit) -> bool:
        """Are block sizes judged file by file here (the namespace has no verdict of its own)?"""
        return self.verify != "none" and unit.plan.block_status is None

    def _size_verdict(self, unit: Unit, group: int, size: int) -> tuple[str, str] | None:
        """classify.size_status of (group, size), kept per unit (a namespace has a few sizes)."""
        key = (group, size)
        try:
            return unit.size_verdicts[key]
        except KeyError:
            bad = classify.size_status(unit.plan, group, size)
            if len(unit.size_verdicts) < VERDICTS_KEPT:
                unit.size_verdicts[key] = bad
            return bad

    def _unusual(self, unit: Unit, mi: int, m: Member, hhh: str, brel: str, bpath: str,
                 unusual: list[tuple[str | None, str]], out: Rows, blocks: dict, misc: list[int]) -> None:
        """The entries the leaf walk left to Python (fan-out folder None: an entry of the
        bucket folder itself), in the order it met them (the Python walk's order), each
        listed again for its DirEntry and taken by the general code."""
        listed: dict[str | None, dict[str, os.DirEntry]] = {}
        for fanout, name in unusual:
            entries = listed.get(fanout)
            if entries is None:
                path, rel = (bpath, brel) if fanout is None else (f"{bpath}/{fanout}", f"{brel}/{fanout}")
                entries = listed[fanout] = {e.name: e for e in self._listing(path, rel, out, m.columns) or ()}
            e = entries.get(name)
            if e is None:
                continue  # gone meanwhile
            if fanout is None:
                self._bucket_entry(unit, mi, m, hhh, brel, e, out, blocks, misc)
            else:
                group, hh = self._fanout_name(fanout)  # the leaf walk took it as one
                self._fanout_folder(unit, mi, m, hhh, f"{bpath}/{fanout}", f"{brel}/{fanout}", group, hh, out,
                                    blocks, misc, files=[e])

    def _listing(self, path: str, rel: str, out: Rows, ns_cols: tuple | None) -> list[os.DirEntry] | None:
        """The entries of a folder of a rank folder; None if it vanished, or (a row saying
        so) if it cannot be listed."""
        try:
            with os.scandir(path) as it:
                return list(it)
        except FileNotFoundError:
            return None
        except OSError as exc:
            st = self._lstat(path, rel, out)
            if st is not None:
                rec = _record(rel, st)
                rec.status, rec.reason = "unreadable", errno_reason(exc, "cannot list", rel)
                self._emit(out, rec, ns_cols)
            return None

    def _fanout_name(self, name: str) -> tuple[int, str] | None:
        fan = self._fanouts.get(name)
        if fan is None:
            fan = layout.parse_fanout(name)
            if fan is not None:  # (only real fan-out names are kept: few, bounded)
                self._fanouts[name] = fan
        return fan

    def _bucket_entry(self, unit: Unit, mi: int, m: Member, hhh: str, brel: str, fe: os.DirEntry, out: Rows,
                      blocks: dict, misc: list[int]) -> None:
        """One entry of a bucket folder: a fan-out folder, or something else."""
        frel = f"{brel}/{fe.name}"
        if not fe.is_dir(follow_symlinks=False):
            self.other_file(fe, frel, out, where="bucket folder", ns_cols=m.columns)
            return
        fan = self._fanout_name(fe.name)
        if fan is None:
            self.dir_rows(fe.path, frel, out, status=None, reason=None, ns_cols=m.columns, where="bucket folder")
            return
        self._fanout_folder(unit, mi, m, hhh, fe.path, frel, fan[0], fan[1], out, blocks, misc)

    def _fanout_folder(self, unit: Unit, mi: int, m: Member, hhh: str, fpath: str, frel: str, group: int, hh: str,
                       out: Rows, blocks: dict, misc: list[int], files: list[os.DirEntry] | None = None) -> None:
        """The files of one fan-out folder (or just `files` of it).

        The hot loop of the Python walk (a block file of a vLLM / llm-d unit in its right
        fan-out folder) is inlined: one lstat through the DirEntry (or, hashing, one
        open + fstat + read), a few list appends, the size verdict from a per-unit cache.
        """
        plan = unit.plan
        fast = plan.family != "vllmcpp"
        hashed = self.hashed
        check_size = self._checks_size(unit)
        check_perm = self.check_perm
        size_verdicts = unit.size_verdicts
        block_name = layout.BLOCK_HEX_RUN
        relpaths, codes, ranks, groups = out.relpath, out.ns, out.rank, out.group
        hashes, sizes, mtimes, inodes, devs, nlinks = (out.block_hash, out.size, out.mtime_ns, out.inode, out.dev,
                                                       out.nlink)
        contents, payloads, statuses, actions, reasons, targets = (out.content, out.payload, out.status, out.action,
                                                                   out.reason, out.target)
        code, rank = m.code, m.rank
        fanout = frel.rsplit("/", 1)[1]
        prefix = hhh + hh  # a block file in its right place starts with these 5 hex
        if files is None:
            files = self._listing(fpath, frel, out, m.columns)
        for e in files or ():
            name = e.name
            bm = block_name(name) if e.is_file(follow_symlinks=False) else None
            if bm is None or bm.end(1) & 1:  # (layout.block_hex, inlined)
                rel = f"{frel}/{name}"
                if e.is_dir(follow_symlinks=False):
                    self.dir_rows(e.path, rel, out, status=None, reason=None, ns_cols=m.columns,
                                  where="fan-out folder")
                else:
                    self.other_file(e, rel, out, where="fan-out folder", ns_cols=m.columns)
                continue
            hex_hash = bm.group(1)
            rel = f"{frel}/{name}"
            misfiled = not name.startswith(prefix)
            if misfiled or not fast:
                i = self._block_file(plan, m, mi, e, rel, hhh, fanout, group, hex_hash, misfiled, out)
            else:
                status = "ok"
                reason = ""
                try:
                    if hashed:
                        r = read_file(e.path, want_hash=True)  # open + fstat + read: no lstat
                        st = r.st
                        content = r.content
                    else:
                        st = e.stat(follow_symlinks=False)
                        content = None
                except Vanished:
                    continue
                except FileNotFoundError:
                    continue
                except OSError:  # a finding: the general code words it
                    i = self._block_file(plan, m, mi, e, rel, hhh, fanout, group, hex_hash, False, out)
                else:
                    size = st.st_size
                    if hashed and (size == 0 or r.all_zero):
                        status, reason = ("short", "empty file") if size == 0 else (
                            "zero_filled", f"all {size} bytes are zero (crash residue)")
                    elif check_perm and not self._may_read(st):
                        status = "unreadable"
                        reason = (f"cannot read {rel}: [EACCES] permission denied "
                                  f"(mode {stat_mod.S_IMODE(st.st_mode):o}, owner uid {st.st_uid})")
                    elif check_size:
                        key = (group, size)
                        try:
                            bad = size_verdicts[key]
                        except KeyError:
                            bad = self._size_verdict(unit, group, size)
                        if bad is not None:
                            status, reason = bad
                    i = len(relpaths)
                    relpaths.append(rel)
                    codes.append(code)
                    ranks.append(rank)
                    groups.append(group)
                    hashes.append(bytes.fromhex(hex_hash))
                    sizes.append(size)
                    mtimes.append(st.st_mtime_ns)
                    inodes.append(st.st_ino)
                    devs.append(st.st_dev)
                    nlinks.append(st.st_nlink)
                    contents.append(content)
                    payloads.append(None)
                    statuses.append(status)
                    actions.append("none")
                    reasons.append(reason)
                    targets.append(None)
            if i is None:
                continue  # vanished
            if misfiled:
                misc.append(i)
            else:  # (not try/except KeyError: the first replica of every block would raise)
                idx = blocks.get((group, hex_hash))
                if idx is None:
                    blocks[(group, hex_hash)] = [i]
                else:
                    idx.append(i)

    def _block_file(self, plan: UnitPlan, m: Member, mi: int, e: os.DirEntry, rel: str, hhh: str, fanout: str,
                    group: int, hex_hash: str, misfiled: bool, out: Rows) -> int | None:
        """A block file through the general path (misfiled, vllm.cpp, or a stat/read
        error to word): its row index, not yet placed in the order; None if it vanished."""
        rec = self.entry_record(e, rel, out)
        if rec is None:
            return None
        rec.rank, rec.group, rec.hex, rec.member = m.rank, group, hex_hash, mi
        try:
            est = e.stat(follow_symlinks=False)  # cached by the DirEntry: no syscall
        except OSError:
            est = None
        if rec.status == "ok" and misfiled:
            rec.status = "misfiled"
            rec.reason = (f"misfiled: fan-out folders {hhh}/{fanout} do not match the file name "
                          f"(it belongs in {layout.fanout_relpath(hex_hash, group)}); never reused")
        if not self._inspect(plan, m, rec, e.path, est):
            return None
        rec.action = "none"
        return out.add(rec, m.code, emit=False)

    def _finish_blocks(self, unit: Unit, blocks: dict[tuple[int, str], list[int]], out: Rows) -> None:
        """Classify a bucket's blocks and place their rows, sorted by (group, hash).

        A block whose files are all fine by themselves gets the verdict of its shape
        (group, ranks, sizes, whether replicas differ), computed by classify once per
        unit; only the target path (and, if the target folder exists, the check of what
        is there) is per block. Other blocks are classified one by one.
        """
        plan = unit.plan
        fast = plan.family != "vllmcpp"
        count_sizes = plan.block_status is None and plan.family in ("vllm", "llmd", "ambiguous")
        shapes: dict[tuple, int] = {}
        if fast and self.leaf is not None:
            self._finish_blocks_c(unit, blocks, out, shapes if count_sizes else None)
        else:
            if out.store is not None:
                out.store.export_blocks(blocks)
            self._finish_blocks_py(unit, blocks, out, shapes if count_sizes else None)
        if shapes:
            base = unit.members[0].ns.source_base
            for (group, ranks, sizes, _), n in shapes.items():
                for rank, size in zip(ranks, sizes):
                    out.sizes[(base, rank, group)][size] += n

    def _finish_blocks_py(self, unit: Unit, blocks: dict[tuple[int, str], list[int]], out: Rows,
                          shapes: dict[tuple, int] | None) -> None:
        plan = unit.plan
        verdicts = unit.verdicts
        fast = plan.family != "vllmcpp"
        replicas = bool(plan.replicas)
        count_sizes = shapes is not None
        target = plan.target
        S, A, R, T = out.status, out.action, out.reason, out.target
        K, Z, C, P = out.rank, out.size, out.content, out.relpath
        order = out.order
        targets_exist = unit.targets_exist
        for key in sorted(blocks):
            idx = blocks[key]
            group, hex_hash = key
            order.extend(idx)
            if not fast or any([S[i] != "ok" for i in idx]):
                self._finish_one(unit, out, idx, group, hex_hash, count_sizes)
                continue
            differ = replicas and len({Z[i] if C[i] is None else C[i] for i in idx}) > 1
            shape = (group, tuple([K[i] for i in idx]), tuple([Z[i] for i in idx]), differ)
            verdict = verdicts.get(shape)
            if verdict is None:
                verdict = self._shape_verdict(unit, out, idx, group, hex_hash, shape)
            tpath = None
            for i, (status, action, reason, has_target) in zip(idx, verdict):
                S[i], A[i], R[i] = status, action, reason
                if has_target:
                    if tpath is None:  # once per block: every replica has the same target
                        tpath = classify.target_relpath(target, hex_hash, group)
                    T[i] = tpath
                    if targets_exist and tpath != P[i]:
                        self._target_exists(unit, out, i, hex_hash)
            if count_sizes:
                shapes[shape] = shapes.get(shape, 0) + 1

    def _finish_blocks_c(self, unit: Unit, blocks: dict[tuple[int, str], list[int]], out: Rows,
                         shapes: dict[tuple, int] | None) -> None:
        """_finish_blocks_py in C (kvmigrate._leafwalk.finish_blocks), with the same
        callbacks for what needs classify or I/O."""
        plan = unit.plan
        target = plan.target

        def shape_verdict(idx: list[int], group: int, hex_hash: str, shape: tuple) -> tuple:
            return self._shape_verdict(unit, out, idx, group, hex_hash, shape)

        prefix = f"{target.rank_dir}/" if target is not None else ""
        slow, check = self.leaf.finish_blocks(blocks, out.columns(), out.store, out.order, unit.verdicts, shape_verdict,
                                              bool(plan.replicas), prefix, unit.targets_exist, shapes)
        for group, hex_hash in slow:
            self._finish_one(unit, out, blocks[(group, hex_hash)], group, hex_hash, shapes is not None)
        for i, hex_hash in check:
            self._target_exists(unit, out, i, hex_hash)

    def _shape_verdict(self, unit: Unit, out: Rows, idx: list[int], group: int, hex_hash: str,
                       shape: tuple) -> tuple:
        """The verdict of a block shape, per row (status, action, reason, has a target):
        classify once, then kept for the unit."""
        recs = [out.record(i, hex_hash) for i in idx]
        self.finish_block(unit, recs, group, hex_hash, check_target=False)
        verdict = tuple((r.status, r.action, r.reason, r.target_relpath is not None) for r in recs)
        if len(unit.verdicts) < VERDICTS_KEPT:
            unit.verdicts[shape] = verdict
        return verdict

    def _target_exists(self, unit: Unit, out: Rows, i: int, hex_hash: str) -> None:
        """Row i's target path is taken (the target folder exists): what is there decides."""
        rec = out.record(i, hex_hash)
        self._check_existing_target(unit.plan, rec)
        out.set_verdict(i, rec.status, rec.action, rec.reason, rec.target_relpath)

    def _finish_one(self, unit: Unit, out: Rows, idx: list[int], group: int, hex_hash: str,
                    count_sizes: bool) -> None:
        recs = [out.record(i, hex_hash) for i in idx]
        fine = [r.status == "ok" for r in recs]
        self.finish_block(unit, recs, group, hex_hash)
        for i, r, ok in zip(idx, recs, fine):
            out.set_verdict(i, r.status, r.action, r.reason, r.target_relpath)
            if ok and count_sizes:
                out.sizes[(unit.members[0].ns.source_base, r.rank, group)][r.size] += 1

    def _inspect(self, plan: UnitPlan, m: Member, rec: FileRecord, path: str,
                 st: os.stat_result | None) -> bool:
        """File-level checks of one block file: read (header, hashes), then size rules.
        False when the file vanished meanwhile."""
        if rec.status != "ok":
            if rec.status == "misfiled" and self.hashed:
                return self.hash_plain(rec, path)
            return True
        is_cpp = plan.family == "vllmcpp" and m.ns.status == "ok" and m.ns.digest is not None
        header_len = vllmcpp.HEADER_SIZE if is_cpp and self.verify != "none" else 0
        if not (self.hashed or header_len):
            if self.verify != "none" and st is not None and not self._may_read(st):
                rec.status = "unreadable"
                rec.reason = (f"cannot read {rec.relpath}: [EACCES] permission denied "
                              f"(mode {stat_mod.S_IMODE(st.st_mode):o}, owner uid {st.st_uid})")
                return True
        else:
            try:
                r = read_file(path, want_hash=self.hashed, header_len=header_len)
            except Vanished:
                return False
            except OSError as exc:
                rec.status, rec.reason = "unreadable", errno_reason(exc, "cannot read", rec.relpath)
                return True
            st = r.st
            if st.st_ino != rec.inode or st.st_size != rec.size:
                # replaced (temp + rename) between listing and reading: report what is there now
                rec.size, rec.mtime_ns, rec.inode, rec.dev, rec.nlink = (st.st_size, st.st_mtime_ns, st.st_ino,
                                                                         st.st_dev, st.st_nlink)
            rec.content = r.content
            if is_cpp:
                rec.payload = r.payload
            if self.verify == "none":
                return True
            all_zero = r.all_zero
            if (not self.hashed and is_cpp and r.header and len(r.header) == vllmcpp.HEADER_SIZE
                    and not r.header.strip(b"\0") and rec.size <= ZERO_SCAN_MAX):
                # a zero header: is the whole file zero (crash residue)? read it to say so (not a huge
                # one: no engine writes a block that large, and a 1 TiB sparse file takes minutes)
                try:
                    all_zero = read_file(path, want_hash=True).all_zero
                except (Vanished, OSError):
                    all_zero = False
            if rec.size == 0:
                rec.status, rec.reason = "short", "empty file"
                return True
            if all_zero:
                rec.status, rec.reason = "zero_filled", f"all {rec.size} bytes are zero (crash residue)"
                return True
            if is_cpp:
                if rec.size < vllmcpp.HEADER_SIZE:
                    rec.status, rec.reason = "short", (f"{rec.size} bytes, shorter than the "
                                                       f"{vllmcpp.HEADER_SIZE}-byte header")
                    return True
                check = vllmcpp.verify_header(
                    r.header or b"", digest=m.ns.digest or b"", payload_size=plan.vllmcpp_payload or 0,
                    key=vllmcpp.make_key(bytes.fromhex(rec.hex or ""), rec.group or 0))
                if check is not None:
                    rec.status = "header_invalid"
                    rec.reason = f"header check '{check}' failed: the vllm.cpp reader deletes this file"
                    return True
        if self.verify == "none" or plan.block_status is not None:
            return True
        bad = classify.size_status(plan, rec.group or 0, rec.size)
        if bad is not None:
            rec.status, rec.reason = bad
        return True

    def _may_read(self, st: os.stat_result) -> bool:
        """Permission bits say we may open the file (no syscall: --verify size never opens
        block files, yet an unreadable file is a finding)."""
        if self._euid == 0:
            return True
        if st.st_uid == self._euid:
            return bool(st.st_mode & stat_mod.S_IRUSR)
        if st.st_gid in self._groups:
            return bool(st.st_mode & stat_mod.S_IRGRP)
        return bool(st.st_mode & stat_mod.S_IROTH)

    def finish_block(self, unit: Unit, recs: list[FileRecord], group: int, hex_hash: str, *,
                     check_target: bool = True) -> None:
        """Block rules (classify) plus the two answers that need I/O: does the target
        path already hold these bytes, and which cell sizes does a row admit."""
        plan = unit.plan
        classify.classify_block(plan, recs, group, hex_hash)
        first = next((r for r in recs if r.target_relpath), None)
        if first is None:
            return
        if first.action in ("slice", "needs_slice") and self.hashed:
            first.action, first.reason = self._slice_reason(unit, first, group) or (first.action, first.reason)
        if not check_target:
            return
        target_dir = first.target_relpath.split("/", 1)[0]
        if target_dir not in self.listing.names or first.target_relpath == first.relpath:
            return
        self._check_existing_target(plan, first)

    def _slice_reason(self, unit: Unit, first: FileRecord, group: int) -> tuple[str, str] | None:
        """Search the row's data for the cell size (kvmigrate.transforms proves it or lists
        the candidates); once per (unit, group, size): the geometry is the namespace's."""
        from kvmigrate.transforms import find_slice_cell

        plan = unit.plan
        key = (unit.index, group, first.size)
        if key in self._slice_cache:
            return self._slice_cache[key]
        data = read_all(os.path.join(self.root, first.relpath), 1 << 30)
        reason = None
        if data is not None:
            layers = plan.layers.get(group)
            known = (layers * plan.page_bytes * plan.blocks_per_file
                     if plan.page_bytes and layers and plan.blocks_per_file else None)
            search = find_slice_cell(data, n=plan.world, known_cell=known)
            if search.cell is None:
                reason = "needs_slice", search.reason
            else:
                reason = "slice", classify.slice_reason(plan.world, search.cell, f"{search.reason} in a sample row "
                                                        "of this size; each row is checked again before it is cut")
        self._slice_cache[key] = reason
        return reason

    def _check_existing_target(self, plan: UnitPlan, rec: FileRecord) -> None:
        tpath = os.path.join(self.root, rec.target_relpath or "")
        try:
            tst = os.lstat(tpath)
        except OSError:
            return
        action = rec.action
        if not stat_mod.S_ISREG(tst.st_mode):
            rec.action, rec.reason = "none", findings.reason(
                f"aliases_source: target path {rec.target_relpath} exists and is a {_kind_of(tst.st_mode)}; use "
                "--dest DIR", findings.TARGET_OCCUPIED, of_action=action, aliases_relpath=rec.target_relpath)
            rec.target_relpath = None
            return
        if (tst.st_dev, tst.st_ino) == (rec.dev, rec.inode):
            rec.action, rec.reason = "already_present", "the target path is a hard link of this file"
            return
        if action.startswith("needs_"):
            rec.reason = findings.Reason(f"{rec.reason}; the target path already exists (compared when the "
                                         "transform runs)", findings.finding_of(rec.reason))
            return
        src = os.path.join(self.root, rec.relpath)
        expected_size = rec.size
        if action == "copy_pad":
            expected_size = classify.pad_to_page(rec.size)
        same = False
        transform_digest = None
        if action in ("slice", "concat", "relayout"):
            expected_size, transform_digest = self.transform_output(self.root, plan, rec)
        if tst.st_size == expected_size:
            new_digest = plan.target.digest if plan.target else None
            want = transform_digest() if transform_digest else rec.content if action == "link" and rec.content else \
                expected_output_digest(action, src, new_digest=new_digest)
            try:
                got = read_file(tpath, want_hash=True).content
            except (Vanished, OSError):
                got = None
            same = want is not None and want == got
        if same:
            rec.action, rec.reason = "already_present", f"the target path already holds the bytes {action} would write"
        else:
            rec.action, rec.reason = "none", findings.reason(
                f"aliases_source: target path {rec.target_relpath} already exists with other bytes than {action} "
                "would write; never overwritten (use --dest DIR)", findings.TARGET_OCCUPIED, of_action=action,
                aliases_relpath=rec.target_relpath)
            rec.target_relpath = None


def _part(bucket: str | None, n: int) -> int:
    """Shard part of a bucket: int(hhh, 16) % N; files outside buckets belong to part 0."""
    if bucket is None or n <= 1:
        return 0
    return int(bucket, 16) % n


# ---------------------------------------------------------------------------------------
# Top-level rows (part 0)


def _non_bucket_rows(walker: Walker, listing: RootListing, namespaces: list[Namespace],
                     units: list[Unit], shard: tuple[int, int]) -> Rows:
    """Rows of files outside buckets: top-level files, .kvmigrate/, base folders
    (config.json, probe and config temp files), rank-folder top level, deep layouts and
    foreign folders. Everything here is part 0 (except bucket files of deep layouts)."""
    out = Rows()
    root = walker.root
    part0 = shard[0] == 0
    if part0:
        for e in listing.files:
            walker.other_file(e, e.name, out, where="the cache root")
        for d in listing.own_dirs:
            walker.dir_rows(os.path.join(root, d), d, out, status="own_artifact",
                            reason="kvmigrate journal folder", ns_cols=None, where="kvmigrate folder")
        for d in listing.foreign_dirs:
            walker.dir_rows(os.path.join(root, d), d, out, status="foreign",
                            reason="folder that is not a cache namespace: not part of the cache", ns_cols=None,
                            where="the cache root")
    for d in listing.deep_dirs:
        walker.dir_rows(os.path.join(root, d), d, out, status="unsupported_layout",
                        reason="old llm-d deep layout (<model>/block_size_*/tp_*_pp_size_*_pcp_size_*/rank_*): "
                               "out of scope", ns_cols=None, where="deep layout", shard=shard)
    for unit in units:
        for m in unit.members:
            _rank_top_level(walker, m, out, emit=part0)
    if not part0:
        return out
    cols_of = {ns.source_base: ns.columns() for ns in namespaces}
    for ns in namespaces:
        if not ns.has_base:
            continue
        base_path = os.path.join(root, ns.source_base)
        try:
            with os.scandir(base_path) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            st = walker._lstat(base_path, ns.source_base, out)
            if st is not None:
                rec = _record(ns.source_base, st)
                rec.status, rec.reason = "unreadable", errno_reason(exc, "cannot list", ns.source_base)
                walker._emit(out, rec, cols_of[ns.source_base])
            continue
        for e in entries:
            rel = f"{ns.source_base}/{e.name}"
            if e.is_dir(follow_symlinks=False):
                walker.dir_rows(e.path, rel, out, status="foreign", reason="unexpected folder in a base folder",
                                ns_cols=cols_of[ns.source_base], where="base folder")
            elif e.name == layout.CONFIG_NAME and ns.config_relpath == rel:
                _config_row(walker, ns, e, rel, out, cols_of[ns.source_base])
            else:
                walker.other_file(e, rel, out, where="base folder", ns_cols=cols_of[ns.source_base])
    return out


def _config_row(walker: Walker, ns: Namespace, entry: os.DirEntry, rel: str, out: Rows,
                ns_cols: tuple) -> None:
    rec = walker.entry_record(entry, rel, out)
    if rec is None:
        return
    if ns.status in ("config_invalid", "digest_mismatch"):
        rec.status, rec.reason = ns.status, ns.status_reason
    elif ns.status == "unsupported_layout":
        rec.reason = f"identity proved, but the namespace is out of scope: {ns.status_reason}"
    else:
        parts = [f"identity of {ns.source_base} ({ns.family}, {ns.scheme}); digest proved"]
        if ns.target_error:
            parts.append(ns.target_error)
        parts.extend(ns.notes)
        rec.reason = "; ".join(parts)
    if walker.hashed and ns.config_raw is not None:
        rec.content = xxhash.xxh3_128_digest(ns.config_raw)
    walker._emit(out, rec, ns_cols)


def _rank_top_level(walker: Walker, m: Member, out: Rows, *, emit: bool) -> None:
    """List a rank folder's top level once: its bucket names for the walk (every shard)
    and, in part 0, rows for anything else in it."""
    path = os.path.join(walker.root, m.dirname)
    try:
        with os.scandir(path) as it:
            entries = sorted(it, key=lambda e: e.name)
    except FileNotFoundError:
        return
    except OSError as exc:
        st = walker._lstat(path, m.dirname, out) if emit else None
        if st is not None:
            rec = _record(m.dirname, st)
            rec.status, rec.reason = "unreadable", errno_reason(exc, "cannot list", m.dirname)
            walker._emit(out, rec, m.columns)
        return
    for e in entries:
        if e.is_dir(follow_symlinks=False) and layout.BUCKET_RE.match(e.name):
            m.buckets.add(e.name)
            continue
        if not emit:
            continue
        rel = f"{m.dirname}/{e.name}"
        if e.is_dir(follow_symlinks=False):
            walker.dir_rows(e.path, rel, out, status="foreign", reason="unexpected folder in a rank folder",
                            ns_cols=m.columns, where="rank folder")
        else:
            walker.other_file(e, rel, out, where="rank folder", ns_cols=m.columns)


# ---------------------------------------------------------------------------------------
# Progress


class Progress:
    """tqdm on stderr (files, bytes, rate); silent when stderr is not a TTY or -q."""

    def __init__(self, enabled: bool):
        self.bar = None
        self.bytes = 0
        self.t0 = time.monotonic()
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(unit=" files", file=sys.stderr, desc="scan", dynamic_ncols=True, leave=True)

    def update(self, files: int, nbytes: int) -> None:
        self.bytes += nbytes
        if self.bar is not None:
            self.bar.update(files)
            dt = max(time.monotonic() - self.t0, 1e-6)
            self.bar.set_postfix_str(f"{human_bytes(self.bytes)}, {human_bytes(self.bytes / dt)}/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------
# The scan


def scan(root: str | os.PathLike[str], output: str | os.PathLike[str] = "kvmigrate-manifest.parquet", *,
         transform_output: Callable[[str, UnitPlan, FileRecord], tuple[int, Callable[[], bytes | None]]],
         batch_sink: Callable[[dict[str, Any]], Any] | None = None,
         target: str = DEFAULT_PROFILE, facts_resolver: FactsResolver | None = None, verify: str = "size",
         threads: int | None = None, shard: tuple[int, int] = (0, 1), progress: bool = False,
         command: str | None = None, workers: int | None = None) -> WalkResult:
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
    """
    if verify not in ("none", "size", "hash"):
        raise UsageError(f"--verify must be none, size or hash, got {verify!r}")
    k, n = shard
    if not (n >= 1 and 0 <= k < n):
        raise UsageError(f"--shard needs 0 <= K < N, got {k}/{n}")
    if workers is not None and workers < 1:
        raise UsageError(f"--workers must be at least 1, got {workers}")
    t0 = time.monotonic()
    root_path = check_root(str(root))
    resolver = facts_resolver or FactsResolver({}, None)
    output = os.path.abspath(output)
    if os.path.isdir(output):
        raise UsageError("the manifest path is a directory", path=output,
                         hint="pass -o FILE.parquet (a dataset directory is written by --run-on ray)")

    try:
        listing = list_root(root_path)
    except OSError as exc:
        raise OperationalError(f"cannot list the cache root: {exc.strerror}", path=root_path) from None
    namespaces = resolve_namespaces(root_path, listing, resolver, target)
    units = build_units(root_path, namespaces, verify == "hash", target)
    walker = Walker(root_path, verify=verify, listing=listing, transform_output=transform_output)
    walker.prepare(namespaces, units)

    meta = {
        "tool_version": __version__,
        "command": command or "kvmigrate scan " + shlex.quote(str(root)),
        "root": root_path,
        "target_profile": target,
        "verify": verify,
        "shard": f"{k}/{n}",
        "facts": {"flags": _jsonable(resolver.flags), "facts_file": resolver.facts_file},
        "namespaces": {ns.source_base: ns.metadata() for ns in namespaces},
        "walk_errors": [],  # a walk with errors rewrites the metadata (see _finalize)
        "walk_failed": False,
    }
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    _lean_arrow_allocator()
    head = _non_bucket_rows(walker, listing, namespaces, units, shard)  # also lists every unit's buckets
    tasks = _tasks(units, k, n)
    workers, threads = _parallelism(workers, threads, verify, sum(len(b) for _, b in tasks))
    with _terminate_as_interrupt():
        return _write(walker, units, head, tasks, workers, threads, meta, output, progress, root_path, t0,
                      batch_sink)


def _write(walker: Walker, units: list[Unit], head: Rows, tasks: list[tuple[int, list[str]]], workers: int,
           threads: int, meta: dict[str, Any], output: str, progress: bool, root_path: str,
           t0: float, batch_sink: Callable[[dict[str, Any]], Any] | None) -> WalkResult:
    """Walk the tasks and write the manifest."""
    sizes: dict[tuple[str, int, int], Counter] = defaultdict(Counter)
    errors: list[str] = []
    files = nbytes = 0
    rewritten = False
    with _walk(walker, tasks, workers, threads) as batches:  # forks the workers first
        totals = batch_sink(meta) if batch_sink else None  # e.g. the summary, aggregated as batches are written
        bar = Progress(progress)
        writer = manifest.ManifestWriter(output, meta)
        try:
            pending: list[pa.Table] = []
            pending_rows = 0

            def take(table: pa.Table, task_sizes: dict, task_errors: list[str]) -> None:
                nonlocal files, nbytes, pending_rows
                for key, cnt in task_sizes.items():
                    sizes[key].update(cnt)
                errors.extend(task_errors)
                rows = table.num_rows
                size = pc.sum(table["size"]).as_py() or 0 if rows else 0
                files += rows
                nbytes += size
                bar.update(rows, size)
                if rows:
                    pending.append(table)
                    pending_rows += rows
                if pending_rows >= BATCH_ROWS:
                    flush()

            def flush() -> None:
                nonlocal pending, pending_rows
                if pending_rows:
                    table = pa.concat_tables(pending).unify_dictionaries()
                    writer.write(table)
                    if totals is not None:
                        for batch in table.combine_chunks().to_batches():
                            totals.add(batch)
                pending, pending_rows = [], 0

            take(head.table(walker.ns_arrays), head.sizes, head.errors)
            for table, task_sizes, task_errors in batches:
                take(table, task_sizes, task_errors)
            flush()
            bar.close()
            rewritten = _finalize(writer, meta, walker, units, sizes, errors)
        except BaseException:
            writer.abort()
            bar.close()
            raise
    pa.default_memory_pool().release_unused()
    return WalkResult(root_path, output, files, nbytes, time.monotonic() - t0, errors,
                      None if rewritten else totals)


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


def _tasks(units: list[Unit], k: int, n: int) -> list[tuple[int, list[str]]]:
    """(unit index, a run of its buckets in sorted order) in the order rows are written."""
    tasks = []
    for u in units:
        names = [b for b in u.bucket_names() if _part(b, n) == k]
        for i in range(0, len(names), TASK_BUCKETS):
            tasks.append((u.index, names[i:i + TASK_BUCKETS]))
    return tasks


def _parallelism(workers: int | None, threads: int | None, verify: str, buckets: int) -> tuple[int, int]:
    """(processes, threads per process). CPU parallelism comes from processes (the rows are
    Python work); threads overlap waits for the disk. The compiled leaf walk waits without
    the GIL: on a cold 1M-file tree (a real cache is not in page cache) four threads per
    process scanned 1.7x (--verify size) and 1.5x (hash) faster than one and two, and within
    5% on a warm one. The Python walk holds the GIL between system calls: there threads cost
    more in hand-overs on a warm tree than they win (hashing large files releases it: two).
    `threads` (--threads) is the number of walkers in all."""
    cpus = _cpus()
    if workers is None:
        workers = cpus if cpus > 1 and buckets >= PARALLEL_MIN_BUCKETS else 1
        if threads is not None:  # --threads N: N walkers in all (--threads 1: one process, one thread)
            workers = min(workers, threads)
    if threads is None:
        per_process = LEAF_THREADS if leaf_walk() is not None else 2 if verify == "hash" else 1
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


class _walk:
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
            global _WORKER_WALKER, _WORKER_THREADS, _WORKER_PARENT
            _WORKER_WALKER, _WORKER_THREADS, _WORKER_PARENT = self.walker, self.threads, os.getpid()
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
        global _WORKER_WALKER
        if self.pool is not None:
            for f in self.inflight:
                f.cancel()
            self.pool.shutdown(wait=True, cancel_futures=True)
        _WORKER_WALKER = None


_WORKER_WALKER: Walker | None = None  # set in the parent just before the fork
_WORKER_THREADS = 1
_WORKER_POOL: ThreadPoolExecutor | None = None


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
    if os.getppid() != _WORKER_PARENT:  # the parent died before prctl
        os._exit(1)


_PR_SET_PDEATHSIG = 1
_WORKER_PARENT = 0


def _worker_task(unit_index: int, buckets: list[str]) -> tuple[bytes, dict, list[str]]:
    """Run in a worker process: walk the buckets, return the rows as an Arrow IPC stream."""
    global _WORKER_POOL
    walker = _WORKER_WALKER
    assert walker is not None
    if _WORKER_THREADS > 1 and _WORKER_POOL is None:
        _WORKER_POOL = ThreadPoolExecutor(_WORKER_THREADS, thread_name_prefix="kvmigrate-scan")
    rows = walk_task(walker, unit_index, buckets, _WORKER_THREADS, _WORKER_POOL)
    table = rows.table(walker.ns_arrays)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes(), dict(rows.sizes), rows.errors


def _outliers(walker: Walker, units: list[Unit], sizes: dict[tuple[str, int, int], Counter]
              ) -> dict[tuple[str, int, int], tuple[set[int], str]]:
    """Sizes that are off in their (namespace, rank, group), with the reason."""
    outliers: dict[tuple[str, int, int], tuple[set[int], str]] = {}
    if walker.verify == "none":
        return outliers
    samples = {m.ns.source_base: m.ns.size_sample for u in units for m in u.members}
    for key, cnt in sizes.items():
        # the shard-independent sample joins the vote, so every --shard part judges alike
        combined = cnt + samples.get(key[0], {}).get((key[1], key[2]), Counter())
        if len(combined) > 1:
            off, why = classify.majority_size(combined)
            if off & set(cnt):
                outliers[key] = (off, why)
    return outliers


def _finalize(writer: manifest.ManifestWriter, meta: dict[str, Any], walker: Walker, units: list[Unit],
              sizes: dict[tuple[str, int, int], Counter], errors: list[str]) -> bool:
    """Close the manifest. Rarely it needs a second pass: blocks with an odd size for
    their (namespace, rank, group) get `size_mismatch` and are classified again, and walk
    errors go into the metadata (the Parquet footer holds it): the written rows are
    then copied into a new manifest with those fixes. True when rows changed."""
    outliers = _outliers(walker, units, sizes)
    if not outliers and not errors:
        writer.close()
        return False
    meta["walk_errors"] = errors[:1000]
    meta["walk_failed"] = bool(errors)
    writer._writer.close()
    stage = f"{writer.path}.stage.kvmigrate-{os.getpid()}.tmp"
    os.replace(writer.tmp, stage)
    try:
        unit_of: dict[str, tuple[Unit, int]] = {}
        for u in units:
            for i, m in enumerate(u.members):
                unit_of.setdefault(m.ns.source_base, (u, i))
        member_of = {(u.index, m.rank, m.ns.source_base): i for u in units for i, m in enumerate(u.members)}
        pf = pq.ParquetFile(stage)
        with manifest.ManifestWriter(writer.path, meta) as out:
            for i in range(pf.num_row_groups):
                t = pf.read_row_group(i)
                if outliers:
                    t = _fix_sizes(t, outliers, walker, unit_of, member_of, units)
                out.write(t)
    finally:
        try:
            os.unlink(stage)
        except FileNotFoundError:
            pass
    return bool(outliers)


def _file_level(status: str | None, reason: str | None) -> tuple[str, str]:
    """The state a row's file showed by itself, before block rules (see FILE_LEVEL_STATUSES)."""
    if status in FILE_LEVEL_STATUSES:
        return status, reason or status
    return "ok", ""


def _fix_sizes(t: pa.Table, outliers: dict, walker: Walker, unit_of: dict, member_of: dict,
               units: list[Unit]) -> pa.Table:
    bases = pa.array(sorted({k[0] for k in outliers}), pa.string())
    hit = pc.fill_null(pc.is_in(t["source_base"].cast(pa.string()), value_set=bases), False)
    if not pc.any(hit).as_py():
        return t
    sb = t["source_base"].to_pylist()
    rk = t["rank"].to_pylist()
    gr = t["group"].to_pylist()
    sz = t["size"].to_pylist()
    bh = t["block_hash"].to_pylist()
    st = t["status"].to_pylist()
    rs = t["reason"].to_pylist()
    ist = [_file_level(a, b)[0] for a, b in zip(st, rs)]
    affected: set[tuple[str, int, bytes]] = set()
    for i in range(t.num_rows):
        if bh[i] is None or ist[i] != "ok":
            continue
        o = outliers.get((sb[i], rk[i], gr[i]))
        if o is not None and sz[i] in o[0]:
            affected.add((unit_of[sb[i]][0].index, gr[i], bh[i]))
    if not affected:
        return t
    idx_by_block: dict[tuple, list[int]] = defaultdict(list)
    for i in range(t.num_rows):
        if bh[i] is not None and sb[i] in unit_of:
            key = (unit_of[sb[i]][0].index, gr[i], bh[i])
            if key in affected:
                idx_by_block[key].append(i)
    cols = {n: t[n].to_pylist() for n in ("status", "action", "reason", "target_relpath", "relpath",
                                          "mtime_ns", "inode", "dev", "nlink", "content_xxh3_128",
                                          "payload_xxh3_128")}
    units_by_index = {u.index: u for u in units}
    refound: dict[int, findings.Finding | None] = {}
    for (uidx, group, bhash), rows in idx_by_block.items():
        unit = units_by_index[uidx]
        recs = []
        for i in rows:
            istatus, ireason = _file_level(st[i], rs[i])
            r = FileRecord(cols["relpath"][i], rk[i], group, bhash.hex(), sz[i], cols["mtime_ns"][i],
                           cols["inode"][i], cols["dev"][i], cols["nlink"][i],
                           member=member_of.get((uidx, rk[i], sb[i]), 0),
                           content=cols["content_xxh3_128"][i], payload=cols["payload_xxh3_128"][i],
                           status=istatus, reason=ireason)
            o = outliers.get((sb[i], rk[i], group))
            if r.status == "ok" and o is not None and r.size in o[0]:
                r.status = "size_mismatch"
                r.reason = f"size {r.size} differs from the rest of its (namespace, rank, group): {o[1]}"
            recs.append(r)
        walker.finish_block(unit, recs, group, bhash.hex())
        for i, r in zip(rows, recs):
            cols["status"][i], cols["action"][i] = r.status, r.action
            cols["reason"][i], cols["target_relpath"][i] = r.reason, r.target_relpath
            refound[i] = findings.finding_of(r.reason)
    # the finding columns: the new reasons' findings on the rows classified again
    found = [tuple(v) for v in zip(*(t[n].to_pylist() for n in findings.COLUMNS))]
    for i, f in refound.items():
        found[i] = f
    for name, array in zip(findings.COLUMNS, findings.arrays(
            [None if f is None or f[0] is None else findings.Finding(*f) for f in found])):
        t = t.set_column(t.schema.get_field_index(name), name, array)
    for name in ("status", "action", "reason"):
        t = t.set_column(t.schema.get_field_index(name), name, _utf8_safe(cols[name]).dictionary_encode())
    t = t.set_column(t.schema.get_field_index("target_relpath"), "target_relpath", _utf8_safe(cols["target_relpath"]))
    return t
