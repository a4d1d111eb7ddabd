"""What a training step holds, measured (the counterpart of ``epscale.plan.memory``'s
estimate): the bytes of this rank's parameter, gradient and optimizer-state storages, and
the bytes a forward leaves allocated for backward.

The forward's bytes come from torch's profiler with memory profiling on (CPU): every
allocation and free inside ``fn`` is recorded with its address, so the allocations not
freed again inside ``fn`` are what it leaves alive when it returns (its output and the
tensors autograd keeps, counted once however many views share them). Buffers allocated
before ``fn`` and reused or freed by it (the CPU kernel's kept workspaces, a module's
statistics of the previous step) are not counted: drop the kept workspaces first
(``MoE.drop_kept_buffers``).

Why the frees are paired by address rather than summed: torch's CPU allocator reports a
free with the size it finds for the address in a table it fills only while profiling
(``ProfiledCPUMemoryReporter``), and never cleans of blocks freed while not profiling. A
block a profiled forward kept and backward freed leaves its entry; when the address is
handed to a new block outside the profiler (the next warm-up step) and that block is freed
inside the next profiled forward, the profiler records a free of the *old* block's size,
for memory the forward never allocated. Which addresses come back depends on the malloc
state (threads, load, address-space layout): that made measurements drift by a few KB to
~100 KB from run to run.
"""

from __future__ import annotations

import warnings
from typing import Callable, Iterator

import torch


def _allocation_events(nodes) -> Iterator:
    """The profiler's allocation records under ``nodes`` (its event tree), in the order
    they happened on each thread (depth first: a parent's children follow it in time)."""
    for node in nodes:
        if node.tag == torch._C._profiler._EventType.Allocation:
            yield node
        yield from _allocation_events(node.children)


def live_allocated_bytes(allocations) -> int:
    """Bytes of ``allocations`` ((address, signed bytes) in time order: > 0 an allocation,
    < 0 a free) still allocated at the end; a free counts only against an allocation
    recorded before it at the same address (a free of a block allocated earlier, whatever
    size the profiler gives it, is not this record's)."""
    live: dict[int, int] = {}
    for ptr, nbytes in allocations:
        if nbytes > 0:
            live[ptr] = nbytes
        else:
            live.pop(ptr, None)
    return sum(live.values())


def forward_kept_bytes(fn: Callable[[], object]) -> tuple[int, object]:
    """(bytes ``fn`` leaves allocated on the CPU, its result)."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = fn()
    events = sorted(_allocation_events(prof.profiler.kineto_results.experimental_event_tree()),
                    key=lambda e: e.start_time_ns)
    return live_allocated_bytes((e.extra_fields.ptr, e.extra_fields.alloc_size) for e in events
                                if e.extra_fields.device.type == "cpu"), out


def measured_model(cfg, bf16_weights: bool, ac: str, modules: tuple[str, ...] = (),
                   storage: str = "compute", device: torch.device | str | None = None
                   ) -> torch.nn.Module:
    """``cfg``'s model as the memory measurements build it (tests/test_memory.py,
    benchmarks/memory.py): seed 0; its weights in bf16 with ``bf16_weights`` (what FSDP's
    mixed precision hands every module); recomputing ``ac`` (or, with 'none', the parts
    ``modules``); activations stored as ``storage`` (``train.activation_storage``); the
    MoE layers' kept buffers dropped, so a forward allocates them as a training step's
    first forward does."""
    from ..model import build_model
    from ..moe.layer import moe_layers
    from ..parallel.activation import apply_activation_checkpointing, apply_activation_storage

    torch.manual_seed(0)
    net = build_model(cfg, device=device)
    if bf16_weights:
        for p in net.parameters():
            p.data = p.data.to(torch.bfloat16)
    apply_activation_checkpointing(net, ac, modules)
    apply_activation_storage(net, storage)
    for moe in moe_layers(net):
        moe.drop_kept_buffers()
    return net


def median_kept_bytes(forward: Callable[[], torch.Tensor], model: torch.nn.Module,
                      samples: int = 3) -> int:
    """The median of :func:`forward_kept_bytes` over ``samples`` forwards of ``forward``
    (a loss of ``model``), each followed by its backward and ``model``'s gradients reset
    (a single measurement on a busy machine once came out 56 KB of 660 KB low)."""
    kept = []
    for _ in range(samples):
        nbytes, loss = forward_kept_bytes(forward)
        loss.backward()
        model.zero_grad(set_to_none=True)
        kept.append(nbytes)
    return sorted(kept)[len(kept) // 2]


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
