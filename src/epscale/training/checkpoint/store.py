"""Saving and loading sharded checkpoints with ``torch.distributed.checkpoint`` (DCP),
resharding on load to whatever layout the run has now.

A save goes to ``checkpoints/.tmp_step_.../`` and is renamed when complete, so a crash
mid-save never touches the latest good checkpoint; only the newest ``keep`` are kept.
:func:`save_async` writes the shards in DCP's background thread (``train.async_checkpoint``)
and finishes the same way when waited for.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

from ...parallel.stage_embedding import copy_original_into_copy
from ...plan.layout import Dims
from .paths import (FORMAT_VERSION, CheckpointError, checkpoints_root, prune, read_meta,
                    sha256, step_dir)
from .state import PlacedExperts, build_state, check_compatible, copy_back, copy_local, saved_keys


SINGLE_PROCESS_WARNING = ".*assuming the intent is to.*single process.*"


@contextlib.contextmanager
def quiet():
    """DCP warns that it 'assumes a single process' whenever no process group exists;
    for a single-process run that is exactly the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    out = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointSaveError(CheckpointError):
    """A save that failed on some rank (disk full, no permission): its partial directory
    is gone, the previous checkpoints are untouched; the message names the path and the
    cause. Raised on every rank alike."""


def _os_cause(e: BaseException, where: Path | None = None) -> str:
    """Why a write failed: the first OSError inside ``e`` (DCP wraps per-rank failures) as
    'strerror (file)'; else, when the file system of ``where`` is (nearly) full, that (the
    zip writer of torch.save reports a full disk as a RuntimeError); else ``e`` itself."""
    full = _disk_full(where)
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if id(x) in seen or x is None:
            continue
        seen.add(id(x))
        if isinstance(x, OSError):
            where = f" ({x.filename})" if getattr(x, "filename", None) else ""
            return f"{x.strerror or x}{where}"
        todo += [x.__cause__, x.__context__] + [v for v in getattr(x, "args", ())
                                                 if isinstance(v, BaseException)]
        failures = getattr(x, "failures", None)  # DCP's CheckpointException: {rank: error}
        if isinstance(failures, dict):
            todo += [v[0] if isinstance(v, tuple) else v for v in failures.values()]
    if full:
        return full
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _disk_full(where: Path | None) -> str | None:
    """'No space left on device (N bytes free on PATH)' when the file system holding
    ``where`` has under 1 MiB or 0.1% free, else None."""
    if where is None:
        return None
    probe = Path(where)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        usage = shutil.disk_usage(probe)
    except OSError:
        return None
    if usage.free < max(1 << 20, usage.total // 1000):
        return f"No space left on device ({usage.free:,} bytes free on {probe})"
    return None


def _agree(failed: str | None) -> str | None:
    """Every rank's failure message, or None when no rank failed (one collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return failed
    msgs: list = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, failed)
    bad = [(r, m) for r, m in enumerate(msgs) if m is not None]
    return "; ".join(f"rank {r}: {m}" for r, m in bad) if bad else None


def save(run_dir: str | Path, step: int, model: nn.Module, opt, dims: Dims, meta: dict,
         keep: int = 2, extra_files: dict[str, Any] | None = None,
         verified: set[Path] | None = None, report=print) -> Path:
    """Collective: every rank calls it. Writes ``step_{step:08d}`` atomically (temporary
    directory, then rename) and keeps the newest ``keep`` checkpoints that verify
    (:func:`~epscale.training.checkpoint.paths.prune`; ``verified`` remembers which were
    checked already). ``extra_files``: {file name: object} that rank 0 writes with
    ``torch.save`` beside the shards (listed and hashed in meta.json like them; read back
    with :func:`load_extra`).

    A failure to write (disk full, no permission, a missing directory) on any rank removes
    the partial directory and raises :class:`CheckpointSaveError` on every rank; the
    previous checkpoints stay as they were."""
    return save_async(run_dir, step, model, opt, dims, meta, keep=keep, extra_files=extra_files,
                      verified=verified, report=report, background=False).wait()


class PendingSave:
    """A save whose shards are being written (by DCP's background thread when started
    with ``background``); :meth:`wait` (collective) finishes it: meta.json, the rename
    to ``step_N``, pruning. Until then the directory is ``.tmp_step_N`` and the previous
    checkpoints are untouched; a process killed before the rename leaves only that."""

    def __init__(self, run_dir: Path, step: int, dims: Dims, meta: dict, keep: int,
                 verified: set[Path] | None, report, future=None, failed: str | None = None):
        self.run_dir, self.step, self.dims, self.meta = run_dir, step, dims, meta
        self.keep, self.verified, self.report = keep, verified, report
        self.future, self.failed = future, failed
        self.final = step_dir(run_dir, step)
        self.tmp = checkpoints_root(run_dir) / f".tmp_{self.final.name}"
        self.started = time.perf_counter()

    @property
    def in_background(self) -> bool:
        return self.future is not None

    def wait(self) -> Path:
        """Collective: block until every rank's shards are written, then finish the save;
        the checkpoint's path, or :class:`CheckpointSaveError` on every rank."""
        rank, failed = _rank(), self.failed
        if self.future is not None and failed is None:
            try:
                with quiet():
                    self.future.result()
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException
                failed = _os_cause(e, self.tmp)
        failed = _agree(failed)
        if failed is None and rank == 0:
            try:
                self._commit()
            except OSError as e:
                failed = _os_cause(e, self.tmp)
        failed = _agree(failed)
        if failed is not None:
            if rank == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)
            _barrier()
            raise CheckpointSaveError(f"checkpoint '{self.final}' could not be saved: {failed}; "
                                      "its partial files were removed, the previous checkpoints "
                                      "are intact")
        if rank == 0:
            if self.verified is not None:
                self.verified.add(self.final)  # hashed just now
            prune(self.run_dir, self.keep, self.verified, self.report)
        _barrier()
        return self.final

    def _commit(self) -> None:
        """Rank 0: hash the files into meta.json, then rename the directory into place."""
        files = {}
        for f in sorted(self.tmp.iterdir()):
            if f.is_file():
                files[f.name] = {"size": f.stat().st_size, "sha256": sha256(f)}
        full_meta = {"format": FORMAT_VERSION, "step": self.step, "time": time.time(),
                     "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                     "pp": getattr(self.dims, "pp", 1), "dp": self.dims.dp, "ep": self.dims.ep,
                     **self.meta, "files": files}
        with open(self.tmp / "meta.json", "w") as f:
            json.dump(full_meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if self.final.exists():  # re-saving a step (after a rollback): replace it
            shutil.rmtree(self.final)
        os.replace(self.tmp, self.final)


def staging_options(device: torch.device) -> StagingOptions | None:
    """How a background save copies the state off ``device`` before training goes on.

    CUDA: into pinned CPU memory (the copies run at full PCIe speed without blocking the
    host on each tensor; one synchronisation when all are queued), kept and reused by the
    next save (no fresh pinned allocation, which is slow, per save); staged before the
    save returns, so training never overwrites what is being written; no shared memory
    (the writer is a thread of this process). None elsewhere: DCP's default (a plain CPU
    copy made fresh each save), all a CPU tensor needs."""
    if device.type != "cuda":
        return None
    return StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                          use_async_staging=False, use_non_blocking_copy=True)


