"""Typed recipe schema, YAML loading with dotted overrides, validation with clear errors."""

from moerl.config.loader import ConfigError, apply_overrides, load_config, parse_override, validate_config
from moerl.config.schema import (
    AlgorithmConfig,
    DataConfig,
    EvalConfig,
    HFModelConfig,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    RecipeConfig,
    RolloutConfig,
    SFTConfig,
    TrainConfig,
)

__all__ = [
    "AlgorithmConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "HFModelConfig",
    "LogConfig",
    "ModelConfig",
    "ParallelConfig",
    "RecipeConfig",
    "RolloutConfig",
    "SFTConfig",
    "TrainConfig",
    "apply_overrides",
    "load_config",
    "parse_override",
    "validate_config",
]
