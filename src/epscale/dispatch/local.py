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
import torch.nn.functional as F

from ..blocks import rows_per_block
from ..moe.counts import count_ids
from ..workspace import Workspace, take_fresh
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
    counts = count_ids(key_A, num_experts + 1)
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
        recv_x_RD = gather_rows(x_TD, order_R, K, self.workspace)
        return recv_x_RD, tokens_per_expert_E, LocalHandle(order_R, topk_weight_TK, T)

    def combine(self, y_RD, handle: LocalHandle):
        return unpermute_weighted(y_RD, handle.order_R, handle.topk_weight_TK, self.workspace)

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


def sum_rows_by_owner(y_RD: torch.Tensor, order_R: torch.Tensor, M: int, K: int,
                      w_R: torch.Tensor | None = None) -> torch.Tensor:
    """out[m] = sum over rows i with order_R[i] // K == m of (w_R[i] *) y[i]: [M, D] in y's
    dtype, zeros for an m without rows. The rows sorted by ``order_R`` are bags of
    consecutive rows, one per m, summed by one ``embedding_bag`` (fp32 accumulation, one
    rounding; on CPU bf16 halfway cases round away from zero, fbgemm's rounding)."""
    key_R, row_R = torch.sort(order_R)           # rows in (m, k) order
    counts_M = count_ids(key_R // K, M)
    offsets_M = torch.cumsum(counts_M, 0) - counts_M
    weights = w_R.index_select(0, row_R) if w_R is not None else None
    return F.embedding_bag(row_R, y_RD, offsets_M, mode="sum", per_sample_weights=weights)


def take_rows(ws: Workspace | None, name: str, like_MD: torch.Tensor, rows: int) -> torch.Tensor:
    """An uninitialised [rows, D] buffer like ``like_MD``'s rows: from the dispatcher's
    workspace (reused once nothing else holds it), or fresh."""
    take = ws.take if ws is not None else take_fresh
    return take(name, (rows, like_MD.shape[1]), like_MD.dtype, like_MD.device)


def gather_rows(x_MD: torch.Tensor, order_R: torch.Tensor, K: int,
                ws: Workspace | None = None) -> torch.Tensor:
    """x_MD[order_R // K]: one row per (m, k) assignment, differentiable in x, written
    into a buffer of ``ws`` when given. Its backward sums each m's row gradients with
    :func:`sum_rows_by_owner` (one pass, fp32 accumulation) instead of autograd's
    index_add into a zeroed [M, D] buffer (a bf16 accumulation, rounded at every add)."""
    return GatherRows.apply(x_MD, order_R, K, ws)


class GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD, order_R, K, ws):
        ctx.save_for_backward(order_R)
        ctx.M, ctx.K = x_MD.shape[0], K
        out = take_rows(ws, "gather_rows", x_MD, order_R.numel())
        return torch.index_select(x_MD, 0, order_R // K, out=out)

    @staticmethod
    def backward(ctx, g_RD):
        (order_R,) = ctx.saved_tensors
        return sum_rows_by_owner(g_RD.contiguous(), order_R, ctx.M, ctx.K), None, None, None


def unpermute_weighted(y_RD: torch.Tensor, order_R: torch.Tensor,
                       topk_weight_TK: torch.Tensor, ws: Workspace | None = None) -> torch.Tensor:
    """y_TD[t] = sum_k w[t, k] * y_RD[row of (t, k)]; missing (dropped) rows count as 0.

    One weighted ``embedding_bag`` pass (fp32 accumulation, one rounding; deterministic,
    no atomics). Differentiable in both y and the weights; ``ws`` (optional) keeps the
    backward's gradient rows from step to step."""
    return WeightedRowSum.apply(y_RD, order_R, topk_weight_TK, ws)


class WeightedRowSum(torch.autograd.Function):
    """out[m] = sum_k w[m, k] * y[row of (m, k)], ``order_R[i]`` = m*K + k of row i; an
    (m, k) that no row has (dropped, or its expert is on another rank) counts as 0, and
    an m with no rows at all gets zeros.

    Forward: the rows sorted by ``order_R`` are bags of consecutive rows, one bag per m,
    summed with their gate weights (in y's dtype) by one ``embedding_bag`` (mode 'sum',
    per-sample weights). It reads each row once, touches no row for a missing (m, k)
    (so a non-finite row reaches only its own m), builds no [M*K, D] or [R, D] temporary,
    and parallelises over m. It replaced a blocked gather + batched [1,K]x[K,D] product
    here (1.8-21x faster on CPU) and an ``index_add_`` of weighted rows in ``dedup``
    (1.4-15x faster; benchmarks/combine.py). On CPU, bf16 results are rounded once from
    fp32 with halfway cases away from zero (fbgemm's rounding), not to even.
    Backward: see :meth:`backward`.
    """

    @staticmethod
    def forward(ctx, y_RD, order_R, w_MK, ws=None):
        M, K = w_MK.shape
        w_R = w_MK.reshape(-1).index_select(0, order_R).to(y_RD.dtype)  # y's dtype
        ctx.save_for_backward(y_RD, order_R, w_R)
        ctx.shape_w, ctx.dtype_w, ctx.ws = (M, K), w_MK.dtype, ws
        return sum_rows_by_owner(y_RD, order_R, M, K, w_R)

    @staticmethod
    def backward(ctx, grad_MD):
        """One gather of the output gradient, then block by block of rows
        (:func:`epscale.blocks.rows_per_block`): the row-wise dot product with y for the
        weight gradients (fp32 sums) and the in-place scale by w for the row gradients,
        while the block is in cache. No [R, D] temporary beside the gathered gradient
        (autograd's version of the formula makes three, and in bf16 two dtype round trips)."""
        y_RD, order_R, w_R = ctx.saved_tensors
        M, K = ctx.shape_w
        need_y, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        g_RD = torch.index_select(grad_MD, 0, order_R // K,
                                  out=take_rows(ctx.ws, "combine_grad", grad_MD, order_R.numel()))
        R, D = g_RD.shape
        dot_R = torch.empty(R, dtype=torch.float32, device=g_RD.device) if need_w else None
        B = rows_per_block(R, D * g_RD.element_size(), g_RD.device)
        tmp_BD = torch.empty((B, D), dtype=g_RD.dtype, device=g_RD.device) if need_w else None
        for r0 in range(0, R, B):
            r1 = min(R, r0 + B)
            g_BD = g_RD[r0:r1]
            if need_w:
                prod_BD = torch.mul(g_BD, y_RD[r0:r1], out=tmp_BD[:r1 - r0])
                torch.sum(prod_BD, 1, dtype=torch.float32, out=dot_R[r0:r1])
            if need_y:
                g_BD.mul_(w_R[r0:r1].unsqueeze(1))
        grad_w = None
        if need_w:
            grad_w = torch.zeros(M * K, dtype=ctx.dtype_w, device=g_RD.device)
            grad_w = grad_w.index_copy_(0, order_R, dot_R.to(ctx.dtype_w)).view(M, K)
        return (g_RD if need_y else None), None, grad_w, None
