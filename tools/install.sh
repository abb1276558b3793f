#!/usr/bin/env bash
# Installs fastload and everything it needs on a fresh Debian/Ubuntu machine.
#   bash tools/install.sh          # the package, its runtime deps, DALI (CPU pipelines work without a GPU)
#   bash tools/install.sh --test   # the same plus the test dependencies
# Safe to rerun: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS=0

extras="dali,remote"
[ "${1:-}" = "--test" ] && extras="dali,remote,test"

# jpeg4py needs libjpeg-turbo's shared library (Debian: libturbojpeg0).
if ! ldconfig -p 2>/dev/null | grep libturbojpeg >/dev/null; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "[install] apt-get install libturbojpeg0 (for jpeg4py; ~20 s)"
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
        echo "[install] apt-get install libjpeg62-turbo-dev gcc (to build fastload's C extensions; ~30 s)"
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
constraints=$(mktemp)
pip_log=$(mktemp)
trap 'rm -f "$constraints" "$pip_log"' EXIT

# pip's own progress bars on a terminal; in a log or a pipe, one line per download and step
# (no bars, no "Requirement already satisfied" for every dependency), and pip's last lines if it fails.
pip_install() {
    if [ -t 1 ]; then
        "$py" -m pip install --disable-pip-version-check "$@"
        return
    fi
    set +e
    "$py" -m pip install --disable-pip-version-check --progress-bar off "$@" 2>&1 | tee "$pip_log" \
        | grep --line-buffered -E '^ *(Downloading|Building wheel for|Installing collected|Successfully)' \
        | sed -u 's/^ */[install]   /'
    local rc=${PIPESTATUS[0]}
    set -e
    if [ "$rc" != 0 ]; then
        echo "[install] pip failed (exit $rc); its last lines:" >&2
        tail -n 25 "$pip_log" >&2
        exit "$rc"
    fi
}

# Never let pip resolve an unpinned torch (it would pull GBs of CUDA wheels on a CPU box):
# keep the torch that is installed (a GPU user's CUDA build), else install the pinned CPU build.
if ! "$py" -c "import torch" >/dev/null 2>&1; then
    echo "[install] pip install torch==2.13.0 (the CPU build, ~200 MB: about a minute)"
    pip_install torch==2.13.0
fi
torch_version=$("$py" -c "import torch; print(torch.__version__)")
echo "torch==$torch_version" > "$constraints"

echo "[install] pip install -e .[$extras] (torch $torch_version kept; DALI is a ~600 MB download:" \
     "1-2 min the first time, seconds on a rerun)"
pip_install -c "$constraints" -e ".[$extras]"
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
# The az:// tests run against Azurite, Microsoft's Azure Blob emulator (an npm package), kept
# in .test-tools/ of the repository; without npm those tests skip with a reason.
if [ "${1:-}" = "--test" ]; then
    if [ -x .test-tools/node_modules/.bin/azurite-blob ]; then
        :
    elif command -v npm >/dev/null 2>&1; then
        echo "[install] npm install azurite (Azure Blob emulator for the az:// tests; ~20 s)"
        npm install --prefix .test-tools --no-audit --no-fund --silent azurite@3 >/dev/null \
            || echo "[install] warning: npm could not install azurite; the az:// tests will skip" >&2
    else
        echo "[install] note: no npm; the az:// tests will skip (apt-get install npm to run them)" >&2
    fi
fi
echo "[install] done in ${SECONDS} s; \`fastload info\` lists what you got, \`fastload demo\` tries it (about a minute)"
