"""Chunked dispatch for backends that can keep an exchange in flight during compute
(``dedup`` and ``hierarchical``, ``parallel.overlap_chunks`` > 1).

Legend: T tokens, D model dim, C chunks, R rows this rank's experts compute.

A backend provides four stages, all chunk-aware:

* ``_plan(topk_idx_TK, C)``: the split sizes of every chunk from ONE count exchange and
  ONE host sync (the layer's only one);
* ``_send(x_TD, topk_idx_TK, topk_weight_TK, plan, c, async_op)``: start chunk c's
  exchange;
* ``_receive(sent, plan, c, dtype, T)``: wait for it, return (recv_x_RD,
  tokens_per_local_expert_e, handle);
* ``_combine_start(y_RD, handle, async_op)``: start the way back; the returned
  ``finish(acc_TD=None)`` waits and returns y_TD, or adds into an fp32 accumulator.

An async exchange's outputs are read through :meth:`~.comm.Exchange.done`, so backward
runs the same pipeline in reverse: each combine's gradients start back as soon as the
output's gradient exists (all chunks' at once, then the shared experts' backward runs
while they travel); chunk c's expert backward runs while chunk c+1's dispatch gradients
are in flight (autograd runs the most recently created ready node first, and chunk c+1's
dispatch was started before chunk c's experts ran).

On CUDA (unrun here: no GPU in this project's CI): an async exchange is an NCCL
collective with ``async_op=True``, which runs on the process group's own stream after an
event recorded on the current one; ``wait()`` makes the current stream wait for its end
event, with no host sync, and the work object keeps its buffers alive until then. The
backward's exchanges go the same way (started in ``Exchange.done``'s backward, waited for
in the exchange's own backward, each on the stream autograd runs that node on).

:func:`dispatch_one` runs them for one chunk (a plain ``dispatch``); :func:`run_pipelined`
overlaps them: the exchange of chunk c+1 is in flight while the experts compute chunk c,
each chunk's combine is in flight while the next chunk computes, and the side work (the
shared experts) runs while the last combines are in flight.
"""

from __future__ import annotations

from typing import Callable

import torch

from .base import SideWork, Timer, no_timer
from .rows import acc_dtype


def dispatch_one(backend, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor,
                 topk_weight_TK: torch.Tensor):
    """``backend.dispatch`` as one chunk, waited for at once."""
    plan = backend._plan(topk_idx_TK, 1)
    sent = backend._send(x_TD, topk_idx_TK, topk_weight_TK, plan, 0, False)
    return backend._receive(sent, plan, 0, x_TD.dtype, x_TD.shape[0])


def dispatch_compute_combine(backend, unchunked, x_TD, topk_idx_TK, topk_weight_TK, experts,
                             timer=None, side_work=None) -> torch.Tensor:
    """``backend.dispatch_compute_combine``: :func:`run_pipelined` over its
    ``overlap_chunks`` when that is above 1, else ``unchunked`` (the base class's
    three-step form, ``super().dispatch_compute_combine``); ``unchunked`` also when the
    backend's ``overlap`` is off."""
    if backend.overlap_chunks == 1 or not backend.overlap:
        return unchunked(x_TD, topk_idx_TK, topk_weight_TK, experts, timer, side_work)
    return run_pipelined(backend, backend.overlap_chunks, x_TD, topk_idx_TK, topk_weight_TK,
                         experts, timer, side_work)


def run_pipelined(backend, num_chunks: int, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor,
                  topk_weight_TK: torch.Tensor,
                  experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  timer: Timer | None = None, side_work: SideWork | None = None) -> torch.Tensor:
    """dispatch -> ``experts(recv_x_RD, tokens_per_local_expert_e)`` -> combine in
    ``num_chunks`` pipelined chunks, all sharing one count exchange and one host sync.
    Sections 'dispatch', 'experts', 'combine'. Returns y_TD [T, D] in x's dtype, summed
    in fp32 (float64 for float64 input) over the chunks (and ``side_work()``'s output) and rounded once."""
    timer = timer or no_timer
    C, T = num_chunks, x_TD.shape[0]
    with timer("dispatch"):
        plan = backend._plan(topk_idx_TK, C)
        sent = [backend._send(x_TD, topk_idx_TK, topk_weight_TK, plan, 0, True)]
    finishes = []
    for c in range(C):
        with timer("dispatch"):
            if c + 1 < C:  # keep the next chunk's exchange in flight during this compute
                sent.append(backend._send(x_TD, topk_idx_TK, topk_weight_TK, plan, c + 1, True))
            recv_x_RD, counts_e, handle = backend._receive(sent[c], plan, c, x_TD.dtype, T)
            sent[c] = None
        with timer("experts"):
            recv_y_RD, handle = backend.run_experts(experts, recv_x_RD, counts_e, handle)
        with timer("combine"):
            finishes.append(backend._combine_start(recv_y_RD, handle, True))
    with timer("combine"):
        side = side_work() if side_work is not None else None
        acc_TD = x_TD.new_zeros(x_TD.shape, dtype=acc_dtype(x_TD.dtype))
        for fin in finishes:
            acc_TD = fin(acc_TD)
        if side is not None:
            acc_TD = acc_TD + side.to(acc_TD.dtype)
    return acc_TD.to(x_TD.dtype)
