"""The step model by shape (epscale.plan.shapes): GEMM efficiency from (M, N, K) by tile
and wave quantization under a roofline, memory-bound work charged by its bytes, fp8 as a
rate, tensor parallelism, recomputation by module, DualPipe's pairing and the SMs the
overlapped dispatch holds; and benchmarks/published.py prints a ratio for every run (its
ratios are a benchmark result in benchmarks/RESULTS.md, not asserted here). Pure
computation: nothing is built and no process is started."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from epscale.config import ConfigError, ModelConfig, MoEConfig, ParallelConfig, RunConfig, TrainConfig
from epscale.plan import ClusterSpec, load_cluster, simulate
from epscale.plan.routing import RoutingSpec
from epscale.plan.shapes import (ATTN_BWD_EFFICIENCY, ATTN_BWD_FLOPS, ATTN_FWD_EFFICIENCY,
                                 FP8_CAST_BYTES, Work, attention_linears, attention_time,
                                 compute_cluster, elementwise_bytes, expert_gemm_tflops,
                                 expert_time,
                                 gemm_efficiency, gemm_time, host_bound_time, kernels_per_layer,
                                 loss_bytes, nonexpert_parts, nonexpert_time,
                                 window_share)
from epscale.plan.pipeline import paired_items, paired_share
from epscale.plan.step_model import _fsdp_exposure, _paired_exposure, payload_row_bytes

H100 = ClusterSpec(sm_count=132, mem_bw_GBps=3350.0, fp8_tflops=1979.0, layer_overhead_us=0.0)
ROOT = Path(__file__).resolve().parents[1]


def _cfg(dim=1024, hidden=1024, E=8, K=2, seq=2048, layers=2, dense=0, vocab=1024, ep=1):
    return RunConfig(
        model=ModelConfig(vocab_size=vocab, dim=dim, num_layers=layers, num_heads=8, seq_len=seq,
                          dense_hidden_dim=2048, num_dense_layers=dense, tie_embeddings=False),
        moe=MoEConfig(dim=dim, hidden_dim=hidden, num_experts=E, top_k=K),
        parallel=ParallelConfig(ep=ep), train=TrainConfig(micro_batch_size=1))


# ------------------------------------------------------------ GEMM efficiency by shape

def test_gemm_efficiency_rises_with_the_shape_and_approaches_the_large_gemm_rate():
    sizes = 2 ** np.arange(4, 15)                                  # 16 .. 16384
    for axis in range(3):
        shape = [np.full(sizes.shape, 8192.0)] * 3
        shape[axis] = sizes.astype(float)
        eff = gemm_efficiency(H100, *shape)
        assert np.all(np.diff(eff) >= -1e-12), axis                # never falls as it grows
        assert eff[0] < 0.5 * eff[-1]                               # small shapes: far below
        assert np.all(eff <= H100.gemm_efficiency + 1e-12)
    big = float(gemm_efficiency(H100, 16384, 16384, 16384))
    assert 0.98 * H100.gemm_efficiency < big <= H100.gemm_efficiency


def test_tile_and_wave_quantization_and_the_memory_roof():
    # compute-bound: a partial tile costs a whole one (129 rows = 256), a partial wave a
    # whole wave (one tile more than the SMs = two waves)
    N = 132 * 128
    assert gemm_time(H100, 129, N, 8192) == pytest.approx(float(gemm_time(H100, 256, N, 8192)))
    one_wave = float(gemm_time(H100, 12 * 128, 11 * 128, 8192))          # 132 tiles
    assert one_wave == pytest.approx(132 * 2 * 128 * 128 * 8192 / H100.flops_per_s)
    assert float(gemm_time(H100, 12 * 128, 11 * 128 + 1, 8192)) == pytest.approx(2 * one_wave)
    # a one-row GEMM with a short reduction is memory-bound: its bytes at the HBM bandwidth
    M, N, K = 1, 4 * 132 * 128, 128
    assert float(gemm_time(H100, M, N, K)) == pytest.approx(
        ((M * K + K * N) * 2 + M * N * 2) / 3350e9)
    # fp8 halves a large compute-bound GEMM at twice the peak
    t16, t8 = (float(gemm_time(H100, 8192, 8192, 8192, p)) for p in ("bf16", "fp8"))
    assert t8 == pytest.approx(t16 * 989 / 1979)
    with pytest.raises(ConfigError, match="fp8_tflops"):
        gemm_time(ClusterSpec(), 128, 128, 128, "fp8")


# ------------------------------------------------------------ bytes of memory-bound work

def test_memory_bound_work_is_charged_by_its_bytes():
    """Doubling the bandwidth takes off half of the elementwise bytes' time and nothing
    else but the router's input-gradient GEMM (N = E = 8 columns: memory-bound; every
    other GEMM here is compute-bound at both bandwidths)."""
    cfg = _cfg()
    T = cfg.model.seq_len
    fast = dataclasses.replace(H100, mem_bw_GBps=2 * 3350.0)
    parts = elementwise_bytes(cfg, True, fp8=False)
    per_token = 3 * sum(v for k, v in parts.items() if k not in ("permute", "moe_act"))
    expected = T * (cfg.model.num_layers * per_token + loss_bytes(cfg)) / (2 * 3350e9)
    router = [float(gemm_time(c, T, cfg.model.dim, cfg.moe.num_experts)) for c in (H100, fast)]
    expected += cfg.model.num_layers * (router[0] - router[1])
    work = Work()
    saved = nonexpert_time(cfg, H100, T, work) - nonexpert_time(cfg, fast, T, work)
    assert saved == pytest.approx(expected, rel=1e-9)
    # the experts' rows: permute, unpermute and activation, forward and twice backward
    rows, gemms = 16384.0, 8.0
    per_row = (parts["permute"] + parts["moe_act"]) / cfg.moe.top_k
    saved_e = expert_time(cfg, H100, rows, rows, gemms, work)[0] - \
        expert_time(cfg, fast, rows, rows, gemms, work)[0]
    assert saved_e == pytest.approx(rows * 3 * per_row / (2 * 3350e9), rel=1e-9)
    # what is charged: a SwiGLU reads gate and up and writes their product
    assert parts["moe_act"] == cfg.moe.top_k * cfg.moe.hidden_dim * 3 * 2
    assert parts["layernorm"] == 2 * 2 * cfg.model.dim * 2


def test_recomputed_modules_add_their_forward():
    cfg = _cfg(dense=1)
    T = cfg.model.seq_len
    base = nonexpert_time(cfg, H100, T, Work(recompute_modules=()))
    norms = nonexpert_time(cfg, H100, T, Work(recompute_modules=("layernorm",)))
    ln = elementwise_bytes(cfg, True, False)["layernorm"]
    assert norms - base == pytest.approx(T * cfg.model.num_layers * ln / 3350e9, rel=1e-9)
    mlp = nonexpert_time(cfg, H100, T, Work(recompute_modules=("mlp",)))
    fwd = float(gemm_time(H100, T, 2 * 2048, 1024) + gemm_time(H100, T, 1024, 2048))
    assert mlp - base == pytest.approx(fwd, rel=1e-9)            # the one dense layer's FFN
    # recomputing the MoE module runs its forward again: two more transfers, more compute
    moe_cfg = _cfg(E=16, K=2, ep=16)
    cl = dataclasses.replace(H100, nodes=2, gpus_per_node=8)
    r = {mods: simulate(moe_cfg, cl, RoutingSpec.parse("uniform"), strategies=("none",),
                        dispatchers=("dedup",), overlap="none", work=Work(recompute_modules=mods))[0]
         for mods in ((), ("moe",))}
    assert r[("moe",)].expert_comm_s == pytest.approx(1.5 * r[()].expert_comm_s)
    assert r[("moe",)].compute_s > r[()].compute_s
    with pytest.raises(ConfigError, match="recompute module 'everything'"):
        simulate(cfg, H100, work=Work(recompute_modules=("everything",)))


def test_tensor_parallel_splits_the_tokens_and_adds_its_collectives():
    cfg = _cfg(ep=1)
    cl = dataclasses.replace(H100, nodes=1, gpus_per_node=2)
    one, two = (simulate(cfg, cl, RoutingSpec.parse("uniform"), strategies=("none",),
                         dispatchers=("dedup",), overlap="none", work=Work(tp=tp))[0]
                for tp in (1, 2))
    # each of two GPUs holds half the micro-batch's tokens: about twice the tokens per
    # second per GPU of the step, less the sequence-parallel collectives
    assert two.step_time_s < one.step_time_s
    T = cfg.model.seq_len
    assert two.tokens_per_s_per_gpu == pytest.approx(T / 2 / two.step_time_s)
    with pytest.raises(ConfigError, match="tp = 3 is invalid"):
        simulate(cfg, cl, work=Work(tp=3))


# ------------------------------------------------------------ overlap per schedule

def test_dualpipe_pairing_hides_transfers_behind_the_other_chunk():
    """'full' without a pipeline: each forward beside the previous micro-batch's backward
    (parallel.overlap_micro_batches), the step's first forward and last backward alone,
    so one micro-batch's transfers of m stay exposed."""
    m = 4
    cfg = dataclasses.replace(_cfg(E=16, K=4, ep=16, dim=256, hidden=256, seq=512, vocab=256),
                              train=TrainConfig(micro_batch_size=1, grad_accum=m))
    cl = dataclasses.replace(H100, nodes=2, gpus_per_node=8, inter_bw_GBps=1000,
                             intra_bw_GBps=1000, inter_latency_us=0, intra_latency_us=0)
    res = {ov: simulate(cfg, cl, RoutingSpec.parse("uniform"), strategies=("none",),
                        dispatchers=("dedup",), overlap=ov)[0] for ov in ("none", "full")}
    assert res["none"].expert_comm_s > 0
    # fast links: the pairs hide all of theirs
    assert res["full"].expert_comm_s == pytest.approx(res["none"].expert_comm_s / m, rel=1e-9)
    slow = dataclasses.replace(cl, inter_bw_GBps=0.01, intra_bw_GBps=0.01)
    r = {ov: simulate(cfg, slow, RoutingSpec.parse("uniform"), strategies=("none",),
                      dispatchers=("dedup",), overlap=ov)[0] for ov in ("none", "full")}
    # slow links: at most the compute of the paired chunk is taken off each layer
    hidden = r["none"].expert_comm_s - r["full"].expert_comm_s
    assert 0 < hidden <= r["full"].compute_s * (1 + 1e-9)


