"""``epscale train``: train an MoE transformer on one or many processes.

    epscale train --config configs/tiny.yaml [--nproc N] [--run-dir DIR] [key=value ...]

Without an outside launcher, ``--nproc N`` (default: parallel.dp x parallel.ep) starts N
local processes through torchrun (gloo on CPU, NCCL on CUDA). Under torchrun or srun the
command runs as one rank of the job. A run directory that already holds a checkpoint is
resumed from its newest complete one. SIGTERM/SIGUSR1 (or ``touch RUN_DIR/STOP``) stop
after the current step with a checkpoint and exit status 0.

The training loop itself is :mod:`epscale.training.loop`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..config import ConfigError, RunConfig, load_config, recipe_path
from ..training.data import check_source
from ..training.dist import detect_env, resolve_layout
from ..training.loop import STOP_FILE, train


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def configure_parser(p) -> None:
    p.add_argument("--config", help="recipe YAML or recipe name, e.g. tiny (default: "
                   "RUN_DIR/config.yaml when resuming, "
                   "else the built-in defaults)")
    p.add_argument("--nproc", type=int, default=None,
                   help="local processes to start with torchrun (default parallel.dp x "
                        "parallel.ep); ignored under an outside torchrun/srun")
    p.add_argument("--run-dir", default=None,
                   help="run directory (default runs/NAME-YYYYmmdd-HHMMSS); resumed when it "
                        "holds a checkpoint")
    p.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                   help="stop after STEP as if signalled (checkpoint, exit 0)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted config overrides, e.g. train.steps=50 moe.top_k=2 parallel.ep=2")


def resolve_config(args) -> RunConfig:
    path = args.config
    if path is None and args.run_dir and (Path(args.run_dir) / "config.yaml").is_file():
        path = Path(args.run_dir) / "config.yaml"
    return load_config(recipe_path(path) if path is not None else None, args.overrides)


def default_run_dir(cfg: RunConfig) -> Path:
    return Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def run(args) -> int:
    cfg = resolve_config(args)
    check_source(cfg.data)
    env = detect_env()
    if env.launcher == "none":
        nproc = args.nproc if args.nproc is not None else cfg.parallel.dp * cfg.parallel.ep
        if nproc < 1:
            raise ConfigError(f"--nproc {nproc} is invalid: must be >= 1")
        resolve_layout(cfg.parallel, nproc, cfg.moe.num_experts)  # fail before launching
        run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
        if nproc > 1:
            return launch_local(args, nproc, run_dir)
    else:
        run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
    result = train(cfg, run_dir, env, stop_at=args.stop_at)
    return 0 if result is not None else 1


def _die_with_parent() -> None:
    """In the torchrun child (Linux): get SIGTERM when this launcher dies, so its workers
    never outlive it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def launch_local(args, nproc: int, run_dir: Path) -> int:
    """Run this same command as ``nproc`` torchrun workers. SIGINT/SIGTERM/SIGUSR1 here
    become a graceful stop there (the RUN_DIR/STOP file); a second one kills them."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "epscale", "train", "--run-dir", str(run_dir)]
    if args.config:
        cmd += ["--config", str(args.config)]
    if args.stop_at is not None:
        cmd += ["--stop-at", str(args.stop_at)]
    cmd += list(args.overrides)
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / STOP_FILE).unlink(missing_ok=True)  # a stale one would stop the new run
    # Own session: a terminal's Ctrl-C reaches only us (and becomes a graceful stop).
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    signals = {"count": 0}

    def forward(signum, _frame):
        signals["count"] += 1
        if signals["count"] == 1:
            (run_dir / STOP_FILE).touch()
            print(f"\nepscale train: stopping after the current step (signal {signum}); "
                  "send it again to kill the workers", file=sys.stderr)
        else:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        return proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
