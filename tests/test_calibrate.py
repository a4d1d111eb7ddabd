"""epscale calibrate: the fits recover known parameters, the CLI writes a cluster file the
simulator reads, and the simulator, calibrated on this machine, predicts a real
expert-parallel MoE layer (2 and 4 gloo processes, alltoall and dedup) within 20%.

The prediction test times both the calibration and the real layer in per-process CPU time
(``clock='cpu'``): the machine running the suite is shared with other jobs, and wall time
would measure their load as much as ours. Both are measured in the same process group, one
right after the other, the layer with the real router, dispatcher and experts; the
simulator gets the layer's own routing as a trace (its metrics.jsonl form).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from epscale.sim.calibrate import (bench_moe_layer, cluster_from, fit_alltoall, fit_gemm, measure,
                               spawn_local)
from epscale.cli import main as cli_main
from epscale.config import ModelConfig, MoEConfig, ParallelConfig, RunConfig, TrainConfig
from epscale.sim import load_cluster, simulate
from epscale.sim.cluster import dump_cluster
from epscale.sim.routing import RoutingSpec

DIM, HIDDEN, TOKENS = 512, 1024, 1024


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


def _session(rank, nproc, moe_cfg, tokens):
    meas = measure(DIM, HIDDEN, "swiglu", quick=False, clock="cpu")
    runs = {d: bench_moe_layer(moe_cfg, d, tokens, iters=3, warmup=1, clock="cpu")
            for d in ("alltoall", "dedup")}
    return meas, runs


@pytest.mark.parametrize("nproc", [2, 4])
def test_simulator_predicts_a_local_ep_run(nproc, tmp_path):
    moe_cfg = MoEConfig(dim=DIM, hidden_dim=HIDDEN, num_experts=8, top_k=2)
    meas, runs = spawn_local(_session, nproc, (moe_cfg, TOKENS), threads=1)[0]
    cluster_file = tmp_path / "cluster.yaml"
    dump_cluster(cluster_from(meas, nproc, DIM, HIDDEN, "swiglu"), cluster_file)
    cluster = load_cluster(cluster_file)
    run_cfg = RunConfig(model=ModelConfig(vocab_size=256, dim=DIM, num_layers=1, num_heads=4,
                                          seq_len=TOKENS),
                        moe=moe_cfg, parallel=ParallelConfig(ep=nproc),
                        train=TrainConfig(micro_batch_size=1))
    report = []
    for disp, run in runs.items():
        trace = tmp_path / f"{disp}.jsonl"
        trace.write_text("\n".join(json.dumps(rec) for rec in run["trace"]))
        res = simulate(run_cfg, cluster, RoutingSpec.parse(f"trace:{trace}"),
                       strategies=("none",), dispatchers=(disp,), overlap="none")[0]
        predicted = res.layers[0]["layer_time_ms"] / 1e3
        report.append((disp, run["median_s"], predicted))
    print(report)
    for disp, measured, predicted in report:
        assert measured == pytest.approx(predicted, rel=0.2), (disp, measured, predicted, report)
    assert np.isfinite([m for _, m, _ in report]).all()
