"""``fastload bench`` on a tiny real pack: table, recommendations, JSON, plot, errors."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from fastload.cli import main
from fastload.commands.bench import BenchPoint, PayloadCost, recommend


@pytest.fixture(scope="module")
def tiny_pack(sample_tree, tmp_path_factory):
    from fastload.config import PackConfig
    from fastload.pack import pack

    dest = tmp_path_factory.mktemp("bench") / "packed"
    pack(sample_tree, dest, config=PackConfig(workers=1, progress=False))
    return dest


def test_bench_measures_and_recommends(tiny_pack, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", str(tiny_pack), "--workers", "0,1", "--batch-sizes", "4,8", "--batches", "3",
               "--seconds", "0", "--crop", "32", "--json", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "24 images, jpeg payload" in text
    table_header = "workers  batch  images  seconds  images/s"  # the table's columns, not a timing check
    assert table_header in text
    for key in ("num_workers=", "batch_size=", "payload="):
        assert f"recommended: {key}" in text
    doc = json.loads(out.read_text())
    pts = doc["points"]
    assert sorted((p["workers"], p["batch_size"]) for p in pts) == [(0, 4), (0, 8), (1, 4), (1, 8)]
    for p in pts:
        assert p["images"] == 3 * p["batch_size"] and p["images_per_sec"] > 0
    rec = doc["recommendation"]
    assert rec["num_workers"] in (0, 1) and rec["batch_size"] in (4, 8)
    cost = doc["payload_cost"]
    assert cost["payload"] == "jpeg" and cost["decode_ms"] > 0
    assert cost["raw_bytes_per_image"] == pytest.approx(120 * 160 * 3, rel=0.3)
    assert cost["bytes_per_image"] < cost["raw_bytes_per_image"]


def _pts(table):
    return [BenchPoint(workers=w, batch_size=b, images=int(ips), seconds=1.0) for (w, b), ips in table.items()]


def test_recommend_picks_fewest_workers_near_best_and_payload_by_cost():
    pts = _pts({(0, 64): 300, (1, 64): 550, (2, 64): 980, (4, 64): 1000, (8, 64): 1010,
                (0, 256): 310, (1, 256): 560, (2, 256): 990, (4, 256): 1005, (8, 256): 1012})
    slow_jpeg = PayloadCost("jpeg", 100, bytes_per_image=110e3, decode_ms=4.0, raw_bytes_per_image=500 * 375 * 3)
    rec = recommend(pts, slow_jpeg, num_images=1000, crop=224, stored_short_side=375)
    assert rec["batch_size"] == 64  # 256 is not 5% faster
    assert rec["num_workers"] == 2  # 980 is within 5% of 1010
    assert rec["payload"] == "raw" and "4.00 ms/image" in rec["why_payload"]
    assert "resize" not in rec  # 375 is not > 1.5 x 256
    cheap = PayloadCost("jpeg", 100, bytes_per_image=3e3, decode_ms=0.05, raw_bytes_per_image=64 * 64 * 3)
    assert recommend(pts, cheap, num_images=1000, crop=56, stored_short_side=64)["payload"] == "jpeg"
    huge = PayloadCost("jpeg", 100, bytes_per_image=110e3, decode_ms=4.0, raw_bytes_per_image=1e6)
    rec = recommend(pts, huge, num_images=10**9, crop=224, stored_short_side=800)
    assert rec["payload"] == "jpeg" and "free memory" in rec["why_payload"]
    assert rec["resize"] == 256
    raw_big = PayloadCost("raw", 100, bytes_per_image=1e6, decode_ms=0.01, raw_bytes_per_image=1e6)
    assert recommend(pts, raw_big, num_images=10**9, crop=224, stored_short_side=256)["payload"] == "jpeg"


def test_bench_plot_needs_matplotlib(tiny_pack, tmp_path):
    png = tmp_path / "p.png"
    r = subprocess.run([sys.executable, "-m", "fastload", "bench", str(tiny_pack), "--workers", "0",
                        "--batch-sizes", "4", "--batches", "1", "--seconds", "0", "--crop", "32",
                        "--plot", str(png), "--no-progress"], capture_output=True, text=True, timeout=300)
    if importlib.util.find_spec("matplotlib") is None:
        assert r.returncode == 1
        assert "pip install matplotlib" in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert not png.exists()
    else:
        assert r.returncode == 0, r.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_bad_dest_is_one_line_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fastload", "bench", str(tmp_path / "nope"), "--no-progress"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "nope" in r.stderr
