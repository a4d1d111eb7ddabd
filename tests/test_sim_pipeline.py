"""The simulator under a pipeline (``parallel.pp``): the schedule orders it reads the
activations in flight from are torch's own, each pipeline rank's memory adds up to the
model, the bubble and p2p times come out as the formulas say, ``describe`` prints the
split and ``--fit`` ranks pipeline layouts; the recipes' pipeline layouts fit 80 GiB.
Pure computations: nothing is built and no process is started."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from epscale.cli import main as cli_main
from epscale.commands.describe import describe, fit_report
from epscale.config import (ConfigError, ModelConfig, MoEConfig, ParallelConfig, RunConfig,
                            TrainConfig, load_recipe, recipe_path)
from epscale.plan import ClusterSpec, simulate
from epscale.plan.layout import Layout
from epscale.plan.memory import DTYPE_BYTES, Activations, estimate, memory_per_rank, pipeline_memory
from epscale.plan.pipeline import (balance_ranks, block_flops, bubble_fraction, bubble_time,
                                   head_flops, in_flight, layers_per_stage, mtp_flops, rank_costs,
                                   schedule_actions, stage_flops, with_mtp)
from epscale.plan.shapes import Work, nonexpert_parts, train_gemms_time
from epscale.plan.routing import RoutingSpec
from epscale.plan.sizing import model_size

GiB = 2 ** 30
SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3),
             ("zero_bubble", 2), ("zbv", 2), ("dualpipev", 2)]


def _cfg(pp=2, schedule="1f1b", virtual=1, m=8, layers=8, E=4, ep=1, dense=1,
         **parallel) -> RunConfig:
    return RunConfig(
        model=ModelConfig(vocab_size=64, dim=32, num_layers=layers, num_heads=4, seq_len=16,
                          dense_hidden_dim=48, num_dense_layers=dense, tie_embeddings=False),
        moe=MoEConfig(dim=32, hidden_dim=24, num_experts=E, top_k=2),
        parallel=ParallelConfig(pp=pp, pp_schedule=schedule, pp_virtual_stages=virtual, ep=ep,
                                **parallel),
        train=TrainConfig(micro_batch_size=1, grad_accum=m))


# ------------------------------------------------------------ the schedules' orders

def _torch_order(schedule: str, p: int, m: int, v: int, rank: int) -> list[tuple[int, str, int]]:
    """torch's own compute order for one rank, from its schedule classes' order generators
    (called on bare instances: they need no stages or process group)."""
    from torch.distributed.pipelining import schedules as S

    if schedule == "gpipe":
        obj = object.__new__(S.ScheduleGPipe)
        obj._num_stages, obj._n_microbatches = p, m
        order = obj._get_pipeline_order()[rank]
    else:
        cls = {"interleaved_1f1b": S.ScheduleInterleaved1F1B,
               "zero_bubble": S.ScheduleInterleavedZeroBubble,
               "zbv": S.ScheduleZBVZeroBubble, "dualpipev": S.ScheduleDualPipeV}[schedule]
        obj = object.__new__(cls)
        obj.pp_group_size, obj._n_microbatches, obj.n_local_stages = p, m, v
        obj.num_stages = obj._num_stages = p * v
        obj.number_of_rounds = max(1, m // p)
        obj.microbatches_per_round = m // obj.number_of_rounds
        order = obj._calculate_single_rank_operations(rank)
    out = []
    for a in order:
        if a is None:
            continue
        kind = a.computation_type.value
        for sub in (a.sub_actions if kind == "OVERLAP_F_B" else [a]):
            if sub.computation_type.value in ("F", "B", "I", "W"):
                out.append((sub.stage_index, sub.computation_type.value, sub.microbatch_index))
    return out


@pytest.mark.parametrize("schedule,v", [s for s in SCHEDULES if s[0] != "1f1b"])
def test_schedule_orders_are_torchs(schedule, v):
    for p in (2, 3, 4):
        for m in sorted({p, 2 * p, 3 * p, 4 * p + 4, 16}):
            if schedule in ("zbv", "dualpipev") and m < 2 * p:
                continue
            if v > 1 and schedule not in ("zbv", "dualpipev") and m % max(1, m // p):
                continue
            for r in range(p):
                assert schedule_actions(schedule, p, m, v, r) == _torch_order(schedule, p, m, v, r), \
                    (schedule, p, m, r)


def test_1f1b_order_is_the_one_torch_runs():
    """Schedule1F1B runs min(m, p - r) forwards, then a backward and a forward in turn
    (its _step_microbatches; the order its IR prints names the last rank's forwards from
    1, not 0)."""
    for p, m in ((2, 2), (4, 4), (4, 9), (8, 16)):
        for r in range(p):
            warm = min(m, p - r)
            want = [(r, "F", i) for i in range(warm)]
            for i in range(m):
                want.append((r, "B", i))
                if warm + i < m:
                    want.append((r, "F", warm + i))
            assert schedule_actions("1f1b", p, m, 1, r) == want


def test_micro_batches_in_flight():
    """1F1B rank r keeps min(m, p - r) micro-batches (the first p, the last 1); GPipe all
    m; interleaved 1F1B (v - 1) p + 2 (p - 1 - r) + 1 stage sets (about p + (p - 1) / v
    micro-batches of the whole rank on rank 0); interleaved zero-bubble v p; ZB-V 2p and
    DualPipeV 2p + 1 on every rank."""
    def held(schedule, p, m, v):
        ones = {s: 1.0 for s in range(p * v)}
        return [in_flight(schedule_actions(schedule, p, m, v, r), ones)[1] for r in range(p)]

    assert held("1f1b", 4, 16, 1) == [4, 3, 2, 1]
    assert held("1f1b", 8, 3, 1) == [3, 3, 3, 3, 3, 3, 2, 1]
    assert held("gpipe", 4, 6, 1) == [6] * 4
    assert held("interleaved_1f1b", 4, 16, 2) == [(2 - 1) * 4 + 2 * (4 - 1 - r) + 1 for r in range(4)]
    assert held("interleaved_1f1b", 4, 16, 3) == [(3 - 1) * 4 + 2 * (4 - 1 - r) + 1 for r in range(4)]
    assert held("zero_bubble", 4, 16, 2) == [8] * 4
    assert held("zbv", 4, 16, 2) == [8] * 4
    assert held("dualpipev", 4, 16, 2) == [9] * 4
    # bytes: the peak mixes stages, each with its own set (rank 0 of 2, stages 0 and 2: F0
    # F1 of both, F2 of stage 0, B0 of stage 2, then F3 of stage 0)
    peak, count = in_flight(schedule_actions("interleaved_1f1b", 2, 4, 2, 0), {0: 10.0, 2: 1.0})
    assert (peak, count) == (4 * 10.0 + 1 * 1.0, 5)


def test_bubble_for_known_cases():
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("gpipe", 8, 8) == pytest.approx(7 / 15)
    assert bubble_fraction("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction("zero_bubble", 4, 8, 2) == pytest.approx(3 / 51)
    # DualPipeV: (p - 1)(F&B + B - 3W) with F = W = B / 2, a third of 1F1B's share
    assert bubble_fraction("dualpipev", 16, 32, 2) == pytest.approx(15 / (3 * 32 + 15))
    assert bubble_fraction("zbv", 4, 8, 2) == 0.0 == bubble_fraction("1f1b", 1, 8)


def test_bubble_time_is_the_sources_formula_in_chunk_times():
    """One chunk's F, B (input + weight halves) and W: 1F1B and interleaved (p - 1)(F + B),
    ZB-H1 (p - 1)(F + B - 2W), DualPipeV (p - 1)(F&B + B - 3W) with F&B = F + B, ZB-V
    none once m >= 2p (ZB-H1 below it). A recomputed forward in B (F = W = 1, B = 3)
    grows the zero-bubble schedules' idle: W no longer covers it."""
    assert bubble_time("1f1b", 4, 8, 1.0, 2.0, 1.0) == pytest.approx(9.0)
    assert bubble_time("interleaved_1f1b", 4, 8, 1.0, 2.0, 1.0) == pytest.approx(9.0)
    assert bubble_time("zero_bubble", 4, 8, 1.0, 2.0, 1.0) == pytest.approx(3.0)
    assert bubble_time("dualpipev", 4, 8, 1.0, 2.0, 1.0) == pytest.approx(3 * (3 + 2 - 3))
    assert bubble_time("dualpipev", 4, 8, 1.0, 3.0, 1.0) == pytest.approx(3 * (4 + 3 - 3))
    assert bubble_time("zero_bubble", 4, 8, 1.0, 3.0, 1.0) == pytest.approx(3 * 2)
    assert bubble_time("zbv", 4, 8, 1.0, 2.0, 1.0) == 0.0
    assert bubble_time("zbv", 4, 4, 1.0, 2.0, 1.0) == pytest.approx(3.0)
    assert bubble_time("dualpipev", 1, 4, 1.0, 2.0, 1.0) == 0.0


