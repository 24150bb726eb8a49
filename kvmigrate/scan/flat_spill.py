"""A flat directory's pages kept on disk while the scan judges them, not as a Python record
each: a HiCache directory of 64,000 pages took ~1.6 KB a page file as names, `FlatFile`s
and per-page dicts. Two kinds of Arrow IPC files go into a working folder in TMPDIR
(kvmigrate/scratch.py):

    runs    the page names as the listing meets them, sorted RUN_NAMES at a time; read
            back merged, in name order (`PageNames`)
    pages   every page in name order with what the scan read of it: its stat, head, hash
            and the (pool, suffix) it was filed under (`PageSpill`). Each deployment's
            verdicts read it back a window at a time, and a window always ends where a
            page hash ends: every file a verdict compares (a page's ranks, its copies, a
            target name beside it) shares the page hash, so sorts next to it.

A small directory (up to RUN_NAMES pages) keeps its names in memory and writes no run.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Iterator
from itertools import islice
from typing import Any

import pyarrow as pa

from kvmigrate import scratch

RUN_NAMES = 1 << 16  # names sorted in memory at a time (~8 MiB of strings)
# names per record batch of a run: the merge holds one batch of every run, and a run comes
# with every RUN_NAMES names (150 runs at 10M pages: ~20 MiB of names held)
NAMES_BATCH = 1_024
HEX = 64  # a page name starts with its page hash

STAT_FIELDS = ("size", "mtime_ns", "inode", "dev", "nlink", "ctime_ns")
SCHEMA = pa.schema([("name", pa.binary()), ("page", pa.bool_()), ("fold", pa.int32())] +
                   [(f, pa.uint64() if f in ("inode", "dev") else pa.int64()) for f in STAT_FIELDS] +
                   [("head", pa.binary()), ("content", pa.binary()), ("all_zero", pa.bool_()),
                    ("carried", pa.bool_())])


FLAT = scratch.Kind("scan-flat", "the scan's temporary files of a flat cache directory",
                    "a page file takes ~150 bytes there while the directory is scanned")


class PageNames:
    """One flat family's page names, in name order once `finish`ed: in memory up to
    RUN_NAMES, else in sorted runs on disk, merged as they are read (`chunks`)."""

    def __init__(self, kind: scratch.Kind = FLAT) -> None:
        self.buffer: list[str] = []
        self.runs: list[str] = []
        self.count = 0
        self.folder: scratch.Folder | None = None
        self.kind = kind  # (its folder's, and what a full TMPDIR's exit 8 names)

    def add(self, name: str) -> None:
        self.buffer.append(name)
        self.count += 1
        if len(self.buffer) >= RUN_NAMES:
            self._spill()

    def finish(self) -> PageNames:
        if self.runs:
            self._spill()
        else:
            self.buffer.sort()
        return self

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    def _spill(self) -> None:
        self.buffer.sort()
        with self.kind.writing(self.folder):
            if self.folder is None:
                self.folder = self.kind.folder()
            path = self.folder.file("names")
            with scratch.IpcWriter(path, pa.schema([("name", pa.binary())])) as out:
                for start in range(0, len(self.buffer), NAMES_BATCH):
                    part = [os.fsencode(n) for n in self.buffer[start:start + NAMES_BATCH]]
                    out.write(pa.record_batch([pa.array(part, pa.binary())], names=["name"]))
        self.runs.append(path)
        self.buffer = []

    def chunks(self, size: int) -> Iterator[list[str]]:
        """The names in name order, `size` at a time."""
        names: Iterator[str] = (iter(self.buffer) if not self.runs else
                                heapq.merge(*(_run(path) for path in self.runs)))
        while chunk := list(islice(names, size)):
            yield chunk


def _run(path: str) -> Iterator[str]:
    for batch in scratch.batches(path):
        yield from map(os.fsdecode, batch.column(0).to_pylist())


class PageSpill:
    """Every page of one flat family in name order, as the scan read it (`add` a chunk at a
    time), then read back in windows of whole page hashes (`windows`)."""

    COLUMNS = tuple(SCHEMA.names)

    def __init__(self, folder: scratch.Folder | None) -> None:
        self.folder = folder
        self.path: str | None = None
        self.writer: scratch.IpcWriter | None = None
        self.rows = 0

    def add(self, cols: dict[str, list[Any]]) -> None:
        """One chunk of pages: a list a column of SCHEMA, `name` as str."""
        n = len(cols["name"])
        if not n:
            return
        arrays = [pa.array([os.fsencode(x) for x in cols["name"]], pa.binary())]
        arrays += [pa.array(cols[f.name], f.type) for f in list(SCHEMA)[1:]]
        with FLAT.writing(self.folder):
            if self.writer is None:
                if self.folder is None:
                    self.folder = FLAT.folder()
                self.path = self.folder.file("pages")
                self.writer = scratch.IpcWriter(self.path, SCHEMA)
            self.writer.write(pa.record_batch(arrays, schema=SCHEMA))
        self.rows += n

    def close(self) -> None:
        if self.writer is not None:
            with FLAT.writing(self.folder):
                self.writer.close()
            self.writer = None

    def windows(self) -> Iterator[dict[str, list[Any]]]:
        """The pages a window at a time, as lists a column (`name` as str); a window ends
        where a page hash ends (its last page hash's files are all in it)."""
        if self.path is None:
            return
        held: dict[str, list[Any]] | None = None
        for batch in scratch.batches(self.path):
            cols = {f: batch.column(f).to_pylist() for f in SCHEMA.names}
            cols["name"] = [os.fsdecode(x) for x in cols["name"]]
            if held is not None:
                cols = {f: held[f] + cols[f] for f in cols}
            names = cols["name"]
            cut = len(names)
            last = names[-1][:HEX]
            while cut > 0 and names[cut - 1][:HEX] == last:
                cut -= 1
            if cut == 0:  # (one page hash fills the window: hold it all)
                held = cols
                continue
            held = {f: v[cut:] for f, v in cols.items()}
            yield {f: v[:cut] for f, v in cols.items()}
        if held is not None and held["name"]:
            yield held

    def remove(self) -> None:
        """Let the folder go (the rows are written)."""
        if self.folder is not None:
            self.folder.remove()
