"""Byte transforms that turn legacy block files into the rows a newer engine reads.

Three transforms of migration.md §1, as pure functions on bytes (plus small streaming
writers for files too large to hold twice in memory):

* ``slice``    -- a vLLM MLA row holding N identical replica cells becomes one cell + pad
                  (the ``replicated_layout`` row).
* ``concat``   -- llm-d per-rank files of one block become one vLLM row
                  ``[W0][W1]...[W(N-1)]`` + zero pad to a multiple of 4096.
* ``relayout`` -- an llm-d file is block-major ``[B][T][P]`` (for each GPU block, for each
                  tensor, one page of P bytes); a vLLM worker cell is tensor-major
                  ``[T][B][P]``. For B == 1 the two orders coincide.

The planning helpers (``find_slice_cell``, ``plan_relayout``) never guess: a number that
the files and the deployment facts do not prove leaves the block ``needs_*`` with a reason
naming the missing number.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import BinaryIO, Protocol, TypeGuard

from kvmigrate import findings
from kvmigrate.errors import IntegrityError

ROW_ALIGN = 4096
"""vLLM rows are mmap'd CPU rows, rounded up to the page size; files keep that padding."""

_STREAM_CHUNK = 1 << 20
_Buffer = bytes | bytearray | memoryview


class TransformError(IntegrityError, ValueError):
    """The bytes do not have the shape a transform needs (size, cells, replicas)."""


class _Writer(Protocol):
    def write(self, data: _Buffer, /) -> object: ...


# --------------------------------------------------------------------------- basics


