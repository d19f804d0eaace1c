"""A run's checkpoint: its folder and file names, where a new one goes, what it saves and loads,
and finding a run's to resume.

``<storage path>/<run name>-<time>-<random>/`` holds ``config.yaml`` (the run's config, written
before the MLflow run exists, whose tag points here), ``checkpoint.pt`` (the Coordinator's state
after a round: :func:`save_checkpoint`) and ``states/`` (client states spilled by the store).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from fedray.platform.api.algorithm import Payload, Server, payload_nbytes
from fedray.platform.config import ExperimentConfig, config_yaml
from fedray.platform.errors import ConfigError
from fedray.platform.runtime import storage
from fedray.platform.runtime.state_store import StateStore
from fedray.platform.tracking.mlflow_run import recorded_checkpoint_dir, run_name
from fedray.platform.tracking.names import Metrics

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


@dataclass
class LoopRecord:
    """What the round loop accumulates besides the server and the client states: the rounds' metrics,
    the bytes sent each way so far, and each evaluated client's last accuracy."""

    history: list[dict[str, float]] = field(default_factory=list)
    cum: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0})
    client_acc: dict[int, float] = field(default_factory=dict)

    def count_traffic(self, uplinks: Iterable[Payload], downlinks: Iterable[Payload]) -> dict[str, float]:
        """A round's bytes each way, and the run's so far, as metrics."""
        up, down = sum(map(payload_nbytes, uplinks)), sum(map(payload_nbytes, downlinks))
        self.cum["up"] += up
        self.cum["down"] += down
        return {
            Metrics.COMM_UP_BYTES: up,
            Metrics.COMM_DOWN_BYTES: down,
            Metrics.COMM_UP_BYTES_CUM: self.cum["up"],
            Metrics.COMM_DOWN_BYTES_CUM: self.cum["down"],
        }


def save_checkpoint(directory: str, done: int, server: Server, store: StateStore, record: LoopRecord) -> str:
    """The committed store (only states new since the last checkpoint are written), the server state
    and the loop's record after round ``done``; the checkpoint file lands atomically, last. Returns its path."""
    state = {
        "round": done,
        "server": server.state_dict(),
        "states": store.write(directory),
        "history": record.history,
        "cum": record.cum,
        "last_client_acc": record.client_acc,
        "torch_rng": torch.get_rng_state(),
    }
    path = checkpoint_file(directory)
    storage.save_torch(state, path)
    store.prune(directory)
    return path


def load_checkpoint(directory: str, server: Server, store: StateStore) -> tuple[int, LoopRecord]:
    """Restore the server and the store as the checkpoint left them; returns the rounds done and the record."""
    state = storage.load_torch(checkpoint_file(directory))
    server.load_state_dict(state["server"])
    store.read(directory, state["states"])
    torch.set_rng_state(state["torch_rng"])
    return state["round"], LoopRecord(state["history"], state["cum"], state["last_client_acc"])
