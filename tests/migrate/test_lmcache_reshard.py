"""The LMCache ``reshard`` transform (lmcache.md §3.4) against an independent numpy oracle.

Each test builds the model's whole KV chunk ``[2, L, T, H, D]`` (an element = b random
bytes), writes the shard files the source TP's workers would have written (vLLM's head
split, or its replicated heads when TP > H) behind a header of ``offset`` bytes, runs
``write_reshard`` into real files, and compares them with the oracle: the source shards
concatenated along the head axis (replicas dropped), split for the target.
"""

from __future__ import annotations

import os
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmigrate.errors import IntegrityError
from kvmigrate.transforms import TransformError
from kvmigrate.transforms_lmcache import (
    HeadRun,
    ReshardGeometry,
    check_reshard_sources,
    head_runs,
    rank_heads,
    replica_ranks,
    reshard_output_size,
    write_reshard,
)

# --------------------------------------------------------------------------- oracle


def full_chunk(L: int, T: int, H: int, D: int, b: int, seed: int = 0) -> np.ndarray:
    """The whole model's chunk ``[2, L, T, H, D, b]`` (bytes), distinct almost everywhere."""
    return np.random.default_rng(seed).integers(0, 256, size=(2, L, T, H, D, b), dtype=np.uint8)


def shard(full: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """What vLLM's worker ``rank`` holds: H/TP consecutive heads, or its one replicated head."""
    H = full.shape[3]
    if tp <= H:
        return np.split(full, tp, axis=3)[rank]
    return full[:, :, :, rank // (tp // H)][:, :, :, np.newaxis]


def oracle_target(shards: list[np.ndarray], H: int, tp_dst: int, rank: int) -> bytes:
    """Concatenate the source shards along the head axis, drop replicas, split for the target."""
    cat = np.concatenate(shards, axis=3)
    if cat.shape[3] > H:  # source TP > H: consecutive ranks hold copies of one head
        cat = cat[:, :, :, :: cat.shape[3] // H]
    assert cat.shape[3] == H
    return np.ascontiguousarray(shard(cat, tp_dst, rank)).tobytes()


def write_sources(d: Path, full: np.ndarray, tp: int, offset: int) -> list[Path]:
    paths = []
    for r in range(tp):
        p = d / f"src-{tp}-{r}.data"
        header = bytes((r * 31 + k) & 0xFF | 1 for k in range(offset))  # nonzero: must not leak
        p.write_bytes(header + np.ascontiguousarray(shard(full, tp, r)).tobytes())
        paths.append(p)
    return paths


def reshard_files(paths: list[Path], offset: int, g: ReshardGeometry, out_dir: Path, **kw) -> list[Path]:
    outs = []
    files = [open(p, "rb") for p in paths]  # noqa: SIM115 - closed below, all together
    try:
        for t in range(g.tp_dst):
            out = out_dir / f"dst-{g.tp_dst}-{t}.data"
            with open(out, "wb") as f:
                n = write_reshard([(fh, offset) for fh in files], f, g, t, **kw)
            assert n == out.stat().st_size == g.target_bytes == reshard_output_size(g, t)
            outs.append(out)
        assert all(fh.tell() == 0 for fh in files)  # pread: positions untouched
    finally:
        for fh in files:
            fh.close()
    return outs


def check_against_oracle(tmp: Path, L, T, H, D, b, S, N, *, offset=0, seed=0, **kw) -> None:
    full = full_chunk(L, T, H, D, b, seed)
    paths = write_sources(tmp, full, S, offset)
    g = ReshardGeometry(layers=L, tokens=T, total_kv_heads=H, head_dim=D, elem_bytes=b, tp_src=S, tp_dst=N)
    outs = reshard_files(paths, offset, g, tmp, **kw)
    shards = [np.frombuffer(p.read_bytes()[offset:], np.uint8).reshape(2, L, T, -1, D, b) for p in paths]
    for t, out in enumerate(outs):
        assert out.read_bytes() == oracle_target(shards, H, N, t), f"target rank {t}"
        # and, independently of the shard files, the target's heads of the model chunk
        assert out.read_bytes() == np.ascontiguousarray(shard(full, N, t)).tobytes()


# --------------------------------------------------------------------------- geometries

# (L, T, H, D, b, S, N): T smaller than a chunk = a partial last chunk; b = 1 fp8, 2 fp16/bf16, 4 fp32
GEOMETRIES = [
    (2, 16, 8, 16, 2, 1, 2),    # TP 1 -> 2
    (2, 16, 8, 16, 2, 2, 4),    # TP 2 -> 4
    (2, 16, 8, 16, 2, 4, 2),    # TP 4 -> 2
    (2, 16, 8, 16, 2, 8, 1),    # TP 8 -> 1
    (2, 16, 8, 16, 2, 2, 8),    # TP 2 -> 8, one head each
    (2, 16, 8, 16, 2, 8, 16),   # TP 16 > H: every head replicated twice
    (2, 16, 8, 16, 2, 16, 2),   # from replicated heads
    (3, 5, 4, 8, 2, 2, 8),      # H=4: TP 8 replicates; partial chunk (T=5)
    (3, 5, 4, 8, 1, 8, 2),      # fp8, from replicated heads
    (2, 1, 2, 8, 2, 4, 8),      # both sides replicated, a single token
    (2, 3, 1, 8, 2, 1, 4),      # MQA (H=1): every target rank gets the one head
    (2, 3, 1, 8, 2, 4, 1),
    (4, 7, 8, 16, 4, 2, 4),     # float32
    (4, 7, 8, 16, 1, 4, 8),     # fp8
    (2, 6, 8, 16, 2, 4, 4),     # same TP: the source rank's own bytes
]


@pytest.mark.parametrize("L,T,H,D,b,S,N", GEOMETRIES)
@pytest.mark.parametrize("offset", [0, 28, 4096])  # raw / fs RemoteMetadata / GDS header
def test_reshard_matches_the_numpy_oracle(tmp_path, L, T, H, D, b, S, N, offset):
    check_against_oracle(tmp_path, L, T, H, D, b, S, N, offset=offset)


@pytest.mark.parametrize("buffer_bytes", [1, 100, 777, 4096, 1 << 30])
@pytest.mark.parametrize("S,N", [(2, 4), (4, 2), (8, 16), (16, 4)])
def test_batch_boundaries_do_not_change_the_bytes(tmp_path, S, N, buffer_bytes):
    """One row per batch, batches that do not divide the rows, one batch for everything."""
    check_against_oracle(tmp_path, 3, 11, 8, 8, 2, S, N, offset=28, buffer_bytes=buffer_bytes)


def test_float16_values_survive_as_values(tmp_path):
    """Real float16 values: each target element is the model's element of the target's heads."""
    L, T, H, D, S, N = 2, 4, 8, 4, 2, 4
    vals = np.arange(2 * L * T * H * D, dtype=np.float16).reshape(2, L, T, H, D) / 7
    full = vals.view(np.uint8).reshape(2, L, T, H, D, 2)
    paths = write_sources(tmp_path, full, S, 0)
    g = ReshardGeometry(layers=L, tokens=T, total_kv_heads=H, head_dim=D, elem_bytes=2, tp_src=S, tp_dst=N)
    for t, out in enumerate(reshard_files(paths, 0, g, tmp_path)):
        got = np.frombuffer(out.read_bytes(), np.float16).reshape(2, L, T, H // N, D)
        np.testing.assert_array_equal(got, vals[:, :, :, t * 2 : t * 2 + 2])


def test_bfloat16_values_survive_as_values(tmp_path):
    """bfloat16 (numpy has none): the high half of float32 values exactly representable in bf16,
    little-endian; each target element, widened back to float32, is the model's value."""
    L, T, H, D, S, N = 2, 3, 8, 4, 4, 1
    k = np.arange(2 * L * T * H * D)
    # distinct values with a 7-bit mantissa: exact in bfloat16
    vals = (np.ldexp(1 + (k // 16 % 128) / 128, k % 16 - 8) * np.where(k % 3, 1, -1)).astype(np.float32)
    vals = vals.reshape(2, L, T, H, D)
    bf16 = (vals.view(np.uint32) >> 16).astype("<u2")
    assert np.array_equal((bf16.astype(np.uint32) << 16).view(np.float32), vals)  # exact in bf16
    full = bf16.view(np.uint8).reshape(2, L, T, H, D, 2)
    paths = write_sources(tmp_path, full, S, 28)
    g = ReshardGeometry(layers=L, tokens=T, total_kv_heads=H, head_dim=D, elem_bytes=2, tp_src=S, tp_dst=N)
    (out,) = reshard_files(paths, 28, g, tmp_path)
    got = (np.frombuffer(out.read_bytes(), "<u2").astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got.reshape(2, L, T, H, D), vals)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    h_exp=st.integers(0, 3),
    s_exp=st.integers(0, 4),
    n_exp=st.integers(0, 4),
    L=st.integers(1, 3),
    T=st.integers(1, 6),
    D=st.integers(1, 9),
    b=st.sampled_from([1, 2, 4]),
    offset=st.sampled_from([0, 28, 4096]),
    buffer_bytes=st.integers(1, 2000),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_any_power_of_two_geometry(tmp_path, h_exp, s_exp, n_exp, L, T, D, b, offset, buffer_bytes, seed):
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    check_against_oracle(d, L, T, 2**h_exp, D, b, 2**s_exp, 2**n_exp, offset=offset, seed=seed,
                         buffer_bytes=buffer_bytes)


@pytest.mark.parametrize("H,S,N", [(8, 2, 4), (8, 2, 8), (4, 2, 8), (8, 1, 8), (2, 4, 1)])
def test_round_trip_restores_the_source_bytes(tmp_path, H, S, N):
    """S -> N -> S gives every source file back, byte for byte (payload after the header)."""
    L, T, D, b, offset = 4, 9, 16, 2, 28
    full = full_chunk(L, T, H, D, b, seed=7)
    src = write_sources(tmp_path, full, S, offset)
    there = ReshardGeometry(layers=L, tokens=T, total_kv_heads=H, head_dim=D, elem_bytes=b, tp_src=S, tp_dst=N)
    (tmp_path / "mid").mkdir()
    (tmp_path / "back").mkdir()
    mid = reshard_files(src, offset, there, tmp_path / "mid", buffer_bytes=1000)
    back_g = ReshardGeometry(layers=L, tokens=T, total_kv_heads=H, head_dim=D, elem_bytes=b, tp_src=N, tp_dst=S)
    back = reshard_files(mid, 0, back_g, tmp_path / "back", buffer_bytes=1000)
    for s, r in zip(src, back):
        assert r.read_bytes() == s.read_bytes()[offset:]


def test_memory_stays_bounded_on_a_large_chunk(tmp_path):
    """Llama-3.1-8B, bf16, TP 2 -> 4: 16 MiB per source file, 8 MiB out; peak ~ the buffer."""
    L, T, H, D, b, S, N = 32, 256, 8, 128, 2, 2, 4
    full = full_chunk(L, T, H, D, b, seed=3)
    paths = write_sources(tmp_path, full, S, 4096)
    g = ReshardGeometry(layers=L, tokens=T, total_kv_heads=H, head_dim=D, elem_bytes=b, tp_src=S, tp_dst=N)
    assert g.source_bytes == 16 << 20
    buffer_bytes = 1 << 20
    out = tmp_path / "dst-1.data"
    files = [open(p, "rb") for p in paths]  # noqa: SIM115 - closed below
    try:
        with open(out, "wb") as f:
            tracemalloc.start()
            try:
                write_reshard([(fh, 4096) for fh in files], f, g, 1, buffer_bytes=buffer_bytes)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
    finally:
        for fh in files:
            fh.close()
    assert peak < 2 * buffer_bytes, peak  # vs 16 MiB source, 8 MiB target
    assert out.read_bytes() == np.ascontiguousarray(shard(full, N, 1)).tobytes()


def test_descriptors_work_as_well_as_file_objects(tmp_path):
    L, T, H, D, b = 2, 3, 8, 4, 2
    full = full_chunk(L, T, H, D, b)
    paths = write_sources(tmp_path, full, 4, 28)
    g = ReshardGeometry(layers=L, tokens=T, total_kv_heads=H, head_dim=D, elem_bytes=b, tp_src=4, tp_dst=1)
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        out = tmp_path / "one.data"
        with open(out, "wb") as f:
            write_reshard([(fd, 28) for fd in fds], f, g, 0)
    finally:
        for fd in fds:
            os.close(fd)
    assert out.read_bytes() == full.tobytes()


# --------------------------------------------------------------------------- head mapping


def test_rank_heads_split_evenly_or_replicate():
    assert [rank_heads(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [rank_heads(4, 8, r) for r in range(8)] == [range(h, h + 1) for h in (0, 0, 1, 1, 2, 2, 3, 3)]
    assert replica_ranks(4, 8, 2) == range(4, 6)
    assert replica_ranks(8, 4, 5) == range(2, 3)


def test_head_runs_worked_example():
    """docs/lmcache-reshard.md: H=8, TP 4 -> 2, target rank 1 = source ranks 2 and 3 side by side."""
    g = ReshardGeometry(layers=1, tokens=1, total_kv_heads=8, head_dim=4, elem_bytes=2, tp_src=4, tp_dst=2)
    assert head_runs(g, 1) == [HeadRun(2, 0, 0, 2), HeadRun(3, 0, 2, 2)]
    g = ReshardGeometry(layers=1, tokens=1, total_kv_heads=8, head_dim=4, elem_bytes=2, tp_src=2, tp_dst=4)
    assert head_runs(g, 3) == [HeadRun(1, 2, 0, 2)]
    g = ReshardGeometry(layers=1, tokens=1, total_kv_heads=4, head_dim=4, elem_bytes=2, tp_src=8, tp_dst=2)
    assert head_runs(g, 1) == [HeadRun(4, 0, 0, 1), HeadRun(6, 0, 1, 1)]  # lowest replica of heads 2, 3


# --------------------------------------------------------------------------- refusals


def _geometry(**kw) -> ReshardGeometry:
    args = {"layers": 2, "tokens": 3, "total_kv_heads": 8, "head_dim": 4, "elem_bytes": 2, "tp_src": 2, "tp_dst": 4}
    return ReshardGeometry(**{**args, **kw})


def test_transform_error_is_integrity_and_value_error():
    with pytest.raises(IntegrityError):
        _geometry(tp_src=3)
    with pytest.raises(ValueError):
        _geometry(tp_src=3)


@pytest.mark.parametrize("kw,words", [
    ({"tp_src": 3}, ["source TP 3", "H=8", "needs_reshard"]),
    ({"tp_dst": 3}, ["target TP 3", "H=8"]),
    ({"total_kv_heads": 6, "tp_src": 4}, ["source TP 4", "H=6"]),
    ({"total_kv_heads": 4, "tp_dst": 6}, ["target TP 6", "H=4"]),
    ({"kv_kind": "mla"}, ["MLA", "never resharded", "linked"]),
    ({"kv_kind": "hybrid"}, ["kv kind", "'hybrid'"]),
    ({"layers": 0}, ["layers", "got 0"]),
    ({"tokens": 0}, ["tokens", "got 0"]),
    ({"head_dim": True}, ["head_dim", "True"]),
    ({"elem_bytes": 1.5}, ["elem_bytes", "1.5"]),
    ({"total_kv_heads": None}, ["total_kv_heads", "None"]),
])
def test_bad_geometry_names_the_value(kw, words):
    with pytest.raises(TransformError) as e:
        _geometry(**kw)
    for w in words:
        assert w in str(e.value)


def test_target_rank_out_of_range(tmp_path):
    with pytest.raises(TransformError, match="rank 4 is out of range for TP 4"):
        reshard_output_size(_geometry(), 4)


def _sources(tmp_path: Path, g: ReshardGeometry, offset: int = 0) -> list[Path]:
    full = full_chunk(g.layers, g.tokens, g.total_kv_heads, g.head_dim, g.elem_bytes)
    return write_sources(tmp_path, full, g.tp_src, offset)


def _run(paths: list[Path], offsets: list[int], g: ReshardGeometry, tmp_path: Path, rank: int = 0, **kw):
    files = [open(p, "rb") for p in paths]  # noqa: SIM115 - closed below
    out = tmp_path / "out.data"
    try:
        with open(out, "wb") as f:
            return write_reshard(list(zip(files, offsets)), f, g, rank, **kw)
    finally:
        for fh in files:
            fh.close()


def test_missing_source_rank_is_refused(tmp_path):
    g = _geometry()
    paths = _sources(tmp_path, g)
    with pytest.raises(TransformError, match="source TP 2 needs one file per rank, got 1"):
        _run(paths[:1], [0], g, tmp_path)


def test_a_short_source_names_the_rank_and_the_sizes(tmp_path):
    g = _geometry()
    paths = _sources(tmp_path, g, 28)
    with open(paths[1], "r+b") as f:
        f.truncate(paths[1].stat().st_size - 2)
    with pytest.raises(TransformError) as e:
        _run(paths, [28, 28], g, tmp_path)
    assert f"source rank 1's payload is {g.source_bytes - 2} bytes" in str(e.value)
    assert f"2·2·3·4·4·2 = {g.source_bytes}" in str(e.value)
    assert not (tmp_path / "out.data").read_bytes()  # nothing written before the check


def test_a_wrong_token_count_is_a_size_mismatch(tmp_path):
    """Sources of a partial chunk (T=3) read as a full one (T=4) are refused, not padded."""
    paths = _sources(tmp_path, _geometry())
    with pytest.raises(TransformError, match="source rank 0's payload is 384 bytes, but 2·L·T·h_s·D·b = 2·2·4·4·4·2 = 512"):
        _run(paths, [0, 0], _geometry(tokens=4), tmp_path)


def test_offset_beyond_the_file(tmp_path):
    g = _geometry()
    paths = _sources(tmp_path, g)
    with pytest.raises(TransformError, match="shorter than its payload offset 4096"):
        _run(paths, [0, 4096], g, tmp_path)
    with pytest.raises(TransformError, match="payload offset must be an integer >= 0"):
        _run(paths, [0, -1], g, tmp_path)


def test_check_reshard_sources_returns_descriptors(tmp_path):
    g = _geometry()
    paths = _sources(tmp_path, g, 28)
    with open(paths[0], "rb") as a, open(paths[1], "rb") as c:
        assert check_reshard_sources([(a, 28), (c, 28)], g) == [a.fileno(), c.fileno()]


def test_replicas_that_differ_are_refused(tmp_path):
    """H=2, source TP 4: ranks 0 and 1 both hold head 0; a flipped byte in rank 1 is found."""
    g = _geometry(total_kv_heads=2, tp_src=4, tp_dst=1)
    paths = _sources(tmp_path, g, 28)
    data = bytearray(paths[1].read_bytes())
    data[28 + 50] ^= 0xFF
    paths[1].write_bytes(bytes(data))
    with pytest.raises(TransformError) as e:
        _run(paths, [28] * 4, g, tmp_path, buffer_bytes=64)
    assert "source ranks 0 and 1 both hold KV head 0" in str(e.value)
    assert "payload byte 50" in str(e.value)
    # without the check the lowest replica (rank 0) is used, the differing copy ignored
    _run(paths, [28] * 4, g, tmp_path, check_replicas=False)
    full = full_chunk(2, 3, 2, 4, 2)
    assert (tmp_path / "out.data").read_bytes() == full.tobytes()


def test_a_replica_only_matters_to_the_targets_that_read_its_head(tmp_path):
    """Rank 3 (head 1's second copy) differs: target rank 0 at TP 2 (head 0) is still written."""
    g = _geometry(total_kv_heads=2, tp_src=4, tp_dst=2)
    paths = _sources(tmp_path, g)
    data = bytearray(paths[3].read_bytes())
    data[-1] ^= 0x01
    paths[3].write_bytes(bytes(data))
    _run(paths, [0] * 4, g, tmp_path, rank=0)
    with pytest.raises(TransformError, match="source ranks 2 and 3 both hold KV head 1"):
        _run(paths, [0] * 4, g, tmp_path, rank=1)


def test_replica_ranks_refuses_a_head_out_of_range():
    with pytest.raises(TransformError, match="head 4 is out of range for total_kv_heads 4"):
        replica_ranks(4, 8, 4)
    with pytest.raises(TransformError, match="neither divides the other"):
        replica_ranks(4, 6, 0)
