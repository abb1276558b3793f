"""One module per CLI sub-command; each defines ``register(subparsers)``.

A sub-command module sets ``run=`` on its parser via ``set_defaults``; heavy imports happen
inside ``run`` so ``fastload --help`` stays fast.
"""

from __future__ import annotations

import importlib

# Order is the order in `fastload --help`.
COMMANDS = ("pack", "inspect", "verify", "demo", "bench")


def register_all(subparsers) -> None:
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name == f"{__name__}.{name}":
                continue  # not written yet
            raise
        mod.register(subparsers)
