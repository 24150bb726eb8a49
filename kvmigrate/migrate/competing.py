"""Competing sources: several source namespaces for one target path (e.g. TP=2 and TP=4
caches of one model), and the rule that decides which is placed.

The rule (decided here, at plan time, so that the dry run counts what the apply does;
never by name order): candidates with provably equal bytes (same inode, or equal
content hashes) are one block, placed once, the others merge (already_present). Of
differing candidates the one whose size is the target's is placed and each other is
a conflict; the target's size is the one its geometry gives (vllm.cpp: header +
page_size_bytes) or else the most common block size of the target's group over all of
its sources. No candidate of that size, or several that differ, and none is placed.
Equal sizes whose bytes the manifest cannot compare (no hashes): the first in merge
order is placed and the others are compared at apply (already_present or conflict).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from kvmigrate.cost import TRANSFORMS

if TYPE_CHECKING:
    from kvmigrate.migrate.model import Tally, TargetPlan

COMPETING = "competing source "  # prefix of the conflict cause of a competing source (`decide`)


class Candidate(NamedTuple):
    source_base: str
    rank: int
    relpath: str
    action: str
    out: int  # bytes the action writes
    group: int
    inode: tuple[int, int]
    digest: bytes | None  # the hash of what the output is made of (None: not comparable)


class Role(NamedTuple):
    role: str  # place | merge (the same bytes as the placed one) | check (compared at apply) | conflict
    cause: str
    source_base: str
    rank: int
    out: int


def geometry_size(tp: TargetPlan) -> int | None:
    """A block's size in the target as its identity gives it, if its family's identity
    states it (vllm.cpp's does; a vLLM row's size depends on the deployment that writes it)."""
    return tp.fam.block_bytes(tp.fields)


def target_sizes(targets: dict[str, TargetPlan], tallies: dict[str, Tally]) -> dict[tuple[str, int], int | None]:
    """(target base, group) -> the target's block size competing sources are judged by:
    its geometry's, else the most common output size over all its sources (None on a tie)."""
    out: dict[tuple[str, int], int | None] = {}
    for base, tal in tallies.items():
        known = geometry_size(targets[base])
        for group, hist in tal.sizes.items():
            ranked = hist.most_common(2)
            modal = ranked[0][0] if len(ranked) == 1 or ranked[0][1] > ranked[1][1] else None
            out[(base, group)] = known if known is not None else modal
    return out


def same_bytes(a: Candidate, b: Candidate) -> bool | None:
    """Whether two candidates write the same bytes: True, False, or None (unknown)."""
    if a.out != b.out:
        return False
    if a.action != b.action or a.action in TRANSFORMS:
        return None
    if a.inode == b.inode and a.inode != (0, 0):
        return True
    if a.digest is not None and b.digest is not None:
        return a.digest == b.digest
    return None


def decide(cands: list[Candidate], size: int | None) -> list[tuple[str, str]]:
    """(role, conflict cause) of each candidate for one target path, in merge order."""
    classes: list[list[int]] = []  # indices of provably equal candidates
    for i, x in enumerate(cands):
        for cl in classes:
            if same_bytes(cands[cl[0]], x):
                cl.append(i)
                break
        else:
            classes.append([i])
    # one size among them: nothing to choose by size (the bytes may still differ); else
    # only those of the target's size qualify
    one_size = len({x.out for x in cands}) == 1
    fitting = classes if one_size else [cl for cl in classes if cands[cl[0]].out == size]
    differ = any(same_bytes(cands[a[0]], cands[b[0]]) is False for a in fitting for b in fitting if a is not b)
    roles: list[tuple[str, str]] = [("", "")] * len(cands)
    if fitting and not differ:
        first = fitting[0]
        roles[first[0]] = ("place", "")
        for cl in fitting:
            for i in cl:
                if i != first[0]:
                    roles[i] = ("merge" if cl is first else "check", "")
    placed = any(r == "place" for r, _ in roles)
    fit = {i for cl in fitting for i in cl}
    for i, x in enumerate(cands):
        if roles[i][0]:
            continue
        if i in fit:  # of a qualifying size, but with other bytes than another one
            other = next(cands[j].source_base for j in fit if cands[j].digest != x.digest)
            why = f"other content than {other}; none placed"
        elif size is None:
            why = f"the target's size is unknown (no single most common size in group {x.group}); none placed"
        else:
            why = f"the target's size is {size}" + ("" if placed else "; none placed")
        roles[i] = ("conflict", f"{COMPETING}{x.source_base}: {x.out} bytes, {why}")
    return roles
