"""SGLang HiCache `file` storage backend: one flat directory of page files (docs/sglang.md).

Writer: `sglang/srt/mem_cache/hicache_storage.py`, class `HiCacheFile` (0.4.9.post3 ...
0.5.23; 0.5.23 L728-1108: suffixes L748-771, key -> stem L822-831, path L853/L891), read
release by release in /work/shared/reference/sglang-format.md. Every file is
`<hash64>[.<pool>]<suffix>.bin`; the suffix carries the parallel layout and, from 0.5.2,
the served model name, so the *name* is the identity: there are no folders and no
config.json. Schemes (sglang.md §1): `sgl-e1` (0.4.9.post3, `{hash}.bin`, torch.save zip),
`sgl-e2` (0.4.9.post4 - 0.5.0rc2, `{hash}[_{r}_{N}]`), `sgl-e3` (0.5.1.x: MLA `{hash}`),
`sgl-e4` (0.5.2 - 0.5.23, `_{model}[_{r}_{N}][_{pp}_{pr}][_cp..][_tp.._dcp.._page..]`).

The grammar is parsed from the right (model names keep `_` and digits); a `model_name`
fact decides a name that could be read two ways. Files are grouped into deployments
(model, pool, TP, PP, CP, DCP): a deployment is the namespace of this family
(`discover`), its files the rows (`flat_verdicts`).
"""

from __future__ import annotations

import functools
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmigrate import families
from kvmigrate.findings import NEEDS_FACT, REPLICA_OF_PRIMARY, asks
from kvmigrate.findings import reason as finding_reason
from kvmigrate.identity.vllm_target import Target

PROFILE = "sglang-0.5.23"
ZIP_MAGIC = b"PK\x03\x04"  # torch.save archives (0.4.9.post3 - 0.4.10.post1)
# PoolName of 0.5.23 (hicache_storage.py L85-121); the KV pool has no tag
POOLS = ("auxiliary_swa", "draft_indexer", "draft_swa", "indexer", "mamba", "draft", "swa")
_POOL_RE = re.compile(r"(deepseek_v4_[a-z0-9]+|" + "|".join(POOLS) + r")(?=_|$)")
_HASH_RE = re.compile(r"^[0-9a-f]{64}")
_KV_NAME_RE = re.compile(r"[0-9a-f]{64}(?:_.*)?\.bin", re.S)  # <hash64>[_<suffix>].bin: the KV pool
_DCP_RE = re.compile(r"_tp(\d+)_dcp(\d+)_(\d+)_page(\d+)$")
_CP_RE = re.compile(r"_cp(\d+)_(\d+)$")
_PAIR_RE = re.compile(r"_(\d+)_(\d+)$")
_E2_SUFFIX = re.compile(r"_\d+_\d+")
_TMP_NEW_RE = re.compile(r"^\.[0-9a-f]{32}\.tmp$")  # 0.5.20+
_TMP_OLD_RE = re.compile(r"^[0-9a-f]{64}.*\.bin\.tmp\.\d+\.\d+\.[0-9a-f]+$", re.S)  # 0.5.14 - 0.5.19
LAYOUT_DEFAULT_BEFORE = "layer_first"  # --hicache-mem-layout default <= 0.5.13
LAYOUT_DEFAULT_AFTER = "page_first"  # >= 0.5.14 (server_args.py L1798-1810)


@dataclass(frozen=True)
class Reading:
    """One reading of a name's suffix (the part between hash[.pool] and `.bin`)."""

    era: str  # "e4" (model in the name) or "e23" (no model: e1, e2 or e3)
    model: str | None  # the sanitised model name (only `/` -> `-`), None for e1-e3
    tp: tuple[int, int] | None = None  # (rank, size)
    pp: tuple[int, int] | None = None  # (size, rank): the writer's order
    cp: tuple[int, int] | None = None  # (rank, size)
    dcp: tuple[int, int, int, int] | None = None  # (tp size, dcp rank, dcp size, page)

    @property
    def mla(self) -> bool | None:
        """MLA as the name proves it (None: the name cannot tell)."""
        if self.era != "e4":
            return None
        return self.tp is None or None  # e4 without a TP pair is MLA; with one: non-MLA, or a .mamba side file

    def shape(self) -> tuple:
        """What all files of one deployment share (ranks left out)."""
        return (self.era, self.model, self.tp[1] if self.tp else None, self.pp[0] if self.pp else None,
                self.cp[1] if self.cp else None, self.dcp[::2] if self.dcp else None)

    def worker(self) -> tuple[int, int]:
        """(rank, writers): the writer's index in the deployment, mixed radix over
        (pp rank, cp rank, dcp rank, tp rank), and how many writers a page needs."""
        parts = [(self.pp[1], self.pp[0]) if self.pp else (0, 1), self.cp or (0, 1),
                 (self.dcp[1], self.dcp[2]) if self.dcp else (0, 1), self.tp or (0, 1)]
        rank, n = 0, 1
        for r, s in parts:
            rank, n = rank * s + r, n * s
        return rank, n