def test_fp8_payload_shrinks_the_forward_dispatch_only():
    """``parallel.payload: fp8``: the forward dispatch of dedup and hierarchical sends one
    byte per channel (4-aligned) and an fp32 scale per 128 channels; combine and the
    backward stay in the activations' dtype; alltoall cannot send fp8. Without latency a
    transfer's time is its bytes, so the exposed EP time and the bytes sent scale by
    (3 + r) / 4, r = fp8 row / bf16 row (by (4 + 2r) / 6 when the recomputed forward
    dispatches again)."""
    D = 256
    r = (D + 4 * 2) / (2 * D)
    assert payload_row_bytes(dataclasses.replace(_cfg(dim=7168, hidden=256), parallel=ParallelConfig(
        payload="fp8")), "dedup", 2) == 7168 + 4 * 56
    cl = ClusterSpec(nodes=2, gpus_per_node=8, inter_bw_GBps=10, intra_bw_GBps=100,
                     inter_latency_us=0, intra_latency_us=0)
    for ac, ratio in (("none", (3 + r) / 4), ("full", (4 + 2 * r) / 6)):
        res = {}
        for payload in ("bf16", "fp8"):
            cfg = _cfg(E=16, K=4, ep=16, dim=D, hidden=256, seq=512, vocab=256)
            cfg = dataclasses.replace(cfg, parallel=ParallelConfig(ep=16, payload=payload),
                                      train=TrainConfig(micro_batch_size=1, dtype="bfloat16",
                                                        activation_checkpointing=ac))
            assert payload_row_bytes(cfg, "alltoall", 2) == 2 * D
            res[payload] = {x.dispatcher: x for x in simulate(
                cfg, cl, RoutingSpec.parse("uniform"), strategies=("none",), overlap="none")}
        for disp, want in (("dedup", ratio), ("hierarchical", ratio), ("alltoall", 1.0)):
            a, b = res["bf16"][disp], res["fp8"][disp]
            assert a.expert_comm_s > 0 and b.compute_s == pytest.approx(a.compute_s)
            assert b.expert_comm_s / a.expert_comm_s == pytest.approx(want)
            assert b.inter_bytes_per_gpu / a.inter_bytes_per_gpu == pytest.approx(
                (3 + r) / 4 if want < 1 else 1.0)


