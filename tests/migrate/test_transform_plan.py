"""Planning and geometry of the transforms, rule by rule (no trees needed):

* classify: when slice / concat / relayout are proven, the numbers their reasons carry,
  the rank-row rule, precedence over link/copy_pad, and the needs_* reason naming the
  missing number otherwise;
* migrate.outputs: the geometry re-derived for apply (`transform_spec`), the streaming
  output and its hash (`write_transform`, `HashingWriter`), the row check before a
  slice (`slice_row_problem`);
* kvmigrate.cost: the cost model read from reasons.
"""

from __future__ import annotations

import os

import pytest

from kvmigrate import families
from kvmigrate.classify import LEGACY_FLOOR, UNVERIFIED, FileRecord, TargetInfo, UnitPlan, classify_block, slice_reason
from kvmigrate.cost import TRANSFORM_BYTES_PER_SECOND, transform_cost
from kvmigrate.findings import TRANSFORM, finding_of
from kvmigrate.migrate.outputs import (
    HashingWriter,
    SourceInvalid,
    TransformSpec,
    slice_row_problem,
    transform_output_hash,
    transform_spec,
    write_transform,
)
from kvmigrate.transforms import llmd_to_vllm_row, relayout_block_major_to_tensor_major

HEX = "abcdef" + "0" * 58
SPECIFIC = TargetInfo("vllm-0.28", "m_111111111111", "111111111111", "m_111111111111_r0", False, False)
AGNOSTIC = TargetInfo("vllm-0.28", "m_111111111111", "111111111111", "m_111111111111_r0", False, True)
REPLICATED = TargetInfo("vllm-0.28", "m_222222222222", "222222222222", "m_222222222222_r0", True, True)


def rec(rank: int, size: int, content: bytes | None = None) -> FileRecord:
    return FileRecord(f"m_000000000000_r{rank}/abc/de_g0/{HEX}.bin", rank, 0, HEX, size, 1, 100 + rank, 1, 1,
                      content=content)


def llmd(ranks: int, **kw) -> UnitPlan:
    kw.setdefault("target", AGNOSTIC)
    kw.setdefault("blocks_per_file", 1)
    kw.setdefault("layers", {0: 2})
    return UnitPlan(fam=families.get("llmd"), expected_ranks=tuple(range(ranks)), world=ranks, **kw)


def classify(plan: UnitPlan, *recs: FileRecord) -> list[FileRecord]:
    recs_ = list(recs)
    classify_block(plan, recs_, 0, HEX)
    return recs_


# --- slice ------------------------------------------------------------------------------------

def slice_plan(**kw) -> UnitPlan:
    return UnitPlan(fam=families.get("vllm"), kv_kind="mla", world=4, layers={0: 2}, blocks_per_file=1,
                    target=REPLICATED, **kw)


def test_slice_with_the_cell_from_facts_carries_every_number():
    (r,) = classify(slice_plan(page_bytes=1024), rec(0, 8192))
    assert r.action == "slice" and r.target_relpath is not None
    assert r.reason == ("slice: cell 0 of 4 (cell 2048 bytes; from facts: 2 layers x 1024 page bytes x 1 blocks "
                        "per file; 4 equal cells and a zero tail are checked before it is cut) + pad to 4096 bytes")


def test_slice_cell_includes_blocks_per_file():
    p = UnitPlan(fam=families.get("vllm"), kv_kind="mla", world=2, layers={0: 2}, blocks_per_file=3, page_bytes=512,
                 target=REPLICATED)
    (r,) = classify(p, rec(0, 8192))
    assert r.action == "slice" and "cell 3072 bytes" in r.reason and r.reason.endswith("pad to 4096 bytes")


def test_slice_without_page_bytes_stays_needs_slice_with_the_candidate_range():
    (r,) = classify(slice_plan(), rec(0, 8192))
    assert r.action == "needs_slice" and "c in 1025..2048 (pass --page-bytes; or scan with --verify hash" in r.reason


def test_a_source_already_replicated_is_a_link_not_a_slice():
    (r,) = classify(slice_plan(page_bytes=1024, source_replicated=True), rec(0, 4096))
    assert r.action == "link"


