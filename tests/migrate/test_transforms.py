"""Byte transforms (migration.md §1 slice / concat / relayout).

Every page a source writer stores gets a distinct pattern (rank, tensor, block), and the
produced rows are read back the way the vLLM reader does: worker cell w at ``w × cell``,
tensor t at ``t × B × P`` inside the cell, block b at ``+ b × P``.
"""

from __future__ import annotations

import io

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvmigrate.errors import IntegrityError
from kvmigrate.transforms import (
    ROW_ALIGN,
    CellSearch,
    TransformError,
    concat_cells,
    find_slice_cell,
    llmd_to_vllm_row,
    pad_len,
    plan_relayout,
    relayout_block_major_to_tensor_major,
    relayout_tensor_major_to_block_major,
    slice_cell,
    write_llmd_row,
    write_relayout,
    write_slice,
)

# --------------------------------------------------------------------------- helpers


def page(rank: int, tensor: int, block: int, P: int) -> bytes:
    """A page no other (rank, tensor, block) shares, for any P >= 4 (or small ids)."""
    ident = (rank * 64 + tensor) * 256 + block
    if P < 4:
        return ident.to_bytes(P, "little")
    return ident.to_bytes(4, "little") + bytes((ident * 7 + k) & 0xFF for k in range(P - 4))


def llmd_file(rank: int, *, B: int, T: int, P: int) -> bytes:
    """What an llm-d worker writes: block-major, for each block, for each tensor, one page."""
    return b"".join(page(rank, t, b, P) for b in range(B) for t in range(T))


def vllm_page(row: bytes, *, worker: int, tensor: int, block: int, B: int, P: int, cell: int) -> bytes:
    """The page a vLLM reader takes from a row (tensor-major cells, one per worker)."""
    start = worker * cell + tensor * B * P + block * P
    return row[start : start + P]


def naive_block_to_tensor_major(data: bytes, B: int, T: int, P: int) -> bytes:
    out = bytearray(len(data))
    for b in range(B):
        for t in range(T):
            out[(t * B + b) * P : (t * B + b + 1) * P] = data[(b * T + t) * P : (b * T + t + 1) * P]
    return bytes(out)


