"""One MoE layer, forward + backward on CPU: epscale beside torchtitan's MoE and Hugging Face
transformers' MixtralSparseMoeBlock, measured side by side in one run.

    .venv/bin/python benchmarks/moe_layer.py                       # coarse + fine, bf16 + fp32
    .venv/bin/python benchmarks/moe_layer.py --configs fine --dtypes bfloat16 --json out.json
    .venv/bin/python benchmarks/moe_layer.py --shape 16,2,512,1408,2048   # E,K,D,F,T

Figures per (config, dtype, implementation), best step of all timed steps:
  tokens/s     T / step time (forward + backward, gradients set to None between steps).
  useful GF/s  expert GEMM FLOPs actually needed (3 passes x T*K rows x 2*D*F x 3 matrices
               for SwiGLU) divided by the step time. Router, permutation and combine are
               overhead by this definition.
  efficiency   useful GF/s / dense GF/s, where dense GF/s is measured in the same run: the
               same nine GEMMs a dense SwiGLU FFN does forward + backward over all T*K rows
               (one weight instead of one per expert, outputs preallocated). A layer that
               lost nothing to routing would score 1.0. ``vs peak`` divides by a square
               2048^3 matmul instead (the machine's best GEMM rate in that dtype).
  peak MB      peak tensor memory allocated during one step (torch profiler, all tensors
               allocated in the step: activations, workspaces and gradients; the previous
               step's gradients and epscale's kept buffers are dropped before it, so
               neither offsets nor hides anything).

The other implementations get our weights copied in (router gate, w1/w3/w2), so they do
identical work; their outputs are checked against ours before timing. Implementations
are timed in interleaved rounds so that a noisy neighbour hits all of them alike.
Benchmark-only dependencies: ``pip install -e '.[bench]'`` (transformers, torchtitan).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass

import torch

import epscale
from epscale.config import CpuKernelConfig
from epscale.dispatch.local import LocalDispatcher

CONFIGS = {
    "coarse": dict(E=8, K=2, D=1024, F=1024, T=4096),
    "fine": dict(E=64, K=8, D=1024, F=256, T=4096),
}


@dataclass
class Impl:
    name: str
    module: torch.nn.Module
    run: callable          # x_TD -> y_TD (differentiable)
    note: str = ""


# ------------------------------------------------------------------ implementations

def build_epscale(shape, dtype, fuse: bool = True, gemm: str = "auto",
                  kernels: str = "auto", workspace: bool = True, workers: int | None = None,
                  impl: str = "auto") -> Impl:
    cpu = CpuKernelConfig(gemm=gemm, elementwise=kernels, keep_buffers=workspace,
                          chunk_workers=workers)
    cfg = epscale.MoEConfig(dim=shape["D"], hidden_dim=shape["F"], num_experts=shape["E"],
                            top_k=shape["K"], score_func="softmax", route_norm=True,
                            experts_impl=impl, cpu=cpu)
    torch.manual_seed(0)
    moe = epscale.MoE(cfg).to(dtype).to(DEVICE)
    if impl == "grouped_mm":
        return Impl("epscale (grouped_mm experts)", moe, moe,
                    "moe.experts_impl=grouped_mm: plain autograd over grouped GEMMs, the "
                    "accelerators' path")
    if workers == 1:
        return Impl("epscale (serial chunks)", moe, moe,
                    "one chunk after another, each op split over the intra-op threads")
    if kernels == "inductor":
        return Impl("epscale (inductor element-wise)", moe, moe,
                    "moe.cpu.elementwise=inductor: torch.compile kernels around the GEMMs")
    if kernels == "off":
        return Impl("epscale (eager element-wise)", moe, moe,
                    "moe.cpu.elementwise=off: eager torch ops around the GEMMs")
    if not workspace:
        return Impl("epscale (no workspace)", moe, moe,
                    "fresh gradient/activation buffers every step")
    if gemm == "grouped":
        return Impl("epscale (grouped_mm GEMMs)", moe, moe,
                    "grouped_mm per chunk instead of the per-expert mm loop")
    if not fuse:
        moe.dispatcher = LocalDispatcher(cfg.num_experts, fuse=False,
                                         workspace=moe.experts.row_buffers())
        return Impl("epscale (rows path)", moe, moe,
                    "dispatch -> experts(x_RD) -> combine, the path EP dispatchers take")
    return Impl("epscale", moe, moe)


def build_torchtitan(ours: epscale.MoE, shape, dtype) -> Impl | str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchtitan.models.common.linear import Linear
            from torchtitan.models.common.moe import (MoE, GroupedExperts, LocalTokenDispatcher,
                                                      RoutedExperts, TokenChoiceTopKRouter)
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return f"torchtitan not importable: {type(e).__name__}: {e}"
    E, K, D, F = shape["E"], shape["K"], shape["D"], shape["F"]
    cfg = MoE.Config(
        num_experts=E,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K)),
        router=TokenChoiceTopKRouter.Config(
            num_experts=E, gate=Linear.Config(in_features=D, out_features=E), top_k=K,
            score_func="softmax", route_norm=True),
        load_balance_coeff=None)
    tt = cfg.build()
    with torch.no_grad():
        inner = tt.routed_experts.inner_experts
        inner.w1_EFD.copy_(ours.experts.w1.transpose(1, 2))
        inner.w3_EFD.copy_(ours.experts.w3.transpose(1, 2))
        inner.w2_EDF.copy_(ours.experts.w2.transpose(1, 2))
        tt.router.gate.weight.copy_(ours.router.gate.weight)
    tt = tt.to(dtype).to(DEVICE)
    note = "computes the experts in bf16 whatever the input dtype" if dtype != torch.bfloat16 else ""

    def run(x_TD):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its router asks for fp32 CPU autocast and warns
            return tt(x_TD.unsqueeze(0)).squeeze(0)
    return Impl("torchtitan MoE", tt, run, note)


def build_mixtral(ours: epscale.MoE, shape, dtype, experts_impl: str | None) -> Impl | str:
    try:
        from transformers import MixtralConfig
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()  # standalone expert modules log a notice per build
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except Exception as e:  # noqa: BLE001
        return f"transformers not importable: {type(e).__name__}: {e}"
    cfg = MixtralConfig(hidden_size=shape["D"], intermediate_size=shape["F"],
                        num_local_experts=shape["E"], num_experts_per_tok=shape["K"])
    if experts_impl is not None:
        cfg._experts_implementation = experts_impl
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(ours.router.gate.weight)
        # gate_up_proj [E, 2F, D]: the first F rows are the gate (our w1), then up (w3).
        block.experts.gate_up_proj.copy_(torch.cat([ours.experts.w1.transpose(1, 2),
                                                    ours.experts.w3.transpose(1, 2)], dim=1))
        block.experts.down_proj.copy_(ours.experts.w2.transpose(1, 2))
    block = block.to(dtype).to(DEVICE)
    name = "HF MixtralSparseMoeBlock" + (f" ({experts_impl})" if experts_impl else " (eager)")

    def run(x_TD):
        out = block(x_TD.unsqueeze(0))
        out = out[0] if isinstance(out, tuple) else out
        return out.squeeze(0)
    return Impl(name, block, run)


# ------------------------------------------------------------------ measurement

def dense_gemm_step(shape, dtype):
    """The nine GEMMs of a dense SwiGLU FFN fwd+bwd over R = T*K rows, as one callable."""
    R, D, F = shape["T"] * shape["K"], shape["D"], shape["F"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(R, D, generator=g).to(DEVICE, dtype)
    w = torch.randn(D, F, generator=g).to(DEVICE, dtype) * D ** -0.5
    w2 = torch.randn(F, D, generator=g).to(DEVICE, dtype) * F ** -0.5
    h = torch.randn(R, F, generator=g).to(DEVICE, dtype)
    gy = torch.randn(R, D, generator=g).to(DEVICE, dtype)
    out_RF, out_RD = (torch.empty(R, F, dtype=dtype, device=DEVICE),
                      torch.empty(R, D, dtype=dtype, device=DEVICE))
    out_DF, out_FD = (torch.empty(D, F, dtype=dtype, device=DEVICE),
                      torch.empty(F, D, dtype=dtype, device=DEVICE))

    def step():
        torch.mm(x, w, out=out_RF)             # h1 = x W1
        torch.mm(x, w, out=out_RF)             # h3 = x W3
        torch.mm(h, w2, out=out_RD)            # y = a W2
        torch.mm(gy, w2.t(), out=out_RF)       # da = dy W2^T
        torch.mm(h.t(), gy, out=out_FD)        # dW2 = a^T dy
        torch.mm(x.t(), h, out=out_DF)         # dW1 = x^T dh1
        torch.mm(x.t(), h, out=out_DF)         # dW3 = x^T dh3
        torch.mm(h, w.t(), out=out_RD)         # dx = dh1 W1^T
        out_RD.addmm_(h, w.t())                # dx += dh3 W3^T
    return step


def peak_gemm_step(dtype):
    """One square 2048^3 matmul; returns (callable, its FLOPs)."""
    n = 2048
    a, b = torch.randn(n, n).to(DEVICE, dtype), torch.randn(n, n).to(DEVICE, dtype)
    out = torch.empty(n, n, dtype=dtype, device=DEVICE)
    return (lambda: torch.mm(a, b, out=out)), 2 * n ** 3


CLOCK = time.perf_counter  # --clock cpu switches to process CPU time
DEVICE = torch.device("cpu")  # --device


def sync() -> None:
    """Wait for the device's queued work (accelerators run asynchronously)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def best_time(fn, reps: int) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = CLOCK()
        fn()
        sync()
        best = min(best, CLOCK() - t0)
    return best


