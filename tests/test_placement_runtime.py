"""Redundant experts at run time: the placed layer equals the unparallelized one (forward,
backward, replica gradients summed), and a live re-placement moves weights and AdamW state
without changing the function or the training trajectory. Real gloo groups, ws 2 and 4.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from dist_utils import (CaseRunner, assert_no_failures, hot_moe, make_inputs, reference_grads,
                        run_distributed)
import epscale
from epscale.placement import plan_placement
from epscale.placement.replicas import (placement_from_dict, placement_to_dict,
                                       spread_over_replicas)


# ------------------------------------------------------------------ host-only
def test_assignments_split_evenly_over_replicas():
    phy2log = torch.tensor([0, 1, 0, 2, 0, 3, 1, 3])          # expert 0 x3, 1 x2, 3 x2
    counts = torch.bincount(phy2log, minlength=4)
    slots = torch.argsort(phy2log, stable=True)
    first = torch.cumsum(counts, 0) - counts
    g = torch.Generator().manual_seed(0)
    idx = torch.multinomial(torch.tensor([6.0, 3, 1, 2]).expand(50, 4), 2, generator=g)
    idx[::7, 0] = -1
    for rotate in (0, 1, 5):
        phys = spread_over_replicas(idx, slots, first, counts, rotate)
        assert torch.equal(phys < 0, idx < 0)
        kept = idx >= 0
        assert torch.equal(phy2log[phys[kept]], idx[kept])   # same logical expert
        per_slot = torch.bincount(phys[kept], minlength=8)
        for x in range(4):
            loads = per_slot[phy2log == x]
            assert int(loads.max() - loads.min()) <= 1, (x, loads)


def test_placement_dict_round_trip():
    load = torch.tensor([[50.0, 1, 1, 1, 9, 1, 1, 1], [1.0, 1, 1, 30, 1, 1, 1, 1]])
    pl = plan_placement(load, 12, 1, 4)
    back = placement_from_dict(placement_to_dict(pl))
    assert torch.equal(back.phy2log, pl.phy2log)
    assert torch.equal(back.log2phy, pl.log2phy)
    assert torch.equal(back.replica_count, pl.replica_count)


# ------------------------------------------------------------------ distributed
BACKENDS = [("alltoall", 1), ("dedup", 1), ("allgather", 1), ("dedup", 2)]  # (name, chunks)
CASES = [  # (name, MoEConfig overrides, hot experts, extra slots per rank)
    ("top2 +1/rank", dict(num_experts=8, top_k=2), (0, 1), 1),
    ("top2 +2/rank", dict(num_experts=8, top_k=2), (0,), 2),
    ("top1 capacity", dict(num_experts=8, top_k=1, capacity_factor=1.5), (3,), 1),
    ("top4 sigmoid shared aux", dict(num_experts=16, top_k=4, score_func="sigmoid",
                                     num_shared_experts=1, aux_loss_coeff=0.01), (0, 5), 1),
]


def _hot_model(over, hot, layers=1, seed=3):
    return hot_moe(over, hot, layers, seed, bias=0.5)


def _hot_load(E, hot, layers):
    load = torch.ones(layers, E)
    for x in hot:
        load[:, x] = 20.0
    return load


def _check_grads(par, ref_pg, placement, dims, atol=2e-5, rtol=1e-4):
    from epscale.parallel import is_expert_param
    from epscale.placement.replicas import local_slots

    layer_of = {}
    for i, (name, m) in enumerate((n, m) for n, m in par.named_modules()
                                  if type(m).__name__ == "MoE"):
        layer_of[name] = i
    for name, p in par.named_parameters():
        ref = ref_pg[name]
        if is_expert_param(p):
            prefix = name.rsplit(".experts.", 1)[0] if ".experts." in name else ""
            layer = layer_of[prefix]
            ref = ref[local_slots(placement, layer, dims.ep_rank)]
        torch.testing.assert_close(p.grad.float(), ref, atol=atol, rtol=rtol,
                                   msg=lambda m: f"grad of {name}: {m}")


def _step(par, dims, x, g):
    from epscale.parallel import sync_gradients

    par.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = par(x)
    aux = sum((m.aux_loss for m in par.modules() if hasattr(m, "aux_loss")), torch.zeros(()))
    ((y.float() * g.float()).sum() + aux).backward()
    sync_gradients(par, dims)  # includes the replica-gradient sum
    return y.detach(), x.grad


def _equivalence_cases(runner, rank, world, dims, tag, backends=BACKENDS):
    from epscale.placement import PlacedDispatcher
    from epscale.placement.replicas import expert_grad_sq_norm

    for backend, chunks in backends:
        for name, over, hot, extra in CASES:
            if chunks > 1 and (over.get("aux_loss_coeff") or over.get("capacity_factor")):
                continue  # the overlapped path is exercised on the plain cases
            with runner.case(f"{tag} {backend} x{chunks} {name}"):
                full = _hot_model(over, hot)
                E = over["num_experts"]
                pl = plan_placement(_hot_load(E, hot, 1), E + extra * dims.ep, 1, dims.ep)
                assert int(pl.replica_count.max()) > 1
                par = epscale.parallelize(copy.deepcopy(full), dims, dispatcher=backend,
                                          overlap_chunks=chunks, placement=pl)
                assert isinstance(par.dispatcher, PlacedDispatcher)
                # the inner backend pipelines (dispatch_compute_combine) when chunks > 1
                assert getattr(par.dispatcher.inner, "overlap_chunks", 1) == chunks
                assert par.experts.w1.shape[0] == pl.slots_per_rank
                xs, gs = make_inputs(dims.world_size, [20] * dims.world_size, 32,
                                     torch.float32, seed=9)
                ref_y, ref_dx, ref_pg = reference_grads(full, xs, gs)
                y, dx = _step(par, dims, xs[rank], gs[rank])
                torch.testing.assert_close(y, ref_y[rank], atol=2e-5, rtol=1e-4)
                torch.testing.assert_close(dx, ref_dx[rank], atol=2e-5, rtol=1e-4)
                _check_grads(par, ref_pg, pl, dims)
                # the logical expert grad norm counts every expert once
                sq = expert_grad_sq_norm(par, dims)
                dist.all_reduce(sq, group=dims.ep_group)
                ref_sq = sum(float(ref_pg[f"experts.{n}"].pow(2).sum()) for n in ("w1", "w2", "w3"))
                assert abs(float(sq) - ref_sq) <= 1e-4 * ref_sq, (float(sq), ref_sq)


def _replacement_case(runner, rank, world, dims, tag):
    from epscale.parallel import is_expert_param
    from epscale.placement import Rebalancer, get_placement
    from epscale.placement.replicas import local_slots

    with runner.case(f"{tag} re-placement keeps function and training"):
        over, hot = dict(num_experts=8, top_k=2), (0, 1)
        full = _hot_model(over, hot, layers=2)
        pl = plan_placement(_hot_load(8, hot, 2), 8 + dims.ep, 1, dims.ep)
        par = epscale.parallelize(copy.deepcopy(full), dims, dispatcher="alltoall", placement=pl)
        # eps large enough that Adam does not blow up rounding noise in grads that are
        # zero in exact arithmetic (non-chosen router logits under route_norm)
        hp = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-3)
        opt_ref = torch.optim.AdamW(full.parameters(), **hp)
        opt = torch.optim.AdamW(par.parameters(), **hp)
        W = dims.world_size

        def train_step(step):
            xs, gs = make_inputs(W, [16] * W, 32, torch.float32, seed=100 + step)
            full.zero_grad()
            total = sum((full(x) * g).sum() for x, g in zip(xs, gs)) / W
            total.backward()
            opt_ref.step()
            _step(par, dims, xs[rank], gs[rank])
            opt.step()

        def fixed_loss():
            xs, gs = make_inputs(W, [16] * W, 32, torch.float32, seed=7)
            with torch.no_grad():
                return float((par(xs[rank]) * gs[rank]).sum())

        def compare_weights():
            placement = get_placement(par)
            ref = dict(full.named_parameters())
            for pname, p in par.named_parameters():
                r = ref[pname]
                if is_expert_param(p):
                    layer = int(pname.split(".")[0])
                    r = r[local_slots(placement, layer, dims.ep_rank)]
                torch.testing.assert_close(p.detach(), r.detach(), atol=1e-5, rtol=1e-4,
                                           msg=lambda m: f"{pname}: {m}")

        for step in (1, 2):
            train_step(step)
        compare_weights()
        before = fixed_loss()
        reb = Rebalancer(par, dims, every=2, optimizer=opt)
        reb.observe(_hot_load(8, (5, 6), 2) * torch.tensor([[1.0], [3.0]]))
        new = reb.maybe_replace(2)
        assert new is not None and reb.num_moves == 1
        assert not torch.equal(new.phy2log, pl.phy2log)
        assert torch.equal(get_placement(par).phy2log, new.phy2log)
        assert reb.maybe_replace(3) is None                   # not due
        after = fixed_loss()
        assert abs(after - before) <= 1e-6 * max(1.0, abs(before)), (before, after)
        compare_weights()
        for step in (3, 4):                                   # Adam state moved with them
            train_step(step)
        compare_weights()


def _error_cases(runner, rank, world, dims, tag):
    from epscale.placement import move_to_placement

    over = dict(num_experts=8, top_k=2)
    with runner.case(f"{tag} errors"):
        wrong = plan_placement(torch.ones(8), 8 + 2 * dims.ep, 1, dims.ep * 2)
        with pytest.raises(ValueError, match="planned for"):
            epscale.parallelize(_hot_model(over, ()), dims, placement=wrong)
        two = plan_placement(torch.ones(2, 8), 8 + dims.ep, 1, dims.ep)
        with pytest.raises(ValueError, match="2 layer"):
            epscale.parallelize(_hot_model(over, ()), dims, placement=two)
        pl = plan_placement(torch.ones(8), 8 + dims.ep, 1, dims.ep)
        par = epscale.parallelize(_hot_model(over, ()), dims, dispatcher="alltoall", placement=pl)
        with pytest.raises(ValueError, match="already parallelized"):
            epscale.parallelize(par, dims, placement=pl)
        bigger = plan_placement(torch.ones(8), 8 + 2 * dims.ep, 1, dims.ep)
        with pytest.raises(ValueError, match="slot count is fixed"):
            move_to_placement(par, dims, bigger)


def _worker(rank, world):
    import epscale

    runner = CaseRunner(rank)
    dims = epscale.ParallelDims(dp=1, ep=world)
    _equivalence_cases(runner, rank, world, dims, f"ep={world}")
    _replacement_case(runner, rank, world, dims, f"ep={world}")
    _error_cases(runner, rank, world, dims, f"ep={world}")
    if world == 4:
        dp2 = epscale.ParallelDims(dp=2, ep=2)
        _equivalence_cases(runner, rank, world, dp2, "dp=2 ep=2")
        _replacement_case(runner, rank, world, dp2, "dp=2 ep=2")
        # 2 emulated nodes x 2 ranks: the hierarchical backend under the placement
        nodes = epscale.ParallelDims(dp=1, ep=4, ranks_per_node=2)
        _equivalence_cases(runner, rank, world, nodes, "ep=4 as 2 nodes",
                           backends=[("hierarchical", 1), ("hierarchical", 2)])
    return runner.failures, runner.num_cases


@pytest.mark.parametrize("world", [2, 4])
def test_placement_runtime(world):
    results = run_distributed(_worker, world, timeout_s=240)
    assert_no_failures(results, min_cases=(len(BACKENDS) - 1) * len(CASES) + 2)
