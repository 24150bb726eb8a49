"""The write-ahead journal of a migration (migration.md §3.5): compressed record frames.

Format 3 (this release) is format 2 with a Mooncake store's intent written as a head
and part records (`mc_part`, migrate/stores.py): a reader holds a part, not the whole
intent (~1 KB a resharded block). Readers take all three formats.

Format 2: a sequence of frames `KVJF <payload length u32> <crc32 u32>
<payload>`, the payload a zlib-compressed block of JSON lines (one frame per write: a
batch's intent, a batch's done records, ...). A frame cut short or failing its CRC (kill -9
mid-write, power loss) ends the journal: it and anything after it are ignored, and the
next writer truncates it away before appending. The hot record, a hard link, is journaled
columnar: one `linked` record per batch names the intent frame (`at`: its byte offset) and
the items of it that were linked, with each link's mtime and hash; the readers expand it
into the same `done` records format 1 wrote. That is 80-90 bytes per linked block (format
1: about 850). Format 1 journals (JSON lines, kvmigrate 0.1.0 before format 2) stay
readable by rollback and verify; they are not resumed (`find_resumable` says so).

Record types, in the order a run writes them:

    header    run id, command line, manifest, root, dest, target profile, identity
    resume    a later process continuing the same run (pid, command)
    target    a target namespace: base folder, family, identity digest (for rewrites)
    intent    fsynced BEFORE a batch of creations: every path the batch may create
              (folders that did not exist, config.json, block files with their source)
    done      after a creation: path, inode, size, xxh3_128 of the output (folders:
              one record `kind: dirs` with the paths a batch created)
    lock      the lock file of a target base folder was created
    mc_*      a Mooncake store's proofs, intent and work (migrate/stores.py lists them)
    skip      a block not created (conflict, changed_since_scan, failed) and why
    complete  the run finished (outcome counts); a complete run is never resumed
    rolled_back  `kvmigrate rollback` removed what the run created

A file may hold several runs (one `header` each); rollback and verify take them all.
Anything at a final path that an intent lists but no `done` covers is settled by
`reconcile`: it is the run's own output only if that can be proven (same inode as the
source for a link, same inode as the run's own temp file, or exactly the bytes the
action produces). Nothing else is ever claimed.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import struct
import tempfile
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvmigrate import layout, scratch
from kvmigrate.errors import OperationalError, UsageError, write_error

VERSION = 3
FRAMED = 2  # the first format of frames (resumable)
FRAME = struct.Struct("<4sII")  # magic, payload length, crc32 of the payload
MAGIC = b"KVJF"
V1_RELEASE = "kvmigrate 0.1.0 before journal format 2"  # who wrote JSON-lines journals
_ZLEVEL = 4  # 20k-link journal: level 4 90.8 B and 5.6 µs per block, level 6 89.8 B and 27.9 µs
JOURNALS_DIR = os.path.join(layout.OWN_DIR, "journals")
# A journal file is compressed binary frames, not JSON lines: new ones are `<run>.journal`;
# `.jsonl`, the name format 1 (JSON lines) gave them, stays readable where it is found.
SUFFIX = ".journal"
LEGACY_SUFFIX = ".jsonl"


def is_journal_name(name: str) -> bool:
    """A journal's file name (either suffix)."""
    return name.endswith(SUFFIX) or name.endswith(LEGACY_SUFFIX)


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def default_journal_dir(root: str) -> str:
    return os.path.join(root, JOURNALS_DIR)


def owning_root(journal_path: str) -> str | None:
    """The root a journal in a root's own journal folder belongs to: ROOT for
    ROOT/.kvmigrate/journals/J and ROOT/.kvmigrate/journals/prune/J; None elsewhere (a
    --journal outside the root names its root in its header only)."""
    folder = os.path.dirname(os.path.abspath(journal_path))
    if os.path.basename(folder) == "prune":
        folder = os.path.dirname(folder)
    own = os.path.dirname(folder)
    if os.path.basename(folder) == "journals" and os.path.basename(own) == layout.OWN_DIR:
        return os.path.dirname(own)
    return None


def rebased(header: dict[str, Any], journal_path: str) -> dict[str, Any]:
    """The header with its root (and a destination that was the root) moved to where the
    journal now lives: a root copied or moved with its journals (cp -a, a restored backup)
    is the copy's, so its rollback, restore and verify act on the copy and consult the
    copy's other journals, never the original root's. Paths in records are relative."""
    root = owning_root(journal_path)
    old = header.get("root")
    if root is None or not isinstance(old, str) or os.path.realpath(old) == os.path.realpath(root):
        return header
    out = {**header, "root": root, "moved_from": old}
    if isinstance(header.get("dest"), str) and os.path.realpath(header["dest"]) == os.path.realpath(old):
        out["dest"] = root
    return out


def journal_files(path: str) -> list[str]:
    """A journal file, or every journal (`*.journal`, `*.jsonl`) in a directory (sorted). In a
    directory, a file whose header line never reached the disk (a run killed between
    creating its journal and writing the header) is skipped: the header is fsynced
    before any intent, so that run created nothing."""
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if is_journal_name(f))
        files = [f for f in files if _has_header_line(f)]
        if not files:
            raise UsageError(f"no journals (*{SUFFIX}) in {path}", path=path,
                             hint="pass the journal or journal directory `migrate --apply` printed")
        return files
    if not os.path.exists(path):
        raise UsageError(f"journal not found: {path}", path=path,
                         hint="pass the journal or journal directory `migrate --apply` printed")
    return [path]


