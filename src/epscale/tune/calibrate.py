"""``epscale calibrate``: measure this machine and write a cluster file for the simulator.

It starts ``--nproc`` local gloo processes (the way a local EP run starts them) and,
with all of them busy at once so that they share the cores as they would in a run:

* expert GEMM throughput: :class:`epscale.moe.experts.GroupedExperts` forward+backward at
  several expert counts and rows per expert, fitted as ``t = (rows + h * experts) *
  flops_per_row / rate + c`` -> ``gemm_tflops`` (efficiency 1: the rate is what was
  reached), ``gemm_half_rows = h``, ``layer_overhead_us`` from ``c``;
* all-to-all: ``all_to_all_single`` at several sizes, fitted as ``t = latency + bytes
  sent per rank / bandwidth`` -> both the intra- and inter-node fields (one machine is
  one node).

The same measurement functions run inside an existing process group, so a test can
calibrate and run the real EP layer in one session (:func:`bench_moe_layer`).
"""

from __future__ import annotations

import datetime
import os
import queue
import statistics
import time
import traceback
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from ..config import ConfigError
from ..launch.local import free_port
from ..moe.experts import GroupedExperts
from ..moe.layer import MoE
from ..parallel import ParallelDims, parallelize
from ..plan.cluster import ClusterSpec

# --------------------------------------------------------------------------- processes


def _entry(rank, nproc, port, threads, fn, args, out) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(nproc)})
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=nproc,
                                timeout=datetime.timedelta(seconds=300))
        result = fn(rank, nproc, *args)
        dist.barrier()   # gloo can abort at exit while a peer is mid-collective
        dist.destroy_process_group()
        out.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((rank, False, traceback.format_exc()))


def spawn_local(fn: Callable, nproc: int, args: tuple = (), threads: int | None = None,
                timeout_s: float = 600.0) -> list[Any]:
    """Run ``fn(rank, nproc, *args)`` in ``nproc`` gloo processes; per-rank results.
    ``threads``: torch threads per process (default: cores // nproc, at least 1)."""
    import torch.multiprocessing as mp

    threads = threads or max(1, (os.cpu_count() or 1) // nproc)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, nproc, port, threads, fn, args, out), daemon=True)
             for r in range(nproc)]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < nproc and time.monotonic() < deadline:
            try:
                rank, ok, payload = out.get(timeout=1.0)
                got[rank] = (ok, payload)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f"rank {r}: {v}" for r, (ok, v) in sorted(got.items()) if not ok]
    missing = [r for r in range(nproc) if r not in got]
    if errors or missing:
        raise RuntimeError("local processes failed:\n" + "\n".join(
            errors + [f"rank {r}: no result (exit code {procs[r].exitcode})" for r in missing]))
    return [got[r][1] for r in range(nproc)]


# --------------------------------------------------------------------------- measurements


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _clock(name: str) -> Callable[[], float]:
    if name not in CLOCKS:
        raise ConfigError(f"clock '{name}' is invalid: must be 'wall' or 'cpu'")
    return CLOCKS[name]


