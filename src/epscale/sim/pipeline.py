"""Pipeline stages by compute: how many blocks each stage gets, what each stage costs,
and the idle share (bubble) of each schedule.

Legend: L layers, n stages (pp x stages per rank), p pipeline ranks, v stages per rank,
m micro-batches per step.

Stage cost = the training FLOPs per token of its blocks (attention + dense FFN, or
attention + router + the top-k routed and the shared experts of an MoE block), plus the
output head on the last stage (2 D V per token forward) and the embedding lookup on the
first (counted as nothing: a gather). A dense first-k block therefore weighs less than
an MoE block of a wide MoE, and the last stage takes fewer blocks when the vocabulary is
large. The split is the contiguous one whose most expensive stage is cheapest.
"""

from __future__ import annotations

from functools import lru_cache

from ..config import ConfigError, RunConfig
from ..config.schema import PP_SCHEDULES, pp_stages_per_rank
from .sizing import _ffn_mats, attention_flops_per_token, attention_params


def block_flops(cfg: RunConfig) -> list[float]:
    """Forward FLOPs per token of each block, in order."""
    model, moe = cfg.model, cfg.moe
    D, m = model.dim, _ffn_mats(moe.activation)
    attn = 2.0 * attention_params(model) + attention_flops_per_token(model)
    dense = 2.0 * m * D * model.dense_hidden_dim
    routed = 2.0 * (m * D * moe.hidden_dim * moe.top_k + m * D * moe.shared_width
                    + D * moe.num_experts)
    return [attn + (routed if model.is_moe_layer(i) else dense) for i in range(model.num_layers)]


def head_flops(cfg: RunConfig) -> float:
    """Forward FLOPs per token of the output head."""
    return 2.0 * cfg.model.dim * cfg.model.vocab_size


def num_stages(cfg: RunConfig) -> int:
    par = cfg.parallel
    return par.pp * pp_stages_per_rank(par.pp_schedule, par.pp_virtual_stages) if par.pp > 1 else 1


def layers_per_stage(cfg: RunConfig) -> list[int]:
    """The blocks of each stage: ``parallel.pp_layers_per_stage`` when set, else the
    contiguous split that minimises the most expensive stage's cost."""
    n, L = num_stages(cfg), cfg.model.num_layers
    given = cfg.parallel.pp_layers_per_stage
    if given is not None:
        if len(given) != n or sum(given) != L:
            raise ConfigError(f"config key 'parallel.pp_layers_per_stage' = {given} is invalid: "
                              f"it must hold {n} layer counts that add up to model.num_layers "
                              f"= {L}")
        return list(given)
    if n == 1:
        return [L]
    if L < n:
        raise ConfigError(f"config key 'parallel.pp' = {cfg.parallel.pp} is invalid: {n} "
                          f"pipeline stages need at least {n} layers; model.num_layers is {L}")
    return _balanced(tuple(block_flops(cfg)), n, head_flops(cfg))


@lru_cache(maxsize=64)
def _balanced(costs: tuple[float, ...], n: int, head: float) -> list[int]:
    """Contiguous split of ``costs`` into n non-empty runs minimising the largest run's
    sum, the last run also paying ``head`` (exact, by dynamic programming; ties go to
    the split that puts more blocks early, so the head's stage stays lighter)."""
    L = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    INF = float("inf")
    # best[k][i]: the least possible largest cost of splitting the first i blocks into k runs
    best = [[INF] * (L + 1) for _ in range(n + 1)]
    cut = [[0] * (L + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for k in range(1, n + 1):
        for i in range(k, L - (n - k) + 1):
            extra = head if k == n else 0.0
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j] + extra)
                if worst == INF:
                    continue
                tie = 1e-9 * max(1.0, worst)
                if worst < best[k][i] - tie or (abs(worst - best[k][i]) <= tie and j > cut[k][i]):
                    best[k][i], cut[k][i] = worst, j
    sizes, i = [], L
    for k in range(n, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def stage_flops(cfg: RunConfig) -> list[float]:
    """Forward FLOPs per token of each stage under :func:`layers_per_stage`."""
    costs, out, start = block_flops(cfg), [], 0
    sizes = layers_per_stage(cfg)
    for s, k in enumerate(sizes):
        out.append(sum(costs[start:start + k]) + (head_flops(cfg) if s == len(sizes) - 1 else 0.0))
        start += k
    return out


def bubble_fraction(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """The share of a step each pipeline rank idles, for equal stages: (p - 1) / (m + p - 1)
    for GPipe and 1F1B; (p - 1) / (v m + p - 1) interleaved over v stages per rank. The
    zero-bubble schedules split each backward into its input and weight halves and fill
    the warm-up and cool-down with weight halves: with forward = input backward = weight
    backward, the interleaved zero-bubble schedule leaves a third of 1F1B's idle time,
    (p - 1) / (3 v m + p - 1), and ZB-V and DualPipeV none once m >= 2p (their papers'
    figures under that equal-cost assumption; real stages are not equal, so measure)."""
    p, m = pp, micro_batches
    if p <= 1:
        return 0.0
    kind = PP_SCHEDULES[schedule]
    v = pp_stages_per_rank(schedule, virtual_stages)
    if schedule in ("1f1b", "gpipe"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zero_bubble":
        return (p - 1) / (3 * v * m + p - 1)
    assert kind == "v"
    if m >= 2 * p:
        return 0.0
    return (p - 1) / (3 * 2 * m + p - 1)  # too few micro-batches to fill the V: as ZB-H1


def micro_batch_problem(schedule: str, pp: int, micro_batches: int) -> str | None:
    """Why ``schedule`` cannot run ``micro_batches`` per step at ``pp`` ranks (the checks
    torch's schedules make, said before anything starts), or None. 1F1B needs m >= p;
    interleaved 1F1B and interleaved zero-bubble a multiple of max(1, m // p) rounds;
    ZB-V and DualPipeV m >= 2p; GPipe any."""
    p, m = pp, micro_batches
    if p <= 1:
        return None
    kind = PP_SCHEDULES[schedule]
    if schedule == "1f1b" and m < p:
        return f"1f1b needs at least pp = {p} micro-batches per step"
    if kind == "v" and m < 2 * p:
        return f"{schedule} needs at least 2 x pp = {2 * p} micro-batches per step"
    if kind == "loop":
        rounds = max(1, m // p)
        if m % rounds:
            return (f"{schedule} runs the micro-batches in rounds of pp = {p}: the count must "
                    f"be below pp or a multiple of its {rounds} rounds")
    return None
