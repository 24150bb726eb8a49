"""The rows of tier directories (spec lmcache.md §1, §4): every file under a tier the
roots phase recognised (scan/tiers.py) is stat-ed and its first bytes read (the whole
file with --verify hash, or when its first bytes are all zero), then the tier's family
groups the files into deployments and gives each its status (`classify_tier`). Each
deployment is a `Namespace` without base or rank folders; the files of no deployment
(temps, foreign files, sub-folders outside the tier's layout) belong to the tier's own
namespace `lmcache:<tier>`. The rows are written in part 0, with the flat families'
(scan/flat.py `rows` asks every namespace's `flat_rows`)."""

from __future__ import annotations

import heapq
import operator
import os
import stat as stat_mod
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import pyarrow as pa
import xxhash

from kvmigrate import scratch
from kvmigrate.fsio import CHUNK, errno_reason, kind_of, open_noatime
from kvmigrate.identity.facts import Facts, FactsResolver
from kvmigrate.scan import tier_spill as S
from kvmigrate.scan.flat_spill import NAMES_BATCH, PageNames
from kvmigrate.scan.roots import Namespace, RootListing
from kvmigrate.scan.rows import RecordRows, rows_of
from kvmigrate.scan.tiers import gds_folder

HEAD_BYTES = 8192
BATCH_ROWS = 8192  # rows of a deployment made into one table at a time
# header bytes before the payload, by suffix: GDS data (4096), fs `.data` (28 when the tier has headers)
_GDS_HEADER = 4096
_FS_HEADER = 28


def resolve(root: str, listing: RootListing, resolver: FactsResolver, profile: str, verify: str) -> list[Namespace]:
    """The namespaces (deployments, and each tier's own) of every tier of the root."""
    out: list[Namespace] = []
    tiers: list[tuple[str, Any, list[os.DirEntry] | None]] = [(name, fam, None) for name, fam in
                                                              sorted(listing.tiers.items())]
    if listing.root_tier is not None:
        fam, entries = listing.root_tier
        tiers.insert(0, (".", fam, entries))
    for tier, fam, claimed in tiers:
        tmp_dir = resolver.for_tier(tier, None).tmp_dir  # the tier's temp folder (§1.4)

        def facts_for(model: str, backend: str, tier: str = tier, fam: Any = fam) -> Facts:
            match = fam.facts_key_matches(backend)
            return resolver.for_tier(tier, model, match)

        folder = S.SPILL.folder()
        with S.SPILL.writing(folder):
            deps, loose, runs = _judge_tier(root, fam, tier, claimed, verify, tmp_dir, facts_for, folder)
        for dep in deps:
            ns = _namespace(fam, dep.label, dep.model, profile)
            ns.scheme, ns.model_name = dep.scheme, dep.model
            ns.family_evidence = [f"file names of LMCache {dep.backend} chunks ({dep.scheme}) in tier {tier}"]
            ns.notes = list(dep.notes)
            ns.fields = {"family": fam.name, "scheme": dep.scheme, "tier": tier, "backend": dep.backend,
                         "model": dep.model, "ws": dep.ws, "dtype": dep.dtype, "group": dep.group,
                         "kv_kind": dep.kv_kind, "deployment": dep.label, "fs_header": dep.fs_header,
                         "needs_facts": sorted(dep.needs), **dep.plan_fields, **fam.deployment_meta(dep, profile)}
            if dep.side is not None:
                ns.fields["target_label"] = fam.target_label_of(dep)
            ns.facts = dep.facts
            ns.target = fam.target(ns.fields, Facts(), profile)
            ns.flat_rows = _SpilledRows(runs, dep.label)
            out.append(ns)
        if loose:
            label = fam.tier_label(tier)
            ns = _namespace(fam, label, None, profile)
            ns.family_evidence = [f"tier directory {tier}: files of no LMCache deployment"]
            ns.fields = {"family": fam.name, "tier": tier, "deployment": label}
            ns.flat_rows = _TierRows(loose)
            out.append(ns)
    return out


def _judge_tier(root: str, fam: Any, tier: str, claimed: list[os.DirEntry] | None, verify: str,
                tmp_dir: str | None, facts_for: Any, folder: scratch.Folder) -> tuple[list[Any], list[Any], S.Runs]:
    """A tier's deployments, its files of no deployment and the runs of its judged chunk
    files: the walk spills each chunk file to the tier's folder as it reads it
    (scan/tier_spill.py), the family's `TierJudge` folds what deployments need of all of them,
    then judges and plans them a partition of chunk hashes at a time."""
    judge = fam.tier_judge(tier, facts_for=facts_for, root=root)
    spill = S.FileSpill(folder)
    outside = _walk_tier(root, fam.tier_file_type, tier, claimed, verify, tmp_dir, _Judged(judge, spill))
    judge.settle()
    spill.partition()
    for ordinals, files in spill.partitions():
        judge.judge(ordinals, files)
    judge.decide()
    runs = S.Runs(folder)
    for _, files in spill.partitions():
        judge.finish(files)
        _payload_columns(judge.deps.values(), files)
        runs.write(files)
    spill.remove()
    deps, loose = judge.result()
    return deps, loose + outside, runs


