"""Communication behind compute (issue 32), on real gloo groups; overlap on must give what
the plain blocking path gives, and both what one process gives.

Inside an MoE layer: the dispatchers with ``overlap`` on (async exchanges in forward and
backward, the chunked pipeline) against the blocking path and one process, in float64 at
the dispatcher level; and in backward, chunk c's expert backward runs while chunk c+1's
dispatch gradients are in flight (the order autograd runs things in, recorded).

Gradient reductions, through ``training.step.AccumulationStep``: the replicated layout
reducing in backward with DDP's buckets (``parallel.grads.reduce_in_backward``; dp=2, and
dp=2 x ep=2 with gradient accumulation), FSDP and HSDP (dp_replicate=2 x dp_shard=2) with
the replica all-reduce once per step: every rank's gradients with overlap on and off equal
one process's at the same global batch. HSDP's replica all-reduces are counted per step
(once, not once per micro-batch), and FSDP's explicit block-to-block prefetch is checked
set under every recomputation mode (and off with ``prefetch=False``).

One spawn per world size (2; 4, also as 2 emulated nodes x 2 ranks); the one-process
references run inside the workers (tiny models)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dist_utils import CaseRunner, assert_no_failures, run_distributed

# ======================================================================================
# Inside an MoE layer
# ======================================================================================

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



# ======================================================================================
# Gradient reductions
# ======================================================================================

ACCUM, MICRO, SEQ, VOCAB = 2, 2, 16, 128
TOL = dict(atol=2e-5, rtol=1e-4)


def _cfg(ep: int, extra=()):
    from epscale.config import load_config

    over = {"model.dim": 32, "model.num_layers": 2, "model.num_heads": 2, "model.seq_len": SEQ,
            "model.vocab_size": VOCAB, "model.dense_hidden_dim": 64, "moe.hidden_dim": 32,
            "moe.num_experts": 4, "moe.top_k": 2, "moe.num_shared_experts": 1,
            "moe.aux_loss_coeff": 0.01, "parallel.ep": ep, **dict(extra)}
    return load_config(None, [f"{k}={v}" for k, v in over.items()])


def _batches(world: int):
    """[rank][micro-batch] -> (x_BS, y_BS): the global batch, identical on every rank."""
    g = torch.Generator().manual_seed(1)
    return [[(torch.randint(0, VOCAB, (MICRO, SEQ), generator=g),
              torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)) for _ in range(ACCUM)]
            for _ in range(world)]


class _Loader:
    def __init__(self, batches):
        self.batches = list(batches)

    def next_micro_batch(self):
        return self.batches.pop(0)


def _reference(cfg, batches):
    """One process over the whole global batch: {name: grad of the mean micro-batch loss}."""
    from epscale.model import build_model

    model = build_model(cfg)
    n = sum(len(b) for b in batches)
    for rank_batches in batches:
        for x, y in rank_batches:
            ((model.loss(x, y) + model.aux_loss()) / n).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _parallel_grads(cfg, dims, batches, overlap, fsdp, clock=None):
    """This rank's gradients (DTensor shards gathered) after one step of ACCUM
    micro-batches, with the overlap mechanisms ``overlap`` on or off; ``clock``: a
    CommClock attached to the model for the step (detached after)."""
    from epscale.metrics.commclock import attach_comm_clock
    from epscale.metrics import StepTimers
    from epscale.model import build_model
    from epscale.parallel import apply_fsdp, finish_gradients, parallelize, sync_gradients
    from epscale.parallel.grads import reduce_in_backward
    from epscale.training.step import AccumulationStep

    model = build_model(cfg)
    parallelize(model, dims, dispatcher=cfg.parallel.dispatcher)
    if fsdp:
        apply_fsdp(model, dims, prefetch=overlap)
    else:
        assert reduce_in_backward(model, dims, overlap) == overlap
    step = AccumulationStep(model, torch.device("cpu"), StepTimers("cpu"),
                            contextlib.nullcontext, dims.rank, dims.world_size, overlap=overlap)
    if clock is not None:
        attach_comm_clock(model, clock)
    try:
        step.train(_Loader(batches[dims.rank]), ACCUM)
    finally:
        if clock is not None:
            attach_comm_clock(model, None)
    if fsdp:
        finish_gradients(model, dims)
    else:
        sync_gradients(model, dims)
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).clone()
    return out, model


def _check(got, ref, model):
    from epscale.parallel.shard import expert_global_rows, is_expert_param

    for name, p in model.named_parameters():
        want = ref[name]
        if is_expert_param(p):
            first, _total = expert_global_rows(p)
            want = want[first:first + got[name].shape[0]]
        torch.testing.assert_close(got[name], want, **TOL, msg=lambda m: f"grad of {name}: {m}")


def _layout_case(runner, tag, cfg, dims, batches, fsdp, ref):
    grads = {}
    for overlap in (True, False):
        with runner.case(f"{tag} overlap={overlap}"):
            grads[overlap], model = _parallel_grads(cfg, dims, batches, overlap, fsdp)
            _check(grads[overlap], ref, model)
    with runner.case(f"{tag} overlap on = off"):
        torch.testing.assert_close(grads[True], grads[False], **TOL)


def _count_replica_all_reduces(runner, cfg, dims, batches, ref):
    """HSDP: the replica all-reduces one step issues, counted at torch.distributed's door
    (FSDP calls ``dist.all_reduce`` with the replica group): with overlap, one per FSDP
    parameter group per step; without, one per group per micro-batch. The CommClock
    attached to the model times each of them as 'dp' (blocking on gloo: wholly exposed),
    and nothing else as 'dp'."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    from epscale.metrics.commclock import CommClock

    replica_ranks = dist.get_process_group_ranks(dims.dense_mesh.get_group("dp_replicate"))
    real = dist.all_reduce
    counts = {}

    def counting(tensor, *args, group=None, **kwargs):
        if group is not None and dist.get_process_group_ranks(group) == replica_ranks:
            counts[key] += 1
        return real(tensor, *args, group=group, **kwargs)

    for key in (True, False):
        with runner.case(f"hsdp replica all-reduces overlap={key}"):
            counts[key] = 0
            clock = CommClock()
            dist.all_reduce = counting
            try:
                got, model = _parallel_grads(cfg, dims, batches, key, fsdp=True, clock=clock)
            finally:
                dist.all_reduce = real
            _check(got, ref, model)
            t = clock.totals()
            assert t["dp"]["n"] == counts[key] > 0, (t["dp"], counts[key])
            assert 0 < t["dp"]["exposed_s"] == t["dp"]["s"], t["dp"]
            assert t["fsdp"]["n"] > 0 and t["pp"]["n"] == 0, t
            assert _fsdp_collectives.dist is dist  # detached: FSDP2's own again
    with runner.case("hsdp replica all-reduce once per step"):
        assert counts[True] > 0 and counts[False] == ACCUM * counts[True], counts


