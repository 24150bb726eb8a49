"""The files of a flat family (docs/families.md §3): one directory whose file names are
the identity (SGLang HiCache, docs/sglang.md). The roots phase sorts the claimed page
names of the cache root here (`RootListing.flat`); `resolve` reads what the names and
the facts need (size, the first bytes the family asks for, the hash with --verify hash)
and lets the family group them into deployments, each a `Namespace` of its own (no base
folder); `rows` writes their rows in part 0 (no buckets to shard).

A HiCache directory holds a million pages in one folder, so this path keeps per file
only what the family's verdicts need: the name, its `FlatFile` and the stat columns
(five int64 a file, filled by the compiled `stat_flat`, by file descriptor with the GIL
released, in a few threads), and writes the rows in batches of Arrow columns
(`rows`), never one Python record a file. A file the C side does not take (not plain,
not ASCII, vanished, or no C extension, KVMIGRATE_PURE_PYTHON=1) is read here in Python,
which words what it is."""

from __future__ import annotations

import gc
import os
import stat as stat_mod
from array import array
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import pyarrow as pa

from kvmigrate import families, pacing
from kvmigrate.classify import FileRecord
from kvmigrate.fsio import Vanished, errno_reason, read_file
from kvmigrate.identity.facts import FactsResolver
from kvmigrate.layout import BUCKET_RE
from kvmigrate.scan.baseline import Baseline
from kvmigrate.scan.roots import Namespace, RootListing
from kvmigrate.scan.rows import Rows

HEAD_BYTES = 4  # enough for a zip magic
BATCH_ROWS = 32_768  # rows of one Arrow batch (scan/run.py writes a row group from 32,768 rows on)
CHUNK_NAMES = 8_192  # names per stat_flat call (threads take chunks)
_STAT_FIELDS = 6  # size, mtime_ns, inode, dev, nlink, ctime_ns


class FlatFiles:
    """The page files of one family in the root, in name order: their names and stat
    columns (`stats[k][i]`, k in size, mtime_ns, inode, dev, nlink, ctime_ns), plus the
    records of the few files Python read (`records[i]`: a status, reason or head of their
    own) and, with --baseline, which pages kept the baseline's hash (`carried[i]`)."""

    def __init__(self, root: str, names: list[str]) -> None:
        self.root = root
        self.names = names
        self.stats = [array("q") for _ in range(_STAT_FIELDS)]
        self.records: dict[int, FileRecord] = {}
        self.carried: bytearray | None = None

    def set_stat(self, i: int, rec: FileRecord) -> None:
        for col, value in zip(self.stats, (rec.size, rec.mtime_ns, rec.inode, rec.dev, rec.nlink, rec.ctime_ns or 0)):
            col[i] = value

    def arrow_stats(self) -> list[pa.Array]:
        """The stat columns as Arrow arrays of the manifest's types (no copy but nlink's)."""
        n = len(self.names)
        arrays = [pa.Array.from_buffers(typ, n, [None, pa.py_buffer(col)])
                  for typ, col in zip((pa.int64(), pa.int64(), pa.uint64(), pa.uint64(), pa.int64(), pa.int64()),
                                      self.stats)]
        arrays[4] = arrays[4].cast(pa.uint32())
        return arrays


def resolve(root: str, listing: RootListing, resolver: FactsResolver, profile: str, verify: str,
            baseline: Baseline | None = None) -> list[Namespace]:
    """The namespaces (deployments) of every flat family's files in the root (`baseline`:
    --baseline, a hash scan's pages that did not change keep its hashes unopened)."""
    listing.flat_temp_cols = temp_columns(listing, resolver)
    if not listing.flat:
        return []
    with _gc_paused():
        out = _resolve(root, listing, resolver, profile, verify, baseline if verify == "hash" else None)
    gc.freeze()  # (what the pages hold lives until their rows are written: `rows` unfreezes)
    return out


class _gc_paused:
    """No cyclic garbage collection while a million page records are made (none of them is
    in a cycle): with it, 17% of a 100,000-page scan's CPU time went to full collections
    that traverse every record made so far."""

    def __enter__(self) -> None:
        self.enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            gc.enable()


