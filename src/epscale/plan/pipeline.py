"""Pipeline stages by compute: how many blocks each stage gets, what each stage costs,
and the idle share (bubble) of each schedule.

Legend: L layers, n stages (pp x stages per rank), p pipeline ranks, v stages per rank,
m micro-batches per step.

Stage cost = the training FLOPs per token of its blocks (attention + dense FFN, or
attention + router + the top-k routed and the shared experts of an MoE block), plus the
output head on the last stage (2 D V per token forward) and the embedding lookup on the
first (counted as nothing: a gather). A dense first-k block therefore weighs less than
an MoE block of a wide MoE, and the last stage takes fewer blocks when the vocabulary is
large. The split is the contiguous one whose most expensive stage is cheapest, with its
blocks then as late as those stage costs allow (the early stages hold the most micro-batches
in flight: fewer blocks there, less memory, the same slowest stage). The
model's multi-token-prediction modules (``model.mtp_depth``) run on the last stage after
the head: their blocks, projections and head passes are part of its cost
(:func:`mtp_cost`), so it takes fewer of the model's own blocks.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from ..config import ConfigError, RunConfig
from ..config.schema import PP_SCHEDULES, pp_stages_per_rank
from .sizing import _ffn_mats, attention_flops_per_token, attention_params


def stage_placement(schedule: str, pp: int, virtual_stages: int = 1) -> list[list[int]]:
    """For each pipeline rank, the stage indices it holds (in the order it runs them)."""
    v = pp_stages_per_rank(schedule, virtual_stages)
    kind = PP_SCHEDULES[schedule]
    if kind == "v":
        return [[r, 2 * pp - 1 - r] for r in range(pp)]
    return [[r + k * pp for k in range(v)] for r in range(pp)]


def layers_label(a: int, b: int, mtp: int = 0) -> str:
    """Blocks a .. b - 1 of a stage ('-': none) and its multi-token-prediction modules, as
    the start-up header and ``describe`` print them: '3-5', '7', 'MTP x1', '60 + MTP x1'."""
    parts = ([f"{a}-{b - 1}" if b - a > 1 else str(a)] if b > a else []) + \
        ([f"MTP x{mtp}"] if mtp else [])
    return " + ".join(parts) or "-"


def stage_layers(layers_per_stage: list[int]) -> list[range]:
    """The block indices of each stage: consecutive runs of the given lengths."""
    out, start = [], 0
    for n in layers_per_stage:
        out.append(range(start, start + n))
        start += n
    return out


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


def mtp_flops(cfg: RunConfig, depth: int) -> float:
    """Forward FLOPs per token of ``depth`` multi-token-prediction modules beyond their
    blocks (DeepSeek-V3 report, section 2.2: each module projects the concatenation of the
    normed hidden state and the normed embedding of the next token, 2 D -> D, runs one
    transformer block and the shared output head): the projection and one more head pass
    per module. The modules' blocks are counted as blocks (:func:`with_mtp`)."""
    D = cfg.model.dim
    return depth * (2.0 * 2 * D * D + head_flops(cfg))


def mtp_block_flops(cfg: RunConfig, depth: int) -> list[float]:
    """Forward FLOPs per token of ``depth`` multi-token-prediction modules' blocks (block
    ids ``num_layers`` ..: an MoE block where the model's pattern makes that id one)."""
    L = cfg.model.num_layers
    longer = replace(cfg, model=replace(cfg.model, num_layers=L + depth, mtp_depth=0))
    return block_flops(longer)[L:]


def mtp_cost(cfg: RunConfig, depth: int) -> float:
    """Forward FLOPs per token the last stage pays for ``depth`` multi-token-prediction
    modules: their blocks, projections and head passes."""
    return sum(mtp_block_flops(cfg, depth)) + mtp_flops(cfg, depth) if depth else 0.0


