"""The components of an LMCache chunk-hash recipe (spec lmcache.md §3.2): the writer
releases' chain eras, the hash algorithm's canonical name, what seeds the chain (NONE_HASH)
and Python's str-hash era. The verdicts (families/lmcache.py `recipe_verdict`) and the
report's comparison (families/lmcache_meta.py) read them from here, so both decide alike.
"""

from __future__ import annotations

from kvmigrate import releases
from kvmigrate.formats import lmcache as L
from kvmigrate.identity.facts import Facts

SHA = ("sha256", "sha256_cbor")
SEEDLESS_RANDOM = ("builtin", "xxhash", "xxhash_cbor")  # NONE_HASH random without a seed, any vLLM
K3_FIRST = (0, 3, 13)  # the first release writing lmc-k3 names
CHAIN_ERA = (0, 4, 1)  # `(prefix, tokens, ())` from 0.4.1: builtin keys agree 0.4.1-0.5.7rc2
SHA_FOLDED = (0, 4, 6)  # sha256-family digests folded to 8 bytes from 0.4.6
VLLM_FIXED_NONE = (0, 29, 0)  # vLLM 0.29+: a seedless sha256 chain hashes "vllm-none-hash"


def release_tuple(release: str) -> tuple[int, int, int]:
    return releases.release_tuple(release) or (0, 0, 0)


def algorithm(name: str | None) -> str:
    return "sha256_cbor" if name == "sha256_cbor_64bit" else (name or "builtin")


def none_hash(algorithm: str, seed: str | None, vllm: str | None) -> str | None:
    """What seeds the chain (§3.2's NONE_HASH): `seed N`, `fixed` ("vllm-none-hash"),
    `random`; None when the facts do not say."""
    if seed is None:
        return None
    if seed != "unset":
        return f"seed {seed}"
    if algorithm in SEEDLESS_RANDOM:
        return "random"
    if vllm is None:
        return None
    return "fixed" if release_tuple(vllm) >= VLLM_FIXED_NONE else "random"


def py_hash_era(version: str | None) -> str | None:
    if version is None:
        return None
    return "<=3.10" if tuple(int(x) for x in version.split(".")) <= (3, 10) else ">=3.11"


def chain_era(c: L.ChunkName, facts: Facts, alg: str) -> tuple[str | None, str, list[str]]:
    """The chain era of a ≤ 16-hex k3 name: ("new", …) 0.4.1+ (sha256 family 0.4.6+), ("old",
    why) before, (None, why) not proven (rule 4). A quoted GDS name is 0.4.3+ by itself."""
    given = facts.writer_release
    releases = list(given) if isinstance(given, tuple) else [given] if given else []
    first = SHA_FOLDED if alg in SHA else CHAIN_ERA
    k3 = [r for r in releases if release_tuple(r) >= K3_FIRST]
    if c.backend == "gds" and c.quoted:  # 0.4.3+ (and a <= 16-hex sha256 name: 0.4.6+)
        return "new", "", k3
    if not releases:
        return None, "a <= 16-hex k3 name proves no release >= 0.4.1 by itself: the writer's release is not given", []
    if not k3:
        return None, ("no listed writer release (" + ", ".join(releases) + ") writes lmc-k3 names (0.3.13+)"), []
    new = [r for r in k3 if release_tuple(r) >= first]
    if len(new) == len(k3):
        return "new", "", k3
    if not new:
        return "old", (f"chain era of {', '.join(k3)} (before {'.'.join(map(str, first))}) vs the target's "
                       "(0.4.1+ builtin, 0.4.6+ sha256 family)"), k3
    return None, ("the listed writer releases " + ", ".join(k3) + " compute this name by different recipes: "
                  "no file of it is proven"), k3
