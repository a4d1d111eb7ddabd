"""``dedup``: DeepEP normal mode over torch.distributed.

Legend: T tokens, D model dim, K top-k, E global experts, e local experts, P EP ranks,
C chunks, N rows sent (one per (token, destination rank)), M rows received,
R expanded rows (one per (received row, local expert)).

A token goes to each destination rank once, however many of its experts live there. The
row carries the token, its expert ids relative to the destination (int8/16/32, -1 where
the expert lives elsewhere) and its K gate weights. The receiver expands each row to its
local experts, and after the experts it applies the gate weights and sums the row's
experts locally, so combine sends one row back per (token, rank). The token payload can
travel as bf16 or as fp8 (e4m3, one fp32 scale per 128 channels); combine stays in the
compute dtype (bf16/fp32) and so does the backward of dispatch.

``dispatch_compute_combine`` pipelines C chunks of tokens: the exchange of chunk c+1 is in
flight while the experts compute chunk c, each chunk's combine is in flight while the
next chunk computes, and the shared experts run while the last combines are in flight.
All chunks share one count exchange and one host sync.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from .comm import Exchange, GroupInfo, exchange_counts
from .ep import EPDispatcher, small_int_dtype
from ..workspace import Workspace
from .local import WeightedRowSum, gather_rows
from .layout import get_dispatch_layout, group_rows_by_expert, select_true


@dataclass(frozen=True)
class DedupHandle:
    tok_N: torch.Tensor          # source token of each sent row
    order_R: torch.Tensor        # flat (row*K + k) of each expanded row, expert-major
    recv_w_MK: torch.Tensor      # received gate weights (carry the router's gradient)
    exchange: Exchange           # the dispatch exchange; combine runs it reversed
    num_tokens: int


@dataclass
class _Plan:
    """Host-side split sizes of every chunk, from the one count exchange."""

    bounds: list[tuple[int, int]]
    send_splits: list[list[int]]       # [C][P]
    recv_splits: list[list[int]]       # [C][P]
    num_expanded: list[int]            # [C] rows this rank's experts compute
    tokens_per_local_expert: list[torch.Tensor]   # [C] device int64 [e]
    in_rank_TP: list[torch.Tensor]     # [C] bool masks


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
                ws: Workspace | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Received rows -> one row per (row, local expert), expert-major. Returns
    (recv_x_RD in ``dtype``, order_R)."""
    K = recv_lidx_MK.shape[1]
    order_R = group_rows_by_expert(recv_lidx_MK, num_local_experts, num_expanded)
    return gather_rows(recv_x_MD, order_R, K, ws).to(dtype), order_R


def reduce_rows(y_RD: torch.Tensor, order_R: torch.Tensor, recv_w_MK: torch.Tensor,
                ws: Workspace | None = None) -> torch.Tensor:
    """Sum over a received row's local experts of gate weight * expert output:
    returns [M, D] in y's dtype. ``order_R[i]`` = row*K + k of expanded row i."""
    return WeightedRowSum.apply(y_RD, order_R, recv_w_MK, ws)


def relative_expert_ids(topk_idx_NK: torch.Tensor, base_N: torch.Tensor, span: int) -> torch.Tensor:
    """Expert ids relative to ``base_N`` (the first expert of the row's destination), -1
    outside ``[0, span)``, in the narrowest int dtype."""
    rel = topk_idx_NK - base_N.unsqueeze(1)
    rel = torch.where((topk_idx_NK >= 0) & (rel >= 0) & (rel < span), rel, torch.full_like(rel, -1))
    return rel.to(small_int_dtype(span))


