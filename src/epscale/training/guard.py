"""Loss-spike policy: a loss above ``factor`` x the rolling median of the last ``window``
accepted losses for ``patience`` consecutive steps asks for a rollback to the last
checkpoint (the trainer then skips the batches that caused it).

Every rank feeds it the same all-reduced loss, so every rank decides the same way.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

MIN_HISTORY = 10  # losses needed before a median means anything


class SpikeGuard:
    """factor <= 0 disables the policy (``observe`` always returns False)."""

    def __init__(self, factor: float, window: int, patience: int):
        self.factor, self.window, self.patience = factor, window, patience
        self.history: deque[float] = deque(maxlen=window)
        self.streak = 0

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
        return {"history": list(self.history), "streak": self.streak}

    def load_state_dict(self, state: dict) -> None:
        self.history = deque((float(x) for x in state.get("history", [])), maxlen=self.window)
        self.streak = int(state.get("streak", 0))
