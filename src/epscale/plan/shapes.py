"""The step model by shape: the time of each GEMM from its (M, N, K), and the memory-bound
work (norms, activations, permutes, router, loss, fp8 casts, optimizer) from the bytes it
moves (torch-free; :mod:`epscale.plan.step_model` reads it).

Legend: T tokens of one micro-batch on one GPU, D model dim, F expert hidden, E experts,
K top-k, V vocabulary, M/N/K of a GEMM: C[M, N] = A[M, K] @ B[K, N].

GEMM time is a roofline over the tiles a GEMM kernel really computes (NVIDIA, "Matrix
Multiplication Background User's Guide", docs.nvidia.com/deeplearning/performance/
dl-performance-matrix-multiplication: *tile quantization* and *wave quantization*):

* the output is computed in ``gemm_tile_m x gemm_tile_n`` tiles, one thread block each:
  a dimension that is not a multiple of the tile still pays for the whole last tile;
* the tiles run in waves of ``sm_count`` (one per SM): the last, partly filled wave costs
  as much as a full one;
* a full tile runs at ``gemm_tflops x gemm_efficiency`` (the rate large GEMMs reach), so
  large shapes approach that rate and small ones fall below it;
* the GEMM cannot beat its memory traffic either, ``(M K + K N) x in-bytes + M N x
  out-bytes`` at ``mem_bw_GBps``: thin GEMMs (few rows per expert) are memory-bound.

fp8 is a rate option: the linear layers' GEMMs run at ``fp8_tflops`` with 1-byte inputs,
and every input is cast first (:data:`FP8_CAST_BYTES`: charged as memory-bound work).
Attention's core (flash attention: QK^T and PV) is charged by its FLOPs at flash
attention's measured forward and backward rates by head width (:data:`ATTN_KERNELS`). The kernels
a layer launches (:func:`kernels_per_layer`) bound how fast a host can feed it after a host
sync (:func:`host_bound_time`). A cluster without ``sm_count`` (a CPU calibrated by ``epscale calibrate``)
keeps the calibrated model: one rate, ``gemm_half_rows`` extra rows per expert GEMM.

Memory-bound work is charged by bytes at ``mem_bw_GBps`` (the forward's bytes per token
in :func:`elementwise_bytes`, the backward twice those: it reads the saved input and the
output gradient and writes the input gradient). Without ``mem_bw_GBps`` the calibrated
``layer_overhead_us`` per layer and pass stands for it instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ..config import ConfigError, RunConfig
from ..config.schema import SPLIT_BACKWARD_SCHEDULES
from .cluster import ClusterSpec
from .sizing import _ffn_mats, attention_flops_per_token, head_dim

PRECISIONS = ("bf16", "fp8")
# Bytes per element of casting one GEMM input to fp8 with a scale computed from the tensor
# itself (Transformer Engine's current scaling; DeepSeek-V3's 1x128 / 128x128 blocks alike):
# one pass reads the bf16 tensor for its amax (2 bytes), a second reads it again and writes
# the fp8 copy (1) and, on Hopper, the transposed fp8 copy the backward GEMMs need (1)
# (Transformer Engine docs, "FP8 Current Scaling" and "Performance considerations:
# handling transposes": Hopper's fp8 GEMMs take only TN layouts).
FP8_CAST_BYTES = 6.0
# train.activation_storage: fp8 (epscale.moe.saved_fp8) per stored element: the forward
# reads the bf16 value (2) and writes its fp8 copy (1) and 1x128 tile scale (4 / 128); the
# backward reads that back (1 + 4 / 128) and writes the bf16 value again (2).
FP8_STORE_BYTES = 2 + 1 + 4 / 128 + 1 + 4 / 128 + 2
# Flash attention's rates on H100 SXM at sequence 4k, as fractions of the dense bf16 peak
# (989 TFLOP/s), by head dim: Shah et al., "FlashAttention-3", arXiv 2407.08608, figures
# "Attention forward/backward speed, head dim 64 / 128 (H100 80GB SXM5)" (the forward's
# figures without the causal mask, as the backward's). cuDNN's kernels (what Megatron-Core
# runs through Transformer Engine): forward 609 / backward 499 TFLOP/s at head dim 128, 408
# / 417 at 64, where the backward counts 2.5 times the forward's FLOPs (it recomputes
# QK^T). FlashAttention-2's bars of the same figures (``Work.attention_kernel = "fa2"``: runs
# that say they use it): 368 / 310 at 128, 321 / 279 at 64. Heads up to 64 wide run at the
# 64 rates, wider ones (MLA's 192, 256) at the 128 rates.
ATTN_RATES_TFLOPS = {"cudnn": {64: (408.0, 417.0), 128: (609.0, 499.0)},
                     "fa2": {64: (321.0, 279.0), 128: (368.0, 310.0)}}
ATTN_FWD_EFFICIENCY = 609.0 / 989.0
ATTN_BWD_EFFICIENCY = 499.0 / 989.0
# PyTorch's FlexAttention (``"flex"``) at FlashAttention-2's rates times what its authors
# measured against FlashAttention-2: "FlexAttention achieves 90% of FlashAttention2's
# performance in the forward pass and 85% in the backward pass" (PyTorch blog "FlexAttention:
# The Flexibility of PyTorch with the Performance of FlashAttention", 2024-08-07, causal
# attention on A100; no H100 figure is published, so the ratios are carried over).
ATTN_KERNELS = {k: {hd: (f / 989.0, b / 989.0) for hd, (f, b) in by_width.items()}
                for k, by_width in ATTN_RATES_TFLOPS.items()}
ATTN_KERNELS["flex"] = {hd: (0.90 * f, 0.85 * b) for hd, (f, b) in ATTN_KERNELS["fa2"].items()}
# The key/value tile of a flash-attention kernel (FlexAttention's default BlockMask block,
# 128 x 128): a sliding window is computed in whole tiles, the tiles outside it skipped.
ATTN_KV_TILE = 128
ATTN_BWD_FLOPS = 2.5
# Host time to issue one kernel: "usually, the launch time on the CPU side is between 5-20
# microseconds" (Meta's Holistic Trace Analysis docs, "CUDA kernel launch statistics"); the
# low end, the runtime call alone (the framework's Python above it only adds).
HOST_LAUNCH_US = 5.0
RECOMPUTE_MODULES = ("layernorm", "mla_up_proj", "moe_act", "core_attn", "mlp", "moe", "router",
                     "shared_experts")


def _peak(cluster: ClusterSpec, precision: str) -> float:
    """Dense tensor-core FLOP/s of the linear layers' GEMMs at ``precision``."""
    if precision == "fp8":
        if not cluster.fp8_tflops:
            raise ConfigError(f"precision 'fp8' needs the cluster's fp8_tflops (cluster "
                              f"'{cluster.name}' has none): set it, or use bf16")
        return cluster.fp8_tflops * 1e12
    return cluster.gemm_tflops * 1e12