def test_looped_and_v_schedules_hide_p2p_behind_compute_with_overlap():
    m, T, D = 8, 64, 32
    cfg = lambda schedule, v: RunConfig(  # noqa: E731
        model=ModelConfig(vocab_size=64, dim=D, num_layers=8, num_heads=4, seq_len=T,
                          tie_embeddings=False),
        moe=MoEConfig(dim=D, hidden_dim=48, num_experts=8, top_k=2),
        parallel=ParallelConfig(pp=2, ep=8, pp_schedule=schedule, pp_virtual_stages=v),
        train=TrainConfig(micro_batch_size=1, grad_accum=m))
    cl = ClusterSpec(nodes=2, gpus_per_node=8, inter_bw_GBps=10, inter_latency_us=20)
    def run(c, overlap="full", work=Work()):
        return simulate(c, cl, RoutingSpec.parse("uniform"), strategies=("none",),
                        dispatchers=("dedup",), overlap=overlap, work=work)[0]

    hop = m * (T * D * 4 / 10e9 + 20e-6)
    assert run(cfg("1f1b", 1)).p2p_s == pytest.approx(hop)          # 1F1B: exposed
    for schedule, v in (("interleaved_1f1b", 2), ("dualpipev", 2)):
        c = cfg(schedule, v)
        assert run(c).p2p_s < run(c, "none").p2p_s, schedule        # overlapped: hidden
        assert run(c, "none", Work(p2p_overlap=True)).p2p_s == pytest.approx(run(c).p2p_s)


def test_dispatch_sms_slow_only_the_overlapped_compute():
    work = Work(comm_sms=20)
    assert compute_cluster(H100, work, "none") is H100
    c = compute_cluster(H100, work, "full")
    assert c.sm_count == 112 and c.gemm_tflops == pytest.approx(989 * 112 / 132)
    with pytest.raises(ConfigError, match="comm_sms = 132 is invalid"):
        compute_cluster(H100, Work(comm_sms=132), "full")
    # the same rate per SM: a GEMM of one wave on either takes as long
    assert float(gemm_time(c, 8 * 128, 14 * 128, 8192)) == pytest.approx(
        float(gemm_time(H100, 12 * 128, 11 * 128, 8192)))


