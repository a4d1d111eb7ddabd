"""ParallelDims, parallelize and the gradient rules on real gloo process groups.

One spawn per world size; each worker runs all its cases and reports failures.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from dist_utils import (CaseRunner, assert_no_failures, compare_grads, make_inputs,
                        parallel_step, reference_grads, run_distributed)


def _dims_checks(runner: CaseRunner, rank: int, world: int) -> None:
    import epscale
    from epscale import ConfigError

    with runner.case("dims ep=world"):
        dims = epscale.ParallelDims(dp=1, ep=world)
        assert (dims.rank, dims.world_size, dims.dp, dims.ep) == (rank, world, 1, world)
        assert (dims.ep_rank, dims.dp_rank) == (rank, 0)
        assert dist.get_process_group_ranks(dims.ep_group) == list(range(world))
        assert dist.get_process_group_ranks(dims.dp_group) == [rank]
        assert dims.mesh.mesh_dim_names == ("dp", "ep")
        assert tuple(dims.mesh.mesh.shape) == (1, world)
        assert dims.ranks_per_node == world and dims.num_nodes == 1 and dims.node_rank == 0
    with runner.case("dims of a Layout, groups built on first use"):
        dims = epscale.ParallelDims(epscale.Layout(world, ep=world))
        assert dims.layout.ranks_per_node == world and "ep_group" not in vars(dims)
        assert dist.get_process_group_ranks(dims.ep_group) == list(range(world))
        assert {"mesh", "dp_group", "ep_intra_group"} <= set(vars(dims))
    if world == 4:
        with runner.case("dims dp=2 ep=2"):
            dims = epscale.ParallelDims(dp=2, ep=2)
            assert (dims.dp_rank, dims.ep_rank) == divmod(rank, 2)
            assert dist.get_process_group_ranks(dims.ep_group) == [rank // 2 * 2, rank // 2 * 2 + 1]
            assert dist.get_process_group_ranks(dims.dp_group) == [rank % 2, rank % 2 + 2]
            # The mesh and the groups coincide.
            assert dims.mesh.get_group("ep") is dims.ep_group
            assert dims.mesh["ep"].mesh.tolist() == dist.get_process_group_ranks(dims.ep_group)
        with runner.case("dims emulated nodes"):
            dims = epscale.ParallelDims(dp=1, ep=4, ranks_per_node=2)
            assert dims.num_nodes == 2 and dims.node_rank == rank // 2
            assert dims.ep_num_nodes == 2 and dims.ep_ranks_per_node == 2
            assert dist.get_process_group_ranks(dims.ep_inter_group) == [rank % 2, rank % 2 + 2]
            assert dist.get_process_group_ranks(dims.ep_intra_group) == [rank // 2 * 2, rank // 2 * 2 + 1]
    with runner.case("error world != dp*ep"):
        with pytest.raises(ConfigError, match=rf"pp x dp x ep = 1 x 1 x 3 = 3 must equal the number of processes \({world}\)"):
            epscale.ParallelDims(dp=1, ep=3)
    with runner.case("error ranks_per_node"):
        with pytest.raises(ConfigError, match="ranks_per_node"):
            epscale.ParallelDims(dp=1, ep=world, ranks_per_node=3)
    dims = epscale.ParallelDims(dp=1, ep=world)
    cfg = epscale.MoEConfig(dim=8, hidden_dim=8, num_experts=2 * world, top_k=2)
    with runner.case("error unknown dispatcher"):
        with pytest.raises(ConfigError, match=r"'alltoal'.*'alltoall'.*'dedup'.*did you mean"):
            epscale.parallelize(epscale.MoE(cfg), dims, dispatcher="alltoal")
    with runner.case("error E % ep"):
        bad = epscale.MoEConfig(dim=8, hidden_dim=8, num_experts=2 * world + 1, top_k=2)
        with pytest.raises(ConfigError, match=rf"must divide moe.num_experts \({2 * world + 1}\)"):
            epscale.parallelize(epscale.MoE(bad), dims, dispatcher="alltoall")
    with runner.case("error payload"):
        with pytest.raises(ConfigError, match="'fp8' needs dispatcher 'dedup' or 'hierarchical'"):
            epscale.parallelize(epscale.MoE(cfg), dims, dispatcher="alltoall", payload="fp8")
        with pytest.raises(ConfigError, match="'fp16' is invalid"):
            epscale.parallelize(epscale.MoE(cfg), dims, dispatcher="dedup", payload="fp16")
    with runner.case("error local with ep>1"):
        with pytest.raises(ConfigError, match="'local' needs ep=1"):
            epscale.parallelize(epscale.MoE(cfg), dims, dispatcher="local")
    with runner.case("error deepep fallback"):
        with pytest.raises(RuntimeError, match="'dedup'"):
            epscale.parallelize(epscale.MoE(cfg), dims, dispatcher="deepep")
    if world == 4:
        with runner.case("error topk_groups > nodes"):
            nd = epscale.ParallelDims(dp=1, ep=4, ranks_per_node=2)
            grp = epscale.MoEConfig(dim=8, hidden_dim=8, num_experts=8, top_k=2, num_groups=4,
                                    topk_groups=3)
            with pytest.raises(ConfigError, match="topk_groups = 3 is more than the 2 nodes"):
                epscale.parallelize(epscale.MoE(grp), nd, dispatcher="hierarchical")
    with runner.case("names and shapes kept"):
        moe = epscale.MoE(cfg)
        names = [n for n, _ in moe.named_parameters()]
        full_w1 = moe.experts.w1.detach().clone()
        epscale.parallelize(moe, dims, dispatcher="alltoall")
        assert [n for n, _ in moe.named_parameters()] == names
        assert moe.experts.w1.shape == (2, 8, 8) and moe.experts.num_experts == 2
        assert torch.equal(moe.experts.w1, full_w1[2 * rank:2 * rank + 2])
        from epscale.parallel import is_expert_param
        assert is_expert_param(moe.experts.w1) and not is_expert_param(moe.router.gate.weight)
        with pytest.raises(ValueError, match="already parallelized"):
            epscale.parallelize(moe, dims, dispatcher="alltoall")


class _TwoLayer(torch.nn.Module):
    """A tiny model: a dense projection (a world-synced param) then two MoE layers."""

    def __init__(self, cfg):
        super().__init__()
        import epscale
        self.proj = torch.nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.moe1 = epscale.MoE(cfg)
        self.moe2 = epscale.MoE(cfg)

    def forward(self, x):
        h = self.proj(x)
        h = h + self.moe1(h)
        return h + self.moe2(h)


def _grad_rules(runner: CaseRunner, rank: int, world: int, dp: int, ep: int,
                dispatchers=("alltoall", "dedup", "allgather"), ranks_per_node=None) -> None:
    """dp x ep: synced grads equal the unparallelized model's grads of the mean loss."""
    import epscale

    dims = epscale.ParallelDims(dp=dp, ep=ep, ranks_per_node=ranks_per_node)
    for dispatcher in dispatchers:
        for shared, cap in ((True, None), (False, 1.0)):
            with runner.case(f"grad rules dp={dp} ep={ep} {dispatcher} shared={shared} cap={cap}"):
                torch.manual_seed(7)
                cfg = epscale.MoEConfig(dim=16, hidden_dim=12, num_experts=4 * ep, top_k=2,
                                        num_shared_experts=int(shared), capacity_factor=cap,
                                        aux_loss_coeff=0.01)
                full = _TwoLayer(cfg)
                par = epscale.parallelize(copy.deepcopy(full), dims, dispatcher=dispatcher)
                xs, gs = make_inputs(world, [6 + 2 * r for r in range(world)], 16, torch.float32)
                ref_y, ref_dx, ref_pg = reference_grads(full, xs, gs)
                for _ in range(2):  # the second step reuses the kept (workspace) buffers
                    y, dx = parallel_step(par, dims, xs[rank], gs[rank])
                    torch.testing.assert_close(y, ref_y[rank], atol=1e-5, rtol=1e-4)
                    torch.testing.assert_close(dx, ref_dx[rank], atol=1e-5, rtol=1e-4)
                    compare_grads(par, ref_pg, dims, atol=1e-5, rtol=1e-4)


def _worker(rank: int, world: int):
    runner = CaseRunner(rank)
    _dims_checks(runner, rank, world)
    _grad_rules(runner, rank, world, 1, world)
    if world == 4:
        _grad_rules(runner, rank, world, 2, 2)
        _grad_rules(runner, rank, world, 4, 1)
        # One rank per emulated node: the hierarchical backend's inter-node stage per DP replica.
        _grad_rules(runner, rank, world, 2, 2, ("hierarchical",), ranks_per_node=1)
    return runner.failures, runner.num_cases


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_dims_and_gradient_rules(world):
    assert_no_failures(run_distributed(_worker, world), min_cases=10)
