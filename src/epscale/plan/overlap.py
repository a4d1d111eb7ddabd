"""What the step records say about communication overlap, torch-free (the monitor and the
simulator read it): the kinds of communication ``epscale.metrics.commclock.CommClock``
times and the median exposed share of a run's records.

A step record carries ``comm_s`` (in flight), ``comm_exposed_s`` (waited on),
``comm_exposed_share`` (exposed / mean step time) and ``comm_by_kind`` (kind -> ``s``,
``exposed_s``, ``exposed_share``, ``collectives``), each the mean over ranks.
"""

from __future__ import annotations

from statistics import median
from typing import Any, Sequence

# What each kind includes (a collective is timed from its issue; a blocking one is exposed
# whole, an asynchronous one while the rank sits in its wait()):
# dispatch: every exchange of the MoE layers' dispatchers (epscale.dispatch.comm): the token
#   and count all-to-alls of dispatch and combine, forward and backward; the allgather
#   backend's gathers and reduce-scatters; spill-over's count gather and row shipping.
# fsdp: FSDP2's parameter all-gathers (forward, and again for backward) and gradient
#   reduce-scatters. Not HSDP's replica all-reduce (FSDP2 issues it inside its reduction,
#   with no object to wrap): it is in no kind.
# dp: the replicated layout's gradient all-reduces after backward (epscale.parallel.grads,
#   with the redundant-expert replica sums): all of them under a pipeline or with
#   parallel.overlap: none. With overlap (pp = 1) the gradients are reduced during backward
#   in DDP's buckets: their all-reduces are timed in flight, but DDP's reducer waits for
#   them inside torch, so that wait is not counted as exposed. None under FSDP.
# pp: the pipeline schedule's point-to-point sends and receives (torch's _batch_p2p).
# In no kind: the step record's and the gradient norm's all-reduces, the balance and
# aux-loss all-reduces (a few numbers each), checkpoint, validation and re-placement traffic.
COMM_KINDS: tuple[str, ...] = ("dispatch", "fsdp", "dp", "pp")


def exposed_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Medians over step records of the exposed share (``comm_exposed_share``), of each
    kind's exposed share (kinds that sent anything), and of the share of the in-flight
    time hidden behind compute (1 - exposed / in flight); None when no record carries
    them (a run from before these fields)."""
    recs = [r for r in records if "comm_exposed_share" in r]
    if not recs:
        return None

    by_kind = {}
    for k in COMM_KINDS:
        ks = [r["comm_by_kind"][k] for r in recs if k in r.get("comm_by_kind", {})]
        if any(v["s"] > 0 for v in ks):
            by_kind[k] = median([float(v.get("exposed_share", 0.0)) for v in ks])
    hidden = [1.0 - r["comm_exposed_s"] / r["comm_s"] for r in recs if r.get("comm_s", 0) > 0]
    return {"exposed_share": median([float(r["comm_exposed_share"]) for r in recs]),
            "by_kind": by_kind, "hidden_frac": median(hidden) if hidden else 0.0}


def format_by_kind(by_kind: dict[str, float]) -> str:
    """'dispatch 40.1%, dp 6.7%' (or 'none')."""
    return ", ".join(f"{k} {100 * v:.1f}%" for k, v in by_kind.items()) or "none"
