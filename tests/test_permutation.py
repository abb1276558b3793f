"""The pointwise keyed permutation behind every shuffled epoch order: a bijection for any size,
pinned across platforms, and mixed well enough that position says nothing about the sample."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.data.permutation import MAX_SIZE, permutation_keys, permute

SIZES = [1, 2, 3, 4, 5, 7, 8, 9, 13, 31, 97, 127, 128, 129, 255, 256, 257, 1009, 1023, 1024, 1025, 4099,
         (1 << 16) - 1, 1 << 16, (1 << 16) + 1]


@pytest.mark.parametrize("n", SIZES)
def test_it_is_a_bijection_for_every_size(n):
    for words in ((0, 0), (7, 3), (2**31, 12345)):
        out = permute(np.arange(n), n, permutation_keys(*words))
        assert out.dtype == np.int64
        assert np.array_equal(np.sort(out), np.arange(n)), "every value once"


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**63), epoch=st.integers(0, 10**6), data=st.data())
def test_any_positions_map_as_the_whole_permutation_does(n, seed, epoch, data):
    """Pointwise: a position's value does not depend on which other positions are asked with it."""
    keys = permutation_keys(seed, epoch)
    whole = permute(np.arange(n), n, keys)
    assert np.array_equal(np.sort(whole), np.arange(n))
    pos = np.asarray(data.draw(st.lists(st.integers(0, n - 1), max_size=40)), dtype=np.int64)
    assert np.array_equal(permute(pos, n, keys), whole[pos])
    assert np.array_equal(permute(pos.reshape(-1, 1), n, keys).ravel(), whole[pos])  # any shape


def test_the_values_are_pinned_across_platforms():
    """Pure uint64 arithmetic: these numbers are the same everywhere. A change here changes
    every epoch's order and must bump plan.ORDER_VERSION."""
    assert permute(np.arange(10), 10, permutation_keys(0, 0)).tolist() == [5, 2, 4, 7, 3, 9, 1, 6, 8, 0]
    assert permutation_keys(0, 0)[:2].tolist() == [16518663272748887656, 8366330045729948292]
    big = permute(np.array([0, 1, 10**9, 10**12 - 1]), 10**12, permutation_keys(3, 1))
    assert big.tolist() == [605764094641, 282221739, 445272056396, 112677486481]  # O(4), not O(10**12)
    mixed = permute(np.array([0, 1, 2, 3] * 2), np.array([8] * 4 + [5] * 4), permutation_keys(1, 2),
                    tweak=np.array([0] * 4 + [3] * 4))
    assert mixed.tolist() == [3, 2, 7, 6, 2, 4, 3, 0]


def test_keys_change_the_permutation():
    n = 1000
    orders = {permute(np.arange(n), n, permutation_keys(s, e)).tobytes() for s in range(5) for e in range(5)}
    assert len(orders) == 25
    assert len({permutation_keys(s, e).tobytes() for s in range(50) for e in range(50)}) == 2500
    assert not np.array_equal(permutation_keys(1, 2), permutation_keys(2, 1))


def test_position_and_value_are_uncorrelated():
    n = 10_000
    for seed in range(10):
        out = permute(np.arange(n), n, permutation_keys(seed, seed + 1))
        r = np.corrcoef(np.arange(n), out)[0, 1]
        assert abs(r) < 4 / np.sqrt(n), (seed, r)  # 4 standard errors of a random permutation's r
        # neighbours stay apart: a random permutation keeps ~1 of the n - 1 adjacent pairs adjacent
        assert np.count_nonzero(np.abs(np.diff(out)) == 1) <= 10


def test_each_element_is_spread_evenly_over_the_positions_across_keys():
    """Over many keys, every element lands in every quarter of the positions about equally
    often (the count of a fair 4-way draw, within 6 standard deviations), and fixed points
    average one per permutation as for a uniformly random permutation."""
    n, keys = 64, 2000
    counts = np.zeros((n, 4), dtype=np.int64)
    fixed = 0
    for k in range(keys):
        out = permute(np.arange(n), n, permutation_keys(k, 7))  # out[p] = element at position p
        counts[out, np.arange(n) // (n // 4)] += 1
        fixed += int(np.count_nonzero(out == np.arange(n)))
    expected, sd = keys / 4, np.sqrt(keys * 0.25 * 0.75)
    assert np.abs(counts - expected).max() < 6 * sd, np.abs(counts - expected).max()
    assert 0.8 * keys < fixed < 1.2 * keys


def test_small_sizes_reach_every_arrangement():
    """For n = 3 all six orders occur, about equally often over many keys."""
    seen: dict[tuple, int] = {}
    for k in range(3000):
        t = tuple(permute(np.arange(3), 3, permutation_keys(k)).tolist())
        seen[t] = seen.get(t, 0) + 1
    assert len(seen) == 6
    assert min(seen.values()) > 3000 / 6 * 0.8


def test_tweaks_give_independent_permutations_in_one_call():
    """One call, per-element sizes and tweaks: each (size, tweak) group is its own permutation."""
    keys = permutation_keys(5, 2)
    sizes = [10, 10, 37, 1, 64]
    x = np.concatenate([np.arange(s) for s in sizes])
    n = np.concatenate([np.full(s, s) for s in sizes])
    tweak = np.concatenate([np.full(s, t) for t, s in enumerate(sizes)])
    out = permute(x, n, keys, tweak=tweak)
    parts = np.split(out, np.cumsum(sizes)[:-1])
    for t, (s, part) in enumerate(zip(sizes, parts)):
        assert np.array_equal(np.sort(part), np.arange(s))
        assert np.array_equal(part, permute(np.arange(s), s, keys, tweak=t))
    assert not np.array_equal(parts[0], parts[1]), "the same size under another tweak is another order"


def test_bad_arguments_raise_value_error():
    keys = permutation_keys(0)
    assert permute(np.zeros(0, np.int64), 0, keys).tolist() == []
    for x, n in (([5], 5), ([-1], 5), ([0], 0)):
        with pytest.raises(ValueError, match="0 .. n - 1"):
            permute(np.array(x), n, keys)
    with pytest.raises(ValueError, match="not supported"):
        permute(np.array([0]), MAX_SIZE + 1, keys)
