"""What each overlap mechanism of issue 32 changes, side by side in one run (not a test).

    python benchmarks/overlap_mechanisms.py                  # 2 gloo ranks (spawned here)
    python benchmarks/overlap_mechanisms.py --world 4        # also HSDP 2 x 2
    python benchmarks/overlap_mechanisms.py --quick          # smaller shapes, fewer iterations

Part 1 (MoE layer, ep = world, dedup with shared experts and ``--chunks`` chunks): the
layer's forward + backward with the dispatcher's ``overlap`` off (every exchange blocking,
one chunk), with the forward-only overlap this repository had before (chunked forward,
blocking backward: ``Exchange.done`` replaced by a plain wait), and with both directions.
Per variant: median time per iteration (slowest rank) and the time the backward spent
waiting on gradient exchanges (``work.wait`` in ``dispatch.comm._grads_finish``: the
exposed part of the backward's communication).

Part 2 (replicated dp = world, ep = 1, a tiny transformer, ``--accum`` micro-batches): one
step through ``AccumulationStep`` with the gradients all-reduced after the whole backward
(``sync_gradients``) against DDP's buckets during backward (``reduce_in_backward``,
``no_sync`` before the last micro-batch); median step time and the time spent in
``sync_gradients`` after the backward.

Part 3 (``--world 4``: HSDP dp_replicate = 2 x dp_shard = 2, ep = 2): replica all-reduces
per step (counted at ``torch.distributed.all_reduce``) and median step time, with the
all-reduce after every micro-batch against once per step.

The three ``bench_*`` functions run inside an initialised process group and return a dict
per variant; ``benchmarks/overlap.py`` can call them. Ratios are new / old (lower is
better for times). On a shared 2-core VM the wall-clock figures are noisy: the variants
alternate, iteration by iteration, so load hits them alike.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

if str(Path(__file__).resolve().parent) not in sys.path:  # spawned ranks import this module
    sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, choices=[2, 4])
    p.add_argument("--tokens", type=int, default=2048, help="part 1: tokens per rank")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--accum", type=int, default=4, help="parts 2, 3: micro-batches per step")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.dim, args.hidden, args.iters = 512, 128, 128, 3
    return args


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


class _WaitClock:
    """Seconds spent in the backward's gradient-exchange waits (``_grads_finish``)."""

    def __init__(self):
        from epscale.dispatch import comm

        self.comm, self.real, self.total = comm, comm._grads_finish, 0.0

    def __enter__(self):
        def timed(meta, pending):
            t0 = time.perf_counter()
            try:
                return self.real(meta, pending)
            finally:
                self.total += time.perf_counter() - t0
        self.comm._grads_finish = timed
        return self

    def __exit__(self, *exc):
        self.comm._grads_finish = self.real


@contextlib.contextmanager
def _forward_only_overlap():
    """The dispatchers as before issue 32: an async exchange is waited for where it is
    read, and its backward blocks (no async start in backward)."""
    from epscale.dispatch.comm import Exchange

    real = Exchange.done

    def plain(self, *outs):
        self.wait()
        return outs
    Exchange.done = plain
    try:
        yield
    finally:
        Exchange.done = real


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _alternate(variants: dict, iters: int) -> dict[str, dict[str, float]]:
    """Run every variant's ``fn() -> (seconds, extra seconds)`` ``iters`` times, the
    variants interleaved; the median time and extra of the slowest rank per variant."""
    times = {k: [] for k in variants}
    extra = {k: [] for k in variants}
    for it in range(iters + 1):  # the first round warms up and is dropped
        for name, fn in variants.items():
            dist.barrier()
            t, x = fn()
            if it:
                times[name].append(_slowest(t))
                extra[name].append(_slowest(x))
    return {k: {"time_s": statistics.median(times[k]), "extra_s": statistics.median(extra[k])}
            for k in variants}


# --------------------------------------------------------------------------------------
# the three parts
# --------------------------------------------------------------------------------------


def bench_layer(args) -> dict[str, dict[str, float]]:
    """Part 1: the MoE layer forward + backward; 'extra_s' = backward exchange waits."""
    import epscale

    rank, world = dist.get_rank(), dist.get_world_size()
    dims = epscale.ParallelDims(dp=1, ep=world)
    torch.manual_seed(0)
    cfg = epscale.MoEConfig(dim=args.dim, hidden_dim=args.hidden, num_experts=args.experts,
                            top_k=args.top_k, num_shared_experts=1)
    moe = epscale.parallelize(epscale.MoE(cfg), dims, dispatcher="dedup",
                              overlap_chunks=args.chunks)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, args.dim, generator=g)
    dy = torch.randn(args.tokens, args.dim, generator=g)

    def run(overlap: bool, backward_overlap: bool):
        def fn():
            moe.dispatcher.overlap = overlap
            ctx = contextlib.nullcontext() if backward_overlap else _forward_only_overlap()
            xi = x.clone().requires_grad_(True)
            with ctx, _WaitClock() as clock:
                t0 = time.perf_counter()
                (moe(xi) * dy).sum().backward()
                t = time.perf_counter() - t0
            moe.zero_grad(set_to_none=True)
            return t, clock.total
        return fn
    return _alternate({"none": run(False, False), "forward only": run(True, False),
                       "forward+backward": run(True, True)}, args.iters)


