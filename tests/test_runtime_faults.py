"""Runtime faults of the loader and trainer, with real processes, signals and tmpfs mounts:
nothing left in shared memory after SIGTERM or SIGKILL, a stopped worker named by the timeout,
a SIGBUS blamed on what caused it, planted /dev/shm names refused, no descriptor per held
batch, and checkpoints that load with ``weights_only=True``."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fastload.data import shm
from fastload.data.loader import DataLoader, WorkerError, WorkerTimeout
from fastload.data.ring import RING_PREFIX, Ring
from fastload.errors import FormatError

from _data_helpers import Indices, make_pack
from _fault_helpers import (REPO, Filler, alive, first_line, kill_started, mounted_tmpfs, run_script, start_script,
                            wait_gone)


@pytest.fixture(autouse=True)
def _no_stray_processes():
    """A failed test must not leave its script (or its workers) running."""
    yield
    kill_started()


def _rings(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(RING_PREFIX))


@pytest.fixture
def ring_dir(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return d


@pytest.fixture
def tmpfs_16m(tmp_path):
    """A real 16 MB tmpfs, mounted for the test and unmounted at the end."""
    with mounted_tmpfs(tmp_path, "16m") as mnt:
        yield mnt


# -- ring names, stale rings -------------------------------------------------------------------


def test_a_ring_directory_names_its_owner_and_is_private(ring_dir):
    ring = Ring((2, 4, 4, 3), slots=2, shared=True, directory=str(ring_dir))
    name = os.path.basename(ring.dir)
    pid, start = name[len(RING_PREFIX):].split("-")[:2]
    assert int(pid) == os.getpid() and int(start) == shm.process_start_time(os.getpid()) > 0
    assert stat.S_IMODE(os.lstat(ring.dir).st_mode) == 0o700
    ring.close()
    assert _rings(ring_dir) == []


def _plant(directory: Path, pid: int, start: int) -> Path:
    d = directory / f"{RING_PREFIX}{pid}-{start}-abc123"
    d.mkdir()
    (d / "slot-0000").write_bytes(b"x" * 100)
    return d


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_stale_sweep_removes_only_dead_owners_of_this_user(ring_dir):
    me = os.getpid()
    dead = _plant(ring_dir, _dead_pid(), 12345)
    reused = _plant(ring_dir, me, shm.process_start_time(me) + 1)  # my pid, another start time: a dead owner
    live = _plant(ring_dir, me, shm.process_start_time(me))
    unknown_start = _plant(ring_dir, me, 0)  # no start time recorded: a live pid is trusted
    target = ring_dir / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("x")
    link = ring_dir / f"{RING_PREFIX}{_dead_pid()}-1-link"
    link.symlink_to(target)
    removed = shm.remove_stale(str(ring_dir), RING_PREFIX)
    assert sorted(removed) == sorted([str(dead), str(reused)])
    assert live.is_dir() and unknown_start.is_dir() and link.is_symlink() and (target / "keep").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_stale_sweep_leaves_another_users_ring(ring_dir):
    theirs = _plant(ring_dir, _dead_pid(), 7)
    os.chown(theirs, 65534, 65534)
    assert shm.remove_stale(str(ring_dir), RING_PREFIX) == []
    assert theirs.is_dir()


def test_stale_sweep_keeps_a_ring_whose_lock_is_held(ring_dir):
    """A dead-looking pid whose directory lock is held (an owner in another pid namespace)."""
    d = _plant(ring_dir, _dead_pid(), 99)
    fd = shm.lock_dir(str(d))
    try:
        assert shm.remove_stale(str(ring_dir), RING_PREFIX) == []
        assert d.is_dir()
    finally:
        os.close(fd)
    assert shm.remove_stale(str(ring_dir), RING_PREFIX) == [str(d)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_live_ring_of_another_process_is_never_removed(ring_dir):
    proc = start_script(ring_dir.parent, f"""
        from fastload.data.ring import Ring
        ring = Ring((2, 4, 4, 3), slots=2, shared=True, directory={str(ring_dir)!r})
        print(ring.dir, flush=True)
        time.sleep(60)
    """)
    try:
        other = first_line(proc).strip()
        assert os.path.isdir(other)
        with DataLoader(Filler(16), 4, num_workers=1, ring_dir=str(ring_dir), pin_memory=False) as loader:
            assert len(list(loader)) == 4
            assert os.path.isdir(other) and len(_rings(ring_dir)) == 2
        assert _rings(ring_dir) == [os.path.basename(other)]
    finally:
        proc.kill()
        proc.wait()
    # the owner is gone now (SIGKILL): the next start removes its ring
    with DataLoader(Filler(16), 4, num_workers=1, ring_dir=str(ring_dir), pin_memory=False) as loader:
        next(iter(loader))
        assert not os.path.exists(other)
    assert _rings(ring_dir) == []


# -- signals to the main process ------------------------------------------------------------

_MID_EPOCH = """
    from fastload.data.loader import DataLoader
    from _fault_helpers import Filler
    loader = DataLoader(Filler(4000, delay=0.02), 4, num_workers=2, ring_dir={ring_dir!r}, pin_memory=False,
                        prefetch=4)
    it = iter(loader)
    held = [next(it) for _ in range(3)]
    print(" ".join(str(p.pid) for p in loader._state["workers"].procs), loader._state["ring"].dir, flush=True)
    for batch in it:  # workers busy mid-epoch until the signal
        pass
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_mid_epoch_leaves_nothing_and_still_dies_by_sigterm(ring_dir):
    proc = start_script(ring_dir.parent, _MID_EPOCH.format(ring_dir=str(ring_dir)))
    *pids, ring = first_line(proc).split()
    assert os.path.isdir(ring)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, err  # the exit status still says "killed by SIGTERM"
    assert wait_gone([int(p) for p in pids])
    assert _rings(ring_dir) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_on_the_per_sample_path_stops_its_workers_and_their_shared_memory(tmp_path):
    proc = start_script(tmp_path, """
        import warnings
        from fastload.data.loader import DataLoader
        from _data_helpers import Indices
        warnings.simplefilter("ignore")
        loader = DataLoader(Indices(4000, hw=(32, 32)), 4, num_workers=2, shuffle=False, pin_memory=False)
        held = []
        for batch in loader:
            held.append(batch)  # each held batch is a shared-memory file of a worker
            if len(held) == 20:
                print(" ".join(str(p.pid) for p in loader._state["torch_loader"]._iterator._workers), flush=True)
    """)
    pids = [int(p) for p in first_line(proc).split()]
    assert any(n.startswith(f"torch_{pids[0]}_") or n.startswith(f"torch_{pids[1]}_") for n in os.listdir("/dev/shm"))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, err[-2000:]
    assert wait_gone(pids, 1)  # killed by the handler, not left to notice on their own
    deadline = time.monotonic() + 15  # torch's shm manager removes the batches' files
    while time.monotonic() < deadline and any(n.startswith(tuple(f"torch_{p}_" for p in pids))
                                               for n in os.listdir("/dev/shm")):
        time.sleep(0.2)
    assert not any(n.startswith(tuple(f"torch_{p}_" for p in pids)) for n in os.listdir("/dev/shm"))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_runs_the_applications_own_handler_untouched(ring_dir):
    """An application that handles SIGTERM itself (a graceful stop) keeps its handler: the
    loader installs none, and its ring is removed when the application closes it."""
    proc = start_script(ring_dir.parent, f"""
        stop = []
        signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
        from fastload.data.loader import DataLoader
        from _fault_helpers import Filler
        with DataLoader(Filler(4000, delay=0.02), 4, num_workers=2, ring_dir={str(ring_dir)!r},
                        pin_memory=False) as loader:
            for k, batch in enumerate(loader):
                if k == 2:
                    print("running", flush=True)
                if stop:
                    print("graceful stop at", k, flush=True)
                    break
    """)
    assert first_line(proc).strip() == "running"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "graceful stop" in out
    assert _rings(ring_dir) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkill_leftover_is_removed_by_the_next_loader_start(ring_dir):
    proc = start_script(ring_dir.parent, _MID_EPOCH.format(ring_dir=str(ring_dir)))
    *pids, ring = first_line(proc).split()
    proc.kill()
    proc.communicate(timeout=30)
    assert os.path.isdir(ring)  # SIGKILL cannot be caught
    assert wait_gone([int(p) for p in pids])  # orphaned workers notice and exit
    with DataLoader(Filler(16), 4, num_workers=1, ring_dir=str(ring_dir), pin_memory=False) as loader:
        assert len(list(loader)) == 4
        assert not os.path.exists(ring)
    assert _rings(ring_dir) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigint_mid_epoch_is_a_keyboard_interrupt_with_nothing_left(ring_dir):
    proc = start_script(ring_dir.parent, _MID_EPOCH.format(ring_dir=str(ring_dir)))
    *pids, ring = first_line(proc).split()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert wait_gone([int(p) for p in pids])
    assert _rings(ring_dir) == []


