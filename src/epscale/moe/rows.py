"""Row layout of the fused kernel's gathered mode (no expert parallelism, and row mode over
chunks of small experts): which row holds which assignment (``token_slots``), padding
experts to equal rows (``pad_expert_rows``), and the per-token sum of the rows
(``gather_combine``).

Legend: T tokens, D model dim, K top-k (rows per token), R rows, P padded rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .counts import count_ids


def gather_combine(rows_RD: torch.Tensor, pos_TK: torch.Tensor) -> torch.Tensor:
    """out[t] = sum over k of rows[pos[t, k]]: [T, D] in the rows' dtype.

    ``rows_RD`` has one extra last row of zeros that dropped assignments point at.

    One ``embedding_bag`` (mode 'sum', bags of K): it reads each row once and writes each
    token once, with no [T*K, D] gather buffer, and parallelises over tokens. It replaced a
    blocked index_select + sum that moved 2-3x the bytes: 3.0-9.5x faster on CPU on the
    benchmark shapes (benchmarks/combine.py). fp32 and fp16 results are bitwise those of the
    sequential sum in order k (fp16 summed in fp32, rounded once). bf16 is summed in fp32
    and rounded once too, but PyTorch's CPU kernel (fbgemm) rounds halfway cases away
    from zero instead of to even: the error stays within half a bf16 ulp, with a mean
    bias of about +6e-4 relative in magnitude for K=2, where halfway cases are common."""
    return F.embedding_bag(pos_TK, rows_RD, mode="sum")


# Gathered mode: a chunk of small experts is padded to equal rows and run as one batched
# GEMM (bmm) per matrix when that adds at most this fraction of its rows. Why: with many
# narrow experts a chunk is a loop of tiny GEMMs, each paying a dispatch and a thread
# fork/join. With 128 experts of width 128 (D=512, top-8, 2048 tokens) the layer's step
# became 1.17x (1 thread) / 1.38x (2 threads) faster (benchmarks/RESULTS.md). Chunks of
# one expert (the coarse and fine benchmark shapes) are not affected. The allowance was
# 0.25 at first; 0.5 batches the chunks that hold one busier expert too, which made that
# shape another 1.01-1.02x faster (a tiny GEMM costs more than its padding).
BATCH_PAD_WASTE = 0.5

# Row mode (the rows an EP dispatcher hands over, [R, D] grouped by expert) cannot pad in
# place, so where padding would batch chunks of at least ROWS_BATCH_MIN_EXPERTS experts
# holding at least ROWS_BATCH_MIN_SHARE of the rows, it runs through gathered mode over
# the rows themselves: row r is token r, with gate weight 1 and one slot. That costs a
# gather of each chunk's inputs (forward, and twice in backward) and one [R, D] copy out
# (forward and backward). Measured on the rows path (benchmarks/RESULTS.md): 1.03-1.28x
# faster with 128-256 rows per expert and 5-8 experts per chunk; with two experts of 256
# rows per chunk it was 0.97-0.99x, hence the minimum of four.
ROWS_BATCH_MIN_EXPERTS = 4
ROWS_BATCH_MIN_SHARE = 0.5


# Gathered mode on CPU: an expert's rows are padded up to a multiple of ROW_ALIGN when it
# has at least ALIGN_MIN_ROWS of them. Why: oneDNN's bf16 GEMM runs [M, K] x [K, N] 10-25%
# slower than usual for about one in ten row counts M that are not multiples of 8 (37 of
# 350 M in 900-1299 with K = N = 1024 at 1 thread, 13 of 113 at 2; none of the multiples
# of 8; benchmarks/RESULTS.md), and a routing that gives one large expert such a count slows
# the whole step. That is ~1.5% of the GEMM time on average against the padding's 3.5
# rows per expert on average (a pad row computes zeros, like those of the batched
# chunks): worth it for large experts only. Measured on the layer: coarse (~1024 rows per
# expert) 1.02-1.03x faster; padding every expert made the 128- and 256-row shapes 1-3%
# slower.
ROW_ALIGN = 8
ALIGN_MIN_ROWS = 512


def aligned_counts(counts: list[int], align: int, min_rows: int | None = None) -> list[int]:
    """Each count of at least ``min_rows`` (default ALIGN_MIN_ROWS) rounded up to a
    multiple of ``align``."""
    min_rows = ALIGN_MIN_ROWS if min_rows is None else min_rows
    return [-(-n // align) * align if n >= min_rows else n for n in counts]


def pad_expert_rows(src_R: torch.Tensor, weight_R: torch.Tensor, pos_TK: torch.Tensor,
                    counts: list[int], padded: list[int]):
    """Rows re-laid out with ``padded[e] >= counts[e]`` rows per expert (gathered mode: the
    caller owns the row layout). A pad row gathers token 0 and has gate weight 0: its
    output is 0, it adds exactly 0 to every weight gradient (its activation gradient is
    scaled by the weight), and no assignment points at it, so nothing combines it.
    Returns (src_P, weight_P, pos_TK renumbered); weight_P is differentiable in weight_R."""
    dev = src_R.device
    R, P = src_R.numel(), sum(padded)
    shift, offsets = 0, []
    for n, p in zip(counts, padded):
        offsets.append(shift)
        shift += p - n
    slot_R = torch.arange(R, device=dev) + torch.repeat_interleave(
        torch.tensor(offsets, device=dev), torch.tensor(counts, device=dev), output_size=R)
    src_P = torch.zeros(P, dtype=src_R.dtype, device=dev).index_copy_(0, slot_R, src_R)
    weight_P = torch.zeros(P, dtype=weight_R.dtype, device=dev).index_copy(0, slot_R, weight_R)
    slot_ext = torch.cat([slot_R, torch.tensor([P], device=dev)])  # the zero row stays last
    return src_P, weight_P, slot_ext[pos_TK]


def token_slots(src_R: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``pos_TK`` for rows that only know their token: row ids of each token's rows,
    padded with R (the zero row) where a token has fewer rows than the busiest one.
    For callers that do not have the dispatcher's assignment order; costs a sort and a
    second host sync (the busiest token's row count), which the dispatcher path avoids."""
    R = src_R.shape[0]
    dev = src_R.device
    counts_T = count_ids(src_R, num_tokens)
    K = max(1, int(counts_T.max())) if R else 1
    order = torch.sort(src_R, stable=True).indices
    tok = src_R.index_select(0, order)
    first_T = torch.cumsum(counts_T, 0) - counts_T
    slot = torch.arange(R, device=dev) - first_T.index_select(0, tok)
    pos_TK = torch.full((num_tokens, K), R, dtype=torch.long, device=dev)
    pos_TK[tok, slot] = order
    return pos_TK
