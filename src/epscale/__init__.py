"""epscale: pretraining Mixture-of-Experts models with expert parallelism, in PyTorch.

The layer and the parallelizing API (``MoE``, ``ParallelDims``, ``parallelize``) load on
first use, so commands that need no torch (``epscale monitor``, ``describe``) start
without importing it.
"""

import importlib

from .config import ConfigError, MoEConfig
from .plan.layout import Layout

__version__ = "0.1.0"

__all__ = ["MoE", "MoEConfig", "ConfigError", "Layout", "ParallelDims", "parallelize", "__version__"]

_LAZY = {"MoE": ".moe.layer", "ParallelDims": ".parallel", "parallelize": ".parallel"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'epscale' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
