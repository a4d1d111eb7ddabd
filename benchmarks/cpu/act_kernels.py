"""The fused expert kernel's element-wise work on its own: the native C kernels of the
default build against the same source built with its generic loops, and against the eager
torch ops, side by side in one process (not a test).

    .venv/bin/python benchmarks/act_kernels.py                    # 1 thread, as a chunk worker runs them
    .venv/bin/python benchmarks/act_kernels.py --threads 2 --json /tmp/act.json

Competitors (each timed forward and backward, SwiGLU and GELU, bf16 and fp32):
  default   epscale.kernels.cpu.native.get(): on a CPU with AVX-512 BF16, bf16 rows run
            the hand-vectorised loops (vscalefps exp, vcvtneps2bf16 rounding)
  generic   the same source built with -DEPSCALE_GENERIC_LOOPS: the compiler-vectorised
            loops, what other CPUs and fp32 run
  eager     epscale.kernels.cpu.inductor.act_forward_eager / act_backward_eager: torch
            ops, fp32 inside, fresh result tensors every call (page faults included;
            the layer's own eager mode, moe.cpu.elementwise=off, writes into buffers)

Shapes [C, F]: two chunk-sized ones (the planner's ~1 MB chunks: wide 372 x 1408, coarse
1024 x 1024) and one out of cache (4096 x 1408). Every competitor's bf16 output is
checked against the default build's first. Rates are elements per second of the best of
``--reps`` calls per round, rounds alternating between competitors.
Legend: C rows, F expert hidden dim.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from epscale.kernels.cpu import native as native_kernels
from epscale.kernels.cpu.inductor import act_backward_eager, act_forward_eager

SHAPES = ((372, 1408), (1024, 1024), (4096, 1408))


def inputs(rows: int, cols: int, swiglu: bool, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    h1 = (torch.randn(rows, cols, generator=g) * 3).to(dtype)
    h3 = torch.randn(rows, cols, generator=g).to(dtype) if swiglu else None
    ga = torch.randn(rows, cols, generator=g).to(dtype)
    return ga, h1, h3, torch.rand(rows, generator=g)


def native_pair(k: native_kernels.NativeKernels, ga, h1, h3, w):
    """(forward, backward) callables writing into buffers allocated once."""
    a, aw, gh1 = torch.empty_like(h1), torch.empty_like(h1), torch.empty_like(h1)
    gh3 = torch.empty_like(h1) if h3 is not None else None
    gw = torch.empty(h1.shape[0])
    return (lambda: k.forward(h1, h3, w, a),
            lambda: (k.backward(ga, h1, h3, w, gw, aw, gh1, gh3), aw)[1])


def eager_pair(ga, h1, h3, w):
    return (lambda: act_forward_eager(h1, h3, w),
            lambda: act_backward_eager(ga, h1, h3, w)[1])


def best_times(fns: dict, rounds: int, reps: int) -> dict:
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: a chunk worker runs the kernels alone)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    default = native_kernels.get("native")
    if default is None:
        raise SystemExit(f"the native kernels did not build: {native_kernels.BUILDER.failed}")
    with tempfile.TemporaryDirectory() as tmp:
        generic = native_kernels.build_generic(Path(tmp))
        print(f"torch {torch.__version__}, {args.threads} thread(s); default build: "
              f"{native_kernels.describe('native', 'cpu')}")
        print(f"{'act':7s}{'dtype':10s}{'shape':>12s}{'pass':>5s}"
              f"{'default':>10s}{'generic':>10s}{'eager':>10s}  Gel/s   default/generic  default/eager")
        rows = []
        for dtype in (torch.bfloat16, torch.float32):
            for swiglu in (True, False):
                for shape in SHAPES:
                    ga, h1, h3, w = inputs(*shape, swiglu, dtype)
                    pairs = dict(default=native_pair(default, ga, h1, h3, w),
                                 generic=native_pair(generic, ga, h1, h3, w),
                                 eager=eager_pair(ga, h1, h3, w))
                    for i, direction in enumerate(("fwd", "bwd")):
                        fns = {name: pair[i] for name, pair in pairs.items()}
                        want = fns["default"]().clone()
                        for name in ("generic", "eager"):
                            torch.testing.assert_close(fns[name]().float(), want.float(),
                                                       rtol=2 ** -7, atol=1e-5)
                        t = best_times(fns, args.rounds, args.reps)
                        rate = {name: h1.numel() / t[name] / 1e9 for name in t}
                        row = dict(act="swiglu" if swiglu else "gelu", dtype=str(dtype).split(".")[1],
                                   rows=shape[0], cols=shape[1], direction=direction,
                                   gel_per_s=rate, default_over_generic=t["generic"] / t["default"],
                                   default_over_eager=t["eager"] / t["default"])
                        rows.append(row)
                        print(f"{row['act']:7s}{row['dtype']:10s}{f'{shape[0]}x{shape[1]}':>12s}"
                              f"{direction:>5s}{rate['default']:10.2f}{rate['generic']:10.2f}"
                              f"{rate['eager']:10.2f}         {row['default_over_generic']:6.2f}x"
                              f"        {row['default_over_eager']:6.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, threads=args.threads,
                           vector_bf16=default.vector_bf16, rows=rows), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
