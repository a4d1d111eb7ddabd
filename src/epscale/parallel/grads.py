"""The gradient rule of dp x ep: after backward, every rank's grads become the gradient of
the MEAN of all ranks' losses, in as few collectives as the buckets allow.

Legend: W world size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..placement.replicas import sync_replica_gradients
from ..plan.layout import Dims
from .shard import expert_param_ids, is_expert_param

BUCKET_BYTES = 32 * 1024 * 1024


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
    if W == 1:
        return
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
