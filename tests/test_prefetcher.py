"""CUDAPrefetcher: the CPU path for real here; the CUDA path in tests marked ``cuda``."""

from __future__ import annotations

import collections
import gc
import threading
import time

import pytest
import torch

from fastload.gpu.prefetcher import CUDAPrefetcher
from fastload.gpu.transforms import IMAGENET_MEAN, IMAGENET_STD, normalize

MEAN = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
STD = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)


def _images(i: int, n: int = 4, h: int = 6, w: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (n, 3, h, w), dtype=torch.uint8, generator=g)


def _reference(x: torch.Tensor) -> torch.Tensor:
    return (x.double() / 255 - MEAN.double()) / STD.double()


class StatefulLoader:
    """A loader with the fastload DataLoader's surface: len, set_epoch, state_dict."""

    def __init__(self, n: int = 6):
        self.n = n
        self.epoch = 0
        self.pos = 0
        self.live_threads: list[threading.Thread] = []

    def __len__(self) -> int:
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        self.pos = 0
        for i in range(self.n):
            self.pos = i + 1
            yield _images(1000 * self.epoch + i), torch.full((4,), 1000 * self.epoch + i, dtype=torch.int64)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "fastload-prefetch"]


def test_cpu_path_normalises_and_keeps_order():
    batches = [(_images(i), torch.arange(4) + i) for i in range(5)]
    p = CUDAPrefetcher(batches, mean=IMAGENET_MEAN, std=IMAGENET_STD)
    assert p.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    out = list(CUDAPrefetcher(batches, "cpu", mean=IMAGENET_MEAN, std=IMAGENET_STD))
    assert len(out) == 5
    for (x, y), (xo, yo) in zip(batches, out):
        assert xo.dtype == torch.float32 and xo.shape == x.shape
        assert xo.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(xo.double(), _reference(x), atol=1e-5, rtol=0)
        assert yo.dtype == torch.int64 and torch.equal(yo, y)


