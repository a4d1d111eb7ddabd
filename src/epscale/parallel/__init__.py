"""Parallelism: the process layout (``dims``), sharding MoE layers over expert parallelism
(``shard``), FSDP2 over the rest (``fsdp``), pipeline stages (``pipeline``), activation
checkpointing (``activation``), materialising a meta-built model shard by shard
(``materialize``), the replicated layout's gradient rule (``grads``), and the one function
that applies them to a model in order (``apply.parallelize_model``)."""

from ..dispatch.registry import DISPATCHERS, make_dispatcher
from .activation import apply_activation_checkpointing
from .apply import Parallelized, parallelize_model
from .dims import ParallelDims
from .fsdp import apply_fsdp, finish_gradients
from .grads import sync_gradients
from .shard import is_expert_param, parallelize

__all__ = ["DISPATCHERS", "ParallelDims", "apply_activation_checkpointing", "apply_fsdp",
           "finish_gradients", "is_expert_param", "make_dispatcher", "Parallelized", "parallelize",
           "parallelize_model", "sync_gradients"]
