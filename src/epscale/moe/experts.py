"""Routed experts as stacked weights, and the dense FFN used for shared experts.

The routed experts run one of two implementations (``moe.experts_impl``): plain autograd
over grouped GEMMs (or a per-expert loop), the path for accelerators, here; or the CPU
fast path, :mod:`epscale.kernels.cpu`. 'auto' picks by the device of each call.

Host syncs: the grouped GEMMs take the group offsets as a device tensor (a cumsum of the
group sizes), so the experts read nothing on the host, forward or backward. Where torch's
fast grouped GEMM cannot run (:func:`slow_grouped_mm_reason`: on CUDA it wants bf16,
widths that are multiples of 8 and a 9.x/10.x device; its own fallback copies the offsets
to the host in every call), the experts loop over groups with host sizes read once per
forward (one sync, kept for recomputation) and say so once per process in a warning.

Legend: T tokens, R rows (received assignments), D model dim, F expert hidden dim,
e local experts, K top-k.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import CpuKernelConfig
from ..dispatch.host import host_ints
from ..kernels.cpu import HAS_GROUPED_MM, CpuFusedExperts, Workspace, grouped_mm_fits
from ..ops import grads_needed, host_shortcuts, mark_tensor_inputs, through_node
from .saved_fp8 import Fp8Storage

_WARNED_SLOW: set[str] = set()   # the reasons warned about in this process


def slow_grouped_mm_reason(x: torch.Tensor, hidden_dim: int) -> str | None:
    """Why torch's grouped GEMM would not run its fast kernel on rows ``x`` [R, D] and
    hidden width ``hidden_dim``, or None when it would. On CPU tensors (with host
    shortcuts) it needs fp32/bf16 with 16-byte aligned rows; elsewhere bf16 with D and F
    multiples of 8, and on CUDA a device of compute capability 9.x or 10.x (torch's
    CUTLASS kernels; otherwise torch loops over groups with the offsets on the host)."""
    if not HAS_GROUPED_MM:
        return f"this torch ({torch.__version__}) has no torch.nn.functional.grouped_mm"
    if host_shortcuts(x.device):
        if grouped_mm_fits(x, hidden_dim):
            return None
        return (f"{x.dtype} rows of dim {x.shape[-1]}, hidden {hidden_dim} (CPU grouped GEMM "
                "takes fp32/bf16 with 16-byte aligned rows)")
    if x.dtype != torch.bfloat16:
        return f"{x.dtype} (the fast grouped GEMM takes bfloat16)"
    if x.shape[-1] % 8 or hidden_dim % 8:
        return f"dim {x.shape[-1]}, hidden {hidden_dim} (must be multiples of 8)"
    if x.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(x.device)
        if major not in (9, 10):
            return (f"CUDA capability {major}.{minor} (torch's grouped GEMM kernels need "
                    "9.x or 10.x)")
    return None


def _warn_slow_once(reason: str) -> None:
    if reason in _WARNED_SLOW:
        return
    _WARNED_SLOW.add(reason)
    warnings.warn(f"epscale: the experts loop over groups with host offsets instead of a "
                  f"grouped GEMM (slower; one host sync per layer forward): {reason}",
                  stacklevel=2)


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
        need_x, need_w, _ = grads_needed(ctx)   # a split backward asks for one at a time
        grad_RF = grad_RF.contiguous()
        grad_x = grad_w = None
        if need_x:
            grad_x = F.grouped_mm(grad_RF, w_eDF.transpose(1, 2), offs=offs_e)
        if need_w:
            grad_w = F.grouped_mm(x_RD.t(), grad_RF, offs=offs_e)
        return grad_x, grad_w, None


class GroupedExperts(nn.Module):
    """``num_experts`` FFNs with weights stacked on a leading expert dimension.

    Parameters (names kept stable for checkpoints; the leading dim is sliced by EP):
    ``w1`` [e, D, F] (gate proj), ``w3`` [e, D, F] (up proj, SwiGLU only), ``w2`` [e, F, D].
    ``forward(x_RD, tokens_per_expert_e)``: rows grouped by expert in ascending order,
    ``tokens_per_expert_e`` int64 counts summing to R. Returns [R, D] in x's dtype.
    ``forward_scatter`` also gathers the rows from the tokens and combines them back (the
    no-EP path, where the layer's dispatcher is local).

    ``impl`` (``moe.experts_impl``): 'grouped_mm', 'cpu_fused' or 'auto' (cpu_fused for
    CPU tensors, grouped_mm elsewhere), decided per call from the input's device.
    ``use_grouped_mm``: 'auto' uses torch's grouped GEMM where it exists and fits the
    shapes, 'never' a per-expert loop. ``cpu``: the CPU kernel's knobs.
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, activation: str = "swiglu",
                 use_grouped_mm: str = "auto", impl: str = "auto",
                 cpu: CpuKernelConfig | None = None):
        super().__init__()
        self.num_experts = num_experts
        self.dim, self.hidden_dim, self.activation = dim, hidden_dim, activation
        self.use_grouped_mm = HAS_GROUPED_MM and use_grouped_mm == "auto"
        if impl not in ("auto", "grouped_mm", "cpu_fused"):
            raise ValueError(f"GroupedExperts: impl={impl!r}; allowed: 'auto', 'grouped_mm', "
                             "'cpu_fused' (moe.experts_impl)")
        self.impl = impl
        # The CPU kernel and the buffers it keeps (None when it can never run).
        self.cpu_kernel = (CpuFusedExperts(cpu or CpuKernelConfig(), use_grouped_mm == "auto")
                           if impl != "grouped_mm" else None)
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim)) if activation == "swiglu" else None
        self.reset_parameters()
        # whether the grouped path keeps only the activation's inputs and recomputes it in
        # backward (set by epscale.parallel.activation: moe_act)
        self.recompute_activation = False
        # the fp8 store of the saved rows (train.activation_storage: fp8; set by
        # epscale.parallel.activation with the region around the MoE layer's forward)
        self.fp8_storage: Fp8Storage | None = None

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w1, std=self.dim ** -0.5)
        nn.init.normal_(self.w2, std=self.hidden_dim ** -0.5)
        if self.w3 is not None:
            nn.init.normal_(self.w3, std=self.dim ** -0.5)

    def impl_for(self, x: torch.Tensor) -> str:
        """'cpu_fused' or 'grouped_mm': what runs a call on ``x``'s device ('auto' with fp8
        storage: grouped_mm, whose saved rows the store can hold)."""
        if self.impl == "auto":
            cpu = host_shortcuts(x.device) and self.fp8_storage is None
            return "cpu_fused" if cpu else "grouped_mm"
        return self.impl

    def row_buffers(self) -> Workspace | None:
        """A buffer cache for the [R, D] rows of this layer's dispatcher when the CPU
        kernel may run and keeps its buffers (``moe.cpu.keep_buffers``), else None."""
        return self.cpu_kernel.new_row_buffers() if self.cpu_kernel is not None else None

    def _host_counts(self, tokens_per_expert_e: torch.Tensor | list[int], num_rows: int
                     ) -> list[int]:
        """The group sizes as host ints, checked (the CPU kernel's input: free on CPU)."""
        counts = (tokens_per_expert_e.tolist() if isinstance(tokens_per_expert_e, torch.Tensor)
                  else list(tokens_per_expert_e))
        if len(counts) != self.w1.shape[0] or sum(counts) != num_rows:
            raise ValueError(f"GroupedExperts: tokens_per_expert has {len(counts)} entries "
                             f"summing to {sum(counts)}; expected {self.w1.shape[0]} local "
                             f"experts and {num_rows} rows")
        return counts

    def _check_groups(self, tokens_per_expert_e: torch.Tensor | list[int], num_rows: int) -> None:
        """What can be checked without reading device values: the number of groups (and,
        for host sizes, their sum)."""
        if isinstance(tokens_per_expert_e, torch.Tensor):
            if tokens_per_expert_e.numel() != self.w1.shape[0]:
                raise ValueError(f"GroupedExperts: tokens_per_expert has "
                                 f"{tokens_per_expert_e.numel()} entries; expected "
                                 f"{self.w1.shape[0]} local experts")
        else:
            self._host_counts(tokens_per_expert_e, num_rows)

    def takes_gate_weights(self, x: torch.Tensor) -> bool:
        """Whether a call on rows like ``x`` applies the rows' gate weights itself (the
        ``weight_R`` of :meth:`forward`): under ``moe_act`` on the grouped-GEMM path, where
        the weight scales the activation before the down projection (DeepSeek-V3's and
        Megatron's weighted SwiGLU), so the weights' gradient needs only the activation's
        inputs, which are kept anyway, and no [R, D] output row is kept for it."""
        return self.recompute_activation and self.impl_for(x) == "grouped_mm"

    def forward(self, x_RD: torch.Tensor, tokens_per_expert_e: torch.Tensor,
                weight_R: torch.Tensor | None = None) -> torch.Tensor:
        """y_RD [R, D] in x's dtype: row r through its expert; times ``weight_R[r]`` (float
        [R], differentiable) when given, which needs :meth:`takes_gate_weights`."""
        if weight_R is not None and not self.takes_gate_weights(x_RD):
            raise ValueError("GroupedExperts: gate weights are applied inside the experts only "
                             "under moe_act on the grouped-GEMM path (takes_gate_weights)")
        if self.impl_for(x_RD) == "grouped_mm":
            self._check_groups(tokens_per_expert_e, x_RD.shape[0])
            return self._forward_grouped(x_RD, tokens_per_expert_e, weight_R)
        counts = self._host_counts(tokens_per_expert_e, x_RD.shape[0])
        return self.cpu_kernel.forward_rows(x_RD, counts, self.w1, self.w3, self.w2)

    def forward_scatter(self, x_TD: torch.Tensor, src_R: torch.Tensor, weight_R: torch.Tensor,
                        tokens_per_expert_e: torch.Tensor | list[int],
                        pos_TK: torch.Tensor | None = None) -> torch.Tensor:
        """y_TD[t] = sum over rows r with src_R[r] == t of weight_R[r] * expert_e(r)(x_TD[t]).

        x_TD: [T, D]; src_R: int64 [R], the token of each row, rows grouped by expert in
        ascending order; weight_R: float [R] gate weights (differentiable);
        tokens_per_expert_e: int64 [e] group sizes (a device tensor: the grouped-GEMM path
        reads nothing on the host; or a host list); pos_TK: int64 [T, K] the row of each
        assignment, R where dropped (the dispatcher has it for free; None: derived from
        src_R, which costs a sort and a second host read on the CPU path). Returns [T, D]
        in x's dtype.
        """
        if self.impl_for(x_TD) == "cpu_fused":
            counts = self._host_counts(tokens_per_expert_e, src_R.shape[0])
            return self.cpu_kernel.forward_scatter(x_TD, src_R, weight_R, counts, pos_TK,
                                                   self.w1, self.w3, self.w2)
        self._check_groups(tokens_per_expert_e, src_R.shape[0])
        # rows -> experts -> each row weighted -> each token's rows summed, in fp32 with one
        # rounding (through pos_TK, a zero row for dropped assignments); under moe_act the
        # experts weight the activation (takes_gate_weights) and the rows are only summed
        rows_RD = x_TD.index_select(0, src_R)
        if self.takes_gate_weights(x_TD):
            wy_RD = self._forward_grouped(rows_RD, tokens_per_expert_e, weight_R).float()
        else:
            y32_RD = self._forward_grouped(rows_RD, tokens_per_expert_e).float()
            self._mark(y32_RD)             # the product keeps it for the weights' gradient
            wy_RD = y32_RD * weight_R.float().unsqueeze(1)
        if pos_TK is None:
            y_TD = wy_RD.new_zeros((x_TD.shape[0], wy_RD.shape[1])).index_add(0, src_R, wy_RD)
            return y_TD.to(x_TD.dtype)
        rows_RD = torch.cat([wy_RD, wy_RD.new_zeros((1, wy_RD.shape[1]))])
        return F.embedding_bag(pos_TK, rows_RD, mode="sum").to(x_TD.dtype)

    def _forward_grouped(self, x_RD: torch.Tensor,
                         tokens_per_expert_e: torch.Tensor | list[int],
                         weight_R: torch.Tensor | None = None) -> torch.Tensor:
        """Plain autograd: one grouped GEMM per weight, offsets a device tensor (no host
        sync), where torch's fast grouped GEMM runs; else a loop over experts with the
        group sizes read on the host once (kept for recomputation), with a warning.
        ``weight_R``: scales each row's activation before the down projection."""
        # each weight through a node of its own, which a split backward's two parts ask
        # about (epscale.ops.grads_needed)
        w3 = through_node(self.w3.to(x_RD.dtype)) if self.w3 is not None else None
        w1, w2 = through_node(self.w1.to(x_RD.dtype)), through_node(self.w2.to(x_RD.dtype))
        slow = slow_grouped_mm_reason(x_RD, self.hidden_dim) if self.use_grouped_mm else "never"
        if slow is None:
            counts_e = (tokens_per_expert_e if isinstance(tokens_per_expert_e, torch.Tensor)
                        else torch.tensor(tokens_per_expert_e, device=x_RD.device))
            offs_e, splits = torch.cumsum(counts_e, 0, dtype=torch.int32), None
        else:
            if slow != "never":  # moe.use_grouped_mm: never asks for the loop: no warning
                _warn_slow_once(slow)
            splits = (host_ints(tokens_per_expert_e)
                      if isinstance(tokens_per_expert_e, torch.Tensor)
                      else list(tokens_per_expert_e))  # one host sync per layer forward
            offs_e = None
        self._mark(x_RD)
        h1_RF = _grouped_linear(x_RD, w1, offs_e, splits)
        h3_RF = _grouped_linear(x_RD, w3, offs_e, splits) if w3 is not None else None
        self._mark(h1_RF, h3_RF)
        if self.recompute_activation and torch.is_grad_enabled():
            y_RD = _ActivationDown.apply(h1_RF, h3_RF, w2, offs_e, splits, weight_R)
        else:
            h_RF = _activation(h1_RF, h3_RF, self._mark)
            if weight_R is not None:
                h_RF = _weighted(h_RF, weight_R)
                self._mark(h_RF)
            y_RD = _grouped_linear(h_RF, w2, offs_e, splits)
        if weight_R is None:
            self._mark(y_RD)           # the combine keeps it for the gate gradient
        return y_RD

    def _mark(self, *tensors: torch.Tensor | None) -> None:
        if self.fp8_storage is not None:
            self.fp8_storage.mark(*tensors)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, dim={self.dim}, hidden={self.hidden_dim}, "
                f"act={self.activation}, impl={self.impl}, grouped_mm={self.use_grouped_mm}")


