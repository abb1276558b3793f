"""The package's public surface: curated exports, cheap import, CLI entry points."""

from __future__ import annotations

import json
import subprocess
import sys

import fastload


def test_all_is_sorted_and_resolvable():
    assert fastload.__all__ == sorted(fastload.__all__)
    assert len(set(fastload.__all__)) == len(fastload.__all__)
    for name in fastload.__all__:
        if name in ("dali",):  # needs the optional DALI wheel; tested in test_dali*
            continue
        assert getattr(fastload, name) is not None, name


def test_import_is_cheap_and_pulls_no_heavy_optional_dependency():
    code = (
        "import sys, json, fastload; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'h5py', 'nvidia', 'jpeg4py', 'simplejpeg', 'lmdb', 'cv2'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_public_submodules_are_listed_and_reachable_lazily():
    import types

    assert set(fastload._SUBMODULES) <= set(fastload.__all__)
    assert {"dali", "gpu", "pack", "train", "transforms"} == set(fastload._SUBMODULES)
    assert isinstance(fastload.gpu, types.ModuleType) and fastload.gpu.__name__ == "fastload.gpu"
    assert "gpu" in dir(fastload)


def test_gpu_submodule_is_reached_without_importing_torch():
    code = (
        "import sys, json, fastload; m = fastload.gpu; "
        "print(json.dumps([m.__name__, sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'nvidia'))]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == ["fastload.gpu", []]


def test_unknown_attribute_raises_attribute_error():
    try:
        fastload.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("expected AttributeError")


def test_python_dash_m_and_version():
    out = subprocess.run([sys.executable, "-m", "fastload", "--version"], capture_output=True, text=True)
    assert out.returncode == 0
    assert out.stdout.strip() == f"fastload {fastload.__version__}"


def test_py_typed_is_shipped():
    from importlib import resources

    assert (resources.files("fastload") / "py.typed").is_file()


def test_help_lists_every_sub_command_in_order():
    from fastload.commands import COMMANDS

    out = subprocess.run([sys.executable, "-m", "fastload", "--help"], capture_output=True, text=True, check=True)
    lines = out.stdout.split("COMMAND\n", 1)[1].splitlines()
    listed = [ln.split()[0] for ln in lines if ln.startswith("    ") and not ln.startswith("     ")]
    assert tuple(listed) == COMMANDS
