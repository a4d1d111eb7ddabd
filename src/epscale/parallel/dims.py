"""The process layout: dp x ep ranks and every process group, built once.

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
from torch.distributed.device_mesh import DeviceMesh

from ..config import ConfigError


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

    def __repr__(self) -> str:
        return (f"ParallelDims(rank={self.rank}, dp={self.dp}, ep={self.ep}, "
                f"ranks_per_node={self.ranks_per_node}, ep_nodes={self.ep_num_nodes})")
