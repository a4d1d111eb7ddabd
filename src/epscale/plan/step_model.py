"""The step model: time of one training step of a recipe on a cluster, per balancing
strategy and dispatcher.

Legend: S step samples, L layer distributions, E experts, P physical slots, R ranks of one
EP group (``ep``), n nodes an EP group spans, g ranks of an EP group per node, M sampled
tokens, K top-k, T tokens per rank and micro-batch.

What is modelled (one EP group stands for all ``dp`` replicas; they are statistically alike):

* Compute. Non-expert work (attention, dense/shared FFNs, router, head) is the same on
  every rank; expert work on rank r follows its slots' rows. On a cluster with ``sm_count``
  (the GPU presets) both are timed by shape (:mod:`epscale.plan.shapes`: every GEMM's
  tiles in waves of the SMs under a roofline, each expert's rows rounded up to the tile,
  fp8 as a rate, memory-bound work by its bytes at the HBM bandwidth, tensor parallelism
  and recomputation by module as ``work`` says). On a calibrated cluster without it:
  ``T * flops / rate`` and each expert GEMM charged ``gemm_half_rows`` extra rows, plus
  ``layer_overhead_us`` per MoE layer and pass.
* Dispatch and combine rows, with the dispatchers' arithmetic: ``alltoall`` one row per
  (token, expert), ``dedup`` one per (token, destination rank), ``hierarchical`` one
  inter-node row per (token, destination node) to the same-index GPU there, which forwards
  one row per (token, rank) over NVLink. Each rank's transfer takes the larger of its
  NVLink and NIC times (in or out) plus latency; the collective ends with the slowest rank.
  Four transfers per MoE layer and micro-batch (dispatch and combine, forward and backward).
  A row is D channels in the activations' dtype, but the forward dispatch's, which
  ``parallel.payload`` may send as bf16 or fp8 (e4m3 and a scale per 128 channels:
  :func:`payload_row_bytes`).
* Synchronisation. A layer's combine waits for the slowest rank's experts: a rank's idle
  time is the sum over layers of (slowest rank's expert time - its own).
* Overlap. ``none``: transfers and compute in sequence. ``chunks``: dispatch, experts and
  combine pipelined over ``overlap_chunks`` chunks. ``full``: DualPipe's pairing of a
  forward chunk of one micro-batch with a backward chunk of another, each transfer beside
  one compute segment of the other pass (:func:`_paired_exposure`: the forward's
  attention beside the backward's combine, the backward's experts beside the forward's
  dispatch, the forward's experts beside the backward's dispatch, the backward's
  attention beside the forward's combine); what exceeds its segment is exposed. The
  forwards without a partner run their transfers exposed
  (:func:`epscale.plan.pipeline.paired_share`): without a pipeline that is
  ``parallel.overlap_micro_batches``, F_i beside B_(i-1), the step's first forward alone
  (1 of m); under one, each rank's warm-up and one more forward. The default is
  what the trainer runs (``epscale.plan.overlap.default_mode``). Overlapped dispatch
  kernels may hold SMs (``work.comm_sms``), which the compute then lacks.
* Data parallelism. Once per step: non-expert gradients all-reduced over all ranks, expert
  gradients over the ``dp`` ranks holding the same experts (ring, bus bandwidth of the
  slowest link crossed, log-depth latency); with overlap, hidden behind the last
  micro-batch's backward where it fits.
* FSDP (``parallel.fsdp``), by ZeRO level (``parallel.zero``, :func:`_fsdp_exposure`). At
  level 3, per micro-batch, every weight is all-gathered twice (forward, and again for
  backward: FSDP frees it after the forward) in the compute dtype and its gradient
  reduce-scattered in fp32; level 2 gathers once per step and reduce-scatters per
  micro-batch; level 1 gathers and reduce-scatters once per step (and so does every level
  under a pipeline, whose stage accumulates unsharded gradients): the non-expert weights
  over ``dp_shard`` ranks, an EP rank's experts over ``dp_shard / ep``. The prefetched
  gathers run behind the compute; the first block's gather and what exceeds the compute
  are exposed. Once per step the shards' gradients are all-reduced over ``dp_replicate``
  (HSDP), replacing the replicated all-reduce.
* Host-bound layers (GPU presets). A dropless exchange reads its split sizes on the host
  once per MoE layer forward, so each layer's forward starts with nothing queued and lasts
  at least its kernels' issue time (:func:`_host_bound`, ``work.launch_us`` per kernel).
* Recomputation (``train.activation_checkpointing``). ``full`` runs every block's forward
  again in backward (compute x 4/3); ``selective`` recomputes only element-wise work (not
  charged). Both run each MoE layer's dispatch and combine again (6 transfers, not 4).

Routing noise: synthetic distributions give each step's per-expert rows as Poisson draws
around their mean (independent tokens); a trace brings its own measured steps.

Pipeline (``parallel.pp`` = p > 1, m micro-batches, stages the outermost dimension: pipeline
rank q holds GPUs [q W, (q + 1) W), W = world / p, and each stage runs the layout above
over its W GPUs). A stage's time per micro-batch is its blocks' non-expert work (its
share of :func:`epscale.plan.pipeline.stage_flops`, the head on the last) plus its MoE
layers' times as above; a rank's is the sum over its stages, plus its p2p receives (each
stage's input from another rank in forward and its output gradient in backward: T x D
in the compute dtype, over NVLink when both ranks' GPUs share a node, else the NIC; exposed
under 1F1B and GPipe and without overlap, else hidden behind the rank's compute under the
looped and V schedules, which run another stage's micro-batch meanwhile) and its FSDP
gathers beyond its compute. The slowest rank sets the pace:
pipeline time = m x (slowest rank's time) + the bubble of the schedule at m
(:func:`epscale.plan.pipeline.bubble_time`: the sources' formulas in one chunk's forward,
backward and weight-backward times, :func:`_chunk_times` of the slowest rank). The
data-parallel reduction of each rank's own weights over its stage's ranks follows, the
slowest rank's counted. Tokens per GPU: m x T per step over the p GPUs of a pipeline.

The AdamW step closes every step, memory-bound (by bytes, on clusters with ``mem_bw_GBps``).
``SimResult.breakdown`` splits the step of the rank that sets the pace by part
(:func:`_breakdown`): the parts add up to ``step_time_s``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from ..config import ConfigError, RunConfig
from ..config.schema import PP_SCHEDULES
from .sizing import expert_params_per_expert, model_size
from .balance import (BalanceParams, Strategy, contiguous_placement, parse_strategy,
                      redundant_placement, temper)
from .cluster import ClusterSpec
from .layout import Layout
from .memory import cached_param_shapes, block_of
from .placement import plan_spill
from .pipeline import (bubble_time, layers_per_stage, micro_batches, paired_share, stage_flops,
                       stage_layers, stage_placement, with_mtp)
from .shapes import (PRECISIONS, RECOMPUTE_MODULES, Work, compute_cluster, expert_parts,
                     head_recompute_time, host_bound_time, kernels_per_layer, nonexpert_parts,
                     optimizer_bytes_per_param, resolve_work)
from .routing import (RoutingSpec, fit_weights, inclusion_probs, layer_shares, sample_topk,
                      shares_of)

DISPATCHERS = ("alltoall", "dedup", "hierarchical")
OVERLAPS = ("none", "chunks", "full")


@dataclass
class SimResult:
    """One (strategy, dispatcher) point. Times in seconds, shares are fractions of a step."""

    strategy: str
    dispatcher: str
    overlap: str
    step_time_s: float
    tokens_per_s_per_gpu: float
    compute_s: float              # slowest rank's compute on the critical path
    expert_comm_s: float          # exposed dispatch/combine time
    dp_comm_s: float              # exposed data-parallel gradient reduction
    fsdp_comm_s: float            # exposed FSDP all-gathers and reduce-scatters
    comm_share: float             # expert_comm_s / step_time_s
    dp_share: float
    worst_idle_share: float       # idle of the least-loaded GPU / step
    mean_idle_share: float
    max_vio: float                # mean over layers/steps of max/mean rank load - 1
    intra_bytes_per_gpu: float    # NVLink bytes sent per GPU per step (dispatch+combine)
    inter_bytes_per_gpu: float    # NIC bytes sent per GPU per step
    layers: list[dict] = field(default_factory=list)
    bubble_s: float = 0.0         # pipeline: the slowest rank's idle share of the schedule
    p2p_s: float = 0.0            # pipeline: the slowest rank's stage-boundary transfers
    # seconds of the step by part on the rank that sets the pace (:func:`_breakdown`):
    # they add up to step_time_s
    breakdown: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def cluster_layout(run_cfg: RunConfig, cluster: ClusterSpec, ep: int) -> Layout:
    """The recipe's :class:`Layout` on the cluster's GPUs at ``ep`` (a node's GPUs are its
    ranks per node), and the step model's own rule: a pipeline stage fills whole nodes or
    divides one."""
    lay = Layout.from_config(run_cfg, cluster.world, ep=ep, ranks_per_node=cluster.gpus_per_node)
    W, gpn = lay.stage_size, cluster.gpus_per_node
    if lay.pp > 1 and (W % gpn if W > gpn else gpn % W):
        raise ConfigError(f"parallel.pp = {lay.pp} is invalid on the cluster's {lay.world} GPUs "
                          f"({cluster.nodes} nodes x {gpn}): a stage's world / pp ranks "
                          "must fill whole nodes or divide one")
    return lay


def _allreduce_time(nbytes: float, n: int, bw_Bps: float, lat_s: float) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / bw_Bps + 2.0 * math.ceil(math.log2(n)) * lat_s


def _ring_time(nbytes: float, n: int, bw_Bps: float, lat_s: float) -> float:
    """All-gather (or reduce-scatter) of ``nbytes`` (the unsharded size) over ``n`` ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / bw_Bps + math.ceil(math.log2(n)) * lat_s


