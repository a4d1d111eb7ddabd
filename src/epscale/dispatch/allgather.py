"""``allgather``: Megatron's all-gather dispatcher.

Legend: T tokens on this rank, Tm the largest T in the EP group, D model dim, K top-k,
E global experts, e local experts, P EP ranks, R rows this rank's experts compute.

Every rank gathers all tokens of its EP group (padded to Tm rows, with their expert ids
and gate weights), computes its local experts on the assignments that name them, applies
the gate weights and sums locally, and a reduce-scatter returns each rank the sum of all
ranks' partial outputs for its own tokens. Simple and with no data-dependent splits;
every token reaches every rank, so it wins at small EP sizes and loses at large ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ops import count_experts
from .base import EPDispatcher
from .comm import AllGatherRows, ReduceScatterRows, finished_collective
from .host import host_ints
from .rows import expand_rows, reduce_rows


@dataclass(frozen=True)
class AllGatherHandle:
    order_R: torch.Tensor     # flat (row*K + k) over the gathered rows, expert-major
    recv_w_MK: torch.Tensor   # gathered gate weights [P*Tm, K]
    num_tokens: int
    rows_weighted: bool = False  # the experts applied the gate weights (run_experts)


class AllGatherDispatcher(EPDispatcher):
    name = "allgather"

    def _gather_counts(self, T: int, counts_E: torch.Tensor) -> torch.Tensor:
        info = self.info
        mine = torch.cat([counts_E.new_full((1,), T), counts_E]).unsqueeze(0)  # no host copy
        if info.size == 1:
            return mine
        out = mine.new_empty((info.size, mine.shape[1]))
        info.counter.add(info.ranks, info.my_rank, [mine.numel() * 8] * info.size,
                         info.ranks_per_node)
        finished_collective(info, lambda async_op: dist.all_gather_into_tensor(
            out, mine, group=info.group, async_op=async_op), (out, mine))
        return out

    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK):
        T, K = topk_idx_TK.shape
        E, e, lo = self.num_experts, self.num_local_experts, self.expert_offset
        counts_E = count_experts(topk_idx_TK, E)[1][:E]
        all_PC = self._gather_counts(T, counts_E)               # [P, 1+E]
        local_e = all_PC[:, 1 + lo:1 + lo + e].sum(0)
        host = host_ints(torch.cat([all_PC[:, 0], local_e.sum().view(1)]))  # the one host sync
        Tm, R = max(host[:-1]), host[-1]
        pad = Tm - T
        payload_TD, _ = self._payload_cast(x_TD)
        if pad:
            payload_TD = torch.nn.functional.pad(payload_TD, (0, 0, 0, pad))
            topk_weight_TK = torch.nn.functional.pad(topk_weight_TK, (0, 0, 0, pad))
            topk_idx_TK = torch.nn.functional.pad(topk_idx_TK, (0, 0, 0, pad), value=-1)
        x_all = AllGatherRows.apply(self.info, payload_TD)
        w_all = AllGatherRows.apply(self.info, topk_weight_TK)
        idx_all = AllGatherRows.apply(self.info, topk_idx_TK)
        lidx_all = torch.where(idx_all >= 0, idx_all - lo, idx_all)
        recv_x_RD, order_R = expand_rows(x_all, lidx_all, e, R, x_TD.dtype, self.workspace)
        return recv_x_RD, local_e, AllGatherHandle(order_R, w_all, T)

    def _combine_start(self, y_RD, handle: AllGatherHandle, async_op):
        partial_PD = reduce_rows(y_RD, handle.order_R, handle.recv_w_MK, self.workspace,
                                 handle.rows_weighted)
        mine_TD = ReduceScatterRows.apply(self.info, partial_PD)[:handle.num_tokens]
        return lambda: mine_TD
