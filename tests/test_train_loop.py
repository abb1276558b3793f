"""The training step: learning, accumulation, resume, AMP, errors (all on the CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fastload import train
from fastload.errors import FormatError
from fastload.gpu.transforms import normalize
from fastload.train.models import SmallCNN

from _train_helpers import DIGITS_EPOCHS, digits_recipe, pack_digits


@pytest.fixture(scope="module")
def digit_packs(tmp_path_factory):
    """(train pack dir, val pack dir): scikit-learn's digits, 32x32 RGB, packed by fastload."""
    return pack_digits(tmp_path_factory.mktemp("digits"))


def _sgd(model, lr=0.05, momentum=0.9):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


def test_small_cnn_learns_packed_digits_through_fastload_loader(digit_packs):
    from fastload.data.dataset import ImageFolder
    from fastload.data.loader import DataLoader

    tr, va = ImageFolder(digit_packs[0]), ImageFolder(digit_packs[1])
    assert tr.classes == [f"digit_{i}" for i in range(10)] and len(va) > 400
    train_loader = DataLoader(tr, 64, shuffle=True, seed=0, num_workers=1)
    val_loader = DataLoader(va, 256, shuffle=False, num_workers=0)
    trainer, hist = digits_recipe(train_loader, val_loader)
    assert [h["epoch"] for h in hist] == list(range(DIGITS_EPOCHS))
    assert hist[-1]["train"]["loss"] < hist[0]["train"]["loss"]
    assert hist[-1]["val"]["acc1"] >= 0.90, hist[-1]
    assert hist[-1]["val"]["samples"] == len(va)
    st = hist[-1]["train"]
    assert st["samples"] == len(tr) and st["steps"] == -(-len(tr) // 64)
    assert 0.0 <= st["data_stall"] <= 1.0 and st["peak_memory_bytes"] > 0
    assert train_loader.epoch == DIGITS_EPOCHS


def _one_epoch_weights(batches, *, accum, seed=0, lr=0.5):
    train.seed_everything(seed)
    model = SmallCNN(num_classes=3, width=4, batch_norm=False)
    trainer = train.Trainer(model, torch.optim.SGD(model.parameters(), lr=lr),
                            config=train.TrainConfig(accum_steps=accum), device="cpu")
    st = trainer.train_epoch(batches)
    return model.state_dict(), st


def test_accumulating_4_micro_batches_equals_one_big_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (32, 3, 12, 12), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 3, (32,), generator=g)
    big, st_big = _one_epoch_weights([(x, y)], accum=1)
    micro, st_micro = _one_epoch_weights([(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)], accum=4)
    assert st_big.steps == st_micro.steps == 1
    for k in big:
        assert torch.allclose(big[k], micro[k], atol=1e-5, rtol=1e-4), k


def test_accumulation_short_last_group_is_averaged_over_its_own_size():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (48, 3, 12, 12), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 3, (48,), generator=g)
    # 6 micro-batches with k=4: one group of 4, then a group of 2 (loss / 2, not / 4).
    ref, st_ref = _one_epoch_weights([(x[:32], y[:32]), (x[32:], y[32:])], accum=1)
    got, st = _one_epoch_weights([(x[i:i + 8], y[i:i + 8]) for i in range(0, 48, 8)], accum=4)
    assert st.steps == st_ref.steps == 2
    for k in ref:
        assert torch.allclose(ref[k], got[k], atol=1e-5, rtol=1e-4), k