# -- signals to a worker --------------------------------------------------------------------


def _workers_and_ring(loader):
    return [p.pid for p in loader._state["workers"].procs], loader._state["ring"].dir


def _timeout_while_stopped(it, stop: list[int], pids: list[int]) -> str:
    """SIGSTOP ``stop``, drain ``it`` until the loader's WorkerTimeout, SIGCONT whatever is
    still alive of ``pids``; returns the error's message."""
    for p in stop:
        os.kill(p, signal.SIGSTOP)
    try:
        with pytest.raises(WorkerTimeout) as err:
            for _ in it:
                pass
    finally:
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGCONT)
    return str(err.value)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stopped_worker_is_named_by_the_timeout_and_nothing_leaks(ring_dir):
    loader = DataLoader(Filler(400, delay=0.05), 4, num_workers=2, ring_dir=str(ring_dir), pin_memory=False,
                        shuffle=False, timeout=2)
    it = iter(loader)
    next(it)
    pids, ring = _workers_and_ring(loader)
    msg = _timeout_while_stopped(it, pids[:1], pids)
    assert f"worker 0 (pid {pids[0]})" in msg and "of epoch 0 (first record index" in msg and "in 2 s" in msg
    assert "timeout=" in msg and "\n" not in msg
    assert wait_gone(pids, 10)  # killed and reaped: no stopped or zombie worker
    assert not os.path.exists(ring) and _rings(ring_dir) == []
    # the next pass starts fresh workers and continues the epoch at the batch that timed out
    left = loader.batches_left()
    rest = [t for _, t in loader]
    assert len(rest) == left and int(rest[-1][-1]) == 399
    loader.close()
    assert _rings(ring_dir) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_stopped_between_batches_is_named_too(ring_dir):
    """Stopped while idle (maybe inside the task queue's lock): no worker picks the batch up."""
    loader = DataLoader(Filler(64), 4, num_workers=1, ring_dir=str(ring_dir), pin_memory=False, prefetch=1,
                        ring_slots=1, copy=True, timeout=2)
    it = iter(loader)
    next(it)
    pids, ring = _workers_and_ring(loader)
    time.sleep(0.5)  # the next batch is filled; the worker waits for a task (the ring has one slot)
    os.kill(pids[0], signal.SIGSTOP)
    with pytest.raises(WorkerTimeout) as err:
        for _ in it:
            pass
    msg = str(err.value)
    assert f"workers (pids {pids[0]}) have not picked up batch 1 of epoch 0 (first record index" in msg
    assert "\n" not in msg
    assert wait_gone(pids, 15) and not os.path.exists(ring)
    loader.close()


