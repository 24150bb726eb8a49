"""The bytes of one synthetic block file and the one way synth writes a file (the tree
builder and the defects both use them)."""

from __future__ import annotations

import os
from pathlib import Path

from kvmigrate.formats.vllmcpp import encode_header, make_key
from kvmigrate.synth import pages
from kvmigrate.synth.identities import Namespace
from kvmigrate.synth.spec import SynthSpec


def write_file(path: Path, data: bytes) -> None:
    """Create or replace a file (and its parent folders)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        path.unlink()
    elif path.exists():
        os.chmod(path, 0o644)  # a rebuild over an `unreadable` defect
    path.write_bytes(data)


def block_file_bytes(spec: SynthSpec, ns: Namespace, hex_hash: str, group: int, rank: int) -> bytes:
    """The bytes the writer of `ns` stores for (block, group) on `rank`."""
    geom = pages.geometry(spec)
    if ns.family == "vllm":
        return pages.vllm_row_bytes(geom, hex_hash=hex_hash, group=group, tensors=ns.tensors,
                                    blocks_per_file=spec.blocks_per_file, cells=ns.cells, canonical=ns.canonical)
    if ns.family == "llmd":
        return pages.llmd_file_bytes(geom, hex_hash=hex_hash, group=group, rank=rank, tensors=ns.tensors,
                                     blocks_per_file=spec.blocks_per_file)
    payload = pages.vllmcpp_payload(geom, hex_hash=hex_hash, group=group, rank=rank, tensors=ns.tensors)
    header = encode_header(bytes.fromhex(ns.digest), make_key(bytes.fromhex(hex_hash), group),
                           ns.fields["page_size_bytes"])
    return header + payload