@dataclass(frozen=True, slots=True)
class PageName:
    hex: str
    pool: str | None
    suffix: str


def parse_page_name(name: str) -> PageName | None:
    """hash, pool and raw suffix of a page file name, None when it is none. (A flat
    directory holds a million names: the KV pool's, most of them, take one regex match;
    the suffix, shared by every page of a deployment, is interned.)"""
    if _KV_NAME_RE.fullmatch(name):  # the KV pool: no pool tag to match
        return PageName(name[:64], None, sys.intern(name[64:-4]))
    if not name.endswith(".bin") or not _HASH_RE.match(name):
        return None
    hexh, rest = name[:64], name[64:-4]
    if rest[:1] == "_" or rest == "":  # (not reached: the KV pool's names matched above)
        return PageName(hexh, None, rest)
    pool = None
    if rest.startswith("."):
        m = _POOL_RE.match(rest, 1)
        if m is None:
            return None
        pool, rest = m.group(1), rest[m.end():]
    if rest and not rest.startswith("_"):
        return None
    return PageName(hexh, pool, sys.intern(rest))


def is_temp(name: str) -> bool:
    """A HiCache temp file (never reused): `.<32 hex>.tmp` (0.5.20+) or
    `<final>.bin.tmp.<pid>.<tid>.<hex>` (0.5.14 - 0.5.19)."""
    if name[:1] != "." and ".bin.tmp." not in name:  # (neither pattern can match: most names)
        return False
    return bool(_TMP_NEW_RE.match(name) or _TMP_OLD_RE.match(name))


@functools.lru_cache(maxsize=4096)
def _zip_era_suffix(suffix: str) -> bool:
    """A suffix of the names e1 and early e2 wrote (bare, or `_{r}_{N}`), once per suffix:
    every page of a deployment shares it."""
    return suffix == "" or _E2_SUFFIX.fullmatch(suffix) is not None


def sanitise(model: str) -> str:
    """The model name as HiCacheFile puts it in a name (L748: only `/` is replaced)."""
    return model.replace("/", "-")


def _pair(s: str, ok) -> tuple[str, tuple[int, int] | None]:
    m = _PAIR_RE.search(s)
    if m and ok(int(m.group(1)), int(m.group(2))):
        return s[:m.start()], (int(m.group(1)), int(m.group(2)))
    return s, None


def _is_tp(r: int, n: int) -> bool:
    return r < n


def _is_pp(size: int, rank: int) -> bool:
    return size >= 2 and rank < size


def read_suffix(suffix: str, pool: str | None, *, model: str | None = None,
                kv_kind: str | None = None) -> Reading | None:
    """The reading of a suffix, numeric groups taken from the right (sglang.md §1).

    `model` (the model_name fact, sanitised here) decides a name whose model could end in
    numeric groups; `kv_kind` "mla" says a KV name carries no TP pair (a `.mamba` file
    keeps it). None: no valid reading."""
    if suffix == "":
        return Reading("e23", None)
    m = re.fullmatch(r"_(\d+)_(\d+)", suffix)
    if (m and _is_tp(int(m.group(1)), int(m.group(2))) and int(m.group(2)) > 1
            and (model is None or not suffix.startswith("_" + sanitise(model) + "_"))):
        return Reading("e23", None, tp=(int(m.group(1)), int(m.group(2))))
    s = suffix
    dcp = cp = None
    d = _DCP_RE.search(s)
    if d:
        t, r, n, p = map(int, d.groups())
        if not (r < n and n >= 2):
            return None
        dcp, s = (t, r, n, p), s[:d.start()]
    c = _CP_RE.search(s)
    if c:
        r, n = int(c.group(1)), int(c.group(2))
        if not (r < n and n >= 2):
            return None
        cp, s = (r, n), s[:c.start()]
    if model is not None:
        head = "_" + sanitise(model)
        if s.startswith(head):
            rest = s[len(head):]
            rest, pp = _pair(rest, _is_pp)
            rest, tp = _pair(rest, _is_tp)
            if rest == "":
                return Reading("e4", sanitise(model), tp, pp, cp, dcp)
    mla = kv_kind == "mla" and pool != "mamba"
    s, pp = _pair(s, _is_pp)
    tp = None
    if not mla:
        s, tp = _pair(s, _is_tp)
    if not s.startswith("_"):
        return None
    return Reading("e4", s[1:], tp, pp, cp, dcp)