def with_mtp(cfg: RunConfig, depth: int) -> RunConfig:
    """The run with ``depth`` multi-token-prediction modules as the step model charges them:
    ``depth`` more blocks after the last (each an MoE block where the model's own pattern
    makes block ``num_layers + i`` one, as DeepSeek-V3's), on the last stage with the head.
    The stage split is the given ``parallel.pp_layers_per_stage``, else the balanced split
    of the model's own blocks with the last stage also paying the modules (blocks,
    projections, head passes), then the modules' blocks appended to the last stage. The
    returned config counts the modules' blocks as layers and has ``model.mtp_depth`` 0
    (whatever ``cfg`` said: ``depth`` replaces it), so sizing does not count them twice;
    the projections and head passes are :func:`mtp_flops`. ``Work.mtp_depth`` (None: the
    recipe's) reaches this through the step model. When ``depth`` is the model's own
    ``model.mtp_depth`` the split is the trainer's (:func:`layers_per_stage`, by stage,
    the modules' blocks then appended to the last stage); another depth (a published
    run's, whose split is not published) is placed as described above."""
    if depth < 0:
        raise ConfigError(f"mtp_depth = {depth} is invalid: must be >= 0")
    if depth == 0:
        if cfg.model.mtp_depth:
            return replace(cfg, model=replace(cfg.model, mtp_depth=0))
        return cfg
    L = cfg.model.num_layers
    model = replace(cfg.model, num_layers=L + depth, mtp_depth=0)
    n = num_stages(cfg)
    if n == 1:
        return replace(cfg, model=model)
    if depth == cfg.model.mtp_depth:            # the trainer's own modules: its own split
        base = layers_per_stage(cfg)
        split = list(base[:-1]) + [base[-1] + depth]
        return replace(cfg, model=model, parallel=replace(cfg.parallel, pp_layers_per_stage=split))
    blocks = block_flops(replace(cfg, model=model,
                                 parallel=replace(cfg.parallel, pp_layers_per_stage=None)))
    if cfg.parallel.pp_layers_per_stage is not None or L < n:
        base = layers_per_stage(cfg)                       # validated (or refused) as given
        split = list(base[:-1]) + [base[-1] + depth]
    else:
        # the last stage holds the modules and their head passes, with or without blocks
        # of the model's own (Megatron's DeepSeek-V3 layout ends in a stage of the MTP
        # block and the loss alone): the cheaper of the two for the worst rank
        par = cfg.parallel
        placement = stage_placement(par.pp_schedule, par.pp, par.pp_virtual_stages)
        last = head_flops(cfg) + mtp_flops(cfg, depth)
        own = _balanced(tuple(blocks[:L]), n, last + sum(blocks[L:]))
        alone = _balanced(tuple(blocks[:L]), n - 1, 0.0)
        options = [balance_ranks(list(own[:-1]) + [own[-1] + depth], blocks, last, placement,
                                 depth),
                   balance_ranks(list(alone) + [depth], blocks, last, placement, depth)]
        split = min(options, key=lambda o: rank_costs(o, blocks, last, placement))
    return replace(cfg, model=model, parallel=replace(cfg.parallel, pp_layers_per_stage=split))


def num_stages(cfg: RunConfig) -> int:
    par = cfg.parallel
    return par.pp * pp_stages_per_rank(par.pp_schedule, par.pp_virtual_stages) if par.pp > 1 else 1


