"""LMCache disk tiers: `local_disk`, `fs` (FSConnector), `gds` (GdsBackend) and `mp` (the
MP server's FS L2 adapter), written by the `lmcache` wheels 0.3.0 … 0.5.6 and 0.5.7rc2
(spec lmcache.md; research notes R1 `lmcache-format.md`, R2 `lmcache-format-2.md`).

A *tier directory* is what one backend was configured with, shared by every rank of every
deployment: no base folder, no rank folder, no config.json; the file names are the keys
(§1.2, §1.3). Every name, key, header and size verdict is read through
`kvmigrate/formats/lmcache.py`, the one grammar; this module groups a tier's files into
deployments (§4: `lmcache:<tier>:<backend>:<model>:<scheme>:ws<ws>[:<dtype>][:<tags>]`,
MP `…:lmc-mp1:ws<ws>:g<group>`) and gives every file its status in §4's order.

This step plans nothing: every row's action is `none` with a reason (`already_present`,
`link` and `reshard` come next), so a scan is honest and never plans a wrong placement. The
§3.3 facts decide §3.2's reachability verdicts (`recipe_verdict`): `unreproducible_hash`,
`stale_hash_recipe` from the facts, or a `needs_fact` finding asking for the facts a
name's recipe needs. The scan side (finding the tiers,
reading the files) is `kvmigrate/scan/tiers.py` and `kvmigrate/scan/tier_rows.py`.
"""

from __future__ import annotations

import struct
from collections import ChainMap, Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvmigrate import families, layout
from kvmigrate import findings as fd
from kvmigrate.families import lmcache_plan as P
from kvmigrate.families.lmcache_plan import deployment_label

# §3.2's recipe components (families/lmcache_recipe.py, shared with the report's metadata)
from kvmigrate.families.lmcache_recipe import SEEDLESS_RANDOM as _SEEDLESS_RANDOM
from kvmigrate.families.lmcache_recipe import algorithm as _algorithm
from kvmigrate.families.lmcache_recipe import chain_era as _chain_era
from kvmigrate.families.lmcache_recipe import none_hash as _none_hash
from kvmigrate.families.lmcache_recipe import py_hash_era as _py_hash_era
from kvmigrate.formats import lmcache as L
from kvmigrate.identity.facts import Facts
from kvmigrate.identity.values import FACT_FLAGS, LMCACHE_PROFILES
from kvmigrate.identity.vllm_target import Target

PROFILES = LMCACHE_PROFILES  # §0: same names, bytes and lookups
DEFAULT_PROFILE = PROFILES[0]
HEAD_BYTES = 8192  # a GDS header (4096) and a sidecar a little longer than one
_V0_PT_HEAD = 10  # a v0 `.pt`'s 8-byte header length, then `{}` at the least (`_looks_v0_pt`)
SIDECAR_MARK = b"/metadata"  # appended to a sidecar's chunk hash inside a plan (flat_page_hex)


@dataclass(slots=True)
class TierFile:
    """One file under a tier as the scan read it. `folders`: its folders inside the tier
    (a GDS `<2>/<2>` pair, or none); `head`: its first bytes (None: not read, --verify
    none); `all_zero`: every byte zero (None: not known); `error`: why it could not be read."""

    relpath: str
    name: str
    folders: tuple[str, ...]
    size: int
    mtime_ns: int = 0
    inode: int = 0
    dev: int = 0
    nlink: int = 1
    ctime_ns: int | None = None
    regular: bool = True
    kind: str = "file"  # what a non-regular entry is ("symlink", "fifo", ...)
    head: bytes | None = None
    all_zero: bool | None = None
    content: bytes | None = None  # XXH3-128 of the file (--verify hash)
    payload: bytes | None = None  # XXH3-128 after the header (fs with header, GDS data)
    error: str | None = None
    # the verdict (classify_tier)
    status: str = "ok"
    action: str = "none"
    reason: str = ""
    deployment: str | None = None
    seed_fix: bool = False  # stale by its NONE_HASH only: the target taking the writer's PYTHONHASHSEED reaches it
    rank: int | None = None
    group: int | None = None
    block_hash: bytes | None = None
    chunk: L.ChunkName | None = None  # what its name parses as (None: no chunk name)
    target: str | None = None  # the row's target_relpath (lmcache_plan)


