"""Placement planners: redundant experts (EPLB-style) and spill-over (LLEP)."""

import numpy as np
import pytest
import torch

from epscale.placement import plan_placement, round_robin_placement
from epscale.placement.eplb import _rank_loads
from epscale.placement.llep import plan_spill


def zipf_load(num_experts, s, seed, total=100_000):
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, num_experts + 1) ** s
    return torch.tensor(rng.permutation(w / w.sum()) * total)


def greedy_no_replica(load_E, num_ranks):
    """The simple greedy policy: no copies, heaviest expert onto the lightest rank."""
    E = len(load_E)
    per = E // num_ranks
    loads, fill = np.zeros(num_ranks), np.zeros(num_ranks, dtype=int)
    for e in np.argsort(-load_E.numpy()):
        r = min((r for r in range(num_ranks) if fill[r] < per), key=lambda r: loads[r])
        loads[r] += float(load_E[e])
        fill[r] += 1
    return loads.max() / loads.mean()


def rr_imbalance(load_LE, P, R):
    phy, counts = round_robin_placement(load_LE.shape[0], load_LE.shape[1], P)
    loads = _rank_loads(load_LE.numpy().astype(float), phy, counts, R)
    return loads.max(dim=1).values / loads.mean(dim=1)


@pytest.mark.parametrize("P,N,R,G", [(64, 1, 8, 1), (72, 2, 8, 8), (80, 2, 8, 4), (96, 4, 8, 8),
                                     (16, 2, 4, 2), (24, 3, 6, 4)])
def test_placement_invariants(P, N, R, G):
    E = 64 if P >= 64 else 16
    load = torch.stack([zipf_load(E, s, i) for i, s in enumerate((0.0, 0.8, 1.2))])
    pl = plan_placement(load, P, N, R, G)
    L = load.shape[0]
    assert pl.phy2log.shape == (L, P)
    assert pl.slots_per_rank == P // R
    for layer in range(L):
        counts = torch.bincount(pl.phy2log[layer], minlength=E)
        assert torch.equal(counts, pl.replica_count[layer])
        assert int(counts.min()) >= 1 and int(counts.sum()) == P
        for e in range(E):
            slots = [int(p) for p in pl.log2phy[layer, e] if p >= 0]
            assert len(slots) == int(counts[e])
            assert all(int(pl.phy2log[layer, p]) == e for p in slots)
    # total load is conserved by the per-rank view
    assert torch.allclose(pl.rank_loads(load).sum(1), load.sum(1).double())


def test_never_worse_than_round_robin_on_random_inputs():
    rng = np.random.default_rng(1)
    for trial in range(150):
        E = int(rng.choice([8, 16, 32]))
        R = int(rng.choice([2, 4, 8]))
        N = int(rng.choice([1, 2])) if R % 2 == 0 else 1
        P = E + R * int(rng.integers(0, 3))
        G = int(rng.choice([1, 2, 4]))
        kind = trial % 3
        if kind == 0:
            load = rng.integers(0, 1000, size=(2, E))
        elif kind == 1:
            load = rng.pareto(1.0, size=(2, E)) * 100
        else:
            load = np.zeros((2, E)); load[:, rng.integers(0, E)] = 500
        load = torch.tensor(load, dtype=torch.float64)
        pl = plan_placement(load, P, N, R, G)
        assert (pl.imbalance(load) <= rr_imbalance(load, P, R) + 1e-9).all(), (E, R, N, P, G)


@pytest.mark.parametrize("s", [0.8, 1.2])
def test_beats_greedy_on_skew_with_redundant_experts(s):
    load = zipf_load(64, s, seed=3)
    greedy = greedy_no_replica(load, 8)
    pl = plan_placement(load, 80, num_nodes=1, num_ranks=8)
    assert float(pl.imbalance(load)[0]) < greedy
    assert float(pl.imbalance(load)[0]) < 1.1  # 16 redundant slots flatten Zipf skew


def test_hierarchical_keeps_groups_on_nodes():
    load = zipf_load(64, 1.0, seed=5)
    pl = plan_placement(load, 64, num_nodes=2, num_ranks=8, num_groups=8)
    per_node = 32
    for n in range(2):
        experts = set(pl.phy2log[0, n * per_node:(n + 1) * per_node].tolist())
        groups = {e // 8 for e in experts}
        assert len(groups) == 4 and len(experts) == 32  # whole groups, 4 per node


def test_placement_errors_name_the_argument():
    with pytest.raises(ValueError, match="num_physical_experts=60"):
        plan_placement(torch.ones(64), 60, 1, 4)
    with pytest.raises(ValueError, match="num_ranks=3"):
        plan_placement(torch.ones(64), 64, 1, 3)
    with pytest.raises(ValueError, match="non-negative"):
        plan_placement(-torch.ones(64), 64, 1, 4)


def test_spill_plan_balances_and_conserves_rows():
    load = (zipf_load(64, 1.2, seed=0, total=4096 * 8 * 8)).long()
    plan = plan_spill(load, 8, threshold=1.3, min_rows=32)
    assert plan.active and plan.imbalance(after=False) > 2
    assert plan.imbalance(after=True) < 1.05
    moved = {}
    for sp in plan.spills:
        assert sp.owner == sp.expert // 8 and sp.helper != sp.owner and sp.rows >= 32
        moved[sp.expert] = moved.get(sp.expert, 0) + sp.rows
    assert all(moved[e] <= int(load[e]) for e in moved)
    assert sum(plan.rank_load_after) == sum(plan.rank_load_before) == int(load.sum())


def test_spill_not_triggered_below_threshold_and_respects_min_rows():
    assert not plan_spill(torch.full((16,), 100), 4).active
    load = torch.tensor([130, 100, 100, 100, 100, 100, 100, 100])  # 1.15x: under threshold
    assert not plan_spill(load, 4, threshold=1.3).active
    load = torch.tensor([400, 0, 0, 0, 0, 0, 0, 0])
    assert not plan_spill(load, 4, threshold=1.3, min_rows=1000).active
    with pytest.raises(ValueError, match="threshold"):
        plan_spill(load, 4, threshold=0.5)
