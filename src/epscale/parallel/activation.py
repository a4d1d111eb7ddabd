"""Activation checkpointing (``train.activation_checkpointing``): a transformer block keeps
less for backward and recomputes the rest when backward reaches it.

* ``full``: a block keeps only its input; its whole forward runs again in backward.
* ``selective``: a block keeps the outputs of its matrix products (the attention and
  dense projections, the expert GEMMs of the grouped-GEMM path, the router's gate) and of
  the router's top-k, and recomputes the cheap element-wise work in between.

Recomputation routes identically (the router sees the same inputs and its bias changes
only after the optimizer step), the dispatchers exchange the same rows again with the
split sizes their first forward read on the host (:mod:`epscale.dispatch.host`: a
recomputation adds no host sync), and the token counters skip it
(``epscale.moe.layer.is_recomputing``), so no token is counted twice. The CPU kernel's
products run into preallocated buffers (``out=`` forms), which cannot be kept this way;
under ``selective`` they are recomputed like the rest.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from ..dispatch.host import recompute_contexts
from ..moe.layer import moe_layers

MODES = ("none", "full", "selective")

_aten = torch.ops.aten
KEEP = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
        _aten.linear.default, _aten.topk.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default}
if hasattr(_aten, "_grouped_mm"):
    KEEP.add(_aten._grouped_mm.default)


def _keep_products(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    """The selective policy's contexts, each entered together with the host-value
    record's (:func:`epscale.dispatch.host.recompute_contexts`)."""
    keep_fwd, keep_rec = create_selective_checkpoint_contexts(_keep_products)
    host_fwd, host_rec = recompute_contexts()
    return _both(keep_fwd, host_fwd), _both(keep_rec, host_rec)


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def run(fn: Callable[..., torch.Tensor], mode: str, *args) -> torch.Tensor:
    """``fn(*args)`` under ``mode`` ('none' runs it plainly)."""
    if mode == "none" or not torch.is_grad_enabled():
        return fn(*args)
    if mode == "full":
        return checkpoint(fn, *args, use_reentrant=False, context_fn=recompute_contexts)
    if mode == "selective":
        return checkpoint(fn, *args, use_reentrant=False, context_fn=_selective_contexts)
    raise ValueError(f"activation checkpointing mode {mode!r}; allowed: {', '.join(MODES)}")


def _run_as(mode: str, fn: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    return run(fn, mode, *args)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of ``model`` (its ``layers``: a ModuleDict keyed by layer
    index, as epscale's Transformer holds them, or a list), in depth order; [] without."""
    layers = getattr(model, "layers", None)
    if layers is None:
        return []
    return list(layers.values()) if isinstance(layers, torch.nn.ModuleDict) else list(layers)


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> None:
    """Set every transformer block of ``model`` (``model.layers``) to ``mode`` (after
    ``epscale.parallelize``). With recomputation, the CPU path's kept buffers are turned
    off: a recomputed forward must run the same operations as the first one (selective
    recomputation matches them one by one), and a kept buffer is handed out or not
    depending on what else still holds it."""
    if mode not in MODES:
        raise ValueError(f"train.activation_checkpointing = {mode!r}; allowed: {', '.join(MODES)}")
    for block in transformer_blocks(model):
        block.run_forward = partial(_run_as, mode)
    if mode != "none":
        for moe in moe_layers(model):
            moe.drop_kept_buffers()
