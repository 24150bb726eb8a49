"""Is a block's source still what the scan saw, and sound? The checks `migrate --apply`
makes before it places a block (migration.md §3): staleness (dev, inode, size, mtime,
ctime), replicas (equal hashes, every rank present), and, for a block the manifest has no
hashes for, the checks a hashing scan makes on the bytes read here (not all zero, the
manifest's size, a vllm.cpp header the engine accepts). A transform opens and checks its
sources here too (`SourceChecks.open_sources`, `check_transform_sources`).

Sources are only read (O_NOFOLLOW, O_NOATIME where permitted): the reads of a batch run
in a helper thread (`read_batch`) while its folders are made; the verdicts are the main
thread's, in block order (`SourceChecks`).
"""

from __future__ import annotations

import os
import stat
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from kvmigrate import families, layout, pacing
from kvmigrate.errors import EXIT_INTEGRITY, EXIT_OPERATIONAL
from kvmigrate.fsio import all_holes, open_noatime
from kvmigrate.migrate import journal as jn
from kvmigrate.migrate.outputs import TransformSpec, slice_row_problem

if TYPE_CHECKING:
    from kvmigrate.migrate.model import BlockAction, Plan, SourceFile, TargetPlan
    from kvmigrate.migrate.state import ApplyState

CTIME_MOVED = ("source changed since the scan: its ctime moved while inode, size and mtime did not (rewritten in "
               "place with its mtime put back?); rescan it to migrate it")


def stat_differs(st: os.stat_result, src: SourceFile, *, bytes_checked: bool = False) -> str | None:
    """Why `st` is not the source file the scan saw, or None: another kind, dev, inode,
    size or mtime, or a ctime the scan did not see (CTIME_MOVED; user space cannot set a
    ctime, so a rewrite whose mtime was put back shows there). A ctime also moves for no
    change of bytes: link(2) sets it, so with a name added since the scan (nlink grew:
    kvmigrate's own link of it, by an earlier or interrupted run) it is no sign. Nor where
    the caller compares what it reads with the scan's hash (`bytes_checked`)."""
    if not stat.S_ISREG(st.st_mode):
        return "source is no longer a regular file"
    if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != (src.dev, src.inode, src.size, src.mtime_ns):
        return "source changed since the scan (dev, inode, size or mtime differ)"
    if (not bytes_checked and src.ctime_ns is not None and st.st_ctime_ns != src.ctime_ns
            and not (src.nlink is not None and st.st_nlink > src.nlink)):
        return CTIME_MOVED
    return None



class LinkedInodes:
    """The inodes earlier migration runs of a root meant to hard-link, each with the
    newest mtime of a journal that says so (`SourceChecks._linked_by_us`). Every link
    of every run is one: kept per device as a sorted array of inodes and one of mtimes
    (16 bytes a link, not a dict entry of Python ints), and the journals are streamed."""

    def __init__(self, by_dev: dict[int, tuple[array, array]]) -> None:
        self._by_dev = by_dev

    @classmethod
    def of_journals(cls, journals: Iterable[str], skip_run: str | None) -> LinkedInodes:
        """The link intents of every run in `journals` (files or directories), but run
        `skip_run` (the one being written: its intents precede its links) and the targets
        a rollback of some targets took back from a run."""
        devs, inos, when = array("Q"), array("Q"), array("q")
        for where in journals:
            if not os.path.exists(where):
                continue
            for path in jn.journal_files(where):
                jn.load_runs(path, paths=False)  # every record checked, as a run's reader does
                written = os.stat(path).st_mtime_ns
                for dev, ino in _link_intents(path, skip_run):
                    devs.append(dev)
                    inos.append(ino)
                    when.append(written)
        if not devs:
            return cls({})
        table = pa.table({"dev": _arrow(devs, pa.uint64()), "ino": _arrow(inos, pa.uint64()),
                          "when": _arrow(when, pa.int64())})
        del devs, inos, when
        table = table.group_by(["dev", "ino"]).aggregate([("when", "max")]).sort_by([("dev", "ascending"),
                                                                                    ("ino", "ascending")])
        by_dev: dict[int, tuple[array, array]] = {}
        for dev in pc.unique(table.column("dev")).to_pylist():
            mine = table.filter(pc.equal(table.column("dev"), pa.scalar(dev, pa.uint64())))
            by_dev[dev] = (_array_of(mine.column("ino"), "Q"), _array_of(mine.column("when_max"), "q"))
        return cls(by_dev)

    def written(self, dev: int, ino: int) -> int:
        """The newest mtime of a journal meant to link (dev, ino); -1 if none did."""
        entry = self._by_dev.get(dev)
        if entry is None:
            return -1
        inos, when = entry
        i = bisect_left(inos, ino)
        return when[i] if i < len(inos) and inos[i] == ino else -1


