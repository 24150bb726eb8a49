"""Typed findings: what a manifest row's `reason` says, as columns later stages read.

The `reason` column is for people; the plan, the cost estimate, the summary and the hints
read these columns instead (interface.md §2), so rewording a message changes no decision.
The scanner makes a row's reason with `reason(text, CODE, numbers...)`: a `Reason` is the
text plus its `Finding`, so the finding travels wherever the reason goes — into the C
walk's verdict values, whose index a row keeps — and the row store turns the findings of
its distinct reasons into columns when it builds the Arrow table (`arrays`).

A reason made as a plain `str` has no finding: the columns are null (the row's `status`
and `action` say all a reader needs).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

from kvmigrate import layout

# --- the finding codes (the `finding` column) -------------------------------------------

REPLICA_OF_PRIMARY = "replica_of_primary"
"""A block's other rank file: a copy of the `primary_rank` file, which carries the action."""
PART_OF_ACTION = "part_of_action"
"""A block's other rank file read by the `of_action` of the `primary_rank` row (concat, relayout)."""
ALIASES_SOURCE = "aliases_source"
"""The target path (`aliases_relpath`) is a source path holding other bytes: never written."""
TARGET_OCCUPIED = "target_occupied"
"""The target path `aliases_relpath` already holds other bytes than `of_action` would write
(or is not a regular file): a conflict for migrate, never overwritten."""
NEEDS_FACT = "needs_fact"
"""The block is not planned until the facts in `asks` are given."""
TRANSFORM = "transform"
"""A proven transform (the row's action) that writes `output_bytes` per block; a slice
keeps cell 0 of `row_cells` cells of `cell_bytes` bytes."""

SILENT_CHANGE = "silent_change"
"""Re-read under `--baseline --recheck`: the file's hash differs from its baseline row
although dev, inode, size, mtime and ctime did not change (disk or filesystem corruption)."""

SUPERSEDED = "superseded"
"""A Mooncake object no engine of the target layout reads: its block is held in full at the
target's own keys (an entry a migration retired, a key rank the target no longer reads)."""

CODES = (REPLICA_OF_PRIMARY, PART_OF_ACTION, ALIASES_SOURCE, TARGET_OCCUPIED, NEEDS_FACT, TRANSFORM, SILENT_CHANGE,
         SUPERSEDED)
SECONDARY = (REPLICA_OF_PRIMARY, PART_OF_ACTION)
"""Rows that only point at their block's primary row (the rank-row rule, migration.md §1)."""
ALIASING = (ALIASES_SOURCE, TARGET_OCCUPIED)


class Finding(NamedTuple):
    """The typed part of a reason; every number is None when the reason has none."""

    code: str
    primary_rank: int | None = None
    of_action: str | None = None
    cell_bytes: int | None = None
    row_cells: int | None = None
    output_bytes: int | None = None
    asks: str | None = None  # the fact flags the row waits for, space-separated ("--page-bytes --kv-kind")
    aliases_relpath: str | None = None


# The manifest columns, in schema order after `target_relpath` (kvmigrate.manifest.SCHEMA).
_DICT = pa.dictionary(pa.int32(), pa.string())
FIELDS = [
    pa.field("finding", _DICT),
    pa.field("primary_rank", pa.int32()),
    pa.field("of_action", _DICT),
    pa.field("cell_bytes", pa.int64()),
    pa.field("row_cells", pa.int32()),
    pa.field("output_bytes", pa.int64()),
    pa.field("asks", _DICT),
    pa.field("aliases_relpath", pa.string()),
]
COLUMNS = tuple(f.name for f in FIELDS)
assert COLUMNS[1:] == Finding._fields[1:] and COLUMNS[0] == "finding"


class Reason(str):
    """A row's reason text carrying its `Finding` (equal to, and hashed as, its text)."""

    __slots__ = ("finding",)
    finding: Finding | None

    def __new__(cls, text: str, finding: Finding | None = None) -> Reason:
        self = super().__new__(cls, text)
        self.finding = finding
        return self

    def __reduce__(self) -> tuple[Any, ...]:  # worker processes pickle verdicts
        return Reason, (str(self), self.finding)


def reason(text: str, code: str, **numbers: Any) -> Reason:
    """The reason `text` with its finding `code` and numbers (fields of `Finding`)."""
    return Reason(text, Finding(code, **numbers))


def finding_of(value: Any) -> Finding | None:
    """The finding a reason carries (None for a plain string, or no reason)."""
    return getattr(value, "finding", None)


def asks(*flags: str) -> str:
    """The `asks` value of a reason that names these fact flags."""
    return " ".join(flags)


def asked_flags(value: str | None) -> list[str]:
    """The flags of an `asks` column value."""
    return value.split() if value else []


# --- the columns of a batch of rows -------------------------------------------------------

def arrays(findings: list[Finding | None]) -> list[pa.Array]:
    """The finding columns (FIELDS order) of rows with these findings."""
    if not any(findings):  # (most batches: plain reasons only)
        return null_arrays(len(findings))
    cols: list[list[Any]] = [[] for _ in FIELDS]
    for f in findings:
        values = f if f is not None else (None,) * len(FIELDS)
        for col, v in zip(cols, values):
            col.append(v)
    out = []
    for field, column in zip(FIELDS, cols):
        a = _array(column, pa.string() if pa.types.is_dictionary(field.type) else field.type)
        out.append(a.dictionary_encode() if pa.types.is_dictionary(field.type) else a)
    return out


def _array(values: list[Any], typ: pa.DataType) -> pa.Array:
    """An Arrow column; a path that is not valid UTF-8 (a lone surrogate of an odd name) is
    shown escaped, as the scan shows it in `target_relpath`."""
    try:
        return pa.array(values, typ)
    except (UnicodeEncodeError, pa.ArrowException):
        if not pa.types.is_string(typ):
            raise
        return pa.array([layout.shown(v) if isinstance(v, str) else v for v in values], typ)


def arrays_by_code(reasons: list[Any], codes: pa.Array) -> list[pa.Array]:
    """The finding columns of rows whose reasons are `reasons[codes[i]]` (null codes: no
    reason): the C walk's rows keep a reason index; no Python object per row is made."""
    if not reasons:
        return null_arrays(len(codes))
    return [pc.take(a, codes) for a in arrays([finding_of(r) for r in reasons])]


def null_arrays(n: int) -> list[pa.Array]:
    return [pa.nulls(n, f.type) for f in FIELDS]


def without_occupied_path(text: str) -> str:
    """A `target_occupied` reason with its target path left out, so the dry run groups
    conflicts by cause: the path is the finding's `aliases_relpath`, not read from the text."""
    f = finding_of(text)
    if f is None or f.code != TARGET_OCCUPIED or not f.aliases_relpath:
        return str(text)
    return str(text).replace(f"target path {f.aliases_relpath}", "the target path", 1)
