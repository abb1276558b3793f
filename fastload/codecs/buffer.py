"""The byte-buffer type every codec's ``decode`` accepts (its own module, so the codec modules
need not import their package, which imports them)."""

from __future__ import annotations

import numpy as np

Buffer = bytes | bytearray | memoryview | np.ndarray
