"""Run a function on N real gloo processes and collect what each rank returns.

Usage (the worker must be a module-level function: it is pickled)::

    from dist_utils import run_distributed, CaseRunner

    def _worker(rank, world_size, cases):
        runner = CaseRunner(rank)
        for case in cases:
            with runner.case(case):          # an exception fails this case, not the process
                ...collectives and asserts...
        return runner.failures               # returned to the parent, rank by rank

    def test_something():
        results = run_distributed(_worker, 2, args=(cases,))
        assert_no_failures(results)

One process group per world size, many cases inside it: starting ranks costs seconds, a
case milliseconds. Keep the collectives of every case identical on all ranks (assert after
them), or a failing rank leaves the others waiting until ``timeout``.

Ranks are forked from a fork server (multiprocessing's ``forkserver``: one per pytest
process, started at its first use) that has imported torch and epscale once: a rank then
starts in well under a second, where a freshly spawned interpreter imports them again
(seconds of CPU per rank; four ranks took 20 to 40 s on the busy 2-core machine, a fork
server's 0.3 to 0.5 s after its first start). The server only imports (no threads, no
process group), so a rank forked from it starts as clean as a spawned one; it gets the
caller's environment and working directory, as a spawned rank does.
``EPSCALE_TEST_START=spawn`` spawns instead.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import socket
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class DistributedTestError(AssertionError):
    """A worker raised, died or timed out; the message holds every rank's story."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# imported once, in the fork server; what a worker imports beyond these it imports itself
_PRELOAD = ["torch", "torch.distributed", "epscale", "epscale.training.loop"]


def _context():
    method = os.environ.get("EPSCALE_TEST_START", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)   # read when the server starts
    return ctx


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, env: dict,
           timeout_s: float, results, environ: dict, cwd: str) -> None:
    # the caller's environment and directory now (a forked rank has the fork server's)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), **env})
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        out = fn(rank, world_size, *args)
        dist.barrier()  # gloo can abort at exit if a peer is still mid-collective
        dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_distributed(fn: Callable[..., Any], world_size: int, args: tuple = (),
                    env: dict[str, str] | None = None, timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new gloo processes.

    Returns the list of per-rank return values (must be picklable). Raises
    DistributedTestError naming each failing rank with its traceback, or a timeout.
    ``env`` adds environment variables in the workers (e.g. LOCAL_WORLD_SIZE).
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, env or {},
                                                timeout_s, results, dict(os.environ),
                                                os.getcwd()), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s + 30
    try:
        while len(got) < world_size:
            try:
                rank, status, payload = results.get(timeout=1.0)
                got[rank] = (status, payload)
                if status == "error":
                    # Peers may be stuck in a collective with the failed rank: give them a
                    # moment to fail too, then stop waiting.
                    deadline = min(deadline, time.monotonic() + 10)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in got]
                if dead or time.monotonic() > deadline:
                    break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f"rank {r}: {payload}" for r, (status, payload) in sorted(got.items())
              if status == "error"]
    missing = [r for r in range(world_size) if r not in got]
    if errors or missing:
        parts = errors + [f"rank {r}: no result (exit code {procs[r].exitcode}; hung or crashed)"
                          for r in missing]
        raise DistributedTestError(f"{len(parts)} of {world_size} ranks failed:\n" + "\n".join(parts))
    return [got[r][1] for r in range(world_size)]


class CaseRunner:
    """Collects per-case failures inside a worker so one bad case does not hide the rest."""

    def __init__(self, rank: int):
        self.rank = rank
        self.failures: list[str] = []
        self.num_cases = 0

    @contextlib.contextmanager
    def case(self, name: Any):
        self.num_cases += 1
        try:
            yield
        except Exception as e:  # noqa: BLE001 - recorded and reported by the parent
            tb = traceback.format_exc(limit=4)
            self.failures.append(f"[rank {self.rank}] case {name}: {type(e).__name__}: {e}\n{tb}")


def assert_no_failures(results: list[Any], min_cases: int = 1) -> None:
    """``results`` from workers that returned ``(failures, num_cases)`` or a failures list."""
    failures, counts = [], []
    for r in results:
        if isinstance(r, tuple):
            failures += r[0]
            counts.append(r[1])
        else:
            failures += r
    assert not failures, f"{len(failures)} failing case(s):\n" + "\n".join(failures[:20])
    assert all(c >= min_cases for c in counts), f"too few cases ran: {counts}"


