"""Parallelism: the process layout (``dims``), sharding MoE layers over expert
parallelism (``shard``) and the gradient rule across ranks (``grads``)."""

from ..dispatch.registry import DISPATCHERS, make_dispatcher
from .dims import ParallelDims
from .grads import sync_gradients
from .shard import is_expert_param, parallelize

__all__ = ["DISPATCHERS", "ParallelDims", "is_expert_param", "make_dispatcher", "parallelize",
           "sync_gradients"]