def _resume_setup(dataset):
    from fastload.data.loader import DataLoader

    train.seed_everything(0)
    model = SmallCNN(num_classes=10, width=8)
    opt = _sgd(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    cfg = train.TrainConfig(accum_steps=2)
    trainer = train.Trainer(model, opt, config=cfg, device="cpu", scheduler=sched)
    return trainer, DataLoader(dataset, 32, shuffle=True, seed=9, num_workers=1)


@pytest.fixture(scope="module")
def digits_subset(digit_packs):
    """The first 480 training digits (15 batches of 32: a short last accumulation group too)."""
    from fastload.data.dataset import ImageFolder

    ds = ImageFolder(digit_packs[0])
    return _Head(ds, 480)


class _Head:
    """The first ``n`` samples of a fastload dataset (keeps its fixed-shape batch filling)."""

    def __init__(self, ds, n):
        self.ds, self.n = ds, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.ds[i]


def test_mid_epoch_checkpoint_resume_gives_identical_weights(digits_subset, tmp_path):
    full, loader = _resume_setup(digits_subset)
    full.fit(loader, epochs=2)

    first, loader = _resume_setup(digits_subset)
    st = first.train_epoch(loader, max_steps=3)
    assert not st.completed and st.steps == 3 and st.samples == 6 * 32
    ckpt = tmp_path / "mid.pt"
    first.save_checkpoint(ckpt, loader=loader)
    # keep training the first trainer a bit so its in-memory state differs from the file
    first.train_epoch(loader, max_steps=1)

    second, loader2 = _resume_setup(digits_subset)
    second.load_checkpoint(ckpt, loader=loader2)
    assert (second.epoch, second.step) == (0, 3)
    assert loader2.state_dict()["order"]["position"] == 6 * 32
    second.fit(loader2, epochs=2)
    assert second.step == full.step == 2 * 8
    a, b = full.module.state_dict(), second.module.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert second.optimizer.param_groups[0]["lr"] == full.optimizer.param_groups[0]["lr"]


def test_checkpoint_errors(tmp_path):
    model = SmallCNN(num_classes=2, width=4)
    trainer = train.Trainer(model, _sgd(model), device="cpu")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(FormatError, match="bad.pt"):
        trainer.load_checkpoint(bad)
    torch.save({"hello": 1}, tmp_path / "other.pt")
    with pytest.raises(FormatError, match="not a fastload training checkpoint"):
        trainer.load_checkpoint(tmp_path / "other.pt")
    with pytest.raises(FileNotFoundError):
        trainer.load_checkpoint(tmp_path / "missing.pt")
    trainer.save_checkpoint(tmp_path / "small.pt")
    wider = SmallCNN(num_classes=3, width=4)
    with pytest.raises(ValueError, match=r"small\.pt: checkpoint weights do not fit this SmallCNN"):
        train.Trainer(wider, _sgd(wider), device="cpu").load_checkpoint(tmp_path / "small.pt")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_on_cpu_runs_in_low_precision(precision):
    train.seed_everything(0)
    model = SmallCNN(num_classes=4, width=8)
    seen = []
    model.features[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    trainer = train.Trainer(model, _sgd(model), config=train.TrainConfig(precision=precision), device="cpu")
    before = copy.deepcopy(model.state_dict())
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 256, (16, 3, 16, 16), dtype=torch.uint8, generator=g), torch.randint(0, 4, (16,)))
            for _ in range(3)]
    st = trainer.train_epoch(data)
    want = torch.bfloat16 if precision == "bf16" else torch.float16
    assert seen and all(d == want for d in seen)
    assert st.steps == 3 and torch.isfinite(torch.tensor(st.loss))
    assert trainer.scaler.is_enabled() == (precision == "fp16")
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.fc.weight.dtype == torch.float32, "weights stay fp32 under autocast"
    ev = trainer.evaluate(data)
    assert ev.samples == 48 and 0 <= ev.acc1 <= ev.acc5 <= 1


def test_channels_last_and_activation_checkpointing_match_plain_step():
    g = torch.Generator().manual_seed(2)
    data = [(torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8, generator=g), torch.randint(0, 4, (8,)))
            for _ in range(2)]
    out = []
    for cfg in (train.TrainConfig(), train.TrainConfig(channels_last=True, checkpoint_blocks=("features",))):
        train.seed_everything(0)
        model = SmallCNN(num_classes=4, width=8)
        train.Trainer(model, _sgd(model), config=cfg, device="cpu").train_epoch(data)
        out.append(model.state_dict())
    for k in out[0]:
        assert torch.allclose(out[0][k], out[1][k], atol=1e-4, rtol=1e-3), k


def test_too_few_batches_for_accumulation_is_a_clear_error():
    model = SmallCNN(num_classes=2, width=4)
    trainer = train.Trainer(model, _sgd(model), config=train.TrainConfig(accum_steps=4), device="cpu")
    data = [(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64))] * 3
    with pytest.raises(ValueError, match="3 batches .* fewer than accum_steps=4"):
        trainer.train_epoch(data)


def test_batch_must_be_images_and_targets():
    model = SmallCNN(num_classes=2, width=4)
    trainer = train.Trainer(model, _sgd(model), device="cpu")
    with pytest.raises(ValueError, match=r"\(images, targets\)"):
        trainer.train_epoch([torch.zeros(2, 3, 8, 8)])


def test_sync_batchnorm_needs_cuda_under_ddp():
    model = SmallCNN(num_classes=2, width=4)
    info = train.DistInfo(rank=0, world_size=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="sync_batchnorm needs CUDA"):
        train.Trainer(model, _sgd(model), dist=info, config=train.TrainConfig(sync_batchnorm=True))


@pytest.mark.cuda
def test_cuda_fp16_step_with_grad_scaler_and_channels_last():
    train.seed_everything(0)
    model = SmallCNN(num_classes=4, width=8)
    cfg = train.TrainConfig(precision="fp16", channels_last=True)
    trainer = train.Trainer(model, _sgd(model), config=cfg, device="cuda")
    data = [(torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8), torch.randint(0, 4, (16,)))
            for _ in range(4)]
    st = trainer.train_epoch(data)
    assert st.steps == 4 and torch.isfinite(torch.tensor(st.loss))
    assert trainer.scaler.is_enabled() and st.peak_memory_bytes > 0
    assert torch.backends.cudnn.benchmark


