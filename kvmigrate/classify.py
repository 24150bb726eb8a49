"""Records + target -> status, action and reason (migration.md §1, interface.md §2).

Pure functions, no I/O: the scanner (`kvmigrate.scan`) stats, reads and hashes files,
puts what it found into `FileRecord`s, and asks this module what each file *is* and what
each block may become. Keeping the decisions here, apart from the walk, lets tests
exercise every cell of the action matrix without building trees.

Vocabulary:
* a *unit* is what the walker visits side by side: one vLLM / llm-d namespace with its
  rank folders, or one vllm.cpp deployment (several per-rank namespaces);
* a *block* is `(unit, group, hex)`: one file per rank;
* the *rank-row rule*: the action and `target_relpath` sit on the rank-0 row (the file
  the action reads first); the other ranks' rows carry `none` with "replica of rank 0"
  or "part of <action> from rank 0", so counting rows by action counts blocks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvmigrate import layout
from kvmigrate.findings import ALIASES_SOURCE, PART_OF_ACTION, REPLICA_OF_PRIMARY, TRANSFORM, Reason
from kvmigrate.findings import reason as finding_reason

PAGE = 4096
LEGACY_FLOOR = 16 * 1024 * 1024  # llm-d builds before 2026-06-04 padded files to >= 16 MiB

# interface.md §2: status -> exit-code bits
STATUS_BITS: dict[str, int] = {
    "ok": 0,
    "incomplete": 1,
    "replica_mismatch": 1 | 4,
    "size_mismatch": 1 | 4,
    "padded_legacy": 1,
    "short": 1 | 4,
    "zero_filled": 1 | 4,
    "misfiled": 1 | 4,
    "header_invalid": 1 | 4,
    "silent_change": 1 | 4,
    "unreadable": 1 | 8,
    "tmp_leftover": 1,
    "own_artifact": 0,
    "foreign": 1,
    "orphan_namespace": 1,
    "digest_mismatch": 1 | 4,
    "config_invalid": 1 | 4,
    "unsupported_layout": 1,
    "missing_slots": 1 | 4,
    # LMCache tiers (spec lmcache.md §4)
    "index_lost": 1,
    "stale_hash_recipe": 1,
    "unreproducible_hash": 1,
    "orphan_data": 1,
    "corrupt_sidecar": 1 | 4,
    # Mooncake stores (spec mooncake.md §4)
    "orphan_index": 1,
}
STATUSES = tuple(STATUS_BITS)
# a namespace of one of these states is read by no target (formats.md §3, interface.md §2):
# prune's opt-in class unreadable_namespaces takes it whole
UNREADABLE_STATUSES = ("orphan_namespace", "digest_mismatch", "config_invalid", "unsupported_layout", "missing_slots")

ACTIONS = ("already_present", "link", "rekey", "copy_pad", "rewrite_header", "slice", "concat", "relayout", "reshard",
           "needs_slice", "needs_concat", "needs_relayout", "needs_reshard", "none")
# Actions whose bytes come from one replica: the other ranks are "replica of rank 0".
REPLICA_ACTIONS = ("already_present", "link", "rekey", "copy_pad", "rewrite_header", "slice", "needs_slice")

REPLICA_REASON = finding_reason("replica of rank 0", REPLICA_OF_PRIMARY, primary_rank=0)
UNVERIFIED = "replicas not yet verified (run scan --verify hash or migrate --apply hashes them)"


def exit_bits(statuses: Iterable[str]) -> int:
    """OR of the exit-code bits of the given states (unknown states count as findings)."""
    code = 0
    for s in statuses:
        code |= STATUS_BITS.get(s, 1)
    return code


def pad_to_page(n: int) -> int:
    return -(-n // PAGE) * PAGE


# ---------------------------------------------------------------------------------------
# The per-unit context the scanner builds once (from config.json, facts and the target)


@dataclass(frozen=True)
class TargetInfo:
    """What classification needs of a computed target identity."""

    profile: str
    base: str
    d12: str
    rank_dir: str
    replicated_layout: bool
    parallel_agnostic: bool
    digest: bytes | None = None  # vllmcpp: raw 32-byte digest for the rewritten header
    unreachable: str | None = None  # e.g. "hash granularity changed", "target_lacks_<key>"


@dataclass
class UnitPlan:
    """Everything block classification needs to know about one walk unit."""

    # the family object of the unit (kvmigrate.families.get(name), set by kvmigrate/context.py):
    # the verdicts below ask it, so classify never imports the registry above it
    fam: Any
    expected_ranks: tuple[int, ...] = (0,)
    rank_dirs: dict[int, str] = field(default_factory=dict)  # rank -> source rank folder (top-level name)
    kv_kind: str | None = None  # full | mla | sliding | hybrid | mamba | None (unknown)
    blocks_per_file: int | None = None  # B
    layers: dict[int, int] = field(default_factory=dict)  # group -> number of layer names
    page_bytes: int | None = None  # P (fact)
    tensors_per_layer: int | None = None  # fact (full attention)
    world: int = 1  # tp * pp * pcp of the writer (cells of a direct vLLM row)
    source_replicated: bool = False  # vLLM identity with replicated_layout
    source_canonical: bool = False  # vLLM identity with canonical_format
    payload_bytes: int | None = None  # what every block file holds after its header (vllm.cpp: page_size_bytes)
    target: TargetInfo | None = None
    # namespace-wide verdicts
    block_status: str | None = None  # status every block row gets (orphan_namespace, digest_mismatch, ...)
    block_reason: str | None = None
    absent_ranks: tuple[int, ...] = ()  # vllm.cpp ranks whose namespace is missing or invalid
    none_reason: str | None = None  # every block gets action none with this reason (e.g. missing fact)
    ambiguity_harmless: bool = False  # S1 ambiguous but both readings give the same bytes
    hashed: bool = False  # scan --verify hash: content hashes available

    @property
    def family(self) -> str:
        """The family's name: vllm | llmd | vllmcpp | ambiguous | unknown (or a name no module has)."""
        return self.fam.name

    @property
    def replicas(self) -> bool | None:
        """True when the ranks of a block must hold identical bytes (MLA replicas), False
        for shards, None when unknown (kv kind not given; vllm.cpp identities say it)."""
        if len(self.expected_ranks) <= 1:
            return False
        if self.kv_kind is None:
            return None
        return self.kv_kind == "mla"

    def tensors(self, group: int) -> int | None:
        """T of a group: layer names x (1 for MLA, tensors_per_layer for full attention)."""
        layers = self.layers.get(group)
        if layers is None or self.kv_kind is None:
            return None
        if self.kv_kind == "mla":
            return layers
        if self.kv_kind == "full" and self.tensors_per_layer:
            return layers * self.tensors_per_layer
        return None

    def data_bytes(self, group: int) -> int | None:
        """Proven bytes of one rank's data for a block file: B x T x P, or None."""
        t = self.tensors(group)
        if t is None or not self.page_bytes or not self.blocks_per_file:
            return None
        return self.blocks_per_file * t * self.page_bytes

    def expected_row_bytes(self, group: int) -> int | None:
        """Proven size of a vLLM row: cells x (T x B x P), padded to 4096 (direct rows and
        replicated rows only; canonical cells hold full pages whose size no fact gives)."""
        if self.source_canonical:
            return None
        cell = self.data_bytes(group)
        if cell is None:
            return None
        cells = 1 if self.source_replicated else self.world
        return pad_to_page(cells * cell)


