"""The `config` layer: schema, YAML load and overrides, checks, FLOP and memory arithmetic.

Imports only `plan` below it (docs/architecture.md, "Layers").
"""

from megapipe.config.load import apply_override, from_dict, load_config, write_config
from megapipe.config.schema import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    Derived,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    RecomputeConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig", "Config", "ConfigError", "DataConfig", "Derived", "LogConfig",
    "ModelConfig", "ParallelConfig", "RecomputeConfig", "RunConfig", "TrainConfig",
    "apply_override", "from_dict", "load_config", "write_config",
]  # fmt: skip