def test_without_the_replicated_target_an_mla_row_is_a_link():
    p = UnitPlan(fam=families.get("vllm"), kv_kind="mla", world=4, layers={0: 2}, blocks_per_file=1, page_bytes=1024,
                 target=SPECIFIC)
    (r,) = classify(p, rec(0, 8192))
    assert r.action == "link"


def test_slice_reason_carries_the_numbers_as_a_finding():
    f = finding_of(slice_reason(8, 5000, "proof"))
    assert (f.code, f.row_cells, f.cell_bytes, f.output_bytes) == (TRANSFORM, 8, 5000, 8192)


# --- concat -----------------------------------------------------------------------------------

def test_concat_of_full_attention_shards_and_the_rank_row_rule():
    r0, r1, r2 = classify(llmd(3, kv_kind="full"), rec(0, 1000), rec(1, 1000), rec(2, 1000))
    assert r0.action == "concat" and r0.reason == "concat: ranks 0..2 (3 x 1000 bytes) + pad to 4096 bytes"
    assert (r1.action, r1.reason, r2.reason) == ("none", "part of concat from rank 0", "part of concat from rank 0")
    assert r1.target_relpath is None


def test_concat_of_mla_replicas_when_the_target_is_not_replicated_needs_their_hashes():
    r0, _ = classify(llmd(2, kv_kind="mla", target=SPECIFIC), rec(0, 1024), rec(1, 1024))
    assert r0.action == "concat" and r0.reason.endswith(UNVERIFIED)
    r0, _ = classify(llmd(2, kv_kind="mla", target=SPECIFIC, hashed=True), rec(0, 1024, b"h" * 16),
                     rec(1, 1024, b"h" * 16))
    assert r0.action == "concat" and r0.reason.endswith("replica hashes verified equal")


def test_mla_replicas_into_a_replicated_target_are_linked_not_concatenated():
    r0, r1 = classify(llmd(2, kv_kind="mla", target=REPLICATED), rec(0, 4096), rec(1, 4096))
    assert r0.action == "link" and r1.reason == "replica of rank 0"


@pytest.mark.parametrize("kw,sizes,fragment", [
    ({"kv_kind": None}, (1024, 1024), "kv kind unknown, so the row's cells are unknown (pass --kv-kind)"),
    ({"kv_kind": "sliding"}, (1024, 1024), "concat is defined for kv kind mla or full, not sliding"),
    ({"kv_kind": "full"}, (1024, 2048), "rank sizes differ"),
    ({"kv_kind": "full", "blocks_per_file": None}, (1024, 1024), "B unknown"),
    ({"kv_kind": "full"}, (LEGACY_FLOOR, LEGACY_FLOOR),
     "cell size unproven: 16777216 bytes is the old llm-d padding floor (pass --page-bytes and "
     "--tensors-per-layer)"),
])
def test_concat_stays_needs_concat_naming_what_is_unproven(kw, sizes, fragment):
    r0, r1 = classify(llmd(2, **kw), rec(0, sizes[0]), rec(1, sizes[1]))
    assert r0.action == "needs_concat" and fragment in r0.reason, r0.reason
    assert r0.reason.startswith("needs_concat: rank 0 ‖ rank 1")
    assert r1.reason == "part of needs_concat from rank 0"


def test_the_padding_floor_is_fine_once_the_geometry_proves_the_size():
    # 2 layers x 2 tensors x 4 MiB pages = 16 MiB of proven data: not the stale floor
    r0, _ = classify(llmd(2, kv_kind="full", tensors_per_layer=2, page_bytes=4 << 20), rec(0, LEGACY_FLOOR),
                     rec(1, LEGACY_FLOOR))
    assert r0.action == "concat"


# --- relayout ---------------------------------------------------------------------------------

def test_relayout_of_a_single_rank_file_pads_its_cell():
    (r,) = classify(llmd(1, kv_kind="full", tensors_per_layer=2, page_bytes=100, blocks_per_file=4),
                    rec(0, 1600))
    assert r.action == "relayout"
    assert r.reason == ("relayout: B=4 T=4 P=100 ([B][T][P] -> [T][B][P], 1600 bytes per rank), then pad to "
                        "4096 bytes")


