"""``epscale launch --nproc N CONFIG [key=value ...]``: train on this machine through
torchrun, restarting the group after a rank dies (see :mod:`epscale.launch.local`)."""

from __future__ import annotations

import os
import shlex
import sys

from ..launch.local import launch_command
from .args import allow_intermixed


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
