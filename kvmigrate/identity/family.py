"""Which writer family made a namespace (formats.md §3).

vLLM's scheme S1 and the llm-d flat layout use the same keys and the same digest recipe,
so only folder evidence tells them apart: rank folders beyond `_r0` (only llm-d workers
write their own rank folders) or block files whose size is not a multiple of 4096 (vLLM
pads rows to the page size, llm-d does not). Without such evidence the family stays
`ambiguous`; we never guess.
"""

from __future__ import annotations

from typing import Any, Iterable

from kvmigrate import families

PAGE = 4096


def is_vllmcpp_identity(fields: dict[str, Any]) -> bool:
    """The config.json keys prove a vllm.cpp identity (families.vllmcpp.MARKERS)."""
    return families.get("vllmcpp").proof(fields) is not None


def detect_family(fields: dict[str, Any], *, rank_numbers: Iterable[int] = (), block_sizes: Iterable[int] = (),
                  forced: str | None = None) -> tuple[str, list[str]]:
    """(family, evidence sentences): a writer family's name, ambiguous, or unknown (no scheme keys).

    The family whose keys prove it wins (each family module says what proves it); an S1
    identity is settled by `forced` (from --family or a FACTS.json `family`) or by folder
    evidence a family recognises. `forced` never overrides a config.json whose keys
    already prove another family.
    """
    shape = families.by_identity(fields)
    if shape is not None:
        evidence = [shape.proof(fields)]
        if forced and forced != shape.name:
            evidence.append(f"forced family {forced!r} ignored: the config.json keys prove {shape.name!r}")
        return shape.name, evidence
    if "hash_block_size" not in fields:
        return families.UNKNOWN, ["config.json has none of tokens_per_hash, hash_block_size or the vllm.cpp keys"]

    evidence = ["config.json has hash_block_size (scheme S1: vLLM 0.22-0.25 or llm-d, same keys and digest)"]
    if forced:
        evidence.append(f"family {forced!r} given by the operator (--family or FACTS.json)")
        settled = families.get(forced)
        if not settled.reads_s1:
            evidence.append(f"forced family {forced!r} ignored: an S1 identity is never a {settled.title} identity")
        else:
            return forced, evidence
    ranks = sorted(set(int(r) for r in rank_numbers))
    sizes = list(block_sizes)
    for fam in families.writers():
        found = fam.folder_evidence(ranks, sizes) if fam.reads_s1 else None
        if found:
            evidence.append(found)
            return fam.name, evidence
    evidence.append(f"only rank folder _r0 and every block size a multiple of {PAGE} (or none seen): "
                    "vLLM and llm-d both fit; pass --family (or 'family' in FACTS.json)")
    return families.AMBIGUOUS, evidence


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
