"""Writer families: one module per family behind one small interface (docs/families.md).

A *family* is a writer of KV-cache trees (formats.md §1): upstream vLLM's fs tier, llm-d's
fs connector, vllm.cpp. Everything that differs between them is asked of the family object
instead of compared as a string: how its identity proves it (detection), its digest
recipe and config.json bytes, its target, which ranks hold a block, the block verdicts
(size and header checks, replica hash, the action matrix), the transforms it offers and
how a migrated block is re-checked. Adding a family is a new module here with its synth
and its tests; nothing outside `families/` and `synth/` compares a family name
(tests/test_families.py).

Besides the writer families two *readings* of a namespace have objects of their own:
`ambiguous` (an S1 identity vLLM and llm-d write alike, families/ambiguous.py) and
`unknown` (no scheme keys, or a name no module has: nothing is migrated).

The registry sits above the primitives it dispatches over (docs/families.md, "Layering"):
the family modules and the defaults below use classify, the identity primitives
(values, canonical, schemes, vllm_target) and layout; none of those imports the registry.
Detection over all families (`detect`) and the target of a namespace (`compute_target`)
are asked here. The modules load on first use; `--help` reads the names from
identity/values.py and imports no family.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Container, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from kvmigrate import layout
from kvmigrate.errors import FactsRefusedError, UsageError
from kvmigrate.identity import canonical, schemes
from kvmigrate.identity.values import (
    AMBIGUOUS,
    DEFAULT_PROFILE,
    ENSURE_ASCII,
    LMCACHE_PROFILES,
    MOONCAKE_PROFILES,
    NAMES,
    UNKNOWN,  # names)
)

if TYPE_CHECKING:  # pragma: no cover
    from kvmigrate.classify import FileRecord, UnitPlan
    from kvmigrate.identity.facts import Facts
    from kvmigrate.identity.vllm_target import Target

PAGE = 4096


class Family:
    """The interface every family module provides (a module defines `FAMILY = Sub()`).

    The defaults are those of a family that writes nothing kvmigrate can migrate
    (`unknown`); a writer family overrides what it knows.
    """

    name: str = UNKNOWN
    title: str = "unknown"  # as messages name the writer
    # detection order: a family whose proof is a superset of another's keys goes first
    proof_priority: int = 0
    # an S1 identity (hash_block_size, no other proof) may be this family's: --family
    # or FACTS.json may settle it on it
    reads_s1: bool = True
    # the family of the engine that reads the target namespace (identity.vllm_target.Target.family)
    target_engine: str = "vllm"
    # the flag that settles this reading of a namespace (ambiguous: --family)
    settled_by: str | None = None
    # every rank writes its own namespace (the rank in its digest): a walk unit is a
    # deployment of namespaces, grouped by their `deployment` digest
    rank_namespaces: bool = False
    # bytes before the payload of a block file (a header the engine checks)
    header_len: int = 0
    # which hash proves MLA replicas equal: "content" (whole file) or "payload" (after the header)
    replica_hash: str = "content"
    # the transforms a block of this family may need (migration.md §1)
    transforms: tuple[str, ...] = ()
    # the same base folder name as the vLLM target may hold other bytes (llm-d shards
    # under vLLM's names): planning there would alias the source
    aliases_vllm_names: bool = False
    # the scheduler writes one row per block through vLLM's FileMapper, which collapses a
    # namespace passing the parallel-agnostic gate (tp/pp folded to 1: the identity then
    # does not record the topology that wrote the rows) and, on a multi-node engine, lacks
    # the remote ranks' slots (identity.md §4.1)
    scheduler_rows: bool = False
    # off-size files are found against the majority size of their (namespace, rank,
    # group) (classify.majority_size): families whose sizes vary with the data they hold
    majority_sizes: bool = False
    # how the family's namespaces sit in a root (formats.md §1): "tree" = base folders
    # `<model>_<d12>` with a config.json and rank folders `<base>_r<k>` of `<hhh>/<hh>_g<g>/`
    # blocks (layout.py's grammar, which the C walk is tested against); "flat" = one
    # directory of files whose names carry the identity and the parallel layout (SGLang
    # HiCache, docs/sglang.md: planned); "tiers" = tier directories recognised by the
    # chunk names they hold (LMCache, scan/tiers.py); "stores" = folders of client roots
    # recognised by their index files (Mooncake, scan/store_rows.py). The scan's roots phase
    # asks `claims_entry` (and `holds_store`).
    root_layout: str = "tree"
    # prune may take this family's files (False: its prune rules are not built yet)
    prunes: bool = True
    # a block's rank files are whole copies of it (SGLang e2 MLA pages): the apply
    # compares those present, and a missing copy does not block the others
    copies_whole: bool = False
    # some files go in pairs whose order matters (a GDS data file and its sidecar: `pair_of`,
    # `removed_first`); False lets the apply and rollback skip asking per file
    paired_files: bool = False
    # what the reading engine does with a block one of whose rank files is missing (the
    # `incomplete` finding's advice, report/hints.py)
    incomplete_advice: str = ("the engine needs every rank's file of a block, so remove the remaining rank files of "
                              "these blocks while no engine runs")

    def __repr__(self) -> str:
        return f"<family {self.name}>"

    def __reduce__(self):
        return get, (self.name,)  # a pickled context (scan workers) gets the registry's object back

    @property
    def ensure_ascii(self) -> bool | None:
        """The digest recipe (values.ENSURE_ASCII: True Python json.dumps, False raw UTF-8
        as nlohmann writes; None: no recipe, the digest cannot be computed)."""
        return ENSURE_ASCII.get(self.name)

    # --- identity ----------------------------------------------------------------------

    def proof(self, fields: Mapping[str, Any]) -> str | None:
        """The evidence sentence when config.json's keys alone prove this family, else None."""
        return None

    def folder_evidence(self, rank_numbers: list[int], block_sizes: Iterable[int]) -> str | None:
        """For an S1 identity: the evidence sentence when the folders prove this family."""
        return None

    def canonical_bytes(self, fields: Mapping[str, Any]) -> bytes:
        """The exact bytes the writer hashes to name the namespace folder."""
        return canonical.canonical_json(dict(fields), self._recipe())

    def full_digest(self, fields: Mapping[str, Any]) -> str:
        """Hex SHA-256 of the canonical identity."""
        return hashlib.sha256(self.canonical_bytes(fields)).hexdigest()

    def d12(self, fields: Mapping[str, Any]) -> str:
        """The 12-hex suffix of the namespace folder name."""
        return self.full_digest(fields)[:canonical.D12_LEN]

    def config_json_bytes(self, fields: Mapping[str, Any]) -> bytes:
        """The config.json the writer puts in the base folder (no trailing newline)."""
        return canonical.config_json(dict(fields), self._recipe())

    def _recipe(self) -> bool:
        if self.ensure_ascii is None:
            raise ValueError(f"unknown family {self.name!r}")
        return self.ensure_ascii

    def config_matches(self, data: bytes, fields: Mapping[str, Any]) -> bool:
        """Whether an existing config.json (its bytes) states this identity, as the engine
        compares it (vLLM and llm-d: the parsed fields)."""
        try:
            return canonical.fields_from_config_bytes(data) == fields
        except ValueError:
            return False

    def config_notes(self, raw: bytes, fields: Mapping[str, Any]) -> list[str]:
        """Notes on a valid config.json the engine reads but would not write so."""
        return []

    def scheme_of(self, fields: Mapping[str, Any]) -> str:
        """The field scheme's name (`identity` reports it)."""
        return schemes.scheme_of(fields)

    def source_problems(self, fields: Mapping[str, Any]) -> list[str]:
        """Why an identity is not valid for its scheme (empty: valid)."""
        return schemes.validate_fields(fields)

    def unknown_keys(self, fields: Mapping[str, Any]) -> list[str]:
        """Keys of the identity its scheme does not know (a target never copies them)."""
        return schemes.unknown_keys(fields)

    def deployment(self, fields: Mapping[str, Any], source_base: str) -> str:
        """What the namespaces of one deployment share (a unit groups them): the base folder
        itself unless every rank writes its own namespace."""
        return source_base

    def unsupported(self, fields: Mapping[str, Any]) -> str | None:
        """Why namespaces of this identity are out of scope (status unsupported_layout), else None."""
        return None

    def target_profile(self, profile: str) -> str:
        """The target profile a namespace of this family is planned for, given --target: an
        lmcache-* profile names what LMCache tiers target, so the others keep the default."""
        return tree_profile(profile)

    def target(self, fields: dict, facts: Facts, profile: str) -> Target:
        """The `Target` of a namespace of this family for a target profile."""
        # imported here, not at the top: the gates are loaded by the commands that compute
        # targets only (a report asks the registry for settled_by alone: 3 ms of its start-up)
        from kvmigrate.identity.vllm_target import vllm_target

        return vllm_target(fields, self, facts, profile)

    def target_digest(self, fields: Mapping[str, Any] | None) -> bytes | None:
        """The raw identity digest a block of a target namespace carries in its header (None: no header)."""
        return None

    # --- paths -------------------------------------------------------------------------

    def tier_label(self, tier: str) -> str:
        """The namespace of a tier directory's own files (root_layout "tiers")."""
        return f"{self.name}:{tier}"

    def claims_entry(self, name: str, is_dir: bool) -> bool:
        """Whether a top-level entry of a cache root may be one of this family's namespaces
        (a tree family: a base or rank folder name; its config.json then says which family)."""
        return is_dir and layout.parse_folder(name) is not None

    def parse_block_path(self, relpath: str) -> Any:
        """(folder, block) of a block file's path in the root, None when it is no block
        name of this family (`layout.parse_block_relpath` for the tree families)."""
        return layout.parse_block_relpath(relpath)

    def block_relpath(self, rank_dir: str, hex_hash: str, group: int) -> str:
        """Where a block of a target namespace of this family is written, from the root."""
        return f"{rank_dir}/{layout.block_relpath_in_rank(hex_hash, group)}"

    # --- a store family (root_layout "stores": Mooncake, docs/mooncake.md) --------------

    def holds_store(self, path: str, fsdir: str | None = None) -> bool:
        """Whether a folder of the root is one of this family's stores (by what it holds;
        `fsdir`: the store's file-per-key folder as its facts name it)."""
        return False

    def root_store_entries(self, root: str, files: list[str], folders: list[str],
                           fsdir: str | None = None) -> set[str]:
        """The top-level names of ROOT that belong to a store at ROOT itself (empty: none)."""
        return set()

    # --- a flat family (root_layout "flat", docs/families.md §3) -------------------------

    def is_temp(self, name: str) -> bool:
        """A claimed file that is a temp leftover of the writer (never read)."""
        return False

    def temp_page(self, name: str) -> str | None:
        """The page file name a temp leftover was being written as, where its name says
        (its deployment is then that page's), else None."""
        return None

    def wants_head(self, file: Any) -> bool:
        """Whether the scan reads a claimed file's first bytes even under --verify size
        (the family's verdict depends on them); `file` is its `flat_file` record."""
        return False

    def flat_file(self, name: str, size: int) -> Any:
        """What `discover` is shown of one claimed file (the scan fills head, hash, zeros)."""
        raise NotImplementedError

    def model_key_matches(self, key: str, name_key: str) -> bool:
        """Whether a FACTS.json key names the model a name key carries (the writer's
        rewrite of model names applied)."""
        return False

    def discover(self, files: list[Any], facts_for: Any) -> list[Any]:
        """A flat directory's files grouped into deployments (each becomes a namespace);
        `facts_for(model, key)` resolves the facts of one name key."""
        return []

    def fold_page(self, folds: dict[Any, Any], file: Any) -> int:
        """Count a flat directory's page (its `flat_file`) into what `discover_folds` and
        the verdicts need of all the pages (`folds`, the family's own): the id of the fold
        it went into (the scan files the page under it)."""
        raise NotImplementedError

    def discover_folds(self, folds: Mapping[Any, Any], facts_for: Any) -> list[Any]:
        """`discover` from the pages folded (`fold_page`), none of them held."""
        return []

    def flat_verdicts(self, deployment: Any, files: list[Any], names: Container[str],
                      hashed: bool) -> Iterable[dict[str, Any]]:
        """The row of every file of some whole pages of a deployment: name, rank, hex,
        status, action, reason, target."""
        return ()

    def flat_page_hex(self, name: str) -> str | None:
        """The page hash a file name of the flat directory carries (the plan checks that
        a row's source and target names name its block); None: not a page name."""
        return None

    def unmarked(self, block_hash: bytes) -> bytes:
        """A row's chunk hash as its names carry it (a tier plan marks a sidecar row's)."""
        return block_hash

    def flat_target(self, source_base: str, fields: Mapping[str, Any]) -> str:
        """The namespace the target names of a deployment belong to, as a rescan labels
        them (the migration's target; prune finds the migrated sources by it)."""
        return source_base

    # --- blocks ------------------------------------------------------------------------

    def block_ranks(self, fields: Mapping[str, Any], present: Iterable[int] = (0,)) -> tuple[int, ...]:
        """The ranks that hold a file of each block (formats.md §2)."""
        return (0,)

    def kv_kind(self, fields: Mapping[str, Any], facts: Mapping[str, Any]) -> str | None:
        """The kv kind of the namespace: the kv_kind fact unless the identity names it."""
        return facts.get("kv_kind")

    def blocks_per_file(self, fields: Mapping[str, Any]) -> int | None:
        """B: the blocks one file holds, as the identity states it (None: not stated)."""
        return fields.get("gpu_blocks_per_file", fields.get("blocks_per_file"))

    def harmless_ambiguity(self, fields: Mapping[str, Any], block_sizes: list[int] | None) -> bool:
        """True when this reading of the namespace is uncertain but changes no byte (ambiguous only)."""
        return False

    def payload_bytes(self, fields: Mapping[str, Any]) -> int | None:
        """The payload size every block file has after its header, when the identity gives it."""
        return None

    def block_bytes(self, fields: Mapping[str, Any]) -> int | None:
        """The size of every block file of a namespace of this identity, when the identity
        alone gives it (a vLLM row's size depends on the deployment that writes it)."""
        return None

    def size_status(self, plan: UnitPlan, group: int, size: int) -> tuple[str, str] | None:
        """What a non-empty block file's size alone proves (None: nothing wrong)."""
        return None

    def plan_action(self, plan: UnitPlan, by_rank: list[FileRecord], group: int) -> tuple[str, str]:
        """(action, reason) of a complete, healthy block with a reachable target;
        `by_rank`: its files in rank order."""
        return "none", f"unknown writer family {plan.family!r}"

    def header_check(self, header: bytes, *, digest: bytes, payload_size: int, hex_hash: str,
                     group: int) -> str | None:
        """The check the engine's reader fails on a block file's first `header_len` bytes,
        given its namespace's identity digest and payload size (None: it passes, or the
        family writes no header). Scan and apply word the finding around it."""
        return None

    def status_advice(self, status: str) -> tuple[str, str, str] | None:
        """The report's (what it is, what follows, how to act) for a status of this family's
        files where the shared words (report/hints.py STATUS_ADVICE) do not fit; None: those."""
        return None

    def detection_notes(self, fields: Mapping[str, Any], block_sizes: list[int]) -> list[str]:
        """Sentences the scan adds to a namespace's family evidence (the ambiguous reading
        says whether its ambiguity changes any byte)."""
        return []

    def pair_of(self, relpath: str) -> str | None:
        """The other file of a pair a tier file belongs to (a GDS data file and its sidecar),
        else None."""
        return None

    def removed_first(self, relpath: str) -> bool:
        """A created file rollback removes before the others (a GDS sidecar: the engine finds
        a data file only through it, so it goes before its data file)."""
        return False

    def verify_tier_file(self, relpath: str, size: int, read: Any) -> tuple[str, str] | None:
        """(finding kind, message) when a file a migration made in a tier would not be read
        by its engine; `read(relpath, limit)` reads a file of the destination."""
        return None

    def verify_block(self, head: bytes, size: int, target: Mapping[str, Any], hex_hash: str | None,
                     group: int) -> tuple[str, str] | None:
        """(finding kind, message) when a migrated block of a target namespace of this
        family would be refused by its engine (`verify --journal`), else None."""
        return None


