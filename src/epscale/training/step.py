"""How a training step runs its micro-batches and how validation runs, behind one
interface the loop calls: plain gradient accumulation (:class:`AccumulationStep`) or a
pipeline schedule (:class:`PipelineStep`). The loop itself has no pipeline branches.

Legend: B micro-batch sequences per rank, S sequence length, m micro-batches per step.

The interface (both classes):

* ``data_rank``, ``data_world``: this rank's place among the ranks that read different
  data (every rank; under a pipeline, the ranks of one stage: its stages share their
  micro-batches).
* ``train(loader, accum)``: one step's ``accum`` micro-batches forward and backward, the
  gradients summed as for ``(loss + aux) / accum`` each; returns (the mean micro-batch
  loss, a 0-dim tensor; whether this rank has it: under a pipeline only the ranks of the
  last stage do, the others return 0).
* ``mtp_loss``: after ``train``, the step's mean multi-token-prediction loss (0-dim, the
  mean over the model's ``model.mtp_depth`` modules and the micro-batches; under a
  pipeline 0 on the ranks without the last stage, like the loss), or None where the model
  has no such modules.
* ``validation_loss_sum(batches)``: the sum of the validation batches' losses this rank
  computes (float64, 0-dim; 0 on ranks without the last stage), forward only.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
from torch import nn

from ..metrics import StepTimers
from ..parallel.dims import ParallelDims
from ..parallel.grads import set_last_micro_batch
from ..parallel.overlap_pair import PairStats, finish_partner, run_pair
from ..parallel.pipeline import Pipeline
from .data import DataLoader

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs x_BS, targets y_BS), on the host


class AccumulationStep:
    """``accum`` micro-batches forward and backward one after another through the whole
    model; every rank reads its own data.

    ``overlap`` (``parallel.overlap``; True unless 'none'): reductions that only need the
    step's sum run in the last micro-batch's backward only (HSDP's replica all-reduce,
    the replicated layout's DDP buckets: :func:`epscale.parallel.grads.set_last_micro_batch`);
    False reduces after every micro-batch (the plain path). ``before_backward(last)``:
    called before each micro-batch's backward (``last``: the step's last), e.g. FSDP's
    ZeRO-1/2 switches (:func:`epscale.parallel.fsdp.micro_batch_sync`). ``mtp_weight``:
    ``train.mtp_loss_weight``, lambda of the multi-token-prediction loss: each micro-batch
    backpropagates ``(loss + lambda * model.mtp_loss() + aux) / accum`` where the model
    has such modules (``model.mtp_depth``).

    ``pair_micro_batches`` (``parallel.overlap_micro_batches``): micro-batch i + 1's
    forward runs together with micro-batch i's backward (:func:`run_pair`: one thread at a
    time, handing over at every expert exchange), so that each one's all-to-alls are in
    flight while the other computes. The first forward and the last backward run alone.
    The same operations on the same tensors as one after the other (the backwards still
    add into the gradients in micro-batch order): the same losses and gradients, bit for
    bit. Memory: two micro-batches' activations at a time. Replicated layout only (FSDP's
    per-module state holds one pass of a module at a time); DDP's post-forward of a pair's
    forward waits until the pair's backward has ended (:func:`finish_partner`), since it
    arms the reducer for the next backward."""

    def __init__(self, model: nn.Module, device: torch.device, timers: StepTimers,
                 autocast: Callable[[], contextlib.AbstractContextManager], rank: int,
                 world: int, overlap: bool = True,
                 before_backward: Callable[[bool], None] | None = None,
                 mtp_weight: float = 0.0, pair_micro_batches: bool = False):
        self.model, self.device, self.timers, self.autocast = model, device, timers, autocast
        self.data_rank, self.data_world = rank, world
        self.overlap = overlap
        self.before_backward = before_backward
        self.mtp_weight = mtp_weight
        self.has_mtp = getattr(model, "mtp", None) is not None
        self.mtp_loss: torch.Tensor | None = None
        self.pair_stats: PairStats | None = None
        if pair_micro_batches:
            if before_backward is not None:
                raise ValueError("paired micro-batches run on the replicated layout only "
                                 "(no per-micro-batch FSDP switches)")
            self.pair_stats = PairStats()
            # before DDP's own post-forward hook (prepend): see the class docstring
            model.register_forward_hook(lambda _m, _args, _out: finish_partner(), prepend=True)

    def train(self, loader: DataLoader, accum: int) -> tuple[torch.Tensor, bool]:
        self._loss_sum = torch.zeros((), device=self.device)
        self._mtp_sum = torch.zeros((), device=self.device) if self.has_mtp else None
        if self.pair_stats is not None and accum > 1:
            total = self._forward(loader, 0, accum)
            for i in range(1, accum):
                total, _ = run_pair(functools.partial(self._forward, loader, i, accum),
                                    functools.partial(self._backward, total, i - 1, accum),
                                    self.pair_stats, self.timers)
            self._backward(total, accum - 1, accum)
        else:
            for i in range(accum):
                self._backward(self._forward(loader, i, accum), i, accum)
        self.mtp_loss = self._mtp_sum
        return self._loss_sum, True

    def _forward(self, loader: DataLoader, i: int, accum: int) -> torch.Tensor:
        """Micro-batch ``i``'s forward: its objective ``(loss + aux [+ mtp]) / accum``, the
        loss (and MTP loss) added to the step's means."""
        T = self.timers
        set_last_micro_batch(self.model, i == accum - 1 or not self.overlap)
        with T.section("data"):
            x_BS, y_BS = loader.next_micro_batch()
            x_BS, y_BS = (x_BS.to(self.device, non_blocking=True),
                          y_BS.to(self.device, non_blocking=True))
        with T.section("forward"):
            with self.autocast():
                loss = self.model.loss(x_BS, y_BS)
                total = loss + self.model.aux_loss()
                if self._mtp_sum is not None:
                    mtp = self.model.mtp_loss()
                    total = total + self.mtp_weight * mtp
                    self._mtp_sum += mtp.detach().float() / accum
                total = total / accum
        self._loss_sum += loss.detach().float() / accum
        return total

    def _backward(self, total: torch.Tensor, i: int, accum: int) -> None:
        with self.timers.section("backward"):
            if self.before_backward is not None:
                self.before_backward(i == accum - 1)
            total.backward()

    def validation_loss_sum(self, batches: list[Batch]) -> torch.Tensor:
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        for x_BS, y_BS in batches:
            with self.autocast():
                total += self.model.loss(x_BS.to(self.device), y_BS.to(self.device)).double()
        return total


