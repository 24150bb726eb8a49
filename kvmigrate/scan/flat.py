"""The files of a flat family (docs/families.md §3): one directory whose file names are
the identity (SGLang HiCache, docs/sglang.md). The roots phase sorts the claimed files of
the cache root here (`RootListing.flat`); `resolve` reads what the names and the facts
need (size, the first bytes the family asks for, the hash with --verify hash) and lets
the family group them into deployments, each a `Namespace` of its own (no base folder);
`rows` writes their rows in part 0 (no buckets to shard)."""

from __future__ import annotations

import os
from typing import Any

from kvmigrate import families
from kvmigrate.classify import FileRecord
from kvmigrate.fsio import Vanished, errno_reason, read_file
from kvmigrate.identity.facts import FactsResolver
from kvmigrate.scan.roots import Namespace, RootListing

HEAD_BYTES = 4  # enough for a zip magic


def resolve(root: str, listing: RootListing, resolver: FactsResolver, profile: str, verify: str) -> list[Namespace]:
    """The namespaces (deployments) of every flat family's files in the root."""
    out: list[Namespace] = []
    for name, entries in sorted(listing.flat.items()):
        fam = families.get(name)
        pages, others = [], []
        for e in entries:
            (others if fam.is_temp(e.name) else pages).append(e)
        flat_files, records = [], {}
        for e in pages:
            rec, ff = _read(fam, e, verify)
            if rec is None:
                continue
            if ff is None:  # could not even be stat-ed: a row of its own
                listing.flat_loose.append(rec)
                continue
            records[e.name] = rec
            flat_files.append(ff)
        entries.clear()  # (the records hold what the rows need: a million DirEntry objects less)
        deployments = fam.discover(flat_files, _facts_for(fam, resolver))
        names = listing.names
        for dep in deployments:
            ns = Namespace(dep.label, dep.model or "", "", has_base=False)
            ns.family = fam.name
            ns.family_evidence = [f"file names of the {fam.title} ({dep.scheme}): <hash64>[.pool]<suffix>.bin"]
            ns.scheme, ns.model_name, ns.deployment = dep.scheme, dep.model, dep.deployment
            ns.facts = dep.facts
            ns.notes = list(dep.notes)
            ns.fields = {"family": fam.name, "scheme": dep.scheme, "kv_kind": dep.kv_kind, "pool": dep.pool,
                         "model": dep.model, "writers": dep.reading.worker()[1]}
            ns.target = fam.target(ns.fields, dep.facts, fam.target_profile(profile))
            ns.flat_rows = []
            for row in fam.flat_verdicts(dep, names, verify == "hash"):
                rec = records[row["name"]]
                if rec.status == "ok":
                    rec.status, rec.reason, rec.action = row["status"], row["reason"], row["action"]
                    rec.target_relpath = row["target"]
                rec.rank, rec.group, rec.hex = row["rank"], 0, row["hex"]
                ns.flat_rows.append(rec)
            out.append(ns)
        listing.flat_temps.extend((fam, e) for e in others)
    return out


def _facts_for(fam: Any, resolver: FactsResolver):
    """facts of one suffix: FACTS.json by exact suffix, then model name (matched after the
    family's rewrite), then "*"; flags fill gaps."""
    keys = sorted(resolver.keys(), key=len, reverse=True)  # the longest model name that fits wins

    def facts_for(model: str | None, suffix: str):
        model_key = next((k for k in keys if k != "*" and fam.model_key_matches(k, suffix)), model)
        return resolver.for_namespace(model_key, suffix)  # (no model: only the suffix and "*" apply)
    return facts_for


def _read(fam: Any, e: os.DirEntry, verify: str) -> tuple[FileRecord | None, Any]:
    """A page file's record and what the family is shown of it (None, None: it vanished)."""
    try:
        st = e.stat(follow_symlinks=False)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        rec = FileRecord(e.name, None, None, None, 0, 0, 0, 0, 0)
        rec.status, rec.reason = "unreadable", errno_reason(exc, "cannot stat", e.name)
        return rec, None
    rec = FileRecord(e.name, None, None, None, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_nlink)
    ff = fam.flat_file(e.name, st.st_size)
    hashed = verify == "hash"
    if verify != "none" and (hashed or fam.wants_head(ff)) and st.st_size:
        try:
            r = read_file(e.path, want_hash=hashed, header_len=HEAD_BYTES)
        except Vanished:
            return None, None
        except OSError as exc:
            rec.status, rec.reason = "unreadable", errno_reason(exc, "cannot read", e.name)
            return rec, ff
        rec.content = r.content
        ff.head, ff.content, ff.all_zero = r.header, r.content, (r.all_zero if hashed else None)
    return rec, ff


def rows(walker: Any, listing: RootListing, namespaces: list[Namespace], out: Any) -> None:
    """Part 0's rows of the flat families: every page file with its deployment's columns,
    temp leftovers outside any namespace."""
    for ns in namespaces:
        cols = ns.columns()
        for rec in getattr(ns, "flat_rows", None) or ():
            walker.emit(out, rec, cols)
    for rec in listing.flat_loose:
        walker.emit(out, rec, None)
    for fam, e in listing.flat_temps:
        walker.other_file(e, e.name, out, where="the cache root", status="tmp_leftover",
                          reason=f"temp leftover of an interrupted {fam.title} write (never read by the engine)")
