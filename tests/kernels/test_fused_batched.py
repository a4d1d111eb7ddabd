"""Batched chunks of the fused kernel: small experts padded to equal rows and run as one
bmm per matrix, against the reference (forward and backward) and against the per-expert
loop; the padding and the plan that decides it. Also large experts padded to a multiple
of 8 rows (rows.ROW_ALIGN).

Legend: T tokens, K top-k, R rows, P padded rows.
"""

from __future__ import annotations

import pytest
import torch

from epscale.kernels.cpu import experts as experts_mod
from epscale.kernels.cpu import fused, rows
from epscale.kernels.cpu.fused import ExpertPlan
from epscale.kernels.cpu.rows import aligned_counts, pad_expert_rows
from test_moe_layer import VARIANTS, compare, make_moe


def batched_chunks_seen(monkeypatch) -> list[bool]:
    """Record, per forward, whether any chunk ran batched."""
    seen = []
    real = fused._chunks

    def spy(plan, device):
        out = real(plan, device)
        seen.append(any(c.batched for c in out))
        return out

    monkeypatch.setattr(fused, "_chunks", spy)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["softmax-norm", "sigmoid-scale", "top4-e16", "cap-probs",
                                  "gelu-cap-shared", "top1"])
def test_batched_chunks_match_reference(name, dtype, monkeypatch):
    # batched chunks replace the per-expert loop; always pad, whatever the imbalance
    moe = make_moe(dtype, gemm="loop", batch_pad_waste=100.0, **VARIANTS[name])
    seen = batched_chunks_seen(monkeypatch)
    compare(moe, (3, 11), tol=1e-5 if dtype == torch.float32 else 3e-2, dtype=dtype)
    assert seen and all(seen)


@pytest.mark.parametrize("path", ["fused", "rows"])
@pytest.mark.parametrize("chunk_bytes", [200, 1 << 30])
def test_batched_equals_loop_with_empty_expert(chunk_bytes, path, monkeypatch):
    """Same output and gradients as the per-expert loop, an expert without rows inside a
    batched chunk included (its gradient must stay exactly zero). Also in row mode, where
    the batched chunks run through gathered mode (on CPU; see the tests below)."""
    results = []
    seen = batched_chunks_seen(monkeypatch)
    for waste in (None, 100.0):
        torch.manual_seed(0)
        moe = make_moe(path=path, num_experts=8, top_k=3, chunk_bytes=chunk_bytes, gemm="loop",
                       batch_pad_waste=waste)
        moe.router.expert_bias[2] = -100.0
        g = torch.Generator(torch.get_default_device()).manual_seed(1)
        x = torch.randn(20, moe.cfg.dim, generator=g, requires_grad=True)
        y = moe(x)
        y.square().sum().backward()
        results.append((y.detach(), x.grad, {n: p.grad for n, p in moe.named_parameters()}))
    (y0, gx0, g0), (y1, gx1, g1) = results
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-6, atol=1e-6)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6, msg=n)
    for n in ("experts.w1", "experts.w2", "experts.w3"):
        assert torch.count_nonzero(g1[n][2]) == 0
    if chunk_bytes > 1000 and (path == "fused" or torch.get_default_device().type == "cpu"):
        assert seen[-1]  # one chunk of all 8 experts, padded and batched


def test_batched_padding_and_plan():
    counts = [5, 4, 0, 6, 20, 3, 3]
    plan = ExpertPlan.build(counts, row_bytes=1, chunk_bytes=16)
    assert plan.chunks == ((0, 15, 0, 4), (15, 35, 4, 5), (35, 41, 5, 7))
    # chunk 0 padded: 4 x 6 = 24 rows for 15 (60% more); the last one: 2 x 3 = 6 for 6.
    assert plan.batched_padding(max_waste=0.5) == counts  # only the last chunk, already even
    padded = plan.batched_padding(max_waste=1.0)
    assert padded == [6, 6, 6, 6, 20, 3, 3]
    new = plan.with_counts(padded)
    assert new.chunks == ((0, 24, 0, 4), (24, 44, 4, 5), (44, 50, 5, 7))
    assert new.batched == (True, False, True)  # a single-expert chunk stays a loop
    assert ExpertPlan.build([0, 0], 1).batched_padding(1.0) is None


def test_pad_rows_weigh_nothing_and_keep_gradients():
    counts, padded = [2, 0, 3], [3, 3, 3]
    src = torch.tensor([4, 7, 1, 4, 9])
    w = torch.tensor([0.5, 0.25, 0.125, 1.0, 2.0], requires_grad=True)
    pos = torch.tensor([[0, 3], [5, 1], [2, 4]])  # 5 = R: a dropped assignment
    src_P, w_P, pos_P = pad_expert_rows(src, w, pos, counts, padded)
    assert src_P.tolist() == [4, 7, 0, 0, 0, 0, 1, 4, 9]
    assert w_P.detach().tolist() == [0.5, 0.25, 0, 0, 0, 0, 0.125, 1.0, 2.0]
    assert pos_P.tolist() == [[0, 7], [9, 1], [6, 8]]  # dropped -> P, the zero row
    (w_P * torch.arange(9.0)).sum().backward()
    assert w.grad.tolist() == [0.0, 1.0, 6.0, 7.0, 8.0]


