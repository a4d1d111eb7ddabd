"""A run whose world size changes between attempts: the same global batch at any layout,
and what changed when it did.

An elastic launch (``epscale launch --nnodes MIN:MAX``, torchrun's elastic rendezvous)
restarts the surviving ranks when a node is lost, and all of them again when it returns;
each attempt is a new trainer at a new world size that resumes the newest checkpoint,
which DCP reshards to the new layout. This module holds the two decisions the trainer
makes at such a start:

- :func:`fit_batch`: ``train.global_batch_size`` is kept by deriving ``grad_accum``
  (global / (world x micro_batch_size)); the sampler then hands out the same global
  batches as the larger layout did, in the same micro-batch chunks.
- :func:`layout_change`: the previous attempt's layout (its 'start' event in
  metrics.jsonl, with the host of every rank) against this one: ranks and hosts lost or
  gained, steps lost since the checkpoint, and when the previous layout logged its last
  step (the start of the outage). The trainer writes it as a 'layout_change' event, with
  the time to resume split into outage, checkpoint load and first step.

When the survivors' world does not fit the config but a smaller one of whole nodes does
(3 nodes left where ep needs an even count), :func:`split_standby` trains on the largest
such world and the ranks past it stand by (:func:`stand_by`: no process group, they wait
for the attempt to end or the next restart, which includes them again). Only in an elastic
launch (``EPSCALE_ELASTIC``, set by ``epscale launch --nnodes MIN:MAX`` and the elastic
sbatch script); elsewhere a world that does not fit is an error. When no layout fits at
all, :func:`no_layout_message` says so with the ranks that are missing and the smallest
world the config allows.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..config import ConfigError, RunConfig
from ..launch.local import ELASTIC_ENV
from ..plan.layout import Layout, record_label
from ..plan.memory import memory_per_rank
from ..parallel.dims import ParallelDims, SingleProcessDims
from .dist import LaunchEnv


def fit_batch(cfg: RunConfig, world: int) -> tuple[RunConfig, str | None]:
    """``cfg`` with ``train.grad_accum`` derived from ``train.global_batch_size`` at
    ``world`` processes (unchanged when that is null), and a note saying so. ConfigError
    with the layout's wording (:class:`~epscale.plan.layout.Layout`) when ``cfg`` cannot
    train there: a degree does not fit, the global batch does not split into world x
    micro-batches, or the pipeline schedule cannot run the micro-batches."""
    lay = Layout.from_config(cfg, world)
    if lay.global_batch_size is None:
        return cfg, None
    # copies, not dataclasses.replace: validation would refuse a derived grad_accum
    fitted, fitted.train = copy.copy(cfg), copy.copy(cfg.train)
    fitted.train.grad_accum = lay.micro_batches
    return fitted, lay.batch_note()


STANDBY_RELEASE = "standby_release.json"  # in RUN_DIR/heartbeats: the attempt is over


def usable_world(cfg: RunConfig, world: int, per_node: int) -> int | None:
    """The largest world of whole nodes (multiples of ``per_node``) up to ``world`` at
    which ``cfg`` trains, or None."""
    for w in range(world - world % per_node, 0, -per_node):
        try:
            check_world(cfg, w)
        except ConfigError:
            continue
        return w
    return None


def split_standby(cfg: RunConfig, env: LaunchEnv) -> tuple[LaunchEnv, int, bool]:
    """(the env this process trains in, how many ranks stand by, whether this one does).
    In an elastic launch whose world the config cannot train at, the largest usable world
    of whole nodes (:func:`usable_world`) trains: its ranks get that world size, the ranks
    past it stand by. Otherwise nothing changes (a world no layout fits is then the
    trainer's error, with :func:`no_layout_message`)."""
    if not os.environ.get(ELASTIC_ENV) or env.launcher != "torchrun" or env.world_size < 2:
        return env, 0, False
    try:
        check_world(cfg, env.world_size)
        return env, 0, False
    except ConfigError:
        pass
    used = usable_world(cfg, env.world_size, max(1, env.local_world_size))
    if used is None:
        return env, 0, False
    idle = env.world_size - used
    if env.rank >= used:
        return env, idle, True
    os.environ["WORLD_SIZE"] = str(used)
    return replace(env, world_size=used), idle, False


def attempt_token() -> str:
    """What every worker of one torchrun attempt shares (the rendezvous picks the master
    address and port of each attempt)."""
    return (f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('MASTER_ADDR', '')}:"
            f"{os.environ.get('MASTER_PORT', '')}")


