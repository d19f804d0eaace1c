"""A run's checkpoint: its folder and file names, where a new one goes, what it saves and loads,
and finding a run's to resume.

``<storage path>/<run name>-<time>-<random>/`` holds ``config.yaml`` (the run's config, written
before the MLflow run exists, whose tag points here), ``checkpoint.pt`` (the Coordinator's state
after a round: :func:`take_checkpoint`, :func:`write_checkpoint`, in a thread of its own:
:class:`CheckpointWriter`) and ``states/`` (the client states, each written by the worker that trained
it: :mod:`.state_store`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as NoAnswer  # the builtin's alias only from 3.11
from dataclasses import dataclass, field
from typing import Any

import torch

from fedray.platform.api.algorithm import Payload, Server, payload_nbytes
from fedray.platform.config import ExperimentConfig, config_yaml, yaml_mapping
from fedray.platform.errors import ConfigError, first_line
from fedray.platform.runtime import storage
from fedray.platform.runtime.state_store import StateStore
from fedray.platform.tracking.mlflow_run import run_name, run_to_resume
from fedray.platform.tracking.names import Metrics, RunKind, Tags

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
CONFIG_FILE = "config.yaml"


def checkpoint_file(directory: str) -> str:
    return storage.join(directory, CHECKPOINT_FILE)


def drop_partial_writes(directory: str) -> None:
    """As a run starts on its folder: the temporary file of a checkpoint whose writer was killed
    part way is never read (the last whole checkpoint is the truth)."""
    storage.clean_up(
        directory,
        lambda name: name.startswith(CHECKPOINT_FILE) and name.endswith(storage.PARTIAL),
        "a checkpoint cut short was",
    )


def has_checkpoint(directory: str) -> bool:
    return storage.exists(checkpoint_file(directory))


# object stores pyarrow reaches over the network: asking for one may look up a region or credentials
REMOTE_SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")


def is_remote(uri: str) -> bool:
    return "://" in uri and uri.split("://", 1)[0] in REMOTE_SCHEMES


# an object store's first answer (a region, credentials, the bucket); one that has none by then hangs
REMOTE_ANSWER_TIMEOUT_S = 30.0


def require_storage(cfg: ExperimentConfig) -> None:
    """A local storage path that cannot hold the run's folder fails in one line before Ray starts,
    not at the folder's making once the workers are up; so does a URI pyarrow cannot read, and an
    object store that cannot be reached (no network, no credentials, no Java for HDFS)."""
    uri = storage.resolve(cfg.storage_path)
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if is_remote(uri):
        require_remote_answer(f"storage_path={cfg.storage_path}", uri)
        return
    if scheme not in ("", "file", "local"):
        from pyarrow import fs

        try:  # a scheme pyarrow has no filesystem for fails here, as the URI is parsed
            fs.FileSystem.from_uri(uri)
        except Exception as err:  # pyarrow's ArrowInvalid: "Unrecognized filesystem type in URI"
            raise ConfigError(
                f"storage_path={cfg.storage_path}: {first_line(err)}; use a local folder, file://, "
                f"or an object store ({', '.join(f'{s}://' for s in REMOTE_SCHEMES)})"
            ) from None
        return
    try:
        path = storage.local_path(uri)
    except Exception as err:  # ArrowInvalid: file://relative/path, file://~/x
        raise ConfigError(
            f"storage_path={cfg.storage_path}: {first_line(err)}; a file:// URI is absolute (file:///home/...)"
        ) from None
    assert path is not None  # a plain path, file:// or local://
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"storage_path={cfg.storage_path}: cannot make the folder {path} ({err.strerror})"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"storage_path={cfg.storage_path}: the folder {path} cannot be written to")


def require_remote_answer(name: str, uri: str) -> None:
    """One look at the storage path in an object store, in a thread that is given up on after
    ``REMOTE_ANSWER_TIMEOUT_S`` (GCS without credentials waits minutes for a metadata server)."""
    answer: Future = Future()

    def look() -> None:
        try:
            storage.exists(uri)
            answer.set_result(None)
        except BaseException as err:  # pyarrow's OSError or ArrowException, whatever the store says
            answer.set_exception(err)

    threading.Thread(target=look, name="fedray-storage-check", daemon=True).start()
    try:
        answer.result(timeout=REMOTE_ANSWER_TIMEOUT_S)
    except NoAnswer:
        raise ConfigError(
            f"{name}: no answer from the object store in {REMOTE_ANSWER_TIMEOUT_S:.0f} s; "
            "check the network and the credentials, or use a local folder"
        ) from None
    except Exception as err:
        raise ConfigError(f"{name}: cannot be reached ({first_line(err)})") from None


def new_checkpoint_dir(cfg: ExperimentConfig) -> str:
    """``<storage path>/<run name>-<time>-<random>``, made before the MLflow run exists (its tag
    points here) and holding the run's config, so ``--resume`` needs nothing else."""
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    path = storage.join(storage.resolve(cfg.storage_path), f"{run_name(cfg)}-{stamp}")
    storage.make_dirs(path)
    storage.write_bytes(storage.join(path, CONFIG_FILE), config_yaml(cfg).encode(), durable=True)
    storage.flush_to_disk([path], files=False)  # the storage path's folder: the run's folder in it
    return path


def saved_config_mapping(directory: str) -> dict[str, Any]:
    """The run's ``config.yaml`` as it was written; one line if it is gone or is not a config."""
    path = storage.join(directory, CONFIG_FILE)
    name = f"the run's saved config {path!r}"
    try:
        data = storage.read_bytes(path)
    except FileNotFoundError:
        raise ConfigError(f"{name} is gone; the run cannot resume without it") from None
    except OSError as err:  # no permission, a folder in its place
        raise ConfigError(f"{name} cannot be read ({first_line(err)})") from None
    # empty, it would resume as the defaults: a different run
    return yaml_mapping(data, name, empty="it was cut short or overwritten")


