"""The one typed model of every command's `--json` / `--format json` output.

Each command prints one of the `*Output` TypedDicts below (json.dumps with sorted keys:
interface.md §1); `OUTPUTS` names the model of each command, and scripts/gen_schema.py
walks these annotations into the JSON Schemas of docs/schema/<command>.json, which
tests/report/test_json_schema.py keeps current and checks real outputs against.

The rules the generator follows (and the only typing forms it takes): a TypedDict is an
object of exactly its keys (keys of a `total=False` class are optional, the others
required); `dict[str, X]` is an object with any keys of values X; `list[X]` an array;
`X | None` allows null; `Any` allows anything (open mappings: a config.json's fields).

This module sits below the stages (it imports nothing of kvmigrate): the report stage
builds the summary, the CLI the commands' outputs, the families the identity.
"""

from __future__ import annotations

from typing import Any, TypedDict

# A fact's value as stated or assumed (facts.md: strings, numbers, booleans; null when unknown).
FactValue = str | int | float | bool | None


# --- shared pieces ---------------------------------------------------------------------------


class BlockCount(TypedDict):
    blocks: int
    bytes: int


class FileCount(TypedDict):
    files: int
    bytes: int


class _TransformCostBase(TypedDict):
    blocks: int
    source_bytes: int
    output_bytes: int
    seconds_estimate: float


class TransformCost(_TransformCostBase, total=False):
    saves_bytes: int  # slice: it keeps 1/N of its rows
    new_bytes: int  # concat, relayout: a new copy



class MergeDuplicates(TypedDict):
    blocks: int
    bytes: int
    by_action: dict[str, BlockCount]


class ReclaimFigures(TypedDict):
    files: int
    bytes: int
    freed_files: int
    freed_bytes: int
    unlinked_files: int
    unlinked_bytes: int


# functional syntax: "class" is a Python keyword
_ReclaimNamespace = TypedDict("_ReclaimNamespace", {
    "class": str, "namespace": str,
    "files": int, "bytes": int, "freed_files": int, "freed_bytes": int, "unlinked_files": int, "unlinked_bytes": int,
})


class ReclaimNamespace(_ReclaimNamespace, total=False):
    """A (class, namespace) figure; a Mooncake store's own namespace in `prune --json`
    adds the objects no longer served and the indexes rewritten (--tails)."""

    objects: int
    rewritten: int


class ReclaimSkipped(TypedDict):
    namespace: str
    written_s_ago: int
    quiet_period_s: float
    reason: str


class OrphanedNamespace(TypedDict):
    namespace: str
    files: int
    bytes: int
    reason: str


# --- findings and hints (report/hints.py) ----------------------------------------------------


class _FindingBase(TypedDict):
    code: str
    severity: str  # operational | integrity | finding | note
    bits: int  # interface.md §2
    namespace: str | None
    message: str
    files: int | None
    bytes: int | None
    blocks: int | None
    example: str | None
    example_reason: str | None


class Finding(_FindingBase, total=False):
    """One finding: the common keys, plus those of its kind."""

    status: str  # a status finding: the status
    flag: str | None  # target_refused: the flag that states the missing fact
    facts: list[str]  # target_guessed: the facts it depends on
    evidence: list[str]  # family_ambiguous: the family evidence
    assumed: dict[str, FactValue]  # assumed_facts
    unproven_replicas: int  # migration_pending
    run: str  # unfinished_run: its run id


class Hint(TypedDict):
    command: str
    why: str
    codes: list[str]
    namespaces: list[str]


# --- the summary (report/summary.py): scan, report, audit, and the base of migrate ------------


class Gate(TypedDict):
    parallel_agnostic: bool | None
    replicated_layout: bool | None
    reasons: list[str]
    by_name: bool


class _NamespaceBase(TypedDict):
    """One source namespace of the summary (interface.md §3)."""

    source_base: str
    family: str | None
    family_evidence: list[str]
    scheme: str | None
    model_name: str | None
    ranks: list[int]
    deployment: str | None
    status: str | None
    status_reason: str | None
    notes: list[str]
    digest_ok: bool | None
    config_error: str | None
    unknown_keys: list[str]
    hash_bytes: list[int]
    target_profile: str | None
    target_family: str | None
    target_base: str | None
    target_rank_dir: str | None
    target_d12: str | None
    target_error: str | None
    target_error_flag: str | None
    target_refused_flag: str | None  # the flag whose stated facts refused the namespace
    target_unreachable: str | None
    target_missing_facts: list[str]
    target_decisive_assumptions: dict[str, FactValue]
    gate: Gate
    facts: dict[str, FactValue]
    facts_source: dict[str, str]
    assumed_facts: dict[str, FactValue]
    claims: list[str]
    files: int
    bytes: int
    blocks: int
    block_bytes: int
    bytes_alone: int
    bytes_shared: int
    data_bytes: int
    by_status: dict[str, FileCount]
    by_action: dict[str, BlockCount]
    reusable: BlockCount
    pending: BlockCount
    merge_duplicates: MergeDuplicates
    not_reusable: BlockCount
    replicas: FileCount
    top_reasons: dict[str, list[list[str | int]]]  # action -> [reason, blocks] pairs, most blocks first
    aliases_source_blocks: int
    flags_asked: dict[str, dict[str, int]]  # action -> flag -> blocks
    transform_cost: dict[str, TransformCost]


