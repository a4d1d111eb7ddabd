"""Parallelism: the process layout (``dims``), sharding MoE layers over expert parallelism
(``shard``), FSDP2 over the rest (``fsdp``), layout-independent initial weights
(``materialize``), activation checkpointing (``activation``) and the replicated layout's
gradient rule (``grads``)."""

from ..dispatch.registry import DISPATCHERS, make_dispatcher
from .activation import apply_activation_checkpointing
from .dims import ParallelDims
from .fsdp import apply_fsdp, finish_gradients
from .grads import sync_gradients
from .shard import is_expert_param, parallelize

__all__ = ["DISPATCHERS", "ParallelDims", "apply_activation_checkpointing", "apply_fsdp",
           "finish_gradients", "is_expert_param", "make_dispatcher", "parallelize",
           "sync_gradients"]
