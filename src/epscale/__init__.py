"""epscale: pretraining Mixture-of-Experts models with expert parallelism, in PyTorch."""

from .config import ConfigError, MoEConfig
from .moe.layer import MoE

__version__ = "0.1.0"

__all__ = ["MoE", "MoEConfig", "ConfigError", "__version__"]
