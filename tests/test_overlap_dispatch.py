"""Communication behind compute inside an MoE layer (issue 32), on real gloo groups: the
dispatchers with ``overlap`` on (async exchanges in forward and backward, the chunked
pipeline) give the blocking path's outputs and gradients in float64, both equal the
unparallelized layer's; and in backward, chunk c's expert backward runs while chunk c+1's
dispatch gradients are in flight (the order autograd runs things in, recorded).

One spawn per world size (2: ep=2; 4: 2 emulated nodes x 2 ranks).
"""

from __future__ import annotations

import copy

import pytest
import torch

from dist_utils import CaseRunner, assert_no_failures, run_distributed

F64 = dict(atol=1e-10, rtol=1e-9)
# (backend, overlap_chunks, MoEConfig overrides, tokens on rank r)
CASES = [
    ("dedup", 1, dict(num_experts=8, top_k=2, num_shared_experts=1), lambda r: 12),
    ("dedup", 3, dict(num_experts=8, top_k=2, num_shared_experts=1, aux_loss_coeff=0.01),
     lambda r: 13),
    ("dedup", 2, dict(num_experts=8, top_k=2, capacity_factor=0.75), lambda r: 10),
    ("dedup", 3, dict(num_experts=8, top_k=2), lambda r: 0 if r == 1 else 9),
    ("alltoall", 1, dict(num_experts=8, top_k=2, num_shared_experts=1), lambda r: 11),
]
NODE_CASES = [
    ("hierarchical", 2, dict(num_experts=8, top_k=2, num_shared_experts=1), lambda r: 12),
    ("hierarchical", 1, dict(num_experts=8, top_k=2, num_shared_experts=1), lambda r: 12),
    ("dedup", 3, dict(num_experts=16, top_k=4), lambda r: 3 + 4 * r),
]


def _build(full, dims, backend, chunks, overlap):
    import epscale

    par = epscale.parallelize(copy.deepcopy(full), dims, dispatcher=backend,
                              overlap_chunks=chunks)
    par.dispatcher.overlap = overlap
    return par


def _routes(world, tokens, E, K, seed):
    """Every rank's (x, topk ids with some dropped, gate weights, upstream grad), float64,
    identical on all ranks (seeded)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for T in tokens:
        x = torch.randn(T, 32, generator=g, dtype=torch.float64)
        idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K]
        idx[torch.rand(T, K, generator=g) < 0.1] = -1
        w = torch.rand(T, K, generator=g, dtype=torch.float64)
        out.append((x, idx, w, torch.randn(T, 32, generator=g, dtype=torch.float64)))
    return out


def _run(disp, experts, shared, x, idx, w, g):
    """dispatch -> experts -> combine (+ the shared experts as side work) and backward of
    <y, g>; returns (y, dx, dw, {param name: grad} of experts and shared)."""
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    for p in list(experts.parameters()) + list(shared.parameters()):
        p.grad = None
    y = disp.dispatch_compute_combine(x, idx, w, experts, side_work=lambda: shared(x))
    (y * g).sum().backward()
    grads = {f"experts.{n}": p.grad for n, p in experts.named_parameters()}
    grads.update({f"shared.{n}": p.grad for n, p in shared.named_parameters()})
    return y.detach(), x.grad, w.grad, grads


class _OneProcess:
    """The experts of the unparallelized layer over one rank's tokens, one expert at a
    time through ``epscale.moe.reference``'s expert: y_t = sum_k w_tk * expert_k(x_t)."""

    def __init__(self, full):
        self.full = full

    def dispatch_compute_combine(self, x, idx, w, experts, side_work):
        from epscale.moe.reference import _expert

        y = side_work()
        for e in range(self.full.cfg.num_experts):
            t, k = (idx == e).nonzero(as_tuple=True)
            y = y.index_add(0, t, w[t, k].unsqueeze(1) * _expert(self.full, e, x[t]))
        return y