def recorded_checkpoint(run) -> str | None:
    """The checkpoint folder an MLflow run recorded, if a checkpoint is there (None otherwise)."""
    path = run.data.tags.get(Tags.CHECKPOINT_DIR)
    if not path:
        return None
    if is_remote(path):  # an object store that does not answer would hang the look below
        require_remote_answer(f"the run's folder {path}", path)
    return path if has_checkpoint(path) else None


def checkpoint_dir_of(run_id: str, uri: str | None = None) -> str:
    """The checkpoint folder a run recorded, for ``fedray run --resume RUN_ID``; one line if none."""
    run = run_to_resume(run_id, uri)
    kind = run.data.tags.get(Tags.KIND)
    if kind == RunKind.SWEEP:
        raise ConfigError(
            f"--resume {run_id}: that is a sweep's parent run; resume the sweep with its command and "
            "--resume (fedray sweep --algo ... --resume), or a trial with its own run id"
        )
    if kind == RunKind.REPORT:
        raise ConfigError(f"--resume {run_id}: that is a report's run (fedray report), not a training run")
    if run.info.status == "FINISHED":
        raise ConfigError(f"--resume {run_id}: the run finished; there is nothing left to resume")
    path = recorded_checkpoint(run)
    if path is None:
        looked = run.data.tags.get(Tags.CHECKPOINT_DIR)
        raise ConfigError(f"--resume {run_id}: the run has no checkpoint to resume from (looked in {looked})")
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


@dataclass
class Checkpoint:
    """A round's checkpoint, taken (:func:`take_checkpoint`) and not yet written (:func:`write_checkpoint`)."""

    path: str  # the checkpoint file
    contents: memoryview  # its bytes: the server state, the store's manifest and the loop's record
    new_states: list[str] = field(default_factory=list)  # state files it lists that no landed one did


def take_checkpoint(
    directory: str, done: int, server: Server, store: StateStore, record: LoopRecord
) -> Checkpoint:
    """Everything the run holds after round ``done``, serialised now (the server and the record go on
    changing); the client states are on disk already, and the checkpoint lists their versions."""
    state = {
        "round": done,
        "server": server.state_dict(),
        "states": store.manifest(),
        "history": record.history,
        "cum": record.cum,
        "last_client_acc": record.client_acc,
        "torch_rng": torch.get_rng_state(),
    }
    return Checkpoint(checkpoint_file(directory), storage.torch_bytes(state), store.unlanded_files())


def write_checkpoint(checkpoint: Checkpoint) -> str:
    """The checkpoint file, atomically: a checkpoint cut short leaves the last one whole. The state
    files it lists reach the disk before it does, and it before this returns (the run then deletes
    the files only the last one listed): a host that crashes leaves a checkpoint to resume from.
    Returns its path."""
    storage.flush_to_disk(checkpoint.new_states)
    storage.write_bytes(checkpoint.path, checkpoint.contents, durable=True)
    return checkpoint.path


class CheckpointWriter:
    """Writes checkpoints in a thread of its own, one at a time, while the next rounds run: at 10,000
    clients, a checkpoint's 50 new client states of 3.35 MB took the Coordinator about 0.45 s, which
    every fifth round of 0.2 s waited for. A checkpoint is written before the next one is taken
    (:meth:`wait`), and a run waits for its last before it returns; a write that failed raises there."""

    def __init__(self, on_written: Callable[[int, str], None]) -> None:
        self.on_written = on_written
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self.pending: Future | None = None
        self.last_write_s = 0.0  # how long the last write took: about how long one on its way may take

    def busy_s(self) -> float:
        """About how long the checkpoint on its way (if any) still needs. Called from the driver's
        thread while the round thread may take ``pending``: read once."""
        pending = self.pending
        return self.last_write_s if pending is not None and not pending.done() else 0.0

    def submit(self, done: int, checkpoint: Checkpoint) -> None:
        self.wait()
        self.pending = self.executor.submit(self.write, done, checkpoint)

    def write(self, done: int, checkpoint: Checkpoint) -> Checkpoint:
        start = time.perf_counter()
        path = write_checkpoint(checkpoint)
        self.last_write_s = time.perf_counter() - start
        self.on_written(done, path)
        return checkpoint

    def wait(self, quietly: bool = False) -> Checkpoint | None:
        """Until the checkpoint on its way has landed, and that checkpoint (None: none was on its
        way); raises what its write raised, or with ``quietly`` (the run is failing already) logs it
        as a warning."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        try:
            return pending.result()
        except Exception as err:
            if not quietly:
                raise
            logger.warning("the last checkpoint was not written: %s", first_line(err))
            return None


def load_checkpoint(directory: str, server: Server, store: StateStore) -> tuple[int, LoopRecord]:
    """Restore the server and the store as the checkpoint left them; returns the rounds done and the
    record. The checkpoint is flushed to the disk first (its writer may have been killed before its
    last flush): the run goes on to delete what only the one before it listed."""
    path = checkpoint_file(directory)
    storage.flush_to_disk([path])
    state = storage.load_torch(path)
    server.load_state_dict(state["server"])
    store.read(directory, state["states"])
    torch.set_rng_state(state["torch_rng"])
    return state["round"], LoopRecord(state["history"], state["cum"], state["last_client_acc"])