def valid_cells(row: bytes, n: int) -> list[int]:
    """The definition of a slice cell, restated literally (test oracle)."""
    size = len(row)
    found = []
    for c in range(1, size // n + 1):
        if not (n * c <= size < n * c + ROW_ALIGN):
            continue
        cells = [row[k * c : (k + 1) * c] for k in range(n)]
        if all(x == cells[0] for x in cells) and row[n * c :] == bytes(size - n * c):
            found.append(c)
    return found


def replicated_row(cell: bytes, n: int) -> bytes:
    return cell * n + bytes(pad_len(len(cell) * n) - len(cell) * n)


# --------------------------------------------------------------------------- pad_len


@pytest.mark.parametrize(("n", "padded"), [(0, 0), (1, 4096), (4095, 4096), (4096, 4096), (4097, 8192)])
def test_pad_len_rounds_up_to_4096(n, padded):
    assert pad_len(n) == padded


def test_pad_len_rejects_negative():
    with pytest.raises(TransformError):
        pad_len(-1)


def test_transform_error_is_integrity_and_value_error():
    assert issubclass(TransformError, IntegrityError)
    assert issubclass(TransformError, ValueError)


# --------------------------------------------------------------------------- relayout


@pytest.mark.parametrize(("B", "T", "P"), [(4, 8, 16), (3, 5, 7), (16, 3, 2), (2, 1, 64), (1, 6, 12)])
def test_relayout_puts_every_page_where_the_vllm_reader_looks(B, T, P):
    data = llmd_file(0, B=B, T=T, P=P)
    cell = relayout_block_major_to_tensor_major(data, B=B, T=T, P=P)
    assert len(cell) == B * T * P
    for t in range(T):
        for b in range(B):
            assert vllm_page(cell, worker=0, tensor=t, block=b, B=B, P=P, cell=len(cell)) == page(0, t, b, P)


def test_relayout_with_one_block_per_file_is_identity():
    data = llmd_file(1, B=1, T=6, P=32)
    assert relayout_block_major_to_tensor_major(data, B=1, T=6, P=32) == data


def test_inverse_relayout_restores_block_major_order():
    B, T, P = 3, 4, 10
    cell = b"".join(page(0, t, b, P) for t in range(T) for b in range(B))
    assert relayout_tensor_major_to_block_major(cell, B=B, T=T, P=P) == llmd_file(0, B=B, T=T, P=P)


def test_relayout_accepts_memoryview_and_bytearray():
    data = llmd_file(0, B=4, T=3, P=8)
    expected = relayout_block_major_to_tensor_major(data, B=4, T=3, P=8)
    assert relayout_block_major_to_tensor_major(memoryview(data), B=4, T=3, P=8) == expected
    assert relayout_block_major_to_tensor_major(bytearray(data), B=4, T=3, P=8) == expected


@pytest.mark.parametrize("delta", [-1, 1, 4096])
def test_relayout_size_mismatch_raises(delta):
    data = bytes(4 * 8 * 16 + delta)
    with pytest.raises(TransformError, match=r"B·T·P = 4·8·16 = 512"):
        relayout_block_major_to_tensor_major(data, B=4, T=8, P=16)
    with pytest.raises(TransformError):
        relayout_tensor_major_to_block_major(data, B=4, T=8, P=16)


@pytest.mark.parametrize(("B", "T", "P"), [(0, 1, 1), (1, 0, 1), (1, 1, 0), (True, 1, 1), (2.0, 1, 1)])
def test_relayout_rejects_bad_geometry(B, T, P):
    with pytest.raises(TransformError):
        relayout_block_major_to_tensor_major(b"", B=B, T=T, P=P)


@settings(max_examples=200, deadline=None)
@given(
    B=st.integers(1, 12),
    T=st.integers(1, 12),
    P=st.integers(1, 40),
    seed=st.binary(min_size=1, max_size=64),
)
def test_relayout_round_trips_and_matches_definition(B, T, P, seed):
    data = (seed * (B * T * P // len(seed) + 1))[: B * T * P]
    data = bytes((x + i) & 0xFF for i, x in enumerate(data))
    cell = relayout_block_major_to_tensor_major(data, B=B, T=T, P=P)
    assert cell == naive_block_to_tensor_major(data, B, T, P)
    assert relayout_tensor_major_to_block_major(cell, B=B, T=T, P=P) == data


# --------------------------------------------------------------------------- concat


def test_concat_puts_rank_w_at_w_times_cell_and_pads_with_zeros():
    cells = [bytes([rank + 1]) * 1000 for rank in range(3)]
    row = concat_cells(cells)
    assert len(row) == 4096
    for rank in range(3):
        assert row[rank * 1000 : (rank + 1) * 1000] == cells[rank]
    assert row[3000:] == bytes(1096)


def test_concat_of_aligned_cells_adds_no_pad():
    cells = [bytes([7]) * 4096, bytes([9]) * 4096]
    assert concat_cells(cells) == cells[0] + cells[1]


def test_concat_rejects_unequal_cells():
    with pytest.raises(TransformError, match="rank 1"):
        concat_cells([bytes(100), bytes(101)])


def test_concat_rejects_no_cells_and_empty_cells():
    with pytest.raises(TransformError):
        concat_cells([])
    with pytest.raises(TransformError):
        concat_cells([b"", b""])


# --------------------------------------------------------------------------- slice_cell


def test_slice_keeps_cell_zero_and_pads():
    cell = bytes(range(1, 201)) * 30  # 6000 bytes
    row = replicated_row(cell, 4)
    out = slice_cell(row, cell=len(cell))
    assert out == cell + bytes(8192 - 6000)


def test_slice_with_n_rechecks_the_row():
    cell = bytes(range(1, 101))
    row = bytearray(replicated_row(cell, 4))
    assert slice_cell(bytes(row), cell=100, n=4) == cell + bytes(3996)
    row[250] ^= 0xFF
    with pytest.raises(TransformError, match="cell 2 differs"):
        slice_cell(bytes(row), cell=100, n=4)


def test_slice_rejects_cell_larger_than_row():
    with pytest.raises(TransformError):
        slice_cell(bytes(10), cell=11)


# --------------------------------------------------------------------------- find_slice_cell


def test_find_slice_cell_unique_answer_from_data():
    cell = bytes((i * 37 + 11) % 251 + 1 for i in range(5000))
    result = find_slice_cell(replicated_row(cell, 4), n=4)
    assert result == CellSearch(5000, [5000], result.reason)
    assert "only size" in result.reason


def test_find_slice_cell_accepts_memoryview():
    cell = bytes((i * 13 + 5) % 255 + 1 for i in range(3000))
    row = replicated_row(cell, 2)
    assert find_slice_cell(memoryview(row), n=2).cell == 3000


def test_find_slice_cell_known_cell_verified():
    cell = bytes((i * 13 + 5) % 255 + 1 for i in range(3000))
    result = find_slice_cell(replicated_row(cell, 8), n=8, known_cell=3000)
    assert result.cell == 3000
    assert "from facts" in result.reason


def test_find_slice_cell_known_cell_settles_an_ambiguous_row():
    row = bytes(8192)  # all zero: the data alone admits every size from 2049 to 4096
    assert find_slice_cell(row, n=2).cell is None
    assert find_slice_cell(row, n=2, known_cell=4096).cell == 4096


def test_find_slice_cell_known_cell_disagreeing_with_data():
    cell = bytes((i * 13 + 5) % 255 + 1 for i in range(3000))
    row = replicated_row(cell, 4)
    result = find_slice_cell(row, n=4, known_cell=2999)
    assert result.cell is None
    assert "facts and data disagree" in result.reason
    assert result.candidates == [3000]


def test_find_slice_cell_known_cell_too_large_for_row():
    row = replicated_row(bytes(range(1, 101)), 2)
    result = find_slice_cell(row, n=2, known_cell=5000)
    assert result.cell is None
    assert "exceeds" in result.reason and "facts and data disagree" in result.reason


def test_find_slice_cell_known_cell_with_nonzero_tail():
    cell = bytes(range(1, 101))
    row = bytearray(replicated_row(cell, 2))
    row[-1] = 1
    result = find_slice_cell(bytes(row), n=2, known_cell=100)
    assert result.cell is None
    assert "not zero" in result.reason


def test_find_slice_cell_known_cell_leaving_a_whole_page_of_tail():
    cell = bytes(range(1, 101))
    row = replicated_row(cell, 2) + bytes(4096)
    result = find_slice_cell(row, n=2, known_cell=100)
    assert result.cell is None
    assert "a pad is < 4096" in result.reason


def test_find_slice_cell_all_zero_row_is_ambiguous_with_every_candidate():
    row = bytes(8192)
    result = find_slice_cell(row, n=2)
    assert result.cell is None
    assert result.candidates == list(range(2049, 4097)) == valid_cells(row, 2)
    assert "--page-bytes" in result.reason and "ambiguous" in result.reason


def test_find_slice_cell_cell_ending_in_zeros_is_still_found():
    cell = bytes(range(1, 11)) + bytes(10)  # replica zeros run into the pad zeros
    row = replicated_row(cell, 2)
    result = find_slice_cell(row, n=2)
    assert result.candidates == valid_cells(row, 2) == [20]
    assert result.cell == 20


def test_find_slice_cell_replicas_differ():
    row = bytearray(replicated_row(bytes(range(1, 201)), 4))
    row[450] ^= 0x55
    result = find_slice_cell(bytes(row), n=4)
    assert result == CellSearch(None, [], result.reason)
    assert result.reason.startswith("needs_slice: 4096 bytes, N=4: no cell size")


def test_find_slice_cell_nonzero_pad_byte_rules_out_every_size():
    cell = bytes(range(1, 101))
    row = bytearray(replicated_row(cell, 2))
    row[-1] = 0x01
    result = find_slice_cell(bytes(row), n=2)
    assert result.cell is None and result.candidates == [] == valid_cells(bytes(row), 2)


def test_find_slice_cell_needs_two_cells():
    with pytest.raises(TransformError):
        find_slice_cell(bytes(4096), n=1)


def _cells():
    random_cell = st.binary(min_size=1, max_size=3000)
    periodic = st.builds(
        lambda unit, reps, zeros: unit * reps + bytes(zeros),
        st.binary(min_size=1, max_size=6),
        st.integers(1, 400),
        st.integers(0, 40),
    )
    zero_tailed = st.builds(
        lambda head, zeros: head + bytes(zeros), st.binary(min_size=1, max_size=500), st.integers(1, 600)
    )
    return st.one_of(random_cell, periodic, zero_tailed, st.integers(1, 2000).map(bytes))


@pytest.mark.slow  # big property test / kill matrix: CI runs it, `-m 'not slow'` leaves it out
@settings(max_examples=300, deadline=None)
@given(cell=_cells(), n=st.integers(2, 8))
def test_find_slice_cell_never_guesses(cell, n):
    row = replicated_row(cell, n)
    result = find_slice_cell(row, n=n)
    oracle = valid_cells(row, n)
    assert len(cell) in oracle
    assert result.candidates == oracle
    if result.cell is not None:
        assert result.cell == len(cell)
        assert oracle == [len(cell)]
    else:
        assert len(oracle) > 1
        assert "pass --page-bytes" in result.reason
    assert slice_cell(row, cell=len(cell), n=n) == cell + bytes(pad_len(len(cell)) - len(cell))


@settings(max_examples=100, deadline=None)
@given(cell=_cells(), n=st.integers(2, 8), offset=st.integers(-3, 3))
def test_find_slice_cell_with_facts_accepts_only_the_true_cell_or_a_valid_one(cell, n, offset):
    row = replicated_row(cell, n)
    known = len(cell) + offset
    assume(known >= 1)
    result = find_slice_cell(row, n=n, known_cell=known)
    if result.cell is not None:
        assert result.cell == known and known in valid_cells(row, n)
    else:
        assert "facts and data disagree" in result.reason
        assert known not in valid_cells(row, n)


# --------------------------------------------------------------------------- plan_relayout


def mla_plan(size, *, B=4, layers=8, page_bytes=768):
    return plan_relayout(size, B=B, layers=layers, kv_kind="mla", page_bytes=page_bytes, tensors_per_layer=None)


def test_plan_relayout_mla():
    plan, reason = mla_plan(4 * 8 * 768)
    assert plan == {"B": 4, "T": 8, "P": 768}
    assert "4·8·768" in reason


def test_plan_relayout_full_attention_uses_tensors_per_layer():
    plan, _ = plan_relayout(2 * 6 * 512, B=2, layers=3, kv_kind="full", page_bytes=512, tensors_per_layer=2)
    assert plan == {"B": 2, "T": 6, "P": 512}


def test_plan_relayout_without_page_bytes_names_it():
    plan, reason = plan_relayout(24576, B=4, layers=8, kv_kind="mla", page_bytes=None, tensors_per_layer=None)
    assert plan is None
    assert reason == "needs_relayout: 24576 bytes, B=4, T=8, P unknown (pass --page-bytes)"


def test_plan_relayout_full_attention_without_tensors_per_layer_names_it():
    plan, reason = plan_relayout(24576, B=4, layers=8, kv_kind="full", page_bytes=384, tensors_per_layer=None)
    assert plan is None
    assert reason == "needs_relayout: 24576 bytes, B=4, T unknown (pass --tensors-per-layer), P=384"


def test_plan_relayout_unknown_kv_kind_and_layers():
    _, reason = plan_relayout(24576, B=4, layers=8, kv_kind=None, page_bytes=768, tensors_per_layer=None)
    assert "T unknown (pass --kv-kind)" in reason
    _, reason = plan_relayout(24576, B=4, layers=None, kv_kind="mla", page_bytes=768, tensors_per_layer=None)
    assert "T unknown (layer names unknown)" in reason
    plan, reason = plan_relayout(24576, B=4, layers=8, kv_kind="sliding", page_bytes=768, tensors_per_layer=2)
    assert plan is None and "not sliding" in reason


def test_plan_relayout_missing_blocks_per_file():
    plan, reason = mla_plan(24576, B=None)
    assert plan is None and "B unknown" in reason


def test_plan_relayout_size_disagreeing_with_facts():
    plan, reason = mla_plan(24576 + 4096)
    assert plan is None
    assert reason.startswith("needs_relayout: 28672 bytes, B=4, T=8, P=768: B·T·P = 24576")
    assert "facts and data disagree" in reason


@given(size=st.integers(0, 1 << 30), B=st.integers(1, 64), layers=st.integers(1, 128))
def test_plan_relayout_never_derives_page_bytes_from_size(size, B, layers):
    plan, reason = mla_plan(size, B=B, layers=layers, page_bytes=None)
    assert plan is None
    assert "P unknown (pass --page-bytes)" in reason


# --------------------------------------------------------------------------- llm-d -> vLLM row


def _assert_row_holds(row: bytes, *, ranks: list[int], B: int, T: int, P: int) -> None:
    """Every page of every listed rank sits where the vLLM reader looks; the rest is zero."""
    cell = B * T * P
    for worker, rank in enumerate(ranks):
        for t in range(T):
            for b in range(B):
                got = vllm_page(row, worker=worker, tensor=t, block=b, B=B, P=P, cell=cell)
                assert got == page(rank, t, b, P), (worker, t, b)
    assert len(row) == pad_len(cell * len(ranks))
    assert row[cell * len(ranks) :] == bytes(len(row) - cell * len(ranks))


@pytest.mark.parametrize(
    ("B", "layers", "tpl", "P"), [(2, 2, 2, 40), (1, 3, 2, 24), (4, 1, 2, 8), (3, 2, 1, 5)]
)
def test_full_attention_tp2_row_is_relayout_then_concat(B, layers, tpl, P):
    T = layers * tpl
    files = [llmd_file(rank, B=B, T=T, P=P) for rank in range(2)]
    row = llmd_to_vllm_row(files, B=B, T=T, P=P, kv_kind="full", replicated_target=False)
    _assert_row_holds(row, ranks=[0, 1], B=B, T=T, P=P)


def test_mla_replicated_target_keeps_rank_zero_cell_only():
    B, T, P = 4, 3, 16
    files = [llmd_file(0, B=B, T=T, P=P)] * 2
    row = llmd_to_vllm_row(files, B=B, T=T, P=P, kv_kind="mla", replicated_target=True)
    _assert_row_holds(row, ranks=[0], B=B, T=T, P=P)


def test_mla_non_replicated_target_holds_every_replica():
    B, T, P = 4, 3, 16
    files = [llmd_file(0, B=B, T=T, P=P)] * 4
    row = llmd_to_vllm_row(files, B=B, T=T, P=P, kv_kind="mla", replicated_target=False)
    _assert_row_holds(row, ranks=[0, 0, 0, 0], B=B, T=T, P=P)


def test_mla_replicas_that_differ_are_refused():
    files = [llmd_file(0, B=2, T=2, P=8), llmd_file(1, B=2, T=2, P=8)]
    with pytest.raises(TransformError, match="rank 1 differs"):
        llmd_to_vllm_row(files, B=2, T=2, P=8, kv_kind="mla", replicated_target=True)


def test_llmd_row_rank_file_of_wrong_size_is_refused():
    files = [llmd_file(0, B=2, T=2, P=8), llmd_file(1, B=2, T=2, P=8)[:-1]]
    with pytest.raises(TransformError, match="rank 1's file is 31 bytes"):
        llmd_to_vllm_row(files, B=2, T=2, P=8, kv_kind="full", replicated_target=False)


def test_llmd_row_refuses_replicated_full_attention_and_unknown_kind():
    files = [llmd_file(0, B=1, T=2, P=8)]
    with pytest.raises(TransformError, match="only for MLA"):
        llmd_to_vllm_row(files, B=1, T=2, P=8, kv_kind="full", replicated_target=True)
    with pytest.raises(TransformError, match="mla or full"):
        llmd_to_vllm_row(files, B=1, T=2, P=8, kv_kind="sliding", replicated_target=False)
    with pytest.raises(TransformError, match="no rank files"):
        llmd_to_vllm_row([], B=1, T=2, P=8, kv_kind="full", replicated_target=False)


# --------------------------------------------------------------------------- streaming writers


def _write(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(("B", "T", "P"), [(4, 8, 16), (16, 3, 2), (1, 5, 9)])
def test_write_relayout_streams_the_same_bytes(tmp_path, B, T, P):
    data = llmd_file(0, B=B, T=T, P=P)
    src = _write(tmp_path, "blk.bin", data)
    out = io.BytesIO()
    with open(src, "rb") as f:
        assert write_relayout(f, out, B=B, T=T, P=P) == B * T * P
    assert out.getvalue() == relayout_block_major_to_tensor_major(data, B=B, T=T, P=P)


def test_write_relayout_refuses_a_file_of_the_wrong_size(tmp_path):
    src = _write(tmp_path, "blk.bin", bytes(100))
    with open(src, "rb") as f, pytest.raises(TransformError, match="100 bytes"):
        write_relayout(f, io.BytesIO(), B=2, T=2, P=24)


@pytest.mark.parametrize(
    ("kind", "replicated", "B", "T", "P", "ranks"),
    [
        ("full", False, 2, 4, 40, [0, 1]),
        ("full", False, 1, 4, 1024, [0, 1, 2, 3]),
        ("mla", True, 4, 3, 16, [0, 0]),
        ("mla", False, 4, 3, 16, [0, 0]),
    ],
)
def test_write_llmd_row_streams_the_same_row(tmp_path, kind, replicated, B, T, P, ranks):
    files = [llmd_file(rank, B=B, T=T, P=P) for rank in ranks]
    paths = [_write(tmp_path, f"r{i}.bin", data) for i, data in enumerate(files)]
    handles = [open(p, "rb") for p in paths]  # noqa: SIM115  (closed in finally)
    try:
        out = io.BytesIO()
        written = write_llmd_row(handles, out, B=B, T=T, P=P, kv_kind=kind, replicated_target=replicated)
    finally:
        for h in handles:
            h.close()
    expected = llmd_to_vllm_row(files, B=B, T=T, P=P, kv_kind=kind, replicated_target=replicated)
    assert out.getvalue() == expected
    assert written == len(expected)


def test_write_slice_streams_cell_zero_and_pad(tmp_path):
    cell = bytes((i * 13 + 5) % 255 + 1 for i in range(5000))
    row = replicated_row(cell, 4)
    src = _write(tmp_path, "row.bin", row)
    out = io.BytesIO()
    with open(src, "rb") as f:
        assert write_slice(f.fileno(), out, cell=5000) == 8192
    assert out.getvalue() == slice_cell(row, cell=5000)

