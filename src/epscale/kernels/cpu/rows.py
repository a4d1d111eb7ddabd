"""Row layout of the fused kernel's gathered mode (no expert parallelism, and row mode over
chunks of small experts): which row holds which assignment (``token_slots``), padding
experts to equal rows (``pad_expert_rows``), and the per-token sum of the rows
(``gather_combine``).

Legend: T tokens, D model dim, K top-k (rows per token), R rows, P padded rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops import count_ids


def gather_combine(rows_RD: torch.Tensor, pos_TK: torch.Tensor) -> torch.Tensor:
    """out[t] = sum over k of rows[pos[t, k]]: [T, D] in the rows' dtype.

    ``rows_RD`` has one extra last row of zeros that dropped assignments point at.

    One ``embedding_bag`` (mode 'sum', bags of K): it reads each row once and writes each
    token once, with no [T*K, D] gather buffer, and parallelises over tokens
    (benchmarks/cpu/combine.py). fp32 and fp16 results are bitwise those of the sequential
    sum in order k (fp16 summed in fp32, rounded once). bf16 is summed in fp32
    and rounded once too, but PyTorch's CPU kernel (fbgemm) rounds halfway cases away
    from zero instead of to even: the error stays within half a bf16 ulp, with a mean
    bias of about +6e-4 relative in magnitude for K=2, where halfway cases are common."""
    return F.embedding_bag(pos_TK, rows_RD, mode="sum")


# Row mode (the rows an EP dispatcher hands over, [R, D] grouped by expert) cannot pad in
# place, so where padding would batch chunks of at least ROWS_BATCH_MIN_EXPERTS experts
# holding at least ROWS_BATCH_MIN_SHARE of the rows, it runs through gathered mode over
# the rows themselves: row r is token r, with gate weight 1 and one slot. That costs a
# gather of each chunk's inputs (forward, and twice in backward) and one [R, D] copy out
# (forward and backward), which pays only when chunks hold several small experts (with
# two experts per chunk it did not: benchmarks/RESULTS.md).
ROWS_BATCH_MIN_EXPERTS = 4
ROWS_BATCH_MIN_SHARE = 0.5

# Gathered mode: an expert's rows are padded up to a multiple of ``moe.cpu.row_align``
# when it has at least ALIGN_MIN_ROWS of them. Why: oneDNN's bf16 GEMM runs [M, K] x
# [K, N] 10-25% slower for about one in ten row counts M that are not multiples of 8, and
# a routing that gives one large expert such a count slows the whole step. A pad row
# computes zeros, like those of the batched chunks; for small experts the padding costs
# more than it saves (benchmarks/RESULTS.md).
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