def _link_intents(path: str, skip_run: str | None) -> Iterator[tuple[int, int]]:
    """(dev, inode) of every `link` block intent of a journal file's runs, streamed: the
    runs of `skip_run` left out, and so are the intents of targets a later rollback of
    some targets took back from their run (`journal._drop_targets`)."""
    runs: list[tuple[set[str], array, array, array]] = []  # per run: targets, devs, inos, target of each
    code: dict[str | None, int] = {}  # a target's number in `runs` (one string per target, not per link)
    skip = False
    for rec in jn.iter_records(path, skip=(b'{"t":"mc_',)):  # (a store's records: no block intent)
        t = rec["t"]
        if t == "header":
            skip = rec.get("run_id") == skip_run
            runs.append((set(), array("Q"), array("Q"), array("I")))
        elif not runs or skip:
            continue
        elif t == "target":
            runs[-1][0].add(rec["base"])
        elif t == "intent":
            _, devs, inos, bases = runs[-1]
            for item in rec.get("items", []):
                dev, ino = item.get("dev"), item.get("ino")
                if item.get("kind") == "block" and item.get("action") == "link" and isinstance(dev, int) \
                        and isinstance(ino, int) and dev >= 0 and ino >= 0:
                    devs.append(dev)
                    inos.append(ino)
                    folder = layout.parse_folder(item["path"].split("/", 1)[0])
                    base = folder.base if folder is not None else item.get("base")
                    bases.append(code.setdefault(base, len(code)))
        elif t == "rolled_back" and rec.get("targets") is not None:
            gone = set(rec["targets"])
            gone_codes = {code[b] for b in gone if b in code}
            for i, (targets, devs, inos, bases) in enumerate(runs):
                if gone & targets:
                    keep = [k for k, b in enumerate(bases) if b not in gone_codes]
                    runs[i] = (targets - gone, array("Q", (devs[k] for k in keep)),
                               array("Q", (inos[k] for k in keep)), array("I", (bases[k] for k in keep)))
    for _, devs, inos, _ in runs:
        yield from zip(devs, inos)


def _arrow(values: array, type_: pa.DataType) -> pa.Array:
    """A Python array as an Arrow array of the same width, sharing its buffer."""
    return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(values)])


def _array_of(column: pa.ChunkedArray, typecode: str) -> array:
    """An Arrow integer column (no nulls) as a Python array of the same width."""
    out = array(typecode)
    for chunk in column.chunks:
        width = chunk.type.bit_width // 8
        out.frombytes(chunk.buffers()[1][chunk.offset * width:(chunk.offset + len(chunk)) * width].to_pybytes())
    return out


