"""Defects injected into a freshly built tree, each recorded with the finding it must cause.

Every defect picks a deterministic victim and adds one record to `SynthResult.defects`:

    name       the defect
    relpath    the file or folder it affects (for a removed file: where it was)
    status     what the scanner must give the rows in `rows` (interface.md §2)
    reason     a fragment the manifest reason should contain (compare case-insensitively)
    rows       relpaths whose manifest row must carry `status`
    base_name, block, group, rank     where it happened (block/group/rank may be None)
    namespace_status                  for namespace-level defects: the namespace status

| defect | victim | status | reason fragment |
|---|---|---|---|
| missing_rank | last rank's file of a block removed (llm-d, vllm.cpp tp>1) | incomplete (other ranks' rows) | missing |
| replica_differs | last rank's MLA replica altered, same size | replica_mismatch (every replica; needs --verify hash) | differ |
| size_mismatch | rank 0's file truncated to 3/4 (vllm.cpp: payload cut) | size_mismatch | size |
| short | vllm/llm-d: emptied; vllm.cpp: cut to 64 bytes | short | empty / header |
| zero_filled | rank 0's file overwritten with zeros, same size | zero_filled | zero |
| misfiled | every rank's file of a block moved to the next `<hhh>` bucket | misfiled | fan-out |
| unreadable | rank 0's file chmod 000 (root reads it anyway: `effective` False) | unreadable | permission |
| padded_legacy | llm-d: every rank's file of a block padded to 16 MiB with stale bytes | padded_legacy | padded |
| header_magic, _key_size, _version, _digest, _payload_size, _key | vllm.cpp rank 0's header field corrupted | header_invalid | magic, key_size, format_version, digest, payload_size, key |
| tmp_vllm | `<hex>.bin_<digits>.tmp` in rank 0's fan-out | tmp_leftover | leftover |
| tmp_cpp_block | `<hex>.bin.<pid>.<n>.tmp` in rank 0's fan-out | tmp_leftover | leftover |
| tmp_cpp_config | `config.json.<pid>.<n>.tmp` in the base folder | tmp_leftover | leftover |
| tmp_probe | `.o_direct_probe_<digits>.tmp` in the base folder | tmp_leftover | leftover |
| foreign | `README.txt` in rank 0's folder | foreign | unexpected |
| symlink | `<hex>.bin` symlink in a fan-out, pointing outside the root | foreign | symlink |
| fifo | `<hex>.bin` FIFO in a fan-out | foreign | fifo |
| config_missing | the base folder's config.json removed | orphan_namespace (every block row of the namespace) | config.json |
| config_unparsable | config.json cut in half | config_invalid (config.json and every block row) | json |
| digest_mismatch | config.json rewritten with another dtype | digest_mismatch (config.json and every block row) | digest |
| deep_layout | an old llm-d deep tree `<model>/block_size_*/tp_*_pp_size_*_pcp_size_*/rank_0/<dtype>/…` | unsupported_layout | deep |
| pp_stage | llm-d pp=2: one base folder per stage (recorded per stage, also for any pp>1) | unsupported_layout | pipeline stage |
| orphan_rank | a rank folder `<model>_<d12>_r0` whose base folder does not exist | orphan_namespace | base folder |

Block defects take blocks from the end (index blocks-1, blocks-2, ...); block 0 always
stays healthy, so each (namespace, group) keeps a size reference.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmigrate import layout
from kvmigrate.formats.vllmcpp import make_key
from kvmigrate.identity.canonical import config_json_bytes, d12, full_digest
from kvmigrate.synth import pages
from kvmigrate.synth.files import block_file_bytes, write_file
from kvmigrate.synth.identities import Namespace, tensors_of
from kvmigrate.synth.spec import BLOCK_DEFECTS, SynthResult, SynthSpec
from kvmigrate.units import plural

LEGACY_FLOOR = 16 * 1024 * 1024  # llm-d CPU path before 0bdacb2: files padded to >= 16 MiB
SYMLINK_TARGET = "/etc/passwd"    # outside any test root; a scanner must never follow it
HEADER_CHECK = {
    "header_magic": "magic",
    "header_key_size": "key_size",
    "header_version": "format_version",
    "header_digest": "digest",
    "header_payload_size": "payload_size",
    "header_key": "key",
}
CONFIG_DEFECTS = ("config_missing", "config_unparsable", "digest_mismatch")


def _bad(msg: str) -> ValueError:
    return ValueError(f"synth: {msg}")


@dataclass
class Injector:
    root: Path
    spec: SynthSpec
    namespaces: list[Namespace]
    result: SynthResult
    taken: int = 0
    fresh: int = 0
    claimed: set[str] = field(default_factory=set)

    # -- where --------------------------------------------------------------------
    @property
    def primary(self) -> list[Namespace]:
        """The namespaces of one deployment stage: all vllm.cpp ranks, llm-d stage 0."""
        return self.namespaces if self.spec.family == "vllmcpp" else self.namespaces[:1]

    @property
    def ranks(self) -> list[int]:
        return [r for ns in self.primary for r in ns.ranks]

    def ns_of(self, rank: int) -> Namespace:
        return next(ns for ns in self.primary if rank in ns.ranks)

    def take_block(self, name: str) -> dict[str, Any]:
        """The next victim block (group 0), from the last key backwards."""
        self.taken += 1
        index = self.spec.blocks - self.taken
        if index < 1:
            n = sum(1 for d in self.spec.defects if d in BLOCK_DEFECTS)
            raise _bad(f"{plural(n, 'block defect')} need{'s' if n == 1 else ''} blocks >= {n + 1} "
                       "(block 0 stays healthy as the size reference)")
        block = next(b for b in self.result.blocks if b["group"] == 0 and b["index"] == index)
        block["defect"] = name
        return block

    def fresh_key(self) -> str:
        """A key no healthy block uses (for leftovers and intruders)."""
        self.fresh += 1
        return pages.block_hash_hex(self.spec.seed, self.spec.blocks + 1000 + self.fresh, self.spec.hash_len)

    def fanout_path(self, ns: Namespace, rank: int, hex_hash: str, filename: str) -> str:
        return f"{ns.rank_dir(rank)}/{hex_hash[0:3]}/{hex_hash[3:5]}_g0/{filename}"

    # -- what ----------------------------------------------------------------------
    def record(self, name: str, relpath: str, status: str, reason: str, rows: list[str], *,
               ns: Namespace | None = None, block: dict | None = None, rank: int | None = None,
               namespace_status: str | None = None, **extra: Any) -> dict[str, Any]:
        self.claimed.update(rows)
        rec = {"name": name, "relpath": relpath, "status": status, "reason": reason, "rows": rows,
               "base_name": ns.base_name if ns else None, "block": block["hex"] if block else None,
               "group": block["group"] if block else None, "rank": rank, "namespace_status": namespace_status}
        rec.update(extra)
        self.result.defects.append(rec)
        return rec

    def path(self, relpath: str) -> Path:
        return self.root / relpath


# -- block defects -----------------------------------------------------------------------

def missing_rank(inj: Injector, name: str) -> None:
    ranks = inj.ranks
    if len(ranks) < 2:
        raise _bad(f"{name} needs several ranks (tp >= 2)")
    block = inj.take_block(name)
    last = ranks[-1]
    relpath = block["files"][last]
    inj.path(relpath).unlink()
    block["files"][last] = None
    inj.record(name, relpath, "incomplete", "missing", [block["files"][r] for r in ranks[:-1]],
               ns=inj.ns_of(last), block=block, rank=last)


def replica_differs(inj: Injector, name: str) -> None:
    ranks = inj.ranks
    if len(ranks) < 2 or inj.spec.kv_kind != "mla":
        raise _bad(f"{name} needs MLA replicas: kv_kind mla and tp >= 2")
    block = inj.take_block(name)
    last = ranks[-1]
    relpath = block["files"][last]
    data = bytearray(inj.path(relpath).read_bytes())
    start = 128 if inj.spec.family == "vllmcpp" else 0
    for i in range(start, min(start + 16, len(data))):
        data[i] ^= 0xFF
    write_file(inj.path(relpath), bytes(data))
    inj.record(name, relpath, "replica_mismatch", "differ", [block["files"][r] for r in ranks],
               ns=inj.ns_of(last), block=block, rank=last, needs_verify="hash")


def _victim_file(inj: Injector, name: str) -> tuple[dict, int, str, bytes]:
    block = inj.take_block(name)
    rank = inj.ranks[0]
    relpath = block["files"][rank]
    return block, rank, relpath, inj.path(relpath).read_bytes()


def size_mismatch(inj: Injector, name: str) -> None:
    block, rank, relpath, data = _victim_file(inj, name)
    if inj.spec.family == "vllmcpp":
        payload = len(data) - 128
        new = data[:128 + payload * 3 // 4] if payload >= 2 else data + b"\1"
    else:
        new = data[:len(data) * 3 // 4] if len(data) >= 2 else data + b"\1"
    write_file(inj.path(relpath), new)
    inj.record(name, relpath, "size_mismatch", "size", [relpath], ns=inj.ns_of(rank), block=block, rank=rank,
               size=len(new), expected_size=len(data))


def short(inj: Injector, name: str) -> None:
    block, rank, relpath, data = _victim_file(inj, name)
    cpp = inj.spec.family == "vllmcpp"
    write_file(inj.path(relpath), data[:64] if cpp else b"")
    inj.record(name, relpath, "short", "header" if cpp else "empty", [relpath], ns=inj.ns_of(rank), block=block,
               rank=rank)


def zero_filled(inj: Injector, name: str) -> None:
    block, rank, relpath, data = _victim_file(inj, name)
    write_file(inj.path(relpath), bytes(len(data)))
    inj.record(name, relpath, "zero_filled", "zero", [relpath], ns=inj.ns_of(rank), block=block, rank=rank)


def misfiled(inj: Injector, name: str) -> None:
    block = inj.take_block(name)
    moved = []
    for rank in inj.ranks:
        relpath = block["files"][rank]
        rank_dir, bucket, fanout, filename = relpath.split("/")
        wrong = f"{(int(bucket, 16) + 1) % 4096:03x}"
        new_rel = f"{rank_dir}/{wrong}/{fanout}/{filename}"
        inj.path(new_rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(inj.path(relpath), inj.path(new_rel))
        block["files"][rank] = None
        moved.append(new_rel)
    inj.record(name, moved[0], "misfiled", "fan-out", moved, ns=inj.primary[0], block=block, rank=inj.ranks[0])


def unreadable(inj: Injector, name: str) -> None:
    block, rank, relpath, _ = _victim_file(inj, name)
    os.chmod(inj.path(relpath), 0)
    inj.record(name, relpath, "unreadable", "permission", [relpath], ns=inj.ns_of(rank), block=block, rank=rank,
               effective=os.geteuid() != 0)


def padded_legacy(inj: Injector, name: str) -> None:
    block = inj.take_block(name)
    rows = []
    stale: bytes | None = None
    for rank in inj.ranks:
        relpath = block["files"][rank]
        data = inj.path(relpath).read_bytes()
        if len(data) >= LEGACY_FLOOR:
            raise _bad(f"{name}: files of {len(data)} bytes are not below the 16 MiB floor")
        if stale is None:  # the same stale bytes on every rank, so MLA replicas stay equal
            stale = pages.stale_bytes(inj.spec.seed, f"padded:{block['hex']}", LEGACY_FLOOR - len(data))
        write_file(inj.path(relpath), data + stale)
        rows.append(relpath)
    inj.record(name, rows[0], "padded_legacy", "padded", rows, ns=inj.primary[0], block=block, rank=inj.ranks[0],
               data_size=len(data), size=LEGACY_FLOOR)


def header_defect(inj: Injector, name: str) -> None:
    block, rank, relpath, data = _victim_file(inj, name)
    ns = inj.ns_of(rank)
    header = bytearray(data[:128])
    if name == "header_magic":
        header[0:8] = b"VLCPPKV0"
    elif name == "header_key_size":
        struct.pack_into("<I", header, 12, 65)
    elif name == "header_version":
        struct.pack_into("<I", header, 8, 2)
    elif name == "header_digest":
        stale = dict(ns.fields, kv_dtype="fp16" if ns.fields["kv_dtype"] != "fp16" else "bf16")
        header[24:56] = bytes.fromhex(full_digest(stale, "vllmcpp"))
    elif name == "header_payload_size":
        struct.pack_into("<Q", header, 16, ns.fields["page_size_bytes"] * 2)
    elif name == "header_key":
        other = bytes.fromhex(pages.block_hash_hex(inj.spec.seed, 0, inj.spec.hash_len))
        header[56:120] = make_key(other, block["group"]).ljust(64, b"\0")
    write_file(inj.path(relpath), bytes(header) + data[128:])
    check = HEADER_CHECK[name]
    inj.record(name, relpath, "header_invalid", check, [relpath], ns=ns, block=block, rank=rank, check=check)


# -- leftovers and intruders -------------------------------------------------------------

def _partial_block(inj: Injector, ns: Namespace, rank: int, hex_hash: str) -> bytes:
    data = block_file_bytes(inj.spec, ns, hex_hash, 0, rank)
    return data[:len(data) // 2]


def tmp_vllm(inj: Injector, name: str) -> None:
    ns, rank, hex_hash = inj.primary[0], inj.ranks[0], inj.fresh_key()
    bits = 63 if inj.spec.family == "vllm" else 32  # vLLM: random 0..2**63-1; llm-d: a u32
    relpath = inj.fanout_path(ns, rank, hex_hash,
                              f"{hex_hash}.bin_{pages.deterministic_int(inj.spec.seed, name, bits)}.tmp")
    write_file(inj.path(relpath), _partial_block(inj, ns, rank, hex_hash))
    inj.record(name, relpath, "tmp_leftover", "leftover", [relpath], ns=ns, rank=rank)


def _cpp_suffix(inj: Injector, name: str) -> str:
    pid = 100 + pages.deterministic_int(inj.spec.seed, f"pid:{name}", 22)
    return f"{pid}.{1 + pages.deterministic_int(inj.spec.seed, f'n:{name}', 4)}.tmp"


def tmp_cpp_block(inj: Injector, name: str) -> None:
    ns, rank, hex_hash = inj.primary[0], inj.ranks[0], inj.fresh_key()
    relpath = inj.fanout_path(ns, rank, hex_hash, f"{hex_hash}.bin.{_cpp_suffix(inj, name)}")
    write_file(inj.path(relpath), _partial_block(inj, ns, rank, hex_hash))
    inj.record(name, relpath, "tmp_leftover", "leftover", [relpath], ns=ns, rank=rank)


def tmp_cpp_config(inj: Injector, name: str) -> None:
    ns = inj.primary[0]
    relpath = f"{ns.base_name}/{layout.CONFIG_NAME}.{_cpp_suffix(inj, name)}"
    write_file(inj.path(relpath), ns.config_bytes)
    inj.record(name, relpath, "tmp_leftover", "leftover", [relpath], ns=ns)


def tmp_probe(inj: Injector, name: str) -> None:
    ns = inj.primary[0]
    relpath = f"{ns.base_name}/.o_direct_probe_{pages.deterministic_int(inj.spec.seed, name, 63)}.tmp"
    write_file(inj.path(relpath), bytes(4096))
    inj.record(name, relpath, "tmp_leftover", "leftover", [relpath], ns=ns)


def foreign(inj: Injector, name: str) -> None:
    ns, rank = inj.primary[0], inj.ranks[0]
    relpath = f"{ns.rank_dir(rank)}/README.txt"
    write_file(inj.path(relpath), b"Cache volume of the staging cluster. Do not delete.\n")
    inj.record(name, relpath, "foreign", "unexpected", [relpath], ns=ns, rank=rank)


def _intruder(inj: Injector, name: str, reason: str, make: Callable[[Path], None], **extra: Any) -> None:
    """A non-regular file named like a block (a fresh key) in rank 0's fan-out."""
    ns, rank, hex_hash = inj.primary[0], inj.ranks[0], inj.fresh_key()
    relpath = inj.fanout_path(ns, rank, hex_hash, f"{hex_hash}.bin")
    path = inj.path(relpath)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.exists():  # a rebuild over the same tree
        path.unlink()
    make(path)
    inj.record(name, relpath, "foreign", reason, [relpath], ns=ns, rank=rank, **extra)


