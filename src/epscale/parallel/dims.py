"""The process layout: pp pipeline stages, each of dp x ep ranks (and, with FSDP,
dp_replicate x dp_shard), and every process group, built once.

Legend: E global experts, e = E/ep local experts, P ranks in an EP group, N nodes, L ranks
of one EP group per node.

Rank layout: ``rank = dp_rank * ep + ep_rank``, so the ranks of one EP group are contiguous
(they share a node whenever ep <= ranks_per_node) and the DP group of an expert shard is
``{d * ep + ep_rank}``. With FSDP, dp = dp_replicate x efsdp and ``dp_rank = replica *
efsdp + efsdp_rank``: the dense mesh is (dp_replicate, dp_shard = efsdp x ep), the expert
mesh (dp_replicate, efsdp, ep), both over the same ranks. Every process group is built
here, once, through DeviceMeshes; the rest of the package only reads them.

Pipeline parallelism (pp > 1) is the outermost dimension: ``rank = pp_rank * S +
stage_rank`` with S = world / pp ranks per stage, and every mesh above is built over one
stage's S ranks (the meshes carry a leading "pp" dimension and are sliced to the stage),
so EP and FSDP stay inside a stage and only the activations between stages cross it.
``pp_group`` joins the ranks with the same ``stage_rank`` (one per stage: the pipeline's
point-to-point traffic), ``stage_group`` the S ranks of this stage (the data-parallel
world: gradients are averaged over it).
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

    ``pp`` > 1: pp pipeline stages of dp x ep ranks each (world = pp x dp x ep); adds
    pp_rank, stage_rank, stage_size, pp_group, stage_group (see the module docstring);
    every mesh and group above is then this stage's.

    ``fsdp=True`` (with ``dp_replicate``, which must divide dp) adds: dp_shard, efsdp,
    replica_rank, efsdp_rank, dense_mesh (dp_replicate, dp_shard), expert_mesh
    (dp_replicate, efsdp, ep), expert_dp_mesh (its (dp_replicate, efsdp) part: where FSDP
    shards an expert slice) and checkpoint_expert_mesh (dp_replicate, ep, efsdp): the same
    ranks with ep outer, so that nested Shard(0) placements give the global expert rows.
    """

    def __init__(self, dp: int = 1, ep: int = 1, ranks_per_node: int | None = None,
                 dp_replicate: int = 1, fsdp: bool = False, pp: int = 1):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ParallelDims needs torch.distributed: call "
                               "torch.distributed.init_process_group(...) first")
        for key, v in (("dp", dp), ("ep", ep), ("pp", pp)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"parallel key '{key}' = {v!r} is invalid: must be a positive integer")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if pp * dp * ep != self.world_size:
            what = f"pp={pp} x dp={dp} x ep={ep}" if pp > 1 else f"dp={dp} x ep={ep}"
            raise ConfigError(f"parallel {what} = {pp * dp * ep} must equal the world size "
                              f"{self.world_size} (the number of processes started)")
        self.dp, self.ep, self.pp = dp, ep, pp
        self.stage_size = dp * ep
        self.pp_rank, self.stage_rank = divmod(self.rank, self.stage_size)
        self.dp_rank, self.ep_rank = divmod(self.stage_rank, ep)
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
        self.mesh = self._stage_mesh((dp, ep), ("dp", "ep"))
        self.ep_group = self.mesh.get_group("ep")
        self.dp_group = self.mesh.get_group("dp")
        self.world_group = dist.group.WORLD
        self.pp_group, self.stage_group = None, self.world_group
        if pp > 1:
            self.pp_group = self._pp_mesh.get_group("pp")
            for stage in range(pp):  # every rank creates every stage's group, in order
                group = dist.new_group(list(range(stage * self.stage_size,
                                                  (stage + 1) * self.stage_size)))
                if stage == self.pp_rank:
                    self.stage_group = group
        self.ep_inter_group = self.ep_intra_group = None
        N, L = self.ep_num_nodes, self.ep_ranks_per_node
        if N > 1:
            # (dp, node of the EP group, local index): inter = vary the node, intra = vary local.
            self._node_mesh = self._stage_mesh((dp, N, L), ("dp", "ep_node", "ep_local"))
            self.ep_inter_group = self._node_mesh.get_group("ep_node")
            if L > 1:
                self.ep_intra_group = self._node_mesh.get_group("ep_local")
        elif ep > 1:
            self.ep_intra_group = self.ep_group
        self.fsdp = bool(fsdp)
        self.dp_replicate = dp_replicate if fsdp else 1
        if self.fsdp:
            self._build_fsdp_meshes(ranks, dp_replicate)
        else:
            self.dp_shard, self.efsdp, self.replica_rank, self.efsdp_rank = 1, 1, 0, 0

    def _stage_mesh(self, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
        """A DeviceMesh of ``shape`` (named ``names``) over this pipeline stage's ranks
        (the whole world when pp is 1)."""
        ranks = torch.arange(self.world_size)
        if self.pp == 1:
            return DeviceMesh(self.device_type, ranks.view(*shape), mesh_dim_names=names)
        full = DeviceMesh(self.device_type, ranks.view(self.pp, *shape),
                          mesh_dim_names=("pp", *names))
        if not hasattr(self, "_pp_mesh"):
            self._pp_mesh = full
        return full[names]

    def background_group(self):
        """A gloo group over the whole world for the collectives of background checkpoint
        saves (DCP ``async_save`` runs them in a thread beside training's; a group of their
        own keeps the two apart). Created on first use: every rank calls this at the same
        save."""
        if getattr(self, "_background_group", None) is None:
            self._background_group = dist.new_group(backend="gloo")
        return self._background_group

    def _build_fsdp_meshes(self, ranks: torch.Tensor, rep: int) -> None:
        if not isinstance(rep, int) or rep < 1 or self.dp % rep:
            raise ConfigError(f"parallel key 'dp_replicate' = {rep!r} is invalid: it must divide "
                              f"dp = world / ep = {self.dp}")
        ep, efsdp = self.ep, self.dp // rep
        self.dp_shard, self.efsdp = efsdp * ep, efsdp
        self.replica_rank, self.efsdp_rank = divmod(self.dp_rank, efsdp)
        dev = self.device_type
        self.dense_mesh = self._stage_mesh((rep, efsdp * ep), ("dp_replicate", "dp_shard"))
        self.expert_mesh = self._stage_mesh((rep, efsdp, ep), ("dp_replicate", "efsdp", "ep"))
        self.expert_dp_mesh = self.expert_mesh["dp_replicate", "efsdp"]
        # the same ranks with ep outer: (pp,) dp_replicate, ep, efsdp
        order = ranks.view(self.pp, rep, efsdp, ep).transpose(2, 3).contiguous()
        names = ("dp_replicate", "ep", "efsdp")
        self.checkpoint_expert_mesh = (
            DeviceMesh(dev, order[0], mesh_dim_names=names) if self.pp == 1 else
            DeviceMesh(dev, order, mesh_dim_names=("pp", *names))[names])

    def __repr__(self) -> str:
        fsdp = (f", fsdp: dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard}, "
                f"efsdp={self.efsdp}" if self.fsdp else "")
        pp = f"pp={self.pp} (stage {self.pp_rank}), " if self.pp > 1 else ""
        return (f"ParallelDims(rank={self.rank}, {pp}dp={self.dp}, ep={self.ep}, "
                f"ranks_per_node={self.ranks_per_node}, ep_nodes={self.ep_num_nodes}{fsdp})")