def make_step(impl: Impl, x_TD: torch.Tensor, gy_TD: torch.Tensor):
    def step():
        impl.module.zero_grad(set_to_none=True)
        x_TD.grad = None
        impl.run(x_TD).backward(gy_TD)
    return step


def peak_step_memory(step, module: torch.nn.Module, x_TD: torch.Tensor) -> int:
    """Peak bytes of tensors allocated during ``step`` (profiler memory events, in order).
    The previous step's gradients are dropped before the profiled step rather than inside
    it, so that freeing them does not offset the new step's allocations; buffers epscale
    keeps across steps (its workspace) are dropped too, so that the step allocates them
    again and they count."""
    from torch.profiler import ProfilerActivity, profile

    module.zero_grad(set_to_none=True)
    x_TD.grad = None
    for owner in (getattr(module, "experts", None), getattr(module, "dispatcher", None)):
        ws = getattr(owner, "workspace", None)
        if ws is not None:
            ws.clear()
    if DEVICE.type == "cuda":  # the caching allocator's own peak counter
        sync()
        torch.cuda.reset_peak_memory_stats(DEVICE)
        base = torch.cuda.memory_allocated(DEVICE)
        step()
        sync()
        return torch.cuda.max_memory_allocated(DEVICE) - base
    try:  # exact allocation/free order (a private API; fall back to op-level totals)
        from torch.profiler._memory_profiler import Action, MemoryProfileTimeline
    except ImportError:
        Action = MemoryProfileTimeline = None
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                  record_shapes=MemoryProfileTimeline is not None,
                                  with_stack=MemoryProfileTimeline is not None) as prof:
        step()
    if MemoryProfileTimeline is not None:
        created: set = set()
        cur = peak = 0
        timeline = MemoryProfileTimeline(prof._memory_profile()).timeline
        for _, action, (key, _version), nbytes in timeline:
            if action == Action.CREATE:
                created.add(key)
                cur += nbytes
            elif action == Action.DESTROY and key in created:
                cur -= nbytes
            peak = max(peak, cur)
        return peak
    # Op-level fallback: an op's net allocation counts at its start, so frees inside a
    # long op (e.g. an autograd node releasing saved tensors) are seen early.
    deltas = []
    for e in prof.events():
        d = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        if d:
            deltas.append((e.time_range.start, d))
    deltas.sort()
    cur = peak = 0
    for _, d in deltas:
        cur += d
        peak = max(peak, cur)
    return peak


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ side prints start/stop lines on fd 2; keep the tables readable."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)