def _resolve(root: str, listing: RootListing, resolver: FactsResolver, profile: str, verify: str,
             baseline: Baseline | None) -> list[Namespace]:
    out: list[Namespace] = []
    for name, pages in sorted(listing.flat.items()):
        fam = families.get(name)
        files = FlatFiles(root, pages)
        flat_files = (_stat_pages(fam, files, verify, listing) if baseline is None else
                      _stat_against_baseline(fam, files, baseline, listing))
        deployments = fam.discover(flat_files, _facts_for(fam, resolver))
        del flat_files  # (the deployments hold them)
        names = listing.names
        for dep in deployments:
            ns = Namespace(dep.label, dep.model or "", "", has_base=False)
            ns.family = fam.name
            ns.family_evidence = [f"file names of the {fam.title} ({dep.scheme}): <hash64>[.pool]<suffix>.bin"]
            ns.scheme, ns.model_name, ns.deployment = dep.scheme, dep.model, dep.deployment
            ns.facts = dep.facts
            ns.notes = list(dep.notes)
            ns.fields = {"family": fam.name, "scheme": dep.scheme, "kv_kind": dep.kv_kind, "pool": dep.pool,
                         "model": dep.model, "writers": dep.reading.worker()[1]}
            ns.target = fam.target(ns.fields, dep.facts, fam.target_profile(profile))
            ns.flat_rows = _FlatRows(fam, dep, files, names, verify == "hash")
            out.append(ns)
    return out


def temp_columns(listing: RootListing, resolver: FactsResolver) -> dict[str, tuple]:
    """The namespace columns (rows.NS_COLUMNS) of the flat families' temp leftovers: the
    family and, where the name says which page it was being written as, that page's
    deployment, scheme and model (read as the page's name would be, facts included). No
    source_base: a temp file is no page of the namespace (it stays prune's residue)."""
    out: dict[str, tuple] = {}
    read: dict[tuple[str, str | None, str], tuple] = {}
    for fam, e in listing.flat_temps:
        page = fam.temp_page(e.name)
        cols: tuple = (fam.name, None, None, None, None, None, None, None, None)
        name = fam.flat_file(page, 0) if page is not None else None
        if name is not None and name.page is not None:
            key = (fam.name, name.page.pool, name.page.suffix)
            if key not in read:
                (dep,) = fam.discover([name], _facts_for(fam, resolver))
                read[key] = (fam.name, dep.scheme, dep.model, None, None, dep.deployment, None, None, None)
            cols = read[key]
        out[e.name] = cols
    return out


def _facts_for(fam: Any, resolver: FactsResolver):
    """facts of one suffix: FACTS.json by exact suffix, then model name (matched after the
    family's rewrite), then "*"; flags fill gaps."""
    keys = sorted(resolver.keys(), key=len, reverse=True)  # the longest model name that fits wins

    def facts_for(model: str | None, suffix: str):
        model_key = next((k for k in keys if k != "*" and fam.model_key_matches(k, suffix)), model)
        # (no model: only the suffix and "*" apply; FactsResolver looks None up as a key no entry has)
        return resolver.for_namespace(cast(str, model_key), suffix)
    return facts_for


def _stat_pages(fam: Any, files: FlatFiles, verify: str, listing: RootListing) -> list[Any]:
    """Every page's stat columns and the family's `flat_file` of it (what it is shown:
    size, and the head or hash it asks for), a chunk at a time as the C side delivers
    them (it stats the next chunks meanwhile, without the GIL)."""
    names = files.names
    hashed = verify == "hash"
    sizes = files.stats[0]
    size_of: dict[int, int] = {}  # (one int object per distinct size, not one a file)
    flat_files = []
    for start, codes, digests, heads in _c_stat(files, hashed):
        end = start + (len(codes) if codes is not None else len(names))
        for i in range(start, end):
            name = names[i]
            if codes is not None and codes[i - start] == 0:
                size = sizes[i]
                size = size_of.setdefault(size, size)
                ff = fam.flat_file(name, size)
                if hashed:
                    assert digests is not None and heads is not None  # (a hashing chunk's, from C)
                    j = i - start
                    ff.head, ff.content = heads[4 * j:4 * j + min(4, size)], digests[16 * j:16 * j + 16]
                    ff.all_zero = False
                elif verify != "none" and size and fam.wants_head(ff):
                    rec, ff = _read(fam, files.root, name, verify, ff)
                    if rec is None:
                        continue
                    files.records[i] = rec
                    files.set_stat(i, rec)
            else:
                ff = _read_in_python(fam, files, listing, i, verify)
                if ff is None:
                    continue
            ff.index = i
            flat_files.append(ff)
    return flat_files


