"""What the report and `explain` read of an LMCache deployment beyond its rows (spec
lmcache.md §7), recorded with its namespace metadata (`config_json`, docs/manifest.md):

* `recipe`: §3.2's hash-recipe comparison, one entry per component, writer against
  target, each value with where it came from (`flag`, `facts:<key>`, the key names
  themselves, the target profile, or `assumed: …`) and whether the two agree (null:
  not known); the values are those the verdicts of `families/lmcache.py` decided by;
* `assumed_facts`: the recipe facts the verdicts assumed, each with the flags stating it;
* `writer_none_hash`: what seeded the writer's chain (`seed N`, `fixed`, `random`; null:
  the facts do not say, or an MP chain);
* `seed_fix_files`: chunks stale by their NONE_HASH alone with the writer's seed known
  (`TierFile.seed_fix`): the target taking that PYTHONHASHSEED reaches them;
* `zero_hex64_files`: fs chunk names whose 64-hex hash starts with `0`, which
  `/cache/load-fs-chunks` cannot load (R2 §3.5: `from_string` drops the zero).

The report turns these into its tier section and notes (kvmigrate/report/tiers.py); no
sentence is read back.
"""

from __future__ import annotations

from typing import Any

from kvmigrate.families import lmcache_recipe as lmc
from kvmigrate.identity.facts import Facts

ASSUMED_WRITER = "assumed: the target's"
ASSUMED_TARGET = "assumed: the writer's"
NOT_GIVEN = "not given"
BY_NAME = "the names"  # what the key names prove by themselves
MP_CHAIN = "MP server"


def _source(facts: Facts, name: str, fallback: str) -> str:
    return facts.sources.get(name) or fallback


def _component(name: str, writer: Any, writer_source: str, target: Any, target_source: str,
               equal: bool | None) -> dict[str, Any]:
    return {"component": name, "writer": None if writer is None else str(writer), "writer_source": writer_source,
            "target": None if target is None else str(target), "target_source": target_source, "equal": equal}


def _pair(name: str, f: Facts, fact: str, writer: Any, target: Any, equal: bool | None) -> dict[str, Any]:
    """A component the verdicts assume equal on both sides unless both are given (§3.3)."""
    both = "assumed: equal for writer and target"
    return _component(name, writer, _source(f, fact, ASSUMED_WRITER if target is not None else both), target,
                      _source(f, "target_" + fact, ASSUMED_TARGET if writer is not None else both),
                      None if writer is None or target is None else equal)


def _known_equal(a: Any, b: Any) -> bool | None:
    return None if a is None or b is None else a == b


def recipe(dep: Any, profile: str) -> list[dict[str, Any]]:
    """§3.2's components for one deployment, writer vs target (the target: `profile`)."""
    f = dep.facts
    w_chunk, t_chunk = f.chunk_size, f.target_chunk_size
    chunk = _pair("chunk_size", f, "chunk_size", w_chunk, t_chunk, _known_equal(w_chunk, t_chunk))
    if dep.scheme == "lmc-mp1":  # blake3 with a fixed none hash: only chunk_size (§3.2)
        return [_component("chain era (writer_release)", "MP blake3 chain", BY_NAME, "MP blake3 chain", profile, True),
                _component("hash_algorithm", "blake3", MP_CHAIN, "blake3", MP_CHAIN, True),
                _component("NONE_HASH (PYTHONHASHSEED)", "fixed: blake3((0, (0,), None))", MP_CHAIN,
                           "fixed: blake3((0, (0,), None))", MP_CHAIN, True),
                chunk]
    alg = lmc.algorithm(f.hash_algorithm)
    t_alg = lmc.algorithm(f.target_hash_algorithm) if f.target_hash_algorithm else alg
    out = [_era(dep, f, alg, profile),
           _component("hash_algorithm", alg, _source(f, "hash_algorithm", "assumed: builtin (LMCache's default)"),
                      t_alg, _source(f, "target_hash_algorithm", ASSUMED_TARGET), alg == t_alg)]
    seed, t_seed = f.pythonhashseed, f.target_pythonhashseed or f.pythonhashseed
    vllm, t_vllm = f.vllm_release, f.target_vllm_release or f.vllm_release
    w_none, t_none = lmc.none_hash(alg, seed, vllm), lmc.none_hash(t_alg, t_seed, t_vllm)
    out.append(_component(
        "NONE_HASH (PYTHONHASHSEED)", _seed_text(seed, w_none), _source(f, "pythonhashseed", NOT_GIVEN),
        _seed_text(t_seed, t_none),
        _source(f, "target_pythonhashseed", ASSUMED_TARGET if seed is not None else NOT_GIVEN),
        False if w_none == "random" else _known_equal(w_none, t_none)))
    out.append(_component("vLLM release", vllm, _source(f, "vllm_release", NOT_GIVEN), t_vllm,
                          _source(f, "target_vllm_release", ASSUMED_TARGET if vllm else NOT_GIVEN),
                          _known_equal(vllm, t_vllm) if f.target_vllm_release else None))
    w_py, t_py = f.python_version, f.target_python_version
    if alg == "builtin" and t_alg == "builtin":  # only Python's str hash depends on it
        out.append(_pair("Python version", f, "python_version", w_py, t_py,
                         _known_equal(lmc.py_hash_era(w_py), lmc.py_hash_era(t_py))))
    else:
        out.append(_component("Python version", w_py, _source(f, "python_version", NOT_GIVEN), t_py,
                              _source(f, "target_python_version", NOT_GIVEN), True))
    out.append(chunk)
    return out


