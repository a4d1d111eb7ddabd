"""The process groups of a :class:`~epscale.plan.layout.Layout`: pp pipeline stages, each
of dp x ep ranks (and, with FSDP, dp_replicate x dp_shard), every group built once, on
first use. The degrees, the rank coordinates and every rule about them are the Layout's;
this module only builds meshes and groups.

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
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..plan.layout import Layout


# Built together on first use (every rank reaches that use: a collective does).
_GROUP_ATTRS = frozenset({
    "mesh", "ep_group", "dp_group", "pp_group", "stage_group", "ep_inter_group",
    "ep_intra_group", "dense_mesh", "expert_mesh", "expert_dp_mesh", "checkpoint_expert_mesh"})


class ParallelDims:
    """The process groups of a :class:`Layout`. Construct after
    ``torch.distributed.init_process_group``: ``ParallelDims(layout)``, or from degrees
    ``ParallelDims(dp=.., ep=.., ranks_per_node=.., dp_replicate=.., fsdp=.., pp=..)``
    (:meth:`Layout.from_degrees` over this world).

    ranks_per_node: processes per node (the layout's, else ``LOCAL_WORLD_SIZE``, else the
    world); set it smaller to emulate several nodes on one machine (the hierarchical
    backend and node-limited routing read it).

    Attributes (the degrees and this rank's coordinates, from the layout): rank,
    world_size, dp, ep, pp, stage_size, dp_rank, ep_rank, pp_rank, stage_rank,
    ranks_per_node, num_nodes, node_rank, ep_num_nodes / ep_ranks_per_node (how one EP
    group spreads over nodes), fsdp, dp_replicate, dp_shard, efsdp, replica_rank,
    efsdp_rank. Groups and meshes (built on first use): mesh (DeviceMesh (dp, ep) named
    ("dp", "ep")), ep_group, dp_group, world_group, the hierarchical backend's
    ep_inter_group (same local index, one rank per node of the EP group) and
    ep_intra_group (the EP group's ranks on this node), either None when it would hold a
    single rank; ``pp`` > 1: pp_group, stage_group (see the module docstring), every mesh
    and group above then this stage's; ``fsdp``: dense_mesh (dp_replicate, dp_shard),
    expert_mesh (dp_replicate, efsdp, ep), expert_dp_mesh (its (dp_replicate, efsdp) part:
    where FSDP shards an expert slice) and checkpoint_expert_mesh (dp_replicate, ep,
    efsdp): the same ranks with ep outer, so that nested Shard(0) placements give the
    global expert rows.
    """

    def __init__(self, layout: Layout | None = None, *, dp: int = 1, ep: int = 1,
                 ranks_per_node: int | None = None, dp_replicate: int = 1, fsdp: bool = False,
                 pp: int = 1):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ParallelDims needs torch.distributed: call "
                               "torch.distributed.init_process_group(...) first")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if layout is None:
            layout = Layout.from_degrees(self.world_size, dp=dp, ep=ep, pp=pp, fsdp=fsdp,
                                         dp_replicate=dp_replicate, ranks_per_node=ranks_per_node)
        if layout.world != self.world_size:
            raise RuntimeError(f"ParallelDims: the layout is for {layout.world} processes, the "
                               f"process group has {self.world_size}")
        if layout.ranks_per_node is None:
            layout = replace(layout, ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE",
                                                                       self.world_size)))
        self.layout = layout
        for name in ("dp", "ep", "pp", "fsdp", "dp_replicate", "dp_shard", "efsdp",
                     "ranks_per_node", "num_nodes", "ep_ranks_per_node", "ep_num_nodes"):
            setattr(self, name, getattr(layout, name))
        self.stage_size = layout.stage_size
        for name, value in layout.coords(self.rank).items():
            setattr(self, name, value)
        backend = str(dist.get_backend())
        self.device_type = "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"
        self.world_group = dist.group.WORLD
        self._built = False

    def __getattr__(self, name: str):
        # only reached when ``name`` is not set: a group or mesh before the first use
        if name in _GROUP_ATTRS and not self.__dict__.get("_built", True):
            self._build_groups()
            return getattr(self, name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def _build_groups(self) -> None:
        """Every group and mesh of the layout, in one fixed order on every rank."""
        self._built = True
        dp, ep, pp = self.dp, self.ep, self.pp
        self.mesh = self._stage_mesh((dp, ep), ("dp", "ep"))
        self.ep_group = self.mesh.get_group("ep")
        self.dp_group = self.mesh.get_group("dp")
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
        if self.fsdp:
            self._build_fsdp_meshes()

    def _stage_mesh(self, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
        """A DeviceMesh of ``shape`` (named ``names``) over this pipeline stage's ranks
        (the whole world when pp is 1)."""
        ranks = torch.arange(self.world_size)
        if self.pp == 1:
            return DeviceMesh(self.device_type, ranks.view(*shape), mesh_dim_names=names)
        full = DeviceMesh(self.device_type, ranks.view(self.pp, *shape),
                          mesh_dim_names=("pp", *names))
        if "_pp_mesh" not in self.__dict__:
            self._pp_mesh = full
        return full[names]

    def background_group(self):
        """A gloo group over the whole world for the collectives of background checkpoint
        saves (DCP ``async_save`` runs them in a thread beside training's; a group of their
        own keeps the two apart). Created on first use: every rank calls this at the same
        save."""
        if self.__dict__.get("_background_group") is None:
            self._background_group = dist.new_group(backend="gloo")
        return self._background_group

    def _build_fsdp_meshes(self) -> None:
        rep, efsdp, ep = self.dp_replicate, self.efsdp, self.ep
        dev = self.device_type
        self.dense_mesh = self._stage_mesh((rep, efsdp * ep), ("dp_replicate", "dp_shard"))
        self.expert_mesh = self._stage_mesh((rep, efsdp, ep), ("dp_replicate", "efsdp", "ep"))
        self.expert_dp_mesh = self.expert_mesh["dp_replicate", "efsdp"]
        # the same ranks with ep outer: (pp,) dp_replicate, ep, efsdp
        ranks = torch.arange(self.world_size)
        order = ranks.view(self.pp, rep, efsdp, ep).transpose(2, 3).contiguous()
        names = ("dp_replicate", "ep", "efsdp")
        self.checkpoint_expert_mesh = (
            DeviceMesh(dev, order[0], mesh_dim_names=names) if self.pp == 1 else
            DeviceMesh(dev, order, mesh_dim_names=("pp", *names))[names])

    def __repr__(self) -> str:
        stage = f" (stage {self.pp_rank})" if self.pp > 1 else ""
        return (f"ParallelDims(rank={self.rank}, {self.layout.label()}{stage}, "
                f"ranks_per_node={self.ranks_per_node}, ep_nodes={self.ep_num_nodes})")


class SingleProcessDims:
    """The ParallelDims attributes for one process (no process group needed)."""

    rank, world_size, dp, ep, ep_rank, dp_rank = 0, 1, 1, 1, 0, 0
    ranks_per_node, num_nodes, node_rank, ep_ranks_per_node, ep_num_nodes = 1, 1, 0, 1, 1
    ep_group = dp_group = mesh = ep_inter_group = ep_intra_group = None
    fsdp, dp_replicate, dp_shard, efsdp = False, 1, 1, 1
    pp, pp_rank, stage_rank, stage_size = 1, 0, 0, 1
    pp_group = stage_group = world_group = None
    layout = Layout(world=1)

    @staticmethod
    def background_group():
        return None  # one process: background saves need no collectives