def test_timeout_argument_is_checked_and_zero_disables_it():
    assert DataLoader(Filler(8), 4, num_workers=0, timeout=0).timeout == 0
    assert DataLoader(Filler(8), 4, num_workers=0, timeout=None).timeout == 0
    assert DataLoader(Filler(8), 4, num_workers=0).timeout == 300
    with pytest.raises(ValueError, match="timeout"):
        DataLoader(Filler(8), 4, num_workers=0, timeout=-1)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stopped_per_sample_worker_is_a_timeout_naming_the_batch():
    loader = DataLoader(Indices(400), 4, num_workers=2, shuffle=False, pin_memory=False, timeout=2)
    it = iter(loader)
    next(it)
    procs = list(loader._state["torch_loader"]._iterator._workers)
    pids = [p.pid for p in procs]
    msg = _timeout_while_stopped(it, pids, pids)
    assert str(pids[0]) in msg and "of epoch 0 (first record index" in msg and "\n" not in msg
    assert wait_gone(pids, 15)
    loader.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig,words", [(signal.SIGKILL, "SIGKILL (the OOM killer?"), (signal.SIGTERM, "SIGTERM"),
                                       (signal.SIGSEGV, "SIGSEGV")])
def test_a_worker_killed_mid_epoch_is_named_with_its_signal(ring_dir, sig, words):
    loader = DataLoader(Filler(400, delay=0.05), 4, num_workers=2, ring_dir=str(ring_dir), pin_memory=False)
    it = iter(loader)
    next(it)
    pids, ring = _workers_and_ring(loader)
    os.kill(pids[1], sig)
    with pytest.raises(WorkerError) as err:
        for _ in it:
            pass
    msg = str(err.value)
    assert f"worker 1 (pid {pids[1]}) was killed by {words}" in msg and "of epoch 0" in msg and "\n" not in msg
    assert wait_gone(pids, 10)
    assert not os.path.exists(ring) and _rings(ring_dir) == []
    loader.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigint_to_a_worker_is_ignored_ctrl_c_belongs_to_the_main_process(ring_dir):
    loader = DataLoader(Filler(200, delay=0.02), 4, num_workers=2, ring_dir=str(ring_dir), pin_memory=False,
                        shuffle=False)
    it = iter(loader)
    got = [next(it)[1]]
    pids, _ = _workers_and_ring(loader)
    os.kill(pids[0], signal.SIGINT)
    got += [t for _, t in it]
    assert torch.equal(torch.cat(got), torch.arange(200))
    assert all(alive(p) for p in pids)
    loader.close()
    assert wait_gone(pids) and _rings(ring_dir) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_per_sample_worker_killed_mid_epoch_is_named_with_its_signal():
    loader = DataLoader(Indices(4000), 4, num_workers=2, shuffle=False, pin_memory=False)
    it = iter(loader)
    next(it)
    pids = [p.pid for p in loader._state["torch_loader"]._iterator._workers]
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerError) as err:
        for _ in it:
            time.sleep(0.001)
    msg = str(err.value)
    assert f"worker (pid {pids[1]}) was killed by SIGKILL" in msg and "of epoch 0 (first record index" in msg
    assert "\n" not in msg
    assert wait_gone(pids, 15)
    loader.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigbus_on_a_full_tmpfs_says_shared_memory_is_full(tmpfs_16m):
    """A real SIGBUS: the worker touches a sparse mapping on a 16 MB tmpfs it filled up."""
    ds = Filler(64, sigbus_dir=str(tmpfs_16m), sigbus_at=8)
    loader = DataLoader(ds, 4, num_workers=1, ring_dir=str(tmpfs_16m), pin_memory=False, shuffle=False)
    with pytest.raises(WorkerError) as err:
        list(loader)
    msg = str(err.value)
    assert "was killed by SIGBUS" in msg and f"{tmpfs_16m} full? (" in msg and "MB free)" in msg, msg
    assert "OOM" not in msg and "\n" not in msg
    loader.close()
    for name in os.listdir(tmpfs_16m):  # the test's own filler files, never a ring
        assert not name.startswith(RING_PREFIX)
        os.unlink(tmpfs_16m / name)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_per_sample_path_on_a_16_mb_dev_shm_is_a_clear_error_not_a_hang(tmp_path):
    """A private mount namespace gets a 16 MB tmpfs as its /dev/shm (Docker's classic small
    /dev/shm); 12 MB batches from a worker cannot all fit. Before, the worker's queue thread
    failed unheard and the main process waited forever."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a private /dev/shm needs root and unshare")
    script = tmp_path / "big.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        import numpy as np
        sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
        from fastload.data.loader import DataLoader
        class Big:
            def __len__(self):
                return 64
            def __getitem__(self, i):
                return np.full((512, 512, 3), i, np.uint8), i
        loader = DataLoader(Big(), 16, num_workers=1, pin_memory=False, shuffle=False, timeout=60)
        held = [b for b in loader]
    """))
    cmd = f"mount -t tmpfs -o size=16m tmpfs /dev/shm && exec {sys.executable} {script}"
    proc = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=100)
    if ("mount" in proc.stderr and "Operation not permitted" in proc.stderr) or "unshare failed" in proc.stderr:
        pytest.skip(f"cannot make a private /dev/shm here: {proc.stderr.strip()[:200]}")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert last.startswith("fastload.data.shm.SharedMemoryFull: /dev/shm is full (") and "MB free)" in last
    assert "--shm-size" in last and "of epoch 0 (first record index" in last