def _tiny_cfg(ep: int):
    from epscale.config import load_config

    over = {"model.dim": 128, "model.num_layers": 4, "model.num_heads": 4, "model.seq_len": 64,
            "model.vocab_size": 512, "model.dense_hidden_dim": 256, "moe.hidden_dim": 128,
            "moe.num_experts": 8, "moe.top_k": 2, "parallel.ep": ep}
    return load_config(None, [f"{k}={v}" for k, v in over.items()])


class _Loader:
    def __init__(self, vocab: int, seq: int, seed: int):
        self.g, self.vocab, self.seq = torch.Generator().manual_seed(seed), vocab, seq

    def next_micro_batch(self):
        return (torch.randint(0, self.vocab, (2, self.seq), generator=self.g),
                torch.randint(0, self.vocab, (2, self.seq), generator=self.g))


def _stepper(model, overlap: bool):
    from epscale.metrics import StepTimers
    from epscale.training.step import AccumulationStep

    return AccumulationStep(model, torch.device("cpu"), StepTimers("cpu"),
                            contextlib.nullcontext, dist.get_rank(), dist.get_world_size(),
                            overlap=overlap)


def bench_replicated(args) -> dict[str, dict[str, float]]:
    """Part 2: replicated dp = world; 'extra_s' = time in sync_gradients after backward."""
    import epscale
    from epscale.model import build_model
    from epscale.parallel import parallelize, sync_gradients
    from epscale.parallel.grads import reduce_in_backward

    world = dist.get_world_size()
    dims = epscale.ParallelDims(dp=world, ep=1)
    cfg = _tiny_cfg(1)
    variants = {}
    for name, overlap in (("after backward", False), ("DDP buckets in backward", True)):
        model = build_model(cfg)
        parallelize(model, dims)
        reduce_in_backward(model, dims, overlap, bucket_bytes=256 * 1024)
        step = _stepper(model, overlap)
        loader = _Loader(cfg.model.vocab_size, cfg.model.seq_len, dist.get_rank())

        def fn(model=model, step=step, loader=loader):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            step.train(loader, args.accum)
            t1 = time.perf_counter()
            sync_gradients(model, dims)
            t2 = time.perf_counter()
            return t2 - t0, t2 - t1
        variants[name] = fn
    return _alternate(variants, args.iters)


def bench_hsdp(args) -> dict[str, dict[str, float]]:
    """Part 3 (4 ranks): HSDP 2 x 2, ep = 2; 'extra_s' = replica all-reduces per step."""
    import epscale
    from epscale.model import build_model
    from epscale.parallel import apply_fsdp, finish_gradients, parallelize

    dims = epscale.ParallelDims(dp=2, ep=2, fsdp=True, dp_replicate=2)
    replica = dist.get_process_group_ranks(dims.dense_mesh.get_group("dp_replicate"))
    cfg = _tiny_cfg(2)
    real = dist.all_reduce
    count = [0]

    def counting(tensor, *a, group=None, **kw):
        if group is not None and dist.get_process_group_ranks(group) == replica:
            count[0] += 1
        return real(tensor, *a, group=group, **kw)

    variants = {}
    for name, overlap in (("every micro-batch", False), ("once per step", True)):
        model = build_model(cfg)
        parallelize(model, dims)
        apply_fsdp(model, dims, prefetch=overlap)
        step = _stepper(model, overlap)
        loader = _Loader(cfg.model.vocab_size, cfg.model.seq_len, dist.get_rank())

        def fn(model=model, step=step, loader=loader):
            model.zero_grad(set_to_none=True)
            count[0] = 0
            dist.all_reduce = counting
            try:
                t0 = time.perf_counter()
                step.train(loader, args.accum)
                finish_gradients(model, dims)
                t = time.perf_counter() - t0
            finally:
                dist.all_reduce = real
            return t, float(count[0])
        variants[name] = fn
    return _alternate(variants, args.iters)


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------


def _worker(rank, world, args):
    out = {"layer": bench_layer(args), "replicated": bench_replicated(args)}
    if world == 4:
        out["hsdp"] = bench_hsdp(args)
    return out


def _table(title: str, res: dict, base: str, extra: str) -> None:
    print(f"\n{title}")
    print(f"| variant | time (s) | vs {base} | {extra} |")
    print("|---|---|---|---|")
    for name, r in res.items():
        ratio = r["time_s"] / res[base]["time_s"]
        print(f"| {name} | {r['time_s']:.4f} | {ratio:.2f} | {r['extra_s']:.4f} |")


def main(argv=None) -> int:
    from epscale.tune.calibrate import spawn_local

    args = parse(argv)
    res = spawn_local(_worker, args.world, args=(args,))[0]
    print(f"world={args.world} tokens/rank={args.tokens} dim={args.dim} hidden={args.hidden} "
          f"E={args.experts} K={args.top_k} chunks={args.chunks} accum={args.accum} "
          f"iters={args.iters} (medians, slowest rank)")
    _table(f"Part 1: MoE layer fwd+bwd, dedup, ep={args.world}", res["layer"], "none",
           "backward exchange waits (s)")
    _table(f"Part 2: replicated dp={args.world}, accum={args.accum}", res["replicated"],
           "after backward", "sync_gradients after backward (s)")
    if "hsdp" in res:
        _table("Part 3: HSDP 2 x 2, ep=2", res["hsdp"], "every micro-batch",
               "replica all-reduces per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
