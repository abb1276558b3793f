"""A remote pack opened in a fresh process: its object-store I/O (manifest, index, download-
ahead) runs in a helper forked from it, so the process never starts obstore's runtime and
its DataLoader workers are forked, not spawned (no torch import per worker before the first
batch). Each case runs a script in a subprocess, because the pytest process has itself used
the store (uploads) and must spawn."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from fastload.config import PackConfig
from fastload.data.dataset import ImageFolder
from fastload.data.loader import DataLoader
from fastload.pack import pack

from _remote_helpers import AUG, CFG

# The script's common part: open the pack named on the command line, a loader with 2 workers.
_PRELUDE = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import fastload.transforms as T
    from fastload import DataLoader, ImageFolder
    from fastload.storage import remote_agent
    from fastload.storage.remote import runtime_started

    AUG = T.Compose([T.RandomResizedCrop((24, 32)), T.RandomHorizontalFlip()])
    conf = json.loads(sys.argv[1])

    def open_ds(cache):
        return ImageFolder(conf["url"], AUG, cache_dir=cache, endpoint_url=conf["endpoint_url"],
                           storage_options=conf["storage_options"])

    def started_by(pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return "spawn" if b"multiprocessing.spawn" in f.read() else "fork"

    def epoch(loader, e):
        loader.set_epoch(e)
        xs, ys = zip(*((x.numpy().copy(), y.numpy().copy()) for x, y in loader))
        return np.concatenate(xs), np.concatenate(ys)
""")


@pytest.fixture(scope="module")
def remote(sample_tree, local_pack, s3_server, tmp_path_factory) -> dict:
    """The sample tree in a bucket (uploaded by this process) and the local pack of the same."""
    url = s3_server.create_bucket("fork-path") + "/train"
    pack(sample_tree, url, config=PackConfig(**CFG), staging=tmp_path_factory.mktemp("remote_fork") / "staging",
         endpoint_url=s3_server.endpoint_url, storage_options=s3_server.storage_options)
    return {"url": url, "endpoint_url": s3_server.endpoint_url, "storage_options": s3_server.storage_options,
            "local": str(local_pack)}