def test_presets_use_the_shape_model_and_calibrated_clusters_keep_theirs():
    for name in ("h100-node", "h100-64", "field-report", "h800-2048"):
        cl = load_cluster(name)
        assert cl.sm_count == 132 and cl.mem_bw_GBps > 0 and cl.layer_overhead_us == 0
    for name, bf16 in (("b200-node", 2250.0), ("gb200-nvl72", 2500.0)):    # Blackwell
        cl = load_cluster(name)
        assert (cl.sm_count, cl.gemm_tflops, cl.fp8_tflops, cl.mem_bw_GBps, cl.intra_bw_GBps) \
            == (148, bf16, 2 * bf16, 8000.0, 900.0) and cl.layer_overhead_us == 0
    with pytest.raises(ConfigError, match="cluster key 'sm_count'"):
        ClusterSpec(sm_count=-1)


# ------------------------------------------------------------ the published runs

def test_published_runs_print_a_ratio_for_every_row(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("published", ROOT / "benchmarks" / "published.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["published"] = mod             # its dataclasses look their module up
    spec.loader.exec_module(mod)
    out = tmp_path / "rows.json"
    assert mod.main(["--json", str(out), "--breakdown", "--gemm-check"]) == 0
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert [r["name"] for r in rows] == [run.name for run in mod.RUNS] and len(rows) >= 4
    for r, run in zip(rows, mod.RUNS):
        assert r["published"] > 0 and r["predicted"] > 0
        assert r["ratio"] == pytest.approx(r["predicted"] / r["published"])
        assert f"{r['ratio']:6.2f}" in text and run.name in text
        assert run.source and "'" in run.source      # every figure quoted from its source
        # the step by part adds up to the step (what --breakdown prints as shares)
        assert sum(r["breakdown"].values()) == pytest.approx(r["step_s"], rel=1e-9)
    assert "EPcomm" in text and "bubble" in text
    for g, m, n, k, tflops in mod.DEEPGEMM_GROUPED:      # the GEMM check prints every shape
        assert f"{g:6d} {m:8d} {n:6d} {k:6d} {tflops:10d}" in text
    # Mixtral's 468 TFLOPS in tokens/s by Megatron's own FLOPs formula
    assert rows[0]["published"] == pytest.approx(468e12 / 8.2933e10, rel=1e-3)


# ------------------------------------------------------------ the step by part

def _sim(cfg, cl, work=Work(), overlap="none", disp="dedup"):
    return simulate(cfg, cl, RoutingSpec.parse("uniform"), strategies=("none",),
                    dispatchers=(disp,), overlap=overlap, step_samples=2, work=work)[0]


def test_the_breakdown_adds_up_to_the_step_with_and_without_a_pipeline():
    cl = dataclasses.replace(H100, nodes=2, gpus_per_node=8)
    flat = _cfg(E=16, K=2, ep=16)
    piped = dataclasses.replace(flat, parallel=ParallelConfig(pp=2, ep=8, pp_schedule="1f1b"),
                                train=TrainConfig(micro_batch_size=1, grad_accum=4))
    for cfg in (flat, piped):
        r = _sim(cfg, cl, Work(launch_us=50.0))
        assert sum(r.breakdown.values()) == pytest.approx(r.step_time_s, rel=1e-12)
        assert r.breakdown["expert_gemm"] > 0 and r.breakdown["attention"] > 0
        assert r.breakdown["expert_comm"] == pytest.approx(r.expert_comm_s)
    # the parts of one micro-batch's non-expert work are its time
    parts = nonexpert_parts(flat, H100, 2048, Work())
    assert sum(parts.values()) == pytest.approx(nonexpert_time(flat, H100, 2048, Work()))


def test_grouped_gemm_rate_pays_each_experts_last_tile():
    N = K = 4096
    full = expert_gemm_tflops(H100, 4, 128 * 33, N, K)
    assert expert_gemm_tflops(H100, 4, 128 * 33 + 1, N, K) < full        # one more tile row
    assert full <= H100.gemm_tflops * H100.gemm_efficiency * (1 + 1e-12)


def test_flash_attention_runs_at_its_measured_rates():
    fwd, bwd = attention_time(H100, 1e12)
    assert fwd == pytest.approx(1e12 / (989e12 * ATTN_FWD_EFFICIENCY))
    assert bwd == pytest.approx(ATTN_BWD_FLOPS * 1e12 / (989e12 * ATTN_BWD_EFFICIENCY))
    assert 989e12 * ATTN_FWD_EFFICIENCY == pytest.approx(609e12)          # FA3 paper's cuDNN
    # FlashAttention-2's bars of the same figures, for runs that say they use it
    assert attention_time(H100, 1e12, "fa2") == pytest.approx(
        (1e12 / 368e12, ATTN_BWD_FLOPS * 1e12 / 310e12))
    with pytest.raises(ConfigError, match="attention_kernel 'fa3' is invalid"):
        attention_time(H100, 1e12, "fa3")
    cfg = _cfg()
    slow, fast = (nonexpert_parts(cfg, H100, 2048, Work(attention_kernel=k)) for k in ("fa2", "cudnn"))
    assert slow["attention"] / fast["attention"] == pytest.approx(
        (1 / 368 + ATTN_BWD_FLOPS / 310) / (1 / 609 + ATTN_BWD_FLOPS / 499))
    assert slow["gemm"] == fast["gemm"]
    # heads 64 wide run at the same figures' head-dim-64 bars (cuDNN 408 / 417, FA2 321 /
    # 279), wider ones at the 128 bars
    assert attention_time(H100, 1e12, "cudnn", 64) == pytest.approx(
        (1e12 / 408e12, ATTN_BWD_FLOPS * 1e12 / 417e12))
    assert attention_time(H100, 1e12, "flex", 32) == pytest.approx(
        (1e12 / (0.90 * 321e12), ATTN_BWD_FLOPS * 1e12 / (0.85 * 279e12)))
    assert attention_time(H100, 1e12, "cudnn", 192) == attention_time(H100, 1e12)
    # a model's head width picks them: dim 1024 over 8 heads is 128 wide, over 16 is 64
    narrow = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_heads=16))
    wide_t, narrow_t = (nonexpert_parts(c, H100, 2048, Work())["attention"] for c in (cfg, narrow))
    assert narrow_t / wide_t == pytest.approx(
        (1 / 408 + ATTN_BWD_FLOPS / 417) / (1 / 609 + ATTN_BWD_FLOPS / 499))
    # a calibrated cluster keeps its one rate, the backward twice the forward
    cal = ClusterSpec()
    assert attention_time(cal, 1e12) == pytest.approx((1e12 / cal.flops_per_s,
                                                       2e12 / cal.flops_per_s))


