"""Random numbers per sample: a counter-based hash of ``(seed, epoch, sample index, stream, draw)``.

Every random decision of an augmentation (a crop box, a flip) is a pure function of the
sample's identity, not of a generator's history. So a sample gets the same augmentation

* whichever worker, batch or rank it lands in, and however many workers there are;
* on every backend: the CPU transforms (:mod:`fastload.data.transforms`), the GPU batch
  helpers (:mod:`fastload.gpu.transforms`) and the DALI pipeline draw the same numbers, so a
  RandomResizedCrop + flip of a given stored size picks the same box and flip on all three.

Numbers come out for a whole batch at once (a few vectorised numpy operations), so the
per-sample cost is a list lookup, not a ``numpy.random.Generator`` built per sample.

Streams keep independent decisions apart: RandomResizedCrop draws from :data:`STREAM_CROP`,
RandomHorizontalFlip from :data:`STREAM_FLIP`; the k-th transform of the same kind in one
pipeline uses stream ``base + k * STREAM_STEP``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = [
    "STREAM_CROP",
    "STREAM_FLIP",
    "STREAM_STEP",
    "STREAM_SUBSTITUTE",
    "SUBSTITUTE_CANDIDATES",
    "BatchDraws",
    "SampleDraws",
    "crop_boxes",
    "flip_flags",
    "rrc_box",
    "rrc_boxes",
    "substitute_index",
    "take",
    "uniform",
]

STREAM_FLIP = 1
STREAM_CROP = 2
STREAM_SUBSTITUTE = 3  # which records stand in for a corrupt one (not an augmentation)
STREAM_STEP = 64
SUBSTITUTE_CANDIDATES = 8  # substitutes tried for a corrupt record before giving up
RRC_ATTEMPTS = 10  # torchvision's number of tries before the centre-crop fallback

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MASK64 = 0xFFFFFFFFFFFFFFFF


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective, well-mixed hash of uint64 values (vectorised)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniform(seed: int, epoch: int, indices: Any, *, stream: int, draws: int = 1) -> np.ndarray:
    """Uniform [0, 1) float64 numbers, shape ``(len(indices), draws)``, a pure function of
    ``(seed, epoch, index, stream, draw)``: the same sample gets the same numbers in any batch.
    """
    idx = np.asarray(indices, dtype=np.int64).reshape(-1).astype(np.uint64)
    with np.errstate(over="ignore"):
        key = _mix64(np.uint64(int(seed) & _MASK64) * _GOLDEN + np.uint64(int(stream) & _MASK64))
        key = _mix64(key ^ (np.uint64(int(epoch) & _MASK64) * _GOLDEN))
        base = _mix64(key ^ (idx * _GOLDEN))[:, None]
        j = np.arange(1, int(draws) + 1, dtype=np.uint64)[None, :]
        bits = _mix64(base + j * _GOLDEN)
    # The top 53 bits make an exactly representable double in [0, 1).
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def substitute_index(seed: int, epoch: int, i: int, k: int, n: int) -> int:
    """Candidate ``k`` (0, 1, ...) among the ``n`` records to serve in place of corrupt record
    ``i`` in ``epoch``: uniform over every index but ``i``, and a pure function of
    ``(seed, epoch, i, k)``, so every worker count and backend (CPU loader, DALI) picks the same
    substitute."""
    n, i, k = int(n), int(i), int(k)
    if n < 2:
        raise ValueError(f"a dataset of {n} record(s) has no other record to substitute")
    if not 0 <= i < n:
        raise ValueError(f"record {i} out of range for a dataset of {n}")
    if k < 0:
        raise ValueError(f"candidate number must be >= 0, got {k}")
    u = uniform(seed, epoch, [i], stream=STREAM_SUBSTITUTE, draws=k + 1)[0, k]
    j = min(int(u * (n - 1)), n - 2)  # guard the float product against rounding up to n - 1
    return j + 1 if j >= i else j


# -- RandomResizedCrop's box, from 4 numbers per attempt --------------------------------------
#
# Both versions below do the same float64 operations in the same order (the aspect ratio goes
# through math.exp in both; sqrt, round-half-even and floor are exact in numpy and Python
# alike), so the scalar one the CPU path runs per sample and the vectorised one the GPU and
# DALI paths run per batch pick the very same box.


def _fallback(height: int, width: int, ratio: tuple[float, float]) -> tuple[int, int, int, int]:
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def rrc_box(
    height: int, width: int, u: list[float], *, scale: tuple[float, float], ratio: tuple[float, float]
) -> tuple[int, int, int, int]:
    """(top, left, h, w) of a RandomResizedCrop of a ``height`` x ``width`` image, from ``u``
    (4 uniform numbers per attempt: area, log aspect ratio, top, left). torchvision's rule:
    the first attempt whose box fits, else the centre crop clamped to ``ratio``."""
    area = float(height * width)
    s_lo, s_span = scale[0], scale[1] - scale[0]
    log_lo = math.log(ratio[0])
    log_span = math.log(ratio[1]) - log_lo
    for a in range(0, len(u) - 3, 4):
        target = area * (s_lo + u[a] * s_span)
        aspect = math.exp(log_lo + u[a + 1] * log_span)
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return math.floor(u[a + 2] * (height - h + 1)), math.floor(u[a + 3] * (width - w + 1)), h, w
    return _fallback(height, width, ratio)


def rrc_boxes(
    heights: Any, widths: Any, u: np.ndarray, *, scale: tuple[float, float], ratio: tuple[float, float]
) -> np.ndarray:
    """:func:`rrc_box` for a batch: ``u`` is ``(n, 4 * attempts)``, ``heights``/``widths`` scalars
    or length-``n`` arrays; returns int64 ``(n, 4)`` boxes (top, left, h, w)."""
    u = np.asarray(u, dtype=np.float64)
    n = u.shape[0]
    u = u.reshape(n, -1, 4)
    hh = np.broadcast_to(np.asarray(heights, dtype=np.int64).reshape(-1, 1), (n, 1))
    ww = np.broadcast_to(np.asarray(widths, dtype=np.int64).reshape(-1, 1), (n, 1))
    area = (hh * ww).astype(np.float64)
    s_lo, s_span = scale[0], scale[1] - scale[0]
    log_lo = math.log(ratio[0])
    log_span = math.log(ratio[1]) - log_lo
    target = area * (s_lo + u[..., 0] * s_span)
    expo = log_lo + u[..., 1] * log_span
    aspect = np.fromiter(map(math.exp, expo.ravel().tolist()), dtype=np.float64, count=expo.size).reshape(expo.shape)
    w = np.rint(np.sqrt(target * aspect)).astype(np.int64)
    h = np.rint(np.sqrt(target / aspect)).astype(np.int64)
    ok = (w > 0) & (h > 0) & (w <= ww) & (h <= hh)
    top = np.floor(u[..., 2] * (hh - h + 1)).astype(np.int64)
    left = np.floor(u[..., 3] * (ww - w + 1)).astype(np.int64)
    rows = np.arange(n)
    first = np.argmax(ok, axis=1)
    boxes = np.stack([top, left, h, w], axis=-1)[rows, first]
    for r in np.flatnonzero(~ok[rows, first]):
        boxes[r] = _fallback(int(hh[r, 0]), int(ww[r, 0]), ratio)
    return boxes


def crop_boxes(
    seed: int, epoch: int, indices: Any, heights: Any, widths: Any, *,
    scale: tuple[float, float], ratio: tuple[float, float], attempts: int = RRC_ATTEMPTS,
) -> np.ndarray:
    """RandomResizedCrop boxes (int64 ``(n, 4)``: top, left, h, w) of samples ``indices`` in
    ``epoch``, for stored sizes ``heights`` x ``widths`` (scalars or per sample): what the CPU
    transform picks for each of them, computed for the whole batch at once."""
    u = uniform(seed, epoch, indices, stream=STREAM_CROP, draws=4 * attempts)
    return rrc_boxes(heights, widths, u, scale=scale, ratio=ratio)


def flip_flags(seed: int, epoch: int, indices: Any, p: float) -> np.ndarray:
    """Which of samples ``indices`` RandomHorizontalFlip(``p``) mirrors in ``epoch`` (bool ``(n,)``)."""
    return uniform(seed, epoch, indices, stream=STREAM_FLIP)[:, 0] < p


# -- draws for the samples of one batch -------------------------------------------------------


class BatchDraws:
    """The random numbers of a batch of samples, computed a stream at a time for all of them."""

    __slots__ = ("seed", "epoch", "indices", "_blocks")

    def __init__(self, seed: int, epoch: int, indices: Any):
        self.seed = int(seed)
        self.epoch = int(epoch)
        self.indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        self._blocks: dict[tuple[int, int], list[list[float]]] = {}

    def rows(self, stream: int, draws: int) -> list[list[float]]:
        """``draws`` numbers of ``stream`` for every sample of the batch (cached)."""
        key = (stream, draws)
        block = self._blocks.get(key)
        if block is None:
            block = uniform(self.seed, self.epoch, self.indices, stream=stream, draws=draws).tolist()
            self._blocks[key] = block
        return block

    def sample(self, j: int) -> SampleDraws:
        """The draws of the batch's ``j``-th sample."""
        return SampleDraws(self, j)


