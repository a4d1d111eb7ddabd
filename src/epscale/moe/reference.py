"""A slow reference MoE: one token at a time, one expert at a time, obviously right.

Every fast path (the grouped-GEMM layer, every dispatcher, EP) is tested against this.
It reads the parameters of an (unparallelized) :class:`epscale.MoE` and returns the output
and the auxiliary loss, differentiable through the same parameters.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _expert(moe, e: int, x_D: torch.Tensor) -> torch.Tensor:
    ex = moe.experts
    h = x_D @ ex.w1[e].to(x_D.dtype)
    if ex.w3 is not None:
        h = F.silu(h) * (x_D @ ex.w3[e].to(x_D.dtype))
    else:
        h = F.gelu(h)
    return h @ ex.w2[e].to(x_D.dtype)


def _route_one(moe, x_D: torch.Tensor):
    cfg = moe.cfg
    logits = x_D.float() @ moe.router.gate.weight.float().t()
    scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
    sel = scores.detach() + moe.router.expert_bias
    E = cfg.num_experts
    allowed = list(range(E))
    if cfg.num_groups > 0 and cfg.topk_groups < cfg.num_groups:
        per = E // cfg.num_groups
        group_scores = []
        for g in range(cfg.num_groups):
            vals = sorted(sel[g * per:(g + 1) * per].tolist(), reverse=True)
            group_scores.append((sum(vals[:min(2, per)]), g))
        keep = [g for _, g in sorted(group_scores, key=lambda p: (-p[0], p[1]))[:cfg.topk_groups]]
        allowed = [e for e in range(E) if e // per in keep]
    ranked = sorted(allowed, key=lambda e: -float(sel[e]))
    chosen = ranked[:cfg.top_k]
    weights = [scores[e] for e in chosen]
    if cfg.route_norm:
        total = sum(weights) + 1e-20
        weights = [w / total for w in weights]
    weights = [w * cfg.route_scale for w in weights]
    return chosen, weights, scores, logits


def reference_forward(moe, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (same shape as x) and aux loss of ``moe`` computed token by token."""
    cfg = moe.cfg
    shape = x.shape
    num_sequences = shape[0] if x.dim() == 3 else 1
    xs = x.reshape(-1, cfg.dim)
    T, E, K = xs.shape[0], cfg.num_experts, cfg.top_k
    routes = [_route_one(moe, xs[t]) for t in range(T)]

    # Capacity: per expert, keep the first `cap` assignments in priority order.
    kept = {(t, k) for t in range(T) for k in range(K)}
    if cfg.capacity_factor is not None:
        cap = math.ceil(T * K * cfg.capacity_factor / E)
        kept = set()
        for e in range(E):
            cands = [(t, k) for t in range(T) for k in range(K) if routes[t][0][k] == e]
            if cfg.drop_policy == "probs":
                cands.sort(key=lambda tk: (-float(routes[tk[0]][1][tk[1]].detach()), tk[0]))
            kept.update(cands[:cap])

    outs = []
    for t in range(T):
        chosen, weights, _, _ = routes[t]
        y = torch.zeros_like(xs[t])
        for k in range(K):
            if (t, k) in kept:
                y = y + weights[k].to(xs.dtype) * _expert(moe, chosen[k], xs[t])
        if moe.shared_experts is not None:
            y = y + moe.shared_experts(xs[t:t + 1])[0]
        outs.append(y)
    out = torch.stack(outs).view(shape)

    # Losses, written out per expert.
    aux = torch.zeros(())
    scores = torch.stack([r[2] for r in routes])
    logits = torch.stack([r[3] for r in routes])
    norm = scores / scores.sum(-1, keepdim=True)
    if cfg.aux_loss_coeff > 0:
        total = 0.0
        for e in range(E):
            f = sum(1 for r in routes if e in r[0]) / (T * K)
            total = total + f * norm[:, e].mean()
        aux = aux + cfg.aux_loss_coeff * E * total
    if cfg.seq_aux_loss_coeff > 0:
        S = T // num_sequences
        seq_total = 0.0
        for b in range(num_sequences):
            rows = range(b * S, (b + 1) * S)
            for e in range(E):
                f = E / (K * S) * sum(1 for t in rows if e in routes[t][0])
                seq_total = seq_total + f * norm[b * S:(b + 1) * S, e].mean()
        aux = aux + cfg.seq_aux_loss_coeff * seq_total / num_sequences
    if cfg.z_loss_coeff > 0:
        aux = aux + cfg.z_loss_coeff * torch.stack(
            [torch.logsumexp(logits[t], -1) ** 2 for t in range(T)]).mean()
    return out, aux
