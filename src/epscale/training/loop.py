"""The training loop: EP x DP steps with gradient accumulation, AdamW + warm-up/cosine,
clipping, non-finite skips, the spike rollback, validation, metrics, checkpoints, resume
and graceful stop.

Legend: B micro-batch sequences per rank, S sequence length, E experts, L MoE layers.

One step on every rank: ``grad_accum`` x (data -> forward -> backward), or the pipeline
schedule over them (``training.step``) -> sync_gradients (and, under a pipeline, the
embedding's and its last-stage copy's gradients summed) -> grad norm (one all-reduce that
also carries the stop flag and non-finite losses) -> AdamW (or a skip) -> the step's
expert loads from the MoE layers' counters (one all-reduce) -> validation when due ->
StepStatsCollector.record (ONE all-reduce of every per-rank number) -> expert-bias update
and re-placement from those loads -> metrics.jsonl/heartbeat -> spike check -> checkpoint
when due.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as pp_schedules

from ..config import ConfigError, RunConfig, dump_yaml, to_dict
from ..kernels.cpu import describe_chunks, describe_elementwise
from ..launch.preflight import run_preflight
from ..launch.watchdog import Watchdog
from ..metrics import MetricsWriter, StepStatsCollector, StepTimers, peak_flops
from ..metrics.commclock import CommClock, attach_comm_clock
from ..appendfile import AppendFile, disk_error, warn_stderr
from ..model import build_meta_model, build_model
from ..moe.balance import step_loads, update_expert_biases
from ..parallel import parallelize_model, sync_gradients
from ..parallel.compile import compile_note, disable_section_timers
from ..parallel.fsdp import finish_gradients, micro_batch_sync, reshard
from ..parallel.pipeline import Pipeline, StageChunk, stage_layers
from ..parallel.stage_embedding import needs_embedding_copy, sum_embedding_gradients
from ..placement import plan_placement
from ..placement.replicas import Rebalancer, get_placement, placement_from_dict, placement_to_dict
from ..plan.layout import Layout, record_label
from ..plan.pipeline import bubble_fraction, layers_label, layers_per_stage
from ..plan.sizing import model_size
from . import checkpoint as ckpt
from .console import TrainConsole
from .data import DataError, DataLoader, load_data, unigram_entropy
from .dist import LaunchEnv, init_process_group, make_dims, pick_device, set_threads, shutdown
from .elastic import (check_memory, fit_batch, release_standby, split_standby, stand_by, why_not, layout_change, layout_record, layout_text, no_layout_message,
                      previous_attempt, process_start_time)
from .guard import Diverged, SpikeGuard, too_many_rollbacks, too_many_skips
from .optim import build_optimizer, ensure_optimizer_state, grad_norm_and_flags, lr_at, set_lr
from .prelaunch import CHECKED_ENV, check_run
from .step import AccumulationStep, PipelineStep
from .run_lock import RunLock, restart_wait

class ReportedByRankZero(ConfigError):
    """A configuration error that rank 0 reports; the other ranks stop with it quietly."""

    quiet = True


def every_rank(exc: BaseException) -> BaseException:
    """``exc`` marked as a stop that every rank raises at the same point, having agreed
    on it through a collective (bad data, divergence): :func:`train` then tears down with
    the barrier (all ranks reach it), so no rank leaves gloo mid-exchange at exit (seen:
    a rank aborting with "terminate called without an active exception")."""
    exc.every_rank = True
    return exc


REBALANCER_FILE = "rebalancer.pt"  # the re-placement load window, beside a checkpoint's shards
STOP_FILE = "STOP"  # touch RUN_DIR/STOP to stop gracefully (what `--nproc` forwards signals as)
_NULL = contextlib.nullcontext()


@dataclass
class RunResult:
    """What a finished (or stopped) run reports back."""

    run_dir: Path
    step: int
    stopped: bool
    records: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


class Trainer:
    """Trains ``cfg`` in ``run_dir`` on this process's share of the job.

    env: how this process was launched (``LaunchEnv('none')`` for a single process).
    stop_at: stop after this step as if signalled (checkpoint, exit cleanly); for tests
    and for splitting a run into pieces.
    """

    def __init__(self, cfg: RunConfig, run_dir: str | Path, env: LaunchEnv,
                 stop_at: int | None = None, checked: bool = False):
        self.cfg, self.env, self.stop_at = cfg, env, stop_at
        self.checked = checked  # the caller ran the pre-launch checks
        self.run_dir = Path(run_dir)
        self._signalled = False
        self._old_handlers: dict[int, Any] = {}
        self._verified: set[Path] = set()  # checkpoints hashed by this process
        self._save_failures = 0            # failed saves in a row
        self._pending: ckpt.PendingSave | None = None   # an async save not finished yet
        self._stager = None  # background saves' staging buffers (pinned on CUDA), kept
        self._layout_change: dict | None = None  # an elastic restart's, until its first step
        self.standby = 0  # ranks of this attempt past the world it trains at (elastic)

    # ================================================================== set-up
    def setup(self) -> None:
        """Everything a run needs, in order: the process group and the layout, the run
        directory, the model and its parallelism, the optimizer, the data, the metrics;
        then the start-up header and the resume from the newest checkpoint."""
        self._start_process_group()
        layout_note = self._resolve_layout()
        self._open_run_dir()
        placement, placement_note = self._build_model()
        self._build_optimizer(placement)
        self._open_data()
        self._open_metrics(placement)
        self._print_start(layout_note, placement_note)
        self._resume()

    def _start_process_group(self) -> None:
        """The device, the process group, this rank's place in it, rank 0's run directory,
        the hosts, and the previous attempt's layout."""
        env = self.env
        self.device = pick_device(env)
        set_threads(env, self.device)
        self._owns_group = init_process_group(env, self.device, single=self.cfg.parallel.fsdp)
        # from the process group where there is one (a caller may have created it)
        self.rank, self.world = ((dist.get_rank(), dist.get_world_size())
                                 if dist.is_initialized() else (env.rank, env.world_size))
        if self.world > 1:  # every rank uses rank 0's run directory
            self.run_dir = Path(self._broadcast(str(self.run_dir)))
        self.hosts = [socket.gethostname()] * self.world
        if self.world > 1:
            dist.all_gather_object(self.hosts, socket.gethostname())
        # The previous attempt's layout, from its 'start' event (an elastic restart may
        # have changed the world size since).
        self.previous = self._broadcast(
            previous_attempt(self.run_dir / "metrics.jsonl") if self.rank == 0 else None)

    def _resolve_layout(self) -> str | None:
        """``self.dims`` and this attempt's config (``train.grad_accum`` fitted to the
        world); returns the start-up header's note about the layout, if any."""
        cfg = self.cfg
        try:
            self.layout = Layout.from_config(cfg, self.world, ranks_per_node=cfg.parallel.ranks_per_node)
            self.dims, layout_note = make_dims(self.layout), self.layout.note
            cfg, batch_note = fit_batch(cfg, self.world)  # train.global_batch_size kept
            shrunk = self.previous and int(self.previous.get("world_size") or 0) > self.world
            if shrunk and self.device.type == "cuda":  # fewer shards each: does it still fit?
                props = torch.cuda.get_device_properties(self.device)
                check_memory(cfg, self.world, props.total_memory, f"one {props.name}")
        except ConfigError as e:
            if self.rank != 0:
                raise ReportedByRankZero("rank 0 reported a configuration error") from None
            raise ConfigError(no_layout_message(cfg, self.world, str(e), self.previous,
                                                self.hosts)) from None
        # The config as given (train.grad_accum not derived), for config.yaml and the
        # checkpoints: it loads again at any world; self.cfg is this attempt's.
        self.given_cfg, self.cfg = self.cfg, cfg
        idle = (f"{self.standby} more rank(s) of this elastic attempt stand by: the largest "
                f"world of whole nodes the config trains at is {self.world} (not "
                f"{self.world + self.standby}: {why_not(cfg, self.world + self.standby)})"
                if self.standby else None)
        return "; ".join(n for n in (layout_note, batch_note, idle) if n) or None

    def _open_run_dir(self) -> None:
        """The console, the pre-launch checks, the run directory (config.yaml, logs), the
        collective watchdog and the pre-flight check of the interconnect."""
        cfg = self.cfg
        self.console = TrainConsole(self.rank == 0, cfg.train.steps)
        self._check_before_writing()
        if self.rank == 0:
            for sub in ("checkpoints", "logs", "heartbeats"):
                (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
            dump_yaml(self.given_cfg, self.run_dir / "config.yaml")
        self._barrier()
        self._log_file = AppendFile(self.run_dir / "logs" / f"rank{self.rank}.log")  # survives ENOSPC
        self.watchdog = None
        if self.world > 1 and cfg.train.collective_timeout_s > 0:
            # Records every collective; one blocked past the timeout ends the job with a
            # report naming the rank, the operation and the step.
            self.watchdog = Watchdog(self.run_dir, timeout_s=cfg.train.collective_timeout_s)
            self.watchdog.start().install()
        if self.world > 1 and cfg.train.preflight:
            report = run_preflight(timeout_s=60, device=self.device)
            self.console.print(report.format())
            self._log(report.format())

    def _build_model(self):
        """The model, parallelized (:func:`epscale.parallel.parallelize_model`), and the
        step strategy that runs it. Returns (the redundant-expert placement or None, a
        line saying where it came from)."""
        cfg = self.cfg
        self.use_bf16 = cfg.train.dtype == "bfloat16" or (cfg.train.dtype == "auto"
                                                            and self.device.type == "cuda")
        self.fsdp = cfg.parallel.fsdp
        self.pp = cfg.parallel.pp
        # Every parallel layout (FSDP, pipelines, replicated dp x ep) is built on the meta
        # device and sharded (or cut into stages) before any memory is allocated; each
        # rank then fills only its part (the values a one-process build would hold).
        on_meta = self.fsdp or self.pp > 1 or self.world > 1
        self.model = build_meta_model(cfg) if on_meta else build_model(cfg, self.device)
        self.layers_per_stage = layers_per_stage(cfg) if self.pp > 1 else []
        self._resume_from = self._find_checkpoint()
        placement, placement_note = None, None
        if self.world > 1 and cfg.parallel.redundant_experts:  # (never with a pipeline)
            placement, placement_note = self._initial_placement()
        parts = parallelize_model(self.model, self.dims, cfg, self.device,
                                  layers_per_stage=self.layers_per_stage, placement=placement,
                                  param_dtype=torch.bfloat16 if self.use_bf16 else None,
                                  autocast=self._autocast)
        self.stages, self.fsdp_notes = parts.stages, parts.notes
        self.chunks = parts.chunks
        self.moe_layers = self.model.moe_layers()
        self.timers = StepTimers(self.device)
        self.model.set_timer(self.timers.section)
        # comm_s / comm_exposed_s of every step: the dispatchers' exchanges and FSDP's
        # gathers and reductions directly; the gradient all-reduce and the pipeline's p2p
        # where the step runs them (train_step)
        self.comm_clock = CommClock(self.device, enabled=cfg.metrics.comm_timing)
        for part in [self.model, *parts.chunks] if cfg.metrics.comm_timing else []:
            attach_comm_clock(part, self.comm_clock)
        if cfg.train.compile:  # a compiled block holds no clock reads (forward/backward still timed)
            disable_section_timers(self.model)
        self.stepper = self._step_strategy(parts.chunks)
        return placement, placement_note

    def _step_strategy(self, chunks: list[StageChunk]) -> AccumulationStep | PipelineStep:
        """Plain gradient accumulation, or this rank's pipeline stages run by the schedule."""
        cfg = self.cfg
        if not chunks:
            zero = cfg.parallel.zero if self.fsdp else 3
            return AccumulationStep(self.model, self.device, self.timers, self._autocast,
                                    self.rank, self.world,
                                    overlap=cfg.parallel.overlap != "none",
                                    before_backward=(lambda last: micro_batch_sync(
                                        self.model, zero, last)) if zero != 3 else None,
                                    mtp_weight=cfg.train.mtp_loss_weight,
                                    pair_micro_batches=cfg.parallel.overlap_micro_batches)
        for chunk in chunks:
            chunk.timer = self.timers.section
        # activations between stages: bf16 when FSDP casts the weights, else fp32
        # (autocast keeps the residual stream in fp32)
        act = torch.bfloat16 if self.use_bf16 and self.fsdp else torch.float32
        pipeline = Pipeline(chunks, self.dims, cfg.parallel.pp_schedule, cfg.train.grad_accum,
                            (cfg.train.micro_batch_size, cfg.model.seq_len), cfg.model.dim,
                            act, self.device, overlap=cfg.parallel.overlap != "none")
        return PipelineStep(pipeline, self.device, self.timers, self.dims,
                            has_mtp=cfg.model.mtp_depth > 0)

    def _build_optimizer(self, placement) -> None:
        """AdamW over this rank's parameters, and the re-placement of experts that moves
        their optimizer state along (a redundant-expert placement with rebalance_every)."""
        cfg = self.cfg
        self.opt = build_optimizer(self.model, cfg.train)
        ensure_optimizer_state(self.opt)
        self.rebalancer = None
        if placement is not None and cfg.parallel.rebalance_every > 0:
            self.rebalancer = Rebalancer(self.model, self.dims, every=cfg.parallel.rebalance_every,
                                         window=cfg.parallel.rebalance_window, optimizer=self.opt,
                                         num_groups=max(1, cfg.moe.num_groups))

    def _open_data(self) -> None:
        """The data (opened, not read), this rank's loader and the validation batches."""
        cfg = self.cfg
        self.splits = load_data(cfg.data, cfg.model.vocab_size)
        self.loader = DataLoader(self.splits, cfg.model.seq_len, cfg.train.micro_batch_size,
                                 cfg.train.grad_accum, self.stepper.data_rank,
                                 self.stepper.data_world, cfg.data.seed)
        self.val_batches = self.loader.val_batches(cfg.train.eval_batches)
        if cfg.data.doc_masking:
            self.model.set_document_masking(self.splits.eos_id)

    def _open_metrics(self, placement) -> None:
        """The step statistics, the metrics sinks, the spike guard and the counters."""
        cfg = self.cfg
        self.size = model_size(cfg)
        dtype = torch.bfloat16 if self.use_bf16 else torch.float32
        all_moe = [(i, cfg.moe.num_experts, cfg.moe.top_k) for i in cfg.model.moe_layer_ids()]
        self.collector = StepStatsCollector(self.model, ep=self.dims.ep, device=self.device,
                                            flops_per_token=self.size.flops_per_token,
                                            peak_flops=peak_flops(self.device, dtype),
                                            dead_after_steps=cfg.metrics.dead_after_steps,
                                            all_layers=all_moe, pp=self.pp)
        self.collector.set_placement(placement)
        self.writer = MetricsWriter.open(
            self.run_dir, rank=self.rank, run_name=cfg.name,
            tensorboard=cfg.metrics.tensorboard or None,  # None: the environment decides
            prometheus_port=cfg.metrics.prometheus_port,
            prometheus_addr=cfg.metrics.prometheus_addr)
        self.guard = SpikeGuard(cfg.train.spike_factor, cfg.train.spike_window,
                                cfg.train.spike_patience)
        self.step, self.num_skipped, self.num_rollbacks, self.skipped_in_a_row = 0, 0, 0, 0
        self.unigram = unigram_entropy(self.splits, cfg.model.vocab_size) if self.rank == 0 else None

    def _check_before_writing(self) -> None:
        """The pre-launch checks (layout, data, run directory, checkpoint against the
        model) on rank 0, unless the launcher ran them, then rank 0 takes the run
        directory's lock (one trainer per directory); nothing is written before. Rank 0
        reports an error; the other ranks stop quietly with exit status 2."""
        error = None
        if self.rank == 0:
            try:
                if not (self.checked or os.environ.get(CHECKED_ENV)):
                    check_run(self.cfg, self.run_dir, self.world)
                self.run_lock = RunLock(self.run_dir).acquire(self.console.note, restart_wait())
            except ConfigError as e:
                error = str(e)
        error = self._broadcast(error)
        if error is not None:
            if self.rank == 0:
                raise ConfigError(error)
            raise ReportedByRankZero("rank 0 reported a configuration error")

    def _find_checkpoint(self) -> tuple[Path, dict] | None:
        """The newest complete checkpoint of the run directory (rank 0 looks, moving the
        ones that fail their checks to checkpoints/corrupt/; every rank gets the answer),
        or None for a fresh run."""
        found = None
        if self.rank == 0:
            before = ckpt.list_checkpoints(self.run_dir)
            hit = ckpt.latest_valid(self.run_dir, report=self._warn, move_corrupt=True)
            found = (str(hit[0]), hit[1]) if hit else None
            if hit is None and before:
                where = ckpt.corrupt_root(self.run_dir)
                self.console.print(
                    f"[bold red]error:[/] all {len(before)} checkpoint(s) of {self.run_dir} "
                    f"failed their checks and were moved to {where} for inspection; "
                    "STARTING FROM STEP 0. Stop now (Ctrl-C) if that is not what you want.")
                self._log(f"error: every checkpoint corrupt, moved to {where}; starting fresh")
        found = self._broadcast(found)
        return (Path(found[0]), found[1]) if found else None

    def _initial_placement(self):
        """The redundant-expert placement to start from, and a line saying where it came
        from: the checkpoint's when it fits this layout; else planned from the checkpoint's
        load window when that fits; else from uniform loads (the first re-plan fixes it)."""
        cfg = self.cfg
        E = cfg.moe.num_experts
        P = E + cfg.parallel.redundant_experts
        L = len(self.model.moe_layers())
        path, meta = self._resume_from or (None, {})
        saved = meta.get("placement")
        if saved:
            try:
                pl = placement_from_dict(saved)
            except (KeyError, TypeError, ValueError) as e:
                raise ckpt.CheckpointError(f"checkpoint '{path}' has an unreadable placement in "
                                           f"meta.json: {e}") from e
            if tuple(pl.phy2log.shape) == (L, P) and pl.num_ranks == self.dims.ep and \
                    pl.replica_count.shape[1] == E:
                return pl, f"expert placement restored from {path.name}"
        loads_LE, source = np.ones((L, E)), "uniform loads"
        window = ckpt.load_extra(path, REBALANCER_FILE) if path is not None else None
        if window is not None and window["loads"].numel() and \
                tuple(window["loads"].shape[1:]) == (L, E):
            loads_LE, source = window["loads"].sum(0).numpy(), f"the loads saved in {path.name}"
        pl = plan_placement(loads_LE, P, self.dims.ep_num_nodes, self.dims.ep,
                            max(1, cfg.moe.num_groups))
        return pl, f"expert placement planned from {source}"

    def _pairing_text(self) -> str:
        """The start-up header's word on ``parallel.overlap_micro_batches``."""
        if not self.cfg.parallel.overlap_micro_batches:
            return ""
        m = self.cfg.train.grad_accum
        if m < 2:
            return ("; parallel.overlap_micro_batches: 1 micro-batch per step at this "
                    "world size, nothing to pair (each runs alone)")
        return (f"; {m} micro-batches, each forward but the first paired with the previous "
                "one's backward (parallel.overlap_micro_batches)")

    def _print_start(self, layout_note: str | None, placement_note: str | None = None) -> None:
        if self.rank != 0:
            return
        from rich.markup import escape  # a run dir named 'runs/[a]' is no markup tag
        cfg, s = self.cfg, self.size
        m, moe = cfg.model, cfg.moe
        num_moe = sum(m.is_moe_layer(i) for i in range(m.num_layers))  # all stages
        mtp = (f" + {m.mtp_depth} multi-token-prediction module(s) (loss weight "
               f"{cfg.train.mtp_loss_weight})" if m.mtp_depth else "")
        threads = torch.get_num_threads()
        lines = [
            f"[bold]epscale train[/] {escape(cfg.name)}: run dir {escape(str(self.run_dir))}",
            f"model: {s.total_params / 1e6:.2f}M parameters, {s.active_params / 1e6:.2f}M active "
            f"per token, {s.flops_per_token / 1e6:.1f} MFLOPs/token (train); {m.num_layers} layers "
            f"({num_moe} MoE: {moe.num_experts} experts, top-{moe.top_k}){mtp}, dim {m.dim}, "
            f"seq {m.seq_len}, vocab {m.vocab_size}",
            f"data: {self.splits.description}: {self.splits.train_tokens / 1e6:.2f}M train / "
            f"{self.splits.val_tokens / 1e6:.2f}M validation tokens, of which each evaluation "
            f"reads {self._val_tokens():,} (train.eval_batches = {cfg.train.eval_batches} global "
            f"batches); unigram entropy {self.unigram:.3f} nats",
            f"layout: {self.world} process(es), {self._layout_text()}, dispatcher "
            f"{cfg.parallel.dispatcher if self.dims.ep > 1 else 'local'}, {self.device.type} "
            f"{self._dtype_text()}, {threads} thread(s) per process",
            *([self._pipeline_text()] if self.pp > 1 else []),
            f"activation checkpointing: {cfg.train.activation_checkpointing}"
            + (f" (recomputed modules: {', '.join(cfg.train.recompute_modules)})"
               if cfg.train.recompute_modules else "")
            + ("; saved expert, FFN and attention-output activations in fp8 (1x128 tiles)"
               if cfg.train.activation_storage == "fp8" else "")
            + f"; AdamW moments in {cfg.train.optimizer_state_dtype}",
            f"element-wise expert kernels: {describe_elementwise(moe.cpu.elementwise, self.device)}",
            f"expert chunks: {describe_chunks(self.device)}",
            f"batch: {self.loader.samples_per_step} sequences x {m.seq_len} = "
            f"{self.loader.samples_per_step * m.seq_len:,} tokens per step, {cfg.train.steps} steps"
            + self._pairing_text(),
        ]
        if placement_note:
            par = cfg.parallel
            every = (f"re-planned every {par.rebalance_every} steps" if par.rebalance_every
                     else "kept fixed (rebalance_every: 0)")
            slots = moe.num_experts + par.redundant_experts
            lines.append(f"experts: {moe.num_experts} logical in {slots} slots "
                         f"({slots // self.dims.ep} per EP rank), {every}; {placement_note}")
        if layout_note:
            lines.append(f"note: {layout_note}")
        lines += self.fsdp_notes
        lines += list(self.writer.notes)  # where the metrics go (e.g. the Prometheus URL)
        for line in lines:
            self.console.print(line)
        self._log(f"start: world={self.world} dp={self.dims.dp} ep={self.dims.ep} "
                  f"params={s.total_params} active={s.active_params}")

    def _resume(self) -> None:
        """Continue from the newest complete checkpoint of the run directory, if any."""
        path = str(self._resume_from[0]) if self._resume_from else None
        layout = {**layout_record(self.dims, self.cfg, self.hosts), "standby": self.standby}
        event = {**layout, "total_params": self.size.total_params,
                 "active_params": self.size.active_params,
                 "flops_per_token": self.size.flops_per_token, "host": socket.gethostname()}
        self.writer.event("start", step=0, **event)
        t_load = time.time()
        if path is not None:
            meta = ckpt.load(Path(path), self.model, self.opt, self.dims)
            self._restore_meta(meta)
        change = layout_change(self.previous, layout, self.step)
        if change is not None:  # written once the first step at the new layout is done
            change.update(process_start=process_start_time(), load_start=t_load,
                          load_end=time.time(), resumed_from=path)
            self._layout_change = change
            old = layout_text(change["old"])
            lost = (f"{change['ranks_lost']} rank(s) lost" if change["ranks_lost"] > 0 else
                    f"{-change['ranks_lost']} rank(s) joined" if change["ranks_lost"] < 0
                    else "same size")
            self.console.print(f"layout changed: {old} -> {layout_text(layout)} ({lost}; "
                               f"{change['steps_lost'] or 0} step(s) since the checkpoint "
                               "are trained again)")
            if change["ranks_lost"] > 0:  # said now, not only after the first step
                self._say_node_lost(change)
            self._log(f"layout change: {old} -> {layout_text(layout)}")
        if path is None:
            return
        self.writer.event("resume", step=self.step, path=path,
                          from_world_size=meta.get("world_size"), from_pp=meta.get("pp", 1),
                          from_dp=meta.get("dp"), from_ep=meta.get("ep"))
        written = record_label(meta, (meta.get("config") or {}).get("parallel"))
        self.console.print(f"resumed from {path} (step {self.step}, written at {written})")
        self._log(f"resume: {path} step={self.step}")

    def _say_node_lost(self, change: dict) -> None:
        """An elastic restart without some of the previous attempt's ranks: a line naming
        the hosts that left and a 'node_lost' event."""
        hosts = change["hosts_lost"] or {}
        where = ", ".join(f"{h} ({n} rank(s))" for h, n in hosts.items()) or "unknown hosts"
        self.writer.event("node_lost", step=self.step, ranks_lost=change["ranks_lost"],
                          hosts_lost=hosts, world_size=self.world)
        self.console.print(f"[bold yellow]node lost:[/] {change['ranks_lost']} rank(s) of the "
                           f"previous attempt are gone ({where}); training goes on at "
                           f"{self.world} process(es) with the same global batch; a node that "
                           "comes back joins at the next restart")
        self._log(f"node lost: {change['ranks_lost']} rank(s) on {where}")

    def _restore_meta(self, meta: dict) -> None:
        self.step = int(meta["step"])
        data = meta.get("data") or {}
        if "position" in data:
            self.loader.load_state_dict(data)
        self.guard.load_state_dict(meta.get("guard") or {})
        self.num_skipped = int(meta.get("num_skipped", 0))
        self.num_rollbacks = int(meta.get("num_rollbacks", 0))
        if self.rebalancer is not None and self._resume_from is not None:
            state = ckpt.load_extra(self._resume_from[0], REBALANCER_FILE)
            if state is not None:
                self.rebalancer.load_state_dict(state)

    # ================================================================== helpers
    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def _broadcast(self, obj: Any) -> Any:
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _log(self, text: str) -> None:
        self._log_file.write_line(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}")

    def _warn(self, text: str) -> None:
        self.console.note(f"[yellow]warning:[/] {text}")
        self._log(f"warning: {text}")

    def _layout_text(self) -> str:
        return self.layout.label()

    def _pipeline_text(self) -> str:
        """The start-up header's pipeline line: schedule, stages and their blocks."""
        par, m = self.cfg.parallel, self.cfg.train.grad_accum
        ranges = stage_layers(self.layers_per_stage)
        runs = [layers_label(r.start, r.stop, self.cfg.model.mtp_depth if i == len(ranges) - 1
                             else 0) for i, r in enumerate(ranges)]
        bubble = bubble_fraction(par.pp_schedule, self.pp, m, par.pp_virtual_stages)
        mtp = " and the multi-token-prediction modules" if self.cfg.model.mtp_depth else ""
        copy = (" with a copy of the embedding (its gradient summed with the first's)"
                if needs_embedding_copy(self.cfg.model) else "")
        return (f"pipeline: {par.pp_schedule}, {len(runs)} stages over pp={self.pp} ranks "
                f"(layers {', '.join(runs)}; embedding on the first, head{mtp} on the "
                f"last{copy}), {m} micro-batches per step, bubble {bubble:.0%} for equal "
                f"stages; this rank: stage(s) {', '.join(map(str, self.stages))}")

    def _dtype_text(self) -> str:
        if not self.use_bf16:
            return "fp32"
        return ("bf16 compute, fp32 master weights and gradient reduction" if self.fsdp
                else "bf16 autocast")

    def _autocast(self):
        if self.use_bf16 and not self.fsdp:  # FSDP casts the parameters itself
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _heartbeat(self) -> None:
        path = self.run_dir / "heartbeats" / f"rank{self.rank}.json"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({"rank": self.rank, "host": socket.gethostname(),
                                       "step": self.step, "time": time.time(), "pid": os.getpid()}))
            os.replace(tmp, path)
        except OSError as e:  # a full disk: the last heartbeat stays; say so once
            if not disk_error(e):
                raise
            tmp.unlink(missing_ok=True)
            if not getattr(self, "_heartbeat_failed", False):
                self._heartbeat_failed = True
                warn_stderr(f"cannot write {path} ({e.strerror}); the run goes on")

    def _on_signal(self, signum, _frame) -> None:
        self._signalled = True

    def _install_signals(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            try:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: rely on the STOP file
                pass

    def _restore_signals(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers = {}

    def _stop_requested(self) -> bool:
        return self._signalled or (self.run_dir / STOP_FILE).exists()

    # ================================================================== one step
    def train_step(self) -> dict[str, Any]:
        """Runs step ``self.step + 1`` on this rank; returns the all-reduced step record."""
        cfg, T = self.cfg, self.timers
        step = self.step + 1
        if self.watchdog is not None:
            self.watchdog.set_step(step)
        T.reset()
        clock = self.comm_clock
        clock.reset()
        t0 = time.perf_counter()
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        for moe in self.moe_layers:
            moe.reset_token_counts()
        accum = cfg.train.grad_accum
        with clock.intercept("pp", pp_schedules, ("_batch_p2p",)) if self.pp > 1 else _NULL:
            loss_sum, has_loss = self.stepper.train(self.loader, accum)
        self.loader.end_step()
        if self.loader.bad_data:  # flagged as non-finite: no rank updates; run() stops them
            loss_sum = torch.full_like(loss_sum, float("nan"))
        with T.section("sync"):  # the gradient all-reduces: communication, and rank waits
            if self.world > 1 or self.fsdp:
                if self.fsdp:
                    finish_gradients(self.model, self.dims)  # FSDP reduce-scattered in backward
                else:
                    with clock.intercept("dp", dist, ("all_reduce",)):
                        sync_gradients(self.model, self.dims)
            # the embedding and the last pipeline stage's copy: both get their sum
            with clock.intercept("pp", dist, ("batch_isend_irecv",)) if self.pp > 1 else _NULL:
                sum_embedding_gradients(self.model, self.dims)
        with T.section("optimizer"):  # the norm and clipping are compute, not communication
            grad_norm, stop, skip = grad_norm_and_flags(
                self.model, self.dims, cfg.train.grad_clip, self._stop_requested(), loss_sum)
        lr = lr_at(step, cfg.train)
        with T.section("optimizer"):
            if skip:
                self.opt.zero_grad(set_to_none=True)
            else:
                set_lr(self.opt, lr)
                self.opt.step()
        step_time = time.perf_counter() - t0
        breakdown = T.breakdown()  # before validation, whose forwards use the same sections
        comm = clock.totals()
        self.step = step
        loads_LE = self._balance_loads(skip)  # before validation's forwards count theirs
        extra: dict[str, Any] = {}
        spilled = [m.dispatcher.spilled_rows() for m in self.moe_layers]
        if any(n is not None for n in spilled):  # spill-over: rows moved in the last micro-batch
            extra["spilled_rows"] = sum(n for n in spilled if n is not None)
        if self._eval_due():
            extra["val_loss"] = self.evaluate()
        rec = self.collector.record(step, step_time_s=step_time,
                                    num_tokens=accum * cfg.train.micro_batch_size * cfg.model.seq_len,
                                    loss=loss_sum if has_loss else None, lr=lr, grad_norm=grad_norm,
                                    breakdown=breakdown, skipped=skip, extra=extra,
                                    comm=comm, mtp_loss=self.stepper.mtp_loss)
        if loads_LE is not None and cfg.moe.bias_update_speed > 0:
            update_expert_biases(self.model, self.dims, cfg.moe.bias_update_speed, loads_LE)
        if loads_LE is not None and self.rebalancer is not None:
            self._rebalance(step, loads_LE)
        self._stop_flag = stop or (self.stop_at is not None and step >= self.stop_at)
        return rec

    def _balance_loads(self, skipped: bool) -> torch.Tensor | None:
        """The step's expert loads [L, E] from the MoE layers' counters, summed over the
        ranks that hold each layer (one all-reduce), for the expert-bias update and the
        re-placement; None when neither runs this step (or it was skipped)."""
        if skipped or (self.cfg.moe.bias_update_speed <= 0 and self.rebalancer is None):
            return None
        return step_loads(self.model, self.dims)

    def _rebalance(self, step: int, loads_LE: torch.Tensor) -> None:
        """Feed the step's loads to the re-placement window; re-place when due (moves
        expert weights and AdamW state between ranks; the model's function is unchanged)."""
        self.rebalancer.observe(loads_LE)
        old = get_placement(self.model)
        t0 = time.perf_counter()
        new = self.rebalancer.maybe_replace(step)
        if new is None:
            return
        window_LE = np.sum(self.rebalancer.loads, axis=0)
        before, after = (float(pl.imbalance(window_LE).max()) for pl in (old, new))
        self.collector.set_placement(new)
        self.writer.event("replacement", step=step, seconds=time.perf_counter() - t0,
                          num_moves=self.rebalancer.num_moves, imbalance_before=before,
                          imbalance_after=after, max_replicas=int(new.replica_count.max()))
        self._log(f"re-placement at step {step}: planned max/mean rank load "
                  f"{before:.3f} -> {after:.3f}")

    def _write_layout_change(self, rec: dict[str, Any]) -> None:
        """The 'layout_change' event, after the first step at the new layout: what changed
        and the time to resume, split into the outage (the previous layout's last step ->
        this process's start: detection, rendezvous, process start), set-up, checkpoint
        load and the first step."""
        ev, self._layout_change = self._layout_change, None
        now, last = time.time(), ev.pop("last_step_time", None)
        start, load_start, load_end = (ev.pop(k) for k in ("process_start", "load_start",
                                                          "load_end"))
        timing = {"setup_s": load_start - start, "load_s": load_end - load_start,
                  "first_step_s": now - load_end}
        if isinstance(last, (int, float)):
            timing = {"outage_s": start - last, **timing, "resume_s": now - last}
        self.writer.event("layout_change", step=rec["step"], **ev,
                          **{k: round(v, 3) for k, v in timing.items()})

    def _eval_due(self) -> bool:
        every = self.cfg.train.eval_every
        return self.step == self.cfg.train.steps or (every > 0 and self.step % every == 0)

    def _val_tokens(self) -> int:
        """Validation tokens one evaluation reads (all ranks): train.eval_batches global
        batches of seq_len windows."""
        return self.cfg.train.eval_batches * self.loader.samples_per_step * self.cfg.model.seq_len

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over the fixed validation batches of every rank."""
        self.model.eval()
        total = self.stepper.validation_loss_sum(self.val_batches)
        if self.fsdp and self.cfg.parallel.zero != 3:   # forwards kept the weights gathered
            reshard([self.model, *self.chunks])
        total /= len(self.val_batches)
        if self.world > 1:  # the mean over the data-parallel ranks (the last stage's)
            dist.all_reduce(total)
            total /= self.stepper.data_world
        self.model.train()
        return float(total)

    # ================================================================== checkpoints
    def save_checkpoint(self, blocking: bool = True) -> Path | None:
        """Save (collective); None when the save failed and training goes on, or when it
        was started in the background (``train.async_checkpoint`` and not ``blocking``:
        :meth:`finish_checkpoint` ends it)."""
        self.finish_checkpoint()
        meta = {"data": self.loader.state_dict(), "guard": self.guard.state_dict(),
                "num_skipped": self.num_skipped, "num_rollbacks": self.num_rollbacks,
                "config": to_dict(self.given_cfg)}
        extra = {}
        placement = get_placement(self.model)
        if placement is not None:
            meta["placement"] = placement_to_dict(placement)
        if self.rebalancer is not None:
            extra[REBALANCER_FILE] = self.rebalancer.state_dict()
        background = self.cfg.train.async_checkpoint and not blocking
        if background and self._stager is None:
            self._stager = ckpt.background_stager(self.device)  # None: DCP's CPU copy
        t0 = time.perf_counter()
        pending = ckpt.save_async(self.run_dir, self.step, self.model, self.opt, self.dims, meta,
                                  keep=self.cfg.train.ckpt_keep, extra_files=extra,
                                  verified=self._verified, report=self._warn,
                                  background=background,
                                  process_group=self.dims.background_group() if background else None,
                                  stager=self._stager if background else None)
        if background and pending.failed is None:
            self._pending = pending
            dt = time.perf_counter() - t0
            self.writer.event("checkpoint_started", step=self.step, staging_seconds=dt)
            self._log(f"checkpoint: step {self.step} staged in {dt:.2f}s, writing in the background")
            return None
        return self._finish(pending)

    def finish_checkpoint(self) -> Path | None:
        """Collective: wait for the background save, if one is running, and finish it."""
        pending, self._pending = self._pending, None
        return self._finish(pending) if pending is not None else None

    def _finish(self, pending: ckpt.PendingSave) -> Path | None:
        try:
            path = pending.wait()
        except ckpt.CheckpointSaveError as e:
            self._save_failures += 1
            limit = self.cfg.train.ckpt_fail_limit
            self.writer.event("checkpoint_failed", step=pending.step, error=str(e),
                              failures_in_a_row=self._save_failures, limit=limit)
            self._warn(f"{e} (failure {self._save_failures} of at most {limit} in a row; "
                       "training goes on)")
            if self._save_failures >= limit:
                raise ckpt.CheckpointSaveError(
                    f"{self._save_failures} checkpoint saves failed in a row "
                    f"(train.ckpt_fail_limit = {limit}); stopping. Last: {e}") from None
            return None
        self._save_failures = 0
        dt = time.perf_counter() - pending.started
        self.writer.event("checkpoint", step=pending.step, path=str(path), seconds=dt,
                          background=pending.in_background)
        self._log(f"checkpoint: {path} ({dt:.2f}s{', in the background' if pending.in_background else ''})")
        return path

    def _rollback(self, rec: dict[str, Any]) -> None:
        """Back to the newest checkpoint, keeping the data position (so the batches since
        then, the spiking ones included, are skipped)."""
        self.finish_checkpoint()
        path = None
        if self.rank == 0:
            found = ckpt.latest_valid(self.run_dir, report=self._warn, rollback=True)
            path = str(found[0]) if found else None
        path = self._broadcast(path)
        from_step, position = self.step, self.loader.position
        if path is None:
            self.writer.event("rollback", step=from_step, ok=False, loss=rec["loss"],
                              reason="no checkpoint written while the loss was normal")
            self._warn(f"loss spike at step {from_step} ({rec['loss']:.4f}) but no checkpoint "
                       "written while the loss was normal to roll back to; continuing")
            return
        to_step = int(ckpt.read_meta(Path(path))["step"])
        if self.guard.count_rollback(to_step) > self.cfg.train.max_rollbacks:
            self._diverged("rollback_limit", too_many_rollbacks(to_step, rec["loss"], self.cfg.train))
        meta = ckpt.load(Path(path), self.model, self.opt, self.dims)
        self.step = int(meta["step"])
        self.num_rollbacks += 1
        self.guard.reset()
        skipped = position - int((meta.get("data") or {}).get("position", position))
        self.writer.event("rollback", step=from_step, ok=True, to_step=self.step, path=path,
                          loss=rec["loss"], median=self.guard.median(), skipped_samples=skipped)
        self._warn(f"loss spike at step {from_step} ({rec['loss']:.4f}): rolled back to step "
                   f"{self.step}, skipping {skipped} samples")

    def _stop_on_bad_data(self) -> None:
        """After a skipped step: when a rank read a token id beyond the vocabulary, every
        rank stops with its message (rank 0 prints it; exit status 2 everywhere)."""
        msgs = [self.loader.bad_data]
        if self.world > 1:
            msgs = [None] * self.world
            dist.all_gather_object(msgs, self.loader.bad_data)
        bad = next((m for m in msgs if m), None)
        if bad is not None:
            self.writer.event("bad_data", step=self.step, message=bad)
            raise every_rank(DataError(bad) if self.rank == 0 else ReportedByRankZero(bad))

    def _diverged(self, reason: str, message: str) -> None:
        """Stop the run: the loss will not settle at this config (an event for `monitor
        --check`, then :class:`Diverged`: exit status 2, and no restart by the launcher)."""
        self.writer.event("diverged", step=self.step, reason=reason, message=message)
        self._log(f"error: {message}")
        raise every_rank(Diverged(message) if self.rank == 0 else ReportedByRankZero(message))

    # ================================================================== the loop
    def run(self) -> RunResult:
        cfg = self.cfg
        records: list[dict[str, Any]] = []
        self._install_signals()
        stopped = False
        last_val = None
        try:
            self.console.start(self.step)
            while self.step < cfg.train.steps:
                rec = self.train_step()
                records.append(rec)
                if self._layout_change is not None:
                    self._write_layout_change(rec)
                last_val = rec.get("val_loss", last_val)
                self.writer.write(rec)
                self.console.step(rec)
                if cfg.train.compile and len(records) == 2:
                    self.console.note(compile_note(records))
                self._heartbeat()
                if self.step % cfg.train.log_every == 0:
                    self._log(f"step {self.step} loss {rec['loss']:.4f} "
                              f"{rec['tokens_per_s']:.0f} tok/s")
                self.skipped_in_a_row = self.skipped_in_a_row + 1 if rec["skipped"] else 0
                if rec["skipped"]:
                    self._stop_on_bad_data()
                    self.num_skipped += 1
                    self.writer.event("skip_nonfinite", step=self.step, loss=rec["loss"],
                                      grad_norm=rec["grad_norm"], total_skipped=self.num_skipped)
                    self._warn(f"step {self.step}: non-finite loss or gradient, update skipped")
                    if self.skipped_in_a_row >= cfg.train.max_skipped_steps:
                        self._diverged("skipped_steps", too_many_skips(self.skipped_in_a_row, cfg.train))
                elif self.guard.observe(rec["loss"]):
                    self._rollback(rec)
                    continue
                due = cfg.train.ckpt_every > 0 and self.step % cfg.train.ckpt_every == 0
                path = None
                last = self.step == cfg.train.steps or self._stop_flag
                if due or last:
                    finished = self._pending.final if self._pending is not None else None
                    path = self.save_checkpoint(blocking=last)
                    if finished is not None and finished.is_dir():
                        self.console.note(f"checkpoint {finished.name} saved (in the background)")
                    if path is not None:
                        self.console.note(f"checkpoint {path.name} saved")
                if self._stop_flag and self.step < cfg.train.steps:
                    stopped = True
                    saved = ("checkpoint saved" if path is not None else
                             "this step's checkpoint failed: the run continues from the last one")
                    self.console.note(f"stopping at step {self.step} ({saved}; run again with "
                                      "the same --run-dir to continue)")
                    break
            self.console.close()
            summary = self.console.summary(records, last_val, self.num_skipped,
                                           self.num_rollbacks, self.unigram) if self.rank == 0 else {}
            self.writer.event("end", step=self.step, stopped=stopped, **summary)
            self._log(f"end: step {self.step} stopped={stopped}")
            return RunResult(self.run_dir, self.step, stopped, records, summary)
        finally:
            self.console.close()
            self._restore_signals()

    def close(self, clean: bool = True) -> None:
        """Tear down whatever setup got to (it may have failed half-way)."""
        try:
            for part in ("watchdog", "collector", "writer", "_log_file", "_stager"):
                obj = getattr(self, part, None)
                if obj is not None:
                    (obj.stop if part == "watchdog" else obj.close)()
            if getattr(self, "rank", None) == 0:
                (self.run_dir / STOP_FILE).unlink(missing_ok=True)
        finally:
            if getattr(self, "run_lock", None) is not None:
                self.run_lock.release()
            if getattr(self, "rank", None) == 0 and self.standby:
                release_standby(self.run_dir)  # even after a failed teardown: they would wait
            shutdown(clean, destroy=getattr(self, "_owns_group", True))


def train(cfg: RunConfig, run_dir: str | Path, env: LaunchEnv | None = None,
          stop_at: int | None = None, checked: bool = False) -> RunResult:
    """Set up, train, tear down. ``env`` None means a single process. ``checked``: the
    caller ran :func:`epscale.training.prelaunch.check_run` already."""
    env, standby, idle = split_standby(cfg, env or LaunchEnv("none"))
    if idle:  # an elastic world larger than the config can use: this rank waits it out
        stand_by(Path(run_dir), env, env.world_size - standby, why_not(cfg, env.world_size))
        return RunResult(Path(run_dir), 0, True, summary={"standby": True})
    trainer = Trainer(cfg, run_dir, env, stop_at=stop_at, checked=checked)
    trainer.standby = standby
    clean = False
    try:
        trainer.setup()
        result = trainer.run()
        clean = True
        return result
    except BaseException as e:
        clean = getattr(e, "every_rank", False)   # a stop all ranks agreed on
        raise
    finally:
        # After an error, no barrier: the other ranks may be stuck in a collective, and
        # the launcher tears them down once this process exits non-zero.
        trainer.close(clean)
