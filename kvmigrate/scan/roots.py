"""Phases 1 and 2 of the scan: the top level of ROOT (`list_root`) and its namespaces
with config, digest, family, facts and target resolved (`resolve_namespaces`)."""

from __future__ import annotations

import os
import stat as stat_mod
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvmigrate import families, findings, layout
from kvmigrate.errors import FactsRefusedError, MissingFactError, UsageError
from kvmigrate.fsio import CHUNK, errno_reason, open_noatime
from kvmigrate.identity import canonical
from kvmigrate.identity.facts import Facts, FactsResolver
from kvmigrate.scan import tiers
from kvmigrate.scan.flat_spill import PageNames

SAMPLE_FILES = 64  # block sizes sampled per rank folder for family detection
CONFIG_MAX = 16 << 20  # engines write a config.json of a few KiB: a larger one is never read into memory
DEEP_RE_PREFIXES = ("block_size_",)


class FlatRowSource(Protocol):
    """A flat family's deployment's rows, made as the walk asks for them (scan/flat.py)."""

    def __bool__(self) -> bool: ...

    def tables(self, code: int, ns_arrays: list) -> Iterator[Any]: ...


@dataclass
class Namespace:
    """One namespace (base folder and/or rank folders) with what scan proved about it."""

    source_base: str
    safe_model: str
    d12: str
    has_base: bool
    rank_dirs: dict[int, str] = field(default_factory=dict)  # rank -> top-level folder name
    config_relpath: str | None = None
    fields: dict[str, Any] | None = None
    config_raw: bytes | None = None
    family: str | None = None
    family_evidence: list[str] = field(default_factory=list)
    scheme: str | None = None
    model_name: str | None = None
    digest_ok: bool | None = None
    digest: bytes | None = None  # full identity digest (raw), vllm.cpp header check
    config_error: str | None = None
    unknown_keys: list[str] = field(default_factory=list)
    deployment: str | None = None
    facts: Facts | None = None
    target: Any = None  # kvmigrate.identity.vllm_target.Target
    target_error: str | None = None
    target_error_flag: str | None = None
    target_refused_flag: str | None = None  # the flag whose stated facts refused the namespace
    status: str = "ok"
    status_reason: str = ""
    notes: list[str] = field(default_factory=list)
    sampled_sizes: list[int] = field(default_factory=list)  # rank 0's, for family evidence
    size_sample: dict[tuple[int, int], Counter] = field(default_factory=dict)  # (rank, group) -> sizes
    # a flat family's deployment: its files' records (scan/flat.py)
    flat_rows: list[Any] | FlatRowSource = field(default_factory=list)

    def columns(self) -> tuple:
        t = self.target
        return (self.family, self.scheme, self.model_name, self.d12, self.source_base,
                self.deployment or self.source_base,
                t.profile if t is not None else None,
                t.d12 if t is not None else None,
                t.base_name if t is not None else None)

    def metadata(self) -> dict[str, Any]:
        t = self.target
        facts = self.facts
        return {
            "family": self.family, "family_evidence": self.family_evidence, "scheme": self.scheme,
            "model_name": self.model_name, "source_d12": self.d12, "digest_ok": self.digest_ok,
            "config_json": self.fields, "config_error": self.config_error, "unknown_keys": self.unknown_keys,
            "ranks": sorted(self.rank_dirs), "rank_dirs": [self.rank_dirs[r] for r in sorted(self.rank_dirs)],
            "deployment": self.deployment or self.source_base,
            "facts": facts.to_dict() if facts is not None else {},
            "facts_source": dict(facts.sources) if facts is not None else {},
            "assumed_facts": dict(t.assumed_facts) if t is not None else {},
            "target": None if t is None else {
                "profile": t.profile, "family": t.family, "fields": t.fields, "d12": t.d12,
                "base_name": t.base_name, "rank_dir": t.rank_dir, "parallel_agnostic": t.parallel_agnostic,
                "replicated_layout": t.replicated_layout, "reasons": list(t.reasons),
                "unreachable": t.unreachable, "missing_facts": list(t.missing_facts),
                "decisive_assumptions": dict(t.decisive_assumptions),
                "writer_topology": t.writer_topology, "claims": list(t.claims)},
            "target_error": self.target_error, "target_error_flag": self.target_error_flag,
            "target_refused_flag": self.target_refused_flag,
            "status": self.status, "status_reason": self.status_reason, "notes": self.notes,
            "block_sizes": _modal_sizes(self.sampled_sizes),  # rank 0's sample (family evidence)
        }


