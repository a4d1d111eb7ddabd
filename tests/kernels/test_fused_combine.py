"""The fused kernel's combine (rows buffer + per-token gather-sum), the slot map it reads,
the dispatchers' weighted row sum against the scatter-then-bmm form it replaced,
the router's blocked fp32 gate and the layer's non-finite row check.

Legend: T tokens, D model dim, K rows per token, R rows.
"""

from __future__ import annotations

import pytest
import torch

from epscale import MoE, MoEConfig, ops
from epscale.moe import router
from epscale.kernels.cpu.rows import gather_combine, token_slots
from epscale.moe.layer import _nonfinite_rows


def random_pos(T: int, K: int, R: int, drop: float, g: torch.Generator) -> torch.Tensor:
    """[T, K] distinct rows out of R, with a fraction pointing at the zero row R."""
    pos = torch.randperm(R, generator=g)[:T * K].view(T, K).clone()
    pos[torch.rand(T, K, generator=g) < drop] = R
    return pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [1, 2, 3, 8])
def test_gather_combine_sums_each_tokens_rows(K, dtype):
    g = torch.Generator(torch.get_default_device()).manual_seed(K)
    T, D = 23, 16
    R = T * K + 5
    rows = torch.randn(R + 1, D, generator=g).to(dtype)
    rows[R] = 0
    pos = random_pos(T, K, R, drop=0.2, g=g)
    out = gather_combine(rows, pos)
    assert out.shape == (T, D) and out.dtype == dtype
    ref = rows.double()[pos].sum(1)  # [T, K, D] -> [T, D], exact
    if dtype != torch.bfloat16:
        # fp32: the sequential sum in order k; fp16: that sum in fp32, rounded once.
        seq = rows.float()[pos[:, 0]]
        for k in range(1, K):
            seq += rows.float()[pos[:, k]]
        assert torch.equal(out, seq.to(dtype))
    else:
        # Summed in fp32, rounded to bf16 once: within half a bf16 ulp (plus fp32 noise).
        err = (out.double() - ref).abs()
        assert bool((err <= ref.abs() * 2.0 ** -8 + 1e-6).all())


def test_rows_per_block():
    cpu, accel = torch.device("cpu"), torch.device("meta")  # meta stands in for an accelerator
    assert ops.rows_per_block(10_000, 1024, cpu) == ops.CPU_BLOCK_BYTES // 1024
    assert ops.rows_per_block(10_000, 1024, accel) == 10_000  # bounded by 256 MB only
    assert ops.rows_per_block(10_000, 1 << 30, cpu) == 1
    assert ops.rows_per_block(7, 4, cpu) == 7


def test_gather_combine_dropped_rows_contribute_nothing():
    rows = torch.randn(5, 4)
    rows[4] = 0
    pos = torch.tensor([[0, 4], [4, 4], [3, 1]])
    out = gather_combine(rows, pos)
    torch.testing.assert_close(out, torch.stack([rows[0], torch.zeros(4), rows[3] + rows[1]]))


def test_token_slots_lists_every_row_once():
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
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
    y_ref = moe.dispatcher.dispatch_compute_combine(x, route.topk_idx_TK, route.topk_weight_TK,
                                                    moe.experts)
    from epscale.dispatch.rows import sort_by_expert
    K = route.topk_idx_TK.shape[1]
    order, counts = sort_by_expert(route.topk_idx_TK, 4)
    weight = route.topk_weight_TK.reshape(-1).index_select(0, order)
    y = moe.experts.forward_scatter(x, order // K, weight, counts)  # slots from src alone
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)


@pytest.mark.parametrize("T", [1, 7, 64])
def test_gate_logits_blocked_match_one_fp32_matmul(T, monkeypatch):
    monkeypatch.setattr(ops, "CPU_BLOCK_BYTES", 3 * 32 * 4)  # 3 rows per block
    g = torch.Generator(torch.get_default_device()).manual_seed(T)
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


def unpermute_by_copy(y_RD, order_R, w_TK):
    """The former formulation: rows scattered into a [T*K, D] buffer, one bmm over all
    tokens (plain autograd)."""
    T, K = w_TK.shape
    full = y_RD.new_zeros((T * K, y_RD.shape[1])).index_copy(0, order_R, y_RD)
    return torch.bmm(w_TK.to(y_RD.dtype).unsqueeze(1), full.view(T, K, -1)).squeeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,drop", [(1, 0.0), (2, 0.3), (8, 0.1), (8, 0.85)])  # 0.85: dedup-like
