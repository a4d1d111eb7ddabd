"""Process set-up for the trainer: which launcher started us (torchrun, srun, none), the
process group, the device, and the ParallelDims that own the groups of the run's Layout.

torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT; under
``srun`` without torchrun we read SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID and take the
first host of SLURM_JOB_NODELIST as the master when MASTER_ADDR is not set.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import ConfigError
from ..parallel.dims import ParallelDims, SingleProcessDims
from ..plan.layout import Layout


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits. launcher: 'torchrun' (RANK/WORLD_SIZE set), 'srun'
    (Slurm tasks without torchrun) or 'none' (a plain single process)."""

    launcher: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500


def _int_env(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} must be an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list ('node[03-05,7],gpu1' -> 'node03')."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=10, check=True).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    first = re.split(r",(?![^\[]*\])", nodelist)[0]
    m = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", first)
    if not m:
        return first
    prefix, ranges, suffix = m.groups()
    lo = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{lo}{suffix}"


def detect_env() -> LaunchEnv:
    if os.environ.get("RANK") is not None and os.environ.get("WORLD_SIZE") is not None:
        world = _int_env("WORLD_SIZE", 1)
        return LaunchEnv("torchrun", _int_env("RANK", 0), world, _int_env("LOCAL_RANK", 0),
                         _int_env("LOCAL_WORLD_SIZE", world), os.environ.get("MASTER_ADDR", "127.0.0.1"),
                         _int_env("MASTER_PORT", 29500))
    ntasks = _int_env("SLURM_NTASKS", 1)
    if os.environ.get("SLURM_PROCID") is not None and ntasks > 1:
        addr = os.environ.get("MASTER_ADDR") or first_slurm_host(os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        # SLURM_TASKS_PER_NODE looks like '4' or '4(x2)' (4 tasks on each of 2 nodes)
        m = re.match(r"^(\d+)", os.environ.get("SLURM_NTASKS_PER_NODE")
                     or os.environ.get("SLURM_TASKS_PER_NODE") or "")
        per_node = int(m.group(1)) if m else None
        if per_node is None:
            nodes = _int_env("SLURM_NNODES", 1) or 1
            per_node = max(1, ntasks // nodes)
        port = _int_env("MASTER_PORT", 29500 + (_int_env("SLURM_JOB_ID", 0) or 0) % 1000)
        return LaunchEnv("srun", _int_env("SLURM_PROCID", 0), ntasks, _int_env("SLURM_LOCALID", 0),
                         per_node, addr, port)
    return LaunchEnv("none")


def pick_device(env: LaunchEnv) -> torch.device:
    if torch.cuda.is_available():
        dev = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def set_threads(env: LaunchEnv, device: torch.device) -> None:
    """Split the CPU cores between the processes of this node (unless OMP_NUM_THREADS says;
    a single process keeps torch's own setting)."""
    if device.type != "cpu" or os.environ.get("OMP_NUM_THREADS") or env.local_world_size <= 1:
        return
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, env.local_world_size)))


def init_process_group(env: LaunchEnv, device: torch.device, single: bool = False) -> bool:
    """gloo on CPU, NCCL on CUDA; for a single process a no-op, unless ``single`` asks for
    a one-rank group (FSDP needs one even alone; it needs no network). Returns whether it
    created the group (a caller that did not should not destroy it)."""
    if dist.is_initialized() or (env.world_size == 1 and not single):
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    if env.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device if device.type == "cuda" else None)
        return True
    # Under srun these are not set yet; ParallelDims and other code read them.
    for key, value in (("MASTER_ADDR", env.master_addr), ("MASTER_PORT", env.master_port),
                       ("RANK", env.rank), ("WORLD_SIZE", env.world_size),
                       ("LOCAL_RANK", env.local_rank), ("LOCAL_WORLD_SIZE", env.local_world_size)):
        os.environ.setdefault(key, str(value))
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(minutes=10),
                            device_id=device if device.type == "cuda" else None)
    return True


def shutdown(clean: bool = True, destroy: bool = True) -> None:
    """Barrier then destroy (gloo can abort at exit when ranks leave unsynchronised);
    ``clean=False`` (after an error) skips the barrier, which could wait forever;
    ``destroy=False`` leaves a group that someone else created."""
    if dist.is_initialized():
        try:
            if clean:
                dist.barrier()
        finally:
            if destroy:
                dist.destroy_process_group()


def make_dims(layout: Layout) -> ParallelDims | SingleProcessDims:
    """The process groups of ``layout`` (SingleProcessDims for one process without FSDP)."""
    if layout.world == 1 and not layout.fsdp:
        return SingleProcessDims()
    return ParallelDims(layout)
