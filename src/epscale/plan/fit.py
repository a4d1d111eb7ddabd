"""Layouts of a recipe that fit a GPU, fastest first (``epscale describe --fit``).

Every layout of the cluster's world is tried: each pipeline depth ``pp`` (1, and each
power of two that gives every pipeline rank at least two layers and stages that fill
whole nodes or divide one; schedules 1f1b and dualpipev, and the recipe's own), each
``ep`` the simulator accepts (it divides the experts and a stage's ranks, and divides a
node or spans whole nodes), replicated data parallelism and FSDP with every
``dp_replicate`` that leaves ``ep | dp_shard``, and each recomputation mode, light
recomputation before whole blocks (:func:`recompute_choices`). Every layout
keeps the recipe's global batch (``train.global_batch_size``, else its data-parallel ranks
x grad_accum x micro_batch_size at the cluster's world): a pipeline of pp ranks runs pp
times the micro-batches per step; layouts whose micro-batch count the schedule cannot run
are left out. A layout fits when :func:`epscale.plan.memory.estimate` (the largest
pipeline rank) stays within the GPU's memory; the fitting ones are ranked by the step
model's time (:func:`epscale.plan.step_model.simulate`, one balancing strategy and
dispatcher).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, replace

from ..config import ConfigError, RunConfig
from ..config.schema import SPLIT_BACKWARD_SCHEDULES, pp_stages_per_rank
from .cluster import ClusterSpec
from .memory import MemoryEstimate, memory_per_rank
from .pipeline import micro_batch_problem, micro_batches
from .step_model import simulate

AC_MODES = ("none", "selective", "full")
FIT_SCHEDULES = (("1f1b", 1), ("dualpipev", 2))   # (schedule, stages per rank) tried at pp > 1


@dataclass(frozen=True)
class FitResult:
    cfg: RunConfig              # the recipe at this layout
    memory: MemoryEstimate
    step_time_s: float
    tokens_per_s_per_gpu: float
    micro_batches: int = 1      # per step (what a pipeline schedules)
    recipe_pp: int = 1          # the recipe's own parallel.pp

    @property
    def layout(self) -> dict:
        par, train = self.cfg.parallel, self.cfg.train
        out = {"ep": par.ep, "fsdp": par.fsdp, "activation_checkpointing": train.activation_checkpointing}
        if train.recompute_modules:
            out["recompute_modules"] = list(train.recompute_modules)
        if par.fsdp:
            out["dp_replicate"] = par.dp_replicate
        else:
            out["dp"] = par.dp
        out["pp"] = par.pp
        if par.overlap_micro_batches:
            out["overlap_micro_batches"] = True
        if par.pp > 1:
            out.update(pp_schedule=par.pp_schedule, pp_virtual_stages=par.pp_virtual_stages,
                       micro_batches=self.micro_batches)
        return out

    def overrides(self) -> list[str]:
        """The key=value overrides that give the recipe this layout."""
        par, train = self.cfg.parallel, self.cfg.train
        if par.fsdp:
            out = ["parallel.fsdp=true", "parallel.dp=1", f"parallel.dp_replicate={par.dp_replicate}",
                   f"parallel.dp_shard={par.dp_shard}", "parallel.redundant_experts=0",
                   "parallel.spill_threshold=null", f"parallel.zero={par.zero}"]
        else:
            out = ["parallel.fsdp=false", f"parallel.dp={par.dp}", "parallel.dp_replicate=1",
                   "parallel.dp_shard=null", "parallel.zero=3",
                   f"parallel.redundant_experts={par.redundant_experts}"]
        out.append(f"parallel.ep={par.ep}")
        if par.pp > 1 or self.recipe_pp > 1:
            split = par.pp_layers_per_stage
            out += [f"parallel.pp={par.pp}", f"parallel.pp_schedule={par.pp_schedule}",
                    f"parallel.pp_virtual_stages={par.pp_virtual_stages}",
                    "parallel.pp_layers_per_stage=" + ("null" if split is None else
                                                       "[" + ",".join(map(str, split)) + "]")]
            if train.global_batch_size is None:
                out.append(f"train.grad_accum={train.grad_accum}")
        out.append(f"parallel.overlap_micro_batches={str(par.overlap_micro_batches).lower()}")
        return out + [f"train.activation_checkpointing={train.activation_checkpointing}",
                      "train.recompute_modules=[" + ",".join(train.recompute_modules) + "]",
                      f"train.activation_storage={train.activation_storage}"]


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending, in O(sqrt(n)) (a world of 10^12 ranks is asked)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _sim_accepts(ep: int, cluster: ClusterSpec, num_experts: int,
                 stage_world: int | None = None) -> bool:
    gpn = cluster.gpus_per_node
    W = cluster.world if stage_world is None else stage_world
    return (W % ep == 0 and num_experts % ep == 0
            and (ep % gpn == 0 if ep > gpn else gpn % ep == 0))


def global_batch(cfg: RunConfig, world: int) -> int:
    """Sequences per step every layout of ``world`` keeps: ``train.global_batch_size``, or
    the recipe's data-parallel ranks there (world / its pp) x grad_accum x micro_batch_size."""
    t = cfg.train
    if t.global_batch_size is not None:
        return t.global_batch_size
    return world // cfg.parallel.pp * t.grad_accum * t.micro_batch_size