def test_relayout_of_mla_replicas_into_the_replicated_row_takes_rank_0():
    r0, r1 = classify(llmd(2, kv_kind="mla", page_bytes=1024, blocks_per_file=4, target=REPLICATED),
                      rec(0, 8192), rec(1, 8192))
    assert r0.action == "relayout" and "then rank 0's cell (the replicated row; " in r0.reason
    assert r0.reason.endswith("+ pad to 8192 bytes")
    assert r1.reason == "part of relayout from rank 0"


def test_relayout_of_full_attention_shards_then_concatenates_them():
    r0, _ = classify(llmd(2, kv_kind="full", tensors_per_layer=2, page_bytes=512, blocks_per_file=2),
                     rec(0, 4096), rec(1, 4096))
    assert r0.reason == ("relayout: B=2 T=4 P=512 ([B][T][P] -> [T][B][P], 4096 bytes per rank), then concat of "
                         "ranks 0..1 + pad to 8192 bytes")


@pytest.mark.parametrize("kw,size,fragment", [
    ({"kv_kind": "mla"}, 8192, "needs_relayout: 8192 bytes, B=4, T=2, P unknown (pass --page-bytes)"),
    ({"kv_kind": "full", "page_bytes": 512}, 8192,
     "needs_relayout: 8192 bytes, B=4, T unknown, P=512 (pass --tensors-per-layer)"),
    ({"kv_kind": "sliding", "page_bytes": 512}, 8192,
     "T unknown (relayout is defined for kv kind mla or full, not sliding)"),
    ({"kv_kind": "mla", "page_bytes": 512}, 8192, "B·T·P = 4096 ≠ size (facts and data disagree)"),
])
def test_relayout_stays_needs_relayout_naming_the_missing_number(kw, size, fragment):
    r0, _ = classify(llmd(2, blocks_per_file=4, **kw), rec(0, size), rec(1, size))
    assert r0.action == "needs_relayout" and fragment in r0.reason, r0.reason


# --- geometry for apply -----------------------------------------------------------------------

def test_transform_spec_rederives_the_planned_numbers():
    p = llmd(2, kv_kind="full", tensors_per_layer=2, page_bytes=512, blocks_per_file=2)
    spec = transform_spec(p, "relayout", 0, 4096, None)
    assert (spec.B, spec.T, spec.P, spec.cells, spec.output_size) == (2, 4, 512, 2, 8192)
    mla = transform_spec(llmd(2, kv_kind="mla", page_bytes=1024, blocks_per_file=4, target=REPLICATED),
                         "relayout", 0, 8192, None)
    assert (mla.cells, mla.replicas, mla.output_size) == (1, True, 8192)
    concat = transform_spec(llmd(3, kv_kind="full"), "concat", 0, 1000, None)
    assert (concat.ranks, concat.cells, concat.output_size) == (3, 3, 4096)


def test_a_slice_cell_proven_by_the_data_travels_in_the_reason():
    p = UnitPlan(fam=families.get("vllm"), kv_kind="mla", world=4, layers={0: 2}, blocks_per_file=1, target=REPLICATED)
    spec = transform_spec(p, "slice", 0, 8192, slice_reason(4, 2048, "the only size"))
    assert (spec.cell, spec.row_cells, spec.output_size) == (2048, 4, 4096)
    with pytest.raises(SourceInvalid, match="neither given by the facts nor in the plan"):
        transform_spec(p, "slice", 0, 8192, "slice")
    with pytest.raises(SourceInvalid, match="the plan says 4 cells of 1024 bytes"):
        transform_spec(UnitPlan(fam=families.get("vllm"), kv_kind="mla", world=4, layers={0: 2}, blocks_per_file=1,
                                page_bytes=1024, target=REPLICATED), "slice", 0, 8192,
                       slice_reason(4, 1024, "edited"))