def _seed_text(seed: str | None, none: str | None) -> str | None:
    if seed is None:
        return None
    shown = "PYTHONHASHSEED unset" if seed == "unset" else f"PYTHONHASHSEED={seed}"
    return f"{shown}: NONE_HASH {none or 'by the vLLM release'}"


def _era(dep: Any, f: Facts, alg: str, profile: str) -> dict[str, Any]:
    """The chain era: the names' (k1, k2, a 64-hex digest, a quoted GDS name) or the writer
    releases' (§3.2 rules 1 and 4)."""
    target = "0.4.6+ chain (sha256 family folded)" if alg in lmc.SHA else "0.4.1+ chain"
    name = "chain era (writer_release)"
    releases = f.writer_release
    given = ", ".join(releases) if isinstance(releases, tuple) else releases
    source = _source(f, "writer_release", NOT_GIVEN)
    if dep.scheme in ("lmc-k1", "lmc-k2"):
        return _component(name, f"{dep.scheme} names (before 0.3.13)", BY_NAME, target, profile, False)
    if dep.hex64:  # (what the scan folded of its names: TierJudge.add)
        return _component(name, "64-hex digest kept whole (0.3.13-0.4.5)", BY_NAME, target, profile, False)
    era = None
    if dep.first_chunk is not None:
        era, _, _ = lmc.chain_era(dep.first_chunk, f, alg)
    if dep.backend == "gds" and dep.quoted:
        return _component(name, "0.4.3+ (quoted GDS names)" + (f"; {given}" if given else ""), BY_NAME, target,
                          profile, True)
    text = None if not given else given + {"new": " (0.4.1+ chain)", "old": " (an older chain)"}.get(
        era or "", " (releases of different chains)")
    return _component(name, text, source, target, profile, None if era is None else era == "new")


def assumed_facts(dep: Any) -> list[dict[str, Any]]:
    """The recipe facts the verdicts assumed (§3.3: each listed with the flags stating it)."""
    f = dep.facts
    if dep.scheme not in ("lmc-k3", "lmc-mp1"):
        return []
    out = []
    if dep.scheme == "lmc-k3":
        if f.hash_algorithm is None:
            out.append({"fact": "hash_algorithm", "value": "builtin", "flags": ["--hash-algorithm"]})
        if f.python_version is None or f.target_python_version is None:
            out.append({"fact": "python_version", "value": "equal for writer and target",
                        "flags": ["--python-version", "--target-python-version"]})
    if f.chunk_size is None or f.target_chunk_size is None:
        out.append({"fact": "chunk_size", "value": "equal for writer and target",
                    "flags": ["--chunk-size", "--target-chunk-size"]})
    return out


def deployment_meta(dep: Any, profile: str) -> dict[str, Any]:
    """The keys added to an LMCache deployment's `config_json` (see the module's doc)."""
    f = dep.facts
    alg = lmc.algorithm(f.hash_algorithm)
    writer_none = None if dep.scheme == "lmc-mp1" else lmc.none_hash(alg, f.pythonhashseed, f.vllm_release)
    return {"recipe": recipe(dep, profile), "assumed_facts": assumed_facts(dep), "writer_none_hash": writer_none,
            "seed_fix_files": dep.seed_fix_files, "zero_hex64_files": dep.zero_hex64_files}