def gemm_time(cluster: ClusterSpec, M, N, K, precision: str = "bf16", out_bytes: int = 2):
    """Seconds of one GEMM C[M, N] = A[M, K] @ B[K, N] (arrays broadcast), by the module
    docstring's roofline. Without ``sm_count`` the cluster's flat rate."""
    M, N, K = (np.asarray(x, dtype=np.float64) for x in (M, N, K))
    rate = _peak(cluster, precision) * cluster.gemm_efficiency
    flops = 2.0 * M * N * K
    if not cluster.sm_count:
        return flops / rate
    tm, tn = cluster.gemm_tile_m, cluster.gemm_tile_n
    tiles = np.ceil(M / tm) * np.ceil(N / tn)
    waves = np.ceil(tiles / cluster.sm_count)
    compute = waves * cluster.sm_count * (2.0 * tm * tn * K) / rate
    in_bytes = 1 if precision == "fp8" else 2
    memory = ((M * K + K * N) * in_bytes + M * N * out_bytes) / (cluster.mem_bw_GBps * 1e9) \
        if cluster.mem_bw_GBps else 0.0
    return np.where(flops > 0, np.maximum(compute, memory), 0.0)


def gemm_efficiency(cluster: ClusterSpec, M, N, K, precision: str = "bf16"):
    """Achieved / peak FLOP rate of one GEMM (what the tests check for monotony)."""
    t = gemm_time(cluster, M, N, K, precision)
    return 2.0 * np.asarray(M, float) * N * K / t / _peak(cluster, precision)


def train_gemms_time(cluster: ClusterSpec, M: float, N: float, K: float, precision: str) -> float:
    """Forward, input-gradient and weight-gradient GEMMs of one linear layer on M rows
    (weight K x N): (M, N, K), (M, K, N) and (K, N, M), the weight gradient in fp32."""
    return float(gemm_time(cluster, M, N, K, precision) + gemm_time(cluster, M, K, N, precision)
                 + gemm_time(cluster, K, N, M, precision, out_bytes=4))


