"""Redundant-expert placement (EPLB-style) as tensors: :class:`Placement` (which logical
expert each physical slot holds, and the copies of each expert) built from the plan of
:func:`epscale.plan.placement.place_experts` (the algorithm, numpy only, shared with the
step model).

Legend: L MoE layers, E logical experts, P physical expert slots (E plus redundant copies),
R ranks, N nodes. Rank r holds slots [r*P/R, (r+1)*P/R).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..plan.placement import place_experts, rank_loads, round_robin_placement


@dataclass(frozen=True)
class Placement:
    """phy2log [L, P]: logical expert in each physical slot.
    log2phy [L, E, max_replicas]: physical slots of each logical expert, -1 padded.
    replica_count [L, E]: copies of each logical expert (>= 1)."""

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    replica_count: torch.Tensor
    num_ranks: int
    num_nodes: int

    @property
    def num_physical_experts(self) -> int:
        return self.phy2log.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical_experts // self.num_ranks

    def rank_loads(self, load_LE: torch.Tensor) -> torch.Tensor:
        """[L, R] load on each rank when each expert's tokens split evenly over its replicas."""
        return _rank_loads(_as_np(load_LE), self.phy2log.numpy(), self.replica_count.numpy(),
                           self.num_ranks)

    def imbalance(self, load_LE: torch.Tensor) -> torch.Tensor:
        """[L] max rank load / mean rank load (1.0 is perfect)."""
        loads = self.rank_loads(load_LE)
        return loads.max(dim=1).values / loads.mean(dim=1).clamp_min(1e-12)


def _as_np(load) -> np.ndarray:
    if isinstance(load, torch.Tensor):
        return load.detach().to(torch.float64).cpu().numpy()
    return np.asarray(load, dtype=np.float64)


def _rank_loads(load_LE: np.ndarray, phy2log: np.ndarray, counts: np.ndarray, R: int) -> torch.Tensor:
    return torch.from_numpy(rank_loads(load_LE, phy2log, counts, R))


def _build(phy2log: np.ndarray, counts: np.ndarray, R: int, N: int) -> Placement:
    L, P = phy2log.shape
    E = counts.shape[1]
    max_rep = int(counts.max())
    log2phy = -np.ones((L, E, max_rep), dtype=np.int64)
    for layer in range(L):
        fill = np.zeros(E, dtype=np.int64)
        for p, e in enumerate(phy2log[layer]):
            log2phy[layer, e, fill[e]] = p
            fill[e] += 1
    return Placement(torch.from_numpy(phy2log), torch.from_numpy(log2phy),
                     torch.from_numpy(counts), R, N)


def plan_placement(load_LE, num_physical_experts: int, num_nodes: int, num_ranks: int,
                   num_groups: int = 1) -> Placement:
    """Plan where each layer's experts and their redundant copies live
    (:func:`epscale.plan.placement.place_experts`).

    load_LE: [L, E] (or [E]) observed tokens per logical expert (any non-negative numbers).
    Returns a :class:`Placement`; never worse than round-robin in max rank load, per layer.
    """
    phy2log, counts = place_experts(_as_np(load_LE), num_physical_experts, num_nodes,
                                    num_ranks, num_groups)
    return _build(phy2log, counts, num_ranks, num_nodes)
