"""Build hook for the optional C extensions; project metadata lives in pyproject.toml.

``fastload._jpegcrop`` decodes only a crop box of a JPEG with libjpeg-turbo's partial
decompression (Debian: ``libjpeg62-turbo-dev``). It is optional: without the headers or a
compiler the build skips it and fastload decodes with simplejpeg/OpenCV instead.

``fastload._resize`` resizes crops: an area (box-filter) downscale like cv2.INTER_AREA (~6x
faster) and bilinear like INTER_LINEAR (~2x faster), with the horizontal flip in the same
pass; plain C, no libraries. Also optional: without it fastload calls OpenCV.
It picks its AVX2 kernels at run time, so the build targets baseline x86-64 (or any other
CPU: the SIMD code is compiled only on x86-64).
"""

import sys

from setuptools import Extension, setup

_O3 = [] if sys.platform == "win32" else ["-O3"]

setup(
    ext_modules=[
        Extension(
            "fastload._jpegcrop",
            ["fastload/_jpegcrop.c"],
            libraries=["jpeg"],
            optional=True,
        ),
        Extension(
            "fastload._resize",
            ["fastload/_resize.c"],
            extra_compile_args=_O3,
            optional=True,
        ),
    ]
)
