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

from ..config import ConfigError, load_config, recipe_path
from ..launch.local import ELASTIC_ENV, launch_command, parse_nnodes, pin_global_batch
from ..training.elastic import check_elastic
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
    p.add_argument("--nnodes", default="1",
                   help="nodes of the job: N, or MIN:MAX for an elastic job (one 'epscale "
                        "launch' per node, the same --rdzv-endpoint and --run-dir on each): "
                        "a lost node leaves the others to restart at the smaller layout, a "
                        "returning one grows it back; the global batch is kept")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="the rendezvous of a multi-node or elastic job (hosted by the node "
                        "whose address it is); default: a standalone one on this machine")
    p.add_argument("--rdzv-id", default="epscale",
                   help="the job's name at the rendezvous (the same on every node)")
    p.add_argument("--rejoin-timeout", type=float, default=None, metavar="SECONDS",
                   help="elastic: once MIN nodes are back in the rendezvous, wait this long "
                        "for the others before going on without them (torchrun's "
                        "last_call_timeout; default 30)")
    p.add_argument("--join-timeout", type=float, default=None, metavar="SECONDS",
                   help="elastic: how long to wait for MIN nodes at all (default 600)")
    p.add_argument("--node-timeout", type=float, default=None, metavar="SECONDS",
                   help="elastic: a node silent at the rendezvous this long is taken as lost "
                        "(default 15)")
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
    lo, hi = parse_nnodes(args.nnodes)
    multi = hi > 1 or args.rdzv_endpoint is not None
    if multi and (args.rdzv_endpoint is None or args.run_dir is None):
        raise ConfigError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT and "
                          "--run-dir (shared by every node, so that they meet and resume "
                          "the same checkpoints)")
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
    overrides = list(args.overrides)
    if lo < hi:
        cfg, pinned = pin_global_batch(cfg, hi * args.nproc)
        overrides += pinned
    cmd = launch_command(args.config, nproc=args.nproc, max_restarts=args.max_restarts,
                         run_dir=str(run_dir), overrides=overrides, log_dir=args.log_dir,
                         nnodes=args.nnodes if multi else 1, rdzv_endpoint=args.rdzv_endpoint,
                         rdzv_id=args.rdzv_id, rejoin_timeout_s=args.rejoin_timeout,
                         join_timeout_s=args.join_timeout, node_timeout_s=args.node_timeout)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    if not os.environ.get(CHECKED_ENV):  # set: a launcher around this one ran the checks
        # elastic: checked at the largest node count that trains (the others are listed)
        nodes = max(check_elastic(cfg, lo, hi, args.nproc)) if lo < hi else hi
        check_run(cfg, run_dir, nodes * args.nproc)
    print(f"epscale launch: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    env = dict(os.environ, **{CHECKED_ENV: "1"})  # the workers need not check again
    if lo < hi:
        env[ELASTIC_ENV] = "1"  # ranks past the usable world stand by
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    # exec, not a child: signals sent to this process (Ctrl-C, SIGTERM, SIGUSR1) reach
    # torchrun directly, which stops or forwards them to the workers.
    os.execve(cmd[0], cmd, env)
    return 1  # not reached
