"""The rows of files outside buckets (part 0 of a sharded scan): top-level files,
.kvmigrate/, base folders, rank-folder top level, deep layouts and foreign folders."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pyarrow as pa
import xxhash

from kvmigrate import layout
from kvmigrate.scan import flat
from kvmigrate.scan.roots import Namespace, RootListing
from kvmigrate.scan.rows import Rows
from kvmigrate.scan.units import Member, Unit
from kvmigrate.scan.walker import Walker


def _folder_batches(walker: Walker, listing: RootListing) -> Iterator[Rows]:
    """The files of kvmigrate's own folders (journals, a prune's quarantine) and of foreign
    folders at the root, a batch of Rows at a time."""
    for d in listing.own_dirs:
        yield from walker.dir_batches(os.path.join(walker.root, d), d, status="own_artifact",
                                      reason="kvmigrate journal folder", where="kvmigrate folder")
    for d in listing.foreign_dirs:
        yield from walker.dir_batches(os.path.join(walker.root, d), d, status="foreign",
                                      reason="folder that is not a cache namespace: not part of the cache",
                                      where="the cache root")


def non_bucket_rows(walker: Walker, listing: RootListing, namespaces: list[Namespace],
                    units: list[Unit], shard: tuple[int, int]) -> list[Rows | Iterator[Rows | pa.Table]]:
    """Rows of files outside buckets: top-level files, .kvmigrate/, base folders
    (config.json, probe and config temp files), rank-folder top level, deep layouts and
    foreign folders. Everything here is part 0 (except bucket files of deep layouts).
    In written order: Rows, then kvmigrate's own and foreign folders as batches of Rows
    (a prune's quarantine: never one list of them), Rows, the flat families' pages as
    batches of Arrow tables (a million in one folder), then Rows of the base folders."""
    out = Rows()
    root = walker.root
    part0 = shard[0] == 0
    head: list[Rows | Iterator[Rows | pa.Table]] = []
    if part0:
        for e in listing.files:
            walker.other_file(e, e.name, out, where="the cache root")
        if listing.own_dirs or listing.foreign_dirs:  # walked as they are written, a batch at a time
            head += [out, _folder_batches(walker, listing)]
            out = Rows()
    for d in listing.deep_dirs:
        walker.dir_rows(os.path.join(root, d), d, out, status="unsupported_layout",
                        reason="old llm-d deep layout (<model>/block_size_*/tp_*_pp_size_*_pcp_size_*/rank_*): "
                               "out of scope", ns_cols=None, where="deep layout", shard=shard)
    for unit in units:
        for m in unit.members:
            _rank_top_level(walker, m, out, emit=part0)
    if not part0:
        return [out]
    flat_tables = flat.rows(walker, listing, namespaces, Rows())
    parts: list[Rows | Iterator[Rows | pa.Table]] = [*head, out, flat_tables]
    out = Rows()
    parts.append(out)
    cols_of = {ns.source_base: ns.columns() for ns in namespaces}
    for ns in namespaces:
        if not ns.has_base:
            continue
        base_path = os.path.join(root, ns.source_base)
        try:
            with os.scandir(base_path) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            walker.unlisted(base_path, ns.source_base, out, exc, cols_of[ns.source_base])
            continue
        for e in entries:
            rel = f"{ns.source_base}/{e.name}"
            if e.is_dir(follow_symlinks=False):
                walker.dir_rows(e.path, rel, out, status="foreign", reason="unexpected folder in a base folder",
                                ns_cols=cols_of[ns.source_base], where="base folder")
            elif e.name == layout.CONFIG_NAME and ns.config_relpath == rel:
                _config_row(walker, ns, e, rel, out, cols_of[ns.source_base])
            else:
                walker.other_file(e, rel, out, where="base folder", ns_cols=cols_of[ns.source_base])
    return parts


def _config_row(walker: Walker, ns: Namespace, entry: os.DirEntry, rel: str, out: Rows,
                ns_cols: tuple) -> None:
    rec = walker.entry_record(entry, rel, out)
    if rec is None:
        return
    if ns.status in ("config_invalid", "digest_mismatch", "missing_slots"):
        rec.status, rec.reason = ns.status, ns.status_reason
    elif ns.status == "unsupported_layout":
        rec.reason = f"identity proved, but the namespace is out of scope: {ns.status_reason}"
    else:
        parts = [f"identity of {ns.source_base} ({ns.family}, {ns.scheme}); digest proved"]
        if ns.target_error:
            parts.append(ns.target_error)
        parts.extend(ns.notes)
        rec.reason = "; ".join(parts)
    if walker.hashed and ns.config_raw is not None:
        rec.content = xxhash.xxh3_128_digest(ns.config_raw)
    walker.emit(out, rec, ns_cols)


def _rank_top_level(walker: Walker, m: Member, out: Rows, *, emit: bool) -> None:
    """List a rank folder's top level once: its bucket names for the walk (every shard)
    and, in part 0, rows for anything else in it."""
    path = os.path.join(walker.root, m.dirname)
    try:
        with os.scandir(path) as it:
            entries = sorted(it, key=lambda e: e.name)
    except FileNotFoundError:
        return
    except OSError as exc:
        if emit:
            walker.unlisted(path, m.dirname, out, exc, m.columns)
        return
    for e in entries:
        if e.is_dir(follow_symlinks=False) and layout.BUCKET_RE.match(e.name):
            m.buckets.add(e.name)
            continue
        if not emit:
            continue
        rel = f"{m.dirname}/{e.name}"
        if e.is_dir(follow_symlinks=False):
            walker.dir_rows(e.path, rel, out, status="foreign", reason="unexpected folder in a rank folder",
                            ns_cols=m.columns, where="rank folder")
        else:
            walker.other_file(e, rel, out, where="rank folder", ns_cols=m.columns)