def near_ties(moe: epscale.MoE, x_TD: torch.Tensor) -> torch.Tensor | None:
    """bool [T]: tokens whose K-th and (K+1)-th router logits (ours, fp32) are within
    2^-5 of the mean |logit| of each other. Another implementation's router, with bf16
    logits, may choose the other expert for them: the outputs then differ by the whole
    expert, which is a different routing decision, not different work."""
    K, E = moe.cfg.top_k, moe.cfg.num_experts
    if K >= E:
        return None
    with torch.no_grad():
        logits_TE = moe.router(x_TD).logits_TE.float()
    top_TK = logits_TE.topk(K + 1, dim=-1).values
    return (top_TK[:, K - 1] - top_TK[:, K]) < 2 ** -5 * logits_TE.abs().mean()


def check_same_work(ours: torch.Tensor, theirs: torch.Tensor, name: str, lowp: bool,
                    near_tie_T: torch.Tensor | None = None) -> float:
    """Relative norm difference of two outputs [T, D]; exits when it says the two do not
    do the same work. In bf16 (``lowp``), tokens at a routing near-tie (``near_tie_T``)
    are left out: each differs by a whole expert when the other router rounds the other
    way (0.3-3% of the tokens on the benchmark shapes, all of them near-ties)."""
    a, b = ours.float(), theirs.float()
    if lowp and near_tie_T is not None:
        a, b = a[~near_tie_T], b[~near_tie_T]
    err = ((a - b).norm() / a.norm()).item()
    limit = 5e-2 if lowp else 1e-3
    if not err < limit:
        left_out = int(near_tie_T.sum()) if lowp and near_tie_T is not None else 0
        raise SystemExit(f"{name}: output differs from epscale's by {err:.3g} (relative "
                         f"norm over {a.shape[0]} tokens, {left_out} routing near-ties "
                         f"left out; limit {limit}); the adapter does not do the same work")
    return err


