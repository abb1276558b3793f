"""A DALI pipeline over a fastload pack: nvJPEG decode and augmentation on the GPU.

The pack's records reach DALI through ``fn.external_source`` in *parallel batch mode*: a
small picklable callable (:class:`PackBatchSource`) runs in DALI's Python worker processes
and returns the encoded bytes and labels of one batch. It is a pure function of
``(epoch, batch number)``; the order comes from the same :class:`~fastload.data.plan.EpochPlan`
as fastload's own DataLoader, so DALI reads exactly the samples it would on each rank and
epoch, and resumes from the same (elastic) positions.
Decoding (``device="mixed"``: nvJPEG), random-resized-crop, flip and normalisation run in
DALI; a ``DALIGenericIterator`` hands the results to PyTorch as ``(images, targets)``.

Last-batch policy: ``drop_last=False`` gives a final partial batch (like a torch DataLoader;
the DDP sampler pads ranks to equal length by wrapping around); ``drop_last=True`` keeps full
batches only and drops the permutation's tail. Either way every rank gets the same number of
batches.

A pack at a URL (``s3://bucket/prefix``) is read through the node-local shard cache, as by
:class:`~fastload.data.dataset.ImageFolder`: the source gets the loader's
:class:`~fastload.storage.remote_pack.RemotePack` (a URL, store options and a cache directory
and limit: it pickles small), so every DALI worker reads the same cache, holds the shards it
reads while it has them open, and starts downloading the shards of the next few batches
before it needs them.

Augmentation draws are fastload's own (:mod:`fastload.data.draws`): the source computes each
sample's RandomResizedCrop box and flip from ``(seed, epoch, sample index)`` and hands them
to DALI with the bytes, so a sample gets the same box and flip as on fastload's CPU loader
and GPU helpers (the pixels differ only by the resampling filter), whatever the rank,
worker or batch it lands in.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..config import usable_cpus
from ..data.draws import crop_boxes, flip_flags
from ..checks import check_batch_args, check_main_guard, resolve_distributed
from ..data.order import Order
from ..data.plan import EpochPlan
from ..codecs import jpegcrop as _jpegcrop
from ..data.dataset import decode_error, describe_record, first_substitute, read_error
from ..data.protocols import on_error_skips
from ..errors import DecodeError, FormatError, require
from ..image import exif_orientations, jpeg_info
from ..normalization import SCALE_ONLY, Normalization, as_normalization
from ..storage import PackReader, open_pack
from ..storage.remote import is_url

__all__ = ["DALILoader", "PackBatchSource", "dali_available"]

_PIP = "nvidia-dali-cuda120"
_DECODABLE = ("jpeg", "png", "bmp", "original")


def _dali():
    """Import DALI where it is used, with an error that says what to install."""
    return require("nvidia.dali", _PIP, "fastload.dali (the DALI pipeline)")


def dali_available() -> bool:
    """Whether ``nvidia.dali`` can be imported here."""
    try:
        _dali()
    except ImportError:
        return False
    return True


class PackBatchSource:
    """The external-source callable: batch ``info.iteration`` of epoch ``base_epoch + info.epoch_idx``.

    Stateless apart from caches, as DALI's parallel mode requires: it pickles small (the pack
    reader opens its files lazily in each worker) and takes the epoch's order from ``plan``,
    cached for the current epoch. The pipeline's first epoch starts at global position
    ``start`` (a resumed job's position); later ones from their beginning.

    ``on_error`` (:class:`~fastload.data.protocols.OnRecordError`): what to do with a record
    that cannot be read or fails :meth:`record`'s check. ``"raise"`` ends the pipeline with a
    DecodeError/FormatError naming the record, its shard and its source file; ``"skip"`` serves
    its first readable substitute (:func:`~fastload.data.draws.substitute_index`, the CPU
    loader's choice), with that sample's label and crop box, and writes one line per
    replacement to stderr (this runs in DALI's worker processes: nothing else reaches the
    main process).

    ``remote``: the :class:`~fastload.storage.remote_pack.RemotePack` of a pack at a URL (the
    loader's, so the workers use its store options and node cache); ``ahead``: how many batches
    past the one being read have their shards' downloads started (remote packs only).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        labels: np.ndarray,
        shapes: np.ndarray | None,
        plan: EpochPlan,
        base_epoch: int = 0,
        start: int = 0,
        hw: np.ndarray | None = None,
        scale: tuple[float, float] | None = None,
        ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
        flip_p: float = 0.5,
        on_error: str = "raise",
        remote: Any = None,
        ahead: int = 0,
    ):
        self.on_error = "skip" if on_error_skips(on_error) else "raise"
        self.root: Path | str = str(root).rstrip("/") if is_url(root) else Path(root)
        self.remote = remote
        self.ahead = max(0, int(ahead))
        self.labels = np.ascontiguousarray(labels, dtype=np.int64)
        self.shapes = None if shapes is None else np.ascontiguousarray(shapes, dtype=np.int32)
        if plan.num_samples != len(self.labels):
            raise ValueError(f"PackBatchSource: a plan of {plan.num_samples} samples for {len(self.labels)} records")
        self.plan = plan
        self.seed = plan.seed
        self.base_epoch = int(base_epoch)
        self.start = int(start)
        # Training augmentation (``scale`` set): each record's stored (h, w) sizes its crop box.
        self.hw = None if hw is None else np.ascontiguousarray(hw, dtype=np.int64)
        self.scale = None if scale is None else (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.flip_p = float(flip_p)
        if self.scale is not None and (self.hw is None or len(self.hw) != len(self.labels)):
            raise ValueError("PackBatchSource: training augmentation needs the stored (h, w) of every record")
        self._pack: PackReader | None = None
        self._cached: tuple[int, int, np.ndarray] | None = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_pack"] = None
        state["_cached"] = None
        return state

    def reader(self) -> PackReader:
        """This process's reader of the pack, opened on first use."""
        if self._pack is None:
            if self.remote is not None:
                pack = PackReader(self.remote.url, check_files=False, remote=self.remote)
            else:
                pack = open_pack(self.root, check_files=False)
            if len(pack) != len(self.labels):
                pack.close()
                raise FormatError(f"{self.root}: the pack has {len(pack)} records, the loader was built for "
                                  f"{len(self.labels)} (packed again since?); build the loader again")
            pack.hold_at_most(self.plan.open_shards)
            self._pack = pack
        return self._pack

    def indices(self, epoch: int, start: int = 0) -> np.ndarray:
        if self._cached is None or self._cached[:2] != (epoch, start):
            self._cached = (epoch, start, self.plan.indices_view(epoch, start))  # lazy: O(batch) per batch
        return self._cached[2]

    def batch_indices(self, epoch_idx: int, iteration: int) -> np.ndarray:
        """Dataset indices of one batch; raises StopIteration past the epoch's end."""
        start = self.start if epoch_idx == 0 else 0
        if iteration >= self.plan.num_batches(start):
            raise StopIteration
        return self.plan.batch(self.indices(self.base_epoch + epoch_idx, start), iteration)

    def augment(self, epoch: int, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Crop windows ``(top, left)`` and ``(bottom, right)`` in pixels of the stored image
        (float32 for a raw payload's resize ROI, int32 for a decoder's slice) and flip flags
        (int32) of samples ``idx``: the draws of fastload's CPU RandomResizedCrop +
        RandomHorizontalFlip for the same samples."""
        hw = self.hw[idx]
        boxes = crop_boxes(self.seed, epoch, idx, hw[:, 0], hw[:, 1], scale=self.scale, ratio=self.ratio)
        flips = flip_flags(self.seed, epoch, idx, self.flip_p)
        dtype = np.float32 if self.shapes is not None else np.int32
        start = boxes[:, :2].astype(dtype)
        end = (boxes[:, :2] + boxes[:, 2:]).astype(dtype)
        return start, end, flips.astype(np.int32)

    def __call__(self, info) -> tuple:
        epoch_idx, iteration = int(info.epoch_idx), int(info.iteration)
        idx = self.batch_indices(epoch_idx, iteration)
        self.download_ahead(epoch_idx, iteration)
        idx, data = self.read(idx, self.base_epoch + epoch_idx)  # idx: what was served (substitutes)
        if self.scale is None:
            return data, self.labels[idx]
        return (data, self.labels[idx], *self.augment(self.base_epoch + epoch_idx, idx))

    def download_ahead(self, epoch_idx: int, iteration: int) -> None:
        """Start downloading (in the background) the remote shards that batch ``iteration`` and
        the ``ahead`` batches after it read, unless this process already did: the batch's
        shards then arrive in parallel, and later batches find theirs in the node cache. DALI
        hands batches to its workers in turn, so every batch is announced by some worker."""
        start = self.start if epoch_idx == 0 else 0
        bs = self.plan.batch_size
        self.reader().prefetch(self.indices(self.base_epoch + epoch_idx, start)[iteration * bs : (iteration + 1 + self.ahead) * bs])

    def read(self, idx: np.ndarray, epoch: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """``(served, data)``: the arrays DALI gets for samples ``idx`` (:meth:`record`), and the
        dataset indices they are of: ``idx`` itself, or a copy with every corrupt record replaced
        by its substitute under ``on_error="skip"`` (its label and crop box follow from it)."""
        pack = self.reader()
        pack.hold_only(idx)  # a remote pack: unpin the shards of earlier batches
        served, data = idx, []
        for j, i in enumerate(idx.tolist()):
            try:
                data.append(self.record(i))
            except (DecodeError, FormatError) as exc:
                if self.on_error != "skip":
                    raise
                s, arr = first_substitute(i, len(self.labels), seed=self.seed, epoch=epoch, error=exc,
                                          attempt=self.record)
                if served is idx:
                    served = idx.copy()  # idx may be a view of the cached epoch order
                served[j] = s
                data.append(arr)
                print(f"fastload DALI source (on_error='skip', epoch {epoch}): {exc}; served "
                      f"{describe_record(pack, s)} in its place", file=sys.stderr, flush=True)
        return served, data

    def record(self, i: int) -> np.ndarray:
        """Record ``i`` as DALI's input (encoded bytes, or a raw payload's HWC pixels), after a
        cheap check (:func:`payload_problem`; raw: the byte count) so that a damaged record
        raises here, naming itself, instead of failing inside DALI, which names neither.
        Reading goes through :meth:`PackReader.get`, which holds a remote shard in the node
        cache while this process has it open; the record is copied out at once."""
        pack = self.reader()
        try:
            buf = np.frombuffer(pack.get(i), dtype=np.uint8)
        except (FormatError, OSError) as exc:
            raise read_error(pack, i, exc) from None
        if self.shapes is not None:
            h, w, c = (int(v) for v in self.shapes[i])
            if buf.size != h * w * c:
                raise read_error(pack, i, f"raw record has {buf.size} bytes, expected {h}x{w}x{c}")
            return buf.reshape(h, w, c).copy()
        problem = payload_problem(buf, pack.payload, None if self.hw is None else self.hw[i])
        if problem is not None:
            raise decode_error(pack, i, problem)
        return np.array(buf)


_PNG = b"\x89PNG\r\n\x1a\n"
# Besides JPEG, what a payload "original" (a source file's own bytes) can start with: the
# formats the packer accepts (fastload.image.IMG_EXTENSIONS), all of which DALI decodes.
_SIGNATURES = {
    "png": (_PNG,),
    "bmp": (b"BM",),
    "original": (_PNG, b"BM", b"II*\x00", b"MM\x00*", b"RIFF", b"P1", b"P2", b"P3", b"P4", b"P5", b"P6"),
}


def payload_problem(buf: np.ndarray, payload: str, hw: Sequence[int] | None = None) -> str | None:
    """What is wrong with an encoded record, from a few header bytes, or None if nothing shows.

    JPEG: the start-of-image marker and a header fastload's own parser reads (when the turbo-crop
    extension is built), and for payload ``"jpeg"`` (fastload's encoder) the end-of-image
    marker last; the header's size (turned by its EXIF orientation: what DALI decodes) equal to
    the index's ``hw``, which places the crop windows. A source file (``"original"``)
    may carry data after its image (a camera's trailer, a motion photo's video), so its end is
    not checked. PNG/BMP: the signature. Damage inside the compressed data gets past these
    checks: DALI's decoder then fails the pipeline.
    """
    n = buf.size
    if n < 4:
        return f"a {n}-byte payload is no image"
    if buf[0] == 0xFF and buf[1] == 0xD8:
        if payload not in ("jpeg", "original"):
            return f"a JPEG in a {payload} pack"
        if payload == "jpeg" and not (buf[-2] == 0xFF and buf[-1] == 0xD9):
            return f"no JPEG end-of-image marker at the end of its {n} bytes (truncated or overwritten)"
        if _jpegcrop.available():
            try:
                _jpegcrop.header(buf)
            except DecodeError as exc:
                return str(exc)
        if payload == "original" and len(set(exif_orientations(buf))) > 1:
            # DALI 2.4's decoder crashes the whole process (SIGSEGV) on such a header
            return ("its EXIF blocks disagree on the orientation, which DALI's decoder cannot read: "
                    "read it with fastload's CPU loader, or repack it with --payload jpeg")
        if hw is not None:
            # DALI turns a JPEG by its EXIF orientation as fastload.image.jpeg_info reads it
            # (checked by tests/test_shape_truth.py), and its crop windows come from the index.
            info = jpeg_info(buf)
            if info is None:
                return "no JPEG frame header before its scan data"
            return info.shape_problem(tuple(hw))
        return None
    if payload == "jpeg":
        return f"no JPEG start-of-image marker (starts with {bytes(buf[:4]).hex(' ')})"
    head = bytes(buf[:8])
    if any(head.startswith(sig) for sig in _SIGNATURES.get(payload, ())):
        return None
    return f"not a {payload} image (starts with {head[:4].hex(' ')})"


class DALILoader:
    """Batches of a fastload pack decoded and augmented by DALI, as ``(images, targets)`` tensors.

    ``device="gpu"``: nvJPEG (``decoders.image(device="mixed")``) and GPU augmentation on CUDA
    device ``device_id`` (default: the current one); outputs are CUDA tensors. ``device="cpu"``:
    a CPU-only pipeline (``device_id=None``), CPU tensors. Images come out as ``(N, 3, crop,
    crop)`` float (``dtype``), normalised with ``normalization`` (a :class:`fastload.Normalization`,
    or ``mean``/``std`` in 0-1 units; without them scaled to 0..1), in channels_last memory format
    unless ``channels_last=False``; targets are int64.

    ``train=True``: random-resized-crop (``scale``, ``ratio``) and a random flip; ``train=False``:
    resize the shorter side to ``crop / 0.875`` and centre-crop. ``len()`` is the number of
    batches per epoch on this rank. ``set_epoch(e)`` selects the epoch's shuffle (like
    fastload's sampler, a finished epoch moves on to the next by itself); ``state_dict`` /
    ``load_state_dict`` resume mid-epoch from a global position (the same ``{"order": ...}``
    state as fastload's DataLoader: either loads the other's, on any number of ranks).
    Re-iterating after breaking out early continues the unfinished epoch.

    ``on_error``: ``"raise"`` (default) stops at a record that cannot be read or fails the
    source's check (:func:`payload_problem`), with an error naming the record, its shard and its
    source file; ``"skip"`` serves the same deterministic substitute as fastload's DataLoader
    (its image, label and crop box), so batches stay full and the epoch keeps its length. The
    source runs in DALI's worker processes, so replacements are not counted here: each one is
    one line on stderr naming the record and its substitute. The check reads only headers and
    markers; a record damaged inside its compressed data still fails DALI's decoder, which
    ends the pipeline (``fastload verify`` finds such shards).

    ``plan``: an :class:`~fastload.data.plan.EpochPlan` to follow instead of a full shuffle
    (e.g. a :class:`~fastload.data.plan.BlockShufflePlan`), as in fastload's DataLoader: its
    ``num_samples`` must be the pack's, and its fields win over ``batch_size`` (which may then
    be left out), ``seed``, ``shuffle``, ``drop_last`` and ``distributed``.

    ``root`` may be a URL (``s3://bucket/prefix``, ``gs://``, ``az://``): the pack is read
    through the node-local shard cache ``cache_dir`` (at most ``cache_limit`` bytes),
    ``storage_options``/``endpoint_url``/``retry_seconds`` configure the store, as for
    :class:`~fastload.data.dataset.ImageFolder`; :attr:`remote` is then the pack's
    :class:`~fastload.storage.remote_pack.RemotePack` (None for a local pack). The source's
    workers must be spawned (the default; the object-store client does not survive ``fork``).
    """

    def __init__(
        self,
        root: str | Path,
        batch_size: int | None = None,
        *,
        device: str = "gpu",
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        crop: int = 224,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        normalization: Normalization | None = None,
        num_threads: int | None = None,
        distributed: tuple[int, int] | None = None,
        train: bool = True,
        dtype: Any = None,
        channels_last: bool = True,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
        resize_ratio: float = 0.875,
        device_id: int | None = None,
        py_num_workers: int = 2,
        py_start_method: str | None = None,
        prefetch_queue_depth: int = 2,
        on_error: str = "raise",
        plan: EpochPlan | None = None,
        cache_dir: str | Path | None = None,
        cache_limit: int | str | None = None,
        storage_options: dict | None = None,
        endpoint_url: str | None = None,
        retry_seconds: float = 60.0,
    ):
        import torch

        on_error = "skip" if on_error_skips(on_error) else "raise"  # ValueError before anything starts

        self._dali_mod = _dali()
        if device not in ("gpu", "cpu"):
            raise ValueError(f"device must be 'gpu' or 'cpu', got {device!r}")
        if plan is not None:
            batch_size = plan.batch_size
        elif batch_size is None:
            raise ValueError("DALILoader needs a batch_size (or a plan=)")
        check_batch_args(batch_size=batch_size, crop=crop, resize_ratio=resize_ratio)
        if not (0 < scale[0] <= scale[1] <= 1):
            raise ValueError(f"scale must satisfy 0 < min <= max <= 1, got {scale}")
        if not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"ratio must satisfy 0 < min <= max, got {ratio}")
        if py_start_method not in (None, "fork", "spawn"):
            raise ValueError(f"py_start_method must be 'fork', 'spawn' or None, got {py_start_method!r}")
        remote = is_url(root)
        if remote and py_start_method == "fork":
            raise ValueError(f"{root}: a pack in object storage needs py_start_method='spawn' "
                             "(the object-store client does not survive fork)")
        dtype = torch.float32 if dtype is None else dtype
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float32, float16 or bfloat16, got {dtype}")
        if device == "gpu":
            if not torch.cuda.is_available():
                raise ValueError("DALILoader(device='gpu') needs a CUDA GPU; use device='cpu' on this machine")
            device_id = torch.cuda.current_device() if device_id is None else int(device_id)
        else:
            device_id = None

        self.root: Path | str = str(root).rstrip("/") if remote else Path(root)  # Path() mangles "s3://"
        self.batch_size = batch_size
        self.device = device
        self.device_id = device_id
        self.shuffle = bool(shuffle if plan is None else plan.shuffle)
        self.seed = int(seed if plan is None else plan.seed)
        self.drop_last = bool(drop_last if plan is None else plan.drop_last)
        self.crop = crop
        self.train = bool(train)
        self.dtype = dtype
        self.channels_last = bool(channels_last)
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.resize_ratio = float(resize_ratio)
        if plan is not None:
            self.rank, self.world_size = plan.rank, plan.world_size
        else:  # the same convention as fastload.DataLoader (None: from torch.distributed if initialised)
            self.rank, self.world_size = resolve_distributed(distributed)
        self.num_threads = int(num_threads) if num_threads else max(1, min(8, usable_cpus()))
        self.py_num_workers = max(1, int(py_num_workers))
        self.py_start_method = py_start_method
        if self._start_method() == "spawn":  # before the pack is opened or anything starts
            check_main_guard("fastload.dali.DALILoader")
        self.prefetch_queue_depth = int(prefetch_queue_depth)
        self.on_error = on_error

        self.normalization = as_normalization(normalization, mean=mean, std=std)
        rgb = (self.normalization or SCALE_ONLY).broadcast(3)  # the pipeline decodes to RGB
        self.mean, self.std = rgb.mean, rgb.std

        pack = open_pack(self.root, cache_dir=cache_dir, cache_limit=cache_limit, storage_options=storage_options,
                         endpoint_url=endpoint_url, retry_seconds=retry_seconds)
        self.remote = pack.remote  # pickles small into the source: its workers use the same node cache
        if pack.payload not in _DECODABLE and pack.payload != "raw":
            raise FormatError(f"{self.root}: payload {pack.payload!r} cannot be read by the DALI pipeline")
        self.payload = pack.payload
        self.classes = pack.classes
        index = pack.index
        self._labels = index.labels
        self._shapes = index.shapes if pack.payload == "raw" else None
        self._hw = np.ascontiguousarray(index.shapes[:, :2], dtype=np.int64)  # sizes the crop boxes
        if self._shapes is not None and len(self._shapes) and int(self._shapes[:, 2].min()) != 3:
            raise FormatError(f"{self.root}: raw records must be RGB (H, W, 3) for the DALI pipeline")
        pack.close()
        self.num_samples = len(self._labels)
        if plan is None:
            plan = EpochPlan(self.num_samples, batch_size=batch_size, seed=seed, shuffle=shuffle,
                             rank=self.rank, world_size=self.world_size, drop_last=drop_last)
        elif plan.num_samples != self.num_samples:
            raise ValueError(f"plan has num_samples={plan.num_samples} but {self.root} has {self.num_samples}")
        self.order = Order(plan)
        if len(self) == 0:
            raise ValueError(
                f"{self.root}: {self.num_samples} samples over {self.world_size} rank(s) make no "
                f"batch of {batch_size}" + (" with drop_last=True" if self.drop_last else "")
            )

        self._pipe = None
        self._iter = None
        self._pipe_next: tuple[int, int] | None = None  # (epoch, offset) the pipeline yields next

    # -- epoch bookkeeping ---------------------------------------------------------------
    def _source(self, base_epoch: int, start: int) -> PackBatchSource:
        return PackBatchSource(
            self.root, labels=self._labels, shapes=self._shapes, plan=self.order.plan,
            base_epoch=base_epoch, start=start,
            hw=self._hw, scale=self.scale if self.train else None, ratio=self.ratio, on_error=self.on_error,
            remote=self.remote, ahead=2 * (self.py_num_workers + self.prefetch_queue_depth),
        )

    @property
    def plan(self) -> EpochPlan:
        return self.order.plan

    def __len__(self) -> int:
        """Batches per epoch on this rank (a resumed epoch has :meth:`batches_left` of them left)."""
        return len(self.order)

    def batches_left(self) -> int:
        """Batches this rank still gets in the current epoch."""
        return self.order.batches_left()

    @property
    def num_padded(self) -> int:
        """How many of this rank's samples per epoch repeat other ranks' (the DDP padding,
        last in the epoch); :meth:`fastload.train.Trainer.evaluate` leaves them out. The same
        as fastload's DataLoader."""
        return self.plan.num_padded()

    def indices(self, epoch: int | None = None) -> np.ndarray:
        """The dataset indices this rank reads in ``epoch`` (default: the current pass), in batch order."""
        return self.order.indices(epoch)

    @property
    def epoch(self) -> int:
        return self.order.epoch

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` next (from its start, unless a loaded state resumes it)."""
        self.order.set_epoch(epoch)

    def state_dict(self) -> dict:
        """``{"order": ...}``, the same shape as fastload's DataLoader: a checkpoint names the
        position the same way for both backends, in global samples (elastic over world sizes)."""
        return {"order": self.order.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Resume right after the position in ``state`` (from this loader, fastload's, or a
        prefetcher around one); refuses a state from a different dataset, seed or order."""
        self.order.load_state_dict(state, what="DALILoader")

    # -- the pipeline --------------------------------------------------------------------
    def _start_method(self) -> str:
        # Spawn by default: forking is unsafe once this process holds a CUDA context (a
        # training script has one before it builds the loader), and a fresh worker inherits
        # no open LMDB/HDF5 state. The callable pickles small, so spawning costs ~1 s per build.
        return self.py_start_method or "spawn"

    def _build(self, base_epoch: int, start: int) -> None:
        self.close()
        dali = self._dali_mod
        from nvidia.dali import fn, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        source = self._source(base_epoch, start)
        gpu = self.device == "gpu"
        raw = self._shapes is not None
        crop = self.crop
        out_dtype = types.FLOAT16 if self.dtype is _torch().float16 else types.FLOAT
        rgb = (self.normalization or SCALE_ONLY).broadcast(3)
        mean, std = list(rgb.mean_255), list(rgb.std_255)  # DALI sees 0-255 pixel values
        train = self.train
        resize_to = max(crop, int(round(crop / self.resize_ratio)))
        layout = "HWC" if self.channels_last else "CHW"

        window = types.FLOAT if raw else types.INT32  # crop window: resize ROI / decoder slice

        def graph():
            outputs = fn.external_source(
                source=source, num_outputs=5 if train else 2, batch=True, batch_info=True, parallel=True,
                dtype=[types.UINT8, types.INT64, window, window, types.INT32][: 5 if train else 2],
                ndim=[3 if raw else 1, 0, 1, 1, 0][: 5 if train else 2],
                layout=["HWC" if raw else "", "", "", "", ""][: 5 if train else 2],
            )
            data, labels = outputs[:2]
            mirror = 0
            if raw:
                images = data.gpu() if gpu else data
                if train:  # the crop window is the resize's region of interest: one pass
                    start, end, mirror = outputs[2:]
                    images = fn.resize(images, size=[crop, crop], roi_start=start, roi_end=end, roi_relative=False)
            else:
                dev = "mixed" if gpu else "cpu"
                if train:  # decode only the crop window (nvJPEG / libjpeg-turbo ROI decoding)
                    start, end, mirror = outputs[2:]
                    images = fn.decoders.image_slice(
                        data, device=dev, output_type=types.RGB, axis_names="HW", start=start, end=end,
                    )
                    images = fn.resize(images, size=[crop, crop])
                else:
                    images = fn.decoders.image(data, device=dev, output_type=types.RGB)
            if not train:
                images = fn.resize(images, resize_shorter=resize_to)
            images = fn.crop_mirror_normalize(
                images, dtype=out_dtype, output_layout=layout, crop=[crop, crop], mean=mean, std=std,
                mirror=mirror,
            )
            return images, (labels.gpu() if gpu else labels)

        pipe_seed = (self.seed * 1_000_003 + self.rank * 7919 + base_epoch * 104_729 + start) % (2**31 - 1)
        pipe = dali.Pipeline(
            batch_size=self.batch_size, num_threads=self.num_threads, device_id=self.device_id,
            seed=pipe_seed, prefetch_queue_depth=self.prefetch_queue_depth,
            py_num_workers=self.py_num_workers, py_start_method=self._start_method(),
        )
        with pipe:
            images, labels = graph()
            pipe.set_outputs(images, labels)
        pipe.build()
        self._pipe = pipe
        self._iter = DALIGenericIterator(
            pipe, ["images", "targets"], last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True,
        )
        self._pipe_next = (base_epoch, start)

    def close(self) -> None:
        """Stop the pipeline and its worker processes (a later iteration starts new ones)."""
        self._iter = None
        self._pipe = None
        self._pipe_next = None
        gc.collect()  # DALI shuts the pipeline and its Python workers down when they are collected

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        order = self.order
        if order.batches_left() <= 0:  # a loaded position at an epoch's very end: an empty pass
            order.finish(order.epoch)
            return iter(())
        order.rebase()  # the pipeline is built for (epoch, global position): no batch offset
        if self._iter is None or self._pipe_next != (order.epoch, order.start):
            self._build(order.epoch, order.start)
        return self._run()

    def _run(self) -> Iterator[tuple[Any, Any]]:
        torch = _torch()
        order = self.order
        epoch = order.epoch
        finished = False
        try:
            for b, out in enumerate(self._iter):
                d = out[0]
                images, targets = d["images"], d["targets"]
                if self.channels_last:
                    images = images.permute(0, 3, 1, 2)  # NHWC memory seen as NCHW: channels_last
                if self.dtype is torch.bfloat16:
                    images = images.to(torch.bfloat16)
                order.advance(epoch, b)
                yield images, targets.to(torch.int64).view(-1)
            finished = True
        finally:
            if finished:
                # auto_reset has already started the pipeline on its next epoch
                order.finish(epoch)
                self._pipe_next = (order.epoch, 0)
            else:
                self._pipe_next = None  # broken off mid-epoch: prefetched batches are stale

    def __repr__(self) -> str:
        return (
            f"DALILoader({str(self.root)!r}, batch_size={self.batch_size}, device={self.device!r}, "
            f"train={self.train}, crop={self.crop}, rank={self.rank}/{self.world_size}, payload={self.payload!r})"
        )

    def __del__(self):
        try:
            self._iter = None
            self._pipe = None
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def _torch():
    import torch

    return torch
