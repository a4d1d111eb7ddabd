"""Least-loaded expert parallelism (LLEP, spill-over) from a step's counts: the plan of
:func:`epscale.plan.placement.plan_spill` (numpy only, shared with the step model) for
row counts given as a tensor or an array.

Legend: E experts, R ranks (the EP group). Expert e is owned by rank e // (E/R).
"""

from __future__ import annotations

import torch

from ..plan.placement import Spill, SpillPlan
from ..plan.placement import plan_spill as _plan

__all__ = ["Spill", "SpillPlan", "plan_spill"]


def plan_spill(tokens_per_expert_E, num_ranks: int, threshold: float = 1.3,
               min_rows: int = 32) -> SpillPlan:
    """Plan this step's spill-over from global per-expert row counts ([E] ints, a tensor or
    an array). Nothing moves unless max/mean rank load exceeds ``threshold``."""
    if isinstance(tokens_per_expert_E, torch.Tensor):
        tokens_per_expert_E = tokens_per_expert_E.detach().cpu().numpy()
    return _plan(tokens_per_expert_E, num_ranks, threshold, min_rows)
