"""A Mooncake store's reshard work kept on disk while it is planned and applied, not as
Python objects held for every block at once (~18 KB a resharded block when they were):
records pickled into unlinked temporary files in TMPDIR (gone with the process, even a
killed one), read back in order, and sorted by merging sorted runs."""

from __future__ import annotations

import heapq
import io
import os
import pickle
import tempfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kvmigrate import scratch

RUN_RECORDS = 1 << 12  # records a sort holds in memory at once (one sorted run)
_READ_BUFFER = 1 << 15  # (a merge reads every run at once)
MERGE_RUNS = 64  # runs merged at once: their open files and read buffers


def spilling() -> Any:
    """A full or read-only TMPDIR while a reshard's work is spilled: exit 8, naming it."""
    return scratch.spilling("the temporary files of a Mooncake store's reshard",
                            "a resharded block's work and outputs take a few KB there while it is planned and applied")


class _At(io.RawIOBase):
    """A file read from its own offset (pread), so that several readers and the appender
    of one file never move each other's position."""

    def __init__(self, fd: int, end: int, pos: int = 0):
        self.fd, self.pos, self.end = fd, pos, end

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        self.pos = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.end}[whence] + pos
        return self.pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.end - self.pos)
        if n <= 0:
            return 0
        data = os.pread(self.fd, n, self.pos)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


class Spill:
    """Records appended to a temporary file and read back in their order, as often as
    needed: a list's `append`, `len` and iteration, without the records in memory."""

    def __init__(self, records: Iterable[Any] = ()):
        self._file: Any = None
        self._count = 0
        for rec in records:
            self.append(rec)

    def append(self, rec: Any) -> int:
        """Add a record; its offset (`at`)."""
        with spilling():
            if self._file is None:
                # (open as long as the Spill lives: `close`, or the process's end, unlinked from the start)
                self._file = tempfile.TemporaryFile(prefix=f"{scratch.PREFIX}reshard-",  # noqa: SIM115
                                                    dir=scratch.tmpdir())
            at = self._file.tell()
            pickle.dump(rec, self._file, pickle.HIGHEST_PROTOCOL)
        self._count += 1
        return at

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Any]:
        return (rec for _, rec in self.items())

    def items(self) -> Iterator[tuple[int, Any]]:
        """(offset, record) of every record: `at(offset)` reads that record again."""
        if self._file is None:
            return
        self._file.flush()
        count, end = self._count, self._file.tell()
        reader = io.BufferedReader(_At(self._file.fileno(), end), _READ_BUFFER)
        for _ in range(count):
            at = reader.tell()
            yield at, pickle.load(reader)

    def at(self, offset: int) -> Any:
        self._file.flush()
        return pickle.load(io.BufferedReader(_At(self._file.fileno(), self._file.tell(), offset), 1 << 12))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self._count = 0


def sort(records: Iterable[Any], key: Callable[[Any], Any], run: int | None = None, reverse: bool = False
         ) -> Iterator[Any]:
    """`records` in the order of `sorted(records, key=key, reverse=reverse)` (stable),
    holding at most `run` (RUN_RECORDS) of them in memory: sorted runs spilled, then merged."""
    run = run or RUN_RECORDS
    runs: list[Spill] = []
    held: list[Any] = []
    for rec in records:
        held.append(rec)
        if len(held) >= run:
            held.sort(key=key, reverse=reverse)
            runs.append(Spill(held))
            held = []
            if len(runs) >= MERGE_RUNS:  # (merged into one: a file and a read buffer a run are held)
                merged = Spill(heapq.merge(*runs, key=key, reverse=reverse))
                for r in runs:
                    r.close()
                runs = [merged]
    held.sort(key=key, reverse=reverse)
    if not runs:
        yield from held
        return
    if held:
        runs.append(Spill(held))
        held = []
    try:
        yield from heapq.merge(*runs, key=key, reverse=reverse)  # (equal keys: the earlier run first, so stable)
    finally:
        for r in runs:
            r.close()
