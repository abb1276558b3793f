"""Where a loader stands: the epoch, and how many of its batches the caller has received.

fastload's DataLoader and the DALI loader both keep one, so a checkpoint names a position the
same way for either backend, and a resume refuses a loader that would not replay the run.
"""

from __future__ import annotations

from typing import Any

# Recorded in a state but allowed to differ on resume (each rank restores its own).
_UNCHECKED = frozenset({"rank"})


class EpochPosition:
    """Epoch number plus batches of that epoch already handed to the caller."""

    __slots__ = ("batches", "epoch")

    def __init__(self) -> None:
        self.epoch = 0
        self.batches = 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; a no-op for the current epoch, so a loaded
        mid-epoch state survives the usual ``set_epoch`` call at the top of the loop."""
        epoch = int(epoch)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self.epoch:
            self.epoch, self.batches = epoch, 0

    def next_epoch(self) -> None:
        self.epoch, self.batches = self.epoch + 1, 0

    def state_dict(self, *, num_batches: int, identity: dict[str, Any]) -> dict[str, Any]:
        """The position (a finished epoch reads as the start of the next) plus ``identity``:
        the settings that must match for a resume to replay the same batches."""
        epoch, done = self.epoch, self.batches
        if done >= num_batches:
            epoch, done = epoch + 1, 0
        return {"epoch": epoch, "batches": done, **identity}

    def load_state_dict(self, state: dict[str, Any], *, num_batches: int, identity: dict[str, Any],
                        what: str = "loader") -> None:
        """Continue right after the batches recorded in ``state``; ValueError if ``state`` came
        from a loader with other settings (it would not reproduce the interrupted run)."""
        for key, mine in identity.items():
            if key not in _UNCHECKED and key in state and state[key] != mine:
                raise ValueError(
                    f"{what} state has {key}={state[key]!r} but this {what} has {mine!r}; "
                    "resuming would not reproduce the interrupted run"
                )
        done = int(state["batches"])
        if not 0 <= done <= num_batches:
            raise ValueError(f"{what} state: batches={done} out of range 0..{num_batches}")
        epoch = int(state["epoch"])
        if epoch < 0:
            raise ValueError(f"{what} state: epoch={epoch} must be >= 0")
        self.epoch, self.batches = epoch, done