def attention_linears(run_cfg: RunConfig) -> list[tuple[str, int, int]]:
    """(name, in, out) of one attention block's weight matrices (as :mod:`.sizing` counts)."""
    m = run_cfg.model
    D, H = m.dim, m.num_heads
    if m.attention == "mla":
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        out = [("wkv_a", D, m.kv_lora_rank + m.qk_rope_head_dim),
               ("wkv_b", m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim)),
               ("wo", H * m.v_head_dim, D)]
        if m.q_lora_rank > 0:
            return [("wq_a", D, m.q_lora_rank), ("wq_b", m.q_lora_rank, H * qk)] + out
        return [("wq", D, H * qk)] + out
    hd, kv = head_dim(m), m.num_kv_heads or m.num_heads
    return [("wqkv", D, (H + 2 * kv) * hd), ("wo", H * hd, D)]


@dataclass(frozen=True)
class Work:
    """Knobs of one simulated run that the recipe does not carry (the published runs'
    features the trainer lacks are modelled through them): ``precision`` of the linear
    layers' GEMMs, ``tp`` tensor-parallel ranks of the non-expert blocks (Megatron's
    sequence parallelism: each holds T / tp tokens outside attention and the dense FFNs,
    experts are not split), ``recompute_modules`` (Megatron's names; ``None``: the
    recipe's ``train.recompute_modules``, else its ``train.activation_checkpointing``:
    :func:`recomputed_modules`), ``comm_sms`` SMs the overlapped dispatch
    kernels hold (:func:`compute_cluster`), ``p2p_overlap``: a looped or V pipeline hides
    its p2p behind compute even where the expert transfers are not overlapped (Megatron's
    interleaved schedule), ``launch_us`` the host's time to issue one kernel
    (:func:`host_bound_time`), ``mtp_depth`` DeepSeek-V3's multi-token-prediction modules
    (:func:`epscale.plan.pipeline.with_mtp`: a block, a 2 D -> D projection and a head pass
    each, on the last stage; ``None``: the recipe's ``model.mtp_depth``, what the trainer
    builds: :func:`resolve_work`), ``attention_kernel`` whose measured rates the attention's core
    runs at (:data:`ATTN_KERNELS`), ``head_loss`` how the output head and its loss run
    (:data:`HEAD_LOSSES`: epscale's trainer ``chunked``, frameworks that keep the logits
    ``full``), ``attention_window`` tokens a query attends back to on ``windowed_layers``
    (a share, 0 to 1) of the layers (sliding-window attention, e.g. GPT-OSS's 128-token
    band on every other layer: :func:`window_share`; 0: every layer attends its whole causal
    context)."""

    precision: str = "bf16"
    tp: int = 1
    recompute_modules: tuple[str, ...] | None = None
    comm_sms: int = 0
    p2p_overlap: bool = False
    launch_us: float = HOST_LAUNCH_US
    mtp_depth: int | None = None
    attention_kernel: str = "cudnn"
    head_loss: str = "chunked"
    attention_window: int = 0
    windowed_layers: float = 0.0


def resolve_work(run_cfg: RunConfig, work: Work) -> Work:
    """``work`` with the knobs it leaves to the recipe filled in from it: ``mtp_depth``
    None -> ``model.mtp_depth`` (a published run's modules given as ``Work(mtp_depth=1)``
    on a recipe without them are charged the same as the recipe's own)."""
    if work.mtp_depth is None:
        return replace(work, mtp_depth=run_cfg.model.mtp_depth)
    return work


# How a run computes the output head and its loss: "chunked" as epscale's trainer
# (epscale.head_loss: chunks of tokens, no [T, V] logits kept, each chunk's logits computed
# again in backward), "full" the logits kept for backward (Megatron-Core and most others).
HEAD_LOSSES = ("chunked", "full")


def head_recomputes(run_cfg: RunConfig, work: Work) -> int:
    """How many times backward runs the output head's logits GEMM again per micro-batch:
    none where the run keeps the logits (``work.head_loss`` "full"); under epscale's chunked
    loss once, and once in each half of a split backward (inputs' gradients, then weights':
    the split schedules of :data:`SPLIT_BACKWARD_SCHEDULES` under a pipeline)."""
    if work.head_loss not in HEAD_LOSSES:
        raise ConfigError(f"head_loss '{work.head_loss}' is invalid: must be one of "
                          f"{', '.join(HEAD_LOSSES)}")
    if work.head_loss == "full":
        return 0
    par = run_cfg.parallel
    return 2 if par.pp > 1 and par.pp_schedule in SPLIT_BACKWARD_SCHEDULES else 1