def own_pipeline(cfg: RunConfig) -> tuple[int, str, int]:
    """The recipe's (pp, schedule, stages per rank), the stages as the schedule reads
    ``parallel.pp_virtual_stages`` (a V schedule's 1 is its 2)."""
    par = cfg.parallel
    if par.pp == 1:
        return 1, par.pp_schedule, par.pp_virtual_stages
    return par.pp, par.pp_schedule, pp_stages_per_rank(par.pp_schedule, par.pp_virtual_stages)


def pipelines(cfg: RunConfig, cluster: ClusterSpec) -> list[tuple[int, str, int]]:
    """(pp, schedule, stages per rank) of every pipeline --fit tries, (1, '1f1b', 1) first,
    each once."""
    model, world, gpn = cfg.model, cluster.world, cluster.gpus_per_node
    out = [(1, "1f1b", 1)]
    schedules = list(FIT_SCHEDULES)
    pp_own, schedule_own, v_own = own_pipeline(cfg)
    if pp_own > 1 and (schedule_own, v_own) not in schedules:
        schedules.append((schedule_own, v_own))
    pp = 2
    while pp <= model.num_layers // 2 and world % pp == 0:
        W = world // pp
        if W % gpn == 0 or gpn % W == 0:
            out += [(pp, s, v) for s, v in schedules if pp * v <= model.num_layers]
        pp *= 2
    return out


def light_modules(cfg: RunConfig) -> list[str]:
    """DeepSeek-V3's light recomputation for this model (``train.recompute_modules``): the
    norms, the routed experts' activation, and MLA's up projections."""
    return ["norm", "moe_act"] + (["mla_up_proj"] if cfg.model.attention == "mla" else [])


def recompute_choices(cfg: RunConfig) -> list[tuple[str, list[str]]]:
    """(train.activation_checkpointing, train.recompute_modules) --fit tries, the lightest
    first: none with the recipe's modules, none with :func:`light_modules` (when the
    recipe names other modules), selective, full."""
    own = list(cfg.train.recompute_modules)
    out = [("none", own)]
    if sorted(light_modules(cfg)) != sorted(own):
        out.append(("none", light_modules(cfg)))
    return out + [(ac, []) for ac in AC_MODES if ac != "none"]


