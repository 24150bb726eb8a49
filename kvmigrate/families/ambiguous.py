"""An S1 namespace vLLM and llm-d write alike (formats.md §3): not a writer family but a
reading of one. Its digest recipe is theirs; its blocks migrate as vLLM rows only when
both readings give the same bytes (`ambiguity_is_harmless`), else every block asks for
--family."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvmigrate.families import AMBIGUOUS, PAGE
from kvmigrate.families.vllm import Vllm
from kvmigrate.findings import NEEDS_FACT, asks
from kvmigrate.findings import reason as finding_reason


def ambiguity_is_harmless(fields: dict[str, Any], block_sizes: Iterable[int] = ()) -> bool:
    """True when the vLLM and llm-d readings of an S1 namespace give the same bytes
    (tp = pp = pcp = 1, gpu_blocks_per_file = 1, sizes multiples of 4096): the ambiguity
    changes no decision and migration may proceed."""
    one = all(fields.get(k) == 1 for k in ("tp_size", "pp_size", "pcp_size", "gpu_blocks_per_file"))
    return one and all(s % PAGE == 0 for s in block_sizes)


def harmless_ambiguity_note(fields: dict[str, Any], block_sizes: Iterable[int] = ()) -> str | None:
    """The sentence a report shows for a harmless ambiguity (None when it matters)."""
    if ambiguity_is_harmless(fields, block_sizes):
        return ("family ambiguous (vLLM or llm-d) but both readings give the same bytes "
                "(tp = pp = pcp = 1, gpu_blocks_per_file = 1, sizes multiples of 4096): proceeding")
    return None


class Ambiguous(Vllm):
    name = AMBIGUOUS
    title = "vLLM or llm-d"
    transforms = ()
    settled_by = "--family"

    def proof(self, fields):
        return None  # never proven: it is what detection says when nothing proves a family

    def detection_notes(self, fields, block_sizes):
        note = harmless_ambiguity_note(fields, block_sizes)
        return [note or "the ambiguity changes decisions here (tp, pp, pcp or blocks per file > 1): "
                        "blocks stay `none` until --family is given"]

    def size_status(self, plan, group, size):
        return None  # neither reading's size rule applies until the family is known

    def harmless_ambiguity(self, fields, block_sizes):
        # the sample of rank 0's block sizes; a manifest without it (before it was
        # recorded) reads as an ambiguity that matters: blocks stay `none`
        return block_sizes is not None and ambiguity_is_harmless(fields, block_sizes)

    def plan_action(self, plan, by_rank, group, note: str = ""):
        first = by_rank[0]
        if not plan.ambiguity_harmless:
            return "none", finding_reason("family ambiguous (S1 written by vLLM or llm-d, and the two readings give "
                                          "different bytes here): pass --family vllm|llmd", NEEDS_FACT,
                                          asks=asks("--family"))
        if first.size % PAGE:
            return "none", finding_reason(f"family ambiguous and {first.size} bytes is not a multiple of {PAGE} "
                                          "(suggests llm-d): pass --family vllm|llmd", NEEDS_FACT, asks=asks("--family"))
        return super().plan_action(plan, by_rank, group, " (family ambiguous, but both readings give the same bytes)")

    def verify_block(self, head, size, target, hex_hash, group):
        return None


FAMILY = Ambiguous()
