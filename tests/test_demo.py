"""``fastload demo`` end to end at a small size: generate, pack, load, train, report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fastload.cli import main
from fastload.storage import open_pack


def test_demo_small_end_to_end(tmp_path, capsys):
    work = tmp_path / "demo"
    assert main(["demo", "--small", "--workdir", str(work), "--workers", "1"]) == 0
    out = capsys.readouterr().out
    for needle in ("loader:", "training:", "data stall", "accuracy:", "packed data:", "throughput summary:"):
        assert needle in out, needle
    summary = json.loads((work / "summary.json").read_text())
    assert summary["loader_images_per_sec"] > 0 and summary["train_images_per_sec"] > 0
    assert 0.0 <= summary["data_stall"] <= 1.0
    assert 0.0 <= summary["val_acc1"] <= 1.0
    assert summary["val_acc1"] > summary["chance_acc1"], "even one small epoch beats chance"
    assert len(summary["epochs"]) == 1 and summary["epochs"][0]["val"]["samples"] == 4 * 8
    tr, va = open_pack(summary["packed"]["train"]), open_pack(summary["packed"]["val"])
    assert (len(tr), len(va)) == (4 * 24, 4 * 8)
    assert tr.payload == "jpeg" and min(int(s) for s in tr.index.shapes[0][:2]) == 40  # pre-resized in the pack

    # A second run with the same sizes reuses the packed data instead of rebuilding it.
    mtime = (work / "packed" / "train").stat().st_mtime_ns
    assert main(["demo", "--small", "--workdir", str(work), "--workers", "1", "--epochs", "1"]) == 0
    assert "reusing the packed sample data" in capsys.readouterr().out
    assert (work / "packed" / "train").stat().st_mtime_ns == mtime


def test_demo_bad_options_give_one_line_errors(tmp_path):
    for args, needle in (
        (["--small", "--batch-size", "1000"], "fewer than one batch"),
        (["--small", "--arch", "no_such_net"], "unknown model"),
        (["--small", "--epochs", "0"], "epochs must be >= 1"),
    ):
        r = subprocess.run([sys.executable, "-m", "fastload", "demo", "--workdir", str(tmp_path / "w"), *args],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 1, (args, r.stderr)
        assert needle in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_demo_with_dali_cpu_pipeline(tmp_path, capsys):
    pytest.importorskip("nvidia.dali")
    work = tmp_path / "demo"
    assert main(["demo", "--small", "--backend", "dali", "--workdir", str(work), "--workers", "1",
                 "--device", "cpu"]) == 0
    assert "loading with DALI" in capsys.readouterr().out
    assert json.loads((work / "summary.json").read_text())["config"]["backend"] == "dali"


@pytest.mark.cuda
def test_demo_on_gpu_uses_prefetcher_and_mixed_precision(tmp_path, capsys):
    work = tmp_path / "demo"
    assert main(["demo", "--small", "--workdir", str(work), "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "CUDAPrefetcher" in out
    assert json.loads((work / "summary.json").read_text())["config"]["precision"] in ("bf16", "fp16")


def test_demo_workdir_that_is_a_file_is_a_one_line_error(tmp_path, capsys):
    f = tmp_path / "not_a_dir"
    f.write_text("x")
    assert main(["demo", "--small", "--workdir", str(f), "--workers", "1"]) == 1
    err = capsys.readouterr().err
    assert "not_a_dir: exists and is not a directory" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert f.read_text() == "x", "the file is left alone"


def test_demo_rebuilds_when_sizes_change_or_a_previous_run_was_cut_short(tmp_path, capsys):
    work = tmp_path / "demo"
    small = ["demo", "--small", "--workdir", str(work), "--workers", "1", "--val-per-class", "2"]
    assert main([*small, "--classes", "2"]) == 0
    assert len(open_pack(work / "packed" / "train")) == 2 * 24
    # Other sizes: the old data is replaced, not mixed in.
    assert main([*small, "--classes", "3"]) == 0
    out = capsys.readouterr().out
    assert "reusing" not in out and "generating 72 + 6 sample JPEGs" in out
    assert len(open_pack(work / "packed" / "train")) == 3 * 24
    assert sorted(p.name for p in (work / "images" / "train").iterdir()) == sorted(open_pack(
        work / "packed" / "train").classes)
    # A run stopped after packing but before recording what it packed is rebuilt, not trusted.
    (work / "data.json").unlink()
    assert main([*small, "--classes", "3"]) == 0
    out = capsys.readouterr().out
    assert "reusing" not in out and "generating" in out
    summary = json.loads((work / "summary.json").read_text())
    assert summary["steady_epochs"] == [0] and 0.0 <= summary["data_stall"] <= 1.0
