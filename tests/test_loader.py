"""fastload.DataLoader with real worker processes over real packs."""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import fastload.transforms as T
from fastload.data.dataset import ImageFolder
from fastload.data.loader import DataLoader
from fastload.gpu.pinning import cudart_paths, drain_cuda_error
from fastload.data.sampler import epoch_indices
from fastload.errors import CorruptRecordError

from _data_helpers import batches_equal, collect, make_pack

AUG = T.Compose([T.RandomResizedCrop((24, 32)), T.RandomHorizontalFlip()])


@pytest.fixture(scope="module")
def jpeg_pack(sample_tree, tmp_path_factory):
    return make_pack(sample_tree, tmp_path_factory.mktemp("loader") / "jpeg", payload="jpeg")


@pytest.fixture(scope="module")
def raw_hdf5_pack(sample_tree, tmp_path_factory):
    return make_pack(sample_tree, tmp_path_factory.mktemp("loader") / "raw", payload="raw", size=(20, 28), backend="hdf5")


class IndexDataset:
    """A user's own map-style dataset: a uint8 image that encodes its index, label = index."""

    def __init__(self, n: int, kind: str = "numpy"):
        self.n, self.kind = n, kind

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        img = np.full((6, 5, 3), i % 256, np.uint8)
        if self.kind == "tensor":
            img = torch.from_numpy(img).permute(2, 0, 1)
        elif self.kind == "pil":
            from PIL import Image

            img = Image.fromarray(img)
        elif self.kind == "dict":
            return {"x": torch.tensor([float(i)]), "y": i}
        return img, i


def test_batches_are_uint8_nchw_channels_last(jpeg_pack):
    loader = DataLoader(ImageFolder(jpeg_pack, AUG), 5, num_workers=2)
    assert loader.mode == "ring" and len(loader) == 5  # 24 samples
    batches = collect(loader, copy=False)
    images, targets = batches[0]
    assert images.dtype == torch.uint8 and tuple(images.shape) == (5, 3, 24, 32)
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert targets.dtype == torch.int64 and targets.shape == (5,)
    assert tuple(batches[-1][0].shape) == (4, 3, 24, 32)  # the incomplete last batch
    seen = torch.cat([t for _, t in batches]).tolist()
    ds = ImageFolder(jpeg_pack)
    assert sorted(seen) == sorted(ds.targets.tolist())
    loader.close()


@pytest.mark.parametrize("pack_name", ["jpeg_pack", "raw_hdf5_pack"])
def test_same_batches_for_zero_and_two_workers(pack_name, request):
    pack = request.getfixturevalue(pack_name)
    transform = AUG if pack_name == "jpeg_pack" else None
    runs = []
    for workers in (0, 2):
        loader = DataLoader(ImageFolder(pack, transform), 4, num_workers=workers, seed=11)
        runs.append([collect(loader), collect(loader)])  # two epochs
        loader.close()
    assert batches_equal(runs[0][0], runs[1][0]) and batches_equal(runs[0][1], runs[1][1])
    assert not batches_equal(runs[0][0], runs[0][1])  # epochs reshuffle and re-augment


def test_batches_match_per_sample_loading(jpeg_pack):
    ds = ImageFolder(jpeg_pack, AUG)
    loader = DataLoader(ds, 6, num_workers=2, seed=4)
    images, targets = collect(loader, limit=1)[0]
    order = epoch_indices(len(ds), seed=4, epoch=0)[:6]
    for k, i in enumerate(order):
        assert np.array_equal(images[k].permute(1, 2, 0).numpy(), ds.load(int(i), epoch=0, seed=4))
        assert targets[k] == ds.targets[i]
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_at_a_random_step_equals_the_uninterrupted_run(jpeg_pack, workers):
    ds = ImageFolder(jpeg_pack, AUG)
    ref_loader = DataLoader(ds, 3, num_workers=workers, seed=2)
    ref = collect(ref_loader) + collect(ref_loader)  # epochs 0 and 1
    ref_loader.close()
    step = random.Random(workers).randrange(1, len(ref) - 1)
    first = DataLoader(ds, 3, num_workers=workers, seed=2)
    got = []
    while len(got) < step:
        for batch in first:
            got.append((batch[0].clone(), batch[1].clone()))
            if len(got) == step:
                break
    state = first.state_dict()
    first.close()
    resumed = DataLoader(ds, 3, num_workers=workers, seed=2)
    resumed.load_state_dict(state)
    resumed.set_epoch(state["order"]["epoch"])  # what a training loop does: must not rewind
    while len(got) < len(ref):
        got += collect(resumed)
    resumed.close()
    assert batches_equal(got, ref)


