"""The training step and loop: every well-known speed and memory technique, each switchable.

:class:`Trainer` is deliberately small and readable, not a framework. It takes a model, an
optimizer and a :class:`TrainConfig`, and trains on any iterable of ``(images, targets)``
batches (uint8 NCHW from ``fastload.DataLoader``, or float tensors already normalised on the
GPU by ``CUDAPrefetcher``/DALI). A loader's optional ``set_epoch``, ``state_dict`` and
``load_state_dict`` are used for shuffling per epoch and exact mid-epoch resume.

What it does, in the order a step runs:

* batches go to the device ``non_blocking``; uint8 images are converted and normalised there
  (4x fewer bytes over PCIe than float), optionally in channels_last layout;
* ``torch.autocast`` in bf16 or fp16, with a ``GradScaler`` for fp16;
* gradient accumulation over k micro-batches: DDP's ``no_sync()`` on all but the last, and
  each loss divided by the number of micro-batches in its group;
* ``zero_grad(set_to_none=True)``; optional gradient clipping (after unscaling);
* no host synchronisation in the hot loop: the loss is summed on the device and read with
  ``.item()`` only every ``log_interval`` optimizer steps and at the end of an epoch (the one
  exception is fp16: ``GradScaler.step`` must read its inf/NaN flag to decide whether to step);
* a pinned host batch copied with ``non_blocking`` is kept alive until its copy has run
  (fastload's DataLoader hands out views of page-locked ring slots that it reuses as soon as
  they are dropped), checked with CUDA events, never by waiting;
* host time is split into *waiting for data* and everything else; their ratio is the data-
  stall fraction (on a GPU the host runs ahead of the kernels, so time the GPU makes the
  host wait shows up as compute, which is what we want: the stall is time the data path
  made everything else wait).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint as _checkpoint

from ..data.plan import EpochPlan
from ..errors import FormatError
from ..gpu.pinning import HostHold
from ..gpu.transforms import apply_scale_shift
from ..normalization import IMAGENET, Normalization, as_normalization, scale_shift
from .distributed import DistInfo, all_reduce_sum, barrier
from .utils import load_checkpoint_file, peak_memory_bytes, plain_state, reset_peak_memory

__all__ = [
    "EpochStats",
    "EvalStats",
    "Precision",
    "TrainConfig",
    "Trainer",
    "check_batch_geometry",
]

CHECKPOINT_FORMAT = "fastload-train-checkpoint"
CHECKPOINT_VERSION = 1


class Precision(str, enum.Enum):
    """Arithmetic of the forward pass. bf16 needs no loss scaling; fp16 does (GradScaler)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def dtype(self) -> torch.dtype | None:
        return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[self.value]


@dataclass(frozen=True)
class TrainConfig:
    """Switches of the training step. The defaults are the safe, plain fp32 step."""

    precision: Precision = Precision.FP32
    accum_steps: int = 1  # micro-batches per optimizer step
    channels_last: bool = False  # NHWC memory layout for model and inputs (faster convs on tensor cores)
    compile: bool = False  # torch.compile the model
    sync_batchnorm: bool = False  # BatchNorm statistics over all ranks (CUDA + DDP only)
    checkpoint_blocks: tuple[str, ...] = ()  # submodule names whose activations are recomputed in backward
    cudnn_benchmark: bool = True  # let cuDNN pick the fastest kernels for fixed input shapes
    grad_clip: float | None = None  # max gradient norm, None = no clipping
    log_interval: int = 0  # optimizer steps between progress lines (and host syncs); 0 = per epoch only
    # uint8 inputs become (x / 255 - mean) / std, in 0-1 units (None: x / 255 only); float inputs
    # are taken as already normalised (CUDAPrefetcher, DALI)
    normalization: Normalization | None = IMAGENET

    def __post_init__(self):
        object.__setattr__(self, "precision", Precision(self.precision))
        object.__setattr__(self, "checkpoint_blocks", tuple(self.checkpoint_blocks))
        if self.accum_steps < 1:
            raise ValueError(f"accum_steps must be >= 1, got {self.accum_steps}")
        if self.log_interval < 0:
            raise ValueError(f"log_interval must be >= 0, got {self.log_interval}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0 or None, got {self.grad_clip}")
        object.__setattr__(self, "normalization", as_normalization(self.normalization))