# ------------------------------------------------------------ memory per pipeline rank

@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_stage_parameters_add_up_to_the_model(schedule, v):
    cfg = _cfg(pp=2, schedule=schedule, virtual=v, m=8)
    size = model_size(cfg)
    one = memory_per_rank(cfg, world=2)              # a stage of one rank: everything once
    ranks = pipeline_memory(cfg, Layout.from_config(cfg, 2))
    assert sum(r.memory.params_per_rank for r in ranks) == size.total_params
    assert one.total == max(r.memory.total for r in ranks)
    stages = sorted(s for r in ranks for s in r.stages)
    assert stages == list(range(2 * v)) and sum(b - a for r in ranks for a, b in r.layers) == 8
    # ep=2 inside each stage: a rank holds half of its stages' experts
    ep = pipeline_memory(cfg, Layout.from_config(cfg, 4, ep=2))
    assert sum(r.memory.params_per_rank for r in ep) == size.total_params - size.expert_params / 2
    # FSDP over the stage's 4 ranks: a quarter each (whole rows: a little more)
    f = pipeline_memory(cfg, Layout.from_config(cfg, 8, ep=2, fsdp=True))
    held = sum(r.memory.params_per_rank for r in f) * 4
    assert size.total_params <= held < size.total_params * 1.15
    assert all(r.memory.gathered > 0 for r in f)


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
@pytest.mark.parametrize("tie,depth", [(True, 0), (False, 1), (True, 2)])
def test_the_last_stage_holds_the_mtp_modules_and_a_copy_of_the_embedding(schedule, tie, depth):
    """At pp > 1 the rank with the last stage holds the multi-token-prediction modules and
    its own copy of the embedding (a tied head, the modules' lookups), also where it holds
    the first stage too (DualPipeV's rank 0); the trainer's split counts the modules in
    the last stage's cost."""
    from dataclasses import replace

    base = _cfg(pp=2, schedule=schedule, m=8, layers=8)
    cfg = replace(base, model=replace(base.model, tie_embeddings=tie, mtp_depth=depth))
    V, D = cfg.model.vocab_size, cfg.model.dim
    size = model_size(cfg)
    for world, extra in ((2, {}), (4, {"ep": 2, "fsdp": True})):
        ranks = pipeline_memory(cfg, Layout.from_config(cfg, world, **extra))
        last = next(r for r in ranks if max(r.stages) == max(s for q in ranks for s in q.stages))
        alone = pipeline_memory(base, Layout.from_config(base, world, **extra))[last.rank]
        if world == 2:   # every parameter once, plus the copy
            assert sum(r.memory.params_per_rank for r in ranks) == size.total_params + V * D
        # ``base`` is untied: a tied head's copy weighs what its output head does
        mine, before = last.memory.params_per_rank, alone.memory.params_per_rank
        assert (mine == before) if depth == 0 else (mine > before)
        assert last.memory.activations > alone.memory.activations or depth == 0
    # the trainer's split: the modules weigh on the last stage (fewer of the model's blocks)
    plain = layers_per_stage(replace(cfg, model=replace(cfg.model, mtp_depth=0)))
    split = layers_per_stage(cfg)
    assert sum(split) == 8 and (split[-1] < plain[-1] if depth else split == plain)
    # the step model charges that split, the modules' blocks on the last stage
    assert layers_per_stage(with_mtp(cfg, depth)) == split[:-1] + [split[-1] + depth]