def layers_per_stage(cfg: RunConfig) -> list[int]:
    """The model's own blocks of each stage: ``parallel.pp_layers_per_stage`` when set,
    else the contiguous split that minimises the most expensive stage's cost (the last
    stage's includes the head and the ``model.mtp_depth`` modules, :func:`mtp_cost`),
    its blocks moved as late as that allows (:func:`_late_as_possible`) unless that makes
    the most expensive rank costlier (a rank of a looped or V schedule holds several).
    With MTP modules the last stage may hold them and the head alone (0 of the model's
    blocks), where that makes the most expensive rank cheaper."""
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
    costs, last = tuple(block_flops(cfg)), head_flops(cfg) + mtp_cost(cfg, cfg.model.mtp_depth)
    par = cfg.parallel
    placement = stage_placement(par.pp_schedule, par.pp, par.pp_virtual_stages)

    def worst_rank(split: list[int]) -> float:
        return rank_costs(split, list(costs), last, placement)[0]

    balanced = _balanced(costs, n, last)
    late = _late_as_possible(costs, balanced, last)
    # (by rank no worse: a rank of a looped or V schedule holds several stages)
    best = late if worst_rank(late) <= worst_rank(balanced) * (1 + 1e-9) else balanced
    if cfg.model.mtp_depth and n > 2:
        # the modules and the head alone on the last stage (Megatron's DeepSeek-V3 layout):
        # where the modules weigh more than a stage of blocks, the model's blocks spread
        # over the other stages instead
        others = _balanced(costs, n - 1, 0.0)
        alone = _late_as_possible(costs, others, 0.0) + [0]
        if worst_rank(alone) < worst_rank(best) * (1 - 1e-9):
            best = alone
    return best


def _late_as_possible(costs: tuple[float, ...], sizes: list[int], head: float) -> list[int]:
    """``sizes`` (a split of the blocks ``costs``, the last stage also paying ``head``)
    with every block as late as the split's own stage costs allow: from the last stage
    back, each stage takes blocks while it costs no more than the most expensive of the
    other stages did (the last stage: or than it did itself, if more), keeping one block
    for each earlier stage. The slowest stage is unchanged; the early stages, which every
    schedule keeps the most micro-batches of in flight, hold fewer blocks (deepseek-v3's
    DualPipeV rank 0: 68 -> 45 GiB by the memory model, the largest rank 68 -> 67)."""
    n = len(sizes)
    if n == 1:
        return list(sizes)
    stage, start = [], 0
    for k in sizes:
        stage.append(sum(costs[start:start + k]))
        start += k
    slowest_other = max(stage[:-1])
    caps = [slowest_other] * (n - 1) + [max(stage[-1] + head, slowest_other)]
    out, end = [], len(costs)
    for s in range(n - 1, 0, -1):
        used, k = (head if s == n - 1 else 0.0), 0
        while end - k - 1 >= s and (k == 0 or used + costs[end - k - 1]
                                    <= caps[s] * (1 + 1e-9)):
            used += costs[end - k - 1]
            k += 1
        out.append(k)
        end -= k
    out.append(end)
    return out[::-1]


def balance_ranks(sizes: list[int], costs: list[float], last: float,
                  placement: list[list[int]], min_last: int = 1) -> list[int]:
    """``sizes`` (a contiguous split of the blocks ``costs``, the last stage also paying
    ``last``) moved one boundary block at a time while that lowers the ranks' costs, most
    expensive first (:func:`rank_costs`). A rank that holds several stages (interleaved,
    V) is balanced as a whole: under a V schedule rank 0 holds the first stage and the
    last one with the head, so its first stage takes fewer blocks. Stages keep at least
    one block (the last ``min_last``). With one stage per rank the split comes back as it
    is (:func:`_balanced` is exact there). Only :func:`with_mtp`'s placement of another
    depth than the model's balances by rank: the trainer's own split
    (:func:`layers_per_stage`) stays balanced by stage, which also keeps the early stages
    (most micro-batches in flight) from taking extra blocks; by rank, deepseek-v3's recipe
    went from 76 to 88 GiB on its largest rank."""
    if all(len(held) == 1 for held in placement):
        return list(sizes)
    best, score = list(sizes), rank_costs(sizes, costs, last, placement)
    improved = True
    while improved:
        improved = False
        for b in range(len(best) - 1):               # the boundary after stage b
            floor = min_last if b + 1 == len(best) - 1 else 1
            for step in (1, -1):                     # a block from stage b + 1 to b, or back
                cand = list(best)
                cand[b] += step
                cand[b + 1] -= step
                if cand[b] < 1 or cand[b + 1] < floor:
                    continue
                new = rank_costs(cand, costs, last, placement)
                if new < score:                      # lexicographic: the worst rank first
                    best, score, improved = cand, new, True
    return best


