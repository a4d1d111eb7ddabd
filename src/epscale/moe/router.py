"""Token-choice top-k router: softmax/sigmoid scores, group-limited selection, expert bias
for loss-free balancing, and capacity dropping.

Legend: T tokens, D model dim, E experts, K top-k, G expert groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..config import MoEConfig
from ..ops import count_ids, grads_needed, rows_per_block, through_node


@dataclass
class RouterOutput:
    topk_idx_TK: torch.Tensor     # int64 expert ids; -1 where capacity dropped the assignment
    topk_weight_TK: torch.Tensor  # fp32 gate weights (0 where dropped)
    scores_TE: torch.Tensor       # fp32 router scores (softmax or sigmoid), for losses/stats
    logits_TE: torch.Tensor       # fp32 raw logits, for the z-loss
    chosen_TK: torch.Tensor       # int64 expert ids before capacity dropping
    num_dropped: int | torch.Tensor  # assignments dropped by capacity: 0 when dropless,
    # else a 0-d int64 tensor on the input's device (no host sync; read it when reporting)


class TopKRouter(nn.Module):
    """Scores every expert for every token and keeps the top K.

    The gate runs in fp32 whatever the input dtype (small, and routing decisions are
    sensitive to rounding). ``expert_bias_E`` is added to the scores for *selection only*;
    gate weights always come from the unbiased scores.
    """

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts), persistent=True)
        if cfg.bias_update_rule == "adaptive":  # per-expert step and last sign (checkpointed)
            self.register_buffer("expert_bias_step", torch.zeros(cfg.num_experts), persistent=True)
            self.register_buffer("expert_bias_sign", torch.zeros(cfg.num_experts), persistent=True)
        nn.init.normal_(self.gate.weight, std=cfg.dim ** -0.5)

    def reset_buffers(self) -> None:
        """Zero expert bias (and adaptive-rule state), as at construction."""
        for buf in self.buffers(recurse=False):
            buf.zero_()

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        cfg = self.cfg
        logits_TE = GateLinear.apply(x_TD, through_node(self.gate.weight))
        if cfg.score_func == "softmax":
            scores_TE = logits_TE.softmax(dim=-1)
        else:
            scores_TE = logits_TE.sigmoid()
        chosen_TK = select_experts(scores_TE.detach() + self.expert_bias, cfg.top_k,
                                   cfg.num_groups, cfg.topk_groups)
        weight_TK = scores_TE.gather(1, chosen_TK)
        if cfg.route_norm:
            weight_TK = weight_TK / (weight_TK.sum(dim=-1, keepdim=True) + 1e-20)
        if cfg.route_scale != 1.0:
            weight_TK = weight_TK * cfg.route_scale
        idx_TK, num_dropped = chosen_TK, 0
        if cfg.capacity_factor is not None:
            cap = expert_capacity(x_TD.shape[0], cfg.top_k, cfg.num_experts, cfg.capacity_factor)
            keep_TK = capacity_keep_mask(chosen_TK, weight_TK.detach(), cfg.num_experts, cap,
                                         cfg.drop_policy)
            idx_TK = torch.where(keep_TK, chosen_TK, torch.full_like(chosen_TK, -1))
            weight_TK = weight_TK * keep_TK
            num_dropped = keep_TK.numel() - keep_TK.sum()  # stays on device: no host sync
        return RouterOutput(idx_TK, weight_TK, scores_TE, logits_TE, chosen_TK, num_dropped)


class GateLinear(torch.autograd.Function):
    """logits_TE = x_TD @ W_ED^T computed in fp32 (routing decisions are sensitive to
    rounding); the backward runs in x's dtype, where the gradients end up anyway. In bf16
    that avoids two fp32 [T, D] GEMMs with a tiny inner dimension E, slow on CPU.

    bf16 x is widened block by block of rows (:func:`epscale.ops.rows_per_block`), not
    all at once: on CPU a fresh fp32 copy of x (tens of MB at pretraining batch sizes)
    would be page-faulted in every step."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_TD, w_ED)
        w32_DE = w_ED.float().t()
        if x_TD.dtype == torch.float32:
            return torch.mm(x_TD, w32_DE)
        T, D = x_TD.shape
        logits_TE = torch.empty((T, w_ED.shape[0]), dtype=torch.float32, device=x_TD.device)
        B = rows_per_block(T, 4 * D, x_TD.device)
        x32_BD = torch.empty((B, D), dtype=torch.float32, device=x_TD.device)
        for i in range(0, T, B):
            j = min(T, i + B)
            torch.mm(x32_BD[:j - i].copy_(x_TD[i:j]), w32_DE, out=logits_TE[i:j])
        return logits_TE

    @staticmethod
    def backward(ctx, g_TE: torch.Tensor):
        x_TD, w_ED = ctx.saved_tensors
        need_x, need_w = grads_needed(ctx)     # a split backward asks for one at a time
        g_TE = g_TE.to(x_TD.dtype)
        gx = torch.mm(g_TE, w_ED.to(x_TD.dtype)) if need_x else None
        gw = torch.mm(g_TE.t(), x_TD).to(w_ED.dtype) if need_w else None
        return gx, gw


