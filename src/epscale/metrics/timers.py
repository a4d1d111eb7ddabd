"""Named wall-clock sections of one training step (the step-time breakdown).

``StepTimers.section(name)`` is a context manager; the MoE layer's ``timer`` hook takes it
as is (``moe.timer = timers.section``). Sections nest: a section's *exclusive* time is its
wall time minus the time spent in sections opened inside it, so the exclusive times of one
step add up to (at most) the step time and can be drawn as a stacked bar. Re-entering a
section that is already open (recursion, re-entrant checkpointing) counts once.

On CPU a section costs two ``time.perf_counter()`` calls and a list append. On CUDA it
records a pair of CUDA events instead (no synchronisation per section); the events are
resolved with ONE ``torch.cuda.synchronize()`` when ``totals()``/``breakdown()`` is called
at the end of the step.
"""

from __future__ import annotations

import time
from typing import Any

import torch

# The sections of the metrics.jsonl contract, in drawing order.
STANDARD_SECTIONS: tuple[str, ...] = ("data", "forward", "attention", "router", "dispatch",
                                      "experts", "combine", "backward", "optimizer", "sync")
# Sections that count as communication (their exclusive time over the step time is the
# step's communication share).
COMM_SECTIONS: tuple[str, ...] = ("dispatch", "combine", "sync")


class _Null:
    """A reusable no-op context manager (cheaper than contextlib.nullcontext())."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return False


_NULL = _Null()


class _Section:
    """One named section; re-used across entries so opening it allocates nothing on CPU."""

    __slots__ = ("timers", "name", "depth", "start", "parent")

    def __init__(self, timers: "StepTimers", name: str):
        self.timers = timers
        self.name = name
        self.depth = 0
        self.start: Any = None
        self.parent: str | None = None

    def __enter__(self) -> "_Section":
        self.depth += 1
        if self.depth == 1:
            stack = self.timers._stack
            self.parent = stack[-1].name if stack else None
            stack.append(self)
            self.start = self.timers._mark()
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.depth -= 1
        if self.depth == 0:
            t = self.timers
            end = t._mark()
            stack = t._stack
            if stack and stack[-1] is self:
                stack.pop()
            else:  # closed out of order (an exception unwound past a child); stay consistent
                try:
                    stack.remove(self)
                except ValueError:
                    pass
            t._intervals.append((self.name, self.parent, self.start, end))
        return False


class StepTimers:
    """Accumulates named section times between ``reset()`` calls (normally one step).

    device: where the timed work runs. A CUDA device times with CUDA events (asynchronous,
    one synchronisation per step when the totals are read); anything else uses
    ``time.perf_counter``. enabled: False turns every section into a shared no-op (the
    baseline of ``benchmarks/metrics_overhead.py``).
    """

    def __init__(self, device: torch.device | str | None = None, enabled: bool = True):
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.use_cuda_events = dev.type == "cuda" and torch.cuda.is_available()
        self.enabled = enabled
        self._sections: dict[str, _Section] = {}
        self._stack: list[_Section] = []
        self._intervals: list[tuple[str, str | None, Any, Any]] = []

    # ---------------------------------------------------------------- timing
    def _mark(self) -> Any:
        if self.use_cuda_events:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def section(self, name: str):
        """Context manager timing ``name``. Usable as ``moe.timer``."""
        if not self.enabled:
            return _NULL
        sec = self._sections.get(name)
        if sec is None:
            sec = self._sections[name] = _Section(self, name)
        return sec

    __call__ = section

    def reset(self) -> None:
        """Forget the sections timed so far (call at the start of each step)."""
        self._intervals.clear()

    def num_open(self) -> int:
        """How many sections are open (nested) now."""
        return len(self._stack)

    def suspend(self, keep: int = 0) -> list[tuple["_Section", int]]:
        """Close the open sections but the ``keep`` outermost (each records its interval
        so far) and return what :meth:`resume` needs to reopen them: for a thread that
        stops running while another one times its own sections inside the same outer
        ones (``epscale.parallel.overlap_pair``), so neither's sections count the other's
        time."""
        open_ = [(sec, sec.depth) for sec in self._stack[keep:]]
        for sec, _depth in reversed(open_):
            sec.depth = 1
            sec.__exit__(None, None, None)
        return open_

    def resume(self, open_: list[tuple["_Section", int]]) -> None:
        """Reopen the sections :meth:`suspend` closed, outermost first."""
        for sec, depth in open_:
            sec.__enter__()
            sec.depth = depth

    # ---------------------------------------------------------------- reading
    def _durations(self) -> list[tuple[str, str | None, float]]:
        if self.use_cuda_events and self._intervals:
            torch.cuda.synchronize()  # the one host sync of the timers, once per step
            return [(n, p, s.elapsed_time(e) / 1e3) for n, p, s, e in self._intervals]
        return [(n, p, e - s) for n, p, s, e in self._intervals]

    def totals(self, inclusive: bool = False) -> dict[str, float]:
        """Seconds per section since ``reset()``.

        inclusive=False (default): exclusive time, i.e. minus nested sections' time.
        inclusive=True: full wall time of each section, nested sections included.
        """
        out: dict[str, float] = {}
        for name, parent, dt in self._durations():
            out[name] = out.get(name, 0.0) + dt
            if not inclusive and parent is not None:
                out[parent] = out.get(parent, 0.0) - dt
        if not inclusive:
            for k, v in out.items():
                out[k] = max(v, 0.0)  # rounding of nested clocks can dip below zero
        return out

    def breakdown(self) -> dict[str, float]:
        """Exclusive seconds for every standard section (0.0 where it was not timed),
        followed by any other section names used: the ``time_breakdown`` record field."""
        tot = self.totals()
        out = {k: float(tot.pop(k, 0.0)) for k in STANDARD_SECTIONS}
        out.update({k: float(v) for k, v in tot.items()})
        return out


def comm_share(breakdown: dict[str, float], step_time_s: float) -> float:
    """Communication share of a step: (dispatch + combine + sync) / step time, in [0, 1]."""
    if not step_time_s > 0:
        return 0.0
    comm = sum(float(breakdown.get(k, 0.0)) for k in COMM_SECTIONS)
    return min(max(comm / step_time_s, 0.0), 1.0)
