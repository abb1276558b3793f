"""A corpus of nasty pack sources, each packed by the real CLI in a subprocess with a timeout.

Every run must end with a packed DEST whose manifest lists each input it did not pack, with a
reason, or with one error line: never a hang, a traceback or a MemoryError. The inputs are
what an attacker or a careless user leaves in a folder: FIFOs and devices named .jpg, link
loops, a decompression bomb, non-UTF-8 names, files too big, broken CSVs.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import pytest
from PIL import Image

from _pack_helpers import cli_env, gradient, jpeg_bytes, run_cli

from fastload.schema import manifest_name, read_manifest

NON_UTF8 = b"caf\xe9-\xff.jpg"  # latin-1 bytes: not valid UTF-8

# Runs ``fastload ARGS`` as an unprivileged user when the test runs as root (root reads any
# folder, so chmod 000 could not make one unreadable): everything the pack will import is
# imported first, while /root is still readable, then the process drops to "nobody".
_UNPRIVILEGED = r"""
import os, shutil, sys, tempfile
import numpy as np
import PIL.Image; PIL.Image.init()
import fastload.cli
from fastload.config import PackConfig
from fastload.pack import pack
if os.geteuid() == 0:
    # a warm-up pack imports every lazily imported module while /root is still readable
    tmp = tempfile.mkdtemp()
    os.makedirs(tmp + "/src/c")
    for name in ("x.jpg", "y.jpg"):  # two, so the warm-up starts a worker pool
        PIL.Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp + "/src/c/" + name)
    pack(tmp + "/src", tmp + "/out", config=PackConfig(workers=2, progress=False))
    shutil.rmtree(tmp)
    fastload.cli.build_parser()
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
sys.exit(fastload.cli.main(sys.argv[1:]))
"""


def _png_bomb() -> bytes:
    """A ~60-byte PNG that declares 100000 x 100000 RGB pixels (30 GB decoded)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _jpeg(seed: int, hw=(20, 28)) -> bytes:
    return jpeg_bytes(gradient(*hw, seed=seed))


def build_hostile_tree(root: Path) -> tuple[set[bytes], dict[bytes, str]]:
    """An ImageFolder full of traps: ``(relpaths that must be packed, relpath -> reason
    fragment for each input that must be listed as skipped)`` (relpaths as bytes)."""
    a = root / "a"
    (a / "dir.jpg").mkdir(parents=True)  # a directory named like an image: walked, not read
    (a / "dir.jpg" / "inner.png").write_bytes(_png(1))
    good = {b"a/dir.jpg/inner.png"}
    for i, name in enumerate([b"good.jpg", b"space name.jpg", b"new\nline.jpg", "ünï cødé.JPG".encode(), NON_UTF8]):
        with open(os.fsencode(a) + b"/" + name, "wb") as f:
            f.write(_jpeg(i))
        good.add(b"a/" + name)
    bad: dict[bytes, str] = {}
    (a / "zero.jpg").write_bytes(b"")
    bad[b"a/zero.jpg"] = "empty file"
    (a / "truncated.jpg").write_bytes(_jpeg(9, (64, 64))[:300])
    bad[b"a/truncated.jpg"] = "not a readable image"
    (a / "text.jpg").write_text("this is not a picture\n")
    bad[b"a/text.jpg"] = "not a readable image"
    (a / "bomb.png").write_bytes(_png_bomb())
    bad[b"a/bomb.png"] = "decompression bomb"
    (a / "big.jpg").write_bytes(_jpeg(3) + b"\0" * 70_000)  # valid JPEG, over the 64K cap used below
    bad[b"a/big.jpg"] = "file too large"
    os.mkfifo(a / "fifo.jpg")
    bad[b"a/fifo.jpg"] = "not a regular file (a FIFO)"
    os.symlink("/dev/zero", a / "zeros.jpg")
    bad[b"a/zeros.jpg"] = "not a regular file (a character device)"
    os.symlink("missing-target.jpg", a / "dangling.jpg")
    bad[b"a/dangling.jpg"] = "broken symbolic link"
    os.symlink(".", a / "loop")  # ln -s . a/loop: without care, a/loop/loop/... forever
    bad[b"a/loop/"] = "already scanned"
    b = root / "b"
    b.mkdir()
    (b / "real.jpg").write_bytes(_jpeg(20))
    good.add(b"b/real.jpg")
    os.symlink("../a", b / "to_a")  # a link into another class: a's images keep a's label
    bad[b"b/to_a/"] = "already scanned"
    os.symlink("real.jpg", b / "link.jpg")  # a second name for one file: a second sample
    good.add(b"b/link.jpg")
    (b / "locked").mkdir()
    (b / "locked" / "hidden.jpg").write_bytes(_jpeg(21))
    os.chmod(b / "locked", 0)
    bad[b"b/locked/"] = "unreadable folder"
    (root / "stray.jpg").write_bytes(_jpeg(22))  # not inside a class folder
    bad[b"stray.jpg"] = "outside any class folder"
    return good, bad


