"""Build hook for the optional C extension; project metadata lives in pyproject.toml.

``fastload._jpegcrop`` decodes only a crop box of a JPEG with libjpeg-turbo's partial
decompression (Debian: ``libjpeg62-turbo-dev``). It is optional: without the headers or a
compiler the build skips it and fastload decodes with simplejpeg/OpenCV instead.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "fastload._jpegcrop",
            ["fastload/_jpegcrop.c"],
            libraries=["jpeg"],
            optional=True,
        )
    ]
)
