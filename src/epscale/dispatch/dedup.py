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

With ``overlap_chunks`` > 1, ``dispatch_compute_combine`` pipelines that many chunks of
tokens (:mod:`.pipeline`): the next chunk's exchange is in flight during expert compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import pipeline
from .base import EPDispatcher
from .comm import Exchange, GroupInfo, exchange_counts
from .host import host_ints
from .layout import get_dispatch_layout, select_true
from .rows import acc_dtype, add_rows, chunk_bounds, expand_rows, reduce_rows, relative_expert_ids


@dataclass(frozen=True)
class DedupHandle:
    tok_N: torch.Tensor          # source token of each sent row
    order_R: torch.Tensor        # flat (row*K + k) of each expanded row, expert-major
    recv_w_MK: torch.Tensor      # received gate weights (carry the router's gradient)
    exchange: Exchange           # the dispatch exchange; combine runs it reversed
    num_tokens: int
    rows_weighted: bool = False  # the experts applied the gate weights (run_experts)


@dataclass
class _Plan:
    """Host-side split sizes of every chunk, from the one count exchange."""

    bounds: list[tuple[int, int]]
    send_splits: list[list[int]]       # [C][P]
    recv_splits: list[list[int]]       # [C][P]
    num_expanded: list[int]            # [C] rows this rank's experts compute
    tokens_per_local_expert: list[torch.Tensor]   # [C] device int64 [e]
    in_rank_TP: list[torch.Tensor]     # [C] bool masks


class DedupDispatcher(EPDispatcher):
    name = "dedup"
    payloads = ("auto", "bf16", "fp8")

    def __init__(self, num_experts: int, info: GroupInfo, payload: str = "auto",
                 overlap_chunks: int = 1, workspace=None, overlap: bool = True):
        super().__init__(num_experts, info, payload, workspace, overlap)
        self.overlap_chunks = overlap_chunks

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
        host = host_ints(torch.cat([send_PCm[:, :, 0].t().reshape(-1),
                                    recv_PCm[:, :, 0].t().reshape(-1),
                                    per_expert_Ce.sum(1)]))     # the one host sync per layer
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
        tok_N, exchange, recv = sent
        recv_x_MD, recv_lidx_MK, recv_w_MK = exchange.done(*recv) if exchange.async_op else recv
        recv_x_RD, order_R = expand_rows(recv_x_MD, recv_lidx_MK, self.num_local_experts,
                                         plan.num_expanded[c], dtype, self.workspace)
        handle = DedupHandle(tok_N, order_R, recv_w_MK, exchange, num_tokens)
        return recv_x_RD, plan.tokens_per_local_expert[c], handle

    def _combine_start(self, y_RD, handle: DedupHandle, async_op: bool):
        out_dtype = y_RD.dtype
        red_MD = reduce_rows(y_RD, handle.order_R, handle.recv_w_MK, self.workspace,
                             handle.rows_weighted)
        back = handle.exchange.reversed()
        back.async_op = async_op
        (ret,) = back(red_MD)

        def finish(acc_TD: torch.Tensor | None = None) -> torch.Tensor:
            """y_TD in the compute dtype, or, given an accumulator (fp32, or float64 for
            float64 rows), acc + this part."""
            (ret_ND,) = back.done(ret) if async_op else (ret,)
            if acc_TD is not None:
                return add_rows(acc_TD, handle.tok_N, ret_ND.to(acc_TD.dtype))
            y_TD = torch.zeros((handle.num_tokens, y_RD.shape[1]), dtype=acc_dtype(out_dtype),
                               device=y_RD.device)
            return add_rows(y_TD, handle.tok_N, ret_ND.to(y_TD.dtype)).to(out_dtype)
        return finish

    # ------------------------------------------------------------------ public API
    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK):
        return pipeline.dispatch_one(self, x_TD, topk_idx_TK, topk_weight_TK)

    def dispatch_compute_combine(self, *args, **kwargs):
        return pipeline.dispatch_compute_combine(self, super().dispatch_compute_combine,
                                                 *args, **kwargs)