class _Unknown(Family):
    def __init__(self, name: str = UNKNOWN) -> None:
        self.name = name


_LOADED: dict[str, Family] = {}


def get(name: str | None) -> Family:
    """The family object of a name (a writer family, `ambiguous`, or anything else:
    an `unknown` family that migrates nothing)."""
    key = name or UNKNOWN
    fam = _LOADED.get(key)
    if fam is None:
        if key in NAMES or key == AMBIGUOUS:
            fam = importlib.import_module(f"{__name__}.{key}").FAMILY
        else:
            fam = _Unknown(key)
        _LOADED[key] = fam
    return fam


def writers() -> list[Family]:
    """The writer families, in NAMES order."""
    return [get(n) for n in NAMES]


def by_identity(fields: Mapping[str, Any]) -> Family | None:
    """The writer family whose keys alone prove it wrote this identity (None: S1 or no scheme)."""
    ranked = sorted(writers(), key=lambda f: -f.proof_priority)
    return next((f for f in ranked if f.proof(fields) is not None), None)


def of_identity(fields: Mapping[str, Any]) -> Family:
    """The family whose rules (digest recipe, validation) read this identity: the one its
    keys prove, else vLLM's (an S1 identity: vLLM and llm-d hash and validate it alike)."""
    return by_identity(fields) or get("vllm")