def head_recompute_time(run_cfg: RunConfig, cluster: ClusterSpec, T: float,
                        work: Work) -> float:
    """Seconds per micro-batch that backward spends computing the output heads' logits
    again (:func:`head_recomputes`; with ``work.mtp_depth`` each multi-token-prediction
    module's head pass too), on a GPU holding T tokens."""
    again = head_recomputes(run_cfg, work)
    if not again:
        return 0.0
    m = run_cfg.model
    heads = 1 + (work.mtp_depth or 0)
    return again * heads * float(gemm_time(cluster, T * work.tp, m.vocab_size / work.tp,
                                           m.dim, "bf16"))


def compute_cluster(cluster: ClusterSpec, work: Work, overlap: str) -> ClusterSpec:
    """The cluster as compute sees it: while dispatch kernels run beside the compute
    (``overlap`` chunks or full) they hold ``work.comm_sms`` of the SMs (DeepSeek-V3's
    report: 20 of the H800's 132), so GEMM waves have fewer SMs at the same rate per SM."""
    if work.comm_sms < 0 or (cluster.sm_count and work.comm_sms >= cluster.sm_count):
        raise ConfigError(f"comm_sms = {work.comm_sms} is invalid: must be >= 0 and below the "
                          f"cluster's sm_count ({cluster.sm_count})")
    if not work.comm_sms or overlap == "none" or not cluster.sm_count:
        return cluster
    keep = (cluster.sm_count - work.comm_sms) / cluster.sm_count
    return replace(cluster, sm_count=cluster.sm_count - work.comm_sms,
                   gemm_tflops=cluster.gemm_tflops * keep, fp8_tflops=cluster.fp8_tflops * keep)


def elementwise_bytes(run_cfg: RunConfig, moe_layer: bool, fp8: bool) -> dict[str, float]:
    """Forward bytes per token of one layer's memory-bound work, by part (bf16 activations:
    2 bytes, router in fp32). Per routed row (x K): the permute writes the row and the
    unpermute reads it, the activation reads 2 F (gate, up) and writes F."""
    m, moe = run_cfg.model, run_cfg.moe
    D, a = m.dim, 2.0
    out = {"layernorm": 2 * 2 * D * a,                  # two RMSNorms: read D, write D
           "residual": 2 * 3 * D * a}                   # two adds: read 2 D, write D
    if m.attention == "mla":
        rope = m.num_heads * m.qk_rope_head_dim + m.qk_rope_head_dim
        out["mla_norms"] = 2 * (m.q_lora_rank + m.kv_lora_rank) * a
    else:
        rope = (m.num_heads + (m.num_kv_heads or m.num_heads)) * head_dim(m)
    out["rope"] = 2 * rope * a
    mats = _ffn_mats(moe.activation)
    act = (3 if mats == 3 else 2) * a                   # swiglu: read 2, write 1
    if moe_layer:
        K, F = moe.top_k, moe.hidden_dim
        out["router"] = 3 * moe.num_experts * 4.0 + K * 8.0   # scores, softmax/top-k in fp32
        out["permute"] = 2 * (1 + K) * D * a             # dispatch permute + combine unpermute
        out["moe_act"] = K * F * act
        out["shared_act"] = moe.shared_width * act
        # the routed experts' inputs are cast per row (:func:`expert_time`); the router
        # stays in bf16
        linear_in = (D + moe.shared_width) * (moe.shared_width > 0)
    else:
        out["mlp_act"] = m.dense_hidden_dim * act
        linear_in = D + m.dense_hidden_dim
    linear_in += sum(i for _, i, _ in attention_linears(run_cfg))
    if fp8:                          # each GEMM input cast to fp8 (:data:`FP8_CAST_BYTES`)
        out["fp8_cast"] = FP8_CAST_BYTES * linear_in
    return out


def loss_bytes(run_cfg: RunConfig) -> float:
    """Bytes per token of the output layer's memory-bound work, fwd + bwd: the bf16 logits
    written and read into an fp32 softmax and cross-entropy, and their gradient."""
    return 16.0 * run_cfg.model.vocab_size


