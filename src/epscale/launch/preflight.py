"""Preflight: before training, every rank joins a short, timed check.

1. **join**: each rank writes its host to the process group's store and waits (``timeout_s``)
   for all others; a rank that does not arrive is reported by rank and by the host it runs on
   (the host of its node's other ranks, since torchrun numbers ranks node by node).
2. **all_reduce** and **all_to_all**: ``iters`` rounds each, timed. Each round starts with the
   rank's local work (a small matmul: a throttled GPU or an overloaded CPU shows here), so a rank that is slow to arrive makes the others *wait*; the rank
   whose local time stands out (``slow_factor`` x the median, and ``min_slow_ms`` above it) is
   reported as slow, with its host.

Every wait has a deadline (``Work.wait(timeout)``), and each rank records the phase it reached
in the store, so a rank that dies half-way is named with the phase it stopped in.

The trainer calls it right after ``init_process_group`` (rank 0 prints the report)::

    from epscale.launch.preflight import run_preflight
    report = run_preflight(timeout_s=60)
    if dist.get_rank() == 0:
        print(report.format())

and ``torchrun --nproc-per-node N -m epscale preflight`` runs it on its own.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

_calls = 0  # preflight calls in this process: keeps store keys of repeated checks apart


class PreflightError(RuntimeError):
    """A rank did not join or did not finish the check. The message names rank and host."""


@dataclass
class RankResult:
    """One rank's measurements (milliseconds; medians over the rounds)."""

    rank: int
    host: str
    join_s: float
    local_ms: float
    all_reduce_ms: float
    all_to_all_ms: float