def symlink(inj: Injector, name: str) -> None:
    _intruder(inj, name, "symlink", lambda path: os.symlink(SYMLINK_TARGET, path), target=SYMLINK_TARGET)


def fifo(inj: Injector, name: str) -> None:
    _intruder(inj, name, "fifo", os.mkfifo)


def deep_layout(inj: Injector, name: str) -> None:
    """An old llm-d deep tree (layout L2) of the same model, holding the first two keys."""
    spec = inj.spec
    top = spec.model_name.lstrip("/")  # L1/L2 join the model verbatim: an HF id nests two folders
    prefix = (f"{top}/block_size_{spec.block_tokens}_blocks_per_file_{spec.blocks_per_file}/"
              f"tp_{spec.tp}_pp_size_{spec.pp}_pcp_size_1/rank_0/{spec.dtype}")
    rows = []
    for index in range(min(2, spec.blocks)):
        hex_hash = pages.block_hash_hex(spec.seed, index, spec.hash_len)
        relpath = f"{prefix}/{layout.block_relpath_in_rank(hex_hash, 0)}"
        data = pages.llmd_file_bytes(spec, hex_hash=hex_hash, group=0, rank=0, tensors=tensors_of(spec),
                                     blocks_per_file=spec.blocks_per_file)
        write_file(inj.path(relpath), data)
        rows.append(relpath)
    inj.record(name, top.split("/")[0], "unsupported_layout", "deep", rows)


