"""``epscale launch --nproc N CONFIG [key=value ...]``: train on one machine through torchrun.

The command runs ``python -m epscale.launch.agent`` (torchrun that forwards SIGUSR1, see
:mod:`epscale.launch.agent`) with a standalone c10d rendezvous on a free local port and
``--max-restarts``: when a rank dies (a crash, an OOM kill, SIGKILL) torchrun stops the
others, starts the whole group again and the trainer resumes from the latest complete
checkpoint in the run directory.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from ..config import ConfigError


def _positive(key: str, value: int, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if not isinstance(value, int) or value < low:
        raise ConfigError(f"{key} = {value!r} is invalid: must be an integer >= {low}")


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
    if not Path(config).is_file():
        raise ConfigError(f"config file '{config}' does not exist")
    return [python or sys.executable, "-m", "epscale.launch.agent",
            *torchrun_args(nproc_per_node=nproc, max_restarts=max_restarts, log_dir=log_dir),
            "-m", "epscale", *train_args(config, run_dir, overrides)]


def allow_intermixed(p) -> None:
    """Let ``key=value`` overrides come after options (``CONFIG --nproc 2 train.steps=9``):
    plain argparse stops collecting a positional list at the first option."""
    plain = p.parse_known_args

    def parse_known(args=None, namespace=None):
        del p.parse_known_args  # the intermixed parser calls the plain one twice inside
        try:
            return p.parse_known_intermixed_args(args, namespace)
        finally:
            p.parse_known_args = parse_known

    assert plain  # the class method, found again once the instance attribute is deleted
    p.parse_known_args = parse_known


def configure_parser(p) -> None:
    allow_intermixed(p)
    p.add_argument("config", help="recipe YAML, e.g. configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides passed to the trainer, e.g. train.steps=50")
    p.add_argument("--nproc", type=int, default=1,
                   help="processes on this machine (one per GPU, or CPU processes with gloo)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="restarts of the whole group after a rank fails (default 3); each "
                        "restart resumes from the latest checkpoint")
    p.add_argument("--run-dir", default=None,
                   help="run directory (checkpoints, metrics, heartbeats); the trainer's "
                        "default when omitted")
    p.add_argument("--log-dir", default=None,
                   help="torchrun's per-attempt, per-rank log files go here")
    p.add_argument("--dry-run", action="store_true", help="print the command, do not run it")


def run(args) -> int:
    cmd = launch_command(args.config, nproc=args.nproc, max_restarts=args.max_restarts,
                         run_dir=args.run_dir, overrides=args.overrides, log_dir=args.log_dir)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    print(f"epscale launch: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    # exec, not a child: signals sent to this process (Ctrl-C, SIGTERM, SIGUSR1) reach
    # torchrun directly, which stops or forwards them to the workers.
    os.execve(cmd[0], cmd, env)
    return 1  # not reached
