"""Least-loaded expert parallelism (LLEP, spill-over): when one step's routing overloads
some ranks, move part of their hot experts' rows to the least-loaded ranks for this step.

Legend: E experts, R ranks (the EP group). Expert e is owned by rank e // (E/R).

The plan is a list of :class:`Spill` (expert, owner, helper, rows): the helper receives a
copy of the expert's weights for the step, computes ``rows`` of that expert's assignments,
and sends the gradients back to the owner. Planning is a longest-processing-time pass:
the heaviest experts of overloaded ranks are split first, each piece goes to the currently
least-loaded rank, until every rank is at or below the target (the mean load) or the pieces
would fall under ``min_rows`` (tiny GEMMs cost more than they save).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Spill:
    expert: int
    owner: int
    helper: int
    rows: int


@dataclass(frozen=True)
class SpillPlan:
    spills: tuple[Spill, ...]
    rank_load_before: tuple[int, ...]
    rank_load_after: tuple[int, ...]

    @property
    def active(self) -> bool:
        return bool(self.spills)

    def imbalance(self, after: bool = True) -> float:
        loads = np.asarray(self.rank_load_after if after else self.rank_load_before, dtype=float)
        return float(loads.max() / max(loads.mean(), 1e-12))


def plan_spill(tokens_per_expert_E, num_ranks: int, threshold: float = 1.3,
               min_rows: int = 32) -> SpillPlan:
    """Plan this step's spill-over from global per-expert row counts ([E] ints).

    Nothing moves unless max/mean rank load exceeds ``threshold``.
    """
    if isinstance(tokens_per_expert_E, torch.Tensor):
        tokens_per_expert_E = tokens_per_expert_E.detach().cpu().numpy()
    load_E = np.asarray(tokens_per_expert_E, dtype=np.int64)
    E, R = len(load_E), num_ranks
    if R < 1 or E % R:
        raise ValueError(f"plan_spill: {E} experts do not divide over {R} ranks")
    if threshold < 1.0:
        raise ValueError(f"plan_spill: threshold={threshold} must be >= 1.0 (max/mean load)")
    if min_rows < 1:
        raise ValueError(f"plan_spill: min_rows={min_rows} must be >= 1")
    per_rank = E // R
    owner_E = np.arange(E) // per_rank
    rank_load = np.bincount(owner_E, weights=load_E, minlength=R).astype(np.int64)
    before = tuple(int(v) for v in rank_load)
    mean = rank_load.sum() / R
    if rank_load.max() <= threshold * mean or mean == 0:
        return SpillPlan((), before, before)
    target = int(np.ceil(mean))
    remaining_E = load_E.copy()  # rows still computed by the owner
    spills: list[Spill] = []
    # Heaviest experts first, from overloaded ranks only.
    for e in np.argsort(-load_E, kind="stable"):
        owner = int(owner_E[e])
        while rank_load[owner] > target and remaining_E[e] > 0:
            helper = int(np.argmin(rank_load))
            if helper == owner:
                break
            room = target - rank_load[helper]
            rows = int(min(rank_load[owner] - target, room, remaining_E[e]))
            if rows < min_rows:
                break
            spills.append(Spill(int(e), owner, helper, rows))
            remaining_E[e] -= rows
            rank_load[owner] -= rows
            rank_load[helper] += rows
    return SpillPlan(tuple(spills), before, tuple(int(v) for v in rank_load))
