"""Loss-free balancing in the router: the expert-bias update after each optimizer step.

Legend: E experts, L MoE layers.

Loss-free balancing (DeepSeek-V3; Wang et al. 2024, "Auxiliary-loss-free load balancing"):
after each optimizer step every layer's selection bias moves against its load,
``b_i += u * sign(mean_load - load_i)``, with the loads summed over the whole step (every
micro-batch of every rank). The bias only changes which experts are *selected*; gate
weights come from the unbiased scores, so no gradient interferes with the language-model
loss. The bias is a persistent buffer of the router, so checkpoints carry it. The layers'
token counters skip activation recomputation (``layer.is_recomputing``), so a recomputed
forward never counts its tokens twice.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..plan.layout import Dims
from .layer import moe_layers, named_moe_layers


def _holders_group(dims: Dims | None) -> object | None:
    """The ranks that hold the same MoE layers: every rank, or under a pipeline the ranks
    of this rank's stages (``dims.stage_group``); None: the default group."""
    if dims is None:
        return None
    group = getattr(dims, "stage_group", None)
    return group if group is not None else getattr(dims, "world_group", None)


@torch.no_grad()
def step_loads(module: nn.Module, dims: Dims | None = None) -> torch.Tensor:
    """The step's loads [L, E] (float64, layer order): every MoE layer's
    ``tokens_per_expert`` counter (its routed assignments since ``reset_token_counts``)
    summed over the ranks that hold the layer, with ONE all-reduce for all layers. The
    counters also count forwards outside training (validation): take the loads before
    those run. What the bias update and the re-placement (``epscale.placement``) use."""
    layers = moe_layers(module)
    if not layers:
        return torch.zeros((0, 0), dtype=torch.float64)
    loads_LE = torch.stack([m.tokens_per_expert.detach().to(torch.float64) for m in layers])
    group = _holders_group(dims)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(loads_LE, group=group)  # one collective for all layers
    return loads_LE


@torch.no_grad()
def update_expert_biases(module: nn.Module, dims: Dims | None = None, u: float = 1e-3,
                         counts: Mapping[int, Sequence[float]] | torch.Tensor | None = None,
                         reset: bool = False) -> torch.Tensor:
    """Loss-free balancing: ``b_i += u * sign(mean load - load_i)`` in every MoE layer.

    module: a model (or a single MoE) holding epscale MoE layers.
    dims: the ParallelDims (None: one process, or reduce over the default group).
    u: the update speed (``moe.bias_update_speed``; 0 leaves the biases untouched).
    counts: the step's loads summed over every rank, either a float tensor [L, E] in layer
        order (what :func:`step_loads` returns) or {layer id: tokens_per_expert_E} (layer
        ids from ``epscale.moe.layer.named_moe_layers``); no communication then. None:
        :func:`step_loads` (the layers' counters, ONE all-reduce).
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
        loads_LE = step_loads(module, dims)
    elif isinstance(counts, torch.Tensor):
        loads_LE = counts.detach().to(torch.float64)
    else:
        ids = [lid for lid, _name, _m in named_moe_layers(module)]
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