def _link(cluster: ClusterSpec, span: int, stride: int = 1) -> tuple[float, float]:
    """(bandwidth B/s, latency s) of a group of ``span`` ranks ``stride`` apart."""
    gpn = cluster.gpus_per_node
    inter = span * stride > gpn or (stride >= gpn and span > 1)
    return ((cluster.inter_bw_GBps if inter else cluster.intra_bw_GBps) * 1e9,
            (cluster.inter_latency_us if inter else cluster.intra_latency_us) * 1e-6)


def _pipeline(t1: np.ndarray, t2: np.ndarray, t3: np.ndarray, chunks: int) -> np.ndarray:
    """Wall time of three dependent stages split into ``chunks`` pipelined pieces."""
    if chunks <= 1:
        return t1 + t2 + t3
    return (t1 + t2 + t3) / chunks + (chunks - 1) / chunks * np.maximum(np.maximum(t1, t2), t3)


def default_mode(run_cfg: RunConfig, chunks: int | None = None) -> str:
    """The step model's overlap for ``run_cfg`` where none is asked for: 'none' under
    ``parallel.overlap: none`` (the trainer's blocking path); 'full' where the recipe
    pairs micro-batches without a pipeline (``parallel.overlap_micro_batches``, more than
    one micro-batch: a forward beside the previous one's backward); 'chunks' where the
    dispatch is pipelined over ``chunks`` (default ``parallel.overlap_chunks``) > 1
    chunks; else 'none'. DualPipeV's pairs are not assumed by default (``--overlap full``
    models them): on CUDA the trainer's pair issues its backward whole
    (``epscale.parallel.overlap_pair``), unmeasured, and ``--fit`` would rank every
    DualPipeV layout by that assumption."""
    par = run_cfg.parallel
    chunks = chunks or par.overlap_chunks
    if par.overlap == "none":
        return "none"
    if par.pp == 1 and par.overlap_micro_batches and (
            run_cfg.train.global_batch_size is not None or run_cfg.train.grad_accum > 1):
        return "full"
    return "chunks" if chunks > 1 else "none"


def simulate(run_cfg: RunConfig, cluster: ClusterSpec, routing: RoutingSpec | None = None, *,
             strategies: tuple[str, ...] = ("none", "aux", "loss_free", "redundant", "spill"),
             dispatchers: tuple[str, ...] = DISPATCHERS, overlap: str | None = None,
             ep: int | None = None, overlap_chunks: int | None = None,
             params: BalanceParams = BalanceParams(), step_samples: int = 8,
             sample_tokens: int = 2048, seed: int = 0,
             loads_cache: dict | None = None, work: Work = Work()) -> list[SimResult]:
    """Simulate one training step for every (strategy, dispatcher) pair.

    ``run_cfg`` supplies the model, the MoE layer, ``parallel.ep`` (unless ``ep`` is given;
    ``dp`` is whatever fills the cluster), the pipeline keys, micro-batch, sequence length,
    gradient accumulation (the micro-batches per step) and ``train.dtype`` (bfloat16: 2-byte
    activations and gradients). ``loads_cache``: a dict shared by calls that differ only in
    layout keys that leave the routing alone (``describe --fit``'s candidates): the sampled
    per-rank loads, which depend on the strategies, ep, tokens per micro-batch, routing and
    seed only, are drawn once per such key (the same draws a fresh call makes). ``work``:
    the run's GEMM precision, tensor parallelism and recomputed modules where the recipe
    does not say them (:class:`epscale.plan.shapes.Work`; the published runs' features).
    """
    routing = routing or RoutingSpec()
    work = resolve_work(run_cfg, work)        # Work.mtp_depth None: model.mtp_depth
    run_cfg = with_mtp(run_cfg, work.mtp_depth)
    for d in dispatchers:
        if d not in DISPATCHERS:
            raise ConfigError(f"dispatcher '{d}' is invalid: must be one of {', '.join(DISPATCHERS)}")
    chunks = overlap_chunks or run_cfg.parallel.overlap_chunks
    # what the trainer runs (the recipe's parallel.overlap: none is its blocking path,
    # whatever the chunks), unless asked
    overlap = overlap or default_mode(run_cfg, chunks)
    if overlap not in OVERLAPS:
        raise ConfigError(f"overlap '{overlap}' is invalid: must be one of {', '.join(OVERLAPS)}")
    model, moe, train = run_cfg.model, run_cfg.moe, run_cfg.train
    E, K = moe.num_experts, moe.top_k
    lay = cluster_layout(run_cfg, cluster, ep or run_cfg.parallel.ep)
    size = model_size(run_cfg)
    n_moe = size.num_moe_layers
    if n_moe == 0:
        raise ConfigError("the recipe has no MoE layer (model.num_dense_layers = model.num_layers)")

    act_bytes = 2 if train.dtype == "bfloat16" else 4
    grad_bytes = act_bytes
    T = _tokens_per_gpu(run_cfg, work)
    rate = cluster.flops_per_s
    row_flops = 6.0 * expert_params_per_expert(moe)             # fwd + bwd per routed row
    expert_flops_tok = n_moe * K * row_flops
    ne_flops = T * (size.flops_per_token - expert_flops_tok)   # non-expert, per micro-batch
    ccl = compute_cluster(cluster, work, overlap)
    # the head's logits computed again in backward (epscale's chunked loss): on the last
    # stage alone under a pipeline, so the rate the stages' FLOPs run at leaves it out
    head_again = head_recompute_time(run_cfg, ccl, T, work)
    # the knobs of ``work`` other than head_loss are modelled by part only
    if cluster.sm_count or work.mtp_depth or \
            replace(work, head_loss=Work().head_loss, mtp_depth=None) != Work():
        ne_parts = nonexpert_parts(run_cfg, ccl, T, work)
    else:
        ne_parts = {"compute": ne_flops / rate, "recompute": head_again}
    dense_time = float(sum(ne_parts.values()))
    dense_time_layer = dense_time / model.num_layers
    overhead = 3 * cluster.layer_overhead_us * 1e-6                      # fwd + 2x bwd
    ctx = dict(half_rows=cluster.gemm_half_rows, work=work, ccl=ccl,
               rate_ne=ne_flops / (dense_time - head_again), head_again=head_again,
               ne_parts=ne_parts,
               tile=cluster.gemm_tile_m if cluster.sm_count else 0)
    row_bytes = model.dim * act_bytes

    key = (tuple(strategies), lay.ep, lay.ep_ranks_per_node, lay.ep_num_nodes, T, n_moe, E, K,
           moe.num_groups, moe.topk_groups, routing, params, step_samples, sample_tokens, seed,
           ctx["tile"])
    if loads_cache is not None and key in loads_cache:
        loads, n_dist = loads_cache[key]
    else:
        rng = np.random.default_rng(seed)
        # Distinct layer distributions (synthetic: up to 8, cycled over the MoE layers).
        n_dist = n_moe if routing.kind == "trace" else min(n_moe, 8)
        base_w, trace_steps = layer_shares(routing, n_dist, E, K, rng, sample_tokens,
                                           moe.num_groups, moe.topk_groups)
        if trace_steps is not None:
            n_dist = base_w.shape[0]
        strats = [parse_strategy(sname, params) for sname in strategies]
        loads = [(strat, _strategy_loads(strat, base_w, trace_steps, lay, moe, params, T, rng,
                                         step_samples, sample_tokens, ctx["tile"]))
                 for strat in strats]
        if loads_cache is not None:
            loads_cache[key] = (loads, n_dist)
    layer_of = np.arange(n_moe) % n_dist
    weight_L = np.bincount(layer_of, minlength=n_dist).astype(np.float64)  # MoE layers per dist

    results = []
    for strat, sim in loads:
        for disp in dispatchers:
            results.append(_evaluate(strat, disp, overlap, chunks, sim, lay, cluster, size, run_cfg,
                                     T, rate, row_flops, ctx, dense_time, dense_time_layer,
                                     overhead, row_bytes, grad_bytes, weight_L))
    return results


