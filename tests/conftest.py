"""Shared fixtures: every test builds its own tiny data in tmp_path (nothing is downloaded)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

# Keep tests snappy and predictable on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sample_tree(tmp_path_factory) -> Path:
    """A small ImageFolder tree of real-photo JPEGs: 4 classes x 6 images, ~120x160."""
    from fastload.sample import make_image_folder

    root = tmp_path_factory.mktemp("sample_tree")
    return make_image_folder(root, num_classes=4, per_class=6, size=(120, 160), seed=1, workers=1)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(12345)
