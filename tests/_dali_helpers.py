"""Whether NVIDIA DALI is importable here, and the skip mark for tests that need it."""

from __future__ import annotations

import pytest

try:
    import nvidia.dali  # noqa: F401

    HAVE_DALI = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_DALI = False

needs_dali = pytest.mark.skipif(not HAVE_DALI, reason="nvidia.dali is not installed (pip install nvidia-dali-cuda120)")
