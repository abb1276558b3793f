"""DDP under a real ``torchrun --nproc_per_node=2`` with gloo: learns, ranks agree, and
validation counts every image exactly once when the set does not divide over the ranks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from _train_helpers import DIGITS_EPOCHS, DIGITS_NORMALIZATION, pack_digits

HERE = Path(__file__).parent


def _odd_val_pack(src: Path, dest: Path, n: int = 101) -> Path:
    """Pack ``n`` of the validation PNGs under ``src`` (spread over every class) into ``dest``."""
    from fastload.config import PackConfig
    from fastload.pack import pack

    files = sorted(src.rglob("*.png"))
    keep = np.unique(np.linspace(0, len(files) - 1, n).round().astype(int))
    assert len(keep) == n
    for i in keep:
        out = dest.parent / "src_odd" / files[i].parent.name / files[i].name
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(files[i], out)
    pack(dest.parent / "src_odd", dest, config=PackConfig(payload="png", workers=1, progress=False))
    return dest


def _single_process_eval(state, pack: Path) -> dict:
    """The same weights evaluated on the whole pack in this process (no DDP), both ways."""
    from fastload import train
    from fastload.data.dataset import ImageFolder
    from fastload.data.loader import DataLoader
    from fastload.loaders import make_loader
    from fastload.train.models import SmallCNN

    model = SmallCNN(num_classes=10, width=16)
    model.load_state_dict(state)
    trainer = train.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), device="cpu",
                            config=train.TrainConfig(normalization=DIGITS_NORMALIZATION))
    plain = DataLoader(ImageFolder(pack), 16, shuffle=False, num_workers=0, distributed=False)
    made = make_loader(pack, batch_size=16, train=False, crop=32, resize_ratio=1.0, num_workers=0,
                       mean=(0.5,) * 3, std=(0.25,) * 3, distributed=(0, 1), device="cpu")
    return {"loader": trainer.evaluate(plain).as_dict(), "make_loader": trainer.evaluate(made).as_dict()}


@pytest.mark.slow
def test_torchrun_two_processes_learn_digits_with_identical_weights(tmp_path):
    tr, va = pack_digits(tmp_path)
    odd = _odd_val_pack(tmp_path / "src" / "val", tmp_path / "val101")
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(HERE / "ddp_train_digits.py"), str(tr), str(va), str(out), "--batch-size=16", "--accum=2",
           "--checkpoint-blocks=features",  # DDP + no_sync + recomputation in backward, together
           f"--odd-val={odd}"]
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
        assert hist[-1]["val"]["samples"] == 450
    # 674 images per rank = 43 micro-batches of 16, in groups of 2: 22 optimizer steps per epoch
    assert ranks[0]["steps"] == ranks[1]["steps"] == DIGITS_EPOCHS * 22
    # no_sync() on all but the last micro-batch of each group: one gradient all-reduce per step
    assert ranks[0]["synced_backwards"] == ranks[1]["synced_backwards"] == DIGITS_EPOCHS * 22
    # 101 validation images on 2 ranks: rank 1 is padded with a repeat of rank 0's first image,
    # which must not be counted; the result is the single-process evaluation of the same weights.
    single = _single_process_eval(a, odd)
    for way in ("loader", "make_loader"):
        ref = single[way]
        assert ref["samples"] == 101
        for x in ranks:
            got = x["odd_val"][way]
            assert got["samples"] == 101, (way, got)
            assert got["acc1"] == ref["acc1"] and got["acc5"] == ref["acc5"], (way, got, ref)
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), (way, got, ref)