def _tokens_per_gpu(run_cfg: RunConfig, work: Work) -> int:
    """Tokens of one micro-batch on one GPU: the micro-batch's, over the tensor-parallel
    ranks that share it (sequence parallelism)."""
    if work.precision not in PRECISIONS:
        raise ConfigError(f"precision '{work.precision}' is invalid: must be one of "
                          f"{', '.join(PRECISIONS)}")
    for mod in work.recompute_modules or ():
        if mod not in RECOMPUTE_MODULES:
            raise ConfigError(f"recompute module '{mod}' is invalid: must be one of "
                              f"{', '.join(RECOMPUTE_MODULES)}")
    if not work.launch_us >= 0:
        raise ConfigError(f"launch_us = {work.launch_us} is invalid: must be >= 0 microseconds "
                          "(the host's time to issue one kernel)")
    tokens = run_cfg.train.micro_batch_size * run_cfg.model.seq_len
    if work.tp < 1 or tokens % work.tp:
        raise ConfigError(f"tp = {work.tp} is invalid: must be a positive integer dividing "
                          f"the micro-batch's {tokens} tokens")
    return tokens // work.tp


def _miss_prob(q_LEX: np.ndarray, top_k: int) -> np.ndarray:
    """[L, X] probability that a token picks none of the experts of each rank/node x.

    ``q[l, e, x]`` is the probability that the token's row for expert e goes to x. Picks
    are K draws without replacement, so each expert already missed makes the rest likelier:
    ``prod_j (1 - q_j / (1 - sum_{i<j} q_i / K))``, exact for uniform routing
    (C(E-m, K) / C(E, K)) and the independent-experts product in the limit of many experts.
    """
    before = np.cumsum(q_LEX, axis=1) - q_LEX
    denom = np.maximum(1.0 - before / top_k, 1e-12)
    return np.prod(np.clip(1.0 - q_LEX / denom, 0.0, 1.0), axis=1)


