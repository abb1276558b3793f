"""The built-in sample dataset: real photographs expanded into an ImageFolder tree.

fastload ships eight small public-domain/CC0 photographs (``fastload/sample_data``, see its
LICENSE.txt). :func:`make_image_folder` turns them into ``N`` classes of ``M`` ImageNet-like
JPEGs (about 375x500 HxW, quality 90) by random crops, scales, flips and lighting, so the demo,
tests and benchmarks all get realistic data without any download. Class ``c`` is drawn from
photograph ``c % 8`` (rotated by 90 degrees for every further round of 8), so the classes
are learnable: a CNN must tell which photograph a crop came from.
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from importlib import resources
from pathlib import Path

import cv2
import numpy as np

from .config import usable_cpus

PHOTOS = ("astronaut", "brick", "cat", "coffee", "grass", "hubble", "retina", "rocket")


def photo_paths() -> list[Path]:
    """Paths of the bundled photographs, in class order."""
    base = resources.files("fastload") / "sample_data"
    return [Path(str(base / f"{name}.jpg")) for name in PHOTOS]


def class_names(num_classes: int) -> list[str]:
    return [f"{i:03d}_{PHOTOS[i % len(PHOTOS)]}" for i in range(num_classes)]


def _base_image(c: int) -> np.ndarray:
    img = cv2.imread(str(photo_paths()[c % len(PHOTOS)]), cv2.IMREAD_COLOR)  # BGR is fine here
    return np.ascontiguousarray(np.rot90(img, k=c // len(PHOTOS)))


def render(base: np.ndarray, rng: np.random.Generator, out_hw: tuple[int, int]) -> np.ndarray:
    """One random view of ``base``: crop (25-100% of the area), aspect jitter, flip, lighting."""
    H, W = base.shape[:2]
    for _ in range(10):
        area = H * W * rng.uniform(0.25, 1.0)
        ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        w = int(round(np.sqrt(area * ratio)))
        h = int(round(np.sqrt(area / ratio)))
        if 0 < w <= W and 0 < h <= H:
            break
    else:
        h, w = H, W
    top = int(rng.integers(0, H - h + 1))
    left = int(rng.integers(0, W - w + 1))
    crop = base[top : top + h, left : left + w]
    oh, ow = out_hw
    interp = cv2.INTER_AREA if oh * ow < h * w else cv2.INTER_CUBIC
    img = cv2.resize(crop, (ow, oh), interpolation=interp)
    if rng.random() < 0.5:
        img = img[:, ::-1]
    gain = rng.uniform(0.8, 1.2)
    bias = rng.uniform(-15, 15)
    return cv2.convertScaleAbs(np.ascontiguousarray(img), alpha=gain, beta=bias)


def _make_class(args) -> int:
    root, c, name, per_class, size, seed, quality = args
    base = _base_image(c)
    rng = np.random.default_rng([seed, c])
    d = Path(root) / name
    d.mkdir(parents=True, exist_ok=True)
    for i in range(per_class):
        # One image in four is portrait, like a real photo collection.
        hw = (size[1], size[0]) if rng.random() < 0.25 else size
        img = render(base, rng, hw)
        cv2.imwrite(str(d / f"{name}_{i:05d}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, quality])
    return per_class


def make_image_folder(
    root: str | Path,
    *,
    num_classes: int = 8,
    per_class: int = 100,
    size: tuple[int, int] = (375, 500),
    seed: int = 0,
    quality: int = 90,
    workers: int | None = None,
) -> Path:
    """Write ``root/<class>/<image>.jpg``: ``num_classes`` x ``per_class`` JPEGs of ``size``
    ``(height, width)``, as torch orders sizes; one image in four is the transposed (portrait) size.

    Deterministic for a given seed. Returns ``root``.
    """
    if num_classes < 1 or per_class < 1:
        raise ValueError("num_classes and per_class must be >= 1")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    names = class_names(num_classes)
    jobs = [(str(root), c, names[c], per_class, tuple(size), seed, quality) for c in range(num_classes)]
    workers = min(workers or usable_cpus(), num_classes)
    if workers <= 1:
        for j in jobs:
            _make_class(j)
    else:
        with ProcessPoolExecutor(workers) as ex:
            list(ex.map(_make_class, jobs))
    return root
