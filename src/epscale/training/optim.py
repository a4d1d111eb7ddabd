"""AdamW with decay groups (its moments in fp32 or bf16, ``train.optimizer_state_dtype``),
the warm-up + cosine schedule, gradient clipping that knows which gradients are sharded
over expert parallelism, and AdamW state helpers.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as torch_adam

from ..config import TrainConfig
from ..parallel import is_expert_param
from ..parallel.stage_embedding import copied_parameters
from ..placement.replicas import expert_grad_sq_norm
from ..plan.layout import Dims

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Moments upcast at once in the bf16-state step: the fp32 copies of at most this many
# elements exist at a time (2 x 4 bytes each: 512 MiB), whatever the rank holds.
UPCAST_CHUNK = 2 ** 26


def adamw_kernel(device: torch.device) -> dict[str, bool]:
    """AdamW's implementation for parameters on ``device``: the fused kernel on CUDA (one
    launch for every parameter instead of a few per tensor; what GPU trainers run);
    torch's default elsewhere (the CPU path keeps the numerics it always had)."""
    return {"fused": True} if device.type == "cuda" else {}


class AdamW(torch.optim.AdamW):
    """torch's AdamW over fp32 (master) parameters, its two moments stored in
    ``state_dtype`` (float32: exactly torch's AdamW; bfloat16: half the state bytes, as
    DeepSeek-V3 trained).

    With bf16 moments a step upcasts the moments of a chunk of parameters (at most
    ``UPCAST_CHUNK`` elements) to fp32, runs torch's own AdamW update on them (the
    functional ``torch.optim.adam.adam`` with decoupled weight decay: the same math, and
    the same kernel choice, fused on CUDA (:func:`adamw_kernel`), foreach or per tensor
    elsewhere), and rounds them back to bf16 (round to nearest). The parameters, their
    update and the step count stay fp32. Deterministic: a run resumed from a checkpoint
    of its bf16 moments continues bit for bit.
    """

    def __init__(self, params, state_dtype: torch.dtype = torch.float32, **kwargs):
        super().__init__(params, **kwargs)
        if state_dtype not in STATE_DTYPES.values():
            raise ValueError(f"AdamW state dtype {state_dtype}; allowed: float32, bfloat16")
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure=None):
        if self.state_dtype == torch.float32:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ensure_optimizer_state(self)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for chunk in _chunks(params, UPCAST_CHUNK):
                self._step_chunk(group, chunk)
        return loss

    def _step_chunk(self, group: dict, params: list[torch.Tensor]) -> None:
        """One chunk's update, on the local tensors (FSDP's DTensor shards: the update is
        element-wise, and DTensor has no rule for the foreach copies)."""
        states = [self.state[p] for p in params]
        avgs = [_local(s["exp_avg"]) for s in states]
        sqs = [_local(s["exp_avg_sq"]) for s in states]
        # upcast with one multi-tensor copy each (a per-tensor .float() is a launch per
        # tensor on CUDA)
        avgs32 = [torch.empty_like(t, dtype=torch.float32) for t in avgs]
        sqs32 = [torch.empty_like(t, dtype=torch.float32) for t in sqs]
        torch._foreach_copy_(avgs32, avgs)
        torch._foreach_copy_(sqs32, sqs)
        beta1, beta2 = group["betas"]
        torch_adam(
            [_local(p) for p in params], [_local(p.grad) for p in params], avgs32, sqs32, [],
            [s["step"] for s in states],
            foreach=group["foreach"], capturable=group["capturable"], differentiable=False,
            fused=group["fused"], decoupled_weight_decay=True, amsgrad=False, beta1=beta1,
            beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
            maximize=group["maximize"])
        torch._foreach_copy_(avgs, avgs32)   # round to nearest
        torch._foreach_copy_(sqs, sqs32)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts loaded moments to the parameter's dtype; keep them in ours."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(self.state_dtype)


def _chunks(params: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """``params`` in order, in runs of at most ``limit`` elements (a larger tensor alone)."""
    out: list[list[torch.Tensor]] = []
    size = limit
    for p in params:
        n = _local(p).numel()
        if size + n > limit:
            out.append([])
            size = 0
        out[-1].append(p)
        size += n
    return out


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> AdamW:
    """AdamW; matrices (dim >= 2: embeddings, projections, experts) decay, norms do not;
    its moments in ``train.optimizer_state_dtype``."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    device = next((p.device for p in decay + no_decay), torch.device("cpu"))
    return AdamW(groups, state_dtype=STATE_DTYPES[cfg.optimizer_state_dtype], lr=cfg.lr,
                 betas=(cfg.beta1, cfg.beta2), eps=1e-8, **adamw_kernel(device))


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
    world adds the stages up. The last stage's copy of the embedding
    (:mod:`epscale.parallel.stage_embedding`), whose gradient is the embedding's, is
    clipped like it and counted once, as the original: the norm is one process's.
    """
    dense, expert, copies = [], [], []
    copied = {id(p) for p in copied_parameters(model)}
    for p in model.parameters():
        if p.grad is not None:
            group = copies if id(p) in copied else expert if is_expert_param(p) else dense
            group.append(_local(p.grad))
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
    if max_norm > 0 and finite and (dense or expert or copies):
        torch._foreach_mul_(dense + expert + copies,
                            torch.clamp(max_norm / (total + 1e-6), max=1.0))
    vals = flags.tolist()
    return float(total), vals[1] > 0, vals[2] > 0 or not finite


def ensure_optimizer_state(opt: torch.optim.AdamW) -> None:
    """Create AdamW's per-parameter state (step 0, zero moments) where it does not exist
    yet, exactly as AdamW would on its first step, so a checkpoint always has every entry.
    The fused and capturable kernels keep the step count on the parameter's device; the
    moments take the optimizer's ``state_dtype`` (:class:`AdamW`; the parameter's dtype
    for torch's own)."""
    dtype = getattr(opt, "state_dtype", None)
    dtype = None if dtype == torch.float32 else dtype     # fp32: like the parameter, as torch
    for group in opt.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            state = opt.state[p]
            if len(state) == 0:
                state["step"] = torch.zeros((), dtype=torch.float32,
                                            device=p.device if on_device else "cpu")
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key] = torch.zeros_like(p, dtype=dtype or p.dtype,
                                                  memory_format=torch.preserve_format)
