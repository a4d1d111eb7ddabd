"""``epscale launch --nproc N CONFIG [key=value ...]``: train on this machine through
torchrun, restarting the group after a rank dies (see :mod:`epscale.launch.local`).

Before torchrun starts, the command runs the checks ``epscale train`` runs (the config, the
layout, the data, the run directory, a checkpoint to resume against the model): a mistake
is one message and exit status 2, not one per rank and restart. The workers are told the
checks passed (:data:`~epscale.training.prelaunch.CHECKED_ENV`); an error only they can see
makes them exit 2, and the agent then stops instead of restarting (:mod:`epscale.launch.agent`).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from ..config import load_config, recipe_path
from ..launch.local import launch_command
from ..training.prelaunch import CHECKED_ENV, check_run
from .args import allow_intermixed
from .train import default_run_dir


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
                   help="run directory (checkpoints, metrics, heartbeats); default "
                        "runs/NAME-YYYYmmdd-HHMMSS, chosen once so that restarts resume")
    p.add_argument("--log-dir", default=None,
                   help="torchrun's per-attempt, per-rank log files go here")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config and print the command, do not run it (the data, "
                        "run directory and checkpoint are checked only by a real launch)")


def run(args) -> int:
    cfg = load_config(recipe_path(args.config), args.overrides)  # a typo: one message, exit 2
    # Fixed here once, so that every rank and every restart use the same directory (the
    # trainer's own default has the start time in its name) and a restart resumes.
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
    cmd = launch_command(args.config, nproc=args.nproc, max_restarts=args.max_restarts,
                         run_dir=str(run_dir), overrides=args.overrides, log_dir=args.log_dir)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    if not os.environ.get(CHECKED_ENV):  # set: a launcher around this one ran the checks
        check_run(cfg, run_dir, args.nproc)
    print(f"epscale launch: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    env = dict(os.environ, **{CHECKED_ENV: "1"})  # the workers need not check again
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    # exec, not a child: signals sent to this process (Ctrl-C, SIGTERM, SIGUSR1) reach
    # torchrun directly, which stops or forwards them to the workers.
    os.execve(cmd[0], cmd, env)
    return 1  # not reached
