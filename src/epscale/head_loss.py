"""The output head and the next-token cross-entropy fused, over chunks of tokens: the loss
without the [T, V] logits kept for backward.

``F.cross_entropy(F.linear(h, W).float(), y)`` keeps the fp32 log-softmax (T x V) until the
backward, and a pipeline's last stage kept its fp32 logits too: for DeepSeek-V3 (V =
129,280, 4,096 tokens per micro-batch) ~2 GiB each. :class:`ChunkedHeadLoss` computes the
logits of a chunk of rows at a time (:func:`epscale.plan.memory.head_chunk_rows`: the
chunk's fp32 logits stay within a fixed budget), keeps only its input h (in the compute
dtype), the weight (the parameter itself, no copy) and the targets, and recomputes each
chunk's logits in backward (Liger's fused linear cross-entropy, torchtitan's chunked
loss).

Legend: T tokens, D model dim, V vocabulary, C rows of one chunk.
"""

from __future__ import annotations

import torch

from .ops import grads_needed, mark_tensor_inputs, through_node
from .plan.memory import head_chunk_rows

IGNORE_INDEX = -100   # targets skipped by the loss, as F.cross_entropy's default


def compute_dtype_of(h: torch.Tensor) -> torch.dtype:
    """The dtype the head's product runs in: autocast's where autocast is on (as
    ``F.linear`` under autocast), else h's."""
    device = h.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return h.dtype


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for the half types, the dtype itself for fp32 and fp64."""
    return torch.promote_types(dtype, torch.float32)


class ChunkedHeadLoss(torch.autograd.Function):
    """loss = mean over the targets != -100 of ``-log_softmax(l_t)[y_t]``, with
    ``l = h_TD @ W_VD^T`` computed in ``dtype`` and upcast to fp32 (fp64 stays fp64), C
    rows at a time: what ``F.cross_entropy(F.linear(h, W).float(), y)`` gives, NaN
    when every target is ignored (its gradients then 0), as there.

    Saved: h in ``dtype``, W (as given) and the targets; nothing per vocabulary entry, not
    even a log-sum-exp (backward's softmax recomputes it with the logits: torch's softmax
    kernel is vectorized on CPU, an ``exp`` of logits - lse ran 6x slower there).
    Backward, per chunk: the logits again, softmax - one-hot scaled by grad / count, then
    grad_h (in
    ``dtype``, one GEMM over the whole V) and grad_W (each chunk's product summed in
    fp32), returned in h's and W's dtypes. Under a split backward (zero-bubble and V
    pipeline schedules: inputs' gradients, then weights', :func:`epscale.ops.grads_needed`)
    each part computes only its own gradient, so each gradient GEMM runs once; each part
    recomputes the chunks' logits."""

    @staticmethod
    def forward(ctx, h_TD: torch.Tensor, w_VD: torch.Tensor, targets_T: torch.Tensor,
                dtype: torch.dtype, chunk_rows: int) -> torch.Tensor:
        mark_tensor_inputs(ctx, h_TD, w_VD, targets_T, dtype, chunk_rows)
        with torch.autocast(h_TD.device.type, enabled=False):
            hc_TD, wc_VD = h_TD.to(dtype), w_VD.to(dtype)
            acc = _accumulation_dtype(dtype)
            T = h_TD.shape[0]
            nll_T = torch.empty(T, dtype=acc, device=h_TD.device)
            valid_T = targets_T != IGNORE_INDEX
            safe_T = torch.where(valid_T, targets_T, 0)
            for i in range(0, T, chunk_rows):
                j = min(T, i + chunk_rows)
                # upcast inside the (vectorized) log-softmax kernel: no fp32 copy of the logits
                logp_CV = torch.log_softmax(torch.mm(hc_TD[i:j], wc_VD.t()), dim=1, dtype=acc)
                nll_T[i:j] = logp_CV.gather(1, safe_T[i:j, None]).squeeze(1).neg_()
                del logp_CV
            loss = torch.where(valid_T, nll_T, 0).sum() / valid_T.sum()
        ctx.save_for_backward(hc_TD, w_VD, targets_T)
        ctx.meta = (h_TD.dtype, dtype, chunk_rows)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hc_TD, w_VD, targets_T = ctx.saved_tensors
        h_dtype, dtype, chunk_rows = ctx.meta
        need_h, need_w = grads_needed(ctx)[:2]   # a split backward asks for one at a time
        if not (need_h or need_w):
            return None, None, None, None, None
        acc = _accumulation_dtype(dtype)
        wc_VD = w_VD.to(dtype)
        valid_T = targets_T != IGNORE_INDEX
        safe_T = torch.where(valid_T, targets_T, 0)
        # grad / count per kept row, 0 for an ignored one (count 0: every row ignored)
        scale_T = valid_T.to(acc) * (grad_loss.to(acc) / valid_T.sum().clamp(min=1))
        T = hc_TD.shape[0]
        gh_TD = torch.empty_like(hc_TD) if need_h else None
        gw_VD = torch.zeros(w_VD.shape, dtype=acc, device=w_VD.device) if need_w else None
        for i in range(0, T, chunk_rows):
            j = min(T, i + chunk_rows)
            grad_CV = torch.softmax(torch.mm(hc_TD[i:j], wc_VD.t()), dim=1, dtype=acc)
            grad_CV.scatter_add_(1, safe_T[i:j, None], -torch.ones_like(scale_T[i:j, None]))
            grad_CV.mul_(scale_T[i:j, None])
            gc_CV = grad_CV.to(dtype)
            del grad_CV
            if need_h:
                torch.mm(gc_CV, wc_VD, out=gh_TD[i:j])
            if need_w:
                if gc_CV.dtype == acc:
                    gw_VD.addmm_(gc_CV.t(), hc_TD[i:j])
                else:
                    gw_VD += torch.mm(gc_CV.t(), hc_TD[i:j])
        return (gh_TD.to(h_dtype) if need_h else None,
                gw_VD.to(w_VD.dtype) if need_w else None, None, None, None)


def head_loss(h_TD: torch.Tensor, w_VD: torch.Tensor, targets_T: torch.Tensor,
              chunk_rows: int | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of the head ``w_VD`` [V, D] over the final norm's
    output ``h_TD`` [T, D] (any float dtype; the product runs in :func:`compute_dtype_of`)
    against ``targets_T`` (int64 [T], -100 skipped): a 0-dim fp32 loss (fp64 for fp64
    inputs). ``chunk_rows``: rows per chunk (default
    :func:`epscale.plan.memory.head_chunk_rows` for the device)."""
    if h_TD.dim() != 2 or w_VD.dim() != 2 or h_TD.shape[1] != w_VD.shape[1]:
        raise ValueError(f"head_loss expects h [T, D] and W [V, D], got {tuple(h_TD.shape)} "
                         f"and {tuple(w_VD.shape)}")
    if targets_T.shape != h_TD.shape[:1]:
        raise ValueError(f"head_loss expects targets [T] = [{h_TD.shape[0]}], got "
                         f"{tuple(targets_T.shape)}")
    if chunk_rows is None:
        kind = "cpu" if h_TD.device.type == "cpu" else "accelerator"
        chunk_rows = head_chunk_rows(h_TD.shape[0], w_VD.shape[0], kind)
    return ChunkedHeadLoss.apply(h_TD, through_node(w_VD), targets_T.long(),
                                 compute_dtype_of(h_TD), max(1, chunk_rows))
