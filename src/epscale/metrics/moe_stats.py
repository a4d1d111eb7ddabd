"""Per-step MoE and per-rank statistics, reduced across ranks with ONE collective.

``StepStatsCollector`` hooks every :class:`epscale.MoE` in a model and accumulates, on the
device and without host syncs, what each forward routed (``moe.last_stats``). Once per step
every rank calls ``collector.record(...)``: the per-layer counters, the step's scalars and
each rank's own numbers (step time, memory, wait time) are packed by name into one flat
float64 tensor (``self.fields``, a :class:`~epscale.metrics.fields.Fields` table built once;
per-rank numbers sit in per-rank rows, so a sum gathers them), summed with a single
``all_reduce``, copied to the host once, read back by name and
turned into the metrics.jsonl step record::

    collector = StepStatsCollector(model, ep=dims.ep, flops_per_token=flops_per_token(cfg))
    timers = StepTimers(device); collector.attach_timer(timers)
    for step in ...:
        timers.reset(); t0 = time.perf_counter()
        ...  # forward/backward/optimizer inside timers.section(...) blocks
        rec = collector.record(step, step_time_s=time.perf_counter() - t0, num_tokens=n,
                               loss=loss, lr=lr, grad_norm=gn, breakdown=timers.breakdown())
        if rank == 0: writer.write(rec)

Balance numbers: per layer, ``max_vio`` = max expert load / mean - 1, ``rank_load`` the
assignments each EP rank computes and ``rank_idle`` = 1 - load / busiest rank's load (the
share of the expert compute a rank waits for the busiest one). Step level: ``rank_idle``
averages the layers' and ``worst_rank_idle`` is its maximum over EP ranks; measured waits
in collectives (the 'sync' section over each rank's step time) are ``rank_wait_frac``.

Counted: only forwards in training mode (``module.training``), so validation passes do
not pollute the routing statistics. Works without ``torch.distributed`` (one process).

Legend: E experts, L MoE layers, P ranks (world), p EP ranks.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..moe.layer import is_recomputing, named_moe_layers
from ..plan.layout import check_expert_split
from .balance import max_vio, rank_loads
from .fields import Fields
from .flops import mfu as _mfu
from .flops import peak_flops as _peak_flops
from ..plan.overlap import COMM_KINDS
from .commclock import empty_totals
from .timers import COMM_SECTIONS, STANDARD_SECTIONS

# Values each rank writes into its own row of the rank matrix (a sum then gathers them).
_RANK_FIELDS = ("step_time_s", "mem_mb", "sync_s", "num_tokens")


def _routed_fields(num_experts: int) -> Fields:
    """A layer's device accumulator: what its training forwards routed since the last
    record (summed on the device, no host sync)."""
    return Fields([("tokens_per_expert", (num_experts,)), ("router_entropy_sum", ()),
                   ("nonfinite_inputs", ()), ("dropped", ()), ("num_tokens", ()),
                   ("num_forwards", ())])


# A rank's communication of the step (CommClock.totals()): in flight and exposed seconds,
# in all and by kind (with the kind's number of collectives); summed over ranks, then
# divided by the world (a rank mean).
_COMM_PAIR = Fields([("s", ()), ("n", ()), ("exposed_s", ())])
COMM_FIELDS = Fields([("s", ()), ("exposed_s", ())] + [(k, _COMM_PAIR) for k in COMM_KINDS])

_BIAS = Fields([("min", ()), ("max", ())])          # a layer's expert-bias range
# the name of the buffer on each MoE layer that sums its routing statistics between records
STATS_BUFFER = "step_routed_sums"


def process_memory_mb(device: torch.device | None = None) -> float:
    """Peak CUDA memory allocated since the last call (CUDA), else resident set size (MB)."""
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        mb = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
        return float(mb)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):  # not Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _comm_record(summed: dict[str, Any], world: int, mean_step: float) -> dict[str, Any]:
    """The record's communication fields from the rank sum of ``CommClock.totals()``."""
    def share(x: float) -> float:
        return min(max(x / mean_step, 0.0), 1.0) if mean_step > 0 else 0.0

    by_kind = {}
    for k in COMM_KINDS:
        s, e = summed[k]["s"] / world, summed[k]["exposed_s"] / world
        by_kind[k] = {"s": s, "exposed_s": e, "exposed_share": share(e),
                      "collectives": summed[k]["n"] / world}
    exposed = summed["exposed_s"] / world
    return {"comm_s": summed["s"] / world, "comm_exposed_s": exposed,
            "comm_exposed_share": share(exposed), "comm_by_kind": by_kind}