def rank_costs(sizes: list[int], costs: list[float], last: float,
               placement: list[list[int]]) -> list[float]:
    """Each rank's cost under the split ``sizes`` (its stages' blocks, the last stage also
    ``last``), most expensive first."""
    stage, start = [], 0
    for k in sizes:
        stage.append(sum(costs[start:start + k]))
        start += k
    stage[-1] += last
    return sorted((sum(stage[s] for s in held) for held in placement), reverse=True)


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


def stage_flops(cfg: RunConfig, mtp_depth: int = 0) -> list[float]:
    """Forward FLOPs per token of each stage under :func:`layers_per_stage`; the last
    stage also pays ``mtp_depth`` modules' projections and head passes (``cfg`` from
    :func:`with_mtp`, whose blocks are already in the split)."""
    costs, out, start = block_flops(cfg), [], 0
    sizes = layers_per_stage(cfg)
    last = head_flops(cfg) + mtp_flops(cfg, mtp_depth)
    for s, k in enumerate(sizes):
        out.append(sum(costs[start:start + k]) + (last if s == len(sizes) - 1 else 0.0))
        start += k
    return out


def bubble_time(schedule: str, pp: int, micro_batches: int, f: float, b: float,
                w: float) -> float:
    """Seconds each pipeline rank idles in one step, from one chunk's times (one stage,
    one micro-batch): ``f`` its forward, ``b`` its full backward (input and weight halves
    together, and any recomputed forward) and ``w`` the weight half alone. The sources'
    formulas, F, B, W per chunk, p = ``pp`` ranks:

    * gpipe, 1f1b: (p - 1)(F + B) (GPipe, Huang et al. 2019; 1F1B, the DualPipe README's
      table, github.com/deepseek-ai/DualPipe).
    * interleaved_1f1b: (p - 1)(F + B) per chunk, i.e. (p - 1)(t_f + t_b) / v of the
      rank's whole share (Narayanan et al. 2021, section 2.2.2).
    * zero_bubble: (p - 1)(F + B - 2W) per chunk (ZB-H1, Qi et al. 2023, arXiv 2401.10241;
      the DualPipe README's ZB1P row), the warm-up and cool-down filled with weight halves.
    * zbv: none once m >= 2p (the comparison table of sail-sg/zero-bubble-pipeline-
      parallelism, which assumes equal forward, input-backward and weight-backward times,
      here F = B - W = W; no closed form is published otherwise).
    * dualpipev: (PP/2 - 1)(F&B + B - 3W) with PP = 2p stages on p ranks: (p - 1)(F&B + B
      - 3W), F&B the time of a forward and a backward chunk run overlapped, which the step
      model already charges as f + b with what their transfers leave exposed (DualPipe
      README: DualPipe's row; DualPipeV, its cut-in-half V, has the same bubble on PP/2
      devices).

    With fewer than 2p micro-batches a V cannot fill: charged as ZB-H1 per chunk."""
    p, m = pp, micro_batches
    if p <= 1:
        return 0.0
    kind = PP_SCHEDULES[schedule]
    if schedule in ("1f1b", "gpipe", "interleaved_1f1b"):
        return (p - 1) * (f + b)
    if schedule == "zero_bubble" or (kind == "v" and m < 2 * p):
        return (p - 1) * max(0.0, f + b - 2 * w)
    if schedule == "zbv":
        return 0.0
    assert schedule == "dualpipev", schedule
    return (p - 1) * max(0.0, (f + b) + b - 3 * w)


