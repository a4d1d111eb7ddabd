"""What a checkpoint holds, as DCP state dicts that share storage with the live model and
optimizer: routed-expert tensors as DTensors on the (dp, ep) mesh (Replicate over dp,
Shard(0) over ep), everything else as plain replicated tensors, so that a checkpoint
written at one (dp, ep) loads at any other (DCP reads the overlapping slices). Experts
under a redundant-expert placement are seen in their logical layout, so checkpoints never
depend on the placement; the last pipeline stage's copy of the embedding is never saved
(:mod:`epscale.parallel.stage_embedding`), so they never depend on the pipeline either.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ...moe.layer import named_moe_layers
from ...parallel import is_expert_param
from ...parallel.stage_embedding import checkpoint_names, load_renames
from ...placement.replicas import expert_state, get_placement, logical_layout, relayout_rows
from ...plan.layout import Dims
from ..optim import ensure_optimizer_state
from .paths import CheckpointError


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _wrap(t: torch.Tensor, expert: bool, dims: Dims) -> torch.Tensor:
    """The checkpoint's view of a live tensor: its place in the full tensor, whatever the
    layout. An FSDP-sharded dense tensor already is that (a DTensor of the full shape); an
    expert slice (replicated over dp, or sharded by FSDP over efsdp) becomes a DTensor of
    all E experts' rows, sharded over ep (and efsdp) and replicated over the rest."""
    if isinstance(t, DTensor) and expert:
        rows = t.shape[0] * dims.ep
        shape = torch.Size((rows, *t.shape[1:]))
        return DTensor.from_local(t.to_local(), dims.checkpoint_expert_mesh,
                                  [Replicate(), Shard(0), t.placements[-1]], run_check=False,
                                  shape=shape, stride=torch.empty(shape, device="meta").stride())
    if isinstance(t, DTensor) or not expert or getattr(dims, "mesh", None) is None \
            or dims.ep == 1:
        return t
    return DTensor.from_local(t, dims.mesh, [Replicate(), Shard(0)], run_check=False)