class Namespace(_NamespaceBase, total=False):
    objects: ObjectCount  # a Mooncake deployment's (or store's) objects, apart from its files (mooncake.md §4)


class OutsideNamespaces(TypedDict):
    files: int
    bytes: int
    families: dict[str, int]
    by_status: dict[str, FileCount]


class ObjectTally(TypedDict):
    objects: int
    bytes: int


class ObjectCount(TypedDict):
    """The objects of a Mooncake store's namespaces (index entries and KVEntries), counted
    apart from the files that hold them (mooncake.md §4)."""

    objects: int
    bytes: int
    by_status: dict[str, ObjectTally]
    by_action: dict[str, ObjectTally]


class _TotalsBase(TypedDict):
    files: int
    bytes: int
    blocks: int
    block_bytes: int
    replicas: FileCount
    bytes_alone: int
    bytes_shared: int
    data_bytes: int
    merge_duplicates: MergeDuplicates
    by_status: dict[str, FileCount]
    by_action: dict[str, BlockCount]
    namespaces: int
    transform_cost: dict[str, TransformCost]
    reusable: BlockCount
    pending: BlockCount
    not_reusable: BlockCount


class Totals(_TotalsBase, total=False):
    objects: ObjectCount  # every store's objects, apart from the files that hold them (mooncake.md §4)


class ScanFacts(TypedDict, total=False):
    flags: dict[str, FactValue]
    facts_file: str | None


class _SelectionStepBase(TypedDict):
    only: list[str]
    exclude: list[str]
    by: str  # scan | report


class SelectionStep(_SelectionStepBase, total=False):
    partial: bool
    skipped_namespaces: list[str]


class MissingFact(TypedDict):
    namespace: str
    flag: str | None
    error: str


class RecipeComponent(TypedDict):
    """One §3.2 hash-recipe component of an LMCache deployment, writer vs target: each
    value with where it came from (`flag`, `facts:<key>`, `the names`, a target profile,
    `assumed: …`, `not given`); `equal` null when not known."""

    component: str
    writer: str | None
    writer_source: str
    target: str | None
    target_source: str
    equal: bool | None


class AssumedFact(TypedDict):
    fact: str
    value: str
    flags: list[str]


class TierDeployment(TypedDict):
    """One deployment of an LMCache tier (lmcache.md §7)."""

    deployment: str
    backend: str
    scheme: str | None
    model: str | None
    ws: int | None
    dtype: str | None
    kv_kind: str | None
    target_profile: str | None
    target_base: str | None
    recipe: list[RecipeComponent]
    assumed_facts: list[AssumedFact]
    writer_none_hash: str | None  # seed N, fixed, random; null: not known
    seed_fix_files: int
    zero_hex64_files: int
    facts: dict[str, FactValue]
    files: int
    bytes: int
    by_status: dict[str, FileCount]
    by_action: dict[str, BlockCount]
    reclaimable: dict[str, FileCount]  # prune class -> files it could take


class Tier(TypedDict):
    """One LMCache tier directory: its deployments and what each prune class could take."""

    tier: str
    target_profile: str | None
    backends: list[str]
    deployments: list[TierDeployment]
    other_files: dict[str, FileCount]  # files of no deployment (temps, foreign), by status
    files: int
    bytes: int
    reclaimable: dict[str, FileCount]


class StoreReclaim(TypedDict):
    """What one prune class could take of a Mooncake store (mooncake.md §6): files moved and
    the bytes they free; objects retired or taken; bytes of those objects that stay in live
    pairs (freed only when Mooncake evicts the pair)."""

    files: int
    bytes: int
    objects: int
    held_bytes: int