def test_held_batch_is_not_overwritten_while_later_batches_are_produced(jpeg_pack):
    ds = ImageFolder(jpeg_pack, AUG)
    reference = collect(DataLoader(ds, 2, num_workers=0, seed=9, copy=True))
    loader = DataLoader(ds, 2, num_workers=2, seed=9, prefetch=2)
    held = {}
    for k, (images, targets) in enumerate(loader):
        if k == 1:
            held[k] = (images, targets)  # keep the ring-slot view itself, no copy
        if k == 4:  # batches 2..4 produced meanwhile, in the ring's other slots
            break
    assert torch.equal(held[1][0], reference[1][0]) and torch.equal(held[1][1], reference[1][1])
    ring = loader._state["ring"]
    assert len(ring) == 2 + 4 and ring.held >= 1  # fixed size: prefetch + margin
    loader.close()


def test_ring_recycles_slots_when_batches_are_dropped(jpeg_pack):
    loader = DataLoader(ImageFolder(jpeg_pack, AUG), 2, num_workers=2, prefetch=3)
    for _ in range(3):
        for images, _ in loader:
            images.float().mean()  # use it, then drop it
    ring = loader._state["ring"]
    assert len(ring) == 3 + 4  # a fixed ring: prefetch + margin, reserved at start
    assert loader.stats()["copied"] == 0  # dropping batches keeps every batch a zero-copy view
    loader.close()


def test_copy_option_gives_private_tensors(jpeg_pack):
    loader = DataLoader(ImageFolder(jpeg_pack, AUG), 4, num_workers=2, copy=True, prefetch=2)
    batches = [b for b in loader]  # hold every batch
    assert loader._state["ring"].held == 0  # copies: no slot stays leased
    ref = collect(DataLoader(ImageFolder(jpeg_pack, AUG), 4, num_workers=0))
    assert batches_equal(batches, ref)
    loader.close()


@pytest.mark.parametrize("kind", ["numpy", "tensor", "pil"])
def test_users_own_dataset_is_collated_to_uint8_batches(kind):
    loader = DataLoader(IndexDataset(23, kind), 5, num_workers=2, seed=1)
    assert loader.mode == "per-sample" and len(loader) == 5
    batches = collect(loader)
    for images, targets in batches:
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, 6, 5)
        assert images.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(images[:, 0, 0, 0].long(), targets)
    assert sorted(torch.cat([t for _, t in batches]).tolist()) == list(range(23))
    assert torch.cat([t for _, t in batches]).tolist() == epoch_indices(23, seed=1, epoch=0).tolist()


def test_non_image_items_use_default_collate():
    batch = next(iter(DataLoader(IndexDataset(8, "dict"), 4, num_workers=0, shuffle=False)))
    assert batch["x"].shape == (4, 1) and batch["y"].tolist() == [0, 1, 2, 3]


def test_user_dataset_resume_and_worker_independence():
    ref = collect(DataLoader(IndexDataset(17), 4, num_workers=0, seed=3))
    assert batches_equal(ref, collect(DataLoader(IndexDataset(17), 4, num_workers=2, seed=3)))
    a = DataLoader(IndexDataset(17), 4, num_workers=2, seed=3)
    head = collect(a, limit=2)
    b = DataLoader(IndexDataset(17), 4, num_workers=2, seed=3)
    b.load_state_dict(a.state_dict())
    assert batches_equal(head + collect(b), ref)


@pytest.mark.parametrize("n", [1, 7, 23, 24, 25])
@pytest.mark.parametrize("drop_last", [False, True])
def test_simulated_ranks_get_equal_batches_and_cover_the_data(n, drop_last):
    for world in (1, 2, 3, 4):
        loaders = [DataLoader(IndexDataset(n), 3, num_workers=0, distributed=(r, world), drop_last=drop_last, seed=5)
                   for r in range(world)]
        counts = {len(collect(ld)) for ld in loaders}
        assert len(counts) == 1 and counts == {len(loaders[0])}
        seen = [t for ld in loaders for _, t in collect(ld)]
        got = torch.cat(seen).tolist() if seen else []
        if drop_last:
            assert len(set(got)) == len(got) and n - len(got) < world * 3 + world
        else:
            assert set(got) == set(range(n))


def test_set_epoch_and_len(jpeg_pack):
    loader = DataLoader(ImageFolder(jpeg_pack, AUG), 5, num_workers=0, drop_last=True)
    assert len(loader) == 4
    loader.set_epoch(3)
    a = collect(loader)
    loader.set_epoch(3)
    assert batches_equal(a, collect(loader)) and len(a) == 4
    assert loader.state_dict()["order"]["epoch"] == 4 and loader.epoch == 4


