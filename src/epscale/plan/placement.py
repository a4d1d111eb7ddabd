"""Where experts live, planned from loads (numpy only): the redundant-expert placement
(EPLB-style: which logical expert each physical slot holds) and the spill-over plan
(LLEP: which hot experts' rows move to the least-loaded ranks for one step). The runtime
(:mod:`epscale.placement`) applies these plans to tensors; the step model
(:mod:`.step_model`) scores them without running anything.

Legend: L MoE layers, E logical experts, P physical expert slots (E plus redundant copies),
R ranks, N nodes, G expert groups. Rank r holds slots [r*P/R, (r+1)*P/R); node n holds
ranks [n*R/N, (n+1)*R/N).

Redundant placement optimises the maximum per-rank load (sum over the rank's slots of the
slot's load, where a slot's load is its logical expert's load divided by that expert's
replica count), because the slowest rank sets the step time. Every rank gets the same
number of slots. Hierarchical policy (G divisible by N): whole expert groups are packed
onto nodes by load (so group-limited routing keeps bounding the nodes a token touches),
the hottest experts of each node are replicated inside the node (the next replica goes to
the expert with the highest load per replica), then the node's replicas are packed onto
its ranks, and a swap pass moves load from the busiest to the least busy rank while it
helps. Global policy otherwise: the same over the whole cluster as one node. The result
is never worse than the round-robin placement: both are scored and the better one is
returned.

Spill-over: expert e is owned by rank e // (E/R). The plan is a list of :class:`Spill`
(expert, owner, helper, rows): the helper receives a copy of the expert's weights for the
step, computes ``rows`` of that expert's assignments, and sends the gradients back to the
owner. Planning is a longest-processing-time pass: the heaviest experts of overloaded
ranks are split first, each piece goes to the currently least-loaded rank, until every
rank is at or below the target (the mean load) or the pieces would fall under
``min_rows`` (tiny GEMMs cost more than they save).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


def rank_loads(load_LE: np.ndarray, phy2log: np.ndarray, counts: np.ndarray, R: int) -> np.ndarray:
    """[L, R] load on each rank when each expert's tokens split evenly over its replicas."""
    L, P = phy2log.shape
    slot_load = np.take_along_axis(load_LE / counts, phy2log, axis=1)  # [L, P]
    return slot_load.reshape(L, R, P // R).sum(axis=2)


def validate_layout(num_experts: int, num_physical: int, num_nodes: int, num_ranks: int,
                    num_groups: int) -> None:
    def bad(msg: str):
        raise ValueError(f"plan_placement: {msg}")
    if num_physical < num_experts:
        bad(f"num_physical_experts={num_physical} must be >= the {num_experts} logical experts")
    if num_ranks < 1 or num_physical % num_ranks:
        bad(f"num_physical_experts={num_physical} must divide evenly over num_ranks={num_ranks}")
    if num_nodes < 1 or num_ranks % num_nodes:
        bad(f"num_ranks={num_ranks} must divide evenly over num_nodes={num_nodes}")
    if num_groups < 1 or num_experts % num_groups:
        bad(f"num_groups={num_groups} must divide the {num_experts} experts")


def _balanced_pack(weights: np.ndarray, num_bins: int, per_bin: int) -> np.ndarray:
    """Assign items to bins, exactly ``per_bin`` items each, heaviest first onto the lightest
    bin that still has room (LPT with a cardinality limit). Returns the bin of each item."""
    order = np.argsort(-weights, kind="stable")
    heap = [(0.0, b) for b in range(num_bins)]
    fill = np.zeros(num_bins, dtype=np.int64)
    out = np.empty(len(weights), dtype=np.int64)
    for item in order:
        load, b = heapq.heappop(heap)
        out[item] = b
        fill[b] += 1
        if fill[b] < per_bin:
            heapq.heappush(heap, (load + float(weights[item]), b))
    return out


def _replicate(load_e: np.ndarray, num_slots: int) -> np.ndarray:
    """Replica counts summing to num_slots: each extra copy goes to the highest load/copy."""
    counts = np.ones(len(load_e), dtype=np.int64)
    heap = [(-float(l), e) for e, l in enumerate(load_e)]
    heapq.heapify(heap)
    for _ in range(num_slots - len(load_e)):
        _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (-float(load_e[e]) / counts[e], e))
    return counts


