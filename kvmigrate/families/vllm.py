"""Upstream vLLM's filesystem tier (formats.md §2): the scheduler writes one row per block
under rank folder `_r0`, padded to 4096 bytes; schemes S1/S2/S3 (identity.md §2)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvmigrate import classify
from kvmigrate.families import PAGE, Family
from kvmigrate.findings import NEEDS_FACT, asks
from kvmigrate.findings import reason as finding_reason


class Vllm(Family):
    name = "vllm"
    title = "vLLM"
    transforms: tuple[str, ...] = ("slice",)
    majority_sizes = True
    scheduler_rows = True

    def proof(self, fields: Mapping[str, Any]) -> str | None:
        if "tokens_per_hash" in fields:
            return "config.json has tokens_per_hash (vLLM scheme S2/S3; llm-d never writes it)"
        return None

    def size_status(self, plan, group, size):
        if size % PAGE:
            return "size_mismatch", f"size {size} is not a multiple of {PAGE} (vLLM pads every row)"
        expected = plan.expected_row_bytes(group)
        if expected is not None and size != expected:
            return "size_mismatch", f"size {size} differs from the {expected} bytes the proven row geometry gives"
        return None

    def plan_action(self, plan, by_rank, group, note: str = ""):
        """A re-key of the row, or a slice of a direct MLA row into a replicated target."""
        t = plan.target
        mla_direct = (plan.kv_kind == "mla" and plan.world > 1 and not plan.source_replicated
                      and not plan.source_canonical)
        if mla_direct and t.replicated_layout:
            return slice_plan(plan, by_rank[0], group)
        return "link", f"re-key of the same deployment's row into {t.base}{note}"

    def verify_block(self, head, size, target, hex_hash, group):
        if size % PAGE:
            return "size_mismatch", f"{size} bytes is not a multiple of 4096"
        return None


def slice_plan(plan: classify.UnitPlan, first: classify.FileRecord, group: int) -> tuple[str, str]:
    """slice when the cell size is proven by the facts (the N cells themselves are compared
    when the transform runs, or by scan --verify hash); needs_slice with the numbers found."""
    n = plan.world
    size = first.size
    layers = plan.layers.get(group)
    if plan.page_bytes and layers and plan.blocks_per_file:
        c = layers * plan.page_bytes * plan.blocks_per_file
        if n * c <= size < n * c + PAGE:
            return "slice", classify.slice_reason(n, c, f"from facts: {layers} layers x {plan.page_bytes} page bytes x "
                                                        f"{plan.blocks_per_file} blocks per file; {n} equal cells and a "
                                                        "zero tail are checked before it is cut")
        return "needs_slice", (f"needs_slice: facts and data disagree: c = {layers} x {plan.page_bytes} x "
                               f"{plan.blocks_per_file} = {c}, but {n} x c does not fit the {size}-byte row")
    lo = max(1, (size - PAGE) // n + 1)
    hi = size // n
    # both ways to prove it: the fact, or a hashing scan that finds the one c giving N equal
    # cells (`kvmigrate migrate ROOT` scans so by default); ";" ends what the reports read as
    # the facts asked for ("pass ...")
    return "needs_slice", finding_reason(f"needs_slice: {size}-byte row, N={n} cells, cell size unknown: {n}*c <= {size} < "
                                 f"{n}*c + {PAGE} allows c in {lo}..{hi} (pass --page-bytes; or scan with --verify "
                                 "hash, as `kvmigrate migrate ROOT` does, to prove it from the replicas)", NEEDS_FACT,
                                 asks=asks("--page-bytes"))


FAMILY = Vllm()
