"""Which writer family made a namespace (formats.md §3).

vLLM's scheme S1 and the llm-d flat layout use the same keys and the same digest recipe,
so only folder evidence tells them apart: rank folders beyond `_r0` (only llm-d workers
write their own rank folders) or block files whose size is not a multiple of 4096 (vLLM
pads rows to the page size, llm-d does not). Without such evidence the family stays
`ambiguous`; we never guess.
"""

from __future__ import annotations

from typing import Any, Iterable

PAGE = 4096
VLLMCPP_MARKERS = ("format_version", "hash_algo", "kv_cache_spec_kind")


def is_vllmcpp_identity(fields: dict[str, Any]) -> bool:
    return all(k in fields for k in VLLMCPP_MARKERS)


def _shape_family(fields: dict[str, Any]) -> str | None:
    """Family proven by the config.json keys alone (None for S1 and for no scheme)."""
    if is_vllmcpp_identity(fields):
        return "vllmcpp"
    if "tokens_per_hash" in fields:
        return "vllm"
    return None


def detect_family(fields: dict[str, Any], *, rank_numbers: Iterable[int] = (), block_sizes: Iterable[int] = (),
                  forced: str | None = None) -> tuple[str, list[str]]:
    """(family, evidence sentences): vllm, llmd, vllmcpp, ambiguous, or unknown (no scheme keys).

    `forced` (from --family or a FACTS.json `family`) settles an S1 namespace; it never
    overrides a config.json whose keys already prove another family.
    """
    shape = _shape_family(fields)
    if shape == "vllmcpp":
        evidence = ["config.json has format_version, hash_algo and kv_cache_spec_kind (vllm.cpp identity)"]
    elif shape == "vllm":
        evidence = ["config.json has tokens_per_hash (vLLM scheme S2/S3; llm-d never writes it)"]
    else:
        evidence = []
    if shape is not None:
        if forced and forced != shape:
            evidence.append(f"forced family {forced!r} ignored: the config.json keys prove {shape!r}")
        return shape, evidence
    if "hash_block_size" not in fields:
        return "unknown", ["config.json has none of tokens_per_hash, hash_block_size or the vllm.cpp keys"]

    evidence = ["config.json has hash_block_size (scheme S1: vLLM 0.22-0.25 or llm-d, same keys and digest)"]
    if forced:
        evidence.append(f"family {forced!r} given by the operator (--family or FACTS.json)")
        if forced == "vllmcpp":
            evidence.append("forced family 'vllmcpp' ignored: an S1 identity is never a vllm.cpp identity")
        else:
            return forced, evidence
    ranks = sorted(set(int(r) for r in rank_numbers))
    extra = [r for r in ranks if r != 0]
    if extra:
        shown = ", ".join(f"_r{r}" for r in extra[:8]) + (" ..." if len(extra) > 8 else "")
        evidence.append(f"rank folders beyond _r0 ({shown}): only llm-d workers write their own rank folders")
        return "llmd", evidence
    odd = sorted(set(s for s in block_sizes if s % PAGE != 0))
    if odd:
        shown = ", ".join(str(s) for s in odd[:4]) + (" ..." if len(odd) > 4 else "")
        evidence.append(f"block sizes not multiples of {PAGE} ({shown} bytes): vLLM pads rows to {PAGE}, llm-d does not")
        return "llmd", evidence
    evidence.append(f"only rank folder _r0 and every block size a multiple of {PAGE} (or none seen): "
                    "vLLM and llm-d both fit; pass --family (or 'family' in FACTS.json)")
    return "ambiguous", evidence


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
