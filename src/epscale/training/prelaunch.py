"""Everything about a run that can be checked before a process starts or a file is
written: the layout, the dispatcher, the data, the run directory and, when resuming, the
checkpoint against the model. ``epscale train`` and ``epscale launch`` run these checks
before torchrun (one message, exit status 2, the run directory as it was); the trainer
runs them again on rank 0 before its first write when an outside launcher started it.
"""

from __future__ import annotations

import errno
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError, RunConfig
from ..config.schema import SPLIT_BACKWARD_SCHEDULES
from ..dispatch.registry import check_choice, check_deepep_ep
from ..model import Transformer
from ..plan.layout import Layout
from . import checkpoint as ckpt
from .data import DataLoader, load_data
from .elastic import fit_batch

# Set by a launcher that ran the checks, so its workers need not repeat them.
CHECKED_ENV = "EPSCALE_PRELAUNCH_CHECKED"


@dataclass
class Checked:
    """What the checks found: the layout note (or None) and the checkpoint a run resumes
    from (None for a fresh run)."""

    layout_note: str | None
    resume_from: Path | None


def check_run(cfg: RunConfig, run_dir: str | Path | None, world_size: int) -> Checked:
    """Raise :class:`ConfigError` (a :class:`~epscale.training.checkpoint.CheckpointError`
    for a checkpoint) naming the key, file or directory when ``cfg`` cannot train at
    ``world_size`` processes in ``run_dir``; writes nothing."""
    lay = Layout.from_config(cfg, world_size)
    cfg, batch_note = fit_batch(cfg, world_size)  # grad_accum from train.global_batch_size
    note = "; ".join(n for n in (lay.note, batch_note) if n) or None
    check_deepep_ep(cfg.parallel.dispatcher, lay.ep)
    check_split_backward_fsdp(cfg)
    if lay.ep > 1:
        check_choice(cfg.parallel.dispatcher, cfg.parallel.payload, cfg.parallel.overlap_chunks)
    check_data(cfg, world_size)
    resume_from = None
    if run_dir is not None:
        check_run_dir(Path(run_dir))
        resume_from = check_checkpoint(cfg, Path(run_dir))
    return Checked(note, resume_from)




def check_split_backward_fsdp(cfg: RunConfig) -> None:
    """A split-backward schedule with FSDP at ZeRO-3 trains with wrong gradients in torch
    2.13 (with or without parallel.overlap; the step-1 gradient norm of the tiny model at
    pp=2 was 4.24 to 4.45 against one process's 4.63), so it does not start. A training
    rule, not a layout one: describe and simulate still size such layouts."""
    par = cfg.parallel
    if par.pp > 1 and par.fsdp and par.zero == 3 and par.pp_schedule in SPLIT_BACKWARD_SCHEDULES:
        raise ConfigError(
            f"config key 'parallel.pp_schedule' = {par.pp_schedule!r} cannot train with "
            "parallel.fsdp: true at parallel.zero: 3 yet: its backward in two parts (inputs, "
            "then weights) gives wrong gradients with FSDP2 regathering the weights per "
            "micro-batch; use parallel.zero: 1, or parallel.pp_schedule 1f1b, "
            "interleaved_1f1b or gpipe")


def check_data(cfg: RunConfig, world_size: int) -> None:
    """The data sources load, their token ids fit model.vocab_size (every id of a .bin
    file; a prepared directory's manifest, and with data.verify_shards every shard's
    SHA-256), and every split holds at least one window of model.seq_len + 1 tokens (the
    loader's own checks)."""
    splits = load_data(cfg.data, cfg.model.vocab_size, thorough=True)
    t = cfg.train
    DataLoader(splits, cfg.model.seq_len, t.micro_batch_size, t.grad_accum, 0, world_size,
               cfg.data.seed)


def check_run_dir(run_dir: Path) -> None:
    """``run_dir`` is a directory (or can become one) that this process can write: checked
    in its nearest existing ancestor, so nothing is created in the run directory itself."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir '{run_dir}' is a file, not a directory; name a directory "
                          "(it is created when missing)")
    probe = run_dir
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"--run-dir '{run_dir}': '{probe}' is a file, so the run directory "
                          "cannot be created under it")
    _probe_write(run_dir, probe)
    for sub in ("checkpoints", "logs", "heartbeats"):
        path = run_dir / sub
        if path.exists() and not path.is_dir():
            raise ConfigError(f"--run-dir '{run_dir}': '{path}' is a file; the run needs it as a "
                              "directory")
        if path.is_dir():
            _probe_write(run_dir, path)


def _probe_write(run_dir: Path, where: Path) -> None:
    """Create and remove an empty directory in ``where``: ``os.access`` says yes to root
    everywhere; a real create says what the file system does (read-only, immutable,
    full, /proc)."""
    try:
        tempfile.TemporaryDirectory(dir=where, prefix=".epscale-probe-").cleanup()
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else str(e)
        hint = ("the disk is full" if e.errno == errno.ENOSPC
                else "choose a directory you can write")
        raise ConfigError(f"--run-dir '{run_dir}' cannot be written ({where}: {why}); "
                          f"{hint}") from None


def check_checkpoint(cfg: RunConfig, run_dir: Path) -> Path | None:
    """The checkpoint a run in ``run_dir`` would resume from, checked against the model
    ``cfg`` builds (parameter names and shapes, on the meta device: nothing is
    allocated); None for a fresh run. Corrupt checkpoints are reported, not moved (the
    trainer moves them aside when it starts). A live run may rotate the checkpoint away
    while it is read (a node joining an elastic job): then the newest one is taken again."""
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.moe)
    for attempt in range(5):
        found = ckpt.latest_valid(run_dir, report=lambda _msg: None)
        if found is None:
            return None
        path, _meta = found
        try:
            ckpt.check_compatible(path, {"model": model.state_dict()})
        except FileNotFoundError:
            if path.exists() or attempt == 4:  # not a rotation: a checkpoint missing a file
                raise
            continue
        return path
    return None
