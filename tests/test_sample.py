"""The built-in sample dataset generator."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from PIL import Image

from fastload.sample import PHOTOS, class_names, make_image_folder, photo_paths


def _digest(root):
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.jpg")):
        h.update(p.relative_to(root).as_posix().encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def test_bundled_photos_exist_with_licence():
    paths = photo_paths()
    assert len(paths) == len(PHOTOS) == 8
    for p in paths:
        with Image.open(p) as im:
            assert im.format == "JPEG" and max(im.size) <= 640
    assert (paths[0].parent / "LICENSE.txt").read_text().count("CC0") >= 3


def test_tree_layout_sizes_and_determinism(tmp_path):
    a = make_image_folder(tmp_path / "a", num_classes=10, per_class=3, size=(60, 80), seed=7, workers=1)
    b = make_image_folder(tmp_path / "b", num_classes=10, per_class=3, size=(60, 80), seed=7, workers=2)
    c = make_image_folder(tmp_path / "c", num_classes=10, per_class=3, size=(60, 80), seed=8, workers=1)
    assert sorted(d.name for d in a.iterdir()) == class_names(10)
    assert all(len(list(d.iterdir())) == 3 for d in a.iterdir())
    sizes = {Image.open(p).size for p in a.rglob("*.jpg")}
    assert sizes <= {(80, 60), (60, 80)}
    assert _digest(a) == _digest(b)  # worker count does not change the output
    assert _digest(a) != _digest(c)  # the seed does


def test_classes_beyond_eight_are_rotated_variants(tmp_path):
    names = class_names(9)
    assert names[0].endswith(PHOTOS[0]) and names[8].endswith(PHOTOS[0]) and names[0] != names[8]


@pytest.mark.parametrize("bad", [dict(num_classes=0), dict(per_class=0)])
def test_bad_arguments(tmp_path, bad):
    with pytest.raises(ValueError):
        make_image_folder(tmp_path, **bad)


def test_images_are_not_trivial(tmp_path):
    root = make_image_folder(tmp_path, num_classes=2, per_class=2, size=(48, 64), seed=0, workers=1)
    for p in root.rglob("*.jpg"):
        arr = np.asarray(Image.open(p))
        assert arr.std() > 5  # real photo content, not a flat colour
