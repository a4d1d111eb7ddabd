"""Configs: typed dataclasses (``schema``), checking and building them from plain data
(``validate``), YAML and ``key=value`` overrides (``io``), and recipes by file or name
(``recipes``). Import from here: ``from epscale.config import RunConfig, load_config``."""

from .io import apply_overrides, dump_yaml, load_yaml, parse_override, yaml_load
from .recipes import PUBLISHED, RECIPES, apply_scale, load_config, load_recipe, recipe_path, shrink
from .schema import (CpuKernelConfig, DataConfig, MetricsConfig, ModelConfig, MoEConfig,
                     ParallelConfig, RunConfig, TrainConfig)
from .validate import ConfigError, from_dict, to_dict

__all__ = [
    "ConfigError", "CpuKernelConfig", "DataConfig", "MetricsConfig", "ModelConfig", "MoEConfig",
    "ParallelConfig", "RunConfig", "TrainConfig", "PUBLISHED", "RECIPES", "apply_overrides",
    "apply_scale", "dump_yaml", "from_dict", "load_config", "load_recipe", "load_yaml",
    "parse_override", "recipe_path", "shrink", "to_dict", "yaml_load",
]