def test_1f1b_ranks_keep_p_to_one_micro_batches():
    p, m = 4, 8
    cfg = _cfg(pp=p, m=m, layers=8, dense=0, pp_layers_per_stage=[2, 2, 2, 2])
    # bf16 under FSDP (one rank per stage): a bf16 residual stream, bf16 receive buffers
    lay, acts = Layout.from_config(cfg, p, fsdp=True), Activations.of(cfg, "full", "bfloat16")
    ranks = pipeline_memory(cfg, lay, acts)
    assert [r.in_flight for r in ranks] == [4, 3, 2, 1]
    T, D, V = 16, 32, 64
    act = T * D * 2
    # bf16 autocast (no FSDP): the stages pass the fp32 residual stream, twice the bytes
    autocast = pipeline_memory(cfg, Layout.from_config(cfg, p), acts)
    assert [r.memory.p2p_buffers for r in autocast] == [2 * r.memory.p2p_buffers for r in ranks]
    # full recomputation: two block inputs; the first stage has the token ids, a stage
    # with a receive buffer keeps no copy of its input, the last adds head and logits
    sets = [r.stage_activations[0] for r in ranks]
    assert sets[0] == 2 * act + T * 8 + act
    assert sets[1] == sets[2] == 2 * act + act - act
    assert ranks[0].memory.activations == 4 * sets[0]
    assert ranks[1].memory.activations == 3 * sets[1]
    assert ranks[3].memory.activations == sets[3] > sets[1]
    # receive buffers, each held while its micro-batch is in flight: one gradient on all
    # but the last, the p - r inputs in flight on all but the first (torch holds m each)
    assert [r.memory.p2p_buffers for r in ranks] == [act, 4 * act, 3 * act, act]
    assert [r.p2p_send_bytes for r in ranks] == [m * act, 2 * m * act, 2 * m * act, m * act]
    # the embedding on the first, the norm and head on the last
    emb = V * D
    assert ranks[0].memory.params_per_rank - ranks[1].memory.params_per_rank == emb
    assert ranks[3].memory.params_per_rank - ranks[2].memory.params_per_rank == emb + D
    assert estimate(cfg, lay, acts) == max((r.memory for r in ranks), key=lambda x: x.total)


