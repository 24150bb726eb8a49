"""The Mooncake reshard of values (mooncake.md §3.4), against an oracle built here: a whole
block ``[rows, H, D]`` of deterministic bytes, sliced per key rank the way an engine at
that TP writes its values (numpy, never kvmigrate's head arithmetic)."""

from __future__ import annotations

import numpy as np
import pytest

from kvmigrate.transforms import TransformError
from kvmigrate.transforms_mooncake import ReplicaMismatch, reshard_problem, reshard_values

ROWS, D, B = 6, 4, 2  # rows (2·L·T or L·P), head size, element bytes


def block(heads: int, rows: int = ROWS, seed: int = 1) -> np.ndarray:
    """The whole block as the model holds it: [rows, H, D·b] bytes, every byte distinct enough."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(rows, heads, D * B), dtype=np.uint8)


def values_at(full: np.ndarray, n: int) -> list[bytes]:
    """The values an engine with `n` key ranks writes: rank t holds heads [t·H/n, (t+1)·H/n),
    or head t // (n/H) when n > H; each as [rows, h, D] in C order."""
    heads = full.shape[1]
    if n <= heads:
        h = heads // n
        return [np.ascontiguousarray(full[:, t * h:(t + 1) * h, :]).tobytes() for t in range(n)]
    k = n // heads
    return [np.ascontiguousarray(full[:, t // k:t // k + 1, :]).tobytes() for t in range(n)]


def reshard(values: list[bytes], n_s: int, n_t: int, heads: int) -> list[bytes]:
    return reshard_values(values, n_s, n_t, heads, D, B)


def test_a_round_trip_2_to_4_to_2_gives_the_same_bytes():
    full = block(8)
    two = values_at(full, 2)
    four = reshard(two, 2, 4, 8)
    assert reshard(four, 4, 2, 8) == two


@pytest.mark.parametrize(("n_s", "n_t"), [(1, 8), (8, 2), (2, 4), (4, 1), (2, 8)])
def test_each_target_value_is_what_the_engine_writes_at_the_target_tp(n_s, n_t):
    full = block(8)
    assert reshard(values_at(full, n_s), n_s, n_t, 8) == values_at(full, n_t)


def test_never_a_concatenation_of_values():
    """1 → 2 splits every row, not the value in halves (the halves of a value differ)."""
    full = block(4)
    (one,) = values_at(full, 1)
    out = reshard([one], 1, 2, 4)
    assert out == values_at(full, 2) and out[0] != one[: len(one) // 2]


def test_sglang_tp_above_heads_reads_one_copy_of_each_replicated_head():
    full = block(2)
    eight = values_at(full, 8)  # SGLang tp 8 over H=2: ranks 0-3 hold head 0, 4-7 head 1
    assert reshard(eight, 8, 2, 2) == values_at(full, 2)
    assert reshard(eight, 8, 1, 2) == values_at(full, 1)
    assert reshard(values_at(full, 1), 1, 4, 2) == values_at(full, 4)  # and a target above H replicates


def test_replicas_that_differ_name_the_ranks():
    full = block(2)
    four = values_at(full, 4)  # ranks 0, 1 hold head 0; 2, 3 head 1
    bad = bytearray(four[3])
    bad[5] ^= 0xFF
    with pytest.raises(ReplicaMismatch) as err:
        reshard([*four[:3], bytes(bad)], 4, 2, 2)
    assert err.value.ranks == (2, 3) and err.value.head == 1 and err.value.at == 5
    assert "key ranks 2 and 3" in str(err.value)


@pytest.mark.parametrize(("sizes", "n_s", "n_t", "heads", "words"), [
    ([96, 96, 96], 3, 2, 8, "source key ranks 3"),  # H % n_s
    ([192, 192], 2, 3, 8, "target key ranks 3"),  # H % n_t
    ([100, 100], 2, 4, 8, "not a whole number of rows"),
    ([192, 160], 2, 4, 8, "different numbers of rows"),
    ([192], 2, 4, 8, "need 2 values"),
])
def test_the_reshard_problem_says_why_it_cannot_run(sizes, n_s, n_t, heads, words):
    why = reshard_problem(sizes, n_s, n_t, heads, D, B)
    assert why is not None and words in why
    with pytest.raises(TransformError):
        reshard_values([bytes(s) for s in sizes], n_s, n_t, heads, D, B)


def test_a_block_that_can_be_resharded_has_no_problem():
    assert reshard_problem([len(v) for v in values_at(block(8), 2)], 2, 4, 8, D, B) is None
