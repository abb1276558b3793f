"""``ImageFolder``: a map-style Dataset over a packed directory, a swap-in for torchvision's.

The index (labels, stored shapes, record paths) is read from memory maps of the pack's index
files (:class:`~fastload.storage.pack_index.PackIndex`): one physical copy per node however
many workers and ranks read it and however they were started, a pickle that carries only the
files' paths, and paths decoded one at a time when asked for. No shard is opened until a worker
reads a record; the shard readers reopen after fork.

Fastload transforms (``fastload.transforms``) are planned from the stored shape before the
record is decoded: that picks a DCT-domain downscaled JPEG decode when the crop is at least
twice the output, and lets :meth:`ImageFolder.fill_batch` resize every crop straight into its
slot of a batch buffer. Each sample's randomness comes from ``(seed, epoch, index)``.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import functools
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from ..codecs import get_codec
from ..codecs import jpeg as _jpeg
from ..codecs import jpegcrop as _jpegcrop
from ..errors import CorruptRecordError, DecodeError, FastloadError, FormatError, warn_not_built
from ..image import JpegInfo, coded_box, jpeg_info, orient, shape_problem
from ..storage import PackReader, open_pack
from ..storage.remote import is_url, runtime_started
from . import resize as _resize
from .draws import SUBSTITUTE_CANDIDATES, BatchDraws, SampleDraws, substitute_index
from .protocols import Replacement, on_error_skips
from .shm import UnsafeShmError, check_private_dir, make_owned_dir, on_terminate, remove_stale
from .transforms import Compose, Normalize, Plan, ToTensor, Transform, as_compose, fixed_output_hw

IMAGE_TYPES = ("numpy", "tensor", "pil")
DECODERS = ("auto", "cv2", "simplejpeg", "jpeg4py", "pil", "turbo-crop")
# Preference of decoder="auto" for JPEG payloads: turbo-crop (fastload's C extension, when it
# was built) decodes only the transform's crop box; then simplejpeg, the fastest full decode
# measured on the project's machines, then OpenCV (always present), then jpeg4py and PIL.
_AUTO_ORDER = ("turbo-crop", "simplejpeg", "cv2", "jpeg4py", "pil")


class SampleList(Sequence):
    """``samples`` of an ImageFolder: ``(path, class_index)`` pairs built on access from the
    pack's mapped index (no list of tuples, nor of paths, held in memory)."""

    def __init__(self, dataset: ImageFolder):
        self._ds = dataset

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for a dataset of {n}")
        return self._ds.path(i), int(self._ds._labels[i])

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"<SampleList of {len(self)} (path, class_index) pairs>"


class TargetList(Sequence):
    """``targets`` of an ImageFolder: torchvision's list of class indices, over the pack's label
    array (a list of Python ints would be copied into every worker's memory on touch).

    It behaves as the list does: items and iteration are Python ints, slices and ``+`` give
    lists, ``count``/``index``/``in`` work, and it equals a list with the same ints.
    ``np.asarray(targets)`` is the int64 array itself (no copy), for vectorised code.
    """

    __slots__ = ("_labels",)
    __hash__ = None  # a list is unhashable too

    def __init__(self, labels: np.ndarray):
        self._labels = labels

    def __len__(self) -> int:
        return len(self._labels)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._labels[i].tolist()
        return int(self._labels[i])

    def __iter__(self):
        return iter(self._labels.tolist())

    def __contains__(self, value) -> bool:
        return bool(np.any(self._labels == value))

    def count(self, value) -> int:
        return int(np.count_nonzero(self._labels == value))

    def index(self, value, start: int = 0, stop: int | None = None) -> int:
        hits = np.flatnonzero(self._labels[start:stop] == value)
        if not len(hits):
            raise ValueError(f"{value!r} is not in targets")
        return start + int(hits[0]) if start >= 0 else int(hits[0]) + len(self._labels) + start

    def tolist(self) -> list[int]:
        return self._labels.tolist()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        labels = np.asarray(self._labels)  # a multi-part pack's PartedArray concatenates here
        return labels if dtype is None else labels.astype(dtype, copy=False)

    def __eq__(self, other) -> bool:
        if isinstance(other, (TargetList, list, tuple)):
            return self.tolist() == list(other)
        return NotImplemented

    def __add__(self, other) -> list[int]:
        return self.tolist() + list(other)

    def __radd__(self, other) -> list[int]:
        return list(other) + self.tolist()

    def __repr__(self) -> str:
        return f"<TargetList of {len(self)} class indices>"