class SourceChecks:
    """The verdicts on a block's sources, in block order, for one run: each either
    passes or records the block's outcome (`state.outcome`) and says no. It holds what a
    verdict needs beyond the block: the batch's reads and lstats (taken ahead by a
    helper: `begin_batch`), the manifest's header identities, and which inodes earlier
    runs of this root linked (a ctime they moved is no change)."""

    def __init__(self, state: ApplyState, plan: Plan, journal_arg: str | None, run_id: str | None) -> None:
        self.outcome = state.outcome
        self.src_abs = state.src_abs
        self.src_prefix = state.src_prefix
        self.plan = plan
        self.journal_arg = journal_arg  # --journal, where earlier runs may be journaled too
        self.run_id = run_id  # the journal run being written (its intents precede its links)
        self._reads: dict[int, list[FileRead]] = {}  # id(action) -> its files' reads, this batch
        self._stats: dict[int, str | None] = {}  # id(source file) -> why it is stale, this batch
        # (dev, inode) -> `_identity` of a transform source read whole and passed, this batch
        self._read_whole: dict[tuple[int, int], tuple[int, int, int, int, int]] = {}
        self._header_ids_of: dict[str, tuple[bytes, int]] | None = None  # see `_header_ids`
        # see `_linked_by_us`: the inodes earlier runs meant to link, with when their journal was written
        self._ours: LinkedInodes | None = None

    def begin_batch(self, reads: dict[int, list[FileRead]], stats: dict[int, str | None]) -> None:
        """What the helper took ahead for the batch about to be placed (`read_batch`)."""
        self._reads, self._stats = reads, stats

    def end_batch(self) -> None:
        self._reads, self._stats = {}, {}
        self._read_whole.clear()

    def stale(self, src: SourceFile, act: BlockAction) -> str | None:
        """Why a source no longer is what the scan saw, or None (lstat-ed by the helper
        while the batch's folders were made, or now; a moved ctime judged by `_ctime_moved`)."""
        if id(src) in self._stats:
            why = self._stats.pop(id(src))
        else:
            why = _stale_at(self.src_abs(src.relpath), src)
        return self._ctime_moved(src, act) if why == CTIME_MOVED else why

    def _ctime_moved(self, src: SourceFile, act: BlockAction) -> str | None:
        """A source whose ctime alone moved since the scan, no name added (prune re-checks
        a ctime too; a chmod, an xattr set, a rewrite whose mtime was put back move it): no
        change when kvmigrate moved it (`_linked_by_us`) or its bytes still hash to the
        scan's (read now); else changed, or unproven without a hash (CTIME_MOVED)."""
        if self._linked_by_us(src):
            return None
        if src.content_hash is None:
            return CTIME_MOVED
        try:
            fd = open_noatime(self.src_abs(src.relpath))
        except OSError as exc:
            return f"source cannot be read: {exc.strerror}"
        try:
            why = stat_differs(os.fstat(fd), src, bytes_checked=True)
            got = None if why else _read_fd(fd, src.size)[0]
        except OSError as exc:
            return f"source cannot be read: {exc.strerror}"
        finally:
            os.close(fd)
        if why or got == src.content_hash:
            return why
        return "source changed since the scan: its ctime moved and its bytes differ from the scan's hash"

    def _linked_by_us(self, src: SourceFile) -> bool:
        """An earlier migration run journaled for this root (its default folder, or
        --journal) meant to hard-link this inode, and its journal was last written at or
        after the inode's ctime: link(2) and a rollback's unlink moved it (the same manifest
        applied after a rollback, or into another --dest), not a rewrite. (The run being
        written is left out: its intents precede its links.) Read once, when a ctime first
        needs it."""
        if self._ours is None:
            journals = {w for w in (jn.default_journal_dir(self.plan.root), self.journal_arg) if w is not None}
            self._ours = LinkedInodes.of_journals(sorted(journals), self.run_id)
        try:
            st = os.lstat(self.src_abs(src.relpath))
        except OSError:
            return False
        return st.st_ctime_ns <= self._ours.written(st.st_dev, st.st_ino)

    def check_replicas(self, tp: TargetPlan, act: BlockAction) -> tuple[bool, bytes | None]:
        """Every rank's file of a multi-rank block must hold equal bytes (payloads for
        vllm.cpp) before one of them is reused, by the hashes the scan took (a block
        lacking them is read instead: `read_checked`). Returns (ok, None); when not ok
        the block already has its outcome."""
        ranks = {act.source.rank, *(r.rank for r in act.replicas)}
        if _incomplete(tp, act, ranks):
            self.outcome(tp, act, "failed", f"block incomplete: rank files {sorted(ranks)} of {act.world}",
                          bits=EXIT_INTEGRITY)
            return False, None
        for rep in act.replicas:
            why = self.stale(rep, act)
            if why:
                self.outcome(tp, act, "changed_since_scan", f"replica {rep.relpath}: {why}")
                return False, None
        payload = act.action == "rewrite_header"
        files = (act.source, *act.replicas)
        known = [f.payload_hash if payload else f.content_hash for f in files]
        differing = [f.relpath for f, h in zip(files, known) if h != known[0]]
        if differing:
            self.outcome(tp, act, "failed", f"replicas differ ({'payload' if payload else 'content'}): "
                          + ", ".join(differing) + f" != {act.source.relpath}", bits=EXIT_INTEGRITY)
            return False, None
        return True, None

    def read_checked(self, tp: TargetPlan, act: BlockAction) -> tuple[bool, bytes | None]:
        """The checks a hashing scan makes, on the bytes this run read (one open and one
        read per file, by the batch's reader thread while the folders are made: `Applier._prepare`):
        no block is published unless every file of it was read here or hashed by the scan
        (README: what `--apply` reads). Verdicts in order: the source is stale, the block
        incomplete, a replica stale, a file unreadable, a file's content damaged (all
        zero, not the manifest's size, a vllm.cpp header the engine refuses), the replicas
        differ. Returns (ok, the source's content hash, journaled with the block)."""
        payload = act.action == "rewrite_header"
        reads = self._reads.pop(id(act), None) or _read_block_files(self.src_prefix, act, tp.fam.header_len)
        # a moved ctime alone: read all the same, and no change if kvmigrate moved it (its bytes are checked below)
        reads = [got._replace(stale=None) if got.stale == CTIME_MOVED and self._linked_by_us(f) else got
                 for f, got in zip(act.sources, reads)]
        first = reads[0]
        if first.stale:
            self.outcome(tp, act, "changed_since_scan", first.stale)
            return False, None
        ranks = {act.source.rank, *(r.rank for r in act.replicas)}
        if _incomplete(tp, act, ranks):
            self.outcome(tp, act, "failed", f"block incomplete: rank files {sorted(ranks)} of {act.world}",
                          bits=EXIT_INTEGRITY)
            return False, None
        for rep, got in zip(act.replicas, reads[1:]):
            if got.stale:
                self.outcome(tp, act, "changed_since_scan", f"replica {rep.relpath}: {got.stale}")
                return False, None
        files = act.sources
        for f, got in zip(files, reads):
            if got.error is not None:
                what = "replica" if act.world > 1 else "the source"
                self.outcome(tp, act, "failed", f"cannot read {what} {f.relpath}: {got.error.strerror}",
                              bits=EXIT_OPERATIONAL)
                return False, None
        for f, got in zip(files, reads):
            where = "" if f is act.source else f" of {f.relpath}"
            problem = _content_problem(got, f.size, where) or (
                self._header_problem(tp, f, got.header, where) if tp.fam.header_len else None)
            if problem:
                self.outcome(tp, act, "failed", f"{problem}; not placed", bits=EXIT_INTEGRITY)
                return False, None
        known = [got.payload if payload else got.content for got in reads]
        differing = [f.relpath for f, h in zip(files, known) if h != known[0]]
        if differing:
            self.outcome(tp, act, "failed", f"replicas differ ({'payload' if payload else 'content'}): "
                          + ", ".join(differing) + f" != {act.source.relpath}", bits=EXIT_INTEGRITY)
            return False, None
        return True, first.content

    def _header_problem(self, tp: TargetPlan, f: SourceFile, header: bytes, where: str) -> str | None:
        """The check the engine's reader fails on this source file's header (its rank
        namespace's digest and payload size, the block's key), worded like the scan's finding."""
        fam = tp.fam
        ids = self._header_ids()
        parsed = layout.parse_block_relpath(f.relpath)
        rank_dir = f.relpath.split("/", 1)[0]
        if rank_dir not in ids or parsed is None:
            return f"header_invalid: no {fam.title} identity in the manifest for {f.relpath}"
        block = parsed[1]
        digest, payload_size = ids[rank_dir]
        check = fam.header_check(header, digest=digest, payload_size=payload_size, hex_hash=block.hex_hash,
                                 group=block.group)
        if check is None:
            return None
        return f"header_invalid: header check '{check}' failed{where}: the {fam.title} reader deletes this file"

    def _header_ids(self) -> dict[str, tuple[bytes, int]]:
        """rank folder -> (identity digest, payload size) of the manifest's namespaces whose
        family writes block headers (what their headers must carry)."""
        if self._header_ids_of is None:
            self._header_ids_of = {}
            for ns in (self.plan.metadata.get("namespaces") or {}).values():
                cfg = ns.get("config_json")
                fam = families.get(ns.get("family"))
                if not fam.header_len or not isinstance(cfg, dict):
                    continue
                try:
                    digest, payload = fam.target_digest(cfg), fam.payload_bytes(cfg)
                    if digest is None or payload is None:  # (a family that writes headers gives both)
                        continue
                    ident = (digest, int(payload))
                except (KeyError, TypeError, ValueError):
                    continue
                for rank_dir in ns.get("rank_dirs") or ():
                    self._header_ids_of[rank_dir] = ident
        return self._header_ids_of

    # --- transforms -------------------------------------------------------------------

    def open_sources(self, tp: TargetPlan, act: BlockAction) -> list[int] | None:
        """Open every file a transform reads and check it is still what the scan saw
        (dev, inode, size, mtime on the open fd). None: the block has its outcome."""
        spec = act.transform_spec
        files = act.sources if spec.action != "slice" else (act.source,)
        # (a flat family's page is one file; its whole copies, if any, are compared, not read into it)
        if spec.action != "slice" and not spec.flat and [f.rank for f in files] != list(range(spec.ranks)):
            self.outcome(tp, act, "failed", f"block incomplete: rank files {[f.rank for f in files]} of "
                          f"{spec.ranks}", bits=EXIT_INTEGRITY)
            return None
        fds: list[int] = []
        try:
            for f in files:
                try:
                    fd = open_noatime(self.src_abs(f.relpath))
                except FileNotFoundError:
                    self.outcome(tp, act, "changed_since_scan", f"{f.relpath} vanished since the scan")
                    return None
                except OSError as exc:
                    self.outcome(tp, act, "failed", f"cannot read {f.relpath}: {exc.strerror}",
                                  bits=EXIT_OPERATIONAL)
                    return None
                fds.append(fd)
                why = stat_differs(os.fstat(fd), f, bytes_checked=f.content_hash is not None)
                if why:
                    self.outcome(tp, act, "changed_since_scan", f"{f.relpath}: {why}")
                    return None
            ready, fds = fds, []
            return ready
        finally:
            for fd in fds:
                os.close(fd)

    def check_transform_sources(self, tp: TargetPlan, act: BlockAction, fds: list[int]) -> bool:
        """Content checks before a transform acts: a slice's row must hold N equal cells
        and a zero tail; MLA rank files must be equal replicas (content hashes computed
        now when the scan did not take them); with the scan's hashes every file is
        re-hashed (staleness). False: the block has its outcome."""
        spec = act.transform_spec
        files = act.sources if spec.action != "slice" else (act.source,)
        try:
            return self._source_contents_ok(tp, act, spec, files, fds)
        except OSError as exc:
            self.outcome(tp, act, "failed", f"cannot read the sources of {act.action}: {exc.strerror or exc}",
                          bits=EXIT_OPERATIONAL)
            return False

    def _source_contents_ok(self, tp: TargetPlan, act: BlockAction, spec: TransformSpec,
                            files: tuple[SourceFile, ...], fds: list[int]) -> bool:
        if spec.action == "slice":
            h = xxhash.xxh3_128()
            problem = slice_row_problem(fds[0], spec, h)
            pacing.charge(act.source.size)  # the row read whole (--bwlimit)
            if act.source.content_hash is not None and h.digest() != act.source.content_hash:
                self.outcome(tp, act, "changed_since_scan", "source content differs from the scan's hash")
                return False
            if problem:
                self.outcome(tp, act, "failed", f"slice of {act.source.relpath}: {problem}; not placed",
                              bits=EXIT_INTEGRITY)
                return False
            return True
        # every rank file is read once here (the writer reads them again): no transform
        # publishes a row made of a file that is all zero (crash residue) or differs from
        # the scan's hash, nor one of MLA replicas that differ. The files of a chunk an
        # earlier output of this batch read and passed are not read again while their
        # stat is unchanged (an LMCache reshard writes one file per target rank and sidecar)
        stats = [_identity(os.fstat(fd)) for fd in fds]
        if all(self._read_whole.get(st[:2]) == st for st in stats):
            return True
        hashes = []
        for f, fd in zip(files, fds):
            os.lseek(fd, 0, os.SEEK_SET)
            got = FileRead(None, *_read_fd(fd, f.size, let_go=False))  # the writer reads it next
            if f.content_hash is not None and got.content != f.content_hash:
                self.outcome(tp, act, "changed_since_scan", f"{f.relpath}: content differs from the scan's hash")
                return False
            problem = _content_problem(got, f.size, "" if f is act.source else f" of {f.relpath}")
            if problem:
                self.outcome(tp, act, "failed", f"{act.action}: {problem}; not placed", bits=EXIT_INTEGRITY)
                return False
            hashes.append(got.content)
        if spec.replicas or spec.flat and len(files) > 1:
            differing = [f.relpath for f, h in zip(files, hashes) if h != hashes[0]]
            if differing:
                self.outcome(tp, act, "failed", "MLA replicas differ (content): " + ", ".join(differing)
                              + f" != {act.source.relpath}", bits=EXIT_INTEGRITY)
                return False
        for st in stats:
            self._read_whole[st[:2]] = st
        return True


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What must be unchanged for a file read moments ago to count as read: dev, inode,
    size, mtime and ctime."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _incomplete(tp: TargetPlan, act: BlockAction, ranks: set[int]) -> bool:
    """The block lacks a rank file it needs: every rank's; for a family whose rank files
    are whole copies, none (a page of one file, world 1, is whole whatever its rank)."""
    if tp.fam.copies_whole:
        return act.world > 1 and not ranks <= set(range(act.world))
    return ranks != set(range(act.world))



