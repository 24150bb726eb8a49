"""The files of a flat family (docs/families.md §3): one directory whose file names are
the identity (SGLang HiCache, docs/sglang.md). The roots phase sorts the claimed page
names of the cache root (`RootListing.flat`); `resolve` reads what the names and the
facts need (size, the first bytes the family asks for, the hash with --verify hash) and
lets the family group them into deployments, each a `Namespace` of its own (no base
folder); `rows` writes their rows in part 0 (no buckets to shard).

A HiCache directory holds millions of pages in one folder, so no page stays a Python
object: the names are sorted on disk, and each chunk of them is stat-ed (by the compiled
`stat_flat`, by file descriptor with the GIL released, in a few threads), shown to the
family a page at a time (`fold_page`: what its deployments need of all their pages) and
written to a temporary file (scan/flat_spill.py). Each deployment's rows are then made
from that file a window of whole page hashes at a time, in batches of Arrow columns. A
file the C side does not take (not plain, not ASCII, vanished, or no C extension,
KVMIGRATE_PURE_PYTHON=1) is read here in Python, which words what it is."""

from __future__ import annotations

import os
import stat as stat_mod
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, cast

import pyarrow as pa

from kvmigrate import families, pacing
from kvmigrate.classify import FileRecord
from kvmigrate.fsio import Vanished, errno_reason, read_file
from kvmigrate.identity.facts import FactsResolver
from kvmigrate.layout import BUCKET_RE
from kvmigrate.scan.baseline import Baseline
from kvmigrate.scan.flat_spill import HEX, STAT_FIELDS, PageNames, PageSpill
from kvmigrate.scan.roots import Namespace, RootListing
from kvmigrate.scan.rows import Rows

HEAD_BYTES = 4  # enough for a zip magic
BATCH_ROWS = 32_768  # rows of one Arrow batch (scan/run.py writes a row group from 32,768 rows on)
PART_ROWS = 8_192  # rows made as Python values at a time (a batch is made of such parts)
CHUNK_NAMES = 8_192  # names per stat_flat call (threads take chunks)
_U64 = (1 << 64) - 1


def resolve(root: str, listing: RootListing, resolver: FactsResolver, profile: str, verify: str,
            baseline: Baseline | None = None) -> list[Namespace]:
    """The namespaces (deployments) of every flat family's files in the root (`baseline`:
    --baseline, a hash scan's pages that did not change keep its hashes unopened)."""
    listing.flat_temp_cols = temp_columns(listing, resolver)
    out: list[Namespace] = []
    for name, pages in sorted(listing.flat.items()):
        fam = families.get(name)
        read = _PagesRead(fam, root, listing, PageSpill(pages.folder))
        if verify == "hash" and baseline is not None:
            _stat_against_baseline(read, pages, baseline)
        else:
            _stat_pages(read, pages, verify)
        read.spill.close()
        for dep in fam.discover_folds(read.folds, _facts_for(fam, resolver)):
            ns = Namespace(dep.label, dep.model or "", "", has_base=False)
            ns.family = fam.name
            ns.family_evidence = [f"file names of the {fam.title} ({dep.scheme}): <hash64>[.pool]<suffix>.bin"]
            ns.scheme, ns.model_name, ns.deployment = dep.scheme, dep.model, dep.deployment
            ns.facts = dep.facts
            ns.notes = list(dep.notes)
            ns.fields = {"family": fam.name, "scheme": dep.scheme, "kv_kind": dep.kv_kind, "pool": dep.pool,
                         "model": dep.model, "writers": dep.reading.worker()[1]}
            ns.target = fam.target(ns.fields, dep.facts, fam.target_profile(profile))
            ns.flat_rows = _FlatRows(fam, dep, read, listing.names, verify == "hash")
            out.append(ns)
    return out


