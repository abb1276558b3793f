"""``fastload pack|inspect|verify`` as real subprocesses: exit codes, messages, interruptions."""

from __future__ import annotations

import json
import resource
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from _pack_helpers import cli_env, gradient, make_jpeg_tree, run_cli, save, tree_bytes
from fastload.errors import FormatError
from fastload.storage import open_pack


def _one_error_line(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    last = lines[-1]
    if code == 1:
        assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in last, (n, last)
    return last


@pytest.fixture(scope="module")
def small_src(tmp_path_factory) -> Path:
    return make_jpeg_tree(tmp_path_factory.mktemp("cli") / "src", classes=2, per_class=4)


def test_pack_inspect_verify_end_to_end(small_src, tmp_path):
    dest = tmp_path / "out"
    p = run_cli("pack", small_src, dest, "--payload", "raw", "--size", "12x16", "--shard-size", "2K", "--workers", "2")
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""  # no TTY: no progress bar
    out = p.stdout.strip()
    assert out.count("\n") == 0 and "packed 8 images (0 skipped)" in out and "images/s" in out
    i = run_cli("inspect", dest)
    assert i.returncode == 0, i.stderr
    for s in ("format:      lmdb", "payload:     raw", "samples:     8", "classes:     2: c0, c1", "12x16x3", "skipped:     0"):
        assert s in i.stdout, (s, i.stdout)
    j = json.loads(run_cli("inspect", "--json", dest).stdout)
    assert j["num_samples"] == 8 and j["num_shards"] == len(list(dest.glob("shard-*.lmdb"))) > 1
    v = run_cli("verify", "--decode", dest)
    assert v.returncode == 0 and v.stdout.startswith("OK:") and "every record decodes" in v.stdout


def _has_restart_markers(jpeg: bytes) -> bool:
    """A DRI marker before the scan (the header's markers, walked by their lengths)."""
    i = 2
    while jpeg[i + 1] != 0xDA:
        if jpeg[i + 1] == 0xDD:
            return True
        i += 2 + int.from_bytes(jpeg[i + 2 : i + 4], "big")
    return False


def test_jpeg_payload_restart_markers_on_by_default_and_off_by_flag(small_src, tmp_path):
    for flag, expected in (((), True), (("--no-restart-markers",), False)):
        dest = tmp_path / f"out{expected}"
        p = run_cli("pack", small_src, dest, "--resize", "40", "--workers", "1", *flag)
        assert p.returncode == 0, p.stderr
        assert json.loads((dest / "manifest.json").read_text())["options"]["restart_markers"] is expected
        reader = open_pack(dest)
        assert all(_has_restart_markers(bytes(reader.get(i))) is expected for i in range(len(reader)))


def test_skipped_inputs_warn_and_show_in_inspect(small_src, tmp_path):
    src = tmp_path / "src"
    make_jpeg_tree(src, classes=1, per_class=2)
    (src / "c0" / "zero.jpg").write_bytes(b"")
    p = run_cli("pack", src, tmp_path / "out", "--workers", "1")
    assert p.returncode == 0, p.stderr
    assert "warning: skipped c0/zero.jpg: empty file" in p.stderr and "(1 skipped)" in p.stdout
    q = run_cli("pack", src, tmp_path / "quiet", "--workers", "1", "--quiet")
    assert q.returncode == 0 and q.stderr == ""
    i = run_cli("inspect", tmp_path / "out")
    assert "skipped:     1" in i.stdout and "c0/zero.jpg: empty file" in i.stdout
    f = run_cli("pack", src, tmp_path / "fail", "--on-error", "fail", "--workers", "1")
    _one_error_line(f, 1, "zero.jpg", "empty file")


@pytest.mark.parametrize(
    "args, code, needles",
    [
        (["--quality", "0"], 2, ["--quality", "1..100"]),
        (["--quality", "101"], 2, ["1..100"]),
        (["--size", "224"], 2, ["--size", "HxW"]),
        (["--size", "0x5"], 2, ["HxW"]),
        (["--part", "2/2"], 2, ["--part", "0 <= I < N"]),
        (["--part", "1-4"], 2, ["--part", "I/N"]),
        (["--shard-size", "0"], 2, ["--shard-size", "positive"]),
        (["--shard-size", "12Q"], 2, ["--shard-size", "invalid size"]),
        (["--payload", "gif"], 2, ["--payload", "invalid choice"]),
        (["--format", "zip"], 2, ["--format", "invalid choice"]),
        (["--workers", "0"], 2, ["--workers", ">= 1"]),
        (["--payload", "original", "--resize", "64"], 2, ["original", "cannot be resized"]),
    ],
)
def test_bad_option_values(small_src, tmp_path, args, code, needles):
    _one_error_line(run_cli("pack", small_src, tmp_path / "out", *args), code, *needles)
    assert not (tmp_path / "out").exists()


def test_bad_sources_and_dest(small_src, tmp_path):
    _one_error_line(run_cli("pack", tmp_path / "missing", tmp_path / "o1"), 1, "missing", "does not exist")
    empty = tmp_path / "empty_src"
    empty.mkdir()
    _one_error_line(run_cli("pack", empty, tmp_path / "o2"), 1, "no class sub-folders")
    make_jpeg_tree(tmp_path / "holes", classes=1, per_class=1)
    (tmp_path / "holes" / "zz_empty").mkdir()
    _one_error_line(run_cli("pack", tmp_path / "holes", tmp_path / "o3"), 1, "zz_empty", "no image files")
    nonimg = tmp_path / "nonimg" / "c"
    nonimg.mkdir(parents=True)
    (nonimg / "a.txt").write_text("x")
    _one_error_line(run_cli("pack", tmp_path / "nonimg", tmp_path / "o4"), 1, "no image files")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    _one_error_line(run_cli("pack", small_src, busy), 1, "not empty", "--overwrite")
    assert run_cli("pack", small_src, tmp_path / "done", "-q").returncode == 0
    _one_error_line(run_cli("pack", small_src, tmp_path / "done"), 1, "finished pack", "--overwrite")
    assert run_cli("pack", small_src, tmp_path / "done", "--overwrite", "--payload", "bmp", "-q").returncode == 0
    bin_src = tmp_path / "photo.bin"
    bin_src.write_bytes(b"\xff\xd8\xff\x00\x9c")
    _one_error_line(run_cli("pack", bin_src, tmp_path / "o5"), 1, "photo.bin", "not a UTF-8")
    # An OSError names its path, then says what is wrong: "PATH: Not a directory".
    _one_error_line(run_cli("pack", small_src, bin_src / "o6"), 1, f"{bin_src / 'o6'}: Not a directory")


def test_a_second_pack_into_the_same_dest_part_is_refused_while_the_first_runs(small_src, tmp_path):
    import fcntl

    one = tmp_path / "one"
    one.mkdir()
    # Hold the lock a running `fastload pack` holds (a real flock, as a first run would).
    with open(one / ".fastload-pack.json.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _one_error_line(run_cli("pack", small_src, one), 1, "another fastload pack is writing this DEST")
        _one_error_line(run_cli("pack", small_src, one, "--overwrite"), 1, "another fastload pack")
    assert run_cli("pack", small_src, one, "-q").returncode == 0
    assert not list(one.glob("*.lock")), sorted(p.name for p in one.iterdir())
    parts = tmp_path / "parts"
    parts.mkdir()
    with open(parts / ".fastload-pack-p00000-of-00002.json.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _one_error_line(run_cli("pack", small_src, parts, "--part", "0/2"), 1, "part 0/2 of this DEST")
        # Other parts are independent jobs and may run at the same time.
        assert run_cli("pack", small_src, parts, "--part", "1/2", "-q").returncode == 0
    assert run_cli("pack", small_src, parts, "--part", "0/2", "-q").returncode == 0
    assert not list(parts.glob("*.lock")), sorted(p.name for p in parts.iterdir())
    assert run_cli("verify", parts).returncode == 0


def test_inspect_and_verify_refuse_unfinished_or_missing(tmp_path):
    _one_error_line(run_cli("inspect", tmp_path / "nope"), 1, "no such directory")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / ".fastload-pack.json").write_text("{}")
    _one_error_line(run_cli("inspect", tmp_path / "half"), 1, "no manifest.json", "rerun the same")
    _one_error_line(run_cli("verify", tmp_path / "half"), 1, "no manifest.json")


@pytest.mark.parametrize("backend", ["lmdb", "hdf5"])
def test_verify_catches_a_flipped_byte_anywhere(small_src, tmp_path, backend):
    dest = tmp_path / "out"
    assert run_cli("pack", small_src, dest, "--format", backend, "--shard-size", "3K", "-q").returncode == 0
    shards = sorted(dest.glob("shard-*"))
    assert len(shards) >= 2
    original = shards[1].read_bytes()
    for where in (0, len(original) // 3, len(original) - 1):
        data = bytearray(original)
        data[where] ^= 0x01
        shards[1].write_bytes(bytes(data))
        v = run_cli("verify", dest)
        assert v.returncode == 1, (where, v.stdout)
        assert "Traceback" not in v.stderr
        assert f"{shards[1].name}: SHA-256 mismatch" in v.stderr and "FAILED" in v.stderr
    shards[1].write_bytes(original)
    assert run_cli("verify", "--decode", dest).returncode == 0
    shards[0].write_bytes(shards[0].read_bytes()[:-100])
    t = run_cli("verify", dest)
    assert t.returncode == 1 and "truncated" in t.stderr
    assert t.stderr.count(shards[0].name) == 1, t.stderr  # one line per problem shard
    shards[0].unlink()
    m = run_cli("verify", dest)
    assert m.returncode == 1 and m.stderr.count(shards[0].name) == 1 and "missing" in m.stderr, m.stderr


def test_verify_decode_finds_an_undecodable_record(tmp_path):
    """A record whose bytes are consistent with the checksum but are not an image."""
    from fastload.storage import make_shard_writer
    from fastload.schema import Manifest, write_manifest

    dest = tmp_path / "out"
    dest.mkdir()
    w = make_shard_writer("lmdb", dest / "shard-00000.lmdb")
    w.append(b"\x89PNG definitely not", label=0, shape=(2, 2, 3), path="x.png")
    entry = w.finish()
    write_manifest(dest / "manifest.json", Manifest(backend="lmdb", payload="png", num_samples=1,
                                                    classes=("a",), shards=(entry,)))
    assert run_cli("verify", dest).returncode == 0  # checksums alone are fine
    v = run_cli("verify", "--decode", dest)
    assert v.returncode == 1 and "record 0 (x.png): does not decode" in v.stderr


# ---------------------------------------------------------------------------- interruptions


@pytest.fixture(scope="module")
def big_src(tmp_path_factory) -> Path:
    """~240 PNG-payload-heavy images (copies of a few noisy 192x192 JPEGs: cheap to make)."""
    root = tmp_path_factory.mktemp("big") / "src"
    rng = np.random.default_rng(0)
    blobs = []
    for k in range(4):
        img = np.clip(gradient(192, 192, k).astype(np.int16) + rng.integers(-40, 41, (192, 192, 3)), 0, 255)
        path = save(Image.fromarray(img.astype(np.uint8)), root / "c0" / f"seed{k}.jpg", quality=90)
        blobs.append(path.read_bytes())
    for c in range(3):
        for i in range(80):
            p = root / f"c{c}" / f"img{i:03d}.jpg"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(blobs[(c + i) % 4])
    return root


def _start(args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fastload", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env(), **kw)


def _wait_for(pattern: str, dest: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    t0 = time.monotonic()
    while not list(dest.glob(pattern)):
        if proc.poll() is not None:
            pytest.fail(f"pack ended before {pattern} appeared: {proc.returncode} {proc.stderr.read()}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            pytest.fail(f"no {pattern} after {timeout} s")
        time.sleep(0.002)


PACK_ARGS = ["--payload", "png", "--shard-size", "200K", "--workers", "1", "--format"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["lmdb", "hdf5"])
def test_kill_9_then_rerun_equals_clean_run(big_src, tmp_path, backend):
    clean = tmp_path / "clean"
    assert run_cli("pack", big_src, clean, *PACK_ARGS, backend, "-q").returncode == 0
    dest = tmp_path / "dest"
    proc = _start(["pack", big_src, dest, *PACK_ARGS, backend, "-q"])
    _wait_for("shard-00001" + {"lmdb": ".lmdb", "hdf5": ".h5"}[backend], dest, proc)  # 2nd finished shard
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (dest / "manifest.json").exists()
    with pytest.raises(FormatError):
        open_pack(dest)
    assert (dest / ".fastload-pack.json").exists()
    again = run_cli("pack", big_src, dest, *PACK_ARGS, backend)
    assert again.returncode == 0, again.stderr
    assert tree_bytes(dest) == tree_bytes(clean)
    assert run_cli("verify", dest).returncode == 0


@pytest.mark.slow
def test_ctrl_c_cleans_up_and_rerun_resumes(big_src, tmp_path):
    clean = tmp_path / "clean"
    args = ["--payload", "png", "--shard-size", "200K", "--workers", "2", "--format", "hdf5"]
    assert run_cli("pack", big_src, clean, *args, "-q").returncode == 0
    dest = tmp_path / "dest"
    # SIGINT restored to its default in the child: a shell's background job (`nohup ... &`)
    # ignores it, and Python then installs no KeyboardInterrupt handler.
    proc = _start(["pack", big_src, dest, *args], preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _wait_for("shard-00001.h5", dest, proc)  # so shard 0 is surely in the journal
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "fastload pack: interrupted; rerun the same command to resume"
    assert "Traceback" not in err
    assert not list(dest.glob("*.tmp")) and not (dest / "manifest.json").exists()
    journal = json.loads((dest / ".fastload-pack.json").read_text())
    assert len(journal["shards"]) >= 1
    again = run_cli("pack", big_src, dest, *args, "-q")
    assert again.returncode == 0, again.stderr
    assert tree_bytes(dest) == tree_bytes(clean)


def _limit_file_size(limit: int):
    def pre():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return pre


@pytest.mark.parametrize("backend", ["lmdb", "hdf5"])
def test_disk_full_is_one_line_and_rerun_resumes(tmp_path, backend):
    """Small shards fit under the file-size limit; the shard holding a huge image does not."""
    src = make_jpeg_tree(tmp_path / "src", classes=1, per_class=12)
    noise = np.random.default_rng(1).integers(0, 256, (420, 420, 3), dtype=np.uint8)
    save(Image.fromarray(noise), src / "c1" / "huge.png")
    args = ["pack", src, tmp_path / "dest", "--format", backend, "--payload", "png", "--shard-size", "4K", "--workers", "1"]
    clean = run_cli(*args[:2], tmp_path / "clean", *args[3:])
    assert clean.returncode == 0
    proc = subprocess.run([sys.executable, "-m", "fastload", *map(str, args)], capture_output=True, text=True,
                          env=cli_env(), preexec_fn=_limit_file_size(256 << 10), timeout=120)
    _one_error_line(proc, 1, "disk full", str(tmp_path / "dest"), "rerun")
    dest = tmp_path / "dest"
    assert not list(dest.glob("*.tmp")) and not (dest / "manifest.json").exists()
    journal = json.loads((dest / ".fastload-pack.json").read_text())
    assert len(journal["shards"]) >= 2
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr
    assert tree_bytes(dest) == tree_bytes(tmp_path / "clean")


def test_output_into_a_closed_pipe_is_quiet(tmp_path):
    """`fastload inspect DEST | head`: no 'Broken pipe' error line, no traceback.

    `true` exits at once, long before Python has started, so the write surely hits a closed pipe."""
    src = make_jpeg_tree(tmp_path / "src", classes=2, per_class=2)
    assert run_cli("pack", src, tmp_path / "dest", "-q").returncode == 0
    cmd = f"{shlex.quote(sys.executable)} -m fastload inspect {shlex.quote(str(tmp_path / 'dest'))} | true"
    out = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, env=cli_env())
    assert out.stderr == ""
    assert out.returncode == 141


@pytest.fixture
def tmpfs_2m(tmp_path):
    """A real 2 MB tmpfs (a disk that fills up), mounted for the test and unmounted after."""
    from _fault_helpers import mounted_tmpfs

    with mounted_tmpfs(tmp_path, "2m") as mnt:
        yield mnt


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["lmdb", "hdf5"])
def test_a_really_full_disk_is_one_line_for_both_formats(tmp_path, tmpfs_2m, backend):
    """A real ENOSPC (not a file-size limit): HDF5's error stack must not spill a second line."""
    src = make_jpeg_tree(tmp_path / "src", classes=1, per_class=4)
    noise = np.random.default_rng(2).integers(0, 256, (700, 700, 3), dtype=np.uint8)
    for k in range(3):  # ~1.5 MB each as PNG: the second cannot fit
        save(Image.fromarray(np.roll(noise, k, axis=0)), src / "c1" / f"big{k}.png")
    dest = tmpfs_2m / "dest"
    proc = subprocess.run([sys.executable, "-m", "fastload", "pack", str(src), str(dest), "--format", backend,
                           "--payload", "png", "--shard-size", "1M", "--workers", "1"],
                          capture_output=True, text=True, env=cli_env(), timeout=120)
    _one_error_line(proc, 1, "disk full", str(dest), "rerun")
    assert not (dest / "manifest.json").exists()
