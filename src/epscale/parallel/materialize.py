"""Materialising a meta-built, parallelized model shard by shard: each rank allocates only
its shards and fills them with the values a single process would hold at those positions
(``epscale.model_init``: values are a function of (seed, name, position)). No rank ever
builds the whole model.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..model import Transformer
from ..model_init import initialize_
from ..plan.layout import Dims
from .shard import expert_global_rows, is_expert_param, mark_all_expert_params


def full_view(param: torch.Tensor, dims: Dims | None = None) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, full shape, offset of the local tensor in the full one) of a
    parameter: plain (the whole tensor), an FSDP DTensor (its shard), or a routed-expert
    weight sliced over expert parallelism (rows ``ep_rank * e`` on; sharded by FSDP too)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if isinstance(param, DTensor):
        shape, offset = tuple(param.shape), tuple(
            compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                  param.placements)[1])
    else:
        shape, offset = tuple(param.shape), (0,) * param.dim()
    if is_expert_param(param):
        first, total = expert_global_rows(param, dims)
        shape = (total, *shape[1:])
        offset = (first + offset[0], *offset[1:])
    return local, shape, offset


def reset_buffers_(module: nn.Module) -> None:
    """After ``to_empty``: every module that holds buffers of its own sets them again
    (rotary tables, router biases, token counters) through its ``reset_buffers()``."""
    for name, mod in module.named_modules():
        if next(mod.buffers(recurse=False), None) is None:
            continue
        reset = getattr(mod, "reset_buffers", None)
        if reset is None:
            raise TypeError(f"module {name or type(mod).__name__} ({type(mod).__name__}) holds "
                            "buffers but has no reset_buffers(); it cannot be built on the meta "
                            "device")
        reset()


def materialize(model: Transformer, device: torch.device | str, seed: int, dims=None,
                roots: list[nn.Module] | None = None) -> None:
    """Allocate a (parallelized, possibly FSDP-sharded) meta-device ``model`` on
    ``device`` and fill each rank's shard of every parameter with the values a
    single-process :func:`epscale.model.build_model` of ``seed`` holds there; buffers are
    set again. ``roots``: the modules FSDP was applied to last, when not ``model`` itself
    (the pipeline stages of a rank: together they hold all of its parameters)."""
    for root in roots or [model]:
        root.to_empty(device=device)
    mark_all_expert_params(model)  # to_empty registered new parameter objects
    initialize_(model, model.param_init, seed, view=lambda p: full_view(p, dims))
    reset_buffers_(model)