def _png(seed: int) -> bytes:
    import io

    buf = io.BytesIO()
    Image.fromarray(gradient(18, 22, seed=seed)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def world_tmp():
    """A scratch folder every user can enter (pytest's tmp_path is root-only when run as root)."""
    d = Path(tempfile.mkdtemp(prefix="fastload-hostile-"))
    os.chmod(d, 0o777)
    yield d
    for dirpath, dirnames, _ in os.walk(d):
        for n in dirnames:
            p = os.path.join(dirpath, n)
            if not os.path.islink(p):
                os.chmod(p, 0o755)
    shutil.rmtree(d)


def _pack(*args, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _UNPRIVILEGED, "pack", *map(str, args)],
                          capture_output=True, text=True, env=cli_env(), timeout=timeout)


def _no_crash(p: subprocess.CompletedProcess) -> None:
    for bad in ("Traceback", "MemoryError", "UnicodeEncodeError"):
        assert bad not in p.stderr, p.stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [1, 2])
def test_hostile_image_folder_packs_or_lists_every_input(world_tmp, workers):
    src = world_tmp / "src"
    good, bad = build_hostile_tree(src)
    os.chmod(world_tmp, 0o777)
    dest = world_tmp / "out"
    p = _pack(src, dest, "--max-file-size", "64K", "--workers", workers)
    _no_crash(p)
    assert p.returncode == 0, p.stderr
    assert f"({len(bad)} skipped)" in p.stdout, p.stdout
    m = read_manifest(dest / manifest_name(0, 1))
    skipped = {os.fsencode(s.path): s.reason for s in m.skipped}
    assert set(skipped) == set(bad), (skipped, bad)
    for path, why in bad.items():
        assert why in skipped[path], (path, skipped[path])
    from fastload import ImageFolder

    ds = ImageFolder(dest)
    packed = [os.fsencode(ds.path(i)) for i in range(len(ds))]
    rel = {x[len(os.fsencode(src)) + 1:] for x in packed}
    assert rel == good and len(packed) == len(good)  # no duplicates through the loop or the link
    # a non-UTF-8 name comes back as the same bytes, and names the same file on disk
    (i,) = [k for k, x in enumerate(packed) if x.endswith(NON_UTF8)]
    assert os.path.isfile(ds.path(i)) and os.fsencode(ds.path(i)) == os.fsencode(src) + b"/a/" + NON_UTF8
    # every skipped input was also warned about, one line each, and stderr stayed readable
    for path in bad:
        assert os.fsdecode(path).encode("utf-8", "backslashreplace").decode() in p.stderr or b"\n" in path


@pytest.mark.timeout(120)
def test_hostile_tree_with_on_error_fail_stops_with_one_line_and_leaves_no_dest(world_tmp):
    src = world_tmp / "src"
    build_hostile_tree(src)
    dest = world_tmp / "out"
    p = _pack(src, dest, "--on-error", "fail", "--workers", "1")
    _no_crash(p)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert "--on-error skip" in lines[0]
    assert not dest.exists()  # nothing half-made left behind


def _csv_case(tmp: Path, text: bytes, images: dict[str, bytes] | None = None) -> Path:
    for rel, data in (images or {}).items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(data)
    csv_path = tmp / "list.csv"
    csv_path.write_bytes(text)
    return csv_path