@dataclass
class Deployment:
    """The files of one deployment of a tier (§4), with what its label says."""

    label: str
    tier: str
    backend: str
    scheme: str
    model: str
    ws: int
    dtype: str | None
    group: int | None
    kv_kind: str | None
    files: list[TierFile] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fs_header: bool | None = None
    facts: Facts = field(default_factory=Facts)
    needs: set[str] = field(default_factory=set)  # facts asked by its rows (needs_fact)
    root: str | None = None  # the scanned root (a reshard's outputs found there are re-computed to compare)
    side: Any = None  # its target (lmcache_plan.TargetSide; None: nothing is planned)
    needs_target: Any = None  # why its target is not decided (lmcache_plan.NotPlanned)
    tags: tuple[tuple[str, str], ...] = ()
    reachability: dict[tuple[Any, ...], tuple[str, str, bool]] = field(default_factory=dict)  # (see _verdict)
    # what lmcache_meta reads of its files, folded as the scan reads them (`TierJudge`)
    first_chunk: L.ChunkName | None = None  # its first chunk file's name, in walk order
    hex64: bool = False  # a 64-hex chunk hash among its names
    quoted: bool = False  # a quoted GDS name among its names
    zero_hex64_files: int = 0  # fs chunk names whose 64-hex hash starts with `0`
    seed_fix_files: int = 0

    @property
    def plan_fields(self) -> dict[str, Any]:
        """What the migration plan re-proves an action from (the namespace's fields)."""
        return P.tier_fields(self, self.side)


def tier_label(tier: str) -> str:
    """The label of a tier's rows that belong to no deployment (temp, foreign)."""
    return f"lmcache:{tier}"


def block_hash_bytes(key: L.Key) -> bytes | None:
    """The `block_hash` column (§1.2): an int as 8 bytes big-endian (two's complement when
    negative), a digest as its 32 bytes."""
    kind = key.hash_kind
    if kind == "hex64":
        return bytes.fromhex(key.hash)
    try:
        h = int(key.hash, 16 if kind == "hex" else 10)
    except ValueError:
        return None
    for signed in (True, False):
        try:
            return h.to_bytes(8, "big", signed=signed)
        except OverflowError:
            continue
    return None


def _gds_folders_fit(key: L.Key, folders: tuple[str, ...]) -> bool:
    """Whether a GDS file sits in the folders its writer derives (§1.3: from the decimal
    string of the signed hash int). A digest's folders come from `str(bytes)` and are not
    checked; a k1 field may be decimal (0.3.3-0.3.5) or signed hex (0.3.6+): either reading fits."""
    want = L.gds_folders(key)
    if want is not None:
        return folders == tuple(p for p in want if p)
    if key.hash_kind == "hex64":
        return True
    readings = []
    for base in (16, 10):
        try:
            readings.append(tuple(p for p in L.gds_int_folders(int(key.hash, base)) if p))
        except ValueError:
            continue
    return folders in readings


def _looks_v0_pt(head: bytes, size: int) -> bool:
    """A v0 LMCLocalDiskBackend `.pt` (safetensors, 0.3.0-0.3.9, §0): an 8-byte
    little-endian header length then a JSON object."""
    if len(head) < _V0_PT_HEAD:
        return False
    n = struct.unpack_from("<Q", head)[0]
    return head[8:9] == b"{" and 2 <= n <= size - 8


def head_read(c: L.ChunkName) -> int | None:
    """How many of a chunk file's first bytes (`TierFile.head`) its verdicts read after
    `TierJudge.add` (None: all that were read): a GDS data file's header (4096), an fs
    file's RemoteMetadata (28), a local_disk `.pt`'s first 10 (`_looks_v0_pt`), none of an
    MP file's; a GDS sidecar's all, since its length and whether any byte is not zero are
    verdicts too. What the scan spills of a head (scan/tier_spill.py): no more is judged."""
    if c.sidecar:
        return None
    return {"gds": L.GDS_HEADER, "fs": L.FS_HEADER_ONE_GROUP, "local_disk": _V0_PT_HEAD}.get(c.backend, 0)


def _modal(sizes: Counter) -> int | None:
    """The most common size, None when it is not unique (one damaged file is no evidence)."""
    common = sizes.most_common(2)
    if not common or (len(common) == 2 and common[0][1] == common[1][1]):
        return None
    return common[0][0]


class _FsHeaderVote:
    """§2.2 detection for one fs tier, a file at a time: a header when most files' first 28
    bytes parse (known fmt, the key's dtype code, shape × b == length == size − 28). Files
    whose header is intact but torn, resized or inconsistent still show a known fmt and dtype
    code: they count for a header as long as at least one file fits exactly."""

    def __init__(self) -> None:
        self.files = self.seen = self.fits = self.plausible = 0

    def add(self, f: TierFile, c: L.ChunkName) -> None:
        self.files += 1
        if f.head is None or f.error or f.all_zero:
            return
        self.seen += 1
        if L.fs_header_fits(f.head, f.size, c.key.dtype):
            self.fits += 1
        h = L.decode_fs_header(f.head)
        if h is not None and h.fmt in L.KV_FORMATS and h.dtype is not None:
            self.plausible += 1

    def result(self) -> bool | None:
        """None: no fs file, or no first bytes read (--verify none)."""
        if not self.seen:
            return None
        return 2 * self.fits > self.seen or (self.fits > 0 and 2 * self.plausible > self.seen)


