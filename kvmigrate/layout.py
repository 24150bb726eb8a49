"""The path grammar shared by all three writer families (formats.md §1).

    <root>/<safe_model>_<d12>/config.json
    <root>/<safe_model>_<d12>_r<rank>/<hhh>/<hh>_g<group>/<hex>.bin

Folder names are parsed from the right: the model name may contain `_`, and `r` is not a
hex digit, so a base folder and a rank folder never match each other's pattern.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BASE_RE = re.compile(r"^(.+)_([0-9a-f]{12})$", re.S)
RANK_RE = re.compile(r"^(.+)_([0-9a-f]{12})_r(\d+)$", re.S)
BUCKET_RE = re.compile(r"^[0-9a-f]{3}$")
FANOUT_RE = re.compile(r"^([0-9a-f]{2})_g(\d+)$")
BLOCK_RE = re.compile(r"^((?:[0-9a-f]{2}){3,})\.bin$")

# Temp leftovers of interrupted atomic writes, per writer.
TMP_VLLM_BLOCK_RE = re.compile(r"^(?:[0-9a-f]{2}){3,}\.bin_\d+\.tmp$")  # vLLM, llm-d
TMP_CPP_BLOCK_RE = re.compile(r"^(?:[0-9a-f]{2}){3,}\.bin\.\d+\.\d+\.tmp$")  # vllm.cpp
TMP_CPP_CONFIG_RE = re.compile(r"^config\.json\.\d+\.\d+\.tmp$")  # vllm.cpp
PROBE_RE = re.compile(r"^\.o_direct_probe_\d+\.tmp$")  # vLLM, base folder
OWN_TMP_RE = re.compile(r"\.kvmigrate-\d+\.tmp$")  # kvmigrate's own temp files

CONFIG_NAME = "config.json"
LOCK_NAME = ".kvmigrate.lock"
OWN_DIR = ".kvmigrate"


def safe_model_name(model_name: str) -> str:
    """Only `/` is replaced; everything else (quotes, spaces, non-ASCII) stays raw."""
    return model_name.replace("/", "_")


def base_name(model_name: str, d12: str) -> str:
    return f"{safe_model_name(model_name)}_{d12}"


def rank_dir_name(base: str, rank: int) -> str:
    return f"{base}_r{rank}"


@dataclass(frozen=True)
class FolderName:
    """A parsed top-level folder: a base folder (rank None) or a rank folder."""

    safe_model: str
    d12: str
    rank: int | None

    @property
    def base(self) -> str:
        return f"{self.safe_model}_{self.d12}"


def parse_folder(name: str) -> FolderName | None:
    """Parse a top-level folder name; None if it is neither a base nor a rank folder."""
    m = RANK_RE.match(name)
    if m:
        return FolderName(m.group(1), m.group(2), int(m.group(3)))
    m = BASE_RE.match(name)
    if m:
        return FolderName(m.group(1), m.group(2), None)
    return None


def block_relpath_in_rank(hex_hash: str, group: int) -> str:
    """`<hhh>/<hh>_g<group>/<hex>.bin` (relative to a rank folder)."""
    return f"{hex_hash[0:3]}/{hex_hash[3:5]}_g{group}/{hex_hash}.bin"


def block_relpath(base: str, rank: int, hex_hash: str, group: int) -> str:
    """Block path relative to the cache root."""
    return f"{rank_dir_name(base, rank)}/{block_relpath_in_rank(hex_hash, group)}"


@dataclass(frozen=True)
class BlockName:
    """A block file found at `<bucket>/<fanout>/<name>` inside a rank folder."""

    hex_hash: str
    group: int
    misfiled: bool  # fan-out folders disagree with the file name


def parse_block(bucket: str, fanout: str, filename: str) -> BlockName | None:
    """Parse a block file's location; None if the name is not `<even hex ≥ 6>.bin` in a
    `<hhh>/<hh>_g<group>` fan-out."""
    m = BLOCK_RE.match(filename)
    f = FANOUT_RE.match(fanout)
    if not m or not f or not BUCKET_RE.match(bucket):
        return None
    hex_hash = m.group(1)
    misfiled = hex_hash[0:3] != bucket or hex_hash[3:5] != f.group(1)
    return BlockName(hex_hash, int(f.group(2)), misfiled)


def temp_kind(filename: str) -> str | None:
    """Which engine's temp-file pattern a name matches (or 'own' for kvmigrate's)."""
    if OWN_TMP_RE.search(filename):
        return "own"
    if TMP_VLLM_BLOCK_RE.match(filename):
        return "vllm-block"
    if TMP_CPP_BLOCK_RE.match(filename):
        return "vllmcpp-block"
    if TMP_CPP_CONFIG_RE.match(filename):
        return "vllmcpp-config"
    if PROBE_RE.match(filename):
        return "vllm-probe"
    return None