def _strategy_loads(strat: Strategy, base_w, trace_steps, lay: Layout, moe, params: BalanceParams,
                    T: int, rng, step_samples: int, sample_tokens: int, tile: int = 0) -> dict:
    """Per-step rank rows, GEMM counts and dispatch dedup ratios of one strategy.

    Without group-limited routing everything is analytic: an expert's inclusion probability
    ``pi_e`` (Rosen's approximation for synthetic routers, ``K * share`` for a trace) and,
    the probability that a token touches a rank or a node from the experts living there
    (:func:`_miss_prob`, draws without replacement). Group-limited routing couples the experts,
    so there the dispatch ratios come from sampled tokens.
    """
    E, K, R, g, n = moe.num_experts, moe.top_k, lay.ep, lay.ep_ranks_per_node, lay.ep_num_nodes
    group_rows = T * R * K                               # assignments of one EP group
    grouped = moe.num_groups > 0 and moe.topk_groups < moe.num_groups
    chosen = None
    if trace_steps is None:
        w = temper(base_w, strat.temper)
        # Loads from the analytic marginals (group limits shift them little and sampled
        # marginals would add noise that reads as imbalance); with groups the tokens
        # sampled below give only the dispatch ratios, which the limits change a lot.
        pi = inclusion_probs(w, K)
        if grouped:
            chosen = sample_topk(w, K, sample_tokens, rng, moe.num_groups, moe.topk_groups)
        counts = rng.poisson((pi / K)[None] * group_rows,
                             size=(step_samples,) + pi.shape).astype(np.float64)
    else:
        steps = temper(trace_steps, strat.temper)
        counts = steps * group_rows
        pi = np.minimum(steps.mean(axis=0) * K, 1.0)
        if grouped:
            w = fit_weights(pi / K, K, sample_tokens, rng, moe.num_groups, moe.topk_groups)
            chosen = sample_topk(w, K, sample_tokens, rng, moe.num_groups, moe.topk_groups)
    L = pi.shape[0]
    if strat.redundant:
        phy2log, replicas = redundant_placement(pi / K, R, n, params.redundant_per_rank,
                                                moe.num_groups)
    else:
        phy2log, replicas = contiguous_placement(L, E)
    P = phy2log.shape[1]
    spr = P // R
    slot_rank = np.arange(P) // spr
    li = np.arange(L)[:, None]
    # Probability that a token sends a row to each rank / node.
    if chosen is None:
        # q[l, e, r]: P(token's copy of expert e is on rank r) = pi_e * copies_on_r / c_e.
        q = np.zeros((L, E, R))
        np.add.at(q, (li, phy2log, np.broadcast_to(slot_rank, phy2log.shape)),
                  (pi / replicas)[li, phy2log])
        q = np.minimum(q, 1.0)
        hit_rank = 1 - _miss_prob(q, K)
        qn = np.minimum(q.reshape(L, E, n, g).sum(axis=3), 1.0)
        hit_node = 1 - _miss_prob(qn, K)
        share_rank = q.sum(axis=1) / K
        share_node = qn.sum(axis=1) / K
    else:
        order = np.argsort(phy2log, axis=1, kind="stable")        # slots grouped by expert
        first = np.zeros_like(replicas)
        first[:, 1:] = np.cumsum(replicas, axis=1)[:, :-1]
        lk = np.arange(L)[:, None, None]
        pick = (rng.random(chosen.shape) * replicas[lk, chosen]).astype(np.int64)
        slot = np.take_along_axis(order, (first[lk, chosen] + pick).reshape(L, -1), axis=1)
        rank = slot.reshape(chosen.shape) // spr                   # [L, M, K]

        def hit_rate(ids, num):
            hit = np.zeros(ids.shape[:2] + (num,), dtype=bool)
            np.put_along_axis(hit, ids, True, axis=2)
            return hit.mean(axis=1)

        share_rank, hit_rank = shares_of(rank, R), hit_rate(rank, R)
        share_node, hit_node = shares_of(rank // g, n), hit_rate(rank // g, n)
    with np.errstate(invalid="ignore", divide="ignore"):
        dedup_ratio = np.where(share_rank > 0, hit_rank / (K * share_rank), 1.0)
        node_ratio = np.where(share_node > 0, hit_node / (K * share_node), 1.0)
    # Per-step slot rows: an expert's rows split evenly over its copies.
    S = counts.shape[0]
    slot_rows = np.take_along_axis(counts / replicas[None],
                                   np.broadcast_to(phy2log, (S,) + phy2log.shape), axis=2)
    rank_rows = slot_rows.reshape(S, L, R, spr)
    gemms = (rank_rows > 0).sum(axis=3).astype(np.float64)        # [S, L, R]
    rows = rank_rows.sum(axis=3)                                   # [S, L, R]
    # rows a grouped GEMM computes: each expert's rounded up to the tile (``tile``: 0, none)
    pad = (np.ceil(rank_rows / tile) * tile).sum(axis=3) - rows if tile else np.zeros(rows.shape)
    spills = np.zeros(rows.shape)                                  # expert weights moved
    if strat.spill and P == E:     # spill-over plans on the plain contiguous layout
        for si in range(S):
            for layer in range(L):
                plan = plan_spill(np.rint(counts[si, layer]).astype(np.int64), R,
                                  params.spill_threshold, params.spill_min_rows)
                if not plan.active:
                    continue
                rows[si, layer] = np.asarray(plan.rank_load_after, dtype=np.float64)
                for sp in plan.spills:
                    gemms[si, layer, sp.helper] += 1
                    pad[si, layer, sp.helper] += tile / 2
                    spills[si, layer, sp.owner] += 1
                    spills[si, layer, sp.helper] += 1
    return {"rows": rows, "gemms": gemms, "pad": pad, "dedup_ratio": np.clip(dedup_ratio, 0.0, 1.0),
            "node_ratio": np.clip(node_ratio, 0.0, 1.0), "spills": spills, "num_slots": P}


def _expert_compute(sim: dict, run_cfg: RunConfig, cluster: ClusterSpec, ctx: dict, rate: float,
                    row_flops: float, overhead: float, redo: float) -> tuple[np.ndarray, dict]:
    """[S, L, R] seconds of each rank's experts per MoE layer and micro-batch, fwd + bwd and
    what is recomputed: by shape (:func:`epscale.plan.shapes.expert_time`) on a cluster
    with ``sm_count``, else the calibrated ``gemm_half_rows`` extra rows per expert GEMM;
    and the mean share of each part (``expert_gemm``, ``expert_memory``,
    ``expert_recompute``, ``overhead``) for :func:`_breakdown`."""
    rows, gemms, work = sim["rows"], sim["gemms"], ctx["work"]
    again = "moe" in (work.recompute_modules or ())       # the MoE forward runs twice
    if not cluster.sm_count:
        gemm = (rows + ctx["half_rows"] * gemms) * row_flops / rate
        parts = {"expert_gemm": gemm, "expert_recompute": gemm * (redo + again / 3.0),
                 "overhead": np.broadcast_to(overhead * (1 + redo + again / 3.0), rows.shape)}
    else:
        p = expert_parts(run_cfg, ctx["ccl"], rows, rows + sim["pad"], gemms, work)
        gemm, mem = p["fwd"] + p["bwd"], p["memory"]
        parts = {"expert_gemm": gemm, "expert_memory": mem,
                 "expert_recompute": p["recompute"] * (1 + redo) + (gemm + mem) * redo
                 + p["fwd"] * again,
                 "overhead": np.broadcast_to(overhead, rows.shape)}
    comp = sum(np.asarray(v, dtype=np.float64) for v in parts.values())
    total = float(np.sum(comp))
    shares = {k: float(np.sum(v)) / total if total > 0 else 0.0 for k, v in parts.items()}
    return comp, shares


def _fsdp_exposure(zero: int, pp: int, gather: float, rs: float, compute: float,
                   layers: int) -> tuple[float, float]:
    """(per micro-batch, per step) exposed seconds of FSDP's collectives at ZeRO level
    ``zero`` (``parallel.zero``): ``gather`` one all-gather of the rank's weights in the
    compute dtype, ``rs`` one fp32 reduce-scatter of their gradients, ``compute`` a
    micro-batch's compute on the rank, ``layers`` its blocks. Level 3 gathers every weight
    twice per micro-batch (forward, and again for backward) and reduce-scatters once; 2
    gathers once per step and reduce-scatters per micro-batch; 1 gathers and
    reduce-scatters once per step. Under a pipeline torch's stage accumulates the gradients
    unsharded and keeps the weights gathered after each backward (level 3: one gather per
    micro-batch, its next forward frees them), so it reduce-scatters once per step at
    every level. A gather runs one block ahead of the compute that needs it (the first
    block's is exposed), a reduce-scatter behind the backward (two thirds of the compute;
    the last block's is exposed)."""
    if pp > 1:
        per_micro, micro_rs, step_gather, step_rs = (gather if zero == 3 else 0.0), 0.0, gather, rs
    else:
        per_micro, micro_rs = {3: (2 * gather, rs), 2: (0.0, rs), 1: (0.0, 0.0)}[zero]
        step_gather, step_rs = (0.0, 0.0) if zero == 3 else (gather, rs if zero == 1 else 0.0)
    micro = per_micro + micro_rs
    micro_exposed = max(0.0, micro - compute) + micro / 3 / layers if micro > 0 else 0.0
    step_exposed = 0.0
    if step_gather:
        step_exposed += max(0.0, step_gather - compute) + step_gather / layers
    if step_rs:
        step_exposed += max(0.0, step_rs - 2.0 / 3.0 * compute) + step_rs / layers
    return micro_exposed, step_exposed


def _host_bound(run_cfg: RunConfig, lay: Layout, sim: dict, cluster: ClusterSpec, work: Work,
                compute: np.ndarray, exposed: np.ndarray) -> np.ndarray:
    """[S, L] seconds each MoE layer and micro-batch waits on the host issuing its kernels
    (:func:`epscale.plan.shapes.host_bound_time`; GPU presets only). A dropless exchange
    reads the split sizes on the host once per MoE layer forward (Megatron-Core's
    all-to-all and DeepEP's normal kernels, and our trainer), so each layer's forward
    starts with nothing queued: it lasts at least its kernels' issue time. The backward
    has no sync; the same bound holds layer by layer where the host falls behind. The
    layer's ``compute`` (experts and its share of the non-expert work) is a third forward,
    two thirds backward; its ``exposed`` transfers half and half. Token dropping at a
    fixed capacity (``moe.capacity_factor``) or one EP rank needs no sync: nothing."""
    if not cluster.sm_count or run_cfg.moe.capacity_factor is not None or lay.ep == 1:
        return np.zeros_like(compute)
    n_fwd, n_bwd = kernels_per_layer(run_cfg, True, int(sim["num_slots"]) // lay.ep, work)
    return (host_bound_time(n_fwd, compute / 3 + exposed / 2, work.launch_us)
            + host_bound_time(n_bwd, 2 * compute / 3 + exposed / 2, work.launch_us))


def _breakdown(ne_parts: dict, ne_step: float, redo: float, ex_shares: dict, ex_step: float,
               **rest: float) -> dict:
    """Seconds of the step by part on the rank that sets the pace: its non-expert work
    (``ne_step``) split as one micro-batch's ``ne_parts`` (the whole-block recomputation,
    ``redo`` of it, as ``recompute``), its experts' (``ex_step``) by ``ex_shares``, and the
    ``rest`` (exposed communication, bubble, optimizer) as given. The parts add up to the
    step time."""
    out: dict = {}
    total = sum(ne_parts.values())
    for k, v in ne_parts.items():
        out[k] = out.get(k, 0.0) + (v / total * ne_step / (1 + redo) if total > 0 else 0.0)
    out["recompute"] = out.get("recompute", 0.0) + ne_step * redo / (1 + redo)
    for k, v in ex_shares.items():
        out[k] = out.get(k, 0.0) + v * ex_step
    out.update(rest)
    return {k: float(v) for k, v in out.items()}


def _optimizer_time(cluster: ClusterSpec, run_cfg: RunConfig, params: float, world: int) -> float:
    """The AdamW step over a rank's ``params`` (sharded over the stage's data-parallel ranks
    under FSDP), memory-bound: its bytes at the HBM bandwidth (0 without ``mem_bw_GBps``)."""
    if not cluster.mem_bw_GBps:
        return 0.0
    shard = world // run_cfg.parallel.dp_replicate if run_cfg.parallel.fsdp else 1
    return params / shard * optimizer_bytes_per_param(run_cfg) / (cluster.mem_bw_GBps * 1e9)


def _paired_exposure(comm: np.ndarray, disp: np.ndarray, experts: np.ndarray, attn,
                     transfers: int, redo: float) -> np.ndarray:
    """Exposed transfer time of one MoE layer under DualPipe's pairing: a forward chunk of
    one micro-batch runs beside a backward chunk of another, one compute segment beside
    one transfer at a time, in the order DualPipe's Figure 4 draws and Megatron-Core's
    combined 1F1B issues (its docs' "issue order": F.attn, B.combine, F.dispatch,
    B.expert, B.dispatch, F.expert, F.combine, B.attn): the forward's attention beside
    the backward's combine, the backward's experts beside the forward's dispatch, the
    forward's experts beside the backward's dispatch, the backward's attention beside
    the forward's combine. Each phase ends when both its halves have (each waits on the
    other stream's previous one), so a transfer longer than its segment is exposed by
    the difference, whatever the other segments leave free. A recomputed forward's
    transfers (in backward) take what the phases leave free.
    ``comm`` one combine or backward transfer, ``disp`` one forward dispatch, ``experts``
    and ``attn`` the layer's expert and non-expert compute (forward a third, backward
    the rest, the recomputation included)."""
    fwd = 1.0 / (3.0 + 3.0 * redo)
    phases = ((attn * fwd, comm), (experts * (1 - fwd), disp), (experts * fwd, comm),
              (attn * (1 - fwd), comm))
    exposed = sum(np.maximum(0.0, t - c) for c, t in phases)
    free = sum(np.maximum(0.0, c - t) for c, t in phases)
    again = transfers // 2 - 2                     # a recomputed forward's dispatch, in backward
    extra = again * disp + (transfers - 4 - again) * comm
    return exposed + np.maximum(0.0, extra - free)


def payload_row_bytes(run_cfg: RunConfig, disp: str, act_bytes: int) -> float:
    """Bytes of one token row of the forward dispatch under ``parallel.payload``: 'auto'
    the activations' dtype (``act_bytes`` per channel), 'bf16' two bytes per channel,
    'fp8' (the dispatchers that send it: ``dedup`` and ``hierarchical``) one byte per
    channel, 4-byte aligned, and one fp32 scale per 128 channels, as
    :mod:`epscale.dispatch.comm` packs it (D = 7168: 7,392 bytes against bf16's 14,336).
    ``alltoall`` cannot send fp8 (the trainer refuses that pair): its rows stay in the
    activations' dtype. The combine and every backward transfer travel in the
    activations' dtype whatever the payload."""
    D, payload = run_cfg.model.dim, run_cfg.parallel.payload
    if payload == "fp8" and disp in ("dedup", "hierarchical"):
        return -(-D // 4) * 4 + 4 * -(-D // 128)
    return D * (2 if payload == "bf16" else act_bytes)


def _transfer_times(disp: str, sim: dict, lay: Layout, cluster: ClusterSpec, run_cfg: RunConfig,
                    rows: np.ndarray, row_bytes: float, grad_bytes: int):
    """Seconds of one transfer of each MoE layer and micro-batch, the slowest rank's ([S, L]):
    (a combine or backward transfer, in the activations' dtype; the forward dispatch, at
    :func:`payload_row_bytes`), and the rows each rank sends over NVLink and the NIC
    ([S, L, R]) per transfer, with the dispatchers' arithmetic (module docstring)."""
    S, L, R = rows.shape
    g, n = lay.ep_ranks_per_node, lay.ep_num_nodes
    # Rows each source sends to each destination rank (per micro-batch, one transfer).
    per_src_to = rows / R                                                     # alltoall
    node_of = np.arange(R) // g
    if disp in ("dedup", "hierarchical"):
        per_src_to = per_src_to * sim["dedup_ratio"][None]
    node_sum = per_src_to.reshape(S, L, n, g).sum(axis=3)                    # [S, L, n]
    total = per_src_to.sum(axis=2, keepdims=True)
    if disp == "hierarchical" and n > 1:
        node_rows = (rows.reshape(S, L, n, g).sum(axis=3) / R) * sim["node_ratio"][None]
        out_inter = node_rows.sum(axis=2, keepdims=True) - node_rows[..., node_of]
        in_inter = (n - 1) * node_rows[..., node_of]
        in_intra = (R - 1) * per_src_to
        out_intra = np.repeat(in_intra.reshape(S, L, n, g).mean(axis=3), g, axis=2)
        lat = cluster.inter_latency_us + cluster.intra_latency_us
    else:
        same = node_sum[..., node_of]
        out_intra = same - per_src_to
        out_inter = total - same
        in_intra = (g - 1) * per_src_to
        in_inter = (R - g) * per_src_to
        lat = cluster.inter_latency_us if n > 1 else cluster.intra_latency_us
    extra = 0.0
    if sim["spills"].any():
        # Spill-over: the helper fetches the expert's weights and returns their gradients.
        wbytes = expert_params_per_expert(run_cfg.moe) * grad_bytes
        bw = (cluster.inter_bw_GBps if n > 1 else cluster.intra_bw_GBps) * 1e9
        extra = (sim["spills"] * wbytes / bw).max(axis=2, keepdims=True) / 2  # /2: 2 of 4 transfers

    def one(nbytes: float) -> np.ndarray:
        if R == 1:
            return np.zeros((S, L))
        intra_t = np.maximum(in_intra, out_intra) * nbytes / (cluster.intra_bw_GBps * 1e9)
        inter_t = np.maximum(in_inter, out_inter) * nbytes / (cluster.inter_bw_GBps * 1e9)
        return (np.maximum(intra_t, inter_t) + lat * 1e-6 + extra).max(axis=2)

    act_bytes = row_bytes / run_cfg.model.dim
    return (one(row_bytes), one(payload_row_bytes(run_cfg, disp, act_bytes)), out_intra,
            out_inter)


def _exposed_transfers(overlap: str, chunks: int, comm: np.ndarray, disp: np.ndarray,
                       comp: np.ndarray, dense_layer: float, transfers: int,
                       redo: float) -> np.ndarray:
    """[S, L] seconds of one MoE layer and micro-batch's transfers left on the critical
    path: ``comm`` one combine or backward transfer, ``disp`` one forward dispatch (each
    forward, the recomputed one too, dispatches at the payload), ``comp`` the slowest
    rank's experts, ``dense_layer`` the layer's share of the non-expert work, under
    ``overlap`` (module docstring)."""
    forwards = transfers // 2 - 1                  # the recomputed forward is a second one
    if overlap == "chunks":
        fwd = _pipeline(disp, comp / (3 + 3 * redo), comm, chunks)
        bwd = _pipeline(comm, 2 * comp / (3 + 3 * redo), comm, chunks)
        return fwd * forwards + bwd - comp
    if overlap == "full":
        return _paired_exposure(comm, disp, comp, dense_layer, transfers, redo)
    return forwards * disp + (transfers - forwards) * comm

def _data_parallel(run_cfg: RunConfig, lay: Layout, cluster: ClusterSpec, size, sim: dict,
                   work: Work, overlap: str, grad_bytes: int, micro: float,
                   accum: int) -> tuple[float, float, float]:
    """Without a pipeline: the exposed seconds per step of the data-parallel gradient
    reduction and of FSDP's collectives (module docstring), and the optimizer step's.
    ``micro`` one micro-batch's time, ``accum`` the micro-batches."""
    def link(span: int, stride: int = 1) -> tuple[float, float]:
        return _link(cluster, span, stride)

    dense_params = (size.total_params - size.expert_params) / work.tp
    expert_params = size.expert_params / lay.ep * sim["num_slots"] / run_cfg.moe.num_experts
    par = run_cfg.parallel
    fsdp_exposed = 0.0
    if par.fsdp:
        rep = par.dp_replicate
        dp_shard = lay.world // rep
        efsdp = dp_shard // lay.ep
        dense_bw, dense_lat = link(dp_shard)
        exp_bw, exp_lat = link(efsdp, lay.ep)
        gather, rs = (_ring_time(dense_params * nbytes, dp_shard, dense_bw, dense_lat)
                      + _ring_time(expert_params * nbytes, efsdp, exp_bw, exp_lat)
                      for nbytes in (grad_bytes, 4))
        per_micro, per_step = _fsdp_exposure(par.zero, 1, gather, rs, micro,
                                             run_cfg.model.num_layers)
        fsdp_exposed = accum * per_micro + per_step
        rep_bw, rep_lat = link(rep, dp_shard)
        ar = (_allreduce_time(dense_params / dp_shard * 4, rep, rep_bw, rep_lat)
              + _allreduce_time(expert_params / efsdp * 4, rep, rep_bw, rep_lat))
    else:
        bw, lat = link(lay.world)
        dp_bw, dp_lat = link(lay.dp, lay.ep)
        ar = (_allreduce_time(dense_params * grad_bytes, lay.world // work.tp, bw, lat)
              + _allreduce_time(expert_params * grad_bytes, lay.dp, dp_bw, dp_lat))
    if overlap == "none":
        dp_exposed = ar
    else:
        dp_exposed = max(0.0, ar - 2.0 / 3.0 * micro)
    opt = _optimizer_time(cluster, run_cfg, dense_params + expert_params, lay.world)
    return dp_exposed, fsdp_exposed, opt


def _evaluate(strat, disp, overlap, chunks, sim, lay: Layout, cluster: ClusterSpec, size, run_cfg,
              T, rate, row_flops, ctx, dense_time, dense_time_layer, overhead, row_bytes,
              grad_bytes, weight_L) -> SimResult:
    rows = sim["rows"]                                            # [S, L, R]
    S, L, R = rows.shape
    ac = run_cfg.train.activation_checkpointing
    work = ctx["work"]
    redo = 1.0 / 3.0 if ac == "full" and work.recompute_modules is None else 0.0
    # a second forward as a share of fwd + bwd; recomputation dispatches again
    if work.recompute_modules is None:
        transfers = 4 if ac == "none" else 6
    else:
        transfers = 6 if "moe" in work.recompute_modules else 4
    dense_time = dense_time * (1 + redo)
    dense_time_layer = dense_time_layer * (1 + redo)
    comp, ex_shares = _expert_compute(sim, run_cfg, cluster, ctx, rate, row_flops, overhead,
                                      redo)                                    # [S, L, R]

    comm_max, disp_max, out_intra, out_inter = _transfer_times(
        disp, sim, lay, cluster, run_cfg, rows, row_bytes, grad_bytes)
    comp_max = comp.max(axis=2)
    accum = micro_batches(run_cfg, lay.world)
    exposed = _exposed_transfers(overlap, chunks, comm_max, disp_max, comp_max,
                                 dense_time_layer, transfers, redo)
    # paired forwards and backwards: the forwards without a partner (the step's first
    # without a pipeline, the warm-up's under one) run alone, their transfers exposed
    alone = (_exposed_transfers("none", chunks, comm_max, disp_max, comp_max,
                                dense_time_layer, transfers, redo)
             if overlap == "full" else exposed)
    if lay.pp == 1:
        share = paired_share(run_cfg.parallel.pp_schedule, 1, accum, 1, 0)
        exposed = share * exposed + (1 - share) * alone
    layer_time = comp_max + exposed
    launch = _host_bound(run_cfg, lay, sim, cluster, work, comp_max + dense_time_layer, exposed)
    layer_time = layer_time + launch
    idle = comp_max[..., None] - comp                                         # [S, L, R]
    # Weighted sum over the MoE layers each distribution stands for, mean over steps.
    wsum = lambda a: float((a.mean(axis=0) * weight_L).sum())  # noqa: E731
    micro = dense_time + wsum(layer_time)
    # transfers' bytes per layer and micro-batch, in units of one in the activations' dtype
    volume = 3 + payload_row_bytes(run_cfg, disp, grad_bytes) / row_bytes
    if lay.pp > 1:
        launch_alone = _host_bound(run_cfg, lay, sim, cluster, work, comp_max + dense_time_layer,
                                   alone)
        return _pipeline_result(
            strat, disp, overlap, lay, cluster, run_cfg, T, ctx["rate_ne"], grad_bytes, row_bytes, redo,
            accum, ctx["work"], ctx["ne_parts"], ctx["head_again"], ex_shares, dict(layer_time=layer_time, launch=launch, comp_max=comp_max, idle=idle,
                        alone_time=comp_max + alone + launch_alone, launch_alone=launch_alone,
                        rows=rows, comm_max=comm_max, comp=comp, out_intra=out_intra,
                        out_inter=out_inter, volume=volume))

    dp_exposed, fsdp_exposed, opt = _data_parallel(run_cfg, lay, cluster, size, sim, ctx["work"],
                                                   overlap, grad_bytes, micro, accum)
    step = accum * micro + dp_exposed + fsdp_exposed + opt
    idle_rank = accum * (idle.mean(axis=0) * weight_L[:, None]).sum(axis=0)   # [R]
    compute = accum * (dense_time + wsum(comp_max))
    expert_comm = accum * wsum(exposed)
    loads = rows.mean(axis=2)
    max_vio = float(np.mean(rows.max(axis=2) / np.maximum(loads, 1e-12) - 1))
    per_transfer_intra = out_intra.mean(axis=(0, 2)) * row_bytes if R > 1 else np.zeros(L)
    per_transfer_inter = out_inter.mean(axis=(0, 2)) * row_bytes if R > 1 else np.zeros(L)
    layers = [{"dist": int(i), "num_layers": int(weight_L[i]),
               "expert_compute_max_ms": float(comp_max[:, i].mean() * 1e3),
               "expert_compute_mean_ms": float(comp[:, i].mean() * 1e3),
               "transfer_ms": float(comm_max[:, i].mean() * 1e3),
               "layer_time_ms": float(layer_time[:, i].mean() * 1e3),
               "intra_bytes_per_gpu": float(per_transfer_intra[i]),
               "inter_bytes_per_gpu": float(per_transfer_inter[i])} for i in range(L)]
    factor = volume * accum
    return SimResult(
        strategy=strat.name, dispatcher=disp, overlap=overlap, step_time_s=step,
        tokens_per_s_per_gpu=accum * T / step, compute_s=compute, expert_comm_s=expert_comm,
        dp_comm_s=dp_exposed, fsdp_comm_s=fsdp_exposed, comm_share=expert_comm / step, dp_share=dp_exposed / step,
        worst_idle_share=float(idle_rank.max() / step), mean_idle_share=float(idle_rank.mean() / step),
        max_vio=max_vio,
        intra_bytes_per_gpu=factor * float((per_transfer_intra * weight_L).sum()),
        inter_bytes_per_gpu=factor * float((per_transfer_inter * weight_L).sum()),
        layers=layers, breakdown=_breakdown(
            ctx["ne_parts"], accum * dense_time, redo, ex_shares, accum * wsum(comp_max),
            expert_comm=expert_comm, launch=accum * wsum(launch), fsdp_comm=fsdp_exposed,
            dp_comm=dp_exposed, optimizer=opt))


def _chunk_times(rank: dict, v: int, redo: float, ne_parts: dict, ex_shares: dict
                 ) -> tuple[float, float, float]:
    """(F, B, W) seconds of one chunk (one stage, one micro-batch) of a pipeline rank for
    :func:`epscale.plan.pipeline.bubble_time`: the rank's time per micro-batch over its
    ``v`` stages. What is recomputed (the whole-block share ``redo`` and the modules'
    ``recompute`` parts) runs in the backward; the rest splits as the GEMMs' FLOPs do, a
    third forward and two thirds backward, transfers included. W, the weight half of the
    backward, is charged the forward's compute without its transfers (a weight-gradient
    GEMM has the forward GEMM's FLOPs; attention's score work has no weight half, so W is
    at most this)."""
    total = sum(ne_parts.values())
    ne_share = redo / (1 + redo) + (ne_parts.get("recompute", 0.0) / total / (1 + redo)
                                    if total > 0 else 0.0)
    rec = (rank["nonexpert"] * ne_share
           + (rank["compute"] - rank["nonexpert"]) * ex_shares.get("expert_recompute", 0.0))
    f = (rank["time"] - rec) / 3.0 / v
    w = max(0.0, rank["compute"] - rec) / 3.0 / v
    return f, rank["time"] / v - f, w


def _block_params(run_cfg: RunConfig, ep: int) -> tuple[dict, dict]:
    """Parameters by block (:func:`epscale.plan.memory.block_of`), unsharded: (non-expert,
    an EP rank's experts)."""
    dense: dict = {}
    expert: dict = {}
    for p in cached_param_shapes(run_cfg.model, run_cfg.moe):
        key = block_of(p)
        book = expert if p.expert else dense
        book[key] = book.get(key, 0) + (p.numel / ep if p.expert else p.numel)
    return dense, expert


def _stage_collectives(cluster: ClusterSpec, lay: Layout, par, d_params: float, e_params: float,
                       grad_bytes: int, tp: int, busy: float, layers: int
                       ) -> tuple[float, float, float]:
    """A pipeline rank's weights' collectives over its stage's W ranks: (FSDP's exposed
    seconds per micro-batch, per step (:func:`_fsdp_exposure`), and the gradient
    all-reduce's seconds: over ``dp_replicate`` under FSDP, else over the stage's ranks
    (non-expert) and the ``dp`` ranks holding the same experts). ``busy`` a micro-batch's
    time on the rank, ``layers`` its blocks."""
    W = lay.stage_size
    if not par.fsdp:
        bw, lat = _link(cluster, W)
        dp_bw, dp_lat = _link(cluster, lay.dp, lay.ep)
        return 0.0, 0.0, (_allreduce_time(d_params * grad_bytes, W // tp, bw, lat)
                          + _allreduce_time(e_params * grad_bytes, lay.dp, dp_bw, dp_lat))
    rep = par.dp_replicate
    dp_shard = W // rep
    efsdp = dp_shard // lay.ep
    dense_bw, dense_lat = _link(cluster, dp_shard)
    exp_bw, exp_lat = _link(cluster, efsdp, lay.ep)
    gather, rs = (_ring_time(d_params * b, dp_shard, dense_bw, dense_lat)
                  + _ring_time(e_params * b, efsdp, exp_bw, exp_lat)
                  for b in (grad_bytes, 4))
    fsdp_t, fsdp_step = _fsdp_exposure(par.zero, lay.pp, gather, rs, busy, max(1, layers))
    rep_bw, rep_lat = _link(cluster, rep, dp_shard)
    return fsdp_t, fsdp_step, (_allreduce_time(d_params / dp_shard * 4, rep, rep_bw, rep_lat)
                               + _allreduce_time(e_params / efsdp * 4, rep, rep_bw, rep_lat))


def _p2p_time(cluster: ClusterSpec, W: int, nbytes: float, owner: dict, stages: list[int],
              r: int) -> float:
    """Seconds pipeline rank ``r`` (holding ``stages``) spends receiving per micro-batch:
    each stage's input from the rank before it and its output gradient from the rank
    after it, ``nbytes`` each, over NVLink when both ranks' W GPUs share a node, else the
    NIC; nothing between two stages of the same rank."""
    return sum(_hop_time(cluster, W, nbytes, r, owner[t]) for s in stages for t in (s - 1, s + 1)
               if t in owner and owner[t] != r)


def _hop_time(cluster: ClusterSpec, W: int, nbytes: float, r: int, a: int) -> float:
    """Seconds ``nbytes`` take from pipeline rank ``a`` to rank ``r`` (each of W GPUs):
    over NVLink when both share a node, else the NIC."""
    gpn = cluster.gpus_per_node
    same_node = W < gpn and (a * W) // gpn == (r * W) // gpn
    bw = (cluster.intra_bw_GBps if same_node else cluster.inter_bw_GBps) * 1e9
    lat = cluster.intra_latency_us if same_node else cluster.inter_latency_us
    return nbytes / bw + lat * 1e-6


def _pipeline_result(strat, disp, overlap, lay: Layout, cluster: ClusterSpec, run_cfg: RunConfig,
                     T: int, rate: float, grad_bytes: int, row_bytes: float, redo: float,
                     m: int, work: Work, ne_parts: dict, head_again: float, ex_shares: dict,
                     moe_times: dict) -> SimResult:
    """One step under a pipeline (the module docstring's 'Pipeline'). ``moe_times``: the
    per-distribution arrays of :func:`_evaluate` ([S, L] or [S, L, R]) for one MoE layer
    and micro-batch; ``head_again`` the seconds per micro-batch the last stage's backward
    spends on the head's logits again (:func:`head_recompute_time`)."""
    model, moe, par = run_cfg.model, run_cfg.moe, run_cfg.parallel
    ranges = stage_layers(layers_per_stage(run_cfg))
    n, W = len(ranges), lay.stage_size
    placement = stage_placement(par.pp_schedule, lay.pp, par.pp_virtual_stages)
    owner = {s: r for r, held in enumerate(placement) for s in held}
    paired_L = moe_times["layer_time"].mean(axis=0)                    # [L]: per distribution
    alone_L = moe_times["alone_time"].mean(axis=0)                     # a forward without partner
    launch_paired = moe_times["launch"].mean(axis=0)
    launch_alone = moe_times["launch_alone"].mean(axis=0)
    comp_max = moe_times["comp_max"].mean(axis=0)
    idle = moe_times["idle"].mean(axis=0)                              # [L, R]
    n_dist = paired_L.shape[0]
    moe_ids = [i for i in range(model.num_layers) if model.is_moe_layer(i)]
    dist_of = {i: j % n_dist for j, i in enumerate(moe_ids)}           # as weight_L cycles them
    routed_fwd = 2.0 * moe.top_k * expert_params_per_expert(moe)       # per token and MoE layer
    fwd = stage_flops(run_cfg, work.mtp_depth)
    dense, expert = _block_params(run_cfg, lay.ep)
    hop_bytes = T * model.dim * grad_bytes                             # one activation, or its gradient
    # With overlap (or ``work.p2p_overlap``) the looped and V schedules run another stage's
    # micro-batch while a boundary's activation or gradient travels (Megatron's interleaved
    # schedule overlaps its p2p, DualPipe pairs chunks): p2p is exposed only where it
    # exceeds the compute.
    hides_p2p = PP_SCHEDULES[par.pp_schedule] != "single" and (overlap != "none" or work.p2p_overlap)
    tp = work.tp
    # the last stage's copy of the embedding (a tied head, MTP's lookups: epscale's
    # parallel/stage_embedding.py, Megatron's embedding group): its weights on that rank,
    # and after the reductions its gradient shard exchanged with the first stage's rank
    copy_params = model.vocab_size * model.dim if model.tie_embeddings or work.mtp_depth else 0
    copy_shard_bytes = copy_params / tp * 4 / (W if par.fsdp else 1)      # fp32 gradients
    ranks = []
    for r, stages in enumerate(placement):
        share = (paired_share(par.pp_schedule, lay.pp, m, par.pp_virtual_stages, r)
                 if overlap == "full" else 1.0)
        layer_time = share * paired_L + (1 - share) * alone_L
        launch_L = share * launch_paired + (1 - share) * launch_alone
        layers = [i for s in stages for i in ranges[s]]
        moes = [dist_of[i] for i in layers if i in dist_of]
        weights = np.bincount(np.asarray(moes, dtype=np.int64), minlength=n_dist).astype(np.float64)
        nonexpert = sum(T * 3.0 * (fwd[s] - routed_fwd * sum(model.is_moe_layer(i) for i in ranges[s]))
                        for s in stages) / rate * (1 + redo) + head_again * (n - 1 in stages)
        compute = nonexpert + float((comp_max * weights).sum())
        busy = nonexpert + float((layer_time * weights).sum())
        p2p = _p2p_time(cluster, W, hop_bytes, owner, stages, r)
        if hides_p2p:
            p2p = max(0.0, p2p - compute)
        keys = layers + ["embed"] * (0 in stages) + ["head"] * (n - 1 in stages)
        d_params = (sum(dense.get(k, 0) for k in keys) + copy_params * (n - 1 in stages)) / tp
        e_params = sum(expert.get(k, 0) for k in keys)
        fsdp_t, fsdp_step, ar = _stage_collectives(cluster, lay, par, d_params, e_params,
                                                   grad_bytes, tp, busy, len(layers))
        ends = (0 in stages, n - 1 in stages)
        exchange = (_hop_time(cluster, W, copy_shard_bytes, r, owner[n - 1 if ends[0] else 0])
                    if copy_params and ends[0] != ends[1] else 0.0)   # one rank holding both: an add
        dp_t = fsdp_step + exchange + (ar if overlap == "none"
                                       else max(0.0, ar - 2.0 / 3.0 * (busy + p2p + fsdp_t)))
        launch = float((launch_L * weights).sum())
        ranks.append(dict(time=busy + p2p + fsdp_t, compute=compute, nonexpert=nonexpert,
                          layer_time=layer_time,
                          launch=launch, expert_comm=busy - compute - launch,
                          p2p=p2p, fsdp=fsdp_t, fsdp_step=fsdp_step, dp=dp_t, weights=weights,
                          opt=_optimizer_time(cluster, run_cfg, d_params + e_params, W)))
    slow = max(ranks, key=lambda x: x["time"])
    f_c, b_c, w_c = _chunk_times(slow, len(placement[0]), redo, ne_parts, ex_shares)
    pipe = m * slow["time"] + bubble_time(par.pp_schedule, lay.pp, m, f_c, b_c, w_c)
    dp_rank = max(ranks, key=lambda x: x["dp"])     # its dp includes ZeRO's per-step share
    dp_exposed = dp_rank["dp"]
    opt = max(x["opt"] for x in ranks)
    step = pipe + dp_exposed + opt
    w = slow["weights"]
    idle_rank = m * (idle * w[:, None]).sum(axis=0)                   # [R]
    rows = moe_times["rows"]
    loads = rows.mean(axis=2)
    max_vio = float(np.mean(rows.max(axis=2) / np.maximum(loads, 1e-12) - 1))
    R = lay.ep
    intra = moe_times["out_intra"].mean(axis=(0, 2)) * row_bytes if R > 1 else np.zeros(n_dist)
    inter = moe_times["out_inter"].mean(axis=(0, 2)) * row_bytes if R > 1 else np.zeros(n_dist)
    comp = moe_times["comp"]
    layers_out = [{"dist": int(i), "num_layers": int(w[i]),
                   "expert_compute_max_ms": float(comp_max[i] * 1e3),
                   "expert_compute_mean_ms": float(comp[:, i].mean() * 1e3),
                   "transfer_ms": float(moe_times["comm_max"][:, i].mean() * 1e3),
                   "layer_time_ms": float(slow["layer_time"][i] * 1e3),
                   "intra_bytes_per_gpu": float(intra[i]),
                   "inter_bytes_per_gpu": float(inter[i])} for i in range(n_dist)]
    expert_comm = m * slow["expert_comm"]
    # Traffic per GPU: the mean over the pipeline ranks (each holds its own MoE layers),
    # whatever rank sets the pace.
    w_mean = np.mean([x["weights"] for x in ranks], axis=0)
    return SimResult(
        strategy=strat.name, dispatcher=disp, overlap=overlap, step_time_s=step,
        tokens_per_s_per_gpu=m * T / lay.pp / step, compute_s=m * slow["compute"],
        expert_comm_s=expert_comm, dp_comm_s=dp_exposed - dp_rank["fsdp_step"],
        fsdp_comm_s=m * slow["fsdp"] + dp_rank["fsdp_step"],
        comm_share=expert_comm / step, dp_share=dp_exposed / step,
        worst_idle_share=float(idle_rank.max() / step),
        mean_idle_share=float(idle_rank.mean() / step), max_vio=max_vio,
        intra_bytes_per_gpu=moe_times["volume"] * m * float((intra * w_mean).sum()),
        inter_bytes_per_gpu=moe_times["volume"] * m * float((inter * w_mean).sum()),
        layers=layers_out, bubble_s=pipe - m * slow["time"], p2p_s=m * slow["p2p"],
        breakdown=_breakdown(ne_parts, m * slow["nonexpert"], redo, ex_shares,
                             m * (slow["compute"] - slow["nonexpert"]), expert_comm=expert_comm,
                             launch=m * slow["launch"],
                             p2p=m * slow["p2p"], fsdp_comm=m * slow["fsdp"] + dp_rank["fsdp_step"],
                             bubble=pipe - m * slow["time"],
                             dp_comm=dp_exposed - dp_rank["fsdp_step"], optimizer=opt))