def optimizer_bytes_per_param(run_cfg: RunConfig) -> float:
    """AdamW step per parameter: read the fp32 weight, gradient and two moments, write the
    weight, the moments and the bf16 copy."""
    return 4 * 4 + 3 * 4 + 2


# train.recompute_modules' names (epscale.parallel.activation) -> Megatron-Core's, which
# ``Work.recompute_modules`` and this module use
CONFIG_RECOMPUTE = {"norm": "layernorm", "attention_core": "core_attn", "mlp": "mlp",
                    "moe_act": "moe_act", "mla_up_proj": "mla_up_proj", "router": "router",
                    "shared_experts": "shared_experts"}


def recomputed_modules(work: Work, run_cfg: RunConfig) -> tuple[str, ...] | None:
    """The modules whose forward runs again in backward, in Megatron's names: ``work``'s
    where it says them, else the recipe's ``train.recompute_modules`` (mapped by
    :data:`CONFIG_RECOMPUTE`), else None (``train.activation_checkpointing`` decides)."""
    if work.recompute_modules is not None:
        return tuple(work.recompute_modules)
    mods = run_cfg.train.recompute_modules
    if mods:
        return tuple(CONFIG_RECOMPUTE[m] for m in mods)
    return None


def _recomputed(work: Work, run_cfg: RunConfig, name: str) -> bool:
    """Whether module ``name``'s forward runs again in backward."""
    mods = recomputed_modules(work, run_cfg)
    if mods is not None:
        return name in mods
    return run_cfg.train.activation_checkpointing == "selective" and name in ("layernorm", "moe_act")


def _linears(run_cfg: RunConfig, moe_layer: bool) -> list[tuple[str, int, int, str]]:
    """(module, in, out, how tensor parallelism splits it: 'n' columns, 'k' rows, '-' not)
    of one layer's non-expert weight matrices; the fused gate/up counts as one."""
    m, moe = run_cfg.model, run_cfg.moe
    mats = _ffn_mats(moe.activation)
    split = {"wq_a": "-", "wkv_a": "-", "wo": "k"}
    out = [("mla_up_proj" if n in ("wq_b", "wkv_b") else "attn", i, o, split.get(n, "n"))
           for n, i, o in attention_linears(run_cfg)]
    if moe_layer:
        out.append(("router", m.dim, moe.num_experts, "-"))
        if moe.shared_width:
            out += [("shared", m.dim, (mats - 1) * moe.shared_width, "n"),
                    ("shared", moe.shared_width, m.dim, "k")]
    else:
        out += [("mlp", m.dim, (mats - 1) * m.dense_hidden_dim, "n"),
                ("mlp", m.dense_hidden_dim, m.dim, "k")]
    return out


def attention_time(cluster: ClusterSpec, fwd_flops: float, kernel: str = "cudnn",
                   head_width: int = 128) -> tuple[float, float]:
    """(forward, backward) seconds of flash attention's core of ``fwd_flops`` forward
    FLOPs over heads ``head_width`` wide (the query-key width): at ``kernel``'s measured
    rates (:data:`ATTN_KERNELS`, those of head dim 64 up to 64, else of 128) on a cluster
    with ``sm_count``, else the calibrated large-GEMM rate (backward twice the forward)."""
    if kernel not in ATTN_KERNELS:
        raise ConfigError(f"attention_kernel '{kernel}' is invalid: must be one of "
                          f"{', '.join(ATTN_KERNELS)}")
    if not cluster.sm_count:
        t = fwd_flops / cluster.flops_per_s
        return t, 2 * t
    peak = cluster.gemm_tflops * 1e12
    fwd_eff, bwd_eff = ATTN_KERNELS[kernel][64 if head_width <= 64 else 128]
    return fwd_flops / (peak * fwd_eff), ATTN_BWD_FLOPS * fwd_flops / (peak * bwd_eff)


