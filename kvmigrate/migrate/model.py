"""The migration's data model: the plain types every migrate module shares (a source
file, a block action, a target namespace's plan, the plan) and the action names.

The bottom of migrate's one-way stack (fsops, outputs <- model <- competing, rows, result,
reconcile, state <- actions, plan, sources <- place, dirs <- apply). It imports none of the
modules above it, so any of them can name these types; building a plan is `plan.py`, what each action kind
does (and the bytes it writes: `ActionKind.output_size`) is `actions.py`. A `BlockAction`
stays a plain NamedTuple (a plan streams millions).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvmigrate import families
from kvmigrate.cost import TRANSFORMS, transform_cost
from kvmigrate.families import Family
from kvmigrate.manifest import holds_no_cache
from kvmigrate.migrate.outputs import TransformSpec

# The reason of a flat family's relayout planned without --dest (plan._flat_rows): its
# output keeps the page's name, so it can only be written into another directory.
NEEDS_DEST = ("a relayout into --dest DIR: the page keeps its name, so it is written into a new storage "
              "directory, never over a source; rerun with --dest DIR")

# Actions that create a file (migration.md §1); the rest are counted, never acted on.
COPIES = ("link", "copy_pad", "rewrite_header")
CREATING = (*COPIES, *TRANSFORMS)
NEEDS = ("needs_slice", "needs_concat", "needs_relayout", "needs_reshard", "needs_dest")
# The reason of an LMCache conversion planned without --dest (plan._tier_rows): a local_disk
# chunk is reused only as an fs chunk of a new tier, which only --dest DIR makes (lmcache.md §3.5).
NEEDS_DEST_TIER = ("a conversion into an fs tier goes only into --dest DIR (DIR/<tier>, then configured as "
                   "remote_url fs://.../DIR/<tier>); rerun with --dest DIR")
# Counts key of a block another source places at the same target path with the same
# bytes: streamed after the placed blocks, compared at apply (already_present).
MERGE = "merge_duplicate"
# Outcomes of a block (interface.md §1): what `--apply` reports, and what the dry run
# foresees with the same numbers (`Plan.outcomes`).
OUTCOMES = ("created", "already_present", "conflict", "changed_since_scan", "skipped_needs_transform", "failed")

class SourceFile(NamedTuple):
    """One source file an action reads, with the stat the scan saw (staleness check).
    (Immutable records; a NamedTuple is built three times faster than a frozen dataclass,
    and a plan makes one per block file.)"""

    relpath: str
    rank: int
    dev: int
    inode: int
    size: int
    mtime_ns: int
    content_hash: bytes | None
    payload_hash: bytes | None
    ctime_ns: int | None = None  # None: the scan did not stat it (never compared)
    nlink: int | None = None  # the names the scan saw (a hard link added since moves the ctime too)


class BlockAction(NamedTuple):
    """One block to materialize at `target_relpath` (relative to the destination root)."""

    action: str  # link | copy_pad | rewrite_header | slice | concat | relayout
    target_relpath: str
    source: SourceFile
    replicas: tuple[SourceFile, ...]  # the other ranks' files (equal to `source`, or the shards of a concat)
    source_base: str
    world: int = 1  # ranks that hold a file of this block (replicas must cover 0..world-1)
    transform: TransformSpec | None = None  # the proven geometry of a slice/concat/relayout

    @property
    def transform_spec(self) -> TransformSpec:
        """The geometry of a slice, concat or relayout, which the plan always gives one
        (`transform`; any other action has none: ValueError)."""
        if self.transform is None:
            raise ValueError(f"{self.action} of {self.target_relpath} has no transform")
        return self.transform

    @property
    def sources(self) -> tuple[SourceFile, ...]:
        """Every file of the block in rank order (what a concat or relayout reads)."""
        return (self.source, *self.replicas)

    @property
    def source_bytes(self) -> int:
        return sum(f.size for f in self.sources)


@dataclass
class TargetPlan:
    """Everything to do for one target namespace, in the fixed merge order; competing
    sources of a target path resolved by the rule of `decide`."""

    base_name: str
    rank_dir: str
    profile: str
    family: str  # target engine family: vllm | vllmcpp
    fields: dict[str, Any]
    sources: list[str]  # source base folders merged into this target, in merge order
    # the block actions in merge order: an `ActionStream` read from the manifest on demand
    # (build_plan), or an empty list (a target whose config.json alone is written)
    actions: Any = field(default_factory=list)
    already_present: list[int] = field(default_factory=lambda: [0, 0])  # blocks, bytes
    skipped: Counter = field(default_factory=Counter)  # (needs_action, reason) -> blocks
    skipped_bytes: Counter = field(default_factory=Counter)
    not_reusable: Counter = field(default_factory=Counter)  # reason -> blocks
    not_reusable_bytes: Counter = field(default_factory=Counter)
    conflicts: Counter = field(default_factory=Counter)  # reason -> blocks whose target path is taken
    # a flat family's target (docs/families.md §3): file names in the destination directory
    # itself, no base folder, rank folder or config.json; `base_name` is its label
    flat: bool = False
    # the operator's statements the target rests on (a collapsed folder's writer topology)
    claims: list[str] = field(default_factory=list)
    lock: str | None = None  # a tier target's folder (its lock sits at the tier's top; "" the root)

    @property
    def lock_dir(self) -> str:
        """The folder whose lock file serialises runs into this target ("" = the
        destination directory, for a flat target: one lock for all of its deployments)."""
        if self.lock is not None:
            return self.lock
        return "" if self.flat else self.base_name

    @property
    def fam(self) -> Family:
        """The target engine's family object (its digest recipe, config comparison, header)."""
        return families.get(self.family)

    @property
    def config_bytes(self) -> bytes:
        return self.fam.config_json_bytes(self.fields)

    @property
    def digest(self) -> bytes:
        """Raw SHA-256 of the target identity (what vllm.cpp headers carry)."""
        return bytes.fromhex(self.fam.full_digest(self.fields))

    def counts(self) -> dict[str, dict[str, int]]:
        """blocks/bytes per creating action; a second source's block at a target path
        another source fills with the same bytes (a merge) is counted under `merge_duplicate`."""
        return {a: dict(v) for a, v in self._tally().counts.items()}

    def _tally(self) -> Tally:
        """The counts taken when the plan was built (`plan.ActionStream.tally`); a target
        with no actions (an empty list) has none."""
        tally = getattr(self.actions, "tally", None)
        if tally is not None:
            return tally
        if self.actions:
            raise TypeError("a target's counts come from the plan: its actions must be build_plan's ActionStream")
        return Tally()

    @property
    def pending(self) -> int:
        c = self.counts()
        return sum(c[a]["blocks"] for a in CREATING)

    @property
    def unverified_merges(self) -> int:
        """Merges whose equal bytes the manifest cannot prove (no content hashes, equal
        sizes): the apply compares them, and a difference is a conflict."""
        return self._tally().unverified

    def outcomes(self) -> dict[str, int]:
        """What `--apply` will report for this target if nothing changes meanwhile
        (changed_since_scan and failed are only known then)."""
        c = self.counts()
        return {"created": self.pending, "already_present": self.already_present[0] + c[MERGE]["blocks"],
                "conflict": sum(self.conflicts.values()), "changed_since_scan": 0,
                "skipped_needs_transform": sum(self.skipped.values()), "failed": 0}

    def transform_costs(self) -> dict[str, dict]:
        """Per transform: blocks, legacy bytes read, bytes written, estimated time, and
        the space saved (slice) or spent (concat, relayout); merge duplicates excluded."""
        totals = self._tally().transforms  # totalled when the plan was built
        return {a: transform_cost(a, *totals[a]) for a in TRANSFORMS if a in totals}