def test_pipeline_layout_errors_name_the_key():
    cfg = _cfg(pp=2, m=8)
    with pytest.raises(ConfigError, match=r"'parallel.pp' = 2 is invalid: must divide the number of processes \(3\)"):
        memory_per_rank(cfg, world=3)
    with pytest.raises(ConfigError, match=r"'parallel.ep' = 4 is invalid: must divide the 2 ranks of one pipeline stage \(world 4 / pp 2\)"):
        memory_per_rank(cfg, world=4, ep=4)
    with pytest.raises(ConfigError, match="'train.grad_accum' = 2 .* 1f1b needs at least pp = 4"):
        memory_per_rank(_cfg(pp=2, m=2), world=4, pp=4)
    with pytest.raises(ConfigError, match="'parallel.pp' = 16 .*model.num_layers is 8"):
        memory_per_rank(cfg, pp=16)
    # a tied head under a pipeline: the last stage holds a copy of the embedding
    tied = load_recipe("tiny", ["train.grad_accum=2"])
    assert tied.model.tie_embeddings and memory_per_rank(tied, pp=2).total > 0
    with pytest.raises(ConfigError, match=r"'train.global_batch_size' = 10 .* at 4 data-parallel ranks \(8 / pp 2\)"):
        memory_per_rank(RunConfig(model=cfg.model, moe=cfg.moe, parallel=cfg.parallel,
                                  train=TrainConfig(micro_batch_size=1, global_batch_size=10)),
                        world=8)


# ------------------------------------------------------------ the step model

def test_step_model_bubble_p2p_and_tokens():
    """pp=2, 1F1B, m=4 on two 8-GPU nodes: the bubble is (p - 1) / (m + p - 1) of the
    pipeline time, each rank receives one activation or gradient per micro-batch (over
    the NIC when a stage fills a node, NVLink when both stages share one), and a GPU's
    tokens are the step's m x T over the pipeline's p GPUs."""
    m, T, D = 4, 64, 32
    cfg = RunConfig(model=ModelConfig(vocab_size=64, dim=D, num_layers=4, num_heads=4, seq_len=T,
                                      tie_embeddings=False),
                    moe=MoEConfig(dim=D, hidden_dim=48, num_experts=8, top_k=2),
                    parallel=ParallelConfig(pp=2, ep=8), train=TrainConfig(micro_batch_size=1,
                                                                           grad_accum=m))
    cl = ClusterSpec(nodes=2, gpus_per_node=8, inter_bw_GBps=10, inter_latency_us=20,
                     intra_bw_GBps=100, intra_latency_us=5)
    r = simulate(cfg, cl, RoutingSpec.parse("uniform"), strategies=("none",),
                 dispatchers=("dedup",), overlap="none")[0]
    pipe = r.step_time_s - r.dp_comm_s
    assert r.bubble_s / pipe == pytest.approx(bubble_fraction("1f1b", 2, m))
    assert r.p2p_s == pytest.approx(m * (T * D * 4 / 10e9 + 20e-6))
    assert r.tokens_per_s_per_gpu == pytest.approx(m * T / 2 / r.step_time_s)
    # both stages in one node: NVLink
    small = RunConfig(model=cfg.model, moe=cfg.moe, parallel=ParallelConfig(pp=2, ep=4),
                      train=cfg.train)
    one = simulate(small, ClusterSpec(nodes=1, gpus_per_node=8, intra_bw_GBps=100,
                                      intra_latency_us=5), RoutingSpec.parse("uniform"),
                   strategies=("none",), dispatchers=("dedup",), overlap="none")[0]
    assert one.p2p_s == pytest.approx(m * (T * D * 4 / 100e9 + 5e-6))
    with pytest.raises(ConfigError, match="parallel.pp = 4 is invalid.*fill whole nodes"):
        simulate(RunConfig(model=cfg.model, moe=cfg.moe, parallel=ParallelConfig(pp=4, ep=2),
                           train=cfg.train), ClusterSpec(nodes=3, gpus_per_node=8))


def test_step_model_dualpipev_bubble_from_its_own_chunk_times():
    """DualPipeV at p = 2 (4 stages), one EP rank (no expert transfers), no recomputation:
    a chunk's time t is half the rank's compute and p2p per micro-batch, F = t / 3,
    B = 2t / 3, W a third of its compute alone, and the bubble (p - 1)(F&B + B - 3W);
    smaller than 1F1B's at the same layout, which is (p - 1) x the rank's whole time."""
    m = 8
    res = {}
    for schedule in ("dualpipev", "1f1b"):
        cfg = _cfg(pp=2, schedule=schedule, virtual=2 if schedule == "dualpipev" else 1, m=m)
        res[schedule] = r = simulate(cfg, ClusterSpec(nodes=1, gpus_per_node=2),
                                     RoutingSpec.parse("uniform"), strategies=("none",),
                                     dispatchers=("dedup",), overlap="none")[0]
        assert r.expert_comm_s == 0.0 and r.fsdp_comm_s == 0.0 and r.p2p_s > 0
    r = res["dualpipev"]
    t = (r.compute_s + r.p2p_s) / m / 2
    f, b, w = t / 3, 2 * t / 3, r.compute_s / m / 2 / 3
    assert r.bubble_s == pytest.approx((2 - 1) * ((f + b) + b - 3 * w))
    one = res["1f1b"]
    assert one.bubble_s == pytest.approx((one.compute_s + one.p2p_s) / m)
    assert 0 < r.bubble_s < one.bubble_s


