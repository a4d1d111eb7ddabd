"""Gradient reductions behind compute (issue 32), on real gloo groups, through
``training.step.AccumulationStep``: the replicated layout reducing in backward with DDP's
buckets (``parallel.grads.reduce_in_backward``; dp=2, and dp=2 x ep=2 with gradient
accumulation), FSDP and HSDP (dp_replicate=2 x dp_shard=2) with the replica all-reduce
once per step: every rank's gradients with overlap on and off equal one process's at the
same global batch. HSDP's replica all-reduces are counted per step (once, not once per
micro-batch), and FSDP's explicit block-to-block prefetch is checked set under every
recomputation mode (and off with ``prefetch=False``).

One spawn per world size (2 and 4); the one-process references run inside the workers
(a tiny model)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dist_utils import CaseRunner, assert_no_failures, run_distributed

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


def _parallel_grads(cfg, dims, batches, overlap, fsdp):
    """This rank's gradients (DTensor shards gathered) after one step of ACCUM
    micro-batches, with the overlap mechanisms ``overlap`` on or off."""
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
    step.train(_Loader(batches[dims.rank]), ACCUM)
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
    parameter group per step; without, one per group per micro-batch."""
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
            dist.all_reduce = counting
            try:
                got, model = _parallel_grads(cfg, dims, batches, key, fsdp=True)
            finally:
                dist.all_reduce = real
            _check(got, ref, model)
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
        cfg = _cfg(1)
        ref = _reference(cfg, batches)
        _layout_case(runner, "replicated dp=2", cfg, epscale.ParallelDims(dp=2, ep=1), batches,
                     False, ref)
        cfg2 = _cfg(2)
        _prefetch_cases(runner, cfg2, epscale.ParallelDims(dp=1, ep=2, fsdp=True))
    else:
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
def test_reductions_overlapped_match_one_process(world):
    assert_no_failures(run_distributed(_worker, world), min_cases=3)
