"""The MoE layer and its parts."""

from .layer import MoE
from .router import RouterOutput, TopKRouter

__all__ = ["MoE", "TopKRouter", "RouterOutput"]
