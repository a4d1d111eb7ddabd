"""The fused kernel's combine (rows buffer + per-token gather-sum), the slot map it reads,
the router's blocked fp32 gate and the layer's non-finite row check.

Legend: T tokens, D model dim, K rows per token, R rows.
"""

from __future__ import annotations

import pytest
import torch

from epscale import MoE, MoEConfig
from epscale.moe import fused, router
from epscale.moe.fused import gather_combine, token_slots
from epscale.moe.layer import _nonfinite_rows


def random_pos(T: int, K: int, R: int, drop: float, g: torch.Generator) -> torch.Tensor:
    """[T, K] distinct rows out of R, with a fraction pointing at the zero row R."""
    pos = torch.randperm(R, generator=g)[:T * K].view(T, K).clone()
    pos[torch.rand(T, K, generator=g) < drop] = R
    return pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [1, 2, 3, 8])
def test_gather_combine_sums_each_tokens_rows(K, dtype, monkeypatch):
    monkeypatch.setattr(fused, "COMBINE_BLOCK_BYTES", 3 * K * 16 * 4)  # several blocks, last one partial
    g = torch.Generator().manual_seed(K)
    T, D = 23, 16
    R = T * K + 5
    rows = torch.randn(R + 1, D, generator=g).to(dtype)
    rows[R] = 0
    pos = random_pos(T, K, R, drop=0.2, g=g)
    out = gather_combine(rows, pos, torch.empty(T, D, dtype=dtype))
    ref32 = rows.double()[pos].sum(1)  # [T, K, D] -> [T, D], exact
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref32, rtol=1e-6, atol=1e-6)
    else:
        # Summed in fp32, rounded to bf16 once: within half a bf16 ulp (plus fp32 noise).
        err = (out.double() - ref32).abs()
        assert bool((err <= ref32.abs() * 2.0 ** -8 + 1e-6).all())


def test_gather_combine_dropped_rows_contribute_nothing():
    rows = torch.randn(5, 4)
    rows[4] = 0
    pos = torch.tensor([[0, 4], [4, 4], [3, 1]])
    out = gather_combine(rows, pos, torch.empty(3, 4))
    torch.testing.assert_close(out, torch.stack([rows[0], torch.zeros(4), rows[3] + rows[1]]))


def test_token_slots_lists_every_row_once():
    g = torch.Generator().manual_seed(0)
    T = 9
    src = torch.randint(0, T - 2, (30,), generator=g)  # two tokens have no rows at all
    pos = token_slots(src, T)
    R = src.numel()
    counts = torch.bincount(src, minlength=T)
    assert pos.shape == (T, int(counts.max()))
    real = pos[pos < R]
    assert sorted(real.tolist()) == list(range(R))
    for t in range(T):
        rows_t = pos[t][pos[t] < R]
        assert bool((src[rows_t] == t).all()) and rows_t.numel() == counts[t]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_scatter_without_slots_matches_dispatcher_path(dtype):
    torch.manual_seed(0)
    moe = MoE(MoEConfig(dim=16, hidden_dim=24, num_experts=4, top_k=2, capacity_factor=0.75)).to(dtype)
    x = torch.randn(20, 16, dtype=dtype)
    route = moe.router(x)
    y_ref, _ = moe.dispatcher.dispatch_compute_combine(x, route.topk_idx_TK, route.topk_weight_TK,
                                                       moe.experts)
    from epscale.dispatch.local import sort_by_expert
    K = route.topk_idx_TK.shape[1]
    order, _, counts = sort_by_expert(route.topk_idx_TK, 4)
    weight = route.topk_weight_TK.reshape(-1).index_select(0, order)
    y = moe.experts.forward_scatter(x, order // K, weight, counts)  # slots from src alone
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)


@pytest.mark.parametrize("T", [1, 7, 64])
def test_gate_logits_blocked_match_one_fp32_matmul(T, monkeypatch):
    monkeypatch.setattr(router, "GATE_BLOCK_BYTES", 3 * 32 * 4)  # 3 rows per block
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 32, generator=g).bfloat16()
    w = torch.randn(6, 32, generator=g).bfloat16()
    logits = router.GateLinear.apply(x, w)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, x.float() @ w.float().t(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_rows(dtype):
    x = torch.full((4, 64), 2000.0 if dtype == torch.float16 else 1e30).to(dtype)  # finite, large sums
    x[1, 3] = float("nan")
    x[3, 0] = float("-inf")
    assert _nonfinite_rows(x).tolist() == [False, True, False, True]
