"""A reference reader for migration tests: what the target engine would load.

Given a target identity (the `target` entry of a manifest namespace: family, fields,
base_name) and a block key, it computes the path the target engine opens and applies
that engine's load rule, independently of kvmigrate's migration code:

* vLLM fs tier: `<base>_r0/<hhh>/<hh>_g<group>/<hex>.bin`; read exactly the row size of
  the deployment; a short read is a miss (the engine deletes such a file; this reader
  only reports it); a longer file is accepted and only the row is returned.
* vllm.cpp: `<base>_r<rank>/...`; the header checks in the engine's order
  (`formats.vllmcpp.verify_header` with the identity digest, page size and key), then
  exactly `payload_size` bytes of payload.

For transformed rows (slice, concat, relayout) `load_pages` goes one step further and
takes the row apart the way a vLLM worker does: worker w's cell at `w × cell`, tensor t
of that cell at `t × B × P`, GPU block b of that tensor at `+ b × P`; `row_page_errors`
compares every page with the page the source writer stored (`synth.page_bytes_for`)
and the pad with zeros.

Also here: tree snapshots used by the safety tests (every file's inode, size, mtime,
mode and content hash; a full listing to prove a dry run wrote nothing).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmigrate import layout
from kvmigrate.formats import vllmcpp
from kvmigrate.identity import canonical

ROW_ALIGN = 4096


@dataclass(frozen=True)
class Load:
    """Outcome of one load: `data` is None on a miss; `why` names the failing rule."""

    path: str
    data: bytes | None
    why: str | None = None


class ReferenceReader:
    def __init__(self, root: str | os.PathLike[str], target: dict[str, Any]):
        self.root = Path(root)
        self.family = target["family"]
        self.fields = target["fields"]
        self.base = layout.base_name(self.fields["model_name"], canonical.d12(self.fields, self.family))
        assert self.base == target.get("base_name", self.base), "target base name disagrees with its fields"
        self.rank = int(self.fields.get("rank", 0)) if self.family == "vllmcpp" else 0

    def relpath(self, hex_hash: str, group: int) -> str:
        """The path the engine opens for a block key (vLLM: always rank folder _r0)."""
        return layout.block_relpath(self.base, self.rank, hex_hash, group)

    def load(self, hex_hash: str, group: int, row_size: int | None = None) -> Load:
        rel = self.relpath(hex_hash, group)
        path = self.root / rel
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return Load(rel, None, "absent")
            raise
        try:
            if self.family == "vllmcpp":
                return self._load_vllmcpp(fd, rel, hex_hash, group)
            assert row_size is not None, "a vLLM reader needs the deployment's row size"
            data = _read_exact(fd, row_size)
            if len(data) < row_size:
                return Load(rel, None, f"short read ({len(data)} < {row_size})")
            return Load(rel, data)
        finally:
            os.close(fd)

    def load_pages(self, hex_hash: str, group: int, *, cells: int, tensors: int, blocks_per_file: int,
                   page: int) -> tuple[Load, dict[tuple[int, int, int], bytes]]:
        """Load a vLLM row of `cells` worker cells, each [T][B][P], and split it into its
        pages keyed (worker, tensor, gpu block), at the offsets a vLLM worker reads."""
        cell = tensors * blocks_per_file * page
        row_size = -(-cells * cell // ROW_ALIGN) * ROW_ALIGN
        got = self.load(hex_hash, group, row_size=row_size)
        pages: dict[tuple[int, int, int], bytes] = {}
        if got.data is None:
            return got, pages
        for w in range(cells):
            for t in range(tensors):
                for b in range(blocks_per_file):
                    off = w * cell + t * blocks_per_file * page + b * page
                    pages[(w, t, b)] = got.data[off:off + page]
        return got, pages

    def _load_vllmcpp(self, fd: int, rel: str, hex_hash: str, group: int) -> Load:
        digest = hashlib.sha256(canonical.canonical_bytes(self.fields, "vllmcpp")).digest()
        payload_size = int(self.fields["page_size_bytes"])
        header = _read_exact(fd, vllmcpp.HEADER_SIZE)
        failed = vllmcpp.verify_header(header, digest=digest, payload_size=payload_size,
                                       key=vllmcpp.make_key(bytes.fromhex(hex_hash), group))
        if failed:
            return Load(rel, None, f"header check {failed}")
        payload = _read_exact(fd, payload_size)
        if len(payload) < payload_size:
            return Load(rel, None, "short payload")
        return Load(rel, payload)

    def keys_on_disk(self) -> set[tuple[str, int]]:
        """(hex, group) of every `.bin` file in the target rank folder (what an engine's
        index scan would consider)."""
        out = set()
        top = self.root / layout.rank_dir_name(self.base, self.rank)
        if not top.is_dir():
            return out
        for dirpath, _dirs, files in os.walk(top):
            rel = os.path.relpath(dirpath, top).split(os.sep)
            for name in files:
                if len(rel) == 2:
                    b = layout.parse_block(rel[0], rel[1], name)
                    if b is not None and not b.misfiled:
                        out.add((b.hex_hash, b.group))
        return out


def _read_exact(fd: int, n: int) -> bytes:
    parts = []
    while n > 0:
        buf = os.read(fd, n)
        if not buf:
            break
        parts.append(buf)
        n -= len(buf)
    return b"".join(parts)


def pad_row(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % ROW_ALIGN)


def expected_vllm_row(ns: dict[str, Any], hex_hash: str, group: int, cells: int) -> bytes:
    """A vLLM row built directly from the pages the source writer stored:
    [W0 cell]...[W(cells-1) cell] + zero pad, each cell tensor-major [T][B][P] of rank w's
    shard (MLA pages are the same on every rank)."""
    from kvmigrate.synth import page_bytes_for

    body = b"".join(page_bytes_for(ns, hex_hash=hex_hash, group=group, rank=w, tensor=t, gpu_block=b)
                    for w in range(cells) for t in ns["tensors"] for b in range(ns["blocks_per_file"]))
    return pad_row(body)


def row_page_errors(reader: ReferenceReader, ns: dict[str, Any], hex_hash: str, group: int, *,
                    cells: int) -> list[str]:
    """Every page of a migrated row compared with what the source writer stored on the
    worker that owns that cell (rank w; MLA pages are the same on every rank), and the
    pad after the cells compared with zeros. Returns the differences (empty: all found)."""
    from kvmigrate.synth import page_bytes_for

    T, B, P = len(ns["tensors"]), ns["blocks_per_file"], ns["page_bytes"]
    got, pages = reader.load_pages(hex_hash, group, cells=cells, tensors=T, blocks_per_file=B, page=P)
    if got.data is None:
        return [f"{got.path}: not loaded ({got.why})"]
    errors = []
    for (w, t, b), page in sorted(pages.items()):
        want = page_bytes_for(ns, hex_hash=hex_hash, group=group, rank=w, tensor=ns["tensors"][t], gpu_block=b)
        if page != want:
            errors.append(f"{got.path}: worker {w} tensor {t} block {b} at offset "
                          f"{w * T * B * P + t * B * P + b * P} is not the page the source stored")
    if got.data[cells * T * B * P:].strip(b"\0"):
        errors.append(f"{got.path}: the pad after {cells} cells is not zero")
    size = os.stat(reader.root / got.path).st_size
    if size != len(got.data):
        errors.append(f"{got.path}: {size} bytes on disk, the row is {len(got.data)}")
    return errors


def expected_vllmcpp_payload(ns: dict[str, Any], hex_hash: str, group: int, rank: int) -> bytes:
    from kvmigrate.synth import page_bytes_for

    return b"".join(page_bytes_for(ns, hex_hash=hex_hash, group=group, rank=rank, tensor=t, gpu_block=0)
                    for t in ns["tensors"])


# --- the namespace vLLM 0.34 reads --------------------------------------------------------

def vllm034_fields(ns: dict[str, Any]) -> dict[str, Any]:
    """The identity vLLM 0.34 computes for the deployment that wrote synth namespace `ns`
    (a vLLM writer: its true tp, pp, kind, canonical and replicated settings), from the
    engine's own rules (identity.md §4.1; offloading/config.py:191-264 and FileMapper of
    the 0.34.0 wheel), not from kvmigrate's code. Direct layouts are never agnostic; a
    canonical one is when certified (synth MLA, or heads that tp splits, and pp = dcp = 1);
    MLA is replicated at tp > 1 with pp = dcp = 1 (mp executor, one node), and a certified
    canonical MLA layout always."""
    src = ns["fields"]
    tp, pp, dcp, mla = ns["tp"], ns["pp"], ns["dcp"], ns["kv_kind"] == "mla"
    if ns["canonical"]:
        agnostic = pp == 1 and dcp == 1 and (mla or 8 % tp == 0)
        replicated = agnostic and mla
    else:
        agnostic, replicated = False, mla and tp > 1 and pp == 1 and dcp == 1
    collapsed = agnostic or replicated
    if "hash_block_size" in src:  # an S1 writer: block size x dcp tokens per block
        groups = [{"tokens_per_block": g["block_size"] * dcp, "layer_names": g["layer_names"]}
                  for g in src["kv_cache_groups"]]
        per_hash, per_file = src["hash_block_size"] * dcp, src["gpu_blocks_per_file"]
    else:
        groups, per_hash, per_file = src["kv_cache_groups"], src["tokens_per_hash"], src["blocks_per_file"]
    fields: dict[str, Any] = {
        "model_name": src["model_name"], "tokens_per_hash": per_hash, "blocks_per_file": per_file,
        "tp_size": 1 if collapsed else tp, "pp_size": 1 if collapsed else pp, "pcp_size": 1,
        "dcp_size": 1 if collapsed else dcp, "dtype": "bfloat16" if src["dtype"] == "auto" else src["dtype"],
        "kv_cache_groups": groups, "inference_engine": "vllm"}
    if not collapsed:
        fields["parallel_agnostic"] = False
    if replicated:
        fields["replicated_layout"] = True
    if ns["canonical"]:
        fields["canonical_format"] = src["canonical_format"]
    return fields


def vllm034_base(ns: dict[str, Any]) -> str:
    """The base folder vLLM 0.34 reads for the writer of synth namespace `ns`."""
    fields = vllm034_fields(ns)
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return f"{fields['model_name'].replace('/', '_')}_{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def vllm034_config_bytes(ns: dict[str, Any]) -> bytes:
    """The config.json the 0.34 fs tier writes into that folder (json.dump, indent 2, sorted keys)."""
    return json.dumps(vllm034_fields(ns), indent=2, sort_keys=True).encode()


# --- tree snapshots -----------------------------------------------------------------------

def _sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_facts(root: str | os.PathLike[str], relpaths: Iterable[str]) -> dict[str, tuple]:
    """(inode, size, mtime_ns, mode, sha256) per file: what safety rule 1 keeps equal."""
    out = {}
    for rel in relpaths:
        p = os.path.join(root, rel)
        st = os.lstat(p)
        out[rel] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode,
                    _sha(p) if stat.S_ISREG(st.st_mode) and os.access(p, os.R_OK) else None)
    return out


def listing(root: str | os.PathLike[str], *, exclude_top: tuple[str, ...] = (),
            with_times: bool = True) -> dict[str, tuple]:
    """Every entry under root (never following symlinks): type, size, inode, mtime and
    content hash of regular files; folders with their mtime (a created or removed entry
    changes it)."""
    root = str(root)
    out: dict[str, tuple] = {}
    for dirpath, dirs, files in os.walk(root, followlinks=False):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == ".":
            dirs[:] = [d for d in dirs if d not in exclude_top]
            files = [f for f in files if f not in exclude_top]
        for name in dirs + files:
            rel = os.path.normpath(os.path.join(rel_dir, name))
            p = os.path.join(root, rel)
            st = os.lstat(p)
            kind = stat.S_IFMT(st.st_mode)
            digest = _sha(p) if stat.S_ISREG(st.st_mode) and os.access(p, os.R_OK) else None
            if stat.S_ISLNK(st.st_mode):
                digest = os.readlink(p)
            times = (st.st_mtime_ns,) if with_times else ()
            out[rel] = (kind, st.st_size if not stat.S_ISDIR(st.st_mode) else 0, st.st_ino, *times, digest)
    return out


def content_listing(root: str | os.PathLike[str], *, exclude_top: tuple[str, ...] = (".kvmigrate",),
                    sources: dict[int, str] | None = None) -> dict[str, tuple]:
    """Entries by (type, content hash, which source file it is a hard link of): two runs
    on identical trees compare equal regardless of inode numbers and times."""
    out = {}
    for rel, entry in listing(root, exclude_top=exclude_top, with_times=False).items():
        kind, size, ino, digest = entry
        out[rel] = (kind, size, digest, (sources or {}).get(ino) if kind == stat.S_IFREG else None)
    return out