class SampleDraws:
    """One sample's random numbers, what fastload's transforms receive as ``rng``.

    Transforms call :meth:`take`; the k-th call for the same stream gets stream
    ``stream + k * STREAM_STEP``, so two flips in one pipeline do not share their coin. Code
    that expects a ``numpy.random.Generator`` (a user's ``Lambda(..., takes_rng=True)``) can use
    its methods here too: they come from a generator seeded by the same ``(seed, epoch, index)``.
    """

    __slots__ = ("_batch", "_j", "_used", "_gen")

    def __init__(self, batch: BatchDraws, j: int):
        self._batch = batch
        self._j = j
        self._used: dict[int, int] = {}
        self._gen: np.random.Generator | None = None

    @classmethod
    def single(cls, seed: int, epoch: int, index: int) -> SampleDraws:
        return cls(BatchDraws(seed, epoch, [index]), 0)

    @property
    def index(self) -> int:
        return int(self._batch.indices[self._j])

    def take(self, stream: int, draws: int) -> list[float]:
        k = self._used.get(stream, 0)
        self._used[stream] = k + 1
        return self._batch.rows(stream + k * STREAM_STEP, draws)[self._j]

    @property
    def generator(self) -> np.random.Generator:
        """A ``numpy.random.Generator`` seeded by ``(seed, epoch, index)``, for free-form use."""
        if self._gen is None:
            b = self._batch
            self._gen = np.random.default_rng([b.seed & _MASK64, b.epoch & _MASK64, self.index, 0x5EED])
        return self._gen

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.generator, name)


def take(rng: Any, stream: int, draws: int) -> list[float]:
    """``draws`` uniform [0, 1) numbers for a transform: from the sample's hash stream when
    ``rng`` is a :class:`SampleDraws`, else from a plain ``numpy.random.Generator``."""
    if isinstance(rng, SampleDraws):
        return rng.take(stream, draws)
    return rng.random(draws).tolist()
