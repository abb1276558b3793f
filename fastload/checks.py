"""Argument checks shared by both loaders (fastload's DataLoader and the DALI loader) and by
``make_loader``: one public module both sides import, so neither imports the other."""

from __future__ import annotations

import ast

__all__ = ["check_batch_args", "check_main_guard", "resolve_distributed"]


def resolve_distributed(distributed) -> tuple[int, int]:
    """``(rank, world_size)`` from a loader's ``distributed`` argument: None reads
    ``torch.distributed`` when it is initialised (else a single process), False means a single
    process, True requires an initialised process group, and a pair sets them."""
    if distributed is False:
        return 0, 1
    if distributed is None or distributed is True:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return dist.get_rank(), dist.get_world_size()
        except ImportError:  # pragma: no cover
            pass
        if distributed is True:
            raise ValueError("distributed=True but torch.distributed is not initialised")
        return 0, 1
    try:
        rank, world = (int(x) for x in distributed)
    except (TypeError, ValueError):
        raise ValueError(f"distributed must be None, a bool or (rank, world_size), got {distributed!r}") from None
    if not 0 <= rank < world:
        raise ValueError(f"distributed=(rank, world_size) needs 0 <= rank < world_size, got {distributed!r}")
    return rank, world


def check_batch_args(*, batch_size, crop, resize_ratio) -> None:
    """Validate the batch geometry both backends take (ValueError naming the bad value)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if isinstance(crop, bool) or not isinstance(crop, int) or crop < 1:
        raise ValueError(f"crop must be a positive int, got {crop!r}")
    if not 0 < resize_ratio <= 1:
        raise ValueError(f"resize_ratio must be in (0, 1], got {resize_ratio}")


def check_main_guard(what: str) -> None:
    """Refuse, before any process starts, to spawn workers from a script's top level.

    A spawned worker imports the main script again (as ``__mp_main__``): without
    ``if __name__ == "__main__":`` every worker would run the script's body, build the loader
    again and start workers of its own (DALI: the script runs three times, and an
    ``in_memory=True`` copy is left in /dev/shm). Both loaders call this when they spawn.
    """
    import multiprocessing as mp
    import sys

    fix = 'put the code that builds and iterates the loader under `if __name__ == "__main__":`'
    # In a spawned worker that is still importing the main script (the stdlib's own flag).
    if getattr(mp.current_process(), "_inheriting", False):
        from .errors import FastloadError

        raise FastloadError(f"{what} was built while a spawned worker re-ran the main script: {fix}")
    # The main script's top-level frame, at the line that is building the loader now.
    main = sys.modules.get("__main__")
    main_globals = getattr(main, "__dict__", None)
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is main_globals):
        frame = frame.f_back
    if frame is None or not getattr(main, "__file__", None):  # `python -c`, a notebook: nothing is re-run
        return
    line = frame.f_lineno
    if not _outside_main_guard(frame.f_code.co_filename, line):
        return
    from .errors import FastloadError

    raise FastloadError(f"{frame.f_code.co_filename}:{line}: {what} starts its workers with spawn, and each one "
                        f"re-runs this script: {fix}")


def _outside_main_guard(path: str, line: int) -> bool:
    """Whether ``line`` of the script ``path`` runs at import (not inside ``if __name__ == "__main__":``)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return False  # cannot tell: do not refuse
    for node in tree.body:
        if isinstance(node, ast.If) and node.lineno <= line <= node.end_lineno and _is_main_test(node.test):
            return not node.body[0].lineno <= line <= node.body[-1].end_lineno  # the else branch runs at import
    return True


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    consts = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and consts == ["__main__"]
