"""Parallelizing MoE layers in place: each EP rank keeps its experts' rows of the stacked
expert weights (a contiguous slice, or the slots of a redundant-expert placement) and a
dispatcher that moves tokens to them; and the one test of which parameters are sharded
expert weights.

Legend: E logical experts, e = E/ep local experts, S physical slots (E plus the redundant
ones) over the EP group, s = S/ep slots per rank.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ConfigError
from ..dispatch.deepep import DeepEPBuffer, hidden_bytes_of
from ..dispatch.registry import check_choice, make_dispatcher
from ..moe.layer import moe_layers
from ..placement.eplb import Placement
from ..placement.replicas import PlacedDispatcher, check_placement, set_placement
from ..plan.layout import check_expert_split

_EXPERT_ATTR = "_epscale_expert"      # on each sharded expert weight
_ROWS_ATTR = "_epscale_expert_rows"   # on each: (first row of this rank's slice, rows in all)
_SHARD_ATTR = "_epscale_expert_shard"  # on the experts module: (first slot, slots) held here
EXPERT_PARAMS = ("w1", "w2", "w3")


def is_expert_param(param: torch.Tensor) -> bool:
    """True for the sharded expert weights (w1/w2/w3 of a parallelized MoE layer): their
    leading dim is this rank's share of the experts, and their gradients sync over the DP
    group only (``epscale.parallel.sync_gradients``)."""
    return bool(getattr(param, _EXPERT_ATTR, False))


def expert_global_rows(param: torch.Tensor, dims=None) -> tuple[int, int]:
    """(first row of dim 0 that this rank's expert slice starts at, rows of the full
    tensor) of a sharded expert weight; (0, rows) for one that is not sharded."""
    return getattr(param, _ROWS_ATTR, (0, param.shape[0]))


def is_parallelized(experts: nn.Module) -> bool:
    return getattr(experts, _SHARD_ATTR, None) is not None


def held_slots(experts: nn.Module) -> tuple[int, int]:
    """(first physical slot, slots) of a parallelized experts module on this rank: rows
    of its stacked weights (the experts ``first ..`` of a plain split, or slots of the
    redundant-expert placement)."""
    return getattr(experts, _SHARD_ATTR)


def mark_expert_params(experts: nn.Module) -> None:
    """Mark the experts module's weights as sharded expert parameters (again after FSDP,
    which registers new parameter objects): what :func:`is_expert_param` and the
    layout-independent init and checkpoints read."""
    first, _n = getattr(experts, _SHARD_ATTR)
    for pname in EXPERT_PARAMS:
        p = getattr(experts, pname, None)
        if p is not None:
            setattr(p, _EXPERT_ATTR, True)
            setattr(p, _ROWS_ATTR, (first, experts.total_rows))


def mark_all_expert_params(module: nn.Module) -> None:
    """:func:`mark_expert_params` for every parallelized MoE layer of ``module`` (after an
    operation that registers new parameter objects: FSDP's ``to_empty``)."""
    for moe in moe_layers(module):
        if is_parallelized(moe.experts):
            mark_expert_params(moe.experts)


def _keep_expert_rows(experts: nn.Module, rows: torch.Tensor, first: int, total: int) -> None:
    """Replace the stacked expert weights by their ``rows`` (this rank's experts or
    slots, starting at row ``first`` of ``total``), marked as sharded expert parameters;
    names and requires_grad unchanged."""
    for pname in EXPERT_PARAMS:
        p = getattr(experts, pname, None)
        if p is None:
            continue
        shard = nn.Parameter(p.detach().index_select(0, rows.to(p.device)).clone(),
                             requires_grad=p.requires_grad)
        setattr(experts, pname, shard)
    experts.num_experts = rows.numel()
    experts.total_rows = total
    setattr(experts, _SHARD_ATTR, (first, rows.numel()))
    mark_expert_params(experts)


def parallelize(module: nn.Module, dims, dispatcher: str = "dedup", overlap_chunks: int = 1,
                payload: str = "auto", placement: Placement | None = None) -> nn.Module:
    """Shard every ``epscale.MoE`` inside ``module`` over the EP group, in place.

    Expert parameters keep their names and their leading expert dim, sliced to this EP
    rank's experts ``[ep_rank*E/ep, (ep_rank+1)*E/ep)``; the router and shared experts stay
    replicated. ``dispatcher`` names the backend (``epscale.dispatch.DISPATCHERS``); with
    ep=1 every choice except 'deepep' (refused there) runs the local (communication-free)
    one; 'deepep' layers share one DeepEP buffer, built here for the widest layer.
    ``overlap_chunks`` > 1 lets 'dedup'/'hierarchical' pipeline chunks of tokens.
    ``payload``: 'auto' sends tokens in their dtype, 'bf16' casts them, 'fp8' sends e4m3
    with per-128-channel scales (dedup/hierarchical). ``placement``: an
    ``epscale.placement.plan_placement`` result; each rank then holds its s = S/ep
    physical slots (copies of hot experts, in the placement's order) and a
    :class:`~epscale.placement.PlacedDispatcher` spreads each expert's tokens over its
    copies; layers are matched to placement rows in registration order.
    Returns ``module``.
    """
    check_choice(dispatcher, payload, overlap_chunks, dims.ep)
    layers = moe_layers(module)
    if placement is not None:
        check_placement(layers, dims, placement)
    shared = None
    if dispatcher == "deepep" and layers:  # one per process, sized before any layer is built
        shared = DeepEPBuffer(dims, max(hidden_bytes_of(moe.cfg.dim) for moe in layers))
    for i, moe in enumerate(layers):
        cfg = moe.cfg
        E, ep = cfg.num_experts, dims.ep
        if is_parallelized(moe.experts):
            raise ValueError("parallelize: this MoE layer is already parallelized; parallelize "
                             "(or apply a placement to) the unparallelized module")
        moe.balance_group = getattr(dims, "stage_group", None)  # a pipeline stage's ranks
        workspace = moe.experts.row_buffers()
        if placement is None:
            check_expert_split(E, ep)
            if cfg.num_groups > 0 and dims.ep_num_nodes > 1 and cfg.topk_groups > dims.ep_num_nodes:
                raise ConfigError(
                    f"moe.topk_groups = {cfg.topk_groups} is more than the {dims.ep_num_nodes} "
                    f"nodes an EP group spans (ep={ep}, ranks_per_node={dims.ranks_per_node}); "
                    "node-limited routing must keep topk_groups <= the number of nodes")
            e = E // ep
            lo = dims.ep_rank * e
            _keep_expert_rows(moe.experts, torch.arange(lo, lo + e), lo, E)
            moe.dispatcher = make_dispatcher(dispatcher, E, dims, payload, overlap_chunks,
                                             workspace, dropless=cfg.capacity_factor is None,
                                             deepep_buffer=shared)
        else:
            S = placement.num_physical_experts
            s = S // ep
            lo = dims.ep_rank * s
            _keep_expert_rows(moe.experts, placement.phy2log[i, lo:lo + s], lo, S)
            inner = make_dispatcher(dispatcher, S, dims, payload, overlap_chunks, workspace,
                                    deepep_buffer=shared)
            moe.dispatcher = PlacedDispatcher(inner, placement.phy2log[i], E, rotate=dims.rank)
    if placement is not None:
        set_placement(module, placement)
    return module


def expert_param_ids(module: nn.Module) -> set[int]:
    """ids of the expert weights of every parallelized MoE layer of ``module``."""
    ids = set()
    for moe in moe_layers(module):
        if is_parallelized(moe.experts):
            ids.update(id(p) for p in moe.experts.parameters())
    return ids