def _read_in_python(fam: Any, files: FlatFiles, listing: RootListing, i: int, verify: str) -> Any:
    """Page i through the Python reader (what the C stat left to it): its record is kept;
    the page's flat_file, or None when it is no page (gone, or a row of its own)."""
    rec, ff = _read(fam, files.root, files.names[i], verify)
    if rec is None:
        return None
    files.records[i] = rec
    files.set_stat(i, rec)
    if ff is None:  # could not even be stat-ed: a row of its own
        listing.flat_loose.append(rec)
    return ff


def flat_bucket(name: str) -> str | None:
    """The --recheck bucket of a page: the first 3 hex digits of its name (its hash), as a
    tree's `<hhh>` folder, so 1/F runs re-read the whole directory."""
    hhh = name[:3]
    return hhh if BUCKET_RE.match(hhh) else None


def _stat_against_baseline(fam: Any, files: FlatFiles, baseline: Baseline, listing: RootListing) -> list[Any]:
    """`_stat_pages` of a --baseline scan: every page stat-ed first; one whose dev, inode,
    size, mtime_ns and ctime_ns equal a baseline row keeps that row's hash unopened
    (`files.carried`), unless its bucket is re-read this run (--recheck); every other page
    is read and hashed, and one whose hash moved under unchanged metadata is a silent change."""
    from kvmigrate.scan.walker import SILENT_CHANGE

    names = files.names
    n = len(names)
    files.carried = bytearray(n)
    codes = _stat_only(files)
    size, mtime, ino, dev, _, ctime = files.stats
    out: list[Any] = [None] * n
    read: list[int] = []
    for i, name in enumerate(names):
        rows = baseline.rows_for(name)
        was = -1 if codes[i] else rows.unchanged(dev[i], ino[i], size[i], mtime[i], ctime[i])
        if was < 0 or baseline.rechecks(flat_bucket(name)):
            read.append(i)
            continue
        ff = fam.flat_file(name, size[i])
        ff.content, ff.all_zero = rows.hashes(was)[0], False
        if fam.wants_head(ff):
            ff.head = fam.carried_head(rows.was_unsupported(was))
        ff.index, out[i] = i, ff
        files.carried[i] = 1
    for i, code, digest, head in _hash_pages(files, read):
        name = names[i]
        if code == 0:
            ff = fam.flat_file(name, size[i])
            ff.head, ff.content, ff.all_zero = head[:min(HEAD_BYTES, size[i])], digest, False
        else:
            ff = _read_in_python(fam, files, listing, i, "hash")
            if ff is None:
                continue
        read_rec = files.records.get(i)
        if ((read_rec is None or read_rec.status == "ok") and ff.content is not None and not ff.all_zero
                and (was := (rows := baseline.rows_for(name)).unchanged(dev[i], ino[i], size[i], mtime[i],
                                                                        ctime[i])) >= 0
                and rows.hashes(was)[0] != ff.content):
            rec = FileRecord(name, None, None, None, size[i], mtime[i], ino[i], dev[i], files.stats[4][i],
                             ctime_ns=ctime[i])
            rec.status, rec.action, rec.reason = "silent_change", "none", SILENT_CHANGE
            files.records[i] = rec
        ff.index, out[i] = i, ff
    return [ff for ff in out if ff is not None]


def _stat_only(files: FlatFiles) -> bytes:
    """lstat every page (in C where built) into `files.stats`: a code a page, 0 for a
    plain file, 1 for one the hashing pass words (not plain, vanished, not ASCII)."""
    codes = bytearray()
    for _, chunk, _, _ in _c_stat(files, False):
        if chunk is not None:
            codes += chunk
            continue
        for i, name in enumerate(files.names):  # the Python walk
            try:
                st = os.lstat(os.path.join(files.root, name))
            except OSError:
                codes.append(1)
                continue
            for col, value in zip(files.stats, (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_nlink,
                                                st.st_ctime_ns)):
                col[i] = value
            codes.append(0 if stat_mod.S_ISREG(st.st_mode) else 1)
    return bytes(codes)