@pytest.mark.parametrize("dim,hidden", [(64, 512), (512, 64)])
def test_chunks_sized_by_the_wider_of_dim_and_hidden(dim, hidden, monkeypatch):
    """The planner's row size is the widest per-row buffer, [C, D] or [C, F]."""
    seen = []
    build = ExpertPlan.build

    def spy(counts, row_bytes, *args, **kw):
        seen.append(row_bytes)
        return build(counts, row_bytes, *args, **kw)

    monkeypatch.setattr(ExpertPlan, "build", staticmethod(spy))
    moe = make_moe(torch.float32, dim=dim, hidden_dim=hidden, num_experts=4, top_k=2)
    moe(torch.randn(16, dim))
    assert seen == [max(dim, hidden) * 4]


def test_aligned_counts_pad_large_experts_only():
    assert aligned_counts([0, 5, 511, 512, 513, 1073], 8) == [0, 5, 511, 512, 520, 1080]
    assert aligned_counts([0, 5, 9], 8, min_rows=1) == [0, 8, 16]
    assert aligned_counts([5, 9], 1, min_rows=1) == [5, 9]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["softmax-norm", "cap-probs", "gelu-cap-shared", "deepseek-like"])
def test_aligned_rows_match_reference_and_unaligned(name, dtype, monkeypatch):
    """Experts padded to a multiple of 8 rows (every expert here: ALIGN_MIN_ROWS set to 1)
    match the reference, and the unpadded layer up to the GEMMs' summation order (a GEMM
    of other M may block differently): a pad row adds exact zeros."""
    monkeypatch.setattr(rows, "ALIGN_MIN_ROWS", 1)
    layouts = []
    real = experts_mod.pad_expert_rows
    monkeypatch.setattr(experts_mod, "pad_expert_rows",
                        lambda src, w, pos, counts, padded: layouts.append(padded)
                        or real(src, w, pos, counts, padded))
    moe = make_moe(dtype, batch_pad_waste=None, **VARIANTS[name])  # alignment alone
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    _, grads = compare(moe, (2, 12), tol=tol, dtype=dtype)
    assert layouts and all(n % 8 == 0 for n in layouts[-1]), layouts
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, moe.cfg.dim, generator=g).to(dtype)
    gy = torch.randn(24, moe.cfg.dim, generator=g).to(dtype)

    def run(layer):
        layer.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_(True)
        y = layer(xr)
        y.backward(gy)
        return [y.detach(), xr.grad, *(p.grad for p in layer.parameters())]

    aligned = run(moe)
    unaligned = make_moe(dtype, batch_pad_waste=None, row_align=1, **VARIANTS[name])
    unaligned.load_state_dict(moe.state_dict())
    layouts.clear()
    plain = run(unaligned)
    assert not layouts  # nothing padded
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (2e-2, 1e-3)
    for a, b in zip(aligned, plain):
        assert (a is None and b is None) or torch.allclose(a.float(), b.float(), rtol, atol)


# Row mode (the path EP dispatchers take): on CPU, chunks of four or more small experts run
# through gathered mode over the rows themselves, so that they can be padded and batched.

@pytest.mark.cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["softmax-norm", "sigmoid-scale", "top4-e16", "cap-probs",
                                  "gelu-cap-shared", "deepseek-like"])
def test_rows_path_batched_matches_reference(name, dtype, monkeypatch):
    # always pad, whatever the imbalance
    moe = make_moe(dtype, path="rows", gemm="loop", batch_pad_waste=100.0, **VARIANTS[name])
    seen = batched_chunks_seen(monkeypatch)
    compare(moe, (3, 11), tol=1e-5 if dtype == torch.float32 else 3e-2, dtype=dtype)
    assert seen and all(seen)


def test_rows_path_batches_only_chunks_of_many_small_experts():
    ex = make_moe(num_experts=8).experts.cpu_kernel
    row_bytes, mb = 64 * 4, 1 << 20

    def batch(counts, chunk_bytes=mb, grouped=False, kernel=ex):
        return kernel._batch_rows(*kernel._plan(counts, row_bytes, chunk_bytes, grouped))

    assert batch([100, 90, 110, 100, 95, 105, 100, 100])      # one chunk of 8 near-equal experts
    assert not batch([100, 90, 110, 100, 95, 105, 100, 100], chunk_bytes=row_bytes * 200)  # 2 per chunk
    assert not batch([700, 10, 10, 10, 10, 10, 10, 10])       # padding would add 5x the rows
    assert not batch([0] * 8)                                   # no rows
    assert not batch([100] * 8, grouped=True)                  # grouped_mm chunks are not padded
    never = make_moe(num_experts=8, batch_pad_waste=None).experts.cpu_kernel
    assert not batch([100] * 8, kernel=never)