class StoreDeployment(TypedDict):
    """One deployment of a Mooncake store (mooncake.md §7): its objects apart from its files."""

    deployment: str
    engine: str
    stem: str
    scheme: str | None
    tenant: str | None
    model: str | None
    kv_kind: str | None
    key_ranks: int  # the writer's key ranks (one more than the largest in its keys)
    writer_tp: int | None  # stated
    target: str | None  # the target deployment's label
    target_profile: str | None
    assumed_facts: dict[str, FactValue]
    files: int  # its KVEntry files on disk
    bytes: int
    objects: int
    object_bytes: int
    by_status: dict[str, ObjectTally]  # objects
    by_action: dict[str, ObjectTally]
    entries_by_status: dict[str, ObjectTally]  # the index entries alone (their files' statuses are the pairs')
    pending_objects: int  # link, rekey, reshard
    reshard_objects: int
    cut_records: int  # keys is_exist reports but no read serves: records cut by their .bucket's end
    raw_keys: int  # raw keys 0.3.14 never reads (pending rekey)
    misfiled_entries: int  # KVEntries outside fpk(key)
    auto_prefix: str | None  # vLLM's auto-<hash> cache prefix of its keys
    reclaimable: dict[str, StoreReclaim]  # prune class -> what it could take


class Store(TypedDict):
    """One Mooncake store (mooncake.md §7): its client roots and deployments."""

    store: str  # its relpath under ROOT ("." for ROOT)
    namespace: str | None  # the namespace of its own files (`mooncake:<store>`)
    backends: list[str]  # bucket, file_per_key
    client_roots: list[str]
    locks: dict[str, str]  # client root -> absent | free | held (the 0.3.14 client lock)
    client_live: list[str]  # client roots whose lock is held: a client runs there
    largest_bucket_id: int | None
    writer_release: str | None  # a release or a range (">=0.3.12")
    writer_release_evidence: str
    writer_release_stated: bool
    engine_stopped: bool  # stated: no client uses the store
    store_is_client_root: bool  # its own folder is a bucket client root above its rank client roots
    target_tp: int | None  # stated
    unused_rank_roots: list[str]  # SGLang rank client roots of TP ranks the target does not run
    files: int
    bytes: int
    objects: int
    object_bytes: int
    pending_objects: int
    start_deletes: dict[str, FileCount]  # status -> the files the next client start deletes
    start_refuses: FileCount  # KVEntry files that stop a client from starting
    deployments: list[StoreDeployment]
    reclaimable: dict[str, StoreReclaim]
    notes: list[str]


class SummaryCore(TypedDict):
    """The summary of a manifest: every key `summarize` makes."""

    summary_version: int
    tool_version: str | None
    command: str | None
    root: str | None
    target_profile: str | None
    verify: str | None
    shard: str | None
    facts: ScanFacts
    selection: list[SelectionStep] | None
    manifest: str | None
    totals: Totals
    namespaces: list[Namespace]
    outside_namespaces: OutsideNamespaces | None
    walk_errors: list[str]
    walk_failed: bool
    no_cache: bool
    missing_facts: list[MissingFact]
    exit_code: int
    findings: list[Finding]
    hints: list[Hint]
    tiers: list[Tier]  # LMCache tier directories (lmcache.md §7); empty without any
    stores: list[Store]  # Mooncake stores (mooncake.md §7); empty without any


class Reclaimable(TypedDict):
    """What prune of every class would take (migrate/prune.py `reclaimable`)."""

    files: int
    bytes: int
    freed_files: int
    freed_bytes: int
    unlinked_files: int
    unlinked_bytes: int
    classes: dict[str, ReclaimFigures]
    namespaces: list[ReclaimNamespace]
    skipped: list[ReclaimSkipped]
    orphaned: list[OrphanedNamespace]


class Run(TypedDict):
    """One journaled run (migrate/runs.py RunInfo.to_dict)."""

    run_id: str
    kind: str  # migrate | prune
    state: str
    journal: str
    command: str | None
    root: str
    targets: list[str]
    counts: dict[str, int]
    holder: int | None
    resume_command: str | None
    undo_command: str


class ReportOutput(SummaryCore, total=False):
    """`scan --json` (the summary alone), `report --format json` and `audit --json` (with
    what prune would reclaim and the root's unfinished runs)."""

    reclaimable: Reclaimable
    unfinished_runs: list[Run]


# --- migrate --------------------------------------------------------------------------------


class Skipped(TypedDict):
    action: str
    reason: str
    blocks: int
    bytes: int


class NotReusable(TypedDict):
    reason: str
    blocks: int
    bytes: int


class Conflict(TypedDict):
    reason: str
    blocks: int


