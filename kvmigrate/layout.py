"""The path grammar shared by all three writer families (formats.md §1).

    <root>/<safe_model>_<d12>/config.json
    <root>/<safe_model>_<d12>_r<rank>/<hhh>/<hh>_g<group>/<hex>.bin

Folder names are parsed from the right: the model name may contain `_`, and `r` is not a
hex digit, so a base folder and a rank folder never match each other's pattern.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The pieces of the grammar, spelled once. Every pattern is anchored with `\Z` (not `$`,
# which also matches before a final newline: `abc\n` is not a bucket), and digits are
# ASCII only (`\d` also takes other scripts' digits; the C walk reads `0-9`).
HEX_HASH = r"(?:[0-9a-f]{2}){3,}"  # a block name's hash: an even number (at least 6) of lowercase hex
MODEL = r"[^/\x00]+"  # a safe model name: anything a folder name may hold
D12 = r"[0-9a-f]{12}"
NUMBER = r"[0-9]+"
BUCKET = r"[0-9a-f]{3}"
HH = r"[0-9a-f]{2}"

BASE_RE = re.compile(rf"^({MODEL})_({D12})\Z")
RANK_RE = re.compile(rf"^({MODEL})_({D12})_r({NUMBER})\Z")
BUCKET_RE = re.compile(rf"^{BUCKET}\Z")
FANOUT_RE = re.compile(rf"^({HH})_g({NUMBER})\Z")
BLOCK_RE = re.compile(rf"^({HEX_HASH})\.bin\Z")
# BLOCK_RE for the scan's hot loop, about 3x faster: a name is a block name iff it matches
# and group 1 (the hex) has an even length (`block_hex`).
BLOCK_HEX_RUN = re.compile(r"([0-9a-f]{6,})\.bin\Z").match
# A block path relative to the cache root as an RE2 pattern, for Arrow's vectorised match
# (RE2's `$` is the end of the text): it matches exactly the paths `parse_block_relpath`
# parses, misfiled or not.
BLOCK_RELPATH_RE2 = rf"^{MODEL}_{D12}_r{NUMBER}/{BUCKET}/{HH}_g{NUMBER}/{HEX_HASH}\.bin$"

# Temp leftovers of interrupted atomic writes, per writer.
TMP_VLLM_BLOCK_RE = re.compile(rf"^{HEX_HASH}\.bin_{NUMBER}\.tmp\Z")  # vLLM, llm-d
TMP_CPP_BLOCK_RE = re.compile(rf"^{HEX_HASH}\.bin\.{NUMBER}\.{NUMBER}\.tmp\Z")  # vllm.cpp
TMP_CPP_CONFIG_RE = re.compile(rf"^config\.json\.{NUMBER}\.{NUMBER}\.tmp\Z")  # vllm.cpp
PROBE_RE = re.compile(rf"^\.o_direct_probe_{NUMBER}\.tmp\Z")  # vLLM, base folder
OWN_TMP_RE = re.compile(rf"\.kvmigrate-{NUMBER}\.tmp\Z")  # kvmigrate's own temp files

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
    return f"{fanout_relpath(hex_hash, group)}/{hex_hash}.bin"


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


def block_hex(name: str) -> str | None:
    """The hex hash of a block file name (`<even hex, at least 6>.bin`), None if it is not one."""
    m = BLOCK_HEX_RUN(name)
    return m.group(1) if m is not None and not m.end(1) & 1 else None


def parse_fanout(name: str) -> tuple[int, str] | None:
    """(group, hh) of a `<hh>_g<group>` fan-out folder name, None if it is not one."""
    m = FANOUT_RE.match(name)
    return (int(m.group(2)), m.group(1)) if m else None


def fanout_relpath(hex_hash: str, group: int) -> str:
    """`<hhh>/<hh>_g<group>`: the folders a block belongs in (relative to a rank folder)."""
    return f"{hex_hash[0:3]}/{hex_hash[3:5]}_g{group}"


def parse_block_relpath(relpath: str) -> tuple[FolderName, BlockName] | None:
    """A block path relative to the cache root (`<rank folder>/<hhh>/<hh>_g<group>/<hex>.bin`):
    its rank folder and block, None if it is not one."""
    parts = relpath.split("/")
    if len(parts) != 4:
        return None
    folder = parse_folder(parts[0])
    block = parse_block(*parts[1:]) if folder is not None and folder.rank is not None else None
    return (folder, block) if folder is not None and block is not None else None


def own_artifact(filename: str) -> str | None:
    """Why a file is kvmigrate's own (its temp file or lock: status own_artifact), or None."""
    if OWN_TMP_RE.search(filename):
        return "kvmigrate temp file"
    if filename == LOCK_NAME:
        return "kvmigrate lock file"
    return None


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


def shown(v: str) -> str:
    """A name as valid UTF-8 for Arrow and messages: bytes kept by surrogateescape become
    backslash escapes, and so does any other lone surrogate (a config.json string holding
    "\\ud800")."""
    try:
        return v.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return v.encode("utf-8", "backslashreplace").decode("utf-8")