def _has_header_line(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            if is_framed(f):
                return next(_frames(f), None) is not None
            return f.readline().endswith(b"\n")
    except OSError:
        return True  # let the reader report it


def is_framed(f: Any) -> bool:
    """Format 2 (frames) rather than format 1 (JSON lines); leaves `f` at its start."""
    f.seek(0)
    head = f.read(len(MAGIC))
    f.seek(0)
    return head == MAGIC


def _frame_head(f: Any) -> tuple[int, int] | None:
    """(payload length, CRC) of the frame at the file's position; None at its end or where
    no frame begins."""
    head = f.read(FRAME.size)
    if len(head) < FRAME.size:
        return None
    magic, length, crc = FRAME.unpack(head)
    return (length, crc) if magic == MAGIC else None


def _frames(f: Any) -> Iterator[tuple[int, bytes]]:
    """(offset, decompressed payload) of every whole frame; stops at the first torn or
    corrupt one (a torn tail)."""
    offset = f.tell()
    while (found := _frame_head(f)) is not None:
        length, crc = found
        payload = f.read(length)
        if len(payload) < length or zlib.crc32(payload) != crc:
            return
        try:
            data = zlib.decompress(payload)
        except zlib.error:
            return
        yield offset, data
        offset += FRAME.size + length


_PIECE = 1 << 20  # bytes of a frame read, and decompressed, at a time (`_wanted_lines`)


class _WantedLines:
    """The lines of a stream fed in pieces that start with one of `wanted` (`got`): a line
    is kept only once its first bytes show it is wanted. `cut` (prefix, opening, closing):
    a wanted line with that prefix loses what lies between the first `opening` and the
    next `closing` (a Mooncake intent's reshards array, which verify and rollback never
    read: ~3 KB a block), and that part is never held either. `skip`: prefixes of lines not
    wanted after all."""

    def __init__(self, wanted: tuple[bytes, ...], cut: tuple[bytes, bytes, bytes] | None = None,
                 skip: tuple[bytes, ...] = ()) -> None:
        self.wanted, self.skip, self.longest = wanted, skip, max(map(len, wanted + skip))
        self.cut = cut
        self.got: list[bytes] = []
        self.line = b""  # the line so far
        self.keep: bool | None = None  # whether it is wanted: None until its first bytes are known
        self.cutting = 0  # 0: no cut (yet), 1: looking for the opening, 2: dropping until the closing, 3: done
        self.dropped = b""  # (while dropping: the last bytes, where a closing may begin)

    def feed(self, data: bytes) -> None:
        start = 0
        while True:
            nl = data.find(b"\n", start)
            part = data[start:] if nl < 0 else data[start:nl]
            if self.keep is None:
                self.line += part
                if len(self.line) >= self.longest or nl >= 0:
                    self.keep = self._wanted(self.line)
                    if not self.keep:
                        self.line = b""
                    elif self.cut is not None and self.line.startswith(self.cut[0]):
                        self.cutting = 1
                        held, self.line = self.line, b""
                        self._add(held)
            elif self.keep:
                self._add(part)
            if nl < 0:
                return
            if self.keep:
                self.got.append(self.line + (self.dropped if self.cutting == 2 else b""))
            self.line, self.keep, self.cutting, self.dropped = b"", None, 0, b""
            start = nl + 1

    def _wanted(self, line: bytes) -> bool:
        return line.startswith(self.wanted) and not (self.skip and line.startswith(self.skip))

    def _add(self, part: bytes) -> None:
        """Part of a kept line, less what its cut drops."""
        if self.cutting in (0, 3):
            self.line += part
            return
        assert self.cut is not None
        _, opening, closing = self.cut
        if self.cutting == 1:
            seen = len(self.line)
            self.line += part
            at = self.line.find(opening, max(0, seen - len(opening) + 1))
            if at < 0:
                return
            self.cutting, rest = 2, self.line[at + len(opening):]
            self.line = self.line[:at + len(opening)]
            part = rest
            self.dropped = b""
        held = self.dropped + part
        at = held.find(closing)
        if at < 0:
            self.dropped = held[-(len(closing) - 1):] if len(closing) > 1 else b""
            return
        self.cutting, self.dropped = 3, b""
        self.line += held[at:]

    def end(self) -> list[bytes]:
        """The wanted lines, with a last one that has no newline (as `splitlines` gives it)."""
        if self.keep is None and self._wanted(self.line):
            self.keep, held, self.line = True, self.line, b""
            if self.cut is not None and held.startswith(self.cut[0]):
                self.cutting = 1
            self._add(held)
        if self.keep and (self.line or self.cutting == 2):
            self.got.append(self.line + (self.dropped if self.cutting == 2 else b""))
        return self.got


def _wanted_lines(f: Any, wanted: tuple[bytes, ...], cut: tuple[bytes, bytes, bytes] | None = None
                  ) -> Iterator[bytes]:
    """The lines starting with one of `wanted` of every whole frame (`_frame_lines`)."""
    for _, lines in _frame_lines(f, wanted, cut):
        yield from lines


def _frame_lines(f: Any, wanted: tuple[bytes, ...], cut: tuple[bytes, bytes, bytes] | None = None,
                 skip: tuple[bytes, ...] = ()) -> Iterator[tuple[int, list[bytes]]]:
    """(offset, lines) of every whole frame, as `_frames` reads them (a frame's lines once
    its CRC proved it; none from the first torn or corrupt frame on), its lines those
    starting with one of `wanted` and none of `skip` (`_WantedLines`), read and
    decompressed a piece at a time: only those lines are held. A Mooncake store's intent
    is one line of ~3 KB a resharded block in a frame of its own; the run states a report
    or prune asks for are a few short lines around it."""
    offset = f.tell()
    while (found := _frame_head(f)) is not None:
        length, crc = found
        z = zlib.decompressobj()
        lines = _WantedLines(wanted, cut, skip)
        seen, left = 0, length
        try:
            while left:
                piece = f.read(min(_PIECE, left))
                if not piece:
                    return  # (torn)
                left -= len(piece)
                seen = zlib.crc32(piece, seen)
                lines.feed(z.decompress(piece, _PIECE))
                while z.unconsumed_tail:  # (a piece of a long run of like bytes inflates a thousandfold)
                    lines.feed(z.decompress(z.unconsumed_tail, _PIECE))
            lines.feed(z.flush())
        except zlib.error:
            return
        if seen != crc or not z.eof:
            return
        yield offset, lines.end()
        offset += FRAME.size + length


def valid_end(path: str) -> int:
    """Byte length of a framed journal's whole frames (where a torn tail begins), each read
    and inflated a piece at a time (a store's intent is a frame of ~1 KB a block)."""
    end = 0
    with open(path, "rb") as f:
        for pieces, z in _proven_frames(f):
            try:
                for _ in pieces:
                    pass
            except zlib.error:
                break
            if not z.eof:
                break
            end = f.tell()
    return end


def _proven_frames(f: Any) -> Iterator[tuple[Iterator[bytes], Any]]:
    """(its payload inflated a piece at a time, the decompressor: `eof` once it all came) of
    each frame whose CRC a first pass over its compressed bytes proves, until the first
    torn or corrupt one. Each payload must be read before the next frame is asked for."""
    while (found := _frame_head(f)) is not None:
        start = f.tell()
        if not _crc_proven(f, *found):
            return
        f.seek(start)
        z = zlib.decompressobj()
        yield _inflated(f, found[0], z), z


def _crc_proven(f: Any, length: int, crc: int) -> bool:
    """The `length` bytes at the file's position are whole and match `crc`, read a piece
    at a time; leaves the file after them."""
    seen = 0
    while length:
        piece = f.read(min(_PIECE, length))
        if not piece:
            return False  # (torn)
        length -= len(piece)
        seen = zlib.crc32(piece, seen)
    return seen == crc


def _inflated(f: Any, length: int, z: Any) -> Iterator[bytes]:
    """The `length` compressed bytes at the file's position inflated by `z`, at most
    _PIECE at a time (a piece of like bytes inflates a thousandfold), then `z`'s flush."""
    while length:
        piece = f.read(min(_PIECE, length))
        length -= len(piece)
        while piece:
            yield z.decompress(piece, _PIECE)
            piece = z.unconsumed_tail
    yield z.flush()


def _raw_records(path: str, skip: tuple[bytes, ...] = ()) -> Iterator[tuple[int, dict[str, Any]]]:
    """(offset of its frame, record) as written, either format (format 1: offset 0).
    `skip`: prefixes of a framed journal's lines left unread (`_frame_lines`)."""
    with open(path, "rb") as f:
        if is_framed(f):
            frames = ((o, d.splitlines()) for o, d in _frames(f)) if not skip else _frame_lines(f, (b"",), skip=skip)
            for offset, lines in frames:
                try:
                    recs = [json.loads(line) for line in lines]
                except ValueError:  # a whole frame, but not one this tool wrote: the journal ends here
                    return
                for rec in recs:
                    yield offset, rec
            return
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            yield 0, rec


def iter_framed(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(offset of its frame, record) of a framed journal (format 2 or 3), records as
    written: a reader that comes back to a frame later (`frame_records`) keeps offsets, not records."""
    with open(path, "rb") as f:
        framed = is_framed(f)
    return _raw_records(path) if framed else iter(())


def frame_records(path: str, offset: int) -> list[dict[str, Any]]:
    """The records of the one frame at `offset` of a framed journal (`iter_framed`)."""
    with open(path, "rb") as f:
        f.seek(offset)
        for _, data in _frames(f):
            return [json.loads(line) for line in data.splitlines()]
    return []


def read_records(path: str) -> list[dict[str, Any]]:
    """All records of a journal file; a torn tail (kill -9 mid-write) is ignored."""
    return list(iter_records(path))


def iter_records(path: str, *, linked: bool = True, skip: tuple[bytes, ...] = ()) -> Iterator[dict[str, Any]]:
    """The records of a journal file one by one, as format 1 wrote them (a `linked`
    batch record comes out as one `done` record per link). `linked=False`: for a
    journal with no `linked` record (a prune's), no intent frame is kept for them.
    `skip`: prefixes of a framed journal's records left unread (`_raw_records`)."""
    first = True
    # frame offset -> intent items: the last few, as many as a writer refers to (bounded memory)
    intents: OrderedDict[int, list[dict[str, Any]]] = OrderedDict()
    for offset, rec in _raw_records(path, skip):
        if not (isinstance(rec, dict) and "t" in rec):
            continue
        t = rec["t"]
        if first:
            if t != "header":
                break
            if isinstance(rec.get("v"), int) and rec["v"] > VERSION:
                raise UsageError(f"{path} was written by a newer kvmigrate (journal format {rec['v']}; this release "
                                 f"reads formats 1 and {VERSION})", path=path,
                                 hint="use the kvmigrate release that wrote it")
        first = False
        if t in ("header", "resume"):  # a writer refers only to intents it wrote itself
            intents.clear()
        elif t == "intent" and linked:
            intents[offset] = rec.get("items", [])
            if len(intents) > JournalWriter._SLOTS:
                intents.popitem(last=False)
        elif t == "linked":
            yield from _expand_linked(rec, intents)
            continue
        yield rec
    if first:
        raise UsageError(f"{path} is not a kvmigrate journal (no header record)", path=path,
                         hint="pass the journal or journal directory `migrate --apply` printed")


def _expand_linked(rec: dict[str, Any], intents: dict[int, list[dict[str, Any]]]) -> Iterator[dict[str, Any]]:
    """The `done` records of a `linked` batch record: each link has its intent item's
    path, source identity and action (a link is the source's inode)."""
    items = intents[rec["at"]]
    mtimes, hashes = rec["mtime_ns"], rec["xxh3_128"]
    k = 0
    mtime = 0
    for start, count in rec["i"]:
        for item in items[start:start + count]:
            mtime += mtimes[k]  # delta-encoded
            done = {"t": "done", "kind": "block", "path": item["path"], "ino": item["ino"], "dev": item["dev"],
                    "size": item["size"], "mtime_ns": mtime, "how": "link", "action": item["action"]}
            if hashes[k]:
                done["xxh3_128"] = hashes[k]
            k += 1
            yield done


@dataclass
class Run:
    """One run inside a journal file, with what it created."""

    header: dict[str, Any]
    journal: str = ""  # the file it was read from
    targets: dict[str, dict[str, Any]] = field(default_factory=dict)  # base -> target record
    intents: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> intent item
    done: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> done record (last wins)
    locks: list[str] = field(default_factory=list)
    store_records: list[dict[str, Any]] = field(default_factory=list)  # Mooncake stores' `mc_*` (migrate/stores.py)
    stored_in_file: bool = False  # `stream_runs`: it has store records, left in the file (`store_records`)
    stores: set[str] = field(default_factory=set)  # the Mooncake stores the run wrote (kept without paths too)
    complete: dict[str, Any] | None = None
    rolled_back: bool = False
    # read by `stream_runs` (per-path records left in the file): where the run's records
    # are in its file's record stream, and the partial rollbacks after them
    span: tuple[int, int] = (0, 0)  # (position of its header, of the next run's header)
    drops: list[tuple[int, set[str]]] = field(default_factory=list)  # (position, targets) of `rolled_back`

    @property
    def dest(self) -> str:
        return self.header["dest"]

    @property
    def root(self) -> str:
        return self.header["root"]

    def pending(self) -> list[dict[str, Any]]:
        """Intent items without a done record, in intent order."""
        return [item for path, item in self.intents.items() if path not in self.done]

    def target_of(self, relpath: str) -> str | None:
        """The target a journaled path belongs to: its base folder, or the target its
        intent names (a flat target's page files sit in the destination directory)."""
        folder = layout.parse_folder(relpath.split("/", 1)[0])
        return folder.base if folder is not None else (self.intents.get(relpath) or {}).get("base")

    def created(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.done.values() if d.get("kind") == kind]


DAMAGED = (KeyError, TypeError, AttributeError, IndexError)  # valid JSON, but not records this tool wrote


def damaged(path: str, exc: Exception) -> UsageError:
    """The error of a journal whose records parse but lack or mistype a field."""
    return UsageError(f"{path}: damaged journal (a record lacks or mistypes {exc})", path=path,
                      hint="pass a journal `migrate --apply` wrote; an edited journal cannot be trusted")


def load_runs(path: str, *, paths: bool = True, stores: bool = True) -> list[Run]:
    """The runs of a journal file. `paths=False` leaves out what each run intended and
    did per path (every record is still checked): the run states only, in bounded memory.
    `stores=False`: no store record is held (`stream_runs` and `store_records` read them)
    and no intent part is read."""
    try:
        if not stores:
            return _load_runs(path, paths, iter_records(path, skip=(_PARTS,)), stores=False)
        return _load_runs(path, paths)
    except DAMAGED as exc:
        raise damaged(path, exc) from None


# the records that make a run's state (`load_runs(paths=False)` of them alone is the same):
# a framed journal's other lines (intents, links: ~all of its bytes) are never parsed
_STATE_RECORDS = tuple(b'{"t":"%s"' % t for t in (b"header", b"target", b"lock", b"complete", b"rolled_back",
                                                  b"resume"))


def run_states(path: str) -> list[Run]:
    """The runs of a journal file, their states only (headers, targets, completion,
    rollback), without parsing a path record: what `prune` and the reports' reclaimable
    figures need (0.8 s for a journal of 200,000 links through `load_runs`)."""
    with open(path, "rb") as f:
        if not is_framed(f):
            return load_runs(path, paths=False)
        recs = [json.loads(line) for line in _wanted_lines(f, _STATE_RECORDS)]
    if not recs or recs[0].get("t") != "header":
        return []
    if isinstance(recs[0].get("v"), int) and recs[0]["v"] > VERSION:
        return load_runs(path, paths=False)  # says which release to use
    try:
        return _load_runs(path, False, recs)
    except DAMAGED as exc:
        raise damaged(path, exc) from None


def _load_runs(path: str, keep: bool = True, records: Any = None, stores: bool = True) -> list[Run]:
    runs: list[Run] = []
    for rec in iter_records(path) if records is None else records:
        t = rec["t"]
        if t == "header":
            if not isinstance(rec.get("root"), str) or not isinstance(rec.get("dest"), str):
                raise KeyError("root/dest in the header")
            runs.append(Run(header=rebased(rec, path), journal=path))
            continue
        run = runs[-1]
        if t == "target":
            run.targets[rec["base"]] = rec
        elif t == "intent":
            for item in rec.get("items", []):
                path = item["path"]  # read either way: a damaged record makes the file unusable
                if keep:
                    run.intents[path] = item
        elif t == "done" and rec.get("kind") == "dirs":
            for path in rec.get("paths", []):
                if keep:
                    run.done[path] = {"kind": "dir", "path": path}
        elif t == "done":
            path = rec["path"]
            if keep:
                run.done[path] = rec
        elif t == "lock":
            run.locks.append(rec["path"])
        elif t == "mc_part":  # (a format-3 intent held whole again: the form format 2 wrote)
            items = rec["items"]
            if keep and stores:
                intent = next((r for r in reversed(run.store_records) if r["t"] == "mc_intent"), None)
                if intent is None:
                    raise KeyError("mc_intent before its parts")
                intent.setdefault(rec["of"], []).extend(items)
        elif t.startswith("mc_"):
            if t == "mc_intent":
                run.stores.add(rec["store"])
            if keep and stores and rec.get("parts"):
                run.store_records.append({k: v for k, v in rec.items() if k != "parts"} |
                                         {name: [] for name in INTENT_ARRAYS})
            elif keep and stores:
                run.store_records.append(rec)
        elif t == "complete":
            run.complete = rec
        elif t == "rolled_back" and rec.get("targets") is not None:
            # a rollback of some targets (--only/--exclude): they are no run's any more
            for r in runs:
                _drop_targets(r, set(rec["targets"]))
        elif t == "rolled_back":
            # rollback applies to every run before it in the file
            for r in runs:
                r.rolled_back = True
        elif t == "resume":
            run.complete = None
    return runs


def _drop_targets(run: Run, bases: set[str]) -> None:
    """Forget what a run made in `bases` (rolled back by a rollback of those targets only):
    a later rollback, verify or resume must not take what another run makes there since."""
    if not bases & set(run.targets):
        return
    run.done = {p: r for p, r in run.done.items() if run.target_of(p) not in bases}
    run.intents = {p: r for p, r in run.intents.items() if run.target_of(p) not in bases}
    run.locks = [p for p in run.locks if (p.rsplit("/", 1)[0] if "/" in p else "") not in bases]
    run.targets = {b: r for b, r in run.targets.items() if b not in bases}
    if not run.targets:
        run.rolled_back = True


def identity_matches(header: dict[str, Any], identity: dict[str, Any]) -> bool:
    return header.get("identity") == identity


def find_resumable(journal: str, identity: dict[str, Any]) -> str | None:
    """The newest unfinished journal with the same identity (root, dest, target profile,
    manifest), in a journal file or directory; None if there is none."""
    if os.path.isdir(journal):
        candidates = sorted((os.path.join(journal, f) for f in os.listdir(journal) if is_journal_name(f)),
                            key=lambda p: os.stat(p).st_mtime_ns, reverse=True)
    elif os.path.isfile(journal):
        candidates = [journal]
    else:
        return None
    for path in candidates:
        try:
            runs = load_runs(path, paths=False, stores=False)  # (every record checked, none held)
        except (UsageError, OSError):
            continue
        last = runs[-1]
        if last.complete is None and not last.rolled_back and identity_matches(last.header, identity):
            if last.header.get("v", 1) < FRAMED:
                raise UsageError(f"the unfinished run in {path} was journaled by {V1_RELEASE} (journal format 1), "
                                 "which this release does not resume", path=path,
                                 hint=f"finish it with the release that started it, or undo it with "
                                      f"`kvmigrate rollback {path}`, then rerun")
            return path
    return None


# one encoder for every record (json.dumps with options builds a new one per call); ASCII
# output (non-ASCII as \u escapes, same values) encodes twice as fast
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


class JournalWriter:
    """Appends records; `intent` and `sync` fsync, `done` records are buffered and
    written with the next other record or sync (a batch is fsynced once at its end), so
    the journal never lags behind the tree by more than one batch and every creation is
    preceded by a durable intent. A done record lost to a kill is no loss: resume finds
    the intended path made and adopts it (`reconcile.reconcile_item`).

    Each flush is one frame (formats 2 and 3). Links are held as columns per intent frame and
    written as one `linked` record each; a format-1 journal reopened to add a record
    (rollback's `rolled_back`) gets a JSON line, its own format."""

    _BUFFERED = 4096  # done records held before a write (one write per batch, not per block)
    _SLOTS = 4  # intent frames whose block paths are remembered for `done_link`

    def __init__(self, path: str, fd: int, *, framed: bool = True, end: int = 0):
        self.path = path
        self._fd = fd
        self._framed = framed
        self.version = VERSION  # the format of the file's first run: a run appended keeps to it
        self._end = end  # file size: the offset of the next frame
        self._pending: list[bytes] = []
        self._slots: OrderedDict[int, dict[str, int]] = OrderedDict()  # intent offset -> {path: item index}
        self._intent_items: dict[int, list[dict[str, Any]]] = {}
        self._links: dict[int, tuple[list[int], list[int], list[str]]] = {}  # offset -> (index, mtime, hash)
        self._held = 0

    @classmethod
    def create(cls, path: str, header: dict[str, Any], *,
               read_only: Callable[[], str | None] | None = None) -> JournalWriter:
        """A new journal file (or a new run appended to an existing journal file).
        `read_only()`: on a read-only filesystem, the hint where --journal elsewhere would
        not help, or None where it would (errors.write_error)."""
        parent = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(parent, exist_ok=True)
            existed = os.path.exists(path)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise write_error(exc, "cannot create the journal", path,
                              read_only=read_only() if read_only and exc.errno == errno.EROFS else None,
                              elsewhere="pass --journal PATH on a writable filesystem") from None
        w = cls(path, fd)
        w._lock()
        if existed and os.fstat(fd).st_size:
            if not _framed_file(path):
                os.close(w._fd)
                w._fd = -1
                raise UsageError(f"{path} is a journal of {V1_RELEASE} (format 1); a new run cannot be added to it",
                                 path=path, hint="pass a new --journal path (or a directory)")
            w._truncate_torn_tail()
            w.version = min(VERSION, _header_version(path))  # (a release reads the format of a file's first header)
        w.write({"t": "header", "v": w.version, **header}, sync=True)
        if not existed:
            _fsync_dir(parent)
        return w

    @classmethod
    def append(cls, path: str) -> JournalWriter:
        """Reopen an existing journal to add records (a torn tail is cut off first)."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise OperationalError(f"cannot reopen the journal: {exc.strerror}", path=path) from None
        w = cls(path, fd, framed=_framed_file(path))
        w._lock()
        w._truncate_torn_tail()
        w.version = _header_version(path)
        return w

    def _lock(self) -> None:
        """One process per journal: a run holds an flock on its journal for its whole
        life, so a second run of the same command (or a rollback) cannot resume or
        append to a journal whose run is still going."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = -1
            holder = _last_pid(self.path)
            who = f"pid {holder}" if holder else "another process"
            raise OperationalError(f"the journal is in use by another kvmigrate run ({who})", path=self.path,
                                   hint=f"wait for {who} to finish, then rerun") from None

    @classmethod
    def resume(cls, path: str, record: dict[str, Any]) -> JournalWriter:
        w = cls.append(path)
        w.write({"t": "resume", **record}, sync=True)
        return w

    def _truncate_torn_tail(self) -> None:
        """Format 2: cut a torn or corrupt last frame, so new frames follow whole ones
        (readers stop at the first bad frame). Format 1: end a torn last line."""
        if not self._framed:
            with open(self.path, "rb") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n":
                    os.write(self._fd, b"\n")
            return
        end = valid_end(self.path)
        if os.fstat(self._fd).st_size != end:
            if _whole_frame_after(self.path, end):
                os.close(self._fd)
                self._fd = -1
                raise OperationalError(f"the journal is damaged at byte {end} (whole records follow a bad one: "
                                       "not a torn tail); not writing to it", path=self.path,
                                       hint="keep it for inspection; `kvmigrate verify` and `rollback --dry-run` "
                                            "read the records before the damage")
            os.ftruncate(self._fd, end)
            os.fsync(self._fd)
        self._end = end

    def write(self, rec: dict[str, Any], sync: bool = False) -> None:
        self._pending.append(_ENCODE(rec).encode() + b"\n")
        self._flush(sync)

    def write_parts(self, parts: Iterable[str], sync: bool = False) -> None:
        """One record whose JSON text comes in `parts` (joined, `_ENCODE` of the record):
        the frame `write` would make, its payload compressed as the parts come into a
        temporary file, so a record of any length (a Mooncake store's whole intent) is
        never held as one string."""
        head = [_ENCODE(rec).encode() + b"\n" for rec in self._linked_records()] + self._pending
        self._pending = []
        self._held = 0
        lines = itertools.chain(head, (p.encode() for p in parts), (b"\n",))
        try:
            if not self._framed:
                for line in lines:
                    self._write_all(line)
            else:
                z = zlib.compressobj(_ZLEVEL)
                crc = length = 0

                def compressed() -> Iterator[bytes]:
                    yield from (z.compress(line) for line in lines)
                    yield z.flush()  # (after the last line: the stream's end)

                with scratch.spilling("a journal record's compressed text", "a Mooncake store's intent takes "
                                      "about a hundred bytes a resharded block there"):
                    tmp = tempfile.TemporaryFile(dir=scratch.tmpdir())  # noqa: SIM115 (closed below)
                    for chunk in compressed():
                        if chunk:
                            tmp.write(chunk)
                            crc = zlib.crc32(chunk, crc)
                            length += len(chunk)
                    tmp.seek(0)
                with tmp:
                    self._write_all(FRAME.pack(MAGIC, length, crc))
                    while block := tmp.read(1 << 20):
                        self._write_all(block)
            if sync:
                os.fsync(self._fd)
        except OSError as exc:
            raise self._cannot_write(exc) from None

    def _cannot_write(self, exc: OSError) -> OperationalError:
        what = (exc.strerror or str(exc)).lower()
        return OperationalError(f"cannot write the journal: {what}", path=self.path,
                                hint="free space on the journal's filesystem, then rerun the same command to resume")

    def _write_all(self, data: bytes) -> None:
        self._end += len(data)
        while data:
            n = os.write(self._fd, data)
            data = data[n:]

    def _flush(self, sync: bool = False) -> None:
        lines = [_ENCODE(rec).encode() + b"\n" for rec in self._linked_records()] + self._pending
        self._pending = []
        self._held = 0
        if not lines:
            data = b""
        elif self._framed:
            payload = zlib.compress(b"".join(lines), _ZLEVEL)
            data = FRAME.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload
        else:
            data = b"".join(lines)
        try:
            self._write_all(data)
            if sync:
                os.fsync(self._fd)
        except OSError as exc:
            raise self._cannot_write(exc) from None

    def intent(self, items: list[dict[str, Any]]) -> None:
        if not items:
            return
        self._flush()  # what is held goes first: the intent is a frame of its own (its offset names it)
        at = self._end
        self.write({"t": "intent", "items": items}, sync=True)
        if self._framed:
            self._slots[at] = {item["path"]: i for i, item in enumerate(items) if item.get("kind") == "block"}
            self._intent_items[at] = items
            while len(self._slots) > self._SLOTS:
                old, _ = self._slots.popitem(last=False)
                self._intent_items.pop(old, None)

    def done(self, rec: dict[str, Any]) -> None:
        self._pending.append(_ENCODE({"t": "done", **rec}).encode() + b"\n")
        self._hold()

    def _hold(self) -> None:
        self._held += 1
        if self._held >= self._BUFFERED:
            self._flush()

    def done_link(self, path: str, st: os.stat_result, action: str, xxh3_128: bytes | None) -> None:
        """`done` of a hard-linked block: a row of its intent frame's `linked` columns
        when its intent item names the very inode (always, for a link this run made),
        else a whole record."""
        for at, index in reversed(self._slots.items()):
            i = index.get(path)
            if i is None:
                continue
            item = self._intent_items[at][i]
            if (item.get("ino"), item.get("dev"), item.get("size"), item.get("action")) == \
                    (st.st_ino, st.st_dev, st.st_size, action):
                cols = self._links.setdefault(at, ([], [], []))
                cols[0].append(i)
                cols[1].append(st.st_mtime_ns)
                cols[2].append(xxh3_128.hex() if xxh3_128 is not None else "")
                return self._hold()
            break
        rec = {"kind": "block", "path": path, "ino": st.st_ino, "dev": st.st_dev, "size": st.st_size,
               "mtime_ns": st.st_mtime_ns, "how": "link", "action": action}
        if xxh3_128 is not None:
            rec["xxh3_128"] = xxh3_128.hex()
        self.done(rec)

    def _linked_records(self) -> Iterator[dict[str, Any]]:
        """The held links as one `linked` record per intent frame: item index ranges,
        mtimes delta-encoded (they differ little), hashes."""
        links, self._links = self._links, {}
        for at, (index, mtimes, hashes) in links.items():
            order = sorted(range(len(index)), key=index.__getitem__)
            ranges: list[list[int]] = []
            deltas, prev = [], 0
            for k in order:
                i = index[k]
                if ranges and ranges[-1][0] + ranges[-1][1] == i:
                    ranges[-1][1] += 1
                else:
                    ranges.append([i, 1])
                deltas.append(mtimes[k] - prev)
                prev = mtimes[k]
            yield {"t": "linked", "at": at, "i": ranges, "mtime_ns": deltas, "xxh3_128": [hashes[k] for k in order]}

    def sync(self) -> None:
        self._flush(sync=True)

    def close(self) -> None:
        if self._fd >= 0:
            if self._pending or self._links:
                self._flush()
            os.close(self._fd)
            self._fd = -1


def _whole_frame_after(path: str, end: int) -> bool:
    """A whole frame starts somewhere after byte `end` (so the bad bytes at `end` are
    damage in the middle, never a torn tail: truncating would drop journaled records)."""
    with open(path, "rb") as f:
        f.seek(end + 1)
        rest = f.read()
    at = rest.find(MAGIC)
    while at >= 0:
        with open(path, "rb") as f:
            f.seek(end + 1 + at)
            if next(_frames(f), None) is not None:
                return True
        at = rest.find(MAGIC, at + 1)
    return False


def _framed_file(path: str) -> bool:
    with open(path, "rb") as f:
        return is_framed(f) or os.fstat(f.fileno()).st_size == 0


def _header_version(path: str) -> int:
    """The journal format its first header states (a format-2 journal resumed by this
    release is written in format 2: the release that started it reads all of it)."""
    try:
        for _, rec in _raw_records(path):  # (its first frame only)
            v = rec.get("v") if isinstance(rec, dict) else None
            return v if isinstance(v, int) else 1
    except OSError:
        pass
    return VERSION


def _last_pid(path: str) -> int | None:
    try:
        pids = [r.get("pid") for r in read_records(path) if r["t"] in ("header", "resume")]
    except (UsageError, OSError):
        return None
    return pids[-1] if pids else None


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def iter_runs(path: str) -> Iterator[tuple[str, Run]]:
    """(journal file, run) for every run in a journal file or directory."""
    for f in journal_files(path):
        for run in load_runs(f):
            yield f, run


# --- streaming: a run's per-path records read from its file when needed, never held ---


# the records `stream_runs` decodes: a run's states and the store records that begin a
# store's work (migrate/store_apply.py writes every other one after its intent), not those
# that grow with its blocks (each frame's wanted lines are held until its CRC is proven)
_STREAM_RECORDS = (*_STATE_RECORDS, b'{"t":"mc_store"', b'{"t":"mc_dir"', b'{"t":"mc_intent"')
_PARTS = b'{"t":"mc_part"'
# ...and of a store's intent, never its reshards (each block's sources and outputs): only a
# resumed run reads them (`load_runs`); verify and rollback read the intent's pairs, outputs,
# rewrites and entries. A format-2 intent's array ends where the pairs begin (migrate/stores.py
# writes them in this order, and `],"pairs":[` is no text a JSON string holds).
_INTENT_RESHARDS = (b'{"t":"mc_intent"', b',"reshards":[', b'],"pairs":[')
_RESHARD_PARTS = b'{"t":"mc_part","of":"reshards"'
INTENT_ARRAYS = ("rewrites", "entries", "reshards", "pairs", "outputs")  # a store intent's, in the order written


def split_intent(rec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A store intent as format 3 writes it: its head (`parts: true`), then its `mc_part`
    records. A format-2 intent (one record holding its arrays) comes out in that form
    too, so that readers of a run's store records take one form."""
    if rec.get("parts"):
        yield rec
        return
    yield {k: v for k, v in rec.items() if k not in INTENT_ARRAYS} | {"parts": True}
    for name in INTENT_ARRAYS:
        if rec.get(name):
            yield {"t": "mc_part", "of": name, "items": rec[name]}


def stream_runs(path: str) -> list[Run]:
    """The runs of a journal file with their states and Mooncake store records but not
    their per-path records (`intents`, `done` stay empty): `path_records` reads those,
    one at a time, when they are needed. Like `run_states`, a framed journal's path
    records (~all of its bytes) are not decoded here: what verify and rollback hold is
    a run, not a record per file it created, and they decode the journal once.
    Positions are ordinals of the `header` and `rolled_back` records (marks)."""
    with open(path, "rb") as f:
        framed = is_framed(f)
        recs: Any = [json.loads(line) for line in _wanted_lines(f, _STREAM_RECORDS, _INTENT_RESHARDS)] \
            if framed else None
    if not framed:
        recs = iter_records(path)
    elif not recs or recs[0].get("t") != "header" or isinstance(recs[0].get("v"), int) and recs[0]["v"] > VERSION:
        load_runs(path, paths=False)  # says why it is no journal this release reads
        return []
    stored: set[int] = set()  # the runs with store records
    heads: list[int] = []
    targets: list[set[str]] = []
    drops: list[list[tuple[int, set[str]]]] = []

    def records() -> Iterator[dict[str, Any]]:
        mark = -1
        for rec in recs:
            t = rec["t"]
            if t in ("header", "rolled_back"):
                mark += 1
            if t == "header":
                heads.append(mark)
                targets.append(set())
                drops.append([])
            elif t == "target" and targets:
                targets[-1].add(rec["base"])
            elif t.startswith("mc_"):
                stored.add(len(heads) - 1)
            elif t == "rolled_back" and rec.get("targets") is not None:
                bases = set(rec["targets"])
                for k, held in enumerate(targets):  # as `_drop_targets` forgets them
                    if bases & held:
                        drops[k].append((mark, bases))
                        held -= bases
            yield rec

    try:
        runs = _load_runs(path, False, records())
    except DAMAGED as exc:
        raise damaged(path, exc) from None
    ends = heads[1:] + [-1]
    for k, run in enumerate(runs):
        run.span = (heads[k], ends[k])
        run.drops = drops[k]
        run.stored_in_file = k in stored
    return runs


UNDONE_ARRAYS = ("rewrites", "entries", "pairs", "outputs")  # what rollback reads of an intent


def store_records(run: Run, arrays: tuple[str, ...] = UNDONE_ARRAYS) -> Iterator[dict[str, Any]]:
    """The Mooncake store records of a run in journal order, each intent as its head and
    then its parts (`split_intent`) of `arrays` only (a resumed run reads the reshards
    too; verify none). A `stream_runs` run's are read from its file again, a part at a
    time: a store's records grow with its blocks (a pair or a KVEntry each, its intent
    ~1 KB each) and verify, rollback and a resumed run hold none of them."""
    def wanted(rec: dict[str, Any]) -> bool:
        return rec["t"] != "mc_part" or rec["of"] in arrays

    if not run.stored_in_file:
        for rec in run.store_records:
            yield from filter(wanted, split_intent(rec) if rec["t"] == "mc_intent" else (rec,))
        return
    start, end = run.span
    mark = -1
    try:
        with open(run.journal, "rb") as f:
            reshards = "reshards" in arrays
            skip = (_PARTS,) if not arrays else () if reshards else (_RESHARD_PARTS,)
            lines = _streamed_lines(f, (b'{"t":"header"', b'{"t":"rolled_back"', b'{"t":"mc_'),
                                    None if reshards else _INTENT_RESHARDS, skip) if is_framed(f) else None
            for rec in (json.loads(line) for line in lines) if lines is not None else iter_records(run.journal):
                t = rec["t"]
                if t in ("header", "rolled_back"):
                    mark += 1
                    if mark == end:
                        return
                elif mark >= start and t.startswith("mc_"):
                    yield from filter(wanted, split_intent(rec) if t == "mc_intent" else (rec,))
    except (*DAMAGED, ValueError, zlib.error) as exc:
        raise damaged(run.journal, exc) from None


def _streamed_lines(f: Any, wanted: tuple[bytes, ...], cut: tuple[bytes, bytes, bytes] | None = None,
                    skip: tuple[bytes, ...] = ()) -> Iterator[bytes]:
    """The wanted lines of every whole frame as `_frame_lines` reads them, but each given
    as soon as it is decompressed: a frame's CRC is proven by a first pass over its
    compressed bytes, so a frame of any length (a store's intent) is never held."""
    for pieces, z in _proven_frames(f):
        lines = _WantedLines(wanted, cut, skip)
        for data in pieces:
            lines.feed(data)
            yield from lines.got
            lines.got.clear()
        if not z.eof:
            raise zlib.error("a frame's payload ends early")
        yield from lines.end()


def path_records(run: Run) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(position, "intent" | "done", record) of a `stream_runs` run, read from its file
    in journal order: every intent item, every done record (a `dirs` record as one
    `{"kind": "dir"}` per folder), as `load_runs` would hold them. A record that is not
    one this tool wrote makes the journal unusable (as `load_runs` says)."""
    start, end = run.span
    mark = -1
    try:
        for rec in iter_records(run.journal, skip=(b'{"t":"mc_',)):  # (a store's records: `stream_runs` has them)
            t = rec["t"]
            if t in ("header", "rolled_back"):
                mark += 1
                if mark == end:
                    return
                continue
            if mark < start:
                continue
            if t == "intent":
                for item in rec.get("items", []):
                    item["path"]  # (a KeyError: damaged, as load_runs says)
                    yield mark, "intent", item
            elif t == "done" and rec.get("kind") == "dirs":
                for folder in rec.get("paths", []):
                    yield mark, "done", {"kind": "dir", "path": folder}
            elif t == "done":
                rec["path"]  # (the same)
                yield mark, "done", rec
    except DAMAGED as exc:
        raise damaged(run.journal, exc) from None


def flat_bases(run: Run) -> dict[str, dict[str, Any]]:
    """The intents `Run.target_of` consults, of a `stream_runs` run: the target of each
    intended path outside a target's folders (a flat target's page files), by path."""
    out: dict[str, dict[str, Any]] = {}
    for _, what, rec in path_records(run):
        if what == "intent" and layout.parse_folder(rec["path"].split("/", 1)[0]) is None:
            out[rec["path"]] = {"base": rec.get("base")}
    return out


def dropped(run: Run, pos: int, target: str | None) -> bool:
    """A record at `pos` of a target a later rollback of some targets took (`_drop_targets`)."""
    return any(at > pos and target in bases for at, bases in run.drops)


def resolve_flat(run: Run) -> None:
    """Give a `stream_runs` run the intents `target_of` needs where it has flat targets
    (or forgot targets whose files may have been flat): `flat_bases`."""
    if not run.intents and (run.drops or any(t.get("flat") for t in run.targets.values())):
        run.intents = flat_bases(run)


def done_records(run: Run, kinds: tuple[str, ...] = ("block", "config")) -> Iterator[dict[str, Any]]:
    """The done records of `kinds` of a `stream_runs` run as `Run.done` holds them (one a
    path, the last written, in the place of the first; none of a target a later
    rollback took), read from its file. Held: 8 bytes a record while it finds the paths
    done twice (a resumed run), then the records of those paths only."""
    resolve_flat(run)

    def kept() -> Iterator[dict[str, Any]]:
        for pos, what, rec in path_records(run):
            if what == "done" and rec.get("kind") in kinds and not (
                    run.drops and dropped(run, pos, run.target_of(rec["path"]))):
                yield rec

    yield from last_per_path(kept)


def last_per_path(records: Callable[[], Iterator[dict[str, Any]]]) -> Iterator[dict[str, Any]]:
    """Records keyed by their path as a dict of them holds them: each path once, its last
    record in the place of its first. `records()` is read two or three times; held: 8
    bytes a record while the paths that occur twice are found, then their records only."""
    import heapq
    from array import array

    digests = array("q", (hash(rec["path"]) for rec in records()))
    step = 16_384  # digests sorted as Python ints at once, then merged
    runs = [array("q", sorted(digests[i:i + step])) for i in range(0, len(digests), step)]
    del digests
    twice: set[int] = set()
    previous = None
    for digest in heapq.merge(*runs):
        if digest == previous:
            twice.add(digest)
        previous = digest
    del runs
    last: dict[str, dict[str, Any]] = {}
    if twice:
        for rec in records():
            if hash(rec["path"]) in twice:
                last[rec["path"]] = rec
    emitted: set[str] = set()
    for rec in records():
        path = rec["path"]
        if path in last:
            if path not in emitted:
                emitted.add(path)
                yield last[path]
            continue
        yield rec