def background_stager(device: torch.device) -> AsyncStager | None:
    """The stager of a process's background saves on ``device`` (see
    :func:`staging_options`), or None for DCP's default. Keep one per process and hand it
    to every :func:`save_async`: it holds the staging buffers between saves; a save
    reuses them only after the previous one finished (the trainer waits for it before
    staging the next). ``close()`` it at the end."""
    options = staging_options(device)
    return DefaultStager(options) if options is not None else None


def save_async(run_dir: str | Path, step: int, model: nn.Module, opt, dims: Dims, meta: dict,
               keep: int = 2, extra_files: dict[str, Any] | None = None,
               verified: set[Path] | None = None, report=print, background: bool = True,
               process_group=None, stager: AsyncStager | None = None) -> PendingSave:
    """Collective: start saving ``step`` (see :func:`save`). ``background``: the state is
    copied to CPU memory here (by ``stager``, see :func:`background_stager`; None: DCP's
    default copy) and the shards are written by DCP's background thread while training
    goes on (its collectives on ``process_group``: a group only checkpointing uses, so
    they never interleave with training's); otherwise they are written before this
    returns. Either way the save ends with :meth:`PendingSave.wait`."""
    run_dir = Path(run_dir)
    pending = PendingSave(run_dir, step, dims, meta, keep, verified, report)
    root, tmp, rank = checkpoints_root(run_dir), pending.tmp, _rank()
    failed = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".tmp_step_*"):   # left by a process killed mid-save
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            failed = _os_cause(e, root)
    failed = _agree(failed)
    if failed is None:
        state = build_state(model, opt, dims, PlacedExperts(model, opt, dims).for_save())
        try:
            with quiet():
                if not background:
                    dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
                else:
                    if not dist.is_initialized():  # quiet() cannot reach DCP's own thread
                        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
                    pending.future = dcp.async_save(
                        state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized(),
                        process_group=process_group if dist.is_initialized() else None,
                        async_stager=stager)
            torch.save(rng_state(), tmp / f"rank_{rank}.pt")
            if rank == 0:
                for name, obj in (extra_files or {}).items():
                    torch.save(obj, tmp / name)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            failed = _os_cause(e, tmp)
    pending.failed = failed
    return pending


def load(path: Path, model: nn.Module, opt, dims: Dims, restore_rng: bool = True) -> dict:
    """Collective. Loads model (and optimizer state when ``opt`` is given and the
    checkpoint has it) into the live tensors, resharding as needed; returns meta.json."""
    meta = read_meta(path)
    placed = PlacedExperts(model, opt, dims).for_load()
    state = build_state(model, opt, dims, placed, load=True)
    check_compatible(path, state)
    if opt is not None and not any(k.startswith("optim.") for k in saved_keys(path)):
        del state["optim"]  # model-only checkpoint (epscale checkpoint import): fresh AdamW
    try:
        with quiet():
            dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except Exception as e:  # DCP wraps per-rank failures; name the checkpoint
        raise CheckpointError(f"checkpoint '{path}' could not be loaded: {e}") from e
    for name, entry in placed.views.items():  # the logical buffers DCP filled (or not)
        copy_local(entry["param"], state["model"][name])
        if "optim" in state and name in state["optim"]:
            for k in ("exp_avg", "exp_avg_sq"):
                copy_local(entry[k], state["optim"][name][k])
    placed.scatter()
    copy_back(model, opt, state, skip=set(placed.views))
    copy_original_into_copy(model, opt if "optim" in state else None)
    if restore_rng:
        saved_world = int(meta.get("world_size", 1))
        f = path / f"rank_{_rank() % max(1, saved_world)}.pt"
        if f.is_file():
            set_rng_state(torch.load(f, weights_only=True))
    return meta


def load_extra(path: Path, name: str) -> Any:
    """An ``extra_files`` entry of a checkpoint (None when it was not written)."""
    f = Path(path) / name
    if not f.is_file():
        return None
    try:
        return torch.load(f, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint '{path}': '{name}' could not be read: {e}") from e
