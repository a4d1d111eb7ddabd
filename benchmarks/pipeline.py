"""Pipeline parallelism: the measured bubble of each schedule next to its formula, and the
throughput of pp=2 x ep=2 against ep=4 and FSDP dp_shard=4 x ep=2 at the same global
batch, all in one run (side by side, same machine, same moment).

    python benchmarks/pipeline.py [--steps 8] [--only bubble|layouts] [--json OUT]

Bubble: 2 processes (1 torch thread each, one per core), pp=2 with one rank per stage,
every schedule at m = 4 and 8 micro-batches per step, through the real trainer. Each rank
times its schedule run (forward and backward of the step's micro-batches) and, inside it,
the time it is blocked in the schedule's point-to-point waits
(``torch.distributed.pipelining.schedules._wait_batch_p2p``, timed by wrapping it; it
includes the transfers, which are small next to the compute here). The ranks start a
step's schedule together (the previous step ends in collectives), so the pipeline's span
is the longest rank's schedule time and a rank's busy time is its own less its waits:
measured bubble = 1 - busy / span, the mean over ranks and over the steps after warm-up
(a rank that finishes early idles until the slowest is done, in the step's next
collective: counted). The formula column is
``epscale.plan.pipeline.bubble_fraction`` (equal stages, and for the zero-bubble
schedules equal forward, input-backward and weight-backward times, which real blocks do
not have).

Layouts: ``epscale train --nproc 4`` of the same model and global batch at pp=2 x ep=2
(1F1B, and interleaved 1F1B with 2 stages per rank), ep=4 (replicated, dp=1) and FSDP
dp_shard=4 x ep=2; tokens/s (medians after warm-up) and each against ep=4. Four
processes share two cores here, so this compares what each layout costs in CPU work and
waits, not what it would gain on GPUs with fast links.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import REPO, run_one, summarize  # noqa: E402  (benchmarks/train.py)

MODEL = ["model.dim=256", "model.num_layers=8", "model.num_heads=4", "model.seq_len=128",
         "moe.hidden_dim=512", "moe.num_experts=8", "model.tie_embeddings=false",
         "train.warmup_steps=2", "train.eval_every=0", "train.ckpt_every=0",
         "train.collective_timeout_s=0", "train.preflight=false", "train.micro_batch_size=2"]
SCHEDULES = {"gpipe": [], "1f1b": [], "interleaved_1f1b": ["parallel.pp_virtual_stages=2"],
             "zero_bubble": ["parallel.pp_virtual_stages=2"], "zbv": [], "dualpipev": []}
LAYOUTS = {  # name -> overrides; 4 processes, 16 sequences per step
    "ep=4 (dp=1)": ["parallel.ep=4", "train.grad_accum=2"],
    "FSDP dp_shard=4 x ep=2": ["parallel.fsdp=true", "parallel.ep=2", "train.grad_accum=2"],
    "pp=2 x ep=2, 1f1b": ["parallel.pp=2", "parallel.ep=2", "train.grad_accum=4"],
    "pp=2 x ep=2, interleaved_1f1b v=2": ["parallel.pp=2", "parallel.ep=2", "train.grad_accum=4",
                                          "parallel.pp_schedule=interleaved_1f1b",
                                          "parallel.pp_virtual_stages=2"],
}


def _bubble_worker(rank, nproc, overrides, run_dir):
    """One pipeline rank: train, recording the time blocked in p2p waits per step."""
    import torch.distributed.pipelining.schedules as sched

    from epscale.config import load_config
    from epscale.training.dist import LaunchEnv
    from epscale.training.loop import Trainer

    waits = [0.0]
    inner = sched._wait_batch_p2p

    def timed_wait(work):
        t0 = time.perf_counter()
        try:
            return inner(work)
        finally:
            waits[-1] += time.perf_counter() - t0

    sched._wait_batch_p2p = timed_wait
    cfg = load_config(REPO / "configs" / "tiny.yaml", overrides)
    t = Trainer(cfg, run_dir, LaunchEnv("torchrun", world_size=nproc), checked=True)
    out = []  # per step: (schedule seconds, of which blocked in p2p waits)
    try:
        t.setup()
        run_schedule = t.pipeline.train_step

        def timed_schedule(x, y):
            waits[-1] = 0.0
            t0 = time.perf_counter()
            try:
                return run_schedule(x, y)
            finally:
                out.append((time.perf_counter() - t0, waits[-1]))

        t.pipeline.train_step = timed_schedule
        while t.step < cfg.train.steps:
            t.train_step()
    finally:
        t.close(True)
        sched._wait_batch_p2p = inner
    return out


def run_bubbles(args, console) -> dict:
    from epscale.tune.calibrate import spawn_local
    from epscale.plan.pipeline import bubble_fraction

    table = Table(title=f"Pipeline bubble, pp=2 (2 processes, 1 thread each), {args.steps} steps "
                        "(after 1/3 warm-up)")
    for col in ("schedule", "micro-batches", "measured bubble", "formula", "schedule ms"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    figures = {}
    base = Path(tempfile.mkdtemp(prefix="epscale-bench-pp-"))
    for m in (4, 8):
        for name, extra in SCHEDULES.items():
            over = MODEL + ["parallel.pp=2", "parallel.ep=1", f"parallel.pp_schedule={name}",
                            f"train.grad_accum={m}", f"train.steps={args.steps}", *extra]
            ranks = spawn_local(_bubble_worker, 2, args=(over, str(base / f"{name}_{m}")),
                                threads=1)
            keep = args.steps // 3
            spans = [max(r[i][0] for r in ranks) for i in range(keep, args.steps)]
            idle = statistics.mean(1 - (r[i][0] - r[i][1]) / span for span, i in
                                   zip(spans, range(keep, args.steps)) for r in ranks)
            step = statistics.median(spans)
            v = 2 if extra else 1
            formula = bubble_fraction(name, 2, m, v)
            figures[f"{name} m={m}"] = {"measured": idle, "formula": formula, "step_s": step}
            table.add_row(name, str(m), f"{idle:.1%}", f"{formula:.1%}", f"{1e3 * step:.0f}")
    console.print(table)
    return figures


def run_layouts(args, console) -> dict:
    table = Table(title=f"Layouts on 4 processes (2 cores), the same model and global batch "
                        f"(16 sequences), {args.steps} steps each (medians after warm-up)")
    for col in ("layout", "tokens/s", "vs ep=4", "ms/step", "final loss"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    base = Path(tempfile.mkdtemp(prefix="epscale-bench-pp-layouts-"))
    figures, ref = {}, None
    for name, over in LAYOUTS.items():
        run_dir = base / name.replace(" ", "_").replace(",", "").replace("=", "")
        s = summarize(run_one(run_dir, 4, args.steps, MODEL + over))
        ref = ref or s
        figures[name] = s
        table.add_row(name, f"{s['tokens_per_s']:,.0f}",
                      f"{s['tokens_per_s'] / ref['tokens_per_s']:.2f}", f"{s['step_ms']:.0f}",
                      f"{s['loss']:.4f}")
    console.print(table)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--only", choices=("bubble", "layouts"))
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    console = Console(width=140)
    figures = {}
    if args.only in (None, "bubble"):
        figures["bubble"] = run_bubbles(args, console)
    if args.only in (None, "layouts"):
        figures["layouts"] = run_layouts(args, console)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
