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
from dataclasses import dataclass, field
from typing import Iterable

from kvmigrate import layout
from kvmigrate.findings import (ALIASES_SOURCE, NEEDS_FACT, PART_OF_ACTION, REPLICA_OF_PRIMARY, TRANSFORM, Reason,
                                asks)
from kvmigrate.findings import reason as finding_reason

PAGE = 4096
LEGACY_FLOOR = 16 * 1024 * 1024  # llm-d builds before 2026-06-04 padded files to >= 16 MiB
VLLMCPP_HEADER = 128

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
    "unreadable": 1 | 8,
    "tmp_leftover": 1,
    "own_artifact": 0,
    "foreign": 1,
    "orphan_namespace": 1,
    "digest_mismatch": 1 | 4,
    "config_invalid": 1 | 4,
    "unsupported_layout": 1,
}
STATUSES = tuple(STATUS_BITS)

ACTIONS = ("already_present", "link", "copy_pad", "rewrite_header", "slice", "concat", "relayout",
           "needs_slice", "needs_concat", "needs_relayout", "none")
# Actions whose bytes come from one replica: the other ranks are "replica of rank 0".
REPLICA_ACTIONS = ("already_present", "link", "copy_pad", "rewrite_header", "slice", "needs_slice")

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

    family: str  # vllm | llmd | vllmcpp | ambiguous | unknown
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
    vllmcpp_payload: int | None = None  # page_size_bytes of the identity
    target: TargetInfo | None = None
    # namespace-wide verdicts
    block_status: str | None = None  # status every block row gets (orphan_namespace, digest_mismatch, ...)
    block_reason: str | None = None
    absent_ranks: tuple[int, ...] = ()  # vllm.cpp ranks whose namespace is missing or invalid
    none_reason: str | None = None  # every block gets action none with this reason (e.g. missing fact)
    ambiguity_harmless: bool = False  # S1 ambiguous but both readings give the same bytes
    hashed: bool = False  # scan --verify hash: content hashes available

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


# ---------------------------------------------------------------------------------------
# File-level rules


def size_status(plan: UnitPlan, group: int, size: int) -> tuple[str, str] | None:
    """What a block file's size alone proves (None: nothing wrong).

    formats.md §2: vLLM rows are multiples of 4096 (and match the proven geometry);
    llm-d files hold exactly B x T x P bytes (a 16 MiB file with less proven data is the
    old padding floor); vllm.cpp files are exactly 128 + page_size_bytes.
    """
    if size == 0:
        return "short", "empty file"
    fam = plan.family
    if fam == "vllmcpp":
        if size < VLLMCPP_HEADER:
            return "short", f"{size} bytes, shorter than the {VLLMCPP_HEADER}-byte header"
        if plan.vllmcpp_payload is not None and size != VLLMCPP_HEADER + plan.vllmcpp_payload:
            return "size_mismatch", (f"size {size}, expected {VLLMCPP_HEADER} + page_size_bytes "
                                     f"{plan.vllmcpp_payload} = {VLLMCPP_HEADER + plan.vllmcpp_payload}")
        return None
    if fam == "vllm":
        if size % PAGE:
            return "size_mismatch", f"size {size} is not a multiple of {PAGE} (vLLM pads every row)"
        expected = plan.expected_row_bytes(group)
        if expected is not None and size != expected:
            return "size_mismatch", f"size {size} differs from the {expected} bytes the proven row geometry gives"
        return None
    if fam == "llmd":
        data = plan.data_bytes(group)
        if data is None or size == data:
            return None
        if size == LEGACY_FLOOR and data < LEGACY_FLOOR:
            return "padded_legacy", (f"padded to the old 16 MiB floor: the {size}-byte file holds {data} "
                                     "bytes of proven data (B x T x P) followed by stale bytes")
        return "size_mismatch", f"size {size} differs from the {data} bytes the proven geometry B x T x P gives"
    return None


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


