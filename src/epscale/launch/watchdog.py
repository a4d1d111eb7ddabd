"""Hung-collective watchdog with a per-rank flight recorder (works on gloo/CPU and NCCL).

Every collective a rank runs is recorded in a ring buffer (sequence number, operation, step,
start time, state); a background thread writes it to ``RUN_DIR/logs/flight_rank{r}.json``
every few seconds. When one blocking collective (or the ``wait()`` of an async one) has run
longer than ``timeout_s``, the watchdog

1. writes this rank's buffer,
2. waits briefly for the other ranks' files to be refreshed,
3. prints one message that names the rank, the operation and the step, followed by each
   rank's last operations, and points at the ranks that are behind (the likely culprits),
4. ends the process with exit code :data:`HANG_EXIT_CODE`, so torchrun restarts the group
   from the last checkpoint (or the job ends when no restarts are left).

If the process group's own timeout fires first (gloo raises in the calling thread), the same
message is printed and :class:`CollectiveTimeout` is raised instead. An optional
``step_timeout_s`` also flags a step that has not finished in time although no collective is
blocking (on CUDA, NCCL calls return at once and a hang shows up at the next sync).

On CUDA, NCCL has its own flight recorder; :data:`NCCL_FLIGHT_RECORDER_ENV` lists the
``TORCH_NCCL_*`` settings that turn it on (the Slurm script exports them).

Use in the trainer (after ``init_process_group``)::

    wd = Watchdog(run_dir, timeout_s=cfg_timeout).start().install()  # patches dist collectives
    for step in ...:
        wd.set_step(step)
        ...
    wd.stop()
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

HANG_EXIT_CODE = 75  # distinct from crashes (1) and signals (128+n), so logs tell them apart

# (name, value, why); "{dump_dir}" is replaced by the directory the dumps should go to.
NCCL_FLIGHT_RECORDER_ENV: list[tuple[str, str, str]] = [
    ("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000",
     "each rank keeps its last 2000 collectives (op, sizes, state, timings); 0 turns it off"),
    ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1",
     "when a collective times out, every rank writes that buffer"),
    ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "{dump_dir}/nccl_trace_rank_",
     "where the dumps go (one file per rank; read with torch's fr_trace tool)"),
    ("TORCH_NCCL_ENABLE_MONITORING", "1",
     "a heartbeat thread ends a rank whose NCCL watchdog is itself stuck, so a hang cannot "
     "last forever"),
    ("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "600", "how long that heartbeat thread waits"),
]

# torch.distributed functions the watchdog records. P2P send/recv are left out: pipeline
# schedules post them far ahead of their completion, which is not a hang.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "broadcast", "broadcast_object_list", "reduce", "gather", "scatter", "barrier",
               "monitored_barrier")


class CollectiveTimeout(RuntimeError):
    """A collective did not finish within the timeout. The message names rank, op and step."""


@dataclass
class OpRecord:
    """One recorded operation. state: 'running' (blocking call in progress), 'issued' (async,
    not waited on yet), 'waiting' (in Work.wait()), 'completed' or 'failed'. Times are Unix
    seconds; ``started`` is when the rank began to block on it."""

    seq: int
    op: str
    step: int | None
    issued: float
    started: float
    state: str = "running"
    ended: float | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def blocking(self) -> bool:
        return self.state in ("running", "waiting")


class FlightRecorder:
    """Ring buffer of a rank's last ``capacity`` operations, dumped as JSON."""

    def __init__(self, rank: int, world_size: int, capacity: int = 64,
                 host: str | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.host = host or socket.gethostname()
        self.step: int | None = None
        self.step_time = time.time()
        self._ops: collections.deque[OpRecord] = collections.deque(maxlen=capacity)
        self._seq = 0
        self._lock = threading.Lock()
        self.version = 0  # bumped on every change (lets a reader tell two snapshots apart)

    def begin(self, op: str, blocking: bool = True, **info: Any) -> OpRecord:
        now = time.time()
        with self._lock:
            self._seq += 1
            rec = OpRecord(self._seq, op, self.step, now, now,
                           "running" if blocking else "issued", info=info)
            self._ops.append(rec)
            self.version += 1
        return rec

    def mark(self, rec: OpRecord, state: str) -> None:
        with self._lock:
            if state == "waiting":
                rec.started = time.time()
            else:
                rec.ended = time.time()
            rec.state = state
            self.version += 1

    def set_step(self, step: int) -> None:
        with self._lock:
            self.step, self.step_time = step, time.time()
            self.version += 1

    def blocking_op(self) -> OpRecord | None:
        """The oldest operation this rank is blocked in, if any."""
        with self._lock:
            return next((r for r in self._ops if r.blocking), None)

    def snapshot(self, reason: str | None = None) -> dict[str, Any]:
        with self._lock:
            return {"rank": self.rank, "world_size": self.world_size, "host": self.host,
                    "pid": os.getpid(), "step": self.step, "time": time.time(),
                    "reason": reason, "ops": [asdict(r) for r in self._ops]}

    def dump(self, path: str | Path, reason: str | None = None) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.snapshot(reason), indent=1))
        os.replace(tmp, p)  # readers never see half a file
        return p