class _Judged:
    """Where the walk puts a file of the tier's layout: the judge's folds, then the spill
    (a chunk file) or the judge's loose files."""

    def __init__(self, judge: Any, spill: S.FileSpill) -> None:
        self.judge, self.spill = judge, spill

    def append(self, f: Any) -> None:
        if self.judge.add(f):
            self.spill.append(f)


def _namespace(fam: Any, label: str, model: str | None, profile: str) -> Namespace:
    ns = Namespace(label, model or "", "", has_base=False)
    ns.family = fam.name
    ns.deployment = label
    return ns


def _payload_columns(deps: Iterable[Any], files: list[Any]) -> None:
    """payload_xxh3_128 only after a header the verdicts proved (fs with header, GDS data)."""
    bare = {dep.label for dep in deps if dep.backend == "fs" and not dep.fs_header or
            dep.backend in ("local_disk", "mp")}
    for f in files:
        if f.deployment in bare:
            f.payload = None


def _walk_tier(root: str, TierFile: Any, tier: str, entries: list[os.DirEntry] | None, verify: str,
               tmp_dir: str | None, files: Any) -> list[Any]:
    """The files under folders outside the tier's layout; each file of its layout goes to
    `files.append` in walk order. `entries`: the root tier's claimed top-level entries (None:
    every entry of the folder `tier`); `TierFile`: the family's record of a file; `tmp_dir`:
    the temp folder a fact names."""
    prefix = "" if tier == "." else f"{tier}/"
    outside: list[Any] = []
    listed: Iterable[Any] | None = entries
    if listed is None:
        listed = _top_listing(TierFile, os.path.join(root, tier), tier, outside)
        if listed is None:
            return outside
    for e in listed:
        rel = prefix + e.name
        if e.is_dir(follow_symlinks=False):
            if gds_folder(e.name):
                _gds_level(root, TierFile, e.path, rel, (e.name,), verify, files, outside)
            elif e.name == tmp_dir:
                _tmp_tree(TierFile, e.path, rel, outside)
            else:
                _foreign_tree(TierFile, e.path, rel, outside, "folder outside the LMCache tier layout")
            continue
        f = _read(TierFile, e.path, rel, e.name, (), verify)
        if f is not None:
            files.append(f)
    return outside


class _Entry(NamedTuple):
    """A tier folder's file as its listing's runs give it back (`_top_listing`)."""

    name: str
    path: str

    def is_dir(self, follow_symlinks: bool = False) -> bool:
        return False


def _top_listing(TierFile: Any, path: str, rel: str, outside: list[Any]) -> Iterable[Any] | None:
    """A tier folder's entries by name, as `_listing`'s, its files' names sorted in runs on
    disk (flat_spill.PageNames): an fs tier keeps every chunk at its top, and 10M entries
    held at once took ~300 bytes each."""
    names = PageNames(S.SPILL)
    folders: list[os.DirEntry] = []
    try:
        with os.scandir(path) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    folders.append(e)
                else:
                    names.add(e.name)
    except OSError as exc:
        outside.append(_error_file(TierFile, path, rel, errno_reason(exc, "cannot list", rel)))
        return None
    names.finish()
    files = (_Entry(n, os.path.join(path, n)) for chunk in names.chunks(NAMES_BATCH) for n in chunk)
    return heapq.merge(sorted(folders, key=_name), files, key=_name)


_name = operator.attrgetter("name")


def _listing(TierFile: Any, path: str, rel: str, outside: list[Any]) -> list[os.DirEntry] | None:
    """A folder's entries by name; None (and an unreadable row for it) when it cannot be listed."""
    try:
        with os.scandir(path) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError as exc:
        outside.append(_error_file(TierFile, path, rel, errno_reason(exc, "cannot list", rel)))
        return None


def _gds_level(root: str, TierFile: Any, path: str, rel: str, folders: tuple[str, ...], verify: str,
               files: Any, outside: list[Any]) -> None:
    entries = _listing(TierFile, path, rel, outside)
    for e in entries or ():
        child = f"{rel}/{e.name}"
        if e.is_dir(follow_symlinks=False):
            if len(folders) == 1 and gds_folder(e.name):
                _gds_level(root, TierFile, e.path, child, folders + (e.name,), verify, files, outside)
            else:
                _foreign_tree(TierFile, e.path, child, outside, "folder outside the LMCache tier layout")
            continue
        f = _read(TierFile, e.path, child, e.name, folders, verify)
        if f is not None:
            files.append(f)


