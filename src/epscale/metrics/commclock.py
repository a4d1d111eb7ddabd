"""How long a rank's communication was in flight, and how long the rank waited on it.

Two numbers per step and per kind of communication (:data:`COMM_KINDS`):

* **in flight** (``comm_s``): the union of the intervals from a collective's issue to its
  completion, so two collectives in flight together count once;
* **exposed** (``comm_exposed_s``): the union of the intervals this rank waited on
  communication with no compute of its own to do: the time inside ``work.wait()`` of an
  asynchronous collective, and the whole of a blocking one.

``exposed / step time`` is the exposed share, the number overlap drives down; in flight
minus exposed is the communication that ran behind compute.

How the intervals are taken:

* CPU (gloo): ``time.perf_counter`` at issue and around each wait. An asynchronous
  collective still running when its wait starts is in flight until the wait returns (so
  the exposed wait lies inside its flight); one already done then ended at the earlier of
  its future's done-callback (gloo gives all-to-all, all-reduce and all-gather a future)
  and the wait's start, and its wait is not exposed (the call returns at once; under CPU
  load a preempted return could otherwise count a wait past the flight's end). Gloo's reduce-scatter and point-to-point works have no future:
  when done before their wait, their flight ends at the wait's start, an upper bound.
* CUDA: events, never a host sync in the step (they are read in :meth:`CommClock.totals`
  after the step's one synchronisation, which ``StepTimers`` already does). Exposed: a
  pair of events on the current stream around ``work.wait()`` (or around a blocking call
  issued on the compute stream): the time the compute stream stalled. In flight: an event
  at issue on the current stream and one on a side stream made to wait for the work; the
  work's tensors are held until the consumer's wait so the side stream's wait cannot
  release them early. A blocking call on another stream (FSDP's all-gather stream) counts
  in flight only: the compute stream's wait on it happens inside torch. (This branch has
  not run on a GPU yet.)

Instrumentation is off unless a clock is attached: the code paths test one attribute for
None. On, a collective costs two or three clock reads (CPU) or two to three events (CUDA)
and a list append.

Legend: none (no tensor shapes here).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard import _fsdp_collectives

from ..dispatch.comm import counters_of
from ..moe.layer import moe_layers
from ..plan.overlap import COMM_KINDS


try:  # a Work whose wait() runs Python: passes FSDP's isinstance(work, Work) checks
    from torch._C._distributed_c10d import PythonCallbackWork as _CallbackWork
except ImportError:  # pragma: no cover - torch builds without distributed
    _CallbackWork = None


def _union(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


class _Flight:
    """One collective's in-flight interval (CPU seconds or CUDA events)."""

    __slots__ = ("kind", "start", "end", "final")

    def __init__(self, kind: str, start: Any, end: Any = None):
        self.kind, self.start, self.end = kind, start, end
        self.final = end is not None

    def done_at(self, t: float) -> None:
        """CPU: done by ``t`` (the completion is the earliest such moment)."""
        if not self.final and (self.end is None or t < self.end):
            self.end = t

    def waited_until(self, t: float) -> None:
        """CPU: the rank waited for it until ``t``: in flight until then, so the wait
        (exposed) lies inside the flight even where the done-callback ran a little
        before the wait returned."""
        if not self.final:
            self.end, self.final = t, True


