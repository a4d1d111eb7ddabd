"""AdamW with decay groups, the warm-up + cosine schedule, and gradient clipping that
knows which gradients are sharded over expert parallelism.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..config import TrainConfig


def is_expert_param(param: torch.Tensor) -> bool:
    """True for routed-expert weights sharded over the ep group (after ``parallelize``)."""
    try:
        from ..parallel import is_expert_param as _is_expert
    except ImportError:
        return False
    return bool(_is_expert(param))


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; matrices (dim >= 2: embeddings, projections, experts) decay, norms do not."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)


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


@torch.no_grad()
def grad_norm_and_clip(model: nn.Module, max_norm: float, ep_group=None) -> torch.Tensor:
    """Global L2 norm of all gradients (fp32 scalar; identical on every rank), clipping
    them to ``max_norm`` (0 disables clipping) when it is finite.

    After gradient sync, non-expert grads are equal on every rank and expert grads on
    the dp replicas of an expert shard, so the norm is the local non-expert part plus the
    expert part summed over the ep group: one all-reduce of one scalar.
    """
    dense, expert = [], []
    for p in model.parameters():
        if p.grad is not None:
            (expert if is_expert_param(p) else dense).append(p.grad)
    device = next(model.parameters()).device
    zero = torch.zeros((), device=device, dtype=torch.float32)
    dense_sq = torch.stack([n.float() ** 2 for n in torch._foreach_norm(dense)]).sum() if dense else zero
    expert_sq = (torch.stack([n.float() ** 2 for n in torch._foreach_norm(expert)]).sum()
                 if expert else zero.clone())
    if ep_group is not None and dist.is_initialized():
        dist.all_reduce(expert_sq, group=ep_group)
    total = (dense_sq + expert_sq).sqrt()
    if max_norm > 0 and bool(torch.isfinite(total)):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grads = dense + expert
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total


def ensure_optimizer_state(opt: torch.optim.AdamW) -> None:
    """Create AdamW's per-parameter state (step 0, zero moments) where it does not exist
    yet, exactly as AdamW would on its first step, so a checkpoint always has every entry."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
