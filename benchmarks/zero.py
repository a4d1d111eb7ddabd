"""ZeRO levels (``parallel.zero``) side by side: the same model and global batch trained
at ZeRO-3 (FSDP regathering each block's weights twice per micro-batch), ZeRO-2 and
ZeRO-1 (weights gathered once per step and kept; ZeRO-1 also reduce-scatters the
gradients once per step instead of once per micro-batch), under a pipeline (pp=2 x FSDP
dp_shard=2, 1F1B) and without one (FSDP dp_shard=4 x ep=2), all in one run.

    python benchmarks/zero.py [--steps 8] [--rounds 2] [--json OUT]

``epscale train --nproc 4`` of ``configs/tiny.yaml`` at dim 256, 8 MoE layers, 4
micro-batches of 1 sequence per rank and step (16 sequences per step without a pipeline,
8 per stage rank pair under it), fp32 on CPU over gloo. The layouts run in turn, round
after round (so a drift of the shared machine touches all of them); tokens/s is the
median over the steps after warm-up of every round, and each level is set against
ZeRO-3 of the same layout. Beside it, the memory model's bytes per rank for the weights,
gradients, AdamW state and gathered weights (``epscale.plan.memory``). Four processes
share two cores here, so the ratio says what the regathering costs in CPU work and gloo
transfers, not what it would cost on GPUs with fast links.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import REPO, run_one  # noqa: E402  (benchmarks/train.py)

MODEL = ["model.dim=256", "model.num_layers=8", "model.num_heads=4", "model.seq_len=128",
         "moe.hidden_dim=512", "moe.num_experts=8", "model.tie_embeddings=false",
         "train.warmup_steps=2", "train.eval_every=0", "train.ckpt_every=0",
         "train.collective_timeout_s=0", "train.preflight=false", "train.micro_batch_size=1",
         "train.grad_accum=4", "parallel.fsdp=true", "parallel.dp=1"]
LAYOUTS = {  # name -> (overrides, the ZeRO levels it runs)
    "pp=2 x FSDP dp_shard=2, 1f1b": (["parallel.pp=2"], (3, 1)),
    "FSDP dp_shard=4 x ep=2": (["parallel.ep=2"], (3, 2, 1)),
}


def _memory(over: list[str]) -> dict[str, float]:
    from epscale.config import load_config
    from epscale.plan.memory import estimate, resolve

    cfg = load_config(REPO / "configs" / "tiny.yaml", over)
    mem = estimate(*resolve(cfg, world=4, compute_dtype="float32"))
    return {k: getattr(mem, k) for k in ("params", "grads", "optimizer", "unsharded")}


def run(args) -> dict:
    runs = [(name, zero, over + [f"parallel.zero={zero}"])
            for name, (over, levels) in LAYOUTS.items() for zero in levels]
    speeds: dict[tuple[str, int], list[float]] = {(n, z): [] for n, z, _ in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, zero, over in runs:
                run_dir = Path(tmp) / f"{r}-{name}-{zero}".replace(" ", "_").replace(",", "")
                recs = run_one(run_dir, 4, args.steps, MODEL + over)
                speeds[name, zero] += [x["tokens_per_s"] for x in recs[len(recs) // 3:]]
    out = {}
    for name, zero, over in runs:
        tps = statistics.median(speeds[name, zero])
        base = statistics.median(speeds[name, 3])
        out[f"{name}, ZeRO-{zero}"] = {"tokens_per_s": tps, "vs_zero3": tps / base,
                                       "memory": _memory(MODEL + over)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    figures = run(args)
    t = Table(title=f"ZeRO levels, 4 processes, {args.steps} steps x {args.rounds} rounds")
    for col in ("layout", "tokens/s", "vs ZeRO-3", "weights+grads+AdamW MiB",
                "gathered weights MiB"):
        t.add_column(col, justify="right")
    for name, f in figures.items():
        m = f["memory"]
        t.add_row(name, f"{f['tokens_per_s']:.0f}", f"{f['vs_zero3']:.2f}x",
                  f"{(m['params'] + m['grads'] + m['optimizer']) / 2 ** 20:.1f}",
                  f"{m['unsharded'] / 2 ** 20:.1f}")
    Console().print(t)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