def _improve_by_swaps(slot_w: np.ndarray, slot_rank: np.ndarray, num_ranks: int,
                      max_rounds: int = 64) -> np.ndarray:
    """Swap one slot of the busiest rank with one of another rank while the max drops."""
    slot_rank = slot_rank.copy()
    for _ in range(max_rounds):
        loads = np.bincount(slot_rank, weights=slot_w, minlength=num_ranks)
        hi = int(np.argmax(loads))
        best = (loads[hi], None)
        hi_slots = np.nonzero(slot_rank == hi)[0]
        for lo in np.argsort(loads)[: max(1, num_ranks - 1)]:
            if lo == hi:
                continue
            lo_slots = np.nonzero(slot_rank == lo)[0]
            # delta[i, j]: load moved from hi to lo when hi's slot i swaps with lo's slot j.
            delta = slot_w[hi_slots][:, None] - slot_w[lo_slots][None, :]
            new_max = np.maximum(loads[hi] - delta, loads[lo] + delta)
            i, j = np.unravel_index(np.argmin(new_max), new_max.shape)
            if new_max[i, j] < best[0] - 1e-12:
                best = (new_max[i, j], (hi_slots[i], lo_slots[j]))
        if best[1] is None:
            break
        a, b = best[1]
        slot_rank[a], slot_rank[b] = slot_rank[b], slot_rank[a]
    return slot_rank


def _place_layer(load_e: np.ndarray, P: int, N: int, R: int, G: int) -> tuple[np.ndarray, np.ndarray]:
    E = len(load_e)
    if G % N or E % N or P % N:
        N_eff = 1  # global policy
    else:
        N_eff = N
    ranks_per_node, slots_per_node = R // N_eff, P // N_eff
    slots_per_rank = P // R
    # 1. groups -> nodes
    per_group = E // G
    group_load = load_e.reshape(G, per_group).sum(axis=1)
    group_node = _balanced_pack(group_load, N_eff, G // N_eff)
    phy2log = np.empty(P, dtype=np.int64)
    counts = np.empty(E, dtype=np.int64)
    for n in range(N_eff):
        experts = np.concatenate([np.arange(g * per_group, (g + 1) * per_group)
                                  for g in np.nonzero(group_node == n)[0]])
        # 2. replicate inside the node
        c = _replicate(load_e[experts], slots_per_node)
        counts[experts] = c
        slot_expert = np.repeat(experts, c)
        slot_w = np.repeat(load_e[experts] / c, c)
        # 3. replicas -> ranks of the node, then swap refinement
        slot_rank = _balanced_pack(slot_w, ranks_per_node, slots_per_rank)
        slot_rank = _improve_by_swaps(slot_w, slot_rank, ranks_per_node)
        for r in range(ranks_per_node):
            mine = slot_expert[slot_rank == r]
            start = (n * ranks_per_node + r) * slots_per_rank
            phy2log[start:start + slots_per_rank] = np.sort(mine)
    return phy2log, counts


def round_robin_placement(num_layers: int, num_experts: int, num_physical: int) -> tuple[np.ndarray, np.ndarray]:
    """Slot p holds expert p mod E: the layout with no knowledge of the loads."""
    phy2log = np.tile(np.arange(num_physical) % num_experts, (num_layers, 1))
    counts = np.stack([np.bincount(row, minlength=num_experts) for row in phy2log])
    return phy2log, counts


def place_experts(load_LE, num_physical_experts: int, num_nodes: int, num_ranks: int,
                  num_groups: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(phy2log [L, P], replica counts [L, E]): where each layer's experts and their
    redundant copies live, for ``load_LE`` ([L, E] or [E], any non-negative numbers: the
    observed tokens per logical expert); never worse than round-robin in max rank load,
    per layer."""
    load = np.asarray(load_LE, dtype=np.float64)
    if load.ndim == 1:
        load = load[None]
    if (load < 0).any() or not np.isfinite(load).all():
        raise ValueError("plan_placement: load_LE must be finite and non-negative")
    L, E = load.shape
    P, N, R, G = num_physical_experts, num_nodes, num_ranks, num_groups
    validate_layout(E, P, N, R, G)
    rr_phy, rr_counts = round_robin_placement(L, E, P)
    rr_loads = rank_loads(load, rr_phy, rr_counts, R).max(axis=1)
    phy2log = np.empty((L, P), dtype=np.int64)
    counts = np.empty((L, E), dtype=np.int64)
    for layer in range(L):
        p2l, c = _place_layer(load[layer], P, N, R, G)
        ours = rank_loads(load[layer:layer + 1], p2l[None], c[None], R).max()
        if ours <= rr_loads[layer] + 1e-9:
            phy2log[layer], counts[layer] = p2l, c
        else:
            phy2log[layer], counts[layer] = rr_phy[layer], rr_counts[layer]
    return phy2log, counts


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