def page_of(f: FlatFile) -> PageName:
    """The parsed name of a page file (parsed once, then kept on the file)."""
    page = f.page
    if page is None:
        page = f.page = parse_page_name(f.name)
        if page is None:
            raise ValueError(f"{f.name!r} is not a page name")
    return page


def _target_name(dep: Deployment, page: PageName, r: Reading) -> str:
    """The name 0.5.23 opens for an e1-e3 page (its deployment's model is known: a
    deployment without one plans nothing)."""
    if dep.model is None:
        raise ValueError(f"{page.hex}: the deployment's model name is not known")
    pool = f".{dep.pool}" if dep.pool else ""
    return f"{page.hex}{pool}{target_suffix(r, dep.model, dep.kv_kind == 'mla', dep.pool)}.bin"


def target_suffix(reading: Reading, model: str, mla: bool, pool: str | None) -> str:
    """The suffix 0.5.23 looks up for the deployment that wrote a name of e2/e3 (L748-760):
    non-MLA `_{model}_{r}_{N}` (also at N=1), MLA `_{model}` (a .mamba file keeps the TP pair)."""
    m = sanitise(model)
    if mla and pool != "mamba":
        return f"_{m}"
    r, n = reading.tp or (0, 1)
    return f"_{m}_{r}_{n}"


@dataclass(slots=True)
class FlatFile:
    """One page file of the directory as the scan saw it (scan/flat.py)."""

    name: str
    size: int
    head: bytes | None = None  # the first bytes, read for names the header decides (e1-e3)
    content: bytes | None = None  # XXH3-128 (--verify hash)
    all_zero: bool | None = None
    page: PageName | None = None
    index: int = -1  # the scan's index of this file (scan/flat.py: its stat columns)


@dataclass
class SuffixFold:
    """What discovery and the verdicts need of all the pages of one (pool, suffix), folded
    as the scan reads them (scan/flat.py): a deployment is one or more of these."""

    id: int  # the order it was first met in (the scan files each page under it)
    pool: str | None
    suffix: str
    count: int = 0
    all_zip: bool = True  # every page's head is a zip archive's
    sizes: Counter = field(default_factory=Counter)  # sizes the pages compare (not empty, no zip payload)


def fold_page(folds: dict[tuple[str | None, str], SuffixFold], f: FlatFile) -> int:
    """Count a page into the fold of its (pool, suffix): that fold's id."""
    page = page_of(f)
    key = (page.pool, page.suffix)
    fold = folds.get(key)
    if fold is None:
        fold = folds[key] = SuffixFold(len(folds), *key)
    fold.count += 1
    if f.head is not None and f.head.startswith(ZIP_MAGIC):
        return fold.id
    fold.all_zip = False
    if f.size > 0:
        fold.sizes[f.size] += 1
    return fold.id


@dataclass
class Deployment:
    """One deployment (and pool) of the directory: this family's namespace."""

    key: tuple
    reading: Reading
    pool: str | None
    facts: Any
    model: str | None  # sanitised
    kv_kind: str | None
    scheme: str
    label: str  # source_base / deployment column
    deployment: str
    notes: list[str] = field(default_factory=list)
    decided: dict[str, str] = field(default_factory=dict)  # suffix -> how the facts decided its reading
    # fold id -> (its place in the deployment's order of suffixes, its reading)
    folds: dict[int, tuple[int, Reading]] = field(default_factory=dict)
    count: int = 0  # page files
    modal: int | None = None  # the size most of its pages have (not empty, no zip payload)


