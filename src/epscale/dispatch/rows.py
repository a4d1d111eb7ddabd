"""Row operations every dispatcher shares: ordering assignments by expert, gathering the
rows of each assignment, the weighted per-token sums of combine, expanding received rows
to local experts, and the narrow int dtypes expert ids travel in.

Legend: T tokens, D model dim, K top-k, E experts, e local experts, A = T*K assignments,
M owners of rows (tokens, or received rows), R rows (one per (owner, expert) assignment).

Buffers: the [R, D] gathers and combine gradients take their memory from a workspace when
one is given (``Dispatcher.workspace``; see :func:`take_rows`), else fresh.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import count_experts, count_ids, rows_per_block
from .host import host_ints
from .layout import group_rows_by_expert


def _fresh(name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def sort_by_expert(topk_idx_TK: torch.Tensor, num_experts: int, num_kept: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept assignments ordered by expert (stable in token order), and the counts.

    Returns ``order_R`` (int64 indices into the flattened T*K assignments; dropped ones,
    id -1, are left out) and ``tokens_per_expert_E`` (int64 tensor, on the ids' device).
    ``num_kept``: R, the number of kept assignments, when the caller knows it (T*K when
    the router never drops): no host sync. None reads the number dropped on the host
    (:func:`epscale.dispatch.host.host_ints`: a sync on accelerators, the layer's one).
    """
    # Dropped assignments get key E so that they sort last and can be cut off.
    key_A, counts = count_experts(topk_idx_TK, num_experts)
    if num_kept is None:
        num_kept = key_A.numel() - host_ints(counts[num_experts:])[0]
    else:  # checked on the device: no sync (on CPU it raises at once)
        torch._assert_async(counts[num_experts] == key_A.numel() - num_kept,
                            f"sort_by_expert: expected {key_A.numel() - num_kept} dropped "
                            "assignments (id -1); a dropless dispatcher got dropped ones")
    order_A = torch.sort(key_A, stable=True).indices
    return order_A[:num_kept], counts[:num_experts]


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


def take_rows(ws, name: str, like_MD: torch.Tensor, rows: int) -> torch.Tensor:
    """An uninitialised [rows, D] buffer like ``like_MD``'s rows: from the workspace
    ``ws`` (anything with ``take(name, shape, dtype, device)``; it reuses a buffer once
    nothing else holds it), or fresh when ``ws`` is None."""
    take = ws.take if ws is not None else _fresh
    return take(name, (rows, like_MD.shape[1]), like_MD.dtype, like_MD.device)


def gather_rows(x_MD: torch.Tensor, order_R: torch.Tensor, K: int,
                ws=None) -> torch.Tensor:
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


def add_rows(acc_MD: torch.Tensor, index_N: torch.Tensor, src_ND: torch.Tensor) -> torch.Tensor:
    """acc_MD.index_add(0, index_N, src_ND) whose backward keeps only the index: autograd's
    own index_add keeps ``src`` (its formula reads src's shape), an [N, D] copy per
    combine hop held until backward (fp32 in the combines that accumulate in fp32)."""
    return AddRows.apply(acc_MD, index_N, src_ND)


class AddRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, acc_MD, index_N, src_ND):
        ctx.save_for_backward(index_N)
        return acc_MD.index_add(0, index_N, src_ND)

    @staticmethod
    def backward(ctx, g_MD):
        (index_N,) = ctx.saved_tensors
        g_src = g_MD.index_select(0, index_N) if ctx.needs_input_grad[2] else None
        return (g_MD if ctx.needs_input_grad[0] else None), None, g_src


