"""``epscale slurm render|submit CONFIG --nodes N --gpus-per-node G``: an sbatch script that
runs ``srun torchrun`` (see :mod:`epscale.launch.slurm` and docs/slurm.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..launch.slurm import SlurmJob, bad_option, render, submit, write_script
from .args import allow_intermixed


def _add_job_options(p) -> None:
    allow_intermixed(p)
    p.add_argument("config", help="recipe YAML, e.g. configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="trainer config overrides")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, required=True,
                   help="GPUs per node; 0 = CPU mode (gloo, no GPU request)")
    p.add_argument("--procs-per-node", "--ntasks-per-node", type=int, default=None,
                   dest="procs_per_node",
                   help="training processes per node (default: --gpus-per-node, or 1 on CPU)")
    p.add_argument("--cpus-per-node", type=int, default=None,
                   help="CPUs for each node's torchrun task (sbatch --cpus-per-task)")
    p.add_argument("--mem", default=None, help="memory per node, e.g. 0 (all) or 500G")
    p.add_argument("--partition", default=None)
    p.add_argument("--time", default=None, help="time limit, e.g. 2-00:00:00")
    p.add_argument("--exclude", default=None, help="nodes to avoid, e.g. node[03,17]")
    p.add_argument("--account", default=None)
    p.add_argument("--qos", default=None)
    p.add_argument("--exclusive", action=argparse.BooleanOptionalAction, default=None,
                   help="whole nodes (default: yes with GPUs, no in CPU mode)")
    p.add_argument("--job-name", default=None, help="default: epscale-<config name>")
    p.add_argument("--run-dir", default=None, help="default: runs/<job name>")
    p.add_argument("--log-root", default=None,
                   help="Slurm output and per-job log directories (default: RUN_DIR/slurm)")
    p.add_argument("--python", default=sys.executable,
                   help="Python of the environment epscale is installed in (default: this one)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="torchrun restarts after a rank fails, per job attempt (default 3)")
    p.add_argument("--signal-before", type=int, default=300,
                   help="seconds before the time limit to checkpoint and requeue (default 300)")
    p.add_argument("--preflight", action=argparse.BooleanOptionalAction, default=True,
                   help="timed all-reduce/all-to-all check of every rank before training "
                        "(default: on)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="extra environment variable for the job (repeatable)")
    p.add_argument("-o", "--output", default=None,
                   help="script path (default: RUN_DIR/<job name>.sbatch; '-' prints it)")


def configure_parser(p) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    _add_job_options(sub.add_parser("render", help="write the sbatch script"))
    _add_job_options(sub.add_parser("submit", help="write the script, run sbatch, print the "
                                                   "job id"))


def _job_from_args(args) -> SlurmJob:
    return SlurmJob(config=args.config, overrides=args.overrides, nodes=args.nodes,
                    gpus_per_node=args.gpus_per_node, procs_per_node=args.procs_per_node,
                    cpus_per_node=args.cpus_per_node, mem=args.mem, partition=args.partition,
                    time=args.time, exclude=args.exclude, account=args.account, qos=args.qos,
                    exclusive=args.exclusive, job_name=args.job_name, run_dir=args.run_dir,
                    log_root=args.log_root, python=args.python, max_restarts=args.max_restarts,
                    signal_before=args.signal_before, preflight=args.preflight, env=args.env)


def run(args) -> int:
    job = _job_from_args(args)
    if args.output == "-":
        if args.action == "submit":
            raise bad_option("--output", "-", "submit needs a file to pass to sbatch")
        sys.stdout.write(render(job))
        return 0
    path = write_script(job, args.output or Path(job.run_dir) / f"{job.job_name}.sbatch")
    if args.action == "render":
        print(path)
        return 0
    try:
        job_id = submit(path)
    except (RuntimeError, FileNotFoundError) as e:
        print(f"epscale slurm submit: {e}", file=sys.stderr)
        return 1
    print(job_id)
    return 0
