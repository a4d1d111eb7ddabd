"""Loss-spike policy: a loss above ``factor`` x the rolling median of the last ``window``
accepted losses for ``patience`` consecutive steps asks for a rollback to the last
checkpoint written while the loss was normal (the trainer then skips the batches that
caused it). Rollbacks to one checkpoint are bounded (``train.max_rollbacks``), and so are
non-finite steps in a row (``train.max_skipped_steps``): past either the run stops with
:class:`Diverged`, since going on would only skip more data.

Every rank feeds it the same all-reduced loss, so every rank decides the same way.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from ..config import ConfigError

MIN_HISTORY = 10  # losses needed before a median means anything


class Diverged(ConfigError):
    """The run stopped because the loss kept spiking after rollbacks or the updates kept
    being non-finite: no restart helps (exit status 2); the message says what to change."""


class SpikeGuard:
    """factor <= 0 disables the policy (``observe`` always returns False)."""

    def __init__(self, factor: float, window: int, patience: int):
        self.factor, self.window, self.patience = factor, window, patience
        self.history: deque[float] = deque(maxlen=window)
        self.streak = 0
        self.rollbacks: dict[int, int] = {}  # checkpoint step -> rollbacks to it

    def healthy(self) -> bool:
        """Whether the loss is normal now: the guard has its history and the last loss
        was not above the threshold. A checkpoint written otherwise (the loss may already
        have exploded) is never a rollback target."""
        return len(self.history) >= min(MIN_HISTORY, self.window) and self.streak == 0

    def count_rollback(self, to_step: int) -> int:
        """Count one more rollback to the checkpoint of ``to_step``; the count so far."""
        self.rollbacks[to_step] = self.rollbacks.get(to_step, 0) + 1
        return self.rollbacks[to_step]

    def observe(self, loss: float) -> bool:
        """Feed one step's loss; True means 'roll back now'."""
        if self.factor <= 0 or not math.isfinite(loss):
            return False
        if len(self.history) >= min(MIN_HISTORY, self.window):
            median = statistics.median(self.history)
            if loss > self.factor * median:
                self.streak += 1
                if self.streak >= self.patience:
                    self.streak = 0
                    return True
                return False
        self.streak = 0
        self.history.append(loss)
        return False

    def median(self) -> float | None:
        return statistics.median(self.history) if self.history else None

    def reset(self) -> None:
        """After a rollback: the spike steps are not history, the rest stays."""
        self.streak = 0

    def state_dict(self) -> dict:
        """For a checkpoint's meta.json; ``healthy`` marks it as a rollback target."""
        return {"history": list(self.history), "streak": self.streak,
                # None with the guard off: not judged (such a checkpoint counts as a target)
                "healthy": self.healthy() if self.factor > 0 else None,
                "rollbacks": {str(k): v for k, v in self.rollbacks.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.history = deque((float(x) for x in state.get("history", [])), maxlen=self.window)
        self.streak = int(state.get("streak", 0))
        self.rollbacks = {int(k): int(v) for k, v in (state.get("rollbacks") or {}).items()}



def too_many_rollbacks(to_step: int, loss: float, train) -> str:
    """Why the run stops after ``train.max_rollbacks`` rollbacks to step ``to_step``."""
    return (f"the loss spiked again ({loss:.4g}) after {train.max_rollbacks} rollback(s) to "
            f"the checkpoint of step {to_step} (train.max_rollbacks = {train.max_rollbacks}): "
            "skipping more data will not help; stopping. Lower train.lr (now "
            f"{train.lr:g}) or raise train.warmup_steps / lower train.grad_clip; if the "
            f"spikes are noise, raise train.spike_factor (now {train.spike_factor:g}) or "
            f"train.spike_patience (now {train.spike_patience})")


def too_many_skips(in_a_row: int, train) -> str:
    """Why the run stops after ``train.max_skipped_steps`` non-finite steps in a row."""
    return (f"{in_a_row} steps in a row had a non-finite loss or gradient and were skipped "
            f"(train.max_skipped_steps = {train.max_skipped_steps}): the model is not "
            f"training; stopping. Lower train.lr (now {train.lr:g}) or train.grad_clip, or "
            "check the data (token ids, documents of garbage) around this step")