def test_worker_error_names_the_shard(sample_tree, tmp_path):
    pack = make_pack(sample_tree, tmp_path / "bad", payload="jpeg")
    ds = ImageFolder(pack, AUG, decoder="cv2")
    payload = bytes(ds.reader.get(7))
    shard = ds.reader.shard_path(0)
    ds.reader.close()
    data = bytearray(shard.read_bytes())
    pos = data.find(payload)
    data[pos : pos + len(payload)] = bytes(len(payload))
    shard.write_bytes(bytes(data))
    loader = DataLoader(ImageFolder(pack, AUG, decoder="cv2"), 4, num_workers=2, shuffle=False)
    # Caught by the record checksum in the worker, before the decoder: named all the same.
    with pytest.raises(CorruptRecordError, match=r"shard-00000\.lmdb: record 7"):
        collect(loader)
    loader.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_early_break_then_reiterate_and_clean_shutdown(jpeg_pack):
    ds = ImageFolder(jpeg_pack, AUG)
    loader = DataLoader(ds, 2, num_workers=2, seed=6)
    for k, _ in enumerate(loader):
        if k == 2:
            break
    loader.set_epoch(0)  # the current epoch: a no-op, so iterating again resumes after the break
    rest = collect(loader)
    assert len(rest) == len(loader) - 3  # resumed after the 3 batches handed out
    pids = [p.pid for p in loader._state["workers"].procs]
    ring = loader._state["ring"].dir
    del loader
    gc.collect()
    deadline = time.time() + 10
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
    assert not os.path.exists(ring)


def test_worker_memory_does_not_grow_over_epochs(jpeg_pack):
    loader = DataLoader(ImageFolder(jpeg_pack, AUG), 4, num_workers=2, seed=0)
    rss = []
    for _ in range(8):
        for _ in loader:
            pass
        rss.append(dict(loader.worker_rss))
    assert len(rss[-1]) == 2
    for w in rss[-1]:
        growth = rss[-1][w] - rss[1][w]
        assert growth < 16 << 20, f"worker {w} grew by {growth / 2**20:.1f} MiB over 6 epochs"
    loader.close()