_NEVER = "never reused"
# what prune --residue does with them (spec §6)
_RESIDUE = "never reused; prune --residue moves a quiet tier's into the quarantine (a GDS pair together)"
# status -> the report's words for an LMCache tier's files (report/hints.py advice)
_ADVICE: dict[str, tuple[str, str, str]] = {
    "size_mismatch": ("LMCache chunk files longer than their header says or than their deployment's other chunks",
                      _NEVER, "list"),
    "short": ("LMCache chunk files that are empty or shorter than their header says (torn writes)", _RESIDUE,
              "prune"),
    "zero_filled": ("all-zero LMCache chunk files (crash residue)", _RESIDUE, "prune"),
    "misfiled": ("LMCache GDS files outside the <2>/<2> folders of their decimal hash (the engine never finds them)",
                 _RESIDUE, "prune"),
    "header_invalid": ("LMCache chunk files whose RemoteMetadata or GDS header contradicts itself or the key",
                       _NEVER, "list"),
    "tmp_leftover": ("temp files of interrupted LMCache writes",
                     "never reused; prune --residue moves a quiet tier's older than an hour into the quarantine",
                     "prune"),
    "foreign": ("files in LMCache tiers that are not part of the cache (incl. symlinks, other folders)",
                "kvmigrate ignores them", "list"),
    "unsupported_layout": ("LMCache files out of scope (layerwise keys, v0 safetensors .pt)",
                           "kvmigrate does not migrate them", "list"),
}


