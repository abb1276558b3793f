"""DDP under a real ``torchrun --nproc_per_node=2`` with gloo: learns, and ranks agree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _train_helpers import DIGITS_EPOCHS, pack_digits

HERE = Path(__file__).parent


@pytest.mark.slow
def test_torchrun_two_processes_learn_digits_with_identical_weights(tmp_path):
    tr, va = pack_digits(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(HERE / "ddp_train_digits.py"), str(tr), str(va), str(out), "--batch-size=16", "--accum=2",
           "--checkpoint-blocks=features"]  # DDP + no_sync + recomputation in backward, together
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ranks = [torch.load(out / f"rank{k}.pt", weights_only=False) for k in (0, 1)]
    assert [x["world_size"] for x in ranks] == [2, 2]
    a, b = ranks[0]["state"], ranks[1]["state"]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].float(), b[k].float()), f"{k} differs between ranks"
    for x in ranks:
        hist = x["history"]
        assert len(hist) == DIGITS_EPOCHS
        assert hist[-1]["val"]["acc1"] >= 0.90, hist[-1]
        assert hist[-1]["train"]["samples"] == 2 * 674  # each rank: half of 1347, padded to 674
        assert hist[-1]["val"]["samples"] == 2 * (450 // 2)
    # 674 images per rank = 43 micro-batches of 16, in groups of 2: 22 optimizer steps per epoch
    assert ranks[0]["steps"] == ranks[1]["steps"] == DIGITS_EPOCHS * 22
    # no_sync() on all but the last micro-batch of each group: one gradient all-reduce per step
    assert ranks[0]["synced_backwards"] == ranks[1]["synced_backwards"] == DIGITS_EPOCHS * 22
