"""Host values of a MoE layer's forward: the one read of device values a layer makes
(the all-to-all split sizes), and keeping it for the layer's recomputation.

A read of device values on the host (``tolist``) waits for every kernel queued before
it: on an accelerator it stalls the launch queue. A MoE layer makes at most one per
forward (the EP backends' split sizes, read once after the count exchange; the local
backend makes none when the router is dropless), and its backward makes none: the
sizes travel in the handle, the exchanges' autograd context and the experts' device
offsets.

Activation checkpointing runs a block's forward again in backward. A recomputed forward
must not read the device again (it would add a sync per layer to every backward) and
must see the very values the first forward saw (the exchanges of every rank must
match). :func:`recompute_contexts` gives ``torch.utils.checkpoint`` a pair of contexts
sharing one record: inside the first forward :func:`host_ints` reads and keeps each
value; inside its recomputation it hands the kept values back in the same order, with
no read. The record belongs to one checkpointed call, so nothing is keyed on layers or
micro-batches, and it is freed with that call's autograd graph. :func:`host_ints` never
runs inside a compiled graph (``torch.compiler.disable``): a traced read would bake the
record's state into the graph instead of keeping and replaying it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch


class _Record:
    """The host values one checkpointed call read, in order; ``replay_at`` is the next
    one a recomputation gets (None while the first forward records)."""

    def __init__(self) -> None:
        self.values: list[list] = []
        self.replay_at: int | None = None


class _Stack(threading.local):
    """The records entered on this thread, innermost last. Per thread: a recomputation
    runs on whichever thread the autograd engine unpacks the saved value on (a device
    thread on accelerators), and enters its context there."""

    def __init__(self) -> None:
        self.records: list[_Record] = []


_ACTIVE = _Stack()


@torch.compiler.disable
def host_ints(t: torch.Tensor) -> list:
    """``t.tolist()`` of a 1-D integer tensor: a read of device values on the host (a
    synchronisation on an accelerator; callers mark it as their layer's one). Inside a
    checkpointed call's first forward the values are also kept; inside its recomputation
    the kept values come back, in the order they were read, without touching ``t``'s
    data."""
    if t.dim() != 1:
        raise ValueError(f"host_ints reads 1-D tensors, got shape {tuple(t.shape)}")
    record = _ACTIVE.records[-1] if _ACTIVE.records else None
    if record is not None and record.replay_at is not None:
        i = record.replay_at
        if i >= len(record.values) or len(record.values[i]) != t.numel():
            raise RuntimeError(
                f"recomputation read host values #{i} of {t.numel()} entries, but its first "
                f"forward read {len(record.values)} value list(s)"
                + (f" (#{i} had {len(record.values[i])} entries)" if i < len(record.values) else "")
                + ": the recomputed forward must run the same code as the first one")
        record.replay_at = i + 1
        return record.values[i]
    values = t.tolist()
    if record is not None:
        record.values.append(values)
    return values


@contextlib.contextmanager
def _recording(record: _Record) -> Iterator[None]:
    record.replay_at = None
    _ACTIVE.records.append(record)
    try:
        yield
    finally:
        _ACTIVE.records.pop()


class _Replaying:
    """The recomputation context of one record. Entered again for each recomputation
    (a split backward, input then weights, as the zero-bubble pipeline schedules run it,
    recomputes twice); every recomputation starts from the first value."""

    def __init__(self, record: _Record) -> None:
        self.record = record

    def __enter__(self) -> None:
        self.record.replay_at = 0
        _ACTIVE.records.append(self.record)

    def __exit__(self, *exc) -> bool:
        _ACTIVE.records.pop()
        self.record.replay_at = None
        return False


def recompute_contexts() -> tuple[contextlib.AbstractContextManager,
                                  contextlib.AbstractContextManager]:
    """(forward context, recomputation context) sharing one fresh record, for
    ``torch.utils.checkpoint(..., context_fn=...)`` (see
    :func:`epscale.parallel.activation.run`)."""
    record = _Record()
    return _recording(record), _Replaying(record)
