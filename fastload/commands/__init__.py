"""One module per CLI sub-command; each defines ``register(subparsers)``.

A sub-command module sets ``run=`` on its parser via ``set_defaults``; heavy imports happen
inside ``run`` so ``fastload --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib

# Order is the order in `fastload --help`.
COMMANDS = ("pack", "inspect", "verify", "demo", "bench")


def register_all(subparsers: argparse._SubParsersAction) -> None:
    """Add every sub-command's parser to ``subparsers``, in :data:`COMMANDS` order."""
    for name in COMMANDS:
        importlib.import_module(f".{name}", __name__).register(subparsers)
