"""Dispatch layout and the packing helpers, against per-token Python loops (no processes)."""

from __future__ import annotations

import pytest
import torch

from epscale.dispatch.comm import dequantize_fp8, pack_rows, plan_fields, quantize_fp8, unpack_rows
from epscale.dispatch.rows import chunk_bounds
from epscale.dispatch.layout import (get_dispatch_layout, group_rows_by_expert, segment_ids,
                                     select_true)


def _loop_layout(idx, E, P, L):
    T, K = idx.shape
    e = E // P
    per_rank, per_node, per_expert = [0] * P, [0] * (P // L), [0] * E
    in_rank = [[False] * P for _ in range(T)]
    in_node = [[False] * (P // L) for _ in range(T)]
    for t in range(T):
        for k in range(K):
            x = int(idx[t, k])
            if x < 0:
                continue
            per_expert[x] += 1
            in_rank[t][x // e] = True
            in_node[t][x // e // L] = True
        for p in range(P):
            per_rank[p] += in_rank[t][p]
        for n in range(P // L):
            per_node[n] += in_node[t][n]
    return per_rank, per_node, per_expert, in_rank, in_node


@pytest.mark.parametrize("E,K,P,L,T", [(8, 2, 2, 2, 13), (16, 8, 4, 2, 21), (64, 8, 8, 4, 17),
                                       (12, 3, 4, 1, 9), (8, 1, 4, 4, 0)])
def test_layout_matches_loop(E, K, P, L, T):
    g = torch.Generator().manual_seed(E * 100 + P)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
        torch.empty(0, K, dtype=torch.long)
    if T:
        idx[torch.rand(T, K, generator=g) < 0.2] = -1  # capacity drops
    lay = get_dispatch_layout(idx, E, P, L)
    per_rank, per_node, per_expert, in_rank, in_node = _loop_layout(idx, E, P, L)
    assert lay.num_tokens_per_rank_P.tolist() == per_rank
    assert lay.num_tokens_per_node_N.tolist() == per_node
    assert lay.num_tokens_per_expert_E.tolist() == per_expert
    assert lay.is_token_in_rank_TP.tolist() == (in_rank if T else [])
    assert lay.is_token_in_node_TN.tolist() == (in_node if T else [])


def test_layout_errors():
    idx = torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="divisible by num_ranks"):
        get_dispatch_layout(idx, 6, 4)
    with pytest.raises(ValueError, match="ranks_per_node=3 must divide num_ranks=4"):
        get_dispatch_layout(idx, 8, 4, 3)


def test_row_helpers():
    counts = torch.tensor([2, 0, 3, 1])
    assert segment_ids(counts, 6).tolist() == [0, 0, 2, 2, 2, 3]
    mask = torch.tensor([[True, False, True], [False, True, True]])
    assert select_true(mask, 4).tolist() == [0, 2, 4, 5]
    lidx = torch.tensor([[1, -1], [0, 1], [-1, 5]], dtype=torch.int8)  # 5: not a local expert
    order = group_rows_by_expert(lidx, 2, 3)
    assert order.tolist() == [2, 0, 3]  # expert 0: (row 1,k 0); expert 1: (0,0), (1,1)
    assert chunk_bounds(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert chunk_bounds(1, 3) == [(0, 1), (1, 1), (1, 1)]


def test_pack_roundtrip_mixed_dtypes():
    x = torch.randn(5, 7, dtype=torch.bfloat16)
    ids = torch.randint(-1, 100, (5, 3), dtype=torch.int8)
    w = torch.rand(5, 3)
    specs, row_bytes = plan_fields([(x.dtype, 7), (ids.dtype, 3), (w.dtype, 3)], None)
    assert row_bytes % 8 == 0 and row_bytes == 32  # 14 + 3 (+3 pad) + 12 = 32
    out = unpack_rows(pack_rows([x, ids, w], specs, row_bytes), specs)
    assert torch.equal(out[0], x) and torch.equal(out[1], ids) and torch.equal(out[2], w)


def test_fp8_quantization_error():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 300, generator=g) * torch.logspace(-2, 2, 64).unsqueeze(1)
    q, scale = quantize_fp8(x)
    assert q.shape == (64, 384) and scale.shape == (64, 3)  # padded to whole 128-blocks
    back = dequantize_fp8(q, scale, 300, torch.float32)
    rel = ((back - x).norm(dim=1) / x.norm(dim=1)).max()
    assert rel < 0.04, rel  # e4m3 has 3 mantissa bits: ~2-3% per row with block scales
    specs, row_bytes = plan_fields([(torch.float32, 300), (torch.float32, 2)], 0)
    w = torch.rand(64, 2)
    out = unpack_rows(pack_rows([x, w], specs, row_bytes), specs)
    torch.testing.assert_close(out[0], back)
    torch.testing.assert_close(out[1], w)
    # 300 fp8 bytes, 3 fp32 scales (4-aligned at 300), then the weights: 300+12+8 = 320.
    assert row_bytes == 320
    odd = torch.randn(4, 30)  # a width that is not a multiple of 4: scales stay aligned
    specs, odd_bytes = plan_fields([(torch.float32, 30)], 0)
    torch.testing.assert_close(unpack_rows(pack_rows([odd], specs, odd_bytes), specs)[0], odd,
                               atol=0.1, rtol=0.07)
