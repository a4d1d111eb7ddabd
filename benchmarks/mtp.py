"""Multi-token prediction's cost on this machine's CPU, side by side in one run: one process,
the tiny recipe's model (configs/tiny.yaml: 4 MoE layers, dim 256, seq 128, vocab 256)
at ``model.mtp_depth`` 0 and D (same seed), forward + backward + AdamW step, the two
models timed in alternation (so a load change hits both): milliseconds per step and the
ratio; and the bytes a forward keeps for backward, measured (torch's profiler, as
tests/test_memory.py) next to the memory model's estimate.

    python benchmarks/mtp.py [--depth 1] [--steps 10] [--micro-batch 8] [--threads 1] [k=v ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from epscale.config import load_config  # noqa: E402
from epscale.metrics.held import median_kept_bytes  # noqa: E402
from epscale.model import build_model  # noqa: E402
from epscale.moe.layer import moe_layers  # noqa: E402
from epscale.plan.layout import Layout  # noqa: E402
from epscale.plan.memory import Activations, estimate  # noqa: E402
from epscale.plan.sizing import model_size  # noqa: E402


def _setup(depth: int, args) -> tuple:
    cfg = load_config(ROOT / "configs" / "tiny.yaml",
                      [f"model.mtp_depth={depth}", f"train.micro_batch_size={args.micro_batch}",
                       "parallel.ep=1", *args.overrides])
    torch.manual_seed(0)
    net = build_model(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    B, S, V = cfg.train.micro_batch_size, cfg.model.seq_len, cfg.model.vocab_size
    x, y = torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)

    def forward():
        return net.loss(x, y) + cfg.train.mtp_loss_weight * net.mtp_loss() + net.aux_loss()

    def step():
        forward().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return cfg, net, forward, step


def _kept(cfg, net, forward) -> tuple[int, float]:
    for moe in moe_layers(net):
        moe.drop_kept_buffers()
    forward().backward()
    net.zero_grad(set_to_none=True)
    kept = median_kept_bytes(forward, net)
    impl = "cpu_fused" if cfg.moe.experts_impl in ("auto", "cpu_fused") else "grouped_mm"
    est = estimate(cfg, Layout.from_config(cfg, 1, ep=1),
                   Activations("none", "float32", impl, norm_kernel="composite"))   # CPU RMSNorm
    return kept, est.activations


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: as the demo's processes; on a shared 2-core "
                         "machine 2 threads swung the ratio from 0.3x to 3x run to run)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of configs/tiny.yaml")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {os.cpu_count()} "
          f"cores, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}, "
          f"torch {torch.__version__}")
    runs = {d: _setup(d, args) for d in (0, args.depth)}
    for d, (cfg, net, forward, _step) in runs.items():
        size = model_size(cfg)
        kept, est = _kept(cfg, net, forward)
        print(f"mtp_depth {d}: {size.total_params / 1e6:.2f}M parameters "
              f"({size.mtp_params / 1e6:.2f}M in the MTP modules), "
              f"{size.flops_per_token / 1e6:.1f} MFLOPs/token; kept for backward "
              f"{kept / 2**20:.2f} MiB measured, {est / 2**20:.2f} MiB estimated "
              f"({est / kept - 1:+.1%})")
    for _d, (_c, _n, _f, step) in runs.items():
        step()                                           # warm-up
    times = {d: [] for d in runs}
    for _ in range(args.steps):
        for d, (_c, _n, _f, step) in runs.items():
            t0 = time.perf_counter()
            step()
            times[d].append(time.perf_counter() - t0)
    med = {d: sorted(t)[len(t) // 2] * 1e3 for d, t in times.items()}
    print(f"ms per step (median of {args.steps}, alternating): depth 0 {med[0]:.1f}, "
          f"depth {args.depth} {med[args.depth]:.1f}: {med[args.depth] / med[0]:.3f}x; "
          f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