def test_shared_loads_give_the_same_results():
    cfg = load_recipe("ref-1t-64e", ["parallel.pp=4", "parallel.dp_shard=128", "train.grad_accum=16"])
    cl = ClusterSpec(nodes=128, gpus_per_node=8)
    cache: dict = {}
    a = simulate(cfg, cl, step_samples=2, loads_cache=cache)
    b = simulate(cfg, cl, step_samples=2, loads_cache=cache)
    c = simulate(cfg, cl, step_samples=2)
    assert [x.as_dict() for x in a] == [x.as_dict() for x in b] == [x.as_dict() for x in c]
    assert len(cache) == 1


# ------------------------------------------------------------ describe and the recipes

def _documented_overrides(recipe: str) -> list[str]:
    """The pipeline layout a recipe's comments give as key=value overrides."""
    text = Path(recipe_path(recipe)).read_text()
    lines = [ln[1:].strip() for ln in text.splitlines()
             if re.match(r"#\s+(parallel|train)\.\w+=", ln)]
    return " ".join(lines).split()


def test_describe_prints_the_split_and_the_largest_rank(capsys):
    over: list[str] = []  # the recipe's own layout: the published pipeline
    assert load_recipe("deepseek-v3").parallel.pp == 16
    assert cli_main(["describe", "deepseek-v3", *over]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "pipeline: dualpipev, 32 stages over pp=16 ranks" in out
    # DualPipeV: (p - 1) / (3 m + p - 1) = 15 / 207 at equal stages, F = W = B / 2
    assert "bubble: 7.2% of the step for dualpipev at 64 micro-batches" in out
    assert "memory per pipeline rank" in out and "p2p receive buffers" in out
    info = describe("deepseek-v3", over)
    pipe = info["pipeline"]
    assert [s["layers"][0] for s in pipe["stages"]] == [0] + [s["layers"][1] for s in pipe["stages"][:-1]]
    assert pipe["stages"][-1]["layers"][1] == 61 and pipe["num_stages"] == 32
    assert sum(s["flops_share"] for s in pipe["stages"]) == pytest.approx(1.0)
    assert [s["rank"] for s in pipe["stages"][:2]] == [0, 1] and pipe["stages"][-1]["rank"] == 0
    largest = max(pipe["ranks"], key=lambda r: r["memory"]["total"])
    assert largest["rank"] == pipe["largest_rank"] and largest["memory"] == info["memory"]
    assert pipe["p2p_bytes_per_boundary"] == 64 * 4096 * 7168 * DTYPE_BYTES["bfloat16"]
    # the command-line options give the same layout as the keys
    assert cli_main(["describe", "deepseek-v3", "--json", "--pp", "16", "--pp-schedule", "dualpipev",
                     "--fsdp", "--world", "2048", "--ep", "64", "train.grad_accum=64"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"] == info["memory"]
    replicated = describe("deepseek-v3", ["parallel.fsdp=false", "parallel.dp_shard=null",
                                          "parallel.zero=3", "parallel.dp=2"])
    assert cli_main(["describe", "deepseek-v3", "--json", "--pp", "16", "--pp-schedule", "dualpipev",
                     "--no-fsdp", "--dp", "2", "--ep", "64", "train.grad_accum=64"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"] == replicated["memory"]
    assert cli_main(["describe", "deepseek-v3", "--pp", "16", "--pp-schedule", "dualpipev",
                     "--no-fsdp", "--dp", "2", "train.grad_accum=16"]) == 2
    assert "needs at least 2 x pp = 32 micro-batches" in capsys.readouterr().err


def test_recipes_and_their_pipeline_layouts_fit_80gib():
    """deepseek-v3 trains with the published pipeline and documents the layout without one;
    ref-1t-64e the other way round. Both layouts of each fit 80 GiB."""
    pp_of = {}
    for recipe in ("deepseek-v3", "ref-1t-64e"):
        own = describe(recipe)
        alternative = describe(recipe, _documented_overrides(recipe))
        for info in (own, alternative):
            assert info["memory"]["total"] < 80 * GiB, recipe
        pp_of[recipe] = (own["layout"].get("pp", 1), alternative["layout"].get("pp", 1))
    assert pp_of == {"deepseek-v3": (16, 1), "ref-1t-64e": (1, 4)}
    ds = describe("deepseek-v3")["layout"]
    assert (ds["world"], ds["pp"], ds["ep"]) == (2048, 16, 64)


def test_fit_ranks_pipeline_layouts_for_deepseek_v3():
    info = fit_report("deepseek-v3", None, "80GiB", "h800-2048", top=500, gpus=2048)
    pp = [r for r in info["layouts"] if r["layout"]["pp"] > 1]
    assert pp and any(r["layout"]["pp"] == 16 and r["layout"]["ep"] == 64 for r in pp)
    for r in pp[:5]:          # the overrides give the layout and its memory
        cfg = load_recipe("deepseek-v3", r["overrides"])
        assert memory_per_rank(cfg, world=2048).total == r["memory"]["total"] <= 80 * GiB
        # the recipe's global batch: 128 data ranks x 64 sequences, over world / pp
        # data-parallel ranks
        assert r["layout"]["micro_batches"] == 128 * 64 // (2048 // r["layout"]["pp"])
    # every listed layout's overrides load (a whole-block recomputation mode turns the
    # recipe's fp8 storage off, which the overrides must say)
    for r in info["layouts"]:
        assert load_recipe("deepseek-v3", r["overrides"]).train.activation_checkpointing == \
            r["layout"]["activation_checkpointing"]


def test_pipeline_traffic_per_gpu_is_the_ranks_mean_whatever_the_overlap():
    """Under a pipeline the per-GPU dispatch traffic is the mean over the pipeline ranks of
    their own MoE layers' bytes: the same with and without overlap (which changes the rank
    that sets the pace) and for any split of the same layers over the stages."""
    def run(split, overlap):
        cfg = RunConfig(
            model=ModelConfig(vocab_size=20000, dim=64, num_layers=8, num_heads=4, seq_len=64,
                              num_dense_layers=0, tie_embeddings=False),
            moe=MoEConfig(dim=64, hidden_dim=32, num_experts=16, top_k=4),
            parallel=ParallelConfig(pp=2, ep=8, pp_layers_per_stage=split),
            train=TrainConfig(micro_batch_size=1, grad_accum=4))
        cl = ClusterSpec(nodes=2, gpus_per_node=8, inter_bw_GBps=10, intra_bw_GBps=10,
                         gemm_tflops=1)
        return simulate(cfg, cl, RoutingSpec.parse("uniform"), strategies=("none",),
                        dispatchers=("dedup",), overlap=overlap)[0]

    ref = run([4, 4], "none")
    assert ref.intra_bytes_per_gpu > 0
    for split in ([6, 2], [4, 4]):
        for overlap in ("none", "full"):
            r = run(split, overlap)
            assert r.intra_bytes_per_gpu == pytest.approx(ref.intra_bytes_per_gpu, rel=1e-9)
            assert r.inter_bytes_per_gpu == pytest.approx(ref.inter_bytes_per_gpu, rel=1e-9)


def test_fit_tries_each_pipeline_once():
    """deepseek-v3 names dualpipev with pp_virtual_stages 1 (read as 2): --fit lists each
    (pp, schedule) once, and its own layout keeps the recipe's stage split."""
    from epscale.config.schema import SPLIT_BACKWARD_SCHEDULES
    from epscale.plan.fit import candidates, pipelines, recompute_choices

    cfg = load_recipe("deepseek-v3")
    cl = ClusterSpec(nodes=256, gpus_per_node=8)
    pipes = pipelines(cfg, cl)
    assert len(pipes) == len(set(pipes))
    assert len({(pp, s) for pp, s, _ in pipes}) == len(pipes)
    assert (16, "dualpipev", 2) in pipes
    # pipelines take a tied head, MTP modules and document masking: --fit tries them too
    mtp = load_recipe("deepseek-v3", ["model.mtp_depth=1", "model.tie_embeddings=true",
                                      "data.doc_masking=true"])
    assert pipelines(mtp, cl) == pipes
    split = [1] * 32
    split[-1] = 61 - 31
    own = load_recipe("deepseek-v3", ["parallel.pp_layers_per_stage=[" + ",".join(map(str, split)) + "]"])
    keys = [(c.parallel.pp, c.parallel.pp_schedule, c.parallel.pp_virtual_stages,
             c.parallel.ep, c.parallel.fsdp, c.parallel.dp_replicate,
             c.train.activation_checkpointing, tuple(c.train.recompute_modules))
            for c in candidates(own, cl)]
    assert len(keys) == len(set(keys))
    # light recomputation (DeepSeek's modules: the recipe's own) is tried first, before
    # whole-block recomputation; a recipe without modules tries none, then the light ones
    light = ("none", ("norm", "mla_up_proj", "moe_act"))
    assert [(ac, tuple(m)) for ac, m in recompute_choices(own)] == [
        light, ("selective", ()), ("full", ())]
    plain = load_recipe("deepseek-v3", ["train.recompute_modules=[]"])
    assert [(ac, sorted(m)) for ac, m in recompute_choices(plain)] == [
        ("none", []), ("none", sorted(light[1])), ("selective", []), ("full", [])]
    assert sum(k[-2:] == light for k in keys) == sum(k[-2:] == ("full", ()) for k in keys) > 0
    assert any(c.parallel.pp_layers_per_stage == split for c in candidates(own, cl))
    # FSDP under a split-backward schedule only at ZeRO-1 (the trainer refuses ZeRO-3 there)
    zero3 = load_recipe("deepseek-v3", ["parallel.zero=3"])
    split_fsdp = [c.parallel for c in candidates(zero3, cl) if c.parallel.fsdp
                  and c.parallel.pp > 1 and c.parallel.pp_schedule in SPLIT_BACKWARD_SCHEDULES]
    assert split_fsdp and {p.zero for p in split_fsdp} == {1}


# ------------------------------------------------------------ multi-token prediction (step model)

def test_balance_ranks_balances_each_ranks_stages_as_a_whole():
    """DualPipeV's rank 0 holds the first stage and the last (with the head): balanced by
    rank, its first stage gives a block away; one stage per rank is left as it is."""
    v_placement = [[0, 3], [1, 2]]
    before = [2, 2, 2, 2]
    assert rank_costs(before, [1.0] * 8, 2.0, v_placement) == [6.0, 4.0]
    after = balance_ranks(before, [1.0] * 8, 2.0, v_placement)
    assert sum(after) == 8 and min(after) >= 1 and after[0] < before[0]
    assert rank_costs(after, [1.0] * 8, 2.0, v_placement) == [5.0, 5.0]
    assert balance_ranks([3, 5], [1.0] * 8, 9.0, [[0], [1]]) == [3, 5]
    # the last stage keeps min_last blocks (the MTP modules' own)
    assert balance_ranks([1, 1, 1, 2], [1.0] * 5, 6.0, v_placement, min_last=2)[-1] >= 2


def test_blocks_sit_as_late_as_the_slowest_stage_allows():
    """The trainer's split keeps the bottleneck of the balanced one and moves blocks to
    later stages (fewer micro-batches in flight): 8 equal blocks over 3 stages go [3, 3, 2]
    balanced and [2, 3, 3] late; no stage becomes slower than the slowest was; a looped or
    V schedule keeps its ranks' worst cost."""
    from epscale.plan.pipeline import _balanced, _late_as_possible, layers_label, stage_placement

    # how the header and describe print a stage (an empty last stage holds the MTP modules)
    assert [layers_label(0, 3), layers_label(7, 8), layers_label(8, 8, 1),
            layers_label(5, 7, 2), layers_label(4, 4)] == ["0-2", "7", "MTP x1", "5-6 + MTP x2", "-"]

    costs = (1.0,) * 8
    assert _balanced(costs, 3, 0.0) == [3, 3, 2]
    assert _late_as_possible(costs, [3, 3, 2], 0.0) == [2, 3, 3]
    # with a head, the last stage takes no block that would make it the slowest
    assert _late_as_possible(costs, [3, 3, 2], 0.5) == [3, 3, 2]
    # a heavy head stays alone with its one block; the others move back to it
    assert _late_as_possible(costs, [4, 3, 1], 3.0) == [3, 4, 1]
    # dense first blocks (cheap): the late split gives the first stage fewer of them
    mixed = (0.5, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    late = _late_as_possible(mixed, _balanced(mixed, 4, 0.0), 0.0)
    assert late[0] < _balanced(mixed, 4, 0.0)[0] and sum(late) == 8 and min(late) >= 1

    def stage_costs(split, c, head):
        out, start = [], 0
        for k in split:
            out.append(sum(c[start:start + k]))
            start += k
        out[-1] += head
        return out

    for split in ([3, 3, 2], [4, 3, 1], [2, 2, 2, 2]):
        for head in (0.0, 0.5, 2.0):
            assert max(stage_costs(_late_as_possible(costs, split, head), costs, head)) <= \
                max(stage_costs(split, costs, head))
    # layers_per_stage: never a worse rank than the balanced split, under every schedule
    for schedule, v in SCHEDULES:
        cfg = _cfg(pp=2, schedule=schedule, virtual=v, layers=8, dense=2)
        par = cfg.parallel
        placement = stage_placement(par.pp_schedule, par.pp, par.pp_virtual_stages)
        n = sum(len(h) for h in placement)
        blocks, head = block_flops(cfg), head_flops(cfg)
        balanced = _balanced(tuple(blocks), n, head)
        assert rank_costs(layers_per_stage(cfg), blocks, head, placement)[0] <= \
            rank_costs(balanced, blocks, head, placement)[0] * (1 + 1e-9)


def test_mtp_modules_sit_on_the_last_stage_with_their_head_passes():
    """Work.mtp_depth's run: depth more (MoE) blocks on the last stage, and per module a
    2 D -> D projection and one more head pass there (DeepSeek-V3's MTP, depth 1)."""
    cfg = _cfg(pp=2, schedule="dualpipev", virtual=2, layers=8, dense=1)
    assert with_mtp(cfg, 0) is cfg
    with pytest.raises(ConfigError, match="mtp_depth = -1 is invalid"):
        with_mtp(cfg, -1)
    c = with_mtp(cfg, 1)
    split = layers_per_stage(c)
    assert c.model.num_layers == 9 and sum(split) == 9 and c.model.is_moe_layer(8)
    D, V = cfg.model.dim, cfg.model.vocab_size
    assert mtp_flops(cfg, 1) == 2 * 2 * D * D + 2 * D * V
    last = block_flops(c)[9 - split[-1]:]
    assert stage_flops(c, 1)[-1] == pytest.approx(sum(last) + head_flops(c) + mtp_flops(c, 1))
    # balanced by rank: the worst rank is no worse than with the block simply appended
    placement = [[0, 3], [1, 2]]
    plain = layers_per_stage(cfg)
    appended = plain[:-1] + [plain[-1] + 1]
    extra = head_flops(cfg) + mtp_flops(cfg, 1)
    assert (rank_costs(split, block_flops(c), extra, placement)[0]
            <= rank_costs(appended, block_flops(c), extra, placement)[0])
    # a given split keeps its stages, the modules join the last one
    given = _cfg(pp=2, layers=8, pp_layers_per_stage=[3, 5])
    assert layers_per_stage(with_mtp(given, 2)) == [3, 7]


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_the_embedding_copys_gradient_exchange_is_charged_between_different_ranks(schedule):
    """A tied head at pp > 1: the copy replaces the untied head's weight on the last stage
    (the same parameters), and its gradient shard crosses once per step between the first
    and the last stage's ranks (fp32, over the NIC here: W = 8 GPUs a node); DualPipeV's
    rank 0 holds both ends and only adds."""
    from dataclasses import replace

    T, m, V, D = 64, 4, 4096, 32
    cl = ClusterSpec(nodes=2, gpus_per_node=8, inter_bw_GBps=10, intra_bw_GBps=100)
    untied = RunConfig(model=ModelConfig(vocab_size=V, dim=D, num_layers=4, num_heads=4,
                                         seq_len=T, tie_embeddings=False),
                       moe=MoEConfig(dim=D, hidden_dim=48, num_experts=8, top_k=2),
                       parallel=ParallelConfig(pp=2, pp_schedule=schedule, ep=8, fsdp=True,
                                               dp_shard=8),
                       train=TrainConfig(micro_batch_size=1, grad_accum=m))
    tied = replace(untied, model=replace(untied.model, tie_embeddings=True))

    def run(cfg):
        return simulate(cfg, cl, RoutingSpec.parse("uniform"), strategies=("none",),
                        dispatchers=("dedup",), overlap="none", step_samples=2)[0]

    a, b = run(untied), run(tied)
    exchange = V * D * 4 / 8 / (cl.inter_bw_GBps * 1e9) + cl.inter_latency_us * 1e-6
    assert b.dp_comm_s - a.dp_comm_s == pytest.approx(0.0 if schedule == "dualpipev" else exchange,
                                                      abs=1e-12)
    assert b.compute_s == pytest.approx(a.compute_s, rel=1e-12)


def test_mtp_slows_the_rank_with_the_head_and_charges_its_head_passes():
    m, T, D = 4, 64, 32
    cl = ClusterSpec(nodes=2, gpus_per_node=8, inter_bw_GBps=10, intra_bw_GBps=100)
    cfg = RunConfig(model=ModelConfig(vocab_size=4096, dim=D, num_layers=4, num_heads=4,
                                      seq_len=T, tie_embeddings=False),
                    moe=MoEConfig(dim=D, hidden_dim=48, num_experts=8, top_k=2),
                    parallel=ParallelConfig(pp=2, ep=8),
                    train=TrainConfig(micro_batch_size=1, grad_accum=m))
    def run(depth):
        return simulate(cfg, cl, RoutingSpec.parse("uniform"), strategies=("none",),
                        dispatchers=("dedup",), overlap="none", step_samples=2,
                        work=Work(mtp_depth=depth))[0]
    plain, mtp = run(0), run(1)
    assert mtp.step_time_s > plain.step_time_s
    assert sum(mtp.breakdown.values()) == pytest.approx(mtp.step_time_s, rel=1e-12)
    assert mtp.tokens_per_s_per_gpu == pytest.approx(m * T / 2 / mtp.step_time_s)
    # a module's head pass and projection in the non-expert parts (its block is a layer)
    flat = RunConfig(model=cfg.model, moe=cfg.moe, parallel=ParallelConfig(ep=8),
                     train=cfg.train)
    h100 = ClusterSpec(sm_count=132, mem_bw_GBps=3350.0, layer_overhead_us=0.0)
    one, two = (nonexpert_parts(flat, h100, T, Work(mtp_depth=d)) for d in (0, 1))
    assert two["gemm"] - one["gemm"] == pytest.approx(
        train_gemms_time(h100, T, 4096, D, "bf16") + train_gemms_time(h100, T, D, 2 * D, "bf16"))
    assert two["memory"] > one["memory"]
