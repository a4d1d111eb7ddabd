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

import contextlib
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

from ..config import ConfigError, RunConfig, load_config, recipe_path
from ..config.io import apply_overrides
from ..config.validate import from_dict, to_dict
from ..launch.agent import kill_tree, parent_death_preexec
from ..launch.agent import main as agent_main
from ..training.dist import detect_env
from ..training.loop import STOP_FILE, train
from ..training.prelaunch import CHECKED_ENV, check_run
from ..training.run_lock import check_unlocked


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
    cfg = load_config(recipe_path(path) if path is not None else None, args.overrides)
    return with_init_from(cfg, args.overrides)


def with_init_from(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """``train.init_from``: the model and moe sections as the Hugging Face config.json
    there maps them, the command line's ``key=value`` overrides applied last (the same on
    every process: config.json is read, not the weights)."""
    if not cfg.train.init_from:
        return cfg
    from ..interop.hf import read_hf

    mapped, _ = read_hf(cfg.train.init_from)
    data = to_dict(cfg)
    for section in ("model", "moe"):
        data[section].update(mapped.data[section])
    return from_dict(RunConfig, apply_overrides(data, list(overrides)))


def import_init_weights(cfg: RunConfig, run_dir: Path, timeout_s: float = 1800.0) -> None:
    """``train.init_from`` into a run directory without a checkpoint: rank 0 (the only
    process, or the launcher of --nproc) writes the Hugging Face weights as step 0; under
    an outside launcher (srun, torchrun) the other ranks wait for it on the shared run
    directory. A run directory with a checkpoint resumes from it as usual."""
    from ..training import checkpoint as ckpt

    if not cfg.train.init_from or ckpt.list_checkpoints(run_dir):
        return
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        from ..interop.hf import read_hf, state_from_hf, write_run

        hf_dir = Path(cfg.train.init_from)
        mapped, _ = read_hf(hf_dir)
        state = state_from_hf(hf_dir, mapped, cfg,
                              lambda m: print(f"epscale train: note: {m}", file=sys.stderr))
        path = write_run(run_dir, cfg, state, hf_dir, {"hf_family": mapped.family,
                                                       "init_from": str(hf_dir)})
        print(f"epscale train: train.init_from: {hf_dir} ({mapped.family}) imported as {path}",
              file=sys.stderr)
        return
    deadline = time.monotonic() + timeout_s
    while not ckpt.list_checkpoints(run_dir):
        if time.monotonic() > deadline:
            raise ConfigError(f"rank {rank}: waited {timeout_s:.0f} s for rank 0 to import "
                              f"train.init_from = '{cfg.train.init_from}' into '{run_dir}' "
                              "(is the run directory on a file system every node shares?)")
        time.sleep(1.0)


@contextlib.contextmanager
def _environ(name: str, value: str):
    """``os.environ[name] = value`` for the duration (what child processes inherit)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def default_run_dir(cfg: RunConfig) -> Path:
    return Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def run(args) -> int:
    cfg = resolve_config(args)
    env = detect_env()
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
    if env.launcher == "none":
        nproc = args.nproc if args.nproc is not None else cfg.parallel.dp * cfg.parallel.ep
        if nproc < 1:
            raise ConfigError(f"--nproc {nproc} is invalid: must be >= 1")
        # Before any process starts or any file is written: one message, exit status 2.
        check_run(cfg, run_dir, nproc)
        check_unlocked(run_dir)  # another trainer's: exit 2 before its STOP file is touched
        import_init_weights(cfg, run_dir)
        if nproc > 1:
            with _environ(CHECKED_ENV, "1"):  # the workers need not check again
                return launch_local(args, nproc, run_dir)
        return 0 if train(cfg, run_dir, env, stop_at=args.stop_at, checked=True) else 1
    import_init_weights(cfg, run_dir)
    result = train(cfg, run_dir, env, stop_at=args.stop_at)
    return 0 if result is not None else 1


def launch_local(args, nproc: int, run_dir: Path) -> int:
    """Run this same command as ``nproc`` torchrun workers (through
    :mod:`epscale.launch.agent`: torchrun whose workers die with it). The first
    SIGINT/SIGTERM/SIGUSR1 here becomes a graceful stop there (the RUN_DIR/STOP file); a
    second SIGINT/SIGTERM kills torchrun and every worker, and the exit status is then
    128 + the signal (130, 143). If this launcher is killed outright, torchrun gets SIGTERM
    (its parent-death signal) and stops the workers itself."""
    argv = ["--standalone", f"--nproc-per-node={nproc}", "-m", "epscale", "train",
            "--run-dir", str(run_dir)]
    if args.config:
        argv += ["--config", str(args.config)]
    if args.stop_at is not None:
        argv += ["--stop-at", str(args.stop_at)]
    argv += list(args.overrides)
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / STOP_FILE).unlink(missing_ok=True)  # a stale one would stop the new run
    pid = _fork_agent(argv, env)
    handler = _StopThenKill(pid, run_dir)
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        _, status = os.waitpid(pid, 0)  # retried after a signal handler runs (PEP 475)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 128 + handler.killed_by if handler.killed_by else os.waitstatus_to_exitcode(status)


def _fork_agent(argv: list[str], env: dict[str, str]) -> int:
    """Start the torchrun agent (:func:`epscale.launch.agent.main` with ``argv``) in a
    forked child, which has torch imported already (a new interpreter would spend seconds
    importing it again before the workers start). The child leads a session of its own
    (a terminal's Ctrl-C reaches only this launcher, which makes it a graceful stop) and
    gets SIGTERM when this process dies. No Python thread runs here at this point (the
    native BLAS/OpenMP pools of numpy and torch may, but the agent does no tensor math),
    so the fork copies no Python-level lock held by another thread."""
    preexec = parent_death_preexec(signal.SIGTERM)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        if preexec is not None:
            preexec()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        agent_main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child must never return into the launcher
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class _StopThenKill:
    """The launcher's signal handler: the first signal asks the workers to stop after the
    current step (touches RUN_DIR/STOP); a second SIGINT/SIGTERM (or SIGUSR1) kills the
    whole tree under torchrun (pid ``root``), whose workers sit in sessions of their own, so
    a process-group kill would miss them. ``killed_by`` is the signal that killed, or 0."""

    def __init__(self, root: int, run_dir: Path):
        self.root, self.run_dir = root, run_dir
        self.count, self.killed_by = 0, 0

    def __call__(self, signum, _frame) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.count == 1:
            (self.run_dir / STOP_FILE).touch()
            print(f"\nepscale train: got {name}; stopping after the current step (a checkpoint "
                  "is written); send it again to kill the workers", file=sys.stderr, flush=True)
        elif not self.killed_by:
            self.killed_by = signum
            print(f"epscale train: got {name} again; killing torchrun and every worker (to "
                  f"resume from the latest checkpoint: --run-dir {self.run_dir})",
                  file=sys.stderr, flush=True)
            left = kill_tree(self.root)
            if left:
                print(f"epscale train: processes {left} did not die within 10 s of SIGKILL "
                      "(stuck in the kernel?); check them with ps", file=sys.stderr, flush=True)