def orphan_rank(inj: Injector, name: str) -> None:
    """A rank folder whose identity (another dtype) has no base folder."""
    ns = inj.primary[0]
    key = "kv_dtype" if ns.family == "vllmcpp" else "dtype"
    fields = dict(ns.fields, **{key: "fp8_e4m3"})
    digest = full_digest(fields, ns.canonical_family)
    rank_dir = layout.rank_dir_name(layout.base_name(fields["model_name"], digest[:12]), ns.ranks[0])
    if (inj.root / layout.base_name(fields["model_name"], digest[:12])).exists():
        raise _bad(f"{name}: the orphan's base folder exists in this root")
    rows = []
    for index in range(min(2, inj.spec.blocks)):
        hex_hash = pages.block_hash_hex(inj.spec.seed, index, inj.spec.hash_len)
        data = block_file_bytes(inj.spec, ns, hex_hash, 0, ns.ranks[0])
        if ns.family == "vllmcpp":
            data = data[:24] + bytes.fromhex(digest) + data[56:]
        relpath = f"{rank_dir}/{layout.block_relpath_in_rank(hex_hash, 0)}"
        write_file(inj.path(relpath), data)
        rows.append(relpath)
    inj.record(name, rank_dir, "orphan_namespace", "base folder", rows, rank=ns.ranks[0])


