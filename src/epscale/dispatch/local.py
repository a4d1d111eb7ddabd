"""``local``: no communication (ep=1). Permute assignments by expert, unpermute after.

Legend: T tokens, D model dim, K top-k, A = T*K assignments, R kept assignments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Dispatcher, permute_by_expert


@dataclass(frozen=True)
class LocalHandle:
    order_R: torch.Tensor        # flat (token*K + k) index of each received row
    topk_weight_TK: torch.Tensor
    num_tokens: int


class LocalDispatcher(Dispatcher):
    """Every expert lives on this rank. Rows are one per kept (token, expert) assignment."""

    name = "local"

    def __init__(self, num_experts: int):
        super().__init__(num_experts, num_experts, 0)

    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK):
        T, K = topk_idx_TK.shape
        order_R, tokens_per_expert_E, _ = permute_by_expert(topk_idx_TK, self.num_experts)
        recv_x_RD = x_TD.index_select(0, order_R // K)
        return recv_x_RD, tokens_per_expert_E, LocalHandle(order_R, topk_weight_TK, T)

    def combine(self, y_RD, handle: LocalHandle):
        return unpermute_weighted(y_RD, handle.order_R, handle.topk_weight_TK)


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
