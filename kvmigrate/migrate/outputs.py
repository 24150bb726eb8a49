"""The bytes each creating action produces from its source file(s) (migration.md §1).

Copies (link as a copy, copy_pad, rewrite_header) are one generator; transforms (slice,
concat, relayout) stream through `kvmigrate.transforms` writers into a hashing writer.
Each serves three callers: apply (writes the chunks to a temp file), the
comparison with an existing file at the target path (hashes them only), and journal
reconciliation after a crash (proves a file at a final path is this run's output).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import xxhash

from kvmigrate import findings
from kvmigrate.classify import UnitPlan
from kvmigrate.cost import TRANSFORMS
from kvmigrate.formats import vllmcpp
from kvmigrate.fsio import open_noatime
from kvmigrate.migrate.fsops import CHUNK, PAGE, padded_size
from kvmigrate.transforms import TransformError, write_llmd_row, write_relayout, write_slice
from kvmigrate.transforms_lmcache import TierSpec, write_tier


class SourceInvalid(ValueError):
    """The source cannot produce the action's output (e.g. a vllm.cpp header that the
    scan saw as valid no longer decodes)."""


def _read_exact(fd: int, n: int) -> bytes:
    parts = []
    while n > 0:
        buf = os.read(fd, min(CHUNK, n))
        if not buf:
            break
        parts.append(buf)
        n -= len(buf)
    return b"".join(parts)


def output_chunks(src_fd: int, action: str, digest: bytes | None, src_hasher=None) -> Iterator[bytes]:
    """Yield the output of `action` ("link" = plain copy, "copy_pad", "rewrite_header")
    read from `src_fd`; every source byte read is fed to `src_hasher` (staleness check
    against the manifest's whole-file hash)."""
    upd = src_hasher.update if src_hasher is not None else (lambda b: None)
    if action == "rewrite_header":
        header = _read_exact(src_fd, vllmcpp.HEADER_SIZE)
        upd(header)
        if len(header) < vllmcpp.HEADER_SIZE:
            raise SourceInvalid("source is shorter than a vllm.cpp header")
        h = vllmcpp.decode_header(header)
        if h.magic != vllmcpp.MAGIC or h.key_size > vllmcpp.MAX_KEY_SIZE:
            raise SourceInvalid("source header is not a valid vllm.cpp header")
        if digest is None or len(digest) != 32:
            raise SourceInvalid("no target identity digest for a header rewrite")
        yield vllmcpp.rewrite_header(header, digest)
        remaining = h.payload_size
        while remaining > 0:
            buf = os.read(src_fd, min(CHUNK, remaining))
            if not buf:
                raise SourceInvalid(f"source payload is short by {remaining} bytes")
            upd(buf)
            remaining -= len(buf)
            yield buf
        while True:  # trailing bytes the engine ignores: hashed for staleness, not copied
            buf = os.read(src_fd, CHUNK)
            if not buf:
                break
            upd(buf)
        return
    n = 0
    while True:
        buf = os.read(src_fd, CHUNK)
        if not buf:
            break
        upd(buf)
        n += len(buf)
        yield buf
    if action == "copy_pad" and n % PAGE:
        yield b"\0" * (PAGE - n % PAGE)


def output_hash(src_fd: int, action: str, digest: bytes | None) -> tuple[bytes, int, bytes]:
    """(output xxh3_128, output size, source xxh3_128) without writing anything."""
    out = xxhash.xxh3_128()
    src = xxhash.xxh3_128()
    size = 0
    for chunk in output_chunks(src_fd, action, digest, src):
        out.update(chunk)
        size += len(chunk)
    return out.digest(), size, src.digest()


# --- transforms (slice, concat, relayout: migration.md §1) --------------------------------

# A slice proven from the data alone (scan --verify hash without --page-bytes) carries its
# cell size in the manifest's `cell_bytes` and `row_cells` columns (classify.slice_reason).
# Each family says which transforms are defined for its blocks (Family.transforms,
# migration.md §1): a slice cuts a vLLM row, a concat or relayout reads llm-d rank files.


@dataclass(frozen=True)
class TransformSpec:
    """The proven geometry of one transform: what it reads and what row it writes.

    slice:    1 file of `row_cells` equal cells of `cell` bytes -> cell 0 + pad.
    concat:   `ranks` files of `cell` bytes (B = 1) -> all of them in rank order + pad.
    relayout: `ranks` files of B·T·P bytes, each [B][T][P] -> [T][B][P]; the row holds
              `cells` of them (1: rank 0's, for one rank or an MLA replicated target) + pad.
              `flat`: one page file of a flat family (sglang.md §2), `halves` of B·T·P
              bytes each transposed on its own, written at its exact size (no pad).
    """

    action: str
    kv_kind: str  # mla | full
    ranks: int
    cells: int
    cell: int
    B: int = 1
    T: int = 1
    P: int = 0
    row_cells: int = 1
    halves: int = 1
    flat: bool = False

    @property
    def output_size(self) -> int:
        return self.cell if self.flat else padded_size(self.cells * self.cell)

    @property
    def replicas(self) -> bool:
        """MLA rank files are replicas: a transform reading several must find them equal."""
        return self.kv_kind == "mla" and self.ranks > 1

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not self.flat:  # (the journal items of the tree families stay as they were)
            del d["halves"], d["flat"]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Any:
        if d.get("tier"):  # an LMCache tier output (transforms_lmcache.TierSpec)
            try:
                return TierSpec.from_json(d)
            except TransformError as exc:
                raise SourceInvalid(str(exc)) from None
        spec = cls(**{k: d[k] for k in ("action", "kv_kind", "ranks", "cells", "cell", "B", "T", "P", "row_cells")},
                   halves=d.get("halves", 1), flat=d.get("flat", False))
        spec.check()
        return spec

    def check(self) -> None:
        ints = (self.ranks, self.cells, self.cell, self.B, self.T, self.row_cells, self.halves)
        if (self.action not in TRANSFORMS or self.kv_kind not in ("mla", "full")
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in ints)
                or not isinstance(self.flat, bool) or self.flat and (self.action != "relayout" or self.ranks != 1)
                or self.cells > self.ranks
                or (self.action == "relayout" and self.halves * self.B * self.T * self.P != self.cell)):
            raise SourceInvalid(f"inconsistent transform geometry {self.to_json()}")


