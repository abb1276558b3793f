"""Byte-flip fuzzing of packs: a damaged shard, index file or manifest never crashes a reader,
never hangs it, and never makes it serve wrong pixels, labels, class names or source paths.

For each backend a small raw pack (records small enough to sit in LMDB leaf pages and big enough
to need overflow pages) is damaged one byte at a time: every byte of the LMDB meta pages and of
every branch/leaf page, every byte of the HDF5 file outside the records' data, every byte of the
index file's header and source paths, and seeded random bytes anywhere in every file. A child process (so that a
SIGBUS/SIGSEGV is observed, not suffered) runs a batch of cases: for each it opens the damaged
copy with :class:`fastload.ImageFolder`, reads every record and its source path and reports
"same" (exactly the original pixels, labels, class names and source paths), "error" (a
FastloadError naming a file of the pack), or what went wrong. A child that dies is restarted
after the case that killed it, which is reported.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastload.storage import open_pack

from _data_helpers import make_pack
from _pack_helpers import REPO, cli_env

pytestmark = [pytest.mark.slow]

_CHILD = r"""
import json, os, shutil, sys
import numpy as np
from fastload import ImageFolder
from fastload.errors import FastloadError

pristine, scratch, cases_path, out_path, expected_path = sys.argv[1:6]
cases = json.load(open(cases_path))
exp = np.load(expected_path)
labels, images = exp["labels"], [exp[f"img{i}"] for i in range(len(exp["labels"]))]
classes, paths = exp["classes"].tolist(), exp["paths"].tolist()
names = sorted(os.listdir(pristine))
with open(out_path, "a") as out:
    for n, fname, pos, xor in cases:
        d = os.path.join(scratch, f"case{n}")
        os.makedirs(d)
        for name in names:
            if name == fname:
                shutil.copyfile(os.path.join(pristine, name), os.path.join(d, name))
            else:
                os.link(os.path.join(pristine, name), os.path.join(d, name))
        with open(os.path.join(d, fname), "r+b") as f:
            f.seek(pos)
            b = f.read(1)
            f.seek(pos)
            f.write(bytes([b[0] ^ xor]))
        out.write(json.dumps([n, "start"]) + "\n")
        out.flush()
        ds = None
        try:
            ds = ImageFolder(d)
            if len(ds) != len(labels):
                verdict = f"wrong: {len(ds)} records"
            elif list(ds.classes) != classes:
                verdict = "wrong: class names"
            else:
                verdict = "same"
                for i in range(len(ds)):
                    img, label = ds[i]
                    if label != labels[i] or not np.array_equal(np.asarray(img), images[i]):
                        verdict = f"wrong: record {i}"
                        break
                    if ds.path(i) != paths[i]:
                        verdict = f"wrong: source path of record {i}"
                        break
        except FastloadError as exc:
            msg = str(exc)
            verdict = "error" if d in msg and "\n" not in msg else f"unclear error: {msg[:300]!r}"
        except Exception as exc:
            verdict = f"raw {type(exc).__name__}: {str(exc)[:300]}"
        finally:
            if ds is not None:
                ds.reader.close()
            del ds
        out.write(json.dumps([n, verdict]) + "\n")
        out.flush()
        shutil.rmtree(d)
"""


def _tree(root: Path) -> Path:
    """Twelve images in three classes: 8x8 (inline in an LMDB leaf) and 40x40 (overflow pages)."""
    rng = np.random.default_rng(0)
    for k in range(12):
        hw = 8 if k % 2 else 40
        p = root / f"c{k % 3}" / f"img{k:02d}.png"
        p.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (hw, hw, 3), np.uint8)).save(p)
    return root


def _lmdb_structural_offsets(path: Path) -> list[int]:
    """Every byte a read can depend on: both meta pages' headers and every page that is not an
    overflow (record data) page, found by each page's flags."""
    data = np.fromfile(path, np.uint8)
    ps = 4096
    offsets = [o for m in range(2) for o in range(m * ps, m * ps + 160)]
    pg = 2
    while pg < len(data) // ps:
        page = data[pg * ps : (pg + 1) * ps]
        flags = int(page[10]) | int(page[11]) << 8
        if flags & 0x04:  # an overflow page: its header; the pages after it are record data
            offsets += range(pg * ps, pg * ps + 16)
            pg += max(1, int(page[12:16].view("<u4")[0]))
            continue
        if flags & 0x03:  # branch or leaf page: header, node pointers and nodes
            lower = int(page[12]) | int(page[13]) << 8
            upper = int(page[14]) | int(page[15]) << 8
            offsets += [pg * ps + o for o in (*range(0, lower), *range(upper, ps))]
        pg += 1
    return offsets


def _hdf5_structural_offsets(path: Path) -> list[int]:
    """Every byte outside the contiguous records' data (superblock, object headers, B-trees,
    heaps, the small datasets)."""
    import h5py

    with h5py.File(path, "r") as f:
        start, size = f["data"].id.get_offset(), f["data"].shape[0]
    return [o for o in range(path.stat().st_size) if not start <= o < start + size]


def _path_blob_offsets(path: Path) -> list[int]:
    """Every byte of the index file's source paths (covered by no record checksum)."""
    raw = path.read_bytes()
    header = json.loads(raw[16 : 16 + int.from_bytes(raw[8:16], "little")])
    start, size = header["sections"]["path_blob"]
    return list(range(start, start + size))


