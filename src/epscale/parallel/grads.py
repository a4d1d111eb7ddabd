"""The gradient rule of dp x ep: after backward, every rank's grads become the gradient of
the MEAN of all ranks' losses, in as few collectives as the buckets allow.

Two ways to get there on the replicated (non-FSDP) layout:

* :func:`sync_gradients` after the whole backward: bucketed all-reduces, issued together
  and waited for at once (the plain path, ``parallel.overlap: none``);
* :func:`reduce_in_backward` (``parallel.overlap: auto``): torch's DDP machinery
  (``torch.distributed._composable.replicate``) buckets the gradients in backward order
  and all-reduces each bucket as soon as its last gradient exists, while the rest of the
  backward computes; a communication hook applies the same rule per bucket. With
  gradient accumulation, only the last micro-batch reduces
  (:func:`set_last_micro_batch`). :func:`sync_gradients` then only finishes what the
  hook cannot (copies of redundant experts).

Legend: W world size (the stage's ranks under a pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed._composable.replicate import replicate
from torch.distributed.fsdp import FSDPModule

from ..placement.replicas import sync_replica_gradients
from ..plan.layout import Dims
from .shard import expert_param_ids, is_expert_param

BUCKET_BYTES = 32 * 1024 * 1024
_REDUCED_IN_BACKWARD = "_epscale_reduced_in_backward"  # set on a module by reduce_in_backward
DDP_HOOK_STATE = "_epscale_ddp_hook_state"  # its communication hook's state (the clock)


def sync_gradients(module: nn.Module, dims: Dims, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Make every rank's grads the gradient of the MEAN of all ranks' losses. Call once
    after backward.

    Non-expert grads (router, shared experts, everything outside MoE): averaged over the
    world (over this pipeline stage's ranks, the data-parallel world, when pp > 1). Expert
    grads: this rank's backward already holds the sum over its EP group's losses for its
    shard, so they are summed over the DP group and divided by that world's size.
    Grads are flattened into buckets of ``bucket_bytes`` per dtype and all-reduced
    asynchronously (one collective per bucket). A missing grad counts as zero (it is
    materialised so every rank sends the same buckets).
    """
    sync_replica_gradients(module, dims)  # copies of one expert get the sum of their grads
    W = getattr(dims, "stage_size", dims.world_size)
    if W == 1 or getattr(module, _REDUCED_IN_BACKWARD, False):
        return  # (reduce_in_backward's hook applied the rule during backward)
    expert_ids = expert_param_ids(module)
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    world = [p for p in params if id(p) not in expert_ids and not is_expert_param(p)]
    expert = [p for p in params if id(p) in expert_ids or is_expert_param(p)]
    pending = []
    for group, plist in ((dims.stage_group, world), (dims.dp_group, expert)):
        if not plist:
            continue
        for bucket in _buckets(plist, bucket_bytes):
            flat = _flatten_dense_tensors([p.grad for p in bucket])
            flat.div_(W)
            work = (dist.all_reduce(flat, group=group, async_op=True)
                    if dist.get_world_size(group) > 1 else None)
            pending.append((work, flat, bucket))
    for work, flat, bucket in pending:
        if work is not None:
            work.wait()
        for p, g in zip(bucket, _unflatten_dense_tensors(flat, [p.grad for p in bucket])):
            p.grad.copy_(g)


def _buckets(params: list[torch.Tensor], bucket_bytes: int):
    by_key: dict = {}
    for p in params:
        by_key.setdefault((p.grad.dtype, p.grad.device), []).append(p)
    for plist in by_key.values():
        bucket, size = [], 0
        for p in plist:
            nbytes = p.grad.numel() * p.grad.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(p)
            size += nbytes
        if bucket:
            yield bucket


# --------------------------------------------------------------------------------------
# Reduction during backward (DDP's buckets) and the micro-batch switch
# --------------------------------------------------------------------------------------


@dataclass
class _HookState:
    world_group: dist.ProcessGroup | None   # dense grads: averaged over the world
    dp_group: dist.ProcessGroup | None      # expert grads: summed over it, divided by W
    world_size: int
    # the trainer's CommClock (epscale.metrics.commclock.attach_comm_clock sets it): each
    # bucket's all-reduce is timed as 'dp' in flight (DDP's reducer waits for it inside
    # torch, so that wait is not timed as exposed)
    clock: Any = None