class LMCache(families.Family):
    name = "lmcache"
    title = "LMCache disk tier"
    reads_s1 = False
    target_engine = "lmcache"
    root_layout = "tiers"  # tier directories at the top of a root, or the root itself (§1.1)
    transforms = ("reshard", "rewrite_header")
    copies_whole = True  # MLA copies are whole chunks; a placed-by-rank chunk reads one file
    paired_files = True  # a GDS data file and its sidecar
    tier_file_type = TierFile  # what the scan records of a file (scan/tier_rows.py)

    def tier_label(self, tier: str) -> str:
        return tier_label(tier)

    def claims_entry(self, name: str, is_dir: bool) -> bool:
        return False  # (tiers are recognised by what they hold: scan/tiers.py asks is_chunk_name)

    def is_chunk_name(self, name: str) -> bool:
        """A file name that parses as a chunk of one backend (§1.3): what makes a tier."""
        return L.parse_name(name) is not None

    def facts_key_matches(self, backend: str) -> Any:
        """How a FACTS.json key's model matches the model a name spells (§1.3, §3.3):
        local_disk names are matched by `m.replace('/', '-')`, never decoded."""
        if backend == "local_disk":
            return lambda key_model, written: key_model == written or L.local_disk_model_matches(key_model, written)
        return None

    def is_tier_entry(self, name: str) -> bool:
        """A top-level file of a root that belongs to a root tier: a chunk or a writer's temp name."""
        return L.parse_name(name) is not None or L.parse_temp_name(name) is not None

    def target_profile(self, profile: str) -> str:
        """Every LMCache tier targets lmcache-0.5.6 unless --target names an lmcache-* profile (§0)."""
        return profile if profile in PROFILES else DEFAULT_PROFILE

    def target(self, fields: dict, facts: Facts, profile: str) -> Target:
        """The target deployment's label (lmcache_plan: the names it looks up); its chunks'
        actions are the rows' (§3.4), so no identity or folder is computed here."""
        label = str(fields.get("target_label") or fields.get("deployment") or "")
        return Target(profile=self.target_profile(profile), family=self.name, fields=None, d12=None,
                      base_name=label or None, rank_dir=None, parallel_agnostic=False, replicated_layout=False,
                      reasons=[])

    # --- the migration plan (docs/families.md §3: a tier's rows are planned as a flat family's) --

    def target_label_of(self, dep: Deployment) -> str:
        """§4's `target_base` of a deployment whose target is decided."""
        return P.target_label(dep.tier, dep, dep.side)

    def flat_target(self, source_base: str, fields: Mapping[str, Any]) -> str:
        return str(fields.get("target_label") or source_base)

    def flat_page_hex(self, name: str) -> str | None:
        """The chunk hash (the `block_hash` column's hex) a path inside a tier names. Inside a
        plan a sidecar row's hash is `marked` (never taken for a rank file of its chunk)."""
        chunk = L.parse_name(name.rsplit("/", 1)[-1])
        h = block_hash_bytes(chunk.key) if chunk is not None else None
        return None if h is None else h.hex()

    sidecar_suffix = L.SIDECAR

    def is_sidecar(self, relpath: str) -> bool:
        chunk = L.parse_name(relpath.rsplit("/", 1)[-1])
        return chunk is not None and chunk.sidecar

    def marked(self, block_hash: bytes) -> bytes:
        return block_hash if block_hash.endswith(SIDECAR_MARK) else block_hash + SIDECAR_MARK

    def unmarked(self, block_hash: bytes) -> bytes:
        return block_hash.removesuffix(SIDECAR_MARK)

    def tier_paths_problem(self, fields: Mapping[str, Any], relpath: str, target: str) -> str | None:
        """Why a row's target is not a name of its tier (a plan writes nowhere else)."""
        tier = str(fields.get("tier") or ".")
        for what, path in (("relpath", relpath), ("target_relpath", target)):
            inside = path.split("/")[1:] if tier != "." else path.split("/")
            if (tier != "." and path.split("/", 1)[0] != tier) or not 1 <= len(inside) <= 3 or (
                    len(inside) > 1 and not all(1 <= len(p) <= 2 for p in inside[:-1])):
                return f"{what} {path!r} is not a file of tier {tier!r}"
        return None

    def tier_spec(self, fields: Mapping[str, Any], facts: Mapping[str, Any], action: str, size: int,
                  target: str) -> Any:
        """The output of a reshard or header rewrite, re-proven (lmcache_plan.tier_spec)."""
        try:
            return P.tier_spec(fields, Facts.from_dict(facts), action, size, target)
        except P.NotPlanned as np:
            raise ValueError(np.why) from None

    def pair_of(self, relpath: str) -> str | None:
        chunk = L.parse_name(relpath.rsplit("/", 1)[-1])
        if chunk is None or chunk.backend != "gds":
            return None
        return relpath[: -len(L.SIDECAR)] if chunk.sidecar else relpath + L.SIDECAR

    def removed_first(self, relpath: str) -> bool:
        return self.is_sidecar(relpath)

    def verify_tier_file(self, relpath: str, size: int, read: Any) -> tuple[str, str] | None:
        """§5: a created file re-parsed to its chunk: an fs header against the name's dtype and
        the file's size, a GDS data header likewise, a sidecar equal to its data file's header."""
        chunk = L.parse_name(relpath.rsplit("/", 1)[-1])
        if chunk is None:
            return "header_invalid", "not an LMCache chunk name"
        head = read(relpath, HEAD_BYTES)
        if chunk.sidecar:
            try:
                data_head = read(relpath[: -len(L.SIDECAR)], L.GDS_HEADER)
            except FileNotFoundError:
                return "corrupt_sidecar", "its data file is missing: a probe finds no data"
            v = L.sidecar_verdict(head, data_head)
        elif chunk.backend == "gds" or chunk.backend == "fs" and L.decode_fs_header(head) is not None and \
                L.fs_header_fits(head, size, chunk.key.dtype):
            v = L.chunk_verdict(chunk.backend, size, head, all_zero=not any(head), dtype=chunk.key.dtype)
        else:  # a raw payload: its size is the journal's, checked above
            return None
        return (v.status, v.reason) if v.status is not None else None

    def expanded_targets(self, fields: Mapping[str, Any], action: str, target: str) -> list[str]:
        return P.expanded_targets(fields, action, target)

    def scheme_of(self, fields: Mapping[str, Any]) -> str:
        return str(fields.get("scheme") or "")

    def source_problems(self, fields: Mapping[str, Any]) -> list[str]:
        return []

    def unknown_keys(self, fields: Mapping[str, Any]) -> list[str]:
        return []

    def kv_kind(self, fields: Mapping[str, Any], facts: Mapping[str, Any]) -> str | None:
        return fields.get("kv_kind") or facts.get("kv_kind")

    def block_ranks(self, fields: Mapping[str, Any], present: Iterable[int] = (0,)) -> tuple[int, ...]:
        """The ranks read together for one chunk: MLA copies (compared) and a reshard's
        shards; a chunk placed rank by rank reads one file (world 1)."""
        if not fields.get("joint_ranks"):
            return (0,)
        return tuple(range(int(fields.get("ws") or 1)))

    def status_advice(self, status: str) -> tuple[str, str, str] | None:
        return _ADVICE.get(status)

    def deployment_meta(self, dep: Deployment, profile: str) -> dict[str, Any]:
        """What the report reads of a deployment beyond its rows (families/lmcache_meta.py)."""
        from kvmigrate.families.lmcache_meta import deployment_meta

        return deployment_meta(dep, self.target_profile(profile))

    # --- a tier's files -----------------------------------------------------------------

    def tier_judge(self, tier: str, *, facts_for: Any = None, root: str | None = None) -> TierJudge:
        """The scan's judge of one tier's files, fed a file at a time (`TierJudge`)."""
        return TierJudge(self, tier, facts_for=facts_for, root=root)

    def classify_tier(self, tier: str, files: list[TierFile], *, kv_kind: str | None = None,
                      facts_for: Any = None, root: str | None = None) -> tuple[list[Deployment], list[TierFile]]:
        """Every file of one tier with its status (§4's order), action and reason: (the
        deployments with their files, the files of no deployment), judged as one piece. `files`
        are the regular and other entries the scan found in the tier's layout (its top level
        and GDS `<2>/<2>` folders); a folder outside it is the scan's (foreign).
        `facts_for(model, backend)`: a deployment's facts (§3.3; None: none given). The scan
        judges a tier in partitions (`TierJudge`, scan/tier_spill.py)."""
        judge = TierJudge(self, tier, kv_kind=kv_kind, facts_for=facts_for, root=root, keep=True)
        chunks = [f for f in files if judge.add(f)]
        judge.settle()
        ordinals = list(range(len(chunks)))
        judge.judge(ordinals, chunks)
        judge.decide()
        judge.finish(chunks)
        return judge.result()

    def _verdict(self, f: TierFile, c: L.ChunkName, dep: Deployment, fs_header: bool | None, modal: int | None,
                 gds: dict[tuple[tuple[str, ...], str], TierFile]) -> None:
        """One chunk file's status by §4's order and its reason."""
        key = c.key
        status: str | None = None
        reason = ""
        if f.error:
            status, reason = "unreadable", f.error
        elif key.layer is not None:  # out of scope: its bytes are no chunk of this grammar (§0)
            status, reason = "unsupported_layout", (f"layerwise key (layer {key.layer}): out of scope, never reused "
                                                    "or reclaimed by default")
        elif c.backend == "local_disk" and f.head is not None and _looks_v0_pt(f.head, f.size):
            status, reason = "unsupported_layout", ("v0 LMCLocalDiskBackend .pt (safetensors, 0.3.0-0.3.9): out of "
                                                    "scope, never reused or reclaimed by default")
        elif c.sidecar:
            status, reason = self._sidecar_verdict(f, c, gds)
        else:
            status, reason = self._data_verdict(f, c, dep, fs_header, modal, gds)
        if status is None and c.backend == "gds" and not _gds_folders_fit(key, f.folders):
            status, reason = "misfiled", (f"in folder {'/'.join(f.folders) or '(tier top)'}, its writer derives the "
                                          "folders from the decimal hash (§1.3): never found")
        if status is None and c.backend != "gds" and f.folders:
            status, reason = "misfiled", f"a {c.backend} chunk inside GDS folders {'/'.join(f.folders)}: never found"
        if status is None:
            # (the verdict depends on the name's scheme, hash kind, backend and quoting, and the
            # deployment's facts: one computation per kind of name)
            kind = (c.key.scheme, c.key.hash_kind, c.backend, c.quoted)
            if kind not in dep.reachability:
                dep.reachability[kind] = self._reachability(c, dep.facts)
            status, reason, f.seed_fix = dep.reachability[kind]
        f.status = status
        f.reason = reason

    def _sidecar_verdict(self, f: TierFile, c: L.ChunkName, gds: dict) -> tuple[str | None, str]:
        data = gds.get((f.folders, c.data_name))
        if f.head is None:
            return (None, "") if data is not None else ("orphan_data", "sidecar without its data file")
        data_head = data.head if data is not None and not data.error else None
        v = L.sidecar_verdict(f.head[:f.size] if f.size < len(f.head) else f.head, data_head)
        if v.status == "zero_filled" and f.all_zero is False:
            v = L.Verdict("corrupt_sidecar", "sidecar does not parse (the startup scan of its folder stops)")
        if v.status is None and data is None:
            return "orphan_data", "sidecar without its data file: a probe finds no data"
        return v.status, v.reason

    def _data_verdict(self, f: TierFile, c: L.ChunkName, dep: Deployment, fs_header: bool | None, modal: int | None,
                      gds: dict) -> tuple[str | None, str]:
        key = c.key
        mla = None if dep.kv_kind is None else dep.kv_kind == "mla"
        if f.head is None:  # --verify none: the size alone
            if f.size == 0:
                return "short", "empty file"
            if c.backend in ("local_disk", "mp", "fs"):  # (a header, if any, is the same 28 bytes on every file)
                v = L.chunk_verdict(c.backend, f.size, b"", all_zero=False, fs_header=False, modal_size=modal,
                                    **_geometry_args(dep))
                return v.status, v.reason
            return None, ""
        sidecar = "ok"
        if c.backend == "gds":
            side = gds.get((f.folders, f.name + L.SIDECAR))
            if side is None:
                sidecar = "missing"
            elif side.status not in ("ok", "misfiled", "stale_hash_recipe"):
                sidecar = "corrupt"
        zero = bool(f.all_zero)
        v = L.chunk_verdict(c.backend, f.size, f.head, all_zero=zero, dtype=key.dtype, mla=mla,
                            fs_header=bool(fs_header),
                            modal_size=modal, sidecar=sidecar, **_geometry_args(dep))
        return v.status, v.reason

    def _reachability(self, c: L.ChunkName, facts: Facts | None = None) -> tuple[str, str, bool]:
        """§3.2's verdicts in order (rule 1 from the name alone, then from the facts), then
        index_lost, else ok; a name whose recipe the facts do not prove keeps its status with
        the finding `needs_fact` asking for them (rule 4)."""
        key = c.key
        if key.scheme in ("lmc-k1", "lmc-k2"):
            return "stale_hash_recipe", (f"{key.scheme} key (written before 0.3.13): no target release computes "
                                         "its chunk hash (§3.2)"), False
        if key.scheme == "lmc-k3" and key.hash_kind == "hex64":
            return "stale_hash_recipe", ("64-hex chunk hash (a 0.3.13-0.4.5 sha256 digest kept whole): a 0.4.6+ "
                                         "target folds it, never computes this key (§3.2)"), False
        verdict = recipe_verdict(c, facts or Facts())
        if verdict is not None and verdict.status is not None:
            return verdict.status, verdict.reason, verdict.seed_fix
        if c.backend == "local_disk":
            status, text = "index_lost", ("local_disk chunk: no restarted engine re-indexes existing .pt files, "
                                          "whatever their name (§3.5)")
        else:
            status, text = "ok", "whole chunk file"
        if verdict is not None:  # (None, why, asks): the recipe is not proven
            return status, fd.reason(f"{text}; {verdict.reason}", fd.NEEDS_FACT, asks=verdict.asks), False
        return status, text, False