class CommClock:
    """Records the in-flight and exposed intervals of one rank's communication between
    :meth:`reset` calls (one step).

    device: where the communication's tensors live; CUDA uses events (see the module
    docstring). enabled: False makes every method a no-op, so a caller may keep one."""

    def __init__(self, device: torch.device | str | None = None, enabled: bool = True):
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = dev.type == "cuda" and torch.cuda.is_available()
        self.enabled = enabled
        self._side = torch.cuda.Stream(dev) if self.cuda else None
        self._compute = torch.cuda.current_stream(dev) if self.cuda else None
        self.reset()

    # ------------------------------------------------------------------ clock
    def _now(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def reset(self) -> None:
        """Start a new step: forget the intervals recorded so far."""
        self._flights: list[_Flight] = []
        self._exposed: list[tuple[str, Any, Any]] = []
        self._origin = self._now() if self.enabled else None

    # ------------------------------------------------------------------ recording
    @contextlib.contextmanager
    def blocking(self, kind: str) -> Iterator[None]:
        """Around a blocking collective: its whole duration is in flight and exposed (on
        CUDA, exposed only when issued on the compute stream)."""
        if not self.enabled:
            yield
            return
        start = self._now()
        yield
        end = self._now()
        self._flights.append(_Flight(kind, start, end))
        if not self.cuda or torch.cuda.current_stream() == self._compute:
            self._exposed.append((kind, start, end))

    def track(self, kind: str, work: Any, keep: Sequence[torch.Tensor] = ()) -> Any:
        """An asynchronous collective just issued: returns a ``Work`` to wait on instead
        of ``work`` (its ``wait()`` is timed as exposed). ``keep``: the collective's
        tensors (CUDA: held until that wait). ``work`` None (nothing was sent) is returned
        as it is."""
        if not self.enabled or work is None:
            return work
        return self._timed_work(kind, work, self._now(), list(keep))

    def _timed_work(self, kind: str, work: Any, issued: Any, keep: list) -> Any:
        """Record ``work``'s flight from ``issued`` and return the Work that times its wait."""
        clock = self
        flight = _Flight(kind, issued)
        self._flights.append(flight)
        if self.cuda:
            with torch.cuda.stream(self._side):
                work.wait()  # the side stream waits; the compute stream does not
                flight.end = torch.cuda.Event(enable_timing=True)
                flight.end.record(self._side)
        else:
            try:
                work.get_future().add_done_callback(
                    lambda _f: flight.done_at(time.perf_counter()))
            except RuntimeError:  # gloo's reduce-scatter and p2p works have no future
                pass

        def wait(_timeout=None) -> bool:
            start = clock._now()
            done = clock.cuda or work.is_completed()
            if not clock.cuda and done:
                flight.done_at(start)
            out = work.wait()
            end = clock._now()
            if not done:
                flight.waited_until(end)
            if clock.cuda or not done:  # CPU: a work done before its wait kept no one waiting
                clock._exposed.append((kind, start, end))
            keep.clear()
            return True if out is None else bool(out)

        if _CallbackWork is None:  # pragma: no cover
            raise RuntimeError("CommClock.track needs torch.distributed (PythonCallbackWork)")
        return _CallbackWork(wait)

    @contextlib.contextmanager
    def intercept(self, kind: str, module: Any, names: Sequence[str]) -> Iterator[None]:
        """Within the block, the functions ``names`` of ``module`` (module attributes, as
        the watchdog replaces torch.distributed's) are timed as ``kind``: a blocking call
        whole, an asynchronous one (``async_op=True``) through :meth:`track`, and a batch
        of point-to-point operations (a name ending in 'batch_p2p' or 'batch_isend_irecv':
        a list of ``P2POp`` in, a list of works out) work by work. For collectives issued
        by code that takes no clock (torch's pipeline schedules, the gradient reduction)."""
        if not self.enabled:
            yield
            return
        saved = {n: getattr(module, n) for n in names if hasattr(module, n)}
        for n, fn in saved.items():
            batch = n.endswith("batch_p2p") or n.endswith("batch_isend_irecv")
            setattr(module, n, self._timed_call(kind, fn, batch))
        try:
            yield
        finally:
            for n, fn in saved.items():
                setattr(module, n, fn)

    def _timed_call(self, kind: str, fn: Callable, batch: bool) -> Callable:
        def timed(*args, **kwargs):
            if batch:
                start = self._now()
                works = fn(*args, **kwargs)
                tensors = [op.tensor for op in args[0]] if args else []
                return [self._timed_work(kind, w, start, list(tensors)) for w in works or []]
            if kwargs.get("async_op"):
                keep = [a for a in args if isinstance(a, torch.Tensor)]
                return self.track(kind, fn(*args, **kwargs), keep)
            with self.blocking(kind):
                return fn(*args, **kwargs)
        return timed

    # ------------------------------------------------------------------ reading
    def _seconds(self, t: Any, end_default: float) -> float:
        if t is None:
            return end_default
        if self.cuda:
            return self._origin.elapsed_time(t) / 1e3
        return t - self._origin

    def totals(self) -> dict[str, Any]:
        """``{"s": in flight, "exposed_s": exposed, kind: {"s", "n", "exposed_s"} for
        every kind of COMM_KINDS}`` in seconds since :meth:`reset` (``n``: collectives). A collective still in flight
        counts up to now. CUDA: one ``torch.cuda.synchronize()`` (after StepTimers', it
        waits for nothing). Disabled: zeros, nothing read."""
        if not self.enabled:
            return empty_totals()
        if self.cuda:
            torch.cuda.synchronize()
            now = self._origin.elapsed_time(self._now()) / 1e3
        else:
            now = time.perf_counter() - self._origin
        flights = [(f.kind, self._seconds(f.start, now), self._seconds(f.end, now))
                   for f in self._flights]
        exposed = [(k, self._seconds(s, now), self._seconds(e, now)) for k, s, e in self._exposed]
        out: dict[str, Any] = {"s": _union([(s, e) for _k, s, e in flights]),
                               "exposed_s": _union([(s, e) for _k, s, e in exposed])}
        for kind in COMM_KINDS:
            mine = [(s, e) for k, s, e in flights if k == kind]
            out[kind] = {"s": _union(mine), "n": float(len(mine)),
                         "exposed_s": _union([(s, e) for k, s, e in exposed if k == kind])}
        return out


def empty_totals() -> dict[str, Any]:
    """:meth:`CommClock.totals` of a step without communication."""
    out: dict[str, Any] = {"s": 0.0, "exposed_s": 0.0}
    out.update({k: {"s": 0.0, "n": 0.0, "exposed_s": 0.0} for k in COMM_KINDS})
    return out


# --------------------------------------------------------------------------------------
# Attaching a clock to a parallelized model
# --------------------------------------------------------------------------------------


class _TimedComm:
    """FSDP2's all-gather or reduce-scatter communication (its ``Comm`` interface: an
    ``allocate`` and a call), timed as 'fsdp'; allocation is the wrapped one's."""

    def __init__(self, inner: Any, clock: CommClock):
        self.inner, self.clock = inner, clock

    def allocate(self, *args, **kwargs) -> torch.Tensor:
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 *args, async_op: bool = False, **kwargs) -> Any:
        if async_op:
            work = self.inner(output_tensor, input_tensor, group, *args, async_op=True, **kwargs)
            return self.clock.track("fsdp", work, (output_tensor, input_tensor))
        with self.clock.blocking("fsdp"):
            return self.inner(output_tensor, input_tensor, group, *args, **kwargs)