def release_standby(run_dir: Path) -> None:
    """Rank 0, when its attempt ends: the standing-by ranks of this attempt may exit."""
    path = Path(run_dir) / "heartbeats" / STANDBY_RELEASE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"attempt": attempt_token(), "time": time.time()}))
    os.replace(tmp, path)


def why_not(cfg: RunConfig, world: int) -> str:
    """The reason ``cfg`` cannot train at ``world`` processes ('' when it can)."""
    try:
        check_world(cfg, world)
    except ConfigError as e:
        return str(e)
    return ""


def stand_by(run_dir: Path, env: LaunchEnv, used: int, reason: str,
             poll_s: float = 1.0) -> None:
    """A rank past the usable world: say so, then wait (no process group, no memory) until
    rank 0 releases this attempt (its training ended) or torchrun stops this process for
    the next restart, which counts it in again."""
    print(f"epscale train: rank {env.rank} ({socket.gethostname()}) stands by: this config "
          f"trains at {used} of the {env.world_size} processes, the largest world of whole "
          f"nodes it can ({reason}); it joins again at the next restart",
          file=sys.stderr, flush=True)
    path, token = Path(run_dir) / "heartbeats" / STANDBY_RELEASE, attempt_token()
    while True:
        try:
            if json.loads(path.read_text()).get("attempt") == token:
                return
        except (OSError, ValueError):
            pass
        time.sleep(poll_s)


def check_world(cfg: RunConfig, world: int) -> None:
    """ConfigError unless ``cfg`` trains at ``world`` processes: every rule of its
    :class:`~epscale.plan.layout.Layout` (the degrees, the experts, the global batch and
    the pipeline's micro-batches)."""
    Layout.from_config(cfg, world)


def check_memory(cfg: RunConfig, world: int, capacity_bytes: float, what: str) -> None:
    """ConfigError when a rank of ``cfg`` at ``world`` processes needs more than
    ``capacity_bytes`` by the memory model (``epscale describe``); ``what`` names the
    device. A layout an elastic restart shrinks to can need more per rank than the old one."""
    est = memory_per_rank(cfg, world=world)
    if est.total > capacity_bytes:
        gib = 2.0 ** 30
        raise ConfigError(
            f"at {world} processes each rank needs {est.total / gib:.1f} GiB by the memory "
            f"model (weights {est.params / gib:.1f}, gradients {est.grads / gib:.1f}, AdamW "
            f"{est.optimizer / gib:.1f}, activations {est.activations / gib:.1f} GiB; see "
            f"'epscale describe CONFIG --world {world}'), more than the {capacity_bytes / gib:.1f}"
            f" GiB of {what}")


def check_elastic(cfg: RunConfig, min_nodes: int, max_nodes: int, per_node: int,
                  who: str = "epscale launch") -> list[int]:
    """The node counts in ``min_nodes..max_nodes`` at which ``cfg`` trains (each node runs
    ``per_node`` processes), printed on stderr with the reason for the others; ConfigError
    when none is (the launch then checks the run at the largest that trains)."""
    ok, refused = [], []
    for n in range(max_nodes, min_nodes - 1, -1):
        try:
            check_world(cfg, n * per_node)
        except ConfigError as e:
            refused.append(f"{n} node(s): {e}")
            continue
        ok.append(n)
    print(f"{who}: elastic over {min_nodes}..{max_nodes} nodes x {per_node} "
          f"process(es), global batch {cfg.train.global_batch_size} sequences kept; trains at "
          f"{', '.join(map(str, ok)) or 'no'} node(s)", file=sys.stderr, flush=True)
    for line in refused:
        print(f"{who}:   not at {line}", file=sys.stderr, flush=True)
    if not ok:
        raise ConfigError(f"--nnodes {min_nodes}:{max_nodes}: no node count in that range "
                          "can train this config (reasons above)")
    return ok


def valid_worlds(cfg: RunConfig, up_to: int) -> list[int]:
    """The process counts 1..``up_to`` at which ``cfg`` can train (:func:`check_world`)."""
    out = []
    for world in range(1, up_to + 1):
        try:
            check_world(cfg, world)
        except ConfigError:
            continue
        out.append(world)
    return out