def bubble_fraction(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """The share of a step each pipeline rank idles, for equal stages whose backward is
    twice the forward and whose weight half equals the forward (F = W = B / 2, no
    recomputation): :func:`bubble_time` over the step. (p - 1) / (m + p - 1) for GPipe and
    1F1B; (p - 1) / (v m + p - 1) interleaved over v stages per rank; (p - 1) / (3 v m +
    p - 1) for the interleaved zero-bubble schedule; none for ZB-V once m >= 2p; (p - 1) /
    (3 m + p - 1) for DualPipeV (a third of 1F1B's at the same ranks and micro-batches)."""
    if pp <= 1:
        return 0.0
    v = pp_stages_per_rank(schedule, virtual_stages)
    idle = bubble_time(schedule, pp, micro_batches, 1.0, 2.0, 1.0)
    return idle / (micro_batches * v * 3.0 + idle)


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


# ------------------------------------------------------------------ what a rank runs, in order
#
# The compute actions of one pipeline rank in the order torch's schedule runs them (torch
# 2.13's ``torch.distributed.pipelining`` order generators, idle slots and communication
# left out), as (stage, kind, micro-batch) with kind F (forward), B (full backward), I (the
# input half of a split backward) or W (its weight half). The memory model reads from
# them how many micro-batches' activations a rank holds at once; tests/test_sim_pipeline.py
# checks them against torch's own orders.


def micro_batches(cfg: RunConfig, world: int) -> int:
    """Micro-batches per step (what the pipeline schedules): ``train.grad_accum``, or what
    ``train.global_batch_size`` derives over the world / pp data-parallel ranks."""
    t, pp = cfg.train, cfg.parallel.pp
    if t.global_batch_size is None:
        return t.grad_accum
    per_micro = world // pp * t.micro_batch_size
    if per_micro < 1 or t.global_batch_size % per_micro:
        raise ConfigError(f"config key 'train.global_batch_size' = {t.global_batch_size} is "
                          f"invalid at {world} ranks: it must be a multiple of the {world // pp} "
                          f"data-parallel ranks (world / pp {pp}) x train.micro_batch_size "
                          f"{t.micro_batch_size}")
    return t.global_batch_size // per_micro


def schedule_actions(schedule: str, pp: int, micro_batches: int, virtual_stages: int,
                     rank: int) -> list[tuple[int, str, int]]:
    """Pipeline rank ``rank``'s compute actions (stage, 'F' | 'B' | 'I' | 'W', micro-batch)
    in the order ``schedule`` runs them at ``pp`` ranks and ``micro_batches`` per step.

    1f1b: p - 1 - r forwards, then one forward and one backward in turn, then the rest of
    the backwards. gpipe: every forward, then every backward. interleaved_1f1b and
    zero_bubble (v stages per rank, in rounds of max(1, m // p) micro-batches): a warm-up
    of (v - 1) x round + k (p - 1 - r) forwards (k = 2, zero_bubble k = 1), then forward
    and backward in turn; zero_bubble splits each backward into I and W and runs the W
    halves r actions late. zbv and dualpipev: the V orders of torch (the zero-bubble V of
    Qi et al. and DeepSeek's DualPipe cut in half), whose backwards are I + W or B."""
    p, m = pp, micro_batches
    kind = PP_SCHEDULES[schedule]
    if schedule == "gpipe":
        return [(rank, "F", i) for i in range(m)] + [(rank, "B", i) for i in range(m)]
    if schedule == "1f1b":
        warm = min(p - 1 - rank, m)
        out = [(rank, "F", i) for i in range(warm)]
        for i in range(m - warm):
            out += [(rank, "F", warm + i), (rank, "B", i)]
        return out + [(rank, "B", i) for i in range(m - warm, m)]
    if kind == "loop":
        return _looped_actions(schedule, p, m, pp_stages_per_rank(schedule, virtual_stages), rank)
    if schedule == "zbv":
        return _zbv_actions(p, m, rank)
    return _dualpipev_actions(p, m, rank)


def paired_items(schedule: str, p: int, m: int, v: int, rank: int) -> list[tuple]:
    """Rank ``rank``'s compute actions (:func:`schedule_actions`) as torch's runtime runs
    them: a DualPipeV forward followed by a backward of another stage as one item of two
    (its ``OVERLAP_F_B``; the last rank runs its first such pair apart), every other
    action an item of one."""
    flat = schedule_actions(schedule, p, m, v, rank)
    items: list[tuple] = []
    first_pair = rank == p - 1
    i = 0
    while i < len(flat):
        a, b = flat[i], flat[i + 1] if i + 1 < len(flat) else None
        pair = (schedule == "dualpipev" and b is not None and a[1] == "F" and b[1] == "B"
                and a[0] != b[0])
        if pair and first_pair:       # the last rank runs its first such pair apart
            pair, first_pair = False, False
        items.append((a, b) if pair else (a,))
        i += 2 if pair else 1
    return items


@lru_cache(maxsize=4096)
def paired_share(schedule: str, pp: int, micro_batches: int, virtual_stages: int,
                 rank: int) -> float:
    """The share of rank ``rank``'s forward chunks that run beside another micro-batch's
    backward when forwards and backwards are paired (the step model's overlap 'full'):
    the rest run alone, their transfers exposed. Without a pipeline, every forward but the
    step's first (F_i beside B_(i-1): ``parallel.overlap_micro_batches``). DualPipeV: the
    pairs torch's schedule emits (:func:`paired_items`). GPipe: none. The others: every
    forward after the warm-up but one, the warm-up's forwards alone: Megatron-Core's
    combined 1F1B moves one more forward into the warm-up so that each steady pair's two
    halves are independent ("The first forward and final backward remain exposed
    fill/drain phases", its moe_a2a_overlap guide)."""
    p, m = pp, micro_batches
    if p <= 1:
        return (m - 1) / m if m > 0 else 0.0
    if schedule == "dualpipev":
        items = paired_items(schedule, p, m, virtual_stages, rank)
        forwards = sum(a[1] == "F" for item in items for a in item)
        return sum(len(item) == 2 for item in items) / max(forwards, 1)
    flat = schedule_actions(schedule, p, m, virtual_stages, rank)
    forwards = sum(a[1] == "F" for a in flat)
    alone = next((i for i, a in enumerate(flat) if a[1] != "F"), len(flat))  # the warm-up + 1
    return (forwards - alone) / max(forwards, 1)


def _looped_actions(schedule: str, p: int, m: int, v: int, rank: int) -> list[tuple[int, str, int]]:
    """Interleaved 1F1B and interleaved zero-bubble (torch's ``_get_1f1b_rank_ops``)."""
    zero_bubble = schedule == "zero_bubble"
    per_round = m // max(1, m // p)
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - rank), m * v)
    steady = m * v - warmup

    def fwd_stage(op):
        return (op // per_round) % v * p + rank

    def bwd_stage(op):
        return (v - 1 - ((op - warmup) // per_round) % v) * p + rank

    out: list[tuple[int, str, int]] = []
    count = {"F": {}, "B": {}, "W": {}}

    def add(stage, kind, key):
        i = count[key].get(stage, 0)
        count[key][stage] = i + 1
        out.append((stage, kind, i))

    backward_ops, weights_done = [], 0
    for op in range(warmup + steady + warmup):
        if op < warmup + steady:
            add(fwd_stage(op), "F", "F")
        if op >= warmup:
            add(bwd_stage(op), "I" if zero_bubble else "B", "B")
            backward_ops.append(op)
            if zero_bubble and op - warmup >= rank:
                add(bwd_stage(backward_ops[weights_done]), "W", "W")
                weights_done += 1
    while zero_bubble and weights_done < len(backward_ops):
        add(bwd_stage(backward_ops[weights_done]), "W", "W")
        weights_done += 1
    return out


def _zbv_actions(p: int, m: int, rank: int) -> list[tuple[int, str, int]]:
    """ZB-V (torch's ``ScheduleZBVZeroBubble``): stages r and 2p - 1 - r."""
    n_micro = max(2 * p - 1, m)
    s0, s1 = rank, 2 * p - 1 - rank
    out: list[tuple[int, str, int]] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - rank) - 1):
        out.append((s0, "F", f0))
        f0 += 1
    for _ in range(rank):
        out += [(s1, "F", f1), (s0, "F", f0)]
        f1 += 1
        f0 += 1
    for _ in range(p - rank):
        out += [(s1, "F", f1), (s1, "I", b1), (s1, "W", b1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n_micro:
        if f0 < n_micro:
            out.append((s0, "F", f0))
            f0 += 1
        out += [(s0, "I", b0), (s0, "W", b0), (s1, "F", f1), (s1, "I", b1), (s1, "W", b1)]
        b0 += 1
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        out += [(s0, "I", b0), (s1, "I", b1)]
        b0 += 1
        b1 += 1
    for _ in range(p - rank):
        out += [(s0, "I", b0), (s0, "W", w0)]
        b0 += 1
        w0 += 1
    out += [(s1, "W", i) for i in range(w1, b1)] + [(s0, "W", i) for i in range(w0, b0)]
    return [a for a in out if a[2] < m]   # the order is built for at least 2p - 1


def _dualpipev_actions(p: int, m: int, rank: int) -> list[tuple[int, str, int]]:
    """DualPipeV (torch's ``ScheduleDualPipeV``): stages r and 2p - 1 - r; an overlapped
    forward + backward pair counts as the forward, then the backward."""
    s0, s1 = rank, 2 * p - 1 - rank
    out: list[tuple[int, str, int]] = []
    count: dict[tuple[int, str], int] = {}
    weights: list[tuple[int, int]] = []

    def add(stage, kind):
        key = (stage, "I" if kind == "B" else kind)
        i = count.get(key, 0)
        out.append((stage, kind, i))
        count[key] = i + 1
        if kind == "I":
            weights.append((stage, i))

    def pending_weight():
        if weights:
            stage, i = weights.pop(0)
            out.append((stage, "W", i))

    for _ in range(2 * (p - rank - 1)):
        add(s0, "F")
    for _ in range(rank + 1):
        add(s0, "F")
        add(s1, "F")
    for _ in range(p - rank - 1):
        add(s1, "I")
        pending_weight()
        add(s1, "F")
    for _ in range(m - 2 * p + rank + 1):        # each pair overlapped (but the last rank's first)
        add(s0, "F")
        add(s1, "B")
        add(s1, "F")
        add(s0, "B")
    for _ in range(p - rank - 1):
        add(s1, "B")
        add(s1, "F")
        add(s0, "B")
    zb = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            zb = True
        add(s1, "I" if zb else "B")
        if i == (rank + 1) // 2 and rank % 2 == 0:
            zb = True
        add(s0, "I" if zb else "B")
    for _ in range(p - rank - 1):
        pending_weight()
        add(s0, "I" if zb else "B")
    for _ in range(rank + 1):
        pending_weight()
    return out


def in_flight(actions: list[tuple[int, str, int]], stage_bytes: dict[int, float],
              whole_backward: frozenset[int] = frozenset()) -> tuple[float, int]:
    """(bytes, micro-batch activation sets) a rank holds at its peak when each forward of
    stage s keeps ``stage_bytes[s]`` until that micro-batch's backward on s frees it: a
    full backward (B), or the weight half (W) of a split one (the input half, I, leaves
    what the weight gradients need: counted as all of it). A stage in ``whole_backward``
    runs its weight gradients with its input gradients (the trainer's last stage of a tied
    head with MTP modules under a split-backward schedule: ``StageChunk.splits_backward``),
    so its I frees the set and its W frees nothing."""
    held: dict[tuple[int, int], float] = {}
    total = peak = 0.0
    count = 0
    for stage, kind, mb in actions:
        if kind == "F":
            held[(stage, mb)] = stage_bytes[stage]
            total += stage_bytes[stage]
            if total > peak or (total == peak and len(held) > count):
                peak, count = total, len(held)
        elif kind == "B" or kind == ("I" if stage in whole_backward else "W"):
            total -= held.pop((stage, mb))
    return peak, count
