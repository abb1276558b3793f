"""``fastload verify`` in constant memory (issue 16): each shard's own index is compared with its
slice of its part's index file and dropped, so verify's peak memory does not grow with the
number of records; and what that streaming comparison reports, part by part."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastload.commands.verify import verify_pack
from fastload.schema import Manifest, ShardEntry, manifest_checksum, manifest_name, shard_name, write_manifest
from fastload.storage import ShardIndex, make_shard_writer, open_pack
from fastload.storage.base import file_sha256
from fastload.storage.index_file import index_name, write_index_file

from _data_helpers import make_pack
from _pack_helpers import cli_env

_PACK_ID = "5ca1ab1e0000000000000000000000aa"


def _synth(dest: Path, n: int, copies: int) -> Path:
    """A valid LMDB pack of ``copies`` shards of ``n`` tiny records each (copies of one shard),
    with its index file and manifest: made without source files, as the scale bench does."""
    dest.mkdir(parents=True)
    payloads = [bytes([k]) * (40 + 7 * k) for k in range(16)]
    first = dest / shard_name("lmdb", 0, 1, 0)
    w = make_shard_writer("lmdb", first, shard_size=1 << 40, pack_id=_PACK_ID)
    for i in range(n):
        w.append(payloads[i % 16], label=i % 10, shape=(8, 8, 3), path=f"c{i % 10}/img_{i:08d}.png")
    entry = w.finish()
    one = w.index()
    entries = [entry]
    for c in range(1, copies):
        name = shard_name("lmdb", 0, 1, c)
        shutil.copyfile(first, dest / name)
        entries.append(ShardEntry(file=name, num_samples=n, bytes=entry.bytes, sha256=entry.sha256))
    size, digest = write_index_file(dest / index_name(""), ShardIndex.concat([one] * copies), pack_id=_PACK_ID)
    write_manifest(dest / manifest_name(0, 1), Manifest(
        backend="lmdb", payload="raw", num_samples=n * copies, classes=tuple(f"c{k}" for k in range(10)),
        shards=tuple(entries), source_count=n * copies, source="/synthetic", pack_id=_PACK_ID,
        index=ShardEntry(file=index_name(""), num_samples=n * copies, bytes=size, sha256=digest)))
    return dest


def _verify_peak_mb(pack: Path) -> tuple[float, str]:
    """Peak RSS (MB) of ``fastload verify PACK`` in a fresh process, and its output."""
    code = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "print(repr((p.returncode, p.stdout + p.stderr))); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    p = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "fastload", "verify", str(pack)],
                       capture_output=True, text=True, env=cli_env(), timeout=600)
    result, peak = p.stdout.strip().splitlines()[-2:]
    rc, out = eval(result)  # noqa: S307 - our own repr
    assert rc == 0, out
    return int(peak) / 1024, out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_verify_peak_memory_does_not_grow_with_the_number_of_records(tmp_path):
    """Four times the records (four shards) cost verify no more memory than one shard: before,
    it kept every shard's index and joined them (+~100 MB here)."""
    n = 200_000
    small = _synth(tmp_path / "one", n, 1)
    big = _synth(tmp_path / "four", n, 4)
    peak_small, out = _verify_peak_mb(small)
    assert f"{n} records" in out
    peak_big, out = _verify_peak_mb(big)
    assert f"{4 * n} records" in out
    assert peak_big < peak_small + 25, (peak_small, peak_big)


def _tree(root: Path, n: int = 24) -> Path:
    rng = np.random.default_rng(0)
    for k in range(n):
        p = root / f"c{k % 3}" / f"img{k:03d}.png"
        p.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (8 + k % 2 * 4, 8, 3), np.uint8)).save(p)
    return root


@pytest.fixture
def parted(tmp_path) -> Path:
    src = _tree(tmp_path / "src")
    for i in range(2):
        make_pack(src, tmp_path / "pack", backend="lmdb", payload="raw", part=i, parts=2, shard_size=2_500)
    return tmp_path / "pack"


def _rewrite_index(pack: Path, part: int, change) -> Path:
    """Rewrite part ``part``'s index file with ``change(index)`` and reseal its manifest (size,
    SHA-256, checksum): a damage only the shard-by-shard comparison can see."""
    r = open_pack(pack)
    m = r.manifests[part]
    idx = r.index.part(part)
    new = change(ShardIndex(np.array(idx.labels), np.array(idx.shapes), idx.paths, np.array(idx.checksums)))
    path = pack / m.index.file
    size, digest = write_index_file(path, new, pack_id=m.pack_id)
    mpath = pack / manifest_name(part, 2)
    d = json.loads(mpath.read_text())
    d["index"].update(bytes=size, sha256=digest)
    d["checksum"] = manifest_checksum(d)
    mpath.write_text(json.dumps(d))
    assert file_sha256(path) == digest
    return path


@pytest.mark.timeout(120)
def test_a_healthy_parted_pack_of_several_shards_per_part_verifies(parted):
    r = open_pack(parted)
    assert len(r.manifests) == 2 and all(len(m.shards) >= 2 for m in r.manifests)
    assert verify_pack(parted) == ([], 24)


@pytest.mark.timeout(120)
def test_an_index_file_that_differs_from_its_shards_is_named_once(parted):
    def another_valid_label(idx: ShardIndex) -> ShardIndex:
        lab = idx.labels.copy()
        lab[-1] = (lab[-1] + 1) % 3
        return ShardIndex(lab, idx.shapes, idx.paths, idx.checksums)

    path = _rewrite_index(parted, 1, another_valid_label)
    problems, n = verify_pack(parted)
    assert n == 24
    assert problems == [f"{path}: index file does not match the shards' records (rebuilt or replaced?); repack"]


@pytest.mark.timeout(120)
def test_a_label_outside_the_classes_in_a_parts_index_names_the_file_and_record(parted):
    def bad_label(idx: ShardIndex) -> ShardIndex:
        lab = idx.labels.copy()
        lab[-1] = 7
        return ShardIndex(lab, idx.shapes, idx.paths, idx.checksums)

    path = _rewrite_index(parted, 1, bad_label)
    n1 = open_pack(parted, check_files=False).manifests[1].num_samples
    problems, _ = verify_pack(parted)
    assert problems == [f"{path}: record {n1 - 1} has label 7, outside the 3 classes 0..2: corrupt or edited index; "
                        "run `fastload verify`"]