class ImageFolder:
    """A packed image folder (LMDB or HDF5, every ``--part``) as ``(image, target)`` samples.

    Same ``classes``, ``class_to_idx``, ``targets`` and ``samples`` (same order) as
    ``torchvision.datasets.ImageFolder`` on the source tree. ``targets`` acts as torchvision's
    list of ints (a :class:`TargetList` over the int64 label array; ``np.asarray`` gives the array). ``samples`` paths join
    the folder the pack was made from (recorded in its manifest) with each image's path, like
    torchvision's; pass ``source_root`` when the source tree has moved since, or ``""`` for
    paths relative to it.

    ``image_type``: ``"numpy"`` (HWC uint8, fastest), ``"tensor"`` (CHW uint8 tensor view) or
    ``"pil"`` (so an existing torchvision PIL pipeline runs unchanged). A fastload transform
    runs on the numpy array before that conversion; any other callable runs after it.

    ``decoder``: ``"auto"`` or one of cv2, simplejpeg, jpeg4py, pil, turbo-crop (JPEG
    payloads); :attr:`decoder` says which was chosen. ``turbo-crop`` (fastload's optional C
    extension, preferred by ``"auto"`` when built) decodes only the crop box a fastload
    transform will keep, with the same pixels as a full decode. ``fast_decode=True`` trades a
    little fidelity for ~10% less JPEG decode time (turbo-crop and simplejpeg: libjpeg-turbo's
    fast integer IDCT, as FFCV decodes, and merged chroma upsampling; mean difference ~1.4
    levels, more at sharp colour edges); other decoders ignore it. ``in_memory=True`` copies the pack into
    ``/dev/shm`` once per node and reads it from there (every worker and rank on the node
    shares those pages; nothing is copied per worker). The copy stays while any process
    that opened it (a rank, a spawned worker) is alive; the last one to exit removes it.

    ``root`` may be a URL (``s3://bucket/prefix``, ``gs://``, ``az://``): the pack's manifests
    and index are fetched at once, each shard on its first read (or ahead of it, when a
    fastload DataLoader announces its next batches) into the node-local shard cache
    ``cache_dir`` (default ``$FASTLOAD_CACHE_DIR`` or ``~/.cache/fastload``), at most
    ``cache_limit`` bytes of shards (default 80% of that disk's free space), shared by every
    process and rank on the node; ``storage_options``/``endpoint_url`` configure the store,
    ``retry_seconds`` bounds retries of an unreachable one (see :mod:`fastload.storage.remote_pack`).

    Every pack has labels (the packer reads an ImageFolder tree or ``path,label`` rows), so
    this class also serves non-classification data: ignore ``target``, or map it with
    ``target_transform``. There is no separate ``PackedDataset``.
    """

    def __init__(
        self,
        root: str | Path,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        *,
        image_type: str = "numpy",
        decoder: str = "auto",
        in_memory: bool = False,
        seed: int = 0,
        dct_reduce: bool = True,
        fast_decode: bool = False,
        source_root: str | Path | None = None,
        check_files: bool = True,
        cache_dir: str | Path | None = None,
        cache_limit: int | str | None = None,
        storage_options: dict | None = None,
        endpoint_url: str | None = None,
        retry_seconds: float = 60.0,
    ):
        if image_type not in IMAGE_TYPES:
            raise ValueError(f"image_type must be one of {', '.join(IMAGE_TYPES)}, got {image_type!r}")
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {', '.join(DECODERS)}, got {decoder!r}")
        remote = is_url(root)
        if remote and in_memory:
            raise ValueError(f"{root}: in_memory=True copies a local pack; a remote pack is cached on local disk "
                             "(cache_dir=, cache_limit=)")
        self.root: Path | str = str(root).rstrip("/") if remote else Path(root)
        self.in_memory = bool(in_memory)
        pack_dir = _copy_to_shm(self.root) if in_memory else self.root
        self.reader: PackReader = open_pack(pack_dir, check_files=check_files, cache_dir=cache_dir,
                                            cache_limit=cache_limit, storage_options=storage_options,
                                            endpoint_url=endpoint_url, retry_seconds=retry_seconds)
        self.reader.index  # noqa: B018 - map (and check) the index now, not in the first worker
        self.classes: list[str] = list(self.reader.classes)
        self.class_to_idx: dict[str, int] = {c: i for i, c in enumerate(self.classes)}
        self.payload = self.reader.payload
        self._codec = get_codec(self.payload)
        self.decoder = self._pick_decoder(decoder)
        self.transform = transform
        self.target_transform = target_transform
        self.image_type = image_type
        self.seed = int(seed)
        self.epoch = 0
        self.dct_reduce = bool(dct_reduce) and self.payload in ("jpeg", "original")
        self.fast_decode = bool(fast_decode)
        if source_root is None:  # where the pack was made from (older packs did not record it)
            source_root = self.reader.manifests[0].source
        self.source_root = str(source_root)
        self._fast: Compose | None = as_compose(transform)
        if self._fast is not None and self._fast.geometric and not _resize.available():
            # Said here, before workers fork (each would say it again when it first resizes).
            warn_not_built("_resize", "OpenCV resizes the crops (2-6x slower)")
        self.samples = SampleList(self)
        self.imgs = self.samples  # torchvision alias

    # -- torchvision-compatible surface -------------------------------------------------

    @property
    def targets(self) -> TargetList:
        """Class index of every sample, a list-compatible view of the label array (see :class:`TargetList`)."""
        return TargetList(self._labels)

    # The index lives in the reader: memory maps of the pack's index files, shared by every
    # process on the node (fork inherits the maps, a pickle carries only the files' paths).
    @property
    def _labels(self) -> np.ndarray:
        """int64 label of every record (a memmap; routed per part for a multi-part pack)."""
        return self.reader.index.labels

    @property
    def _shapes(self) -> np.ndarray:
        """int32 (N, 3) stored shape of every record (a memmap, like :attr:`_labels`)."""
        return self.reader.index.shapes

    def __len__(self) -> int:
        return len(self.reader)

    def path(self, i: int) -> str:
        """Source path of record ``i``: ``source_root`` joined with its path in the source tree
        (decoded from the mapped index on each call: no list of N paths is ever built)."""
        rel = self.reader.index.paths[i]
        return os.path.join(self.source_root, rel) if self.source_root else rel

    # -- packs in object storage ---------------------------------------------------------

    @property
    def worker_start_method(self) -> str | None:
        """How worker processes must start: "spawn" for a remote pack once this process has
        made object-store requests itself (their runtime does not survive fork; it has not if
        it only opened the pack and announced shards, which go through a helper process),
        else no preference. Asked when the workers start."""
        return "spawn" if self.reader.remote is not None and runtime_started() else None

    def prefetch(self, indices: np.ndarray) -> None:
        """Start downloading the shards that samples ``indices`` are in, if the pack is remote
        (a no-op for a local pack). The loader calls it for the batches a few steps ahead, so a
        warm loader never waits on the network."""
        self.reader.prefetch(indices)

    def hold_at_most(self, n: int | None) -> None:
        """Keep at most ``n`` remote shards open in each process (the loader passes its order's
        ``open_shards``)."""
        self.reader.hold_at_most(n)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch that seeds augmentation (fastload's DataLoader passes it per batch)."""
        self.epoch = int(epoch)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        img, target, _ = self.get(i, epoch=self.epoch, seed=self.seed)
        return img, target

    def get(self, i: int, *, epoch: int, seed: int, on_error: str = "raise") -> tuple[Any, Any, Replacement | None]:
        """``(image, target, replacement)`` of sample ``i`` augmented for ``epoch`` and ``seed``:
        what ``dataset[i]`` gives, without reading or changing :attr:`epoch`/:attr:`seed` (so a
        loader never mutates the user's dataset). ``on_error`` as in :meth:`fill_batch`;
        ``replacement`` says which sample was served instead of a corrupt one, else None."""
        skip = on_error_skips(on_error)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for a dataset of {n}")
        i = int(i) % n
        replacement = None
        try:
            img = self.load(i, epoch=epoch, seed=seed)
        except (DecodeError, FormatError) as exc:
            if not skip:
                raise
            seed = self.seed if seed is None else seed
            s, img = first_substitute(
                i, n, seed=seed, epoch=epoch, error=exc, attempt=lambda k: self.load(k, epoch=epoch, seed=seed)
            )
            replacement = Replacement(index=i, substitute=s, epoch=int(epoch), reason=str(exc))
            i = s  # the substitute's label goes with its image
        if self.image_type == "tensor" and isinstance(img, np.ndarray):
            import torch

            img = torch.from_numpy(img).permute(2, 0, 1)
        elif self.image_type == "pil" and isinstance(img, np.ndarray):
            from PIL import Image

            img = Image.fromarray(img[:, :, 0] if img.shape[2] == 1 else img)
        if self.transform is not None and self._fast is None:
            img = self.transform(img)
        return img, self._target(i), replacement

    def __repr__(self) -> str:
        return (
            f"fastload.ImageFolder({str(self.root)!r}, {len(self)} images, {len(self.classes)} classes, "
            f"payload={self.payload}, backend={self.reader.backend}, decoder={self.decoder})"
        )

    # -- decoding -------------------------------------------------------------------------

    def _pick_decoder(self, decoder: str) -> str:
        if self.payload == "raw":
            if decoder not in ("auto",):
                raise ValueError(f"{self.root}: raw payloads need no decoder (got decoder={decoder!r})")
            return "none"
        if self.payload in ("bmp", "png"):
            if decoder not in ("auto", "cv2"):
                raise ValueError(f"{self.root}: {self.payload} payloads are decoded with cv2 (got {decoder!r})")
            return "cv2"
        if decoder == "auto" and not _jpegcrop.available():
            warn_not_built("_jpegcrop", "JPEGs are decoded whole instead of only the crop", stacklevel=4)
        if self.payload == "original" and decoder == "auto":
            # OpenCV reads every format. turbo-crop takes the JPEGs (turned by fastload's
            # orientation rule, see _decode_original) and hands CMYK back to OpenCV.
            return "turbo-crop" if _jpegcrop.available() else "cv2"
        if decoder != "auto":
            _check_decoder(decoder)
            return decoder
        for name in _AUTO_ORDER:
            try:
                _check_decoder(name)
                # A decoder can import yet fail to decode (jpeg4py without libturbojpeg): try
                # it on a tiny JPEG of our own, so no shard is opened before the workers fork.
                _jpeg.decode(_probe_jpeg(), backend=name)
                return name
            except Exception:
                continue
        return "cv2"  # pragma: no cover - cv2 always imports

    def _rng(self, epoch: int, i: int, seed: int | None = None) -> SampleDraws:
        """Sample ``i``'s random numbers in ``epoch`` (see :mod:`fastload.data.draws`)."""
        return SampleDraws.single(self.seed if seed is None else seed, epoch, i)

    def stored_hw(self, i: int) -> tuple[int, int]:
        """(H, W) the index stores for record ``i``: every plan's box is placed by it, so every
        decode is checked against it (a mismatch is a DecodeError naming the record)."""
        s = self._shapes[i]
        return int(s[0]), int(s[1])

    def decode(self, i: int, *, reduce: int = 1) -> np.ndarray:
        """Record ``i`` decoded to HWC uint8 RGB (a read-only view for raw payloads).

        Errors name the shard file, the record in it and its source path.
        """
        try:
            buf = self.reader.get(i)
        except (FormatError, OSError) as exc:
            raise self._read_error(i, exc) from None
        return self._decode_bytes(i, buf, reduce)

    def _decode_bytes(self, i: int, buf, reduce: int) -> np.ndarray:
        """:meth:`decode` of record ``i``'s bytes ``buf``. The decoded shape must be the
        index's (every crop box is planned from it): a DecodeError naming the record if not."""
        shape = tuple(int(v) for v in self._shapes[i])
        try:
            if self.payload == "jpeg":
                img = _jpeg.decode(buf, backend=self.decoder, reduce=reduce, fast=self.fast_decode)
            elif self.payload == "original":
                img = self._decode_original(buf, reduce)
            else:
                img = self._codec.decode(buf, shape=shape)
        except MemoryError:  # not about the record: on_error="skip" must not hide it
            raise
        except Exception as exc:  # decoders fail on bad bytes with many types (cv2.error, OSError, ...)
            raise self._decode_error(i, exc) from None
        problem = shape_problem(img.shape, shape, reduce=reduce)
        if problem is not None:
            raise self._decode_error(i, problem)
        return img

    def _decode_error(self, i: int, exc: Exception) -> DecodeError:
        return decode_error(self.reader, i, exc, source=self._source_for_error(i))

    def _read_error(self, i: int, exc: Exception) -> FormatError:
        return read_error(self.reader, i, exc, source=self._source_for_error(i))

    def _source_for_error(self, i: int) -> str:
        """``path(i)``, or what to say when the index file's paths cannot be trusted (an error
        about a record must stay that error, not become one about the index)."""
        try:
            return self.path(i)
        except FormatError:
            return "unknown: the index file is damaged"


    def _run_plan(self, i: int, plan: Plan, hw: tuple[int, int], dst: np.ndarray | None = None) -> np.ndarray:
        """Decode record ``i`` and run ``plan`` on it. With turbo-crop only the plan's box is
        decoded (same pixels as cutting it from a full decode at the same scale); the box comes
        from the index's shape, so the JPEG header's size must equal it (else a DecodeError
        naming the record: cropping by a wrong shape would stretch the wrong pixels)."""
        reduce = plan.reduce_for(hw) if self.dct_reduce else 1
        if self.decoder != "turbo-crop":
            return plan.execute(self.decode(i, reduce=reduce), hw, dst=dst)
        try:
            buf = self.reader.get(i)
        except (FormatError, OSError) as exc:
            raise self._read_error(i, exc) from None
        crop, orientation = None, 1
        try:
            if self.payload == "jpeg":  # fastload's encoder writes no EXIF: upright as coded
                info: JpegInfo | None = JpegInfo(*_jpegcrop.header(buf)[:2], 1)
            else:  # an original: a JPEG (turned by its EXIF orientation), else the full decode below
                info = jpeg_info(buf)
            if info is not None:
                orientation = info.orientation
                problem = info.shape_problem(hw)
                if problem is not None:
                    raise DecodeError(problem)
                H, W = _jpegcrop.scaled_hw(*hw, reduce)
                t, l, bh, bw = box = plan.box_in(H, W, hw)
                if t >= 0 and l >= 0 and t + bh <= H and l + bw <= W:
                    # The same box of the image as coded, turned after: only it is decoded.
                    box = coded_box(box, (H, W), orientation)
                    # Into a reused buffer when the crop is resized into dst at once.
                    out = None if dst is None else _jpegcrop.scratch(_jpegcrop.out_bytes(box[2], box[3]))
                    crop = _jpegcrop.decode_crop(buf, box, reduce=reduce, out=out, fast=self.fast_decode)
        except MemoryError:
            raise
        except Exception as exc:
            raise self._decode_error(i, exc) from None
        if crop is not None:  # outside the try: a resize bug is not a corrupt record
            return plan.finish(orient(crop, orientation), dst=dst)
        # a box reaching outside the image (padding), or an original that is no JPEG
        return plan.execute(self._decode_bytes(i, buf, reduce), hw, dst=dst)

    def _decode_original(self, buf, reduce: int) -> np.ndarray:
        # simplejpeg, jpeg4py, PIL's raw decode and turbo-crop decode a JPEG as coded: turn it
        # here by fastload's orientation rule (image.jpeg_info), which the packer sized it by
        # and the codec applies to OpenCV's decode too. Other formats go to the codec.
        if self.decoder != "cv2":
            info = jpeg_info(buf)
            if info is not None:
                img = _jpeg.decode(buf, backend=self.decoder, reduce=reduce, fast=self.fast_decode)
                return orient(img, info.orientation)
        return self._codec.decode(buf, reduce=reduce)

    def load(self, i: int, *, epoch: int = 0, seed: int | None = None) -> Any:
        """Record ``i`` decoded and passed through the fastload transform (if any)."""
        fast = self._fast
        if fast is not None and fast._n_geometric:
            rng = self._rng(epoch, i, seed)
            hw = self.stored_hw(i)
            plan = fast.plan(hw, rng)
            return fast.apply_tail(self._run_plan(i, plan, hw), rng)
        img = self.decode(i)
        if not img.flags.writeable:  # a raw view into the shard's memory map: give an owned copy
            img = img.copy()
        if fast is not None:
            img = fast.apply_tail(img, self._rng(epoch, i, seed))
        return img

    def _target(self, i: int):
        t = int(self._labels[i])
        return self.target_transform(t) if self.target_transform is not None else t

    # -- the batched fast path the DataLoader uses ---------------------------------------

    def batch_image_shape(self) -> tuple[int, int, int] | None:
        """(H, W, 3) of every sample when it is fixed and :meth:`fill_batch` can make it,
        else None (the DataLoader then falls back to per-sample loading)."""
        if self.transform is None:
            shape = self.reader.image_shape
            if shape is None and len(self):
                lo, hi = self._shapes.min(axis=0), self._shapes.max(axis=0)  # no N-sized temporary
                if (lo == hi).all():
                    shape = tuple(int(s) for s in lo)
            return tuple(shape) if shape is not None else None
        if self._fast is None or not self._fast.geometric:
            return None
        hw = fixed_output_hw(self._fast)
        if hw is None:
            return None
        channels = int(self._shapes[0][2]) if len(self) else 3
        return (hw[0], hw[1], channels)

    def fill_batch(
        self, indices: np.ndarray, images: np.ndarray, targets: np.ndarray, *, epoch: int, seed: int | None = None,
        on_error: str = "raise",
    ) -> list[Replacement] | None:
        """Decode, crop and resize samples ``indices`` straight into ``images[j]`` (N, H, W, C
        uint8) and their labels into ``targets[j]``: no per-sample array survives. Pixels are
        the same as ``load(i, epoch=epoch, seed=seed)`` gives.

        A record that cannot be read or decoded (:class:`DecodeError`/:class:`FormatError`
        naming its shard, record and source) stops the batch with ``on_error="raise"``. With
        ``"skip"`` its slot gets the first readable of its substitutes
        (:func:`~fastload.data.draws.substitute_index`: deterministic, so a rerun or resume serves
        the same batch), with that sample's own augmentation and label; returns one
        :class:`Replacement` per replaced slot, None when there was none.
        """
        skip = on_error_skips(on_error)
        fast = self._fast
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        self.reader.hold_only(idx)  # a remote pack: unpin the shards of earlier batches
        seed = self.seed if seed is None else int(seed)
        draws = BatchDraws(seed, epoch, idx) if fast is not None else None
        shapes = self._shapes[idx, :2].tolist()  # per batch, not per sample: numpy indexing costs
        replaced: list[Replacement] | None = None
        for j, (i, hw) in enumerate(zip(idx.tolist(), shapes)):
            hw = (hw[0], hw[1])
            plan = fast.plan(hw, draws.sample(j)) if draws is not None else Plan.identity(hw)
            try:
                self._run_plan(i, plan, hw, dst=images[j])
            except (DecodeError, FormatError) as exc:
                if not skip:
                    raise
                if replaced is None:
                    replaced, idx = [], idx.copy()  # idx[j] becomes what slot j serves (for its label)
                s, _ = first_substitute(
                    i, len(self), seed=seed, epoch=epoch, error=exc,
                    attempt=lambda s, dst=images[j]: self._fill_slot(s, dst, epoch=epoch, seed=seed),
                )
                idx[j] = s
                replaced.append(Replacement(index=i, substitute=s, epoch=int(epoch), reason=str(exc)))
        if self.target_transform is None:
            targets[: len(idx)] = self._labels[idx]
        else:
            for j, i in enumerate(idx.tolist()):
                targets[j] = self._target(i)
        return replaced

    def _fill_slot(self, i: int, dst: np.ndarray, *, epoch: int, seed: int) -> None:
        """Sample ``i`` into batch slot ``dst`` with its own draws (a substitute's fill)."""
        hw = self.stored_hw(i)
        fast = self._fast
        plan = fast.plan(hw, self._rng(epoch, i, seed)) if fast is not None else Plan.identity(hw)
        self._run_plan(i, plan, hw, dst=dst)

    def ring_blocker(self) -> str | None:
        """Why :meth:`batch_image_shape` is None, so the DataLoader decodes sample by sample:
        one sentence naming the transform (or the pack) responsible and what to do instead.
        None when batches are filled in place. (``image_type`` plays no part: the ring path
        fills uint8 arrays whatever it is.)"""
        if self.batch_image_shape() is not None:
            return None
        if self.transform is None:
            if not len(self):
                return f"{self.root} holds no images"
            sizes = np.unique(self._shapes, axis=0).tolist()
            shown = ", ".join(f"{h}x{w}x{c}" for h, w, c in sizes[:3]) + (", ..." if len(sizes) > 3 else "")
            return (
                f"the pack's images have different sizes ({shown}): add a transform that fixes the size "
                "(fastload.transforms.RandomResizedCrop or Resize + CenterCrop), or pack with --size HxW"
            )
        fast = self._fast
        if fast is None:
            return (
                f"transform {_transform_name(self.transform)} is not a fastload transform: a torchvision/other "
                "callable transform runs per sample: use fastload.transforms for geometric ops"
            )
        if not fast.geometric:
            return _per_sample_reason(fast)
        names = ", ".join(_transform_name(t) for t in _flat(fast.transforms))
        return (
            f"the output size of {names} depends on each image's stored size (Resize(int) keeps the aspect "
            "ratio): add a CenterCrop or RandomResizedCrop so every sample has one size"
        )

    # -- pickling -------------------------------------------------------------------------

    def __getstate__(self):
        # Small whatever the pack's size: the reader pickles its index as the files' paths.
        return self.__dict__.copy()

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        if self.in_memory:  # a spawned worker or another process: count as a user of the copy
            _copy_to_shm(self.root)


# -- corrupt records: naming them, the policy, substitutes (shared with gpu/dali.py) ----------

_T = TypeVar("_T")


def describe_record(reader: PackReader, i: int, *, source: str | None = None) -> str:
    """``"<shard file>: record <j> (dataset index <i>, source '<path>')"``: how every error about
    one record names it, so the user can find the shard, the record in it and its source image.
    ``source`` defaults to the pack's recorded source folder joined with the record's path."""
    k, j = reader.locate(i)
    if source is None:
        try:
            rel = reader.index.paths[i]
        except FormatError:  # the index file's paths cannot be trusted: the record error stays one
            rel = None
        root = reader.manifests[0].source
        source = "unknown: the index file is damaged" if rel is None else os.path.join(root, rel) if root else rel
    return f"{reader.shard_name(k)}: record {j} (dataset index {i}, source {source!r})"


def read_error(reader: PackReader, i: int, exc: Exception | str, *, source: str | None = None) -> FormatError:
    """Record ``i``'s bytes could not be read (damaged LMDB page, missing key, HDF5 read error),
    or do not match their checksum (a :class:`CorruptRecordError`, kept as such)."""
    if isinstance(exc, CorruptRecordError):
        return CorruptRecordError(f"{describe_record(reader, i, source=source)}: {exc.detail}", detail=exc.detail)
    return FormatError(f"{describe_record(reader, i, source=source)} could not be read: {exc}")


def decode_error(reader: PackReader, i: int, exc: Exception | str, *, source: str | None = None) -> DecodeError:
    """Record ``i``'s bytes are not a valid image of the pack's payload codec."""
    return DecodeError(f"{describe_record(reader, i, source=source)} could not be decoded as {reader.payload}: {exc}")


def first_substitute(
    i: int, n: int, *, seed: int, epoch: int, error: Exception, attempt: Callable[[int], _T]
) -> tuple[int, _T]:
    """``(s, attempt(s))`` for the first substitute ``s`` of corrupt record ``i`` (of ``n``) that
    reads: candidates from :func:`~fastload.data.draws.substitute_index`, tried in order, one
    that fails too (DecodeError/FormatError) is passed over. ``error`` is record ``i``'s; when
    every candidate fails, a DecodeError repeats it and says the substitutes failed too."""
    tried: list[int] = []
    for k in range(SUBSTITUTE_CANDIDATES if n > 1 else 0):
        s = substitute_index(seed, epoch, i, k, n)
        try:
            return s, attempt(s)
        except (DecodeError, FormatError):
            tried.append(s)
    if not tried:
        raise DecodeError(f"{error}; on_error='skip' found no other record to serve in its place") from None
    raise DecodeError(
        f"{error}; on_error='skip' tried {len(tried)} substitutes for it (dataset indices "
        f"{', '.join(map(str, tried))}) and none could be read either (is the pack damaged? run fastload verify)"
    ) from None


def _transform_name(t: Any) -> str:
    """``fastload.transforms.Normalize`` for fastload's own, ``module.Class`` for the rest."""
    cls = type(t)
    module = "fastload.transforms" if cls.__module__ == Transform.__module__ else cls.__module__
    return f"{module}.{cls.__qualname__}"


def _flat(transforms: Sequence[Any]) -> list[Any]:
    """The transforms of a pipeline with nested fastload Composes opened up."""
    out: list[Any] = []
    for t in transforms:
        out.extend(_flat(t.transforms) if isinstance(t, Compose) else [t])
    return out


def _per_sample_reason(fast: Compose) -> str:
    """:meth:`ImageFolder.ring_blocker` for a fastload pipeline with non-geometric steps."""
    steps = [t for t in _flat(fast.transforms) if not getattr(t, "geometric", False)]
    if not steps:
        return "the transform is an empty Compose: pass transform=None"
    foreign = [t for t in steps if not isinstance(t, Transform)]
    floats = [t for t in steps if isinstance(t, (Normalize, ToTensor))]
    other = [t for t in steps if isinstance(t, Transform) and not isinstance(t, (Normalize, ToTensor))]

    def names(ts: list[Any]) -> str:
        return " and ".join(dict.fromkeys(_transform_name(t) for t in ts))  # once each, in order

    reasons = []
    if foreign:
        reasons.append(f"{names(foreign)} in the Compose: a torchvision/other callable transform runs per sample: "
                       "use fastload.transforms for geometric ops")
    if floats:
        reasons.append(f"{names(floats)} runs per sample on float images: drop it and normalise on the GPU "
                       "(CUDAPrefetcher / fastload.Normalization)")
    if other:
        reasons.append(f"{names(other)} runs per sample on each decoded image: drop it, or do its work on the "
                       "GPU on whole batches")
    return "; ".join(reasons)


@functools.lru_cache(maxsize=1)
def _probe_jpeg() -> bytes:
    return _jpeg.encode(np.full((16, 16, 3), 128, np.uint8), quality=90)


def _check_decoder(name: str) -> None:
    if name == "turbo-crop":
        _jpegcrop.require()
    elif name == "simplejpeg":
        from ..errors import require

        require("simplejpeg", "simplejpeg", "the simplejpeg decoder")
    elif name == "jpeg4py":
        _jpeg._jpeg4py()


# -- in_memory: one copy of the pack per node, in /dev/shm --------------------------------
#
# The copy is named after the pack (its resolved path and manifests), so every process on the
# node that asks for the same pack finds the same directory. Each user holds a shared flock on
# a lock file next to it for as long as it lives (forked workers inherit it; spawned workers
# take their own when the dataset is unpickled). At exit (or SIGTERM) a user closes its lock
# and tries an exclusive one: only the last user gets it, and removes the copy. Whoever
# arrives first makes the copy (in a private temporary directory renamed into place, so nobody
# reads half a copy). A copy nobody holds is a leftover (its users were SIGKILLed): the next
# process that attaches any copy removes it.
#
# The name is predictable and /dev/shm is writable by everyone, so another user could plant
# it (a directory of their own data, a symlink): the copy and its lock file are used only when
# they are ours, not symlinks, and not writable by others (.shm.check_private_dir), checked
# with lstat/fstat before anything is read.

_SHM = Path("/dev/shm")
_attached: dict[Path, tuple[int, int]] = {}  # copy -> (pid that attached, lock fd)


def _shm_name(root: Path) -> Path:
    manifests = sorted(root.glob("manifest*.json"))
    if not manifests:
        raise FormatError(f"{root}: no manifest (not a fastload pack, or its packing never finished)")
    h = hashlib.sha256(str(root.resolve()).encode())
    for m in manifests:
        h.update(m.read_bytes())
    return _SHM / f"fastload-{os.getuid()}-{h.hexdigest()[:16]}"


def _lock_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".lock")


