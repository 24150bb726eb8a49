"""`--baseline PREV`: the previous manifest of this root, so a scheduled `--verify hash`
reads only what changed (fclones' `--cache`, jdupes' hash database).

A file whose dev, inode, size, mtime_ns and ctime_ns equal its baseline row keeps the
baseline's hashes without being opened (ctime cannot be set from user space: a rewrite
that restores size and mtime still moves it). `--recheck F` re-reads a rotating part of
those files anyway, by bucket (int(hhh, 16) % P == slot, P = 1/F, the slot one further
each run), so P runs cover the tree; a hash that changed under unchanged metadata is a
`silent_change` (disk or filesystem corruption).
"""

from __future__ import annotations

import os
import struct
from fractions import Fraction
from typing import Any

from kvmigrate import manifest
from kvmigrate.errors import UsageError
from kvmigrate.history import history_dir, kept_audits

# dev, inode, size, mtime_ns, ctime_ns (native int64: the C walk's BlockRows.carry reads
# them so), then the 16-byte content hash and, for vllm.cpp files, the payload hash
PACK = struct.Struct("=QQqqq16s")
DEFAULT_RECHECK = Fraction(1, 30)
# Rows whose hashes a run never takes over: what the read itself found (a later read may
# find otherwise), and rows the walk could not read or hash.
READ_FINDINGS = frozenset({"short", "zero_filled", "unreadable", "header_invalid", "silent_change"})
_COLUMNS = ("relpath", "dev", "inode", "size", "mtime_ns", "ctime_ns", "content_xxh3_128", "payload_xxh3_128",
            "status")


def parse_fraction(text: str) -> Fraction:
    """`--recheck F`: 1/30, 0.05, 0 (never) or 1 (every carried file)."""
    try:
        f = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        raise UsageError(f"--recheck must be a fraction between 0 and 1 (e.g. 1/30 or 0.05), got {text!r}") from None
    if not 0 <= f <= 1:
        raise UsageError(f"--recheck must be between 0 and 1, got {text!r}")
    return f


class Baseline:
    """A previous manifest of this root, checked, as a lookup {relpath: packed row}."""

    def __init__(self, path: str, meta: dict[str, Any], lookup: dict[str, bytes], recheck: Fraction):
        self.path = path
        self.meta = meta
        self.lookup = lookup
        self.recheck = recheck
        self.period = 0 if recheck == 0 else max(1, round(1 / recheck))
        previous = (meta.get("baseline") or {}).get("recheck_slot")
        self.slot = 0 if not self.period or previous is None else (int(previous) + 1) % self.period

    def rechecks(self, bucket: str | None) -> bool:
        """Files of this bucket are re-read this run (their hashes compared to the baseline's)."""
        if not self.period or bucket is None:
            return False
        return int(bucket, 16) % self.period == self.slot

    def unchanged(self, relpath: str, st: os.stat_result) -> bytes | None:
        """The packed baseline row of a file whose stat fields did not change, or None."""
        packed = self.lookup.get(relpath)
        if packed is None:
            return None
        if PACK.unpack_from(packed)[:5] != (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns):
            return None
        return packed

    def metadata(self) -> dict[str, Any]:
        return {"path": self.path, "tool_version": self.meta.get("tool_version"), "rows": len(self.lookup),
                "recheck": str(self.recheck), "recheck_period": self.period,
                "recheck_slot": self.slot if self.period else None}


def content_of(packed: bytes) -> tuple[bytes, bytes | None]:
    """(content hash, payload hash or None) of a packed baseline row."""
    return packed[40:56], packed[56:72] if len(packed) >= 72 else None


def load(spec: str, *, root: str, target: str, verify: str, recheck: Fraction,
         history: str | None = None) -> Baseline | None:
    """The baseline named by `--baseline` (a manifest, a dataset directory, or `auto`: the
    newest kept audit of ROOT), checked against this run; None for `auto` with no kept
    audit yet (the first run reads everything)."""
    if verify != "hash":
        raise UsageError(f"--baseline carries hashes over: it needs --verify hash (got --verify {verify})",
                         hint="add --verify hash, or drop --baseline")
    if spec == "auto":
        kept = kept_audits(history_dir(root, history))
        if not kept:
            return None
        path = str(kept[-1])
    else:
        path = os.path.abspath(spec)
        if not os.path.exists(path):
            raise UsageError("no such baseline manifest", path=path,
                             hint="pass a manifest written by `kvmigrate scan --verify hash`, or --baseline auto")
    rescan = f"rescan with `kvmigrate scan {root} --verify hash -o MANIFEST` and pass that manifest"
    version = _version(path)
    if version != manifest.MANIFEST_VERSION:
        raise UsageError(f"baseline refused: manifest format version {version}, a baseline needs version "
                         f"{manifest.MANIFEST_VERSION} (its ctime_ns column)", path=path, hint=rescan)
    meta = manifest.read_metadata(path)
    for key, ours, what in (("root", root, "cache root"), ("target_profile", target, "target profile")):
        if meta.get(key) != ours:
            raise UsageError(f"baseline refused: it is a scan of {what} {meta.get(key)!r}, this run's is {ours!r}",
                             path=path, hint="pass a manifest of this root and --target, or --baseline auto")
    if meta.get("verify") != "hash":
        raise UsageError(f"baseline refused: a --verify {meta.get('verify')} scan has no hashes to carry over",
                         path=path, hint=rescan)
    return Baseline(path, meta, _lookup(path), recheck)


def _version(path: str) -> Any:
    """The manifest_version of a manifest (the first part of a dataset directory)."""
    import json

    import pyarrow.parquet as pq

    try:
        files = manifest._parquet_files(path)
        raw = (pq.read_schema(files[0]).metadata or {}).get(manifest.META_KEY)
    except (OSError, ValueError) as exc:
        raise UsageError(f"baseline refused: cannot read it as a Parquet manifest ({exc})", path=path) from None
    if raw is None:
        raise UsageError("baseline refused: not a kvmigrate manifest (no kvmigrate metadata)", path=path)
    return json.loads(raw).get("manifest_version", 1)


def _lookup(path: str) -> dict[str, bytes]:
    """{relpath: packed row} of the rows whose hashes may be carried over."""
    lookup: dict[str, bytes] = {}
    pack = PACK.pack
    for batch in manifest.iter_batches(path, columns=_COLUMNS):
        cols = [batch.column(i).to_pylist() for i in range(len(_COLUMNS))]
        for rel, dev, ino, size, mtime, ctime, content, payload, status in zip(*cols):
            if content is None or ctime is None or status in READ_FINDINGS:
                continue
            packed = pack(dev, ino, size, mtime, ctime, content)
            lookup[rel] = packed + payload if payload is not None else packed
    return lookup