class ListingNames:
    """Every entry name of the top level but a flat family's page files: those are held on
    disk (scan/flat_spill.py), and the one question asked of them, whether the name a page
    is read as exists, is answered beside the page (scan/flat.py)."""

    __slots__ = ("names",)

    def __init__(self, names: Any = ()) -> None:
        self.names: set[str] = set(names)

    def add(self, name: str) -> None:
        self.names.add(name)

    def __contains__(self, name: object) -> bool:
        return name in self.names


@dataclass
class RootListing:
    """The top level of ROOT, sorted into what each entry is."""

    bases: dict[str, os.DirEntry] = field(default_factory=dict)
    rank_folders: dict[str, dict[int, str]] = field(default_factory=dict)  # base -> rank -> dirname
    own_dirs: list[str] = field(default_factory=list)
    deep_dirs: list[str] = field(default_factory=list)
    foreign_dirs: list[str] = field(default_factory=list)
    files: list[os.DirEntry] = field(default_factory=list)  # top-level non-directories
    names: ListingNames = field(default_factory=ListingNames)
    # flat families (docs/families.md §3): family name -> the names of the page files it claims,
    # sorted (names only, and on disk past a few hundred thousand: scan/flat_spill.py)
    flat: dict[str, PageNames] = field(default_factory=dict)
    flat_temps: list[tuple[Any, os.DirEntry]] = field(default_factory=list)  # (family, temp file), in name order
    # temp file name -> its namespace columns: the family, and the deployment its name says
    # (scan/flat.py temp_columns); never a source_base (no page of a namespace)
    flat_temp_cols: dict[str, tuple] = field(default_factory=dict)
    flat_loose: list[Any] = field(default_factory=list)  # claimed files that could not be stat-ed
    # tier directories (scan/tiers.py, spec lmcache.md §1.1): folder name -> its family; the
    # root itself ("."): its family and the top-level entries its tier claims
    tiers: dict[str, Any] = field(default_factory=dict)
    root_tier: tuple[Any, list[os.DirEntry]] | None = None
    # Mooncake stores (families/mooncake.py, spec mooncake.md §1.1): folder name -> its
    # family ("." for ROOT itself); `store_entries`: the top-level names ROOT's store claims
    stores: dict[str, Any] = field(default_factory=dict)
    store_entries: set[str] = field(default_factory=set)


