"""The combine step on its own: epscale's ``embedding_bag`` combines against the forms they
replaced, side by side in one process (not a test).

    .venv/bin/python benchmarks/combine.py                       # all threads, wall clock
    .venv/bin/python benchmarks/combine.py --threads 1 --clock cpu --json /tmp/combine.json
    python benchmarks/combine.py --device cuda                   # on a GPU (benchmarks/gpu_check.sh)

Part 1, the fused kernel's per-token sum (no EP): out[t] = sum_k rows[pos[t, k]].
  embedding_bag   epscale.kernels.cpu.rows.gather_combine (current)
  gather+sum      the former form: per 1 MB block of tokens, index_select the block's K
                  rows into a buffer, then add them (fp32 sum, one rounding, for K > 2)

Part 2, the dispatchers' weighted sum (alltoall, dedup): out[m] = sum_k w[m, k] *
y[row of (m, k)], for all of a token's K rows present (local / alltoall) or only the
ones on this rank's experts (dedup's received rows, a fraction ``fill`` of M*K).
  embedding_bag   epscale.dispatch.local.unpermute_weighted's forward (current)
  gather+bmm      the former local/alltoall form: per block, gather K rows (a zero weight
                  for missing ones), one batched [1,K]x[K,D] product
  index_add       the former dedup form: weighted rows index_add_'ed into zeros

Every competitor's output is checked against the current one first. Times are the best
of ``--reps`` calls per round, rounds alternating between competitors.
Legend: T tokens (M received rows), K top-k, D model dim.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from epscale.ops import rows_per_block
from epscale.dispatch.rows import WeightedRowSum, assignment_rows
from epscale.kernels.cpu.rows import gather_combine

SHAPES = {"coarse": (4096, 2, 1024), "fine": (4096, 8, 1024), "narrow": (2048, 8, 512)}
FILLS = (1.0, 0.25, 0.125)  # 1.0: local/alltoall; 0.25 / 0.125: dedup at EP=4 / 8 (uniform routing)


def sum_by_gather(rows_RD: torch.Tensor, pos_TK: torch.Tensor) -> torch.Tensor:
    """The former per-token sum: blocked index_select into a buffer, then add/sum."""
    T, K = pos_TK.shape
    D, dt = rows_RD.shape[1], rows_RD.dtype
    dev = rows_RD.device
    out = torch.empty((T, D), dtype=dt, device=dev)
    B = rows_per_block(T, K * D * rows_RD.element_size(), dev)
    buf = torch.empty((B * K, D), dtype=dt, device=dev)
    acc = torch.empty((B, D), dtype=torch.float32, device=dev) if K > 2 and dt != torch.float32 else None
    flat = pos_TK.reshape(-1)
    for b0 in range(0, T, B):
        n = min(T, b0 + B) - b0
        g = torch.index_select(rows_RD, 0, flat[b0 * K:(b0 + n) * K], out=buf[:n * K]).view(n, K, D)
        o = out[b0:b0 + n]
        if K == 1:
            o.copy_(g[:, 0])
        elif acc is None:
            torch.add(g[:, 0], g[:, 1], out=o)
            for k in range(2, K):
                o.add_(g[:, k])
        else:
            o.copy_(torch.sum(g, dim=1, dtype=torch.float32, out=acc[:n]))
    return out


def weighted_by_gather_bmm(y_RD: torch.Tensor, order_R: torch.Tensor, w_MK: torch.Tensor) -> torch.Tensor:
    """The former local/alltoall weighted sum: blocked gather + batched [1,K]x[K,D]."""
    M, K = w_MK.shape
    R, D = y_RD.shape
    dt, dev = y_RD.dtype, y_RD.device
    out = torch.empty((M, D), dtype=dt, device=dev)
    pos = assignment_rows(order_R, (M, K)).view(-1)
    w_M1K = torch.where((pos < R).view(M, K), w_MK, 0).to(dt).unsqueeze(1)
    pos = pos.clamp_(max=R - 1)
    B = rows_per_block(M, K * D * y_RD.element_size(), dev)
    buf = torch.empty((B * K, D), dtype=dt, device=dev)
    for b0 in range(0, M, B):
        n = min(M, b0 + B) - b0
        g = torch.index_select(y_RD, 0, pos[b0 * K:(b0 + n) * K], out=buf[:n * K])
        torch.bmm(w_M1K[b0:b0 + n], g.view(n, K, D), out=out[b0:b0 + n].view(n, 1, D))
    return out


def weighted_by_index_add(y_RD: torch.Tensor, order_R: torch.Tensor, w_MK: torch.Tensor) -> torch.Tensor:
    """The former dedup weighted sum: weighted rows index_add_'ed into zeros."""
    M, K = w_MK.shape
    w_R = w_MK.reshape(-1).index_select(0, order_R).to(y_RD.dtype)
    out = y_RD.new_zeros((M, y_RD.shape[1]))
    return out.index_add_(0, order_R // K, y_RD * w_R.unsqueeze(1))


def time_side_by_side(fns: dict, rounds: int, reps: int, clock, sync) -> dict[str, float]:
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    sync()
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(reps):
                t0 = clock()
                fn()
                sync()
                best[name] = min(best[name], clock() - t0)
    return best


def check_close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> float:
    err = ((ours.double() - theirs.double()).norm() / ours.double().norm().clamp(min=1e-30)).item()
    if not err < 1e-2:
        raise SystemExit(f"{what}: outputs differ by {err:.3g} (relative norm); not the same sum")
    return err


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="coarse,fine,narrow", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="cpu: process CPU time (use with --threads 1)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch sees no CUDA device")
    if args.clock == "cpu" and dev.type != "cpu":
        raise SystemExit("--clock cpu measures host CPU time: use --clock wall with --device cuda")
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        raise SystemExit("--clock cpu sums all threads' CPU time: use it with --threads 1")
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; choose from {', '.join(SHAPES)}")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    dt = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {dev}, {torch.get_num_threads()} threads, {args.clock} clock, "
          f"{args.dtype}")
    print(f"{'part':9s} {'shape':8s} {'fill':>5s} {'current ms':>10s} {'former':>12s} "
          f"{'former ms':>10s} {'speedup':>8s}")
    rows = []

    def report(part, shape, fill, best, current="embedding_bag"):
        for name, t in best.items():
            if name == current:
                continue
            r = dict(part=part, shape=shape, fill=fill, current_ms=best[current] * 1e3,
                     former=name, former_ms=t * 1e3, speedup=t / best[current])
            rows.append(r)
            print(f"{part:9s} {shape:8s} {fill:5.3f} {r['current_ms']:10.3f} {name:>12s} "
                  f"{r['former_ms']:10.3f} {r['speedup']:8.2f}")

    for shape in args.shapes.split(","):
        T, K, D = SHAPES[shape]
        R = T * K
        rows_RD = torch.randn(R + 1, D, generator=g).to(dev, dt)
        rows_RD[R] = 0
        pos_TK = torch.randperm(R, generator=g).view(T, K).to(dev)
        check_close(gather_combine(rows_RD, pos_TK), sum_by_gather(rows_RD, pos_TK), f"sum {shape}")
        best = time_side_by_side({"embedding_bag": lambda: gather_combine(rows_RD, pos_TK),
                                  "gather+sum": lambda: sum_by_gather(rows_RD, pos_TK)},
                                 args.rounds, args.reps, clock, sync)
        report("sum", shape, 1.0, best)
        for fill in FILLS:
            keep = torch.rand(R, generator=g) < fill
            order = torch.randperm(R, generator=g)
            order_R = order[keep[order]].to(dev)  # kept (m, k) ids, in an arbitrary (expert) order
            y_RD = torch.randn(order_R.numel(), D, generator=g).to(dev, dt)
            w_TK = torch.rand(T, K, generator=g).to(dev)
            fns = {"embedding_bag": lambda: WeightedRowSum.apply(y_RD, order_R, w_TK),
                   "gather+bmm": lambda: weighted_by_gather_bmm(y_RD, order_R, w_TK),
                   "index_add": lambda: weighted_by_index_add(y_RD, order_R, w_TK)}
            ref = fns["embedding_bag"]()
            for name in ("gather+bmm", "index_add"):
                check_close(ref, fns[name](), f"weighted {shape} {name}")
            report("weighted", shape, fill, time_side_by_side(fns, args.rounds, args.reps, clock, sync))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, device=str(dev), threads=torch.get_num_threads(),
                           clock=args.clock, dtype=args.dtype, rows=rows), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
