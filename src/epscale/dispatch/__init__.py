"""Token dispatch/combine backends behind one interface (``base.Dispatcher``).

Backends, one file each: ``local`` (ep=1), ``allgather``, ``alltoall``, ``dedup`` (DeepEP
normal mode), ``hierarchical`` (DeepEP internode), ``deepep`` (the real DeepEP, CUDA
only). They share row operations (``rows``), the token layout (``layout``), the
collectives (``comm``) and, for chunked overlap, ``pipeline``. Build them by name through
``registry.make_dispatcher`` (``epscale.parallelize`` does it for every MoE layer).
"""

from .base import Dispatcher, EPDispatcher
from .layout import DispatchLayout, get_dispatch_layout
from .local import LocalDispatcher
from .registry import DISPATCHERS, PAYLOADS, make_dispatcher

__all__ = ["DISPATCHERS", "PAYLOADS", "Dispatcher", "EPDispatcher", "LocalDispatcher",
           "DispatchLayout", "get_dispatch_layout", "make_dispatcher"]
