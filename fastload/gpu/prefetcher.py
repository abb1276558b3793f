"""CUDAPrefetcher: overlap the host-to-device copy of batch k+1 with compute on batch k.

Wraps any iterable of batches (fastload's DataLoader, a torch DataLoader, a generator).
On CUDA each of ``depth`` buffer slots owns a side stream and an event: the batch is pinned
(if the loader did not), copied with ``non_blocking=True`` on the slot's stream, converted
from uint8 to float, normalised and made channels_last there too; the consumer's stream
waits on the slot's event, and ``record_stream`` tells the caching allocator that the
consumer stream uses the outputs, so their memory is not handed out again while a kernel
still reads it. Without CUDA the same class prefetches on a background thread and
normalises on the CPU, so one training script runs everywhere.
"""

from __future__ import annotations

import collections
import queue
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..normalization import Normalization, as_normalization, scale_shift
from .pinning import HostHold
from .transforms import _check_dtype, apply_scale_shift

__all__ = ["CUDAPrefetcher", "resolve_device"]

_END = object()


@dataclass(frozen=True)
class _Failure:
    """An exception raised by the loader, carried to the consumer thread."""

    exc: BaseException


def _map_tensors(batch: Any, fn) -> Any:
    """Apply ``fn`` to every tensor in a nested tuple/list/dict/namedtuple; keep the rest."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = [(k, _map_tensors(v, fn)) for k, v in batch.items()]
        return dict(items) if type(batch) is dict else type(batch)(items)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_map_tensors(v, fn) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_map_tensors(v, fn) for v in batch)
    return batch


def _has_cuda_tensor(batch: Any) -> bool:
    found = False

    def look(t: torch.Tensor) -> torch.Tensor:
        nonlocal found
        found = found or t.is_cuda
        return t

    _map_tensors(batch, look)
    return found


def _is_image_batch(t: torch.Tensor) -> bool:
    """uint8 ``(N, C, H, W)`` or ``(C, H, W)`` tensors are images to convert; others just move."""
    return t.dtype == torch.uint8 and t.dim() in (3, 4)


def resolve_device(device: torch.device | str | int | None) -> torch.device:
    """``None``: the current CUDA device, or the CPU without CUDA; an int is a CUDA index;
    ``"cuda"`` gets the current index. Only CUDA and CPU devices are accepted."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {dev} requested but CUDA is not available on this machine")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device must be a CUDA device or 'cpu', got {dev}")
    return dev