def pad_len(n: int) -> int:
    """``n`` rounded up to a multiple of ROW_ALIGN (the length of a padded vLLM row)."""
    _require_int("length", n, minimum=0)
    return -(-n // ROW_ALIGN) * ROW_ALIGN


def _require_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TransformError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _is_count(value: object) -> TypeGuard[int]:
    """A proven positive number (bool is not a count, None is unknown)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _byte_view(data: _Buffer) -> memoryview:
    """A flat unsigned-byte view of any contiguous buffer, without copying."""
    view = memoryview(data)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


def _padded(parts: Sequence[_Buffer], length: int) -> bytes:
    """Join ``parts`` (total ``length`` bytes) and zero-pad to a multiple of 4096, one copy."""
    return b"".join([*parts, bytes(pad_len(length) - length)])


# --------------------------------------------------------------------------- relayout


def _transpose_pages(data: _Buffer, rows: int, cols: int, page: int) -> bytes:
    """``[rows][cols][page]`` -> ``[cols][rows][page]``, treating each page as one element.

    Large pages (the real case: KiB to MiB) are gathered with one join over page views;
    tiny pages use strided slice assignment, one per byte column, so the Python-level
    loop count is min(rows·cols, cols·page).
    """
    view = _byte_view(data)
    if page >= rows:
        return b"".join(
            [
                view[(r * cols + c) * page : (r * cols + c + 1) * page]
                for c in range(cols)
                for r in range(rows)
            ]
        )
    src = bytes(view)
    out = bytearray(len(src))
    run = rows * page  # one output column block: all rows of column c
    for c in range(cols):
        for k in range(page):
            out[c * run + k : (c + 1) * run : page] = src[c * page + k :: cols * page]
    return bytes(out)


def _check_geometry(data_len: int, B: int, T: int, P: int, what: str) -> None:
    _require_int("B (blocks per file)", B, minimum=1)
    _require_int("T (tensors)", T, minimum=1)
    _require_int("P (page bytes)", P, minimum=1)
    if data_len != B * T * P:
        raise TransformError(
            f"{what} is {data_len} bytes, but B·T·P = {B}·{T}·{P} = {B * T * P}: "
            "the file does not have the geometry the facts describe"
        )


def relayout_block_major_to_tensor_major(data: _Buffer, *, B: int, T: int, P: int) -> bytes:
    """llm-d file ``[B][T][P]`` -> vLLM cell ``[T][B][P]``; ``len(data)`` must be B·T·P."""
    view = _byte_view(data)
    _check_geometry(len(view), B, T, P, "block-major data")
    return _transpose_pages(view, B, T, P)


def relayout_tensor_major_to_block_major(data: _Buffer, *, B: int, T: int, P: int) -> bytes:
    """vLLM cell ``[T][B][P]`` -> llm-d order ``[B][T][P]`` (the inverse transform)."""
    view = _byte_view(data)
    _check_geometry(len(view), B, T, P, "tensor-major data")
    return _transpose_pages(view, T, B, P)


# --------------------------------------------------------------------------- concat / slice


def concat_cells(cells: Sequence[_Buffer]) -> bytes:
    """Rank 0 ‖ rank 1 ‖ … ‖ rank N-1 + zero pad: the row a vLLM reader splits at ``w × cell``.

    The reader finds worker w's cell at ``w × cell``, so every cell must have the same size.
    """
    if not cells:
        raise TransformError("concat needs at least one rank's cell, got none")
    views = [_byte_view(cell) for cell in cells]
    size = len(views[0])
    if size == 0:
        raise TransformError("concat: rank 0's cell is empty")
    for rank, view in enumerate(views):
        if len(view) != size:
            raise TransformError(
                f"concat: rank {rank}'s cell is {len(view)} bytes, rank 0's is {size}: "
                "a vLLM reader needs equal cells"
            )
    return _padded(views, size * len(views))


def slice_cell(row: _Buffer, *, cell: int, n: int | None = None) -> bytes:
    """Cell 0 of a replicated row + zero pad: the ``replicated_layout`` row.

    With ``n`` the row is re-checked (n equal cells, zero tail) before anything is cut, so
    a row that changed since planning cannot produce a wrong output.
    """
    view = _byte_view(row)
    _require_int("cell", cell, minimum=1)
    if cell > len(view):
        raise TransformError(f"slice: cell {cell} bytes is larger than the {len(view)}-byte row")
    if n is not None:
        data = row if isinstance(row, (bytes, bytearray)) else bytes(view)
        problem = _row_problem(view, data, cell=cell, n=n)
        if problem is not None:
            raise TransformError(
                f"slice: row of {len(view)} bytes is not {n} cells of {cell}: {problem}"
            )
    return _padded([view[:cell]], cell)


# --------------------------------------------------------------------------- slice cell search


@dataclass
class CellSearch:
    """Outcome of the slice cell-size search: ``cell`` is None unless proven."""

    cell: int | None
    candidates: list[int] = field(default_factory=list)
    reason: str = ""


def _row_problem(view: memoryview, data: bytes | bytearray, *, cell: int, n: int) -> str | None:
    """Why ``view`` is not ``n`` equal cells of ``cell`` bytes + a zero tail < 4096, or None."""
    size = len(view)
    used = n * cell
    if used > size:
        return f"N·c = {n}·{cell} = {used} exceeds the {size}-byte row"
    tail = size - used
    if tail >= ROW_ALIGN:
        return f"the row has {tail} bytes after N·c = {used}, a pad is < {ROW_ALIGN}"
    # Cells 0..n-1 are equal <=> the row is equal to itself shifted by one cell.
    if not data.startswith(view[cell:used]):
        first = next(k for k in range(1, n) if not data.startswith(view[k * cell : (k + 1) * cell]))
        return f"cell {first} differs from cell 0"
    if tail and not data.endswith(bytes(tail)):
        return f"the {tail} bytes after the cells are not zero"
    return None


def _show(candidates: list[int]) -> str:
    if len(candidates) <= 8:
        return ", ".join(str(c) for c in candidates) or "none"
    return f"{candidates[0]}..{candidates[-1]} ({len(candidates)} values)"


def _data_candidates(view: memoryview, data: bytes | bytearray, n: int) -> list[int]:
    """Every c with N·c ≤ size < N·c + 4096, N equal cells and a zero tail (ascending)."""
    size = len(view)
    low = max(1, -(-(size - (ROW_ALIGN - 1)) // n))
    high = size // n
    if low > high:
        return []
    # Tail check first, without touching the cells: the tail [N·c, size) is shorter than
    # 4096, so the trailing zero run of the last 4095 bytes decides it for every c.
    window = bytes(view[max(0, size - (ROW_ALIGN - 1)) :])
    trailing_zeros = len(window) - len(window.rstrip(b"\0"))
    low = max(low, -(-(size - trailing_zeros) // n))
    if low > high:
        return []
    if data == bytes(size):
        return list(range(low, high + 1))  # all-zero row: every size fits, no need to compare
    # startswith on a memoryview is one memcmp with early exit: wrong sizes cost little.
    return [c for c in range(low, high + 1) if data.startswith(view[c : n * c])]


def find_slice_cell(row: _Buffer, *, n: int, known_cell: int | None = None) -> CellSearch:
    """The cell size of a row holding ``n`` replica cells + zero pad, only when proven.

    ``known_cell`` (layers × page_bytes × blocks_per_file, from facts) is verified against
    the data; without it the data must admit exactly one size. Otherwise ``cell`` is None,
    ``candidates`` lists every size the data allows, and ``reason`` names what is missing.
    """
    _require_int("n (cells per row)", n, minimum=2)
    view = _byte_view(row)
    data = row if isinstance(row, (bytes, bytearray)) else bytes(view)
    size = len(view)
    prefix = f"needs_slice: {size} bytes, N={n}"
    if known_cell is not None:
        _require_int("known cell", known_cell, minimum=1)
        problem = _row_problem(view, data, cell=known_cell, n=n)
        if problem is None:
            return CellSearch(
                known_cell,
                [known_cell],
                f"cell {known_cell} bytes from facts (layers × page_bytes × blocks_per_file), "
                f"verified: {n} equal cells and {size - n * known_cell} zero bytes of pad",
            )
        found = _data_candidates(view, data, n)
        return CellSearch(
            None,
            found,
            f"{prefix}: facts and data disagree: facts give cell {known_cell} "
            f"(layers × page_bytes × blocks_per_file) but {problem}; "
            f"cell sizes the data allows: {_show(found)}",
        )
    found = _data_candidates(view, data, n)
    if len(found) == 1:
        return CellSearch(
            found[0],
            found,
            f"cell {found[0]} bytes: the only size with {n} equal cells and a zero tail",
        )
    if not found:
        return CellSearch(
            None,
            [],
            f"{prefix}: no cell size c with N·c ≤ size < N·c + {ROW_ALIGN} gives {n} equal "
            "cells and a zero tail (the row does not hold N replicas)",
        )
    return CellSearch(
        None,
        found,
        findings.reason(f"{prefix}, cell size ambiguous: {len(found)} candidates {_show(found)} "
                        "(pass --page-bytes: cell = layers × page_bytes × blocks_per_file)",
                        findings.NEEDS_FACT, asks=findings.asks("--page-bytes")),
    )


# --------------------------------------------------------------------------- relayout planning


def plan_relayout(
    size: int,
    *,
    B: int | None,
    layers: int | None,
    kv_kind: str | None,
    page_bytes: int | None,
    tensors_per_layer: int | None,
) -> tuple[dict | None, str]:
    """``({"B", "T", "P"}, reason)`` when ``size == B·T·P`` is proven, else ``(None, reason)``.

    P comes only from the ``page_bytes`` fact, never from the file size: dividing the size
    by B·T would always "work" and silently produce the wrong page boundaries.
    """
    missing: list[str] = []
    b_text = f"B={B}"
    if not _is_count(B):
        b_text = "B unknown (blocks_per_file missing from the identity)"
        missing.append("B")

    T: int | None = None
    known_layers = layers if _is_count(layers) else None
    if kv_kind is None:
        t_text = "T unknown (pass --kv-kind)"
    elif kv_kind not in ("mla", "full"):
        t_text = f"T unknown (relayout is defined for kv kind mla or full, not {kv_kind})"
    elif known_layers is None:
        t_text = "T unknown (layer names unknown)"
    elif kv_kind == "mla":
        T = known_layers
        t_text = f"T={T}"
    elif _is_count(tensors_per_layer):
        T = known_layers * tensors_per_layer
        t_text = f"T={T}"
    else:
        t_text = "T unknown (pass --tensors-per-layer)"
    if T is None:
        missing.append("T")

    P: int | None = None
    if _is_count(page_bytes):
        P = page_bytes
        p_text = f"P={P}"
    else:
        p_text = "P unknown (pass --page-bytes)"
        missing.append("P")

    numbers = f"{size} bytes, {b_text}, {t_text}, {p_text}"
    if missing:
        return None, f"needs_relayout: {numbers}"
    assert B is not None and T is not None and P is not None
    if size != B * T * P:
        return None, (
            f"needs_relayout: {numbers}: B·T·P = {B * T * P} ≠ size "
            "(facts and data disagree; check --page-bytes and --tensors-per-layer)"
        )
    return {"B": B, "T": T, "P": P}, f"relayout [B][T][P] -> [T][B][P]: {size} bytes = {B}·{T}·{P}"


# --------------------------------------------------------------------------- llm-d -> vLLM row


def _check_row_kind(kv_kind: str, replicated_target: bool) -> None:
    if kv_kind not in ("mla", "full"):
        raise TransformError(f"llm-d -> vLLM row: kv kind must be mla or full, got {kv_kind!r}")
    if replicated_target and kv_kind != "mla":
        raise TransformError("llm-d -> vLLM row: a replicated_layout target exists only for MLA")


def llmd_to_vllm_row(
    rank_files: Sequence[_Buffer],
    *,
    B: int,
    T: int,
    P: int,
    kv_kind: str,
    replicated_target: bool,
) -> bytes:
    """The vLLM row for one llm-d block, from every rank's file (rank order).

    Each rank's file becomes a tensor-major cell; an MLA ``replicated_layout`` target keeps
    rank 0's cell alone, every other target holds all N cells. MLA rank files are replicas
    and are checked to be equal: a row made of differing replicas is not what vLLM writes.
    """
    _check_row_kind(kv_kind, replicated_target)
    if not rank_files:
        raise TransformError("llm-d -> vLLM row: no rank files given")
    views = [_byte_view(f) for f in rank_files]
    for rank, view in enumerate(views):
        _check_geometry(len(view), B, T, P, f"rank {rank}'s file")
    if kv_kind == "mla":
        for rank, view in enumerate(views[1:], start=1):
            if view != views[0]:
                raise TransformError(
                    f"llm-d -> vLLM row: MLA replica of rank {rank} differs from rank 0"
                )
    if replicated_target:
        views = views[:1]
    cells = views if B == 1 else [relayout_block_major_to_tensor_major(v, B=B, T=T, P=P) for v in views]
    return concat_cells(cells)


# --------------------------------------------------------------------------- streaming writers


def _fd(src: int | BinaryIO) -> int:
    return src if isinstance(src, int) else src.fileno()


def _pread_exact(fd: int, buf: bytearray, offset: int) -> None:
    got = os.preadv(fd, [buf], offset)
    if got != len(buf):
        raise TransformError(
            f"short read: {got} of {len(buf)} bytes at offset {offset} (the file changed while reading)"
        )


def write_pad(dst: _Writer, length: int) -> int:
    """Write the zeros that bring a row of ``length`` bytes to a multiple of 4096."""
    pad = pad_len(length) - length
    if pad:
        dst.write(bytes(pad))
    return pad


def write_relayout(src: int | BinaryIO, dst: _Writer, *, B: int, T: int, P: int, halves: int = 1) -> int:
    """Stream ``[B][T][P]`` from ``src`` as ``[T][B][P]`` into ``dst`` in output order;
    with ``halves`` (an SGLang MHA page: the K half, then the V half) each half of
    B·T·P bytes is transposed on its own, ``[h][B][T][P]`` -> ``[h][T][B][P]``.

    Memory stays at one P-byte buffer whatever the file size; output is sequential, so
    ``dst`` may be a hashing writer. Returns the bytes written (halves·B·T·P, no pad).
    """
    fd = _fd(src)
    _require_int("halves", halves, minimum=1)
    size = os.fstat(fd).st_size
    if size % halves:
        raise TransformError(f"a {size}-byte file is not {halves} equal halves")
    _check_geometry(size // halves, B, T, P, "block-major file" if halves == 1 else "each half of the page")
    buf = bytearray(P)
    for h in range(halves):
        base = h * B * T * P
        for t in range(T):
            for b in range(B):
                _pread_exact(fd, buf, base + (b * T + t) * P)
                dst.write(buf)
    return halves * B * T * P


def _write_copy(fd: int, dst: _Writer, length: int) -> None:
    buf = bytearray(min(_STREAM_CHUNK, length))
    view = memoryview(buf)
    offset = 0
    while offset < length:
        part = view[: min(len(buf), length - offset)]
        got = os.preadv(fd, [part], offset)
        if got != len(part):
            raise TransformError(
                f"short read: {got} of {len(part)} bytes at offset {offset} (the file changed)"
            )
        dst.write(part)
        offset += got


def write_slice(src: int | BinaryIO, dst: _Writer, *, cell: int) -> int:
    """Stream cell 0 of ``src`` + zero pad into ``dst``; returns bytes written.

    The cell size must already be proven (``find_slice_cell``); this only copies.
    """
    fd = _fd(src)
    _require_int("cell", cell, minimum=1)
    size = os.fstat(fd).st_size
    if cell > size:
        raise TransformError(f"slice: cell {cell} bytes is larger than the {size}-byte file")
    _write_copy(fd, dst, cell)
    return cell + write_pad(dst, cell)


def write_llmd_row(
    rank_srcs: Sequence[int | BinaryIO],
    dst: _Writer,
    *,
    B: int,
    T: int,
    P: int,
    kv_kind: str,
    replicated_target: bool,
) -> int:
    """Streaming ``llmd_to_vllm_row``: same bytes, bounded memory; returns bytes written.

    Unlike the in-memory version it does not compare MLA replicas (that would read every
    rank twice): the caller must have proven them equal by content hash, as migration.md
    §1 requires for any action that relies on replicas being equal.
    """
    _check_row_kind(kv_kind, replicated_target)
    if not rank_srcs:
        raise TransformError("llm-d -> vLLM row: no rank files given")
    fds = [_fd(s) for s in rank_srcs]
    for rank, fd in enumerate(fds):
        _check_geometry(os.fstat(fd).st_size, B, T, P, f"rank {rank}'s file")
    if replicated_target:
        fds = fds[:1]
    for fd in fds:
        if B == 1:
            _write_copy(fd, dst, T * P)
        else:
            write_relayout(fd, dst, B=B, T=T, P=P)
    written = len(fds) * B * T * P
    return written + write_pad(dst, written)