def _fmt_op(op: dict | None, now: float) -> str:
    if op is None:
        return "no operations recorded"
    state = op["state"]
    if state in ("running", "waiting"):
        when = f"{state} for {now - op['started']:.1f} s"
    elif op.get("ended"):
        when = f"{state} {now - op['ended']:.1f} s ago"
    else:
        when = state
    return f"#{op['seq']} {op['op']} at step {op['step']}, {when}"


def read_flight_dumps(log_dir: str | Path, world_size: int) -> dict[int, dict | None]:
    """Each rank's last flight dump in ``log_dir`` (None for a rank that has none)."""
    out: dict[int, dict | None] = {}
    for r in range(world_size):
        p = Path(log_dir) / f"flight_rank{r}.json"
        try:
            out[r] = json.loads(p.read_text())
        except (OSError, ValueError):
            out[r] = None
    return out


def hang_report(rank: int, host: str, rec: OpRecord, timeout_s: float,
                dumps: dict[int, dict | None], log_dir: str | Path, what: str = "",
                stale_s: float = float("inf")) -> str:
    """The message printed on a hang: who, what, when, then every rank's last operations.
    A rank whose record is older than ``stale_s`` seconds is flagged as frozen."""
    now = time.time()
    head = (f"epscale watchdog: rank {rank} (host {host}) timed out in collective "
            f"'{rec.op}' (#{rec.seq}) at step {rec.step}: not finished after "
            f"{now - rec.started:.1f} s (timeout {timeout_s:g} s){what}.")

    def progress(d: dict) -> tuple[int, int]:
        last = d["ops"][-1] if d.get("ops") else None
        return ((d.get("step") if d.get("step") is not None else -1),
                (last["seq"] if last else 0))

    known = {r: d for r, d in dumps.items() if d is not None}
    lead = max((progress(d) for d in known.values()), default=(0, 0))
    lines = [head, "Last operations per rank (flight recorder):"]
    behind = []
    for r in sorted(dumps):
        d = dumps[r]
        if d is None:
            lines.append(f"  rank {r}: no flight record: the rank died or never started "
                         "<- suspect")
            behind.append(r)
            continue
        last = d["ops"][-1] if d.get("ops") else None
        age = now - d.get("time", now)
        note = ""
        if age > stale_s:
            note = ("  <- its record stopped updating: the process is frozen, dead or holds "
                    "the GIL")
            behind.append(r)
        elif progress(d) < lead:
            note = "  <- behind the others: likely the rank that holds the group up"
            behind.append(r)
        lines.append(f"  rank {r} (host {d.get('host')}, pid {d.get('pid')}, step "
                     f"{d.get('step')}, record {age:.1f} s old): {_fmt_op(last, now)}{note}")
        for op in (d.get("ops") or [])[-4:-1][::-1]:
            lines.append(f"      before: {_fmt_op(op, now)}")
    if behind:
        lines.append(f"Ranks behind or missing: {behind}.")
    lines.append(f"Full dumps: {Path(log_dir)}/flight_rank*.json")
    return "\n".join(lines)


def _looks_like_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text or "deadline" in text


class _TrackedWork:
    """Wraps an async ``Work`` so the time a rank blocks in ``wait()`` is watched."""

    def __init__(self, work, rec: OpRecord, wd: "Watchdog") -> None:
        self._work, self._rec, self._wd = work, rec, wd

    def wait(self, *args, **kwargs):
        self._wd.recorder.mark(self._rec, "waiting")
        try:
            out = self._work.wait(*args, **kwargs)
        except Exception as e:
            self._wd._failed(self._rec, e)
            raise
        self._wd.recorder.mark(self._rec, "completed")
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


