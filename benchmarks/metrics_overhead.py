"""What the step metrics cost: the same training steps with and without them, side by side.

"with": StepTimers sections around data/forward/backward/optimizer plus the model's own
attention/router/dispatch/experts/combine sections, the StepStatsCollector forward hooks
and its per-step record (pack, one all_reduce when distributed, one host copy), and a
JsonlSink line per step. "without": the timers disabled (shared no-op sections), no
hooks, no record, no sink. Steps alternate A/B/A/B on one model so drift and neighbours'
load hit both; the claim (issue #6) is that the metrics cost under 2% of step time.

    python benchmarks/metrics_overhead.py [--steps 40] [--config configs/tiny.yaml] [key=value ...]

Prints a table of median step times and the ratio with/without (and the per-step cost in
ms measured directly around the record + sink call).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from epscale.config import load_config  # noqa: E402
from epscale.metrics import JsonlSink, StepStatsCollector, StepTimers, flops_per_token  # noqa: E402
from epscale.model import build_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="timed steps per variant (default 40)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (CUDA-event timers)")
    ap.add_argument("--json", default=None, help="write the headline figures to this file")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    dev = torch.device(args.device)
    model = build_model(cfg, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    B, S = cfg.train.micro_batch_size, cfg.model.seq_len
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.model.vocab_size, (B, S + 1), generator=g).to(dev)
               for _ in range(8)]

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    on_timers, off_timers = StepTimers(dev), StepTimers(dev, enabled=False)
    collector = StepStatsCollector(model, ep=1, flops_per_token=flops_per_token(cfg))
    collector.close()  # hooks are attached only during "with" steps (below)
    tmp = tempfile.TemporaryDirectory()
    sink = JsonlSink(Path(tmp.name) / "metrics.jsonl")
    record_cost: list[float] = []

    def step(i: int, with_metrics: bool) -> tuple[float, float]:
        T = on_timers if with_metrics else off_timers
        model.set_timer(T.section)
        T.reset()
        x = batches[i % len(batches)]
        c0 = time.process_time()
        t0 = time.perf_counter()
        with T.section("data"):
            inp, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()
        with T.section("forward"):
            loss = model.loss(inp, tgt) + model.aux_loss()
        with T.section("backward"):
            loss.backward()
        with T.section("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync()
        if with_metrics:
            r0 = time.perf_counter()
            rec = collector.record(i, step_time_s=r0 - t0, num_tokens=B * S, loss=loss.detach(),
                                   lr=1e-3, grad_norm=1.0, breakdown=T.breakdown())
            sink.write(rec)
            record_cost.append(time.perf_counter() - r0)
        return time.perf_counter() - t0, time.process_time() - c0

    def attach(on: bool) -> None:
        collector.close()
        if on:
            collector._hooks = [m.register_forward_hook(collector.count_forward)
                                for _l, _n, m in collector.layers]

    for i in range(args.warmup):
        attach(True), step(i, True)
        attach(False), step(i, False)
    wall = {True: [], False: []}
    cpu = {True: [], False: []}
    pair_wall, pair_cpu = [], []
    for i in range(args.steps):
        order = (True, False) if i % 2 == 0 else (False, True)
        for on in order:
            attach(on)
            w, c = step(i, on)
            wall[on].append(w)
            cpu[on].append(c)
        pair_wall.append(wall[True][-1] / wall[False][-1])
        pair_cpu.append(cpu[True][-1] / cpu[False][-1])
    sink.close()
    tmp.cleanup()

    # ---- the fixed cost per step, component by component (tight loops: steady numbers)
    num_sections = len(on_timers._intervals)  # sections opened in the last "with" step
    reps = 20000
    probe = StepTimers(dev)
    c0 = time.perf_counter()
    for _ in range(reps):
        with probe.section("probe"):
            pass
    section_us = (time.perf_counter() - c0) / reps * 1e6
    probe.reset()
    attach(True)
    moe0 = collector.layers[0][2]
    hook = collector.count_forward
    c0 = time.perf_counter()
    for _ in range(2000):
        hook(moe0, (), None)
    sync()
    hook_us = (time.perf_counter() - c0) / 2000 * 1e6
    collector.reset()
    attach(False)
    fixed_ms = (num_sections * section_us + len(collector.layers) * hook_us) / 1e3 + \
        statistics.median(record_cost) * 1e3

    med = statistics.median
    rec_ms = med(record_cost) * 1e3
    print(f"metrics overhead: {cfg.name} recipe, {cfg.model.num_layers} layers "
          f"({len(collector.layers)} MoE x {cfg.moe.num_experts} experts), batch {B}x{S} tokens, "
          f"{torch.get_num_threads()} threads, {args.steps} interleaved step pairs")
    print(f"{'variant':<30}{'wall median (ms)':>18}{'CPU median (ms)':>17}")
    print(f"{'without metrics':<30}{med(wall[False]) * 1e3:>18.2f}{med(cpu[False]) * 1e3:>17.2f}")
    print(f"{'with timers + stats + jsonl':<30}{med(wall[True]) * 1e3:>18.2f}{med(cpu[True]) * 1e3:>17.2f}")
    print(f"record() + jsonl write alone: {rec_ms:.3f} ms per step "
          f"({100 * rec_ms / (med(wall[False]) * 1e3):.2f}% of the step's wall time)")
    q = statistics.quantiles
    print(f"ratio with/without, median of per-pair ratios: wall {med(pair_wall):.4f}, "
          f"process CPU time {med(pair_cpu):.4f}  (claim: < 1.02)")
    print(f"  per-pair ratio quartiles: wall {[round(v, 3) for v in q(pair_wall, n=4)]}, "
          f"CPU {[round(v, 3) for v in q(pair_cpu, n=4)]}")
    print(f"fixed cost per step: {num_sections} sections x {section_us:.2f} us + "
          f"{len(collector.layers)} hook calls x {hook_us:.1f} us + record/jsonl {rec_ms:.3f} ms "
          f"= {fixed_ms:.3f} ms = {100 * fixed_ms / (med(wall[False]) * 1e3):.3f}% of the median "
          f"step without metrics ({med(wall[False]) * 1e3:.1f} ms)")
    print("the side-by-side ratios are noisy where other processes share the cores; the "
          "fixed cost is measured in tight loops")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "benchmark": "metrics_overhead", "recipe": cfg.name, "steps": args.steps,
            "threads": torch.get_num_threads(),
            "step_ms_without": med(wall[False]) * 1e3, "step_ms_with": med(wall[True]) * 1e3,
            "ratio_wall": med(pair_wall), "ratio_cpu": med(pair_cpu),
            "record_ms": rec_ms, "fixed_ms": fixed_ms,
            "fixed_share": fixed_ms / (med(wall[False]) * 1e3)}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
