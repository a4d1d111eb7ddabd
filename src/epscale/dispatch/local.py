"""``local``: no communication (ep=1). Permute assignments by expert, unpermute after.

Legend: T tokens, D model dim, K top-k, E experts, A = T*K assignments, R kept assignments.

``dispatch_compute_combine`` (the layer's call) hands the experts the tokens, the row of
each assignment and its gate weight in one ``forward_scatter``, so that gather, expert
compute and weighted combine run as one pass (on CPU the chunked kernel of
:mod:`epscale.kernels.cpu`). ``fuse=False`` keeps the generic dispatch -> experts ->
combine steps instead, the path every EP backend takes (tests and benchmarks use it to
exercise that path without communication).

Host syncs: none when the router never drops (``dropless``: the rows are the T*K
assignments, the experts get their group sizes as a device tensor); one otherwise (the
number of kept assignments), kept for recomputation (:mod:`.host`). The CPU kernel
reads the group sizes on the host, where that is free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Dispatcher, no_timer
from .rows import assignment_rows, gather_rows, reduce_rows, row_gate_weights, sort_by_expert


@dataclass(frozen=True)
class LocalHandle:
    order_R: torch.Tensor        # flat (token*K + k) index of each received row
    topk_weight_TK: torch.Tensor
    num_tokens: int
    rows_weighted: bool = False  # the experts applied the gate weights (run_experts)


class LocalDispatcher(Dispatcher):
    """Every expert lives on this rank. Rows are one per kept (token, expert) assignment.

    ``fuse``: run :meth:`dispatch_compute_combine` as one ``experts.forward_scatter``
    (default True); False takes the generic dispatch -> experts -> combine path.
    ``dropless``: the router never drops (no id -1; ``moe.capacity_factor`` unset), so
    every assignment is a row and their number needs no host sync. False (the safe
    default) reads the number kept on the host.
    """

    name = "local"

    def __init__(self, num_experts: int, fuse: bool = True, workspace=None,
                 dropless: bool = False):
        super().__init__(num_experts, num_experts, 0, workspace)
        self.fuse = fuse
        self.dropless = dropless

    def _sort(self, topk_idx_TK):
        return sort_by_expert(topk_idx_TK, self.num_experts,
                              topk_idx_TK.numel() if self.dropless else None)

    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK):
        T, K = topk_idx_TK.shape
        order_R, tokens_per_expert_E = self._sort(topk_idx_TK)
        recv_x_RD = gather_rows(x_TD, order_R, K, self.workspace)
        return recv_x_RD, tokens_per_expert_E, LocalHandle(order_R, topk_weight_TK, T)

    def combine(self, y_RD, handle: LocalHandle):
        return reduce_rows(y_RD, handle.order_R, handle.topk_weight_TK, self.workspace,
                           handle.rows_weighted)

    def row_weights(self, handle: LocalHandle) -> torch.Tensor:
        return row_gate_weights(handle.topk_weight_TK, handle.order_R)

    def dispatch_compute_combine(self, x_TD, topk_idx_TK, topk_weight_TK, experts,
                                 timer=None, side_work=None):
        """y_TD = combine(experts(dispatch(x_TD))) (+ ``side_work()``) in one pass of
        ``experts.forward_scatter`` (a :class:`epscale.moe.experts.GroupedExperts` holding
        all E experts). Sections: 'dispatch' (sort by expert), 'experts' (gather + compute
        + combine), 'combine' (the side work)."""
        if not self.fuse:
            return super().dispatch_compute_combine(x_TD, topk_idx_TK, topk_weight_TK, experts,
                                                    timer, side_work)
        timer = timer or no_timer
        K = topk_idx_TK.shape[1]
        with timer("dispatch"):
            order_R, counts_E = self._sort(topk_idx_TK)
            src_R = order_R // K
            weight_R = topk_weight_TK.reshape(-1).index_select(0, order_R)
            pos_TK = assignment_rows(order_R, topk_idx_TK.shape)
        with timer("experts"):
            y_TD = experts.forward_scatter(x_TD, src_R, weight_R, counts_E, pos_TK)
        with timer("combine"):  # entered either way: the step breakdown always has it
            side_TD = side_work() if side_work is not None else None
        return y_TD + side_TD if side_TD is not None else y_TD

    def __repr__(self) -> str:
        return (f"LocalDispatcher(experts={self.num_experts}, fuse={self.fuse}, "
                f"dropless={self.dropless})")