def reduce_in_backward(module: nn.Module, dims: Dims, overlap: bool = True,
                       bucket_bytes: int = BUCKET_BYTES) -> bool:
    """Reduce ``module``'s gradients during backward with torch's DDP machinery
    (composable ``replicate`` over the world, one communication hook), on the replicated
    layout: no FSDP, pp = 1, more than one rank. Call once after ``epscale.parallelize``
    (every rank holds its weights: nothing is broadcast), before the optimizer is built.
    Returns whether it applied (False when ``overlap`` is off or the layout is not that
    one; :func:`sync_gradients` then does all the work after backward).

    The hook keeps :func:`sync_gradients`' rule exactly: each bucket is divided by W and
    summed over the world for dense grads and over the DP group for expert grads (a
    bucket holding both sends two all-reduces). Every parameter is expected to get a
    gradient in every backward (an MoE layer's experts do, with zero rows too).
    """
    W = getattr(dims, "stage_size", dims.world_size)
    if not overlap or W == 1 or getattr(dims, "fsdp", False) or getattr(dims, "pp", 1) > 1:
        return False
    world = getattr(dims, "stage_group", None) or dist.group.WORLD
    replicate(module, process_group=world, bucket_cap_mb=bucket_bytes / 2 ** 20,
              init_sync=False, gradient_as_bucket_view=True)
    state = _HookState(world, dims.dp_group, W)
    module.register_comm_hook(state, _reduce_bucket)
    setattr(module, _REDUCED_IN_BACKWARD, True)
    setattr(module, DDP_HOOK_STATE, state)
    return True


def _all_reduce_future(flat: torch.Tensor, group, clock=None) -> torch.futures.Future:
    if group is None or dist.get_world_size(group) == 1:
        fut = torch.futures.Future()
        fut.set_result([flat])
        return fut
    work = dist.all_reduce(flat, group=group, async_op=True)
    if clock is not None:
        clock.track("dp", work, (flat,))  # its flight; DDP waits on the future below
    return work.get_future()


def _reduce_bucket(state: _HookState, bucket):
    """DDP communication hook: the bucket's flat gradients divided by W, the dense
    parameters' slices summed over the world, the expert parameters' over the DP group.
    Returns a future of the reduced flat buffer (DDP copies it into the grads). (No
    return annotation: DDP checks it against the real type, and this module's
    annotations are strings.)"""
    buf = bucket.buffer()
    buf.div_(state.world_size)
    spans = {True: [], False: []}   # is_expert -> [(start, end)] in the flat buffer
    start = 0
    for p in bucket.parameters():
        spans[is_expert_param(p)].append((start, start + p.numel()))
        start += p.numel()
    if not spans[True] or not spans[False]:
        group = state.dp_group if spans[True] else state.world_group
        return _all_reduce_future(buf, group, state.clock).then(lambda fut: buf)
    parts = {kind: torch.cat([buf[a:b] for a, b in spans[kind]]) for kind in (False, True)}
    futs = [_all_reduce_future(parts[False], state.world_group, state.clock),
            _all_reduce_future(parts[True], state.dp_group, state.clock)]

    def copy_back(_fut) -> torch.Tensor:
        for kind in (False, True):
            offset = 0
            for a, b in spans[kind]:
                buf[a:b].copy_(parts[kind][offset:offset + b - a])
                offset += b - a
        return buf
    return torch.futures.collect_all(futs).then(copy_back)


def set_last_micro_batch(module: nn.Module, is_last: bool) -> None:
    """Before each micro-batch's forward under gradient accumulation: whether its
    backward is the step's last. Reductions that only need the step's sum then run once,
    in the last backward: FSDP's (HSDP's) replica all-reduce (reduce-scatters still run
    every micro-batch, their sums kept sharded), and :func:`reduce_in_backward`'s
    all-reduces (DDP's ``no_sync``). Pass True for every micro-batch to reduce after each
    one (the plain path). A module with neither is left alone. (Without replicas, FSDP
    is not told to skip its all-reduce: it would then hold each reduce-scatter's output
    aside instead of adding it to the sharded gradients, for nothing to all-reduce.)"""
    if isinstance(module, FSDPModule):
        module.set_is_last_backward(is_last)
        if _has_replicas(module):
            module.set_requires_all_reduce(is_last)
    if getattr(module, _REDUCED_IN_BACKWARD, False):
        module.set_requires_gradient_sync(is_last)


def _has_replicas(module: nn.Module) -> bool:
    """Whether an FSDP-wrapped module is replicated (HSDP: some parameter's mesh has a
    replica dimension of size > 1); remembered on the module."""
    known = getattr(module, "_epscale_has_replicas", None)
    if known is None:
        known = any(isinstance(p, DTensor) and p.device_mesh.ndim > 1
                    and p.device_mesh.size(0) > 1 for p in module.parameters())
        setattr(module, "_epscale_has_replicas", known)
    return known
