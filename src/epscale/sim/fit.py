"""Layouts of a recipe that fit a GPU, fastest first (``epscale describe --fit``).

Every layout of the cluster's world is tried: each ``ep`` the simulator accepts (it
divides the experts and the world, and divides a node or spans whole nodes), replicated
data parallelism and FSDP with every ``dp_replicate`` that leaves ``ep | dp_shard``, and
each recomputation mode. A layout fits when :func:`epscale.sim.memory.estimate` stays
within the GPU's memory; the fitting ones are ranked by the step model's time
(:func:`epscale.sim.step_model.simulate`, one balancing strategy and dispatcher).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import ConfigError, RunConfig
from .cluster import ClusterSpec
from .memory import MemoryEstimate, memory_per_rank
from .step_model import simulate

AC_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class FitResult:
    cfg: RunConfig              # the recipe at this layout
    memory: MemoryEstimate
    step_time_s: float
    tokens_per_s_per_gpu: float

    @property
    def layout(self) -> dict:
        par, train = self.cfg.parallel, self.cfg.train
        out = {"ep": par.ep, "fsdp": par.fsdp, "activation_checkpointing": train.activation_checkpointing}
        if par.fsdp:
            out["dp_replicate"] = par.dp_replicate
        else:
            out["dp"] = par.dp
        return out

    def overrides(self) -> list[str]:
        """The key=value overrides that give the recipe this layout."""
        par, train = self.cfg.parallel, self.cfg.train
        if par.fsdp:
            out = ["parallel.fsdp=true", "parallel.dp=1", f"parallel.dp_replicate={par.dp_replicate}",
                   f"parallel.dp_shard={par.dp_shard}", "parallel.redundant_experts=0",
                   "parallel.spill_threshold=null"]
        else:
            out = ["parallel.fsdp=false", f"parallel.dp={par.dp}", "parallel.dp_replicate=1",
                   "parallel.dp_shard=null",
                   f"parallel.redundant_experts={par.redundant_experts}"]
        return out + [f"parallel.ep={par.ep}",
                      f"train.activation_checkpointing={train.activation_checkpointing}"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _sim_accepts(ep: int, cluster: ClusterSpec, num_experts: int) -> bool:
    gpn = cluster.gpus_per_node
    return (cluster.world % ep == 0 and num_experts % ep == 0
            and (ep % gpn == 0 if ep > gpn else gpn % ep == 0))


def candidates(cfg: RunConfig, cluster: ClusterSpec) -> list[RunConfig]:
    """The recipe at every layout of the cluster's world (see the module docstring)."""
    world, E = cluster.world, cfg.moe.num_experts
    out = []
    for ep in (d for d in _divisors(E) if _sim_accepts(d, cluster, E)):
        for ac in AC_MODES:
            train = replace(cfg.train, activation_checkpointing=ac)
            red = cfg.parallel.redundant_experts   # kept where the slots divide over ep
            red = red if ep > 1 and (E + red) % ep == 0 else 0
            out.append(replace(cfg, train=train, parallel=replace(
                cfg.parallel, fsdp=False, dp=world // ep, ep=ep, dp_replicate=1,
                dp_shard=None, redundant_experts=red)))
            for rep in _divisors(world):
                if (world // rep) % ep:
                    continue
                # FSDP refuses redundant experts and spill-over (parallel.fsdp's checks)
                out.append(replace(cfg, train=train, parallel=replace(
                    cfg.parallel, fsdp=True, dp=1, ep=ep, dp_replicate=rep, dp_shard=world // rep,
                    redundant_experts=0, spill_threshold=None)))
    return out


def fit(cfg: RunConfig, cluster: ClusterSpec, gpu_bytes: float, *, dispatcher: str | None = None,
        strategy: str = "loss_free", step_samples: int = 2) -> tuple[list[FitResult], int]:
    """(the fitting layouts fastest first, how many layouts were tried)."""
    if cfg.model.num_layers == cfg.model.num_dense_layers:
        raise ConfigError("the recipe has no MoE layer: --fit ranks MoE layouts")
    dispatcher = dispatcher or cfg.parallel.dispatcher
    tried = candidates(cfg, cluster)
    results = []
    for c in tried:
        mem = memory_per_rank(c, world=cluster.world)
        if mem.total > gpu_bytes:
            continue
        r = simulate(c, cluster, strategies=(strategy,), dispatchers=(dispatcher,),
                     ep=c.parallel.ep, step_samples=step_samples)[0]
        results.append(FitResult(c, mem, r.step_time_s, r.tokens_per_s_per_gpu))
    results.sort(key=lambda r: (round(r.step_time_s, 3), r.memory.total))
    return results, len(tried)