def _prefetch_cases(runner, cfg, dims):
    """apply_fsdp's explicit prefetch: block i's forward prefetches block i+1's gathers,
    its backward block i-1's, under every recomputation mode; none with prefetch=False."""
    from epscale.model import build_model
    from epscale.parallel import apply_activation_checkpointing, apply_fsdp, parallelize
    from epscale.parallel.activation import MODES, transformer_blocks

    for mode in MODES:
        for prefetch in (True, False):
            with runner.case(f"fsdp prefetch={prefetch} recompute={mode}"):
                model = build_model(cfg)
                parallelize(model, dims)
                apply_activation_checkpointing(model, mode)
                apply_fsdp(model, dims, prefetch=prefetch)
                blocks = transformer_blocks(model)
                states = [b._get_fsdp_state() for b in blocks]
                for i, s in enumerate(states):
                    fwd = [states[i + 1]] if prefetch and i + 1 < len(states) else []
                    bwd = [states[i - 1]] if prefetch and i > 0 else []
                    assert s._states_to_forward_prefetch == fwd, (i, s._states_to_forward_prefetch)
                    assert s._states_to_backward_prefetch == bwd, (i, s._states_to_backward_prefetch)


def _worker(rank, world):
    import epscale

    runner = CaseRunner(rank)
    batches = _batches(world)
    if world == 2:
        dims = epscale.ParallelDims(dp=1, ep=2)
        _equal_cases(runner, rank, world, dims, CASES, "ep=2")
        for overlap in (True, False):
            _order_case(runner, rank, dims, overlap)
        cfg = _cfg(1)
        _layout_case(runner, "replicated dp=2", cfg, epscale.ParallelDims(dp=2, ep=1), batches,
                     False, _reference(cfg, batches))
        _prefetch_cases(runner, _cfg(2), epscale.ParallelDims(dp=1, ep=2, fsdp=True))
    else:
        nodes = epscale.ParallelDims(dp=1, ep=4, ranks_per_node=2)
        _equal_cases(runner, rank, world, nodes, NODE_CASES, "2 nodes x 2")
        cfg = _cfg(2)
        ref = _reference(cfg, batches)
        _layout_case(runner, "replicated dp=2 x ep=2", cfg, epscale.ParallelDims(dp=2, ep=2),
                     batches, False, ref)
        _layout_case(runner, "fsdp dp_shard=4 x ep=2", cfg,
                     epscale.ParallelDims(dp=2, ep=2, fsdp=True), batches, True, ref)
        hsdp = epscale.ParallelDims(dp=2, ep=2, fsdp=True, dp_replicate=2)
        _count_replica_all_reduces(runner, cfg, hsdp, batches, ref)
    return runner.failures, runner.num_cases


@pytest.mark.parametrize("world", [2, 4])
def test_overlap_on_matches_blocking_and_one_process(world):
    assert_no_failures(run_distributed(_worker, world), min_cases=8)