def window_share(work: Work, seq_len: int) -> float:
    """The attention core's FLOPs under ``work``'s sliding window, as a share of full causal
    attention's, averaged over the layers: a windowed layer computes, per query, the
    key/value tiles (:data:`ATTN_KV_TILE`) that hold its window, ``ceil(W / tile) + 1`` of
    them (a tile-aligned block of queries reaches back W keys), at most its causal context;
    the other layers their whole causal context, ``(S + 1) / 2`` keys on average."""
    W, share = work.attention_window, work.windowed_layers
    if not (isinstance(W, int) and not isinstance(W, bool) and W >= 0):
        raise ConfigError(f"attention_window = {W!r} is invalid: must be a whole number of "
                          "tokens >= 0 (0: no sliding window)")
    if not 0.0 <= share <= 1.0:
        raise ConfigError(f"windowed_layers = {share!r} is invalid: must be the share of the "
                          "layers with a sliding window, 0 to 1")
    if W == 0 or share == 0.0:
        return 1.0
    causal = (seq_len + 1) / 2
    windowed = min(causal, (math.ceil(W / ATTN_KV_TILE) + 1) * ATTN_KV_TILE)
    return 1.0 - share + share * windowed / causal


def _layer_parts(run_cfg: RunConfig, cluster: ClusterSpec, T: float, work: Work,
                 moe_layer: bool) -> dict[str, float]:
    """Seconds of one layer's non-expert work, fwd + bwd (+ the modules recomputed), on a
    GPU holding T tokens of the micro-batch (T x tp under tensor parallelism), by part:
    ``gemm`` the linear layers, ``attention`` flash attention's core, ``memory`` the
    memory-bound work by its bytes, ``recompute`` the forwards run again, ``tp_comm`` the
    sequence-parallel collectives."""
    tp = work.tp
    full = T * tp
    out = dict(gemm=0.0, attention=0.0, memory=0.0, recompute=0.0, tp_comm=0.0)
    for module, k, n, how in _linears(run_cfg, moe_layer):
        prec = "bf16" if module == "router" else work.precision
        M, N, K = (T, n, k) if how == "-" or tp == 1 else \
            (full, n / tp, k) if how == "n" else (full, n, k / tp)
        out["gemm"] += train_gemms_time(cluster, M, N, K, prec)
        again = _recomputed(work, run_cfg, "shared_experts" if module == "shared" else module) \
            or (module in ("router", "shared") and _recomputed(work, run_cfg, "moe"))
        if again:
            out["recompute"] += float(gemm_time(cluster, M, N, K, prec))
    m = run_cfg.model
    width = m.qk_nope_head_dim + m.qk_rope_head_dim if m.attention == "mla" else head_dim(m)
    fwd_attn, bwd_attn = attention_time(
        cluster, T * attention_flops_per_token(m) * window_share(work, m.seq_len),
        work.attention_kernel, width)
    out["attention"] = fwd_attn + bwd_attn
    out["recompute"] += fwd_attn * _recomputed(work, run_cfg, "core_attn")
    if cluster.mem_bw_GBps:
        parts = elementwise_bytes(run_cfg, moe_layer, work.precision == "fp8")
        per_row = ("permute", "moe_act")          # charged with the experts' rows
        nbytes = sum(v for k_, v in parts.items() if k_ not in per_row)
        bw = cluster.mem_bw_GBps * 1e9
        out["memory"] = T * 3 * nbytes / bw
        out["recompute"] += T * parts["layernorm"] * _recomputed(work, run_cfg, "layernorm") / bw
    if tp > 1:          # sequence parallelism: all-gather in, reduce-scatter out, fwd and bwd
        hops = 4 * (1 + (not moe_layer))
        out["tp_comm"] = hops * ((tp - 1) / tp * full * run_cfg.model.dim * 2
                                 / (cluster.intra_bw_GBps * 1e9) + cluster.intra_latency_us * 1e-6)
    return out


def nonexpert_parts(run_cfg: RunConfig, cluster: ClusterSpec, T: float,
                    work: Work) -> dict[str, float]:
    """:func:`nonexpert_time` by part (:func:`_layer_parts`' names; the output head's
    GEMMs count as ``gemm``, its softmax and cross-entropy as ``memory``, its logits
    computed again in backward (:func:`head_recompute_time`) as ``recompute``; with
    ``work.mtp_depth`` each multi-token-prediction module adds a head pass with its loss, its
    2 D -> D projection and its two RMSNorms, its block being one of ``run_cfg``'s layers:
    :func:`epscale.plan.pipeline.with_mtp`)."""
    m = run_cfg.model
    n_moe = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    moe_p = _layer_parts(run_cfg, cluster, T, work, True)
    dense_p = _layer_parts(run_cfg, cluster, T, work, False)
    out = {k: n_moe * moe_p[k] + (m.num_layers - n_moe) * dense_p[k] for k in moe_p}
    depth = work.mtp_depth or 0
    head_n, heads = m.vocab_size / work.tp, 1 + depth
    out["gemm"] += heads * train_gemms_time(cluster, T * work.tp, head_n, m.dim, "bf16")
    out["gemm"] += depth * train_gemms_time(cluster, T, m.dim, 2 * m.dim, work.precision)
    out["recompute"] += head_recompute_time(run_cfg, cluster, T, work)
    if cluster.mem_bw_GBps:
        mtp_norms = depth * 3 * 2 * (2 * m.dim * 2.0)      # fwd + bwd, read + write
        out["memory"] += T * (heads * loss_bytes(run_cfg) + mtp_norms) / (cluster.mem_bw_GBps * 1e9)
    return out