class Watchdog:
    """See the module docstring.

    run_dir: the run directory; dumps go to ``run_dir/logs``. timeout_s: how long one
    collective may block. step_timeout_s: how long one step may take (None: unchecked).
    rank / world_size: default from torch.distributed (or RANK / WORLD_SIZE).
    capacity: operations kept per rank. flush_s: how often the buffer is written.
    on_hang: called with the message instead of printing it and ending the process
    (for embedding; the default is print + ``os._exit(HANG_EXIT_CODE)``).
    """

    def __init__(self, run_dir: str | Path, timeout_s: float = 600.0, *,
                 step_timeout_s: float | None = None, rank: int | None = None,
                 world_size: int | None = None, capacity: int = 64, flush_s: float = 2.0,
                 on_hang: Callable[[str], None] | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"watchdog timeout_s = {timeout_s!r} is invalid: must be > 0")
        if step_timeout_s is not None and not step_timeout_s > 0:
            raise ValueError(f"watchdog step_timeout_s = {step_timeout_s!r} is invalid: "
                             "must be > 0 or None")
        rank, world_size = self._rank_world(rank, world_size)
        self.log_dir = Path(run_dir) / "logs"
        self.timeout_s, self.step_timeout_s = float(timeout_s), step_timeout_s
        self.flush_s = flush_s
        self.poll_s = min(1.0, self.timeout_s / 4)
        self.recorder = FlightRecorder(rank, world_size, capacity)
        self.path = self.log_dir / f"flight_rank{rank}.json"
        self.on_hang = on_hang
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._patched: dict[str, Callable] = {}
        self._fired = False

    @staticmethod
    def _rank_world(rank, world_size) -> tuple[int, int]:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        return rank, world_size

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> "Watchdog":
        self.recorder.dump(self.path)
        self._thread = threading.Thread(target=self._loop, name="epscale-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.uninstall()
        self.recorder.dump(self.path, reason="stopped")

    def __enter__(self) -> "Watchdog":
        return self.start().install()

    def __exit__(self, *exc) -> None:
        self.stop()

    def set_step(self, step: int) -> None:
        """Tell the watchdog a new step began (recorded with every following operation)."""
        self.recorder.set_step(step)

    # -- recording ------------------------------------------------------------------------

    @contextlib.contextmanager
    def op(self, name: str, **info: Any):
        """Record a blocking operation explicitly: ``with wd.op("all_reduce"): ...``."""
        rec = self.recorder.begin(name, **info)
        try:
            yield rec
        except Exception as e:
            self._failed(rec, e)
            raise
        self.recorder.mark(rec, "completed")

    def _failed(self, rec: OpRecord, exc: BaseException) -> None:
        self.recorder.mark(rec, "failed")
        if _looks_like_timeout(exc) and not isinstance(exc, CollectiveTimeout):
            msg = self._report(rec, f" (the process group raised: {str(exc).splitlines()[0]})")
            raise CollectiveTimeout(msg) from exc

    def wrap(self, name: str, fn: Callable) -> Callable:
        """``fn`` (a torch.distributed collective) with recording around it."""
        wd = self

        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            async_op = bool(kwargs.get("async_op", False))
            info = {}
            t = args[0] if args else None
            if hasattr(t, "shape"):
                info = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
            rec = wd.recorder.begin(name, blocking=not async_op, **info)
            try:
                out = fn(*args, **kwargs)
            except Exception as e:
                wd._failed(rec, e)
                raise
            if async_op and out is not None:
                return _TrackedWork(out, rec, wd)
            wd.recorder.mark(rec, "completed")
            return out

        recorded.__epscale_watchdog__ = True
        return recorded

    def install(self) -> "Watchdog":
        """Record every call of the torch.distributed collectives (module attributes are
        replaced, so code calling ``dist.all_reduce(...)`` is covered)."""
        import torch.distributed as dist

        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None or getattr(fn, "__epscale_watchdog__", False):
                continue
            self._patched[name] = fn
            setattr(dist, name, self.wrap(name, fn))
        return self

    def uninstall(self) -> None:
        import torch.distributed as dist

        for name, fn in self._patched.items():
            setattr(dist, name, fn)
        self._patched.clear()

    # -- detection ------------------------------------------------------------------------

    def _loop(self) -> None:
        last_flush = 0.0
        while not self._stop.wait(self.poll_s):
            now = time.time()
            rec = self.recorder.blocking_op()
            if rec is not None and now - rec.started > self.timeout_s:
                self._hang(rec)
                return
            if (self.step_timeout_s is not None and self.recorder.step is not None
                    and now - self.recorder.step_time > self.step_timeout_s):
                last = rec or OpRecord(0, "(no collective in flight)", self.recorder.step,
                                       self.recorder.step_time, self.recorder.step_time)
                self._hang(last, f"; step {self.recorder.step} has run for "
                                 f"{now - self.recorder.step_time:.1f} s "
                                 f"(step timeout {self.step_timeout_s:g} s)")
                return
            # Rewrite at least every flush_s even when nothing changed: the file's time then
            # tells the other ranks whether this one is alive (a frozen rank's file goes stale).
            if now - last_flush >= self.flush_s:
                last_flush = now
                try:
                    self.recorder.dump(self.path)
                except OSError:
                    pass  # a full or vanished disk must not take the training down

    def _report(self, rec: OpRecord, what: str = "") -> str:
        if self._fired:
            return f"epscale watchdog: rank {self.recorder.rank}: {rec.op} failed{what}"
        self._fired = True
        self.recorder.dump(self.path, reason=f"timeout in {rec.op} #{rec.seq}")
        # Give the other ranks' flushers time to write what they are doing now.
        time.sleep(min(self.flush_s * 1.5 + 0.5, self.timeout_s))
        dumps = read_flight_dumps(self.log_dir, self.recorder.world_size)
        dumps[self.recorder.rank] = self.recorder.snapshot()
        msg = hang_report(self.recorder.rank, self.recorder.host, rec, self.timeout_s, dumps,
                          self.log_dir, what, stale_s=max(4 * self.flush_s, 5.0))
        (self.log_dir / f"hang_rank{self.recorder.rank}.txt").write_text(msg + "\n")
        print(msg, file=sys.stderr, flush=True)
        return msg

    def _hang(self, rec: OpRecord, what: str = "") -> None:
        msg = self._report(rec, what)
        if self.on_hang is not None:
            self.on_hang(msg)
            return
        os._exit(HANG_EXIT_CODE)  # the main thread is stuck inside C++; nothing else ends it