class SGLang(families.Family):
    name = "sglang"
    title = "SGLang HiCache file backend"
    incomplete_advice = ("SGLang needs every TP rank's file of a page (docs/sglang.md §3): the remaining files are "
                         "never read as a page, so remove them while no engine runs")
    reads_s1 = False
    target_engine = "sglang"
    root_layout = "flat"
    majority_sizes = True
    copies_whole = True  # e2 MLA: every rank wrote the whole page (sglang.md §3: a missing copy does not block)

    def claims_entry(self, name: str, is_dir: bool) -> bool:
        if is_dir:
            return False
        return _KV_NAME_RE.fullmatch(name) is not None or parse_page_name(name) is not None or is_temp(name)

    def is_temp(self, name: str) -> bool:
        return is_temp(name)

    def temp_page(self, name: str) -> str | None:
        """`<final>.bin.tmp.<pid>.<tid>.<hex>` (0.5.14 - 0.5.19) names its page; `.<32 hex>.tmp` none."""
        return name[:name.index(".bin.tmp.") + 4] if _TMP_OLD_RE.match(name) else None

    def wants_head(self, file: FlatFile) -> bool:
        """Names whose payload the zip magic decides (e1 and early e2 wrote torch.save
        archives): their first bytes are read even under --verify size."""
        p = file.page
        return p is not None and _zip_era_suffix(p.suffix)

    def carried_head(self, unsupported: bool) -> bytes:
        """The head shown a page whose bytes did not change since the --baseline row that
        judged it (scan/flat.py): the zip magic where that row was the zip payload's
        unsupported_layout, else none of it."""
        return ZIP_MAGIC if unsupported else b""

    def target_profile(self, profile: str) -> str:
        return PROFILE

    def flat_file(self, name: str, size: int) -> FlatFile:
        return FlatFile(name, size, page=parse_page_name(name))

    def fold_page(self, folds: dict[Any, Any], file: FlatFile) -> int:
        return fold_page(folds, file)

    def model_key_matches(self, key: str, suffix: str) -> bool:
        """A FACTS.json model name fits a suffix `_{model}` + the groups after it."""
        head = "_" + sanitise(key)
        return suffix == head or suffix.startswith(head + "_")

    # --- discovery ---------------------------------------------------------------------

    def discover(self, files: list[FlatFile], facts_for) -> list[Deployment]:
        """`discover_folds` of these files (a temp file's page, read as its page would be)."""
        folds: dict[tuple[str | None, str], SuffixFold] = {}
        for f in files:
            fold_page(folds, f)
        return self.discover_folds(folds, facts_for)

    def discover_folds(self, folds: Mapping[tuple[str | None, str], SuffixFold], facts_for) -> list[Deployment]:
        """Group the directory's pages, folded by (pool, suffix), into deployments.
        `facts_for(model, suffix)` gives the facts of a suffix (FACTS.json: exact suffix,
        then model name, then "*"; flags fill gaps). Each distinct suffix is read once."""
        out: dict[tuple, Deployment] = {}
        sizes: dict[tuple, Counter] = defaultdict(Counter)
        zipped: dict[tuple, bool] = {}
        for fold in sorted(folds.values(), key=lambda x: (x.pool or "", x.suffix)):
            pool, suffix = fold.pool, fold.suffix
            greedy = read_suffix(suffix, pool)
            facts = facts_for(greedy.model if greedy else None, suffix)
            model_fact = getattr(facts, "model_name", None)
            reading = read_suffix(suffix, pool, model=model_fact, kv_kind=facts.kv_kind)
            if reading is None:
                reading = Reading("e23", None)  # (never: every parsed name has a reading)
            note = None
            if greedy is not None and reading != greedy:
                note = (f"suffix {suffix!r} read with the model name {model_fact!r} from "
                        f"{facts.sources.get('model_name') or facts.sources.get('kv_kind', 'the facts')}")
            model = reading.model if reading.era == "e4" else (sanitise(model_fact) if model_fact else None)
            key = (pool, model) + reading.shape()  # (e1-e3: the model the facts give)
            dep = out.get(key)
            if dep is None:
                dep = out[key] = self._deployment(key, reading, pool, facts, model_fact)
            if note:
                dep.decided[suffix] = note
                if note not in dep.notes:
                    dep.notes.append(note)
            dep.folds[fold.id] = (len(dep.folds), reading)
            dep.count += fold.count
            sizes[key].update(fold.sizes)  # (in the order of suffixes: the modal size's ties go to the first)
            zipped[key] = zipped.get(key, True) and fold.all_zip
        for key, dep in out.items():
            dep.notes.extend(_hazards(dep))
            dep.modal = sizes[key].most_common(1)[0][0] if sizes[key] else None
            if dep.scheme == "sgl-e3" and zipped[key]:
                dep.scheme = "sgl-e1"  # bare names of torch.save archives: 0.4.9.post3 (or 0.4.9.post4+ at TP=1)
                dep.label = dep.label.replace(":sgl-e3", ":sgl-e1")
                dep.deployment = dep.deployment.replace(":sgl-e3", ":sgl-e1")
        return [out[k] for k in sorted(out, key=lambda k: out[k].label)]

    def _deployment(self, key: tuple, reading: Reading, pool: str | None, facts: Any, model_fact: str | None
                    ) -> Deployment:
        model = reading.model if reading.era == "e4" else (sanitise(model_fact) if model_fact else None)
        mla = reading.mla
        kv_kind = "mla" if mla else facts.kv_kind
        if reading.era == "e4" and reading.tp is not None and pool != "mamba":
            kv_kind = "full" if facts.kv_kind in (None, "mla") else facts.kv_kind
        if reading.era == "e4" and reading.dcp is not None:
            kv_kind = "mla"
        scheme = "sgl-e4" if reading.era == "e4" else ("sgl-e2" if reading.tp else "sgl-e3")
        parts = [model if model is not None else "?"]
        if reading.tp:
            parts.append(f"tp{reading.tp[1]}")
        if reading.pp:
            parts.append(f"pp{reading.pp[0]}")
        if reading.cp:
            parts.append(f"cp{reading.cp[1]}")
        if reading.dcp:
            parts.append(f"tp{reading.dcp[0]}dcp{reading.dcp[2]}page{reading.dcp[3]}")
        if reading.era != "e4":
            parts.append(scheme)
        deployment = "sglang:" + ":".join(parts)
        label = deployment + (f".{pool}" if pool else "")
        return Deployment(key, reading, pool, facts, model, kv_kind, scheme, label, deployment)

    # --- verdicts ----------------------------------------------------------------------

    def flat_verdicts(self, dep: Deployment, files: list[tuple[FlatFile, Reading]], names: Container[str],
                      hashed: bool) -> Iterator[dict[str, Any]]:
        """The row of every file of some whole pages of a deployment (sglang.md §3):
        status, action, reason, rank and target name. `files`: every file of the
        deployment with one of these page hashes, in the order of page hashes and then of
        the deployment's suffixes; `names`: every entry of the directory that may share
        these page hashes (a target that exists is already present)."""
        modal = dep.modal
        zipped = {f.name for f, _ in files if f.head is not None and f.head.startswith(ZIP_MAGIC)}
        ranks_of: dict[str, set[int]] = defaultdict(set)
        worker: dict[Reading, tuple[int, int]] = {}  # (few readings: one per suffix)
        writers = 1
        for f, r in files:
            w = worker.get(r) or worker.setdefault(r, r.worker())
            rank, writers = w
            if writers > 1:  # (one writer: every page is whole; no set a page)
                ranks_of[page_of(f).hex].add(rank)
        replicas = dep.reading.era == "e23" and dep.reading.tp is not None and dep.kv_kind == "mla"
        copies: dict[str, list[bytes | None]] = defaultdict(list)
        primary: dict[str, int] = {}  # e2 MLA copies: page hash -> the rank placed
        if replicas:
            for f, _ in files:
                copies[page_of(f).hex].append(f.content)
            primary = _primaries(files, copies, zipped, modal)
        if writers > 1:
            files.sort(key=lambda fr: (page_of(fr[0]).hex, worker[fr[1]][0]))
        for f, r in files:
            row = {"name": f.name, "rank": worker[r][0], "hex": page_of(f).hex, "status": "ok",
                   "action": "none", "reason": "", "target": None}
            self._verdict(dep, f, r, row, names, hashed, zipped, modal, replicas, copies, ranks_of, writers, primary)
            yield row

    def _verdict(self, dep: Deployment, f: FlatFile, r: Reading, row: dict, names: Container[str], hashed: bool,
                 zipped: set[str], modal: int | None, replicas: bool, copies: Mapping[str, list],
                 ranks_of: Mapping[str, set[int]], writers: int, primary: Mapping[str, int]) -> None:
        """One file's status, action, reason and target (sglang.md §3), written into `row`."""
        if f.size == 0:
            row["status"], row["reason"] = "short", "empty file"
            return
        if f.all_zero:
            row["status"], row["reason"] = "zero_filled", f"all {f.size} bytes are zero (crash residue)"
            return
        if f.name in zipped:
            row["status"] = "unsupported_layout"
            row["reason"] = ("torch.save zip payload (SGLang 0.4.9.post3 - 0.4.10.post1): pickled tensors, "
                             "no raw reader; never migrated")
            return
        if modal is not None and f.size != modal:
            row["status"] = "size_mismatch"
            row["reason"] = (f"{f.size} bytes, the deployment's other pages have {modal} "
                             "(SGLang 0.5.23 raises on a short read and truncates a long one)")
            return
        page = page_of(f)
        if replicas:
            agree = Counter(c for c in copies[page.hex] if c is not None)
            if len(agree) > 1:
                top, n = agree.most_common(1)[0]
                if n * 2 <= sum(agree.values()) or f.content != top:
                    row["status"] = "replica_mismatch"
                    row["reason"] = "MLA copy differs from the other ranks' copies of this page"
                    return
        elif dep.kv_kind is not None and writers > 1 and len(ranks_of[page.hex]) < writers:
            missing = sorted(set(range(writers)) - ranks_of[page.hex])
            row["status"] = "incomplete"
            row["reason"] = (f"page missing for writer(s) {', '.join(map(str, missing))} of {writers}: "
                             "the engine needs every rank's file")
            return
        self._action(dep, f, r, row, names, replicas, copies, hashed, primary)
        decided = dep.decided.get(page.suffix)
        if decided and type(row["reason"]) is str:  # (a typed reason keeps its finding)
            row["reason"] += f"; {decided}"

    def _action(self, dep: Deployment, f: FlatFile, r: Reading, row: dict, names: Container[str], replicas: bool,
                copies: Mapping[str, list], hashed: bool, primary: Mapping[str, int]) -> None:
        facts = dep.facts
        page = page_of(f)
        if dep.reading.era == "e23":
            if dep.kv_kind is None:
                row["reason"] = finding_reason(
                    f"{f.name[64:]!r} is read several ways (e1, e2 or e3; MLA copies or head shards): "
                    f"set 'kv_kind' for key {page.suffix!r} in --facts (or --kv-kind)", NEEDS_FACT,
                    asks=asks("--kv-kind"))
                return
            if dep.model is None:
                row["reason"] = finding_reason(
                    f"e1-e3 names carry no model name: set 'model_name' for key {page.suffix!r} in --facts "
                    "(or --model-name), the served model name of the deployment", NEEDS_FACT,
                    asks=asks("--model-name"))
                return
        writer = getattr(facts, "writer_layout", None) or _layout_of_release(getattr(facts, "writer_release", None))
        if writer is None and dep.reading.era == "e23":
            writer = LAYOUT_DEFAULT_BEFORE  # every e1-e3 release defaulted to layer_first
        target_layout = getattr(facts, "target_layout", None) or LAYOUT_DEFAULT_AFTER
        if writer is None:
            row["action"] = "needs_relayout"
            row["reason"] = finding_reason(
                "the page layout of 0.5.2 - 0.5.23 writers is unrecorded (layer_first up to 0.5.13, page_first "
                "from 0.5.14): set 'writer_layout' or 'writer_release' in --facts (or --writer-layout); "
                "SGLang would read these pages in place, possibly wrongly", NEEDS_FACT,
                asks=asks("--writer-layout"))
            return
        if replicas and r.tp and r.tp[0] != primary.get(page.hex, r.tp[0]):
            first = primary[page.hex]
            row["reason"] = finding_reason(f"replica of rank {first} (one file places the page)", REPLICA_OF_PRIMARY,
                                           primary_rank=first)
            return
        if _byte_order(writer) != _byte_order(target_layout):
            self._relayout(dep, f, r, row, writer, target_layout)
            return
        if dep.reading.era == "e4":
            row["action"], row["reason"], row["target"] = "already_present", "SGLang 0.5.23 reads this name", f.name
            return
        target = _target_name(dep, page, r)
        row["target"] = target
        if target in names:
            row["action"], row["reason"] = "already_present", f"{target} exists"
            return
        row["action"] = "link"
        row["reason"] = f"SGLang 0.5.23 reads this page as {target}"
        if replicas and not hashed:
            row["reason"] += "; MLA copies not yet compared (scan --verify hash)"

    def _relayout(self, dep: Deployment, f: FlatFile, r: Reading, row: dict, writer: str, target: str) -> None:
        """A page whose layout the target reads differently (sglang.md §3): `relayout` into
        --dest DIR when the geometry proves its size, else `needs_relayout` naming the facts."""
        head = f"written {writer}, read {target} by the target: a relayout of the L and P axes"
        geo = _geometry(_fact_values(dep.facts), r, dep.kv_kind, dep.pool, writer, f.size)
        if geo.spec is None and geo.size_off:
            row["status"], row["reason"] = "size_mismatch", f"{head} cannot apply: {geo.why}"
            return
        if geo.spec is None:
            row["action"] = "needs_relayout"
            row["reason"] = finding_reason(f"{head} {geo.why}", NEEDS_FACT, asks=asks(*geo.flags)) if geo.flags \
                else f"{head}: {geo.why}"
            return
        row["action"] = "relayout"
        row["target"] = f.name if dep.reading.era == "e4" else _target_name(dep, page_of(f), r)
        row["reason"] = f"{head} ({geo.why}), written into --dest DIR as {row['target']}"

    def flat_relayout(self, fields: Mapping[str, Any], facts: Mapping[str, Any], name: str, size: int
                      ) -> dict[str, int]:
        """The relayout geometry of a page file, re-proven from the namespace's fields and
        facts (the plan's check of a `relayout` row): {halves, B, T, P} of the source's
        order; raises ValueError naming what is not proven."""
        page = parse_page_name(name)
        reading = read_suffix(page.suffix, page.pool, model=facts.get("model_name"),
                              kv_kind=fields.get("kv_kind")) if page is not None else None
        if page is None or reading is None:
            raise ValueError(f"{name!r} is not a page name")
        writer = facts.get("writer_layout") or _layout_of_release(facts.get("writer_release")) or (
            LAYOUT_DEFAULT_BEFORE if reading.era == "e23" else None)
        target = facts.get("target_layout") or LAYOUT_DEFAULT_AFTER
        if writer is None or _byte_order(writer) == _byte_order(target):
            raise ValueError(f"the facts give no layout change ({writer or 'unknown'} -> {target})")
        geo = _geometry(facts, reading, fields.get("kv_kind"), page.pool, writer, size)
        if geo.spec is None:
            raise ValueError(geo.why)
        return geo.spec

    # --- the Family interface for the shared stages -------------------------------------

    def target(self, fields: dict, facts: Any, profile: str) -> Target:
        return Target(profile=PROFILE, family=self.name, fields=None, d12=None, base_name=None, rank_dir=None,
                      parallel_agnostic=False, replicated_layout=False, reasons=[])

    def block_ranks(self, fields: Mapping[str, Any], present: Iterable[int] = (0,)) -> tuple[int, ...]:
        """The ranks whose files are copies of one page: the e2 MLA writers (each wrote
        the whole page under its `_{r}_{N}` name); any other file is a page of its own
        (a head shard, a stage, a pool), placed by its own link."""
        if fields.get("scheme") == "sgl-e2" and fields.get("kv_kind") == "mla":
            return tuple(range(int(fields.get("writers", 1))))
        return (0,)

    def flat_page_hex(self, name: str) -> str | None:
        page = parse_page_name(name) if "/" not in name else None
        return page.hex if page is not None else None

    def flat_target(self, source_base: str, fields: Mapping[str, Any]) -> str:
        """An e4 deployment is its own target; an e1-e3 one becomes the e4 deployment of
        its model: `sglang:{model}:tp{N}` (non-MLA, and `.mamba` files), `sglang:{model}`
        (MLA), the pool appended, as `discover` labels the names `target_suffix` makes."""
        model = fields.get("model")
        if fields.get("scheme") == "sgl-e4" or not model:
            return source_base
        pool = fields.get("pool")
        mla = fields.get("kv_kind") == "mla" and pool != "mamba"
        return f"sglang:{model}" + ("" if mla else f":tp{int(fields.get('writers', 1))}") + (f".{pool}" if pool else "")

    def kv_kind(self, fields: Mapping[str, Any], facts: Mapping[str, Any]) -> str | None:
        return fields.get("kv_kind") or facts.get("kv_kind")

    def scheme_of(self, fields: Mapping[str, Any]) -> str:
        return fields.get("scheme", "sgl-e4")

    def source_problems(self, fields: Mapping[str, Any]) -> list[str]:
        return []

    def unknown_keys(self, fields: Mapping[str, Any]) -> list[str]:
        return []