def test_flex_attention_and_a_sliding_window_by_the_tiles_they_compute():
    # FlexAttention at 90% / 85% of FlashAttention-2's forward / backward rates
    assert attention_time(H100, 1e12, "flex") == pytest.approx(
        (1e12 / (0.90 * 368e12), ATTN_BWD_FLOPS * 1e12 / (0.85 * 310e12)))
    cfg = _cfg(seq=4096)                                   # causal: 2048.5 keys a query
    full = nonexpert_parts(cfg, H100, 4096, Work(attention_kernel="flex"))
    # a 128-token window on half the layers: each windowed query block computes two
    # 128-key tiles (its own and the one before), 256 of 2048.5 keys
    half = nonexpert_parts(cfg, H100, 4096, Work(attention_kernel="flex", attention_window=128,
                                                 windowed_layers=0.5))
    assert window_share(Work(attention_window=128, windowed_layers=0.5), 4096) == \
        pytest.approx(0.5 + 0.5 * 256 / 2048.5)
    assert half["attention"] / full["attention"] == pytest.approx(0.5 + 0.5 * 256 / 2048.5)
    assert half["gemm"] == full["gemm"] and half["memory"] == full["memory"]
    # a window of 129 tokens reaches into a third tile; one wider than the context is none
    assert window_share(Work(attention_window=129, windowed_layers=1.0), 4096) == \
        pytest.approx(384 / 2048.5)
    assert window_share(Work(attention_window=8192, windowed_layers=1.0), 4096) == 1.0
    assert window_share(Work(attention_window=128), 4096) == 1.0     # no windowed layers
    with pytest.raises(ConfigError, match="windowed_layers = 1.5 is invalid"):
        nonexpert_parts(cfg, H100, 4096, Work(attention_window=128, windowed_layers=1.5))
    with pytest.raises(ConfigError, match="attention_window = -1 is invalid"):
        window_share(Work(attention_window=-1, windowed_layers=0.5), 4096)


def test_fp8_casts_are_charged_with_the_amax_pass_and_the_transposed_copy():
    cfg = _cfg()
    parts = elementwise_bytes(cfg, True, fp8=True)
    linear_in = sum(i for _, i, _ in attention_linears(cfg))          # no shared experts here
    assert FP8_CAST_BYTES == 2 + 2 + 1 + 1
    assert parts["fp8_cast"] == FP8_CAST_BYTES * linear_in
    assert "fp8_cast" not in elementwise_bytes(cfg, True, fp8=False)


# ------------------------------------------------------------ host-bound layers

def test_a_host_bound_segment_lasts_its_kernels_issue_time():
    assert float(host_bound_time(100, 0.0, 5.0)) == pytest.approx(500e-6)
    assert float(host_bound_time(200, 0.0, 5.0)) == pytest.approx(2 * 500e-6)   # twice the kernels
    assert float(host_bound_time(100, 200e-6, 5.0)) == pytest.approx(300e-6)     # beyond the GPU's
    assert float(host_bound_time(100, 1e-3, 5.0)) == 0.0                        # GPU-bound: nothing
    # each local expert adds its two GEMMs to the forward and four to the backward; fp8
    # an amax and a cast kernel per GEMM input
    cfg = _cfg()
    (f1, b1), (f2, b2) = (kernels_per_layer(cfg, True, e, Work()) for e in (1, 2))
    assert (f2 - f1, b2 - b1) == (2, 4)
    f8, b8 = kernels_per_layer(cfg, True, 2, Work(precision="fp8"))
    assert f8 - f2 == b8 - b2 == 2 * (len(attention_linears(cfg)) + 1 + 2 * 2)


