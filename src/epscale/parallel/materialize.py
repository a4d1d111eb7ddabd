"""Initial weights that do not depend on the layout: every parameter's values are a
function of (seed, parameter name, position in the full tensor), generated block by block
of rows, so a rank fills only its own shard and gets exactly the values a single process
would hold at those positions. No rank ever builds the whole model (meta-device init).

Legend: R rows of dim 0 of a parameter's full shape, r rows of one generation block.

A parameter's full tensor is cut along dim 0 into blocks of about 2^20 elements (at least
one row; a routed-expert weight [E, D, F] usually gives one expert per block); block b is
drawn from its own generator, seeded from (seed, name, b). A shard that covers rows
[a, b) of dim 0 (and any part of the other dims) generates the blocks that overlap it and
keeps the overlap. The block size depends on the full shape only.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..plan.layout import Dims
from .shard import expert_global_rows, is_expert_param

BLOCK_ELEMENTS = 1 << 20
# spec(name) -> ("normal", std) | ("ones", None) | ("zeros", None)
InitSpec = Callable[[str], tuple[str, float | None]]


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def rows_per_block(full_shape: tuple[int, ...]) -> int:
    row = math.prod(full_shape[1:]) if len(full_shape) > 1 else 1
    return max(1, BLOCK_ELEMENTS // max(row, 1))


@torch.no_grad()
def fill_normal_(local: torch.Tensor, full_shape: tuple[int, ...], offset: tuple[int, ...],
                 std: float, seed: int, name: str) -> torch.Tensor:
    """Fill ``local`` (the part of a parameter of ``full_shape`` that starts at ``offset``)
    with N(0, std) values that depend only on (seed, name, position); returns ``local``."""
    if local.numel() == 0:
        return local
    if local.dim() == 0:
        g = torch.Generator().manual_seed(_block_seed(seed, name, 0))
        return local.copy_(torch.empty(()).normal_(0.0, std, generator=g))
    r = rows_per_block(full_shape)
    lo, hi = offset[0], offset[0] + local.shape[0]
    rest = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:]))
    for b in range(lo // r, -(-hi // r)):
        b0, b1 = b * r, min((b + 1) * r, full_shape[0])
        g = torch.Generator().manual_seed(_block_seed(seed, name, b))
        block = torch.empty((b1 - b0, *full_shape[1:])).normal_(0.0, std, generator=g)
        s0, s1 = max(lo, b0), min(hi, b1)
        local[s0 - lo:s1 - lo].copy_(block[(slice(s0 - b0, s1 - b0), *rest)])
    return local


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


@torch.no_grad()
def initialize_(module: nn.Module, spec: InitSpec, seed: int, dims: Dims | None = None,
                names: Iterable[str] | None = None) -> None:
    """Fill every parameter of ``module`` (or those in ``names``) by ``spec`` from ``seed``:
    the same values at every layout (one process, EP, FSDP)."""
    wanted = set(names) if names is not None else None
    for name, p in module.named_parameters():
        if wanted is not None and name not in wanted:
            continue
        kind, std = spec(name)
        local, shape, offset = full_view(p, dims)
        if kind == "normal":
            fill_normal_(local, shape, offset, std, seed, name)
        elif kind == "ones":
            local.fill_(1.0)
        elif kind == "zeros":
            local.zero_()
        else:
            raise ValueError(f"initialize_: unknown init {kind!r} for parameter {name!r}")


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