@dataclass(frozen=True)
class EpochStats:
    """What one (possibly partial) pass over the training loader did and how fast."""

    epoch: int
    steps: int  # optimizer steps
    samples: int  # images seen by all ranks (per-rank count x world size)
    loss: float  # mean training loss over the micro-batches
    seconds: float
    data_seconds: float  # host time spent waiting for the next batch
    peak_memory_bytes: int
    completed: bool  # False if stopped early (max_steps) mid-epoch
    replaced: int = 0  # corrupt records replaced by substitutes on this rank (loader on_error="skip")

    @property
    def images_per_sec(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def data_stall(self) -> float:
        """Fraction of the wall time the step waited for data (0 = never, 1 = always)."""
        return self.data_seconds / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "images_per_sec": self.images_per_sec, "data_stall": self.data_stall}


@dataclass(frozen=True)
class EvalStats:
    loss: float
    acc1: float  # top-1 accuracy in [0, 1]
    acc5: float  # top-5 accuracy (equals 1.0 with 5 or fewer classes)
    samples: int  # distinct images evaluated on all ranks (padding repeats are not counted)
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_batch_geometry(num_samples: int, *, batch_size: int, world_size: int = 1, accum_steps: int = 1,
                         drop_last: bool = False) -> int:
    """Micro-batches each rank sees per epoch (the loaders' own count: :class:`EpochPlan`);
    a clear ValueError if that cannot train.

    One optimizer step consumes ``accum_steps`` micro-batches on each of ``world_size`` ranks;
    a dataset too small for that would never step, and ``drop_last`` could drop it all.
    """
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be >= 1, got {accum_steps}")
    plan = EpochPlan(num_samples, batch_size=batch_size, world_size=world_size, drop_last=drop_last)
    per_step = batch_size * world_size * accum_steps
    if num_samples < per_step or plan.num_batches() < accum_steps:
        raise ValueError(
            f"one optimizer step needs batch_size {batch_size} x world size {world_size} x accumulation "
            f"{accum_steps} = {per_step} images, but the dataset has only {num_samples}"
            f"{' (after drop_last)' if drop_last else ''}: lower the batch size or accumulation, or use fewer processes"
        )
    return plan.num_batches()


class _FrozenBNStats:
    """Within the block, BatchNorm layers in ``module`` normalise but do not update running stats."""

    def __init__(self, module: nn.Module):
        self.bns = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                    and m.track_running_stats]

    def __enter__(self):
        self.saved = [(m.momentum, m.num_batches_tracked.clone() if m.num_batches_tracked is not None else None)
                      for m in self.bns]
        for m in self.bns:
            m.momentum = 0.0
        return self

    def __exit__(self, *exc):
        for m, (mom, nbt) in zip(self.bns, self.saved):
            m.momentum = mom
            if nbt is not None:
                m.num_batches_tracked.copy_(nbt)
        return False


def _checkpointed_forward(module: nn.Module, forward: Callable, *args, **kwargs):
    if not (module.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    calls = [0]

    def run(*a, **k):
        # The second call is the recomputation during backward: BatchNorm must not count
        # the batch twice in its running statistics.
        calls[0] += 1
        if calls[0] == 1:
            return forward(*a, **k)
        with _FrozenBNStats(module):
            return forward(*a, **k)

    return _checkpoint(run, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: nn.Module, names: Iterable[str]) -> nn.Module:
    """Recompute the activations of the named submodules in backward instead of storing them.

    Trades compute for memory. The forward is wrapped in place, so parameter names (and
    checkpoints) are unchanged. Returns ``model``.
    """
    mods = dict(model.named_modules())
    for name in names:
        if name not in mods or name == "":
            raise ValueError(f"checkpoint_blocks: model has no submodule {name!r} "
                             f"(top-level ones: {', '.join(n for n, _ in model.named_children())})")
        m = mods[name]
        if getattr(m, "_fastload_checkpointed", False):
            continue
        m.forward = functools.partial(_checkpointed_forward, m, m.forward)
        m._fastload_checkpointed = True
    return model


def _find(loader: Any, name: str) -> Any:
    """Attribute ``name`` of ``loader`` or of the first loader it wraps through ``.loader``
    (CUDAPrefetcher) that has it; None when none does."""
    seen: set[int] = set()
    while loader is not None and id(loader) not in seen:
        seen.add(id(loader))
        value = getattr(loader, name, None)
        if value is not None:
            return value
        loader = getattr(loader, "loader", None)
    return None


def _padded_tail(loader: Any) -> int:
    """Samples at the end of one pass of ``loader`` on this rank that repeat other ranks'
    samples: ``num_padded`` of fastload's loaders (0 when the loader does not say)."""
    pad = _find(loader, "num_padded")
    if pad is None:
        return 0
    pad = int(pad)
    if pad < 0:
        raise ValueError(f"{type(loader).__name__}.num_padded must be >= 0, got {pad}")
    return pad


def _replaced_so_far(loader: Any) -> int:
    """Corrupt records a fastload DataLoader has served substitutes for (``on_error="skip"``)."""
    stats = _find(loader, "stats")
    found = stats() if callable(stats) else None
    return int(found.get("replaced", 0)) if isinstance(found, dict) else 0


def _unwrap(model: nn.Module) -> nn.Module:
    model = getattr(model, "_orig_mod", model)  # torch.compile
    return model.module if isinstance(model, DDP) else model


def _split_batch(batch) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, dict):  # DALI-style {"data": ..., "label": ...}
        return batch["data"], batch["label"]
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        if isinstance(batch[0], dict):  # DALI iterators yield one dict per pipeline
            return batch[0]["data"], batch[0]["label"]
        return batch[0], batch[1]
    raise ValueError(f"a training batch must be (images, targets), got {type(batch).__name__}")