class StepStatsCollector:
    """Collects the MoE routing statistics and per-rank numbers of each training step.

    model: any module holding epscale MoE layers (found by ``epscale.moe.layer.named_moe_layers``).
    ep: expert-parallel degree p; experts are placed contiguously, E/p per EP rank, unless
        ``expert_to_rank`` ([E] ints in [0, p)) says otherwise (EPLB placements).
    group: the process group to reduce over (None: the default group, or a single process
        when ``torch.distributed`` is not initialised). Every rank of it must call
        ``record`` at every step.
    device: where the flat tensor lives (None: the model's first parameter's device; use a
        CUDA device with NCCL).
    dead_after_steps: an expert with no tokens on any rank for this many consecutive
        records is listed in its layer's ``dead_experts``.
    flops_per_token / peak_flops: for MFU (see ``epscale.metrics.flops``); MFU is 0.0 when
        flops_per_token is not given. peak_flops None: ``flops.peak_flops(device)``.
    all_layers / pp: under pipeline parallelism a rank holds only its stages' MoE layers;
        ``all_layers`` lists every MoE layer of the whole model as (layer id, experts,
        top-k), so that every rank packs the same slots (zeros for the layers it does not
        hold) and the record lists each layer once under its global id; ``pp`` stages
        each count the step's tokens, so the token total is divided by it.
    """

    def __init__(self, model: nn.Module, *, ep: int = 1, group: Any = None,
                 device: torch.device | str | None = None,
                 expert_to_rank: Sequence[int] | None = None, dead_after_steps: int = 50,
                 flops_per_token: float | None = None, peak_flops: float | None = None,
                 all_layers: Sequence[tuple[int, int, int]] | None = None, pp: int = 1):
        self.layers = named_moe_layers(model)
        if device is None:
            p = next(model.parameters(), None)
            device = p.device if p is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        if not isinstance(ep, int) or ep < 1:
            raise ValueError(f"StepStatsCollector: ep={ep!r} must be a positive integer")
        if dead_after_steps < 1:
            raise ValueError(f"StepStatsCollector: dead_after_steps={dead_after_steps!r} must be >= 1")
        self.ep = ep
        self.dead_after_steps = dead_after_steps
        self.flops_per_token = float(flops_per_token or 0.0)
        self.peak_flops = float(peak_flops) if peak_flops else _peak_flops(self.device)
        self.pp = pp
        local = {lid: i for i, (lid, _n, _m) in enumerate(self.layers)}
        if all_layers is None:
            all_layers = [(lid, m.cfg.num_experts, m.cfg.top_k) for lid, _n, m in self.layers]
        elif not set(local) <= {lid for lid, _e, _k in all_layers}:
            raise ValueError(f"StepStatsCollector: the model's MoE layers {sorted(local)} are "
                             f"not all in all_layers {[lid for lid, _e, _k in all_layers]}")
        # one slot per MoE layer of the whole model: (layer id, index among this rank's or None)
        self.slots = [(lid, local.get(lid)) for lid, _e, _k in all_layers]
        self.num_experts = [E for _lid, E, _k in all_layers]
        self.top_k = [k for _lid, _E, k in all_layers]
        self.expert_to_rank: list[np.ndarray] = []
        for E in self.num_experts:
            if expert_to_rank is not None:
                placement = np.asarray(expert_to_rank, dtype=np.int64)
                if placement.shape != (E,) or placement.min() < 0 or placement.max() >= ep:
                    raise ValueError(f"StepStatsCollector: expert_to_rank must hold {E} ints in "
                                     f"[0, ep={ep}), got shape {placement.shape}")
            else:
                check_expert_split(E, ep)
                placement = np.arange(E) // (E // ep)
            self.expert_to_rank.append(placement)
        self.placement = None
        self._routed = {m.cfg.num_experts: _routed_fields(m.cfg.num_experts)
                        for _lid, _n, m in self.layers}
        # Each layer's sums since the last record live on the layer itself (a non-persistent
        # buffer on the device, token and forward counts included), so that the one hook
        # below reads nothing layer-specific from its closure and no host number that
        # changes: a block compiled with torch.compile traces it once for all its layers.
        # (With the layer's index in the closure and the counts in a host dict, dynamo
        # guarded on both and compiled a graph per MoE layer and per forward.)
        for _lid, _n, m in self.layers:
            m.register_buffer(STATS_BUFFER, torch.zeros(
                self._routed[m.cfg.num_experts].size, dtype=torch.float64, device=self.device),
                persistent=False)
        # The step's ONE all-reduce, by name: every MoE layer of the whole model (zeros for
        # the ones another pipeline stage holds), then the step's numbers, then one row
        # per rank. Device parts first, then the host ones (one host tensor).
        self.fields = Fields(
            [(f"layers.{lid}.routed", _routed_fields(E)) for (lid, _i), E in
             zip(self.slots, self.num_experts)]
            + [(f"layers.{lid}.bias", _BIAS) for lid, _i in self.slots]
            + [("loss_tensor", ()), ("loss_value", ()), ("loss_count", ()), ("mtp_loss", ()),
               ("num_tokens", ()),
               ("breakdown", Fields([(k, ()) for k in STANDARD_SECTIONS])),
               ("comm", COMM_FIELDS)]
            + [("ranks", (self.world, len(_RANK_FIELDS)))])
        self._zero_streak = [np.zeros(E, dtype=np.int64) for E in self.num_experts]
        self._hooks = [m.register_forward_hook(self.count_forward) for _l, _n, m in self.layers]

    # ------------------------------------------------------------------ accumulation
    def count_forward(self, module: nn.Module, _inputs: Any, _output: Any) -> None:
        """The forward hook of every MoE layer: adds the layer's routing statistics of
        this forward to the layer's sums (device adds, no host sync)."""
        if not module.training or is_recomputing():  # recomputed forwards count once
            return
        st = module.last_stats
        counts = st.get("tokens_per_expert")
        if counts is None:
            return
        acc = getattr(module, STATS_BUFFER)
        at = self._routed[module.cfg.num_experts].slices
        with torch.no_grad():  # device adds only: no host sync here
            acc[at["tokens_per_expert"]] += counts.to(acc.device, torch.float64)
            ent = st.get("router_entropy")
            if isinstance(ent, torch.Tensor):
                acc[at["router_entropy_sum"]] += ent.to(acc.device, torch.float64)
            elif ent is not None:
                acc[at["router_entropy_sum"]] += float(ent)
            bad = st.get("num_nonfinite_inputs")
            if isinstance(bad, torch.Tensor):
                acc[at["nonfinite_inputs"]] += bad.to(acc.device, torch.float64)
            drop = st.get("num_dropped", 0)  # a device tensor under capacity, else 0
            if isinstance(drop, torch.Tensor):
                acc[at["dropped"]] += drop.to(acc.device, torch.float64)
            elif drop:
                acc[at["dropped"]] += float(drop)
            acc[at["num_tokens"]] += int(st.get("num_tokens", 0))
            acc[at["num_forwards"]] += 1

    def set_placement(self, placement: Any) -> None:
        """Count per-rank loads under a redundant-expert placement (an
        ``epscale.placement.Placement``: each expert's tokens split evenly over its copies);
        None returns to ``expert_to_rank``. Call again after every re-placement."""
        if placement is not None:
            L, E = placement.replica_count.shape
            if L != len(self.slots) or placement.num_ranks != self.ep or \
                    any(n != E for n in self.num_experts):
                raise ValueError(f"StepStatsCollector.set_placement: the placement is for {L} "
                                 f"layers x {E} experts over {placement.num_ranks} ranks; the "
                                 f"collector has {len(self.slots)} layers over ep={self.ep}")
        self.placement = placement

    def attach_timer(self, timers: Any) -> None:
        """Point every MoE layer's ``timer`` hook at ``timers.section``."""
        for _lid, _name, m in self.layers:
            m.timer = timers.section

    def reset(self) -> None:
        """Drop what was accumulated since the last record (``record`` calls this)."""
        for _lid, _name, m in self.layers:
            getattr(m, STATS_BUFFER).zero_()

    def close(self) -> None:
        """Remove the forward hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ the step record
    def record(self, step: int, *, step_time_s: float, num_tokens: int,
               loss: float | torch.Tensor | None = None, lr: float = 0.0,
               grad_norm: float | torch.Tensor | None = None,
               breakdown: dict[str, float] | None = None, skipped: bool = False,
               mem_mb: float | None = None, extra: dict[str, Any] | None = None,
               time_now: float | None = None, comm: dict[str, Any] | None = None,
               mtp_loss: torch.Tensor | None = None) -> dict[str, Any]:
        """Reduce this step's numbers across ranks (collective: every rank calls it) and
        return the step record of the metrics.jsonl contract (the same dict on every rank).

        step_time_s: this rank's wall time of the step. num_tokens: tokens this rank
        trained on in the step. loss: this rank's mean loss (float or 0-d tensor; averaged
        over ranks). grad_norm: the global gradient norm (taken from rank 0). breakdown:
        this rank's ``StepTimers.breakdown()`` (averaged over ranks; its 'sync' is also
        kept per rank). mem_mb: None measures ``process_memory_mb``. extra: fields copied
        into the record as they are (e.g. ``val_loss``). comm: this rank's
        ``CommClock.totals()`` (None: no communication was timed; zeros), averaged over
        ranks into ``comm_s``, ``comm_exposed_s``, ``comm_exposed_share`` (exposed over the
        mean step time) and ``comm_by_kind``. mtp_loss: this rank's mean
        multi-token-prediction loss (0-d tensor; ``model.mtp_depth`` > 0), averaged over
        the ranks that have a loss into ``mtp_loss`` (``loss`` stays the main next-token
        loss); None: no such field.
        """
        import time as _time

        bd = dict(breakdown or {})
        L = len(self.slots)
        loss_t = loss.detach().double().reshape(()) if isinstance(loss, torch.Tensor) else None
        ranks = np.zeros((self.world, len(_RANK_FIELDS)))
        mem = process_memory_mb(self.device) if mem_mb is None else float(mem_mb)
        ranks[self.rank] = [step_time_s, mem, float(bd.get("sync", 0.0)), num_tokens]

        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.float64, device=self.device)

        values: dict[str, Any] = {
            # always a loss-tensor slot, so every rank packs the same layout
            "loss_tensor": loss_t if loss_t is not None else zeros(1),
            "loss_value": 0.0 if loss is None or loss_t is not None else float(loss),
            "loss_count": 0.0 if loss is None else 1.0,
            "mtp_loss": (mtp_loss.detach().double().reshape(()) if mtp_loss is not None
                         else zeros(1)),
            "num_tokens": float(num_tokens),
            "breakdown": {k: float(bd.get(k, 0.0)) for k in STANDARD_SECTIONS},
            "comm": comm if comm is not None else empty_totals(),
            "ranks": ranks,
        }
        with torch.no_grad():
            for (lid, idx), E in zip(self.slots, self.num_experts):
                key = f"layers.{lid}"
                if idx is None:  # a layer another pipeline stage holds
                    values.update({f"{key}.routed": zeros(_routed_fields(E).size),
                                   f"{key}.bias": zeros(_BIAS.size)})
                    continue
                bias = self.layers[idx][2].router.expert_bias.detach().to(self.device,
                                                                          torch.float64)
                values.update({f"{key}.routed": getattr(self.layers[idx][2], STATS_BUFFER),
                               f"{key}.bias": torch.stack([bias.min(), bias.max()])})
            flat = self.fields.pack(values, self.device)
        if self.distributed and self.world > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)  # the one collective
        red = self.fields.unpack(flat.tolist())  # the one device->host copy (host sync) of the step
        self.reset()

        routed = [red[f"layers.{lid}.routed"] for lid, _idx in self.slots]
        loss_sum = red["loss_tensor"]
        loss_sum += red["loss_value"]
        loss_n, tokens_total = red["loss_count"], red["num_tokens"] / self.pp
        holders = self.world / self.pp  # the ranks that hold each layer
        slots = red["ranks"]
        rank = {name: slots[:, j] for j, name in enumerate(_RANK_FIELDS)}

        rank_step = rank["step_time_s"]
        step_time = float(rank_step.max())
        mean_step = float(rank_step.mean())
        time_breakdown = {k: v / self.world for k, v in red["breakdown"].items()}
        for k, v in bd.items():  # non-standard sections: this rank's own numbers
            if k not in time_breakdown:
                time_breakdown[k] = float(v)
        comm = sum(time_breakdown[k] for k in COMM_SECTIONS)
        tps = tokens_total / step_time if step_time > 0 else 0.0
        tps_proc = tps / self.world
        gn = float(grad_norm) if grad_norm is not None else float("nan")

        layers_out = []
        total_assign = total_dropped = 0.0
        idle_by_rank = np.zeros(self.ep)
        counts_by_layer = [r["tokens_per_expert"] for r in routed]
        placed_loads_LR = (self.placement.rank_loads(np.asarray(counts_by_layer, dtype=np.float64))
                           if self.placement is not None and self.layers else None)
        for idx, (lid, _local) in enumerate(self.slots):
            counts = counts_by_layer[idx]
            bias = red[f"layers.{lid}.bias"]
            n_tok, n_fwd = routed[idx]["num_tokens"], routed[idx]["num_forwards"]
            n_drop = routed[idx]["dropped"]
            assign = n_tok * self.top_k[idx]
            total_assign += assign
            total_dropped += n_drop
            if placed_loads_LR is not None:
                loads = [int(round(v)) for v in placed_loads_LR[idx].tolist()]
            else:
                loads = rank_loads(counts, self.expert_to_rank[idx], self.ep)
            peak = max(loads) if loads else 0
            idle = [1.0 - ld / peak if peak > 0 else 0.0 for ld in loads]
            idle_by_rank += np.asarray(idle)
            streak = self._zero_streak[idx]
            zero = np.asarray(counts) <= 0
            streak[:] = np.where(zero, streak + 1, 0)
            layers_out.append({
                "layer": lid,
                "tokens_per_expert": [int(round(c)) for c in counts],
                "rank_load": loads,
                "rank_idle": idle,
                "max_vio": max_vio(counts),
                "dropped_frac": n_drop / assign if assign > 0 else 0.0,
                "router_entropy": (routed[idx]["router_entropy_sum"] / n_fwd if n_fwd > 0
                                   else 0.0),
                "bias_min": bias["min"] / holders,
                "bias_max": bias["max"] / holders,
                "dead_experts": [int(e) for e in np.nonzero(streak >= self.dead_after_steps)[0]],
                "nonfinite_inputs": int(routed[idx]["nonfinite_inputs"]),
            })
        rank_idle = (idle_by_rank / L).tolist() if L else []
        rec: dict[str, Any] = {
            **_comm_record(red["comm"], self.world, mean_step),
            "step": int(step),
            "time": float(time_now if time_now is not None else _time.time()),
            "loss": loss_sum / loss_n if loss_n > 0 else float("nan"),
            "lr": float(lr),
            "grad_norm": gn,
            "tokens_per_s": tps,
            "tokens_per_s_per_proc": tps_proc,
            "step_time_s": step_time,
            "time_breakdown": time_breakdown,
            "comm_share": min(max(comm / mean_step, 0.0), 1.0) if mean_step > 0 else 0.0,
            "mfu": _mfu(tps_proc, self.flops_per_token, self.peak_flops),
            "max_vio": max((lo["max_vio"] for lo in layers_out), default=0.0),
            "worst_rank_idle": max(rank_idle, default=0.0),
            "dropped_frac": total_dropped / total_assign if total_assign > 0 else 0.0,
            "skipped": bool(skipped),
            "layers": layers_out,
            "rank_step_time_s": rank_step.tolist(),
            "rank_wait_frac": [float(s / t) if t > 0 else 0.0
                               for s, t in zip(rank["sync_s"], rank_step)],
            "rank_idle": rank_idle,
            "mem_mb": float(rank["mem_mb"].max()),
            "rank_mem_mb": rank["mem_mb"].tolist(),
            "num_tokens": int(round(tokens_total)),
            "world_size": self.world,
        }
        if mtp_loss is not None and loss_n > 0:
            rec["mtp_loss"] = red["mtp_loss"] / loss_n
        if loss_n == 0:
            del rec["loss"]
        if grad_norm is None:
            del rec["grad_norm"]
        if extra:
            rec.update(extra)
        return rec
