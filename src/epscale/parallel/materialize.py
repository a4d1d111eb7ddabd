"""Materialising a meta-built, parallelized model shard by shard: each rank allocates only
its shards and fills them with the values a single process would hold at those positions
(``epscale.model_init``: values are a function of (seed, name, position)). No rank ever
builds the whole model, at any layout (FSDP, pipelines, and the replicated dp x ep one,
whose expert slots may be copies of a redundant-expert placement). The last pipeline
stage's copy of the embedding is drawn under the embedding's name: the same values.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..model import Transformer
from ..model_init import InitSpec, fill_normal_, initialize_
from ..moe.layer import moe_layers
from ..placement.replicas import get_placement
from ..plan.layout import Dims
from .stage_embedding import COPY, ORIGINAL
from .shard import (EXPERT_PARAMS, expert_global_rows, held_slots, is_expert_param,
                    mark_all_expert_params)


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


def placed_expert_rows(model: nn.Module) -> dict[str, tuple[list[int], int]]:
    """{name: (the logical expert of each local row, logical experts in all)} of the
    expert weights that hold slots of a redundant-expert placement: their rows are copies
    of experts anywhere in the one-process tensor, not one contiguous run of it."""
    placement = get_placement(model)
    if placement is None:
        return {}
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for i, moe in enumerate(moe_layers(model)):
        first, n = held_slots(moe.experts)
        logical = [int(e) for e in placement.phy2log[i, first:first + n].tolist()]
        for pname in EXPERT_PARAMS:
            p = getattr(moe.experts, pname, None)
            if p is not None:
                out[names[id(p)]] = (logical, moe.cfg.num_experts)
    return out


@torch.no_grad()
def _fill_placed(model: nn.Module, spec: InitSpec, seed: int,
                 placed: dict[str, tuple[list[int], int]]) -> None:
    """Each slot row of a placed expert weight gets its logical expert's one-process row."""
    params = dict(model.named_parameters())
    for name, (logical, E) in placed.items():
        p = params[name]
        kind, std = spec(name)
        if kind != "normal":   # values that do not depend on the position
            initialize_(model, spec, seed, names=[name])
            continue
        full = (E, *p.shape[1:])
        for row, e in enumerate(logical):
            fill_normal_(p[row:row + 1], full, (e,) + (0,) * (p.dim() - 1), std, seed, name)


def materialize(model: Transformer, device: torch.device | str, seed: int, dims=None,
                roots: list[nn.Module] | None = None) -> None:
    """Allocate a (parallelized, possibly FSDP-sharded) meta-device ``model`` on
    ``device`` and fill each rank's shard of every parameter with the values a
    single-process :func:`epscale.model.build_model` of ``seed`` holds there (a slot of a
    redundant-expert placement: its logical expert's); buffers are set again.
    ``roots``: the modules FSDP was applied to last, when not ``model`` itself (the
    pipeline stages of a rank: together they hold all of its parameters)."""
    for root in roots or [model]:
        root.to_empty(device=device)
    mark_all_expert_params(model)  # to_empty registered new parameter objects
    placed = placed_expert_rows(model)
    rest = [n for n, _ in model.named_parameters() if n not in placed and n != COPY]
    initialize_(model, model.param_init, seed, view=lambda p: full_view(p, dims), names=rest)
    _fill_placed(model, model.param_init, seed, placed)
    _fill_embedding_copy(model, seed, dims)
    reset_buffers_(model)


@torch.no_grad()
def _fill_embedding_copy(model: Transformer, seed: int, dims) -> None:
    """The last pipeline stage's copy of the embedding (``stage_embedding``) gets the
    values ``tok_embeddings.weight`` holds at the same positions (drawn under that name):
    equal to the first stage's shards, with no communication."""
    copy = model.stage_embedding
    if copy is None:
        return
    kind, std = model.param_init(ORIGINAL)
    assert kind == "normal", kind  # the embedding's initialisation (Transformer.param_init)
    local, shape, offset = full_view(copy.weight, dims)
    fill_normal_(local, shape, offset, std, seed, ORIGINAL)
