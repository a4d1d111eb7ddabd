"""``epscale calibrate``: measure this machine (expert GEMM rate, gloo all-to-all) with N
local processes and write a cluster file the simulator reads."""

from __future__ import annotations

from pathlib import Path

from ..tune.calibrate import CLOCKS, calibrate
from ..plan.cluster import dump_cluster


def configure_parser(p) -> None:
    p.add_argument("--nproc", type=int, default=2, help="local processes (default 2)")
    p.add_argument("--out", default=None, help="cluster YAML to write (default local-N.yaml)")
    p.add_argument("--dim", type=int, default=512, help="model dim of the GEMM benchmark")
    p.add_argument("--hidden", type=int, default=1024, help="expert hidden dim of the GEMM benchmark")
    p.add_argument("--activation", choices=("swiglu", "gelu"), default="swiglu")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per process (default cores // nproc)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                   help="wall time (default) or per-process CPU time (a machine shared with other jobs)")


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"calibrating with {args.nproc} gloo processes ...")
    cluster, meas = calibrate(args.nproc, args.dim, args.hidden, args.activation, args.quick,
                              args.threads, args.clock)
    t = Table(title=f"measurements ({args.nproc} processes)")
    for col in ("what", "size", "seconds"):
        t.add_column(col, justify="right")
    for s in meas["gemm"]:
        t.add_row(f"experts fwd+bwd, {s['experts']} experts", f"{s['rows']} rows", f"{s['seconds']:.4f}")
    for s in meas["alltoall"]:
        t.add_row("all_to_all_single", f"{s['bytes_per_peer']} B/peer", f"{s['seconds']:.5f}")
    console.print(t)
    out = Path(args.out or f"local-{args.nproc}.yaml")
    dump_cluster(cluster, out, comment=f"epscale calibrate --nproc {args.nproc} "
                                       f"(dim {args.dim}, hidden {args.hidden})")
    console.print(f"GEMM {cluster.gemm_tflops * 1e3:.1f} GFLOP/s per process, half rows "
                  f"{cluster.gemm_half_rows:.0f}, layer overhead {cluster.layer_overhead_us:.0f} us; "
                  f"all-to-all {cluster.intra_bw_GBps:.2f} GB/s, latency {cluster.intra_latency_us:.0f} us")
    console.print(f"wrote {out}")
    return 0