def test_no_mean_std_scales_to_unit_range():
    x = torch.tensor([0, 51, 255], dtype=torch.uint8).view(1, 3, 1, 1)
    (out,) = list(CUDAPrefetcher([x], "cpu", channels_last=False))
    assert out.flatten().tolist() == pytest.approx([0.0, 0.2, 1.0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtypes(dtype):
    x = _images(3)
    (out,) = list(CUDAPrefetcher([x], "cpu", mean=IMAGENET_MEAN, std=IMAGENET_STD, dtype=dtype))
    assert out.dtype == dtype
    # float32 arithmetic then one rounding: within half an ulp of the exact result.
    ref = _reference(x).to(dtype)
    assert torch.equal(out, ref) or (out.double() - ref.double()).abs().max() <= (ref.double().abs().max() * 2**-7)


def test_nested_batches_tuple_list_dict_namedtuple():
    Pair = collections.namedtuple("Pair", "image label")
    batch = {
        "img": _images(0),
        "nested": [Pair(_images(1), torch.tensor([1, 2])), ("text", 7)],
        "floats": torch.ones(2, 3, 4, 4),
        "mask": torch.zeros(4, 3, 2, dtype=torch.uint8),  # 3-D uint8 counts as (C, H, W) images
    }
    (out,) = list(CUDAPrefetcher([batch], "cpu", channels_last=False))
    assert set(out) == set(batch)
    torch.testing.assert_close(out["img"], batch["img"].float() / 255)
    pair = out["nested"][0]
    assert isinstance(pair, Pair) and pair.image.dtype == torch.float32
    assert torch.equal(pair.label, torch.tensor([1, 2]))
    assert out["nested"][1] == ("text", 7)
    assert isinstance(out["nested"], list) and isinstance(out["nested"][1], tuple)
    assert out["floats"].dtype == torch.float32 and torch.equal(out["floats"], batch["floats"])
    assert out["mask"].dtype == torch.float32


def test_reiteration_and_set_epoch_passthrough():
    loader = StatefulLoader(n=3)
    p = CUDAPrefetcher(loader, "cpu")
    assert len(p) == 3
    seen = []
    for epoch in range(3):
        p.set_epoch(epoch)
        seen.append([int(y[0]) for _, y in p])
    assert seen == [[0, 1, 2], [1000, 1001, 1002], [2000, 2001, 2002]]
    assert not _prefetch_threads()


def test_set_epoch_reaches_a_torch_sampler():
    ds = torch.utils.data.TensorDataset(torch.arange(8))
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=0)
    p = CUDAPrefetcher(torch.utils.data.DataLoader(ds, batch_size=2, sampler=sampler), "cpu")
    p.set_epoch(5)
    assert sampler.epoch == 5
    with pytest.raises(AttributeError, match="set_epoch"):
        CUDAPrefetcher([1, 2], "cpu").set_epoch(1)


def test_state_dict_describes_consumed_batches_not_prefetched_ones():
    loader = StatefulLoader(n=6)
    p = CUDAPrefetcher(loader, "cpu", depth=3)
    assert p.state_dict() == {"source": {"epoch": 0, "pos": 0}}  # a stage nests its source's state
    it = iter(p)
    next(it)
    next(it)
    deadline = time.monotonic() + 10
    while loader.pos < 5 and time.monotonic() < deadline:  # the thread runs ahead...
        time.sleep(0.01)
    assert loader.pos >= 5
    assert p.state_dict() == {"source": {"epoch": 0, "pos": 2}}  # ...but the state is what we consumed
    it.close()
    assert p.state_dict() == {"source": {"epoch": 0, "pos": 2}}
    p.load_state_dict({"source": {"epoch": 4, "pos": 1}})
    assert loader.epoch == 4 and p.state_dict() == {"source": {"epoch": 4, "pos": 1}}
    p.load_state_dict({"epoch": 2, "pos": 0})  # a bare loader state loads too
    assert loader.epoch == 2


class _Numbers(torch.utils.data.Dataset):
    """Sample i is a 3x2x2 uint8 image filled with i, label i."""

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int):
        return torch.full((3, 2, 2), i, dtype=torch.uint8), i


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("depth", [1, 3])
def test_early_break_then_reiteration_loses_no_prefetched_batch(depth, device):
    """fastload's DataLoader continues an unfinished epoch; the batches the prefetcher had
    taken ahead but nobody received must come again, and the state must agree."""
    from fastload.data.loader import DataLoader

    loader = DataLoader(_Numbers(), 4, shuffle=True, seed=2, num_workers=0, pin_memory=False)
    order = loader.plan.indices(0).tolist()
    p = CUDAPrefetcher(loader, device, depth=depth)
    got = []
    for i, (_, y) in enumerate(p):
        got += y.tolist()
        if i == 1:
            break
    assert loader.state_dict() == p.state_dict()["source"]
    assert loader.state_dict()["order"]["position"] == 2 * 4
    with pytest.raises(RuntimeError, match="step failed"):
        for _, y in p:  # one more batch, then the consumer fails
            got += y.tolist()
            raise RuntimeError("the training step failed")
    assert loader.state_dict()["order"]["position"] == 3 * 4
    got += [t for _, y in p for t in y.tolist()]
    assert got == order  # every sample once, in the sampler's order
    assert loader.epoch == 1 and p.state_dict()["source"]["order"]["position"] == 0


def test_a_new_iteration_closes_an_unfinished_one_first():
    from fastload.data.loader import DataLoader

    loader = DataLoader(_Numbers(), 4, shuffle=False, num_workers=0)
    p = CUDAPrefetcher(loader, "cpu", depth=2)
    old = iter(p)  # held, never closed by the caller
    first = next(old)[1].tolist()
    rest = [t for _, y in p for t in y.tolist()]
    assert first + rest == list(range(30))  # nothing skipped, nothing read twice
    assert not _prefetch_threads()
    with pytest.raises(StopIteration):
        next(old)