def _hash_pages(files: FlatFiles, picked: list[int]) -> Iterator[tuple[int, int, bytes, bytes]]:
    """(index, code, digest, head) of each picked page, read and hashed in C where built
    (its stat columns replaced by what was read), in order; code 1 where the Python walk
    reads it (no C extension, KVMIGRATE_PURE_PYTHON=1, --bwlimit) or the C side left it."""
    from kvmigrate.scan.walker import leaf_walk

    leaf = leaf_walk()
    if leaf is None or not hasattr(leaf, "stat_flat") or pacing.limited():
        for i in picked:
            yield i, 1, b"", b""
        return
    names, stats = files.names, files.stats
    chunks = [picked[s:s + CHUNK_NAMES] for s in range(0, len(picked), CHUNK_NAMES)]

    def call(chunk: list[int]) -> tuple:
        return leaf.stat_flat(files.root, tuple(names[i] for i in chunk), True)

    threads = max(1, min(len(chunks), 2 * (os.cpu_count() or 1), 8))
    with ThreadPoolExecutor(threads, thread_name_prefix="kvmigrate-flat") as pool:
        for chunk, (codes, st, digests, heads) in zip(chunks, pool.map(call, chunks)):
            m = len(chunk)
            got = memoryview(st).cast("q")
            for j, i in enumerate(chunk):
                if codes[j] == 0:
                    for k, col in enumerate(stats):
                        col[i] = got[k * m + j]
                yield i, codes[j], digests[16 * j:16 * j + 16], heads[HEAD_BYTES * j:HEAD_BYTES * (j + 1)]


def _c_stat(files: FlatFiles, hashed: bool) -> Iterator[tuple[int, bytes | None, bytes | None, bytes | None]]:
    """stat (hashed: read and hash) every page in C, a chunk of names per call, in a few
    threads: (first index, codes, digests, heads) of each chunk in order, its stat columns
    appended to `files.stats`. One chunk of codes None where the Python walk runs (no C
    extension, KVMIGRATE_PURE_PYTHON=1, or --bwlimit with --verify hash: every read is
    charged)."""
    from kvmigrate.scan.walker import leaf_walk  # (the one switch between the C and the Python walk)

    n = len(files.names)
    leaf = leaf_walk()
    if leaf is None or not hasattr(leaf, "stat_flat") or (hashed and pacing.limited()):
        for col in files.stats:
            col.frombytes(bytes(8 * n))
        yield 0, None, None, None
        return
    starts = range(0, n, CHUNK_NAMES)
    threads = min(len(starts), 2 * (os.cpu_count() or 1) if hashed else os.cpu_count() or 1, 8)

    def call(start: int) -> tuple:
        return leaf.stat_flat(files.root, tuple(files.names[start:start + CHUNK_NAMES]), hashed)

    with ThreadPoolExecutor(max(threads, 1), thread_name_prefix="kvmigrate-flat") as pool:
        for start, (codes, st, digests, heads) in zip(starts, pool.map(call, starts)):
            m = len(st) // _STAT_FIELDS
            for k, col in enumerate(files.stats):
                col.frombytes(st[k * m:(k + 1) * m])
            yield start, codes, digests, heads


