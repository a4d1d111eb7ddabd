"""``epscale launch --nproc N CONFIG [key=value ...]``: train on one machine through torchrun.

The command runs ``python -m epscale.launch.agent`` (torchrun that forwards SIGUSR1, see
:mod:`epscale.launch.agent`) with a standalone c10d rendezvous on a free local port and
``--max-restarts``: when a rank dies (a crash, an OOM kill, SIGKILL) torchrun stops the
others, starts the whole group again and the trainer resumes from the latest complete
checkpoint in the run directory.

With ``--nnodes MIN:MAX`` and ``--rdzv-endpoint`` the job is elastic (one such launch per
node, all naming the same endpoint and run directory): a node that is lost and not back
within ``--rejoin-timeout`` leaves the survivors to restart at the smaller world, a node
that joins makes every node restart at the larger one, and the trainer keeps the global
batch (``train.global_batch_size``, set here from the largest layout) by changing
``grad_accum`` (:mod:`epscale.training.elastic`).
"""

from __future__ import annotations

import socket
import sys
from dataclasses import replace

from ..config import ConfigError, RunConfig, recipe_path


def _positive(key: str, value: int, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if not isinstance(value, int) or value < low:
        raise ConfigError(f"{key} = {value!r} is invalid: must be an integer >= {low}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a local rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_args(config: str, run_dir: str | None = None,
               overrides: list[str] | None = None) -> list[str]:
    """Arguments after ``python -m epscale`` that start the trainer in one process."""
    args = ["train", "--config", str(config)]
    if run_dir:
        args += ["--run-dir", str(run_dir)]
    return args + list(overrides or [])


# Set for the workers of an elastic job (``--nnodes MIN:MAX``): ranks past the largest world
# the config can train at stand by instead of failing (epscale.training.elastic).
ELASTIC_ENV = "EPSCALE_ELASTIC"


def parse_nnodes(text: str | int) -> tuple[int, int]:
    """``--nnodes`` as (min, max): '4' -> (4, 4), '2:4' -> (2, 4); ConfigError otherwise."""
    parts = str(text).split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if not 1 <= lo <= hi:
        raise ConfigError(f"--nnodes = {text!r} is invalid: give a node count N or a range "
                          "MIN:MAX with 1 <= MIN <= MAX (e.g. 2:4: train on 2 to 4 nodes)")
    return lo, hi


def pin_global_batch(cfg: RunConfig, max_world: int) -> tuple[RunConfig, list[str]]:
    """For an elastic launch: ``cfg`` with ``train.global_batch_size`` fixed at the
    largest layout's batch (its data-parallel ranks, ``max_world`` / parallel.pp, x
    grad_accum x micro_batch_size: pipeline stages share their micro-batches) unless it is
    set already, and the overrides that say so to every attempt's trainer."""
    t = cfg.train
    if t.global_batch_size is not None:
        return cfg, []
    g = max(1, max_world // cfg.parallel.pp) * t.grad_accum * t.micro_batch_size
    return (replace(cfg, train=replace(t, global_batch_size=g, grad_accum=1)),
            ["train.grad_accum=1", f"train.global_batch_size={g}"])


def torchrun_args(*, nproc_per_node: int, max_restarts: int = 0, nnodes: int | str = 1,
                  rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                  log_dir: str | None = None, monitor_interval: float = 1.0,
                  rejoin_timeout_s: float | None = None,
                  join_timeout_s: float | None = None,
                  node_timeout_s: float | None = None) -> list[str]:
    """torchrun options. Without ``rdzv_endpoint`` the rendezvous is standalone (this
    machine, a free port); with it, a c10d rendezvous hosted at that ``host:port``.

    nproc_per_node: worker processes per node (one per GPU, or CPU processes).
    max_restarts: how often torchrun restarts the whole group after a worker fails.
    nnodes: a count, or 'MIN:MAX' for an elastic job (torchrun's elastic rendezvous).
    rejoin_timeout_s: once MIN nodes are in a rendezvous, how long it waits for more
        (torchrun's ``last_call_timeout``): a lost node that returns within it is part of
        the next layout, else the survivors go on without it.
    join_timeout_s: how long a rendezvous waits for MIN nodes at all (``join_timeout``).
    node_timeout_s: a node whose rendezvous heartbeat is this old is taken as gone
        (torchrun's keep-alive: an interval of a third of it, three misses; default 15 s).
    """
    _positive("--nproc", nproc_per_node)
    _positive("--max-restarts", max_restarts, allow_zero=True)
    parse_nnodes(nnodes)
    args = [f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}",
            f"--monitor-interval={monitor_interval}"]
    if rdzv_endpoint is None:
        args += ["--standalone", f"--nnodes={nnodes}"]
    else:
        args += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                 f"--rdzv-id={rdzv_id or 'epscale'}"]
        conf = {"last_call_timeout": rejoin_timeout_s, "join_timeout": join_timeout_s}
        if node_timeout_s is not None:
            conf.update(keep_alive_interval=max(1, round(node_timeout_s / 3)),
                        keep_alive_max_attempt=3)
        conf_text = ",".join(f"{k}={v:g}" for k, v in conf.items() if v is not None)
        if conf_text:
            args += [f"--rdzv-conf={conf_text}"]
    if log_dir:
        args += [f"--log-dir={log_dir}"]
    return args


def launch_command(config: str, *, nproc: int, max_restarts: int = 0,
                   run_dir: str | None = None, overrides: list[str] | None = None,
                   log_dir: str | None = None, python: str | None = None,
                   **rendezvous) -> list[str]:
    """The full command ``epscale launch`` runs (a list for ``subprocess``); ``rendezvous``
    (nnodes, rdzv_endpoint, rdzv_id, rejoin_timeout_s, join_timeout_s, node_timeout_s) goes to
    :func:`torchrun_args`."""
    config = str(recipe_path(config))
    return [python or sys.executable, "-m", "epscale.launch.agent",
            *torchrun_args(nproc_per_node=nproc, max_restarts=max_restarts, log_dir=log_dir,
                           **rendezvous),
            "-m", "epscale", *train_args(config, run_dir, overrides)]