def test_early_break_stops_the_thread_and_the_loader():
    produced = []

    def endless():
        i = 0
        while True:
            produced.append(i)
            yield _images(i)
            i += 1

    p = CUDAPrefetcher(endless(), "cpu", depth=2)
    for i, _ in enumerate(p):
        if i == 3:
            break
    gc.collect()
    assert not _prefetch_threads()
    n = len(produced)
    time.sleep(0.2)
    assert len(produced) == n  # nothing runs any more
    assert n <= 4 + 2 + 1  # consumed + queue depth + the one being put


def test_loader_exception_surfaces_in_the_consumer():
    def bad():
        yield _images(0)
        raise RuntimeError("shard-00003.lmdb: record 17 is corrupt")

    p = CUDAPrefetcher(bad(), "cpu")
    it = iter(p)
    assert next(it).shape == (4, 3, 6, 5)
    with pytest.raises(RuntimeError, match="record 17 is corrupt"):
        next(it)
    gc.collect()
    assert not _prefetch_threads()


def test_over_plain_torch_dataloader_with_workers():
    imgs = torch.randint(0, 256, (10, 3, 8, 8), dtype=torch.uint8)
    ds = torch.utils.data.TensorDataset(imgs, torch.arange(10))
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, shuffle=False)
    p = CUDAPrefetcher(loader, "cpu", mean=IMAGENET_MEAN, std=IMAGENET_STD)
    for _ in range(2):  # two epochs
        xs, ys = zip(*p)
        assert [len(y) for y in ys] == [4, 4, 2]
        torch.testing.assert_close(torch.cat(xs).double(), _reference(imgs), atol=1e-5, rtol=0)
        assert torch.equal(torch.cat(ys), torch.arange(10))
    # early break with live workers must not hang
    for _ in p:
        break
    gc.collect()
    assert not _prefetch_threads()


def test_over_a_generator_and_len_error():
    p = CUDAPrefetcher((_images(i) for i in range(3)), "cpu")
    assert len(list(p)) == 3
    with pytest.raises(TypeError):
        len(p)


def test_bad_arguments():
    with pytest.raises(ValueError, match="depth"):
        CUDAPrefetcher([], "cpu", depth=0)
    with pytest.raises(ValueError, match="floating"):
        CUDAPrefetcher([], "cpu", dtype=torch.int32)
    with pytest.raises(ValueError, match="std"):
        CUDAPrefetcher([], "cpu", std=(0.2, 0.0, 0.1))
    with pytest.raises(ValueError, match="channels"):
        list(CUDAPrefetcher([_images(0)], "cpu", mean=(0.1, 0.2)))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            CUDAPrefetcher([], "cuda")


# --- CUDA (skipped without a GPU; never faked) ----------------------------------------


def _host_batches(n: int, size: int = 64, batch: int = 32, pinned: bool = False):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=g)
        y = torch.randint(0, 1000, (batch,), generator=g)
        out.append((x.pin_memory(), y.pin_memory()) if pinned else (x, y))
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_prefetch_equals_synchronous_conversion_bit_for_bit(dtype):
    """The sync-vs-async race check: many batches against synchronous ``.cuda()`` + the same
    normalisation, with nothing in the loop synchronising the host. Pinned inputs let the
    host queue copies as fast as it likes. First pass: the consumer reads each batch at once,
    while later copies run (a missing wait on the slot's event reads a half-written batch).
    Second pass: the consumer stream is kept busy before each read and every batch is dropped
    right after its read is queued (without ``record_stream`` the allocator hands that memory
    to a later copy, which overwrites it before the read runs)."""
    batches = _host_batches(24, size=224, batch=64, pinned=True)
    ref = [normalize(x.cuda(), mean=IMAGENET_MEAN, std=IMAGENET_STD, dtype=dtype, channels_last=True)
           for x, _ in batches]
    p = CUDAPrefetcher(batches, "cuda", mean=IMAGENET_MEAN, std=IMAGENET_STD, dtype=dtype, depth=3)
    for busy in (False, True):
        got = []
        for xo, yo in p:
            if busy:
                torch.cuda._sleep(20_000_000)  # a real kernel spinning ~10 ms on the consumer stream
            got.append((xo.clone(), yo.clone()))
            del xo, yo
        torch.cuda.synchronize()
        assert len(got) == len(batches)
        for k, ((_, y), r, (xo, yo)) in enumerate(zip(batches, ref, got)):
            assert xo.is_cuda and xo.dtype == dtype
            assert xo.is_contiguous(memory_format=torch.channels_last)
            assert torch.equal(xo, r), f"batch {k} differs (busy={busy})"
            assert torch.equal(yo.cpu(), y)


