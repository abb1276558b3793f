"""``fastload.dali``: read a fastload pack through an NVIDIA DALI pipeline (nvJPEG on the GPU).

Importing this module needs DALI (``pip install nvidia-dali-cuda120``); ``import fastload``
never imports it. See :class:`DALILoader`.
"""

from __future__ import annotations

from .errors import require

require("nvidia.dali", "nvidia-dali-cuda120", "fastload.dali (the DALI pipeline)")

from .gpu.dali import DALILoader, PackBatchSource, dali_available  # noqa: E402

__all__ = ["DALILoader", "PackBatchSource", "dali_available"]
