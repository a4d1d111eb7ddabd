"""``hierarchical``: DeepEP internode dispatch over torch.distributed.

Legend: T tokens, D model dim, K top-k, E global experts, e local experts per rank,
N nodes of the EP group, L ranks per node (P = N*L), C chunks,
N1 rows sent across nodes (one per (token, destination node)), M1 rows a forwarder
receives, N2 rows it forwards (one per (token, destination rank)), M2 rows a rank
receives, R expanded rows (one per (received row, local expert)).

Stage 1 (inter-node): a token crosses to each destination node once, to the rank with
the same local index as its source (the inter group). Stage 2 (intra-node): that rank
forwards it to each of its node's ranks that hold one of its experts (the intra group).
The final rank expands the row to its local experts as ``dedup`` does. Combine reverses
both stages and reduces at each hop: a rank sums its experts, the forwarder sums its
node's rows of a token before the row crosses back, the source sums over nodes. With
group-limited (node-limited) routing a token reaches at most ``topk_groups`` nodes.

An fp8 payload is quantized at the source and re-quantized by the forwarder; the
forwarder's values already lie on the fp8 grid with the same block scales, so the
second rounding adds (almost) nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import pipeline
from .base import EPDispatcher
from .comm import Exchange, GroupInfo, exchange_counts
from .host import host_ints
from .layout import get_dispatch_layout, membership, select_true
from .rows import acc_dtype, add_rows, chunk_bounds, expand_rows, reduce_rows, relative_expert_ids


@dataclass(frozen=True)
class HierarchicalHandle:
    tok_N1: torch.Tensor       # source token of each row sent across nodes
    inter: Exchange            # stage-1 exchange (inter group)
    row_N2: torch.Tensor       # stage-1 received row of each forwarded row
    intra: Exchange            # stage-2 exchange (intra group)
    num_forwarder_rows: int    # M1
    order_R: torch.Tensor      # flat (row*K + k) of each expanded row, expert-major
    recv_w_MK: torch.Tensor    # stage-2 received gate weights
    num_tokens: int
    rows_weighted: bool = False  # the experts applied the gate weights (run_experts)


@dataclass
class _HPlan:
    bounds: list[tuple[int, int]]
    inter_send: list[list[int]]
    inter_recv: list[list[int]]
    intra_send: list[list[int]]
    intra_recv: list[list[int]]
    num_expanded: list[int]
    tokens_per_local_expert: list[torch.Tensor]
    in_node_TN: list[torch.Tensor]


class HierarchicalDispatcher(EPDispatcher):
    """Two-stage dispatch over ``inter`` (one rank per node of the EP group, same local
    index) and ``intra`` (the EP group's ranks on this node). ``overlap_chunks`` > 1
    pipelines chunks as ``dedup`` does (:mod:`.pipeline`)."""

    name = "hierarchical"
    payloads = ("auto", "bf16", "fp8")

    def __init__(self, num_experts: int, info: GroupInfo, inter: GroupInfo, intra: GroupInfo,
                 payload: str = "auto", overlap_chunks: int = 1, workspace=None,
                 overlap: bool = True):
        super().__init__(num_experts, info, payload, workspace, overlap)
        if inter.size * intra.size != info.size:
            raise ValueError(f"inter group ({inter.size}) x intra group ({intra.size}) must "
                             f"cover the EP group ({info.size})")
        self.inter, self.intra = inter, intra
        self.overlap_chunks = overlap_chunks

    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK):
        return pipeline.dispatch_one(self, x_TD, topk_idx_TK, topk_weight_TK)

    def dispatch_compute_combine(self, *args, **kwargs):
        return pipeline.dispatch_compute_combine(self, super().dispatch_compute_combine,
                                                 *args, **kwargs)

    def _plan(self, topk_idx_TK, num_chunks):
        E, e, P = self.num_experts, self.num_local_experts, self.info.size
        N, L = self.inter.size, self.intra.size
        bounds = chunk_bounds(topk_idx_TK.shape[0], num_chunks)
        metas, masks = [], []
        for s, t in bounds:
            lay = get_dispatch_layout(topk_idx_TK[s:t], E, P, L)
            per_rank_NL = lay.is_token_in_rank_TP.view(-1, N, L).sum(0)
            metas.append(torch.cat([lay.num_tokens_per_node_N.unsqueeze(1), per_rank_NL,
                                    lay.num_tokens_per_expert_E.view(N, L * e)], 1))
            masks.append(lay.is_token_in_node_TN)
        send_NCm = torch.stack(metas, 1)                                   # [N, C, 1+L+L*e]
        recv_NCm = exchange_counts(self.inter, send_NCm.reshape(N, -1)).view_as(send_NCm)
        # What this rank forwards to each rank l of its node, summed over source nodes.
        fwd = recv_NCm.sum(0)                                              # [C, 1+L+L*e]
        intra_send_LCm = torch.cat([fwd[:, 1:1 + L].t().unsqueeze(2),
                                    fwd[:, 1 + L:].view(-1, L, e).transpose(0, 1)], 2)
        intra_recv_LCm = exchange_counts(self.intra, intra_send_LCm.reshape(L, -1)
                                         ).view_as(intra_send_LCm)         # [L, C, 1+e]
        per_expert_Ce = intra_recv_LCm[:, :, 1:].sum(0)
        host = host_ints(torch.cat([send_NCm[:, :, 0].t().reshape(-1),
                                    recv_NCm[:, :, 0].t().reshape(-1),
                                    intra_send_LCm[:, :, 0].t().reshape(-1),
                                    intra_recv_LCm[:, :, 0].t().reshape(-1),
                                    per_expert_Ce.sum(1)]))                # the one host sync
        C = num_chunks

        def cut(start, width):
            return [host[start + c * width:start + (c + 1) * width] for c in range(C)]
        return _HPlan(bounds, cut(0, N), cut(C * N, N), cut(2 * C * N, L), cut(2 * C * N + C * L, L),
                      host[2 * C * (N + L):], list(per_expert_Ce.unbind(0)), masks)

    def _send(self, x_TD, topk_idx_TK, topk_weight_TK, plan: _HPlan, c, async_op):
        s, t = plan.bounds[c]
        e, L = self.num_local_experts, self.intra.size
        sel_N1 = select_true(plan.in_node_TN[c].t(), sum(plan.inter_send[c]))
        Tc = max(t - s, 1)
        tok_N1, node_N1 = sel_N1 % Tc + s, sel_N1 // Tc
        send_ND, fp8 = self._payload_cast(x_TD.index_select(0, tok_N1))
        nid_N1K = relative_expert_ids(topk_idx_TK.index_select(0, tok_N1), node_N1 * (L * e), L * e)
        inter = Exchange(self.inter, plan.inter_send[c], plan.inter_recv[c],
                         fp8_field=0 if fp8 else None, async_op=async_op)
        recv = inter(send_ND, nid_N1K, topk_weight_TK.index_select(0, tok_N1))
        return tok_N1, inter, recv, fp8

    def _receive(self, sent, plan: _HPlan, c, dtype, num_tokens):
        tok_N1, inter, recv, fp8 = sent
        x1_MD, nid_MK, w1_MK = inter.done(*recv) if inter.async_op else recv
        e, L = self.num_local_experts, self.intra.size
        M1 = x1_MD.shape[0]
        local_MK = torch.where(nid_MK >= 0, nid_MK.long() // e, torch.full_like(nid_MK, -1).long())
        in_local_ML = membership(local_MK, L)
        sel_N2 = select_true(in_local_ML.t(), sum(plan.intra_send[c]))
        row_N2, dest_N2 = sel_N2 % max(M1, 1), sel_N2 // max(M1, 1)
        lid_N2K = relative_expert_ids(nid_MK.long().index_select(0, row_N2), dest_N2 * e, e)
        intra = Exchange(self.intra, plan.intra_send[c], plan.intra_recv[c],
                         fp8_field=0 if fp8 else None)
        x2_MD, lid_MK, w2_MK = intra(x1_MD.index_select(0, row_N2), lid_N2K,
                                     w1_MK.index_select(0, row_N2))
        recv_x_RD, order_R = expand_rows(x2_MD, lid_MK, e, plan.num_expanded[c], dtype,
                                         self.workspace)
        handle = HierarchicalHandle(tok_N1, inter, row_N2, intra, M1, order_R, w2_MK, num_tokens)
        return recv_x_RD, plan.tokens_per_local_expert[c], handle

    def _combine_start(self, y_RD, handle: HierarchicalHandle, async_op):
        out_dtype, D = y_RD.dtype, y_RD.shape[1]
        red_M2D = reduce_rows(y_RD, handle.order_R, handle.recv_w_MK, self.workspace,
                              handle.rows_weighted)
        (back_N2D,) = handle.intra.reversed()(red_M2D)
        red_M1D = torch.zeros((handle.num_forwarder_rows, D), dtype=acc_dtype(out_dtype),
                              device=y_RD.device)
        red_M1D = add_rows(red_M1D, handle.row_N2, back_N2D.to(red_M1D.dtype))
        back = handle.inter.reversed()
        back.async_op = async_op
        (ret,) = back(red_M1D.to(out_dtype))

        def finish(acc_TD: torch.Tensor | None = None) -> torch.Tensor:
            (ret_N1D,) = back.done(ret) if async_op else (ret,)
            if acc_TD is not None:
                return add_rows(acc_TD, handle.tok_N1, ret_N1D.to(acc_TD.dtype))
            y_TD = torch.zeros((handle.num_tokens, D), dtype=acc_dtype(out_dtype),
                               device=y_RD.device)
            return add_rows(y_TD, handle.tok_N1, ret_N1D.to(y_TD.dtype)).to(out_dtype)
        return finish
