"""Small device-generic tensor operations shared by the MoE layer, the dispatchers, the
placement runtimes and the CPU kernels: counting ids without a host synchronisation,
and the block size of memory-bound passes.

``torch.bincount`` on CUDA reads its input's minimum and maximum back to the host to size
its output: two synchronisations per call, each of which stalls the launch queue. The MoE
layer counts ids several times per step (tokens per expert for the dispatch, the
statistics, the balance losses), so :func:`count_ids` is given its output size and needs
none.

Memory-bound passes (gathers, combines, the router's fp32 widening) work block by block
so that none builds one big temporary: on CPU a block is cache-sized (1 MB), since a
fresh buffer of tens of MB is page-faulted in on every step and a small one stays in
cache between the ops of a block; accelerators have caching allocators and pay per kernel
launch instead, so their blocks are large (256 MB): few launches, yet bounded memory (a
[T*K, D] gather of a 16k-token, top-8, D=7168 batch in bf16 would be 1.8 GB in one piece).

Host shortcuts: reading a CPU tensor's values on the host costs nothing (there is no
device to wait for), so the CPU path may branch on them (:func:`host_shortcuts`); on an
accelerator every such read is a synchronisation. :func:`device_code_path` turns the
shortcuts off for CPU tensors, so that tests/test_host_syncs.py counts, on CPU, the
synchronisations of the code CUDA runs.

Split backward: the zero-bubble and V pipeline schedules run a backward in two parts (the
inputs' gradients, then the weights'); a custom autograd Function asks
:func:`grads_needed` which of its gradients the running part wants.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

CPU_BLOCK_BYTES = 1 << 20
ACCELERATOR_BLOCK_BYTES = 256 << 20


_HOST_SHORTCUTS = {"on": True}


def host_shortcuts(device: torch.device) -> bool:
    """True where code may read tensor values on the host for free and take a host-side
    shortcut (CPU tensors); False on accelerators, where each read is a synchronisation,
    and for CPU tensors inside :func:`device_code_path` and inside ``torch.compile``'d code
    (``train.compile``: a graph cannot branch on tensor values)."""
    return (device.type == "cpu" and _HOST_SHORTCUTS["on"]
            and not torch.compiler.is_compiling())


@contextlib.contextmanager
def device_code_path() -> Iterator[None]:
    """Run CPU tensors through the code accelerators run (no host shortcuts; the experts
    on torch's grouped GEMM with the accelerators' rules, see
    :func:`epscale.moe.experts.slow_grouped_mm_reason`). Process-wide, for tests: the
    host-sync test counts, on CPU, what would synchronise on CUDA."""
    before = _HOST_SHORTCUTS["on"]
    _HOST_SHORTCUTS["on"] = False
    try:
        yield
    finally:
        _HOST_SHORTCUTS["on"] = before


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [n]: how often each of 0 .. n-1 occurs in ``ids`` (integer, any shape; every
    value must lie in [0, n)). torch.bincount on CPU, where it is fast and syncs nothing;
    an integer ``index_add_`` (exact, so deterministic) elsewhere (bincount on CUDA reads
    the ids' min and max back to the host)."""
    flat = ids.reshape(-1)
    if host_shortcuts(flat.device):
        return torch.bincount(flat, minlength=n)
    return index_add_counts(flat, n)


def index_add_counts(flat: torch.Tensor, n: int) -> torch.Tensor:
    """count_ids' accelerator form, on any device: ones added at each id."""
    ones = torch.ones_like(flat, dtype=torch.int64)
    return torch.zeros(n, dtype=torch.int64, device=flat.device).index_add_(0, flat, ones)


def expert_keys(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The flattened expert ids with dropped assignments (id -1) mapped to
    ``num_experts``, so that they sort last and count in a slot of their own."""
    flat = topk_idx.reshape(-1)
    return torch.where(flat < 0, torch.full_like(flat, num_experts), flat)


def count_experts(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``expert_keys``, int64 [E + 1] counts of each key): kept assignments per expert,
    then the number dropped. No host sync."""
    keys = expert_keys(topk_idx, num_experts)
    return keys, count_ids(keys, num_experts + 1)


def rows_per_block(num_rows: int, row_bytes: int, device: torch.device) -> int:
    """Rows of ``row_bytes`` each in one block on ``device`` (at least 1, at most num_rows)."""
    budget = CPU_BLOCK_BYTES if host_shortcuts(device) else ACCELERATOR_BLOCK_BYTES
    return max(1, min(num_rows, budget // max(1, row_bytes)))


def grads_needed(ctx) -> tuple[bool, ...]:
    """For a custom autograd Function's backward: whether this backward pass uses each
    input's gradient. ``ctx.needs_input_grad`` says only which inputs require grad; a pass
    that asks for some gradients only (``torch.autograd.grad(..., inputs=...)``: the
    split backward of the zero-bubble and V pipeline schedules, first the stage inputs'
    gradients, then the weights' from the same graph) runs the Function's backward in
    both parts, and built-in ops then compute only the half each part needs. Here the
    engine says which of the next nodes it will run (``torch._C._will_engine_execute_node``,
    what torch's own ``register_multi_grad_hook`` asks); a plain ``backward()`` runs
    them all. Under torch.compile (a traced backward) the static answer."""
    if torch.compiler.is_compiling():        # a traced backward: the graph is not the engine's
        return tuple(ctx.needs_input_grad)
    tensors = getattr(ctx, "tensor_inputs", None) or (True,) * len(ctx.needs_input_grad)
    edges = iter(ctx.next_functions)         # one per tensor input, in order
    out = []
    for need, is_tensor in zip(ctx.needs_input_grad, tensors):
        fn = next(edges)[0] if is_tensor else None
        out.append(bool(need and fn is not None and _engine_runs(fn)))
    return tuple(out)


def _engine_runs(fn) -> bool:
    """Whether the running backward pass will run node ``fn``. torch cannot say for a
    leaf's gradient accumulator under ``torch.autograd.grad``: then True (computed, as
    without this check); :func:`through_node` gives a weight a node of its own."""
    try:
        return torch._C._will_engine_execute_node(fn)
    except RuntimeError:
        return True


def through_node(w: torch.Tensor) -> torch.Tensor:
    """``w`` itself, or, for a leaf that requires grad (a parameter used as it is), a view
    of it: an autograd node of its own between a custom Function and the parameter's
    gradient accumulator, which :func:`grads_needed` can ask the engine about."""
    if torch.compiler.is_compiling():        # traced: no engine node to ask about
        return w
    return w.view_as(w) if w.requires_grad and w.grad_fn is None else w


def mark_tensor_inputs(ctx, *args) -> None:
    """In a custom Function's forward whose arguments are not all tensors (None, lists):
    which are, so that :func:`grads_needed` pairs its inputs with the graph's edges."""
    ctx.tensor_inputs = tuple(isinstance(a, torch.Tensor) for a in args)