def test_weighted_row_sum_matches_scatter_then_bmm(K, drop, dtype, monkeypatch):
    from epscale.dispatch import rows as local

    monkeypatch.setattr(ops, "CPU_BLOCK_BYTES", 5 * 16 * 2)  # backward: 5-row blocks
    g = torch.Generator(torch.get_default_device()).manual_seed(K)
    T, D = 19, 16
    keep = torch.rand(T * K, generator=g) >= drop
    order = torch.randperm(T * K, generator=g)[keep[torch.arange(T * K)]]  # kept assignments, any order
    y = torch.randn(order.numel(), D, generator=g).to(dtype)
    w = torch.rand(T, K, generator=g)
    gy = torch.randn(T, D, generator=g).to(dtype)
    outs, grads = [], []
    for fn in (local.unpermute_weighted, unpermute_by_copy):
        yy, ww = y.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = fn(yy, order, ww)
        out.backward(gy)
        outs.append(out.detach())
        grads.append((yy.grad, ww.grad))
    # Both sum the same products (weights rounded to y's dtype) in fp32 and round once.
    full = torch.zeros(T * K, D, dtype=torch.float64).index_copy(0, order, y.double())
    ref = (w.to(dtype).double().unsqueeze(-1) * full.view(T, K, D)).sum(1)
    ulp = 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -8
    for out in outs:
        assert bool(((out.double() - ref).abs() <= ref.abs() * ulp + K * 1e-6).all())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grads[0][0], grads[1][0], **tol)
    torch.testing.assert_close(grads[0][1], grads[1][1], **tol)


def test_weighted_row_sum_keeps_a_nonfinite_row_to_its_own_token():
    from epscale.dispatch.rows import unpermute_weighted

    T, K, D = 4, 2, 3
    order = torch.tensor([0, 2, 3, 6])      # (t, k) = (0,0), (1,0), (1,1), (3,0); token 2 has none
    y = torch.ones(4, D)
    y[1] = float("inf")                     # token 1's first row
    out = unpermute_weighted(y, order, torch.full((T, K), 0.5))
    assert torch.equal(out[0], torch.full((D,), 0.5))
    assert bool(torch.isinf(out[1]).all())
    assert torch.equal(out[2], torch.zeros(D)) and torch.equal(out[3], torch.full((D,), 0.5))


def test_weighted_row_sum_with_no_rows():
    from epscale.dispatch.rows import unpermute_weighted

    y = torch.zeros(0, 4, requires_grad=True)
    w = torch.rand(3, 2, requires_grad=True)
    out = unpermute_weighted(y, torch.zeros(0, dtype=torch.long), w)
    assert torch.equal(out, torch.zeros(3, 4))
    out.sum().backward()
    assert torch.equal(w.grad, torch.zeros(3, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_rows_backward_sums_each_owners_rows(dtype):
    from epscale.dispatch.rows import gather_rows

    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    M, K, D = 13, 4, 8
    keep = torch.rand(M * K, generator=g) < 0.6
    keep[K * 5:K * 6] = False                              # row owner 5 has no rows at all
    order = torch.randperm(M * K, generator=g)
    order = order[keep[order]]
    x = torch.randn(M, D, generator=g).to(dtype)
    gy = torch.randn(order.numel(), D, generator=g).to(dtype)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya = gather_rows(xa, order, K)
    yb = xb.index_select(0, order // K)
    assert torch.equal(ya, yb)
    ya.backward(gy)
    yb.backward(gy)
    assert torch.equal(xa.grad[5], torch.zeros(D, dtype=dtype))
    ref = torch.zeros(M, D, dtype=torch.float64).index_add_(0, order // K, gy.double())
    ulp = 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -8
    assert bool(((xa.grad.double() - ref).abs() <= ref.abs() * ulp + K * 1e-6).all())
    torch.testing.assert_close(xa.grad, xb.grad, rtol=0 if dtype == torch.float32 else 2e-2,
                               atol=1e-6 if dtype == torch.float32 else 2e-2)
