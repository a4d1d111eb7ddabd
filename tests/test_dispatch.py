"""Every EP backend against the unparallelized layer, forward and backward, on real gloo
process groups: world sizes 2 and 4, and 4 ranks as 2 emulated nodes x 2.

One spawn per world size; the worker loops over (backend, case) and reports failures.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from dist_utils import (CaseRunner, assert_no_failures, compare_grads, make_inputs,
                        parallel_step, reference_grads, run_distributed)

# (name, MoEConfig overrides, tokens per rank as a function of (rank, world), expert bias)
CASES = [
    ("top1", dict(num_experts=8, top_k=1), None, None),
    ("top2 shared aux", dict(num_experts=8, top_k=2, num_shared_experts=1, aux_loss_coeff=0.01),
     None, None),
    ("top8", dict(num_experts=16, top_k=8, score_func="sigmoid"), None, None),
    ("capacity probs", dict(num_experts=8, top_k=2, capacity_factor=0.75), None, None),
    ("capacity position", dict(num_experts=8, top_k=2, capacity_factor=1.0,
                               drop_policy="position"), None, None),
    ("group-limited", dict(num_experts=16, top_k=4, num_groups=4, topk_groups=2,
                           score_func="sigmoid", num_shared_experts=1), None, None),
    ("uneven batches", dict(num_experts=8, top_k=2), lambda r, w: 3 + 5 * r, None),
    ("zero tokens on a rank", dict(num_experts=8, top_k=2), lambda r, w: 0 if r == w - 1 else 9,
     None),
    ("a rank receives nothing", dict(num_experts=8, top_k=2), None, "last_rank_cold"),
    ("an expert without tokens", dict(num_experts=8, top_k=2), None, "expert1_cold"),
    ("all tokens to one expert", dict(num_experts=8, top_k=1), None, "last_expert_hot"),
    ("small experts, rows padded", dict(num_experts=16, top_k=4), None, None),
]
BF16_CASES = ("top2 shared aux", "top8", "capacity probs", "small experts, rows padded")
# Cases run again with the experts applying the gate weights (moe_act on the grouped-GEMM
# path: Dispatcher.run_experts hands each received row's weight to the experts and the
# combine only sums), in fp32 against the same unparallelized layer.
GATE_IN_EXPERTS_CASES = ("top2 shared aux", "capacity probs", "group-limited", "uneven batches",
                         "zero tokens on a rank")
# Cases whose received rows always run padded into batched chunks (experts.py, row mode
# through gathered mode): at EP 2 and 4 each rank holds 8 or 4 of the 16 experts.
PADDED_ROW_CASES = ("small experts, rows padded",)


def _bias(kind, E, ep):
    b = torch.zeros(E)
    if kind == "last_rank_cold":
        b[E - E // ep:] = -100.0
    elif kind == "expert1_cold":
        b[1] = -100.0
    elif kind == "last_expert_hot":
        b[E - 1] = 100.0
    return b


def _rel_err(a, b):
    # The floor keeps grads that are zero up to rounding (top-1 with route_norm: the gate
    # weight is w/w = 1) from turning noise into a huge relative error.
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-3))


def _layer_cases(runner, rank, world, dims, backends, tag):
    import epscale
    from epscale.config import CpuKernelConfig

    for backend, opts in backends:
        for name, over, tokens_fn, bias_kind in CASES:
            chunks = opts.get("overlap_chunks", 1)
            payload = opts.get("payload", "auto")
            dtypes = [torch.float32] + ([torch.bfloat16] if name in BF16_CASES and chunks == 1
                                        and payload == "auto" else [])
            runs = [(dtype, False) for dtype in dtypes]
            if name in GATE_IN_EXPERTS_CASES and payload == "auto":
                runs.append((torch.float32, True))
            for dtype, gate_in_experts in runs:
                label = f"{tag} {backend}{opts} {name} {dtype}" + " gate-in-experts" * gate_in_experts
                with runner.case(label):
                    torch.manual_seed(11)
                    # padded rows: the per-expert loop replaced by batched chunks, always
                    cpu = (CpuKernelConfig(gemm="loop", batch_pad_waste=100.0)
                           if name in PADDED_ROW_CASES else CpuKernelConfig())
                    impl = {"experts_impl": "grouped_mm"} if gate_in_experts else {}
                    cfg = epscale.MoEConfig(dim=32, hidden_dim=16, **over, cpu=cpu, **impl)
                    full = epscale.MoE(cfg)
                    if bias_kind:
                        full.router.expert_bias.copy_(_bias(bias_kind, cfg.num_experts, dims.ep))
                    full = full.to(dtype)
                    par = epscale.parallelize(copy.deepcopy(full), dims, dispatcher=backend,
                                              overlap_chunks=chunks, payload=payload)
                    par.experts.recompute_activation = gate_in_experts
                    weighted_calls = _count_weighted_calls(par.experts)
                    tokens = [tokens_fn(r, world) if tokens_fn else 12 for r in range(world)]
                    xs, gs = make_inputs(world, tokens, 32, dtype, seed=3)
                    ref_y, ref_dx, ref_pg = reference_grads(full, xs, gs)
                    # overlap_chunks > 1: MoE.forward takes the pipelined
                    # dispatch_compute_combine path (shared experts as its side work).
                    y, dx = parallel_step(par, dims, xs[rank], gs[rank])
                    if tokens[rank] == 0:
                        assert y.shape == (0, 32) and dx.shape == (0, 32)
                    # every backend but alltoall (which weights at the source) hands the
                    # weights to the experts when they take them
                    assert bool(weighted_calls) == (gate_in_experts and backend != "alltoall")
                    if dtype == torch.float32 and payload == "auto":
                        torch.testing.assert_close(y, ref_y[rank], atol=2e-5, rtol=1e-4)
                        torch.testing.assert_close(dx, ref_dx[rank], atol=2e-5, rtol=1e-4)
                        compare_grads(par, ref_pg, dims, atol=2e-5, rtol=1e-4)
                    else:  # bf16 compute or a lossy payload: relative error of whole tensors
                        tol = {"fp8": 0.08, "bf16": 0.02}.get(payload, 0.03)
                        if tokens[rank]:
                            assert _rel_err(y, ref_y[rank]) < tol, _rel_err(y, ref_y[rank])
                            assert _rel_err(dx, ref_dx[rank]) < tol, _rel_err(dx, ref_dx[rank])
                        for pname, p in par.named_parameters():
                            ref = ref_pg[pname]
                            if p.shape != ref.shape:
                                e = p.shape[0]
                                ref = ref[dims.ep_rank * e:(dims.ep_rank + 1) * e]
                            assert _rel_err(p.grad, ref) < tol, (pname, _rel_err(p.grad, ref))


def _count_weighted_calls(experts) -> list[int]:
    """Record (on the returned list) each call of ``experts`` given gate weights."""
    calls, forward = [], experts.forward

    def counted(x_RD, counts_e, weight_R=None):
        if weight_R is not None:
            calls.append(weight_R.numel())
        return forward(x_RD, counts_e, weight_R)
    experts.forward = counted
    return calls


def _contract_cases(runner, rank, world, dims, backends, tag):
    """Dispatcher-level contract: recv counts equal the layout's, identity experts give
    sum_k w_k x, rows are grouped by local expert, bytes are counted exactly."""
    from epscale.dispatch.layout import get_dispatch_layout
    from epscale.parallel import make_dispatcher

    E, K, D, T = 8, 3, 16, 10
    for backend, opts in backends:
        if opts:
            continue
        with runner.case(f"{tag} contract {backend}"):
            disp = make_dispatcher(backend, E, dims)
            g = torch.Generator().manual_seed(100 + rank)
            idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
            idx[0, 1] = -1  # a dropped assignment
            w = torch.rand(T, K, generator=g)
            w[0, 1] = 0.0
            x = torch.randn(T, D, generator=g)
            before, before_inter = disp.bytes_sent(), disp.inter_node_bytes_sent()
            recv_x, counts_e, handle = disp.dispatch(x, idx, w)
            sent = disp.bytes_sent() - before
            sent_inter = disp.inter_node_bytes_sent() - before_inter
            lay = get_dispatch_layout(idx, E, dims.ep)
            per_expert = lay.num_tokens_per_expert_E.clone()
            dist.all_reduce(per_expert, group=dims.ep_group)
            e, lo = E // dims.ep, dims.ep_rank * (E // dims.ep)
            assert counts_e.tolist() == per_expert[lo:lo + e].tolist()
            assert recv_x.shape == (int(counts_e.sum()), D)
            y = disp.combine(recv_x, handle)
            torch.testing.assert_close(y, (w.unsqueeze(-1) * x.unsqueeze(1)).sum(1),
                                       atol=1e-5, rtol=1e-5)
            others = [p for p in range(dims.ep) if p != dims.ep_rank]
            if backend == "alltoall":
                rows = sum(int(lay.num_tokens_per_expert_E[p * e:(p + 1) * e].sum()) for p in others)
                assert sent == rows * D * 4 + len(others) * e * 8, sent
            row_bytes = D * 4 + K * 1 + 1 + K * 4  # payload, int8 ids (+pad), fp32 weights
            if backend == "dedup":
                rows = sum(int(lay.num_tokens_per_rank_P[p]) for p in others)
                assert sent == rows * row_bytes + len(others) * (1 + e) * 8, sent
            if backend == "hierarchical":
                # Across nodes: one row per (token, other node), to the same-index peer.
                L, N = dims.ep_ranks_per_node, dims.ep_num_nodes
                lay_n = get_dispatch_layout(idx, E, dims.ep, L)
                me = dims.ep_rank // L
                rows = sum(int(lay_n.num_tokens_per_node_N[n]) for n in range(N) if n != me)
                counts = (N - 1) * (1 + L + L * e) * 8
                assert sent_inter == rows * row_bytes + counts, (sent_inter, rows, counts)


def _node_limit_case(runner, rank, dims):
    """Group-limited routing with groups = nodes: hierarchical sends each token across at
    most topk_groups - 1 other nodes, and fewer inter-node bytes than dedup."""
    import epscale

    with runner.case("node-limited routing bounds inter-node rows"):
        torch.manual_seed(5)
        cfg = epscale.MoEConfig(dim=32, hidden_dim=16, num_experts=16, top_k=4, num_groups=2,
                                topk_groups=1, score_func="sigmoid")
        from epscale.dispatch.layout import get_dispatch_layout

        sent = {}
        for backend in ("dedup", "hierarchical"):
            torch.manual_seed(5)
            moe = epscale.parallelize(epscale.MoE(cfg), dims, dispatcher=backend)
            x = torch.randn(40, 32)
            moe(x)
            sent[backend] = moe.dispatcher.inter_node_bytes_sent()
        lay = get_dispatch_layout(moe.router(x).topk_idx_TK, 16, 4, 2)
        assert int(lay.is_token_in_node_TN.sum(1).max()) <= cfg.topk_groups
        assert sent["hierarchical"] <= sent["dedup"], sent


BACKENDS = [("alltoall", {}), ("allgather", {}), ("dedup", {}), ("dedup", {"payload": "bf16"}),
            ("dedup", {"payload": "fp8"}), ("dedup", {"overlap_chunks": 3}), ("hierarchical", {}),
            ("dedup", {"payload": "fp8", "overlap_chunks": 2})]
# 4 ranks as 2 emulated nodes x 2 ranks.
NODE_BACKENDS = [("hierarchical", {}), ("hierarchical", {"overlap_chunks": 2}),
                 ("hierarchical", {"payload": "fp8"}), ("dedup", {})]


def _worker(rank, world):
    import epscale

    runner = CaseRunner(rank)
    dims = epscale.ParallelDims(dp=1, ep=world)
    _contract_cases(runner, rank, world, dims, BACKENDS, f"ep={world}")
    _layer_cases(runner, rank, world, dims, BACKENDS, f"ep={world}")
    if world == 4:
        nodes = epscale.ParallelDims(dp=1, ep=4, ranks_per_node=2)
        _contract_cases(runner, rank, world, nodes, NODE_BACKENDS, "2 nodes x 2")
        _layer_cases(runner, rank, world, nodes, NODE_BACKENDS, "2 nodes x 2")
        _node_limit_case(runner, rank, nodes)
    return runner.failures, runner.num_cases


@pytest.mark.parametrize("world", [2, 4])
def test_backends_match_unparallelized_layer(world):
    assert_no_failures(run_distributed(_worker, world), min_cases=50)
