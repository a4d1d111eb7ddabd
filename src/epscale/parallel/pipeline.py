"""Pipeline parallelism: the model cut into stages of consecutive blocks, run by
``torch.distributed.pipelining``'s schedules (1F1B, GPipe, interleaved 1F1B, interleaved
zero-bubble, ZB-V, DualPipeV) over the pp process group.

Legend: p pipeline ranks (parallel.pp), v stages per rank, n = p x v stages, m
micro-batches per step, B micro-batch sequences, S sequence length, D model dim.

Placement: ``stage_placement`` lists the stages each pipeline rank holds: one (1f1b,
gpipe), v looped (stage s on rank s mod p: interleaved_1f1b, zero_bubble) or two in a V
(stages r and 2p - 1 - r: zbv, dualpipev).

The model on a rank: the meta-built Transformer keeps only the blocks of its stages,
under their original names (``layers.{i}.``), the embedding if it holds stage 0 and the
final norm, head and multi-token-prediction modules if it holds stage n - 1
(:func:`keep_stages`), there also a copy of the embedding where a tied head or the MTP
modules use it (``stage_embedding``, kept equal to the first stage's:
:mod:`epscale.parallel.stage_embedding`). Parameter names, and so checkpoints, are those of
the whole model whatever the split (the copy is never saved): a checkpoint written at one
pp loads at any other, and at any EP/FSDP layout. Each stage runs through a
:class:`StageChunk`, a module over its blocks (no copies) that PipelineStage drives.

The loss: the last stage computes it (the final norm, the head and the cross-entropy
fused over chunks of tokens, :meth:`epscale.model.Transformer.head_loss`: no [T, V]
logits kept, nor handed to the schedule) and outputs the micro-batch's loss as a
one-element tensor (the schedules' evaluation concatenates the last stage's outputs, which
a 0-dim tensor cannot be); the schedule's ``loss_fn`` (:func:`stage_loss`) returns it as
the 0-dim loss its backward starts from. Each micro-batch's token ids and targets reach
every stage as keyword inputs of the stage forward (``tokens_BS``, ``targets_BS``):
torch's schedules split a step's keyword arguments into micro-batches as they split its
inputs and hand micro-batch i's to every stage's forward of micro-batch i, whatever the
schedule's order. Every stage makes the document mask (``data.doc_masking``) from the
ids; the last stage masks the loss's targets with them
(:meth:`epscale.model.Transformer.loss_targets`) and runs the MTP modules on them.

MoE auxiliary losses: a stage's router losses never cross to the next stage. The chunk
attaches them to its output through :class:`AuxLossIntoBackward`, which passes the
activations through unchanged and, in backward, gives the auxiliary losses the gradient
1, as if they had been added to the micro-batch's loss; the schedule's 1/m scaling of
every gradient then makes it exactly ``(loss + aux) / m`` per micro-batch, the objective
of gradient accumulation without a pipeline. The MTP term (``train.mtp_loss_weight`` times
the modules' mean loss) and the MTP blocks' auxiliary losses join the last stage's loss
the same way, so ``loss`` stays the next-token loss the schedule reports.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from ..config import ConfigError
from ..config.schema import PP_SCHEDULES
from ..moe.layer import MoE
from .overlap_pair import install as install_overlapped_pairs
from ..plan.pipeline import stage_layers, stage_placement
from .pipeline_buffers import hold_receive_buffers_in_flight
from .stage_embedding import add_embedding_copy

SCHEDULE_CLASSES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe",
                    "interleaved_1f1b": "ScheduleInterleaved1F1B",
                    "zero_bubble": "ScheduleInterleavedZeroBubble",
                    "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


class AuxLossIntoBackward(torch.autograd.Function):
    """``y = x`` (a copy) in forward; in backward ``x`` gets y's gradient and ``aux`` (a 0-dim
    loss) the gradient 1: the auxiliary loss joins the objective without travelling to
    the last stage."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        # a copy, not a view: the zero-bubble schedules detach stage outputs in place
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)