def _run(script: str, remote: dict, tmp_path: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(_PRELUDE + textwrap.dedent(script))
    return subprocess.run([sys.executable, str(path), json.dumps(remote)], capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_path)


def _reference(remote: dict, e: int) -> tuple[np.ndarray, np.ndarray]:
    loader = DataLoader(ImageFolder(remote["local"], AUG), 5, num_workers=0, seed=3, pin_memory=False)
    loader.set_epoch(e)
    xs, ys = zip(*((x.numpy().copy(), y.numpy().copy()) for x, y in loader))
    return np.concatenate(xs), np.concatenate(ys)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_workers_fork_while_the_process_has_made_no_request_itself(remote, tmp_path):
    """A fresh process's loader forks its workers and reads pixel-identical batches; once the
    process downloads a shard itself, a new loader spawns them (and still reads the same)."""
    proc = _run("""
        def main():
            ds = open_ds("cache")
            loader = DataLoader(ds, 5, num_workers=2, seed=3, pin_memory=False)
            x1, y1 = epoch(loader, 1)
            procs = loader._state["workers"].procs
            out = {"context": loader.multiprocessing_context, "started": [started_by(p.pid) for p in procs],
                   "runtime": runtime_started(), "agent": remote_agent.started(),
                   "downloads": ds.reader.remote.stats().downloads, "shards": len(ds.reader.shard_entries)}
            loader.close()
            np.savez("fork.npz", x=x1, y=y1)
            other = open_ds("cache2")  # this process now downloads a shard itself: its workers must spawn
            other.load(0)
            loader = DataLoader(ds, 5, num_workers=2, seed=3, pin_memory=False)
            x2, y2 = epoch(loader, 1)
            out.update(context2=loader.multiprocessing_context, runtime2=runtime_started(),
                       started2=[started_by(p.pid) for p in loader._state["workers"].procs])
            loader.close()
            np.savez("spawn.npz", x=x2, y=y2)
            print(json.dumps(out))

        if __name__ == "__main__":
            main()
    """, remote, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["context"] is None and out["started"] == ["fork", "fork"]
    assert out["runtime"] is False and out["agent"] is True  # the helper did the process's requests
    assert out["downloads"] <= out["shards"]  # the helper's download-ahead, one per shard at most
    assert out["context2"] == "spawn" and out["runtime2"] is True and out["started2"] == ["spawn", "spawn"]
    ref_x, ref_y = _reference(remote, 1)
    for name in ("fork", "spawn"):
        got = np.load(tmp_path / f"{name}.npz")
        assert np.array_equal(got["y"], ref_y) and np.array_equal(got["x"], ref_x), name
    assert "Traceback" not in proc.stderr


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_helper_ends_with_its_parent_even_after_kill_9(remote, tmp_path):
    path = tmp_path / "script.py"
    path.write_text(_PRELUDE + textwrap.dedent("""
        import time
        ds = open_ds("cache")
        print(" ".join(map(str, remote_agent.pids())), flush=True)
        time.sleep(120)
    """))
    proc = subprocess.Popen([sys.executable, str(path), json.dumps(remote)], stdout=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    try:
        helpers = [int(p) for p in proc.stdout.readline().split()]
        assert len(helpers) == 1 and _alive(helpers[0])
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while _alive(helpers[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(helpers[0]), "the object-store helper outlived its killed parent"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_helper_is_replaced_and_reading_goes_on(remote, tmp_path):
    """kill -9 of the helper mid-run: the next download-ahead starts a new one, workers read
    every shard they need themselves, and the epochs are still exact."""
    proc = _run("""
        import signal
        ds = open_ds("cache")
        loader = DataLoader(ds, 5, num_workers=2, seed=3, pin_memory=False)
        first = remote_agent.pids()
        os.kill(first[0], signal.SIGKILL)
        x1, y1 = epoch(loader, 1)
        second = remote_agent.pids()
        other = open_ds("cache3")  # the manifest fetch of a new pack goes through the new helper
        np.savez("after_kill.npz", x=x1, y=y1)
        print(json.dumps({"first": first, "second": second, "len": len(other), "runtime": runtime_started()}))
    """, remote, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["second"] and out["second"] != out["first"] and out["runtime"] is False
    assert out["len"] == len(ImageFolder(remote["local"]))
    ref_x, ref_y = _reference(remote, 1)
    got = np.load(tmp_path / "after_kill.npz")
    assert np.array_equal(got["y"], ref_y) and np.array_equal(got["x"], ref_x)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_unreachable_store_at_open_is_one_error_from_the_helper(remote, tmp_path):
    """Errors raised in the helper reach the caller as the same exception types and text."""
    dead = dict(remote, endpoint_url="http://127.0.0.1:9")  # nothing listens on port 9
    path = tmp_path / "script.py"
    path.write_text(_PRELUDE + textwrap.dedent("""
        from fastload.storage.remote import RemoteError
        try:
            ImageFolder(conf["url"], cache_dir="cache", endpoint_url=conf["endpoint_url"],
                        storage_options=conf["storage_options"], retry_seconds=1)
        except RemoteError as exc:
            print(type(exc).__name__, "|", exc)
    """))
    proc = subprocess.run([sys.executable, str(path), json.dumps(dead)], capture_output=True, text=True,
                          timeout=100, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip()
    assert line.startswith("RemoteError |") and "127.0.0.1:9" in line and "\n" not in line


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_multiprocessing_child_that_opened_a_remote_pack_exits(remote, tmp_path, method):
    """multiprocessing joins a child's own children when it exits, before atexit hooks run: the
    helper must be stopped before that join, or the child (a benchmark's isolated run, a
    user's training process) never ends."""
    path = tmp_path / "script.py"
    path.write_text(_PRELUDE + textwrap.dedent(f"""
        import multiprocessing as mp

        def child():
            ds = open_ds("cache")
            assert remote_agent.started()
            print("opened", len(ds), flush=True)

        if __name__ == "__main__":
            p = mp.get_context({method!r}).Process(target=child)
            p.start()
            p.join(30)
            print("exitcode", p.exitcode)
            if p.exitcode is None:
                p.kill()
    """))
    proc = subprocess.run([sys.executable, str(path), json.dumps(remote)], capture_output=True, text=True,
                          timeout=100, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["opened", str(len(ImageFolder(remote["local"]))), "exitcode", "0"]