# --------------------------------------------------------------------------------------
# Parallelized vs unparallelized: the check every EP test makes
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def backward_on_its_own_thread():
    """torch.autograd.backward (Tensor.backward's too; torch's pipeline stages call it)
    runs the backward on a new thread while the caller waits: on the CPU, what the autograd
    engine does on CUDA, whose device thread runs a backward's nodes."""
    original = torch.autograd.backward

    def on_thread(*args, **kwargs):
        errors = []

        def run():
            try:
                original(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - raised on the caller
                errors.append(e)

        engine = threading.Thread(target=run, name="emulated-device-thread")
        engine.start()
        engine.join()
        if errors:
            raise errors[0]

    torch.autograd.backward = on_thread
    try:
        yield
    finally:
        torch.autograd.backward = original


def run_trainer(cfg, run_dir, world: int, stop_at: int | None = None, inspect=None,
                final_checkpoint: bool = True) -> list[dict]:
    """Train ``cfg`` in ``run_dir`` on this process's share of ``world`` (the process
    group exists already when world > 1; the trainer leaves it); the step records.
    ``inspect(trainer)`` runs after set-up. ``final_checkpoint=False`` skips the save the
    trainer makes at its last step, for a case that compares step records only (with
    ``train.ckpt_every: 0`` nothing is saved then; the layout matrix's two spawns took
    45.8 s with the save, 42.6 s without it)."""
    from epscale.training.dist import LaunchEnv
    from epscale.training.loop import Trainer

    env = LaunchEnv("torchrun", world_size=world) if world > 1 else LaunchEnv("none")
    t = Trainer(cfg, run_dir, env, stop_at=stop_at, checked=True)
    clean = False
    try:
        t.setup()
        if not final_checkpoint:
            if cfg.train.ckpt_every:
                raise ValueError("final_checkpoint=False with train.ckpt_every > 0: "
                                 "the checkpoints of the run would be skipped too")
            t.save_checkpoint = lambda blocking=True: None
        if inspect is not None:
            inspect(t)
        records = t.run().records
        clean = True
        return records
    finally:
        t.close(clean)


def _train_worker(rank, world, config, overrides, run_dir, stop_at):
    from pathlib import Path

    from epscale.config import load_config

    return run_trainer(load_config(config, list(overrides)), Path(run_dir), world, stop_at=stop_at)


def train_in_ranks(config, overrides, run_dir, world: int, stop_at: int | None = None,
                   timeout_s: float = 300.0) -> list[dict]:
    """What ``epscale train --config CONFIG --nproc WORLD --run-dir RUN_DIR --stop-at STOP
    OVERRIDES`` trains, in ranks from this process's fork server (the same trainer from
    :class:`Trainer` on, one thread per rank, as a launch with OMP_NUM_THREADS=1): for a
    reference run, where a launch would spend seconds of CPU per process importing torch.
    Rank 0's step records."""
    return run_distributed(_train_worker, world, args=(str(config) if config else None,
                                                       tuple(overrides), str(run_dir), stop_at),
                           timeout_s=timeout_s)[0]


def copy_checkpoint(src_run, step: int, dst_run, rank: int) -> None:
    """Rank 0 copies ``src_run``'s checkpoint of ``step`` into a new run directory; all
    ranks wait for it."""
    import shutil

    from epscale.training import checkpoint as ckpt

    if rank == 0:
        (dst_run / "checkpoints").mkdir(parents=True)
        shutil.copytree(ckpt.step_dir(src_run, step), ckpt.step_dir(dst_run, step))
    if dist.is_initialized():
        dist.barrier()


def make_inputs(world_size: int, tokens_per_rank: list[int], dim: int, dtype: torch.dtype,
                seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's input and upstream gradient, identical on all ranks (seeded)."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(t, dim, generator=g).to(dtype) for t in tokens_per_rank]
    gs = [torch.randn(t, dim, generator=g).to(dtype) for t in tokens_per_rank]
    return xs, gs


def reference_grads(full: torch.nn.Module, xs: list[torch.Tensor], gs: list[torch.Tensor]):
    """Run the unparallelized module on each rank's batch (capacity and aux losses are per
    local batch) and backprop sum_r loss_r, loss_r = <y_r, g_r> + aux_r.

    Returns (outputs per rank, input grads per rank, {param name: grad of the MEAN loss}).
    """
    full.zero_grad(set_to_none=True)
    ys, xgrads, total = [], [], 0
    for x, g in zip(xs, gs):
        x = x.clone().requires_grad_(True)
        y = full(x)
        aux = sum((m.aux_loss for m in full.modules() if hasattr(m, "aux_loss")), torch.zeros(()))
        total = total + (y.float() * g.float()).sum() + aux
        ys.append(y)
        xgrads.append(x)
    total.backward()
    W = len(xs)
    pgrads = {n: (p.grad.float() / W if p.grad is not None else torch.zeros_like(p, dtype=torch.float))
              for n, p in full.named_parameters()}
    return [y.detach() for y in ys], [x.grad for x in xgrads], pgrads


def parallel_step(par: torch.nn.Module, dims, x: torch.Tensor, g: torch.Tensor,
                  forward: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """Forward + backward of this rank's batch on the parallelized module, then the gradient
    sync. Returns (output, input grad)."""
    from epscale.parallel import sync_gradients

    par.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = (forward or par)(x)
    aux = sum((m.aux_loss for m in par.modules() if hasattr(m, "aux_loss")), torch.zeros(()))
    ((y.float() * g.float()).sum() + aux).backward()
    sync_gradients(par, dims)
    return y.detach(), x.grad


def compare_grads(par: torch.nn.Module, ref_pgrads: dict, dims, atol: float, rtol: float) -> None:
    """Parallelized grads equal the reference grads of the mean loss (expert params compared
    on this rank's shard)."""
    from epscale.parallel import is_expert_param

    for name, p in par.named_parameters():
        ref = ref_pgrads[name]
        if is_expert_param(p):
            e = p.shape[0]
            ref = ref[dims.ep_rank * e:(dims.ep_rank + 1) * e]
        assert p.grad is not None, f"no grad for {name}"
        torch.testing.assert_close(p.grad.float(), ref, atol=atol, rtol=rtol,
                                   msg=lambda m: f"grad of {name}: {m}")


def hot_moe(over: dict, hot, layers: int = 1, seed: int = 3, bias: float = 0.5):
    """An unparallelized MoE (``layers`` > 1: an nn.Sequential of them) of dim 32, hidden
    16, whose experts ``hot`` get router bias ``bias`` so routing is skewed toward them."""
    import epscale
    from torch import nn

    torch.manual_seed(seed)
    cfg = epscale.MoEConfig(dim=32, hidden_dim=16, **over)
    mods = []
    for _ in range(layers):
        m = epscale.MoE(cfg)
        for x in hot:
            m.router.expert_bias[x] = bias
        mods.append(m)
    return mods[0] if layers == 1 else nn.Sequential(*mods)
