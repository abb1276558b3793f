"""What a newcomer sees from ``fastload pack``: a kill -9 that stays quiet, a resumed run that
says so, a shard cap that holds, a failed run that cleans up and names the next step."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from _pack_helpers import cli_env, gradient, make_jpeg_tree, run_cli, save

from fastload.config import PackConfig
from fastload.pack import PackSummary, pack
from fastload.schema import read_manifest


def _noisy_tree(root: Path, n: int, hw=(160, 160)) -> Path:
    """``n`` noisy JPEGs in two classes: slow enough to PNG-encode that a pack can be caught mid-way."""
    rng = np.random.default_rng(0)
    blobs = []
    for k in range(4):
        img = np.clip(gradient(*hw, k).astype(np.int16) + rng.integers(-40, 41, (*hw, 3)), 0, 255)
        blobs.append(save(Image.fromarray(img.astype(np.uint8)), root / "seeds" / f"s{k}.jpg", quality=90).read_bytes())
    for i in range(n):
        p = root / "src" / f"c{i % 2}" / f"img{i:04d}.jpg"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(blobs[i % 4])
    return root / "src"


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its parent's wait is missing


@pytest.mark.timeout(180)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; parent-death signal is Linux's")
def test_kill_9_mid_pack_leaves_no_tracebacks_and_no_workers(tmp_path):
    src = _noisy_tree(tmp_path, 240)
    dest = tmp_path / "dest"
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fastload", "pack", src, dest, "--payload", "png", "--workers", "2",
             "--shard-size", "300K"],
            stdout=subprocess.DEVNULL, stderr=err, env=cli_env(), start_new_session=True,
        )
        t0 = time.monotonic()
        while not list(dest.glob("shard-00000.lmdb")):  # mid-pack: workers busy, results flowing
            assert proc.poll() is None, err_path.read_text()
            assert time.monotonic() - t0 < 120, "no shard after 120 s"
            time.sleep(0.01)
        workers = _children(proc.pid)
        assert len(workers) >= 2  # a real pool (the children list is the pool's processes)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not any(_alive(w) for w in workers)
    time.sleep(0.5)  # anything a dying worker would print has been written by now
    text = err_path.read_text()
    assert "Traceback" not in text and "BrokenPipeError" not in text, text
    assert len(text.splitlines()) <= 1, text


def _limit_file_size(limit: int):
    def pre():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return pre


@pytest.mark.timeout(120)
def test_a_resumed_pack_says_so_and_rates_only_its_own_images(tmp_path):
    """A file-size limit stops the first run after a few shards (a huge image does not fit);
    the rerun says how many shards it took over and counts only what it packed itself."""
    src = make_jpeg_tree(tmp_path / "src", classes=1, per_class=12)
    noise = np.random.default_rng(1).integers(0, 256, (420, 420, 3), dtype=np.uint8)
    save(Image.fromarray(noise), src / "c1" / "huge.png")
    dest = tmp_path / "dest"
    args = ["pack", src, dest, "--payload", "png", "--shard-size", "4K", "--workers", "1"]
    first = subprocess.run([sys.executable, "-m", "fastload", *map(str, args)], capture_output=True, text=True,
                           env=cli_env(), preexec_fn=_limit_file_size(256 << 10), timeout=120)
    assert first.returncode == 1 and "disk full" in first.stderr
    journal = json.loads((dest / ".fastload-pack.json").read_text())
    kept, before = len(journal["shards"]), sum(s["num_samples"] for s in journal["shards"])
    assert kept >= 2
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr
    m = read_manifest(dest / "manifest.json")
    line = again.stdout.strip()
    assert f"resumed after {kept} of {len(m.shards)} shards ({m.num_samples - before} images packed by this run)" in line
    fresh = run_cli(*args[:2], tmp_path / "fresh", *args[3:])
    assert fresh.returncode == 0 and "resumed after" not in fresh.stdout


def test_summary_rate_counts_this_run_only():
    s = PackSummary(packed=100, skipped=0, bytes=1, seconds=2.0, dest=Path("d"), manifest=Path("d/m"), shards=4,
                    resumed_from=60, resumed_shards=3, packed_before=60)
    assert s.images_per_s == 20.0 and "(20 images/s)" in s.line() and "resumed after 3 of 4 shards" in s.line()
    fresh = PackSummary(packed=100, skipped=0, bytes=1, seconds=2.0, dest=Path("d"), manifest=Path("d/m"), shards=4)
    assert fresh.images_per_s == 50.0 and "resumed after" not in fresh.line()


@pytest.mark.parametrize("backend", ["lmdb", "hdf5"])
@pytest.mark.parametrize("payload", ["png", "jpeg"])
def test_shard_payload_never_passes_the_cap(tmp_path, backend, payload):
    """Payload bytes per shard stay under --shard-size; a record bigger than the cap gets a
    shard of its own; the records, in order, are all there."""
    src = make_jpeg_tree(tmp_path / "src", classes=2, per_class=15, hw=(40, 56))
    noise = np.random.default_rng(2).integers(0, 256, (90, 90, 3), dtype=np.uint8)
    save(Image.fromarray(noise), src / "c1" / "img007b.png")  # ~24 KB as PNG: over the cap alone
    cap = 9000 if payload == "png" else 3000
    cfg = PackConfig(backend=backend, payload=payload, workers=1, shard_size=cap)
    summary = pack(src, tmp_path / "out", config=cfg)
    from fastload.storage import make_shard_reader

    m = read_manifest(tmp_path / "out" / "manifest.json")
    assert summary.shards == len(m.shards) >= 3
    alone = 0
    for e in m.shards:
        sizes = [len(bytes(p)) for p in make_shard_reader(backend, tmp_path / "out" / e.file, e.num_samples).iter_payloads()]
        if sum(sizes) > cap:
            assert len(sizes) == 1  # only a single oversized record may pass the cap
            alone += 1
    assert alone == (1 if payload == "png" else 0) or payload == "jpeg"
    assert m.num_samples == 31


def test_on_error_fail_names_the_next_step_and_leaves_no_half_made_dest(tmp_path):
    src = make_jpeg_tree(tmp_path / "src", classes=1, per_class=3)
    (src / "c0" / "img001.jpg").write_bytes(b"not a jpeg")
    dest = tmp_path / "new" / "dest"
    p = run_cli("pack", src, dest, "--on-error", "fail", "--workers", "1")
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert "img001.jpg" in lines[0] and "rerun with --on-error skip" in lines[0]
    assert not dest.exists()  # no folder holding only a hidden journal
    # a DEST the user made beforehand is left in place, empty
    dest.mkdir(parents=True)
    p = run_cli("pack", src, dest, "--on-error", "fail", "--workers", "1")
    assert p.returncode == 1 and dest.is_dir() and os.listdir(dest) == []
