"""What `epscale monitor` costs on a long run's metrics.jsonl: time and peak memory of
`monitor --check` and of the HTML report, each in a fresh process, on a generated file.

    python benchmarks/monitor_large.py [--mb 100] [--layers 4] [--experts 8] [--world 2]

The file holds step records shaped like the trainer's (the tiny recipe's fields: time
breakdown, per-layer expert counts and rank loads, per-rank times), with a checkpoint
event every 100 steps; its size is reached by repeating steps with fresh numbers.
Prints one line per command: seconds, peak RSS (MiB), records.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("data", "forward", "attention", "router", "dispatch", "experts", "combine",
            "backward", "optimizer", "sync")


def record(step: int, layers: int, experts: int, world: int, rng: random.Random) -> dict:
    lay = []
    for i in range(layers):
        counts = [rng.randint(0, 400) for _ in range(experts)]
        mean = sum(counts) / experts or 1
        lay.append({"layer": i, "tokens_per_expert": counts,
                    "rank_load": [sum(counts[r::world]) for r in range(world)],
                    "rank_idle": [rng.random() * 0.2 for _ in range(world)],
                    "max_vio": max(counts) / mean - 1, "dropped_frac": 0.0,
                    "router_entropy": 1.6 + rng.random() * 0.1, "bias_min": -rng.random() * 0.01,
                    "bias_max": rng.random() * 0.01, "dead_experts": [], "nonfinite_inputs": 0})
    t = 0.3 + rng.random() * 0.01
    return {"step": step, "time": 1.7e9 + step * t, "loss": 3 / (1 + step / 1000) + rng.random() * 0.05,
            "lr": 3e-3, "grad_norm": 0.5 + rng.random(), "tokens_per_s": 3000 + rng.random() * 50,
            "tokens_per_s_per_proc": 1500 + rng.random() * 25, "step_time_s": t,
            "time_breakdown": {s: rng.random() * t / len(SECTIONS) for s in SECTIONS},
            "comm_share": 0.1 + rng.random() * 0.01, "mfu": 0.02, "max_vio": 0.5 + rng.random(),
            "worst_rank_idle": rng.random() * 0.1, "dropped_frac": 0.0, "skipped": False,
            "layers": lay, "rank_step_time_s": [t * (1 - rng.random() * 0.05) for _ in range(world)],
            "rank_wait_frac": [rng.random() * 0.05 for _ in range(world)],
            "rank_idle": [rng.random() * 0.1 for _ in range(world)], "mem_mb": 350.0,
            "rank_mem_mb": [350.0] * world, "num_tokens": 1024, "world_size": world}


def write_run(run: Path, mb: float, layers: int, experts: int, world: int) -> int:
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(
        f"name: big\nparallel: {{dp: 1, ep: {world}}}\nmoe: {{num_experts: {experts}}}\n")
    rng, step, size = random.Random(0), 0, 0
    with open(run / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"event": "start", "step": 0, "time": 1.7e9, "world_size": world}) + "\n")
        while size < mb * 2 ** 20:
            step += 1
            line = json.dumps(record(step, layers, experts, world, rng), separators=(",", ":"))
            if step % 100 == 0:
                line += "\n" + json.dumps({"event": "checkpoint", "step": step, "time": 1.7e9 + step})
            f.write(line + "\n")
            size += len(line) + 1
        f.write(json.dumps({"event": "end", "step": step, "time": 1.7e9 + step}) + "\n")
    return step


# Runs `epscale ARGS` in a child of its own and prints that child's peak RSS (KiB) and
# its exit status: RUSAGE_CHILDREN of this wrapper covers that one command only.
WRAP = ("import resource, subprocess, sys\n"
        "r = subprocess.run([sys.executable, '-m', 'epscale', *sys.argv[1:]], capture_output=True)\n"
        "sys.stderr.write(r.stderr.decode()[-3000:])\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode)")


def measure(args: list[str]) -> tuple[float, float, int]:
    """(seconds, peak RSS MiB, exit status) of `epscale ARGS` in a fresh process."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", WRAP, *args], cwd=REPO, capture_output=True,
                       text=True)
    dt = time.perf_counter() - t0
    peak_kib, code = (int(x) for x in r.stdout.split()[-2:])
    if code not in (0, 1):
        raise SystemExit(f"epscale {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return dt, peak_kib / 1024, code


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--world", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        steps = write_run(run, a.mb, a.layers, a.experts, a.world)
        size = (run / "metrics.jsonl").stat().st_size / 2 ** 20
        print(f"metrics.jsonl: {size:.0f} MiB, {steps:,} step records "
              f"({a.layers} layers x {a.experts} experts, world {a.world})")
        for name, cmd in (("monitor --check", [str(run), "--check"]),
                          ("monitor (report)", [str(run)])):
            dt, peak, code = measure(["monitor", *cmd])
            print(f"{name:<18} {dt:6.1f} s  peak RSS {peak:6.0f} MiB  (exit {code})")


if __name__ == "__main__":
    main()