class StageChunk(nn.Module):
    """One pipeline stage of a Transformer: its blocks (shared with the rank's model, not
    copied), the embedding on the first stage, the norm and head on the last, and there
    the multi-token-prediction modules and the copy of the embedding a tied head or those
    modules use (:mod:`epscale.parallel.stage_embedding`). Input: token ids [B, S] (first
    stage) or the previous stage's activations [B, S, D]; ``tokens_BS`` (int64 [B, S],
    the micro-batch's token ids: the document mask is made from them, the last stage's
    loss masks and the MTP modules read them) and ``targets_BS`` (int64 [B, S], -100
    skipped; used by the last stage only). Output: activations [B, S, D], or on the last
    stage the micro-batch's mean next-token loss (fp32 [1]; its backward also carries
    ``mtp_weight`` times the mean MTP loss and the MTP blocks' MoE auxiliary losses, see
    :meth:`_loss`). ``autocast``: a context (bf16 autocast) the forward runs under."""

    def __init__(self, model: nn.Module, index: int, num_stages: int, layer_ids: range,
                 autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                 mtp_weight: float = 0.0):
        super().__init__()
        self.index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.layer_ids = layer_ids
        self.blocks = nn.ModuleList(model.layers[str(i)] for i in layer_ids)
        self.tok_embeddings = model.tok_embeddings if self.is_first else None
        if self.is_last:
            self.norm, self.output = model.norm, model.output
            self.stage_embedding, self.mtp = model.stage_embedding, model.mtp
        else:
            self.mtp = None
        # the model's own methods (bound: the model is not a submodule of the chunk)
        self._attention_mask, self._loss_targets = model.attention_mask, model.loss_targets
        self._head_loss = model.head_loss if self.is_last else None
        self._mtp_loss_terms = model.mtp_loss_terms if self.is_last else None
        self.mtp_weight = mtp_weight
        # the detached mean MTP loss of each training micro-batch, in forward order
        self.mtp_losses: list[torch.Tensor] = []
        self._autocast = autocast or contextlib.nullcontext
        self.timer: Callable[[str], contextlib.AbstractContextManager] = \
            lambda name: contextlib.nullcontext()

    @property
    def splits_backward(self) -> bool:
        """Whether torch's split backward (input gradients first, weight gradients later:
        the zero-bubble and V schedules) can run this chunk. Not the last stage of a tied
        head with MTP modules: its copy of the embedding feeds both the modules' input and
        their head, one upstream of the other, and torch's weight pass, which starts from
        the nodes where each weight's path meets the input's, would run the modules'
        backward twice (the second time over a freed graph)."""
        return not (self.is_last and self.output is None and self.mtp is not None)

    def mtp_blocks(self) -> list[nn.Module]:
        """The multi-token-prediction modules' blocks (the last stage's; [] elsewhere)."""
        return [m.block for m in self.mtp.values()] if self.mtp is not None else []

    def run_order(self) -> list[nn.Module]:
        """The chunk's transformer blocks in the order its forward runs them: its own, then
        (last stage) the multi-token-prediction modules'."""
        return list(self.blocks) + self.mtp_blocks()

    def forward(self, x: torch.Tensor, targets_BS: torch.Tensor | None = None,
                tokens_BS: torch.Tensor | None = None) -> torch.Tensor:
        tokens_BS = x if self.is_first else tokens_BS
        if tokens_BS is None or (self.is_last and targets_BS is None):
            raise ValueError(f"pipeline stage {self.index}'s forward needs the micro-batch's "
                             "tokens_BS" + (" and targets_BS" if self.is_last else ""))
        with self.timer("forward"), self._autocast():
            mask = self._attention_mask(tokens_BS)
            h_BSD = self.tok_embeddings(x) if self.is_first else x
            for block in self.blocks:
                h_BSD = block(h_BSD) if mask is None else block(h_BSD, None, mask)
            h_BSD = _with_aux_losses(h_BSD, self.blocks)
            if not self.is_last:
                return h_BSD
            return self._loss(h_BSD, tokens_BS, targets_BS)

    def _loss(self, h_BSD: torch.Tensor, tokens_BS: torch.Tensor,
              targets_BS: torch.Tensor) -> torch.Tensor:
        """The last stage's output: the next-token loss [1] (not a view: torch detaches the
        last stage's outputs in place). In training with MTP modules its backward also
        gives ``mtp_weight * mean_k L^k`` and the modules' MoE auxiliary losses the
        gradient 1 (:class:`AuxLossIntoBackward`): the micro-batch's objective is
        ``loss + mtp_weight * mean_k L^k + aux``, as without a pipeline."""
        targets_BS = self._loss_targets(tokens_BS, targets_BS)
        loss = self._head_loss(h_BSD, targets_BS).reshape(1)
        if self.mtp is None or not (self.mtp.training and torch.is_grad_enabled()):
            return loss.clone()
        mtp = torch.stack(self._mtp_loss_terms(h_BSD, tokens_BS, targets_BS)).mean()
        self.mtp_losses.append(mtp.detach())
        extra = self.mtp_weight * mtp
        aux = _aux_losses(self.mtp_blocks())
        if aux:
            extra = extra + torch.stack(aux).sum()
        return AuxLossIntoBackward.apply(loss, extra.to(loss.dtype))


