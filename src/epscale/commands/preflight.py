"""``epscale preflight`` (under torchrun): a timed all-reduce / all-to-all of every rank
that names a slow or missing rank and its host (see :mod:`epscale.launch.preflight`)."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ..launch.preflight import PreflightError, run_preflight


def configure_parser(p) -> None:
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds to wait for every rank to join and for each collective")
    p.add_argument("--iters", type=int, default=5, help="timed rounds per collective")
    p.add_argument("--numel", type=int, default=1 << 16, help="float32 values per collective")
    p.add_argument("--slow-factor", type=float, default=3.0,
                   help="a rank is slow when its local time is this many times the median")
    p.add_argument("--min-slow-ms", type=float, default=5.0,
                   help="... and at least this many milliseconds above it (default 5)")
    p.add_argument("--fail-on-slow", action="store_true",
                   help="exit with status 1 when a rank is slow (a missing rank always fails)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.epilog = "Run it under torchrun, e.g. torchrun --nproc-per-node 8 -m epscale preflight"


def run(args) -> int:
    if "RANK" not in os.environ:
        print("epscale preflight: run it under torchrun (RANK/WORLD_SIZE are not set), e.g. "
              "torchrun --nproc-per-node 2 -m epscale preflight", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo",
                            timeout=timedelta(seconds=max(args.timeout * 2, 60)))
    try:
        report = run_preflight(timeout_s=args.timeout, iters=args.iters, numel=args.numel,
                               slow_factor=args.slow_factor, min_slow_ms=args.min_slow_ms)
    except PreflightError as e:
        print(f"epscale preflight: rank {dist.get_rank()}: {e}", file=sys.stderr, flush=True)
        os._exit(1)  # peers may be gone: no barrier, no clean shutdown possible
    if dist.get_rank() == 0:
        print(report.to_json() if args.json else report.format(), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if (args.fail_on_slow and not report.ok) else 0