def test_dropless_exchanges_wait_on_the_host_and_fixed_capacity_does_not():
    cl = dataclasses.replace(H100, nodes=1, gpus_per_node=8)
    cfg = _cfg(E=16, K=2, ep=8, dim=256, hidden=256, seq=256, vocab=256)
    slow_host = _sim(cfg, cl, Work(launch_us=100.0))
    assert slow_host.breakdown["launch"] > 0
    assert _sim(cfg, cl, Work(launch_us=0.0)).breakdown["launch"] == 0.0
    # doubling the launch time doubles the issue time; what exceeds the GPU's grows more
    more = _sim(cfg, cl, Work(launch_us=200.0))
    assert more.breakdown["launch"] > 2 * slow_host.breakdown["launch"]
    capped = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=1.0))
    assert _sim(capped, cl, Work(launch_us=100.0)).breakdown["launch"] == 0.0
    with pytest.raises(ConfigError, match="launch_us = -1"):
        _sim(cfg, cl, Work(launch_us=-1.0))


# ------------------------------------------------------------ ZeRO levels

def test_zero_levels_gather_and_reduce_per_step_or_per_micro_batch():
    g, rs, c, layers = 1.0, 2.0, 0.0, 4
    assert _fsdp_exposure(3, 1, g, rs, c, layers) == pytest.approx((4.0 + 4.0 / 3 / 4, 0.0))
    assert _fsdp_exposure(2, 1, g, rs, c, layers) == pytest.approx((2.0 + 2.0 / 3 / 4, 1.25))
    assert _fsdp_exposure(1, 1, g, rs, c, layers) == pytest.approx((0.0, 1.25 + 2.5))
    # under a pipeline the gradients are reduce-scattered once per step at every level
    assert _fsdp_exposure(3, 2, g, rs, c, layers)[1] == _fsdp_exposure(1, 2, g, rs, c, layers)[1]
    assert _fsdp_exposure(1, 2, g, rs, c, layers)[0] == 0.0
    # a long compute hides all but the first / last block's share
    assert _fsdp_exposure(1, 1, g, rs, 100.0, layers) == pytest.approx((0.0, (g + rs) / layers))


def test_zero1_charges_one_gather_per_step_whatever_the_micro_batches():
    cl = dataclasses.replace(H100, nodes=2, gpus_per_node=8, inter_bw_GBps=1.0)
    def run(zero, accum):
        cfg = _cfg(E=16, K=2, ep=8)
        cfg = dataclasses.replace(
            cfg, parallel=ParallelConfig(ep=8, fsdp=True, zero=zero),
            train=TrainConfig(micro_batch_size=1, grad_accum=accum))
        return _sim(cfg, cl).fsdp_comm_s

    assert run(1, 4) == pytest.approx(run(1, 1), rel=1e-9)        # once per step
    assert run(3, 4) == pytest.approx(4 * run(3, 1), rel=1e-9)    # every micro-batch
    assert run(1, 4) < run(3, 4)


def test_the_recipes_recompute_modules_are_charged():
    cfg = _cfg(dense=1)
    T = cfg.model.seq_len
    for config_name, megatron_name in (("norm", "layernorm"), ("mlp", "mlp"),
                                       ("attention_core", "core_attn")):
        recipe = dataclasses.replace(cfg, train=TrainConfig(micro_batch_size=1,
                                                           recompute_modules=[config_name]))
        assert nonexpert_time(recipe, H100, T, Work()) == pytest.approx(
            nonexpert_time(cfg, H100, T, Work(recompute_modules=(megatron_name,))), rel=1e-12)
        assert nonexpert_time(recipe, H100, T, Work()) > nonexpert_time(cfg, H100, T, Work())


def test_simulate_cli_takes_the_config_names_of_recomputed_modules():
    """`simulate --recompute-modules` takes train.recompute_modules' names (norm,
    attention_core, ...) as well as Megatron's, which the step model uses."""
    import argparse

    from epscale.commands import simulate as cmd

    p = argparse.ArgumentParser()
    cmd.configure_parser(p)
    args = p.parse_args(["cfg.yaml", "--recompute-modules", "norm,attention_core,mla_up_proj"])
    assert cmd.work_of(args).recompute_modules == ("layernorm", "core_attn", "mla_up_proj")
    args = p.parse_args(["cfg.yaml", "--recompute-modules", "layernorm"])
    assert cmd.work_of(args).recompute_modules == ("layernorm",)