def nonexpert_time(run_cfg: RunConfig, cluster: ClusterSpec, T: float, work: Work) -> float:
    """Seconds of one micro-batch's non-expert work on one GPU holding T tokens: every
    layer's attention, norms, dense FFN or shared experts and router, and the output head
    with its loss (bf16), forward and backward."""
    return float(sum(nonexpert_parts(run_cfg, cluster, T, work).values()))


def _grouped(padded_rows, rows, gemms, N: int, K: int, rate: float, sm: int, tm: int, tn: int,
             in_b: int, bw: float):
    """One grouped GEMM over a rank's experts: tiles of every expert's padded rows, in waves
    of ``sm``; or its bytes (each expert's weights read once) at ``bw``."""
    tiles = padded_rows / tm * math.ceil(N / tn)
    c = np.where(tiles > 0, np.ceil(tiles / sm) * sm * 2.0 * tm * tn * K / rate, 0.0)
    mem = (rows * K * in_b + gemms * K * N * in_b + rows * N * 2) / bw
    return np.maximum(c, mem)


def expert_gemm_tflops(cluster: ClusterSpec, groups: int, rows_per_group: int, N: int, K: int,
                       precision: str = "bf16") -> float:
    """Achieved TFLOP/s of one grouped GEMM of ``groups`` experts with ``rows_per_group``
    rows each, weights K x N, as :func:`expert_parts` charges it (its forward GEMM)."""
    rate = _peak(cluster, precision) * cluster.gemm_efficiency
    rows = groups * rows_per_group
    padded = groups * math.ceil(rows_per_group / cluster.gemm_tile_m) * cluster.gemm_tile_m
    bw = cluster.mem_bw_GBps * 1e9 if cluster.mem_bw_GBps else np.inf
    t = _grouped(padded, rows, groups, N, K, rate, cluster.sm_count, cluster.gemm_tile_m,
                 cluster.gemm_tile_n, 1 if precision == "fp8" else 2, bw)
    return float(2.0 * rows * N * K / t / 1e12)


def expert_parts(run_cfg: RunConfig, cluster: ClusterSpec, rows, padded_rows, gemms,
                 work: Work) -> dict:
    """A rank's grouped expert GEMMs and the memory-bound work of its rows, by part
    (arrays broadcast): ``fwd`` and ``bwd`` the GEMMs' forward and backward, ``memory``
    the rows' permute, unpermute, activation (and fp8 casts), fwd + bwd, ``recompute``
    the activation run again. ``rows`` received, ``padded_rows`` the same rounded up to
    the tile per expert, ``gemms`` experts with rows."""
    moe, D = run_cfg.moe, run_cfg.model.dim
    mats, F = _ffn_mats(moe.activation), moe.hidden_dim
    prec = work.precision
    rate = _peak(cluster, prec) * cluster.gemm_efficiency
    sm, tm, tn = cluster.sm_count, cluster.gemm_tile_m, cluster.gemm_tile_n
    in_b = 1 if prec == "fp8" else 2
    bw = cluster.mem_bw_GBps * 1e9 if cluster.mem_bw_GBps else np.inf
    fwd = bwd = 0.0
    for k, n in ((D, (mats - 1) * F), (F, D)):
        for is_fwd, N, K in ((True, n, k), (False, k, n)):          # forward, input gradient
            t = _grouped(padded_rows, rows, gemms, N, K, rate, sm, tm, tn, in_b, bw)
            if is_fwd:
                fwd = fwd + t
            else:
                bwd = bwd + t
        tiles = gemms * math.ceil(k / tm) * math.ceil(n / tn)          # weight gradient
        q = np.where(tiles > 0, tiles / np.maximum(np.ceil(tiles / sm) * sm, 1), 1.0)
        c = 2.0 * rows * math.ceil(k / tm) * tm * math.ceil(n / tn) * tn / rate / q
        mem = (rows * (k + n) * in_b + gemms * k * n * 4) / bw
        bwd = bwd + np.maximum(c, mem)
    memory = recompute = 0.0
    if cluster.mem_bw_GBps:
        parts = elementwise_bytes(run_cfg, True, prec == "fp8")
        per_row = (parts["permute"] + parts["moe_act"]) / moe.top_k
        if prec == "fp8":
            per_row += FP8_CAST_BYTES * (D + F)
        act = parts["moe_act"] / moe.top_k
        memory = rows * (3 * per_row + _fp8_stored_per_row(run_cfg, work)) / bw
        recompute = rows * act * _recomputed(work, run_cfg, "moe_act") / bw
    return dict(fwd=fwd, bwd=bwd, memory=memory, recompute=recompute)