def test_transform_spec_refuses_numbers_that_do_not_prove_the_file():
    with pytest.raises(SourceInvalid, match="do not prove the 4000-byte file"):
        transform_spec(llmd(2, kv_kind="full", tensors_per_layer=2, page_bytes=512, blocks_per_file=2),
                       "relayout", 0, 4000, None)
    with pytest.raises(SourceInvalid, match="kv kind None"):
        transform_spec(llmd(2), "concat", 0, 1024, None)


def test_a_journaled_spec_is_checked_when_read_back():
    spec = TransformSpec("relayout", "full", ranks=2, cells=2, cell=4096, B=2, T=4, P=512)
    assert TransformSpec.from_json(spec.to_json()) == spec
    with pytest.raises(SourceInvalid):
        TransformSpec.from_json({**spec.to_json(), "P": 256})  # B·T·P no longer the cell


# --- streaming output -------------------------------------------------------------------------

def _files(tmp_path, blobs: list[bytes]) -> list[int]:
    fds = []
    for i, blob in enumerate(blobs):
        p = tmp_path / f"f{i}"
        p.write_bytes(blob)
        fds.append(os.open(p, os.O_RDONLY))
    return fds


def test_the_streamed_row_equals_the_in_memory_transform_and_its_hash(tmp_path):
    B, T, P = 3, 4, 100
    ranks = [bytes((r * 50 + i) % 251 for i in range(B * T * P)) for r in range(2)]
    fds = _files(tmp_path, ranks)
    try:
        spec = TransformSpec("relayout", "full", ranks=2, cells=2, cell=B * T * P, B=B, T=T, P=P)
        out_fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT)
        w = HashingWriter(out_fd, chunk=333)
        assert write_transform(spec, fds, w) == 4096
        w.flush()
        os.close(out_fd)
        want = llmd_to_vllm_row(ranks, B=B, T=T, P=P, kv_kind="full", replicated_target=False)
        assert (tmp_path / "out").read_bytes() == want
        assert want[:B * T * P] == relayout_block_major_to_tensor_major(ranks[0], B=B, T=T, P=P)
        import xxhash

        assert w.digest() == xxhash.xxh3_128_digest(want) and w.size == len(want)
        assert transform_output_hash(spec, fds) == (w.digest(), len(want))
    finally:
        for fd in fds:
            os.close(fd)


def test_a_file_that_no_longer_has_the_geometry_is_refused(tmp_path):
    fds = _files(tmp_path, [b"x" * 1000, b"y" * 999])
    try:
        spec = TransformSpec("concat", "full", ranks=2, cells=2, cell=1000, B=1, T=1, P=1000)
        with pytest.raises(SourceInvalid, match="rank 1's file is 999 bytes"):
            transform_output_hash(spec, fds)
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("row,problem", [
    (b"A" * 1000 * 4 + bytes(96), None),
    (b"A" * 1000 * 3 + b"B" * 1000 + bytes(96), "cell 3 differs from cell 0"),
    (b"A" * 1000 * 4 + b"\x00" * 95 + b"\x01", "the 96 bytes after the 4 cells are not zero"),
    (b"A" * 1000 * 4 + bytes(4096), "is not 4 cells of 1000 bytes + a pad < 4096"),
])
def test_a_slice_checks_the_whole_row_before_cutting(tmp_path, row, problem):
    (fd,) = _files(tmp_path, [row])
    try:
        spec = TransformSpec("slice", "mla", ranks=1, cells=1, cell=1000, row_cells=4)
        got = slice_row_problem(fd, spec)
        assert got == problem or (problem and problem in got)
    finally:
        os.close(fd)


# --- cost -------------------------------------------------------------------------------------

def test_cost_of_a_slice_is_a_saving_and_of_a_concat_new_space():
    s = transform_cost("slice", 10, 10 * 8192, 10 * 4096)
    assert s["saves_bytes"] == 10 * 4096 and "new_bytes" not in s
    c = transform_cost("concat", 10, 10 * 2048, 10 * 4096)
    assert c["new_bytes"] == 10 * 4096 and "saves_bytes" not in c
    assert c["seconds_estimate"] == round(10 * 4096 / TRANSFORM_BYTES_PER_SECOND, 3)