# --- §3.2 the hash recipe -----------------------------------------------------------------

class RecipeVerdict(NamedTuple):
    """§3.2 for one name: `status` (None: not proven either way), why, the flags a proof
    asks for, and `seed_fix`: stale by its NONE_HASH alone with the writer's seed known,
    so the target taking that PYTHONHASHSEED reaches the chunk again (§7's note)."""

    status: str | None
    reason: str
    asks: str | None = None
    seed_fix: bool = False


def recipe_verdict(c: L.ChunkName, facts: Facts) -> RecipeVerdict | None:
    """§3.2 rules 2-4 for a name rule 1 left: (status, reason, None) when the facts prove
    the chunk unreachable, (None, why, asks) when they do not prove its recipe, None when
    writer and target compute the same hash."""
    key = c.key
    w_chunk, t_chunk = facts.chunk_size, facts.target_chunk_size
    if w_chunk is not None and t_chunk is not None and w_chunk != t_chunk:
        chunk_diff = f"chunk_size {w_chunk} (writer) vs {t_chunk} (target): chunk size is part of every hash"
    else:
        chunk_diff = None
    if key.scheme == "lmc-mp1":  # blake3 with a fixed none hash: only chunk_size (§3.2)
        return RecipeVerdict("stale_hash_recipe", f"MP chain: {chunk_diff} (§3.2)") if chunk_diff else None
    alg = _algorithm(facts.hash_algorithm)
    t_alg = _algorithm(facts.target_hash_algorithm) if facts.target_hash_algorithm else alg
    seed = facts.pythonhashseed
    t_seed = facts.target_pythonhashseed or seed
    vllm = facts.vllm_release
    t_vllm = facts.target_vllm_release or vllm
    writer_none = _none_hash(alg, seed, vllm)
    # rule 2: the writer's NONE_HASH was random
    if writer_none == "random":
        why = ("PYTHONHASHSEED unset with the builtin hash (Python's str hash is random)" if alg == "builtin" else
               f"PYTHONHASHSEED unset with {alg} (NONE_HASH from os.urandom)" if alg in _SEEDLESS_RANDOM else
               f"PYTHONHASHSEED unset under vLLM {vllm} (<= 0.28: NONE_HASH from os.urandom)")
        return RecipeVerdict("unreproducible_hash", f"the writer's chain was seeded at random: {why}; no process "
                                                    "can regenerate these keys (§3.2)")
    # rule 3: any other component differs
    diffs: list[str] = []
    seed_fix = False
    if alg != t_alg:
        diffs.append(f"hash_algorithm {alg} (writer) vs {t_alg} (target)")
    target_none = _none_hash(t_alg, t_seed, t_vllm)
    if writer_none is not None and target_none is not None and writer_none != target_none:
        diffs.append(f"NONE_HASH {writer_none} (writer) vs {target_none} (target)")
        seed_fix = seed is not None and seed != "unset"
    if alg == "builtin" and t_alg == "builtin":
        w_py, t_py = _py_hash_era(facts.python_version), _py_hash_era(facts.target_python_version)
        if w_py and t_py and w_py != t_py:
            diffs.append(f"Python {facts.python_version} (writer) vs {facts.target_python_version} (target): "
                         "str hash differs between <= 3.10 and >= 3.11")
    if chunk_diff:
        diffs.append(chunk_diff)
    era, era_why, releases = _chain_era(c, facts, alg)
    if era == "old":
        diffs.append(era_why)
    if diffs:
        # only the seed differs: the target can take the writer's (another difference stays)
        seed_fix = seed_fix and len(diffs) == 1
        if seed_fix:
            diffs[0] += (f": setting the target's PYTHONHASHSEED to the writer's ({seed}) makes the chunks "
                         "reachable again")
        return RecipeVerdict("stale_hash_recipe", "hash recipe differs: " + "; ".join(diffs) + " (§3.2)",
                             seed_fix=seed_fix)
    # rule 4 and the facts a proof needs
    asks: list[str] = []
    whys: list[str] = []
    if era is None:
        asks.append("--writer-release")
        whys.append(era_why)
    if seed is None:
        asks.append("--pythonhashseed")
        whys.append("the writer's PYTHONHASHSEED is not given")
    elif writer_none is None:
        asks.append("--vllm-release")
        whys.append(f"PYTHONHASHSEED unset with {alg}: vLLM's release decides NONE_HASH")
    elif target_none is None:
        asks.append("--target-vllm-release")
        whys.append("the target's NONE_HASH depends on its vLLM release")
    if asks:
        return RecipeVerdict(None, "hash recipe not proven: " + "; ".join(whys) + " (§3.2)", fd.asks(*asks))
    return None


