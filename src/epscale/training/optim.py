"""AdamW with decay groups, the warm-up + cosine schedule, gradient clipping that knows
which gradients are sharded over expert parallelism, and AdamW state helpers.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import TrainConfig
from ..parallel import is_expert_param
from ..placement.replicas import expert_grad_sq_norm
from ..plan.layout import Dims


def adamw_kernel(device: torch.device) -> dict[str, bool]:
    """AdamW's implementation for parameters on ``device``: the fused kernel on CUDA (one
    launch for every parameter instead of a few per tensor; what GPU trainers run);
    torch's default elsewhere (the CPU path keeps the numerics it always had)."""
    return {"fused": True} if device.type == "cuda" else {}


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; matrices (dim >= 2: embeddings, projections, experts) decay, norms do not."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    device = next((p.device for p in decay + no_decay), torch.device("cpu"))
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                             **adamw_kernel(device))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (1-based): linear warm-up over
    ``warmup_steps``, then cosine from ``lr`` down to ``min_lr`` at ``steps``."""
    if cfg.warmup_steps > 0 and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, max(0.0, (step - cfg.warmup_steps) / span))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _sq_norm(grads: list[torch.Tensor], device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), device=device, dtype=torch.float32)
    return torch.stack([n.float() ** 2 for n in torch._foreach_norm(grads)]).sum()


@torch.no_grad()
def grad_norm_and_flags(model: nn.Module, dims: Dims, max_norm: float, stop: bool,
                        loss: torch.Tensor) -> tuple[float, bool, bool]:
    """(global grad norm, any rank asked to stop, skip this step), clipping the grads to
    ``max_norm`` (0: no clipping) when the norm is finite. Same answer on every rank.

    ONE all-reduce over the world carries [this rank's share of the squared norm, stop
    flag, non-finite loss flag], so a rank's signal or NaN loss reaches every rank too.
    Replicated layout: after sync_gradients, non-expert grads are equal on every rank and
    expert grads on the dp replicas of a shard, so the squared norm is the local
    non-expert part plus the expert part summed over the ep group (each rank sends its
    expert part / dp). FSDP: every rank holds a shard of every gradient, replicated over
    dp_replicate, so each rank sends its whole local part / dp_replicate. Pipeline stages
    (pp > 1) hold disjoint weights: the dense part then travels in the all-reduce too
    (each of a stage's ranks sends its copy / the stage's size), and the sum over the
    world adds the stages up.
    """
    dense, expert = [], []
    for p in model.parameters():
        if p.grad is not None:
            (expert if is_expert_param(p) else dense).append(_local(p.grad))
    device = loss.device
    if getattr(dims, "fsdp", False):
        share = (_sq_norm(dense, device) + _sq_norm(expert, device)) / dims.dp_replicate
        local_dense = torch.zeros((), device=device)
    else:
        # Under a redundant-expert placement each logical expert counts once (its copies
        # hold the same summed grad); without one this is the plain squared norm.
        share = (expert_grad_sq_norm(model, dims).float().to(device) if expert
                 else _sq_norm(expert, device)) / dims.dp
        local_dense = _sq_norm(dense, device)
        if getattr(dims, "pp", 1) > 1:  # each stage holds other weights: sum over the stages
            share = share + local_dense / dims.stage_size
            local_dense = torch.zeros((), device=device)
    flags = torch.stack([share, torch.tensor(float(stop), device=device),
                         (~torch.isfinite(loss)).float()])
    if dims.world_size > 1 and dist.is_initialized():
        dist.all_reduce(flags)
    total = (local_dense + flags[0]).sqrt()
    finite = bool(torch.isfinite(total))  # host sync: decides clip/skip on every rank
    if max_norm > 0 and finite and (dense or expert):
        torch._foreach_mul_(dense + expert, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    vals = flags.tolist()
    return float(total), vals[1] > 0, vals[2] > 0 or not finite


def ensure_optimizer_state(opt: torch.optim.AdamW) -> None:
    """Create AdamW's per-parameter state (step 0, zero moments) where it does not exist
    yet, exactly as AdamW would on its first step, so a checkpoint always has every entry.
    The fused and capturable kernels keep the step count on the parameter's device."""
    for group in opt.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            state = opt.state[p]
            if len(state) == 0:
                state["step"] = torch.zeros((), dtype=torch.float32,
                                            device=p.device if on_device else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
