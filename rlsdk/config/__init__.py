"""Canonical config dataclasses, strict YAML loading and command-line overrides.

Importing this package does not import tyro; ``parse_cli`` imports it when called.
"""

from rlsdk.config.cli import parse_cli
from rlsdk.config.components import (
    AlgorithmConfig,
    ColocatedConfig,
    DataConfig,
    EmbeddedConfig,
    InferenceConfig,
    LaunchConfig,
    ModelConfig,
    ObserveConfig,
    RayConfig,
    RolloutConfig,
    SlurmConfig,
    TrainConfig,
    VLLMConfig,
)
from rlsdk.config.errors import ConfigDeprecationWarning, ConfigError
from rlsdk.config.io import config_from_dict, config_to_dict, load_config, merge_overrides, save_config
from rlsdk.config.session import SessionConfig

__all__ = [
    "AlgorithmConfig",
    "ColocatedConfig",
    "ConfigDeprecationWarning",
    "ConfigError",
    "DataConfig",
    "EmbeddedConfig",
    "InferenceConfig",
    "LaunchConfig",
    "ModelConfig",
    "ObserveConfig",
    "RayConfig",
    "RolloutConfig",
    "SessionConfig",
    "SlurmConfig",
    "TrainConfig",
    "VLLMConfig",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "merge_overrides",
    "parse_cli",
    "save_config",
]