def flat_relayout_spec(kv_kind: str, size: int, geometry: dict[str, int]) -> TransformSpec:
    """The relayout of one page file of a flat family, from the geometry its family proved
    (`Family.flat_relayout`: halves, B, T, P of the source's order)."""
    spec = TransformSpec("relayout", kv_kind, ranks=1, cells=1, cell=size, B=geometry["B"], T=geometry["T"],
                         P=geometry["P"], halves=geometry["halves"], flat=True)
    spec.check()
    return spec


def transform_spec(plan: UnitPlan, action: str, group: int, size: int,
                   found: findings.Finding | str | None) -> TransformSpec:
    """Re-derive a planned transform's numbers from the namespace (identity + facts) and
    the rank-0 file size; raises SourceInvalid naming what is not proven. `found`: the
    row's finding (or its reason, which carries it): a slice proven from the data has its
    cell there. Used by the migration plan (from manifest metadata) and by the scan
    (existing target paths)."""
    if isinstance(found, str):
        found = findings.finding_of(found)
    if action in TRANSFORMS and action not in plan.fam.transforms:
        raise SourceInvalid(f"{action} is not defined for a {plan.family} namespace")
    ranks = len(plan.expected_ranks)
    kind = plan.kv_kind
    if action == "slice":
        n, layers, B = plan.world, plan.layers.get(group), plan.blocks_per_file
        said = (found.row_cells, found.cell_bytes) if found is not None and found.cell_bytes is not None else None
        if plan.page_bytes and layers and B:
            cell = layers * plan.page_bytes * B
        elif said:
            cell = said[1]
        else:
            raise SourceInvalid("slice: the cell size is neither given by the facts nor in the plan")
        if said and said != (n, cell):
            raise SourceInvalid(f"slice: the plan says {said[0]} cells of {said[1]} bytes, the namespace "
                                f"gives {n} cells of {cell}")
        if kind != "mla" or n < 2 or not n * cell <= size < n * cell + PAGE:
            raise SourceInvalid(f"slice: {n} cells of {cell} bytes do not fit a {size}-byte row of kv kind {kind}")
        return TransformSpec("slice", "mla", ranks=1, cells=1, cell=cell, row_cells=n)
    if kind not in ("mla", "full"):
        raise SourceInvalid(f"{action}: kv kind {kind!r} is not mla or full")
    if action == "concat":
        if plan.blocks_per_file != 1 or ranks < 2:
            raise SourceInvalid(f"concat: needs B = 1 and several ranks, got B={plan.blocks_per_file}, "
                                f"{ranks} ranks")
        spec = TransformSpec("concat", kind, ranks=ranks, cells=ranks, cell=size, B=1, T=1, P=size)
    elif action == "relayout":
        B, T, P = plan.blocks_per_file, plan.tensors(group), plan.page_bytes
        if not (B and B > 1 and T and P) or size != B * T * P:
            raise SourceInvalid(f"relayout: B={B}, T={T}, P={P} do not prove the {size}-byte file")
        one = ranks == 1 or (kind == "mla" and plan.target is not None and plan.target.replicated_layout)
        spec = TransformSpec("relayout", kind, ranks=ranks, cells=1 if one else ranks, cell=size, B=B, T=T, P=P)
    else:
        raise SourceInvalid(f"unknown transform {action!r}")
    spec.check()
    return spec


