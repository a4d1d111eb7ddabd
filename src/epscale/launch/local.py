"""``epscale launch --nproc N CONFIG [key=value ...]``: train on one machine through torchrun.

The command runs ``python -m epscale.launch.agent`` (torchrun that forwards SIGUSR1, see
:mod:`epscale.launch.agent`) with a standalone c10d rendezvous on a free local port and
``--max-restarts``: when a rank dies (a crash, an OOM kill, SIGKILL) torchrun stops the
others, starts the whole group again and the trainer resumes from the latest complete
checkpoint in the run directory.
"""

from __future__ import annotations

import socket
import sys

from ..config import ConfigError, recipe_path


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


def torchrun_args(*, nproc_per_node: int, max_restarts: int = 0, nnodes: int | str = 1,
                  rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                  log_dir: str | None = None, monitor_interval: float = 1.0) -> list[str]:
    """torchrun options. Without ``rdzv_endpoint`` the rendezvous is standalone (this
    machine, a free port); with it, a c10d rendezvous hosted at that ``host:port``.

    nproc_per_node: worker processes per node (one per GPU, or CPU processes).
    max_restarts: how often torchrun restarts the whole group after a worker fails.
    """
    _positive("--nproc", nproc_per_node)
    _positive("--max-restarts", max_restarts, allow_zero=True)
    args = [f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}",
            f"--monitor-interval={monitor_interval}"]
    if rdzv_endpoint is None:
        args += ["--standalone", f"--nnodes={nnodes}"]
    else:
        args += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                 f"--rdzv-id={rdzv_id or 'epscale'}"]
    if log_dir:
        args += [f"--log-dir={log_dir}"]
    return args


def launch_command(config: str, *, nproc: int, max_restarts: int = 0,
                   run_dir: str | None = None, overrides: list[str] | None = None,
                   log_dir: str | None = None, python: str | None = None) -> list[str]:
    """The full command ``epscale launch`` runs (a list for ``subprocess``)."""
    config = str(recipe_path(config))
    return [python or sys.executable, "-m", "epscale.launch.agent",
            *torchrun_args(nproc_per_node=nproc, max_restarts=max_restarts, log_dir=log_dir),
            "-m", "epscale", *train_args(config, run_dir, overrides)]
