"""Communication behind compute: per dispatcher and layout, the exposed communication
share (the time a rank waited on communication over the step time, ``comm_exposed_share``
of metrics.jsonl) and tokens/s with ``parallel.overlap: auto`` against ``none`` (the plain
blocking path), side by side in one run, with the ratios.

    .venv/bin/python benchmarks/overlap.py                       # every case, 1 round
    .venv/bin/python benchmarks/overlap.py --cases ep2-dedup,ep4-dedup --rounds 3
    .venv/bin/python benchmarks/overlap.py --steps 12 --recipe larger
    .venv/bin/python benchmarks/overlap.py --overhead            # the clock's own cost
    .venv/bin/python benchmarks/overlap.py --cases pp2-ep2-dualpipev --rounds 3  # micro-batch pairs
    .venv/bin/python benchmarks/overlap.py --cases ep2-alltoall-accum4,ep2-alltoall-pairs  # no pipeline

Each case trains ``configs/tiny.yaml`` (or ``--recipe larger``) for ``--steps`` steps on
gloo (``epscale train --nproc N``), once per mode; ``--rounds R`` alternates auto and none
R times (a busy machine then hits both alike) and takes the median of the runs' medians.
Per run: the median over the steps after the first third of the exposed share, of the
in-flight share (``comm_s`` / step time), of the exposed share of each kind, and of
tokens/s. Printed per case: both modes, exposed(auto) / exposed(none) (the issue's target:
below 0.7) and tokens/s(auto) / tokens/s(none).
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

REPO = Path(__file__).resolve().parent.parent
KINDS = ("dispatch", "fsdp", "dp", "pp")
CHUNKS = ["parallel.overlap_chunks=2"]
DUALPIPEV = ["parallel.pp=2", "parallel.ep=2", "parallel.pp_schedule=dualpipev",
             "model.tie_embeddings=false", "train.micro_batch_size=1", "train.grad_accum=8"]
ACCUM4 = ["train.grad_accum=4", "train.micro_batch_size=1"]
ACCUM8 = ["train.grad_accum=8", "train.micro_batch_size=1"]
PAIRS = ["parallel.overlap_micro_batches=true"]
# name -> (processes, overrides on the recipe[, overrides of the 'auto' run only])
CASES = {
    "ep2-alltoall": (2, ["parallel.ep=2", "parallel.dispatcher=alltoall"]),
    "ep2-dedup": (2, ["parallel.ep=2", "parallel.dispatcher=dedup", *CHUNKS]),
    "ep2-hierarchical": (2, ["parallel.ep=2", "parallel.dispatcher=hierarchical",
                             "parallel.ranks_per_node=1", *CHUNKS]),
    "ep2-allgather": (2, ["parallel.ep=2", "parallel.dispatcher=allgather"]),
    "ep4-alltoall": (4, ["parallel.ep=4", "parallel.dispatcher=alltoall"]),
    "ep4-dedup": (4, ["parallel.ep=4", "parallel.dispatcher=dedup", *CHUNKS]),
    "ep4-hierarchical": (4, ["parallel.ep=4", "parallel.dispatcher=hierarchical",
                             "parallel.ranks_per_node=2", *CHUNKS]),
    "ep4-allgather": (4, ["parallel.ep=4", "parallel.dispatcher=allgather"]),
    "fsdp2-ep2-dedup": (2, ["parallel.fsdp=true", "parallel.ep=2", "parallel.dispatcher=dedup",
                            *CHUNKS]),
    # DualPipeV on 4 ranks: with 'auto' its paired forward and backward of two
    # micro-batches interleave at their exchanges (parallel/overlap_pair.py); 8
    # micro-batches of 1 sequence per data rank
    "pp2-ep2-dualpipev": (4, DUALPIPEV + ["parallel.dispatcher=alltoall"]),
    "pp2-ep2-dualpipev-dedup": (4, DUALPIPEV + ["parallel.dispatcher=dedup", *CHUNKS]),
    # Without a pipeline, 4 micro-batches of 1 sequence: 'auto' pairs each forward with the
    # previous micro-batch's backward (parallel.overlap_micro_batches); the -accum4 cases
    # are the same runs without the pairs
    "ep2-alltoall-accum4": (2, ["parallel.ep=2", "parallel.dispatcher=alltoall", *ACCUM4]),
    "ep2-alltoall-pairs": (2, ["parallel.ep=2", "parallel.dispatcher=alltoall", *ACCUM4], PAIRS),
    "ep2-dedup-pairs": (2, ["parallel.ep=2", "parallel.dispatcher=dedup", *CHUNKS, *ACCUM4],
                        PAIRS),
    "ep4-alltoall-accum4": (4, ["parallel.ep=4", "parallel.dispatcher=alltoall", *ACCUM4]),
    "ep4-alltoall-pairs": (4, ["parallel.ep=4", "parallel.dispatcher=alltoall", *ACCUM4], PAIRS),
    # 8 micro-batches: the unpaired first forward and last backward are a smaller part
    "ep4-alltoall-pairs8": (4, ["parallel.ep=4", "parallel.dispatcher=alltoall", *ACCUM8], PAIRS),
    "ep4-dedup-pairs": (4, ["parallel.ep=4", "parallel.dispatcher=dedup", *CHUNKS, *ACCUM4],
                        PAIRS),
    "ep4-hierarchical-pairs": (4, ["parallel.ep=4", "parallel.dispatcher=hierarchical",
                                   "parallel.ranks_per_node=2", *CHUNKS, *ACCUM4], PAIRS),
}
RECIPES = {
    "tiny": [],
    "larger": ["model.dim=384", "model.num_layers=6", "model.num_heads=6",
               "moe.hidden_dim=768", "moe.num_experts=16", "train.micro_batch_size=2"],
}


def run_one(run_dir: Path, nproc: int, steps: int, over: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "epscale", "train", "--config", str(REPO / "configs" / "tiny.yaml"),
           "--nproc", str(nproc), "--run-dir", str(run_dir), f"train.steps={steps}",
           "train.eval_every=0", "train.ckpt_every=0", "train.warmup_steps=2",
           "train.preflight=false", "moe.num_shared_experts=1", *over]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        idle = machine_idle_share(proc, run_dir / "metrics.jsonl", steady_from=steps // 3 + 1)
        if proc.returncode != 0:
            log.seek(0)
            raise SystemExit(f"run failed: {' '.join(cmd)}\n{log.read()[-4000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "event" not in r and "comm_exposed_share" in r]
    for r in recs:
        r["machine_idle_share"] = idle
    return recs


def _cpu_times() -> tuple[int, int]:
    """(idle + iowait, total) jiffies of the whole machine, from /proc/stat's first line."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields[:8])


