"""Balance numbers of expert loads: MaxVio (per step and running over steps), the loads
each EP rank computes, and the share of the busiest rank's time the others wait.

Legend: E experts, L MoE layers, R ranks of the EP group.
"""

from __future__ import annotations

from collections import deque
from typing import Mapping, Sequence

import numpy as np
import torch


def max_vio(load_E: Sequence[float]) -> float:
    """MaxVio = max_e load / mean load - 1 (0 when balanced; E-1 when one expert takes all)."""
    load = np.asarray(load_E, dtype=np.float64)
    mean = load.mean() if load.size else 0.0
    return float(load.max() / mean - 1.0) if mean > 0 else 0.0


def rank_idle(rank_load_R) -> list[float]:
    """1 - load_r / max load: the share of the busiest rank's time rank r waits."""
    load = np.asarray(rank_load_R, dtype=np.float64)
    peak = load.max() if load.size else 0.0
    return [float(1.0 - v / peak) if peak > 0 else 0.0 for v in load]


class RunningMaxVio:
    """MaxVio_global: the violation of the loads summed over all steps seen so far (or over
    the last ``window`` steps), per layer. Feed it each step's all-reduced counts (the
    metrics record already has them, so it costs no communication).

    ``update(counts_LE)`` with counts [L, E] (or {layer: counts}) returns the running
    MaxVio of each layer; ``batch`` holds the step's own (MaxVio_batch) values.
    """

    def __init__(self, window: int | None = None):
        if window is not None and window < 1:
            raise ValueError(f"RunningMaxVio: window={window} must be >= 1 or None")
        self.window = window
        self._hist: deque = deque(maxlen=window)
        self._total: np.ndarray | None = None
        self.batch: list[float] = []

    def update(self, counts_LE) -> list[float]:
        if isinstance(counts_LE, Mapping):
            counts_LE = [counts_LE[k] for k in sorted(counts_LE)]
        c = np.asarray(counts_LE.tolist() if isinstance(counts_LE, torch.Tensor) else counts_LE,
                       dtype=np.float64)
        if c.ndim == 1:
            c = c[None]
        if self._total is not None and self._total.shape != c.shape:
            raise ValueError(f"RunningMaxVio: counts shape {c.shape} differs from the "
                             f"earlier {self._total.shape}")
        if self.window is not None:
            self._hist.append(c)
            self._total = np.sum(self._hist, axis=0)
        else:
            self._total = c.copy() if self._total is None else self._total + c
        self.batch = [max_vio(row) for row in c]
        return [max_vio(row) for row in self._total]

    @property
    def totals(self) -> np.ndarray | None:
        """[L, E] loads the running value is computed from."""
        return self._total


def rank_loads(tokens_per_expert_E: Sequence[float], expert_to_rank_E: Sequence[int],
               num_ranks: int) -> list[int]:
    """Assignments each EP rank computes: the sum of its hosted experts' counts."""
    out = np.zeros(num_ranks, dtype=np.float64)
    np.add.at(out, np.asarray(expert_to_rank_E, dtype=np.int64),
              np.asarray(tokens_per_expert_E, dtype=np.float64))
    return [int(round(v)) for v in out]
