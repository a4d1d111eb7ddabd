"""The layout of a run's process world: one frozen dataclass of degrees, built and checked
once, read by the trainer, ``describe``, ``simulate``, ``slurm`` and elastic restarts.

```
world = pp x S                 S: the ranks of one pipeline stage (the world when pp = 1)
replicated:  S = dp x ep       every rank holds every non-expert weight; experts split over ep
FSDP:        S = dp_replicate x dp_shard, ep divides dp_shard, efsdp = dp_shard / ep
             (HSDP when dp_replicate > 1: the shards replicated dp_replicate times)
```
Ranks: ``rank = pp_rank * S + stage_rank``, ``stage_rank = dp_rank * ep + ep_rank`` (an EP
group is contiguous), with FSDP ``dp_rank = replica_rank * efsdp + efsdp_rank``; node
``rank // ranks_per_node``. An EP group fills whole nodes or fits inside one.

Every rule about degrees lives here, each with one wording (``config key 'K' = V is
invalid: what is allowed``): :meth:`Layout.__post_init__` checks what the degrees alone
decide, :meth:`Layout.from_config` what needs the recipe (the experts, the global batch).
A pipeline's world-independent rules (layers per stage, schedule and virtual stages) are
the recipe's own (``epscale.config.schema``), checked when it loads. Nothing here needs a
process group or torch; ``epscale.parallel.ParallelDims`` builds the groups of a Layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..config import ConfigError, RunConfig
from ..config.schema import PP_SCHEDULES, check_zero, pp_stages_per_rank
from ..config.validate import choice, fail
from .pipeline import layers_per_stage, micro_batch_problem


def _positive(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        fail(key, value, "must be a positive integer")


def check_expert_split(num_experts: int, ep: int) -> None:
    """The rule "ep divides the routed experts", in its one wording: for a Layout, and for
    the runtime pieces built from degrees alone (``epscale.parallelize`` on a bare layer,
    the step statistics)."""
    if num_experts % ep:
        fail("parallel.ep", ep, f"must divide moe.num_experts ({num_experts}) so every rank "
             "holds whole experts")


@dataclass(frozen=True)
class Layout:
    """Degrees of one run over ``world`` processes (see the module docstring).

    ``num_experts``: the routed experts ep must divide (None: not checked, for a layout of
    degrees only). ``micro_batches``: per optimizer step per data-parallel rank (what a
    pipeline schedules; ``train.grad_accum``); ``global_batch_size``: the recipe's, when
    the micro-batches were derived from it (the micro-batch rule then names that key).
    ``ranks_per_node``: None until known (a launcher's LOCAL_WORLD_SIZE; ParallelDims fills
    it in). ``zero``: what FSDP shards (``parallel.zero``: 3 weights, gradients and AdamW
    state; 2 gradients and AdamW state; 1 AdamW state). ``note``: what :meth:`from_config` derived that the recipe did not say.
    """

    world: int
    ep: int = 1
    pp: int = 1
    fsdp: bool = False
    dp_replicate: int = 1
    ranks_per_node: int | None = None
    num_experts: int | None = None
    redundant_experts: int = 0
    micro_batch_size: int = 1
    micro_batches: int = 1
    global_batch_size: int | None = None
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    layers_per_stage: tuple[int, ...] | None = None
    zero: int = 3
    note: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        self._check_positive()
        self._check_pipeline()
        self._check_experts()
        self._check_stage()
        self._check_nodes()
        check_zero(self.zero, self.fsdp, self.pp)

    # ------------------------------------------------------------------ the rules
    def _check_positive(self) -> None:
        if not isinstance(self.world, int) or isinstance(self.world, bool) or self.world < 1:
            raise ConfigError(f"the number of processes (world) = {self.world!r} is invalid: "
                              "must be a positive integer")
        for key in ("ep", "pp", "dp_replicate", "micro_batch_size", "micro_batches",
                    "pp_virtual_stages"):
            _positive(_KEYS[key], getattr(self, key))
        if self.ranks_per_node is not None:
            _positive("parallel.ranks_per_node", self.ranks_per_node)
        r = self.redundant_experts
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            fail("parallel.redundant_experts", r, "must be an integer >= 0")

    def _check_pipeline(self) -> None:
        if self.world % self.pp:
            fail("parallel.pp", self.pp, f"must divide the number of processes ({self.world}): "
                 "world = pp x the ranks of one pipeline stage")
        if self.pp == 1:
            return
        choice("parallel.pp_schedule", self.pp_schedule, tuple(PP_SCHEDULES))
        problem = micro_batch_problem(self.pp_schedule, self.pp, self.micro_batches)
        if problem:
            key, value = (("train.global_batch_size", self.global_batch_size)
                          if self.global_batch_size is not None else
                          ("train.grad_accum", self.micro_batches))
            fail(key, value, f"gives {self.micro_batches} micro-batches per step (the "
                 f"pipeline's), and at parallel.pp = {self.pp} parallel.pp_schedule "
                 f"{problem}; raise it (or lower train.micro_batch_size) or choose another "
                 "schedule")

    def _check_experts(self) -> None:
        E, r, ep = self.num_experts, self.redundant_experts, self.ep
        if E is not None:
            check_expert_split(E, ep)
        if r and ep < 2:
            fail("parallel.redundant_experts", r, f"needs parallel.ep >= 2 (it is {ep}): "
                 "redundant copies spread load over EP ranks; set it to 0 or raise parallel.ep")
        if r and E is not None and (E + r) % ep:
            fail("parallel.redundant_experts", r, f"moe.num_experts + redundant_experts = "
                 f"{E + r} physical slots must divide evenly over ep = {ep} ranks; use a "
                 f"multiple of {ep}")

    def _where(self) -> str:
        S = self.stage_size
        return (f"the {S} processes" if self.pp == 1 else
                f"the {S} ranks of one pipeline stage (world {self.world} / pp {self.pp})")

    def _check_stage(self) -> None:
        S, ep, rep = self.stage_size, self.ep, self.dp_replicate
        if not self.fsdp:
            if rep != 1:
                fail("parallel.dp_replicate", rep, "shards with FSDP: set parallel.fsdp: true")
            if S % ep:
                fail("parallel.ep", ep, f"must divide {self._where()}: world = "
                     f"{'pp x ' if self.pp > 1 else ''}dp x ep")
            return
        if S % rep:
            fail("parallel.dp_replicate", rep, f"must divide {self._where()}: "
                 f"{'a stage' if self.pp > 1 else 'the world'} = dp_replicate x dp_shard")
        if (S // rep) % ep:
            fail("parallel.ep", ep, f"must divide dp_shard = {S // rep} ({self._where()} / "
                 f"dp_replicate {rep}): expert parallelism borrows its ranks from the sharded "
                 "dimension")

    def _check_nodes(self) -> None:
        n, ep = self.ranks_per_node, self.ep
        if n is None:
            return
        if self.world % n:
            fail("parallel.ranks_per_node", n, f"must divide the number of processes "
                 f"({self.world}): every node runs as many")
        if ep % n and n % ep:
            fail("parallel.ranks_per_node", n, f"does not fit ep = {ep}: an EP group must "
                 "fill whole nodes (ep a multiple of ranks_per_node) or fit inside one "
                 "(ranks_per_node a multiple of ep)")

    # ------------------------------------------------------------------ degrees
    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage (the world without a pipeline): the data-parallel
        world, which splits each step's batch."""
        return self.world // self.pp

    @property
    def dp(self) -> int:
        """Ranks holding a copy (replicated) or a shard (FSDP) of each expert slice."""
        return self.stage_size // self.ep

    @property
    def dp_shard(self) -> int:
        return self.stage_size // self.dp_replicate if self.fsdp else 1

    @property
    def efsdp(self) -> int:
        return self.dp_shard // self.ep if self.fsdp else 1

    @property
    def stages_per_rank(self) -> int:
        return pp_stages_per_rank(self.pp_schedule, self.pp_virtual_stages) if self.pp > 1 else 1

    @property
    def num_nodes(self) -> int | None:
        return None if self.ranks_per_node is None else self.world // self.ranks_per_node

    @property
    def ep_ranks_per_node(self) -> int:
        """Ranks of one EP group on one node (the whole group when nodes are unknown)."""
        return self.ep if self.ranks_per_node is None else min(self.ep, self.ranks_per_node)

    @property
    def ep_num_nodes(self) -> int:
        return self.ep // self.ep_ranks_per_node

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all ranks."""
        return self.stage_size * self.micro_batches * self.micro_batch_size

    def coords(self, rank: int) -> dict[str, int]:
        """Where ``rank`` sits: pp_rank, stage_rank, dp_rank, ep_rank, replica_rank,
        efsdp_rank and node_rank (the module docstring's order)."""
        pp_rank, stage_rank = divmod(rank, self.stage_size)
        dp_rank, ep_rank = divmod(stage_rank, self.ep)
        replica_rank, efsdp_rank = divmod(dp_rank, self.efsdp) if self.fsdp else (0, 0)
        node_rank = rank // (self.ranks_per_node or self.world)
        return dict(pp_rank=pp_rank, stage_rank=stage_rank, dp_rank=dp_rank, ep_rank=ep_rank,
                    replica_rank=replica_rank, efsdp_rank=efsdp_rank, node_rank=node_rank)

    # ------------------------------------------------------------------ building
    @classmethod
    def from_config(cls, cfg: RunConfig, world: int | None = None, *, dp: int | None = None,
                    ep: int | None = None, fsdp: bool | None = None,
                    dp_replicate: int | None = None, micro_batch_size: int | None = None,
                    ranks_per_node: int | None = None) -> Layout:
        """The layout ``cfg`` trains at over ``world`` processes, any of the keywords
        replacing the recipe's keys (a different pipeline: build the recipe with it first,
        :func:`epscale.plan.memory.with_pipeline`, whose keys the recipe checks). ``world``
        None: the recipe's own (pp x dp x ep; with FSDP pp x dp_replicate x (dp_shard or
        ep); ``dp`` given: pp x dp x ep). ConfigError with the rule's one wording when a
        degree does not fit; ``note`` says what was derived (dp or dp_shard from the world;
        ``micro_batches`` is grad_accum, or what the global batch gives: :meth:`batch_note`). ``ranks_per_node``: checked against ep when
        given (the trainer gives parallel.ranks_per_node or its launcher's count)."""
        par, train = cfg.parallel, cfg.train
        ep = par.ep if ep is None else ep
        pp = par.pp
        fsdp = par.fsdp if fsdp is None else fsdp
        rep = (par.dp_replicate if dp_replicate is None else dp_replicate) if fsdp else 1
        mbs = train.micro_batch_size if micro_batch_size is None else micro_batch_size
        if world is None:
            world = pp * (rep * (par.dp_shard or ep) if fsdp and dp is None else
                          (par.dp if dp is None else dp) * ep)
        # the degrees first (GPipe, the schedule here until the step's micro-batches are
        # known, runs any count), then the micro-batches and the recipe's schedule
        base = cls(world, ep, pp, fsdp, rep, ranks_per_node, cfg.moe.num_experts, par.redundant_experts,
                   mbs, pp_schedule="gpipe")
        m, gbs = train.grad_accum, train.global_batch_size
        if gbs is not None:
            m = cls.micro_batches_of(gbs, base)
        pipe: dict[str, Any] = dict(pp_schedule=par.pp_schedule,
                                    pp_virtual_stages=par.pp_virtual_stages)
        if pp > 1:
            pipe["layers_per_stage"] = tuple(layers_per_stage(cfg))
        note = cls._derived_note(par, base)
        return replace(base, micro_batches=m, global_batch_size=gbs, note=note,
                       zero=par.zero if fsdp else 3, **pipe)

    @classmethod
    def from_degrees(cls, world: int, *, dp: int = 1, ep: int = 1, pp: int = 1,
                     fsdp: bool = False, dp_replicate: int = 1,
                     ranks_per_node: int | None = None) -> Layout:
        """The layout of explicit degrees (``epscale.ParallelDims(dp=.., ep=..)``): pp x dp x
        ep must be the world (with FSDP dp = dp_replicate x efsdp)."""
        _positive("parallel.dp", dp)
        if isinstance(ep, int) and isinstance(pp, int) and pp * dp * ep != world:
            fail("parallel.dp", dp, f"parallel.pp x dp x ep = {pp} x {dp} x {ep} = "
                 f"{pp * dp * ep} must equal the number of processes ({world})")
        return cls(world, ep, pp, fsdp, dp_replicate if fsdp else 1, ranks_per_node)

    @staticmethod
    def _data_ranks(lay: Layout) -> str:
        return (f"{lay.world} processes" if lay.pp == 1 else
                f"{lay.stage_size} data-parallel ranks ({lay.world} / pp {lay.pp})")

    def batch_note(self) -> str | None:
        """What :meth:`from_config` derived of the batch: grad_accum from the global batch."""
        if self.global_batch_size is None:
            return None
        return (f"train.grad_accum = {self.micro_batches} (train.global_batch_size "
                f"{self.global_batch_size} over {self._data_ranks(self)} x micro_batch_size "
                f"{self.micro_batch_size})")

    @staticmethod
    def micro_batches_of(global_batch_size: int, lay: Layout) -> int:
        """The micro-batches per step that keep ``global_batch_size`` at ``lay``."""
        per_micro = lay.stage_size * lay.micro_batch_size
        if global_batch_size % per_micro:
            fail("train.global_batch_size", global_batch_size,
                 f"cannot be kept at {Layout._data_ranks(lay)}: it must be a multiple of them "
                 f"x train.micro_batch_size = {lay.stage_size} x {lay.micro_batch_size} = "
                 f"{per_micro} (grad_accum is derived from it)")
        return global_batch_size // per_micro

    @staticmethod
    def _derived_note(par, lay: Layout) -> str | None:
        S = lay.stage_size
        if lay.fsdp:
            if par.dp_shard is None:
                return (f"parallel.dp_shard = {lay.dp_shard} (the world over dp_replicate = "
                        f"{lay.dp_replicate})")
            if par.dp_shard != lay.dp_shard:
                return (f"parallel.dp_replicate={par.dp_replicate} x parallel.dp_shard="
                        f"{par.dp_shard} != {S} processes: using dp_shard={lay.dp_shard}")
            return None
        if not par.fsdp and par.dp * lay.ep != S:
            return (f"parallel.dp={par.dp} x parallel.ep={lay.ep} != {S} processes: using "
                    f"dp={lay.dp}")
        return None

    @classmethod
    def from_record(cls, rec: dict[str, Any], parallel: dict[str, Any] | None = None
                    ) -> Layout | None:
        """The layout a 'start' event or a checkpoint's meta.json recorded (world_size, pp,
        dp, ep, fsdp, dp_replicate; FSDP and dp_replicate from the run's ``parallel``
        config section where the record lacks them), or None when it does not hold one."""
        par = parallel or {}
        try:
            world, ep = int(rec["world_size"]), int(rec["ep"])
            fsdp = bool(rec["fsdp"] if "fsdp" in rec else par.get("fsdp", False))
            rep = int(rec.get("dp_replicate") or par.get("dp_replicate") or 1) if fsdp else 1
            # the schedule is not recorded: GPipe's, which runs any micro-batch count
            return cls(world, ep, int(rec.get("pp") or 1), fsdp, rep, pp_schedule="gpipe")
        except (KeyError, TypeError, ValueError):   # ConfigError is a ValueError
            return None

    # ------------------------------------------------------------------ the one formatter
    def label(self, pipeline: bool = False) -> str:
        """'dp=2 x ep=2' (replicated), 'FSDP dp_shard=4 (ep=2, efsdp=2)', 'HSDP
        dp_replicate=2 x dp_shard=2 (ep=2, efsdp=1)', and under a pipeline 'pp=2 x (...)'
        (the layout of each stage inside); ``pipeline`` adds the schedule, its stages per
        rank and the micro-batches."""
        zero = f", ZeRO-{self.zero}" if self.zero != 3 else ""
        if not self.fsdp:
            inner = f"dp={self.dp} x ep={self.ep}"
        elif self.dp_replicate == 1:
            inner = f"FSDP dp_shard={self.dp_shard} (ep={self.ep}, efsdp={self.efsdp}{zero})"
        else:
            inner = (f"HSDP dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} "
                     f"(ep={self.ep}, efsdp={self.efsdp}{zero})")
        if self.pp == 1:
            return inner
        detail = ""
        if pipeline:
            v = self.stages_per_rank
            per = f", {v} stages per rank" if v > 1 else ""
            detail = f" ({self.pp_schedule}{per}, {self.micro_batches} micro-batches)"
        return f"pp={self.pp}{detail} x ({inner})"


class Dims(Protocol):
    """What code reads of a run's process groups: ``epscale.parallel.ParallelDims``, or
    ``SingleProcessDims`` for one process (its groups None). The type of every parameter
    named ``dims``; the groups are torch's (``Any`` here, where torch is not imported)."""

    layout: Layout
    rank: int
    world_size: int
    dp: int
    ep: int
    pp: int
    fsdp: bool
    dp_replicate: int
    dp_shard: int
    efsdp: int
    dp_rank: int
    ep_rank: int
    pp_rank: int
    stage_rank: int
    stage_size: int
    ranks_per_node: int
    num_nodes: int
    node_rank: int
    ep_ranks_per_node: int
    ep_num_nodes: int
    mesh: Any
    ep_group: Any
    dp_group: Any
    pp_group: Any
    stage_group: Any
    world_group: Any
    ep_inter_group: Any
    ep_intra_group: Any

    def background_group(self) -> Any: ...


def record_label(rec: dict[str, Any] | None, parallel: dict[str, Any] | None = None) -> str:
    """:meth:`Layout.label` of a recorded layout (see :meth:`Layout.from_record`); '?' when
    the record holds none."""
    lay = Layout.from_record(rec or {}, parallel)
    return lay.label() if lay is not None else "?"


_KEYS = {"ep": "parallel.ep", "pp": "parallel.pp", "dp_replicate": "parallel.dp_replicate",
         "micro_batch_size": "train.micro_batch_size", "micro_batches": "train.grad_accum",
         "pp_virtual_stages": "parallel.pp_virtual_stages"}

__all__ = ["Dims", "Layout", "record_label"]