def test_a_blocking_recipe_is_modelled_without_overlap():
    """parallel.overlap: none is the trainer's blocking path: the step model's default
    overlap follows it (chunks only pipeline with overlap auto)."""
    from epscale.config import load_recipe
    from epscale.plan.cluster import load_cluster
    from epscale.plan.step_model import simulate

    cfg = load_recipe("deepseek-v3", ["parallel.overlap_chunks=4"])
    cluster = load_cluster("h800-2048")
    auto = simulate(cfg, cluster, dispatchers=("dedup",))[0]
    blocking = simulate(load_recipe("deepseek-v3", ["parallel.overlap_chunks=4",
                                                    "parallel.overlap=none"]),
                        cluster, dispatchers=("dedup",))[0]
    assert (auto.overlap, blocking.overlap) == ("chunks", "none")
    assert blocking.step_time_s > auto.step_time_s


def test_fp8_activation_storage_charges_its_casts_by_bytes():
    """train.activation_storage: fp8 moves FP8_STORE_BYTES per stored element of each
    routed row (input and output rows, the activation's inputs, and its output unless
    moe_act is recomputed) through memory: the expert memory time grows by exactly that."""
    import numpy as np

    from epscale.config import load_recipe
    from epscale.plan.cluster import load_cluster
    from epscale.plan.shapes import FP8_STORE_BYTES, Work, expert_parts

    cl = load_cluster("h100-64")
    rows, padded, gemms = np.array([4096.0]), np.array([4096.0]), np.array([8.0])

    def memory(*over):
        cfg = load_recipe("qwen3-30b-a3b", ["train.activation_checkpointing=none", *over])
        return expert_parts(cfg, cl, rows, padded, gemms, Work())["memory"][0]

    D, F = 2048, 768
    bw = cl.mem_bw_GBps * 1e9
    light = ("train.recompute_modules=[moe_act]",)
    assert memory("train.activation_storage=fp8") - memory() == pytest.approx(
        4096 * FP8_STORE_BYTES * (2 * D + 2 * F + F) / bw)
    assert memory("train.activation_storage=fp8", *light) - memory(*light) == pytest.approx(
        4096 * FP8_STORE_BYTES * (2 * D + 2 * F) / bw)


def test_the_chunked_loss_charges_the_heads_logits_again_in_backward():
    """epscale's chunked head loss computes each chunk's logits again in backward (once,
    twice under a split backward); a run that keeps its logits does not."""
    from epscale.plan.shapes import head_recompute_time, head_recomputes
    cfg = _cfg(vocab=65536, layers=4)
    T = cfg.model.seq_len
    split = dataclasses.replace(cfg, parallel=ParallelConfig(pp=2, pp_schedule="dualpipev",
                                                           pp_virtual_stages=2))
    plain = dataclasses.replace(cfg, parallel=ParallelConfig(pp=2, pp_schedule="1f1b"))
    assert head_recomputes(cfg, Work(head_loss="full")) == 0
    assert [head_recomputes(c, Work()) for c in (cfg, plain, split)] == [1, 1, 2]
    logits = float(gemm_time(H100, T, 65536, 1024))                  # [T, D] x [D, V] forward
    assert head_recompute_time(cfg, H100, T, Work()) == pytest.approx(logits, rel=1e-12)
    assert head_recompute_time(split, H100, T, Work(mtp_depth=1)) == pytest.approx(4 * logits)
    kept = nonexpert_parts(cfg, H100, T, Work(head_loss="full"))
    chunked = nonexpert_parts(cfg, H100, T, Work())
    assert chunked["recompute"] - kept["recompute"] == pytest.approx(logits, rel=1e-12)
    assert {k: v for k, v in chunked.items() if k != "recompute"} == \
        {k: v for k, v in kept.items() if k != "recompute"}
    with pytest.raises(ConfigError, match="head_loss 'fused' is invalid"):
        head_recomputes(cfg, Work(head_loss="fused"))
    # the step: without a pipeline every micro-batch pays it; under one, the rank holding
    # the head's stage (here the slowest: a large vocabulary on the last of two stages)
    cl = dataclasses.replace(H100, nodes=1, gpus_per_node=8)
    flat = dataclasses.replace(_cfg(vocab=65536, layers=4, E=16, ep=8),
                               train=TrainConfig(micro_batch_size=1, grad_accum=4))
    piped = dataclasses.replace(flat, parallel=ParallelConfig(pp=2, ep=4, pp_schedule="1f1b"))
    # 4 micro-batches; 1F1B's step is (m + p - 1) of its slowest rank's micro-batches
    for c, passes in ((flat, 4), (piped, 4 + 1)):
        r = {h: _sim(c, cl, Work(head_loss=h)) for h in ("full", "chunked")}
        extra = r["chunked"].step_time_s - r["full"].step_time_s
        assert extra == pytest.approx(passes * logits, rel=1e-6), c.parallel


