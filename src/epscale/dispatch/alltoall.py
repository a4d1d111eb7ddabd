"""``alltoall``: the classic all-to-all dispatcher of Megatron and torchtitan.

Legend: T tokens, D model dim, K top-k, E global experts, e local experts, P EP ranks,
A = T*K assignments, S sent rows (kept assignments), R received rows.

One row per kept (token, expert) assignment. The per-expert counts are exchanged first
(one small all-to-all, then the layer's one host sync), then one ``all_to_all_single`` of
the rows there and one back. Gate weights never travel: the source rank applies them when
the rows come back, as the local dispatcher does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import count_experts
from .base import EPDispatcher
from .comm import Exchange, exchange_counts
from .host import host_ints
from .layout import segment_ids
from .rows import gather_rows, unpermute_weighted


@dataclass(frozen=True)
class AllToAllHandle:
    order_S: torch.Tensor        # flat (t*K + k) of each sent row, grouped by expert
    topk_weight_TK: torch.Tensor
    regroup_R: torch.Tensor      # source-major received row of each expert-major row
    exchange: Exchange           # the forward dispatch exchange (combine runs it reversed)
    num_tokens: int


class AllToAllDispatcher(EPDispatcher):
    name = "alltoall"

    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK):
        T, K = topk_idx_TK.shape
        E, e, P = self.num_experts, self.num_local_experts, self.info.size
        key_A, counts_E1 = count_experts(topk_idx_TK, E)
        counts_E = counts_E1[:E]
        send_counts_Pe = counts_E.view(P, e)
        recv_counts_Pe = exchange_counts(self.info, send_counts_Pe)
        # the one host sync
        host = host_ints(torch.cat([send_counts_Pe.sum(1), recv_counts_Pe.sum(1)]))
        send_splits, recv_splits = host[:P], host[P:]
        S, R = sum(send_splits), sum(recv_splits)

        order_S = torch.argsort(key_A, stable=True)[:S]
        send_x_SD, _ = self._payload_cast(gather_rows(x_TD, order_S, K, self.workspace))
        exchange = Exchange(self.info, send_splits, recv_splits)
        (recv_raw_RD,) = exchange(send_x_SD)
        # Received rows come source-major (source q, then its rows for my expert j);
        # experts want them expert-major (j, then q).
        seg_R = segment_ids(recv_counts_Pe, R)
        regroup_R = torch.argsort((seg_R % e) * P + seg_R // e, stable=True)
        recv_x_RD = recv_raw_RD.index_select(0, regroup_R).to(x_TD.dtype)
        tokens_per_local_expert_e = recv_counts_Pe.sum(0)
        return recv_x_RD, tokens_per_local_expert_e, AllToAllHandle(
            order_S, topk_weight_TK, regroup_R, exchange, T)

    def _combine_start(self, y_RD, handle: AllToAllHandle, async_op):
        inverse_R = torch.empty_like(handle.regroup_R)
        inverse_R[handle.regroup_R] = torch.arange(handle.regroup_R.numel(),
                                                   device=inverse_R.device)
        y_raw_RD = y_RD.index_select(0, inverse_R)
        back = handle.exchange.reversed()
        back.async_op = async_op
        (y,) = back(y_raw_RD)

        def finish() -> torch.Tensor:
            (y_SD,) = back.done(y) if async_op else (y,)
            return unpermute_weighted(y_SD, handle.order_S, handle.topk_weight_TK, self.workspace)
        return finish
