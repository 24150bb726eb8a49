"""llm-d's fs connector (formats.md §2): every worker writes its own rank folder of
unpadded files (B x T x P bytes; builds before 0bdacb2 padded to a 16 MiB floor), the S1
keys and digest recipe of vLLM; one base folder per pipeline stage. Its blocks become
vLLM rows by re-key, zero padding, concat or relayout."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvmigrate import classify
from kvmigrate.classify import LEGACY_FLOOR, UNVERIFIED, pad_to_page
from kvmigrate.families import PAGE, Family, worker_ranks
from kvmigrate.findings import NEEDS_FACT, TRANSFORM, asks
from kvmigrate.findings import reason as finding_reason


class Llmd(Family):
    name = "llmd"
    title = "llm-d"
    incomplete_advice = ("llm-d silently serves stale KV for the missing rank, so remove the remaining rank files "
                         "of these blocks while no engine runs")
    transforms = ("concat", "relayout")
    aliases_vllm_names = True
    majority_sizes = True

    def folder_evidence(self, rank_numbers: list[int], block_sizes: Iterable[int]) -> str | None:
        extra = [r for r in rank_numbers if r != 0]
        if extra:
            shown = ", ".join(f"_r{r}" for r in extra[:8]) + (" ..." if len(extra) > 8 else "")
            return f"rank folders beyond _r0 ({shown}): only llm-d workers write their own rank folders"
        odd = sorted(set(s for s in block_sizes if s % PAGE != 0))
        if odd:
            shown = ", ".join(str(s) for s in odd[:4]) + (" ..." if len(odd) > 4 else "")
            return f"block sizes not multiples of {PAGE} ({shown} bytes): vLLM pads rows to {PAGE}, llm-d does not"
        return None

    def unsupported(self, fields: Mapping[str, Any]) -> str | None:
        if fields.get("pp_size", 1) > 1:
            return (f"pipeline stage: llm-d with pp={fields['pp_size']} writes one base folder per stage "
                    "(out of scope)")
        return None

    def block_ranks(self, fields, present=(0,)):
        # one per worker (tp x pcp): a pipeline stage is its own base folder
        return worker_ranks(fields, ("tp_size", "pcp_size"), present)

    def size_status(self, plan, group, size):
        data = plan.data_bytes(group)
        if data is None or size == data:
            return None
        if size == LEGACY_FLOOR and data < LEGACY_FLOOR:
            return "padded_legacy", (f"padded to the old 16 MiB floor: the {size}-byte file holds {data} "
                                     "bytes of proven data (B x T x P) followed by stale bytes")
        return "size_mismatch", f"size {size} differs from the {data} bytes the proven geometry B x T x P gives"

    def plan_action(self, plan, by_rank, group):
        t = plan.target
        first = by_rank[0]
        n = len(plan.expected_ranks)
        b = plan.blocks_per_file or 0
        if b > 1:
            return relayout_plan(plan, by_rank, group)
        if n == 1:
            if first.size % PAGE == 0:
                return "link", f"tp=1 llm-d file is a valid vLLM row ({first.size} bytes, a multiple of {PAGE})"
            return "copy_pad", (f"tp=1 llm-d file of {first.size} bytes, zero padded to "
                                f"{pad_to_page(first.size)} for the vLLM reader")
        if plan.replicas and t.replicated_layout:
            if first.size % PAGE == 0:
                return "link", f"rank-0 MLA replica is the replicated row; {_verified_note(plan)}"
            return "copy_pad", (f"rank-0 MLA replica ({first.size} bytes) zero padded to "
                                f"{pad_to_page(first.size)}; {_verified_note(plan)}")
        return concat_plan(plan, by_rank, group)


def _verified_note(plan: classify.UnitPlan) -> str:
    return "replica hashes verified equal" if plan.hashed else UNVERIFIED


def concat_plan(plan: classify.UnitPlan, by_rank: list[classify.FileRecord], group: int) -> tuple[str, str]:
    """concat of every rank's file (B = 1) into one row of N equal cells, when the cell is
    proven: equal rank sizes, a known kv kind, and not the old 16 MiB padding floor."""
    sizes = [r.size for r in by_rank]
    total = sum(sizes)
    n = len(by_rank)
    parts = " ‖ ".join(f"rank {r.rank}" for r in by_rank)
    found = f"needs_concat: {parts} ({' + '.join(str(s) for s in sizes)} = {total} bytes)"
    if plan.blocks_per_file != 1:
        return "needs_concat", f"{found}: B unknown (blocks_per_file missing from the identity)"
    if plan.kv_kind not in ("mla", "full"):
        if plan.kv_kind is None:
            return "needs_concat", finding_reason(f"{found}: kv kind unknown, so the row's cells are unknown (pass --kv-kind)",
                                          NEEDS_FACT, asks=asks("--kv-kind"))
        return "needs_concat", f"{found}: concat is defined for kv kind mla or full, not {plan.kv_kind}"
    if len(set(sizes)) > 1:
        return "needs_concat", f"{found}: rank sizes differ, a vLLM reader needs N equal cells"
    if sizes[0] == LEGACY_FLOOR and plan.data_bytes(group) is None:
        flags = ("--page-bytes", "--tensors-per-layer") if plan.kv_kind == "full" else ("--page-bytes",)
        return "needs_concat", finding_reason(f"{found}: cell size unproven: {LEGACY_FLOOR} bytes is the old llm-d padding "
                                      f"floor (pass {' and '.join(flags)})", NEEDS_FACT, asks=asks(*flags))
    note = f"; {_verified_note(plan)}" if plan.replicas else ""
    return "concat", finding_reason(f"concat: ranks 0..{n - 1} ({n} x {sizes[0]} bytes) + pad to {pad_to_page(total)} bytes"
                            f"{note}", TRANSFORM, output_bytes=pad_to_page(total))


def relayout_plan(plan: classify.UnitPlan, by_rank: list[classify.FileRecord], group: int) -> tuple[str, str]:
    """relayout of B > 1 files ([B][T][P] -> [T][B][P]) when B, T and P are proven and match the size."""
    b = plan.blocks_per_file
    size = by_rank[0].size
    t = plan.tensors(group)
    p = plan.page_bytes
    parts = [f"{size} bytes", f"B={b}"]
    missing = []
    if t is None:
        if plan.kv_kind is None:
            missing.append("--kv-kind")
        elif plan.kv_kind == "full" and not plan.tensors_per_layer:
            missing.append("--tensors-per-layer")
        parts.append("T unknown" if plan.kv_kind in (None, "mla", "full")
                     else f"T unknown (relayout is defined for kv kind mla or full, not {plan.kv_kind})")
    else:
        parts.append(f"T={t}")
    if not p:
        parts.append("P unknown")
        missing.append("--page-bytes")
    else:
        parts.append(f"P={p}")
    text = "needs_relayout: " + ", ".join(parts)
    if missing:
        return "needs_relayout", finding_reason(f"{text} (pass {' and '.join(missing)})", NEEDS_FACT, asks=asks(*missing))
    if t is None or not p or not b:
        return "needs_relayout", text
    if size != b * t * p:
        return "needs_relayout", f"{text}: B·T·P = {b * t * p} ≠ size (facts and data disagree)"
    n = len(by_rank)
    if n > 1 and len({r.size for r in by_rank}) > 1:
        return "needs_relayout", f"{text}: rank sizes differ"
    if n == 1:
        cells, then = 1, "then"
    elif plan.replicas and plan.target is not None and plan.target.replicated_layout:
        cells, then = 1, f"then rank 0's cell (the replicated row; {_verified_note(plan)}) +"
    else:
        cells = n
        then = f"then concat of ranks 0..{n - 1}" + (f" ({_verified_note(plan)})" if plan.replicas else "") + " +"
    return "relayout", finding_reason(f"relayout: B={b} T={t} P={p} ([B][T][P] -> [T][B][P], {size} bytes per rank), "
                              f"{then} pad to {pad_to_page(cells * size)} bytes", TRANSFORM,
                              output_bytes=pad_to_page(cells * size))


FAMILY = Llmd()
