"""AdamW's step with its moments in fp32 (torch's AdamW) and in bf16 (epscale's
``train.optimizer_state_dtype: bfloat16``: torch's update on the moments upcast chunk by
chunk, rounded back), side by side on the same parameters and gradients: the step time of
each, their ratio, and the state bytes. On CUDA both take the fused kernel
(``epscale.training.optim.adamw_kernel``); on the CPU torch's default (foreach).

    python benchmarks/optim_state.py [--params 64e6] [--tensors 64] [--steps 10] [--device cpu]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _time_steps(opt, params, steps: int, sync) -> float:
    """Median seconds of one step (after one warm-up step that creates the state)."""
    for p in params:
        p.grad = p.detach().mul(1e-3).add_(1e-4)
    opt.step()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=64e6, help="parameters in all (default 64e6)")
    ap.add_argument("--tensors", type=int, default=64, help="split into this many tensors")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    import torch

    from epscale.training.optim import AdamW, adamw_kernel
    from epscale.metrics.held import state_bytes
    sys.path.insert(0, str(REPO / "benchmarks"))
    from simulate import machine

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n = int(args.params) // args.tensors
    print(f"machine: {machine()}, {torch.get_num_threads()} threads")
    print(f"{args.tensors} tensors x {n:,} = {n * args.tensors / 1e6:.0f}M fp32 parameters on "
          f"{device}; kernel {adamw_kernel(device) or 'torch default (foreach)'}")
    out = {}
    for name, dtype in (("fp32 moments (torch AdamW)", torch.float32),
                        ("bf16 moments (epscale AdamW)", torch.bfloat16)):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, device=device)) for _ in range(args.tensors)]
        opt = AdamW(params, state_dtype=dtype, lr=1e-3, weight_decay=0.1, **adamw_kernel(device))
        secs = _time_steps(opt, params, args.steps, sync)
        module = torch.nn.ParameterList(params)
        held = state_bytes(module, opt)["optimizer"]
        out[name] = secs
        print(f"{name:30s} step {secs * 1e3:8.1f} ms   moments {held / 2 ** 20:8.1f} MiB")
        del opt, params, module
    a, b = out.values()
    print(f"bf16 / fp32 step time: {b / a:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
