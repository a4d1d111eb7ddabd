"""The MoE layer and its parts: router, experts, losses, loss-free balance, the slow
reference every fast path is tested against."""

from .layer import MoE, moe_layers, named_moe_layers
from .router import RouterOutput, TopKRouter

__all__ = ["MoE", "TopKRouter", "RouterOutput", "moe_layers", "named_moe_layers"]