def no_layout_message(cfg: RunConfig, world: int, reason: str,
                      previous: dict[str, Any] | None, hosts: list[str]) -> str:
    """The error of a start at ``world`` processes that no layout fits: ``reason`` (the
    layout's own error), which ranks and hosts of the previous attempt are missing, and
    the smallest world (and the next larger ones up to the previous size) the config allows."""
    lines = [f"no valid layout for the {world} process(es) of this attempt: {reason}"]
    old = int(previous.get("world_size", 0)) if previous else 0
    if old > world:
        lost = lost_hosts(previous.get("hosts") or [], hosts)
        where = f" (hosts: {', '.join(f'{h} x{n}' for h, n in lost.items())})" if lost else ""
        lines.append(f"missing: {old - world} of the {old} ranks of the previous layout "
                     f"({layout_text(previous)}){where}")
    allowed = valid_worlds(cfg, max(old, world, 2 * world, 8))
    if allowed:
        fits = [w for w in allowed if w <= world]
        best = f"; the largest at or below {world}: {fits[-1]}" if fits else ""
        lines.append(f"the smallest layout this config allows is {allowed[0]} processes "
                     f"(allowed: {', '.join(map(str, allowed[:8]))}{best}); bring the "
                     "missing ranks back, or relaunch with a parallel.ep / "
                     "train.global_batch_size that the survivors can hold")
    else:
        lines.append("the config allows no layout up to the previous size; change "
                     "parallel.ep or train.global_batch_size")
    return "\n".join(lines)


def layout_record(dims: ParallelDims | SingleProcessDims, cfg: RunConfig,
                  hosts: list[str]) -> dict[str, Any]:
    """What a 'start' event says of the layout (read back by :func:`layout_change`)."""
    t, lay = cfg.train, dims.layout
    return {"world_size": lay.world, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep,
            "fsdp": lay.fsdp, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard,
            "grad_accum": t.grad_accum,
            "global_batch": lay.stage_size * t.grad_accum * t.micro_batch_size,
            "hosts": list(hosts)}


def layout_text(rec: dict[str, Any]) -> str:
    """'4 processes, dp=2 x ep=2, grad_accum 1' from a :func:`layout_record` (the layout
    labelled by :meth:`Layout.label`)."""
    return (f"{rec.get('world_size')} processes, {record_label(rec)}, grad_accum "
            f"{rec.get('grad_accum', '?')}")


LAYOUT_KEYS = ("world_size", "pp", "dp", "ep", "fsdp", "dp_replicate", "dp_shard")


def lost_hosts(old_hosts: list[str], new_hosts: list[str]) -> dict[str, int]:
    """host -> how many more ranks it had in the old layout than in the new one."""
    return dict(Counter(old_hosts) - Counter(new_hosts))


def previous_attempt(metrics_path: Path) -> dict[str, Any] | None:
    """The last 'start' event of a metrics.jsonl (the previous attempt's layout) with the
    step and time of the last step record after it (``last_step``, ``last_step_time``), or
    None (no file, no start). Damaged lines are skipped."""
    if not metrics_path.is_file():
        return None
    start, last = None, None
    with open(metrics_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict):
                continue
            if rec.get("event") == "start":
                start, last = rec, None
            elif "event" not in rec and isinstance(rec.get("step"), int):
                last = rec
    if start is None:
        return None
    out = dict(start)
    if last is not None:
        out["last_step"], out["last_step_time"] = last["step"], last.get("time")
    return out


def layout_change(previous: dict[str, Any] | None, current: dict[str, Any],
                  resumed_step: int) -> dict[str, Any] | None:
    """The 'layout_change' event's fields when ``current`` (a :func:`layout_record`)
    differs from the previous attempt's, else None: old and new layouts, ranks lost
    (negative: gained), the hosts lost and gained, and the steps the previous layout
    trained past the checkpoint this attempt resumed from (``steps_lost``)."""
    if previous is not None:  # a record without pp (written before pipelines): pp 1
        previous, current = ({"pp": 1, **rec} for rec in (previous, current))
    if previous is None or all(previous.get(k) == current.get(k) for k in LAYOUT_KEYS):
        return None
    old_hosts, new_hosts = previous.get("hosts") or [], current.get("hosts") or []
    last = previous.get("last_step")
    return {
        "old": {k: previous.get(k) for k in (*LAYOUT_KEYS, "grad_accum", "global_batch")},
        "new": {k: current.get(k) for k in (*LAYOUT_KEYS, "grad_accum", "global_batch")},
        "ranks_lost": int(previous.get("world_size") or 0) - int(current["world_size"]),
        "hosts_lost": lost_hosts(old_hosts, new_hosts),
        "hosts_gained": lost_hosts(new_hosts, old_hosts),
        "steps_lost": max(0, int(last) - resumed_step) if isinstance(last, int) else None,
        "last_step_time": previous.get("last_step_time"),
    }


_IMPORTED_AT = time.time()


def process_start_time() -> float:
    """When this process started (seconds since the epoch): from /proc (boot time plus
    the process's start ticks), else when this module was imported."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat[stat.rfind(")") + 2:].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT
