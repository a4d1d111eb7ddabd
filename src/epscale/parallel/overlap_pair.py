"""One micro-batch's forward and another's backward run together, so that the expert
all-to-alls of each run while the other computes (DualPipeV's overlapped pairs).

torch's ``ScheduleDualPipeV`` emits ``OVERLAP_F_B`` actions: the forward of micro-batch i
on one of the rank's two stages paired with the full backward of micro-batch j on the
other. Its runtime runs the pair one after the other; :func:`install` registers
:func:`overlapped_f_b` for them instead (``parallel.overlap: auto``). Without a pipeline,
``parallel.overlap_micro_batches`` pairs micro-batch i + 1's forward with micro-batch i's
backward the same way (``epscale.training.step.AccumulationStep``); there both passes run
through the same modules, so module state a forward leaves for its caller (the MoE layers'
``aux_loss``) is not rewritten by a recomputation, and a wrapper's post-forward that must
not run inside the other's backward waits for it (:func:`finish_partner`).

How: the forward runs on the calling thread and the backward on a helper thread, ONE AT A
TIME, handing a baton back and forth (:class:`Baton`). A thread hands it over at each of
its communication points (``epscale.dispatch.comm``'s hand-off: after an exchange is
issued, before it is waited for: dispatch and combine, their count exchanges, and the
gradients' exchanges in backward, also inside a recomputed forward), and gets it back at
the other thread's next communication point (or its end). So while the forward's dispatch
is in flight the backward computes, and while the backward's gradients travel the forward
computes. The hand-offs are at the same collectives on every rank of an expert-parallel
group (both ranks run the same pair, and a hand-off never depends on whether a transfer
has finished), so every rank issues the group's collectives in the same order.

The arithmetic is that of the sequential pair (the same operations on the same tensors;
the two micro-batches touch different stages, hence different modules, so neither reads
what the other writes). Time a rank spends waiting on communication is still recorded
by ``CommClock`` inside the wait, after the hand-off: time the other micro-batch
computed while a transfer was in flight counts as hidden, the wait that remains (both
micro-batches waiting) as exposed.

On CUDA both threads issue onto the same compute stream (the helper takes the caller's
device and stream) in baton order, so the kernels of one land between the issue and the
wait of the other's collective on NCCL's stream. There the autograd engine runs the
backward's nodes on its own device thread while the helper waits in ``backward()``; the
helper's hand-off is registered for the engine's threads too
(``epscale.dispatch.comm.set_engine_handoff``), so the device thread hands the baton over
at the backward's exchanges as the helper would (the baton belongs to a side, not to a
thread). On the CPU the tests run the backward on a thread of its own to check that; the
CUDA run itself is unrun here (no GPU in this project's CI).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.pipelining import schedules as pp_schedules

from ..config import ConfigError
from ..dispatch.comm import set_engine_handoff, set_handoff


@dataclass
class PairStats:
    """What :func:`overlapped_f_b` ran: pairs, and hand-offs between their two threads."""

    pairs: int = 0
    switches: int = 0


class Baton:
    """Two participants (0 and 1), one running at a time; 0 holds the baton first."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._holder = 0
        self._finished = [False, False]
        self.switches = 0

    def acquire(self, me: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._holder == me)

    def switch(self, me: int) -> None:
        """Hand the baton to the other participant (unless it has finished) and wait
        until it comes back."""
        with self._cv:
            if self._finished[1 - me]:
                return
            self.switches += 1
            self._holder = 1 - me
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._holder == me)

    def partner_finished(self, me: int) -> bool:
        with self._cv:
            return self._finished[1 - me]

    def finish(self, me: int) -> None:
        with self._cv:
            self._finished[me] = True
            self._holder = 1 - me
            self._cv.notify_all()


_PAIR = threading.local()  # .current: (baton, me, timers, keep) inside run_pair's threads


def run_pair(first: Callable[[], Any], second: Callable[[], Any],
             stats: PairStats | None = None, timers=None) -> tuple[Any, Any]:
    """Run ``first`` on this thread and ``second`` on a helper thread, one at a time,
    switching at every communication hand-off point; returns both results. ``second`` is
    the backward side: its hand-off also serves the autograd engine's threads while they
    run a backward node for it. An exception
    in either is raised here after both have ended. ``stats``: counts the pair and its
    hand-offs. ``timers``: the ``StepTimers`` both time their sections with; a thread's
    sections opened inside the pair are closed while the other runs
    (``suspend``/``resume``), so a section's time is its own thread's; the caller's open
    sections hold both."""
    baton = Baton()
    keep = timers.num_open() if timers is not None else 0
    results: list[Any] = [None, None]
    errors: list[BaseException | None] = [None, None]

    stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None

    def body(me: int, fn: Callable[[], Any]) -> None:
        baton.acquire(me)
        if stream is not None and me == 1:  # CUDA's device and stream are per thread
            torch.cuda.set_device(stream.device)
            torch.cuda.set_stream(stream)
        handoff = functools.partial(_switch, baton, me, timers, keep)
        set_handoff(handoff)
        if me == 1:  # the backward side: also where the engine's device thread runs it
            set_engine_handoff(handoff)
        _PAIR.current = (baton, me, timers, keep)
        try:
            results[me] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            errors[me] = e
        finally:
            _PAIR.current = None
            set_handoff(None)
            if me == 1:
                set_engine_handoff(None)
            baton.finish(me)

    helper = threading.Thread(target=body, args=(1, second), name="epscale-overlap-pair",
                              daemon=True)
    helper.start()
    body(0, first)
    helper.join()
    if stats is not None:
        stats.pairs += 1
        stats.switches += baton.switches
    for e in errors:
        if e is not None:
            raise e
    return results[0], results[1]