def _two_streams(compute: list[float], comm: list[float]) -> float:
    """One paired layer run event by event on a compute and a communication stream, in
    Megatron-Core's issue order (F.attn, B.combine, F.dispatch, B.expert, B.dispatch,
    F.expert, F.combine, B.attn): each op waits for the one before it on its own stream
    and for its input on the other (F.dispatch for F.attn, B.expert for B.combine, and so
    on). Returns when both streams are done."""
    comp_end = comm_end = 0.0
    for k in range(4):
        # op k on either stream waits for op k - 1 on both: its own stream's, and its
        # input from the other (F.dispatch waits F.attn, B.expert waits B.combine, ...)
        start = max(comp_end, comm_end)
        comm_end, comp_end = start + comm[k], start + compute[k]
    return max(comp_end, comm_end)


def test_paired_layers_hide_each_transfer_behind_one_segment_of_the_other_pass():
    """DualPipe's pairing as Megatron-Core's combined 1F1B issues it: the forward's
    attention beside the backward's combine, the backward's experts beside the forward's
    dispatch, the forward's experts beside the backward's dispatch, the backward's
    attention beside the forward's combine. The exposed time is what an event-by-event
    run of the two streams adds to the compute, for any sizes; a transfer longer than
    its segment is exposed even where the pass as a whole could hide it."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        comm, disp = rng.uniform(0.0, 2.0, 2)
        experts, attn = rng.uniform(0.0, 6.0, 2)
        got = float(_paired_exposure(np.float64(comm), np.float64(disp), np.float64(experts),
                                     attn, 4, 0.0))
        compute = [attn / 3, experts * 2 / 3, experts / 3, attn * 2 / 3]
        ran = _two_streams(compute, [comm, disp, comm, comm])
        assert got == pytest.approx(ran - (experts + attn), abs=1e-12)
    # short attention: its two transfers are exposed although the backward alone
    # (6 of experts + 0.2 of attention) is longer than the forward's two transfers
    assert float(_paired_exposure(1.0, 1.0, 9.0, 0.3, 4, 0.0)) == pytest.approx(0.9 + 0.8)
    # a recomputed forward's two transfers (6 in all) take what the phases leave free
    assert float(_paired_exposure(1.0, 1.0, 9.0, 0.3, 6, 0.0)) == pytest.approx(1.7)
    assert float(_paired_exposure(1.0, 1.0, 1.5, 0.3, 6, 0.0)) == pytest.approx(
        6.0 - (0.1 + 1.0 + 0.5 + 0.2))


def test_the_forwards_without_a_partner_are_the_warm_up_and_one_more():
    """Paired overlap ('full'): without a pipeline every forward but the step's first has
    a partner; GPipe none; 1F1B and the looped schedules every forward after the warm-up
    but one (Megatron-Core's combined 1F1B moves one more forward into the warm-up);
    DualPipeV the pairs torch's schedule emits."""
    assert paired_share("1f1b", 1, 8, 1, 0) == 7 / 8
    assert paired_share("gpipe", 4, 8, 1, 0) == 0.0
    for rank, warm in ((0, 3), (3, 0)):
        assert paired_share("1f1b", 4, 8, 1, rank) == (8 - warm - 1) / 8
    # interleaved, v = 2 at p = 4: a warm-up of (v - 1) p + 2 (p - 1 - r) forwards
    assert paired_share("interleaved_1f1b", 4, 8, 2, 0) == (16 - 10 - 1) / 16
    assert paired_share("interleaved_1f1b", 4, 8, 2, 3) == (16 - 4 - 1) / 16
    for rank in range(4):
        items = paired_items("dualpipev", 4, 16, 2, rank)
        pairs = sum(len(i) == 2 for i in items)
        assert 0 < pairs < 32 and paired_share("dualpipev", 4, 16, 2, rank) == pairs / 32
    # more micro-batches amortise the warm-up
    assert paired_share("interleaved_1f1b", 4, 32, 2, 0) > paired_share("interleaved_1f1b", 4, 8, 2, 0)


def test_a_pipelines_paired_overlap_leaves_its_warm_up_exposed():
    """Under a pipeline with paired overlap, the rank's forwards without a partner run
    their transfers exposed: more micro-batches leave less exposed per micro-batch, and a
    step at any count lies between all paired and none."""
    def run(m, overlap="full"):
        cfg = RunConfig(
            model=ModelConfig(vocab_size=64, dim=32, num_layers=8, num_heads=4, seq_len=64,
                              tie_embeddings=False),
            moe=MoEConfig(dim=32, hidden_dim=48, num_experts=8, top_k=2),
            parallel=ParallelConfig(pp=2, ep=8, pp_schedule="interleaved_1f1b",
                                    pp_virtual_stages=2),
            train=TrainConfig(micro_batch_size=1, grad_accum=m))
        cl = ClusterSpec(nodes=2, gpus_per_node=8, inter_bw_GBps=1, intra_bw_GBps=1,
                         inter_latency_us=20)
        return simulate(cfg, cl, RoutingSpec.parse("uniform"), strategies=("none",),
                        dispatchers=("dedup",), overlap=overlap)[0]

    few, many = run(4), run(32)
    assert few.expert_comm_s / 4 > many.expert_comm_s / 32 > 0
    assert few.expert_comm_s < run(4, "none").expert_comm_s
