"""tools/train.py on digits packed by fastload: trains, checkpoints, resumes, fails cleanly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastload.data.order import find_order_state

from _train_helpers import pack_digits

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "train.py"
FAST = ["--arch", "small_cnn", "--batch-size", "64", "--lr", "0.2", "--crop", "32", "--min-scale", "0.7",
        "--workers", "1", "--warmup-epochs", "0.5"]


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("digits")
    pack_digits(root)
    return root


def _run(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_train_script_trains_checkpoints_and_resumes(digits_dir, tmp_path):
    ckpt = tmp_path / "ck.pt"
    r = _run(digits_dir, *FAST, "--epochs", "2", "--checkpoint", ckpt, "--accum", "2", "--amp", "bf16")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("epoch ")]
    assert [ln.split(":")[0] for ln in lines] == ["epoch 0", "epoch 1"]
    for ln in lines:
        assert re.search(r"train loss [\d.]+ .* img/s .*data stall \d+% .*Acc@1 [\d.]+%", ln), ln
    assert "= 128 per step" in r.stdout
    state = torch.load(ckpt, weights_only=False)
    assert state["epoch"] == 2 and find_order_state(state["loader"])["epoch"] == 2 and len(state["history"]) == 2

    r2 = _run(digits_dir, *FAST, "--epochs", "3", "--checkpoint", ckpt, "--accum", "2", "--amp", "bf16",
              "--resume", ckpt)
    assert r2.returncode == 0, r2.stderr
    assert "resumed from" in r2.stdout
    assert [ln.split(":")[0] for ln in r2.stdout.splitlines() if ln.startswith("epoch ")] == ["epoch 2"]
    acc = float(re.search(r"Acc@1 ([\d.]+)%", r2.stdout.split("epoch 2:")[1]).group(1))
    assert acc > 50.0, r2.stdout  # 3 short epochs on digits: far above the 10% of chance

    r3 = _run(digits_dir, *FAST, "--resume", ckpt, "--evaluate")
    assert r3.returncode == 0 and re.search(r"val: loss [\d.]+\s+Acc@1", r3.stdout), r3.stderr


@pytest.mark.parametrize("args, needle", [
    (["{missing}"], "missing; DIR must hold train/ and val/"),
    (["{data}", "--arch", "nope"], "unknown model 'nope'"),
    (["{data}", "--batch-size", "1000", "--accum", "4"], "one optimizer step needs"),
    (["{data}", "--resume", "{missing}/ck.pt"], "no such checkpoint file"),
])
def test_train_script_errors_are_one_line(digits_dir, tmp_path, args, needle):
    args = [a.format(data=digits_dir, missing=tmp_path / "nothing") for a in args]
    r = _run(*args, "--workers", "0", "--epochs", "1")
    assert r.returncode == 1
    assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
def test_train_script_under_torchrun_two_processes(digits_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ckpt = tmp_path / "ck.pt"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(SCRIPT), str(digits_dir), *FAST, "--batch-size", "32", "--epochs", "2", "--checkpoint",
                        str(ckpt)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "2 processes on cpu" in r.stdout and "= 64 per step" in r.stdout
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("epoch ")]
    assert len(lines) == 2, "only rank 0 prints"
    assert torch.load(ckpt, weights_only=False)["world_size"] == 2