def _fp8_stored_per_row(run_cfg: RunConfig, work: Work) -> float:
    """Bytes moved per routed row to keep its saved activations in fp8 and restore them
    (``train.activation_storage: fp8``): the input row and the output row the combine
    keeps (D each), the activation's inputs ((mats - 1) F) and, unless ``moe_act`` is
    recomputed, its output (F)."""
    if run_cfg.train.activation_storage != "fp8":
        return 0.0
    D, F = run_cfg.model.dim, run_cfg.moe.hidden_dim
    elements = 2 * D + (_ffn_mats(run_cfg.moe.activation) - 1) * F
    elements += F * (not _recomputed(work, run_cfg, "moe_act"))
    return FP8_STORE_BYTES * elements


def expert_time(run_cfg: RunConfig, cluster: ClusterSpec, rows, padded_rows, gemms,
                work: Work):
    """Seconds of a rank's grouped expert GEMMs, fwd + bwd, and the memory-bound work of its
    rows (arrays broadcast; :func:`expert_parts`). The forward's share is returned too (for
    a recomputed MoE forward)."""
    p = expert_parts(run_cfg, cluster, rows, padded_rows, gemms, work)
    return p["fwd"] + p["bwd"] + p["memory"] + p["recompute"], p["fwd"]


def kernels_per_layer(run_cfg: RunConfig, moe_layer: bool, local_experts: int,
                      work: Work) -> tuple[int, int]:
    """(forward, backward) kernels one layer launches per micro-batch, counted from its
    structure as an eager framework runs it (Megatron-Core with Transformer Engine, or our
    trainer): one GEMM per linear layer and per local expert (a grouped GEMM on Hopper is a
    loop of GEMMs, one per expert), the norms, rope, flash attention, residual adds, the
    router's scores, top-k and statistics (6), the permute and unpermute (2 each), the
    exchanges (split sizes, their host copy, dispatch, combine), activations; fp8 adds an
    amax and a cast kernel per GEMM input. The backward runs two GEMMs per forward GEMM
    (input and weight gradients), two kernels per element-wise one (the gradient and the
    reduction of a weight's or a residual's gradient), three for flash attention."""
    m, moe = run_cfg.model, run_cfg.moe
    linears = len(_linears(run_cfg, moe_layer)) - moe_layer          # the router: below
    elem = 2 + 2 + 2 + 2 * (m.attention == "mla")                   # norms, rope, residuals
    comm = 4 * (work.tp > 1)                                         # sequence parallelism
    if moe_layer:
        linears += 1 + 2 * local_experts                             # router, experts
        elem += 6 + 2 * 2 + (moe.shared_width > 0) + 1               # routing, permutes, acts
        comm += 4                                                    # sizes, copy, a2a x 2
    else:
        elem += 1                                                    # the FFN's activation
    casts = 2 * linears if work.precision == "fp8" else 0
    fwd = linears + elem + comm + casts + 1                          # + flash attention
    bwd = 2 * linears + 2 * elem + comm + casts + 3
    return fwd, bwd


def host_bound_time(n_kernels, gpu_time, launch_us: float = HOST_LAUNCH_US):
    """Seconds a segment of ``n_kernels`` kernels that starts after a host sync (the host
    waited for the GPU, so nothing is queued) takes beyond its ``gpu_time`` (arrays
    broadcast): the host issues them one by one, so the segment lasts at least
    ``n_kernels x launch_us``."""
    return np.maximum(0.0, np.asarray(n_kernels, float) * launch_us * 1e-6 - gpu_time)