def _step_records(path: Path) -> int:
    try:
        return sum('"event"' not in line for line in path.read_text().splitlines())
    except OSError:
        return 0


def machine_idle_share(proc: subprocess.Popen, metrics: Path, steady_from: int) -> float:
    """Wait for ``proc``; the share of the machine's CPU time left idle between the
    ``steady_from``-th step record and the last one (polled every 0.2 s from
    ``/proc/stat``): where it is near 0 the ranks had no idle core to fill, so hiding a
    wait cannot shorten the step (another rank's compute held the core). NaN off Linux
    or for a run too short to poll twice."""
    import time

    if not os.path.exists("/proc/stat"):
        proc.wait()
        return float("nan")
    first = last = None
    seen = 0
    while proc.poll() is None:
        time.sleep(0.2)
        n = _step_records(metrics)
        if n >= steady_from and n > seen:
            if first is None:
                first = _cpu_times()
            else:
                last = _cpu_times()
        seen = n
    if first is None or last is None or last[1] == first[1]:
        return float("nan")
    return (last[0] - first[0]) / (last[1] - first[1])


def summarize(recs: list[dict]) -> dict[str, float]:
    steady = recs[len(recs) // 3:]

    def med(f) -> float:
        return statistics.median(f(r) for r in steady)

    out = {"exposed": med(lambda r: r["comm_exposed_share"]),
           "in_flight": med(lambda r: r["comm_s"] / r["step_time_s"]),
           "tokens_per_s": med(lambda r: r["tokens_per_s"]),
           "step_ms": 1e3 * med(lambda r: r["step_time_s"]),
           "dispatch_n": med(lambda r: r["comm_by_kind"]["dispatch"].get("collectives", 0.0)),
           "dispatch_exposed_ms": 1e3 * med(lambda r: r["comm_by_kind"]["dispatch"]["exposed_s"]),
           "machine_idle": steady[0]["machine_idle_share"]}
    for k in KINDS:
        out[f"exposed.{k}"] = med(lambda r: r["comm_by_kind"][k]["exposed_share"])
    return out


def _kinds(s: dict[str, float]) -> str:
    return " ".join(f"{k} {100 * s[f'exposed.{k}']:.1f}%" for k in KINDS if s[f"exposed.{k}"] > 0)


def _overhead_worker(rank: int, world: int, port: int, n: int, out) -> None:
    """Per collective: an async all-to-all of 64 floats and its wait, bare and through a
    CommClock (track + timed wait), alternating blocks of n; rank 0 reports."""
    import time

    import torch
    import torch.distributed as dist

    from epscale.metrics.commclock import CommClock

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x, y = torch.ones(64), torch.empty(64)
    clock = CommClock()
    times: dict[str, list[float]] = {"bare": [], "clock": []}
    for r in range(10):
        for mode in ("bare", "clock") if r % 2 == 0 else ("clock", "bare"):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                w = dist.all_to_all_single(y, x, async_op=True)
                if mode == "clock":
                    w = clock.track("dispatch", w, (x, y))
                w.wait()
            times[mode].append((time.perf_counter() - t0) / n)
            clock.reset()
    if rank == 0:
        out.put({m: statistics.median(v) for m, v in times.items()})
    dist.barrier()
    dist.destroy_process_group()


def _transfer_worker(rank: int, world: int, port: int, n: int, out) -> None:
    """An all-to-all of ``nbytes`` per rank (fp32), every rank entering together (after a
    barrier), alone on the machine's gloo: the transfer itself, no waiting for a peer."""
    import time

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    res = {}
    for nbytes in (64 << 10, 256 << 10, 1 << 20, 4 << 20):
        x = torch.ones(nbytes // 4)
        y = torch.empty_like(x)
        ts = []
        for _ in range(n):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_to_all_single(y, x)
            ts.append(time.perf_counter() - t0)
        res[nbytes] = statistics.median(ts)
    if rank == 0:
        out.put(res)
    dist.barrier()
    dist.destroy_process_group()


def _spawn(target, world: int, *args):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = q.get(timeout=600)
    for p in procs:
        p.join()
    return got


def transfer() -> None:
    for world in (2, 4):
        got = _spawn(_transfer_worker, world, 50)
        for nbytes, t in got.items():
            print(f"blocking all-to-all, {world} gloo ranks entering together, {nbytes >> 10} "
                  f"KiB per rank: median {1e3 * t:.2f} ms")


def overhead(n: int = 2000) -> None:
    got = _spawn(_overhead_worker, 2, n)
    print(f"async all-to-all of 64 floats + wait, 2 gloo ranks, median of 5 blocks of {n}: "
          f"bare {1e6 * got['bare']:.1f} us, with CommClock {1e6 * got['clock']:.1f} us "
          f"({1e6 * (got['clock'] - got['bare']):+.1f} us per collective, "
          f"{got['clock'] / got['bare']:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--recipe", choices=list(RECIPES), default="tiny")
    ap.add_argument("--json", type=Path, default=None,
                    help="also write the per-case medians and ratios to this file")
    ap.add_argument("--overhead", action="store_true",
                    help="no training: the clock's cost per collective (bare vs timed) and "
                    "the time of a bare all-to-all of a few sizes (the transfer alone)")
    args = ap.parse_args()
    if args.overhead:
        overhead()
        transfer()
        return
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    print(f"recipe {args.recipe}, {args.steps} steps, {args.rounds} round(s); medians over the "
          "steps after the first third (exposed and in flight: share of the step time)")
    head = (f"{'case':<24} {'mode':<5} {'exposed':>8} {'in flight':>9} {'tok/s':>7} "
            f"{'step ms':>8} {'CPU idle':>8}  exposed by kind")
    print(head)
    rows, figures = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            nproc, over, *auto_only = CASES[name]
            runs: dict[str, list[dict]] = {"auto": [], "none": []}
            for r in range(args.rounds):
                for mode in ("auto", "none") if r % 2 == 0 else ("none", "auto"):
                    run_dir = Path(tmp) / f"{name}-{mode}-{r}"
                    extra = auto_only[0] if auto_only and mode == "auto" else []
                    recs = run_one(run_dir, nproc, args.steps, RECIPES[args.recipe] + over
                                   + extra + [f"parallel.overlap={mode}"])
                    runs[mode].append(summarize(recs))
            s = {m: {k: statistics.median(x[k] for x in v) for k in v[0]} for m, v in runs.items()}
            for mode in ("auto", "none"):
                x = s[mode]
                print(f"{name:<24} {mode:<5} {100 * x['exposed']:>7.1f}% {100 * x['in_flight']:>8.1f}% "
                      f"{x['tokens_per_s']:>7.0f} {x['step_ms']:>8.1f} {100 * x['machine_idle']:>7.1f}%  "
                      f"{_kinds(x)}; dispatch "
                      f"{x['dispatch_n']:.0f} collectives, {x['dispatch_exposed_ms']:.0f} ms "
                      "exposed", flush=True)
            ratio = s["auto"]["exposed"] / s["none"]["exposed"] if s["none"]["exposed"] > 0 else float("nan")
            speed = s["auto"]["tokens_per_s"] / s["none"]["tokens_per_s"]
            rows.append((name, ratio, speed))
            figures[name] = {"auto": s["auto"], "none": s["none"], "exposed_ratio": ratio,
                             "tokens_per_s_ratio": speed}
            print(f"{name:<24} ratio auto/none: exposed {ratio:.2f}x, tokens/s {speed:.2f}x",
                  flush=True)
    print("\nsummary (auto / none)")
    for name, ratio, speed in rows:
        print(f"  {name:<24} exposed {ratio:.2f}x  tokens/s {speed:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