class Trainer:
    """Trains ``model`` with ``optimizer`` under ``config``; see the module docstring.

    Build the optimizer from ``model.parameters()`` before creating the Trainer: moving the
    model to its device, SyncBatchNorm conversion and DDP wrapping keep the same Parameter
    objects. Call :meth:`fit`, or :meth:`train_epoch`/:meth:`evaluate` yourself.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, config: TrainConfig = TrainConfig(),
                 dist: DistInfo | None = None, device: str | torch.device | None = None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 scheduler: Any = None, log: Callable[[str], None] | None = None):
        self.config = config
        self.dist = dist or DistInfo(device=torch.device(device) if device is not None else
                                     torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
        if device is not None and dist is not None and torch.device(device) != dist.device:
            raise ValueError(f"device {device} differs from dist.device {dist.device}")
        self.device = self.dist.device
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loss_fn = loss_fn or F.cross_entropy
        self.log = log if (log is not None and self.dist.is_main) else (lambda msg: None)
        self.epoch = 0  # the epoch being (or next to be) trained
        self.step = 0  # optimizer steps taken so far
        self._epoch_pos = 0  # micro-batches already done in the current epoch (mid-epoch resume)
        self._epoch_len: int | None = None  # micro-batches in the current epoch, as known when it began
        self.history: list[dict[str, Any]] = []

        if self.device.type == "cuda" and config.cudnn_benchmark and not torch.backends.cudnn.deterministic:
            torch.backends.cudnn.benchmark = True
        if config.sync_batchnorm and self.dist.distributed:
            if self.device.type != "cuda":
                raise ValueError("sync_batchnorm needs CUDA devices (SyncBatchNorm has no CPU kernel)")
        if self.dist.distributed and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise ValueError(f"dist says world size {self.dist.world_size} but no process group is initialised: "
                             f"get it from fastload.train.init_distributed() under torchrun")
        if config.sync_batchnorm and self.dist.distributed:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = model.to(self.device, memory_format=torch.channels_last if config.channels_last else torch.preserve_format)
        if config.checkpoint_blocks:
            apply_activation_checkpointing(model, config.checkpoint_blocks)
        self._ddp: DDP | None = None
        if self.dist.distributed:
            ids = [self.device.index] if self.device.type == "cuda" else None
            model = self._ddp = DDP(model, device_ids=ids)
        if config.compile:
            model = torch.compile(model)
        self.model = model
        dtype = config.precision.dtype
        self._autocast = functools.partial(torch.autocast, device_type=self.device.type, dtype=dtype,
                                           enabled=dtype is not None)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=config.precision is Precision.FP16)
        self._norm_consts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # channels -> (scale, shift)
        self._host_hold = HostHold()  # pinned host batches until their non_blocking copies have run

    # -- the step ------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The bare model (without DDP or torch.compile wrappers)."""
        return _unwrap(self.model)

    def _normalization_constants(self, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``config.normalization`` as float32 ``(C, 1, 1)`` scale and shift on the device, built
        once per channel count (not per batch: a host-to-device copy each time would sync)."""
        consts = self._norm_consts.get(channels)
        if consts is None:
            scale, shift = scale_shift(self.config.normalization, channels)
            consts = self._norm_consts[channels] = (
                torch.tensor(scale, dtype=torch.float32, device=self.device).view(channels, 1, 1),
                torch.tensor(shift, dtype=torch.float32, device=self.device).view(channels, 1, 1),
            )
        return consts

    def _prepare(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = _split_batch(batch)
        pinned_copy = self.device.type == "cuda" and not x.is_cuda and x.is_pinned()
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        if pinned_copy:
            # The copy runs when the stream gets to it, maybe steps after the host dropped the
            # batch; a loader could refill that pinned memory meanwhile (the slot-release rule).
            self._host_hold.hold(batch, torch.cuda.current_stream(self.device))
        if not x.is_floating_point():
            # uint8 stays uint8 until here: convert and normalise on the device, with the
            # arithmetic of fastload.gpu.transforms.normalize (so the floats are the same).
            scale, shift = self._normalization_constants(x.shape[-3])
            x = apply_scale_shift(x, scale, shift, dtype=torch.float32, channels_last=self.config.channels_last)
        if self.config.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y

    def _optimizer_step(self) -> None:
        if self.config.grad_clip is not None:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1

    def train_epoch(self, loader: Iterable, *, epoch: int | None = None, max_steps: int | None = None) -> EpochStats:
        """Train over ``loader`` once (or for ``max_steps`` optimizer steps, then stop mid-epoch).

        After a mid-epoch stop, :meth:`save_checkpoint` can record the position; calling
        this again (or after :meth:`load_checkpoint`) continues the same epoch.
        """
        k = self.config.accum_steps
        resuming = self._epoch_pos > 0
        if epoch is not None and epoch != self.epoch:
            if resuming:
                raise ValueError(f"epoch {self.epoch} was stopped mid-way; finish it before starting epoch {epoch}")
            self.epoch = epoch
        if not resuming and hasattr(loader, "set_epoch"):
            loader.set_epoch(self.epoch)
        if hasattr(loader, "batches_left"):
            # fastload's loaders know what is left of the epoch, also after a resume on another
            # number of processes (their positions are global); micro-batch positions here
            # count from where this process's share of the epoch began.
            self._epoch_len = self._epoch_pos + loader.batches_left()
        elif not resuming:
            try:
                self._epoch_len = len(loader)  # type: ignore[arg-type]
            except TypeError:
                self._epoch_len = None
        total = self._epoch_len
        if total is not None and total < k and not resuming:
            raise ValueError(
                f"the loader yields {total} batches per process per epoch, fewer than accum_steps={k}: no optimizer "
                f"step would ever happen; lower the accumulation or batch size, or use fewer processes"
            )
        self.model.train()
        reset_peak_memory(self.device)
        replaced_before = _replaced_so_far(loader)
        loss_sum = torch.zeros((), device=self.device)
        micro = samples = steps = 0
        pos = self._epoch_pos
        data_s = 0.0
        t_start = time.perf_counter()
        completed = True
        it = iter(loader)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            data_s += time.perf_counter() - t0
            x, y = self._prepare(batch)
            group_start = pos - pos % k
            group_len = k if total is None else min(k, total - group_start)
            last = pos % k == group_len - 1
            # Skip the gradient all-reduce on all but the last micro-batch of a group.
            sync = contextlib.nullcontext() if (last or self._ddp is None) else self._ddp.no_sync()
            with sync:
                with self._autocast():
                    loss = self.loss_fn(self.model(x), y)
                self.scaler.scale(loss / group_len).backward()
            loss_sum += loss.detach().float()
            micro += 1
            samples += x.shape[0]
            pos += 1
            if last:
                self._optimizer_step()
                steps += 1
                if self.config.log_interval and self.step % self.config.log_interval == 0:
                    running = loss_sum.item() / micro  # the host sync of this interval, before the clock
                    now = time.perf_counter()
                    self.log(f"epoch {self.epoch} step {self.step}: loss {running:.4f} "
                             f"({samples * self.dist.world_size / (now - t_start):,.0f} img/s)")
                if max_steps is not None and steps >= max_steps and (total is None or pos < total):
                    completed = False
                    break
        if completed and pos % k and total is None:
            self._optimizer_step()  # unknown epoch length: step on the last, short group
            steps += 1
        # .item() waits for the device to finish the epoch's queued work: read it before the
        # clock, or a GPU epoch would look faster than it was.
        mean_loss = loss_sum.item() / micro if micro else float("nan")
        seconds = time.perf_counter() - t_start
        self._host_hold.drain()  # the sync above finished every copy: this only drops them
        stats = EpochStats(epoch=self.epoch, steps=steps, samples=samples * self.dist.world_size, loss=mean_loss,
                           seconds=seconds, data_seconds=data_s, peak_memory_bytes=peak_memory_bytes(self.device),
                           completed=completed, replaced=_replaced_so_far(loader) - replaced_before)
        if completed:
            self.epoch += 1
            self._epoch_pos = 0
            self._epoch_len = None
        else:
            self._epoch_pos = pos
        return stats

    @torch.inference_mode()
    def evaluate(self, loader: Iterable) -> EvalStats:
        """Loss and top-1/top-5 accuracy over ``loader``, summed over all ranks.

        Under DDP a loader that pads every rank to the same length (fastload's DataLoader with
        ``drop_last=False``) repeats a few images on some ranks. Every rank still runs all its
        batches, so the ranks' forward passes stay in step (DDP's forward can broadcast
        buffers), but the repeats at the end of each rank's pass, ``loader.num_padded`` of
        them, are left out of the sums: each image is counted exactly once. The count is read
        from ``loader`` or the loader it wraps (``loader.loader``, as in CUDAPrefetcher); a
        loader without ``num_padded`` is taken to repeat nothing.
        """
        was_training = self.model.training
        self.model.eval()
        t0 = time.perf_counter()
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)  # loss, top1, top5, n
        pad = _padded_tail(loader)
        tail: collections.deque[torch.Tensor] = collections.deque()  # per-sample rows of the last batches
        in_tail = 0
        for batch in loader:
            x, y = self._prepare(batch)
            with self._autocast():
                out = self.model(x)
            out = out.float()
            hit = out.topk(min(5, out.shape[1]), dim=1).indices == y[:, None]
            rows = torch.stack([F.cross_entropy(out, y, reduction="none").double(), hit[:, 0].double(),
                                hit.any(dim=1).double()], dim=1)  # (batch, [loss, top1, top5])
            sums[:3] += rows.sum(dim=0)
            sums[3] += rows.shape[0]
            if pad:  # keep just enough of the latest rows to take the padding back out at the end
                tail.append(rows)
                in_tail += rows.shape[0]
                while in_tail - tail[0].shape[0] >= pad:
                    in_tail -= tail.popleft().shape[0]
        if tail:
            repeats = torch.cat(tuple(tail))[-pad:]
            sums[:3] -= repeats.sum(dim=0)
            sums[3] -= repeats.shape[0]
        all_reduce_sum(sums)
        loss, c1, c5, n = sums.tolist()
        self._host_hold.drain()  # tolist() synchronised: every copy has run
        self.model.train(was_training)
        if n == 0:
            raise ValueError("evaluation loader yielded no samples")
        return EvalStats(loss=loss / n, acc1=c1 / n, acc5=c5 / n, samples=int(round(n)),
                         seconds=time.perf_counter() - t0)

    def fit(self, train_loader: Iterable, *, epochs: int, val_loader: Iterable | None = None,
            checkpoint_path: str | Path | None = None) -> list[dict[str, Any]]:
        """Train until ``epochs`` epochs are done (resuming where a checkpoint left off).

        Logs one line per epoch; saves ``checkpoint_path`` after each epoch if given.
        Returns the per-epoch records (also kept in ``self.history``).
        """
        while self.epoch < epochs:
            tr = self.train_epoch(train_loader)
            rec: dict[str, Any] = {"epoch": tr.epoch, "train": tr.as_dict()}
            msg = (f"epoch {tr.epoch}: train loss {tr.loss:.4f}, {tr.images_per_sec:,.0f} img/s, "
                   f"data stall {tr.data_stall:.0%}, peak mem {tr.peak_memory_bytes / 2**20:,.0f} MiB")
            replaced = int(all_reduce_sum(torch.tensor([tr.replaced], device=self.device)).item())  # every rank calls this
            if replaced:
                msg += f", {replaced} corrupt record(s) replaced by substitutes (see loader.stats())"
            if val_loader is not None:
                ev = self.evaluate(val_loader)
                rec["val"] = ev.as_dict()
                msg += f" | val loss {ev.loss:.4f}, Acc@1 {ev.acc1:.2%}, Acc@5 {ev.acc5:.2%}"
            self.log(msg)
            self.history.append(rec)
            if checkpoint_path is not None:
                self.save_checkpoint(checkpoint_path, loader=train_loader)
        return self.history

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self, *, loader: Any = None) -> dict[str, Any]:
        """Everything needed to continue exactly: model, optimizer, scaler, position, loader."""
        state = {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "epoch": self.epoch,
            "step": self.step,
            "epoch_pos": self._epoch_pos,
            "epoch_len": self._epoch_len,
            "accum_steps": self.config.accum_steps,
            "world_size": self.dist.world_size,
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
            # torch's own states above load with weights_only=True as they are; ours are made plain
            "history": plain_state(self.history),
            "loader": plain_state(loader.state_dict()) if hasattr(loader, "state_dict") else None,
        }
        return state

    def save_checkpoint(self, path: str | Path, *, loader: Any = None) -> None:
        """Write a checkpoint atomically (rank 0 writes; every rank must call this)."""
        if self._epoch_pos % self.config.accum_steps:
            raise ValueError("cannot checkpoint in the middle of a gradient-accumulation group")
        path = Path(path)
        state = self.state_dict(loader=loader)
        if self.dist.is_main:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
            torch.save(state, tmp)
            os.replace(tmp, path)
        barrier()

    def load_checkpoint(self, path: str | Path, *, loader: Any = None,
                        allow_unsafe_checkpoint: bool = False) -> dict[str, Any]:
        """Restore a checkpoint written by :meth:`save_checkpoint` (and the loader's position).

        Loaded with ``torch.load(weights_only=True)``: tensors and plain containers only, so a
        file that carries arbitrary pickled objects cannot run code here; it is refused with
        :class:`~fastload.errors.FormatError`. ``allow_unsafe_checkpoint=True`` loads such a
        file (e.g. an older fastload's checkpoint) with full unpickling: only for files you trust.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(2, "no such checkpoint file", str(path))
        state = load_checkpoint_file(path, map_location=self.device, allow_unsafe=allow_unsafe_checkpoint)
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise FormatError(f"{path}: not a fastload training checkpoint")
        if state.get("version") != CHECKPOINT_VERSION:
            raise FormatError(f"{path}: checkpoint version {state.get('version')} is not supported "
                              f"(this fastload reads {CHECKPOINT_VERSION})")
        if state["epoch_pos"] and state["accum_steps"] != self.config.accum_steps:
            raise ValueError(f"{path}: saved mid-epoch with accumulation {state['accum_steps']}; "
                             f"resume with the same accumulation (or from an epoch boundary)")
        if state["epoch_pos"] and state["world_size"] != self.dist.world_size and not hasattr(loader, "batches_left"):
            raise ValueError(f"{path}: saved mid-epoch on {state['world_size']} processes; resuming on "
                             f"{self.dist.world_size} needs a fastload loader (its positions are global)")
        try:
            self.module.load_state_dict(state["model"])
        except RuntimeError as exc:  # torch's message lists every key: too long for one line
            raise ValueError(f"{path}: checkpoint weights do not fit this {type(self.module).__name__} "
                             "(saved from another architecture or number of classes?)") from exc
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.epoch, self.step = state["epoch"], state["step"]
        self._epoch_pos, self._epoch_len = state["epoch_pos"], state["epoch_len"]
        self.history = list(state.get("history") or [])
        torch.set_rng_state(state["torch_rng"].cpu())
        if state["cuda_rng"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"].cpu(), self.device)
        if loader is not None and state["loader"] is not None:
            if not hasattr(loader, "load_state_dict"):
                raise ValueError("the checkpoint holds a loader position but this loader has no load_state_dict")
            loader.load_state_dict(state["loader"])
        elif loader is not None and self._epoch_pos:
            raise ValueError(f"{path}: saved mid-epoch without the loader's state; cannot resume exactly")
        return state
