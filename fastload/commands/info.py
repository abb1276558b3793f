"""``fastload info``: what this install has, in one command, for a bug report.

Versions (fastload, Python, torch and CUDA, DALI, OpenCV and the libjpeg-turbo it carries,
simplejpeg, jpeg4py's libturbojpeg, obstore...), which JPEG decoders work and whether the C
extensions were built, the cores this process may use, ``/dev/shm`` and the GPUs torch sees:
like torch's ``collect_env``. Every probe is guarded: a missing piece reads "not installed" or
"not built", never a traceback.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from typing import Any, Callable

NOT_INSTALLED = "not installed"
NOT_BUILT = "not built"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "info", help="print versions, decoders, C extensions, CPUs, /dev/shm and GPUs (for bug reports)",
        description="Print what this install of fastload has: versions of fastload, Python, torch, CUDA, DALI, "
                    "OpenCV, libjpeg-turbo and obstore; which JPEG decoders and C extensions work; usable CPUs; "
                    "/dev/shm size and free space; the GPUs torch sees. Paste it into a bug report.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(run=run)


def _guard(probe: Callable[[], Any]) -> Any:
    """A probe's answer, or one line saying why it has none (a probe must never end the report)."""
    try:
        return probe()
    except ImportError:
        return NOT_INSTALLED
    except Exception as exc:  # noqa: BLE001 - anything a broken install raises
        return f"error: {type(exc).__name__}: {exc}".splitlines()[0]


def _dist_version(*names: str) -> str:
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return NOT_INSTALLED


def _dali() -> str:
    from importlib import metadata

    dists = sorted({d.metadata["Name"] for d in metadata.distributions()
                    if (d.metadata["Name"] or "").lower().startswith("nvidia-dali")})
    if not dists:
        return NOT_INSTALLED
    try:
        import nvidia.dali  # the CPU pipeline works without a GPU, so it must import everywhere
    except ImportError as exc:
        return f"{', '.join(dists)} installed, but does not import: {str(exc).splitlines()[0]}"
    return f"{nvidia.dali.__version__} ({', '.join(dists)})"


def _torch() -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    gpus = []
    if cuda:
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            gpus.append(f"{i}: {prop.name}, {prop.total_memory / 2**30:.1f} GiB, compute {prop.major}.{prop.minor}")
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "version": torch.__version__,
        "built with CUDA": torch.version.cuda or "no (CPU build)",
        "cuDNN": str(cudnn) if cudnn else "none",
        "CUDA available": cuda,
        "GPUs": gpus or ["none seen by torch"],
    }


def _opencv() -> str:
    import cv2

    jpeg = next((line.split(":", 1)[1].strip() for line in cv2.getBuildInformation().splitlines()
                 if line.strip().startswith("JPEG:")), "unknown")
    return f"{cv2.__version__} (JPEG: {jpeg})"


def _libturbojpeg() -> str:
    import ctypes.util

    name = ctypes.util.find_library("turbojpeg")
    return name or "not found (jpeg4py cannot decode; Debian: apt-get install libturbojpeg0)"


def _turbo_version(number: int) -> str:
    return f"{number // 1000000}.{number // 1000 % 1000}.{number % 1000}"


def _extensions() -> dict[str, str]:
    out = {}
    try:
        from .. import _jpegcrop

        version = getattr(_jpegcrop, "LIBJPEG_TURBO_VERSION", None)
        out["fastload._jpegcrop"] = "built" + (f" (libjpeg-turbo {_turbo_version(version)})" if version else "")
    except ImportError:
        out["fastload._jpegcrop"] = f"{NOT_BUILT}: JPEGs are decoded whole instead of only the crop"
    try:
        from .. import _resize

        out["fastload._resize"] = f"built (SIMD: {_resize.simd()})"
    except ImportError:
        out["fastload._resize"] = f"{NOT_BUILT}: OpenCV resizes the crops (2-6x slower)"
    return out


def _decoders() -> dict[str, str]:
    """Each JPEG decoder fastload can use, tried on a tiny JPEG (importing is not enough:
    jpeg4py imports without libturbojpeg and fails at its first decode)."""
    import numpy as np

    from ..codecs import jpeg

    probe = jpeg.encode(np.zeros((16, 16, 3), np.uint8), quality=90)
    out = {}
    for name in jpeg.BACKENDS:
        try:
            jpeg.decode(probe, backend=name)
            out[name] = "works"
        except Exception as exc:  # noqa: BLE001 - a missing library shows up as anything
            out[name] = f"unavailable ({str(exc).splitlines()[0][:120] or type(exc).__name__})"
    return out


def _shm() -> str:
    if not os.path.isdir("/dev/shm"):
        return "not present (give the DataLoader ring_dir=; in_memory=True needs it)"
    usage = shutil.disk_usage("/dev/shm")
    return f"{usage.total / 2**30:.1f} GiB, {usage.free / 2**30:.1f} GiB free"


def collect() -> dict[str, Any]:
    """The report as a JSON-able dict (``fastload info --json`` prints it)."""
    from .. import __version__
    from ..config import usable_cpus

    return {
        "fastload": {"version": __version__, "path": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))},
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "cpus": _guard(lambda: f"{usable_cpus()} usable (of {os.cpu_count()} on the machine)"),
        "/dev/shm": _guard(_shm),
        "torch": _guard(_torch),
        "DALI": _guard(_dali),
        "OpenCV": _guard(_opencv),
        "simplejpeg": _guard(lambda: _dist_version("simplejpeg")),
        "jpeg4py": _guard(lambda: _dist_version("jpeg4py")),
        "libturbojpeg (for jpeg4py)": _guard(_libturbojpeg),
        "Pillow": _guard(lambda: _dist_version("Pillow", "pillow")),
        "numpy": _guard(lambda: _dist_version("numpy")),
        "lmdb": _guard(lambda: _dist_version("lmdb")),
        "h5py": _guard(lambda: _dist_version("h5py")),
        "obstore (s3://, gs://, az://)": _guard(lambda: _dist_version("obstore")),
        "C extensions": _guard(_extensions),
        "JPEG decoders": _guard(_decoders),
    }


def _lines(report: dict[str, Any], indent: str = "") -> list[str]:
    out = []
    for key, value in report.items():
        if isinstance(value, dict):
            out.append(f"{indent}{key}:")
            out += _lines(value, indent + "  ")
        elif isinstance(value, list):
            out.append(f"{indent}{key}: {value[0]}" if len(value) == 1 else f"{indent}{key}:")
            if len(value) > 1:
                out += [f"{indent}  {v}" for v in value]
        else:
            out.append(f"{indent}{key}: {value}")
    return out


def run(args) -> int:
    report = collect()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print("\n".join(_lines(report)))
    extensions = report["C extensions"]
    if isinstance(extensions, dict) and any(v.startswith(NOT_BUILT) for v in extensions.values()):
        from ..errors import BUILD_EXTENSIONS

        print(f"to build the C extensions: {BUILD_EXTENSIONS}", file=sys.stderr)
    return 0