def _open_lock(lock: Path, flags: int) -> int:
    """Open the lock file without following a symlink, refusing one another user planted."""
    try:
        fd = os.open(lock, flags | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeShmError(f"{lock}: in_memory lock file is a symlink: refusing to use it "
                                 "(another user may have planted it); remove it") from None
        raise
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        os.close(fd)
        raise UnsafeShmError(f"{lock}: in_memory lock file is owned by uid {st.st_uid} (mode "
                             f"{st.st_mode & 0o777:o}), not privately by this user: refusing to use it; remove it")
    return fd


def _lock_shared(dest: Path) -> int:
    """A shared flock on the copy's lock file (retrying if the last user removed that file
    between our open and our lock)."""
    lock = _lock_path(dest)
    while True:
        fd = _open_lock(lock, os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.stat(lock, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _copy_to_shm(root: Path) -> Path:
    """The pack's node-wide copy in /dev/shm, made if missing; this process counts as a user
    of it until it exits (see the comment above for who removes it)."""
    if not _SHM.is_dir():
        raise FastloadError("in_memory=True needs /dev/shm (a Linux tmpfs); read from disk instead")
    dest = _shm_name(root)
    pid = os.getpid()
    if dest not in _attached or _attached[dest][0] != pid:
        if not any(p == pid for p, _ in _attached.values()):  # once per process
            _remove_unused_copies(keep=dest)
            on_terminate(_remove_shm_copies)
        _attached[dest] = (pid, _lock_shared(dest))
    try:
        if os.path.lexists(dest):
            check_private_dir(dest, "in_memory copy")
        if not (dest / ".complete").exists():
            _make_copy(root, dest)
            check_private_dir(dest, "in_memory copy")
    except UnsafeShmError:
        _detach(dest, _attached.pop(dest)[1])
        raise
    return dest


def _make_copy(root: Path, dest: Path) -> None:
    files = [p for p in root.iterdir() if p.is_file() and not p.name.startswith(".")]
    need = sum(p.stat().st_size for p in files)
    free = shutil.disk_usage(_SHM).free
    if need > free * 0.9:
        raise FastloadError(
            f"in_memory=True: {root} needs {need / 2**30:.1f} GiB but /dev/shm has {free / 2**30:.1f} GiB free"
        )
    prefix = dest.name + ".tmp"
    remove_stale(str(_SHM), prefix)  # half copies of SIGKILLed processes
    tmp_s, fd = make_owned_dir(prefix, str(_SHM))  # mode 0700, an unpredictable name
    tmp = Path(tmp_s)
    try:
        for p in files:
            shutil.copyfile(p, tmp / p.name)
        (tmp / ".complete").touch()
        os.rename(tmp, dest)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if (dest / ".complete").exists():  # another process on this node won the race (or planted it: checked next)
            return
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # filled up meanwhile (another copy, a ring)
            free = shutil.disk_usage(_SHM).free
            raise FastloadError(f"in_memory=True: /dev/shm filled up while copying {root} ({need / 2**30:.2f} GiB; "
                                f"{free / 2**20:,.1f} MB free now): read from disk instead, or give the "
                                "container more shared memory (docker run --shm-size=...)") from None
        raise
    finally:
        os.close(fd)


def _remove_if_unused(dest: Path) -> None:
    """Remove the copy if no process (or inherited descriptor) holds its lock."""
    lock = _lock_path(dest)
    try:
        probe = _open_lock(lock, 0)
    except (FileNotFoundError, UnsafeShmError):
        return
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another user is still alive: the last one removes it
        os.close(probe)
        return
    try:
        try:
            if os.path.lexists(dest):
                check_private_dir(dest, "in_memory copy")
                (dest / ".complete").unlink(missing_ok=True)
                shutil.rmtree(dest, ignore_errors=True)
        except UnsafeShmError:  # not ours: never touch it; our lock file goes
            pass
        lock.unlink(missing_ok=True)
    finally:
        os.close(probe)


def _detach(dest: Path, fd: int) -> None:
    """Stop using the copy; remove it if no other process (or inherited descriptor) holds it."""
    os.close(fd)
    _remove_if_unused(dest)


def _remove_unused_copies(keep: Path) -> None:
    """Remove this user's copies that nobody uses (left behind by SIGKILLed processes)."""
    for lock in _SHM.glob(f"fastload-{os.getuid()}-*.lock"):
        dest = lock.with_name(lock.name[: -len(".lock")])
        if dest != keep and dest not in _attached:
            _remove_if_unused(dest)


@atexit.register
def _remove_shm_copies() -> None:
    for dest, (pid, fd) in list(_attached.items()):
        if pid == os.getpid():  # a forked child shares its parent's lock; it does not detach
            _detach(dest, fd)
    _attached.clear()
