"""The dispatcher contract shared by every backend.

Legend: T tokens on this rank, D model dim, K top-k, E global experts, e local experts,
R received rows (what this rank's experts compute on), P ranks of the EP group.

A dispatcher is stateless between calls: ``dispatch`` returns a handle (everything
``combine`` needs to send results back) and ``combine`` consumes it.

* ``topk_idx_TK`` (int64) holds global expert ids; ``-1`` marks an assignment that was
  dropped (capacity) and must be neither sent nor computed.
* ``topk_weight_TK`` (float) are the gate weights. Combine multiplies each expert output
  by its weight and sums over the K choices, so gradients reach the router through the
  weights kept in the handle. Where a backend has the weights on the experts' rank
  (:meth:`Dispatcher.row_weights`) and the experts take them
  (``experts.takes_gate_weights(rows)``: ``moe_act`` recomputation, which weights the
  activation before the down projection as DeepSeek-V3 and Megatron do), the experts apply
  them and the combine sums the rows as they are (:meth:`Dispatcher.run_experts`): no
  [R, D] expert output is kept for the gate gradient.
* ``recv_x_RD`` rows are grouped by local expert in ascending order;
  ``tokens_per_local_expert_e`` (int64 tensor, on the input's device) gives the group sizes.
* Autograd: the backward of dispatch is a combine with the same handle, the backward of
  combine is a dispatch; backends get this from autograd-aware collectives.

``dispatch_compute_combine`` is what the MoE layer calls: dispatch -> experts -> combine,
with optional side work (the shared experts) run while the combine is in flight and
added to the output. The base class implements it from the three steps; a backend
overrides it where it can do better (the local backend's one-pass kernel, the chunked
compute/communication pipelines of dedup and hierarchical).

``workspace``: an optional cache of large row buffers (anything with
``take(name, shape, dtype, device)``, e.g. :class:`epscale.kernels.cpu.Workspace`), handed
in by whoever builds the dispatcher for a layer on the CPU path; None allocates fresh
buffers, as accelerators want.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from typing import Any, Callable, ContextManager

import torch

from .comm import CommCounter, GroupInfo
from .rows import row_gate_weights

Timer = Callable[[str], ContextManager]
SideWork = Callable[[], torch.Tensor]


def no_timer(name: str) -> ContextManager:
    return contextlib.nullcontext()


class Dispatcher(ABC):
    """Base class of every backend; subclasses implement ``dispatch`` and ``combine``."""

    name = "base"

    def __init__(self, num_experts: int, num_local_experts: int, expert_offset: int = 0,
                 workspace=None):
        self.num_experts = num_experts
        self.num_local_experts = num_local_experts
        self.expert_offset = expert_offset
        self.workspace = workspace

    @abstractmethod
    def dispatch(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor,
                 topk_weight_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Send each kept assignment's row to the rank of its expert: returns
        (recv_x_RD grouped by local expert, tokens_per_local_expert_e, handle)."""

    @abstractmethod
    def combine(self, y_RD: torch.Tensor, handle: Any) -> torch.Tensor:
        """Send expert outputs back and reduce them per token with the gate weights:
        returns y_TD."""

    def combine_overlapped(self, y_RD: torch.Tensor, handle: Any, side_work: SideWork | None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Combine and run ``side_work`` (e.g. shared experts) while the combine is in
        flight. Backends that cannot overlap run it first, then combine."""
        side = side_work() if side_work is not None else None
        return self.combine(y_RD, handle), side

    def dispatch_compute_combine(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor,
                                 topk_weight_TK: torch.Tensor,
                                 experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                                 timer: Timer | None = None,
                                 side_work: SideWork | None = None) -> torch.Tensor:
        """y_TD = combine(experts(dispatch(x_TD))) (+ ``side_work()``).

        ``experts(recv_x_RD, tokens_per_local_expert_e) -> recv_y_RD``: the layer's
        :class:`epscale.moe.experts.GroupedExperts`. ``timer``: optional ``name -> context
        manager``; sections 'dispatch', 'experts', 'combine'. ``side_work``: runs while the
        combine is in flight where the backend can overlap it; its output is added.
        Returns y_TD [T, D] in x's dtype.
        """
        timer = timer or no_timer
        with timer("dispatch"):
            recv_x_RD, tokens_per_local_expert_e, handle = self.dispatch(
                x_TD, topk_idx_TK, topk_weight_TK)
        with timer("experts"):
            recv_y_RD, handle = self.run_experts(experts, recv_x_RD, tokens_per_local_expert_e,
                                                 handle)
        with timer("combine"):
            y_TD, side_TD = self.combine_overlapped(recv_y_RD, handle, side_work)
        return y_TD + side_TD if side_TD is not None else y_TD

    def row_weights(self, handle: Any) -> torch.Tensor | None:
        """w_R: the gate weight of each received row on this rank (differentiable), where
        this backend keeps them here: its handle has ``order_R`` (row*K + k of each
        expanded row) and ``recv_w_MK``; None otherwise (the weights stay at the source)."""
        w_MK = getattr(handle, "recv_w_MK", None)
        return None if w_MK is None else row_gate_weights(w_MK, handle.order_R)

    def run_experts(self, experts: Callable[..., torch.Tensor], recv_x_RD: torch.Tensor,
                    tokens_per_local_expert_e: torch.Tensor, handle: Any
                    ) -> tuple[torch.Tensor, Any]:
        """(recv_y_RD, handle) from ``experts`` on the received rows. Where the experts
        take gate weights (``experts.takes_gate_weights(recv_x_RD)``) and this backend has
        them here (:meth:`row_weights`), the experts weight the rows and the returned
        handle says so (``rows_weighted``), so that the combine only sums."""
        takes = getattr(experts, "takes_gate_weights", None)
        w_R = self.row_weights(handle) if takes is not None and takes(recv_x_RD) else None
        if w_R is None:
            return experts(recv_x_RD, tokens_per_local_expert_e), handle
        return (experts(recv_x_RD, tokens_per_local_expert_e, w_R),
                dataclasses.replace(handle, rows_weighted=True))

    def bytes_sent(self) -> int:
        """Bytes this rank sent since construction (0 for purely local backends)."""
        return 0

    def inter_node_bytes_sent(self) -> int:
        """Of ``bytes_sent``, the bytes that crossed nodes."""
        return 0

    def spilled_rows(self) -> int | None:
        """Rows the last dispatch sent to a helper rank instead of their expert's own
        (spill-over, ``epscale.placement.spill``); None for a backend that never spills."""
        return None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(experts={self.num_experts}, "
                f"local={self.num_local_experts}, offset={self.expert_offset})")


class EPDispatcher(Dispatcher):
    """An expert-parallel backend over ``info`` (the EP group). Expert ``i`` lives on group
    rank ``i // e``; this rank holds ``[offset, offset + e)``.

    Subclasses implement ``dispatch`` and ``_combine_start(y_RD, handle, async_op) ->
    finish`` where ``finish()`` returns y_TD; the transfer may still be in flight between
    the two, which is what ``combine_overlapped`` uses to run the shared experts meanwhile.

    ``payload``: how token rows travel; a backend lists what it can send in ``payloads``
    ('fp8' only where the rows carry their scales: dedup and hierarchical).

    ``overlap`` (``parallel.overlap``; True unless it is 'none'): exchanges run
    asynchronously behind compute, in forward and backward (an async exchange's gradients
    travel back asynchronously too: :meth:`~.comm.Exchange.done`), the shared experts
    while the combine is in flight, and ``overlap_chunks`` > 1 pipelines chunks. False:
    every exchange blocks, in both directions, one chunk (the plain path, kept for
    comparison).
    """

    payloads: tuple[str, ...] = ("auto", "bf16")

    def __init__(self, num_experts: int, info: GroupInfo, payload: str = "auto", workspace=None,
                 overlap: bool = True):
        P = info.size
        if num_experts % P:
            raise ValueError(f"num_experts={num_experts} is not divisible by the EP size {P}")
        if payload not in self.payloads:
            raise ValueError(f"dispatcher {self.name!r} cannot send payload={payload!r}; it sends "
                             f"{', '.join(map(repr, self.payloads))} ('fp8' needs 'dedup' or "
                             "'hierarchical')")
        e = num_experts // P
        super().__init__(num_experts, e, info.index * e, workspace)
        self.info = info
        self.payload = payload
        self.overlap = overlap

    @property
    def counter(self) -> CommCounter:
        return self.info.counter

    def bytes_sent(self) -> int:
        return self.info.counter.total

    def inter_node_bytes_sent(self) -> int:
        return self.info.counter.inter_node

    @abstractmethod
    def _combine_start(self, y_RD: torch.Tensor, handle: Any, async_op: bool
                       ) -> Callable[..., torch.Tensor]:
        """Start the combine exchange (async when ``async_op``); the returned callable
        waits for it and returns y_TD."""

    def combine(self, y_RD: torch.Tensor, handle: Any) -> torch.Tensor:
        return self._combine_start(y_RD, handle, False)()

    def combine_overlapped(self, y_RD, handle, side_work):
        finish = self._combine_start(y_RD, handle, side_work is not None and self.overlap)
        side = side_work() if side_work is not None else None
        return finish(), side

    def _payload_cast(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The tensor to send and whether its first field travels as fp8."""
        if self.payload == "bf16" and x_ND.dtype != torch.bfloat16:
            return x_ND.to(torch.bfloat16), False
        return x_ND, self.payload == "fp8"

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(experts={self.num_experts}, local={self.num_local_experts}, "
                f"offset={self.expert_offset}, ep={self.info.size}, payload={self.payload})")
