"""``local``: no communication (ep=1). Permute assignments by expert, unpermute after.

Legend: T tokens, D model dim, K top-k, E experts, A = T*K assignments, R kept assignments.

Besides the generic ``dispatch``/``combine`` pair, this backend offers
``dispatch_compute_combine``: with every expert on this rank the gather, the expert
compute and the weighted combine run as one chunked kernel
(:class:`epscale.moe.fused.FusedExperts`) with its own buffers, kept from step to step.
The MoE layer uses it whenever its dispatcher has it (``fuse=True``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .base import Dispatcher


@dataclass(frozen=True)
class LocalHandle:
    order_R: torch.Tensor        # flat (token*K + k) index of each received row
    topk_weight_TK: torch.Tensor
    num_tokens: int


def sort_by_expert(topk_idx_TK: torch.Tensor, num_experts: int
                   ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Kept assignments ordered by expert (stable in token order), and the counts.

    Returns ``order_R`` (int64 indices into the flattened T*K assignments; dropped ones,
    id -1, are left out), ``tokens_per_expert_E`` (int64 tensor) and the same counts as a
    host list. One host sync (the counts), which the expert compute needs anyway.
    """
    flat_A = topk_idx_TK.reshape(-1)
    # Dropped assignments get key E so that they sort last and can be cut off.
    key_A = torch.where(flat_A < 0, num_experts, flat_A)
    counts = torch.bincount(key_A, minlength=num_experts + 1)
    counts_list = counts.tolist()  # the one host sync
    order_A = torch.sort(key_A, stable=True).indices
    num_kept = flat_A.numel() - counts_list[num_experts]
    return order_A[:num_kept], counts[:num_experts], counts_list[:num_experts]


class LocalDispatcher(Dispatcher):
    """Every expert lives on this rank. Rows are one per kept (token, expert) assignment.

    ``fuse``: offer :meth:`dispatch_compute_combine` to the layer (default True); False
    makes the layer take the generic dispatch -> experts -> combine path.
    """

    name = "local"

    def __init__(self, num_experts: int, fuse: bool = True):
        super().__init__(num_experts, num_experts, 0)
        self.fuse = fuse

    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK):
        T, K = topk_idx_TK.shape
        order_R, tokens_per_expert_E, _ = sort_by_expert(topk_idx_TK, self.num_experts)
        recv_x_RD = x_TD.index_select(0, order_R // K)
        return recv_x_RD, tokens_per_expert_E, LocalHandle(order_R, topk_weight_TK, T)

    def combine(self, y_RD, handle: LocalHandle):
        return unpermute_weighted(y_RD, handle.order_R, handle.topk_weight_TK)

    def dispatch_compute_combine(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor,
                                 topk_weight_TK: torch.Tensor, experts,
                                 timer=None) -> tuple[torch.Tensor, torch.Tensor]:
        """y_TD = combine(experts(dispatch(x_TD))) in one chunked pass.

        ``experts``: a :class:`epscale.moe.experts.GroupedExperts` holding all E experts.
        ``timer``: optional ``name -> context manager``; sections 'dispatch' (sort by
        expert) and 'experts' (gather + compute + combine).
        Returns y_TD [T, D] in x's dtype and tokens_per_expert_E (kept rows per expert).
        """
        timer = timer or (lambda name: contextlib.nullcontext())
        K = topk_idx_TK.shape[1]
        with timer("dispatch"):
            order_R, tokens_per_expert_E, counts = sort_by_expert(topk_idx_TK, self.num_experts)
            src_R = order_R // K
            weight_R = topk_weight_TK.reshape(-1).index_select(0, order_R)
            pos_TK = assignment_rows(order_R, topk_idx_TK.shape)
        with timer("experts"):
            y_TD = experts.forward_scatter(x_TD, src_R, weight_R, counts, pos_TK)
        return y_TD, tokens_per_expert_E

    def __repr__(self) -> str:
        return f"LocalDispatcher(experts={self.num_experts}, fuse={self.fuse})"


def assignment_rows(order_R: torch.Tensor, shape_TK) -> torch.Tensor:
    """pos_TK: the row of each (token, k) assignment, R (one past the last row) where it
    was dropped; the inverse of ``order_R``."""
    R = order_R.numel()
    pos_A = torch.full((shape_TK[0] * shape_TK[1],), R, dtype=torch.long, device=order_R.device)
    pos_A[order_R] = torch.arange(R, device=order_R.device)
    return pos_A.view(shape_TK)


def unpermute_weighted(y_RD: torch.Tensor, order_R: torch.Tensor,
                       topk_weight_TK: torch.Tensor) -> torch.Tensor:
    """y_TD[t] = sum_k w[t, k] * y_RD[row of (t, k)]; missing (dropped) rows count as 0.

    Scatters rows back to a [T*K, D] buffer, then one batched [1,K]x[K,D] product per token,
    which is deterministic (no atomics) and differentiable in both y and the weights.
    """
    T, K = topk_weight_TK.shape
    D = y_RD.shape[-1]
    if order_R.numel() == T * K:
        full_AD = torch.empty((T * K, D), dtype=y_RD.dtype, device=y_RD.device)
    else:
        full_AD = y_RD.new_zeros((T * K, D))
    full_AD = full_AD.index_copy(0, order_R, y_RD)
    w_T1K = topk_weight_TK.to(y_RD.dtype).unsqueeze(1)
    return torch.bmm(w_T1K, full_AD.view(T, K, D)).squeeze(1)