def _equal_cases(runner, rank, world, dims, cases, tag):
    """Dispatcher level, float64 (the router computes in fp32, so the whole layer could
    not be compared this tightly): overlap on and off against one process running every
    rank's tokens through all the experts."""
    import epscale

    for backend, chunks, over, tokens_fn in cases:
        with runner.case(f"{tag} {backend} chunks={chunks} {over}"):
            torch.manual_seed(7)
            full = epscale.MoE(epscale.MoEConfig(dim=32, hidden_dim=16, **over)).double()
            shared = torch.nn.Linear(32, 32, bias=False).double()
            E, K = full.cfg.num_experts, full.cfg.top_k
            data = _routes(world, [tokens_fn(r) for r in range(world)], E, K, seed=5)
            got = {}
            for overlap in (True, False):
                par = _build(full, dims, backend, chunks, overlap)
                got[overlap] = _run(par.dispatcher, par.experts, shared, *data[rank])
            one = _OneProcess(full)
            refs = [_run(one, full.experts, shared, *d) for d in data]
            ref_grads = {n: sum(r[3][n] for r in refs) for n in refs[0][3]}
            e = E // dims.ep
            for n in ref_grads:
                if n.startswith("experts."):
                    ref_grads[n] = ref_grads[n][dims.ep_rank * e:(dims.ep_rank + 1) * e]
                else:  # the shared weights see only this rank's tokens
                    ref_grads[n] = refs[rank][3][n]
            for overlap in (True, False):
                y, dx, dw, pg = got[overlap]
                torch.testing.assert_close((y, dx, dw), refs[rank][:3], **F64)
                torch.testing.assert_close(pg, ref_grads, **F64)
            torch.testing.assert_close(got[True], got[False], **F64)


def _order_case(runner, rank, dims, overlap):
    """Record, in backward, when each gradient exchange starts and is waited for and when
    each chunk's experts run their backward: with overlap, chunk c's expert backward lies
    between the start and the wait of chunk c+1's dispatch gradients; without it, every
    exchange is waited for right where it starts."""
    import epscale
    from epscale.dispatch import comm

    with runner.case(f"backward order overlap={overlap}"):
        torch.manual_seed(3)
        cfg = epscale.MoEConfig(dim=32, hidden_dim=16, num_experts=8, top_k=2,
                                num_shared_experts=1)
        par = _build(epscale.MoE(cfg), dims, "dedup", 3, overlap)
        log = []
        start, finish = comm._grads_start, comm._grads_finish
        ids = {}

        def rec_start(ex, meta, grads):
            ids[id(meta)] = len(ids)
            log.append(("start", ids[id(meta)]))
            return start(ex, meta, grads)

        def rec_finish(meta, pending):
            log.append(("wait", ids[id(meta)]))
            return finish(meta, pending)

        experts = par.experts

        def traced(recv_x, counts):
            y = experts(recv_x, counts)
            return _Mark.apply(y, log, "experts")

        comm._grads_start, comm._grads_finish = rec_start, rec_finish
        try:
            x = torch.randn(15, 32, requires_grad=True)
            r = par.router(x)
            y = par.dispatcher.dispatch_compute_combine(x, r.topk_idx_TK, r.topk_weight_TK,
                                                        traced)
            y.sum().backward()
        finally:
            comm._grads_start, comm._grads_finish = start, finish
        kinds = [k for k, _ in log]
        starts = [i for i, k in enumerate(kinds) if k == "start"]
        waits = [i for i, k in enumerate(kinds) if k == "wait"]
        wait_of = {n: i for i, (k, n) in enumerate(log) if k == "wait"}
        experts_bwd = [i for i, k in enumerate(kinds) if k == "experts"]
        if not overlap:  # blocking, one chunk: each start is followed by its wait
            assert len(starts) == len(waits) == 2 and len(experts_bwd) == 1, log
            assert all(w == s + 1 for s, w in zip(starts, waits)), log
            return
        assert len(starts) == len(waits) == 6 and len(experts_bwd) == 3, log
        # every combine's gradients start before any expert backward runs
        assert sorted(starts)[:3] == starts[:3] and starts[2] < experts_bwd[0], log
        # chunk c+1's dispatch gradients start after its experts' backward and are waited
        # for after chunk c's experts ran theirs (c = the last two of the three chunks)
        in_flight = [(s, wait_of[log[s][1]]) for s in starts[3:]]
        hidden = [any(s < e < w for e in experts_bwd) for s, w in in_flight]
        assert hidden == [True, True, False], log


class _Mark(torch.autograd.Function):
    """Identity that appends ``name`` to ``log`` when its backward runs."""

    @staticmethod
    def forward(ctx, y, log, name):
        ctx.log, ctx.name = log, name
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        ctx.log.append((ctx.name, None))
        return g, None, None


def _worker(rank, world):
    import epscale

    runner = CaseRunner(rank)
    if world == 2:
        dims = epscale.ParallelDims(dp=1, ep=2)
        _equal_cases(runner, rank, world, dims, CASES, "ep=2")
        for overlap in (True, False):
            _order_case(runner, rank, dims, overlap)
    else:
        nodes = epscale.ParallelDims(dp=1, ep=4, ranks_per_node=2)
        _equal_cases(runner, rank, world, nodes, NODE_CASES, "2 nodes x 2")
    return runner.failures, runner.num_cases


@pytest.mark.parametrize("world", [2, 4])
def test_overlapped_dispatch_equals_blocking(world):
    assert_no_failures(run_distributed(_worker, world), min_cases=3)
