"""Trainer throughput: the default recipe and a larger one, each next to the same model
with a dense FFN of equal active parameters, and the share of step time spent in
dispatch/combine, all measured in one run (side by side, same machine, same moment).

    python benchmarks/train.py [--steps 12] [--nproc 2] [--only tiny] [--keep DIR]
    python benchmarks/train.py --compile [--steps 12]

Every configuration runs through ``epscale train --nproc N`` (torchrun, gloo on CPU, NCCL
on CUDA) on the stdlib text; tokens/s and the breakdown are medians over the steps after
the first third (warm-up) read back from each run's metrics.jsonl. The dense twin replaces
every MoE layer by a dense FFN of hidden width top_k x expert hidden (the same active
parameters per token, up to the router) and runs data-parallel on the same processes.

Judged by: MoE tokens/s / dense tokens/s (how close sparse training gets to the dense
model it costs the same FLOPs as) and the dispatch+combine share of the step.

``--compile``: eager against ``train.compile=true`` (bf16) on the default recipe, one
process at ep=1 and two at ep=2: steady tokens/s side by side, their ratio, and the first
(compiling) step's time.

``--layouts``: the same model at the data-parallel layouts of issue #19 on --nproc
processes (default 4) at the same global batch: replicated dp x ep, FSDP, HSDP, FSDP with
full recomputation; tokens/s against replicated, the step time FSDP adds (its
all-gathers and reduce-scatters less the all-reduce it replaces, with prefetch), and the
bytes of weights, gradients and AdamW state per rank (the estimate, which
benchmarks/memory.py finds exact).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]

# name -> overrides on top of configs/tiny.yaml
RECIPES = {
    "tiny": [],
    "larger": ["model.dim=384", "model.num_layers=6", "model.num_heads=6",
               "moe.hidden_dim=768", "moe.num_experts=16", "train.micro_batch_size=2"],
}


def dense_twin(over: list[str], cfg) -> list[str]:
    """Same model, every layer a dense FFN of top_k x expert hidden width."""
    return over + [f"model.num_dense_layers={cfg.model.num_layers}",
                   f"model.dense_hidden_dim={cfg.moe.top_k * cfg.moe.hidden_dim}",
                   "parallel.ep=1"]


def run_one(run_dir: Path, nproc: int, steps: int, over: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "epscale", "train", "--config", str(REPO / "configs" / "tiny.yaml"),
           "--nproc", str(nproc), "--run-dir", str(run_dir), f"train.steps={steps}",
           "train.eval_every=0", "train.ckpt_every=0", "train.warmup_steps=2", *over]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if proc.returncode != 0:
        raise SystemExit(f"run failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "event" not in r]


def summarize(recs: list[dict]) -> dict:
    steady = recs[len(recs) // 3:]
    med = lambda f: statistics.median(f(r) for r in steady)  # noqa: E731
    return {
        "tokens_per_s": med(lambda r: r["tokens_per_s"]),
        "tokens_per_s_per_proc": med(lambda r: r["tokens_per_s_per_proc"]),
        "step_ms": 1e3 * med(lambda r: r["step_time_s"]),
        # (0 under train.compile: a compiled block times no sections of its own)
        "dispatch_combine": med(lambda r: (r["time_breakdown"].get("dispatch", 0.0)
                                           + r["time_breakdown"].get("combine", 0.0))
                                / r["step_time_s"]),
        "comm": med(lambda r: r["comm_share"]),
        "mfu": med(lambda r: r["mfu"]),
        "loss": recs[-1]["loss"],
    }


LAYOUTS = {  # name -> overrides; ep=2 and 2 sequences per rank everywhere
    "replicated dp x ep=2": ["parallel.fsdp=false"],
    "FSDP, ep=2": ["parallel.fsdp=true", "parallel.dp=1"],
    "HSDP 2 x N/2, ep=2": ["parallel.fsdp=true", "parallel.dp=1", "parallel.dp_replicate=2"],
    "FSDP, ep=2, full recompute": ["parallel.fsdp=true", "parallel.dp=1",
                                   "train.activation_checkpointing=full"],
}


def run_layouts(args, console) -> dict:
    from epscale.config import load_config
    from epscale.plan.memory import memory_per_rank

    n = args.nproc
    base = RECIPES["larger"] + ["parallel.ep=2", f"parallel.dp={n // 2}", "train.micro_batch_size=2"]
    base_dir = args.keep or Path(tempfile.mkdtemp(prefix="epscale-bench-layouts-"))
    table = Table(title=f"Data-parallel layouts, {n} processes, {args.steps} steps each, the same "
                        "global batch (medians after warm-up)")
    for col in ("layout", "tokens/s", "vs replicated", "ms/step", "added ms/step",
                "weights+grads+AdamW / rank", "final loss"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    figures, ref = {}, None
    for name, over in LAYOUTS.items():
        o = base + over
        cfg = load_config(REPO / "configs" / "tiny.yaml", o)
        mem = memory_per_rank(cfg, world=n, ep=2)
        s = summarize(run_one(base_dir / name.replace(" ", "_").replace(",", ""), n, args.steps, o))
        ref = ref or s
        state = mem.params + mem.grads + mem.optimizer
        figures[name] = {**s, "state_bytes_per_rank": state}
        table.add_row(name, f"{s['tokens_per_s']:,.0f}", f"{s['tokens_per_s'] / ref['tokens_per_s']:.2f}",
                      f"{s['step_ms']:.0f}", f"{s['step_ms'] - ref['step_ms']:+.0f}",
                      f"{state / 2 ** 20:.1f} MiB", f"{s['loss']:.4f}")
    console.print(table)
    console.print(f"run directories: {base_dir}")
    return figures


COMPILE_LAYOUTS = {  # name -> (processes, overrides); bf16: the compiled grouped GEMM takes it
    "1 process, ep=1": (1, ["parallel.ep=1"]),
    "2 processes, ep=2": (2, ["parallel.ep=2"]),
}


def run_compile(args, console) -> dict:
    """Eager against ``train.compile=true`` on the default recipe in bf16, per layout: the
    steady tokens/s (medians after the first third), their ratio, and the first step's
    time (the compiled run traces and compiles there)."""
    base_dir = args.keep or Path(tempfile.mkdtemp(prefix="epscale-bench-compile-"))
    table = Table(title=f"train.compile, tiny recipe in bf16, {args.steps} steps each "
                        "(medians after warm-up)")
    for col in ("layout", "mode", "tokens/s", "ms/step", "first step s", "compiled/eager",
                "final loss"):
        table.add_column(col, justify="left" if col in ("layout", "mode") else "right")
    figures = {}
    for name, (nproc, over) in COMPILE_LAYOUTS.items():
        runs = {}
        for mode in ("eager", "compiled"):
            o = over + ["train.dtype=bfloat16", f"train.compile={mode == 'compiled'}"]
            recs = run_one(base_dir / f"{name.split(',')[0].replace(' ', '')}-{mode}", nproc,
                           args.steps, o)
            runs[mode] = {**summarize(recs), "first_step_s": recs[0]["step_time_s"]}
        ratio = runs["compiled"]["tokens_per_s"] / runs["eager"]["tokens_per_s"]
        figures[name] = {**runs, "compiled_over_eager_tokens_per_s": ratio}
        for mode, s in runs.items():
            table.add_row(name, mode, f"{s['tokens_per_s']:,.0f}", f"{s['step_ms']:.0f}",
                          f"{s['first_step_s']:.1f}", f"{ratio:.2f}" if mode == "compiled" else "",
                          f"{s['loss']:.4f}")
    console.print(table)
    console.print(f"run directories: {base_dir}")
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--only", choices=sorted(RECIPES), action="append")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    ap.add_argument("--json", type=Path, default=None, help="write the headline figures here")
    ap.add_argument("--layouts", action="store_true",
                    help="replicated vs FSDP vs HSDP vs FSDP+recompute (default --nproc 4)")
    ap.add_argument("--compile", action="store_true",
                    help="eager vs train.compile=true (bf16; 1 process at ep=1 and 2 at ep=2)")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    if args.compile:
        figures = run_compile(args, Console(width=160))
        if args.json:
            args.json.write_text(json.dumps({"benchmark": "train --compile", "steps": args.steps,
                                             "results": figures}, indent=1))
        return
    if args.layouts:
        args.nproc = args.nproc if "--nproc" in sys.argv else 4
        figures = run_layouts(args, Console(width=160))
        if args.json:
            args.json.write_text(json.dumps({"benchmark": "train --layouts", "nproc": args.nproc,
                                             "steps": args.steps, "results": figures}, indent=1))
        return
    from epscale.config import load_config
    from epscale.plan.sizing import model_size

    console = Console(width=160)
    base_dir = args.keep or Path(tempfile.mkdtemp(prefix="epscale-bench-train-"))
    table = Table(title=f"Training throughput, {args.nproc} processes, {args.steps} steps each "
                        f"(medians after warm-up)")
    for col in ("recipe", "FFN", "params", "active", "tokens/s", "tok/s/proc", "ms/step",
                "dispatch+combine", "all comm", "MFU", "MoE/dense"):
        table.add_column(col, justify="right" if col not in ("recipe", "FFN") else "left")
    ratios, figures = {}, {}
    for name in args.only or list(RECIPES):
        over = RECIPES[name] + [f"parallel.ep={args.nproc}"]
        cfg = load_config(REPO / "configs" / "tiny.yaml", over)
        results = {}
        for kind, o in (("MoE", over), ("dense", dense_twin(over, cfg))):
            c = load_config(REPO / "configs" / "tiny.yaml", o)
            size = model_size(c)
            recs = run_one(base_dir / f"{name}-{kind}", args.nproc, args.steps, o)
            results[kind] = (size, summarize(recs))
        ratio = results["MoE"][1]["tokens_per_s"] / results["dense"][1]["tokens_per_s"]
        ratios[name] = ratio
        figures[name] = {kind: {"total_params": size.total_params,
                                "active_params": size.active_params, **s}
                         for kind, (size, s) in results.items()}
        figures[name]["moe_over_dense_tokens_per_s"] = ratio
        for kind in ("MoE", "dense"):
            size, s = results[kind]
            table.add_row(name, kind, f"{size.total_params / 1e6:.1f}M", f"{size.active_params / 1e6:.1f}M",
                          f"{s['tokens_per_s']:,.0f}", f"{s['tokens_per_s_per_proc']:,.0f}",
                          f"{s['step_ms']:.0f}", f"{100 * s['dispatch_combine']:.1f}%",
                          f"{100 * s['comm']:.1f}%", f"{100 * s['mfu']:.2f}%",
                          f"{ratio:.2f}" if kind == "MoE" else "")
    console.print(table)
    for name, r in ratios.items():
        console.print(f"{name}: MoE tokens/s / dense tokens/s at equal active params = {r:.2f}")
    console.print(f"run directories: {base_dir}")
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "train", "nproc": args.nproc,
                                         "steps": args.steps, "results": figures}, indent=1))
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