class PipelineStep:
    """A step's micro-batches through the pipeline schedule (``pipeline``: this rank's
    stages); the ranks of one stage read different data, a stage's pipeline ranks the
    same. Timed: each stage's forward as 'forward', the rest of the schedule as
    'backward' (so it includes the point-to-point waits and the pipeline's bubble).
    ``has_mtp``: the model has multi-token-prediction modules (``model.mtp_depth`` > 0;
    the last stage runs them, ``train.mtp_loss_weight`` given to its chunk)."""

    def __init__(self, pipeline: Pipeline, device: torch.device, timers: StepTimers,
                 dims: ParallelDims, has_mtp: bool = False):
        self.pipeline, self.device, self.timers = pipeline, device, timers
        self.data_rank, self.data_world = dims.stage_rank, dims.stage_size
        self.has_mtp = has_mtp
        self.mtp_loss: torch.Tensor | None = None

    def _stacked(self, micro_batches: list[Batch]) -> Batch:
        """A step's micro-batches as one batch each of inputs and targets (the pipeline
        schedule cuts them apart again), on the device."""
        x_BS = torch.cat([x for x, _y in micro_batches]).to(self.device, non_blocking=True)
        y_BS = torch.cat([y for _x, y in micro_batches]).to(self.device, non_blocking=True)
        return x_BS, y_BS

    def train(self, loader: DataLoader, accum: int) -> tuple[torch.Tensor, bool]:
        T = self.timers
        with T.section("data"):
            batches = [loader.next_micro_batch() for _ in range(accum)]
        x_BS, y_BS = self._stacked(batches)
        with T.section("backward"):
            losses = self.pipeline.train_step(x_BS, y_BS)
        self.mtp_loss = self._mean_mtp_loss()
        if not losses:
            return torch.zeros((), device=self.device), False
        return torch.stack([l.detach().float() for l in losses]).mean(), True

    def _mean_mtp_loss(self) -> torch.Tensor | None:
        """The step's mean MTP loss over its micro-batches (the last stage's ranks; 0 on the
        others: the step statistics average it over the ranks that have a loss)."""
        if not self.has_mtp:
            return None
        mtp = self.pipeline.mtp_losses()
        return torch.stack(mtp).float().mean() if mtp else torch.zeros((), device=self.device)

    def validation_loss_sum(self, batches: list[Batch]) -> torch.Tensor:
        """A step's worth of micro-batches at a time, forward only; the last stage sums."""
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        m = self.pipeline.micro_batches
        for i in range(0, len(batches), m):
            losses = self.pipeline.eval_losses(*self._stacked(batches[i:i + m]))
            total += sum(l.double() for l in losses) if losses else 0.0
        return total
