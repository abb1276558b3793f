"""``fastload info`` says what the install gave you, and a missing C extension is said once."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _data_helpers import make_pack
from _pack_helpers import cli_env, make_jpeg_tree, run_cli

SECTIONS = ("fastload", "python", "platform", "cpus", "/dev/shm", "torch", "DALI", "OpenCV", "simplejpeg",
            "jpeg4py", "libturbojpeg (for jpeg4py)", "obstore (s3://, gs://, az://)", "C extensions", "JPEG decoders")


def _python(code: str, *, timeout: int = 300) -> subprocess.CompletedProcess:
    env = cli_env()
    env.pop("FASTLOAD_WARNED_NOT_BUILT", None)  # set when this pytest process warned (test_resize's fallback)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _info_json(*missing: str) -> tuple[dict, str]:
    """``fastload info --json`` in a process where the modules in ``missing`` cannot be imported."""
    proc = _python(f"""
        import sys
        for name in {list(missing)!r}:
            sys.modules[name] = None  # what an install without that piece looks like to an import
        from fastload.cli import main
        sys.exit(main(["info", "--json"]))
    """)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return json.loads(proc.stdout), proc.stderr


def test_info_text_lists_every_section():
    proc = run_cli("info")  # python -m fastload info
    assert proc.returncode == 0, proc.stderr
    for section in SECTIONS:
        assert f"\n{section}:" in "\n" + proc.stdout, section
    assert "version: " in proc.stdout and "usable" in proc.stdout


def test_info_json_reports_this_install():
    import os

    import fastload
    import torch

    report, _ = _info_json()
    assert set(SECTIONS) <= set(report)
    assert report["fastload"]["version"] == fastload.__version__
    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["CUDA available"] == torch.cuda.is_available()
    assert report["cpus"].startswith(f"{len(os.sched_getaffinity(0))} usable")
    assert report["/dev/shm"].endswith("GiB free")
    assert report["JPEG decoders"]["cv2"] == "works"
    for name in ("fastload._jpegcrop", "fastload._resize"):
        assert report["C extensions"][name].startswith(("built", "not built")), name


def test_info_without_optional_pieces_says_so_and_does_not_crash():
    report, err = _info_json("fastload._jpegcrop", "fastload._resize", "torch", "nvidia.dali", "simplejpeg", "obstore")
    assert report["torch"] == "not installed"
    assert report["DALI"] == "not installed" or "installed, but does not import" in report["DALI"]
    ext = report["C extensions"]
    assert ext["fastload._jpegcrop"].startswith("not built") and ext["fastload._resize"].startswith("not built")
    assert report["JPEG decoders"]["turbo-crop"].startswith("unavailable")
    assert report["JPEG decoders"]["simplejpeg"].startswith("unavailable")
    assert report["JPEG decoders"]["pil"] == "works"
    assert "apt-get install gcc libjpeg62-turbo-dev && pip install -e ." in err  # how to build them


# -- the loader says once that the C extensions are missing -------------------------------


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("info")
    return make_pack(make_jpeg_tree(root / "src", classes=2, per_class=8, hw=(48, 64)), root / "packed")


@pytest.mark.timeout(300)
def test_missing_extensions_warn_once_per_process_tree(packed):
    proc = _python(f"""
        import sys
        sys.modules["fastload._jpegcrop"] = None
        sys.modules["fastload._resize"] = None
        import numpy as np
        import fastload, fastload.transforms as T
        from fastload.data.resize import resize

        ds = fastload.ImageFolder({str(packed)!r}, T.Compose([T.RandomResizedCrop(24), T.RandomHorizontalFlip()]))
        assert ds.decoder != "turbo-crop"
        for epoch in range(2):
            loader = fastload.DataLoader(ds, 4, num_workers=2, seed=0)
            loader.set_epoch(epoch)
            n = sum(len(y) for _, y in loader)
            loader.close()
        again = fastload.ImageFolder({str(packed)!r}, T.RandomResizedCrop(24))
        resize(np.zeros((40, 40, 3), np.uint8), np.zeros((20, 20, 3), np.uint8))
        print("images", n)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "images 16" in proc.stdout
    err = proc.stderr
    for ext in ("_jpegcrop", "_resize"):
        assert err.count(f"fastload.{ext} (a C extension) was not built") == 1, err
    assert err.count("PerformanceWarning") == 2
    assert err.count("apt-get install gcc libjpeg62-turbo-dev && pip install -e .") == 2


def test_built_extensions_do_not_warn(packed):
    import warnings

    import fastload
    import fastload.transforms as T
    from fastload.codecs import jpegcrop
    from fastload.data import resize

    if not (jpegcrop.available() and resize.available()):
        pytest.skip("the C extensions are not built here")
    with warnings.catch_warnings():
        warnings.simplefilter("error", fastload.PerformanceWarning)
        ds = fastload.ImageFolder(packed, T.RandomResizedCrop(24))
        ds[0]