def _hazards(dep: Deployment) -> list[str]:
    """What the engine does to this directory that an offline tool must respect (sglang.md §4)."""
    facts = dep.facts
    writer = getattr(facts, "writer_layout", None) or _layout_of_release(getattr(facts, "writer_release", None))
    source = facts.sources.get("writer_layout") or facts.sources.get("writer_release")
    if writer is None and dep.reading.era == "e23":
        writer, source = LAYOUT_DEFAULT_BEFORE, "the default of every e1-e3 release"
    target = getattr(facts, "target_layout", None) or LAYOUT_DEFAULT_AFTER
    out = []
    if dep.reading.era == "e23" and dep.reading.tp is not None:
        out.append("a running SGLang 0.4.9.post4 - 0.5.1.post3 engine rewrites its `_{r}_{N}` pages in place, on the "
                   "same inode (its exists() check adds the suffix twice): link from this directory only while that "
                   "engine is stopped, or use --mode copy")
    out.append("no file records dtype, layout, revision or page size: assumed writer layout "
               f"{writer or 'unknown'}{f' ({source})' if writer and source else ''}, target layout {target}; "
               "SGLang's LRU evictor (0.5.14+) orders by mtime and evicts by unlink (links share one mtime, "
               "unlinking one name frees nothing), clear() deletes every regular file of the directory (other "
               "models' too), and the metadata cache (0.5.16+) may show a file removed offline for its TTL")
    return out