def _looks_deep(path: str, depth: int = 3) -> bool:
    """Old llm-d deep layout: `<model>/block_size_*/tp_*_pp_size_*_pcp_size_*/rank_*/...`
    (the model name is verbatim, so `org/model` nests one more level)."""
    try:
        with os.scandir(path) as it:
            subdirs = [e for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return False
    for e in subdirs:
        if e.name.startswith(DEEP_RE_PREFIXES):
            return True
    if depth > 1:
        return any(_looks_deep(e.path, depth - 1) for e in subdirs[:64])
    return False


def list_root(root: str, fsdir_of: Any = None) -> RootListing:
    """`fsdir_of(store)`: the file-per-key folder the facts name for a store (None: the
    default), by which a Mooncake store is recognised (mooncake.md §1.1)."""
    fsdir_of = fsdir_of or (lambda store: None)
    listing = RootListing()
    flat = [f for f in families.writers() if f.root_layout == "flat"]
    tier_fams = [f for f in families.writers() if f.root_layout == "tiers"]
    store_fams = [f for f in families.writers() if f.root_layout == "stores"]
    entries = []
    pages = {f.name: PageNames() for f in flat}
    with os.scandir(root) as it:
        for e in it:  # a flat family's page files keep only their name (see RootListing.flat)
            if flat and e.is_file(follow_symlinks=False):
                name = e.name
                fam = next((f for f in flat if f.claims_entry(name, False)), None)
                if fam is not None and not fam.is_temp(name):
                    pages[fam.name].add(name)
                    continue
            entries.append(e)
    listing.flat = {name: names.finish() for name, names in pages.items() if names}
    entries.sort(key=lambda e: e.name)
    for e in entries:
        listing.names.add(e.name)
        if not e.is_dir(follow_symlinks=False):
            fam = next((f for f in flat if e.is_file(follow_symlinks=False) and f.claims_entry(e.name, False)), None)
            if fam is not None:  # (a temp file: its pages are listed above)
                listing.flat_temps.append((fam, e))
            else:
                listing.files.append(e)
            continue
        if e.name == layout.OWN_DIR:
            listing.own_dirs.append(e.name)
            continue
        parsed = layout.parse_folder(e.name)
        if parsed is not None and parsed.rank is not None:
            listing.rank_folders.setdefault(parsed.base, {})[parsed.rank] = e.name
        elif parsed is not None:
            listing.bases[e.name] = e
        elif (store := next((f for f in store_fams if f.holds_store(e.path, fsdir_of(e.name))), None)) is not None:
            listing.stores[e.name] = store
        elif tier_fams and (tier := tiers.tier_family(e.path, tier_fams)) is not None:
            listing.tiers[e.name] = tier
        elif _looks_deep(e.path):
            listing.deep_dirs.append(e.name)
        else:
            listing.foreign_dirs.append(e.name)
    listing.flat_temps.sort(key=lambda fe: fe[0].name)  # (stable: by family, then name, as they were written)
    if tier_fams:
        _root_tier(listing, entries, tier_fams)
    for fam in store_fams:
        _root_store(root, listing, fam, fsdir_of("."))
    return listing


def _root_store(root: str, listing: RootListing, fam: Any, fsdir: str | None = None) -> None:
    """ROOT itself is a store (spec mooncake.md §1.1) when it is a client root or holds
    `rank_*` client roots: the entries of its layout move from the root's own rows (and
    from the stores found below it: a rank client root is part of ROOT's store) to it."""
    claimed = fam.root_store_entries(root, [e.name for e in listing.files],
                                     sorted(listing.foreign_dirs + list(listing.stores)), fsdir)
    if not claimed:
        return
    listing.files = [e for e in listing.files if e.name not in claimed]
    listing.foreign_dirs = [d for d in listing.foreign_dirs if d not in claimed]
    for name in claimed:
        listing.stores.pop(name, None)
    listing.stores["."] = fam
    listing.store_entries = claimed


def _root_tier(listing: RootListing, entries: list[os.DirEntry], tier_fams: list[Any]) -> None:
    """ROOT itself is a tier (spec lmcache.md §1.1) when its top-level files, or its GDS
    `<2>/<2>/` folders, hold chunk names: those entries (and the writer's temp names) move
    from the root's own rows to the tier's."""
    for fam in tier_fams:
        files = [e for e in listing.files if fam.is_tier_entry(e.name)]
        pairs = [e for e in entries if tiers.gds_folder(e.name) and (e.name in listing.tiers or e.name in
                                                                      listing.foreign_dirs) and tiers.gds_pair(e.path, fam)]
        chunk_file = any(fam.is_chunk_name(e.name) and e.is_file(follow_symlinks=False) for e in files)
        if not (chunk_file or pairs):
            continue
        claimed = {e.name for e in files} | {e.name for e in pairs}
        listing.files = [e for e in listing.files if e.name not in claimed]
        listing.foreign_dirs = [d for d in listing.foreign_dirs if d not in claimed]
        for e in pairs:  # a GDS tier's two-character folders belong to it, they are never tiers (§1.1)
            listing.tiers.pop(e.name, None)
        listing.root_tier = (fam, sorted(files + pairs, key=lambda e: e.name))
        return


def _read_config(root: str, ns: Namespace) -> None:
    """Read, parse and validate config.json; prove the digest against the folder name."""
    rel = f"{ns.source_base}/{layout.CONFIG_NAME}"
    path = os.path.join(root, rel)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        ns.status, ns.status_reason = "orphan_namespace", f"{rel} is missing"
        ns.config_error = "config.json missing"
        return
    except OSError as exc:
        ns.status, ns.status_reason = "config_invalid", errno_reason(exc, "cannot stat", rel)
        ns.config_error = ns.status_reason
        return
    ns.config_relpath = rel
    if not stat_mod.S_ISREG(st.st_mode):
        ns.status, ns.status_reason = "orphan_namespace", f"{rel} is not a regular file (never followed)"
        ns.config_error = "config.json is not a regular file"
        ns.config_relpath = None
        return
    too_big = (f"{rel} is larger than {CONFIG_MAX} bytes (an engine's config.json is a few KiB); not read, "
               "never migrated")
    if st.st_size > CONFIG_MAX:
        ns.status, ns.status_reason, ns.config_error = "config_invalid", too_big, too_big
        return
    try:
        fd = open_noatime(path)
        try:
            chunks = []
            n = 0
            while n <= CONFIG_MAX:  # it may grow while read
                b = os.read(fd, CHUNK)
                if not b:
                    break
                chunks.append(b)
                n += len(b)
            raw = b"".join(chunks)
        finally:
            os.close(fd)
        if n > CONFIG_MAX:
            ns.status, ns.status_reason, ns.config_error = "config_invalid", too_big, too_big
            return
    except OSError as exc:
        ns.status, ns.status_reason = "config_invalid", errno_reason(exc, "cannot read", rel)
        ns.config_error = ns.status_reason
        return
    ns.config_raw = raw
    try:
        fields = canonical.fields_from_config_bytes(raw)
    except ValueError as exc:
        ns.status, ns.status_reason = "config_invalid", f"{rel}: {exc}"
        ns.config_error = str(exc)
        return
    fam = families.of_identity(fields)  # whose rules (validation, digest recipe) read this identity
    problems = fam.source_problems(fields)
    if problems:
        ns.status = "config_invalid"
        ns.status_reason = f"{rel}: " + "; ".join(problems[:5])
        ns.config_error = "; ".join(problems)
        ns.fields = fields
        return
    ns.fields = fields
    ns.model_name = fields["model_name"]
    ns.scheme = fam.scheme_of(fields)
    digest_hex = fam.full_digest(fields)
    ns.digest = fam.target_digest(fields) if fam.header_len else None  # what its block headers carry
    ns.unknown_keys = fam.unknown_keys(fields)
    ns.notes += fam.config_notes(raw, fields)
    ns.deployment = fam.deployment(fields, ns.source_base)
    expected_base = layout.base_name(ns.model_name, digest_hex[:12])
    ns.digest_ok = expected_base == ns.source_base
    if not ns.digest_ok:
        ns.status = "digest_mismatch"
        if digest_hex[:12] != ns.d12:
            ns.status_reason = (f"digest mismatch: {rel} hashes to {digest_hex[:12]}, the folder name says "
                                f"{ns.d12}; never migrated")
        else:
            ns.status_reason = (f"digest mismatch: {rel} names model {ns.model_name!r}, the folder name says "
                                f"{ns.safe_model!r}; never migrated")


def _sample_sizes(root: str, rank_dir: str, limit: int = SAMPLE_FILES) -> list[tuple[int, int]]:
    """(group, size) of the first block files of a rank folder, in sorted bucket order.

    Deterministic and independent of --shard: it is the family evidence of S1 folders and
    the shared size reference that lets every shard judge odd sizes the same way.
    """
    sizes: list[tuple[int, int]] = []
    base = os.path.join(root, rank_dir)
    try:
        with os.scandir(base) as it:
            buckets = sorted(e.name for e in it if e.is_dir(follow_symlinks=False) and layout.BUCKET_RE.match(e.name))
    except OSError:
        return sizes
    for b in buckets:
        try:
            with os.scandir(os.path.join(base, b)) as it:
                fanouts = sorted(e.name for e in it
                                 if e.is_dir(follow_symlinks=False) and layout.FANOUT_RE.match(e.name))
        except OSError:
            continue
        for f in fanouts:
            fanout = layout.FANOUT_RE.match(f)
            assert fanout is not None  # (listed above only if it matches)
            group = int(fanout.group(2))
            try:
                with os.scandir(os.path.join(base, b, f)) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except OSError:
                continue
            for e in entries:
                if e.is_file(follow_symlinks=False) and layout.BLOCK_RE.match(e.name):
                    try:
                        sizes.append((group, e.stat(follow_symlinks=False).st_size))
                    except OSError:
                        continue
                    if len(sizes) >= limit:
                        return sizes
    return sizes


def _modal_sizes(sizes: list[int]) -> list[int]:
    """The most common block size(s) of a sample: one damaged file is not evidence."""
    if not sizes:
        return []
    counts = Counter(sizes).most_common()
    top = counts[0][1]
    return [s for s, n in counts if n == top and s > 0]


def resolve_namespaces(root: str, listing: RootListing, resolver: FactsResolver, profile: str) -> list[Namespace]:
    """Every namespace of the root with config, digest, family, facts and target resolved."""
    namespaces: list[Namespace] = []
    names = sorted(set(listing.bases) | set(listing.rank_folders))
    for base in names:
        parsed = layout.parse_folder(base)
        assert parsed is not None  # (the listing keeps folders whose names parse)
        ns = Namespace(base, parsed.safe_model, parsed.d12, has_base=base in listing.bases,
                       rank_dirs=dict(sorted(listing.rank_folders.get(base, {}).items())))
        if ns.has_base:
            _read_config(root, ns)
        else:
            ns.status = "orphan_namespace"
            ns.status_reason = f"rank folder without its base folder {base}/"
        if ns.has_base and not ns.rank_dirs and ns.status == "ok":
            ns.notes.append("no rank folder: the namespace holds no blocks")
        if ns.fields is not None and ns.status in ("ok", "digest_mismatch"):
            _resolve_identity(root, ns, resolver, profile)
        namespaces.append(ns)
    return namespaces


def _resolve_identity(root: str, ns: Namespace, resolver: FactsResolver, profile: str) -> None:
    fields = ns.fields
    assert fields is not None
    facts = resolver.for_namespace(ns.model_name or "", ns.source_base, fields)
    ns.facts = facts
    if families.of_identity(fields).block_bytes(fields) is None:  # sizes are evidence unless the identity gives them
        for rank, dirname in ns.rank_dirs.items():
            for group, size in _sample_sizes(root, dirname):
                ns.size_sample.setdefault((rank, group), Counter())[size] += 1
                if rank == 0:
                    ns.sampled_sizes.append(size)
    family, evidence = families.detect(fields, rank_numbers=list(ns.rank_dirs),
                                       block_sizes=_modal_sizes(ns.sampled_sizes), forced=facts.family)
    fam = families.get(family)
    ns.family, ns.family_evidence = family, list(evidence) + fam.detection_notes(fields, _modal_sizes(ns.sampled_sizes))
    if family == families.UNKNOWN:
        ns.status, ns.status_reason = "config_invalid", "config.json matches no known writer scheme"
        return
    out_of_scope = fam.unsupported(fields)
    if out_of_scope:
        ns.status, ns.status_reason = "unsupported_layout", out_of_scope
    elif fam.scheduler_rows and (facts.nnodes or 1) > 1:
        # the engine core wrote rows from its own node's region: the remote workers' slots
        # are missing from rows of full size (vllm#54415; vLLM 0.34 refuses such deployments)
        ns.status, ns.status_reason = "missing_slots", (
            f"written by a multi-node engine (nnodes {facts.nnodes}, from {facts.sources.get('nnodes', 'flag')}): "
            "its rows lack the remote ranks' slots (vllm#54415); never reused")
    if ns.status != "ok":
        return
    try:
        ns.target = families.compute_target(fields, family, facts, fam.target_profile(profile))
    except MissingFactError as exc:
        ns.target_error_flag = exc.flag
        ns.target_error = findings.reason(f"missing deployment fact '{exc.fact}': pass {exc.flag} "
                                          f"(or '{exc.fact}' for this namespace in --facts)", findings.NEEDS_FACT,
                                          asks=findings.asks(exc.flag))
    except FactsRefusedError as exc:
        ns.target_refused_flag = exc.flag
        ns.target_error = str(exc).split("\n")[0]
    except UsageError as exc:
        ns.target_error = str(exc).split("\n")[0]


def select_folders(listing: RootListing, selection: Any) -> tuple[RootListing, list[str]]:
    """The listing narrowed to the namespaces a selection (kvmigrate.selection) may keep,
    decided by folder name before anything in them is opened, and the bases it skipped.
    A filtered scan covers namespaces only: top-level files, foreign, deep and own folders
    are left out too (its manifest is partial). `names` stays whole: a target folder that
    exists is still seen."""
    keep = {b for b in set(listing.bases) | set(listing.rank_folders) if selection.by_folder(b) is not False}
    narrowed = RootListing(bases={b: e for b, e in listing.bases.items() if b in keep},
                           rank_folders={b: r for b, r in listing.rank_folders.items() if b in keep},
                           names=listing.names)
    return narrowed, sorted((set(listing.bases) | set(listing.rank_folders)) - keep)


def select_namespaces(namespaces: list[Namespace], selection: Any) -> tuple[list[Namespace], list[str]]:
    """The namespaces a selection keeps once their model name and target are known, and
    the bases it skipped (only their config.json was read)."""
    def names(ns: Namespace) -> list[str | None]:
        return [ns.model_name, ns.safe_model, ns.source_base, ns.target.base_name if ns.target is not None else None]

    kept = [ns for ns in namespaces if selection.admits(names(ns))]
    return kept, sorted(ns.source_base for ns in namespaces if ns not in kept)
