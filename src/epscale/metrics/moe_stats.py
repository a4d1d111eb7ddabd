"""Per-step MoE and per-rank statistics, reduced across ranks with ONE collective.

``StepStatsCollector`` hooks every :class:`epscale.MoE` in a model and accumulates, on the
device and without host syncs, what each forward routed (``moe.last_stats``). Once per step
every rank calls ``collector.record(...)``: the per-layer counters, the step's scalars and
each rank's own numbers (step time, memory, wait time) are packed into one flat float64
tensor, summed with a single ``all_reduce`` (per-rank numbers sit in per-rank slots, so a
sum gathers them), copied to the host once, and turned into the metrics.jsonl step record::

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
from .balance import max_vio, rank_loads
from .flops import mfu as _mfu
from .flops import peak_flops as _peak_flops
from .timers import COMM_SECTIONS, STANDARD_SECTIONS

# Values each rank writes into its own slot of the flat tensor.
_RANK_FIELDS = ("step_time_s", "mem_mb", "sync_s", "num_tokens")
# Per-layer device accumulator: E counts, then these.
_LAYER_DEV = ("entropy_sum", "nonfinite", "dropped")
# Per-layer host counters, then these per-layer local-only values (averaged over ranks).
_LAYER_HOST = ("num_tokens", "num_forwards", "bias_min", "bias_max")


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
                if E % ep:
                    raise ValueError(f"StepStatsCollector: ep={ep} must divide num_experts={E}")
                placement = np.arange(E) // (E // ep)
            self.expert_to_rank.append(placement)
        self.placement = None
        self._dev_acc = [torch.zeros(m.cfg.num_experts + len(_LAYER_DEV), dtype=torch.float64,
                                     device=self.device) for _lid, _n, m in self.layers]
        self._host_acc = [[0, 0] for _ in self.layers]
        self._zero_streak = [np.zeros(E, dtype=np.int64) for E in self.num_experts]
        self._hooks = [m.register_forward_hook(self._make_hook(i))
                       for i, (_lid, _name, m) in enumerate(self.layers)]

    # ------------------------------------------------------------------ accumulation
    def _make_hook(self, idx: int):
        def hook(module: nn.Module, _inputs: Any, _output: Any) -> None:
            if not module.training or is_recomputing():  # recomputed forwards count once
                return
            st = module.last_stats
            counts = st.get("tokens_per_expert")
            if counts is None:
                return
            acc = self._dev_acc[idx]
            E = acc.numel() - len(_LAYER_DEV)
            with torch.no_grad():  # device adds only: no host sync here
                acc[:E] += counts.to(acc.device, torch.float64)
                ent = st.get("router_entropy")
                if isinstance(ent, torch.Tensor):
                    acc[E] += ent.to(acc.device, torch.float64)
                elif ent is not None:
                    acc[E] += float(ent)
                bad = st.get("num_nonfinite_inputs")
                if isinstance(bad, torch.Tensor):
                    acc[E + 1] += bad.to(acc.device, torch.float64)
                drop = st.get("num_dropped", 0)  # a device tensor under capacity, else 0
                if isinstance(drop, torch.Tensor):
                    acc[E + 2] += drop.to(acc.device, torch.float64)
                elif drop:
                    acc[E + 2] += float(drop)
            host = self._host_acc[idx]
            host[0] += int(st.get("num_tokens", 0))
            host[1] += 1
        return hook

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
        for acc in self._dev_acc:
            acc.zero_()
        for host in self._host_acc:
            host[:] = [0, 0]

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
               time_now: float | None = None) -> dict[str, Any]:
        """Reduce this step's numbers across ranks (collective: every rank calls it) and
        return the step record of the metrics.jsonl contract (the same dict on every rank).

        step_time_s: this rank's wall time of the step. num_tokens: tokens this rank
        trained on in the step. loss: this rank's mean loss (float or 0-d tensor; averaged
        over ranks). grad_norm: the global gradient norm (taken from rank 0). breakdown:
        this rank's ``StepTimers.breakdown()`` (averaged over ranks; its 'sync' is also
        kept per rank). mem_mb: None measures ``process_memory_mb``. extra: fields copied
        into the record as they are (e.g. ``val_loss``).
        """
        import time as _time

        bd = dict(breakdown or {})
        L = len(self.slots)
        # Host part: globals, breakdown, per-layer host counters, per-rank slots.
        loss_t = loss.detach().double().reshape(()) if isinstance(loss, torch.Tensor) else None
        host: list[float] = [0.0 if loss is None or loss_t is not None else float(loss),
                             0.0 if loss is None else 1.0, float(num_tokens)]
        host += [float(bd.get(k, 0.0)) for k in STANDARD_SECTIONS]
        for _lid, idx in self.slots:
            host += [0.0, 0.0] if idx is None else [float(v) for v in self._host_acc[idx]]
        rank_slots = np.zeros((self.world, len(_RANK_FIELDS)))
        mem = process_memory_mb(self.device) if mem_mb is None else float(mem_mb)
        rank_slots[self.rank] = [step_time_s, mem, float(bd.get("sync", 0.0)), num_tokens]
        host_t = torch.tensor(host + rank_slots.reshape(-1).tolist(), dtype=torch.float64)
        # Device part: per-layer counters, expert-bias ranges, the loss tensor.
        def absent(n: int) -> torch.Tensor:  # a layer another pipeline stage holds
            return torch.zeros(n, dtype=torch.float64, device=self.device)

        dev_parts = [absent(E + len(_LAYER_DEV)) if idx is None else self._dev_acc[idx]
                     for (_lid, idx), E in zip(self.slots, self.num_experts)]
        with torch.no_grad():
            for _lid, idx in self.slots:
                if idx is None:
                    dev_parts.append(absent(2))
                    continue
                bias = self.layers[idx][2].router.expert_bias.detach().to(self.device,
                                                                          torch.float64)
                dev_parts.append(torch.stack([bias.min(), bias.max()]))
            # Always one loss slot, so every rank packs the same layout.
            dev_parts.append(loss_t.to(self.device).reshape(1) if loss_t is not None
                             else torch.zeros(1, dtype=torch.float64, device=self.device))
            flat = torch.cat(dev_parts + [host_t.to(self.device)]) if dev_parts else host_t.to(self.device)
        if self.distributed and self.world > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)  # the one collective
        vals = flat.tolist()  # the one device->host copy (host sync) of the step
        self.reset()

        # ---- unpack (same order as packed)
        pos = 0
        counts_by_layer, ent_sum, nonfinite, dropped = [], [], [], []
        for E in self.num_experts:
            counts_by_layer.append(vals[pos:pos + E])
            ent_sum.append(vals[pos + E])
            nonfinite.append(vals[pos + E + 1])
            dropped.append(vals[pos + E + 2])
            pos += E + len(_LAYER_DEV)
        bias_rng = []
        holders = self.world / self.pp  # the ranks that hold each layer
        for _ in range(L):
            bias_rng.append((vals[pos] / holders, vals[pos + 1] / holders))
            pos += 2
        loss_sum = vals[pos]  # the tensor-loss slot
        pos += 1
        loss_sum += vals[pos]
        loss_n, tokens_total = vals[pos + 1], vals[pos + 2] / self.pp
        pos += 3
        bd_sum = vals[pos:pos + len(STANDARD_SECTIONS)]
        pos += len(STANDARD_SECTIONS)
        layer_host = []
        for _ in range(L):
            layer_host.append(vals[pos:pos + 2])
            pos += 2
        slots = np.asarray(vals[pos:pos + self.world * len(_RANK_FIELDS)]).reshape(
            self.world, len(_RANK_FIELDS))

        rank_step = slots[:, 0]
        step_time = float(rank_step.max())
        mean_step = float(rank_step.mean())
        time_breakdown = {k: v / self.world for k, v in zip(STANDARD_SECTIONS, bd_sum)}
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
        placed_loads_LR = (self.placement.rank_loads(np.asarray(counts_by_layer, dtype=np.float64))
                        if self.placement is not None and self.layers else None)
        for idx, (lid, _local) in enumerate(self.slots):
            counts = counts_by_layer[idx]
            n_tok, n_fwd = layer_host[idx]
            n_drop = dropped[idx]
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
                "router_entropy": ent_sum[idx] / n_fwd if n_fwd > 0 else 0.0,
                "bias_min": bias_rng[idx][0],
                "bias_max": bias_rng[idx][1],
                "dead_experts": [int(e) for e in np.nonzero(streak >= self.dead_after_steps)[0]],
                "nonfinite_inputs": int(nonfinite[idx]),
            })
        rank_idle = (idle_by_rank / L).tolist() if L else []
        rec: dict[str, Any] = {
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
                               for s, t in zip(slots[:, 2], rank_step)],
            "rank_idle": rank_idle,
            "mem_mb": float(slots[:, 1].max()),
            "rank_mem_mb": slots[:, 1].tolist(),
            "num_tokens": int(round(tokens_total)),
            "world_size": self.world,
        }
        if loss_n == 0:
            del rec["loss"]
        if grad_norm is None:
            del rec["grad_norm"]
        if extra:
            rec.update(extra)
        return rec
