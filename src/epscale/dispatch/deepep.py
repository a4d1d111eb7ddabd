"""``deepep``: an adapter to DeepEP's ``deep_ep.Buffer`` (CUDA + NVLink/RDMA only).

Legend: T tokens, D model dim, K top-k, E global experts, e local experts,
M received rows (one per (token, rank), as in dedup), R expanded rows.

Written against DeepEP's (v1) ``Buffer`` API: ``get_dispatch_layout``, ``dispatch`` and
``combine`` with handles; the backward of dispatch is a combine and the backward of
combine a dispatch, as in DeepEP's own training example. Every call runs on DeepEP's
communication stream (``previous_event`` = an event captured on the current stream,
``async_finish=True``, ``allocate_on_comm_stream=True``) and the current stream then waits
on the returned event, the pattern of DeepEP's README example. One ``deep_ep.Buffer`` per
process (:class:`DeepEPBuffer`) serves every MoE layer. Choosing it where DeepEP or CUDA
is missing fails with a message naming the fallback ('dedup', the same algorithm over
torch.distributed). CI has neither, so this path runs only on a GPU cluster
(benchmarks/gpu_check.sh checks it against dedup there).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from ..plan.layout import Dims
from .base import EPDispatcher
from .comm import CommCounter, GroupInfo
from .rows import expand_rows, reduce_rows

FALLBACK = "dedup"
WIRE_BYTES = 2  # tokens travel in bf16


def deepep_available() -> tuple[bool, str]:
    """(available, reason when not)."""
    if importlib.util.find_spec("deep_ep") is None:
        return False, "the deep_ep package is not installed"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    return True, ""


def require_deepep() -> None:
    ok, why = deepep_available()
    if not ok:
        raise RuntimeError(f"dispatcher 'deepep' cannot run here: {why}. Use dispatcher="
                           f"'{FALLBACK}', the portable implementation of the same algorithm "
                           "(DeepEP normal mode) over torch.distributed")


def hidden_bytes_of(dim: int) -> int:
    """Bytes of one token row of model dim ``dim`` on the wire (bf16)."""
    return dim * WIRE_BYTES


# --------------------------------------------------------------------------------------
# The one buffer of a process (deep_ep is imported only when one is built)
# --------------------------------------------------------------------------------------

class DeepEPBuffer:
    """The one ``deep_ep.Buffer`` of this process's EP group, shared by all its MoE layers.

    DeepEP's buffers are large (hundreds of MiB each at ep = 8 by its own size hints) and,
    across nodes, each one sets up NVSHMEM/RDMA; DeepEP's examples keep one per process. :func:`epscale.parallelize` builds exactly one, sized for the largest
    ``hidden_bytes`` over the model's MoE layers before any layer is built, and hands it to
    every layer's :class:`DeepEPDispatcher`. It is owned by what it serves (the layers'
    dispatchers), not by ParallelDims: ParallelDims owns the process groups and knows
    nothing of the model's sizes, while ``parallelize`` is the one place that sees every
    layer first, so it can size the buffer once and never grow it. A layer wider than the
    size is refused (:meth:`check_fits`), never served by a silently rebuilt buffer.
    """

    def __init__(self, dims: Dims, hidden_bytes: int):
        require_deepep()
        import deep_ep  # an optional dependency: imported only where it is used

        self.group = dims.ep_group
        self.hidden_bytes = hidden_bytes
        P = dims.ep
        nvl = rdma = 0
        for cfg in (deep_ep.Buffer.get_dispatch_config(P), deep_ep.Buffer.get_combine_config(P)):
            nvl = max(nvl, cfg.get_nvl_buffer_size_hint(hidden_bytes, P))
            if dims.ep_num_nodes > 1:
                rdma = max(rdma, cfg.get_rdma_buffer_size_hint(hidden_bytes, P))
        self.num_nvl_bytes, self.num_rdma_bytes = nvl, rdma
        self.buffer = deep_ep.Buffer(self.group, nvl, rdma)
        self._capture = deep_ep.Buffer.capture

    def check_fits(self, hidden_bytes: int) -> None:
        if hidden_bytes > self.hidden_bytes:
            raise ValueError(f"deepep: a layer sends {hidden_bytes} bytes per token but the "
                             f"process's DeepEP buffer was sized for {self.hidden_bytes}; "
                             "build it for the largest layer (epscale.parallelize does)")

    def run(self, method: str, *args, **kwargs):
        """``buffer.<method>(*args, **kwargs)`` on DeepEP's communication stream, after the
        work queued so far on the current stream; the current stream waits for it (the
        event is the last item DeepEP returns)."""
        out = getattr(self.buffer, method)(*args, previous_event=self._capture(),
                                           async_finish=True, allocate_on_comm_stream=True,
                                           **kwargs)
        out[-1].current_stream_wait()
        return out


# --------------------------------------------------------------------------------------
# The adapter
# --------------------------------------------------------------------------------------

@dataclass
class _DeepEPState:
    handle: object = None           # deep_ep's communication handle
    recv_counts_e: list | None = None


@dataclass(frozen=True)
class DeepEPHandle:
    state: _DeepEPState
    order_R: torch.Tensor
    recv_w_MK: torch.Tensor
    out_dtype: torch.dtype
    rows_weighted: bool = False  # the experts applied the gate weights (run_experts)


class _Dispatch(torch.autograd.Function):
    """deep_ep dispatch; its backward is a deep_ep combine with the same handle."""

    @staticmethod
    def forward(ctx, disp, state, x_TD, topk_idx_TK, topk_weight_TK):
        shared = disp.shared
        (num_per_rank, num_per_rdma_rank, num_per_expert, in_rank, _) = shared.run(
            "get_dispatch_layout", topk_idx_TK, disp.num_experts)
        recv_x, recv_idx, recv_w, counts, handle, _ = shared.run(
            "dispatch", x_TD, topk_idx=topk_idx_TK, topk_weights=topk_weight_TK,
            num_tokens_per_rank=num_per_rank, num_tokens_per_rdma_rank=num_per_rdma_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=num_per_expert)
        state.handle, state.recv_counts_e = handle, list(counts)  # counts: host list (DeepEP's sync)
        ctx.disp, ctx.state = disp, state
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_w

    @staticmethod
    def backward(ctx, grad_x, _grad_idx, grad_w):
        gx, gw, _ = ctx.disp.shared.run("combine", grad_x.contiguous(), ctx.state.handle,
                                        topk_weights=grad_w.contiguous())
        return None, None, gx, None, gw


class _Combine(torch.autograd.Function):
    """deep_ep combine (sums a token's rows); its backward is a deep_ep dispatch."""

    @staticmethod
    def forward(ctx, disp, state, y_MD):
        ctx.disp, ctx.state = disp, state
        out, _, _ = disp.shared.run("combine", y_MD.contiguous(), state.handle)
        return out

    @staticmethod
    def backward(ctx, grad_TD):
        g, *_ = ctx.disp.shared.run("dispatch", grad_TD.contiguous(), handle=ctx.state.handle)
        return None, None, g


class DeepEPDispatcher(EPDispatcher):
    """Same contract as ``dedup`` (one row per (token, rank); the receiver expands, weights
    and reduces), with DeepEP's NVLink/RDMA kernels moving the rows. Tokens travel in bf16.
    ``shared``: the process's one :class:`DeepEPBuffer` (all layers use it)."""

    name = "deepep"

    def __init__(self, num_experts: int, dims: Dims, shared: DeepEPBuffer, workspace=None):
        info = GroupInfo.of(dims.ep_group, dims.ranks_per_node, CommCounter())
        super().__init__(num_experts, info, "auto", workspace)
        self.shared = shared

    def bytes_sent(self) -> int:
        return 0  # DeepEP moves bytes in its own kernels; they are not counted here

    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK):
        self.shared.check_fits(hidden_bytes_of(x_TD.shape[-1]))
        state = _DeepEPState()
        send_TD = x_TD.to(torch.bfloat16)
        recv_x, recv_idx, recv_w = _Dispatch.apply(self, state, send_TD, topk_idx_TK.long(),
                                                   topk_weight_TK.float())
        R = sum(state.recv_counts_e)
        recv_x_RD, order_R = expand_rows(recv_x, recv_idx, self.num_local_experts, R, x_TD.dtype,
                                         self.workspace)
        # DeepEP hands the counts back as a host list: stage them in pinned memory so the
        # copy to the device does not block the host.
        counts_e = torch.tensor(state.recv_counts_e, dtype=torch.int64, pin_memory=x_TD.is_cuda)
        counts_e = counts_e.to(x_TD.device, non_blocking=True)
        return recv_x_RD, counts_e, DeepEPHandle(state, order_R, recv_w, x_TD.dtype)

    def _combine_start(self, y_RD, handle: DeepEPHandle, async_op):
        red_MD = reduce_rows(y_RD, handle.order_R, handle.recv_w_MK, self.workspace,
                             handle.rows_weighted).to(torch.bfloat16)
        out_TD = _Combine.apply(self, handle.state, red_MD).to(handle.out_dtype)
        return lambda: out_TD
