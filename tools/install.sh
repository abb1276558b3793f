#!/usr/bin/env bash
# Installs fastload and everything it needs on a fresh Debian/Ubuntu machine.
#   bash tools/install.sh          # the package, its runtime deps, DALI (CPU pipelines work without a GPU)
#   bash tools/install.sh --test   # the same plus the test dependencies
# Safe to rerun: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="dali,remote"
[ "${1:-}" = "--test" ] && extras="dali,remote,test"

# jpeg4py needs libjpeg-turbo's shared library (Debian: libturbojpeg0).
if ! ldconfig -p 2>/dev/null | grep libturbojpeg >/dev/null; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "[install] apt-get install libturbojpeg0"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libturbojpeg0 >/dev/null
    else
        echo "[install] warning: libturbojpeg not found and cannot apt-get it; jpeg4py decoding will be unavailable" >&2
    fi
fi

# fastload's optional C extensions need a C compiler: fastload._jpegcrop (cropped JPEG decode)
# also libjpeg-turbo's headers (Debian: libjpeg62-turbo-dev); fastload._resize (the fast area
# filter) nothing else. Without them pip skips the extensions and fastload falls back to
# simplejpeg/OpenCV.
if [ ! -f /usr/include/jpeglib.h ] || ! command -v cc >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "[install] apt-get install libjpeg62-turbo-dev gcc"
        apt-get update -qq
        # libjpeg62-turbo-dev on Debian; libjpeg-dev names the libjpeg-turbo headers on Ubuntu too.
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libjpeg62-turbo-dev gcc >/dev/null \
            || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libjpeg-dev gcc >/dev/null \
            || echo "[install] warning: could not install libjpeg62-turbo-dev; the turbo-crop decoder will be unavailable" >&2
    else
        echo "[install] warning: no jpeglib.h or C compiler and cannot apt-get them; the turbo-crop decoder will be unavailable" >&2
    fi
fi

py=${PYTHON:-python3}
# Never let pip resolve an unpinned torch (it would pull GBs of CUDA wheels on a CPU box):
# keep the torch that is installed (a GPU user's CUDA build), else install the pinned CPU build.
if ! "$py" -c "import torch" >/dev/null 2>&1; then
    echo "[install] pip install torch==2.13.0"
    "$py" -m pip install -q torch==2.13.0
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$py" -c "import torch; print('torch==' + torch.__version__)" > "$constraints"

echo "[install] pip install -e .[$extras]"
"$py" -m pip install -q --disable-pip-version-check -c "$constraints" -e ".[$extras]"
if "$py" -c "import fastload._jpegcrop" >/dev/null 2>&1; then
    echo "[install] built fastload._jpegcrop (turbo-crop JPEG decoder)"
else
    echo "[install] note: fastload._jpegcrop not built; decoding falls back to simplejpeg/OpenCV" >&2
fi
if "$py" -c "import fastload._resize" >/dev/null 2>&1; then
    echo "[install] built fastload._resize (area and bilinear resize with a fused flip)"
else
    echo "[install] note: fastload._resize not built; shrinking crops fall back to OpenCV's INTER_AREA" >&2
fi