def _aux_losses(blocks) -> list[torch.Tensor]:
    """The MoE auxiliary losses (0-dim, with a graph) of ``blocks``' last forward."""
    aux = [b.ffn.aux_loss for b in blocks if isinstance(b.ffn, MoE)]
    return [a for a in aux if isinstance(a, torch.Tensor) and a.requires_grad]


def _with_aux_losses(h_BSD: torch.Tensor, blocks) -> torch.Tensor:
    """``h_BSD`` carrying the MoE auxiliary losses of ``blocks``' last forward into
    backward (:class:`AuxLossIntoBackward`): a stage's router losses never travel to the
    next stage."""
    aux = _aux_losses(blocks)
    if aux and torch.is_grad_enabled():
        return AuxLossIntoBackward.apply(h_BSD, torch.stack(aux).sum())
    return h_BSD


def _no_weight_pass() -> None:
    """The deferred weight pass of a stage whose backward ran whole (its ``dw_builder``)."""


def stage_loss(loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The schedules' ``loss_fn``: the last stage's output [1] is already the micro-batch's
    loss (``target``, the same micro-batch's targets, went to the stage itself); 0-dim,
    and not a view (the split backward detaches the loss in place)."""
    return loss.sum()


def keep_stages(model: nn.Module, stages: list[int], layers_per_stage: list[int]) -> None:
    """Drop from ``model`` (meta-built, before parallelizing) every block that is not in
    one of ``stages``, the embedding unless stage 0 is among them and the final norm,
    head and multi-token-prediction modules unless the last stage is; the names of what
    stays do not change. With the last stage, the copy of the embedding it uses (a tied
    head, MTP modules) is added as ``model.stage_embedding``
    (:mod:`epscale.parallel.stage_embedding`)."""
    n = len(layers_per_stage)
    keep = {i for s in stages for i in stage_layers(layers_per_stage)[s]}
    for key in [k for k in model.layers if int(k) not in keep]:
        del model.layers[key]
    if n - 1 in stages:
        add_embedding_copy(model)
    else:
        model.norm = None
        model.output = None
        model.mtp = None
    if 0 not in stages:
        model.tok_embeddings = None


class Pipeline:
    """This rank's part of the pipeline: its :class:`StageChunk`s run by the
    ``torch.distributed.pipelining`` schedule ``schedule`` over ``dims.pp_group``.

    ``micro_batch_shape`` (B, S) and ``activation_dtype`` give the stages their input and
    output shapes, so no extra forward runs to infer them. ``train_step(x, y)`` runs one
    step's ``micro_batches`` micro-batches (``x``, ``y``: all of them stacked, [m B, S])
    forward and backward and returns the micro-batches' losses on the ranks of the last
    stage ([] elsewhere; their multi-token-prediction losses then from
    :meth:`mtp_losses`); ``eval_losses(x, y)`` the same forward only (the next-token loss
    alone). The last stage computes each loss itself (:func:`stage_loss`).

    ``overlap`` (``parallel.overlap`` != 'none'): DualPipeV's paired forward and backward
    of two micro-batches run interleaved at their communication points
    (:mod:`epscale.parallel.overlap_pair`) instead of one after the other.
    """

    def __init__(self, chunks: list[StageChunk], dims, schedule: str, micro_batches: int,
                 micro_batch_shape: tuple[int, int], dim: int,
                 activation_dtype: torch.dtype, device: torch.device, overlap: bool = False):
        from torch.distributed import pipelining

        self.chunks, self.dims, self.name = chunks, dims, schedule
        self.micro_batches, self.device = micro_batches, device
        self.has_first = any(c.is_first for c in chunks)
        self.has_last = any(c.is_last for c in chunks)
        B, S = micro_batch_shape
        # shapes only (meta); requires_grad says which gradients travel back
        self.act_BSD = torch.empty(B, S, dim, dtype=activation_dtype, device="meta",
                               requires_grad=True)
        stages = []
        for c in chunks:
            inp = torch.empty(B, S, dtype=torch.long, device="meta") if c.is_first else self.act_BSD
            # the last stage's output: the micro-batch's loss
            out = (torch.empty(1, device="meta", requires_grad=True)
                   if c.is_last else self.act_BSD)
            # a chunk whose weight gradients torch cannot split off runs them with its
            # input gradients (a no-op weight pass; the same arithmetic)
            whole = {} if c.splits_backward else {"dw_builder": lambda: _no_weight_pass}
            stages.append(pipelining.PipelineStage(c, c.index, c.num_stages, device,
                                                   input_args=(inp,), output_args=(out,),
                                                   group=dims.pp_group, **whole))
        self.receive_buffers = hold_receive_buffers_in_flight(stages)
        cls = getattr(pipelining, SCHEDULE_CLASSES[schedule], None)
        if cls is None:
            raise ConfigError(f"parallel.pp_schedule = {schedule!r} needs torch's "
                              f"{SCHEDULE_CLASSES[schedule]}, which this torch "
                              f"({torch.__version__}) does not have; choose another schedule")
        single = PP_SCHEDULES[schedule] == "single"
        self.schedule = cls(stages[0] if single else stages, micro_batches, loss_fn=stage_loss)
        # the counts of DualPipeV's overlapped pairs (None: run one after the other)
        self.pair_stats = (install_overlapped_pairs(self.schedule)
                           if overlap and schedule == "dualpipev" else None)
        self.placement = stage_placement(schedule, dims.pp, len(chunks) if not single else 1)

    def _inputs(self, x_BS: torch.Tensor, y_BS: torch.Tensor, losses: list) -> tuple[tuple, dict]:
        # every stage's forward takes its micro-batch's token ids and targets
        kwargs = {"targets_BS": y_BS, "tokens_BS": x_BS}
        if self.has_last:
            kwargs.update(target=y_BS, losses=losses)
        return ((x_BS,) if self.has_first else ()), kwargs

    def train_step(self, x_BS: torch.Tensor, y_BS: torch.Tensor) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        for chunk in self.chunks:
            chunk.mtp_losses.clear()
        args, kwargs = self._inputs(x_BS, y_BS, losses)
        self.schedule.step(*args, return_outputs=False, **kwargs)
        return losses

    def mtp_losses(self) -> list[torch.Tensor]:
        """The mean multi-token-prediction loss of each micro-batch of the last
        :meth:`train_step` (0-dim each; [] without the last stage or MTP modules)."""
        return [loss for chunk in self.chunks for loss in chunk.mtp_losses]

    @torch.no_grad()
    def eval_losses(self, x_BS: torch.Tensor, y_BS: torch.Tensor) -> list[torch.Tensor]:
        """Forward only. The schedule's own ``eval()`` where torch's works; it also divides
        whatever gradients it finds on the stages by m, as after a step, so the stages'
        gradients are dropped first (call this after the step's optimizer update). The V
        schedules' ``eval()`` fails in torch 2.13 (it looks for a backward), so for them
        each micro-batch goes through the stages one after another, over plain sends."""
        for chunk in self.chunks:
            chunk.zero_grad(set_to_none=True)
        if PP_SCHEDULES[self.name] != "v":
            losses: list[torch.Tensor] = []
            args, kwargs = self._inputs(x_BS, y_BS, losses)
            self.schedule.eval(*args, **kwargs)
            return losses
        return self._sequential_eval(x_BS, y_BS)  # (all m micro-batches, stacked)

    def _sequential_eval(self, x_mBS: torch.Tensor, y_mBS: torch.Tensor) -> list[torch.Tensor]:
        """``x_mBS``, ``y_mBS``: the m micro-batches stacked, [m B, S]."""
        import torch.distributed as dist

        owner = {s: r for r, held in enumerate(self.placement) for s in held}
        me, n = self.dims.pp_rank, len(owner)
        mine = {c.index: c for c in self.chunks}
        group = self.dims.pp_group
        peer = {r: dist.get_global_rank(group, r) for r in range(self.dims.pp)}
        losses = []
        for x_BS, y_BS in zip(x_mBS.chunk(self.micro_batches), y_mBS.chunk(self.micro_batches)):
            h = x_BS  # token ids [B, S] into stage 0, activations [B, S, D] after it
            for s in range(n):
                if owner[s] != me:
                    continue
                if s > 0 and owner[s - 1] != me:
                    h = torch.empty(self.act_BSD.shape, dtype=self.act_BSD.dtype,
                                    device=self.device)
                    dist.recv(h, src=peer[owner[s - 1]], group=group)
                h = mine[s](h, targets_BS=y_BS, tokens_BS=x_BS)
                if s + 1 < n and owner[s + 1] != me:
                    dist.send(h.contiguous(), dst=peer[owner[s + 1]], group=group)
                if s == n - 1:  # h: the micro-batch's loss, [1]
                    losses.append(stage_loss(h, y_BS))
        return losses