def _switch(baton: Baton, me: int, timers, keep: int) -> None:
    open_ = timers.suspend(keep) if timers is not None else None
    baton.switch(me)
    if timers is not None:
        timers.resume(open_)


def finish_partner() -> None:
    """Inside one side of a :func:`run_pair`: hand the baton over until the other side has
    run to its end, then go on (outside a pair: nothing). For work that must not start
    while the other side is half-way, e.g. DDP's post-forward ``prepare_for_backward`` of
    the step's last micro-batch, which would arm the reducer's hooks inside the previous
    micro-batch's backward. Every rank runs the pair alike, so it hands over at the same
    points on every rank."""
    current = getattr(_PAIR, "current", None)
    if current is None:
        return
    baton, me, timers, keep = current
    while not baton.partner_finished(me):
        _switch(baton, me, timers, keep)


def _timers_of(stage) -> Any:
    """The StepTimers a stage's chunk times its sections with (its ``timer`` is the
    trainer's ``StepTimers.section``), or None."""
    owner = getattr(getattr(stage.submod, "timer", None), "__self__", None)
    return owner if hasattr(owner, "suspend") else None


def overlapped_f_b(action, ctx, stats: PairStats | None = None) -> None:
    """``OVERLAP_F_B`` for torch's pipeline runtime (``register_custom_function``): the
    forward and full-backward sub-actions as the runtime runs them (receives waited for,
    loss computed on the last stage, inputs handed to a neighbouring stage on this rank),
    their compute through :func:`run_pair`. ``ctx``: the runtime's ``_PipelineContext``."""
    sched = ctx.schedule_ref
    fwd, bwd = action.sub_actions
    stages = {s.stage_index: s for s in sched._stages}
    f_stage, b_stage = stages[fwd.stage_index], stages[bwd.stage_index]
    f_mb, b_mb = fwd.microbatch_index, bwd.microbatch_index
    sched._assert_unsharded(f_stage)
    sched._assert_unsharded(b_stage)
    if not f_stage.is_first and fwd.stage_index - 1 not in stages:
        pp_schedules._wait_batch_p2p(sched.fwd_recv_ops.pop((fwd.stage_index, f_mb)))
    if not b_stage.is_last and bwd.stage_index + 1 not in stages:
        pp_schedules._wait_batch_p2p(sched.bwd_recv_ops.pop((bwd.stage_index, b_mb)))
    loss = sched._maybe_get_loss(b_stage, b_mb)
    sched.backward_counter[bwd.stage_index] += 1
    last = sched.backward_counter[bwd.stage_index] == sched._n_microbatches

    output, _ = run_pair(
        lambda: f_stage.forward_one_chunk(f_mb, ctx.arg_mbs[f_mb], ctx.kwarg_mbs[f_mb],
                                          save_forward_output=False),
        lambda: b_stage.backward_one_chunk(b_mb, loss=loss, full_backward=True,
                                           last_backward=last),
        stats, _timers_of(f_stage))
    sched._maybe_compute_loss(f_stage, output, ctx.target_mbs, f_mb)
    if fwd.stage_index + 1 in stages:
        stages[fwd.stage_index + 1].set_local_fwd_input(output, f_mb)
    if bwd.stage_index - 1 in stages:
        stages[bwd.stage_index - 1].set_local_bwd_input(b_stage.get_local_bwd_output(b_mb),
                                                        b_mb)


def install(schedule) -> PairStats:
    """Run ``schedule``'s ``OVERLAP_F_B`` actions through :func:`overlapped_f_b`; returns
    the counts they will keep."""
    kind = getattr(pp_schedules, "OVERLAP_F_B", None)
    if kind is None or not hasattr(schedule, "register_custom_function"):
        raise ConfigError("parallel.overlap = 'auto' with parallel.pp_schedule = 'dualpipev' "
                          "needs torch's OVERLAP_F_B actions and register_custom_function, "
                          "which this torch does not have; set parallel.overlap: none")
    stats = PairStats()
    schedule.register_custom_function(kind, functools.partial(overlapped_f_b, stats=stats))
    return stats
