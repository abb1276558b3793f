"""What a newcomer hits first (issue 15): CLI messages, sizes in HxW, the main-guard check,
``targets`` as a list, bench output in a log, and tests that do not depend on how they start."""

from __future__ import annotations

import re
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from _data_helpers import make_pack
from _pack_helpers import REPO, cli_env, make_jpeg_tree, run_cli, save

TRACEBACK = "Traceback"


def _one_line(proc: subprocess.CompletedProcess, code: int) -> str:
    """The one stderr line of a refused command (exit ``code``, no traceback, nothing on stdout)."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert TRACEBACK not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("misc")
    return make_pack(make_jpeg_tree(root / "src", classes=3, per_class=5, hw=(40, 56)), root / "packed")


# -- 1. signal tests pass however pytest is started --------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_signal_tests_pass_when_sigint_is_ignored(tmp_path):
    """`nohup pytest ... &` starts pytest with SIGINT ignored; the Ctrl-C tests set up their own."""
    tests = ["tests/test_cli_pack.py::test_ctrl_c_cleans_up_and_rerun_resumes",
             "tests/test_loader.py::test_keyboard_interrupt_stops_workers"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "t"), *tests],
        cwd=REPO, capture_output=True, text=True, env=cli_env(), timeout=850,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout


# -- 6. typos and bad values point to the sub-command's help -----------------------------


def test_unknown_option_names_the_subcommand_help_and_the_closest_option(tmp_path):
    line = _one_line(run_cli("pack", tmp_path / "src", tmp_path / "dest", "--fromat", "hdf5"), 2)
    assert line.startswith("fastload pack: error: unrecognized arguments: --fromat hdf5")
    assert "did you mean --format?" in line and line.endswith("(see fastload pack --help)")
    line = _one_line(run_cli("inspect", tmp_path, "--jsn"), 2)
    assert "did you mean --json?" in line and "(see fastload inspect --help)" in line


def test_unknown_option_without_a_close_one_still_points_to_the_subcommand(tmp_path):
    line = _one_line(run_cli("verify", tmp_path, "--zzzzzz"), 2)
    assert "did you mean" not in line and line.endswith("(see fastload verify --help)")


def test_bad_value_names_the_closest_choice():
    line = _one_line(run_cli("pack", "a", "b", "--format", "hdf"), 2)
    assert "invalid choice: 'hdf'" in line and "did you mean hdf5?" in line
    assert line.endswith("(see fastload pack --help)")
    line = _one_line(run_cli("pakc", "a", "b"), 2)
    assert "did you mean pack?" in line and line.endswith("(see fastload --help)")


# -- 10. unsupported URL schemes ---------------------------------------------------------


@pytest.mark.parametrize("url", ["ftp://host/data", "hdfs://namenode/data"])
@pytest.mark.parametrize("command", ["pack", "inspect", "verify", "bench"])
def test_unsupported_url_scheme_is_one_line_and_creates_nothing(tmp_path, packed, url, command):
    args = [command, packed, url] if command == "pack" else [command, url]
    line = _one_line(run_cli(*args, cwd=tmp_path), 2)
    scheme = url.split(":")[0]
    assert f"does not support {scheme}:// URLs" in line and "s3://" in line
    assert line.endswith(f"(see fastload {command} --help)")
    assert list(tmp_path.iterdir()) == []  # no local folder named "ftp:" or "hdfs:"


def test_supported_urls_and_paths_pass_the_parser():
    from fastload.commands import location

    for text in ("s3://b/x", "gs://b/x", "az://c/x", "file:///tmp/x", "relative/dir", "/abs/dir", "C:x"):
        assert location(text) == text


# -- 9. verify on an interrupted pack ----------------------------------------------------


def test_verify_of_an_interrupted_pack_says_rerun_to_resume(tmp_path):
    """A real interrupted pack: the shard holding a huge image hits the file-size limit."""
    src = make_jpeg_tree(tmp_path / "src", classes=1, per_class=12)
    noise = np.random.default_rng(1).integers(0, 256, (420, 420, 3), dtype=np.uint8)
    save(Image.fromarray(noise), src / "c1" / "huge.png")
    dest = tmp_path / "dest"

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))

    proc = subprocess.run([sys.executable, "-m", "fastload", "pack", str(src), str(dest), "--payload", "png",
                           "--shard-size", "4K", "--workers", "1"], capture_output=True, text=True,
                          env=cli_env(), preexec_fn=limit, timeout=120)
    assert proc.returncode == 1 and not (dest / "manifest.json").exists()
    line = _one_line(run_cli("verify", dest), 1)
    assert line.startswith("fastload verify: error:") and str(dest) in line
    assert "rerun the same `fastload pack` command to resume" in line
    assert "rerun the same `fastload pack` command to resume" in _one_line(run_cli("inspect", dest), 1)


# -- 10. bench output in a log ------------------------------------------------------------


def test_bench_writes_no_carriage_returns_when_redirected(packed):
    proc = run_cli("bench", packed, "--workers", "0", "--batch-sizes", "4", "--batches", "1", "--warmup", "0",
                   "--seconds", "0", "--crop", "16")
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stdout and "\r" not in proc.stderr
    assert "recommended: num_workers=0" in proc.stdout


# -- 4. sizes are HxW everywhere ----------------------------------------------------------


def _shapes(root: Path) -> list[tuple[int, int]]:
    return [Image.open(p).size[::-1] for p in sorted(root.rglob("*.jpg"))]  # PIL says (w, h)


def test_demo_image_size_is_height_by_width(tmp_path):
    from fastload.cli import build_parser
    from fastload.sample import make_image_folder
    from fastload.train.demo import DemoConfig, with_overrides

    args = build_parser().parse_args(["demo", "--image-size", "48x72", "--small"])
    assert args.image_size == (48, 72)
    cfg = with_overrides(DemoConfig.small(), image_size=args.image_size)
    make_image_folder(tmp_path, num_classes=2, per_class=12, size=cfg.image_size, workers=1)
    shapes = _shapes(tmp_path)
    assert shapes.count((48, 72)) > len(shapes) / 2  # landscape, as asked
    assert set(shapes) <= {(48, 72), (72, 48)}  # one in four is its portrait twin


def test_demo_image_size_help_and_errors_say_hxw():
    out = run_cli("demo", "--help").stdout
    assert "HxW" in out and "WxH" not in out
    line = _one_line(run_cli("demo", "--image-size", "48by72"), 2)
    assert "expected HxW" in line and "(see fastload demo --help)" in line


def test_make_sample_size_is_height_by_width(tmp_path):
    out = tmp_path / "tree"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "make_sample.py"), str(out), "--classes", "2",
                           "--per-class", "12", "--size", "40x64", "--workers", "1"],
                          capture_output=True, text=True, env=cli_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    shapes = _shapes(out)
    assert shapes.count((40, 64)) > len(shapes) / 2 and set(shapes) <= {(40, 64), (64, 40)}
    help_text = subprocess.run([sys.executable, str(REPO / "tools" / "make_sample.py"), "--help"],
                               capture_output=True, text=True, env=cli_env(), timeout=60).stdout
    assert "HxW" in help_text
    bad = subprocess.run([sys.executable, str(REPO / "tools" / "make_sample.py"), str(out), "--size", "40"],
                         capture_output=True, text=True, env=cli_env(), timeout=60)
    assert bad.returncode == 2 and TRACEBACK not in bad.stderr and "expected HxW" in bad.stderr


def test_every_size_option_in_the_cli_help_says_hxw():
    for command in ("pack", "demo"):
        out = run_cli(command, "--help").stdout
        assert "HxW" in out and "WxH" not in out, command


# -- 10. ImageFolder.targets acts as torchvision's list ----------------------------------


def test_targets_is_list_compatible(packed):
    from fastload import ImageFolder

    ds = ImageFolder(packed)
    t = ds.targets
    ref = [int(v) for v in np.asarray(t)]
    assert ref == [0] * 5 + [1] * 5 + [2] * 5
    assert t == ref and list(t) == ref and len(t) == 15
    assert all(type(v) is int for v in t) and type(t[3]) is int and t[-1] == 2
    assert t[2:7] == ref[2:7] and isinstance(t[2:7], list)
    assert t.count(1) == ref.count(1) == 5 and t.count(7) == 0
    assert t.index(2) == ref.index(2) and t.index(1, 7) == ref.index(1, 7) and t.index(2, -3) == ref.index(2, -3)
    with pytest.raises(ValueError):
        t.index(9)
    assert 2 in t and 9 not in t
    assert t + [9] == ref + [9] and [9] + t == [9] + ref and t + t == ref + ref
    assert t.tolist() == ref and sorted(t) == sorted(ref)
    arr = np.asarray(t)
    assert arr.dtype == np.int64 and np.shares_memory(arr, np.asarray(ds.targets))  # no copy
    assert list(ds.samples)[4][1] == ref[4]
    import collections

    assert collections.Counter(t) == collections.Counter(ref)


# -- 10. small things ---------------------------------------------------------------------


def test_demo_workdir_is_ignored_by_git():
    proc = subprocess.run(["git", "check-ignore", "-q", "fastload-demo/summary.json"], cwd=REPO, timeout=30)
    assert proc.returncode == 0


def test_train_script_help_shows_defaults():
    out = subprocess.run([sys.executable, str(REPO / "tools" / "train.py"), "--help"], capture_output=True,
                         text=True, env=cli_env(), timeout=120).stdout
    flat = " ".join(out.split("options:", 1)[1].split())  # the option list, not the usage line
    for option, default in [("--epochs EPOCHS", "90"), ("--lr LR", "0.1"), ("--momentum MOMENTUM", "0.9"),
                            ("--crop CROP", "224"), ("--seed SEED", "0"), ("--amp {off,bf16,fp16}", "off")]:
        start = flat.index(option)
        assert f"(default: {default})" in flat[start:start + 200], option
    assert "(default: None)" not in flat and "(default: False)" not in flat


def test_readme_names_only_files_in_the_repository():
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)\)", text)
    for link in links:
        if "://" in link:
            continue
        assert (REPO / link).resolve().is_relative_to(REPO.resolve()), link
        assert (REPO / link).exists(), link
    for path in re.findall(r"`((?:benchmarks|tools|tests|fastload)/[\w./-]+\.\w+)`", text):
        assert (REPO / path).exists(), path


# -- 7. spawned workers and scripts without `if __name__ == "__main__":` ------------------


def _script(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train_script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=cli_env(),
                          cwd=tmp_path, timeout=300)


def _guard_error(proc: subprocess.CompletedProcess, script_line: int) -> str:
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    last = proc.stderr.strip().splitlines()[-1]
    assert f"train_script.py:{script_line}:" in last
    assert 'under `if __name__ == "__main__":`' in last
    assert proc.stdout.count("body ran") == 1  # the script body ran once: no worker started
    return last


@pytest.mark.timeout(300)
def test_dali_loader_in_a_script_without_main_guard_says_what_to_add(tmp_path, packed):
    pytest.importorskip("nvidia.dali")
    proc = _script(tmp_path, f"""\
        print("body ran", flush=True)
        from fastload.dali import DALILoader
        loader = DALILoader({str(packed)!r}, 4, device="cpu", crop=16)
        for images, targets in loader:
            pass
    """)
    assert "DALILoader starts its workers with spawn" in _guard_error(proc, 3)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dali_loader_in_a_script_with_main_guard_runs(tmp_path, packed):
    pytest.importorskip("nvidia.dali")
    proc = _script(tmp_path, f"""\
        print("body ran", flush=True)
        from fastload.dali import DALILoader

        def main():
            loader = DALILoader({str(packed)!r}, 4, device="cpu", crop=16, py_num_workers=1)
            print("batches", sum(1 for _ in loader), flush=True)

        if __name__ == "__main__":
            main()
    """)
    assert proc.returncode == 0, proc.stderr
    assert "batches 4" in proc.stdout


@pytest.mark.timeout(300)
def test_spawned_cpu_loader_without_main_guard_says_what_to_add_and_leaves_no_shm_copy(tmp_path, packed):
    from fastload.data.dataset import _shm_name

    proc = _script(tmp_path, f"""\
        print("body ran", flush=True)
        import fastload, fastload.transforms as T
        ds = fastload.ImageFolder({str(packed)!r}, T.RandomResizedCrop(16), in_memory=True)
        loader = fastload.DataLoader(ds, 4, num_workers=2, multiprocessing_context="spawn")
        for images, targets in loader:
            pass
    """)
    assert "DataLoader starts its workers with spawn" in _guard_error(proc, 4)
    assert not _shm_name(packed).exists()


def test_guard_check_accepts_the_guarded_line_and_refuses_the_else_branch(tmp_path):
    from fastload.checks import _outside_main_guard

    src = tmp_path / "s.py"
    src.write_text(textwrap.dedent("""\
        import os
        x = 1
        if __name__ == "__main__":
            run()
        else:
            run()
        if "__main__" == __name__:
            run()
    """))
    assert _outside_main_guard(str(src), 2)
    assert not _outside_main_guard(str(src), 4)
    assert _outside_main_guard(str(src), 6)
    assert not _outside_main_guard(str(src), 8)
    assert not _outside_main_guard(str(tmp_path / "missing.py"), 1)  # cannot tell: never refuse


# -- 3. tools/install.sh says what it installs, one line per step in a log ---------------

_FAKE_PIP = """#!/bin/bash
# python3, except that `-m pip` prints what a real install prints (nothing is installed)
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "pip $*" >> "$PIP_CALLS"
  echo "Obtaining file://$PWD"
  echo "Requirement already satisfied: numpy in /site-packages (2.4.6)"
  echo "Collecting nvidia-dali-cuda120"
  echo "  Downloading nvidia_dali_cuda120-1.50-py3-none-manylinux2014_x86_64.whl (612.3 MB)"
  echo "Building wheels for collected packages: fastload"
  echo "  Building wheel for fastload (pyproject.toml): finished with status 'done'"
  echo "Installing collected packages: nvidia-dali-cuda120, fastload"
  echo "Successfully installed fastload-0.1.0 nvidia-dali-cuda120-1.50"
  if [ -n "$PIP_FAILS" ]; then echo "ERROR: No matching distribution found for nvidia-dali-cuda120" >&2; exit 1; fi
  exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