def fact_of_flag(flag: str) -> str:
    """The FACTS.json key of a fact flag."""
    return next(name for name, f in FACT_FLAGS.items() if f == flag)


def _header_kind(f: TierFile, dep: Deployment) -> tuple[bool, str | None]:
    """What one file says of its deployment's kv kind: (whether it decides, the kind); the
    first file in walk order that decides does (`TierJudge.judge`)."""
    if f.status != "ok" or f.head is None or f.chunk is None or f.chunk.sidecar:
        return False, None
    if f.chunk.backend == "gds":
        g = L.decode_gds_header(f.head)
        fmt = g.fmt if g is not None else None
    elif f.chunk.backend == "fs" and dep.fs_header:
        h = L.decode_fs_header(f.head)
        fmt = h.fmt if h is not None else None
    else:
        return True, None
    if fmt in L.KV_FORMATS:
        return True, "mla" if fmt == L.KV_MLA_FMT else "full"
    return False, None


def _geometry_args(dep: Deployment) -> dict[str, Any]:
    """chunk_verdict's full_chunk, token_bytes and save_unfull_chunk from the facts (§2.4)."""
    full = _full_chunk(dep)
    if full is None:
        return {}
    return {"full_chunk": full, "token_bytes": full // (dep.facts.chunk_size or 1),
            "save_unfull_chunk": bool(dep.facts.save_unfull_chunk)}


