"""A run's checkpoint folder: its file names, where a new one goes, and finding a run's to resume.

``<storage path>/<run name>-<time>-<random>/`` holds ``config.yaml`` (the run's config, written
before the MLflow run exists, whose tag points here), ``checkpoint.pt`` (the Coordinator's state
after a round, written by the Coordinator) and ``states/`` (client states spilled by the store).
"""

from __future__ import annotations

import time
import uuid

from fedray.platform.config import ExperimentConfig, config_yaml
from fedray.platform.errors import ConfigError
from fedray.platform.runtime import storage
from fedray.platform.tracking.mlflow_run import recorded_checkpoint_dir, run_name

CHECKPOINT_FILE = "checkpoint.pt"
CONFIG_FILE = "config.yaml"


def checkpoint_file(directory: str) -> str:
    return storage.join(directory, CHECKPOINT_FILE)


def has_checkpoint(directory: str) -> bool:
    return storage.exists(checkpoint_file(directory))


def new_checkpoint_dir(cfg: ExperimentConfig) -> str:
    """``<storage path>/<run name>-<time>-<random>``, made before the MLflow run exists (its tag
    points here) and holding the run's config, so ``--resume`` needs nothing else."""
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    path = storage.join(storage.resolve(cfg.storage_path), f"{run_name(cfg)}-{stamp}")
    storage.make_dirs(path)
    storage.write_bytes(storage.join(path, CONFIG_FILE), config_yaml(cfg).encode())
    return path


def saved_config_text(directory: str) -> str:
    return storage.read_bytes(storage.join(directory, CONFIG_FILE)).decode()


def checkpoint_dir_of(run_id: str, uri: str | None = None) -> str:
    """The checkpoint folder a run recorded, for ``fedray run --resume RUN_ID``; one line if none."""
    path = recorded_checkpoint_dir(run_id, uri)
    if not path or not has_checkpoint(path):
        raise ConfigError(f"--resume {run_id}: the run has no checkpoint to resume from (looked in {path})")
    return path