@dataclass(slots=True)
class FileRecord:
    """One file seen by the walk; status starts as what the file alone shows."""

    relpath: str
    rank: int | None
    group: int | None
    hex: str | None
    size: int
    mtime_ns: int
    inode: int
    dev: int
    nlink: int
    member: int = 0  # index of the namespace in the unit (vllm.cpp: one per rank)
    content: bytes | None = None  # XXH3-128 of the whole file
    payload: bytes | None = None  # XXH3-128 after the vllm.cpp header
    status: str = "ok"
    reason: str = ""
    action: str = "none"
    target_relpath: str | None = None
    ctime_ns: int | None = None  # the inode change time (a --baseline trusts a row only if it is unchanged)
    carried: bool = False  # hashes taken from the --baseline row: not opened


# ---------------------------------------------------------------------------------------
# File-level rules


def size_status(plan: UnitPlan, group: int, size: int) -> tuple[str, str] | None:
    """What a block file's size alone proves (None: nothing wrong).

    formats.md §2, each family's rule (Family.size_status): vLLM rows are multiples of
    4096 (and match the proven geometry); llm-d files hold exactly B x T x P bytes (a
    16 MiB file with less proven data is the old padding floor); vllm.cpp files are
    exactly 128 + page_size_bytes.
    """
    if size == 0:
        return "short", "empty file"
    return plan.fam.size_status(plan, group, size)


def majority_size(sizes: Counter) -> tuple[set[int], str]:
    """The sizes that are off in one (namespace, rank, group): everything but the most
    common size; on a tie every size is off (nothing can be called the norm)."""
    ranked = sizes.most_common()
    top = ranked[0][1]
    winners = sorted(s for s, n in ranked if n == top)
    if len(winners) == 1:
        norm = winners[0]
        return {s for s in sizes if s != norm}, f"most of its files are {norm} bytes"
    return set(sizes), "no majority size among " + ", ".join(f"{s}" for s in sorted(sizes)) + " bytes"


# ---------------------------------------------------------------------------------------
# Block-level rules: replicas, completeness, and the action matrix


