"""The dispatcher contract shared by every backend.

Legend: T tokens on this rank, D model dim, K top-k, E global experts, e local experts,
R received rows (what this rank's experts compute on).

A dispatcher is stateless between calls: ``dispatch`` returns a handle (everything
``combine`` needs to send results back) and ``combine`` consumes it.

* ``topk_idx_TK`` (int64) holds global expert ids; ``-1`` marks an assignment that was
  dropped (capacity) and must be neither sent nor computed.
* ``topk_weight_TK`` (float) are the gate weights. Combine multiplies each expert output
  by its weight and sums over the K choices, so gradients reach the router through the
  weights kept in the handle.
* ``recv_x_RD`` rows are grouped by local expert in ascending order;
  ``tokens_per_local_expert_e`` (int64 tensor, on the input's device) gives the group sizes.
* Autograd: the backward of dispatch is a combine with the same handle, the backward of
  combine is a dispatch; backends get this from autograd-aware collectives.

Optional fused protocol: a backend may offer
``dispatch_compute_combine(x_TD, topk_idx_TK, topk_weight_TK, experts, timer=None
[, side_work=None]) -> (y_TD, tokens_per_local_expert_e)`` and set ``fuse = True``; MoE.forward
then calls it instead of the three steps (the local fused kernel; the chunked
compute/communication pipelines of dedup and hierarchical). ``accepts_side_work = True``
says it runs ``side_work`` (the shared experts) while combines are in flight and adds the
result to y_TD.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import torch

from ..moe.counts import count_ids
from ..workspace import Workspace


class Dispatcher(ABC):
    """Base class of every backend; subclasses implement ``dispatch`` and ``combine``."""

    name = "base"

    def __init__(self, num_experts: int, num_local_experts: int, expert_offset: int = 0):
        self.num_experts = num_experts
        self.num_local_experts = num_local_experts
        self.expert_offset = expert_offset
        # Row buffers kept from step to step (the gathered rows and the combine's gradient
        # rows): on CPU a fresh [R, D] buffer is page-faulted in on every step.
        self.workspace = Workspace()

    @abstractmethod
    def dispatch(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor,
                 topk_weight_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Send each kept assignment's row to the rank of its expert: returns
        (recv_x_RD grouped by local expert, tokens_per_local_expert_e, handle)."""

    @abstractmethod
    def combine(self, y_RD: torch.Tensor, handle: Any) -> torch.Tensor:
        """Send expert outputs back and reduce them per token with the gate weights:
        returns y_TD."""

    def combine_overlapped(self, y_RD: torch.Tensor, handle: Any,
                           side_work: Callable[[], torch.Tensor] | None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Combine and run ``side_work`` (e.g. shared experts) while the combine is in
        flight. Backends that cannot overlap run it first, then combine."""
        side = side_work() if side_work is not None else None
        return self.combine(y_RD, handle), side

    def bytes_sent(self) -> int:
        """Bytes this rank sent since construction (0 for purely local backends)."""
        return 0

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(experts={self.num_experts}, "
                f"local={self.num_local_experts}, offset={self.expert_offset})")


def permute_by_expert(topk_idx_TK: torch.Tensor, num_experts: int,
                      num_valid: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Order the T*K assignments by expert id, dropped (-1) ones last.

    Returns ``order_A`` (indices into the flattened T*K assignments of the kept ones,
    grouped by expert, stable in token order), ``tokens_per_expert_E`` and the number
    kept. One host sync (the number kept) only when ``num_valid`` is not given.
    """
    flat_A = topk_idx_TK.reshape(-1)
    key_A = torch.where(flat_A < 0, torch.full_like(flat_A, num_experts), flat_A)
    counts = count_ids(key_A, num_experts + 1)
    order_A = torch.argsort(key_A, stable=True)
    if num_valid is None:
        num_valid = int(flat_A.numel() - counts[num_experts].item())  # the one host sync
    return order_A[:num_valid], counts[:num_experts], num_valid
