"""Small helpers the field keeps re-typing: seeding, in-place ReLU, Conv+BN fusion, bias drop,
and checkpoint files that load with ``torch.load(weights_only=True)``.

Each transformation returns a model that computes the same function (tested numerically);
they exist to save memory (in-place ReLU), time at inference (fusion) or parameters (bias).
"""

from __future__ import annotations

import enum
import os
import pickle
import random
import resource
import sys
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import FormatError

__all__ = [
    "drop_conv_bias_before_bn",
    "fuse_conv_bn",
    "fuse_conv_bn_eval",
    "load_checkpoint_file",
    "peak_memory_bytes",
    "plain_state",
    "relu_inplace",
    "reset_peak_memory",
    "seed_everything",
]


def seed_everything(seed: int, *, deterministic: bool = False) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device) from one integer.

    ``deterministic=True`` also asks cuDNN and torch for deterministic kernels (slower, and
    turns ``cudnn.benchmark`` off); leave it False for speed when bitwise repeatability on
    the GPU is not needed. Data-loading order is seeded separately, by the loader.
    """
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    os.environ["PYTHONHASHSEED"] = str(seed)  # for subprocesses started from here
    torch.backends.cudnn.deterministic = deterministic
    if deterministic:
        torch.backends.cudnn.benchmark = False
        # cuBLAS needs this set before its first use to be deterministic.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(deterministic, warn_only=True)


def relu_inplace(model: nn.Module) -> nn.Module:
    """Switch every ``nn.ReLU`` to ``inplace=True`` (saves one activation tensor each).

    Safe when nothing else reads the ReLU's input afterwards, which holds for the usual
    conv-BN-ReLU stacks (BN's backward keeps its own saved tensors, and ReLU's backward
    needs only its output). Returns ``model`` for chaining.
    """
    for m in model.modules():
        if isinstance(m, nn.ReLU):
            m.inplace = True
    return model


@torch.no_grad()
def fuse_conv_bn_eval(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """A new Conv2d equal to ``bn(conv(x))`` with ``bn`` in eval mode (running statistics).

    w' = w * gamma / sqrt(var + eps);  b' = (b - mean) * gamma / sqrt(var + eps) + beta.
    """
    if not isinstance(conv, nn.Conv2d) or not isinstance(bn, nn.BatchNorm2d):
        raise ValueError(f"fuse_conv_bn_eval needs Conv2d + BatchNorm2d, got {type(conv).__name__} + {type(bn).__name__}")
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError("cannot fuse a BatchNorm2d without running statistics (track_running_stats=False)")
    if conv.out_channels != bn.num_features:
        raise ValueError(f"conv has {conv.out_channels} output channels but BatchNorm has {bn.num_features}")
    fused = nn.Conv2d(
        conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride, padding=conv.padding,
        dilation=conv.dilation, groups=conv.groups, bias=True, padding_mode=conv.padding_mode,
        device=conv.weight.device, dtype=conv.weight.dtype,
    )
    gamma = bn.weight if bn.affine else torch.ones_like(bn.running_var)
    beta = bn.bias if bn.affine else torch.zeros_like(bn.running_mean)
    scale = gamma / torch.sqrt(bn.running_var + bn.eps)
    fused.weight.copy_(conv.weight * scale.reshape(-1, 1, 1, 1))
    b = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
    fused.bias.copy_((b - bn.running_mean) * scale + beta)
    return fused


def _conv_bn_pairs(model: nn.Module):
    """(parent, conv name, bn name) for every Conv2d directly followed by a BatchNorm2d.

    "Followed" means consecutive children of an ``nn.Sequential``, or attributes named
    ``convN``/``bnN`` (the ResNet convention: conv1/bn1, conv2/bn2 ...) or ``conv``/``bn``.
    """
    for parent in model.modules():
        children = list(parent.named_children())
        if isinstance(parent, nn.Sequential):
            for (n1, m1), (n2, m2) in zip(children, children[1:]):
                if isinstance(m1, nn.Conv2d) and isinstance(m2, nn.BatchNorm2d):
                    yield parent, n1, n2
        else:
            names = dict(children)
            for n1, m1 in children:
                if isinstance(m1, nn.Conv2d) and n1.startswith("conv"):
                    n2 = "bn" + n1[len("conv"):]
                    if isinstance(names.get(n2), nn.BatchNorm2d):
                        yield parent, n1, n2


def fuse_conv_bn(model: nn.Module) -> nn.Module:
    """Fold every BatchNorm2d that directly follows a Conv2d into it, for inference.

    Works in place on ``model`` (which must be in eval mode: fusion uses running
    statistics); the BN becomes ``nn.Identity``. Returns ``model``.
    """
    if model.training:
        raise ValueError("fuse_conv_bn is for inference: call model.eval() first (training BN uses batch statistics)")
    for parent, conv_name, bn_name in list(_conv_bn_pairs(model)):
        conv, bn = getattr(parent, conv_name), getattr(parent, bn_name)
        setattr(parent, conv_name, fuse_conv_bn_eval(conv, bn))
        setattr(parent, bn_name, nn.Identity())
    return model


@torch.no_grad()
def drop_conv_bias_before_bn(model: nn.Module) -> nn.Module:
    """Remove the bias of every Conv2d followed by a BatchNorm2d: BN subtracts the mean anyway.

    In training mode the output is unchanged exactly (the bias cancels in the batch mean);
    to keep eval-mode outputs unchanged too, the bias is folded into BN's running mean.
    Works in place; returns ``model``.
    """
    for parent, conv_name, bn_name in list(_conv_bn_pairs(model)):
        conv, bn = getattr(parent, conv_name), getattr(parent, bn_name)
        if conv.bias is None:
            continue
        if bn.running_mean is not None:
            bn.running_mean.sub_(conv.bias)
        conv.bias = None
    return model


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory: CUDA ``max_memory_allocated`` on a GPU, else the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # macOS: bytes, Linux: KiB


# -- checkpoint files ------------------------------------------------------------------


def plain_state(obj: Any) -> Any:
    """``obj`` built only of what ``torch.load(weights_only=True)`` rebuilds: tensors, numbers,
    strings, bytes, None, and dicts, lists, tuples and sets of them. Numpy arrays become
    tensors, numpy scalars numbers, dataclasses dicts, enums their values; anything else is a
    TypeError now rather than a checkpoint that cannot be loaded safely later."""
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, torch.Tensor, torch.dtype,
                                       torch.device, torch.Size)):
        return obj
    if isinstance(obj, enum.Enum):
        return plain_state(obj.value)
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    if isinstance(obj, np.generic):
        return obj.item()
    if is_dataclass(obj) and not isinstance(obj, type):
        return plain_state(asdict(obj))
    if isinstance(obj, dict):
        return {plain_state(k): plain_state(v) for k, v in obj.items()}
    for kind in (list, tuple, set):  # a subclass (a namedtuple, say) as its plain base type
        if isinstance(obj, kind):
            return kind(plain_state(v) for v in obj)
    if isinstance(obj, frozenset):
        return set(map(plain_state, obj))
    raise TypeError(f"cannot store a {type(obj).__name__} in a checkpoint (tensors, numbers, strings, "
                    "dicts, lists, tuples and sets only, so it loads with weights_only=True)")


def load_checkpoint_file(path: str | Path, *, map_location: Any = "cpu", allow_unsafe: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``; a file that needs full unpickling is refused
    with one line saying so, unless ``allow_unsafe`` (the caller trusts the file)."""
    try:
        return torch.load(path, map_location=map_location, weights_only=not allow_unsafe)
    except pickle.UnpicklingError as exc:
        if "global" not in str(exc).lower():  # garbage, truncated or not a torch file at all
            raise FormatError(f"{path}: cannot read checkpoint (corrupt, truncated or not a torch "
                              "checkpoint file)") from exc
        raise FormatError(
            f"{path}: the checkpoint holds pickled Python objects that weights_only loading refuses "
            f"({_first_line(exc, 'global')}); if you wrote it yourself (an older fastload's checkpoint), "
            "load it once with load_checkpoint(..., allow_unsafe_checkpoint=True) and save it again"
        ) from exc
    except Exception as exc:
        raise FormatError(f"{path}: cannot read checkpoint ({_first_line(exc)})") from exc


def _first_line(exc: BaseException, prefer: str | None = None) -> str:
    """A one-line summary of ``exc``: its first line mentioning ``prefer`` (any case) if any."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if prefer is not None:
        for ln in lines:
            if prefer in ln.lower():
                return ln.split(". Please use")[0].rstrip(".")[:200]
    return (lines[0] if lines else type(exc).__name__)[:200]