class Target(TypedDict):
    """One target namespace of a migration plan."""

    target_base: str | None
    family: str | None
    rank_dir: str | None
    sources: list[str]
    claims: list[str]
    actions: dict[str, BlockCount]
    outcomes: dict[str, int]
    merges_checked_at_apply: int
    transform_cost: dict[str, TransformCost]
    already_present: BlockCount
    skipped: list[Skipped]
    not_reusable: list[NotReusable]
    conflicts: list[Conflict]


class GuessedTarget(TypedDict):
    namespace: str
    facts: list[str]


class MigrateDryRunOutput(SummaryCore):
    """`migrate --json` (the plan)."""

    outcomes: dict[str, int]
    targets: list[Target]
    pending: int
    apply_command: str | None
    waiting_for_dest: BlockCount
    dest_command: str | None
    merges_checked_at_apply: int
    guessed_targets: list[GuessedTarget]
    facts_command: str | None


class ApplyResult(TypedDict):
    """migrate/result.py ApplyResult.to_dict."""

    outcomes: dict[str, int]
    linked: int
    copied: int
    link_copies: int
    transformed: int
    bytes_written: int
    per_target: dict[str, dict[str, int]]
    findings: list[str]
    namespace_errors: list[str]
    journal: str | None
    resumed: bool
    recovered: int
    left_out_guessed: list[GuessedTarget]
    stopped: str | None


class MigrateApplyOutput(SummaryCore):
    """`migrate --apply --json`."""

    outcomes: dict[str, int]
    apply: ApplyResult
    targets: list[Target]


MigrateOutput = MigrateDryRunOutput | MigrateApplyOutput


# --- verify ---------------------------------------------------------------------------------


class VerifyFinding(TypedDict):
    code: str
    path: str
    message: str
    related: bool


class VerifyChecked(TypedDict):
    namespaces: int
    blocks: int
    configs: int


class VerifyOutput(TypedDict):
    """`verify --json`: the root's summary totals (migrate/verify.py SUMMARY_KEYS) and the checks."""

    summary_version: int
    tool_version: str | None
    target_profile: str | None
    totals: Totals
    namespaces: list[Namespace]
    outside_namespaces: OutsideNamespaces | None
    walk_errors: list[str]
    root: str
    checked: VerifyChecked
    journals: list[str]
    findings: list[VerifyFinding]
    strict: bool
    next: str
    exit_code: int


# --- prune, purge, restore, rollback ----------------------------------------------------------


class PruneDryRunOutput(TypedDict):
    """`prune --json` (the plan)."""

    root: str
    classes: list[str]
    totals: dict[str, ReclaimFigures]
    namespaces: list[ReclaimNamespace]
    skipped: dict[str, str]
    orphaned: list[OrphanedNamespace]
    files: int
    objects: dict[str, int]  # class -> Mooncake store objects no longer served
    rewritten: int  # Mooncake indexes a --tails apply rewrites
    apply_command: str | None
    exit_code: int


class PruneRun(TypedDict):
    """migrate/quarantine.py PruneResult.to_dict."""

    journal: str | None
    run_id: str | None
    quarantine: str | None
    moved: dict[str, int]
    moved_bytes: dict[str, int]
    freed_bytes: int
    unlinked_files: int
    dirs_removed: int
    left: dict[str, int]
    legacy_names_removed: dict[str, int]
    legacy_names_left: dict[str, int]
    kept: list[str]
    objects: dict[str, int]  # class -> Mooncake store objects no longer served (a moved pair's entries, a KVEntry)
    rewritten: int  # Mooncake indexes rewritten (--tails: short entries' keys retired)
    already_moved: dict[str, int]  # class -> files a killed run had moved whose done record was lost (not in `moved`)
    failed: list[str]
    exit_code: int


class PruneApplyOutput(PruneRun):
    """`prune --apply --json`."""

    root: str
    classes: list[str]
    skipped: dict[str, str]
    finished_interrupted: list[PruneRun]


class PurgeOutput(TypedDict):
    """`prune --purge --json`."""

    root: str
    dry_run: bool
    purged_runs: list[str]
    files: int
    freed_bytes: int
    kept_young_runs: int
    failed: list[str]
    exit_code: int


PruneOutput = PruneDryRunOutput | PruneApplyOutput | PurgeOutput


class RestoreOutput(TypedDict):
    """`restore --json` (migrate/restore.py RestoreResult.to_dict)."""

    restored: int
    already_in_place: int
    dirs_made: int
    kept: list[str]
    conflicts: int
    journals: list[str]
    exit_code: int


class RollbackOutput(TypedDict):
    """`rollback --json` (migrate/rollback.py RollbackResult.to_dict)."""

    dry_run: bool
    removed: dict[str, int]
    restored: int
    already_gone: int
    kept: list[str]
    notes: list[str]
    journals: list[str]
    per_namespace: dict[str, dict[str, int]]
    exit_code: int