# -- namespace-level ------------------------------------------------------------------------

def _namespace_block_rows(inj: Injector, ns: Namespace) -> list[str]:
    rows = []
    for block in inj.result.blocks:
        for rank in ns.ranks:
            rel = block["files"].get(rank)
            if rel is not None and rel not in inj.claimed:
                rows.append(rel)
    return rows


def config_missing(inj: Injector, name: str) -> None:
    ns = inj.primary[0]
    relpath = f"{ns.base_name}/{layout.CONFIG_NAME}"
    inj.path(relpath).unlink()
    inj.record(name, relpath, "orphan_namespace", "config.json", _namespace_block_rows(inj, ns), ns=ns,
               namespace_status="orphan_namespace")


def config_unparsable(inj: Injector, name: str) -> None:
    ns = inj.primary[0]
    relpath = f"{ns.base_name}/{layout.CONFIG_NAME}"
    data = ns.config_bytes
    write_file(inj.path(relpath), data[:len(data) // 2])  # a non-atomic write cut short
    inj.record(name, relpath, "config_invalid", "json", [relpath, *_namespace_block_rows(inj, ns)], ns=ns,
               namespace_status="config_invalid")


def digest_mismatch(inj: Injector, name: str) -> None:
    ns = inj.primary[0]
    key = "kv_dtype" if ns.family == "vllmcpp" else "dtype"
    edited = dict(ns.fields, **{key: "fp8" if ns.fields[key] != "fp8" else "fp16"})
    assert d12(edited, ns.canonical_family) != ns.d12
    relpath = f"{ns.base_name}/{layout.CONFIG_NAME}"
    write_file(inj.path(relpath), config_json_bytes(edited, ns.canonical_family))
    inj.record(name, relpath, "digest_mismatch", "digest", [relpath, *_namespace_block_rows(inj, ns)], ns=ns,
               namespace_status="digest_mismatch", edited_key=key)


def pp_stages(inj: Injector) -> None:
    """Every base folder of a pp>1 llm-d deployment is out of scope (formats.md §2)."""
    for ns in inj.namespaces:
        inj.record("pp_stage", ns.base_name, "unsupported_layout", "pipeline stage", _namespace_block_rows(inj, ns),
                   ns=ns, namespace_status="unsupported_layout", stage=ns.stage)


INJECTORS: dict[str, Callable[[Injector, str], None]] = {
    "missing_rank": missing_rank,
    "replica_differs": replica_differs,
    "size_mismatch": size_mismatch,
    "short": short,
    "zero_filled": zero_filled,
    "misfiled": misfiled,
    "unreadable": unreadable,
    "padded_legacy": padded_legacy,
    **{name: header_defect for name in HEADER_CHECK},
    "tmp_vllm": tmp_vllm,
    "tmp_cpp_block": tmp_cpp_block,
    "tmp_cpp_config": tmp_cpp_config,
    "tmp_probe": tmp_probe,
    "foreign": foreign,
    "symlink": symlink,
    "fifo": fifo,
    "deep_layout": deep_layout,
    "orphan_rank": orphan_rank,
    "config_missing": config_missing,
    "config_unparsable": config_unparsable,
    "digest_mismatch": digest_mismatch,
}


def inject(root: Path, spec: SynthSpec, namespaces: list[Namespace], result: SynthResult) -> None:
    """Apply `spec.defects` (block defects first, namespace-level last) and record them."""
    config = [d for d in spec.defects if d in CONFIG_DEFECTS]
    if len(config) > 1:
        raise _bad(f"defects {', '.join(config)} all rewrite config.json: pick one")
    if config and spec.pp > 1:
        raise _bad(f"{config[0]} cannot be combined with pipeline stages (both decide the namespace status)")
    inj = Injector(root, spec, namespaces, result)
    ordered = [d for d in spec.defects if d in BLOCK_DEFECTS]
    ordered += [d for d in spec.defects if d not in BLOCK_DEFECTS and d not in CONFIG_DEFECTS and d != "pp_stage"]
    ordered += config
    for name in ordered:
        INJECTORS[name](inj, name)
    if spec.pp > 1:
        pp_stages(inj)
