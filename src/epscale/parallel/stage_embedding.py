"""The last pipeline stage's copy of the token embedding: a tied output head
(``model.tie_embeddings``) and DeepSeek-V3's multi-token prediction (``model.mtp_depth``:
the embedding of the tokens k positions ahead) under ``parallel.pp > 1``.

Why a copy: both need the embedding on the last stage, which sits on the first. One
parameter cannot belong to two stages: they are two ranks (1F1B, GPipe, interleaved), or
two FSDP roots and two PipelineStages on one rank (the V schedules: ZB-V, DualPipeV put the
first and the last stage on pp rank 0). So the rank that holds the last stage also holds
``model.stage_embedding``, an ``nn.Embedding`` of the embedding's shape, in that stage's
chunk (Megatron's approach), and the two stay equal:

* the same initial values: the copy is materialised with the values of
  ``tok_embeddings.weight`` (a function of the seed, that name and the position; FSDP
  shards dim 0 of both the same way over a stage's dense mesh, so the copy's shard on a
  stage rank equals the original's shard on the same stage rank);
* the same gradient: after the step's backward and the gradient reductions (FSDP's
  reduce-scatter, the replicated layout's all-reduce) each holds the gradient of its own
  uses; :func:`sum_embedding_gradients` gives both their sum, the gradient the
  one-process model's single embedding gets: an exchange over the pp group between the
  rank of stage 0 (pp rank 0) and the rank of the last stage with the same stage rank
  (pp rank pp - 1; in effect an all-reduce over those two ranks), or an addition where
  one rank holds both. ``a + b`` and ``b + a`` are the same number in IEEE arithmetic, so
  the two sums are equal bit for bit;
* the same update: AdamW's arithmetic on equal values, gradients and moments (the grad
  norm, which scales both alike when clipping, counts the copy once:
  :func:`copied_parameters`).

Checkpoints never hold the copy, so they stay those of the whole model at every pp: a save
leaves it out (the original, with the same values and moments, is saved by the first
stage); a load reads ``tok_embeddings.weight`` into it on a rank without the original
(:func:`load_renames`) and copies the original into it on a rank with both
(:func:`copy_original_into_copy`).

Legend: V vocabulary, D model dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import ModelConfig

ORIGINAL = "tok_embeddings.weight"
COPY = "stage_embedding.weight"


def needs_embedding_copy(cfg: ModelConfig) -> bool:
    """Whether the last pipeline stage uses the embedding: a tied head, or
    multi-token-prediction modules."""
    return cfg.tie_embeddings or cfg.mtp_depth > 0


def add_embedding_copy(model: nn.Module) -> None:
    """Give ``model`` (a Transformer cut to the stages of a rank that holds the last one,
    still on the meta device) its ``stage_embedding`` where the last stage needs one."""
    if needs_embedding_copy(model.cfg):
        device = next(model.parameters()).device
        model.stage_embedding = nn.Embedding(model.cfg.vocab_size, model.cfg.dim, device=device)


def copied_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that copy another one (the last stage's embedding): the grad norm
    leaves them out, their gradient being the original's."""
    copy = getattr(model, "stage_embedding", None)
    return [copy.weight] if copy is not None else []


def load_renames(model: nn.Module) -> dict[str, str]:
    """{checkpoint name: this rank's parameter name}: the copy loads the original's tensor
    where this rank does not hold the original."""
    if getattr(model, "stage_embedding", None) is None or model.tok_embeddings is not None:
        return {}
    return {ORIGINAL: COPY}


def checkpoint_names(model: nn.Module, load: bool) -> dict[str, str]:
    """{name in ``model``'s state dict: its name in a checkpoint} for what a checkpoint
    holds of ``model``: everything under its own name but the copy, which is left out, or
    for a ``load`` on a rank without the original loaded under the original's name."""
    renamed = {live: saved for saved, live in load_renames(model).items()} if load else {}
    return {name: renamed.get(name, name) for name in model.state_dict()
            if name != COPY or name in renamed}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def copy_original_into_copy(model: nn.Module, opt: torch.optim.Optimizer | None) -> None:
    """Where this rank holds both (a V schedule's pp rank 0): the copy gets the original's
    values and AdamW state (after a checkpoint load, which filled the original only)."""
    copy = getattr(model, "stage_embedding", None)
    if copy is None or model.tok_embeddings is None:
        return
    original = model.tok_embeddings.weight
    _local(copy.weight).copy_(_local(original))
    if opt is None or not opt.state.get(original):
        return
    copied = opt.state[copy.weight]
    for key, t in opt.state[original].items():
        if key in copied and isinstance(t, torch.Tensor):
            _local(copied[key]).copy_(_local(t))
        else:
            copied[key] = t.clone() if isinstance(t, torch.Tensor) else t


def _grad(p: nn.Parameter) -> torch.Tensor:
    """``p``'s local gradient, zeros where backward left none."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return _local(p.grad)


@torch.no_grad()
def sum_embedding_gradients(model: nn.Module, dims) -> None:
    """After the step's backward and gradient reductions (collective over the pp ranks that
    hold the first or the last stage): the embedding and the last stage's copy both hold
    the sum of their gradients. A no-op without a pipeline or without a copy."""
    if getattr(dims, "pp", 1) == 1 or not needs_embedding_copy(model.cfg):
        return
    original = model.tok_embeddings.weight if model.tok_embeddings is not None else None
    copy = model.stage_embedding.weight if model.stage_embedding is not None else None
    if original is not None and copy is not None:   # one rank holds both ends
        total = _grad(original).add_(_grad(copy))
        _grad(copy).copy_(total)
        return
    mine = original if original is not None else copy
    if mine is None:
        return                                       # a middle stage
    peer = dims.pp - 1 if original is not None else 0
    grad = _grad(mine)
    theirs = torch.empty_like(grad)
    group = dims.pp_group
    peer_rank = dist.get_global_rank(group, peer)
    ops = [dist.P2POp(dist.isend, grad.contiguous(), peer_rank, group),
           dist.P2POp(dist.irecv, theirs, peer_rank, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    grad.add_(theirs)