def _ranks_text(ranks: Iterable[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


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
        what = "payloads" if plan.family == "vllmcpp" else "contents"
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
    """Compare content hashes (vllm.cpp: payload hashes, headers differ by design) when
    taken, else sizes."""
    def key(r: FileRecord):
        if plan.hashed:
            h = r.payload if plan.family == "vllmcpp" else r.content
            if h is not None:
                return h
        return r.size

    return len({key(r) for r in recs}) > 1


def target_relpath(target: TargetInfo, hex_hash: str, group: int) -> str:
    return f"{target.rank_dir}/{layout.block_relpath_in_rank(hex_hash, group)}"


def _verified_note(plan: UnitPlan) -> str:
    return "replica hashes verified equal" if plan.hashed else UNVERIFIED


def plan_action(plan: UnitPlan, recs: list[FileRecord], group: int, hex_hash: str) -> tuple[str, str]:
    """(action, reason) of a complete, healthy block, before looking at the target path."""
    if plan.none_reason:
        return "none", plan.none_reason
    t = plan.target
    if t is None:
        return "none", "no target identity for this namespace"
    if t.unreachable:
        return "none", t.unreachable
    by_rank = sorted(recs, key=lambda r: r.rank)
    first = by_rank[0]
    n = len(plan.expected_ranks)
    fam = plan.family

    if fam == "ambiguous" and not plan.ambiguity_harmless:
        return "none", finding_reason("family ambiguous (S1 written by vLLM or llm-d, and the two readings give "
                              "different bytes here): pass --family vllm|llmd", NEEDS_FACT, asks=asks("--family"))
    if fam == "vllm" or fam == "ambiguous":
        note = ""
        if fam == "ambiguous":
            if first.size % PAGE:
                return "none", finding_reason(f"family ambiguous and {first.size} bytes is not a multiple of {PAGE} "
                                      "(suggests llm-d): pass --family vllm|llmd", NEEDS_FACT, asks=asks("--family"))
            note = " (family ambiguous, but both readings give the same bytes)"
        mla_direct = (plan.kv_kind == "mla" and plan.world > 1 and not plan.source_replicated
                      and not plan.source_canonical)
        if mla_direct and t.replicated_layout:
            return _slice_plan(plan, first, group)
        return "link", f"re-key of the same deployment's row into {t.base}{note}"

    if fam == "llmd":
        b = plan.blocks_per_file or 0
        if b > 1:
            return _relayout_plan(plan, by_rank, group)
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
        return _concat_plan(plan, by_rank, group)

    if fam == "vllmcpp":
        if n == 1:
            if t.rank_dir == plan.rank_dirs.get(first.rank):
                return "link", "single-rank vllm.cpp cache: already in place"
            return "rewrite_header", f"identity digest changes: new header for {t.base}"
        if plan.kv_kind == "mla":
            if not t.replicated_layout:
                return "none", "vllm.cpp MLA deployment is not collapsible under the target (replicated gate failed)"
            return "rewrite_header", (f"MLA payloads equal on all {n} ranks: rank 0's payload under the collapsed "
                                      f"replicated identity {t.base}; "
                                      + ("payload hashes verified equal" if plan.hashed else UNVERIFIED))
        return "none", "rank-private shard: each rank's payload is its own shard; no reader can use a collapsed copy"

    return "none", f"unknown writer family {fam!r}"


def slice_reason(n: int, cell: int, proof: str) -> Reason:
    """The reason of a proven slice, with the numbers migrate and the reports read (its
    finding: cell 0 of `row_cells` cells of `cell_bytes`, `output_bytes` written)."""
    return finding_reason(f"slice: cell 0 of {n} (cell {cell} bytes; {proof}) + pad to {pad_to_page(cell)} bytes", TRANSFORM,
                  cell_bytes=cell, row_cells=n, output_bytes=pad_to_page(cell))


def _slice_plan(plan: UnitPlan, first: FileRecord, group: int) -> tuple[str, str]:
    """slice when the cell size is proven by the facts (the N cells themselves are compared
    when the transform runs, or by scan --verify hash); needs_slice with the numbers found."""
    n = plan.world
    size = first.size
    layers = plan.layers.get(group)
    if plan.page_bytes and layers and plan.blocks_per_file:
        c = layers * plan.page_bytes * plan.blocks_per_file
        if n * c <= size < n * c + PAGE:
            return "slice", slice_reason(n, c, f"from facts: {layers} layers x {plan.page_bytes} page bytes x "
                                               f"{plan.blocks_per_file} blocks per file; {n} equal cells and a "
                                               "zero tail are checked before it is cut")
        return "needs_slice", (f"needs_slice: facts and data disagree: c = {layers} x {plan.page_bytes} x "
                               f"{plan.blocks_per_file} = {c}, but {n} x c does not fit the {size}-byte row")
    lo = max(1, (size - PAGE) // n + 1)
    hi = size // n
    # both ways to prove it: the fact, or a hashing scan that finds the one c giving N equal
    # cells (`kvmigrate migrate ROOT` scans so by default); ";" ends what the reports read as
    # the facts asked for ("pass ...")
    return "needs_slice", finding_reason(f"needs_slice: {size}-byte row, N={n} cells, cell size unknown: {n}*c <= {size} < "
                                 f"{n}*c + {PAGE} allows c in {lo}..{hi} (pass --page-bytes; or scan with --verify "
                                 "hash, as `kvmigrate migrate ROOT` does, to prove it from the replicas)", NEEDS_FACT,
                                 asks=asks("--page-bytes"))


def _concat_plan(plan: UnitPlan, by_rank: list[FileRecord], group: int) -> tuple[str, str]:
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


def _relayout_plan(plan: UnitPlan, by_rank: list[FileRecord], group: int) -> tuple[str, str]:
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