class _PagesRead:
    """What the scan read of one flat family's pages, as it reads them in name order: each
    chunk's columns go to the spill, each page into its (pool, suffix)'s fold; a file read
    in Python that shows something of its own (unreadable, a silent change) keeps its
    record (`records`, by its place in name order: few)."""

    def __init__(self, fam: Any, root: str, listing: RootListing, spill: PageSpill) -> None:
        self.fam, self.root, self.listing, self.spill = fam, root, listing, spill
        self.folds: dict[tuple[str | None, str], Any] = {}
        self.records: dict[int, FileRecord] = {}
        self.index = 0  # the next name's place in name order
        self.cols: dict[str, list[Any]] = {f: [] for f in PageSpill.COLUMNS}

    def page(self, ff: Any, stat: Iterable[int], carried: bool = False) -> None:
        """A page file, with what the family was shown of it and its stat."""
        cols = self.cols
        cols["name"].append(ff.name)
        cols["page"].append(True)
        cols["fold"].append(self.fam.fold_page(self.folds, ff))
        for f, value in zip(STAT_FIELDS, stat):
            cols[f].append(value)
        cols["head"].append(ff.head)
        cols["content"].append(ff.content)
        cols["all_zero"].append(ff.all_zero)
        cols["carried"].append(carried)
        self.index += 1

    def no_page(self, name: str) -> None:
        """A name that is no page (it vanished, or could not be stat-ed: a row of its own)
        but still names an entry of the directory."""
        cols = self.cols
        cols["name"].append(name)
        cols["page"].append(False)
        cols["fold"].append(-1)
        for f in STAT_FIELDS:
            cols[f].append(0)
        for f in ("head", "content", "all_zero"):
            cols[f].append(None)
        cols["carried"].append(False)
        self.index += 1

    def record(self, rec: FileRecord) -> None:
        """The Python reader's record of the next name (kept only when it shows something)."""
        if rec.status != "ok":
            self.records[self.index] = rec

    def flush(self) -> None:
        self.spill.add(self.cols)
        self.cols = {f: [] for f in PageSpill.COLUMNS}

    def read_in_python(self, name: str, verify: str) -> None:
        """A page through the Python reader (what the C stat left to it)."""
        rec, ff = _read(self.fam, self.root, name, verify)
        if rec is None:
            self.no_page(name)
            return
        self.record(rec)
        if ff is None:  # could not even be stat-ed: a row of its own
            self.listing.flat_loose.append(rec)
            self.no_page(name)
            return
        self.page(ff, _stat_of(rec))


def _stat_of(rec: FileRecord) -> tuple[int, ...]:
    return rec.size, rec.mtime_ns, rec.inode & _U64, rec.dev & _U64, rec.nlink, rec.ctime_ns or 0


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


def _stat_pages(read: _PagesRead, pages: PageNames, verify: str) -> None:
    """Every page's stat and what the family is shown of it (size, and the head or hash it
    asks for), a chunk at a time as the C side delivers them (it stats the next chunks
    meanwhile, without the GIL)."""
    fam, hashed = read.fam, verify == "hash"
    for names, got in _c_stat(read.root, pages, hashed):
        if got is None:  # the Python walk
            for name in names:
                read.read_in_python(name, verify)
            read.flush()
            continue
        codes, stats, digests, heads = got
        for j, name in enumerate(names):
            if codes[j] != 0:
                read.read_in_python(name, verify)
                continue
            stat = [col[j] for col in stats]
            size = stat[0]
            ff = fam.flat_file(name, size)
            if hashed:
                ff.head, ff.content = heads[HEAD_BYTES * j:HEAD_BYTES * j + min(HEAD_BYTES, size)], digests[16 * j:16 * j + 16]
                ff.all_zero = False
            elif verify != "none" and size and fam.wants_head(ff):
                rec, ff = _read(fam, read.root, name, verify, ff)
                if rec is None:
                    read.no_page(name)
                    continue
                read.record(rec)
                stat = list(_stat_of(rec))
            read.page(ff, stat)
        read.flush()


def flat_bucket(name: str) -> str | None:
    """The --recheck bucket of a page: the first 3 hex digits of its name (its hash), as a
    tree's `<hhh>` folder, so 1/F runs re-read the whole directory."""
    hhh = name[:3]
    return hhh if BUCKET_RE.match(hhh) else None