def _timed(fn: Callable[[], Any], iters: int, warmup: int = 1, clock: str = "wall") -> float:
    """Median seconds of ``fn`` with all ranks starting together; the max over ranks.
    ``clock='cpu'`` counts this process's CPU time instead of wall time (on a machine
    shared with other jobs, wall time measures their load as much as ours)."""
    now = _clock(clock)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = now()
        fn()
        times.append(now() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def measure_gemm(dim: int = 512, hidden: int = 1024, activation: str = "swiglu",
                 experts: tuple[int, ...] = (1, 4), rows: tuple[int, ...] = (64, 256, 1024),
                 iters: int = 3, clock: str = "wall") -> list[dict]:
    """Forward+backward time of the grouped expert FFN, every rank at once (in a group)."""
    torch.manual_seed(0)
    samples = []
    for e in experts:
        mod = GroupedExperts(e, dim, hidden, activation)
        for r in rows:
            x = torch.randn(e * r, dim, requires_grad=True)
            counts = torch.full((e,), r, dtype=torch.int64)

            def step():
                mod.zero_grad(set_to_none=True)
                mod(x, counts).sum().backward()
            samples.append({"experts": e, "rows": e * r, "seconds": _timed(step, iters, clock=clock)})
    return samples


def measure_alltoall(sizes: tuple[int, ...] = (1 << 10, 1 << 16, 1 << 20, 1 << 22),
                     iters: int = 5, clock: str = "wall") -> list[dict]:
    """``all_to_all_single`` time for several bytes-per-peer sizes (in a group)."""
    P = dist.get_world_size()
    samples = []
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        send = torch.randn(P * n)
        recv = torch.empty_like(send)
        t = _timed(lambda: dist.all_to_all_single(recv, send), iters, clock=clock)
        samples.append({"bytes_per_peer": n * 4, "bytes_out": (P - 1) * n * 4, "seconds": t})
    return samples


def fit_gemm(samples: list[dict], dim: int, hidden: int, activation: str) -> dict:
    """Least squares ``t = a*rows + b*experts + c`` -> rate, half rows, overhead."""
    mats = 3 if activation == "swiglu" else 2
    row_flops = 6.0 * mats * dim * hidden
    A = np.array([[s["rows"], s["experts"], 1.0] for s in samples])
    y = np.array([s["seconds"] for s in samples])
    # Relative errors count, not absolute ones: the largest sample would decide alone.
    (a, b, c), *_ = np.linalg.lstsq(A / y[:, None], np.ones_like(y), rcond=None)
    a = max(a, 1e-15)
    return {"flops_per_s": row_flops / a, "half_rows": max(0.0, b / a), "overhead_s": max(0.0, c)}


def fit_alltoall(samples: list[dict]) -> dict:
    """Least squares ``t = latency + bytes_out / bandwidth``."""
    A = np.array([[1.0, s["bytes_out"]] for s in samples])
    y = np.array([s["seconds"] for s in samples])
    (lat, inv_bw), *_ = np.linalg.lstsq(A / y[:, None], np.ones_like(y), rcond=None)
    return {"latency_s": max(0.0, lat), "bw_Bps": 1.0 / max(inv_bw, 1e-15)}


def measure(dim: int = 512, hidden: int = 1024, activation: str = "swiglu", quick: bool = False,
            clock: str = "wall") -> dict:
    """Every calibration measurement, inside an initialised process group."""
    iters = 2 if quick else 3
    gemm = measure_gemm(dim, hidden, activation, iters=iters, clock=clock,
                        rows=(64, 256, 1024) if not quick else (128, 512))
    a2a = (measure_alltoall(iters=3 if quick else 5, clock=clock)
           if dist.get_world_size() > 1 else [])
    return {"gemm": gemm, "alltoall": a2a, "clock": clock}


def _calibrate_worker(rank, nproc, dim, hidden, activation, quick, clock):
    return measure(dim, hidden, activation, quick, clock)


def cluster_from(meas: dict, nproc: int, dim: int, hidden: int, activation: str,
                 name: str | None = None) -> ClusterSpec:
    g = fit_gemm(meas["gemm"], dim, hidden, activation)
    if meas["alltoall"]:
        c = fit_alltoall(meas["alltoall"])
    else:
        c = {"latency_s": 0.0, "bw_Bps": 1e12}
    bw = float(c["bw_Bps"]) / 1e9
    lat = float(c["latency_s"]) * 1e6
    return ClusterSpec(
        name=name or f"local-{nproc}", nodes=1, gpus_per_node=nproc,
        intra_bw_GBps=bw, intra_latency_us=lat, inter_bw_GBps=bw, inter_latency_us=lat,
        gemm_tflops=float(g["flops_per_s"]) / 1e12, gemm_efficiency=1.0,
        gemm_half_rows=float(g["half_rows"]), layer_overhead_us=float(g["overhead_s"]) * 1e6 / 3,
        description=f"measured by epscale calibrate: {nproc} gloo processes on "
                    f"{os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads in the parent")


def calibrate(nproc: int, dim: int = 512, hidden: int = 1024, activation: str = "swiglu",
              quick: bool = False, threads: int | None = None, clock: str = "wall"
              ) -> tuple[ClusterSpec, dict]:
    """Spawn ``nproc`` processes, measure, and return (cluster, raw measurements)."""
    if nproc < 1:
        raise ConfigError(f"--nproc = {nproc} is invalid: must be >= 1")
    _clock(clock)
    res = spawn_local(_calibrate_worker, nproc, (dim, hidden, activation, quick, clock),
                      threads=threads)
    meas = res[0]
    return cluster_from(meas, nproc, dim, hidden, activation), meas


# --------------------------------------------------------------------------- the real layer


def bench_moe_layer(moe_cfg, dispatcher: str, tokens: int, iters: int = 5, warmup: int = 2,
                    seed: int = 0, clock: str = "wall") -> dict:
    """Forward+backward of one expert-parallel MoE layer over the whole (initialised)
    process group (ep = world). Returns per-iteration step times (max over ranks) and the
    global tokens per expert of every iteration, in a metrics.jsonl-like ``layers`` form."""
    P = dist.get_world_size()
    torch.manual_seed(seed)
    moe = MoE(moe_cfg)
    dims = ParallelDims(dp=1, ep=P)
    parallelize(moe, dims, dispatcher=dispatcher)
    g = torch.Generator().manual_seed(seed + 1 + dist.get_rank())
    x = torch.randn(tokens, moe_cfg.dim, generator=g, requires_grad=True)
    now = _clock(clock)
    times, traces = [], []
    for it in range(warmup + iters):
        moe.zero_grad(set_to_none=True)
        x.grad = None
        dist.barrier()
        t0 = now()
        y = moe(x)
        (y.float().square().mean() + moe.aux_loss).backward()
        dt = torch.tensor([now() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        counts = moe.last_stats["tokens_per_expert"].to(torch.int64).clone()
        dist.all_reduce(counts)
        if it >= warmup:
            times.append(float(dt.item()))
            traces.append({"step": it, "layers": [{"layer": 0, "tokens_per_expert": counts.tolist()}]})
    return {"times": times, "median_s": statistics.median(times), "trace": traces,
            "bytes_sent": int(moe.dispatcher.bytes_sent())}
