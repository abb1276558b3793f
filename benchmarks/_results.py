"""Helpers the benchmark scripts share: timing, tables, packs, and writing RESULTS.md sections.

Each benchmark owns one section of benchmarks/RESULTS.md, delimited by HTML comments, so
running one benchmark replaces its own figures and leaves the others alone.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
_HEADER = "# fastload benchmark results\n\nEach section is written by the script it names; rerun it to refresh that section.\n"


def machine_line() -> str:
    """One line describing where the figures were measured."""
    try:
        import torch

        tv = torch.__version__
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except Exception:  # pragma: no cover
        tv, gpu = "n/a", "no GPU"
    cpu = platform.processor() or platform.machine()
    return f"{os.cpu_count()} CPU cores ({cpu}), {gpu}, Python {platform.python_version()}, torch {tv}"


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except Exception:  # pragma: no cover
        return "unknown"


def table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table (also readable as plain text on the terminal)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:,.0f}" if abs(c) >= 100 else f"{c:.2f}"
    return str(c)


def write_section(name: str, body: str, *, command: str | None = None) -> None:
    """Replace (or append) section ``name`` of RESULTS.md with ``body``."""
    command = command or "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    stamp = time.strftime("%Y-%m-%d %H:%M")
    block = (
        f"<!-- {name}:start -->\n## {name}\n\n"
        f"Command: `{command}`  \nMeasured {stamp} at commit {git_rev()} on {machine_line()}.\n\n"
        f"{body.strip()}\n<!-- {name}:end -->\n"
    )
    text = RESULTS.read_text() if RESULTS.exists() else _HEADER
    pat = re.compile(rf"<!-- {re.escape(name)}:start -->.*?<!-- {re.escape(name)}:end -->\n?", re.S)
    text = pat.sub(lambda _: block, text) if pat.search(text) else text.rstrip("\n") + "\n\n" + block
    RESULTS.write_text(text)


def ensure_tree(workdir: Path, images: int, *, workers: int) -> tuple[Path, int]:
    """``workdir/src``: the sample generator's ImageFolder tree of about ``images`` ~500x375
    JPEGs (8 classes; 2 below 80 images), made unless it is already there. Returns the tree
    and how many images it was made with."""
    import math

    from fastload.sample import make_image_folder

    classes = 8 if images >= 80 else 2
    per_class = math.ceil(images / classes)
    src = Path(workdir) / "src"
    if not src.exists():
        print(f"generating {classes * per_class} JPEGs in {src} ...", flush=True)
        make_image_folder(src, num_classes=classes, per_class=per_class, workers=workers)
    return src, classes * per_class


def ensure_pack(src: Path, dest: Path, cfg, label: str) -> Path:
    """``dest``, packed from ``src`` with the PackConfig ``cfg`` unless it already holds a
    finished pack made with the same output options: a workdir kept from a run of an older
    fastload may hold packs made otherwise (say, before restart markers), and those are redone."""
    import dataclasses
    import json

    from fastload.pack import pack

    try:
        manifest = json.loads((dest / "manifest.json").read_text())
        if manifest.get("options") == cfg.output_options() and manifest.get("backend") == cfg.backend:
            return dest
    except (OSError, ValueError):
        pass
    print(f"packing {label} ...", flush=True)
    pack(src, dest, config=dataclasses.replace(cfg, overwrite=True))
    return dest
