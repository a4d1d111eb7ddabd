"""epscale calibrate: the fits recover known parameters, the CLI writes a cluster file the
simulator reads, the simulator's layer time is the arithmetic of a given cluster
description on a given routing, and the real EP layer that calibration is checked against
runs and reports its routing as a trace.

How close the calibrated simulator comes to a measured layer depends on the machine and
its load, so it is a benchmark, not a test: ``benchmarks/simulate.py --calibration``
prints measured / predicted and the machine it ran on (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from epscale.tune.calibrate import bench_moe_layer, fit_alltoall, fit_gemm, spawn_local
from epscale.cli import main as cli_main
from epscale.config import ModelConfig, MoEConfig, ParallelConfig, RunConfig, TrainConfig
from epscale.plan import ClusterSpec, load_cluster, simulate
from epscale.plan.routing import RoutingSpec


def test_fits_recover_known_parameters():
    row_flops = 6 * 3 * 64 * 128
    rate, h, c = 2e10, 40.0, 3e-4
    samples = [{"experts": e, "rows": r, "seconds": (r + h * e) * row_flops / rate + c}
               for e in (1, 4) for r in (64, 512, 4096)]
    fit = fit_gemm(samples, 64, 128, "swiglu")
    assert fit["flops_per_s"] == pytest.approx(rate, rel=1e-6)
    assert fit["half_rows"] == pytest.approx(h, rel=1e-6)
    assert fit["overhead_s"] == pytest.approx(c, rel=1e-6)
    a2a = [{"bytes_out": b, "seconds": 5e-5 + b / 2e9} for b in (1e3, 1e5, 1e7)]
    got = fit_alltoall(a2a)
    assert got["latency_s"] == pytest.approx(5e-5, rel=1e-6)
    assert got["bw_Bps"] == pytest.approx(2e9, rel=1e-6)


def test_calibrate_cli_writes_a_cluster_file(tmp_path, capsys):
    out = tmp_path / "local.yaml"
    assert cli_main(["calibrate", "--nproc", "2", "--quick", "--dim", "128", "--hidden", "256",
                     "--out", str(out)]) == 0
    cl = load_cluster(out)
    assert (cl.nodes, cl.gpus_per_node) == (1, 2)
    assert cl.gemm_tflops > 0 and cl.intra_bw_GBps > 0 and cl.gemm_efficiency == 1.0
    assert "wrote" in capsys.readouterr().out


def _trace(tmp_path, counts_E, steps=3):
    path = tmp_path / "trace.jsonl"
    rec = {"layers": [{"layer": 0, "tokens_per_expert": list(counts_E)}]}
    path.write_text("\n".join(json.dumps({"step": s + 1, **rec}) for s in range(steps)))
    return RoutingSpec.parse(f"trace:{path}")


@pytest.mark.parametrize("ep", [2, 4])
def test_layer_time_is_the_cluster_arithmetic(ep, tmp_path):
    """One MoE layer, plain all-to-all, no overlap: expert compute of the busiest rank (rows
    plus the per-GEMM allowance, at the cluster's rate, plus the per-layer overhead) and
    four transfers of the slowest rank (rows out or in, whichever is more, over the link,
    plus its latency), by hand from the cluster description and the routing trace."""
    E, K, D, F, T = 8, 2, 64, 96, 128
    counts_E = [40, 0, 10, 30, 25, 5, 50, 40]          # one expert gets no rows
    cluster = ClusterSpec(name="given", nodes=1, gpus_per_node=ep, intra_bw_GBps=2.0,
                          intra_latency_us=30.0, inter_bw_GBps=2.0, inter_latency_us=30.0,
                          gemm_tflops=0.05, gemm_efficiency=0.8, gemm_half_rows=16.0,
                          layer_overhead_us=200.0)
    moe_cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=K)
    run_cfg = RunConfig(model=ModelConfig(vocab_size=256, dim=D, num_layers=1, num_heads=4,
                                          seq_len=T),
                        moe=moe_cfg, parallel=ParallelConfig(ep=ep),
                        train=TrainConfig(micro_batch_size=1, dtype="float32"))
    res = simulate(run_cfg, cluster, _trace(tmp_path, counts_E), strategies=("none",),
                   dispatchers=("alltoall",), overlap="none")[0]

    share = np.array(counts_E, dtype=np.float64) / sum(counts_E)
    rows_E = share * T * ep * K                        # the EP group's rows per expert
    e = E // ep
    rows_R = rows_E.reshape(ep, e).sum(1)
    gemms_R = (rows_E.reshape(ep, e) > 0).sum(1)
    rate = 0.05e12 * 0.8
    row_flops = 6 * 3 * D * F                          # SwiGLU: 3 matrices, fwd + bwd
    compute_R = (rows_R + 16.0 * gemms_R) * row_flops / rate + 3 * 200e-6
    to_each_R = rows_R / ep                             # what each source sends each rank
    out_R = to_each_R.sum() - to_each_R                 # to the other ranks
    in_R = (ep - 1) * to_each_R
    transfer_R = np.maximum(out_R, in_R) * D * 4 / 2e9 + 30e-6
    want_ms = (compute_R.max() + 4 * transfer_R.max()) * 1e3
    layer = res.layers[0]
    assert layer["layer_time_ms"] == pytest.approx(want_ms, rel=1e-9)
    assert layer["expert_compute_max_ms"] == pytest.approx(compute_R.max() * 1e3, rel=1e-9)
    assert layer["transfer_ms"] == pytest.approx(transfer_R.max() * 1e3, rel=1e-9)
    # dedup sends a token once per destination rank: never more than alltoall
    dedup = simulate(run_cfg, cluster, _trace(tmp_path, counts_E), strategies=("none",),
                     dispatchers=("dedup",), overlap="none")[0].layers[0]
    assert dedup["transfer_ms"] <= layer["transfer_ms"]
    assert dedup["expert_compute_max_ms"] == pytest.approx(layer["expert_compute_max_ms"])


def _session(rank, nproc, moe_cfg, tokens):
    return {d: bench_moe_layer(moe_cfg, d, tokens, iters=2, warmup=1, clock="cpu")
            for d in ("alltoall", "dedup")}


def test_real_layer_bench_reports_its_routing():
    """What --calibration compares the simulator with: the real EP layer's step times and
    its global tokens per expert as a metrics.jsonl-like trace (2 gloo processes)."""
    moe_cfg = MoEConfig(dim=32, hidden_dim=48, num_experts=4, top_k=2)
    runs = spawn_local(_session, 2, (moe_cfg, 64), threads=1)
    assert runs[0].keys() == {"alltoall", "dedup"}
    for disp, run in runs[0].items():
        assert len(run["times"]) == 2 and run["median_s"] > 0 and run["bytes_sent"] > 0, disp
        for rec in run["trace"]:
            (layer,) = rec["layers"]
            assert sum(layer["tokens_per_expert"]) == 2 * 64 * 2  # every rank's tokens x top-k
    # every rank reduced the same step times and counts
    assert runs[0]["dedup"]["trace"] == runs[1]["dedup"]["trace"]