def _stat_against_baseline(read: _PagesRead, pages: PageNames, baseline: Baseline) -> None:
    """`_stat_pages` of a --baseline scan: each chunk of pages stat-ed first; one whose
    dev, inode, size, mtime_ns and ctime_ns equal a baseline row keeps that row's hash
    unopened (carried), unless its bucket is re-read this run (--recheck); every other
    page is read and hashed, and one whose hash moved under unchanged metadata is a silent
    change."""
    from kvmigrate.scan.walker import SILENT_CHANGE

    fam = read.fam
    for names, got in _c_stat(read.root, pages, False):
        stats = got[1] if got is not None else _lstat_in_python(read.root, names)
        codes = got[0] if got is not None else stats.pop()
        carried: dict[int, Any] = {}
        picked: list[int] = []
        for j, name in enumerate(names):
            rows = baseline.rows_for(name)
            size, mtime, ino, dev, _, ctime = (col[j] for col in stats)
            was = -1 if codes[j] else rows.unchanged(dev, ino, size, mtime, ctime)
            if was < 0 or baseline.rechecks(flat_bucket(name)):
                picked.append(j)
                continue
            ff = fam.flat_file(name, size)
            ff.content, ff.all_zero = rows.hashes(was)[0], False
            if fam.wants_head(ff):
                ff.head = fam.carried_head(rows.was_unsupported(was))
            carried[j] = ff
        hashed = dict(zip(picked, _hash_pages(read.root, [names[j] for j in picked])))
        for j, name in enumerate(names):
            if j in carried:
                read.page(carried[j], [col[j] for col in stats], carried=True)
                continue
            code, stat, digest, head = hashed[j]
            if code != 0:
                read.read_in_python(name, "hash")
            else:
                ff = fam.flat_file(name, stat[0])
                ff.head, ff.content, ff.all_zero = head[:min(HEAD_BYTES, stat[0])], digest, False
                read.page(ff, stat)
            if read.cols["page"][-1] is not True:
                continue
            content = read.cols["content"][-1]
            size, mtime, ino, dev, nlink, ctime = (read.cols[f][-1] for f in STAT_FIELDS)
            if (read.index - 1 not in read.records and content is not None and not read.cols["all_zero"][-1]
                    and (was := (rows := baseline.rows_for(name)).unchanged(dev, ino, size, mtime, ctime)) >= 0
                    and rows.hashes(was)[0] != content):
                rec = FileRecord(name, None, None, None, size, mtime, ino, dev, nlink, ctime_ns=ctime)
                rec.status, rec.action, rec.reason = "silent_change", "none", SILENT_CHANGE
                read.records[read.index - 1] = rec
        read.flush()


def _lstat_in_python(root: str, names: list[str]) -> list[Any]:
    """The stat columns of these names by os.lstat (the Python walk), then their codes: 0
    for a plain file, 1 for one the hashing pass words (not plain, vanished)."""
    stats: list[Any] = [[0] * len(names) for _ in STAT_FIELDS]
    codes = bytearray(len(names))
    for j, name in enumerate(names):
        try:
            st = os.lstat(os.path.join(root, name))
        except OSError:
            codes[j] = 1
            continue
        for col, value in zip(stats, (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_nlink,
                                      st.st_ctime_ns)):
            col[j] = value
        codes[j] = 0 if stat_mod.S_ISREG(st.st_mode) else 1
    stats.append(bytes(codes))
    return stats


