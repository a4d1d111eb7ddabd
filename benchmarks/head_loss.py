"""The fused, chunked output head + cross-entropy (``epscale.head_loss``) against the plain
``F.cross_entropy(F.linear(h, W).float(), y)``, forward + backward, side by side in one run
on this machine's CPU (or ``--device cuda``), fp32 and bf16 autocast: milliseconds per
call and the ratio. The fused path recomputes the logits in backward (one GEMM more of
three) and adds each chunk's product into an fp32 weight gradient.

    python benchmarks/head_loss.py [--tokens 2048] [--dim 512] [--vocab 32000]
                                   [--chunk-rows N] [--repeats 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from epscale.head_loss import head_loss  # noqa: E402


def _time(fn, repeats: int, device: torch.device) -> float:
    fn()                                     # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--chunk-rows", type=int, default=None,
                    help="rows per chunk (default: epscale.plan.memory.head_chunk_rows)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}, "
          f"torch {torch.__version__}; T={args.tokens} D={args.dim} V={args.vocab}")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(args.tokens, args.dim, generator=g).to(device).requires_grad_(True)
    w = torch.randn(args.vocab, args.dim, generator=g).to(device).requires_grad_(True)
    y = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    for autocast in (False, True):
        def run(fused: bool):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = (head_loss(h, w, y, chunk_rows=args.chunk_rows) if fused
                        else F.cross_entropy(F.linear(h, w).float(), y))
            loss.backward()
        fused = _time(lambda: run(True), args.repeats, device)
        plain = _time(lambda: run(False), args.repeats, device)
        print(f"{'bf16 autocast' if autocast else 'fp32':>13}: fused {fused * 1e3:8.1f} ms, "
              f"plain {plain * 1e3:8.1f} ms, fused / plain {fused / plain:.2f}")


if __name__ == "__main__":
    main()
