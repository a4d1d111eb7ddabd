"""Load balancing in the router: the loss-free expert-bias update, the global-batch balance
loss, the activation-recomputation guard for the token counters, and running balance metrics.

Legend: T tokens, E experts, K top-k, L MoE layers, R ranks of the EP group.

Loss-free balancing (DeepSeek-V3; Wang et al. 2024, "Auxiliary-loss-free load balancing"):
after each optimizer step every layer's selection bias moves against its load,
``b_i += u * sign(mean_load - load_i)``, with the loads summed over the whole step (every
micro-batch of every rank). The bias only changes which experts are *selected*; gate
weights come from the unbiased scores, so no gradient interferes with the language-model
loss. The bias is a persistent buffer of the router, so checkpoints carry it.

Activation recomputation re-runs a layer's forward inside the backward pass; counting that
second forward would double the loads (harmless for ``sign`` when every layer doubles, but
not when only some layers recompute). :func:`is_recomputing` tells the two apart.
"""

from __future__ import annotations

from collections import deque
from typing import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .moe.counts import count_ids


def moe_layers(module: nn.Module) -> list[nn.Module]:
    """The epscale MoE layers inside ``module``, in registration (depth) order."""
    from .moe.layer import MoE

    return [m for m in module.modules() if isinstance(m, MoE)]