@pytest.mark.timeout(120)
def test_hostile_csv_that_packs(tmp_path):
    """BOM, CRLF, quotes, an absolute path, a `..` path, a duplicate row, a missing file."""
    outside = tmp_path / "elsewhere" / "abs.jpg"
    outside.parent.mkdir()
    outside.write_bytes(_jpeg(5))
    d = tmp_path / "data"
    d.mkdir()
    (tmp_path / "up.jpg").write_bytes(_jpeg(6))
    rows = [
        b"path,label", b'"img/with, comma.jpg",1', b"img/plain.jpg,0", b"img/plain.jpg,0",
        os.fsencode(outside) + b",2", b"../up.jpg,1", b"img/missing.jpg,0", b"",
    ]
    csv_path = _csv_case(d, b"\xef\xbb\xbf" + b"\r\n".join(rows),
                         {"img/with, comma.jpg": _jpeg(1), "img/plain.jpg": _jpeg(2)})
    p = run_cli("pack", csv_path, tmp_path / "out", "--workers", "1", timeout=120)
    _no_crash(p)
    assert p.returncode == 0, p.stderr
    m = read_manifest(tmp_path / "out" / manifest_name(0, 1))
    assert m.num_samples == 5 and m.classes == ("0", "1", "2")  # the duplicate row is a second sample
    assert [(s.path, s.reason) for s in m.skipped] == [("img/missing.jpg", "file not found")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("body, needles", [
    (b"a.jpg,\n", ["list.csv:1", "empty label"]),
    (b"a.jpg,0\n,1\n", ["list.csv:2", "empty path"]),
    (b"a.jpg,0\nb.jpg,-1\n", ["list.csv:2", "label -1 is out of range"]),
    (b"a.jpg,0\nb.jpg,4000000000\n", ["list.csv:2", "label 4000000000 is out of range"]),
    (b"a.jpg,0\nb.jpg," + b"9" * 5000 + b"\n", ["list.csv:2", "out of range"]),
    (b"a.jpg,0,extra\n", ["list.csv:1", "expected 2 columns"]),
    (b"a.jpg,0\nb\xff\xfe.jpg,1\n", ["list.csv", "not a UTF-8 text file"]),
    (b'"a.jpg,0\n' + b"x" * 200_000 + b"\n", ["list.csv", "malformed CSV"]),
    (b"\n\n", ["list.csv", "no rows"]),
    (b"a.jpg,0\nb\0.jpg,1\n", ["list.csv:2"]),
], ids=["empty-label", "empty-path", "negative", "4e9", "5000-digits", "3-columns", "not-utf8",
        "unclosed-quote", "no-rows", "nul-byte"])
def test_hostile_csv_errors_are_one_line(tmp_path, body, needles):
    csv_path = _csv_case(tmp_path, body, {"a.jpg": _jpeg(1), "b.jpg": _jpeg(2)})
    p = run_cli("pack", csv_path, tmp_path / "out", "--workers", "1", timeout=120)
    _no_crash(p)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(60)
def test_a_non_utf8_dest_name_is_one_error_line(tmp_path):
    src = tmp_path / "src" / "c0"
    src.mkdir(parents=True)
    (src / "x.jpg").write_bytes(_jpeg(1))
    dest = os.fsencode(tmp_path) + b"/out-\xff"
    p = run_cli("pack", tmp_path / "src", os.fsdecode(dest), "--workers", "1")
    _no_crash(p)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and len(lines) == 1 and "not valid UTF-8" in lines[0], p.stderr
    assert not os.path.exists(dest)


def test_dest_inside_an_image_folder_source_and_source_inside_dest_are_refused(tmp_path):
    src = tmp_path / "split" / "val"
    (src / "c0").mkdir(parents=True)
    (src / "c0" / "x.jpg").write_bytes(_jpeg(1))
    p = run_cli("pack", src, src / "packed", "--workers", "1")
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and len(lines) == 1 and "DEST is inside SRC" in lines[0], p.stderr
    assert not (src / "packed").exists()
    os.symlink(src, tmp_path / "val-link")  # the same folder by another name is caught too
    p = run_cli("pack", tmp_path / "val-link", src / "c0" / "out", "--workers", "1")
    assert p.returncode == 1 and "DEST is inside SRC" in p.stderr
    p = run_cli("pack", src, tmp_path / "split", "--workers", "1")
    assert p.returncode == 1 and "is inside DEST" in p.stderr
    # a CSV names its files row by row: packing beside it is fine
    (src / "list.csv").write_text("c0/x.jpg,0\n")
    p = run_cli("pack", src / "list.csv", src / "packed-from-csv", "--workers", "1")
    assert p.returncode == 0, p.stderr


@pytest.mark.timeout(120)
def test_an_unreadable_sub_folder_is_listed_or_with_on_error_fail_stops_the_pack(world_tmp):
    src = world_tmp / "src"
    (src / "c0" / "locked").mkdir(parents=True)
    (src / "c0" / "ok.jpg").write_bytes(_jpeg(1))
    (src / "c0" / "locked" / "inside.jpg").write_bytes(_jpeg(2))
    os.chmod(src / "c0" / "locked", 0)
    p = _pack(src, world_tmp / "out", "--workers", "1")
    _no_crash(p)
    assert p.returncode == 0 and "warning: skipped c0/locked/: unreadable folder" in p.stderr, p.stderr
    m = read_manifest(world_tmp / "out" / manifest_name(0, 1))
    assert m.num_samples == 1 and [s.path for s in m.skipped] == ["c0/locked/"]
    p = _pack(src, world_tmp / "fail", "--on-error", "fail", "--workers", "1")
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert "c0/locked" in lines[0] and "unreadable folder" in lines[0] and "--on-error skip" in lines[0]
    assert not (world_tmp / "fail").exists()


@pytest.mark.timeout(60)
def test_odd_names_keep_warnings_and_errors_on_one_line(tmp_path):
    c0 = os.fsencode(tmp_path / "src" / "c0")
    os.makedirs(c0)
    with open(c0 + b"/ok.jpg", "wb") as f:
        f.write(_jpeg(1))
    for name in (b"bad\nname.jpg", b"bad-\xff.jpg"):
        open(c0 + b"/" + name, "wb").close()  # empty: skipped
    p = run_cli("pack", tmp_path / "src", tmp_path / "out", "--workers", "1")
    _no_crash(p)
    lines = p.stderr.splitlines()
    assert p.returncode == 0 and len(lines) == 2, p.stderr  # one warning line per skipped file
    assert "'c0/bad\\nname.jpg'" in p.stderr and "'c0/bad-\\udcff.jpg'" in p.stderr
    p = run_cli("pack", tmp_path / "src", tmp_path / "fail", "--workers", "1", "--on-error", "fail")
    assert p.returncode == 1 and len(p.stderr.splitlines()) == 1, p.stderr