def unpermute_weighted(y_RD: torch.Tensor, order_R: torch.Tensor,
                       topk_weight_TK: torch.Tensor, ws=None) -> torch.Tensor:
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
    and parallelises over m (against the gather + batched product and the ``index_add_``
    it replaced: benchmarks/cpu/combine.py). On CPU, bf16 results are rounded once from
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
        (:func:`epscale.ops.rows_per_block`): the row-wise dot product with y for the
        weight gradients (fp32 sums) and the in-place scale by w for the row gradients,
        while the block is in cache. No [R, D] temporary beside the gathered gradient
        (autograd's version of the formula makes three, and in bf16 two dtype round trips)."""
        y_RD, order_R, w_R = ctx.saved_tensors
        M, K = ctx.shape_w
        need_y, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        g_RD = torch.index_select(grad_MD, 0, order_R // K,
                                  out=take_rows(ctx.ws, "combine_grad", grad_MD, order_R.numel()))
        R, D = g_RD.shape
        acc = acc_dtype(g_RD.dtype)
        dot_R = torch.empty(R, dtype=acc, device=g_RD.device) if need_w else None
        B = rows_per_block(R, D * g_RD.element_size(), g_RD.device)
        tmp_BD = torch.empty((B, D), dtype=g_RD.dtype, device=g_RD.device) if need_w else None
        for r0 in range(0, R, B):
            r1 = min(R, r0 + B)
            g_BD = g_RD[r0:r1]
            if need_w:
                prod_BD = torch.mul(g_BD, y_RD[r0:r1], out=tmp_BD[:r1 - r0])
                torch.sum(prod_BD, 1, dtype=acc, out=dot_R[r0:r1])
            if need_y:
                g_BD.mul_(w_R[r0:r1].unsqueeze(1))
        grad_w = None
        if need_w:
            grad_w = torch.zeros(M * K, dtype=ctx.dtype_w, device=g_RD.device)
            grad_w = grad_w.index_copy_(0, order_R, dot_R.to(ctx.dtype_w)).view(M, K)
        return (g_RD if need_y else None), None, grad_w, None


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums over rows accumulate in: fp32, or the rows' own when wider."""
    return torch.promote_types(dtype, torch.float32)


def chunk_bounds(num_tokens: int, num_chunks: int) -> list[tuple[int, int]]:
    """``num_chunks`` contiguous token ranges (some empty when T < C); every rank makes the
    same number so the collectives match."""
    base, extra = divmod(num_tokens, num_chunks)
    out, s = [], 0
    for c in range(num_chunks):
        n = base + (c < extra)
        out.append((s, s + n))
        s += n
    return out


def expand_rows(recv_x_MD: torch.Tensor, recv_lidx_MK: torch.Tensor, num_local_experts: int,
                num_expanded: int, dtype: torch.dtype,
                ws=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Received rows -> one row per (row, local expert), expert-major. Returns
    (recv_x_RD in ``dtype``, order_R)."""
    K = recv_lidx_MK.shape[1]
    order_R = group_rows_by_expert(recv_lidx_MK, num_local_experts, num_expanded)
    return gather_rows(recv_x_MD, order_R, K, ws).to(dtype), order_R


def reduce_rows(y_RD: torch.Tensor, order_R: torch.Tensor, recv_w_MK: torch.Tensor,
                ws=None, rows_weighted: bool = False) -> torch.Tensor:
    """Sum over a received row's local experts of gate weight * expert output:
    returns [M, D] in y's dtype. ``order_R[i]`` = row*K + k of expanded row i.
    ``rows_weighted``: the experts already applied the weights (:func:`row_gate_weights`):
    a plain sum, which keeps only ``order_R`` for backward (no [R, D] rows)."""
    if rows_weighted:
        return SumRows.apply(y_RD, order_R, recv_w_MK.shape[0], recv_w_MK.shape[1])
    return WeightedRowSum.apply(y_RD, order_R, recv_w_MK, ws)


def row_gate_weights(recv_w_MK: torch.Tensor, order_R: torch.Tensor) -> torch.Tensor:
    """w_R: the gate weight of each expanded row (``order_R[i]`` = row*K + k), in the
    weights' dtype, differentiable (its gradient goes back to ``recv_w_MK``)."""
    return recv_w_MK.reshape(-1).index_select(0, order_R)


class SumRows(torch.autograd.Function):
    """out[m] = sum of the rows i with ``order_R[i] // K == m`` (:func:`sum_rows_by_owner`,
    fp32 accumulation, one rounding); backward gathers each row's owner gradient and keeps
    only ``order_R``: the transpose of :class:`GatherRows`."""

    @staticmethod
    def forward(ctx, y_RD, order_R, M, K):
        ctx.save_for_backward(order_R)
        ctx.K = K
        return sum_rows_by_owner(y_RD, order_R, M, K)

    @staticmethod
    def backward(ctx, g_MD):
        (order_R,) = ctx.saved_tensors
        return g_MD.index_select(0, order_R // ctx.K), None, None, None


def relative_expert_ids(topk_idx_NK: torch.Tensor, base_N: torch.Tensor, span: int) -> torch.Tensor:
    """Expert ids relative to ``base_N`` (the first expert of the row's destination), -1
    outside ``[0, span)``, in the narrowest int dtype."""
    rel = topk_idx_NK - base_N.unsqueeze(1)
    rel = torch.where((topk_idx_NK >= 0) & (rel >= 0) & (rel < span), rel, torch.full_like(rel, -1))
    return rel.to(small_int_dtype(span))


def small_int_dtype(max_value: int) -> torch.dtype:
    """Narrowest signed int dtype holding -1..max_value (expert ids travel in it)."""
    if max_value < 127:
        return torch.int8
    if max_value < 32767:
        return torch.int16
    return torch.int32