def _foreign_tree(TierFile: Any, path: str, rel: str, outside: list[Any], reason: str) -> None:
    """Every file under a folder outside the tier's layout: foreign (§1.1), never followed."""
    entries = _listing(TierFile, path, rel, outside)
    for e in entries or ():
        child = f"{rel}/{e.name}"
        if e.is_dir(follow_symlinks=False):
            _foreign_tree(TierFile, e.path, child, outside, reason)
            continue
        f = _read(TierFile, e.path, child, e.name, (), "none")
        if f is not None:
            f.status, f.action = "foreign", "none"
            f.reason = (f"{f.kind} (never followed): not part of the cache" if not f.regular else
                        f"{reason}: not part of the cache")
            outside.append(f)


def _tmp_tree(TierFile: Any, path: str, rel: str, outside: list[Any]) -> None:
    """The files of the tier's temp folder (the `tmp_dir` fact, §1.4): tmp_leftover, never
    reused; a symlink or a deeper folder's files stay foreign."""
    entries = _listing(TierFile, path, rel, outside)
    for e in entries or ():
        child = f"{rel}/{e.name}"
        if e.is_dir(follow_symlinks=False):
            _foreign_tree(TierFile, e.path, child, outside, "folder inside the tier's temp folder")
            continue
        f = _read(TierFile, e.path, child, e.name, (), "none")
        if f is None:
            continue
        f.action = "none"
        if f.regular:
            f.status = "tmp_leftover"
            f.reason = f"temp leftover in the tier's temp folder {rel} (tmp_dir): never read by the engine"
        else:
            f.status, f.reason = "foreign", f"{f.kind} (never followed): not part of the cache"
        outside.append(f)


def _error_file(TierFile: Any, path: str, rel: str, reason: str) -> Any:
    try:
        st = os.lstat(path)
        f = TierFile(rel, os.path.basename(path), (), 0, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_nlink,
                     st.st_ctime_ns)
    except OSError:
        f = TierFile(rel, os.path.basename(path), (), 0)
    f.status, f.action, f.reason, f.error = "unreadable", "none", reason, reason
    return f


def _read(TierFile: Any, path: str, rel: str, name: str, folders: tuple[str, ...], verify: str) -> Any:
    """A file's record: its stat, and (verify size/hash) its first bytes, whether every byte
    is zero where those are, and with --verify hash its XXH3-128 (and its payload's after a
    GDS or fs header). None: it vanished."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        f = TierFile(rel, name, folders, 0)
        f.error = errno_reason(exc, "cannot stat", rel)
        return f
    f = TierFile(rel, name, folders, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_nlink, st.st_ctime_ns)
    if not stat_mod.S_ISREG(st.st_mode):
        f.regular = False
        f.kind = kind_of(st.st_mode)
        return f
    if verify == "none" or st.st_size == 0:
        if st.st_size == 0:
            f.head, f.all_zero = b"", False
        return f
    hashed = verify == "hash"
    skip = _GDS_HEADER if name.endswith((".kvcache.safetensors", ".weka1")) else _FS_HEADER if name.endswith(
        ".data") else None
    try:
        fd = open_noatime(path)
    except OSError as exc:
        f.error = errno_reason(exc, "cannot read", rel)
        return f
    try:
        head = b""
        whole = xxhash.xxh3_128() if hashed else None
        after = xxhash.xxh3_128() if hashed and skip is not None else None
        zero = True
        pos = 0
        while True:
            want = HEAD_BYTES - len(head) if len(head) < HEAD_BYTES else CHUNK
            b = os.read(fd, want)
            if not b:
                break
            if len(head) < HEAD_BYTES:
                head += b
            if zero and any(b):
                zero = False
            if whole is not None:
                whole.update(b)
            if after is not None and skip is not None and pos + len(b) > skip:
                after.update(b[max(0, skip - pos):])
            pos += len(b)
            if not hashed and len(head) >= HEAD_BYTES and not zero:
                break  # the head decides; the rest is read only to hash or to prove all zero
            if pos >= st.st_size:
                break  # (its size as stat-ed: no read only to meet the end; a file grown since is the apply's to see)
    except OSError as exc:
        f.error = errno_reason(exc, "cannot read", rel)
        return f
    finally:
        os.close(fd)
    f.head = head
    f.all_zero = zero
    if whole is not None:
        f.content = whole.digest()
        f.payload = after.digest() if after is not None and pos > (skip or 0) else None
    return f


class _TierRows(RecordRows):
    """A tier namespace's rows: its files' records, as one table when written."""


class _SpilledRows:
    """A deployment's rows read back from its tier's runs, in relpath order, in batches of
    BATCH_ROWS (the runs' folder goes with the last namespace that holds them)."""

    def __init__(self, runs: S.Runs, label: str) -> None:
        self.runs, self.label = runs, label

    def __bool__(self) -> bool:
        return bool(self.runs.counts.get(self.label))

    def tables(self, code: int, ns_arrays: list) -> Iterator[pa.Table]:
        batch: list[Any] = []
        for f in self.runs.rows(self.label):
            batch.append(f)
            if len(batch) == BATCH_ROWS:
                yield rows_of(batch, code).table(ns_arrays)
                batch = []
        if batch:
            yield rows_of(batch, code).table(ns_arrays)