class PlacedExperts:
    """Expert tensors of a model placed with redundant experts (``parallel.redundant_experts``),
    seen in the logical layout: this rank's E/ep logical experts, contiguous, exactly as
    an unplaced model holds them. Checkpoints therefore never depend on the placement (a
    checkpoint written with one placement, or none, loads into any other, at any ep).

    ``for_save`` gathers the logical rows from the slots (one exchange per layer);
    ``for_load`` hands out empty logical buffers and ``scatter`` copies what DCP loaded
    into them back to every slot that holds the expert (one exchange per layer).
    """

    def __init__(self, model: nn.Module, opt, dims: Dims):
        self.placement = get_placement(model)
        self.dims, self.opt = dims, opt
        if opt is not None and self.placement is not None:
            ensure_optimizer_state(opt)
        self.layers = []  # (layer index, module name prefix, moe)
        if self.placement is not None:
            moes = [(n, m) for _lid, n, m in named_moe_layers(model)]
            self.layers = [(i, n, m) for i, (n, m) in enumerate(moes)]
        self.views: dict[str, dict[str, torch.Tensor]] = {}  # param name -> logical views
        self._live: list[tuple[int, list[torch.Tensor], list[torch.Tensor]]] = []

    def _collect(self, load: bool) -> None:
        for i, prefix, moe in self.layers:
            fields = expert_state(moe, self.opt, keys=("exp_avg", "exp_avg_sq"))
            live = [t for _, _, t in fields]
            E, ep = moe.cfg.num_experts, self.dims.ep
            if load:
                logical = [t.new_zeros((E // ep, *t.shape[1:])) for t in live]
                self._live.append((i, live, logical))
            else:
                logical, _, _ = relayout_rows(live, self.placement.phy2log[i].numpy(),
                                              logical_layout(E), self.dims)
            for (pname, key, _), t in zip(fields, logical):
                name = f"{prefix}.experts.{pname}" if prefix else f"experts.{pname}"
                self.views.setdefault(name, {})[key] = t

    def for_save(self) -> "PlacedExperts":
        self._collect(load=False)
        return self

    def for_load(self) -> "PlacedExperts":
        self._collect(load=True)
        return self

    @torch.no_grad()
    def scatter(self) -> None:
        """After a load into the logical buffers: copy them into every slot."""
        for i, live, logical in self._live:
            E = self.placement.replica_count.shape[1]
            placed, _, _ = relayout_rows(logical, logical_layout(E),
                                         self.placement.phy2log[i].numpy(), self.dims)
            for t, v in zip(live, placed):
                t.copy_(v)


def build_state(model: nn.Module, opt: torch.optim.Optimizer | None, dims: Dims,
                placed: "PlacedExperts | None" = None, load: bool = False) -> dict[str, Any]:
    """``{"model": {name: tensor}, "optim": {name: {"step", "exp_avg", "exp_avg_sq"}}}``
    whose tensors share storage with the live parameters and optimizer state (a DCP load
    writes straight into them). Experts under a redundant-expert placement appear in their
    logical layout instead (``placed``: a :class:`PlacedExperts` prepared for save or
    load). The last pipeline stage's copy of the embedding is never a key of its own: left
    out (the first stage saves the original), or for a ``load`` on a rank without the
    original, under the original's name (:func:`~epscale.parallel.stage_embedding.load_renames`)."""
    if opt is not None:
        ensure_optimizer_state(opt)
    views = placed.views if placed is not None else {}
    params = dict(model.named_parameters())
    names = checkpoint_names(model, load)
    model_sd = {}
    for name, t in model.state_dict().items():
        if name not in names:
            continue
        p = params.get(name)
        if name in views:
            t = views[name]["param"]
        model_sd[names[name]] = _wrap(t, p is not None and is_expert_param(p), dims)
    state: dict[str, Any] = {"model": model_sd}
    if opt is not None:
        optim_sd = {}
        for name, p in params.items():
            st = opt.state.get(p)
            if not st or name not in names:
                continue
            expert = is_expert_param(p)
            src = views.get(name, st)
            optim_sd[names[name]] = {"step": st["step"],
                                     "exp_avg": _wrap(src["exp_avg"], expert, dims),
                                     "exp_avg_sq": _wrap(src["exp_avg_sq"], expert, dims)}
        state["optim"] = optim_sd
    return state


def copy_back(model: nn.Module, opt, state: dict, skip: set[str] = frozenset()) -> None:
    """Copy DTensor local shards into the live tensors when DCP did not load in place
    (``skip``: names whose tensors are not the live ones, the placed experts); a tensor
    loaded under another name (the last stage's embedding copy) goes to its live one."""
    live = model.state_dict()
    params = dict(model.named_parameters())
    renames = load_renames(model)
    for name, t in state["model"].items():
        if name not in skip:
            copy_local(_local(live[renames.get(name, name)]), t)
    if opt is not None and "optim" in state:
        for name, entry in state["optim"].items():
            if name in skip:
                continue
            st = opt.state[params[renames.get(name, name)]]
            for k, t in entry.items():
                copy_local(_local(st[k]), t)


def copy_local(dst: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a loaded tensor (or a DTensor's local shard) into ``dst`` unless it is ``dst``."""
    src = _local(loaded)
    if dst.data_ptr() != src.data_ptr():
        dst.copy_(src)


def saved_keys(path: Path) -> dict[str, Any]:
    reader = dcp.FileSystemReader(str(path))
    return reader.read_metadata().state_dict_metadata


def check_compatible(path: Path, state: dict) -> None:
    """Raise CheckpointError when the saved tensors do not match the model's names/shapes."""
    saved = saved_keys(path)
    problems = []
    for name, t in state["model"].items():
        key = f"model.{name}"
        if key not in saved:
            problems.append(f"'{name}' is not in the checkpoint")
            continue
        shape = tuple(t.shape) if not isinstance(t, DTensor) else tuple(t.size())
        saved_shape = tuple(getattr(saved[key], "size", ()))
        if saved_shape != shape:
            problems.append(f"'{name}' has shape {saved_shape} there, {shape} in the model")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"checkpoint '{path}' does not fit this model: "
                              f"{'; '.join(problems[:3])}{more}. Was it written with another "
                              "model config?")
