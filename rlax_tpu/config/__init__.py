"""Typed, validated run configuration. Imports no JAX: the CLI reads configs first."""

from rlax_tpu.config.base import ConfigBase, ConfigError
from rlax_tpu.config.distribution import Distribution
from rlax_tpu.config.loader import load_config
from rlax_tpu.config.run import (
    DEFAULT_LOGICAL_AXIS_RULES,
    TPU_ACCELERATORS,
    TPU_CHIPS,
    AlgorithmConfig,
    ControllerConfig,
    DatasetConfig,
    DeployConfig,
    InferenceConfig,
    LoggingConfig,
    MeshConfig,
    ModelConfig,
    ParamServerConfig,
    RopeScalingConfig,
    RunConfig,
    StalenessConfig,
    StorageConfig,
    TpuSliceConfig,
    TrainerConfig,
    VerifierConfig,
    topology_chips,
)

__all__ = [
    "DEFAULT_LOGICAL_AXIS_RULES",
    "TPU_ACCELERATORS",
    "TPU_CHIPS",
    "AlgorithmConfig",
    "ConfigBase",
    "ConfigError",
    "ControllerConfig",
    "DatasetConfig",
    "DeployConfig",
    "Distribution",
    "InferenceConfig",
    "LoggingConfig",
    "MeshConfig",
    "ModelConfig",
    "ParamServerConfig",
    "RopeScalingConfig",
    "RunConfig",
    "StalenessConfig",
    "StorageConfig",
    "TpuSliceConfig",
    "TrainerConfig",
    "VerifierConfig",
    "load_config",
    "topology_chips",
]
