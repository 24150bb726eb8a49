"""Phase 4 of the scan, per bucket: the `Walker` lists bucket `<hhh>` of every rank
folder of a unit and stats or reads each file (the file-level checks); its base class
`BlockVerdicts` (blocks.py) classifies the bucket's blocks.

The plain block files of vLLM / llm-d buckets go through the compiled leaf walk where it
is built (`kvmigrate._leafwalk`: by file descriptor, GIL released); anything unusual it
hands back to the Python code here, which words it."""

from __future__ import annotations

import os
import stat as stat_mod
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, NamedTuple

import pyarrow as pa

from kvmigrate import classify, findings, layout, pacing
from kvmigrate.classify import FileRecord, UnitPlan
from kvmigrate.fsio import Vanished, errno_reason, kind_of, read_buffer, read_file
from kvmigrate.scan.baseline import Baseline
from kvmigrate.scan.blocks import BlockVerdicts
from kvmigrate.scan.roots import Namespace, RootListing
from kvmigrate.scan.rows import Rows, ns_arrays
from kvmigrate.scan.units import Member, Unit

ZERO_SCAN_MAX = 64 << 20  # --verify size reads a zero-header vllm.cpp file whole only up to this size
SILENT_CHANGE = findings.reason("content hash changed although size, mtime, ctime and inode did not: disk or "
                                "filesystem corruption (silent data change); never migrated",
                                findings.SILENT_CHANGE)


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


class Visit(NamedTuple):
    """One rank folder's bucket in a walk: what the per-entry code of `Walker.bucket`
    needs, made once per rank folder and bucket (never per file)."""

    unit: Unit
    member: Member
    mi: int  # the member's index in unit.members (a FileRecord's `member`)
    hhh: str  # the bucket
    brel: str  # the bucket folder's relpath
    out: Rows  # the task's rows
    blocks: dict[tuple[int, str], list[int]]  # (group, hash) -> rows of its files met so far in this bucket
    misc: list[int]  # rows of misfiled block files (placed after the bucket's other rows)


def stat_record(relpath: str, st: os.stat_result, rank: int | None = None, group: int | None = None,
            hex_hash: str | None = None) -> FileRecord:
    return FileRecord(relpath, rank, group, hex_hash, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev,
                      st.st_nlink, ctime_ns=st.st_ctime_ns)


FOLDER_BATCH = 8192  # rows of a part-0 folder (kvmigrate's own, a foreign one) handed on at once