def read_batch(prefix: str, acts: list[BlockAction], header_len: int
                ) -> tuple[dict[int, list], dict[int, str | None]]:
    """What the blocks of a batch will check about their sources, taken ahead by a
    helper: the files of blocks the manifest has no hashes for, read (by action id); the
    other sources, lstat-ed (by file id; see `SourceChecks.stale`)."""
    reads: dict[int, list] = {}
    stats: dict[int, str | None] = {}
    for act in acts:
        if reads_block(act):
            reads[id(act)] = _read_block_files(prefix, act, header_len)
        else:
            for f in (act.sources if act.transform is None else (act.source,)):
                stats[id(f)] = _stale_at(prefix + f.relpath, f)
    return reads, stats


class FileRead(NamedTuple):
    """What one open and read of a source file found (`SourceChecks.read_checked` judges it)."""

    stale: str | None  # why it no longer is what the scan saw (then nothing was read)
    content: bytes | None  # XXH3-128 of the whole file
    payload: bytes | None  # XXH3-128 after the header (header rewrites compare these)
    header: bytes  # the block header (families that write one: vllm.cpp)
    nread: int
    all_zero: bool
    error: OSError | None = None


def _read_block_files(prefix: str, act: BlockAction, header_len: int) -> list[FileRead]:
    """Every file of a block read once, source first. Reads only (sources are never
    written): safe in a thread."""
    payload = act.action == "rewrite_header"
    return [_stat_and_read(prefix + f.relpath, f, header_len, payload) for f in act.sources]