def candidates(cfg: RunConfig, cluster: ClusterSpec) -> list[RunConfig]:
    """The recipe at every layout of the cluster's world (see the module docstring)."""
    world, E = cluster.world, cfg.moe.num_experts
    G = global_batch(cfg, world)
    mbs = cfg.train.micro_batch_size
    own = cfg.parallel
    out = []
    for pp, schedule, v in pipelines(cfg, cluster):
        W = world // pp
        if G % (W * mbs):
            continue
        m = G // (W * mbs)
        if pp > 1 and micro_batch_problem(schedule, pp, m):
            continue
        same = (pp, schedule, v) == own_pipeline(cfg)
        pipe = dict(pp=pp, pp_schedule=schedule, pp_virtual_stages=v,
                    pp_layers_per_stage=own.pp_layers_per_stage if same else None)
        accum = {} if cfg.train.global_batch_size is not None else {"grad_accum": m}
        # a pipeline refuses ZeRO-2; a split backward trains only at ZeRO-1 under FSDP
        # (training/prelaunch.check_split_backward_fsdp)
        zero = 1 if pp > 1 and (own.zero == 2 or (own.zero == 3 and schedule in
                                                   SPLIT_BACKWARD_SCHEDULES)) else own.zero
        for ep in (d for d in _divisors(E) if _sim_accepts(d, cluster, E, W)):
            for ac, mods in recompute_choices(cfg):
                # the recipe's fp8 storage goes with 'none' (whole-block modes replace it)
                storage = cfg.train.activation_storage if ac == "none" else "compute"
                train = replace(cfg.train, activation_checkpointing=ac, recompute_modules=mods,
                                activation_storage=storage, **accum)
                red = own.redundant_experts   # kept where the slots divide over ep
                red = red if ep > 1 and (E + red) % ep == 0 and pp == 1 else 0
                spill = own.spill_threshold if pp == 1 else None   # a pipeline refuses both
                # the recipe's paired micro-batches where the layout runs them
                pairs = own.overlap_micro_batches and pp == 1 and ep > 1
                out.append(replace(cfg, train=train, parallel=replace(
                    own, fsdp=False, dp=W // ep, ep=ep, dp_replicate=1, dp_shard=None,
                    redundant_experts=red, spill_threshold=spill, zero=3,
                    overlap_micro_batches=pairs, **pipe)))
                for rep in _divisors(W):
                    if (W // rep) % ep:
                        continue
                    # FSDP refuses redundant experts and spill-over (parallel.fsdp's checks)
                    out.append(replace(cfg, train=train, parallel=replace(
                        own, fsdp=True, dp=1, ep=ep, dp_replicate=rep, dp_shard=W // rep,
                        redundant_experts=0, spill_threshold=None, zero=zero,
                        overlap_micro_batches=False, **pipe)))
    return out


def fit(cfg: RunConfig, cluster: ClusterSpec, gpu_bytes: float, *, dispatcher: str | None = None,
        strategy: str = "loss_free", step_samples: int = 2) -> tuple[list[FitResult], int]:
    """(the fitting layouts fastest first, how many layouts were tried)."""
    if cfg.model.num_layers == cfg.model.num_dense_layers:
        raise ConfigError("the recipe has no MoE layer: --fit ranks MoE layouts")
    dispatcher = dispatcher or cfg.parallel.dispatcher
    tried = candidates(cfg, cluster)
    results = []
    loads: dict = {}          # the sampled routing loads, shared by layouts of the same ep
    for c in tried:
        mem = memory_per_rank(c, world=cluster.world)
        if mem.total > gpu_bytes:
            continue
        r = simulate(c, cluster, strategies=(strategy,), dispatchers=(dispatcher,),
                     ep=c.parallel.ep, step_samples=step_samples, loads_cache=loads)[0]
        results.append(FitResult(c, mem, r.step_time_s, r.tokens_per_s_per_gpu,
                                 micro_batches(c, cluster.world), cfg.parallel.pp))
    results.sort(key=lambda r: (round(r.step_time_s, 3), r.memory.total))
    return results, len(tried)