class Walker(BlockVerdicts):
    """The walk of one scan: options, shared caches and the per-bucket worker (the
    block-level verdicts are `BlockVerdicts`'s)."""

    def __init__(self, root: str, *, verify: str, listing: RootListing,
                 transform_output: Callable[[str, UnitPlan, FileRecord], tuple[int, Callable[[], bytes | None]]],
                 baseline: Baseline | None = None):
        self.root = root
        # --baseline (hash scans only): unchanged files keep its hashes unopened, except in
        # the buckets re-read this run (--recheck), where a changed hash is a silent change
        self.baseline = baseline if verify == "hash" else None
        self.transform_output = transform_output  # see `scan`
        self.verify = verify
        self.hashed = verify == "hash"
        self.listing = listing
        self._slice_cache: dict[tuple[int, int, int], tuple[str, str] | None] = {}
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
        # with --bwlimit the Python walk reads, file by file, where every read is charged
        # (the C walk reads a whole bucket between two charges: too coarse a burst)
        self.leaf = None if pacing.limited() else leaf_walk()

    def prepare(self, namespaces: list[Namespace], units: list[Unit]) -> None:
        """Number the namespaces (rows carry a code, batches a dictionary) and note per
        unit what the block fast path needs."""
        for cols in [ns.columns() for ns in namespaces] + list(self.listing.flat_temp_cols.values()):
            if cols not in self.ns_codes:
                self.ns_codes[cols] = len(self.ns_table)
                self.ns_table.append(cols)
        for u in units:
            for m in u.members:
                m.code = self.ns_codes[m.columns]
            t = u.plan.target
            u.targets_exist = t is not None and t.rank_dir in self.listing.names
        self.ns_arrays = ns_arrays(self.ns_table)
        self.units = units

    # -- generic file rows -------------------------------------------------------------

    def lstat_row(self, path: str, rel: str, out: Rows) -> os.stat_result | None:
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
        return stat_record(rel, st)

    def hash_plain(self, rec: FileRecord, path: str) -> bool:
        """Hash a non-block regular file in --verify hash mode; False if it vanished."""
        if not self.hashed:
            return True
        if self._carry(rec):
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
                kind: str | None = kind_of(mode)
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
                own = layout.own_artifact(entry.name)
                if own is not None:
                    rec.status, rec.reason = "own_artifact", own
                elif kind is not None:
                    rec.status, rec.reason = "tmp_leftover", f"temp leftover of an interrupted write ({kind})"
                else:
                    rec.status, rec.reason = "foreign", f"unexpected file in {where}: not part of the cache"
                if not self.hash_plain(rec, entry.path):
                    return
        rec.action = "none"
        self.emit(out, rec, ns_cols)

    def emit(self, out: Rows, rec: FileRecord, ns_cols: tuple | None) -> None:
        out.add(rec, self.ns_codes[ns_cols])

    def unlisted(self, path: str, rel: str, out: Rows, exc: OSError, ns_cols: tuple | None) -> None:
        """A folder that cannot be listed: its own row, `unreadable`, saying why."""
        st = self.lstat_row(path, rel, out)
        if st is not None:
            rec = stat_record(rel, st)
            rec.status, rec.reason = "unreadable", errno_reason(exc, "cannot list", rel)
            self.emit(out, rec, ns_cols)

    def dir_rows(self, path: str, rel: str, out: Rows, *, status: str | None, reason: str | None,
                 ns_cols: tuple | None, where: str, shard: tuple[int, int] | None = None) -> None:
        """Every file under a directory (no symlink follow) as non-block rows. With `shard`,
        only files whose innermost `<hhh>` ancestor belongs to this part (none: part 0)."""
        for _ in self._dir_walk(path, rel, [out], None, status=status, reason=reason, ns_cols=ns_cols, where=where,
                                shard=shard, bucket=None):
            pass

    def dir_batches(self, path: str, rel: str, *, status: str, reason: str, where: str) -> Iterator[Rows]:
        """`dir_rows` of a part-0 folder (kvmigrate's own, a foreign one), in the same order
        but a Rows of FOLDER_BATCH rows at a time: a prune's quarantine holds every file it
        moved, and one Rows of them held ~1 KB a file until the folder's walk ended."""
        box = [Rows()]
        yield from self._dir_walk(path, rel, box, FOLDER_BATCH, status=status, reason=reason, ns_cols=None,
                                  where=where, shard=None, bucket=None)
        if len(box[0]):
            yield box[0]

    def _dir_walk(self, path: str, rel: str, box: list[Rows], limit: int | None, *, status: str | None,
                  reason: str | None, ns_cols: tuple | None, where: str, shard: tuple[int, int] | None,
                  bucket: str | None) -> Iterator[Rows]:
        """The walk of `dir_rows` into box[0]; each time it holds `limit` rows (None: never),
        it yields them and goes on in a new Rows."""
        try:
            with os.scandir(path) as it:
                entries = sorted(it, key=lambda e: e.name)
        except FileNotFoundError:
            return
        except OSError as exc:
            if shard is None or shard_part(bucket, shard[1]) == shard[0]:
                self.unlisted(path, rel, box[0], exc, ns_cols)
            return
        for e in entries:
            child = f"{rel}/{e.name}"
            if e.is_dir(follow_symlinks=False):
                inner = e.name if layout.BUCKET_RE.match(e.name) else bucket
                yield from self._dir_walk(e.path, child, box, limit, status=status, reason=reason, ns_cols=ns_cols,
                                          where=where, shard=shard, bucket=inner)
            elif shard is None or shard_part(bucket, shard[1]) == shard[0]:
                self.other_file(e, child, box[0], where=where, status=status, reason=reason, ns_cols=ns_cols)
            if limit is not None and len(box[0]) >= limit:
                full, box[0] = box[0], Rows()
                yield full

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
        leaf = self.leaf if unit.plan.fam.header_len == 0 else None
        baseline = self.baseline
        recheck = baseline is not None and baseline.rechecks(hhh)
        carry = baseline is not None and not recheck  # (stat first: read only what changed)
        if leaf is not None:
            verdict = partial(self._size_verdict, unit) if self._checks_size(unit) else None
            buf = read_buffer()
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
                j0 = len(store)
                unusual = leaf.walk_bucket(bpath, brel + "/", hhh, self.hashed and not carry, self.leaf_perm, m.code,
                                           m.rank, store, verdict, buf)
                if baseline is not None:
                    self._against_baseline(store, j0, carry, brel)
                if unusual == []:
                    continue
                store.export_blocks(blocks)  # Python rows join the blocks: after the C walk's rows so far
                if unusual is not None:
                    self._unusual(Visit(unit, m, mi, hhh, brel, out, blocks, misc), unusual)
                    continue
            visit = Visit(unit, m, mi, hhh, brel, out, blocks, misc)
            fanouts = self._listing(bpath, brel, out, m.columns)  # (block rows are sorted per bucket below)
            for fe in fanouts or ():
                self._bucket_entry(visit, fe)
        out.order.extend(misc)
        if blocks or leaf is not None:  # (the C walk files its rows' blocks in out.store)
            self._finish_blocks(unit, blocks, out)

    def _against_baseline(self, store: Any, j0: int, carry: bool, brel: str) -> None:
        """The C walk's rows from j0 on against the baseline. Carrying (the walk only
        stat()ed them): unchanged files take the baseline's hash, the others are read
        here. Re-checking (the walk hashed them): unchanged metadata with another hash is
        a silent change."""
        assert self.baseline is not None
        b = self.baseline.bucket_rows(brel)
        if not carry:
            for j in store.carry(j0, *b.stat, b.content, True):
                store.set(j, "silent_change", "none", SILENT_CHANGE, None)
            return
        for j in store.carry(j0, *b.stat, b.content, False):
            rel = store.row(j)[0]
            try:
                r = read_file(f"{self.root}/{rel}", want_hash=True)
            except (Vanished, OSError) as exc:  # (gone or unreadable since its stat: the row keeps no hash)
                if not isinstance(exc, (Vanished, FileNotFoundError)):
                    store.set(j, "unreadable", "none", errno_reason(exc, "cannot read", rel), None)
                continue
            if r.st.st_size == 0:
                store.set(j, "short", "none", "empty file", None)
            elif r.all_zero:
                store.set(j, "zero_filled", "none", f"all {r.st.st_size} bytes are zero (crash residue)", None)
            else:
                store.set_content(j, r.content)

    def _carry(self, rec: FileRecord) -> bool:
        """A file through the Python walk against the baseline: True when unchanged and
        carried over (rec has the baseline's hashes; not to be read)."""
        b = self.baseline
        if b is None or b.rechecks(_bucket_of(rec.relpath)):
            return False
        rows = b.rows_for(rec.relpath)
        i = rows.unchanged(rec.dev, rec.inode, rec.size, rec.mtime_ns, rec.ctime_ns)
        if i < 0:
            return False
        rec.content, rec.payload = rows.hashes(i)
        rec.carried = True
        return True

    def _rechecked(self, rec: FileRecord) -> bool:
        """A file just hashed in a re-checked bucket: True (a silent change) if only its bytes moved."""
        b = self.baseline
        if b is None or rec.status != "ok" or rec.content is None:
            return False
        rows = b.rows_for(rec.relpath)
        i = rows.unchanged(rec.dev, rec.inode, rec.size, rec.mtime_ns, rec.ctime_ns)
        if i >= 0 and rows.hashes(i)[0] != rec.content:
            rec.status, rec.reason = "silent_change", SILENT_CHANGE
            return True
        return False

    def _unusual(self, v: Visit, unusual: list[tuple[str | None, str]]) -> None:
        """The entries the leaf walk left to Python (fan-out folder None: an entry of the
        bucket folder itself), in the order it met them (the Python walk's order), each
        listed again for its DirEntry and taken by the general code."""
        listed: dict[str | None, dict[str, os.DirEntry]] = {}
        brel = v.brel
        bpath = f"{self.root}/{brel}"
        for fanout, name in unusual:
            entries = listed.get(fanout)
            if entries is None:
                path, rel = (bpath, brel) if fanout is None else (f"{bpath}/{fanout}", f"{brel}/{fanout}")
                entries = listed[fanout] = {e.name: e for e in self._listing(path, rel, v.out, v.member.columns) or ()}
            e = entries.get(name)
            if e is None:
                continue  # gone meanwhile
            if fanout is None:
                self._bucket_entry(v, e)
            else:  # (the leaf walk took it as a fan-out folder)
                fan = self._fanout_name(fanout)
                assert fan is not None  # (the leaf walk takes fan-out folders by their names)
                self._fanout_folder(v, f"{bpath}/{fanout}", f"{brel}/{fanout}", fan, files=[e])

    def _listing(self, path: str, rel: str, out: Rows, ns_cols: tuple | None) -> list[os.DirEntry] | None:
        """The entries of a folder of a rank folder; None if it vanished, or (a row saying
        so) if it cannot be listed."""
        try:
            with os.scandir(path) as it:
                return list(it)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.unlisted(path, rel, out, exc, ns_cols)
            return None

    def _fanout_name(self, name: str) -> tuple[int, str] | None:
        fan = self._fanouts.get(name)
        if fan is None:
            fan = layout.parse_fanout(name)
            if fan is not None:  # (only real fan-out names are kept: few, bounded)
                self._fanouts[name] = fan
        return fan

    def _bucket_entry(self, v: Visit, fe: os.DirEntry) -> None:
        """One entry of a bucket folder: a fan-out folder, or something else."""
        frel = f"{v.brel}/{fe.name}"
        if not fe.is_dir(follow_symlinks=False):
            self.other_file(fe, frel, v.out, where="bucket folder", ns_cols=v.member.columns)
            return
        fan = self._fanout_name(fe.name)
        if fan is None:
            self.dir_rows(fe.path, frel, v.out, status=None, reason=None, ns_cols=v.member.columns,
                          where="bucket folder")
            return
        self._fanout_folder(v, fe.path, frel, fan)

    def _fanout_folder(self, v: Visit, fpath: str, frel: str, fan: tuple[int, str],
                       files: list[os.DirEntry] | None = None) -> None:
        """The files of one fan-out folder (`fan`: its group and `<hh>`), or just `files` of it.

        The hot loop of the Python walk (a block file of a vLLM / llm-d unit in its right
        fan-out folder) is inlined: one lstat through the DirEntry (or, hashing, one
        open + fstat + read), a few list appends, the size verdict from a per-unit cache.
        """
        unit, m, out, blocks, misc = v.unit, v.member, v.out, v.blocks, v.misc
        group, hh = fan
        fast = unit.plan.fam.header_len == 0
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
        ctimes, carries = out.ctime_ns, out.carried
        baseline = self.baseline
        recheck = baseline is not None and baseline.rechecks(v.hhh)
        rows = baseline.bucket_rows(v.brel) if baseline is not None else None  # (v.brel: the bucket folder)
        unchanged = rows.unchanged if rows is not None else _not_carried
        carried_hashes = rows.hashes if rows is not None else _no_hashes
        prefix = v.hhh + hh  # a block file in its right place starts with these 5 hex
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
                i = self._block_file(v, e, rel, group, hex_hash, misfiled)
            else:
                status = "ok"
                reason = ""
                carried = False
                try:
                    if baseline is not None and not recheck:  # --baseline: stat, read only if it changed
                        st = e.stat(follow_symlinks=False)
                        was = unchanged(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                        carried = was >= 0
                    if carried:
                        content: bytes | None = carried_hashes(was)[0]
                    elif hashed:
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
                    i = self._block_file(v, e, rel, group, hex_hash, False)
                else:
                    size = st.st_size
                    if hashed and not carried and (size == 0 or r.all_zero):
                        status, reason = ("short", "empty file") if size == 0 else (
                            "zero_filled", f"all {size} bytes are zero (crash residue)")
                    elif check_perm and not self._may_read(st):
                        status = "unreadable"
                        reason = (f"cannot read {rel}: [EACCES] permission denied "
                                  f"(mode {stat_mod.S_IMODE(st.st_mode):o}, owner uid {st.st_uid})")
                    elif recheck and (was := unchanged(st.st_dev, st.st_ino, size, st.st_mtime_ns,
                                                       st.st_ctime_ns)) >= 0 and carried_hashes(was)[0] != content:
                        status, reason = "silent_change", SILENT_CHANGE
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
                    ctimes.append(st.st_ctime_ns)
                    carries.append(carried)
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

    def _block_file(self, v: Visit, e: os.DirEntry, rel: str, group: int, hex_hash: str,
                    misfiled: bool) -> int | None:
        """A block file through the general path (misfiled, vllm.cpp, or a stat/read
        error to word): its row index, not yet placed in the order; None if it vanished."""
        m = v.member
        rec = self.entry_record(e, rel, v.out)
        if rec is None:
            return None
        rec.rank, rec.group, rec.hex, rec.member = m.rank, group, hex_hash, v.mi
        try:
            est = e.stat(follow_symlinks=False)  # cached by the DirEntry: no syscall
        except OSError:
            est = None
        if rec.status == "ok" and misfiled:
            rec.status = "misfiled"
            fanout = rel.rsplit("/", 2)[1]
            rec.reason = (f"misfiled: fan-out folders {v.hhh}/{fanout} do not match the file name "
                          f"(it belongs in {layout.fanout_relpath(hex_hash, group)}); never reused")
        if not self._inspect(v.unit.plan, m, rec, e.path, est):
            return None
        rec.action = "none"
        return v.out.add(rec, m.code, emit=False)

    def _inspect(self, plan: UnitPlan, m: Member, rec: FileRecord, path: str,
                 st: os.stat_result | None) -> bool:
        """File-level checks of one block file: read (header, hashes), then size rules.
        False when the file vanished meanwhile."""
        if rec.status != "ok":
            if rec.status == "misfiled" and self.hashed:
                return self.hash_plain(rec, path)
            return True
        fam = plan.fam
        has_header = fam.header_len > 0 and m.ns.status == "ok" and m.ns.digest is not None
        header_len = fam.header_len if has_header and self.verify != "none" else 0
        if not (self.hashed or header_len):
            if self.verify != "none" and st is not None and not self._may_read(st):
                rec.status = "unreadable"
                rec.reason = (f"cannot read {rec.relpath}: [EACCES] permission denied "
                              f"(mode {stat_mod.S_IMODE(st.st_mode):o}, owner uid {st.st_uid})")
                return True
        elif self.hashed and self._carry(rec):
            pass  # unchanged since the baseline: its hashes, and its header was valid then
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
                rec.ctime_ns = st.st_ctime_ns
            rec.content = r.content
            if has_header:
                rec.payload = r.payload
            if self.verify == "none":
                return True
            all_zero = r.all_zero
            if (not self.hashed and has_header and r.header and len(r.header) == fam.header_len
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
            if has_header:
                if rec.size < fam.header_len:
                    rec.status, rec.reason = "short", (f"{rec.size} bytes, shorter than the "
                                                       f"{fam.header_len}-byte header")
                    return True
                check = fam.header_check(r.header or b"", digest=m.ns.digest or b"",
                                         payload_size=plan.payload_bytes or 0, hex_hash=rec.hex or "",
                                         group=rec.group or 0)
                if check is not None:
                    rec.status = "header_invalid"
                    rec.reason = f"header check '{check}' failed: the {fam.title} reader deletes this file"
                    return True
            if self.baseline is not None and self._rechecked(rec):
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


def _bucket_of(relpath: str) -> str | None:
    """The innermost `<hhh>` folder of a path (the --recheck rotation goes by bucket)."""
    parts = relpath.split("/")
    for name in reversed(parts[:-1]):
        if layout.BUCKET_RE.match(name):
            return name
    return None


def shard_part(bucket: str | None, n: int) -> int:
    """Shard part of a bucket: int(hhh, 16) % N; files outside buckets belong to part 0."""
    if bucket is None or n <= 1:
        return 0
    return int(bucket, 16) % n


def _not_carried(dev: int, ino: int, size: int, mtime_ns: int, ctime_ns: int | None) -> int:
    """`Baseline.unchanged` without a baseline: no row."""
    return -1


def _no_hashes(i: int) -> tuple[bytes, bytes | None]:
    """`Baseline.hashes` without a baseline: never asked (no row is carried)."""
    raise LookupError(f"no --baseline row {i}")