@pytest.mark.slow
def test_torch_compile_step_matches_eager_and_checkpoints_plain_names(tmp_path):
    g = torch.Generator().manual_seed(3)
    data = [(torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8, generator=g), torch.randint(0, 4, (8,)))
            for _ in range(3)]
    states = []
    for compiled in (False, True):
        train.seed_everything(0)
        model = SmallCNN(num_classes=4, width=8)
        trainer = train.Trainer(model, _sgd(model), config=train.TrainConfig(compile=compiled), device="cpu")
        trainer.train_epoch(data)
        states.append(trainer.module.state_dict())
        if compiled:
            trainer.save_checkpoint(tmp_path / "c.pt")
            saved = torch.load(tmp_path / "c.pt", weights_only=False)["model"]
            assert list(saved) == list(states[0]), "no _orig_mod. prefixes in checkpoints"
    for k in states[0]:
        assert torch.allclose(states[0][k], states[1][k], atol=1e-4, rtol=1e-3), k


class _DropoutNet(nn.Module):
    """A BN-free net whose training step draws from torch's RNG (dropout)."""

    def __init__(self):
        super().__init__()
        self.body = SmallCNN(num_classes=4, width=4, batch_norm=False)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.body(x))


def _dropout_trainer():
    train.seed_everything(0)
    model = _DropoutNet()
    return train.Trainer(model, _sgd(model, lr=0.1), device="cpu")


def test_resume_restores_torch_rng_so_dropout_masks_repeat(tmp_path):
    g = torch.Generator().manual_seed(5)
    data = [(torch.randint(0, 256, (8, 3, 12, 12), dtype=torch.uint8, generator=g), torch.randint(0, 4, (8,)))
            for _ in range(4)]
    full = _dropout_trainer()
    full.train_epoch(data)
    full.train_epoch(data)

    first = _dropout_trainer()
    first.train_epoch(data)
    first.save_checkpoint(tmp_path / "e1.pt")
    torch.rand(1000)  # move the global RNG on: only the checkpoint's RNG state may count
    second = _dropout_trainer()
    torch.rand(1000)
    second.load_checkpoint(tmp_path / "e1.pt")
    second.train_epoch(data)
    assert second.epoch == full.epoch == 2
    for k, v in full.module.state_dict().items():
        assert torch.equal(v, second.module.state_dict()[k]), k

    # Without the RNG state the dropout masks differ, and so do the weights: the check above can fail.
    state = torch.load(tmp_path / "e1.pt", weights_only=False)
    third = _dropout_trainer()
    third.module.load_state_dict(state["model"])
    third.optimizer.load_state_dict(state["optimizer"])
    third.epoch = 1
    third.train_epoch(data)
    assert any(not torch.equal(v, third.module.state_dict()[k]) for k, v in full.module.state_dict().items())


def test_log_interval_reads_the_loss_every_n_steps_on_rank_0_only():
    data = [(torch.zeros(4, 3, 8, 8, dtype=torch.uint8), torch.zeros(4, dtype=torch.int64))] * 6
    lines: list[str] = []
    model = SmallCNN(num_classes=2, width=4)
    trainer = train.Trainer(model, _sgd(model), config=train.TrainConfig(log_interval=2), device="cpu",
                            log=lines.append)
    trainer.train_epoch(data)
    assert [ln.split(":")[0] for ln in lines] == ["epoch 0 step 2", "epoch 0 step 4", "epoch 0 step 6"]
    assert all("loss" in ln and "img/s" in ln for ln in lines)
    other: list[str] = []
    rank1 = train.DistInfo(rank=1, world_size=1, device=torch.device("cpu"))
    train.Trainer(model, _sgd(model), config=train.TrainConfig(log_interval=1), dist=rank1,
                  log=other.append).train_epoch(data)
    assert other == []


def test_distributed_dist_info_without_a_process_group_is_a_clear_error():
    model = SmallCNN(num_classes=2, width=4)
    info = train.DistInfo(rank=0, world_size=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="no process group is initialised.*init_distributed"):
        train.Trainer(model, _sgd(model), dist=info)