@dataclass
class Plan:
    root: str  # where the sources are (the scanned root)
    dest: str  # where targets go
    manifest_path: str | None
    target_profile: str
    metadata: dict[str, Any]
    targets: list[TargetPlan]
    untargeted: Counter  # reason -> blocks of namespaces with no target identity
    integrity_rows: int  # every row of the manifest with an integrity state (reported)
    status_counts: Counter
    # (target base, group) -> the block size competing sources are judged by (None: unknown)
    target_sizes: dict[tuple[str, int], int | None] = field(default_factory=dict)
    placed_integrity_rows: int = 0  # those of blocks the plan would place (exit bit 4)
    selection: Any = None  # --only/--exclude (kvmigrate.selection.Selection): the namespaces planned
    # (family title, action) -> blocks the scan planned whose migration this kvmigrate does not
    # apply yet (Mooncake stores, docs/mooncake.md): pending, never written
    not_built: Counter = field(default_factory=Counter)
    stores: list[Any] = field(default_factory=list)  # Mooncake stores' work (migrate/stores.StorePlan)

    @property
    def pending(self) -> int:
        return sum(t.pending for t in self.targets) + self.store_objects

    @property
    def store_objects(self) -> int:
        """Objects the stores' work places (rekeys and links)."""
        return sum(sum(p.objects.values()) for p in self.stores)

    @property
    def waiting_for_dest(self) -> tuple[int, int]:
        """(blocks, bytes) that only a run with --dest DIR places (NEEDS_DEST)."""
        hits = [(n, tp.skipped_bytes[key]) for tp in self.targets for key, n in tp.skipped.items()
                if key[1] in (NEEDS_DEST, NEEDS_DEST_TIER)]
        return sum(n for n, _ in hits), sum(b for _, b in hits)

    @property
    def holds_no_cache(self) -> bool:
        """The scanned root holds no cache at all: an empty or unmounted volume (manifest.holds_no_cache)."""
        return holds_no_cache(self.metadata, self.status_counts)

    @property
    def conflicts(self) -> int:
        """Blocks whose target path the scan found taken by other bytes."""
        return sum(sum(t.conflicts.values()) for t in self.targets)

    def outcomes(self) -> dict[str, int]:
        """The apply's outcomes as the dry run foresees them (`TargetPlan.outcomes`)."""
        out = dict.fromkeys(OUTCOMES, 0)
        for tp in self.targets:
            for k, n in tp.outcomes().items():
                out[k] += n
        out["created"] += self.store_objects
        return out

    def dry_run_exit_code(self) -> int:
        """interface.md §4: 1 if anything would be created (here, or with --dest DIR), +4 for
        conflicts it would meet or integrity states of blocks it would place. Other rows' findings are reported in
        the plan, not failed on (they are `audit`'s exit code)."""
        code = 1 if self.pending or self.waiting_for_dest[0] or self.not_built else 0  # (work waiting for --dest too)
        if self.placed_integrity_rows or self.conflicts:
            code |= 4
        return code


@dataclass
class Tally:
    """What planning learns about one target's actions without keeping them: the
    (source base, rank) groups to stream, counts per action, transform totals and the
    devices that `link` sources sit on (with a path on each, for messages)."""

    groups: set = field(default_factory=set)
    blocks: int = 0
    counts: dict[str, dict[str, int]] = field(
        default_factory=lambda: {a: {"blocks": 0, "bytes": 0} for a in (*CREATING, MERGE)})
    transforms: dict[str, list[int]] = field(default_factory=dict)  # action -> [blocks, source bytes, output bytes]
    link_devs: dict[int, str] = field(default_factory=dict)
    sizes: dict[int, Counter] = field(default_factory=dict)  # group -> output size -> blocks (all sources)
    competing: bool = False  # some target path has candidates from several rows (decided in a second pass)
    merges: set = field(default_factory=set)  # (source base, rank) groups with merges, streamed after the rest
    unverified: int = 0  # merges of equal sizes whose bytes the manifest cannot compare (checked at apply)