def detect(fields: Mapping[str, Any], *, rank_numbers: Iterable[int] = (), block_sizes: Iterable[int] = (),
           forced: str | None = None) -> tuple[str, list[str]]:
    """(family, evidence sentences) of a namespace (formats.md §3): a writer family's name,
    ambiguous, or unknown (no scheme keys).

    vLLM's scheme S1 and llm-d use the same keys and digest recipe, so only folder evidence
    tells them apart; without it the family stays `ambiguous`: we never guess. The family
    whose keys prove it wins (each family module says what proves it); an S1 identity is
    settled by `forced` (from --family or a FACTS.json `family`) or by folder evidence a
    family recognises. `forced` never overrides a config.json whose keys already prove
    another family.
    """
    shape = by_identity(fields)
    proof = shape.proof(fields) if shape is not None else None
    if shape is not None and proof is not None:  # (by_identity picks a family whose keys prove it)
        evidence = [proof]
        if forced and forced != shape.name:
            evidence.append(f"forced family {forced!r} ignored: the config.json keys prove {shape.name!r}")
        return shape.name, evidence
    if "hash_block_size" not in fields:
        return UNKNOWN, ["config.json has none of tokens_per_hash, hash_block_size or the vllm.cpp keys"]

    evidence = ["config.json has hash_block_size (scheme S1: vLLM 0.22-0.25 or llm-d, same keys and digest)"]
    if forced:
        evidence.append(f"family {forced!r} given by the operator (--family or FACTS.json)")
        settled = get(forced)
        if not settled.reads_s1:
            evidence.append(f"forced family {forced!r} ignored: an S1 identity is never a {settled.title} identity")
        else:
            return forced, evidence
    ranks = sorted(set(int(r) for r in rank_numbers))
    sizes = list(block_sizes)
    for fam in writers():
        found = fam.folder_evidence(ranks, sizes) if fam.reads_s1 else None
        if found:
            evidence.append(found)
            return fam.name, evidence
    evidence.append(f"only rank folder _r0 and every block size a multiple of {PAGE} (or none seen): "
                    "vLLM and llm-d both fit; pass --family (or 'family' in FACTS.json)")
    return AMBIGUOUS, evidence


