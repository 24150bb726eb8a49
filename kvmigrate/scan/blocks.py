"""Phase 4 of the scan, per block: the block-level half of the `Walker` (its base class).

A bucket's block files, once stat-ed or read, are classified (`kvmigrate.classify`) and
placed, sorted by (group, hash). A block whose files are all fine by themselves gets the
verdict of its shape, computed once per unit and replayed (in C by the leaf walk's
`finish_blocks` where it is built); the answers that need I/O (does the target path
already hold these bytes, which cell size does a row admit) are asked here."""

from __future__ import annotations

import os
import stat as stat_mod
from collections.abc import Callable
from typing import Any

import xxhash

from kvmigrate import classify, findings
from kvmigrate.classify import FileRecord, UnitPlan
from kvmigrate.formats import vllmcpp
from kvmigrate.fsio import Vanished, kind_of, read_all, read_file
from kvmigrate.scan.roots import RootListing
from kvmigrate.scan.rows import Rows
from kvmigrate.scan.units import Unit

VERDICTS_KEPT = 4096  # block shapes (and sizes) whose verdict a walk remembers: a namespace has a few


def expected_output_digest(action: str, src: str, *, new_digest: bytes | None = None) -> bytes | None:
    """XXH3-128 of the file an action would write from `src` (to recognise a target that
    already holds it): link = the source bytes, copy_pad = + zero pad to 4096,
    rewrite_header = the new header + the payload."""
    try:
        if action == "link":
            return read_file(src, want_hash=True).content
        data = read_all(src, 1 << 32)
    except (Vanished, OSError):
        return None
    if data is None:
        return None
    if action == "copy_pad":
        return xxhash.xxh3_128_digest(data + bytes(-len(data) % classify.PAGE))
    if action == "rewrite_header" and new_digest is not None and len(data) >= vllmcpp.HEADER_SIZE:
        return xxhash.xxh3_128_digest(vllmcpp.rewrite_header(data, new_digest) + data[vllmcpp.HEADER_SIZE:])
    return None


