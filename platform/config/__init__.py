"""The config layer: the typed experiment config (:mod:`.schema`), its algorithm section's base
(:mod:`.algorithm_config`) and loading (:mod:`.loading`). It imports no dataset, model or algorithm."""

from fedray.platform.config.algorithm_config import AlgorithmConfig, client_count, round_count
from fedray.platform.config.loading import Catalog, load_yaml, merge, parse_overrides, yaml_problem
from fedray.platform.config.schema import (
    DataConfig,
    EvalConfig,
    ExperimentConfig,
    LeafConfig,
    ModelConfig,
    PartitionConfig,
    RayConfig,
    SplitConfig,
    TrackingConfig,
    TrainConfig,
    build_dataclass,
    clients_per_round,
    config_yaml,
    flatten,
    scale,
    scaled_count,
    validate,
)

__all__ = [
    "AlgorithmConfig",
    "Catalog",
    "DataConfig",
    "EvalConfig",
    "ExperimentConfig",
    "LeafConfig",
    "ModelConfig",
    "PartitionConfig",
    "RayConfig",
    "SplitConfig",
    "TrackingConfig",
    "TrainConfig",
    "build_dataclass",
    "client_count",
    "clients_per_round",
    "config_yaml",
    "flatten",
    "load_yaml",
    "merge",
    "parse_overrides",
    "round_count",
    "scale",
    "scaled_count",
    "validate",
    "yaml_problem",
]