def _ranks_text(ranks: Iterable[int | None]) -> str:
    return ", ".join(str(r) for r in sorted(ranks, key=_rank_order))


def _rank_order(rank: int | None) -> int:
    """Ranks in order; a file of no rank folder (a flat family's page) first."""
    return -1 if rank is None else rank


def _rank_of(r: FileRecord) -> int:
    return _rank_order(r.rank)


def classify_block(plan: UnitPlan, recs: list[FileRecord], group: int, hex_hash: str) -> None:
    """Set status/action/reason/target_relpath of every row of one block, in place.

    `recs` hold the block's files (one per rank present) with their file-level status
    already set; this adds completeness, replica comparison and the action.
    """
    for r in recs:
        r.action = "none"
        r.target_relpath = None
        if r.status != "ok":
            r.reason = r.reason or r.status
    if plan.block_status is not None:
        for r in recs:
            if r.status == "ok":
                r.status, r.reason = plan.block_status, plan.block_reason or plan.block_status
        return

    by_rank = {r.rank: r for r in recs}
    missing = [k for k in plan.expected_ranks if k not in by_rank and k not in plan.absent_ranks]
    ok = [r for r in recs if r.status == "ok"]
    if missing:
        why = f"block incomplete: rank {_ranks_text(missing)} file missing"
        for r in ok:
            r.status, r.reason = "incomplete", why
        return
    bad = [r for r in recs if r.status != "ok"]
    if bad:
        why = "block unusable: " + "; ".join(f"rank {r.rank} file is {r.status}" for r in bad)
        for r in ok:
            r.reason = why
        return

    if plan.replicas and _replicas_differ(plan, recs):
        # every replica is flagged: nothing tells which copy is the right one
        what = plan.fam.replica_hash + "s"
        basis = "hashes" if plan.hashed else "sizes"
        for r in recs:
            r.status = "replica_mismatch"
            r.reason = (f"replicas differ: the MLA {what} of ranks {_ranks_text(x.rank for x in recs)} "
                        f"must be equal, their {basis} are not")
        return

    first = min(recs, key=lambda r: r.rank if r.rank is not None else -1)
    action, reason = plan_action(plan, recs, group, hex_hash)
    first.action, first.reason = action, reason
    if action != "none" and plan.target is not None:
        first.target_relpath = target_relpath(plan.target, hex_hash, group)
        if first.target_relpath == first.relpath:
            if action == "link":
                first.action = "already_present"
                first.reason = "already at its target path (the target identity is the source identity)"
            else:
                first.action = "none"
                first.target_relpath = None
                first.reason = finding_reason(f"aliases_source: the target path is this source file, which holds other "
                                      f"bytes than {action} would write; use --dest DIR", ALIASES_SOURCE,
                                      of_action=action, aliases_relpath=first.relpath)
    follower: str = REPLICA_REASON if first.action in REPLICA_ACTIONS else \
        finding_reason(f"part of {first.action} from rank 0", PART_OF_ACTION, primary_rank=0, of_action=first.action)
    if first.action == "none":
        follower = first.reason
    for r in recs:
        if r is not first:
            r.action, r.reason = "none", follower


def _replicas_differ(plan: UnitPlan, recs: list[FileRecord]) -> bool:
    """Compare the hashes the family's replicas share (content, or vllm.cpp's payload:
    its headers differ by design) when taken, else sizes."""
    which = plan.fam.replica_hash

    def key(r: FileRecord):
        if plan.hashed:
            h = getattr(r, which)
            if h is not None:
                return h
        return r.size

    return len({key(r) for r in recs}) > 1


def target_relpath(target: TargetInfo, hex_hash: str, group: int) -> str:
    return f"{target.rank_dir}/{layout.block_relpath_in_rank(hex_hash, group)}"


def plan_action(plan: UnitPlan, recs: list[FileRecord], group: int, hex_hash: str) -> tuple[str, str]:
    """(action, reason) of a complete, healthy block, before looking at the target path:
    the namespace-wide verdicts, then the family's action matrix (Family.plan_action)."""
    if plan.none_reason:
        return "none", plan.none_reason
    t = plan.target
    if t is None:
        return "none", "no target identity for this namespace"
    if t.unreachable:
        return "none", t.unreachable
    by_rank = sorted(recs, key=_rank_of)
    return plan.fam.plan_action(plan, by_rank, group)


def slice_reason(n: int, cell: int, proof: str) -> Reason:
    """The reason of a proven slice, with the numbers migrate and the reports read (its
    finding: cell 0 of `row_cells` cells of `cell_bytes`, `output_bytes` written)."""
    return finding_reason(f"slice: cell 0 of {n} (cell {cell} bytes; {proof}) + pad to {pad_to_page(cell)} bytes", TRANSFORM,
                  cell_bytes=cell, row_cells=n, output_bytes=pad_to_page(cell))