def _no_mark(*tensors) -> None:
    return None


def _activation(h1_RF: torch.Tensor, h3_RF: torch.Tensor | None,
                mark: Callable[..., None] = _no_mark) -> torch.Tensor:
    """The experts' activation: silu(h1) * h3 (SwiGLU), or gelu(h1); ``mark`` is shown the
    intermediates autograd saves (fp8 storage), each before the operation that saves it."""
    if h3_RF is None:
        h_RF = F.gelu(h1_RF)
        mark(h_RF)
        return h_RF
    a_RF = F.silu(h1_RF)
    mark(a_RF)                 # before the product saves it (the hooks pack at once)
    h_RF = a_RF * h3_RF
    mark(h_RF)
    return h_RF


class _ActivationDown(torch.autograd.Function):
    """``moe_act``: the experts' activation (times the rows' gate weights ``weight_R`` when
    given) and down projection, keeping only the activation's inputs (h1, h3: what
    DeepSeek-V3 caches) and the weights. Backward recomputes the activation, takes the down
    projection's gradients as its own backward does (the same grouped GEMMs; on the loop
    path its forward product runs again), the weights' as row-wise dot products summed in
    fp32, and the activation's through autograd: without weights the gradients are those
    without recomputation, bit for bit."""

    @staticmethod
    def forward(ctx, h1_RF, h3_RF, w2_eFD, offs_e, splits, weight_R):
        ctx.splits = splits
        mark_tensor_inputs(ctx, h1_RF, h3_RF, w2_eFD, offs_e, splits, weight_R)
        ctx.save_for_backward(h1_RF, h3_RF, w2_eFD, offs_e, weight_R)
        return _grouped_linear(_weighted(_activation(h1_RF, h3_RF), weight_R), w2_eFD,
                               offs_e, splits)

    @staticmethod
    def backward(ctx, grad_RD):
        h1_RF, h3_RF, w2_eFD, offs_e, weight_R = ctx.saved_tensors
        need = grads_needed(ctx)   # a split backward: the inputs' part, then the weights'
        need_h, need_w2, need_weight = need[0] or need[1], need[2], need[5]
        with torch.enable_grad():
            h1 = h1_RF.detach().requires_grad_(need_h)
            h3 = h3_RF.detach().requires_grad_(need_h) if h3_RF is not None else None
            h_RF = _activation(h1, h3)
        hw_RF = _weighted(h_RF.detach(), weight_R)     # the down projection's input
        need_hw = need_h or need_weight
        grad_hw = grad_w2 = None
        if offs_e is None:     # the loop: autograd over the recomputed products
            with torch.enable_grad():
                hw = hw_RF.requires_grad_(need_hw)
                w2 = w2_eFD.detach().requires_grad_(need_w2)
                if need_hw or need_w2:
                    torch.autograd.backward(_grouped_linear(hw, w2, None, ctx.splits), grad_RD)
            grad_hw, grad_w2 = hw.grad, w2.grad
        else:                  # _GroupedMM's backward, on the recomputed activation
            grad_RD = grad_RD.contiguous()
            if need_hw:
                grad_hw = F.grouped_mm(grad_RD, w2_eFD.transpose(1, 2), offs=offs_e)
            if need_w2:
                grad_w2 = F.grouped_mm(hw_RF.t(), grad_RD, offs=offs_e)
        grad_weight = None
        if weight_R is not None and grad_hw is not None:
            if need_weight:
                grad_weight = torch.sum(grad_hw * h_RF.detach(), 1,
                                        dtype=torch.promote_types(grad_hw.dtype, torch.float32)
                                        ).to(weight_R.dtype)
            grad_hw = _weighted(grad_hw, weight_R)
        if need_h:
            torch.autograd.backward(h_RF, grad_hw)
        return (h1.grad, (h3.grad if h3 is not None else None), grad_w2, None, None,
                grad_weight)


def _weighted(h_RF: torch.Tensor, weight_R: torch.Tensor | None) -> torch.Tensor:
    """h scaled row by row by the gate weights (cast to h's dtype), or h."""
    return h_RF if weight_R is None else h_RF * weight_R.to(h_RF.dtype).unsqueeze(1)


class FeedForward(nn.Module):
    """Dense FFN (shared experts, dense transformer layers). SwiGLU or GELU."""

    def __init__(self, dim: int, hidden_dim: int, activation: str = "swiglu"):
        super().__init__()
        self.activation = activation
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False) if activation == "swiglu" else None
        # the fp8 store of its hidden activations (train.activation_storage: fp8; set by
        # epscale.parallel.activation); its input is the caller's
        self.fp8_storage: Fp8Storage | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mark = self.fp8_storage.mark if self.fp8_storage is not None else _no_mark
        h = self.w1(x)
        mark(h)
        if self.w3 is None:
            h = F.gelu(h)
        else:
            a = F.silu(h)
            mark(a)
            u = self.w3(x)
            mark(u)
            h = a * u
        mark(h)
        return self.w2(h)