class RunsOutput(TypedDict):
    """`runs --json`."""

    root: str
    runs: list[Run]
    exit_code: int


# --- identity (families/explain.py) ------------------------------------------------------------


class SourceIdentity(TypedDict):
    fields: dict[str, Any]  # the config.json's fields, as the writer wrote them
    d12: str | None
    base_name: str | None
    digest_ok: bool | None


class TargetIdentity(TypedDict):
    profile: str
    family: str
    fields: dict[str, Any] | None
    d12: str | None
    base_name: str | None
    rank_dir: str | None
    parallel_agnostic: bool
    replicated_layout: bool
    reasons: list[str]
    unreachable: str | None
    missing_facts: list[str]
    decisive_assumptions: dict[str, FactValue]
    writer_topology: list[int] | None
    claims: list[str]


class IdentityOutput(TypedDict):
    """`identity --json`."""

    family: str
    family_evidence: list[str]
    scheme: str | None
    source: SourceIdentity
    target: TargetIdentity
    assumed_facts: dict[str, FactValue]


# --- explain (report/explain.py) ---------------------------------------------------------------


class ExplainFact(TypedDict):
    name: str
    value: FactValue
    source: str  # flag, FACTS.json key, model config, assumed...
    flag: str


class ExplainGate(TypedDict):
    gate: str
    gate_name: str
    needs: str
    passed: bool
    reason: str | None
    facts: list[ExplainFact]


class ExplainTarget(TypedDict):
    profile: str | None
    family: str | None
    base_name: str | None
    rank_dir: str | None
    parallel_agnostic: bool | None
    replicated_layout: bool | None
    unreachable: str | None
    missing_facts: list[str] | None
    decisive_assumptions: dict[str, FactValue] | None


class ExplainClass(TypedDict):
    """One class of blocks that is not reusable, and the command that would change it."""

    status: str
    action: str
    finding: str | None
    asks: str | None
    blocks: int
    bytes: int
    reason: str | None
    command: str | None
    why: str | None


class ExplainTier(TypedDict):
    """An LMCache deployment's tier and its entry of the summary's tiers (lmcache.md §7)."""

    tier: str
    deployment: TierDeployment


class ExplainStore(TypedDict):
    """A Mooncake store's entry of the summary's stores and, for a deployment, its own (mooncake.md §7)."""

    store: Store
    deployment: StoreDeployment | None


class ExplainOutput(TypedDict):
    """`explain --json`."""

    manifest: str
    namespace: str
    model_name: str | None
    family: str | None
    scheme: str | None
    ranks: list[int]
    status: str | None
    status_reason: str | None
    target_profile: str | None
    target: ExplainTarget | None
    target_error: str | None
    gates: list[ExplainGate]
    gate_note: str | None
    facts: list[ExplainFact]
    blocks: int
    reusable: BlockCount
    pending: BlockCount
    not_reusable: list[ExplainClass]
    why: str | None
    command: str | None
    tier: ExplainTier | None  # an LMCache deployment: its recipe comparison, target, counts
    store: ExplainStore | None  # a Mooncake store or deployment: its store, counts and reclaimable


# command -> the model of its JSON output; docs/schema/<command>.json is generated from it
# --- facts, synth --------------------------------------------------------------------------------


class FactsOutput(TypedDict):
    """`facts --json`: the FACTS.json skeleton and what it leaves null."""

    root: str
    facts: dict[str, dict[str, FactValue]]  # key (base folder or model name) -> fact -> value (null: not stated)
    unknown: list[str]  # "<key>: <fact>" for every null
    output: str | None  # the -o file written, if any
    exit_code: int


class SynthOutput(TypedDict):
    """`synth --json`: what the generator wrote (the tests' and benchmarks' ground truth;
    namespaces, blocks and defects are open records: kvmigrate/synth/spec.py SynthResult)."""

    root: str
    namespaces: list[dict[str, Any]]
    blocks: list[dict[str, Any]]
    defects: list[dict[str, Any]]


OUTPUTS: dict[str, Any] = {
    "report": ReportOutput,  # also scan --json and audit --json
    "migrate": MigrateOutput,
    "verify": VerifyOutput,
    "prune": PruneOutput,
    "rollback": RollbackOutput,
    "restore": RestoreOutput,
    "identity": IdentityOutput,
    "runs": RunsOutput,
    "explain": ExplainOutput,
    "facts": FactsOutput,
    "synth": SynthOutput,
}