def _read(fam: Any, root: str, name: str, verify: str, ff: Any = None) -> tuple[FileRecord | None, Any]:
    """A page file's record and what the family is shown of it, read in Python (None,
    None: it vanished). `ff`: the family's record of it when the C side stat-ed it (only
    the head is then read)."""
    path = os.path.join(root, name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        rec = FileRecord(name, None, None, None, 0, 0, 0, 0, 0)
        rec.status, rec.reason = "unreadable", errno_reason(exc, "cannot stat", name)
        return rec, None
    rec = FileRecord(name, None, None, None, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_nlink,
                     ctime_ns=st.st_ctime_ns)
    if ff is None:
        ff = fam.flat_file(name, st.st_size)
    hashed = verify == "hash"
    if verify != "none" and (hashed or fam.wants_head(ff)) and st.st_size:
        try:
            r = read_file(path, want_hash=hashed, header_len=HEAD_BYTES)
        except Vanished:
            return None, None
        except OSError as exc:
            rec.status, rec.reason = "unreadable", errno_reason(exc, "cannot read", name)
            return rec, ff
        rec.content = r.content
        ff.head, ff.content, ff.all_zero = r.header, r.content, (r.all_zero if hashed else None)
    return rec, ff


class _FlatRows:
    """A deployment's rows, made when written (`tables`): the family's verdicts in its
    order, in batches of Arrow columns."""

    def __init__(self, fam: Any, dep: Any, files: FlatFiles, names: Any, hashed: bool) -> None:
        self.fam, self.dep, self.files, self.names, self.hashed = fam, dep, files, names, hashed

    def __bool__(self) -> bool:
        return bool(self.dep.files)

    def tables(self, code: int, ns_arrays: list) -> Iterator[pa.Table]:
        stats = self.files.arrow_stats()
        by_name = None
        rows, flat_files = [], []
        for j, row in enumerate(self.fam.flat_verdicts(self.dep, self.names, self.hashed)):
            dep_files = self.dep.files
            ff = dep_files[j][0] if j < len(dep_files) else None  # (the verdicts come in the files' order)
            if ff is None or ff.name != row["name"]:
                by_name = by_name or {f.name: f for f, _ in dep_files}
                ff = by_name[row["name"]]
            rows.append(row)
            flat_files.append(ff)
            if len(rows) >= BATCH_ROWS:
                yield self._table(rows, flat_files, stats, code, ns_arrays)
                rows, flat_files = [], []
        if rows:
            yield self._table(rows, flat_files, stats, code, ns_arrays)

    def _table(self, rows: list[dict], flat_files: list[Any], stats: list[pa.Array], code: int,
               ns_arrays: list) -> pa.Table:
        """One batch: the verdicts' columns, the stat columns taken by the files' index."""
        n = len(rows)
        out = Rows()
        out.relpath = [f.name for f in flat_files]
        out.rank = [r["rank"] for r in rows]
        out.block_hash = [bytes.fromhex(r["hex"]) if r["hex"] else None for r in rows]
        out.content = [f.content for f in flat_files]
        out.status = [r["status"] for r in rows]
        out.action = [r["action"] for r in rows]
        out.reason = [r["reason"] for r in rows]
        out.target = [r["target"] for r in rows]
        records = self.files.records
        if records:  # a file Python read keeps its own status (unreadable), action and reason
            for k, f in enumerate(flat_files):
                rec = records.get(f.index)
                if rec is not None and rec.status != "ok":
                    out.status[k], out.action[k], out.reason[k], out.target[k] = (
                        rec.status, rec.action, rec.reason, rec.target_relpath)
        index = pa.array([f.index for f in flat_files], pa.int64())
        out.ns = [code] * n
        out.group = [0] * n
        out.size, out.mtime_ns, out.inode, out.dev, out.nlink, out.ctime_ns = (col.take(index) for col in stats)
        out.payload = [None] * n
        carried = self.files.carried
        out.carried = [False] * n if carried is None else [carried[f.index] == 1 for f in flat_files]
        out.order = list(range(n))
        return out.table(ns_arrays)


def rows(walker: Any, listing: RootListing, namespaces: list[Namespace], out: Rows) -> Iterator[pa.Table]:
    """Part 0's rows of the flat families, in batches: every page file with its
    deployment's columns, then files that could not be stat-ed and temp leftovers
    (outside any namespace, in `out`, which is yielded last as a table)."""
    try:
        for ns in namespaces:
            flat_rows = getattr(ns, "flat_rows", None)
            if flat_rows:
                yield from flat_rows.tables(walker.ns_codes[ns.columns()], walker.ns_arrays)
    finally:
        if listing.flat:
            gc.unfreeze()
    for rec in listing.flat_loose:
        walker.emit(out, rec, None)
    for fam, e in listing.flat_temps:
        walker.other_file(e, e.name, out, where="the cache root", status="tmp_leftover",
                          reason=f"temp leftover of an interrupted {fam.title} write (never read by the engine)",
                          ns_cols=listing.flat_temp_cols.get(e.name))
    if len(out):
        yield out.table(walker.ns_arrays)