DTYPE_BYTES = {"half": 2, "float16": 2, "bfloat16": 2, "float": 4, "float32": 4}  # model_dtype -> element bytes
GEOMETRY_FLAGS = {"layers": "--layers", "page_tokens": "--page-tokens", "kv_heads": "--kv-heads",
                  "head_dim": "--head-dim", "latent_dim": "--latent-dim", "dtype_bytes": "--dtype-bytes"}


def _byte_order(layout: str) -> str:
    """The byte order of a page layout (sglang.md §2): `page_first_direct`, [2, 1, L, P, H, D]
    or [1, L, P, 1, dim], holds its bytes in `layer_first` order (its extra axis is 1)."""
    return "page_first" if layout == "page_first" else "layer_first"


@dataclass(frozen=True)
class _Geometry:
    spec: dict[str, int] | None  # halves, B, T, P of the source's order (B x T cells of P bytes per half)
    why: str  # the numbers (proven), or what is missing or disagrees
    flags: tuple[str, ...] = ()  # the flags of the missing facts
    size_off: bool = False  # every fact is given and the file's size is not the page's


def _fact_values(facts: Any) -> dict[str, Any]:
    return facts.to_dict() if hasattr(facts, "to_dict") else dict(facts)


def _geometry(facts: Mapping[str, Any], reading: Reading, kv_kind: str | None, pool: str | None, writer: str,
              size: int) -> _Geometry:
    """A KV page's relayout, proven from the facts (sglang.md §2): MHA [2, L, P, H, D] or MLA
    [L, P, 1, dim] in layer_first order (L and P swapped in page_first), of b-byte elements."""
    if pool is not None:
        return _Geometry(None, f"is not defined for the {pool} pool (sglang.md §2 gives the KV pool's pages)")
    if kv_kind not in ("mla", "full"):
        return _Geometry(None, "needs the kv kind: set 'kv_kind' (--kv-kind)", ("--kv-kind",))
    got = {k: facts.get(k) for k in ("layers", "page_tokens", "latent_dim" if kv_kind == "mla" else "head_dim")}
    got["dtype_bytes"] = facts.get("dtype_bytes") or DTYPE_BYTES.get(facts.get("model_dtype") or "")
    tp = reading.tp[1] if reading.tp else 1
    if kv_kind != "mla":
        total = facts.get("total_kv_heads")
        got["kv_heads"] = facts.get("kv_heads") or (max(1, total // tp) if total else None)
    missing = [k for k, v in got.items() if not v]
    if missing:
        return _Geometry(None, "needs the geometry facts " + ", ".join(missing) + " (--facts, or "
                         + " ".join(GEOMETRY_FLAGS[k] for k in missing) + ")",
                         tuple(GEOMETRY_FLAGS[k] for k in missing))
    have: dict[str, int] = {k: v for k, v in got.items() if v}  # (every one: none is missing)
    L, P, b = have["layers"], have["page_tokens"], have["dtype_bytes"]
    if kv_kind == "mla":
        halves, cell, formula = 1, have["latent_dim"] * b, f"L·P·dim·b = {L}·{P}·{have['latent_dim']}·{b}"
    else:
        halves, cell = 2, have["kv_heads"] * have["head_dim"] * b
        formula = f"2·L·P·H·D·b = 2·{L}·{P}·{have['kv_heads']}·{have['head_dim']}·{b}"
    want = halves * L * P * cell
    if want != size:
        return _Geometry(None, f"the geometry gives {formula} = {want} bytes, the file has {size}", size_off=True)
    rows, cols = (L, P) if _byte_order(writer) == "layer_first" else (P, L)
    return _Geometry({"halves": halves, "B": rows, "T": cols, "P": cell}, f"{formula} = {size} bytes")


def _primaries(files: list[tuple[FlatFile, Reading]], copies: Mapping[str, list], zipped: set[str],
               modal: int | None) -> dict[str, int]:
    """page hash -> the rank of the e2 MLA copy one link places: the lowest whose copy is
    healthy (not empty, all zero, a zip payload or off-size) and agrees with the others'
    majority (any healthy one when they were not compared: the apply compares them)."""
    top = {}
    for hexh, contents in copies.items():
        agree = Counter(c for c in contents if c is not None)
        if len(agree) > 1:
            value, n = agree.most_common(1)[0]
            top[hexh] = value if n * 2 > sum(agree.values()) else None  # (no majority: none agrees)
    out: dict[str, int] = {}
    for f, r in files:
        hexh = page_of(f).hex
        if (not r.tp or f.size == 0 or f.all_zero or f.name in zipped or modal is not None and f.size != modal
                or hexh in top and f.content != top[hexh]):
            continue
        out[hexh] = min(out.get(hexh, r.tp[0]), r.tp[0])
    return out


def _layout_of_release(release: Any) -> str | None:
    """The --hicache-mem-layout default of a release: layer_first up to 0.5.13, page_first from 0.5.14
    (a list of releases, which only LMCache tiers take, decides none)."""
    if not release or not isinstance(release, str):
        return None
    nums = [int(x) for x in re.findall(r"\d+", release)[:3]]
    nums += [0] * (3 - len(nums))
    return LAYOUT_DEFAULT_BEFORE if tuple(nums) <= (0, 5, 13) else LAYOUT_DEFAULT_AFTER


FAMILY = SGLang()
