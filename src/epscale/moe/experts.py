"""Routed experts as stacked weights, and the dense FFN used for shared experts.

Legend: R rows (received assignments), D model dim, F expert hidden dim, e local experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fused import HAS_GROUPED_MM, ExpertPlan, FusedExperts, default_chunk_bytes
from .rows import (BATCH_PAD_WASTE, ROW_ALIGN, ROWS_BATCH_MIN_EXPERTS, ROWS_BATCH_MIN_SHARE,
                   aligned_counts, pad_expert_rows, token_slots)
from ..config import KERNEL_MODES, kernel_mode
from ..workspace import Workspace


def _grouped_linear(x_RD: torch.Tensor, w_eDF: torch.Tensor, offs_e: torch.Tensor | None,
                    splits: list[int] | None) -> torch.Tensor:
    """x rows of group i times w[i]. Uses grouped GEMM when ``offs_e`` is given, else a
    loop over experts with the host-side ``splits``."""
    if offs_e is not None:
        return _GroupedMM.apply(x_RD, w_eDF, offs_e)
    outs = [xi @ w_eDF[i] for i, xi in enumerate(torch.split(x_RD, splits)) if xi.shape[0]]
    if not outs:
        return x_RD.new_zeros((0, w_eDF.shape[-1])) + 0 * w_eDF.sum()
    return torch.cat(outs) if len(outs) > 1 else outs[0]


class _GroupedMM(torch.autograd.Function):
    """grouped_mm with a contiguous grad in backward (the CPU kernel requires it)."""

    @staticmethod
    def forward(ctx, x_RD, w_eDF, offs_e):
        ctx.save_for_backward(x_RD, w_eDF, offs_e)
        return F.grouped_mm(x_RD, w_eDF, offs=offs_e)

    @staticmethod
    def backward(ctx, grad_RF):
        x_RD, w_eDF, offs_e = ctx.saved_tensors
        grad_RF = grad_RF.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = F.grouped_mm(grad_RF, w_eDF.transpose(1, 2), offs=offs_e)
        if ctx.needs_input_grad[1]:
            grad_w = F.grouped_mm(x_RD.t(), grad_RF, offs=offs_e)
        return grad_x, grad_w, None


class GroupedExperts(nn.Module):
    """``num_experts`` FFNs with weights stacked on a leading expert dimension.

    Parameters (names kept stable for checkpoints; the leading dim is sliced by EP):
    ``w1`` [e, D, F] (gate proj), ``w3`` [e, D, F] (up proj, SwiGLU only), ``w2`` [e, F, D].
    ``forward(x_RD, tokens_per_expert_e)``: rows grouped by expert in ascending order,
    ``tokens_per_expert_e`` int64 counts summing to R. Returns [R, D] in x's dtype.
    ``forward_scatter`` is the no-EP fast path that also gathers and combines.

    ``impl``: 'fused' (default; :mod:`epscale.moe.fused`, chunked with a hand-written
    backward) or 'autograd' (plain autograd over grouped GEMMs; kept as a second,
    independent implementation for tests and benchmarks).
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, activation: str = "swiglu",
                 use_grouped_mm: str = "auto", compile_kernels: str = "auto"):
        super().__init__()
        self.num_experts = num_experts
        self.dim, self.hidden_dim, self.activation = dim, hidden_dim, activation
        self.use_grouped_mm = HAS_GROUPED_MM and use_grouped_mm == "auto"
        # Fused impl GEMMs: 'loop' (torch.mm per expert into preallocated slices) or
        # 'grouped' (grouped_mm per chunk). 'auto' picks grouped_mm on accelerators and
        # the loop on CPU, where grouped_mm is itself a loop of mm calls and measured
        # slower (benchmarks/RESULTS.md); moe.use_grouped_mm='never' forces the loop.
        self.gemm = "auto"
        self.impl = "fused"
        # Target size of one chunk's widest buffer (fused impl); None: the device's default
        # (1 MB on CPU, cache-sized; 256 MB on accelerators, few launches).
        self.chunk_bytes: int | None = None
        # Fused impl on CPU: at most this many threads of torch's OpenMP team run its chunks
        # side by side, one chunk per thread (epscale.moe.chunk_workers); None: torch's
        # intra-op thread count where the layout allows; 1: one chunk after another, each
        # op split over all threads.
        self.chunk_workers: int | None = None
        # Pad chunks of small experts to equal rows and run them as one bmm when that adds
        # at most this fraction of rows (fused impl without EP); None: never.
        self.batch_pad_waste: float | None = BATCH_PAD_WASTE
        # Pad the rows of each expert with at least rows.ALIGN_MIN_ROWS of them to a multiple
        # of this on CPU (fused impl without EP; rows.ROW_ALIGN: some row counts run the
        # GEMMs slowly); 1: no padding.
        self.row_align: int = ROW_ALIGN
        # Weight-gradient and saved pre-activation buffers kept across steps on CPU (fused
        # impl; see workspace.Workspace). None allocates fresh ones every step.
        self.workspace: Workspace | None = Workspace()
        # moe.compile_kernels (see MoEConfig): how the fused impl runs the element-wise
        # work around its GEMMs: 'auto'/'native' (C kernels, epscale.moe.native_kernels),
        # 'inductor' (torch.compile, epscale.moe.compiled_kernels) or 'off' (eager ops).
        compile_kernels = kernel_mode(compile_kernels)
        if compile_kernels not in KERNEL_MODES:
            raise ValueError(f"GroupedExperts: compile_kernels={compile_kernels!r}; "
                             f"allowed: {', '.join(map(repr, KERNEL_MODES))}")
        self.compile_kernels = compile_kernels
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim)) if activation == "swiglu" else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w1, std=self.dim ** -0.5)
        nn.init.normal_(self.w2, std=self.hidden_dim ** -0.5)
        if self.w3 is not None:
            nn.init.normal_(self.w3, std=self.dim ** -0.5)

    def _weights(self, dtype: torch.dtype):
        w3 = self.w3.to(dtype) if self.w3 is not None else None
        return self.w1.to(dtype), w3, self.w2.to(dtype)

    def _grouped(self, x: torch.Tensor) -> bool:
        if self.gemm == "loop" or not self.use_grouped_mm:
            return False
        ok = x.dtype in (torch.float32, torch.bfloat16) and _aligned_for_grouped_mm(x, self.hidden_dim)
        return ok and (self.gemm == "grouped" or x.device.type != "cpu")

    def _check_counts(self, tokens_per_expert_e: torch.Tensor | list[int], num_rows: int) -> list[int]:
        counts = (tokens_per_expert_e.tolist() if isinstance(tokens_per_expert_e, torch.Tensor)
                  else list(tokens_per_expert_e))  # the one host sync of the expert compute
        if len(counts) != self.w1.shape[0] or sum(counts) != num_rows:
            raise ValueError(f"GroupedExperts: tokens_per_expert has {len(counts)} entries "
                             f"summing to {sum(counts)}; expected {self.w1.shape[0]} local "
                             f"experts and {num_rows} rows")
        return counts

    def forward(self, x_RD: torch.Tensor, tokens_per_expert_e: torch.Tensor) -> torch.Tensor:
        if self.impl == "autograd":
            return self._forward_autograd(x_RD, tokens_per_expert_e)
        return self._fused(x_RD, None, None, self._check_counts(tokens_per_expert_e, x_RD.shape[0]))

    def forward_scatter(self, x_TD: torch.Tensor, src_R: torch.Tensor, weight_R: torch.Tensor,
                        tokens_per_expert_e: torch.Tensor | list[int],
                        pos_TK: torch.Tensor | None = None) -> torch.Tensor:
        """y_TD[t] = sum over rows r with src_R[r] == t of weight_R[r] * expert_e(r)(x_TD[t]).

        x_TD: [T, D]; src_R: int64 [R], the token of each row, rows grouped by expert in
        ascending order; weight_R: float [R] gate weights (differentiable);
        tokens_per_expert_e: int64 [e] group sizes (a tensor, or a host list when the
        caller already synced); pos_TK: int64 [T, K] the row of each assignment, R where
        dropped (the dispatcher has it for free; derived from src_R with a sort when
        None). Returns [T, D] in x's dtype.
        """
        return self._fused(x_TD, src_R, weight_R,
                           self._check_counts(tokens_per_expert_e, src_R.shape[0]), pos_TK)

    def _fused(self, x: torch.Tensor, src_R: torch.Tensor | None, weight_R: torch.Tensor | None,
               counts: list[int], pos_TK: torch.Tensor | None = None) -> torch.Tensor:
        """The fused kernel over ``x`` ([R, D] rows, or [T, D] tokens gathered by src_R)."""
        # A chunk's widest per-row buffer sets its size: [C, D] (inputs, outputs) or [C, F]
        # (pre-activations, activation and their gradients), whichever is wider.
        row_bytes = max(x.shape[-1], self.hidden_dim) * x.element_size()
        chunk_bytes = self.chunk_bytes or default_chunk_bytes(x.device)
        grouped = self._grouped(x)
        plan, padded = self._plan(counts, row_bytes, chunk_bytes, grouped)
        if src_R is None and self._batch_rows(x, plan, padded):
            # Row mode over chunks of small experts: run it as gathered mode over the rows
            # themselves (row r is "token" r with weight 1 and one slot), which may pad.
            R = x.shape[0]
            src_R = torch.arange(R, device=x.device)
            weight_R = torch.ones(R, dtype=torch.float32, device=x.device)
            pos_TK = src_R.unsqueeze(1)
        # Gathered mode owns its row layout, so it may add pad rows (see pad_expert_rows).
        layout = counts
        if src_R is not None and not grouped and x.device.type == "cpu" and self.row_align > 1:
            aligned = aligned_counts(counts, self.row_align)
            if aligned != counts:  # an expert of rows.ALIGN_MIN_ROWS rows or more
                layout = aligned
                plan, padded = self._plan(layout, row_bytes, chunk_bytes, grouped)
        w1, w3, w2 = self._weights(x.dtype)
        if src_R is not None and pos_TK is None:
            pos_TK = token_slots(src_R, x.shape[0])
        if src_R is not None and padded is not None:
            # chunks of small experts: one bmm each (rows.BATCH_PAD_WASTE)
            layout = padded
            plan = plan.with_counts(padded)
        if layout != counts:
            src_R, weight_R, pos_TK = pad_expert_rows(src_R, weight_R, pos_TK, counts, layout)
        return FusedExperts.apply(x, weight_R, w1, w3, w2, src_R, pos_TK, plan, self.activation,
                                  self.workspace, self.compile_kernels, self.chunk_workers)

    def _plan(self, layout: list[int], row_bytes: int, chunk_bytes: int,
              grouped: bool) -> tuple[ExpertPlan, list[int] | None]:
        """The chunk plan of ``layout`` and the rows per expert that would batch its chunks
        of small experts (None: no chunk qualifies, or batching is off or not possible)."""
        plan = ExpertPlan.build(layout, row_bytes, chunk_bytes, grouped)
        if grouped or self.batch_pad_waste is None:
            return plan, None
        return plan, plan.batched_padding(self.batch_pad_waste)

    def _batch_rows(self, x: torch.Tensor, plan: ExpertPlan, padded: list[int] | None) -> bool:
        """Row mode on CPU: whether padding (``padded``, from :meth:`_plan`) turns chunks of
        ROWS_BATCH_MIN_EXPERTS or more small experts into one bmm each, for at least
        ROWS_BATCH_MIN_SHARE of the rows. Only gathered mode can pad, and running row mode
        through it copies each chunk's rows in and out once more (see rows.py)."""
        if x.device.type != "cpu" or padded is None:
            return False
        batched_rows = sum(r1 - r0 for r0, r1, e0, e1 in plan.chunks
                           if e1 - e0 >= ROWS_BATCH_MIN_EXPERTS and len(set(padded[e0:e1])) == 1)
        return batched_rows >= ROWS_BATCH_MIN_SHARE * max(plan.num_rows, 1)

    def _forward_autograd(self, x_RD: torch.Tensor, tokens_per_expert_e: torch.Tensor) -> torch.Tensor:
        use_grouped = (self.use_grouped_mm and x_RD.dtype in (torch.float32, torch.bfloat16)
                       and _aligned_for_grouped_mm(x_RD, self.hidden_dim))
        if use_grouped:
            offs_e, splits = torch.cumsum(tokens_per_expert_e, 0).to(torch.int32), None
        else:
            offs_e, splits = None, tokens_per_expert_e.tolist()  # one host sync per layer
        w1, w3, w2 = self._weights(x_RD.dtype)
        h_RF = _grouped_linear(x_RD, w1, offs_e, splits)
        if w3 is not None:
            h_RF = F.silu(h_RF) * _grouped_linear(x_RD, w3, offs_e, splits)
        else:
            h_RF = F.gelu(h_RF)
        return _grouped_linear(h_RF, w2, offs_e, splits)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, dim={self.dim}, hidden={self.hidden_dim}, "
                f"act={self.activation}, impl={self.impl}, gemm={self.gemm}, "
                f"kernels={self.compile_kernels}, "
                f"grouped_mm={self.use_grouped_mm}")


def _aligned_for_grouped_mm(x_RD: torch.Tensor, hidden_dim: int) -> bool:
    """grouped_mm needs 16-byte aligned row strides for every operand (bf16: widths % 8)."""
    per = 16 // x_RD.element_size()
    return x_RD.shape[-1] % per == 0 and hidden_dim % per == 0


class FeedForward(nn.Module):
    """Dense FFN (shared experts, dense transformer layers). SwiGLU or GELU."""

    def __init__(self, dim: int, hidden_dim: int, activation: str = "swiglu"):
        super().__init__()
        self.activation = activation
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False) if activation == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w1(x)
        h = F.silu(h) * self.w3(x) if self.w3 is not None else F.gelu(h)
        return self.w2(h)