class DedupDispatcher(EPDispatcher):
    name = "dedup"
    # dispatch_compute_combine takes side_work= (shared experts overlapped with combine).
    accepts_side_work = True

    def __init__(self, num_experts: int, info: GroupInfo, payload: str = "auto",
                 overlap_chunks: int = 1):
        super().__init__(num_experts, info, payload)
        self.overlap_chunks = overlap_chunks
        # MoE.forward takes dispatch_compute_combine when ``fuse`` is true.
        self.fuse = overlap_chunks > 1

    # ------------------------------------------------------------------ planning
    def _plan(self, topk_idx_TK: torch.Tensor, num_chunks: int) -> _Plan:
        E, e, P = self.num_experts, self.num_local_experts, self.info.size
        bounds = chunk_bounds(topk_idx_TK.shape[0], num_chunks)
        metas, masks = [], []
        for s, t in bounds:
            lay = get_dispatch_layout(topk_idx_TK[s:t], E, P)
            metas.append(torch.cat([lay.num_tokens_per_rank_P.unsqueeze(1),
                                    lay.num_tokens_per_expert_E.view(P, e)], 1))
            masks.append(lay.is_token_in_rank_TP)
        send_PCm = torch.stack(metas, 1)                       # [P, C, 1+e]
        recv_PCm = exchange_counts(self.info, send_PCm.reshape(P, -1)).view_as(send_PCm)
        per_expert_Ce = recv_PCm[:, :, 1:].sum(0)
        host = torch.cat([send_PCm[:, :, 0].t().reshape(-1), recv_PCm[:, :, 0].t().reshape(-1),
                          per_expert_Ce.sum(1)]).tolist()      # the one host sync per layer
        C = num_chunks
        send = [host[c * P:(c + 1) * P] for c in range(C)]
        recv = [host[C * P + c * P:C * P + (c + 1) * P] for c in range(C)]
        return _Plan(bounds, send, recv, host[2 * C * P:], list(per_expert_Ce.unbind(0)), masks)

    # ------------------------------------------------------------------ stages
    def _send(self, x_TD, topk_idx_TK, topk_weight_TK, plan: _Plan, c: int, async_op: bool):
        s, t = plan.bounds[c]
        e = self.num_local_experts
        num_send = sum(plan.send_splits[c])
        sel_N = select_true(plan.in_rank_TP[c].t(), num_send)   # flat dest*Tc + t, dest-major
        Tc = max(t - s, 1)
        tok_N = sel_N % Tc + s
        dest_N = sel_N // Tc
        send_ND, fp8 = self._payload_cast(x_TD.index_select(0, tok_N))
        lidx_NK = relative_expert_ids(topk_idx_TK.index_select(0, tok_N), dest_N * e, e)
        exchange = Exchange(self.info, plan.send_splits[c], plan.recv_splits[c],
                            fp8_field=0 if fp8 else None, async_op=async_op)
        recv = exchange(send_ND, lidx_NK, topk_weight_TK.index_select(0, tok_N))
        return tok_N, exchange, recv

    def _receive(self, sent, plan: _Plan, c: int, dtype: torch.dtype, num_tokens: int):
        tok_N, exchange, (recv_x_MD, recv_lidx_MK, recv_w_MK) = sent
        exchange.wait()
        recv_x_RD, order_R = expand_rows(recv_x_MD, recv_lidx_MK, self.num_local_experts,
                                         plan.num_expanded[c], dtype, self.workspace)
        handle = DedupHandle(tok_N, order_R, recv_w_MK, exchange, num_tokens)
        return recv_x_RD, plan.tokens_per_local_expert[c], handle

    def _combine_start(self, y_RD, handle: DedupHandle, async_op: bool):
        out_dtype = y_RD.dtype
        red_MD = reduce_rows(y_RD, handle.order_R, handle.recv_w_MK, self.workspace)
        back = handle.exchange.reversed()
        back.async_op = async_op
        (ret_ND,) = back(red_MD)

        def finish(acc_TD: torch.Tensor | None = None) -> torch.Tensor:
            """y_TD in the compute dtype, or, given an fp32 accumulator, acc + this part."""
            back.wait()
            if acc_TD is not None:
                return acc_TD.index_add(0, handle.tok_N, ret_ND.float())
            y_TD = torch.zeros((handle.num_tokens, y_RD.shape[1]), dtype=torch.float32,
                               device=y_RD.device)
            return y_TD.index_add(0, handle.tok_N, ret_ND.float()).to(out_dtype)
        return finish

    # ------------------------------------------------------------------ public API
    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK):
        plan = self._plan(topk_idx_TK, 1)
        sent = self._send(x_TD, topk_idx_TK, topk_weight_TK, plan, 0, False)
        return self._receive(sent, plan, 0, x_TD.dtype, x_TD.shape[0])

    def dispatch_compute_combine(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor,
                                 topk_weight_TK: torch.Tensor,
                                 experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                                 timer: Callable[[str], ContextManager] | None = None,
                                 side_work: Callable[[], torch.Tensor] | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """dispatch -> ``experts(recv_x_RD, tokens_per_local_expert_e)`` -> combine, in
        ``overlap_chunks`` pipelined chunks (the protocol MoE.forward uses when the
        dispatcher's ``fuse`` is true, which it is here when overlap_chunks > 1).

        ``timer``: optional ``name -> context manager`` ('dispatch', 'experts', 'combine').
        ``side_work`` (e.g. the shared experts): runs while the last combines are in
        flight and its output is added to y_TD.
        Returns y_TD [T, D] in x's dtype and tokens_per_local_expert_e (int64, all chunks).
        """
        timer = timer or (lambda name: contextlib.nullcontext())
        C = self.overlap_chunks
        T = x_TD.shape[0]
        with timer("dispatch"):
            plan = self._plan(topk_idx_TK, C)
            sent = [self._send(x_TD, topk_idx_TK, topk_weight_TK, plan, 0, True)]
        finishes = []
        for c in range(C):
            with timer("dispatch"):
                if c + 1 < C:  # keep the next chunk's exchange in flight during this compute
                    sent.append(self._send(x_TD, topk_idx_TK, topk_weight_TK, plan, c + 1, True))
                recv_x_RD, counts_e, handle = self._receive(sent[c], plan, c, x_TD.dtype, T)
                sent[c] = None
            with timer("experts"):
                recv_y_RD = experts(recv_x_RD, counts_e)
            with timer("combine"):
                finishes.append(self._combine_start(recv_y_RD, handle, True))
        with timer("combine"):
            side = side_work() if side_work is not None else None
            acc_TD = x_TD.new_zeros(x_TD.shape, dtype=torch.float32)
            for fin in finishes:
                acc_TD = fin(acc_TD)
            if side is not None:
                acc_TD = acc_TD + side.float()
        return acc_TD.to(x_TD.dtype), torch.stack(plan.tokens_per_local_expert).sum(0)