def source_problems(fields: Mapping[str, Any]) -> list[str]:
    """Why an identity is not valid for its scheme (empty: valid), by the rules of the
    family that reads it (of_identity)."""
    return of_identity(fields).source_problems(fields)


def compute_target(source_fields: dict, family: str, facts: Facts, profile: str = DEFAULT_PROFILE) -> Target:
    """Target identity of an existing namespace (identity.md §4): the `target` of its
    family, or of the family its keys prove when that one is read by another engine.

    Raises MissingFactError when a required fact is missing (model_dtype to resolve
    "auto" for targets >= 0.27; cache_dtype for targets <= 0.26 from a resolved source),
    UsageError for an unknown profile, an identity that is not valid for its scheme, or
    facts that refused the namespace (a model config of another model).
    """
    if facts.refusal is not None:
        raise FactsRefusedError(facts.refusal, facts.refusal_flag)
    problems = source_problems(source_fields)
    if problems:
        raise UsageError("source identity is not valid: " + "; ".join(problems),
                         hint="the namespace's config.json is damaged or from an unknown writer")
    fam = get(family)
    proven = by_identity(source_fields)
    if proven is not None and proven.target_engine != fam.target_engine:
        fam = proven  # the keys decide which engine reads it
    return fam.target(source_fields, facts, fam.target_profile(profile))


def tree_profile(profile: str) -> str:
    """What the tree families (vLLM, llm-d) target under --target `profile`: an lmcache-* or
    mooncake-* profile is the LMCache tiers' or the Mooncake stores' alone (lmcache.md §0,
    mooncake.md §0), so they keep DEFAULT_PROFILE."""
    return DEFAULT_PROFILE if profile in LMCACHE_PROFILES or profile in MOONCAKE_PROFILES else profile


def _size(fields: Mapping[str, Any], key: str) -> int:
    v = fields.get(key, 1)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key} {v!r} is not an integer")
    return v


def worker_ranks(fields: Mapping[str, Any], keys: tuple[str, ...], present: Iterable[int]) -> tuple[int, ...]:
    """Ranks 0 .. (product of the identity's `keys` sizes) - 1: one file per worker of a
    block; fields that give no number (an invalid config.json) fall back to the rank
    folders `present`."""
    try:
        n = 1
        for k in keys:
            n *= _size(fields, k)
    except ValueError:
        n = len(tuple(present))
    return tuple(range(max(1, n)))
