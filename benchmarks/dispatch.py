"""Dispatch + combine of every EP backend, side by side, in one run (not a test).

    torchrun --nproc-per-node 8 benchmarks/dispatch.py                 # CPU, gloo
    torchrun --nproc-per-node 8 benchmarks/dispatch.py --quick         # smaller shapes
    srun torchrun ... benchmarks/dispatch.py --ranks-per-node 8        # GPUs, NCCL

Part 1 (dispatch): for each EP size that divides the world (dp = world/ep groups run at
once), each routing (uniform, skewed, group-limited) and each backend, with identity
experts: exact bytes sent per rank (counted by the dispatcher, forward and backward,
and the part that crosses nodes), time of dispatch+combine forward and backward (median
over iterations, slowest rank), and the ratios to alltoall. Every backend's output is
first checked against alltoall's on the same input.

Part 2 (layer): the whole MoE layer forward+backward under EP=4 for each backend, and
dedup with chunked overlap (dispatch_compute_combine), with the ratio to alltoall and a
plain statement of whether overlap helped on this machine.

Legend: T tokens per rank, D model dim, E experts, K top-k.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import epscale
from epscale.dispatch.deepep import DeepEPBuffer, deepep_available, hidden_bytes_of
from epscale.parallel import make_dispatcher

BACKENDS = [("alltoall", "auto"), ("allgather", "auto"), ("dedup", "auto"), ("dedup", "fp8"),
            ("hierarchical", "auto"), ("deepep", "auto")]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--ep-sizes", default="2,4,8")
    p.add_argument("--routings", default="uniform,skewed,grouped")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="emulated node size (default: LOCAL_WORLD_SIZE, or 4 on CPU)")
    p.add_argument("--layer-tokens", type=int, default=1024)
    p.add_argument("--layer-dim", type=int, default=512)
    p.add_argument("--layer-hidden", type=int, default=256)
    p.add_argument("--layer-ep", type=int, default=4)
    p.add_argument("--overlap-chunks", type=int, default=4)
    p.add_argument("--skip-layer", action="store_true")
    p.add_argument("--quick", action="store_true", help="small shapes for a smoke run")
    p.add_argument("--json", default=None, help="write all rows to this file (rank 0)")
    a = p.parse_args()
    if a.quick:
        a.tokens, a.dim, a.iters, a.layer_tokens, a.layer_dim, a.layer_hidden = 256, 256, 2, 256, 128, 64
    return a


# ------------------------------------------------------------------------------ routing
def make_routing(kind: str, T: int, E: int, K: int, ep: int, seed: int, device):
    """topk_idx [T, K] and weights [T, K]: 'uniform' (K distinct experts at random),
    'skewed' (Zipf-like popularity, exponent 1.2), 'grouped' (8 groups of experts, each
    token confined to its 4 best groups, DeepSeek-V3 style)."""
    g = torch.Generator().manual_seed(1000 + seed)
    gumbel = -torch.log(-torch.log(torch.rand(T, E, generator=g).clamp(1e-9, 1 - 1e-9)))
    if kind == "uniform":
        scores = gumbel
    elif kind == "skewed":
        pop = 1.0 / torch.arange(1, E + 1).float() ** 1.2
        perm = torch.randperm(E, generator=torch.Generator().manual_seed(7))  # same on all ranks
        scores = torch.log(pop[perm]) + gumbel
    elif kind == "grouped":
        from epscale.moe.router import select_experts
        idx = select_experts(gumbel, K, num_groups=8, topk_groups=4)
        w = torch.rand(T, K, generator=g)
        return idx.to(device), (w / w.sum(1, keepdim=True)).to(device)
    else:
        raise ValueError(f"routing {kind!r} is not one of uniform, skewed, grouped")
    idx = scores.topk(K, dim=1).indices
    w = torch.rand(T, K, generator=g)
    return idx.to(device), (w / w.sum(1, keepdim=True)).to(device)


# ------------------------------------------------------------------------------ helpers
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def slowest(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def mean_over_ranks(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def build(backend: str, payload: str, E: int, dims, deepep_buffer=None):
    return make_dispatcher(backend, E, dims, payload=payload, deepep_buffer=deepep_buffer)


def time_dispatch(disp, x, idx, w, g, iters: int, device):
    """Median forward (dispatch+combine) and backward seconds; bytes of one iteration."""
    fwd, bwd, out = [], [], None
    b0 = disp.bytes_sent()
    i0 = getattr(disp, "inter_node_bytes_sent", lambda: 0)()
    fwd_bytes = None
    for it in range(iters + 1):  # the first iteration warms up
        xi = x.detach().requires_grad_(True)
        wi = w.detach().requires_grad_(True)
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        recv_x, counts, handle = disp.dispatch(xi, idx, wi)
        y = disp.combine(recv_x, handle)
        sync(device)
        t1 = time.perf_counter()
        if fwd_bytes is None:
            fwd_bytes = disp.bytes_sent() - b0
        (y.float() * g).sum().backward()
        sync(device)
        t2 = time.perf_counter()
        if it:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        out = y.detach()
    n = iters + 1
    total = (disp.bytes_sent() - b0) / n
    inter = (getattr(disp, "inter_node_bytes_sent", lambda: 0)() - i0) / n
    return statistics.median(fwd), statistics.median(bwd), fwd_bytes, total - fwd_bytes, inter, out


# ------------------------------------------------------------------------------ part 1
def bench_dispatch(args, device, dtype, rank, world, rpn):
    rows = []
    E, K, T, D = args.experts, args.top_k, args.tokens, args.dim
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, D, generator=g).to(device=device, dtype=dtype)
    grad = torch.randn(T, D, generator=g).to(device)
    have_deepep = deepep_available()[0] and device.type == "cuda"
    for ep in [int(s) for s in args.ep_sizes.split(",")]:
        if world % ep or E % ep:
            if rank == 0:
                print(f"# skipping ep={ep}: needs world % ep == 0 and experts % ep == 0")
            continue
        dims = epscale.ParallelDims(dp=world // ep, ep=ep, ranks_per_node=rpn)
        # deepep: one buffer per EP group, as parallelize builds it; nothing to exchange at ep=1
        deepep_buf = DeepEPBuffer(dims, hidden_bytes_of(D)) if have_deepep and ep > 1 else None
        for routing in args.routings.split(","):
            idx, w = make_routing(routing, T, E, K, ep, rank, device)
            ref = None
            for backend, payload in BACKENDS:
                if backend == "deepep" and deepep_buf is None:
                    continue
                disp = build(backend, payload, E, dims, deepep_buf)
                f, b, fb, bb, inter, y = time_dispatch(disp, x, idx, w, grad, args.iters, device)
                if ref is None:
                    ref = y.float()
                err = float((y.float() - ref).norm() / ref.norm())
                row = dict(ep=ep, routing=routing, backend=backend + ("+fp8" if payload == "fp8" else ""),
                           fwd_ms=1e3 * slowest(f, device), bwd_ms=1e3 * slowest(b, device),
                           fwd_MB=mean_over_ranks(fb, device) / 2**20,
                           bwd_MB=mean_over_ranks(bb, device) / 2**20,
                           inter_MB=mean_over_ranks(inter, device) / 2**20,
                           rel_err_vs_alltoall=slowest(err, device), nodes=dims.ep_num_nodes)
                rows.append(row)
                del disp
    return rows


def print_dispatch(rows, args, world, rpn):
    print(f"\n## Dispatch + combine (identity experts): T={args.tokens}/rank, D={args.dim}, "
          f"top-{args.top_k} of {args.experts}, {args.dtype}, world={world}, "
          f"ranks_per_node={rpn}, median of {args.iters}")
    print("bytes: mean per rank, counted exactly (forward = dispatch+combine); time: slowest rank")
    hdr = (f"{'ep':>3} {'routing':>8} {'backend':>13} {'nodes':>5} {'fwd MB':>8} {'bwd MB':>8} "
           f"{'inter MB':>8} {'fwd ms':>8} {'bwd ms':>8} {'bytes/a2a':>9} {'time/a2a':>8} {'err':>8}")
    print(hdr)
    base = {(r["ep"], r["routing"]): r for r in rows if r["backend"] == "alltoall"}
    for r in rows:
        b = base[(r["ep"], r["routing"])]
        br = (r["fwd_MB"] + r["bwd_MB"]) / max(b["fwd_MB"] + b["bwd_MB"], 1e-12)
        tr = (r["fwd_ms"] + r["bwd_ms"]) / (b["fwd_ms"] + b["bwd_ms"])
        r["bytes_ratio"], r["time_ratio"] = br, tr
        print(f"{r['ep']:>3} {r['routing']:>8} {r['backend']:>13} {r['nodes']:>5} {r['fwd_MB']:>8.1f} "
              f"{r['bwd_MB']:>8.1f} {r['inter_MB']:>8.1f} {r['fwd_ms']:>8.1f} {r['bwd_ms']:>8.1f} "
              f"{br:>9.3f} {tr:>8.3f} {r['rel_err_vs_alltoall']:>8.1e}")


# ------------------------------------------------------------------------------ part 2
def overlapped(moe):
    """The layer flow with dispatch_compute_combine (what MoE.forward does once wired)."""
    def fwd(x):
        route = moe.router(x)
        shared = (lambda: moe.shared_experts(x)) if moe.shared_experts is not None else None
        return moe.dispatcher.dispatch_compute_combine(
            x, route.topk_idx_TK, route.topk_weight_TK, moe.experts, side_work=shared)
    return fwd


def bench_layer(args, device, rank, world, rpn):
    ep = args.layer_ep
    if world % ep:
        return []
    dims = epscale.ParallelDims(dp=world // ep, ep=ep, ranks_per_node=rpn)
    torch.manual_seed(0)
    cfg = epscale.MoEConfig(dim=args.layer_dim, hidden_dim=args.layer_hidden,
                            num_experts=args.experts, top_k=args.top_k, num_shared_experts=1)
    base = epscale.MoE(cfg).to(device)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.layer_tokens, cfg.dim, generator=g).to(device)
    variants = [("alltoall", 1, "auto"), ("allgather", 1, "auto"), ("dedup", 1, "auto"),
                ("hierarchical", 1, "auto"), ("dedup", 1, "fp8"), ("dedup", args.overlap_chunks, "auto")]
    rows, ref = [], None
    for backend, chunks, payload in variants:
        moe = epscale.parallelize(copy.deepcopy(base), dims, dispatcher=backend,
                                  overlap_chunks=chunks, payload=payload)
        fwd = overlapped(moe) if chunks > 1 else moe
        times = []
        for it in range(args.iters + 1):
            dist.barrier()
            sync(device)
            t0 = time.perf_counter()
            y = fwd(x.detach().requires_grad_(True))
            y.square().mean().backward()
            sync(device)
            if it:
                times.append(time.perf_counter() - t0)
        ref = y.detach() if ref is None else ref
        err = float((y.detach() - ref).norm() / ref.norm())
        rows.append(dict(backend=backend + ("+fp8" if payload == "fp8" else ""), chunks=chunks,
                         ms=1e3 * slowest(statistics.median(times), device),
                         rel_err=slowest(err, device)))
    return rows


def print_layer(rows, args, world):
    print(f"\n## MoE layer forward+backward, EP={args.layer_ep} (dp={world // args.layer_ep}): "
          f"T={args.layer_tokens}/rank, D={args.layer_dim}, F={args.layer_hidden}, "
          f"top-{args.top_k} of {args.experts}, 1 shared expert, fp32, slowest rank")
    base = rows[0]["ms"]
    for r in rows:
        r["ratio"] = r["ms"] / base
        print(f"{r['backend']:>13} chunks={r['chunks']}  {r['ms']:9.1f} ms   x{r['ratio']:.3f} vs alltoall"
              f"   output rel. err vs alltoall {r['rel_err']:.1e}")
    plain = next(r for r in rows if r["backend"] == "dedup" and r["chunks"] == 1)["ms"]
    over = rows[-1]["ms"]
    verdict = ("overlap helped" if over < 0.95 * plain else
               "overlap did NOT help here (the collectives and the expert compute share the "
               "same CPU cores, or the backend serialises them)")
    print(f"dedup overlap ({args.overlap_chunks} chunks) / no overlap: {over / plain:.3f} -> {verdict}")


def main() -> int:
    args = parse()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda")
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    rpn = args.ranks_per_node or (int(os.environ.get("LOCAL_WORLD_SIZE", world)) if cuda
                                  else min(4, world))
    dtype = getattr(torch, args.dtype)
    rows = bench_dispatch(args, device, dtype, rank, world, rpn)
    if rank == 0:  # part 1 as soon as it is measured (a later part may run out of time)
        print_dispatch(rows, args, world, rpn)
        sys.stdout.flush()
    layer = [] if args.skip_layer else bench_layer(args, device, rank, world, rpn)
    if rank == 0:
        if layer:
            print_layer(layer, args, world)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "dispatch": rows, "layer": layer}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
