"""Least-loaded spill-over at run time: the slot layout on the host, and the spilled layer
against the unparallelized one (forward and backward) on real gloo groups at ws 2 and 4.

One spawn per world size; the worker loops over (backend, case).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from dist_utils import (CaseRunner, assert_no_failures, compare_grads, hot_moe, make_inputs,
                        parallel_step, reference_grads, run_distributed)
from epscale.placement.llep import plan_spill
from epscale.placement.spill import assign_slots, spill_layout


# ------------------------------------------------------------------ host-side layout
@pytest.mark.parametrize("R,E,seed", [(2, 4, 0), (4, 8, 1), (4, 16, 2), (8, 16, 3)])
def test_slots_receive_exactly_the_planned_rows(R, E, seed):
    g = torch.Generator().manual_seed(seed)
    e = E // R
    # Skewed routing: expert 0 (rank 0) is hot on every source rank.
    probs = torch.ones(E)
    probs[0], probs[1 % E] = 12.0, 5.0
    topk = [torch.multinomial(probs.expand(40 + 7 * q, E), 2, generator=g) for q in range(R)]
    topk[0][::5, 1] = -1  # some dropped assignments
    counts_RE = np.stack([np.bincount(t[t >= 0].numpy(), minlength=E) for t in topk])
    plan = plan_spill(counts_RE.sum(0), R, threshold=1.1, min_rows=3)
    assert plan.active
    lay = spill_layout(counts_RE, plan)
    W = lay.slots_per_rank
    got = np.zeros(R * W, dtype=np.int64)
    for q in range(R):
        phys = assign_slots(topk[q], lay, q)
        assert torch.equal(phys < 0, topk[q] < 0)
        np.add.at(got, phys[phys >= 0].numpy(), 1)
        # an assignment stays with its own expert: the slot is the owner's or a helper slot of it
        for x, s in zip(topk[q][topk[q] >= 0].tolist(), phys[phys >= 0].tolist()):
            r, j = divmod(s, W)
            assert (j < e and r * e + j == x) or (j >= e and lay.helped[r][j - e] == x)
    expected = np.zeros(R * W, dtype=np.int64)
    spilled = {}
    for sp in plan.spills:
        slot = sp.helper * W + e + lay.helped[sp.helper].index(sp.expert)
        expected[slot] += sp.rows
        spilled[sp.expert] = spilled.get(sp.expert, 0) + sp.rows
    for x in range(E):
        o = x // e
        expected[o * W + x - o * e] = counts_RE[:, x].sum() - spilled.get(x, 0)
    np.testing.assert_array_equal(got, expected)
    per_rank = got.reshape(R, W).sum(1)
    np.testing.assert_array_equal(per_rank, plan.rank_load_after)


# ------------------------------------------------------------------ distributed
BACKENDS = ["alltoall", "dedup", "allgather"]
# (name, MoEConfig overrides, tokens per rank fn, hot experts (bias +), layers)
CASES = [
    ("top2 hot rank0", dict(num_experts=8, top_k=2), None, (0, 1), 1),
    ("top1 one hot expert", dict(num_experts=8, top_k=1), None, (0,), 1),
    ("top4 shared aux", dict(num_experts=16, top_k=4, num_shared_experts=1,
                             aux_loss_coeff=0.01), None, (0, 1, 2), 1),
    ("capacity drops", dict(num_experts=8, top_k=3, capacity_factor=2.0), None, (0, 1), 1),
    ("uneven tokens", dict(num_experts=8, top_k=2), lambda r, w: 9 + 11 * r, (0, 1), 1),
    ("a rank has no tokens", dict(num_experts=8, top_k=2),
     lambda r, w: 0 if r == 1 else 20, (0,), 1),
    ("two layers", dict(num_experts=8, top_k=2), None, (0, 1), 2),
    ("balanced: no spill", dict(num_experts=8, top_k=2), None, (), 1),
]


def _build(over, hot, layers, seed=7):
    return hot_moe(over, hot, layers, seed, bias=10.0)


def _worker(rank, world):
    import epscale

    runner = CaseRunner(rank)
    dims = epscale.ParallelDims(dp=1, ep=world)
    _equivalence(runner, rank, world, dims, BACKENDS, CASES, f"ws={world}")
    if world == 4:
        dp2 = epscale.ParallelDims(dp=2, ep=2)
        _equivalence(runner, rank, world, dp2, ["alltoall", "dedup"],
                     [c for c in CASES if c[0] in ("top2 hot rank0", "two layers")], "dp=2 ep=2")
        # 2 emulated nodes x 2 ranks: spill-over around the hierarchical backend
        nodes = epscale.ParallelDims(dp=1, ep=4, ranks_per_node=2)
        _equivalence(runner, rank, world, nodes, ["hierarchical"], CASES, "ep=4 as 2 nodes")
    _other_cases(runner, rank, world, dims)
    return runner.failures, runner.num_cases


def _equivalence(runner, rank, world, dims, backends, cases, tag):
    import epscale
    from epscale.placement import SpillDispatcher, apply_spill

    for backend in backends:
        for name, over, tokens_fn, hot, layers in cases:
            with runner.case(f"{tag} {backend} {name}"):
                full = _build(over, hot, layers)
                par = epscale.parallelize(copy.deepcopy(full), dims, dispatcher=backend)
                apply_spill(par, dims, threshold=1.2, min_rows=2)
                tokens = [tokens_fn(r, world) if tokens_fn else 24 for r in range(world)]
                xs, gs = make_inputs(world, tokens, 32, torch.float32, seed=5)
                ref_y, ref_dx, ref_pg = reference_grads(full, xs, gs)
                y, dx = parallel_step(par, dims, xs[rank], gs[rank])
                torch.testing.assert_close(y, ref_y[rank], atol=3e-5, rtol=1e-4)
                torch.testing.assert_close(dx, ref_dx[rank], atol=3e-5, rtol=1e-4)
                compare_grads(par, ref_pg, dims, atol=3e-5, rtol=1e-4)
                spills = [m.dispatcher for m in par.modules() if isinstance(m, epscale.MoE)]
                assert all(isinstance(d, SpillDispatcher) for d in spills)
                active = [d.last_plan.active for d in spills]
                assert active == [bool(hot)] * layers, active
                rows = [d.spilled_rows() for d in spills]  # what the step record reports
                assert rows == [sum(s.rows for s in d.last_plan.spills) for d in spills]
                assert (min(rows) > 0) == bool(hot), rows
                if hot:
                    plan = spills[0].last_plan
                    assert plan.imbalance(after=True) < plan.imbalance(after=False)
                    assert {s.helper for s in plan.spills} - {0}, "no helper took rows"


def _other_cases(runner, rank, world, dims):
    import epscale
    from epscale.placement import apply_spill

    with runner.case(f"ws={world} input without grad (first layer)"):
        from epscale.parallel import sync_gradients

        full = _build(dict(num_experts=8, top_k=2), (0, 1), 1)
        par = apply_spill(epscale.parallelize(copy.deepcopy(full), dims, "dedup"), dims,
                          threshold=1.2, min_rows=2)
        xs, gs = make_inputs(world, [24] * world, 32, torch.float32, seed=5)
        _ref_y, _ref_dx, ref_pg = reference_grads(full, xs, gs)
        ((par(xs[rank]) * gs[rank]).sum()).backward()
        sync_gradients(par, dims)
        assert par.dispatcher.last_plan.active
        compare_grads(par, ref_pg, dims, atol=3e-5, rtol=1e-4)
    with runner.case("errors"):
        with pytest.raises(ValueError, match="not an EP backend"):
            apply_spill(epscale.MoE(epscale.MoEConfig(dim=8, hidden_dim=8, num_experts=8,
                                                      top_k=2)), dims)
        par = epscale.parallelize(_build(dict(num_experts=8, top_k=2), (), 1), dims, "alltoall")
        apply_spill(par, dims)
        with pytest.raises(ValueError, match="already spills"):
            apply_spill(par, dims)


@pytest.mark.parametrize("world", [2, 4])
def test_spill_equals_plain_ep(world):
    results = run_distributed(_worker, world, timeout_s=240)
    assert_no_failures(results, min_cases=len(BACKENDS) * len(CASES))
