"""Token dispatch/combine backends behind one interface (see ``base.Dispatcher``).

Backends: ``local`` (ep=1), ``allgather``, ``alltoall``, ``dedup`` (DeepEP normal mode),
``hierarchical`` (DeepEP internode), ``deepep`` (the real DeepEP, CUDA only). Build them
through ``epscale.parallelize`` / ``epscale.parallel.make_dispatcher``; ``layout`` computes
where tokens go.
"""

from .base import Dispatcher
from .layout import DispatchLayout, get_dispatch_layout
from .local import LocalDispatcher

__all__ = ["Dispatcher", "LocalDispatcher", "DispatchLayout", "get_dispatch_layout"]
