"""Where one MoE layer's forward + backward spends its time: torch.profiler over a few steps
of epscale's layer and of the comparisons in benchmarks/moe_layer.py, on CPU or CUDA.

    .venv/bin/python benchmarks/profile_layer.py --configs coarse --impls epscale,eager
    python benchmarks/profile_layer.py --device cuda --impls epscale,rows,torchtitan

Per (config, implementation) it prints the best step time (wall clock, synchronised),
what one step asks of the host: operator calls, kernel launches and host synchronisations
(CUDA; a synchronisation stalls the launch queue), and the top operators by self time on
the device (CUDA) or the CPU. It finds launch-bound and sync-bound steps, which the
throughput table of moe_layer.py only shows as a low efficiency.
Legend: T tokens, D model dim.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

import moe_layer as ml

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPIES = ("cudaMemcpyAsync", "cudaMemcpy")


def build(name: str, shape, dtype) -> ml.Impl | str:
    """One implementation; the comparisons get the weights of epscale's default layer."""
    ours = lambda: ml.build_epscale(shape, dtype).module  # noqa: E731
    makers = {
        "epscale": lambda: ml.build_epscale(shape, dtype),
        "rows": lambda: ml.build_epscale(shape, dtype, fuse=False),
        "grouped": lambda: ml.build_epscale(shape, dtype, gemm="grouped"),
        "eager": lambda: ml.build_epscale(shape, dtype, kernels="off"),
        "inductor": lambda: ml.build_epscale(shape, dtype, kernels="inductor"),
        "serial": lambda: ml.build_epscale(shape, dtype, workers=1),
        "torchtitan": lambda: ml.build_torchtitan(ours(), shape, dtype),
        "mixtral-grouped": lambda: ml.build_mixtral(ours(), shape, dtype, "grouped_mm"),
    }
    if name not in makers:
        raise SystemExit(f"--impls: unknown {name!r}; known: {', '.join(makers)}")
    return makers[name]()


def step_of(impl: ml.Impl, shape, dtype):
    """One forward + backward of ``impl`` on a fixed random [T, D] input."""
    g = torch.Generator().manual_seed(1)
    x_TD = torch.randn(shape["T"], shape["D"], generator=g).to(ml.DEVICE, dtype).requires_grad_(True)
    gy_TD = torch.randn(shape["T"], shape["D"], generator=g).to(ml.DEVICE, dtype)
    return ml.make_step(impl, x_TD, gy_TD)


def profile_one(impl: ml.Impl, shape, dtype, steps: int) -> dict:
    step = step_of(impl, shape, dtype)
    best = ml.best_time(step, reps=max(3, steps))  # also the warm-up
    cuda = ml.DEVICE.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with ml._quiet_stderr(), profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        ml.sync()
    events = prof.key_averages()
    calls = {e.key: e.count for e in events}
    ops = sum(n for k, n in calls.items() if k.startswith("aten::"))
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    return dict(impl=impl.name, step_ms=1e3 * best,
                aten_ops_per_step=ops / steps,
                launches_per_step=sum(calls.get(k, 0) for k in LAUNCHES) / steps,
                syncs_per_step=sum(calls.get(k, 0) for k in SYNCS) / steps,
                memcpy_per_step=sum(calls.get(k, 0) for k in COPIES) / steps,
                table=events.table(sort_by=sort, row_limit=14, max_name_column_width=48))


def find_syncs(impl: ml.Impl, shape, dtype) -> list[tuple[int, str]]:
    """(count, where) of every host synchronisation in one step, from CUDA's sync debug
    mode: the epscale frames of the Python stack that asked for it (autograd's backward
    threads included)."""
    step = step_of(impl, shape, dtype)
    step()  # warm-up: first-call work is not the steady state
    ml.sync()
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "/src/epscale/" in f.filename]
        where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                            for f in reversed(frames[-3:])) or "(no epscale frame: autograd backward)"
        sites[where] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    ml.sync()
    return sorted(((n, w) for w, n in sites.items()), reverse=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="coarse,fine", help="comma list of: " + ", ".join(ml.CONFIGS))
    p.add_argument("--shape", default=None, help="custom E,K,D,F,T instead of --configs")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--impls", default="epscale,torchtitan")
    p.add_argument("--steps", type=int, default=5, help="profiled steps (after a warm-up)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--tables", action="store_true", help="print each profile's top operators")
    p.add_argument("--find-syncs", action="store_true",
                   help="CUDA: also list where each host synchronisation of a step comes from")
    p.add_argument("--json", default=None, help="write the per-step counts here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ml.DEVICE = ml.parse_device(p, args.device)
    todo = ml.parse_shapes(p, args.configs, args.shape)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {ml.DEVICE}, {torch.get_num_threads()} threads, {args.dtype}")
    if ml.DEVICE.type == "cpu" and torch.get_num_threads() > 1:
        print("note: the profiler records the calling thread's ops only; with 2+ threads the "
              "fused kernel's chunks run on torch's OpenMP team (epscale.kernels.cpu.chunk_workers), "
              "whose other threads' ops are not counted. --threads 1 counts them all.")
    out = []
    for label, shape in todo:
        print(f"\n== {label}  E={shape['E']} K={shape['K']} D={shape['D']} F={shape['F']} T={shape['T']}")
        print(f"{'implementation':34s} {'ms/step':>8s} {'aten ops':>9s} {'launches':>9s} "
              f"{'syncs':>6s} {'memcpy':>7s}")
        for name in args.impls.split(","):
            impl = build(name, shape, dtype)
            if isinstance(impl, str):
                print(f"{name:34s} unavailable: {impl}")
                continue
            r = profile_one(impl, shape, dtype, args.steps)
            print(f"{r['impl']:34s} {r['step_ms']:8.2f} {r['aten_ops_per_step']:9.0f} "
                  f"{r['launches_per_step']:9.0f} {r['syncs_per_step']:6.1f} "
                  f"{r['memcpy_per_step']:7.1f}")
            if args.tables:
                print(r["table"])
            if args.find_syncs and ml.DEVICE.type == "cuda":
                syncs = find_syncs(impl, shape, dtype)
                r["sync_sites"] = syncs
                print(f"  host syncs in one step: {sum(n for n, _ in syncs)}")
                for n, where in syncs:
                    print(f"  {n:4d}  {where}")
            out.append(dict(config=label, shape=shape, **{k: v for k, v in r.items() if k != "table"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(benchmark="profile_layer", device=str(ml.DEVICE), dtype=args.dtype,
                           torch=torch.__version__, results=out), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
