"""Router: scores, top-k, renormalisation and scale, group-limited routing, expert bias,
capacity dropping (both policies).

Legend: T tokens, D model dim, E experts, K top-k.
"""

from __future__ import annotations

import math

import pytest
import torch

from epscale.config import MoEConfig
from epscale.moe.router import (TopKRouter, capacity_keep_mask, expert_capacity,
                                select_experts)


def make_router(**kw) -> TopKRouter:
    base = dict(dim=16, hidden_dim=8, num_experts=8, top_k=2)
    base.update(kw)
    return TopKRouter(MoEConfig(**base))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_scores_topk_and_weights(score_func):
    router = make_router(score_func=score_func, route_norm=False)
    x_TD = torch.randn(32, 16)
    out = router(x_TD)
    logits_TE = x_TD @ router.gate.weight.t()
    scores_TE = logits_TE.softmax(-1) if score_func == "softmax" else logits_TE.sigmoid()
    torch.testing.assert_close(out.logits_TE, logits_TE)
    torch.testing.assert_close(out.scores_TE, scores_TE)
    top = scores_TE.topk(2, dim=-1)
    assert torch.equal(out.topk_idx_TK, top.indices)
    torch.testing.assert_close(out.topk_weight_TK, top.values)
    assert out.num_dropped == 0 and torch.equal(out.chosen_TK, out.topk_idx_TK)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_route_norm_and_scale(score_func):
    router = make_router(score_func=score_func, route_norm=True, route_scale=2.5)
    out = router(torch.randn(20, 16))
    torch.testing.assert_close(out.topk_weight_TK.sum(-1), torch.full((20,), 2.5))
    ratio = out.topk_weight_TK[:, 0] / out.topk_weight_TK[:, 1]
    raw = out.scores_TE.gather(1, out.topk_idx_TK)
    torch.testing.assert_close(ratio, raw[:, 0] / raw[:, 1])


def test_router_runs_in_fp32_for_bf16_input():
    router = make_router().to(torch.bfloat16)
    out = router(torch.randn(8, 16, dtype=torch.bfloat16))
    assert out.scores_TE.dtype == torch.float32
    assert out.topk_weight_TK.dtype == torch.float32
    assert out.topk_idx_TK.dtype == torch.int64


def test_expert_bias_changes_selection_not_weights():
    router = make_router(score_func="sigmoid", route_norm=False)
    x_TD = torch.randn(16, 16)
    router.expert_bias[5] = 10.0  # every token now picks expert 5
    out = router(x_TD)
    assert (out.topk_idx_TK == 5).any(dim=-1).all()
    # The weight of expert 5 is its unbiased score, never score + bias.
    w5 = out.topk_weight_TK[out.topk_idx_TK == 5]
    torch.testing.assert_close(w5, out.scores_TE[:, 5])
    assert (out.topk_weight_TK < 1.0).all()


def test_group_limited_uses_top2_sum_not_max():
    # 4 groups of 2 experts. Group 0 holds the single largest score, but group 1's two
    # scores sum higher; with topk_groups=1 routing must stay inside group 1.
    scores_TE = torch.tensor([[0.90, 0.00, 0.60, 0.55, 0.1, 0.1, 0.2, 0.2]])
    idx = select_experts(scores_TE, top_k=2, num_groups=4, topk_groups=1)
    assert sorted(idx[0].tolist()) == [2, 3]
    # Without groups the global top-2 wins.
    assert sorted(select_experts(scores_TE, 2)[0].tolist()) == [0, 2]
    # Two groups kept: groups 1 (1.15) and 0 (0.90); top-2 inside them.
    idx = select_experts(scores_TE, top_k=2, num_groups=4, topk_groups=2)
    assert sorted(idx[0].tolist()) == [0, 2]


def test_group_limited_matches_bruteforce():
    T, E, G, TG, K = 64, 16, 4, 2, 3
    scores_TE = torch.rand(T, E)
    idx = select_experts(scores_TE, K, G, TG)
    per = E // G
    for t in range(T):
        s = scores_TE[t].tolist()
        gsum = [sum(sorted(s[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(G)]
        keep = sorted(range(G), key=lambda g: -gsum[g])[:TG]
        allowed = [e for e in range(E) if e // per in keep]
        want = sorted(allowed, key=lambda e: -s[e])[:K]
        assert sorted(idx[t].tolist()) == sorted(want)


def test_expert_capacity_formula():
    assert expert_capacity(10, 2, 8, 1.0) == math.ceil(10 * 2 * 1.0 / 8) == 3
    assert expert_capacity(4096, 8, 64, 1.25) == 640
    assert expert_capacity(1, 1, 8, 0.01) == 1


def test_capacity_position_policy_keeps_earliest():
    chosen_TK = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    weight_TK = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4]])
    keep = capacity_keep_mask(chosen_TK, weight_TK, 4, capacity=2, policy="position")
    want = torch.tensor([[True, True], [True, True], [False, True], [True, False]])
    assert torch.equal(keep, want)


def test_capacity_probs_policy_drops_lowest_weight_first():
    chosen_TK = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    weight_TK = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4]])
    keep = capacity_keep_mask(chosen_TK, weight_TK, 4, capacity=2, policy="probs")
    # Expert 0 got weights 0.1, 0.8, 0.7, 0.4: keeps 0.8 and 0.7.
    want = torch.tensor([[False, True], [True, True], [True, True], [True, False]])
    assert torch.equal(keep, want)


def test_capacity_probs_ties_go_to_earlier_token():
    chosen_TK = torch.zeros(5, 1, dtype=torch.long)
    weight_TK = torch.full((5, 1), 0.5)
    keep = capacity_keep_mask(chosen_TK, weight_TK, 2, capacity=2, policy="probs")
    assert keep.view(-1).tolist() == [True, True, False, False, False]


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_router_capacity_marks_and_counts_drops(policy):
    T, E, K, cf = 64, 8, 2, 0.5
    router = make_router(num_experts=E, top_k=K, capacity_factor=cf, drop_policy=policy)
    router.expert_bias[0] = 5.0  # overload expert 0 so that drops certainly happen
    out = router(torch.randn(T, 16))
    cap = expert_capacity(T, K, E, cf)
    dropped = out.topk_idx_TK == -1
    assert out.num_dropped == int(dropped.sum()) > 0
    assert (out.topk_weight_TK[dropped] == 0).all()
    assert (out.topk_idx_TK[~dropped] == out.chosen_TK[~dropped]).all()
    kept_E = torch.bincount(out.topk_idx_TK[~dropped], minlength=E)
    assert (kept_E <= cap).all()
    routed_E = torch.bincount(out.chosen_TK.view(-1), minlength=E)
    torch.testing.assert_close(kept_E, routed_E.clamp(max=cap))


def test_gate_gets_gradient_through_weights():
    router = make_router(route_norm=False)
    x_TD = torch.randn(8, 16)
    router(x_TD).topk_weight_TK.sum().backward()
    assert router.gate.weight.grad is not None and router.gate.weight.grad.abs().sum() > 0