def _location_offsets(path: Path) -> list[int]:
    """Every byte of the index file's record-location sections (LMDB packs): a wrong location
    must be caught by the bounds check or the record checksum, a wrong pack-id place by the walk."""
    raw = path.read_bytes()
    header = json.loads(raw[16 : 16 + int.from_bytes(raw[8:16], "little")])
    out: list[int] = []
    for name in ("record_offsets", "record_sizes", "pack_id_at"):
        if name in header["sections"]:
            start, size = header["sections"][name]
            out += range(start, start + size)
    return out


def _cases(pack: Path, backend: str, *, random_per_file: int) -> list[tuple[str, int, int]]:
    """(file, offset, xor mask) of every case: every structural byte of the first shard, of the
    index file's header and (LMDB run) of the manifest; seeded random bytes of every file. HDF5
    metadata is ~10 KB of mostly padding per shard: its first 1 KiB (superblock, root group)
    and 1500 seeded bytes of the rest."""
    rnd = random.Random(1234)
    cases: list[tuple[str, int, int]] = []
    for p in sorted(pack.iterdir()):
        size = p.stat().st_size
        first_shard = p.name.startswith("shard-00000")
        if p.suffix == ".lmdb" and first_shard:
            structural = _lmdb_structural_offsets(p)
        elif p.suffix == ".h5" and first_shard:
            meta = _hdf5_structural_offsets(p)
            structural = [o for o in meta if o < 1024] + rnd.sample([o for o in meta if o >= 1024], 1500)
        elif p.suffix == ".fli":
            # magic, JSON header, source paths, record locations
            structural = list(range(0, 512)) + _path_blob_offsets(p) + _location_offsets(p)
        elif p.name == "manifest.json" and backend == "lmdb":  # every byte (once: it is the same JSON)
            structural = list(range(size))
        else:
            structural = []
        cases += [(p.name, o, 1 << rnd.randrange(8)) for o in structural]
        cases += [(p.name, rnd.randrange(size), rnd.randrange(1, 256)) for _ in range(random_per_file)]
    return cases


def _run_cases(pack: Path, cases: list, tmp: Path, *, timeout: float) -> dict[int, str]:
    """Run ``cases`` in child processes; restart after a case that kills the child."""
    ds = open_pack(pack)
    from fastload import ImageFolder

    folder = ImageFolder(pack)
    expected = {"labels": np.asarray([folder[i][1] for i in range(len(folder))])}
    expected.update({f"img{i}": np.asarray(folder[i][0]) for i in range(len(folder))})
    expected["classes"] = np.asarray(folder.classes)
    expected["paths"] = np.asarray([folder.path(i) for i in range(len(folder))])
    folder.reader.close()
    ds.close()
    np.savez(tmp / "expected.npz", **expected)
    numbered = [[n, *c] for n, c in enumerate(cases)]
    results: dict[int, str] = {}
    todo = numbered
    while todo:
        (tmp / "cases.json").write_text(json.dumps(todo))
        out = tmp / "out.jsonl"
        out.unlink(missing_ok=True)
        scratch = tmp / "scratch"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _CHILD, str(pack), str(scratch), str(tmp / "cases.json"), str(out),
                 str(tmp / "expected.npz")],
                env=cli_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout,
            )
            rc, err = proc.returncode, proc.stderr.strip().splitlines()[-1:]
        except subprocess.TimeoutExpired:
            rc, err = "timeout", []
        started = None
        for line in out.read_text().splitlines() if out.exists() else []:
            n, verdict = json.loads(line)
            if verdict == "start":
                started = n
            else:
                results[n] = verdict
                started = None
        if rc == 0:
            break
        if started is None:  # died outside a case: report it on the next one
            started = todo[0][0] if not results else min(c[0] for c in todo if c[0] not in results)
        results[started] = f"child died: {'timeout' if rc == 'timeout' else _signal_name(rc)} {err}"
        todo = [c for c in todo if c[0] not in results]
    shutil.rmtree(tmp / "scratch", ignore_errors=True)
    return results


def _signal_name(rc: int) -> str:
    if rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"
    return f"exit {rc}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["lmdb", "hdf5"])
def test_byte_flips_never_crash_hang_or_serve_wrong_data(tmp_path, backend):
    pack = make_pack(_tree(tmp_path / "src"), tmp_path / "pack", backend=backend, payload="raw", shard_size=20_000)
    assert len(open_pack(pack).shard_entries) >= 2
    cases = _cases(pack, backend, random_per_file=150)
    results = _run_cases(pack, cases, tmp_path, timeout=400)
    assert len(results) == len(cases)
    bad = {n: v for n, v in results.items() if v not in ("same", "error")}
    summary = {}
    for n, v in bad.items():
        key = (cases[n][0].rsplit(".", 1)[-1], v.split(":")[0])
        summary.setdefault(key, []).append((cases[n], v))
    assert not bad, {k: (len(v), v[:3]) for k, v in summary.items()}
    verdicts = list(results.values())
    assert verdicts.count("error") > 0 and verdicts.count("same") > 0  # both outcomes were exercised