def _fsdp_param_groups(model: torch.nn.Module) -> list[Any]:
    """FSDP2's parameter groups of every ``fully_shard``-ed module of ``model``."""
    out = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is not None:
            out.extend(get_state()._fsdp_param_groups)
    return out


class _ReplicaAllReduce:
    """Stands for ``torch.distributed`` inside FSDP2's collectives module, whose one
    ``all_reduce`` is HSDP's replica all-reduce (``foreach_reduce``, after the
    reduce-scatter, in the step's last backward): that call is timed as 'dp' by ``clock``;
    every other name is ``torch.distributed``'s, looked up at each call. FSDP2 also
    all-reduces over a replica dimension of size 1 (the expert mesh's, without HSDP):
    no traffic, not timed."""

    def __init__(self, clock: CommClock):
        self.clock = clock

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def all_reduce(self, tensor: torch.Tensor, *args, **kwargs) -> Any:
        group = kwargs.get("group")
        if group is not None and group.size() == 1:  # a replica dimension of 1: no traffic
            return dist.all_reduce(tensor, *args, **kwargs)
        return self.clock._timed_call("dp", dist.all_reduce, False)(tensor, *args, **kwargs)


def _time_replica_all_reduce(model: torch.nn.Module, clock: CommClock | None) -> None:
    """Time HSDP's replica all-reduces with ``clock`` when ``model`` has replicated FSDP
    parameter groups; else (or ``clock`` None) FSDP2 calls ``torch.distributed`` directly
    again. One clock per process: the last model attached decides."""
    replicated = any(getattr(g.mesh_info, "replicate_mesh_size", 1) > 1
                     for g in _fsdp_param_groups(model))
    if clock is not None and replicated:
        _fsdp_collectives.dist = _ReplicaAllReduce(clock)
    elif isinstance(_fsdp_collectives.dist, _ReplicaAllReduce):
        _fsdp_collectives.dist = dist


def attach_comm_clock(model: torch.nn.Module, clock: CommClock | None) -> None:
    """Time ``model``'s communication with ``clock`` (None detaches it): every MoE layer's
    dispatcher exchanges as 'dispatch'; FSDP2's all-gathers and reduce-scatters as 'fsdp'
    (each parameter group's communication objects wrapped: torch's ``set_custom_all_gather``
    does the same for a module of one group, and refuses ours, whose blocks hold a dense
    and an expert-mesh group); HSDP's replica all-reduce as 'dp' (FSDP2 issues it without
    a communication object: :class:`_ReplicaAllReduce` takes its module's
    ``torch.distributed``); 'dp' also: the replicated layout's DDP bucket all-reduces in
    backward (in flight only: DDP's reducer waits for them inside torch), else timed where
    the trainer runs them, as is 'pp' (:meth:`CommClock.intercept`)."""
    for moe in moe_layers(model):
        for counter in counters_of(moe.dispatcher):
            counter.clock = clock
    hook_state = getattr(model, "_epscale_ddp_hook_state", None)  # parallel.grads.DDP_HOOK_STATE
    if hook_state is not None:  # the replicated layout's DDP buckets, reduced in backward
        hook_state.clock = clock
    for group in _fsdp_param_groups(model):
        for name in ("_all_gather_comm", "_reduce_scatter_comm"):
            comm = getattr(group, name)
            inner = comm.inner if isinstance(comm, _TimedComm) else comm
            setattr(group, name, inner if clock is None else _TimedComm(inner, clock))
    _time_replica_all_reduce(model, clock)