@dataclass
class PreflightReport:
    """All ranks' results; ``slow`` lists (rank, host, why) for the ranks that stand out."""

    world_size: int
    backend: str
    numel: int
    results: list[RankResult]
    slow: list[tuple[int, str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.slow

    def format(self) -> str:
        lines = [f"preflight: {self.world_size} ranks ({self.backend}), all_reduce/all_to_all "
                 f"of {self.numel} float32 values",
                 f"{'rank':>5} {'host':<20} {'join s':>7} {'local ms':>9} "
                 f"{'all_reduce ms':>14} {'all_to_all ms':>14}"]
        for r in self.results:
            flag = "  <- slow" if any(s[0] == r.rank for s in self.slow) else ""
            lines.append(f"{r.rank:>5} {r.host[:20]:<20} {r.join_s:>7.2f} "
                         f"{r.local_ms:>9.2f} {r.all_reduce_ms:>14.2f} "
                         f"{r.all_to_all_ms:>14.2f}{flag}")
        if self.slow:
            for rank, host, why in self.slow:
                lines.append(f"SLOW rank {rank} on host {host}: {why}")
        else:
            lines.append("preflight ok: every rank joined and none is slow")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def find_slow(results: list[RankResult], slow_factor: float = 3.0,
              min_slow_ms: float = 5.0) -> list[tuple[int, str, str]]:
    """Ranks whose local work per round is more than ``slow_factor`` x the median of the
    *other* ranks and at least ``min_slow_ms`` above it (with two ranks, the other one)."""
    slow = []
    for r in results:
        others = [o.local_ms for o in results if o.rank != r.rank]
        if not others:
            continue
        med = statistics.median(others)
        if r.local_ms > slow_factor * med and r.local_ms - med >= min_slow_ms:
            slow.append((r.rank, r.host,
                         f"local work took {r.local_ms:.1f} ms per round, "
                         f"{r.local_ms / max(med, 1e-6):.1f}x the other ranks' median "
                         f"{med:.1f} ms; every collective waits for it"))
    return slow


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception as e:  # pragma: no cover - depends on the torch build
        raise PreflightError(f"preflight needs the process group's store: {e}") from e


def _host_of(rank: int, joined: dict[int, dict], local_world: int) -> str:
    node = rank // max(1, local_world)
    hosts = {info["host"] for r, info in joined.items() if r // max(1, local_world) == node}
    if hosts:
        return f"{sorted(hosts)[0]} (node {node}, from its other ranks)"
    return f"unknown (node {node}: no rank of that node joined)"


def _missing_message(missing: list[int], joined: dict[int, dict], local_world: int,
                     phase: str, timeout_s: float, phases: dict[int, str] | None = None) -> str:
    parts = []
    for r in missing:
        where = f", last phase '{phases[r]}'" if phases and phases.get(r) else ""
        parts.append(f"rank {r} on host {_host_of(r, joined, local_world)}{where}")
    return (f"preflight: {len(missing)} rank(s) did not {phase} within {timeout_s:g} s: "
            + "; ".join(parts))


def _wait_for_keys(store, keys: dict[int, str], timeout_s: float) -> list[int]:
    """Poll until every key exists; return the ranks whose key is still missing."""
    deadline = time.monotonic() + timeout_s
    pending = dict(keys)
    while pending and time.monotonic() < deadline:
        for r, k in list(pending.items()):
            if store.check([k]):
                del pending[r]
        if pending:
            time.sleep(0.05)
    return sorted(pending)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_preflight(*, timeout_s: float = 60.0, iters: int = 5, numel: int = 1 << 16,
                  slow_factor: float = 3.0, min_slow_ms: float = 5.0,
                  device: torch.device | str | None = None, delay_s: float = 0.0,
                  raise_on_slow: bool = False) -> PreflightReport:
    """Run the check on every rank of the default process group (all must call it).

    timeout_s: deadline for joining and for each collective. iters: timed rounds per
    collective. numel: float32 values per all_reduce / all_to_all (rounded up to a multiple
    of the world size). device: where tensors live (default: cuda:LOCAL_RANK when the backend
    is NCCL, else CPU). delay_s: extra local work per round on this rank, for straggler
    drills. raise_on_slow: raise PreflightError instead of only reporting slow ranks.
    Returns the same :class:`PreflightReport` on every rank.
    """
    global _calls
    if not dist.is_initialized():
        raise PreflightError("preflight runs after torch.distributed.init_process_group")
    for name, v in (("timeout_s", timeout_s), ("slow_factor", slow_factor)):
        if not v > 0:
            raise ValueError(f"preflight {name} = {v!r} is invalid: must be > 0")
    if iters < 1 or numel < 1:
        raise ValueError(f"preflight iters = {iters}, numel = {numel}: both must be >= 1")
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = str(dist.get_backend())
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if device is None:
        device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
                  if backend == "nccl" else torch.device("cpu"))
    device = torch.device(device)
    host = socket.gethostname()
    store = _store()
    _calls += 1
    # Every rank of one attempt must use the same keys: never a per-node value such as
    # TORCHELASTIC_RESTART_COUNT, which is smaller on a node that joined an elastic job
    # later (both sides then waited for each other's keys until the restarts ran out).
    # epscale's agent gives each attempt a fresh store; MASTER_PORT, the same on every rank
    # of an attempt, also keeps attempts apart on a store shared between them.
    prefix = f"epscale/preflight/{os.environ.get('MASTER_PORT', '0')}/{_calls}"
    timeout = timedelta(seconds=timeout_s)

    def set_phase(name: str) -> None:
        store.set(f"{prefix}/phase/{rank}", name)

    def phases() -> dict[int, str]:
        out = {}
        for r in range(world):
            k = f"{prefix}/phase/{r}"
            out[r] = store.get(k).decode() if store.check([k]) else "never joined"
        return out

    # 1. join ---------------------------------------------------------------------------
    t0 = time.monotonic()
    set_phase("join")
    store.set(f"{prefix}/join/{rank}", json.dumps({"host": host, "pid": os.getpid()}))
    missing = _wait_for_keys(store, {r: f"{prefix}/join/{r}" for r in range(world)}, timeout_s)
    joined = {r: json.loads(store.get(f"{prefix}/join/{r}")) for r in range(world)
              if r not in missing}
    if missing:
        raise PreflightError(_missing_message(missing, joined, local_world, "join the check",
                                              timeout_s))
    join_s = time.monotonic() - t0

    # 2. rounds of local work + collective ---------------------------------------------
    n = 512 if device.type == "cuda" else 96
    a = torch.randn(n, n, device=device) / n ** 0.5
    numel = -(-numel // world) * world
    x = torch.ones(numel, device=device)
    out = torch.empty_like(x)
    local, times = [], {"all_reduce": [], "all_to_all": []}

    def timed(op_name: str, start) -> None:
        nonlocal a
        t_local = time.perf_counter()
        a = torch.tanh(a @ a)  # the local work a training step does between collectives
        _sync(device)
        if delay_s:
            time.sleep(delay_s)
        local.append((time.perf_counter() - t_local) * 1e3)
        set_phase(op_name)
        t_op = time.perf_counter()
        work = start()
        try:
            work.wait(timeout)
            _sync(device)
        except Exception as e:
            ph = phases()
            stuck = [r for r in range(world) if ph.get(r) != op_name]
            msg = _missing_message(stuck, joined, local_world, f"finish {op_name}", timeout_s,
                                   ph)
            raise PreflightError(f"{msg} (rank {rank} on {host} saw: "
                                 f"{str(e).splitlines()[0] if str(e) else type(e).__name__})"
                                 ) from e
        times[op_name].append((time.perf_counter() - t_op) * 1e3)

    for op_name, start in (
            ("all_reduce", lambda: dist.all_reduce(x, async_op=True)),
            ("all_to_all", lambda: dist.all_to_all_single(out, x, async_op=True))):
        for i in range(iters + 1):  # round 0 warms the connections up and is not counted
            timed(op_name, start)
            if i == 0:
                times[op_name].clear()
                local.pop()
            if op_name == "all_reduce":
                x.fill_(1.0)
    if not torch.equal(out, torch.ones_like(out)):
        raise PreflightError(f"preflight: all_to_all on rank {rank} ({host}) returned wrong "
                             "values: the transport corrupts data")
    set_phase("done")

    mine = RankResult(rank=rank, host=host, join_s=round(join_s, 4),
                      local_ms=round(statistics.median(local), 3),
                      all_reduce_ms=round(statistics.median(times["all_reduce"]), 3),
                      all_to_all_ms=round(statistics.median(times["all_to_all"]), 3))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, asdict(mine))
    results = [RankResult(**g) for g in gathered]
    report = PreflightReport(world, backend, numel, results,
                             find_slow(results, slow_factor, min_slow_ms))
    if raise_on_slow and report.slow:
        raise PreflightError(report.format())
    return report


# ---------------------------------------------------------------------------------------
# `epscale preflight` (run under torchrun)
# ---------------------------------------------------------------------------------------