@pytest.mark.cuda
def test_cuda_buffer_lifetime_old_batches_stay_intact():
    batches = _host_batches(30, size=32)
    p = CUDAPrefetcher(batches, "cuda", channels_last=False, depth=2)
    kept, sums = [], []
    for x, _ in p:
        kept.append(x)
        sums.append(x.double().sum().item())
        torch.cuda.empty_cache()  # invites the allocator to recycle anything not protected
    torch.cuda.synchronize()
    for x, s, (h, _) in zip(kept, sums, batches):
        assert x.double().sum().item() == s
        assert torch.equal(x.cpu(), normalize(h))


def _consume(p, stop=None) -> int:
    n = 0
    for i, batch in enumerate(p):
        n += 1
        del batch
        if stop is not None and i == stop:
            break
    return n


@pytest.mark.cuda
def test_cuda_no_memory_growth_over_epochs_and_early_break():
    batches = _host_batches(20, size=32)
    p = CUDAPrefetcher(batches, "cuda")
    assert _consume(p) == 20
    torch.cuda.synchronize()
    gc.collect()
    base = torch.cuda.memory_allocated()
    streams = list(p._streams)
    for _ in range(5):
        assert _consume(p, stop=7) == 8
        assert _consume(p) == 20
    torch.cuda.synchronize()
    gc.collect()
    assert torch.cuda.memory_allocated() <= base
    assert p._streams == streams  # streams made once, not per epoch


@pytest.mark.cuda
def test_cuda_unpinned_and_pinned_inputs_and_state_passthrough():
    loader = StatefulLoader(n=4)
    p = CUDAPrefetcher(loader, "cuda", mean=IMAGENET_MEAN, std=IMAGENET_STD)
    it = iter(p)
    x, y = next(it)
    assert x.is_cuda and y.is_cuda and y.dtype == torch.int64
    assert p.state_dict() == {"source": {"epoch": 0, "pos": 1}}
    it.close()
    pinned = [(_images(0).pin_memory(), torch.arange(4).pin_memory())]
    ((xo, yo),) = list(CUDAPrefetcher(pinned, "cuda", channels_last=False))
    assert torch.equal(xo.cpu(), normalize(pinned[0][0]))
    assert torch.equal(yo.cpu(), torch.arange(4))


@pytest.mark.cuda
def test_cuda_convert_returns_after_the_copy_from_a_registered_ring_slot():
    """``convert`` is synchronous: a loader may refill its page-locked (cudaHostRegister'ed,
    so not guarded by torch's host allocator) slot as soon as the call returns."""
    import numpy as np

    from fastload.gpu.pinning import pin_array as _pin

    slot = _pin(np.empty((16, 3, 128, 128), dtype=np.uint8))
    x = torch.from_numpy(slot)
    assert x.is_pinned()  # registered memory counts as pinned: the copy below is truly async
    x.copy_(_images(0, n=16, h=128, w=128))
    want = normalize(x.cuda(), mean=IMAGENET_MEAN, std=IMAGENET_STD)
    p = CUDAPrefetcher([], "cuda", mean=IMAGENET_MEAN, std=IMAGENET_STD, channels_last=False)
    p.convert(x)  # builds the constants (which synchronises once)
    torch.cuda._sleep(50_000_000)  # the next copy queues behind ~25 ms of work
    got = p.convert(x)
    x.zero_()  # the loader reuses the slot at once
    assert torch.equal(got, want)