def select_experts(sel_scores_TE: torch.Tensor, top_k: int, num_groups: int = 0,
                   topk_groups: int = 0) -> torch.Tensor:
    """Top-k expert ids from selection scores; with groups, only inside the ``topk_groups``
    groups whose top-2 scores sum highest (DeepSeek-V3 node-limited routing)."""
    T, E = sel_scores_TE.shape
    if num_groups > 0 and topk_groups < num_groups:
        per_group = E // num_groups
        grouped_TGe = sel_scores_TE.view(T, num_groups, per_group)
        top = min(2, per_group)
        group_score_TG = grouped_TGe.topk(top, dim=-1).values.sum(dim=-1)
        keep_idx_TG = group_score_TG.topk(topk_groups, dim=-1).indices
        group_mask_TG = torch.zeros_like(group_score_TG, dtype=torch.bool)
        group_mask_TG.scatter_(1, keep_idx_TG, True)
        expert_mask_TE = group_mask_TG.unsqueeze(-1).expand(T, num_groups, per_group).reshape(T, E)
        sel_scores_TE = sel_scores_TE.masked_fill(~expert_mask_TE, float("-inf"))
    return sel_scores_TE.topk(top_k, dim=-1).indices


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Assignments each expert may take: ceil(T*K*cf/E)."""
    return int(math.ceil(num_tokens * top_k * capacity_factor / num_experts))


def capacity_keep_mask(chosen_TK: torch.Tensor, weight_TK: torch.Tensor, num_experts: int,
                       capacity: int, policy: str) -> torch.Tensor:
    """Bool [T, K]: which assignments fit in their expert's capacity.

    'position': first come, first served in token order. 'probs': per expert, the
    assignments with the highest gate weight win (batch-prioritised routing); ties go to
    the earlier token. Vectorised: one sort, no loop over experts or tokens.
    """
    T, K = chosen_TK.shape
    flat_A = chosen_TK.reshape(-1)
    A = flat_A.numel()
    if policy == "probs":
        # Order assignments by (expert asc, weight desc, position asc) with two stable sorts.
        by_weight = torch.argsort(-weight_TK.reshape(-1).float(), stable=True)
        order = by_weight[torch.argsort(flat_A[by_weight], stable=True)]
    else:
        # Token order: assignment index t*K + k is already position order.
        order = torch.argsort(flat_A, stable=True)
    sorted_e = flat_A[order]
    counts_E = count_ids(flat_A, num_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_in_expert = torch.arange(A, device=flat_A.device) - starts_E[sorted_e]
    keep_sorted = rank_in_expert < capacity
    keep_A = torch.empty_like(keep_sorted)
    keep_A[order] = keep_sorted
    return keep_A.view(T, K)
