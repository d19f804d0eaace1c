"""``run_experiment(config) -> Result``: the one call used by the CLI, the sweeps and the tests.

The driver validates the config and builds the partition before Ray starts (so bad input fails
fast), puts the shards in Ray's object store, starts the Coordinator and streams its events to the
progress display and to MLflow. ``resume_experiment(run_id)`` continues an interrupted run from its
last checkpoint, logging into the same MLflow run.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from fedray.platform.config import ExperimentConfig, load_config, save_yaml
from fedray.platform.data import (
    Federation,
    build_federation,
    check_data,
    histogram_heatmap,
    load_dataset,
    majority_baseline,
    write_split,
)
from fedray.platform.progress import Progress, mb
from fedray.platform.tracking import TAG_CHECKPOINT, RunTracker, checkpoint_dir_of, run_name
from fedray.platform.transport import use_fast_tensor_transport

FINAL_KEYS = ("acc/personal_mean", "acc/personal_std", "acc/personal_weighted", "acc/global")
BEST_KEYS = ("acc/personal_mean", "acc/personal_weighted", "acc/global")


@dataclass
class Result:
    run_id: str
    experiment_id: str
    config: ExperimentConfig
    history: list[dict[str, float]]
    client_acc: dict[int, float]
    finished: bool
    wall_time_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def last(self, key: str) -> float | None:
        """The latest logged value of a metric (evaluation metrics are not logged every round)."""
        for metrics in reversed(self.history):
            if key in metrics:
                return metrics[key]
        return None

    def best(self, key: str) -> float | None:
        values = [m[key] for m in self.history if key in m]
        return max(values) if values else None

    def best_round(self, key: str) -> int | None:
        """The round (1-based, as logged) of the best value; the first one on ties."""
        rounds = [(m[key], -i) for i, m in enumerate(self.history, start=1) if key in m]
        return -max(rounds)[1] if rounds else None

    @property
    def final(self) -> dict[str, float | None]:
        return {key: self.last(key) for key in FINAL_KEYS}

    def summary_row(self) -> dict[str, Any]:
        f = self.final
        std = f["acc/personal_std"]
        pers = (
            None
            if f["acc/personal_mean"] is None
            else f"{100 * f['acc/personal_mean']:.2f} ± {100 * (std or 0):.2f}"
        )
        baseline = self.extra.get("acc/majority_baseline")
        return {
            "algorithm": self.config.algorithm,
            "personal acc %": pers,
            "majority baseline %": None
            if baseline is None or math.isnan(baseline)
            else round(100 * baseline, 2),
            "global acc %": None if f["acc/global"] is None else round(100 * f["acc/global"], 2),
            "MB up": round(mb(self.last("comm/up_bytes_cum") or 0), 3),
            "MB down": round(mb(self.last("comm/down_bytes_cum") or 0), 3),
            "wall s": round(self.wall_time_s, 1),
            "run id": self.run_id,
        }


# --------------------------------------------------------------------------------------------- pieces


def prepare_federation(cfg: ExperimentConfig) -> Federation:
    """Validate the data side and partition it; everything here runs before Ray starts."""
    check_data(cfg.data)
    return build_federation(load_dataset(cfg.data), cfg.data, cfg.seed)


def federation_meta(fed: Federation) -> dict[str, Any]:
    return {
        "num_classes": fed.num_classes,
        "in_channels": fed.in_channels,
        "image_size": fed.image_size,
        "mean": fed.mean,
        "std": fed.std,
        "train_sizes": [len(shard.train) for shard in fed.shards],
    }


# Ray prestarts its worker processes at ray.init; preloading the client module there means torch,
# Lightning and torchvision (about 4 s of imports per process) are loaded while the driver is still
# partitioning data, not after the first ClientActor lands on a worker.
PRELOAD = {"preload_python_modules": ["fedray.platform.client"]}

# A Coordinator process started by ensure_ray(spare_coordinator=True), keyed by the Ray job that owns it.
_spare_coordinators: dict[str, Any] = {}


def ensure_ray(cfg: ExperimentConfig, *, spare_coordinator: bool = False) -> None:
    """Join ``RAY_ADDRESS`` / ``ray.address`` if given; otherwise start a local Ray with this machine's CPUs.

    Ray prestarts one worker process per CPU for the ClientActors; ``spare_coordinator`` also starts
    the next run's Coordinator process now, for drivers that start Ray ahead of their runs (notebooks,
    benchmarks), so that run does not wait for a process to boot and import torch and Lightning.
    """
    import ray

    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS") or cfg.ray.address
        kwargs: dict[str, Any] = {
            "include_dashboard": False,
            "logging_level": logging.ERROR,
            "log_to_driver": os.environ.get("FEDRAY_RAY_LOGS", "0") == "1",
        }
        if address:
            ray.init(address=address, **kwargs)
        else:
            ray.init(num_cpus=cfg.ray.num_cpus or os.cpu_count(), _system_config=PRELOAD, **kwargs)
    use_fast_tensor_transport()  # the shards and the global test set leave as raw bytes
    job = ray.get_runtime_context().get_job_id()
    if spare_coordinator and job not in _spare_coordinators:
        from fedray.platform.coordinator import Coordinator

        _spare_coordinators.clear()  # handles from an earlier Ray session are dead
        _spare_coordinators[job] = Coordinator.remote()


def take_coordinator(placement_group=None):
    """The spare Coordinator of this Ray session when there is one (outside Tune's placement
    groups), else a new one."""
    import ray

    from fedray.platform.coordinator import Coordinator, scheduling

    if placement_group is None:
        spare = _spare_coordinators.pop(ray.get_runtime_context().get_job_id(), None)
        if spare is not None:
            return spare
    return Coordinator.options(**scheduling(placement_group)).remote()


def log_partition(tracker: RunTracker, fed: Federation, baseline: dict[str, float]) -> None:
    """The class histogram (table and heatmap), the split itself (re-runnable elsewhere with
    ``data.partition.kind=file``) and the majority-label reference accuracy."""
    tracker.log_table(fed.histogram_table(), "partition.csv")
    with tempfile.TemporaryDirectory() as tmp:
        histogram_heatmap(fed, Path(tmp) / "partition.png")
        tracker.log_file(Path(tmp) / "partition.png")
        write_split(fed, Path(tmp) / "split.json")
        tracker.log_file(Path(tmp) / "split.json")
    tracker.log_metrics(baseline, step=0)


def baseline_metrics(fed: Federation) -> dict[str, float]:
    """Each client predicting its most frequent training label: the reference every personalised
    accuracy is read against under label skew. NaN when no client has test data."""
    plain, weighted, _ = majority_baseline(fed)
    return {"acc/majority_baseline": plain, "acc/majority_baseline_weighted": weighted}


# --------------------------------------------------------------------------------------------- driver


def run_experiment(
    cfg: ExperimentConfig,
    *,
    resume_run_id: str | None = None,
    stop_after_round: int | None = None,
    parent_run_id: str | None = None,
    tags: dict[str, str] | None = None,
    on_round: Callable[[int, dict[str, float]], None] | None = None,
    placement_group=None,
    num_actors: int | None = None,
) -> Result:
    """Run (or resume) one federated experiment end to end and return its numbers.

    ``stop_after_round`` stops after that many rounds as an interruption would (the MLflow run is
    left KILLED, the checkpoint stays); ``on_round`` sees every round's metrics (Ray Tune reporting).
    """
    import ray

    from fedray.platform.coordinator import pool_size, start_client_actors

    fed = prepare_federation(cfg)  # config and data errors surface here, before Ray
    baseline = baseline_metrics(fed)
    ensure_ray(cfg)
    meta = federation_meta(fed)
    size = num_actors or pool_size(cfg, ray.available_resources() or ray.cluster_resources())
    actors = start_client_actors(cfg, meta, size, placement_group)
    coordinator = take_coordinator(placement_group)
    ready = coordinator.setup.remote(
        cfg, meta, [ray.put(shard) for shard in fed.shards], ray.put(fed.global_test), actors
    )
    start = time.perf_counter()
    status, tracker = "FAILED", None
    try:
        ray.get(ready)  # algorithm and client set-up errors surface here
        if resume_run_id is not None:
            tracker = RunTracker(cfg, run_id=resume_run_id, parent_run_id=parent_run_id, extra_tags=tags)
            ckpt_dir = checkpoint_dir_of(resume_run_id, tracker.uri)
            ray.get(coordinator.load_checkpoint.remote(str(ckpt_dir)))
            run_ref = coordinator.run.remote(str(ckpt_dir), stop_after_round)
        else:
            ckpt_dir = new_checkpoint_dir(cfg)
            # the rounds start now; the MLflow run is set up while the first one trains, and the
            # events wait in the Coordinator's queue until the driver streams them
            run_ref = coordinator.run.remote(str(ckpt_dir), stop_after_round)
            tracker = RunTracker(cfg, parent_run_id=parent_run_id, extra_tags=tags)
            tracker.set_tags({TAG_CHECKPOINT: str(ckpt_dir)})
            tracker.log_params(cfg)
            tracker.log_config(cfg)
            log_partition(tracker, fed, baseline)
        with Progress(cfg.rounds, f"{cfg.algorithm} on {cfg.data.dataset}", enabled=cfg.progress) as progress:
            done = False
            while not done:
                done = bool(ray.wait([run_ref], timeout=0)[0])
                for event in ray.get(coordinator.poll.remote(0.0 if done else 0.5)):
                    progress.handle(event)
                    if event["type"] == "round_end":
                        tracker.log_metrics(event["metrics"], step=event["round"])
                        if on_round is not None:
                            on_round(event["round"], event["metrics"])
        summary = ray.get(run_ref)
        result = Result(
            tracker.run_id,
            tracker.experiment_id,
            cfg,
            summary["history"],
            summary["client_acc"],
            summary["finished"],
            time.perf_counter() - start,
            extra=baseline,
        )
        if summary["finished"]:
            log_final(tracker, result, summary["global_model"], ray.get(coordinator.client_models.remote()))
            status = "FINISHED"
        else:
            status = "KILLED"
        return result
    except KeyboardInterrupt:
        status = "KILLED"
        if tracker is not None:
            print(f"\ninterrupted: resume with  fedray run --resume {tracker.run_id}", flush=True)
        raise
    finally:
        if tracker is not None:
            tracker.end(status)
        for actor in [coordinator, *actors]:
            ray.kill(actor)


def new_checkpoint_dir(cfg: ExperimentConfig) -> Path:
    """``output_dir/<run name>-<time>-<random>``, made before the MLflow run exists (its tag points here)."""
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    path = Path(cfg.output_dir).resolve() / f"{run_name(cfg)}-{stamp}"
    path.mkdir(parents=True)
    save_yaml(cfg, path / "config.yaml")
    return path


def log_final(tracker: RunTracker, result: Result, global_model, client_models) -> None:
    """Per-client final accuracies, the final global model and every client's model."""
    frame = pd.DataFrame(
        [{"client": cid, "accuracy": acc} for cid, acc in sorted(result.client_acc.items())],
        columns=["client", "accuracy"],
    )
    tracker.log_table(frame, "client_accuracy.csv")
    if global_model is not None:
        tracker.log_torch(global_model, "global_model.pt")
    tracker.log_torch(client_models, "client_models.pt")
    final = {}
    for key in BEST_KEYS:
        name = key.split("/", 1)[1]
        final[f"best/{name}"] = result.best(key)
        final[f"best_round/{name}"] = result.best_round(key)
        final[f"final/{name}"] = result.last(key)
    tracker.log_metrics({k: v for k, v in final.items() if v is not None}, step=len(result.history))


def resume_experiment(run_id: str, **kwargs: Any) -> Result:
    """Continue an interrupted run from its last checkpoint, to the same final numbers."""
    cfg = load_config(checkpoint_dir_of(run_id) / "config.yaml")
    return run_experiment(cfg, resume_run_id=run_id, **kwargs)
