"""FSDP2 (``fully_shard``) over the parallelized model: dense weights sharded over
dp_shard and replicated over dp_replicate (HSDP); each rank's routed-expert slice sharded
over efsdp = dp_shard / ep. Gradients are reduce-scattered by FSDP in backward; parameters
are all-gathered before each group's forward and freed after.

Legend: E experts, e = E/ep local experts, D model dim, F expert hidden dim, W world size.

Groups (bottom-up, as fully_shard wants): every transformer block (its attention, norms,
router, shared and routed experts, dense FFN; the multi-token-prediction modules' blocks
too), then the root (embedding, final norm, head, the MTP modules' norms and projections;
under a pipeline each stage is a root, the last one also holding its copy of the
embedding). Dense weights are sharded on the dense mesh; routed-expert weights, in the same
unit, on the expert mesh (dp_replicate, efsdp): FSDP2 keeps one parameter group per mesh.

Gradient scale. The objective is the mean of every rank's loss. FSDP averages a group's
gradients over its mesh: the world for dense weights (right), but only W / ep ranks for
an expert slice, whose local gradient already sums the losses of the ep ranks that sent it
tokens; :func:`finish_gradients` divides those by ep once after the step's backward.
(FSDP's own divide factor would do it in the reduction, but gloo has no PREMUL_SUM.)

Communication behind compute (``parallel.overlap``): the explicit block-to-block prefetch
(:func:`_prefetch`, ``apply_fsdp(prefetch=...)``, on unless overlap is 'none'); under
gradient accumulation, HSDP's replica all-reduce once per step, in the last micro-batch's
backward (``epscale.parallel.grads.set_last_micro_batch``, which the accumulation step
calls; the reduce-scatters still run every micro-batch and FSDP keeps their sum). Under a
pipeline, torch.distributed.pipelining's stage already defers every reduction of an
FSDP-wrapped stage (reduce-scatter and all-reduce) to its last backward of the step.

ZeRO levels (``parallel.zero``). 3, the default: the above, each block's weights gathered
before its forward, freed after it and gathered again for its backward, for every
micro-batch; gradients reduce-scattered after every micro-batch's backward. 2 and 1 keep the
weights gathered once they are (``reshard_after_forward=False``, as torchtitan does under a
pipeline): gathered in the step's first forward and freed after its last backward, so a
step gathers each block once instead of twice per micro-batch, for the memory of a whole
gathered model (a stage's, under a pipeline) in the compute dtype. 2 reduce-scatters the
gradients after every micro-batch (sharded gradients accumulate); 1 accumulates them
unsharded (fp32: FSDP upcasts to the reduction dtype) and reduce-scatters once, after the
last micro-batch: 1/m of the gradient traffic. The fp32 master weights and AdamW state
stay sharded at every level. That is DeepSeek-V3's PP16 x EP64 x ZeRO-1: its data-parallel
ranks hold gathered weights and unsharded gradients, and shard the optimizer.

Why FSDP2 and not torch's ``ZeroRedundancyOptimizer``: ZeroRedundancyOptimizer shards only
the optimizer over a plain replicated model, so every rank would keep the full fp32 master
weights and the gradients would be all-reduced, not reduce-scattered; it knows nothing of
expert parameters already split over ep (their data-parallel group is efsdp, the dense
weights' dp_shard); and its checkpoint is consolidated on one rank, not DTensor shards that
DCP reshards to any layout. FSDP2 gives levels 1 and 2 from the same sharded parameters
(per-parameter meshes, mixed precision, DCP checkpoints that load at every layout) with
two of its own switches: ``reshard_after_forward`` when sharding, and per micro-batch
``set_requires_gradient_sync`` / ``set_reshard_after_backward`` (:func:`micro_batch_sync`).
Under a pipeline torch's ``PipelineStage`` sets those itself on every stage (no gradient
reduction and no resharding until its last backward, then ``post_backward`` by hand): a
stage's gradients are accumulated unsharded at every level there, which is why level 2
is refused under a pipeline, and why level 3 under a pipeline holds a stage's unsharded
gradients and, after each backward, its gathered weights too (the memory model counts
both).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
# FSDP2's per-parameter mesh (documented in fully_shard's shard_placement_fn; torch >= 2.13)
from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import DTensor, Shard

from ..config import ConfigError
from ..moe.layer import moe_layers
from ..plan.layout import Dims
from .activation import transformer_blocks
from .shard import mark_expert_params

# The hidden dim of each expert weight: w1/w3 [e, D, F], w2 [e, F, D].
HIDDEN_DIM = {"w1": 2, "w3": 2, "w2": 1}


def expert_shard_dims(num_local_experts: int, hidden_dim: int, efsdp: int) -> str:
    """'experts' when efsdp divides the local experts (shard whole experts, dim 0), else
    'hidden' (shard each expert's hidden dim F, which efsdp must divide)."""
    if num_local_experts % efsdp == 0:
        return "experts"
    if hidden_dim % efsdp == 0:
        return "hidden"
    raise ConfigError(f"FSDP over efsdp = dp_shard / ep = {efsdp} ranks cannot shard the "
                      f"{num_local_experts} experts per EP rank (moe.num_experts / parallel.ep) "
                      f"nor their hidden dim moe.hidden_dim = {hidden_dim}: choose a "
                      "parallel.ep or parallel.dp_shard whose efsdp divides one of them")


def expert_placements(model: nn.Module, dims: Dims
                      ) -> tuple[dict[int, Shard | ShardPlacementResult], list[str]]:
    """Where FSDP shards each routed-expert weight: ``id(param) -> ShardPlacementResult``
    on the expert mesh (dp_replicate, efsdp), whole experts (dim 0) or each expert's hidden
    dim (see :func:`expert_shard_dims`). Returns (the table, lines for the header)."""
    mesh_info = HSDPMeshInfo(dims.expert_dp_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    dense = HSDPMeshInfo(dims.dense_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    # FSDP on one rank: both meshes are that rank's group, and FSDP refuses two mesh
    # infos over one group; the unit's own (dense) mesh shards the experts the same way
    same_groups = (mesh_info.shard_process_group is dense.shard_process_group
                   and mesh_info.replicate_process_group is dense.replicate_process_group)
    table, notes = {}, []
    for moe in moe_layers(model):
        experts = moe.experts
        how = expert_shard_dims(experts.num_experts, experts.hidden_dim, dims.efsdp)
        if how == "hidden" and not notes:
            notes.append(f"experts: {experts.num_experts} per EP rank over efsdp = "
                         f"{dims.efsdp} ranks: each expert's hidden dim is sharded")
        for name in HIDDEN_DIM:
            param = getattr(experts, name, None)
            if param is not None:
                dim = 0 if how == "experts" else HIDDEN_DIM[name]
                table[id(param)] = (Shard(dim) if same_groups
                                    else ShardPlacementResult(Shard(dim), mesh_info))
    return table, notes


def apply_fsdp(model: nn.Module, dims: Dims, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = torch.float32,
               prefetch: bool = True, roots: list[nn.Module] | None = None,
               reshard_after_forward: bool = True) -> list[str]:
    """fully_shard ``model`` in place (after ``epscale.parallelize``, before the optimizer
    is built). ``param_dtype``: the compute dtype FSDP casts parameters to (bf16 mixed
    precision; None keeps fp32); gradients are reduced in ``reduce_dtype``; master weights
    and optimizer state stay fp32. ``prefetch``: the explicit block-to-block prefetch.
    ``roots``: the modules that run (and are sharded last) instead of ``model``: a
    pipeline rank's stages (``epscale.parallel.pipeline.StageChunk``), each holding some
    of the blocks (the last one also the multi-token-prediction modules' blocks, and the
    copy of the embedding, sharded like the first stage's); blocks prefetch within their
    stage, in the order it runs them. ``reshard_after_forward``: False
    keeps gathered weights until the step's last backward (ZeRO-1/2, see the module
    docstring). Returns lines for the start-up header.

    A block's routed experts belong to the block's own FSDP unit, each expert weight on
    the expert mesh (a per-parameter mesh, FSDP2's ``ShardPlacementResult``): one
    all-gather per block before its forward and its recomputation, none inside the block.
    (A separate unit for the experts ran FSDP's hooks inside the recomputed region, and
    when efsdp = 1, where the forward gathers nothing, selective recomputation saw
    operations the forward had not run and failed in the first backward.)"""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    placements, notes = expert_placements(model, dims)

    def place(param: nn.Parameter) -> Shard | ShardPlacementResult | None:
        return placements.get(id(param))  # None: Shard(0) on the dense mesh

    kw = dict(mesh=dims.dense_mesh, mp_policy=mp, shard_placement_fn=place,
              reshard_after_forward=reshard_after_forward)
    for block in transformer_blocks(model):
        fully_shard(block, **kw)
    for root in roots or [model]:
        fully_shard(root, **kw)
        if prefetch:
            _prefetch(root.run_order() if roots else transformer_blocks(model))
    for moe in moe_layers(model):  # FSDP registered new parameter objects
        mark_expert_params(moe.experts)
    return notes


def _prefetch(blocks: list[nn.Module]) -> None:
    """Explicit prefetch: when block i starts its forward, block i+1's all-gather is
    issued; when it starts its backward, block i-1's. FSDP's implicit prefetch issues the
    next all-gather only once the CPU reaches the next module, and an MoE layer's host sync
    (the split sizes of its dispatch) holds the CPU back until the device has caught up,
    so that all-gather would not overlap anything. The gathers run in the blocks' FSDP
    hooks, outside any recomputed region, so prefetch works under every recomputation
    mode."""
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])


def micro_batch_sync(model: nn.Module, zero: int, last: bool) -> None:
    """Before a micro-batch's backward without a pipeline (``last``: the step's last):
    ZeRO-1 accumulates unsharded gradients until the last micro-batch and reduce-scatters
    them then; ZeRO-1 and 2 keep the weights gathered until the last backward. Level 3
    (and a model FSDP did not wrap) keeps FSDP's defaults."""
    if zero == 3 or not isinstance(model, FSDPModule):
        return
    model.set_reshard_after_backward(last)
    if zero == 1:
        model.set_requires_gradient_sync(last)


def reshard(modules: list[nn.Module]) -> None:
    """Free the gathered weights of every FSDP module in ``modules`` (and below): after a
    forward-only pass (validation) at ZeRO-1/2, which keeps them gathered."""
    for root in modules:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def finish_gradients(model: nn.Module, dims: Dims) -> None:
    """After the step's backward (all micro-batches): the expert slices' gradients divided
    by ep (see the module docstring); the dense ones are final already."""
    if dims.ep == 1:
        return
    grads = [_local(p.grad) for moe in moe_layers(model) for p in moe.experts.parameters()
             if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, 1.0 / dims.ep)