def bench_one(label: str, shape, dtype, args) -> dict:
    T, K, D, F = shape["T"], shape["K"], shape["D"], shape["F"]
    useful = 3 * T * K * 2 * D * F * 3
    dense_step = dense_gemm_step(shape, dtype)
    peak_step, peak_flops = peak_gemm_step(dtype)

    ours = build_epscale(shape, dtype)
    impls: list[Impl] = [ours]
    skipped: dict[str, str] = {}
    wanted = set(args.impls.split(","))
    if "rows" in wanted:
        impls.append(build_epscale(shape, dtype, fuse=False))
    if "grouped" in wanted:
        impls.append(build_epscale(shape, dtype, gemm="grouped"))
    if "eager" in wanted:
        impls.append(build_epscale(shape, dtype, kernels="off"))
    if wanted & {"inductor", "compiled"}:
        impls.append(build_epscale(shape, dtype, kernels="inductor"))
    if "noworkspace" in wanted:
        impls.append(build_epscale(shape, dtype, workspace=False))
    if "serial" in wanted:
        impls.append(build_epscale(shape, dtype, workers=1))
    if "grouped_mm" in wanted:
        impls.append(build_epscale(shape, dtype, impl="grouped_mm"))
    for key, build in (("torchtitan", lambda: build_torchtitan(ours.module, shape, dtype)),
                       ("mixtral", lambda: build_mixtral(ours.module, shape, dtype, None)),
                       ("mixtral-grouped", lambda: build_mixtral(ours.module, shape, dtype,
                                                                 "grouped_mm"))):
        if key in wanted:
            got = build()
            if isinstance(got, str):
                skipped[key] = got
            else:
                impls.append(got)

    g = torch.Generator().manual_seed(1)
    x_TD = torch.randn(T, D, generator=g).to(DEVICE, dtype).requires_grad_(True)
    gy_TD = torch.randn(T, D, generator=g).to(DEVICE, dtype)
    with torch.no_grad():
        ref = ours.run(x_TD)
    near_tie_T = near_ties(ours.module, x_TD)
    diffs = {}
    for impl in impls[1:]:
        try:
            with torch.no_grad():
                lowp = dtype != torch.float32 or "bf16" in impl.note
                diffs[impl.name] = check_same_work(ref, impl.run(x_TD), impl.name, lowp,
                                                   near_tie_T)
        except SystemExit:
            raise
        except Exception as e:  # noqa: BLE001 - an implementation that cannot run here
            skipped[impl.name] = f"failed to run: {type(e).__name__}: {e}"
    impls = [i for i in impls if i.name not in skipped]

    steps = {i.name: make_step(i, x_TD, gy_TD) for i in impls}
    # The dense references are timed inside the same rounds, so that a busy moment on a
    # shared machine does not make them look slow (which would flatter the efficiency).
    steps["_dense"], steps["_peak"] = dense_step, peak_step
    best = {name: float("inf") for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            best[name] = min(best[name], best_time(step, args.reps))
    dense_rate = useful / best["_dense"]
    peak_rate = peak_flops / best["_peak"]
    rows = []
    for i in impls:
        t = best[i.name]
        rows.append(dict(impl=i.name, step_ms=1e3 * t, tokens_per_s=T / t,
                         useful_gflops=useful / t / 1e9, efficiency=(useful / t) / dense_rate,
                         eff_vs_peak=(useful / t) / peak_rate,
                         peak_mb=peak_step_memory(steps[i.name], i.module, x_TD) / 2 ** 20,
                         rel_diff=diffs.get(i.name, 0.0), note=i.note))
    return dict(config=label, dtype=str(dtype).replace("torch.", ""), shape=shape,
                dense_gflops=dense_rate / 1e9, peak_gflops=peak_rate / 1e9, results=rows,
                skipped=skipped)


def print_table(res: dict) -> None:
    s = res["shape"]
    print(f"\n== {res['config']}  E={s['E']} K={s['K']} D={s['D']} F={s['F']} T={s['T']}  "
          f"{res['dtype']}  dense {res['dense_gflops']:.0f} GF/s  peak {res['peak_gflops']:.0f} GF/s")
    ref = {r["impl"]: r for r in res["results"]}
    tt = ref.get("torchtitan MoE")
    print(f"{'implementation':38s} {'ms/step':>8s} {'tokens/s':>9s} {'GF/s':>6s} {'eff':>5s} "
          f"{'vs peak':>7s} {'peak MB':>8s} {'x titan':>7s}")
    for r in res["results"]:
        ratio = f"{r['tokens_per_s'] / tt['tokens_per_s']:.2f}" if tt else "n/a"
        print(f"{r['impl']:38s} {r['step_ms']:8.1f} {r['tokens_per_s']:9.0f} "
              f"{r['useful_gflops']:6.0f} {r['efficiency']:5.2f} {r['eff_vs_peak']:7.2f} "
              f"{r['peak_mb']:8.0f} {ratio:>7s}" + (f"  ({r['note']})" if r["note"] else ""))
    for name, why in res["skipped"].items():
        print(f"{name:38s} unavailable: {why}")


def parse_device(p: argparse.ArgumentParser, name: str) -> torch.device:
    """--device as a torch device (cpu or an available cuda), or a usage error."""
    try:
        dev = torch.device(name)
    except RuntimeError:
        p.error(f"--device {name}: not a device name (cpu, cuda, cuda:1, ...)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {name}: torch sees no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        p.error(f"--device {name}: only cpu and cuda are supported")
    return dev


def parse_shapes(p: argparse.ArgumentParser, configs: str,
                 shape: str | None) -> list[tuple[str, dict]]:
    """(label, shape) pairs from --configs (names in CONFIGS) or --shape E,K,D,F,T."""
    if shape:
        try:
            E, K, D, F, T = (int(v) for v in shape.split(","))
        except ValueError:
            p.error(f"--shape {shape}: expected five integers E,K,D,F,T")
        return [("custom", dict(E=E, K=K, D=D, F=F, T=T))]
    unknown = [c for c in configs.split(",") if c not in CONFIGS]
    if unknown:
        p.error(f"unknown config {unknown[0]!r}; known: {', '.join(CONFIGS)}")
    return [(c, CONFIGS[c]) for c in configs.split(",")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="coarse,fine", help="comma list of: " + ", ".join(CONFIGS))
    p.add_argument("--shape", default=None, help="custom E,K,D,F,T instead of --configs")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--impls", default="rows,grouped,torchtitan,mixtral,mixtral-grouped",
                   help="others beside epscale: rows, grouped (moe.cpu.gemm=grouped), eager "
                        "(moe.cpu.elementwise=off), inductor (moe.cpu.elementwise=inductor; "
                        "'compiled' is its old name), noworkspace (moe.cpu.keep_buffers=false), "
                        "serial (one chunk at a time, each op over all threads: "
                        "moe.cpu.chunk_workers=1), grouped_mm (moe.experts_impl=grouped_mm), "
                        "torchtitan, mixtral, mixtral-grouped")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over implementations")
    p.add_argument("--reps", type=int, default=2, help="timed steps per implementation per round")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: elapsed time (default). cpu: process CPU time, which other "
                        "processes on a shared machine do not inflate; only meaningful with "
                        "--threads 1 (idle OpenMP threads spin and count)")
    p.add_argument("--device", default="cpu",
                   help="cpu (default) or cuda[:N]: where the layers and the dense references run")
    p.add_argument("--json", default=None, help="write the headline figures to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    global DEVICE
    DEVICE = parse_device(p, args.device)
    if DEVICE.type == "cuda" and args.clock == "cpu":
        p.error("--clock cpu measures host CPU time; use the wall clock with --device cuda")
    if args.clock == "cpu":
        global CLOCK
        if torch.get_num_threads() != 1:
            p.error("--clock cpu needs --threads 1")
        CLOCK = time.process_time
    todo = parse_shapes(p, args.configs, args.shape)
    where = (f"{torch.cuda.get_device_name(DEVICE)}" if DEVICE.type == "cuda"
             else f"{platform.processor() or platform.machine()}")
    print(f"torch {torch.__version__}, {DEVICE}, {torch.get_num_threads()} threads, {args.clock} "
          f"clock, {where}, python {platform.python_version()}")
    results = []
    for label, shape in todo:
        for dt in args.dtypes.split(","):
            res = bench_one(label, shape, getattr(torch, dt), args)
            print_table(res)
            results.append(res)
            sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(benchmark="moe_layer", torch=torch.__version__, device=str(DEVICE),
                           threads=torch.get_num_threads(), clock=args.clock,
                           command=" ".join(sys.argv),
                           results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
