"""A keyed permutation of ``0 .. n - 1`` evaluated pointwise: ``permute(x, n, keys)``.

Why: an epoch's order as one array (``rng.permutation(N)``) costs O(N) time and 8N bytes on
every rank before the first batch, at 10M samples about a second and at 100M several. Here
the sample at any position of the order is a pure function of the position, so a rank asks
for the positions of the batch it is about to read: O(batch) per batch, nothing at an epoch
boundary, and no state to share between ranks, workers or restarts.

How: a Feistel network on ``k``-bit integers (``2**k`` the power of two at or above ``n``,
``k >= 2``) is a bijection whatever its round functions, so it permutes ``0 .. 2**k - 1``;
*cycle walking* (apply it again while the value is ``>= n``) restricts it to a permutation
of ``0 .. n - 1`` (the walk from ``x`` follows ``x``'s cycle, which returns to ``x`` at
worst, so it ends). Since ``2**k < 2n`` for ``n > 2``, fewer than two steps are needed on
average. The halves are ``ceil(k/2)`` and ``floor(k/2)`` bits (a rotation between rounds keeps
every round a bijection when they differ); the round function is splitmix64's finaliser of
(half, round key, tweak), the same hash :mod:`.draws` uses. All arithmetic is uint64 numpy,
so the order is the same on every platform and numpy version; nothing uses Python's
``hash()`` or a generator's stream.

A ``tweak`` per element picks one of many independent permutations in the same call (a
:class:`~fastload.data.plan.BlockShufflePlan` shuffles each window of shards with its own).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .draws import _mix64

__all__ = ["MAX_SIZE", "ROUNDS", "permutation_keys", "permute"]

ROUNDS = 8  # 4 make a strong pseudo-random permutation in theory; small domains want more
MAX_SIZE = 1 << 52  # sizes up to here have exact float64 bit lengths (far beyond any dataset)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MASK64 = 0xFFFFFFFFFFFFFFFF


def permutation_keys(*words: int, rounds: int = ROUNDS) -> np.ndarray:
    """``rounds`` uint64 round keys, a pure function of ``words`` (e.g. seed, epoch, stream)."""
    with np.errstate(over="ignore"):
        key = np.uint64(0x6F72646572)  # "order"
        for w in words:
            key = _mix64(np.asarray(key ^ (np.uint64(int(w) & _MASK64) * _GOLDEN)))
        return _mix64(key + np.arange(1, int(rounds) + 1, dtype=np.uint64) * _GOLDEN)


def _bit_length(v: np.ndarray) -> np.ndarray:
    """Bit length of each non-negative int64 below ``MAX_SIZE`` (0 for 0)."""
    return np.frexp(v.astype(np.float64))[1].astype(np.uint64)


def _encrypt(x: np.ndarray, a: Any, b: Any, keys: np.ndarray, tweak: Any) -> np.ndarray:
    """One pass of the Feistel network over ``a + b``-bit values ``x`` (uint64)."""
    lo_mask = (np.uint64(1) << b) - np.uint64(1)
    hi_mask = (np.uint64(1) << a) - np.uint64(1)
    lo = np.empty_like(x)
    for k in keys:  # in place where numpy allows: fewer temporaries per round
        np.bitwise_and(x, lo_mask, out=lo)
        f = _mix64(lo ^ (tweak ^ k))
        f &= hi_mask
        np.right_shift(x, b, out=x)
        x ^= f  # the high part, changed by a function of the low part
        np.left_shift(lo, a, out=lo)
        x |= lo  # rotate: the next round changes the other bits
    return x


def permute(x: Any, n: Any, keys: np.ndarray, tweak: Any = 0) -> np.ndarray:
    """The images of ``x`` (ints in ``0 .. n - 1``) under the permutation of ``0 .. n - 1``
    set by ``keys`` (:func:`permutation_keys`) and ``tweak``, as int64. ``n`` and ``tweak`` are
    scalars or arrays shaped like ``x`` (one permutation per element); the cost is
    O(len(x)), whatever ``n``."""
    x = np.asarray(x, dtype=np.int64)
    shape = x.shape
    x = x.reshape(-1)
    per_element = np.ndim(n) > 0 or np.ndim(tweak) > 0
    n = np.asarray(n, dtype=np.int64)
    if x.size == 0:
        return np.zeros(shape, dtype=np.int64)
    if (x < 0).any() or (x >= n).any():
        raise ValueError("permute: every value must lie in 0 .. n - 1")
    if n.max() > MAX_SIZE:
        raise ValueError(f"permute: sizes above {MAX_SIZE} are not supported, got {int(n.max())}")
    keys = np.asarray(keys, dtype=np.uint64)
    with np.errstate(over="ignore"):
        twk = _mix64(np.asarray(tweak, dtype=np.int64).astype(np.uint64) * _GOLDEN + np.uint64(1))
        bits = np.maximum(_bit_length(n - 1), np.uint64(2))
        b = bits // np.uint64(2)
        a = bits - b
        if per_element:
            n = np.broadcast_to(n, shape).reshape(-1)
            a, b = np.broadcast_to(a, shape).reshape(-1), np.broadcast_to(b, shape).reshape(-1)
            twk = np.broadcast_to(twk, shape).reshape(-1)
        y = _encrypt(x.astype(np.uint64), a, b, keys, twk)  # a copy: x stays the caller's
        walk = np.flatnonzero(y >= n.astype(np.uint64))  # cycle walking: the few that left 0 .. n - 1
        while walk.size:
            if per_element:
                z = _encrypt(y[walk], a[walk], b[walk], keys, twk[walk])
                y[walk] = z
                walk = walk[z >= n[walk].astype(np.uint64)]
            else:
                z = _encrypt(y[walk], a, b, keys, twk)
                y[walk] = z
                walk = walk[z >= n.astype(np.uint64)]
    return y.astype(np.int64).reshape(shape)