def _full_chunk(dep: Deployment) -> int | None:
    """§2.4's `S = k·L·T·hidden·b` from the geometry facts (None: not all given); with
    chunk_size the facts replace the deployment's modal size."""
    f = dep.facts
    if dep.backend == "gds" or f.chunk_size is None or f.layers is None or dep.dtype not in L.DTYPE_BYTES:
        return None
    kind = dep.kv_kind or f.kv_kind
    if kind == "mla":
        hidden = f.latent_dim
    elif kind == "full" and f.total_kv_heads and f.head_dim and dep.ws:
        heads = f.total_kv_heads
        per_rank = heads // dep.ws if heads % dep.ws == 0 else 1 if dep.ws % heads == 0 else None
        hidden = per_rank * f.head_dim if per_rank else None
    else:
        hidden = None
    if not hidden:
        return None
    return L.full_chunk_bytes(kind == "mla", f.layers, f.chunk_size, hidden, str(dep.dtype))


class TierJudge:
    """One tier's files judged in pieces, so that a scan never holds them all (scan/tier_rows.py
    spills them to disk): `add` each file in walk order (the deployment-level folds: the fs
    header vote, modal sizes, lmcache_meta's counts), `settle`; `judge` every partition of
    the chunk files (a chunk hash's files are in one: the verdicts and plans that compare
    files stay inside it) for the kv kind their headers state, `decide`; then `finish` every
    partition again (verdicts, plan, the facts its rows ask). `keep`: the deployments keep
    their files (`Deployment.files`)."""

    def __init__(self, fam: LMCache, tier: str, *, kv_kind: str | None = None, facts_for: Any = None,
                 root: str | None = None, keep: bool = False) -> None:
        self.fam, self.tier, self.kv_kind, self.facts_for, self.root, self.keep = (
            fam, tier, kv_kind, facts_for, root, keep)
        self.deps: dict[str, Deployment] = {}
        self.loose: list[TierFile] = []
        self.present_loose: dict[str, TierFile] = {}  # (a symlink may sit at a target name)
        self.vote = _FsHeaderVote()
        self.sizes: dict[str, Counter] = defaultdict(Counter)
        self.modal: dict[str, int | None] = {}
        self.fs_header: bool | None = None
        self.header_kind: dict[str, tuple[int, str | None]] = {}  # label -> (ordinal, kind) of the deciding file
        self.verdict_kind: dict[str, str | None] = {}

    def add(self, f: TierFile) -> bool:
        """A file of the tier's layout, in walk order: True for a chunk file (judged in its
        partition), False for a file of no deployment (kept in `loose`)."""
        f.action = "none"
        tier = self.tier
        chunk = L.parse_name(f.name)
        if not f.regular:
            f.status, f.reason = "foreign", f"{f.kind} (never followed): not part of the cache"
            self.loose.append(f)
            self.present_loose[f.relpath] = f
            return False
        if chunk is None:
            temp = L.parse_temp_name(f.name)
            own = layout.own_artifact(f.name)
            if own is not None:
                f.status, f.reason = "own_artifact", own
            elif temp is not None:
                f.status, f.reason = "tmp_leftover", (f"temp leftover of an interrupted LMCache {temp.backend} "
                                                      "write (never read by the engine)")
            else:
                f.status, f.reason = "foreign", f"unexpected file in LMCache tier {tier}: not part of the cache"
            if f.error and f.status != "foreign":
                f.status, f.reason = "unreadable", f.error
            self.loose.append(f)
            self.present_loose[f.relpath] = f
            return False
        label = deployment_label(tier, chunk)
        dep = self.deps.get(label)
        k = chunk.key
        if dep is None:
            facts = self.facts_for(k.model, chunk.backend) if self.facts_for is not None else Facts()
            dep = self.deps[label] = Deployment(label, tier, chunk.backend, k.scheme, k.model, k.ws, k.dtype,
                                                k.group if k.scheme == "lmc-mp1" else 0,
                                                self.kv_kind or facts.kv_kind, facts=facts, root=self.root,
                                                tags=k.tags)
        if self.keep:
            dep.files.append(f)
        f.chunk = chunk
        f.deployment = label
        f.rank = k.wid
        f.group = k.group or 0 if k.scheme == "lmc-mp1" else 0
        f.block_hash = block_hash_bytes(k)
        if chunk.backend == "fs" and k.layer is None:
            self.vote.add(f, chunk)
        if k.layer is None and not chunk.sidecar and not f.error:
            self.sizes[label][f.size] += 1
        if dep.first_chunk is None:
            dep.first_chunk = chunk
        if k.hash_kind == "hex64":
            dep.hex64 = True
            if chunk.backend == "fs" and not chunk.sidecar and k.hash.startswith("0"):
                dep.zero_hex64_files += 1
        if chunk.quoted:
            dep.quoted = True
        return True

    def settle(self) -> None:
        """After the walk: the tier's fs header vote, each deployment's modal size."""
        self.fs_header = self.vote.result() if self.vote.files else None
        self.modal = {label: _modal(cnt) for label, cnt in self.sizes.items()}
        self.sizes.clear()
        for dep in self.deps.values():
            if dep.backend == "fs":
                if dep.facts.save_chunk_meta is not None:  # the tier's fact decides (§2.2)
                    dep.fs_header = dep.facts.save_chunk_meta
                else:
                    dep.fs_header = self.fs_header
                dep.notes.append("RemoteMetadata header: " + (
                    "not known (no first bytes read)" if dep.fs_header is None else
                    "present (most files' first 28 bytes parse, §2.2)" if dep.fs_header else "absent (raw payloads)"))
            # (§7's notes: the report's, from deployment_meta)
            self.verdict_kind[dep.label] = dep.kv_kind

    def _verdicts(self, files: list[TierFile]) -> None:
        named = [(f, f.chunk) for f in files if f.chunk is not None]  # (every file a partition holds)
        gds = {(f.folders, f.name): f for f, c in named if c.backend == "gds"}
        named.sort(key=lambda fc: not fc[1].sidecar)  # a data file's verdict reads its sidecar's
        for f, c in named:
            dep = self.deps[str(f.deployment)]
            header = dep.fs_header if c.backend == "fs" else self.fs_header
            self.fam._verdict(f, c, dep, header, self.modal.get(dep.label), gds)

    def judge(self, ordinals: list[int], files: list[TierFile]) -> None:
        """One partition's verdicts (walk order), for the kv kind the deployments' headers state."""
        self._verdicts(files)
        for k, f in zip(ordinals, files):
            label = str(f.deployment)
            dep = self.deps[label]
            if dep.kv_kind is not None or self.header_kind.get(label, (k + 1,))[0] < k:
                continue
            decides, kind = _header_kind(f, dep)
            if decides:
                self.header_kind[label] = (k, kind)

    def decide(self) -> None:
        """After every partition is judged: each deployment's kv kind and target (lmcache_plan)."""
        for dep in self.deps.values():
            if dep.kv_kind is None:
                dep.kv_kind = self.header_kind.get(dep.label, (0, None))[1]
        P.plan_sides(self.deps.values())

    def finish(self, files: list[TierFile]) -> None:
        """One partition judged again (its verdicts read the kv kind known before `decide`)
        and planned; the facts its rows ask for and lmcache_meta's counts folded."""
        final = {label: dep.kv_kind for label, dep in self.deps.items()}
        for label, dep in self.deps.items():
            dep.kv_kind = self.verdict_kind[label]
        try:
            self._verdicts(files)
        finally:
            for label, dep in self.deps.items():
                dep.kv_kind = final[label]
        present = ChainMap({f.relpath: f for f in files}, self.present_loose)
        P.plan_files(self.tier, self.deps.values(), files, present)
        for f in files:
            dep = self.deps[str(f.deployment)]
            if f.seed_fix:
                dep.seed_fix_files += 1
            found = fd.finding_of(f.reason)  # the facts its verdicts wait for (`kvmigrate facts`)
            if found is not None and found.code == fd.NEEDS_FACT:
                dep.needs.update(fact_of_flag(flag) for flag in fd.asked_flags(found.asks))

    def result(self) -> tuple[list[Deployment], list[TierFile]]:
        """(the deployments by label, the files of no deployment)."""
        return sorted(self.deps.values(), key=lambda d: d.label), self.loose


FAMILY = LMCache()
