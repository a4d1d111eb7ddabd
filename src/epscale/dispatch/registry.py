"""Backends by name: which exist, which payloads each can send, and building one for a
MoE layer over a :class:`~epscale.parallel.ParallelDims` layout.

``parallel.dispatcher`` names one of :data:`DISPATCHERS`; ``parallel.payload`` one of
:data:`PAYLOADS`. Each layer gets its own backend (and its own byte counter); 'deepep'
layers share the process's one :class:`~.deepep.DeepEPBuffer`.
"""

from __future__ import annotations

import difflib

from ..config import ConfigError
from ..plan.layout import Dims
from .allgather import AllGatherDispatcher
from .alltoall import AllToAllDispatcher
from .base import Dispatcher
from .comm import CommCounter, group_info
from .dedup import DedupDispatcher
from .deepep import DeepEPBuffer, DeepEPDispatcher, require_deepep
from .hierarchical import HierarchicalDispatcher
from .local import LocalDispatcher

DISPATCHERS = ("local", "allgather", "alltoall", "dedup", "hierarchical", "deepep")
PAYLOADS = ("auto", "bf16", "fp8")
_EP_BACKENDS = {"allgather": AllGatherDispatcher, "alltoall": AllToAllDispatcher,
                "dedup": DedupDispatcher, "hierarchical": HierarchicalDispatcher}


def check_deepep_ep(name: str, ep: int) -> None:
    """ConfigError when 'deepep' is chosen without expert parallelism."""
    if name == "deepep" and ep == 1:
        raise ConfigError("parallel key 'dispatcher' = 'deepep' needs ep > 1 (got ep=1): with "
                          "one EP rank there is nothing to exchange; use dispatcher='local'")


def check_choice(name: str, payload: str = "auto", overlap_chunks: int = 1,
                 ep: int | None = None) -> None:
    """ConfigError naming the key when ``parallel.dispatcher`` / ``payload`` /
    ``overlap_chunks`` (and ``ep``, when given) cannot work together (before anything is
    built)."""
    if name not in DISPATCHERS:
        close = difflib.get_close_matches(str(name), DISPATCHERS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"parallel key 'dispatcher' = {name!r} is invalid: must be one of "
                          f"{', '.join(map(repr, DISPATCHERS))}{hint}")
    if not isinstance(overlap_chunks, int) or isinstance(overlap_chunks, bool) or overlap_chunks < 1:
        raise ConfigError(f"parallel key 'overlap_chunks' = {overlap_chunks!r} is invalid: "
                          "must be a positive integer")
    if payload not in PAYLOADS:
        raise ConfigError(f"parallel key 'payload' = {payload!r} is invalid: must be one of "
                          f"{', '.join(map(repr, PAYLOADS))}")
    sends = _EP_BACKENDS[name].payloads if name in _EP_BACKENDS else ("auto", "bf16")
    if payload not in sends:
        fp8 = [n for n, cls in _EP_BACKENDS.items() if "fp8" in cls.payloads]
        raise ConfigError(f"parallel key 'payload' = {payload!r} needs dispatcher "
                          f"{' or '.join(map(repr, fp8))} (got {name!r}, which sends "
                          f"{', '.join(map(repr, sends))})")
    if ep is not None:
        check_deepep_ep(name, ep)
    if name == "deepep":
        require_deepep()


def make_dispatcher(name: str, num_experts: int, dims: Dims, payload: str = "auto",
                    overlap_chunks: int = 1, workspace=None, dropless: bool = False,
                    deepep_buffer: DeepEPBuffer | None = None) -> Dispatcher:
    """Build the named backend for one MoE layer with ``num_experts`` experts over the EP
    group of ``dims`` (its own byte counter). ``workspace``: a row-buffer cache for the CPU
    path (see :class:`~epscale.dispatch.base.Dispatcher`), or None. With ep=1 every name
    but 'deepep' gives the communication-free local backend; ``dropless`` (the layer's
    router never drops) spares it its host sync (:class:`~.local.LocalDispatcher`).
    'deepep' needs ep > 1 and ``deepep_buffer``, the process's one buffer, sized for its
    widest layer (``epscale.parallelize`` builds it)."""
    check_choice(name, payload, overlap_chunks, dims.ep)
    if name == "local" and dims.ep != 1:
        raise ConfigError(f"parallel key 'dispatcher' = 'local' needs ep=1 (got ep={dims.ep}); "
                          "choose 'alltoall', 'dedup', 'allgather' or 'hierarchical'")
    if name == "deepep":
        if deepep_buffer is None:
            raise ValueError("make_dispatcher('deepep') needs deepep_buffer: the process's one "
                             "DeepEPBuffer, sized for its widest MoE layer (epscale.parallelize "
                             "builds it)")
        return DeepEPDispatcher(num_experts, dims, deepep_buffer, workspace)
    if dims.ep == 1:
        return LocalDispatcher(num_experts, workspace=workspace, dropless=dropless)
    counter = CommCounter()
    ep_info = group_info(dims, "ep", counter)
    if name == "hierarchical":
        return HierarchicalDispatcher(num_experts, ep_info, group_info(dims, "ep_inter", counter),
                                      group_info(dims, "ep_intra", counter), payload,
                                      overlap_chunks, workspace)
    if name == "dedup":
        return DedupDispatcher(num_experts, ep_info, payload, overlap_chunks, workspace)
    return _EP_BACKENDS[name](num_experts, ep_info, payload, workspace)