class HashingWriter:
    """A buffered writer that hashes (XXH3-128) and counts everything written, so an
    output's hash is known when the last byte is written; fd None = hash only."""

    def __init__(self, fd: int | None = None, *, chunk: int = CHUNK,
                 on_flush: Callable[[], None] | None = None):
        self.fd = fd
        self.hasher = xxhash.xxh3_128()
        self.size = 0
        self._buf = bytearray()
        self._chunk = chunk
        self._on_flush = on_flush

    def write(self, data) -> int:
        self.hasher.update(data)
        n = len(data)
        self.size += n
        if self.fd is not None:
            self._buf += data
            if len(self._buf) >= self._chunk:
                self.flush()
        return n

    def flush(self) -> None:
        if not self._buf or self.fd is None:  # (hash only: nothing is ever buffered)
            return
        view = memoryview(self._buf)
        while view:
            view = view[os.write(self.fd, view):]
        self._buf = bytearray()
        if self._on_flush is not None:
            self._on_flush()

    def digest(self) -> bytes:
        return self.hasher.digest()


def write_transform(spec: TransformSpec, fds: list[int], dst) -> int:
    """Stream the transform's output row into `dst` (fds in rank order; slice: one row).
    Geometry is re-checked against every file's size by the writers."""
    if getattr(spec, "tier", False):  # an LMCache tier output: its header, then its rows
        return write_tier(spec, fds, dst)  # type: ignore[arg-type]
    if spec.action == "slice":
        return write_slice(fds[0], dst, cell=spec.cell)
    if spec.flat:  # one page file (its whole copies, if any, were compared by the caller)
        return write_relayout(fds[0], dst, B=spec.B, T=spec.T, P=spec.P, halves=spec.halves)
    if len(fds) != spec.ranks:
        raise SourceInvalid(f"{spec.action}: {len(fds)} rank files given, {spec.ranks} expected")
    return write_llmd_row(fds, dst, B=spec.B, T=spec.T, P=spec.P, kv_kind=spec.kv_kind,
                          replicated_target=spec.cells == 1 and spec.ranks > 1)


def transform_output_hash(spec: TransformSpec, fds: list[int]) -> tuple[bytes, int]:
    """(XXH3-128, size) of the row a transform writes, without writing it."""
    w = HashingWriter()
    try:
        write_transform(spec, fds, w)
    except TransformError as exc:
        raise SourceInvalid(str(exc)) from None
    return w.digest(), w.size


def slice_row_problem(fd: int, spec: TransformSpec, src_hasher=None) -> str | None:
    """Why the row is not `row_cells` equal cells of `cell` bytes + a zero tail < 4096,
    or is all zero (crash residue), or None. One sequential read; every byte also goes
    to `src_hasher` (staleness). Cells are compared by XXH3-128, like replicas elsewhere."""
    size = os.fstat(fd).st_size
    n, cell = spec.row_cells, spec.cell
    used = n * cell
    if used > size or size - used >= PAGE:
        return f"a {size}-byte row is not {n} cells of {cell} bytes + a pad < {PAGE}"
    upd = src_hasher.update if src_hasher is not None else (lambda b: None)
    offset = 0
    cells = []
    zero = True  # is cell 0 all zero (then, its replicas and the tail being equal and zero, the row)
    for k in range(n):
        h = xxhash.xxh3_128()
        end = offset + cell
        while offset < end:
            buf = os.pread(fd, min(CHUNK, end - offset), offset)
            if not buf:
                return f"short read at offset {offset} (the file changed while reading)"
            h.update(buf)
            upd(buf)
            if k == 0 and zero:
                zero = not buf[0] and buf.count(0) == len(buf)
            offset += len(buf)
        cells.append(h.digest())
    tail = os.pread(fd, size - used, used) if size > used else b""
    upd(tail)
    differs = next((k for k in range(1, n) if cells[k] != cells[0]), None)
    if differs is not None:
        return f"cell {differs} differs from cell 0 (the row does not hold {n} replicas)"
    if tail.strip(b"\0"):
        return f"the {len(tail)} bytes after the {n} cells are not zero"
    if zero:
        return f"zero_filled: all {size} bytes are zero (crash residue)"
    return None


def expected_transform_output(root: str, plan: UnitPlan, rec: Any) -> tuple[int, Callable[[], bytes | None]]:
    """For a scan that finds a file at a transform's target path: the output size the
    transform would write, and a function computing its hash (None when unknown), so the
    file can be called already_present only when it holds exactly those bytes."""
    try:
        spec = transform_spec(plan, rec.action, rec.group or 0, rec.size, rec.reason)
    except SourceInvalid:
        return -1, lambda: None
    tail = rec.relpath.split("/", 1)[1]
    ranks = plan.expected_ranks if spec.action != "slice" else (rec.rank,)
    paths = [os.path.join(root, plan.rank_dirs.get(r, ""), tail) if spec.action != "slice"
             else os.path.join(root, rec.relpath) for r in ranks]

    def digest() -> bytes | None:
        fds: list[int] = []
        try:
            for p in paths:
                fds.append(open_noatime(p))
            return transform_output_hash(spec, fds)[0]
        except (OSError, SourceInvalid):
            return None
        finally:
            for fd in fds:
                os.close(fd)

    return spec.output_size, digest