def is_recomputing() -> bool:
    """True while a forward runs inside a backward pass, i.e. it is an activation
    recomputation (``torch.utils.checkpoint``, reentrant or not). Counters that must see
    each routed token once (``MoE.tokens_per_expert``, the step statistics) skip then."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def _default_group(dims) -> object | None:
    return getattr(dims, "world_group", None) if dims is not None else None


@torch.no_grad()
def update_expert_biases(module: nn.Module, dims=None, u: float = 1e-3,
                         counts: Mapping[int, Sequence[float]] | torch.Tensor | None = None,
                         reset: bool = False) -> torch.Tensor:
    """Loss-free balancing: ``b_i += u * sign(mean load - load_i)`` in every MoE layer.

    module: a model (or a single MoE) holding epscale MoE layers.
    dims: the ParallelDims (None: one process, or reduce over the default group).
    u: the update speed (``moe.bias_update_speed``; 0 leaves the biases untouched).
    counts: the step's loads summed over every rank, either a float tensor [L, E] in layer
        order or {layer id: tokens_per_expert_E} as the metrics step record holds them
        (layer ids from ``epscale.metrics.moe_stats.find_moe_layers``); no communication
        then. None: the layers' ``tokens_per_expert`` buffers (accumulated over the step's
        micro-batches) are stacked and summed over all ranks with ONE all-reduce.
    reset: zero the layers' token counters afterwards.
    Returns the loads [L, E] (float64) the update used. Every rank applies the same update,
    so the replicated biases stay identical.
    """
    layers = moe_layers(module)
    if not layers:
        return torch.zeros((0, 0), dtype=torch.float64)
    if u < 0:
        raise ValueError(f"update_expert_biases: u={u} must be >= 0 (moe.bias_update_speed)")
    if counts is None:
        loads_LE = torch.stack([m.tokens_per_expert.detach().to(torch.float64) for m in layers])
        group = _default_group(dims)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(loads_LE, group=group)  # one collective for all layers
    elif isinstance(counts, torch.Tensor):
        loads_LE = counts.detach().to(torch.float64)
    else:
        from .metrics.moe_stats import find_moe_layers

        ids = [lid for lid, _name, _m in find_moe_layers(module)]
        missing = [lid for lid in ids if lid not in counts]
        if missing:
            raise ValueError(f"update_expert_biases: counts has no entry for MoE layer(s) "
                             f"{missing}; it holds {sorted(counts)}")
        loads_LE = torch.tensor([list(counts[lid]) for lid in ids], dtype=torch.float64)
    if loads_LE.shape[0] != len(layers):
        raise ValueError(f"update_expert_biases: loads for {loads_LE.shape[0]} layers, the model "
                         f"has {len(layers)} MoE layers")
    for m, load_E in zip(layers, loads_LE):
        bias_E = m.router.expert_bias
        if load_E.numel() != bias_E.numel():
            raise ValueError(f"update_expert_biases: {load_E.numel()} loads for a layer with "
                             f"{bias_E.numel()} experts")
        if u > 0:
            load_E = load_E.to(bias_E.device)
            sign_E = torch.sign(load_E.mean() - load_E).to(bias_E.dtype)
            if getattr(m.router.cfg, "bias_update_rule", "sign") == "adaptive":
                bias_E += _adaptive_step(m.router, sign_E, u) * sign_E
            else:
                bias_E += u * sign_E
        if reset:
            m.reset_token_counts()
    return loads_LE


ADAPTIVE_GROW, ADAPTIVE_SHRINK = 1.2, 0.5   # per-step factors of the adaptive rule
ADAPTIVE_MAX, ADAPTIVE_MIN = 10.0, 0.1       # its step bounds, in units of u


def _adaptive_step(router: nn.Module, sign_E: torch.Tensor, u: float) -> torch.Tensor:
    """The per-expert step of ``bias_update_rule='adaptive'`` (sign-based, Rprop-like):
    it starts at u, grows x1.2 while an expert's sign(mean - load) repeats and halves
    when it flips, within [u/10, 10u]. A sign-rule bias with a fixed step swings around
    the balance point with period 2 whenever a step of u moves more load than the
    imbalance it corrects; halving on every flip damps that swing, growing while the sign
    holds keeps the recovery of a collapsed router fast. Updates the router's
    ``expert_bias_step`` / ``expert_bias_sign`` buffers in place and returns the step."""
    step_E, last_E = router.expert_bias_step, router.expert_bias_sign
    step_E[step_E == 0] = u  # first update
    agree = sign_E * last_E
    factor = torch.where(agree > 0, ADAPTIVE_GROW, torch.where(agree < 0, ADAPTIVE_SHRINK, 1.0))
    step_E.mul_(factor).clamp_(ADAPTIVE_MIN * u, ADAPTIVE_MAX * u)
    last_E.copy_(sign_E)
    return step_E


def global_batch_balance_loss(scores_TE: torch.Tensor, chosen_TK: torch.Tensor,
                              num_experts: int, group=None) -> torch.Tensor:
    """Switch/GShard balance loss with the expert fractions f_e taken over the whole group's
    batch (Qwen's global-batch balancing): ``E * sum_e f_e^group * P_e``.

    scores_TE: fp32 router scores of this rank's tokens (differentiable).
    chosen_TK: int64 chosen experts before capacity drops.
    group: the process group whose batches form the global batch: every rank that trains
        on different tokens (the world for dp x ep, the default). One all-reduce of E+1
        numbers; differentiable through P_e only (f_e is a count).
    Averaged over the group's ranks (as the gradient sync does), the loss equals the
    Switch loss of the concatenated batch when every rank has the same number of tokens.
    """
    T, K = chosen_TK.shape
    counts = count_ids(chosen_TK, num_experts).to(torch.float64)
    buf = torch.cat([counts, counts.new_tensor([float(T * K)])])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(buf, group=group)
    f_E = (buf[:num_experts] / buf[num_experts].clamp_min(1.0)).to(scores_TE.dtype)
    if T == 0:
        return scores_TE.sum() * 0.0
    # Sigmoid scores do not sum to one; normalised per token as in moe.losses.
    p_E = (scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)).mean(dim=0)
    return num_experts * (f_E * p_E).sum()


# --------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------


def max_vio(load_E) -> float:
    """MaxVio = (max load - mean load) / mean load; 0 when perfectly balanced."""
    load = np.asarray(load_E, dtype=np.float64)
    mean = load.mean() if load.size else 0.0
    return float(load.max() / mean - 1.0) if mean > 0 else 0.0


def rank_idle(rank_load_R) -> list[float]:
    """1 - load_r / max load: the share of the busiest rank's time rank r waits."""
    load = np.asarray(rank_load_R, dtype=np.float64)
    peak = load.max() if load.size else 0.0
    return [float(1.0 - v / peak) if peak > 0 else 0.0 for v in load]


class RunningMaxVio:
    """MaxVio_global: the violation of the loads summed over all steps seen so far (or over
    the last ``window`` steps), per layer. Feed it each step's all-reduced counts (the
    metrics record already has them, so it costs no communication).

    ``update(counts_LE)`` with counts [L, E] (or {layer: counts}) returns the running
    MaxVio of each layer; ``batch`` holds the step's own (MaxVio_batch) values.
    """

    def __init__(self, window: int | None = None):
        if window is not None and window < 1:
            raise ValueError(f"RunningMaxVio: window={window} must be >= 1 or None")
        self.window = window
        self._hist: deque = deque(maxlen=window)
        self._total: np.ndarray | None = None
        self.batch: list[float] = []

    def update(self, counts_LE) -> list[float]:
        if isinstance(counts_LE, Mapping):
            counts_LE = [counts_LE[k] for k in sorted(counts_LE)]
        c = np.asarray(counts_LE.tolist() if isinstance(counts_LE, torch.Tensor) else counts_LE,
                       dtype=np.float64)
        if c.ndim == 1:
            c = c[None]
        if self._total is not None and self._total.shape != c.shape:
            raise ValueError(f"RunningMaxVio: counts shape {c.shape} differs from the "
                             f"earlier {self._total.shape}")
        if self.window is not None:
            self._hist.append(c)
            self._total = np.sum(self._hist, axis=0)
        else:
            self._total = c.copy() if self._total is None else self._total + c
        self.batch = [max_vio(row) for row in c]
        return [max_vio(row) for row in self._total]

    @property
    def totals(self) -> np.ndarray | None:
        """[L, E] loads the running value is computed from."""
        return self._total