def _install_sh(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    import shutil

    if not (shutil.which("cc") and Path("/usr/include/jpeglib.h").exists()
            and "libturbojpeg" in subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout):
        pytest.skip("install.sh would apt-get system packages here")  # never let a test install them
    fake = tmp_path / "python"
    fake.write_text(_FAKE_PIP)
    fake.chmod(0o755)
    run_env = {**cli_env(), "PYTHON": str(fake), "REAL_PYTHON": sys.executable, "PIP_CALLS": str(tmp_path / "calls"),
               **env}
    return subprocess.run(["bash", str(REPO / "tools" / "install.sh")], capture_output=True, text=True,
                          env=run_env, stdin=subprocess.DEVNULL, timeout=300)


@pytest.mark.slow
def test_install_sh_in_a_log_says_what_and_how_long_one_line_per_step(tmp_path):
    proc = _install_sh(tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert all(line.startswith("[install]") for line in out), out
    pip_line = next(line for line in out if "pip install -e .[dali,remote]" in line)
    assert "DALI" in pip_line and "min" in pip_line  # what, and roughly how long
    assert any("Downloading nvidia_dali" in line and "612.3 MB" in line for line in out)
    assert any("Successfully installed" in line for line in out)
    assert "Requirement already satisfied" not in proc.stdout and "Collecting" not in proc.stdout
    assert "\r" not in proc.stdout  # no progress bars in a log
    assert out[-1].startswith("[install] done in") and "fastload info" in out[-1]
    assert "--progress-bar off" in (tmp_path / "calls").read_text()


def test_install_sh_shows_pips_last_lines_when_it_fails(tmp_path):
    proc = _install_sh(tmp_path, PIP_FAILS="1")
    assert proc.returncode == 1
    assert "[install] pip failed (exit 1); its last lines:" in proc.stderr
    assert "ERROR: No matching distribution found for nvidia-dali-cuda120" in proc.stderr
    assert "done in" not in proc.stdout