@pytest.mark.cuda
def test_cuda_step_keeps_pinned_ring_batches_alive_until_their_copies_ran(digit_packs):
    """fastload's DataLoader reuses a pinned ring slot once its batch is dropped; the step's
    non_blocking copy may not have run by then. Slow the stream down so the host runs far
    ahead, and check every batch the model saw is the batch the loader produced."""
    from fastload.data.dataset import ImageFolder
    from fastload.data.loader import DataLoader

    loader = DataLoader(ImageFolder(digit_packs[1]), 32, shuffle=False, num_workers=0, pin_memory=True)
    expected = [x.clone() for x, _ in loader]
    model = SmallCNN(num_classes=10, width=4)
    seen = []

    def record(module, args):
        torch.cuda._sleep(20_000_000)  # keep the GPU busy: copies lag steps behind the host
        seen.append(args[0].detach().clone())

    model.register_forward_pre_hook(record)
    trainer = train.Trainer(model, _sgd(model), device="cuda")
    trainer.train_epoch(loader)
    assert len(seen) == len(expected)
    for i, (got, want) in enumerate(zip(seen, expected)):
        want = normalize(want.cuda(), normalization=trainer.config.normalization)
        assert torch.equal(got, want), f"batch {i} was overwritten before its copy ran"


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_epoch_synchronises_the_host_only_once(precision):
    """The loss is read once per epoch (log_interval=0); nothing else in the step syncs."""
    import warnings

    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8, generator=g).pin_memory(),
             torch.randint(0, 4, (16,)).pin_memory()) for _ in range(6)]
    model = SmallCNN(num_classes=4, width=8)
    trainer = train.Trainer(model, _sgd(model), config=train.TrainConfig(precision=precision, accum_steps=2),
                            device="cuda")
    trainer.train_epoch(data[:2])  # warm-up: cuDNN autotuning, allocator
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train_epoch(data)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, syncs


def test_evaluate_is_eval_mode_without_grad_and_leaves_bn_statistics_alone():
    train.seed_everything(0)
    model = SmallCNN(num_classes=4, width=8)
    trainer = train.Trainer(model, _sgd(model), device="cpu")
    g = torch.Generator().manual_seed(4)
    data = [(torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8, generator=g), torch.randint(0, 4, (8,)))
            for _ in range(3)]
    trainer.train_epoch(data)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    grad_on = []
    model.fc.register_forward_hook(lambda m, i, o: grad_on.append((m.training, o.requires_grad)))
    ev = trainer.evaluate(data)
    assert grad_on == [(False, False)] * 3
    assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers()), "eval must use running statistics"
    assert model.training, "evaluate restores training mode"
    with torch.no_grad():
        model.eval()
        logits = torch.cat([model(normalize(x, normalization=trainer.config.normalization)) for x, _ in data])
        model.train()
    labels = torch.cat([y for _, y in data])
    assert ev.acc1 == pytest.approx((logits.argmax(1) == labels).float().mean().item())
    assert ev.loss == pytest.approx(nn.functional.cross_entropy(logits, labels).item(), rel=1e-5)


def test_checkpoint_restores_the_grad_scaler(tmp_path):
    g = torch.Generator().manual_seed(6)
    data = [(torch.randint(0, 256, (8, 3, 12, 12), dtype=torch.uint8, generator=g), torch.randint(0, 4, (8,)))
            for _ in range(3)]
    cfg = train.TrainConfig(precision="fp16")
    model = SmallCNN(num_classes=4, width=4)
    trainer = train.Trainer(model, _sgd(model), config=cfg, device="cpu")
    trainer.train_epoch(data)
    trainer.scaler.update(new_scale=1024.0)  # not the default 65536: a reload must bring it back
    trainer.save_checkpoint(tmp_path / "fp16.pt")
    fresh_model = SmallCNN(num_classes=4, width=4)
    fresh = train.Trainer(fresh_model, _sgd(fresh_model), config=cfg, device="cpu")
    assert fresh.scaler.get_scale() != trainer.scaler.get_scale()
    fresh.load_checkpoint(tmp_path / "fp16.pt")
    assert fresh.scaler.get_scale() == trainer.scaler.get_scale()
    assert fresh.scaler.state_dict() == trainer.scaler.state_dict()


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_grad_clip_bounds_the_true_gradient_norm_also_under_loss_scaling(precision):
    """SGD(lr=1, no momentum) moves the weights by exactly the clipped gradient. Under fp16 the
    scaler must unscale before clipping, or the step would be clip / scale long."""
    g = torch.Generator().manual_seed(8)
    data = [(torch.randint(0, 256, (8, 3, 12, 12), dtype=torch.uint8, generator=g), torch.randint(0, 4, (8,)))]
    train.seed_everything(0)
    model = SmallCNN(num_classes=4, width=4, batch_norm=False)
    clip = 1e-3
    trainer = train.Trainer(model, torch.optim.SGD(model.parameters(), lr=1.0),
                            config=train.TrainConfig(precision=precision, grad_clip=clip), device="cpu")
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=256.0, enabled=precision == "fp16")  # no overflow
    before = [p.detach().clone() for p in model.parameters()]
    assert trainer.train_epoch(data).steps == 1
    moved = torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(model.parameters(), before)))
    assert moved.item() == pytest.approx(clip, rel=1e-2)
