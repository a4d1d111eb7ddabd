"""``train.compile``: ``torch.compile`` per transformer block (torchtitan's granularity:
each block is one compiled region, compiled once and reused by every block of the same
structure, so compile time does not grow with depth).

What is compiled, and why there: a block's own forward (``Block._forward``: attention,
the norms, the dense FFN or the MoE layer), inside activation checkpointing, not around
it. The recomputation modes hand ``torch.utils.checkpoint`` contexts of their own
(:mod:`epscale.dispatch.host`'s record of host values, and selective recomputation's
caching dispatch modes entered together with it): Dynamo traces checkpoint only with no
context or the bare selective-policy one, so the checkpoint stays eager and runs the
compiled forward, once in forward and again when backward recomputes it (there a graph
compiled without the token counters' updates, which computes the same values and saves
the same tensors, as checkpoint checks). Selective recomputation with compile is refused
by the config (``train.compile``): its policy sees a compiled block's fused kernels as
one opaque call and would recompute everything, and torch.compile traces the policy itself
only around code without side effects (the MoE layer updates its counters and losses).

Graphs:

* dense blocks and MoE blocks on the local dropless path (ep = 1, ``moe.capacity_factor``
  unset) with torch's fast grouped GEMM (bf16; :func:`epscale.moe.experts.slow_grouped_mm_reason`)
  compile with ``fullgraph=True``: one graph per block, no host sync, nothing left in
  Python (a break would raise at the first step).
* With expert parallelism (or a dropping router, or the experts' per-group loop in fp32)
  the block compiles with one documented graph break: the dispatcher's
  dispatch -> experts -> combine runs eagerly (``MoE.dispatch_eagerly``), because its
  exchanges are c10d ``all_to_all_single`` calls with asynchronous work handles (and the
  collective watchdog's records around them), which Dynamo does not trace, and the split
  sizes are read on the host there (:func:`epscale.dispatch.host.host_ints`, the layer's
  one sync, replayed eagerly in recomputation). Everything before it (norms, attention,
  router) and after it (losses, statistics, residual) is compiled, and so are the
  experts' grouped GEMMs, on their own with the row count dynamic (it changes every
  step). The split sizes are therefore not captured scalars (torchtitan's
  ``capture_scalar_outputs``): that needs the exchanges on traceable functional
  collectives (``torch.distributed._functional_collectives.all_to_all_single_autograd``)
  in dispatch/comm.py.

Inside a compiled region the CPU's host shortcuts are off (:func:`epscale.ops.host_shortcuts`):
a graph cannot branch on tensor values, so a compiled block on CPU runs the accelerator
code path (the experts on torch's grouped GEMM, not the CPU kernel's native calls). The
token counters skip recomputation by a flag the eager caller sets
(:func:`epscale.moe.layer.is_recomputing`), which the compiled graph is guarded on.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ..moe.experts import slow_grouped_mm_reason
from ..moe.layer import MoE, is_recomputing, moe_layers, recomputing
from ..ops import device_code_path
from .activation import transformer_blocks


def _no_timer(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class CompiledForward:
    """A block's forward compiled with ``torch.compile`` (``fullgraph`` as given); called
    like the eager one. Incremental decoding (a key/value cache passed) runs eagerly: the
    trainer never decodes, and a cache object is no graph input."""

    def __init__(self, forward: Callable[..., torch.Tensor], fullgraph: bool):
        self.eager = forward
        self.fullgraph = fullgraph
        self.compiled = torch.compile(forward, fullgraph=fullgraph)

    def __call__(self, x_BSD: torch.Tensor, kv=None, attn_mask: torch.Tensor | None = None
                 ) -> torch.Tensor:
        if kv is not None:
            return self.eager(x_BSD, kv, attn_mask)
        with recomputing(is_recomputing()):
            if attn_mask is None:
                return self.compiled(x_BSD)
            return self.compiled(x_BSD, None, attn_mask)


def graph_break_reason(moe: MoE, ep: int, dtype: torch.dtype, device: torch.device
                       ) -> tuple[str | None, bool]:
    """(why the MoE layer ``moe`` cannot compile as one graph at expert-parallel degree
    ``ep``, computing in ``dtype`` on ``device``, or None when it can; whether its experts'
    grouped GEMMs can compile on their own: no host read inside them)."""
    fast = moe.experts.use_grouped_mm
    if fast:
        with device_code_path():  # what a compiled region runs: no host shortcuts, on CPU too
            rows = torch.empty((0, moe.cfg.dim), dtype=dtype, device=device)
            fast = slow_grouped_mm_reason(rows, moe.cfg.hidden_dim) is None
    if ep > 1:
        return "expert parallelism (the c10d exchanges and the split sizes' host read)", fast
    if moe.cfg.capacity_factor is not None:
        return "moe.capacity_factor (the number of kept rows is read on the host)", False
    if not fast:
        return (f"the experts loop over groups with host sizes ({dtype}, or "
                "moe.use_grouped_mm: never; the fast grouped GEMM takes bfloat16)"), False
    return None, True


def compile_blocks(model: torch.nn.Module, ep: int, dtype: torch.dtype,
                   device: torch.device, split_backward: bool = False) -> list[str]:
    """Compile every transformer block's forward of ``model`` (after activation
    checkpointing, before FSDP; see the module docstring). ``ep``: the expert-parallel
    degree; ``dtype``: the blocks' compute dtype (bf16 under autocast or mixed precision).
    A MoE layer that cannot be one graph runs its dispatcher eagerly inside the compiled
    block (``MoE.dispatch_eagerly``), with its experts compiled on their own where they
    read nothing on the host (rows a dynamic dimension: their number changes every step).
    ``split_backward``: a pipeline schedule that splits each backward into its input and
    weight halves (zero-bubble, ZB-V, DualPipeV) runs the compiled graphs' backward with
    ``retain_graph=True`` for the input half, which AOTAutograd's donated buffers (a
    compiled backward reusing its saved tensors' memory) refuse; they are switched off for
    this process. Returns the start-up header's lines."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if split_backward:
        torch._functorch.config.donated_buffer = False
    whole, broken, experts_alone = 0, {}, 0
    for block in transformer_blocks(model):
        reasons = set()
        for moe in moe_layers(block):
            reason, experts_ok = graph_break_reason(moe, ep, dtype, device)
            if reason is None:
                continue
            reasons.add(reason)
            moe.dispatch_eagerly = True
            if experts_ok:
                moe.experts.forward = torch.compile(moe.experts.forward, fullgraph=True,
                                                    dynamic=True)
                experts_alone += 1
        block._forward = CompiledForward(block._forward, fullgraph=not reasons)
        whole += not reasons
        for r in reasons:
            broken[r] = broken.get(r, 0) + 1
    lines = [f"compile: torch.compile per block: {whole} block(s) as one graph (fullgraph)"]
    lines += [f"compile: {n} block(s) with a graph break around dispatch -> experts -> combine "
              f"(run eagerly; experts compiled on their own in {experts_alone}): {r}"
              for r, n in broken.items()]
    return lines


def disable_section_timers(model: torch.nn.Module) -> None:
    """No per-section timing inside compiled blocks (attention, router, dispatch, experts,
    combine): the trainer calls this after ``set_timer`` when ``train.compile`` is on."""
    for block in transformer_blocks(model):
        block.timer = _no_timer
    for moe in moe_layers(model):
        moe.timer = _no_timer


def compile_note(records: list[dict]) -> str:
    """The console's line after the second step of a compiled run: the first step traced
    and compiled every block (forward and backward), the second ran the compiled graphs."""
    first, second = (r["step_time_s"] for r in records[:2])
    return (f"compile: step 1 took {first:.1f} s (tracing and compiling the blocks), "
            f"step 2 {second:.2f} s: about {max(first - second, 0.0):.1f} s of compilation")
