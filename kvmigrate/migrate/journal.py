"""The write-ahead journal of a migration (migration.md §3.5): JSON lines.

Record types, in the order a run writes them:

    header    run id, command line, manifest, root, dest, target profile, identity
    resume    a later process continuing the same run (pid, command)
    target    a target namespace: base folder, family, identity digest (for rewrites)
    intent    fsynced BEFORE a batch of creations: every path the batch may create
              (folders that did not exist, config.json, block files with their source)
    done      after a creation: path, inode, size, xxh3_128 of the output (folders:
              one record `kind: dirs` with the paths a batch created)
    lock      the lock file of a target base folder was created
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

import fcntl
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

from kvmigrate import layout
from kvmigrate.errors import OperationalError, UsageError

VERSION = 1
JOURNALS_DIR = os.path.join(layout.OWN_DIR, "journals")


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def default_journal_dir(root: str) -> str:
    return os.path.join(root, JOURNALS_DIR)


def journal_files(path: str) -> list[str]:
    """A journal file, or every `*.jsonl` in a directory of journals (sorted). In a
    directory, a file whose header line never reached the disk (a run killed between
    creating its journal and writing the header) is skipped: the header is fsynced
    before any intent, so that run created nothing."""
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".jsonl"))
        files = [f for f in files if _has_header_line(f)]
        if not files:
            raise UsageError(f"no journals (*.jsonl) in {path}", path=path,
                             hint="pass the journal or journal directory `migrate --apply` printed")
        return files
    if not os.path.exists(path):
        raise UsageError(f"journal not found: {path}", path=path,
                         hint="pass the journal or journal directory `migrate --apply` printed")
    return [path]


def _has_header_line(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.readline().endswith(b"\n")
    except OSError:
        return True  # let the reader report it


def read_records(path: str) -> list[dict[str, Any]]:
    """All records of a journal file; a torn last line (kill -9 mid-write) is ignored."""
    return list(iter_records(path))


def iter_records(path: str) -> Iterator[dict[str, Any]]:
    """The records of a journal file one by one (see `read_records`)."""
    first = True
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "t" in rec:
                if first and rec.get("t") != "header":
                    break
                first = False
                yield rec
    if first:
        raise UsageError(f"{path} is not a kvmigrate journal (no header record)", path=path,
                         hint="pass the journal or journal directory `migrate --apply` printed")


@dataclass
class Run:
    """One run inside a journal file, with what it created."""

    header: dict[str, Any]
    targets: dict[str, dict[str, Any]] = field(default_factory=dict)  # base -> target record
    intents: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> intent item
    done: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> done record (last wins)
    locks: list[str] = field(default_factory=list)
    complete: dict[str, Any] | None = None
    rolled_back: bool = False

    @property
    def dest(self) -> str:
        return self.header["dest"]

    @property
    def root(self) -> str:
        return self.header["root"]

    def pending(self) -> list[dict[str, Any]]:
        """Intent items without a done record, in intent order."""
        return [item for path, item in self.intents.items() if path not in self.done]

    def created(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.done.values() if d.get("kind") == kind]


def load_runs(path: str, *, paths: bool = True) -> list[Run]:
    """The runs of a journal file. `paths=False` leaves out what each run intended and
    did per path (every record is still checked): the run states only, in bounded memory."""
    try:
        return _load_runs(path, paths)
    except (KeyError, TypeError, AttributeError) as exc:  # valid JSON, but not records this tool wrote
        raise UsageError(f"{path}: damaged journal (a record lacks or mistypes {exc})", path=path,
                         hint="pass a journal `migrate --apply` wrote; an edited journal cannot be trusted") from None


def _load_runs(path: str, keep: bool = True) -> list[Run]:
    runs: list[Run] = []
    for rec in iter_records(path):
        t = rec["t"]
        if t == "header":
            if not isinstance(rec.get("root"), str) or not isinstance(rec.get("dest"), str):
                raise KeyError("root/dest in the header")
            runs.append(Run(header=rec))
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
        elif t == "complete":
            run.complete = rec
        elif t == "rolled_back":
            # rollback applies to every run before it in the file
            for r in runs:
                r.rolled_back = True
        elif t == "resume":
            run.complete = None
    return runs


def identity_matches(header: dict[str, Any], identity: dict[str, Any]) -> bool:
    return header.get("identity") == identity


def find_resumable(journal: str, identity: dict[str, Any]) -> str | None:
    """The newest unfinished journal with the same identity (root, dest, target profile,
    manifest), in a journal file or directory; None if there is none."""
    if os.path.isdir(journal):
        candidates = sorted((os.path.join(journal, f) for f in os.listdir(journal) if f.endswith(".jsonl")),
                            key=lambda p: os.stat(p).st_mtime_ns, reverse=True)
    elif os.path.isfile(journal):
        candidates = [journal]
    else:
        return None
    for path in candidates:
        try:
            runs = load_runs(path, paths=False)  # old journals of big runs are not held in memory
        except (UsageError, OSError):
            continue
        last = runs[-1]
        if last.complete is None and not last.rolled_back and identity_matches(last.header, identity):
            return path
    return None


# one encoder for every record (json.dumps with options builds a new one per call); ASCII
# output (non-ASCII as \u escapes, same values) encodes twice as fast
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode
_STR = json.encoder.encode_basestring_ascii  # a JSON string literal, as _ENCODE writes it


class JournalWriter:
    """Appends records; `intent` and `sync` fsync, `done` records are buffered and
    written with the next other record or sync (a batch is fsynced once at its end), so
    the journal never lags behind the tree by more than one batch and every creation is
    preceded by a durable intent. A done record lost to a kill is no loss: resume finds
    the intended path made and adopts it (`reconcile.reconcile_item`)."""

    _BUFFERED = 4096  # done records held before a write (one write per batch, not per block)

    def __init__(self, path: str, fd: int):
        self.path = path
        self._fd = fd
        self._pending: list[bytes] = []

    @classmethod
    def create(cls, path: str, header: dict[str, Any]) -> "JournalWriter":
        """A new journal file (or a new run appended to an existing journal file)."""
        parent = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(parent, exist_ok=True)
            existed = os.path.exists(path)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise OperationalError(f"cannot create the journal: {exc.strerror}", path=path,
                                   hint="pass --journal PATH on a writable filesystem") from None
        w = cls(path, fd)
        w._lock()
        if existed:
            w._terminate_torn_line()
        w.write({"t": "header", "v": VERSION, **header}, sync=True)
        if not existed:
            _fsync_dir(parent)
        return w

    @classmethod
    def append(cls, path: str) -> "JournalWriter":
        """Reopen an existing journal to add records (a torn last line is terminated)."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise OperationalError(f"cannot reopen the journal: {exc.strerror}", path=path) from None
        w = cls(path, fd)
        w._lock()
        w._terminate_torn_line()
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
    def resume(cls, path: str, record: dict[str, Any]) -> "JournalWriter":
        w = cls.append(path)
        w.write({"t": "resume", **record}, sync=True)
        return w

    def _terminate_torn_line(self) -> None:
        with open(self.path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                os.write(self._fd, b"\n")

    def write(self, rec: dict[str, Any], sync: bool = False) -> None:
        self._pending.append(_ENCODE(rec).encode() + b"\n")
        self._flush(sync)

    def _flush(self, sync: bool = False) -> None:
        data = b"".join(self._pending)
        self._pending.clear()
        try:
            while data:
                n = os.write(self._fd, data)
                data = data[n:]
            if sync:
                os.fsync(self._fd)
        except OSError as exc:
            what = (exc.strerror or str(exc)).lower()
            raise OperationalError(f"cannot write the journal: {what}", path=self.path,
                                   hint="free space on the journal's filesystem, then rerun the same command "
                                        "to resume") from None

    def intent(self, items: list[dict[str, Any]]) -> None:
        if items:
            self.write({"t": "intent", "items": items}, sync=True)

    def done(self, rec: dict[str, Any]) -> None:
        self._pending.append(_ENCODE({"t": "done", **rec}).encode() + b"\n")
        if len(self._pending) >= self._BUFFERED:
            self._flush()

    def done_link(self, path: str, st: os.stat_result, action: str, xxh3_128: bytes | None) -> None:
        """`done` of a hard-linked block, formatted directly: the hot record of a run
        (the same JSON `done` writes, without a dict and the generic encoder per block)."""
        line = (f'{{"t":"done","kind":"block","path":{_STR(path)},"ino":{st.st_ino},"dev":{st.st_dev},'
                f'"size":{st.st_size},"mtime_ns":{st.st_mtime_ns},"how":"link","action":{_STR(action)}'
                + (f',"xxh3_128":"{xxh3_128.hex()}"}}\n' if xxh3_128 is not None else "}\n"))
        self._pending.append(line.encode())
        if len(self._pending) >= self._BUFFERED:
            self._flush()

    def sync(self) -> None:
        self._flush(sync=True)

    def close(self) -> None:
        if self._fd >= 0:
            if self._pending:
                self._flush()
            os.close(self._fd)
            self._fd = -1


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