def _stat_and_read(path: str, src: SourceFile, header_len: int, payload: bool) -> FileRead:
    try:
        fd = open_noatime(path)
    except OSError as exc:
        why = _stale_at(path, src)  # the verdict lstat gives: vanished, not a regular file, changed
        return FileRead(why, None, None, b"", 0, False, None if why else exc)
    try:
        st = os.fstat(fd)
        why = stat_differs(st, src)
        if why and why != CTIME_MOVED:  # (a moved ctime alone is judged by the main thread: read it all the same)
            return FileRead(why, None, None, b"", 0, False)
        try:
            if all_holes(fd, st):  # every byte zero: refused as the scan would, without the read
                return FileRead(why, None, None, os.pread(fd, header_len, 0) if header_len else b"",
                                 st.st_size, True)
            return FileRead(why, *_read_fd(fd, src.size, header_len, payload))
        except OSError as exc:
            return FileRead(None, None, None, b"", 0, False, exc)
    finally:
        os.close(fd)


def _read_fd(fd: int, size: int, header_len: int = 0, payload: bool = False, let_go: bool = True
             ) -> tuple[bytes, bytes | None, bytes, int, bool]:
    """The scan's block reader (`kvmigrate.fsio.read_fd`) on an open source file: (its
    XXH3-128, the XXH3-128 after `header_len` bytes if `payload`, those bytes, bytes read,
    every byte zero); reading stops once more than `size` bytes came (it grew)."""
    from kvmigrate.fsio import read_fd

    return read_fd(fd, size, header_len, payload, let_go=let_go)


