"""The checksum xattr a vLLM fs tier may keep (vllm PR #57912, not in 0.34): a hard link
keeps it, a copy of the same bytes copies it, a file whose bytes change never carries it
(a stale value makes vLLM delete the file on its first load), and verify checks it.

The values are set by the test with its own bitwise CRC-32C (Castagnoli, reflected
0x82F63B78), not kvmigrate's, on ext4 or tmpfs (both keep `user.*` attributes).
"""

from __future__ import annotations

import os
import random

import pytest

from kvmigrate.formats import checksum

from helpers.cli_helpers import run, run_json

NAME = "user.vllm.kv_crc32c"
FULL = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1",
        "--writer-pp", "1"]


def crc32c_ref(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def stamp(path) -> bytes:
    value = crc32c_ref(path.read_bytes()).to_bytes(4, "big")
    os.setxattr(path, NAME, value)
    return value


def blocks(root, rank_dir: str) -> list:
    return sorted((root / rank_dir).rglob("*.bin"))


def test_crc32c_is_castagnoli_in_both_builds():
    assert checksum.crc32c(b"123456789") == 0xE3069283 == crc32c_ref(b"123456789")
    data = random.Random(7).randbytes(10_000)
    assert checksum.crc32c(data) == checksum._py_crc32c(data) == crc32c_ref(data)
    assert checksum.crc32c(data[5000:], checksum.crc32c(data[:5000])) == crc32c_ref(data)


def migrated(tmp_path, synth_root, spec: dict, *flags: str):
    root, (res,) = synth_root(spec)
    ns = res.namespaces[0]
    stamped = {p.name: stamp(p) for d in ns["rank_dirs"] for p in blocks(root, d)}
    code, done = run_json("migrate", root, *FULL, *flags, "--apply")
    assert code == 0 and done["outcomes"]["created"] == len(res.blocks), done
    (target,) = done["targets"]
    return root, stamped, blocks(root, target["rank_dir"])


@pytest.mark.parametrize("mode", ["link", "copy"])
def test_a_link_keeps_and_a_copy_copies_the_checksum(tmp_path, synth_root, mode):
    root, stamped, out = migrated(tmp_path, synth_root, {"family": "vllm", "scheme": "S2"}, "--mode", mode)
    for p in out:
        assert os.getxattr(p, NAME) == stamped[p.name]
        assert (os.stat(p).st_nlink > 1) is (mode == "link")
    code, text = run("verify", root, "--journal", root / ".kvmigrate" / "journals")
    assert code == 0, text


def test_a_file_whose_bytes_change_carries_no_checksum(tmp_path, synth_root):
    """llm-d TP1 files padded to a vLLM row (copy_pad): the old value would be stale."""
    root, stamped, out = migrated(tmp_path, synth_root, {"family": "llmd", "tp": 1})
    assert out and all(NAME not in os.listxattr(p) for p in out)
    code, text = run("verify", root, "--journal", root / ".kvmigrate" / "journals")
    assert code == 0, text


def test_verify_finds_a_checksum_that_does_not_match(tmp_path, synth_root):
    root, stamped, out = migrated(tmp_path, synth_root, {"family": "vllm", "scheme": "S2"}, "--mode", "copy")
    os.setxattr(out[0], NAME, b"\0\0\0\0")
    code, result = run_json("verify", root, "--journal", root / ".kvmigrate" / "journals")
    assert code & 4
    (finding,) = [f for f in result["findings"] if f["code"] == "checksum_mismatch"]
    assert finding["path"] == str(out[0]) and "deletes the block on its first load" in finding["message"]
    os.setxattr(out[0], NAME, b"\1\2")  # not 4 bytes: the engine rejects it too
    code, result = run_json("verify", root, "--journal", root / ".kvmigrate" / "journals")
    assert code & 4 and "not a 4-byte checksum" in result["findings"][0]["message"]
