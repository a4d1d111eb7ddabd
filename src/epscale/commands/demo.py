"""``epscale demo``: route one batch through an MoE layer, show where tokens went and how
fast the layer ran."""

from __future__ import annotations

import time

import torch
from rich.console import Console
from rich.table import Table

from ..config import MoEConfig, apply_overrides, from_dict, to_dict
from ..kernels.cpu import describe_chunks, describe_elementwise
from ..moe.layer import MoE
from ..moe.router import expert_capacity


def configure_parser(p) -> None:
    p.add_argument("--tokens", type=int, default=4096, help="tokens in the batch (default 4096)")
    p.add_argument("--iters", type=int, default=5, help="timed forward+backward passes")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="MoEConfig fields, e.g. num_experts=16 top_k=2 capacity_factor=1.0")


def run(args) -> int:
    console = Console()
    base = dict(dim=512, hidden_dim=1024, num_experts=8, top_k=2, capacity_factor=1.25,
                aux_loss_coeff=0.01)
    cfg = from_dict(MoEConfig, apply_overrides(base, args.overrides), prefix="moe")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    moe = MoE(cfg).to(dtype)
    x = torch.randn(args.tokens, cfg.dim, dtype=dtype, requires_grad=True)
    console.print(f"[bold]MoE layer[/] {to_dict(cfg)}")
    y = moe(x)
    y.float().square().mean().add(moe.aux_loss).backward()  # warm-up
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        y = moe(x)
        (y.float().square().mean() + moe.aux_loss).backward()
        times.append(time.perf_counter() - t0)
    stats = moe.last_stats
    counts = stats["tokens_per_expert"].tolist()
    cap = None
    if cfg.capacity_factor is not None:
        cap = expert_capacity(args.tokens, cfg.top_k, cfg.num_experts, cfg.capacity_factor)
    table = Table(title=f"Tokens per expert ({args.tokens} tokens, top-{cfg.top_k})")
    table.add_column("expert", justify="right")
    table.add_column("routed", justify="right")
    table.add_column("kept", justify="right")
    table.add_column("dropped", justify="right")
    table.add_column("share", justify="left")
    mean = sum(counts) / len(counts)
    for e, n in enumerate(counts):
        kept = min(n, cap) if cap is not None else n
        bar = "█" * max(1, round(20 * n / max(counts)))
        table.add_row(str(e), str(n), str(kept), str(n - kept), bar)
    console.print(table)
    best = min(times)
    dropped = int(stats["num_dropped"])
    console.print(f"dropped assignments: {dropped} of {args.tokens * cfg.top_k} "
                  f"({100 * dropped / (args.tokens * cfg.top_k):.2f}%)  "
                  f"MaxVio: {(max(counts) - mean) / mean:.3f}  "
                  f"router entropy: {float(stats['router_entropy']):.3f} nats")
    console.print(f"forward+backward: {best * 1e3:.1f} ms best of {args.iters} -> "
                  f"[bold]{args.tokens / best:,.0f} tokens/s[/] ({args.dtype}, "
                  f"{torch.get_num_threads()} threads)")
    console.print(f"element-wise expert kernels: {describe_elementwise(cfg.cpu.elementwise, 'cpu')}")
    console.print(f"expert chunks: {describe_chunks('cpu')}")
    return 0
