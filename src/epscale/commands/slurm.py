"""``epscale slurm render|submit CONFIG --nodes N --gpus-per-node G``: an sbatch script that
runs ``srun torchrun`` (see :mod:`epscale.launch.slurm` and docs/slurm.md).

Before a script is written, the allocation is checked against the recipe, so a job that
cannot start fails here and not after it has waited in the queue: nodes x procs-per-node
must be a world the layout can use (:class:`~epscale.plan.layout.Layout`: ep divides it and
moe.num_experts, the global batch splits over it),
and with GPUs the estimated memory per rank (``epscale describe``) must fit ``--gpu-mem``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from ..config import ConfigError, RunConfig
from ..launch.local import pin_global_batch
from ..launch.slurm import SlurmJob, bad_option, render, submit, write_script
from ..plan.layout import Layout
from ..plan.memory import estimate
from ..training.elastic import check_elastic
from .args import allow_intermixed, parse_size

DEFAULT_GPU_MEM = "80GiB"  # an H100/A100-80GB

def _add_job_options(p) -> None:
    allow_intermixed(p)
    p.add_argument("config", help="recipe YAML, e.g. configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="trainer config overrides")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--min-nodes", type=int, default=None,
                   help="elastic: when nodes fail, train on with the rest down to this many "
                        "(torchrun --nnodes=MIN:NODES; the job survives a node, --no-kill); "
                        "the global batch is kept by raising grad_accum")
    p.add_argument("--rejoin-timeout", type=int, default=30, metavar="SECONDS",
                   help="elastic: how long the survivors wait for a lost node (default 30)")
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
    p.add_argument("--gpu-mem", default=DEFAULT_GPU_MEM, metavar="SIZE",
                   help="memory of one GPU, e.g. 80GiB or 141GB (default 80GiB); the "
                        "estimated memory per rank must fit it (checked with GPUs only)")
    p.add_argument("--memory-check", action=argparse.BooleanOptionalAction, default=True,
                   help="refuse a job whose estimated memory per rank exceeds --gpu-mem "
                        "(default: on; the estimate shards only the experts, so the large "
                        "recipes need --no-memory-check)")
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
                    signal_before=args.signal_before, preflight=args.preflight, env=args.env,
                    min_nodes=args.min_nodes, rejoin_timeout=args.rejoin_timeout)


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:,.1f} GiB"


def _ranks_text(args, job: SlurmJob) -> str:
    """'--nodes 3 x --gpus-per-node 8 = 24 ranks', naming the option the count came from."""
    if args.procs_per_node is not None:
        per = f"--procs-per-node {job.procs_per_node}"
    elif job.gpus_per_node:
        per = f"--gpus-per-node {job.gpus_per_node}"
    else:
        per = "1 process per node (the CPU-mode default of --procs-per-node)"
    return f"--nodes {job.nodes} x {per} = {job.world_size} ranks"


def _layout_hint(job: SlurmJob, cfg: RunConfig) -> str:
    """What would work when the world does not fit the layout (a multiple of parallel.ep;
    with FSDP of dp_replicate x ep): node counts for this --procs-per-node, the recipe's
    own world, and an ep that fits this world."""
    par, ppn, world = cfg.parallel, job.procs_per_node, job.world_size
    unit = par.dp_replicate * par.ep if par.fsdp else par.ep
    step = unit // math.gcd(unit, ppn)
    if par.fsdp:
        own = par.dp_replicate * par.dp_shard if par.dp_shard else None
        own_txt = (f"; the recipe's parallel.dp_replicate={par.dp_replicate} x "
                   f"parallel.dp_shard={par.dp_shard} is {own} ranks" if own else "")
    else:
        own = par.pp * par.dp * par.ep
        pp_txt = f"parallel.pp={par.pp} x " if par.pp > 1 else ""
        own_txt = (f"; the recipe's {pp_txt}parallel.dp={par.dp} x parallel.ep={par.ep} is "
                   f"{own} ranks")
    if own and own % ppn == 0:
        own_txt += f" = --nodes {own // ppn}"
    per = world // par.dp_replicate if par.fsdp and world % par.dp_replicate == 0 else world
    fit = math.gcd(per, cfg.moe.num_experts)
    ep_txt = (f", or override parallel.ep={fit} (divides {per} and moe.num_experts="
              f"{cfg.moe.num_experts})" if fit > 1 and not par.redundant_experts else "")
    return (f"Use --nodes {step} or a multiple of it ({step} x {ppn} = {step * ppn} ranks"
            f"{own_txt}){ep_txt}.")


def check_layout(args, job: SlurmJob, cfg: RunConfig) -> Layout:
    """The :class:`Layout` of the job's world, or ConfigError naming the options and keys
    (the layout's own message): the trainer would refuse this world at start-up, after the
    job has waited in the queue."""
    try:
        return Layout.from_config(cfg, job.world_size)
    except ConfigError as e:
        par = cfg.parallel
        unit = par.dp_replicate * par.ep if par.fsdp else par.ep
        hint = _layout_hint(job, cfg) if job.world_size % unit else ""
        raise ConfigError(f"{_ranks_text(args, job)} cannot start {cfg.name}: {e}. "
                          f"{hint}".rstrip()) from None


def check_memory(cfg: RunConfig, lay: Layout, gpu_mem: str) -> None:
    """ConfigError when the estimated training memory of one rank at ``lay`` (what
    ``epscale describe --world --ep`` prints; the largest pipeline rank under a pipeline)
    exceeds one GPU's ``gpu_mem``."""
    limit = parse_size("--gpu-mem", gpu_mem)
    world, ep = lay.world, lay.ep
    mem = estimate(cfg, lay)
    if mem.total <= limit:
        return
    parts = ", ".join(f"{k} {_gib(getattr(mem, k))}"
                      for k in ("params", "grads", "optimizer", "unsharded", "activations",
                                "gathered", "comm")
                      if getattr(mem, k))
    par, train = cfg.parallel, cfg.train
    layout = lay.label() + ("; the largest pipeline rank" if lay.pp > 1 else "")
    fixes = []
    if not par.fsdp:
        fixes.append("shard the rest with parallel.fsdp=true")
    if train.activation_checkpointing != "full":
        fixes.append("recompute activations with train.activation_checkpointing=full")
    if ep < cfg.moe.num_experts:
        fixes.append("raise parallel.ep")
    if train.micro_batch_size > 1:
        fixes.append("lower train.micro_batch_size")
    fixes.append("run on more nodes" if par.fsdp else "give the real GPU size with --gpu-mem")
    raise ConfigError(
        f"{cfg.name} needs about {_gib(mem.total)} per rank ({layout}: {parts}; see epscale "
        f"describe {cfg.name} --world {world} --ep {ep}, or --fit {gpu_mem} for layouts that "
        f"fit), more than --gpu-mem {gpu_mem}. To fit: {', '.join(fixes)}; to submit anyway "
        "(you know it fits), add --no-memory-check.")


def check_job(args, job: SlurmJob) -> None:
    """The checks a job must pass before its script is written (see the module docstring);
    prints the layout note (dp derived from the world) to stderr."""
    cfg = job.run_config
    lay = check_layout(args, job, cfg)
    if lay.note:
        print(f"epscale slurm: note: {lay.note}", file=sys.stderr)
    if job.gpus_per_node and args.memory_check:
        check_memory(cfg, lay, args.gpu_mem)
    if job.elastic:  # the node counts it can shrink to; the smallest must fit memory too
        pinned, _ = pin_global_batch(cfg, job.world_size)
        ok = check_elastic(pinned, job.min_nodes, job.nodes, job.procs_per_node,
                           who="epscale slurm")
        if job.gpus_per_node and args.memory_check:
            smallest = min(ok) * job.procs_per_node
            try:
                check_memory(cfg, Layout.from_config(cfg, smallest), args.gpu_mem)
            except ConfigError as e:
                raise ConfigError(f"--min-nodes {job.min_nodes}: at {min(ok)} node(s) {e}") from None


def run(args) -> int:
    job = _job_from_args(args)
    check_job(args, job)
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