class CUDAPrefetcher:
    """Iterate ``loader``'s batches already on ``device``, images converted and normalised.

    Every uint8 tensor of 3 or 4 dims in a batch is taken as images ``(N, C, H, W)``: it is
    converted to ``dtype``, scaled by 1/255, normalised with ``normalization`` (a
    :class:`fastload.Normalization`, or ``mean``/``std`` in 0-1 units like torchvision's; neither:
    just ``x / 255``) and, with ``channels_last``, laid out NHWC in memory. Other tensors
    (labels, float tensors) are moved unchanged; non-tensors pass through.

    ``device=None`` uses the current CUDA device, or the CPU when CUDA is not available. On
    the CPU a thread keeps ``depth`` converted batches ready. ``len()``, ``set_epoch``,
    ``state_dict`` and ``load_state_dict`` are passed to the loader; ``state_dict`` describes
    the batches the consumer has received, not the ones prefetched ahead. When an iteration
    ends early (``break``, an exception), a loader with ``load_state_dict`` is put back to that
    position, so the next iteration re-reads the prefetched batches nobody received instead of
    skipping them (fastload's DataLoader continues an unfinished epoch).
    """

    def __init__(
        self,
        loader: Iterable,
        device: torch.device | str | int | None = None,
        *,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        normalization: Normalization | None = None,
        dtype: torch.dtype = torch.float32,
        channels_last: bool = True,
        depth: int = 2,
    ):
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {depth!r}")
        self.loader = loader
        self.device = resolve_device(device)
        self.normalization = as_normalization(normalization, mean=mean, std=std)
        self.mean = None if self.normalization is None else self.normalization.mean
        self.std = None if self.normalization is None else self.normalization.std
        self.dtype = _check_dtype(dtype)
        self.channels_last = bool(channels_last)
        self.depth = depth
        self._consts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._streams: list[torch.cuda.Stream] | None = None
        self._events: list[torch.cuda.Event] | None = None
        self._state: dict | None = None  # loader state after the last batch handed out
        self._live: weakref.ref | None = None  # the current iteration's generator


    # -- passthrough -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Forward to the loader (or to its sampler, for a plain torch DataLoader)."""
        target = self.loader if hasattr(self.loader, "set_epoch") else getattr(self.loader, "sampler", None)
        if target is None or not hasattr(target, "set_epoch"):
            raise AttributeError(f"{type(self.loader).__name__} has no set_epoch (nor does its sampler)")
        target.set_epoch(epoch)

    def batches_left(self) -> int:
        """The loader's batches left in its epoch (between iterations; while one runs, the
        loader is ``depth`` batches ahead of the consumer)."""
        if hasattr(self.loader, "batches_left"):
            return self.loader.batches_left()
        return len(self)

    def state_dict(self) -> dict:
        """``{"source": the loader's state as of the last batch this prefetcher handed out}``:
        a stage nests its source's state (the prefetcher has none of its own)."""
        if not hasattr(self.loader, "state_dict"):
            raise AttributeError(f"{type(self.loader).__name__} has no state_dict")
        return {"source": dict(self._state) if self._state is not None else self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the loader from a state of this prefetcher (or a bare loader state)."""
        if not hasattr(self.loader, "load_state_dict"):
            raise AttributeError(f"{type(self.loader).__name__} has no load_state_dict")
        self._state = None
        self.loader.load_state_dict(state["source"] if "source" in state else state)

    def _rewind(self, consumed: dict | None) -> None:
        """Put the loader back to what the consumer received (after an iteration ended early)."""
        if consumed is not None and hasattr(self.loader, "load_state_dict"):
            self.loader.load_state_dict(consumed)

    def _snapshot(self) -> dict | None:
        if hasattr(self.loader, "state_dict"):
            try:
                return self.loader.state_dict()
            except Exception:  # a loader that only answers between epochs: fall back to it
                return None
        return None

    # -- conversion --------------------------------------------------------------------
    def _constants(self, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
        consts = self._consts.get(channels)
        if consts is None:
            scale, shift = scale_shift(self.normalization, channels)
            s = torch.tensor(scale, dtype=torch.float32).view(channels, 1, 1)
            b = torch.tensor(shift, dtype=torch.float32).view(channels, 1, 1)
            if self.device.type == "cuda":
                self._ensure_streams()
                s, b = s.to(self.device), b.to(self.device)
                # Copied on whichever stream is current (a slot's side stream when called from
                # the prefetch loop) and read later on every side stream: finish the copy now,
                # and tell the allocator all side streams use them.
                torch.cuda.current_stream(self.device).synchronize()
                for st in self._streams or ():
                    s.record_stream(st)
                    b.record_stream(st)
            consts = self._consts[channels] = (s, b)
        return consts

    def _convert(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            if not t.is_cuda:
                if not t.is_pinned():
                    t = t.pin_memory()
                t = t.to(self.device, non_blocking=True)
            elif t.device != self.device:
                t = t.to(self.device, non_blocking=True)
        if not _is_image_batch(t):
            return t
        scale, shift = self._constants(t.shape[-3])
        return apply_scale_shift(t, scale, shift, dtype=self.dtype, channels_last=self.channels_last)

    def convert(self, batch: Any) -> Any:
        """Synchronous conversion of one batch (what the prefetcher does ahead of time).

        On CUDA it returns once the copies have run, so the caller may drop or refill the host
        batch at once (a loader's page-locked ring slot is not protected by torch's allocator)."""
        out = _map_tensors(batch, self._convert)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return out

    # -- iteration ---------------------------------------------------------------------
    def __iter__(self) -> Iterator:
        # One live iteration at a time: an unfinished earlier one is closed first, so its
        # thread stops and the loader is rewound before this one starts reading.
        previous = self._live() if self._live is not None else None
        if previous is not None:
            previous.close()
        self._state = None
        it = self._iter_cuda() if self.device.type == "cuda" else self._iter_cpu()
        self._live = weakref.ref(it)
        return it

    def _ensure_streams(self) -> None:
        if self._streams is None:
            with torch.cuda.device(self.device):
                self._streams = [torch.cuda.Stream(self.device) for _ in range(self.depth)]
                self._events = [torch.cuda.Event() for _ in range(self.depth)]

    def _iter_cuda(self) -> Iterator:
        self._ensure_streams()
        assert self._streams is not None and self._events is not None
        consumed = self._snapshot()  # the loader's position as of the last batch handed out
        it = iter(self.loader)
        inflight: collections.deque = collections.deque()  # (slot, device batch, loader state)
        # Host batches whose copies may still run: a loader may hand out views of its own
        # page-locked buffers (fastload's ring slots) that go back to its workers as soon as
        # the view is dropped, so each is held until its copy has completed.
        hold = HostHold()
        k = 0
        exhausted = completed = False

        def issue() -> None:
            nonlocal k, exhausted
            try:
                host = next(it)
            except StopIteration:
                exhausted = True
                return
            state = self._snapshot()
            slot = k % self.depth
            k += 1
            stream, event = self._streams[slot], self._events[slot]
            if _has_cuda_tensor(host):
                # Tensors made on the consumer's stream must be ready before the side stream
                # reads them (only then: waiting always would serialise copy and compute).
                stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                dev = _map_tensors(host, self._convert)
            event.record(stream)
            hold.hold(host, stream)
            inflight.append((slot, dev, state))

        try:
            for _ in range(self.depth):
                if exhausted:
                    break
                issue()
            while inflight:
                slot, dev, state = inflight.popleft()
                consumer = torch.cuda.current_stream(self.device)
                consumer.wait_event(self._events[slot])

                def _claim(t: torch.Tensor, consumer=consumer) -> torch.Tensor:
                    if t.is_cuda:
                        t.record_stream(consumer)
                    return t

                _map_tensors(dev, _claim)
                if not exhausted:
                    issue()
                self._state = consumed = state
                yield dev
            self._state = None
            completed = True
        finally:
            # Drop the prefetched batches and the loader's iterator (a torch DataLoader shuts
            # its workers down when its iterator goes); host buffers only once copies are done.
            inflight.clear()
            hold.drain()
            del it  # closes the loader's iterator (nothing else holds it) before the rewind
            if not completed:
                self._rewind(consumed)

    def _iter_cpu(self) -> Iterator:
        q: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()

        def put(item) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                it = iter(self.loader)
                while not stop.is_set():
                    try:
                        batch = next(it)
                    except StopIteration:
                        break
                    state = self._snapshot()
                    if not put((self.convert(batch), state)):
                        return
                put(_END)
            except BaseException as exc:  # noqa: BLE001 - carried to the consumer and re-raised
                put(_Failure(exc))

        consumed = self._snapshot()  # taken before the thread starts moving the loader
        completed = False
        thread = threading.Thread(target=produce, name="fastload-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = q.get()
                if item is _END:
                    break
                if isinstance(item, _Failure):
                    raise item.exc
                batch, state = item
                self._state = consumed = state
                yield batch
            self._state = None
            completed = True
        finally:
            stop.set()
            # Unblock a producer waiting on a full queue, then wait for it to notice `stop`
            # (it may first have to finish the `next()` it is in).
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
            thread.join()
            if not completed:
                self._rewind(consumed)

    def __repr__(self) -> str:
        return (
            f"CUDAPrefetcher({type(self.loader).__name__}, device={self.device}, dtype={self.dtype}, "
            f"mean={self.mean}, std={self.std}, channels_last={self.channels_last}, depth={self.depth})"
        )