def test_sigbus_with_plenty_of_shared_memory_names_only_the_signal(tmp_path):
    from fastload.data.workers import describe_death

    text = describe_death(-signal.SIGBUS, [str(tmp_path)])
    assert text.startswith("was killed by SIGBUS") and "full?" not in text
    assert describe_death(-signal.SIGKILL, []) == "was killed by SIGKILL (the OOM killer? check dmesg)"
    assert describe_death(3, []) == "exited with code 3"


# -- holding batches ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", ["per-sample", "ring"])
def test_holding_many_batches_needs_no_descriptor_each(tmp_path, path):
    """With 128 descriptors allowed, hold 600 batches from 2 workers (torch's default sharing
    keeps one descriptor per received tensor: this failed after ~100 before)."""
    ds = "Indices(1200)" if path == "per-sample" else "Filler(1200)"
    proc = run_script(tmp_path, f"""
        import resource, warnings
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
        from fastload.data.loader import DataLoader
        from _data_helpers import Indices
        from _fault_helpers import Filler
        warnings.simplefilter("ignore")
        with DataLoader({ds}, 2, num_workers=2, shuffle=False, pin_memory=False) as loader:
            held = list(loader)
            assert loader.mode == {path!r}, loader.mode
            assert [int(t[0]) for _, t in held] == list(range(0, 1200, 2))
            print(len(held), len(os.listdir("/proc/self/fd")), flush=True)
    """, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    held, fds = map(int, proc.stdout.split())
    assert held == 600 and fds < 64


# -- in_memory copies --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def raw_pack(sample_tree, tmp_path_factory):
    return make_pack(sample_tree, tmp_path_factory.mktemp("faults") / "raw", payload="raw", size=(16, 16))


def _copy_name(pack: Path) -> Path:
    from fastload.data.dataset import _shm_name

    return _shm_name(pack)


def _detach_copy(pack: Path) -> None:
    """Stop this process using ``pack``'s copy (the last user removes it), leaving other tests' copies be."""
    from fastload.data.dataset import _attached, _detach

    dest = _copy_name(pack)
    _detach(dest, _attached.pop(dest)[1])


def _no_copy_left(pack: Path) -> bool:
    dest = _copy_name(pack)
    return not any(n.startswith(dest.name) for n in os.listdir("/dev/shm"))


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
@pytest.mark.parametrize("plant", ["symlink", "other-owner", "group-writable", "lock-symlink"])
def test_in_memory_refuses_a_planted_copy(raw_pack, tmp_path, plant):
    from fastload.data.dataset import ImageFolder
    from fastload.data.shm import UnsafeShmError

    dest = _copy_name(raw_pack)
    lock = dest.with_name(dest.name + ".lock")
    assert not os.path.lexists(dest)
    evil = tmp_path / "attacker"
    shutil.copytree(raw_pack, evil)
    (evil / ".complete").touch()
    for f in evil.iterdir():
        if f.name.startswith("shard"):
            f.write_bytes(b"\xff" * f.stat().st_size)  # the attacker's data
    try:
        if plant == "symlink":
            dest.symlink_to(evil)
        elif plant == "lock-symlink":
            lock.symlink_to(tmp_path / "target-of-lock")
        else:
            shutil.copytree(evil, dest)
            if plant == "other-owner":
                if os.geteuid() != 0:
                    pytest.skip("chown to another user needs root")
                for p in [dest, *dest.iterdir()]:
                    os.chown(p, 65534, 65534)
            else:
                os.chmod(dest, 0o775)
        with pytest.raises(UnsafeShmError) as err:
            ImageFolder(raw_pack, in_memory=True)
        msg = str(err.value)
        assert msg.startswith(str(lock if plant == "lock-symlink" else dest)) and "refusing" in msg
        assert "\n" not in msg
        assert not (tmp_path / "target-of-lock").exists()  # the planted lock link was not followed
        if plant != "lock-symlink":
            assert not os.path.lexists(lock)  # our lock file did not stay behind
    finally:
        if dest.is_symlink() or dest.is_file():
            dest.unlink()
        elif dest.exists():
            shutil.rmtree(dest)
        if os.path.lexists(lock):
            lock.unlink()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_in_memory_copy_is_private_and_removed_after_use(raw_pack):
    from fastload.data.dataset import ImageFolder

    ds = ImageFolder(raw_pack, in_memory=True)
    dest = _copy_name(raw_pack)
    st = os.lstat(dest)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077
    ref = ImageFolder(raw_pack)
    assert all(np.array_equal(ds[i][0], ref[i][0]) for i in range(len(ds)))
    del ds
    _detach_copy(raw_pack)
    assert _no_copy_left(raw_pack)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_in_memory_copy_after_sigterm_or_sigkill(sample_tree, tmp_path, ring_dir, sig):
    """SIGTERM: the dying process removes its copy. SIGKILL: the next process that uses
    in_memory (a fresh one: a process sweeps leftovers when it first attaches a copy) removes
    the unused leftover."""
    raw_pack = make_pack(sample_tree, tmp_path / "mine", payload="raw", size=(8, 8))
    proc = start_script(tmp_path, f"""
        from fastload.data.dataset import ImageFolder
        from fastload.data.loader import DataLoader
        import fastload.transforms as T
        ds = ImageFolder({str(raw_pack)!r}, T.RandomResizedCrop(8), in_memory=True)
        loader = DataLoader(ds, 2, num_workers=2, pin_memory=False, ring_dir={str(ring_dir)!r})
        it = iter(loader)
        next(it)
        print(" ".join(str(p.pid) for p in loader._state["workers"].procs), flush=True)
        time.sleep(60)
    """)
    pids = [int(p) for p in first_line(proc).split()]
    assert not _no_copy_left(raw_pack)
    proc.send_signal(sig)
    proc.communicate(timeout=60)
    assert proc.returncode == -sig
    assert wait_gone(pids)
    if sig == signal.SIGTERM:
        assert _no_copy_left(raw_pack) and _rings(ring_dir) == []
        return
    assert len(shm.remove_stale(str(ring_dir), RING_PREFIX)) == 1  # the SIGKILLed run's ring
    assert not _no_copy_left(raw_pack)  # left behind by SIGKILL ...
    other = make_pack(sample_tree, tmp_path / "other", payload="raw", size=(8, 8))
    done = run_script(tmp_path, f"""
        from fastload.data.dataset import ImageFolder
        ImageFolder({str(other)!r}, in_memory=True)  # ... until another process attaches a copy
        print("attached", flush=True)
    """)
    assert done.returncode == 0 and "attached" in done.stdout, done.stderr
    assert _no_copy_left(raw_pack)
    assert _no_copy_left(other)  # and that process's own copy went with it


# -- checkpoints ---------------------------------------------------------------------------------


def _trainer():
    from fastload import train
    from fastload.train.models import SmallCNN

    train.seed_everything(0)
    model = SmallCNN(num_classes=3, width=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return train.Trainer(model, opt, device="cpu", scheduler=sched)


def test_checkpoint_round_trip_loads_with_weights_only(tmp_path):
    loader = DataLoader(Filler(48, hw=(12, 12), classes=3), 8, num_workers=0, seed=3, pin_memory=False)
    trainer = _trainer()
    trainer.train_epoch(loader, max_steps=2)
    ckpt = tmp_path / "c.pt"
    trainer.save_checkpoint(ckpt, loader=loader)
    state = torch.load(ckpt, weights_only=True)  # no arbitrary objects inside
    assert state["loader"]["order"]["position"] == 16 and isinstance(state["torch_rng"], torch.Tensor)
    resumed = _trainer()
    loader2 = DataLoader(Filler(48, hw=(12, 12), classes=3), 8, num_workers=0, seed=3, pin_memory=False)
    resumed.load_checkpoint(ckpt, loader=loader2)
    assert (resumed.epoch, resumed.step) == (trainer.epoch, trainer.step)
    assert loader2.state_dict() == loader.state_dict()
    for k, v in trainer.module.state_dict().items():
        assert torch.equal(v, resumed.module.state_dict()[k]), k


def test_plain_state_turns_numpy_dataclasses_and_enums_into_safe_types(tmp_path):
    import dataclasses
    import enum

    from fastload.train.utils import plain_state

    class Kind(enum.Enum):
        A = "a"

    @dataclasses.dataclass
    class Pos:
        epoch: int
        rest: tuple

    state = plain_state({"pos": Pos(np.int64(3), (1, np.float32(0.5))), "kind": Kind.A,
                         "arr": np.arange(4, dtype=np.int64), "set": frozenset({3, 1})})
    torch.save(state, tmp_path / "s.pt")
    back = torch.load(tmp_path / "s.pt", weights_only=True)
    assert back["pos"] == {"epoch": 3, "rest": (1, 0.5)} and back["kind"] == "a" and back["set"] == {1, 3}
    assert type(back["pos"]["epoch"]) is int and type(back["pos"]["rest"][1]) is float
    assert torch.equal(back["arr"], torch.arange(4))
    with pytest.raises(TypeError, match="cannot store a object in a checkpoint"):
        plain_state({"x": object()})


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_a_checkpoint_with_a_pickled_object_is_refused_unless_opted_in(tmp_path):
    trainer = _trainer()
    trainer.save_checkpoint(tmp_path / "good.pt")
    state = torch.load(tmp_path / "good.pt", weights_only=True)
    marker = tmp_path / "code-ran"
    state["history"] = [_Evil(str(marker))]
    torch.save(state, tmp_path / "evil.pt")
    with pytest.raises(FormatError) as err:
        _trainer().load_checkpoint(tmp_path / "evil.pt")
    msg = str(err.value)
    assert msg.startswith(str(tmp_path / "evil.pt")) and "allow_unsafe_checkpoint=True" in msg
    assert "os.makedirs" in msg and "\n" not in msg  # names what it refused
    assert not marker.exists()  # nothing of the file ran
    # a file you trust (say, written by an older fastload) loads through the explicit opt-in
    _trainer().load_checkpoint(tmp_path / "evil.pt", allow_unsafe_checkpoint=True)
    assert marker.exists()


def test_a_garbage_checkpoint_is_one_clear_line(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(FormatError, match=r"bad\.pt: cannot read checkpoint \(corrupt, truncated or not a torch"):
        _trainer().load_checkpoint(bad)