def _content_problem(got: FileRead, size: int, where: str = "") -> str | None:
    """What a read shows is wrong with a block file (`where`: " of <relpath>" for a file
    other than the one the outcome line names), worded like the scan's finding."""
    if got.nread == 0:
        return f"short: the file{where} is empty"
    if got.all_zero:
        return f"zero_filled: all {got.nread} bytes{where} are zero (crash residue)"
    if got.nread != size:
        return f"size_mismatch: {got.nread} bytes read{where}, the manifest says {size}"
    return None


def _stale_at(path: str, src: SourceFile) -> str | None:
    """Why a source no longer is what the scan saw, or None (by lstat)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "source vanished since the scan"
    except OSError as exc:
        return f"source cannot be read: {exc.strerror}"
    return stat_differs(st, src)


def reads_block(act: BlockAction) -> bool:
    """The block's files are read and checked before it is placed (see `Applier._block`);
    a transform reads its sources itself (`check_transform_sources`)."""
    return act.transform is None and _unhashed(act)


def _unhashed(act: BlockAction) -> bool:
    """The manifest lacks a content (payload, for header rewrites) hash of a file of
    the block: the scan did not read it, so apply must."""
    if act.action == "rewrite_header":
        return any(f.payload_hash is None for f in act.sources)
    return any(f.content_hash is None for f in act.sources)

