"""The routed experts' CPU fast path (``moe.experts_impl`` 'cpu_fused'): lays the rows out
for the chunked kernel (:mod:`.fused`), pads where that lets small experts run as one
batched GEMM or keeps a large expert's GEMM off slow row counts (:mod:`.rows`), and keeps
the large buffers from step to step (:mod:`.workspace`).

Legend: T tokens, R rows (kept assignments, grouped by expert), D model dim, F expert
hidden dim, e local experts, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...config import CpuKernelConfig
from .fused import CHUNK_BYTES, ExpertPlan, FusedExperts
from .rows import ROWS_BATCH_MIN_EXPERTS, ROWS_BATCH_MIN_SHARE, aligned_counts, pad_expert_rows, token_slots
from .workspace import Workspace

HAS_GROUPED_MM = hasattr(F, "grouped_mm")


def grouped_mm_fits(x: torch.Tensor, hidden_dim: int) -> bool:
    """grouped_mm needs fp32/bf16 and 16-byte aligned row strides for every operand
    (bf16: widths a multiple of 8)."""
    per = 16 // x.element_size()
    return (x.dtype in (torch.float32, torch.bfloat16) and x.shape[-1] % per == 0
            and hidden_dim % per == 0)


class CpuFusedExperts:
    """The CPU kernel of one :class:`epscale.moe.experts.GroupedExperts`: its knobs
    (``cfg``, a :class:`~epscale.config.CpuKernelConfig`) and the buffers it keeps.

    ``allow_grouped_mm``: False when ``moe.use_grouped_mm`` is 'never' (the per-chunk
    GEMMs then always loop over experts). Weights are passed per call (the module owns
    them); ``forward_rows`` and ``forward_scatter`` are differentiable in x, the weights
    and the gate weights.
    """

    def __init__(self, cfg: CpuKernelConfig, allow_grouped_mm: bool = True):
        self.cfg = cfg
        self.allow_grouped_mm = allow_grouped_mm and HAS_GROUPED_MM
        # Weight-gradient and saved pre-activation buffers (and the [R, D] rows) kept
        # across steps (see workspace.Workspace); None allocates fresh ones every step.
        self.workspace: Workspace | None = Workspace() if cfg.keep_buffers else None

    def new_row_buffers(self) -> Workspace | None:
        """A buffer cache for a dispatcher's [R, D] rows (its gather and its combine's
        gradient), or None when buffers are not kept."""
        return Workspace() if self.cfg.keep_buffers else None

    # ------------------------------------------------------------------ entry points
    def forward_rows(self, x_RD: torch.Tensor, counts: list[int], w1: torch.Tensor,
                     w3: torch.Tensor | None, w2: torch.Tensor) -> torch.Tensor:
        """Row mode: ``x_RD`` grouped by expert (``counts`` rows each, host ints) ->
        [R, D] in x's dtype."""
        return self._run(x_RD, None, None, counts, None, w1, w3, w2)

    def forward_scatter(self, x_TD: torch.Tensor, src_R: torch.Tensor, weight_R: torch.Tensor,
                        counts: list[int], pos_TK: torch.Tensor | None, w1: torch.Tensor,
                        w3: torch.Tensor | None, w2: torch.Tensor) -> torch.Tensor:
        """Gathered mode: y_TD[t] = sum over rows r of token t of weight_R[r] * expert(x[t])
        (see :meth:`epscale.moe.experts.GroupedExperts.forward_scatter`)."""
        return self._run(x_TD, src_R, weight_R, counts, pos_TK, w1, w3, w2)

    # ------------------------------------------------------------------ the layout
    def _grouped(self, x: torch.Tensor, hidden_dim: int) -> bool:
        """grouped_mm per chunk: only when asked for (``moe.cpu.gemm: grouped``); on CPU it
        is itself a loop of mm calls and measured slower than the kernel's own loop."""
        return (self.cfg.gemm == "grouped" and self.allow_grouped_mm
                and grouped_mm_fits(x, hidden_dim))

    def _run(self, x, src_R, weight_R, counts, pos_TK, w1, w3, w2):
        """The fused kernel over ``x`` ([R, D] rows, or [T, D] tokens gathered by src_R)."""
        if x.device.type != "cpu":
            raise RuntimeError(f"moe.experts_impl='cpu_fused' runs on CPU tensors only, got "
                               f"{x.device}; use 'auto' or 'grouped_mm' on accelerators")
        cfg = self.cfg
        hidden_dim = w1.shape[-1]
        # A chunk's widest per-row buffer sets its size: [C, D] (inputs, outputs) or [C, F]
        # (pre-activations, activation and their gradients), whichever is wider.
        row_bytes = max(x.shape[-1], hidden_dim) * x.element_size()
        chunk_bytes = cfg.chunk_bytes or CHUNK_BYTES
        grouped = self._grouped(x, hidden_dim)
        plan, padded = self._plan(counts, row_bytes, chunk_bytes, grouped)
        if src_R is None and self._batch_rows(plan, padded):
            # Row mode over chunks of small experts: run it as gathered mode over the rows
            # themselves (row r is "token" r with weight 1 and one slot), which may pad.
            R = x.shape[0]
            src_R = torch.arange(R, device=x.device)
            weight_R = torch.ones(R, dtype=torch.float32, device=x.device)
            pos_TK = src_R.unsqueeze(1)
        # Gathered mode owns its row layout, so it may add pad rows (see pad_expert_rows).
        layout = counts
        if src_R is not None and not grouped and cfg.row_align > 1:
            aligned = aligned_counts(counts, cfg.row_align)
            if aligned != counts:  # an expert of rows.ALIGN_MIN_ROWS rows or more
                layout = aligned
                plan, padded = self._plan(layout, row_bytes, chunk_bytes, grouped)
        w1, w2 = w1.to(x.dtype), w2.to(x.dtype)
        w3 = w3.to(x.dtype) if w3 is not None else None
        if src_R is not None and pos_TK is None:
            pos_TK = token_slots(src_R, x.shape[0])
        if src_R is not None and padded is not None:
            # chunks of small experts: one bmm each (moe.cpu.batch_pad_waste)
            layout = padded
            plan = plan.with_counts(padded)
        if layout != counts:
            src_R, weight_R, pos_TK = pad_expert_rows(src_R, weight_R, pos_TK, counts, layout)
        activation = "swiglu" if w3 is not None else "gelu"
        return FusedExperts.apply(x, weight_R, w1, w3, w2, src_R, pos_TK, plan, activation,
                                  self.workspace, cfg.elementwise, cfg.chunk_workers)

    def _plan(self, layout: list[int], row_bytes: int, chunk_bytes: int,
              grouped: bool) -> tuple[ExpertPlan, list[int] | None]:
        """The chunk plan of ``layout`` and the rows per expert that would batch its chunks
        of small experts (None: no chunk qualifies, or batching is off or not possible)."""
        plan = ExpertPlan.build(layout, row_bytes, chunk_bytes, grouped)
        if grouped or self.cfg.batch_pad_waste is None:
            return plan, None
        return plan, plan.batched_padding(self.cfg.batch_pad_waste)

    @staticmethod
    def _batch_rows(plan: ExpertPlan, padded: list[int] | None) -> bool:
        """Row mode: whether padding (``padded``, from :meth:`_plan`) turns chunks of
        ROWS_BATCH_MIN_EXPERTS or more small experts into one bmm each, for at least
        ROWS_BATCH_MIN_SHARE of the rows. Only gathered mode can pad, and running row mode
        through it copies each chunk's rows in and out once more (see rows.py)."""
        if padded is None:
            return False
        batched_rows = sum(r1 - r0 for r0, r1, e0, e1 in plan.chunks
                           if e1 - e0 >= ROWS_BATCH_MIN_EXPERTS and len(set(padded[e0:e1])) == 1)
        return batched_rows >= ROWS_BATCH_MIN_SHARE * max(plan.num_rows, 1)

    def __repr__(self) -> str:
        return f"CpuFusedExperts({self.cfg}, workspace={self.workspace!r})"
