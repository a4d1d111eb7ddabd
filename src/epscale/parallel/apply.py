"""Parallelizing the model, in one place and in one fixed order (torchtitan's
``parallelize_*`` shape): the trainer builds the model (on the meta device for FSDP and
pipelines), calls :func:`parallelize_model` once, and gets back what it runs. The model
itself knows nothing of parallelism.

The order, and why:

1. pipeline split: a rank keeps only its stages' blocks (names unchanged), each stage run
   by a :class:`~epscale.parallel.pipeline.StageChunk` (the last one with the
   multi-token-prediction modules and the copy of the embedding it uses); everything
   below then touches only what this rank holds.
2. expert parallelism: each EP rank keeps its experts' rows (or its slots of a
   redundant-expert placement) and a dispatcher that moves tokens to them; spill-over
   wraps that dispatcher.
3. activation checkpointing: the blocks run their forward recomputed in backward.
4. compile (``train.compile``): each block's forward through ``torch.compile``
   (:mod:`epscale.parallel.compile`), after its forward is final (experts sharded,
   recomputation set), before FSDP wraps the blocks.
5. FSDP: experts on the expert mesh, blocks and roots on the dense mesh; at
   ``parallel.zero`` 1 or 2 the weights stay gathered across micro-batches.
6. materialisation: a meta-built model gets its weights, each rank its shards only, with
   the values a one-process build holds there.
7. the replicated layout (no FSDP, no pipeline): gradients reduced during backward in
   DDP's buckets (``parallel.grads.reduce_in_backward``; ``parallel.overlap: none`` keeps
   the reduction after the whole backward).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..config import RunConfig
from ..config.schema import SPLIT_BACKWARD_SCHEDULES
from ..dispatch.comm import counters_of
from ..model import Transformer
from ..moe.layer import moe_layers
from ..placement.eplb import Placement
from ..placement.spill import apply_spill
from .activation import apply_activation_checkpointing, apply_activation_storage
from .compile import compile_blocks
from .dims import ParallelDims
from .fsdp import apply_fsdp
from .grads import reduce_in_backward
from .materialize import materialize
from .pipeline import StageChunk, keep_stages, stage_layers, stage_placement
from .shard import parallelize


@dataclass
class Parallelized:
    """What :func:`parallelize_model` made of this rank's model.

    stages: the pipeline stages this rank holds, in the order it runs them ([] without a
    pipeline). chunks: one StageChunk per held stage (the modules the pipeline schedule
    runs and FSDP wraps last). notes: lines for the start-up header."""

    stages: list[int] = field(default_factory=list)
    chunks: list[StageChunk] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def set_blocking(model: nn.Module) -> None:
    """``parallel.overlap: none``: every exchange of every MoE layer's dispatcher runs
    synchronously (whatever the dispatcher asks for), and the EP backends (also those a
    placement or spill-over wrapper holds) run their plain path: one chunk, no shared
    experts behind the combine, gradients exchanged blocking in backward."""
    for moe in moe_layers(model):
        for counter in counters_of(moe.dispatcher):
            counter.blocking = True
        backend = moe.dispatcher
        while backend is not None:
            if hasattr(backend, "overlap"):
                backend.overlap = False
            backend = getattr(backend, "inner", None) or getattr(backend, "plain", None)


def parallelize_model(model: Transformer, dims: ParallelDims, cfg: RunConfig,
                      device: torch.device, *,
                      layers_per_stage: list[int] | None = None,
                      placement: Placement | None = None,
                      param_dtype: torch.dtype | None = None,
                      autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                      ) -> Parallelized:
    """Apply ``cfg.parallel`` and ``cfg.train``'s recomputation to ``model`` in place, for
    this rank of ``dims`` (the order: see the module docstring).

    model: built by ``epscale.model.build_model`` (on ``device``) or ``build_meta_model``
    (then materialised here, from ``train.seed``). layers_per_stage: blocks per pipeline
    stage (parallel.pp > 1). placement: a redundant-expert placement for the EP ranks.
    param_dtype: the compute dtype: FSDP's (bf16 mixed precision), or autocast's without
    FSDP (None: fp32); compiled blocks take it into account.
    autocast: the context the pipeline stages run their forward under."""
    par, train = cfg.parallel, cfg.train
    on_meta = any(p.is_meta for p in model.parameters())
    out = Parallelized()

    # 1. pipeline split
    if par.pp > 1:
        out.stages = stage_placement(par.pp_schedule, par.pp,
                                     par.pp_virtual_stages)[dims.pp_rank]
        keep_stages(model, out.stages, layers_per_stage)
        ranges = stage_layers(layers_per_stage)
        out.chunks = [StageChunk(model, s, len(ranges), ranges[s], autocast=autocast,
                                 mtp_weight=train.mtp_loss_weight)
                      for s in out.stages]

    # 2. expert parallelism: sharding, dispatcher wiring, spill-over
    overlap = par.overlap != "none"
    if dims.world_size > 1 or par.fsdp:
        parallelize(model, dims, dispatcher=par.dispatcher,
                    overlap_chunks=par.overlap_chunks if overlap else 1,
                    payload=par.payload, placement=placement)
        if par.spill_threshold is not None and dims.ep > 1:
            apply_spill(model, dims, par.spill_threshold, par.spill_min_rows)
        if not overlap:
            set_blocking(model)

    # 3. activation checkpointing
    apply_activation_checkpointing(model, train.activation_checkpointing, train.recompute_modules)
    apply_activation_storage(model, train.activation_storage)

    # 4. compile, per transformer block
    if train.compile:
        out.notes += compile_blocks(model, dims.ep, param_dtype or torch.float32, device,
                                    split_backward=par.pp > 1
                                    and par.pp_schedule in SPLIT_BACKWARD_SCHEDULES)

    # 5. FSDP
    roots: list[nn.Module] | None = out.chunks or None
    if par.fsdp:
        out.notes += apply_fsdp(model, dims, param_dtype=param_dtype, prefetch=overlap,
                                roots=roots, reshard_after_forward=par.zero == 3)

    # 6. materialisation, shard by shard
    if on_meta:
        materialize(model, device, train.seed, dims, roots=roots)

    # 7. the replicated layout's gradients: reduced during backward in DDP's buckets
    # (FSDP reduces its own; under a pipeline or with overlap off: sync_gradients after)
    if not par.fsdp:
        reduce_in_backward(model, dims, overlap)
    return out
