"""The cluster simulator: cluster files, routing distributions, the step model's row and
byte arithmetic, balancing effects, the scale it runs at, and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from epscale.cli import main as cli_main
from epscale.config import ConfigError, ModelConfig, MoEConfig, RunConfig, TrainConfig, ParallelConfig
from epscale.config import load_recipe
from epscale.plan import PRESETS, ClusterSpec, load_cluster, simulate
from epscale.plan.cluster import dump_cluster
from epscale.plan.routing import (RoutingSpec, inclusion_probs, read_trace, sample_topk, shares_of,
                                 zipf_weights)


def _cfg(E=16, K=1, ep=16, dim=256, hidden=512, T=1024, layers=2, groups=0, topk_groups=0,
         dtype="float32"):
    return RunConfig(
        model=ModelConfig(vocab_size=1000, dim=dim, num_layers=layers, num_heads=4, seq_len=T),
        moe=MoEConfig(dim=dim, hidden_dim=hidden, num_experts=E, top_k=K, num_groups=groups,
                      topk_groups=topk_groups),
        parallel=ParallelConfig(ep=ep), train=TrainConfig(micro_batch_size=1, dtype=dtype))


def _trace(tmp_path, counts_SLE):
    path = tmp_path / "metrics.jsonl"
    with path.open("w") as f:
        for step, layers in enumerate(counts_SLE):
            rec = {"step": step, "loss": 1.0,
                   "layers": [{"layer": i, "tokens_per_expert": [int(c) for c in lay]}
                              for i, lay in enumerate(layers)]}
            f.write(json.dumps(rec) + "\n")
    return path


# ---------------------------------------------------------------- cluster and routing

def test_cluster_presets_and_yaml_roundtrip(tmp_path):
    fr = load_cluster("field-report")
    assert fr.world == 1024 and fr.gpus_per_node == 8
    dump_cluster(fr, tmp_path / "c.yaml", comment="test")
    again = load_cluster(tmp_path / "c.yaml", ["nodes=2"])
    assert again.nodes == 2 and again.inter_bw_GBps == fr.inter_bw_GBps
    with pytest.raises(ConfigError, match="unknown config key 'cluster.nodez'.*nodes"):
        load_cluster("field-report", ["nodez=3"])
    with pytest.raises(ConfigError, match="gemm_efficiency"):
        ClusterSpec(gemm_efficiency=1.5)
    with pytest.raises(ConfigError, match="presets: .*field-report"):
        load_cluster("no-such-cluster")
    assert set(PRESETS) >= {"field-report", "h100-node"}


def test_routing_parse_errors():
    assert RoutingSpec.parse("zipf:1.5").skew == 1.5
    for bad in ("zipf:-1", "zipf:x", "gauss", "trace:/no/such/file"):
        with pytest.raises(ConfigError, match="routing"):
            RoutingSpec.parse(bad)


def test_inclusion_probs_match_sampling():
    rng = np.random.default_rng(0)
    w = zipf_weights(2, 32, 1.2, rng)
    pi = inclusion_probs(w, 4)
    assert np.allclose(pi.sum(axis=1), 4) and (pi <= 1).all()
    sampled = shares_of(sample_topk(w, 4, 40000, rng), 32) * 4
    assert np.abs(pi - sampled).max() < 0.03      # Rosen's approximation
    assert np.allclose(inclusion_probs(np.ones((1, 8)), 2), 0.25)


def test_group_limited_sampling_respects_groups():
    rng = np.random.default_rng(0)
    chosen = sample_topk(np.ones((1, 16)), 4, 500, rng, num_groups=4, topk_groups=2)
    groups_used = np.array([len(set(row // 4)) for row in chosen[0]])
    assert groups_used.max() <= 2
    assert all(len(set(row)) == 4 for row in chosen[0])      # distinct experts


def test_read_trace_and_mismatch(tmp_path):
    path = _trace(tmp_path, np.ones((3, 2, 8)))
    assert read_trace(path, 8).shape == (3, 2, 8)
    with pytest.raises(ConfigError, match="8 experts per layer but the recipe has moe.num_experts=4"):
        read_trace(path, 4)


# ---------------------------------------------------------------- step model arithmetic

def test_alltoall_time_and_bytes_by_hand(tmp_path):
    """16 experts on 16 ranks over 2 nodes, top-1, perfectly uniform trace: every source
    sends T/16 rows to each rank, half of them across nodes."""
    cfg = _cfg()
    cl = ClusterSpec(nodes=2, gpus_per_node=8, intra_bw_GBps=100, inter_bw_GBps=10,
                     intra_latency_us=0, inter_latency_us=20, layer_overhead_us=0,
                     gemm_half_rows=0)
    T, D = 1024, 256
    path = _trace(tmp_path, np.full((2, 2, 16), T * 16 / 16))
    res = simulate(cfg, cl, RoutingSpec.parse(f"trace:{path}"), strategies=("none",),
                   dispatchers=("alltoall",), overlap="none")[0]
    row_bytes = D * 4
    inter = 8 * (T / 16) * row_bytes
    intra = 7 * (T / 16) * row_bytes
    lay = res.layers[0]
    assert lay["inter_bytes_per_gpu"] == pytest.approx(inter)
    assert lay["intra_bytes_per_gpu"] == pytest.approx(intra)
    assert lay["transfer_ms"] == pytest.approx((inter / 10e9 + 20e-6) * 1e3)
    rows_per_rank = T          # 16 sources x T/16
    comp = rows_per_rank * 6 * 3 * D * 512 / cl.flops_per_s
    assert lay["expert_compute_max_ms"] == pytest.approx(comp * 1e3)
    assert res.worst_idle_share == pytest.approx(0.0, abs=1e-12) and res.max_vio == pytest.approx(0)
    # 2 MoE layers x 4 transfers (dispatch, combine; forward and backward)
    assert res.inter_bytes_per_gpu == pytest.approx(2 * 4 * inter)


def test_dedup_and_hierarchical_send_fewer_rows():
    cfg = _cfg(E=64, K=8, ep=16)              # 4 experts per rank, 2 nodes
    cl = ClusterSpec(nodes=2, gpus_per_node=8)
    res = {r.dispatcher: r for r in simulate(cfg, cl, RoutingSpec.parse("uniform"),
                                             strategies=("none",), overlap="none")}
    a, d, h = res["alltoall"], res["dedup"], res["hierarchical"]
    # dedup: one row per (token, rank). Uniform top-8 of 64, 4 experts a rank:
    # P(token hits a rank) = 1 - C(60, 8) / C(64, 8), against 4 * 8/64 rows for alltoall.
    from math import comb
    ratio = (1 - comb(60, 8) / comb(64, 8)) / (4 * 8 / 64)
    assert d.inter_bytes_per_gpu / a.inter_bytes_per_gpu == pytest.approx(ratio, rel=1e-9)
    node_ratio = (1 - comb(32, 8) / comb(64, 8)) / (32 * 8 / 64)
    assert h.inter_bytes_per_gpu / a.inter_bytes_per_gpu == pytest.approx(node_ratio, rel=1e-9)
    assert h.step_time_s < d.step_time_s < a.step_time_s


def test_ep_inside_one_node_has_no_inter_node_traffic():
    res = simulate(_cfg(E=8, K=2, ep=8), ClusterSpec(nodes=4, gpus_per_node=8),
                   RoutingSpec.parse("uniform"), strategies=("none",))
    assert all(r.inter_bytes_per_gpu == 0 for r in res)
    assert all(r.intra_bytes_per_gpu > 0 for r in res)


def test_imbalance_sets_the_step_and_balancing_helps():
    cfg = load_recipe("ref-1t-64e")
    res = {(r.strategy, r.dispatcher): r for r in simulate(
        cfg, load_cluster("field-report"), RoutingSpec.parse("zipf:1.0"),
        strategies=("none", "aux", "loss_free", "redundant", "loss_free+redundant"))}
    none, lf = res[("none", "alltoall")], res[("loss_free", "alltoall")]
    assert none.worst_idle_share > 0.3 and none.max_vio > 2
    assert lf.worst_idle_share < res[("aux", "alltoall")].worst_idle_share < none.worst_idle_share
    assert res[("loss_free+redundant", "alltoall")].max_vio < lf.max_vio
    assert lf.tokens_per_s_per_gpu > 2 * none.tokens_per_s_per_gpu
    # the hot rank's NIC is the bottleneck of plain alltoall; hierarchical spreads it
    assert res[("none", "hierarchical")].comm_share < none.comm_share


def test_overlap_hides_communication():
    cfg = load_recipe("ref-1t-64e")
    cl = load_cluster("field-report")
    out = {ov: simulate(cfg, cl, RoutingSpec.parse("uniform"), strategies=("none",),
                        dispatchers=("dedup",), overlap=ov)[0] for ov in ("none", "chunks", "full")}
    out["chunks4"] = simulate(cfg, cl, RoutingSpec.parse("uniform"), strategies=("none",),
                              dispatchers=("dedup",), overlap="chunks", overlap_chunks=4)[0]
    assert out["full"].expert_comm_s < out["chunks4"].expert_comm_s < out["none"].expert_comm_s
    assert out["chunks"].expert_comm_s == pytest.approx(out["none"].expert_comm_s)   # 1 chunk
    assert out["chunks"].dp_comm_s < out["none"].dp_comm_s    # overlapped with backward


def test_trace_group_limited_and_scale():
    """DeepSeek-V3 (256 experts, 8 groups, top-8) on 2,048 GPUs: node-limited routing keeps
    hierarchical traffic to at most 4 nodes per token; all pairs simulate."""
    cfg = load_recipe("deepseek-v3")
    res = simulate(cfg, load_cluster("h800-2048"), RoutingSpec.parse("zipf:0.5"),
                   strategies=("none", "loss_free", "redundant", "spill"))
    assert len(res) == 12
    a = next(r for r in res if r.strategy == "none" and r.dispatcher == "alltoall")
    h = next(r for r in res if r.strategy == "none" and r.dispatcher == "hierarchical")
    # top-8 over 8 nodes limited to 4 nodes: at most 4/8 of the alltoall rows cross nodes
    assert h.inter_bytes_per_gpu < 0.55 * a.inter_bytes_per_gpu


def test_layout_errors_are_clear():
    with pytest.raises(ConfigError, match="'parallel.ep' = 12 is invalid"):
        simulate(_cfg(E=24, ep=12), ClusterSpec(nodes=2, gpus_per_node=8))
    with pytest.raises(ConfigError, match="dispatcher 'nccl'"):
        simulate(_cfg(), ClusterSpec(nodes=2, gpus_per_node=8), dispatchers=("nccl",))
    with pytest.raises(ConfigError, match="balancing strategy 'magic'"):
        simulate(_cfg(), ClusterSpec(nodes=2, gpus_per_node=8), strategies=("magic",))


def test_simulate_cli(tmp_path, capsys):
    js, png = tmp_path / "out.json", tmp_path / "out.png"
    rc = cli_main(["simulate", "ref-1t-64e", "--cluster", "field-report", "--routing", "uniform",
                   "--routing", "zipf:1.0", "--strategies", "none,loss_free+redundant",
                   "--json", str(js), "--plot", str(png), "--layers"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "routing zipf(s=1)" in out and "fastest:" in out and "per MoE layer" in out
    data = json.loads(js.read_text())
    assert len(data["runs"]) == 2 and len(data["runs"][0]["results"]) == 6
    assert png.stat().st_size > 10_000


def test_row_arithmetic_matches_the_dispatch_layout():
    """The simulator's dedup and hierarchical row counts equal what the real dispatchers'
    layout (epscale.dispatch.layout) computes for tokens routed the same way."""
    import torch

    from epscale.dispatch.layout import get_dispatch_layout

    E, K, R, g, T = 64, 8, 16, 8, 20000
    torch.manual_seed(0)
    idx = torch.rand(T, E).topk(K, dim=1).indices                # uniform top-8, distinct
    lay = get_dispatch_layout(idx, E, R, ranks_per_node=g)
    # a source on node 0: rows it sends to node 1 under each dispatcher
    a2a_rows = int(((idx // (E // R)) // g == 1).sum())
    dedup_rows = int(lay.num_tokens_per_rank_P[g:].sum())
    hier_rows = int(lay.num_tokens_per_node_N[1])
    res = {r.dispatcher: r for r in simulate(_cfg(E=E, K=K, ep=R), ClusterSpec(nodes=2, gpus_per_node=g),
                                             RoutingSpec.parse("uniform"), strategies=("none",),
                                             overlap="none")}
    sim_dedup = res["dedup"].inter_bytes_per_gpu / res["alltoall"].inter_bytes_per_gpu
    sim_hier = res["hierarchical"].inter_bytes_per_gpu / res["alltoall"].inter_bytes_per_gpu
    assert sim_dedup == pytest.approx(dedup_rows / a2a_rows, rel=0.02)
    assert sim_hier == pytest.approx(hier_rows / a2a_rows, rel=0.02)