def _hash_pages(root: str, names: list[str]) -> list[tuple[int, list[int], bytes, bytes]]:
    """(code, stat, digest, head) of each name, read and hashed in C where built, in a few
    threads; code 1 where the Python walk reads it (no C extension,
    KVMIGRATE_PURE_PYTHON=1, --bwlimit) or the C side left it."""
    from kvmigrate.scan.walker import leaf_walk

    leaf = leaf_walk()
    if not names:
        return []
    if leaf is None or not hasattr(leaf, "stat_flat") or pacing.limited():
        return [(1, [], b"", b"")] * len(names)
    step = max(256, -(-len(names) // 4))
    parts = [names[s:s + step] for s in range(0, len(names), step)]
    out = []
    with ThreadPoolExecutor(min(len(parts), 2 * (os.cpu_count() or 1), 8), thread_name_prefix="kvmigrate-flat") as pool:
        for part, (codes, st, digests, heads) in zip(parts, pool.map(
                lambda part: leaf.stat_flat(root, tuple(part), True), parts)):
            stats = _columns(st, len(part))
            for j in range(len(part)):
                out.append((codes[j], [col[j] for col in stats], digests[16 * j:16 * j + 16],
                            heads[HEAD_BYTES * j:HEAD_BYTES * (j + 1)]))
    return out


def _columns(st: bytes, m: int) -> list[list[int]]:
    """stat_flat's stat buffer (six int64 columns of m values) as lists; inode and dev
    unsigned, as the manifest keeps them."""
    view = memoryview(st)
    return [view[8 * k * m:8 * (k + 1) * m].cast("Q" if STAT_FIELDS[k] in ("inode", "dev") else "q").tolist()
            for k in range(len(STAT_FIELDS))]


def _c_stat(root: str, pages: PageNames, hashed: bool) -> Iterator[tuple[list[str], Any]]:
    """stat (hashed: read and hash) every page in C, a chunk of names per call, in a few
    threads: (names, (codes, stat columns, digests, heads)) of each chunk in order; None
    for the second where the Python walk runs (no C extension, KVMIGRATE_PURE_PYTHON=1, or
    --bwlimit with --verify hash: every read is charged)."""
    from kvmigrate.scan.walker import leaf_walk  # (the one switch between the C and the Python walk)

    leaf = leaf_walk()
    if leaf is None or not hasattr(leaf, "stat_flat") or (hashed and pacing.limited()):
        for names in pages.chunks(CHUNK_NAMES):
            yield names, None
        return
    threads = max(1, min(2 * (os.cpu_count() or 1) if hashed else os.cpu_count() or 1, 8))

    def call(names: list[str]) -> tuple:
        codes, st, digests, heads = leaf.stat_flat(root, tuple(names), hashed)
        return codes, _columns(st, len(names)), digests, heads

    with ThreadPoolExecutor(threads, thread_name_prefix="kvmigrate-flat") as pool:
        yield from _ahead(pool, call, pages.chunks(CHUNK_NAMES), 2 * threads)


def _ahead(pool: Executor, fn: Callable[[Any], Any], items: Iterable[Any], depth: int) -> Iterator[tuple[Any, Any]]:
    """(item, fn(item)) in order, with at most `depth` items running ahead in the pool
    (Executor.map would take every item, and hold every result, at once)."""
    running: deque = deque()
    for item in items:
        running.append((item, pool.submit(fn, item)))
        if len(running) > depth:
            done, future = running.popleft()
            yield done, future.result()
    while running:
        done, future = running.popleft()
        yield done, future.result()


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
    """A deployment's rows, made when written (`tables`): the family's verdicts of a
    window of whole page hashes at a time, in the order of page hashes, in batches of
    Arrow columns."""

    def __init__(self, fam: Any, dep: Any, read: _PagesRead, names: Any, hashed: bool) -> None:
        self.fam, self.dep, self.read, self.names, self.hashed = fam, dep, read, names, hashed

    def __bool__(self) -> bool:
        return self.dep.count > 0

    def tables(self, code: int, ns_arrays: list) -> Iterator[pa.Table]:
        folds = self.dep.folds
        out, parts, held = Rows(), [], 0
        start = 0
        for win in self.read.spill.windows():
            names = win["name"]
            files = []
            for j, (fold, page) in enumerate(zip(win["fold"], win["page"])):
                if page and fold in folds:
                    order, reading = folds[fold]
                    ff = self.fam.flat_file(names[j], win["size"][j])
                    ff.head, ff.content, ff.all_zero, ff.index = win["head"][j], win["content"][j], win["all_zero"][j], j
                    files.append((names[j][:HEX], order, ff, reading))
            if files:
                files.sort(key=lambda x: (x[0], x[1]))
                pairs = [(ff, reading) for _, _, ff, reading in files]
                beside = _Beside(names, self.names)
                for k, row in enumerate(self.fam.flat_verdicts(self.dep, pairs, beside, self.hashed)):
                    ff = pairs[k][0]  # (the verdicts come in the files' order, sorted in place)
                    assert ff.name == row["name"]
                    self._add(out, row, ff, win, start, code)
                    if len(out) >= min(PART_ROWS, BATCH_ROWS):  # (as Arrow columns: few rows as Python objects)
                        parts.append(out.table(ns_arrays))
                        held += len(out)
                        out = Rows()
                        if held >= BATCH_ROWS:
                            yield pa.concat_tables(parts)
                            parts, held = [], 0
            start += len(names)
        if len(out):
            parts.append(out.table(ns_arrays))
        if parts:
            yield pa.concat_tables(parts)

    def _add(self, out: Rows, row: dict, ff: Any, win: dict, start: int, code: int) -> None:
        """One row: the verdict, the stat columns of its window, or the record Python
        read of it (unreadable, a silent change: its own status, action and reason)."""
        j = ff.index
        status, action, reason, target = row["status"], row["action"], row["reason"], row["target"]
        rec = self.read.records.get(start + j)
        if rec is not None:
            status, action, reason, target = rec.status, rec.action, rec.reason, rec.target_relpath
        out.order.append(len(out.relpath))
        out.relpath.append(ff.name)
        out.ns.append(code)
        out.rank.append(row["rank"])
        out.group.append(0)
        out.block_hash.append(bytes.fromhex(row["hex"]) if row["hex"] else None)
        for f in STAT_FIELDS:
            getattr(out, f).append(win[f][j])
        out.content.append(ff.content)
        out.payload.append(None)
        out.status.append(status)
        out.action.append(action)
        out.reason.append(reason)
        out.target.append(target)
        out.carried.append(win["carried"][j])


class _Beside:
    """Whether an entry of the directory has a name, asked of a window's names: a target a
    page is read as shares its page hash, so sorts into the same window; any other entry
    (a folder, a symlink of that name) is in the listing's names."""

    def __init__(self, window: list[str], listing_names: Any) -> None:
        self.window, self.listing_names = window, listing_names
        self.set: set[str] | None = None

    def __contains__(self, name: object) -> bool:
        if self.set is None:
            self.set = set(self.window)
        return name in self.set or name in self.listing_names


def rows(walker: Any, listing: RootListing, namespaces: list[Namespace], out: Rows) -> Iterator[pa.Table]:
    """Part 0's rows of the flat families, in batches: every page file with its
    deployment's columns, then files that could not be stat-ed and temp leftovers
    (outside any namespace, in `out`, which is yielded last as a table)."""
    for ns in namespaces:
        flat_rows = getattr(ns, "flat_rows", None)
        if flat_rows:  # (an LMCache tier's and a Mooncake store's too: scan/tier_rows.py, store_rows.py)
            yield from flat_rows.tables(walker.ns_codes[ns.columns()], walker.ns_arrays)
    for ns in namespaces:  # (every deployment's rows are written: the pages' files go)
        if isinstance(flat_rows := getattr(ns, "flat_rows", None), _FlatRows):
            flat_rows.read.spill.remove()
    for rec in listing.flat_loose:
        walker.emit(out, rec, None)
    for fam, e in listing.flat_temps:
        walker.other_file(e, e.name, out, where="the cache root", status="tmp_leftover",
                          reason=f"temp leftover of an interrupted {fam.title} write (never read by the engine)",
                          ns_cols=listing.flat_temp_cols.get(e.name))
    if len(out):
        yield out.table(walker.ns_arrays)
