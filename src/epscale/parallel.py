"""Process layout (dp x ep), parallelizing MoE layers in place, and the gradient rules.

Legend: E global experts, e = E/ep local experts, P ranks in an EP group, N nodes, L ranks
of one EP group per node.

Rank layout: ``rank = dp_rank * ep + ep_rank``, so the ranks of one EP group are contiguous
(they share a node whenever ep <= ranks_per_node) and the DP group of an expert shard is
``{d * ep + ep_rank}``. Every process group is built here, once, through DeviceMeshes; the
rest of the package only reads them.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh

from .config import ConfigError
from .dispatch.comm import CommCounter, GroupInfo

DISPATCHERS = ("local", "allgather", "alltoall", "dedup", "hierarchical", "deepep")
_EXPERT_ATTR = "_epscale_expert"
BUCKET_BYTES = 32 * 1024 * 1024


class ParallelDims:
    """The dp x ep process layout. Construct after ``torch.distributed.init_process_group``.

    dp: data-parallel replicas of each expert shard. ep: expert-parallel group size.
    ranks_per_node: processes per node (default ``LOCAL_WORLD_SIZE``, else the world);
    set it smaller to emulate several nodes on one machine (the hierarchical backend and
    node-limited routing read it).

    Attributes: rank, world_size, dp, ep, dp_rank, ep_rank, ep_group, dp_group, mesh
    (DeviceMesh (dp, ep) named ("dp", "ep")), ranks_per_node, num_nodes, node_rank,
    ep_num_nodes / ep_ranks_per_node (how one EP group spreads over nodes) and the two
    groups the hierarchical backend uses: ep_inter_group (same local index, one rank per
    node of the EP group) and ep_intra_group (the EP group's ranks on this node); either is
    None when it would hold a single rank.
    """

    def __init__(self, dp: int = 1, ep: int = 1, ranks_per_node: int | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ParallelDims needs torch.distributed: call "
                               "torch.distributed.init_process_group(...) first")
        for key, v in (("dp", dp), ("ep", ep)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"parallel key '{key}' = {v!r} is invalid: must be a positive integer")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if dp * ep != self.world_size:
            raise ConfigError(f"parallel dp={dp} x ep={ep} = {dp * ep} must equal the world size "
                              f"{self.world_size} (the number of processes started)")
        self.dp, self.ep = dp, ep
        self.dp_rank, self.ep_rank = divmod(self.rank, ep)
        if ranks_per_node is None:
            ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        if (not isinstance(ranks_per_node, int) or ranks_per_node < 1
                or self.world_size % ranks_per_node):
            raise ConfigError(f"parallel key 'ranks_per_node' = {ranks_per_node!r} is invalid: "
                              f"must be a positive divisor of the world size {self.world_size}")
        if ep % ranks_per_node and ranks_per_node % ep:
            raise ConfigError(f"parallel key 'ranks_per_node' = {ranks_per_node} is invalid with "
                              f"ep={ep}: an EP group must fill whole nodes (ep a multiple of "
                              f"ranks_per_node) or fit inside one (ranks_per_node a multiple of ep)")
        self.ranks_per_node = ranks_per_node
        self.num_nodes = self.world_size // ranks_per_node
        self.node_rank = self.rank // ranks_per_node
        self.ep_ranks_per_node = min(ep, ranks_per_node)
        self.ep_num_nodes = ep // self.ep_ranks_per_node

        backend = str(dist.get_backend())
        device_type = "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"
        self.device_type = device_type
        ranks = torch.arange(self.world_size)
        self.mesh = DeviceMesh(device_type, ranks.view(dp, ep), mesh_dim_names=("dp", "ep"))
        self.ep_group = self.mesh.get_group("ep")
        self.dp_group = self.mesh.get_group("dp")
        self.world_group = dist.group.WORLD
        self.ep_inter_group = self.ep_intra_group = None
        N, L = self.ep_num_nodes, self.ep_ranks_per_node
        if N > 1:
            # (dp, node of the EP group, local index): inter = vary the node, intra = vary local.
            self._node_mesh = DeviceMesh(device_type, ranks.view(dp, N, L),
                                         mesh_dim_names=("dp", "ep_node", "ep_local"))
            self.ep_inter_group = self._node_mesh.get_group("ep_node")
            if L > 1:
                self.ep_intra_group = self._node_mesh.get_group("ep_local")
        elif ep > 1:
            self.ep_intra_group = self.ep_group

    # ------------------------------------------------------------------ group views
    def group_info(self, which: str, counter: CommCounter | None = None) -> GroupInfo:
        """GroupInfo of 'ep', 'dp', 'ep_inter' or 'ep_intra' (a single-rank group when the
        real one would be trivial) sharing ``counter``."""
        counter = counter if counter is not None else CommCounter()
        group = {"ep": self.ep_group, "dp": self.dp_group, "ep_inter": self.ep_inter_group,
                 "ep_intra": self.ep_intra_group}[which]
        if group is None:
            return GroupInfo(None, [self.rank], self.rank, self.ranks_per_node, counter)
        return GroupInfo.of(group, self.ranks_per_node, counter)

    def __repr__(self) -> str:
        return (f"ParallelDims(rank={self.rank}, dp={self.dp}, ep={self.ep}, "
                f"ranks_per_node={self.ranks_per_node}, ep_nodes={self.ep_num_nodes})")


# --------------------------------------------------------------------------------------
# parallelize
# --------------------------------------------------------------------------------------


def make_dispatcher(name: str, num_experts: int, dims: ParallelDims, payload: str = "auto",
                    overlap_chunks: int = 1):
    """Build the named backend for one MoE layer (its own byte counter)."""
    if name not in DISPATCHERS:
        import difflib
        close = difflib.get_close_matches(str(name), DISPATCHERS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"parallel key 'dispatcher' = {name!r} is invalid: must be one of "
                          f"{', '.join(map(repr, DISPATCHERS))}{hint}")
    if name == "local":
        if dims.ep != 1:
            raise ConfigError(f"parallel key 'dispatcher' = 'local' needs ep=1 (got ep={dims.ep}); "
                              "choose 'alltoall', 'dedup', 'allgather' or 'hierarchical'")
        from .dispatch.local import LocalDispatcher
        return LocalDispatcher(num_experts)
    counter = CommCounter()
    ep_info = dims.group_info("ep", counter)
    if name == "alltoall":
        from .dispatch.alltoall import AllToAllDispatcher
        return AllToAllDispatcher(num_experts, ep_info, payload)
    if name == "allgather":
        from .dispatch.allgather import AllGatherDispatcher
        return AllGatherDispatcher(num_experts, ep_info, payload)
    if name == "dedup":
        from .dispatch.dedup import DedupDispatcher
        return DedupDispatcher(num_experts, ep_info, payload, overlap_chunks)
    if name == "hierarchical":
        from .dispatch.hierarchical import HierarchicalDispatcher
        return HierarchicalDispatcher(num_experts, ep_info, dims.group_info("ep_inter", counter),
                                      dims.group_info("ep_intra", counter), payload, overlap_chunks)
    from .dispatch.deepep import DeepEPDispatcher
    return DeepEPDispatcher(num_experts, dims)


def _moe_layers(module: nn.Module):
    from .moe.layer import MoE
    return [m for m in module.modules() if isinstance(m, MoE)]


def parallelize(module: nn.Module, dims: ParallelDims, dispatcher: str = "dedup",
                overlap_chunks: int = 1, payload: str = "auto", placement=None) -> nn.Module:
    """Shard every ``epscale.MoE`` inside ``module`` over the EP group, in place.

    Expert parameters keep their names and their leading expert dim, sliced to this EP
    rank's experts ``[ep_rank*E/ep, (ep_rank+1)*E/ep)``; the router and shared experts stay
    replicated. ``dispatcher`` names the backend (see ``DISPATCHERS``); with ep=1 every
    choice except 'deepep' runs the local (communication-free) one. ``overlap_chunks`` > 1
    lets 'dedup'/'hierarchical' pipeline chunks through ``dispatch_compute_combine``.
    ``payload``: 'auto' sends tokens in their dtype, 'bf16' casts them, 'fp8' sends e4m3
    with per-128-channel scales (dedup/hierarchical). ``placement``: an
    ``epscale.placement.plan_placement`` result; each rank then holds its P/ep physical slots
    (redundant copies of hot experts) instead of a contiguous E/ep slice. Returns ``module``.
    """
    if dispatcher not in DISPATCHERS:
        make_dispatcher(dispatcher, 1, dims)  # raises the listing error
    if not isinstance(overlap_chunks, int) or overlap_chunks < 1:
        raise ConfigError(f"parallel key 'overlap_chunks' = {overlap_chunks!r} is invalid: "
                          "must be a positive integer")
    from .dispatch.ep import PAYLOADS
    if payload not in PAYLOADS:
        raise ConfigError(f"parallel key 'payload' = {payload!r} is invalid: must be one of "
                          f"{', '.join(map(repr, PAYLOADS))}")
    if payload == "fp8" and dispatcher not in ("dedup", "hierarchical"):
        raise ConfigError(f"parallel key 'payload' = 'fp8' needs dispatcher 'dedup' or "
                          f"'hierarchical' (got {dispatcher!r})")
    if dispatcher == "deepep":
        from .dispatch.deepep import require_deepep
        require_deepep()
    if placement is not None:
        from .placement.runtime import apply_placement
        return apply_placement(module, dims, placement, dispatcher, overlap_chunks, payload)
    for moe in _moe_layers(module):
        cfg = moe.cfg
        E, ep = cfg.num_experts, dims.ep
        if getattr(moe.experts, _EXPERT_ATTR + "_shard", None) is not None:
            raise ValueError("parallelize: this MoE layer is already parallelized")
        if E % ep:
            raise ConfigError(f"moe.num_experts = {E} is not divisible by parallel.ep = {ep}: "
                              f"each EP rank must hold the same number of experts")
        if cfg.num_groups > 0 and dims.ep_num_nodes > 1 and cfg.topk_groups > dims.ep_num_nodes:
            raise ConfigError(
                f"moe.topk_groups = {cfg.topk_groups} is more than the {dims.ep_num_nodes} nodes "
                f"an EP group spans (ep={ep}, ranks_per_node={dims.ranks_per_node}); "
                "node-limited routing must keep topk_groups <= the number of nodes")
        e = E // ep
        lo = dims.ep_rank * e
        experts = moe.experts
        for pname in ("w1", "w2", "w3"):
            p = getattr(experts, pname, None)
            if p is None:
                continue
            shard = nn.Parameter(p.detach()[lo:lo + e].clone(), requires_grad=p.requires_grad)
            setattr(shard, _EXPERT_ATTR, True)
            setattr(experts, pname, shard)
        experts.num_experts = e
        setattr(experts, _EXPERT_ATTR + "_shard", (lo, e))
        if ep == 1 and dispatcher != "deepep":
            from .dispatch.local import LocalDispatcher
            moe.dispatcher = LocalDispatcher(E)
        else:
            moe.dispatcher = make_dispatcher(dispatcher, E, dims, payload, overlap_chunks)
    return module


# --------------------------------------------------------------------------------------
# Gradient rules
# --------------------------------------------------------------------------------------


def is_expert_param(param: torch.Tensor) -> bool:
    """True for the sharded expert weights (w1/w2/w3 of a parallelized MoE layer): their
    leading dim is the local expert shard and their grads sync over the DP group only."""
    return bool(getattr(param, _EXPERT_ATTR, False))


def _expert_param_ids(module: nn.Module) -> set[int]:
    ids = set()
    for moe in _moe_layers(module):
        if getattr(moe.experts, _EXPERT_ATTR + "_shard", None) is not None:
            ids.update(id(p) for p in moe.experts.parameters())
    return ids


def sync_gradients(module: nn.Module, dims: ParallelDims, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Make every rank's grads the gradient of the MEAN of all ranks' losses. Call once
    after backward.

    Non-expert grads (router, shared experts, everything outside MoE): averaged over the
    world. Expert grads: this rank's backward already holds the sum over its EP group's
    losses for its shard, so they are summed over the DP group and divided by the world size.
    Grads are flattened into buckets of ``bucket_bytes`` per dtype and all-reduced
    asynchronously (one collective per bucket). A missing grad counts as zero (it is
    materialised so every rank sends the same buckets).
    """
    from .placement.runtime import sync_replica_gradients

    sync_replica_gradients(module, dims)  # copies of one expert get the sum of their grads
    W = dims.world_size
    if W == 1:
        return
    expert_ids = _expert_param_ids(module)
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    world = [p for p in params if id(p) not in expert_ids and not is_expert_param(p)]
    expert = [p for p in params if id(p) in expert_ids or is_expert_param(p)]
    pending = []
    for group, plist in ((dims.world_group, world), (dims.dp_group, expert)):
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