class BlockVerdicts:
    """Block verdicts of a walk; the `Walker` gives the state they read."""

    root: str
    verify: str
    hashed: bool
    listing: RootListing
    leaf: Any  # kvmigrate._leafwalk, or None
    transform_output: Callable[[str, UnitPlan, FileRecord], tuple[int, Callable[[], bytes | None]]]
    _slice_cache: dict[tuple[int, int, int], tuple[str, str] | None]

    def _checks_size(self, unit: Unit) -> bool:
        """Are block sizes judged file by file here (the namespace has no verdict of its own)?"""
        return self.verify != "none" and unit.plan.block_status is None

    def _size_verdict(self, unit: Unit, group: int, size: int) -> tuple[str, str] | None:
        """classify.size_status of (group, size), kept per unit (a namespace has a few sizes)."""
        key = (group, size)
        try:
            return unit.size_verdicts[key]
        except KeyError:
            bad = classify.size_status(unit.plan, group, size)
            if len(unit.size_verdicts) < VERDICTS_KEPT:
                unit.size_verdicts[key] = bad
            return bad

    def _finish_blocks(self, unit: Unit, blocks: dict[tuple[int, str], list[int]], out: Rows) -> None:
        """Classify a bucket's blocks and place their rows, sorted by (group, hash).

        A block whose files are all fine by themselves gets the verdict of its shape
        (group, ranks, sizes, whether replicas differ), computed by classify once per
        unit; only the target path (and, if the target folder exists, the check of what
        is there) is per block. Other blocks are classified one by one.
        """
        plan = unit.plan
        fast = plan.fam.header_len == 0  # no header to check per file: one verdict per shape
        count_sizes = plan.block_status is None and plan.fam.majority_sizes
        shapes: dict[tuple, int] = {}
        if fast and self.leaf is not None:
            self._finish_blocks_c(unit, blocks, out, shapes if count_sizes else None)
        else:
            if out.store is not None:
                out.store.export_blocks(blocks)
            self._finish_blocks_py(unit, blocks, out, shapes if count_sizes else None)
        if shapes:
            base = unit.members[0].ns.source_base
            for (group, ranks, sizes, _), n in shapes.items():
                for rank, size in zip(ranks, sizes):
                    out.sizes[(base, rank, group)][size] += n

    def _finish_blocks_py(self, unit: Unit, blocks: dict[tuple[int, str], list[int]], out: Rows,
                          shapes: dict[tuple, int] | None) -> None:
        plan = unit.plan
        verdicts = unit.verdicts
        fast = plan.fam.header_len == 0
        replicas = bool(plan.replicas)
        count_sizes = shapes is not None
        target = plan.target
        S, A, R, T = out.status, out.action, out.reason, out.target
        K, Z, C, P = out.rank, out.size, out.content, out.relpath
        order = out.order
        targets_exist = unit.targets_exist
        for key in sorted(blocks):
            idx = blocks[key]
            group, hex_hash = key
            order.extend(idx)
            if not fast or any([S[i] != "ok" for i in idx]):
                self._finish_one(unit, out, idx, group, hex_hash, count_sizes)
                continue
            differ = replicas and len({Z[i] if C[i] is None else C[i] for i in idx}) > 1
            shape = (group, tuple([K[i] for i in idx]), tuple([Z[i] for i in idx]), differ)
            verdict = verdicts.get(shape)
            if verdict is None:
                verdict = self._shape_verdict(unit, out, idx, group, hex_hash, shape)
            tpath = None
            for i, (status, action, reason, has_target) in zip(idx, verdict):
                S[i], A[i], R[i] = status, action, reason
                if has_target:
                    if tpath is None:  # once per block: every replica has the same target
                        assert target is not None  # (a verdict with a target is one of a namespace with one)
                        tpath = classify.target_relpath(target, hex_hash, group)
                    T[i] = tpath
                    if targets_exist and tpath != P[i]:
                        self._target_exists(unit, out, i, hex_hash)
            if shapes is not None:  # count_sizes
                shapes[shape] = shapes.get(shape, 0) + 1

    def _finish_blocks_c(self, unit: Unit, blocks: dict[tuple[int, str], list[int]], out: Rows,
                         shapes: dict[tuple, int] | None) -> None:
        """_finish_blocks_py in C (kvmigrate._leafwalk.finish_blocks), with the same
        callbacks for what needs classify or I/O."""
        plan = unit.plan
        target = plan.target

        def shape_verdict(idx: list[int], group: int, hex_hash: str, shape: tuple) -> tuple:
            return self._shape_verdict(unit, out, idx, group, hex_hash, shape)

        prefix = f"{target.rank_dir}/" if target is not None else ""
        slow, check = self.leaf.finish_blocks(blocks, out.columns(), out.store, out.order, unit.verdicts, shape_verdict,
                                              bool(plan.replicas), prefix, unit.targets_exist, shapes)
        for group, hex_hash in slow:
            self._finish_one(unit, out, blocks[(group, hex_hash)], group, hex_hash, shapes is not None)
        for i, hex_hash in check:
            self._target_exists(unit, out, i, hex_hash)

    def _shape_verdict(self, unit: Unit, out: Rows, idx: list[int], group: int, hex_hash: str,
                       shape: tuple) -> tuple:
        """The verdict of a block shape, per row (status, action, reason, has a target):
        classify once, then kept for the unit."""
        recs = [out.record(i, hex_hash) for i in idx]
        self.finish_block(unit, recs, group, hex_hash, check_target=False)
        verdict = tuple((r.status, r.action, r.reason, r.target_relpath is not None) for r in recs)
        if len(unit.verdicts) < VERDICTS_KEPT:
            unit.verdicts[shape] = verdict
        return verdict

    def _target_exists(self, unit: Unit, out: Rows, i: int, hex_hash: str) -> None:
        """Row i's target path is taken (the target folder exists): what is there decides."""
        rec = out.record(i, hex_hash)
        self._check_existing_target(unit.plan, rec)
        out.set_verdict(i, rec.status, rec.action, rec.reason, rec.target_relpath)

    def _finish_one(self, unit: Unit, out: Rows, idx: list[int], group: int, hex_hash: str,
                    count_sizes: bool) -> None:
        recs = [out.record(i, hex_hash) for i in idx]
        fine = [r.status == "ok" for r in recs]
        self.finish_block(unit, recs, group, hex_hash)
        for i, r, ok in zip(idx, recs, fine):
            out.set_verdict(i, r.status, r.action, r.reason, r.target_relpath)
            if ok and count_sizes:
                out.sizes[(unit.members[0].ns.source_base, r.rank, group)][r.size] += 1

    def finish_block(self, unit: Unit, recs: list[FileRecord], group: int, hex_hash: str, *,
                     check_target: bool = True) -> None:
        """Block rules (classify) plus the two answers that need I/O: does the target
        path already hold these bytes, and which cell sizes does a row admit."""
        plan = unit.plan
        classify.classify_block(plan, recs, group, hex_hash)
        first = next((r for r in recs if r.target_relpath), None)
        if first is None:
            return
        if first.action in ("slice", "needs_slice") and self.hashed:
            first.action, first.reason = self._slice_reason(unit, first, group) or (first.action, first.reason)
        if not check_target:
            return
        target_dir = (first.target_relpath or "").split("/", 1)[0]  # (set: `first` was chosen by it)
        if target_dir not in self.listing.names or first.target_relpath == first.relpath:
            return
        self._check_existing_target(plan, first)

    def _slice_reason(self, unit: Unit, first: FileRecord, group: int) -> tuple[str, str] | None:
        """Search the row's data for the cell size (kvmigrate.transforms proves it or lists
        the candidates); once per (unit, group, size): the geometry is the namespace's."""
        from kvmigrate.transforms import find_slice_cell

        plan = unit.plan
        key = (unit.index, group, first.size)
        if key in self._slice_cache:
            return self._slice_cache[key]
        data = read_all(os.path.join(self.root, first.relpath), 1 << 30)
        reason = None
        if data is not None:
            layers = plan.layers.get(group)
            known = (layers * plan.page_bytes * plan.blocks_per_file
                     if plan.page_bytes and layers and plan.blocks_per_file else None)
            search = find_slice_cell(data, n=plan.world, known_cell=known)
            if search.cell is None:
                reason = "needs_slice", search.reason
            else:
                reason = "slice", classify.slice_reason(plan.world, search.cell, f"{search.reason} in a sample row "
                                                        "of this size; each row is checked again before it is cut")
        self._slice_cache[key] = reason
        return reason

    def _check_existing_target(self, plan: UnitPlan, rec: FileRecord) -> None:
        tpath = os.path.join(self.root, rec.target_relpath or "")
        try:
            tst = os.lstat(tpath)
        except OSError:
            return
        action = rec.action
        if not stat_mod.S_ISREG(tst.st_mode):
            rec.action, rec.reason = "none", findings.reason(
                f"aliases_source: target path {rec.target_relpath} exists and is a {kind_of(tst.st_mode)}; use "
                "--dest DIR", findings.TARGET_OCCUPIED, of_action=action, aliases_relpath=rec.target_relpath)
            rec.target_relpath = None
            return
        if (tst.st_dev, tst.st_ino) == (rec.dev, rec.inode):
            rec.action, rec.reason = "already_present", "the target path is a hard link of this file"
            return
        if action.startswith("needs_"):
            rec.reason = findings.Reason(f"{rec.reason}; the target path already exists (compared when the "
                                         "transform runs)", findings.finding_of(rec.reason))
            return
        src = os.path.join(self.root, rec.relpath)
        expected_size = rec.size
        if action == "copy_pad":
            expected_size = classify.pad_to_page(rec.size)
        same = False
        transform_digest = None
        if action in ("slice", "concat", "relayout"):
            expected_size, transform_digest = self.transform_output(self.root, plan, rec)
        if tst.st_size == expected_size:
            new_digest = plan.target.digest if plan.target else None
            want = transform_digest() if transform_digest else rec.content if action == "link" and rec.content else \
                expected_output_digest(action, src, new_digest=new_digest)
            try:
                got = read_file(tpath, want_hash=True).content
            except (Vanished, OSError):
                got = None
            same = want is not None and want == got
        if same:
            rec.action, rec.reason = "already_present", f"the target path already holds the bytes {action} would write"
        else:
            rec.action, rec.reason = "none", findings.reason(
                f"aliases_source: target path {rec.target_relpath} already exists with other bytes than {action} "
                "would write; never overwritten (use --dest DIR)", findings.TARGET_OCCUPIED, of_action=action,
                aliases_relpath=rec.target_relpath)
            rec.target_relpath = None
