"""Tiny hand-made source images and CLI runners for the packer's tests (owned by the packer)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]


def gradient(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A smooth RGB image with some noise: compresses like a photo, not like flat colour."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), ((x + y) * 3) % 256], axis=2)
    img = img + rng.integers(-8, 9, size=img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def save(img: Image.Image, path: Path, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, **kw)
    return path


def make_special_tree(root: Path) -> Path:
    """An ImageFolder with odd sizes and every colour mode we promise to convert."""
    a, b = root / "a_modes", root / "b_more"
    save(Image.fromarray(gradient(17, 31, 1)), a / "odd_31x17.png")
    save(Image.fromarray(gradient(20, 24, 2)[:, :, 0]), a / "gray_L.png")
    rgba = np.dstack([gradient(19, 23, 3), np.full((19, 23), 120, np.uint8)])
    save(Image.fromarray(rgba, "RGBA"), a / "rgba.png")
    save(Image.fromarray(gradient(21, 18, 4)).convert("P", palette=Image.Palette.ADAPTIVE), a / "palette.png")
    save(Image.fromarray(gradient(24, 32, 5)).convert("CMYK"), a / "cmyk.jpg", quality=92)
    g16 = (np.arange(22 * 26, dtype=np.uint16).reshape(22, 26) * 97) % 65535
    save(Image.fromarray(g16.astype(np.uint16)), b / "gray16.png")
    assert Image.open(b / "gray16.png").mode.startswith("I")
    save(Image.fromarray(gradient(18, 30, 6)), b / "plain.jpg", quality=90)
    save(Image.fromarray(gradient(16, 28, 7)), b / "exif6.jpg", exif=_exif(6), quality=95)
    return root


def _exif(orientation: int) -> Image.Exif:
    e = Image.Exif()
    e[0x0112] = orientation
    return e


def jpeg_bytes(arr: np.ndarray, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def make_jpeg_tree(root: Path, *, classes: int = 3, per_class: int = 8, hw=(24, 32)) -> Path:
    """A small tree of distinct JPEGs (fast to make; for order/determinism tests)."""
    for c in range(classes):
        for i in range(per_class):
            save(Image.fromarray(gradient(hw[0], hw[1], seed=c * 1000 + i)), root / f"c{c}" / f"img{i:03d}.jpg", quality=90)
    return root


def cli_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    """Run ``python -m fastload ARGS`` in a real subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "fastload", *map(str, args)],
        capture_output=True, text=True, env=cli_env(), timeout=kw.pop("timeout", 300), **kw,
    )


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative name -> content), to compare packs byte for byte."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def pack_interrupted(src: Path, dest: Path, cfg, *, after_shards: int) -> None:
    """Run a pack that a Ctrl-C stops as shard ``after_shards`` is about to start."""
    import pytest

    import fastload.pack as packmod
    from fastload.pack import pack

    orig = packmod._PackRun._open_writer

    def dying_open_writer(self):
        if len(self.entries) == after_shards:
            raise KeyboardInterrupt
        orig(self)

    packmod._PackRun._open_writer = dying_open_writer
    try:
        with pytest.raises(KeyboardInterrupt):
            pack(src, dest, config=cfg)
    finally:
        packmod._PackRun._open_writer = orig


def synthetic_lmdb_pack(dest: Path, n: int) -> Path:
    """A one-shard LMDB pack of ``n`` records of one tiny JPEG with record locations, written by
    the storage writer and the index/manifest code the packer uses (fast at any ``n``)."""
    from fastload.codecs import jpeg
    from fastload.schema import Manifest, ShardEntry, manifest_name, shard_name, write_manifest
    from fastload.storage import make_shard_writer
    from fastload.storage import lmdb_backend
    from fastload.storage.index_file import index_name, write_index_file

    pack_id = "0123456789abcdef0123456789abcdef"
    dest.mkdir(parents=True)
    data = jpeg.encode(np.full((8, 8, 3), 99, np.uint8), quality=80)
    shard = dest / shard_name("lmdb", 0, 1, 0)
    writer = make_shard_writer("lmdb", shard, shard_size=1 << 40, pack_id=pack_id)
    for i in range(n):
        writer.append(data, label=i % 10, shape=(8, 8, 3), path=f"c{i % 10}/image_{i:09d}.jpg")
    entry = writer.finish()
    index = lmdb_backend.with_record_locations(writer.index(), [(shard, n)])
    size, digest = write_index_file(dest / index_name(""), index, pack_id=pack_id)
    write_manifest(dest / manifest_name(0, 1), Manifest(
        backend="lmdb", payload="jpeg", num_samples=n, classes=tuple(f"c{k}" for k in range(10)), shards=(entry,),
        image_shape=(8, 8, 3), source_count=n, source="/synthetic", pack_id=pack_id,
        index=ShardEntry(file=index_name(""), num_samples=n, bytes=size, sha256=digest),
    ))
    return dest
