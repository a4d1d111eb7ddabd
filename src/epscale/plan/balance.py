"""Balancing strategies as re-distributions of expert load, for the simulator.

Legend: L layer distributions, E experts, P physical slots, R ranks of one EP group.

* ``none``: the router's distribution as it is.
* ``aux`` (Switch/GShard auxiliary loss) and ``loss_free`` (DeepSeek-V3's bias update):
  the router's weights are tempered, ``w -> w**residual``; for a Zipf(s) router that is
  Zipf(s*residual). The residual exponents (default 0.35 and 0.1) are modelling
  assumptions: an auxiliary loss trades balance against its weight on the LM loss and
  leaves a visible skew, the bias update drives the mean load to uniform and leaves the
  batch-to-batch noise. A trace from a run that used the strategy is the better input.
* ``redundant`` (EPLB): ``redundant_per_rank`` extra expert slots per rank, planned by
  :func:`epscale.placement.eplb.plan_placement` from the mean load; a replicated expert's
  rows split evenly over its copies.
* ``spill`` (LLEP): each step, rows of overloaded ranks' hottest experts move to the
  least-loaded ranks (:func:`epscale.placement.llep.plan_spill`); the helper first receives
  the expert's weights (and returns their gradient), which the step model charges.
Strategies compose with '+', e.g. ``loss_free+redundant``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import ConfigError
from .placement import place_experts

STRATEGIES = ("none", "aux", "loss_free", "redundant", "spill")


@dataclass(frozen=True)
class BalanceParams:
    aux_residual: float = 0.35
    loss_free_residual: float = 0.1
    redundant_per_rank: int = 1
    spill_threshold: float = 1.05
    spill_min_rows: int = 32


@dataclass(frozen=True)
class Strategy:
    name: str
    temper: float          # exponent applied to the router weights (1.0 = untouched)
    redundant: bool
    spill: bool


def parse_strategy(text: str, params: BalanceParams = BalanceParams()) -> Strategy:
    parts = [p for p in text.split("+") if p]
    bad = [p for p in parts if p not in STRATEGIES]
    if bad or not parts:
        raise ConfigError(f"balancing strategy '{text}' is invalid: use one of "
                          f"{', '.join(STRATEGIES)} or a '+' combination (e.g. loss_free+redundant)")
    temper = 1.0
    if "aux" in parts:
        temper = min(temper, params.aux_residual)
    if "loss_free" in parts:
        temper = min(temper, params.loss_free_residual)
    return Strategy(text, temper, "redundant" in parts, "spill" in parts)


def temper(weights: np.ndarray, exponent: float) -> np.ndarray:
    """w**exponent renormalised along the last axis."""
    if exponent == 1.0:
        return weights
    w = np.maximum(weights, 1e-300) ** exponent
    return w / w.sum(axis=-1, keepdims=True)


def contiguous_placement(num_layers: int, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """phy2log [L, E] (expert e in slot e) and replica counts [L, E] (all ones)."""
    return (np.tile(np.arange(num_experts), (num_layers, 1)),
            np.ones((num_layers, num_experts), dtype=np.int64))


def redundant_placement(mean_load_LE: np.ndarray, num_ranks: int, num_nodes: int,
                        per_rank: int, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """phy2log [L, P] and replica counts [L, E] from the EPLB planner."""
    L, E = mean_load_LE.shape
    P = E + per_rank * num_ranks
    groups = num_groups if num_groups and num_groups % num_nodes == 0 else 1
    return place_experts(mean_load_LE, P, num_nodes, num_ranks, groups)
