"""One normalisation, one unit: :class:`Normalization` in 0-1 units, shared by every consumer.

The CPU ``Normalize`` transform, the GPU ``normalize``/``BatchAugment`` helpers, the
``CUDAPrefetcher``, the DALI pipeline and ``fastload.train.Trainer`` all take their mean and
std from a :class:`Normalization`, so a value written for one means the same for all of them.
The unit is torchvision's: ``(x / 255 - mean) / std`` for uint8 pixels ``x``. Values that look
like 0-255 units are refused rather than silently giving a model the wrong inputs; write them
with :meth:`Normalization.from_255`. No torch or numpy here: the CPU transforms import it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["IMAGENET", "SCALE_ONLY", "Normalization", "as_normalization", "scale_shift"]

_Floats = tuple[float, ...]


def _floats(values: Iterable[float], name: str) -> _Floats:
    """A tuple of finite floats from any sequence of numbers (list, tuple, array, tensor)."""
    try:
        if isinstance(values, (str, bytes)):
            raise TypeError
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a sequence of numbers, got {values!r}") from None
    if not all(math.isfinite(v) for v in out):
        raise ValueError(f"{name} values must be finite, got {out}")
    return out


@dataclass(frozen=True)
class Normalization:
    """Per-channel ``mean`` and ``std`` in 0-1 units: ``out = (x / 255 - mean) / std``.

    A 1-channel normalisation applies to every channel. Any ``mean`` or ``std`` above 1 is
    refused as a 0-255 value given in the wrong unit (use :meth:`from_255` for those).
    """

    mean: _Floats
    std: _Floats

    def __post_init__(self) -> None:
        mean, std = _floats(self.mean, "mean"), _floats(self.std, "std")
        if not mean or len(mean) != len(std):
            raise ValueError(f"mean and std must have the same length >= 1, got {len(mean)} and {len(std)} values")
        if any(s <= 0 for s in std):
            raise ValueError(f"std values must be > 0, got {std}")
        if any(m > 1 for m in mean) or any(s > 1 for s in std):
            raise ValueError(
                f"Normalization expects mean/std in 0-1 units (applied to x / 255), got mean={mean}, std={std}; "
                f"for 0-255 values use Normalization.from_255(mean, std)"
            )
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)

    @classmethod
    def from_255(cls, mean: Sequence[float], std: Sequence[float]) -> Normalization:
        """The same normalisation written in 0-255 units (``(x - mean) / std`` on uint8 pixels)."""
        m, s = _floats(mean, "mean"), _floats(std, "std")
        if all(v <= 1 for v in (*m, *s)):
            raise ValueError(
                f"Normalization.from_255 expects mean/std in 0-255 units, got mean={m}, std={s}, which look "
                f"like 0-1 units; pass those to Normalization(mean, std)"
            )
        return cls(tuple(v / 255.0 for v in m), tuple(v / 255.0 for v in s))

    @property
    def channels(self) -> int:
        return len(self.mean)

    def broadcast(self, channels: int) -> Normalization:
        """This normalisation for images of ``channels`` channels (a 1-channel one is repeated)."""
        if self.channels == channels:
            return self
        if self.channels == 1:
            return Normalization(self.mean * channels, self.std * channels)
        raise ValueError(f"the normalization has {self.channels} channels but the images have {channels} channels")

    def scale_shift(self, channels: int) -> tuple[_Floats, _Floats]:
        """Per-channel ``(scale, shift)`` with ``out = x_uint8 * scale - shift``: one multiply
        and one subtract per pixel, the arithmetic every consumer runs, so they agree."""
        n = self.broadcast(channels)
        return tuple(1.0 / (255.0 * s) for s in n.std), tuple(m / s for m, s in zip(n.mean, n.std))

    @property
    def mean_255(self) -> _Floats:
        """``mean`` in 0-255 units (for operators that see uint8 values, like DALI's)."""
        return tuple(m * 255.0 for m in self.mean)

    @property
    def std_255(self) -> _Floats:
        """``std`` in 0-255 units."""
        return tuple(s * 255.0 for s in self.std)


IMAGENET = Normalization((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
"""The ImageNet channel statistics torchvision's pretrained models expect."""

SCALE_ONLY = Normalization((0.0,), (1.0,))
"""``x / 255`` and nothing else: what "no normalization" (``None``) means to every consumer."""


def as_normalization(
    normalization: Normalization | None = None,
    *,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> Normalization | None:
    """The one check of what users may pass: a :class:`Normalization`, or ``mean``/``std`` in
    0-1 units (a missing one defaults to 0 or 1 per channel), or nothing (``None``: x / 255 only).
    """
    if normalization is not None:
        if mean is not None or std is not None:
            raise ValueError("pass either normalization= or mean=/std=, not both")
        if not isinstance(normalization, Normalization):
            raise ValueError(
                f"normalization must be a fastload.Normalization, got {type(normalization).__name__}"
            )
        return normalization
    if mean is None and std is None:
        return None
    if mean is None:
        mean = (0.0,) * len(_floats(std, "std"))  # type: ignore[arg-type]
    if std is None:
        std = (1.0,) * len(_floats(mean, "mean"))
    return Normalization(mean, std)  # type: ignore[arg-type]


def scale_shift(normalization: Normalization | None, channels: int) -> tuple[_Floats, _Floats]:
    """:meth:`Normalization.scale_shift`, with ``None`` meaning :data:`SCALE_ONLY`."""
    return (normalization or SCALE_ONLY).scale_shift(channels)
