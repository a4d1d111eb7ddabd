"""Dispatch layout: where every token has to go, computed on the device without a host sync.

Legend: T tokens on this rank, K top-k, E global experts, e local experts per rank,
P ranks in the EP group, N nodes in the EP group, L ranks per node.

Experts are laid out contiguously: EP rank p owns experts ``[p*e, (p+1)*e)`` and node n
owns ranks ``[n*L, (n+1)*L)``. ``-1`` in ``topk_idx_TK`` is a dropped assignment and goes
nowhere. The dispatchers turn these tensors into split sizes with their single host
synchronisation per layer (after the count exchange); this module never syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import count_experts


@dataclass(frozen=True)
class DispatchLayout:
    """``num_tokens_per_rank_P``: tokens with at least one kept expert on rank p (int64).
    ``num_tokens_per_node_N``: tokens with at least one kept expert on node n (int64).
    ``num_tokens_per_expert_E``: kept assignments per expert (int64).
    ``is_token_in_rank_TP`` / ``is_token_in_node_TN``: bool membership masks."""

    num_tokens_per_rank_P: torch.Tensor
    num_tokens_per_node_N: torch.Tensor
    num_tokens_per_expert_E: torch.Tensor
    is_token_in_rank_TP: torch.Tensor
    is_token_in_node_TN: torch.Tensor


def membership(owner_TK: torch.Tensor, num_owners: int) -> torch.Tensor:
    """Bool [T, num_owners]: does token t have an assignment owned by o. Negative owners
    (dropped assignments) count for nothing."""
    T = owner_TK.shape[0]
    slot_TK = torch.where(owner_TK < 0, torch.full_like(owner_TK, num_owners), owner_TK)
    mask = torch.zeros((T, num_owners + 1), dtype=torch.bool, device=owner_TK.device)
    mask.scatter_(1, slot_TK, True)
    return mask[:, :num_owners]


def get_dispatch_layout(topk_idx_TK: torch.Tensor, num_experts: int, num_ranks: int,
                        ranks_per_node: int | None = None) -> DispatchLayout:
    """Tokens per rank, per node and per expert, and the token-in-rank/node masks.

    topk_idx_TK: int64 [T, K] global expert ids, -1 = dropped. num_experts must be a
    multiple of num_ranks; ranks_per_node (default: all ranks on one node) must divide
    num_ranks.
    """
    if num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} must be divisible by num_ranks={num_ranks}")
    L = num_ranks if ranks_per_node is None else min(ranks_per_node, num_ranks)
    if num_ranks % L:
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide num_ranks={num_ranks}")
    e = num_experts // num_ranks
    valid_TK = topk_idx_TK >= 0
    rank_TK = torch.where(valid_TK, topk_idx_TK // e, torch.full_like(topk_idx_TK, -1))
    node_TK = torch.where(valid_TK, rank_TK // L, rank_TK)
    in_rank_TP = membership(rank_TK, num_ranks)
    in_node_TN = membership(node_TK, num_ranks // L)
    per_expert_E = count_experts(topk_idx_TK, num_experts)[1][:num_experts]
    return DispatchLayout(in_rank_TP.sum(0), in_node_TN.sum(0), per_expert_E,
                          in_rank_TP, in_node_TN)


def segment_ids(counts_S: torch.Tensor, total: int) -> torch.Tensor:
    """[total] int64: segment index of each row when segments have sizes ``counts_S``
    (``total`` = counts.sum(), known on the host, so no sync)."""
    return torch.repeat_interleave(torch.arange(counts_S.numel(), device=counts_S.device),
                                   counts_S.reshape(-1), output_size=total)


def select_true(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Flat indices of the True entries of ``mask`` in order; ``count`` (their number) is
    known on the host, so unlike ``nonzero`` this needs no sync."""
    flat = mask.reshape(-1)
    return torch.argsort((~flat).to(torch.int8), stable=True)[:count]


def group_rows_by_expert(local_idx_MK: torch.Tensor, num_local_experts: int, num_rows: int
                         ) -> torch.Tensor:
    """Expand received rows to their local experts: returns ``order_R``, flat (row*K + k)
    indices of the ``num_rows`` assignments with a local expert (ids in [0, e)), grouped by
    expert ascending, stable in row order."""
    e = num_local_experts
    valid = (local_idx_MK >= 0) & (local_idx_MK < e)
    key = torch.where(valid, local_idx_MK, torch.full_like(local_idx_MK, e)).reshape(-1)
    return torch.argsort(key, stable=True)[:num_rows]