@pytest.mark.slow
def test_keyboard_interrupt_stops_workers(jpeg_pack, tmp_path):
    import signal

    script = tmp_path / "interrupt.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import fastload.transforms as T
        from fastload.data.dataset import ImageFolder
        from fastload.data.loader import DataLoader
        loader = DataLoader(ImageFolder({str(jpeg_pack)!r}, T.RandomResizedCrop(16)), 2, num_workers=2)
        it = iter(loader)
        next(it)
        print(" ".join(str(p.pid) for p in loader._state["workers"].procs), loader._state["ring"].dir, flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            next(it)
    """))
    # SIGINT restored to its default in the child: under `nohup ... &` it is ignored, and
    # Python then installs no KeyboardInterrupt handler.
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr
    *pids, ring = proc.stdout.split()
    time.sleep(0.5)
    assert not any(_alive(int(p)) for p in pids)
    assert not os.path.exists(ring)


@pytest.mark.cuda
def test_ring_slots_are_pinned_and_copy_to_the_gpu(jpeg_pack):
    loader = DataLoader(ImageFolder(jpeg_pack, AUG), 4, num_workers=2, pin_memory=True)
    ref = collect(DataLoader(ImageFolder(jpeg_pack, AUG), 4, num_workers=0, pin_memory=False))
    for k, (images, targets) in enumerate(loader):
        assert images.is_pinned()
        gpu = images.cuda(non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(gpu.cpu(), ref[k][0])
    loader.close()


def _mapped(path_part: str) -> bool:
    """Whether this process has a mapping of a file whose path contains ``path_part``."""
    with open("/proc/self/maps") as f:
        return any(path_part in line for line in f)


def test_slot_owner_releases_once_after_the_last_view_while_still_mapped(tmp_path):
    import mmap

    from fastload.gpu.pinning import ReleasedLast as _ReleasedLast

    path = tmp_path / "slot"
    path.write_bytes(bytes(range(24)))
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 24)
    calls = []
    owned = np.asarray(_ReleasedLast(np.frombuffer(mm, np.uint8).reshape(2, 3, 4),
                                     lambda: calls.append(_mapped(str(path)))))
    del mm  # from here on only the views keep the mapping
    view = torch.from_numpy(owned[1:].view()).permute(0, 2, 1)  # a view of a view of a view
    del owned
    gc.collect()
    assert calls == [] and _mapped(str(path))  # still viewed: neither released nor unmapped
    assert view.permute(0, 2, 1).flatten().tolist() == list(range(12, 24))
    del view
    gc.collect()
    assert calls == [True]  # released exactly once, while the memory was still mapped
    assert not _mapped(str(path))  # and unmapped right after


@pytest.mark.parametrize("workers", [0, 2])
def test_close_frees_unheld_slots_now_and_held_ones_with_their_batch(jpeg_pack, workers):
    loader = DataLoader(ImageFolder(jpeg_pack, AUG), 4, num_workers=workers, pin_memory=True, seed=3)
    ref = collect(DataLoader(ImageFolder(jpeg_pack, AUG), 4, num_workers=0, seed=3))
    held = None
    for k, (images, _) in enumerate(loader):
        if k == 1:
            held = images
    del images
    pool = loader._state["ring"]
    ring = pool.dir
    assert len(pool) >= 2
    loader.close()
    gc.collect()
    assert not pool.images and pool.closed
    assert torch.equal(held, ref[1][0])  # a held batch stays valid after close()
    if ring is not None:
        assert not os.path.exists(ring)
        assert sum(1 for line in open("/proc/self/maps") if ring in line) == 1  # only the held slot
        del held
        gc.collect()
        assert not _mapped(ring)


def test_loaders_can_be_created_and_closed_repeatedly(jpeg_pack):
    ref = collect(DataLoader(ImageFolder(jpeg_pack, AUG), 4, num_workers=0, seed=2))
    for k in range(20):
        workers = 2 if k % 10 == 0 else 0
        with DataLoader(ImageFolder(jpeg_pack, AUG), 4, num_workers=workers, pin_memory=True, seed=2) as loader:
            assert batches_equal(collect(loader), ref)


@pytest.mark.cuda
@pytest.mark.parametrize("workers", [0, 2])
def test_closing_a_pinned_loader_unregisters_its_slots(jpeg_pack, workers):
    cudart = torch.cuda.cudart()
    ref = collect(DataLoader(ImageFolder(jpeg_pack, AUG), 4, num_workers=0, pin_memory=False))
    for _ in range(20):  # a registration left behind would make a later mapping at its address fail
        loader = DataLoader(ImageFolder(jpeg_pack, AUG), 4, num_workers=workers, pin_memory=True)
        for k, (images, _) in enumerate(loader):
            assert images.is_pinned()
            assert torch.equal(images.cuda(non_blocking=True).cpu(), ref[k][0])
        del images
        ptrs = [a.ctypes.data for a in loader._state["ring"].images]
        assert ptrs
        loader.close()
        gc.collect()
        for ptr in ptrs:  # already unregistered: unregistering again is an error
            assert int(cudart.cudaHostUnregister(ptr)) != 0
        drain_cuda_error()  # those errors are pending: the next test's first kernel would raise them


def test_cudart_paths_from_proc_maps():
    lines = [
        "7f00-7f10 r-xp 00000000 08:01 123 /venv/lib/nvidia/cuda_runtime/lib/libcudart.so.12\n",
        "7f10-7f20 r--p 00010000 08:01 123 /venv/lib/nvidia/cuda_runtime/lib/libcudart.so.12\n",
        "7f20-7f30 r-xp 00000000 08:01 456 /opt/torch/lib/libcudart-9335f6a2.so.12 (deleted)\n",
        "7f30-7f40 r-xp 00000000 08:01 789 /usr/lib/libcudnn.so.9\n",
        "7f40-7f50 rw-p 00000000 00:00 0 \n",
        "7f50-7f60 rw-p 00000000 00:00 0 [heap]\n",
    ]
    assert cudart_paths(lines) == ["/venv/lib/nvidia/cuda_runtime/lib/libcudart.so.12",
                                    "/opt/torch/lib/libcudart-9335f6a2.so.12"]
    drain_cuda_error()  # without CUDA: finds no runtime (or one with nothing pending), does nothing


@pytest.mark.cuda
def test_failed_pin_warns_falls_back_and_leaves_no_pending_cuda_error():
    """Registering a slot twice fails (cudaErrorHostMemoryAlreadyRegistered): the second
    _pin warns and returns the memory unpinned, and the error is drained, so the next kernel
    launch (whose check reads cudaGetLastError) does not raise it."""
    from fastload.gpu import pinning as loader_mod

    a = np.zeros(1 << 20, np.uint8)
    pinned = loader_mod.pin_array(a)
    assert torch.from_numpy(pinned).is_pinned()
    with pytest.warns(RuntimeWarning, match="cudaHostRegister"):
        again = loader_mod.pin_array(a)
    assert again is a
    x = torch.ones(8, device="cuda") * 3  # launches kernels: raises if the error were pending
    assert float(x.sum()) == 24.0
    del pinned
    gc.collect()


def _failing_target(t):
    raise ValueError(f"no target for class {t}\nsecond line")


def test_worker_error_is_one_line_with_the_traceback_kept(jpeg_pack):
    from fastload.data.loader import WorkerError

    loader = DataLoader(ImageFolder(jpeg_pack, AUG, target_transform=_failing_target), 4, num_workers=2)
    with pytest.raises(WorkerError) as info:
        collect(loader)
    loader.close()
    msg = str(info.value)
    assert "\n" not in msg and "ValueError: no target for class" in msg and msg.startswith("batch ")
    assert "_failing_target" in info.value.worker_traceback


class PidDataset(IndexDataset):
    """Label = the pid of the process that loaded the sample."""

    def __getitem__(self, i):
        return np.zeros((2, 2, 3), np.uint8), os.getpid()


def test_per_sample_workers_persist_across_epochs():
    loader = DataLoader(PidDataset(12), 3, num_workers=2, seed=0)
    pids = [set(torch.cat([t for _, t in collect(loader)]).tolist()) for _ in range(3)]
    assert len(pids[0]) == 2 and pids[0] == pids[1] == pids[2] and os.getpid() not in pids[0]
    loader.close()
    deadline = time.time() + 10
    while any(_alive(p) for p in pids[0]) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids[0]), "close() left the per-sample workers running"


def test_per_sample_imagefolder_sees_the_epoch_in_persistent_workers(jpeg_pack):
    # ToTensor after the crop cannot be planned into a batch slot: the per-sample path.
    aug = T.Compose([T.RandomResizedCrop((24, 32)), T.RandomHorizontalFlip(), T.ToTensor(scale=False)])
    runs = []
    for workers in (0, 2):
        loader = DataLoader(ImageFolder(jpeg_pack, aug), 5, num_workers=workers, seed=7)
        assert loader.mode == "per-sample"
        runs.append([collect(loader) for _ in range(3)])
        loader.close()
    for epoch in range(3):
        assert batches_equal(runs[0][epoch], runs[1][epoch]), f"epoch {epoch} differs between 0 and 2 workers"
    assert not batches_equal(runs[1][1], runs[1][2])
    ring = collect(DataLoader(ImageFolder(jpeg_pack, AUG), 5, num_workers=0, seed=7))  # same pixels as the ring path
    assert batches_equal(runs[1][0], ring)


def test_per_sample_break_then_reiterate_resumes_with_persistent_workers():
    ref = collect(DataLoader(IndexDataset(30), 4, num_workers=0, seed=8))
    loader = DataLoader(IndexDataset(30), 4, num_workers=2, seed=8, prefetch=4)
    head = collect(loader, limit=3)  # abandons the iteration with batches in flight
    rest = collect(loader)  # the same epoch goes on after the 3 batches handed out
    assert batches_equal(head + rest, ref)
    fresh = DataLoader(IndexDataset(30), 4, num_workers=0, seed=8)
    fresh.set_epoch(1)
    assert batches_equal(collect(loader), collect(fresh))  # and the next epoch is the right one
    loader.close()


@pytest.mark.parametrize("change", [dict(seed=1), dict(shuffle=False)])
def test_load_state_refuses_a_different_run(change):
    args = dict(batch_size=4, seed=0, drop_last=False, shuffle=True)
    state = DataLoader(IndexDataset(17), num_workers=0, **args).state_dict()
    other = DataLoader(IndexDataset(17), num_workers=0, **{**args, **change})
    with pytest.raises(ValueError, match=next(iter(change))):
        other.load_state_dict(state)


def test_default_workers_follow_cpu_affinity_not_the_machine_total():
    # Under taskset or a container cpuset, os.cpu_count() overcounts; every default worker
    # count (DataLoader, pack, sample data, bench) comes from the affinity mask instead.
    code = textwrap.dedent(
        """
        import os
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        from fastload.config import usable_cpus
        from fastload.data.loader import DataLoader
        from fastload.commands.bench import default_workers
        print(usable_cpus(), DataLoader(list(range(4)), 2).num_workers, default_workers())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split(None, 2) == ["1", "1", "[0, 1]\n"]
