"""What a training step holds, measured (the counterpart of ``epscale.plan.memory``'s
estimate): the bytes of this rank's parameter, gradient and optimizer-state storages, and
the bytes a forward leaves allocated for backward.

The forward's bytes come from torch's profiler with memory profiling on (CPU): every
allocation and free inside ``fn`` is recorded, so their sum is what ``fn`` leaves alive
when it returns (its output and the tensors autograd keeps, counted once however many
views share them). Buffers allocated before ``fn`` and reused by it (the CPU kernel's
kept workspaces) are not counted: drop them first (``MoE.drop_kept_buffers``).
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch


def forward_kept_bytes(fn: Callable[[], object]) -> tuple[int, object]:
    """(bytes ``fn`` leaves allocated on the CPU, its result)."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = fn()
    events = prof.profiler.kineto_results.events()
    return sum(e.nbytes() for e in events if e.name() == "[memory]"), out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
                ) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer tensors (DTensors: the
    local shard)."""
    params = grads = 0
    for p in model.parameters():
        local = _local(p)
        params += local.numel() * local.element_size()
        if p.grad is not None:
            g = _local(p.grad)
            grads += g.numel() * g.element_size()
    optim = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    local = _local(v)
                    optim += local.numel() * local.element_size()
    return {"params": params, "grads": grads, "optimizer": optim}
