"""epscale: pretraining Mixture-of-Experts models with expert parallelism, in PyTorch."""

from .config import ConfigError, MoEConfig
from .moe.layer import MoE
from .parallel import ParallelDims, parallelize
from .plan.layout import Layout

__version__ = "0.1.0"

__all__ = ["MoE", "MoEConfig", "ConfigError", "Layout", "ParallelDims", "parallelize",
           "__version__"]
